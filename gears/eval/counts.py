"""Integer counts from log-normalised expression: the training normalisation inverted, then a
seeded sampler (the Virtual Cell Challenge 2026 scores raw counts).

Training normalises raw counts y of a cell with library size L (its total) as
x = log1p(y * T / L), T = data.normalize's target sum (the median total). Inverting it gives
the cell's expected counts, its *rate*: rate = expm1(x) * L / T; a real cell's rate is its own
counts again (`raw_counts`). normalize_total keeps only a cell's composition, so a predicted
cell (a real control cell plus GEARS's predicted change in log space, gears.eval.predicted_cells) is
inverted as a composition, expm1(x) / sum(expm1(x)), times a library size
(`composition_rates`): that control cell's, or, with `--counts`, that scaled to the requested
median UMI per cell; its expected total is then exactly that depth.

Samplers (`SAMPLERS`, in gears/choices.py), all seeded, all with E[counts] = the rate they are
given:
  poisson      counts ~ Poisson(rate): the rate's counts plus Poisson noise.
  multinomial  counts ~ Multinomial(round(sum of rate), rate / sum): Poisson given its total,
               so each cell's total is its rate's (to within rounding).
  nb           counts ~ NB(mean, dispersion): a gamma-Poisson draw around the perturbation's
               mean rate per library unit times the cell's library size, with per-gene
               dispersions estimated from the control cells (`control_dispersion`); the
               cell-to-cell spread comes from the NB, not from the control cell.
  rounding     stochastic rounding, floor(rate) + Bernoulli(rate - floor(rate)): the least
               noise an integer draw can add; a zero change gives the control cell back.
Every cell is then held to at most MAX_COUNTS_PER_CELL counts (the challenge's rule) by an
exact hypergeometric downsampling of the few cells above it (`cap_counts`).
"""

from __future__ import annotations

import numpy as np

from gears.choices import SAMPLERS
from gears.errors import GearsInputError

MAX_COUNTS_PER_CELL = 1_000_000  # cell-eval2's vcc2026 max_counts_per_cell
ROWS_PER_DRAW = 256  # cells per random stream: draws do not depend on how output is chunked
NB_MEAN_CELLS = 256  # control cells averaged for a perturbation's mean rate (sampler nb)
THETA_RANGE = (1e-2, 1e6)  # NB dispersion bounds; 1e6 is Poisson in practice


def check_sampler(name: str) -> str:
    if name not in SAMPLERS:
        raise GearsInputError(f"counts sampler must be one of {SAMPLERS}, got {name!r}")
    return name


def rates(x: np.ndarray, library_size: np.ndarray, target_sum: float) -> np.ndarray:
    """Expected counts of log-normalised cells: expm1(x) * L / T.

    x [cells, genes] (>= 0), library_size [cells] -> rate [cells, genes] float64."""
    x = np.asarray(x, dtype=np.float64)
    scale = np.asarray(library_size, dtype=np.float64) / float(target_sum)
    return np.expm1(x) * scale[:, None]


def composition_rates(x: np.ndarray, library_size: np.ndarray) -> np.ndarray:
    """Expected counts of log-normalised cells drawn at a chosen depth: each cell's normalised
    expression expm1(x) as a composition, times its library size L. normalize_total keeps only
    a cell's composition, so this is its inverse at any depth; for a real cell at its own depth
    it equals `rates` (its counts). A predicted cell (a control cell plus a change in log space)
    need not sum to the target any more: its composition is kept and its total is L exactly.

    x [cells, genes] (>= 0), library_size [cells] -> rate [cells, genes] float64."""
    z = np.expm1(np.asarray(x, dtype=np.float64))
    total = z.sum(axis=1, keepdims=True)
    scale = np.asarray(library_size, dtype=np.float64)[:, None] / np.where(total > 0, total, 1.0)
    return z * scale


def raw_counts(x: np.ndarray, library_size: np.ndarray, target_sum: float) -> np.ndarray:
    """The raw counts processed cells came from, float32 [cells, genes]: their rates rounded.
    Exact for counts below ~1e6: float32 log1p keeps the rate within 1e-2 of the integer."""
    return np.rint(rates(x, library_size, target_sum)).astype(np.float32)


