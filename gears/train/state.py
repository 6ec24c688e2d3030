"""Where training stands (TrainState, one per Trainer: Trainer.state) and a Trainer as a
checkpoint and back: what a checkpoint holds, what a resuming run must share with it
(`checkpoint_meta`, and the run's `fingerprint`), rank 0's write, and the read that every rank
resumes from (rank 0 reads, then broadcasts); and a stop on SIGTERM or SIGINT, which ends in a
checkpoint. Files are written by gears/train/checkpoint.py."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import signal
from dataclasses import dataclass, field

import numpy as np
import torch

from gears.device import to_device, to_host
from gears.errors import GearsInputError, TrainingStopped
from gears.io import CheckpointWriteError
from gears.model import code_digest, graph_buffer_names
from gears.train import checkpoint as ckpt
from gears.train.distributed import all_gather_objects, all_reduce_max, barrier, broadcast_object
from gears.train.runtime import run_threads, threads_change_no_bit


@dataclass
class History:
    """Per-epoch records of a training run (a checkpoint carries them)."""

    train_loss: list[float] = field(default_factory=list)
    val: list[dict] = field(default_factory=list)
    epoch_s: list[float] = field(default_factory=list)
    cells_per_s: list[float] = field(default_factory=list)
    skipped_steps: list[int] = field(default_factory=list)  # GradScaler (fp16) skips per epoch

    def record(self, loss: float, val: dict, epoch_s: float, cells_per_s: float) -> None:
        self.train_loss.append(loss)
        self.val.append(val)
        self.epoch_s.append(epoch_s)
        self.cells_per_s.append(cells_per_s)


WALL_CLOCK = ("epoch_s", "cells_per_s")  # History's timings: no two runs share them


def _same(a, b) -> bool:
    """Equal bit for bit: tensors by torch.equal (on the host), containers item by item, NaN
    equal to NaN."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        tensors = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        return tensors and torch.equal(to_host(a), to_host(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b) or bool(a != a and b != b)  # (NaN != NaN)


