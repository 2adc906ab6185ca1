"""tuneloop vs TRL's SFTTrainer on the same vision-language model, rows and images: who trains faster?

The model is a LLaVA built here from a config (random weights, seed 0; nothing downloaded): a LLaMA of hidden 256,
4 layers, under a CLIP vision tower of hidden 128, 2 layers, at 224×224 pixels in 14-pixel patches (256 image
tokens per image), with a byte-level BPE tokenizer trained here and a CLIP image processor. The rows are chat rows,
one image each (a coloured rectangle of random size, written as a PNG beside the data) and a question about it; the
answers are of mixed length. Both rows of the table read the same files:

  tuneloop     fp32   tuneloop's real run (tuneloop.run.TrainingSession, what `tuneloop train` runs), `bf16: false`:
                      its token cache keeps the rows' text tokens and image references; the collator reads and
                      processes a micro-batch's images
  tuneloop_bf16, trl_sft_bf16: the same pair at each tool's bf16 (tuneloop `bf16: auto`, TRL `bf16=True`), where the
                      CPU computes bf16 natively; each against the TRL row of its own precision
  trl_sft      fp32   TRL's SFTTrainer as its docs set up a VLM: a `datasets` Dataset of `messages` and `images`
                      (an Image feature over the same PNG files), the processor as processing_class, TRL's own
                      DataCollatorForVisionLanguageModeling (it renders, tokenizes and processes each batch), and
                      assistant_only_loss=True with a chat template that writes the same text as tuneloop's and marks
                      the answers {% generation %} (TRL's default trains every token, image tokens included);
                      gradient_checkpointing=False (TRL's default is True; tuneloop does not checkpoint unless asked)

Both: AdamW (adamw_torch_fused), cosine schedule without warm-up, lr 1e-3, no weight decay, clip 1.0, the same
micro-batch and accumulation, one epoch, SDPA, seed 42, one thread per process. Each variant runs in a fresh
process, alternating (tuneloop, trl_sft, tuneloop, trl_sft, ...) for `--rounds`; the ratio is taken within each
round, then the median. Each child times only its training loop and counts the real tokens its collator made (the
attention mask: text + image tokens), the image tokens among them and the trained (target) tokens; peak memory is the
child's max RSS at the end of the loop; the final loss is the eval loss per target token over held-out rows, computed
by one function (tuneloop's collator, the model's logits) for both.

    python benchmarks/vlm.py --quick      # 16 rows, 1 round: < 2 minutes on 2 cores
    python benchmarks/vlm.py              # 64 rows, 3 rounds
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import BenchHooks, child_env, peak_memory_mb  # noqa: E402  (light: torch loads in the children)

# variant -> its precision as the table says it; the bf16 pair runs where the CPU computes bf16 natively (else the
# table says why it is left out): tuneloop at its default `bf16: auto` (its plan's choice), TRL with `bf16=True`
VARIANTS = {"tuneloop": "fp32", "trl_sft": "fp32", "tuneloop_bf16": "bf16: auto", "trl_sft_bf16": "bf16"}
PEER = {"tuneloop": "trl_sft", "trl_sft": "trl_sft", "tuneloop_bf16": "trl_sft_bf16", "trl_sft_bf16": "trl_sft_bf16"}
PRESETS = {
    "quick": dict(train_rows=16, eval_rows=8, micro_batch_size=4, gradient_accumulation_steps=1, rounds=1),
    "default": dict(train_rows=64, eval_rows=16, micro_batch_size=4, gradient_accumulation_steps=2, rounds=3),
}
LEARNING_RATE, SEED, IMAGE_SIZE = 1e-3, 42, 224
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220), "yellow": (230, 220, 30),
           "purple": (140, 40, 160), "orange": (240, 140, 20)}
WORDS = ("the square is a flat shape with four equal sides drawn in one colour on a plain background and it "
         "looks bright or dark depending on the shade of its paint which was chosen at random").split()
QUESTIONS = ["What colour is this?", "Which colour does this image show?", "Describe the colour of the shape.",
             "Tell me what colour fills this picture, in a few words."]
# tuneloop's LLaVA template (chat_template_texts.LLAVA) over content given as parts, with TRL's {% generation %}
# markers around each answer: the same text (an image part is "<image>\n", as tuneloop writes it), the same trained
# tokens (the answer with the space before it; tuneloop's turn span leaves the space after it untrained)
TRL_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'] | upper + ':' }}{% endif %}"
    "{% set ns = namespace(text='') %}"
    "{% if message['content'] is string %}{% set ns.text = message['content'] %}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{% set ns.text = ns.text + '<image>\n' %}"
    "{% elif part['type'] == 'text' %}{% set ns.text = ns.text + part['text'] %}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ ' ' + ns.text }}{% endgeneration %}{{ ' ' }}"
    "{% elif message['role'] == 'system' %}{{ ns.text + ' ' }}{% else %}{{ ' ' + ns.text + ' ' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


# ======================================================================================== parent: assets
def build_llava(target: Path) -> Path:
    """The LLaVA folder both variants load: model, processor (CLIP image processor at 224, tokenizer, template)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (CLIPImageProcessorPil, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor,
                              PreTrainedTokenizerFast)

    from tuneloop.data.chat_template_texts import LLAVA

    corpus = [" ".join(WORDS), " ".join(QUESTIONS), " ".join(COLOURS), "USER: ASSISTANT: system user assistant"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>", "<image>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<pad>",
                                   extra_special_tokens={"image_token": "<image>"})
    images = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                   crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    LlavaProcessor(image_processor=images, tokenizer=fast, chat_template=LLAVA, patch_size=14,
                   vision_feature_select_strategy="default", num_additional_image_tokens=1).save_pretrained(target)
    config = LlavaConfig(
        text_config=dict(model_type="llama", vocab_size=len(fast), hidden_size=256, intermediate_size=688,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=1024, pad_token_id=fast.pad_token_id),
        vision_config=dict(model_type="clip_vision_model", hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                           num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=14, projection_dim=128),
        image_token_id=fast.convert_tokens_to_ids("<image>"), vision_feature_layer=-1,
        vision_feature_select_strategy="default", use_cache=False)
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(target)
    return target


