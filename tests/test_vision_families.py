"""More vision-language families (data/images.py's VISION_FAMILIES): Gemma 3 (soft tokens framed by start/end of image,
token types for its two-way attention over an image), Idefics3 and SmolVLM (images split into tiles and a global
image, row-col tags), Mllama (one `<|image|>` token, cross-attention over the image's tiles), Qwen3-VL and Qwen3.5
(Qwen2-VL's image pads and M-RoPE inputs; Qwen3.5's linear-attention decoder, dense and mixture-of-experts; Qwen3-VL
on a mixture of experts too), GLM-4.1V / GLM-4.5V (the same under its own image tokens), InternVL
(tiles and a thumbnail between <img> and </img>), PaddleOCR-VL (Qwen2-VL's arithmetic under its own image
tokens; Llama 4 is refused: its image processor needs torchvision). Each runs on a tiny model
and processor built from configs (tests/vision_family_models.py, nothing downloaded) over coloured squares: the
collator's batch is what the family's processor makes of the same text and images, the cached rows hold the
processor's lengths, image and framing tokens are never trained, the plan's steps are the steps run, the loss falls,
and `freeze_mm_modules` leaves the vision tower and projector as they were."""

from __future__ import annotations

import contextlib

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_user_error, read_metrics, run_in_process, write_config, write_jsonl
from test_vision_language import COLOURS, QUESTION, caption_rows, plan_of, vlm_config
from vision_family_models import save_gemma3, save_idefics3, save_mistral3, save_mllama, save_smolvlm
from vision_family_models import save_internvl, save_qwen3_5, save_qwen3_5_moe, save_qwen3_vl
from vision_family_models import save_qwen3_vl_moe
from vision_family_models import save_paddleocr_vl
from vision_family_models import save_gemma4, save_glm4v

# family -> (builder, chat_template (None: the tokenizer's own, as axolotl uses for SmolVLM), the image marker in the
# chat text, the image token, framing tokens, vision module-name parts, two image sizes (width, height))
FAMILIES = {
    "gemma3": (save_gemma3, "gemma3", "<start_of_image>", "<image_soft_token>", ("<start_of_image>", "<end_of_image>"),
               ("vision_tower", "multi_modal_projector"), [(40, 30), (28, 28)]),
    "idefics3": (save_idefics3, None, "<image>", "<image>",
                 ("<fake_token_around_image>", "<global-img>", "<row_1_col_1>", "<row_1_col_2>", "<row_2_col_1>",
                  "<row_2_col_2>"), ("vision_model", "connector"), [(56, 56), (56, 28)]),
    "smolvlm": (save_smolvlm, None, "<image>", "<image>", ("<fake_token_around_image>", "<global-img>", "<row_1_col_1>",
                                                           "<row_1_col_2>"),
                ("vision_model", "connector"), [(56, 56), (56, 28)]),
    "mllama": (save_mllama, "llama3_2_vision", "<|image|>", "<|image|>", (), ("vision_model", "multi_modal_projector"),
               [(56, 28), (28, 28)]),
    "mistral3": (save_mistral3, "mistral_v7_tekken", "[IMG]", "[IMG]", ("[IMG_BREAK]", "[IMG_END]"),
                 ("vision_tower", "multi_modal_projector"), [(70, 42), (28, 56)]),
}
# image tokens per image of each size, by the processors' arithmetic: Gemma 3 always 4 soft tokens; Idefics3/SmolVLM
# rescale to a 56-pixel longest edge and split into 28-pixel tiles (2×2 or 1×2) plus the global image, 1 token
# each; Mllama keeps one token
IMAGE_TOKENS = {"gemma3": (4, 4), "idefics3": (5, 3), "smolvlm": (5, 3), "mllama": (1, 1)}
# Mistral 3: 70×42 shrinks into the 56-pixel longest edge (56×33), each side rounded up to 28 pixels: 2 rows of 2
# [IMG]; 28×56 is 2 rows of 1
IMAGE_TOKENS["mistral3"] = (4, 2)
# Qwen3-VL and Qwen3.5 (Qwen2-VL's image text; tokenizer's own template, axolotl's qwen3_5) and InternVL (its image
# tokens between <img> and </img>): 16-pixel patches merged 2×2 (64×64: 4 tokens, 64×32: 2); InternVL's 28-pixel
# tiles (2×2 or 1×2) plus the thumbnail, 1 token each
_QWEN_IMAGE = ("<|vision_start|><|image_pad|><|vision_end|>", "<|image_pad|>", ("<|vision_start|>", "<|vision_end|>"),
               ("visual",), [(64, 64), (64, 32)])
