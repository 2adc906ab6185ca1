"""Ways to watch a run from outside, without touching the loop's code.

The run calls a RunHooks at fixed points: when the plan is made, around each phase of a step
(`with hooks.phase("forward")`), with every collated micro-batch, with every metrics record, and when
the loop starts and ends. Every method does nothing here: the command line subclasses it to print
the plan and the progress lines, the benchmark to time the phases and count tokens. A phase costs
one method call and an empty context manager when nobody watches.

Phases, in the order a step meets them: "sampler" (an epoch's micro-batches), "collate",
"to(device)", "forward and loss" (one forward: the loss meets the output projection in chunks),
"backward", "clip grad norm", "optimizer step", "scheduler step", "zero_grad"; and, at the steps that
have them, "logging", "eval" and "save".
"""

from __future__ import annotations

import contextlib

_NOTHING = contextlib.nullcontext()


class RunHooks:
    def phase(self, name: str):
        """A context manager around one phase of the loop."""
        return _NOTHING

    def micro_batch(self, batch) -> None:
        """Every micro-batch the loop trains on, after collation (a data.collate.MicroBatch)."""

    def preparing(self, rows_read: int, fraction: float) -> None:
        """Main process, while the data cache is built: after every chunk of rows, the rows read and the share of
        the data files' bytes read."""

    def planned(self, plan, resume_from) -> None:
        """Main process: the plan the run follows, and the checkpoint it resumes from (or None)."""

    def notice(self, text: str) -> None:
        """Main process: something the user should know before training (a damaged checkpoint skipped, a
        resumed run made longer)."""

    def told(self, text: str) -> None:
        """Main process: a line worth showing that is not a warning (where the trackers write)."""

    def logged(self, record: dict) -> None:
        """Main process: every line written to metrics.jsonl (train and eval)."""

    def stepped(self, step: int) -> None:
        """Main process: after every optimizer step (host-side only: nothing here may wait for the device)."""

    def completions(self, step: int, records: list[dict]) -> None:
        """Main process, online RL with `trl.log_completions`: every completion of the generation that `step`
        trains on (prompt, completion, rewards, advantage), as completions.jsonl has it."""

    def saved(self, checkpoint) -> None:
        """Main process: a checkpoint folder was written whole (and older ones pruned), before the next step."""

    def loop_started(self) -> None:
        """Right before the first step of this session."""

    def loop_ended(self, model) -> None:
        """Right after the last step, before the final model is written (the unwrapped model)."""


class TogetherHooks(RunHooks):
    """The run's own hooks and observers that watch beside them (trackers). Phases and micro-batches go to
    the first alone: they are for timing and counting, and a second observer there would cost every step."""

    def __init__(self, first: RunHooks, *others: RunHooks):
        self.first, self.all = first, (first, *others)

    def phase(self, name: str):
        return self.first.phase(name)

    def micro_batch(self, batch) -> None:
        self.first.micro_batch(batch)

    def preparing(self, rows_read: int, fraction: float) -> None:
        for hooks in self.all:
            hooks.preparing(rows_read, fraction)

    def planned(self, plan, resume_from) -> None:
        for hooks in self.all:
            hooks.planned(plan, resume_from)

    def notice(self, text: str) -> None:
        for hooks in self.all:
            hooks.notice(text)

    def told(self, text: str) -> None:
        for hooks in self.all:
            hooks.told(text)

    def logged(self, record: dict) -> None:
        for hooks in self.all:
            hooks.logged(record)

    def stepped(self, step: int) -> None:
        for hooks in self.all:
            hooks.stepped(step)

    def completions(self, step: int, records: list[dict]) -> None:
        for hooks in self.all:
            hooks.completions(step, records)

    def saved(self, checkpoint) -> None:
        for hooks in self.all:
            hooks.saved(checkpoint)

    def loop_started(self) -> None:
        for hooks in self.all:
            hooks.loop_started()

    def loop_ended(self, model) -> None:
        for hooks in self.all:
            hooks.loop_ended(model)
