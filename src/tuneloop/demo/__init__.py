"""Demo assets: the embedded default model and data, built from PyPI packages (see embedded.py)."""
