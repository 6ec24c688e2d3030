"""Input as users have it: the Virtual Cell Challenge layout, condition-column detection, control
spellings, raw counts (data.normalize=log1p), configs/vcc.yaml, and cell-eval scores in runs."""

from __future__ import annotations

import math
import sys

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scanpy as sc
import scipy.sparse as sp
import torch
from vcc_helpers import HAS_CELL_EVAL, NO_CELL_EVAL, ROOT, VCC_PARAMS, write_vcc_files

from gears.cli.job import run
from gears.config import load_config
from gears.data.conditions import detect_condition_key
from gears.data.pertdata import PertData
from gears.data.synthetic import make_vcc_layout, write_gene2go_tsv, write_vcc_example
from gears.errors import GearsInputError
from gears.eval.predicted_cells import real_cells_for_scoring, require_cell_eval
from gears.train.distributed import DistEnv

CELL_EVAL_METRICS = ("mae", "overlap_at_N", "discrimination_score_l1")


@pytest.fixture(scope="module")
def vcc_files(tmp_path_factory):
    return write_vcc_files(tmp_path_factory.mktemp("vcc_files"))


def test_vcc_layout_is_the_challenge_layout():
    adata, gene2go = make_vcc_layout(**VCC_PARAMS)
    assert list(adata.obs.columns) == ["target_gene", "guide_id", "batch"]
    assert "gene_id" in adata.var and adata.var["gene_id"].str.startswith("ENSG").all()
    assert sp.issparse(adata.X) and adata.X.dtype == np.float32
    assert np.array_equal(adata.X.data, np.round(adata.X.data)), "X must hold raw counts"
    target = adata.obs["target_gene"].astype(str)
    assert (target == "non-targeting").sum() == VCC_PARAMS["n_control_cells"]
    singles = set(target) - {"non-targeting"}
    assert len(singles) == VCC_PARAMS["n_perturbations"]
    assert all("+" not in s and s in adata.var_names for s in singles), "bare gene symbols"
    assert singles <= set(gene2go)


def test_condition_column_is_detected_and_printed(vcc_files, tmp_path, capsys):
    h5ad, gene2go = vcc_files
    p = PertData(tmp_path, gene2go=gene2go).load(data_path=h5ad, normalize="log1p")
    assert "obs['target_gene']" in capsys.readouterr().out
    assert p.condition_key == "target_gene"
    assert p.condition_spelling["ctrl"] == "non-targeting"
    raw = ad.read_h5ad(h5ad)
    n_ctrl = (raw.obs["target_gene"] == "non-targeting").sum()
    assert len(p.ctrl_rows) == n_ctrl
    gene = next(g for g in raw.obs["target_gene"].astype(str) if g != "non-targeting")
    assert p.condition_spelling[f"{gene}+ctrl"] == gene
    assert f"{gene}+ctrl" in p.conditions


def test_detection_order_and_clear_errors():
    assert detect_condition_key(["batch", "gene", "perturbation"]) == "perturbation"
    assert detect_condition_key(["guide_target", "x"]) == "guide_target"
    assert detect_condition_key(["gene", "condition"], "gene") == "gene"
    with pytest.raises(GearsInputError, match="data.condition_key"):
        detect_condition_key(["batch", "guide_id"])
    with pytest.raises(GearsInputError, match="no column 'sgRNA'"):
        detect_condition_key(["gene"], "sgRNA")


def test_normalize_log1p_is_scanpys_median_scaling(vcc_files, tmp_path):
    h5ad, gene2go = vcc_files
    p = PertData(tmp_path, gene2go=gene2go, verbose=False)
    p.load(data_path=h5ad, normalize="log1p")
    reference = ad.read_h5ad(h5ad)
    sc.pp.normalize_total(reference)  # target_sum=None: the median total, cell-eval's choice
    sc.pp.log1p(reference)
    got = p.expr.numpy()
    got = got.toarray() if sp.issparse(got) else np.asarray(got)
    np.testing.assert_allclose(got, reference.X.toarray(), rtol=1e-5, atol=1e-6)
    totals = np.asarray(ad.read_h5ad(h5ad).X.sum(axis=1)).ravel()
    assert p.normalize_target_sum == pytest.approx(float(np.median(totals)))
    assert p.report["normalize"]["method"] == "log1p"
    # The caller's AnnData is never normalised in place.
    raw = ad.read_h5ad(h5ad)
    before = raw.X.copy()
    PertData(tmp_path / "b", gene2go=gene2go, verbose=False).new_data_process(
        "x", raw, normalize="log1p", write=False
    )
    assert (raw.X != before).nnz == 0


