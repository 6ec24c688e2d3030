"""Plots a run leaves behind: loss curves and GEARS-style perturbation plots (PNG, matplotlib)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter  # noqa: E402

from gears.device import to_host  # noqa: E402

# A loss that falls by less than this factor reads best on a linear axis; a log axis over a
# narrow range labels its ticks as 8.2x10^0.
LOG_SCALE_RANGE = 10.0
PLAIN = FuncFormatter(lambda value, _: f"{value:g}")


def history_figure(history):
    """Training loss and validation mse_de per epoch -> a matplotlib Figure."""
    epochs = np.arange(1, len(history.train_loss) + 1)
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
    loss = np.asarray(history.train_loss, dtype=float)
    ax[0].plot(epochs, loss, marker="o")
    ax[0].set(xlabel="epoch", ylabel="training loss (mean per step)", title="training loss")
    finite = loss[np.isfinite(loss) & (loss > 0)]
    if finite.size and finite.max() / finite.min() > LOG_SCALE_RANGE:
        ax[0].set_yscale("log")
        ax[0].yaxis.set_major_formatter(PLAIN)  # 1, 10, 100: no 10^k notation
        ax[0].yaxis.set_minor_formatter(NullFormatter())
    val = [v.get("mse_de", np.nan) for v in history.val]
    ax[1].plot(epochs[: len(val)], val, marker="o", color="tab:orange")
    ax[1].set(xlabel="epoch", ylabel="validation mse_de", title="validation MSE, top-20 DE genes")
    for a in ax:
        a.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole numbers
        if a.get_yscale() == "linear":  # no "+8.2" offset or 1e-5 factor above the axis
            a.ticklabel_format(axis="y", style="plain", useOffset=False)
        a.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_history(history, save_file: str | Path) -> Path:
    """Training loss and validation mse_de per epoch, written to save_file (PNG)."""
    _save(history_figure(history), save_file)
    return Path(save_file)


def _save(fig, save_file: str | Path) -> None:
    """savefig through a temp file and a rename (a full disk leaves no partial PNG, and an
    error line instead of a traceback), then close the figure."""
    from gears.checkpoint import atomic_write

    try:
        atomic_write(save_file, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    finally:
        plt.close(fig)


def plot_perturbation(
    pert_data, condition: str, pred_mean: np.ndarray, save_file: str | Path | None = None
):
    """Boxes: observed per-cell change from the control mean on the condition's top-20 DE
    genes; red dots: the predicted mean change (GEARS's `plot_perturbation`).

    pred_mean: [genes] the predicted mean profile. Returns the saved path, or the Figure when
    save_file is None."""
    ctrl = pert_data.ctrl_mean
    observed = condition in pert_data.cond_to_id
    genes = (
        [g for g in pert_data.de_idx[pert_data.cond_to_id[condition]] if g >= 0]
        if observed
        else list(np.argsort(-np.abs(pred_mean - ctrl))[:20])
    )
    rows = np.flatnonzero(pert_data.cell_condition == pert_data.cond_to_id.get(condition, -1))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    handles = []
    if len(rows):
        truth = to_host(pert_data.expr.rows(rows)).numpy()[:, genes] - ctrl[genes]
        ax.boxplot(truth, showfliers=False, medianprops={"color": "black"})
        handles.append(
            Patch(
                facecolor="white",
                edgecolor="black",
                label=f"observed: {len(rows)} cells (median, quartiles, whiskers to 1.5 IQR)",
            )
        )
    ax.scatter(np.arange(1, len(genes) + 1), pred_mean[genes] - ctrl[genes], color="red", zorder=3)
    handles.append(
        Line2D([], [], color="red", marker="o", linestyle="", label="predicted mean change")
    )
    ax.axhline(0, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xticks(np.arange(1, len(genes) + 1))
    ax.set_xticklabels([pert_data.gene_names[g] for g in genes], rotation=90)
    ax.set_xlabel(
        f"top {len(genes)} DE genes of {condition}, most DE first"
        if observed
        else f"the {len(genes)} genes with the largest predicted change"
    )
    ax.set_ylabel("change over the control mean\n(log-normalised expression)")
    ax.set_title(condition + ("" if len(rows) else " (not observed)"))
    ax.legend(handles=handles, loc="best", fontsize="small")
    fig.tight_layout()
    if save_file is not None:
        _save(fig, save_file)
        return Path(save_file)
    return fig
