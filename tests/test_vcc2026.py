"""The Virtual Cell Challenge 2026 round trip: a raw-count file with contexts in (configs/
vcc2026.yaml, PertData.contexts / context_view, gears/cli/contexts.py), integer counts out
(predict.py --output counts) and cell-eval2's vcc2026 score of every context
(gears/eval/vcc2026.py)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scanpy as sc
import scipy.sparse as sp
import torch
from vcc_helpers import ROOT

from gears.cli.job import guarded, load_pert_data, run
from gears.config import load_config
from gears.data import de as de_mod
from gears.data.pertdata import PertData
from gears.data.synthetic import make_vcc2026_layout, write_vcc2026_example
from gears.errors import GearsInputError
from gears.eval.counts import MAX_COUNTS_PER_CELL, raw_counts
from gears.eval.predicted_cells import read_counts
from gears.eval.vcc2026 import MEMBERS
from gears.train.distributed import DistEnv
from predict import main as predict_main

HAS_CELL_EVAL2 = all(importlib.util.find_spec(m) for m in ("cell_eval2", "pdex"))
NO_CELL_EVAL2 = "cell-eval2 is not installed (pip install -r requirements-eval.txt)"
PARAMS = dict(n_genes=60, n_perturbations=12, cells_per_perturbation=40, n_control_cells=90)
CONTROL = "non-targeting"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    return write_vcc2026_example(tmp_path_factory.mktemp("vcc2026_files"), **PARAMS)


def _load(files, tmp_path, store="memory", **kw) -> PertData:
    pert = PertData(tmp_path / "data", gene2go=files["gene2go"], verbose=False, store=store)
    kw = {"normalize": "log1p", "context_key": "cell_line", **kw}
    return pert.load(data_path=files["training"], **kw)


def _dense(X) -> np.ndarray:
    return X.toarray() if sp.issparse(X) else np.asarray(X)


# ---------------------------------------------------------------------------------- data in
def test_the_2026_layout():
    adata, gene2go = make_vcc2026_layout(**PARAMS)
    assert list(adata.obs.columns) == ["target", "cell_line"]
    assert sp.issparse(adata.X) and adata.X.dtype == np.float32
    assert np.array_equal(adata.X.data, np.round(adata.X.data)), "raw counts"
    panel = adata.obs.groupby(["cell_line", "target"], observed=True).size().unstack(0)
    assert list(panel.columns) == ["lineA", "lineB"]
    assert (panel.loc[CONTROL] == PARAMS["n_control_cells"]).all()
    assert (panel.drop(CONTROL) == PARAMS["cells_per_perturbation"]).all().all(), "same panel"
    assert set(panel.index) - {CONTROL} <= set(adata.var_names) <= set(gene2go)
    totals = np.asarray(adata.X.sum(axis=1)).ravel()
    line = adata.obs["cell_line"].values
    assert np.median(totals[line == "lineA"]) != np.median(totals[line == "lineB"]), "own depth"


def test_vcc2026_config_reads_the_2026_layout(files, tmp_path):
    cfg = load_config(ROOT / "configs" / "vcc2026.yaml", base=ROOT / "configs" / "default.yaml")
    assert (cfg.data.condition_key, cfg.data.context_key) == ("target", "cell_line")
    assert cfg.data.normalize == "log1p" and cfg.split.type == "simulation_single"
    pert = _load(files, tmp_path)  # obs['target'] is found without condition_key
    assert pert.condition_key == "target" and pert.condition_spelling["ctrl"] == CONTROL
    assert pert.contexts == ["lineA", "lineB"]


@pytest.mark.parametrize("store", ["memory", "mmap"])
def test_raw_counts_and_their_library_sizes_are_kept(files, tmp_path, store):
    """Normalised inside, in memory and out of core, to the same values; each cell's raw
    total is kept, and rebuilding counts from the processed cells gives the file's counts."""
    pert = _load(files, tmp_path, store)
    raw = ad.read_h5ad(files["training"])
    totals = np.asarray(raw.X.sum(axis=1)).ravel()
    np.testing.assert_array_equal(pert.library_size, totals)  # every cell kept, in file order
    assert pert.normalize_target_sum == pytest.approx(float(np.median(totals)))
    rebuilt = raw_counts(_dense(pert.expr.numpy()), pert.library_size, pert.normalize_target_sum)
    np.testing.assert_array_equal(rebuilt, raw.X.toarray())


