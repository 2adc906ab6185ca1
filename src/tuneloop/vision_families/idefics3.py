"""Idefics3 and SmolVLM (its successor, the same model type's arithmetic): images split into tiles, then the global
image. Each tile is written as a row-col tag and its tokens; a SigLIP tower per tile, pixel-shuffled scale_factor² to a
token by the connector."""

from tuneloop.vision_families._record import VisionFamily


def tiles(config, layers: int, image_processor=None) -> dict:
    """Tile by tile: scale_factor² positions per image token, each attending within its tile's patches."""
    vision = config.vision_config
    return {"positions_per_token": config.scale_factor ** 2, "context": (vision.image_size // vision.patch_size) ** 2}


IDEFICS3 = dict(placeholder="<image>", image_token="<image>",
                framing=("<fake_token_around_image>", "<global-img>",
                         *(f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7))),
                vision_modules=("vision_model", "connector"), projector_parts=("connector",), layout="tiles",
                nested=True, packs=True,
                shrink="processor_kwargs: {{do_image_splitting: false}} (one tile per image) or image_size",
                tower_shape=tiles)

FAMILIES = (
    VisionFamily(name="idefics3", words="Idefics3", hub_ids=(r"idefics3",),
                 hub_examples=("HuggingFaceM4/Idefics3-8B-Llama3",), **IDEFICS3),
    VisionFamily(name="smolvlm", words="SmolVLM", hub_ids=(r"smolvlm",),
                 hub_examples=("HuggingFaceTB/SmolVLM2-2.2B-Instruct",), **IDEFICS3),
)
