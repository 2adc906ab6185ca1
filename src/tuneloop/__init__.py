"""tuneloop: fine-tune Hugging Face language models from one YAML file."""

__version__ = "0.1.0"
