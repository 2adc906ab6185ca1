"""From a YAML file (and `--set key=value` overrides) to a validated config, every problem reported at once.

Reading goes: YAML → overrides → blank values dropped (`key:` with nothing after it means "not set", as in
axolotl) → axolotl's keys triaged (config/axolotl.py: implemented, warned about, ignored or refused) → each
field checked (config/schema.py) → the cross-key rules (config/rules.py). The problems of every step are
collected and raised as one UserError, one line each.
"""

from __future__ import annotations

import difflib
import os
import warnings
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from tuneloop.config import axolotl
from tuneloop.config.datasets import DATASET_FORM, PRETRAINING_FORM, CustomFormat, DatasetConfig, PreferenceFormat
from tuneloop.config.rules import problems_of
from tuneloop.rl_methods import ONLINE_METHODS
from tuneloop.config.schema import TuneloopConfig
from tuneloop.errors import UserError

TOP_LEVEL_KEYS = set(TuneloopConfig.model_fields)
DATASET_KEYS = set(DatasetConfig.model_fields)
CUSTOM_FORMAT_KEYS = set(CustomFormat.model_fields) | set(PreferenceFormat.model_fields)
# axolotl's other names for keys tuneloop implements (its remapped and deprecated spellings)
ALIASES = {"type_of_model": "model_type", "model_revision": "revision_of_model",
           "dataset_num_proc": "dataset_processes", "model_config": "overrides_of_model_config",
           "evaluation_strategy": "eval_strategy"}
AXOLOTL_TOP_LEVEL = set(axolotl.SPEED_OR_LOGGING) | axolotl.LAUNCHER | set(axolotl.REFUSED) | axolotl.REMOVED


def _is_empty(value: Any) -> bool:
    return value is None or value is False or value == "" or value == [] or value == {}