@dataclass(eq=False)
class TrainState:
    """Where training stands: the Trainer's one record of it (Trainer.state), which a
    checkpoint saves and a resume restores whole (the network, optimizer, schedule, GradScaler
    and RNGs hold their own states, saved beside it).

    The fp16 GradScaler's skipped steps are counted on the device (count_skip: no host sync)
    and folded into the host count `skipped_steps` at epoch ends and checkpoints (fold_skips,
    a host sync)."""

    epoch: int = 0  # epochs completed
    step: int = 0  # optimizer steps taken
    best_metric: float = float("inf")  # the best (lowest) selection score so far
    best_epoch: int = -1  # the epoch that scored it (0-based; -1: none yet)
    best_state: dict | None = field(default=None, repr=False)  # its weights (fit ends with them)
    stale_epochs: int = 0  # epochs since the last improvement (early stopping)
    # The position within an epoch stopped by SIGTERM or SIGINT, which a resume continues:
    # {"epoch", "batch" (micro-batches done), "cells", "loss_sum" (each rank's, [world_size])}.
    partial: dict | None = None
    history: History = field(default_factory=History)
    skipped_steps: int = 0  # steps the GradScaler skipped, all epochs, as of the last fold
    device_skips: torch.Tensor | None = None  # skips since the last fold, on the device

    def count_skip(self, skipped: torch.Tensor) -> None:
        """Add a step's skip flag (a bool tensor on the device) to the device count."""
        if self.device_skips is None:
            self.device_skips = torch.zeros((), dtype=torch.long, device=skipped.device)
        self.device_skips.add_(skipped)

    def fold_skips(self) -> int:
        """Fold the device count into skipped_steps (a host sync when there is one).
        -> skipped_steps, all epochs."""
        if self.device_skips is not None:
            self.skipped_steps += int(to_host(self.device_skips).item())
            self.device_skips = None
        return self.skipped_steps

    def steps_into_epoch(self, grad_accum_steps: int) -> int:
        """Optimizer steps taken in the epoch a stop interrupted (0 at an epoch's end)."""
        return self.partial["batch"] // grad_accum_steps if self.partial else 0

    def to_checkpoint(self) -> dict:
        """The state as a checkpoint's keys (plain values and tensors: weights_only-loadable);
        the device count folded in."""
        history = {
            k: [_plain(v) for v in vals] for k, vals in dataclasses.asdict(self.history).items()
        }
        return {
            "epoch": self.epoch,
            "step": self.step,
            "best_metric": float(self.best_metric),
            "best_epoch": self.best_epoch,
            "best_state": self.best_state,
            "stale_epochs": self.stale_epochs,
            "partial": self.partial,
            "history": history,
            "skipped_steps": self.fold_skips(),
        }

    @classmethod
    def from_checkpoint(cls, state: dict) -> TrainState:
        """to_checkpoint's keys (a checkpoint of format 2, all of whose writers saved them)."""
        return cls(
            epoch=state["epoch"],
            step=state["step"],
            best_metric=state["best_metric"],
            best_epoch=state["best_epoch"],
            best_state=state["best_state"],
            stale_epochs=state["stale_epochs"],
            partial=state["partial"],
            history=History(**state["history"]),
            skipped_steps=state["skipped_steps"],
        )

    def __eq__(self, other) -> bool:
        """The same training state, bit for bit (tensors by torch.equal; skipped steps with the
        device count, a host sync), except the history's wall-clock records (epoch_s,
        cells_per_s), which no two runs share: a resumed run equals the uninterrupted one."""
        if not isinstance(other, TrainState):
            return NotImplemented
        return _same(self._compared(), other._compared())

    def _compared(self) -> dict:
        """What __eq__ compares: every field, with the device count in skipped_steps and the
        history without its timings."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        history = dataclasses.asdict(self.history)
        on_device = 0 if self.device_skips is None else int(to_host(self.device_skips).item())
        return {
            **fields,
            "history": {k: v for k, v in history.items() if k not in WALL_CLOCK},
            "skipped_steps": self.skipped_steps + on_device,
            "device_skips": None,
        }


@dataclass
class EpochTotals:
    """An epoch's running totals on this rank, and the batch it starts at (0, or where a
    SIGTERM stopped it)."""

    loss_sum: torch.Tensor
    cells: int = 0
    start: int = 0


def epoch_position(trainer, epoch: int) -> EpochTotals:
    """Where this epoch starts: at batch 0, or where a SIGTERM stopped it (state.partial, with
    this rank's loss sum and the cells seen so far)."""
    state, device = trainer.state, trainer.device
    totals = EpochTotals(torch.zeros((), device=device))
    partial = state.partial
    if partial is not None and partial["epoch"] == epoch:
        totals.start, totals.cells = partial["batch"], partial["cells"]
        totals.loss_sum += to_device(partial["loss_sum"][trainer.env.rank], device)
    state.partial = None
    return totals


def stop_mid_epoch(trainer, epoch: int, batches_done: int, totals: EpochTotals):
    """A stop agreed within the epoch: record the position in state.partial (each rank's
    running loss over its shard, so each resumes its own sum) for the checkpoint; fit() then
    stops. -> train_epoch's (NaN loss, cells seen by all ranks)."""
    sums = all_gather_objects(trainer.env, to_host(totals.loss_sum))
    trainer.state.partial = {
        "epoch": epoch,
        "batch": batches_done,
        "cells": totals.cells,
        "loss_sum": torch.stack(sums),  # [world_size]
    }
    return float("nan"), totals.cells * trainer.env.world_size


@contextlib.contextmanager
def stop_requests(trainer):
    """While training: SIGTERM (Slurm's preemption / time-limit signal) and SIGINT (Ctrl-C) set
    trainer.stop_requested, which the ranks agree on at the next step boundary; a second SIGINT
    stops at once (e.g. a hung collective). The previous handlers come back after."""

    def on_signal(signum, frame):
        if signum == signal.SIGINT and trainer.stop_requested == signal.SIGINT:
            raise KeyboardInterrupt
        trainer.stop_requested = int(signum)

    previous = {}
    for signum in (signal.SIGTERM, signal.SIGINT):
        try:
            previous[signum] = signal.signal(signum, on_signal)
        except ValueError:  # not the main thread (e.g. a notebook worker): no handler
            pass
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def stop_on_signal(trainer) -> None:
    """Every rank, after an agreed stop: rank 0 writes the checkpoint (mid-epoch position
    included), then all leave through TrainingStopped."""
    signum = signal.SIGINT if trainer.stop_agreed == signal.SIGINT else signal.SIGTERM
    name = signal.Signals(signum).name
    state, where = trainer.state, None
    if trainer.out_dir is not None:
        if state.partial is not None:
            write_checkpoint(trainer)
        where = ckpt.list_checkpoints(os.path.join(trainer.out_dir, "checkpoints"))[-1:]
    if trainer.env.is_main:
        into = state.steps_into_epoch(trainer.cfg.grad_accum_steps)
        saved = (
            f"wrote {where[0]}; run the same command with train.resume=true to continue"
            if where
            else "no out_dir, nothing saved"
        )
        print(
            f"{name} received: stopped after {ckpt.position(state.epoch, into, state.step)}; "
            f"{saved}",
            flush=True,
        )
    raise TrainingStopped(f"stopped by {name} at step {state.step}", signum)


def rng_state(device: torch.device | None = None) -> dict:
    """Host RNG states, plus the CUDA generator of this process's own GPU (one per rank; not
    every visible GPU's, which another machine may not have)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)  # GPU-only
    return state


def set_rng_state(state: dict, device: torch.device | None = None) -> None:
    """Restore `rng_state`'s output on any device. RNG states must be CPU byte tensors whatever
    device wrote the file; a CUDA state is restored only into this process's GPU, and a state
    from an older checkpoint (a list, one per GPU) gives this GPU's entry or the first."""
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_cpu_bytes(state["torch"]))
    cuda = state.get("cuda")
    if cuda is None or device is None or device.type != "cuda":
        return
    if isinstance(cuda, (list, tuple)):
        cuda = cuda[device.index] if (device.index or 0) < len(cuda) else cuda[0]
    torch.cuda.set_rng_state(_cpu_bytes(cuda), device)  # GPU-only