@pytest.mark.parametrize("store", ["memory", "mmap"])
def test_a_context_view_is_that_context_alone(files, tmp_path, store):
    """context_view('lineA') against an independent computation: lineA's cells of the file,
    normalised by scanpy to the whole data's target sum; its control mean, condition means and
    top-20 DE genes (scanpy's t-test against lineA's own controls) are the view's. The
    perturbation vocabulary is the whole data's."""
    pert = _load(files, tmp_path, store)
    view = pert.context_view("lineA")
    assert view.context == "lineA" and view.contexts == ["lineA"]
    assert list(view.pert_names) == list(pert.pert_names)
    assert view.normalize_target_sum == pert.normalize_target_sum
    raw = ad.read_h5ad(files["training"])
    mine = raw[raw.obs["cell_line"] == "lineA"].copy()
    np.testing.assert_array_equal(view.library_size, np.asarray(mine.X.sum(axis=1)).ravel())
    sc.pp.normalize_total(mine, target_sum=pert.normalize_target_sum)
    sc.pp.log1p(mine)
    target = mine.obs["target"].astype(str)
    condition = np.where(target == CONTROL, "ctrl", target + "+ctrl")
    assert sorted(view.conditions) == sorted(set(condition))
    X = mine.X.toarray()
    np.testing.assert_allclose(view.ctrl_mean, X[condition == "ctrl"].mean(0), rtol=1e-5, atol=1e-6)
    for c in view.conditions:
        np.testing.assert_allclose(
            view.condition_means([c])[0], X[condition == c].mean(0), rtol=1e-5, atol=1e-6
        )
        i = view.cond_to_id[c]
        genes = [g for g in c.split("+") if g != "ctrl"]
        assert all(view.cond_pert_index[i, k] == pert.node_map_pert[g] for k, g in enumerate(genes))
    reference = ad.AnnData(
        X=mine.X, obs=pd.DataFrame({"condition": condition}, index=mine.obs_names), var=mine.var
    )
    reference.var["gene_name"] = reference.var_names
    de = de_mod.compute_de(reference, n_top=20)
    for c in view.conditions:
        if c == "ctrl":
            continue
        ours = list(view.gene_names[view.de_idx[view.cond_to_id[c]]])
        assert ours == list(np.asarray(de[de_mod.RANK_KEY][c])[:20]), c


def test_in_memory_and_out_of_core_views_agree(files, tmp_path):
    a = _load(files, tmp_path / "a", "memory").context_view("lineB")
    b = _load(files, tmp_path / "b", "mmap").context_view("lineB")
    assert a.conditions == b.conditions
    np.testing.assert_allclose(_dense(a.expr.numpy()), _dense(b.expr.numpy()), rtol=1e-6)
    np.testing.assert_allclose(a.ctrl_mean, b.ctrl_mean, rtol=1e-6)
    np.testing.assert_array_equal(a.de_idx, b.de_idx)


def test_a_context_view_keeps_the_data_subset_in_memory_and_out_of_core(files, tmp_path):
    """data.subset holds in a context's view: the store-backed view (processed again from the
    file) equals the in-memory one (rows of the subset's processed matrix), and the excluded
    perturbations stay out of both."""
    raw = ad.read_h5ad(files["training"])
    targets = sorted(set(raw.obs["target"].astype(str)) - {CONTROL})
    kept, dropped = targets[:6], targets[6:]
    subset = {"target": [CONTROL, *kept]}
    views = {
        store: _load(files, tmp_path / store, store, subset=subset).context_view("lineB")
        for store in ("memory", "mmap")
    }
    a, b = views["memory"], views["mmap"]
    assert a.conditions == b.conditions
    assert {c.split("+")[0] for c in b.conditions} - {"ctrl"} <= set(kept)
    assert not {f"{t}+ctrl" for t in dropped} & set(b.conditions)
    assert len(b.cell_condition) == len(a.cell_condition)
    np.testing.assert_array_equal(a.library_size, b.library_size)
    np.testing.assert_allclose(_dense(a.expr.numpy()), _dense(b.expr.numpy()), rtol=1e-6)
    np.testing.assert_allclose(a.ctrl_mean, b.ctrl_mean, rtol=1e-6)
    np.testing.assert_array_equal(a.de_idx, b.de_idx)


@pytest.mark.parametrize("store", ["memory", "mmap"])
def test_bad_counts_and_context_inputs_are_named(files, tmp_path, store):
    with pytest.raises(GearsInputError, match="'tissue'.*no such column.*cell_line"):
        _load(files, tmp_path / "a", store, context_key="tissue")
    with pytest.raises(GearsInputError, match="unknown context 'lineC'.*lineA"):
        _load(files, tmp_path / "b", store).context_view("lineC")
    fractional = ad.read_h5ad(files["training"])
    fractional.X.data[::7] += 0.5
    path = tmp_path / "fractional.h5ad"
    fractional.write_h5ad(path)
    with pytest.raises(GearsInputError, match="non-integer"):
        PertData(tmp_path / "c", gene2go=files["gene2go"], verbose=False, store=store).load(
            data_path=path, normalize="log1p", context_key="cell_line"
        )


def test_a_counts_file_without_the_models_context_is_named(files):
    request = read_counts(files["counts"], "target", "cell_line", "lineB")
    frame = pd.read_csv(files["counts"]).query("cell_line == 'lineB'")
    assert request.n_cells == dict(zip(frame["target"], frame["n_cells"]))
    assert request.median_umi == dict(zip(frame["target"], frame["median_umi_per_cell"]))
    with pytest.raises(GearsInputError, match="no rows for context 'lineC'.*lineA"):
        read_counts(files["counts"], "target", "cell_line", "lineC")