def without_blanks(value: Any) -> Any:
    """A blank YAML value (`key:` with nothing after it) means "not set", at every depth, as in axolotl."""
    if isinstance(value, dict):
        return {key: without_blanks(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [without_blanks(item) for item in value]
    return value


def _nearest(key: str, known: set[str]) -> str:
    match = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.5)
    return f" Did you mean `{match[0]}`?" if match else ""


def _triage_top_level(raw: dict, problems: list[str]) -> dict:
    """Keys tuneloop implements are kept (axolotl's aliases renamed); every other axolotl key is handled as
    config/axolotl.py classifies it."""
    kept = {}
    for key, value in raw.items():
        key = str(key)  # (a YAML key may read as a number)
        name = ALIASES.get(key, key)
        if name in TOP_LEVEL_KEYS:
            if name in kept:
                problems.append(f"`{key}` and `{name}` are the same setting: keep one of them")
            kept[name] = value
        elif key in axolotl.LAUNCHER:
            continue  # set by launchers (torchrun gives each rank its own), not a training setting
        elif key in axolotl.SPEED_OR_LOGGING:
            if not _is_empty(value):
                warnings.warn(f"`{key}` is an axolotl key tuneloop does not implement; it only affects speed, memory "
                              "or logging, so it is ignored.", UserWarning, stacklevel=3)
        elif key in axolotl.REFUSED or key in axolotl.REMOVED:
            if not _is_empty(value):
                problems.append(axolotl.refusal(key, value))
        else:
            problems.append(f"unknown key `{key}`.{_nearest(key, TOP_LEVEL_KEYS | AXOLOTL_TOP_LEVEL | set(ALIASES))}")
    return kept


def _triage_dataset(entry: Any, where: str, problems: list[str]) -> Any:
    if not isinstance(entry, dict):
        return entry  # pydantic names the type error
    kept = {}
    for key, value in entry.items():
        key = str(key)
        if key in DATASET_KEYS:
            kept[key] = value
        elif key in axolotl.DATASET_REFUSED:
            if not _is_empty(value):
                problems.append(axolotl.refusal(key, value, where))
        else:
            known = DATASET_KEYS | set(axolotl.DATASET_REFUSED)
            problems.append(f"unknown key {where}`{key}`.{_nearest(key, known)}")
    if isinstance(kept.get("type"), dict):
        for key in kept["type"]:
            if key not in CUSTOM_FORMAT_KEYS:
                problems.append(f"unknown key {where}type.`{key}`.{_nearest(key, CUSTOM_FORMAT_KEYS)}")
    return kept


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=value` → (["a", "b"], value parsed as YAML)."""
    if "=" not in text:
        raise UserError(f"--set {text!r}: expected KEY=VALUE, e.g. --set learning_rate=1e-4")
    key, value = text.split("=", 1)
    try:
        parsed = yaml.safe_load(value) if value != "" else None
    except yaml.YAMLError as error:
        raise UserError(f"--set {text!r}: the value is not valid YAML ({error.problem})") from None
    return key.strip().split("."), parsed


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Each `a.b.0.c=value` set in place: a mapping's key (one not set, or blank, becomes a mapping to go into), a
    list's entry by its index. A path through a value that is neither is said with that value."""
    for text in overrides:
        path, value = parse_override(text)
        node: Any = raw
        for depth, part in enumerate(path):
            last, where = depth == len(path) - 1, ".".join(path[:depth])
            if isinstance(node, list):
                if not (part.isdigit() and int(part) < len(node)):
                    raise UserError(f"--set {text!r}: `{where}` is a list of {len(node)} "
                                    f"{'entry' if len(node) == 1 else 'entries'}, and `{part}` is not an index of it "
                                    f"(0 to {len(node) - 1})" if node else
                                    f"--set {text!r}: `{where}` is an empty list: set it whole (--set '{where}=[...]')")
                if last:
                    node[int(part)] = value
                else:
                    node = node[int(part)]
            elif isinstance(node, dict):
                if last:
                    node[part] = value
                else:
                    if node.get(part) is None:  # (a blank `key:` is not set: a mapping is made, as for a new key)
                        node[part] = {}
                    node = node[part]
            else:
                raise UserError(f"--set {text!r}: `{where}` is {_value_words(node)}, which has no `{part}`: set "
                                f"`{where}` itself (--set {where}=...)")
    return raw


def _value_words(value: Any) -> str:
    """A YAML scalar in words, with the value: "a string ('alpaca')"."""
    kind = ("true or false" if isinstance(value, bool) else "a string" if isinstance(value, str)
            else "a number" if isinstance(value, (int, float)) else f"a {type(value).__name__}")
    return f"{kind} ({value!r})"


def _validation_lines(error: ValidationError) -> list[str]:
    lines = []
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"] if not str(part).startswith(("function-", "literal["))
                       and part not in (PRETRAINING_FORM, DATASET_FORM))
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "missing":
            message = "is required"
        elif item["type"].startswith("literal_error"):
            message = f"got {item.get('input')!r}; {message.lower()}"
        elif "input" in item and item["type"] not in ("value_error",):
            message = f"got {item['input']!r}; {message}"
        lines.append(f"`{key}` {message}" if key else message)
    return lines


def _validated(kept: dict, problems: list[str]) -> TuneloopConfig | None:
    """The fields checked one by one. Where some are refused, the config of the others (the refused ones missing,
    so that no rule judges a value that is not there) still goes through the rules, for `check` to show every
    problem at once."""
    try:
        cfg, refused = TuneloopConfig.model_validate(kept), set()
    except ValidationError as error:
        problems += _validation_lines(error)
        refused = {str(item["loc"][0]) for item in error.errors() if item["loc"]}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (said by the first validation already)
                cfg = TuneloopConfig.model_validate({key: value for key, value in kept.items() if key not in refused})
        except ValidationError:  # (each field is checked alone, so this is not expected: the field errors stand)
            return None
        for name in refused:
            cfg.__dict__.pop(name, None)
    problems += problems_of(cfg, refused)
    return cfg


def config_from_dict(raw: Any, overrides: list[str] = ()) -> TuneloopConfig:
    if not isinstance(raw, dict):
        raise UserError("config: the YAML file must be a mapping of keys to values")
    raw = without_blanks(apply_overrides(dict(raw), list(overrides)))
    problems: list[str] = []
    kept = _triage_top_level(raw, problems)
    for list_key in ("datasets", "test_datasets"):
        if isinstance(kept.get(list_key), list):
            kept[list_key] = [_triage_dataset(entry, f"{list_key}[{i}].", problems)
                              for i, entry in enumerate(kept[list_key])]
    cfg = _validated(kept, problems)
    if problems:
        raise UserError("config: " + "\n  ".join(dict.fromkeys(problems)))
    return cfg


class _DuplicateKey(Exception):
    pass


class _KeysOnce(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that gives one key twice (the later would win in silence)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: the merged keys may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                raise _DuplicateKey(f"line {key_node.start_mark.line + 1}: a key must be a name, not "
                                    f"{key!r}") from None
            if key in seen:
                raise _DuplicateKey(f"`{key}` is given twice (lines {seen[key] + 1} and {key_node.start_mark.line + 1})"
                                    "; keep one of them")
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def read_yaml(path: Path):
    """The file's YAML; its problems said with file:line and the fix (tabs, non-UTF-8 bytes, a key twice). A UTF-8
    byte-order mark (Windows editors write one) is read as nothing, as YAML itself reads it."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[:error.start].count(b"\n") + 1
        raise UserError(f"config: {path}:{line}: byte 0x{data[error.start]:02x} is not UTF-8 (a comment written in "
                        "another encoding, say): save the file as UTF-8") from None
    try:
        return yaml.load(text, Loader=_KeysOnce)
    except _DuplicateKey as error:
        raise UserError(f"config: {path}: {error}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(error, "problem", None) or str(error)
        lines = text.splitlines()
        line = lines[mark.line] if mark is not None and mark.line < len(lines) else ""
        if "\t" in line[:len(line) - len(line.lstrip())] or "'\\t'" in problem:
            raise UserError(f"config: {where}: a tab where YAML takes spaces only (to indent, and after a `key:`): "
                            "replace the tabs with spaces") from None
        raise UserError(f"config: {where} is not valid YAML: {problem}") from None


def load_config(path: str | os.PathLike, overrides: list[str] = ()) -> TuneloopConfig:
    path = Path(path).expanduser()
    if path.is_dir():
        raise UserError(f"config: {path} is a folder, not a config file: {_yaml_files_in(path)}")
    if not path.is_file():
        raise UserError(f"config: no such file {path}")
    raw = read_yaml(path)
    raw = raw or {}
    if isinstance(raw, dict) and isinstance(raw.get("deepspeed"), str):  # a DeepSpeed file beside the config
        given, beside = Path(raw["deepspeed"]).expanduser(), path.parent / raw["deepspeed"]
        if not given.is_file() and not given.is_absolute() and beside.is_file():
            raw = dict(raw, deepspeed=str(beside.resolve()))
    cfg = config_from_dict(raw, overrides)
    cfg._config_dir = path.parent.resolve()
    if cfg.rl in ONLINE_METHODS:  # a reward function that does not import is said now, not at the first step
        from tuneloop.online_rl.rewards import check_reward_functions

        check_reward_functions(cfg)
    return cfg


def _yaml_files_in(folder: Path) -> str:
    """What to give instead of a folder: its one YAML file by name, else what it holds."""
    found = sorted(path.name for path in folder.iterdir() if path.suffix in (".yml", ".yaml") and path.is_file())
    if len(found) == 1:
        return f"give the file, {folder / found[0]} (the one .yml/.yaml file there)"
    if found:
        return f"give one of its {len(found)} YAML files ({', '.join(found[:5])}{', …' if len(found) > 5 else ''})"
    return "give the path of the run's .yml/.yaml file (this folder holds none)"


def load_run_config(path: str | os.PathLike, overrides: list[str] = ()) -> TuneloopConfig:
    """The config as a run uses it: validated, with the embedded aliases resolved to local paths."""
    from tuneloop.demo.embedded import resolve_aliases

    return resolve_aliases(load_config(path, overrides))
