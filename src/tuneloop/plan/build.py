"""The TrainingPlan: every number of the run, computed once, exactly, before the model loads its weights.

The plan runs the real sampler (data/batching.py) for every epoch the run touches, on every rank (through the
rows: data/source.py), so steps and token counts are counted, never estimated; a stream's steps and rows per step
are exact, and what it holds is counted as it is read. The loop, the scheduler and the progress bar read their
numbers from here, and tests check that the loop runs exactly `total_steps` optimizer steps and sees exactly
`total_trainable_tokens` targets.

`build_plan` assembles the plan whole, in named steps: the batch, the data's steps (the rows count them), the
schedule (schedule.py), the model's part (its size, memory per rank: memory.py; compute: flops.py), and the
warnings. Nothing is added to a plan after it is built; its words are text.py's.

An optimizer step is `gradient_accumulation_steps` micro-batches per rank. When an epoch's micro-batches do not
divide evenly, its last step takes the remainder: the loss is normalised by the tokens actually in the step, so a
short step is still an exact mean.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np

from tuneloop.config.hub import push_words
from tuneloop.data.batching import BatchingSpec
from tuneloop.data.collate import Padding, padding_for
from tuneloop.errors import UserError
from tuneloop.optim import optimizer_words, schedule_words
from tuneloop.plan.schedule import run_schedule
from tuneloop.rl_methods import RL_METHODS, is_online, objective_name, reference_source
from tuneloop.resolved import slow_bf16_note

FREQUENT_FRACTION = 0.02  # evals or saves closer than 2% of the run are worth a warning


@dataclass(kw_only=True)
class TrainingPlan:
    world_size: int  # the processes launched
    # the ranks that read different rows (the world size without its tensor- and context-parallel factor); the
    # batch arithmetic, the samplers and the loss's averaging count these
    data_ranks: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    global_batch_size: int
    batching: str
    sequence_len: int
    train_rows: int
    train_tokens: int
    trainable_tokens: int
    eval_rows: int
    dropped_too_long: int
    micro_batches_per_epoch: int | None  # None: a stream's epochs are unknown
    rows_cut_per_epoch: int
    steps_per_epoch: int | None
    total_steps: int
    epochs_to_run: int | None
    epochs_covered: float | None
    warmup_steps: int
    eval_steps_at: list[int]
    eval_count: int
    save_steps_at: list[int]
    save_count: int
    tokens_per_step: float | None
    total_trainable_tokens: int | None
    total_real_tokens: int | None
    packing_efficiency: float | None
    padding_fraction: float | None
    max_micro_batch_tokens: int
    objective: str = "language_model"  # or the preference method (`rl:`)
    unit: str = "tokens"  # what a step's loss is averaged over: target tokens, or pairs (rows are then pairs)
    reference: str | None = None  # preference methods: where the reference log-probs come from
    learning_rate: float = 0.0
    optimizer_steps: str | None = None  # how the optimizer steps, where its name does not say it
    qat: str | None = None  # `qat:`: what is fake-quantized, how, and from which step (quant/qat.py), in words
    lr_scheduler: str = ""
    optimizer: str = ""
    dropped_no_trained_tokens: int = 0
    dropped_identical_pairs: int = 0  # preference pairs whose chosen and rejected replies tokenize the same
    dropped_too_short: int = 0  # under `min_sample_len` tokens
    dropped_duplicates: int = 0  # repeats of an earlier row (`dataset_exact_deduplication`)
    precision: str | None = None  # resolved.precision in words: "fp32 (...)", "bf16 mixed precision (...)"
    host_allocator: str | None = None  # the host allocator of every tuneloop process, in words (host/allocator.py)
    attention: str | None = None  # the attention implementation the model loads with
    attention_split: str | None = None  # SDPA per sequence: how many micro-batches split, in words
    torch_compile: str | None = None  # what torch.compile compiles, when the run compiles
    torch_compile_choice: str | None = None  # `torch_compile: auto`: on or off, and why (plan/compile_choice.py)
    compile_decision: tuple | None = None  # the same as (on, why), which rank 0 hands the other ranks (run.py)
    compile_key: str | None = None  # what this run's compile measurements are recorded under (compile_choice.py)
    flops_per_token: float | None = None  # model FLOPs per real token of a training step (flops.py)
    flops_per_step: float | None = None  # the same per optimizer step, on average over the run (every rank's)
    # a vision-language model: the image side's share of the FLOPs, its images and tower positions (flops.py)
    vision_flops: dict | None = None
    attention_context: float | None = None  # positions a token attends to, on average over the data
    peak_flops: float | None = None  # one device's peak at the run's precision, per second
    peak_source: str | None = None  # where that figure comes from, or why MFU is not counted
    estimated_memory_gb: float | None = None
    memory: dict | None = None  # the estimate's parts per rank: weights, gradients, optimizer, activations, device
    engine: str | None = None  # how the ranks share the model, in words (engines/)
    mesh: str | None = None  # the device mesh of axolotl's N-D keys when any is set (engines/mesh.py)
    # bytes each rank sends per optimizer step, in total and by collective (plan/comm.py); None: no model
    communication: dict | None = None
    # context parallel (engines/context_parallel.py): the ranks one row's positions are split over (1: none)
    context_ranks: int = 1

    def data_rank(self, process_index: int) -> int:
        """Which of the data ranks' rows process `process_index` reads (engines/mesh.py lays the mesh out)."""
        return process_index // (self.world_size // self.data_ranks)

    @property
    def gradient_ranks(self) -> int:
        """The ranks the engine averages gradients over: the data ranks, and the context-parallel ranks of each
        (their gradients are parts of one row's, averaged with the rest: FSDP2 shards over dp_shard × cp, DDP
        averages over every rank). Tensor-parallel ranks average nothing: theirs are already whole."""
        return self.data_ranks * self.context_ranks
    saved_dtype: str | None = None  # the dtype of the weights the run saves (the same under every engine)
    model: str | None = None  # the model trained: its class, and where its weights come from (4/8-bit: how loaded)
    adapter: str | None = None  # the LoRA adapter trained on it, in words: rank, scale, targets, DoRA/rsLoRA/LoRA+
    # save_strategy: best: the metric whose improvement saves (save_steps_at: the evals that may); the final model
    # folder's weights when they are not the last step's (load_best_model_at_end)
    saves_at_best: str | None = None
    final_model: str | None = None
    push: str | None = None  # where the run is pushed (hub_model_id), in words (use/hub.py)
    # encoder-decoder runs: the encoder's and the decoder's real tokens over the run, and the share of each side's
    # computed positions that is padding (each side is padded to its own longest row)
    encoder_tokens: int | None = None
    decoder_tokens: int | None = None
    encoder_padding_fraction: float | None = None
    decoder_padding_fraction: float | None = None
    # a streamed run (pretraining_dataset, streaming: true): rows are read as the run goes, so steps and rows per
    # step are exact and what the data holds (rows, passes, target tokens) is not known beforehand
    streamed: bool = False
    # online RL (rl: grpo, gdpo): prompts and completions per step, generations, the generated tokens at most
    # (online_rl/rows.py), and the generation's KV cache per rank
    rollout: dict | None = None
    warnings: list[str] = field(default_factory=list)
    resolved: object = None  # the run's decided settings (resolved.py), structured; plan.json shows them
    # what the loop's sampler and collator are given; not in plan.json, whose numbers above say it all
    train_batching: BatchingSpec | None = None
    eval_batching: BatchingSpec | None = None
    padding: Padding | None = None  # how wide each micro-batch is (pad_to_sequence_len, rounding under compile)
    first_epoch_batches: list | None = None  # epoch 0's micro-batches per rank, as counted: the loop starts on them

    def to_json(self) -> dict:
        # field by field: asdict would first copy the first epoch's micro-batches (a million rows' worth)
        values = {item.name: copy.deepcopy(getattr(self, item.name)) for item in fields(self)
                  if item.name not in NOT_IN_JSON}
        values["resolved"] = self.resolved.to_json() if self.resolved is not None else None
        return values


