"""The run's tokenizer: trained on the data, `tokenizer_config`'s or the model's, its added tokens and pad token,
and the run's chat template given to it."""

from __future__ import annotations

from pathlib import Path

from tuneloop.config import TuneloopConfig
from tuneloop.data.chat_templates import TOKENIZER_DEFAULT, resolve_template
from tuneloop.errors import UserError
from tuneloop.model.model_config import checked_source, revision_options

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
    source = checked_source(cfg.tokenizer_config or cfg.base_model or cfg.base_model_config, key)
    if cfg.tokenizer_use_mistral_common:
        from tuneloop.data.mistral_chat import load_mistral_common_tokenizer

        return load_mistral_common_tokenizer(source, key, revision_options(cfg, key))
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
                                                    **revision_options(cfg, key), **only_transformers)
    except Exception as error:  # (tokenizers raises bare Exceptions for a tokenizer.json it cannot read)
        raise UserError(f"model: cannot load a tokenizer from `{key}: {source}`"
                        f"{f' as {cfg.tokenizer_type}' if cfg.tokenizer_type else ''}: {first_line_of(error)}") from None
    if not getattr(tokenizer, "is_fast", False):
        raise UserError(f"model: the tokenizer of {source!r} is not a fast tokenizer; tuneloop needs character "
                        "offsets to mask prompts exactly")
    return _with_added_tokens(cfg, tokenizer)

def first_line_of(error: Exception) -> str:
    """The error's type and first line: a tokenizer's errors run on over many lines (tokenizers lists every variant
    it tried), and the first says what failed."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")


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
