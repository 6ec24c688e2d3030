"""A Trainer's state as a checkpoint and back: what a checkpoint holds, what a resuming run
must share with it (`checkpoint_meta`, and the run's `fingerprint`), rank 0's write, and the
read that every rank resumes from (rank 0 reads, then broadcasts); and a stop on SIGTERM or
SIGINT, which ends in a checkpoint. Files are written by gears/checkpoint.py."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import signal
from dataclasses import dataclass, field

import numpy as np
import torch

from gears import checkpoint as ckpt
from gears.device import to_device, to_host
from gears.distributed import all_gather_objects, all_reduce_max, barrier, broadcast_object
from gears.errors import GearsInputError, TrainingStopped
from gears.model import code_digest, graph_buffer_names


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


@dataclass
class EpochTotals:
    """An epoch's running totals on this rank, and the batch it starts at (0, or where a
    SIGTERM stopped it)."""

    loss_sum: torch.Tensor
    cells: int = 0
    start: int = 0


def epoch_position(trainer, epoch: int) -> EpochTotals:
    """Where this epoch starts: at batch 0, or where a SIGTERM stopped it (trainer.partial, with
    this rank's loss sum and the cells seen so far)."""
    totals = EpochTotals(torch.zeros((), device=trainer.device))
    partial = trainer.partial
    if partial is not None and partial["epoch"] == epoch:
        totals.start, totals.cells = partial["batch"], partial["cells"]
        totals.loss_sum += to_device(partial["loss_sum"][trainer.env.rank], trainer.device)
    trainer.partial = None
    return totals


def stop_mid_epoch(trainer, epoch: int, batches_done: int, totals: EpochTotals):
    """A stop agreed within the epoch: record the position in trainer.partial (each rank's
    running loss over its shard, so each resumes its own sum) for the checkpoint; fit() then
    stops. -> train_epoch's (NaN loss, cells seen by all ranks)."""
    sums = all_gather_objects(trainer.env, to_host(totals.loss_sum))
    trainer.partial = {
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
    where = None
    if trainer.out_dir is not None:
        if trainer.partial is not None:
            write_checkpoint(trainer)
        where = ckpt.list_checkpoints(os.path.join(trainer.out_dir, "checkpoints"))[-1:]
    if trainer.env.is_main:
        into = trainer.partial["batch"] // trainer.cfg.grad_accum_steps if trainer.partial else 0
        saved = (
            f"wrote {where[0]}; run the same command with train.resume=true to continue"
            if where
            else "no out_dir, nothing saved"
        )
        print(
            f"{name} received: stopped after {ckpt.position(trainer.epoch, into, trainer.step)}; "
            f"{saved}",
            flush=True,
        )
    raise TrainingStopped(f"stopped by {name} at step {trainer.step}", signum)


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
    """The run's identity (gears.checkpoint.run_fingerprint: settings, data, split, graphs,
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
    """The whole training state as tensors and plain values (weights_only-loadable)."""
    history = {
        k: [_plain(v) for v in vals] for k, vals in dataclasses.asdict(trainer.history).items()
    }
    return {
        "format": ckpt.FORMAT_VERSION,
        "meta": checkpoint_meta(trainer),
        "fingerprint": fingerprint(trainer),
        "config": {
            "train": dataclasses.asdict(trainer.cfg),
            "model": dataclasses.asdict(trainer.model_cfg),
        },
        "partial": trainer.partial,
        "skipped_steps": trainer.skipped_steps,
        "model": trainer.net.state_dict(),
        "optimizer": trainer.opt.state_dict(),
        "scheduler": trainer.sched.state_dict(),
        "scaler": trainer.scaler.state_dict(),
        "rng": rng_state(trainer.device),
        "epoch": trainer.epoch,
        "step": trainer.step,
        "best_metric": float(trainer.best_metric),
        "best_epoch": trainer.best_epoch,
        "best_state": trainer.best_state,
        "stale_epochs": trainer.stale_epochs,
        "history": history,
        "world_size": trainer.env.world_size,
        "cpu_threads": torch.get_num_threads(),
    }


def write_checkpoint(trainer) -> None:
    """Rank 0 writes the state into out_dir/checkpoints (the newest two kept), between two
    barriers: every rank has finished the epoch before, and waits for the file after. A write
    that fails on rank 0 (a full disk) stops every rank with rank 0's one line."""
    folder = os.path.join(trainer.out_dir, "checkpoints")
    barrier(trainer.env)
    failed = None
    if trainer.env.is_main:
        partial = trainer.partial
        done = partial["batch"] // trainer.cfg.grad_accum_steps if partial else 0
        path = ckpt.checkpoint_path(folder, trainer.epoch, done)
        try:
            ckpt.atomic_save(training_state(trainer), path)
            ckpt.prune(folder, keep=2)
        except ckpt.CheckpointWriteError as e:
            failed = str(e)
    failed = broadcast_object(trainer.env, failed)  # (also the barrier after the write)
    if failed is not None:
        error = ckpt.CheckpointWriteError(failed)
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
    """Load a checkpoint's state into the trainer. optimizer_kernel: this device's update
    kernel, named in the optimizer state before loading it (a loaded state carries the writer's
    choice, fused or foreach; naming this one lets load_state_dict place Adam's step counters
    where it wants them: fused, float32 on the parameters' device; foreach, as loaded, on the
    host, since checkpoints load to CPU)."""
    trainer.net.load_state_dict(state["model"])
    for group in state["optimizer"]["param_groups"]:
        group.update(optimizer_kernel)
    trainer.opt.load_state_dict(state["optimizer"])
    trainer.sched.load_state_dict(state["scheduler"])
    # An fp32 or bf16 run saves a disabled scaler's empty state; fp16 then starts afresh.
    if state["scaler"]:
        trainer.scaler.load_state_dict(state["scaler"])
    set_rng_state(state["rng"], trainer.device)
    trainer.epoch, trainer.step = state["epoch"], state["step"]
    trainer.best_metric, trainer.best_epoch = state["best_metric"], state["best_epoch"]
    trainer.best_state, trainer.stale_epochs = state["best_state"], state["stale_epochs"]
    trainer.history = History(**state["history"])
    trainer.partial, trainer.skipped_steps = state["partial"], state["skipped_steps"]


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
    into = trainer.partial["batch"] // trainer.cfg.grad_accum_steps if trainer.partial else 0
    log(f"resumed from {state['path']}: after {ckpt.position(trainer.epoch, into, trainer.step)}")
    threads, now = state.get("cpu_threads"), torch.get_num_threads()
    if trainer.device.type == "cpu" and threads is not None and threads != now:
        log(
            f"note: this run has {now} CPU threads, the checkpoint's run had {threads}: float "
            "sums add in another order, so it ends near, not exactly at, where that run "
            f"would have (train.threads={threads} resumes it exactly)"
        )
    return True
