"""Errors that are the user's to fix: the CLI prints them without a traceback and exits 2."""


class UserError(Exception):
    """A problem in the user's config, data or environment, with a message that says the fix."""


class CheckpointFailed(UserError):
    """A checkpoint could not be written (a full disk, say). Raised on every rank at the same point, so
    no rank is left waiting at a barrier for one that gave up; the older checkpoints are intact."""


class TrainingDiverged(Exception):
    """The loss or the gradient norm went bad; the last complete checkpoint is kept (exit code 3)."""


DIVERGED_EXIT_CODE = 3
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL, "try again": a scheduler can requeue and auto-resume
