"""predict.py: predicted cells as AnnData (the Virtual Cell Challenge layout), its inputs and
errors, GEARS.predict agreement, batching, and cell-eval scoring of a prediction."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from vcc_helpers import HAS_CELL_EVAL, NO_CELL_EVAL, ROOT

from gears.cli.job import guarded
from gears.compat.api import GEARS
from gears.compat.pretrained import load_model
from gears.data.pertdata import PertData
from gears.data.synthetic import write_pert_counts
from gears.errors import GearsInputError
from gears.eval.counts import MAX_COUNTS_PER_CELL, SAMPLERS
from gears.eval.predicted_cells import MEAN_KEY, UNCERTAINTY_LAYER, predict_cells, read_counts
from gears.train import checkpoint as ckpt
from predict import main as predict_main

CONTROL = "non-targeting"


def _genes(vcc_run) -> list[str]:
    return json.loads((vcc_run["model"] / "config.json").read_text())["gene_names"]


def _perturbations(vcc_run) -> tuple[list[str], str]:
    """Two perturbations seen in the file and one measured gene never perturbed."""
    raw = ad.read_h5ad(vcc_run["h5ad"])
    seen = sorted(set(raw.obs["target_gene"].astype(str)) - {CONTROL})
    unseen = next(g for g in _genes(vcc_run) if g not in seen)
    return seen[:2] + [unseen], unseen


def _dense(X) -> np.ndarray:
    return X.toarray() if sp.issparse(X) else np.asarray(X)


@pytest.fixture(scope="module")
def prediction(vcc_run, tmp_path_factory):
    labels, _ = _perturbations(vcc_run)
    out = tmp_path_factory.mktemp("pred") / "pred.h5ad"
    predict_main(
        [
            "--model",
            str(vcc_run["model"]),
            "--perturbations",
            ",".join(labels),
            "--cells-per-perturbation",
            "7",
            "--out",
            str(out),
        ]
    )
    return labels, out


def test_output_round_trips_with_documented_obs_var_layers_uns(vcc_run, prediction):
    labels, out = prediction
    pred = ad.read_h5ad(out)
    assert list(pred.var_names) == _genes(vcc_run), "genes in the training order"
    counts = pred.obs["target_gene"].astype(str).value_counts()
    assert {g: counts[g] for g in labels} == {g: 7 for g in labels}
    assert counts[CONTROL] == ad.read_h5ad(vcc_run["model"] / "control_cells.h5ad").n_obs
    assert set(counts.index) == {CONTROL, *labels}, "the input's spelling: bare symbols"
    assert (pred.obs["predicted"] == (pred.obs["target_gene"] != CONTROL)).all()
    assert set(pred.obs["gears_condition"].astype(str)) == {"ctrl", *(f"{g}+ctrl" for g in labels)}
    assert (_dense(pred.X) >= 0).all()
    mean = pred.uns[MEAN_KEY]
    assert list(mean["perturbations"]) == labels
    assert mean["mean"].shape == (len(labels), pred.n_vars)
    assert len(mean["confidence"]) == len(labels)
    layer = pred.layers[UNCERTAINTY_LAYER]  # the model has the uncertainty head
    is_pred = pred.obs["predicted"].values
    assert np.isnan(layer[~is_pred]).all() and np.isfinite(layer[is_pred]).all()


def test_each_cell_is_a_real_control_cell_plus_the_predicted_change(vcc_run, prediction):
    labels, out = prediction
    pred = ad.read_h5ad(out)
    controls = ad.read_h5ad(vcc_run["model"] / "control_cells.h5ad")
    ctrl_X = _dense(controls.X)
    row_of = {name: i for i, name in enumerate(controls.obs_names)}
    ctrl_mean = np.asarray(ckpt.load(vcc_run["model"] / "model.pt")["ctrl_expression"])
    mean = pred.uns[MEAN_KEY]
    X = _dense(pred.X)
    for p, label in enumerate(labels):
        rows = np.flatnonzero(pred.obs["target_gene"].astype(str).values == label)
        source = [row_of[c] for c in pred.obs["control_cell"].values[rows]]
        assert len(set(source)) == len(source), "distinct control cells while they last"
        change = (mean["mean"][p] - ctrl_mean).astype(np.float32)
        expected = np.maximum(ctrl_X[source] + change, 0)
        np.testing.assert_allclose(X[rows], expected, rtol=0, atol=1e-5)
        # Per-cell uncertainty is the perturbation's (the network sees no cell).
        assert np.allclose(
            pred.layers[UNCERTAINTY_LAYER][rows], pred.layers[UNCERTAINTY_LAYER][rows[0]]
        )
    control_rows = np.flatnonzero(~pred.obs["predicted"].values)
    np.testing.assert_array_equal(X[control_rows], ctrl_X)


def test_per_perturbation_means_equal_gears_predict(vcc_run, prediction):
    labels, out = prediction
    cfg = vcc_run["cfg"]
    pert_data = PertData(cfg.data.data_dir, gene2go=cfg.data.gene2go, verbose=False).load(
        data_path=vcc_run["h5ad"], normalize=cfg.data.normalize
    )
    model = GEARS(pert_data, device="cpu").load_pretrained(vcc_run["model"])
    expected, confidence = model.predict([[g] for g in labels])
    mean = ad.read_h5ad(out).uns[MEAN_KEY]
    for p, label in enumerate(labels):
        np.testing.assert_allclose(mean["mean"][p], expected[label], rtol=0, atol=1e-12)
        assert mean["confidence"][p] == pytest.approx(confidence[label], rel=1e-9)


def test_vcc_counts_file_sets_cells_per_perturbation(vcc_run, tmp_path):
    raw = ad.read_h5ad(vcc_run["h5ad"])
    labels, unseen = _perturbations(vcc_run)
    counts = write_pert_counts(raw, tmp_path / "pert_counts_Validation.csv", labels[:2])
    frame = pd.read_csv(counts)
    assert list(frame.columns) == ["target_gene", "n_cells", "median_umi_per_cell"]
    frame.loc[len(frame)] = [unseen, 3, 1000.0]
    frame.loc[len(frame)] = [CONTROL, 5, 1000.0]  # a control row sets the control cells
    frame.to_csv(counts, index=False)
    out = tmp_path / "val.h5ad"
    pred = predict_main(
        ["--model", str(vcc_run["model"]), "--counts", str(counts), "--out", str(out)]
    )
    got = ad.read_h5ad(out).obs["target_gene"].astype(str).value_counts().to_dict()
    assert got == {**dict(zip(frame["target_gene"], frame["n_cells"]))}
    assert pred.n_obs == frame["n_cells"].sum()


def test_one_forward_per_chunk_of_perturbations_not_per_cell(vcc_run):
    model, info, controls = load_model(vcc_run["model"])
    calls = []
    handle = model.model.register_forward_hook(lambda *a: calls.append(1))
    labels, _ = _perturbations(vcc_run)
    pred = predict_cells(model, info, controls, labels, [400, 300, 200])
    handle.remove()
    assert pred.n_obs == controls.n_obs + 900
    assert len(calls) == 1


def _run_cli(argv, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as stop:
        guarded(lambda: predict_main(argv))
    return stop.value.code, capsys.readouterr().err


def test_genes_outside_the_vocabulary_are_listed_exit_2(vcc_run, tmp_path, capsys):
    labels, _ = _perturbations(vcc_run)
    argv = ["--model", str(vcc_run["model"]), "--out", str(tmp_path / "p.h5ad")]
    code, err = _run_cli([*argv, "--perturbations", f"NOPE1,{labels[0]},NOPE2"], capsys)
    assert code == 2 and "NOPE1" in err and "NOPE2" in err and "vocabulary" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "p.h5ad").exists()


def test_bad_requests_exit_2_with_one_line(vcc_run, tmp_path, capsys):
    model = str(vcc_run["model"])
    out = str(tmp_path / "p.h5ad")
    bad_counts = tmp_path / "bad.csv"
    bad_counts.write_text("target_gene,cells\nSG0001,3\n")
    cases = {
        "n_cells": ["--model", model, "--counts", str(bad_counts), "--out", out],
        "not a saved GEARS model": ["--model", str(tmp_path), "--perturbations", "A", "--out", out],
        "control": ["--model", model, "--perturbations", CONTROL, "--out", out],
        "names no perturbation": ["--model", model, "--perturbations", " , ", "--out", out],
        "must end in .h5ad": ["--model", model, "--perturbations", "A", "--out", "p.csv"],
    }
    for needle, argv in cases.items():
        code, err = _run_cli(argv, capsys)
        assert code == 2 and needle in err and err.count("\n") == 1, (needle, err)


def test_perturbation_file_one_a_line(vcc_run, tmp_path):
    labels, _ = _perturbations(vcc_run)
    listing = tmp_path / "perts.txt"
    listing.write_text("# requested\n" + "\n".join(labels) + "\n\n")
    out = tmp_path / "p.h5ad"
    argv = ["--model", str(vcc_run["model"]), "--perturbations", str(listing)]
    pred = predict_main(
        [*argv, "--cells-per-perturbation", "2", "--control-cells", "4", "--out", str(out)]
    )
    assert pred.obs["target_gene"].astype(str).value_counts().to_dict() == {
        CONTROL: 4,
        **{g: 2 for g in labels},
    }


def test_real_file_is_scored_with_cell_eval(vcc_run, prediction, tmp_path):
    if not HAS_CELL_EVAL:
        pytest.skip(NO_CELL_EVAL)
    labels, _ = prediction
    out = tmp_path / "scored.h5ad"
    argv = ["--model", str(vcc_run["model"]), "--perturbations", ",".join(labels)]
    # The real file is the raw-count training file itself: its counts are normalised as in
    # training; the never-perturbed gene is absent from it and is left out of the scores.
    predict_main([*argv, "--out", str(out), "--real", str(vcc_run["h5ad"])])
    scores = json.loads((tmp_path / "scored.metrics.json").read_text())["cell_eval"]["gears"]
    assert scores["n_perturbations"] == 2
    for metric in ("mae", "overlap_at_N", "discrimination_score_l1"):
        assert scores[metric] is not None and math.isfinite(scores[metric])
    assert (tmp_path / "scored_cell_eval" / "results.csv").exists()


@pytest.mark.slow
def test_command_line_exit_code_2(vcc_run, tmp_path):
    """The script itself (not only main()): bad input is one line on stderr and status 2."""
    out = tmp_path / "cli.h5ad"
    cmd = [sys.executable, "predict.py", "--model", str(vcc_run["model"]), "--out", str(out)]
    bad = subprocess.run(
        [*cmd, "--perturbations", "NOT_A_GENE"], cwd=ROOT, capture_output=True, text=True
    )
    assert bad.returncode == 2 and bad.stderr.startswith("error:") and "NOT_A_GENE" in bad.stderr
    assert bad.stderr.count("\n") == 1 and not out.exists()


def test_labels_follow_the_training_datas_spelling(vcc_run):
    model, info, controls = load_model(vcc_run["model"])
    labels, unseen = _perturbations(vcc_run)
    asked = [f"{labels[0]}+ctrl", f"ctrl+{unseen}"]
    pred = predict_cells(model, info, controls, asked, [2, 2])
    # The challenge's file writes singles as bare symbols: so does the prediction.
    assert set(pred.obs["target_gene"].astype(str)) == {CONTROL, labels[0], unseen}
    assert list(pred.uns[MEAN_KEY]["perturbations"]) == [labels[0], unseen]


def _prediction_inputs(vcc_run, n_genes=None):
    model, info, controls = load_model(vcc_run["model"])
    labels, _ = _perturbations(vcc_run)
    rng = np.random.default_rng(0)
    delta = rng.normal(0, 0.5, (len(labels), controls.n_vars))
    logvar = rng.normal(0, 1, (len(labels), controls.n_vars))
    args = (labels, [f"{g}+ctrl" for g in labels], delta, [50, 30, 20], controls, "target_gene")
    return args, dict(control_label=CONTROL, n_control=40, seed=3, logvar=logvar, ctrl_mean=None)


def test_written_in_chunks_equals_the_in_memory_prediction(vcc_run, tmp_path):
    """write_prediction (a few cells per chunk here) writes prediction_adata's cells: the same
    obs, X bit for bit (stored as CSR float32 without zeros, indptr as wide as indices), layer
    and uns."""
    from gears.eval.predicted_cells import prediction_adata, write_prediction

    args, kwargs = _prediction_inputs(vcc_run)
    expected = prediction_adata(*args, **kwargs)
    n_genes = expected.n_vars
    write_prediction(tmp_path / "p.h5ad", *args, **kwargs, chunk_bytes=4 * n_genes * 7)
    got = ad.read_h5ad(tmp_path / "p.h5ad")
    assert sp.issparse(got.X) and got.X.format == "csr" and got.X.dtype == np.float32
    assert got.X.indptr.dtype == got.X.indices.dtype == np.int32 and (got.X.data != 0).all()
    np.testing.assert_array_equal(got.X.toarray(), expected.X)
    pd.testing.assert_frame_equal(got.obs, expected.obs)
    np.testing.assert_array_equal(got.layers[UNCERTAINTY_LAYER], expected.layers[UNCERTAINTY_LAYER])
    assert got.uns["gears_condition_key"] == "target_gene"
    assert not list(tmp_path.glob(".p.h5ad.tmp*")), "no temporary file left"


def test_writing_a_prediction_holds_one_chunk_not_the_output(tmp_path):
    """Peak memory of write_prediction stays far below the output's dense size (numpy's
    allocations, traced): 6,000 cells x 2,000 genes here (48 MB dense, twice with the
    log-variance layer); at VCC size the output is 4.3 GB (docs/predictions.md)."""
    import tracemalloc

    from gears.eval.predicted_cells import write_prediction

    rng = np.random.default_rng(0)
    n_genes, labels = 2000, ["A", "B", "C"]
    X = sp.random(200, n_genes, density=0.3, format="csr", dtype=np.float32, random_state=0)
    controls = ad.AnnData(
        X=X,
        obs=pd.DataFrame(index=[f"c{i}" for i in range(200)]),
        var=pd.DataFrame(index=[f"g{i}" for i in range(n_genes)]),
    )
    delta = rng.normal(0, 0.5, (3, n_genes))
    n_cells = [2500, 2000, 1500]
    dense_bytes = 4 * sum(n_cells) * n_genes
    tracemalloc.start()
    try:
        write_prediction(
            tmp_path / "big.h5ad",
            labels,
            [f"{g}+ctrl" for g in labels],
            delta,
            n_cells,
            controls,
            "target_gene",
            CONTROL,
            logvar=delta,
            chunk_bytes=2**20,
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Memory holds the control cells (1.6 MB dense), the changes and a 1 MB chunk's few copies
    # (the CSR conversion's int64 coordinates included): measured 9.1 MB.
    assert peak < dense_bytes / 4, (peak, dense_bytes)
    assert ad.read_h5ad(tmp_path / "big.h5ad", backed="r").n_obs == sum(n_cells) + 200


def test_prediction_file_passes_cell_eval_prep(vcc_run, tmp_path):
    """`cell-eval prep`'s checks and conversion accept the chunked file as it is (CSR float32)."""
    if not HAS_CELL_EVAL:
        pytest.skip(NO_CELL_EVAL)
    import shutil

    if shutil.which("zstd") is None:
        pytest.skip("cell-eval prep needs the zstd command, which is not installed")
    from cell_eval._cli._prep import strip_anndata

    from gears.eval.predicted_cells import write_prediction

    args, kwargs = _prediction_inputs(vcc_run)
    write_prediction(tmp_path / "p.h5ad", *args, **kwargs)
    pred = ad.read_h5ad(tmp_path / "p.h5ad")
    strip_anndata(
        pred,
        str(tmp_path / "p.prep.vcc"),
        list(pred.var_names),
        pert_col="target_gene",
        ntc_name=CONTROL,
        encoding=32,
        exp_gene_dim=None,
    )
    assert (tmp_path / "p.prep.vcc").stat().st_size > 0


