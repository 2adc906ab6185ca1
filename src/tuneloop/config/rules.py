"""What several keys mean together: one function per feature, each yielding the problems it finds.

Every rule runs, so a config shows all of its problems at once (`tuneloop check`). A rule that reads a key
whose own value was refused (a field error) cannot judge: it is skipped, and it speaks once that value is
fixed. A rule writes no key (but for axolotl's alias: a template's text means `chat_template: jinja`): the config
that comes out says what the user wrote, and what the run then does with it (the engine, compiling, checkpointing,
precision) is decided once, in resolved.py; a rule says what it leaves off that only changes speed.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Callable, Iterator

from tuneloop.config import axolotl
from tuneloop.config.datasets import (CHAT_ONLY_KEYS, PAIRED_ONLY_KEYS, TRAINED_TURN_KEYS, UNPAIRED_ONLY_KEYS,
                                      PreferenceFormat, given, jinja_means_jinja)
from tuneloop.config.schema import MXFP4_CLASS, MXFP4_SETTINGS
from tuneloop.data.formats import FORMATS
from tuneloop.data.mistral_chat import CHAT_TYPES as MISTRAL_CHAT_TYPES
from tuneloop.data.preference import PREFERENCE_FORMATS, REWARD_FORMATS, UNPAIRED_FORMATS
from tuneloop.data.stepwise import STEPWISE_TYPES
from tuneloop.optim import OPTIMIZERS
from tuneloop.rl_methods import PREFERENCE_KEYS, RL_METHODS, is_online, matches_features

Problems = Iterator[str]


def schedule(cfg) -> Problems:
    """Warm-up, evals, saves and the learning-rate schedule."""
    for first, second in (("warmup_steps", "warmup_ratio"), ("eval_steps", "evals_per_epoch"),
                          ("save_steps", "saves_per_epoch")):
        if getattr(cfg, first) is not None and getattr(cfg, second) is not None:
            yield f"`{first}` and `{second}` cannot both be set: keep one of them"
    if cfg.save_strategy == "no" and (cfg.save_steps is not None or cfg.saves_per_epoch):
        yield "`save_strategy: no` turns saving off, but `save_steps`/`saves_per_epoch` is set: keep one of them"
    if cfg.save_strategy == "epoch" and cfg.save_steps is not None:
        yield "`save_strategy: epoch` and `save_steps` disagree: keep one of them"
    if cfg.eval_strategy == "steps" and cfg.eval_steps is None:
        yield "`eval_strategy: steps` needs `eval_steps`"
    if cfg.eval_strategy in ("epoch", "no") and cfg.eval_steps is not None:
        yield f"`eval_strategy: {cfg.eval_strategy}` and `eval_steps` disagree: keep one of them"
    if cfg.lr_div_factor is not None and cfg.lr_scheduler != "one_cycle":
        yield (f"`lr_div_factor` only shapes `lr_scheduler: one_cycle`, and this run uses `{cfg.lr_scheduler}`: "
               "remove it or switch the scheduler")
    if cfg.cosine_constant_lr_ratio and cfg.lr_scheduler not in ("cosine", "cosine_with_min_lr"):
        yield (f"`cosine_constant_lr_ratio` ends a cosine decay early, and this run uses `lr_scheduler: "
               f"{cfg.lr_scheduler}`: remove it or set `lr_scheduler: cosine`")
    if cfg.optimizer == "muon" and cfg.lr_scheduler == "one_cycle":
        yield ("`optimizer: muon` with `lr_scheduler: one_cycle`: one_cycle would cycle the betas of Muon's AdamW part "
               "(axolotl's cycles its momentum instead); use cosine, linear or constant")
    if cfg.lr_quadratic_warmup and cfg.lr_scheduler == "one_cycle":
        yield ("`lr_quadratic_warmup` shapes a warm-up, and `lr_scheduler: one_cycle` rises by its own curve: "
               "remove one of them")
    if cfg.cosine_min_lr_ratio is not None and cfg.lr_scheduler in ("constant", "constant_with_warmup", "one_cycle"):
        yield (f"`cosine_min_lr_ratio` sets where a decay ends, and `lr_scheduler: {cfg.lr_scheduler}` has none of "
               "its own: remove it or switch the scheduler")


def muon_betas(cfg) -> Problems:
    """`optimizer: muon` takes both Adam betas for its AdamW part or its own (0.95, 0.95), as axolotl's Muon does:
    one beta alone is not used, and said so (axolotl accepts it in silence)."""
    if cfg.optimizer == "muon" and (cfg.adam_beta1 is None) != (cfg.adam_beta2 is None):
        alone = "adam_beta1" if cfg.adam_beta1 is not None else "adam_beta2"
        warnings.warn(f"`{alone}` alone with `optimizer: muon` is not used: Muon's AdamW part takes both "
                      "`adam_beta1` and `adam_beta2`, or its own (0.95, 0.95) when either is missing; set both, or "
                      f"remove `{alone}`", UserWarning, stacklevel=2)
    yield from ()  # (a warning, never a problem: axolotl runs it)


ATTENTION_FLAGS = {"flash_attention": "flash_attention_2", "sdp_attention": "sdpa", "flex_attention": "flex_attention",
                   "eager_attention": "eager"}


def best_eval(cfg) -> Problems:
    """save_strategy: best, load_best_model_at_end and the metric that picks the best eval: they need evals, and
    the metric must be one the run's evals report."""
    from tuneloop.rl_methods import eval_metric_names

    wanted = [key for key, on in (("save_strategy: best", cfg.save_strategy == "best"),
                                  ("load_best_model_at_end", cfg.load_best_model_at_end)) if on]
    if cfg.save_strategy == "best" and (cfg.save_steps is not None or cfg.saves_per_epoch):
        yield ("`save_strategy: best` saves at the evals that improve, and `save_steps`/`saves_per_epoch` is set: "
               "keep one of them")
    no_evals = (not cfg.val_set_size and not cfg.test_datasets) or cfg.eval_strategy == "no" or cfg.evals_per_epoch == 0
    if wanted and no_evals:
        yield (f"`{wanted[0]}` picks the best of the evals, and this run has none: set `val_set_size` (or "
               "`test_datasets`) and let evals run, or remove it")
    picks = wanted or (["early_stopping_patience"] if cfg.early_stopping_patience else [])
    for key in ("metric_for_best_model", "greater_is_better"):
        if getattr(cfg, key) is not None and not picks:
            yield (f"`{key}` says which eval is the best, and nothing in this run uses the best eval: set "
                   "`save_strategy: best`, `load_best_model_at_end: true` or `early_stopping_patience`, or remove it")
    names = eval_metric_names(cfg)
    name, _ = cfg.best_metric
    if picks and name not in names:
        known = ", ".join(n.removeprefix("eval_") for n in names) or "none: online RL has no eval set"
        yield f"`metric_for_best_model: {cfg.metric_for_best_model}` is not a metric this run's evals report ({known})"


def precision_and_attention(cfg) -> Problems:
    """One precision, one weights dtype, one attention kernel."""
    if cfg.bf16 is True and cfg.fp16:
        yield "`bf16` and `fp16` cannot both be true: choose one precision"
    if sum((cfg.bfloat16, cfg.float16, cfg.float32)) > 1:
        yield "`bfloat16`, `float16` and `float32` choose one dtype for the weights: keep one"
    flags = [name for name in ATTENTION_FLAGS if getattr(cfg, name)]
    if len(flags) > 1 or (flags and cfg.attn_implementation and ATTENTION_FLAGS[flags[0]] != cfg.attn_implementation):
        named = flags + ([f"attn_implementation: {cfg.attn_implementation}"] if cfg.attn_implementation else [])
        yield f"the attention settings disagree ({', '.join(named)}): keep one of them"


