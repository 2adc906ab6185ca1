"""The TrainingPlan: every number of the run, computed once, exactly, before the model loads.

The plan runs the real sampler (data/batching.py) for every epoch the run touches, on every
rank, so steps and token counts are counted, never estimated. The loop, the scheduler and
the progress bar all read their numbers from here, and a test checks that the loop runs
exactly `total_steps` optimizer steps and sees exactly `total_trainable_tokens` targets.

An optimizer step is `gradient_accumulation_steps` micro-batches per rank. When an epoch's
micro-batches do not divide evenly, its last step takes the remainder: the loss is
normalised by the tokens actually in the step, so a short step is still an exact mean.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import asdict, dataclass, field, fields

import numpy as np

from tuneloop.config import TuneloopConfig
from tuneloop.data.batching import BatchingSpec, epoch_micro_batches
from tuneloop.data.collate import Padding, padding_for
from tuneloop.errors import UserError
from tuneloop.rl_methods import RL_METHODS

FREQUENT_FRACTION = 0.02  # evals or saves closer than 2% of the run are worth a warning


@dataclass
class TrainingPlan:
    world_size: int
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
    micro_batches_per_epoch: int
    rows_cut_per_epoch: int
    steps_per_epoch: int
    total_steps: int
    epochs_to_run: int
    epochs_covered: float
    warmup_steps: int
    eval_steps_at: list[int]
    eval_count: int
    save_steps_at: list[int]
    save_count: int
    tokens_per_step: float
    total_trainable_tokens: int
    total_real_tokens: int
    packing_efficiency: float | None
    padding_fraction: float | None
    max_micro_batch_tokens: int
    objective: str = "language_model"  # or the preference method (`rl:`)
    unit: str = "tokens"  # what a step's loss is averaged over: target tokens, or pairs (rows are then pairs)
    reference: str | None = None  # preference methods: where the reference log-probs come from
    learning_rate: float = 0.0
    lr_scheduler: str = ""
    optimizer: str = ""
    dropped_no_trained_tokens: int = 0
    dropped_identical_pairs: int = 0  # preference pairs whose chosen and rejected replies tokenize the same
    precision: str | None = None  # set from the machine: "fp32", "bf16 (mixed)", "fp16 (mixed)"
    attention: str | None = None  # the attention implementation the model loads with
    torch_compile: str | None = None  # what torch.compile compiles, when the config asks for it
    flops_per_token: float | None = None  # model FLOPs per real token of a training step (flops.py)
    attention_context: float | None = None  # positions a token attends to, on average over the data
    peak_flops: float | None = None  # one device's peak at the run's precision, per second
    peak_source: str | None = None  # where that figure comes from, or why MFU is not counted
    estimated_memory_gb: float | None = None
    memory: dict | None = None  # the estimate's parts per rank: weights, gradients, optimizer, activations, device
    engine: str | None = None  # how the ranks share the model: DDP, FSDP2 or DeepSpeed ZeRO (distributed.py)
    model: str | None = None  # the model trained: its class, and where its weights come from
    # encoder-decoder runs: the encoder's and the decoder's real tokens over the run, and the share of each side's
    # computed positions that is padding (each side is padded to its own longest row)
    encoder_tokens: int | None = None
    decoder_tokens: int | None = None
    encoder_padding_fraction: float | None = None
    decoder_padding_fraction: float | None = None
    # a streamed run (pretraining_dataset, streaming: true): rows are read as the run goes, so steps and rows per
    # step are exact and what the data holds (rows, passes, target tokens) is not known beforehand
    streamed: bool = False
    warnings: list[str] = field(default_factory=list)
    # what the loop's sampler and collator are given; not in plan.json, whose numbers above say it all
    train_batching: BatchingSpec | None = None
    eval_batching: BatchingSpec | None = None
    padding: Padding | None = None  # how wide each micro-batch is (pad_to_sequence_len, rounding under compile)
    first_epoch_batches: list | None = None  # epoch 0's micro-batches per rank, as counted: the loop starts on them

    def to_json(self) -> dict:
        # field by field: asdict would first copy the first epoch's micro-batches (a million rows' worth)
        return {item.name: copy.deepcopy(getattr(self, item.name)) for item in fields(self)
                if item.name not in NOT_IN_JSON}


NOT_IN_JSON = ("train_batching", "eval_batching", "padding", "first_epoch_batches")


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def batching_mode(cfg: TuneloopConfig) -> str:
    if cfg.sample_packing:
        return "packed"
    return "group_by_length" if cfg.group_by_length else "random"


def train_spec(cfg: TuneloopConfig, world_size: int) -> BatchingSpec:
    return BatchingSpec(batching_mode(cfg), cfg.micro_batch_size, cfg.sequence_len, world_size, cfg.seed)


def eval_spec(cfg: TuneloopConfig, world_size: int, encoder_decoder: bool = False) -> BatchingSpec:
    mode = "packed" if cfg.resolved_eval_sample_packing and not encoder_decoder else "group_by_length"
    return BatchingSpec(mode, cfg.resolved_eval_batch_size, cfg.sequence_len, world_size, cfg.seed)


def _scheduled(total: int, steps_per_epoch: int, every: int | float | None, per_epoch: int | None,
               default_per_epoch: int) -> list[int]:
    """Step numbers (1-based) at which something recurring happens."""
    if every is not None:
        interval = max(1, math.ceil(total * every)) if every < 1 else int(every)
        return list(range(interval, total + 1, interval))
    per_epoch = default_per_epoch if per_epoch is None else per_epoch
    steps = set()
    for epoch in range(math.ceil(total / steps_per_epoch)):
        for k in range(1, per_epoch + 1):
            steps.add(epoch * steps_per_epoch + max(1, round(steps_per_epoch * k / per_epoch)))
    return sorted(step for step in steps if step <= total)


def make_plan(cfg: TuneloopConfig, train_lengths: np.ndarray, train_targets: np.ndarray, eval_rows: int,
              dropped_too_long: int, world_size: int, dropped_no_trained_tokens: int = 0,
              sequence_lengths: np.ndarray | None = None, group: int = 1,
              source_lengths: np.ndarray | None = None) -> TrainingPlan:
    """`train_lengths`/`train_targets`: per unit (a row, or a preference pair of `group` sequences whose own
    lengths are `sequence_lengths`: unpacked, each gets a row of the micro-batch). `source_lengths`: an
    encoder-decoder's rows, the encoder's share of each row's length (the rest is the decoder's)."""
    cfg.check_batch_size(world_size)
    spec = train_spec(cfg, world_size)
    accum = cfg.gradient_accumulation_steps
    global_batch = cfg.micro_batch_size * accum * world_size
    if cfg.val_set_size and len(train_lengths) < global_batch:
        raise UserError(f"config: `val_set_size: {cfg.val_set_size:g}` leaves {len(train_lengths)} train rows, fewer "
                        f"than one global batch ({global_batch} rows): lower val_set_size or the batch")
    first_epoch = epoch_micro_batches(train_lengths, spec, epoch=0)
    micro_per_rank = len(first_epoch[0])
    if micro_per_rank == 0:
        raise UserError(f"plan: {len(train_lengths)} training rows make fewer micro-batches than the "
                        f"{world_size} ranks; lower micro_batch_size or use more data")
    steps_per_epoch = math.ceil(micro_per_rank / accum)
    total_steps = cfg.max_steps or steps_per_epoch * cfg.num_epochs
    epochs_to_run = math.ceil(total_steps / steps_per_epoch)

    # walk every step the run will take, on every rank, and count its tokens
    total_targets = total_real = computed = largest = 0
    sides = {"encoder": [0, 0], "decoder": [0, 0]}  # an encoder-decoder's [real, computed] tokens per side
    padding = padding_for(cfg)
    step = 0
    for epoch in range(epochs_to_run):
        per_rank = first_epoch if epoch == 0 else epoch_micro_batches(train_lengths, spec, epoch=epoch)
        for start in range(0, micro_per_rank, accum):
            step += 1
            if step > total_steps:
                break
            for batches in per_rank:
                for micro in batches[start:start + accum]:
                    for row in micro:
                        total_targets += int(train_targets[row].sum())
                        total_real += int(train_lengths[row].sum())
                    if source_lengths is not None:  # encoder and decoder, each padded to its longest row
                        encoder = np.concatenate([source_lengths[row] for row in micro])
                        decoder = np.concatenate([train_lengths[row] for row in micro]) - encoder
                        padded = 0
                        for side, lengths in (("encoder", encoder), ("decoder", decoder)):
                            width = padding.width(int(lengths.max()))
                            sides[side][0] += int(lengths.sum())
                            sides[side][1] += len(lengths) * width
                            padded += len(lengths) * width
                        computed += padded
                        largest = max(largest, padded)
                        continue
                    if group > 1 and spec.mode != "packed":  # a row per sequence
                        width = max(int(sequence_lengths[unit * group:(unit + 1) * group].max())
                                    for row in micro for unit in row)
                        rows = len(micro) * group
                    else:
                        width, rows = max(int(train_lengths[row].sum()) for row in micro), len(micro)
                    padded = padding.width(width)
                    computed += rows * padded
                    largest = max(largest, rows * padded)

    used_rows = sum(len(micro) for batches in first_epoch for micro in batches)
    if spec.mode == "packed":
        rows_cut = len(train_lengths) - sum(len(row) for batches in first_epoch for micro in batches for row in micro)
    else:
        rows_cut = len(train_lengths) - used_rows
    real_epoch0 = sum(int(train_lengths[row].sum()) for batches in first_epoch for micro in batches for row in micro)
    packing_efficiency = padding_fraction = None
    if spec.mode == "packed":
        packing_efficiency = round(real_epoch0 / (used_rows * cfg.sequence_len), 4)
    else:
        padding_fraction = round(1 - total_real / computed, 4) if computed else 0.0

    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else math.ceil((cfg.warmup_ratio or 0) * total_steps)
    # evals_per_epoch: 0 and eval_strategy: no turn evaluation off, the final eval included
    has_eval = eval_rows > 0 and cfg.evals_per_epoch != 0 and cfg.eval_strategy != "no"
    eval_at = _scheduled(total_steps, steps_per_epoch, cfg.eval_steps, cfg.evals_per_epoch, 1) if has_eval else []
    if has_eval and total_steps not in eval_at:
        eval_at.append(total_steps)  # the final model is always evaluated
    if has_eval and cfg.eval_on_start:
        eval_at.insert(0, 0)
    saves_off = cfg.save_strategy == "no" or cfg.saves_per_epoch == 0
    save_at = [] if saves_off else [s for s in _scheduled(total_steps, steps_per_epoch, cfg.save_steps,
                                                          cfg.saves_per_epoch, 1) if s < total_steps]

    plan = TrainingPlan(
        world_size=world_size, micro_batch_size=cfg.micro_batch_size, gradient_accumulation_steps=accum,
        global_batch_size=cfg.micro_batch_size * accum * world_size, batching=spec.mode,
        sequence_len=cfg.sequence_len, train_rows=len(train_lengths), train_tokens=int(train_lengths.sum()),
        trainable_tokens=int(train_targets.sum()), eval_rows=eval_rows, dropped_too_long=dropped_too_long,
        micro_batches_per_epoch=micro_per_rank, rows_cut_per_epoch=rows_cut, steps_per_epoch=steps_per_epoch,
        total_steps=total_steps, epochs_to_run=epochs_to_run,
        epochs_covered=round(total_steps / steps_per_epoch, 4), warmup_steps=warmup, eval_steps_at=eval_at,
        eval_count=len(eval_at), save_steps_at=save_at, save_count=len(save_at),
        tokens_per_step=round(total_targets / total_steps, 2), total_trainable_tokens=total_targets,
        total_real_tokens=total_real, packing_efficiency=packing_efficiency, padding_fraction=padding_fraction,
        max_micro_batch_tokens=largest, learning_rate=cfg.learning_rate, lr_scheduler=cfg.lr_scheduler,
        optimizer=cfg.optimizer, dropped_no_trained_tokens=dropped_no_trained_tokens, train_batching=spec,
        objective=cfg.rl or "language_model", unit=RL_METHODS[cfg.rl].unit if cfg.rl else "tokens",
        eval_batching=eval_spec(cfg, world_size, source_lengths is not None),
        padding=padding, first_epoch_batches=first_epoch,
    )
    if source_lengths is not None:
        plan.encoder_tokens, plan.decoder_tokens = sides["encoder"][0], sides["decoder"][0]
        plan.encoder_padding_fraction, plan.decoder_padding_fraction = (
            round(1 - real / computed_side, 4) if computed_side else 0.0 for real, computed_side in sides.values())
    plan.warnings = plan_warnings(cfg, plan)
    return plan


def make_stream_plan(cfg: TuneloopConfig, eval_rows: int, world_size: int, packed: bool,
                     encoder_decoder: bool = False) -> TrainingPlan:
    """The plan of a streamed run: `max_steps` steps of micro_batch_size × accumulation rows on every rank. Packed,
    every row is exactly sequence_len tokens, so the real tokens are exact too; the target tokens, the rows a
    pass holds and the number of passes are counted as the run reads them. Settings per epoch (evals_per_epoch,
    saves_per_epoch) count over the whole run: a stream has no epochs known in advance."""
    cfg.check_batch_size(world_size)
    accum, total_steps = cfg.gradient_accumulation_steps, cfg.max_steps
    global_rows = cfg.micro_batch_size * accum * world_size
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else math.ceil((cfg.warmup_ratio or 0) * total_steps)
    has_eval = eval_rows > 0 and cfg.evals_per_epoch != 0 and cfg.eval_strategy != "no"
    eval_at = _scheduled(total_steps, total_steps, cfg.eval_steps, cfg.evals_per_epoch, 1) if has_eval else []
    if has_eval and total_steps not in eval_at:
        eval_at.append(total_steps)
    if has_eval and cfg.eval_on_start:
        eval_at.insert(0, 0)
    saves_off = cfg.save_strategy == "no" or cfg.saves_per_epoch == 0
    save_at = [] if saves_off else [s for s in _scheduled(total_steps, total_steps, cfg.save_steps,
                                                          cfg.saves_per_epoch, 1) if s < total_steps]
    mode = "packed" if packed else "random"
    real = total_steps * global_rows * cfg.sequence_len if packed else None
    widest = cfg.micro_batch_size * cfg.sequence_len * (2 if encoder_decoder else 1)
    plan = TrainingPlan(
        world_size=world_size, micro_batch_size=cfg.micro_batch_size, gradient_accumulation_steps=accum,
        global_batch_size=global_rows, batching=f"streamed, {mode}", sequence_len=cfg.sequence_len, train_rows=0,
        train_tokens=0, trainable_tokens=0, eval_rows=eval_rows, dropped_too_long=0,
        # (a stream's epochs are unknown: a longer run resumes as a longer run, with its schedule stretched)
        micro_batches_per_epoch=None, rows_cut_per_epoch=0, steps_per_epoch=None,
        total_steps=total_steps, epochs_to_run=None, epochs_covered=None, warmup_steps=warmup, eval_steps_at=eval_at,
        eval_count=len(eval_at), save_steps_at=save_at, save_count=len(save_at), tokens_per_step=None,
        total_trainable_tokens=None, total_real_tokens=real, packing_efficiency=1.0 if packed else None,
        padding_fraction=None, max_micro_batch_tokens=widest, learning_rate=cfg.learning_rate,
        lr_scheduler=cfg.lr_scheduler, optimizer=cfg.optimizer, train_batching=BatchingSpec(
            mode, cfg.micro_batch_size, cfg.sequence_len, world_size, cfg.seed),
        eval_batching=eval_spec(cfg, world_size, encoder_decoder), padding=padding_for(cfg), streamed=True)
    plan.warnings = [text for text in plan_warnings(cfg, plan) if "passes over the data" not in text]
    return plan


def attach_memory_estimate(plan: TrainingPlan, estimate) -> None:
    """Adds the estimate (memory.py) to the plan, and a warning when it exceeds the device."""
    plan.estimated_memory_gb = estimate.total_gb
    plan.memory = asdict(estimate)
    if estimate.device_gb and estimate.total_gb > estimate.device_gb:
        ranks = f" per rank over {estimate.world_size} ranks" if estimate.world_size > 1 else ""
        plan.warnings.append(
            f"estimated memory {estimate.total_gb:.1f} GB{ranks} (weights {estimate.weights_gb:.1f}, gradients "
            f"{estimate.gradients_gb:.1f}, optimizer {estimate.optimizer_gb:.1f}, activations "
            f"{estimate.activations_gb:.1f}) is above the {estimate.device_gb:.0f} GB of {estimate.device}: "
            "lower micro_batch_size or sequence_len, or use gradient_checkpointing, an adapter, or more ranks with "
            "a sharding engine (fsdp, deepspeed zero3).")


MEMORY_REFUSAL_FACTOR = 1.5  # above this multiple of the device's memory, the run would die in the allocator


def check_memory_fits(plan: TrainingPlan, ranks_sharing_memory: int = 1) -> None:
    """Refuse to start a run whose estimate is far above the device's memory (on a CPU, the ranks of one host
    share its RAM). The estimate is rough, hence the margin; `--ignore-memory-estimate` starts anyway."""
    memory = plan.memory
    if not memory or not memory["device_gb"]:
        return
    needed = memory["total_gb"] * ranks_sharing_memory
    if needed > MEMORY_REFUSAL_FACTOR * memory["device_gb"]:
        ranks = f" for {ranks_sharing_memory} ranks on this host" if ranks_sharing_memory > 1 else ""
        raise UserError(f"plan: the run needs about {needed:.1f} GB{ranks} (weights {memory['weights_gb']:.1f}, "
                        f"activations {memory['activations_gb']:.1f}, ...), more than {MEMORY_REFUSAL_FACTOR}× the "
                        f"{memory['device_gb']:.0f} GB of {memory['device']}. Lower micro_batch_size or "
                        "sequence_len, or use gradient_checkpointing or an adapter; `tuneloop train "
                        "--ignore-memory-estimate` starts anyway.")


def plan_warnings(cfg: TuneloopConfig, plan: TrainingPlan) -> list[str]:
    found = []
    if cfg.max_steps and not plan.streamed and plan.epochs_covered != cfg.num_epochs:
        covered = plan.total_steps / plan.steps_per_epoch  # unrounded: 2 steps of 148,480 round to 0 passes
        ratio = cfg.num_epochs / covered
        text = (f"max_steps={cfg.max_steps} covers {covered:.4g} passes over the data, "
                f"while num_epochs={cfg.num_epochs}; max_steps wins.")
        if plan.world_size > 1 and math.isclose(ratio, plan.world_size, rel_tol=0.02):
            text += (f" The ratio is the world size ({plan.world_size}): you probably counted per-device "
                     "batches; one step here consumes a global batch from every rank.")
        found.append(text)
    if plan.padding_fraction is not None and plan.padding_fraction > 0.20 and not (
            cfg.group_by_length and plan.encoder_tokens is not None):  # (nothing left to suggest)
        remedy = ("`group_by_length: true` would reclaim most of it" if plan.encoder_tokens is not None
                  else "`sample_packing: true` (or `group_by_length: true`) would reclaim most of it")
        found.append(f"{plan.padding_fraction:.0%} of the computed tokens are padding; {remedy}.")
    for name, count in (("eval", plan.eval_count), ("save", plan.save_count)):
        if count > 1 / FREQUENT_FRACTION:
            found.append(f"{count} {name}s in {plan.total_steps} steps: one every "
                         f"{plan.total_steps / count:.1f} steps costs time; space them out.")
    read = plan.train_rows + plan.eval_rows + plan.dropped_too_long + plan.dropped_no_trained_tokens
    if read and plan.dropped_no_trained_tokens / read > 0.01:
        found.append(f"{plan.dropped_no_trained_tokens} of {read} rows have no trained token (nothing for the loss, "
                     "e.g. no turn of a role in roles_to_train) and are dropped.")
    if read and plan.dropped_too_long / read > 0.01:
        found.append(f"sequence_len={cfg.sequence_len} drops {plan.dropped_too_long} of {read} rows "
                     f"({plan.dropped_too_long / read:.1%}); raise sequence_len to keep them.")
    asked_for_evals = [key for key in ("eval_steps", "evals_per_epoch", "eval_on_start", "early_stopping_patience")
                       if getattr(cfg, key)]
    if not plan.eval_rows and asked_for_evals:
        found.append(f"{', '.join(asked_for_evals)} set, but there is no eval set (val_set_size or test_datasets): "
                     "no eval will run" + (", and early stopping cannot stop the run" if cfg.early_stopping_patience
                                           else "") + ".")
    if not plan.streamed and plan.micro_batches_per_epoch < plan.gradient_accumulation_steps:
        found.append(f"the global batch ({plan.global_batch_size} rows) is larger than one epoch of data "
                     f"({plan.micro_batches_per_epoch} micro-batches per rank): every step is a partial batch; "
                     "lower micro_batch_size or gradient_accumulation_steps.")
    if plan.warmup_steps >= plan.total_steps:
        found.append(f"warm-up ({plan.warmup_steps} steps) is as long as the run ({plan.total_steps} steps) "
                     "or longer: the learning rate never reaches its peak.")
    if plan.rows_cut_per_epoch:
        found.append(f"{plan.rows_cut_per_epoch} rows per epoch do not fill a micro-batch on every one of the "
                     f"{plan.world_size} ranks and are left out of that epoch (a different set each epoch).")
    return found


def describe(plan: TrainingPlan) -> str:
    """The human-readable plan: a short report, numbers first."""
    if plan.streamed:
        return _describe_streamed(plan)
    rows = "pairs" if plan.unit == "pairs" else "rows"
    batch_rows, per_step = rows, ""
    if plan.batching == "packed" and plan.unit != "tokens":  # a packed row holds several pairs (KTO: rows)
        batch_rows = "packed rows"
        per_step = f" (~{(plan.train_rows - plan.rows_cut_per_epoch) / plan.steps_per_epoch:.1f} {rows} per step)"
    density = (f"packing efficiency {plan.packing_efficiency:.1%}" if plan.packing_efficiency is not None
               else f"padding {plan.padding_fraction:.1%} of computed tokens")
    lines = [
        "tuneloop plan",
        *([f"  model                {plan.model}"] if plan.model else []),
        f"  world size           {plan.world_size}",
        f"  batch                {plan.micro_batch_size} {batch_rows}/micro-batch × {plan.gradient_accumulation_steps} "
        f"accumulation × {plural(plan.world_size, 'rank')} = {plan.global_batch_size} {batch_rows} per optimizer step"
        + per_step,
        f"  batching             {plan.batching} (sequence_len {plan.sequence_len}; {density})",
        f"  data                 {plan.train_rows} train {rows}, {plan.train_tokens} tokens, "
        f"{plan.trainable_tokens} trained tokens per epoch; {plan.eval_rows} eval {rows}",
        f"  steps                {plan.steps_per_epoch} per epoch ({plan.micro_batches_per_epoch} micro-batches "
        f"per rank), {plan.total_steps} in total = {plural(plan.epochs_covered, 'epoch')}",
        f"  tokens               {plan.tokens_per_step:.0f} trained tokens per step, "
        f"{plan.total_trainable_tokens} over the run",
        f"  optimizer            {plan.optimizer}, learning rate {plan.learning_rate:g}, {plan.lr_scheduler} schedule, "
        f"warm-up {plural(plan.warmup_steps, 'step')}",
    ]
    lines += _machine_lines(plan)
    return "\n".join(lines)


def _describe_streamed(plan: TrainingPlan) -> str:
    rows = "full rows" if plan.packing_efficiency else "rows"
    tokens = (f"{plan.total_real_tokens // plan.total_steps} tokens per step ({plan.global_batch_size} × "
              f"{plan.sequence_len}), {plan.total_real_tokens} over the run" if plan.total_real_tokens is not None
              else "each row as long as it is (padded to the longest of its micro-batch)")
    lines = [
        "tuneloop plan",
        *([f"  model                {plan.model}"] if plan.model else []),
        f"  world size           {plan.world_size}",
        f"  batch                {plan.micro_batch_size} {rows}/micro-batch × {plan.gradient_accumulation_steps} "
        f"accumulation × {plural(plan.world_size, 'rank')} = {plan.global_batch_size} {rows} per optimizer step",
        f"  batching             {plan.batching} (sequence_len {plan.sequence_len})",
        "  data                 streamed: each rank reads its own share of the rows as the run goes; passes over "
        f"the data and trained tokens are counted as they come; {plan.eval_rows} eval rows",
        f"  steps                {plan.total_steps} (max_steps)",
        f"  tokens               {tokens}",
        f"  optimizer            {plan.optimizer}, learning rate {plan.learning_rate:g}, {plan.lr_scheduler} schedule, "
        f"warm-up {plural(plan.warmup_steps, 'step')}",
    ]
    return "\n".join(lines + _machine_lines(plan))


def _machine_lines(plan: TrainingPlan) -> list[str]:
    """The plan's lines after the data's: precision, compute, engine, memory, evals, saves, drops, warnings."""
    lines = []
    if plan.encoder_tokens is not None:
        lines.append(f"  encoder-decoder      encoder {plan.encoder_tokens} tokens (padding "
                     f"{plan.encoder_padding_fraction:.1%}), decoder {plan.decoder_tokens} tokens (padding "
                     f"{plan.decoder_padding_fraction:.1%}) over the run")
    if plan.objective != "language_model":
        together = ("chosen and rejected" if plan.unit == "pairs"
                    else "each row's reply and its mismatched reply for the KL estimate")
        lines.append(f"  objective            {plan.objective}: loss averaged over the {plan.unit} of each step "
                     f"({together} in one micro-batch); reference {plan.reference or 'none'}")
    if plan.precision is not None:
        lines.append(f"  precision            {plan.precision}; attention {plan.attention}")
    if plan.torch_compile is not None:
        lines.append(f"  compile              {plan.torch_compile}: the first step compiles (it can take a minute) "
                     "and is timed apart; widths rounded up to multiples of 64")
    if plan.peak_source is not None:
        lines.append(f"  compute              {_compute_line(plan)}")
    if plan.engine is not None:
        lines.append(f"  engine               {plan.engine}")
    lines += [
        f"  memory               {_memory_line(plan)}",
        f"  evals                {plan.eval_count} (at steps {_short(plan.eval_steps_at)})",
        f"  saves                {plan.save_count} (at steps {_short(plan.save_steps_at)})",
    ]
    dropped = [f"{plan.dropped_too_long} longer than sequence_len"] if plan.dropped_too_long else []
    if plan.dropped_no_trained_tokens:
        dropped.append(f"{plan.dropped_no_trained_tokens} with no trained token")
    if plan.dropped_identical_pairs:
        dropped.append(f"{plan.dropped_identical_pairs} pairs whose chosen and rejected replies are the same")
    if dropped:
        lines.append(f"  dropped rows         {'; '.join(dropped)}")
    for warning in plan.warnings:
        lines.append(f"  warning: {warning}")
    return lines


def _compute_line(plan: TrainingPlan) -> str:
    if plan.flops_per_token is None:
        return f"MFU {plan.peak_source}"
    return (f"{plan.flops_per_token / 1e9:.3g} GFLOP per real token (attention over {plan.attention_context:g} "
            f"positions on average); MFU against {plan.peak_source}")


def _memory_line(plan: TrainingPlan) -> str:
    if plan.memory is None:
        return "not estimated"
    m = plan.memory
    device = f" of {m['device_gb']:.0f} GB on {m['device']}" if m["device_gb"] else ""
    per_rank = " per rank" if m.get("world_size", 1) > 1 else ""
    return (f"~{m['total_gb']:.2f} GB{per_rank}{device} (weights {m['weights_gb']:.2f}, gradients "
            f"{m['gradients_gb']:.2f}, optimizer {m['optimizer_gb']:.2f}, activations {m['activations_gb']:.2f}"
            + (f", gathered layers {m['gathered_gb']:.2f}" if m.get("gathered_gb") else "")
            + (f", reference copy {m['reference_gb']:.2f}" if m.get("reference_gb") else "")
            + (f"; {m['host_gb']:.2f} GB offloaded to host memory" if m.get("host_gb") else "") + "; "
            f"{m['trainable_parameters']:,} of "
            f"{m['parameters']:,} parameters trained)")


def plural(count: float, word: str) -> str:
    return f"{count:g} {word}" if count == 1 else f"{count:g} {word}s"


def _short(steps: list[int]) -> str:
    if not steps:
        return "none"
    return ", ".join(map(str, steps)) if len(steps) <= 8 else f"{', '.join(map(str, steps[:6]))}, …, {steps[-1]}"
