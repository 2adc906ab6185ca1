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
                                      UNTRAINED_FAMILIES, VISION_FAMILIES, VISION_FAMILY_WHY_NOT, family_named_by)


def vision_keys(cfg) -> list[str]:
    """The keys that ask for a vision-language model, as the config writes them (`model_type: ...`)."""
    model_type = cfg.model_type or ""
    vision_class = model_type == "AutoModelForImageTextToText" or (
        model_type.endswith("ForConditionalGeneration") and not model_type.startswith(("T5", "MT5", "UMT5", "Bart")))
    return [f"{key}: {getattr(cfg, key)}" for key, asks in (("model_type", vision_class),
                                                            ("processor_type", cfg.processor_type),
                                                            ("freeze_mm_modules", cfg.freeze_mm_modules)) if asks]


def asks_for_vision(cfg) -> bool:
    return bool(vision_keys(cfg))


def local_text_model(cfg) -> tuple[str, Path] | None:
    """(model type, config.json) where `base_model` is a local folder whose config.json is a text model's: no
    `vision_config` (what model/kinds.py reads when the model loads) and no vision family's model type."""
    local = Path(cfg.base_model or cfg.base_model_config or "").expanduser() / "config.json"
    try:
        config = json.loads(local.read_text()) if local.is_file() else None
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("vision_config") is not None:
        return None
    model_type = config.get("model_type")
    if not model_type or model_type in VISION_FAMILIES or model_type in UNTRAINED_FAMILIES:
        return None
    return model_type, local


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
