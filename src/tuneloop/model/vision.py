"""A vision-language run's settings: what it cannot do yet, the processor its tokenizer carries, which families
pack, and the vision tower frozen (`freeze_mm_modules`)."""

from __future__ import annotations

from tuneloop.config import TuneloopConfig
from tuneloop.errors import UserError
from tuneloop.model.kinds import VISION_LANGUAGE, ModelKind
from tuneloop.model.model_config import model_config

def check_vision_settings(cfg: TuneloopConfig, kind: ModelKind | None) -> None:
    """What a vision-language run cannot do yet, refused before any data is read; and the image keys refused on
    a text-only model (accepted and ignored, they would say the run does what it does not)."""
    source = cfg.base_model or cfg.base_model_config
    if kind != VISION_LANGUAGE:
        for key in ("processor_type", "freeze_mm_modules", "processor_kwargs", "image_size", "image_resize_algorithm"):
            if getattr(cfg, key):
                raise UserError(f"config: `{key}: {getattr(cfg, key)}` is for vision-language models, and {source} "
                                "is a text-only model: remove it")
        return
    refused = {"rl": "is preference training; tuneloop does not train vision-language models on preference "
                     "pairs yet",
               "reward_model": "puts a score head on a text decoder; not on a vision-language model",
               "pretraining_dataset": "streams raw text; a vision-language model trains on chat rows with images",
               "streaming": "streams rows; a vision-language model's rows are prepared whole (their images are "
                            "read lazily per micro-batch)"}
    for key, why in refused.items():
        if getattr(cfg, key, None):
            raise UserError(f"config: `{key}: {getattr(cfg, key)}` {why} ({source} is a vision-language model)")
    if cfg.image_resize_algorithm and cfg.image_size is None:  # (axolotl then takes the vision config's image_size)
        raise UserError(f"config: `image_resize_algorithm: {cfg.image_resize_algorithm}` is the filter `image_size` "
                        "resizes with, and image_size is not set: set it (an int pads each image to that square, "
                        "[width, height] stretches it), or remove image_resize_algorithm")

def attach_image_inputs(cfg: TuneloopConfig, kind: ModelKind | None, tokenizer) -> None:
    """A vision-language run's processor, carried by its tokenizer to preparing, collating and saving
    (data/images.py: image_inputs_of)."""
    check_vision_settings(cfg, kind)
    if kind == VISION_LANGUAGE:
        from tuneloop.data.images import load_image_inputs

        image_inputs = load_image_inputs(cfg, model_config(cfg, tokenizer), tokenizer)
        check_vision_packing(cfg, image_inputs.family)
        tokenizer.tuneloop_image_inputs = image_inputs

def check_vision_packing(cfg: TuneloopConfig, family) -> None:
    """`sample_packing` on a vision-language model: the families whose packed sequences stay apart
    (vision_families: VisionFamily.packs), refused naming the family for the others."""
    from tuneloop.vision_families import packing_families

    for key in ("sample_packing", "eval_sample_packing"):
        if getattr(cfg, key) and not family.packs:
            raise UserError(f"config: `{key}: {getattr(cfg, key)}` packs rows, and a {family.name} model's packed "
                            "sequences are not kept apart yet (its image positions or image attention span the "
                            f"whole row); families that pack: {packing_families()}. Set it to false (axolotl's "
                            "configs do); `group_by_length: true` reclaims most of the padding")

def freeze_vision_modules(cfg: TuneloopConfig, model) -> None:
    """`freeze_mm_modules`: the vision tower and projector frozen (each family's record names them: vision_families/)."""
    from tuneloop.data.images import vision_family

    parts = vision_family(model.config, cfg.base_model or cfg.base_model_config).vision_modules
    for name, parameter in model.named_parameters():
        if any(part in name.split(".") for part in parts):
            parameter.requires_grad_(False)
