"""gears/cli/check_model.py: the fork guard passes on the code as it is, and names the layer where
an
edit of the fast network departs from the reference (the edits monkeypatched in)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY_CLI
from torch import nn

from gears.cli import check_model as cm
from gears.cli.job import DEFAULT_CONFIG, load_pert_data
from gears.config import load_config
from gears.model import network, reference
from gears.train.distributed import DistEnv


def _overrides(data_dir) -> list[str]:
    return [f"data.data_dir={data_dir}", f"data.synthetic={TINY_CLI}", "wandb.mode=disabled"]


@pytest.fixture(scope="module")
def screen(tmp_path_factory):
    """(config, PertData) of the tiny synthetic screen."""
    cfg = load_config(None, _overrides(tmp_path_factory.mktemp("data")), base=DEFAULT_CONFIG)
    return cfg, load_pert_data(cfg, DistEnv())


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # (conftest restores the count) small kernels: no thread handoff


def test_code_as_it_is_passes(screen, capsys):
    cfg, _ = screen
    assert cm.main([*_overrides(cfg.data.data_dir), "model.uncertainty=true"]) == 0
    out = capsys.readouterr().out
    assert "OK: every layer agrees" in out
    for layer in ("pert_fuse.norms.0", "recovery_w.linears.1", "uncertainty_w.norms.2"):
        assert layer in out  # compared, with a row in the table


def test_plain_batchnorm_in_both_mlps_is_named(screen, monkeypatch):
    """A batch-norm appended to the MLP of both networks, written plainly in the fast one: its
    rows are distinct perturbations, so it ignores their cells (and counts controls in the
    fusion MLP). The check names it."""

    def init(self, sizes, _init):
        _init(self, sizes)
        self.extra = nn.BatchNorm1d(sizes[-1])

    for module in (network, reference):
        _init = module.MLP.__init__
        monkeypatch.setattr(module.MLP, "__init__", lambda s, sizes, i=_init: init(s, sizes, i))
    fast_forward, ref_forward = network.MLP.forward, reference.MLP.forward
    monkeypatch.setattr(
        network.MLP, "forward", lambda s, x, w=None, b=None: s.extra(fast_forward(s, x, w, b))
    )
    monkeypatch.setattr(
        reference.MLP, "forward", lambda s, x, rows=None: s.extra(ref_forward(s, x, rows=rows))
    )
    report = cm.check_model(*screen)
    assert not report.ok and report.first_departing().endswith(".extra"), report.table()
    assert "DEPARTS first at" in report.table()


def test_dropout_in_the_fast_mlp_is_named(screen, monkeypatch):
    """Dropout after each hidden layer of the fast MLP only: the next Linear departs first."""

    def forward(self, x, weight=None, blocks=None):
        last = len(self.linears) - 1
        for i, (linear, norm) in enumerate(zip(self.linears, self.norms)):
            x = norm(linear(x), weight, blocks)
            if i < last:
                x = F.dropout(torch.relu(x), 0.1, self.training)
        return x

    monkeypatch.setattr(network.MLP, "forward", forward)
    report = cm.check_model(*screen)
    assert report.first_departing() == "emb_trans_v2.linears.1", report.table()


def test_weights_that_do_not_load_are_a_clear_failure(screen, monkeypatch):
    _init = network.MLP.__init__

    def init(self, sizes):
        _init(self, sizes)
        self.scale = nn.Parameter(torch.ones(1))

    monkeypatch.setattr(network.MLP, "__init__", init)
    report = cm.check_model(*screen)
    assert not report.ok and "emb_trans_v2.scale" in report.table()


# ------------------------------------------------------------------------- contract checks
class ReadsXUndeclared(reference.GEARSReference):
    """A fork that adds the control cell when it is given one, without declaring reads_x."""

    def forward_cells(self, cells):
        change = super().forward_cells(cells)
        return change if cells.x is None else change + 0.1 * cells.x


def test_contract_holds_for_the_code_as_it_is(screen):
    report = cm.check_model(*screen)
    assert report.contract and not any(report.contract.values()), report.table()
    assert "contract: distinct rows = one row per cell: ok" in report.table()


def test_a_row_mixing_layer_fails_the_distinct_rows_check(screen, monkeypatch):
    """Centring each MLP output over its rows (a mean over the batch dimension, weighted by
    nothing): distinct rows no longer stand for their cells."""
    forward = network.MLP.forward
    monkeypatch.setattr(
        network.MLP, "forward", lambda s, x, *a: (lambda y: y - y.mean(0))(forward(s, x, *a))
    )
    report = cm.check_model(*screen)
    problem = report.contract["distinct rows = one row per cell"]
    assert not report.ok and "train mode" in problem, report.table()


def test_reading_x_without_declaring_it_is_named(screen):
    cfg, pert_data = screen
    impl = "tests.test_check_model:ReadsXUndeclared"
    report = cm.check_model(replace(cfg, model=replace(cfg.model, impl=impl)), pert_data)
    problem = report.contract["undeclared inputs ignored"]
    assert "a control cell x (reads_x is False)" in problem, report.table()
    assert not report.ok


def test_the_context_fork_passes_the_contract(tmp_path):
    from pathlib import Path

    fork = Path(__file__).resolve().parents[1] / "examples" / "context_gears.py"
    overrides = [*_overrides(tmp_path), f"model.impl={fork}:ContextGEARS"]
    cfg = load_config(None, [*overrides, "data.context_key=cell_type"], base=DEFAULT_CONFIG)
    report = cm.check_model(cfg, load_pert_data(cfg, DistEnv()))
    assert report.ok and "context_emb.weight" in report.skipped, report.table()


def test_bad_input_on_the_command_line_is_one_line_and_status_2():
    """`python -m gears.cli.check_model` with an unknown key printed GearsInputError's traceback."""
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run(
        [sys.executable, "-m", "gears.cli.check_model", "train.nope=1"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: unknown config key 'train.nope'")
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


# ---------------------------------------------------------------- stochastic forks, options
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
DROPOUT = f"{EXAMPLES / 'dropout_gears.py'}:DropoutGEARS"


class FunctionalDropout(reference.GEARSReference):
    """Dropout with no module to switch off (F.dropout on self.training)."""

    def cell_embedding(self, cells):
        return F.dropout(super().cell_embedding(cells), 0.2, self.training)


def test_the_dropout_fork_trains_saves_loads_and_passes_check_model(tmp_path, capsys):
    """A correct fork that adds dropout failed check_model ("train mode: cell predictions
    differ", then every later layer departed): its train-mode checks now run with dropout off
    and say so. Its option (model.extra.dropout) reaches the network, config.json records it
    and load_pretrained rebuilds it."""
    from gears.cli.job import run
    from gears.compat.api import GEARS
    from gears.train.saved_model import read_model_json

    data = tmp_path / "data"
    overrides = [*_overrides(data), f"model.impl={DROPOUT}", "model.extra.dropout=0.3"]
    cfg = load_config(
        None,
        [*overrides, f"out_dir={tmp_path / 'run'}", "train.epochs=1", "train.plot_conditions=0"],
        base=DEFAULT_CONFIG,
    )
    run(cfg, DistEnv())
    folder = tmp_path / "run" / "model"
    assert read_model_json(folder, "config.json")["extra"] == {"dropout": 0.3}
    loaded = GEARS(load_pert_data(cfg, DistEnv()), device="cpu").load_pretrained(
        folder, trust_code=True
    )
    assert type(loaded.model).__name__ == "DropoutGEARS" and loaded.model.dropout.p == 0.3
    capsys.readouterr()
    assert cm.main(overrides) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "stochastic in training mode" in out and "dropout off" in out, out
    assert "OK: every layer agrees" in out and "departs" not in out, out


def test_a_stochastic_fork_without_dropout_modules_is_compared_in_evaluation_mode(screen):
    cfg, pert_data = screen
    impl = "tests.test_check_model:FunctionalDropout"
    report = cm.check_model(replace(cfg, model=replace(cfg.model, impl=impl)), pert_data)
    assert report.ok, report.table()
    assert "evaluation mode only" in report.table(), report.table()


def test_a_fork_option_it_does_not_declare_is_refused_naming_the_accepted_ones(tmp_path):
    from gears.cli.job import check_before_the_run
    from gears.errors import GearsInputError

    cfg = load_config(None, [f"model.impl={DROPOUT}", "model.extra.dropuot=0.2"])
    with pytest.raises(GearsInputError, match=r"\['dropuot'\].*accepts: dropout \(default 0.1\)"):
        check_before_the_run(cfg)
    with pytest.raises(GearsInputError, match="model.extra.dropout.*not a valid float"):
        check_before_the_run(load_config(None, [f"model.impl={DROPOUT}", "model.extra.dropout=x"]))
    with pytest.raises(GearsInputError, match="'fast' does not take; it accepts: none"):
        check_before_the_run(load_config(None, ["model.extra.dropout=0.2"]))