FAMILIES.update({"qwen3_vl": (save_qwen3_vl, None, *_QWEN_IMAGE),
                 "qwen3_vl_moe": (save_qwen3_vl_moe, None, *_QWEN_IMAGE),
                 "qwen3_5": (save_qwen3_5, "qwen3_5", *_QWEN_IMAGE),
                 "qwen3_5_moe": (save_qwen3_5_moe, "qwen3_5", *_QWEN_IMAGE),
                 "internvl": (save_internvl, None, "<IMG_CONTEXT>\n", "<IMG_CONTEXT>", ("<img>", "</img>"),
                              ("vision_tower", "multi_modal_projector"), [(56, 56), (56, 28)])})
IMAGE_TOKENS.update({"qwen3_vl": (4, 2), "qwen3_vl_moe": (4, 2), "qwen3_5": (4, 2), "qwen3_5_moe": (4, 2),
                     "internvl": (5, 3)})
# the model inputs beside input_ids, attention_mask and pixel_values (Qwen's M-RoPE reads the grid and token types)
QWEN3_AND_INTERNVL_INPUTS = {**dict.fromkeys(("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"),
                                             ["image_grid_thw", "mm_token_type_ids"]),
                             "internvl": []}
# PaddleOCR-VL: Qwen2-VL's image text under its own tokens, 14-pixel patches merged 2×2 (56×56: 4 tokens, 56×28: 2);
# its processor builds here (no video half), so the reference is the processor itself
FAMILIES["paddleocr_vl"] = (save_paddleocr_vl, None, "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>",
                            "<|IMAGE_PLACEHOLDER|>", ("<|IMAGE_START|>", "<|IMAGE_END|>"), ("visual", "projector"),
                            [(56, 56), (56, 28)])
IMAGE_TOKENS["paddleocr_vl"] = (4, 2)
# Gemma 4: <|image>, soft tokens, <image|>; each image resized within 70 soft tokens of 3×3 4-pixel patches: a 28×28
# square to 96×96 (8×8 tokens), 56×28 to 132×60 (11×5)
FAMILIES["gemma4"] = (save_gemma4, "gemma4", "<|image|>", "<|image|>", ("<|image>", "<image|>"),
                      ("vision_tower", "embed_vision"), [(28, 28), (56, 28)])
IMAGE_TOKENS["gemma4"] = (64, 55)

# GLM-4.1V and GLM-4.5V (Qwen2-VL's image text under its own tokens; the tokenizer's own template): 14-pixel
# patches merged 2×2 (56×56: 4 tokens, 56×28: 2); its processor needs torchvision (videos): built by hand as Qwen's
_GLM_IMAGE = ("<|begin_of_image|><|image|><|end_of_image|>", "<|image|>", ("<|begin_of_image|>", "<|end_of_image|>"),
              ("visual",), [(56, 56), (56, 28)])
FAMILIES.update({"glm4v": (save_glm4v, None, *_GLM_IMAGE),
                 "glm4v_moe": (lambda target: save_glm4v(target, moe=True), None, *_GLM_IMAGE)})
IMAGE_TOKENS.update({"glm4v": (4, 2), "glm4v_moe": (4, 2)})
QWEN3_AND_INTERNVL_INPUTS.update(dict.fromkeys(("glm4v", "glm4v_moe"), ["image_grid_thw", "mm_token_type_ids"]))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    built = {}

    def build(family: str) -> Path:
        if family not in built:
            built[family] = FAMILIES[family][0](tmp_path_factory.mktemp(f"tiny_{family}"))
        return built[family]

    return build


