"""The config's fields, as axolotl names them, each with its own checks (one value at a time).

What several keys mean together is config/rules.py's (one function per feature); reading the YAML, `--set` and
axolotl's key table is config/load.py's. Whether a resumed run may change a field is declared on the field
(`Annotated[..., WATCHING]` and friends): a field without such a mark decides what is trained, and a checkpoint
written with another value of it is another run (train/resume.py).
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, Discriminator, Field, PrivateAttr, Tag, field_validator, model_validator

from tuneloop.config import axolotl
from tuneloop.config.datasets import (DATASET_FORM, PRETRAINING_FORM, DatasetConfig, PretrainingDataset, Strict,
                                      home_expanded, pretraining_entry_form)
from tuneloop.config.hub import repo_id_problem
from tuneloop.config.names import name_pattern
from tuneloop.config.qat_block import QATBlock
from tuneloop.config.ebft_block import EBFTBlock
from tuneloop.config.vllm_block import VLLMBlock
from tuneloop.data.chat_templates import check_template_name
from tuneloop.errors import UserError
from tuneloop.optim import OPTIMIZERS, SCHEDULERS
from tuneloop.online_rl.settings import TRLBlock
from tuneloop.rl_methods import NOT_OFFERED, ONLINE_METHODS, RL_METHODS


@dataclass(frozen=True)
class OnResume:
    """A field a resumed run may set to another value than its checkpoint's, and why."""

    why: str


WATCHING = OnResume("when and how the run is observed, evaluated, saved or stopped, not what it trains")
SPEED = OnResume("speed only: the same rows and the same loss")
TRACKING = OnResume("where the metrics go")
RUN_LENGTH = OnResume("the run's length, which a resume may change while it ends after the checkpoint (resume.py)")

ZERO_MEANS = {"evals_per_epoch": " (no evals)", "saves_per_epoch": " (no saves)", "max_grad_norm": " (no clipping)"}
# what `attn_implementation` may say; kernels that cannot run on this machine fall back to sdpa (same maths).
# sdpa_per_sequence: SDPA over each packed sequence apart (kernels/packed_attention.py), which tuneloop chooses itself
# for packed CPU runs unless `attn_implementation: sdpa` asks for transformers' SDPA path as it is
# the one transformers quantization config class a checkpoint loads through (gpt-oss's MXFP4 experts, dequantized:
# quant/mxfp4.py), and the settings tuneloop passes to it (config/rules.py refuses the others)
MXFP4_CLASS = "Mxfp4Config"
MXFP4_SETTINGS = ("dequantize",)
ATTENTION_IMPLEMENTATIONS = {"sdpa", "sdpa_per_sequence", "eager", "flash_attention_2", "flash_attention_3",
                             "flex_attention", "xformers"}
# the text-to-text (encoder-decoder) model families: their *ForConditionalGeneration classes are seq2seq models,
# not the multimodal ones of the same suffix (model/model_config.py checks that the class and the checkpoint agree)
SEQ2SEQ_FAMILIES = ("T5", "MT5", "UMT5", "LongT5", "Bart", "MBart", "PLBart", "Pegasus", "PegasusX", "BigBirdPegasus",
                    "Blenderbot", "BlenderbotSmall", "LED", "M2M100", "NllbMoe", "FSMT", "Mvp", "ProphetNet",
                    "SwitchTransformers", "T5Gemma", "Marian")


# peft's `init_lora_weights` values tuneloop takes (besides true and false): each leaves the base weights as they
# are, so the saved adapter means the same on them (gaussian: A drawn with std 1/r; orthogonal: A and B from one
# orthogonal draw, B·A = 0; mica: B from the smallest singular directions of W, frozen, A from 0)
INIT_LORA_WEIGHTS = ("gaussian", "orthogonal", "mica")
BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq")  # (and pissa_niter_N)
DATA_DRIVEN_INITS = ("eva", "lora_ga")


def is_seq2seq_class(name: str) -> bool:
    family = name.removesuffix("ForConditionalGeneration").removesuffix("MTModel")
    return name != family and family in SEQ2SEQ_FAMILIES


def _compiled(written: str, pattern: str) -> None:
    try:
        re.compile(pattern)
    except re.error as error:
        raise ValueError(f"{written!r} is not a valid regular expression ({error})") from None


class TrainTokenizer(Strict):
    """tuneloop's own key: a tokenizer trained on the run's training text (with the `tokenizers` library) before
    the data is prepared, for a model trained from scratch. It is cached beside the prepared data and saved with
    the model; the model's embeddings are sized to it."""

    type: Literal["bpe", "unigram"] = "bpe"
    vocab_size: int = 8000
    # what each special token is called; the first ids go to them in this order (T5's: pad 0, eos 1, unk 2)
    special_tokens: dict[str, str] = Field(default_factory=lambda: {"pad_token": "<pad>", "eos_token": "</s>",
                                                                   "unk_token": "<unk>"})
    min_frequency: int = 2

    @field_validator("vocab_size")
    @classmethod
    def _vocabulary(cls, value):
        if value < 32:
            raise ValueError("must be at least 32 (the special tokens and the bytes or characters need room)")
        return value

    @field_validator("special_tokens")
    @classmethod
    def _special(cls, value):
        known = ("pad_token", "eos_token", "unk_token", "bos_token", "sep_token", "cls_token", "mask_token")
        for name in value:
            if name not in known:
                raise ValueError(f"`{name}` is not a special token name; use {', '.join(known)}")
        for needed in ("pad_token", "eos_token"):
            if needed not in value:
                raise ValueError(f"needs `{needed}` (padding and the end of every target use it)")
        return value

    @model_validator(mode="after")
    def _unknown_for_unigram(self):
        if self.type == "unigram" and "unk_token" not in self.special_tokens:
            raise ValueError("a unigram tokenizer needs `special_tokens.unk_token`: a character it never saw in "
                             "training (in eval rows or a prompt) has no other token to become")
        return self



