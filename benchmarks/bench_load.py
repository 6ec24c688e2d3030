"""The default main job idle and beside a busy core: default threads vs 1, 1 and 2 ranks.

python benchmarks/bench_load.py --json load.json            # 3 epochs, 3 repeats (~15 min, 2 cores)
python benchmarks/bench_load.py --quick                     # 1 epoch of 30 batches, 1 repeat
python benchmarks/bench_load.py --spinning --json load.json # also libgomp's spinning waits (before)
python benchmarks/bench_load.py --passive --genes 1000 --epochs 2 --json waits.json
                                        # governed waits against passive ones, 1,000-gene screen

Each run is a fresh `python train_single.py` (1 rank) or `python train_distributed.py --nproc 2`
(2 ranks) on the default synthetic screen, with the environment a user has: no OMP_NUM_THREADS,
OMP_WAIT_POLICY or GOMP_SPINCOUNT, so the entry points choose (gears/train/runtime.py). "busy"
starts
one `python -c "while True: pass"` beside the run and stops it after; "idle" starts nothing, so
an idle figure is only as idle as the machine (the JSON records the load). Runs are interleaved:
every repeat runs every arm under every load, in an order rotated from repeat to repeat, so a
drift in the machine's load spreads over all arms instead of biasing one.

Per run: wall time of the whole command, its CPU time (user + system, every process of the run),
and metrics.json's timing (train_s, threads). The table gives medians and the ratios the targets
name: beside a busy core, default / `train.threads=1` (at most 1.5); idle, `train.threads=1` /
default (the second core's gain); and each arm's busy / idle. `--spinning` adds the behaviour
before passive waits (GOMP_SPINCOUNT=300000, libgomp's default; 2 ranks with every core each);
`--passive` adds passive waits (OMP_WAIT_POLICY=PASSIVE, the default before the governed waits
of gears.train.runtime.WaitGovernor). Training cells/s (metrics.json) are reported beside wall
times.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from provenance import provenance  # noqa: E402

from gears.train.runtime import usable_cores  # noqa: E402

# Thread and wait settings a user's shell may hold; each arm starts without them.
THREAD_VARS = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "NUMBA_NUM_THREADS",
    "OMP_WAIT_POLICY",
    "GOMP_SPINCOUNT",
    "KMP_BLOCKTIME",
)
LAUNCH_PREFIXES = ("SLURM_", "TORCHELASTIC_", "GEARS_")
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SPINNING = {"GOMP_SPINCOUNT": "300000"}  # libgomp's default when no wait policy is set
PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE"}  # the entry points' default before governed waits


def arms(
    spinning: bool, cores: int, passive: bool = False, compile: bool = False
) -> dict[str, tuple[str, list[str], dict[str, str]]]:
    """key -> (label, command after `python`, extra environment)."""
    single = [str(ROOT / "train_single.py")]
    spawn2 = [str(ROOT / "train_distributed.py"), "--nproc", "2"]
    found = {
        "1r": ("1 rank, default", single, {}),
        "1r_t1": ("1 rank, train.threads=1", [*single, "train.threads=1"], {}),
        "2r": ("2 ranks, default", spawn2, {}),
        "2r_t1": ("2 ranks, train.threads=1", [*spawn2, "train.threads=1"], {}),
    }
    if compile:
        found["1r_compile"] = (
            "1 rank, default, train.compile=true",
            [*single, "train.compile=true"],
            {},
        )
    if passive:
        found["1r_passive"] = ("1 rank, default, passive waits (before)", single, PASSIVE)
    if spinning:
        found["1r_spin"] = ("1 rank, default, spinning waits (before)", single, SPINNING)
        found["2r_spin"] = (
            "2 ranks, every core each, spinning waits (before)",
            [*spawn2, f"train.threads={cores}"],
            SPINNING,
        )
    return found


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=None, help="epochs per run (default 3)")
    p.add_argument("--limit-batches", type=int, default=0, help="batches per epoch (0 = all)")
    p.add_argument("--repeats", type=int, default=None, help="runs per arm and load (default 3)")
    p.add_argument("--loads", default="idle,busy", help="comma-separated: idle, busy")
    p.add_argument("--spinning", action="store_true", help="add the spinning-wait arms")
    p.add_argument("--passive", action="store_true", help="add the passive-wait arm (before)")
    p.add_argument("--compile", action="store_true", help="add a train.compile=true arm")
    p.add_argument("--genes", type=int, default=0, help="synthetic screen's genes (0: default)")
    p.add_argument("--only", default=None, help="comma-separated arm keys: 1r,1r_t1,2r,2r_t1,...")
    p.add_argument("--quick", action="store_true", help="1 epoch of 30 batches, 1 repeat")
    p.add_argument("--work", default=None, help="folder for the runs (default: a temp folder)")
    p.add_argument("--json", default=None, help="write the runs and the summary here")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run before it fails")
    args = p.parse_args(argv)
    if args.quick:
        args.epochs = args.epochs or 1
        args.limit_batches = args.limit_batches or 30
        args.repeats = args.repeats or 1
    args.epochs = args.epochs or 3
    args.repeats = args.repeats or 3
    args.loads = [x.strip() for x in args.loads.split(",") if x.strip()]
    bad = set(args.loads) - {"idle", "busy"}
    if bad:
        p.error(f"--loads takes idle and busy, not {sorted(bad)}")
    return args


@contextlib.contextmanager
def load(kind: str):
    """'busy': one process spinning on a core meanwhile; 'idle': nothing started."""
    if kind == "idle":
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # running before the job starts
        yield
    finally:
        spinner.kill()
        spinner.wait()


def user_env(extra: dict[str, str]) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in THREAD_VARS and k not in LAUNCH_VARS and not k.startswith(LAUNCH_PREFIXES)
    }
    return {**env, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", **extra}


def run_one(cmd: list[str], env: dict[str, str], out_dir: Path, data_dir: Path, args) -> dict:
    """One job: wall and CPU seconds (the whole process tree) and metrics.json's timing."""
    overrides = [
        f"out_dir={out_dir}",
        f"data.data_dir={data_dir}",
        "wandb.mode=disabled",
        "device=cpu",
        f"train.epochs={args.epochs}",
        f"train.limit_batches={args.limit_batches}",
    ]
    if args.genes:
        overrides.append(f"data.synthetic={{n_genes: {args.genes}}}")
    log = out_dir.with_suffix(".log")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, *cmd, *overrides], stdout=f, stderr=subprocess.STDOUT, env=env
        )
    deadline = t0 + args.timeout
    status, usage = 0, None
    while usage is None:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid == 0:
            usage = None
            if time.perf_counter() > deadline:
                proc.kill()
            time.sleep(0.05)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    record = {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "exit": proc.returncode}
    metrics = out_dir / "metrics.json"
    if proc.returncode == 0 and metrics.exists():
        timing = json.loads(metrics.read_text())["timing"]
        keys = ("train_s", "total_s", "threads", "train_cells_per_s", "omp_waits", "thread_policy")
        record.update({k: timing.get(k) for k in keys})
    else:
        record["log_tail"] = log.read_text()[-2000:]
    return record


