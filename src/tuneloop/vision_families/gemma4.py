"""Gemma 4 (gemma-4-E2B/E4B/26B-A4B/31B): a soft token per pooled patch of the image. Its template writes <|image|> for
an image; the processor writes <|image>, a soft token per pooled patch of the image (resized within the image
processor's max_soft_tokens), <image|>. Its vision tower and embed_vision, the projection into the decoder."""

from tuneloop.vision_families._record import VisionFamily


def padded_budget(config, layers: int, image_processor=None) -> dict:
    """Gemma 4: its image processor pads every image's patches to max_soft_tokens × pooling² (the budget the image
    was resized within), and the tower runs them all (the padding masked out of attention, not out of the
    matmuls); its pooler averages them into max_soft_tokens, of which the image's own are kept."""
    if image_processor is None:
        return {"why_not": "not counted for gemma4's vision tower without its image processor (the positions it runs "
                           "are the processor's max_soft_tokens)"}
    pooled = image_processor.max_soft_tokens
    return {"fixed_positions": pooled * config.vision_config.pooling_kernel_size ** 2, "pooled": pooled}


FAMILIES = (
    # (gemma-4-12B is Gemma 4 unified, another family: untrained.py; its longer match wins)
    VisionFamily(name="gemma4", words="Gemma 4", hub_ids=(r"gemma-4",), hub_examples=("google/gemma-4-E4B-it",),
                 placeholder="<|image|>", image_token="<|image|>", framing=("<|image>", "<image|>"),
                 vision_modules=("vision_tower", "embed_vision"), layout="soft",
                 projector_parts=("embed_vision",),  # (the projection of each soft token into the decoder)
                 # (every image is resized to fill max_soft_tokens (70, 140, 280, 560 or 1120), whatever its size)
                 shrink="processor_kwargs: {{max_soft_tokens: 70}} (at most 70 image tokens an image)",
                 tower_shape=padded_budget),
)
