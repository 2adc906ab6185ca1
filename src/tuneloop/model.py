"""Load the tokenizer and the model: model kinds, loading or building from a config (from scratch), adapters,
checkpointing, and what the plan knows of the model (ModelFacts). What kind of model, which attention kernel and
which precision a run uses is decided once, in resolved.py; the loaders here are given it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from tuneloop.config import TuneloopConfig
from tuneloop.data.chat_templates import TOKENIZER_DEFAULT, resolve_template
from tuneloop.errors import UserError
from tuneloop.registry import Registry


@dataclass(frozen=True)
class ModelKind:
    name: str
    auto_class: str  # the transformers Auto class that builds and loads it
    peft_task_type: str  # what peft calls it, for LoRA
    encoder_decoder: bool = False  # the prompt goes to an encoder, the trained text is the decoder's labels


MODEL_KINDS: Registry[ModelKind] = Registry("model kind", "model_type")
MODEL_KINDS.add("causal", ModelKind("causal", "AutoModelForCausalLM", peft_task_type="CAUSAL_LM"))
MODEL_KINDS.add("seq2seq", ModelKind("seq2seq", "AutoModelForSeq2SeqLM", peft_task_type="SEQ_2_SEQ_LM",
                                     encoder_decoder=True))
# a decoder with a score head over its last real token (a reward model: `reward_model: true`); built on a causal
# checkpoint, its head starts random; under LoRA peft trains the head whole (SEQ_CLS's modules_to_save)
MODEL_KINDS.add("sequence_classification", ModelKind("sequence_classification", "AutoModelForSequenceClassification",
                                                     peft_task_type="SEQ_CLS"))
SEQUENCE_CLASSIFICATION = MODEL_KINDS["sequence_classification"]
# a decoder with a 2-label head on every token (a process reward model: `process_reward_model: true`, each
# reasoning step's end token classified correct or not); built on a causal checkpoint, its head starts random
MODEL_KINDS.add("token_classification", ModelKind("token_classification", "AutoModelForTokenClassification",
                                                  peft_task_type="TOKEN_CLS"))
TOKEN_CLASSIFICATION = MODEL_KINDS["token_classification"]
# a decoder that also reads images (a vision tower and projector before it): chat rows with image parts, the
# processor's image inputs per micro-batch (data/images.py), its loss the causal one over the text tokens
MODEL_KINDS.add("vision_language", ModelKind("vision_language", "AutoModelForImageTextToText",
                                             peft_task_type="CAUSAL_LM"))
VISION_LANGUAGE = MODEL_KINDS["vision_language"]


def kind_of_config(config) -> ModelKind:
    """What a transformers config says the model is (a saved reward model's config names its class)."""
    if any(name.endswith("ForSequenceClassification") for name in getattr(config, "architectures", None) or ()):
        return SEQUENCE_CLASSIFICATION
    if any(name.endswith("ForTokenClassification") for name in getattr(config, "architectures", None) or ()):
        return TOKEN_CLASSIFICATION
    if getattr(config, "vision_config", None) is not None:
        return VISION_LANGUAGE
    return MODEL_KINDS["seq2seq" if getattr(config, "is_encoder_decoder", False) else "causal"]


# layers that mix tokens by attention: a packed row's sequences stay apart under the per-sequence mask
# `layer_types` values of layers that carry state along the sequence (transformers 5.24 writes Mamba and gated
# delta-net layers as linear_attention, LFM2's as conv, Falcon-H1's and Inkling's parallel SSM+attention as
# hybrid); a deny-list, since attention keeps gaining new names (indexed_attention, compressed_sparse_attention,
# window_attention, ...) that all take packed boundaries as attention does
RECURRENT_LAYER_TYPES = {"linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba", "recurrent"}
# families whose token mixers are recurrent or convolutional even where `layer_types` does not say so
RECURRENT_FAMILIES = ("mamba", "falcon_mamba", "rwkv", "xlstm", "recurrent_gemma", "lfm2", "lfm3", "zamba", "bamba",
                      "falcon_h1")


def recurrent_layers(config) -> str | None:
    """What in this model carries state along the sequence outside attention (state-space, linear-attention or
    short-convolution layers), in words; None for attention-only models. Such a layer runs straight through a
    packed row: transformers' kernels on this stack take no sequence boundaries (Qwen3.5's torch gated-delta rule
    drops its `cu_seqlens`, Mamba's slow path and LFM2's conv take none), so one sequence's state would leak into
    the next."""
    configs = [config, *(getattr(config, name, None) for name in ("text_config", "language_config"))]
    for part in (c for c in configs if c is not None):
        types = getattr(part, "layer_types", None) or getattr(part, "layers_block_type", None)
        others = sorted({str(t) for t in types or ()} & RECURRENT_LAYER_TYPES)
        if others:
            return f"{getattr(part, 'model_type', 'this model')}'s {'/'.join(others)} layers"
        model_type = str(getattr(part, "model_type", ""))
        if model_type.startswith(RECURRENT_FAMILIES):
            return f"{model_type}'s recurrent layers"
    return None


def named_kind(cfg: TuneloopConfig) -> ModelKind | None:
    """The kind `model_type` names (AutoModelForSeq2SeqLM, a seq2seq family's class, or a causal one), if set; a
    reward model is a sequence classifier whatever the checkpoint was."""
    from tuneloop.config.schema import is_seq2seq_class

    if cfg.reward_model or (cfg.model_type or "").endswith("ForSequenceClassification"):
        return SEQUENCE_CLASSIFICATION
    if cfg.process_reward_model or (cfg.model_type or "").endswith("ForTokenClassification"):
        return TOKEN_CLASSIFICATION
    if not cfg.model_type:
        return None
    if cfg.model_type == "AutoModelForImageTextToText" or (cfg.model_type.endswith("ForConditionalGeneration")
                                                           and not is_seq2seq_class(cfg.model_type)):
        return VISION_LANGUAGE
    seq2seq = cfg.model_type == "AutoModelForSeq2SeqLM" or is_seq2seq_class(cfg.model_type)
    return MODEL_KINDS["seq2seq" if seq2seq else "causal"]


def check_encoder_decoder_settings(cfg: TuneloopConfig) -> None:
    """What an encoder-decoder (T5) run cannot do, refused before any data is read."""
    if cfg.sample_packing or cfg.eval_sample_packing:
        key = "sample_packing" if cfg.sample_packing else "eval_sample_packing"
        raise UserError(f"config: `{key}: true` packs rows for a causal model, and this is an encoder-decoder model "
                        "(its relative positions and cross-attention do not separate packed rows): set it to false; "
                        "`group_by_length: true` reclaims most of the padding")
    if cfg.train_on_inputs:
        raise UserError("config: `train_on_inputs: true` trains the prompt's tokens too, and an encoder-decoder's "
                        "prompt is its encoder's input, which it does not predict: remove it")
    if cfg.pretraining_dataset:
        raise UserError("config: `pretraining_dataset` trains a causal model on raw text; an encoder-decoder's "
                        "pretraining (T5's span corruption) is not something tuneloop does. Stream source/target rows "
                        "with `datasets` (type seq2seq) and `streaming: true`")
    for entry in cfg.train_entries + cfg.test_datasets:  # found now, not when a stream reaches the entry
        if entry.type == "completion":
            raise UserError(f"config: `type: completion` trains the whole text, and an encoder-decoder model needs a "
                            f"prompt for its encoder and a target for its decoder ({entry.path}): use `type: "
                            "seq2seq` with field_source/field_target, alpaca, or a chat dataset")
    if cfg.rl:
        raise UserError(f"config: `rl: {cfg.rl}` is preference training of causal models; tuneloop does not train "
                        "encoder-decoder models on preference pairs yet")


def check_vision_settings(cfg: TuneloopConfig, kind: ModelKind | None) -> None:
    """What a vision-language run cannot do yet, refused before any data is read; and the image keys refused on
    a text-only model (accepted and ignored, they would say the run does what it does not)."""
    source = cfg.base_model or cfg.base_model_config
    if kind != VISION_LANGUAGE:
        for key in ("processor_type", "freeze_mm_modules", "processor_kwargs", "image_size", "image_resize_algorithm"):
            if getattr(cfg, key):
                raise UserError(f"config: `{key}: {getattr(cfg, key)}` is for vision-language models, and {source} "
                                "is a text-only model: remove it")
        return
    refused = {"rl": "is preference training; tuneloop does not train vision-language models on preference "
                     "pairs yet",
               "reward_model": "puts a score head on a text decoder; not on a vision-language model",
               "pretraining_dataset": "streams raw text; a vision-language model trains on chat rows with images",
               "streaming": "streams rows; a vision-language model's rows are prepared whole (their images are "
                            "read lazily per micro-batch)"}
    for key, why in refused.items():
        if getattr(cfg, key, None):
            raise UserError(f"config: `{key}: {getattr(cfg, key)}` {why} ({source} is a vision-language model)")
    if cfg.image_resize_algorithm and cfg.image_size is None:  # (axolotl then takes the vision config's image_size)
        raise UserError(f"config: `image_resize_algorithm: {cfg.image_resize_algorithm}` is the filter `image_size` "
                        "resizes with, and image_size is not set: set it (an int pads each image to that square, "
                        "[width, height] stretches it), or remove image_resize_algorithm")


def attach_image_inputs(cfg: TuneloopConfig, kind: ModelKind | None, tokenizer) -> None:
    """A vision-language run's processor, carried by its tokenizer to preparing, collating and saving
    (data/images.py: image_inputs_of)."""
    check_vision_settings(cfg, kind)
    if kind == VISION_LANGUAGE:
        from tuneloop.data.images import load_image_inputs

        image_inputs = load_image_inputs(cfg, model_config(cfg, tokenizer), tokenizer)
        check_vision_packing(cfg, image_inputs.family)
        tokenizer.tuneloop_image_inputs = image_inputs


def check_vision_packing(cfg: TuneloopConfig, family) -> None:
    """`sample_packing` on a vision-language model: the families whose packed sequences stay apart
    (vision_families: VisionFamily.packs), refused naming the family for the others."""
    from tuneloop.vision_families import packing_families

    for key in ("sample_packing", "eval_sample_packing"):
        if getattr(cfg, key) and not family.packs:
            raise UserError(f"config: `{key}: {getattr(cfg, key)}` packs rows, and a {family.name} model's packed "
                            "sequences are not kept apart yet (its image positions or image attention span the "
                            f"whole row); families that pack: {packing_families()}. Set it to false (axolotl's "
                            "configs do); `group_by_length: true` reclaims most of the padding")


def freeze_vision_modules(cfg: TuneloopConfig, model) -> None:
    """`freeze_mm_modules`: the vision tower and projector frozen (each family's record names them: vision_families/)."""
    from tuneloop.data.images import vision_family

    parts = vision_family(model.config, cfg.base_model or cfg.base_model_config).vision_modules
    for name, parameter in model.named_parameters():
        if any(part in name.split(".") for part in parts):
            parameter.requires_grad_(False)


def auto_class(kind: ModelKind):
    import transformers

    return getattr(transformers, kind.auto_class)


def loader_for_config(config):
    """The Auto class that loads a saved folder with this config (for `infer`, `eval` and `merge-lora`)."""
    return auto_class(kind_of_config(config))


def _checked_source(name: str, key: str) -> str:
    """A local-looking path that does not exist is the user's to fix (aliases are resolved upstream)."""
    if name.startswith(("/", "./", "../", "~")) and not Path(name).expanduser().exists():
        raise UserError(f"config: `{key}: {name}` is not an existing folder")
    return name


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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model",
                   "sentencepiece.bpe.model", "vocab.txt")


