"""The network contract (gears/model/batch.py) through the data layer, gears/model/rows.py, the
engine, the evaluator, predict and model folders: a network that reads the control cell x, a
network that reads a covariate (the context fork in examples/), pairing within contexts, and
fork classes named by model.impl. Results are checked against direct calls of the network."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import TINY
from torch import nn

from gears.compat.api import GEARS
from gears.config import ModelConfig, TrainConfig, load_config
from gears.data.conditions import condition_genes
from gears.data.loaders import pairing_hash
from gears.data.pertdata import PertData
from gears.errors import GearsInputError
from gears.model import GEARSNet, network_class
from gears.model.batch import ModelBatch, predicted_expression
from gears.model.losses import gears_loss
from gears.model.reference import GEARSReference
from gears.model.rows import batch_rows
from gears.train.distributed import DistEnv
from gears.train.engine import CELL_ROWS, Trainer, seed_everything
from gears.train.evaluate import EVAL_PAIRING_EPOCH, segment_mean

ROOT = Path(__file__).resolve().parents[1]
FORK = f"{ROOT / 'examples' / 'context_gears.py'}:ContextGEARS"


class ReadsX(GEARSReference):
    """The reference plus a term of the control cell x: its output depends on x."""

    reads_x = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.x_gain = nn.Parameter(torch.tensor(0.3))

    def forward_cells(self, cells: ModelBatch):
        centred = cells.x - cells.x.mean(1, keepdim=True)
        return super().forward_cells(cells) - self.x_gain * centred


def _screen(folder: Path, context: bool) -> PertData:
    """The TINY screen; with `context`, its cells dealt alternately to lines L1 and L2."""
    pert_data = PertData(folder, verbose=False)
    pert_data.load("synthetic", synthetic_params=TINY)
    if context:
        n = pert_data.adata.n_obs
        pert_data.adata.obs["line"] = np.where(np.arange(n) % 2 == 0, "L1", "L2")
        pert_data.set_context_key("line")
    return pert_data.prepare_split("simulation", seed=1)


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> PertData:
    return _screen(tmp_path_factory.mktemp("plain"), context=False)


@pytest.fixture(scope="module")
def lines(tmp_path_factory) -> PertData:
    return _screen(tmp_path_factory.mktemp("lines"), context=True)


def _model(pert_data: PertData, impl: str = "fast") -> GEARS:
    seed_everything(0)
    cfg = ModelConfig(hidden_size=8, impl=impl)
    return GEARS(pert_data, device="cpu").initialize(cfg)


def _reads_x_model(pert_data: PertData) -> GEARS:
    """A GEARS facade holding ReadsX (a class defined here, not named by model.impl)."""
    model = _model(pert_data, "reference")
    net = ReadsX(model.model_cfg, pert_data.n_genes, len(model.pert_list), *_graphs(model))
    net.load_state_dict(model.model.state_dict(), strict=False)
    model.model = model.evaluator.net = net
    return model


def _graphs(model: GEARS):
    (go, go_w), (co, co_w) = model.graphs["go"], model.graphs["coexpress"]
    return go, go_w, co, co_w


# ---------------------------------------------------------------------- a network that reads x
def test_a_network_that_reads_x_gets_one_row_per_cell_with_its_control_cell(plain):
    model = _reads_x_model(plain)
    trainer = Trainer(model.model, plain, TrainConfig(batch_size=16), model.model_cfg, DistEnv())
    batch = next(iter(plain.get_dataloader(16, 16)["train_loader"]))
    assert len(batch.counts) < len(batch)  # some cells share a perturbation: no dedup allowed
    assert trainer.row_layout(batch.counts) == CELL_ROWS
    model.model.train()
    state = {k: v.clone() for k, v in model.model.state_dict().items()}
    loss = trainer.loss_on(batch, trainer.row_layout(batch.counts))
    model.model.load_state_dict(state)  # (batch-norm statistics as they were)
    cells = ModelBatch(batch.uniq_pert_index[batch.inverse], 1.0, batch.x)
    direct = gears_loss(
        model.model(cells) + batch.x,
        batch.y,
        batch.inverse,
        batch.counts,
        torch.as_tensor(plain.non_zero_mask)[batch.uniq_cond],
        torch.as_tensor(plain.ctrl_mean, dtype=torch.float32),
    )
    torch.testing.assert_close(loss, direct, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="one row per cell"):
        batch_rows(batch, None, reads_x=True)


def test_evaluator_scores_a_network_that_reads_x_on_paired_control_cells(plain):
    """Each test cell through the network with its paired control cell (the evaluation
    pairing), x + change, the mean per perturbation: against a loop over conditions."""
    model = _reads_x_model(plain)
    model.model.eval()
    got = model.evaluator.predict_means("test")
    view = model.evaluator.set_view("test")
    ds = plain.example_set("test")
    X = plain.expr.numpy()
    for k, cid in enumerate(view["cond_ids"]):
        examples = np.flatnonzero(ds.cond == cid)
        x = torch.as_tensor(X[ds.control_rows(examples, EVAL_PAIRING_EPOCH)])
        rows = torch.as_tensor(plain.cond_pert_index[[cid] * len(examples)])
        with torch.no_grad():
            cells = model.model(ModelBatch(rows, 1.0, x)) + x
        np.testing.assert_allclose(got[k], cells.double().mean(0).numpy(), rtol=1e-5, atol=1e-6)


# -------------------------------------------------------------------------------- contexts
def test_pairing_stays_within_a_cells_context_and_is_unchanged_without_contexts(plain, lines):
    ds = lines.example_set("train")
    perturbed = np.flatnonzero(~ds.is_ctrl)
    paired = ds.control_rows(perturbed, epoch=3)
    assert (lines.cell_context[paired] == lines.cell_context[ds.rows[perturbed]]).all()
    assert set(lines.cell_context[paired]) == {0, 1}
    before = plain.example_set("train")  # one context: the draw over all control cells
    examples = np.flatnonzero(~before.is_ctrl)
    draw = pairing_hash(before.seed, 3, examples) % np.uint64(len(plain.ctrl_rows))
    expected = plain.ctrl_rows[draw.astype(np.int64)]
    np.testing.assert_array_equal(before.control_rows(examples, epoch=3), expected)


def test_a_context_without_control_cells_is_named(tmp_path):
    pert_data = PertData(tmp_path, verbose=False)
    pert_data.load("synthetic", synthetic_params=TINY)
    obs = pert_data.adata.obs
    obs["line"] = np.where(obs["condition"].astype(str) == "ctrl", "L1", "L2")
    with pytest.raises(GearsInputError, match=r"\['L2'\] have no control cells"):
        pert_data.set_context_key("line")


def test_batches_group_cells_by_perturbation_and_covariate(lines):
    codes = {"context": lines.cell_context}
    loader = lines.get_dataloader(32, 32, covariates=codes)["train_loader"]
    batch = next(iter(loader))
    ds = loader.dataset
    cell_codes = lines.cell_context[ds.rows[batch.example.numpy()]]
    group_codes = batch.uniq_covariates["context"][batch.inverse].numpy()
    np.testing.assert_array_equal(group_codes, cell_codes)
    np.testing.assert_array_equal(batch.uniq_cond[batch.inverse].numpy(), batch.cond.numpy())
    pairs = {(int(c), int(k)) for c, k in zip(batch.cond, cell_codes)}
    assert len(batch.counts) == len(pairs)  # one group per distinct (condition, context)
    counts = np.bincount(batch.inverse.numpy(), minlength=len(batch.counts))
    np.testing.assert_array_equal(batch.counts.numpy(), counts)
    rows = batch_rows(batch, None, covariates=("context",))
    assert set(rows.inputs.covariates) == {"context"}
    with pytest.raises(GearsInputError, match="does not carry"):
        batch_rows(batch, None, covariates=("dose",))


def test_the_context_fork_trains_evaluates_and_predicts_per_context(lines, tmp_path):
    model = _model(lines, FORK)
    assert model.config["covariates"] == {"context": ["L1", "L2"]}
    seen = []
    model.model.register_forward_hook(lambda m, args, out: seen.append(set(args[0].covariates)))
    model.train(epochs=1, batch_size=16, limit_batches=3, progress=False)
    assert seen and all(keys == {"context"} for keys in seen)
    view = model.evaluator.set_view("test")
    X = lines.expr.numpy()
    unit = view["cell_condition"]
    for k in range(len(view["conditions"])):  # each unit: one perturbation in one line
        cells = view["rows"][unit == k]
        assert (lines.cell_context[cells] == view["covariates"]["context"][k]).all()
        np.testing.assert_allclose(view["truth_mean"][k], X[cells].mean(0), rtol=1e-6)
    assert len(view["conditions"]) == 2 * len(set(view["conditions"]))
    means = model.evaluator.predict_means("test")
    cond = view["conditions"][1]
    line = ["L1", "L2"][int(view["covariates"]["context"][1])]
    predicted = model.predict([condition_genes(cond)], covariates={"context": line})
    np.testing.assert_allclose(next(iter(predicted.values())), means[1], rtol=1e-6, atol=1e-7)
    with pytest.raises(GearsInputError, match=r"give a value for \['context'\]"):
        model.predict([condition_genes(cond)])
    with pytest.raises(GearsInputError, match="not among the model's categories"):
        model.predict([condition_genes(cond)], covariates={"context": "L3"})


def test_a_saved_fork_loads_its_code_and_its_categories(lines, tmp_path):
    """The folder keeps the fork's file and the context names: loaded beside data that holds
    line L2 only, L2 keeps the model's code (1), not that data's own first code (0)."""
    model = _model(lines, FORK)
    model.train(epochs=1, batch_size=16, limit_batches=2, progress=False)
    model.save_model(tmp_path / "model")
    assert (tmp_path / "model" / "context_gears.py").is_file()
    only_l2 = PertData(tmp_path / "l2", verbose=False)
    only_l2.load("synthetic", synthetic_params=TINY)
    n = only_l2.adata.n_obs
    only_l2.adata.obs["line"] = np.where(np.arange(n) % 2 == 0, "L1", "L2")
    keep = only_l2.adata.obs["line"].values == "L2"
    only_l2.new_data_process("l2", only_l2.adata[keep].copy(), write=False)
    only_l2.set_context_key("line").prepare_split("simulation", seed=1)
    with pytest.raises(GearsInputError, match="trust_code=True"):
        GEARS(only_l2, device="cpu").load_pretrained(tmp_path / "model")
    loaded = GEARS(only_l2, device="cpu").load_pretrained(tmp_path / "model", trust_code=True)
    assert type(loaded.model).__name__ == "ContextGEARS"
    assert loaded.config["covariates"] == {"context": ["L1", "L2"]}
    for k, v in model.model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[k], v), k
    gene = [str(lines.pert_names[2])]
    want = model.predict_changes([gene], {"context": "L2"})[0]
    np.testing.assert_array_equal(loaded.predict_changes([gene], {"context": "L2"})[0], want)
    view = loaded.evaluator.set_view("test")
    assert set(view["covariates"]["context"].tolist()) == {1}


# --------------------------------------------------------------------------- model.impl specs
def test_model_impl_names_a_fork_class_or_is_refused_by_name(tmp_path):
    assert network_class(FORK).__name__ == "ContextGEARS"
    assert network_class("gears.model.reference:GEARSReference") is GEARSReference
    assert load_config(None, [f"model.impl={FORK}"]).model.impl == FORK
    refusals = {
        f"{tmp_path / 'missing.py'}:Net": "no file",
        f"{ROOT / 'examples' / 'context_gears.py'}:Nope": "defines no torch.nn.Module class 'Nope'",
        "gears.no_such_module:Net": "cannot import 'gears.no_such_module'",
        "json:loads": "defines no torch.nn.Module class 'loads'",
        "slow": "neither a built-in network",
    }
    for impl, message in refusals.items():
        with pytest.raises(GearsInputError, match=message):
            network_class(impl)


def test_the_contract_gives_defaults_to_a_network_that_declares_nothing():
    """A plain nn.Module declares nothing: each accessor gives its default. The built-in
    networks and the example forks are read through the same accessors."""
    from gears.model import contract

    bare = nn.Module()
    bare.register_buffer("go_edge_index", torch.zeros(2, 1))
    bare.register_buffer("running_mean", torch.zeros(1))
    assert not contract.reads_x(bare) and contract.declared_covariates(bare) == ()
    assert not contract.per_cell_rows(bare) and not contract.one_row_per_cell(bare)
    assert contract.declared_options(bare) == {} and not contract.syncs_batchnorm(bare)
    assert contract.graph_buffer_names(bare) == ["go_edge_index"]
    contract.set_sync_batchnorm(bare, True)  # (no effect, no error)
    contract.fixed_shape_graphs(bare)
    only_x = type("OnlyX", (nn.Module,), {"reads_x": True})  # reads x, declares no layout
    assert contract.one_row_per_cell(only_x) and contract.one_row_per_cell(GEARSReference)
    assert not contract.per_cell_rows(GEARSNet) and contract.syncs_batchnorm(GEARSNet)
    fork = network_class(FORK)
    assert contract.declared_covariates(fork) == ("context",) and not contract.reads_x(fork)


def test_predicted_expression_is_the_control_cell_plus_the_change():
    change = torch.tensor([[0.5, -1.0]], dtype=torch.bfloat16)
    x = torch.tensor([[1.0, 2.0]])
    out = predicted_expression(change, x)
    assert out.dtype == torch.float32 and out.tolist() == [[1.5, 1.0]]
    assert predicted_expression(np.array([1.0, 2.0]), np.array([0.5, 0.5])).tolist() == [1.5, 2.5]


def test_segment_mean_is_the_mean_per_group():
    X = np.arange(12, dtype=np.float64).reshape(4, 3)
    got = segment_mean(X, np.array([1, 0, 1]), np.array([0, 1, 3]), 2)
    np.testing.assert_array_equal(got, [X[1], (X[0] + X[3]) / 2])


# ------------------------------------------------------------ a model folder's code and forks
# A fork file that leaves a mark when it is imported (the mark: code ran).
MARKING_FORK = """from pathlib import Path

