"""The embedded default dataset: a seeded, offline simulated Perturb-seq screen with ground truth.

Model (everything vectorised with numpy, deterministic from `seed` via `np.random.default_rng`):

1. Genes `SG0001`... are split into `n_modules` equal modules (random membership). A quarter of
   each module are regulators (90% activators r_i = +1, else repressors r_i = -1); half of a
   module's genes form its core program, hit by each of its regulators with probability 0.9
   (periphery 0.04), with sign r_i * s_j (s_j = +1 or -1: the target's direction in the program),
   so perturbing genes of one module moves the same program. A few hub regulators and rare random
   edges (0.1%) reach non-regulator genes of other modules. Regulator -> regulator edges follow a
   random order, so the graph is acyclic; each target's incoming |weight| sums to at most 1.2.
   `grn[i, j]` is the weight of regulator i on target j.
2. A single perturbation clamps the perturbed gene's log-fold change (lfc) at its direct effect
   d ~ +U(1.5, 3) for `crispra` or -U(1.5, 3) for `crispri`; the others follow the steady state of
   x_j = sum_i grn[i, j] * 2 tanh(x_i / 2) (saturating regulation; synchronous updates reach it
   exactly because the graph is acyclic). Non-perturbed lfc are finally soft-capped, 3 tanh(x / 3).
   Perturbed genes are spread over modules: activators first, then repressors, then targets, so
   the singles of a module correlate (~0.6 on the downstream profile at the defaults; ~0 across
   modules) without being identical.
3. A double combines its two (uncapped) single profiles a, b by a declared interaction type:
   additive a + b; synergistic (1.6..2)(a + b); suppressive (0.25..0.5)(a + b); epistatic = the
   dominant single alone; neomorphic a + b + the propagated effect of a new direct hit on one or two
   regulators neither single reaches. Both perturbed genes keep their direct effects.
4. Counts: per-gene baseline abundances p_g (log-normal, sigma 1.6; CRISPRi targets drawn from the
   upper half, CRISPRa targets from the middle half), per-cell library sizes
   L ~ LogNormal(log(8 * n_genes), 0.35), counts ~ NB (gamma-Poisson) with mean
   L p_g exp(lfc_g + l_g a_m) and per-gene dispersion phi_g ~ U(0.05, 0.45); then normalised to 1e4
   counts per cell and log1p. Low-abundance genes are zero in most cells (real dropout).
   a_m ~ N(0, 0.5^2), drawn per cell, is the activity of module m's program (the cell-to-cell
   variation of real cells: cycle, stress, state); l_g (`program_loading`) is +-U(0.9, 1.3) for
   regulators and core genes, in their program direction s_j, and +-U(0, 0.4) for the periphery;
   a clamped perturbed gene ignores it. Genes of a module thus co-vary in every condition, and
   GEARS's co-expression graph (|r| > 0.4) links expressed genes within modules.
5. `true_means[c]` = E[log1p(1e4 n_g / (n_g + R))] (R: the other genes' counts) is computed
   analytically, not by Monte-Carlo: the gene's log-rate shift t = log-library deviation + l_g a
   (Gaussian) by 7-node Gauss-Hermite quadrature; log R given t as a Gaussian to second order (its
   mean and variance from the other genes' NB and program (co)variances, moving with t through the
   library and the gene's own module); the NB expectation by an exact pmf sum for means < 50 and,
   above, a log-gamma grid integral with a second-order Poisson term. At the defaults it matches
   60,000-cell Monte-Carlo means to within their sampling error; with 4 modules of 25 genes (one
   module a quarter of the library, so third-order terms show) the bias is ~0.1 SE of 3,000-cell
   means on average and ~0.2 SE for the most expressed genes.
6. GO-style annotations: each gene takes each of its module's 4 terms with probability 0.6, a
   regulator's own regulon term is shared by 40% of its targets, and every gene gets 0-1 of 5 broad
   terms and 1+ random noise terms, so GO Jaccard between genes tracks the similarity of their
   perturbation effects (what GEARS's GO graph needs to generalise to unseen genes).
"""

from __future__ import annotations

import gzip
import os
from dataclasses import dataclass
from math import comb
from pathlib import Path

import anndata
import numpy as np
import pandas as pd
import scipy.sparse as sp
from scipy.special import gammaln

from gears.data.conditions import CTRL
from gears.errors import GearsInputError
from gears.io import write_h5ad

INTERACTION_TYPES = ("additive", "synergistic", "suppressive", "epistatic", "neomorphic")
MODES = ("crispra", "crispri")
TARGET_SUM = 1e4

_REGULATOR_FRACTION = 0.25
_ACTIVATOR_FRACTION = 0.9
_CORE_FRACTION = 0.5  # share of a module's genes in its core program
_P_CORE, _P_PERIPHERY = 0.9, 0.04  # chance a regulator hits a core / peripheral gene of its module
_P_HUB = 0.08  # chance a hub regulator hits a gene of another module
_P_CROSS = 0.001  # background cross-module edges
_MAX_IN_WEIGHT = 1.2  # cap on sum_i |grn[i, j]|, which bounds |lfc| at 1.2 * _INNER_CAP
_INNER_CAP = 2.0  # saturation of a regulator's influence, 2 tanh(x / 2)
_OUTER_CAP = 3.0  # final soft cap of downstream lfc
_PROGRAM_SD = 0.5  # sd of a module's program activity across cells (log scale)
_CORE_LOADING, _PERIPHERY_LOADING = (0.9, 1.3), (0.0, 0.4)  # |loading| ranges on the program
_TERMS_PER_MODULE = 4
_N_BROAD_TERMS = 5
_LIB_SIGMA = 0.35
_COUNTS_PER_GENE = 8.0  # median library size = 8 * n_genes
_EXACT_SUM_BELOW = 50.0  # NB mean below which E[log1p] is an exact pmf sum
_HERMITE_NODES = 7
_SERIES_TERMS = 24  # terms of the exp series in program covariances (exact while s2 l^2 <= 1)
_LOGGAMMA_GRID = 160


