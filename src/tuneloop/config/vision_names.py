"""Which vision-language family a config names, read from the config alone (`check` imports no torch and opens no
model): the model's own config.json where `base_model` is a local folder, else the family its hub id names.

A vision-language run is recognised by `processor_type` or a vision-language `model_type`. Its family decides
whether tuneloop can train it (data/images.py's VISION_FAMILIES); `check` refuses the families it knows by name
and cannot train, naming the family, so that "accepted by check" means what it says. A name it does not know is
accepted: the model's config decides when `plan` or `train` reads it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

# model types tuneloop trains (data/images.py's VISION_FAMILIES; kept here too so `check` stays torch-free: a test
# holds the two equal)
TRAINED_VISION_TYPES = ("llava", "qwen2_vl", "qwen2_5_vl", "gemma3", "gemma4", "idefics3", "smolvlm", "mllama",
                        "mistral3", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "internvl", "paddleocr_vl",
                        "glm4v", "glm4v_moe")
TRAINED_VISION_WORDS = ("LLaVA, Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5, InternVL, Gemma 3 / Gemma 4, "
                        "Idefics3 / SmolVLM, "
                        "Llama 3.2 Vision (Mllama), PaddleOCR-VL, GLM-4.1V / GLM-4.5V / GLM-4.6V and "
                        "Mistral 3 (Pixtral vision)")
# families tuneloop knows and does not train, with why where it is more than "not yet" (`check` and the model's
# config say it)
VISION_FAMILY_WHY_NOT = {
    # (timm builds MobileNetV5 on torchvision: it installs torchvision with it)
    "gemma3n": "Gemma 3n's vision tower is timm's MobileNetV5, and timm needs torchvision, which tuneloop does not "
               "depend on (its audio side is not trained either)",
    "gemma4_unified": "the image processor of Gemma 4 unified (gemma-4-12B) is in transformers only as a torchvision "
                      "one, with no PIL twin, and tuneloop reads images without torchvision (not one of its "
                      "dependencies)",
    "lfm2_vl": "LFM2-VL's image processor is in transformers only as a torchvision one, with no PIL twin, and "
               "tuneloop reads images without torchvision (not one of its dependencies)",
    "llama4": "Llama 4's image processor (its tiles and their image text) is in transformers only as a torchvision "
              "one, with no PIL twin, and tuneloop reads images without torchvision (not one of its dependencies)",
}

# hub-id patterns (case-insensitive) -> (model type, family in words); the first match wins
FAMILY_NAMES = (
    (r"qwen2\.5-vl", "qwen2_5_vl", "Qwen2.5-VL"),
    (r"qwen2-vl", "qwen2_vl", "Qwen2-VL"),
    (r"llava", "llava", "LLaVA"),
    (r"qwen3\.5|qwen3_5", "qwen3_5", "Qwen3.5 (vision)"),
    (r"qwen3-vl-\d+b-a\d+b", "qwen3_vl_moe", "Qwen3-VL (mixture of experts)"),  # (Qwen3-VL-30B-A3B, -235B-A22B)
    (r"qwen3-vl", "qwen3_vl", "Qwen3-VL"),
    (r"gemma-3n", "gemma3n", "Gemma 3n"),
    (r"gemma-4-12b", "gemma4_unified", "Gemma 4 unified"),  # (transformers' gemma4_unified: google/gemma-4-12B-it)
    (r"gemma-4", "gemma4", "Gemma 4"),
    (r"gemma-3", "gemma3", "Gemma 3"),
    (r"llama-3\.2-\d+b-vision", "mllama", "Llama 3.2 Vision (Mllama)"),
    (r"llama-4", "llama4", "Llama 4"),
    (r"internvl", "internvl", "InternVL"),
    (r"smolvlm", "smolvlm", "SmolVLM"),
    (r"idefics3", "idefics3", "Idefics3"),
    (r"idefics", "idefics2", "Idefics / Idefics2"),
    (r"ministral-3|mistral-small-3|mistral-medium|pixtral|magistral", "mistral3", "Mistral 3 / Pixtral"),
    (r"lfm2-vl", "lfm2_vl", "LFM2-VL"),
    (r"paddleocr-vl", "paddleocr_vl", "PaddleOCR-VL"),
    (r"voxtral", "voxtral", "Voxtral (audio)"),
    # (GLM-4.5V/4.6V: a mixture of experts; GLM-4.6V-Flash is dense, GLM-4.1V's architecture)
    (r"glm-4\.[56]v(?!-flash)", "glm4v_moe", "GLM-4.5V / GLM-4.6V"),
    (r"glm-4\.\dv", "glm4v", "GLM-4V"),
)


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
    for pattern, model_type, words in FAMILY_NAMES:
        if re.search(pattern, source, flags=re.IGNORECASE):
            return model_type, words, "its hub id"
    return None
