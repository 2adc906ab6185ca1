"""Reward functions, found as axolotl finds them and called as TRL calls them.

`trl.reward_funcs` lists dotted names (`rewards.correct`: the function `correct` of the module `rewards`), looked
up in the config's folder (users keep the file next to the YAML), the working directory and the Python path, in
that order; or a local folder holding a sequence-classification model (`num_labels: 1`), whose score of the
prompt and completion together is the reward. A folder that is no such model (a chat model's: transformers would give
it a newly initialised, random score head) is refused by its config.json when the config is checked, and by
transformers' load report (weights missing) when it is loaded. A dataset transform (`type: rewards.prepare`) is found the same way
(prompts.py).

A function is called once per step on this rank's completions: `f(prompts=..., completions=...,
completion_ids=..., trainer_state=..., **the rows' other columns)` (trainer_state: TrainerProgress, the
global_step/max_steps/epoch of TRL's) -> one float per completion, or None where it does not apply
(TRL's convention; a completion no function scores trains with advantage 0). What it raises or returns wrongly
stops the run with exit 2, naming the function, the row and the value, before any weight of that step changes; so
does a function without **kwargs that would be passed a column it does not take.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tuneloop.errors import UserError


def search_path(config_dir: Path | None) -> list[str]:
    """Where a dotted name is looked for, before the Python path: the config's folder, then the working directory."""
    folders = [str(config_dir.resolve())] if config_dir is not None else []
    folders.append(str(Path.cwd().resolve()))
    return list(dict.fromkeys(folders))


def import_dotted(name: str, key: str, config_dir: Path | None) -> Callable:
    """The object `module.attribute` names. A name that does not import is a UserError with the import error's
    first line and the folders searched."""
    module_name, _, attribute = name.rpartition(".")
    if not module_name:
        raise UserError(f"config: `{key}: {name}` is not a dotted name (module.function); write e.g. "
                        f"`rewards.{name}` for the function `{name}` in rewards.py beside the config")
    folders = search_path(config_dir)
    for folder in reversed(folders):  # first on the path wins: the config's folder
        if folder in sys.path:
            sys.path.remove(folder)
        sys.path.insert(0, folder)
    _forget_a_module_shadowed_by(module_name.split(".")[0], folders)
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # the user's module failed to import: its own first line says why
        first = (str(error).splitlines() or [""])[0]
        raise UserError(f"config: `{key}: {name}` does not import: {type(error).__name__}: {first} (searched "
                        f"{', '.join(folders)} and the Python path)") from None
    found = getattr(module, attribute, None)
    if found is None:
        raise UserError(f"config: `{key}: {name}`: {getattr(module, '__file__', module_name)} has no `{attribute}`"
                        f"{_nearest_words(module, module_name, attribute)}")
    if not callable(found):
        raise UserError(f"config: `{key}: {name}` is a {type(found).__name__}, not a function")
    return found


def _nearest_words(module, module_name: str, attribute: str) -> str:
    """A misspelt name's likely meaning, and the module's own functions (what the name could be)."""
    own = [name for name, value in vars(module).items() if inspect.isfunction(value) and not name.startswith("_")
           and value.__module__ == module.__name__]
    if not own:
        return ""
    nearest = difflib.get_close_matches(attribute, own, n=1)
    guess = f"; did you mean `{module_name}.{nearest[0]}`?" if nearest else ""
    return f"{guess} (its functions: {', '.join(own)})"


def reward_name(name: str) -> str:
    """A reward's short name: a function's own name, or a reward model's folder."""
    folder = Path(name).expanduser()
    return folder.name if folder.is_dir() else name.rpartition(".")[2]


def reward_names(names: list[str]) -> list[str]:
    """Each reward's name on the train line (`rewards/<name>`), in trackers and in completions.jsonl: its short name,
    or, where two rewards share it (`format_a.score` and `format_b.score`), the name as the config writes it, so
    neither hides the other."""
    short = [reward_name(name) for name in names]
    return [name if short.count(brief) > 1 else brief for name, brief in zip(names, short)]


def online_reward_names(cfg) -> list[str]:
    """The run's rewards by name, in the order of its rewards table (and `trl.reward_weights`): EBFT's feature
    matching first (`rl: ebft`), then `trl.reward_funcs`."""
    from tuneloop.online_rl.feature_matching import REWARD_NAME
    from tuneloop.rl_methods import matches_features

    own = [REWARD_NAME] if matches_features(cfg) else []
    return reward_names(own + list(cfg.trl_settings.reward_funcs or []))


