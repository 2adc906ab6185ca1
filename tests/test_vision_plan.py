"""A vision-language run's plan and its inputs: the vision tower's FLOPs counted per image (plan/flops.py), rows
shown with their images collapsed (`preprocess --show`), axolotl's processor keys (`processor_kwargs`,
`image_size`, `image_resize_algorithm`), and bad image input refused in one line, exit 2, nothing written. Tiny
models and processors are built here (test_vision_language.py's), images drawn with PIL."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_user_error, run_in_process, write_config, write_jsonl
from test_vision_language import QUESTION, caption_rows, plan_of, save_qwen2_vl, tiny_tokenizer, vlm_config

# the tiny LLaVA below: a 3-layer CLIP tower over 28×28 crops (2×2 patches of 14 pixels and the class position),
# read at vision_feature_layer -2 (its last layer runs forward only), a 2-layer LLaMA
TEXT = dict(hidden=64, ffn=128, layers=2, heads=4, kv_heads=2)
TOWER = dict(hidden=32, ffn=64, layers=3, heads=2, image=28, patch=14)


def save_llava(target: Path) -> Path:
    import torch
    from transformers import CLIPImageProcessorPil, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    from tuneloop.data.chat_template_texts import LLAVA

    tokenizer = tiny_tokenizer(["<|endoftext|>", "<image>", "<pad>"], "<|endoftext|>", "<pad>",
                               extra_special_tokens={"image_token": "<image>"})
    images = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    LlavaProcessor(image_processor=images, tokenizer=tokenizer, chat_template=LLAVA, patch_size=14,
                   vision_feature_select_strategy="default", num_additional_image_tokens=1).save_pretrained(target)
    config = LlavaConfig(
        text_config=dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=TEXT["hidden"],
                         intermediate_size=TEXT["ffn"], num_hidden_layers=TEXT["layers"],
                         num_attention_heads=TEXT["heads"], num_key_value_heads=TEXT["kv_heads"],
                         max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(model_type="clip_vision_model", hidden_size=TOWER["hidden"],
                           intermediate_size=TOWER["ffn"], num_hidden_layers=TOWER["layers"],
                           num_attention_heads=TOWER["heads"], image_size=TOWER["image"],
                           patch_size=TOWER["patch"], projection_dim=32),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-2,
        vision_feature_select_strategy="default")
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(target)
    return target


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory) -> Path:
    return save_llava(tmp_path_factory.mktemp("tiny_llava_3"))


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    return save_qwen2_vl(tmp_path_factory.mktemp("tiny_qwen2_vl"))


# ---- FLOPs ---------------------------------------------------------------------------------------------------
def llava_image_flops(trained: bool) -> float:
    """One image through the tiny LLaVA's tower and projector, counted by hand from the sizes above."""
    h, f, layers = TOWER["hidden"], TOWER["ffn"], TOWER["layers"]
    patches = (TOWER["image"] // TOWER["patch"]) ** 2
    positions, tokens = patches + 1, patches  # (the class position; "default" drops its feature)
    patch_weights, layer_weights, projector = 3 * TOWER["patch"] ** 2 * h, 4 * h * h + 2 * h * f, \
        h * TEXT["hidden"] + TEXT["hidden"] ** 2
    attention = 4 * h * positions  # per position and layer, forward
    if not trained:  # forward only
        return (2 * patch_weights * patches + layers * positions * (2 * layer_weights + attention)
                + 2 * projector * tokens)
    reached = layers - 1  # vision_feature_layer -2: the last layer's output is never read
    return (4 * patch_weights * patches  # forward and the weights' gradient; pixels need none
            + reached * positions * (6 * layer_weights + 3 * attention)
            + (layers - reached) * positions * (2 * layer_weights + attention)
            + 6 * projector * tokens)


def text_flops(lengths: np.ndarray, targets: int, vocabulary: int) -> float:
    """The language model over rows of these lengths (image tokens included), its head only where a target is
    (the chunked loss), attention causal within each row."""
    d, f, layers, kv = TEXT["hidden"], TEXT["ffn"], TEXT["layers"], TEXT["kv_heads"] * TEXT["hidden"] // TEXT["heads"]
    body = layers * (2 * d * d + 2 * d * kv + 3 * d * f)
    return 6 * body * lengths.sum() + 6 * d * vocabulary * targets + 12 * layers * d * (lengths * (lengths + 1) / 2).sum()


@pytest.mark.parametrize("frozen", [False, True])
def test_plan_flops_per_step_of_a_tiny_llava_equal_a_hand_count(tmp_path, llava_dir, frozen):
    """8 rows in 2 steps: the plan's FLOPs per step are the hand count, the tower per image (8 of them) and the
    language model per token; `freeze_mm_modules` leaves the tower and projector their forward alone."""
    from transformers import AutoTokenizer

    from tuneloop.config import config_from_dict
    from tuneloop.resolved import resolve_run
    from tuneloop.run import prepare_data

    data = write_jsonl(tmp_path / "train.jsonl", caption_rows(tmp_path, 8, seed=1))
    keys = vlm_config(tmp_path, llava_dir, data, max_steps=2, freeze_mm_modules=frozen or None)
    plan = plan_of(write_config(tmp_path / "c.yml", **keys))
    _, rows = prepare_data(config_from_dict(keys), resolve_run(config_from_dict(keys)))
    lengths = np.asarray(rows.store["length"], dtype=np.float64)
    targets = int(np.asarray(rows.store["n_targets"]).sum())
    assert plan["total_steps"] == 2 and plan["total_real_tokens"] == lengths.sum()  # (the whole epoch, once)
    vision = 8 * llava_image_flops(not frozen)
    hand = (text_flops(lengths, targets, len(AutoTokenizer.from_pretrained(llava_dir))) + vision) / 2
    assert plan["flops_per_step"] == pytest.approx(hand, rel=1e-9)
    assert plan["vision_flops"]["images"] == 8 and plan["vision_flops"]["tower_positions"] == 8 * 5
    assert plan["vision_flops"]["share"] == pytest.approx(vision / (2 * hand), rel=1e-9)
    print(f"\nfrozen={frozen}: {plan['flops_per_step']:,.0f} FLOPs per step, vision "
          f"{plan['vision_flops']['share']:.1%}; the old count (the tower's weights per text token) would say "
          f"{old_count(llava_dir, lengths, targets, frozen) / 2:,.0f}")
    text = run_in_process("plan", str(write_config(tmp_path / "c.yml", **keys)))
    assert f"vision tower and projector {plan['vision_flops']['share']:.1%} of a step's FLOPs (8 images" in text.stdout


def old_count(model_dir: Path, lengths: np.ndarray, targets: int, frozen: bool) -> float:
    """What flops.py counted before the image side had its own count: every Linear, the tower's too, per token."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from tuneloop.plan.model_facts import count_matmul_weights
    from tuneloop.plan.flops import count_flops

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    if frozen:
        for name, parameter in model.named_parameters():
            if "vision_tower" in name or "multi_modal_projector" in name:
                parameter.requires_grad_(False)
    frozen_weights, trained = count_matmul_weights(model)
    head = TEXT["hidden"] * config.text_config.vocab_size
    skipped = 6 * head * (1 - targets / lengths.sum())
    return count_flops(config.text_config, frozen_weights, trained, lengths, skipped).per_token * lengths.sum()


def flop_counter_total(model, **inputs) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        model(**inputs, labels=inputs["input_ids"], use_cache=False).loss.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("frozen", [False, True])
def test_torchs_flop_counter_agrees_with_the_count_on_one_forward_and_backward(llava_dir, frozen):
    """FlopCounterMode over a real step of 3 rows (eager attention: it computes the whole square of scores, where
    the plan counts a causal row's half, the model's work; that difference is added back, nothing else)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from tuneloop.data.images import VISION_FAMILIES
    from tuneloop.plan.model_facts import count_matmul_weights
    from tuneloop.plan.flops import count_flops, image_flops, vision_weights

    model = AutoModelForImageTextToText.from_pretrained(llava_dir, attn_implementation="eager")
    if frozen:
        for name, parameter in model.named_parameters():
            if "vision_tower" in name or "multi_modal_projector" in name:
                parameter.requires_grad_(False)
    rows, length = 3, 20
    ids = torch.randint(10, 250, (rows, length))
    ids[:, 2:6] = model.config.image_token_id
    measured = flop_counter_total(model, input_ids=ids, pixel_values=torch.randn(rows, 3, 28, 28))
    vision = vision_weights(model, model.config, VISION_FAMILIES["llava"])
    frozen_weights, trained = count_matmul_weights(model)
    text = count_flops(model.config.text_config, frozen_weights - vision.in_text_count[0],
                       trained - vision.in_text_count[1], np.array([length])).per_token
    square = 12 * TEXT["layers"] * TEXT["hidden"] * (length * length - length * (length + 1) / 2)
    counted = rows * (length * text + square + image_flops(vision, 4)[0])
    assert measured == pytest.approx(counted, rel=1e-9)
    assert image_flops(vision, 4)[0] == llava_image_flops(not frozen)


def test_qwen2_vl_counts_its_patch_grid_before_the_merge(qwen_dir):
    """Qwen2-VL's tower runs 4 patches per image token (the 2×2 merge), its merger once per token; two images of
    different sizes in one step, against FlopCounterMode."""
    import torch
    from transformers import AutoModelForImageTextToText

    from tuneloop.data.images import VISION_FAMILIES
    from tuneloop.plan.flops import image_flops, vision_weights

    model = AutoModelForImageTextToText.from_pretrained(qwen_dir, attn_implementation="eager")
    grids = torch.tensor([[1, 4, 4], [1, 4, 2]])  # 16 and 8 patches: 4 and 2 image tokens
    vision = vision_weights(model, model.config, VISION_FAMILIES["qwen2_vl"])
    with_images = torch.zeros(2, 12, dtype=torch.long) + 20
    with_images[0, 1:5] = with_images[1, 1:3] = model.config.image_token_id
    pixels = torch.randn(24, 3 * 2 * 14 * 14)
    image_inputs = dict(pixel_values=pixels, image_grid_thw=grids,
                        mm_token_type_ids=(with_images == model.config.image_token_id).long())
    measured_with = flop_counter_total(model, input_ids=with_images, **image_inputs)
    measured_without = flop_counter_total(model, input_ids=torch.zeros(2, 12, dtype=torch.long) + 20)
    assert image_flops(vision, 4)[1] == 16 and image_flops(vision, 2)[1] == 8
    # the same text ids with and without the images: the difference is the image side (and the image tokens'
    # embeddings, which are looked up, not multiplied)
    assert measured_with - measured_without == pytest.approx(image_flops(vision, 4)[0] + image_flops(vision, 2)[0],
                                                             rel=1e-9)


@pytest.mark.parametrize("frozen", [False, True])
def test_mistral3_counts_pixtrals_patch_grid_before_its_patch_merger(tmp_path, frozen):
    """Mistral 3's Pixtral tower runs 4 patches per [IMG] token (14-pixel patches, merged 2×2 by the projector's
    patch merger, once per token): one image a step (eager attention's square is then the image's own), a square
    and a half-width image, against FlopCounterMode."""
    import torch
    from transformers import AutoModelForImageTextToText
    from vision_family_models import save_mistral3

    from tuneloop.data.images import VISION_FAMILIES
    from tuneloop.plan.flops import image_flops, vision_weights

    model = AutoModelForImageTextToText.from_pretrained(save_mistral3(tmp_path), attn_implementation="eager")
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(not frozen or not ("vision_tower" in name or "multi_modal_projector" in name))
    vision = vision_weights(model, model.config, VISION_FAMILIES["mistral3"])
    text_only = flop_counter_total(model, input_ids=torch.zeros(1, 12, dtype=torch.long) + 20)
    for (height, width), tokens in (((56, 56), 4), ((56, 28), 2)):
        ids = torch.zeros(1, 12, dtype=torch.long) + 20
        ids[0, 1:1 + tokens] = model.config.image_token_id
        measured = flop_counter_total(model, input_ids=ids, pixel_values=torch.randn(1, 3, height, width),
                                      image_sizes=torch.tensor([[height, width]]))
        assert image_flops(vision, tokens)[1] == 4 * tokens
        assert measured - text_only == pytest.approx(image_flops(vision, tokens)[0], rel=1e-9)


@pytest.mark.parametrize("family", ["qwen3_vl", "internvl"])
def test_qwen3_vl_and_internvl_count_their_towers_positions(tmp_path, family):
    """Qwen3-VL: 4 patches per image token, its merger and DeepStack merger once per token; InternVL: each 28-pixel
    tile's 4 patches and class position, pixel-shuffled to 1 token. Two images of different sizes in one step, the
    difference with and without them against FlopCounterMode."""
    import torch
    from transformers import AutoModelForImageTextToText
    from vision_family_models import save_internvl, save_qwen3_vl

    from tuneloop.data.images import VISION_FAMILIES
    from tuneloop.plan.flops import image_flops, vision_weights

    model_dir = (save_qwen3_vl if family == "qwen3_vl" else save_internvl)(tmp_path / family)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, attn_implementation="eager")
    vision = vision_weights(model, model.config, VISION_FAMILIES[family])
    with_images = torch.zeros(2, 12, dtype=torch.long) + 20
    if family == "qwen3_vl":  # 16 and 8 patches of 16 pixels: 4 and 2 image tokens
        tokens, positions = (4, 2), (16, 8)
        with_images[0, 1:5] = with_images[1, 1:3] = model.config.image_token_id
        image_inputs = dict(pixel_values=torch.randn(24, 3 * 2 * 16 * 16),
                            image_grid_thw=torch.tensor([[1, 4, 4], [1, 4, 2]]),
                            mm_token_type_ids=(with_images == model.config.image_token_id).long())
    else:  # 5 and 3 tiles (4 patches and the class position each): 5 and 3 image tokens
        tokens, positions = (5, 3), (25, 15)
        with_images[0, 1:6] = with_images[1, 1:4] = model.config.image_token_id
        image_inputs = dict(pixel_values=torch.randn(8, 3, 28, 28))
    assert tuple(image_flops(vision, count)[1] for count in tokens) == positions
    measured_with = flop_counter_total(model, input_ids=with_images, **image_inputs)
    measured_without = flop_counter_total(model, input_ids=torch.zeros(2, 12, dtype=torch.long) + 20)
    assert measured_with - measured_without == pytest.approx(sum(image_flops(vision, count)[0] for count in tokens),
                                                             rel=1e-9)


