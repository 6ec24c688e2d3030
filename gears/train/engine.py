"""The one training loop, for 1 or N processes: AMP, accumulation, clipping, eval, checkpoints."""

from __future__ import annotations

import contextlib
import copy
import os
import random
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gears.choices import CHOICES
from gears.config import DistributedConfig, ModelConfig, TrainConfig, check_impl
from gears.device import module_to_device, to_device, to_host
from gears.errors import GearsInputError, NonFiniteLossError
from gears.model.batch import check_output, predicted_expression
from gears.model.contract import (
    declared_covariates,
    fixed_shape_graphs,
    graph_buffer_names,
    one_row_per_cell,
    reads_x,
    set_sync_batchnorm,
    syncs_batchnorm,
)
from gears.model.losses import gears_loss
from gears.model.rows import (  # noqa: F401 (the layouts, re-exported)
    CELL_ROWS,
    WEIGHTED_ROWS,
    CellRows,
    EqualRows,
    Layout,
    RepeatRows,
    WeightedRows,
    batch_rows,
    cell_outputs,
    row_layout,
)
from gears.torch_compat import compiled_backward_config, ddp_ignore, is_batch_norm
from gears.train import checkpoint as ckpt
from gears.train.distributed import (
    DistEnv,
    all_gather_objects,
    all_reduce_max,
    all_reduce_mean,
    barrier,
    broadcast_object,
    set_tf32,
)
from gears.train.evaluate import EVAL_CHUNK, Evaluator
from gears.train.faults import FaultPlan
from gears.train.graph_step import EpochPlan, ForwardRunner, PlanUnsupported, StepRunner
from gears.train.runtime import at_step
from gears.train.state import (  # noqa: F401 (rng_state, set_rng_state: re-exported)
    History,
    TrainState,
    epoch_position,
    resume,
    rng_state,
    set_rng_state,
    stop_mid_epoch,
    stop_on_signal,
    stop_requests,
    write_checkpoint,
)


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


def optimizer_kernel(
    optimizer: str, device: torch.device, capturable: bool = False
) -> dict[str, bool | None]:
    """The update kernel for a device: fused Adam/AdamW on CUDA and CPU (one kernel for all
    parameters; on CPU faster than `foreach`, with the same parameters to ~1e-6), the
    multi-tensor `foreach` path elsewhere (SGD, other devices). capturable (the planned step,
    gears/train/graph_step.py, which replays the update inside a CUDA graph): Adam and AdamW keep
    their step count on the device and take a tensor learning rate; SGD runs its fused kernel,
    which reads the tensor learning rate on the device (the foreach one reads it on the
    host)."""
    if capturable:
        if optimizer in ("adam", "adamw"):
            return {"fused": True, "foreach": None, "capturable": True}
        return {"fused": True, "foreach": None}
    if device.type in ("cuda", "cpu") and optimizer in ("adam", "adamw"):
        return {"fused": True, "foreach": None}
    return {"fused": None, "foreach": True}


def make_optimizer(
    params, cfg: TrainConfig, device: torch.device | None = None, capturable: bool = False
) -> torch.optim.Optimizer:
    """Adam with L2 weight decay, as GEARS (adamw and plain sgd on request), with the update
    kernel of optimizer_kernel."""
    kinds = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
    if cfg.optimizer not in CHOICES["train.optimizer"]:
        raise GearsInputError(
            f"unknown train.optimizer {cfg.optimizer!r}: {CHOICES['train.optimizer']}"
        )
    kernel = optimizer_kernel(cfg.optimizer, device or torch.device("cpu"), capturable)
    return kinds[cfg.optimizer](params, lr=cfg.lr, weight_decay=cfg.weight_decay, **kernel)


def planned_step_wanted(setting, device: torch.device) -> bool:
    """train.cuda_graphs: null (auto) is on with CUDA and off on CPU; true / false as given."""
    return device.type == "cuda" if setting is None else bool(setting)


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


