"""GEARS evaluation metrics on per-condition mean profiles (vectorised over conditions) and GI fits.

The definitions and key names follow snap-stanford/GEARS `gears/inference.py` (`compute_metrics`,
`deeper_analysis`, `non_dropout_analysis`) and `gears/utils.py` (`get_coeffs`, `get_GI_params`).
GEARS loops over perturbations in Python; here every metric is one array expression over
conditions: row-wise Pearson on `[conditions, k]` gathers, masked by `-1` padding.

Deliberate differences from GEARS (all where GEARS would crash or is undefined):
- A metric that GEARS leaves out for a perturbation (no gene passes its filter) is NaN here, so
  `summarize`'s nan-mean equals GEARS's mean over the perturbations that have the key.
- Pearson over fewer than 2 genes is NaN (scipy raises); a constant input gives 0 as in GEARS.
- Gene lists shorter than asked for (`-1` padding, or fewer than 200 genes) use the genes that
  are there: `frac_correct_direction_200` divides by the number of valid genes, not by 200.
- "std > 0" in the sigma metrics is tested as max > min over the cells, which is the exact
  condition (a float std of identical values can come out as 1e-17).
- A condition with no truth cells, or whose predicted row is not finite, is NaN everywhere.
- GEARS's gene-set direction metrics `frac_*_direction_non_zero` / `_non_dropout` need the
  per-perturbation non-zero gene sets, which this API does not take; they are not computed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import scipy.sparse as sp
from scipy.spatial.distance import cdist

from gears.errors import GearsInputError

DE_SIZES = (20, 50, 100, 200)
QUANTILE_RANGES = {"45_55": (0.45, 0.55), "40_60": (0.40, 0.60), "25_75": (0.25, 0.75)}
# Fold-change bins of deeper_analysis: name -> (exclusive lower, exclusive upper) bound.
FOLD_CHANGE_BINS = {
    "all": (0.0, np.inf),
    "downreg_0.33": (0.0, 0.333),
    "downreg_0.1": (0.0, 0.1),
    "upreg_3": (3.0, np.inf),
    "upreg_10": (10.0, np.inf),
}
# GEARS ignores genes whose mean in the perturbation is below this when binning fold changes.
MIN_FOLD_CHANGE_EXPRESSION = 0.5
# Elements per block when streaming over cells or distance-matrix rows (bounds peak memory).
_BLOCK_ELEMENTS = 1 << 22


def condition_metrics(
    pred_mean: np.ndarray,
    truth_cells,
    cell_condition: np.ndarray,
    ctrl_mean: np.ndarray,
    de_idx: np.ndarray,
    non_dropout_de_idx: np.ndarray,
    hvg_idx: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """GEARS's per-perturbation metrics for every condition at once.

    pred_mean: [conditions, genes] predicted mean profiles. truth_cells: [cells, genes] dense or
    scipy sparse (only the DE columns are gathered per cell; never densified). cell_condition:
    [cells] row of pred_mean each truth cell belongs to. ctrl_mean: [genes]. de_idx: [conditions,
    K] genes ranked by DE, `-1` padded; the `_de` / `top20` metrics use its first 20 columns.
    non_dropout_de_idx: [conditions, 20] top-20 non-dropout DE genes, `-1` padded. hvg_idx: [H]
    genes for the `*_top200_hvg` metrics (see `top_variable_genes`), skipped when None.
    Returns metric name -> [conditions] float64, NaN where undefined.
    """
    pred = np.asarray(pred_mean, dtype=np.float64)
    if pred.ndim != 2:
        raise GearsInputError(f"pred_mean must be [conditions, genes], got shape {pred.shape}")
    n_cond, n_genes = pred.shape
    ctrl = _vector(ctrl_mean, n_genes, "ctrl_mean")
    if not sp.issparse(truth_cells):
        truth_cells = np.asarray(truth_cells)
    if truth_cells.ndim != 2 or truth_cells.shape[1] != n_genes:
        raise GearsInputError(
            f"truth_cells must be [cells, {n_genes}] to match pred_mean, got {truth_cells.shape}"
        )
    cond = np.asarray(cell_condition)
    if cond.shape != (truth_cells.shape[0],) or not np.issubdtype(cond.dtype, np.integer):
        raise GearsInputError(
            f"cell_condition must be [{truth_cells.shape[0]}] integers (one per truth cell), "
            f"got shape {cond.shape} dtype {cond.dtype}"
        )
    if cond.size and (cond.min() < 0 or cond.max() >= n_cond):
        raise GearsInputError(f"cell_condition values must lie in [0, {n_cond}) (rows of pred)")
    de = _index_table(de_idx, n_cond, n_genes, "de_idx")
    nd = _index_table(non_dropout_de_idx, n_cond, n_genes, "non_dropout_de_idx")[:, :20]
    de20 = de[:, :20]

    counts = np.bincount(cond, minlength=n_cond)
    truth = _group_means(truth_cells, cond, counts)
    out: dict[str, np.ndarray] = {}
    all_genes = np.ones_like(pred, dtype=bool)

    # compute_metrics
    out["mse"] = _masked_mse(pred, truth, all_genes)
    out["pearson"] = _masked_pearson(pred, truth, all_genes)
    _add_pair_metrics(out, pred, truth, ctrl, de20, "{m}_de", delta_key="pearson_delta_de")

    # deeper_analysis
    out["pearson_delta"] = _masked_pearson(pred - ctrl, truth - ctrl, all_genes)
    out["frac_correct_direction_all"] = _direction_fractions(pred, truth, ctrl, all_genes)[0]
    for n in DE_SIZES:
        top = de[:, :n]
        p, t, c = _gather(pred, top), _gather(truth, top), _ctrl_at(ctrl, top)
        out[f"frac_correct_direction_{n}"] = _direction_fractions(p, t, c, top >= 0)[0]
        _add_pair_metrics(out, pred, truth, ctrl, top, f"{{m}}_top{n}_de", delta=True)
    # One pass over the cells gathers both gene lists: [C, 20 + 20] statistics, split below.
    both = _cell_stats(truth_cells, cond, counts, np.hstack([de20, nd]))
    stats = {key: values[:, : de20.shape[1]] for key, values in both.items()}
    stats_nd = {key: values[:, de20.shape[1] :] for key, values in both.items()}
    out.update(_range_metrics(_gather(pred, de20), de20 >= 0, stats, ""))
    nonzero = (de20 >= 0) & ~((stats["min"] == 0) & (stats["max"] == 0))
    frac = _direction_fractions(
        _gather(pred, de20), _gather(truth, de20), _ctrl_at(ctrl, de20), nonzero
    )
    out["frac_correct_direction_20_nonzero"] = frac[0]
    out.update(_fold_change_gaps(pred, truth, ctrl))
    if hvg_idx is not None:
        hvg = np.asarray(hvg_idx)
        if hvg.ndim != 1 or not np.issubdtype(hvg.dtype, np.integer):
            raise GearsInputError(f"hvg_idx must be a 1-D integer array, got {hvg.shape}")
        if hvg.size and (hvg.min() < 0 or hvg.max() >= n_genes):
            raise GearsInputError(f"hvg_idx values must lie in [0, {n_genes})")
        hvg_table = np.broadcast_to(hvg, (n_cond, hvg.size))
        _add_pair_metrics(out, pred, truth, ctrl, hvg_table, "{m}_top200_hvg", delta=True)
        # GEARS takes mse_top200_hvg on raw means (unlike mse_top{n}_de, which is on deltas).
        out["mse_top200_hvg"] = _masked_mse(pred[:, hvg], truth[:, hvg], hvg_table >= 0)

    # non_dropout_analysis
    mask = nd >= 0
    p_nd, t_nd = _gather(pred, nd), _gather(truth, nd)
    correct, zero_one, opposite = _direction_fractions(p_nd, t_nd, _ctrl_at(ctrl, nd), mask)
    out["frac_correct_direction_top20_non_dropout"] = correct
    out["frac_opposite_direction_top20_non_dropout"] = opposite
    out["frac_0/1_direction_top20_non_dropout"] = zero_one
    out.update(_range_metrics(p_nd, mask, stats_nd, "_non_dropout"))
    _add_pair_metrics(out, pred, truth, ctrl, nd, "{m}_top20_de_non_dropout", delta=True)

    undefined = (counts == 0) | ~np.isfinite(pred).all(axis=1)
    for values in out.values():
        values[undefined] = np.nan
    return out


def top_variable_genes(condition_means: np.ndarray, n: int = 200) -> np.ndarray:
    """GEARS's `most_variable_genes`: the n genes whose mean varies most across conditions.

    condition_means: [conditions, genes] mean profile of every condition in the data (GEARS uses
    all of them, control included). Returns [min(n, genes)] gene indices, ascending by std.
    """
    means = np.asarray(condition_means, dtype=np.float64)
    if means.ndim != 2:
        raise GearsInputError(f"condition_means must be [conditions, genes], got {means.shape}")
    n = min(int(n), means.shape[1])
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    return np.argsort(means.std(axis=0), kind="stable")[-n:]


def summarize(
    per_condition: dict[str, np.ndarray],
    condition_names: Sequence[str],
    groups: dict[str, Sequence[str]] | None = None,
) -> dict:
    """Average per-condition metrics over all conditions and over each group of conditions.

    Returns {"overall": {metric: nan-mean, ..., "n_conditions": C}, "<group>": {...}}.

    per_condition: metric -> [conditions] as returned by `condition_metrics`, rows in the order of
    condition_names. groups: group name -> condition names (e.g. test subgroups); names absent
    from condition_names are ignored and groups with none present are omitted.
    """
    names = np.asarray(list(condition_names), dtype=object)
    for key, values in per_condition.items():
        if np.shape(values) != names.shape:
            raise GearsInputError(
                f"metric {key!r} has {np.shape(values)} values but there are {names.size} "
                "condition names; pass the names in the row order of the metrics"
            )
    selections = {"overall": np.ones(names.size, dtype=bool)}
    for group, members in (groups or {}).items():
        selected = np.isin(names, np.asarray(list(members), dtype=object))
        if selected.any():
            selections[group] = selected
    summary = {}
    for group, selected in selections.items():
        row = {}
        for key, values in per_condition.items():
            picked = np.asarray(values, dtype=np.float64)[selected]
            finite = ~np.isnan(picked)
            row[key] = float(picked[finite].mean()) if finite.any() else float("nan")
        row["n_conditions"] = int(selected.sum())
        summary[group] = row
    return summary


def gi_params(first: np.ndarray, second: np.ndarray, double: np.ndarray) -> dict[str, float]:
    """GEARS's genetic-interaction fit (`get_coeffs`): double ~ c1*first + c2*second, no intercept.

    first, second, double: [genes] changes versus the control mean (usually restricted to a gene
    subset). The fit is sklearn's TheilSenRegressor with GEARS's settings (up to 1e5 gene pairs:
    seconds per call on thousands of genes, as in GEARS). Returns c1, c2,
    mag = |(c1, c2)|, dcor (singles jointly vs double), dcor_singles, dcor_first, dcor_second,
    corr_fit (Pearson of fitted vs double), dominance = |log10(c1/c2)|, eq_contr = min/max of
    dcor_first and dcor_second.
    """
    from sklearn.linear_model import TheilSenRegressor

    x1, x2, y = (np.asarray(v, dtype=np.float64).ravel() for v in (first, second, double))
    if not (x1.size == x2.size == y.size) or y.size < 3:
        raise GearsInputError(
            f"gi_params needs three equal-length vectors of >= 3 genes, got {x1.size}, "
            f"{x2.size}, {y.size}"
        )
    singles = np.column_stack([x1, x2])
    model = TheilSenRegressor(
        fit_intercept=False, max_subpopulation=1e5, max_iter=1000, random_state=1000
    ).fit(singles, y)
    fitted = model.predict(singles)
    c1, c2 = (float(c) for c in model.coef_)
    d_first, d_second = distance_correlation(x1, y), distance_correlation(x2, y)
    with np.errstate(divide="ignore", invalid="ignore"):
        dominance = float(np.abs(np.log10(np.float64(c1) / np.float64(c2))))
        eq_contr = float(np.float64(min(d_first, d_second)) / np.float64(max(d_first, d_second)))
        corr_fit = float(np.corrcoef(fitted, y)[0, 1])
    return {
        "c1": c1,
        "c2": c2,
        "mag": float(np.hypot(c1, c2)),
        "dcor": distance_correlation(singles, y),
        "dcor_singles": distance_correlation(x1, x2),
        "dcor_first": d_first,
        "dcor_second": d_second,
        "corr_fit": corr_fit,
        "dominance": dominance,
        "eq_contr": eq_contr,
    }


def distance_correlation(x: np.ndarray, y: np.ndarray) -> float:
    """Biased (V-statistic) distance correlation of Szekely et al., as `dcor.distance_correlation`.

    x: [n] or [n, p]; y: [n] or [n, q] (rows are samples). Streams the n x n distance matrices
    in row blocks, using mean(A*B) = mean(a*b) - 2 mean_i(a_i. b_i.) + a.. b.. for the
    double-centred A, B, so memory stays O(block * n). Returns 0 when either input is constant.
    """
    xs = np.asarray(x, dtype=np.float64)
    ys = np.asarray(y, dtype=np.float64)
    xs = xs.reshape(len(xs), -1)
    ys = ys.reshape(len(ys), -1)
    n = len(xs)
    if len(ys) != n or n == 0:
        raise GearsInputError(f"distance_correlation needs equal sample counts, got {n}, {len(ys)}")
    row_a, row_b = np.empty(n), np.empty(n)
    sum_ab = sum_aa = sum_bb = 0.0
    step = max(1, _BLOCK_ELEMENTS // n)
    for start in range(0, n, step):
        stop = min(n, start + step)
        a = cdist(xs[start:stop], xs)
        b = cdist(ys[start:stop], ys)
        row_a[start:stop] = a.mean(axis=1)
        row_b[start:stop] = b.mean(axis=1)
        sum_ab += float(np.einsum("ij,ij->", a, b))
        sum_aa += float(np.einsum("ij,ij->", a, a))
        sum_bb += float(np.einsum("ij,ij->", b, b))
    grand_a, grand_b = row_a.mean(), row_b.mean()
    dcov = sum_ab / n**2 - 2.0 * np.mean(row_a * row_b) + grand_a * grand_b
    dvar_x = sum_aa / n**2 - 2.0 * np.mean(row_a**2) + grand_a**2
    dvar_y = sum_bb / n**2 - 2.0 * np.mean(row_b**2) + grand_b**2
    denominator = np.sqrt(abs(dvar_x * dvar_y))
    if denominator == 0.0:
        return 0.0
    return float(np.sqrt(max(dcov / denominator, 0.0)))


# ---------------------------------------------------------------------------------------------
# Vectorised building blocks. Arrays named like [C, k] are per condition over k gathered genes.


def _vector(values, n_genes: int, name: str) -> np.ndarray:
    out = np.asarray(values, dtype=np.float64).ravel()
    if out.shape != (n_genes,):
        raise GearsInputError(f"{name} must have {n_genes} values (one per gene), got {out.size}")
    return out


def _index_table(table, n_cond: int, n_genes: int, name: str) -> np.ndarray:
    idx = np.asarray(table)
    if idx.ndim != 2 or idx.shape[0] != n_cond or not np.issubdtype(idx.dtype, np.integer):
        raise GearsInputError(
            f"{name} must be an integer [{n_cond}, k] table (one row per condition, -1 padded), "
            f"got shape {idx.shape} dtype {idx.dtype}"
        )
    if idx.size and (idx.min() < -1 or idx.max() >= n_genes):
        raise GearsInputError(f"{name} values must be gene indices in [0, {n_genes}) or -1")
    return idx.astype(np.int64)


def _gather(values: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """values [C, G] at idx [C, k] -> [C, k], NaN at -1 padding."""
    picked = np.take_along_axis(values, np.maximum(idx, 0), axis=1)
    return np.where(idx >= 0, picked, np.nan)


def _ctrl_at(ctrl: np.ndarray, idx: np.ndarray) -> np.ndarray:
    return np.where(idx >= 0, ctrl[np.maximum(idx, 0)], np.nan)


def _masked_mse(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> np.ndarray:
    n = mask.sum(axis=1)
    sq = np.where(mask, (a - b) ** 2, 0.0).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, sq / n, np.nan)


def _masked_pearson(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Row-wise scipy.stats.pearsonr on masked entries: constant row -> 0 (GEARS), n < 2 -> NaN."""
    n = mask.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        da = np.where(mask, a - np.where(mask, a, 0.0).sum(axis=1, keepdims=True) / n[:, None], 0)
        db = np.where(mask, b - np.where(mask, b, 0.0).sum(axis=1, keepdims=True) / n[:, None], 0)
        r = (da * db).sum(axis=1) / np.sqrt((da * da).sum(axis=1) * (db * db).sum(axis=1))
    # scipy returns NaN for exactly constant input (x == x[0]); GEARS maps that NaN to 0.
    constant = _masked_constant(a, mask) | _masked_constant(b, mask)
    r = np.where(constant, 0.0, np.clip(r, -1.0, 1.0))
    return np.where(n >= 2, r, np.nan)


