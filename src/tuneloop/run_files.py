"""Every file and folder tuneloop writes into output_dir, and the atomic ways it writes them.

Whatever a run leaves in output_dir is named here, once: its records (plan, metrics, summary,
report), the model folder that `save_pretrained` writes, checkpoints, and the hidden temporary
folders a save goes through. `--overwrite` removes exactly what is listed and nothing else, so a
new kind of output (tracker logs, a merged model, a trained tokenizer) is one more entry here.

Writes are atomic: a file or folder is written under a temporary name, made durable (fsync) and
renamed into place, so a kill or a full disk never leaves a torn file where a reader would find it.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

# ---- the run's records
PLAN = "plan.json"
RUN_CONFIG = "run_config.yml"  # the config the run used, every key with its value: `tuneloop train` can rerun it
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
RESUMES = "resumes.jsonl"  # one line per resume: the checkpoint, and the settings --force-resume overrode
COMPLETIONS = "completions.jsonl"  # online RL with trl.log_completions: every generated completion and its rewards
VLLM_WEIGHTS = "vllm_weights"  # online RL on a vLLM server: the latest step's weights, as the server loads them
REPORT_MD = "report.md"
REPORT_PNG = "report.png"

# ---- checkpoints: checkpoint-STEP/ holds the model, TRAINING_STATE (optimizer, scheduler, RNG),
# one RANK_RNG per rank, a copy of METRICS, and STATE written last (the completeness marker)
CHECKPOINT_PREFIX = "checkpoint-"
STATE = "tuneloop_state.json"
TRAINING_STATE = "training_state.pt"
RANK_RNG = "rng_state_{rank}.pt"

# ---- saves in progress, and the early-stopping best model
TEMP_PREFIX = ".tmp-"
TEMP_FINAL = ".tmp-final"
BEST = "best"
TEMP_BEST = f"{TEMP_PREFIX}{BEST}"
OLD_BEST = f".old-{BEST}"  # the previous best while save_best replaces it

# ---- trackers' files (trackers.py)
TENSORBOARD = "runs"  # as the Trainer names it
WANDB = "wandb"  # wandb's own folder (an offline run lives there until `wandb sync`)
# ---- a model folder as the use commands meet it (use/folders.py): a LoRA adapter's config, or weights
ADAPTER_CONFIG = "adapter_config.json"
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
# ---- what the use commands write there (use/)
MERGED = "merged"  # `tuneloop merge-lora`'s default output
QUANTIZED = "quantized"  # `tuneloop quantize`'s default output (axolotl's name)


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return output_dir / f"{CHECKPOINT_PREFIX}{step}"


def temp_checkpoint_dir(output_dir: Path, step: int) -> Path:
    return output_dir / f"{TEMP_PREFIX}{CHECKPOINT_PREFIX}{step}"


def pending_shards(output_dir: Path, step: int) -> Path:
    """The engine's shards of a checkpoint (FSDP2, DeepSpeed), written by every rank before the main process builds
    the checkpoint that takes them in."""
    return output_dir / f"{TEMP_PREFIX}shards-{step}"


def pending_rank_rng(output_dir: Path, step: int, rank: int) -> Path:
    """A rank's RNG state, written before the main process builds the checkpoint that takes it in."""
    return output_dir / f".rng-{step}-rank{rank}.pt"


@dataclass(frozen=True)
class OutputEntry:
    pattern: str  # a name or a glob in output_dir
    what: str


