"""Plots a run leaves behind: loss curves and GEARS-style perturbation plots (PNG, matplotlib)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from gears.device import to_host  # noqa: E402


def plot_history(history, save_file: str | Path) -> Path:
    """Training loss and validation mse_de per epoch."""
    epochs = np.arange(1, len(history.train_loss) + 1)
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
    ax[0].plot(epochs, history.train_loss, marker="o")
    ax[0].set(xlabel="epoch", ylabel="training loss", title="training loss", yscale="log")
    val = [v.get("mse_de", np.nan) for v in history.val]
    ax[1].plot(epochs, val, marker="o", color="tab:orange")
    ax[1].set(xlabel="epoch", ylabel="val mse_de", title="validation MSE, top-20 DE genes")
    fig.tight_layout()
    fig.savefig(save_file, dpi=110)
    plt.close(fig)
    return Path(save_file)


def plot_perturbation(
    pert_data, condition: str, pred_mean: np.ndarray, save_file: str | Path | None = None
):
    """Boxes: observed per-cell change from control on the condition's top-20 DE genes;
    red dots: the predicted mean change (GEARS's `plot_perturbation`)."""
    ctrl = pert_data.ctrl_mean
    genes = (
        [g for g in pert_data.de_idx[pert_data.cond_to_id[condition]] if g >= 0]
        if condition in pert_data.cond_to_id
        else list(np.argsort(-np.abs(pred_mean - ctrl))[:20])
    )
    rows = np.flatnonzero(pert_data.cell_condition == pert_data.cond_to_id.get(condition, -1))
    fig, ax = plt.subplots(figsize=(10, 4))
    if len(rows):
        truth = to_host(pert_data.expr.rows(rows)).numpy()[:, genes] - ctrl[genes]
        ax.boxplot(truth, showfliers=False, medianprops={"color": "black"})
    ax.scatter(
        np.arange(1, len(genes) + 1),
        pred_mean[genes] - ctrl[genes],
        color="red",
        zorder=3,
        label="predicted",
    )
    ax.axhline(0, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xticks(np.arange(1, len(genes) + 1))
    ax.set_xticklabels([pert_data.gene_names[g] for g in genes], rotation=90)
    ax.set_ylabel("change over control")
    ax.set_title(condition + ("" if len(rows) else " (not observed)"))
    ax.legend(loc="best")
    fig.tight_layout()
    if save_file is not None:
        fig.savefig(save_file, dpi=110)
        plt.close(fig)
        return Path(save_file)
    return fig