@dataclass
class SyntheticScreen:
    """A simulated screen and its ground truth.

    adata: X [cells, genes] CSR float32, log1p of counts normalised to 1e4 per cell;
        obs['condition'] canonical (`ctrl`, `A+ctrl`, `A+B`), obs['cell_type'] = 'synthetic';
        var_names and var['gene_name'] = gene symbols.
    gene2go: gene symbol -> GO-style term ids, for every gene.
    true_means: condition -> expected log-normalised mean profile [genes] (includes `ctrl`).
    interaction_types: double condition -> one of INTERACTION_TYPES.
    grn: [genes, genes] signed weights, row regulator -> column target.
    gene_module: [genes] module index of each gene (the structure GO terms and effects share).
    program_loading: [genes] loading of each gene on its module's cell-to-cell program activity
        (a gene's log expression moves by loading * activity; same-module genes co-vary).
    """

    adata: anndata.AnnData
    gene2go: dict[str, set[str]]
    true_means: dict[str, np.ndarray]
    interaction_types: dict[str, str]
    grn: np.ndarray
    gene_module: np.ndarray
    program_loading: np.ndarray


def _check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise GearsInputError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise GearsInputError(f"{name} must be {bound}, got {value}")
    return int(value)


def _validate(
    n_genes, n_single, n_double, cells_per_condition, n_control_cells, n_modules, mode, seed
):
    _check_int("n_genes", n_genes, 2)
    _check_int("n_modules", n_modules, 1)
    if n_modules > n_genes // 2:
        raise GearsInputError(
            f"n_modules={n_modules} leaves fewer than 2 genes per module for n_genes={n_genes}; "
            f"use n_modules <= {n_genes // 2}"
        )
    _check_int("n_single", n_single, 1)
    if n_single > n_genes:
        raise GearsInputError(
            f"n_single={n_single} exceeds n_genes={n_genes}: perturbable genes are measured genes; "
            "lower n_single or raise n_genes"
        )
    _check_int("n_double", n_double, 0)
    n_pairs = comb(n_single, 2)
    if n_double > n_pairs:
        raise GearsInputError(
            f"n_double={n_double} exceeds the {n_pairs} pairs of {n_single} single genes "
            "(every double combines two singles); lower n_double or raise n_single"
        )
    _check_int("cells_per_condition", cells_per_condition, 1)
    _check_int("n_control_cells", n_control_cells, 1)
    _check_int("seed", seed, 0)
    if mode not in MODES:
        raise GearsInputError(f"mode must be one of {MODES}, got {mode!r}")
    _check_size(n_genes, n_control_cells + (n_single + n_double) * cells_per_condition)


def _physical_memory() -> int | None:
    """Bytes of RAM of this machine, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _check_size(n_genes: int, n_cells: int) -> None:
    """Refuse a screen that cannot fit: the simulation holds a few dense float64 [cells, genes]
    arrays and the [genes, genes] network at once (about 5 and 3 copies), so `n_cells=1e20`
    is one error line instead of an overflow or a 7-TB allocation."""
    need = 8 * (5 * n_cells * n_genes + 3 * n_genes * n_genes)  # Python ints: no overflow
    memory = _physical_memory()
    if need > min(memory or 2**63, 2**63):
        have = f"this machine's {memory / 1e9:,.0f} GB" if memory else "any machine's memory"
        raise GearsInputError(
            f"the synthetic screen would simulate {n_cells:,} cells x {n_genes:,} genes, "
            f"about {need / 1e9:,.0f} GB while simulating, more than {have}; lower "
            "n_control_cells, cells_per_condition, n_single, n_double or n_genes"
        )


def _gene_names(n_genes: int) -> np.ndarray:
    width = max(4, len(str(n_genes)))
    return np.array([f"SG{i:0{width}d}" for i in range(1, n_genes + 1)], dtype=object)


def _rank_within(groups: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Rank of each item among items of its group, ordered by `keys` (ascending). -> [items]"""
    order = np.lexsort((keys, groups))
    sorted_groups = groups[order]
    starts = np.flatnonzero(np.r_[True, sorted_groups[1:] != sorted_groups[:-1]])
    first = np.repeat(starts, np.diff(np.r_[starts, len(order)]))
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order)) - first
    return rank


