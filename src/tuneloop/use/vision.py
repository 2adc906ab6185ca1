"""Images for the `use` commands: image parts of `infer` prompts, and a vision-language folder's processor. The prompts'
images (`--image`, jsonl rows) are checked before any model loads; the processor is reloaded from what the run saved
beside the model.

A prompt's images go through the path training takes (data/images.py): each image part becomes the family's
placeholder in the chat text, the processor's arithmetic expands it to the image's tokens, and the collator's
`batch_inputs` makes the pixel inputs. So a prompt is the model's input exactly as a training row was.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path

from tuneloop.errors import UserError
from tuneloop.use.folders import ModelFolder

PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


# ---- image parts of prompts ----------------------------------------------------------------------------------

def image_part(part: dict, where: str, base_dir: Path) -> dict:
    """An image part of a prompt, checked now (the file read and its pixels decoded, so a bad image is said before
    the model loads) and made absolute: {"type": "image", "path": ...} or {"type": "image", "base64": ...}. A
    relative path is relative to `base_dir` (the prompts file's folder, as for training rows)."""
    from tuneloop.data.images import IMAGE_KEYS

    value = next((part[key] for key in IMAGE_KEYS if isinstance(part.get(key), str) and part[key]), None)
    if value is None:
        raise UserError(f"infer: {where}: an image part needs one of {', '.join(IMAGE_KEYS)} (a path, a file: URL "
                        f"or base64 text); got keys {', '.join(sorted(part))}")
    if part.get("base64") == value or value.startswith("data:"):
        data = value.split(",", 1)[-1] if value.startswith("data:") else value
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as error:
            raise UserError(f"infer: {where}: an image's base64 text does not decode ({error})") from None
        decode_image(io.BytesIO(raw), "(base64 data)", where)
        return {"type": "image", "base64": data}
    if value.startswith(("http://", "https://")):
        raise UserError(f"infer: {where}: image {value} is a web address; tuneloop reads no network: download the "
                        "image and give its path")
    path = Path(value.removeprefix("file://").removeprefix("file:")).expanduser()
    path = path if path.is_absolute() else base_dir / path
    decode_image(path, str(path), where)
    return {"type": "image", "path": str(path.resolve())}


def decode_image(source, shown: str, where: str) -> None:
    """The image decoded whole (a truncated file fails here, not halfway through generating); PIL's words if not."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(source) as image:
            image.convert("RGB")
    except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError) as error:
        raise UserError(f"infer: {where}: cannot read image {shown} (PIL: {error})") from None


def reference_of(part: dict) -> str:
    """A checked image part as data/images.py's reference (what the training cache keeps)."""
    return f"path:{part['path']}" if "path" in part else f"base64:{part['base64']}"


def is_image_part(part) -> bool:
    return isinstance(part, dict) and part.get("type") == "image"


def prompt_has_images(prompt) -> bool:
    return isinstance(prompt, list) and any(isinstance(m.get("content"), list) and any(map(is_image_part, m["content"]))
                                            for m in prompt)


def with_images(prompt, parts: list[dict]):
    """`--image`: the images before the text of the prompt's first user message (a plain prompt becomes one)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    first = next((m for m in messages if m["role"] == "user"), None)
    if first is None:
        raise UserError("infer: --image goes into the prompt's first user message, and this prompt has none")
    content = first["content"]
    first["content"] = list(parts) + ([{"type": "text", "text": content}] if isinstance(content, str) else content)
    return messages


# ---- a vision-language folder ---------------------------------------------------------------------------------

def folder_config(folder: ModelFolder, trust_remote_code: bool = False):
    """The model's config (an adapter's base's), read without loading weights; None if it does not load (the
    model loader then says why)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder.base if folder.is_adapter else folder.path,
                                          trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None


def load_processor_of(folder: ModelFolder, trust_remote_code: bool = False):
    """(processor or None, image processor, where from): what the run saved beside the model or adapter (its
    processor with the run's tokenizer), else the adapter's base's. A processor transformers cannot build here
    (Qwen2-VL's, Qwen3-VL's, SmolVLM's and InternVL's need torchvision for their video half) gives its image
    processor alone."""
    from transformers import AutoImageProcessor, AutoProcessor

    from tuneloop.data.images import lacks_torchvision

    sources = [folder.path] + ([folder.base] if folder.is_adapter else [])
    saved = [source for source in sources if any((Path(source) / name).is_file() for name in PROCESSOR_FILES)]
    for source in saved or sources:  # (a hub base: AutoProcessor finds its files)
        try:
            processor = AutoProcessor.from_pretrained(source, trust_remote_code=trust_remote_code)
            image_processor = getattr(processor, "image_processor", None)
            if image_processor is not None:
                return processor, image_processor, str(source)
        except (AttributeError, ImportError, OSError, ValueError, TypeError) as error:
            if not lacks_torchvision(error):  # (the video processor's torchvision: its image processor alone)
                continue
        try:
            return None, AutoImageProcessor.from_pretrained(source, trust_remote_code=trust_remote_code), str(source)
        except (OSError, ValueError, TypeError):
            continue
    raise UserError(f"model: no image processor in {' nor in '.join(map(str, sources))}; a vision-language model "
                    "needs its processor (preprocessor_config.json) beside it: copy the base model's there")


