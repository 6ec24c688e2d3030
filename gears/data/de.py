"""Differentially expressed genes per condition (t-test vs control) and GEARS's dropout sets."""

from __future__ import annotations

import contextlib
import warnings
from typing import NamedTuple

import anndata as ad
import numpy as np
import pandas as pd
import scipy.sparse as sp
import torch

from gears.data.conditions import CTRL, canonicalize_conditions, control_like_genes
from gears.data.validate import gene_names_of
from gears.errors import GearsInputError

# Keys written into `adata.uns` (GEARS's names; keyed by canonical condition, not `condition_name`).
RANK_KEY = "rank_genes_groups_cov_all"  # condition -> all gene ids (var_names), most DE first
TOP_NON_DROPOUT_KEY = "top_non_dropout_de_20"  # condition -> 20 gene ids, DE-ranked, non-dropout
TOP_NON_ZERO_KEY = "top_non_zero_de_20"  # condition -> 20 gene ids, DE-ranked, non-zero mean
NON_DROPOUT_KEY = "non_dropout_gene_idx"  # condition -> int gene indices (non-zero or zero in ctrl)
NON_ZERO_KEY = "non_zeros_gene_idx"  # condition -> int gene indices with non-zero mean
DE_KEYS = (RANK_KEY, TOP_NON_DROPOUT_KEY, TOP_NON_ZERO_KEY, NON_DROPOUT_KEY, NON_ZERO_KEY)
N_DE = 20  # GEARS's "top-20 DE genes"
N_DE_RANKED = 200  # longest DE list the metrics use (top-200 variants)


@contextlib.contextmanager
def torch_threads_kept():
    """Give torch back its intra-op thread count on exit. scanpy's numba t-test starts numba's
    OpenMP layer, which sets the libgomp pool torch shares to NUMBA_NUM_THREADS (every logical
    core, whatever OMP_NUM_THREADS said): a run that computes DE would then train at another
    thread count, so with another float summation order, than one that loads it processed
    (a resumed run on a real dataset)."""
    before = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def condition_means(X, codes: np.ndarray, n_groups: int) -> np.ndarray:
    """Mean row of X per group via one sparse indicator product. X [cells, genes] -> [groups, G]."""
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
    import scanpy as sc  # here, not at import: the streamed path never needs it

    conditions = np.asarray(adata.obs["condition"].astype(str))
    groups = sorted(set(conditions) - {CTRL})
    var_names = np.asarray(adata.var_names)
    # A light AnnData sharing X, so scanpy's writes never touch the caller's object.
    light = ad.AnnData(
        X=adata.X, obs={"condition": conditions}, var={"_": np.zeros(len(var_names))}
    )
    light.var_names = var_names
    light.obs["condition"] = light.obs["condition"].astype("category")
    # scanpy's own pandas fragmentation warnings; torch's thread count as it was
    with warnings.catch_warnings(), torch_threads_kept():
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
    gene_index = pd.Index(var_names)
    ranked_idx = np.stack([gene_index.get_indexer(ranked_ids[c]) for c in groups]).astype(np.int64)
    return de_tables(groups, ranked_idx, means, var_names, n_top)


def de_tables(
    groups: list[str],
    ranked_idx: np.ndarray,
    means: np.ndarray,
    var_names: np.ndarray,
    n_top: int = 20,
) -> dict[str, dict[str, np.ndarray]]:
    """The DE_KEYS entries from a ranking and the condition means.

    groups: the perturbed conditions, sorted; ranked_idx [groups, genes] gene indices, most DE
    first; means [1 + groups, genes] with the control mean in row 0.
    """
    var_names = np.asarray(var_names)
    non_zero = means != 0
    non_dropout = non_zero | (~non_zero & ~non_zero[0][None, :])
    rows = np.arange(1, len(groups) + 1)[:, None]
    top_nd = first_k_where(ranked_idx, non_dropout[rows, ranked_idx], n_top)
    top_nz = first_k_where(ranked_idx, non_zero[rows, ranked_idx], n_top)

    def ids(idx_row: np.ndarray) -> np.ndarray:
        return var_names[idx_row[idx_row >= 0]].astype(str)

    return {
        RANK_KEY: {c: var_names[ranked_idx[i]].astype(str) for i, c in enumerate(groups)},
        TOP_NON_DROPOUT_KEY: {c: ids(top_nd[i]) for i, c in enumerate(groups)},
        TOP_NON_ZERO_KEY: {c: ids(top_nz[i]) for i, c in enumerate(groups)},
        NON_DROPOUT_KEY: {c: np.flatnonzero(non_dropout[i + 1]) for i, c in enumerate(groups)},
        NON_ZERO_KEY: {c: np.flatnonzero(non_zero[i + 1]) for i, c in enumerate(groups)},
    }


