"""The checks a raw AnnData (in memory or backed) passes before any processing: each failure is
one GearsInputError naming the problem and the fix."""

from __future__ import annotations

import anndata as ad
import numpy as np
import pandas as pd
import scipy.sparse as sp

from gears.data.conditions import CTRL
from gears.errors import GearsInputError

RAW_COUNT_MAX = 30  # log1p of normalised counts stays far below; raw UMI counts reach it


def finite_values(X) -> np.ndarray:
    """The stored values of X (a sparse matrix's non-zeros, a dense matrix whole)."""
    return X.data if sp.issparse(X) else np.asarray(X)


def rows_with_nonfinite(X) -> np.ndarray:
    """Rows (cells) holding a NaN or infinite value (only run to word an error)."""
    if sp.issparse(X):
        X = sp.csr_matrix(X)
        bad_values = np.flatnonzero(~np.isfinite(X.data))
        return np.unique(np.searchsorted(X.indptr, bad_values, side="right") - 1)
    return np.flatnonzero(~np.isfinite(np.asarray(X)).all(axis=1))


def validate_adata(adata: ad.AnnData, condition_key: str = "condition") -> None:
    """Raise GearsInputError naming the first problem found in a raw AnnData."""
    if adata.n_obs == 0 or adata.n_vars == 0:
        raise GearsInputError(f"the AnnData is empty ({adata.n_obs} cells x {adata.n_vars} genes)")
    if condition_key not in adata.obs:
        raise GearsInputError(
            f"adata.obs has no {condition_key!r} column naming each cell's perturbation "
            f"(columns present: {list(adata.obs.columns)}); add it, spelled 'ctrl' / 'A+ctrl' / "
            "'A+B' (or 'control', 'A', 'A+B')"
        )
    missing = adata.obs[condition_key].isna()
    if missing.any():
        raise GearsInputError(
            f"{int(missing.sum())} cells have a missing (NaN/null) value in "
            f"obs[{condition_key!r}]; "
            "label them (e.g. 'ctrl') or drop them"
        )
    _check_values(adata)
    check_gene_names(adata)
    _check_unique(gene_names_of(adata))


def _check_values(adata: ad.AnnData) -> None:
    """NaN, infinite, negative and beyond-float32 values of an in-memory X."""
    values = finite_values(adata.X)
    n_bad = int(np.size(values) - np.isfinite(values).sum())
    if n_bad:
        first = [str(adata.obs_names[r]) for r in rows_with_nonfinite(adata.X)[:5]]
        raise GearsInputError(
            f"adata.X has {n_bad} NaN or infinite expression values (cells {first} ...); "
            "drop those cells or fix them (e.g. re-run sc.pp.normalize_total + sc.pp.log1p on "
            "the raw counts) before processing"
        )
    if np.size(values) and values.min() < 0:
        raise GearsInputError(
            f"adata.X has negative values (min {values.min():.3g}); GEARS expects log-normalised "
            "counts (sc.pp.normalize_total then sc.pp.log1p), not scaled or centred data"
        )
    if np.size(values) and values.max() > np.finfo(np.float32).max:  # inf once stored
        raise GearsInputError(
            f"adata.X has values too large for float32 (max {values.max():.3g}); GEARS expects "
            "log-normalised counts (sc.pp.normalize_total then sc.pp.log1p)"
        )


def _check_unique(names: pd.Index) -> None:
    dup = names[names.duplicated()].unique()
    if len(dup):
        raise GearsInputError(
            f"{len(dup)} duplicate gene names, e.g. {list(dup[:5])}; make them unique "
            "(adata.var_names_make_unique()) or drop the duplicates"
        )


def validate_backed(backed: ad.AnnData, condition_key: str) -> None:
    """validate_adata's checks that need no expression value, on a backed AnnData (values are
    checked chunk by chunk as they are streamed: gears.data.stream.check_block)."""
    names = gene_names_of(backed)
    if backed.n_obs == 0 or backed.n_vars == 0:
        raise GearsInputError(
            f"the AnnData is empty ({backed.n_obs} cells x {backed.n_vars} genes)"
        )
    check_gene_names(backed)
    if condition_key not in backed.obs:
        raise GearsInputError(
            f"adata.obs has no {condition_key!r} column naming each cell's perturbation "
            f"(columns present: {list(backed.obs.columns)})"
        )
    raw = backed.obs[condition_key]
    if raw.isna().any():
        raise GearsInputError(
            f"{int(raw.isna().sum())} cells have a missing (NaN/null) value in "
            f"obs[{condition_key!r}]; label them (e.g. 'ctrl') or drop them"
        )
    _check_unique(names)


