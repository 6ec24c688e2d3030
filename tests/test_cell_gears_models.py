"""Models saved by cell-gears 0.1.2 (gears/compat/cell_gears.py), against the real thing: the
fixture in
tests/fixtures/cell_gears was trained, saved and queried by cell-gears itself
(tests/fixtures/make_cell_gears_fixture.py); cell-gears is not needed here."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from pathlib import Path

import anndata as ad
import numpy as np
import pytest
import torch

from gears.compat import cell_gears
from gears.compat.api import GEARS
from gears.compat.cell_gears import cell_gears_vocabulary, read_config
from gears.data.pertdata import PertData
from gears.errors import GearsInputError

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "cell_gears"
MODELS = ("model_plain", "model_uncertainty")
GENE2GO = FIXTURE / "gene2go_all.pkl"
SCREEN = FIXTURE / "screen.h5ad"
# cell-gears's recorded mean is a float32 mean of 300 cells near 4 (rounding ~1e-6 each);
# ours is exact in float64 after an fp32 network: measured difference <= 7e-6.
ATOL = 2e-5

INFO = json.loads((FIXTURE / "predictions.json").read_text())
RECORDED = dict(np.load(FIXTURE / "predictions.npz"))
KEYS = ["_".join(q) for q in INFO["queries"]]


def as_cell_gears(model: GEARS, name: str, **kwargs) -> tuple[np.ndarray, np.ndarray | None]:
    """Our predictions of the fixture's queries, with cell-gears's sampled control mean in place
    of the mean of all control cells (the only difference its predict() adds by design)."""
    out = model.predict(INFO["queries"], **kwargs)
    pred, score = out if isinstance(out, tuple) else (out, None)
    delta = np.stack([pred[k] - model.ctrl_expression for k in KEYS])
    scores = None if score is None else np.array([score[k] for k in KEYS])
    return delta + RECORDED[f"{name}/ctrl_sample_mean"], scores


def copy_model(name: str, folder: Path) -> Path:
    shutil.copytree(FIXTURE / name, folder)
    return folder


@pytest.fixture(scope="module")
def pert_data(tmp_path_factory) -> PertData:
    """Our PertData of the data cell-gears trained on, with the GO source it used."""
    pd_ = PertData(tmp_path_factory.mktemp("data"), gene2go=str(GENE2GO), verbose=False)
    return pd_.load(data_name=str(SCREEN))


# ------------------------------------------------------------------------------ predictions
@pytest.mark.parametrize("name", MODELS)
def test_predictions_equal_cell_gears(name):
    model = GEARS.from_cell_gears(FIXTURE / name, SCREEN, GENE2GO)
    assert model.gene_list == INFO["gene_list"] and model.pert_list == INFO["pert_list"]
    pred, score = as_cell_gears(model, name)
    np.testing.assert_allclose(pred, RECORDED[f"{name}/pred"], rtol=0, atol=ATOL)
    if name == "model_uncertainty":
        np.testing.assert_allclose(score, RECORDED[f"{name}/logvar_score"], rtol=1e-6)
    else:
        assert score is None


def test_pert_data_vocabulary_is_cell_gears_and_load_pretrained_predicts_the_same(pert_data):
    assert list(pert_data.gene_names) == INFO["gene_list"]
    assert list(pert_data.pert_names) == INFO["pert_list"]
    model = GEARS(pert_data, device="cpu").load_pretrained(FIXTURE / "model_plain")
    pred, _ = as_cell_gears(model, "model_plain")
    np.testing.assert_allclose(pred, RECORDED["model_plain/pred"], rtol=0, atol=ATOL)


def test_network_alone_differs_from_cell_gears_predict():
    """cell-gears's predict() lets the co-expression graph reach 1 of its 300 cells; this
    project's network reaches every cell. The protocol is what makes the numbers equal."""
    model = GEARS.from_cell_gears(
        FIXTURE / "model_plain", SCREEN, GENE2GO, cell_gears_predict=False
    )
    pred, _ = as_cell_gears(model, "model_plain")
    assert np.abs(pred - RECORDED["model_plain/pred"]).max() > 50 * ATOL


@pytest.mark.parametrize("key", ["emb_trans_v2.linears.0.weight", "sim_layers.0.lin.weight"])
def test_a_transposed_weight_is_caught(key):
    """The comparison is sensitive to a mis-mapped weight of the right shape."""
    model = GEARS.from_cell_gears(FIXTURE / "model_plain", SCREEN, GENE2GO)
    weight = dict(model.model.named_parameters())[key]
    with torch.no_grad():
        weight.copy_(weight.t().clone())
    pred, _ = as_cell_gears(model, "model_plain")
    assert np.abs(pred - RECORDED["model_plain/pred"]).max() > 10 * ATOL


