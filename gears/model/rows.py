"""How a training batch becomes the network's rows: the layout rule (`row_layout`) and the one
function that lays a batch out (`batch_rows`: the rows, and the map back to cells).

A batch's distinct groups (a perturbation, with the values of the covariates the network reads)
are computed once, each row weighted by its cells, unless the network reads the control cell x
(or asks for per-cell rows): then one row per cell. Four layouts, a small tagged type
(`Layout`), give the same cell outputs: `EqualRows` (one count for every row), `RepeatRows`,
`CELL_ROWS` and `WEIGHTED_ROWS`; under torch.compile rows are padded to a few sizes
(`pad_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from gears.errors import GearsInputError
from gears.model.batch import ModelBatch, split_output
from gears.model.kernels import gather_rows

# Deduplication (one row per distinct perturbation, batch-norm weighted by multiplicity) pays
# when it removes many rows; when it removes few, one row per cell takes the native batch-norm
# kernel with the same statistics and is faster (bf16 random batches at 1,000 genes, measured in
# benchmarks/README.md, finding 4). The rule: one row per cell when the distinct
# rows exceed this fraction of the cells.
CELL_ROWS_ABOVE_FRACTION = 0.75


@dataclass(frozen=True)
class WeightedRows:
    """Layout: the distinct rows, each weighted by its cells (batch.counts)."""

    kind: ClassVar[str] = "weighted"  # (the short name benchmarks and tests print)


@dataclass(frozen=True)
class EqualRows:
    """Layout: the distinct rows, every one standing for `count` cells (native batch-norm)."""

    kind: ClassVar[str] = "uniform"
    count: float


@dataclass(frozen=True, eq=False)
class RepeatRows:
    """Layout: distinct row u repeated repeats[u] times, every row standing for `count` cells
    (counts [8, 4, 4] -> 4 rows of 4 cells): uniform rows take the native batch-norm kernel.
    Exact: copies of a row have equal outputs, each cell reads its first copy, and the gradient
    summed over the copies is the per-cell batch's."""

    kind: ClassVar[str] = "repeat"
    count: float
    repeats: torch.Tensor  # [U] long, host
    rows: int  # sum(repeats), read on the host by row_layout (the step then reads nothing)


@dataclass(frozen=True)
class CellRows:
    """Layout: one row per cell (instead of one per distinct group), each standing for 1."""

    kind: ClassVar[str] = "cells"


WEIGHTED_ROWS, CELL_ROWS = WeightedRows(), CellRows()
Layout = WeightedRows | EqualRows | RepeatRows | CellRows


def as_layout(layout) -> Layout:
    """A Layout, also from the spellings the engine once used: None (weighted rows), a number
    (one count for every row) and "cells" (one row per cell)."""
    if layout is None:
        return WEIGHTED_ROWS
    if isinstance(layout, Layout):
        return layout
    if layout == "cells":
        return CELL_ROWS
    if isinstance(layout, int | float):
        return EqualRows(float(layout))
    raise TypeError(f"not a row layout: {layout!r}")


@dataclass
class Rows:
    """A batch laid out for the network: its input, and where each cell's output is.

    inputs: the ModelBatch the network is called with.
    to_cells [B] long: the row holding each cell's output; None when row i is cell i.
    n_rows: the real rows when inputs were padded for torch.compile (the rest weigh 0);
        None when not padded.
    """

    inputs: ModelBatch
    to_cells: torch.Tensor | None
    n_rows: int | None = None


def use_cell_rows(n_distinct: int, n_cells: int) -> bool:
    """True when a batch of n_cells cells with n_distinct distinct perturbations (and unequal
    counts) is cheaper as one row per cell: n_distinct > 0.75 * n_cells."""
    return n_distinct > CELL_ROWS_ABOVE_FRACTION * n_cells


