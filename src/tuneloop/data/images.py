"""Images in chat rows, for vision-language models: the one place that reads, sizes and expands them.

A row's image parts (`{"type": "image", "path" | "url" | "base64" | "image": ...}`) become references
(`path:/abs/file.png`, `base64:...`): the token cache keeps those, never pixels. Preparing reads each image's
size from its header (PIL opens lazily: no pixels decoded) and asks the model's processor what text that size
becomes (image tokens, and for some families tile tags, start/end tokens and newlines), so the cached rows hold
their final length and the plan's counts are exact. The collator decodes and processes a micro-batch's images only
when it needs them (ImageInputs.batch_inputs), with the tensors a family reads beside the pixels (Gemma 3's token
types, Mllama's cross-attention mask).

A family (VisionFamily, one file each in tuneloop/vision_families/) says what the chat text writes for an image,
how the processor expands it (`layout`, expanded here), which token it repeats, which tokens frame it (never
trained, nor is any of an image's text), and which modules are the vision tower and projector (`freeze_mm_modules`).
Families without a record are refused by name.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from dataclasses import dataclass
from pathlib import Path

from tuneloop.errors import UserError
# (VISION_FAMILIES is read from here too: the families this module expands)
from tuneloop.vision_families import VISION_FAMILIES, VISION_FAMILY_WHY_NOT, VisionFamily

MULTIMODAL_FEATURE = "multimodal models"  # config/axolotl.py's FEATURES["multimodal"][0]


def is_vision_config(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def vision_family(config, source: str) -> VisionFamily:
    """The family of a vision-language model's config; others are refused naming their model type."""
    family = VISION_FAMILIES.get(getattr(config, "model_type", None))
    if family is None:
        why = VISION_FAMILY_WHY_NOT.get(config.model_type)
        raise UserError(f"model: {source} is a {config.model_type} vision-language model; tuneloop trains "
                        f"{', '.join(VISION_FAMILIES)} so far, and this family asks for {MULTIMODAL_FEATURE}, which "
                        "tuneloop does not do yet" + (f": {why}" if why else ""))
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


IMAGES_COLUMN = "images"  # the column form: image parts without a source take the row's images in order


def row_image_references(parts: list[dict], row_values: dict, where: str, base_dir: Path) -> list[str]:
    """The references of a row's image parts, in the text's order. A part that names no image itself (`{"type":
    "image"}`, as in HuggingFaceH4/llava-instruct-mix-vsft and TRL's vision datasets) takes the next entry of the
    row's `images` column: a path, a file: URL or base64 text, or a datasets Image value ({"bytes", "path"}) as a
    parquet or Arrow file holds it. The counts must agree: a row with more parts than images (or fewer) names
    both."""
    column = row_values.get(IMAGES_COLUMN)
    column = [] if column is None else column if isinstance(column, list) else [column]
    named = [any(isinstance(part.get(key), str) and part[key] for key in IMAGE_KEYS) for part in parts]
    bare = named.count(False)
    if bare and bare != len(column):
        raise UserError(f"data: {where}: {bare} image part(s) name no image and the row's `{IMAGES_COLUMN}` column "
                        f"holds {len(column)}; give each part its image (path, url or base64), or as many images "
                        f"in `{IMAGES_COLUMN}` as parts without one")
    if column and not bare:
        raise UserError(f"data: {where}: the row's `{IMAGES_COLUMN}` column holds {len(column)} image(s) and no "
                        "message has an image part without its own source to take them: add `{\"type\": \"image\"}` "
                        "parts where the images go, or remove the column")
    taken = iter(column)
    return [image_reference(part if has_source else _as_part(next(taken), where, base_dir), where, base_dir)
            for part, has_source in zip(parts, named)]


