"""Vision-language fine-tuning (model kind vision_language, data/images.py): tiny LLaVA and Qwen2-VL models and
processors built here from configs (nothing downloaded), coloured squares drawn with PIL, and a caption task the
model can learn ("What colour is this?" -> "red")."""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_user_error, read_metrics, run_in_process, write_config, write_jsonl

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220), "yellow": (230, 220, 30)}
QUESTION = "What colour is this?"
CORPUS = [f"{QUESTION} " + " ".join(COLOURS) + " USER: ASSISTANT: system user assistant You are a helpful assistant."]


def tiny_tokenizer(specials: list[str], eos: str, pad: str, **extra):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos, pad_token=pad, **extra)


def save_llava(target: Path) -> Path:
    """LLaVA: a 2-layer CLIP tower over 28×28 crops (4 patches -> 4 image tokens), a 2-layer LLaMA."""
    import torch
    from transformers import CLIPImageProcessorPil, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    from tuneloop.data.chat_template_texts import LLAVA

    tokenizer = tiny_tokenizer(["<|endoftext|>", "<image>", "<pad>"], "<|endoftext|>", "<pad>",
                               extra_special_tokens={"image_token": "<image>"})
    images = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    LlavaProcessor(image_processor=images, tokenizer=tokenizer, chat_template=LLAVA, patch_size=14,
                   vision_feature_select_strategy="default", num_additional_image_tokens=1).save_pretrained(target)
    config = LlavaConfig(
        text_config=dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-1,
        vision_feature_select_strategy="default")
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(target)
    return target


def save_qwen2_vl(target: Path, version: str = "2") -> Path:
    """Qwen2-VL (version "2.5": Qwen2.5-VL, its windowed vision blocks and gated MLP): one vision block,
    28×28..56×56 pixels (1–4 image tokens after the 2×2 merge), a 2-layer decoder. Its processor needs torchvision
    (videos), not installed here: the image processor and tokenizer are saved, which is what a Qwen2-VL folder
    holds (Qwen2.5-VL's uses the same image processor)."""
    import torch
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil)

    from tuneloop.data.chat_template_texts import QWEN2_VL

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|image_pad|>", "<|video_pad|>"]
    tokenizer = tiny_tokenizer(specials, "<|im_end|>", "<|endoftext|>")
    tokenizer.chat_template = QWEN2_VL
    tokenizer.save_pretrained(target)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56).save_pretrained(target)
    ids = tokenizer.convert_tokens_to_ids
    if version == "2.5":
        config_class, model_class = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, out_hidden_size=64, num_heads=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[0])
    else:
        config_class, model_class = Qwen2VLConfig, Qwen2VLForConditionalGeneration
        vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2)
    config = config_class(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=vision,
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))
    torch.manual_seed(0)
    model_class(config).save_pretrained(target)
    return target


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory) -> Path:
    return save_llava(tmp_path_factory.mktemp("tiny_llava"))


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    return save_qwen2_vl(tmp_path_factory.mktemp("tiny_qwen2_vl"))


