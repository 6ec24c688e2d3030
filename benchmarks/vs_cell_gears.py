"""This project's GEARS beside the original `cell-gears` 0.1.2: same input, same split, same
hyperparameters, both scored by this project's metric code.

    python benchmarks/vs_cell_gears.py     # every dataset, seeds 1,2,3, ~1,000 steps (see --epochs)
    python benchmarks/vs_cell_gears.py --datasets synthetic_500x2k --seeds 1,2,3 --epochs 5 \
        --json vs.json --out benchmarks/results/vs_cell_gears

What it does, per dataset:
1. Writes one input for both tools into <work>/<dataset>/: `screen.h5ad` (log-normalised
   expression, obs `condition` in GEARS spelling + `cell_type`, var `gene_name`, no DE results,
   so each tool computes its own), the gene -> GO annotations as `gene2go.tsv` (ours) and
   `gene2go_all.pkl` (cell-gears), the same dict. Perturbations whose genes have no GO annotation
   are removed from the input (cell-gears cannot index them).
2. Per split seed: this project's `simulation` split, written as `split_seed<s>.pkl`
   ({"train", "val", "test"} condition lists) and given to cell-gears as `prepare_split('custom')`;
   our worker recomputes the split and checks it equals the file.
3. Runs both tools in fresh subprocesses (alternating which goes first, seed by seed), with
   GEARS's recipe on both sides: hidden 64, batch 32, Adam lr 1e-3 weight decay 5e-4, LR halved
   every epoch, best epoch by validation mse_de (ours: configs/gears_paper.yaml), `--epochs` each.
   cell-gears runs in its own virtual environment (created on first use, `--venv`) from a neutral
   working directory with `python -P`, so `import gears` finds it and not this project.
4. Scores both tools' mean test predictions with gears.train.evaluate.Evaluator.full, twice:
`paired`
   (a perturbation's mean = mean of the per-cell predictions, each on a randomly paired control
   cell: GEARS's protocol, each tool with its own pairing) and `all` (predicted change + mean of
   all control cells); the four baselines are scored on the same perturbations.

Compatibility shims cell-gears 0.1.2 needs with current pandas/scipy (nothing else is patched):
- `GEARS.__init__` indexes `adata.X` with a boolean pandas Series, which scipy's CSR rejects: X is
  dense for that call only and restored afterwards.
- Its `train()` ends with a test analysis we do not use (we score with our code): the test loader
  is held back during `train()` and used afterwards for the predictions.
Its custom GO graph is built by its own code (`make_GO`, a process pool) inside its timed run.

Timing per tool and seed, measured inside each worker: end_to_end_s (process start to predictions
written, data processing included), train_s, epoch_s = train_s / epochs (cell-gears's epoch
includes its per-epoch evaluation of the whole training and validation sets, ours a per-
perturbation validation), train_cells_per_s = training cells x epochs / train_s, peak_rss_mb
(the kernel's VmHWM of the worker).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from provenance import provenance  # noqa: E402

SHARED_DATA = Path(os.environ.get("GEARS_SHARED_DATA", ROOT.parent / "shared" / "data"))
CELL_GEARS = "cell-gears==0.1.2"
METRICS = ("mse", "mse_de", "pearson_delta", "pearson_delta_de")
TOOLS = ("ours", "cell_gears")
TIMING = ("end_to_end_s", "train_s", "epoch_s", "train_cells_per_s", "peak_rss_mb")
# name -> (genes, total cells): 60 singles + 40 doubles, 1,000 control cells, the rest split
# evenly over the 100 perturbations (the default screen's design at other sizes).
SYNTHETIC = {
    "synthetic_500x2k": (500, 2_000),
    "synthetic_1000x6k": (1_000, 6_000),
    "synthetic_2000x20k": (2_000, 20_000),
}
NORMAN = "norman_subset"
DATASETS = (*SYNTHETIC, NORMAN)
# The fixed budget of the default run: 20 epochs (GEARS's recipe) where that is affordable, and
# about the same number of optimizer steps (~1,000 at batch 32) on the larger screens, where 20
# epochs of cell-gears take hours per seed on one CPU core. Both tools always get the same.
DEFAULT_EPOCHS = "20,synthetic_1000x6k=7,synthetic_2000x20k=2"


def epochs_for(spec: str, name: str) -> int:
    """Epochs of dataset `name` under an --epochs spec ("20" or "20,NAME=2,...")."""
    default, own = None, {}
    for part in str(spec).split(","):
        key, eq, value = part.strip().rpartition("=")
        try:
            n = int(value)
        except ValueError:
            raise SystemExit(f"--epochs: {part!r} is not N or NAME=N") from None
        if n < 1:
            raise SystemExit(f"--epochs: {part!r} must be >= 1")
        if eq:
            if key not in DATASETS:
                raise SystemExit(f"--epochs: unknown dataset {key!r}; choose from {DATASETS}")
            own[key] = n
        else:
            default = n
    if name in own:
        return own[name]
    if default is None:
        raise SystemExit(f"--epochs {spec!r} gives no epochs for {name!r}")
    return default


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--datasets", default=",".join(DATASETS), help="comma-separated subset")
    p.add_argument("--seeds", default="1,2,3", help="split seeds, e.g. 1,2,3")
    p.add_argument(
        "--epochs",
        default=DEFAULT_EPOCHS,
        help="epochs for both tools: N for every dataset, or N,NAME=M,... to give some datasets "
        f"their own (default {DEFAULT_EPOCHS}: ~1,000 optimizer steps per run at every size)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads in each worker")
    p.add_argument("--work", default="/tmp/gears_vs_cell_gears", help="inputs and worker files")
    p.add_argument("--venv", default="/tmp/gears_cell_gears_venv", help="cell-gears venv")
    p.add_argument("--out", default="benchmarks/results/vs_cell_gears", help="md/png prefix")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.add_argument(
        "--reuse",
        action="store_true",
        help="reuse worker results already in --work (same dataset, seed and epochs)",
    )
    p.add_argument("--worker", choices=("ours",), help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------- inputs
def synthetic_params(genes: int, cells: int) -> dict:
    n_single, n_double, n_ctrl = 60, 40, 1_000
    return dict(
        n_genes=genes,
        n_single=n_single,
        n_double=n_double,
        cells_per_condition=max(2, (cells - n_ctrl) // (n_single + n_double)),
        n_control_cells=n_ctrl,
    )


def source_pert_data(name: str, work: Path):
    """This project's PertData of a dataset, the source of the shared input files."""
    from gears.data.pertdata import PertData

    if name in SYNTHETIC:
        pd_ = PertData(work / "source", verbose=False)
        return pd_.load("synthetic", synthetic_params=synthetic_params(*SYNTHETIC[name]))
    if name == NORMAN:
        h5ad = SHARED_DATA / "perturbench_devel.h5ad"
        if not h5ad.exists():
            return None
        pd_ = PertData(
            work / "source",
            gene2go=SHARED_DATA / "gene2go_human.tsv.gz",
            gene_aliases=SHARED_DATA / "gene_aliases_human.tsv.gz",
            # GEARS's behaviour for perturbed genes without GO annotation: drop their conditions.
            unmapped_perts="drop",
            verbose=False,
        )
        return pd_.load(data_name=str(h5ad), subset={"dataset": "norman19"})
    raise SystemExit(f"unknown dataset {name!r}; choose from {DATASETS}")