def chat_template(cfg) -> Problems:
    """The run's template: a template's text without `chat_template: jinja` means that template, as in axolotl."""
    try:
        jinja_means_jinja(cfg)
    except ValueError as error:
        yield str(error)
        return
    if cfg.chat_template == "jinja" and not cfg.chat_template_jinja:
        yield "`chat_template: jinja` needs the template text in `chat_template_jinja`"


# BitsAndBytesConfig's keys, by the kind of value each takes (a key not here would be ignored by transformers)
BNB_KEYS = {
    "bnb_4bit_compute_dtype": "dtype", "bnb_4bit_quant_storage": "dtype",
    "bnb_4bit_quant_type": ("nf4", "fp4"), "bnb_4bit_use_double_quant": bool, "llm_int8_threshold": float,
    "llm_int8_skip_modules": list, "llm_int8_enable_fp32_cpu_offload": bool, "llm_int8_has_fp16_weight": bool,
}
TORCH_DTYPES = ("float32", "float16", "bfloat16", "uint8", "int8", "float64")


def bitsandbytes_settings(cfg) -> Problems:
    """`bnb_config_kwargs`, checked before anything loads: a key BitsAndBytesConfig does not take would be ignored
    silently, a bad value would crash the load."""
    for key, value in (cfg.bnb_config_kwargs or {}).items():
        kind = BNB_KEYS.get(key)
        if key in ("load_in_4bit", "load_in_8bit"):
            yield f"`bnb_config_kwargs.{key}`: say it as the top-level `{key}` key (or `adapter: qlora`)"
        elif kind is None:
            yield (f"`bnb_config_kwargs.{key}` is not a bitsandbytes setting; the settings are "
                   f"{', '.join(sorted(BNB_KEYS))}")
        elif kind == "dtype" and str(value).removeprefix("torch.") not in TORCH_DTYPES:
            yield f"`bnb_config_kwargs.{key}: {value}` is not a dtype; use one of {', '.join(TORCH_DTYPES)}"
        elif isinstance(kind, tuple) and value not in kind:
            yield f"`bnb_config_kwargs.{key}: {value}`: use {' or '.join(kind)}"
        elif kind is bool and not isinstance(value, bool):
            yield f"`bnb_config_kwargs.{key}: {value!r}` must be true or false"
        elif kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
            yield f"`bnb_config_kwargs.{key}: {value!r}` must be a number"
        elif kind is list and not (isinstance(value, list) and all(isinstance(item, str) for item in value)):
            yield f"`bnb_config_kwargs.{key}` must be a list of module names"


def adapters(cfg) -> Problems:
    """What is trained: an adapter (on quantized weights or not), or some of the model's own weights."""
    if cfg.load_in_4bit and cfg.load_in_8bit:
        yield "`load_in_4bit` and `load_in_8bit` cannot both be true: choose one"
    if cfg.adapter == "qlora" and cfg.load_in_8bit:
        yield ("`adapter: qlora` loads the weights in 4-bit, and `load_in_8bit` asks for 8-bit: use `adapter: lora` "
               "with load_in_8bit, or qlora without it")
    if (cfg.load_in_4bit or cfg.load_in_8bit) and not cfg.adapter:
        yield ("quantized weights (`load_in_4bit`/`load_in_8bit`) are not trained directly: set `adapter: qlora` "
               "(4-bit) or `adapter: lora`")
    if cfg.adapter and not (cfg.lora_target_linear or cfg.lora_target_modules or cfg.lora_target_parameters):
        yield (f"`adapter: {cfg.adapter}` needs `lora_target_modules`, `lora_target_parameters` or "
               "`lora_target_linear: true`")
    if cfg.quantize_moe_experts and cfg.load_in_8bit:
        yield (f"`quantize_moe_experts` with `load_in_8bit` asks for {axolotl.FEATURES['moe'][0]} (8-bit experts), "
               "which tuneloop does not do yet: its experts quantize to 4-bit, with `adapter: qlora`")
    elif cfg.quantize_moe_experts and not (cfg.load_in_4bit or cfg.adapter == "qlora"):
        yield ("`quantize_moe_experts` quantizes a MoE model's expert weights to 4-bit beside the rest of a QLoRA "
               "base: set `adapter: qlora` (or `load_in_4bit: true` with `adapter: lora`), or remove it")
    if cfg.unfrozen_parameters and cfg.adapter:
        yield (f"`unfrozen_parameters` with `adapter: {cfg.adapter}` (base-model weights trained next to the adapter) "
               f"asks for {axolotl.FEATURES['peft_variants'][0]}; keep one of them")


# the LoRA variants' keys, with the values that ask for nothing (axolotl's full fine-tunes carry
# `lora_fan_in_fan_out: false`); any other value shapes an adapter, so it needs `adapter:`
LORA_VARIANT_KEYS = {"peft_use_dora": (False,), "peft_use_rslora": (False,), "peft_init_lora_weights": (True,),
                     "lora_fan_in_fan_out": (None, False), "loraplus_lr_ratio": (None,),
                     "loraplus_lr_embedding": (None,), "lora_model_dir": (None,)}


def lora_variants(cfg) -> Problems:
    """DoRA, rsLoRA, LoRA+, the adapter's start (adapters.py, optim.py): settings of an adapter, which agree with
    each other and with the schedule."""
    given = [key for key, nothing in LORA_VARIANT_KEYS.items() if getattr(cfg, key) not in nothing]
    if given and not cfg.adapter:
        yield f"`{given[0]}` shapes a LoRA adapter, and this run trains none: set `adapter: lora`, or remove it"
    if cfg.loraplus_lr_ratio is not None and cfg.optimizer == "muon":
        yield ("`loraplus_lr_ratio` sets the learning rates of AdamW's groups, and `optimizer: muon` groups the weights "
               "its own way: keep one of them")
    if cfg.loraplus_lr_embedding is not None and cfg.loraplus_lr_ratio is None:
        yield "`loraplus_lr_embedding` is a LoRA+ setting: set `loraplus_lr_ratio` too, or remove it"
    if cfg.loraplus_lr_ratio is not None and cfg.lr_scheduler == "one_cycle":
        yield ("`loraplus_lr_ratio` with `lr_scheduler: one_cycle`: one_cycle drives every parameter group to the one "
               "peak `learning_rate`, which would undo LoRA+'s faster B matrices; use cosine, linear or constant")
    if cfg.lora_fan_in_fan_out and cfg.lora_target_parameters:
        yield ("`lora_fan_in_fan_out: true` with `lora_target_parameters`: peft's LoRA on parameters takes them as "
               "stored and refuses fan_in_fan_out; remove it (on layers, peft reads each one's layout itself)")
    init = cfg.peft_init_lora_weights
    if init == "orthogonal" and cfg.lora_r % 2:
        yield f"`peft_init_lora_weights: orthogonal` needs an even `lora_r` (it pairs rows of A and B): {cfg.lora_r}"
    if init == "mica" and cfg.peft_use_dora:
        yield "`peft_init_lora_weights: mica` with `peft_use_dora: true`: peft has no DoRA for MiCA; keep one of them"
    if init is not True and cfg.lora_model_dir:
        yield (f"`peft_init_lora_weights: {init}` says how a new adapter starts, and `lora_model_dir` starts from that "
               "folder's trained adapter: remove one of them")


