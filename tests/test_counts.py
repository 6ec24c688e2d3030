"""gears/eval/counts.py: the training normalisation inverted, and the counts samplers'
statistics."""

from __future__ import annotations

import numpy as np
import pytest
import scanpy as sc
import scipy.sparse as sp
from anndata import AnnData

from gears.errors import GearsInputError
from gears.eval import counts

# Each check below compares a sample mean with its expectation at Z standard errors: a
# two-sided normal tail of 4e-8 per gene, so over the ~100 genes of a check a correct sampler
# fails once in ~250,000 seeds. The seeds are fixed, so the outcome is fixed too.
Z = 5.5


def _profile(n_genes=60, target=1e4, seed=0):
    """A predicted log-normalised cell whose normalised expression sums to `target`: five
    silent genes, the others at least ~0.1 counts a cell at the depths below (so that a few
    thousand cells give every gene's mean a usable standard error)."""
    rng = np.random.default_rng(seed)
    share = rng.gamma(0.4, 1.0, n_genes) + 0.003
    share[:5] = 0  # silent genes stay silent
    return np.log1p(share / share.sum() * target)


def test_rates_invert_scanpys_normalisation_exactly():
    rng = np.random.default_rng(1)
    raw = rng.poisson(rng.gamma(0.5, 4.0, (50, 80))).astype(np.float32)
    raw[0] = 0
    raw[0, 3] = 7
    work = AnnData(X=sp.csr_matrix(raw))
    sc.pp.normalize_total(work, target_sum=1234.0)
    sc.pp.log1p(work)
    totals = raw.sum(axis=1)
    got = counts.raw_counts(work.X.toarray(), totals, 1234.0)
    np.testing.assert_array_equal(got, raw)
    # Large counts too: a float32 log1p keeps the integer within reach up to ~1e6.
    big = np.array([[250_000.0, 700_000.0, 1.0]], dtype=np.float32)
    x = np.log1p(big / big.sum() * 1e4).astype(np.float32)
    np.testing.assert_array_equal(counts.raw_counts(x, big.sum(1), 1e4), big)


def test_composition_rates_keep_a_cells_composition_at_any_depth():
    rng = np.random.default_rng(11)
    raw = rng.poisson(rng.gamma(0.5, 4.0, (30, 50))).astype(np.float64) + (np.arange(50) == 0)
    library = raw.sum(axis=1)
    x = np.log1p(raw / library[:, None] * 1e4)
    np.testing.assert_allclose(counts.composition_rates(x, library), raw, rtol=1e-9)
    shifted = x + rng.normal(0, 0.5, x.shape).clip(-x)  # a predicted change: no longer sums to 1e4
    rate = counts.composition_rates(shifted, 2 * library)
    np.testing.assert_allclose(rate.sum(axis=1), 2 * library)
    z = np.expm1(shifted)
    np.testing.assert_allclose(rate / rate.sum(1, keepdims=True), z / z.sum(1, keepdims=True))


def _variance(sampler, rate, theta=None):
    if sampler == "poisson":
        return rate
    if sampler == "rounding":
        frac = rate - np.floor(rate)
        return frac * (1 - frac)
    if sampler == "multinomial":
        total = np.rint(rate.sum(axis=1, keepdims=True))
        p = rate / rate.sum(axis=1, keepdims=True)
        return total * p * (1 - p)
    return rate + rate**2 / theta


@pytest.mark.parametrize("sampler", counts.SAMPLERS)
def test_each_sampler_draws_the_rate_on_average(sampler):
    """E[counts] = rate for every sampler: the mean of 4,000 cells of one predicted cell stays
    within Z standard errors of the rate, gene by gene, with each sampler's exact variance."""
    n, library, target = 4000, 3000.0, 1e4
    x = _profile()
    rate = np.repeat(counts.rates(x[None, :], [library], target), n, axis=0)
    theta = np.linspace(0.5, 50, rate.shape[1])
    got = counts.draw_counts(rate, np.random.default_rng(2), sampler, theta)
    assert got.dtype == np.float32 and np.array_equal(got, np.round(got)) and got.min() >= 0
    se = np.sqrt(_variance(sampler, rate, theta)[0] / n)
    err = np.abs(got.mean(axis=0) - rate[0])
    assert (err <= Z * se + 1e-12).all(), (err / np.maximum(se, 1e-12)).max()
    assert (got[:, :5] == 0).all(), "a gene predicted silent is never drawn"


