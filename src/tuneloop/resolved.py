"""What a run is, decided once: precision, attention kernel, model kind, engine, batching, stored or streamed data,
compiled or not, activation checkpointing.

The config says what the user asked for; some answers also depend on the machine (is there native bf16, can
flash-attention run) and on the model's own config (is it an encoder-decoder). Each is decided here, in one
function, into a frozen `Resolved` that everything below reads: the plan carries it (and plan.json shows it),
the session builds Accelerate from it, the model loader, the engines, the data and the loop read it. Nothing
re-derives these from the config.

Two stages: `resolve_config(cfg)` is what the config alone can say (no torch, no model: `tuneloop check`);
`resolve_run(cfg)` adds the machine and the model's config (plan, train, eval).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace

from tuneloop.engines.base import EngineSpec
from tuneloop.engines.keys import run_engine, uncompiled_by
from tuneloop.host.hardware import quantized_loading
from tuneloop.model.kinds import ModelKind, kind_of_config, named_kind, recurrent_layers

PRECISION_NAMES = {"no": "fp32", "bf16": "bf16 mixed precision", "fp16": "fp16 mixed precision"}
FLASH_PACKAGES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


@dataclass(frozen=True)
class Precision:
    mixed: str  # Accelerate's mixed_precision: "no" (fp32), "bf16" or "fp16"
    why: str  # in words: which key, and what the machine has
    # the model computes with bf16 weights and the optimizer steps fp32 master copies of them (engines/masters.py);
    # False: fp32 weights that autocast casts in every forward (or the 16-bit weights `bfloat16` loads)
    masters: bool = False
    # an adapter's frozen base holds its matmul weights in bf16: autocast's cast of them, made once (masters.py)
    frozen_bf16: bool = False

    @property
    def name(self) -> str:
        if self.masters:
            return "bf16 mixed precision with bf16 compute weights and fp32 masters"
        if self.frozen_bf16:
            return "bf16 mixed precision with the frozen base's matmul weights held in bf16"
        return PRECISION_NAMES[self.mixed]

    def __str__(self) -> str:
        return f"{self.name} ({self.why})"


@dataclass(frozen=True)
class Attention:
    asked: str  # what the config asks for (attn_implementation, or axolotl's flags)
    used: str | None = None  # what the model loads with; None until the machine is known
    note: str | None = None  # why it is not the one asked for


@dataclass(frozen=True, kw_only=True)
class Resolved:
    engine: EngineSpec  # how the ranks share the model (engines/)
    streamed: bool  # training rows read as the run goes, instead of prepared whole
    batching: str  # training micro-batches: "packed", "group_by_length", "token_budget" or "random"
    eval_batching: str  # eval micro-batches: "packed", "group_by_length" or "token_budget"
    compiled: bool  # torch.compile of the training step
    compile_auto: bool  # `torch_compile: auto`, left to the plan (plan/compile_choice.py); never where nothing compiles
    gradient_checkpointing: bool | str  # layers recomputed in the backward: True, "offload" (kept in CPU memory), False
    attention: Attention
    model_kind: ModelKind | None  # model/kinds.py's MODEL_KINDS; None: not known from the config alone
    precision: Precision | None = None  # None: not known without the machine
    packing_note: str | None = None  # why packing that was asked for is not done (the plan warns with it)

    @property
    def encoder_decoder(self) -> bool:
        return self.model_kind is not None and self.model_kind.encoder_decoder

    def to_json(self) -> dict:
        return {"precision": None if self.precision is None else {"mixed": self.precision.mixed,
                                                                  "masters": self.precision.masters,
                                                                  "frozen_bf16": self.precision.frozen_bf16,
                                                                  "name": self.precision.name,
                                                                  "why": self.precision.why},
                "attention": {"asked": self.attention.asked, "used": self.attention.used, "note": self.attention.note},
                "model_kind": self.model_kind and self.model_kind.name, "engine": self.engine.identity(),
                "batching": self.batching, "eval_batching": self.eval_batching, "streamed": self.streamed,
                "compiled": self.compiled, "compile_auto": self.compile_auto,
                "gradient_checkpointing": self.gradient_checkpointing}


def resolve_config(cfg) -> Resolved:
    """Stage 1: what the config alone decides (the kind only where `model_type` names it)."""
    return _resolved(cfg, named_kind(cfg))


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve_run(cfg, model_config=None) -> Resolved:
    """Stage 2: with this machine and the model's config (read here unless given)."""
    from tuneloop.kernels.packed_attention import model_can_split

    if model_config is None:
        from tuneloop.model.model_config import model_config as read_model_config

        model_config = read_model_config(cfg)
    kind = named_kind(cfg) or kind_of_config(model_config)
    decided = _resolved(cfg, kind)
    packed = "packed" in (decided.batching, decided.eval_batching) and not decided.encoder_decoder
    recurrent = packed and recurrent_layers(model_config)
    if recurrent and decided.streamed and decided.batching == "packed":
        # a stream cut into rows of whole sequence_len has no unpacked form that keeps its long documents: grouped
        # by length, every document longer than sequence_len would be dropped unseen
        from tuneloop.errors import UserError

        raise UserError(f"config: this run streams its documents packed into rows of sequence_len, and {recurrent} "
                        "carry state from one packed sequence into the next (the kernels here take no sequence "
                        "boundaries): train this model on prepared data instead (`datasets:` with `type: "
                        "completion` and no `streaming`), where rows are grouped by length")
    if recurrent:
        decided = replace(decided, batching="group_by_length" if decided.batching == "packed" else decided.batching,
                          eval_batching=eval_batching(cfg, True), packing_note=(
                              f"sample packing is set aside: {recurrent} carry state from one packed sequence into "
                              "the next (the kernels here take no sequence boundaries), so rows are grouped by "
                              "length instead: the same loss per sequence, with some padding"))
        packed = False
    # packed rows anywhere; on a CPU padded rows too (each row's real tokens apart, kernels/packed_attention.py)
    padded_on_cpu = not decided.encoder_decoder and not _cuda_available()
    splittable = (packed or padded_on_cpu) and not cfg.trust_remote_code and model_can_split(model_config)
    run_precision = precision(cfg, decided.engine)
    chosen = attention(cfg, splittable, sixteen_bit=run_precision.mixed != "no" or bool(cfg.bfloat16 or cfg.float16))
    if not cfg.trust_remote_code:
        chosen = eager_without_sdpa(chosen, model_config)
    blind = packed and chosen.used == "eager" and PACKING_BLIND_MASKS.get(getattr(model_config, "model_type", None))
    if blind:
        decided = _unpacked(decided, blind, eval_batching(cfg, True))
    return replace(decided, precision=run_precision, attention=chosen)