# ------------------------------------------------------------- hostile inputs (one clear line)
def test_out_that_is_a_directory_fails_before_any_prediction(vcc_run, tmp_path, capsys):
    """--out naming a folder stops at once (it used to fail only after every cell was computed)."""
    import gears.compat.pretrained as gp

    labels, _ = _perturbations(vcc_run)
    calls = []
    real_load = gp.load_model
    gp.load_model = lambda *a, **k: calls.append(1) or real_load(*a, **k)
    try:
        argv = ["--model", str(vcc_run["model"]), "--perturbations", labels[0]]
        (tmp_path / "dir.h5ad").mkdir()
        code, err = _run_cli([*argv, "--out", str(tmp_path / "dir.h5ad")], capsys)
    finally:
        gp.load_model = real_load
    assert code == 2 and "is a directory" in err and err.count("\n") == 1, err
    assert not calls, "the model was loaded before --out was checked"


def test_bad_numbers_in_the_request_are_one_line(vcc_run, tmp_path, capsys):
    """--seed -1, n_cells 1e20 in a counts file and a huge --cells-per-perturbation used to end
    in numpy's tracebacks (negative seed, int64 overflow / a memory error)."""
    labels, _ = _perturbations(vcc_run)
    base = ["--model", str(vcc_run["model"]), "--out", str(tmp_path / "p.h5ad")]
    huge = tmp_path / "huge.csv"
    huge.write_text(f"target_gene,n_cells\n{labels[0]},1e20\n")
    cases = {
        "--seed": [*base, "--perturbations", labels[0], "--seed", "-1"],
        "n_cells must be whole numbers from 1": [*base, "--counts", str(huge)],
        "--cells-per-perturbation must be": [
            *base,
            "--perturbations",
            labels[0],
            "--cells-per-perturbation",
            str(10**20),
        ],
    }
    for needle, argv in cases.items():
        code, err = _run_cli(argv, capsys)
        assert code == 2 and needle in err and err.count("\n") == 1, (needle, err)
    assert not (tmp_path / "p.h5ad").exists()