def model_quantization(cfg) -> Problems:
    """`model_quantization_config` (Mxfp4Config, the one class the schema takes: quant/mxfp4.py) and its settings: the
    experts dequantized (packed MXFP4 does not train), loaded from a checkpoint, and through no other quantization
    config (transformers loads through one)."""
    settings = cfg.model_quantization_config_kwargs or {}
    if cfg.model_quantization_config is None:
        if settings:
            yield ("`model_quantization_config_kwargs` are the settings of `model_quantization_config`, which is not "
                   f"set: set `model_quantization_config: {MXFP4_CLASS}`, or remove them")
        return
    unknown = [key for key in settings if key not in MXFP4_SETTINGS]
    if unknown:
        # (with dequantize every expert is unpacked: transformers reads modules_to_not_convert only to keep some packed)
        yield (f"`model_quantization_config_kwargs.{unknown[0]}` is not a setting tuneloop passes to {MXFP4_CLASS}: it "
               "takes `dequantize: true` only")
    elif settings.get("dequantize") is not True:
        yield (f"`model_quantization_config: {MXFP4_CLASS}` without `model_quantization_config_kwargs: {{dequantize: "
               "true}` keeps the experts packed in MXFP4, which cannot be trained: transformers runs packed MXFP4 "
               "only through its GPU Triton kernels, forward only (its quantizer is not trainable); set "
               "`model_quantization_config_kwargs: {dequantize: true}` to load them as trainable weights")
    bitsandbytes = [key for key, on in (("adapter: qlora", cfg.adapter == "qlora"), ("load_in_4bit", cfg.load_in_4bit),
                                        ("load_in_8bit", cfg.load_in_8bit)) if on]
    if bitsandbytes:
        yield (f"`model_quantization_config: {MXFP4_CLASS}` with `{bitsandbytes[0]}`: transformers loads a checkpoint "
               "through one quantization config, MXFP4's dequantization or bitsandbytes' 4/8-bit, not both: use "
               "`adapter: lora` (without load_in_4bit/load_in_8bit) on the dequantized weights")
    if cfg.from_scratch:
        yield (f"`model_quantization_config: {MXFP4_CLASS}` dequantizes a checkpoint's MXFP4 weights as they load, "
               "and this run starts from random weights (from scratch): remove it and its kwargs")


def eval_set_and_shards(cfg) -> Problems:
    if cfg.test_datasets and cfg.val_set_size:
        yield "`test_datasets` and `val_set_size` cannot both be set: keep one way to get an eval set"
    if cfg.dataset_shard_num is not None and not 0 <= cfg.dataset_shard_idx < cfg.dataset_shard_num:
        yield f"`dataset_shard_idx` must be in [0, dataset_shard_num={cfg.dataset_shard_num})"


def vision_family(cfg) -> Problems:
    """A vision-language config whose family tuneloop cannot train yet is refused by `check` already, naming the
    family (config/vision_names.py reads it from the local config.json or the hub id)."""
    from tuneloop.config.vision_names import (TRAINED_VISION_TYPES, TRAINED_VISION_WORDS, VISION_FAMILY_WHY_NOT,
                                              local_text_model, named_vision_family, vision_keys)

    asking = vision_keys(cfg)
    if not asking:
        return
    text = local_text_model(cfg)
    if text is not None:  # (a text model is no vision-language family at all: the key that asks for images is wrong)
        model_type, found = text
        fix = ("remove model_type, or set `model_type: AutoModelForCausalLM`" if asking[0].startswith("model_type")
               else "remove it")
        yield (f"`{asking[0]}` asks for a vision-language model (images and text), and `base_model: "
               f"{cfg.base_model or cfg.base_model_config}` is a text model ({model_type}, by {found}: no "
               f"vision_config): {fix}")
        return
    named = named_vision_family(cfg)
    if named is not None and named[0] not in TRAINED_VISION_TYPES:
        model_type, words, found = named
        why = VISION_FAMILY_WHY_NOT.get(model_type)
        yield (f"`base_model: {cfg.base_model or cfg.base_model_config}` is a {words} vision-language model (by "
               f"{found}); tuneloop trains {TRAINED_VISION_WORDS} so far, and this family asks for "
               "multimodal models, which tuneloop does not do yet" + (f": {why}" if why else ""))


def model_source(cfg) -> Problems:
    """Pretrained weights, or a model built from a config (from scratch) with a tokenizer to go with it."""
    if cfg.base_model is None and cfg.base_model_config is None:
        yield ("`base_model` is required (the model to fine-tune); to train from scratch give `base_model_config` "
               "(a folder with a config.json, or a model type such as t5)")
        return
    for key in ("base_model", "base_model_config"):
        adapter = adapter_folder(getattr(cfg, key))
        if adapter is not None:
            base, folder = adapter
            yield (f"`{key}: {getattr(cfg, key)}` is a LoRA adapter ({folder / 'adapter_config.json'}), not a model: "
                   f"set `base_model: {base or 'its base model'}` (the model it was trained on"
                   + (", as its base_model_name_or_path says" if base else "") + f") and `lora_model_dir: "
                   f"{getattr(cfg, key)}` with `adapter: lora` to train on from the adapter, or merge it first "
                   f"(`tuneloop merge-lora --adapter {getattr(cfg, key)}`)")
            return
    named = [key for key in ("pad_token", "eos_token", "unk_token") if key in cfg.special_tokens]
    if cfg.train_tokenizer and named:
        yield (f"`special_tokens.{named[0]}` and `train_tokenizer` both name it: a trained tokenizer's special tokens "
               "are `train_tokenizer.special_tokens`; move it there")
    if not cfg.from_scratch:
        if cfg.train_tokenizer:
            yield ("`train_tokenizer` makes new token ids, which mean nothing to the pretrained weights of "
                   f"{cfg.base_model}: use it to train from scratch (`reinit_weights: true`, or `base_model_config` "
                   "without base_model), or remove it")
        return
    if cfg.adapter:
        yield (f"`adapter: {cfg.adapter}` trains a small adapter on frozen weights, and this run starts from random "
               "weights (training from scratch): remove the adapter")
    if cfg.rl:
        yield (f"`rl: {cfg.rl}` tunes a trained model's preferences, and this run starts from random weights: train "
               "it first, then give it as base_model")
    if cfg.base_model is None and not (cfg.train_tokenizer or cfg.tokenizer_config):
        source = cfg.base_model_config
        if source is None or not Path(source).expanduser().is_dir():
            yield (f"training from scratch with `base_model_config: {source}` needs a tokenizer: `train_tokenizer: "
                   "{type: bpe, vocab_size: 8000}` trains one on the data, or `tokenizer_config` names one")


def adapter_folder(source: str | None) -> tuple[str | None, Path] | None:
    """(the base model its adapter_config.json names, the folder) where `source` is a local folder holding a LoRA
    adapter and no model (config.json); None otherwise."""
    import json

    folder = Path(source or "").expanduser()
    if not source or not (folder / "adapter_config.json").is_file() or (folder / "config.json").is_file():
        return None
    try:
        base = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8-sig")).get(
            "base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    return (base if isinstance(base, str) and base else None), folder


