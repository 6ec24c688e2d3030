"""gears/eval/plots.py: the plots a run writes say what they show (legend and axis labels), and the
loss axis reads as plain numbers."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest
from helpers import tiny_split

from gears.eval.plots import history_figure, plot_history, plot_perturbation
from gears.train.engine import History


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_split(tmp_path_factory.mktemp("data"))


def _tick_labels(axis) -> list[str]:
    axis.figure.canvas.draw()
    ticks = axis.get_ticklabels() + axis.get_ticklabels(minor=True)
    return [t.get_text() for t in ticks if t.get_text()]


@pytest.mark.parametrize(
    "loss",
    [
        [8.243, 8.201, 8.15],  # a default run's first epochs: the axis read 8.2x10^0
        [120.0, 30.0, 8.0, 3.0, 1.2],  # a wide range: log axis, labelled 1, 10, 100
        [5.25],  # one epoch: the axis read 0.945 ... 1.050
    ],
)
def test_loss_axis_reads_as_plain_numbers(loss):
    history = History(train_loss=loss, val=[{"mse_de": 1.0 - 0.1 * i} for i in range(len(loss))])
    fig = history_figure(history)
    try:
        loss_ax, val_ax = fig.axes
        labels = _tick_labels(loss_ax.yaxis)
        assert labels, "the loss axis has no tick labels"
        for text in labels:  # e.g. "8.20" or "10", never "$\\mathdefault{8.2\\times10^{0}}$"
            float(text.replace("\N{MINUS SIGN}", "-"))
        assert loss_ax.yaxis.get_offset_text().get_text() == ""  # no "+8.2" above the axis
        assert loss_ax.get_yscale() == ("log" if max(loss) / min(loss) > 10 else "linear")
        for ax in fig.axes:
            assert ax.get_xlabel() == "epoch" and ax.get_ylabel()
            epochs = [float(t.replace("\N{MINUS SIGN}", "-")) for t in _tick_labels(ax.xaxis)]
            assert all(e.is_integer() for e in epochs), epochs  # whole epochs, not 1.2, 1.4
    finally:
        plt.close(fig)


def test_plot_history_writes_a_png(tmp_path):
    path = plot_history(
        History(train_loss=[2.0, 1.0], val=[{"mse_de": 1.0}, {}]), tmp_path / "l.png"
    )
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_perturbation_plot_has_a_legend_for_boxes_and_dots_and_an_x_label(tiny):
    """The observed-cell boxes had no legend entry and the x axis no label."""
    cond = next(c for c in tiny.set2conditions["test"] if c != "ctrl")
    n_cells = int((tiny.cell_condition == tiny.cond_to_id[cond]).sum())
    fig = plot_perturbation(tiny, cond, np.asarray(tiny.ctrl_mean) + 0.1)
    try:
        (ax,) = fig.axes
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert labels == [
            f"observed: {n_cells} cells (median, quartiles, whiskers to 1.5 IQR)",
            "predicted mean change",
        ]
        n_genes = len([g for g in tiny.de_idx[tiny.cond_to_id[cond]] if g >= 0])
        assert ax.get_xlabel() == f"top {n_genes} DE genes of {cond}, most DE first"
        assert "control mean" in ax.get_ylabel()
    finally:
        plt.close(fig)


def test_an_unobserved_perturbation_says_so(tiny):
    genes = list(tiny.gene_names[:2])
    fig = plot_perturbation(tiny, f"{genes[0]}+{genes[1]}", np.asarray(tiny.ctrl_mean) + 0.1)
    try:
        (ax,) = fig.axes
        assert ax.get_title().endswith("(not observed)")
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["predicted mean change"]
        assert ax.get_xlabel() == "the 20 genes with the largest predicted change"
    finally:
        plt.close(fig)


def test_a_condition_named_like_a_path_plots_inside_out_dir_plots(tmp_path):
    """The run's example plots were named by their condition: a perturbed gene named
    ../../../x/NAME wrote its plot outside out_dir. Every name now lands in out_dir/plots, one
    file each (names that clean to the same text stay apart)."""
    from gears.cli.job import plot_examples

    out = tmp_path / "a" / "b" / "c" / "run"
    units = [
        ("../../../x/NAME+ctrl", {}),
        ("/abs/G1+ctrl", {}),
        ("..+ctrl", {}),
        ("G2\x00+ctrl", {"context": "../line"}),
        ("G3+ctrl", {"context": "A172"}),
        ("G4+G5", {}),
    ]

    class Model:
        def test_units(self):
            return units

        def plot_perturbation(self, cond, save_file, values):
            Path(save_file).parent.mkdir(parents=True, exist_ok=True)
            Path(save_file).write_text(cond)

    plot_examples(Model(), out, len(units))
    written = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert all(p.parent == out / "plots" for p in written), written
    assert len(written) == len(units)
    names = {p.name for p in written}
    assert {"G3_ctrl_A172.png", "G4_G5.png"} <= names  # plain names are kept as they were


def test_a_run_whose_genes_are_named_like_paths_plots_inside_out_dir_plots(tmp_path):
    """The whole run on the hand-made screen with its perturbed genes renamed ../../../x/NAME..:
    its example plots were written to out_dir/../../x/ (seen: a/b/x/NAMEG02_ctrl.png); now
    every plot is in out_dir/plots."""
    import torch
    from helpers import GENES, tiny_gene2go, tiny_screen, write_gene2go

    from gears.cli.job import run
    from gears.config import load_config
    from gears.data.pertdata import PertData
    from gears.train.distributed import DistEnv

    names = {g: f"../../../x/NAME{g}" for g in ("G00", "G01", "G02", "G03")}

    def rename(text: str) -> str:
        for gene, name in names.items():
            text = text.replace(gene, name)
        return text

    adata = tiny_screen()
    adata.var_names = [names.get(g, g) for g in GENES]
    adata.obs["condition"] = [rename(c) for c in adata.obs["condition"]]
    go = {names.get(g, g): terms for g, terms in tiny_gene2go().items()}
    pert_data = PertData(tmp_path / "data", gene2go=write_gene2go(tmp_path / "go.tsv", go))
    pert_data.new_data_process("tiny", adata, write=False)
    pert_data.prepare_split("simulation", seed=1)
    assert any("/" in c for c in pert_data.set2conditions["test"])
    out = tmp_path / "a" / "b" / "c" / "run"
    overrides = [f"out_dir={out}", "train.epochs=1", "model.hidden_size=8", "wandb.mode=disabled"]
    cfg = load_config(None, [*overrides, "device=cpu", "train.plot_conditions=10"])
    run(cfg, DistEnv(device=torch.device("cpu")), pert_data)
    plots = sorted(tmp_path.rglob("*.png"))
    assert len(plots) > 1 and all(p.parent == out / "plots" for p in plots), plots


def _legend(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_run_title_names_the_run_the_context_and_the_model(tmp_path):
    """Two contexts' plots had the same title, and no plot named its run or model."""
    from gears.eval.plots import run_title

    assert run_title(tmp_path / "runs" / "norman", "GEARSNet") == "run norman | model GEARSNet"
    # one model per context: out_dir is the context's folder, the run its parent
    a172 = run_title(tmp_path / "lines" / "A172", "GEARSNet", "A172", context_run=True)
    t98g = run_title(tmp_path / "lines" / "T98G", "GEARSNet", "T98G", context_run=True)
    assert a172 == "run lines | context A172 | model GEARSNet" and a172 != t98g
    # one model across contexts (a fork reading the context): out_dir is the run
    joint = run_title(tmp_path / "fork", "ContextGEARS", "A172")
    assert joint == "run fork | context A172 | model ContextGEARS"


