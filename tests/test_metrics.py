"""Tests for gears/train/metrics.py: hand-computed cases and a slow GEARS-style loop reference."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import scipy.sparse as sp
from scipy.stats import pearsonr

from gears.errors import GearsInputError
from gears.train.metrics import (
    condition_metrics,
    distance_correlation,
    gi_params,
    summarize,
    top_variable_genes,
)

REQUIRED_KEYS = (
    ["mse", "pearson", "mse_de", "pearson_de", "pearson_delta", "pearson_delta_de"]
    + ["frac_correct_direction_all"]
    + [f"frac_correct_direction_{n}" for n in (20, 50, 100, 200)]
    + ["frac_in_range", "frac_in_range_45_55", "frac_in_range_40_60", "frac_in_range_25_75"]
    + ["mean_sigma", "std_sigma", "frac_sigma_below_1", "frac_sigma_below_2"]
    + ["fold_change_gap_all", "fold_change_gap_downreg_0.33", "fold_change_gap_downreg_0.1"]
    + ["fold_change_gap_upreg_3", "fold_change_gap_upreg_10"]
    + ["pearson_delta_top200_hvg", "pearson_top200_hvg", "mse_top200_hvg"]
    + [f"{m}_top{n}_de" for n in (20, 50, 100, 200) for m in ("pearson_delta", "pearson", "mse")]
    + ["frac_opposite_direction_top20_non_dropout", "frac_0/1_direction_top20_non_dropout"]
    + ["frac_correct_direction_top20_non_dropout", "frac_in_range_non_dropout"]
    + [f"frac_in_range_{r}_non_dropout" for r in ("45_55", "40_60", "25_75")]
    + ["mean_sigma_non_dropout", "std_sigma_non_dropout", "frac_sigma_below_1_non_dropout"]
    + ["frac_sigma_below_2_non_dropout", "pearson_delta_top20_de_non_dropout"]
    + ["pearson_top20_de_non_dropout", "mse_top20_de_non_dropout"]
)


# ------------------------------------------------------------------ slow reference (GEARS loops)


def _pearson0(x, y):
    """GEARS: scipy pearsonr, NaN (constant input) -> 0."""
    if len(x) < 2:
        return np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        val = pearsonr(x, y)[0]
    return 0.0 if np.isnan(val) else float(val)


def _mse(x, y):
    return float(np.mean((np.asarray(x) - np.asarray(y)) ** 2))


def _direction(pred, truth, ctrl):
    change = np.abs(np.sign(pred - ctrl) - np.sign(truth - ctrl))
    n = len(change)
    return [np.sum(change == k) / n for k in (0, 1, 2)]


def _range_reference(pred_mean, cells, suffix):
    """deeper_analysis / non_dropout_analysis block on the listed genes (cells: [n, k])."""
    res = {}
    mean, std = cells.mean(0), cells.std(0)
    min_, max_ = cells.min(0), cells.max(0)
    q = {p: np.quantile(cells, p / 100, axis=0) for p in (25, 40, 45, 55, 60, 75)}
    zero_des = np.intersect1d(np.where(min_ == 0)[0], np.where(max_ == 0)[0])
    nonzero_des = np.setdiff1d(list(range(cells.shape[1])), zero_des)
    if len(nonzero_des) == 0:
        return res
    pm = pred_mean[nonzero_des]
    res["frac_in_range" + suffix] = np.mean((pm >= min_[nonzero_des]) & (pm <= max_[nonzero_des]))
    for lo, hi in ((45, 55), (40, 60), (25, 75)):
        inside = (pm >= q[lo][nonzero_des]) & (pm <= q[hi][nonzero_des])
        res[f"frac_in_range_{lo}_{hi}{suffix}"] = np.mean(inside)
    zero_idx = np.where(std > 0)[0]
    if len(zero_idx) == 0:  # GEARS raises ZeroDivisionError here; we document NaN.
        return res
    sigma = np.abs(pred_mean[zero_idx] - mean[zero_idx]) / std[zero_idx]
    res["mean_sigma" + suffix] = np.mean(sigma)
    res["std_sigma" + suffix] = np.std(sigma)
    res["frac_sigma_below_1" + suffix] = 1 - len(np.where(sigma > 1)[0]) / len(zero_idx)
    res["frac_sigma_below_2" + suffix] = 1 - len(np.where(sigma > 2)[0]) / len(zero_idx)
    return res


def reference_metrics(pred_mean, truth, cond, ctrl, de_idx, nd_idx, hvg):
    """One dict per condition, written like GEARS's loops (valid, i.e. non -1, genes only)."""
    out = []
    for c in range(pred_mean.shape[0]):
        res = {}
        cells = truth[cond == c]
        p, t = pred_mean[c], cells.mean(0)
        de = de_idx[c][de_idx[c] >= 0]
        de20 = de[:20]
        res["mse"], res["pearson"] = _mse(p, t), _pearson0(p, t)
        res["mse_de"], res["pearson_de"] = _mse(p[de20], t[de20]), _pearson0(p[de20], t[de20])
        res["pearson_delta"] = _pearson0(p - ctrl, t - ctrl)
        res["pearson_delta_de"] = _pearson0(p[de20] - ctrl[de20], t[de20] - ctrl[de20])
        res["frac_correct_direction_all"] = _direction(p, t, ctrl)[0]
        for n in (20, 50, 100, 200):
            g = de[:n]
            res[f"frac_correct_direction_{n}"] = _direction(p[g], t[g], ctrl[g])[0]
            d_p, d_t = p[g] - ctrl[g], t[g] - ctrl[g]
            res[f"pearson_delta_top{n}_de"] = _pearson0(d_p, d_t)
            res[f"pearson_top{n}_de"] = _pearson0(p[g], t[g])
            res[f"mse_top{n}_de"] = _mse(d_p, d_t)
        block = _range_reference(p[de20], cells[:, de20], "")
        res.update(block)
        if "frac_in_range" in block:
            mins, maxs = cells[:, de20].min(0), cells[:, de20].max(0)
            nz = ~((mins == 0) & (maxs == 0))
            res["frac_correct_direction_20_nonzero"] = _direction(
                p[de20][nz], t[de20][nz], ctrl[de20][nz]
            )[0]
        with np.errstate(all="ignore"):
            fold = (t / ctrl)[None, :]
        fold[np.isnan(fold)] = 0
        fold[np.isinf(fold)] = 0
        fold[0][np.where(t < 0.5)[0]] = 0
        bins = {
            "all": np.where(fold[0] > 0)[0],
            "downreg_0.33": np.intersect1d(np.where(fold[0] < 0.333)[0], np.where(fold[0] > 0)[0]),
            "downreg_0.1": np.intersect1d(np.where(fold[0] < 0.1)[0], np.where(fold[0] > 0)[0]),
            "upreg_3": np.where(fold[0] > 3)[0],
            "upreg_10": np.where(fold[0] > 10)[0],
        }
        for name, o in bins.items():
            if len(o) > 0:
                res[f"fold_change_gap_{name}"] = np.mean(np.abs(p[o] / ctrl[o] - t[o] / ctrl[o]))
        res["pearson_delta_top200_hvg"] = _pearson0(p[hvg] - ctrl[hvg], t[hvg] - ctrl[hvg])
        res["pearson_top200_hvg"] = _pearson0(p[hvg], t[hvg])
        res["mse_top200_hvg"] = _mse(p[hvg], t[hvg])
        nd = nd_idx[c][nd_idx[c] >= 0]
        correct, zero_one, opposite = _direction(p[nd], t[nd], ctrl[nd])
        res["frac_correct_direction_top20_non_dropout"] = correct
        res["frac_opposite_direction_top20_non_dropout"] = opposite
        res["frac_0/1_direction_top20_non_dropout"] = zero_one
        res.update(_range_reference(p[nd], cells[:, nd], "_non_dropout"))
        res["pearson_delta_top20_de_non_dropout"] = _pearson0(p[nd] - ctrl[nd], t[nd] - ctrl[nd])
        res["pearson_top20_de_non_dropout"] = _pearson0(p[nd], t[nd])
        res["mse_top20_de_non_dropout"] = _mse(p[nd] - ctrl[nd], t[nd] - ctrl[nd])
        out.append(res)
    return out