class PlannedWatch:
    """NonFiniteWatch's interface over the planned step's device flag (the first batch of the
    epoch whose loss was not finite, -1 for none): take() returns it and the batches' (step,
    batch number, condition ids) by batch index, then clears the flag."""

    def __init__(self, trainer: Trainer, runner):
        self.trainer, self.runner = trainer, runner
        self.steps: dict[int, int] = {}

    def take(self) -> tuple[torch.Tensor, PlannedWatch]:
        first_bad = self.runner.first_bad.clone()
        self.runner.first_bad.fill_(-1)
        return first_bad, self

    def __getitem__(self, i: int):
        plan = self.runner.plan
        uniq = plan.host["uniq_cond"][i][: int(plan.host["n_groups"][i])]
        return self.steps.get(i, -1), i + 1, torch.from_numpy(uniq)


def planned_step_refusal(trainer: Trainer, loader) -> str | None:
    """Why the planned step cannot train this run (None: it can). fp16's GradScaler, gradient
    accumulation and synchronised batch-norm under DDP stay eager for now."""
    cfg = trainer.cfg
    if not hasattr(loader, "batch_sampler") or not hasattr(loader, "dataset"):
        return "the training loader is no EpochLoader"
    if trainer.scaler.is_enabled():
        return "train.precision=fp16 (GradScaler) is not planned yet"
    if cfg.grad_accum_steps > 1:
        return "train.grad_accum_steps > 1 is not planned yet"
    if trainer.env.distributed and trainer.dist_cfg.sync_batchnorm:
        return (
            "distributed.sync_batchnorm=true under DDP (batch statistics all-reduced inside "
            "the forward) is not planned yet"
        )
    return None


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


def compiled_backward_as_eager(compiled: bool):
    """A context for calling a torch.compile'd network whose backward must mean what eager's
    means. Two of torch.compile's defaults differ (the torch versions: docs/mixed_precision.md):
    the compiled backward is traced under the forward's autocast (the fp32 layers' backward
    matmuls then run in half precision, far from eager's gradient; pytorch#153044), and the
    partitioner may recompute, in the backward, reads of a parameter that the forward mutates in
    place (the max-norm embeddings: their gradients then use rows scaled twice on a step that
    renormalises, fp32 included). tests/test_compile_amp.py fails without either setting."""
    if not compiled:
        return contextlib.nullcontext()
    return compiled_backward_config()  # torch._functorch.config (private): gears/torch_compat.py


def check_network(
    net: torch.nn.Module, train_cfg: TrainConfig, dist_cfg: DistributedConfig
) -> None:
    """Refuse, by name, what the network class cannot run (gears.config.check_impl does the
    same for model.impl=reference when the config is read)."""
    name = type(net).__name__
    if train_cfg.compile and one_row_per_cell(net):
        raise GearsInputError(
            f"train.compile=true needs rows of distinct perturbations; {name} takes one row per "
            "cell (data-dependent shapes recompile per batch): drop train.compile"
        )
    if dist_cfg.sync_batchnorm and not syncs_batchnorm(net):
        raise GearsInputError(
            f"distributed.sync_batchnorm=true needs a network with set_sync_batchnorm (the fast "
            f"GEARSNet's weighted batch-norms); {name} has none: drop distributed.sync_batchnorm"
        )


def wrap_for_training(
    net: torch.nn.Module,
    env: DistEnv,
    dist_cfg: DistributedConfig,
    compile: bool,
    ddp: bool = True,
) -> torch.nn.Module:
    """The module the step calls: the network, under DDP with several processes (ddp=False
    for the planned step, which averages the gradients itself), compiled with train.compile
    (rows padded to a few sizes by batch_rows)."""
    model = net
    if env.distributed and ddp:
        set_sync_batchnorm(net, dist_cfg.sync_batchnorm)  # (the fast network's)
        # The graphs are built identically on every rank: DDP's default would broadcast them
        # (MBs at genome scale) from rank 0 before every forward.
        ddp_ignore(net, graph_buffer_names(net))
        model = DDP(
            net,
            device_ids=[env.device.index] if env.device.type == "cuda" else None,  # GPU-only
            find_unused_parameters=dist_cfg.find_unused_parameters,
            static_graph=dist_cfg.static_graph,
            gradient_as_bucket_view=dist_cfg.gradient_as_bucket_view,
        )
    if compile:
        model = torch.compile(model, dynamic=False)
    return model


def set_train_mode(model: torch.nn.Module, net: torch.nn.Module, freeze_batchnorm: bool):
    """Training mode; batch-norms frozen in eval mode with train.freeze_batchnorm."""
    model.train()
    if freeze_batchnorm:
        for m in net.modules():
            if is_batch_norm(m):
                m.eval()