from gears.model.network import GEARSNet

Path({mark!r}).write_text("ran")


class Evil(GEARSNet):
    pass
"""


def _folder_naming(plain, folder: Path, impl: str, fork_file: Path | None, mark: Path) -> Path:
    """A saved model of the plain screen whose config.json says model.impl=impl; fork_file (if
    given) holds a class Evil that writes `mark` when imported."""
    seed_everything(0)
    _model(plain).save_model(folder)
    if fork_file is not None:
        fork_file.parent.mkdir(parents=True, exist_ok=True)
        fork_file.write_text(MARKING_FORK.format(mark=str(mark)))
    config = json.loads((folder / "config.json").read_text())
    config["impl"] = impl
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_model_folders_own_code_runs_only_with_trust_code(plain, tmp_path):
    """A config.json naming x.py:Evil beside an x.py ran that file on load_pretrained, with
    nothing said: now it is one line naming the file and the opt-in, and nothing runs."""
    mark = tmp_path / "ran"
    folder = _folder_naming(plain, tmp_path / "m", "x.py:Evil", tmp_path / "m" / "x.py", mark)
    with pytest.raises(GearsInputError, match=r"m/x\.py.*trust_code=True") as refused:
        GEARS(plain, device="cpu").load_pretrained(folder)
    assert "\n" not in str(refused.value) and "--trust-model-code" in str(refused.value)
    assert not mark.exists()
    loaded = GEARS(plain, device="cpu").load_pretrained(folder, trust_code=True)
    assert mark.exists() and type(loaded.model).__name__ == "Evil"


def test_a_model_folders_impl_names_only_its_own_file_checked_before_any_import(
    plain, tmp_path, monkeypatch
):
    """An absolute path, a `..` path or another module named by a folder's config.json was
    imported (even with no file in the folder): now refused before anything is imported, with
    trust_code or without; the built-in networks and gears.model's classes still load."""
    mark = tmp_path / "ran"
    outside = tmp_path / "elsewhere" / "y.py"
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "gears_test_marking_module.py").write_text(
        MARKING_FORK.format(mark=str(mark))
    )
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    cases = {
        f"{outside}:Evil": "no file y.py",
        "../elsewhere/y.py:Evil": "no file y.py",
        "gears_test_marking_module:Evil": "names the module 'gears_test_marking_module'",
        "os:system": "names the module 'os'",
        "x.py:Evil;": "not a class name",
        "gears.model.no_such_module:Evil": r"config\.json\): cannot import",
    }
    for k, (impl, message) in enumerate(cases.items()):
        folder = _folder_naming(plain, tmp_path / f"m{k}", impl, outside, mark)
        for trust in (False, True):
            with pytest.raises(GearsInputError, match=message):
                GEARS(plain, device="cpu").load_pretrained(folder, trust_code=trust)
            assert not mark.exists(), impl
    assert "gears_test_marking_module" not in sys.modules
    for impl, cls in {
        "fast": "GEARSNet",
        "gears.model.reference:GEARSReference": "GEARSReference",
    }.items():
        folder = _folder_naming(plain, tmp_path / impl, impl, None, mark)
        assert type(GEARS(plain, device="cpu").load_pretrained(folder).model).__name__ == cls


