"""How a batch is laid out in rows for GEARSNet: one row per distinct perturbation (weighted by
its cells) or one per cell, and the row padding that gives torch.compile a few shapes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Deduplication (one row per distinct perturbation, batch-norm weighted by multiplicity) pays
# when it removes many rows; when it removes few, one row per cell takes the native batch-norm
# kernel with the same statistics and is faster (bf16 random batches: 110 -> 70 ms per step at
# 1,000 genes, benchmarks/README.md finding 4). The rule: one row per cell when the distinct
# rows exceed this fraction of the cells.
CELL_ROWS_ABOVE_FRACTION = 0.75


def use_cell_rows(n_distinct: int, n_cells: int) -> bool:
    """True when a batch of n_cells cells with n_distinct distinct perturbations (and unequal
    counts) is cheaper as one row per cell: n_distinct > 0.75 * n_cells."""
    return n_distinct > CELL_ROWS_ABOVE_FRACTION * n_cells


def row_bucket(n_rows: int, smallest: int = 8) -> int:
    """The padded row count for torch.compile: the next power of two >= max(n_rows, smallest),
    so batches with any number of distinct perturbations hit a few compiled shapes."""
    return max(smallest, 1 << (max(n_rows, 1) - 1).bit_length())


def pad_rows(pert_index: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pert_index [U, P], counts [U] -> [row_bucket(U), P], [row_bucket(U)]: padding rows are
    controls (-1) that stand for 0 cells, so they weigh 0 in every batch-norm and change no
    statistic; the caller slices the output back to its first U rows."""
    n_rows = pert_index.shape[0]
    extra = row_bucket(n_rows) - n_rows
    if extra == 0:
        return pert_index, counts
    return F.pad(pert_index, (0, 0, 0, extra), value=-1), F.pad(counts, (0, extra), value=0.0)