def mixed_rows(folder: Path, family: str, count: int, seed: int) -> list[dict]:
    """Caption rows, the first half with images of the family's first size, the rest its second."""
    first, second = FAMILIES[family][-1]
    half = count // 2
    return caption_rows(folder, half, seed=seed, size=first) + caption_rows(folder, count - half, seed=seed + 50,
                                                                              size=second)


def family_config(tmp_path: Path, model_dir: Path, data: Path, family: str, **overrides) -> dict:
    template = FAMILIES[family][1]
    return vlm_config(tmp_path, model_dir, data, **({"chat_template": template} if template else {}),
                      sequence_len=128, **overrides)


def reference_processor(family: str, model_dir: Path):
    """The family's processor from the folder; SmolVLM's needs torchvision and num2words (not here): Idefics3's
    processor over SmolVLM's image processor and tokenizer writes the same image text (transformers' SmolVLM and
    Idefics3 processors build it alike)."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer, Idefics3Processor

    if family == "smolvlm":
        return Idefics3Processor(image_processor=AutoImageProcessor.from_pretrained(model_dir),
                                 tokenizer=AutoTokenizer.from_pretrained(model_dir), image_seq_len=1)
    if family == "mistral3":
        return pixtral_processor(model_dir)
    if family == "gemma4":
        return gemma4_processor(model_dir)
    if family in QWEN3_AND_INTERNVL_INPUTS:
        return processed_by_hand(family, model_dir)
    return AutoProcessor.from_pretrained(model_dir)


def pixtral_processor(model_dir: Path):
    """Mistral 3's PixtralProcessor as it works (its module imports torchvision, not installed here): its image
    processor, given patch_size × spatial_merge_size as the processor gives it, resizes each image; each image's
    [IMG] becomes replace_image_token's text for the size it was resized to (per row of image tokens [IMG] × columns
    and [IMG_BREAK], the last break [IMG_END]); then the tokenizer."""
    from transformers import AutoImageProcessor, AutoTokenizer

    settings = json.loads((model_dir / "processor_config.json").read_text())
    side = settings["patch_size"] * settings["spatial_merge_size"]
    image_processor, tokenizer = AutoImageProcessor.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)

    def image_text(height: int, width: int) -> str:
        rows = [["[IMG]"] * (width // side) + ["[IMG_BREAK]"]] * (height // side)
        return "".join([token for row in rows for token in row][:-1] + ["[IMG_END]"])

    def process(images, text, **kwargs):
        pixels = image_processor([image for row in images for image in row], patch_size={"height": side, "width": side},
                                 return_tensors="pt")
        sizes = iter(pixels["image_sizes"].tolist())
        expanded = []
        for row in text:
            pieces = row.split("[IMG]")
            expanded.append(pieces[0] + "".join(image_text(*next(sizes)) + piece for piece in pieces[1:]))
        return {**tokenizer(expanded, **kwargs), **pixels}

    return process


def processed_by_hand(family: str, model_dir: Path):
    """Qwen3-VL's (Qwen3.5's), GLM-4V's and InternVL's processors need torchvision (their video half), not installed
    here: the folder's image processor and tokenizer, with the image text their processors' replace_image_token
    writes from the image processor's output (Qwen and GLM-4V: the grid's patches over merge_size² of the image
    token, then mm_token_type_ids 1 on the image tokens; InternVL: <img>, the tiles' image_seq_length tokens each (1
    here), </img>), one image a text."""
    from transformers import AutoImageProcessor, AutoTokenizer

    image_processor, tokenizer = AutoImageProcessor.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)

    def process(images, text, **kwargs) -> dict:
        flat = [image for row in images for image in row]
        if family == "internvl":  # (InternVLProcessor always asks for the tiles)
            pixels = dict(image_processor(images=flat, crop_to_patches=True, return_tensors="pt"))
            text = [one.replace("<IMG_CONTEXT>", "<img>" + "<IMG_CONTEXT>" * int(tiles) + "</img>")
                    for one, tiles in zip(text, pixels.pop("num_patches"))]
            return {**tokenizer(text, **kwargs), **pixels}
        pixels = dict(image_processor(images=flat, return_tensors="pt"))
        tokens = pixels["image_grid_thw"].prod(-1) // image_processor.merge_size ** 2
        image = FAMILIES[family][3]  # (GLM-4V's <|image|>, Qwen's <|image_pad|>)
        text = [one.replace(image, image * int(count)) for one, count in zip(text, tokens)]
        encoded = tokenizer(text, **kwargs)
        image_id = tokenizer.convert_tokens_to_ids(image)
        return {**encoded, **pixels, "mm_token_type_ids": (encoded["input_ids"] == image_id).long()}

    return process


def gemma4_processor(model_dir: Path):
    """Gemma4Processor as it works (it needs torchvision for its video processor, not installed here): the image
    processor's soft tokens per image, each <|image|> replaced as its replace_image_token does (<|image>, the soft
    tokens, <image|>), then the tokenizer; mm_token_type_ids 1 on the image tokens (create_mm_token_type_ids), the
    per-image counts dropped (its unused_input_names)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    image_processor, tokenizer = AutoImageProcessor.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)

    def process(images, text, **kwargs) -> dict:
        pixels = dict(image_processor(images=[image for row in images for image in row], return_tensors="pt"))
        counts = pixels.pop("num_soft_tokens_per_image")
        text = [one.replace("<|image|>", "<|image>" + "<|image|>" * int(count) + "<image|>")
                for one, count in zip(text, counts)]
        encoded = tokenizer(text, **kwargs)
        image_id = tokenizer.convert_tokens_to_ids("<|image|>")
        return {**encoded, **pixels, "mm_token_type_ids": (encoded["input_ids"] == image_id).long()}

    return process