# ------------------------------------------------- one model per context or one across them
def _config(files, tmp_path, *overrides):
    return load_config(
        ROOT / "configs" / "vcc2026.yaml",
        [
            f"data.dataset={files['training']}",
            f"data.gene2go={files['gene2go']}",
            "data.gene_aliases=null",
            f"data.data_dir={tmp_path / 'data'}",
            "wandb.mode=disabled",
            *overrides,
        ],
        base=ROOT / "configs" / "default.yaml",
    )


def test_context_models_chooses_one_model_per_context_or_one_across(files, tmp_path):
    from gears.cli.contexts import one_model_per_context, reads_context

    assert one_model_per_context(_config(files, tmp_path))  # auto: GEARS reads no context
    assert one_model_per_context(_config(files, tmp_path, "data.context_models=per_context"))
    assert not one_model_per_context(_config(files, tmp_path, "data.context_models=joint"))
    assert not one_model_per_context(_config(files, tmp_path, "data.context_key=null"))

    class ReadsContext:
        covariates = ("context", "dose")

    assert reads_context(ReadsContext) and not reads_context(object)
    with pytest.raises(GearsInputError, match="data.context_models"):
        _config(files, tmp_path, "data.context_models=both")
    # Loading is loading, whatever trains on it: the whole data split, every context in it
    # (a model across contexts, or one scored on a context's cells, needs the split); only the
    # per-context driver asks for it unsplit.
    pert = load_pert_data(_config(files, tmp_path), DistEnv())
    assert pert.contexts == ["lineA", "lineB"] and pert.set2conditions["test"]
    unsplit = load_pert_data(_config(files, tmp_path), DistEnv(), split=False)
    assert unsplit.contexts == ["lineA", "lineB"] and unsplit.set2conditions is None


def test_a_network_reading_the_context_trains_across_contexts(files, tmp_path):
    from gears.cli.contexts import one_model_per_context

    fork = f"model.impl={ROOT / 'examples' / 'context_gears.py'}:ContextGEARS"
    assert not one_model_per_context(_config(files, tmp_path, fork))
    assert one_model_per_context(_config(files, tmp_path, fork, "data.context_models=per_context"))


def test_cell_eval2_refuses_what_it_cannot_score_per_context(files, tmp_path):
    """eval.cell_eval2 scores one context's model at a time, from cells built as predict.py
    builds them: one model across contexts (it would mix the contexts' real cells) and a
    network that reads covariates are refused before training."""
    from gears.cli.contexts import one_model_per_context
    from gears.eval.vcc2026 import require_scorable
    from gears.model import network_class

    fast = network_class("fast")
    per_context = _config(files, tmp_path)
    require_scorable(per_context, fast, one_model_per_context(per_context))
    joint = _config(files, tmp_path, "data.context_models=joint")
    with pytest.raises(GearsInputError, match="one model per context"):
        require_scorable(joint, fast, one_model_per_context(joint))
    fork = network_class(f"{ROOT / 'examples' / 'context_gears.py'}:ContextGEARS")
    with pytest.raises(GearsInputError, match=r"ContextGEARS reads \['context'\]"):
        require_scorable(per_context, fork, True)


