"""cell-eval2's vcc2026 scores of GEARS and the baselines, per context, on the offline 2026
example and on mcfaline23's three glioma lines: the figures docs/predictions.md quotes.

    python benchmarks/vcc2026_scores.py --json benchmarks/results/vcc2026_scores.json

Runs, under --work (a step whose output is already there is not run again):
  - synthetic_2026: examples/synthetic_vcc.py --layout 2026 (raw counts, two contexts),
    configs/vcc2026.yaml with eval.cell_eval2=true (input_type counts), then predict.py
    --output counts on the validation perturbations and `cell-eval2 run --preset vcc2026` on
    each context's file (raw values only: the official CLI has no rescaling without a bundle);
  - mcfaline23: configs/perturbench_mcfaline23.yaml one model per line (data.context_key
    cell_type, its per-line command) with eval.cell_eval2=true (log-normalised data:
    input_type lognorm, not the challenge's counts score).
Each context's test split is scored as in every run (gears/eval/vcc2026.py): each member raw and
rescaled, 0 = cell-eval2's mean-response baseline, 1 = its replicate anchor on the same cells.
Needs requirements-eval.txt (cell-eval2, pdex) and its `cell-eval2` command on PATH.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from provenance import provenance  # noqa: E402

PY = sys.executable


def step(cmd: list[str], done: Path, log: Path) -> str:
    """Run cmd from the repository root unless `done` exists -> the command as text."""
    text = shlex.join(["python" if c == PY else c for c in cmd])
    if not done.exists():
        with log.open("a") as out:
            print(f"$ {text}", flush=True)
            subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, check=True)
    return text


def scores_of(run_dir: Path) -> dict:
    """A run with contexts -> per context: its test split's vcc2026 scores; their mean."""
    summary = json.loads((run_dir / "metrics.json").read_text())
    contexts = {}
    for name, entry in summary["contexts"].items():
        ce = entry["cell_eval2"]
        contexts[name] = {
            "input_type": ce["input_type"],
            "n_test_perturbations": ce["n_perturbations"],
            "baseline": ce["baseline"],
            "replicate": ce["replicate"],
            "unscored": sorted(ce["unscored"]),
            "predictors": {
                p: {k: got[k] for k in ("score", "scaled", "raw")}
                for p, got in ce["predictors"].items()
            },
        }
    mean = {p: got["score"] for p, got in summary["mean_over_contexts"]["cell_eval2"].items()}
    return {"contexts": contexts, "mean_score_over_contexts": mean}


def cli_means(folder: Path) -> dict:
    """`cell-eval2 run`'s agg_results.csv -> each member's mean over perturbations (raw)."""
    agg = pd.read_csv(folder / "agg_results.csv").set_index("statistic")
    return {k: (None if pd.isna(v) else float(v)) for k, v in agg.loc["mean"].items()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="/tmp/gears_vcc2026_scores")
    p.add_argument("--epochs", type=int, default=5, help="training epochs of the example")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    log = work / "log.txt"
    t0 = time.perf_counter()
    common = ["wandb.mode=disabled"]

    data = work / "data" / "vcc2026_synthetic"
    run = work / "runs" / "vcc2026_synthetic"
    commands = [
        step(
            [PY, "examples/synthetic_vcc.py", str(data), "--layout", "2026"],
            data / "gene2go.tsv",
            log,
        ),
        step(
            [
                PY,
                "train_single.py",
                "--config",
                "configs/vcc2026.yaml",
                f"data.dataset={data}/adata_Training.h5ad",
                f"data.gene2go={data}/gene2go.tsv",
                "data.gene_aliases=null",
                f"data.data_dir={work / 'data'}",
                f"train.epochs={args.epochs}",
                f"out_dir={run}",
                "eval.cell_eval2=true",
                *common,
            ],
            run / "metrics.json",
            log,
        ),
        step(
            [
                PY,
                "predict.py",
                "--model",
                str(run),
                "--counts",
                f"{data}/pert_counts_Validation.csv",
                "--output",
                "counts",
                "--out",
                f"{run}/pred.h5ad",
            ],
            run / "pred_lineA.h5ad",
            log,
        ),
    ]
    contexts = json.loads((run / "contexts.json").read_text())["contexts"]
    validation = {}
    for context in contexts:
        folder = run / f"cell_eval2_{context}"
        commands.append(
            step(
                [
                    "cell-eval2",
                    "run",
                    "-ap",
                    f"{run}/pred_{context}.h5ad",
                    "-ar",
                    f"{data}/adata_Validation_{context}.h5ad",
                    "--preset",
                    "vcc2026",
                    "--set",
                    "device=cpu",
                    "--set",
                    "de.backend=pdex",
                    "-o",
                    str(folder),
                ],
                folder / "agg_results.csv",
                log,
            )
        )
        validation[context] = cli_means(folder)
    example = {"commands": commands, **scores_of(run), "validation_cli_raw_means": validation}

    mcf = work / "mcf"
    mcf_command = step(
        [
            PY,
            "train_single.py",
            "--config",
            "configs/perturbench_mcfaline23.yaml",
            "data.context_key=cell_type",
            "split.type=simulation_single",
            "split.train_gene_set_size=0.6",
            "train.epochs=20",
            "eval.cell_eval2=true",
            f"out_dir={mcf}",
            f"data.data_dir={work / 'mcfdata'}",
            *common,
        ],
        mcf / "metrics.json",
        log,
    )
    result = {
        **provenance(argv),
        "seconds": round(time.perf_counter() - t0, 1),
        "scale": "each member (u - b) / (r - b) with its clamps; score = mean of the scaled "
        "members cell-eval2 could form; 0 = mean-response baseline b, 1 = replicate r",
        "synthetic_2026": example,
        "mcfaline23_lognorm": {"commands": [mcf_command], **scores_of(mcf)},
    }
    for name in ("synthetic_2026", "mcfaline23_lognorm"):
        print(f"\n{name}: vcc2026 score per context (0 = mean-response baseline, 1 = replicate)")
        table = {
            c: {p: v["score"] for p, v in e["predictors"].items()}
            for c, e in result[name]["contexts"].items()
        }
        frame = pd.DataFrame(table)
        frame["mean"] = pd.Series(result[name]["mean_score_over_contexts"])
        print(frame.round(4).to_string())
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from gears.cli.exiting import run_and_exit  # exits once done, whatever threads are left

    run_and_exit(main)
