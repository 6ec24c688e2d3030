"""Injected faults for the kill, preemption and NaN tests (GEARS_FAULT_KILL), kept out of the
training step: the engine calls two hooks, and a NaN loss comes from a forward hook; and rank 0's
injected delays (GEARS_TEST_SLOW_RANK0)."""

from __future__ import annotations

import os
import signal
import time

import torch

ENV_VAR = "GEARS_FAULT_KILL"


class FaultPlan:
    """GEARS_FAULT_KILL=<rank|all>:<epoch|step>:<n>[:<SIGNAL>[:parent]] sends SIGKILL (or the
    named signal, e.g. TERM) to that rank after epoch or optimizer step n, on the first attempt
    only: a resumed run (every rank of a torchrun restart, including nodes whose
    TORCHELASTIC_RESTART_COUNT stayed 0) is disarmed; `:parent` signals the parent process
    instead (the torchrun agent, as Slurm does). `<rank>:step:<n>:NAN` sends nothing and makes
    that rank's training loss of optimizer step n NaN (its network's training outputs are).
    Inert without the variable. It holds no reference to the Trainer."""

    def __init__(self, spec: str | None, rank: int):
        self.armed = False
        self.kind, self.n, self.signal, self.parent, self.nan = "", 0, None, False, False
        self.next_step = 1  # the optimizer step the coming training forwards belong to
        if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return
        who, kind, n, *sig = spec.split(":")
        if who not in ("all", str(rank)):
            return
        self.armed, self.kind, self.n = True, kind, int(n)
        self.nan = sig == ["NAN"]
        if not self.nan:
            self.signal = getattr(signal, f"SIG{sig[0]}") if sig else signal.SIGKILL
            self.parent = sig[1:] == ["parent"]

    @classmethod
    def from_env(cls, rank: int) -> FaultPlan:
        return cls(os.environ.get(ENV_VAR), rank)

    def attach(self, net: torch.nn.Module) -> None:
        """For a NaN plan, a forward hook that poisons the network's training outputs of step
        n (every micro-batch of it); nothing otherwise."""
        if self.armed and self.nan:
            net.register_forward_hook(self._poison)

    def disarm(self) -> None:
        """A resumed run: no fault (the first attempt had it)."""
        self.armed = False

    def after_step(self, epoch: int, step: int) -> None:
        self.next_step = step + 1
        self._fire("step", step)

    def after_epoch(self, epoch: int, step: int) -> None:
        self._fire("epoch", epoch)

    def _fire(self, where: str, n: int) -> None:
        if self.armed and not self.nan and self.kind == where and self.n == n:
            os.kill(os.getppid() if self.parent else os.getpid(), self.signal)

    def _poison(self, module: torch.nn.Module, inputs, output):
        if not (
            self.armed and module.training and self.kind == "step" and self.n == self.next_step
        ):
            return output
        if isinstance(output, tuple):
            return tuple(o * float("nan") for o in output)
        return output * float("nan")


def injected_delay(stage: str, rank: int) -> None:
    """Test hook: GEARS_TEST_SLOW_RANK0=data:10,scoring:10 makes rank 0's data step or scoring
    that many seconds slower (tests that no other rank waits for them in a collective);
    refusal:3 delays rank 0's raising of a refusal every rank raises (tests that rank 0's line
    is printed before the other ranks exit)."""
    spec = os.environ.get("GEARS_TEST_SLOW_RANK0")
    if rank != 0 or not spec:
        return
    delays = dict(item.split(":") for item in spec.split(","))
    if stage in delays:
        time.sleep(float(delays[stage]))
