"""The training step as one fixed-shape function per shape bucket, fed by an epoch plan on the
device, and replayed as a CUDA graph (train.cuda_graphs).

On a GPU this model is host-bound (../DESIGN.md section 3; docs/performance.md, "The planned step
and CUDA graphs"): the GPU idles most of a batch-32 step while the host dispatches its ops. Two
pieces remove the host from the step:

`EpochPlan` lays a whole epoch out at `set_epoch`, vectorised over every batch at once, and
uploads it once: each batch's expression rows (x and y), its distinct groups padded to a shape
bucket (perturbations, conditions, covariate codes, counts 0 for padding rows), each cell's
group (`inverse`) and the number of groups (a device number). A step reads batch `cursor` (a
device counter it advances itself): no host work, no host-to-device copy. The batches are the
training loader's, batch for batch (tests/test_graph_step.py).

`StepRunner` runs forward, loss, backward, gradient clipping and the optimizer step on that plan
as one function per bucket, always in the same shapes (the distinct rows padded with rows that
weigh 0), with the parameters, gradients (allocated once, zeroed inside the step), optimizer
state (fused Adam, capturable, a tensor learning rate the schedule fills in place) and the
accumulators (loss sum, first non-finite batch) keeping their storage. On CUDA each bucket's
step is captured once as a CUDA graph (after a warm-up on a side stream, all graphs in one
memory pool) and replayed; on CPU the same function is called on the same buffers, so that
everything but the capture call runs in every test.

Under DDP (several processes) the graph goes around the local part: per bucket, forward, loss
and backward into gradients that are views of one flat buffer (allocated once) are one
function, replayed; the flat buffer is then averaged over the ranks by one eager all_reduce
(gloo on CPU, NCCL on GPUs), and clipping and the optimizer step are a second function,
replayed. Before the local part rank 0's buffers are broadcast, as DistributedDataParallel does
before each forward. Every rank takes the same bucket for step k (the largest of the ranks',
agreed once an epoch), so the ranks run the same shapes.
"""

from __future__ import annotations

import contextlib
import sys
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from gears.device import to_device, to_host
from gears.model.batch import ModelBatch, split_output
from gears.model.contract import fixed_shape_graphs, graph_buffer_names
from gears.model.kernels import gather_rows
from gears.torch_compat import compiled_backward_config

# A batch's distinct groups are padded to one of this many sizes (multiples of 8 up to the
# batch size): U distinct groups take the smallest bucket >= U.
BUCKET_PARTS = 4


class PlanUnsupported(Exception):
    """Why a run cannot take the planned step (the trainer then trains eagerly, saying so)."""


