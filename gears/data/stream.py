"""Out-of-core processing: one pass over a backed .h5ad in row chunks -> per-condition statistics.

The pass validates each chunk (NaN/inf/negative), accumulates per-condition sums and sums of
squares (all that the means, the dropout sets and scanpy <= 1.11's t-test need; RunningMoments
for scanpy >= 1.12's) and hands the kept rows
to a sink (the store writer). Memory is O(chunk + conditions x genes), never the whole matrix.
Raw counts are told apart (CountsProbe) or normalised per chunk (count_totals, then
normalize_log1p) exactly as the in-memory path does on the whole matrix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from gears.errors import GearsInputError


def not_counts_error() -> GearsInputError:
    """data.normalize=log1p on values that are not all integers."""
    return GearsInputError(
        "data.normalize=log1p expects raw counts in adata.X, but it holds non-integer "
        "values (already normalised?); set data.normalize=none for log-normalised data"
    )


@dataclass
class ConditionStats:
    """Sufficient statistics per condition. C conditions, G genes."""

    counts: np.ndarray  # [C] int64 cells per condition
    sums: np.ndarray  # [C, G] float64 sum of x
    sumsq: np.ndarray  # [C, G] float64 sum of float32 x*x (as scanpy's mean/variance kernels)
    max_value: float  # largest expression value seen (raw-count warning)
    moments: RunningMoments | None = None  # scanpy >= 1.12's mean and variance (de.py)

    @property
    def means(self) -> np.ndarray:
        """[C, G] float64."""
        return self.sums / np.maximum(self.counts, 1)[:, None]


class RunningMoments:
    """Per-condition mean and variance by Welford's running update, cell after cell in row
    order, with scanpy.get.aggregate's arithmetic (scanpy >= 1.12 takes its t-test's means
    and variances from it): dense rows update with every value; sparse rows with their stored
    values only, the implicit zeros merged in at the end. Each (condition, gene) is a sequence
    of its own, so the r-th update of every one is done at once: one numpy step per rank.
    C conditions, G genes."""

    def __init__(self, n_conditions: int, n_genes: int):
        self.mean = np.zeros((n_conditions, n_genes))
        self.m2 = np.zeros((n_conditions, n_genes))
        self.n = np.zeros((n_conditions, n_genes), np.int64)  # values merged so far
        self.sparse: bool | None = None

    def add(self, codes: np.ndarray, block) -> None:
        """Rows of block [rows, G] (CSR or dense), each of condition codes[row], in order."""
        sparse = sp.issparse(block)
        if self.sparse is None:
            self.sparse = sparse
        elif self.sparse != sparse:
            raise ValueError("RunningMoments takes sparse or dense rows, not both")
        # Row r-th of its condition in the block: step r updates each condition once, so the
        # rows of one step touch distinct (condition, gene) sequences, each in row order.
        order = np.argsort(codes, kind="stable")
        firsts = np.flatnonzero(np.r_[True, codes[order][1:] != codes[order][:-1]])
        rank = np.empty(len(codes), np.int64)
        rank[order] = np.arange(len(codes)) - np.repeat(firsts, np.diff(np.r_[firsts, len(codes)]))
        steps = np.argsort(rank, kind="stable")
        bounds = np.searchsorted(rank[steps], np.arange(rank.max(initial=-1) + 2))
        if sparse:
            block = sp.csr_matrix(block)[steps]
            step_codes = codes[steps].astype(np.int64) * self.mean.shape[1]
            mean, m2, n = self.mean.reshape(-1), self.m2.reshape(-1), self.n.reshape(-1)
            for lo, hi in zip(bounds[:-1], bounds[1:]):
                start, stop = block.indptr[lo], block.indptr[hi]
                lengths = np.diff(block.indptr[lo : hi + 1])
                key = np.repeat(step_codes[lo:hi], lengths) + block.indices[start:stop]
                self._update(mean, m2, n, key, block.data[start:stop].astype(np.float64))
        else:
            block = np.asarray(block)
            for lo, hi in zip(bounds[:-1], bounds[1:]):
                rows = steps[lo:hi]
                value = block[rows].astype(np.float64)
                self._update(self.mean, self.m2, self.n, codes[rows], value)

    @staticmethod
    def _update(mean, m2, n, key, value) -> None:
        """One Welford step of the sequences `key` (distinct), as scanpy's kernels write it."""
        count = n[key] + 1
        n[key] = count
        delta = value - mean[key]
        updated = mean[key] + delta / count
        mean[key] = updated
        m2[key] += delta * (value - updated)

    def mean_var(self, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """([C, G] means, [C, G] variances with n - 1 in the denominator; NaN for 1 cell).

        counts [C]: cells per condition."""
        counts = np.asarray(counts, np.int64)[:, None]
        mean, m2 = self.mean.copy(), self.m2.copy()
        if self.sparse:  # merge each accumulator with its implicit zeros
            zeros = counts - self.n
            merge = (zeros > 0) & (self.n > 0)
            mean_a = self.mean
            mean = np.where(merge, mean_a * self.n / counts, mean)
            m2 = np.where(merge, m2 + mean_a * mean_a * self.n * zeros / counts, m2)
        with np.errstate(invalid="ignore", divide="ignore"):
            var = np.where(counts > 0, m2 / counts, 0.0)
            denom = np.where(counts > 1, counts - 1, np.nan)
            var *= counts / denom
        return mean, var


def iter_row_chunks(X, n_rows: int, chunk_cells: int) -> Iterator[tuple[int, object]]:
    """(first row, block) for consecutive row blocks of a backed or in-memory matrix.

    Blocks are scipy CSR (sparse inputs) or dense float32 numpy arrays.
    """
    if chunk_cells < 1:
        raise GearsInputError(f"data.chunk_cells must be >= 1, got {chunk_cells}")
    for start in range(0, n_rows, chunk_cells):
        block = X[start : min(start + chunk_cells, n_rows)]
        if sp.issparse(block):
            block = sp.csr_matrix(block, dtype=np.float32)
        else:
            block = np.asarray(block, dtype=np.float32)
        yield start, block


def check_block(block, start: int) -> None:
    """GearsInputError naming the rows when a block has NaN, infinite or negative values."""
    values = block.data if sp.issparse(block) else block
    stop = start + block.shape[0]
    n_bad = int(values.size - np.count_nonzero(np.isfinite(values)))
    if n_bad:
        raise GearsInputError(
            f"adata.X has {n_bad} NaN or infinite expression values in cells {start}-{stop - 1}; "
            "remove or repair them before processing"
        )
    if values.size and values.min() < 0:
        raise GearsInputError(
            f"adata.X has negative values (min {values.min():.3g}, cells {start}-{stop - 1}); "
            "GEARS expects log-normalised counts (sc.pp.normalize_total then sc.pp.log1p), "
            "not scaled or centred data"
        )


def _add_group_sums(out: np.ndarray, codes: np.ndarray, block, square: bool) -> None:
    """out[code] += rows of block (or of block*block in float32), summed in float64."""
    if sp.issparse(block):
        block = block.copy() if square else block
        if square:
            block.data = block.data * block.data  # float32 squares, as scanpy's kernels
        indicator = sp.csr_matrix(
            (np.ones(len(codes)), (codes, np.arange(len(codes)))), shape=(out.shape[0], len(codes))
        )
        summed = (indicator @ block.astype(np.float64)).tocoo()
        # A canonical product has one entry per (condition, gene): plain fancy += is exact.
        out[summed.row, summed.col] += summed.data
        return
    values = block * block if square else block
    order = np.argsort(codes, kind="stable")
    uniq, starts = np.unique(codes[order], return_index=True)
    out[uniq] += np.add.reduceat(values[order].astype(np.float64), starts, axis=0)


def _values(block) -> np.ndarray:
    return block.data if sp.issparse(block) else block


def _rows(block, mask: np.ndarray):
    return block if mask.all() else block[np.flatnonzero(mask)]


@dataclass
class CountsProbe:
    """What the in-memory raw-counts check reads (gears.data.validate.check_not_raw_counts):
    the first `sample` stored values in row order, here gathered chunk by chunk."""

    sample: int = 10_000_000
    seen: int = 0
    integer: bool = True
    max_value: float = float("-inf")

    def add(self, block) -> None:
        head = np.asarray(_values(block)).reshape(-1)[: max(self.sample - self.seen, 0)]
        if head.size:
            self.seen += head.size
            self.max_value = max(self.max_value, float(head.max()))
            self.integer = self.integer and np.array_equal(head, np.round(head))

    def summary(self) -> np.ndarray:
        """Values with the same maximum and integer-ness as those seen (for the check)."""
        if not self.seen:
            return np.zeros(0, np.float32)
        return np.array([self.max_value] + ([] if self.integer else [0.5]))


def count_totals(X, n_rows: int, keep: np.ndarray, chunk_cells: int) -> np.ndarray:
    """data.normalize=log1p, first pass: validate every chunk, refuse non-integer values in the
    kept rows (with the in-memory message) and return their totals [kept cells] as the
    in-memory path sums them (float32 rows of the float32 matrix)."""

    totals = []
    for start, block in iter_row_chunks(X, n_rows, chunk_cells):
        check_block(block, start)
        block = _rows(block, keep[start : start + block.shape[0]])
        values = _values(block)
        if values.size and np.any(values != np.round(values)):
            raise not_counts_error()
        totals.append(np.asarray(block.sum(axis=1)).ravel())
    return np.concatenate(totals) if totals else np.zeros(0, np.float32)


def normalize_log1p(block, target_sum: float):
    """One chunk of kept rows scaled to `target_sum` counts per cell, then log1p: scanpy's
    normalize_total + log1p, row by row the values the in-memory path computes (which calls
    this on the whole matrix). A CSR block may be changed in place.

    CSR float counts are scaled here with scanpy's arithmetic, bit for bit (each cell's total,
    exact in float64 for integer counts, stored in the data's dtype, divided by target_sum; an
    empty cell divided by 1; then log1p), not by scanpy: scanpy >= 1.12 runs that step in a
    numba kernel whose on-disk cache never matches, so every process compiled it again
    (docs/performance.md). Callers have checked that the values are integers."""
    if isinstance(block, sp.csr_matrix | sp.csr_array) and block.dtype in (
        np.float32,
        np.float64,
    ):
        per_cell = np.diff(block.indptr)
        rows = np.repeat(np.arange(block.shape[0]), per_cell)
        totals = np.bincount(rows, weights=block.data, minlength=block.shape[0])
        scale = totals.astype(block.dtype) / target_sum
        scale = scale + (scale == 0)
        block.data = block.data / np.repeat(scale, per_cell)
        np.log1p(block.data, out=block.data)
        return block
    import anndata as ad
    import scanpy as sc

    work = ad.AnnData(X=block)
    sc.pp.normalize_total(work, target_sum=target_sum)
    sc.pp.log1p(work)
    return work.X


def stream_condition_stats(
    X,
    n_rows: int,
    codes: np.ndarray,
    n_conditions: int,
    n_genes: int,
    chunk_cells: int,
    sink: Callable[[object], None] | None = None,
    inspect: Callable[[int, object], None] | None = None,
    transform: Callable[[object], object] | None = None,
    moments: bool = False,
) -> ConditionStats:
    """One pass over the rows of X: validate, accumulate per-condition statistics, feed `sink`.

    codes [n_rows] int: each cell's condition, -1 for cells to drop (not summed, not sunk).
    sink receives each chunk's kept rows in order (e.g. StoreWriter.append_rows).
    inspect(first row, chunk) sees every validated chunk, dropped rows included (the raw-counts
    probe); transform maps the kept rows before anything is summed or sunk (normalisation).
    moments: also keep RunningMoments (what scanpy >= 1.12's t-test computes; de.py).
    """
    running = RunningMoments(n_conditions, n_genes) if moments else None
    sums = np.zeros((n_conditions, n_genes))
    sumsq = np.zeros((n_conditions, n_genes))
    max_value = 0.0
    for start, block in iter_row_chunks(X, n_rows, chunk_cells):
        check_block(block, start)
        if inspect is not None:
            inspect(start, block)
        block_codes = codes[start : start + block.shape[0]]
        keep = block_codes >= 0
        if not keep.all():
            block, block_codes = block[np.flatnonzero(keep)], block_codes[keep]
        if block.shape[0] == 0:
            continue
        if transform is not None:
            block = transform(block)
        values = block.data if sp.issparse(block) else block
        if values.size:
            max_value = max(max_value, float(values.max()))
        _add_group_sums(sums, block_codes, block, square=False)
        _add_group_sums(sumsq, block_codes, block, square=True)
        if running is not None:
            running.add(block_codes, block)
        if sink is not None:
            sink(block)
    counts = np.bincount(codes[codes >= 0], minlength=n_conditions).astype(np.int64)
    return ConditionStats(counts, sums, sumsq, max_value, running)
