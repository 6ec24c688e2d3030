"""Tests for gears/data/pertdata.py and gears/data/de.py: processing, DE genes, tables, splits,
graphs, the processed file, and every kind of bad input."""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import torch
from helpers import (
    ALWAYS_ZERO,
    DOWN,
    DROPPED_IN_G00,
    GENES,
    ONLY_IN_G01,
    RAW_TO_CANONICAL,
    SYNTHETIC_PARAMS,
    UP,
    canonical_by_hand,
    tiny_gene2go,
    tiny_screen,
    write_gene2go,
)

from gears.data import de as de_mod
from gears.data import graphs
from gears.data.conditions import condition_genes
from gears.data.pertdata import PROCESSED_NAME, PertData
from gears.data.splits import SPLIT_TYPES as ALL_SPLIT_TYPES
from gears.errors import GearsInputError

SPLIT_TYPES = tuple(t for t in ALL_SPLIT_TYPES if t != "custom")


# ------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def synth(tmp_path_factory) -> PertData:
    """The synthetic screen at small sizes; tests call prepare_split themselves."""
    data_dir = tmp_path_factory.mktemp("synth")
    return PertData(data_dir, verbose=False).load("synthetic", synthetic_params=SYNTHETIC_PARAMS)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> PertData:
    """The hand-made screen of tests/helpers.py, processed once."""
    data_dir = tmp_path_factory.mktemp("tiny")
    go = write_gene2go(data_dir / "gene2go.tsv", tiny_gene2go())
    return PertData(data_dir, gene2go=go, verbose=False).new_data_process("tiny", tiny_screen())


def tiny_pertdata(tmp_path: Path, gene2go: dict | None = None, **kwargs) -> PertData:
    go = write_gene2go(tmp_path / "gene2go.tsv", tiny_gene2go() if gene2go is None else gene2go)
    return PertData(tmp_path, gene2go=go, verbose=False, **kwargs)


def dense(X) -> np.ndarray:
    return X.toarray() if sp.issparse(X) else np.asarray(X)


def means_by_hand(adata: ad.AnnData) -> pd.DataFrame:
    """Mean profile per condition with pandas: [conditions, genes]."""
    frame = pd.DataFrame(dense(adata.X).astype(np.float64), columns=list(adata.var_names))
    return frame.groupby(np.asarray(adata.obs["condition"].astype(str))).mean()


# ------------------------------------------------------------------------------------------ DE
def test_first_k_where_hand_values():
    ranked = np.array([[4, 2, 0, 1, 3], [0, 1, 2, 3, 4]])
    keep = np.array([[False, True, True, False, True], [False, False, False, False, True]])
    out = de_mod.first_k_where(ranked, keep, 2)
    assert out.tolist() == [[2, 0], [4, -1]]
    out = de_mod.first_k_where(ranked, keep, 5)
    assert out.tolist() == [[2, 0, 3, -1, -1], [4, -1, -1, -1, -1]]
    assert de_mod.first_k_where(ranked, np.zeros_like(keep), 3).tolist() == [[-1] * 3] * 2


def test_condition_means_matches_pandas():
    rng = np.random.default_rng(3)
    X = rng.random((9, 4))
    codes = np.array([2, 0, 2, 1, 0, 2, 2, 1, 0])
    out = de_mod.condition_means(sp.csr_matrix(X), codes, 4)
    expected = pd.DataFrame(X).groupby(codes).mean().to_numpy()
    np.testing.assert_allclose(out[:3], expected, rtol=1e-12)
    assert np.all(out[3] == 0)  # an empty group gives zeros, not NaN


def test_de_keys_are_keyed_by_canonical_condition(tiny):
    perturbed = set(RAW_TO_CANONICAL.values()) - {"ctrl"}
    for key in de_mod.DE_KEYS:
        assert key in tiny.adata.uns
        assert set(tiny.adata.uns[key]) == perturbed, key


def test_strongly_changed_gene_ranks_first(tiny):
    ranked = tiny.adata.uns[de_mod.RANK_KEY]
    for cond, gene in {**UP, **DOWN}.items():  # DOWN checks rankby_abs: a drop ranks first too
        assert ranked[cond][0] == gene, cond
    assert set(ranked["G00+G03"][:2]) == {"G00", "G03"}
    for cond in ranked:
        assert sorted(ranked[cond]) == GENES  # every gene ranked exactly once


