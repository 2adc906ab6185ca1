"""What stops a run early and loudly: a diverged loss (watchdog) and a signal (preemption). (A plateau,
early stopping, is counted in the run state: state.py.)

The watchdog keeps its counters on the device so a healthy step costs no host sync; it is
read at logging steps, before every save and at the end, and it remembers the first step at
which it tripped, so the message names that step even when it is read a few steps later.
"""

from __future__ import annotations

import os
import shutil
import signal
import time

import torch

from tuneloop.errors import TrainingDiverged


class LossWatchdog:
    def __init__(self, threshold: float | None, patience: int | None, device, streaks: list[int] = (0, 0)):
        self.threshold = threshold
        # NaN/inf stop at once unless the user asked for patience; a high loss gets axolotl's 3
        self.patience = torch.tensor([patience or 1, patience or 3], device=device)
        # [not finite, too high] steps in a row; a resumed run starts from the checkpoint's streaks
        self.consecutive = torch.tensor(list(streaks), dtype=torch.long, device=device)
        self.tripped_at = torch.full((2,), -1, dtype=torch.long, device=device)
        self.first_not_finite = torch.full((), -1, dtype=torch.long, device=device)

    def observe(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Device ops only: no sync."""
        not_finite = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        too_high = loss > self.threshold if self.threshold is not None else torch.zeros_like(not_finite)
        bad = torch.stack([not_finite, too_high & ~not_finite]).long()
        self.consecutive = (self.consecutive + 1) * bad
        newly = (self.consecutive >= self.patience) & (self.tripped_at < 0)
        self.tripped_at = torch.where(newly, torch.full_like(self.tripped_at, step), self.tripped_at)
        first = not_finite & (self.first_not_finite < 0)
        self.first_not_finite = torch.where(first, torch.full_like(self.first_not_finite, step),
                                            self.first_not_finite)

    def streaks(self) -> list[int]:
        """This rank's streaks (host sync: read when saving, after check_before_save has synced anyway)."""
        return [int(v) for v in self.consecutive.tolist()]

    @staticmethod
    def _earliest(values: torch.Tensor, accelerator) -> list[int]:
        """The earliest step over ranks (-1: never); every rank gets the same answer."""
        if accelerator.num_processes == 1:
            return [int(v) for v in values.reshape(-1).tolist()]
        never = torch.iinfo(torch.long).max
        as_steps = torch.where(values < 0, torch.full_like(values, never), values)
        earliest = -accelerator.reduce(-as_steps, reduction="max")  # accelerate has no "min"
        return [-1 if int(v) == never else int(v) for v in earliest.reshape(-1).tolist()]

    def check_before_save(self, accelerator) -> None:
        """Whatever the patience, a model that has seen a non-finite step is never checkpointed."""
        self.check(accelerator)
        (step,) = self._earliest(self.first_not_finite, accelerator)
        if step >= 0:
            raise TrainingDiverged(f"the loss or gradient norm was not finite at step {step}; the model is not "
                                   "saved over the last good checkpoint")

    def check(self, accelerator) -> None:
        """Host sync; all ranks agree on the outcome."""
        nan_step, high_step = self._earliest(self.tripped_at, accelerator)
        if nan_step >= 0:
            raise TrainingDiverged(f"the loss or gradient norm is not finite at step {nan_step} "
                                   f"({int(self.patience[0])} bad step(s) in a row); lower learning_rate, "
                                   "check the data, or use max_grad_norm")
        if high_step >= 0:
            raise TrainingDiverged(f"the loss stayed above loss_watchdog_threshold={self.threshold} for "
                                   f"{int(self.patience[1])} steps in a row, reaching step {high_step}")


# Test hook: "RANK:STEP" makes that rank send itself SIGTERM after that step, so a test can show that
# a signal reaching one rank stops every rank at the same step, without timing a kill from outside.
SIGNAL_AT_STEP_ENV = "TUNELOOP_TEST_SIGNAL_AT_STEP"


class StopRequests:
    """SIGTERM/SIGINT ask the loop to checkpoint and leave at a step boundary; a second signal
    leaves at once (every write is atomic, so nothing is torn).

    One process acts at the end of the step in which the signal arrived (after that step's eval and
    save). Several ranks must all stop at the same step: after each step, each rank starts an
    asynchronous max-reduce of its flag on a CPU (gloo) side group and reads the one it started a
    step earlier, long finished. So every rank stops at the end of the step after the one in which
    the signal arrived, without a device sync or a wait in the step.
    """

    def __init__(self):
        self.received: int | None = None
        self.final_save = None  # the final model's folder in progress, once the run's steps are done
        self._previous = {}
        self._group = None
        self._pending = None  # (work, flag) of the reduce started last step

    def __enter__(self):
        """Every rank, at the same point before training (creating a group is a collective)."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # gloo even when training on NCCL: a CPU flag is read without touching the device. Made here,
            # not at the first step, so a network that gloo cannot use fails before any training
            # (GLOO_SOCKET_IFNAME picks the interface on multi-node clusters).
            self._group = dist.new_group(backend="gloo")
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if self._pending is not None:  # no collective may outlive the loop (see cli._leave_together)
            self._pending[0].wait()
            self._pending = None
            # gloo's worker lets go of the flag a moment after wait() returns and needs the GIL for it;
            # give it the GIL now, in case an unexpected error takes this rank straight to exit
            time.sleep(0.05)

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.received is not None:
            if self.final_save is not None:  # (every write is atomic: the half-written folder is only removed)
                shutil.rmtree(self.final_save, ignore_errors=True)
                print(f"\n{name} received again: stopped during the final save, so the final model was NOT "
                      "written; the last checkpoint is kept (auto_resume_from_checkpoints: true finishes the run "
                      "from it)", flush=True)
            os._exit(128 + signum)
        self.received = signum
        if self.final_save is not None:
            print(f"\n{name} received: the run's steps are done and its final model is being saved; send it again "
                  "to stop at once (the model would then not be written)", flush=True)
        else:
            print(f"\n{name} received: saving a checkpoint at the end of this step (send it again to stop at once)",
                  flush=True)

    def finishing(self, final_save) -> None:
        """The loop's steps are done and the final model is about to be saved (into `final_save`, a folder)."""
        if self.received is not None:
            print("(the signal came during the last step: the run is complete, so it saves its final model rather "
                  "than a checkpoint)", flush=True)
        self.final_save = final_save

    def requested(self, accelerator, step: int) -> bool:
        """Called by every rank after every step but the last."""
        if os.environ.get(SIGNAL_AT_STEP_ENV) == f"{accelerator.process_index}:{step}":
            os.kill(os.getpid(), signal.SIGTERM)
        if accelerator.num_processes == 1:
            return self.received is not None
        import torch.distributed as dist

        agreed = False
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            agreed = bool(flag.item())
        flag = torch.tensor([int(self.received is not None)], dtype=torch.int32)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flag)
        return agreed