@pytest.mark.parametrize("sampler", ["rounding", "poisson", "multinomial"])
def test_normalised_means_of_sampled_cells_equal_the_prediction(sampler):
    """Cells drawn from a predicted cell, normalised as training normalises them (each scaled
    to the target total), average to the predicted normalised expression expm1(x): within Z
    standard errors (estimated from the 3,000 cells) on every gene. For Poisson the total is
    random, but given it the counts are multinomial, so the ratio is unbiased too."""
    n, library, target = 3000, 2500.0, 1e4
    x = _profile(seed=3)
    rate = np.repeat(counts.rates(x[None, :], [library], target), n, axis=0)
    got = counts.draw_counts(rate, np.random.default_rng(4), sampler).astype(np.float64)
    normalised = got / got.sum(axis=1, keepdims=True) * target
    expected = np.expm1(x)
    se = normalised.std(axis=0, ddof=1) / np.sqrt(n)
    err = np.abs(normalised.mean(axis=0) - expected)
    live = expected > 0
    assert (err[live] <= Z * se[live]).all(), (err[live] / se[live]).max()
    assert (normalised[:, ~live] == 0).all()


def test_rounding_gives_a_real_cell_back_unchanged():
    """A zero change: the rate is the control cell's own counts, and rounding adds nothing."""
    rng = np.random.default_rng(5)
    raw = rng.poisson(3.0, (20, 40)).astype(np.float64)
    library = raw.sum(axis=1)
    x = np.log1p(raw / library[:, None] * 1e4).astype(np.float32)
    rate = counts.rates(x, library, 1e4)
    np.testing.assert_array_equal(counts.draw_counts(rate, rng, "rounding"), raw)


def test_no_cell_above_the_challenges_cap():
    """A cell whose draw exceeds 1e6 counts is downsampled to exactly 1e6 (never dropped, never
    above), its genes in proportion; the others are untouched."""
    rng = np.random.default_rng(6)
    rate = np.full((3, 50), 10.0)
    rate[1] = 40_000.0  # 2e6 expected counts
    got = counts.sample_rows(rate, 0, seed=1, sampler="poisson")
    totals = got.sum(axis=1)
    assert totals[1] == counts.MAX_COUNTS_PER_CELL and (totals <= counts.MAX_COUNTS_PER_CELL).all()
    assert np.abs(got[1] / totals[1] - 1 / 50).max() < 1e-3  # 20,000 each, +- hypergeometric
    assert got[0].sum() < 1000 and got[2].sum() < 1000
    capped = counts.cap_counts(np.array([[3e6, 1e6]]), rng)
    assert capped.sum() == 1e6 and capped[0, 0] > capped[0, 1]


def test_draws_do_not_depend_on_how_rows_are_chunked():
    rate = np.random.default_rng(7).gamma(1.0, 2.0, (700, 30))
    whole = counts.sample_rows(rate, 0, seed=3, sampler="poisson")
    step = counts.ROWS_PER_DRAW
    parts = [counts.sample_rows(rate[i : i + step], i, 3, "poisson") for i in (0, step, 2 * step)]
    np.testing.assert_array_equal(whole, np.vstack(parts))
    with pytest.raises(ValueError, match="multiple"):
        counts.sample_rows(rate[:10], 5, 3, "poisson")


def test_control_dispersion_recovers_the_simulated_one():
    """Method of moments on 6,000 NB cells with unequal library sizes: theta 0.5-20 comes back
    within 15%; Poisson genes get the Poisson end of the range."""
    rng = np.random.default_rng(8)
    n, genes = 6000, 12
    theta = np.geomspace(0.5, 20, genes)
    size = rng.lognormal(0, 0.3, n)
    mean = 20.0 * size[:, None] * np.ones(genes)
    nb = rng.poisson(rng.gamma(theta, mean / theta))
    got = counts.control_dispersion(nb, size * 1000)
    np.testing.assert_allclose(got, theta, rtol=0.15)
    poisson = rng.poisson(20.0 * size[:, None] * np.ones(4))
    assert (counts.control_dispersion(poisson, size) > 100).all()


def test_bad_sampler_and_bad_rates_are_named():
    with pytest.raises(GearsInputError, match="sampler"):
        counts.check_sampler("gauss")
    with pytest.raises(GearsInputError, match="finite"):
        counts.draw_counts(np.array([[np.nan, 1.0]]), np.random.default_rng(0), "poisson")
    with pytest.raises(GearsInputError, match="dispersions"):
        counts.draw_counts(np.ones((1, 2)), np.random.default_rng(0), "nb")


@pytest.mark.parametrize("sampler", counts.SAMPLERS)
def test_the_seed_changes_the_draws(sampler):
    """The same rates drawn with seeds 0 and 1 give other counts (every sampler draws at random:
    rates of 0.5 leave even rounding a coin toss per gene); the same seed gives them again."""
    rate = np.full((300, 40), 0.5)  # 300 rows: two random streams (ROWS_PER_DRAW 256)
    theta = np.full(40, 2.0)
    first = counts.sample_rows(rate, 0, seed=0, sampler=sampler, theta=theta)
    np.testing.assert_array_equal(first, counts.sample_rows(rate, 0, 0, sampler, theta))
    other = counts.sample_rows(rate, 0, seed=1, sampler=sampler, theta=theta)
    step = counts.ROWS_PER_DRAW
    for block in (slice(0, step), slice(step, None)):
        assert not np.array_equal(first[block], other[block]), (sampler, block)
