"""Using what a vision-language run trained: `tuneloop infer --image` and jsonl prompts with image parts, `tuneloop
eval` of image rows, `tuneloop merge-lora` of a VLM adapter, and the saved folders reloaded by transformers' Auto
classes. A tiny LLaVA (test_vision_language.py's builders) is trained for a few steps, full and LoRA, once for the
module; every number is checked against transformers computing the same thing on its own."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from conftest import assert_user_error, read_metrics, run_in_process, write_config, write_jsonl
from test_vision_language import QUESTION, caption_rows, llava_dir, save_qwen2_vl, square, vlm_config  # noqa: F401

NEW_TOKENS = 6


def train(folder: Path, model_dir: Path, data: Path, held_out: Path, **keys) -> Path:
    folder.mkdir()
    config = write_config(folder / "run.yml", **vlm_config(
        folder, model_dir, data, num_epochs=2, evals_per_epoch=1,
        test_datasets=[{"path": str(held_out), "type": "chat_template"}], **keys))
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    return config


@pytest.fixture(scope="module")
def runs(tmp_path_factory, llava_dir) -> dict:  # noqa: F811
    """{"full": run.yml, "lora": run.yml, "held_out": the eval rows' file}: 16 caption rows, 8 steps each, the
    4 held-out rows evaluated at the end; each run's model is in out/ beside its config."""
    root = tmp_path_factory.mktemp("vision_use")
    data = write_jsonl(root / "train.jsonl", caption_rows(root, 16, seed=1))
    held_out = write_jsonl(root / "held_out.jsonl", caption_rows(root, 4, seed=2))
    return {"full": train(root / "full", llava_dir, data, held_out),
            "lora": train(root / "lora", llava_dir, data, held_out, learning_rate=1e-2, adapter="lora", lora_r=4,
                          lora_alpha=8, lora_target_linear=True),
            "held_out": held_out}


def out_of(config: Path) -> Path:
    return config.parent / "out"


def rgb(path: Path):
    from PIL import Image

    with Image.open(path) as image:
        return image.convert("RGB")


def processor_inputs(processor, image_path: Path, question: str = QUESTION) -> dict:
    """The processor's own inputs for the prompt `infer` renders: the chat template with the image's placeholder."""
    text = processor.apply_chat_template([{"role": "user", "content": "<image>\n" + question}], tokenize=False,
                                         add_generation_prompt=True)
    return processor(images=[rgb(image_path)], text=[text], return_tensors="pt")


def greedy(model, processor, inputs: dict) -> str:
    tokenizer = processor.tokenizer
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def infer(*args: str) -> list[dict]:
    result = run_in_process("infer", *args, "--max-new-tokens", str(NEW_TOKENS))
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines()]


# ---- infer ---------------------------------------------------------------------------------------

def test_infer_with_images_is_generate_on_the_processors_inputs_and_the_folder_reloads_by_auto_classes(runs,
                                                                                                     tmp_path):
    """The full run's folder reloads with AutoModelForImageTextToText and AutoProcessor (its chat template the
    run's); `infer --image` and jsonl rows with image parts (two images and a text-only prompt in one left-padded
    batch) answer what `model.generate` answers, greedy, on the processor's inputs of each prompt alone."""
    from transformers import AutoModelForImageTextToText, AutoProcessor, LlavaForConditionalGeneration

    out = out_of(runs["full"])
    model = AutoModelForImageTextToText.from_pretrained(out).eval()
    processor = AutoProcessor.from_pretrained(out)
    assert isinstance(model, LlavaForConditionalGeneration) and type(processor).__name__ == "LlavaProcessor"
    assert processor.chat_template == (out / "chat_template.jinja").read_text()

    images = tmp_path / "pictures"
    images.mkdir()
    for index, colour in enumerate(["red", "blue"]):
        square(colour, (40, 30), seed=99 + index).save(images / f"{colour}.png")
    expected = {colour: greedy(model, processor, processor_inputs(processor, images / f"{colour}.png"))
                for colour in ("red", "blue")}
    assert all(expected.values()), expected  # text came out

    one = tmp_path / "one.txt"
    one.write_text(QUESTION + "\n")
    (row,) = infer(str(runs["full"]), "--prompts", str(one), "--image", str(images / "red.png"))
    assert row["completion"] == expected["red"]
    assert row["prompt"][0]["content"][0] == {"type": "image", "path": str(images / "red.png")}

    text_only = processor.tokenizer(processor.apply_chat_template([{"role": "user", "content": "Hello there"}],
                                                                   tokenize=False, add_generation_prompt=True),
                                    return_tensors="pt")
    expected["text"] = greedy(model, processor, dict(text_only))
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [  # image paths relative to the prompts file, as in training
        {"messages": [{"role": "user", "content": [{"type": "image", "path": "pictures/blue.png"},
                                                   {"type": "text", "text": QUESTION}]}]},
        {"prompt": "Hello there"},
        {"messages": [{"role": "user", "content": [{"type": "image", "path": "pictures/red.png"},
                                                   {"type": "text", "text": QUESTION}]}]}])
    rows = infer("--model", str(out), "--prompts", str(prompts), "--batch-size", "3")
    assert [row["completion"] for row in rows] == [expected["blue"], expected["text"], expected["red"]]