# ------------------------------------------------------------------------ one run, contexts
@pytest.fixture(scope="module")
def run2026(files, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vcc2026_run")
    cfg = load_config(
        ROOT / "configs" / "vcc2026.yaml",
        [
            f"data.dataset={files['training']}",
            f"data.gene2go={files['gene2go']}",
            "data.gene_aliases=null",
            f"data.data_dir={root / 'data'}",
            f"out_dir={root / 'run'}",
            "train.epochs=1",
            "model.hidden_size=16",
            "train.plot_conditions=0",
            "wandb.mode=disabled",
            "split.train_gene_set_size=0.6",
            f"eval.cell_eval2={str(HAS_CELL_EVAL2).lower()}",
        ],
        base=ROOT / "configs" / "default.yaml",
    )
    summary = run(cfg, DistEnv(device=torch.device("cpu")))
    return {"cfg": cfg, "out": root / "run", "summary": summary}


@pytest.mark.slow
def test_one_model_per_context_and_a_summary(run2026):
    out = run2026["out"]
    summary = json.loads((out / "metrics.json").read_text())
    assert summary == json.loads(json.dumps(run2026["summary"]))
    assert set(summary["contexts"]) == {"lineA", "lineB"}
    index = json.loads((out / "contexts.json").read_text())
    assert index == {
        "context_key": "cell_line",
        "contexts": {c: f"{c}/model" for c in ("lineA", "lineB")},
    }
    means = []
    for name in ("lineA", "lineB"):
        folder = out / name
        metrics = json.loads((folder / "metrics.json").read_text())
        assert (folder / "model" / "model.pt").exists() and (folder / "config.yaml").exists()
        assert json.loads((folder / "model" / "prediction.json").read_text())["context"] == name
        assert summary["contexts"][name]["test"] == metrics["test"]
        assert metrics["test"]["n_conditions"] >= 2
        means.append(metrics["test"]["mse_de"])
    assert summary["mean_over_contexts"]["test"]["mse_de"] == pytest.approx(np.mean(means))


@pytest.mark.slow
def test_every_context_holds_the_six_members_raw_and_rescaled(run2026):
    if not HAS_CELL_EVAL2:
        pytest.skip(NO_CELL_EVAL2)
    summary = run2026["summary"]
    for name, entry in summary["contexts"].items():
        scores = entry["cell_eval2"]
        assert scores["input_type"] == "counts" and scores["members"] == list(MEMBERS)
        assert {"gears", "no_change", "train_mean"} <= set(scores["predictors"])
        for predictor, got in scores["predictors"].items():
            assert set(got["raw"]) == set(got["scaled"]) == set(MEMBERS), (name, predictor)
            for m in MEMBERS:
                if m in scores["unscored"]:
                    assert got["scaled"][m] is None
                    continue
                assert math.isfinite(got["raw"][m]) and math.isfinite(got["scaled"][m]), m
            kept = [v for v in got["scaled"].values() if v is not None]
            assert got["score"] == pytest.approx(np.mean(kept))
        assert (run2026["out"] / name / "cell_eval2" / "agg_gears.csv").exists()
    assert "gears" in summary["mean_over_contexts"]["cell_eval2"]


@pytest.mark.slow
def test_counts_out_for_every_context(run2026, files, tmp_path):
    """predict.py --model RUN --counts CSV --output counts: one file per context, integer
    counts (no fraction, no negative, no NaN, at most 1e6 a cell), the CSV's cells per
    perturbation, the context in obs, and each predicted cell at its control cell's depth
    scaled to the CSV's median UMI (up to the rounding sampler's noise, variance <= 1/4 a
    gene)."""
    out = tmp_path / "pred.h5ad"
    argv = ["--model", str(run2026["out"]), "--counts", str(files["counts"]), "--output", "counts"]
    predict_main([*argv, "--out", str(out)])
    request = pd.read_csv(files["counts"])
    for name in ("lineA", "lineB"):
        pred = ad.read_h5ad(tmp_path / f"pred_{name}.h5ad")
        values = pred.X.data
        assert np.isfinite(values).all() and (values >= 0).all()
        assert np.array_equal(values, np.round(values))
        totals = np.asarray(pred.X.sum(axis=1)).ravel()
        assert totals.max() <= MAX_COUNTS_PER_CELL
        assert set(pred.obs["cell_line"]) == {name}
        mine = request[request["cell_line"] == name].set_index("target")
        got = pred.obs["target"].astype(str).value_counts()
        assert {t: got[t] for t in mine.index} == mine["n_cells"].to_dict()
        controls = ad.read_h5ad(run2026["out"] / name / "model" / "control_cells.h5ad")
        library = controls.obs["library_size"]
        scale = mine["median_umi_per_cell"] / np.median(library)
        target = pred.obs["target"].astype(str).values
        hit = target != CONTROL
        # A copy: under pandas' Copy-on-Write, .values of a selection is a read-only view.
        expected = library[pred.obs["control_cell"].values].to_numpy(dtype=np.float64, copy=True)
        expected[hit] *= scale[target[hit]].values
        bound = 5.5 * np.sqrt(pred.n_vars / 4)
        assert np.abs(totals - expected).max() <= bound, np.abs(totals - expected).max()
        assert pred.uns["gears_counts"]["sampler"] == "rounding"
    if not HAS_CELL_EVAL2:
        pytest.skip(NO_CELL_EVAL2)
    from cell_eval2.cli import main as cell_eval2_main

    result = tmp_path / "scored"
    cell_eval2_main(
        [
            "run",
            "-ap",
            str(tmp_path / "pred_lineA.h5ad"),
            "-ar",
            str(files["validation_lineA"]),
            "--preset",
            "vcc2026",
            "--set",
            "device=cpu",
            "--set",
            "de.backend=pdex",
            "-o",
            str(result),
        ]
    )
    agg = pd.read_csv(result / "agg_results.csv").set_index("statistic")
    assert all(math.isfinite(agg.loc["mean", m]) for m in ("pds_cosine", "de_wilcoxon_sig_jaccard"))


@pytest.mark.slow
def test_the_rescaled_members_are_cell_eval2_score_real_bundle(files, tmp_path):
    """score_vcc2026 against the official procedure on the same cells: cell-eval2's CLI builds
    the baseline (`baseline --save-pred`), the real bundle (`prep-real-bundle`: baseline and
    replicate anchor), scores the prediction (`run`) and rescales it (`score --real-bundle`);
    every member's from_replicate and the average equal ours."""
    if not HAS_CELL_EVAL2:
        pytest.skip(NO_CELL_EVAL2)
    from cell_eval2.cli import main as cell_eval2_main

    from gears.eval.vcc2026 import score_vcc2026

    # A screen deep enough that all six members are defined (the official gate refuses a
    # degenerate member, where score_vcc2026 reports it unscored).
    real, _ = make_vcc2026_layout(
        n_genes=80,
        n_perturbations=8,
        cells_per_perturbation=100,
        n_control_cells=150,
        contexts=("lineA",),
        counts_per_gene=100,
    )
    real.obs = real.obs[["target"]]
    rng = np.random.default_rng(0)
    pred = real.copy()  # a noisy copy of the real cells: a prediction with some skill
    pred.X = sp.csr_matrix(rng.poisson(real.X.toarray()).astype(np.float32))
    real_path, pred_path = tmp_path / "real.h5ad", tmp_path / "pred.h5ad"
    real.write_h5ad(real_path)
    pred.write_h5ad(pred_path)
    ours = score_vcc2026({"pred": pred}, real, "target", CONTROL, "counts", threads=1)
    # Every label here names a measured gene: cell-eval2 resolves the targets by name, as our
    # target_gene_map does, so the two configurations exclude the same genes.
    assert set(real.obs["target"]) - {CONTROL} <= set(real.var_names)
    cpu = ["--set", "device=cpu", "--set", "de.backend=pdex", "--set", "num_threads=1"]
    base = tmp_path / "baseline"
    cell_eval2_main(
        ["baseline", "-ar", str(real_path), "--preset", "vcc2026", *cpu, "-o", str(base)]
        + ["--save-pred", str(base / "baseline.h5ad")]
    )
    bundle = tmp_path / "bundle"
    cell_eval2_main(
        ["prep-real-bundle", "--real", str(real_path), "--baseline", str(base / "baseline.h5ad")]
        + ["-o", str(bundle), "--preset", "vcc2026", *cpu]
    )
    scored = tmp_path / "run"
    cell_eval2_main(
        ["run", "-ap", str(pred_path), "-ar", str(real_path), "--preset", "vcc2026", *cpu]
        + ["-o", str(scored)]
    )
    cell_eval2_main(
        ["score", "--user-agg", str(scored / "agg_results.csv"), "--real-bundle", str(bundle)]
        + ["-o", str(tmp_path / "score.csv")]
    )
    official = pd.read_csv(tmp_path / "score.csv").set_index("metric")["from_replicate"]
    got = ours["predictors"]["pred"]
    assert not ours["unscored"] and got["n_scored"] == 6
    for m in MEMBERS:
        assert got["scaled"][m] == pytest.approx(official[m], rel=1e-9, abs=1e-12), m
    assert got["score"] == pytest.approx(official["avg_score"], rel=1e-9)


def test_cell_eval2_missing_is_refused_before_training(files, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "cell_eval2", None)  # import cell_eval2 -> ImportError
    cfg = load_config(
        ROOT / "configs" / "vcc2026.yaml",
        [
            f"data.dataset={files['training']}",
            f"data.gene2go={files['gene2go']}",
            "data.gene_aliases=null",
            f"data.data_dir={tmp_path / 'data'}",
            f"out_dir={tmp_path / 'run'}",
            "eval.cell_eval2=true",
        ],
    )
    with pytest.raises(GearsInputError, match="requirements-eval.txt"):
        run(cfg, DistEnv(device=torch.device("cpu")))
    assert not (tmp_path / "run").exists(), "nothing was trained or written"


def test_counts_output_needs_a_model_trained_from_counts(tmp_path, capsys):
    """A model trained on log-normalised data has no raw scale to invert: one line, exit 2."""
    from gears.compat.api import GEARS

    pert = PertData(tmp_path / "data", verbose=False).load(
        "synthetic", synthetic_params={"n_genes": 40, "n_single": 6, "n_double": 0}
    )
    pert.prepare_split("simulation_single", seed=1)
    model = GEARS(pert, device="cpu")
    model.model_initialize(hidden_size=8)
    model.save_model(tmp_path / "model")
    gene = str(pert.pert_names[0])
    argv = ["--model", str(tmp_path / "model"), "--perturbations", gene, "--output", "counts"]
    with pytest.raises(SystemExit) as stop:
        guarded(lambda: predict_main([*argv, "--out", str(tmp_path / "p.h5ad")]))
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "raw counts' scale" in err and err.count("\n") == 1


# ------------------------------------------------- the rescaling, offline (a fake cell-eval2)
# Per member: its raw value u, the baseline b, the replicate r, and s = (u - b) / (r - b) by
# hand (0 = the mean-response baseline, 1 = a repeat of the experiment). sig_jaccard's
# replicate equals its baseline: no scale, so it is unscored and left out of the mean.
HAND = {
    "pds_cosine": (0.5, 0.2, 0.6, 0.75),  # 0.3 / 0.4
    "expr_mse_unbiased_capped_norm": (0.7, 0.8, 0.4, 0.25),  # -0.1 / -0.4 (lower is better)
    "de_wilcoxon_lfc_nmae": (0.9, 1.0, 0.5, 0.2),  # -0.1 / -0.5 (lower is better)
    "de_wilcoxon_direction_fidelity_yield_raw": (0.5, 0.1, 0.9, 0.5),  # 0.4 / 0.8
    "de_wilcoxon_direction_reach_raw": (0.45, 0.3, 0.5, 0.75),  # 0.15 / 0.2
    "de_wilcoxon_sig_jaccard": (0.5, 0.4, 0.4, None),  # r == b
}
HAND_SCORE = (0.75 + 0.25 + 0.2 + 0.5 + 0.75) / 5  # 0.49


class _FakeAgg:
    """What gears.eval.vcc2026 reads of cell-eval2's aggregate: its 'mean' row (one value a
    member)."""

    def __init__(self, values: dict):
        self.values = dict(values)

    def __getitem__(self, column):  # agg["statistic"] == "mean" -> True: filter keeps the row
        return "mean"

    def filter(self, keep):
        assert keep is True
        return self

    def drop(self, column):
        return self

    def to_dicts(self):
        return [dict(self.values)]


def fake_cell_eval2(monkeypatch) -> None:
    """cell-eval2's interface as gears.eval.vcc2026 calls it, with HAND's baseline and replicate per
    member and a linear score_one: installed in sys.modules whether or not cell-eval2 is."""
    import dataclasses
    import types

    @dataclasses.dataclass(frozen=True)
    class De:
        backend: str = "auto"

    @dataclasses.dataclass(frozen=True)
    class EvalConfig:
        pert_col: str = "target_gene"
        control: str = "non-targeting"
        input_type: str = "counts"
        device: str = "auto"
        num_threads: int = -1
        gather_threads: int = -1
        target_gene_map: dict | None = None
        metrics: tuple = tuple(MEMBERS)
        de: De = De()

        @classmethod
        def from_preset(cls, name):
            assert name == "vcc2026"
            return cls()

    @dataclasses.dataclass(frozen=True)
    class Policy:
        lower_is_better: bool
        anchor: float = math.nan
        allow_negative_baseline: bool = True

    def is_degenerate(base, policy):  # no scale unless the replicate is better than b
        gap = policy.anchor - base
        return not math.isfinite(gap) or (gap >= 0 if policy.lower_is_better else gap <= 0)

    def score_one(user, base, policy):
        return 0.0 if user is None else (user - base) / (policy.anchor - base)

    def build_generic_baseline(real, config, emit, allow_degenerate):
        assert emit == "dispersed" and config.de.backend == "pdex"
        return types.SimpleNamespace(agg=_FakeAgg({m: HAND[m][1] for m in config.metrics}))

    def compute_replicate_anchor(real, config):
        members = list(config.metrics)
        return None, pd.DataFrame({"metric": members, "replicate": [HAND[m][2] for m in members]})

    def compute_metrics(pred, real, config):
        return {m: pred.uns["raw"][m] for m in config.metrics}

    lower = {"expr_mse_unbiased_capped_norm", "de_wilcoxon_lfc_nmae"}
    modules = {
        "cell_eval2": dict(
            __version__="fake",
            EvalConfig=EvalConfig,
            build_generic_baseline=build_generic_baseline,
            compute_metrics=compute_metrics,
            aggregate_metrics_wide=lambda values, metrics: _FakeAgg(values),
        ),
        "cell_eval2.anchor": dict(compute_replicate_anchor=compute_replicate_anchor),
        "cell_eval2.run": dict(metric_output_names=lambda cfg: list(cfg.metrics)),
        "cell_eval2.catalog": dict(
            CATALOG={m: types.SimpleNamespace(scoring=Policy(m in lower)) for m in MEMBERS}
        ),
        "cell_eval2.scoring": dict(is_degenerate=is_degenerate, score_one=score_one),
        "pdex": {},
    }
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)


