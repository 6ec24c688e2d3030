"""GPU check: what only a CUDA machine can verify, run through the project's own entry points.

    python benchmarks/gpu_check.py [--json FILE]          # every check on the visible GPUs
    python benchmarks/gpu_check.py --quick --json FILE    # small sizes, few steps: a first try
    python benchmarks/gpu_check.py --only e2e,restart     # some checks
    python benchmarks/gpu_check.py --device cpu --quick   # the harness itself, on the CPU

No GPU has run this file yet; its CPU mode runs in the tests (tests/test_benchmarks.py). One
line per check says pass / fail / skip and why; --json FILE is rewritten after every check (a
check that raises, times out or is killed still leaves it), every log stays under --work.

Checks (each a function returning a dict, each in its own time limit):
  e2e         train_single.py on the device: fp32 with train.tf32=false and =true, bf16, fp16,
              bf16 + train.compile=true. Every output is written (config.yaml, metrics.json,
              model/, checkpoints/, plots/*.png) and the test mse_de and pearson_delta lie
              within the spread of CPU runs of the same config, seeds 1..n:
              [min - 2 r, max + 2 r], r = max - min of the CPU seeds (n = 5; 3 with --quick).
              The GPU's numerics act like another seed; one more run drawn from the same
              normal distribution falls outside with probability 0.5% at n = 5 (5.4% at n = 3),
              so a defect-free GPU fails one of the 5 x 2 comparisons with at most ~5% (union
              bound). Then predict.py on the fp32 model writes its .h5ad. (--device cpu: 2
              seeds, and the fp32 run is the seed-1 run itself: a test of the harness.)
  ddp         N ranks x batch b == 1 process x batch N*b, tests/test_ddp.py's protocol through
              train_distributed.py / train_single.py: SGD lr 0.01, no weight decay or clipping,
              fp32 without TF32, 2 steps, synchronised batch-norm, every batch whole
              perturbation groups of 4 cells (one group per condition, so the loss's mean
              over perturbations splits exactly over ranks). 2 ranks sharing one GPU over gloo;
              NCCL over min(GPUs, 8) ranks when 2+ GPUs are visible. Saved weights (and
              batch-norm statistics) agree within atol 1e-4 + rtol 1e-4: the runs differ only in
              the order of fp32 sums (all-reduce vs one batch, other matmul shapes and
              kernels). Through this harness on the CPU that noise is 2.6e-6 at most, while the
              defect it guards against (batch-norm statistics not synchronised) moves weights
              by 0.05-0.12: the tolerance sits ~40x above the one and ~500x below the other.
  restart     torchrun --max-restarts=1 with rank 1 SIGKILLed in epoch 2 (GEARS_FAULT_KILL, after
              the epoch-1 checkpoint): the log says "resumed from" that checkpoint and the final
              weights equal an uninterrupted run's bit for bit (GEARS_DETERMINISTIC=1 in both).
  throughput  the engine at Norman size (5,000 genes) and VCC size (18,080 genes), hidden 64,
              random batches of 32 and 256, fp32 (TF32 off, on), bf16, fp16: cells/s as the
              median of timed blocks of warm steps (synchronised at each block's ends), beside
              bench_train's bare per-cell bound timed the same way on the same device; peak GPU
              memory per configuration; at VCC size the largest batch that fits (doubling).
  cell_gears  --with-cell-gears: cell-gears 0.1.2's training loop on the same screen and device
              (bench_train's harness, in the environment vs_cell_gears.py creates), and ours.
  projection  on paper, not measured: DDP efficiency at 2/4/8 GPUs from the measured step times
              and the fp32 gradient bytes per step over a ring all-reduce.
Without CUDA (and without --device cpu) it says so, writes a JSON of skipped checks, exits 0.
Exit status 1 when a check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

CHECKS = ("e2e", "ddp", "restart", "throughput", "cell_gears", "projection")
TIMEOUT_S = {  # per check; --timeout replaces them all
    "e2e": 3600,
    "ddp": 1800,
    "restart": 1800,
    "throughput": 3600,
    "cell_gears": 3600,
    "projection": 60,
}
E2E_METRICS = ("mse_de", "pearson_delta")
SPREAD_MARGIN = 2.0  # e2e: accept [min - 2r, max + 2r] of the CPU seeds, r their range
DDP_TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}  # see the docstring (ddp)
# Tiny screens: the same numbers as tests/helpers.py's TINY (e2e --quick, restart) and one with
# a single group of 4 cells per condition, control included (ddp).
TINY_SCREEN = (
    "{n_genes: 60, n_single: 16, n_double: 12, cells_per_condition: 16, "
    "n_control_cells: 128, n_modules: 4}"
)
DDP_SCREEN = (
    "{n_genes: 120, n_single: 60, n_double: 50, cells_per_condition: 4, n_control_cells: 4, "
    "n_modules: 6}"
)
SIZES = {"norman": 5_000, "vcc": 18_080}  # genes; hidden 64
QUICK_SIZES = {"norman": 500, "vcc": 1_000}
BATCHES = (32, 256)
# (label, train.precision, train.tf32)
PRECISIONS = (("fp32", "fp32", False), ("fp32+tf32", "fp32", True), ("bf16", "bf16", False))
PRECISIONS += (("fp16", "fp16", False),)
# Projection assumptions (bus bandwidth of a ring all-reduce, per GPU):
LINKS = {
    # H100 SXM NVLink 4 moves 450 GB/s per direction; NCCL all-reduce reaches less: assumed.
    "NVLink (300 GB/s assumed)": 300e9,
    "InfiniBand 200 Gb/s (25 GB/s)": 25e9,
}
EXPECTED_SPEEDUP = {2: 1.8, 4: 3.4, 8: 6.2}  # quoted expectation, never measured
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK")
LAUNCH_PREFIXES = ("SLURM_", "TORCHELASTIC_", "GEARS_FAULT", "TORCH_DISABLE_SHARE")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="FILE", help="write the results here (after every check)")
    p.add_argument("--quick", action="store_true", help="small sizes, few steps: a first try")
    p.add_argument("--only", help=f"comma-separated checks among {','.join(CHECKS)}")
    p.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="cpu runs the harness on the CPU (fp32/bf16; CUDA-only parts skipped)",
    )
    p.add_argument("--precisions", default="fp32,bf16,fp16", help="subset of fp32,bf16,fp16")
    p.add_argument(
        "--cpu-seeds", type=int, default=None, help="e2e CPU runs (5; --quick 3; --device cpu 2)"
    )
    p.add_argument("--timeout", type=float, default=None, help="seconds per check (all)")
    p.add_argument("--work", default=None, help="run folders and logs (default: a new temp dir)")
    p.add_argument("--with-cell-gears", action="store_true", help="also time cell-gears 0.1.2")
    p.add_argument("--cell-gears-python", help="python with cell-gears (default: its venv)")
    args = p.parse_args(argv)
    args.only = [c.strip() for c in args.only.split(",")] if args.only else list(CHECKS)
    unknown = [c for c in args.only if c not in CHECKS]
    if unknown:
        p.error(f"--only: unknown check(s) {unknown}; choose from {', '.join(CHECKS)}")
    if args.cpu_seeds is not None and args.cpu_seeds < 2:
        p.error("--cpu-seeds must be >= 2 (a spread needs two runs)")
    args.precisions = [x.strip() for x in args.precisions.split(",") if x.strip()]
    if set(args.precisions) - {"fp32", "bf16", "fp16"}:
        p.error(f"--precisions {args.precisions}: use fp32, bf16, fp16")
    return args


# ------------------------------------------------------------------------------ processes
class CheckTimeout(BaseException):
    """A check ran past its limit (BaseException: no `except Exception` in a check swallows it)."""


class Stopped(BaseException):
    """SIGTERM: the harness stops, killing its children and recording the check it was in."""


def on_sigterm(signum, frame):
    raise Stopped("stopped by SIGTERM")


LIVE: set[Proc] = set()


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without launcher variables (a run must not think it is a rank)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCH_VARS and not k.startswith(LAUNCH_PREFIXES)
    }
    return {**env, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", **extra}


def descendants(pid: int) -> list[int]:
    """Every process below pid (torchrun's workers run in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


class Proc:
    """A command in the background, stdout and stderr in one log file."""

    def __init__(self, cmd: list[str], log: Path, env: dict[str, str] | None = None):
        self.cmd, self.log, self.rc = [str(c) for c in cmd], log, None
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as f:
            f.write(f"$ {shlex.join(self.cmd)}\n")
            f.flush()
            self.p = subprocess.Popen(
                self.cmd, cwd=ROOT, env=env or clean_env(), stdout=f, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        LIVE.add(self)

    def wait(self) -> Proc:
        self.rc = self.p.wait()  # the check's time limit (SIGALRM) interrupts this
        LIVE.discard(self)
        return self

    def kill(self) -> None:
        for pid in [*descendants(self.p.pid), self.p.pid]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self.p.wait()
        LIVE.discard(self)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def why(self) -> str:
        tail = " | ".join(ln for ln in self.text().splitlines()[-6:] if ln.strip())
        return f"exit {self.rc} (log {self.log}): ...{tail[-600:]}"


def run(cmd: list, log: Path, env: dict[str, str] | None = None) -> Proc:
    return Proc(cmd, log, env).wait()


@contextlib.contextmanager
def time_limit(seconds: float):
    def on_alarm(signum, frame):
        raise CheckTimeout(f"timed out after {seconds:g}s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def result(status: str, reason: str, **details) -> dict:
    return {"status": status, "reason": reason, **details}


# ------------------------------------------------------------------------------ helpers
def train_single(ctx, out: Path, overrides: list[str], device: str, log_name: str) -> Proc:
    cmd = [sys.executable, "train_single.py", f"device={device}", f"out_dir={out}"]
    cmd += [f"data.data_dir={out.parent / (out.name + '_data')}", "wandb.mode=disabled"]
    return Proc(cmd + overrides, ctx.work / "logs" / f"{log_name}.log")


def run_dir_problems(out: Path) -> list[str]:
    """What train_single.py / train_distributed.py failed to write into a run folder."""
    missing = [
        name
        for name in ("config.yaml", "metrics.json", "model/model.pt", "model/config.json")
        if not (out / name).is_file()
    ]
    if not list((out / "checkpoints").glob("*.pt")):
        missing.append("checkpoints/*.pt")
    plots = {p.name for p in (out / "plots").glob("*.png")}
    if "loss.png" not in plots or len(plots) < 2:
        missing.append(f"plots/ (loss.png + perturbation plots; found {sorted(plots)})")
    return missing


def test_metrics(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())["test"]


def saved_weights(out: Path) -> dict[str, torch.Tensor]:
    from gears import checkpoint as ckpt

    return ckpt.load(out / "model" / "model.pt")["state_dict"]


def last_step(out: Path) -> int:
    from gears import checkpoint as ckpt

    return ckpt.load(ckpt.list_checkpoints(out / "checkpoints")[-1])["step"]


def compare_weights(a: dict, b: dict, exact: bool = False) -> tuple[bool, float, str]:
    """(equal within DDP_TOLERANCE or bit for bit, max |a - b|, the key where it is largest)."""
    if a.keys() != b.keys():
        return False, math.inf, f"keys differ: {sorted(set(a) ^ set(b))[:5]}"
    ok, worst, where = True, 0.0, ""
    for k in a:
        x, y = a[k].float(), b[k].float()
        diff = (x - y).abs().max().item() if x.numel() else 0.0
        if diff > worst:
            worst, where = diff, k
        if exact:
            ok &= torch.equal(a[k], b[k])
        else:
            ok &= torch.allclose(x, y, **DDP_TOLERANCE)
    return ok, worst, where


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def blocks_per_s(runner, device: torch.device, repeats: int) -> float:
    """Cells/s of `runner` (a closure -> cells done): one warm-up call, then the median over
    `repeats` calls, each timed between device synchronisations."""
    runner()
    rates = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        cells = runner()
        sync(device)
        rates.append(cells / (time.perf_counter() - t0))
    return statistics.median(rates)


def free_gpu() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def precision_configs(ctx) -> list[tuple[str, str, bool, str | None]]:
    """(label, precision, tf32, why skipped or None) for this device and --precisions."""
    rows = []
    for label, precision, tf32 in PRECISIONS:
        why = None
        if ctx.device == "cpu" and precision == "fp16":
            why = "fp16 needs CUDA (autocast + GradScaler)"
        elif ctx.device == "cpu" and tf32:
            why = "no TF32 on the CPU (train.tf32 only touches CUDA)"
        elif precision == "bf16" and ctx.device == "cuda" and not ctx.native_bf16:
            why = "bf16 only emulated on this GPU (train.precision=bf16 is refused)"
        elif precision not in ctx.args.precisions:
            why = f"not in --precisions {','.join(ctx.args.precisions)}"
        rows.append((label, precision, tf32, why))
    return rows


# ------------------------------------------------------------------------------ 1. e2e
def check_e2e(ctx) -> dict:
    """train_single.py per precision on the device, CPU seeds for the spread, predict.py."""
    quick, dev = ctx.args.quick, ctx.device
    screen, hidden, epochs = (TINY_SCREEN, 16, 1) if quick else ("{}", 64, 2)
    common = [f"data.synthetic={screen}", f"model.hidden_size={hidden}", f"train.epochs={epochs}"]
    n_seeds = ctx.args.cpu_seeds or (2 if dev == "cpu" else 3 if quick else 5)
    threads = max(1, ((os.cpu_count() or 2) - (dev == "cuda")) // n_seeds)
    folder = ctx.work / "e2e"
    refs = {
        seed: (
            folder / f"cpu_seed{seed}",
            train_single(
                ctx,
                folder / f"cpu_seed{seed}",
                [*common, f"seed={seed}", f"train.threads={threads}"],
                "cpu",
                f"e2e_cpu_seed{seed}",
            ),
        )
        for seed in range(1, n_seeds + 1)
    }  # all at once, in the background
    configs = []
    for label, precision, tf32, why in precision_configs(ctx):
        configs.append((label, [f"train.precision={precision}", f"train.tf32={tf32}"], why))
    compile_why = next(w for lab, _, _, w in precision_configs(ctx) if lab == "bf16")
    if dev == "cpu":
        compile_why = "inductor on the CPU builds C++ for minutes (tests/test_compile.py: CPU)"
    configs.append(("bf16+compile", ["train.precision=bf16", "train.compile=true"], compile_why))
    rows = {}
    for label, over, why in configs:
        if why:
            rows[label] = result("skip", why)
            continue
        if dev == "cpu" and label == "fp32":  # the same command as the seed-1 reference
            rows[label] = {"out": refs[1][0], "proc": refs[1][1], "note": "= CPU seed 1 run"}
            continue
        out = folder / label.replace("+", "_")
        t0 = time.perf_counter()
        proc = train_single(ctx, out, [*common, *over], dev, f"e2e_{label}").wait()
        rows[label] = {"out": out, "proc": proc, "seconds": time.perf_counter() - t0}
    # The CPU spread.
    ref_metrics, problems = {}, []
    for seed, (out, proc) in refs.items():
        proc.wait()
        bad = [] if proc.rc == 0 else [proc.why()]
        bad = bad or run_dir_problems(out)
        if bad:
            problems.append(f"CPU seed {seed}: {'; '.join(bad)}")
        else:
            ref_metrics[seed] = {m: test_metrics(out).get(m) for m in E2E_METRICS}
    interval = {}
    for m in E2E_METRICS:
        values = [v[m] for v in ref_metrics.values() if v[m] is not None]
        if len(values) >= 2:
            lo, hi = min(values), max(values)
            interval[m] = (lo - SPREAD_MARGIN * (hi - lo), hi + SPREAD_MARGIN * (hi - lo))
    for label, row in rows.items():
        if "proc" not in row:
            continue
        proc, out = row.pop("proc"), row.pop("out")
        if proc.rc != 0:
            rows[label] = result("fail", proc.why())
            continue
        missing = run_dir_problems(out)
        if missing:
            rows[label] = result("fail", "; ".join(f"missing {x}" for x in missing))
            continue
        metrics = json.loads((out / "metrics.json").read_text())
        got = {m: metrics["test"].get(m) for m in E2E_METRICS}
        info = {"metrics": got, "cells_per_s": metrics["timing"]["train_cells_per_s"]}
        info["seconds"] = row.get("seconds")
        outside = [
            f"{m} {got[m]} outside [{interval[m][0]:.4f}, {interval[m][1]:.4f}]"
            for m in E2E_METRICS
            if m in interval and (got[m] is None or not interval[m][0] <= got[m] <= interval[m][1])
        ]
        if len(interval) < len(E2E_METRICS):
            outside.append("no CPU spread to compare with (CPU runs failed)")
        if outside:
            rows[label] = result("fail", "; ".join(outside), **info)
        else:
            note = f" ({row['note']})" if "note" in row else ""
            why = f"outputs written, metrics within the CPU spread{note}"
            rows[label] = result("pass", why, run_dir=str(out), **info)
    # predict.py on the device-trained fp32 model (or the first that passed).
    trained = [lab for lab in ("fp32", *rows) if rows.get(lab, {}).get("status") == "pass"]
    predict = result("skip", "no device run passed")
    if trained:
        predict = predict_check(ctx, Path(rows[trained[0]]["run_dir"]), trained[0])
    failed = [lab for lab, r in rows.items() if r["status"] == "fail"]
    failed += ["predict"] if predict["status"] == "fail" else []
    if problems:
        failed.append("CPU references")
    ran = [lab for lab, r in rows.items() if r["status"] != "skip"]
    if failed:
        status = "fail"
        reason = f"failed: {', '.join(failed)}" + "".join(f"; {p[:300]}" for p in problems)
    elif ran:
        status = "pass"
        reason = (
            f"{', '.join(ran)} trained on {dev}, outputs written, test metrics within the "
            f"spread of {n_seeds} CPU seeds (margin {SPREAD_MARGIN:g} x range); predict.py ran"
        )
    else:
        status, reason = "skip", "no configuration to run (--precisions)"
    return result(
        status, reason, configs=rows, predict=predict, cpu_seeds=ref_metrics,
        interval={m: list(v) for m, v in interval.items()}, margin=f"{SPREAD_MARGIN:g} x range",
    )  # fmt: skip


def predict_check(ctx, run_dir: Path, label: str) -> dict:
    import anndata
    import numpy as np

    info = json.loads((run_dir / "model" / "prediction.json").read_text())
    control = info.get("control_label", "ctrl")
    perts = [c for c in info["condition_spelling"] if c != control][:2]
    out = ctx.work / "e2e" / f"predict_{label.replace('+', '_')}.h5ad"
    cmd = [sys.executable, "predict.py", "--model", run_dir / "model", "--perturbations"]
    cmd += [",".join(perts), "--cells-per-perturbation", "20", "--device", ctx.device]
    proc = run([*cmd, "--out", out], ctx.work / "logs" / "e2e_predict.log")
    if proc.rc != 0:
        return result("fail", proc.why())
    if not out.is_file():
        return result("fail", f"predict.py exited 0 but wrote no {out}")
    pred = anndata.read_h5ad(out)
    X = pred.X.toarray() if hasattr(pred.X, "toarray") else np.asarray(pred.X)
    if pred.n_obs < 40 or not np.isfinite(X).all():
        return result("fail", f"{out}: {pred.n_obs} cells, finite: {bool(np.isfinite(X).all())}")
    return result("pass", f"{label} model: {pred.n_obs} cells x {pred.n_vars} genes in {out}")


# ------------------------------------------------------------------------------ 2. ddp
DDP_PROTOCOL = [
    f"data.synthetic={DDP_SCREEN}",
    "model.hidden_size=32",
    "train.optimizer=sgd",
    "train.lr=0.01",
    "train.weight_decay=0",
    "train.grad_clip=0",
    "train.schedule=constant",
    "train.epochs=1",
    "train.limit_batches=2",
    "train.precision=fp32",
    "train.tf32=false",
    "train.batching=grouped",
    "train.cells_per_group=4",
    "train.select=last",
    "distributed.sync_batchnorm=true",
    "distributed.timeout_s=300",
]
PER_RANK_BATCH = 8  # 2 groups of 4 cells


def check_ddp(ctx) -> dict:
    variants = []  # (label, ranks, backend, device of the ranks, device of the 1-process run)
    if ctx.device == "cpu":
        variants.append(("gloo, 2 CPU ranks", 2, "gloo", "cpu", "cpu"))
    else:
        variants.append(("gloo, 2 ranks on 1 GPU", 2, "gloo", "cuda", "cuda:0"))
        if ctx.gpus >= 2:
            n = min(ctx.gpus, 8)
            variants.append((f"nccl, {n} GPUs", n, "nccl", "cuda", "cuda:0"))
    rows = {}
    for label, n, backend, device, single_device in variants:
        folder = ctx.work / "ddp" / f"{backend}{n}"
        single = folder / "single"
        one = train_single(
            ctx, single, [*DDP_PROTOCOL, f"train.batch_size={n * PER_RANK_BATCH}"],
            single_device, f"ddp_{backend}{n}_single",
        ).wait()  # fmt: skip
        multi = folder / "ranks"
        cmd = [sys.executable, "train_distributed.py", "--nproc", n, f"device={device}"]
        cmd += [f"distributed.backend={backend}", f"out_dir={multi}", "wandb.mode=disabled"]
        cmd += [f"data.data_dir={folder / 'ranks_data'}", *DDP_PROTOCOL]
        cmd += [f"train.batch_size={PER_RANK_BATCH}"]
        many = run(cmd, ctx.work / "logs" / f"ddp_{backend}{n}_ranks.log")
        bad = [p.why() for p in (one, many) if p.rc != 0]
        if bad:
            rows[label] = result("fail", "; ".join(bad))
            continue
        steps = (last_step(single), last_step(multi))
        if steps != (2, 2):
            rows[label] = result("fail", f"steps (1 process, {n} ranks) = {steps}, expected 2")
            continue
        same, diff, where = compare_weights(saved_weights(single), saved_weights(multi))
        tol = f"atol {DDP_TOLERANCE['atol']:g} + rtol {DDP_TOLERANCE['rtol']:g}"
        rows[label] = result(
            "pass" if same else "fail",
            f"{n} ranks x batch {PER_RANK_BATCH} vs 1 process x {n * PER_RANK_BATCH}: max |diff| "
            f"{diff:.2e} ({where or '-'}), {'within' if same else 'OUTSIDE'} {tol}",
            max_abs_diff=diff,
        )  # fmt: skip
    failed = [k for k, r in rows.items() if r["status"] == "fail"]
    reason = "; ".join(f"{k}: {r['reason']}" for k, r in rows.items())
    if ctx.device == "cuda" and ctx.gpus < 2:
        reason += "; NCCL skipped: needs 2+ GPUs (NCCL refuses two ranks on one GPU)"
    if ctx.device == "cpu":
        reason += "; NCCL skipped: CUDA only"
    return result("fail" if failed else "pass", reason, variants=rows)


# ------------------------------------------------------------------------------ 3. restart
def check_restart(ctx) -> dict:
    """Kill rank 1 in epoch 2 under torchrun --max-restarts=1; compare with no kill."""
    cuda = ctx.device == "cuda"
    backend = "nccl" if cuda and ctx.gpus >= 2 else "gloo"
    hidden = 16 if ctx.args.quick else 64
    overrides = [f"device={'cuda' if cuda else 'cpu'}", f"distributed.backend={backend}"]
    overrides += [f"data.synthetic={TINY_SCREEN}", f"model.hidden_size={hidden}"]
    overrides += ["train.epochs=3", "train.batch_size=16", "train.checkpoint_every=1"]
    overrides += ["distributed.timeout_s=120", "wandb.mode=disabled"]
    env = {
        "GEARS_DETERMINISTIC": "1",
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        # run_multi_node.sh's setting: a process group per rendezvous (restarted ranks must not
        # find the killed attempt's keys; see tests/test_distributed.py).
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        **({"OMP_NUM_THREADS": "1"} if not cuda else {}),
    }

    def torchrun(name: str, extra_env: dict, restarts: int) -> Proc:
        out = ctx.work / "restart" / name
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc_per_node=2", f"--max-restarts={restarts}", "train_distributed.py"]
        cmd += [f"out_dir={out}", f"data.data_dir={out}_data", *overrides]
        return run(cmd, ctx.work / "logs" / f"restart_{name}.log", clean_env(**env, **extra_env))

    ref = torchrun("uninterrupted", {}, 0)
    if ref.rc != 0:
        return result("fail", f"uninterrupted run: {ref.why()}")
    ref_dir = ctx.work / "restart" / "uninterrupted"
    per_epoch = last_step(ref_dir) // 3
    if per_epoch < 2:
        return result("fail", f"{per_epoch} steps per epoch: cannot kill inside epoch 2")
    kill_step = per_epoch + per_epoch // 2 + 1  # optimizer steps count from 1
    killed = torchrun("killed", {"GEARS_FAULT_KILL": f"1:step:{kill_step}"}, 1)
    log = killed.text()
    details = {"backend": backend, "kill_step": kill_step, "steps_per_epoch": per_epoch}
    if killed.rc != 0:
        return result("fail", f"killed run did not finish: {killed.why()}", **details)
    if "resumed from" not in log or "epoch_0001.pt (epoch 1," not in log:
        return result("fail", f"no 'resumed from ...epoch_0001.pt' in {killed.log}", **details)
    same, diff, where = compare_weights(
        saved_weights(ctx.work / "restart" / "killed"), saved_weights(ref_dir), exact=True
    )
    why = (
        f"rank 1 SIGKILLed at step {kill_step} (epoch 2, {per_epoch} steps/epoch, {backend}); "
        f"resumed from the epoch-1 checkpoint; final weights vs uninterrupted: "
        + ("bit-identical" if same else f"DIFFER, max |diff| {diff:.2e} at {where}")
    )
    return result("pass" if same else "fail", why, max_abs_diff=diff, **details)


# ------------------------------------------------------------------------------ 4. throughput
def screen(ctx, genes: int):
    """bench_train's synthetic screen at `genes` genes (built once per size)."""
    from bench_train import build_data

    if genes not in ctx.screens:
        quick = ctx.args.quick
        spec = SimpleNamespace(
            genes=genes, singles=40 if quick else 100, doubles=30 if quick else 60,
            cells_per_condition=20 if quick else 50, quick=quick,
        )  # fmt: skip
        ctx.screens[genes] = build_data(spec, ctx.work / "screens" / str(genes))
    return ctx.screens[genes]


def engine_and_bound(ctx, pd_, net0, genes: int, batch: int, precision: str, tf32: bool) -> dict:
    """Cells/s of the engine (real loader, GPU-resident data when it fits) and of the bare
    per-cell bound, timed alike; peak GPU memory of the engine configuration."""
    from bench_train import bare_runner, engine_runner

    from gears.distributed import set_tf32

    device = torch.device(ctx.device)
    steps, repeats = (3, 2) if ctx.args.quick else (20, 5)
    spec = SimpleNamespace(batch=batch, hidden=64, steps=steps)
    row = {"genes": genes, "batch": batch, "precision": precision, "tf32": tf32}
    free_gpu()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        row["base_mb"] = torch.cuda.memory_allocated(device) / 2**20
    runner = engine_runner(pd_, net0, spec, "random", precision, device, tf32)
    row["cells_per_s"] = blocks_per_s(runner, device, repeats)
    row["step_ms"] = 1e3 * batch / row["cells_per_s"]
    if device.type == "cuda":
        row["peak_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    del runner
    free_gpu()
    set_tf32(device, tf32)
    bound = bare_runner(genes, 64, batch, precision, steps, device)
    row["bound_cells_per_s"] = blocks_per_s(bound, device, repeats)
    row["x_bound"] = row["cells_per_s"] / row["bound_cells_per_s"]
    del bound
    free_gpu()
    return row


class BatchList:
    """A fixed list of batches with the loader interface Trainer.train_epoch reads."""

    def __init__(self, batches: list):
        self.batches = batches

    def set_epoch(self, epoch: int) -> None:
        pass

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def largest_batch(ctx, pd_, net0, precision: str, start: int = 512, cap: int = 1 << 20) -> dict:
    """Double the batch (examples drawn with replacement, gathered on the GPU) until a training
    step runs out of memory; -> the largest that fit and the first that did not."""
    import numpy as np
    from bench_train import make_trainer

    device = torch.device(ctx.device)
    ds = pd_.example_set("train")
    rng = np.random.default_rng(0)
    fits, oom, peak, batch = None, None, None, start
    while batch <= cap:
        trainer = loader = one = None
        try:
            free_gpu()
            torch.cuda.reset_peak_memory_stats(device)
            spec = SimpleNamespace(batch=32, hidden=64, steps=1)
            trainer, _ = make_trainer(pd_, copy.deepcopy(net0), spec, "random", precision, device)
            one = ds[rng.integers(0, len(ds), batch)]
            loader = BatchList([one, one])
            trainer.cfg.limit_batches = 2
            trainer.train_epoch(loader, 0, progress=False)
            sync(device)
            fits, peak = batch, torch.cuda.max_memory_allocated(device) / 2**20
        except torch.OutOfMemoryError:
            oom = batch
            break
        finally:
            trainer = loader = one = None  # noqa: F841 - the GPU memory goes before the next try
            free_gpu()
        batch *= 2
    return {"precision": precision, "fits": fits, "peak_mb": peak, "first_oom": oom, "cap": cap}


def check_throughput(ctx) -> dict:
    from bench_train import build_net

    sizes = QUICK_SIZES if ctx.args.quick else SIZES
    configs = precision_configs(ctx)
    rows, skipped, params, max_batch = [], {}, {}, []
    for size, genes in sizes.items():
        pd_ = screen(ctx, genes)
        net0 = build_net(pd_, 64)
        params[size] = sum(p.numel() for p in net0.parameters())
        if ctx.device == "cuda":
            pd_.expr.to_device(torch.device("cuda"))  # resident before any peak is measured
        for batch in BATCHES:
            for label, precision, tf32, why in configs:
                if why:
                    skipped[label] = why
                    continue
                row = {"size": size, "label": label, "genes": genes, "batch": batch}
                try:
                    row.update(engine_and_bound(ctx, pd_, net0, genes, batch, precision, tf32))
                except torch.OutOfMemoryError:
                    row["oom"] = True
                except (Exception, SystemExit) as e:  # this configuration only
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                free_gpu()
                rows.append(row)
                print(f"  {format_row(rows[-1])}", flush=True)
        if size == "vcc" and ctx.device == "cuda":
            for label, precision, _, why in configs:
                if not why and label in ("fp32", "bf16"):
                    max_batch.append({"genes": genes, **largest_batch(ctx, pd_, net0, precision)})
    ooms = [r for r in rows if r.get("oom")]
    errors = [
        f"{r['size']} batch {r['batch']} {r['label']}: {r['error']}" for r in rows if "error" in r
    ]
    measured = len(rows) - len(ooms) - len(errors)
    reason = (
        f"{measured} of {len(rows)} configurations measured"
        + (f", {len(ooms)} out of memory" if ooms else "")
        + "".join(f"; FAILED {e}" for e in errors)
        + "".join(f"; {k} skipped: {v}" for k, v in skipped.items())
        + ("" if ctx.device == "cuda" else "; peak memory and largest batch: CUDA only")
    )
    blocks, steps = (2, 3) if ctx.args.quick else (5, 20)
    return result(
        "fail" if errors else "pass" if measured else "skip",
        reason,
        rows=rows,
        params=params,
        largest_batch=max_batch,
        timing=f"median of {blocks} synchronised blocks of {steps} warm steps after a warm-up",
    )


def format_row(r: dict) -> str:
    head = f"{r['size']:<7}{r['genes']:>6} genes  batch {r['batch']:>4}  {r['label']:<10}"
    if r.get("oom") or "error" in r:
        return head + ("out of memory" if r.get("oom") else f"FAILED {r['error']}")
    peak = f"{r['peak_mb']:>8.0f} MB peak" if "peak_mb" in r else ""
    return (
        head + f"{r['cells_per_s']:>10.0f} cells/s  bound {r['bound_cells_per_s']:>10.0f}  "
        f"x {r['x_bound']:.2f}  {r['step_ms']:>7.2f} ms/step{peak}"
    )


# ------------------------------------------------------------------------------ 5. cell-gears
def check_cell_gears(ctx) -> dict:
    if not ctx.args.with_cell_gears:
        return result("skip", "not asked (--with-cell-gears)")
    from bench_train import build_net, cell_gears_throughput, engine_runner
    from vs_cell_gears import parse_args as vs_args

    python = Path(ctx.args.cell_gears_python or Path(vs_args([]).venv) / "bin" / "python")
    if not python.exists():
        return result(
            "skip",
            f"no cell-gears environment at {python}: benchmarks/vs_cell_gears.py creates it "
            "(pip install cell-gears==0.1.2, needs the network), or pass --cell-gears-python",
        )
    genes = (QUICK_SIZES if ctx.args.quick else SIZES)["norman"]
    pd_ = screen(ctx, genes)
    device = torch.device(ctx.device)
    steps, repeats = (3, 2) if ctx.args.quick else (20, 5)
    spec = SimpleNamespace(
        batch=32, hidden=64, steps=steps, repeats=repeats, threads=torch.get_num_threads()
    )
    ours = blocks_per_s(
        engine_runner(pd_, build_net(pd_, 64), spec, "random", "fp32", device), device, repeats
    )
    work = ctx.work / "cell_gears"
    work.mkdir(parents=True, exist_ok=True)
    status, theirs = cell_gears_throughput(pd_, spec, work, str(python), ctx.device)
    if theirs is None:
        return result("skip" if status == "not installed" else "fail", f"cell-gears: {status}")
    return result(
        "pass",
        f"cell-gears {status}: {theirs:.0f} cells/s, ours {ours:.0f} (random fp32, batch 32, "
        f"{genes} genes, {ctx.device}): {ours / theirs:.2f}x",
        ours=ours, cell_gears=theirs, ratio=ours / theirs, genes=genes,
    )  # fmt: skip


# ------------------------------------------------------------------------------ 6. projection
def check_projection(ctx) -> dict:
    """DDP efficiency on paper: step t (measured, per GPU, batch fixed per GPU) against a ring
    all-reduce of the fp32 gradients, 2 (N-1)/N x 4 P bytes / bandwidth, without overlap."""
    measured = ctx.results.get("throughput", {})
    rows = [r for r in measured.get("rows", []) if "cells_per_s" in r]
    if not rows:
        return result("skip", "needs the throughput check's step times (run it first)")
    lines = []
    for size, n_params in measured["params"].items():
        for batch in BATCHES:
            same = [r for r in rows if r["size"] == size and r["batch"] == batch]
            if not same:
                continue
            fastest = min(same, key=lambda r: r["step_ms"])  # the least favourable to scaling
            t = fastest["step_ms"] / 1e3
            for link, bandwidth in LINKS.items():
                comm = {n: 2 * (n - 1) / n * 4 * n_params / bandwidth for n in EXPECTED_SPEEDUP}
                eff = {n: t / (t + c) for n, c in comm.items()}
                lines.append(
                    {
                        "size": size, "params": n_params, "batch_per_gpu": batch,
                        "precision": fastest["label"], "step_ms": fastest["step_ms"],
                        "link": link, "allreduce_ms": {n: 1e3 * c for n, c in comm.items()},
                        "efficiency": eff, "speedup": {n: n * e for n, e in eff.items()},
                    }
                )  # fmt: skip
    return result(
        "pass",
        "PROJECTION, not a measurement: per-GPU batch fixed, the fastest measured step of each "
        "size and batch, plus a ring all-reduce of the fp32 gradients at the stated bandwidth, "
        "not overlapped; no latency, host overhead, load imbalance or sync batch-norm traffic "
        "(where allreduce_ms is well under a millisecond these, not bandwidth, decide). Beside "
        "it the expected 1.8x/3.4x/6.2x, itself never measured",
        projection=lines, expected_speedup=EXPECTED_SPEEDUP, assumptions=list(LINKS),
    )  # fmt: skip


# ------------------------------------------------------------------------------ driver
CHECK_FUNCTIONS = {
    "e2e": check_e2e,
    "ddp": check_ddp,
    "restart": check_restart,
    "throughput": check_throughput,
    "cell_gears": check_cell_gears,
    "projection": check_projection,
}


def injected_fault(name: str) -> str | None:
    """Test hook: GEARS_GPU_CHECK_FAULT=<check>:raise|hang[,...] makes that check fail so."""
    for item in os.environ.get("GEARS_GPU_CHECK_FAULT", "").split(","):
        check, _, kind = item.partition(":")
        if check == name:
            return kind
    return None


def run_check(ctx, name: str) -> dict:
    limit = ctx.args.timeout or TIMEOUT_S[name]
    t0 = time.perf_counter()
    try:
        with time_limit(limit):
            fault = injected_fault(name)
            if fault == "raise":
                raise RuntimeError("injected failure (GEARS_GPU_CHECK_FAULT)")
            if fault == "hang":  # a child that never ends: the limit must stop and kill it
                log = ctx.work / "logs" / f"{name}_hang.log"
                run([sys.executable, "-c", "import time; time.sleep(10**6)", log], log)
            out = CHECK_FUNCTIONS[name](ctx)
    except CheckTimeout:
        out = result("fail", f"timed out after {limit:g}s (time limit of the check)")
    except (Exception, SystemExit) as e:
        out = result(
            "fail", f"raised {type(e).__name__}: {str(e)[:500]}",
            traceback=traceback.format_exc()[-4000:],
        )  # fmt: skip
    finally:
        for proc in list(LIVE):
            proc.kill()
        free_gpu()
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def header(args, device: str | None) -> dict:
    from provenance import provenance

    h = {
        **provenance(),
        "command": shlex.join([sys.executable, *sys.argv]),
        "device": device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "quick": args.quick,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if device == "cuda":
        count = torch.cuda.device_count()
        props = torch.cuda.get_device_properties(0)
        h.update(
            gpus=[torch.cuda.get_device_name(i) for i in range(count)],
            gpu_count=count,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            compute_capability=f"{props.major}.{props.minor}",
            cudnn=torch.backends.cudnn.version(),
            native_bf16=torch.cuda.is_bf16_supported(including_emulation=False),
        )
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            h["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired, IndexError):
            h["driver"] = None
    return h


def write_json(path: str | None, doc: dict) -> None:
    if not path:
        return
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def print_details(name: str, r: dict) -> None:
    """The check's own lines under its verdict (what a failed or skipped check has)."""
    if name == "e2e" and "configs" in r:
        seeds = " | ".join(
            f"seed {s}: " + ", ".join(f"{k} {v:.4f}" for k, v in m.items() if v is not None)
            for s, m in r["cpu_seeds"].items()
        )
        accepted = ", ".join(f"{k} [{lo:.4f}, {hi:.4f}]" for k, (lo, hi) in r["interval"].items())
        print(f"  CPU runs {seeds}; accepted ({r['margin']}): {accepted}")
        for label, row in r["configs"].items():
            got = row.get("metrics", {})
            metrics = ", ".join(f"{k} {v:.4f}" for k, v in got.items() if v is not None)
            print(f"  {label:<14}{row['status']:<6}{metrics:<38}{row['reason'][:120]}")
        if "predict" in r:
            print(f"  {'predict.py':<14}{r['predict']['status']:<6}{r['predict']['reason'][:150]}")
    elif name == "ddp":
        for label, row in r.get("variants", {}).items():
            print(f"  {label:<24}{row['status']:<6}{row['reason'][:150]}")
    elif name == "throughput":
        for m in r.get("largest_batch", []):
            print(
                f"  largest batch at {m['genes']} genes, {m['precision']}: fits {m['fits']} "
                f"(peak {m['peak_mb'] or 0:.0f} MB), out of memory at {m['first_oom']}"
                + (" (cap reached)" if m["first_oom"] is None else "")
            )
    elif name == "projection":
        ns = list(EXPECTED_SPEEDUP)
        print(f"  PROJECTION (not measured); expected speed-up {EXPECTED_SPEEDUP} (unmeasured)")
        for p in r.get("projection", []):
            speed = "  ".join(f"{n} GPUs {p['speedup'][n]:.2f}x" for n in ns)
            print(
                f"  {p['size']:<7}{p['params']:>9,} params  batch {p['batch_per_gpu']:>4}/GPU "
                f"{p['precision']:<10}step {p['step_ms']:>8.2f} ms  {p['link']:<30}"
                f"all-reduce {p['allreduce_ms'][ns[-1]]:.3f} ms at {ns[-1]}  {speed}"
            )


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    device = "cpu" if args.device == "cpu" else "cuda" if cuda else None
    doc = {"header": header(args, device), "checks": []}
    print(f"gpu_check: {doc['header']['command']}")
    print(json.dumps({k: v for k, v in doc["header"].items() if k != "command"}))
    if device is None:
        why = (
            f"no CUDA device visible (torch {torch.__version__}, cuda {torch.version.cuda}); "
            "run on a GPU machine, or with --device cpu to try the harness on the CPU"
        )
        print(f"gpu_check: {why}; nothing checked")
        doc["checks"] = [{"name": c, **result("skip", why)} for c in args.only]
        doc["ok"] = True
        write_json(args.json, doc)
        return 0
    if device == "cuda":
        from gears.runtime import tune_allocator

        tune_allocator()
    signal.signal(signal.SIGTERM, on_sigterm)
    work = Path(args.work or tempfile.mkdtemp(prefix="gears_gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"work folder (runs and logs): {work}", flush=True)
    ctx = SimpleNamespace(
        args=args, device=device, work=work, results={}, screens={},
        gpus=torch.cuda.device_count() if device == "cuda" else 0,
        native_bf16=bool(doc["header"].get("native_bf16", True)),
    )  # fmt: skip
    entries = {c: {"name": c, **result("pending", "not started")} for c in args.only}
    doc["checks"] = list(entries.values())
    for name in args.only:
        entries[name].update(status="running", reason="started")
        write_json(args.json, doc)
        print(f"\n[{name}] running (limit {args.timeout or TIMEOUT_S[name]:g}s)", flush=True)
        try:
            r = run_check(ctx, name)
        except (Stopped, KeyboardInterrupt) as e:
            entries[name].update(status="fail", reason=f"{e or 'interrupted'} during this check")
            write_json(args.json, doc)
            print(f"[{name}] {entries[name]['reason']}; children killed", flush=True)
            return 130
        ctx.results[name] = r
        entries[name].clear()
        entries[name].update(name=name, **r)
        print(f"[{name}] {r['status'].upper()} in {r['seconds']:.0f}s: {r['reason']}", flush=True)
        try:
            print_details(name, r)
        except Exception as e:  # the JSON holds everything; the screen must not stop the run
            print(f"  (details not printed: {type(e).__name__}: {e})")
        write_json(args.json, doc)
    ok = all(e["status"] != "fail" for e in doc["checks"])
    doc["ok"] = ok
    doc["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    write_json(args.json, doc)
    print(f"\n{'check':<12}{'status':<8}{'seconds':>8}  why")
    for e in doc["checks"]:
        print(f"{e['name']:<12}{e['status']:<8}{e.get('seconds', 0):>8.0f}  {e['reason'][:200]}")
    print("\nno check failed" if ok else "\nSOME CHECKS FAILED (see above and the logs)")
    if args.json:
        print(f"results written to {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