def as_text_messages(row: dict, marker: str) -> list[dict]:
    """A caption row's messages as the chat template sees them: the image part as the family's marker."""
    return [{"role": message["role"], "content": "".join(marker if part["type"] == "image" else part["text"]
                                                         for part in message["content"])}
            for message in row["messages"]]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_collated_batch_is_what_the_familys_processor_makes(tmp_path, model_dirs, family):
    import torch

    from tuneloop.config import config_from_dict
    from tuneloop.data.chat_templates import resolve_template
    from tuneloop.data.collate import collator_for
    from tuneloop.data.images import image_inputs_of, open_image
    from tuneloop.resolved import resolve_run
    from tuneloop.run import prepare_data

    model_dir = model_dirs(family)
    _, template_name, marker, image_token, framing, _, _ = FAMILIES[family]
    rows = mixed_rows(tmp_path, family, 4, seed=1)
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    cfg = config_from_dict(family_config(tmp_path, model_dir, data, family))
    tokenizer, prepared = prepare_data(cfg, resolve_run(cfg))
    store = prepared.store
    image_id = tokenizer.convert_tokens_to_ids(image_token)
    untrained = [image_id, *tokenizer.convert_tokens_to_ids(list(framing))]
    for index, expected in zip(range(4), (IMAGE_TOKENS[family][0],) * 2 + (IMAGE_TOKENS[family][1],) * 2):
        ids, labels = store.tokens("input_ids", index), store.tokens("labels", index)
        assert (ids == image_id).sum() == expected, index
        assert np.isin(untrained[:2], ids).all()  # the image token and the first framing token are there
        assert (labels[np.isin(ids, untrained)] == -100).all()
        trained = tokenizer.decode(labels[labels != -100], skip_special_tokens=True).strip()
        trained = trained.removeprefix("<think>\n\n</think>").strip()  # (qwen3_5's template: every answer's block)
        assert trained in COLOURS, trained
        (reference, count), = store.images(index)
        assert count == expected

    # rows 1 and 2: the two image sizes side by side, so the rows' lengths differ and one is padded
    batch = collator_for(store, tokenizer.pad_token_id, False, images=image_inputs_of(tokenizer))([[1], [2]])
    processor = reference_processor(family, model_dir)
    template = resolve_template(cfg.chat_template, None, tokenizer)
    texts = [tokenizer.apply_chat_template(as_text_messages(rows[i], marker), chat_template=template, tokenize=False)
             for i in (1, 2)]
    images = [open_image(store.images(i)[0][0]).convert("RGB") for i in (1, 2)]
    expected = processor(images=[[image] for image in images], text=texts, padding=True, add_special_tokens=False,
                         return_tensors="pt")
    width = expected["input_ids"].shape[1]
    for i, index in enumerate((1, 2)):
        length = int(expected["attention_mask"][i].sum())
        assert len(store.tokens("input_ids", index)) == length  # the cached row: the processor's length
        assert (batch.inputs["input_ids"][i, :length] == expected["input_ids"][i, :length]).all()
        assert (batch.inputs["attention_mask"][i, :width] == expected["attention_mask"][i]).all()
    extra = {"gemma3": ["token_type_ids"], "idefics3": ["pixel_attention_mask"], "smolvlm": ["pixel_attention_mask"],
             "mllama": ["aspect_ratio_ids", "aspect_ratio_mask", "cross_attention_mask"],
             "mistral3": ["image_sizes"], **QWEN3_AND_INTERNVL_INPUTS,
             "paddleocr_vl": ["image_grid_thw", "mm_token_type_ids"],
             "gemma4": ["image_position_ids", "mm_token_type_ids"]}[family]
    assert set(batch.inputs) == {"input_ids", "attention_mask", "pixel_values", *extra}
    for key in ["pixel_values", *extra]:
        got, want = batch.inputs[key], expected[key]
        if key in ("token_type_ids", "cross_attention_mask", "mm_token_type_ids"):  # per token: the processor's
            # batch is as wide as it
            got = got[:, :width]
        assert got.shape == want.shape, (key, got.shape, want.shape)
        torch.testing.assert_close(got, want, msg=key)