NOT_IN_JSON = ("train_batching", "eval_batching", "padding", "first_epoch_batches", "compile_decision")


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def train_spec(cfg, resolved, world_size: int) -> BatchingSpec:
    return BatchingSpec(resolved.batching, cfg.micro_batch_size, cfg.sequence_len, world_size, cfg.seed,
                        ordered=cfg.curriculum_sampling, sequential=cfg.sample_packing_sequentially,
                        **_budget(cfg, resolved))


def eval_spec(cfg, resolved, world_size: int) -> BatchingSpec:
    return BatchingSpec(resolved.eval_batching, cfg.resolved_eval_batch_size, cfg.sequence_len, world_size, cfg.seed,
                        **_budget(cfg, resolved))


def _budget(cfg, resolved) -> dict:
    """`max_tokens_per_micro_batch`, with the multiple the collator pads widths to (data/collate.py)."""
    if not cfg.max_tokens_per_micro_batch:
        return {}
    cp = resolved.engine.mesh_keys.cp or 1
    return {"token_budget": cfg.max_tokens_per_micro_batch,
            "pad_multiple": padding_for(cfg, resolved.compiled, cp).multiple}


def build_plan(cfg, resolved, rows, tokenizer, world_size: int, device_memory_gb: float | None = None,
               compile_decision: tuple[bool, str] | None = None) -> TrainingPlan:
    """Every number of the run: the data's, and the model's and the machine's (memory per rank on
    `device_memory_gb` GB devices when planning for other machines; MFU against the peak of the devices).
    `compile_decision`: `torch_compile: auto` decided already (by rank 0, for every rank: run.py)."""
    from tuneloop.plan.model_facts import model_facts

    facts = model_facts(cfg, resolved.model_kind, tokenizer)
    return _assembled(cfg, resolved, rows, world_size, facts, device_memory_gb, tokenizer, compile_decision)