def caption_rows(folder: Path, count: int, seed: int) -> list[dict]:
    """Chat rows of one image each (a PNG of random size beside the data) and a question; answers of mixed length."""
    from PIL import Image

    rng = random.Random(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(count):
        colour = rng.choice(list(COLOURS))
        shade = tuple(max(0, min(255, v + rng.randint(-25, 25))) for v in COLOURS[colour])
        name = f"images/{seed}-{i}.png"
        Image.new("RGB", (rng.randint(160, 400), rng.randint(160, 400)), shade).save(folder / name)
        answer = f"It is {colour}. " + " ".join(rng.choices(WORDS, k=rng.choice([0, 2, 8, 24, 48])))
        rows.append({"messages": [
            {"role": "user", "content": [{"type": "image", "path": name},
                                         {"type": "text", "text": rng.choice(QUESTIONS)}]},
            {"role": "assistant", "content": [{"type": "text", "text": answer.strip()}]}]})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def tuneloop_config(model_dir: Path, data: Path, workdir: Path, setup: dict) -> dict:
    return {"base_model": str(model_dir), "processor_type": "AutoProcessor",
            "datasets": [{"path": str(data), "type": "chat_template"}],
            "dataset_prepared_path": str(workdir / "prepared"), "output_dir": str(workdir / "out" / "tuneloop"),
            "sequence_len": 1024, "micro_batch_size": setup["micro_batch_size"],
            "gradient_accumulation_steps": setup["gradient_accumulation_steps"], "num_epochs": 1,
            "learning_rate": LEARNING_RATE, "lr_scheduler": "cosine", "warmup_steps": 0,
            "optimizer": "adamw_torch_fused", "weight_decay": 0.0, "max_grad_norm": 1.0,
            "attn_implementation": "sdpa", "bf16": False, "sample_packing": False, "logging_steps": 1,
            "save_strategy": "no", "seed": SEED, "dataset_processes": 1}


def make_setup(preset: str, args, workdir: Path) -> dict:
    """Model, rows and images built once; the rows prepared once by tuneloop (its children hit that cache)."""
    import yaml

    from tuneloop.config import config_from_dict
    from tuneloop.resolved import resolve_run
    from tuneloop.run import prepare_data

    setup = dict(PRESETS[preset])
    for key in ("train_rows", "eval_rows", "rounds"):
        if getattr(args, key, None):
            setup[key] = getattr(args, key)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model_dir = build_llava(workdir / "model")
    train_file = write_jsonl(workdir / "train.jsonl", caption_rows(workdir, setup["train_rows"], seed=1))
    eval_file = write_jsonl(workdir / "heldout.jsonl", caption_rows(workdir, setup["eval_rows"], seed=2))
    raw = tuneloop_config(model_dir, train_file, workdir, setup)
    config_path = workdir / "tuneloop.yml"
    config_path.write_text(yaml.safe_dump(raw, sort_keys=False))
    eval_path = workdir / "heldout.yml"
    eval_path.write_text(yaml.safe_dump(dict(raw, datasets=[{"path": str(eval_file), "type": "chat_template"}])))
    stores = {}
    for name, path in (("train", config_path), ("eval", eval_path)):
        cfg = config_from_dict(yaml.safe_load(path.read_text()))
        tokenizer, rows = prepare_data(cfg, resolve_run(cfg))
        stores[name] = rows.store
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    lengths = [len(stores["train"].tokens("input_ids", i)) for i in range(len(stores["train"]))]
    image_tokens = sum(int((stores["train"].tokens("input_ids", i) == image_id).sum())
                       for i in range(len(stores["train"])))
    return {"preset": preset, "model_dir": str(model_dir), "config_path": str(config_path),
            "eval_config_path": str(eval_path), "train_file": str(train_file), "workdir": str(workdir),
            "micro_batch_size": setup["micro_batch_size"],
            "gradient_accumulation_steps": setup["gradient_accumulation_steps"], "rounds": setup["rounds"],
            "image_token_id": image_id,
            "data": {"train_rows": len(lengths), "eval_rows": len(stores["eval"]), "train_tokens": sum(lengths),
                     "image_tokens": image_tokens, "min_len": min(lengths), "max_len": max(lengths)},
            "rows_tokens": [stores["train"].tokens("input_ids", i).tolist() for i in range(len(lengths))]}


# ======================================================================================== parent: running
def run_child(job: dict, variant: str, round_index: int, threads: int, timeout: int) -> dict:
    workdir = Path(job["workdir"])
    (workdir / "logs").mkdir(exist_ok=True)
    tag = f"{variant}-r{round_index}"
    job_file, result_file, log_file = (workdir / "logs" / f"{tag}.job.json", workdir / "logs" / f"{tag}.result.json",
                                       workdir / "logs" / f"{tag}.log")
    result_file.unlink(missing_ok=True)
    shutil.rmtree(workdir / "out" / tag, ignore_errors=True)
    job_file.write_text(json.dumps(dict(job, variant=variant, result_file=str(result_file),
                                        output_dir=str(workdir / "out" / tag))))
    with open(log_file, "w") as log:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(job_file)],
                              env=child_env(threads), stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                              cwd=str(workdir))
    if proc.returncode != 0 or not result_file.exists():
        raise SystemExit(f"variant {variant} (round {round_index}) failed with exit code {proc.returncode}; log "
                         f"{log_file}:\n{log_file.read_text(errors='replace')[-4000:]}")
    return json.loads(result_file.read_text())