def load_tokenizer(cfg: TuneloopConfig, *, encoder_decoder: bool):
    """The run's tokenizer: trained on the data (`train_tokenizer`: an encoder-decoder's learns from source and
    target apart), `tokenizer_config`'s, or the model's."""
    import transformers

    if cfg.train_tokenizer:
        from tuneloop.data.tokenizer_training import trained_tokenizer

        return _with_added_tokens(cfg, trained_tokenizer(cfg, encoder_decoder=encoder_decoder))
    key = "tokenizer_config" if cfg.tokenizer_config else "base_model" if cfg.base_model else "base_model_config"
    source = _checked_source(cfg.tokenizer_config or cfg.base_model or cfg.base_model_config, key)
    if cfg.tokenizer_use_mistral_common:
        from tuneloop.data.mistral_chat import load_mistral_common_tokenizer

        return load_mistral_common_tokenizer(source, key, _revision(cfg, key))
    tokenizer_class = getattr(transformers, cfg.tokenizer_type or "AutoTokenizer", None)
    if tokenizer_class is None:
        raise UserError(f"config: `tokenizer_type: {cfg.tokenizer_type}` is not a class transformers has")
    folder = Path(source).expanduser()
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        # (transformers would go on to suggest installing sentencepiece, which is not what is missing)
        raise UserError(f"model: `{key}: {source}` holds no tokenizer ({', '.join(TOKENIZER_FILES[:4])}, ...): point "
                        "`tokenizer_config` at the folder of the tokenizer the model was trained with (the model it "
                        "was fine-tuned from, say)")
    try:
        # (with mistral-common installed, AutoTokenizer would pick it for a folder holding tekken.json; only
        # `tokenizer_use_mistral_common` says so)
        only_transformers = {"mistral_format": False} if tokenizer_class is transformers.AutoTokenizer else {}
        tokenizer = tokenizer_class.from_pretrained(source, trust_remote_code=cfg.trust_remote_code,
                                                    **_revision(cfg, key), **only_transformers)
    except (OSError, ValueError, TypeError) as error:
        raise UserError(f"model: cannot load a tokenizer from {source!r}"
                        f"{f' as {cfg.tokenizer_type}' if cfg.tokenizer_type else ''}: {error}") from None
    if not getattr(tokenizer, "is_fast", False):
        raise UserError(f"model: the tokenizer of {source!r} is not a fast tokenizer; tuneloop needs character "
                        "offsets to mask prompts exactly")
    return _with_added_tokens(cfg, tokenizer)


