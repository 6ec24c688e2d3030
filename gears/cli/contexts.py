"""One model per context (data.context_key, e.g. the cell line): split, train and score each
context on its own, then one summary of every context and their mean.

A network that reads the context (it declares `covariates = ("context", ...)`) trains one model
across contexts instead; `one_model_per_context` tells the two apart, and the joint model's
per-context scoring uses the same data layer (`PertData.contexts`, `PertData.context_view`).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np

from gears.data import splits
from gears.data.conditions import CTRL
from gears.errors import GearsInputError
from gears.eval.predicted_cells import require_cell_eval
from gears.eval.vcc2026 import require_cell_eval2
from gears.io import atomic_write
from gears.model import network_class
from gears.model.contract import declared_covariates

SUMMARY_FILE = "contexts.json"  # context -> its run folder and model, for predict.py
SUMMARY_METRICS = ("mse", "mse_de", "pearson_delta", "pearson_delta_de")


def reads_context(network_class) -> bool:
    """Whether a network reads each cell's context (and so trains across contexts)."""
    return "context" in declared_covariates(network_class)


def one_model_per_context(cfg) -> bool:
    """data.context_key is set, and data.context_models is per_context, or auto with a
    network that does not read the context."""
    if cfg.data.context_key is None or cfg.data.context_models == "joint":
        return False
    if cfg.data.context_models == "per_context":
        return True
    return not reads_context(network_class(cfg.model.impl))


# What out_dir holds beside the contexts' folders: a context never takes one of these names.
SUMMARY_NAMES = (
    "config.yaml",
    "metrics.json",
    SUMMARY_FILE,
    "model",
    "checkpoints",
    "plots",
    "cell_eval",
    "cell_eval2",
    "wandb",
)


def context_folder(name: str) -> str:
    """A context's run folder under out_dir, and its part of file names (predict.py's
    <out stem>_<folder>.h5ad): letters, digits, '.', '_' and '-' (others become '_'), never
    starting with '.' (so never '.' or '..', nor hidden), never a summary's name (SUMMARY_NAMES:
    prefixed 'context_')."""
    import re

    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", str(name).strip())
    safe = re.sub(r"^\.+", lambda m: "_" * len(m.group()), safe) or "context"
    if safe.casefold() in {n.casefold() for n in SUMMARY_NAMES}:
        safe = f"context_{safe}"
    return safe


def context_folders(contexts) -> dict[str, str]:
    """context -> context_folder(context), or a GearsInputError naming every pair of contexts
    that would share a folder (also where case alone differs: some file systems ignore it)."""
    folders = {name: context_folder(name) for name in contexts}
    seen: dict[str, str] = {}
    clashes = []
    for name, folder in folders.items():
        other = seen.setdefault(folder.casefold(), name)
        if other != name:
            clashes.append(f"{other!r} and {name!r} (both {folder!r})")
    if clashes:
        raise GearsInputError(
            f"contexts {'; '.join(clashes)} become the same folder and file name; rename one "
            "of each pair in the data's context column so that they differ in letters or digits"
        )
    return folders


def check_splittable(cfg, pert_data, contexts) -> None:
    """Split each context's conditions as its view will (cfg.split), before any context
    trains: a context that cannot be split is named now, not after the others have trained."""
    if pert_data.cell_context is None or pert_data.cell_condition is None:
        return
    split = cfg.split
    conditions = np.asarray(pert_data.conditions, dtype=object)
    for name in contexts:
        rows = pert_data.cell_context == contexts.index(name)
        counts = np.bincount(pert_data.cell_condition[rows], minlength=len(conditions))
        kept = sorted({str(c) for c in conditions[counts >= 2]} | {CTRL})
        try:
            split_dict = None
            if split.type == "custom":
                if split.split_dict_path is None:
                    return  # said by the view's own prepare_split
                split_dict = splits.load_split_dict(split.split_dict_path, kept)
            splits.make_split(
                kept,
                split.type,
                split_dict=split_dict,
                seed=split.seed,
                train_gene_set_size=split.train_gene_set_size,
                combo_seen2_train_frac=split.combo_seen2_train_frac,
                test_size=split.test_size,
                val_size=split.val_size,
            )
        except GearsInputError as e:
            raise GearsInputError(
                f"context {name!r} ({len(kept) - 1} perturbation(s)) cannot be split, so no "
                f"context was trained: {e}. Leave it out (data.subset), or choose a split.type "
                "every context can take"
            ) from None


