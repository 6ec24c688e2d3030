"""Tests for gears/data/synthetic.py: the seeded simulated screen and its ground truth."""

from __future__ import annotations

import gzip
import re
import time

import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

from gears.data.synthetic import (
    INTERACTION_TYPES,
    VCC_CONTROL,
    SyntheticScreen,
    make_synthetic,
    vcc_targets,
    write_gene2go_tsv,
)
from gears.errors import GearsInputError

SMALL = dict(n_genes=120, n_single=16, n_double=12, cells_per_condition=20, n_control_cells=100)


@pytest.fixture(scope="module")
def timed_default() -> tuple[SyntheticScreen, float]:
    # CPU seconds of this process, not wall time: a loaded CI machine stretches wall time
    # several-fold, while an accidental O(cells^2) step would still show here (~1.6 s when written).
    start = time.process_time()
    screen = make_synthetic()
    return screen, time.process_time() - start


@pytest.fixture(scope="module")
def screen(timed_default) -> SyntheticScreen:
    return timed_default[0]


@pytest.fixture(scope="module")
def screen_i() -> SyntheticScreen:
    return make_synthetic(mode="crispri")


def _gene_index(screen: SyntheticScreen) -> dict[str, int]:
    return {g: i for i, g in enumerate(screen.adata.var_names)}


def _singles(screen: SyntheticScreen) -> list[str]:
    return [c for c in screen.true_means if c.endswith("+ctrl")]


def _empirical_means(screen: SyntheticScreen) -> dict[str, np.ndarray]:
    X = screen.adata.X.toarray()
    cond = screen.adata.obs["condition"].astype(str).to_numpy()
    return {c: X[cond == c].mean(axis=0) for c in np.unique(cond)}


def _jaccard(gene2go: dict[str, set[str]], genes: list[str]) -> np.ndarray:
    """[genes, genes] Jaccard of term sets, via a binary gene x term matrix."""
    terms = sorted(set().union(*gene2go.values()))
    col = {t: j for j, t in enumerate(terms)}
    rows = [i for i, g in enumerate(genes) for _ in gene2go[g]]
    cols = [col[t] for g in genes for t in gene2go[g]]
    M = sp.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(len(genes), len(terms)))
    inter = (M @ M.T).toarray()
    size = np.asarray(M.sum(axis=1)).ravel()
    return inter / (size[:, None] + size[None, :] - inter)


# --- determinism and layout -------------------------------------------------------------------


def test_same_seed_same_screen_and_different_seed_differs():
    a, b, c = make_synthetic(**SMALL), make_synthetic(**SMALL), make_synthetic(**SMALL, seed=1)
    assert (a.adata.X != b.adata.X).nnz == 0
    assert a.adata.obs.equals(b.adata.obs) and a.adata.var.equals(b.adata.var)
    assert a.gene2go == b.gene2go and a.interaction_types == b.interaction_types
    assert np.array_equal(a.grn, b.grn) and np.array_equal(a.gene_module, b.gene_module)
    assert np.array_equal(a.program_loading, b.program_loading)
    assert a.true_means.keys() == b.true_means.keys()
    assert all(np.array_equal(a.true_means[k], b.true_means[k]) for k in a.true_means)

    assert a.adata.X.shape == c.adata.X.shape
    assert (a.adata.X != c.adata.X).nnz > 0
    assert not np.array_equal(a.grn, c.grn)
    assert a.gene2go != c.gene2go
    assert not np.allclose(a.true_means["ctrl"], c.true_means["ctrl"])


def test_shapes_condition_spellings_and_counts(screen):
    ad = screen.adata
    n_conditions = 1 + 60 + 40
    assert ad.shape == (1000 + 50 * (60 + 40), 400)
    assert list(ad.var_names) == [f"SG{i:04d}" for i in range(1, 401)]
    assert list(ad.var["gene_name"]) == list(ad.var_names)
    assert ad.obs_names.is_unique
    assert set(ad.obs["cell_type"]) == {"synthetic"}

    counts = ad.obs["condition"].astype(str).value_counts()
    assert len(counts) == n_conditions and counts["ctrl"] == 1000
    assert (counts.drop("ctrl") == 50).all()
    singles = [c for c in counts.index if c.endswith("+ctrl")]
    doubles = [c for c in counts.index if c != "ctrl" and not c.endswith("+ctrl")]
    assert len(singles) == 60 and len(doubles) == 40
    single_genes = {c.split("+")[0] for c in singles}
    assert single_genes <= set(ad.var_names)
    for d in doubles:
        a, b = d.split("+")
        assert a < b and {a, b} <= single_genes  # sorted, both genes perturbed alone too
    assert set(screen.true_means) == set(counts.index)
    assert all(v.shape == (400,) for v in screen.true_means.values())
    assert set(screen.interaction_types) == set(doubles)
    # Five types cycled over 40 doubles: eight of each.
    kinds = list(screen.interaction_types.values())
    assert {t: kinds.count(t) for t in INTERACTION_TYPES} == dict.fromkeys(INTERACTION_TYPES, 8)
    assert screen.grn.shape == (400, 400) and screen.gene_module.shape == (400,)
    assert screen.program_loading.shape == (400,)
    assert set(screen.gene_module) == set(range(12))


