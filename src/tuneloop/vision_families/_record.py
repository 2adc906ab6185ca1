"""The record a vision-language family file declares (see the package's docstring for where each field is read)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# (model config, tower layers, the run's image processor or None) -> VisionWeights' shape fields (plan/flops.py):
# how many positions the vision tower runs per image and how far each attends; {"why_not": ...} where not counted
TowerShape = Callable[[object, int, object], dict]


@dataclass(frozen=True, kw_only=True)
class KnownVisionFamily:
    """What a config's name says: the model type config.json holds, and the hub ids that name the family."""

    name: str  # the model type (config.json's model_type); the key everything else is found by
    words: str  # the family in words, for messages and the lists of families
    hub_ids: tuple[str, ...]  # regular expressions (case-insensitive) a hub id naming the family contains
    hub_examples: tuple[str, ...] = ()  # hub ids the patterns must give this family (a test holds them)


@dataclass(frozen=True, kw_only=True)
class UntrainedFamily(KnownVisionFamily):
    """A family tuneloop knows by name and does not train: `check` refuses it, naming the family and why."""

    why_not: str = ""  # why, where it is more than "not yet"
    needs: str = ""  # the library it would need that tuneloop does not depend on (torchvision, timm)


@dataclass(frozen=True, kw_only=True)
class VisionFamily(KnownVisionFamily):
    """A family tuneloop trains: how its images become text and tokens, its vision modules and its tower's FLOPs."""

    placeholder: str  # what a message's text holds where an image part was (the model's chat template writes it)
    image_token: str  # the token the processor repeats once per image token
    framing: tuple[str, ...]  # tokens around an image (vision start/end): never trained either
    vision_modules: tuple[str, ...]  # module-name parts of the vision tower and projector (`freeze_mm_modules`)
    # module-name parts, within those, of what runs once per image token, not per tower position (the projector,
    # a merger): plan/flops.py counts them so
    projector_parts: tuple[str, ...]
    # how the processor writes one image's text in place of the marker (`layout`, data/images.py expands it):
    # "repeat" (the image token, as many times as the image has tokens), "gemma3" (start/end of image around its
    # soft tokens, blank lines either side), "tiles" (Idefics3/SmolVLM: a row-col tag and tokens per tile, then
    # the global image), "cross" (Mllama: the one token stays; the decoder reads the image through
    # cross-attention), "framed" (InternVL: the two framing tokens around the image token, as many times as the
    # image's tiles have tokens), "rows" (Mistral 3's Pixtral: per row of the resized image a row of image tokens
    # and [IMG_BREAK], the last break [IMG_END]) or "soft" (Gemma 4: start and end of image around as many soft
    # tokens as the image, resized within the image processor's budget, has pooled patches)
    layout: str = "repeat"
    marker: str = ""  # the token the chat text holds per image, which the processor replaces ("": image_token)
    nested: bool = False  # the image processor takes each row's images as one list (its tensors are per row)
    # settings the family's processor gives its image processor on every call (InternVL's crop_to_patches, which
    # its preprocessor_config.json leaves off): given here too, so the image processor alone (its processor needs
    # torchvision) cuts the same tiles
    image_kwargs: tuple[tuple[str, object], ...] = ()
    # `sample_packing` keeps each packed sequence apart: the family's decoder takes plain positions (restarting per
    # sequence) and its image features replace the image tokens in order. Not Qwen's multimodal rotary positions
    # (computed from a row's images as one sequence), Gemma 3's bidirectional image attention (its mask is built
    # from the whole row) or Mllama's cross-attention (a row's text reads the row's images)
    packs: bool = False
    # the processor setting that makes an image fewer tokens, offered when an image alone is longer than
    # sequence_len (`{pixels}`: a max_pixels that fits; doubled braces are literal); None: every image is the
    # same number of tokens
    shrink: str | None = None
    tower_shape: TowerShape | None = None  # None: the plan says the tower is not counted

    @property
    def text_marker(self) -> str:
        return self.marker or self.image_token
