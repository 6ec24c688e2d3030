"""Simple reference predictors (no change, training mean, additive, linear) scored beside GEARS.

The `linear` baseline is the model of Ahlmann-Eltze, Huber & Anders (Nat Methods 2025, "Deep-
learning-based gene perturbation effect prediction does not yet outperform simple linear
baselines"), as in their `run_linear_pretrained_model.R` with gene and perturbation embeddings
both taken from a PCA of the training pseudobulk.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from gears.data.conditions import CTRL, condition_genes
from gears.errors import GearsInputError

BASELINES = ("no_change", "train_mean", "additive", "linear")


def baseline_predictions(
    train_means: Mapping[str, np.ndarray],
    ctrl_mean: np.ndarray,
    conditions: Sequence[str],
    gene_names: Sequence[str],
    pca_dim: int = 10,
    ridge: float = 0.1,
) -> dict[str, np.ndarray]:
    """Predicted mean profiles of each baseline for the target conditions.

    train_means: training condition (`A+ctrl` / `A+B`) -> true mean profile [genes]; a `ctrl`
    entry is ignored (ctrl_mean is the control). ctrl_mean: [genes]. conditions: target names in
    canonical spelling. gene_names: [genes] symbols, used to find a perturbed gene's row.
    Returns name -> [conditions, genes] for `no_change`, `train_mean`, `additive` and `linear`.

    `additive` is NaN on rows it cannot form (a single not seen in training, or a double with
    a single missing from training); callers score it only on the rows it covers, e.g. by
    passing those rows alone or by the nan-mean of `gears.train.metrics.summarize`.
    """
    ctrl = np.asarray(ctrl_mean, dtype=np.float64).ravel()
    n_genes = ctrl.size
    if len(gene_names) != n_genes:
        raise GearsInputError(
            f"gene_names has {len(gene_names)} names but ctrl_mean has {n_genes} genes"
        )
    train = {name: _profile(mean, n_genes, name) for name, mean in train_means.items()}
    train.pop(CTRL, None)
    if not train:
        raise GearsInputError(
            "train_means holds no perturbation; the baselines need the mean profile of at "
            "least one training perturbation"
        )
    targets = list(conditions)
    train_names = sorted(train)
    train_matrix = np.stack([train[name] for name in train_names])
    n_targets = len(targets)
    return {
        "no_change": np.tile(ctrl, (n_targets, 1)),
        "train_mean": np.tile(train_matrix.mean(axis=0), (n_targets, 1)),
        "additive": additive_predictions(train, ctrl, targets),
        "linear": linear_predictions(
            train_matrix, train_names, ctrl, targets, gene_names, pca_dim, ridge
        ),
    }


def additive_predictions(
    train: Mapping[str, np.ndarray], ctrl: np.ndarray, conditions: Sequence[str]
) -> np.ndarray:
    """ctrl + sum of the training singles' changes -> [conditions, genes] (NaN where unformable).

    A single seen in training gets its training mean, `ctrl` gets ctrl, a double `A+B` gets
    ctrl + (A - ctrl) + (B - ctrl) from the training singles `A+ctrl` and `B+ctrl`.
    """
    out = np.full((len(conditions), ctrl.size), np.nan)
    for row, condition in enumerate(conditions):
        singles = [f"{gene}+{CTRL}" for gene in condition_genes(condition)]
        if all(single in train for single in singles):
            out[row] = ctrl + sum(train[single] - ctrl for single in singles)
    return out


def linear_predictions(
    train_matrix: np.ndarray,
    train_names: Sequence[str],
    ctrl: np.ndarray,
    conditions: Sequence[str],
    gene_names: Sequence[str],
    pca_dim: int = 10,
    ridge: float = 0.1,
) -> np.ndarray:
    """Ahlmann-Eltze et al.'s linear model -> [conditions, genes].

    train_matrix: [train conditions, genes] mean profiles named by train_names. With Y the
    [genes, conditions] training pseudobulk (control included, as in the authors' script, with
    a zero perturbation embedding), G = the top `pca_dim` principal-component scores of the
    genes (PCA of Y with each condition centred across genes, like R's prcomp), P = rows of G
    of each condition's perturbed genes (summed for a double), b = row means of Y:
        W = (G^T G + ridge I)^-1 G^T (Y - b) P (P^T P + ridge I)^-1,  prediction = G W p^T + b.
    Training doubles join the fit with summed embeddings (the authors' script drops them).
    A target or training condition with a gene not in gene_names gets no embedding: targets fall
    back to b, training conditions are left out of the fit. pca_dim is clipped to the rank the
    data allows.
    """
    gene_row = {name: row for row, name in enumerate(gene_names)}
    y = np.vstack([ctrl[None, :], train_matrix]).T
    names = [CTRL, *train_names]
    n_genes, n_cols = y.shape
    k = max(1, min(int(pca_dim), n_genes, n_cols))
    centred = y - y.mean(axis=0, keepdims=True)
    u, s, _ = np.linalg.svd(centred, full_matrices=False)
    gene_emb = u[:, :k] * s[:k]

    def embedding(condition: str) -> np.ndarray | None:
        genes = condition_genes(condition)
        if any(gene not in gene_row for gene in genes):
            return None
        return gene_emb[[gene_row[gene] for gene in genes]].sum(axis=0)

    train_emb = [embedding(name) for name in names]
    keep = [i for i, emb in enumerate(train_emb) if emb is not None]
    fit_y = y[:, keep]
    perts = np.stack([train_emb[i] for i in keep])
    offset = fit_y.mean(axis=1)
    eye = np.eye(k)
    left = np.linalg.solve(
        gene_emb.T @ gene_emb + ridge * eye, gene_emb.T @ (fit_y - offset[:, None])
    )
    weights = np.linalg.solve(perts.T @ perts + ridge * eye, (left @ perts).T).T

    target_emb = [embedding(name) for name in conditions]
    known = np.array([emb is not None for emb in target_emb], dtype=bool)
    p = np.zeros((len(conditions), k))
    if known.any():
        p[known] = np.stack([emb for emb in target_emb if emb is not None])
    return (gene_emb @ weights @ p.T).T + offset


def _profile(values, n_genes: int, name: str) -> np.ndarray:
    out = np.asarray(values, dtype=np.float64).ravel()
    if out.shape != (n_genes,):
        raise GearsInputError(
            f"train_means[{name!r}] has {out.size} values; expected {n_genes} (one per gene)"
        )
    return out
