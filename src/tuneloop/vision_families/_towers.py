"""Tower shapes several families share (VisionFamily.tower_shape; plan/flops.py's notes say how they are counted).
Read from the model config alone: no torch here (`check` imports this package)."""

from __future__ import annotations


def whole_crop(config, layers: int, image_processor=None) -> dict:
    """LLaVA's CLIP and Gemma 3's SigLIP: every patch of the image's fixed crop (and CLIP's class position)."""
    vision = config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    cls = 1 if vision.model_type == "clip_vision_model" else 0  # (CLIP's class position; SigLIP has none)
    return {"fixed_positions": patches + cls, "cls": cls}


def merged_patch_grid(config, layers: int, image_processor=None) -> dict:
    """Qwen2-VL's arithmetic: the patch grid before the merge, spatial_merge_size² positions per image token, every
    block attending over the whole image."""
    return {"positions_per_token": config.vision_config.spatial_merge_size ** 2}


def side(size) -> int:
    """A square's side, where a config gives it as one number or as (height, width) (InternVL's)."""
    return size if isinstance(size, int) else size[0]
