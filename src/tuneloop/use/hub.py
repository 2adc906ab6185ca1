"""Pushing a run to the Hugging Face Hub, as axolotl does when `hub_model_id` is set, and `tuneloop push`.

axolotl hands `hub_model_id` and `hub_strategy` to transformers' Trainer with `push_to_hub`, `hub_private_repo` and
`hub_always_push` on; this module does what the Trainer then does (its `init_hf_repo`, `_push_from_checkpoint` and
`push_to_hub`), smaller:

- when `train` starts (main process, before the data is read): a token, the hub reached, the repo created if it is
  new (private, as axolotl asks for) and the `hub_revision` branch created if it is missing. A failure stops the run
  there (exit 2): a run meant to be pushed that cannot be is better stopped at once than found unpushed hours later.
- at each checkpoint save, by `hub_strategy` (the Trainer's values and meanings; unset: the Trainer's default,
  every_save, which axolotl keeps): see `uploads_at_save`. Each push is queued in the background (huggingface_hub's
  run_as_future: one upload at a time, in order), so the steps do not wait for the network; like axolotl
  (hub_always_push) no save is skipped because the one before is still uploading.
- at the end: the queued pushes are waited for, then the final model folder is pushed (`uploads_at_end`). A push that
  fails then never fails the finished run: it is a warning with the `tuneloop push` command that uploads the finished
  output folder later.

Light at import (the CLI's `--help` imports it): huggingface_hub is imported inside the functions.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass
from pathlib import Path

from tuneloop import run_files
from tuneloop.config.hub import LAST_CHECKPOINT, repo_id_problem, strategy_of
from tuneloop.errors import UserError
from tuneloop.train.hooks import RunHooks

STRATEGIES = ("end", "every_save", "checkpoint", "all_checkpoints")
MODEL_PATTERNS = tuple(entry.pattern for entry in run_files.MODEL_FILES)  # what save_pretrained writes
# the run's records beside the final model: what was trained, and how it went
RECORDS = (run_files.RUN_CONFIG, run_files.PLAN, run_files.METRICS, run_files.SUMMARY, run_files.RESUMES,
           run_files.COMPLETIONS, run_files.REPORT_MD, run_files.REPORT_PNG)
NOT_PUSHING = "remove hub_model_id to train without pushing"


@dataclass(frozen=True)
class Upload:
    """One upload_folder call: the files of `folder` that match `patterns` (None: all of them) go to `path_in_repo`
    ("": the repo's root)."""

    folder: Path
    path_in_repo: str
    patterns: tuple[str, ...] | None
    message: str  # the commit message


# ---- what goes where (no network) ---------------------------------------------------------------------------------

def uploads_at_save(strategy: str, checkpoint: Path) -> list[Upload]:
    """What a checkpoint save pushes, as the Trainer's `_push_from_checkpoint`: with every strategy but `end`, the
    checkpoint's model files to the repo's root (the repo always holds the newest model); with `checkpoint`, also
    the whole checkpoint (optimizer, scheduler, RNG: resumable) as `last-checkpoint/`, replaced at each save; with
    `all_checkpoints`, each whole checkpoint under its own name."""
    if strategy == "end":
        return []
    step = checkpoint.name.removeprefix(run_files.CHECKPOINT_PREFIX)
    uploads = [Upload(checkpoint, "", MODEL_PATTERNS, f"Training in progress, step {step}")]
    if strategy == "checkpoint":
        uploads.append(Upload(checkpoint, LAST_CHECKPOINT, None, f"Training in progress, step {step}, checkpoint"))
    elif strategy == "all_checkpoints":
        uploads.append(Upload(checkpoint, checkpoint.name, None, f"Training in progress, step {step}, checkpoint"))
    return uploads


def uploads_at_end(output_dir: Path) -> list[Upload]:
    """The finished run: the final model (or adapter) and its tokenizer at the repo's root, with the run's records.
    Checkpoints, tracker folders, exports and tuneloop's hidden files stay local (the Trainer leaves checkpoints out
    too; the strategy pushed those that were wanted)."""
    return [Upload(output_dir, "", MODEL_PATTERNS + RECORDS, "End of training (tuneloop)")]


def push_command(output_dir: Path, repo_id: str, revision: str | None) -> str:
    """The command that pushes a finished output folder later."""
    command = f"tuneloop push {shlex.quote(str(output_dir))} --hub-model-id {shlex.quote(repo_id)}"
    return command + (f" --revision {shlex.quote(revision)}" if revision else "")


# ---- the network ------------------------------------------------------------------------------------------------

def hub_failures() -> tuple[type[BaseException], ...]:
    """What huggingface_hub raises when the hub cannot be used: its HTTP errors (HfHubHTTPError for an HTTP status,
    and the HTTP library's own for a refused connection or a timeout, re-exported as huggingface_hub.errors.HTTPError)
    and OSError (OfflineModeIsEnabled under HF_HUB_OFFLINE=1, a file that cannot be read)."""
    from huggingface_hub.errors import HTTPError

    return HTTPError, OSError


def in_words(error: BaseException) -> str:
    """One line on what went wrong, with what the user can do about the usual cases."""
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    first_line = (str(error).strip().splitlines() or [""])[0]
    if isinstance(error, OfflineModeIsEnabled):
        return "HF_HUB_OFFLINE is set, so the hub is not reached (unset it)"
    status = error.response.status_code if isinstance(error, HfHubHTTPError) and error.response is not None else None
    if status == 401:
        return ("the hub refused the token (401 Unauthorized): log in again with `hf auth login`, or set HF_TOKEN to "
                "a valid token")
    if status == 403:
        return ("the token may not create or write this repo (403 Forbidden): use a token with write access to its "
                "owner (`hf auth login`, or HF_TOKEN)")
    if status is not None:
        return f"the hub answered {status}: {first_line}"
    return (f"cannot reach {constants.ENDPOINT} ({type(error).__name__}: {first_line}); check the network and "
            "HF_ENDPOINT")


def open_repo(repo_id: str, revision: str | None, named: str = "hub_model_id", otherwise: str = NOT_PUSHING):
    """(an HfApi holding the token, the repo's full id) once the repo is there to push to; a UserError naming `named`
    and the fix otherwise. `otherwise`: the way out besides fixing it."""
    from huggingface_hub import HfApi, get_token

    problem = repo_id_problem(repo_id)
    if problem:
        raise UserError(f"{named}: `{repo_id}` is not a Hub repo id ({problem}); write NAME or OWNER/NAME, or "
                        f"{otherwise}")
    try:
        token = get_token()
    except Exception as error:  # an OIDC token exchange (HF_OIDC_RESOURCE) that failed raises its own errors
        raise UserError(f"{named}: no Hugging Face token for `{repo_id}` ({type(error).__name__}: {error}); log in "
                        f"with `hf auth login` or set HF_TOKEN, or {otherwise}") from None
    if token is None:
        raise UserError(f"{named}: pushing to `{repo_id}` needs a Hugging Face token with write access, and none is "
                        f"set: log in with `hf auth login` or set HF_TOKEN, or {otherwise}")
    api = HfApi(token=token)
    try:
        full_id = reach_repo(api, repo_id, revision)
    except hub_failures() as error:
        raise UserError(f"{named}: cannot push to `{repo_id}`"
                        f"{f' (branch {revision})' if revision else ''}: {in_words(error)}; or {otherwise}") from None
    return api, full_id


def reach_repo(api, repo_id: str, revision: str | None) -> str:
    """The repo's full id once the hub was reached: the repo created if it is new (private: axolotl asks the Trainer
    for a private repo; an existing repo keeps its visibility), and the branch `revision` if it is missing (an upload
    to a missing branch fails). The Trainer's init_hf_repo does the first."""
    full_id = api.create_repo(repo_id, private=True, exist_ok=True).repo_id
    if revision:
        api.create_branch(full_id, branch=revision, exist_ok=True)
    return full_id


def upload(api, repo_id: str, revision: str | None, item: Upload, background: bool = False):
    """One upload_folder call (a future when `background`)."""
    return api.upload_folder(repo_id=repo_id, folder_path=str(item.folder), path_in_repo=item.path_in_repo or None,
                             allow_patterns=list(item.patterns) if item.patterns is not None else None,
                             revision=revision, commit_message=item.message, run_as_future=background)


class HubPush(RunHooks):
    """Main process: the run's pushes. Opened when the run starts (the repo reached, or a UserError), told of every
    checkpoint saved (a hook), finished when the run ends."""

    def __init__(self, cfg, notice):
        self.repo_id, self.revision, self.strategy = cfg.hub_model_id, cfg.hub_revision, strategy_of(cfg)
        self.api, self.full_id = open_repo(self.repo_id, self.revision)
        self.notice = notice
        self.queued: list[tuple[Upload, object]] = []  # (what, its future), oldest first

    @property
    def url(self) -> str:
        from huggingface_hub import constants

        return f"{constants.ENDPOINT}/{self.full_id}" + (f"/tree/{self.revision}" if self.revision else "")

    def saved(self, checkpoint: Path) -> None:
        """Queues the checkpoint's pushes. (A checkpoint that save_total_limit prunes before its queued upload ran
        fails that upload, said as a warning; the Trainer shares the race.)"""
        self._say_failed_pushes(wait=False)
        for item in uploads_at_save(self.strategy, checkpoint):
            self.queued.append((item, upload(self.api, self.full_id, self.revision, item, background=True)))

    def finish(self, output_dir: Path, final: bool) -> str | None:
        """Waits for the queued pushes (their failures said as notices), then pushes the final folder when the run
        finished (`final`). Returns what failed in that push, with the command that pushes it later, or None."""
        self._say_failed_pushes(wait=True)
        if not final:
            return None
        try:
            for item in uploads_at_end(output_dir):
                upload(self.api, self.full_id, self.revision, item)
        except Exception as error:  # whatever it is, the finished run must keep its exit code: said, not raised
            why = in_words(error) if isinstance(error, hub_failures()) else f"{type(error).__name__}: {error}"
            return (f"hub: the run finished, but pushing {output_dir} to {self.full_id} failed: {why}. The folder is "
                    f"intact; push it later with `{push_command(output_dir, self.full_id, self.revision)}`")
        return None

    def abandon(self, output_dir: Path) -> None:
        """A run stopped by a signal or an error does not wait for its queued pushes: those not started yet are
        cancelled (huggingface_hub's worker thread would otherwise run every one of them before the process could
        exit; one already under way ends first), and the command that pushes the folder later is said."""
        dropped = sum(job.cancel() for _, job in self.queued)
        self.queued = [(item, job) for item, job in self.queued if not job.cancelled()]
        self._say_failed_pushes(wait=False)
        if dropped:
            self.notice(f"hub: the run stopped, so {dropped} queued checkpoint push(es) to {self.full_id} were "
                        f"cancelled; push the folder later with "
                        f"`{push_command(output_dir, self.full_id, self.revision)}`")

    def _say_failed_pushes(self, wait: bool) -> None:
        """The queued pushes that have ended (all of them, when `wait`): each failure said once, none raised (a
        checkpoint push is a copy; the run and its local checkpoints go on)."""
        still = []
        for item, job in self.queued:
            if not wait and not job.done():
                still.append((item, job))
                continue
            error = job.exception()
            if error is not None:
                where = f"{item.path_in_repo}/" if item.path_in_repo else "the repo's root"
                self.notice(f"hub: pushing {item.folder} to {where} of {self.full_id} failed "
                            f"({in_words(error) if isinstance(error, hub_failures()) else error}); the run goes on, "
                            "and the final model is pushed when it ends")
        self.queued = still


# ---- tuneloop push OUTPUT_DIR -------------------------------------------------------------------------------------

def add_push_command(commands) -> None:
    push = commands.add_parser("push", help="upload a finished run's output folder (its final model and records) "
                               "to the Hugging Face Hub")
    push.add_argument("output_dir", help="the output_dir of a finished tuneloop run")
    push.add_argument("--hub-model-id", metavar="ID", help="the repo (NAME or OWNER/NAME; created private if new); "
                      "default: the run's hub_model_id")
    push.add_argument("--revision", metavar="BRANCH", help="the branch (created if missing); default: the run's "
                      "hub_revision when the repo is the run's own (no --hub-model-id), else main")
    push.set_defaults(handler=command_push)


def command_push(args: argparse.Namespace) -> int:
    output_dir = Path(args.output_dir).expanduser()
    check_finished_output(output_dir)
    settings = _run_settings(output_dir)
    repo_id = args.hub_model_id or settings.get("hub_model_id")
    revision = args.revision or (settings.get("hub_revision") if not args.hub_model_id else None)
    if not repo_id:
        raise UserError(f"push: which repo? {output_dir}'s run had no hub_model_id: give --hub-model-id NAME "
                        "(or OWNER/NAME)")
    api, full_id = open_repo(repo_id, revision, named="push: --hub-model-id", otherwise="push later")
    try:
        for item in uploads_at_end(output_dir):
            upload(api, full_id, revision, item)
    except hub_failures() as error:
        raise UserError(f"push: uploading {output_dir} to {full_id} failed: {in_words(error)}; the folder is "
                        "intact: run the command again") from None
    print(f"pushed {output_dir} to {full_id}" + (f" (branch {revision})" if revision else ""))
    return 0


def check_finished_output(folder: Path) -> None:
    """A folder `tuneloop push` uploads: a finished run's output_dir, with its summary and its final model."""
    from tuneloop.run_files import ADAPTER_CONFIG, WEIGHT_PATTERNS

    if not folder.is_dir():
        raise UserError(f"push: {folder} is not a folder; give the output_dir of a finished tuneloop run")
    if not (folder / run_files.SUMMARY).is_file():
        raise UserError(f"push: {folder} is not a finished tuneloop run (no {run_files.SUMMARY}, which a run writes "
                        "when it ends); give the output_dir of a finished run")
    has_weights = any(any(folder.glob(pattern)) for pattern in WEIGHT_PATTERNS)
    if not (folder / ADAPTER_CONFIG).is_file() and not ((folder / "config.json").is_file() and has_weights):
        raise UserError(f"push: {folder} holds no final model (neither config.json with weights nor "
                        f"{ADAPTER_CONFIG}); give the output_dir of a finished run")


def _run_settings(output_dir: Path) -> dict:
    """The run's config as it ran (run_config.yml), or {} when it cannot be read (the flags then say it all)."""
    import yaml

    try:
        settings = yaml.safe_load((output_dir / run_files.RUN_CONFIG).read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return settings if isinstance(settings, dict) else {}