def _forget_a_module_shadowed_by(top: str, folders: list[str]) -> None:
    """A module of that name imported earlier in this process (a notebook's previous run, from another folder)
    gives way to the one the search finds first."""
    for folder in folders:
        if (Path(folder) / f"{top}.py").is_file() or (Path(folder) / top / "__init__.py").is_file():
            cached = sys.modules.get(top)
            if cached is not None and not str(getattr(cached, "__file__", "") or "").startswith(folder + "/"):
                for name in [name for name in sys.modules if name == top or name.startswith(top + ".")]:
                    del sys.modules[name]
            return


@dataclass
class RewardFunction:
    name: str  # as the config writes it (the train line's `rewards/<name>`)
    call: Callable  # (prompts, completions, completion_ids, columns) -> list of float or None
    takes: frozenset | None = None  # the keyword names it accepts; None: any (**kwargs, a model, a builtin)


def load_reward_functions(names: list[str], config_dir: Path | None, device=None) -> list[RewardFunction]:
    functions = []
    for index, (name, shown) in enumerate(zip(names, reward_names(names))):
        key = f"trl.reward_funcs[{index}]"
        folder = Path(name).expanduser()
        if folder.is_dir() and (folder / "config.json").is_file():
            check_reward_model_folder(folder, key)
            functions.append(RewardFunction(shown, RewardModel(folder, device)))
            continue
        function = import_dotted(name, key, config_dir)
        _check_signature(function, name, key)
        functions.append(RewardFunction(shown, _called_as_trl(function), _keywords_taken(function)))
    return functions


def check_reward_functions(cfg) -> None:
    """Every dotted reward name imports and takes TRL's arguments, and every reward model's folder holds a
    sequence classifier with one label (by its config.json: its weights are loaded at train)."""
    for index, name in enumerate(cfg.trl_settings.reward_funcs or []):
        folder = Path(name).expanduser()
        key = f"trl.reward_funcs[{index}]"
        if folder.is_dir() and (folder / "config.json").is_file():
            check_reward_model_folder(folder, key)
        else:
            _check_signature(import_dotted(name, key, cfg._config_dir), name, key)


def check_reward_model_folder(folder: Path, key: str) -> None:
    """A reward model is a sequence classifier with one label, as its config.json says (`architectures`: a
    ...ForSequenceClassification; `id2label`, else `num_labels`, else transformers' default of 2: one label).
    Anything else loaded as one gets a newly initialised score head (a chat model) or is scored by a logit that is
    no reward (a classifier of several labels), and the run would train on that silently."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise UserError(f"config: `{key}: {folder}`: its config.json does not read ({error}); a reward model's "
                        "folder is a transformers sequence classifier saved with save_pretrained") from None
    architectures = config.get("architectures") or []
    labels = len(config["id2label"]) if isinstance(config.get("id2label"), dict) else config.get("num_labels", 2)
    classifier = any(str(name).endswith("ForSequenceClassification") for name in architectures)
    if architectures and not classifier:
        named = ", ".join(map(str, architectures))
        what = " (a language model)" if any(str(name).endswith("ForCausalLM") for name in architectures) else ""
        raise UserError(f"config: `{key}: {folder}`: its config.json's `architectures` says {named}{what}, not a "
                        "sequence classifier with one label (...ForSequenceClassification, `num_labels: 1`): loaded "
                        "as one its score head would be newly initialised and the rewards random; give a trained "
                        "reward model's folder, or a reward function (module.function)")
    if labels != 1:
        raise UserError(f"config: `{key}: {folder}`: its config.json gives {labels} labels, and a reward model has "
                        "one (`num_labels: 1`, TRL's): the first of several logits is no reward; give a reward "
                        "model's folder, or wrap this classifier in a reward function that turns its logits into "
                        "one score")


def _check_signature(function: Callable, name: str, key: str) -> None:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return  # a builtin or C function: called and judged by what it returns
    takes_any = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters)
    if not takes_any and not {"prompts", "completions"} & {p.name for p in parameters}:
        raise UserError(f"config: `{key}: {name}` takes ({', '.join(p.name for p in parameters)}); a reward function "
                        "takes `prompts` and `completions` (and the rows' columns by name, or **kwargs), as TRL's")


@dataclass(frozen=True)
class TrainerProgress:
    """What TRL's `trainer_state` tells a reward function of the run (a curriculum reads global_step): the
    optimizer steps done before this generation's first, the run's steps, and the epochs done."""

    global_step: int
    max_steps: int
    epoch: float


def _keywords_taken(function: Callable) -> frozenset | None:
    """The keyword names a function accepts, or None where it takes any (**kwargs) or has no signature to read."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return frozenset(p.name for p in parameters if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                               inspect.Parameter.KEYWORD_ONLY))


