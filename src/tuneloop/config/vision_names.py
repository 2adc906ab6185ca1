"""Which vision-language family a config names, read from the config alone. `check` imports no torch and opens no model:
the family is the model's own config.json's where `base_model` is a local folder, else the one its hub id names.

A vision-language run is recognised by `processor_type` or a vision-language `model_type`. Its family decides
whether tuneloop can train it (the records of tuneloop/vision_families/, torch-free); `check` refuses the families
it knows by name and cannot train, naming the family, so that "accepted by check" means what it says. A name it
does not know is accepted: the model's config decides when `plan` or `train` reads it.
"""

from __future__ import annotations

import json
from pathlib import Path

from tuneloop.vision_families import (TRAINED_VISION_TYPES, TRAINED_VISION_WORDS,  # noqa: F401 (read from here)
                                      VISION_FAMILY_WHY_NOT, family_named_by)


def asks_for_vision(cfg) -> bool:
    model_type = cfg.model_type or ""
    return bool(cfg.processor_type or cfg.freeze_mm_modules or model_type == "AutoModelForImageTextToText"
                or (model_type.endswith("ForConditionalGeneration") and not model_type.startswith(("T5", "MT5",
                                                                                                   "UMT5", "Bart"))))


def named_vision_family(cfg) -> tuple[str, str, str] | None:
    """(model type, family in words, how it was found) for a vision-language config, or None when neither the
    local config.json nor the hub id says."""
    source = cfg.base_model or cfg.base_model_config or ""
    local = Path(source).expanduser() / "config.json"
    if local.is_file():
        try:
            model_type = json.loads(local.read_text()).get("model_type")
        except (OSError, ValueError):
            return None
        return (model_type, model_type, f"{local}") if model_type else None
    family = family_named_by(source)
    return (family.name, family.words, "its hub id") if family else None
