"""Where a run's numbers go besides metrics.jsonl: TensorBoard, Weights & Biases, MLflow (axolotl's keys).

Each tracker is one registry entry: when the config asks for it, and how to start it. Its library is
imported only then (they are optional extras: `pip install 'tuneloop[trackers]'`). Trackers run on
the main process only. They are started before the first step, after the plan: a tracker that cannot
start (library missing, no credentials for an online run, an unusable tracking URI) is a UserError
then, not a crash an hour in. One that fails later is dropped with a warning; training goes on, and
metrics.jsonl still has every line.

What each receives: the plan's numbers and the config as run parameters; every train and eval line
under `train/...` and `eval/...` at its optimizer step; online RL's completions with `trl.log_completions` (a
TensorBoard text table, a wandb Table, an MLflow JSON artifact per generation); the summary at the end.

Secrets: a tracking URI's user and password are never printed (`redacted`); config keys that look like
credentials are never logged as parameters; API keys come from the libraries' own environment
variables or login files, which tuneloop neither reads nor prints.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tuneloop import run_files
from tuneloop.errors import UserError
from tuneloop.registry import Registry
from tuneloop.train.hooks import RunHooks

SECRET_NAMES = re.compile(r"key|token|secret|password|credential", re.IGNORECASE)


@dataclass(frozen=True)
class TrackerKind:
    wanted: Callable  # (cfg) -> bool
    start: Callable  # (cfg, output_dir, parameters) -> a started tracker: .log(values, step), .finish(), .where
    package: str  # what to pip install when its library is missing
    module: str  # the library `import`ed when it starts
    folder: str | None = None  # the shared folder it writes in, in output_dir (run_files.SHARED_FOLDERS)
    preflight: Callable | None = None  # (cfg) -> None: what its start would refuse, refused without starting it


TRACKERS: Registry[TrackerKind] = Registry("tracker", "use_tensorboard/use_wandb/use_mlflow")


CREDENTIALS_IN_URI = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")


def redacted(text: str) -> str:
    """The text with every URI's user:password@ replaced by ***@ (mlflow takes credentials inside its URI, and
    its errors quote the URI whole)."""
    return CREDENTIALS_IN_URI.sub(lambda match: f"{match['scheme']}***@", text)


def flat(values: dict, prefix: str = "") -> dict:
    """{"memory": {"weights_gb": 1}} -> {"memory/weights_gb": 1}; lists become their text (trackers keep scalars)."""
    out = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat(value, f"{name}/"))
        elif isinstance(value, (list, tuple)):
            out[name] = str(value)
        else:
            out[name] = value
    return out


COMPLETION_COLUMNS = ["prompt", "completion", "reward", "advantage"]


def _cell(value) -> str:
    """A prompt (a text, or its messages' contents) or a completion as one table cell."""
    if isinstance(value, list):
        value = " / ".join(str(message.get("content", "")) for message in value if isinstance(message, dict))
    return str(value).replace("|", "\\|").replace("\n", " ")


def run_parameters(cfg, plan) -> dict:
    """The plan's numbers and the config's keys, flat, credentials left out."""
    settings = {key: value for key, value in cfg.model_dump(mode="json").items()
                if value is not None and not SECRET_NAMES.search(key)}
    return {**flat(plan.to_json(), "plan/"), **flat(settings, "config/")}


def numbers_of(record: dict) -> tuple[int, dict]:
    """(step, {"train/loss": ...} or {"eval/loss": ...}): a metrics line as trackers name it."""
    is_eval = any(key.startswith("eval_") for key in record)
    group = "eval" if is_eval else "train"
    values = {}
    for key, value in record.items():
        if key == "step" or not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        name = key[len("eval_"):] if is_eval and key.startswith("eval_") else key
        values[f"{group}/{name}"] = value
    return record["step"], values


# ---- TensorBoard ---------------------------------------------------------------------------------
class TensorBoardTracker:
    def __init__(self, cfg, output_dir: Path, parameters: dict):
        from torch.utils.tensorboard import SummaryWriter
        import yaml

        self.where = str(output_dir / run_files.TENSORBOARD)
        self.writer = SummaryWriter(log_dir=self.where)  # a resumed run adds an event file beside the first
        self.writer.add_text("run parameters", "\n".join(f"    {key}: {value}" for key, value in parameters.items()))
        self.writer.add_text("config", "    " + yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
                             .replace("\n", "\n    "))

    def log(self, values: dict, step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def log_completions(self, records: list[dict], step: int) -> None:
        """A markdown table under the text tag `completions`, one per generation."""
        rows = ["| prompt | completion | reward | advantage |", "|---|---|---|---|"]
        rows += [f"| {_cell(r['prompt'])} | {_cell(r['completion'])} | {r['reward']} | {r['advantage']} |"
                 for r in records]
        self.writer.add_text("completions", "\n".join(rows), step)

    def finish(self, summary: dict | None) -> None:
        for name, value in flat(summary or {}, "summary/").items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(name, value, summary.get("steps", 0))
        self.writer.close()


TRACKERS.add("tensorboard", TrackerKind(lambda cfg: bool(cfg.use_tensorboard), TensorBoardTracker,
                                        package="tensorboard", module="tensorboard", folder=run_files.TENSORBOARD))


# ---- Weights & Biases ----------------------------------------------------------------------------
def _wandb_wanted(cfg) -> bool:
    """As in axolotl: `use_wandb: true` or a `wandb_project`; `wandb_mode: disabled` turns it off."""
    asked = cfg.use_wandb if cfg.use_wandb is not None else bool(cfg.wandb_project)
    return asked and cfg.wandb_mode != "disabled"


class WandbTracker:
    def __init__(self, cfg, output_dir: Path, parameters: dict):
        import wandb

        mode = cfg.wandb_mode or os.environ.get("WANDB_MODE") or "online"
        try:
            self.run = wandb.init(
                project=cfg.wandb_project, entity=cfg.wandb_entity, name=cfg.wandb_name or cfg.wandb_run_id,
                id=cfg.wandb_run_id, resume="allow" if cfg.wandb_run_id else None, mode=mode, dir=str(output_dir),
                config=parameters, settings=wandb.Settings(silent=True, console="off"))
        except Exception as error:  # wandb raises its own types (UsageError, CommError, ...) for a bad start
            hint = WANDB_LOGIN if mode == "online" else "check wandb_project/wandb_entity"
            raise UserError(f"wandb: could not start the run ({type(error).__name__}: {error}); {hint}") from None
        self.where = f"wandb {mode} run {self.run.id} ({self.run.dir})"

    def log(self, values: dict, step: int) -> None:
        self.run.log(values, step=step)

    def log_completions(self, records: list[dict], step: int) -> None:
        import wandb

        table = wandb.Table(columns=COMPLETION_COLUMNS,
                            data=[[_cell(r["prompt"]), r["completion"], r["reward"], r["advantage"]] for r in records])
        self.run.log({"completions": table}, step=step)

    def finish(self, summary: dict | None) -> None:
        for name, value in flat(summary or {}).items():
            self.run.summary[name] = value
        self.run.finish()


WANDB_LOGIN = "set WANDB_API_KEY or run `wandb login`, or set `wandb_mode: offline`"


def _wandb_preflight(cfg) -> None:
    """An online run needs credentials: the environment's, or `wandb login`'s netrc entry."""
    import netrc
    from urllib.parse import urlparse

    if (cfg.wandb_mode or os.environ.get("WANDB_MODE") or "online") != "online" or os.environ.get("WANDB_API_KEY"):
        return
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        known = netrc.netrc().authenticators(host)
    except (OSError, netrc.NetrcParseError):
        known = None
    if not known:
        raise UserError(f"wandb: could not start the run (an online run needs credentials, and this machine has none "
                        f"for {host}); {WANDB_LOGIN}")


TRACKERS.add("wandb", TrackerKind(_wandb_wanted, WandbTracker, package="wandb", module="wandb", folder=run_files.WANDB,
                                  preflight=_wandb_preflight))


# ---- MLflow --------------------------------------------------------------------------------------
def _mlflow_wanted(cfg) -> bool:
    """As in axolotl: `use_mlflow: true` or an `mlflow_experiment_name`; a tracking URI alone asks for it too."""
    if cfg.use_mlflow is not None:
        return cfg.use_mlflow
    return bool(cfg.mlflow_experiment_name or cfg.mlflow_tracking_uri)


def _is_file_store(uri: str) -> bool:
    return uri.startswith("file:") or "://" not in uri and not uri.startswith(("databricks", "sqlite"))


class MlflowTracker:
    def __init__(self, cfg, output_dir: Path, parameters: dict):
        import mlflow

        uri = cfg.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if uri and _is_file_store(uri):
            # mlflow 3 refuses a local file store unless told otherwise; the user's URI asks for one explicitly
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = None
        try:
            if uri:
                mlflow.set_tracking_uri(uri)
            if cfg.mlflow_experiment_name:
                mlflow.set_experiment(cfg.mlflow_experiment_name)
            self.run = mlflow.start_run(run_name=cfg.mlflow_run_name)
            # values are strings of at most 6000 characters for mlflow; the plan's lists are short
            mlflow.log_params({key: str(value)[:6000] for key, value in parameters.items()})
        except Exception as error:  # mlflow raises MlflowException, and OSError/ImportError for its stores
            shown = redacted(uri) if uri else "mlflow's default store"
            raise UserError(f"mlflow: could not start a run at {shown} ({type(error).__name__}: "
                            f"{redacted(str(error))}); {_mlflow_hint(uri)}") from None
        self.mlflow = mlflow
        self.where = f"mlflow run {self.run.info.run_id} at {redacted(mlflow.get_tracking_uri())}"

    def log(self, values: dict, step: int) -> None:
        # mlflow's metric names allow letters, digits, _ - . / and spaces: ours are train/loss and such
        self.mlflow.log_metrics(values, step=step)

    def log_completions(self, records: list[dict], step: int) -> None:
        """One JSON artifact per generation: completions/step_000012.json."""
        self.mlflow.log_dict(records, f"completions/step_{step:06d}.json")

    def finish(self, summary: dict | None) -> None:
        numbers = {f"summary/{key}": value for key, value in flat(summary or {}).items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool)}
        if numbers:
            self.mlflow.log_metrics(numbers)
        self.mlflow.end_run()


def _mlflow_hint(uri: str | None) -> str:
    """What to do about a store that refused: a local one is a folder or a file to write; a server is to reach."""
    if uri and _is_file_store(uri):
        return (f"mlflow_tracking_uri names a local store ({redacted(uri)}): check that its folder can be written, or "
                "point it at another (`file:/path`, `sqlite:///path.db`)")
    return ("check mlflow_tracking_uri: the server must be reachable from here, or use a local store that works "
            "offline (`file:/path` or `sqlite:///path.db`)")


def _mlflow_preflight(cfg) -> None:
    """A local file store's folder can be written (a server can only be known by reaching it, when the run starts)."""
    uri = cfg.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri or not _is_file_store(uri) or uri.startswith("sqlite"):
        return
    folder = Path(uri.removeprefix("file://").removeprefix("file:")).expanduser()
    existing = next((parent for parent in (folder, *folder.parents) if parent.exists()), None)
    if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK):
        raise UserError(f"mlflow: could not start a run at {redacted(uri)}: {existing or folder} cannot be written; "
                        f"{_mlflow_hint(uri)}")


