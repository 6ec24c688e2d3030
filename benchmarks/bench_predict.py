"""predict.py at Virtual Cell Challenge size: peak memory and time of writing predicted cells,
log-normalised (the 2025 layout) and as integer counts (2026), side by side.

    python benchmarks/bench_predict.py                      # 60,000 cells x 18,080 genes
    python benchmarks/bench_predict.py --genes 2000 --cells 6000 --json bench_predict.json

It trains a model for one epoch on a synthetic raw-count screen in the 2026 layout with --genes
genes (one context; the weights do not matter here, the sizes do), writes a counts file that
asks for --cells predicted cells over 100 of the model's perturbations (median_umi_per_cell
--median-umi) plus 1,000 control cells, and runs `predict.py --counts` twice in fresh
processes, `--output lognorm` and `--output counts` (sampler rounding), recording each one's
wall time and peak resident memory (the kernel's ru_maxrss) beside the output's dense float32
size and its size on disk.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from provenance import provenance  # noqa: E402


def run_measured(cmd: list[str]) -> tuple[float, float]:
    """Run cmd in a fresh process -> (wall seconds, its peak resident memory in MB)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed")
    return wall, usage.ru_maxrss / 1024  # Linux reports kB


def write_screen(work: Path, genes: int) -> tuple[Path, Path]:
    """A 2026-layout raw-count screen of `genes` genes and its GO file -> their paths."""
    from gears.data.synthetic import make_vcc2026_layout, write_gene2go_tsv

    work.mkdir(parents=True, exist_ok=True)
    adata, gene2go = make_vcc2026_layout(
        n_genes=genes,
        n_perturbations=100,
        cells_per_perturbation=4,
        n_control_cells=1000,
        contexts=("lineA",),
        counts_per_gene=1.1,  # the challenge's depth: ~20,000 UMI over ~18,000 genes
    )
    h5ad = work / f"screen_{genes}.h5ad"
    adata.write_h5ad(h5ad)
    return h5ad, write_gene2go_tsv(gene2go, work / f"gene2go_{genes}.tsv")


def train(work: Path, genes: int) -> Path:
    """A one-epoch model on a 2026-layout raw-count screen of `genes` genes -> its run dir.
    The screen is made in a process of its own, as the training is: a child's peak RSS
    (ru_maxrss) starts at its parent's memory high-water mark (Linux carries it across fork and
    exec), so a bench process that had built the screen itself (~12 GB at 18,080 genes) gave
    every predict.py it measured that peak."""
    run_dir = work / f"run_{genes}"
    if (run_dir / "model" / "model.pt").exists():
        return run_dir
    script = [sys.executable, __file__, "--genes", str(genes), "--work", str(work)]
    subprocess.run([*script, "--write-screen"], cwd=ROOT, check=True)
    h5ad, go = work / f"screen_{genes}.h5ad", work / f"gene2go_{genes}.tsv"
    cmd = [
        sys.executable,
        "train_single.py",
        f"data.dataset={h5ad}",
        f"data.gene2go={go}",
        "data.normalize=log1p",
        f"data.data_dir={work / 'data'}",
        f"out_dir={run_dir}",
        "split.type=no_test",
        "train.epochs=1",
        "train.plot_conditions=0",
        "wandb.mode=disabled",
    ]
    subprocess.run(cmd, cwd=ROOT, check=True)
    return run_dir


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--genes", type=int, default=18_080)
    p.add_argument("--cells", type=int, default=60_000, help="predicted (perturbed) cells")
    p.add_argument("--median-umi", type=float, default=20_000.0)
    p.add_argument("--work", default="/tmp/gears_bench_predict")
    p.add_argument("--json", default=None)
    p.add_argument("--write-screen", action="store_true", help="write the screen, then exit")
    args = p.parse_args(argv)
    work = Path(args.work)
    if args.write_screen:
        write_screen(work, args.genes)
        return {}
    run_dir = train(work, args.genes)
    meta = json.loads((run_dir / "model" / "config.json").read_text())
    info = json.loads((run_dir / "model" / "prediction.json").read_text())
    singles = [g for g in meta["pert_names"] if g in info["condition_spelling"].values()][:100]
    share, extra = divmod(args.cells, len(singles))
    per = [share + (i < extra) for i in range(len(singles))]
    counts = work / "counts.csv"
    frame = pd.DataFrame(
        {"target": singles, "n_cells": per, "median_umi_per_cell": args.median_umi}
    )
    frame.loc[len(frame)] = [info["control_label"], 1000, args.median_umi]
    frame.to_csv(counts, index=False)
    n_cells = args.cells + 1000
    result = {
        **provenance(),
        "genes": args.genes,
        "cells": n_cells,
        "perturbations": len(singles),
        "dense_float32_gb": round(4 * n_cells * args.genes / 1e9, 2),
    }
    for output in ("lognorm", "counts"):
        out = work / f"pred_{output}.h5ad"
        cmd = [sys.executable, "predict.py", "--model", str(run_dir / "model")]
        cmd += ["--counts", str(counts), "--output", output, "--out", str(out)]
        wall, peak_mb = run_measured(cmd)
        result[output] = {
            "file_gb": round(out.stat().st_size / 1e9, 2),
            "predict_wall_s": round(wall, 1),
            "predict_peak_rss_gb": round(peak_mb / 1024, 2),
        }
        out.unlink()
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    from gears.cli.exiting import run_and_exit  # exits once done, whatever threads are left

    run_and_exit(main)