def data_plan(cfg, resolved, rows, world_size: int) -> TrainingPlan:
    """The plan of the data and the batch settings alone (no model: no memory, no compute)."""
    return _assembled(cfg, resolved, rows, world_size, None, None, None)


def _assembled(cfg, resolved, rows, world_size: int, facts, device_memory_gb, tokenizer,
               compile_decision: tuple[bool, str] | None = None) -> TrainingPlan:
    # resolved against the world size now: sizes that cannot make it stop `plan --world-size N` and `train` here
    mesh = resolved.engine.mesh(world_size)
    batch = _batch(cfg, rows, world_size, mesh.data_ranks, mesh.cp)

    def counted(resolved):
        padding = padding_for(cfg, resolved.compiled, mesh.cp)
        counts = rows.count_steps(train_spec(cfg, resolved, mesh.data_ranks), cfg.gradient_accumulation_steps,
                                  padding,
                                  cfg.max_steps, cfg.num_epochs)
        model_part, notes = (_model_part(cfg, resolved, facts, counts, world_size, device_memory_gb, tokenizer,
                                         getattr(rows, "store", None))
                             if facts is not None else ({}, []))
        return padding, counts, model_part, notes

    padding, counts, model_part, notes = counted(resolved)
    if resolved.compile_auto and facts is not None:
        compile_on, why = compile_decision or _auto_compile(cfg, resolved, facts, counts, model_part, world_size)
        if compile_on:  # compiled widths are rounded up (data/collate.py): counted again
            resolved = replace(resolved, compiled=True)
            padding, counts, model_part, notes = counted(resolved)
        model_part["torch_compile_choice"] = f"auto: {'on' if compile_on else 'off'}, {why}"
        model_part["compile_decision"] = (compile_on, why)
    compile_keys = [key for key in ("torch_compile_mode", "torch_compile_backend", "torch_compile_options")
                    if getattr(cfg, key)]
    if compile_keys and not resolved.compiled and facts is not None:  # said, not silently dropped
        notes.append(f"{', '.join(f'`{key}`' for key in compile_keys)} given, but this run is not compiled "
                     f"(torch_compile: {'auto' if resolved.compile_auto else False}"
                     + (", and the plan decided against it" if resolved.compile_auto else "")
                     + "): set `torch_compile: true` for them to apply")
    eval_rows = rows.prepared.stats.eval_rows
    schedule = run_schedule(cfg, counts.total_steps, counts.steps_per_epoch, eval_rows)
    if tokenizer is not None:
        notes += _stopping_notes(cfg, rows, tokenizer)
    plan = TrainingPlan(
        **batch, sequence_len=cfg.sequence_len, batching=_batching_words(resolved, padding),
        train_rows=counts.train_rows, train_tokens=counts.train_tokens, trainable_tokens=counts.trainable_tokens,
        eval_rows=eval_rows, dropped_too_long=counts.dropped_too_long,
        dropped_no_trained_tokens=counts.dropped_no_trained_tokens,
        dropped_identical_pairs=counts.dropped_identical_pairs, dropped_too_short=counts.dropped_too_short,
        dropped_duplicates=counts.dropped_duplicates,
        micro_batches_per_epoch=counts.micro_batches_per_epoch, rows_cut_per_epoch=counts.rows_cut_per_epoch,
        steps_per_epoch=counts.steps_per_epoch, total_steps=counts.total_steps, epochs_to_run=counts.epochs_to_run,
        epochs_covered=(round(counts.total_steps / counts.steps_per_epoch, 4) if counts.steps_per_epoch else None),
        warmup_steps=schedule.warmup_steps, eval_steps_at=schedule.eval_steps_at,
        eval_count=len(schedule.eval_steps_at), save_steps_at=schedule.save_steps_at,
        save_count=len(schedule.save_steps_at), saves_at_best=_best_words(cfg) if cfg.save_strategy == "best" else None,
        final_model=f"the best eval's weights ({_best_words(cfg)})" if cfg.load_best_model_at_end else None,
        push=push_words(cfg, len(schedule.save_steps_at)),
        tokens_per_step=(round(counts.total_trainable_tokens / counts.total_steps, 2)
                         if counts.total_trainable_tokens is not None else None),
        total_trainable_tokens=counts.total_trainable_tokens, total_real_tokens=counts.total_real_tokens,
        packing_efficiency=counts.packing_efficiency, padding_fraction=counts.padding_fraction,
        max_micro_batch_tokens=counts.max_micro_batch_tokens, encoder_tokens=counts.encoder_tokens,
        decoder_tokens=counts.decoder_tokens, encoder_padding_fraction=counts.encoder_padding_fraction,
        decoder_padding_fraction=counts.decoder_padding_fraction,
        learning_rate=cfg.learning_rate, lr_scheduler=schedule_words(cfg), optimizer=cfg.optimizer,
        optimizer_steps=optimizer_words(cfg), qat=cfg.qat.words(counts.total_steps) if cfg.qat else None,
        objective=objective_name(cfg), unit=_unit(cfg), rollout=counts.rollout,
        reference=reference_source(cfg), streamed=resolved.streamed, resolved=resolved,
        train_batching=train_spec(cfg, resolved, mesh.data_ranks),
        eval_batching=eval_spec(cfg, resolved, mesh.data_ranks),
        padding=padding, first_epoch_batches=counts.first_epoch_batches,
        mesh=str(mesh) if resolved.engine.mesh_keys.written else None, **model_part)
    return replace(plan, warnings=plan_warnings(cfg, plan, counts) + notes)