# what `save_pretrained` of a model (or a peft adapter) and of its tokenizer write
MODEL_FILES = (
    OutputEntry("config.json", "model config"), OutputEntry("generation_config.json", "generation config"),
    OutputEntry("model.safetensors", "weights"), OutputEntry("model-*.safetensors", "weight shards"),
    OutputEntry("model.safetensors.index.json", "weight shard index"),
    OutputEntry("adapter_model.safetensors", "LoRA adapter weights"),
    OutputEntry("adapter_config.json", "LoRA adapter config"), OutputEntry("README.md", "peft's adapter card"),
    OutputEntry("tokenizer.json", "tokenizer"), OutputEntry("tokenizer_config.json", "tokenizer config"),
    OutputEntry("special_tokens_map.json", "special tokens"), OutputEntry("chat_template.jinja", "chat template"),
    OutputEntry("vocab.json", "vocabulary"), OutputEntry("merges.txt", "BPE merges"),
    OutputEntry("tokenizer.model", "sentencepiece model"), OutputEntry("added_tokens.json", "added tokens"),
    OutputEntry("tekken.json", "mistral-common tokenizer"),
)
OUTPUT_FILES = (
    OutputEntry(PLAN, "the plan"), OutputEntry(RUN_CONFIG, "the config the run used"),
    OutputEntry(METRICS, "train and eval metrics"),
    OutputEntry(SUMMARY, "the finished run's summary"), OutputEntry(REPORT_MD, "the report"),
    OutputEntry(RESUMES, "the resumes of the run"), OutputEntry(COMPLETIONS, "online RL's completions"),
    OutputEntry(VLLM_WEIGHTS, "the weights sent to the vLLM server"),
    OutputEntry(REPORT_PNG, "the report's plot"),
    *MODEL_FILES,
    OutputEntry(f"{CHECKPOINT_PREFIX}*", "checkpoints"), OutputEntry(f"{TEMP_PREFIX}*", "saves in progress"),
    OutputEntry(".rng-*-rank*.pt", "RNG states of a checkpoint in progress"),
    OutputEntry(BEST, "the early-stopping best model"), OutputEntry(OLD_BEST, "the previous best model"),
    OutputEntry(TENSORBOARD, "TensorBoard event files"), OutputEntry(WANDB, "wandb's run files"),
    OutputEntry(MERGED, "the merged model (merge-lora)"), OutputEntry(QUANTIZED, "the quantized model (quantize)"),
    OutputEntry("*.gguf", "GGUF exports (export)"), OutputEntry("*.Modelfile", "Ollama Modelfiles (export)"),
)
# Every name tuneloop has written into output_dir, one a line: what `--overwrite` may remove is what is both
# listed here and an OUTPUT_FILES name, so a user's own README.md or checkpoint-notes.txt is never touched.
WRITTEN = ".tuneloop-written"
IN_PROGRESS = (f"{TEMP_PREFIX}*", ".rng-*-rank*.pt", OLD_BEST)  # tuneloop's by their names alone
# folders other programs write into too (the Trainer and axolotl leave TensorBoard logs in runs/): tuneloop records
# the entries it adds inside them (`runs/events...`), never the folder, so a user's own experiments there stay;
# `runs/` (a trailing slash) records that tuneloop made the folder, which goes when its entries are gone and it
# is empty
SHARED_FOLDERS = (TENSORBOARD, WANDB)
# held by the run that writes in output_dir (an OS lock: a crash releases it); never a run file, never removed
LOCK = ".tuneloop-lock"


def record(output_dir: Path, *names: str) -> None:
    """Main process: these names in output_dir are tuneloop's (see WRITTEN)."""
    known = written_names(output_dir)
    new = [name for name in names if name not in known]
    if new:
        with open(output_dir / WRITTEN, "a") as handle:
            handle.write("".join(f"{name}\n" for name in new))


def written_names(output_dir: Path) -> set[str]:
    try:
        return set((output_dir / WRITTEN).read_text().split("\n")) - {""}
    except FileNotFoundError:
        return set()


def _is_output_name(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, entry.pattern) for entry in OUTPUT_FILES)


def is_tuneloop_run(output_dir: Path) -> bool:
    return ((output_dir / WRITTEN).exists() or (output_dir / PLAN).exists()
            or bool(complete_checkpoints(output_dir)))