def write_inputs(pert_data, folder: Path) -> dict:
    """screen.h5ad + gene2go.tsv + gene2go_all.pkl, the one input both tools read."""
    import anndata as ad
    import pandas as pd

    from gears.data.conditions import CTRL, condition_genes

    folder.mkdir(parents=True, exist_ok=True)
    src = pert_data.adata
    cond = src.obs["condition"].astype(str).values
    known = {g for g, terms in pert_data.gene2go.items() if terms}
    keep = np.array([c == CTRL or all(g in known for g in condition_genes(c)) for c in cond])
    genes = list(pert_data.gene_names)
    adata = ad.AnnData(
        X=src.X[keep],
        obs=pd.DataFrame(
            {"condition": cond[keep], "cell_type": "cell"}, index=src.obs_names[keep].astype(str)
        ),
        var=pd.DataFrame({"gene_name": genes}, index=genes),
    )
    adata.write_h5ad(folder / "screen.h5ad")
    gene2go = {g: sorted(t) for g, t in pert_data.gene2go.items() if t}
    (folder / "gene2go.tsv").write_text(
        "".join(f"{g}\t{','.join(t)}\n" for g, t in sorted(gene2go.items()))
    )
    with open(folder / "gene2go_all.pkl", "wb") as f:
        pickle.dump({g: set(t) for g, t in gene2go.items()}, f)
    dropped = sorted(set(cond[~keep]))
    return {"cells": int(keep.sum()), "genes": len(genes), "dropped_conditions": dropped}