def test_empty_or_garbled_counts_file_is_one_line(vcc_run, tmp_path, capsys):
    base = ["--model", str(vcc_run["model"]), "--out", str(tmp_path / "p.h5ad")]
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    binary = tmp_path / "binary.csv"
    binary.write_bytes(b"\xff\xfe\x00\x81garbage\x00" * 50)
    header_only = tmp_path / "header.csv"
    header_only.write_text("target_gene,n_cells,median_umi_per_cell\n")
    for path, needle in (
        (empty, "empty or not a CSV"),
        (binary, "--counts"),
        (header_only, "no rows"),
    ):
        code, err = _run_cli([*base, "--counts", str(path)], capsys)
        assert code == 2 and needle in err and err.count("\n") == 1, (path.name, err)
        assert "Traceback" not in err


def test_truncated_control_cells_file_is_one_line(vcc_run, tmp_path, capsys):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(vcc_run["model"], model)
    cells = model / "control_cells.h5ad"
    cells.write_bytes(cells.read_bytes()[: cells.stat().st_size // 3])
    labels, _ = _perturbations(vcc_run)
    argv = ["--model", str(model), "--perturbations", labels[0], "--out", str(tmp_path / "p.h5ad")]
    code, err = _run_cli(argv, capsys)
    assert code == 2 and "control_cells.h5ad" in err and "truncated or damaged" in err, err
    assert err.count("\n") == 1


def test_labels_with_blanks_are_written_without_them(vcc_run, tmp_path):
    """A training file spelling a perturbation ' G000 ' (blanks around it): the model knows
    G000, and predict.py's obs says 'G000', as the counts file and --perturbations do."""
    cfg = vcc_run["cfg"]
    raw = ad.read_h5ad(vcc_run["h5ad"])
    gene = next(g for g in raw.obs["target_gene"].astype(str) if g != CONTROL)
    raw.obs["target_gene"] = raw.obs["target_gene"].astype(str).replace(gene, f" {gene} ")
    pert_data = PertData(tmp_path / "data", gene2go=cfg.data.gene2go, verbose=False)
    pert_data.new_data_process("blanks", raw, normalize="log1p", write=False)
    assert pert_data.condition_spelling[f"{gene}+ctrl"] == gene
    pert_data.prepare_split("simulation_single", seed=1)
    model = GEARS(pert_data, device="cpu")
    model.model_initialize(hidden_size=8)
    model.save_model(tmp_path / "model")
    out = tmp_path / "p.h5ad"
    predict_main(
        ["--model", str(tmp_path / "model"), "--perturbations", f" {gene} ", "--out", str(out)]
    )
    assert set(ad.read_h5ad(out).obs["target_gene"].astype(str)) == {CONTROL, gene}


def _limited_file_size(limit: int):
    """preexec_fn: files this process writes stop at `limit` bytes (EFBIG, as a full disk
    gives ENOSPC): the same failed write inside HDF5, without needing a small filesystem."""
    import resource
    import signal

    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.mark.slow
def test_a_full_disk_while_writing_is_one_line_and_keeps_the_old_file(vcc_run, tmp_path):
    """Before: h5py's RuntimeError on close, then a segmentation fault (exit 139). Now: exit 2,
    one line naming the file, no temporary file left, the earlier output untouched."""
    labels, _ = _perturbations(vcc_run)
    out = tmp_path / "pred.h5ad"
    out.write_bytes(b"an earlier prediction")
    cmd = [sys.executable, "predict.py", "--model", str(vcc_run["model"]), "--out", str(out)]
    cmd += ["--perturbations", ",".join(labels), "--cells-per-perturbation", "4000"]
    run = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, preexec_fn=_limited_file_size(300_000)
    )
    assert run.returncode == 2, (run.returncode, run.stderr[-2000:])
    assert run.stderr.startswith("error: could not write") and run.stderr.count("\n") == 1
    assert out.read_bytes() == b"an earlier prediction"
    assert not list(tmp_path.glob(".pred.h5ad.tmp*")), "temporary file left behind"


def test_a_killed_writers_temporary_file_is_removed_by_the_next_run(vcc_run, tmp_path):
    """SIGKILL mid-write leaves the hidden temporary file (.<name>.tmp<pid>; nothing can run on
    a kill): the next write of the same output removes it; one of a writer still running stays."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "pred.h5ad"
    stale = tmp_path / f".pred.h5ad.tmp{dead.pid}"
    stale.write_bytes(b"half an h5ad")
    live = tmp_path / f".pred.h5ad.tmp{os.getppid()}"
    live.write_bytes(b"another writer's")
    labels, _ = _perturbations(vcc_run)
    predict_main(
        ["--model", str(vcc_run["model"]), "--perturbations", labels[0], "--out", str(out)]
    )
    assert out.exists() and not stale.exists() and live.exists()


# ----------------------------------------------------------------------------- counts output
def _counts_of(path) -> tuple[pd.DataFrame, np.ndarray]:
    pred = ad.read_h5ad(path)
    return pred.obs, _dense(pred.X)


def test_the_seed_changes_the_counts_predict_py_draws(vcc_run, tmp_path):
    """A model folder with one saved control cell: every predicted cell is that cell plus its
    perturbation's change, whatever the seed, so only the counts sampler's draws can differ.
    The same --seed gives the same counts; another --seed, other counts."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(vcc_run["model"], model)
    one = ad.read_h5ad(model / "control_cells.h5ad")[:1].copy()
    one.write_h5ad(model / "control_cells.h5ad")
    labels, _ = _perturbations(vcc_run)
    base = ["--model", str(model), "--perturbations", labels[0], "--output", "counts"]
    base += ["--sampler", "poisson", "--cells-per-perturbation", "30"]
    got = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        predict_main([*base, "--seed", str(seed), "--out", str(tmp_path / f"{name}.h5ad")])
        got[name] = _counts_of(tmp_path / f"{name}.h5ad")
    obs, first = got["a"]
    assert (obs["control_cell"] == one.obs_names[0]).all()
    pd.testing.assert_frame_equal(obs, got["c"][0])  # the same cells, whatever the seed
    np.testing.assert_array_equal(first, got["b"][1])
    predicted = obs["predicted"].to_numpy()
    assert predicted.sum() == 30
    assert not np.array_equal(first[predicted], got["c"][1][predicted])


def test_a_median_umi_of_exactly_the_cap_is_accepted(vcc_run, tmp_path):
    """median_umi_per_cell may be the challenge's cap itself (1e6 counts a cell), not above."""
    labels, _ = _perturbations(vcc_run)
    csv = tmp_path / "counts.csv"
    csv.write_text(f"target_gene,n_cells,median_umi_per_cell\n{labels[0]},4,1000000\n")
    assert read_counts(csv, "target_gene").median_umi == {labels[0]: 1e6}
    out = tmp_path / "p.h5ad"
    argv = ["--model", str(vcc_run["model"]), "--counts", str(csv), "--output", "counts"]
    predict_main([*argv, "--out", str(out)])
    obs, X = _counts_of(out)
    totals = X[obs["predicted"].to_numpy()].sum(axis=1)
    assert len(totals) == 4 and totals.max() <= MAX_COUNTS_PER_CELL and totals.min() > 1e5
    csv.write_text(f"target_gene,n_cells,median_umi_per_cell\n{labels[0]},4,1000001\n")
    with pytest.raises(GearsInputError, match="median_umi_per_cell must be > 0 and <="):
        read_counts(csv, "target_gene")


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_control_cells_are_their_own_raw_counts_under_every_sampler(vcc_run, tmp_path, sampler):
    """The control cells of a counts prediction are the training file's raw counts of the saved
    control cells they name, exactly: no sampler draws them (and no depth is applied)."""
    labels, _ = _perturbations(vcc_run)
    out = tmp_path / "p.h5ad"
    argv = ["--model", str(vcc_run["model"]), "--perturbations", ",".join(labels[:2])]
    argv += ["--output", "counts", "--sampler", sampler, "--cells-per-perturbation", "5"]
    predict_main([*argv, "--out", str(out)])
    obs, X = _counts_of(out)
    control = ~obs["predicted"].to_numpy()
    assert control.sum() == 100  # every saved control cell
    raw = ad.read_h5ad(vcc_run["h5ad"])
    names = obs["control_cell"].to_numpy()[control]
    expected = _dense(raw[names, _genes(vcc_run)].X)
    assert expected.sum() > 0
    np.testing.assert_array_equal(X[control], expected)


def test_a_model_folders_own_code_runs_only_with_trust_model_code(vcc_run, tmp_path, capsys):
    """predict.py --model FOLDER whose config.json names x.py:Evil beside an x.py ran x.py
    (exit 0, nothing said): now one line naming the file and --trust-model-code, nothing runs;
    with the flag the folder's code loads and predicts."""
    folder = tmp_path / "model"
    shutil.copytree(vcc_run["model"], folder)
    mark = tmp_path / "ran"
    (folder / "x.py").write_text(
        f"from pathlib import Path\n\nfrom gears.model.network import GEARSNet\n\n"
        f"Path({str(mark)!r}).write_text('ran')\n\n\nclass Evil(GEARSNet):\n    pass\n"
    )
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "impl": "x.py:Evil"}))
    labels, _ = _perturbations(vcc_run)
    out = tmp_path / "p.h5ad"
    argv = ["--model", str(folder), "--perturbations", labels[0], "--out", str(out)]
    code, err = _run_cli(argv, capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert str(folder / "x.py") in err and "--trust-model-code" in err
    assert not mark.exists() and not out.exists()
    with pytest.raises(Exception, match="trust"):
        load_model(folder)
    assert not mark.exists()
    predict_main([*argv, "--trust-model-code"])
    assert mark.exists() and out.is_file()


def test_a_runs_context_index_names_only_folders_inside_the_run(tmp_path):
    """predict.py --model RUN read each context's model from the folder contexts.json names:
    an edited index sent it to any folder (`../elsewhere/model`, an absolute path). Now a
    folder outside the run is one line naming the index; the run's own folders still count."""
    from gears.errors import GearsInputError
    from predict import model_folders

    run = tmp_path / "run"
    run.mkdir()
    index = run / "contexts.json"
    for outside in ("../elsewhere/model", str(tmp_path / "elsewhere" / "model"), "a/../../x"):
        index.write_text(json.dumps({"contexts": {"lineA": outside}}))
        with pytest.raises(GearsInputError, match="contexts.json.*outside"):
            model_folders(run, tmp_path / "p.h5ad")
    index.write_text(json.dumps({"contexts": {"lineA": "lineA/model"}}))
    assert model_folders(run, tmp_path / "p.h5ad") == [
        (run / "lineA" / "model", tmp_path / "p_lineA.h5ad")
    ]


# ------------------------------------------------------------- scanpy and provenance
def _predict_file(vcc_run, tmp_path, output: str) -> tuple:
    labels, _ = _perturbations(vcc_run)
    out = tmp_path / f"pred_{output}.h5ad"
    argv = ["--model", str(vcc_run["model"]), "--perturbations", ",".join(labels)]
    predict_main([*argv, "--cells-per-perturbation", "5", "--output", output, "--out", str(out)])
    return labels, out


@pytest.mark.parametrize("output", ["lognorm", "counts"])
def test_scanpy_rank_genes_groups_runs_on_the_written_file(vcc_run, tmp_path, output):
    """sc.tl.rank_genes_groups failed on predict.py's files ("ValueError: Output dtype not
    compatible with inputs"): X's indptr was 64-bit beside 32-bit indices."""
    import h5py
    import scanpy as sc

    labels, out = _predict_file(vcc_run, tmp_path, output)
    with h5py.File(out, "r") as f:
        assert f["X/indptr"].dtype == f["X/indices"].dtype, "one index width, as scipy wants"
    pred = ad.read_h5ad(out)
    if output == "counts":
        sc.pp.normalize_total(pred)
        sc.pp.log1p(pred)
    sc.tl.rank_genes_groups(pred, "target_gene", reference=CONTROL, method="t-test")
    assert set(pred.uns["rank_genes_groups"]["names"].dtype.names) == set(labels)


def test_the_file_records_the_model_config_code_and_sampler(vcc_run, tmp_path):
    """A prediction file said nothing of the model that made it."""
    import hashlib

    from gears.choices import DEFAULT_SAMPLER
    from gears.eval.predicted_cells import PROVENANCE_KEY, code_commit

    code_commit.cache_clear()  # (asked once per process: a commit made since is not seen)
    folder = vcc_run["model"]
    config_sha = hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    assert code_commit().removesuffix("+modified") == (commit or "unknown")
    for output, sampler in (("lognorm", "none"), ("counts", DEFAULT_SAMPLER)):
        _, out = _predict_file(vcc_run, tmp_path, output)
        record = ad.read_h5ad(out, backed="r").uns[PROVENANCE_KEY]
        assert record["model_folder"] == str(folder.resolve())
        assert record["model_impl"] == "fast"
        assert record["config_sha256"] == config_sha
        assert record["code_commit"] == code_commit()
        assert record["output"] == output and record["sampler"] == sampler, record
        assert int(record["seed"]) == 0


def test_without_git_the_commit_is_unknown(monkeypatch):
    from gears.eval import predicted_cells as predict_mod

    predict_mod.code_commit.cache_clear()
    monkeypatch.setenv("PATH", "/nonexistent")
    try:
        assert predict_mod.code_commit() == "unknown"
    finally:
        predict_mod.code_commit.cache_clear()


def test_more_cells_x_genes_than_32_bits_hold_widen_indices_and_indptr_together(
    vcc_run, tmp_path, monkeypatch
):
    """Past 2**31 - 1 cells x genes (lowered here) indices and indptr are both 64-bit: the same
    cells, and one width for scipy."""
    import scanpy as sc

    from gears.eval import predicted_cells as predict_mod

    args, kwargs = _prediction_inputs(vcc_run)
    expected = predict_mod.prediction_adata(*args, **kwargs)
    monkeypatch.setattr(predict_mod, "MAX_INT32_NNZ", 10)
    predict_mod.write_prediction(tmp_path / "p.h5ad", *args, **kwargs)
    got = ad.read_h5ad(tmp_path / "p.h5ad")
    assert got.X.indptr.dtype == got.X.indices.dtype == np.int64
    np.testing.assert_array_equal(got.X.toarray(), expected.X)
    sc.tl.rank_genes_groups(got, "target_gene", reference=CONTROL, method="t-test")
