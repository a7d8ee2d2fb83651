"""A diverged update: a non-finite loss or gradient norm stops the actor before the optimizer applies it.

Every rank agrees (one flag reduced over the group), so all ranks stop at the same minibatch and none waits
in a collective for a peer that left. The actor then exits with EXIT_DIVERGED: nothing from the bad weights
reaches a rollout or a checkpoint, and the launchers do not restart it (it would diverge again).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist

from rljob.runtime.process.termination import write_termination_message
from rljob.runtime.wire.context import RoleContext
from rljob.runtime.wire.identity import EXIT_DIVERGED


class Diverged(RuntimeError):
    """Raised by a learner instead of applying an update whose loss or gradient norm is not finite."""

    def __init__(self, step: int, values: dict[str, float], here: bool) -> None:
        self.step = step
        self.values = values
        self.here = here
        """False: this rank's values were finite, another rank's were not."""
        self.last_good = ""
        """The newest checkpoint, as the actor names it (see `with_checkpoint`)."""
        super().__init__(self.describe())

    def describe(self) -> str:
        shown = ", ".join(f"{name} {value:.6g}" for name, value in self.values.items())
        if self.here:
            bad = [name for name, value in self.values.items() if not math.isfinite(value)]
            what = f"non-finite {' and '.join(bad)} ({shown})"
        else:
            what = f"a non-finite loss or gradient norm on another actor rank (here: {shown})"
        message = f"diverged at step {self.step}: {what}; the update was not applied"
        if self.last_good:
            message += f"; {self.last_good}"
        return message

    def with_checkpoint(self, checkpoints: list[tuple[int, Path]]) -> Diverged:
        """Name the last good checkpoint (the newest one: every checkpoint predates the bad update)."""
        if checkpoints:
            step, path = checkpoints[-1]
            self.last_good = f"last good checkpoint: {path} (step {step})"
        else:
            self.last_good = "no checkpoint was written before it (spec.checkpoint.interval)"
        self.args = (self.describe(),)
        return self


def check_update(step: int, values: dict[str, float], world_size: int, device: torch.device) -> None:
    """Raise Diverged, on every rank, when any rank's `values` (loss, grad norm) are not all finite."""
    bad = not all(math.isfinite(v) for v in values.values())
    agreed = bad
    if world_size > 1:
        flag = torch.tensor([1.0 if bad else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        agreed = bool(flag.item())
    if agreed:
        raise Diverged(step, values, here=bad)


def diverged_exit(context: RoleContext, exc: Diverged) -> int:
    """Log the values and the last good checkpoint, leave them as the pod's termination message (which the
    operator copies into the Diverged condition), and return
    EXIT_DIVERGED (the launchers fail the job on it instead of restarting the actor group)."""
    context.log.error("%s", exc)
    if context.identity.local_rank == 0:
        write_termination_message(str(exc))
    return EXIT_DIVERGED