@pytest.mark.parametrize(
    "source, error",
    [
        ("from gears.model.network import GEARSNet\nclass Net(GEARSNet)\n    pass\n", "line 2"),
        ("import gears_no_such_module_here\n", "line 1: ModuleNotFoundError"),
        ("x = 1\nraise RuntimeError('not ready')\n", "line 2: RuntimeError: not ready"),
    ],
    ids=["syntax", "missing_import", "raise"],
)
def test_a_fork_that_fails_to_import_is_one_line_naming_file_and_line(tmp_path, source, error):
    fork = tmp_path / "broken_fork.py"
    fork.write_text(source)
    with pytest.raises(GearsInputError, match=rf"broken_fork\.py.*{error}") as refused:
        network_class(f"{fork}:Net")
    assert "\n" not in str(refused.value)


def test_a_fork_imports_a_module_beside_it_and_its_folder_keeps_both(plain, tmp_path):
    """`from my_layers import Scale` beside the fork failed (ModuleNotFoundError); now it
    imports, save_model copies the module into the model folder, and the folder loads with
    the originals gone."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "gears_test_layers.py").write_text("SCALE = 2.0\n")
    (src / "gears_test_unused.py").write_text("raise RuntimeError('never imported')\n")
    (src / "sibling_fork.py").write_text(
        "from gears_test_layers import SCALE\n"
        "from gears.model.reference import GEARSReference\n\n\n"
        "class Net(GEARSReference):\n"
        "    def cell_embedding(self, cells):\n"
        "        return super().cell_embedding(cells) * SCALE\n"
    )
    model = _model(plain, f"{src / 'sibling_fork.py'}:Net")
    model.save_model(tmp_path / "model")
    saved = sorted(p.name for p in (tmp_path / "model").glob("*.py"))
    assert saved == ["gears_test_layers.py", "sibling_fork.py"]
    want = model.predict_changes([[str(plain.pert_names[2])]])[0]
    shutil.rmtree(src)
    sys.modules.pop("gears_test_layers", None)
    loaded = GEARS(plain, device="cpu").load_pretrained(tmp_path / "model", trust_code=True)
    got = loaded.predict_changes([[str(plain.pert_names[2])]])[0]
    np.testing.assert_array_equal(got, want)