def summarise(runs: dict[str, list[dict]]) -> list[dict]:
    rows, rounds = [], len(runs["tuneloop"])
    runs = {name: got for name, got in runs.items() if got}
    speed = lambda r: r["real_tokens"] / r["train_seconds"]  # noqa: E731
    for name, got in runs.items():
        rows.append({
            "name": name, "precision": VARIANTS[name],
            "real_tokens": got[0]["real_tokens"] if len({r["real_tokens"] for r in got}) == 1 else None,
            "image_tokens": got[0]["image_tokens"], "targets": got[0]["targets"],
            "real_tokens_per_s": round(statistics.median(speed(r) for r in got), 1),
            "steps": got[0]["steps"],
            "seconds_per_step": round(statistics.median(r["train_seconds"] / r["steps"] for r in got), 4),
            "padding_fraction": round(1 - got[0]["real_tokens"] / got[0]["computed_tokens"], 4),
            "peak_mem_mb": round(statistics.median(r["peak_mem_mb"] for r in got), 1),
            "final_loss": round(statistics.median(r["eval_loss"] for r in got), 4),
            # (against the TRL row of the same precision)
            "ratio_vs_trl": round(statistics.median(speed(got[i]) / speed(runs[PEER[name]][i])
                                                    for i in range(rounds)), 3),
            "memory_vs_trl": round(statistics.median(got[i]["peak_mem_mb"] / runs[PEER[name]][i]["peak_mem_mb"]
                                                     for i in range(rounds)), 3),
            "per_round": [{k: r[k] for k in ("real_tokens", "train_seconds", "steps", "peak_mem_mb", "eval_loss")}
                          for r in got]})
    return rows