def load_shared(folder: Path, seed: int, data_dir: Path):
    """Our PertData on the shared input with the `simulation` split of `seed`."""
    from gears.data.pertdata import PertData

    pd_ = PertData(data_dir, gene2go=folder / "gene2go.tsv", verbose=False)
    pd_.load(data_name=str(folder / "screen.h5ad"))
    pd_.prepare_split("simulation", seed=seed)
    return pd_


def split_dict(pert_data) -> dict[str, list[str]]:
    return {k: list(pert_data.set2conditions.get(k, [])) for k in ("train", "val", "test")}


def write_split(pert_data, path: Path) -> Path:
    """Our split as cell-gears's custom split file (a pickled {set: [conditions]} dict)."""
    with open(path, "wb") as f:
        pickle.dump(split_dict(pert_data), f)
    return path


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# ---------------------------------------------------------------------------------- workers
def ours_worker(folder: Path, seed: int, epochs: int, threads: int) -> None:
    """Train our GEARS with GEARS's recipe; write test changes and paired-control means."""
    t0 = time.perf_counter()
    import torch

    from gears.compat.api import GEARS
    from gears.config import load_config
    from gears.train.engine import seed_everything
    from gears.train.evaluate import Evaluator, predict_deltas

    torch.set_num_threads(threads)
    cfg = load_config(
        ROOT / "configs" / "gears_paper.yaml",
        [f"train.epochs={epochs}", "train.batch_size=32", "model.hidden_size=64"],
        base=ROOT / "configs" / "default.yaml",
    )
    pd_ = load_shared(folder, seed, folder / f"ours_seed{seed}")
    with open(folder / f"split_seed{seed}.pkl", "rb") as f:
        if pickle.load(f) != split_dict(pd_):
            raise SystemExit("our split differs from the split file given to cell-gears")
    torch.set_num_threads(threads)  # the DE step (scanpy -> numba) may have reset them
    model = GEARS(pd_, device="cpu", seed=seed)
    seed_everything(seed)
    model.model_initialize(hidden_size=cfg.model.hidden_size)
    t_train = time.perf_counter()
    history = model.train(train_cfg=cfg.train, progress=False, control_mean="paired")
    train_s = time.perf_counter() - t_train
    ev = Evaluator(pd_, net=model.model, control_mean="paired")
    view = ev.set_view("test")
    delta, _ = predict_deltas(model.model, pd_.cond_pert_index[view["cond_ids"]])
    np.savez(
        folder / f"ours_seed{seed}.npz",
        conditions=np.array(view["conditions"]),
        delta=delta,
        pair_mean=view["pair_mean"],
    )
    n_train = len(pd_.example_set("train").rows)
    timing = {
        "end_to_end_s": time.perf_counter() - t0,
        "train_s": train_s,
        "epoch_s": train_s / epochs,
        "train_cells_per_s": n_train * epochs / train_s,
        "peak_rss_mb": peak_rss_mb(),
        "epochs": epochs,
        "best_epoch": model.trainer.best_epoch + 1,
        "train_loss": history.train_loss,
    }
    (folder / f"ours_seed{seed}.json").write_text(json.dumps(timing))