STREAM_CONFLICTS = {"val_set_size": "hold eval rows out of a stream; use `test_datasets`",
                    "group_by_length": "sort a stream by length",
                    "dataset_shard_num": "shard a stream (each rank already reads its own share)",
                    "dataset_exact_deduplication": "remember every row of a stream to drop repeats",
                    "curriculum_sampling": "reorder a stream (it is read in its own order already)",
                    "sample_packing_sequentially": "choose how a stream packs (it packs rows as they come)",
                    "min_sample_len": "filter a stream's rows by length"}


def streaming(cfg) -> Problems:
    """Training data prepared whole (`datasets`), or read as a stream (pretraining_dataset, streaming: true)."""
    if not cfg.datasets and not cfg.pretraining_dataset:
        yield "`datasets` is required (or `pretraining_dataset`, text read as a stream)"
        return
    if not cfg.streams:
        return
    if cfg.datasets and cfg.pretraining_dataset:
        yield "`pretraining_dataset` replaces `datasets` (its text is read as a stream): keep one"
        return
    cfg.train_entries  # (a text_column that would be ignored is refused here, as a ValueError)
    if not cfg.max_steps:
        yield ("a streamed dataset (`pretraining_dataset` or `streaming: true`) is read as the run goes, so its "
               "length is unknown: set `max_steps`")
    for key, why in STREAM_CONFLICTS.items():
        if getattr(cfg, key):
            yield f"`{key}` cannot be used with a streamed dataset: tuneloop does not {why}"
    why_whole = _prepared_whole(cfg)
    if why_whole:
        key = "pretraining_dataset" if cfg.pretraining_dataset else "streaming"
        yield f"`{key}` reads the training rows as a stream, and {why_whole}: remove `{key}`"


def _prepared_whole(cfg) -> str | None:
    """Why this run's training rows cannot be streamed, in words (None: they can): a vision-language model's, a
    preference or reward model's. (A type both trainings read, `chat_template`, is supervised data without `rl:`.)"""
    from tuneloop.config.vision_names import vision_keys

    asking = vision_keys(cfg)
    if asking:
        return (f"`{asking[0]}` trains a vision-language model, whose rows are prepared whole (their images are "
                "read per micro-batch from the prepared rows)")
    for key, what in (("rl", f"`rl: {cfg.rl}` trains on preference data"),
                      ("reward_model", "`reward_model: true` trains on chosen/rejected pairs"),
                      ("process_reward_model", "`process_reward_model: true` trains on labelled reasoning steps")):
        if getattr(cfg, key):
            return f"{what}, which is prepared whole"
    for index, entry in enumerate(cfg.train_entries):
        if isinstance(entry.type, PreferenceFormat):
            return f"dataset {index}'s `type:` mapping is preference data, which is prepared whole"
        if not isinstance(entry.type, str) or entry.type in FORMATS:
            continue  # (supervised rows stream: a custom format's, chat_template's)
        for formats, what in ((PREFERENCE_FORMATS, "preference pairs"), (UNPAIRED_FORMATS, "labelled preference rows"),
                              (REWARD_FORMATS, "a reward model's pairs"),
                              (STEPWISE_TYPES, "a process reward model's steps")):
            if entry.type in formats:
                return f"dataset {index} is `type: {entry.type}`, {what}, which are prepared whole"
    return None


def preference(cfg) -> Problems:
    """`rl:` and its keys agree (each key is read by the run's method: rl_methods.py), and every dataset is
    preference data of the method's kind (pairs, or KTO's labelled rows) exactly when `rl` is set."""
    if cfg.ebft is not None and not matches_features(cfg):
        yield (f"`ebft:` configures `rl: ebft`'s feature-matching reward, and this run is "
               f"{f'`rl: {cfg.rl}`' if cfg.rl else 'supervised'}: set `rl: ebft`, or remove it")
    if is_online(cfg):
        yield from online_rl(cfg)
        return
    if cfg.trl is not None:
        yield (f"`trl:` configures online RL, and this run is {f'`rl: {cfg.rl}`' if cfg.rl else 'supervised'}: set "
               f"`rl: grpo` (or gdpo) to train by rewards, or remove it")
    yield from _preference_data(cfg)
    set_keys = [key for key in PREFERENCE_KEYS if given(cfg, key)]
    if not cfg.rl:
        if set_keys:
            yield (f"`{set_keys[0]}` sets preference training, which `rl:` turns on: set `rl:` to one of "
                   f"{RL_METHODS.choices()}, or remove it")
        return
    method = RL_METHODS[cfg.rl]
    for key in set_keys:
        if key not in method.keys:
            yield f"`{key}` {PREFERENCE_KEYS[key]}, and this run is `rl: {cfg.rl}`, which does not read it: remove it"
    if cfg.rl_beta is not None and cfg.dpo_beta is not None and cfg.rl_beta != cfg.dpo_beta:
        yield f"`rl_beta: {cfg.rl_beta}` and `dpo_beta: {cfg.dpo_beta}` are the same setting: keep one"
    if cfg.dpo_loss_type and "dpo_loss_type" in method.keys:
        for name in cfg.dpo_loss_type:
            if name not in method.loss_types:
                yield f"`dpo_loss_type: {name}` is not a loss of `rl: {cfg.rl}` ({', '.join(method.loss_types)})"
    losses = cfg.dpo_loss_type or list(method.loss_types[:1])  # (the method's default)
    if cfg.dpo_loss_weights is not None and "dpo_loss_weights" in method.keys:
        if any(weight < 0 for weight in cfg.dpo_loss_weights):
            yield "`dpo_loss_weights` must not be negative (a negative weight would maximise that loss)"
        if len(cfg.dpo_loss_weights) != len(losses):
            yield (f"`dpo_loss_weights` has {len(cfg.dpo_loss_weights)} weights for {len(losses)} losses in "
                   "`dpo_loss_type`: give one each")
    if cfg.dpo_label_smoothing and "dpo_label_smoothing" in method.keys and "sigmoid" not in losses:
        yield "`dpo_label_smoothing` smooths the sigmoid loss, and `dpo_loss_type` has none: remove it or add `sigmoid`"
    if cfg.cpo_alpha is not None and cfg.cpo_alpha < 0:
        yield "`cpo_alpha` must not be negative (it weighs the chosen reply's NLL)"
    ignored = sorted({key for entry in cfg.datasets + cfg.test_datasets for key in CHAT_ONLY_KEYS
                      if key in TRAINED_TURN_KEYS and given(entry, key)})
    if ignored:
        yield (f"`{ignored[0]}` picks the trained turns of a conversation, and under `rl:` the trained part is the "
               "reply (with its end-of-turn marker): remove it")
    if cfg.train_on_inputs:
        yield (f"`train_on_inputs: true` with `rl: {cfg.rl}`: a preference loss compares the replies, and the prompt "
               "is never part of it; remove it")