def print_table(job: dict, rows: list[dict], threads: int) -> None:
    data = job["data"]
    print(f"\n== {job['preset']} preset: tiny LLaVA (LLaMA hidden 256 x 4 layers, CLIP hidden 128 x 2 layers at "
          f"{IMAGE_SIZE} px), {data['train_rows']} train rows of one image each ({data['train_tokens']} tokens, "
          f"{data['image_tokens']} of them image tokens; lengths {data['min_len']}-{data['max_len']}), batch "
          f"{job['micro_batch_size']} x {job['gradient_accumulation_steps']}, 1 epoch, lr {LEARNING_RATE:g} cosine, "
          f"cpu, {job['rounds']} round(s), {threads} thread(s)")
    print(f"   final loss = eval loss per target token on the {data['eval_rows']} held-out rows (same function for "
          "every row); x trl = against the TRL row of the same precision, within a round, then the median")
    head = (f"{'variant':<14}{'precision':>11}{'real tok/s':>11}{'s/step':>8}{'steps':>6}{'pad %':>7}"
            f"{'targets':>8}{'peak MB':>9}{'final loss':>11}{'x trl tok/s':>12}{'x trl mem':>10}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['name']:<14}{r['precision']:>11}{r['real_tokens_per_s']:>11.1f}{r['seconds_per_step']:>8.3f}"
              f"{r['steps']:>6}{100 * r['padding_fraction']:>7.1f}{r['targets']:>8}{r['peak_mem_mb']:>9.0f}"
              f"{r['final_loss']:>11.4f}{r['ratio_vs_trl']:>12.2f}{r['memory_vs_trl']:>10.2f}")
    tokens = {(r["real_tokens"], r["image_tokens"]) for r in rows}
    print(f"real tokens per run (text + image): {', '.join(f'{t} ({i} image)' for t, i in sorted(tokens, key=str))}"
          + (" (identical in both variants)" if len(tokens) == 1 else "  <-- NOT the same: unfair comparison"))


# ======================================================================================== children
class VisionBenchHooks(BenchHooks):
    """compare.py's hooks (real and computed tokens, the loop's clock, peak memory), plus image and target tokens."""

    def __init__(self, image_token_id: int):
        super().__init__("cpu", profile=False)
        self.image_token_id, self.image_tokens, self.targets = image_token_id, 0, 0

    def micro_batch(self, batch) -> None:
        super().micro_batch(batch)
        self.image_tokens += int((batch.inputs["input_ids"] == self.image_token_id).sum())
        self.targets += batch.n_targets


