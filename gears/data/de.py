"""Differentially expressed genes per condition (scanpy t-test vs control) and GEARS's dropout sets."""

from __future__ import annotations

import warnings

import anndata as ad
import numpy as np
import pandas as pd
import scanpy as sc
import scipy.sparse as sp

from gears.data.conditions import CTRL

# Keys written into `adata.uns` (GEARS's names; keyed by canonical condition, not `condition_name`).
RANK_KEY = "rank_genes_groups_cov_all"  # condition -> all gene ids (var_names), most DE first
TOP_NON_DROPOUT_KEY = "top_non_dropout_de_20"  # condition -> 20 gene ids, DE-ranked, non-dropout
TOP_NON_ZERO_KEY = "top_non_zero_de_20"  # condition -> 20 gene ids, DE-ranked, non-zero mean
NON_DROPOUT_KEY = "non_dropout_gene_idx"  # condition -> int gene indices (non-zero or zero in ctrl)
NON_ZERO_KEY = "non_zeros_gene_idx"  # condition -> int gene indices with non-zero mean
DE_KEYS = (RANK_KEY, TOP_NON_DROPOUT_KEY, TOP_NON_ZERO_KEY, NON_DROPOUT_KEY, NON_ZERO_KEY)


def condition_means(X, codes: np.ndarray, n_groups: int) -> np.ndarray:
    """Mean row of X per group via one sparse indicator product. X [cells, genes] -> [groups, genes]."""
    n = codes.shape[0]
    indicator = sp.csr_matrix((np.ones(n, np.float64), (codes, np.arange(n))), shape=(n_groups, n))
    sums = indicator @ X
    sums = sums.toarray() if sp.issparse(sums) else np.asarray(sums)
    counts = np.bincount(codes, minlength=n_groups).astype(np.float64)
    return sums / np.maximum(counts, 1)[:, None]


def first_k_where(ranked_idx: np.ndarray, keep: np.ndarray, k: int) -> np.ndarray:
    """Per row, the first k entries of `ranked_idx` whose `keep` flag is set, -1 padded.

    ranked_idx [rows, genes] int, keep [rows, genes] bool aligned with ranked_idx -> [rows, k].
    """
    # A stable argsort of ~keep moves kept entries to the front in rank order.
    order = np.argsort(~keep, axis=1, kind="stable")[:, :k]
    out = np.take_along_axis(ranked_idx, order, axis=1)
    valid = np.take_along_axis(keep, order, axis=1)
    return np.where(valid, out, -1)


def compute_de(adata: ad.AnnData, n_top: int = 20) -> dict[str, dict[str, np.ndarray]]:
    """DE ranking of every perturbed condition against `ctrl`, plus GEARS's dropout gene sets.

    Uses scanpy's t-test with `rankby_abs=True` (as GEARS). Expects canonical `obs['condition']`
    and log-normalised X. Returns the `.uns` entries named in DE_KEYS (the caller stores them).
    """
    conditions = np.asarray(adata.obs["condition"].astype(str))
    groups = sorted(set(conditions) - {CTRL})
    var_names = np.asarray(adata.var_names)
    # A light AnnData sharing X, so scanpy's writes never touch the caller's object.
    light = ad.AnnData(X=adata.X, obs={"condition": conditions}, var={"_": np.zeros(len(var_names))})
    light.var_names = var_names
    light.obs["condition"] = light.obs["condition"].astype("category")
    with warnings.catch_warnings():  # scanpy's own pandas fragmentation warnings
        warnings.simplefilter("ignore", pd.errors.PerformanceWarning)
        sc.tl.rank_genes_groups(
            light,
            groupby="condition",
            groups=groups,
            reference=CTRL,
            rankby_abs=True,
            n_genes=len(var_names),
            use_raw=False,
            method="t-test",
        )
    names = light.uns["rank_genes_groups"]["names"]
    ranked_ids = {g: np.asarray(names[g]).astype(str) for g in groups}

    all_conds = [CTRL, *groups]
    codes = np.searchsorted(np.array(all_conds[1:]), conditions) + 1  # groups are sorted
    codes[conditions == CTRL] = 0
    means = condition_means(adata.X, codes, len(all_conds))
    non_zero = means != 0
    non_dropout = non_zero | (~non_zero & ~non_zero[0][None, :])

    gene_index = pd.Index(var_names)
    ranked_idx = np.stack([gene_index.get_indexer(ranked_ids[c]) for c in groups]).astype(np.int64)
    rows = np.arange(1, len(all_conds))[:, None]
    top_nd = first_k_where(ranked_idx, non_dropout[rows, ranked_idx], n_top)
    top_nz = first_k_where(ranked_idx, non_zero[rows, ranked_idx], n_top)

    def ids(idx_row: np.ndarray) -> np.ndarray:
        return var_names[idx_row[idx_row >= 0]].astype(str)

    return {
        RANK_KEY: ranked_ids,
        TOP_NON_DROPOUT_KEY: {c: ids(top_nd[i]) for i, c in enumerate(groups)},
        TOP_NON_ZERO_KEY: {c: ids(top_nz[i]) for i, c in enumerate(groups)},
        NON_DROPOUT_KEY: {c: np.flatnonzero(non_dropout[i + 1]) for i, c in enumerate(groups)},
        NON_ZERO_KEY: {c: np.flatnonzero(non_zero[i + 1]) for i, c in enumerate(groups)},
    }