def _random_case(seed=0):
    rng = np.random.default_rng(seed)
    n_genes, sizes = 260, [1, 2, 7, 13, 30, 4]
    n_cond = len(sizes)
    cond = rng.permutation(np.repeat(np.arange(n_cond), sizes))
    truth = rng.gamma(2.0, 1.0, (cond.size, n_genes)) * (rng.random((cond.size, n_genes)) < 0.6)
    truth[:, 5] = 0.0  # a gene that is zero in every cell
    truth[:, 6] = 2.0  # a gene that is constant but not zero (std exactly 0)
    truth[cond == 3, 7] = 0.0  # zero in one condition only
    ctrl = np.exp(rng.uniform(np.log(0.03), np.log(8.0), n_genes))
    means = np.stack([truth[cond == c].mean(0) for c in range(n_cond)])
    pred = means + rng.normal(0, 0.4, means.shape)
    pred[4] = ctrl  # a no-change prediction: constant deltas
    de_idx = np.stack([rng.permutation(n_genes)[:220] for _ in range(n_cond)])
    de_idx[:, :3] = [5, 6, 7]  # the special genes sit among the top 20
    de_idx[2, 150:] = -1  # fewer ranked genes than 200 for one condition
    nd_idx = np.stack([rng.permutation(n_genes)[:20] for _ in range(n_cond)])
    nd_idx[0, 15:] = -1
    nd_idx[1, :2] = [5, 6]
    return pred, truth, cond, ctrl, de_idx, nd_idx, means