# model types whose attention masks ignore packed rows' position_ids (transformers 5.24), so that eager attention
# lets a packed row's sequences attend to each other; flash-attention's varlen kernels take the boundaries from
# position_ids themselves (measured: a tiny gpt_oss's logits of a packed row's second sequence differ from its
# own by 0.4 under eager)
PACKING_BLIND_MASKS = {"gpt_oss": "GptOss builds its attention masks without the packed rows' position_ids, so "
                                  "under eager attention packed sequences would attend to each other"}


def _unpacked(decided: Resolved, why: str, unpacked_eval: str) -> Resolved:
    """Packing set aside for rows grouped by length (the same loss per sequence, with some padding), or refused for a
    packed stream, whose long documents have no unpacked form."""
    if decided.streamed and decided.batching == "packed":
        from tuneloop.errors import UserError

        raise UserError(f"config: this run streams its documents packed into rows of sequence_len, and {why}: train "
                        "this model on prepared data instead (`datasets:` with `type: completion` and no "
                        "`streaming`), where rows are grouped by length")
    return replace(decided, batching="group_by_length" if decided.batching == "packed" else decided.batching,
                   eval_batching=unpacked_eval,
                   packing_note=f"sample packing is set aside: {why}, so rows are grouped by length instead: the same "
                                "loss per sequence, with some padding")


SDPA_FALLBACK_WORDS = "using sdpa (the same attention, another kernel)"


def eager_without_sdpa(chosen: Attention, model_config) -> Attention:
    """Eager attention where SDPA would run and the model's class has none (gpt-oss: its attention sinks are no
    argument of SDPA, and neither transformers' SDPA nor the per-sequence split would apply them): transformers
    refuses to load such a class under sdpa. Eager is the class's own attention, packed rows included (transformers
    builds the same block-diagonal mask from position_ids)."""
    from transformers import AutoModelForCausalLM

    from tuneloop.kernels.packed_attention import PER_SEQUENCE_SDPA

    if chosen.used not in ("sdpa", PER_SEQUENCE_SDPA):
        return chosen
    try:
        model_class = AutoModelForCausalLM._model_mapping[type(model_config)]
    except (KeyError, ValueError):
        return chosen  # (not a causal class transformers maps: its own loader says what it supports)
    if getattr(model_class, "_supports_sdpa", True):
        return chosen
    instead = f"using eager ({model_class.__name__} has no SDPA attention in transformers; the same attention)"
    if chosen.note and SDPA_FALLBACK_WORDS in chosen.note:
        return Attention(chosen.asked, "eager", chosen.note.replace(SDPA_FALLBACK_WORDS, instead))
    return Attention(chosen.asked, "eager", f"attention `{chosen.asked}`: {instead}")