def sync_module(env: DistEnv, net: torch.nn.Module) -> None:
    """Rank 0's parameters and buffers (not the fixed graphs) on every rank, as
    DistributedDataParallel's constructor makes them: for the planned step, which has no
    wrapper."""
    if not env.distributed:
        return
    with torch.no_grad():
        for p in net.parameters():
            dist.broadcast(p.data, src=0)
    sync_buffers(env, net)


def sync_buffers(env: DistEnv, net: torch.nn.Module) -> None:
    """Rank 0's batch-norm running statistics on every rank. Without sync_batchnorm each rank
    updates them with its own batches after DDP's pre-forward broadcast, so evaluation (chunks
    dealt to ranks), the best state and checkpoints would depend on the rank."""
    if not env.distributed:
        return
    graphs = set(graph_buffer_names(net))
    for name, buf in net.named_buffers():
        if name not in graphs:
            dist.broadcast(buf, src=0)


def announce(env: DistEnv, cfg: TrainConfig, steps_per_epoch: int) -> None:
    """Rank 0: the run's shape (processes, batch, accumulation, precision)."""
    if env.is_main:
        world, accum = env.world_size, cfg.grad_accum_steps
        print(
            f"training on {env.device} x {world} process(es): batch {cfg.batch_size}/process x "
            f"{world} x accumulation {accum} = effective batch {cfg.batch_size * world * accum}; "
            f"{steps_per_epoch} steps/epoch/process, precision {cfg.precision}",
            flush=True,
        )


def log_epoch(
    cfg: TrainConfig, wandb, history: History, epoch: int, loss: float, val: dict, step: int
) -> None:
    """Rank 0 at the end of an epoch: its line, and wandb."""
    speed, seconds = history.cells_per_s[-1], history.epoch_s[-1]
    print(
        f"epoch {epoch + 1}/{cfg.epochs}: train loss {loss:.4f}"
        + "".join(f", val {k} {v:.4f}" for k, v in val.items())
        + f", {speed:.0f} cells/s, {seconds:.1f}s",
        flush=True,
    )
    if wandb is not None:
        metrics = {"epoch": epoch + 1, "train/epoch_loss": loss}
        metrics.update({f"val/{k}": v for k, v in val.items()})
        wandb.log({**metrics, "train/cells_per_s": speed}, step=step)


def check_trainable(train_loader, batch_size: int, world_size: int) -> None:
    """A training loader must yield a full batch on every process."""
    if len(train_loader) == 0:
        n = len(getattr(train_loader, "dataset", ()))
        per = f"{n} cells, {-(-n // world_size)} per process" if n else "no cells"
        raise GearsInputError(
            f"train.batch_size={batch_size} is larger than the training set ({per} with "
            f"{world_size} process(es)): no full batch can be formed. Lower train.batch_size "
            "(or use fewer processes)"
        )


def non_finite_error(env: DistEnv, conditions, epoch: int, first_bad, recorded) -> Exception:
    """The NonFiniteLossError naming the first bad micro-batch of any rank (gathered: every
    rank calls this): epoch, step, batch, rank and its conditions. Under DDP rank 0 prints it
    before any rank leaves (a launcher ends the other workers when the first one exits)."""
    mine = None
    if int(first_bad) >= 0:
        step, batch_no, ids = recorded[int(first_bad)]
        mine = (env.rank, step, batch_no, [conditions[int(c)] for c in ids])
    seen = [r for r in all_gather_objects(env, mine) if r is not None]
    rank, step, batch_no, names = seen[0]
    where = f" on rank {rank}" if env.distributed else ""
    error = NonFiniteLossError(
        f"the training loss became NaN or infinite in epoch {epoch + 1}, at step {step} in "
        f"all (batch {batch_no} of the epoch){where}; the batch's conditions: "
        f"{names[:20]}{' ...' if len(names) > 20 else ''}. No checkpoint was written "
        "after it. Lower train.lr, keep train.grad_clip > 0, try train.precision=fp32, "
        "or check these conditions' expression values (NaN, huge raw counts)"
    )
    if env.distributed:
        if env.is_main:
            print(f"error: {error}", file=sys.stderr, flush=True)
        barrier(env)
        error.reported = True
    return error


