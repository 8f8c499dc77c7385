"""The embedded tiny default: a tiny LLaMA, its tokenizer and generated instruction tasks."""

from hf_scale.tiny.build import ensure_tiny_model
from hf_scale.tiny.tasks import generate_conversation_tasks, generate_tasks

__all__ = ["ensure_tiny_model", "generate_conversation_tasks", "generate_tasks"]