@pytest.mark.parametrize("which", ["fake", "cell-eval2"])
def test_rescale_puts_the_baseline_at_0_and_the_replicate_at_1(which, monkeypatch):
    """rescale(member, raw, baseline, replicate) against HAND's values: by the fake (offline,
    the argument order and the direction of each member), and by cell-eval2's own catalog
    policies where it is installed (the hand values are the official ones)."""
    from gears.eval.vcc2026 import rescale

    if which == "fake":
        fake_cell_eval2(monkeypatch)
    elif not HAS_CELL_EVAL2:
        pytest.skip(NO_CELL_EVAL2)
    for member, (u, b, r, s) in HAND.items():
        if s is None:
            assert rescale(member, u, b, r) is None, member
        else:
            assert rescale(member, u, b, r) == pytest.approx(s, abs=1e-12), member
            assert rescale(member, b, b, r) == pytest.approx(0.0, abs=1e-12), member
            assert rescale(member, r, b, r) == pytest.approx(1.0, abs=1e-12), member


def test_score_vcc2026_rescales_each_member_and_averages_the_scored_ones(monkeypatch):
    """score_vcc2026 on a fake cell-eval2 (runs without it): each member's baseline and
    replicate reported as given, each raw value rescaled by hand's (u - b) / (r - b), the
    member with no scale unscored (None) and out of the mean, the score the mean of the five."""
    from gears.eval.vcc2026 import score_vcc2026

    fake_cell_eval2(monkeypatch)
    real = ad.AnnData(
        X=sp.csr_matrix(np.ones((4, 2), dtype=np.float32)),
        obs=pd.DataFrame({"target": [CONTROL, CONTROL, "G1", "G2"]}, index=list("abcd")),
        var=pd.DataFrame(index=["G1", "G2"]),
    )
    pred = real.copy()
    pred.uns["raw"] = {m: u for m, (u, _, _, _) in HAND.items()}
    got = score_vcc2026({"pred": pred}, real, "target", CONTROL, "counts", threads=1)
    assert got["baseline"] == {m: b for m, (_, b, _, _) in HAND.items()}
    assert got["replicate"] == {m: r for m, (_, _, r, _) in HAND.items()}
    assert list(got["unscored"]) == ["de_wilcoxon_sig_jaccard"]
    scores = got["predictors"]["pred"]
    assert scores["raw"] == pred.uns["raw"]
    for member, (_, _, _, s) in HAND.items():
        if s is None:
            assert scores["scaled"][member] is None
        else:
            assert scores["scaled"][member] == pytest.approx(s, abs=1e-12), member
    assert scores["n_scored"] == 5
    assert scores["score"] == pytest.approx(HAND_SCORE, abs=1e-12)
    assert HAND_SCORE == pytest.approx(0.49)