def _with_added_tokens(cfg: TuneloopConfig, tokenizer):
    if cfg.special_tokens:
        tokenizer.add_special_tokens(dict(cfg.special_tokens))
    if cfg.tokens:
        tokenizer.add_tokens(list(cfg.tokens))  # new vocabulary; load_model grows the embeddings to match
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            source = cfg.tokenizer_config or cfg.base_model or cfg.base_model_config
            raise UserError(f"model: the tokenizer of {source} has neither a pad token nor an eos token: batches "
                            "cannot be padded, and rows cannot end. Name them: `special_tokens: {pad_token: "
                            "\"<pad>\", eos_token: \"</s>\"}` (tokens it already has, such as <|endoftext|>, are "
                            "used as they are; new ones grow the embeddings)")
        # padding positions never reach the loss or attention, so any id will do; eos is the convention
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def apply_run_template(cfg: TuneloopConfig, tokenizer) -> None:
    """The run's chat template becomes the tokenizer's, saved with the model for whoever generates next. Done
    after the data is prepared: a dataset with `chat_template: tokenizer_default` meant the tokenizer's own."""
    if cfg.chat_template and cfg.chat_template != TOKENIZER_DEFAULT:
        tokenizer.chat_template = resolve_template(cfg.chat_template, cfg.chat_template_jinja, tokenizer)