TRACKERS.add("mlflow", TrackerKind(_mlflow_wanted, MlflowTracker, package="mlflow-skinny", module="mlflow",
                                   preflight=_mlflow_preflight))


# ---- all of them, as hooks -------------------------------------------------------------------------
def wanted_trackers(cfg) -> list[str]:
    return [name for name in TRACKERS.names() if TRACKERS[name].wanted(cfg)]


def check_trackers(cfg) -> None:
    """What starting the trackers would refuse (a library missing, no credentials for an online run, a store that
    cannot be written), refused without starting them: `plan` says it before `train` meets it."""
    import importlib.util

    for name in wanted_trackers(cfg):
        kind = TRACKERS[name]
        if importlib.util.find_spec(kind.module) is None:
            raise UserError(_missing_library(name, kind.module, kind.package))
        if kind.preflight is not None:
            kind.preflight(cfg)


def _missing_library(name: str, module: str, package: str) -> str:
    return (f"config asks for {name} ({_asking_key(name)}), but {module} is not installed: pip install {package} "
            "(or 'tuneloop[trackers]')")


class Trackers(RunHooks):
    """The run's trackers, fed the metrics lines (main process only); `start` before the loop."""

    def __init__(self, notice: Callable[[str], None]):
        self.started: dict[str, object] = {}
        self.notice = notice
        self.output_dir: Path | None = None
        self.folders: dict[str, set[str] | None] = {}  # shared folder -> its entries before (None: not there)

    def start(self, cfg, plan, output_dir: Path) -> list[str]:
        """Starts every tracker the config asks for; returns where each writes. A UserError if one cannot start
        (the ones already started are closed first)."""
        parameters = run_parameters(cfg, plan)
        self.output_dir = output_dir
        for name in wanted_trackers(cfg):
            kind = TRACKERS[name]
            try:
                if kind.folder is not None:
                    folder = output_dir / kind.folder
                    self.folders[kind.folder] = run_files.entries_of(folder) if folder.exists() else None
                self.started[name] = kind.start(cfg, output_dir, parameters)
                if kind.folder is not None:  # its files are there now: recorded at once (a kill loses no record)
                    run_files.record_shared_folder(output_dir, kind.folder, self.folders[kind.folder])
            except ImportError as error:
                self.finish(None)
                raise UserError(_missing_library(name, error.name or name, kind.package)) from None
            except UserError:
                self.finish(None)
                raise
        return [tracker.where for tracker in self.started.values()]

    def logged(self, record: dict) -> None:
        step, values = numbers_of(record)
        for name, tracker in list(self.started.items()):
            try:
                tracker.log(values, step)
            except Exception as error:  # a tracker is never worth a failed run
                del self.started[name]
                self.notice(f"{name} stopped tracking at step {step} ({type(error).__name__}: "
                            f"{redacted(str(error))}); metrics.jsonl has every line")

    def completions(self, step: int, records: list[dict]) -> None:
        for name, tracker in list(self.started.items()):
            try:
                tracker.log_completions(records, step)
            except Exception as error:  # a tracker is never worth a failed run
                del self.started[name]
                self.notice(f"{name} stopped tracking at step {step} ({type(error).__name__}: "
                            f"{redacted(str(error))}); metrics.jsonl and completions.jsonl have every line")

    def finish(self, summary: dict | None) -> None:
        for name, tracker in list(self.started.items()):
            try:
                tracker.finish(summary)
            except Exception as error:
                self.notice(f"{name} could not close its run ({type(error).__name__}: {redacted(str(error))})")
        self.started.clear()
        for folder, before in self.folders.items():  # what the trackers added is this run's (--overwrite clears it)
            run_files.record_shared_folder(self.output_dir, folder, before)
        self.folders.clear()


def _asking_key(name: str) -> str:
    return {"tensorboard": "use_tensorboard", "wandb": "use_wandb/wandb_project",
            "mlflow": "use_mlflow/mlflow_experiment_name/mlflow_tracking_uri"}[name]
