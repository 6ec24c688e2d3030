"""data.normalize: raw counts -> log1p of counts scaled to one total per cell (in memory; the
out-of-core path applies the same arithmetic chunk by chunk, gears.data.stream)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from gears.choices import CHOICES
from gears.data.stream import normalize_log1p, not_counts_error
from gears.data.validate import finite_values
from gears.errors import GearsInputError


@dataclass
class Normalised:
    """The expression to process and how it was normalised (both None with normalize=none)."""

    X: object  # [cells, genes] float32, dense or CSR
    target_sum: float | None = None  # each cell's total after scaling
    library_size: np.ndarray | None = None  # [cells] float64 raw totals


def check_normalize(method: str) -> None:
    if method not in CHOICES["data.normalize"]:
        raise GearsInputError(
            f"normalize must be one of {CHOICES['data.normalize']}, got {method!r}"
        )


def median_total(totals: np.ndarray) -> float:
    """data.normalize=log1p's target: the median total of the cells with any counts."""
    totals = np.asarray(totals)
    return float(np.median(totals[totals > 0])) if (totals > 0).any() else 1.0


def normalise(
    X,
    method: str,
    copy: bool,
    target_sum: float | None,
    log: Callable[[str], None],
) -> Normalised:
    """normalize='log1p': raw counts -> log1p(counts scaled to the median cell total, or to
    target_sum); the totals are kept as library_size. copy=False may normalise X in place."""
    check_normalize(method)
    if method == "none":
        return Normalised(X)
    values = finite_values(X)
    if np.size(values) and np.any(values != np.round(values)):
        raise not_counts_error()
    totals = np.asarray(X.sum(axis=1)).ravel()
    target = median_total(totals) if target_sum is None else float(target_sum)
    scaled = normalize_log1p(X.copy() if copy else X, target)
    log(
        f"normalised raw counts: each cell scaled to {target:.0f} counts "
        f"({'the median' if target_sum is None else 'as the whole data'}), then log1p"
    )
    return Normalised(scaled, target, totals.astype(np.float64))