def test_x_is_csr_float32_log1p_normalised(screen):
    X = screen.adata.X
    assert sp.isspmatrix_csr(X) and X.dtype == np.float32
    assert np.isfinite(X.data).all() and X.data.min() >= 0.0
    totals = np.asarray(np.expm1(X.astype(np.float64)).sum(axis=1)).ravel()
    np.testing.assert_allclose(totals, 1e4, rtol=1e-4)
    # Real dropout: many zeros, and some genes are zero in most control cells.
    dense = X.toarray()
    assert 0.1 < (dense == 0).mean() < 0.6
    ctrl = screen.adata.obs["condition"].to_numpy() == "ctrl"
    assert ((dense[ctrl] == 0).mean(axis=0) > 0.5).sum() >= 20


def test_gene2go_covers_every_gene_with_go_style_ids(screen):
    assert set(screen.gene2go) == set(screen.adata.var_names)
    pattern = re.compile(r"^GO:\d{7}$")
    assert all(len(t) >= 1 and all(pattern.match(x) for x in t) for t in screen.gene2go.values())


def test_grn_is_acyclic_signed_and_bounded(screen):
    W = screen.grn
    assert np.all(np.diag(W) == 0) and (W > 0).any() and (W < 0).any()
    assert np.abs(W).sum(axis=0).max() <= 1.2 + 1e-9
    # Acyclic <=> the adjacency matrix is nilpotent: all walks of length n_genes vanish.
    reach = (W != 0).astype(np.float64)
    power = reach.copy()
    for _ in range(9):  # 2^9 = 512 > 400 genes
        power = np.minimum(power @ power, 1.0)
    assert not power.any()
    # Mostly within-module edges.
    rows, cols = np.nonzero(W)
    same = screen.gene_module[rows] == screen.gene_module[cols]
    assert same.mean() > 0.7


# --- biology of the effects -------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["crispra", "crispri"])
def test_perturbed_gene_moves_in_the_right_direction(screen, screen_i, mode):
    s = screen if mode == "crispra" else screen_i
    sign = 1.0 if mode == "crispra" else -1.0
    idx = _gene_index(s)
    ctrl = s.true_means["ctrl"]
    emp = _empirical_means(s)
    for cond in s.true_means:
        for gene in [g for g in cond.split("+") if g != "ctrl"]:
            g = idx[gene]
            assert sign * (s.true_means[cond][g] - ctrl[g]) > 0.8, (cond, gene)
            assert sign * (emp[cond][g] - emp["ctrl"][g]) > 0.4, (cond, gene)


def test_effects_follow_the_regulatory_edges(screen):
    """A perturbed regulator's strong direct targets move with the sign of the edge."""
    idx = _gene_index(screen)
    ctrl = screen.true_means["ctrl"]
    agree, total = 0, 0
    for cond in _singles(screen):
        w = screen.grn[idx[cond.split("+")[0]]]
        strong = np.abs(w) > 0.2
        delta = screen.true_means[cond] - ctrl
        agree += int((np.sign(delta[strong]) == np.sign(w[strong])).sum())
        total += int(strong.sum())
    assert total > 100 and agree / total > 0.95


def _double_stats(screen: SyntheticScreen, double: str):
    """Changes versus control, the two perturbed genes left out. -> (d_a, d_b, d_ab) [genes - 2]"""
    idx = _gene_index(screen)
    a, b = double.split("+")
    keep = np.ones(len(idx), dtype=bool)
    keep[[idx[a], idx[b]]] = False
    ctrl = screen.true_means["ctrl"]
    return tuple((screen.true_means[c] - ctrl)[keep] for c in (f"{a}+ctrl", f"{b}+ctrl", double))