def vision_parameters(state: dict, parts: tuple[str, ...]) -> dict:
    return {name: value for name, value in state.items() if any(part in name.split(".") for part in parts)}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_family_trains_as_planned_with_its_vision_modules_frozen(tmp_path, model_dirs, family):
    """Six steps through `tuneloop train`: the plan's steps and trained tokens are the run's, the loss falls, the
    vision tower and projector end as they began (and the plan does not count them as trained), the decoder moved."""
    import torch
    from transformers import AutoModelForImageTextToText

    model_dir = model_dirs(family)
    parts = FAMILIES[family][5]
    data = write_jsonl(tmp_path / "train.jsonl", mixed_rows(tmp_path, family, 8, seed=2))
    keys = family_config(tmp_path, model_dir, data, family, max_steps=6, freeze_mm_modules=True, num_epochs=3,
                         learning_rate=5e-3)
    config = write_config(tmp_path / "c.yml", **keys)
    plan = plan_of(config)
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    losses = [line["loss"] for line in read_metrics(out) if "loss" in line]
    print(f"\n{family}: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps (vision frozen)")
    assert plan["total_steps"] == summary["steps"] == len(losses) == 6
    assert summary["tokens"] == plan["total_trainable_tokens"]
    assert losses[-1] < losses[0]

    base = AutoModelForImageTextToText.from_pretrained(model_dir)
    vision = sum(p.numel() for n, p in base.named_parameters() if any(part in n.split(".") for part in parts))
    assert vision > 0
    assert plan["memory"]["trainable_parameters"] == sum(p.numel() for p in base.parameters()) - vision
    before, after = base.state_dict(), AutoModelForImageTextToText.from_pretrained(out).state_dict()
    assert after.keys() == before.keys()
    frozen = vision_parameters(after, parts)
    assert len(frozen) == len(vision_parameters(before, parts)) > 0
    for name, value in frozen.items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=name)
    assert any(not torch.equal(after[name], before[name]) for name in after if name not in frozen)