CELL_GEARS_WORKER = textwrap.dedent(
    """
    import json, os, pickle, random, time
    t0 = time.perf_counter()
    import numpy as np, anndata, torch
    torch.set_num_threads({threads})
    random.seed({seed}); np.random.seed({seed}); torch.manual_seed({seed})
    from gears import GEARS, PertData  # cell-gears: python -P from a neutral directory
    folder, seed, epochs = {folder!r}, {seed}, {epochs}
    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    adata = anndata.read_h5ad(os.path.join(folder, "screen.h5ad"))
    pd_ = PertData(os.getcwd(), default_pert_graph=False)  # gene2go_all.pkl is here: no download
    pd_.new_data_process("screen", adata)
    split_path = os.path.join(folder, f"split_seed{{seed}}.pkl")
    pd_.prepare_split(split="custom", split_dict_path=split_path)
    pd_.get_dataloader(32, 128)
    # Shim: GEARS() indexes X with a boolean Series, which CSR rejects in current scipy.
    X = pd_.adata.X
    pd_.adata.X = X.toarray() if hasattr(X, "toarray") else X
    model = GEARS(pd_, device="cpu")
    pd_.adata.X = X
    model.model_initialize(hidden_size=64)
    torch.set_num_threads({threads})  # its DE step (scanpy -> numba) may have reset them
    test_loader = pd_.dataloader.pop("test_loader")  # shim: skip its own test analysis
    n_train = len(pd_.dataloader["train_loader"].dataset)
    t_train = time.perf_counter()
    model.train(epochs=epochs, lr=1e-3, weight_decay=5e-4)
    train_s = time.perf_counter() - t_train
    net = model.best_model.eval()
    sums, xsums, counts = {{}}, {{}}, {{}}
    with torch.no_grad():
        for batch in test_loader:
            pred = net(batch)
            x = batch.x.reshape(pred.shape[0], -1)
            for i, p in enumerate(batch.pert):
                sums[p] = sums.get(p, 0) + pred[i].double().numpy()
                xsums[p] = xsums.get(p, 0) + x[i].double().numpy()
                counts[p] = counts.get(p, 0) + 1
    conds = sorted(sums)
    np.savez(os.path.join(folder, f"cell_gears_seed{{seed}}.npz"), conditions=np.array(conds),
             mean=np.stack([sums[c] / counts[c] for c in conds]),
             pair_mean=np.stack([xsums[c] / counts[c] for c in conds]))
    json.dump({{"end_to_end_s": time.perf_counter() - t0, "train_s": train_s,
               "epoch_s": train_s / epochs, "train_cells_per_s": n_train * epochs / train_s,
               "peak_rss_mb": rss(), "epochs": epochs}},
              open(os.path.join(folder, f"cell_gears_seed{{seed}}.json"), "w"))
    """
)


def ensure_venv(venv: Path) -> Path:
    """A virtual environment with cell-gears 0.1.2 (and dcor) that sees this environment's
    packages (torch, PyG, scanpy) through a .pth file; created once, reused afterwards."""
    python = venv / "bin" / "python"
    probe = [str(python), "-P", "-c", "import importlib.metadata as m; m.version('cell-gears')"]
    if python.exists() and subprocess.run(probe, capture_output=True, cwd="/").returncode == 0:
        return python
    import site

    print(f"creating {venv} with {CELL_GEARS} (once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # The venv's own site-packages comes first (cell-gears's `gears`), ours after it.
    out = subprocess.run(
        [str(python), "-c", "import site; print(site.getsitepackages()[0])"],
        capture_output=True,
        text=True,
        check=True,
    )
    Path(out.stdout.strip(), "_project_env.pth").write_text(
        "\n".join(p for p in site.getsitepackages() if "gears_cell_gears" not in p) + "\n"
    )
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", CELL_GEARS, "dcor"], check=True
    )
    return python