def folder_image_inputs(folder: ModelFolder, config, tokenizer, trust_remote_code: bool = False, image_size=None,
                        resample: str = "bilinear"):
    """data/images.py's ImageInputs for a saved folder: its family (from the config), its saved processor with its
    saved tokenizer, the ids never trained; `image_size` and `resample`: the run's resize (axolotl's keys)."""
    from tuneloop.data.images import ImageInputs, _tile_tokens, _token_pixels, vision_family

    family = vision_family(config, str(folder.path))
    processor, image_processor, source = load_processor_of(folder, trust_remote_code)
    if processor is not None:
        processor.tokenizer = tokenizer
    ids = [tokenizer.convert_tokens_to_ids(token) for token in (family.image_token, *family.framing)]
    if tokenizer.unk_token_id in ids or None in ids:
        raise UserError(f"model: the tokenizer in {source} lacks the {family.name} image tokens "
                        f"({family.image_token} {' '.join(family.framing)})")
    # (_tile_tokens: Idefics3/SmolVLM's tokens per tile from the model config, as a run computes it; _token_pixels:
    # Mistral 3's pixels per image token)
    return ImageInputs(family, image_processor, processor, tuple(ids), _tile_tokens(config, family), image_size,
                       resample, token_pixels=_token_pixels(config, family))


@dataclass
class VisionPrompts:
    """Prompts with images, turned into token ids and image references as training turns rows."""

    inputs: object  # data/images.py's ImageInputs
    tokenizer: object

    def encode(self, prompt, where: str) -> tuple[list[int], list[str]]:
        """(the ids the model continues, the references of the images in them, in order)."""
        references: list[str] = []
        messages = [{**message, "content": self._content_text(message["content"], references)}
                    for message in ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt)]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        from tuneloop.data.images import image_size

        sizes = [image_size(reference, where) for reference in references]
        expanded, _, _ = self.inputs.expanded(text, [], sizes, where)
        return self.tokenizer(expanded, add_special_tokens=False)["input_ids"], references  # (BOS: the template's)

    def _content_text(self, content, references: list[str]) -> str:
        """Parts joined, an image as the family's placeholder (as data/formats.py joins a training row's)."""
        if isinstance(content, str):
            return content
        texts = []
        for part in content:
            if is_image_part(part):
                texts.append(self.inputs.family.placeholder)
                references.append(reference_of(part))
            else:
                texts.append(part["text"])
        return "".join(texts)

    def batch_inputs(self, input_ids, references: list[list[str]], model) -> dict:
        """The batch's pixel inputs on the model's device, floats in the model's dtype."""
        inputs = self.inputs.batch_inputs(input_ids.cpu(), references)
        dtype = next(model.parameters()).dtype
        return {key: value.to(input_ids.device, dtype=dtype if value.is_floating_point() else value.dtype)
                for key, value in inputs.items()}


def save_processor_of(folder: ModelFolder, target: Path, tokenizer, trust_remote_code: bool = False) -> str:
    """A vision-language adapter's processor beside its merged model (AutoProcessor reloads it; where transformers
    cannot build the whole processor here, the image processor, which AutoImageProcessor reloads). Returns what was
    saved, in words."""
    processor, image_processor, _ = load_processor_of(folder, trust_remote_code)
    if processor is not None:
        processor.tokenizer = tokenizer
        processor.save_pretrained(target)
        return "its processor"
    image_processor.save_pretrained(target)
    return "its image processor and tokenizer"


def processor_note(folder: Path) -> str:
    """What a saved vision-language folder holds for its inputs, in words ("" for a text model's)."""
    if (folder / "processor_config.json").is_file():
        return " with its processor (AutoProcessor loads it)"
    if (folder / "preprocessor_config.json").is_file():
        return (" with its image processor and tokenizer (AutoImageProcessor and AutoTokenizer load them; this "
                "family's AutoProcessor also builds a video processor, which needs torchvision)")
    return ""