@pytest.mark.parametrize("layout", ["dense", "dense32", "csr", "csc"])
def test_matches_gears_style_reference(layout):
    pred, truth, cond, ctrl, de_idx, nd_idx, means = _random_case()
    hvg = np.argsort(np.std(means, axis=0))[-200:]  # GEARS's most_variable_genes
    np.testing.assert_array_equal(np.sort(top_variable_genes(means)), np.sort(hvg))
    ref = reference_metrics(pred, truth, cond, ctrl, de_idx, nd_idx, hvg)
    if layout == "dense32":
        truth = truth.astype(np.float32)
        ref = reference_metrics(pred, truth.astype(np.float64), cond, ctrl, de_idx, nd_idx, hvg)
    elif layout == "csr":
        truth = sp.csr_matrix(truth)
    elif layout == "csc":
        truth = sp.csc_matrix(truth)
    ours = condition_metrics(pred, truth, cond, ctrl, de_idx, nd_idx, hvg_idx=hvg)

    assert set(REQUIRED_KEYS) <= set(ours)
    ref_keys = set().union(*ref)
    assert ref_keys <= set(ours)
    for key in sorted(ref_keys):
        expected = np.array([r.get(key, np.nan) for r in ref])
        np.testing.assert_allclose(ours[key], expected, rtol=1e-9, atol=1e-12, err_msg=key)
        assert ours[key].shape == (len(ref),)
    # The case exercises the undefined branches, not only the easy ones.
    assert np.isnan(ours["mean_sigma"][0])  # one cell: no gene has spread
    assert not np.isnan(ours["frac_in_range"][0])
    assert ours["pearson_delta"][4] == 0.0  # constant delta -> 0, as GEARS
    assert np.isnan(ours["fold_change_gap_downreg_0.1"]).sum() < len(ref)


