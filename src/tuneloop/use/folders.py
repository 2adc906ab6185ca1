"""Model folders as the `use` commands meet them: a full model (config.json and weights) or a LoRA adapter
(adapter_config.json, its base model named inside), loaded for inference or evaluation."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tuneloop.errors import UserError
from tuneloop.run_files import ADAPTER_CONFIG, WEIGHT_PATTERNS


@dataclass(frozen=True)
class ModelFolder:
    path: Path
    base: str | None = None  # an adapter's base model (a local folder or a hub name); None: a full model

    @property
    def is_adapter(self) -> bool:
        return self.base is not None


def find_model_folder(path: str | Path, flag: str, base: str | None = None, no_model_hint: str = "") -> ModelFolder:
    """The folder `flag` names, as a full model or an adapter whose base is `base` if given, else the one its
    adapter_config.json names. `no_model_hint` ends the message when the folder holds neither."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise UserError(f"{flag}: {folder} is not a folder{no_model_hint}")
    if (folder / ADAPTER_CONFIG).is_file():
        return ModelFolder(folder, base or adapter_base(folder))
    if (folder / "config.json").is_file() and any(any(folder.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        return ModelFolder(folder)
    raise UserError(f"{flag}: {folder} holds no model: neither config.json with weights (a full model) nor "
                    f"{ADAPTER_CONFIG} (a LoRA adapter){no_model_hint}")


def adapter_base(folder: Path) -> str:
    """The base model the adapter was trained on, as its adapter_config.json names it (tuneloop writes the
    base_model path of the run there)."""
    try:
        base = json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError) as error:
        raise UserError(f"model: cannot read {folder / ADAPTER_CONFIG}: {error}") from None
    if not base:
        raise UserError(f"model: {folder / ADAPTER_CONFIG} names no base model (base_model_name_or_path); "
                        "give it with --base DIR")
    return base


def check_base_reachable(folder: ModelFolder) -> None:
    """A local base that moved or was deleted since training: said before anything is loaded (huggingface_hub would
    take the path for a hub name it refuses: "Repo id must be in the form...")."""
    base = folder.base
    if base and not Path(base).expanduser().is_dir() and not _could_be_hub_name(base):
        raise UserError(f"model: {base}, the base model of the adapter in {folder.path}, is not there (moved or "
                        "deleted?); give the base model's folder with --base DIR")


def _could_be_hub_name(name: str) -> bool:
    """`name` reads as a hub repository (`org/model`, `model`); a path with more to it (`/data/base`, `./base`,
    `runs/a/base`) does not."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.startswith(("/", ".", "~")):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def load_tokenizer_of(folder: ModelFolder):
    """The tokenizer saved with the model (a tuneloop run saves the run's tokenizer and chat template next to
    the weights or the adapter), else the base model's."""
    from transformers import AutoTokenizer

    from tuneloop.data.mistral_chat import load_mistral_common_tokenizer, saved_with_mistral_common

    sources = [folder.path] + ([folder.base] if folder.is_adapter else [])
    if (folder.path / "tuneloop_state.json").is_file():  # a checkpoint of a run before checkpoints kept a tokenizer:
        sources.insert(1, folder.path.parent)  # the run's own, in its output_dir
    for source in sources:
        if saved_with_mistral_common(source):  # a run with `tokenizer_use_mistral_common` saved its tekken.json
            return load_mistral_common_tokenizer(str(source), "--model")
        try:
            # (with mistral-common installed, AutoTokenizer would pick it for a folder that also holds tekken.json)
            tokenizer = AutoTokenizer.from_pretrained(source, mistral_format=False)
        except Exception as error:  # (tokenizers raises its bare Exception, a KeyError, a TypeError of many lines)
            if not holds_tokenizer_files(source):
                continue  # (nothing saved here: the next source's)
            # a tokenizer saved here that does not load is said, not passed over for another folder's (the run's
            # own may have tokens the base's lacks)
            first = (str(error).splitlines() or [""])[0]
            raise UserError(f"model: cannot load the tokenizer saved in {source}: {type(error).__name__}: {first} "
                            "(its tokenizer.json or tokenizer_config.json is damaged or from a newer library: copy "
                            "them again from the model it was saved from)") from None
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token  # padded positions are masked: any id will do
        return tokenizer
    raise UserError(f"model: no tokenizer in {folder.path}" + (f" nor in {folder.base}" if folder.is_adapter else ""))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def holds_tokenizer_files(source) -> bool:
    folder = Path(source).expanduser()
    return folder.is_dir() and any((folder / name).is_file() for name in TOKENIZER_FILES)


def load_model_from(folder: ModelFolder, dtype, *, attn_implementation: str | None = None, model_class=None,
                    base_config=None, trust_remote_code: bool = False, vocabulary: int | None = None,
                    quantization=None):
    """The model of a full folder, or the adapter on its base (not merged). `vocabulary`: the tokenizer's
    length; a base with fewer embedding rows is grown first, as the run grew it before training the adapter.
    `quantization`: a bitsandbytes config the base is loaded with (a QLoRA run's adapter sits on 4-bit weights)."""
    from safetensors import SafetensorError
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # a loading bar per file would mix into the output
    loader = model_class or loader_of(folder, base_config, trust_remote_code)
    options = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    if attn_implementation:
        from tuneloop.kernels.packed_attention import loadable

        options["attn_implementation"] = loadable(attn_implementation)
    if quantization is not None:
        options["quantization_config"] = quantization
    if not folder.is_adapter:
        try:
            return loader.from_pretrained(folder.path, **options)
        except (OSError, ValueError, SafetensorError) as error:
            raise UserError(f"model: cannot load {folder.path}: {type(error).__name__}: {error}") from None
    check_base_reachable(folder)
    if base_config is not None:
        options["config"] = base_config
    try:
        base = loader.from_pretrained(folder.base, **options)
    except (OSError, ValueError, SafetensorError) as error:
        raise UserError(f"model: cannot load {folder.base}, the base model of the adapter in {folder.path} "
                        f"({type(error).__name__}: {error}); give the base model's folder with --base DIR") from None
    if vocabulary and vocabulary > base.get_input_embeddings().weight.shape[0]:
        from tuneloop.model.load import grow_embeddings

        grow_embeddings(base, vocabulary)  # the rows the run grew (a fixed seed)
    return attach_adapter(base, folder.path)


def loader_of(folder: ModelFolder, base_config=None, trust_remote_code: bool = False):
    """The Auto class for the folder's model (or its base's): AutoModelForSeq2SeqLM for an encoder-decoder (T5),
    AutoModelForCausalLM otherwise."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tuneloop.model.kinds import loader_for_config

    config = base_config
    if config is None:
        try:
            config = AutoConfig.from_pretrained(folder.base if folder.is_adapter else folder.path,
                                                trust_remote_code=trust_remote_code)
        except (OSError, ValueError):
            return AutoModelForCausalLM  # the loader's own error will name what is missing
    return loader_for_config(config)


def attach_adapter(base, adapter_dir: Path):
    import warnings

    from peft import PeftModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft's own deprecation notices, not the user's concern
        try:
            return PeftModel.from_pretrained(base, str(adapter_dir))
        except (OSError, ValueError, RuntimeError) as error:  # a damaged adapter, or one for another base
            raise UserError(f"model: cannot load the adapter in {adapter_dir} on its base: "
                            f"{type(error).__name__}: {error}") from None