def _raw_counts(layout, dtype):
    """Integer counts in CSR, with an empty cell and one cell beyond float32's exact integers."""
    rng = np.random.default_rng(0)
    dense = rng.poisson(0.7, size=(40, 30)).astype(dtype)
    dense[3] = 0
    dense[5, :4] = 2.0**22
    return layout(dense)


def _scanpys(X, target_sum):
    work = ad.AnnData(X=X.copy())
    sc.pp.normalize_total(work, target_sum=target_sum)
    sc.pp.log1p(work)
    return work.X


@pytest.mark.parametrize("layout", [sp.csr_matrix])  # scanpy 1.11 fails on csr_array
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("target_sum", [None, 1234.5])
def test_normalize_log1p_of_csr_counts_is_scanpys_bit_for_bit(layout, dtype, target_sum):
    """Both normalisation paths (in memory, per chunk) equal the installed scanpy's
    normalize_total + log1p bit for bit, though CSR counts do not go through scanpy."""
    from gears.data.normalise import median_total, normalise
    from gears.data.stream import normalize_log1p

    X = _raw_counts(layout, dtype)
    totals = np.asarray(X.sum(axis=1)).ravel()
    target = median_total(totals) if target_sum is None else target_sum
    want = _scanpys(X, target)
    chunk = normalize_log1p(X.copy(), target)
    whole = normalise(X, "log1p", copy=True, target_sum=target_sum, log=lambda _: None).X
    for got in (chunk, whole):
        assert type(got) is type(want) and got.dtype == want.dtype == dtype
        for part in ("data", "indices", "indptr"):
            np.testing.assert_array_equal(getattr(got, part), getattr(want, part), strict=True)
    assert (X != _raw_counts(layout, dtype)).nnz == 0  # copy=True leaves the input as it was


def test_normalize_log1p_of_csr_counts_does_not_call_scanpy(monkeypatch):
    """scanpy >= 1.12 normalises CSR in a numba kernel whose on-disk cache never matches (its
    sparse type is rebuilt on every load), so each process compiled it again: seconds a
    command (docs/performance.md). CSR counts are scaled here in numpy instead."""
    from gears.data.normalise import normalise
    from gears.data.stream import normalize_log1p

    def refuse(*args, **kwargs):
        raise AssertionError("CSR counts went through scanpy's normalize_total")

    monkeypatch.setattr(sc.pp, "normalize_total", refuse)
    X = _raw_counts(sp.csr_matrix, np.float32)
    normalize_log1p(X.copy(), 100.0)
    normalise(X, "log1p", copy=True, target_sum=None, log=lambda _: None)


def test_real_cells_for_scoring_normalise_csr_counts_as_scanpy_without_it(tmp_path, monkeypatch):
    """predict.py --real: the real file's raw counts are normalised as in training, bit for bit
    scanpy's normalize_total + log1p, without calling it (the kernel compiled in every process)."""

    X = _raw_counts(sp.csr_matrix, np.float32)
    labels = np.array(["non-targeting", "A", "B", "C"])[np.arange(X.shape[0]) % 4]
    genes = [f"g{i}" for i in range(X.shape[1])]
    path = tmp_path / "real.h5ad"
    ad.AnnData(X=X, obs={"target_gene": labels}, var=pd.DataFrame(index=genes)).write_h5ad(path)
    pred = ad.AnnData(
        X=np.zeros((2, len(genes)), np.float32),
        obs={"gears_condition": ["A+ctrl", "B+ctrl"], "target_gene": ["A", "B"]},
    )
    pred.uns["gears_condition_key"] = "target_gene"
    info = {"condition_key": "target_gene", "control_label": "non-targeting"}
    info["normalize_target_sum"] = 321.0
    keep = labels != "C"
    want = _scanpys(X[np.flatnonzero(keep)], 321.0)

    def refuse(*args, **kwargs):
        raise AssertionError("CSR counts went through scanpy's normalize_total")

    monkeypatch.setattr(sc.pp, "normalize_total", refuse)
    real, _ = real_cells_for_scoring(path, info, genes, pred)
    for part in ("data", "indices", "indptr"):
        np.testing.assert_array_equal(getattr(real.X, part), getattr(want, part), strict=True)


def test_normalize_log1p_rejects_log_normalised_data(vcc_files, tmp_path):
    h5ad, gene2go = vcc_files
    adata = ad.read_h5ad(h5ad)
    sc.pp.log1p(adata)
    with pytest.raises(GearsInputError, match="raw counts"):
        PertData(tmp_path, gene2go=gene2go, verbose=False).new_data_process(
            "x", adata, normalize="log1p", write=False
        )


