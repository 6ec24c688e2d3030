"""The network's input (ModelBatch), what a network declares it reads, and the one place where a
predicted change meets its control cell.

A network is called `net(batch: ModelBatch)` and returns the predicted change of each row's
cells from their control cell, `[R, G]` (or `(change, logvar)` with the uncertainty head). It
declares what its output depends on (reads_x, covariates: gears/model/contract.py lists every
declaration and its default) and receives exactly that: `x` is None unless it reads x, and
`covariates` holds the declared names only. Whatever it does not read, the engine, the
evaluator and predict deduplicate over: GEARS reads neither, so it computes each distinct
perturbation once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from gears.errors import GearsInputError
from gears.model.contract import declared_covariates, reads_x  # noqa: F401 (their old home)


@dataclass
class ModelBatch:
    """One forward's rows. R rows, G genes, P perturbation slots.

    pert_index [R, P] long: each row's perturbations (indices into the perturbation vocabulary,
        -1 padded; a row of -1 is a control).
    counts [R] float, or one float for every row: the cells each row stands for (batch-norm
        weighs rows by them, so R distinct rows behave as the batch of all their cells).
    x [R, G] float or None: each row's control cell; given only to a network that reads x, and
        then one row per cell (counts 1).
    covariates: name -> [R] long codes (of the categories recorded with the model), the
        declared names only.
    n_cells: the sum of counts [R] as a Python number, when the caller knows it on the host
        (the engine does for weighted rows), or None: a network may use it instead of summing
        counts on the device (GEARSNet's batch-norms then count the cells in no device op).
    """

    pert_index: torch.Tensor
    counts: torch.Tensor | float = 1.0
    x: torch.Tensor | None = None
    covariates: dict[str, torch.Tensor] = field(default_factory=dict)
    n_cells: float | None = None

    def __len__(self) -> int:
        return self.pert_index.shape[0]


def split_output(out) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A network's output as (change [R, G], logvar [R, G] or None)."""
    return out if isinstance(out, tuple) else (out, None)


def check_output(out, net, n_rows: int, n_genes: int) -> None:
    """A GearsInputError naming the network's class and what is wrong when its output breaks
    the contract: a floating-point tensor [rows, genes] (or a tuple of two: change and
    log-variance). Reads shapes and dtypes only (no host sync)."""
    name = type(net).__name__
    fix = (
        f"{name}.forward must return a floating-point torch.Tensor [rows, genes] = "
        f"[{n_rows}, {n_genes}] (or a tuple (change, logvar) of two such tensors)"
    )
    parts = out if isinstance(out, tuple) else (out,)
    if isinstance(out, tuple) and len(out) != 2:
        raise GearsInputError(f"{name} returned a tuple of {len(out)}; {fix}")
    for what, part in zip(("output", "log-variance"), parts):
        if not isinstance(part, torch.Tensor):
            raise GearsInputError(f"{name} returned a {type(part).__name__} as its {what}; {fix}")
        if not part.is_floating_point():
            raise GearsInputError(f"{name} returned dtype {part.dtype} as its {what}; {fix}")
        if tuple(part.shape) != (n_rows, n_genes):
            raise GearsInputError(f"{name} returned shape {list(part.shape)} as its {what}; {fix}")


def predicted_expression(change, x):
    """A cell's predicted expression: its control cell x plus the predicted change. The one
    place where the two meet (the engine's loss, evaluation, predict, GI_predict): a change in
    float32 or bf16 is added in float32 to a tensor x; numpy arrays add in their own dtype
    (evaluation: float64 changes + float64 control means)."""
    if isinstance(change, np.ndarray):
        return change + x
    return change.float() + x
