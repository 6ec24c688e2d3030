"""The one training loop, for 1 or N processes: AMP, accumulation, clipping, eval, checkpoints."""

from __future__ import annotations

import contextlib
import copy
import os
import random
import signal
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gears import checkpoint as ckpt
from gears.config import DistributedConfig, ModelConfig, TrainConfig
from gears.distributed import DistEnv, all_reduce_mean, allow_tf32, barrier, broadcast_object
from gears.errors import GearsInputError
from gears.evaluate import Evaluator
from gears.model.losses import gears_loss
from gears.model.network import pad_rows, use_cell_rows

# loss_on(batch, CELL_ROWS): one row per cell instead of one per distinct perturbation.
CELL_ROWS = "cells"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


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
    raise GearsInputError(f"unknown train.precision {precision!r} (fp32, bf16, fp16)")


def optimizer_kernel(optimizer: str, device: torch.device) -> dict[str, bool | None]:
    """The update kernel for a device: fused Adam/AdamW on CUDA (one kernel for all parameters),
    the multi-tensor `foreach` path elsewhere."""
    if device.type == "cuda" and optimizer in ("adam", "adamw"):
        return {"fused": True, "foreach": None}  # GPU-only
    return {"fused": None, "foreach": True}


def make_optimizer(
    params, cfg: TrainConfig, device: torch.device | None = None
) -> torch.optim.Optimizer:
    """Adam with L2 weight decay, as GEARS (adamw and plain sgd on request)."""
    kinds = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
    if cfg.optimizer not in kinds:
        raise GearsInputError(f"unknown train.optimizer {cfg.optimizer!r}: {sorted(kinds)}")
    kernel = optimizer_kernel(cfg.optimizer, device or torch.device("cpu"))
    return kinds[cfg.optimizer](params, lr=cfg.lr, weight_decay=cfg.weight_decay, **kernel)


def make_scheduler(opt: torch.optim.Optimizer, cfg: TrainConfig):
    if cfg.schedule == "step":  # GEARS: halve the learning rate after every epoch
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=cfg.step_gamma)
    if cfg.schedule == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(cfg.epochs, 1))
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)


