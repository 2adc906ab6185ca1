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

    def planned(self, plan, resume_from) -> None:
        """Main process: the plan the run follows, and the checkpoint it resumes from (or None)."""

    def notice(self, text: str) -> None:
        """Main process: something the user should know before training (a damaged checkpoint skipped, a
        resumed run made longer)."""

    def logged(self, record: dict) -> None:
        """Main process: every line written to metrics.jsonl (train and eval)."""

    def loop_started(self) -> None:
        """Right before the first step of this session."""

    def loop_ended(self, model) -> None:
        """Right after the last step, before the final model is written (the unwrapped model)."""
