"""Llama 3.2 Vision (Mllama): the <|image|> token stays one token; the decoder reads the image's tiles through
cross-attention layers (a row's text reads the row's images, so its rows do not pack)."""

from tuneloop.vision_families._record import VisionFamily

FAMILIES = (
    VisionFamily(name="mllama", words="Llama 3.2 Vision (Mllama)", hub_ids=(r"llama-3\.2-\d+b-vision",),
                 hub_examples=("meta-llama/Llama-3.2-11B-Vision-Instruct",),
                 placeholder="<|image|>", image_token="<|image|>", framing=(),
                 vision_modules=("vision_model", "multi_modal_projector"), projector_parts=("multi_modal_projector",),
                 layout="cross", nested=True,
                 shrink=None,  # (every image is one token)
                 tower_shape=None),  # (its tiled tower with gated cross-attention layers is not counted yet)
)