def _masked_constant(a: np.ndarray, mask: np.ndarray) -> np.ndarray:
    hi = np.where(mask, a, -np.inf).max(axis=1, initial=-np.inf)
    lo = np.where(mask, a, np.inf).min(axis=1, initial=np.inf)
    return hi == lo


def _direction_fractions(pred, truth, ctrl, mask):
    """Fractions of masked genes with |sign(pred - ctrl) - sign(truth - ctrl)| = 0, 1 and 2."""
    change = np.abs(np.sign(pred - ctrl) - np.sign(truth - ctrl))
    n = mask.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return tuple(
            np.where(n > 0, (mask & (change == k)).sum(axis=1) / n, np.nan) for k in (0, 1, 2)
        )


def _add_pair_metrics(out, pred, truth, ctrl, idx, template, delta=False, delta_key=None):
    """pearson/mse (raw) and pearson_delta on the genes idx [C, k] of each condition.

    With delta=True the keys are GEARS's deeper-analysis ones: pearson_delta_<x>, pearson_<x> and
    mse_<x> where mse is taken on the changes versus control (as GEARS does for the DE lists).
    """
    mask = idx >= 0
    p, t, c = _gather(pred, idx), _gather(truth, idx), _ctrl_at(ctrl, idx)
    if delta:
        out[template.format(m="pearson_delta")] = _masked_pearson(p - c, t - c, mask)
        out[template.format(m="pearson")] = _masked_pearson(p, t, mask)
        out[template.format(m="mse")] = _masked_mse(p - c, t - c, mask)
    else:
        out[template.format(m="mse")] = _masked_mse(p, t, mask)
        out[template.format(m="pearson")] = _masked_pearson(p, t, mask)
        out[delta_key] = _masked_pearson(p - c, t - c, mask)