def _revision(cfg: TuneloopConfig, key: str = "base_model") -> dict:
    """`revision_of_model` pins a hub model's commit; it says nothing about a tokenizer from elsewhere, and a local
    folder has no revisions (refused rather than ignored)."""
    if not cfg.revision_of_model or key != "base_model":
        return {}
    if Path(cfg.base_model).expanduser().exists():
        raise UserError(f"config: `revision_of_model: {cfg.revision_of_model}` applies to hub models, and "
                        f"{cfg.base_model} is a local folder; remove it")
    return {"revision": cfg.revision_of_model}


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
            source = _checked_source(name, key)
            check_from_scratch_source(cfg)
            config = AutoConfig.from_pretrained(source, trust_remote_code=cfg.trust_remote_code,
                                                **_revision(cfg, key))
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


@dataclass
class ModelFacts:
    """What the plan needs to know of the model, read from its config alone (no weights)."""

    config: object  # the transformers config
    parameters: int
    trainable_parameters: int  # all of them, the adapter's, or the unfrozen ones
    max_positions: int | None  # n_positions / max_position_embeddings, where the config has one
    learned_positions: bool  # a position-embedding table of max_positions rows: longer rows cannot run at all
    chunked_loss: bool = False  # the loss meets the output projection in chunks (no whole logits tensor)
    matmul_weights: tuple[int, int] = (0, 0)  # (frozen, trained) weights tokens are multiplied by: plan/flops.py
    grown_rows: int = 0  # embedding rows added for the tokenizer's tokens the model's vocabulary does not have
    embedding_rows: int = 0  # the model's own rows, before any was added
    embeddings_trained: bool = True  # the input embeddings are trained (not under LoRA without modules_to_save)
    # trained weights only matmuls read: held in bf16 beside fp32 masters under bf16 (engines/masters.py)
    matmul_only_trained: int = 0
    matmul_only_frozen: int = 0  # the frozen ones: held in bf16 under bf16 beside an adapter (engines/masters.py)
    hidden_matrices_trained: int = 0  # trained weights Muon orthogonalises (muon.is_hidden_matrix): its states
    # (weights, trained) of the output projection the chunked loss meets; (0, False) without the chunked loss
    head_weights: tuple[int, bool] = (0, False)
    module_classes: frozenset = frozenset()  # the class names of the model's modules (an engine checks its own)
    layer_classes: tuple = ()  # the model's decoder-layer classes (transformers' _no_split_modules)
    quantizable: tuple[int, int, int] = (0, 0, 0)  # (weights, rows, layers) of the linears 4/8-bit loading quantizes
    experts: tuple[int, int] = (0, 0)  # (weights, tensors) of the 3-D expert weights (quantize_moe_experts)
    vision: object = None  # a vision-language model's image side as plan/flops.py counts it (VisionWeights)
    # what LLaMA-formula decoder layers keep for the backward (plan/activations.py); None for other models
    decoder_layers: object = None

    @property
    def text_config(self):
        """The config that holds the language model's sizes (hidden, layers, heads, vocabulary): a composite
        config's text part (Gemma 4, Qwen3.5), else the config itself."""
        return sizes_config(self.config)