def test_dropout_sets_match_recomputation(tiny):
    uns = tiny.adata.uns
    means = means_by_hand(tiny.adata)
    ctrl_zero = set(np.flatnonzero(means.loc["ctrl"].to_numpy() == 0))
    gene_idx = {g: i for i, g in enumerate(GENES)}
    for cond in uns[de_mod.RANK_KEY]:
        row = means.loc[cond].to_numpy()
        non_zero = {i for i in range(len(GENES)) if row[i] != 0}
        non_dropout = non_zero | ({i for i in range(len(GENES)) if row[i] == 0} & ctrl_zero)
        assert set(np.asarray(uns[de_mod.NON_ZERO_KEY][cond]).tolist()) == non_zero, cond
        assert set(np.asarray(uns[de_mod.NON_DROPOUT_KEY][cond]).tolist()) == non_dropout, cond
        ranked = list(uns[de_mod.RANK_KEY][cond])
        top_nd = [g for g in ranked if gene_idx[g] in non_dropout][:20]
        top_nz = [g for g in ranked if gene_idx[g] in non_zero][:20]
        assert list(uns[de_mod.TOP_NON_DROPOUT_KEY][cond]) == top_nd, cond
        assert list(uns[de_mod.TOP_NON_ZERO_KEY][cond]) == top_nz, cond
    # The hand-made cases, spelled out.
    g = gene_idx
    assert g[DROPPED_IN_G00] not in uns[de_mod.NON_DROPOUT_KEY]["G00+ctrl"]
    assert g[DROPPED_IN_G00] in uns[de_mod.NON_DROPOUT_KEY]["G01+ctrl"]
    assert DROPPED_IN_G00 not in uns[de_mod.TOP_NON_DROPOUT_KEY]["G00+ctrl"]
    assert g[ALWAYS_ZERO] in uns[de_mod.NON_DROPOUT_KEY]["G00+ctrl"]
    assert g[ALWAYS_ZERO] not in uns[de_mod.NON_ZERO_KEY]["G00+ctrl"]
    assert g[ONLY_IN_G01] in uns[de_mod.NON_ZERO_KEY]["G01+ctrl"]
    assert g[ONLY_IN_G01] not in uns[de_mod.NON_ZERO_KEY]["G02+ctrl"]


def test_tiny_conditions_are_canonical(tiny):
    assert tiny.conditions == ["ctrl", "G00+G03", "G00+ctrl", "G01+ctrl", "G02+ctrl", "G03+ctrl"]
    counts = pd.Series(tiny.adata.obs["condition"]).value_counts()
    assert counts["ctrl"] == 30 and all(counts.drop("ctrl") == 12)
    assert tiny.report["dropped_conditions"] == []


# ----------------------------------------------------------------------- tables on synthetic
def test_synthetic_conditions_and_rows(synth):
    raw = np.asarray(synth.synthetic.adata.obs["condition"].astype(str))
    assert synth.conditions[0] == "ctrl"
    assert synth.conditions[1:] == sorted(set(raw) - {"ctrl"})
    n_single = sum(len(condition_genes(c)) == 1 for c in synth.conditions)
    n_double = sum(len(condition_genes(c)) == 2 for c in synth.conditions)
    assert (n_single, n_double) == (SYNTHETIC_PARAMS["n_single"], SYNTHETIC_PARAMS["n_double"])
    np.testing.assert_array_equal(synth.ctrl_rows, np.flatnonzero(raw == "ctrl"))
    assert len(synth.ctrl_rows) == SYNTHETIC_PARAMS["n_control_cells"]
    assert [synth.conditions[i] for i in synth.cell_condition] == raw.tolist()
    assert synth.ctrl_id == 0