def square(colour: str, size: tuple[int, int], seed: int):
    """A square of the colour, its shade jittered (held-out images are not training images)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    shade = np.clip(np.asarray(COLOURS[colour]) + rng.integers(-25, 26, 3), 0, 255)
    return Image.new("RGB", size, tuple(int(v) for v in shade))


def caption_rows(folder: Path, count: int, seed: int, size=(32, 32), as_base64_every: int = 0) -> list[dict]:
    """Chat rows: an image part (a file beside the data, or base64) and the question; the answer is its colour."""
    rows, names = [], list(COLOURS)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    for i in range(count):
        colour = names[(i + seed) % len(names)]
        image = square(colour, size, seed * 1000 + i)
        if as_base64_every and i % as_base64_every == 0:
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            part = {"type": "image", "base64": base64.b64encode(buffer.getvalue()).decode()}
        else:
            name = f"images/{seed}-{i}.png"
            image.save(folder / name)
            part = {"type": "image", "path": name}
        rows.append({"messages": [
            {"role": "user", "content": [part, {"type": "text", "text": QUESTION}]},
            {"role": "assistant", "content": [{"type": "text", "text": colour}]}]})
    return rows


def vlm_config(tmp_path: Path, model_dir: Path, data: Path, **overrides) -> dict:
    keys = {"base_model": str(model_dir), "processor_type": "AutoProcessor",
            "datasets": [{"path": str(data), "type": "chat_template"}],
            "dataset_prepared_path": str(tmp_path / "prepared"), "output_dir": str(tmp_path / "out"),
            "sequence_len": 64, "micro_batch_size": 4, "gradient_accumulation_steps": 1, "num_epochs": 1,
            "learning_rate": 3e-3, "logging_steps": 1, "save_strategy": "no", "seed": 7, "bf16": False,
            "sample_packing": False, "dataset_processes": 1}
    keys.update(overrides)
    return keys


def plan_of(config: Path) -> dict:
    result = run_in_process("plan", str(config), "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def test_llava_rows_mask_image_tokens_and_train_the_answer(tmp_path, llava_dir):
    from tuneloop.config import config_from_dict
    from tuneloop.resolved import resolve_run
    from tuneloop.run import prepare_data

    data = write_jsonl(tmp_path / "train.jsonl", caption_rows(tmp_path, 6, seed=1, as_base64_every=3))
    cfg = config_from_dict(vlm_config(tmp_path, llava_dir, data))
    tokenizer, rows = prepare_data(cfg, resolve_run(cfg))
    store = rows.store
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    for index in range(len(store)):
        ids, labels = store.tokens("input_ids", index), store.tokens("labels", index)
        assert (ids == image_id).sum() == 4  # 28×28 crop, 14-pixel patches, the CLS feature dropped
        assert (labels[ids == image_id] == -100).all()
        trained = tokenizer.decode(labels[labels != -100])
        assert trained.strip() in COLOURS, trained  # the answer (and LLaVA's template writes no end marker)
        (reference, count), = store.images(index)
        assert count == 4 and reference.startswith(("path:", "base64:"))
    # the collator's batch is what the processor makes of the same text and images
    from transformers import AutoProcessor
    from tuneloop.data.collate import collator_for
    from tuneloop.data.images import image_inputs_of, open_image

    batch = collator_for(store, tokenizer.pad_token_id, False, images=image_inputs_of(tokenizer))([[0], [1]])
    processor = AutoProcessor.from_pretrained(llava_dir)
    images = [open_image(store.images(i)[0][0]).convert("RGB") for i in (0, 1)]
    expected = processor(images=images, text=["<image>"] * 2, return_tensors="pt")
    assert (batch.inputs["pixel_values"] == expected["pixel_values"]).all()
    for i in (0, 1):
        n = int(batch.inputs["attention_mask"][i].sum())
        assert (batch.inputs["input_ids"][i, :n].numpy() == store.tokens("input_ids", i)).all()


def test_the_images_column_gives_parts_without_a_source_their_images_in_order(tmp_path, llava_dir):
    """axolotl's and TRL's column form (HuggingFaceH4/llava-instruct-mix-vsft): `{"type": "image"}` parts take the
    row's `images` in order, each a path, base64 text or a datasets Image value ({"bytes", "path"}); the rows
    prepare to the same tokens and images as with the images in the parts."""
    from tuneloop.config import config_from_dict
    from tuneloop.data.images import open_image
    from tuneloop.resolved import resolve_run
    from tuneloop.run import prepare_data

    inline = caption_rows(tmp_path, 3, seed=2)
    columns = []
    for index, row in enumerate(inline):
        part = row["messages"][0]["content"][0]
        given = [part["path"], base64.b64encode((tmp_path / part["path"]).read_bytes()).decode(),
                 {"bytes": None, "path": str(tmp_path / part["path"])}][index]
        columns.append({"messages": [{**row["messages"][0], "content": [{"type": "image"},
                                                                         *row["messages"][0]["content"][1:]]},
                                     row["messages"][1]], "images": [given]})
    stores = []
    for name, rows in (("inline", inline), ("column", columns)):
        folder = tmp_path / name
        cfg = config_from_dict(vlm_config(folder, llava_dir, write_jsonl(tmp_path / f"{name}.jsonl", rows)))
        stores.append(prepare_data(cfg, resolve_run(cfg))[1].store)
    for index in range(3):
        assert (stores[0].tokens("input_ids", index) == stores[1].tokens("input_ids", index)).all()
        (inline_ref, _), = stores[0].images(index)
        (column_ref, _), = stores[1].images(index)
        assert open_image(inline_ref).tobytes() == open_image(column_ref).tobytes()
    mismatched = [dict(columns[0], images=[])]
    config = write_config(tmp_path / "bad.yml", **vlm_config(tmp_path / "bad", llava_dir,
                                                               write_jsonl(tmp_path / "bad.jsonl", mismatched)))
    assert_user_error(run_in_process("preprocess", str(config)), "bad.jsonl:1",
                      "1 image part(s) name no image and the row's `images` column holds 0")


def answer_accuracy(model_dir: Path, rows: list[dict], folder: Path) -> float:
    """How often the saved model gives the right colour the lowest summed loss after the question, among the
    four (the image tokens' and question's losses are the same for every candidate)."""
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
            text = processor.apply_chat_template([{"role": "user", "content": "<image>\n" + QUESTION},
                                                  {"role": "assistant", "content": colour}], tokenize=False)
            inputs = processor(images=[image], text=[text], return_tensors="pt")
            with torch.no_grad():
                # summed, not averaged: the colours' words have different token counts
                losses[colour] = model(**inputs, labels=inputs["input_ids"]).loss.item() * (inputs["input_ids"].shape[1] - 1)
        right += min(losses, key=losses.get) == truth
    return right / len(rows)


def test_llava_learns_the_colour_of_held_out_images(tmp_path, llava_dir):
    data = write_jsonl(tmp_path / "train.jsonl", caption_rows(tmp_path, 64, seed=1))
    held_out = caption_rows(tmp_path, 16, seed=2)
    config = write_config(tmp_path / "c.yml", **vlm_config(tmp_path, llava_dir, data, num_epochs=10,
                                                          micro_batch_size=8, warmup_steps=2))
    before = answer_accuracy(llava_dir, held_out, tmp_path)
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [line["loss"] for line in read_metrics(tmp_path / "out") if "loss" in line]
    after = answer_accuracy(tmp_path / "out", held_out, tmp_path)
    print(f"\nloss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps; held-out colour accuracy "
          f"{before:.2f} -> {after:.2f} (chance 0.25)")
    assert losses[-1] < 0.5 * losses[0]
    assert after >= 0.75  # 12 of 16 held-out squares; chance is 4 of 16


def test_llava_plan_equals_run_and_accumulation_equals_one_batch(tmp_path, llava_dir):
    """8 rows in one optimizer step: 8 rows × 1 micro-batch, or 2 micro-batches of 4 accumulated (fp32)."""
    import torch
    from safetensors.torch import load_file

    data = write_jsonl(tmp_path / "train.jsonl", caption_rows(tmp_path, 8, seed=3))
    weights = {}
    for micro, accumulation in ((8, 1), (4, 2)):
        out = tmp_path / f"out-{micro}"
        config = write_config(tmp_path / f"c{micro}.yml", **vlm_config(
            tmp_path, llava_dir, data, micro_batch_size=micro, gradient_accumulation_steps=accumulation,
            output_dir=str(out), max_steps=1, optimizer="sgd", learning_rate=0.5))
        plan = plan_of(config)
        result = run_in_process("train", str(config))
        assert result.returncode == 0, result.stderr[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        assert plan["total_steps"] == summary["steps"] == 1
        assert plan["tokens_per_step"] == summary["tokens"]  # the trained tokens, exact
        weights[micro] = load_file(out / "model.safetensors")
    for name, value in weights[8].items():
        torch.testing.assert_close(value, weights[4][name], rtol=1e-5, atol=1e-6, msg=name)


def test_qwen2_vl_plans_with_its_image_grid_and_frozen_tower(tmp_path, qwen_dir):
    """A 56×56 image is 4 image tokens by Qwen2-VL's own grid arithmetic; the image and vision start/end tokens are
    untrained; the plan's token count is the store's; freeze_mm_modules leaves the `visual` tower (merger included)
    out of the trained count."""
    from tuneloop.config import config_from_dict
    from tuneloop.resolved import resolve_run
    from tuneloop.run import prepare_data

    data = write_jsonl(tmp_path / "train.jsonl", caption_rows(tmp_path, 8, seed=4, size=(56, 56)))
    keys = vlm_config(tmp_path, qwen_dir, data, chat_template="qwen2_vl", freeze_mm_modules=True)
    cfg = config_from_dict(keys)
    tokenizer, rows = prepare_data(cfg, resolve_run(cfg))
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    framing = [tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>")]
    ids, labels = rows.store.tokens("input_ids", 0), rows.store.tokens("labels", 0)
    assert (ids == pad).sum() == 4  # 56×56 -> a 4×4 grid of 14-pixel patches, merged 2×2
    assert (labels[np.isin(ids, [pad, *framing])] == -100).all()
    assert tokenizer.decode(labels[labels != -100]).startswith(tuple(COLOURS))
    plan = plan_of(write_config(tmp_path / "c.yml", **keys))
    assert plan["train_tokens"] == int(np.asarray(rows.store["length"]).sum())
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(qwen_dir)
    visual = sum(p.numel() for n, p in model.named_parameters() if ".visual." in f".{n}")
    assert visual > 0
    assert plan["memory"]["trainable_parameters"] == sum(p.numel() for p in model.parameters()) - visual


@pytest.mark.parametrize("problem", ["missing file", "http", "text model", "not a processor"])
def test_bad_vision_input_is_one_line(tmp_path, llava_dir, tiny_model_dir, problem):
    rows = caption_rows(tmp_path, 4, seed=5)
    model = llava_dir
    extra = {}
    if problem == "missing file":
        rows[2]["messages"][0]["content"][0]["path"] = "images/nowhere.png"
        expected = ("train.jsonl:3", "nowhere.png", "does not exist")
    elif problem == "http":
        rows[1]["messages"][0]["content"][0] = {"type": "image", "url": "https://example.com/cat.png"}
        expected = ("train.jsonl:2", "https://example.com/cat.png", "no network")
    elif problem == "text model":
        model, extra = tiny_model_dir, {"processor_type": None, "chat_template": "chatml"}
        expected = ("train.jsonl:1", "'image'", "text-only model")
    else:  # (packing a family whose sequences would mix: test_vision_families.py)
        extra = {"processor_type": "LlamaForCausalLM"}
        expected = ("processor_type: LlamaForCausalLM", "not a processor")
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    config = write_config(tmp_path / "c.yml", **vlm_config(tmp_path, model, data, **extra))
    result = run_in_process("preprocess", str(config))
    assert_user_error(result, *expected)


def test_check_refuses_a_vision_family_tuneloop_cannot_train_by_its_config_or_hub_id(tmp_path):
    """`check` reads no model: the family comes from a local config.json, or from the hub id's name; the families
    the trained list holds are the ones data/images.py expands."""
    from tuneloop.config.load import config_from_dict
    from tuneloop.config.vision_names import TRAINED_VISION_TYPES, TRAINED_VISION_WORDS
    from tuneloop.data.images import VISION_FAMILIES
    from tuneloop.errors import UserError

    assert set(TRAINED_VISION_TYPES) == set(VISION_FAMILIES)
    keys = {"datasets": [{"path": "x", "type": "chat_template"}], "processor_type": "AutoProcessor"}
    with pytest.raises(UserError, match="is a Gemma 3n vision-language model \\(by its hub id\\); tuneloop trains "
                                        + re.escape(TRAINED_VISION_WORDS) + " so far, and this family asks for "
                                        "multimodal"):
        config_from_dict({**keys, "base_model": "google/gemma-3n-E4B-it"})
    local = tmp_path / "tiny-idefics2"  # (glm4v, the example here before, is trained now)
    local.mkdir()
    (local / "config.json").write_text('{"model_type": "idefics2"}')
    with pytest.raises(UserError, match="is a idefics2 vision-language model \\(by .*config.json\\)"):
        config_from_dict({**keys, "base_model": str(local)})
    for trained in ("google/gemma-3-4b-it", "HuggingFaceTB/SmolVLM2-2.2B-Instruct", "HuggingFaceM4/Idefics3-8B-Llama3",
                    "meta-llama/Llama-3.2-11B-Vision-Instruct", "Qwen/Qwen3.5-9B", "Qwen/Qwen3-VL-8B-Instruct",
                    "OpenGVLab/InternVL3_5-8B-HF", "Qwen/Qwen3-VL-30B-A3B-Instruct", "zai-org/GLM-4.1V-9B-Thinking",
                    "zai-org/GLM-4.5V", "zai-org/GLM-4.6V-Flash"):
        assert config_from_dict({**keys, "base_model": trained}).processor_type == "AutoProcessor"
    from types import SimpleNamespace

    from tuneloop.config.vision_names import named_vision_family

    # the mixture-of-experts names before the dense ones' patterns (GLM-4.6V-Flash is GLM-4.1V's architecture)
    named = {"Qwen/Qwen3-VL-30B-A3B-Instruct": "qwen3_vl_moe", "Qwen/Qwen3-VL-8B-Instruct": "qwen3_vl",
             "zai-org/GLM-4.5V": "glm4v_moe", "zai-org/GLM-4.6V-Flash": "glm4v"}
    for hub_id, model_type in named.items():
        assert named_vision_family(SimpleNamespace(base_model=hub_id, base_model_config=None))[0] == model_type
    assert config_from_dict({**keys, "base_model": "Qwen/Qwen2.5-VL-7B-Instruct"}).processor_type == "AutoProcessor"
    assert config_from_dict({**keys, "base_model": "someone/unknown-vlm"}).processor_type == "AutoProcessor"
    for mistral3 in ("mistralai/Mistral-Small-3.1-24B-Instruct-2503", "mistralai/Ministral-3-8B-Instruct-2512"):
        assert config_from_dict({**keys, "base_model": mistral3}).processor_type == "AutoProcessor"
    with pytest.raises(UserError, match="is a LFM2-VL vision-language model .* asks for multimodal models, which "
                                        "tuneloop does not do yet: LFM2-VL's image processor is in transformers only "
                                        "as a torchvision one"):
        config_from_dict({**keys, "base_model": "LiquidAI/LFM2-VL-1.6B"})


def test_axolotls_qwen2_5_vl_example_is_accepted_plans_and_trains_on_a_tiny_qwen2_5_vl(tmp_path):
    """axolotl's qwen2_5-vl/lora-7b.yaml with its keys as written (8-bit AdamW, bf16, flash attention, gradient
    checkpointing, its LoRA pattern over the language model's layers), a tiny Qwen2.5-VL in place of the 7B and
    local caption rows in place of the hub dataset: `check` accepts it, the plan trains exactly the LoRA weights the
    pattern names (no vision module), each micro-batch carries its images' pixels and grids, and two steps run."""
    import re

    import torch
    import yaml
    from safetensors.torch import load_file
    from test_axolotl_configs import EXAMPLES, swapped
    from transformers import AutoModelForImageTextToText

    if EXAMPLES is None:
        pytest.skip("../shared/axolotl-examples is not on this machine")
    model_dir = save_qwen2_vl(tmp_path / "tiny_qwen2_5_vl", version="2.5")
    raw = swapped(yaml.safe_load((EXAMPLES / "qwen2_5-vl/lora-7b.yaml").read_text()), model_dir)
    checked = run_in_process("check", str(write_config(tmp_path / "check.yml", **raw)))
    assert checked.returncode == 0 and checked.stdout.startswith("tuneloop check: accepted"), checked.stderr[-3000:]

    data = write_jsonl(tmp_path / "train.jsonl", caption_rows(tmp_path, 8, seed=6, size=(56, 56)))
    raw["datasets"] = [{**raw["datasets"][0], "path": str(data), "split": "train"}]  # (train[:1%] of the hub's)
    raw.update(output_dir=str(tmp_path / "out"), dataset_prepared_path=str(tmp_path / "prepared"), max_steps=2,
               sequence_len=512)
    config = write_config(tmp_path / "run.yml", **raw)
    plan = plan_of(config)
    assert plan["total_steps"] == 2 and plan["optimizer"] == "adamw_bnb_8bit" and plan["batching"] != "packed"
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    assert model.config.model_type == "qwen2_5_vl"
    targets = {name: module for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear) and re.fullmatch(raw["lora_target_modules"], name)}
    assert len(targets) == 2 * 7 and all(name.startswith("model.language_model.layers.") for name in targets)
    lora = sum(raw["lora_r"] * (m.in_features + m.out_features) for m in targets.values())
    assert plan["memory"]["trainable_parameters"] == lora

    from tuneloop.config import config_from_dict
    from tuneloop.data.collate import collator_for
    from tuneloop.data.images import image_inputs_of
    from tuneloop.resolved import resolve_run
    from tuneloop.run import prepare_data

    cfg = config_from_dict(raw)
    tokenizer, rows = prepare_data(cfg, resolve_run(cfg))
    assert (rows.store.tokens("input_ids", 0) == tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum() == 4
    batch = collator_for(rows.store, tokenizer.pad_token_id, False, images=image_inputs_of(tokenizer))([[0, 1]])
    assert batch.inputs["image_grid_thw"].tolist() == [[1, 4, 4]] * 2  # 56×56: 4×4 patches, merged 2×2 -> 4 tokens
    assert batch.inputs["pixel_values"].shape[0] == 2 * 16

    trained = run_in_process("train", str(config))
    assert trained.returncode == 0, trained.stderr[-3000:]
    out = tmp_path / "out"
    assert [m["step"] for m in read_metrics(out) if "loss" in m] == [1, 2]
    assert json.loads((out / "summary.json").read_text())["tokens"] == plan["total_trainable_tokens"]
    adapter = load_file(out / "adapter_model.safetensors")
    assert len(adapter) == 2 * len(targets) and all(".language_model.layers." in key for key in adapter)
    assert (out / "preprocessor_config.json").is_file()  # the image processor beside the adapter


def test_exact_deduplication_keeps_the_same_text_about_another_image(tmp_path, llava_dir):
    """Rows 0 and 4 of the caption rows ask the same question of two red squares (other shades, other files): the
    same tokens, other images. Both stay; a repeat of row 0 (its image too) is dropped."""
    from tuneloop.config import config_from_dict
    from tuneloop.resolved import resolve_run
    from tuneloop.run import prepare_data

    rows = caption_rows(tmp_path, 5, seed=3)
    assert rows[0]["messages"][1] == rows[4]["messages"][1] and rows[0] != rows[4]
    data = write_jsonl(tmp_path / "train.jsonl", [rows[0], rows[4], rows[0]])
    cfg = config_from_dict(vlm_config(tmp_path, llava_dir, data, dataset_exact_deduplication=True))
    _, prepared = prepare_data(cfg, resolve_run(cfg))
    store = prepared.store
    assert len(store) == 2
    assert (store.tokens("input_ids", 0) == store.tokens("input_ids", 1)).all()  # the same text, tokens and all
    assert [Path(store.images(i)[0][0].removeprefix("path:")).name for i in (0, 1)] == ["3-0.png", "3-4.png"]


def test_lora_target_linear_reaches_what_axolotls_reaches_on_a_vlm(tmp_path, llava_dir):
    """`lora_target_linear: true` on a VLM: every Linear but the output head, the vision tower's and the projector's
    too (axolotl passes peft the last names of all Linear modules but the head, which match the same modules; peft's
    "all-linear", what tuneloop passes, leaves out the head alone). The plan's trainable count is that adapter's."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    data = write_jsonl(tmp_path / "train.jsonl", caption_rows(tmp_path, 4, seed=1))
    keys = vlm_config(tmp_path, llava_dir, data, adapter="lora", lora_r=4, lora_alpha=8, lora_target_linear=True)
    plan = plan_of(write_config(tmp_path / "c.yml", **keys))
    model = AutoModelForImageTextToText.from_pretrained(llava_dir)
    names = {name.split(".")[-1] for name, module in model.named_modules()
             if isinstance(module, torch.nn.Linear)} - {"lm_head"}  # (axolotl's find_all_linear_names)
    assert {"fc1", "fc2", "out_proj", "linear_1", "linear_2", "gate_proj", "q_proj"} <= names
    axolotls = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=sorted(names)))
    reached = {name.rsplit(".lora_A", 1)[0] for name, _ in axolotls.named_parameters() if ".lora_A." in name}
    assert any(".vision_tower." in name for name in reached) and any(".multi_modal_projector." in name
                                                                     for name in reached)
    trainable = sum(p.numel() for p in axolotls.parameters() if p.requires_grad)
    assert plan["memory"]["trainable_parameters"] == trainable


@pytest.mark.parametrize("targets", ["the language model", "every linear", "full, tower frozen"])
def test_a_frozen_tower_under_a_checkpointed_adapter_builds_no_graph(tmp_path, llava_dir, targets):
    """LoRA with re-entrant gradient checkpointing: the checkpointed layers need inputs that require a gradient, and
    transformers' hook (which peft installs) would mark the tower's patch embedding too, so a frozen tower built a
    graph and ran a backward for nothing. Only sub-models holding a trained weight are marked now: an adapter on
    the language model leaves the tower's output without a graph and still trains; one that reaches the tower
    gets its gradients there."""
    import torch

    from tuneloop.config import config_from_dict
    from tuneloop.data.collate import collator_for
    from tuneloop.data.images import image_inputs_of
    from tuneloop.model.load import load_model
    from tuneloop.resolved import resolve_run
    from tuneloop.run import prepare_data

    data = write_jsonl(tmp_path / "train.jsonl", caption_rows(tmp_path, 2, seed=1))
    reach = {"the language model": {"lora_target_modules": r".*language_model.*\.(q_proj|v_proj)"},
             "every linear": {"lora_target_linear": True},
             "full, tower frozen": {"adapter": None, "freeze_mm_modules": True}}[targets]
    cfg = config_from_dict(vlm_config(tmp_path, llava_dir, data, **{"adapter": "lora", "lora_r": 4, "lora_alpha": 8,
                                                                    **reach},
                                      gradient_checkpointing=True, bf16=False,
                                      gradient_checkpointing_kwargs={"use_reentrant": True}))
    resolved = resolve_run(cfg)
    tokenizer, rows = prepare_data(cfg, resolved)
    model = load_model(cfg, resolved, tokenizer)
    model.train()
    batch = collator_for(rows.store, tokenizer.pad_token_id, False, images=image_inputs_of(tokenizer))([[0, 1]])
    tower_outputs = []
    tower = (model.get_base_model() if hasattr(model, "get_base_model") else model).model.vision_tower
    tower.register_forward_hook(lambda module, inputs, output: tower_outputs.append(output.last_hidden_state))
    logits = model(**batch.inputs, use_cache=False).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=-100).backward()
    reached_tower = targets == "every linear"
    assert tower_outputs[0].requires_grad == reached_tower
    trained = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    assert all(grad is not None and grad.abs().sum() > 0 for name, grad in trained.items()
               if ".language_model." in name and ("lora_B" in name or targets.startswith("full")))
    assert any(".vision_tower." in name for name in trained) == reached_tower
    assert all(trained[name] is not None for name in trained if ".vision_tower." in name and "lora_B" in name)
