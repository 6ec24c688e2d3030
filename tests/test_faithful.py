"""Faithfulness to GEARS: control_mean all vs paired, the model-selection rule, train_fit in
metrics.json, the seeds summary, and the input pieces of benchmarks/vs_cell_gears.py."""

from __future__ import annotations

import importlib.util
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import TINY_CLI, tiny_split

from gears.compat.api import GEARS
from gears.config import TrainConfig, load_config
from gears.data.pertdata import PertData
from gears.errors import GearsInputError
from gears.train.distributed import DistEnv
from gears.train.engine import Trainer, seed_everything, selection_score
from gears.train.evaluate import Evaluator, predict_deltas

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> PertData:
    return tiny_split(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def net(tiny) -> torch.nn.Module:
    seed_everything(0)
    model = GEARS(tiny, device="cpu").model_initialize(hidden_size=16)
    return model.model.eval()


# ------------------------------------------------------------------------------ control_mean
def test_paired_is_change_plus_mean_of_each_conditions_paired_controls(tiny, net):
    """paired (GEARS's protocol, the old behaviour): per condition, the mean over its test cells
    of (change + the control cell paired with that cell)."""
    ev = Evaluator(tiny, net=net, control_mean="paired")
    view = ev.set_view("test")
    delta, _ = predict_deltas(net, tiny.cond_pert_index[view["cond_ids"]])
    ds = tiny.example_set("test")
    examples = np.flatnonzero(np.isin(ds.cond, view["cond_ids"]))
    paired_rows = ds.control_rows(examples, 0)
    X = tiny.expr.numpy().astype(np.float64)
    expected = np.stack(
        [
            delta[i] + X[paired_rows[ds.cond[examples] == cid]].mean(0)
            for i, cid in enumerate(view["cond_ids"])
        ]
    )
    np.testing.assert_allclose(ev.predict_means("test"), expected, atol=1e-5)


def test_all_is_change_plus_mean_of_every_control_cell(tiny, net):
    ev = Evaluator(tiny, net=net)  # the default
    assert ev.control_mean == "all"
    view = ev.set_view("test")
    delta, _ = predict_deltas(net, tiny.cond_pert_index[view["cond_ids"]])
    X = tiny.expr.numpy().astype(np.float64)
    ctrl = X[tiny.ctrl_rows].mean(0)
    np.testing.assert_allclose(ev.predict_means("test"), delta + ctrl[None, :], atol=1e-5)
    paired = Evaluator(tiny, net=net, control_mean="paired").predict_means("test")
    assert np.abs(paired - ev.predict_means("test")).max() > 1e-3  # they really differ


def test_all_agrees_with_predict(tiny, net):
    model = GEARS(tiny, device="cpu")
    model.model = net
    ev = Evaluator(tiny, net=net)
    view = ev.set_view("test")
    cond = view["conditions"][0]
    genes = [g for g in cond.split("+") if g != "ctrl"]
    got = next(iter(model.predict([genes]).values()))
    np.testing.assert_allclose(ev.predict_means("test")[0], got, atol=1e-5)


def test_unknown_control_mean_is_a_clear_error(tiny):
    with pytest.raises(GearsInputError, match="control_mean"):
        Evaluator(tiny, control_mean="random")
    with pytest.raises(GearsInputError, match="eval.control_mean"):
        load_config(overrides=["eval.control_mean=pairs"])


# ------------------------------------------------------------------------------ selection
def test_selection_score_rules():
    val = {"mse": 0.2, "mse_de": 0.9}
    assert selection_score("val_mse_de", val, 5.0, 3) == 0.9
    assert selection_score("val_mse", val, 5.0, 3) == 0.2
    assert selection_score("val_mse", {}, 5.0, 3) == 5.0  # no validation set: training loss
    assert selection_score("last", val, 5.0, 4) < selection_score("last", val, 5.0, 3)
    with pytest.raises(GearsInputError, match="train.select"):
        selection_score("best", val, 5.0, 0)


@pytest.mark.parametrize("rule", ["last", "val_mse_de", "val_mse"])
def test_fit_keeps_the_epoch_the_rule_picks(tiny, rule):
    seed_everything(0)
    model = GEARS(tiny, device="cpu").model_initialize(hidden_size=16)
    cfg = TrainConfig(epochs=4, batch_size=32, limit_batches=3, select=rule, lr=3e-3)
    loaders = tiny.get_dataloader_distributed(cfg.batch_size, 64)
    trainer = Trainer(model.model, tiny, cfg, model.model_config(), DistEnv())
    trainer.fit(loaders, progress=False)
    history = trainer.history
    if rule == "last":
        expected = cfg.epochs - 1
    else:
        key = rule.removeprefix("val_")
        expected = int(np.argmin([v[key] for v in history.val]))
    assert trainer.best_epoch == expected
    # The kept weights are that epoch's: its validation numbers come back exactly.
    again = trainer.evaluator.quick("val")
    for k, v in history.val[expected].items():
        assert again[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k


def test_gears_paper_config_is_gears_recipe():
    cfg = load_config(ROOT / "configs" / "gears_paper.yaml", base=ROOT / "configs" / "default.yaml")
    t = cfg.train
    assert (t.schedule, t.step_gamma, t.select, t.epochs) == ("step", 0.5, "val_mse_de", 20)
    assert (t.lr, t.weight_decay, t.batch_size, cfg.model.hidden_size) == (1e-3, 5e-4, 32, 64)
    assert cfg.eval.control_mean == "paired"
    default = load_config(base=ROOT / "configs" / "default.yaml")
    assert (default.train.select, default.eval.control_mean) == ("last", "all")


# ------------------------------------------------------------------------- train_fit, seeds
@pytest.fixture(scope="module")
def seeds_run(tmp_path_factory):
    from gears.cli.seeds import main

    out = tmp_path_factory.mktemp("seeds")
    overrides = [
        f"out_dir={out}",
        f"data.data_dir={out / 'data'}",
        f"data.synthetic={TINY_CLI}",
        "train.epochs=2",
        "train.limit_batches=4",
        "train.plot_conditions=0",
        "wandb.mode=disabled",
    ]
    summary = main(["--seeds", "1,2", *overrides])
    return out, summary, overrides


def test_metrics_json_has_train_fit_and_its_baselines(seeds_run, tiny):
    out, _, _ = seeds_run
    metrics = json.loads((out / "seed_1" / "metrics.json").read_text())
    fit, baselines = metrics["train_fit"], metrics["train_fit_baselines"]
    assert {"mse", "mse_de", "pearson_delta", "n_conditions"} <= set(fit)
    assert set(baselines) == {"no_change", "train_mean", "additive", "linear"}
    n_train = len([c for c in tiny.set2conditions["train"] if c != "ctrl"])  # same split
    assert fit["n_conditions"] == n_train > 0
    for row in (fit, *baselines.values()):
        assert row["mse"] >= 0 and row["n_conditions"] == fit["n_conditions"]
    # train_mean is an average of the very perturbations scored: it cannot be worse than
    # predicting no change on their mean squared error summed over conditions and genes.
    assert baselines["train_mean"]["mse"] <= baselines["no_change"]["mse"] + 1e-12
    assert metrics["select"] == "last" and metrics["best_epoch"] == 2
    assert metrics["control_mean"] == "all"


def test_seeds_summary_mean_and_sd_over_seeds(seeds_run):
    out, summary, overrides = seeds_run
    per_seed = [json.loads((out / f"seed_{s}" / "metrics.json").read_text()) for s in (1, 2)]
    assert summary["seeds"] == [1, 2]
    # split.seed and seed both follow the seed: the two splits differ
    assert per_seed[0]["test"]["mse"] != per_seed[1]["test"]["mse"]
    stats = summary["test"]["overall"]["gears"]["mse"]
    values = [r["test"]["mse"] for r in per_seed]
    assert stats["values"] == pytest.approx(values)
    assert stats["mean"] == pytest.approx(np.mean(values))
    assert stats["sd"] == pytest.approx(np.std(values, ddof=1))
    b = summary["test"]["overall"]["train_mean"]["pearson_delta"]
    assert b["values"] == pytest.approx(
        [r["baselines"]["train_mean"]["pearson_delta"] for r in per_seed]
    )
    assert "unseen_single" in summary["test"]
    assert summary["train_fit"]["gears"]["mse"]["n"] == 2
    md = (out / "seeds_summary.md").read_text()
    assert "| overall" in md and "train fit" in md and "±" in md
    on_disk = json.loads((out / "seeds_summary.json").read_text())
    assert on_disk["test"]["overall"]["gears"]["mse"]["mean"] == pytest.approx(stats["mean"])


def test_seeds_collect_rebuilds_the_summary(seeds_run):
    from gears.cli.seeds import main

    out, summary, overrides = seeds_run
    (out / "seeds_summary.json").unlink()
    again = main(["--collect", *overrides])
    assert again["test"]["overall"]["gears"]["mse"] == summary["test"]["overall"]["gears"]["mse"]


def test_bad_seeds_are_a_clear_error():
    from gears.cli.seeds import parse_seeds

    assert parse_seeds("[1, 2,3]") == [1, 2, 3]
    for bad in ("1,x", "", "1,1"):
        with pytest.raises(GearsInputError, match="--seeds"):
            parse_seeds(bad)


# ------------------------------------------------------------------- vs_cell_gears pieces
def _vs_module():
    spec = importlib.util.spec_from_file_location(
        "vs_cell_gears", ROOT / "benchmarks" / "vs_cell_gears.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_vs_cell_gears_inputs_and_custom_split(tiny, tmp_path):
    import anndata as ad

    vs = _vs_module()
    info = vs.write_inputs(tiny, tmp_path)
    adata = ad.read_h5ad(tmp_path / "screen.h5ad")
    assert info["cells"] == adata.n_obs == tiny.adata.n_obs
    assert list(adata.var["gene_name"]) == list(tiny.gene_names)
    assert set(adata.obs["condition"]) == set(tiny.adata.obs["condition"].astype(str))
    assert "cell_type" in adata.obs and not adata.uns  # no DE: each tool computes its own
    np.testing.assert_array_equal(
        np.asarray(adata.X.todense() if hasattr(adata.X, "todense") else adata.X),
        np.asarray(tiny.adata.X.todense() if hasattr(tiny.adata.X, "todense") else tiny.adata.X),
    )
    with open(tmp_path / "gene2go_all.pkl", "rb") as f:
        pkl = pickle.load(f)
    tsv = dict(line.split("\t") for line in (tmp_path / "gene2go.tsv").read_text().splitlines())
    assert pkl and {g: set(t.split(",")) for g, t in tsv.items()} == pkl
    # Our split on the shared input equals the split written for cell-gears, and both tools
    # would train and test on the same perturbations.
    ours = vs.load_shared(tmp_path, seed=3, data_dir=tmp_path / "d")
    vs.write_split(ours, tmp_path / "split.pkl")
    with open(tmp_path / "split.pkl", "rb") as f:
        split = pickle.load(f)
    assert set(split) == {"train", "val", "test"}
    assert split["test"] == list(ours.set2conditions["test"]) and "ctrl" in split["train"]
    again = vs.load_shared(tmp_path, seed=3, data_dir=tmp_path / "d2")
    assert vs.split_dict(again) == split
    other = vs.load_shared(tmp_path, seed=4, data_dir=tmp_path / "d3")
    assert vs.split_dict(other) != split


def test_vs_cell_gears_alignment_and_markdown():
    vs = _vs_module()
    rows = np.arange(6.0).reshape(3, 2)
    out = vs.aligned(["b", "x", "a"], np.array(["a", "b", "c"]), rows)
    np.testing.assert_array_equal(out[0], rows[1])
    assert np.isnan(out[1]).all()
    np.testing.assert_array_equal(out[2], rows[0])
    assert vs.synthetic_params(500, 2000)["cells_per_condition"] * 100 + 1000 == 2000
    assert vs._ms([1.0, 3.0]) == f"2.000 ± {np.std([1.0, 3.0], ddof=1):.3f}"
