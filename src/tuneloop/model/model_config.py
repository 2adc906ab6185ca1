"""The model's transformers config as a run reads it, and the class that loads it (`model_type`), checked against each
other. The config has the overrides applied, is sized to the tokenizer for a model built from scratch, and carries a
classifier's head."""

from __future__ import annotations

from pathlib import Path

from tuneloop.config import TuneloopConfig
from tuneloop.errors import UserError
from tuneloop.model.kinds import (SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION, VISION_LANGUAGE, ModelKind,
                                  auto_class, kind_of_config, named_kind)

def checked_source(name: str, key: str) -> str:
    """A local-looking path that does not exist is the user's to fix (aliases are resolved upstream)."""
    if name.startswith(("/", "./", "../", "~")) and not Path(name).expanduser().exists():
        raise UserError(f"config: `{key}: {name}` is not an existing folder")
    return name

def revision_options(cfg: TuneloopConfig, key: str = "base_model") -> dict:
    """`revision_of_model` pins a hub model's commit; it says nothing about a tokenizer from elsewhere, and a local
    folder has no revisions (refused rather than ignored)."""
    if not cfg.revision_of_model or key != "base_model":
        return {}
    if Path(cfg.base_model).expanduser().exists():
        raise UserError(f"config: `revision_of_model: {cfg.revision_of_model}` applies to hub models, and "
                        f"{cfg.base_model} is a local folder; remove it")
    return {"revision": cfg.revision_of_model}

def model_class(cfg: TuneloopConfig, kind: ModelKind):
    """The class that loads the model: `model_type` (axolotl's key: an Auto class or a concrete class), else the
    kind's Auto class."""
    import transformers

    if not cfg.model_type:
        return auto_class(kind)
    found = getattr(transformers, cfg.model_type, None)
    if found is None:
        raise UserError(f"config: `model_type: {cfg.model_type}` is not a class transformers has")
    return found


def check_model_class(cfg: TuneloopConfig, config) -> None:
    """A concrete `model_type` must be what the checkpoint says it is (a LlamaForCausalLM class loading a
    Mistral checkpoint would quietly drop or misplace weights)."""
    model_class(cfg, kind_of_config(config))  # a class transformers has
    source = cfg.base_model_config or cfg.base_model
    named, actual = named_kind(cfg), kind_of_config(config)
    if named in (SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION) and actual.name == "causal":
        actual = named  # a causal checkpoint's body under a new score head (what a reward model starts from)
    if named is not None and named != actual:
        if actual == SEQUENCE_CLASSIFICATION:
            raise UserError(f"config: {source} is a sequence-classification model (a reward model's score head): set "
                            "`reward_model: true` to train it as one, or use its causal base model")
        if actual == TOKEN_CLASSIFICATION:
            raise UserError(f"config: {source} is a token-classification model (a process reward model's head): "
                            "set `process_reward_model: true` to train it as one, or use its causal base model")
        if named == TOKEN_CLASSIFICATION:
            raise UserError(f"config: `process_reward_model: true` puts a token-classification head on a text "
                            f"decoder, and {source} is a {actual.name} model: use a causal (decoder-only) base model")
        if named == SEQUENCE_CLASSIFICATION:
            raise UserError(f"config: `reward_model: true` puts a score head on a text decoder, and {source} is "
                            f"a {actual.name} model: use a causal (decoder-only) base model")
        named_text = ("a vision-language" if named == VISION_LANGUAGE else "a text-to-text" if named.encoder_decoder
                      else "a causal")
        actual_text = ("a vision-language" if actual == VISION_LANGUAGE else "an encoder-decoder"
                       if actual.encoder_decoder else "a causal")
        raise UserError(f"config: `model_type: {cfg.model_type}` is {named_text} model class, and {source} is "
                        f"{actual_text} model; set `model_type: {actual.auto_class}` or leave it out")
    architectures = getattr(config, "architectures", None) or []
    if cfg.model_type and not cfg.model_type.startswith("Auto") and architectures \
            and cfg.model_type not in architectures:
        raise UserError(f"config: `model_type: {cfg.model_type}` does not match {source}, whose config says "
                        f"{', '.join(architectures)}; set `model_type: {actual.auto_class}` or the right class")

WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")


def model_config(cfg: TuneloopConfig, tokenizer=None):
    """The model's config with `overrides_of_model_config` (axolotl's `model_config`) applied: the checkpoint's,
    `base_model_config`'s (a folder, or a model type such as `t5`: that type's default config), and for a model
    trained from scratch sized to the tokenizer when one is given."""
    from transformers import CONFIG_MAPPING, AutoConfig

    key = "base_model_config" if cfg.base_model_config else "base_model"
    name = cfg.base_model_config or cfg.base_model
    try:
        if cfg.base_model_config and name in CONFIG_MAPPING and not Path(name).expanduser().exists():
            config = AutoConfig.for_model(name)
        else:
            source = checked_source(name, key)
            check_from_scratch_source(cfg)
            config = AutoConfig.from_pretrained(source, trust_remote_code=cfg.trust_remote_code,
                                                **revision_options(cfg, key))
    except (OSError, ValueError) as error:
        raise UserError(f"model: cannot read the config of {name!r} (`{key}`): {error}") from None
    for option, value in (cfg.overrides_of_model_config or {}).items():
        if not hasattr(config, option):  # a misspelt size would build the default-sized model in silence
            raise UserError(f"config: `overrides_of_model_config.{option}` is not a setting of {type(config).__name__}"
                            f" (a {config.model_type} config); check its spelling")
        setattr(config, option, value)
    if cfg.from_scratch and tokenizer is not None:
        size_to_tokenizer(cfg, config, tokenizer)
    check_model_class(cfg, config)
    if named_kind(cfg) == SEQUENCE_CLASSIFICATION:
        score_last_real_token(cfg, config, tokenizer)
    elif named_kind(cfg) == TOKEN_CLASSIFICATION:
        config.num_labels = 2  # a step is correct or not (axolotl's process reward models)
    return config

def score_last_real_token(cfg: TuneloopConfig, config, tokenizer) -> None:
    """A reward model's head: one score per sequence (the config's rules refuse other num_labels), read by
    transformers at the last token that is not the pad token, which it can only find knowing the tokenizer's pad
    id (saved with the model, so that it scores the same when loaded elsewhere)."""
    config.num_labels = cfg.num_labels or 1
    if tokenizer is not None:
        config.get_text_config().pad_token_id = tokenizer.pad_token_id

def check_from_scratch_source(cfg: TuneloopConfig) -> None:
    """`base_model_config` alone builds random weights; where that folder holds weights, the config must say
    which was meant (axolotl's `reinit_weights: true`: random weights; `base_model:` the folder: its weights)."""
    if cfg.base_model is not None or cfg.reinit_weights:
        return
    folder = Path(cfg.base_model_config).expanduser()
    weights = [path.name for pattern in WEIGHT_FILES for path in folder.glob(pattern)] if folder.is_dir() else []
    if weights:
        raise UserError(f"config: `base_model_config: {cfg.base_model_config}` holds weights ({weights[0]}), and "
                        "without base_model tuneloop would start from random weights: set `reinit_weights: true` "
                        f"to train from scratch, or `base_model: {cfg.base_model_config}` to fine-tune those weights")

def size_to_tokenizer(cfg: TuneloopConfig, config, tokenizer) -> None:
    """A model built from scratch gets the tokenizer's vocabulary and special ids (its embeddings are sized to
    the tokenizer; T5 starts its decoder from the pad id)."""
    vocabulary = len(tokenizer)
    asked = (cfg.overrides_of_model_config or {}).get("vocab_size")
    if asked is not None and asked < vocabulary:
        raise UserError(f"config: `overrides_of_model_config.vocab_size: {asked}` is smaller than the tokenizer's "
                        f"{vocabulary} tokens; raise it or leave it out (the model is then sized to the tokenizer)")
    config.vocab_size = asked or vocabulary
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        token = getattr(tokenizer, name, None)
        if token is not None:
            setattr(config, name, token)
    if getattr(config, "is_encoder_decoder", False):
        config.decoder_start_token_id = tokenizer.pad_token_id