def run_files_in(output_dir: Path) -> list[Path]:
    """What an earlier tuneloop run left in output_dir: the names it recorded writing (a run of an older tuneloop
    without the record: its plan, records, model files and marked checkpoints), the entries it recorded inside
    the shared folders, and saves in progress."""
    if not is_tuneloop_run(output_dir):
        return []
    recorded = written_names(output_dir)
    found = []
    for name in sorted(os.listdir(output_dir)):
        path = output_dir / name
        if name in SHARED_FOLDERS and path.is_dir():
            found += [path / inside for inside in sorted(os.listdir(path)) if f"{name}/{inside}" in recorded]
        elif name == LOCK:
            continue
        elif any(fnmatch.fnmatchcase(name, pattern) for pattern in IN_PROGRESS) or name == WRITTEN:
            found.append(path)
        elif recorded:
            if name in recorded and _is_output_name(name):
                found.append(path)
        elif _is_output_name(name) and (not name.startswith(CHECKPOINT_PREFIX) or (path / STATE).is_file()):
            found.append(path)
    return found


def never_trained(output_dir: Path) -> bool:
    """A run that stopped before its first step (a bad config found late, a model that did not load): it left
    its plan and config, and nothing else worth keeping."""
    return {path.name for path in run_files_in(output_dir)} <= {PLAN, RUN_CONFIG, WRITTEN}


def foreign_model_files(output_dir: Path) -> list[Path]:
    """In a folder that holds no tuneloop run: files a run would write over (someone else's model or notes)."""
    if is_tuneloop_run(output_dir):
        return []
    return [output_dir / name for name in sorted(os.listdir(output_dir))
            if any(fnmatch.fnmatchcase(name, entry.pattern) for entry in (*MODEL_FILES, *OUTPUT_FILES[:6]))]


def clear_run_files(output_dir: Path) -> None:
    """Removes an earlier tuneloop run's files (run_files_in), nothing else; a shared folder tuneloop made goes too
    once nothing is left in it."""
    made = [name.rstrip("/") for name in written_names(output_dir) if name.endswith("/")]
    for path in run_files_in(output_dir):
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    for name in made:
        folder = output_dir / name
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


def entries_of(folder: Path) -> set[str]:
    """The names in a folder (none when it does not exist)."""
    return set(os.listdir(folder)) if folder.is_dir() else set()


def record_shared_folder(output_dir: Path, name: str, before: set[str] | None) -> None:
    """After a tracker wrote into the shared folder `name`: the entries it added (`before`: those there when it
    started, None where the folder did not exist and tuneloop made it)."""
    added = entries_of(output_dir / name) - (before or set())
    record(output_dir, *([f"{name}/"] if before is None else []), *(f"{name}/{entry}" for entry in sorted(added)))


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """Checkpoint folders with their completeness marker, oldest first."""
    found = [p for p in Path(output_dir).glob(f"{CHECKPOINT_PREFIX}*")
             if p.is_dir() and p.name[len(CHECKPOINT_PREFIX):].isdigit() and (p / STATE).is_file()]
    return sorted(found, key=step_of)


def step_of(checkpoint: Path) -> int:
    return int(checkpoint.name[len(CHECKPOINT_PREFIX):])


def remove_torn_saves(output_dir: Path) -> None:
    """What a kill or a full disk left half-written. Not OLD_BEST: it can be the only best model."""
    for pattern in (f"{TEMP_PREFIX}*", ".rng-*-rank*.pt"):
        for leftover in Path(output_dir).glob(pattern):
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)


# ---- one run at a time ------------------------------------------------------------------------

