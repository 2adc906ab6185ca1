"""LLaVA: a CLIP (or SigLIP) tower's patches, projected; <image> repeated once per image token."""

from tuneloop.vision_families._record import VisionFamily
from tuneloop.vision_families._towers import whole_crop

FAMILIES = (
    VisionFamily(name="llava", words="LLaVA", hub_ids=(r"llava",), hub_examples=("llava-hf/llava-1.5-7b-hf",),
                 placeholder="<image>\n", image_token="<image>", framing=(),
                 vision_modules=("vision_tower", "multi_modal_projector"), projector_parts=("multi_modal_projector",),
                 packs=True,
                 shrink=None,  # (every image is the tower's crop: the same tokens whatever its size)
                 tower_shape=whole_crop),
)
