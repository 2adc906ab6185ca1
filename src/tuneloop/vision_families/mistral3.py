"""Mistral 3 (Mistral-Small-3.1/3.2, Ministral 3, Mistral-Medium-3.5; Pixtral's vision): the merged patch grid, row by
row. [IMG] per token of the grid, each row ended by [IMG_BREAK] and the image by [IMG_END]; its vision tower and
projector (the patch merger is in it)."""

from tuneloop.vision_families._record import VisionFamily


def patch_grid_before_merger(config, layers: int, image_processor=None) -> dict:
    """Pixtral: the patch grid before the projector's patch merger, spatial_merge_size² patches a token."""
    return {"positions_per_token": config.spatial_merge_size ** 2}


FAMILIES = (
    VisionFamily(name="mistral3", words="Mistral 3 (Pixtral vision)",
                 hub_ids=(r"ministral-3|mistral-small-3|mistral-medium|pixtral|magistral",),
                 hub_examples=("mistralai/Mistral-Small-3.1-24B-Instruct-2503",
                               "mistralai/Ministral-3-8B-Instruct-2512"),
                 placeholder="[IMG]", image_token="[IMG]", framing=("[IMG_BREAK]", "[IMG_END]"),
                 vision_modules=("vision_tower", "multi_modal_projector"), layout="rows", packs=True,
                 projector_parts=("multi_modal_projector",),  # (its patch merger is in it)
                 # (an image whose longer side is N pixels is at most (N / 28)² image tokens: 14-pixel patches
                 # merged 2×2)
                 shrink="processor_kwargs: {{size: {{longest_edge: N}}}} (an image is at most (N / 28)² image tokens) "
                        "or image_size",
                 tower_shape=patch_grid_before_merger),
)