def _cpu_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.uint8)


def _plain(value):
    """numpy scalars and containers of them as Python floats/ints (weights_only-loadable)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def checkpoint_meta(trainer) -> dict:
    """What a checkpoint must share with the run resuming it (checked by name on resume)."""
    cfg = trainer.cfg
    return {
        "vocab_hash": trainer.vocab_hash,
        **trainer.model_cfg.shape_fields(),
        # A mid-epoch position only means the same batches with these:
        "world_size": trainer.env.world_size,
        "train.batch_size": cfg.batch_size,
        "train.grad_accum_steps": cfg.grad_accum_steps,
        "train.batching": cfg.batching,
    }


def fingerprint(trainer) -> dict:
    """The run's identity (gears.train.checkpoint.run_fingerprint: settings, data, split, graphs,
    world size; a fork's source, gears.model.code_digest), computed once per trainer; a
    resume must match it (checkpoint.check_resume)."""
    if trainer._fingerprint is None:
        config = dict(trainer.run_config or {"seed": trainer.seed})
        config["train"] = dataclasses.asdict(trainer.cfg)
        config["model"] = dataclasses.asdict(trainer.model_cfg)
        config.setdefault("distributed", {"sync_batchnorm": trainer.dist_cfg.sync_batchnorm})
        config.setdefault("eval", {"control_mean": trainer.evaluator.control_mean})
        buffers = dict(trainer.net.named_buffers())
        graphs = {n: buffers[n] for n in graph_buffer_names(trainer.net) if n in buffers}
        trainer._fingerprint = ckpt.run_fingerprint(
            config, trainer.pert_data, graphs, trainer.env.world_size
        )
        code = code_digest(type(trainer.net))
        if code is not None:  # a fork's code, by content (model.impl names only its file)
            trainer._fingerprint["code:network"] = code
    return trainer._fingerprint


def training_state(trainer) -> dict:
    """The whole training state as tensors and plain values (weights_only-loadable): the run's
    identity, its TrainState, and the states of the network, optimizer, schedule, GradScaler
    and RNGs."""
    return {
        "format": ckpt.FORMAT_VERSION,
        "meta": checkpoint_meta(trainer),
        "fingerprint": fingerprint(trainer),
        "config": {
            "train": dataclasses.asdict(trainer.cfg),
            "model": dataclasses.asdict(trainer.model_cfg),
        },
        **trainer.state.to_checkpoint(),
        "model": trainer.net.state_dict(),
        "optimizer": trainer.opt.state_dict(),
        "scheduler": trainer.sched.state_dict(),
        "scaler": trainer.scaler.state_dict(),
        "rng": rng_state(trainer.device),
        "world_size": trainer.env.world_size,
        "cpu_threads": run_threads(),  # the run's, not the count a busy CPU left it
    }


def write_checkpoint(trainer) -> None:
    """Rank 0 writes the state into out_dir/checkpoints (the newest two kept), between two
    barriers: every rank has finished the epoch before, and waits for the file after. A write
    that fails on rank 0 (a full disk) stops every rank with rank 0's one line."""
    folder = os.path.join(trainer.out_dir, "checkpoints")
    barrier(trainer.env)
    failed = None
    if trainer.env.is_main:
        done = trainer.state.steps_into_epoch(trainer.cfg.grad_accum_steps)
        path = ckpt.checkpoint_path(folder, trainer.state.epoch, done)
        try:
            ckpt.atomic_save(training_state(trainer), path)
            ckpt.prune(folder, keep=2)
        except CheckpointWriteError as e:
            failed = str(e)
    failed = broadcast_object(trainer.env, failed)  # (also the barrier after the write)
    if failed is not None:
        error = CheckpointWriteError(failed)
        error.reported = not trainer.env.is_main  # one line, from rank 0
        error.every_rank = True
        raise error