def _check_keywords(function: RewardFunction, columns: dict) -> None:
    """TRL passes a reward function the dataset's every column by name (besides its own arguments): one that takes
    neither that column nor **kwargs would fail with Python's TypeError, which says nothing of why it was passed."""
    if function.takes is None:
        return
    unknown = [name for name in ("prompts", "completions", "completion_ids", "trainer_state", *columns)
               if name not in function.takes]
    if not unknown:
        return
    named = ", ".join(f"the dataset column `{name}`" if name in columns else f"TRL's argument `{name}`"
                      for name in unknown)
    raise UserError(f"reward `{function.name}` does not take {named}: add **kwargs to its parameters (TRL passes "
                    "every column by name, and its own prompts, completions, completion_ids and trainer_state), "
                    f"e.g. `def {function.name.rpartition('.')[2]}(prompts, completions, **kwargs)`")


def _called_as_trl(function: Callable) -> Callable:
    def call(prompts, completions, completion_ids, columns: dict, progress: TrainerProgress | None = None):
        return function(prompts=prompts, completions=completions, completion_ids=completion_ids,
                        trainer_state=progress, **columns)
    return call


class RewardModel:
    """A sequence-classification model's score (its first logit) of prompt + completion, as one text (a chat
    through the model's own template when the prompt is a list of messages)."""

    def __init__(self, folder: Path, device):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        model, report = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32,
                                                                           output_loading_info=True)
        missing = sorted(report.get("missing_keys") or [])
        if missing:  # (transformers initialised them at random: the scores would be noise, and trained on)
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            raise UserError(f"config: `trl.reward_funcs`: {folder}: its weights hold no {shown}, which transformers "
                            "would initialise at random (the rewards would be random): it is not a trained reward "
                            "model; give a sequence classifier trained with one label (`num_labels: 1`)")
        self.model = model.eval()
        if device is not None:
            self.model.to(device)

    def __call__(self, prompts, completions, completion_ids, columns: dict, progress=None):
        import torch

        if prompts and isinstance(prompts[0], list):
            texts = [self.tokenizer.apply_chat_template(prompt + completion, tokenize=False)
                     for prompt, completion in zip(prompts, completions)]
        else:
            texts = [prompt + completion for prompt, completion in zip(prompts, completions)]
        encoded = self.tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            logits = self.model(**encoded.to(self.model.device)).logits
        return logits[:, 0].float().tolist()


def checked_rewards(function: RewardFunction, returned, count: int, where: list[str]) -> list[float]:
    """What a function returned, as floats (NaN for None); a wrong length or a non-number is a UserError."""
    if isinstance(returned, (str, bytes)) or not hasattr(returned, "__len__"):
        raise UserError(f"reward `{function.name}` returned {_short(returned)} for {count} completions; it must "
                        "return a list with one float (or None) per completion")
    values = list(returned.tolist() if hasattr(returned, "tolist") else returned)
    if len(values) != count:
        raise UserError(f"reward `{function.name}` returned {len(values)} values for {count} completions (rows "
                        f"{where[0]} … {where[-1]}); it must return one per completion")
    checked = []
    for index, value in enumerate(values):
        if value is None:
            checked.append(math.nan)
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = None
        if number is None or not math.isfinite(number):  # (NaN too: it would train nothing and say "done")
            raise UserError(f"reward `{function.name}` returned {_short(value)} for the completion of {where[index]}; "
                            "a reward is a finite number (or None: not scored)")
        checked.append(number)
    return checked


def score(functions: list[RewardFunction], prompts: list, completions: list, completion_ids: list,
          columns: dict, where: list[str], progress: TrainerProgress | None = None) -> list[list[float]]:
    """[completion][function] rewards (NaN: None). A function that raises is a UserError naming it and the rows."""
    table = [[math.nan] * len(functions) for _ in completions]
    for column, function in enumerate(functions):
        _check_keywords(function, columns)
        try:
            returned = function.call(prompts, completions, completion_ids, columns, progress)
        except Exception as error:  # the user's code: what it raised, where, in one line
            first = (str(error).splitlines() or [""])[0]
            raise UserError(f"reward `{function.name}` raised {type(error).__name__}: {first} (scoring the "
                            f"completions of rows {where[0]} … {where[-1]})") from None
        for row, value in enumerate(checked_rewards(function, returned, len(completions), where)):
            table[row][column] = value
    return table


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