def run_tool(tool: str, folder: Path, seed: int, epochs: int, args, cg_python: Path | None) -> dict:
    done = folder / f"{tool}_seed{seed}.json"
    if args.reuse and done.exists() and (folder / f"{tool}_seed{seed}.npz").exists():
        timing = json.loads(done.read_text())
        if timing.get("epochs") == epochs:
            print(f"  {tool:10s} seed {seed}: reused {done}", flush=True)
            return timing
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS=str(args.threads), NUMBA_NUM_THREADS=str(args.threads))
    env.setdefault("WANDB_MODE", "disabled")
    if tool == "ours":
        # As train_single.py runs: idle OpenMP threads sleep (cell-gears runs as it ships).
        if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "ours"]
        cmd += ["--dir", str(folder), "--seed", str(seed), "--epochs", str(epochs)]
        cmd += ["--threads", str(args.threads)]
        cwd = ROOT
    else:
        cwd = folder / f"cell_gears_seed{seed}"
        (cwd / "data").mkdir(parents=True, exist_ok=True)  # its make_GO writes ./data/go_*.csv
        (cwd / "gene2go_all.pkl").write_bytes((folder / "gene2go_all.pkl").read_bytes())
        script = CELL_GEARS_WORKER.format(
            folder=str(folder), seed=seed, epochs=epochs, threads=args.threads
        )
        cmd = [str(cg_python), "-P", "-c", script]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{tool} seed {seed} failed:\n{out.stderr[-3000:]}")
    timing = json.loads((folder / f"{tool}_seed{seed}.json").read_text())
    print(f"  {tool:10s} seed {seed}: {time.perf_counter() - t0:6.1f}s wall", flush=True)
    return timing


# ---------------------------------------------------------------------------------- scoring
def aligned(conditions: list[str], names, rows: np.ndarray) -> np.ndarray:
    """rows[i] belongs to names[i]; -> [len(conditions), G] in `conditions` order, NaN if absent."""
    index = {str(n): i for i, n in enumerate(names)}
    out = np.full((len(conditions), rows.shape[1]), np.nan)
    for i, c in enumerate(conditions):
        if c in index:
            out[i] = rows[index[c]]
    return out


def score_seed(pert_data, folder: Path, seed: int) -> dict:
    """{tool: {metric: value, metric_all: value}, "baselines": {name: {metric: value}}}."""
    from gears.eval.baselines import baseline_predictions
    from gears.train.evaluate import Evaluator

    ev = Evaluator(pert_data)
    view = ev.set_view("test")
    conds = view["conditions"]
    ctrl = np.asarray(pert_data.ctrl_mean, np.float64)[None, :]
    ours = np.load(folder / f"ours_seed{seed}.npz")
    cg = np.load(folder / f"cell_gears_seed{seed}.npz")
    delta = aligned(conds, ours["conditions"], ours["delta"])
    cg_mean = aligned(conds, cg["conditions"], cg["mean"])
    cg_delta = cg_mean - aligned(conds, cg["conditions"], cg["pair_mean"])
    preds = {
        "ours": (delta + aligned(conds, ours["conditions"], ours["pair_mean"]), delta + ctrl),
        "cell_gears": (cg_mean, cg_delta + ctrl),
    }
    out = {}
    for tool, (paired, exact) in preds.items():
        row = ev.full("test", pred_mean=paired)["summary"]["overall"]
        row_all = ev.full("test", pred_mean=exact)["summary"]["overall"]
        out[tool] = {m: row[m] for m in METRICS} | {f"{m}_all": row_all[m] for m in METRICS}
        out[tool]["n_conditions"] = row["n_conditions"]
    train_conds = [c for c in pert_data.set2conditions["train"] if c != "ctrl"]
    train_means = dict(zip(train_conds, pert_data.condition_means(train_conds)))
    out["baselines"] = {}
    for name, bpred in baseline_predictions(
        train_means, pert_data.ctrl_mean, conds, list(pert_data.gene_names)
    ).items():
        row = ev.full("test", pred_mean=bpred)["summary"]["overall"]
        out["baselines"][name] = {m: row[m] for m in METRICS}
    return out


