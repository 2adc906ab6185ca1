"""GLM-4.1V and GLM-4.5V/4.6V: Qwen2-VL's arithmetic under their own image tokens. GLM-4.5V/4.6V are glm4v_moe, a
mixture of experts (GLM-4.6V-Flash is dense, GLM-4.1V's architecture); 14-pixel patches are merged 2×2 by the tower's
downsampling convolution and merger, both in `visual`, and M-RoPE runs over the row."""

from dataclasses import replace

from tuneloop.vision_families._record import VisionFamily
from tuneloop.vision_families._towers import merged_patch_grid

GLM4V = VisionFamily(
    # (any GLM-4.xV but glm4v_moe's GLM-4.5V and GLM-4.6V; GLM-4.6V-Flash is this one)
    name="glm4v", words="GLM-4.1V", hub_ids=(r"glm-4\.(?![56]v(?!-flash))\dv",),
    hub_examples=("zai-org/GLM-4.1V-9B-Thinking", "zai-org/GLM-4.6V-Flash"),
    placeholder="<|begin_of_image|><|image|><|end_of_image|>", image_token="<|image|>",
    framing=("<|begin_of_image|>", "<|end_of_image|>"), vision_modules=("visual",),
    projector_parts=("downsample", "merger"),  # (its 2×2 convolution after the blocks, and the merger: per token)
    # (its size bounds the pixels of 2 frames (an image counts twice), 784 pixels an image token)
    shrink="processor_kwargs: {{size: {{shortest_edge: 12544, longest_edge: {pixels}}}}} (an image is about "
           "longest_edge / 1568 tokens) or image_size",
    tower_shape=merged_patch_grid)

FAMILIES = (
    GLM4V,
    replace(GLM4V, name="glm4v_moe", words="GLM-4.5V / GLM-4.6V", hub_ids=(r"glm-4\.[56]v(?!-flash)",),
            hub_examples=("zai-org/GLM-4.5V", "zai-org/GLM-4.6V")),
)
