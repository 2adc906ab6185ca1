"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 (its vision half, on a hybrid linear-attention decoder). One image text
(<|image_pad|> per merged patch between vision start and end) and M-RoPE over the row; the tower, its merger inside
(`visual`), runs the patch grid before the 2×2 merge."""

from dataclasses import replace

from tuneloop.vision_families._record import VisionFamily
from tuneloop.vision_families._towers import merged_patch_grid


def windowed_patch_grid(config, layers: int, image_processor=None) -> dict:
    """Qwen2.5-VL: the merged patch grid, its windowed blocks attending within windows of (window_size /
    patch_size)² positions (an upper bound where a window at an image's edge is cut short), the others over the
    whole image."""
    vision = config.vision_config
    merge = vision.spatial_merge_size
    window_side = (vision.window_size // merge // vision.patch_size) * merge  # patches along a window's side
    return {"positions_per_token": merge ** 2, "window": window_side ** 2,
            "full_layers": tuple(vision.fullatt_block_indexes or range(layers))}


QWEN2_VL = VisionFamily(
    name="qwen2_vl", words="Qwen2-VL", hub_ids=(r"qwen2-vl",), hub_examples=("Qwen/Qwen2-VL-2B-Instruct",),
    placeholder="<|vision_start|><|image_pad|><|vision_end|>", image_token="<|image_pad|>",
    framing=("<|vision_start|>", "<|vision_end|>"), vision_modules=("visual",), projector_parts=("merger",),
    shrink="processor_kwargs: {{max_pixels: {pixels}}} (an image is about max_pixels / 784 tokens) or image_size",
    tower_shape=merged_patch_grid)
# Qwen3-VL: 16-pixel patches, about max_pixels / 1024 tokens (so the max_pixels offered is on the safe side), and
# its DeepStack mergers, per image token too, each over a middle layer's merged patches
QWEN3_VL = replace(QWEN2_VL, name="qwen3_vl", words="Qwen3-VL", hub_ids=(r"qwen3-vl",),
                   hub_examples=("Qwen/Qwen3-VL-8B-Instruct",), shrink=QWEN2_VL.shrink.replace("784", "1024"),
                   projector_parts=("merger", "deepstack_merger_list"))
# Qwen3.5: Qwen3-VL's image side without DeepStack
QWEN3_5 = replace(QWEN3_VL, name="qwen3_5", words="Qwen3.5", hub_ids=(r"qwen3\.5|qwen3_5",),
                  hub_examples=("Qwen/Qwen3.5-9B",), projector_parts=("merger",))

FAMILIES = (
    QWEN2_VL,
    replace(QWEN2_VL, name="qwen2_5_vl", words="Qwen2.5-VL", hub_ids=(r"qwen2\.5-vl",),
            hub_examples=("Qwen/Qwen2.5-VL-7B-Instruct",), tower_shape=windowed_patch_grid),
    QWEN3_VL,
    # (Qwen3-VL-30B-A3B, -235B-A22B: the same on a mixture of experts; its longer match wins over qwen3_vl's)
    replace(QWEN3_VL, name="qwen3_vl_moe", hub_ids=(r"qwen3-vl-\d+b-a\d+b",),
            hub_examples=("Qwen/Qwen3-VL-30B-A3B-Instruct", "Qwen/Qwen3-VL-235B-A22B-Thinking")),
    QWEN3_5,
    # (Qwen3.5-35B-A3B: the same on a mixture of experts; its hub ids read as qwen3_5's, whose `check` is the same)
    replace(QWEN3_5, name="qwen3_5_moe", hub_ids=(), hub_examples=()),
)
