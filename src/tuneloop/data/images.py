"""Images in chat rows, for vision-language models: the one place that reads, sizes and expands them.

A row's image parts (`{"type": "image", "path" | "url" | "base64" | "image": ...}`) become references
(`path:/abs/file.png`, `base64:...`): the token cache keeps those, never pixels. Preparing reads each image's
size from its header (PIL opens lazily: no pixels decoded) and asks the model's processor how many image tokens
that size becomes, so the cached rows hold their final length and the plan's counts are exact. The collator
decodes and processes a micro-batch's images only when it needs them (ImageInputs.pixel_inputs).

A family (VisionFamily) says what the chat text writes for an image, which token the processor repeats for it,
which tokens frame it (never trained), and which modules are the vision tower and projector
(`freeze_mm_modules`). Families not listed are refused by name.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from dataclasses import dataclass
from pathlib import Path

from tuneloop.errors import UserError

MULTIMODAL_FEATURE = "multimodal models"  # config/axolotl.py's FEATURES["multimodal"][0]


@dataclass(frozen=True)
class VisionFamily:
    name: str
    placeholder: str  # what a message's text holds where an image part was (the model's chat template writes it)
    image_token: str  # the token the processor repeats once per image token
    framing: tuple[str, ...]  # tokens around an image (vision start/end): never trained either
    vision_modules: tuple[str, ...]  # module-name parts of the vision tower and projector (`freeze_mm_modules`)


_QWEN_VL = dict(placeholder="<|vision_start|><|image_pad|><|vision_end|>", image_token="<|image_pad|>",
                framing=("<|vision_start|>", "<|vision_end|>"), vision_modules=("visual",))  # (the merger is in it)
VISION_FAMILIES = {
    "llava": VisionFamily("llava", "<image>\n", "<image>", (), ("vision_tower", "multi_modal_projector")),
    "qwen2_vl": VisionFamily("qwen2_vl", **_QWEN_VL),
    "qwen2_5_vl": VisionFamily("qwen2_5_vl", **_QWEN_VL),
}


def is_vision_config(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def vision_family(config, source: str) -> VisionFamily:
    """The family of a vision-language model's config; others are refused naming their model type."""
    family = VISION_FAMILIES.get(getattr(config, "model_type", None))
    if family is None:
        raise UserError(f"model: {source} is a {config.model_type} vision-language model; tuneloop trains "
                        f"{', '.join(VISION_FAMILIES)} so far, and this family asks for {MULTIMODAL_FEATURE}, which "
                        "tuneloop does not do yet")
    return family


# ---- references: where an image part's image is -------------------------------------------------------------
IMAGE_KEYS = ("path", "url", "base64", "image")


def image_reference(part: dict, where: str, base_dir: Path) -> str:
    """An image part as a reference the cache can keep: `path:` an absolute file, or `base64:` the bytes. A
    relative path is relative to the data file's folder; http(s) URLs are refused (no network at run time)."""
    value = next((part[key] for key in IMAGE_KEYS if isinstance(part.get(key), str) and part[key]), None)
    if value is None:
        raise UserError(f"data: {where}: an image part needs one of {', '.join(IMAGE_KEYS)} (a path, a file: URL or "
                        f"base64 text); got keys {', '.join(sorted(part))}")
    if part.get("base64") == value or value.startswith("data:"):
        return "base64:" + value.split(",", 1)[-1] if value.startswith("data:") else "base64:" + value
    if value.startswith(("http://", "https://")):
        raise UserError(f"data: {where}: image {value} is a web address; tuneloop reads no network at run time: "
                        "download the image and give its path")
    path = Path(value.removeprefix("file://").removeprefix("file:")).expanduser()
    path = path if path.is_absolute() else base_dir / path
    if not path.is_file():
        raise UserError(f"data: {where}: image file {path} does not exist; fix the path (relative paths are "
                        "relative to the data file's folder)")
    return f"path:{path}"


def open_image(reference: str, where: str = ""):
    """The image a reference names, lazily (PIL reads the header now, the pixels when asked)."""
    from PIL import Image, UnidentifiedImageError

    kind, _, value = reference.partition(":")
    try:
        if kind == "base64":
            return Image.open(io.BytesIO(base64.b64decode(value, validate=True)))
        return Image.open(value)
    except (OSError, UnidentifiedImageError, binascii.Error, ValueError) as error:
        shown = value if kind == "path" else "(base64 data)"
        raise UserError(f"data: {where or 'a row'}: cannot read image {shown}: {error}") from None


def image_size(reference: str, where: str) -> tuple[int, int]:
    """(height, width) from the image's header, without decoding its pixels."""
    with open_image(reference, where) as image:
        return image.height, image.width