def round_up(n: int, k: int = 8) -> int:
    return -(-int(n) // k) * k


def row_buckets(batch_size: int, per_cell: bool = False) -> tuple[int, ...]:
    """The padded row counts of a batch of batch_size cells: BUCKET_PARTS multiples of 8 up to
    the batch size rounded up to 8 (batch 32: 8, 16, 24, 32; 256: 64, 128, 192, 256). One
    bucket (the batch's cells) for a network with one row per cell."""
    top = round_up(max(batch_size, 1))
    if per_cell:
        return (top,)
    return tuple(
        sorted({round_up(-(-top * k // BUCKET_PARTS)) for k in range(1, 1 + BUCKET_PARTS)})
    )


def bucket_of(n_rows: np.ndarray, buckets: tuple[int, ...]) -> np.ndarray:
    """The smallest bucket >= each row count."""
    return np.asarray(buckets)[np.searchsorted(np.asarray(buckets), n_rows)]


class PlanBatch(NamedTuple):
    """One planned batch on the device, its groups padded to a bucket of R rows (B cells)."""

    x: torch.Tensor  # [B, G]
    y: torch.Tensor  # [B, G]
    inverse: torch.Tensor  # [B] long
    uniq_pert_index: torch.Tensor  # [R, P] long, -1 for padding rows
    uniq_cond: torch.Tensor  # [R] long, 0 for padding rows
    counts: torch.Tensor  # [R] float, 0 for padding rows
    n_groups: torch.Tensor  # [] float: the real groups
    uniq_covariates: dict[str, torch.Tensor]  # name -> [R] long


class EpochPlan:
    """A training loader's epoch, laid out at set_epoch and uploaded once (see the module's
    docstring). Every batch must hold the same number of cells (drop_last; not
    train.batching=grouped, whose mixed steps are smaller)."""

    def __init__(self, loader, device: torch.device, per_cell: bool = False):
        self.loader, self.dataset = loader, loader.dataset
        self.device, self.per_cell = torch.device(device), per_cell
        expr = self.dataset.expr
        if expr.dense is None:
            raise PlanUnsupported("the expression matrix is CSR (gathered on the host per batch)")
        where = expr.dense.device
        if where.type != self.device.type or self.device.index not in (None, where.index):
            raise PlanUnsupported(
                f"the expression matrix is on {where}, not on {self.device} (too large for "
                "the GPU's memory, or gathered by loader workers: train.num_workers > 0)"
            )
        self.expr = expr.dense
        self.tensors: dict[str, torch.Tensor] = {}
        self.cursor = to_device(torch.zeros(1, dtype=torch.long), self.device)
        self.batch_size = 0
        self.buckets: tuple[int, ...] = ()
        self.bucket: list[int] = []  # each batch's bucket (host)
        self.host: dict[str, np.ndarray] = {}
        self.generation = 0  # bumped when the device storage is reallocated

    def examples(self) -> np.ndarray:
        """This epoch's batches as [n_batches, B] example ids (the loader's sampler order)."""
        batches = [np.asarray(list(b), dtype=np.int64) for b in self.loader.batch_sampler]
        sizes = {len(b) for b in batches}
        if len(sizes) > 1:
            raise PlanUnsupported(f"batches of unequal size ({sorted(sizes)} cells)")
        if not batches:
            return np.zeros((0, 0), dtype=np.int64)
        return np.stack(batches)

    def build(self, epoch: int) -> dict[str, np.ndarray]:
        """The epoch's plan on the host, vectorised over all batches. -> name -> array."""
        ds = self.dataset
        examples = self.examples()
        nb, B = examples.shape
        flat = examples.reshape(-1)
        cond = ds.cond[flat]
        batch_id = np.repeat(np.arange(nb), B)
        # The per-batch np.unique of ExampleSet.__getitem__ (sorted by condition, then the
        # covariate codes), for all batches at once: the batch is the leading sort key.
        key = np.stack([batch_id, cond, *(c[flat] for c in ds.covariates.values())], axis=1)
        uniq_key, inverse, counts = np.unique(key, axis=0, return_inverse=True, return_counts=True)
        group_batch = uniq_key[:, 0]
        n_groups = np.bincount(group_batch, minlength=nb)
        first = np.cumsum(n_groups) - n_groups
        slot = np.arange(len(uniq_key)) - first[group_batch]
        buckets = row_buckets(B, self.per_cell)
        width = buckets[-1]
        P = ds.cond_pert_index.shape[1]
        uniq_cond = np.zeros((nb, width), dtype=np.int64)
        uniq_cond[group_batch, slot] = uniq_key[:, 1]
        plan = {
            "xy_rows": np.concatenate(
                [ds.control_rows(flat, epoch).reshape(nb, B), ds.rows[flat].reshape(nb, B)], 1
            ),
            "inverse": inverse.reshape(nb, B) - first[:, None],
            "uniq_cond": uniq_cond,
            "counts": np.zeros((nb, width), dtype=np.float32),
            "pert": np.full((nb, width, P), -1, dtype=np.int64),
            "n_groups": n_groups.astype(np.float32),
        }
        plan["counts"][group_batch, slot] = counts
        plan["pert"][group_batch, slot] = ds.cond_pert_index.numpy()[uniq_key[:, 1]]
        for j, name in enumerate(ds.covariates):
            codes = np.zeros((nb, width), dtype=np.int64)
            codes[group_batch, slot] = uniq_key[:, 2 + j]
            plan[f"cov:{name}"] = codes
        self.batch_size, self.buckets = B, buckets
        self.bucket = bucket_of(n_groups, buckets).tolist() if not self.per_cell else [width] * nb
        return plan

    def set_epoch(self, epoch: int) -> None:
        """Lay the epoch out and upload it into the same device storage as the last epoch's
        (reallocated, and `generation` bumped, only when the shapes change)."""
        host = self.build(epoch)
        same = host.keys() == self.tensors.keys() and all(
            tuple(self.tensors[k].shape) == v.shape for k, v in host.items()
        )
        if same:
            for name, array in host.items():
                self.tensors[name].copy_(torch.from_numpy(array))
        else:
            self.tensors = {k: to_device(torch.from_numpy(v), self.device) for k, v in host.items()}
            self.generation += 1
        self.host = host
        self.cursor.fill_(0)

    def __len__(self) -> int:
        return len(self.bucket)

    def read(self, bucket: int, index: torch.Tensor | int | None = None) -> PlanBatch:
        """Batch `index` (default: the device cursor, read on the device) padded to `bucket`
        rows: every op's shape depends on the bucket alone."""
        t = self.tensors
        if index is None:
            index = self.cursor
        elif isinstance(index, int):
            index = torch.full((1,), index, dtype=torch.long, device=self.cursor.device)

        def row(name: str) -> torch.Tensor:
            return t[name].index_select(0, index)[0]

        B = self.batch_size
        xy = self.expr.index_select(0, row("xy_rows"))
        covariates = {
            name.removeprefix("cov:"): row(name)[:bucket] for name in t if name.startswith("cov:")
        }
        return PlanBatch(
            x=xy[:B],
            y=xy[B:],
            inverse=row("inverse"),
            uniq_pert_index=row("pert")[:bucket],
            uniq_cond=row("uniq_cond")[:bucket],
            counts=row("counts")[:bucket],
            n_groups=row("n_groups"),
            uniq_covariates=covariates,
        )


class StepRunner:
    """The planned training step of a Trainer (see the module's docstring). `run(i)` trains on
    the plan's batch i, which must be the cursor's (the runner advances the cursor itself)."""

    def __init__(self, trainer, plan: EpochPlan, capture: bool):
        self.trainer, self.plan, self.capture = trainer, plan, capture
        self.net, self.opt = trainer.net, trainer.opt
        device = trainer.device
        self.params = [p for p in self.net.parameters() if p.requires_grad]
        self.loss_sum = to_device(torch.zeros(()), device)
        self.last_loss = to_device(torch.zeros(()), device)
        self.first_bad = to_device(torch.full((), -1, dtype=torch.long), device)
        self.graphs: dict[int, object] = {}
        self.pool = None
        self.stepped = False  # the first step allocates the gradients and optimizer state
        self.generation = plan.generation
        self.captured_storage: tuple[int, ...] = ()
        tensor_lr(self.opt)
        # DDP: the trainer's module is the network itself, compiled with train.compile, with no
        # DistributedDataParallel (the runner averages the gradients: average_gradients).
        self.world = trainer.env.world_size if trainer.env.distributed else 1
        self.model = trainer.model
        self.flat_grads: list[torch.Tensor] = []
        self.synced_buffers: list[tuple[torch.Tensor, list, list]] = []
        if self.world > 1:
            graphs = set(graph_buffer_names(self.net))
            buffers = [b for n, b in self.net.named_buffers() if n not in graphs]
            self.synced_buffers = packed_buffers(buffers)

    # ------------------------------------------------------------------------- the step
    def step_fn(self, bucket: int) -> None:
        """One optimizer step on the cursor's batch: forward, loss, backward, clipping, Adam,
        the accumulators, the cursor. Same ops and shapes for every batch of a bucket."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            torch._foreach_zero_(grads)
        loss = planned_loss(self.trainer, self.plan.read(bucket))
        loss.backward()
        self.update_fn()
        self.tally(loss.detach())

    def local_fn(self, bucket: int) -> None:
        """DDP's first part, this rank's alone: forward, loss and backward into the flat
        gradients, the accumulators, the cursor. Same ops and shapes for every batch of a
        bucket."""
        if self.flat_grads:  # (the first step creates the gradients: flat_grads_of_used)
            torch._foreach_zero_(self.flat_grads)
        loss = planned_loss(self.trainer, self.plan.read(bucket), self.model)
        loss.backward()
        self.tally(loss.detach())

    def tally(self, loss: torch.Tensor) -> None:
        """A step's accumulators on the device: the last loss, the epoch's loss sum, the first
        non-finite batch; then the cursor moves to the next batch."""
        plan = self.plan
        self.last_loss.copy_(loss)
        self.loss_sum.add_(loss)
        bad = (self.first_bad < 0) & ~torch.isfinite(loss)
        self.first_bad.copy_(torch.where(bad, plan.cursor[0], self.first_bad))
        plan.cursor.add_(1)

    def update_fn(self) -> None:
        """Clipping and the optimizer step: the single-process step's last part, and DDP's
        (on the averaged gradients)."""
        if self.trainer.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_value_(self.params, self.trainer.cfg.grad_clip, foreach=True)
        self.opt.step()

    def average_gradients(self) -> None:
        """The flat gradients averaged over the ranks, eagerly between two replays: divided by
        the world size, then one all_reduce (a sum), as DistributedDataParallel's default."""
        for flat in self.flat_grads:
            flat.div_(self.world)
            dist.all_reduce(flat)

    def broadcast_buffers(self) -> None:
        """Rank 0's buffers (batch-norm statistics; not the fixed graphs) on every rank, as
        DistributedDataParallel broadcasts them before each forward: packed into one flat
        buffer per dtype, one broadcast each, unpacked (the same ops on every rank)."""
        for flat, views, buffers in self.synced_buffers:
            torch._foreach_copy_(views, buffers)
            dist.broadcast(flat, src=0)
            torch._foreach_copy_(buffers, views)

    def run_distributed(self, bucket: int) -> None:
        """One DDP step: buffers from rank 0, the local part (replayed), the gradients averaged,
        the update (replayed). Captured on CUDA after a first, uncaptured step (undone when
        capturing: dry_step)."""
        if self.capture and not self.stepped:
            self.dry_step(lambda: self._distributed_parts(bucket))
        self._distributed_parts(bucket)

    def _distributed_parts(self, bucket: int) -> None:
        self.broadcast_buffers()
        parts = ((("local", bucket), lambda: self.local_fn(bucket)), ("update", self.update_fn))
        for n, (key, fn) in enumerate(parts):
            if n == 1:
                if not self.flat_grads:
                    self.flat_grads_of_used()
                self.average_gradients()
            capture = self.stepped and self.capture
            replay_or_call(
                self.graphs, key, fn, capture and (lambda k=key, f=fn: self._capture(k, f))
            )
        self.stepped = True

    def run(self, i: int) -> None:
        """Train on batch i (the cursor's): the bucket's graph replayed, or the step called."""
        bucket = self.plan.bucket[i]
        if self.plan.generation != self.generation:  # the plan's storage moved: recapture
            self.graphs.clear()
            self.generation = self.plan.generation
        if self.world > 1:
            self.run_distributed(bucket)
            return
        if not self.stepped:  # gradients and optimizer state are created by this first step
            if not self.capture:
                self.step_fn(bucket)
                self.stepped = True
                return
            self.dry_step(lambda: self.step_fn(bucket))
            self.stepped = True
        replay_or_call(
            self.graphs,
            bucket,
            lambda: self.step_fn(bucket),
            self.capture and (lambda: self._capture(bucket)),
        )

    def dry_step(self, step) -> None:
        """A process's first step, step(), run and undone: it allocates the gradients and the
        optimizer state, which a capture needs, and leaves the state as it found it (what
        existed restored, what it created zeroed: a fresh optimizer state, Adam's step 0).
        Every step a capturing runner trains is then a replay, so that a run resumed in a new
        process takes the same kernels at every step as one that never stopped (an uncaptured
        first step may round differently from the graph's replays)."""
        before = self.state_tensors()
        saved = [t.clone() for t in before]
        step()

        def where(t):  # (state_tensors gives new objects for the same storage: p.data)
            return t.data_ptr(), tuple(t.shape), t.dtype

        known = {where(t) for t in before}
        with torch.no_grad():
            torch._foreach_copy_(before, saved)
            created = [t for t in self.state_tensors() if where(t) not in known]
            if created:
                torch._foreach_zero_(created)

    def begin_epoch(self, start: int) -> None:
        """At an epoch's start (start > 0: resuming within it): cursor and accumulators; the
        captured graphs are dropped when any storage they read has moved (a loaded checkpoint's
        optimizer state, a new learning-rate tensor, the plan reallocated)."""
        if self.capture and self.graphs and self.storage() != self.captured_storage:
            self.graphs.clear()
        if self.world > 1:
            self.agree_buckets()
        self.plan.cursor.fill_(start)
        self.loss_sum.zero_()
        self.first_bad.fill_(-1)

    def flat_grads_of_used(self) -> None:
        """After the first local part: the gradients of the parameters it used on any rank
        (the same set at every step: one fixed function per bucket) moved into views of one
        flat buffer, the same layout on every rank. A parameter no rank used keeps no
        gradient, so the optimizer skips it, as after eager DDP's backward."""
        used = torch.tensor([p.grad is not None for p in self.params], dtype=torch.long)
        if dist.get_backend() == "nccl":
            used = used.to(self.trainer.device)
        dist.all_reduce(used, op=dist.ReduceOp.MAX)
        chosen = [p for p, u in zip(self.params, used.cpu().tolist(), strict=True) if u]
        self.flat_grads = flat_gradients(chosen)

    def agree_buckets(self) -> None:
        """Every rank's bucket for step k: the largest of the ranks' (one all_reduce of the
        epoch's buckets), so that the ranks run the same shapes. The padding rows weigh 0."""
        mine = torch.tensor(self.plan.bucket, dtype=torch.long)
        if dist.get_backend() == "nccl":
            mine = mine.to(self.trainer.device)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        self.plan.bucket = mine.cpu().tolist()

    # ---------------------------------------------------------------------------- capture
    def storage(self) -> tuple[int, ...]:
        """The addresses a captured step reads and writes (state, learning rates, plan)."""
        tensors = self.state_tensors() + list(self.plan.tensors.values()) + [self.plan.expr]
        tensors += [g["lr"] for g in self.opt.param_groups if torch.is_tensor(g["lr"])]
        return tuple(t.data_ptr() for t in tensors)

    def state_tensors(self) -> list[torch.Tensor]:
        """Everything a step writes: parameters, gradients, optimizer state, buffers (not the
        fixed graphs), accumulators, the cursor."""
        graphs = set(graph_buffer_names(self.net))
        out = [p.data for p in self.params]
        out += [p.grad for p in self.params if p.grad is not None]
        out += [v for s in self.opt.state.values() for v in s.values() if torch.is_tensor(v)]
        out += [b for n, b in self.net.named_buffers() if n not in graphs]
        return out + [self.loss_sum, self.last_loss, self.first_bad, self.plan.cursor]

    # The CUDA API the capture uses, and the graph object of a bucket: torch's, replaced in
    # tests/test_graph_step.py by a stand-in that runs the captured function on replay (the
    # warm-up, the undoing of its effects, the pool and the fallback then run on the CPU).
    cuda = torch.cuda

    def new_graph(self, bucket):
        return torch.cuda.CUDAGraph()

    def _capture(self, bucket, fn=None):
        """The bucket's step (or under DDP one part of it, `fn`, keyed by `bucket`) as a CUDA
        graph: warm-up calls on a side stream (their effects undone), then the capture; None
        (and one line) when capturing fails: eager steps."""
        if fn is None:
            fn = lambda: self.step_fn(bucket)  # noqa: E731
        state = self.state_tensors()
        saved = [t.clone() for t in state]

        def restore():
            with torch.no_grad():
                torch._foreach_copy_(state, saved)

        try:
            graph = capture_graph(
                self.cuda, fn, lambda: self.new_graph(bucket), self.pool, reset=restore
            )
            if self.pool is None:
                self.pool = graph.pool()
            self.captured_storage = self.storage()
        except Exception as error:  # noqa: BLE001 - any capture failure falls back to eager
            graph = None
            self.capture = False
            if self.trainer.env.is_main:
                capture_failed("the step", "training with eager steps", error)
        restore()
        return graph


def replay_or_call(graphs: dict, key, fn, capture) -> None:
    """key's graph replayed; captured first by capture() (-> the graph, or None when capturing
    failed) when capture is given and key has none yet; fn() itself where there is no graph
    (capture off, or failed)."""
    if capture and key not in graphs:
        graphs[key] = capture()
    graph = graphs.get(key)
    if graph is not None:
        graph.replay()
    else:
        fn()


def capture_graph(cuda, fn, new_graph, pool, reset=None):
    """fn() captured as a CUDA graph: two warm-up calls on a side stream (the first calls of an
    op allocate and choose kernels, which a capture must not see), then the capture into
    new_graph() in `pool` (None: a new one). -> the graph; raises when capturing fails.
    reset(): called before each warm-up call and before the capture, so that each starts from
    the same state (the training step's cursor at the batch being captured: a warm-up that
    read the next batches could index past the bucket's rows or past the epoch's plan).
    `cuda` is torch.cuda, or the tests' CPU stand-in for it."""
    side = cuda.Stream()
    side.wait_stream(cuda.current_stream())
    with cuda.stream(side):
        for _ in range(2):
            if reset is not None:
                reset()
            fn()
    cuda.current_stream().wait_stream(side)
    if reset is not None:
        reset()
    graph = new_graph()
    with cuda.graph(graph, pool=pool):
        fn()
    return graph


def capture_failed(what: str, fallback: str, error: Exception) -> None:
    """The one line a capture that failed prints (rank 0): what, why, and what runs instead."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    print(
        f"train.cuda_graphs: capturing {what} failed ({type(error).__name__}: {first}); {fallback}",
        file=sys.stderr,
        flush=True,
    )


def tensor_lr(opt: torch.optim.Optimizer) -> None:
    """Each parameter group's learning rate as a 0-dim tensor on its parameters' device, which
    the schedulers then fill in place (a captured step reads it from the same storage). float64
    on CPU (the Python number's precision, as an eager step), float32 on a GPU (what the fused
    CUDA kernels read; they compute fp32 parameters' updates in fp32 either way)."""
    for group in opt.param_groups:
        lr = group["lr"]
        if not torch.is_tensor(lr):
            device = torch.device(group["params"][0].device if group["params"] else "cpu")
            dtype = torch.float64 if device.type == "cpu" else torch.float32
            group["lr"] = to_device(torch.tensor(float(lr), dtype=dtype), device)


def flat_gradients(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each parameter's gradient set to a view of one flat buffer per dtype (one in practice),
    allocated once, holding the gradient it had (zero for none): backward accumulates into the
    views in place, and one all_reduce averages all of them. -> the flat buffers."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    flats = []
    for dtype, group in by_dtype.items():
        flat = torch.zeros(sum(p.numel() for p in group), dtype=dtype, device=group[0].device)
        offset = 0
        for p in group:
            view = flat[offset : offset + p.numel()].view_as(p)
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view
            offset += p.numel()
        flats.append(flat)
    return flats


def packed_buffers(buffers: list[torch.Tensor]) -> list[tuple[torch.Tensor, list, list]]:
    """(flat buffer, its views shaped as the buffers, the buffers) per dtype, allocated once:
    the buffers are copied in and out of the flat one around a broadcast (they stay where
    they are: the module's attributes and a captured graph read them there)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for b in buffers:
        by_dtype.setdefault(b.dtype, []).append(b)
    packed = []
    for dtype, group in by_dtype.items():
        flat = torch.zeros(sum(b.numel() for b in group), dtype=dtype, device=group[0].device)
        views, offset = [], 0
        for b in group:
            views.append(flat[offset : offset + b.numel()].view_as(b))
            offset += b.numel()
        packed.append((flat, views, group))
    return packed


def planned_loss(trainer, batch: PlanBatch, model=None) -> torch.Tensor:
    """The loss of a planned batch: the padded distinct rows weighted by their counts (padding
    rows weigh 0), or one row per cell for a network that reads x or asks for per-cell rows;
    GEARS's loss over the real groups (n_groups). Trainer.loss_on's numbers. model: the module
    called (default the trainer's; the network itself under DDP)."""
    B = batch.x.shape[0]
    codes = {name: batch.uniq_covariates[name] for name in trainer.covariates}
    if trainer.per_cell:
        rows = ModelBatch(
            batch.uniq_pert_index[batch.inverse],
            1.0,
            batch.x if trainer.reads_x else None,
            {k: c[batch.inverse] for k, c in codes.items()},
        )
    else:
        rows = ModelBatch(batch.uniq_pert_index, batch.counts, None, codes, float(B))
    compiled = trainer.cfg.compile
    with autocast_uncached(trainer), compiled_backward_config() if compiled else _none():
        out = (trainer.model if model is None else model)(rows)
    change, logvar = split_output(out)
    if not trainer.per_cell:
        change = gather_rows(change, batch.inverse)
        logvar = None if logvar is None else gather_rows(logvar, batch.inverse)
    return trainer.cell_loss(batch, change, logvar, n_groups=batch.n_groups)


def _none():
    return contextlib.nullcontext()


def autocast_uncached(trainer):
    """The forward's autocast (train.precision) with its weight-cast cache off: a captured
    step must cast inside the graph, not reuse a cast made outside it."""
    if trainer.amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(trainer.device.type, dtype=trainer.amp_dtype, cache_enabled=False)


class ForwardRunner:
    """predict_deltas's forward (gears/train/evaluate.py) replayed like the training step: the rows
    in
    chunks of `rows` (the last one padded with control rows, covariate code 0 and x 0, whose
    outputs are dropped), copied into static input buffers of the chunk's shape (perturbation
    slots, genes of x, covariate names), the network run in eval mode, its change (and
    log-variance) copied into static output buffers, read back. On CUDA each shape is captured
    once as a CUDA graph (after a warm-up on a side stream; all of this runner's graphs in one
    memory pool, apart from the training step's) and replayed; on CPU, or after a capture
    failed, the same function runs on the same buffers. Batch-norm in eval mode reads running
    statistics, so a row's output does not depend on its chunk's other rows."""

    def __init__(self, net: torch.nn.Module, capture: bool, rows: int, is_main: bool = True):
        self.net, self.capture, self.rows, self.is_main = net, capture, int(rows), is_main
        self.static: dict[tuple, dict[str, torch.Tensor]] = {}
        self.graphs: dict[tuple, object] = {}
        self.pool = None
        self.captured_storage: tuple[int, ...] = ()
        fixed_shape_graphs(net)  # graph propagation without a sparse tensor built per call

    def run(self, pert_index: np.ndarray, x, covariates: dict[str, np.ndarray]):
        """One chunk of at most `rows` rows: pert_index [n, P], x [n, G] (tensor) or None,
        covariates name -> [n] codes. -> change [n, G], logvar [n, G] or None (float32, host)."""
        n = len(pert_index)
        key = (pert_index.shape[1], None if x is None else x.shape[1], tuple(covariates))
        static = self.static.get(key) or self._allocate(key)
        fill = {"pert": (pert_index, -1), "x": (x, 0)}
        fill.update({f"cov:{k}": (v, 0) for k, v in covariates.items()})
        for name, (value, pad) in fill.items():
            if value is not None:
                static[name][:n].copy_(torch.as_tensor(value))
                static[name][n:].fill_(pad)
        if self.capture and self.graphs and self.storage() != self.captured_storage:
            self.graphs.clear()  # the parameters (or buffers) moved: capture again
        replay_or_call(
            self.graphs,
            key,
            lambda: self.forward_fn(key),
            self.capture and (lambda: self._capture(key)),
        )
        logvar = static.get("logvar")  # (copies: the next chunk overwrites the buffers)
        return (
            to_host(static["delta"][:n]).numpy().copy(),
            None if logvar is None else to_host(logvar[:n]).numpy().copy(),
        )

    def _allocate(self, key: tuple) -> dict[str, torch.Tensor]:
        """The static inputs of a chunk shape; the outputs are allocated by its first call."""
        P, G, names = key
        device = next(self.net.parameters()).device
        static = {"pert": to_device(torch.full((self.rows, P), -1, dtype=torch.long), device)}
        if G is not None:
            static["x"] = to_device(torch.zeros(self.rows, G), device)
        for name in names:
            static[f"cov:{name}"] = to_device(torch.zeros(self.rows, dtype=torch.long), device)
        self.static[key] = static
        return static

    def forward_fn(self, key: tuple) -> None:
        """The network on the static inputs of `key`, its outputs copied into static outputs
        (allocated by the first call: the warm-up on CUDA). Same ops for every chunk of a key."""
        static = self.static[key]
        names = key[2]
        batch = ModelBatch(
            static["pert"],
            x=static.get("x"),
            covariates={name: static[f"cov:{name}"] for name in names},
        )
        delta, logvar = split_output(self.net(batch))
        for name, value in (("delta", delta), ("logvar", logvar)):
            if value is None:
                continue
            if name not in static:
                static[name] = torch.empty(value.shape, dtype=torch.float32, device=value.device)
            static[name].copy_(value)

    def storage(self) -> tuple[int, ...]:
        """The addresses a captured forward reads: parameters, buffers."""
        tensors = list(self.net.parameters()) + list(self.net.buffers())
        return tuple(t.data_ptr() for t in tensors)

    # torch's CUDA API and graph object; replaced in tests by StepRunner's stand-ins.
    cuda = torch.cuda

    def new_graph(self, key: tuple):
        return torch.cuda.CUDAGraph()

    def _capture(self, key: tuple):
        """The chunk shape's forward as a CUDA graph (warm-up on a side stream, then the
        capture); None (and one line) when capturing fails: the forward then runs uncaptured.
        An eval-mode forward changes no state, so nothing is undone."""
        try:
            graph = capture_graph(
                self.cuda, lambda: self.forward_fn(key), lambda: self.new_graph(key), self.pool
            )
            if self.pool is None:
                self.pool = graph.pool()
            self.captured_storage = self.storage()
            return graph
        except Exception as error:  # noqa: BLE001 - any capture failure falls back to eager
            self.capture = False
            if self.is_main:
                capture_failed("the evaluation forward", "evaluating with eager forwards", error)
            return None