def sizes_config(config):
    """The config whose global sizes the plan reads: a composite's text part, and for a heterogeneous one (per-layer
    head sizes, Gemma 4) a copy that answers with the global values (the estimates need one figure; transformers
    refuses to give it, or warns once per key, unless asked for it)."""
    import copy
    import logging

    sizes = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(sizes, "allow_global_per_layer_attribute_access", True) is False:
        sizes = copy.copy(sizes)
        sizes.allow_global_per_layer_attribute_access = True
        logging.getLogger("transformers.integrations.heterogeneity.configuration_utils").setLevel(logging.ERROR)
    return sizes


def model_facts(cfg: TuneloopConfig, kind: ModelKind, tokenizer=None) -> ModelFacts:
    """The model built on the meta device (no memory, no weights read), with the adapter or the freezing it
    will train with, so the counts are the real ones."""
    import torch

    from tuneloop.adapters import add_adapter, freeze_all_but
    from tuneloop.engines.masters import matmul_only_weights
    from tuneloop.quant.mxfp4 import dequantizes_mxfp4
    from tuneloop.kernels.output_head import loss_meets_head_in_chunks, output_head
    from tuneloop.plan.activations import llama_decoder_layers
    from tuneloop.quant.quantized_experts import count_expert_weights, expert_parameter_names, expert_targets

    config = model_config(cfg, tokenizer)
    dequantizes_mxfp4(cfg, config)  # (an MXFP4 checkpoint and the MXFP4 keys go together: refused now, not at load)
    try:
        with torch.device("meta"):
            built = model_class(cfg, kind)
            model = (built.from_config(config, trust_remote_code=cfg.trust_remote_code) if hasattr(built, "from_config")
                     else built._from_config(config))  # a concrete class (model_type: LlamaForCausalLM)
    except (OSError, ValueError) as error:
        raise UserError(f"model: cannot build {cfg.base_model!r} from its config: {error}") from None
    grown = len(tokenizer) - model.get_input_embeddings().num_embeddings if tokenizer is not None else 0
    if grown > 0:
        with torch.device("meta"):  # (mean-initialising new rows reads values: there are none on meta)
            model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    embedding_name = next(name for name, module in model.named_modules() if module is model.get_input_embeddings())
    quantizable = quantizable_linears(cfg, model)
    if cfg.qat is not None:  # a group size the layers' widths do not take: refused by the plan, before training
        from tuneloop.quant.qat import check_fits

        check_fits(cfg.qat, model)
    experts = count_expert_weights(model)
    if cfg.quantize_moe_experts and not experts[1]:
        raise UserError(f"config: `quantize_moe_experts: true`, but {cfg.base_model} ({type(model).__name__}) has no "
                        "expert weights to quantize (3-D parameters named like `experts.gate_up_proj`): remove the key")
    if cfg.quantize_moe_experts and cfg.lora_target_parameters:  # what `train` would refuse, refused by the plan
        expert_targets(cfg.lora_target_parameters, expert_parameter_names(model))
    classes = frozenset(type(module).__name__ for module in model.modules())
    layer_classes = tuple(getattr(model, "_no_split_modules", None) or ())
    parameters = sum(p.numel() for p in model.parameters())
    sizes = sizes_config(config)
    max_positions = getattr(sizes, "n_positions", None) or getattr(sizes, "max_position_embeddings", None)
    inputs = model.get_input_embeddings()
    learned = max_positions is not None and any(
        isinstance(module, torch.nn.Embedding) and module is not inputs and module.num_embeddings == max_positions
        for module in model.modules())
    if cfg.adapter:
        model = add_adapter(cfg, model, kind.peft_task_type)
    elif cfg.unfrozen_parameters:
        freeze_all_but(model, cfg.unfrozen_parameters)
    if cfg.freeze_mm_modules:
        freeze_vision_modules(cfg, model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    embeddings_trained = any(parameter.requires_grad and embedding_name in name  # (peft prefixes the names)
                             for name, parameter in model.named_parameters())
    chunked = loss_meets_head_in_chunks(cfg, model)
    head = output_head(model)[1] if chunked else None
    decoder_layers = llama_decoder_layers(model, getattr(sizes, "num_hidden_layers", 0) or 0)
    return ModelFacts(config, parameters, trainable, max_positions, learned, chunked,
                      count_matmul_weights(model), grown_rows=max(grown, 0),
                      head_weights=(head.numel(), head.requires_grad) if head is not None else (0, False),
                      embedding_rows=len(tokenizer) - grown if tokenizer is not None else 0,
                      embeddings_trained=embeddings_trained,
                      matmul_only_trained=sum(p.numel() for p in matmul_only_weights(model, cfg)),
                      matmul_only_frozen=sum(p.numel() for p in matmul_only_weights(model, cfg, trained=False)),
                      hidden_matrices_trained=hidden_matrices_trained(model),
                      module_classes=classes, layer_classes=layer_classes, quantizable=quantizable, experts=experts,
                      vision=_vision_weights(cfg, kind, model, config, tokenizer), decoder_layers=decoder_layers)


def _vision_weights(cfg: TuneloopConfig, kind: ModelKind, model, config, tokenizer=None):
    """A vision-language model's image side, stage by stage, for the plan's FLOPs (plan/flops.py), with the run's
    image processor where the tokenizer carries it (Gemma 4's tower runs as many positions as it says)."""
    if kind != VISION_LANGUAGE:
        return None
    from tuneloop.data.images import image_inputs_of, vision_family
    from tuneloop.plan.flops import vision_weights

    images = image_inputs_of(tokenizer)
    return vision_weights(model, config, vision_family(config, cfg.base_model or cfg.base_model_config),
                          images.image_processor if images is not None else None)


def hidden_matrices_trained(model) -> int:
    from tuneloop.muon import is_hidden_matrix

    return sum(p.numel() for name, p in model.named_parameters() if p.requires_grad and is_hidden_matrix(name, p))


def quantizable_linears(cfg: TuneloopConfig, model) -> tuple[int, int, int]:
    """(weights, output rows, layers) of the layers bitsandbytes quantizes when loading, by transformers' own rule:
    every Linear (and GPT-2's Conv1D) but those its skip patterns match — `llm_int8_skip_modules` when given (it
    replaces the default), else the output head and tied weights."""
    import torch
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    skip = (cfg.bnb_config_kwargs or {}).get("llm_int8_skip_modules")
    patterns = list(skip) if skip is not None else get_keys_to_not_convert(model)
    weights = rows = layers = 0
    for name, module in model.named_modules():
        conv1d = type(module).__name__ == "Conv1D"
        if (isinstance(module, torch.nn.Linear) or conv1d) and should_convert_module(name, patterns):
            weights += module.weight.numel()
            rows += module.weight.shape[1] if conv1d else module.out_features
            layers += 1
    return weights, rows, layers


def count_matmul_weights(model) -> tuple[int, int]:
    """(frozen, trained) weights of the matrices tokens are multiplied by: every Linear (an adapter's too, and
    a tied output head once) and GPT-2's Conv1D; embeddings are looked up, not multiplied (plan/flops.py)."""
    import torch

    frozen = trained = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if weight is None or not (isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"):
            continue
        if weight.requires_grad:
            trained += weight.numel()
        else:
            frozen += weight.numel()
    return frozen, trained


def check_sequence_len(cfg: TuneloopConfig, facts: ModelFacts) -> str | None:
    """A refusal when rows longer than the model's position table would crash mid-training; a warning (returned)
    when only the trained context length is exceeded (rotary positions extrapolate, often badly)."""
    limit = facts.max_positions
    if limit is None or cfg.sequence_len <= limit:
        return None
    if facts.learned_positions:
        raise UserError(f"config: `sequence_len: {cfg.sequence_len}` is longer than the {limit} positions this model "
                        f"has ({cfg.base_model or cfg.base_model_config}: a learned position table); set sequence_len "
                        f"to {limit} or less")
    return (f"sequence_len={cfg.sequence_len} is above the model's max_position_embeddings={limit}: positions past "
            f"{limit} were never trained; quality may drop on rows that long.")


def enable_checkpointing(cfg: TuneloopConfig, model, checkpointing: bool | str) -> None:
    """Activation checkpointing (recompute each layer in the backward), non-reentrant unless the config's
    gradient_checkpointing_kwargs say otherwise; `checkpointing` (resolved.gradient_checkpointing) "offload" keeps
    the checkpoints in CPU memory."""
    from tuneloop.adapters import checkpointing_kwargs

    import torch

    # on a CPU the checkpoints are in CPU memory already (and pinned copies need an accelerator)
    offload = checkpointing == "offload" and torch.cuda.is_available()
    if hasattr(model, "activation_checkpointing_enable"):  # transformers ≥ 5.24's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing_kwargs(cfg),
                                              offload=offload)
    elif offload:
        raise UserError("config: `gradient_checkpointing: offload` needs transformers 5.24 or later; set it to true")
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs(cfg))