def _group_means(cells, cond: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Mean row of cells [N, G] per condition -> [C, G] float64 (NaN for conditions with no cell).

    Streams blocks of cells through a sparse condition-indicator product so a float32 or sparse
    matrix is never copied whole into float64.
    """
    n_cells, n_genes = cells.shape
    sums = np.zeros((len(counts), n_genes))
    step = max(1, _BLOCK_ELEMENTS // max(n_genes, 1))
    sparse = sp.issparse(cells)
    if sparse:
        cells = sp.csr_matrix(cells)
    for start in range(0, n_cells, step):
        stop = min(n_cells, start + step)
        indicator = sp.csr_matrix(
            (np.ones(stop - start), (cond[start:stop], np.arange(stop - start))),
            shape=(len(counts), stop - start),
        )
        block = cells[start:stop]
        if sparse:
            sums += (indicator @ block.astype(np.float64)).toarray()
        else:
            sums += indicator @ np.asarray(block, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return sums / np.where(counts > 0, counts, np.nan)[:, None]


def _gather_cells(cells, cols: np.ndarray) -> np.ndarray:
    """cells[i, cols[i, j]] for every cell i -> [N, k] float64, touching only those entries."""
    if sp.issparse(cells):
        rows = np.repeat(np.arange(cols.shape[0]), cols.shape[1])
        picked = sp.csr_matrix(cells)[rows, cols.ravel()]
        return np.asarray(picked, dtype=np.float64).reshape(cols.shape)
    return np.asarray(np.take_along_axis(np.asarray(cells), cols, axis=1), dtype=np.float64)


def _cell_stats(cells, cond, counts, idx) -> dict[str, np.ndarray]:
    """Per-condition statistics over the truth cells at genes idx [C, k] -> name -> [C, k].

    mean, std (ddof 0), min, max and the GEARS quantiles q25/q40/q45/q55/q60/q75 (numpy's
    default linear interpolation). Cells are grouped by condition and each gene column sorted
    within the groups (a stable value sort, then a stable group sort), so quantiles are gathers
    at per-condition offsets: no padding to the largest condition, no loop over conditions.
    """
    n_cond, k = idx.shape
    cols = idx[cond]
    # Gather in storage order (cache friendly for CSR), then group the small [cells, k] result.
    values = np.where(cols >= 0, _gather_cells(cells, np.maximum(cols, 0)), np.nan)
    order = np.argsort(cond, kind="stable")
    group = cond[order]
    values = values[order]

    by_value = np.argsort(values, axis=0, kind="stable")
    by_group = np.argsort(group[by_value], axis=0, kind="stable")
    ranked = np.take_along_axis(values, np.take_along_axis(by_value, by_group, axis=0), axis=0)

    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    last = np.maximum(counts - 1, 0)
    has_cells = (counts > 0)[:, None] & (idx >= 0)

    def at(offset: np.ndarray) -> np.ndarray:
        rows = np.minimum(starts[:, None] + offset, max(len(group) - 1, 0))
        if len(group) == 0:
            return np.full((n_cond, k), np.nan)
        return np.where(has_cells, np.take_along_axis(ranked, rows, axis=0), np.nan)

    indicator = sp.csr_matrix(
        (np.ones(len(group)), (group, np.arange(len(group)))), shape=(n_cond, len(group))
    )
    safe = np.where(counts > 0, counts, np.nan)[:, None]
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = (indicator @ np.nan_to_num(values)) / safe
        var = (indicator @ np.nan_to_num((values - mean[group]) ** 2)) / safe
    stats = {
        "mean": np.where(has_cells, mean, np.nan),
        "std": np.where(has_cells, np.sqrt(var), np.nan),
        "min": at(np.zeros((n_cond, k), dtype=np.int64)),
        "max": at(np.broadcast_to(last[:, None], (n_cond, k))),
    }
    for q in {q for pair in QUANTILE_RANGES.values() for q in pair}:
        # numpy's "linear" method: virtual index (n - 1) q, clamped, and its two-sided lerp.
        virtual = (counts - 1) * q
        below = np.floor(virtual)
        above_end = virtual >= counts - 1
        lo = np.where(above_end, last, below).astype(np.int64)
        hi = np.where(above_end, last, below + 1).astype(np.int64)
        gamma = (virtual - below)[:, None]
        a = at(np.broadcast_to(lo[:, None], (n_cond, k)))
        b = at(np.broadcast_to(hi[:, None], (n_cond, k)))
        diff = b - a
        stats[f"q{round(q * 100)}"] = np.where(
            gamma >= 0.5, b - diff * (1 - gamma), a + diff * gamma
        )
    return stats


def _range_metrics(pred: np.ndarray, mask: np.ndarray, stats: dict, suffix: str) -> dict:
    """GEARS's frac_in_range*, mean/std_sigma and frac_sigma_below_* on genes [C, k].

    As in GEARS: the range metrics count the listed genes that are not zero in every cell; the
    sigma metrics use the listed genes whose std over cells is > 0; both are left out (NaN) for a
    condition whose listed genes are all zero in every cell.
    """
    nonzero = mask & ~((stats["min"] == 0) & (stats["max"] == 0))
    n_nonzero = nonzero.sum(axis=1)
    out = {}
    with np.errstate(invalid="ignore", divide="ignore"):
        bounds = {"": ("min", "max")} | {
            f"_{name}": (f"q{round(lo * 100)}", f"q{round(hi * 100)}")
            for name, (lo, hi) in QUANTILE_RANGES.items()
        }
        for tag, (lo, hi) in bounds.items():
            inside = nonzero & (pred >= stats[lo]) & (pred <= stats[hi])
            out[f"frac_in_range{tag}{suffix}"] = inside.sum(axis=1) / n_nonzero
        spread = mask & (stats["max"] > stats["min"])
        n_spread = spread.sum(axis=1)
        sigma = np.where(spread, np.abs(pred - stats["mean"]) / stats["std"], 0.0)
        mean_sigma = sigma.sum(axis=1) / n_spread
        out[f"mean_sigma{suffix}"] = mean_sigma
        deviation = np.where(spread, (sigma - mean_sigma[:, None]) ** 2, 0.0)
        out[f"std_sigma{suffix}"] = np.sqrt(deviation.sum(axis=1) / n_spread)
        for level in (1, 2):
            above = (spread & (sigma > level)).sum(axis=1)
            out[f"frac_sigma_below_{level}{suffix}"] = 1.0 - above / n_spread
    for key, values in out.items():
        undefined = n_nonzero == 0
        if "sigma" in key:
            undefined = undefined | (n_spread == 0)
        out[key] = np.where(undefined, np.nan, values)
    return out


def _fold_change_gaps(pred: np.ndarray, truth: np.ndarray, ctrl: np.ndarray) -> dict:
    """GEARS's fold_change_gap_*: mean |pred/ctrl - truth/ctrl| over genes in a fold-change bin.

    The fold change truth/ctrl is set to 0 where it is not finite or where truth < 0.5, and 0
    means "in no bin", exactly as GEARS does.
    """
    with np.errstate(invalid="ignore", divide="ignore"):
        fold = truth / ctrl
        fold[~np.isfinite(fold) | (truth < MIN_FOLD_CHANGE_EXPRESSION)] = 0.0
        gap = np.abs(pred / ctrl - truth / ctrl)
        out = {}
        for name, (low, high) in FOLD_CHANGE_BINS.items():
            selected = (fold > low) & (fold < high)
            n = selected.sum(axis=1)
            total = np.where(selected, gap, 0.0).sum(axis=1)
            out[f"fold_change_gap_{name}"] = np.where(n > 0, total / np.maximum(n, 1), np.nan)
    return out