def _best_words(cfg) -> str:
    name, greater = cfg.best_metric
    return f"{name}, {'higher' if greater else 'lower'} is better"


def _unit(cfg) -> str:
    if is_online(cfg):
        return cfg.trl_settings.unit
    if cfg.reward_model:
        return "pairs"  # (train/reward_model.py: the Bradley-Terry loss is a mean over pairs)
    return RL_METHODS[cfg.rl].unit if cfg.rl else "tokens"


def _batch(cfg, rows, world_size: int, data_ranks: int, context_ranks: int = 1) -> dict:
    """The batch settings, checked against each other and against the data. Ranks that split one batch's work
    (tensor and context parallel) add no rows to it: the global batch counts the data ranks."""
    cfg.check_batch_size(data_ranks)
    accumulation = cfg.gradient_accumulation_steps
    global_batch = cfg.micro_batch_size * accumulation * data_ranks
    if cfg.val_set_size and rows.units is not None and rows.units < global_batch:
        raise UserError(f"config: `val_set_size: {cfg.val_set_size:g}` leaves {rows.units} train rows, fewer "
                        f"than one global batch ({global_batch} rows): lower val_set_size or the batch")
    return {"world_size": world_size, "data_ranks": data_ranks, "micro_batch_size": cfg.micro_batch_size,
            "context_ranks": context_ranks,
            "gradient_accumulation_steps": accumulation, "global_batch_size": global_batch}


def _batching_words(resolved, padding: Padding) -> str:
    if resolved.streamed:
        return f"streamed, {resolved.batching}"
    if resolved.batching == "token_budget" and padding.multiple > 1:
        # (the cuts count widths as padded: a resume that pads otherwise, compiled or not, would deal other rows,
        # and the checkpoint's plan says so by this word)
        return f"token_budget, widths in multiples of {padding.multiple}"
    return resolved.batching


def _auto_compile(cfg, resolved, facts, counts, model_part: dict, world_size: int) -> tuple[bool, str]:
    """`torch_compile: auto`, from what this machine measured for this model (plan/compile_choice.py)."""
    import torch

    from tuneloop.plan.compile_choice import decide, read_records

    if is_online(cfg):
        return False, "not for online RL (its generation would run through the training graph)"
    return decide(read_records(), model_part["compile_key"], counts.total_real_tokens or 0,
                  model_part.get("flops_per_token"), model_part.get("peak_flops"),
                  "cuda" if torch.cuda.is_available() else "cpu")