def median(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None and r["exit"] == 0]
    return statistics.median(values) if values else None


def summarise(runs: list[dict], names: list[str], loads: list[str]) -> dict:
    """Medians per (load, arm) and the ratios the targets name."""
    cells = {}
    for kind in loads:
        for name in names:
            mine = [r for r in runs if r["load"] == kind and r["arm"] == name]
            cells[f"{kind} | {name}"] = {
                "runs": len(mine),
                "failed": sum(r["exit"] != 0 for r in mine),
                **{
                    k: median(mine, k)
                    for k in ("wall_s", "cpu_s", "train_s", "threads", "train_cells_per_s")
                },
            }

    def ratio(a: str, b: str, key: str = "wall_s") -> float | None:
        x, y = cells.get(a, {}).get(key), cells.get(b, {}).get(key)
        return x / y if x and y else None

    ratios = {}
    for ranks in ("1 rank", "2 ranks"):
        default, one = f"{ranks}, default", f"{ranks}, train.threads=1"
        ratios[f"busy: {ranks} default / threads=1 (target <= 1.5)"] = ratio(
            f"busy | {default}", f"busy | {one}"
        )
        ratios[f"idle: {ranks} threads=1 / default (second core's gain)"] = ratio(
            f"idle | {one}", f"idle | {default}"
        )
    for name in names:
        ratios[f"busy / idle: {name}"] = ratio(f"busy | {name}", f"idle | {name}")
    cps = "train_cells_per_s"
    for kind, want in (("idle", ">= 1.3"), ("busy", ">= 1/1.5 = 0.67")):
        ratios[f"{kind}: 1 rank default / threads=1, train cells/s (target {want})"] = ratio(
            f"{kind} | 1 rank, default", f"{kind} | 1 rank, train.threads=1", cps
        )
        ratios[f"{kind}: 1 rank default / passive waits (before), train cells/s"] = ratio(
            f"{kind} | 1 rank, default", f"{kind} | 1 rank, default, passive waits (before)", cps
        )
        ratios[f"{kind}: 1 rank train.compile=true / eager (default), train cells/s"] = ratio(
            f"{kind} | 1 rank, default, train.compile=true", f"{kind} | 1 rank, default", cps
        )
    return {"cells": cells, "ratios": ratios}


