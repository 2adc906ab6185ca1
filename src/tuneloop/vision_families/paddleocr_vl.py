"""PaddleOCR-VL (a NaViT tower on ERNIE-4.5): Qwen2-VL's arithmetic (14-pixel patches, 2×2 merged to a token by its
projector) and M-RoPE over the row, under its own image tokens."""

from tuneloop.vision_families._record import VisionFamily
from tuneloop.vision_families._towers import merged_patch_grid

FAMILIES = (
    VisionFamily(name="paddleocr_vl", words="PaddleOCR-VL", hub_ids=(r"paddleocr-vl",),
                 hub_examples=("PaddlePaddle/PaddleOCR-VL",),
                 placeholder="<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>", image_token="<|IMAGE_PLACEHOLDER|>",
                 framing=("<|IMAGE_START|>", "<|IMAGE_END|>"), vision_modules=("visual", "projector"),
                 projector_parts=("projector",),  # (its 2×2 patch merge and MLP, once per image token)
                 # (max_pixels is its image processor's too, 784 pixels an image token)
                 shrink="processor_kwargs: {{max_pixels: {pixels}}} (an image is about max_pixels / 784 tokens) or "
                        "image_size",
                 tower_shape=merged_patch_grid),  # (its tower runs the patch grid, each image apart)
)