def online_rl(cfg) -> Problems:
    """`rl: grpo`/`gdpo` and its `trl:` block (online_rl/settings.py): reward functions named, prompts with room
    for their completions, no key of offline preference training, and what online RL cannot run with yet."""
    from tuneloop.online_rl.prompts import is_transform_type
    from tuneloop.online_rl.settings import NOT_OFFERED_KEYS

    from tuneloop.online_rl.rewards import online_reward_names

    settings = cfg.trl_settings
    if not settings.reward_funcs and not matches_features(cfg):
        yield (f"`rl: {cfg.rl}` scores its completions with `trl.reward_funcs`, and none is given: list your reward "
               "functions (e.g. `rewards.correct` for correct() in rewards.py beside the config)")
    rewards = online_reward_names(cfg)
    if settings.reward_weights is not None and len(settings.reward_weights) != len(rewards):
        first = ", EBFT's own first" if matches_features(cfg) else ""
        yield (f"`trl.reward_weights` has {len(settings.reward_weights)} weights for {len(rewards)} rewards "
               f"({', '.join(rewards)}{first}): give one weight each")
    for key in settings.refused_keys:
        if key == "steps_per_generation" and settings.model_extra[key] == cfg.gradient_accumulation_steps:
            continue  # TRL's default: one generation per optimizer step, which is what runs here
        yield (f"`trl.{key}` asks for {NOT_OFFERED_KEYS[key][0]}, which tuneloop does not do yet "
               f"({axolotl.FEATURES['preference'][0]}): remove it")
    if settings.max_completion_length >= cfg.sequence_len:
        yield (f"`trl.max_completion_length: {settings.max_completion_length}` leaves no room for a prompt in "
               f"`sequence_len: {cfg.sequence_len}` (prompt + completion must fit): raise sequence_len or lower it")
    for key in PREFERENCE_KEYS:
        if given(cfg, key):
            yield (f"`{key}` {PREFERENCE_KEYS[key]}; `rl: {cfg.rl}` reads its settings from the `trl:` block "
                   "(its KL coefficient is `trl.beta`): remove it")
    if cfg.val_set_size or cfg.test_datasets:
        yield (f"`rl: {cfg.rl}` has no eval set (its train lines report the rewards of every step's completions): "
               "remove `val_set_size`/`test_datasets`")
    if cfg.train_on_inputs:
        yield f"`train_on_inputs: true` with `rl: {cfg.rl}`: only the generated completions are trained; remove it"
    if cfg.fsdp or cfg.deepspeed:
        yield (f"`rl: {cfg.rl}` under {'FSDP' if cfg.fsdp else 'DeepSpeed'}: generation from sharded weights is "
               "not built yet (online RL runs on one process or DDP ranks); remove the sharding keys")
    for index, entry in enumerate(cfg.datasets):
        if entry.type is not None and not is_transform_type(entry.type):
            name = entry.type if isinstance(entry.type, str) else "a mapping"
            yield (f"dataset {index} is `type: {name}`, and `rl: {cfg.rl}` reads prompts: rows with a `prompt` "
                   "column (leave `type` unset) or a `type: module.function` transform that makes one")
    if settings.use_vllm and (cfg.load_in_4bit or cfg.load_in_8bit):
        yield (f"`trl.use_vllm: true` with a {'4' if cfg.load_in_4bit else '8'}-bit base (QLoRA): the server would "
               "generate from its own unquantized copy of the base, not the quantized weights the adapter trains "
               "against; remove load_in_4bit/load_in_8bit or use_vllm")
    if settings.use_vllm and settings.loss_type == "vespo" and settings.vllm_importance_sampling_correction:
        yield ("`trl.loss_type: vespo` with vLLM's importance-sampling correction: TRL folds the correction into "
               "VESPO's gamma weights, which tuneloop does not yet; set trl.vllm_importance_sampling_correction: "
               "false or another loss_type")
    if settings.asynchronous and settings.num_iterations > 1:
        yield ("`trl.async_prefetch` with `trl.num_iterations` > 1: a generation trained several steps is stale by "
               "more than the one step async mode corrects; use one or the other")
    if settings.use_data_producer and not settings.async_prefetch:
        warnings.warn("`trl.use_data_producer` alone changes nothing here (axolotl's protocol for its async mode): "
                      "completions are generated as each step needs them; `trl.async_prefetch: true` overlaps them",
                      UserWarning, stacklevel=2)
    if cfg.sample_packing:
        warnings.warn(f"`sample_packing` with `rl: {cfg.rl}`: each completion is trained in a padded row of its own "
                      "(the same loss; speed only)", UserWarning, stacklevel=2)


def _preference_data(cfg) -> Problems:
    method = RL_METHODS[cfg.rl] if cfg.rl else None
    formats = (PREFERENCE_FORMATS if method.paired else UNPAIRED_FORMATS) if method else None
    from tuneloop.online_rl.prompts import is_transform_type

    for index, entry in enumerate(cfg.datasets + cfg.test_datasets):
        mapping = isinstance(entry.type, PreferenceFormat)
        if cfg.reward_model or (isinstance(entry.type, str) and entry.type in REWARD_FORMATS):
            yield from _reward_model_data(cfg, index, entry)
            continue
        if cfg.process_reward_model or entry.type in STEPWISE_TYPES:
            continue  # (process_reward_model below)
        if is_transform_type(entry.type):
            yield (f"dataset {index} is `type: {entry.type}`: a dataset type tuneloop does not have, or a "
                   "module.function transform, which tuneloop runs for online RL's prompts (`rl: grpo`) only so far "
                   f"({axolotl.FEATURES['data_options'][0]} tuneloop does not have yet for this run)")
            continue
        if method is None:
            if mapping or (isinstance(entry.type, str) and entry.type not in FORMATS):
                yield (f"dataset {index} is preference data (chosen/rejected pairs, or labelled rows): set `rl:` to "
                       f"one of {RL_METHODS.choices()} to train on it")
            continue
        fits = (entry.type in formats) if isinstance(entry.type, str) else mapping
        if not fits:
            name = entry.type if isinstance(entry.type, str) else "a mapping of instruction fields"
            data = "preference pairs" if method.paired else "rows with a desirable/undesirable label"
            fields = "field_chosen/field_rejected" if method.paired else "field_completion/field_label"
            yield (f"`rl: {cfg.rl}` trains on {data}, and dataset {index} is `type: {name}`: use one of "
                   f"{formats.choices()}, or a mapping with field_prompt and {fields}")
            continue
        wrong = [key for key in (UNPAIRED_ONLY_KEYS if method.paired else PAIRED_ONLY_KEYS)
                 if mapping and given(entry.type, key)]
        if wrong:
            yield f"dataset {index}: `type.{wrong[0]}` is not read by `rl: {cfg.rl}`; remove it"


def _reward_model_data(cfg, index: int, entry) -> Problems:
    """A reward model trains on its own pair types (data/preference.py's REWARD_FORMATS), and they on it alone."""
    name = entry.type if isinstance(entry.type, str) else "a mapping of fields"
    if not cfg.reward_model:
        yield (f"dataset {index} is `type: {name}`, pairs for a reward model: set `reward_model: true` (and "
               "`model_type: AutoModelForSequenceClassification`) to train one on it")
    elif entry.type not in REWARD_FORMATS:
        yield (f"`reward_model: true` trains on chosen/rejected pairs, and dataset {index} is `type: {name}`: use "
               f"{REWARD_FORMATS.choices()}")


STEPWISE_KEYS = ("step_separator", "max_completion_length", "train_on_last_step_only")