def _model_part(cfg, resolved, facts, counts, world_size: int, device_memory_gb, tokenizer,
                store=None) -> tuple[dict, list]:
    """What the model and the machine add: the model's line, precision and attention, the engine (its settings
    checked against the plan), the memory per rank, the compute per token and the peak MFU is taken against;
    and their warnings (a sequence_len past the model's positions, an attention kernel that cannot run here, a
    run above the device's memory)."""
    from tuneloop.plan.model_facts import check_sequence_len
    from tuneloop.plan.flops import count_flops, head_flops_skipped, run_peak
    from tuneloop.plan.memory import estimate_memory, memory_warning

    precision = resolved.precision.mixed
    too_long = check_sequence_len(cfg, facts)
    grown = _grown_embeddings(cfg, facts, tokenizer)
    resolved.engine.check_model(facts)  # what `train` would meet, the plan meets first
    if resolved.engine.mesh_keys.cp:
        from tuneloop.engines.context_parallel import check_context_parallel

        check_context_parallel(facts.config, resolved.engine.mesh_keys.cp, cfg.sequence_len, resolved.attention.used,
                               resolved.engine.mesh_keys.tp or 1)
    try:  # a DeepSpeed file's set values must agree with the plan: refused now, not when the engine starts
        resolved.engine.check_plan(cfg.micro_batch_size, cfg.gradient_accumulation_steps, world_size,
                                   cfg.max_grad_norm, precision, getattr(facts.text_config, "hidden_size", None))
    except ValueError as error:
        raise UserError(f"config: {error}") from None
    generated = 0
    if counts.rollout:  # one generation batch per rank: its completions, each as long as the longest can be
        generated = counts.rollout["completions_per_rank"] * int(counts.sequence_lengths.max())
    # (context parallel: each rank holds its slice of every row's activations)
    mesh = resolved.engine.mesh(world_size)
    slice_tokens = -(-counts.max_micro_batch_tokens // mesh.cp)
    vision_activations = 0.0
    if facts.vision is not None and counts.first_epoch_batches:  # the tower's, at the micro-batch of most positions
        from tuneloop.data.batching import epoch_micro_batches
        from tuneloop.plan.flops import largest_micro_batch_tower_positions, row_image_tokens
        from tuneloop.plan.memory import vision_activation_bytes

        lengths, spec = np.asarray(store.unit_column("length")), train_spec(cfg, resolved, mesh.data_ranks)
        epochs = [counts.first_epoch_batches] + [epoch_micro_batches(lengths, spec, epoch)  # (as count_steps deals)
                                                 for epoch in range(1, counts.epochs_to_run or 1)]
        positions = largest_micro_batch_tower_positions(facts.vision, row_image_tokens(store), epochs)
        vision_activations = vision_activation_bytes(facts.vision, positions, precision,
                                                     resolved.gradient_checkpointing)
    estimate = estimate_memory(cfg, facts, slice_tokens, precision, resolved.engine, world_size,
                               device_memory_gb, generated_positions=generated,
                               masters=resolved.precision.masters, frozen_bf16=resolved.precision.frozen_bf16,
                               tensor_parallel=mesh.tp, vision_activations=vision_activations,
                               checkpointing=resolved.gradient_checkpointing)
    from tuneloop.host.allocator import tune_host_allocator
    from tuneloop.host.kernel_caches import in_words as kernel_caches_in_words
    from tuneloop.kernels.packed_attention import PER_SEQUENCE_SDPA, split_summary
    from tuneloop.plan.compile_choice import shape_key

    part = {"model": model_line(cfg, facts), "adapter": adapter_line(cfg), "precision": str(resolved.precision),
            "host_allocator": tune_host_allocator() + (f"; {kernel_caches_in_words()}" if estimate.kernel_caches_gb
                                                        else ""),
            "saved_dtype": "fp32" if cfg.adapter else {"bf16": "bf16", "fp16": "fp16"}.get(
                "bf16" if cfg.bfloat16 else "fp16" if cfg.float16 else "", "fp32"),
            "attention": resolved.attention.used, "engine": resolved.engine.describe(world_size),
            "estimated_memory_gb": estimate.total_gb, "memory": asdict(estimate),
            "communication": _communication(cfg, resolved, facts, world_size,
                                           counts.max_micro_batch_tokens)}
    if resolved.engine.mesh_keys.cp:  # (engines/context_parallel.py)
        part["attention"] += (f", on whole rows behind DeepSpeed's Ulysses all-to-alls over "
                              f"{resolved.engine.mesh_keys.cp} context-parallel ranks")
    import torch

    if resolved.attention.used == PER_SEQUENCE_SDPA and counts.packed_attention_work:
        part["attention_split"] = split_summary(counts.packed_attention_work, "bf16" if precision == "bf16" else "fp32",
                                                varlen=torch.cuda.is_available())
    elif (resolved.attention.used == PER_SEQUENCE_SDPA and counts.padded_attention_work
          and not torch.cuda.is_available()):  # (padded rows split on a CPU only)
        part["attention_split"] = split_summary(counts.padded_attention_work, "bf16" if precision == "bf16" else "fp32",
                                                masked=True)
    # (the preference losses' log-probs, log_probs.py, also meet the head only at target positions)
    skipped = head_flops_skipped(facts.head_weights, counts.total_real_tokens, counts.total_trainable_tokens)
    count = count_flops(facts.text_config, *_text_matmul_weights(facts), counts.sequence_lengths, skipped)
    if facts.vision is not None:  # the image side per image, from the store's image token counts (flops.py)
        from tuneloop.plan.flops import image_token_counts, with_images

        count, split = with_images(count, facts.vision, image_token_counts(store),
                                   float(np.asarray(counts.sequence_lengths).sum()))
        part["vision_flops"] = split or None
    part.update(flops_per_token=count.per_token, attention_context=count.attention_context)
    if count.per_token is not None and counts.total_real_tokens and counts.total_steps:
        part["flops_per_step"] = count.per_token * counts.total_real_tokens / counts.total_steps
    if count.per_token is None:
        part["peak_source"] = count.why_not
    else:
        # (`tuneloop plan --world-size N` outside a launcher: the N ranks are taken to share this host)
        peak = run_peak(precision, cfg.peak_tflops, world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
        part.update(peak_flops=peak.flops, peak_source=peak.source)
    part["compile_key"] = shape_key(cfg, resolved, facts.text_config, world_size)
    if resolved.compiled:
        part["torch_compile"] = f"torch.compile ({cfg.torch_compile_backend or 'inductor'}" + (
            f", mode {cfg.torch_compile_mode})" if cfg.torch_compile_mode else ")")
    notes = [note for note in (too_long, grown, resolved.packing_note, resolved.attention.note,
                                slow_bf16_note(cfg, resolved.precision), memory_warning(estimate),
                                facts.fan_in_fan_out_note) if note]
    return part, notes


def _text_matmul_weights(facts) -> tuple[int, int]:
    """(frozen, trained) weights a token meets: a vision-language model's image side is counted per image."""
    frozen, trained = facts.matmul_weights
    if facts.vision is None:
        return frozen, trained
    vision_frozen, vision_trained = facts.vision.in_text_count
    return frozen - vision_frozen, trained - vision_trained


def _communication(cfg, resolved, facts, world_size: int, micro_batch_tokens: int) -> dict:
    """What each rank sends per optimizer step (plan/comm.py), with the line the plan prints."""
    from tuneloop.engines.tensor_parallel import layer_table
    from tuneloop.plan.comm import communication_per_step
    from tuneloop.plan.memory import whole_bytes

    import torch

    precision, masters = resolved.precision.mixed, resolved.precision.masters
    text = facts.text_config
    hidden = getattr(text, "hidden_size", 0) or 0
    heads = getattr(text, "num_attention_heads", 0) or 0
    head_dim = getattr(text, "head_dim", None) or (hidden // heads if heads else 0)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    # (+ tensor and context parallel's activations)
    kinds = list(layer_table(facts.config).values())
    whole = replace(whole_bytes(cfg, facts, precision, resolved.engine, masters),
                    micro_batch_tokens=micro_batch_tokens, hidden_size=hidden, attention_width=heads * head_dim,
                    kv_width=kv_heads * head_dim, rowwise_projections=kinds.count("rowwise"),
                    colwise_projections=kinds.count("colwise"))
    sent = communication_per_step(resolved.engine, whole,
                                  world_size, cfg.gradient_accumulation_steps, precision, masters,
                                  backend="nccl" if torch.cuda.is_available() else "gloo")
    return {**sent.to_json(), "words": sent.words()}


def _grown_embeddings(cfg, facts, tokenizer) -> str | None:
    """The tokenizer has tokens the model's embeddings have no row for: the rows are added (as axolotl does, and
    said here), and refused where nothing would train them and the data uses them (random vectors for good; a pad
    token's row is never read by the loss or attention, so it may stay as it starts)."""
    if not facts.grown_rows:
        return None
    added = [token_id for token_id in range(facts.embedding_rows, facts.embedding_rows + facts.grown_rows)
             if token_id != tokenizer.pad_token_id]
    names = ", ".join(tokenizer.convert_ids_to_tokens(added[:5])) + (", …" if len(added) > 5 else "")
    if added and not facts.embeddings_trained:
        raise UserError(f"config: the tokenizer has {len(added)} tokens ({names}) the model's {facts.embedding_rows} "
                        f"embedding rows do not (added `tokens`/`special_tokens`, or a tokenizer larger than the "
                        f"model), and under `adapter: {cfg.adapter}` the embeddings are frozen: their rows would stay "
                        "random. Train them (`lora_modules_to_save: [embed_tokens, lm_head]`), or use tokens the model "
                        "has")
    trained = "are trained" if facts.embeddings_trained else "stay as they start (the pad token's: never read)"
    return (f"the model's embeddings grow by {facts.grown_rows} rows for tokens its {facts.embedding_rows} rows do "
            f"not have ({names or tokenizer.pad_token}): they start near the other rows' mean and {trained}.")


def _stopping_notes(cfg, rows, tokenizer) -> list[str]:
    """A model that never trains its end-of-sequence or end-of-turn token never learns to stop (axolotl #3754,
    LLaMA-Factory #5593): said when most rows train none of them."""
    from tuneloop.data.chat_templates import end_of_turn_ids, resolve_template

    template = resolve_template(cfg.chat_template, cfg.chat_template_jinja, tokenizer)
    stops = end_of_turn_ids(tokenizer, template, cfg.eot_tokens)
    counted = rows.rows_training_none_of(stops)
    if counted is None:
        return []  # (a stream's rows are not known before they are read)
    without, total = counted
    if not total or without * 2 < total:
        return []
    names = ", ".join(tokenizer.convert_ids_to_tokens(sorted(stops))) or "none: the tokenizer has no eos token"
    return [f"{without} of {total} training rows train no end-of-sequence or end-of-turn token ({names}): the model "
            "will not learn to stop. Chat rows train their turn's end with `train_on_eos: turn` (the default); "
            "completion and instruction rows end with a trained eos when the tokenizer has one."]


def model_line(cfg, facts) -> str:
    """What the plan says of the model: its class, its size, and where its weights come from."""
    name = type(facts.config).__name__.removesuffix("Config")
    if cfg.from_scratch:
        source = f"random weights (from scratch) from the config of {cfg.base_model_config or cfg.base_model}"
    else:
        source = f"weights of {cfg.base_model}"
    return f"{name}, {facts.parameters:,} parameters; {source}{_quantized_words(cfg)}{_dequantized_words(cfg, facts)}"


def _quantized_words(cfg) -> str:
    """A 4-bit (QLoRA) or 8-bit base, as bitsandbytes loads it (adapters.quantization_config: its defaults, and
    `bnb_config_kwargs` over them)."""
    from tuneloop.adapters import four_bit_compute_dtype
    from tuneloop.host.hardware import quantized_loading

    kind, settings = quantized_loading(cfg), cfg.bnb_config_kwargs or {}
    if kind == "8bit":
        return ", loaded in 8-bit by bitsandbytes (LLM.int8)"
    if kind != "4bit":
        return ""
    double = ", double-quantized" if settings.get("bnb_4bit_use_double_quant", True) else ""
    compute = four_bit_compute_dtype(cfg)
    return (f", loaded in 4-bit by bitsandbytes ({str(settings.get('bnb_4bit_quant_type', 'nf4')).upper()}{double}, "
            f"computed in {compute}: QLoRA)")


def adapter_line(cfg) -> str | None:
    """What the plan says of the LoRA adapter (adapters.lora_config builds it; LoRA+ is optim.py's): its rank and
    scale, what it wraps, where it starts, and its variants. None: no adapter."""
    if not cfg.adapter:
        return None
    if cfg.peft_use_rslora:
        scale = f"scale alpha/√r = {cfg.lora_alpha / math.sqrt(cfg.lora_r):.3g} (rsLoRA)"
    else:
        scale = f"scale alpha/r = {cfg.lora_alpha / cfg.lora_r:.3g}"
    targets = [words for words, given in (
        ("every linear layer", cfg.lora_target_linear),
        (f"modules matching {cfg.lora_target_modules!r}" if isinstance(cfg.lora_target_modules, str)
         else ", ".join(cfg.lora_target_modules or ()), cfg.lora_target_modules),
        (f"parameters {', '.join(cfg.lora_target_parameters or ())}", cfg.lora_target_parameters)) if given]
    parts = [f"LoRA r {cfg.lora_r}, alpha {cfg.lora_alpha:g}, {scale}, dropout {cfg.lora_dropout:g}, on "
             + " and ".join(targets)]
    if cfg.lora_modules_to_save:
        parts.append(f"trained whole beside it: {', '.join(cfg.lora_modules_to_save)}")
    if cfg.lora_model_dir:
        parts.append(f"starts from the trained adapter in {cfg.lora_model_dir}")
    elif cfg.peft_init_lora_weights is not True:
        parts.append(f"starts as peft's `{cfg.peft_init_lora_weights}` initialisation")
    if cfg.peft_use_dora:
        parts.append("DoRA: each weight's magnitude trained apart from its direction")
    if cfg.loraplus_lr_ratio is not None:
        embedding = (f"; an embedding's LoRA {cfg.loraplus_embedding_lr:g}" if cfg.loraplus_lr_embedding is not None
                     else "")
        parts.append(f"LoRA+: the B matrices learn {cfg.loraplus_lr_ratio:g}× faster (learning rate "
                     f"{cfg.learning_rate * cfg.loraplus_lr_ratio:g}{embedding})")
    return "; ".join(parts)


def _dequantized_words(cfg, facts) -> str:
    """How an MXFP4 checkpoint's experts load (quant/mxfp4.py): unpacked into the run's weights dtype, which the memory
    estimate counts them in."""
    from tuneloop.quant.mxfp4 import dequantizes_mxfp4, loaded_dtype_words

    if not dequantizes_mxfp4(cfg, facts.config):
        return ""
    return f" (its MXFP4 experts dequantized to {loaded_dtype_words(cfg)} as they load)"


def plan_warnings(cfg, plan: TrainingPlan, counts) -> list[str]:
    """What the data and the batch settings do that the user probably did not mean."""
    found = []
    if cfg.max_steps and plan.steps_per_epoch and plan.epochs_covered != cfg.num_epochs:
        covered = plan.total_steps / plan.steps_per_epoch  # unrounded: 2 steps of 148,480 round to 0 passes
        ratio = cfg.num_epochs / covered
        text = (f"max_steps={cfg.max_steps} covers {covered:.4g} passes over the data, "
                f"while num_epochs={cfg.num_epochs}; max_steps wins.")
        if plan.world_size > 1 and math.isclose(ratio, plan.world_size, rel_tol=0.02):
            text += (f" The ratio is the world size ({plan.world_size}): you probably counted per-device "
                     "batches; one step here consumes a global batch from every rank.")
        found.append(text)
    if plan.padding_fraction is not None and plan.padding_fraction > 0.20 and not (
            cfg.group_by_length and (plan.encoder_tokens is not None or cfg.reward_model)):  # (nothing left)
        remedy = ("`group_by_length: true` would reclaim most of it"
                  if plan.encoder_tokens is not None or cfg.reward_model  # (neither packs: rules.py)
                  else "`sample_packing: true` (or `group_by_length: true`) would reclaim most of it")
        found.append(f"{plan.padding_fraction:.0%} of the computed tokens are padding; {remedy}.")
    for name, count in (("eval", plan.eval_count), ("save", plan.save_count)):
        if count > 1 / FREQUENT_FRACTION:
            found.append(f"{count} {name}s in {plan.total_steps} steps: one every "
                         f"{plan.total_steps / count:.1f} steps costs time; space them out.")
    replies = (plan.rollout or {}).get("reference_replies")
    if replies and replies["median_tokens"] > plan.rollout["max_completion_length"]:
        found.append(f"trl.max_completion_length={plan.rollout['max_completion_length']} is below the typical "
                     f"reference reply of these rows ({replies['median_tokens']} tokens at the median, "
                     f"{replies['longer_than_max_completion_length']} of {replies['rows']} longer): most completions "
                     "would be cut before they finish, and rewards of cut answers train little (TRL's quickstart "
                     f"trains on zero reward this way); raise it to about {replies['p90_tokens']}.")
    read = plan.train_rows + plan.eval_rows + plan.dropped_too_long + plan.dropped_no_trained_tokens
    if read and plan.dropped_no_trained_tokens / read > 0.01:
        found.append(f"{plan.dropped_no_trained_tokens} of {read} rows have no trained token (nothing for the loss, "
                     "e.g. no turn of a role in roles_to_train) and are dropped.")
    if read and plan.dropped_too_long / read > 0.01:
        found.append(f"sequence_len={cfg.sequence_len} drops {plan.dropped_too_long} of {read} rows "
                     f"({plan.dropped_too_long / read:.1%}); raise sequence_len to keep them.")
    asked_for_evals = [key for key in ("eval_steps", "evals_per_epoch", "eval_on_start", "early_stopping_patience",
                                       "load_best_model_at_end") if getattr(cfg, key)]
    asked_for_evals += ["save_strategy: best"] if cfg.save_strategy == "best" else []
    if not plan.eval_rows and asked_for_evals:
        found.append(f"{', '.join(asked_for_evals)} set, but there is no eval set (val_set_size or test_datasets): "
                     "no eval will run" + (", and early stopping cannot stop the run" if cfg.early_stopping_patience
                                           else "") + ".")
    budgeted = plan.batching.startswith("token_budget")  # (its steps hold fewer rows than micro_batch_size allows)
    partial = counts.batch_rows_per_epoch is not None and (
        plan.micro_batches_per_epoch < cfg.gradient_accumulation_steps if budgeted
        else counts.batch_rows_per_epoch < plan.global_batch_size)
    if partial:
        rows = "packed rows" if plan.batching == "packed" else "rows"
        found.append(f"the global batch ({plan.global_batch_size} {rows}) is larger than one epoch of data "
                     f"({counts.batch_rows_per_epoch} {rows} in {plan.micro_batches_per_epoch} micro-batches per "
                     "rank): every step is a partial batch (still an exact mean over its tokens); lower "
                     "micro_batch_size or gradient_accumulation_steps.")
    if cfg.qat is not None and cfg.qat.start_step() >= plan.total_steps:
        found.append(f"qat.fake_quant_after_n_steps={cfg.qat.start_step()} is not below the run's {plan.total_steps} "
                     "steps: no step trains fake-quantized, and the model is trained as without `qat`.")
    if plan.warmup_steps >= plan.total_steps:
        found.append(f"warm-up ({plan.warmup_steps} steps) is as long as the run ({plan.total_steps} steps) "
                     "or longer: the learning rate never reaches its peak.")
    if plan.rows_cut_per_epoch and plan.rollout is None:  # (online RL: the plan names its waiting prompts)
        found.append(f"{plan.rows_cut_per_epoch} rows per epoch do not fill a micro-batch on every one of the "
                     f"{plan.world_size} ranks and are left out of that epoch (a different set each epoch).")
    return found