def test_cond_pert_index(synth):
    table = synth.cond_pert_index
    assert table.shape == (len(synth.conditions), 2) and table.dtype == np.int64
    for c, name in enumerate(synth.conditions):
        genes = condition_genes(name)
        row = table[c]
        assert [synth.pert_names[i] for i in row if i >= 0] == genes, name
        assert (row[len(genes) :] == -1).all(), name  # -1 padding after the perturbed genes
        assert (row[: len(genes)] >= 0).all(), name
    assert table[synth.ctrl_id].tolist() == [-1, -1]
    assert any(len(condition_genes(c)) == 2 for c in synth.conditions)


def test_de_tables(synth):
    uns = synth.adata.uns
    G = synth.n_genes
    names = list(synth.gene_names)
    assert synth.de_idx.shape == (len(synth.conditions), 20)
    assert synth.de_ranked_idx.shape == (len(synth.conditions), min(200, G))
    assert synth.non_dropout_de_idx.shape == (len(synth.conditions), 20)
    assert (synth.de_idx[synth.ctrl_id] == -1).all()
    assert (synth.non_dropout_de_idx[synth.ctrl_id] == -1).all()
    for c, name in enumerate(synth.conditions[1:], start=1):
        ranked = [names.index(g) for g in uns[de_mod.RANK_KEY][name]]
        assert synth.de_ranked_idx[c].tolist() == ranked[: min(200, G)]
        assert synth.de_idx[c].tolist() == ranked[:20]
        nd = [names.index(g) for g in uns[de_mod.TOP_NON_DROPOUT_KEY][name]]
        assert synth.non_dropout_de_idx[c].tolist() == nd + [-1] * (20 - len(nd))


def test_non_zero_mask_and_means(synth):
    X = dense(synth.synthetic.adata.X).astype(np.float64)
    raw = np.asarray(synth.synthetic.adata.obs["condition"].astype(str))
    mask = synth.non_zero_mask
    assert mask.shape == (len(synth.conditions), synth.n_genes) and mask.dtype == bool
    assert mask[synth.ctrl_id].all()  # ctrl keeps every gene
    for c, name in enumerate(synth.conditions):
        mean = X[raw == name].mean(0)
        if name != "ctrl":
            np.testing.assert_array_equal(mask[c], mean != 0, err_msg=name)
        np.testing.assert_allclose(synth.condition_means([name])[0], mean, rtol=1e-5, atol=1e-6)
    assert not mask.all()  # the synthetic screen has dropouts, so the test above bites
    np.testing.assert_allclose(synth.ctrl_mean, X[raw == "ctrl"].mean(0), rtol=1e-5, atol=1e-6)
    assert synth.ctrl_mean.shape == (synth.n_genes,)


# -------------------------------------------------------------------------------------- splits
@pytest.mark.parametrize("split", SPLIT_TYPES)
def test_every_split_type(synth, split):
    synth.prepare_split(split, seed=3)
    sets = synth.set2conditions
    train, val, test = (set(sets[k]) for k in ("train", "val", "test"))
    held = set(synth.split.held_out)
    assert not (train & val) and not (train & test) and not (val & test)
    assert not (held & (train | val | test))
    assert train | val | test | held == set(synth.conditions)
    if split == "no_split":
        assert train == set() and val == set() and "ctrl" in test
        return
    assert "ctrl" in train and "ctrl" not in val | test
    assert val, split
    if split == "no_test":
        assert test == set()
    else:
        assert test, split
    # The cell rows of each set are exactly the cells of its conditions.
    raw = np.asarray(synth.adata.obs["condition"].astype(str))
    for name in ("train", "val", "test"):
        rows, cond = synth.set_rows(name)
        np.testing.assert_array_equal(rows, np.flatnonzero(np.isin(raw, sets[name])))
        assert [synth.conditions[i] for i in cond] == raw[rows].tolist()


def test_simulation_subgroups(synth):
    synth.prepare_split("simulation", seed=1)
    sub = synth.subgroup["test_subgroup"]
    assert set(sub) == {"combo_seen0", "combo_seen1", "combo_seen2", "unseen_single"}
    assert set().union(*map(set, sub.values())) == set(synth.set2conditions["test"])
    seen = {g for c in synth.set2conditions["train"] for g in condition_genes(c)}
    for cond in sub["unseen_single"]:
        assert condition_genes(cond)[0] not in seen
    for cond in sub["combo_seen0"]:
        assert not set(condition_genes(cond)) & seen


