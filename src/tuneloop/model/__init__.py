"""The model a run trains: its kind, its config and class, its tokenizer, a vision-language run's settings, and the
model loaded or built. One module each: kinds.py, model_config.py, tokenizer.py, vision.py, load.py."""