def process_reward_model(cfg) -> Problems:
    """`process_reward_model: true` (model/kinds.py's token_classification kind, train/process_reward_model.py's loss)
    trains on `type: stepwise_supervised` rows (data/stepwise.py), and they on it alone."""
    for index, entry in enumerate(cfg.datasets + cfg.test_datasets):
        stepwise = isinstance(entry.type, str) and entry.type in STEPWISE_TYPES
        if stepwise and not cfg.process_reward_model:
            yield (f"dataset {index} is `type: {entry.type}`, steps for a process reward model: set "
                   "`process_reward_model: true` to train one on it")
        elif cfg.process_reward_model and not stepwise:
            name = entry.type if isinstance(entry.type, str) else "a mapping of fields"
            yield (f"`process_reward_model: true` trains on labelled reasoning steps, and dataset {index} is "
                   f"`type: {name}`: use {', '.join(STEPWISE_TYPES)}")
        for key in STEPWISE_KEYS if not stepwise else ():
            if getattr(entry, key) is not None:
                yield f"dataset {index}: `{key}` is read by `type: stepwise_supervised` only; remove it"
        if stepwise and entry.max_completion_length is not None and entry.max_completion_length < 1:
            yield f"dataset {index}: `max_completion_length` must be at least 1"
    if not cfg.process_reward_model:
        if (cfg.model_type or "").endswith("ForTokenClassification"):
            yield (f"`model_type: {cfg.model_type}` trains a token classifier, which tuneloop trains as a process "
                   "reward model only: set `process_reward_model: true` (with rows of type stepwise_supervised)")
        return
    for key in ("rl", "reward_model"):
        if getattr(cfg, key):
            yield (f"`process_reward_model: true` and `{key}: {getattr(cfg, key)}` are two trainings: keep one")
    if cfg.model_type and not cfg.model_type.endswith("ForTokenClassification"):
        yield (f"`model_type: {cfg.model_type}` with `process_reward_model: true`: a process reward model is a token "
               "classifier; set `model_type: AutoModelForTokenClassification` or remove it")
    if cfg.num_labels not in (None, 2):
        yield (f"`num_labels: {cfg.num_labels}` with `process_reward_model: true`: a step is correct or not (2 "
               "labels); remove it")
    for key in ("sample_packing", "eval_sample_packing"):
        if getattr(cfg, key):
            yield (f"`{key}: true` with `process_reward_model: true`: a process reward model's rows are not packed "
                   "yet; set it to false (`group_by_length: true` reclaims most of the padding)")
    if cfg.train_on_inputs:
        yield ("`train_on_inputs: true` with `process_reward_model: true`: only the steps' end tokens carry labels; "
               "remove it")
    if cfg.pretraining_dataset:
        yield "`process_reward_model: true` trains on stepwise_supervised rows, not a pretraining stream"


def reward_model(cfg) -> Problems:
    """`reward_model: true` (a Bradley-Terry reward model: model/kinds.py's sequence_classification kind,
    train/reward_model.py's loss) and the keys that go with it, or against it."""
    if not cfg.reward_model:
        for key in ("num_labels", "center_rewards_coefficient"):
            if getattr(cfg, key) is not None and not (key == "num_labels" and cfg.process_reward_model):
                yield (f"`{key}` shapes a reward model's training, which `reward_model: true` turns on: set it, "
                       f"or remove {key}")
        if (cfg.model_type or "").endswith("ForSequenceClassification"):
            yield (f"`model_type: {cfg.model_type}` trains a sequence classifier, which tuneloop trains as a reward "
                   "model only: set `reward_model: true` (with pairs of type bradley_terry.chat_template), or remove "
                   "it")
        return
    if cfg.rl:
        yield (f"`reward_model: true` and `rl: {cfg.rl}` are two trainings (a reward model's score, a policy's "
               "preferences): keep one")
    if cfg.num_labels not in (None, 1):
        yield (f"`num_labels: {cfg.num_labels}` with `reward_model: true`: a reward model gives one score per "
               "sequence; set `num_labels: 1` or remove it")
    if cfg.model_type and not cfg.model_type.endswith("ForSequenceClassification"):
        yield (f"`model_type: {cfg.model_type}` with `reward_model: true`: a reward model is a sequence classifier; "
               "set `model_type: AutoModelForSequenceClassification` or remove it")
    for key in ("sample_packing", "eval_sample_packing"):
        if getattr(cfg, key):
            yield (f"`{key}: true` with `reward_model: true`: the score is read at each row's last real token, so a "
                   "row holds one sequence; set it to false (`group_by_length: true` reclaims most of the padding)")
    if cfg.train_on_inputs:
        yield ("`train_on_inputs: true` with `reward_model: true`: a reward model scores the whole conversation, "
               "and has no prompt to mask or train; remove it")
    if cfg.from_scratch:
        yield ("`reward_model: true` scores with a trained model's understanding, and this run starts from random "
               "weights: give a trained model as base_model")


def sharding(cfg) -> Problems:
    """How the ranks share the model (engines/keys.py reads axolotl's fsdp and deepspeed keys), and what a
    sharding engine cannot run with. What it leaves off that only changes speed or host memory (torch.compile,
    rank 0's loading) is said here and decided by resolved.py, with the same functions of engines/keys.py."""
    from tuneloop.engines.keys import engine_of, rank_zero_loading_left_off, uncompiled_by
    from tuneloop.host.hardware import quantized_loading

    try:
        engine = engine_of(cfg)
    except ValueError as error:
        yield str(error)
        return
    uncompiled = uncompiled_by(engine)
    if uncompiled and cfg.torch_compile is True:  # compiling changes only speed: said, and left off (auto: silent)
        warnings.warn(f"`torch_compile` with {uncompiled}: tuneloop compiles only unsharded models without context "
                      "parallel so far, so this run is not compiled (the same result, without the speed-up).",
                      UserWarning, stacklevel=2)
    left_off = rank_zero_loading_left_off(engine, cfg.rl, quantized_loading(cfg))
    if left_off:
        warnings.warn(left_off, UserWarning, stacklevel=2)
    yield from sharded_quantized_weights(cfg, engine)
    mesh = engine.mesh_keys
    if mesh.tp:
        yield from tensor_parallel(cfg, mesh.tp)
    if mesh.cp:
        yield from context_parallel(cfg, mesh.cp)
    if cfg.optimizer == "muon" and engine.name != "ddp":
        yield (f"`optimizer: muon` orthogonalises whole weight matrices, and {engine.name} hands the optimizer shards "
               "of them: use muon on DDP ranks (no `fsdp`/`deepspeed`), or an AdamW")
    if engine.name == "fsdp2" and OPTIMIZERS[cfg.optimizer].library == "bitsandbytes":
        # (DDP steps the module's own tensors, DeepSpeed's ZeRO its flat fp32 partitions: plain tensors both)
        yield (f"`optimizer: {cfg.optimizer}` with `fsdp` asks for {axolotl.FEATURES['fsdp2_bnb_optimizer'][0]}, which "
               "tuneloop cannot run: bitsandbytes' kernels step plain tensors, and FSDP2 hands the optimizer DTensor "
               "shards (the first step would fail on every rank); use `optimizer: adamw_torch_fused` (or "
               "adamw_torch), or keep it on DDP ranks or DeepSpeed (`deepspeed: zero2`), where it steps plain tensors")


def tensor_parallel(cfg, tp: int) -> Problems:
    """What tensor parallel (engines/tensor_parallel.py) runs with: a whole model's projections split by torch's
    parallelize_module. An adapter wraps them (peft's layers are no nn.Linear the split knows), 4/8-bit weights
    have no split, and online RL's generation and a stream's per-rank counts are not arranged for ranks that share
    their rows."""
    key = f"`tensor_parallel_size: {tp}`"
    if cfg.adapter:
        yield (f"{key} with `adapter: {cfg.adapter}`: tuneloop splits a whole model's projections, and the "
               "adapter's layers wrap them; fine-tune the whole model, or set tensor_parallel_size to 1 and "
               "shard with dp_shard_size")
    elif cfg.load_in_4bit or cfg.load_in_8bit:
        yield f"{key} with 4/8-bit weights: quantized weights are not split; set tensor_parallel_size to 1"
    if is_online(cfg):
        yield (f"{key} with `rl: {cfg.rl}`: online generation is not arranged for ranks that share their prompts; "
               "set tensor_parallel_size to 1")
    if cfg.streams:
        yield (f"{key} with a streamed dataset: a stream's per-rank counts are not arranged for ranks that share "
               "their rows; prepare the data (remove `streaming`), or set tensor_parallel_size to 1")


