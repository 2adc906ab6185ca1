"""The model a run trains: its kind (kinds.py), its transformers config and class (model_config.py), its tokenizer
(tokenizer.py), a vision-language run's settings (vision.py), and the model loaded or built (load.py)."""
