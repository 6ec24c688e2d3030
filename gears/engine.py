"""The one training loop, for 1 or N processes: AMP, accumulation, clipping, eval, checkpoints."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
import torch._functorch.config
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gears import checkpoint as ckpt
from gears.choices import CHOICES
from gears.config import DistributedConfig, ModelConfig, TrainConfig, check_impl
from gears.device import to_device, to_host
from gears.distributed import (
    DistEnv,
    all_gather_objects,
    all_reduce_max,
    all_reduce_mean,
    barrier,
    broadcast_object,
    set_tf32,
)
from gears.errors import GearsInputError, NonFiniteLossError, TrainingStopped
from gears.evaluate import Evaluator
from gears.model.kernels import gather_rows
from gears.model.losses import gears_loss
from gears.model.rows import pad_rows, use_cell_rows

# loss_on(batch, CELL_ROWS): one row per cell instead of one per distinct perturbation.
CELL_ROWS = "cells"


class RepeatRows(NamedTuple):
    """loss_on layout: distinct row u repeated repeats[u] times, every row standing for `count`
    cells (counts [8, 4, 4] -> 4 rows of 4 cells): uniform rows take the native batch-norm
    kernel. Exact: copies of a row have equal outputs, each cell reads its first copy, and the
    gradient summed over the copies is the per-cell batch's."""

    count: float
    repeats: torch.Tensor  # [U] long, host


def _plain(value):
    """numpy scalars and containers of them as Python floats/ints (weights_only-loadable)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def seed_everything(seed: int) -> None:
    """Seed every generator. GEARS_DETERMINISTIC=1 also selects deterministic kernels (GPU
    reruns then match bit for bit; CPU reruns always do)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if os.environ.get("GEARS_DETERMINISTIC", "0") == "1":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts
        torch.use_deterministic_algorithms(True)


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """None for fp32; bf16 on CPU or CUDA; fp16 on CUDA only (with a GradScaler)."""
    if precision == "fp32":
        return None
    if precision == "bf16":
        # Emulated bf16 (V100, T4) is far slower than fp16 there: ask for the native kind.
        if device.type == "cuda":
            if not torch.cuda.is_bf16_supported(including_emulation=False):  # GPU-only
                raise GearsInputError("train.precision=bf16 is not supported by this GPU; use fp16")
        return torch.bfloat16
    if precision == "fp16":
        if device.type != "cuda":
            raise GearsInputError(
                "train.precision=fp16 needs a CUDA device (autocast + GradScaler); on CPU use "
                "train.precision=bf16"
            )
        return torch.float16
    raise GearsInputError(f"unknown train.precision {precision!r}: {CHOICES['train.precision']}")


def optimizer_kernel(optimizer: str, device: torch.device) -> dict[str, bool | None]:
    """The update kernel for a device: fused Adam/AdamW on CUDA and CPU (one kernel for all
    parameters; on CPU 3.4x faster than `foreach`, 0.46 vs 1.56 ms a step at 1,000 genes, with
    the same parameters to ~1e-6), the multi-tensor `foreach` path elsewhere (SGD, other
    devices)."""
    if device.type in ("cuda", "cpu") and optimizer in ("adam", "adamw"):
        return {"fused": True, "foreach": None}
    return {"fused": None, "foreach": True}


def make_optimizer(
    params, cfg: TrainConfig, device: torch.device | None = None
) -> torch.optim.Optimizer:
    """Adam with L2 weight decay, as GEARS (adamw and plain sgd on request)."""
    kinds = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
    if cfg.optimizer not in CHOICES["train.optimizer"]:
        raise GearsInputError(
            f"unknown train.optimizer {cfg.optimizer!r}: {CHOICES['train.optimizer']}"
        )
    kernel = optimizer_kernel(cfg.optimizer, device or torch.device("cpu"))
    return kinds[cfg.optimizer](params, lr=cfg.lr, weight_decay=cfg.weight_decay, **kernel)


def make_scheduler(opt: torch.optim.Optimizer, cfg: TrainConfig):
    """The learning-rate schedule train.schedule names, stepped once per epoch."""
    if cfg.schedule == "step":  # GEARS: halve the learning rate after every epoch
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=cfg.step_gamma)
    if cfg.schedule == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(cfg.epochs, 1))
    if cfg.schedule == "constant":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    raise GearsInputError(f"unknown train.schedule {cfg.schedule!r}: {CHOICES['train.schedule']}")