def _resolved(cfg, kind: ModelKind | None) -> Resolved:
    encoder_decoder = kind is not None and kind.encoder_decoder
    engine = run_engine(cfg, quantized_loading(cfg))
    return Resolved(engine=engine, streamed=cfg.streams, batching=batching(cfg, encoder_decoder),
                    eval_batching=eval_batching(cfg, encoder_decoder), compiled=compiled(cfg, engine),
                    compile_auto=cfg.torch_compile == "auto" and uncompiled_by(engine) is None,
                    gradient_checkpointing=gradient_checkpointing(cfg, engine),
                    attention=Attention(requested_attention(cfg)), model_kind=kind)


def batching(cfg, encoder_decoder: bool) -> str:
    """How training rows make micro-batches. Packed where asked (a pretraining stream always packs), but never for
    an encoder-decoder (its relative positions and cross-attention do not separate packed rows)."""
    if cfg.streams:
        return "packed" if (cfg.pretraining_dataset or cfg.sample_packing) and not encoder_decoder else "random"
    if cfg.sample_packing:
        return "packed"
    if cfg.max_tokens_per_micro_batch:
        if encoder_decoder:
            from tuneloop.errors import UserError

            raise UserError("config: `max_tokens_per_micro_batch` with an encoder-decoder model: its two sides pad "
                            "apart, and tuneloop budgets one; remove it (`group_by_length: true` groups rows by "
                            "length)")
        return "token_budget"
    return "group_by_length" if cfg.group_by_length else "random"


def eval_batching(cfg, unpacked: bool) -> str:
    """How eval rows make micro-batches; `unpacked`: an encoder-decoder, or a model whose packed rows would mix."""
    if cfg.resolved_eval_sample_packing and not unpacked:
        return "packed"
    return "token_budget" if cfg.max_tokens_per_micro_batch else "group_by_length"


def compiled(cfg, engine: EngineSpec) -> bool:
    """`torch_compile: true`, but never under a sharding engine or context parallel (engines/keys.py: uncompiled_by;
    config/rules.py says so). `auto` (the default) is decided by the plan, from the run's length and what this
    machine measured for the model (plan/compile_choice.py), and starts here as not compiled; axolotl's auto means
    "torch is recent enough" (2.5.1), which every torch tuneloop runs on is."""
    return cfg.torch_compile is True and uncompiled_by(engine) is None


def gradient_checkpointing(cfg, engine: EngineSpec) -> bool | str:
    """`gradient_checkpointing` (true, or "offload"), or FSDP's `activation_checkpointing`, which asks for the same
    recomputation."""
    return cfg.gradient_checkpointing or engine.activation_checkpointing


def precision(cfg, engine: EngineSpec) -> Precision:
    """Accelerate's mixed precision for the config on this machine, whether the weights it computes with are bf16
    copies of fp32 masters, and why."""
    mixed = _mixed_precision(cfg)
    masters, why_not = master_weights(cfg, mixed.mixed, engine)
    if masters:
        return replace(mixed, masters=True, why=f"{mixed.why}; master_weights: {cfg.master_weights}")
    if frozen_weights_in_bf16(cfg, mixed.mixed, engine):
        return replace(mixed, frozen_bf16=True, why=f"{mixed.why}; master_weights: {cfg.master_weights}")
    if why_not and cfg.master_weights is True:  # (config/rules.py refuses what the config alone rules out)
        from tuneloop.errors import UserError

        raise UserError(f"config: `master_weights: true` needs {why_not}")
    return mixed


def frozen_weights_in_bf16(cfg, mixed: str, engine: EngineSpec) -> bool:
    """An adapter's frozen base holds its matmul weights in bf16 under bf16 mixed precision (engines/masters.py):
    autocast would cast them to bf16 in every forward anyway, and they never change. Where the base is not fp32
    (`bfloat16`/`float16`, 4- and 8-bit), where the engine keeps its own precision (FSDP2, DeepSpeed), and under
    DoRA (its magnitude reads the base weight's fp32 norm in every forward) they stay as loaded;
    `master_weights: false` keeps them fp32 too."""
    return (mixed == "bf16" and cfg.adapter is not None and cfg.master_weights is not False
            and not (cfg.bfloat16 or cfg.float16 or cfg.load_in_4bit or cfg.load_in_8bit or cfg.peft_use_dora)
            and engine.name == "ddp")


def master_weights(cfg, mixed: str, engine: EngineSpec) -> tuple[bool, str | None]:
    """(bf16 compute weights with fp32 masters, what rules them out). They compute what autocast computes (the
    same bf16 products of the same rounded weights, gradients added into fp32) without casting every weight in
    every forward and backward: one copy per optimizer step instead (engines/masters.py). Only the DDP engine needs
    them: FSDP2's mixed precision and DeepSpeed's bf16 keep fp32 masters of their own."""
    from tuneloop.config.rules import master_weights_blocker

    if cfg.master_weights is False:
        return False, None
    blocker = master_weights_blocker(cfg, mixed, engine)
    return blocker is None, blocker