def test_control_names_for_other_control_spellings(vcc_files, tmp_path):
    h5ad, gene2go = vcc_files
    adata = ad.read_h5ad(h5ad)
    adata.obs["target_gene"] = (
        adata.obs["target_gene"].astype(str).replace("non-targeting", "NegCtrl_sg1")
    )
    path = tmp_path / "negctrl.h5ad"
    adata.write_h5ad(path)
    with pytest.raises(GearsInputError, match="no control cells"):
        PertData(tmp_path, gene2go=gene2go, verbose=False).load(data_path=path)
    p = PertData(tmp_path, gene2go=gene2go, verbose=False).load(
        data_path=path, control_names=("NegCtrl_sg1",), normalize="log1p"
    )
    assert p.condition_spelling["ctrl"] == "NegCtrl_sg1"
    assert len(p.ctrl_rows) == VCC_PARAMS["n_control_cells"]


def test_vcc_config_reads_the_challenge_file_as_documented():
    cfg = load_config(ROOT / "configs" / "vcc.yaml", base=ROOT / "configs" / "default.yaml")
    assert cfg.data.dataset.endswith("adata_Training.h5ad")
    assert cfg.data.condition_key == "target_gene"
    assert cfg.data.normalize == "log1p"
    assert cfg.split.type == "simulation_single"
    with pytest.raises(GearsInputError, match="data.normalize"):
        load_config(overrides=["data.normalize=cp10k"])


def test_vcc_file_trains_and_cell_eval_scores_land_in_metrics(vcc_run):
    metrics = vcc_run["metrics"]
    assert metrics["test"]["n_conditions"] >= 1 and math.isfinite(metrics["test"]["mse"])
    assert (vcc_run["model"] / "control_cells.h5ad").exists()
    if not HAS_CELL_EVAL:
        pytest.skip(NO_CELL_EVAL)
    scores = metrics["cell_eval"]
    assert set(scores) == {"gears", *metrics["baselines"]}
    for name, row in scores.items():
        assert row["n_perturbations"] == metrics["test"]["n_conditions"], name
        for metric in CELL_EVAL_METRICS:
            assert row[metric] is not None and math.isfinite(row[metric]), (name, metric)
    # GEARS's cells and the no-change baseline's differ, so their MAE does too.
    assert scores["gears"]["mae"] != scores["no_change"]["mae"]
    assert (vcc_run["out"] / "cell_eval" / "gears" / "agg_results.csv").exists()


def test_missing_cell_eval_says_how_to_install(vcc_files, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "cell_eval", None)  # import cell_eval -> ImportError
    with pytest.raises(GearsInputError, match="pip install -r requirements-eval.txt"):
        require_cell_eval()
    h5ad, gene2go = vcc_files
    cfg = load_config(
        ROOT / "configs" / "vcc.yaml",
        [f"data.dataset={h5ad}", f"data.gene2go={gene2go}", f"out_dir={tmp_path / 'run'}"],
    )
    cfg.eval.cell_eval = True
    with pytest.raises(GearsInputError, match="requirements-eval.txt"):
        run(cfg, DistEnv(device=torch.device("cpu")))  # before any training
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_generator_writes_go_source_the_loader_reads(tmp_path):
    adata, gene2go = make_vcc_layout(**VCC_PARAMS)
    path = write_gene2go_tsv(gene2go, tmp_path / "g.tsv")
    p = PertData(tmp_path, gene2go=path, verbose=False).new_data_process(
        "vcc", adata, normalize="log1p", write=False
    )
    assert set(p.pert_names) == set(adata.var_names)


def test_example_files_hold_out_perturbations_with_their_real_cells(tmp_path):
    paths = write_vcc_example(tmp_path, **VCC_PARAMS)
    train = ad.read_h5ad(paths["training"]).obs["target_gene"].astype(str)
    val = ad.read_h5ad(paths["validation"]).obs["target_gene"].astype(str)
    held_out = set(val) - {"non-targeting"}
    assert held_out and not held_out & set(train)
    assert (train == "non-targeting").sum() + (val == "non-targeting").sum() == VCC_PARAMS[
        "n_control_cells"
    ]
    counts = pd.read_csv(paths["counts"])
    assert (
        dict(zip(counts["target_gene"], counts["n_cells"]))
        == val[val != "non-targeting"].value_counts().to_dict()
    )