def test_split_cache_reused_and_keyed_by_parameters(synth):
    folder = synth.data_dir / synth.dataset_name / "splits"

    def files() -> set[Path]:
        return set(folder.glob("*.json")) if folder.exists() else set()

    before = files()
    synth.prepare_split("simulation", seed=11)
    created = files() - before
    assert len(created) == 1
    cache = created.pop()
    assert cache.name.startswith("simulation_")
    stored = json.loads(cache.read_text())
    assert stored["train"] == synth.set2conditions["train"]
    assert stored["test"] == synth.set2conditions["test"]

    # A second call must read the file: change it and see the change come back.
    moved = stored["val"][0]
    tampered = dict(stored, val=stored["val"][1:], test=sorted([*stored["test"], moved]))
    cache.write_text(json.dumps(tampered))
    synth.prepare_split("simulation", seed=11, train_gene_set_size=0.75)  # explicit default
    assert files() - before == {cache}
    assert synth.set2conditions["test"] == tampered["test"]
    assert synth.set2conditions["val"] == tampered["val"]

    seen = {cache}
    for kwargs in [
        dict(seed=12),
        dict(seed=11, train_gene_set_size=0.5),
        dict(seed=11, combo_seen2_train_frac=0.5),
        dict(seed=11, val_size=0.2),
        dict(seed=11, combo_single_split_test_set_fraction=0.2),
    ]:
        synth.prepare_split("simulation", **kwargs)
        new = files() - before - seen
        assert len(new) == 1, kwargs
        seen |= new
    synth.prepare_split("combo_seen2", seed=11)
    new = files() - before - seen
    assert len(new) == 1 and new.pop().name.startswith("combo_seen2_")


def test_custom_split(synth, tmp_path):
    singles = [c for c in synth.conditions if len(condition_genes(c)) == 1]
    doubles = [c for c in synth.conditions if len(condition_genes(c)) == 2]
    a, b = condition_genes(doubles[0])
    spec = {"train": singles[:5], "val": [singles[5]], "test": [f"{b}+{a}"]}  # reversed double
    path = tmp_path / "split.json"
    path.write_text(json.dumps(spec))
    synth.prepare_split("custom", split_dict_path=path)
    assert synth.set2conditions["train"] == sorted(["ctrl", *singles[:5]])
    assert synth.set2conditions["val"] == [singles[5]]
    assert synth.set2conditions["test"] == [doubles[0]]


def test_custom_split_bad_files(synth, tmp_path):
    with pytest.raises(GearsInputError, match="does not exist"):
        synth.prepare_split("custom", split_dict_path=tmp_path / "missing.json")
    with pytest.raises(GearsInputError, match="split_dict_path"):
        synth.prepare_split("custom")
    bad = tmp_path / "bad.json"
    bad.write_text("{'train': [oops")
    with pytest.raises(GearsInputError, match="neither JSON nor a pickle"):
        synth.prepare_split("custom", split_dict_path=bad)
    wrong_shape = tmp_path / "list.json"
    wrong_shape.write_text(json.dumps(["ctrl", synth.conditions[1]]))
    with pytest.raises(GearsInputError, match="must be a dict"):
        synth.prepare_split("custom", split_dict_path=wrong_shape)
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"train": [synth.conditions[1]], "test": ["NOTAGENE+ctrl"]}))
    with pytest.raises(GearsInputError, match="NOTAGENE\\+ctrl"):
        synth.prepare_split("custom", split_dict_path=unknown)


def test_unknown_split_type(synth):
    with pytest.raises(GearsInputError, match="unknown split type"):
        synth.prepare_split("random_please")


# -------------------------------------------------------------------------------------- graphs
def test_go_graph(synth):
    g = synth.go_graph()
    assert g.genes == list(synth.pert_names)
    assert g.num_edges > len(g.genes)  # more than the self edges
    assert g.edge_index.dtype == torch.long and g.edge_weight.dtype == torch.float32
    assert synth.go_graph() is g  # built once
    # Edge weights are the Jaccard indices of the genes' GO sets.
    src, tgt = g.edge_index.numpy()
    for s, t, w in list(zip(src, tgt, g.edge_weight.numpy()))[:50]:
        a, b = synth.gene2go[g.genes[s]], synth.gene2go[g.genes[t]]
        assert w == pytest.approx(len(a & b) / len(a | b), rel=1e-6)


