"""Per-cell covariates a network may read: obs columns coded against the categories recorded
with a model, and `context`, the column that data.context_key names (e.g. the cell line)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import scipy.sparse as sp

from gears.errors import GearsInputError

CONTEXT = "context"  # the covariate name of data.context_key's column


def covariate_column(name: str, context_key: str | None) -> str:
    """The obs column a covariate reads: data.context_key for `context`, else the name."""
    if name != CONTEXT:
        return name
    if context_key is None:
        raise GearsInputError(
            "the network reads the covariate 'context', but data.context_key is not set: name "
            "the obs column holding each cell's context (e.g. data.context_key=cell_type)"
        )
    return context_key


def obs_values(obs, column: str) -> np.ndarray:
    """obs[column] as strings [cells]; a missing column is an error naming the columns."""
    if column not in obs:
        raise GearsInputError(
            f"the data has no obs column {column!r} (columns: {list(obs.columns)}); name an "
            "existing column (data.context_key, or the covariate names the network declares). "
            "Data processed into a memory-mapped store keeps the condition column only: use "
            "data.store=memory"
        )
    return np.asarray(obs[column].astype(str).values)


def categories_of(values: np.ndarray) -> list[str]:
    """A covariate's categories: its distinct values, sorted (code i = categories[i])."""
    return sorted(set(np.asarray(values, dtype=str).tolist()))


def encode(values, categories: list[str], name: str) -> np.ndarray:
    """values [n] (str) -> codes [n] int64 into categories; a value the model was not trained
    with is an error naming it."""
    values = np.asarray(values, dtype=str)
    codes = pd.Categorical(values, categories=list(categories)).codes.astype(np.int64)
    unknown = sorted(set(values[codes < 0].tolist()))
    if unknown:
        raise GearsInputError(
            f"covariate {name!r}: {unknown[:5]} {'is' if len(unknown) == 1 else 'are'} not among "
            f"the model's categories {categories[:20]}; predict for values it was trained with"
        )
    return codes


def data_categories(pert_data, names: tuple[str, ...]) -> dict[str, list[str]]:
    """The categories of each covariate in a PertData's cells (what a new model records)."""
    key = getattr(pert_data, "context_key", None)
    return {
        n: categories_of(obs_values(pert_data.adata.obs, covariate_column(n, key))) for n in names
    }


def cell_codes(pert_data, categories: dict[str, list[str]]) -> dict[str, np.ndarray]:
    """Each cell row's code [cells] per covariate, against the model's categories."""
    key = getattr(pert_data, "context_key", None)
    return {
        name: encode(obs_values(pert_data.adata.obs, covariate_column(name, key)), cats, name)
        for name, cats in categories.items()
    }


def context_ctrl_means(
    X, cell_context: np.ndarray, ctrl_rows: np.ndarray, contexts: list[str], context_key: str
) -> np.ndarray:
    """Each context's control mean [contexts, genes] float64 from X [cells, genes] (dense or
    CSR) and each cell's context code; a context without control cells is an error (its cells
    are paired with its own controls)."""
    ctrl_context = cell_context[ctrl_rows]
    without = [c for i, c in enumerate(contexts) if not (ctrl_context == i).any()]
    if without:
        raise GearsInputError(
            f"data.context_key={context_key!r}: context(s) {without} have no control cells; "
            "each context's cells are paired with its own controls: drop those contexts "
            "(data.subset) or choose another column"
        )
    indicator = sp.csr_matrix(
        (np.ones(len(ctrl_context)), (ctrl_context, ctrl_rows)),
        shape=(len(contexts), X.shape[0]),
    )
    sums = indicator @ X
    sums = sums.toarray() if sp.issparse(sums) else np.asarray(sums)
    return sums / np.bincount(ctrl_context)[:, None]