def test_paddleocr_vl_counts_its_patch_grid_before_its_projectors_merge(tmp_path):
    """PaddleOCR-VL's NaViT tower runs 4 patches of 14 pixels per image token, each image's attention apart, and its
    projector merges them 2×2 once per token: two images of different sizes in one step, trained and with the tower
    and projector frozen, the difference with and without them against FlopCounterMode."""
    import torch
    from transformers import AutoModelForImageTextToText
    from vision_family_models import save_paddleocr_vl

    from tuneloop.data.images import VISION_FAMILIES
    from tuneloop.plan.flops import image_flops, vision_weights

    model = AutoModelForImageTextToText.from_pretrained(save_paddleocr_vl(tmp_path / "paddleocr_vl"),
                                                        attn_implementation="eager")
    image_id = model.config.image_token_id
    with_images = torch.zeros(2, 12, dtype=torch.long) + 20
    with_images[0, 1:5] = with_images[1, 1:3] = image_id
    image_inputs = dict(pixel_values=torch.randn(24, 3, 14, 14), image_grid_thw=torch.tensor([[1, 4, 4], [1, 2, 4]]),
                        mm_token_type_ids=(with_images == image_id).long())
    for frozen in (False, True):
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(not frozen or not any(part in name.split(".") for part in ("visual", "projector")))
        vision = vision_weights(model, model.config, VISION_FAMILIES["paddleocr_vl"])
        assert (image_flops(vision, 4)[1], image_flops(vision, 2)[1]) == (16, 8)
        measured_with = flop_counter_total(model, input_ids=with_images, **image_inputs)
        measured_without = flop_counter_total(model, input_ids=torch.zeros(2, 12, dtype=torch.long) + 20)
        assert measured_with - measured_without == pytest.approx(image_flops(vision, 4)[0] + image_flops(vision, 2)[0],
                                                                 rel=1e-9), frozen