def selection_score(rule: str, val: dict, loss: float, epoch: int) -> float:
    """Lower is better: the number Trainer.fit compares across epochs to keep a model.

    last: the final model (each epoch beats the previous one); val_mse: mean squared error over
    all genes of the validation perturbations; val_mse_de: over their top-20 DE genes (GEARS).
    The validation rules fall back to the training loss when there is no validation set.
    """
    if rule == "last":
        return -float(epoch)
    if rule not in CHOICES["train.select"]:
        raise GearsInputError(f"unknown train.select {rule!r}: {CHOICES['train.select']}")
    return val.get(rule.removeprefix("val_"), loss)


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


def graph_buffer_names(net: torch.nn.Module) -> list[str]:
    """The network's fixed graph buffers (identical on every rank, never to be broadcast)."""
    names = getattr(net, "graph_buffer_names", None)
    if callable(names):
        return list(names())
    return [n for n, _ in net.named_buffers() if "edge" in n.rsplit(".", 1)[-1]]


def _fault_injection(epoch: int, step: int, env: DistEnv, where: str, resumed: bool) -> bool:
    """Test hook: GEARS_FAULT_KILL=<rank|all>:<epoch|step>:<n>[:<SIGNAL>] sends SIGKILL (or the
    named signal, e.g. TERM) to that rank on the first attempt: a resumed run (every rank of a
    torchrun restart, including nodes whose TORCHELASTIC_RESTART_COUNT stayed 0) is disarmed;
    `<...>:TERM:parent` signals the parent process instead (the torchrun agent, as Slurm does).
    With NAN for the signal (`1:step:5:NAN`) nothing is sent: True at where="loss" tells the loop
    to make that rank's loss of optimizer step n NaN."""
    spec = os.environ.get("GEARS_FAULT_KILL")
    if not spec or resumed or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return False
    rank, kind, n, *sig = spec.split(":")
    if rank not in ("all", str(env.rank)):
        return False
    if sig == ["NAN"]:
        return where == "loss" and kind == "step" and int(n) == step
    if kind == where and int(n) == (epoch if where == "epoch" else step):
        target = os.getppid() if sig[1:] == ["parent"] else os.getpid()
        os.kill(target, getattr(signal, f"SIG{sig[0]}") if sig else signal.SIGKILL)
    return False