def _as_part(value, where: str, base_dir: Path) -> dict:
    """An `images` column entry as an image part. A string is a URL (data:, file:, http), else a file where one
    exists, else base64 text where it decodes as such (else the path it was meant to be: refused as missing)."""
    if isinstance(value, dict) and isinstance(value.get("bytes"), (bytes, bytearray)):
        return {"base64": base64.b64encode(value["bytes"]).decode()}
    if isinstance(value, dict) and isinstance(value.get("path"), str):
        return {"path": value["path"]}
    if isinstance(value, str):
        if value.startswith(("data:", "file:", "http://", "https://")):
            return {"image": value}
        path = Path(value).expanduser()
        if (path if path.is_absolute() else base_dir / path).is_file() or not _is_base64(value):
            return {"path": value}
        return {"base64": value}
    if hasattr(value, "save") and hasattr(value, "size"):  # a PIL image (datasets decodes an Image column so)
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return {"base64": base64.b64encode(buffer.getvalue()).decode()}
    raise UserError(f"data: {where}: an `{IMAGES_COLUMN}` entry is {type(value).__name__}; give a path, a file: URL, "
                    "base64 text or a datasets Image value")


def _is_base64(text: str) -> bool:
    try:
        return len(text) >= 16 and bool(base64.b64decode(text, validate=True))
    except (binascii.Error, ValueError):
        return False


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