@pytest.mark.parametrize("problem", ["text model flag", "text model row", "missing", "undecodable", "row image",
                                     "two prompts"])
def test_bad_image_input_is_one_line(runs, tiny_model_dir, tmp_path, problem):
    from PIL import Image

    good = tmp_path / "good.png"
    Image.new("RGB", (28, 28), (200, 30, 30)).save(good)
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png at all")
    one = tmp_path / "one.txt"
    one.write_text(QUESTION + "\n")
    image_row = {"messages": [{"role": "user", "content": [{"type": "image", "path": "good.png"},
                                                           {"type": "text", "text": QUESTION}]}]}
    source = ["--model", str(tiny_model_dir)] if problem.startswith("text model") else [str(runs["full"])]
    if problem == "text model flag":
        args, expected = ["--prompts", str(one), "--image", str(good)], (f"--image {good}", "text-only model")
    elif problem == "text model row":
        rows = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "hi"}, image_row])
        args, expected = ["--prompts", str(rows)], (f"{rows}:2", "text-only model")
    elif problem == "missing":
        args, expected = ["--prompts", str(one), "--image", str(tmp_path / "nowhere.png")], (
            f"--image {tmp_path / 'nowhere.png'}", "PIL: [Errno 2] No such file or directory")
    elif problem == "undecodable":
        args, expected = ["--prompts", str(one), "--image", str(broken)], (str(broken), "PIL: cannot identify image")
    elif problem == "row image":
        bad_row = {"messages": [{"role": "user", "content": [{"type": "image", "path": "broken.png"}]}]}
        rows = write_jsonl(tmp_path / "rows.jsonl", [image_row, bad_row])
        args, expected = ["--prompts", str(rows)], (f"{rows}:2", str(broken), "PIL: cannot identify image")
    else:
        two = tmp_path / "two.txt"
        two.write_text("first\nsecond\n")
        args, expected = ["--prompts", str(two), "--image", str(good)], ("--image", "single prompt", "2 were given")
    assert_user_error(run_in_process("infer", *source, *args), *expected)


# ---- eval ----------------------------------------------------------------------------------------

