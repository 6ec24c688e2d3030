"""predict.py at Virtual Cell Challenge size: peak memory and time of writing predicted cells.

    python benchmarks/bench_predict.py                      # 60,000 cells x 18,080 genes
    python benchmarks/bench_predict.py --genes 2000 --cells 6000 --json bench_predict.json

It trains a model for one epoch on a synthetic screen with --genes genes (the weights do not
matter here, the sizes do), writes a VCC-style counts file that asks for --cells predicted cells
over the model's perturbations plus 1,000 control cells, and runs `predict.py --counts` in a
fresh process, recording its wall time and peak resident memory (the kernel's ru_maxrss) beside
the output's dense float32 size and its size on disk.
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


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--genes", type=int, default=18_080)
    p.add_argument("--cells", type=int, default=60_000, help="predicted (perturbed) cells")
    p.add_argument("--work", default="/tmp/gears_bench_predict")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    work = Path(args.work)
    run_dir = work / f"run_{args.genes}"
    synthetic = f"{{n_genes: {args.genes}, cells_per_condition: 4, n_control_cells: 1000}}"
    if not (run_dir / "model" / "model.pt").exists():
        train = [
            sys.executable,
            "train_single.py",
            f"data.synthetic={synthetic}",
            f"data.data_dir={work / 'data'}",
            f"out_dir={run_dir}",
            "train.epochs=1",
            "wandb.mode=disabled",
        ]
        subprocess.run(train, cwd=ROOT, check=True)
    meta = json.loads((run_dir / "model" / "config.json").read_text())
    singles = list(meta["pert_names"])[:100]
    share, extra = divmod(args.cells, len(singles))
    per = [share + (i < extra) for i in range(len(singles))]
    counts = work / "counts.csv"
    info = json.loads((run_dir / "model" / "prediction.json").read_text())
    frame = pd.DataFrame({"target_gene": singles, "n_cells": per, "median_umi_per_cell": 1000.0})
    frame.loc[len(frame)] = [info["control_label"], 1000, 1000.0]
    frame.to_csv(counts, index=False)
    out = work / "pred.h5ad"
    cmd = [sys.executable, "predict.py", "--model", str(run_dir / "model")]
    wall, peak_mb = run_measured([*cmd, "--counts", str(counts), "--out", str(out)])
    n_cells = args.cells + 1000
    result = {
        **provenance(),
        "genes": args.genes,
        "cells": n_cells,
        "perturbations": len(singles),
        "dense_float32_gb": round(4 * n_cells * args.genes / 1e9, 2),
        "file_gb": round(out.stat().st_size / 1e9, 2),
        "predict_wall_s": round(wall, 1),
        "predict_peak_rss_gb": round(peak_mb / 1024, 2),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
