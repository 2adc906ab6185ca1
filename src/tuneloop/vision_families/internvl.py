"""InternVL 3/3.5 (transformers' -hf layout): an image as the context tokens of its tiles. Its template writes
<IMG_CONTEXT> for an image; the processor writes <img>, the context tokens of the image's tiles (its thumbnail too when
it has more than one), </img>."""

from tuneloop.vision_families._record import VisionFamily
from tuneloop.vision_families._towers import side


def tile_by_tile(config, layers: int, image_processor=None) -> dict:
    """Tile by tile: its patches, downsample_ratio along each side (0.5: 4 patches a token), and a class position,
    which the tile's patches attend to as well."""
    vision = config.vision_config
    patches, per_token = (side(vision.image_size) // side(vision.patch_size)) ** 2, round(
        1 / config.downsample_ratio ** 2)
    return {"positions_per_token": per_token, "cls": 1, "tile_tokens": patches // per_token, "context": patches + 1}


FAMILIES = (
    VisionFamily(name="internvl", words="InternVL", hub_ids=(r"internvl",),
                 hub_examples=("OpenGVLab/InternVL3_5-8B-HF",),
                 placeholder="<IMG_CONTEXT>\n", image_token="<IMG_CONTEXT>", framing=("<img>", "</img>"),
                 vision_modules=("vision_tower", "multi_modal_projector"), projector_parts=("multi_modal_projector",),
                 layout="framed",
                 image_kwargs=(("crop_to_patches", True),), packs=True,
                 shrink="processor_kwargs: {{max_patches: 1}} (one tile per image)", tower_shape=tile_by_tile),
)