def control_dispersion(counts: np.ndarray, library_size: np.ndarray) -> np.ndarray:
    """Per-gene NB dispersion theta (variance = mu + mu^2 / theta) of control cells, by the
    method of moments on library-size-scaled counts; genes with no excess variance (or no
    counts) get the Poisson end of THETA_RANGE. counts [cells, genes] -> theta [genes]."""
    counts = np.asarray(counts, dtype=np.float64)
    size = np.asarray(library_size, dtype=np.float64)
    size = size / size.mean()
    scaled = counts / size[:, None]
    mean = scaled.mean(axis=0)
    var = scaled.var(axis=0, ddof=1) if len(counts) > 1 else np.zeros_like(mean)
    poisson_var = mean * np.mean(1.0 / size)  # what Poisson noise alone gives the scaled counts
    excess = var - poisson_var
    with np.errstate(divide="ignore", invalid="ignore"):
        theta = np.where(excess > 0, mean**2 / excess, THETA_RANGE[1])
    return np.clip(np.nan_to_num(theta, nan=THETA_RANGE[1]), *THETA_RANGE)


def draw_counts(
    rate: np.ndarray,
    rng: np.random.Generator,
    sampler: str,
    theta: np.ndarray | None = None,
) -> np.ndarray:
    """Integer counts with expectation `rate` [cells, genes] (float64 >= 0) -> float32 counts.
    theta [genes]: the NB dispersion (sampler nb)."""
    check_sampler(sampler)
    rate = np.asarray(rate, dtype=np.float64)
    if rate.size and not (np.isfinite(rate).all() and rate.min() >= 0):
        raise GearsInputError("counts rates must be finite and >= 0 (a predicted cell overflowed)")
    if sampler == "poisson":
        out = rng.poisson(rate)
    elif sampler == "rounding":
        floor = np.floor(rate)
        out = floor + (rng.random(rate.shape) < rate - floor)
    elif sampler == "multinomial":
        totals = np.rint(rate.sum(axis=1)).astype(np.int64)
        with np.errstate(divide="ignore", invalid="ignore"):
            p = rate / rate.sum(axis=1, keepdims=True)
        p = np.nan_to_num(p)
        out = np.zeros(rate.shape, dtype=np.int64)
        live = totals > 0
        if live.any():
            out[live] = rng.multinomial(totals[live], p[live])
    else:  # nb: gamma-Poisson mixture, mean rate, variance rate + rate^2 / theta
        if theta is None:
            raise GearsInputError("sampler nb needs the control cells' gene dispersions")
        theta = np.asarray(theta, dtype=np.float64)[None, :]
        out = rng.poisson(rng.gamma(theta, rate / theta))
    return np.asarray(out, dtype=np.float32)


def cap_counts(
    counts: np.ndarray, rng: np.random.Generator, max_total: int = MAX_COUNTS_PER_CELL
) -> np.ndarray:
    """Cells above max_total counts downsampled to exactly max_total (hypergeometric: each
    count kept with equal chance), in place; the others untouched. counts [cells, genes]."""
    totals = counts.sum(axis=1, dtype=np.float64)
    for row in np.flatnonzero(totals > max_total):
        colors = counts[row].astype(np.int64)
        counts[row] = rng.multivariate_hypergeometric(colors, max_total, method="marginals")
    return counts


def block_rng(seed: int, block: int) -> np.random.Generator:
    """The random stream of cells [block * ROWS_PER_DRAW, (block + 1) * ROWS_PER_DRAW)."""
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(block)]))


def sample_rows(
    rate: np.ndarray,
    first_row: int,
    seed: int,
    sampler: str,
    theta: np.ndarray | None = None,
) -> np.ndarray:
    """Counts of cells first_row .. first_row + len(rate), drawn block by block from
    `block_rng`, so a cell's counts are the same whichever chunk computes it. first_row must be
    a multiple of ROWS_PER_DRAW. rate [cells, genes] -> counts float32 [cells, genes]."""
    if first_row % ROWS_PER_DRAW:
        raise ValueError(f"first_row {first_row} is not a multiple of {ROWS_PER_DRAW}")
    out = np.empty(rate.shape, dtype=np.float32)
    for start in range(0, len(rate), ROWS_PER_DRAW):
        rng = block_rng(seed, (first_row + start) // ROWS_PER_DRAW)
        part = slice(start, start + ROWS_PER_DRAW)
        out[part] = cap_counts(draw_counts(rate[part], rng, sampler, theta), rng)
    return out
