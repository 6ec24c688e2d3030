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

from gears.data.conditions import CTRL
from gears.device import to_host  # noqa: E402
from gears.eval.baselines import additive_predictions
from gears.io import atomic_write

# A loss that falls by less than this factor reads best on a linear axis; a log axis over a
# narrow range labels its ticks as 8.2x10^0.
LOG_SCALE_RANGE = 10.0
PLAIN = FuncFormatter(lambda value, _: f"{value:g}")


def run_title(
    out_dir: str | Path, model: str, context: str | None = None, context_run: bool = False
) -> str:
    """What a plot names so it stands alone: the run (out_dir's name), the context if any, the
    model (network class). context_run: out_dir is one context's folder of a run that trains
    one model per context (gears.cli.contexts), so the run is its parent folder."""
    out = Path(out_dir)
    parts = [f"run {out.parent.name if context_run else out.name}"]
    if context is not None:
        parts.append(f"context {context}")
    return " | ".join([*parts, f"model {model}"])


def history_figure(
    history, kept_epoch: int | None = None, no_change: float | None = None, title: str = ""
):
    """Training loss and validation mse_de per epoch -> a matplotlib Figure.

    kept_epoch (from 1): a vertical line on both panels at the epoch whose weights were kept.
    no_change: no_change's validation mse_de, drawn as a level under the validation curve (a
    model above it predicts worse than no change at all). title: above both panels (run_title).
    """
    epochs = np.arange(1, len(history.train_loss) + 1)
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.8 if title else 3.5))
    loss = np.asarray(history.train_loss, dtype=float)
    ax[0].plot(epochs, loss, marker="o")
    ax[0].set(xlabel="epoch", ylabel="training loss (mean per step)", title="training loss")
    finite = loss[np.isfinite(loss) & (loss > 0)]
    if finite.size and finite.max() / finite.min() > LOG_SCALE_RANGE:
        ax[0].set_yscale("log")
        ax[0].yaxis.set_major_formatter(PLAIN)  # 1, 10, 100: no 10^k notation
        ax[0].yaxis.set_minor_formatter(NullFormatter())
    val = [v.get("mse_de", np.nan) for v in history.val]
    ax[1].plot(epochs[: len(val)], val, marker="o", color="tab:orange", label="model")
    ax[1].set(xlabel="epoch", ylabel="validation mse_de", title="validation MSE, top-20 DE genes")
    if no_change is not None and np.isfinite(no_change):
        ax[1].axhline(  # across the whole axis: visible with one epoch too
            no_change,
            color="grey",
            linestyle="--",
            label=f"no_change: {no_change:.4f}",
        )
    for a in ax:
        if kept_epoch is not None:
            a.plot(
                [kept_epoch, kept_epoch],
                [0, 1],
                transform=a.get_xaxis_transform(),  # x in epochs, y over the whole axis
                color="tab:green",
                linestyle=":",
                label=f"kept epoch {kept_epoch}",
            )
        a.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole numbers
        if len(epochs) == 1:  # else the locator spreads 0.945 ... 1.050 around the one epoch
            a.set_xlim(0.5, 1.5)
            a.set_xticks([1])
        if a.get_yscale() == "linear":  # no "+8.2" offset or 1e-5 factor above the axis
            a.ticklabel_format(axis="y", style="plain", useOffset=False)
        a.grid(alpha=0.3)
    if kept_epoch is not None or no_change is not None:
        ax[1].legend(loc="best", fontsize="small")
    if title:
        fig.suptitle(title, fontsize="medium")
    fig.tight_layout()
    return fig


def plot_history(
    history,
    save_file: str | Path,
    kept_epoch: int | None = None,
    no_change: float | None = None,
    title: str = "",
) -> Path:
    """Training loss and validation mse_de per epoch, written to save_file (PNG); the other
    arguments as history_figure's."""
    _save(history_figure(history, kept_epoch, no_change, title), save_file)
    return Path(save_file)