def hand_eval(model_dir: Path, rows_file: Path) -> tuple[float, int]:
    """(mean loss over the answers' tokens, their count) by transformers alone: each row through the processor,
    the loss over the tokens of " <colour>" after the generation prompt (the image tokens, the question and the
    template's words untrained)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    total, count = 0.0, 0
    for line in rows_file.read_text().splitlines():
        row = json.loads(line)
        image = rows_file.parent / row["messages"][0]["content"][0]["path"]
        answer = row["messages"][1]["content"][0]["text"]
        user = {"role": "user", "content": "<image>\n" + QUESTION}
        prompt = processor_inputs(processor, image)["input_ids"][0]
        full_text = processor.apply_chat_template([user, {"role": "assistant", "content": answer}], tokenize=False)
        full = processor(images=[rgb(image)], text=[full_text], return_tensors="pt")
        answer_ids = processor.tokenizer(" " + answer, add_special_tokens=False)["input_ids"]
        ids = full["input_ids"][0]
        assert ids[:len(prompt)].tolist() == prompt.tolist()
        assert ids[len(prompt):len(prompt) + len(answer_ids)].tolist() == answer_ids
        with torch.no_grad():
            logits = model(**full).logits[0].float()
        positions = torch.arange(len(prompt), len(prompt) + len(answer_ids))
        total += torch.nn.functional.cross_entropy(logits[positions - 1], ids[positions], reduction="sum").item()
        count += len(answer_ids)
    return total / count, count


def test_eval_of_image_rows_is_the_hand_computed_loss_and_the_runs_last_eval(runs):
    measured = {}
    for run in ("full", "lora"):
        result = run_in_process("eval", str(runs[run]))
        assert result.returncode == 0, result.stderr[-3000:]
        measured[run] = json.loads(result.stdout)
        last = [m for m in read_metrics(out_of(runs[run])) if "eval_loss" in m][-1]
        assert measured[run]["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-6)
        assert measured[run]["eval_tokens"] == last["eval_tokens"]
    loss, tokens = hand_eval(out_of(runs["full"]), runs["held_out"])
    print(f"\neval loss: tuneloop {measured['full']['eval_loss']:.6f}, by hand {loss:.6f} over {tokens} tokens")
    assert measured["full"]["eval_tokens"] == tokens
    assert measured["full"]["eval_loss"] == pytest.approx(loss, rel=1e-5)
    assert measured["full"]["eval_perplexity"] == pytest.approx(torch.tensor(loss).exp().item(), rel=1e-5)


# ---- merge-lora ----------------------------------------------------------------------------------

def test_merged_vlm_reloads_by_auto_classes_and_computes_what_the_adapter_does(runs, llava_dir, tmp_path):  # noqa: F811
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor

    merged_dir = tmp_path / "merged"
    result = run_in_process("merge-lora", str(runs["lora"]), "--output", str(merged_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "with its processor (AutoProcessor loads it)" in result.stdout
    assert (merged_dir / "processor_config.json").is_file() and not (merged_dir / "adapter_config.json").exists()

    merged = AutoModelForImageTextToText.from_pretrained(merged_dir).eval()  # transformers alone, no peft
    processor = AutoProcessor.from_pretrained(merged_dir)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        adapter = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(llava_dir),
                                            out_of(runs["lora"])).eval()
    image = tmp_path / "green.png"
    square("green", (32, 32), seed=5).save(image)
    inputs = processor_inputs(processor, image)
    with torch.no_grad():
        merged_logits, adapter_logits = merged(**inputs).logits, adapter(**inputs).logits
        base_logits = AutoModelForImageTextToText.from_pretrained(llava_dir)(**inputs).logits
    difference = (merged_logits - adapter_logits).abs().max().item()
    print(f"\nmerged vs adapter logits on an image prompt: max |difference| {difference:.2e}")
    assert difference < 1e-5  # fp32: W + BA·s folded
    assert (base_logits - adapter_logits).abs().max() > 1e-3  # the adapter changed something to fold in

    one = tmp_path / "one.txt"
    one.write_text(QUESTION + "\n")
    answers = [infer("--model", str(folder), "--prompts", str(one), "--image", str(image))[0]["completion"]
               for folder in (out_of(runs["lora"]), merged_dir)]
    assert answers[0] == answers[1] == greedy(merged, processor, inputs)


@pytest.mark.slow
def test_merged_qwen2_vl_holds_its_image_processor_and_tokenizer_and_computes_what_the_adapter_does(tmp_path):
    """Qwen2-VL's AutoProcessor needs torchvision (its video processor), not installable here: the merged folder holds
    the image processor and the tokenizer, which AutoImageProcessor and AutoTokenizer reload; with them the merged
    model's logits on an image prompt are the adapter's, and `infer --image` gives the same text from both."""
    from peft import PeftModel
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    model_dir = save_qwen2_vl(tmp_path / "tiny_qwen2_vl")
    data = write_jsonl(tmp_path / "train.jsonl", caption_rows(tmp_path, 8, seed=4, size=(56, 56)))
    config = write_config(tmp_path / "run.yml", **vlm_config(
        tmp_path, model_dir, data, chat_template="qwen2_vl", max_steps=2, learning_rate=1e-2, adapter="lora",
        lora_r=4, lora_alpha=8, lora_target_modules=["q_proj", "v_proj"]))
    trained = run_in_process("train", str(config))
    assert trained.returncode == 0, trained.stderr[-3000:]
    merged_dir = tmp_path / "merged"
    result = run_in_process("merge-lora", str(config), "--output", str(merged_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "with its image processor and tokenizer" in result.stdout and "torchvision" in result.stdout
    assert {"preprocessor_config.json", "tokenizer.json", "chat_template.jinja"} <= {
        path.name for path in merged_dir.iterdir()}

    images, tokenizer = AutoImageProcessor.from_pretrained(merged_dir), AutoTokenizer.from_pretrained(merged_dir)
    merged = AutoModelForImageTextToText.from_pretrained(merged_dir).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        adapter = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(model_dir),
                                            tmp_path / "out").eval()
    image = tmp_path / "blue.png"
    square("blue", (56, 56), seed=8).save(image)
    pixels = images(images=[rgb(image)], return_tensors="pt")
    tokens = int(pixels["image_grid_thw"].prod()) // images.merge_size ** 2  # 4×4 patches merged 2×2: 4 tokens
    text = tokenizer.apply_chat_template([{"role": "user", "content": "<|vision_start|><|image_pad|><|vision_end|>"
                                           + QUESTION}], tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text.replace("<|image_pad|>", "<|image_pad|>" * tokens), return_tensors="pt")
    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    # (the types the processor returns beside input_ids: M-RoPE places the image tokens by them)
    inputs = {**ids, **pixels, "mm_token_type_ids": (ids["input_ids"] == image_token).long()}
    assert int(inputs["mm_token_type_ids"].sum()) == tokens == 4
    with torch.no_grad():
        difference = (merged(**inputs).logits - adapter(**inputs).logits).abs().max().item()
    print(f"\nQwen2-VL merged vs adapter logits on an image prompt: max |difference| {difference:.2e}")
    assert difference < 1e-5

    one = tmp_path / "one.txt"
    one.write_text(QUESTION + "\n")
    answers = [infer("--model", str(folder), "--prompts", str(one), "--image", str(image))[0]["completion"]
               for folder in (tmp_path / "out", merged_dir)]
    assert answers[0] == answers[1]
    with torch.no_grad():
        output = merged.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                                 pad_token_id=tokenizer.pad_token_id)
    assert answers[1] == tokenizer.decode(output[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def test_infer_resizes_images_as_the_run_did(runs, tmp_path):
    """A run trained with axolotl's `image_size` resized each image before its processor (letterboxed to a square);
    the saved processor does not know it, the run's run_config.yml does: `infer` on the folder gives the model the
    pixels training gave it."""
    import argparse
    import shutil

    import yaml
    from PIL import Image, ImageOps
    from transformers import AutoProcessor

    from tuneloop.use.commands import load_for_inference

    folder = tmp_path / "out"
    shutil.copytree(out_of(runs["full"]), folder)
    recorded = yaml.safe_load((folder / "run_config.yml").read_text())
    (folder / "run_config.yml").write_text(yaml.safe_dump({**recorded, "image_size": 64}, sort_keys=False))
    picture = tmp_path / "wide.png"
    square("red", (60, 20), seed=5).save(picture)

    args = argparse.Namespace(config=None, model=str(folder), base=None)
    model, tokenizer, vision = load_for_inference(args)
    ids, references = vision.encode([{"role": "user", "content": [{"type": "image", "path": str(picture)},
                                                                  {"type": "text", "text": QUESTION}]}], "a prompt")
    pixels = vision.batch_inputs(torch.tensor([ids]), [references], model)["pixel_values"]
    processor = AutoProcessor.from_pretrained(folder)
    letterboxed = processor.image_processor(images=[ImageOps.pad(rgb(picture), (64, 64), Image.Resampling.BILINEAR,
                                                                         color=(0, 0, 0))],
                                            return_tensors="pt")["pixel_values"]
    as_it_is = processor.image_processor(images=[rgb(picture)], return_tensors="pt")["pixel_values"]
    assert torch.equal(pixels, letterboxed.to(pixels.dtype))
    assert not torch.equal(letterboxed, as_it_is)  # (the resize shows in the pixels)