# ---------------------------------------------------------------------------------- reports
def _ms(values) -> str:
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=float)
    if not len(v):
        return "-"
    return f"{v.mean():.3f} ± {v.std(ddof=1):.3f}" if len(v) > 1 else f"{v.mean():.3f}"


def markdown(results: dict, args) -> str:
    lines = [
        "# Our GEARS vs cell-gears 0.1.2",
        "",
        f"Commit `{results['settings']['commit']}`, `{results['settings']['command']}`, "
        f"{results['settings']['date']}, {results['settings']['machine']}.",
        "",
        f"Seeds {args.seeds}, epochs `{args.epochs}` (both tools), {args.threads} torch "
        "thread(s) per worker; mean ± sd over seeds. Metrics: our metric code on both tools' "
        "mean test predictions; `paired` = GEARS's protocol (each tool's own random control "
        "pairing), `all` = predicted change + mean of all control cells.",
    ]
    for name, d in results["datasets"].items():
        info = d.get("input", {})
        lines += [
            "",
            f"## {name} ({info.get('genes')} genes x {info.get('cells')} cells, "
            f"{d.get('epochs')} epochs)",
            "",
            "| metric | ours paired | cell-gears paired | ours all | cell-gears all | "
            "no_change | train_mean | additive | linear |",
            "| --- " * 9 + "|",
        ]
        for m in METRICS:
            cells = [
                _ms(d["ours"][m]),
                _ms(d["cell_gears"][m]),
                _ms(d["ours"][f"{m}_all"]),
                _ms(d["cell_gears"][f"{m}_all"]),
            ]
            cells += [_ms(d["baselines"].get(b, {}).get(m, [])) for b in BASELINE_ORDER]
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines += ["", "| timing | ours | cell-gears | ours better by |", "| --- " * 4 + "|"]
        for t in TIMING:
            o, c = d["timing"]["ours"][t], d["timing"]["cell_gears"][t]
            # times and memory: theirs / ours; cells/s (higher is better): ours / theirs
            num, den = (o, c) if t == "train_cells_per_s" else (c, o)
            ratio = np.mean(num) / np.mean(den) if np.mean(den) else float("nan")
            lines.append(f"| {t} | {_ms(o)} | {_ms(c)} | {ratio:.2f} |")
    return "\n".join(lines) + "\n"


BASELINE_ORDER = ("no_change", "train_mean", "additive", "linear")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["datasets"])
    fig, axes = plt.subplots(1, len(METRICS) + 2, figsize=(4 * (len(METRICS) + 2), 3.6))
    colors = {"ours": "tab:blue", "cell_gears": "tab:orange"}
    for ax, m in zip(axes, METRICS):
        for j, name in enumerate(names):
            d = results["datasets"][name]
            for k, tool in enumerate(TOOLS):
                v = np.asarray(d[tool][m], dtype=float)
                x = j + (k - 0.5) * 0.3
                ax.bar(x, np.nanmean(v), width=0.28, color=colors[tool], alpha=0.6,
                       label=tool if j == 0 else None)  # fmt: skip
                ax.scatter(np.full(len(v), x), v, color="k", s=8, zorder=3)
            for b, style in zip(BASELINE_ORDER, ("-", "--", ":", "-.")):
                v = d["baselines"].get(b, {}).get(m)
                if v:
                    ax.hlines(np.nanmean(np.asarray(v, float)), j - 0.45, j + 0.45, colors="gray",
                              linestyles=style, label=b if j == 0 else None)  # fmt: skip
        ax.set_title(f"test {m} (paired)")
        ax.set_xticks(range(len(names)), names, rotation=20, fontsize=7)
    axes[0].legend(fontsize=6)
    for ax, t, label in zip(axes[-2:], ("end_to_end_s", "peak_rss_mb"), ("seconds", "MB")):
        for k, tool in enumerate(TOOLS):
            v = [np.mean(results["datasets"][n]["timing"][tool][t]) for n in names]
            ax.bar(np.arange(len(names)) + (k - 0.5) * 0.3, v, width=0.28, color=colors[tool],
                   label=tool)  # fmt: skip
        ax.set_title(f"{t} per dataset")
        ax.set_ylabel(label)
        ax.set_xticks(range(len(names)), names, rotation=20, fontsize=7)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------- main