class Trainer:
    """Trains a network on a PertData split. World size 1 is the single-process case.

    __init__ builds what the step uses: the network on its device, wrapped for DDP and
    torch.compile (wrap_for_training), the optimizer (make_optimizer), the schedule
    (make_scheduler), the fp16 GradScaler; the loss is loss_on's."""

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
        evaluator: Evaluator | None = None,
        run_config: dict | None = None,
    ):
        self.cfg, self.model_cfg, self.env = train_cfg, model_cfg, env
        # The whole Config as a dict: the run's fingerprint (gears.train.state.fingerprint).
        self.run_config = run_config
        self._fingerprint = None
        self.pert_data = pert_data
        self.out_dir = out_dir
        self.wandb = wandb_run
        self.seed = seed
        self.device = env.device
        set_tf32(self.device, train_cfg.tf32)
        self.amp_dtype = autocast_dtype(train_cfg.precision, self.device)
        self.net = module_to_device(model, self.device)
        dist_cfg = self.dist_cfg = dist_cfg or DistributedConfig()
        check_impl(model_cfg, train_cfg, dist_cfg)
        check_network(self.net, train_cfg, dist_cfg)
        # The planned step (train.cuda_graphs): built at the first epoch (StepRunner), or None
        # with the reason it cannot run printed once; eager steps then.
        self.planned = planned_step_wanted(train_cfg.cuda_graphs, self.device)
        self.runner = None
        # Under DDP the planned step averages the gradients itself, and a
        # DistributedDataParallel wrapper would keep every parameter's gradient accumulator
        # alive from the stream it was built on, where a capture on a side stream cannot use
        # them: the wrapper is built only when eager steps train (step_runner's refusal).
        self.model = wrap_for_training(
            self.net, env, dist_cfg, train_cfg.compile, ddp=not self.planned
        )
        if self.planned:
            sync_module(env, self.net)
        self.opt = make_optimizer(self.net.parameters(), train_cfg, self.device, self.planned)
        self.sched = make_scheduler(self.opt, train_cfg)
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.amp_dtype == torch.float16)
        self.params = [p for p in self.net.parameters() if p.requires_grad]  # for clipping
        # What the network reads (its class's declarations): the rows it is given.
        self.reads_x, self.covariates = reads_x(self.net), declared_covariates(self.net)
        self.per_cell = one_row_per_cell(self.net)
        self.gene_mask = to_device(torch.as_tensor(pert_data.non_zero_mask), self.device)
        self.ctrl_mean = to_device(
            torch.as_tensor(pert_data.ctrl_mean, dtype=torch.float32), self.device
        )
        self.evaluator = evaluator or Evaluator(pert_data, env, self.net, control_mean)
        # Epoch, step, best model, early-stopping count, mid-epoch position, history, skipped
        # steps: what a checkpoint saves and a resume restores (gears.train.state).
        self.state = TrainState()
        self.vocab_hash = ckpt.vocab_hash(pert_data.gene_names, pert_data.pert_names)
        # The signal (SIGTERM or SIGINT) that asked to stop, 0 for none; acted on at the next
        # step boundary, where the ranks agree on the largest (all-reduced).
        self.stop_requested = 0
        self.stop_agreed = 0
        self.resumed = False  # training continues from a checkpoint
        # The stop / non-finite flags are read on the host every `check_every` optimizer steps:
        # every step on CPU (free), at the logging interval on GPU (a host sync each time).
        self.check_every = 1 if self.device.type == "cpu" else max(train_cfg.log_every, 1)
        self.output_checked = False  # check_output runs at the first training step
        self.faults = FaultPlan.from_env(env.rank)  # GEARS_FAULT_KILL (tests); else inert
        self.faults.attach(self.net)

    # ----------------------------------------------------------------------------- one batch
    def loss_on(self, batch, layout: Layout = WEIGHTED_ROWS) -> torch.Tensor:
        """The batch's loss: its rows (batch_rows: the distinct groups, or one row per cell, as
        `layout` says; WEIGHTED_ROWS = the distinct groups weighted by batch.counts), the
        network, each cell's prediction (its control cell + the change), GEARS's loss
        (gears_loss, given the model config's loss parameters)."""
        rows = batch_rows(batch, layout, self.covariates, self.reads_x, pad=self.cfg.compile)
        with self.autocast(), compiled_backward_as_eager(self.cfg.compile):
            out = self.model(rows.inputs)
        if not self.output_checked:  # the network's contract, at the first step (a fork's)
            check_output(out, self.net, rows.inputs.pert_index.shape[0], self.ctrl_mean.shape[-1])
            self.output_checked = True
        change, logvar = cell_outputs(out, rows)
        return self.cell_loss(batch, change, logvar)

    def cell_loss(self, batch, change, logvar, n_groups=None) -> torch.Tensor:
        """GEARS's loss (gears_loss, given the model config's loss parameters) of each cell's
        prediction: its control cell + its change [cells, G] (logvar: the uncertainty head's,
        or None). n_groups: the batch's group count as a device number (the planned step's
        padded batches), None: counted from batch.inverse."""
        m = self.model_cfg
        return gears_loss(
            predicted_expression(change, batch.x),
            batch.y,
            batch.inverse,
            batch.counts,
            self.gene_mask[batch.uniq_cond],
            self.ctrl_mean,
            logvar=None if logvar is None else logvar.float(),
            n_groups=n_groups,
            gamma=m.gamma,
            direction_lambda=m.direction_lambda,
            direction_temperature=m.direction_temperature,
            uncertainty_reg=m.uncertainty_reg,
        )

    def autocast(self):
        """The forward's autocast context (train.precision), or none for fp32."""
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def row_layout(self, counts: torch.Tensor) -> Layout:
        """The layout of a batch with these host counts [U] (gears.model.rows.row_layout): one
        row per cell for a network that reads x or asks for per-cell rows."""
        return row_layout(counts, self.per_cell, self.cfg.compile)

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
            self.state.step += 1
        return loss.detach()

    def train_epoch(self, loader, epoch: int, progress: bool = True) -> tuple[float, int]:
        """One pass over this rank's shard: train_step on each batch, and at step boundaries the
        stop / non-finite check. Returns (mean loss over ranks, cells seen by all ranks)."""
        runner = self.step_runner(loader)
        if runner is not None:
            return self.train_epoch_planned(runner, loader, epoch, progress)
        set_train_mode(self.model, self.net, self.cfg.freeze_batchnorm)
        loader.set_epoch(epoch)
        accum = self.cfg.grad_accum_steps
        n_batches = min(len(loader), self.cfg.limit_batches or len(loader))
        totals = epoch_position(self, epoch)  # loss sum and cells so far; batches to skip
        skipped_before = self.state.fold_skips()
        watch = NonFiniteWatch(self.device, enabled=not self.scaler.is_enabled())
        log = TrainProgress(self, epoch, n_batches, totals.start, progress)
        for i, batch in enumerate(loader):
            if i == n_batches:
                break
            if i < totals.start:
                continue  # trained on before the stop; the loader order is fixed by the epoch
            at_step()  # the CPU thread count follows the load, where no bit depends on it
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
                        return stop_mid_epoch(self, epoch, i + 1, totals)
            log.batch_done(i, loss)
        log.close()
        mean_loss = to_host(all_reduce_mean(self.env, totals.loss_sum / max(n_batches, 1))).item()
        self.state.history.skipped_steps.append(self.state.fold_skips() - skipped_before)
        return mean_loss, totals.cells * self.env.world_size

    # ------------------------------------------------------------------- the planned step
    def step_runner(self, loader):
        """The planned step's runner for this loader (gears/train/graph_step.py), or None: not asked
        for, or not possible here (one line says why, once)."""
        if not self.planned:
            return None
        if self.runner is not None and self.runner.plan.loader is loader:
            return self.runner
        why = planned_step_refusal(self, loader)
        plan = None
        if why is None:
            try:
                plan = EpochPlan(loader, self.device, self.per_cell)
                plan.build(0)  # (raises PlanUnsupported for batches of unequal size)
            except PlanUnsupported as refused:
                why = str(refused)
        if why is not None:
            self.planned = False
            if self.env.distributed:  # eager DDP steps: the wrapper
                self.model = wrap_for_training(self.net, self.env, self.dist_cfg, self.cfg.compile)
            if self.env.is_main:
                print(f"train.cuda_graphs: {why}; training with eager steps", flush=True)
            return None
        fixed_shape_graphs(self.net)  # graph propagation without a sparse tensor built per call
        self.runner = StepRunner(self, plan, capture=self.device.type == "cuda")
        # The validation and test forwards replayed the same way (evaluate.predict_deltas).
        self.evaluator.forward_runner = ForwardRunner(
            self.net, self.runner.capture, EVAL_CHUNK, self.env.is_main
        )
        return self.runner

    def train_epoch_planned(self, runner, loader, epoch: int, progress: bool):
        """train_epoch with the planned step: the epoch laid out and uploaded once, then one
        replay per batch; the same checks at the same step boundaries."""
        set_train_mode(self.model, self.net, self.cfg.freeze_batchnorm)
        loader.set_epoch(epoch)
        runner.plan.set_epoch(epoch)
        n_batches = min(len(runner.plan), self.cfg.limit_batches or len(runner.plan))
        totals = epoch_position(self, epoch)
        skipped_before = self.state.fold_skips()
        runner.begin_epoch(totals.start)
        watch = PlannedWatch(self, runner)
        log = TrainProgress(self, epoch, n_batches, totals.start, progress)
        for i in range(totals.start, n_batches):
            runner.run(i)
            self.state.step += 1
            watch.steps[i] = self.step
            totals.cells += runner.plan.batch_size
            self.faults.after_step(epoch, self.step)
            if self.step % self.check_every == 0 or i + 1 == n_batches:
                stop = self.check_step(epoch, watch)
                if stop and i + 1 < n_batches:
                    totals.loss_sum += runner.loss_sum
                    log.close()
                    return stop_mid_epoch(self, epoch, i + 1, totals)
            log.batch_done(i, runner.last_loss)
        log.close()
        totals.loss_sum += runner.loss_sum
        mean_loss = to_host(all_reduce_mean(self.env, totals.loss_sum / max(n_batches, 1))).item()
        self.state.history.skipped_steps.append(self.state.fold_skips() - skipped_before)
        return mean_loss, totals.cells * self.env.world_size

    def scaler_step(self) -> None:
        """Optimizer step through the GradScaler, counting the steps it skips (fp16 overflow:
        not fatal, the scale is lowered and training goes on) on the device: no host sync."""
        if not self.scaler.is_enabled():
            self.scaler.step(self.opt)
            self.scaler.update()
            return
        # The scale tensor, compared on the device (get_scale() is a host sync): it drops
        # exactly when the step was skipped. (Fused Adam / AdamW read GradScaler's inf flag on
        # the device too; with SGD, GradScaler.step reads it on the host.)
        before = self.scaler._get_scale_async().clone()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.state.count_skip(self.scaler._get_scale_async() < before)

    # The training state's numbers under the names callers read (written in self.state).
    @property
    def epoch(self) -> int:
        """Epochs completed."""
        return self.state.epoch

    @property
    def step(self) -> int:
        """Optimizer steps taken, all epochs."""
        return self.state.step

    @property
    def best_epoch(self) -> int:
        """The epoch whose weights fit keeps (0-based; -1 before the first)."""
        return self.state.best_epoch

    @property
    def history(self) -> History:
        """Per-epoch records (what fit returns)."""
        return self.state.history

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps the GradScaler skipped (fp16 overflow), all epochs: the device count
        folded in (a host sync; TrainState.fold_skips)."""
        return self.state.fold_skips()

    def check_step(self, epoch: int, watch: NonFiniteWatch) -> bool:
        """At a step boundary, agree over ranks on the stop flag (the signal any rank got) and raise
        NonFiniteLossError if any rank saw a NaN/inf loss since the last check."""
        first_bad, recorded = watch.take()
        flags = torch.stack(
            [torch.tensor(float(self.stop_requested)), to_host(first_bad >= 0).float()]
        )
        stop, bad = to_host(all_reduce_max(self.env, to_device(flags, self.device))).tolist()
        self.stop_agreed = int(stop)
        if bad:
            raise non_finite_error(self.env, self.pert_data.conditions, epoch, first_bad, recorded)
        return bool(stop)

    # ------------------------------------------------------------------------------ training
    def fit(self, loaders: dict, progress: bool = True) -> History:
        """Train from self.epoch to cfg.epochs: per epoch train_epoch, validation, model
        selection and early stopping (select_epoch), logging, the checkpoint policy
        (checkpoint_due). A SIGTERM (Slurm's preemption / time-limit signal) or SIGINT (Ctrl-C)
        stops every rank at the next step boundary; rank 0 writes a checkpoint and
        TrainingStopped is raised (the entry points exit with status 0 after SIGTERM, 130 after
        SIGINT)."""
        train = loaders["train_loader"]
        check_trainable(train, self.cfg.batch_size, self.env.world_size)
        with stop_requests(self):
            announce(self.env, self.cfg, len(train))
            for epoch in range(self.epoch, self.cfg.epochs):
                if self.run_epoch(train, epoch, "val_loader" in loaders, progress):
                    break
            if self.state.best_state is not None:
                self.net.load_state_dict(self.state.best_state)
            return self.state.history

    def run_epoch(self, train, epoch: int, has_val: bool, progress: bool) -> bool:
        """One epoch and what follows it; True when training stops early."""
        t0 = time.perf_counter()
        loss, cells = self.train_epoch(train, epoch, progress)
        if self.state.partial is not None:  # stopped by SIGTERM within the epoch
            stop_on_signal(self)
        train_s = time.perf_counter() - t0
        sync_buffers(self.env, self.net)
        self.sched.step()
        val = self.evaluator.quick("val") if has_val else {}
        self.state.epoch = epoch + 1
        self.state.history.record(loss, val, time.perf_counter() - t0, cells / max(train_s, 1e-9))
        stop = self.select_epoch(epoch, selection_score(self.cfg.select, val, loss, epoch))
        if self.env.is_main:
            log_epoch(self.cfg, self.wandb, self.history, epoch, loss, val, self.step)
        if self.out_dir is not None and self.checkpoint_due(stop):
            self.save_checkpoint()
        self.faults.after_epoch(epoch + 1, self.step)
        if self.stop_agreed and self.epoch < self.cfg.epochs:
            stop_on_signal(self)
        if stop and self.env.is_main:
            print(
                f"early stopping after epoch {epoch + 1}: no val improvement for "
                f"{self.cfg.early_stopping_patience} epochs",
                flush=True,
            )
        return stop

    def select_epoch(self, epoch: int, metric: float) -> bool:
        """Model selection and early stopping: rank 0 decides (every rank holds the same
        gathered metric) and broadcasts; an improvement keeps this epoch's weights. True when
        train.early_stopping_patience epochs have passed without one."""
        decision, state = None, self.state
        if self.env.is_main:
            improved = metric < state.best_metric
            state.stale_epochs = 0 if improved else state.stale_epochs + 1
            patience = self.cfg.early_stopping_patience
            decision = (improved, patience > 0 and state.stale_epochs >= patience)
        improved, stop = broadcast_object(self.env, decision)
        if improved:
            state.best_metric, state.best_epoch = metric, epoch
            state.best_state = copy.deepcopy(self.net.state_dict())
        return stop

    def checkpoint_due(self, stopping: bool) -> bool:
        """The checkpoint policy after an epoch: every train.checkpoint_every epochs, the last
        one, and whenever training stops (early stopping, a SIGTERM or SIGINT)."""
        every = self.epoch % self.cfg.checkpoint_every == 0
        return every or self.epoch == self.cfg.epochs or stopping or bool(self.stop_agreed)

    def unwrap(self) -> None:
        """Drop the DDP wrapper (after training), so that it is freed while the process group
        is still alive rather than at exit (see distributed.release)."""
        self.model = self.net

    # ---------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> None:
        """Rank 0 writes the whole training state (gears.train.state.write_checkpoint)."""
        write_checkpoint(self)

    def resume(self, asked: bool = True) -> bool:
        """Continue from the newest readable checkpoint in out_dir/checkpoints, if any, when any
        rank asks (gears.train.state.resume). Every rank calls this."""
        # (the kernel this run steps with: a checkpoint of eager steps names another)
        kernel = optimizer_kernel(self.cfg.optimizer, self.device, self.planned)
        if not resume(self, asked, kernel):
            return False
        self.resumed = True
        self.faults.disarm()
        return True