def test_saved_in_our_format_predicts_as_our_network(pert_data, tmp_path):
    model = GEARS(pert_data, device="cpu").load_pretrained(FIXTURE / "model_uncertainty")
    model.save_model(tmp_path / "converted")
    again = GEARS(pert_data, device="cpu").load_pretrained(tmp_path / "converted")
    network = GEARS(pert_data, device="cpu").load_pretrained(
        FIXTURE / "model_uncertainty", cell_gears_predict=False
    )
    assert again.cell_gears_net is None
    for a, b in zip(again.predict([["SG0006"], ["SG0021", "SG0030"]]), network.predict(
        [["SG0006"], ["SG0021", "SG0030"]]
    )):  # fmt: skip
        for k in a:
            np.testing.assert_allclose(a[k], b[k], rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------ config.pkl
def _folder_with_config(tmp_path: Path, config_bytes: bytes) -> Path:
    folder = copy_model("model_plain", tmp_path / "model")
    (folder / "config.pkl").write_bytes(config_bytes)
    return folder


def test_config_reader_admits_tensors_and_plain_values():
    config = read_config(FIXTURE / "model_plain" / "config.pkl")
    assert config["hidden_size"] == 16 and config["uncertainty"] is False
    assert config["G_go"].dtype == torch.long and config["G_go"].shape[0] == 2
    assert config["G_go_weight"].dtype == torch.float32


def test_malicious_config_is_refused_and_never_runs(tmp_path, pert_data):
    marker = tmp_path / "ran"
    # protocol 0 by hand: GLOBAL os system, called on a shell command (REDUCE)
    payload = f"cos\nsystem\n(S'touch {marker}'\ntR.".encode()
    folder = _folder_with_config(tmp_path, payload)
    with pytest.raises(GearsInputError, match=r"names os\.system"):
        GEARS(pert_data, device="cpu").load_pretrained(folder)
    assert not marker.exists()

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (folder / "config.pkl").write_bytes(pickle.dumps({"hidden_size": Evil()}))
    with pytest.raises(GearsInputError, match=r"names (posix|os|nt)\.system"):
        read_config(folder / "config.pkl")
    assert not marker.exists()


def test_malicious_storage_bytes_are_refused_and_never_run(tmp_path):
    """A tensor's storage bytes are a torch.save stream that torch's own reader
    (torch.storage._load_from_bytes) loads with weights_only=False: ours must not."""
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    inner = io.BytesIO()
    torch.save(Evil(), inner, _use_new_zipfile_serialization=False)

    class Storage:
        def __reduce__(self):
            return (torch.storage._load_from_bytes, (inner.getvalue(),))

    path = tmp_path / "config.pkl"
    path.write_bytes(pickle.dumps({"G_go": Storage()}))
    with pytest.raises(GearsInputError, match=r"system \(inside a tensor's storage bytes\)"):
        read_config(path)
    assert not marker.exists()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_layers": 3}, r"key\(s\) \['hidden_layers'\]"),
        ({"no_perturb": True}, r"no_perturb=True is not supported"),
        ({"hidden_size": 16.0}, r"hidden_size is 16\.0"),
        ({"G_go_weight": torch.ones(3)}, r"G_go_weight has shape \(3,\)"),
        ({"num_perts": 37}, r"G_go|37 perturbable"),
    ],
)
def test_config_that_does_not_map_is_refused_by_name(tmp_path, change, message):
    config = read_config(FIXTURE / "model_plain" / "config.pkl") | change
    folder = _folder_with_config(tmp_path, pickle.dumps(config))
    with pytest.raises(GearsInputError, match=message):
        GEARS.from_cell_gears(folder, SCREEN, GENE2GO)


def test_missing_config_key_is_named(tmp_path):
    config = read_config(FIXTURE / "model_plain" / "config.pkl")
    del config["G_coexpress"]
    folder = _folder_with_config(tmp_path, pickle.dumps(config))
    with pytest.raises(GearsInputError, match=r"lacks \['G_coexpress'\]"):
        GEARS.from_cell_gears(folder, SCREEN, GENE2GO)


# ------------------------------------------------------------------------------ model.pt
def _folder_with_weights(tmp_path: Path, edit) -> Path:
    folder = copy_model("model_plain", tmp_path / "model")
    state = torch.load(folder / "model.pt", weights_only=True)
    edit(state)
    torch.save(state, folder / "model.pt")
    return folder


def test_weights_that_do_not_map_are_refused_by_name(tmp_path):
    def unknown(state):
        state["extra_layer.weight"] = torch.zeros(2)

    def transposed(state):  # [32, 16] -> [16, 32]: a wrong shape
        state["recovery_w.network.0.weight"] = state["recovery_w.network.0.weight"].t()

    def missing(state):
        del state["bn_emb.running_var"]

    def relu_weight(state):
        state["pert_fuse.network.2.weight"] = torch.zeros(16)

    cases = [
        (unknown, r"does not have: \['extra_layer\.weight'\]"),
        (transposed, r"recovery_w\.network\.0\.weight \(16, 32\) \(expected \(32, 16\)\)"),
        (missing, r"lacks weight\(s\) \['bn_emb\.running_var'\]"),
        (relu_weight, r"pert_fuse\.network\.2\.weight"),
    ]
    for i, (edit, message) in enumerate(cases):
        folder = _folder_with_weights(tmp_path / str(i), edit)
        with pytest.raises(GearsInputError, match=message):
            GEARS.from_cell_gears(folder, SCREEN, GENE2GO)


