"""Refuse to pool contexts (cell lines, cell types) silently: find the obs column that names
more than one, and stop unless data.context_key, data.subset or data.pool_contexts says what
to do with them.

Pooled, every line's control cells make one control mean, so the "DE genes" and the changes a
model is scored on compare lines with each other, not perturbed cells with their controls.

The rule (cheap: obs, and at most MAX_CELLS x MAX_GENES of the control cells' expression):
- a column named like a context (NAMED, any case) with two or more values among the kept
  cells is a context column;
- any other text, categorical or boolean column (or integer with few values) with 2 to
  MAX_GROUPS values among the control cells, MIN_GROUP_CELLS control cells in at least two of
  them, is one when it explains at least MIN_SHARE of the control cells' expression variance
  (summed over genes; the between-group share, eta squared) and at least NULL_FACTOR times
  what labels drawn at random would explain, (groups - 1) / (cells - 1). Cell lines explain a
  quarter to a third (A172, T98G, U87MG and K562 in ../shared/data: 0.26 to 0.32); a random
  four-way label 0.008.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from gears.data.conditions import (
    CTRL,
    canonicalize_conditions,
    control_like_genes,
    detect_condition_key,
)
from gears.errors import GearsInputError

# Column names that say "context" whatever the data: a second value is enough.
NAMED = frozenset(
    {
        "cell_type",
        "celltype",
        "cell_line",
        "cellline",
        "cell_line_name",
        "cell_type_name",
        "cell_line_id",
        "cell_lines",
        "context",
        "cell_context",
    }
)
MAX_GROUPS = 20  # more values than this is an identifier or a batch, not a context
MIN_GROUP_CELLS = 3
MIN_SHARE = 0.05
NULL_FACTOR = 10.0
MAX_CELLS = 1000  # control cells read for the expression rule (a seeded sample)
MAX_GENES = 2000  # genes read for it (a seeded sample)


def context_columns(
    obs: pd.DataFrame,
    is_control: np.ndarray,
    control_rows=None,
    skip: tuple[str, ...] = (),
) -> list[tuple[str, list[str]]]:
    """The obs columns that name more than one context, most telling first: [(column, values)].

    obs: the kept cells' obs; is_control: [cells] bool; control_rows(rows) -> [rows, genes]
    expression of those (sorted) cell rows, or None to apply the name rule alone; skip: columns
    that are not contexts (the perturbation column)."""
    found: list[tuple[str, list[str]]] = []
    later: list[str] = []
    for column in obs.columns:
        if column in skip:
            continue
        values = obs[column]
        if str(column).lower() in NAMED:
            kinds = _values(values)
            if len(kinds) > 1:
                found.append((str(column), kinds))
            continue
        if _groupable(values):
            later.append(column)
    if control_rows is None or not later or is_control.sum() < 2 * MIN_GROUP_CELLS:
        return found
    rows = np.flatnonzero(is_control)
    rng = np.random.default_rng(0)
    if len(rows) > MAX_CELLS:
        rows = np.sort(rng.choice(rows, MAX_CELLS, replace=False))
    X = np.asarray(control_rows(rows), dtype=np.float64)
    if X.shape[1] > MAX_GENES:
        X = X[:, np.sort(rng.choice(X.shape[1], MAX_GENES, replace=False))]
    total = float(((X - X.mean(0)) ** 2).sum())
    if total <= 0:
        return found
    scored = []
    for column in later:
        labels = obs[column].to_numpy()[rows].astype(str)
        kinds, codes, sizes = np.unique(labels, return_inverse=True, return_counts=True)
        if not 2 <= len(kinds) <= MAX_GROUPS or (sizes >= MIN_GROUP_CELLS).sum() < 2:
            continue
        share = _between_share(X, codes, len(kinds), total)
        null = (len(kinds) - 1) / max(len(rows) - 1, 1)
        if share >= MIN_SHARE and share >= NULL_FACTOR * null:
            scored.append((share, str(column), _values(obs[column])))
    found += [(c, v) for _, c, v in sorted(scored, key=lambda s: -s[0])]
    return found


def check_contexts(
    adata,
    keep: np.ndarray | None,
    *,
    subset: dict | None,
    condition_key: str | None,
    control_names=(),
    normalize: str = "none",
    pool_contexts: bool | None = False,
    log=print,
) -> None:
    """Refuse (pool_contexts=False), report (None) or allow (True) a file whose kept cells
    (keep: [cells] bool, None = all) span several contexts. adata may be backed: only obs and
    a sample of the control rows are read. Labels this cannot read are left to the processing
    that follows, which names them."""
    if pool_contexts is True:
        return
    obs = adata.obs if keep is None else adata.obs[keep]
    rows_of = np.arange(adata.n_obs) if keep is None else np.flatnonzero(keep)
    try:
        chosen = detect_condition_key(obs.columns, condition_key)
        genes = control_like_genes(adata.var_names, control_names)
        canon = canonicalize_conditions(
            obs[chosen].astype(str).str.strip().values, "+", control_names, genes
        )
    except GearsInputError:
        return

    def control_rows(rows):
        block = adata.X[rows_of[rows]]
        block = block.toarray() if hasattr(block, "toarray") else np.asarray(block)
        if normalize == "log1p":
            totals = block.sum(1, keepdims=True)
            block = np.log1p(block / np.maximum(totals, 1e-12) * np.median(totals))
        return block

    found = context_columns(obs, canon == CTRL, control_rows, skip=(chosen, "condition"))
    if pool_contexts is None:
        if found:
            column, values = found[0]
            log(
                f"note: obs[{column!r}] holds {len(values)} contexts ({', '.join(values[:8])}); "
                f"their cells are pooled: set_context_key({column!r}) keeps them apart"
            )
        return
    refuse_pooled_contexts(found, subset)


def refuse_pooled_contexts(found: list[tuple[str, list[str]]], subset: dict | None) -> None:
    """One line naming the first context column, its values and the settings that choose."""
    if not found:
        return
    column, values = found[0]
    shown = ", ".join(values[:8]) + (f", ... ({len(values)} in all)" if len(values) > 8 else "")
    also = [c for c, _ in found[1:]]
    kept = f" (after data.subset={subset})" if subset else ""
    raise GearsInputError(
        f"obs[{column!r}] holds {len(values)} contexts{kept} ({shown}) and data.context_key is "
        "not set: their control cells would be pooled into one control mean, so the DE genes "
        "and metrics would compare contexts, not perturbations"
        f"{f' (also separating the controls: {also})' if also else ''}; set "
        f"data.context_key={column} (one model per context), or data.subset.{column}=<value> "
        "(one context), or data.pool_contexts=true to pool them on purpose"
    )


def _values(values: pd.Series) -> list[str]:
    return sorted({str(v) for v in values.dropna().unique()})


def _groupable(values: pd.Series) -> bool:
    """Text, categorical or boolean, or integers with few values: labels, not measurements."""
    dtype = values.dtype
    if isinstance(dtype, pd.CategoricalDtype) or pd.api.types.is_bool_dtype(dtype):
        return True
    if pd.api.types.is_object_dtype(dtype):
        return True
    if pd.api.types.is_string_dtype(dtype):
        return True
    return pd.api.types.is_integer_dtype(dtype) and values.nunique() <= MAX_GROUPS


def _between_share(X: np.ndarray, codes: np.ndarray, k: int, total: float) -> float:
    """The share of X's summed variance that the groups' means explain (eta squared)."""
    sums = np.zeros((k, X.shape[1]))
    np.add.at(sums, codes, X)
    sizes = np.bincount(codes, minlength=k).astype(np.float64)
    means = sums / sizes[:, None]
    between = float((sizes[:, None] * (means - X.mean(0)) ** 2).sum())
    return between / total