# ------------------------------------------------------------- scoring never ends a run
def test_a_replicate_at_the_baseline_is_unscored_not_a_crash(monkeypatch):
    """A member whose replicate anchor equals the mean-response baseline at 0.0 (a [0, 1]
    member whose structural worst value is 0: a real 2026 screen's split gave it) made
    cell-eval2's policy raise "metric_min (0.0) must be strictly below anchor (0.0)" out of
    score_vcc2026. It is reported unscored with that reason; the mean names what it used."""
    if not HAS_CELL_EVAL2:
        pytest.skip(NO_CELL_EVAL2)
    import cell_eval2.anchor as anchor_mod
    import polars as pl

    from gears.eval.vcc2026 import rescale, score_vcc2026

    member = "de_wilcoxon_direction_fidelity_yield_raw"
    real, _ = make_vcc2026_layout(
        n_genes=60,
        n_perturbations=6,
        cells_per_perturbation=20,
        n_control_cells=40,
        contexts=("lineA",),
    )
    real.obs = real.obs[["target"]]
    original = anchor_mod.compute_replicate_anchor

    def replicate_at_the_baseline(real, config):
        splits, anchor = original(real, config=config)
        at = pl.when(pl.col("metric") == member).then(0.0).otherwise(pl.col("replicate"))
        return splits, anchor.with_columns(at.alias("replicate"))

    monkeypatch.setattr(anchor_mod, "compute_replicate_anchor", replicate_at_the_baseline)
    got = score_vcc2026({"pred": real.copy()}, real, "target", CONTROL, "counts", threads=1)
    assert got["baseline"][member] == 0.0 and got["replicate"][member] == 0.0
    assert "metric_min (0.0) must be strictly below anchor (0.0)" in got["unscored"][member]
    pred = got["predictors"]["pred"]
    assert pred["scaled"][member] is None and member not in pred["scored_members"]
    assert pred["scored_members"] == [m for m in MEMBERS if pred["scaled"][m] is not None]
    assert pred["score"] == pytest.approx(
        np.mean([pred["scaled"][m] for m in pred["scored_members"]])
    )
    # The public rescale keeps its signature and answers None for such ends, never raises.
    assert rescale(member, 0.3, 0.0, 0.0) is None
    from gears.eval.vcc2026 import scale_problem

    assert "metric_min" in scale_problem(member, 0.0, 0.0)
    assert rescale(member, 0.5, 0.0, 1.0) == pytest.approx(0.5)