def test_coexpress_graph_uses_ctrl_and_train_cells(synth):
    X = dense(synth.synthetic.adata.X)
    raw = np.asarray(synth.synthetic.adata.obs["condition"].astype(str))
    for seed in (1, 2):
        synth.prepare_split("simulation", seed=seed)
        keep = np.isin(raw, synth.set2conditions["train"]) | (raw == "ctrl")
        # The synthetic screen's genes barely co-vary cell by cell, so at GEARS's |r| > 0.4 the
        # graph holds little beyond self edges; 0.2 gives real neighbours to compare as well.
        for threshold in (0.4, 0.2):
            g = synth.coexpress_graph(threshold=threshold)
            assert g.num_edges > 0
            assert g.genes == list(synth.gene_names)
            ref = graphs.coexpression_graph(X[keep], list(synth.gene_names), threshold=threshold)
            assert torch.equal(g.edge_index, ref.edge_index)
            torch.testing.assert_close(g.edge_weight, ref.edge_weight, rtol=1e-5, atol=1e-6)
        src, tgt = g.edge_index
        assert (src != tgt).sum() > 10


# --------------------------------------------------------------------------- processed h5ad file
TABLES = (
    "cond_pert_index",
    "de_idx",
    "de_ranked_idx",
    "non_dropout_de_idx",
    "non_zero_mask",
    "ctrl_rows",
    "cell_condition",
    "pert_names",
)


def assert_same_tables(a: PertData, b: PertData) -> None:
    assert a.conditions == b.conditions
    assert list(a.gene_names) == list(b.gene_names)
    for name in TABLES:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    np.testing.assert_allclose(a.ctrl_mean, b.ctrl_mean, rtol=0, atol=0)
    np.testing.assert_array_equal(a.expr.numpy(), b.expr.numpy())
    for key in de_mod.DE_KEYS:
        assert set(a.adata.uns[key]) == set(b.adata.uns[key])
        for cond in a.adata.uns[key]:
            assert list(a.adata.uns[key][cond]) == list(b.adata.uns[key][cond]), (key, cond)


def test_processed_file_written_and_reloaded(synth, tmp_path, monkeypatch):
    writer = PertData(tmp_path, gene2go=synth.gene2go_path, verbose=False)
    writer.new_data_process("written", synth.synthetic.adata)
    path = tmp_path / "written" / PROCESSED_NAME
    assert path.is_file()
    assert_same_tables(writer, synth)  # load('synthetic') and new_data_process agree

    def no_de(*args, **kwargs):
        raise AssertionError("reloading a processed file must reuse its stored DE genes")

    monkeypatch.setattr(de_mod, "compute_de", no_de)
    for data_path in (path, path.parent):  # the file, or the folder holding it
        reader = PertData(tmp_path / "elsewhere", gene2go=synth.gene2go_path, verbose=False)
        reader.load(data_path=data_path)
        assert reader.dataset_name == "written"
        assert_same_tables(reader, writer)


def test_raw_h5ad_path_is_processed(tmp_path):
    raw = tiny_screen()
    raw.write_h5ad(tmp_path / "raw_screen.h5ad")
    p = tiny_pertdata(tmp_path).load(data_path=tmp_path / "raw_screen.h5ad")
    assert p.dataset_name == "raw_screen"
    assert p.conditions == ["ctrl", *sorted(set(RAW_TO_CANONICAL.values()) - {"ctrl"})]
    assert p.adata.uns[de_mod.RANK_KEY]["G00+ctrl"][0] == "G00"


def test_reload_synthetic_with_other_params_uses_its_own_go(tmp_path):
    params = dict(
        n_genes=20, n_single=5, n_double=2, cells_per_condition=3, n_control_cells=10, n_modules=2
    )
    p = PertData(tmp_path, verbose=False)
    p.load("synthetic", synthetic_params={**params, "seed": 0})
    p.load("synthetic", synthetic_params={**params, "seed": 1})
    expected = {g: p.synthetic.gene2go[g] for g in p.pert_names}
    assert p.gene2go == expected, "GO annotations of the first screen were reused"