def checked_size(reference: str, where: str) -> tuple[int, int]:
    """image_size, for preparing: the file's structure checked too (PIL's verify: a PNG's chunks and checksums, no
    pixels decoded; a JPEG decoded at 1/8 scale, which finds one cut short), so a broken image is refused naming
    its row now, not when a micro-batch meets it."""
    from PIL import Image

    with open_image(reference, where) as image:
        size = image.height, image.width
        try:
            if image.format == "JPEG":
                image.draft("RGB", (max(1, image.width // 8), max(1, image.height // 8)))
                image.load()
            else:
                image.verify()
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
            shown = reference.partition(":")[2] if reference.startswith("path:") else "(base64 data)"
            raise UserError(f"data: {where}: cannot decode image {shown}: {error}") from None
    return size


def check_images_fit(counts: list[int], references: list[str], sizes: list[tuple[int, int]], sequence_len: int,
                     family: VisionFamily, where: str) -> None:
    """An image whose tokens alone fill sequence_len can never train: refused naming it, its tokens and the
    processor setting that makes it fewer (the row's other images and text are the ordinary length check's)."""
    for number, (count, reference, (height, width)) in enumerate(zip(counts, references, sizes), start=1):
        if count < sequence_len:
            continue
        shown = reference.partition(":")[2] if reference.startswith("path:") else "(base64 data)"
        shrink = family.shrink
        fix = (f"shrink it with {shrink.format(pixels=784 * (sequence_len // 2))}, or raise sequence_len" if shrink
               else f"{family.name} makes every image this many tokens: raise sequence_len")
        raise UserError(f"data: {where}: image {number} ({shown}, {width}×{height}) becomes {count} image tokens, "
                        f"which do not fit in sequence_len={sequence_len}; {fix}")


def expand_images(text: str, spans: list[tuple[int, int]], marker: str,
                  replacements: list[str]) -> tuple[str, list[tuple[int, int]]]:
    """The text with its i-th image marker replaced by replacements[i] (what the processor writes for that image),
    the trained character spans moved to match; an image's text is never trained, so it is cut out of them."""
    pieces, markers, at = [], [], 0
    for replacement in replacements:
        found = text.index(marker, at)
        pieces += [text[at:found], replacement]
        markers.append((found, found + len(marker), len(replacement) - len(marker)))
        at = found + len(marker)
    pieces.append(text[at:])

    def moved(position: int) -> int:
        return position + sum(extra for _, after, extra in markers if position >= after)

    kept = []
    for start, end in spans:
        for found, after, _ in markers:
            if start < after and found < end:  # the span holds this image's marker: split around it
                if start < found:
                    kept.append((start, found))
                start = max(start, after)
        if start < end:
            kept.append((start, end))
    return "".join(pieces), [(moved(start), moved(end)) for start, end in kept]


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
    tile_tokens: int = 0  # Idefics3/SmolVLM without their processor, InternVL: image tokens per tile (the model
    # config's)
    # axolotl's `image_size` (an int: in proportion, padded black to that square; (width, height): stretched) and
    # `image_resize_algorithm`: each image resized so before the processor sees it, and its tokens counted so
    image_size: int | tuple[int, int] | None = None
    resample: str = "bilinear"
    # Mistral 3: pixels per image token along a side (the vision patch × spatial_merge_size: the model config's, which
    # its PixtralProcessor gives the image processor as patch_size on every call)
    token_pixels: int = 0

    def seen_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) of an image of this size as the processor gets it (after `image_size`)."""
        if self.image_size is None:
            return height, width
        if isinstance(self.image_size, int):
            return self.image_size, self.image_size
        return self.image_size[1], self.image_size[0]

    def resized(self, image):
        """The image as the processor gets it: resized as `image_size` says (axolotl's way), or as it is."""
        from PIL import Image, ImageOps

        if self.image_size is None:
            return image
        method = getattr(Image.Resampling, self.resample.upper())
        if isinstance(self.image_size, int):
            return ImageOps.pad(image, (self.image_size, self.image_size), method=method, color=(0, 0, 0))
        return image.resize(tuple(self.image_size), method)

    def opened(self, references: list[str]) -> list:
        return [self.resized(image) for image in _opened(references)]

    def tokens_for(self, height: int, width: int) -> int:
        """How many image tokens an image of this size becomes: the processor's own arithmetic."""
        if self.family.layout != "repeat":
            return self.expansion(height, width).count(self.family.image_token)
        if self.processor is not None and hasattr(self.processor, "_get_num_multimodal_tokens"):
            return int(self.processor._get_num_multimodal_tokens(image_sizes=[(height, width)])["num_image_tokens"][0])
        # Qwen2-VL's image processor alone: its patch grid, merge_size × merge_size patches to a token
        patches = self.image_processor.get_number_of_image_patches(height, width, {})
        return patches // self.image_processor.merge_size ** 2

    def expansion(self, height: int, width: int) -> str:
        """The text the processor writes in place of the marker for an image of this size (from its size alone)."""
        family = self.family
        if family.layout == "repeat":
            return family.image_token * self.tokens_for(height, width)
        if family.layout == "cross":  # Mllama: the token stays one token
            return family.image_token
        if family.layout == "gemma3":  # no pan-and-scan crops (refused when the image processor asks for them)
            return self.processor.replace_image_token({"num_crops": [0]}, 0)
        if family.layout == "rows":
            return self.pixtral_rows(height, width)
        if family.layout == "soft":
            start, end = family.framing
            return start + family.image_token * self.gemma4_soft_tokens(height, width) + end
        if family.layout == "framed":  # InternVL: its tiles (and thumbnail), tile_tokens each, between the framing
            tiles = self.image_processor.get_number_of_image_patches(height, width, dict(family.image_kwargs))
            start, end = family.framing
            return start + family.image_token * (self.tile_tokens * tiles) + end
        # tiles: rows × columns of the resized image (0 × 0 when it is not split), then the global image
        _, rows, cols = self.image_processor.get_number_of_image_patches(height, width, {})
        if self.processor is not None:
            return self.processor.replace_image_token({"rows": [[rows]], "cols": [[cols]]}, 0)
        from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

        return get_image_prompt_string(rows, cols, self.tile_tokens, "<fake_token_around_image>", family.image_token,
                                       "<global-img>")

    def expanded(self, text: str, spans: list[tuple[int, int]], sizes: list[tuple[int, int]],
                 where: str) -> tuple[str, list[tuple[int, int]], list[int]]:
        """A rendered row with each image's marker replaced by the processor's text for it (the row's length is
        final), its trained spans moved, and each image's token count (kept with the cached row)."""
        marker = self.family.text_marker
        sizes = [self.seen_size(height, width) for height, width in sizes]
        if text.count(marker) != len(sizes):
            why = ("the chat template dropped image markers (a template that reads message content as a list of "
                   "parts gets text here: use one that writes the content as text)" if text.count(marker) < len(sizes)
                   else f"the text must not write {marker} itself")
            raise UserError(f"data: {where}: the chat text holds {text.count(marker)} image marker(s) {marker} for "
                            f"{len(sizes)} image(s); {why}")
        replacements = [self.expansion(height, width) for height, width in sizes]
        expanded, moved = expand_images(text, spans, marker, replacements)
        return expanded, moved, [replacement.count(self.family.image_token) for replacement in replacements]

    def pixel_inputs(self, references: list[str]) -> dict:
        """The model's image inputs (pixel_values, and the grid where the family has one) for these images."""
        return dict(self.image_processor(images=self.opened(references), return_tensors="pt",
                                         **dict(self.family.image_kwargs), **self.pixtral_patch()))

    def pixtral_patch(self) -> dict:
        """Mistral 3: the patch_size its processor gives the image processor (patch × merge), so each side is
        resized to whole image tokens; nothing for other families."""
        return {"patch_size": {"height": self.token_pixels, "width": self.token_pixels}} if self.token_pixels else {}

    def pixtral_size(self, height: int, width: int) -> tuple[int, int]:
        """Mistral 3: (height, width) Pixtral's image processor resizes an image of this size to (within its
        size's longest_edge, each side rounded up to whole image tokens): its own function, given the shape alone."""
        import numpy as np
        from transformers.models.pixtral.image_processing_pil_pixtral import get_resize_output_image_size

        size = self.image_processor.size
        bound = (size.longest_edge,) * 2 if size.longest_edge else (size.height, size.width)  # (its resize's rule)
        shape = np.broadcast_to(np.uint8(0), (height, width, 3))  # (no memory: the function reads the shape)
        return get_resize_output_image_size(shape, size=bound, patch_size=(self.token_pixels,) * 2,
                                            input_data_format="channels_last")

    def pixtral_rows(self, height: int, width: int) -> str:
        """PixtralProcessor.replace_image_token's text for an image of this size, as resized (its module imports
        torchvision, not a dependency here): per row of image tokens [IMG] × columns then [IMG_BREAK]; the last
        break is [IMG_END]."""
        resized_height, resized_width = self.pixtral_size(height, width)
        rows, cols = resized_height // self.token_pixels, resized_width // self.token_pixels
        if not rows or not cols:  # (Pixtral's image processor raises on it too)
            raise UserError(f"data: an image of {width}×{height} pixels is too long and thin for Mistral 3's image "
                            "processor: shrunk to fit its longest_edge, one side becomes 0 pixels; crop or pad it")
        row_break, end = self.family.framing
        return ((self.family.image_token * cols + row_break) * rows)[:-len(row_break)] + end

    def gemma4_soft_tokens(self, height: int, width: int) -> int:
        """Gemma 4: the soft tokens of an image of this size, as its image processor makes them (its processor needs
        torchvision for videos): resized in proportion to at most max_soft_tokens × pooling² patches, each side a
        whole number of pooling × patch pixels, then pooled by pooling² patches to a token; its own function."""
        from transformers.models.gemma4.image_processing_pil_gemma4 import get_aspect_ratio_preserving_size

        images = self.image_processor
        pooling, patch = images.pooling_kernel_size, images.patch_size
        if not images.do_resize:  # (the image as it is, cut to whole patches)
            return (height // patch) * (width // patch) // pooling ** 2
        try:
            resized = get_aspect_ratio_preserving_size(height, width, patch, images.max_soft_tokens * pooling ** 2,
                                                       pooling)
        except ValueError as error:  # (an image too long and thin for the budget: the image processor raises too)
            raise UserError(f"data: an image of {width}×{height} pixels cannot be resized for Gemma 4's image "
                            f"processor: {error}; crop or pad it") from None
        return (resized[0] // patch) * (resized[1] // patch) // pooling ** 2

    def batch_inputs(self, input_ids, references: list[list[str]]) -> dict:
        """A micro-batch's image inputs: its rows' images (as one list per row where the family's tensors are per
        row), and what the family reads beside them: Gemma 3's token types (image tokens attend to each other both
        ways), Mllama's cross-attention mask (each text token reads the images before it, every tile of them)."""
        import torch

        if not any(references):
            return {}
        if not self.family.nested:
            inputs = self.pixel_inputs([reference for row in references for reference in row])
        else:
            inputs = dict(self.image_processor(images=[self.opened(row) for row in references], return_tensors="pt"))
        for unused in ("num_crops", "rows", "cols", "num_patches", "num_soft_tokens_per_image"):
            inputs.pop(unused, None)
        if self.family.layout == "gemma3":
            inputs["token_type_ids"] = (input_ids == self.never_trained[0]).long()
        if self.family.layout == "soft":  # Gemma 4: its larger models' image tokens attend to each other both ways
            # (use_bidirectional_attention "vision"), each image's run of them found by these types
            inputs["mm_token_type_ids"] = (input_ids == self.never_trained[0]).long()
        if "image_grid_thw" in inputs:  # Qwen2-VL/2.5-VL's, Qwen3-VL's and GLM-4V's M-RoPE finds the image tokens
            # by these types (transformers 5.24: without them Qwen2-VL and Qwen3-VL raise, and Qwen2.5-VL silently gives the
            # image tokens text positions)
            inputs["mm_token_type_ids"] = (input_ids == self.never_trained[0]).long()
        if self.family.layout == "cross":
            from transformers.models.mllama.processing_mllama import (convert_sparse_cross_attention_mask_to_dense,
                                                                      get_cross_attention_token_mask)

            num_tiles = inputs.pop("num_tiles")
            spans = [get_cross_attention_token_mask(row.tolist(), self.never_trained[0]) for row in input_ids]
            inputs["cross_attention_mask"] = torch.from_numpy(convert_sparse_cross_attention_mask_to_dense(
                spans, num_tiles=num_tiles, max_num_tiles=self.image_processor.max_image_tiles,
                length=input_ids.shape[1]))
        return inputs

    def save(self, folder: Path) -> None:
        """The processor beside the model, so AutoProcessor reloads it (the image processor where only it loaded)."""
        (self.processor or self.image_processor).save_pretrained(folder)


def _opened(references: list[str]) -> list:
    images = []
    for reference in references:
        with open_image(reference) as image:
            try:
                images.append(image.convert("RGB"))
            except (OSError, SyntaxError, ValueError) as error:  # (a JPEG cut short passes checked_size)
                shown = reference.partition(":")[2][:200] if reference.startswith("path:") else "(base64 data)"
                raise UserError(f"data: cannot decode image {shown}: {error}; replace the file, then run `tuneloop "
                                "preprocess CONFIG --force`") from None
    return images


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
        processor = processor_class.from_pretrained(source, trust_remote_code=cfg.trust_remote_code,
                                                    **(cfg.processor_kwargs or {}))
        image_processor = processor.image_processor
    except (AttributeError, ImportError, OSError, ValueError, TypeError) as error:
        if not lacks_torchvision(error):
            raise UserError(f"model: cannot load a processor from {source!r} as {name}: {error}") from None
        image_processor = _image_processor_alone(source, cfg, error)
    if processor is not None:
        processor.tokenizer = tokenizer  # the run's (its added tokens and template), saved with it
    ids = [tokenizer.convert_tokens_to_ids(token) for token in (family.image_token, *family.framing)]
    if tokenizer.unk_token_id in ids or None in ids:
        raise UserError(f"model: the tokenizer of {source} lacks the {family.name} image tokens "
                        f"({family.image_token} {' '.join(family.framing)}); use the model's own tokenizer")
    if family.layout == "gemma3" and (processor is None or getattr(image_processor, "do_pan_and_scan", False)):
        raise UserError(f"model: {source}: " + ("Gemma 3's image processor asks for pan-and-scan crops, which tuneloop "
                                               "does not make yet; set do_pan_and_scan to false in its "
                                               "preprocessor_config.json" if processor is not None else
                                               "Gemma 3 needs its processor (processor_config.json), which did not "
                                               "load"))
    check_processor_kwargs(cfg, processor, image_processor)
    return ImageInputs(family, image_processor, processor, tuple(ids), _tile_tokens(config, family),
                       cfg.image_size, cfg.image_resize_algorithm or "bilinear",
                       token_pixels=_token_pixels(config, family))


def _token_pixels(config, family: VisionFamily) -> int:
    """Mistral 3: pixels per image token along a side, the vision patch × spatial_merge_size (what its processor's
    patch_size and spatial_merge_size hold: the model reads the image so)."""
    if family.layout != "rows":
        return 0
    return config.vision_config.patch_size * config.spatial_merge_size


def lacks_torchvision(error: Exception) -> bool:
    """A processor transformers cannot build here for want of torchvision (its video half): Qwen2-VL's and SmolVLM's
    raise ImportError (or AttributeError from the video mapping), InternVL's a ValueError naming torchvision."""
    return isinstance(error, (AttributeError, ImportError)) or "torchvision" in str(error)


def _tile_tokens(config, family: VisionFamily) -> int:
    """Image tokens per tile, by the model config's arithmetic (the processor's image_seq_len or image_seq_length,
    for when the processor cannot load): (image_size / patch_size)² patches, pixel-shuffled scale_factor² to one
    (Idefics3/SmolVLM) or by downsample_ratio along each side (InternVL: 0.5, 4 patches to one)."""
    if family.layout not in ("tiles", "framed"):
        return 0
    vision = config.vision_config
    patches = (_side(vision.image_size) // _side(vision.patch_size)) ** 2
    if family.layout == "framed":
        return round(patches * config.downsample_ratio ** 2)
    return patches // config.scale_factor ** 2


def _side(size) -> int:
    """A square's side, where a config gives it as one number or as (height, width)."""
    return size if isinstance(size, int) else size[0]


def check_processor_kwargs(cfg, processor, image_processor) -> None:
    """`processor_kwargs` go to the processor's from_pretrained, as axolotl gives them; transformers drops a name
    neither the processor nor its image processor takes without a word, so such a name is refused here."""
    if not cfg.processor_kwargs:
        return
    import inspect

    known = set(image_processor.to_dict())
    for holder in (processor, image_processor):
        if holder is None:
            continue
        known |= set(holder.to_dict()) if holder is processor else set()
        known |= set(inspect.signature(type(holder).__init__).parameters) - {"self", "args", "kwargs"}
        kinds = getattr(holder, "valid_kwargs", None)  # (a TypedDict of the kwargs it takes)
        for kind in kinds.__mro__ if isinstance(kinds, type) else ():
            known |= set(getattr(kind, "__annotations__", {}))
    unknown = sorted(set(cfg.processor_kwargs) - known - {"tokenizer", "image_processor", "chat_template"})
    if unknown:
        names = " or ".join(type(holder).__name__ for holder in (processor, image_processor) if holder is not None)
        raise UserError(f"config: processor_kwargs: {', '.join(unknown)} is not a setting of {names} (transformers "
                        f"would drop it without a word); its settings include {', '.join(sorted(known)[:40])}")


def _image_processor_alone(source: str, cfg, error: Exception):
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(source, trust_remote_code=cfg.trust_remote_code,
                                                  **(cfg.processor_kwargs or {}))
    except (OSError, ValueError, TypeError) as second:
        raise UserError(f"model: cannot load the processor of {source!r} ({type(error).__name__}: {error}) nor its "
                        f"image processor ({second})") from None


def image_inputs_of(tokenizer) -> ImageInputs | None:
    """The run's image side, carried by its tokenizer (set by run.py for a vision-language model)."""
    return getattr(tokenizer, "tuneloop_image_inputs", None)


def references_json(references: list[tuple[str, int]]) -> str:
    """A row's images as the cache keeps them: (reference, image tokens) in the order the text holds them."""
    return json.dumps([[reference, count] for reference, count in references])
