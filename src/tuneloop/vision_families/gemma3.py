"""Gemma 3: its template writes <start_of_image> for an image; the processor writes soft tokens after it, framed by
start and end of image (blank lines either side). A SigLIP tower over a fixed crop, pooled to mm_tokens_per_image."""

from tuneloop.vision_families._record import VisionFamily
from tuneloop.vision_families._towers import whole_crop

FAMILIES = (
    VisionFamily(name="gemma3", words="Gemma 3", hub_ids=(r"gemma-3",), hub_examples=("google/gemma-3-4b-it",),
                 placeholder="<start_of_image>", image_token="<image_soft_token>",
                 framing=("<start_of_image>", "<end_of_image>"),
                 vision_modules=("vision_tower", "multi_modal_projector"),
                 projector_parts=("multi_modal_projector",),  # (a bare projection matrix, pooled patches in)
                 layout="gemma3", marker="<start_of_image>",
                 shrink=None,  # (every image is mm_tokens_per_image soft tokens)
                 tower_shape=whole_crop),
)
