"""One model across contexts against one model per context, scored per context.

    python examples/compare_contexts.py --seeds 1,2,3 --out runs/compare_contexts

On mcfaline23's three glioma lines (configs/perturbench_mcfaline23.yaml, ../shared/data), for
each split seed it trains
  - context_gears: examples/context_gears.py, one model on all three lines with a context
    embedding (data.context_key=cell_type);
  - gears_pooled: GEARS on all three lines, blind to the line (each cell still paired with a
    control cell of its own line; data.context_models=joint);
  - gears_per_line: GEARS on one line's cells (data.subset.cell_type=...), three models;
then scores every model on each line's own data (its cells, control mean and DE genes: the
config with data.subset.cell_type=<line>) on the same test perturbations, and prints the mean
and standard deviation over seeds per line. Figures go to <out>/scores.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gears.cli.job import DEFAULT_CONFIG, load_pert_data, run  # noqa: E402
from gears.compat.api import GEARS  # noqa: E402
from gears.config import load_config  # noqa: E402
from gears.train.distributed import DistEnv  # noqa: E402

CONFIG = ROOT / "configs" / "perturbench_mcfaline23.yaml"
FORK = f"{ROOT / 'examples' / 'context_gears.py'}:ContextGEARS"
LINES = ("A172", "T98G", "U87MG")
METRICS = ("mse_de", "pearson_delta", "pearson_delta_de")
MODELS = ("context_gears", "gears_pooled", "gears_per_line")


def config(seed: int, out: Path, *overrides: str):
    shared = ROOT.parent / "shared" / "data"
    fixed = [
        f"split.seed={seed}",
        f"out_dir={out}",
        f"data.dataset={shared / 'perturbench_devel.h5ad'}",
        f"data.gene2go={shared / 'gene2go_human.tsv.gz'}",
        f"data.gene_aliases={shared / 'gene_aliases_human.tsv.gz'}",
        "wandb.mode=disabled",
        "train.threads=1",
    ]
    return load_config(CONFIG, [*fixed, *overrides], base=DEFAULT_CONFIG)


def score_on_line(model_dir: Path, seed: int, line: str, out: Path) -> tuple[dict, list[str]]:
    """A saved model's test metrics on one line's own data -> (overall, test conditions)."""
    cfg = config(seed, out, f"data.subset.cell_type={line}", "data.context_key=cell_type")
    pert_data = load_pert_data(cfg, DistEnv())
    # The fork's run was trained here, from examples/context_gears.py: its code is trusted.
    model = GEARS(pert_data, device="cpu").load_pretrained(model_dir, trust_code=True)
    scored = model.evaluate("test", control_mean=cfg.eval.control_mean)
    return scored["summary"]["overall"], sorted(set(scored["conditions"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--out", default="runs/compare_contexts")
    parser.add_argument("--json", default=None, help="also write the table's figures here")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    scores: dict = {m: {line: [] for line in LINES} for m in MODELS}
    t0 = time.perf_counter()
    for seed in (int(s) for s in args.seeds.split(",")):
        folder = out / f"seed{seed}"
        across = folder / "context_gears"
        run(config(seed, across, f"model.impl={FORK}", "data.context_key=cell_type"), DistEnv())
        across_cfg = config(seed, across, "data.context_key=cell_type")
        split = load_pert_data(across_cfg, DistEnv()).set2conditions["test"]
        trained_on_test = tuple(sorted(c for c in split if c != "ctrl"))
        pooled = folder / "gears_pooled"
        run(
            config(seed, pooled, "data.context_key=cell_type", "data.context_models=joint"),
            DistEnv(),
        )
        for line in LINES:
            alone = folder / f"gears_{line}"
            run(
                config(seed, alone, f"data.subset.cell_type={line}", "data.context_key=null"),
                DistEnv(),
            )
            tested = {trained_on_test}
            for name, model_dir in zip(MODELS, (across, pooled, alone)):
                overall, conditions = score_on_line(model_dir / "model", seed, line, folder)
                scores[name][line].append({"seed": seed, "conditions": conditions, **overall})
                tested.add(tuple(conditions))
            if len(tested) != 1:  # every model held out the perturbations it is scored on
                raise SystemExit(f"seed {seed}, {line}: the test sets differ: {tested}")
    (out / "scores.json").write_text(json.dumps(scores, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(provenance(scores, argv), indent=1) + "\n")
    print(table(scores))
    print(f"\n{time.perf_counter() - t0:.0f} s; figures in {out / 'scores.json'}")
    return 0


def provenance(scores: dict, argv) -> dict:
    """The figures with the commit and command that made them."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    keep = ("seed", "conditions", "n_conditions", "mse", *METRICS)
    keep += ("frac_correct_direction_top20_non_dropout",)
    return {
        "commit": commit or "unknown",
        "command": " ".join(["python examples/compare_contexts.py", *(argv or sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "scores": {
            model: {
                line: [{k: r[k] for k in keep if k in r} for r in runs] for line, runs in by.items()
            }
            for model, by in scores.items()
        },
    }


def table(scores: dict) -> str:
    """Markdown: one row per line and model, mean ± sd over seeds of each metric."""
    lines = [
        "| line | model | " + " | ".join(METRICS) + " |",
        "|---|---|" + "---|" * len(METRICS),
    ]
    for line in LINES:
        for model in MODELS:
            runs = scores[model][line]
            cells = []
            for m in METRICS:
                values = [r[m] for r in runs if r.get(m) is not None]
                sd = statistics.stdev(values) if len(values) > 1 else 0.0
                cells.append(f"{statistics.mean(values):.4f} ± {sd:.4f}" if values else "-")
            lines.append(f"| {line} | {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