@pytest.mark.parametrize("mode", ["crispra", "crispri"])
def test_doubles_match_their_declared_interaction_type(screen, screen_i, mode):
    s = screen if mode == "crispra" else screen_i
    unexplained_additive, unexplained_neo = [], []
    for double, kind in s.interaction_types.items():
        da, db, dab = _double_stats(s, double)
        total = da + db
        ratio = np.linalg.norm(dab) / np.linalg.norm(total)
        fit = np.stack([da, db], axis=1)
        coef = np.linalg.lstsq(fit, dab, rcond=None)[0]
        unexplained = np.sum((dab - fit @ coef) ** 2) / np.sum(dab**2)
        if kind == "additive":
            assert 0.95 < ratio < 1.05 and np.corrcoef(dab, total)[0, 1] > 0.99, double
            unexplained_additive.append(unexplained)
        elif kind == "synergistic":
            assert ratio > 1.3 and np.corrcoef(dab, total)[0, 1] > 0.95, double
        elif kind == "suppressive":
            assert ratio < 0.85, double
        elif kind == "epistatic":
            closest = min(np.linalg.norm(dab - da), np.linalg.norm(dab - db))
            assert closest / np.linalg.norm(dab) < 0.35, double
        else:
            assert kind == "neomorphic"
            unexplained_neo.append(unexplained)
    # Neomorphic doubles change genes neither single explains; additive ones do not.
    assert max(unexplained_additive) < 0.01 < 0.05 < min(unexplained_neo)


def test_go_jaccard_is_higher_within_modules(screen):
    genes = list(screen.adata.var_names)
    J = _jaccard(screen.gene2go, genes)
    module = screen.gene_module
    same = module[:, None] == module[None, :]
    off_diagonal = ~np.eye(len(genes), dtype=bool)
    within, between = J[same & off_diagonal].mean(), J[~same].mean()
    assert within > 0.1 and within > 5 * between
    # GEARS keeps GO edges with Jaccard > 0.1: these should mostly join genes of one module.
    edges = (J > 0.1) & off_diagonal
    assert same[edges].mean() > 0.8


def test_effects_correlate_within_modules_and_with_go_similarity(screen):
    idx = _gene_index(screen)
    singles = _singles(screen)
    genes = np.array([idx[c.split("+")[0]] for c in singles])
    deltas = np.stack([screen.true_means[c] - screen.true_means["ctrl"] for c in singles])
    deltas[np.arange(len(genes)), genes] = 0.0  # the perturbed gene itself says nothing
    corr = np.corrcoef(deltas)
    module = screen.gene_module[genes]
    same = module[:, None] == module[None, :]
    off_diagonal = ~np.eye(len(genes), dtype=bool)
    within, between = corr[same & off_diagonal], corr[~same]
    # Singles of one module move its program together, but not identically.
    assert 0.5 < within.mean() < 0.8 and abs(between.mean()) < 0.05
    assert within.std() > 0.1 and (within < 0.9).mean() > 0.5
    J = _jaccard(screen.gene2go, list(screen.adata.var_names))[np.ix_(genes, genes)]
    assert np.corrcoef(J[off_diagonal], corr[off_diagonal])[0, 1] > 0.4


def test_module_programs_make_genes_of_a_module_coexpressed(screen):
    """Cells vary in each module's program activity a ~ N(0, 0.5^2), shared by its genes.

    For well-expressed genes log1p(normalised count) ~ log(count) + const, so across control cells
    Cov(x_i, x_j) ~ l_i l_j Var(a) = 0.25 l_i l_j for genes of one module and ~0 across modules.
    """
    X = screen.adata.X.toarray().astype(np.float64)
    ctrl = X[screen.adata.obs["condition"].to_numpy() == "ctrl"]
    loading, module = screen.program_loading, screen.gene_module
    same = module[:, None] == module[None, :]
    off_diagonal = ~np.eye(len(module), dtype=bool)
    core = np.abs(loading) >= 0.9
    assert 0.5 < core.mean() < 0.75 and (loading[core] > 0).mean() > 0.6

    top = np.argsort(-screen.true_means["ctrl"])[:60]
    cov = np.cov(ctrl[:, top].T)
    product = np.outer(loading[top], loading[top])
    pairs = (same & off_diagonal)[np.ix_(top, top)]
    slope = (product[pairs] @ cov[pairs]) / (product[pairs] @ product[pairs])
    assert 0.2 < slope < 0.28 and np.corrcoef(product[pairs], cov[pairs])[0, 1] > 0.9
    assert abs(cov[~same[np.ix_(top, top)]].mean()) < 0.02

    # GEARS's co-expression graph keeps |Pearson r| > 0.4: several edges per expressed core gene,
    # all within a module, with the sign of l_i l_j.
    r = np.corrcoef(ctrl.T)
    edges = (np.abs(r) > 0.4) & off_diagonal
    assert edges.sum() > 300 and same[edges].mean() > 0.98
    assert (np.sign(r[edges]) == np.sign(np.outer(loading, loading)[edges])).mean() > 0.98
    expressed_core = np.argsort(-screen.true_means["ctrl"])[:80]
    expressed_core = expressed_core[core[expressed_core]]
    assert np.median(edges[expressed_core].sum(axis=1)) >= 3