# ----------------------------------------------------------------------------------- bad input
def test_condition_key_option_and_missing_column(tmp_path):
    adata = tiny_screen()
    # 'perturbation' is found by itself now (tests/test_vcc.py); a custom name is not.
    adata.obs = adata.obs.rename(columns={"condition": "my_perturbation"})
    with pytest.raises(GearsInputError, match="none of the usual perturbation columns"):
        tiny_pertdata(tmp_path).new_data_process("x", adata, write=False)
    p = tiny_pertdata(tmp_path).new_data_process(
        "x", adata, condition_key="my_perturbation", write=False
    )
    assert "G00+G03" in p.conditions


def test_no_control_cells(tmp_path):
    adata = tiny_screen()
    adata = adata[adata.obs["condition"] != "control"].copy()
    with pytest.raises(GearsInputError, match="no control cells"):
        tiny_pertdata(tmp_path).new_data_process("x", adata, write=False)


def test_custom_control_names_and_separator(tmp_path):
    adata = tiny_screen()
    spelled = {
        "control": "NegCtrl",
        "G03+G00": "G03_G00",
        "ctrl+G01": "ctrl_G01",
        "G02+ctrl": "G02_CTRL",
    }
    adata.obs["condition"] = adata.obs["condition"].map(lambda c: spelled.get(c, c))
    p = tiny_pertdata(tmp_path).new_data_process(
        "x", adata, sep="_", control_names=("negctrl",), write=False
    )
    assert p.conditions == ["ctrl", "G00+G03", "G00+ctrl", "G01+ctrl", "G02+ctrl", "G03+ctrl"]


def test_only_control_cells(tmp_path):
    adata = tiny_screen()
    adata = adata[adata.obs["condition"] == "control"].copy()
    with pytest.raises(GearsInputError, match="(?i)perturb"):
        tiny_pertdata(tmp_path).new_data_process("x", adata, write=False)


def test_gene_absent_from_var_and_go(tmp_path):
    adata = tiny_screen()
    adata.obs["condition"] = adata.obs["condition"].replace({"G03": "NOPE1"})
    with pytest.raises(GearsInputError, match="NOPE1"):
        tiny_pertdata(tmp_path).new_data_process("x", adata, write=False)

    p = tiny_pertdata(tmp_path, keep_unmapped_perts=True).new_data_process("x", adata, write=False)
    assert "NOPE1+ctrl" in p.conditions
    assert p.report["perturbed_genes_without_go"] == ["NOPE1"]
    assert p.report["dropped_conditions"] == []
    node = list(p.pert_names).index("NOPE1")
    assert p.cond_pert_index[p.cond_to_id["NOPE1+ctrl"]].tolist() == [node, -1]
    assert p.gene2go["NOPE1"] == set()
    g = p.go_graph()
    assert g.num_edges > 0 and not (g.edge_index == node).any()  # an isolated node


def test_measured_gene_without_go_is_dropped_and_reported(tmp_path):
    go = tiny_gene2go()
    del go["G03"]
    p = tiny_pertdata(tmp_path, gene2go=go).new_data_process("x", tiny_screen(), write=False)
    assert sorted(p.report["dropped_conditions"]) == ["G00+G03", "G03+ctrl"]
    assert p.report["perturbed_genes_without_go"] == ["G03"]
    assert p.conditions == ["ctrl", "G00+ctrl", "G01+ctrl", "G02+ctrl"]
    assert p.adata.n_obs == 30 + 3 * 12
    assert set(p.adata.obs["condition"]) == set(p.conditions)
    assert "G03" not in p.pert_names
    assert "G03" in list(p.gene_names)  # still measured, just not perturbable

    kept = tiny_pertdata(tmp_path, gene2go=go, keep_unmapped_perts=True)
    kept.new_data_process("x", tiny_screen(), write=False)
    assert "G03+ctrl" in kept.conditions and "G00+G03" in kept.conditions
    assert kept.report["dropped_conditions"] == []