@pytest.mark.parametrize("frozen", [False, True])
def test_gemma4_counts_every_patch_of_its_budget_and_its_pooler(tmp_path, frozen):
    """Gemma 4's image processor pads each image's patches to max_soft_tokens × 3² (630 here) and the tower runs
    them all; its pooler averages them into 70 by a matmul, of which the image's own soft tokens (64 and 55) reach
    the projection. A square and a wide image in one step, the difference with and without them against
    FlopCounterMode."""
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText
    from vision_family_models import save_gemma4

    from tuneloop.data.images import VISION_FAMILIES
    from tuneloop.plan.flops import image_flops, vision_weights

    model_dir = save_gemma4(tmp_path / "gemma4")
    model = AutoModelForImageTextToText.from_pretrained(model_dir, attn_implementation="eager")
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(not frozen or not ("vision_tower" in name or "embed_vision" in name))
    image_processor = AutoImageProcessor.from_pretrained(model_dir)
    vision = vision_weights(model, model.config, VISION_FAMILIES["gemma4"], image_processor)
    pixels = image_processor(images=[Image.new("RGB", (28, 28)), Image.new("RGB", (56, 28))], return_tensors="pt")
    tokens = pixels.pop("num_soft_tokens_per_image").tolist()
    assert tokens == [64, 55]
    with_images = torch.zeros(2, 80, dtype=torch.long) + 20
    with_images[0, 1:65] = with_images[1, 1:56] = model.config.image_token_id
    measured_with = flop_counter_total(model, input_ids=with_images, **pixels,
                                       mm_token_type_ids=(with_images == model.config.image_token_id).long())
    measured_without = flop_counter_total(model, input_ids=torch.zeros(2, 80, dtype=torch.long) + 20)
    assert [image_flops(vision, count)[1] for count in tokens] == [630, 630]
    assert measured_with - measured_without == pytest.approx(sum(image_flops(vision, count)[0] for count in tokens),
                                                             rel=1e-9)