def context_parallel(cfg, cp: int) -> Problems:
    """What context parallel (engines/context_parallel.py) runs with: the language-model loss, which is a sum over
    tokens and so splits over slices of a row. A preference or reward loss needs whole rows' log-probs or scores,
    online RL generates whole rows, and a stream's per-rank counts are not arranged for ranks that share rows."""
    key = (f"`context_parallel_size: {cp}`" if cfg.context_parallel_size
           else f"`sequence_parallel_degree: {cp}`")
    if cfg.rl or cfg.reward_model or cfg.process_reward_model:
        what = f"`rl: {cfg.rl}`" if cfg.rl else "a reward model"
        yield (f"{key} with {what}: context parallel splits each row over ranks, and this loss needs whole rows "
               "(their log-probs or scores); it trains the language-model loss (SFT, pretraining): set "
               "context_parallel_size to 1")
    if cfg.streams:
        yield (f"{key} with a streamed dataset: a stream's per-rank counts are not arranged for ranks that share "
               "their rows; prepare the data (remove `streaming`), or set context_parallel_size to 1")
    if cfg.pad_to_sequence_len and cfg.sequence_len % cp:
        yield (f"{key} does not divide `sequence_len: {cfg.sequence_len}` (with `pad_to_sequence_len`): each cp "
               f"rank holds an equal slice of every row; make sequence_len a multiple of {cp}")


def sharded_quantized_weights(cfg, engine) -> Problems:
    """4/8-bit weights under FSDP2 or DeepSpeed, as bitsandbytes and the engine can run them (measured on gloo ranks).
    FSDP2 and ZeRO-3 divide a 4-bit weight's packed values like any parameter, and the weight gets its quantization
    state back when it is gathered (FSDP2: bitsandbytes restores it from the layer; ZeRO-3 keeps the parameter
    object). But an engine that casts the model's floating-point weights to 16 bits (FSDP2 gathering under bf16,
    DeepSpeed's own bf16/fp16) would cast 4-bit values packed into another float dtype, destroying them. An 8-bit
    weight's scales live on the parameter object, which FSDP2 replaces: it comes back without them."""
    from tuneloop.host.hardware import mixed_precision, native_bf16, quantized_loading

    quantized = quantized_loading(cfg)
    if not quantized or engine.name == "ddp":
        return
    if quantized == "8bit" and engine.name == "fsdp2":
        yield (f"`load_in_8bit` with `fsdp` asks for {axolotl.FEATURES['fsdp2_8bit'][0]}, which tuneloop cannot do: "
               "bitsandbytes keeps an 8-bit weight's scales on the parameter FSDP2 replaces, so a gathered weight "
               "comes back without them; use `adapter: qlora` (4-bit weights shard), or 8-bit under DeepSpeed or "
               "DDP ranks")
        return
    storage = str((cfg.bnb_config_kwargs or {}).get("bnb_4bit_quant_storage", "uint8")).removeprefix("torch.")
    asks_machine = cfg.bf16 == "auto" and not cfg.fp16  # (fp16 needing CUDA is refused by resolved.precision)
    mixed, _ = mixed_precision(cfg.fp16, cfg.bf16, native_bf16() if asks_machine else None)
    if engine.name == "fsdp2":
        cast = "bfloat16" if mixed == "bf16" else None
        who = "FSDP2 gathers every floating-point weight in bfloat16 (`bf16`)"
    else:
        cast = {"bf16": "bfloat16", "fp16": "float16"}.get(mixed) if engine.sixteen_bit_weights(mixed) else None
        who = f"DeepSpeed casts the model's floating-point weights to {cast} (its {mixed} block)"
    if quantized == "4bit" and cast and storage in ("float32", "float16", "bfloat16") and storage != cast:
        yield (f"`bnb_config_kwargs.bnb_4bit_quant_storage: {storage}` under {engine.name}: {who}, which would "
               f"cast the 4-bit values packed in {storage} and destroy them; set bnb_4bit_quant_storage to {cast} "
               "(the seed's recipe: the compute dtype) or uint8")


def read_engine_quietly(cfg):
    """The engine the sharding keys ask for, read again without its warnings (`sharding` said them); None where
    `sharding` refused the keys (and said why)."""
    from tuneloop.engines.keys import engine_of

    try:
        return engine_of(cfg, quiet=True)
    except ValueError:
        return None


def master_weights_blocker(cfg, mixed: str, engine) -> str | None:
    """What rules out bf16 compute weights with fp32 masters (resolved.master_weights), in words; None: nothing.
    `engine`: the run's (None: the sharding keys were refused, and said)."""
    if mixed != "bf16":
        return "bf16 mixed precision (`bf16: true`, or `bf16: auto` on a machine with native bf16)"
    if cfg.adapter:
        return ("a full fine-tune: an adapter's frozen base needs no masters (under `master_weights: auto` its "
                "matmul weights are held in bf16; `bfloat16: true` loads the whole base in bf16)")
    if cfg.bfloat16 or cfg.float16:
        return "fp32 weights to keep as masters (`bfloat16`/`float16` load 16-bit weights with no fp32 copy)"
    if engine is not None and engine.name != "ddp":
        return f"the DDP engine ({engine.name} keeps fp32 masters of its own under `bf16`)"
    return None


def master_weights(cfg) -> Problems:
    """`master_weights: true` where the config alone rules them out (bf16 off, an adapter, 16-bit weights, a
    sharding engine); a machine without native bf16 under `bf16: auto` is resolved.py's to say."""
    if cfg.master_weights is True:
        blocker = master_weights_blocker(cfg, "no" if cfg.bf16 is False or cfg.fp16 else "bf16",
                                         read_engine_quietly(cfg))
        if blocker:
            yield f"`master_weights: true` needs {blocker}"


def row_order(cfg) -> Problems:
    """`sample_packing_sequentially` says how rows pack (data/batching.py): a run that does not pack has none.
    `max_tokens_per_micro_batch` deals padded rows by length under a token budget: what fixes a micro-batch's
    tokens otherwise, or deals rows another way, cannot go with it."""
    if cfg.sample_packing_sequentially and not cfg.sample_packing and not cfg.streams:
        yield ("`sample_packing_sequentially` chooses how rows are packed, and this run does not pack: set "
               "`sample_packing: true`, or remove it (`curriculum_sampling: true` alone keeps the data's order)")
    budget = cfg.max_tokens_per_micro_batch
    if budget is None:
        return
    if budget < cfg.sequence_len:
        yield (f"`max_tokens_per_micro_batch: {budget}` is below sequence_len ({cfg.sequence_len}), and a row may be "
               "that long: set it to at least sequence_len")
    instead = ("`sample_packing: true` (packing fills each micro-batch to micro_batch_size × sequence_len tokens "
               "already)" if cfg.sample_packing else
               "`pad_to_sequence_len: true` (every micro-batch is micro_batch_size × sequence_len tokens)"
               if cfg.pad_to_sequence_len else
               "`curriculum_sampling: true` (the data's order; the budget deals rows by length)"
               if cfg.curriculum_sampling else
               "a streamed dataset (read as it comes)" if cfg.streams else
               f"`rl: {cfg.rl}` (its rows are pairs or rollouts, dealt by rows)" if cfg.rl else
               "`reward_model` (its rows are pairs, dealt by rows)" if cfg.reward_model else None)
    if instead:
        yield f"`max_tokens_per_micro_batch` cannot be used with {instead}: remove one of them"