def test_gene_aliases_rename_perturbed_genes(tmp_path):
    go = tiny_gene2go()
    go["G01NEW"] = go.pop("G01")
    aliases = tmp_path / "aliases.tsv"
    aliases.write_text("alias\tsymbol\nG01\tG01NEW\n")
    p = tiny_pertdata(tmp_path, gene2go=go, gene_aliases=aliases)
    p.new_data_process("x", tiny_screen(), write=False)
    assert p.report["renamed_genes"] == {"G01": "G01NEW"}
    assert "G01+ctrl" in p.conditions  # condition names keep the screen's symbols
    assert p.gene2go["G01"] == go["G01NEW"]


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("sparse", [False, True])
def test_nan_and_inf_expression(tmp_path, value, sparse):
    adata = tiny_screen()
    X = adata.X.copy()
    X[3, 4] = value
    adata.X = sp.csr_matrix(X) if sparse else X
    with pytest.raises(GearsInputError, match="1 NaN or infinite"):
        tiny_pertdata(tmp_path).new_data_process("x", adata, write=False)


def test_negative_expression(tmp_path):
    adata = tiny_screen()
    adata.X[5, 1] = -0.5
    with pytest.raises(GearsInputError, match="negative values"):
        tiny_pertdata(tmp_path).new_data_process("x", adata, write=False)


def test_duplicate_gene_names(tmp_path):
    adata = tiny_screen()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adata.var_names = [*GENES[:-1], GENES[0]]
    with pytest.raises(GearsInputError, match="duplicate gene names.*G00"):
        tiny_pertdata(tmp_path).new_data_process("x", adata, write=False)
    adata = tiny_screen()
    adata.var["gene_name"] = [*GENES[:-1], GENES[1]]  # unique ids, duplicate symbols
    with pytest.raises(GearsInputError, match="duplicate gene names.*G01"):
        tiny_pertdata(tmp_path).new_data_process("x", adata, write=False)


def test_empty_anndata(tmp_path):
    no_cells = ad.AnnData(
        X=np.zeros((0, 3), np.float32),
        obs=pd.DataFrame({"condition": []}),
        var=pd.DataFrame(index=GENES[:3]),
    )
    with pytest.raises(GearsInputError, match="empty"):
        tiny_pertdata(tmp_path).new_data_process("x", no_cells, write=False)
    no_genes = tiny_screen()[:, []].copy()
    with pytest.raises(GearsInputError, match="empty"):
        tiny_pertdata(tmp_path).new_data_process("x", no_genes, write=False)


def test_missing_condition_values(tmp_path):
    adata = tiny_screen()
    obs = adata.obs.copy()
    obs["condition"] = obs["condition"].astype(object)
    obs.iloc[[40, 41], 0] = np.nan
    adata.obs = obs
    for keep in (False, True):
        with pytest.raises(GearsInputError, match="(?i)missing|null|NaN (value|condition)"):
            tiny_pertdata(tmp_path, keep_unmapped_perts=keep).new_data_process(
                "x", adata, write=False
            )


def test_condition_with_a_single_cell(tmp_path):
    adata = tiny_screen()
    obs = adata.obs.copy()
    obs["condition"] = obs["condition"].astype(object)
    obs.iloc[35, 0] = "G04"  # one cell of a new single perturbation
    adata.obs = obs
    # Either processed, or refused with a GearsInputError that names the condition; never a
    # bare scanpy error.
    try:
        p = tiny_pertdata(tmp_path).new_data_process("x", adata, write=False)
    except GearsInputError as err:
        assert "G04" in str(err)
    else:
        assert "G04+ctrl" in p.conditions or "G04+ctrl" in p.report["dropped_conditions"]


def test_unknown_dataset_and_missing_paths(tmp_path):
    with pytest.raises(GearsInputError, match="unknown dataset 'not_a_dataset'"):
        PertData(tmp_path, verbose=False).load("not_a_dataset")
    with pytest.raises(GearsInputError, match="no .h5ad file"):
        PertData(tmp_path, verbose=False).load(data_path=tmp_path / "missing.h5ad")
    with pytest.raises(GearsInputError, match="data_name or data_path"):
        PertData(tmp_path, verbose=False).load()