# --- ground truth -----------------------------------------------------------------------------


def test_empirical_means_approach_true_means():
    """With 3,000 cells per condition the error is sampling noise: z-scores have unit scale."""
    s = make_synthetic(
        n_genes=100,
        n_single=3,
        n_double=1,
        cells_per_condition=3000,
        n_control_cells=3000,
        n_modules=4,
        seed=2,
    )
    X = s.adata.X.toarray().astype(np.float64)
    cond = s.adata.obs["condition"].astype(str).to_numpy()
    for c, truth in s.true_means.items():
        cells = X[cond == c]
        se = cells.std(axis=0, ddof=1) / np.sqrt(len(cells))
        ok = se > 0
        z = (cells.mean(axis=0) - truth)[ok] / se[ok]
        assert 0.7 < np.sqrt(np.mean(z**2)) < 1.3, c
        assert abs(z.mean()) < 0.6 and np.abs(z).max() < 5.0, c
        # The test has power: log of the mean (instead of mean of the log) is far off.
        naive = np.log1p(np.expm1(cells).mean(axis=0))
        assert np.sqrt(np.mean(((cells.mean(axis=0) - naive)[ok] / se[ok]) ** 2)) > 3.0


def test_default_screen_means_match_truth(screen):
    emp = _empirical_means(screen)
    np.testing.assert_allclose(emp["ctrl"], screen.true_means["ctrl"], atol=0.12)
    errors = np.stack([emp[c] - screen.true_means[c] for c in screen.true_means])
    assert np.abs(errors).mean() < 0.12 and abs(errors.mean()) < 0.01


# --- arguments, files, speed ------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(n_genes=10, n_single=11, n_modules=2), "n_single"),
        (dict(n_genes=20, n_single=5, n_double=11, n_modules=2), "n_double"),
        (dict(mode="crispr"), "mode"),
        (dict(n_genes=0), "n_genes"),
        (dict(n_genes=30.0), "n_genes"),
        (dict(cells_per_condition=0), "cells_per_condition"),
        (dict(n_control_cells=-5), "n_control_cells"),
        (dict(n_modules=300), "n_modules"),
        (dict(seed=-1), "seed"),
        (dict(seed=True), "seed"),
    ],
)
def test_bad_arguments_raise(kwargs, fragment):
    with pytest.raises(GearsInputError, match=fragment):
        make_synthetic(**kwargs)


def test_edge_sizes_work():
    s = make_synthetic(n_genes=10, n_single=10, n_double=45, n_modules=5, cells_per_condition=2)
    assert len(s.interaction_types) == 45  # every pair of singles
    s = make_synthetic(n_genes=4, n_single=1, n_double=0, n_modules=2, cells_per_condition=3)
    conditions = set(s.adata.obs["condition"].astype(str))
    assert len(conditions) == 2 and "ctrl" in conditions and s.interaction_types == {}
    assert set(s.true_means) == conditions


@pytest.mark.parametrize("name", ["gene2go.tsv", "sub/gene2go.tsv.gz"])
def test_write_gene2go_tsv_round_trip(tmp_path, name):
    gene2go = {"SG0002": {"GO:0000003", "GO:0000001"}, "SG0001": {"GO:0000002"}}
    path = write_gene2go_tsv(gene2go, tmp_path / name)
    assert path == tmp_path / name
    opener = gzip.open if name.endswith(".gz") else open
    with opener(path, "rt") as fh:
        lines = fh.read().splitlines()
    assert lines == [
        "gene_symbol\tgo_ids",
        "SG0001\tGO:0000002",
        "SG0002\tGO:0000001,GO:0000003",
    ]
    first = path.read_bytes()
    write_gene2go_tsv(gene2go, path)
    assert path.read_bytes() == first  # no time stamp in the gzip header


def test_default_call_is_fast(timed_default):
    assert timed_default[1] < 8.0


@pytest.mark.parametrize("dtype", [object, "category", pd.StringDtype()])
def test_vcc_targets_from_any_string_column(dtype):
    """pandas 3 reads strings as its own string dtype, whose arrays numpy's np.char refuses."""
    condition = pd.Series(["B+ctrl", "ctrl", "A+ctrl"], dtype=dtype)
    assert list(vcc_targets(condition)) == ["B", VCC_CONTROL, "A"]