def eval_loss_per_token(model, job: dict) -> float:
    """Mean cross-entropy per target token over the held-out rows, batches made by tuneloop's collator (text tokens,
    image references -> pixels): the same function for both variants."""
    import torch

    from tuneloop.config import load_config
    from tuneloop.data.collate import collator_for
    from tuneloop.data.images import image_inputs_of
    from tuneloop.resolved import resolve_run
    from tuneloop.run import prepare_data
    from tuneloop.train.objectives import summed_token_loss

    cfg = load_config(job["eval_config_path"])
    tokenizer, rows = prepare_data(cfg, resolve_run(cfg))
    store = rows.store
    collate = collator_for(store, tokenizer.pad_token_id, False, images=image_inputs_of(tokenizer))
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(store), 8):
            batch = collate([[i] for i in range(start, min(start + 8, len(store)))])
            total += float(summed_token_loss(model(**batch.inputs).logits, batch.targets))  # (targets: shifted)
            count += batch.n_targets
    return total / count


def child_tuneloop(job: dict) -> dict:
    """tuneloop's real run in this process, watched through its hooks (nothing patched)."""
    from tuneloop.config import load_run_config
    from tuneloop.run import TrainingSession

    hooks = VisionBenchHooks(job["image_token_id"])
    overrides = [f"output_dir={job['output_dir']}"] + (["bf16=auto"] if job["variant"].endswith("_bf16") else [])
    with TrainingSession(load_run_config(job["config_path"], overrides), hooks) as session:
        result = session.run(overwrite=True)
    if result.error is not None or "model" not in hooks.kept:
        raise SystemExit(f"tuneloop train failed: {result.error or 'no final model'}")
    summary = result.summary
    return {"real_tokens": hooks.real, "computed_tokens": hooks.computed, "image_tokens": hooks.image_tokens,
            "targets": hooks.targets, "train_seconds": summary["train_seconds"], "steps": summary["steps"],
            "peak_mem_mb": hooks.kept["peak_mem_mb"], "eval_loss": eval_loss_per_token(hooks.kept["model"], job)}


class CountingVisionCollator:
    """Wraps TRL's collator: counts real (attention mask), computed, image and target tokens; keeps each row's
    tokens once (the parent checks they are tuneloop's rows)."""

    def __init__(self, inner, image_token_id: int):
        self.inner, self.image_token_id = inner, image_token_id
        self.real = self.computed = self.image_tokens = self.targets = 0
        self.rows: list[list[int]] = []

    def __call__(self, examples):
        batch = self.inner(examples)
        mask = batch["attention_mask"]
        self.real += int(mask.sum())
        self.computed += mask.numel()
        self.image_tokens += int((batch["input_ids"] == self.image_token_id).sum())
        self.targets += int((batch["labels"][:, 1:] != -100).sum())
        self.rows += [ids[:int(m.sum())].tolist() for ids, m in zip(batch["input_ids"], mask)]
        return batch


def trl_dataset(train_file: str):
    """The rows as TRL's VLM docs give them: `messages` (an image part is a placeholder TRL fills) and `images`, an
    Image feature over the same PNG files (decoded when a batch is made)."""
    from datasets import Dataset, Image, List

    messages, images = [], []
    folder = Path(train_file).parent
    for line in Path(train_file).read_text().splitlines():
        row = json.loads(line)
        paths, conversation = [], []
        for message in row["messages"]:
            parts = []
            for part in message["content"]:
                if part["type"] == "image":
                    paths.append(str(folder / part["path"]))
                    parts.append({"type": "image"})
                else:
                    parts.append({"type": "text", "text": part["text"]})
            conversation.append({"role": message["role"], "content": parts})
        messages.append(conversation)
        images.append(paths)
    return Dataset.from_dict({"messages": messages, "images": images}).cast_column("images", List(Image()))


