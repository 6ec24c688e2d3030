"""The network's input (ModelBatch), what a network declares it reads, and the one place where a
predicted change meets its control cell.

A network is called `net(batch: ModelBatch)` and returns the predicted change of each row's
cells from their control cell, `[R, G]` (or `(change, logvar)` with the uncertainty head). It
declares what its output depends on with two class attributes:

    reads_x: bool = False            # the control cell x (then one row per cell)
    covariates: tuple[str, ...] = ()  # named per-cell codes, e.g. ("context",)

and receives exactly that: `x` is None unless it reads x, and `covariates` holds the declared
names only. Whatever it does not read, the engine, the evaluator and predict deduplicate over:
GEARS reads neither, so it computes each distinct perturbation once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


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
    """

    pert_index: torch.Tensor
    counts: torch.Tensor | float = 1.0
    x: torch.Tensor | None = None
    covariates: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.pert_index.shape[0]


def reads_x(net: torch.nn.Module) -> bool:
    """Whether the network's output depends on the control cell x (its class says so)."""
    return bool(getattr(net, "reads_x", False))


def declared_covariates(net: torch.nn.Module) -> tuple[str, ...]:
    """The covariate names the network reads (its class's `covariates`), in declared order."""
    return tuple(getattr(net, "covariates", ()) or ())


def split_output(out) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A network's output as (change [R, G], logvar [R, G] or None)."""
    return out if isinstance(out, tuple) else (out, None)


def predicted_expression(change, x):
    """A cell's predicted expression: its control cell x plus the predicted change. The one
    place where the two meet (the engine's loss, evaluation, predict, GI_predict): a change in
    float32 or bf16 is added in float32 to a tensor x; numpy arrays add in their own dtype
    (evaluation: float64 changes + float64 control means)."""
    if isinstance(change, np.ndarray):
        return change + x
    return change.float() + x