def test_scoring_that_fails_keeps_every_context_and_the_summary(
    files, tmp_path, monkeypatch, capsys
):
    """Every context's model/ and metrics.json and the run's summary are written before any
    optional scoring; a scorer that raises prints one line, and the run ends with its models."""
    if not HAS_CELL_EVAL2:
        pytest.skip(NO_CELL_EVAL2)
    import gears.eval.vcc2026

    out = tmp_path / "run"
    seen = []

    def failing_scorer(cfg, pert_data, net, conditions, baseline_means, where):
        for name in ("lineA", "lineB"):
            assert (out / name / "model" / "model.pt").exists(), "model saved before scoring"
            assert (out / name / "metrics.json").exists(), "metrics.json written before scoring"
        assert (out / "metrics.json").exists(), "the run's summary written before scoring"
        seen.append(where)
        raise ValueError(
            "metric_min (0.0) must be strictly below anchor (0.0) for a higher-is-better metric"
        )

    monkeypatch.setattr(gears.eval.vcc2026, "test_split_scores", failing_scorer)
    cfg = _config(
        files,
        tmp_path,
        f"out_dir={out}",
        "train.epochs=1",
        "model.hidden_size=8",
        "train.plot_conditions=0",
        "split.train_gene_set_size=0.6",
        "eval.cell_eval2=true",
    )
    summary = run(cfg, DistEnv(device=torch.device("cpu")))
    assert len(seen) == 2
    err = capsys.readouterr().err
    assert err.count("cell-eval2 scoring failed") == 2, err
    assert "Traceback" not in err
    on_disk = json.loads((out / "metrics.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    for name in ("lineA", "lineB"):
        metrics = json.loads((out / name / "metrics.json").read_text())
        assert metrics["test"]["n_conditions"] >= 2
        assert "metric_min" in metrics["cell_eval2"]["error"]
        assert "metric_min" in on_disk["contexts"][name]["cell_eval2"]["error"]
    assert "cell_eval2" not in on_disk["mean_over_contexts"]


# ------------------------------------------------------------ context names become paths
def test_context_folders_are_safe_names():
    from gears.cli.contexts import SUMMARY_NAMES, context_folder, context_folders

    for name in [".", "..", "../up", "/abs/path", "a/b", "a\\b", ".hidden", "", " ", "x" * 3]:
        folder = context_folder(name)
        assert folder not in (".", "..") and not folder.startswith(".")
        assert "/" not in folder and "\\" not in folder and folder.strip(), (name, folder)
    for summary_name in SUMMARY_NAMES:
        assert context_folder(summary_name) != summary_name
        assert context_folder(summary_name.upper()).casefold() != summary_name.casefold()
    assert context_folder("lineA") == "lineA" and context_folder("K562.v2") == "K562.v2"
    with pytest.raises(GearsInputError, match=r"'line A' and 'line/A' \(both 'line_A'\)"):
        context_folders(["line A", "line/A"])
    with pytest.raises(GearsInputError, match=r"'k562' and 'K562'"):
        context_folders(["k562", "K562"])


def _relabelled(files, tmp_path, mapping) -> str:
    adata = ad.read_h5ad(files["training"])
    adata.obs["cell_line"] = adata.obs["cell_line"].astype(str).map(mapping)
    path = tmp_path / "relabelled.h5ad"
    adata.write_h5ad(path)
    return str(path)


def test_contexts_that_share_a_folder_are_refused_before_training(files, tmp_path):
    data = _relabelled(files, tmp_path, {"lineA": "line A", "lineB": "line/A"})
    out = tmp_path / "run"
    cfg = _config(files, tmp_path, f"data.dataset={data}", f"out_dir={out}", "train.epochs=1")
    with pytest.raises(GearsInputError, match=r"'line A' and 'line/A' \(both 'line_A'\)"):
        run(cfg, DistEnv(device=torch.device("cpu")))
    assert not (out / "line_A").exists(), "no context trained"


@pytest.mark.slow
def test_contexts_named_dot_and_dotdot_stay_inside_out_dir(files, tmp_path):
    """A context named '..' wrote a whole run into out_dir's parent, one named '.' into
    out_dir itself (its summary then overwrote that context's metrics.json)."""
    data = _relabelled(files, tmp_path, {"lineA": "..", "lineB": "."})
    out = tmp_path / "parent" / "run"
    cfg = _config(
        files,
        tmp_path,
        f"data.dataset={data}",
        f"out_dir={out}",
        "train.epochs=1",
        "model.hidden_size=8",
        "train.plot_conditions=0",
        "split.train_gene_set_size=0.6",
    )
    summary = run(cfg, DistEnv(device=torch.device("cpu")))
    assert sorted(p.name for p in (tmp_path / "parent").iterdir()) == ["run"]
    assert summary["folders"] == {"..": "__", ".": "_"}
    for name, folder in summary["folders"].items():
        metrics = json.loads((out / folder / "metrics.json").read_text())
        assert (out / folder / "model" / "model.pt").exists()
        assert summary["contexts"][name]["test"] == metrics["test"]
    assert not (out / "model").exists() and not (out / "checkpoints").exists()
    gene = sorted(set(ad.read_h5ad(data).obs["target"].astype(str)) - {CONTROL})[0]
    preds = predict_main(
        ["--model", str(out), "--perturbations", gene, "--out", str(tmp_path / "p.h5ad")]
    )
    assert sorted(p.name for p in preds) == ["p__.h5ad", "p___.h5ad"]
    index = json.loads((out / "contexts.json").read_text())
    index["contexts"][".."] = "../../elsewhere/model"
    (out / "contexts.json").write_text(json.dumps(index))
    with pytest.raises(GearsInputError, match=r"contexts\.json.*'\.\.'.*outside"):
        predict_main(
            ["--model", str(out), "--perturbations", gene, "--out", str(tmp_path / "q.h5ad")]
        )


@pytest.mark.slow
def test_a_counts_file_naming_another_context_or_only_controls_is_named(run2026, files, tmp_path):
    """A counts CSV row for a context the run has no model of was skipped without a word; a
    context with only control rows crashed in the network (a reshape of 0 elements)."""
    request = pd.read_csv(files["counts"])
    extra = request[request["cell_line"] == "lineA"].assign(cell_line="lineC")
    path = tmp_path / "three_lines.csv"
    pd.concat([request, extra]).to_csv(path, index=False)
    argv = ["--model", str(run2026["out"]), "--out", str(tmp_path / "p.h5ad")]
    with pytest.raises(GearsInputError, match=r"lists context\(s\) \['lineC'\].*no model"):
        predict_main([*argv, "--counts", str(path)])
    assert not list(tmp_path.glob("p_*.h5ad")), "refused before predicting any context"
    control_row = request.iloc[[0]].assign(cell_line="lineB", target=CONTROL)
    only_controls = pd.concat([request[request["cell_line"] == "lineA"], control_row])
    path = tmp_path / "controls_only.csv"
    only_controls.to_csv(path, index=False)
    with pytest.raises(GearsInputError, match=r"no perturbation for context 'lineB'.*only"):
        predict_main([*argv, "--counts", str(path)])