def run_contexts(cfg, env, pert_data, *, load, prepare, run_one) -> dict | None:
    """Train, evaluate and score one model per context, one after another, each in
    out_dir/<context>/ (a whole run folder: config.yaml, metrics.json, model/ ...), with the
    same config and seeds; then out_dir/metrics.json (every context's test metrics and 2026
    scores, and their mean over contexts), out_dir/contexts.json and a printed table.

    pert_data: the whole data (not split), or None to load it with load(cfg, env);
    prepare(view, cfg) splits a context's view and builds its graphs; run_one(cfg, env,
    pert_data=view) trains and scores it (gears.cli.job passes its own; this module imports
    nothing of gears.cli.job, which dispatches here)."""
    if env.world_size > 1:
        raise GearsInputError(
            "data.context_key trains one model per context, one after another, in one "
            "process; run it with train_single.py, or launch one context at a time with "
            "data.subset={<context column>: <context>} and data.context_key=null"
        )
    if cfg.eval.cell_eval:
        require_cell_eval()
    if cfg.eval.cell_eval2:
        require_cell_eval2()  # before any context trains
    out = Path(cfg.out_dir)
    if pert_data is None:
        pert_data = load(cfg, env)
    contexts = pert_data.contexts
    if not contexts:
        raise GearsInputError(f"data.context_key={cfg.data.context_key!r} names no context")
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
        cfg.save(out / "config.yaml")
        print(
            f"{len(contexts)} contexts in obs[{cfg.data.context_key!r}]: {contexts}; one model "
            "each, one after another",
            flush=True,
        )
    folders = context_folders(contexts)  # before any context trains
    check_splittable(cfg, pert_data, contexts)
    per_context, later = {}, []
    for name in contexts:
        sub = copy.deepcopy(cfg)
        sub.out_dir = str(out / folders[name])
        if env.is_main:
            print(f"\n=== context {name!r} -> {sub.out_dir}", flush=True)
        view = prepare(pert_data.context_view(name), sub)
        mine: list = []
        per_context[name] = run_one(sub, env, pert_data=view, later=mine)
        later.append((name, mine))
    if not env.is_main:
        return None
    # Every context's model and metrics.json are written, and now the summary: the optional
    # outputs (plots, cell-eval, cell-eval2) come after, and rewrite it with their scores.
    summary = _write_summary(cfg, out, per_context, folders)
    if any(mine for _, mine in later):
        for name, mine in later:
            if env.is_main:
                print(f"\n=== context {name!r}: plots and scores", flush=True)
            for optional_outputs in mine:
                per_context[name] = optional_outputs()
        summary = _write_summary(cfg, out, per_context, folders)
    print_contexts_table(summary)
    print(f"\nwrote {out}/ (metrics.json, {SUMMARY_FILE}, one folder per context)", flush=True)
    return summary


def _write_summary(cfg, out: Path, per_context: dict, folders: dict[str, str]) -> dict:
    summary = summarize(cfg.data.context_key, per_context)
    summary["folders"] = dict(folders)
    text = json.dumps(summary, indent=1)
    atomic_write(out / "metrics.json", lambda tmp: tmp.write_text(text))
    index = {
        "context_key": cfg.data.context_key,
        "contexts": {name: f"{folders[name]}/model" for name in per_context},
    }
    index_text = json.dumps(index, indent=1)
    atomic_write(out / SUMMARY_FILE, lambda tmp: tmp.write_text(index_text))
    return summary