def test_loss_plot_marks_the_kept_epoch_and_the_no_change_level():
    history = History(train_loss=[3.0, 2.0, 1.5], val=[{"mse_de": v} for v in (1.0, 0.7, 0.8)])
    fig = history_figure(history, kept_epoch=2, no_change=0.9, title="run r | model GEARSNet")
    try:
        loss_ax, val_ax = fig.axes
        assert fig._suptitle.get_text() == "run r | model GEARSNet"
        labels = _legend(val_ax)
        assert "no_change: 0.9000" in labels
        assert "kept epoch 2" in labels
        (level,) = [x for x in val_ax.get_lines() if x.get_label() == "no_change: 0.9000"]
        assert list(level.get_ydata()) == [0.9, 0.9]
        (kept,) = [x for x in val_ax.get_lines() if x.get_label() == "kept epoch 2"]
        assert list(kept.get_xdata()) == [2, 2]
        assert any(x.get_label() == "kept epoch 2" for x in loss_ax.get_lines())
    finally:
        plt.close(fig)


def test_perturbation_plot_shows_train_mean_and_for_a_double_additive(tiny):
    """The prediction stood alone: nothing told a reader whether it beat a trivial guess.
    split_baselines forms the baselines from the split (train_mean always, additive for a double
    whose two singles were trained) as gears.eval.baselines does."""
    from gears.eval.baselines import additive_predictions
    from gears.eval.plots import split_baselines

    train = [c for c in tiny.set2conditions["train"] if c != "ctrl"]
    means = dict(zip(train, tiny.condition_means(train)))
    singles = {c for c in train if c.endswith("+ctrl")}
    double = next(
        c
        for c in tiny.set2conditions["test"]
        if "ctrl" not in c and all(f"{g}+ctrl" in singles for g in c.split("+"))
    )
    fig = plot_perturbation(
        tiny,
        double,
        np.asarray(tiny.ctrl_mean) + 0.1,
        baselines=split_baselines(tiny, double),
        title="run r | model GEARSNet",
    )
    try:
        (ax,) = fig.axes
        assert ax.get_title() == f"{double}\nrun r | model GEARSNet"
        labels = _legend(ax)
        assert labels[1:] == [
            "predicted mean change",
            "train_mean (mean of the training perturbations)",
            "additive (sum of the two singles' changes)",
        ]
        genes = [g for g in tiny.de_idx[tiny.cond_to_id[double]] if g >= 0]
        ctrl = np.asarray(tiny.ctrl_mean, dtype=np.float64)
        additive = additive_predictions(means, ctrl, [double])[0]
        (dots,) = [c for c in ax.collections if c.get_label() == "additive"]
        assert np.allclose(dots.get_offsets()[:, 1], (additive - ctrl)[genes])
        train_mean = np.mean(np.stack(list(means.values())), axis=0)
        (dots,) = [c for c in ax.collections if c.get_label() == "train_mean"]
        assert np.allclose(dots.get_offsets()[:, 1], (train_mean - ctrl)[genes])
    finally:
        plt.close(fig)
    single = next(c for c in tiny.set2conditions["test"] if c.endswith("+ctrl"))
    pred = np.asarray(tiny.ctrl_mean) + 0.1
    fig = plot_perturbation(tiny, single, pred, baselines=split_baselines(tiny, single))
    try:
        labels = _legend(fig.axes[0])
        assert "train_mean (mean of the training perturbations)" in labels
        assert not [x for x in labels if x.startswith("additive")]
    finally:
        plt.close(fig)
