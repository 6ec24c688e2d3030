"""A Trainer's state as a checkpoint and back: what a checkpoint holds, what a resuming run
must share with it (`checkpoint_meta`), rank 0's write, and the read that every rank resumes
from (rank 0 reads, then broadcasts). Files are written by gears/checkpoint.py."""

from __future__ import annotations

import dataclasses
import os
import random
from dataclasses import dataclass, field

import numpy as np
import torch

from gears import checkpoint as ckpt
from gears.device import to_device, to_host
from gears.distributed import all_gather_objects, all_reduce_max, barrier, broadcast_object
from gears.errors import GearsInputError


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


def training_state(trainer) -> dict:
    """The whole training state as tensors and plain values (weights_only-loadable)."""
    history = {
        k: [_plain(v) for v in vals] for k, vals in dataclasses.asdict(trainer.history).items()
    }
    return {
        "format": ckpt.FORMAT_VERSION,
        "meta": checkpoint_meta(trainer),
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
    barriers: every rank has finished the epoch before, and waits for the file after."""
    folder = os.path.join(trainer.out_dir, "checkpoints")
    barrier(trainer.env)
    if trainer.env.is_main:
        partial = trainer.partial
        done = partial["batch"] // trainer.cfg.grad_accum_steps if partial else 0
        path = ckpt.checkpoint_path(folder, trainer.epoch, done)
        ckpt.atomic_save(training_state(trainer), path)
        ckpt.prune(folder, keep=2)
    barrier(trainer.env)


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
            state = ckpt.load_latest(folder, map_location="cpu", log=log)
            if state is not None:
                mid_epoch = bool(state.get("partial"))
                expected = {
                    k: v
                    for k, v in checkpoint_meta(trainer).items()
                    if mid_epoch or k == "vocab_hash" or k.startswith("model.")
                }
                ckpt.check_compatible(state, state["path"], expected)
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
    where = f", {trainer.partial['batch']} batches into the next" if trainer.partial else ""
    log(f"resumed from {state['path']} (epoch {trainer.epoch}{where}, step {trainer.step})")
    threads, now = state.get("cpu_threads"), torch.get_num_threads()
    if trainer.device.type == "cpu" and threads is not None and threads != now:
        log(
            f"note: this run has {now} CPU threads, the checkpoint's run had {threads}: float "
            "sums add in another order, so it ends near, not exactly at, where that run "
            f"would have (train.threads={threads} resumes it exactly)"
        )
    return True