def table(summary: dict) -> str:
    def fmt(x, digits=1):
        return "-" if x is None else f"{x:.{digits}f}"

    lines = [
        "| load | arm | runs | wall s | CPU s | train s | train cells/s | threads |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, c in summary["cells"].items():
        kind, name = key.split(" | ")
        runs = f"{c['runs']}" + (f" ({c['failed']} failed)" if c["failed"] else "")
        lines.append(
            f"| {kind} | {name} | {runs} | {fmt(c['wall_s'])} | {fmt(c['cpu_s'])} | "
            f"{fmt(c['train_s'])} | {fmt(c['train_cells_per_s'], 0)} | {fmt(c['threads'], 0)} |"
        )
    lines += ["", "| ratio (wall time unless named, medians) | value |", "|---|---|"]
    lines += [f"| {k} | {fmt(v, 2)} |" for k, v in summary["ratios"].items()]
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    cores = usable_cores()
    all_arms = arms(args.spinning, cores, args.passive, args.compile)
    if args.only:
        wanted = [x.strip() for x in args.only.split(",")]
        unknown = [x for x in wanted if x not in all_arms]
        if unknown:
            raise SystemExit(f"--only: unknown arms {unknown}; known: {list(all_arms)}")
        all_arms = {k: all_arms[k] for k in wanted}
    names = [label for label, _, _ in all_arms.values()]
    info = provenance(sys.argv if argv is None else ["benchmarks/bench_load.py", *argv])
    print(f"{info['commit']}, {info['machine']}, {cores} usable cores", flush=True)
    work_ctx = (
        contextlib.nullcontext(args.work)
        if args.work
        else tempfile.TemporaryDirectory(prefix="bench_load_")
    )
    runs = []
    with work_ctx as work:
        work = Path(work)
        work.mkdir(parents=True, exist_ok=True)
        plan = [(kind, name) for kind in args.loads for name in names]
        for rep in range(args.repeats):
            shift = rep % len(plan)
            for kind, name in plan[shift:] + plan[:shift]:
                _, cmd, extra = next(a for a in all_arms.values() if a[0] == name)
                out_dir = work / f"r{rep}_{kind}_{names.index(name)}"
                load_before = os.getloadavg()[0]
                with load(kind):
                    record = run_one(cmd, user_env(extra), out_dir, work / "data", args)
                record.update(
                    load=kind,
                    arm=name,
                    repeat=rep,
                    loadavg_before=load_before,
                    loadavg_after=os.getloadavg()[0],
                )
                runs.append(record)
                status = "ok" if record["exit"] == 0 else f"exit {record['exit']}"
                print(
                    f"{kind:4s} {name:52s} wall {record['wall_s']:7.1f}s "
                    f"cpu {record['cpu_s']:7.1f}s threads {record.get('threads')} "
                    f"cells/s {record.get('train_cells_per_s') or 0:.0f} "
                    f"load {load_before:.1f} {record.get('omp_waits')} {status}",
                    flush=True,
                )
    summary = summarise(runs, names, args.loads)
    print()
    print(table(summary))
    result = {
        **info,
        "usable_cores": cores,
        "epochs": args.epochs,
        "limit_batches": args.limit_batches,
        "genes": args.genes or None,
        "repeats": args.repeats,
        "runs": runs,
        **summary,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    from gears.cli.exiting import run_and_exit  # exits once done, whatever threads are left

    run_and_exit(main)