class FaultHooks:
    """The test hooks of GEARS_FAULT_KILL (_fault_injection), kept out of the training step:
    after_step / after_epoch may kill this process (or signal its parent), and with
    `<rank>:step:<n>:NAN` loss_on is wrapped so that step n's loss is NaN. Inert without the
    variable."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        spec = os.environ.get("GEARS_FAULT_KILL", "")
        if spec.endswith(":NAN"):
            loss_on = trainer.loss_on

            def nan_loss_on(batch, layout=None):
                loss = loss_on(batch, layout)
                if self._fire(0, trainer.step + 1, "loss"):
                    loss = loss * float("nan")
                return loss

            trainer.loss_on = nan_loss_on

    def _fire(self, epoch: int, step: int, where: str) -> bool:
        return _fault_injection(epoch, step, self.trainer.env, where, self.trainer.resumed)

    def after_step(self, epoch: int, step: int) -> None:
        self._fire(epoch, step, "step")

    def after_epoch(self, epoch: int, step: int) -> None:
        self._fire(epoch, step, "epoch")


class NonFiniteWatch:
    """Notes the first micro-batch since the last check whose loss is NaN/inf, without a host
    sync (a device-side index); check_step reads it at step boundaries. Off under GradScaler,
    which skips a non-finite step by itself."""

    def __init__(self, device: torch.device, enabled: bool):
        self.device, self.enabled = device, enabled
        self.first_bad = torch.full((), -1, dtype=torch.long, device=device)
        self.recorded: list[tuple[int, int, torch.Tensor]] = []  # (step, batch, condition ids)

    def record(self, loss: torch.Tensor, step: int, batch_no: int, cond_ids) -> None:
        if self.enabled:
            bad = (self.first_bad < 0) & ~torch.isfinite(loss)
            self.first_bad = torch.where(bad, len(self.recorded), self.first_bad)
        self.recorded.append((step, batch_no, cond_ids))

    def take(self) -> tuple[torch.Tensor, list]:
        """(index of the first bad micro-batch in the list or -1, the list); then starts over."""
        taken = self.first_bad, self.recorded
        self.first_bad = torch.full_like(self.first_bad, -1)
        self.recorded = []
        return taken


@dataclass
class EpochTotals:
    """An epoch's running totals on this rank, and the batch it starts at (0, or where a
    SIGTERM stopped it)."""

    loss_sum: torch.Tensor
    cells: int = 0
    start: int = 0


class TrainProgress:
    """Rank 0's progress bar, with the loss (a host sync) and wandb every train.log_every
    batches; nothing on other ranks or with progress=False."""

    def __init__(self, trainer: Trainer, epoch: int, n_batches: int, start: int, show: bool):
        self.trainer, self.bar = trainer, None
        if show and trainer.env.is_main:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=n_batches,
                initial=start,
                desc=f"epoch {epoch + 1}/{trainer.cfg.epochs}",
                leave=False,
                dynamic_ncols=True,
                mininterval=0.5,
            )

    def batch_done(self, i: int, loss: torch.Tensor) -> None:
        if self.bar is None:
            return
        self.bar.update(1)
        trainer = self.trainer
        if (i + 1) % trainer.cfg.log_every == 0:
            value = to_host(loss).item()  # the only host sync, at the logging interval
            self.bar.set_postfix(loss=f"{value:.4f}")
            if trainer.wandb is not None:
                lr = trainer.sched.get_last_lr()[0]
                trainer.wandb.log({"train/loss": value, "lr": lr}, step=trainer.step)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclass
class History:
    train_loss: list[float] = field(default_factory=list)
    val: list[dict] = field(default_factory=list)
    epoch_s: list[float] = field(default_factory=list)
    cells_per_s: list[float] = field(default_factory=list)
    skipped_steps: list[int] = field(default_factory=list)  # GradScaler (fp16) skips per epoch


def compiled_backward_as_eager(compiled: bool):
    """A context for calling a torch.compile'd network whose backward must mean what eager's
    means. Two defaults of PyTorch 2.13 differ: the compiled backward is traced under the
    forward's autocast (the fp32 layers' backward matmuls then ran in half precision: indv_b1's
    bf16 gradient 30x further from fp32 than eager's; pytorch#153044), and the partitioner may
    recompute, in the backward, reads of a parameter that the forward mutates in place (the
    max-norm embeddings: their gradients then used rows scaled twice, 50-80% off on a step that
    renormalises, fp32 included). tests/test_compile_amp.py fails without either setting."""
    if not compiled:
        return contextlib.nullcontext()
    return torch._functorch.config.patch(
        backward_pass_autocast="off", treat_parameters_as_free_to_save=False
    )


class Trainer:
    """Trains a GEARSNet on a PertData split. World size 1 is the single-process case."""

    def __init__(
        self,
        model: torch.nn.Module,
        pert_data,
        train_cfg: TrainConfig,
        model_cfg: ModelConfig,
        env: DistEnv,
        out_dir=None,
        dist_cfg: DistributedConfig | None = None,
        wandb_run=None,
        seed: int = 1,
        control_mean: str = "all",
    ):
        self.cfg, self.model_cfg, self.env = train_cfg, model_cfg, env
        self.pert_data = pert_data
        self.out_dir = out_dir
        self.wandb = wandb_run
        self.seed = seed
        self.device = env.device
        set_tf32(self.device, train_cfg.tf32)
        self.amp_dtype = autocast_dtype(train_cfg.precision, self.device)
        self.net = model.to(self.device)
        dist_cfg = dist_cfg or DistributedConfig()
        check_impl(model_cfg, train_cfg, dist_cfg)
        if env.distributed:
            set_sync = getattr(self.net, "set_sync_batchnorm", None)  # (the fast network's)
            if set_sync is not None:
                set_sync(dist_cfg.sync_batchnorm)
            # The graphs are built identically on every rank: DDP's default would broadcast
            # them (MBs at genome scale) from rank 0 before every forward.
            DDP._set_params_and_buffers_to_ignore_for_model(self.net, graph_buffer_names(self.net))
            self.model = DDP(
                self.net,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,  # GPU-only
                find_unused_parameters=dist_cfg.find_unused_parameters,
                static_graph=dist_cfg.static_graph,
                gradient_as_bucket_view=dist_cfg.gradient_as_bucket_view,
            )
        else:
            self.model = self.net
        if train_cfg.compile:  # distinct-perturbation rows padded to a few sizes in loss_on
            self.model = torch.compile(self.model, dynamic=False)
        self.opt = make_optimizer(self.net.parameters(), train_cfg, self.device)
        self.sched = make_scheduler(self.opt, train_cfg)
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.amp_dtype == torch.float16)
        self.gene_mask = to_device(torch.as_tensor(pert_data.non_zero_mask), self.device)
        self.ctrl_mean = to_device(
            torch.as_tensor(pert_data.ctrl_mean, dtype=torch.float32), self.device
        )
        self.evaluator = Evaluator(pert_data, env, self.net, control_mean=control_mean)
        self.history = History()
        self.epoch = 0  # epochs completed
        self.step = 0  # optimizer steps taken
        self.best_metric = float("inf")
        self.best_epoch = -1
        self.best_state = None
        self.stale_epochs = 0
        self.skipped_steps = 0  # optimizer steps GradScaler skipped (fp16 overflow), all epochs
        self.vocab_hash = ckpt.vocab_hash(pert_data.gene_names, pert_data.pert_names)
        self.stop_requested = False  # set by SIGTERM; acted on at the next step boundary
        self.stop_agreed = False  # some rank got SIGTERM (all-reduced at the last check)
        self.partial = None  # position within an epoch stopped by SIGTERM (resume continues)
        self.resumed = False  # training continues from a checkpoint
        # The stop / non-finite flags are read on the host every `check_every` optimizer steps:
        # every step on CPU (free), at the logging interval on GPU (a host sync each time).
        self.check_every = 1 if self.device.type == "cpu" else max(train_cfg.log_every, 1)
        self.params = [p for p in self.net.parameters() if p.requires_grad]  # for clipping
        self.faults = FaultHooks(self)

    # ----------------------------------------------------------------------------- one batch
    def loss_on(self, batch, row_counts=None) -> torch.Tensor:
        """Forward on the batch's distinct perturbations, broadcast to cells, GEARS loss.

        row_counts: cells per distinct perturbation, a number when equal for every row (the
        native batch-norm kernel applies), CELL_ROWS for one row per cell (native kernel, same
        statistics), else None to use batch.counts."""
        ctx = (
            torch.autocast(self.device.type, dtype=self.amp_dtype)
            if self.amp_dtype
            else contextlib.nullcontext()
        )
        rows, counts, to_cells = batch.uniq_pert_index, row_counts, batch.inverse
        if row_counts is None:
            counts = batch.counts
        elif isinstance(row_counts, RepeatRows):
            repeats = row_counts.repeats.to(rows.device, non_blocking=True)
            n_rows = int(row_counts.repeats.sum())  # host tensor: no device sync
            rows = rows.repeat_interleave(repeats, dim=0, output_size=n_rows)
            counts = row_counts.count
            to_cells = (torch.cumsum(repeats, 0) - repeats)[batch.inverse]  # first copies
        elif row_counts == CELL_ROWS:
            rows, counts, to_cells = rows[batch.inverse], 1.0, None
        if self.cfg.compile:  # a few row counts -> a few compiled graphs, not one per batch
            n_rows = rows.shape[0]
            if not torch.is_tensor(counts):
                counts = torch.full((n_rows,), float(counts), device=rows.device)
            rows, counts = pad_rows(rows, counts)
        with ctx, compiled_backward_as_eager(self.cfg.compile):
            out = self.model(rows, counts)
        if self.cfg.compile:
            out = tuple(o[:n_rows] for o in out) if isinstance(out, tuple) else out[:n_rows]
        delta, logvar = out if self.model_cfg.uncertainty else (out, None)
        if to_cells is not None:
            delta = gather_rows(delta, to_cells)  # (a fixed-order gradient sum)
            logvar = None if logvar is None else gather_rows(logvar, to_cells)
        pred = delta.float() + batch.x
        return gears_loss(
            pred,
            batch.y,
            batch.inverse,
            batch.counts,
            self.gene_mask[batch.uniq_cond],
            self.ctrl_mean,
            gamma=self.model_cfg.gamma,
            direction_lambda=self.model_cfg.direction_lambda,
            direction_temperature=self.model_cfg.direction_temperature,
            logvar=None if logvar is None else logvar.float(),
            uncertainty_reg=self.model_cfg.uncertainty_reg,
        )

    def row_layout(self, counts: torch.Tensor) -> float | str | RepeatRows | None:
        """loss_on's row_counts for a batch with these host counts [U]: the common count when
        equal (native batch-norm); unless compiled (padded distinct rows keep the compiled
        shapes few): RepeatRows when counts share a divisor g > 1 that makes at most one more
        row (grouped batches: [8, 4, 4, ...] -> uniform rows of 4; the weighted path costs
        more than one row), CELL_ROWS when deduplication removes few rows; else None
        (weighted). A per-cell network (model.impl=reference) always takes CELL_ROWS."""
        if getattr(self.net, "per_cell_rows", False):
            return CELL_ROWS
        if bool((counts == counts[0]).all()):
            return float(counts[0])
        if self.cfg.compile:
            return None
        whole = counts.long()
        g = int(np.gcd.reduce(whole.numpy())) if bool((whole == counts).all()) else 1
        if g > 1 and int(whole.sum()) // g <= counts.shape[0] + 1:
            return RepeatRows(float(g), whole // g)
        if use_cell_rows(counts.shape[0], int(counts.sum())):
            return CELL_ROWS
        return None

    # ------------------------------------------------------------------------ the training step
    def train_step(self, batch, layout, last_micro: bool) -> torch.Tensor:
        """One micro-batch: forward, loss, backward (gradients averaged over the accumulation);
        on the accumulation's last micro-batch, gradient clipping and the optimizer step.
        -> the loss, detached (on the device: reading it is a host sync)."""
        no_sync = self.env.distributed and not last_micro  # DDP all-reduces on the last only
        with self.model.no_sync() if no_sync else contextlib.nullcontext():
            loss = self.loss_on(batch, layout)
            self.scaler.scale(loss / self.cfg.grad_accum_steps).backward()
        if last_micro:
            if self.cfg.grad_clip > 0:
                self.scaler.unscale_(self.opt)
                # foreach: one kernel for all gradients (CPU's default is a loop per tensor)
                torch.nn.utils.clip_grad_value_(self.params, self.cfg.grad_clip, foreach=True)
            self.scaler_step()
            self.opt.zero_grad(set_to_none=True)
            self.step += 1
        return loss.detach()

    def train_epoch(self, loader, epoch: int, progress: bool = True) -> tuple[float, int]:
        """One pass over this rank's shard: train_step on each batch, and at step boundaries the
        stop / non-finite check. Returns (mean loss over ranks, cells seen by all ranks)."""
        self.set_train_mode()
        loader.set_epoch(epoch)
        accum = self.cfg.grad_accum_steps
        n_batches = min(len(loader), self.cfg.limit_batches or len(loader))
        totals = self.resume_position(epoch)  # loss sum and cells so far; batches to skip
        skipped_before = self.skipped_steps
        watch = NonFiniteWatch(self.device, enabled=not self.scaler.is_enabled())
        log = TrainProgress(self, epoch, n_batches, totals.start, progress)
        for i, batch in enumerate(loader):
            if i == n_batches:
                break
            if i < totals.start:
                continue  # trained on before the stop; the loader order is fixed by the epoch
            cond_ids = batch.uniq_cond  # host copy, only read to report a non-finite loss
            layout = self.row_layout(batch.counts)  # host tensor: costs no device sync
            batch = batch.to(self.device, non_blocking=True)
            last_micro = (i + 1) % accum == 0 or i + 1 == n_batches
            loss = self.train_step(batch, layout, last_micro)
            watch.record(loss, self.step + (not last_micro), i + 1, cond_ids)
            totals.loss_sum += loss
            totals.cells += len(batch)
            if last_micro:
                self.faults.after_step(epoch, self.step)
                if self.step % self.check_every == 0 or i + 1 == n_batches:
                    stop = self.check_step(epoch, watch)
                    if stop and i + 1 < n_batches:
                        log.close()
                        return self.stop_mid_epoch(epoch, i + 1, totals)
            log.batch_done(i, loss)
        log.close()
        mean_loss = to_host(all_reduce_mean(self.env, totals.loss_sum / max(n_batches, 1))).item()
        self.history.skipped_steps.append(self.skipped_steps - skipped_before)
        return mean_loss, totals.cells * self.env.world_size

    def set_train_mode(self) -> None:
        """Training mode; batch-norms frozen in eval mode with train.freeze_batchnorm."""
        self.model.train()
        if self.cfg.freeze_batchnorm:
            for m in self.net.modules():
                if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                    m.eval()

    def resume_position(self, epoch: int) -> EpochTotals:
        """Where this epoch starts: at batch 0, or where a SIGTERM stopped it (with this rank's
        loss sum and the cells seen so far)."""
        totals = EpochTotals(torch.zeros((), device=self.device))
        if self.partial is not None and self.partial["epoch"] == epoch:
            totals.start, totals.cells = self.partial["batch"], self.partial["cells"]
            totals.loss_sum += to_device(self.partial["loss_sum"][self.env.rank], self.device)
        self.partial = None
        return totals

    def stop_mid_epoch(self, epoch: int, batches_done: int, totals: EpochTotals):
        """A stop agreed within the epoch: record the position (each rank's running loss over
        its shard, so each resumes its own sum) for the checkpoint; fit() then stops."""
        sums = all_gather_objects(self.env, to_host(totals.loss_sum))
        self.partial = {
            "epoch": epoch,
            "batch": batches_done,
            "cells": totals.cells,
            "loss_sum": torch.stack(sums),  # [world_size]
        }
        return float("nan"), totals.cells * self.env.world_size

    def scaler_step(self) -> None:
        """Optimizer step through the GradScaler, counting the steps it skips (fp16 overflow:
        not fatal, the scale is lowered and training goes on)."""
        if not self.scaler.is_enabled():
            self.scaler.step(self.opt)
            self.scaler.update()
            return
        scale = self.scaler.get_scale()  # the scaler syncs on its inf check anyway
        self.scaler.step(self.opt)
        self.scaler.update()
        if self.scaler.get_scale() < scale:  # the scale only drops when the step was skipped
            self.skipped_steps += 1

    def check_step(self, epoch: int, watch: NonFiniteWatch) -> bool:
        """At a step boundary, agree over ranks on the stop flag (SIGTERM on any rank) and raise
        NonFiniteLossError if any rank saw a NaN/inf loss since the last check."""
        first_bad, recorded = watch.take()
        flags = torch.stack(
            [torch.tensor(float(self.stop_requested)), to_host(first_bad >= 0).float()]
        )
        stop, bad = to_host(all_reduce_max(self.env, to_device(flags, self.device))).tolist()
        self.stop_agreed = bool(stop)
        if bad:
            mine = None
            if int(first_bad) >= 0:
                step, batch_no, ids = recorded[int(first_bad)]
                names = [self.pert_data.conditions[int(c)] for c in ids]
                mine = (self.env.rank, step, batch_no, names)
            seen = [r for r in all_gather_objects(self.env, mine) if r is not None]
            rank, step, batch_no, names = seen[0]
            where = f" on rank {rank}" if self.env.distributed else ""
            error = NonFiniteLossError(
                f"the training loss became NaN or infinite at epoch {epoch + 1}, step {step} "
                f"(batch {batch_no} of the epoch){where}; the batch's conditions: "
                f"{names[:20]}{' ...' if len(names) > 20 else ''}. No checkpoint was written "
                "after it. Lower train.lr, keep train.grad_clip > 0, try train.precision=fp32, "
                "or check these conditions' expression values (NaN, huge raw counts)"
            )
            if self.env.distributed:
                # Every rank stops on this one error: rank 0 prints it, once, and before any
                # rank leaves (a launcher ends the other workers when the first one exits).
                if self.env.is_main:
                    print(f"error: {error}", file=sys.stderr, flush=True)
                barrier(self.env)
                error.reported = True
            raise error
        return bool(stop)

    # ------------------------------------------------------------------------------ training
    def fit(self, loaders: dict, progress: bool = True) -> History:
        """Train from self.epoch to cfg.epochs. A SIGTERM (Slurm's preemption / time-limit
        signal) stops every rank at the next step boundary; rank 0 writes a checkpoint and
        TrainingStopped is raised (the entry points exit with status 0)."""
        train = loaders["train_loader"]
        if len(train) == 0:
            n = len(getattr(train, "dataset", ()))
            per = f"{n} cells, {-(-n // self.env.world_size)} per process" if n else "no cells"
            raise GearsInputError(
                f"train.batch_size={self.cfg.batch_size} is larger than the training set ({per} "
                f"with {self.env.world_size} process(es)): no full batch can be formed. Lower "
                "train.batch_size (or use fewer processes)"
            )

        def on_sigterm(signum, frame):
            self.stop_requested = True

        try:
            previous = signal.signal(signal.SIGTERM, on_sigterm)
        except ValueError:  # not the main thread (e.g. a notebook worker): no handler
            previous = None
        try:
            return self._fit(train, loaders, progress)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def _fit(self, train, loaders: dict, progress: bool) -> History:
        has_val = "val_loader" in loaders
        if self.env.is_main:
            eff = self.cfg.batch_size * self.env.world_size * self.cfg.grad_accum_steps
            print(
                f"training on {self.device} x {self.env.world_size} process(es): batch "
                f"{self.cfg.batch_size}/process x {self.env.world_size} x accumulation "
                f"{self.cfg.grad_accum_steps} = effective batch {eff}; "
                f"{len(train)} steps/epoch/process, precision {self.cfg.precision}",
                flush=True,
            )
        for epoch in range(self.epoch, self.cfg.epochs):
            t0 = time.perf_counter()
            loss, cells = self.train_epoch(train, epoch, progress)
            if self.partial is not None:  # stopped by SIGTERM within the epoch
                self.stop_on_signal()
            train_s = time.perf_counter() - t0
            self.sync_buffers()
            self.sched.step()
            val = self.evaluator.quick("val") if has_val else {}
            self.epoch = epoch + 1
            self.history.train_loss.append(loss)
            self.history.val.append(val)
            self.history.epoch_s.append(time.perf_counter() - t0)
            self.history.cells_per_s.append(cells / max(train_s, 1e-9))
            metric = selection_score(self.cfg.select, val, loss, epoch)
            # Rank 0 decides (all ranks hold the same gathered metric) and broadcasts.
            decision = None
            if self.env.is_main:
                improved = metric < self.best_metric
                if improved:
                    self.best_metric, self.best_epoch, self.stale_epochs = metric, epoch, 0
                else:
                    self.stale_epochs += 1
                patience = self.cfg.early_stopping_patience
                decision = (improved, patience > 0 and self.stale_epochs >= patience)
            improved, stop = broadcast_object(self.env, decision)
            if improved:
                self.best_metric, self.best_epoch = metric, epoch
                self.best_state = copy.deepcopy(self.net.state_dict())
            if self.env.is_main:
                msg = (
                    f"epoch {epoch + 1}/{self.cfg.epochs}: train loss {loss:.4f}"
                    + "".join(f", val {k} {v:.4f}" for k, v in val.items())
                    + f", {self.history.cells_per_s[-1]:.0f} cells/s, "
                    f"{self.history.epoch_s[-1]:.1f}s"
                )
                print(msg, flush=True)
                if self.wandb is not None:
                    self.wandb.log(
                        {
                            "epoch": epoch + 1,
                            "train/epoch_loss": loss,
                            **{f"val/{k}": v for k, v in val.items()},
                            "train/cells_per_s": self.history.cells_per_s[-1],
                        },
                        step=self.step,
                    )
            if self.out_dir is not None and (
                self.epoch % self.cfg.checkpoint_every == 0 or self.epoch == self.cfg.epochs or stop
            ):
                self.save_checkpoint()
            elif self.out_dir is not None and self.stop_agreed:
                self.save_checkpoint()  # stopping: keep this epoch whatever checkpoint_every says
            self.faults.after_epoch(epoch + 1, self.step)
            if self.stop_agreed and self.epoch < self.cfg.epochs:
                self.stop_on_signal()
            if stop:
                if self.env.is_main:
                    print(
                        f"early stopping after epoch {epoch + 1}: no val improvement for "
                        f"{self.cfg.early_stopping_patience} epochs",
                        flush=True,
                    )
                break
        if self.best_state is not None:
            self.net.load_state_dict(self.best_state)
        return self.history

    def stop_on_signal(self) -> None:
        """Every rank: rank 0 writes the checkpoint (mid-epoch position included), then all
        leave through TrainingStopped."""
        where = None
        if self.out_dir is not None:
            if self.partial is not None:
                self.save_checkpoint()
            where = ckpt.list_checkpoints(os.path.join(self.out_dir, "checkpoints"))[-1:]
        if self.env.is_main:
            pos = (
                f"epoch {self.epoch + 1}, step {self.step}"
                if self.partial
                else (f"the end of epoch {self.epoch}")
            )
            saved = (
                f"wrote {where[0]}; run the same command with train.resume=true to continue"
                if where
                else "no out_dir, nothing saved"
            )
            print(f"SIGTERM received: stopped at {pos}; {saved}", flush=True)
        raise TrainingStopped(f"stopped by SIGTERM at step {self.step}")

    def sync_buffers(self) -> None:
        """Rank 0's batch-norm running statistics on every rank. Without sync_batchnorm each rank
        updates them with its own batches after DDP's pre-forward broadcast, so evaluation
        (chunks dealt to ranks), the best state and checkpoints would depend on the rank."""
        if not self.env.distributed:
            return
        graphs = set(graph_buffer_names(self.net))
        for name, buf in self.net.named_buffers():
            if name not in graphs:
                dist.broadcast(buf, src=0)

    def unwrap(self) -> None:
        """Drop the DDP wrapper (after training), so that it is freed while the process group
        is still alive rather than at exit (see distributed.release)."""
        self.model = self.net

    # ---------------------------------------------------------------------------- checkpoints
    def meta(self) -> dict:
        """What a checkpoint must share with the run resuming it (checked by name on resume)."""
        return {
            "vocab_hash": self.vocab_hash,
            **self.model_cfg.shape_fields(),
            # A mid-epoch position only means the same batches with these:
            "world_size": self.env.world_size,
            "train.batch_size": self.cfg.batch_size,
            "train.grad_accum_steps": self.cfg.grad_accum_steps,
            "train.batching": self.cfg.batching,
        }

    def state(self) -> dict:
        """The whole training state as tensors and plain values (weights_only-loadable)."""
        history = {
            k: [_plain(v) for v in vals] for k, vals in dataclasses.asdict(self.history).items()
        }
        return {
            "format": ckpt.FORMAT_VERSION,
            "meta": self.meta(),
            "config": {
                "train": dataclasses.asdict(self.cfg),
                "model": dataclasses.asdict(self.model_cfg),
            },
            "partial": self.partial,
            "skipped_steps": self.skipped_steps,
            "model": self.net.state_dict(),
            "optimizer": self.opt.state_dict(),
            "scheduler": self.sched.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": rng_state(self.device),
            "epoch": self.epoch,
            "step": self.step,
            "best_metric": float(self.best_metric),
            "best_epoch": self.best_epoch,
            "best_state": self.best_state,
            "stale_epochs": self.stale_epochs,
            "history": history,
            "world_size": self.env.world_size,
            "cpu_threads": torch.get_num_threads(),
        }

    def save_checkpoint(self) -> None:
        folder = os.path.join(self.out_dir, "checkpoints")
        barrier(self.env)  # every rank has finished the epoch before rank 0 writes
        if self.env.is_main:
            done = self.partial["batch"] // self.cfg.grad_accum_steps if self.partial else 0
            path = ckpt.checkpoint_path(folder, self.epoch, done)
            ckpt.atomic_save(self.state(), path)
            ckpt.prune(folder, keep=2)
        barrier(self.env)

    def _load_checkpoint_on_rank_0(self, log) -> dict | None:
        """The newest readable, compatible checkpoint, read by rank 0 and broadcast: only rank 0
        writes checkpoints, so on node-local disks the other nodes have none (every rank must
        resume from the same state, or their epochs and collectives stop matching). A refusal
        on rank 0 is raised on every rank."""
        outcome = None
        if self.env.is_main:
            folder = os.path.join(self.out_dir, "checkpoints")
            try:
                # On the CPU whatever device wrote it: load_state_dict moves weights and
                # optimizer state to the parameters' device; RNG states must stay CPU tensors.
                state = ckpt.load_latest(folder, map_location="cpu", log=log)
                if state is not None:
                    mid_epoch = bool(state.get("partial"))
                    expected = {
                        k: v
                        for k, v in self.meta().items()
                        if mid_epoch or k == "vocab_hash" or k.startswith("model.")
                    }
                    ckpt.check_compatible(state, state["path"], expected)
                outcome = (state, None)
            except GearsInputError as e:
                outcome = (None, str(e))
        state, refusal = broadcast_object(self.env, outcome)
        if refusal is not None:
            raise GearsInputError(refusal)
        return state

    def resume(self, asked: bool = True) -> bool:
        """Continue from the newest readable checkpoint in out_dir/checkpoints, if any, when any
        rank asks: after a node's worker fails, torchrun counts a restart on that node only
        (TORCHELASTIC_RESTART_COUNT; the other nodes restart for the membership change without
        counting), yet every rank must resume. Every rank calls this."""
        if self.env.distributed:
            flag = to_device(torch.tensor(float(asked)), self.device)
            asked = bool(to_host(all_reduce_max(self.env, flag)).item())
        if not asked:
            return False
        log = print if self.env.is_main else (lambda *_: None)
        state = self._load_checkpoint_on_rank_0(log)
        if state is None:
            folder = os.path.join(self.out_dir, "checkpoints")
            log(f"train.resume: no checkpoint in {folder}; starting from scratch")
            return False
        self.net.load_state_dict(state["model"])
        # A loaded optimizer state carries the writer's kernel choice (fused or foreach): name
        # this device's kernel before loading, so that load_state_dict places Adam's step
        # counters where it wants them (fused: float32 on the parameters' device; foreach: as
        # loaded, on the host, since checkpoints load to CPU).
        for group in state["optimizer"]["param_groups"]:
            group.update(optimizer_kernel(self.cfg.optimizer, self.device))
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        # An fp32 or bf16 run saves a disabled scaler's empty state; fp16 then starts afresh.
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        set_rng_state(state["rng"], self.device)
        self.epoch, self.step = state["epoch"], state["step"]
        self.best_metric, self.best_epoch = state["best_metric"], state["best_epoch"]
        self.best_state, self.stale_epochs = state["best_state"], state["stale_epochs"]
        self.history = History(**state["history"])
        self.partial, self.skipped_steps = state["partial"], state["skipped_steps"]
        where = f", {self.partial['batch']} batches into the next" if self.partial else ""
        log(f"resumed from {state['path']} (epoch {self.epoch}{where}, step {self.step})")
        threads, now = state.get("cpu_threads"), torch.get_num_threads()
        if self.device.type == "cpu" and threads is not None and threads != now:
            log(
                f"note: this run has {now} CPU threads, the checkpoint's run had {threads}: float "
                "sums add in another order, so it ends near, not exactly at, where that run "
                f"would have (train.threads={threads} resumes it exactly)"
            )
        self.resumed = True
        return True