def summarize(context_key: str, per_context: dict[str, dict]) -> dict:
    """Every context's test metrics (GEARS and baselines) and vcc2026 scores, and their mean
    over the contexts that have them."""
    contexts = {}
    for name, res in per_context.items():
        entry = {
            "test": res.get("test", {}),
            "baselines": res.get("baselines", {}),
            "best_epoch": res.get("best_epoch"),
            "n_test_perturbations": res.get("test", {}).get("n_conditions"),
        }
        if res.get("cell_eval2"):
            entry["cell_eval2"] = res["cell_eval2"]
        if res.get("cell_eval"):
            entry["cell_eval"] = res["cell_eval"]
        contexts[name] = entry
    mean = {"test": _mean_of([c["test"] for c in contexts.values()]), "baselines": {}}
    names = sorted({b for c in contexts.values() for b in c["baselines"]})
    for b in names:
        mean["baselines"][b] = _mean_of([c["baselines"].get(b, {}) for c in contexts.values()])
    # A context whose scoring failed holds {"error": why} and is left out of the mean.
    scored = {
        n: c["cell_eval2"] for n, c in contexts.items() if "predictors" in c.get("cell_eval2", {})
    }
    if scored:
        mean["cell_eval2"] = {}
        predictors = sorted({p for s in scored.values() for p in s["predictors"]})
        for p in predictors:
            # a predictor cell-eval2 could not score in a context holds no score there
            used = {
                n: s["predictors"][p]
                for n, s in scored.items()
                if s["predictors"].get(p, {}).get("score") is not None
            }
            rows = list(used.values())
            if not rows:
                continue
            mean["cell_eval2"][p] = {
                "scaled": _mean_of([r["scaled"] for r in rows]),
                "raw": _mean_of([r["raw"] for r in rows]),
                "score": _mean_of([{"score": r["score"]} for r in rows]).get("score"),
                "n_contexts": len(rows),
                "contexts": list(used),  # the contexts this mean is over
                # a member unscored in a context is left out of its mean: say over how many
                "n_contexts_scaled": {
                    m: sum(r["scaled"].get(m) is not None for r in rows) for m in rows[0]["scaled"]
                },
            }
    return {"context_key": context_key, "contexts": contexts, "mean_over_contexts": mean}


def _mean_of(rows: list[dict]) -> dict:
    """Per key, the mean of the finite numbers the rows hold (None when none has one)."""
    keys = sorted({k for r in rows for k, v in r.items() if isinstance(v, (int, float))})
    out = {}
    for k in keys:
        vals = [float(r[k]) for r in rows if isinstance(r.get(k), (int, float))]
        vals = [v for v in vals if math.isfinite(v)]
        out[k] = float(np.mean(vals)) if vals else None
    return out


def print_contexts_table(summary: dict) -> None:
    """Test metrics per context and their mean (GEARS and each baseline); then each
    predictor's vcc2026 score per context."""
    contexts = list(summary["contexts"])
    cols = [*contexts, "mean"]
    width = 36
    print(
        "\nper context: test metrics (mean over perturbations; lower mse is better, higher "
        "pearson is better), then their mean over contexts"
    )
    print("".ljust(width) + "".join(c[:11].rjust(12) for c in cols))
    mean = summary["mean_over_contexts"]
    predictors = ["gears", *mean["baselines"]]
    for p in predictors:
        for m in SUMMARY_METRICS:
            vals = []
            for c in contexts:
                row = summary["contexts"][c]
                src = row["test"] if p == "gears" else row["baselines"].get(p, {})
                vals.append(src.get(m))
            vals.append((mean["test"] if p == "gears" else mean["baselines"].get(p, {})).get(m))
            print(f"{p} {m}".ljust(width) + "".join(_cell(v) for v in vals))
    if "cell_eval2" not in mean:
        return
    print(
        "\nper context: cell-eval2 vcc2026 score (mean of the scaled members; 0 = the "
        "mean-response baseline, 1 = a replicate)"
    )
    print("".ljust(width) + "".join(c[:11].rjust(12) for c in cols))
    for p in mean["cell_eval2"]:
        vals = []
        for c in contexts:
            ce = summary["contexts"][c].get("cell_eval2", {}).get("predictors", {})
            vals.append(ce.get(p, {}).get("score"))
        vals.append(mean["cell_eval2"][p]["score"])
        print(f"{p} score".ljust(width) + "".join(_cell(v) for v in vals))


def _cell(value) -> str:
    return ("-" if value is None else f"{value:.4f}").rjust(12)