GROWN_ROWS_SEED = 0  # new tokens' embedding rows are drawn with this seed, wherever a base model is grown


def grow_embeddings(model, vocabulary: int) -> None:
    """The embeddings grown to `vocabulary` rows. transformers draws the new rows at random (around the old rows'
    mean); drawn from a fixed seed, the same base grows the same rows in `train`, in a preference run's
    reference, in `eval` and in `infer`, whatever the process drew before."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(GROWN_ROWS_SEED)
        # (on the meta device there are no values to average: the rows come from rank 0 with the rest)
        model.resize_token_embeddings(vocabulary, mean_resizing=model.device.type != "meta")


def weights_dtype(cfg: TuneloopConfig):
    """fp32 weights (mixed precision computes in bf16 where asked), or bf16/fp16 weights where the config says
    `bfloat16`/`float16` (axolotl's keys: no fp32 copy at all). A LoRA adapter stays fp32 either way (peft)."""
    import torch

    return torch.bfloat16 if cfg.bfloat16 else torch.float16 if cfg.float16 else torch.float32


class QuantizedBase(NamedTuple):
    """How a QLoRA / 8-bit run loaded its base, so that eval, infer, merge-lora and export load it the same way."""

    bnb_config: Any  # transformers' BitsAndBytesConfig
    dtype: Any  # the dtype the weights were loaded in (and quantized from)
    experts: bool = False  # `quantize_moe_experts`: the expert weights quantized after loading (quant/quantized_experts.py)

    def quantize_experts(self, model) -> None:
        """The expert weights of a loaded base (its adapter attached or not) quantized as the run quantized them."""
        if self.experts:
            from tuneloop.quant.quantized_experts import quantize_experts, remove_lora_proxies_after_each_forward

            quantize_experts(model, self.bnb_config)
            remove_lora_proxies_after_each_forward(model)


def quantized_base(cfg) -> QuantizedBase | None:
    from tuneloop.adapters import quantization_config
    from tuneloop.host.hardware import quantized_loading

    kind = quantized_loading(cfg)
    if not kind:
        return None
    return QuantizedBase(quantization_config(cfg, kind), weights_dtype(cfg), bool(cfg.quantize_moe_experts))


def load_model(cfg: TuneloopConfig, resolved, tokenizer, checkpoint=None, on_meta: bool = False):
    """The model to train (of the run's kind, with its attention kernel: resolved.py); from a checkpoint's weights
    when resuming (the adapter's, for LoRA). `on_meta`: built without weights on the meta device, adapter and all,
    for an engine that sends this rank its weights when it starts (engines/fsdp2.py)."""
    from safetensors import SafetensorError

    from tuneloop.adapters import quantization_config
    from tuneloop.host.hardware import quantized_loading
    from tuneloop.quant.mxfp4 import dequantizes_mxfp4, mxfp4_loading_config

    from tuneloop.kernels.packed_attention import loadable

    config = model_config(cfg, tokenizer)
    built = model_class(cfg, resolved.model_kind)
    attention = loadable(resolved.attention.used)
    if resolved.engine.mesh_keys.cp:  # the kernel behind context parallel's exchange (engines/context_parallel.py)
        from tuneloop.engines import context_parallel

        attention = context_parallel.loadable(attention)
    if on_meta:
        import torch

        with torch.device("meta"):
            return _prepared_for_training(cfg, resolved, built_from_config(cfg, built, config, attention),
                                          tokenizer, False, None)
    if cfg.from_scratch and checkpoint is None:
        return _prepared_for_training(cfg, resolved, built_from_config(cfg, built, config, attention),
                                      tokenizer, False, checkpoint)
    if checkpoint is not None and not cfg.adapter:  # the checkpoint's whole weights (an adapter's sit on the base)
        source, options = str(checkpoint), {}
    else:
        source, options = _checked_source(cfg.base_model, "base_model"), {**_revision(cfg), "config": config}
    quantized = quantized_loading(cfg)
    if quantized:
        options["quantization_config"] = quantization_config(cfg, quantized)
    # gpt-oss's MXFP4 experts unpacked as they load (quant/mxfp4.py); a full checkpoint of the run holds them unpacked
    if "config" in options and dequantizes_mxfp4(cfg, config):
        options["quantization_config"] = mxfp4_loading_config(cfg)
    try:
        model = built.from_pretrained(source, dtype=weights_dtype(cfg), trust_remote_code=cfg.trust_remote_code,
                                      attn_implementation=attention, **options)
    except (OSError, ValueError, SafetensorError) as error:  # missing, unreadable or damaged weights
        raise UserError(f"model: cannot load {source!r}: {type(error).__name__}: {error}") from None
    if cfg.quantize_moe_experts:  # before peft's preparation, which would upcast 16-bit experts to fp32 first
        from tuneloop.quant.quantized_experts import quantize_experts_as_asked

        quantize_experts_as_asked(model, options["quantization_config"], source)
    return _prepared_for_training(cfg, resolved, model, tokenizer, quantized, checkpoint)


def built_from_config(cfg: TuneloopConfig, built, config, attention: str | None):
    """Random weights from the config (training from scratch), drawn from the run's seed."""
    import torch

    options = {"dtype": weights_dtype(cfg), "attn_implementation": attention}
    try:
        if hasattr(built, "from_config"):  # an Auto class
            return built.from_config(config, trust_remote_code=cfg.trust_remote_code, **options)
        return built._from_config(config, dtype=options["dtype"], attn_implementation=attention)
    except (ValueError, TypeError, torch.OutOfMemoryError) as error:
        raise UserError(f"model: cannot build a {config.model_type} model from its config: {error}") from None


def _prepared_for_training(cfg: TuneloopConfig, resolved, model, tokenizer, quantized, checkpoint):
    """The loaded or built model made ready: cache off, embeddings grown to the tokenizer, checkpointing (the
    run's: resolved.gradient_checkpointing), the adapter or the frozen parameters."""
    from tuneloop.kernels import rms_norm, swiglu
    from tuneloop.adapters import add_adapter, freeze_all_but, prepare_quantized

    # A cache in training defeats the packed-sequence mask (STACK-NOTES trap 1) and wastes memory.
    model.config.use_cache = False
    rms_norm.use_in(model)  # LLaMA-formula norms: the same forward, a leaner backward
    swiglu.use_in(model)  # LLaMA-formula MLPs: the same values, SiLU's output made again in the backward
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        grow_embeddings(model, len(tokenizer))
    checkpointing = resolved.gradient_checkpointing
    if quantized:
        model = prepare_quantized(cfg, model, checkpointing)  # (peft's preparation checkpoints in place)
    if checkpointing == "offload" or (checkpointing and not quantized):
        enable_checkpointing(cfg, model, checkpointing)
    if cfg.adapter:
        return add_adapter(cfg, model, resolved.model_kind.peft_task_type, checkpoint, checkpointing)
    if cfg.unfrozen_parameters:
        freeze_all_but(model, cfg.unfrozen_parameters)
    if cfg.freeze_mm_modules:
        freeze_vision_modules(cfg, model)
    if checkpointing and (cfg.unfrozen_parameters or cfg.freeze_mm_modules):
        from tuneloop.adapters import require_input_grads_where_trained

        require_input_grads_where_trained(model)  # (re-entrant checkpointing's hooks: a frozen tower builds no graph)
    return model