def scanpy_aggregates() -> bool:
    """Whether the installed scanpy's t-test takes each group's mean and variance from
    scanpy.get.aggregate (1.12 on: Welford's running update, stream.RunningMoments) rather
    than from E[x] and E[x^2] (up to 1.11: welch_scores). The two round differently, and the
    rankings part from about rank 100 on a real screen: the streamed DE follows the one a user
    has, without importing scanpy."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    try:
        return Version(version("scanpy")) >= Version("1.12")
    except PackageNotFoundError:
        return False


def welch_scores(
    sums: np.ndarray, sumsq: np.ndarray, counts: np.ndarray, reference: int = 0
) -> np.ndarray:
    """Welch t statistics of every group against `reference`, from per-group sufficient statistics.

    sums, sumsq [groups, genes] float64 (sums of x and of float32 x*x), counts [groups] ->
    [groups, genes] float64 (the reference row is 0). The arithmetic follows scanpy 1.11's
    `rank_genes_groups(method="t-test")`: mean and E[x^2] per group, variance
    (E[x^2] - mean^2) * n / (n - 1), then welch_from_moments.
    """
    counts = np.asarray(counts, dtype=np.float64)[:, None]
    means = sums / counts
    var = sumsq / counts - means**2
    var *= np.where(counts != 1, counts / np.maximum(counts - 1, 1), 1.0)
    return welch_from_moments(means, var, counts[:, 0], reference)


def welch_from_moments(
    means: np.ndarray, var: np.ndarray, counts: np.ndarray, reference: int = 0
) -> np.ndarray:
    """Welch t statistics of every group against `reference` from means and variances [groups,
    genes] (n - 1 in the denominator) -> [groups, genes] float64, the reference row 0: scipy's
    ttest_ind_from_stats as scanpy calls it, t = (mean - mean_ref) / sqrt(var/n + var_ref/n_ref)
    with std = sqrt(var) squared back, and NaN (equal means, zero variances) set to 0.
    """
    counts = np.asarray(counts, dtype=np.float64)[:, None]
    # scipy's ttest_ind_from_stats takes std = sqrt(var): a negative rounding residue gives NaN.
    with np.errstate(invalid="ignore", divide="ignore"):
        std = np.sqrt(var)
        denom = np.sqrt(std**2 / counts + std[reference] ** 2 / counts[reference])
        scores = (means - means[reference]) / denom
    scores[np.isnan(scores)] = 0
    scores[reference] = 0
    return scores


def rank_by_abs_score(scores: np.ndarray) -> np.ndarray:
    """Gene indices by decreasing |score| -> [genes], ties broken as scanpy's `_select_top_n`.

    scanpy ranks with argpartition then an (unstable) argsort of the partition, reversed; the
    same calls give the same order for equal scores, so the result is gene-for-gene scanpy's.
    """
    key = np.abs(scores)
    n = key.shape[0]
    partition = np.argpartition(key, -n)[-n:]
    return partition[np.argsort(key[partition])[::-1]]


def de_from_stats(
    conditions: list[str],
    sums: np.ndarray,
    sumsq: np.ndarray,
    counts: np.ndarray,
    var_names: np.ndarray,
    n_top: int = 20,
    n_ranked: int | None = None,
    moments=None,
) -> dict[str, dict[str, np.ndarray]]:
    """`compute_de` from per-condition sums and sums of squares (a streamed pass over the cells).

    conditions [C] with `ctrl` first, then the perturbed conditions sorted; sums, sumsq
    [C, genes] float64; counts [C]. n_ranked: keep only this many genes of each full ranking
    (RANK_KEY), None = all. moments: the pass's stream.RunningMoments, which scanpy >= 1.12
    needs (stream_condition_stats(moments=scanpy_aggregates())). Equals the installed scanpy's
    t-test ranking gene for gene, on the same matrix (dense or sparse): welch_scores for
    scanpy <= 1.11, welch_from_moments of the running moments for 1.12 on.
    """
    if conditions[0] != CTRL or list(conditions[1:]) != sorted(conditions[1:]):
        raise ValueError("conditions must be ctrl first, then the perturbed ones sorted")
    if moments is not None:
        scores = welch_from_moments(*moments.mean_var(counts), counts, reference=0)
    elif scanpy_aggregates():
        raise ValueError("scanpy >= 1.12 ranks from running moments: pass the pass's moments")
    else:
        scores = welch_scores(sums, sumsq, counts, reference=0)
    ranked_idx = np.stack([rank_by_abs_score(scores[i]) for i in range(1, len(conditions))])
    means = sums / np.maximum(np.asarray(counts, np.float64), 1)[:, None]
    tables = de_tables(list(conditions[1:]), ranked_idx, means, var_names, n_top)
    if n_ranked is not None:
        tables[RANK_KEY] = {c: v[:n_ranked] for c, v in tables[RANK_KEY].items()}
    return tables


def translate_de_keys(uns: dict, adata: ad.AnnData, condition_key: str) -> dict:
    """DE results shipped in a file's `.uns`, keyed by condition. GEARS's own files key them by
    `condition_name` and list var_names (Ensembl ids): re-key them and map the ids to symbols."""
    if "condition_name" in adata.obs:
        canon = canonicalize_conditions(
            adata.obs[condition_key].values, genes=control_like_genes(gene_names_of(adata))
        )
        name_to_cond = dict(zip(adata.obs["condition_name"].astype(str), canon))
    else:
        name_to_cond = {}
    id_to_symbol = pd.Series(gene_names_of(adata), index=adata.var_names.astype(str))
    out = {}
    for key in DE_KEYS:
        out[key] = {}
        for k, v in uns[key].items():
            v = np.asarray(v)
            if v.dtype.kind in "OUS":
                v = id_to_symbol.reindex(v.astype(str)).fillna("").values.astype(str)
            out[key][name_to_cond.get(k, k)] = v
    return out


class DEIndex(NamedTuple):
    """DE results as index tables over gene_names; -1 pads."""

    ranked: np.ndarray  # [C, min(200, G)] int64 DE-ranked genes
    non_dropout: np.ndarray  # [C, 20] int64 top non-dropout DE genes
    non_zero_mask: np.ndarray  # [C, G] bool loss mask (ctrl keeps every gene, as GEARS's loss)


def de_index(de: dict, conditions: list[str], gene_names: pd.Index) -> DEIndex:
    """DE dicts (DE_KEYS layout, keyed by condition) -> index tables."""
    C, G = len(conditions), len(gene_names)
    ranked = np.full((C, min(N_DE_RANKED, G)), -1, dtype=np.int64)
    non_dropout = np.full((C, N_DE), -1, dtype=np.int64)
    non_zero_mask = np.ones((C, G), dtype=bool)
    for c, name in enumerate(conditions):
        if name == CTRL:
            continue
        if name not in de[RANK_KEY]:
            raise GearsInputError(
                f"processed file lacks DE genes for condition {name!r}; "
                "re-run new_data_process without skip_calc_de"
            )
        idx = gene_names.get_indexer(np.asarray(de[RANK_KEY][name]).astype(str))
        ranked[c, : min(len(idx), ranked.shape[1])] = idx[: ranked.shape[1]]
        nd = gene_names.get_indexer(np.asarray(de[TOP_NON_DROPOUT_KEY][name]).astype(str))[:N_DE]
        non_dropout[c, : len(nd)] = nd
        non_zero_mask[c] = False
        non_zero_mask[c, np.asarray(de[NON_ZERO_KEY][name], dtype=np.int64)] = True
    return DEIndex(ranked, non_dropout, non_zero_mask)