def read_checkpoint(trainer, log) -> dict | None:
    """The newest readable, compatible checkpoint, read by rank 0 and broadcast: only rank 0
    writes checkpoints, so on node-local disks the other nodes have none (every rank must
    resume from the same state, or their epochs and collectives stop matching). A refusal on
    rank 0 is raised on every rank."""
    outcome = None
    if trainer.env.is_main:
        folder = os.path.join(trainer.out_dir, "checkpoints")
        try:
            # On the CPU whatever device wrote it: load_state_dict moves weights and optimizer
            # state to the parameters' device; RNG states must stay CPU tensors.
            state = ckpt.load_for_resume(folder, map_location="cpu", log=log)
            if state is not None:
                mid_epoch = bool(state.get("partial"))
                expected = {
                    k: v
                    for k, v in checkpoint_meta(trainer).items()
                    if mid_epoch or k == "vocab_hash" or k.startswith("model.")
                }
                ckpt.check_compatible(state, state["path"], expected)
                ckpt.check_resume(state, state["path"], fingerprint(trainer))
            outcome = (state, None)
        except GearsInputError as e:
            outcome = (None, str(e))
    state, refusal = broadcast_object(trainer.env, outcome)
    if refusal is not None:
        raise GearsInputError(refusal)
    return state


def restore(trainer, state: dict, optimizer_kernel: dict) -> None:
    """Load a checkpoint's state into the trainer: its TrainState whole, and the network's,
    optimizer's, schedule's, GradScaler's and RNGs' states. optimizer_kernel: this device's
    update kernel, named in the optimizer state before loading it (a loaded state carries the
    writer's choice, fused or foreach; naming this one lets load_state_dict place Adam's step
    counters where it wants them: fused, float32 on the parameters' device; foreach, as loaded,
    on the host, since checkpoints load to CPU)."""
    trainer.net.load_state_dict(state["model"])
    for group in state["optimizer"]["param_groups"]:
        group.update(optimizer_kernel)
    trainer.opt.load_state_dict(state["optimizer"])
    trainer.sched.load_state_dict(state["scheduler"])
    for group in trainer.opt.param_groups:
        # A planned run saves each learning rate as a tensor on its device (float32 on a GPU),
        # loaded here as a CPU tensor. Kept as it is, a captured step on a GPU reads it once, at
        # the capture, and never sees the schedule's later rates. It becomes a Python number
        # again, as in a fresh run; the planned step makes its own tensor (graph_step.tensor_lr).
        if torch.is_tensor(group["lr"]):
            group["lr"] = group["lr"].item()
    # An fp32 or bf16 run saves a disabled scaler's empty state; fp16 then starts afresh.
    if state["scaler"]:
        trainer.scaler.load_state_dict(state["scaler"])
    set_rng_state(state["rng"], trainer.device)
    trainer.state = TrainState.from_checkpoint(state)


def resume(trainer, asked: bool, optimizer_kernel: dict) -> bool:
    """Load the newest readable checkpoint in out_dir/checkpoints into the trainer, if any,
    when any rank asks: after a node's worker fails, torchrun counts a restart on that node
    only (TORCHELASTIC_RESTART_COUNT; the other nodes restart for the membership change without
    counting), yet every rank must resume. Every rank calls this. -> whether it resumed."""
    env = trainer.env
    if env.distributed:
        flag = to_device(torch.tensor(float(asked)), trainer.device)
        asked = bool(to_host(all_reduce_max(env, flag)).item())
    if not asked:
        return False
    log = print if env.is_main else (lambda *_: None)
    state = read_checkpoint(trainer, log)
    if state is None:
        folder = os.path.join(trainer.out_dir, "checkpoints")
        log(f"train.resume: no checkpoint in {folder}; starting from scratch")
        return False
    restore(trainer, state, optimizer_kernel)
    at = trainer.state
    into = at.steps_into_epoch(trainer.cfg.grad_accum_steps)
    log(f"resumed from {state['path']}: after {ckpt.position(at.epoch, into, at.step)}")
    threads, now = state.get("cpu_threads"), run_threads()
    exact = threads_change_no_bit()  # fp32 built-in network, MKL strict: any count, same bits
    if trainer.device.type == "cpu" and threads is not None and threads != now and not exact:
        log(
            f"note: this run has {now} CPU threads, the checkpoint's run had {threads}: float "
            "sums add in another order, so it ends near, not exactly at, where that run "
            f"would have (train.threads={threads} resumes it exactly)"
        )
    return True
