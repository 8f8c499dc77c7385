"""hf_scale: instruction fine-tuning of LLaMA-2-class models that stays inside the Hugging Face Trainer."""

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.trainer import ScaleTrainer

__version__ = "0.1.0"
__all__ = ["ScaleTrainer", "ScaleTrainingArguments"]