def main(args) -> dict:
    if args.worker == "ours":
        ours_worker(Path(args.dir), args.seed, int(args.epochs), args.threads)
        return {}
    from gears.cli.seeds import parse_seeds

    seeds = parse_seeds(args.seeds)
    names = [n.strip() for n in args.datasets.split(",") if n.strip()]
    unknown = [n for n in names if n not in DATASETS]
    if unknown:
        raise SystemExit(f"unknown dataset(s) {unknown}; choose from {', '.join(DATASETS)}")
    epochs = {n: epochs_for(args.epochs, n) for n in names}  # bad --epochs fails before any run
    cg_python = ensure_venv(Path(args.venv))
    work = Path(args.work)
    results = {"datasets": {}}
    t_start = time.perf_counter()
    for name in names:
        source = source_pert_data(name, work / name)
        if source is None:
            print(f"{name}: skipped ({SHARED_DATA} is absent)", flush=True)
            continue
        folder = work / name
        info = write_inputs(source, folder)
        print(f"{name}: {info['genes']} genes x {info['cells']} cells", flush=True)
        d = {
            "input": info,
            "epochs": epochs[name],
            "ours": {},
            "cell_gears": {},
            "baselines": {},
            "timing": {t: {} for t in TOOLS},
            "best_epoch": {"ours": []},
        }
        for i, seed in enumerate(seeds):
            pert_data = load_shared(folder, seed, folder / f"score_seed{seed}")
            write_split(pert_data, folder / f"split_seed{seed}.pkl")
            for tool in TOOLS if i % 2 == 0 else TOOLS[::-1]:  # alternate who runs first
                timing = run_tool(tool, folder, seed, epochs[name], args, cg_python)
                for t in TIMING:
                    d["timing"][tool].setdefault(t, []).append(timing[t])
                if tool == "ours":
                    d["best_epoch"]["ours"].append(timing["best_epoch"])
            scored = score_seed(pert_data, folder, seed)
            for tool in TOOLS:
                for m, v in scored[tool].items():
                    d[tool].setdefault(m, []).append(v)
            for b, row in scored["baselines"].items():
                for m, v in row.items():
                    d["baselines"].setdefault(b, {}).setdefault(m, []).append(v)
        results["datasets"][name] = d
    results["settings"] = {
        **provenance(),
        "seeds": seeds,
        "epochs": args.epochs,
        "threads": args.threads,
        "total_s": time.perf_counter() - t_start,
        "load_average": os.getloadavg(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = markdown(results, args)
    out.with_suffix(".md").write_text(text)
    if results["datasets"]:
        plot(results, out.with_suffix(".png"))
    if args.json:
        Path(args.json).write_text(json.dumps(_json_safe(results), indent=1))
    print(text, flush=True)
    return results


def _json_safe(obj):
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, (np.floating, float)):
        return None if not np.isfinite(obj) else float(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


if __name__ == "__main__":
    from gears.cli.exiting import run_and_exit  # exits once done, whatever threads are left

    run_and_exit(lambda: main(parse_args()))