class TuneloopConfig(Strict):
    _config_dir: Any = PrivateAttr(default=None)  # the YAML's folder (reward functions and transforms live there)
    # model: pretrained weights (base_model), or a model built from a config with random weights (from scratch:
    # base_model_config, a folder or a model type name such as `t5`, or reinit_weights)
    base_model: Optional[str] = None
    base_model_config: Optional[str] = None
    reinit_weights: bool = False
    train_tokenizer: Optional[TrainTokenizer] = None
    model_type: Optional[str] = None  # a transformers class name; axolotl's `type_of_model` too
    revision_of_model: Optional[str] = None  # axolotl's `model_revision` too
    overrides_of_model_config: Optional[dict[str, Any]] = None  # axolotl's `model_config` too
    tokenizer_config: Optional[str] = None
    tokenizer_type: Optional[str] = None  # a transformers tokenizer class name
    # mistral-common's tokenizer (tekken.json) and chat encoding, as Mistral's models are trained (data/mistral_chat.py)
    tokenizer_use_mistral_common: bool = False
    trust_remote_code: bool = False
    attn_implementation: Optional[str] = None
    flash_attention: bool = False
    sdp_attention: bool = False
    flex_attention: bool = False
    eager_attention: bool = False
    special_tokens: dict[str, str] = Field(default_factory=dict)
    tokens: list[str] = Field(default_factory=list)  # new tokens added to the vocabulary
    chat_template: Optional[str] = None
    chat_template_jinja: Optional[str] = None
    eot_tokens: Optional[list[str]] = None  # the text that ends a chat turn (its trained end marker)
    plugins: list[str] = Field(default_factory=list)
    # adapters and quantized loading
    adapter: Optional[Literal["lora", "qlora"]] = None
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: Optional[Union[str, list[str]]] = None  # names, or one regex over module paths
    lora_target_parameters: Optional[list[str]] = None
    lora_target_linear: bool = False
    lora_modules_to_save: Optional[list[str]] = None
    # LoRA variants, passed to peft's LoraConfig as axolotl does (adapters.py); the rules say which need an adapter
    peft_use_dora: bool = False  # DoRA: a trained magnitude per output feature beside the low-rank direction
    peft_use_rslora: bool = False  # rsLoRA: the update scaled by lora_alpha / sqrt(r) instead of lora_alpha / r
    peft_init_lora_weights: Union[bool, str] = True  # how A and B start (INIT_LORA_WEIGHTS)
    lora_fan_in_fan_out: Optional[bool] = None  # unset: as the layers store their weights (peft's choice)
    loraplus_lr_ratio: Optional[float] = None  # LoRA+: the B matrices learn at learning_rate × this (optim.py)
    loraplus_lr_embedding: Optional[float] = None  # LoRA+: an embedding's LoRA learns at this (unset: 1e-6, axolotl)
    lora_model_dir: Optional[str] = None  # an adapter folder to continue training (adapter_config.json inside)
    peft: Optional[dict[str, Any]] = None  # axolotl's block for LoftQ, which tuneloop refuses (_peft_block)
    load_in_4bit: bool = False
    load_in_8bit: bool = False
    bnb_config_kwargs: Optional[dict[str, Any]] = None
    quantize_moe_experts: bool = False  # a MoE model's 3-D expert weights in 4-bit too (quant/quantized_experts.py)
    qat: Optional[QATBlock] = None  # quantization-aware training: fake-quantized Linear layers (quant/qat.py)
    # a transformers quantization config class the checkpoint loads through, with its settings: Mxfp4Config with
    # `dequantize: true` only (gpt-oss's MXFP4 experts loaded as trainable weights: quant/mxfp4.py)
    model_quantization_config: Optional[str] = None
    model_quantization_config_kwargs: Optional[dict[str, Any]] = None
    unfrozen_parameters: Optional[list[str]] = None  # full fine-tuning of only the parameters these regexes match
    # vision-language models (data/images.py): the processor class loaded from the base model, and the vision tower
    # and projector frozen
    processor_type: Optional[str] = None
    freeze_mm_modules: Optional[bool] = None
    # axolotl's: settings given to the processor's from_pretrained (max_pixels, crop_size, ...), and each image
    # resized before the processor (an int: kept in proportion and padded black to that square; [width, height]:
    # stretched to it), with PIL's bilinear (the default), bicubic or lanczos filter
    processor_kwargs: Optional[dict[str, Any]] = None
    image_size: Optional[Union[int, tuple[int, int]]] = None
    image_resize_algorithm: Optional[str] = None
    # data
    datasets: list[DatasetConfig] = Field(default_factory=list)
    # read as a stream instead of prepared whole (axolotl's keys): raw text packed into full rows, for max_steps
    # (an entry is axolotl's pretraining form, or a dataset entry of any type, as axolotl also takes)
    pretraining_dataset: Optional[list[Annotated[
        Union[Annotated[PretrainingDataset, Tag(PRETRAINING_FORM)], Annotated[DatasetConfig, Tag(DATASET_FORM)]],
        Discriminator(pretraining_entry_form)]]] = None
    streaming: bool = False
    test_datasets: list[DatasetConfig] = Field(default_factory=list)
    val_set_size: float = 0.0
    dataset_prepared_path: Annotated[str, WATCHING] = "last_run_prepared"
    shuffle_merged_datasets: bool = True
    dataset_shard_num: Optional[int] = None
    dataset_shard_idx: int = 0
    sequence_len: int = 2048
    train_on_inputs: bool = False
    sample_packing: bool = False
    eval_sample_packing: Annotated[Optional[bool], WATCHING] = None
    pad_to_sequence_len: bool = False
    group_by_length: bool = False
    # tuneloop's own: rows by length into micro-batches of at most this many tokens as padded (rows × the longest),
    # so a micro-batch of long rows (large images) holds fewer of them: data/batching.py
    max_tokens_per_micro_batch: Optional[int] = None
    # rows as the data orders them (no shuffle), packed in that order when sample_packing_sequentially: data/batching.py
    curriculum_sampling: bool = False
    sample_packing_sequentially: bool = False
    # filters at preparation, counted by the plan (data/prepare.py)
    dataset_exact_deduplication: bool = False  # a row whose tokens and labels repeat an earlier row's is dropped
    min_sample_len: Optional[int] = None  # rows shorter than this many tokens are dropped
    # batch arithmetic
    micro_batch_size: int = 1
    eval_batch_size: Annotated[Optional[int], WATCHING] = None
    gradient_accumulation_steps: int = 1
    batch_size: Optional[int] = None
    # a fraction is a share of an epoch's steps, rounded up (as the Trainer does): data/source.py
    num_epochs: Annotated[Union[int, float], RUN_LENGTH] = 1
    max_steps: Annotated[Optional[int], RUN_LENGTH] = None
    # optimisation
    learning_rate: float = 2e-5
    lr_scheduler: str = "cosine"  # a name in optim.py's SCHEDULERS
    warmup_steps: Optional[int] = None
    warmup_ratio: Optional[float] = None
    cosine_min_lr_ratio: Optional[float] = None
    # cosine: the decay reaches its floor at this share of the run and holds it (axolotl's "warmup, decay,
    # constant" schedule); 0 or blank = off, as in axolotl
    cosine_constant_lr_ratio: Optional[float] = None
    lr_quadratic_warmup: bool = False  # the warm-up rises as the square of its progress (axolotl's, for cosine)
    lr_div_factor: Optional[float] = None  # one_cycle: it starts at learning_rate / lr_div_factor (default 6)
    optimizer: str = "adamw_torch_fused"  # a name in optim.py's OPTIMIZERS
    weight_decay: float = 0.0
    # unset: AdamW's 0.9 and 0.999 (the `adamw_betas` property); axolotl's Muon takes its own (0.95, 0.95) unless
    # both are given, so "unset" is kept as such (a recorded run_config.yml reruns with the same betas)
    adam_beta1: Optional[float] = None
    adam_beta2: Optional[float] = None
    adam_epsilon: float = 1e-8
    max_grad_norm: Optional[float] = 1.0  # 0 turns clipping off (a blank value means the default, as in axolotl)
    # precision and memory
    bf16: Union[bool, Literal["auto"]] = "auto"
    fp16: bool = False
    tf32: bool = False
    gradient_checkpointing: Union[bool, Literal["offload"]] = False  # "offload": checkpoints kept in CPU memory
    gradient_checkpointing_kwargs: Optional[dict[str, Any]] = None
    chunked_cross_entropy: Optional[bool] = None  # unset/true: the loss meets lm_head in chunks; false: whole logits
    # sharding over ranks (engines/): FSDP2 from axolotl's fsdp keys, or DeepSpeed ZeRO from a JSON file
    fsdp: Optional[Union[str, list[str]]] = None  # axolotl's list: full_shard, shard_grad_op, offload, auto_wrap
    fsdp_version: Optional[int] = None
    fsdp_config: Optional[dict[str, Any]] = None
    fsdp_final_state_dict_type: Optional[str] = None
    deepspeed: Optional[Union[str, dict[str, Any]]] = None  # a path, beside the config, or a shipped name (zero2)
    # axolotl's N-D parallel sizes (engines/mesh.py): the device mesh the engine runs on; unset or 1: not an axis
    dp_replicate_size: Optional[int] = None
    dp_shard_size: Optional[int] = None
    tensor_parallel_size: Optional[int] = None
    context_parallel_size: Optional[int] = None
    sequence_parallel_degree: Optional[int] = None  # context_parallel_size's older name
    # seconds a collective may wait for the other ranks (torch's default: 10 min on NCCL, 30 on gloo); the ranks
    # that wait while rank 0 prepares the data wait without one
    ddp_timeout: Annotated[Optional[int], SPEED] = None
    # preference training (rl_methods.py; the losses in train/preference.py)
    rl: Optional[str] = None  # a method of rl_methods.py's RL_METHODS; unset: supervised fine-tuning
    rl_beta: Optional[float] = None  # DPO/IPO's beta (default 0.1); axolotl's older `dpo_beta` too
    dpo_beta: Optional[float] = None
    # names of dpo_loss_types.py's DPO_LOSS_TYPES (default: the method's first, sigmoid); a list is a weighted sum
    dpo_loss_type: Optional[Union[str, list[str]]] = None
    dpo_loss_weights: Optional[list[float]] = None  # one per dpo_loss_type (default: 1 each)
    dpo_label_smoothing: float = 0.0  # conservative DPO: the chance a pair's label is flipped
    orpo_alpha: Optional[float] = None  # ORPO's weight of the odds-ratio term (default 0.1)
    simpo_gamma: Optional[float] = None  # SimPO's target reward margin (default 0.5, as TRL's CPO trainer)
    cpo_alpha: Optional[float] = None  # SimPO's weight of the chosen reply's NLL (default 1.0, as TRL; 0: pure SimPO)
    kto_desirable_weight: float = 1.0  # KTO's weights of desirable and undesirable rows' losses
    kto_undesirable_weight: float = 1.0
    precompute_ref_log_probs: bool = False  # reference log-probs computed once, before training, and cached
    trl: Optional[TRLBlock] = None  # online RL (rl: grpo, gdpo, ebft): generation, rewards and GRPO's loss
    vllm: Optional[VLLMBlock] = None  # the vLLM server `tuneloop vllm-serve` starts (trl.use_vllm generates on it)
    ebft: Optional[EBFTBlock] = None  # rl: ebft's feature-matching reward (online_rl/feature_matching.py)
    # a Bradley-Terry reward model (axolotl's keys): a sequence classifier's score trained to rank chosen above
    # rejected (train/reward_model.py); num_labels: its scores per sequence (1: one reward)
    reward_model: bool = False
    num_labels: Optional[int] = None
    center_rewards_coefficient: Optional[float] = None  # weight of mean((r_chosen + r_rejected)^2)
    # a process reward model (axolotl's key): a token classifier (2 labels) trained on each reasoning step's end
    # token, correct or not (type: stepwise_supervised; train/process_reward_model.py)
    process_reward_model: bool = False
    # speed: torch.compile of the model's body (train/compiling.py), and the peak MFU is measured against
    # "auto": true, as in axolotl (torch ≥ 2.5.1 here)
    # auto: where the plan predicts the run repays compiling (plan/compile_choice.py)
    torch_compile: Annotated[Union[bool, Literal["auto"]], SPEED] = "auto"
    torch_compile_mode: Annotated[Optional[Literal["default", "reduce-overhead", "max-autotune"]], SPEED] = None
    torch_compile_backend: Annotated[Optional[str], SPEED] = None  # torch.compile's backend (inductor when unset)
    torch_compile_options: Annotated[Optional[dict[str, Any]], SPEED] = None  # torch._inductor.config flags
    # tuneloop's key: this device's peak for MFU, instead of the table or the probe
    peak_tflops: Annotated[Optional[float], SPEED] = None
    bfloat16: bool = False  # load the weights in bf16 (no fp32 copy): half the memory, bf16 updates
    float16: bool = False  # the same in fp16
    float32: bool = False  # the default: fp32 weights (mixed precision computes in bf16 where asked)
    # tuneloop's key: under bf16, the model computes with bf16 weights and the optimizer steps fp32 masters of them
    # (auto: wherever the run can, resolved.master_weights says where, and beside an adapter the frozen base's
    # projections held in bf16, resolved.frozen_weights_in_bf16; false: fp32 weights cast by autocast)
    master_weights: Union[bool, Literal["auto"]] = "auto"
    # outputs, logging, eval, saves
    output_dir: Annotated[str, WATCHING] = "./model-out"
    logging_steps: Annotated[int, WATCHING] = 10
    eval_steps: Annotated[Optional[Union[int, float]], WATCHING] = None
    evals_per_epoch: Annotated[Optional[int], WATCHING] = None
    eval_strategy: Optional[Literal["steps", "epoch", "no"]] = None  # axolotl's `evaluation_strategy` too
    eval_on_start: Annotated[bool, WATCHING] = False
    save_steps: Annotated[Optional[Union[int, float]], WATCHING] = None
    saves_per_epoch: Annotated[Optional[int], WATCHING] = None
    # best: a checkpoint at each eval that improves metric_for_best_model (the Trainer's "best")
    save_strategy: Annotated[Optional[Literal["steps", "epoch", "best", "no"]], WATCHING] = None
    save_total_limit: Annotated[Optional[int], WATCHING] = None
    # pushed to the Hugging Face Hub (use/hub.py), as axolotl does: the repo (NAME or OWNER/NAME, created private if
    # new), what each save pushes (the Trainer's strategies; unset: every_save, the Trainer's default), the branch
    hub_model_id: Annotated[Optional[str], WATCHING] = None
    hub_strategy: Annotated[Optional[Literal["end", "every_save", "checkpoint", "all_checkpoints"]],
                            WATCHING] = None
    hub_revision: Annotated[Optional[str], WATCHING] = None
    seed: int = 42
    # processes that tokenize the data (default: every core available)
    dataset_processes: Annotated[Optional[int], SPEED] = None
    # trackers (trackers.py), as axolotl spells them; metrics.jsonl is always written
    use_tensorboard: Annotated[bool, TRACKING] = False  # event files in output_dir/runs/
    use_wandb: Annotated[Optional[bool], TRACKING] = None  # unset: on when wandb_project is set
    wandb_project: Annotated[Optional[str], TRACKING] = None
    wandb_entity: Annotated[Optional[str], TRACKING] = None
    wandb_name: Annotated[Optional[str], TRACKING] = None
    wandb_run_id: Annotated[Optional[str], TRACKING] = None  # continue that run (its name too, unless wandb_name)
    # unset: WANDB_MODE, or online
    wandb_mode: Annotated[Optional[Literal["online", "offline", "disabled", "shared"]], TRACKING] = None
    # unset: on when mlflow_experiment_name or mlflow_tracking_uri is set
    use_mlflow: Annotated[Optional[bool], TRACKING] = None
    mlflow_tracking_uri: Annotated[Optional[str], TRACKING] = None
    mlflow_experiment_name: Annotated[Optional[str], TRACKING] = None
    mlflow_run_name: Annotated[Optional[str], TRACKING] = None
    # resume and failure handling
    resume_from_checkpoint: Annotated[Optional[str], WATCHING] = None
    auto_resume_from_checkpoints: Annotated[bool, WATCHING] = False
    loss_watchdog_threshold: Annotated[Optional[float], WATCHING] = None
    loss_watchdog_patience: Annotated[Optional[int], WATCHING] = None
    early_stopping_patience: Annotated[Optional[int], WATCHING] = None
    # which eval is the best (for save_strategy: best, load_best_model_at_end and early stopping): an eval metric's
    # name, with or without `eval_` (default loss); greater_is_better unset: false for loss and perplexity, else true
    metric_for_best_model: Optional[str] = None
    greater_is_better: Optional[bool] = None
    load_best_model_at_end: bool = False  # the final model folder holds the best eval's weights

    @field_validator("base_model", "base_model_config", "tokenizer_config", "dataset_prepared_path", "output_dir",
                     "resume_from_checkpoint", "deepspeed", "mlflow_tracking_uri", "lora_model_dir")
    @classmethod
    def _home(cls, value):
        return home_expanded(value)

    @field_validator("processor_kwargs")
    @classmethod
    def _processor_kwargs(cls, value):
        reserved = sorted({"revision", "trust_remote_code"} & set(value or ()))
        if reserved:  # (as axolotl refuses them)
            raise ValueError(f"{', '.join(reserved)} must not be set inside processor_kwargs: use the top-level "
                             "`revision_of_model` / `trust_remote_code` keys")
        return value

    @field_validator("image_size")
    @classmethod
    def _image_size(cls, value):
        if value is not None and min((value,) if isinstance(value, int) else value) < 1:
            raise ValueError("must be a side in pixels (an int: padded to that square) or [width, height], above 0")
        return value

    @field_validator("image_resize_algorithm")
    @classmethod
    def _resize_algorithm(cls, value):
        if value is not None and value.lower() not in ("bilinear", "bicubic", "lanczos"):
            raise ValueError(f"`{value}` is not one of bilinear, bicubic, lanczos (PIL's filters, as axolotl takes)")
        return value.lower() if value is not None else None

    @field_validator("rl")
    @classmethod
    def _known_rl(cls, value):
        if value is None or value in ONLINE_METHODS:
            return value
        if value in RL_METHODS:
            return RL_METHODS.canonical(value)
        why = NOT_OFFERED.get(value, f"`rl: {value}` is not a method tuneloop trains ({RL_METHODS.choices()}, "
                                     f"{', '.join(ONLINE_METHODS)})")
        raise ValueError(f"asks for {axolotl.FEATURES['preference'][0]}, which tuneloop does not do yet: {why}")

    @field_validator("dpo_loss_type")
    @classmethod
    def _loss_types(cls, value):
        return [value] if isinstance(value, str) else value

    @field_validator("dpo_label_smoothing")
    @classmethod
    def _smoothing(cls, value):
        if not 0 <= value < 0.5:
            raise ValueError("must be at least 0 and below 0.5 (the chance that a pair's label is wrong)")
        return value

    @field_validator("rl_beta", "dpo_beta", "orpo_alpha", "kto_desirable_weight", "kto_undesirable_weight",
                     "simpo_gamma")
    @classmethod
    def _positive_weight(cls, value):
        if value is not None and value <= 0:
            raise ValueError("must be above 0")
        return value

    @field_validator("optimizer")
    @classmethod
    def _known_optimizer(cls, value):
        elsewhere = axolotl.optimizer_elsewhere(value) if value not in OPTIMIZERS else None
        if elsewhere:
            raise ValueError(f"got {value!r}: {elsewhere}; use {OPTIMIZERS.choices()}")
        return OPTIMIZERS.check(value)

    @field_validator("warmup_steps", mode="before")
    @classmethod
    def _whole_warmup_steps(cls, value):
        """axolotl types it a whole number too; a fraction is most likely meant as a share of the run."""
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"got {value:g}, and it counts whole steps; a share of the run is "
                             f"`warmup_ratio: {value:g}`")
        return value

    @field_validator("lr_scheduler")
    @classmethod
    def _known_scheduler(cls, value):
        return SCHEDULERS.check(value)

    @field_validator("num_epochs", mode="before")
    @classmethod
    def _epochs(cls, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return value  # (pydantic names the type)
        if not math.isfinite(value) or value <= 0:
            raise ValueError("must be more than 0 (a fraction such as 0.5 runs that share of an epoch's steps)")
        return value

    @field_validator("sequence_len", "micro_batch_size", "gradient_accumulation_steps", "logging_steps")
    @classmethod
    def _positive(cls, value):
        if value < 1:
            raise ValueError("must be at least 1")
        return value

    @model_validator(mode="before")
    @classmethod
    def _old_tokens_mapping(cls, data):
        """Old axolotl configs give special tokens as a `tokens:` mapping (today's `special_tokens`)."""
        if isinstance(data, dict) and isinstance(data.get("tokens"), dict):
            data = dict(data)
            data["special_tokens"] = {**data.pop("tokens"), **(data.get("special_tokens") or {})}
            warnings.warn("`tokens` given as a mapping is axolotl's old spelling of `special_tokens`; it is read as "
                          "that.", UserWarning, stacklevel=2)
        return data

    @field_validator("bf16", mode="before")
    @classmethod
    def _bf16_full(cls, value):
        """axolotl's `bf16: full` is bf16 training plus `bf16_full_eval`: the Trainer evaluates with the whole model
        cast to bf16, faster and lighter than under autocast but with metrics that can move. tuneloop trains in
        bf16 as for `true` and keeps its evaluations in the run's own mixed precision, so the rest changes only
        eval speed and memory: said, not refused."""
        if isinstance(value, str) and value.strip().lower() == "full":
            warnings.warn("`bf16: full` is read as `bf16: true`: training in bf16 as axolotl does; its other half, "
                          "evaluating with the whole model cast to bf16 (bf16_full_eval), only changes eval speed and "
                          "memory, and tuneloop evaluates in the run's mixed precision instead.", UserWarning,
                          stacklevel=2)
            return True
        return value

    @field_validator("gradient_checkpointing", mode="before")
    @classmethod
    def _checkpointing(cls, value):
        if value == "offload_disk":
            warnings.warn("`gradient_checkpointing: offload_disk`: tuneloop offloads checkpointed activations to CPU "
                          "memory, not to disk (where they live changes only memory and speed).", UserWarning,
                          stacklevel=2)
            return "offload"
        return value

    @field_validator("unfrozen_parameters")
    @classmethod
    def _unfrozen_patterns(cls, value):
        for pattern in value or []:
            if re.search(r"\[\d*(:\d*)?\]$", pattern):
                raise ValueError(f"{pattern!r}: unfreezing a row range of a parameter asks for "
                                 f"{axolotl.FEATURES['training_methods'][0]}; unfreeze whole parameters")
            _compiled(pattern, name_pattern(pattern))
        return value

    @field_validator("peft_init_lora_weights", mode="before")
    @classmethod
    def _lora_init(cls, value):
        if isinstance(value, bool) or value in INIT_LORA_WEIGHTS:
            return value
        if isinstance(value, str) and (value in BASE_REWRITING_INITS or value.startswith("pissa_niter_")):
            raise ValueError(f"{value!r} asks for {axolotl.FEATURES['peft_variants'][0]} tuneloop does not do yet: "
                             f"it rewrites the base model's weights before training (W minus the adapter's start), "
                             "and tuneloop's saved adapter, its checkpoints and `merge`/`infer` put the adapter back "
                             "on the original weights; use true, false, gaussian, orthogonal or mica")
        if value in DATA_DRIVEN_INITS:
            raise ValueError(f"{value!r} asks for {axolotl.FEATURES['peft_variants'][0]} tuneloop does not do yet: "
                             "it computes the adapter's start from a pass over the data before training; use true, "
                             "false, gaussian, orthogonal or mica")
        raise ValueError(f"got {value!r}; use true, false or one of {', '.join(sorted(INIT_LORA_WEIGHTS))}")

    @field_validator("peft")
    @classmethod
    def _peft_block(cls, value):
        """axolotl's `peft:` block holds `loftq_config` only. LoftQ quantizes the base weights and starts the adapter
        from the quantization error: peft runs it on CUDA only (bitsandbytes on a GPU), and like PiSSA it rewrites
        the base weights that tuneloop's saved adapter is put back on."""
        if not value:
            return value
        if set(value) != {"loftq_config"}:
            raise ValueError(f"knows `loftq_config` only (axolotl's `peft:` block); got {', '.join(map(str, value))}")
        raise ValueError(f"`loftq_config` (LoftQ) asks for {axolotl.FEATURES['peft_variants'][0]} tuneloop does not "
                         "do yet: it rewrites the base weights as their quantized values (peft runs it on CUDA "
                         "only), and tuneloop's saved adapter is put back on the original weights; remove it "
                         "(`adapter: qlora` trains LoRA on 4-bit weights)")

    @field_validator("model_quantization_config")
    @classmethod
    def _quantization_class(cls, value):
        """Mxfp4Config is the one class tuneloop loads through (its settings are the `mxfp4` rule's to judge)."""
        if value is None or value == MXFP4_CLASS:
            return value
        raise ValueError(f"got {value!r}: loading through {value} asks for "
                         f"{axolotl.FEATURES['quantization'][0]}, which tuneloop does not do yet; it loads through "
                         f"{MXFP4_CLASS} (with `dequantize: true`) and bitsandbytes (`load_in_4bit`/`load_in_8bit`)")

    @field_validator("loraplus_lr_ratio")
    @classmethod
    def _loraplus_ratio(cls, value):
        if value is not None and (not math.isfinite(value) or value <= 0):
            raise ValueError("must be above 0 (LoRA+'s paper uses 16: the B matrices learn 16 times faster)")
        return value

    @field_validator("loraplus_lr_embedding")
    @classmethod
    def _loraplus_embedding(cls, value):
        if value is not None and (not math.isfinite(value) or value < 0):
            raise ValueError("is a learning rate: 0 or more")
        return value

    @field_validator("lora_target_modules")
    @classmethod
    def _target_regex(cls, value):
        if isinstance(value, str):
            _compiled(value, value)
        return value

    @field_validator("chat_template")
    @classmethod
    def _template(cls, value):
        return value if value is None else check_template_name(value)

    @field_validator("attn_implementation")
    @classmethod
    def _attention(cls, value):
        if value is None or value in ATTENTION_IMPLEMENTATIONS or value.startswith("kernels-community/"):
            return value
        raise ValueError(f"got {value!r}; use one of {', '.join(sorted(ATTENTION_IMPLEMENTATIONS))} or a "
                         "kernels-community/ flash-attention kernel")

    @field_validator("model_type")
    @classmethod
    def _model_class(cls, value):
        if value is None or value in ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM") or value.endswith("ForCausalLM"):
            return value
        # a vision-language model's class (model/kinds.py's vision_language kind; its family is checked on loading)
        if value == "AutoModelForImageTextToText" or value.endswith("ForConditionalGeneration"):
            return value
        if value.endswith("ForSequenceClassification"):  # a reward model's (rules.py: reward_model)
            return value
        if value.endswith("ForTokenClassification"):  # a process reward model's (rules.py: process_reward_model)
            return value
        if is_seq2seq_class(value):
            return value
        feature = ("multimodal" if "ConditionalGeneration" in value or "ImageText" in value or "Vision" in value
                   else "preference" if "SequenceClassification" in value else "model_options")
        raise ValueError(f"got {value!r}: tuneloop trains causal language models (AutoModelForCausalLM or a "
                         f"*ForCausalLM class) and text-to-text models (AutoModelForSeq2SeqLM, "
                         f"T5ForConditionalGeneration, ...) and vision-language models (AutoModelForImageTextToText, "
                         f"a *ForConditionalGeneration class); this needs {axolotl.FEATURES[feature][0]}")

    @field_validator("hub_model_id")
    @classmethod
    def _hub_repo_id(cls, value):
        """A malformed repo id is refused here, so `check` says what `train` would stop at (axolotl's own example
        placeholder, `<your-hub-model-id>`, stops axolotl's train too, when the Trainer makes the repo)."""
        problem = repo_id_problem(value) if value else None
        if problem:
            raise ValueError(f"got {value!r}: not a Hub repo id ({problem}); write NAME or OWNER/NAME, or remove "
                             "hub_model_id to train without pushing")
        return value

    @field_validator("plugins")
    @classmethod
    def _plugins(cls, value):
        for plugin in value:
            if plugin not in axolotl.SPEED_ONLY_PLUGINS:
                raise ValueError(f"the plugin {plugin!r} is {axolotl.FEATURES['plugins'][0]} tuneloop does not "
                                 "have; remove it")
            warnings.warn(f"`plugins`: {axolotl.SPEED_ONLY_PLUGINS[plugin]} changes only speed, memory or "
                          "logging, so tuneloop trains without it.", UserWarning, stacklevel=2)
        return value

    @field_validator("max_steps", "eval_batch_size", "batch_size", "dataset_processes", "ddp_timeout",
                     "save_total_limit", "loss_watchdog_patience", "early_stopping_patience", "num_labels")
    @classmethod
    def _positive_or_none(cls, value):
        if value is not None and value < 1:
            raise ValueError("must be at least 1 (or left out)")
        return value

    @field_validator("peak_tflops")
    @classmethod
    def _peak_positive(cls, value):
        if value is not None and value <= 0:
            raise ValueError("is the device's peak in TFLOPS (e.g. 989 for an H100 in bf16): a positive number")
        return value

    @field_validator("warmup_steps", "dataset_shard_idx", "weight_decay", "evals_per_epoch", "saves_per_epoch",
                     "max_grad_norm", "min_sample_len", "center_rewards_coefficient")
    @classmethod
    def _not_negative(cls, value, info):
        if value is not None and value < 0:
            raise ValueError(f"must be 0{ZERO_MEANS.get(info.field_name, '')} or more")
        return value

    @field_validator("save_strategy", "eval_strategy", mode="before")
    @classmethod
    def _unquoted_no(cls, value):
        """`save_strategy: no` unquoted is YAML's false (as `--set save_strategy=no` is): it means "no"."""
        return "no" if value is False else value

    @field_validator("seed")
    @classmethod
    def _seed(cls, value):
        if not 0 <= value < 2 ** 32:
            raise ValueError("must be a whole number from 0 to 4294967295 (numpy's and torch's seeds)")
        return value

    @field_validator("lora_r", "lora_alpha")
    @classmethod
    def _lora_positive(cls, value):
        if value < 1:
            raise ValueError("must be at least 1")
        return value

    @field_validator("lora_dropout", "adam_beta1", "adam_beta2")
    @classmethod
    def _probability(cls, value):
        if value is not None and not 0 <= value < 1:
            raise ValueError("must be in [0, 1)")
        return value

    @field_validator("learning_rate", "lr_div_factor", "adam_epsilon", "loss_watchdog_threshold")
    @classmethod
    def _lr_positive(cls, value):
        if value is None:
            return value
        if value <= 0:
            raise ValueError("must be greater than 0")
        return value

    @field_validator("val_set_size")
    @classmethod
    def _val_set_size(cls, value):
        if value < 0 or (value >= 1 and value != int(value)):
            raise ValueError("must be a fraction in [0, 1) or a whole number of rows")
        return value

    @field_validator("eval_steps", "save_steps")
    @classmethod
    def _interval(cls, value):
        if value is None:
            return value
        if value <= 0 or (value >= 1 and value != int(value)):
            raise ValueError("must be a whole number of steps (≥ 1) or a fraction of the run in (0, 1)")
        return int(value) if value >= 1 else value

    @field_validator("shuffle_merged_datasets")
    @classmethod
    def _shuffled(cls, value):
        if not value:
            raise ValueError("false is not supported: tuneloop's sampler shuffles rows every epoch (by seed)")
        return value

    @field_validator("warmup_ratio", "cosine_min_lr_ratio", "cosine_constant_lr_ratio")
    @classmethod
    def _ratio(cls, value):
        if value is not None and not 0 <= value <= 1:
            raise ValueError("must be between 0 and 1")
        return value

    # ---- what the keys say, read where it is needed ---------------------------------------------------------
    @property
    def streams(self) -> bool:
        """The training rows are read as a stream (pretraining_dataset, or `streaming: true`): the one place the
        stored/streamed split is decided (resolved.py carries it)."""
        return self.streaming or bool(self.pretraining_dataset)

    @property
    def train_entries(self) -> list[DatasetConfig]:
        """The training data's entries: `datasets`, or pretraining_dataset's as dataset entries."""
        if not self.pretraining_dataset:
            return self.datasets
        return [entry.as_dataset() if isinstance(entry, PretrainingDataset) else entry
                for entry in self.pretraining_dataset]

    @property
    def from_scratch(self) -> bool:
        """Random weights from a config (base_model_config without base_model, or reinit_weights)."""
        return self.reinit_weights or self.base_model is None

    @property
    def beta(self) -> float:
        """DPO/IPO's beta: rl_beta (or dpo_beta), 0.1 by default as in TRL."""
        return self.rl_beta if self.rl_beta is not None else self.dpo_beta if self.dpo_beta is not None else 0.1

    @property
    def loraplus_embedding_lr(self) -> float:
        """LoRA+'s learning rate for an embedding layer's LoRA: 1e-6 unless set, as in axolotl and peft."""
        return 1e-6 if self.loraplus_lr_embedding is None else self.loraplus_lr_embedding

    @property
    def resolved_eval_batch_size(self) -> int:
        return self.eval_batch_size or self.micro_batch_size

    @property
    def adamw_betas(self) -> tuple[float, float]:
        return (0.9 if self.adam_beta1 is None else self.adam_beta1, 0.999 if self.adam_beta2 is None else self.adam_beta2)

    @property
    def best_metric(self) -> tuple[str, bool]:
        """(the eval line's name of the metric that picks the best eval, whether greater is better)."""
        name = self.metric_for_best_model or "loss"
        name = name if name.startswith("eval_") else f"eval_{name}"
        greater = self.greater_is_better
        return name, (name not in ("eval_loss", "eval_perplexity") if greater is None else greater)

    @property
    def resolved_eval_sample_packing(self) -> bool:
        return self.sample_packing if self.eval_sample_packing is None else self.eval_sample_packing

    @property
    def trl_settings(self) -> TRLBlock:
        """The `trl:` block, TRL's defaults where it is unset."""
        return self.trl if self.trl is not None else TRLBlock()

    def check_batch_size(self, world_size: int) -> None:
        """`batch_size` is axolotl's global batch; it must agree with the other three knobs."""
        if self.batch_size is None:
            return
        implied = self.micro_batch_size * self.gradient_accumulation_steps * world_size
        if self.batch_size != implied:
            raise UserError(
                f"config: `batch_size: {self.batch_size}` disagrees with micro_batch_size × "
                f"gradient_accumulation_steps × world size = {self.micro_batch_size} × "
                f"{self.gradient_accumulation_steps} × {world_size} = {implied}. "
                "Remove `batch_size` or change one of the others."
            )


def fields_marked(*marks: OnResume) -> set[str]:
    """The top-level fields that carry one of these marks."""
    return {name for name, info in TuneloopConfig.model_fields.items()
            if any(mark in marks for mark in info.metadata)}


# what a resumed run may change (when it is watched, saved, stopped; its speed; its trackers); every other key
# must agree with the checkpoint's, but for the run's length (RUN_LENGTH_KEYS), which resume.py judges
NOT_RESULT_CHANGING = fields_marked(WATCHING, SPEED, TRACKING)
RUN_LENGTH_KEYS = fields_marked(RUN_LENGTH)


def result_settings(cfg: TuneloopConfig) -> dict:
    """The settings that decide what a run trains (JSON-ready), to compare a run with a checkpoint's."""
    return {key: value for key, value in cfg.model_dump(mode="json").items() if key not in NOT_RESULT_CHANGING}


def changed_settings(before: dict, now: dict, ignore: set[str] = frozenset()) -> list[str]:
    """`key (old → new)` for each setting that differs; long values are named, not printed."""
    changed = []
    for key in sorted(set(before) | set(now)):
        # a key an older tuneloop did not have was, in effect, at its default
        old = before[key] if key in before else _default_setting(key)
        new = now.get(key)
        if key in ignore or old == new:
            continue
        if isinstance(old, (list, dict)) or isinstance(new, (list, dict)):
            changed.append(f"{key} (changed)")
        else:
            changed.append(f"{key} ({old} → {new})")
    return changed


def _default_setting(key: str):
    """A top-level key's default as result_settings writes it (JSON), or None for a key it does not know."""
    field = TuneloopConfig.model_fields.get(key)
    if field is None or field.is_required():
        return None
    value = field.get_default(call_default_factory=True)
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else value