def check_not_raw_counts(values: np.ndarray, sample: int = 10_000_000) -> None:
    """Refuse raw counts: every value an integer and the maximum above RAW_COUNT_MAX. GEARS's
    loss and metrics assume log-normalised expression; raw counts would train and score without
    any error, on the wrong scale (a wrong result that looks right). A check of the first
    `sample` stored values keeps this cheap on large data."""
    head = np.asarray(values).reshape(-1)[:sample].astype(np.float32, copy=False)  # as stored
    if head.size and head.max() > RAW_COUNT_MAX and np.array_equal(head, np.round(head)):
        raise GearsInputError(
            f"adata.X looks like raw counts (every value is an integer, max {head.max():.0f}); "
            "GEARS expects log-normalised expression: set data.normalize=log1p (PertData: "
            "normalize='log1p') to normalise them, or run sc.pp.normalize_total(adata) then "
            "sc.pp.log1p(adata) first"
        )


def check_controls(
    conditions: np.ndarray, condition_key: str, gene_spellings: set[str], fix: str
) -> None:
    """Canonical conditions [cells] must hold at least 2 control cells and a perturbed one;
    `fix` is the no-control error's advice on other control spellings."""
    if not (conditions == CTRL).any():
        raise GearsInputError(
            f"no control cells: none of obs[{condition_key!r}] is 'ctrl', 'control' or "
            f"'non-targeting' ({fix})" + gene_spelling_hint(gene_spellings)
        )
    if (conditions == CTRL).all():
        raise GearsInputError("every cell is a control: the data has no perturbed cells")
    check_control_cells(int((conditions == CTRL).sum()))


def check_control_cells(n_ctrl: int) -> None:
    """DE tests each condition against the control cells: one cell has no variance."""
    if n_ctrl < 2:
        raise GearsInputError(
            f"only {n_ctrl} control cell: the DE test and the control mean need at least 2; "
            "add control cells (or label more cells with a control spelling)"
        )


def gene_spelling_hint(gene_spellings: set[str]) -> str:
    """The 'no control cells' error's note when a control-like spelling was read as a gene."""
    if not gene_spellings:
        return ""
    return (
        f"; labels spelled {sorted(gene_spellings)} were read as the measured gene(s) of that "
        "name: if they are your control cells, add that spelling to data.control_names"
    )


def context_labels(obs: pd.DataFrame, context_key: str | None) -> np.ndarray | None:
    """Each cell's context (obs[context_key] as text) [cells], None without a key; a missing
    column or a cell without a context is one GearsInputError naming the fix."""
    if context_key is None:
        return None
    if context_key not in obs:
        raise GearsInputError(
            f"data.context_key={context_key!r}: adata.obs has no such column (columns: "
            f"{list(obs.columns)}); name the column of each cell's context (e.g. its cell "
            "line), or set data.context_key=null for one context"
        )
    column = obs[context_key]
    missing = column.isna().values | (column.astype(str).str.strip() == "").values
    if missing.any():
        raise GearsInputError(
            f"{int(missing.sum())} cells have no value in obs[{context_key!r}] "
            "(data.context_key); label their context or drop them"
        )
    return column.astype(str).str.strip().values.astype(object)


def check_gene_names(adata: ad.AnnData) -> None:
    """Every gene needs a name: an empty or missing one (str() would make it 'nan' or
    'None') cannot be perturbed, predicted or matched to a model."""
    column = adata.var["gene_name"] if "gene_name" in adata.var else adata.var_names.to_series()
    blank = column.isna().values | (column.astype(str).str.strip() == "").values
    if blank.any():
        where = "var['gene_name']" if "gene_name" in adata.var else "var_names"
        raise GearsInputError(
            f"{int(blank.sum())} genes have an empty or missing gene name in {where} (rows "
            f"{np.flatnonzero(blank)[:5].tolist()}); name them or drop those genes"
        )


def gene_names_of(adata: ad.AnnData) -> pd.Index:
    """Gene symbols: var['gene_name'] when present (GEARS's files), else var_names."""
    if "gene_name" in adata.var:
        return pd.Index(adata.var["gene_name"].astype(str).values)
    return pd.Index(adata.var_names.astype(str))