def expand_images(text: str, spans: list[tuple[int, int]], image_token: str,
                  counts: list[int]) -> tuple[str, list[tuple[int, int]]]:
    """The text with its i-th image token repeated counts[i] times (what the processor does), the trained
    character spans moved to match."""
    pieces, shifts, at = [], [], 0
    for count in counts:
        found = text.index(image_token, at)
        pieces += [text[at:found], image_token * count]
        shifts.append((found + len(image_token), len(image_token) * (count - 1)))
        at = found + len(image_token)
    pieces.append(text[at:])

    def moved(position: int) -> int:
        return position + sum(extra for after, extra in shifts if position >= after)

    return "".join(pieces), [(moved(start), moved(end)) for start, end in spans]


# ---- the model's processor, as preparing and collating use it ----------------------------------------------
@dataclass
class ImageInputs:
    """A vision-language model's image side: its processor (or, where transformers cannot build the whole
    processor on this machine, its image processor: Qwen2-VL's needs torchvision for videos), its family, and
    the token ids never trained."""

    family: VisionFamily
    image_processor: object
    processor: object | None  # the whole processor, saved with the model
    never_trained: tuple[int, ...]  # the image token's and the framing tokens' ids

    def tokens_for(self, height: int, width: int) -> int:
        """How many image tokens an image of this size becomes: the processor's own arithmetic."""
        if self.processor is not None and hasattr(self.processor, "_get_num_multimodal_tokens"):
            return int(self.processor._get_num_multimodal_tokens(image_sizes=[(height, width)])["num_image_tokens"][0])
        # Qwen2-VL's image processor alone: its patch grid, merge_size × merge_size patches to a token
        patches = self.image_processor.get_number_of_image_patches(height, width, {})
        return patches // self.image_processor.merge_size ** 2

    def pixel_inputs(self, references: list[str]) -> dict:
        """The model's image inputs (pixel_values, and the grid where the family has one) for these images."""
        images = []
        for reference in references:
            with open_image(reference) as image:
                images.append(image.convert("RGB"))
        return dict(self.image_processor(images=images, return_tensors="pt"))

    def save(self, folder: Path) -> None:
        """The processor beside the model, so AutoProcessor reloads it (the image processor where only it loaded)."""
        (self.processor or self.image_processor).save_pretrained(folder)


def load_image_inputs(cfg, config, tokenizer) -> ImageInputs:
    """The processor of the base model (`processor_type`, AutoProcessor by default), with the run's tokenizer."""
    import transformers

    source = cfg.base_model or cfg.base_model_config
    family = vision_family(config, source)
    name = cfg.processor_type or "AutoProcessor"
    processor_class = getattr(transformers, name, None)
    if processor_class is None or not (name == "AutoProcessor"
                                       or isinstance(processor_class, type) and issubclass(processor_class,
                                                                                           transformers.ProcessorMixin)):
        raise UserError(f"config: `processor_type: {name}` is not a processor class transformers has; use "
                        "AutoProcessor (or leave it out)")
    processor = None
    try:
        processor = processor_class.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
        image_processor = processor.image_processor
    except (AttributeError, ImportError) as error:  # a video processor transformers cannot build without torchvision
        image_processor = _image_processor_alone(source, cfg, error)
    except (OSError, ValueError, TypeError) as error:
        raise UserError(f"model: cannot load a processor from {source!r} as {name}: {error}") from None
    if processor is not None:
        processor.tokenizer = tokenizer  # the run's (its added tokens and template), saved with it
    ids = [tokenizer.convert_tokens_to_ids(token) for token in (family.image_token, *family.framing)]
    if tokenizer.unk_token_id in ids or None in ids:
        raise UserError(f"model: the tokenizer of {source} lacks the {family.name} image tokens "
                        f"({family.image_token} {' '.join(family.framing)}); use the model's own tokenizer")
    return ImageInputs(family, image_processor, processor, tuple(ids))


def _image_processor_alone(source: str, cfg, error: Exception):
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError, TypeError) as second:
        raise UserError(f"model: cannot load the processor of {source!r} ({type(error).__name__}: {error}) nor its "
                        f"image processor ({second})") from None


def image_inputs_of(tokenizer) -> ImageInputs | None:
    """The run's image side, carried by its tokenizer (set by run.py for a vision-language model)."""
    return getattr(tokenizer, "tuneloop_image_inputs", None)


def references_json(references: list[tuple[str, int]]) -> str:
    """A row's images as the cache keeps them: (reference, image tokens) in the order the text holds them."""
    return json.dumps([[reference, count] for reference, count in references])