def _build_network(rng: np.random.Generator, n_genes: int, n_modules: int):
    """Modules, regulators, signed acyclic GRN, program loadings.

    -> (module [G], regulator_sign [G] (+1 activator, -1 repressor, 0 other), grn [G, G],
    loading [G])
    """
    module = np.empty(n_genes, dtype=np.int64)
    module[rng.permutation(n_genes)] = np.arange(n_genes) % n_modules
    # Regulators: the first quarter of each module in a random order (at least one per module);
    # that order also orients regulator -> regulator edges, which keeps the graph acyclic.
    rank = _rank_within(module, rng.random(n_genes))
    module_size = np.bincount(module, minlength=n_modules)
    n_reg = np.maximum(1, np.round(_REGULATOR_FRACTION * module_size)).astype(np.int64)
    is_regulator = rank < n_reg[module]

    reg_sign = np.where(rng.random(n_genes) < _ACTIVATOR_FRACTION, 1.0, -1.0)
    # The module program: regulators are "on" in it; a target goes up (+1) or down (-1).
    program_sign = np.where(is_regulator | (rng.random(n_genes) < 0.7), 1.0, -1.0)
    is_core = rng.random(n_genes) < _CORE_FRACTION
    p_hit = np.where(is_core, _P_CORE, _P_PERIPHERY) * np.where(is_regulator, 0.5, 1.0)
    same_module = module[:, None] == module[None, :]
    forward = ~is_regulator[None, :] | (rank[:, None] < rank[None, :])
    within = same_module & forward & (rng.random((n_genes, n_genes)) < p_hit[None, :])

    n_hubs = max(1, n_modules // 4)
    hub_rows = np.zeros(n_genes, dtype=bool)
    hub_rows[rng.choice(np.flatnonzero(is_regulator), size=n_hubs, replace=False)] = True
    outside = ~same_module & ~is_regulator[None, :]
    hub_edges = outside & hub_rows[:, None] & (rng.random((n_genes, n_genes)) < _P_HUB)
    cross = outside & (rng.random((n_genes, n_genes)) < _P_CROSS)
    random_sign = np.where(rng.random((n_genes, n_genes)) < 0.5, 1.0, -1.0)

    grn = np.where(within, reg_sign[:, None] * program_sign[None, :], 0.0)
    grn = np.where(hub_edges | cross, random_sign, grn)
    grn *= rng.uniform(0.5, 1.0, size=(n_genes, n_genes)) * is_regulator[:, None]
    in_weight = np.abs(grn).sum(axis=0)
    grn *= np.minimum(1.0, _MAX_IN_WEIGHT / np.maximum(in_weight, 1e-12))[None, :]
    # Loadings on the module's cell-to-cell program activity, in the direction the program moves
    # each gene: regulators and core genes follow it closely, the periphery loosely.
    strength = np.where(
        is_regulator | is_core,
        rng.uniform(*_CORE_LOADING, size=n_genes),
        rng.uniform(*_PERIPHERY_LOADING, size=n_genes),
    )
    return module, reg_sign * is_regulator, grn, program_sign * strength


def _propagate(direct: np.ndarray, clamped: np.ndarray, grn: np.ndarray) -> np.ndarray:
    """Uncapped steady-state lfc; `clamped` entries stay at `direct`. [n, G] -> [n, G]

    The graph is acyclic, so synchronous updates reach the steady state exactly after at most
    (longest regulator chain + 1) steps.
    """
    x = direct.copy()
    for _ in range(grn.shape[0] + 1):
        new = np.where(clamped, direct, (_INNER_CAP * np.tanh(x / _INNER_CAP)) @ grn)
        if np.array_equal(new, x):
            break
        x = new
    return x


def _choose_perturbable(rng, module, regulator_sign, n_single) -> np.ndarray:
    """Perturbable genes spread evenly over modules, regulators first. -> [n_single] gene indices"""
    n_genes = len(module)
    # Within a module: activators, then repressors (whose effects run against their module's
    # program), then targets, random order inside each; across modules: round-robin (all rank-0
    # genes, then rank-1 genes, ...), modules in a random order.
    priority = np.select([regulator_sign > 0, regulator_sign < 0], [2.0, 1.0], 0.0)
    within_rank = _rank_within(module, rng.random(n_genes) - priority)
    module_order = rng.permutation(module.max() + 1)[module]
    order = np.lexsort((module_order, within_rank))
    return order[:n_single]


def _combine_doubles(rng, single_x, pair_rows, pair_genes, types, direct_single, grn, is_regulator):
    """Double profiles from singles by interaction type.

    single_x [S, G] uncapped single lfc; pair_rows [D, 2] rows of single_x; pair_genes [D, 2] gene
    indices. -> ([D, G] uncapped lfc, [D, G] clamped mask)
    """
    n_double, n_genes = len(pair_rows), single_x.shape[1]
    a, b = single_x[pair_rows[:, 0]], single_x[pair_rows[:, 1]]
    rows = np.arange(n_double)[:, None]
    scale = np.ones(n_double)
    is_syn, is_sup = types == "synergistic", types == "suppressive"
    scale[is_syn] = rng.uniform(1.6, 2.0, size=is_syn.sum())
    scale[is_sup] = rng.uniform(0.25, 0.5, size=is_sup.sum())
    x = scale[:, None] * (a + b)

    is_epi = types == "epistatic"
    a_dominates = rng.random(n_double) < 0.5
    x[is_epi] = np.where(a_dominates[is_epi, None], a[is_epi], b[is_epi])

    # Neomorphic: a new direct hit on 1-2 regulators that neither single reaches.
    is_neo = np.flatnonzero(types == "neomorphic")
    if len(is_neo):
        untouched = (np.abs(a[is_neo]) + np.abs(b[is_neo]) < 0.05) & is_regulator[None, :]
        untouched[~untouched.any(axis=1)] = True  # fall back to any gene
        key = np.where(untouched, rng.random(untouched.shape), np.inf)
        picks = np.argsort(key, axis=1)[:, :2]
        n_hits = rng.integers(1, 3, size=len(is_neo))
        new_direct = np.zeros((len(is_neo), n_genes))
        hit_sign = np.where(rng.random((len(is_neo), 2)) < 0.5, 1.0, -1.0)
        hit_value = hit_sign * rng.uniform(1.0, 2.0, size=(len(is_neo), 2))
        hit_value[:, 1] *= n_hits == 2
        new_direct[np.arange(len(is_neo))[:, None], picks] = hit_value
        x[is_neo] += _propagate(new_direct, new_direct != 0, grn)

    clamped = np.zeros((n_double, n_genes), dtype=bool)
    clamped[rows, pair_genes] = True
    x[rows, pair_genes] = direct_single[pair_genes]
    return x, clamped


def _log_gamma_grid(shape: np.ndarray):
    """Grid over u = log G, G ~ Gamma(shape, 1/shape), and its normalised weights. -> [n, K] each"""
    k = shape[:, None]
    # The log-gamma density is smooth and decays doubly-exponentially on the right and like
    # exp(k u) on the left, so a uniform grid with plain sums converges fast.
    lo = (np.log(1e-12) + gammaln(k + 1)) / k - np.log(k)
    hi = np.log(1.0 + 40.0 / k)
    u = lo + (hi - lo) * np.linspace(0.0, 1.0, _LOGGAMMA_GRID)[None, :]
    log_density = k * np.log(k) + k * u - k * np.exp(u) - gammaln(k)
    w = np.exp(log_density - log_density.max(axis=1, keepdims=True))
    return u, w / w.sum(axis=1, keepdims=True)


def _log1p_normalised(n, rest, rest_var):
    """log1p(1e4 n / (n + R)), log R = log(rest) + e, Var(e) = rest_var, to 2nd order in e."""
    # d^2/de^2 of log((1 + 1e4) n + R) - log(n + R) is q (1 - q) - p (1 - p) with p = R / (n + R)
    # and q = R / ((1 + 1e4) n + R); written without 1 - p to keep precision when n << R.
    big = (1.0 + TARGET_SUM) * n
    curvature = rest * big / (big + rest) ** 2 - rest * n / (n + rest) ** 2
    return np.log1p(TARGET_SUM * n / (n + rest)) + 0.5 * rest_var * curvature


def _expected_log_normalised(mean, shape, rest, rest_var) -> np.ndarray:
    """E[log1p(1e4 * n / (n + R))] for n ~ NB(mean, shape), elementwise over 1-D arrays.

    R, the counts of the other genes, is log-normal-like around `rest`: log R = log(rest) + e with
    small Var(e) = rest_var. Means below _EXACT_SUM_BELOW: exact pmf sum. Above: the gamma rate
    is integrated on a log grid and the Poisson noise around lambda enters through the second
    derivative in n.
    """
    out = np.empty_like(mean)
    small = mean < _EXACT_SUM_BELOW
    idx = np.flatnonzero(small)
    m, k = mean[idx], shape[idx]
    n_max = np.ceil(m + 8.0 * np.sqrt(m + m * m / k) + 12.0).astype(np.int64)
    # Chunks of similar pmf length, so the many short-tailed entries stay cheap.
    order = np.argsort(n_max, kind="stable")
    for chunk in np.array_split(order, max(1, len(order) // 4096)):
        if not len(chunk):
            continue
        ci = idx[chunk]
        n = np.arange(n_max[chunk].max() + 1, dtype=np.float64)[None, :]
        mc, kc = mean[ci][:, None], shape[ci][:, None]
        # log pmf(n) - log pmf(n - 1) = log((n - 1 + k) / n) + log(m / (m + k)): a cumulative
        # sum costs one log per term instead of three gammaln.
        step = np.log((n[:, 1:] - 1.0 + kc) / n[:, 1:]) + np.log(mc / (mc + kc))
        log_pmf = kc * np.log(kc / (kc + mc)) + np.concatenate(
            [np.zeros((len(ci), 1)), np.cumsum(step, axis=1)], axis=1
        )
        value = _log1p_normalised(n, rest[ci][:, None], rest_var[ci][:, None])
        out[ci] = (np.exp(log_pmf) * value).sum(axis=1)
    idx = np.flatnonzero(~small)
    if len(idx):
        # The grid depends on the shape alone, which is per gene: build it once per shape.
        shapes, which = np.unique(shape[idx], return_inverse=True)
        u, w = _log_gamma_grid(shapes)
        u, w = u[which], w[which]
        lam = mean[idx][:, None] * np.exp(u)
        r = rest[idx][:, None]
        # log1p(1e4 n / (n + r)) = log((1 + 1e4) n + r) - log(n + r); Poisson variance = lambda.
        curvature = (
            1.0 / (lam + r) ** 2 - ((1.0 + TARGET_SUM) / ((1.0 + TARGET_SUM) * lam + r)) ** 2
        )
        value = _log1p_normalised(lam, r, rest_var[idx][:, None]) + 0.5 * lam * curvature
        out[idx] = (w * value).sum(axis=1)
    return out


def _true_means(abundance, lfc, loading, module, dispersion, lib_median) -> np.ndarray:
    """Expected log-normalised means.

    abundance [G], lfc [C, G], loading [C, G] (0 where a gene is clamped), module [G],
    dispersion [G] -> [C, G]

    A cell scales gene g by library * exp(t) with t = log-library deviation + l_g * a (a: the
    activity of g's module), a Gaussian with variance tau2. t is integrated by Gauss-Hermite
    quadrature; log R, the other genes' counts, is Gaussian given t to second order (the library
    and g's own module move it along with t), which the normalisation step integrates.
    """
    s2, lib_var = _PROGRAM_SD**2, _LIB_SIGMA**2
    rel = abundance[None, :] * np.exp(lfc)  # [C, G]
    share = rel * np.exp(0.5 * s2 * loading**2)  # E[rel exp(l a)]
    rest = share.sum(axis=1, keepdims=True) - share  # E[R] / library
    # Relative variance of R given the library: the other genes' gamma noise, and their program
    # terms, which co-vary within a module: Cov(e^(l_i a), e^(l_j a)) = E[e^(l_i a)] E[e^(l_j a)]
    # (exp(s2 l_i l_j) - 1). The sum over j of module(i) is a power series in s2 l_i over the
    # module's moments sum_j l_j^k share_j (no [genes, genes] matrix per condition).
    one_hot = np.eye(module.max() + 1)[module]  # [G, modules]
    cov_share = np.zeros_like(share)  # sum_j Cov(i, j) / E[e^(l_i a)], j in module(i) [C, G]
    power, coef = np.ones_like(loading), np.ones_like(loading)
    for k in range(1, _SERIES_TERMS + 1):
        power = power * loading
        coef = coef * (s2 * loading) / k
        cov_share += coef * ((share * power) @ one_hot)[:, module]
    program_var = (share * cov_share).sum(axis=1, keepdims=True)
    # ... minus what gene g adds itself: 2 Cov(g, all) - Var(g).
    program_own = 2.0 * share * cov_share - share**2 * np.expm1(s2 * loading**2)
    over = dispersion * (rel * np.exp(s2 * loading**2)) ** 2  # E[gamma variance]
    over_rest = over.sum(axis=1, keepdims=True) - over
    rest_rel_var = (over_rest + program_var - program_own) / rest**2
    # Slope of log R on g's own module activity (Stein: Cov(e^(l a), a) = s2 l E[e^(l a)]).
    weighted = share * loading
    slope = ((weighted @ one_hot)[:, module] - weighted) / rest

    tau2 = lib_var + s2 * loading**2  # Var(t)
    cov_t = lib_var + s2 * slope * loading  # Cov(log R, t)
    kappa = cov_t / tau2  # E[log R | t] moves by kappa * t
    nodes, weights = np.polynomial.hermite_e.hermegauss(_HERMITE_NODES)
    weights = weights / weights.sum()
    t = nodes[:, None, None] * np.sqrt(tau2)[None]  # [Q, C, G]
    mean = lib_median * rel * np.exp(t)
    # Poisson part of R's relative variance at the library typical of node t.
    rho = rest_rel_var + 1.0 / (lib_median * rest * np.exp(kappa * t))
    log_rest = np.log(lib_median * rest) - 0.5 * rho + kappa * t
    rest_var = np.maximum(lib_var + rho - kappa * cov_t, 0.0)  # Var(log R | t)
    shape = np.broadcast_to(1.0 / dispersion, mean.shape)
    value = _expected_log_normalised(
        mean.ravel(), shape.ravel(), np.exp(log_rest).ravel(), rest_var.ravel()
    )
    return np.tensordot(weights, value.reshape(mean.shape), axes=1)


def make_synthetic(
    n_genes: int = 400,
    n_single: int = 60,
    n_double: int = 40,
    cells_per_condition: int = 50,
    n_control_cells: int = 1000,
    n_modules: int = 12,
    mode: str = "crispra",
    seed: int = 0,
    keep_counts: bool = False,
    counts_per_gene: float = _COUNTS_PER_GENE,
) -> SyntheticScreen:
    """Simulate a Perturb-seq screen (model in the module docstring); same seed, same screen.

    keep_counts: also keep the raw counts (before normalisation) in adata.layers['counts'].
    counts_per_gene: the median library size over the number of genes (the depth).

    Every double's two genes are among the single-perturbation genes, so GEARS's `simulation`
    split finds combo_seen0/1/2 and unseen_single test conditions.
    """
    _validate(
        n_genes, n_single, n_double, cells_per_condition, n_control_cells, n_modules, mode, seed
    )
    if not (isinstance(counts_per_gene, (int, float)) and 0 < counts_per_gene <= 1e4):
        raise GearsInputError(f"counts_per_gene must be > 0 and <= 1e4, got {counts_per_gene!r}")
    rng = np.random.default_rng(seed)
    genes = _gene_names(n_genes)
    module, regulator_sign, grn, loading = _build_network(rng, n_genes, n_modules)
    is_regulator = regulator_sign != 0

    # Singles.
    pert = _choose_perturbable(rng, module, regulator_sign, n_single)
    sign = 1.0 if mode == "crispra" else -1.0
    direct_single = np.zeros(n_genes)
    direct_single[pert] = sign * rng.uniform(1.5, 3.0, size=n_single)
    single_clamped = np.zeros((n_single, n_genes), dtype=bool)
    single_clamped[np.arange(n_single), pert] = True
    single_direct = np.where(single_clamped, direct_single[None, :], 0.0)
    single_x = _propagate(single_direct, single_clamped, grn)

    # Doubles: distinct unordered pairs of singles; interaction types balanced, then shuffled.
    rows, cols = np.triu_indices(n_single, k=1)
    chosen = np.sort(rng.choice(len(rows), size=n_double, replace=False))
    pair_rows = np.stack([rows[chosen], cols[chosen]], axis=1).reshape(n_double, 2)
    pair_genes = pert[pair_rows]
    types = rng.permutation(np.resize(np.array(INTERACTION_TYPES), n_double))
    double_x, double_clamped = _combine_doubles(
        rng, single_x, pair_rows, pair_genes, types, direct_single, grn, is_regulator
    )

    # lfc of every condition: ctrl, singles, doubles. [C, G]
    x = np.concatenate([np.zeros((1, n_genes)), single_x, double_x])
    clamped = np.concatenate([np.zeros((1, n_genes), dtype=bool), single_clamped, double_clamped])
    lfc = np.where(clamped, x, _OUTER_CAP * np.tanh(x / _OUTER_CAP))
    double_names = ["+".join(sorted(genes[p])) for p in pair_genes]
    conditions = [CTRL] + [f"{g}+{CTRL}" for g in genes[pert]] + double_names

    # Baseline abundances, sorted high to low. CRISPRi targets come from the upper half so that a
    # knock-down is visible; CRISPRa targets from the middle half: a 5-20x activation of a top gene
    # would swamp the library (shifting every other gene after normalisation), and one of a
    # nearly silent gene would stay invisible.
    log_abundance = np.sort(rng.normal(0.0, 1.6, size=n_genes))[::-1]
    window = max(n_single, n_genes // 2)
    lo = 0 if mode == "crispri" else min(n_genes // 4, n_genes - window)
    hi = lo + window
    top_pick = lo + rng.choice(hi - lo, size=n_single, replace=False)
    other_ranks = np.setdiff1d(np.arange(n_genes), top_pick)
    others = np.setdiff1d(np.arange(n_genes), pert)
    gene_log_abundance = np.empty(n_genes)
    gene_log_abundance[pert] = log_abundance[top_pick]
    gene_log_abundance[others] = log_abundance[rng.permutation(other_ranks)]
    abundance = np.exp(gene_log_abundance - gene_log_abundance.max())
    abundance /= abundance.sum()
    dispersion = rng.uniform(0.05, 0.45, size=n_genes)
    lib_median = counts_per_gene * n_genes

    # Cells: condition codes in a shuffled order, library sizes, module program activities (a
    # clamped gene ignores its program), gamma-Poisson counts.
    n_per = np.r_[n_control_cells, np.full(len(conditions) - 1, cells_per_condition)]
    cell_condition = rng.permutation(np.repeat(np.arange(len(conditions)), n_per))
    n_cells = len(cell_condition)
    library = lib_median * np.exp(_LIB_SIGMA * rng.standard_normal(n_cells))
    activity = _PROGRAM_SD * rng.standard_normal((n_cells, n_modules))
    condition_loading = np.where(clamped, 0.0, loading[None, :])  # [C, G]
    cell_lfc = lfc[cell_condition] + condition_loading[cell_condition] * activity[:, module]
    cell_mean = library[:, None] * abundance[None, :] * np.exp(cell_lfc)
    shape = 1.0 / dispersion
    counts = rng.poisson(rng.gamma(shape[None, :], cell_mean / shape[None, :]))
    totals = counts.sum(axis=1, keepdims=True)
    norm = counts * (TARGET_SUM / np.maximum(totals, 1))
    X = sp.csr_matrix(np.log1p(norm).astype(np.float32))

    obs = pd.DataFrame(
        {
            "condition": pd.Categorical.from_codes(cell_condition, categories=conditions),
            "cell_type": pd.Categorical(np.full(len(cell_condition), "synthetic")),
        },
        index=pd.Index([f"cell{i:06d}" for i in range(len(cell_condition))]),
    )
    var = pd.DataFrame({"gene_name": genes.astype(str)}, index=pd.Index(genes.astype(str)))
    adata = anndata.AnnData(X=X, obs=obs, var=var)
    if keep_counts:
        adata.layers["counts"] = sp.csr_matrix(counts.astype(np.float32))

    means = _true_means(abundance, lfc, condition_loading, module, dispersion, lib_median)
    return SyntheticScreen(
        adata=adata,
        gene2go=_go_annotations(rng, genes, module, grn, n_modules),
        true_means={c: means[i] for i, c in enumerate(conditions)},
        interaction_types=dict(zip(double_names, types.tolist())),
        grn=grn,
        gene_module=module,
        program_loading=loading,
    )


def _go_annotations(rng, genes, module, grn, n_modules) -> dict[str, set[str]]:
    """GO-style terms per gene: module terms, regulon terms, broad and noise terms."""
    n_genes = len(genes)
    # Term columns: [module terms | regulon terms (one per gene) | broad terms | noise terms].
    n_module_terms = n_modules * _TERMS_PER_MODULE
    n_noise = 2 * n_genes
    n_terms = n_module_terms + n_genes + _N_BROAD_TERMS + n_noise
    has = np.zeros((n_genes, n_terms), dtype=bool)

    own = module[:, None] * _TERMS_PER_MODULE + np.arange(_TERMS_PER_MODULE)[None, :]
    take = rng.random(own.shape) < 0.6
    take[np.arange(n_genes), rng.integers(0, _TERMS_PER_MODULE, n_genes)] |= ~take.any(axis=1)
    has[np.arange(n_genes)[:, None], own] = take

    # A regulator's regulon term, shared by some of its targets.
    regulon = n_module_terms + np.arange(n_genes)
    is_regulator = (grn != 0).any(axis=1)
    shared = (grn != 0) & (rng.random(grn.shape) < 0.4)  # [regulator, target]
    has[:, regulon] = shared.T
    has[is_regulator, regulon[is_regulator]] = True

    broad = n_module_terms + n_genes + np.arange(_N_BROAD_TERMS)
    has[:, broad] = rng.random((n_genes, _N_BROAD_TERMS)) < 0.15
    noise_start = n_module_terms + n_genes + _N_BROAD_TERMS
    n_noise_per_gene = 1 + rng.poisson(1.0, size=n_genes)
    noise_gene = np.repeat(np.arange(n_genes), n_noise_per_gene)
    has[noise_gene, noise_start + rng.integers(0, n_noise, size=len(noise_gene))] = True

    # Term ids in a shuffled order, so an id says nothing about the kind of term.
    ids = np.array([f"GO:{i:07d}" for i in 1 + rng.permutation(n_terms)], dtype=object)
    gene_idx, term_idx = np.nonzero(has)
    splits = np.split(ids[term_idx], np.flatnonzero(np.diff(gene_idx)) + 1)
    return {str(genes[g]): set(t) for g, t in zip(np.unique(gene_idx), splits)}


def write_gene2go_tsv(
    gene2go: dict[str, set[str]], path: str | Path, compress: bool | None = None
) -> Path:
    """Write `gene2go` as `SYMBOL<TAB>GO:1,GO:2` lines (gzip when `path` ends in .gz, or as
    `compress` says: a temp file's name does not end in .gz).

    The first line is the header `gene_symbol<TAB>go_ids`, as in the shared gene2go_human.tsv.gz,
    so one reader serves both. Genes and terms are sorted and the gzip header carries no time
    stamp: the same mapping always gives the same bytes.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["gene_symbol\tgo_ids"]
    lines += [f"{gene}\t{','.join(sorted(terms))}" for gene, terms in sorted(gene2go.items())]
    data = ("\n".join(lines) + "\n").encode()
    if path.suffix == ".gz" if compress is None else compress:
        with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
            gz.write(data)
    else:
        path.write_bytes(data)
    return path


VCC_CONTROL = "non-targeting"


def vcc_targets(condition: pd.Series) -> np.ndarray:
    """GEARS conditions ('G+ctrl', 'ctrl') as the challenge's target_gene ('G', VCC_CONTROL)."""
    # A numpy str array: pandas 3's string dtype (a StringArray) has no np.char loops.
    condition = np.asarray(condition.astype(str), dtype=str)
    return np.where(condition == CTRL, VCC_CONTROL, np.char.replace(condition, f"+{CTRL}", ""))


def make_vcc_layout(
    n_genes: int = 200,
    n_perturbations: int = 30,
    cells_per_perturbation: int = 40,
    n_control_cells: int = 300,
    n_modules: int = 6,
    n_batches: int = 4,
    seed: int = 0,
) -> tuple[anndata.AnnData, dict[str, set[str]]]:
    """A small CRISPRi screen laid out like the Virtual Cell Challenge's adata_Training.h5ad.

    Layout (the challenge's data page): X [cells, genes] CSR float32 raw UMI counts;
    obs['target_gene'] the bare symbol of the knocked-down gene or 'non-targeting',
    obs['guide_id'] (two guides per gene), obs['batch']; var_names gene symbols,
    var['gene_id'] Ensembl-style ids; singles only. Returns (adata, gene -> GO terms).
    """
    screen = make_synthetic(
        n_genes=n_genes,
        n_single=n_perturbations,
        n_double=0,
        cells_per_condition=cells_per_perturbation,
        n_control_cells=n_control_cells,
        n_modules=n_modules,
        mode="crispri",
        seed=seed,
        keep_counts=True,
    )
    src = screen.adata
    target = vcc_targets(src.obs["condition"])
    rng = np.random.default_rng(seed + 1)
    guide = np.char.add(
        np.char.add(target.astype(str), "_guide"), (1 + rng.integers(0, 2, len(target))).astype(str)
    )
    batch = np.char.add("batch", rng.integers(0, n_batches, len(target)).astype(str))
    obs = pd.DataFrame(
        {
            "target_gene": pd.Categorical(target),
            "guide_id": pd.Categorical(guide),
            "batch": pd.Categorical(batch),
        },
        index=pd.Index([f"{name}-{b}" for name, b in zip(src.obs_names, batch)]),
    )
    genes = src.var_names.astype(str)
    var = pd.DataFrame(
        {"gene_id": [f"ENSG{900000 + i:011d}" for i in range(len(genes))]},
        index=pd.Index(genes),
    )
    return anndata.AnnData(X=src.layers["counts"], obs=obs, var=var), screen.gene2go


def write_pert_counts(adata: anndata.AnnData, path: str | Path, perturbations=None) -> Path:
    """The challenge's pert_counts CSV (target_gene,n_cells,median_umi_per_cell) for a
    VCC-layout AnnData of raw counts, restricted to `perturbations` when given."""
    target = adata.obs["target_gene"].astype(str).values
    umis = np.asarray(adata.X.sum(axis=1)).ravel()
    frame = (
        pd.DataFrame({"target_gene": target, "umi": umis})
        .query("target_gene != @VCC_CONTROL")
        .groupby("target_gene", sort=True)["umi"]
        .agg(n_cells="size", median_umi_per_cell="median")
        .reset_index()
    )
    if perturbations is not None:
        frame = frame[frame["target_gene"].isin(list(perturbations))]
    path = Path(path)
    frame.to_csv(path, index=False)
    return path


def write_vcc_example(
    folder: str | Path, validation_fraction: float = 1 / 3, seed: int = 0, **layout
) -> dict[str, Path]:
    """A synthetic stand-in for the challenge's files in `folder`: adata_Training.h5ad (half the
    control cells and the training perturbations), adata_Validation.h5ad (the other control cells
    and the held-out perturbations: the real answers), pert_counts_Validation.csv (its cell
    counts, the challenge's request format) and gene2go.tsv. layout: make_vcc_layout arguments."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    adata, gene2go = make_vcc_layout(seed=seed, **layout)
    target = adata.obs["target_gene"].astype(str).values
    perts = np.array(sorted(set(target) - {VCC_CONTROL}))
    rng = np.random.default_rng(seed + 2)
    n_val = max(1, int(round(len(perts) * validation_fraction)))
    held_out = set(rng.choice(perts, size=n_val, replace=False).tolist())
    is_ctrl = target == VCC_CONTROL
    ctrl_half = np.zeros(len(target), dtype=bool)
    ctrl_rows = np.flatnonzero(is_ctrl)
    ctrl_half[rng.permutation(ctrl_rows)[: len(ctrl_rows) // 2]] = True
    in_val = np.isin(target, sorted(held_out)) | (is_ctrl & ctrl_half)
    paths = {
        "training": folder / "adata_Training.h5ad",
        "validation": folder / "adata_Validation.h5ad",
        "counts": folder / "pert_counts_Validation.csv",
        "gene2go": folder / "gene2go.tsv",
    }
    write_h5ad(adata[~in_val], paths["training"])
    validation = adata[in_val].copy()
    write_h5ad(validation, paths["validation"])
    write_pert_counts(validation, paths["counts"])
    write_gene2go_tsv(gene2go, paths["gene2go"])
    return paths


VCC2026_CONTEXTS = ("lineA", "lineB")


def make_vcc2026_layout(
    n_genes: int = 200,
    n_perturbations: int = 30,
    cells_per_perturbation: int = 40,
    n_control_cells: int = 300,
    contexts: tuple[str, ...] = VCC2026_CONTEXTS,
    n_modules: int = 6,
    seed: int = 0,
    counts_per_gene: float = 40.0,
) -> tuple[anndata.AnnData, dict[str, set[str]]]:
    """A small CRISPRi screen laid out as the Virtual Cell Challenge 2026 describes its files:
    X [cells, genes] CSR float32 raw UMI counts, obs['target'] the bare symbol of the
    knocked-down gene or 'non-targeting', obs['cell_line'] the context, var_names symbols.

    Every context holds the same panel (cells_per_perturbation cells of each perturbation and
    n_control_cells controls per context): one simulated screen whose cells are dealt to the
    contexts, each context then given its own baseline (every gene's counts thinned by a
    factor drawn from [0.4, 1]) and depth (library sizes thinned by a factor from [0.5, 1]),
    so contexts differ the way cell lines differ while the perturbations act alike.
    counts_per_gene: depth before thinning (median library size / genes; the 2025 layout's 8
    gives a few hundred counts a cell at 60 genes, too shallow for cell-eval2's noise-corrected
    expression members on a small panel). Returns (adata, gene -> GO terms)."""
    k = len(contexts)
    if k < 1 or len(set(contexts)) != k:
        raise GearsInputError(f"contexts must be distinct names, got {contexts}")
    screen = make_synthetic(
        n_genes=n_genes,
        n_single=n_perturbations,
        n_double=0,
        cells_per_condition=cells_per_perturbation * k,
        n_control_cells=n_control_cells * k,
        n_modules=n_modules,
        mode="crispri",
        seed=seed,
        keep_counts=True,
        counts_per_gene=counts_per_gene,
    )
    src = screen.adata
    target = vcc_targets(src.obs["condition"])
    rng = np.random.default_rng(seed + 7)
    context = np.empty(len(target), dtype=object)
    for label in np.unique(target):  # each context gets an equal share of every perturbation
        rows = rng.permutation(np.flatnonzero(target == label))
        context[rows] = np.resize(np.array(contexts, dtype=object), len(rows))
    counts = sp.csr_matrix(src.layers["counts"], dtype=np.float64)
    gene_factor = rng.uniform(0.4, 1.0, size=(k, n_genes))  # each context's baseline
    depth = rng.uniform(0.5, 1.0, size=k)  # and its sequencing depth
    cell_code = pd.Index(contexts).get_indexer(context)
    entry_code = cell_code[np.repeat(np.arange(counts.shape[0]), np.diff(counts.indptr))]
    keep = gene_factor[entry_code, counts.indices] * depth[entry_code]
    counts.data = rng.binomial(counts.data.astype(np.int64), keep).astype(np.float64)
    counts.eliminate_zeros()
    obs = pd.DataFrame(
        {
            "target": pd.Categorical(target),
            "cell_line": pd.Categorical(context.astype(str), categories=list(contexts)),
        },
        index=pd.Index([f"{name}-{c}" for name, c in zip(src.obs_names, context)]),
    )
    genes = src.var_names.astype(str)
    return (
        anndata.AnnData(
            X=sp.csr_matrix(counts, dtype=np.float32), obs=obs, var=pd.DataFrame(index=genes)
        ),
        screen.gene2go,
    )


def write_vcc2026_example(
    folder: str | Path, validation_fraction: float = 1 / 3, seed: int = 0, **layout
) -> dict[str, Path]:
    """A synthetic stand-in for the 2026 challenge's files in `folder`: adata_Training.h5ad
    (every context's control cells but a third, and the training perturbations),
    adata_Validation_<context>.h5ad per context (the other control cells and the held-out
    perturbations' real cells: the answers, one file per context as cell-eval2 scores them),
    pert_counts_Validation.csv (cell_line,target,n_cells,median_umi_per_cell: the request) and
    gene2go.tsv. layout: make_vcc2026_layout arguments."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    adata, gene2go = make_vcc2026_layout(seed=seed, **layout)
    target = adata.obs["target"].astype(str).values
    context = adata.obs["cell_line"].astype(str).values
    perts = np.array(sorted(set(target) - {VCC_CONTROL}))
    rng = np.random.default_rng(seed + 2)
    n_val = max(1, int(round(len(perts) * validation_fraction)))
    held_out = sorted(rng.choice(perts, size=n_val, replace=False).tolist())
    is_ctrl = target == VCC_CONTROL
    val_ctrl = np.zeros(len(target), dtype=bool)
    ctrl_rows = np.flatnonzero(is_ctrl)
    val_ctrl[rng.permutation(ctrl_rows)[: len(ctrl_rows) // 3]] = True
    in_val = np.isin(target, held_out) | val_ctrl
    paths = {
        "training": folder / "adata_Training.h5ad",
        "counts": folder / "pert_counts_Validation.csv",
        "gene2go": folder / "gene2go.tsv",
    }
    write_h5ad(adata[~in_val], paths["training"])
    validation = adata[in_val].copy()
    umis = np.asarray(validation.X.sum(axis=1)).ravel()
    rows = []
    for name in adata.obs["cell_line"].cat.categories:
        mine = context[in_val] == name
        paths[f"validation_{name}"] = folder / f"adata_Validation_{name}.h5ad"
        write_h5ad(validation[mine], paths[f"validation_{name}"])
        frame = pd.DataFrame({"target": target[in_val][mine], "umi": umis[mine]})
        frame = frame[frame["target"] != VCC_CONTROL]
        per = frame.groupby("target", sort=True)["umi"].agg(["size", "median"]).reset_index()
        for _, row in per.iterrows():
            rows.append([name, row["target"], int(row["size"]), float(row["median"])])
    pd.DataFrame(rows, columns=["cell_line", "target", "n_cells", "median_umi_per_cell"]).to_csv(
        paths["counts"], index=False
    )
    write_gene2go_tsv(gene2go, paths["gene2go"])
    return paths