def hub_push(cfg) -> Problems:
    """`hub_strategy` and `hub_revision` say how the run is pushed (use/hub.py): without `hub_model_id` it is not."""
    unused = [f"`{key}`" for key in ("hub_strategy", "hub_revision") if getattr(cfg, key)]
    if unused and not cfg.hub_model_id:
        warnings.warn(f"{' and '.join(unused)} say how the run is pushed to the Hugging Face Hub, and without "
                      "`hub_model_id` it is not pushed: set `hub_model_id` to push, or remove them", UserWarning,
                      stacklevel=2)
    yield from ()  # (a warning, never a problem: axolotl ignores them)

def quantization_aware_training(cfg) -> Problems:
    """`qat:` (quant/qat.py) fake-quantizes the weights the run trains, for a model quantized after training. Refused
    with what would make it mean something else: an adapter (as in axolotl for 4/8-bit bases; a LoRA would train beside
    frozen fake-quantized weights, and the merged model `tuneloop quantize` rounds is not what trained), and DeepSpeed,
    under which tuneloop has not run torchao's fake-quantized layers yet. (FSDP2 runs them: tests/test_qat.py.)"""
    if cfg.qat is None:
        return
    if cfg.adapter or cfg.load_in_4bit or cfg.load_in_8bit:
        key = f"adapter: {cfg.adapter}" if cfg.adapter else "load_in_4bit" if cfg.load_in_4bit else "load_in_8bit"
        yield (f"`qat` with `{key}`: quantization-aware training fake-quantizes the weights the run trains, and an "
               "adapter trains beside frozen ones (the merged model would not be what trained): remove one of them "
               "(axolotl refuses QAT with 4/8-bit loading too)")
    engine = read_engine_quietly(cfg)
    if engine is not None and engine.name not in ("ddp", "fsdp2"):
        yield (f"`qat` with {engine.name} asks for {axolotl.FEATURES['quantization'][0]} (QAT under DeepSpeed), "
               "which tuneloop does not do yet: it has not run torchao's fake-quantized layers under ZeRO; train QAT "
               "on one process, DDP ranks or FSDP2 (`fsdp_version: 2`)")


def mistral_common(cfg) -> Problems:
    """`tokenizer_use_mistral_common`: chats are encoded by mistral-common (data/mistral_chat.py), so what only a
    transformers tokenizer or a Jinja template would read is refused rather than ignored. (axolotl ignores some of
    them here: `eot_tokens`, a template.)"""
    if not cfg.tokenizer_use_mistral_common:
        return
    why = "with `tokenizer_use_mistral_common: true`"
    from tuneloop.config.vision_names import asks_for_vision

    if asks_for_vision(cfg):  # (mistral-common encodes images itself, as image chunks: data/mistral_chat.py does not)
        yield (f"a vision-language model {why} asks for {axolotl.FEATURES['multimodal'][0]} on mistral-common's "
               "encoding of images, which tuneloop does not do yet; remove tokenizer_use_mistral_common to train "
               "with the model's own processor and chat template (tokenizer.json)")
    for key in ("chat_template", "chat_template_jinja"):
        if getattr(cfg, key):
            yield (f"`{key}` {why}: mistral-common encodes the chats itself, and a Jinja template would be ignored; "
                   "remove it")
    model_option, data_option = axolotl.FEATURES["model_options"][0], axolotl.FEATURES["data_options"][0]
    for key, what in (("tokenizer_type", "a transformers tokenizer class"), ("train_tokenizer", "a trained tokenizer"),
                      ("special_tokens", "added or renamed special tokens"), ("tokens", "added tokens")):
        if getattr(cfg, key):
            yield (f"`{key}` {why} asks for {what} on a mistral-common tokenizer, {model_option} tuneloop does not "
                   "have yet: remove one of them")
    if cfg.eot_tokens and list(cfg.eot_tokens) != ["</s>"]:
        yield (f"`eot_tokens: {list(cfg.eot_tokens)}` {why} asks for {data_option} tuneloop does not have yet: "
               "mistral-common ends an assistant turn with </s> alone; remove eot_tokens")
    if cfg.rl:
        yield (f"`rl: {cfg.rl}` {why} asks for {axolotl.FEATURES['preference'][0]} on mistral-common's chat "
               "encoding, which tuneloop does not do yet (its preference rows are rendered with a template)")
    for index, entry in enumerate(cfg.datasets + cfg.test_datasets):
        yield from _mistral_common_entry(index, entry, why, data_option)


def _mistral_common_entry(index: int, entry, why: str, data_option: str) -> Problems:
    """A dataset of chat rows (or of tokens), trained as mistral-common can tell its turns apart."""
    where = f"dataset {index} ({entry.path})"
    if entry.type is not None and entry.type not in MISTRAL_CHAT_TYPES:
        name = entry.type if isinstance(entry.type, str) else "a mapping of instruction fields"
        yield (f"{where} is `type: {name}` {why}: {axolotl.FEATURES['dataset_types'][0]} on mistral-common yet (it "
               f"encodes chat rows: {', '.join(MISTRAL_CHAT_TYPES)}; rows given as tokens, without type, work too)")
    for key in ("chat_template", "chat_template_jinja"):
        if getattr(entry, key, None):
            yield f"{where}: `{key}` {why}: mistral-common encodes the chats itself; remove it"
    if list(entry.roles_to_train) != ["assistant"]:
        yield (f"{where}: `roles_to_train: {list(entry.roles_to_train)}` {why} asks for {data_option} tuneloop does "
               "not have yet (it finds the assistant's turns in mistral-common's tokens); set [assistant] or remove it")
    for key in ("train_on_eos", "train_on_eot"):
        if getattr(entry, key) == "all":
            yield (f"{where}: `{key}: all` {why} asks for {data_option} tuneloop does not have yet: in "
                   "mistral-common's encoding only assistant turns end with </s>; use turn (the default), last or none")


RULES: tuple[Callable[..., Problems], ...] = (schedule, muon_betas, best_eval, vision_family, precision_and_attention, chat_template, adapters,
                                              lora_variants, bitsandbytes_settings, model_quantization,
                                              eval_set_and_shards, model_source,
                                              streaming, row_order, preference, reward_model,
                                              process_reward_model, sharding,
                                              master_weights, hub_push,
                                              quantization_aware_training, mistral_common)


def problems_of(cfg, unjudged: set[str] = frozenset()) -> list[str]:
    """Every rule's problems. `unjudged`: fields whose values were refused; they are missing from `cfg`, and a rule
    that reads one is skipped (an AttributeError naming it) rather than judge a value that is not there."""
    found = []
    for rule in RULES:
        problems = rule(cfg)
        while True:
            try:
                found.append(next(problems))
            except StopIteration:
                break
            except AttributeError as error:
                if error.name not in unjudged:
                    raise
                break
            except ValueError as error:  # a key reader's refusal (a text_column that would be ignored, say)
                found.append(str(error))
                break
    return found