def test_a_template_that_drops_the_image_marker_is_one_line(tmp_path, model_dirs):
    """SmolVLM's hub template reads message content as a list of parts; given text (as tuneloop's rows are) it
    writes nothing for the message, images included: refused naming the row, not trained on empty turns."""
    parts_template = ("<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}: "
                      "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
                      "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
                      "{% endfor %}")
    data = write_jsonl(tmp_path / "train.jsonl", caption_rows(tmp_path, 2, seed=4, size=(56, 56)))
    config = write_config(tmp_path / "c.yml", **vlm_config(tmp_path, model_dirs("idefics3"), data,
                                                            chat_template="jinja", chat_template_jinja=parts_template))
    assert_user_error(run_in_process("preprocess", str(config)), "train.jsonl:1", "0 image marker(s) <image> for 1",
                      "reads message content as a list of parts")


@pytest.mark.slow
def test_gemma3_learns_the_colour_of_held_out_images(tmp_path, model_dirs):
    """Gemma 3 (the cheapest: 4 soft tokens an image) on 64 squares for 6 epochs (48 steps) names the colour of 16
    held-out squares (other shades) far above chance, its vision tower trained too (measured: loss 5.70 -> 0.53,
    accuracy 0.25 -> 1.00)."""
    model_dir = model_dirs("gemma3")
    data = write_jsonl(tmp_path / "train.jsonl", caption_rows(tmp_path, 64, seed=1, size=(28, 28)))
    held_out = caption_rows(tmp_path, 16, seed=2, size=(28, 28))
    config = write_config(tmp_path / "c.yml", **family_config(tmp_path, model_dir, data, "gemma3", num_epochs=6,
                                                              micro_batch_size=8, warmup_steps=2))
    before = gemma3_accuracy(model_dir, held_out, tmp_path)
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [line["loss"] for line in read_metrics(tmp_path / "out") if "loss" in line]
    after = gemma3_accuracy(tmp_path / "out", held_out, tmp_path)
    print(f"\ngemma3: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps; held-out colour accuracy "
          f"{before:.2f} -> {after:.2f} (chance 0.25)")
    assert losses[-1] < 0.5 * losses[0]
    assert after >= 0.75


def gemma3_accuracy(model_dir: Path, rows: list[dict], folder: Path) -> float:
    """How often the saved model gives the right colour the lowest summed loss after the question, among the four
    (the processor writes the image's soft tokens and their token types)."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    right = 0
    for row in rows:
        image = Image.open(folder / row["messages"][0]["content"][0]["path"]).convert("RGB")
        truth = row["messages"][1]["content"][0]["text"]
        losses = {}
        for colour in COLOURS:
            text = processor.apply_chat_template([{"role": "user", "content": "<start_of_image>" + QUESTION},
                                                  {"role": "assistant", "content": colour}], tokenize=False)
            inputs = processor(images=[image], text=[text], add_special_tokens=False, return_tensors="pt")
            labels = inputs["input_ids"].masked_fill(inputs["token_type_ids"] == 1, -100)
            with torch.no_grad():
                loss = model(**inputs, labels=labels).loss.item()
            losses[colour] = loss * int((labels[0, 1:] != -100).sum())  # summed: the colours' token counts differ
        right += min(losses, key=losses.get) == truth
    return right / len(rows)


def test_train_on_inputs_trains_no_part_of_an_images_text(tmp_path, model_dirs):
    """Idefics3 writes newlines between an image's rows of tiles: with `train_on_inputs: true` the question and
    template are trained, the image's text (tiles, tags, newlines) is not."""
    from tuneloop.config import config_from_dict
    from tuneloop.resolved import resolve_run
    from tuneloop.run import prepare_data

    data = write_jsonl(tmp_path / "train.jsonl", caption_rows(tmp_path, 1, seed=5, size=(56, 56)))
    cfg = config_from_dict(family_config(tmp_path, model_dirs("idefics3"), data, "idefics3", train_on_inputs=True))
    tokenizer, prepared = prepare_data(cfg, resolve_run(cfg))
    ids, labels = prepared.store.tokens("input_ids", 0), prepared.store.tokens("labels", 0)
    fake = np.flatnonzero(ids == tokenizer.convert_tokens_to_ids("<fake_token_around_image>"))
    image = slice(fake[0], fake[-1] + 1)  # from the first tile's tag to the global image's closing one
    assert "\n" in tokenizer.decode(ids[image])  # the newlines between the rows of tiles
    assert (labels[image] == -100).all()
    assert tokenizer.decode(labels[fake[-1] + 1:][labels[fake[-1] + 1:] != -100]).startswith(QUESTION)
    assert (labels[:fake[0]] != -100).any()  # "User:" is trained