def rng_state(device: torch.device | None = None) -> dict:
    """Host RNG states, plus the CUDA generator of this process's own GPU (one per rank; not
    every visible GPU's, which another machine may not have)."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
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
    np.random.set_state(state["numpy"])
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


def _fault_injection(epoch: int, step: int, env: DistEnv, where: str) -> None:
    """Test hook: GEARS_FAULT_KILL=<rank>:<epoch|step>:<n> SIGKILLs that rank on the first attempt
    (a torchrun restart sets TORCHELASTIC_RESTART_COUNT > 0 and disarms it)."""
    spec = os.environ.get("GEARS_FAULT_KILL")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    rank, kind, n = spec.split(":")
    if int(rank) == env.rank and kind == where and int(n) == (epoch if where == "epoch" else step):
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class History:
    train_loss: list[float] = field(default_factory=list)
    val: list[dict] = field(default_factory=list)
    epoch_s: list[float] = field(default_factory=list)
    cells_per_s: list[float] = field(default_factory=list)


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
    ):
        self.cfg, self.model_cfg, self.env = train_cfg, model_cfg, env
        self.pert_data = pert_data
        self.out_dir = out_dir
        self.wandb = wandb_run
        self.seed = seed
        self.device = env.device
        allow_tf32(self.device)
        self.amp_dtype = autocast_dtype(train_cfg.precision, self.device)
        self.net = model.to(self.device)
        dist_cfg = dist_cfg or DistributedConfig()
        if env.distributed:
            self.net.set_sync_batchnorm(dist_cfg.sync_batchnorm)
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
        self.gene_mask = torch.as_tensor(pert_data.non_zero_mask, device=self.device)
        self.ctrl_mean = torch.as_tensor(
            pert_data.ctrl_mean, dtype=torch.float32, device=self.device
        )
        self.evaluator = Evaluator(pert_data, env, self.net)
        self.history = History()
        self.epoch = 0  # epochs completed
        self.step = 0  # optimizer steps taken
        self.best_metric = float("inf")
        self.best_epoch = -1
        self.best_state = None
        self.stale_epochs = 0

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
        elif row_counts == CELL_ROWS:
            rows, counts, to_cells = rows[batch.inverse], 1.0, None
        if self.cfg.compile:  # a few row counts -> a few compiled graphs, not one per batch
            n_rows = rows.shape[0]
            if not torch.is_tensor(counts):
                counts = torch.full((n_rows,), float(counts), device=rows.device)
            rows, counts = pad_rows(rows, counts)
        with ctx:
            out = self.model(rows, counts)
        if self.cfg.compile:
            out = tuple(o[:n_rows] for o in out) if isinstance(out, tuple) else out[:n_rows]
        delta, logvar = out if self.model_cfg.uncertainty else (out, None)
        if to_cells is not None:
            delta = delta[to_cells]
            logvar = None if logvar is None else logvar[to_cells]
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

    def row_layout(self, counts: torch.Tensor) -> float | str | None:
        """loss_on's row_counts for a batch with these host counts [U]: the common count when
        equal (native batch-norm), CELL_ROWS when deduplication removes few rows (unless
        compiled: padded distinct rows keep the compiled shapes few), else None (weighted)."""
        if bool((counts == counts[0]).all()):
            return float(counts[0])
        if not self.cfg.compile and use_cell_rows(counts.shape[0], int(counts.sum())):
            return CELL_ROWS
        return None

    def train_epoch(self, loader, epoch: int, progress: bool = True) -> tuple[float, int]:
        """One pass over this rank's shard. Returns (mean loss over ranks, cells seen by all)."""
        self.model.train()
        if self.cfg.freeze_batchnorm:
            for m in self.net.modules():
                if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                    m.eval()
        loader.set_epoch(epoch)
        accum = self.cfg.grad_accum_steps
        n_batches = len(loader)
        if self.cfg.limit_batches:
            n_batches = min(n_batches, self.cfg.limit_batches)
        loss_sum = torch.zeros((), device=self.device)
        cells = 0
        bar = None
        if progress and self.env.is_main:
            from tqdm.auto import tqdm

            bar = tqdm(
                total=n_batches,
                desc=f"epoch {epoch + 1}/{self.cfg.epochs}",
                leave=False,
                dynamic_ncols=True,
                mininterval=0.5,
            )
        params = [p for p in self.net.parameters() if p.requires_grad]
        for i, batch in enumerate(loader):
            if i == n_batches:
                break
            layout = self.row_layout(batch.counts)  # host tensor: costs no device sync
            batch = batch.to(self.device, non_blocking=True)
            last_micro = (i + 1) % accum == 0 or i + 1 == n_batches
            sync = (
                self.model.no_sync()
                if self.env.distributed and not last_micro
                else contextlib.nullcontext()
            )
            with sync:
                loss = self.loss_on(batch, layout)
                self.scaler.scale(loss / accum).backward()
            loss_sum += loss.detach()
            cells += len(batch)
            if last_micro:
                if self.cfg.grad_clip > 0:
                    self.scaler.unscale_(self.opt)
                    torch.nn.utils.clip_grad_value_(params, self.cfg.grad_clip)
                self.scaler.step(self.opt)
                self.scaler.update()
                self.opt.zero_grad(set_to_none=True)
                self.step += 1
                _fault_injection(epoch, self.step, self.env, "step")
            if bar is not None:
                bar.update(1)
                if (i + 1) % self.cfg.log_every == 0:
                    value = loss.item()  # the only host sync, at the logging interval
                    bar.set_postfix(loss=f"{value:.4f}")
                    if self.wandb is not None:
                        self.wandb.log(
                            {"train/loss": value, "lr": self.sched.get_last_lr()[0]}, step=self.step
                        )
        if bar is not None:
            bar.close()
        mean_loss = all_reduce_mean(self.env, loss_sum / max(n_batches, 1)).item()
        return mean_loss, cells * self.env.world_size

    # ------------------------------------------------------------------------------ training
    def fit(self, loaders: dict, progress: bool = True) -> History:
        train = loaders["train_loader"]
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
            train_s = time.perf_counter() - t0
            self.sync_buffers()
            self.sched.step()
            val = self.evaluator.quick("val") if has_val else {}
            self.epoch = epoch + 1
            self.history.train_loss.append(loss)
            self.history.val.append(val)
            self.history.epoch_s.append(time.perf_counter() - t0)
            self.history.cells_per_s.append(cells / max(train_s, 1e-9))
            metric = val.get("mse_de", loss)
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
            _fault_injection(epoch + 1, self.step, self.env, "epoch")
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

    def _use_device_kernel(self) -> None:
        """A loaded optimizer state carries the writer's kernel choice (fused on CUDA, foreach on
        CPU) and puts Adam's step counters where that kernel wants them: switch both to this
        device's kernel (fused wants the counters on the GPU, foreach on the host)."""
        kernel = optimizer_kernel(self.cfg.optimizer, self.device)
        for group in self.opt.param_groups:
            group.update(kernel)
            for p in group["params"]:
                step = self.opt.state.get(p, {}).get("step")
                if torch.is_tensor(step):
                    where = p.device if kernel["fused"] else torch.device("cpu")
                    self.opt.state[p]["step"] = step.to(where, torch.float32)

    # ---------------------------------------------------------------------------- checkpoints
    def state(self) -> dict:
        return {
            "model": self.net.state_dict(),
            "optimizer": self.opt.state_dict(),
            "scheduler": self.sched.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": rng_state(self.device),
            "epoch": self.epoch,
            "step": self.step,
            "best_metric": self.best_metric,
            "best_epoch": self.best_epoch,
            "best_state": self.best_state,
            "stale_epochs": self.stale_epochs,
            "history": self.history.__dict__,
            "world_size": self.env.world_size,
        }

    def save_checkpoint(self) -> None:
        folder = os.path.join(self.out_dir, "checkpoints")
        barrier(self.env)  # every rank has finished the epoch before rank 0 writes
        if self.env.is_main:
            ckpt.atomic_save(self.state(), ckpt.checkpoint_path(folder, self.epoch))
            ckpt.prune(folder, keep=2)
        barrier(self.env)

    def resume(self) -> bool:
        """Continue from the newest readable checkpoint in out_dir/checkpoints, if any."""
        folder = os.path.join(self.out_dir, "checkpoints")
        log = print if self.env.is_main else (lambda *_: None)
        # On the CPU whatever device wrote it: load_state_dict moves weights and optimizer state
        # to the parameters' device, and RNG states must stay CPU tensors.
        state = ckpt.load_latest(folder, map_location="cpu", log=log)
        if state is None:
            log(f"train.resume: no checkpoint in {folder}; starting from scratch")
            return False
        self.net.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self._use_device_kernel()
        self.sched.load_state_dict(state["scheduler"])
        # An fp32 or bf16 run saves a disabled scaler's empty state; fp16 then starts afresh.
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        set_rng_state(state["rng"], self.device)
        self.epoch, self.step = state["epoch"], state["step"]
        self.best_metric, self.best_epoch = state["best_metric"], state["best_epoch"]
        self.best_state, self.stale_epochs = state["best_state"], state["stale_epochs"]
        self.history = History(**state["history"])
        log(f"resumed from {state['path']} (epoch {self.epoch}, step {self.step})")
        return True
