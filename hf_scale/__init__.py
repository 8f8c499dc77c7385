"""hf_scale: instruction fine-tuning of LLaMA-2-class models that stays inside the Hugging Face Trainer."""

__version__ = "0.1.0"