def test_gemma4_audio_parts_are_refused_in_one_line_naming_multimodal_models(tmp_path, model_dirs):
    """Gemma 4 (the E2B/E4B models) hears audio too; tuneloop trains its image side alone, so a row with an audio
    part is refused naming the row and the feature, not trained without its audio."""
    rows = caption_rows(tmp_path, 2, seed=8, size=(28, 28))
    rows[1]["messages"][0]["content"].append({"type": "audio", "path": "clip.wav"})
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    config = write_config(tmp_path / "c.yml", **family_config(tmp_path, model_dirs("gemma4"), data, "gemma4"))
    assert_user_error(run_in_process("preprocess", str(config)), "train.jsonl:2", "type 'audio'",
                      "multimodal models beyond images")


def test_gemma3_pan_and_scan_is_refused_naming_the_setting(tmp_path, model_dirs):
    """Pan-and-scan crops a wide image into extra views (more image text per image); tuneloop does not make them
    yet, so a processor that asks for them is refused rather than trained on rows of the wrong length."""
    import shutil

    model_dir = shutil.copytree(model_dirs("gemma3"), tmp_path / "gemma3-pan-and-scan")
    settings = json.loads((model_dir / "processor_config.json").read_text())
    settings["image_processor"]["do_pan_and_scan"] = True
    (model_dir / "processor_config.json").write_text(json.dumps(settings))
    data = write_jsonl(tmp_path / "train.jsonl", caption_rows(tmp_path, 2, seed=6, size=(28, 28)))
    config = write_config(tmp_path / "c.yml", **family_config(tmp_path, model_dir, data, "gemma3"))
    assert_user_error(run_in_process("preprocess", str(config)), "pan-and-scan", "do_pan_and_scan")


PACKED_FAMILIES = ["idefics3", "mistral3", "internvl"]  # (and LLaVA: test_vision_language.py's fixture, below)


def per_sequence_losses(model, batch) -> list[float]:
    """Each sequence's summed cross-entropy over its targets, in row order (a packed row's sequences start where
    its positions restart at 0)."""
    import torch

    inputs = {key: value for key, value in batch.inputs.items()}
    with torch.no_grad():  # (use_cache=False, as training runs: transformers builds the packed rows' mask only so)
        logits = model(**inputs, use_cache=False).logits.float()
    losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), reduction="none",
                                               ignore_index=-100).view(batch.targets.shape)
    positions = inputs.get("position_ids")
    sums = []
    for row in range(losses.shape[0]):
        starts = (torch.nonzero(positions[row] == 0).flatten().tolist() if positions is not None else [0])
        for start, end in zip(starts, starts[1:] + [losses.shape[1]]):
            if (batch.targets[row, start:end] != -100).any():
                sums.append(float(losses[row, start:end].sum()))
    return sums


@contextlib.contextmanager
def splitting_always():
    """Every packed row split at its sequences (the kernel weighs the split's fixed cost per call against the row's
    mask, and would keep a short test row whole)."""
    from tuneloop.kernels import packed_attention

    costs = dict(packed_attention.CALL_COST)
    packed_attention.CALL_COST.update({name: 0 for name in costs})
    try:
        yield
    finally:
        packed_attention.CALL_COST.update(costs)