def row_layout(counts: torch.Tensor, per_cell: bool = False, compiled: bool = False) -> Layout:
    """The layout of a batch whose distinct groups have these host counts [U].

    per_cell (a network that reads x or asks for per-cell rows): CELL_ROWS. Else EqualRows of
    the common count when all are equal (native batch-norm); unless compiled (padded distinct
    rows keep the compiled shapes few): RepeatRows when the counts share a divisor g > 1 that
    makes at most one more row (grouped batches: [8, 4, 4, ...] -> uniform rows of 4; the
    weighted path costs more than one row), CELL_ROWS when deduplication removes few rows;
    else WEIGHTED_ROWS."""
    if per_cell:
        return CELL_ROWS
    if bool((counts == counts[0]).all()):
        return EqualRows(float(counts[0]))
    if compiled:
        return WEIGHTED_ROWS
    whole = counts.long()
    g = int(np.gcd.reduce(whole.numpy())) if bool((whole == counts).all()) else 1
    if g > 1 and int(whole.sum()) // g <= counts.shape[0] + 1:
        return RepeatRows(float(g), whole // g, int(whole.sum()) // g)
    if use_cell_rows(counts.shape[0], int(counts.sum())):
        return CELL_ROWS
    return WEIGHTED_ROWS


def batch_rows(
    batch,
    layout: Layout = WEIGHTED_ROWS,
    covariates: tuple[str, ...] = (),
    reads_x: bool = False,
    pad: bool = False,
) -> Rows:
    """Lay a training batch (gears.data.loaders.Batch) out as the network's rows.

    layout: from row_layout (a network that reads x must take CELL_ROWS; as_layout's older
    spellings are accepted). covariates: the names the network reads (only these reach it).
    reads_x: give it the control cells. pad: pad the rows to row_bucket's sizes for
    torch.compile."""
    layout = as_layout(layout)
    rows, to_cells = batch.uniq_pert_index, batch.inverse
    codes = _declared_codes(batch, covariates)
    if reads_x and not isinstance(layout, CellRows):
        raise ValueError("a network that reads x takes one row per cell (layout CELL_ROWS)")
    if isinstance(layout, WeightedRows):
        counts = batch.counts
    elif isinstance(layout, RepeatRows):
        repeats = layout.repeats.to(rows.device, non_blocking=True)
        n_rows = layout.rows
        rows = rows.repeat_interleave(repeats, dim=0, output_size=n_rows)
        codes = {k: c.repeat_interleave(repeats, 0, output_size=n_rows) for k, c in codes.items()}
        counts = layout.count
        to_cells = (torch.cumsum(repeats, 0) - repeats)[batch.inverse]  # first copies
    elif isinstance(layout, CellRows):
        rows, counts, to_cells = rows[batch.inverse], 1.0, None
        codes = {k: c[batch.inverse] for k, c in codes.items()}
    else:  # EqualRows
        counts = layout.count
    # Weighted rows: the cell count is known on the host (len(batch) = sum(counts)), which
    # spares the batch-norms a device sum and their running update ~10 device ops (unpadded
    # only: a compiled graph would specialise on the number).
    n_cells = float(len(batch)) if isinstance(layout, WeightedRows) and not pad else None
    inputs = ModelBatch(rows, counts, batch.x if reads_x else None, codes, n_cells)
    if not pad:
        return Rows(inputs, to_cells)
    n_rows = rows.shape[0]
    if not torch.is_tensor(counts):
        counts = torch.full((n_rows,), float(counts), device=rows.device)
    return Rows(pad_rows(ModelBatch(rows, counts, inputs.x, codes)), to_cells, n_rows)


def _declared_codes(batch, covariates: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The batch's per-group codes [U] of the declared covariates, by name."""
    have = getattr(batch, "uniq_covariates", None) or {}
    missing = [name for name in covariates if name not in have]
    if missing:
        raise GearsInputError(
            f"the network reads covariates {missing}, which this batch does not carry (it has "
            f"{sorted(have)}); build the loaders with them (GEARS.train does: the loaders get "
            "the network's declared covariates)"
        )
    return {name: have[name] for name in covariates}


def cell_outputs(out, rows: Rows) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The network's output on `rows` as each cell's (change [B, G], logvar [B, G] or None):
    padding dropped, rows broadcast back to their cells."""
    change, logvar = split_output(out)
    if rows.n_rows is not None:
        change = change[: rows.n_rows]
        logvar = None if logvar is None else logvar[: rows.n_rows]
    if rows.to_cells is not None:
        change = gather_rows(change, rows.to_cells)  # (a fixed-order gradient sum)
        logvar = None if logvar is None else gather_rows(logvar, rows.to_cells)
    return change, logvar


def row_bucket(n_rows: int, smallest: int = 8) -> int:
    """The padded row count for torch.compile: the next power of two >= max(n_rows, smallest),
    so batches with any number of distinct perturbations hit a few compiled shapes."""
    return max(smallest, 1 << (max(n_rows, 1) - 1).bit_length())


def pad_rows(inputs: ModelBatch) -> ModelBatch:
    """inputs with R rows (counts a tensor [R]) -> row_bucket(R) rows: padding rows are
    controls (-1) that stand for 0 cells, so they weigh 0 in every batch-norm and change no
    statistic (their covariate codes are 0, their x zeros); callers keep the first R rows of
    the output."""
    n_rows = inputs.pert_index.shape[0]
    extra = row_bucket(n_rows) - n_rows
    if extra == 0:
        return inputs
    return ModelBatch(
        F.pad(inputs.pert_index, (0, 0, 0, extra), value=-1),
        F.pad(inputs.counts, (0, extra), value=0.0),
        None if inputs.x is None else F.pad(inputs.x, (0, 0, 0, extra)),
        {k: F.pad(c, (0, extra), value=0) for k, c in inputs.covariates.items()},
    )