def _mixed_precision(cfg) -> Precision:
    import torch

    from tuneloop.errors import UserError
    from tuneloop.host.hardware import mixed_precision, native_bf16

    if cfg.fp16 and not torch.cuda.is_available():  # accelerate would accept it and quietly train in fp32
        raise UserError("config: `fp16: true` needs a CUDA GPU, and this machine has none (accelerate would "
                        "silently train in fp32 here). Remove it, or use `bf16: true` where the CPU has bf16.")
    native = native_bf16() if cfg.bf16 == "auto" and not cfg.fp16 else None
    return Precision(*mixed_precision(cfg.fp16, cfg.bf16, native))


def slow_bf16_note(cfg, mixed: Precision) -> str | None:
    """`bf16: true` on a CPU without bf16 instructions (no AVX512-BF16 or AMX): kept, as asked, but said. There
    bf16 products are emulated: a 2048² matmul ran 1.9 GFLOPS in bf16 against 38 in fp32 on an AVX2 EPYC."""
    import torch

    from tuneloop.host.hardware import native_bf16

    if mixed.mixed != "bf16" or cfg.bf16 is not True or torch.cuda.is_available() or native_bf16():
        return None
    return ("`bf16: true` on a CPU without bf16 instructions (AVX512-BF16 or AMX): its bf16 products are emulated, "
            "an order of magnitude slower than fp32 here; `bf16: auto` trains in fp32 on such a machine")


def requested_attention(cfg) -> str:
    if cfg.attn_implementation:
        return cfg.attn_implementation
    if cfg.flash_attention:
        return "flash_attention_2"
    if cfg.flex_attention:
        return "flex_attention"
    return "eager" if cfg.eager_attention else "sdpa"  # sdp_attention: true says sdpa too


def attention(cfg, packed: bool = False, sixteen_bit: bool = False) -> Attention:
    """The attention implementation the model loads with, and a note when it is not the one asked for.

    Flash-attention kernels (and xformers, hub kernels, flex attention) compute the same attention as SDPA,
    packed rows included (transformers builds the block-diagonal mask from position_ids for SDPA and uses
    the varlen path for flash-attention), so where they cannot run the run uses SDPA and says so.

    `packed` (rows that can be split — packed rows, and padded ones on a CPU — of a model whose attention goes
    through transformers' attention interface): on a CPU, SDPA runs each packed sequence, or each padded row's real
    tokens, on its own where that is cheaper than the whole row under one mask (kernels/packed_attention.py; measured
    there; under torch.compile it stays eager). On a GPU a `sixteen_bit` run's
    packed rows go to torch's own varlen flash kernel in one call (where this torch has it: no flash-attn
    package needed), which skips the masked blocks SDPA's kernels compute. Not where the config says
    `attn_implementation: sdpa`, which names transformers' SDPA path as it is (`attn_implementation:
    sdpa_per_sequence` asks for the split anywhere)."""
    import torch

    from tuneloop.kernels.packed_attention import PER_SEQUENCE_SDPA, varlen_kernel

    asked = requested_attention(cfg)
    cuda = torch.cuda.is_available()
    chosen = (packed and cfg.attn_implementation != "sdpa"
              and (not cuda or (sixteen_bit and varlen_kernel() is not None)))
    if asked in ("sdpa", "eager", PER_SEQUENCE_SDPA):
        return Attention(asked, PER_SEQUENCE_SDPA if asked == "sdpa" and chosen else asked)
    if asked in FLASH_PACKAGES:
        if cuda and importlib.util.find_spec(FLASH_PACKAGES[asked]) is not None:
            return Attention(asked, asked)
        reason = "a CUDA GPU" if not cuda else f"the {FLASH_PACKAGES[asked]} package"
    elif asked.startswith("kernels-community/"):
        if cuda and importlib.util.find_spec("kernels") is not None:
            return Attention(asked, asked)
        reason = "a CUDA GPU and the kernels package"
    elif asked == "flex_attention":
        if cuda:
            return Attention(asked, asked)
        reason = "a CUDA GPU (on CPU it compiles slowly)"
    else:  # xformers: transformers has no xformers attention
        reason = "transformers' xformers support, which it does not have"
    if chosen and cuda:
        return Attention(asked, PER_SEQUENCE_SDPA, f"attention `{asked}` needs {reason}: packed rows use torch's own "
                                                   "varlen flash-attention kernel (the same attention)")
    used = PER_SEQUENCE_SDPA if chosen else "sdpa"
    return Attention(asked, used, f"attention `{asked}` needs {reason}: using sdpa (the same attention, another "
                                  "kernel)")
