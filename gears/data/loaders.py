"""Batches gathered from tensors: expression kept once, examples as (control, cell, condition)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import NamedTuple

import numpy as np
import scipy.sparse as sp
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, Sampler

from gears.device import holds_device_memory, to_device
from gears.errors import GearsInputError

# Dense expression up to this many bytes; larger screens stay CSR and are densified per batch.
DENSE_LIMIT_BYTES = 8 * 1024**3
# A dense matrix moves onto the GPU when it takes at most this fraction of the free memory.
GPU_FRACTION = 0.25


class ExpressionMatrix:
    """One copy of the [cells, genes] float32 expression, dense tensor or CSR, indexed per batch."""

    def __init__(self, X, dense_limit_bytes: int = DENSE_LIMIT_BYTES):
        n, g = X.shape
        self.shape = (n, g)
        if sp.issparse(X) and n * g * 4 > dense_limit_bytes:
            self.dense = None
            self.csr = sp.csr_matrix(X, dtype=np.float32)
        else:
            array = X.toarray() if sp.issparse(X) else np.asarray(X)
            self.dense = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
            self.csr = None
        self.host = self.dense  # the host copy; dense is the gather source (host or device)

    @classmethod
    def shared(cls, matrix) -> ExpressionMatrix:
        """Wrap a memory-mapped store matrix without copying it.

        matrix: a read-only np.memmap [cells, genes] float32, or a scipy CSR whose arrays are
        memory-maps. Batches are gathered from the mapping, so the pages stay in the page cache
        that every process on the node shares.
        """
        self = cls.__new__(cls)
        self.shape = tuple(matrix.shape)
        if sp.issparse(matrix):
            self.dense, self.csr = None, matrix
        else:
            with warnings.catch_warnings():  # read-only mapping: batches are gathered copies
                warnings.simplefilter("ignore", UserWarning)
                self.dense = torch.from_numpy(matrix)
            self.csr = None
        self.host = self.dense
        return self

    def place(self, device: torch.device, gather_on_device: bool = True) -> bool:
        """Keep a dense matrix on a GPU when it fits in GPU_FRACTION of the free memory and
        batches are gathered in this process (GPU_REVIEW defect 9); else on the host (CSR
        matrices, CPU devices, loader worker processes, which must not index GPU memory).
        Returns whether batches are now born on the device (then they need no pinning).
        Idempotent: a second loader build finds the matrix where the first one put it."""
        if self.dense is None:
            return False
        on_device = gather_on_device and holds_device_memory(device)
        if on_device and self.dense is self.host:
            if torch.device(device).type == "cuda":
                free, _ = torch.cuda.mem_get_info(device)  # GPU-only line
                on_device = self.host.numel() * self.host.element_size() <= GPU_FRACTION * free
            if on_device:
                self.dense = to_device(self.host, device)
        elif not on_device:
            self.dense = self.host
        return on_device

    def rows(self, idx: np.ndarray) -> torch.Tensor:
        """[len(idx), genes] float32 (on the matrix's device)."""
        if self.dense is not None:
            index = torch.from_numpy(np.asarray(idx, dtype=np.int64))
            return self.dense[index.to(self.dense.device, non_blocking=True)]
        return torch.from_numpy(self.csr[idx].toarray())

    def numpy(self):
        """The matrix as numpy (dense) or scipy CSR, from the host copy (no device read)."""
        return self.csr if self.dense is None else self.host.numpy()


def pairing_hash(seed: int, epoch: int, example: np.ndarray) -> np.ndarray:
    """splitmix64 of (seed, epoch, example index): a counter-based draw, independent of rank.

    example [n] int -> [n] uint64. The same example gets the same control cell in an epoch whatever
    the world size, batch size or order in which examples are visited.
    """
    with np.errstate(over="ignore"):
        z = np.asarray(example, dtype=np.uint64)
        z = z + np.uint64((seed * 0x9E3779B1 + epoch * 0x85EBCA77 + 1) & 0xFFFFFFFFFFFFFFFF)
        z = z * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


@dataclass
class Batch:
    """One batch. Shapes: B examples, G genes, P = 2 perturbation slots, U distinct groups: the
    distinct conditions, or with covariates the distinct (condition, covariate codes)."""

    x: torch.Tensor  # [B, G] paired control cell (the residual input)
    y: torch.Tensor  # [B, G] observed perturbed cell
    pert_index: torch.Tensor  # [B, P] long, indices into the perturbation vocabulary, -1 padded
    cond: torch.Tensor  # [B] long, condition ids
    de_idx: torch.Tensor  # [B, 20] long, top-20 DE gene indices of the condition, -1 padded
    uniq_cond: torch.Tensor  # [U] long, each distinct group's condition
    uniq_pert_index: torch.Tensor  # [U, P] long
    inverse: torch.Tensor  # [B] long, position of each example's group in uniq_cond
    counts: torch.Tensor  # [U] float, examples per distinct group
    example: torch.Tensor  # [B] long, example ids within the split set
    # name -> [U] long, each distinct group's covariate codes (the loaders' covariates only)
    uniq_covariates: dict[str, torch.Tensor] = field(default_factory=dict)

    def to(self, device, non_blocking: bool = False) -> Batch:
        return self._map(lambda t: to_device(t, device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        return self._map(lambda t: t.pin_memory())

    def _map(self, move) -> Batch:
        """The batch with every tensor (covariate codes included) passed through move."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, dict):
                moved[name] = {k: move(v) for k, v in value.items()}
            else:
                moved[name] = move(value)
        return Batch(**moved)

    def __len__(self) -> int:
        return self.cond.shape[0]


class EpochBatch(NamedTuple):
    """A batch request carrying its epoch, for worker processes that outlive an epoch."""

    epoch: int
    examples: list


class _EpochTaggedSampler:
    """Wraps a batch sampler so each request names the loader's current epoch."""

    def __init__(self, batch_sampler, owner: EpochLoader):
        self.batch_sampler, self.owner = batch_sampler, owner

    def __iter__(self) -> Iterator[EpochBatch]:
        epoch = self.owner.epoch
        return (EpochBatch(epoch, list(b)) for b in self.batch_sampler)

    def __len__(self) -> int:
        return len(self.batch_sampler)


class ExampleSet(Dataset):
    """The examples of one split set; `dataset[list_of_example_ids]` gathers a whole Batch.

    rows [n] cell rows (targets y), cond [n] condition ids. Control examples (condition `ctrl`) use
    their own cell as input (x = y, as GEARS); every other example is paired with a control cell
    drawn by `pairing_hash(seed, epoch, example id)`: among all control cells, or with
    `context` (a code per cell row of the matrix) among those of the example's own context.
    covariates: name -> a code per cell row of the matrix; batches then group their examples
    by (condition, codes) and carry each group's codes (Batch.uniq_covariates).
    """

    def __init__(
        self,
        expr: ExpressionMatrix,
        rows: np.ndarray,
        cond: np.ndarray,
        ctrl_rows: np.ndarray,
        ctrl_cond: int,
        cond_pert_index: np.ndarray,
        de_idx: np.ndarray,
        seed: int,
        context: np.ndarray | None = None,
        covariates: dict[str, np.ndarray] | None = None,
    ):
        self.expr = expr
        self.rows = np.asarray(rows, dtype=np.int64)
        self.cond = np.asarray(cond, dtype=np.int64)
        self.ctrl_rows = np.asarray(ctrl_rows, dtype=np.int64)
        self.is_ctrl = self.cond == ctrl_cond
        self.cond_pert_index = torch.as_tensor(cond_pert_index, dtype=torch.long)
        self.de_idx = torch.as_tensor(de_idx, dtype=torch.long)
        self.seed = seed
        self.epoch = 0
        self.covariates = {
            k: np.asarray(v, np.int64)[self.rows] for k, v in (covariates or {}).items()
        }
        self.pool = None  # pairing within contexts: (example context, control pool start, size)
        if context is not None:
            context = np.asarray(context, dtype=np.int64)
            ctrl_context = context[self.ctrl_rows]
            order = np.argsort(ctrl_context, kind="stable")
            self.ctrl_rows = self.ctrl_rows[order]  # grouped by context, in row order within
            sizes = np.bincount(ctrl_context, minlength=int(context.max()) + 1)
            self.pool = (context[self.rows], np.cumsum(sizes) - sizes, sizes)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.rows.shape[0]

    def control_rows(self, example: np.ndarray, epoch: int | None = None) -> np.ndarray:
        """The control cell row paired with each example in `epoch` (default: the current one)."""
        epoch = self.epoch if epoch is None else epoch
        if self.pool is None:
            draw = pairing_hash(self.seed, epoch, example) % np.uint64(len(self.ctrl_rows))
            paired = self.ctrl_rows[draw.astype(np.int64)]
        else:
            context, start, size = self.pool
            group = context[example]
            pool = np.maximum(size[group], 1).astype(np.uint64)  # (PertData: none is empty)
            draw = pairing_hash(self.seed, epoch, example) % pool
            paired = self.ctrl_rows[start[group] + draw.astype(np.int64)]
        return np.where(self.is_ctrl[example], self.rows[example], paired)

    def __getitem__(self, example) -> Batch:
        epoch = None
        if isinstance(example, EpochBatch):  # from a persistent worker: the epoch travels along
            epoch, example = example.epoch, example.examples
        example = np.asarray(example, dtype=np.int64)
        y_rows = self.rows[example]
        x_rows = self.control_rows(example, epoch)
        # One gather for x and y together keeps the copy in a single pass.
        xy = self.expr.rows(np.concatenate([x_rows, y_rows]))
        cond_np = self.cond[example]
        codes = {}
        if self.covariates:  # distinct (condition, codes) groups, sorted by condition first
            key = np.stack([cond_np, *(c[example] for c in self.covariates.values())], axis=1)
            uniq_key, inverse, counts = np.unique(
                key, axis=0, return_inverse=True, return_counts=True
            )
            uniq = np.ascontiguousarray(uniq_key[:, 0])
            codes = {
                k: torch.from_numpy(np.ascontiguousarray(uniq_key[:, i + 1]))
                for i, k in enumerate(self.covariates)
            }
        else:
            uniq, inverse, counts = np.unique(cond_np, return_inverse=True, return_counts=True)
        cond = torch.from_numpy(cond_np)
        uniq_t = torch.from_numpy(uniq)
        return Batch(
            x=xy[: len(example)],
            y=xy[len(example) :],
            pert_index=self.cond_pert_index[cond],
            cond=cond,
            de_idx=self.de_idx[cond],
            uniq_cond=uniq_t,
            uniq_pert_index=self.cond_pert_index[uniq_t],
            inverse=torch.from_numpy(inverse.reshape(-1).astype(np.int64)),
            counts=torch.from_numpy(counts.astype(np.float32)),
            example=torch.from_numpy(example),
            uniq_covariates=codes,
        )


class ShardSampler(Sampler):
    """Evaluation order: a contiguous 1/world_size share of the examples, no padding duplicates."""

    def __init__(self, n: int, world_size: int = 1, rank: int = 0):
        self.indices = np.array_split(np.arange(n), world_size)[rank].tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class BlockShuffleSampler(Sampler):
    """Shuffled order that reads storage in contiguous blocks (as scDataset does).

    Each epoch (seeded by seed and epoch only) shuffles blocks of `block_size` consecutive
    examples, then the examples inside each block; rank r takes every world_size-th example of
    that order after dropping the remainder, so the ranks cover each example at most once per
    epoch and together form the single-process order. Consecutive examples are consecutive cell
    rows, so a backed or memory-mapped matrix is read a block at a time instead of row by row.
    """

    def __init__(self, n: int, block_size: int, seed: int, world_size: int = 1, rank: int = 0):
        self.n, self.block_size = n, max(1, block_size)
        self.seed, self.world_size, self.rank = seed, world_size, rank
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self) -> np.ndarray:
        """The single-process order of this epoch. -> [n] example ids."""
        rng = np.random.default_rng([self.seed, self.epoch, 1])
        starts = rng.permutation(np.arange(0, self.n, self.block_size))
        return (
            np.concatenate([s + rng.permutation(min(self.block_size, self.n - s)) for s in starts])
            if self.n
            else np.zeros(0, dtype=np.int64)
        )

    def __iter__(self) -> Iterator[int]:
        usable = self.n - self.n % self.world_size
        return iter(self.order()[:usable][self.rank :: self.world_size].tolist())

    def __len__(self) -> int:
        return self.n // self.world_size


class GroupedBatchSampler(Sampler):
    """Batches of K conditions x M cells (`train.batching: grouped`), sharded by rank.

    Each epoch (seeded by seed and epoch only) shuffles every condition's examples and cuts them
    into groups of M; a condition's last group holds the remainder (fewer than M cells). Global
    steps take K * world_size groups of one size: the full groups, and the remainder groups
    of each size, are dealt separately, so a step's conditions all carry the same number of
    cells (the network's batch-norms then take the native kernel instead of the weighted one).
    The groups left over by each size (fewer than a step) make mixed steps; the steps are
    shuffled. Rank r takes groups [r*K, (r+1)*K) of each step, so the ranks' step-k batches
    together are the single-process step-k batch. An incomplete final step is dropped.
    """

    def __init__(
        self,
        cond: np.ndarray,
        cells_per_group: int,
        groups_per_batch: int,
        seed: int,
        world_size: int = 1,
        rank: int = 0,
    ):
        self.cond = np.asarray(cond)
        self.m, self.k = cells_per_group, groups_per_batch
        self.seed, self.world_size, self.rank = seed, world_size, rank
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _steps(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]:
        """This epoch's plan -> (examples ordered group after group, each group's start and
        size in that order, the global steps as arrays of K * world_size group ids: groups of
        equal size first, then the mixed leftovers, then all steps shuffled)."""
        rng = np.random.default_rng([self.seed, self.epoch])
        n = len(self.cond)
        order = rng.permutation(n)
        # Stable sort by condition of a random permutation = every condition's examples shuffled.
        shuffled = order[np.argsort(self.cond[order], kind="stable")]
        cond = self.cond[shuffled]
        first = np.r_[True, cond[1:] != cond[:-1]] if n else np.zeros(0, bool)
        within = np.arange(n) - np.maximum.accumulate(np.where(first, np.arange(n), 0))
        starts = np.flatnonzero(within % self.m == 0)  # a group every m examples of a condition
        sizes = np.diff(np.r_[starts, n])
        groups = rng.permutation(len(starts))
        per_step = self.k * self.world_size
        steps, rest = [], []
        for size in np.unique(sizes):
            same = groups[sizes[groups] == size]
            whole = len(same) - len(same) % per_step
            steps += list(same[:whole].reshape(-1, per_step))
            rest.append(same[whole:])
        rest = np.concatenate(rest) if rest else np.zeros(0, np.int64)
        rest = rest[rng.permutation(len(rest))]
        steps += list(rest[: len(rest) - len(rest) % per_step].reshape(-1, per_step))
        return shuffled, starts, sizes, [steps[i] for i in rng.permutation(len(steps))]

    def __iter__(self) -> Iterator[list[int]]:
        shuffled, starts, sizes, steps = self._steps()
        for step in steps:
            mine = step[self.rank * self.k : (self.rank + 1) * self.k]
            yield np.concatenate(
                [shuffled[starts[g] : starts[g] + sizes[g]] for g in mine]
            ).tolist()

    def __len__(self) -> int:
        sizes = np.bincount(np.unique(self.cond, return_inverse=True)[1].reshape(-1))
        n_groups = int(np.sum(-(-sizes // self.m)))
        return n_groups // (self.k * self.world_size)


class EpochLoader:
    """A DataLoader over whole batches, with `set_epoch` reaching both sampler and pairing."""

    def __init__(
        self, dataset: ExampleSet, batch_sampler, num_workers: int = 0, pin_memory: bool = False
    ):
        self.dataset = dataset
        self.batch_sampler = batch_sampler
        self.epoch = 0
        sampler, extra = batch_sampler, {}
        if num_workers > 0:
            # Workers persist across epochs and prefetch; they fork, so a memory-mapped or
            # in-memory matrix is shared with them, not copied. Their copy of the dataset keeps
            # the epoch it was forked with, so each request carries the current epoch.
            sampler = _EpochTaggedSampler(batch_sampler, self)
            extra = {"persistent_workers": True, "prefetch_factor": 4}
        self.loader = DataLoader(
            dataset,
            sampler=sampler,
            batch_size=None,
            num_workers=num_workers,
            pin_memory=pin_memory,
            **extra,
        )

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.dataset.set_epoch(epoch)
        inner = getattr(self.batch_sampler, "sampler", self.batch_sampler)
        for s in {id(inner): inner, id(self.batch_sampler): self.batch_sampler}.values():
            if hasattr(s, "set_epoch"):
                s.set_epoch(epoch)

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.batch_sampler)


def train_loader(
    dataset: ExampleSet,
    batch_size: int,
    *,
    seed: int,
    world_size: int = 1,
    rank: int = 0,
    batching: str = "random",
    cells_per_group: int = 4,
    drop_last: bool = True,
    num_workers: int = 0,
    pin_memory: bool = False,
    block_size: int = 1024,
) -> EpochLoader:
    """Shuffled training batches of `batch_size` per rank: `random` (DistributedSampler),
    `grouped` (perturbations x cells) or `block` (block-shuffled reads, BlockShuffleSampler)."""
    if batching == "grouped":
        if batch_size % cells_per_group:
            raise GearsInputError(
                f"train.batching=grouped needs train.batch_size ({batch_size}) to be a multiple "
                f"of train.cells_per_group ({cells_per_group})"
            )
        sampler = GroupedBatchSampler(
            dataset.cond, cells_per_group, batch_size // cells_per_group, seed, world_size, rank
        )
    elif batching == "block":
        sampler = BatchSampler(
            BlockShuffleSampler(len(dataset), block_size, seed, world_size, rank),
            batch_size,
            drop_last=drop_last,
        )
    else:
        # drop_last: no padding duplicates, so N ranks take exactly the steps of one process
        # with batch N * b, and their step-k batches together are its step-k batch.
        inner = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        sampler = BatchSampler(inner, batch_size, drop_last=drop_last)
    return EpochLoader(dataset, sampler, num_workers, pin_memory)


def eval_loader(
    dataset: ExampleSet,
    batch_size: int,
    *,
    world_size: int = 1,
    rank: int = 0,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> EpochLoader:
    """In-order evaluation batches over this rank's contiguous shard (no padding duplicates)."""
    sampler = BatchSampler(
        ShardSampler(len(dataset), world_size, rank), batch_size, drop_last=False
    )
    return EpochLoader(dataset, sampler, num_workers, pin_memory)