@pytest.mark.parametrize("family", PACKED_FAMILIES + ["llava"])
def test_packed_rows_give_each_sequence_the_loss_it_has_alone(tmp_path, model_dirs, family):
    """`sample_packing: true` on a family whose packed sequences stay apart: a packed row of three sequences (their
    images processed together, in order) gives each sequence the summed loss it has in a row of its own (fp32)."""
    from transformers import AutoModelForImageTextToText

    from test_vision_language import save_llava
    from tuneloop.config import config_from_dict
    from tuneloop.data.collate import collator_for
    from tuneloop.data.images import image_inputs_of
    from tuneloop.kernels import packed_attention
    from tuneloop.kernels.packed_attention import PER_SEQUENCE_SDPA, loadable
    from tuneloop.resolved import resolve_run
    from tuneloop.run import prepare_data

    if family == "llava":
        model_dir, data = save_llava(tmp_path / "llava"), write_jsonl(tmp_path / "t.jsonl", caption_rows(tmp_path, 3, 4))
        keys = vlm_config(tmp_path, model_dir, data, sample_packing=True, sequence_len=256)
    else:
        model_dir = model_dirs(family)
        data = write_jsonl(tmp_path / "t.jsonl", mixed_rows(tmp_path, family, 3, seed=4))
        keys = family_config(tmp_path, model_dir, data, family, sample_packing=True)
    cfg = config_from_dict(keys)
    resolved = resolve_run(cfg)
    tokenizer, rows = prepare_data(cfg, resolved)
    images = image_inputs_of(tokenizer)
    pad = tokenizer.pad_token_id
    packed = collator_for(rows.store, pad, True, images=images)([[0, 1, 2]])
    alone = collator_for(rows.store, pad, False, images=images)([[0], [1], [2]])
    assert packed.inputs["input_ids"].shape[0] == 1 and (packed.inputs["position_ids"] == 0).sum() >= 3
    # both ways each kernel a packed run may use: transformers' SDPA under the row's block-diagonal mask, and SDPA
    # per sequence (what a packed run on a CPU chooses: the tower's own attention, not causal, stays whole)
    assert resolved.attention.used == PER_SEQUENCE_SDPA
    expected = None
    for kernel in ("sdpa", PER_SEQUENCE_SDPA):
        model = AutoModelForImageTextToText.from_pretrained(model_dir, attn_implementation=loadable(kernel)).eval()
        if expected is None:
            expected = per_sequence_losses(model, alone)
        with splitting_always():
            assert per_sequence_losses(model, packed) == pytest.approx(expected, rel=1e-5), kernel
        if kernel == PER_SEQUENCE_SDPA:  # (the language model's layers did split the row: its sequences' lengths)
            assert len(packed_attention._last_split[1][0]) == 3


def test_a_family_whose_packed_sequences_would_mix_is_refused_naming_it(tmp_path, model_dirs):
    data = write_jsonl(tmp_path / "t.jsonl", mixed_rows(tmp_path, "gemma3", 4, seed=4))
    config = write_config(tmp_path / "c.yml", **family_config(tmp_path, model_dirs("gemma3"), data, "gemma3",
                                                               sample_packing=True))
    assert_user_error(run_in_process("preprocess", str(config)), "`sample_packing: True` packs rows",
                      "a gemma3 model's packed sequences are not kept apart", "families that pack: ")


def test_llama4_is_refused_naming_its_torchvision_only_image_processor():
    """Llama 4's image processor (which cuts the tiles its image text counts) is in transformers only as a
    torchvision one: `check` refuses its hub id, and the model's config is refused, each naming why (PaddleOCR-VL's
    hub id is accepted)."""
    from transformers import Llama4Config

    from tuneloop.config.load import config_from_dict
    from tuneloop.data.images import vision_family
    from tuneloop.errors import UserError

    why = ".*Llama 4's image processor .* only as a torchvision one, with no PIL twin"
    keys = {"datasets": [{"path": "x", "type": "chat_template"}], "processor_type": "AutoProcessor"}
    with pytest.raises(UserError, match=r"(?s)is a Llama 4 vision-language model \(by its hub id\)" + why):
        config_from_dict({**keys, "base_model": "meta-llama/Llama-4-Scout-17B-16E-Instruct"})
    with pytest.raises(UserError, match="(?s)is a llama4 vision-language model; tuneloop trains " + why):
        vision_family(Llama4Config(), "tiny-llama4")
    assert config_from_dict({**keys, "base_model": "PaddlePaddle/PaddleOCR-VL"}).processor_type == "AutoProcessor"