# ---- preprocess --show ---------------------------------------------------------------------------------------
def test_preprocess_show_collapses_each_images_tokens(tmp_path, llava_dir):
    rows = caption_rows(tmp_path, 3, seed=2)
    rows[1]["messages"][0]["content"].insert(0, dict(rows[1]["messages"][0]["content"][0]))  # two images
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    config = write_config(tmp_path / "c.yml", **vlm_config(tmp_path, llava_dir, data))
    result = run_in_process("preprocess", str(config), "--show", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    shown = result.stdout.split("--- row ")[1:]
    assert len(shown) == 3 and "<image>" not in result.stdout
    assert [part.count("⟨image ") for part in shown] == [1, 2, 1]
    assert "⟨image 1: 4 tokens⟩" in shown[0] and "⟨image 2: 4 tokens⟩" in shown[1]
    assert QUESTION in shown[0]


# ---- axolotl's processor keys --------------------------------------------------------------------------------
def qwen_rows_and_store(tmp_path: Path, qwen_dir: Path, size: tuple[int, int], **keys):
    from tuneloop.config import config_from_dict
    from tuneloop.resolved import resolve_run
    from tuneloop.run import prepare_data

    data = write_jsonl(tmp_path / "train.jsonl", caption_rows(tmp_path, 4, seed=3, size=size))
    cfg = config_from_dict(vlm_config(tmp_path, qwen_dir, data, chat_template="qwen2_vl", **keys))
    return prepare_data(cfg, resolve_run(cfg))


def collated(tokenizer, rows):
    from tuneloop.data.collate import collator_for
    from tuneloop.data.images import image_inputs_of

    return collator_for(rows.store, tokenizer.pad_token_id, False, images=image_inputs_of(tokenizer))([[0, 1]])


def test_processor_kwargs_reach_the_image_processor_and_the_token_counts(tmp_path, qwen_dir):
    """max_pixels 28×28: a 56×56 square becomes 1 image token (4 without it), in the cached rows and in the
    grid the collator gives the model."""
    tokenizer, rows = qwen_rows_and_store(tmp_path, qwen_dir, (56, 56), processor_kwargs={"max_pixels": 28 * 28})
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert (rows.store.tokens("input_ids", 0) == pad).sum() == 1 and rows.store.images(0)[0][1] == 1
    assert collated(tokenizer, rows).inputs["image_grid_thw"].tolist() == [[1, 2, 2]] * 2


@pytest.mark.parametrize("algorithm", [None, "bicubic"])
def test_image_size_resizes_before_the_processor_as_axolotl_does(tmp_path, qwen_dir, algorithm):
    """An int pads the image (in proportion, black) to that square; [width, height] stretches it; the filter is
    image_resize_algorithm's (bilinear when unset). The tokens come from the resized size, the pixels are the
    processor's of the resized image."""
    from PIL import Image, ImageOps
    from transformers import AutoImageProcessor

    method = Image.Resampling.BICUBIC if algorithm else Image.Resampling.BILINEAR
    processor = AutoImageProcessor.from_pretrained(qwen_dir)
    for size, image_size, grid in (((56, 28), 56, [1, 4, 4]), ((56, 56), [28, 56], [1, 4, 2])):
        folder = tmp_path / f"{image_size}"
        tokenizer, rows = qwen_rows_and_store(folder, qwen_dir, size, image_size=image_size,
                                              image_resize_algorithm=algorithm)
        batch = collated(tokenizer, rows).inputs
        assert batch["image_grid_thw"].tolist() == [grid] * 2
        assert rows.store.images(0)[0][1] == grid[1] * grid[2] // 4
        originals = [Image.open(rows.store.images(i)[0][0].removeprefix("path:")).convert("RGB") for i in (0, 1)]
        resized = [ImageOps.pad(image, (image_size, image_size), method=method, color=(0, 0, 0))
                   if isinstance(image_size, int) else image.resize(tuple(image_size), method) for image in originals]
        expected = processor(images=resized, return_tensors="pt")["pixel_values"]
        assert (batch["pixel_values"] == expected).all()


@pytest.mark.parametrize("problem", ["unknown kwarg", "reserved kwarg", "algorithm alone", "bad algorithm",
                                     "text model"])
def test_processor_keys_refused_in_one_line(tmp_path, qwen_dir, tiny_model_dir, problem):
    model, extra = qwen_dir, {}
    if problem == "unknown kwarg":
        extra = {"processor_kwargs": {"max_pixel": 784}}
        expected = ("processor_kwargs: max_pixel is not a setting of Qwen2VLImageProcessorPil", "max_pixels")
    elif problem == "reserved kwarg":
        extra = {"processor_kwargs": {"revision": "main"}}
        expected = ("processor_kwargs", "revision_of_model")
    elif problem == "algorithm alone":
        extra = {"image_resize_algorithm": "lanczos"}
        expected = ("image_resize_algorithm: lanczos", "image_size is not set")
    elif problem == "bad algorithm":
        extra = {"image_size": 56, "image_resize_algorithm": "nearest"}
        expected = ("image_resize_algorithm", "bilinear, bicubic, lanczos")
    else:
        model, extra = tiny_model_dir, {"processor_type": None, "image_size": 56, "chat_template": "chatml"}
        expected = ("image_size: 56", "text-only model")
    refused_writing_nothing(tmp_path, model, caption_rows(tmp_path, 4, seed=5), extra, *expected)


# ---- bad input -----------------------------------------------------------------------------------------------
def refused_writing_nothing(tmp_path: Path, model: Path, rows: list[dict], extra: dict, *expected: str) -> None:
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    keys = vlm_config(tmp_path, model, data, **extra)
    result = run_in_process("train", str(write_config(tmp_path / "c.yml", **keys)))
    assert_user_error(result, *expected)
    assert not Path(keys["output_dir"]).exists()
    prepared = Path(keys["dataset_prepared_path"])
    assert not prepared.exists() or not any(prepared.rglob("rows.json")), sorted(prepared.rglob("*"))


@pytest.mark.parametrize("problem", ["missing", "not an image", "truncated", "text model", "not a processor",
                                     "too large"])
def test_bad_image_input_is_refused_in_one_line_and_nothing_is_written(tmp_path, llava_dir, qwen_dir,
                                                                       tiny_model_dir, problem):
    """No family tuneloop trains has a number of images per row that transformers refuses (Mllama's and
    Idefics3's processors take any number): a row's images are bounded by sequence_len, checked image by image."""
    rows, model, extra = caption_rows(tmp_path, 4, seed=6), llava_dir, {}
    image = tmp_path / "images" / "6-2.png"
    if problem == "missing":
        rows[2]["messages"][0]["content"][0]["path"] = "images/nowhere.png"
        expected = ("train.jsonl:3", "nowhere.png", "does not exist")
    elif problem == "not an image":
        image.write_bytes(b"this is text, not a PNG")
        expected = ("train.jsonl:3", str(image), "cannot identify image file")
    elif problem == "truncated":
        image.write_bytes(image.read_bytes()[:-30])  # the last chunks (IDAT's end, IEND) cut off
        expected = ("train.jsonl:3", f"cannot decode image {image}", "runcated")
    elif problem == "text model":
        model, extra = tiny_model_dir, {"processor_type": None, "chat_template": "chatml"}
        expected = ("train.jsonl:1", "'image'", "text-only model")
    elif problem == "not a processor":
        extra = {"processor_type": "AutoTokenizer"}
        expected = ("processor_type: AutoTokenizer", "not a processor")
    else:  # a 112×112 square is 16 tokens once max_pixels lets it be (the tiny processor's own stops at 4)
        rows = caption_rows(tmp_path, 4, seed=6, size=(112, 112))
        model = qwen_dir
        extra = {"chat_template": "qwen2_vl", "processor_kwargs": {"max_pixels": 112 * 112}, "sequence_len": 16}
        expected = ("train.jsonl:1", "image 1", "112×112", "becomes 16 image tokens", "sequence_len=16",
                    "processor_kwargs: {max_pixels: 6272}")
    refused_writing_nothing(tmp_path, model, rows, extra, *expected)


def test_a_jpeg_cut_short_is_refused_when_preparing(tmp_path, llava_dir):
    """A JPEG cut short in its image data has a header that reads fine (and PIL's verify passes it): preparing
    decodes it at 1/8 scale to find out."""
    from PIL import Image

    rows = caption_rows(tmp_path, 4, seed=7)
    jpeg = tmp_path / "images" / "cut.jpg"
    noise = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(noise).save(jpeg, quality=95)
    whole = jpeg.read_bytes()
    jpeg.write_bytes(whole[:whole.index(b"\xff\xda") + 100])  # the start of scan, and 100 bytes of its data
    with Image.open(jpeg) as opened:
        assert opened.size == (64, 64)
    rows[1]["messages"][0]["content"][0]["path"] = "images/cut.jpg"
    refused_writing_nothing(tmp_path, llava_dir, rows, {}, "train.jsonl:2", f"cannot decode image {jpeg}",
                            "image file is truncated")


# ---- memory: the tower's activations ---------------------------------------------------------------------------
@pytest.mark.parametrize("ffn", [256, 512])
def test_the_towers_activations_are_what_autograd_saves_for_its_backward(ffn):
    """A CLIP tower of width 128 over 224-pixel images (257 positions each), every layer reached by the loss: what
    autograd saves in its forward (saved-tensor hooks; its weights and the pixels left out) is the plan's count to
    within 5%, at an MLP of twice and of four times the width; a frozen tower saves nothing, and is counted so."""
    import torch
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    from tuneloop.data.images import VISION_FAMILIES
    from tuneloop.plan.flops import vision_weights
    from tuneloop.plan.memory import vision_activation_bytes

    config = LlavaConfig(
        text_config=dict(model_type="llama", vocab_size=300, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2),
        vision_config=dict(model_type="clip_vision_model", hidden_size=128, intermediate_size=ffn,
                           num_hidden_layers=2, num_attention_heads=4, image_size=224, patch_size=14),
        image_token_id=299, vision_feature_layer=-1, vision_feature_select_strategy="default")
    config.vision_config._attn_implementation = "sdpa"
    model = LlavaForConditionalGeneration(config)
    pixels = torch.randn(3, 3, 224, 224)

    def saved_by_the_tower() -> int:
        weights = {parameter.untyped_storage().data_ptr() for parameter in model.parameters()}
        saved = {}

        def keep(tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in weights and storage.data_ptr() != pixels.untyped_storage().data_ptr():
                saved[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            model.model.vision_tower(pixels)
        return sum(saved.values())

    vision = vision_weights(model, config, VISION_FAMILIES["llava"])
    counted = vision_activation_bytes(vision, 3 * 257, "fp32", checkpointing=False)
    measured = saved_by_the_tower()
    print(f"\nMLP {ffn}: autograd saved {measured:,} bytes, the plan counts {counted:,.0f}")
    assert counted == pytest.approx(measured, rel=0.05)
    for parameter in model.model.vision_tower.parameters():
        parameter.requires_grad_(False)
    frozen = vision_weights(model, config, VISION_FAMILIES["llava"])
    assert saved_by_the_tower() == 0 and vision_activation_bytes(frozen, 3 * 257, "fp32", False) == 0


@pytest.mark.parametrize("frozen", [False, True])
def test_the_plans_memory_counts_the_towers_activations_for_a_micro_batchs_images(tmp_path, llava_dir, frozen):
    """The tiny LLaVA (vision_feature_layer -2: of its 3 layers the loss reaches 2), rows of two images, 2 rows a
    micro-batch: the plan's tower activations are the count for 4 images' 20 positions; none when frozen."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from tuneloop.data.images import VISION_FAMILIES
    from tuneloop.plan.flops import vision_weights
    from tuneloop.plan.memory import vision_activation_bytes

    rows = caption_rows(tmp_path, 8, seed=1)
    for row in rows:
        row["messages"][0]["content"].insert(0, dict(row["messages"][0]["content"][0]))
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    keys = vlm_config(tmp_path, llava_dir, data, micro_batch_size=2, bf16=False, freeze_mm_modules=frozen or None)
    counted = plan_of(write_config(tmp_path / "c.yml", **keys))["memory"]["per_rank_bytes"].get("vision_activations")
    if frozen:
        assert counted is None
        return
    config = AutoConfig.from_pretrained(llava_dir)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    vision = vision_weights(model, config, VISION_FAMILIES["llava"])
    assert vision.gradient_layers == 2
    assert counted == int(vision_activation_bytes(vision, 4 * 5, "fp32", False)) > 0


def test_a_token_budget_gives_rows_of_many_images_smaller_micro_batches(tmp_path, llava_dir):
    """Rows of one and of four images (about 30 and 44 tokens here) under `max_tokens_per_micro_batch: 128`: no
    micro-batch is wider than the budget as padded, those of four-image rows hold fewer rows (2 against 4), and the
    run is the plan."""
    from tuneloop.config import config_from_dict
    from tuneloop.resolved import resolve_run
    from tuneloop.run import prepare_data

    rows = caption_rows(tmp_path, 16, seed=2)
    for row in rows[::2]:
        row["messages"][0]["content"][:1] *= 4
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    keys = vlm_config(tmp_path, llava_dir, data, micro_batch_size=4, max_tokens_per_micro_batch=128,
                      sequence_len=64, bf16=False)
    config = write_config(tmp_path / "c.yml", **keys)
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == plan["total_steps"] and summary["targets_collated"] == plan["total_trainable_tokens"]
    assert plan["max_micro_batch_tokens"] <= 128

    from tuneloop.data.batching import epoch_batches
    from tuneloop.plan.build import train_spec

    cfg = config_from_dict(keys)
    resolved = resolve_run(cfg)
    _, prepared = prepare_data(cfg, resolved)
    lengths = np.asarray(prepared.store["length"])
    batches = epoch_batches(lengths, train_spec(cfg, resolved, 1), 0)
    per_batch = {len(batch): max(int(lengths[row[0]]) for row in batch) for batch in batches}
    assert set(per_batch) == {4, 2} and per_batch[2] > per_batch[4]