class OutputDirLock:
    """output_dir for one run at a time: an OS lock on the folder itself (flock), released when the run closes it
    or its process dies. Taking it writes nothing; `sign()` then leaves who holds it in LOCK, for the message a
    second run gets, once the folder is known to be the run's own."""

    def __init__(self, output_dir: Path):
        import fcntl

        from tuneloop.errors import UserError

        self.output_dir = output_dir
        self.descriptor = os.open(output_dir, os.O_RDONLY)
        try:
            fcntl.flock(self.descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if not isinstance(error, BlockingIOError):  # a file system without locks: the run goes on unguarded
                os.close(self.descriptor)
                self.descriptor = None
                return
            os.close(self.descriptor)
            raise UserError(f"output_dir {output_dir} is in use by another tuneloop run ({holder_of(output_dir)}); "
                            "two runs in one "
                            "folder would mix their files. Wait for that run to end, or choose another "
                            "output_dir.") from None

    def sign(self) -> None:
        import socket
        import time

        write_json(self.output_dir / LOCK, {"pid": os.getpid(), "host": socket.gethostname(),
                                            "since": time.strftime("%Y-%m-%d %H:%M:%S")}, recorded=False)

    def close(self) -> None:
        if self.descriptor is not None:
            os.close(self.descriptor)  # (releases the lock)
            self.descriptor = None


def holder_of(output_dir: Path) -> str:
    """Who holds output_dir's lock, as the holder signed LOCK."""
    holder = read_json(output_dir / LOCK) or {}
    return (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, since {holder.get('since', '?')}"
            if holder else "a process that has not said who it is")


def training_in(output_dir: Path) -> str | None:
    """While a run holds output_dir (OutputDirLock): who it is (holder_of); None when no run does, or when the
    folder or its file system gives no lock to test."""
    import fcntl

    try:
        descriptor = os.open(output_dir, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)  # (a shared lock, let go at once: the test only)
    except BlockingIOError:
        return holder_of(output_dir)
    except OSError:
        return None
    finally:
        os.close(descriptor)
    return None


def append_json_line(path: Path, record_: dict) -> None:
    """One more line of a log kept in output_dir (RESUMES)."""
    record(path.parent, path.name)
    with open(path, "a") as handle:
        handle.write(json.dumps(record_) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


# ---- atomic writes --------------------------------------------------------------------------

def fsync_files(folder: Path) -> None:
    """The folder's files' contents on disk (a rename is only as durable as what it renames)."""
    for path in folder.rglob("*"):  # an engine's shards sit in a sub-folder
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())


def fsync_folder_entry(folder: Path) -> None:
    """The folder's own entries (the renames into it) on disk."""
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def make_readable(folder: Path) -> None:
    """Files and folders with the modes of anything else the user creates (0644 / 0755 under the usual umask).
    Some writers make private temporary files (transformers' weights come out 0600, mkdtemp's folders 0700),
    and a model that a serving process under another user cannot read is not much of an output."""
    mask = os.umask(0)
    os.umask(mask)
    folder.chmod(0o777 & ~mask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def move_files_into(source: Path, output_dir: Path) -> None:
    """Each file of `source` renamed into output_dir, after all of them are on disk: a rename within one
    file system is atomic, so each file in output_dir is either the old one or whole (a power loss must not
    leave an empty model.safetensors behind a summary.json that says the run finished)."""
    fsync_files(source)
    names = sorted(path.name for path in source.iterdir())
    record(output_dir, *names)
    for name in names:
        os.replace(source / name, output_dir / name)
    fsync_folder_entry(output_dir)


def write_json(path: Path, data: dict, recorded: bool = True) -> None:
    write_text(path, json.dumps(data, indent=2), recorded)


def write_text(path: Path, text: str, recorded: bool = True) -> None:
    """Written whole or not at all: a reader never sees half a plan.json or summary.json. `recorded`: the name is
    one of the run's (WRITTEN), for `--overwrite` to clear."""
    temp = path.with_name(f"{TEMP_PREFIX}{path.name}")
    if recorded:
        record(path.parent, path.name)
    try:
        temp.write_text(text)
        with open(temp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def read_yaml(path: Path) -> dict | None:
    """None when the file is missing or torn."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (FileNotFoundError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None


def read_json(path: Path) -> dict | None:
    """None when the file is missing or torn."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