def _save(fig, save_file: str | Path) -> None:
    """savefig through a temp file and a rename (a full disk leaves no partial PNG, and an
    error line instead of a traceback), then close the figure."""
    try:
        atomic_write(save_file, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    finally:
        plt.close(fig)


# The baselines a perturbation plot draws beside the prediction, with their legend text.
PLOT_BASELINES = {
    "train_mean": ("mean of the training perturbations", "tab:blue", "s"),
    "additive": ("sum of the two singles' changes", "tab:green", "^"),
}


def split_baselines(pert_data, condition: str) -> dict[str, np.ndarray]:
    """The PLOT_BASELINES predictions of one condition from pert_data's split (as
    gears.eval.baselines forms them): name -> [genes] mean profile; additive only where it can be
    formed, nothing without a training perturbation."""
    train = [c for c in (getattr(pert_data, "set2conditions", None) or {}).get("train", [])]
    train = [c for c in train if c != CTRL and c in pert_data.cond_to_id]
    if not train:
        return {}
    means = dict(zip(train, pert_data.condition_means(train)))
    ctrl = np.asarray(pert_data.ctrl_mean, dtype=np.float64)
    out = {"train_mean": np.mean(np.stack(list(means.values())), axis=0)}
    additive = additive_predictions(means, ctrl, [condition])[0]
    if "+" in condition and CTRL not in condition.split("+") and not np.isnan(additive).any():
        out["additive"] = additive
    return out


def plot_perturbation(
    pert_data,
    condition: str,
    pred_mean: np.ndarray,
    save_file: str | Path | None = None,
    *,
    baselines: dict[str, np.ndarray] | None = None,
    title: str = "",
):
    """Boxes: observed per-cell change from the control mean on the condition's top-20 DE
    genes; red dots: the predicted mean change (GEARS's `plot_perturbation`); beside them the
    baselines' changes (train_mean, and additive for a double), so a reader sees whether the
    prediction beats a trivial guess.

    pred_mean: [genes] the predicted mean profile. baselines: name -> [genes] mean profile
    (PLOT_BASELINES' names, e.g. split_baselines(pert_data, condition); None: none drawn). title:
    a second title line (run_title). Returns the saved path, or the Figure when save_file is None.
    """
    ctrl = pert_data.ctrl_mean
    observed = condition in pert_data.cond_to_id
    genes = (
        [g for g in pert_data.de_idx[pert_data.cond_to_id[condition]] if g >= 0]
        if observed
        else list(np.argsort(-np.abs(pred_mean - ctrl))[:20])
    )
    baselines = baselines or {}
    rows = np.flatnonzero(pert_data.cell_condition == pert_data.cond_to_id.get(condition, -1))
    fig, ax = plt.subplots(figsize=(13, 4.8 if title else 4.5))
    handles = []
    x = np.arange(1, len(genes) + 1)
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
    ax.scatter(x, pred_mean[genes] - ctrl[genes], color="red", zorder=4, label="prediction")
    handles.append(
        Line2D([], [], color="red", marker="o", linestyle="", label="predicted mean change")
    )
    for shift, (name, (what, color, marker)) in zip((-0.22, 0.22), PLOT_BASELINES.items()):
        profile = baselines.get(name)
        if profile is None or np.isnan(profile).any():
            continue
        change = np.asarray(profile, dtype=np.float64)[genes] - ctrl[genes]
        ax.scatter(x + shift, change, color=color, marker=marker, s=18, zorder=3, label=name)
        handles.append(
            Line2D([], [], color=color, marker=marker, linestyle="", label=f"{name} ({what})")
        )
    ax.axhline(0, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xticks(x)
    ax.set_xticklabels([pert_data.gene_names[g] for g in genes], rotation=90)
    ax.set_xlabel(
        f"top {len(genes)} DE genes of {condition}, most DE first"
        if observed
        else f"the {len(genes)} genes with the largest predicted change"
    )
    ax.set_ylabel("change over the control mean\n(log-normalised expression)")
    ax.set_title(
        condition + ("" if len(rows) else " (not observed)") + (f"\n{title}" if title else "")
    )
    # beside the axes, not over the boxes: "best" still covers some with four entries
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    fig.tight_layout()
    if save_file is not None:
        _save(fig, save_file)
        return Path(save_file)
    return fig