def test_indv_w1_shape_is_checked_in_cell_gears_terms(tmp_path):
    def wrong(state):
        state["indv_w1"] = state["indv_w1"][:, :8]

    folder = _folder_with_weights(tmp_path, wrong)
    with pytest.raises(GearsInputError, match=r"indv_w1 \(40, 8, 1\) \(expected \(40, 16, 1\)\)"):
        GEARS.from_cell_gears(folder, SCREEN, GENE2GO)


def test_data_parallel_prefix_and_unused_weights_are_accepted(tmp_path):
    folder = _folder_with_weights(
        tmp_path, lambda s: s.update({f"module.{k}": s.pop(k) for k in list(s)})
    )
    model = GEARS.from_cell_gears(folder, SCREEN, GENE2GO)
    pred, _ = as_cell_gears(model, "model_plain")
    np.testing.assert_allclose(pred, RECORDED["model_plain/pred"], rtol=0, atol=ATOL)


def test_pickled_code_in_model_pt_is_refused(tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    folder = _folder_with_weights(tmp_path, lambda s: s.update(evil=Evil()))
    with pytest.raises(GearsInputError, match="model.pt was refused"):
        GEARS.from_cell_gears(folder, SCREEN, GENE2GO)
    assert not marker.exists()


# ------------------------------------------------------------------------------ vocabulary
def test_vocabulary_rule_of_cell_gears():
    adata = ad.read_h5ad(SCREEN)
    genes, perts = cell_gears_vocabulary(adata.var["gene_name"], adata.obs["condition"], GENE2GO)
    assert genes == INFO["gene_list"] and perts == INFO["pert_list"]
    # default_pert_graph=True: a gene set (cell-gears's essential genes) instead of the data's
    _, from_set = cell_gears_vocabulary(genes, [], GENE2GO, gene_set=["SG0040", "EXTRA1", "NOGO"])
    assert from_set == ["EXTRA1", "SG0040"]  # in gene2go, sorted; genes outside it left out


def test_vocabulary_of_other_size_is_refused(tmp_path):
    gene_set = tmp_path / "essential_all_data_pert_genes.pkl"
    gene_set.write_bytes(pickle.dumps(INFO["pert_list"] + ["EXTRA1"]))
    with pytest.raises(GearsInputError, match=r"36 perturbable genes, this data 40 and 37"):
        GEARS.from_cell_gears(FIXTURE / "model_plain", SCREEN, GENE2GO, gene_set=gene_set)


def test_vocabulary_in_another_order_is_refused_by_the_go_graph():
    perts = INFO["pert_list"]
    shuffled = perts[1:] + perts[:1]  # same genes, same size, each index naming another gene
    model = GEARS(_vocabulary(perts=shuffled), device="cpu")
    with pytest.raises(GearsInputError, match="does not match the model's GO graph"):
        model.load_pretrained(FIXTURE / "model_plain")
    model.load_pretrained(FIXTURE / "model_plain", check_go_graph=False)  # the user's call


def _vocabulary(perts):
    from gears.data.graphs import read_gene2go
    from gears.train.saved_model import SavedVocabulary

    vocab = SavedVocabulary(INFO["gene_list"], perts, np.zeros(len(INFO["gene_list"])))
    gene2go = read_gene2go(GENE2GO)
    vocab.gene2go = {p: gene2go[p] for p in perts}
    return vocab


# ------------------------------------------------------------------------------ predict.py
def test_predict_cli_on_a_cell_gears_folder(tmp_path):
    import predict

    out = tmp_path / "pred.h5ad"
    args = ["--model", str(FIXTURE / "model_uncertainty"), "--perturbations"]
    args += ["SG0006+ctrl,SG0021+SG0030", "--cells-per-perturbation", "3", "--out", str(out)]
    with pytest.raises(GearsInputError, match="Pass --data"):
        predict.main(args)
    predict.main(args + ["--data", str(SCREEN), "--gene2go", str(GENE2GO)])
    pred = ad.read_h5ad(out)
    assert pred.n_obs == 80 + 2 * 3 and list(pred.var_names) == INFO["gene_list"]
    assert "log_variance" in pred.layers
    model = GEARS.from_cell_gears(FIXTURE / "model_uncertainty", SCREEN, GENE2GO)
    expected, _ = model.predict([["SG0006"], ["SG0021", "SG0030"]])
    mean = pred.uns["gears_mean_prediction"]["mean"]
    np.testing.assert_allclose(mean[0], expected["SG0006"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(mean[1], expected["SG0021_SG0030"], rtol=0, atol=1e-6)
    cell = pred[pred.obs["condition"] == "SG0006+ctrl"].X[0]
    assert np.all(np.asarray(cell.todense() if hasattr(cell, "todense") else cell) >= 0)


def test_is_cell_gears_folder(tmp_path):
    assert cell_gears.is_cell_gears_folder(FIXTURE / "model_plain")
    folder = copy_model("model_plain", tmp_path / "m")
    (folder / "config.json").write_text("{}")  # ours has config.json: never taken for cell-gears
    assert not cell_gears.is_cell_gears_folder(folder)