def test_order_of_calls(tmp_path):
    with pytest.raises(GearsInputError, match="load data before prepare_split"):
        PertData(tmp_path, verbose=False).prepare_split("simulation")
    fresh = tiny_pertdata(tmp_path).new_data_process("x", tiny_screen(), write=False)
    with pytest.raises(GearsInputError, match="prepare_split"):
        fresh.set_rows("train")
    with pytest.raises(GearsInputError, match="prepare_split"):
        fresh.get_dataloader(4)


# ----------------------------------------------------------------------------------- real data
def test_norman19_real_data(shared_data, tmp_path):
    adata = ad.read_h5ad(shared_data / "perturbench_devel.h5ad")
    adata = adata[adata.obs["dataset"] == "norman19"].copy()
    raw = np.asarray(adata.obs["condition"].astype(str))
    assert "control" in raw and any("+" in r for r in raw)

    start = time.perf_counter()
    # IER5L has no GO annotation and is not among the 500 measured genes: keep it unmapped.
    p = PertData(
        tmp_path,
        gene2go=shared_data / "gene2go_human.tsv.gz",
        gene_aliases=shared_data / "gene_aliases_human.tsv.gz",
        keep_unmapped_perts=True,
        verbose=False,
    )
    p.new_data_process("norman19", adata)
    p.prepare_split("simulation", seed=1)
    go, coexpress = p.go_graph(), p.coexpress_graph()
    elapsed = time.perf_counter() - start
    print(f"norman19: process + simulation split + both graphs in {elapsed:.2f} s")
    assert elapsed < 30

    expected = {r: canonical_by_hand(r) for r in set(raw)}
    assert "KLF1+SET" in expected.values() and "ctrl" in expected.values()
    assert np.asarray(p.adata.obs["condition"]).tolist() == [expected[r] for r in raw]
    assert p.conditions == ["ctrl", *sorted(set(expected.values()) - {"ctrl"})]
    assert p.report["perturbed_genes_without_go"] == ["IER5L"]
    for key in de_mod.DE_KEYS:
        assert set(p.adata.uns[key]) == set(p.conditions) - {"ctrl"}
    assert (p.de_idx[1:] >= 0).all()
    assert go.num_edges > len(go.genes) > 0
    src, tgt = coexpress.edge_index
    assert coexpress.num_edges > 0 and (src != tgt).any()

    sub = p.subgroup["test_subgroup"]
    assert set().union(*map(set, sub.values())) == set(p.set2conditions["test"])
    batch = next(iter(p.get_dataloader(16)["train_loader"]))
    assert batch.x.shape == (16, 500) and batch.y.shape == (16, 500)
    ctrl_profiles = {tuple(r) for r in dense(p.adata.X[p.ctrl_rows]).tolist()}
    assert all(tuple(r) in ctrl_profiles for r in batch.x.tolist())

    p.prepare_split("combo_seen2", seed=1)
    test = p.set2conditions["test"]
    assert test and all(len(condition_genes(c)) == 2 for c in test)
    assert not set(test) & set(p.set2conditions["train"])


def test_csr_with_mixed_index_dtypes_processes_like_dense(tmp_path):
    """Writers may store int32 indices with int64 indptr; scanpy's kernels then refused the
    matrix ("Output dtype not compatible"). Processing must give the dense result."""
    adata = tiny_screen()
    csr = sp.csr_matrix(np.asarray(adata.X, np.float32))
    csr.indices = csr.indices.astype(np.int32)
    csr.indptr = csr.indptr.astype(np.int64)
    mixed = ad.AnnData(X=csr, obs=adata.obs.copy(), var=adata.var.copy())
    got = tiny_pertdata(tmp_path).new_data_process("mixed", mixed, write=False)
    want = tiny_pertdata(tmp_path).new_data_process("dense", adata, write=False)
    np.testing.assert_allclose(got.ctrl_mean, want.ctrl_mean, rtol=1e-6)
    np.testing.assert_array_equal(got.de_idx, want.de_idx)
