"""Results over several split seeds: `python -m gears.cli.seeds --seeds 1,2,3,4,5 [--config F]
[k=v]`.

Each seed is one whole run (train_single.py's job) with `split.seed` and `seed` (weights, batch
order, control pairing) both set to it, written to <out_dir>/seed_<s>/. The summary gives, per
metric, the mean and sample standard deviation over seeds for GEARS and every baseline, overall
and per test subgroup, plus the fit on the training perturbations and the kept epoch, as
<out_dir>/seeds_summary.json and seeds_summary.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from gears.cli.job import config_from_args, parse_args, run
from gears.errors import GearsInputError
from gears.eval.baselines import BASELINES
from gears.train.distributed import DistEnv, choose_device

SUMMARY_METRICS = ("mse", "mse_de", "pearson_delta", "pearson_delta_de")


def parse_seeds(text: str) -> list[int]:
    """'1,2,3' or '[1, 2, 3]' -> [1, 2, 3]; a clear error otherwise."""
    try:
        seeds = [int(s) for s in text.strip("[] ").split(",") if s.strip()]
    except ValueError:
        raise GearsInputError(
            f"--seeds {text!r}: give integers separated by commas, e.g. 1,2,3"
        ) from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise GearsInputError(f"--seeds {text!r}: give at least one seed, each once")
    return seeds


def _stats(values: list) -> dict:
    finite = [float(v) for v in values if v is not None and np.isfinite(v)]
    return {
        "mean": float(np.mean(finite)) if finite else None,
        "sd": float(np.std(finite, ddof=1)) if len(finite) > 1 else None,
        "n": len(finite),
        "values": [None if v is None else float(v) for v in values],
    }


def summarize_seeds(results: dict[int, dict]) -> dict:
    """Per-seed metrics.json contents -> mean/sd over seeds.

    Returns {"seeds": [...], "best_epoch": [...], "select": [...], "control_mean": [...],
    "test": {group: {model: {metric: stats}}}, "train_fit": {model: {metric: stats}}} where
    group is "overall" or a test subgroup, model is "gears" or a baseline and stats is
    {"mean", "sd", "n", "values"} (values in seed order; a seed where a baseline covers none of
    a group's perturbations gives None).
    """
    seeds = sorted(results)

    def tables(seed: int) -> tuple[dict, dict]:
        r = results[seed]
        test = {"overall": {"gears": r.get("test", {})}}
        for group, row in r.get("subgroups", {}).items():
            test.setdefault(group, {})["gears"] = row
        for name, row in r.get("baselines", {}).items():
            test["overall"][name] = row
            for group, sub in r.get("baseline_subgroups", {}).get(name, {}).items():
                test.setdefault(group, {})[name] = sub
        fit = {"gears": r.get("train_fit", {}), **r.get("train_fit_baselines", {})}
        return test, fit

    per_seed = {s: tables(s) for s in seeds}
    groups = sorted({g for s in seeds for g in per_seed[s][0]}, key=lambda g: (g != "overall", g))
    summary = {
        "seeds": seeds,
        "best_epoch": [results[s].get("best_epoch") for s in seeds],
        "select": [results[s].get("select") for s in seeds],
        "control_mean": [results[s].get("control_mean") for s in seeds],
        "test": {},
        "train_fit": {},
    }
    for group in groups:
        models = _ordered({m for s in seeds for m in per_seed[s][0].get(group, {})})
        summary["test"][group] = {
            m: _metric_stats([per_seed[s][0].get(group, {}).get(m, {}) for s in seeds])
            for m in models
        }
    models = _ordered({m for s in seeds for m in per_seed[s][1]})
    summary["train_fit"] = {
        m: _metric_stats([per_seed[s][1].get(m, {}) for s in seeds]) for m in models
    }
    return summary


def _ordered(models: set) -> list[str]:
    rank = {m: i for i, m in enumerate(("gears", *BASELINES))}
    return sorted(models, key=lambda m: (rank.get(m, len(rank)), m))


def _metric_stats(rows: list[dict]) -> dict:
    keys = sorted({k for row in rows for k in row})
    return {k: _stats([row.get(k) for row in rows]) for k in keys}


def _cell(stats: dict | None) -> str:
    if not stats or stats["mean"] is None:
        return "-"
    sd = "" if stats["sd"] is None else f" ± {stats['sd']:.3f}"
    return f"{stats['mean']:.3f}{sd}"


def _sizes(table: dict, model: str) -> list:
    """The model's n (perturbations scored) per seed in one row; 0 where it scored none."""
    values = (table.get(model, {}).get("n_conditions") or {}).get("values") or []
    return [0 if v is None else int(v) for v in values]


def _size_text(sizes: list) -> str:
    return "/".join(map(str, sorted(set(sizes))))


FEWER = "*"
COVERAGE = {
    "additive": "only perturbations whose singles were trained (on test, the doubles of "
    "combo_seen2: compare it there)"
}


def summary_markdown(summary: dict, metrics=SUMMARY_METRICS, title: str = "") -> str:
    """One table per metric: rows = test subgroups + train fit, columns = GEARS and baselines.
    A row's label carries GEARS's n per seed; a cell whose model scored fewer perturbations than
    GEARS in that row, in any seed, carries its own n and a mark, explained under the tables."""
    models = _ordered({m for g in summary["test"].values() for m in g})
    lines = [f"### {title}" if title else "", ""]
    lines.append(
        f"Split seeds {summary['seeds']}; mean ± sd over seeds; kept epoch per seed "
        f"{summary['best_epoch']}{_protocol_text(summary)}."
    )
    fewer: set[str] = set()
    for metric in metrics:
        lines += ["", f"**{metric}**", "", "| subgroup (n) | " + " | ".join(models) + " |"]
        lines.append("| --- " * (len(models) + 1) + "|")
        rows = [(g, summary["test"][g]) for g in summary["test"]]
        rows.append(("train fit", summary["train_fit"]))
        for group, table in rows:
            gears_n = _sizes(table, "gears")
            count = f" ({_size_text(gears_n)})" if gears_n else ""
            cells = []
            for m in models:
                cell, n = _cell(table.get(m, {}).get(metric)), _sizes(table, m)
                if (
                    cell != "-"
                    and n
                    and len(n) == len(gears_n)
                    and any(a < b for a, b in zip(n, gears_n))
                ):
                    cell += f" ({_size_text(n)}){FEWER}"
                    fewer.add(m)
                cells.append(cell)
            lines.append(f"| {group}{count} | " + " | ".join(cells) + " |")
    if fewer:
        lines += ["", f"{FEWER}: over fewer perturbations than gears in that row (its n per seed)."]
        lines += [
            f"{m} covers {COVERAGE.get(m, 'the perturbations it can predict')}."
            for m in sorted(fewer)
        ]
    return "\n".join(lines).strip() + "\n"


def _protocol_text(summary: dict) -> str:
    """'; eval.control_mean=all, train.select=last' (each as given per seed when they differ)."""
    parts = []
    for key, name in (("control_mean", "eval.control_mean"), ("select", "train.select")):
        values = [v for v in summary.get(key, []) if v is not None]
        if values:
            shown = values[0] if len(set(values)) == 1 else "/".join(map(str, values))
            parts.append(f"{name}={shown}")
    return "; " + ", ".join(parts) if parts else ""


def write_summary(root: Path, results: dict[int, dict], title: str, extra: dict) -> dict:
    """seeds_summary.json and .md under root from per-seed metrics -> the summary."""
    summary = summarize_seeds(results) | extra
    root.mkdir(parents=True, exist_ok=True)
    (root / "seeds_summary.json").write_text(json.dumps(summary, indent=1))
    (root / "seeds_summary.md").write_text(summary_markdown(summary, title=title))
    return summary


def collect(root: Path) -> dict[int, dict]:
    """The metrics.json of every finished seed_<s>/ under root (runs made elsewhere included)."""
    results = {}
    for path in sorted(Path(root).glob("seed_*/metrics.json")):
        try:
            results[int(path.parent.name.removeprefix("seed_"))] = json.loads(path.read_text())
        except ValueError:
            continue
    if not results:
        raise GearsInputError(f"no seed_<s>/metrics.json under {root}: run the seeds first")
    return results


def run_seeds(args, seeds: list[int]) -> dict:
    """Run the main job once per seed (in this process); rewrite the summary after each seed,
    so an interrupted series still leaves the summary of the seeds it finished."""
    base = config_from_args(args)
    root = Path(base.out_dir)
    title = f"{args.config or 'configs/default.yaml'} {' '.join(args.overrides)}".strip()
    extra = {"config": args.config, "overrides": list(args.overrides)}
    if args.collect:
        summary = write_summary(root, collect(root), title, extra)
        print(f"wrote {root}/seeds_summary.json and seeds_summary.md", flush=True)
        return summary
    results = {}
    for seed in seeds:
        args_s = type(args)(**vars(args))
        args_s.overrides = [
            *args.overrides,
            f"split.seed={seed}",
            f"seed={seed}",
            f"out_dir={root / f'seed_{seed}'}",
        ]
        cfg = config_from_args(args_s)
        print(f"\n=== seed {seed}: {cfg.out_dir}", flush=True)
        env = DistEnv(device=choose_device(cfg.device, 0, cfg.distributed.gpu_ids))
        results[seed] = run(cfg, env)
        summary = write_summary(root, results, title, extra)
    print(f"\nwrote {root}/seeds_summary.json and seeds_summary.md", flush=True)
    return summary


def main(argv: list[str] | None = None) -> dict:
    def extra(parser):
        parser.add_argument("--seeds", default="1,2,3,4,5", help="split seeds, e.g. 1,2,3")
        parser.add_argument(
            "--collect",
            action="store_true",
            help="only rebuild the summary from the seed_<s>/ runs already in out_dir",
        )

    args = parse_args(argv, "Train and evaluate GEARS over several split seeds.", extra)
    return run_seeds(args, parse_seeds(args.seeds))


if __name__ == "__main__":
    from gears.cli.job import command

    command(lambda: main(sys.argv[1:]))