def test_hand_computed_two_conditions():
    ctrl = np.ones(5)
    truth = np.array(
        [
            [2.0, 0.0, 1.0, 3.0, 1.0],  # condition 0
            [2.0, 2.0, 1.0, 1.0, 1.0],  # condition 0 -> mean [2, 1, 1, 2, 1]
            [0.0, 0.0, 0.0, 0.0, 5.0],  # condition 1
        ]
    )
    cond = np.array([0, 0, 1])
    pred = np.array([[3.0, 1.0, 0.0, 2.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    de_idx = np.array([[0, 2, 3, -1], [4, 0, 1, -1]])
    nd_idx = np.array([[3, 1, -1], [4, 0, -1]])
    m = condition_metrics(pred, sp.csr_matrix(truth), cond, ctrl, de_idx, nd_idx)

    # Condition 0: centred pred [1.6,-.4,-1.4,.6,-.4], truth [.6,-.4,-.4,.6,-.4].
    r0 = 2.2 / np.sqrt(5.2 * 1.2)
    np.testing.assert_allclose(m["mse"], [2 / 5, 20 / 5])
    np.testing.assert_allclose(m["pearson"], [r0, 0.0])  # constant prediction -> 0
    np.testing.assert_allclose(m["pearson_delta"], [r0, 0.0])
    np.testing.assert_allclose(m["frac_correct_direction_all"], [4 / 5, 0.0])
    # DE genes of condition 0: [0, 2, 3]: pred [3, 0, 2], truth [2, 1, 2].
    np.testing.assert_allclose(m["mse_de"], [2 / 3, 18 / 3])
    np.testing.assert_allclose(m["pearson_de"], [15 / np.sqrt(252), 0.0])
    np.testing.assert_allclose(m["frac_correct_direction_20"], [2 / 3, 0.0])
    np.testing.assert_allclose(m["frac_correct_direction_200"], [2 / 3, 0.0])
    # Ranges: gene 3 (cells 3 and 1) holds pred 2; genes 0 and 2 are constant, pred outside.
    # Condition 1 has one cell: genes 0 and 1 are zero everywhere, so only gene 4 counts.
    np.testing.assert_allclose(m["frac_in_range"], [1 / 3, 0.0])
    np.testing.assert_allclose(m["frac_in_range_25_75"], [1 / 3, 0.0])  # q25..q75 = [1.5, 2.5]
    np.testing.assert_allclose(m["frac_in_range_45_55"], [1 / 3, 0.0])  # [1.9, 2.1]
    np.testing.assert_allclose(m["mean_sigma"], [0.0, np.nan])  # |2 - 2| / 1; no spread
    np.testing.assert_allclose(m["frac_sigma_below_1"], [1.0, np.nan])
    # Fold changes = truth mean, all >= 0.5 in condition 0: mean |pred - truth| = 2 / 5.
    np.testing.assert_allclose(m["fold_change_gap_all"], [2 / 5, 5 / 1 - 1 / 1])
    np.testing.assert_allclose(m["fold_change_gap_upreg_3"], [np.nan, 4.0])
    assert np.isnan(m["fold_change_gap_downreg_0.33"]).all()
    # Non-dropout genes of condition 0: [3, 1]: pred [2, 1] = truth [2, 1]; signs [+, 0].
    np.testing.assert_allclose(m["frac_correct_direction_top20_non_dropout"], [1.0, 0.0])
    np.testing.assert_allclose(m["frac_0/1_direction_top20_non_dropout"], [0.0, 1.0])
    np.testing.assert_allclose(m["frac_opposite_direction_top20_non_dropout"], [0.0, 0.0])
    np.testing.assert_allclose(m["mse_top20_de_non_dropout"], [0.0, (16 + 1) / 2])
    np.testing.assert_allclose(m["pearson_top20_de_non_dropout"], [1.0, 0.0])  # two points
    assert "pearson_top200_hvg" not in m  # no hvg_idx given


def test_opposite_direction_and_empty_or_nan_rows():
    ctrl = np.zeros(3)
    truth = np.array([[1.0, -1.0, 0.0]])
    pred = np.array([[-1.0, 1.0, 0.0], [np.nan, 0.0, 0.0], [1.0, 1.0, 1.0]])
    idx = np.array([[0, 1, 2], [0, 1, 2], [0, 1, 2]])
    m = condition_metrics(pred, truth, np.array([0]), ctrl, idx, idx)
    np.testing.assert_allclose(m["frac_opposite_direction_top20_non_dropout"][0], 2 / 3)
    np.testing.assert_allclose(m["frac_correct_direction_top20_non_dropout"][0], 1 / 3)
    np.testing.assert_allclose(m["pearson"][0], -1.0)
    # Row 1 has a non-finite prediction, row 2 no truth cells: NaN everywhere.
    for values in m.values():
        assert np.isnan(values[1:]).all()


def test_all_padding_and_bad_input():
    truth = np.ones((2, 4))
    m = condition_metrics(
        np.ones((1, 4)),
        truth,
        np.array([0, 0]),
        np.ones(4),
        -np.ones((1, 20), int),
        -np.ones((1, 20), int),
    )
    assert np.isnan(m["pearson_de"][0]) and np.isnan(m["frac_in_range"][0])
    assert m["mse"][0] == 0.0
    with pytest.raises(GearsInputError, match="de_idx"):
        condition_metrics(
            np.ones((1, 4)),
            truth,
            np.array([0, 0]),
            np.ones(4),
            np.full((1, 3), 9),
            np.zeros((1, 3), int),
        )
    with pytest.raises(GearsInputError, match="cell_condition"):
        condition_metrics(
            np.ones((1, 4)),
            truth,
            np.array([0, 1]),
            np.ones(4),
            np.zeros((1, 3), int),
            np.zeros((1, 3), int),
        )


def test_summarize_with_groups():
    per = {"a": np.array([1.0, np.nan, 3.0]), "b": np.array([np.nan, np.nan, 2.0])}
    names = ["X+ctrl", "X+Y", "Z+ctrl"]
    groups = {"single": ["X+ctrl", "Z+ctrl", "W+ctrl"], "double": ["X+Y"], "empty": ["Q+ctrl"]}
    out = summarize(per, names, groups)
    assert set(out) == {"overall", "single", "double"}
    assert out["overall"] == {"a": 2.0, "b": 2.0, "n_conditions": 3}
    assert out["single"] == {"a": 2.0, "b": 2.0, "n_conditions": 2}
    assert np.isnan(out["double"]["a"]) and out["double"]["n_conditions"] == 1
    with pytest.raises(GearsInputError):
        summarize(per, names[:2])


def test_top_variable_genes_clips():
    means = np.array([[0.0, 1.0, 5.0], [0.0, 3.0, 5.5]])
    np.testing.assert_array_equal(top_variable_genes(means, n=2), [2, 1])
    assert len(top_variable_genes(means, n=200)) == 3


# ------------------------------------------------------------------ genetic interactions


def _brute_dcor(x, y):
    x = np.asarray(x, float).reshape(len(x), -1)
    y = np.asarray(y, float).reshape(len(y), -1)
    a = np.sqrt(((x[:, None, :] - x[None, :, :]) ** 2).sum(-1))
    b = np.sqrt(((y[:, None, :] - y[None, :, :]) ** 2).sum(-1))
    big_a = a - a.mean(0) - a.mean(1)[:, None] + a.mean()
    big_b = b - b.mean(0) - b.mean(1)[:, None] + b.mean()
    return np.sqrt((big_a * big_b).mean() / np.sqrt((big_a**2).mean() * (big_b**2).mean()))


def test_distance_correlation():
    rng = np.random.default_rng(1)
    x = rng.normal(size=200)
    assert distance_correlation(x, 3 * x + 2) == pytest.approx(1.0, abs=1e-12)
    x2, y2 = rng.normal(size=(25, 2)), rng.normal(size=25) + 0.5 * rng.normal(size=(25, 2))[:, 0]
    assert distance_correlation(x2, y2) == pytest.approx(_brute_dcor(x2, y2), rel=1e-10)
    assert distance_correlation(x2[:, 0], x2[:, 1]) == pytest.approx(
        _brute_dcor(x2[:, 0], x2[:, 1]), rel=1e-10
    )
    independent = distance_correlation(rng.normal(size=3000), rng.normal(size=3000))
    assert independent < 0.1
    # The value documented by the `dcor` package for this pair.
    a = np.arange(1.0, 17.0).reshape(4, 4)
    b = np.array([[1.0], [0.0], [0.0], [1.0]])
    assert distance_correlation(a, b) == pytest.approx(0.5266403, abs=1e-7)
    assert distance_correlation(np.ones(10), rng.normal(size=10)) == 0.0


def test_gi_params_recovers_coefficients():
    rng = np.random.default_rng(2)
    first, second = rng.normal(size=150), rng.normal(size=150)
    double = 0.3 * first + 1.5 * second + rng.normal(0, 0.01, 150)
    res = gi_params(first, second, double)
    assert res["c1"] == pytest.approx(0.3, abs=0.01)
    assert res["c2"] == pytest.approx(1.5, abs=0.01)
    assert res["mag"] == pytest.approx(np.hypot(res["c1"], res["c2"]))
    assert res["dominance"] == pytest.approx(abs(np.log10(res["c1"] / res["c2"])))
    assert res["dominance"] == pytest.approx(np.log10(5), abs=0.02)
    assert res["corr_fit"] > 0.999
    singles = np.column_stack([first, second])
    assert res["dcor"] == pytest.approx(_brute_dcor(singles, double), rel=1e-10)
    assert res["dcor_second"] > res["dcor_first"]
    assert res["eq_contr"] == pytest.approx(res["dcor_first"] / res["dcor_second"])
    assert res["dcor_singles"] == pytest.approx(_brute_dcor(first, second), rel=1e-10)