def child_trl(job: dict) -> dict:
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    processor = AutoProcessor.from_pretrained(job["model_dir"])
    processor.chat_template = TRL_TEMPLATE
    model = LlavaForConditionalGeneration.from_pretrained(job["model_dir"], dtype=torch.float32,
                                                          attn_implementation="sdpa")
    model.config.use_cache = False

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_epoch_end(self, args, state, control, **kwargs):
            self.seconds = time.perf_counter() - self.start
            self.peak = peak_memory_mb("cpu")

    clock = Clock()
    args = SFTConfig(output_dir=job["output_dir"], per_device_train_batch_size=job["micro_batch_size"],
                     gradient_accumulation_steps=job["gradient_accumulation_steps"], num_train_epochs=1,
                     learning_rate=LEARNING_RATE, lr_scheduler_type="cosine", warmup_steps=0, weight_decay=0.0,
                     max_grad_norm=1.0, optim="adamw_torch_fused", seed=SEED,
                     bf16=job["variant"].endswith("_bf16"), use_cpu=True,
                     gradient_checkpointing=False, assistant_only_loss=True, max_length=None, logging_steps=1,
                     report_to="none", save_strategy="no")
    trainer = SFTTrainer(model=model, args=args, train_dataset=trl_dataset(job["train_file"]),
                         processing_class=processor, callbacks=[clock])
    collator = CountingVisionCollator(trainer.data_collator, job["image_token_id"])
    trainer.data_collator = collator
    trainer.train()
    return {"real_tokens": collator.real, "computed_tokens": collator.computed, "image_tokens": collator.image_tokens,
            "targets": collator.targets, "train_seconds": clock.seconds, "steps": trainer.state.global_step,
            "peak_mem_mb": clock.peak, "eval_loss": eval_loss_per_token(trainer.model, job),
            "rows": sorted(collator.rows)}


def child_main(job_file: str) -> None:
    job = json.loads(Path(job_file).read_text())
    result = child_tuneloop(job) if job["variant"].startswith("tuneloop") else child_trl(job)
    Path(job["result_file"]).write_text(json.dumps(result))


# ======================================================================================== parent entry
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16 rows, 1 round (< 2 minutes on 2 cores)")
    parser.add_argument("--rounds", type=int, help="alternating rounds (default: the preset's)")
    parser.add_argument("--train-rows", dest="train_rows", type=int)
    parser.add_argument("--eval-rows", dest="eval_rows", type=int)
    parser.add_argument("--threads", type=int, default=1, help="OMP/torch threads per child (default 1)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.add_argument("--workdir", help="keep model, data and logs here (default: a temporary folder, removed)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds allowed per child process")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    import os

    args = parse_args(argv)
    if args.child:
        child_main(args.child)
        return 0
    os.environ.update({k: v for k, v in child_env(args.threads).items() if k != "PYTHONPATH"})
    preset = "quick" if args.quick else "default"
    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="tuneloop-vlm-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        started = time.perf_counter()
        job = make_setup(preset, args, root)
        expected_rows = sorted(job.pop("rows_tokens"))
        print(f"prepared {job['data']['train_rows']} train / {job['data']['eval_rows']} held-out rows in "
              f"{time.perf_counter() - started:.1f} s (workdir {root})", flush=True)
        from tuneloop.host.hardware import native_bf16

        variants = [name for name in VARIANTS if native_bf16() or not name.endswith("_bf16")]
        if len(variants) < len(VARIANTS):
            print("  bf16 rows left out: this CPU has no native bf16 (its bf16 products would be emulated)")
        runs = {name: [] for name in variants}
        for round_index in range(job["rounds"]):
            for name in variants:
                t0 = time.perf_counter()
                result = run_child(job, name, round_index, args.threads, args.timeout)
                if "rows" in result and result.pop("rows") != expected_rows:
                    raise SystemExit("TRL's collator made other token rows than tuneloop's cache: unfair comparison")
                runs[name].append(result)
                print(f"  round {round_index + 1}/{job['rounds']} {name:<13} {result['real_tokens']:>7} real tokens "
                      f"in {result['train_seconds']:.2f} s ({result['steps']} steps; eval loss "
                      f"{result['eval_loss']:.4f}; process {time.perf_counter() - t0:.1f} s)", flush=True)
        rows = summarise(runs)
        print_table(job, rows, args.threads)
        print("TRL's rows were checked token for token against tuneloop's cache (same text and image tokens)")
        if args.json:
            Path(args.json).write_text(json.dumps({"preset": preset, "data": job["data"], "rows": rows,
                                                   "threads": args.threads, "rounds": job["rounds"]}, indent=2))
            print(f"wrote {args.json}")
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
