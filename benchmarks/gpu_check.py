"""GPU check: what only a CUDA machine can verify, in two stages that stop at 5 minutes each.

    python benchmarks/gpu_check.py --stage correctness --out DIR    # budget: 5 min on one H100
    python benchmarks/gpu_check.py --stage speed --out DIR          # budget: 4 min on one H100
    python benchmarks/gpu_check.py --stage correctness --device cpu --quick   # the CPU twin
    python benchmarks/gpu_check.py --stage speed --device cpu --quick --only screen,speed_b32

No GPU has run this file yet. Its CPU twin (--device cpu) runs the same checks through the same
entry points on the CPU, device runs under the device-memory stand-in (GEARS_DEVICE_STANDIN=1);
tests/test_benchmarks.py runs it. docs/gpus_and_clusters.md has the recipe for a lent GPU.

Stage correctness: its checks run side by side (each in its own processes). Budget: the seconds
a check is expected to take on one H100 (16 cores); limit: when it is killed.
  train    budget 150 s, limit 240 s. train_single.py on the GPU in fp32 (train.tf32=false and
           true), bf16, fp16 and bf16 + train.compile=true, beside CPU runs of the same config
           with seeds 1..n (n = 5; 3 with --quick; 2 on the CPU), all at once; then predict.py
           on the GPU fp32 model. A GPU run passes when it exits 0, writes every output
           (config.yaml, metrics.json, model/, checkpoints/, plots/), allocated CUDA memory
           (torch.cuda.max_memory_allocated in its own process), its test mse_de and
           pearson_delta lie in the CPU seeds' spread [min - 2 r, max + 2 r] (r = max - min:
           the GPU's numerics act like another seed; a defect-free GPU fails one of the 5 x 2
           comparisons with at most ~5% at n = 5), it beats the no_change baseline on every
           metric of SCORED on which every CPU seed beats it, and it skipped no optimizer step
           (fp16: GradScaler skips at most max(10, 5% of the steps), counted from metrics.json).
  ddp      budget 60 s, limit 120 s. N ranks x batch b == 1 process x batch N*b (the protocol
           of tests/test_ddp.py): SGD, no clipping, fp32 without TF32, 2 steps, synchronised
           batch-norm, batches of whole perturbation groups. 2 ranks sharing one GPU over gloo;
           NCCL over min(GPUs, 8) ranks when 2+ GPUs are visible. Saved weights agree within
           atol 1e-4 + rtol 1e-4 (CPU noise through this harness: 2.6e-6; unsynchronised
           batch-norm statistics: 0.05-0.12). One more gloo row with the planned step
           (train.cuda_graphs=true, replayed as CUDA graphs on a GPU), frozen instead of
           synchronised batch-norm (which stays eager), both runs planned: the same equality,
           and neither run may fall back to eager steps.
  restart  budget 90 s, limit 180 s. torchrun --max-restarts=1 with rank 1 SIGKILLed inside
           epoch 2 (GEARS_FAULT_KILL): the log says "resumed from" the epoch-1 checkpoint and
           the final weights equal an uninterrupted run's bit for bit (GEARS_DETERMINISTIC=1).
  no_sync  budget 45 s, limit 120 s. Steady-state training steps (Trainer.train_step) in every
           precision and every row layout (equal counts, repeated, per-cell, weighted) under a
           watch that lists every op on a device tensor that makes the host wait for the device
           (_local_scalar_dense, nonzero, masked_select, unique, boolean-mask indexing,
           repeat_interleave without output_size, ...), and on CUDA
           torch.cuda.set_sync_debug_mode("warn"); also the planned step's function
           (train.cuda_graphs, called without the capture) in fp32 and bf16. Passes when there
           is none.
Stage speed: one check at a time (they time the GPU).
  screen      budget 75 s, limit 150 s. A Norman-size screen with Norman's mix of conditions
              (5,000 genes, 105 single and 131 double perturbations, 100-300 cells each, 5,000
              control cells; gears/data/synthetic.py's simulator, norman_mix_h5ad), split and
              graphs in the memory-mapped store the next checks open; its composition and the
              distinct perturbations per batch.
  speed_b32   budget 75 s, limit 150 s. Training cells/s at batch 32: the engine eager in fp32
              and bf16 and compiled (train.compile) in bf16, and the planned step replayed as
              CUDA graphs (train.cuda_graphs, gears/train/graph_step.py) in fp32, bf16 and compiled
              bf16, beside bench_train's bare per-cell layers bound in fp32 and bf16, timed
              alike on the same device: one warm-up call each (compiling and capturing, timed),
              then the median of interleaved blocks of steps, each between device
              synchronisations. Per engine row also (CUDA) one block under torch.profiler (host ms,
              summed kernel ms and kernels per step), whether graphs were captured, peak
              memory; graphs vs eager (step ms, cells/s) and the largest parameter difference
              of the two fp32 steps after 20 steps from the same start. The CPU twin times
              eager fp32 and bf16 and graphs fp32 (the planned step, not captured).
  speed_b256  budget 90 s, limit 150 s. The same at batch 256.
  Targets (TARGETS), for the step replayed as CUDA graphs ("graphs ..." rows): at least 20,000
  cells/s at batch 32 and 100,000 at batch 256, and no slower than the eager row of the same
  precision; every engine row also against 0.8 of the bound (CPU: reported only).
Each stage also stops at --stage-limit (300 s): a check still running then is killed, one not
yet started fails. The CPU twin gives every check the largest limit, 240 s (a shared 2-core
machine is far slower than the GPU host's 16 cores).

Exit status: 0 when every check passed and every target was met; 1 when a check failed or a
target was missed; 2 without CUDA (with --device cuda, the default) or for bad arguments; 130
or 143 when stopped by SIGINT or SIGTERM. The JSON (--json FILE; with --out DIR also
DIR/gpu_check_<stage>.json and the logs in DIR/gpu_check_<stage>_logs.tar.gz) is rewritten
after every check: ok, exit_status, failed (one line per failed check or missed target),
checks (name, status pass/fail/skip, reason, seconds, budget_s, limit_s, details), targets
(speed), header (machine, torch, GPU).

Children die with the harness: each carries GEARS_GPU_CHECK_TAG=<run>:<check> in its
environment, which its own children (torchrun's workers in their sessions, mp.spawn's ranks)
inherit; a check past its limit, SIGTERM, SIGINT and the harness's exit kill every process
with the tag, and a watchdog process started first does the same when the harness itself is
killed (it waits for the harness's end of a pipe to close).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import traceback
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

STAGES = {
    # check: (budget_s on one H100, limit_s)
    "correctness": {
        "train": (150, 240),
        "ddp": (60, 120),
        "restart": (90, 180),
        "no_sync": (45, 120),
    },
    "speed": {"screen": (75, 150), "speed_b32": (75, 150), "speed_b256": (90, 150)},
}
PARALLEL = {"correctness": True, "speed": False}
STAGE_LIMIT_S = 300
CPU_TWIN_LIMIT_S = 240  # every check's limit on the CPU twin (a 2-core machine, not the GPU host)
TARGETS = {32: 20_000, 256: 100_000}  # replayed-step cells/s at batch 32 and 256
MIN_X_BOUND = 0.8  # engine cells/s over the bare per-cell bound of the same precision
TAG_ENV = "GEARS_GPU_CHECK_TAG"
FAULT_ENV = "GEARS_GPU_CHECK_FAULT"  # test hook: <check>:raise|hang[,...]

# ---- train
E2E_METRICS = ("mse_de", "pearson_delta")  # compared with the CPU seeds' spread
SCORED = {
    "mse": "lower",
    "mse_de": "lower",
    "pearson_delta": "higher",
    "pearson_delta_de": "higher",
}
SPREAD_MARGIN = 2.0
FP16_SKIPS = (10, 0.05)  # at most max(10, 5% of the steps) skipped by GradScaler
# (label, train.precision, train.tf32, train.compile)
DEVICE_RUNS = (
    ("fp32", "fp32", False, False),
    ("fp32+tf32", "fp32", True, False),
    ("bf16", "bf16", False, False),
    ("fp16", "fp16", False, False),
    ("bf16+compile", "bf16", False, True),
)
# The tests' TINY screen (tests/helpers.py) for --quick, restart and no_sync's small runs, and
# one with a single group of 4 cells per condition, control included (ddp).
TINY_SCREEN = (
    "{n_genes: 60, n_single: 16, n_double: 12, cells_per_condition: 16, "
    "n_control_cells: 128, n_modules: 4}"
)
DDP_SCREEN = (
    "{n_genes: 120, n_single: 60, n_double: 50, cells_per_condition: 4, n_control_cells: 4, "
    "n_modules: 6}"
)
DDP_TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}
PER_RANK_BATCH = 8  # 2 groups of 4 cells
# ---- no_sync: random batches of 32 from ~80 conditions take per-cell rows, of 128 weighted
# rows, grouped ones equal counts (Trainer.row_layout).
NO_SYNC_SCREEN = dict(
    n_genes=200, n_single=50, n_double=40, cells_per_condition=24, n_control_cells=200, n_modules=6
)
NO_SYNC_LAYOUTS = (("random", 32), ("random", 128), ("grouped", 32))
# ---- speed: Norman et al. 2019's mix of conditions; the simulator makes `distinct` cells per
# condition (its analytic ground truth costs conditions x genes) and each condition is then
# drawn to 100-300 cells from them: throughput does not depend on the cells' values.
NORMAN_MIX = dict(genes=5000, singles=105, doubles=131, cells=(100, 300), controls=5000, distinct=8)
QUICK_MIX = dict(genes=300, singles=105, doubles=131, cells=(10, 30), controls=500, distinct=8)
# (label, train.precision, train.compile)
# (label, precision, train.compile, train.cuda_graphs): eager steps, and the planned step
# (gears/train/graph_step.py) replayed as CUDA graphs (on the CPU twin: the same step, not
# captured).
ENGINE_CONFIGS = (("eager fp32", "fp32", False, False), ("eager bf16", "bf16", False, False))
ENGINE_CONFIGS += (("compiled bf16", "bf16", True, False),)
ENGINE_CONFIGS += (("graphs fp32", "fp32", False, True), ("graphs bf16", "bf16", False, True))
ENGINE_CONFIGS += (("graphs+compiled bf16", "bf16", True, True),)
# The CPU twin times these (each planned configuration costs a dense 5,000 x 5,000 product a
# step on the CPU); the rest run on a GPU only.
CPU_CONFIGS = ("eager fp32", "eager bf16", "graphs fp32")
# The planned step against the eager one from the same start: parameters after this many steps.
AGREEMENT_STEPS = 20
TOP_KERNELS = 15  # the speed rows' kernels by device time, in the JSON
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK")
LAUNCH_PREFIXES = ("SLURM_", "TORCHELASTIC_", "GEARS_FAULT", "TORCH_DISABLE_SHARE")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", choices=tuple(STAGES), required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the CPU twin")
    p.add_argument("--quick", action="store_true", help="small sizes and few steps")
    p.add_argument("--only", help="comma-separated checks of the stage")
    p.add_argument("--json", metavar="FILE", help="write the results here (after every check)")
    p.add_argument("--out", metavar="DIR", help="DIR/gpu_check_<stage>.json and its logs")
    p.add_argument("--work", help="run folders and logs (default: a new temp folder)")
    p.add_argument("--timeout", type=float, help="seconds per check, replacing every limit")
    p.add_argument("--stage-limit", type=float, default=STAGE_LIMIT_S, help="seconds per stage")
    p.add_argument("--cpu-seeds", type=int, help="train: CPU runs (5; --quick 3; --device cpu 2)")
    args = p.parse_args(argv)
    checks = STAGES[args.stage]
    args.only = [c.strip() for c in args.only.split(",")] if args.only else list(checks)
    unknown = [c for c in args.only if c not in checks]
    if unknown:
        p.error(f"--only: {unknown} not in stage {args.stage} ({', '.join(checks)})")
    if args.cpu_seeds is not None and args.cpu_seeds < 2:
        p.error("--cpu-seeds must be >= 2 (a spread needs two runs)")
    if args.timeout is not None and not 0 < args.timeout <= 240:
        p.error("--timeout must be in (0, 240] seconds")
    return args


# ============================================================================ processes
def tagged_pids(tag: str, whole_run: bool = False) -> list[int]:
    """Processes whose environment has TAG_ENV=tag (whole_run: any check of the run `tag`)."""
    exact = f"{TAG_ENV}={tag}".encode()
    prefix = exact + b":"
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                variables = f.read().split(b"\0")
        except OSError:  # gone, or not ours
            continue
        if any(v == exact or (whole_run and v.startswith(prefix)) for v in variables):
            found.append(int(entry.name))
    return found


def sweep(tag: str, whole_run: bool = False) -> int:
    """SIGKILL every process carrying the tag until none is left (a dying parent may still be
    starting children); -> how many were killed. Killed children of this process are reaped by
    their Popen; a zombie has no environment, so it is not found again."""
    killed: set[int] = set()
    for _ in range(50):
        pids = tagged_pids(tag, whole_run)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
        time.sleep(0.05)
    return len(killed)


def watchdog_main(run_id: str) -> None:
    """--watchdog RUN: wait until the harness's end of stdin closes (it exited or was killed),
    then kill every process of the run. Runs in a session of its own, ignoring the terminal's
    signals, so what kills the harness does not kill it first."""
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    sys.stdin.buffer.read()
    for _ in range(5):  # children still starting when the harness died
        sweep(run_id, whole_run=True)
        time.sleep(0.2)


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without launcher variables (a run must not think it is a rank)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCH_VARS and not k.startswith(LAUNCH_PREFIXES) and k != TAG_ENV
    }
    return {**env, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", **extra}


class CheckTimeout(BaseException):
    """The check's limit passed and its processes were killed (not an Exception: no `except
    Exception` in a check swallows it)."""


class Stopped(BaseException):
    """SIGTERM, SIGINT or SIGHUP: the harness stops, killing every child."""


class Proc:
    """A command in the background, stdout and stderr in one log file, in its own session."""

    def __init__(self, run: CheckRun, cmd: list, log: Path, env: dict[str, str]):
        self.run, self.cmd, self.log, self.rc = run, [str(c) for c in cmd], log, None
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as f:
            f.write(f"$ {shlex.join(self.cmd)}\n")
            f.flush()
            self.p = subprocess.Popen(
                self.cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip

    def wait(self) -> Proc:
        self.rc = self.p.wait()
        if self.run.timed_out.is_set():
            raise CheckTimeout(f"{self.run.name}: killed at its limit")
        return self

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def why(self) -> str:
        tail = " | ".join(ln for ln in self.text().splitlines()[-6:] if ln.strip())
        return f"exit {self.rc} (log {self.log.name}): ...{tail[-600:]}"


class CheckRun:
    """One check's processes: all carry the check's tag, so they are killed together."""

    def __init__(self, ctx, name: str, limit: float):
        self.ctx, self.name, self.limit = ctx, name, limit
        self.tag = f"{ctx.run_id}:{name}"
        self.timed_out = threading.Event()
        self.folder = ctx.work / name
        self.folder.mkdir(parents=True, exist_ok=True)

    def env(self, **extra: str) -> dict[str, str]:
        env = clean_env(**{TAG_ENV: self.tag}, **extra)
        if self.ctx.device == "cpu":  # 2-core CI: many small processes, one thread each
            env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("NUMBA_NUM_THREADS", "2")  # scanpy's DE in many processes at once
        return env

    def start(self, cmd: list, log: str, env: dict[str, str] | None = None) -> Proc:
        return Proc(self, cmd, self.ctx.work / "logs" / f"{log}.log", env or self.env())

    def run(self, cmd: list, log: str, env: dict[str, str] | None = None) -> Proc:
        return self.start(cmd, log, env).wait()

    def child(self, spec: dict, log: str, env: dict[str, str] | None = None) -> Proc:
        """This file in child mode (--child SPEC): see child_main."""
        return self.start([sys.executable, __file__, "--child", json.dumps(spec)], log, env)


def result(status: str, reason: str, **details) -> dict:
    return {"status": status, "reason": reason, **details}


def injected_fault(run: CheckRun) -> None:
    """Test hook (FAULT_ENV=<check>:raise|hang): the check raises, or waits on a child that
    never ends and has a grandchild in a session of its own (as torchrun's workers)."""
    for item in os.environ.get(FAULT_ENV, "").split(","):
        check, _, kind = item.partition(":")
        if check != run.name:
            continue
        if kind == "raise":
            raise RuntimeError(f"injected failure ({FAULT_ENV})")
        if kind == "hang":
            grandchild = (
                "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                "'import time; time.sleep(10**6)'], start_new_session=True); time.sleep(10**6)"
            )
            run.run([sys.executable, "-c", grandchild], f"{run.name}_hang")


# ============================================================= host-sync watch
# Which ops make the host wait is opcount's (sync_kind; its SyncGuard refuses them in the
# training-step tests, tests/test_ops.py): this watch lists those that read a device tensor.


def sync_reason(func, args: tuple, kwargs: dict) -> str | None:
    """Why this aten op makes the host wait for the device (opcount.sync_kind: a value
    read, an output size that is data, a copy to the host), or None; only when it reads a
    device tensor (CUDA's, or the stand-in's): on the host nothing waits."""
    from opcount import sync_kind, tensors_in

    from gears.device import DeviceTensor

    why = sync_kind(func, args, kwargs)
    if why is None:
        return None
    on_device = [t for t in tensors_in((args, kwargs)) if t.is_cuda or isinstance(t, DeviceTensor)]
    return why if on_device else None


def _project_call_site() -> str:
    """The innermost line of the project's code (opcount.project_line: not an installed
    package's, even with the virtual environment inside the clone as .ci/run's is), not this
    file's and not the stand-in's."""
    from opcount import project_line

    return project_line(skip=(__file__, ROOT / "gears" / "device.py"))


@contextlib.contextmanager
def watch_host_syncs():
    """Yields a list that collects "<op> at <file:line>" for every op in the block that makes
    the host wait for a device tensor (sync_reason); the ops still run."""
    import torch

    from gears.device import DeviceTensor
    from gears.torch_compat import dispatch_mode_base

    found: list[str] = []

    def plain(tree):
        """The stand-in's device tensors as plain ones (the same memory): the op runs as it
        would unwatched, where the stand-in's torch-function layer wraps its outputs."""
        if isinstance(tree, DeviceTensor):
            return tree.as_subclass(torch.Tensor)
        if isinstance(tree, (list, tuple)):
            return type(tree)(plain(x) for x in tree)
        if isinstance(tree, dict):
            return {k: plain(v) for k, v in tree.items()}
        return tree

    class Watch(dispatch_mode_base()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            why = sync_reason(func, args, kwargs)
            if why:
                found.append(f"{why} at {_project_call_site()}")
            return func(*plain(args), **plain(kwargs))

    with Watch():
        yield found


# ====================================================================== child processes
def child_main(spec: dict) -> int:
    """--child SPEC: one piece of a check in its own process (SPEC's "kind")."""
    kind = spec["kind"]
    if kind == "run":
        return child_run(spec)
    out = {"screen": child_screen, "speed": child_speed, "no_sync": child_no_sync}[kind](spec)
    write_json(spec["out"], out)
    return 0


def cuda_probe() -> dict:
    """What this process did on CUDA: peak memory allocated over every device."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {"cuda_initialized": False, "max_memory_allocated": 0}
    devices = range(torch.cuda.device_count())
    return {
        "cuda_initialized": True,
        "max_memory_allocated": sum(torch.cuda.max_memory_allocated(d) for d in devices),
        "device": torch.cuda.get_device_name(torch.cuda.current_device()),
    }


def child_run(spec: dict) -> int:
    """train_single.py or predict.py's main in this process, then the CUDA probe (the run's own
    evidence that it used the GPU) written to spec["probe"]."""
    import importlib

    from gears.cli.job import guarded

    module = importlib.import_module(spec["script"])
    code = 0
    try:
        guarded(lambda: module.main(spec["argv"]))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        write_json(spec["probe"], cuda_probe())
    return code


def norman_mix_h5ad(mix: dict, data_dir: Path) -> tuple[Path, Path]:
    """A screen with Norman's mix of conditions (NORMAN_MIX) as an .h5ad and its gene2go file.
    The simulator's library sizes leave ~70% of the matrix non-zero; values below the 75th
    percentile are dropped (~18% non-zero: 4x less to process and store; training reads the
    matrix dense either way)."""
    import anndata
    import numpy as np
    import pandas as pd

    from gears.data.conditions import CTRL
    from gears.data.synthetic import make_synthetic, write_gene2go_tsv

    screen = make_synthetic(
        n_genes=mix["genes"], n_single=mix["singles"], n_double=mix["doubles"],
        cells_per_condition=mix["distinct"], n_control_cells=mix["distinct"] * 40,
        n_modules=max(2, min(12, mix["genes"] // 20)), seed=0,
    )  # fmt: skip
    distinct = screen.adata.X.copy()
    distinct.data[distinct.data < np.quantile(distinct.data, 0.75)] = 0
    distinct.eliminate_zeros()
    condition = screen.adata.obs["condition"].astype(str).to_numpy()
    rng = np.random.default_rng(1)
    rows = []
    for name in sorted(set(condition)):
        cells = np.flatnonzero(condition == name)
        n = mix["controls"] if name == CTRL else rng.integers(mix["cells"][0], mix["cells"][1] + 1)
        rows.append(rng.choice(cells, n, replace=True))
    rows = rng.permutation(np.concatenate(rows))
    adata = anndata.AnnData(
        X=distinct[rows],
        obs=pd.DataFrame(
            {"condition": condition[rows]}, index=[f"cell{i:07d}" for i in range(len(rows))]
        ),
        var=screen.adata.var.copy(),
    )
    data_dir.mkdir(parents=True, exist_ok=True)
    adata.write_h5ad(data_dir / "norman_mix.h5ad")
    gene2go = write_gene2go_tsv(screen.gene2go, data_dir / "gene2go.tsv.gz")
    return data_dir / "norman_mix.h5ad", gene2go


def open_norman_mix(data_dir: Path):
    """PertData of the screen norman_mix_h5ad wrote, through the memory-mapped store (built by
    the first call, opened by the next; docs/large_screens.md), split and both graphs (cached
    in the store)."""
    from gears.data.pertdata import PertData

    pert_data = PertData(
        data_dir, gene2go=str(data_dir / "gene2go.tsv.gz"), store="mmap", verbose=False
    )
    pert_data.load(data_path=data_dir / "norman_mix.h5ad")
    pert_data.prepare_split("simulation", seed=1)
    pert_data.go_graph()
    pert_data.coexpress_graph()
    return pert_data


def distinct_per_batch(pert_data, batch: int, batches: int = 20) -> float:
    import numpy as np

    loader = pert_data.get_dataloader(batch, 128)["train_loader"]
    loader.set_epoch(1)
    distinct = [len(b.uniq_cond) for _, b in zip(range(batches), loader)]
    return float(np.mean(distinct))


def child_screen(spec: dict) -> dict:
    import numpy as np

    data_dir = Path(spec["data_dir"])
    t0 = time.perf_counter()
    norman_mix_h5ad(spec["mix"], data_dir)
    written = time.perf_counter()
    pert_data = open_norman_mix(data_dir)
    stored = time.perf_counter()
    open_norman_mix(data_dir)  # what each speed check does
    opened = time.perf_counter()
    obs = pert_data.adata.obs["condition"].astype(str)
    counts = obs.value_counts()
    perturbed = counts[counts.index != "ctrl"]
    return {
        "genes": int(pert_data.n_genes),
        "singles": int(sum("+ctrl" in c for c in perturbed.index)),
        "doubles": int(sum("+ctrl" not in c for c in perturbed.index)),
        "cells": int(len(obs)),
        "control_cells": int(counts.get("ctrl", 0)),
        "cells_per_condition": {
            "min": int(perturbed.min()),
            "median": float(np.median(perturbed)),
            "max": int(perturbed.max()),
        },
        "train_examples": int(len(pert_data.example_set("train"))),
        "train_conditions": len(pert_data.set2conditions["train"]),
        "distinct_per_batch": {b: distinct_per_batch(pert_data, b) for b in TARGETS},
        "simulate_s": round(written - t0, 1),
        "store_s": round(stored - written, 1),
        "open_s": round(opened - stored, 1),
    }


def engine_runner(
    pert_data, net0, batch: int, steps: int, precision: str, compiled: bool, device, graphs=False
):
    """A closure running Trainer.train_epoch over `steps` random batches (the loader keeps the
    matrix on the GPU when it fits, as train_single.py does) -> the cells trained; its Trainer
    is the closure's `trainer`. graphs: train.cuda_graphs."""
    import copy
    import itertools

    from gears.config import ModelConfig, TrainConfig
    from gears.train.distributed import DistEnv
    from gears.train.engine import Trainer

    cfg = TrainConfig(
        epochs=1,
        batch_size=batch,
        precision=precision,
        compile=compiled,
        limit_batches=steps,
        cuda_graphs=graphs,
    )
    trainer = Trainer(
        copy.deepcopy(net0), pert_data, cfg, ModelConfig(hidden_size=64), DistEnv(device=device)
    )
    loader = pert_data.get_dataloader(batch, 128, device=device, pin_memory=device.type == "cuda")[
        "train_loader"
    ]
    if len(loader) < steps:
        raise RuntimeError(f"only {len(loader)} batches of {batch} per epoch; {steps} needed")
    epochs = itertools.count(1)

    def run() -> int:
        return trainer.train_epoch(loader, next(epochs), progress=False)[1]

    run.trainer, run.loader = trainer, loader
    return run


def epoch_setup_s(run, sync) -> float:
    """What an epoch costs before its first step, which a timed block of a few steps pays
    once: the loader's new order and, for the planned step, the epoch's plan laid out and
    uploaded (EpochPlan.set_epoch, over every batch of the epoch). Median of 3, synchronised."""
    trainer, loader = run.trainer, run.loader
    times = []
    for epoch in (101, 102, 103):
        sync()
        t0 = time.perf_counter()
        loader.set_epoch(epoch)
        if trainer.runner is not None:
            trainer.runner.plan.set_epoch(epoch)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def profile_block(run, steps: int, cuda: bool, sync) -> dict:
    """One block of `steps` steps under torch.profiler: the host's wall time per step (with the
    profiler's own overhead), the summed device kernel time per step and kernels per step (0 on
    the CPU, which has no kernels apart from the host)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        run()
        sync()
    wall = time.perf_counter() - t0
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    kernel_us = sum(getattr(e, "device_time_total", 0.0) for e in kernels)
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:120], []).append(getattr(e, "device_time_total", 0.0))
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:TOP_KERNELS]
    return {
        "host_ms_per_step": round(1e3 * wall / steps, 3),
        "kernel_ms_per_step": round(kernel_us / 1e3 / steps, 3),
        "kernels_per_step": round(len(kernels) / steps, 1),
        # where the kernel time goes: name, calls a step, ms a step
        "top_kernels": [
            [name, round(len(t) / steps, 1), round(sum(t) / 1e3 / steps, 4)] for name, t in top
        ],
    }


def planned_agreement(pert_data, net0, batch: int, device) -> dict:
    """The planned step and the eager one, fp32, from the same start over AGREEMENT_STEPS
    batches: the largest parameter (and buffer) difference, and whether graphs were captured."""
    trained = {}
    for graphs in (False, True):
        run = engine_runner(pert_data, net0, batch, AGREEMENT_STEPS, "fp32", False, device, graphs)
        run()
        trained[graphs] = run.trainer
    eager, planned = trained[False].net.state_dict(), trained[True].net.state_dict()
    worst, name, relative = 0.0, "", (0.0, "")
    for key, value in eager.items():
        if value.is_floating_point():
            diff = float((planned[key].double() - value.double()).abs().max())
            if diff > worst:
                worst, name = diff, key
            # (relative to the tensor's largest magnitude: batch-norm statistics run large)
            scale = max(float(value.double().abs().max()), 1e-12)
            relative = max(relative, (diff / scale, key))
    runner = trained[True].runner
    return {
        "steps": AGREEMENT_STEPS,
        "max_relative_diff": relative[0],
        "worst_relative": relative[1],
        "max_param_diff": worst,
        "worst_param": name,
        "planned": runner is not None,
        "graphs_captured": sorted(runner.graphs) if runner is not None else [],
    }


def child_speed(spec: dict) -> dict:
    """Cells/s of the engine configurations and of the bare bounds at one batch size, timed in
    interleaved blocks between device synchronisations (bench_train's way, on this device)."""
    import torch
    from bench_train import bare_runner, build_net

    from gears.train.runtime import tune_allocator

    device = torch.device(spec["device"])
    tune_allocator()  # as bench_train and train_single.py
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    pert_data = open_norman_mix(Path(spec["data_dir"]))
    net0 = build_net(pert_data, 64)
    batch, steps, repeats = spec["batch"], spec["steps"], spec["repeats"]
    runners, rows = {}, {}
    for precision in ("fp32", "bf16"):
        label = f"bound {precision}"
        runners[label] = bare_runner(pert_data.n_genes, 64, batch, precision, steps, device)
        rows[label] = {"config": label, "kind": "bound", "precision": precision}
    for label, precision, compiled, graphs in ENGINE_CONFIGS:
        if label not in spec["configs"]:
            continue
        runners[label] = engine_runner(
            pert_data, net0, batch, steps, precision, compiled, device, graphs
        )
        rows[label] = {"config": label, "kind": "engine", "precision": precision}
        rows[label].update(compiled=compiled, graphs=graphs)
    for label, run in runners.items():  # warm-up (compiling, for compiled configurations)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        sync()
        t0 = time.perf_counter()
        run()
        sync()
        rows[label]["warmup_s"] = round(time.perf_counter() - t0, 2)
        if cuda:
            rows[label]["peak_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20)
    seconds = {label: [] for label in runners}
    for _ in range(repeats):  # interleaved: a change of clock or load hits every one alike
        for label, run in runners.items():
            sync()
            t0 = time.perf_counter()
            cells = run()
            sync()
            seconds[label].append(time.perf_counter() - t0)
            rows[label]["cells"] = cells
    for label, row in rows.items():
        median = statistics.median(seconds[label])
        cells = row.pop("cells")
        row["cells_per_s"] = round(cells / median, 1)
        row["step_ms"] = round(1e3 * median / steps, 3)
        trainer = getattr(runners[label], "trainer", None)
        if trainer is None:
            continue
        # An engine block is one epoch cut at `steps` steps: it pays the epoch's setup once,
        # which a whole epoch (epoch_steps) spreads over all its steps. The figures judged are
        # a whole epoch's: the steps' time (the block less the setup) plus the setup, once.
        setup = epoch_setup_s(runners[label], sync)
        step = max(median - setup, 0.0) / steps
        epoch_steps = len(runners[label].loader)
        row["block_cells_per_s"], row["block_step_ms"] = row["cells_per_s"], row["step_ms"]
        row["epoch_setup_ms"], row["epoch_steps"] = round(1e3 * setup, 3), epoch_steps
        row["step_ms"] = round(1e3 * step, 3)
        row["cells_per_s"] = round(
            cells / steps * epoch_steps / max(epoch_steps * step + setup, 1e-12), 1
        )
        runner = trainer.runner
        row["planned"] = runner is not None
        row["graphs_captured"] = sorted(runner.graphs) if runner is not None else []
        if not cuda:  # (the CPU profiler's overhead is seconds a step on Norman's screen)
            continue
        try:  # host time against kernel time (a profiler failure costs the figures only)
            row.update(profile_block(runners[label], steps, cuda, sync))
        except Exception as e:  # noqa: BLE001
            row["profile_error"] = f"{type(e).__name__}: {e}"[:300]
    extra = {}
    for precision in ("fp32", "bf16"):
        eager, planned = rows.get(f"eager {precision}"), rows.get(f"graphs {precision}")
        if eager and planned:
            extra[f"graphs_vs_eager_{precision}"] = {
                "step_ms": [planned["step_ms"], eager["step_ms"]],
                "cells_per_s": [planned["cells_per_s"], eager["cells_per_s"]],
                "speedup": round(eager["step_ms"] / max(planned["step_ms"], 1e-9), 2),
            }
    if "graphs fp32" in rows and "eager fp32" in rows:
        extra["agreement"] = planned_agreement(pert_data, net0, batch, device)
    return {
        **extra,
        "batch": batch,
        "steps": steps,
        "repeats": repeats,
        "timing": (
            f"median of {repeats} interleaved blocks of {steps} steps after a warm-up; engine "
            "rows: a whole epoch's rate (epoch_steps steps at step_ms, the block less the "
            "epoch's setup, plus epoch_setup_ms once); block_*: the block as timed"
        ),
        "rows": list(rows.values()),
        **cuda_probe(),
    }


@contextlib.contextmanager
def syncs_into(found: list, device):
    """The block's host syncs (watch_host_syncs) and, on CUDA, the sync debug mode's warnings
    (cuda_sync_warnings), appended to `found` when the block ends."""
    import warnings

    import torch

    with contextlib.ExitStack() as stack:
        caught = stack.enter_context(warnings.catch_warnings(record=True))
        warnings.simplefilter("always")
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
            stack.callback(torch.cuda.set_sync_debug_mode, "default")
        watched = stack.enter_context(watch_host_syncs())
        yield
    found += watched + cuda_sync_warnings(caught)


def cuda_sync_warnings(caught) -> list[str]:
    """The warnings of synchronizing CUDA operations among those recorded (the sync debug
    mode's "warn"), as "CUDA: <message>". Not the notice torch prints the first time the mode
    is switched on in a process ("Synchronization debug mode is a prototype feature..."),
    which named no operation and failed the first row of every run."""
    found = []
    for w in caught:
        text = str(w.message)
        if "synchroniz" in text.lower() and "prototype feature" not in text:
            found.append(f"CUDA: {text}")
    return found


def row_layout_name(layout) -> str:
    from gears.train.engine import CellRows, EqualRows, RepeatRows, WeightedRows

    names = {
        WeightedRows: "weighted rows",
        RepeatRows: "repeated rows",
        CellRows: "per-cell rows",
        EqualRows: "equal counts",
    }
    return names[type(layout)]


def child_no_sync(spec: dict) -> dict:
    """Steady-state Trainer.train_step calls watched for host syncs, per precision and batch
    kind (the batch is moved to the device before the watch: the step is what is checked)."""
    import copy

    import torch

    from gears.compat.api import GEARS
    from gears.config import ModelConfig, TrainConfig
    from gears.data.pertdata import PertData
    from gears.device import HostReadError
    from gears.train.distributed import DistEnv
    from gears.train.engine import Trainer, set_train_mode

    device = torch.device(spec["device"])
    pert_data = PertData(spec["data_dir"], verbose=False)
    pert_data.load("synthetic", synthetic_params=NO_SYNC_SCREEN)
    pert_data.prepare_split("simulation", seed=1)
    torch.manual_seed(0)
    net0 = GEARS(pert_data, device="cpu").model_initialize(hidden_size=32).model
    rows = []
    for precision in spec["precisions"]:
        for batching, batch_size in NO_SYNC_LAYOUTS:
            cfg = TrainConfig(
                batch_size=batch_size, precision=precision, batching=batching, cells_per_group=4
            )
            trainer = Trainer(
                copy.deepcopy(net0), pert_data, cfg, ModelConfig(hidden_size=32),
                DistEnv(device=device),
            )  # fmt: skip
            loader = pert_data.get_dataloader(
                batch_size, 64, batching=batching, cells_per_group=4, device=device,
                pin_memory=device.type == "cuda",
            )["train_loader"]  # fmt: skip
            loader.set_epoch(1)
            set_train_mode(trainer.model, trainer.net, cfg.freeze_batchnorm)
            found, layouts, steps = [], set(), 0
            for i, batch in enumerate(loader):
                if i == 6:
                    break
                layout = trainer.row_layout(batch.counts)
                batch = batch.to(device, non_blocking=True)
                if i < 2:  # warm-up: first allocations, lazy initialisation
                    trainer.train_step(batch, layout, True)
                    continue
                layouts.add(row_layout_name(layout))
                with syncs_into(found, device):
                    try:
                        trainer.train_step(batch, layout, True)
                    except HostReadError as e:
                        found.append(f"host read: {str(e)[:300]}")
                steps += 1
            rows.append(
                {
                    "precision": precision, "batching": batching, "batch": batch_size,
                    "layouts": sorted(layouts), "steps": steps, "syncs": sorted(set(found)),
                }
            )  # fmt: skip
        if precision != "fp16":  # (fp16 keeps eager steps)
            rows.append(planned_no_sync(pert_data, net0, precision, device))
    return {"rows": rows, **cuda_probe()}


def planned_no_sync(pert_data, net0, precision: str, device) -> dict:
    """The planned step (train.cuda_graphs, gears/train/graph_step.py) called eagerly, not captured,
    under the same watch: the step function a CUDA graph would hold makes no host sync."""
    import copy

    from gears.config import ModelConfig, TrainConfig
    from gears.train.distributed import DistEnv
    from gears.train.engine import Trainer, set_train_mode

    cfg = TrainConfig(batch_size=32, precision=precision, cuda_graphs=True)
    trainer = Trainer(
        copy.deepcopy(net0), pert_data, cfg, ModelConfig(hidden_size=32), DistEnv(device=device)
    )
    loader = pert_data.get_dataloader(32, 64, device=device)["train_loader"]
    runner = trainer.step_runner(loader)
    row = {"precision": precision, "batching": "random", "batch": 32, "layouts": []}
    if runner is None:
        return {**row, "steps": 0, "syncs": ["the planned step was refused (see the log)"]}
    runner.capture = False
    set_train_mode(trainer.model, trainer.net, False)
    loader.set_epoch(1)
    runner.plan.set_epoch(1)
    runner.begin_epoch(0)
    found, steps = [], 0
    for i in range(min(6, len(runner.plan))):
        if i < 2:  # warm-up: the first step allocates gradients and optimizer state
            runner.run(i)
            continue
        with syncs_into(found, device):
            runner.run(i)
        steps += 1
    return {**row, "layouts": ["planned step"], "steps": steps, "syncs": sorted(set(found))}


# ============================================================================ helpers
def write_json(path, doc: dict) -> None:
    if not path:
        return
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    os.replace(tmp, path)  # whole or absent, whatever kills the harness


def read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def run_dir_problems(out: Path) -> list[str]:
    """What train_single.py / train_distributed.py failed to write into a run folder."""
    missing = [
        f"missing {name}"
        for name in ("config.yaml", "metrics.json", "model/model.pt", "model/config.json")
        if not (out / name).is_file()
    ]
    if not list((out / "checkpoints").glob("*.pt")):
        missing.append("missing checkpoints/*.pt")
    plots = {p.name for p in (out / "plots").glob("*.png")}
    if "loss.png" not in plots or len(plots) < 2:
        missing.append(f"missing plots/ (loss.png + perturbation plots; found {sorted(plots)})")
    return missing


def saved_weights(out: Path) -> dict:
    from gears.train import checkpoint as ckpt

    return ckpt.load(out / "model" / "model.pt")["state_dict"]


def last_step(out: Path) -> int:
    from gears.train import checkpoint as ckpt

    return ckpt.load(ckpt.list_checkpoints(out / "checkpoints")[-1])["step"]


def compare_weights(a: dict, b: dict, exact: bool = False) -> tuple[bool, float, str]:
    """(equal within DDP_TOLERANCE or bit for bit, max |a - b|, the key where it is largest)."""
    import torch

    if a.keys() != b.keys():
        return False, math.inf, f"keys differ: {sorted(set(a) ^ set(b))[:5]}"
    ok, worst, where = True, 0.0, ""
    for k in a:
        x, y = a[k].float(), b[k].float()
        diff = (x - y).abs().max().item() if x.numel() else 0.0
        if diff > worst:
            worst, where = diff, k
        ok &= torch.equal(a[k], b[k]) if exact else torch.allclose(x, y, **DDP_TOLERANCE)
    return ok, worst, where


def beats(metric: str, model: float | None, baseline: float | None) -> bool:
    if model is None or baseline is None or math.isnan(model) or math.isnan(baseline):
        return False
    return model < baseline if SCORED[metric] == "lower" else model > baseline


def cuda_evidence(run: CheckRun, probe: Path) -> str | None:
    """None when the run's process allocated CUDA memory (or on the CPU twin), else why not."""
    if run.ctx.device != "cuda":
        return None
    got = read_json(probe)
    if got.get("max_memory_allocated", 0) > 0:
        return None
    return (
        f"no CUDA memory allocated by the run ({probe.name}: {got or 'not written'}): not on a GPU"
    )


def single_run(run: CheckRun, out: Path, overrides: list[str], device: str, log: str, env=None):
    """train_single.py (in child_run, which records the CUDA probe) into `out`."""
    argv = [f"device={device}", f"out_dir={out}", f"data.data_dir={out}_data"]
    argv += ["wandb.mode=disabled", *overrides]
    spec = {"kind": "run", "script": "train_single", "argv": argv, "probe": f"{out}.probe.json"}
    return run.child(spec, log, env)


# ================================================================ stage correctness
def device_runs(ctx) -> list[tuple[str, list[str], str | None]]:
    """(label, overrides, why skipped or None) of the train check's device runs."""
    rows = []
    for label, precision, tf32, compiled in DEVICE_RUNS:
        why = None
        if ctx.device == "cpu" and precision == "fp16":
            why = "fp16 needs CUDA (autocast + GradScaler)"
        elif ctx.device == "cpu" and tf32:
            why = "no TF32 on the CPU (train.tf32 only touches CUDA)"
        elif ctx.device == "cpu" and compiled:
            why = "inductor on the CPU builds C++ for minutes (tests/test_compile.py: CPU)"
        elif precision == "bf16" and ctx.device == "cuda" and not ctx.native_bf16:
            why = "bf16 only emulated on this GPU (train.precision=bf16 is refused)"
        over = [f"train.precision={precision}", f"train.tf32={str(tf32).lower()}"]
        rows.append((label, over + (["train.compile=true"] if compiled else []), why))
    return rows


def score_run(run: CheckRun, label: str, proc: Proc, out: Path, interval, cpu_beat) -> dict:
    """The verdict on one device run of the train check."""
    if proc.rc != 0:
        return result("fail", proc.why())
    problems = run_dir_problems(out)
    if problems:
        return result("fail", "; ".join(problems))
    metrics = json.loads((out / "metrics.json").read_text())
    test, no_change = metrics["test"], metrics["baselines"].get("no_change", {})
    skipped = sum(metrics["history"].get("skipped_steps", []))
    steps = last_step(out)
    info = {
        "metrics": {m: test.get(m) for m in SCORED},
        "no_change": {m: no_change.get(m) for m in SCORED},
        "skipped_steps": skipped,
        "steps": steps,
        "cells_per_s": metrics["timing"]["train_cells_per_s"],
        "cuda": read_json(Path(f"{out}.probe.json")),
    }
    bad = [why] if (why := cuda_evidence(run, Path(f"{out}.probe.json"))) else []
    for m in E2E_METRICS:
        lo, hi = interval.get(m, (None, None))
        if lo is None:
            bad.append(f"no CPU spread for {m} (CPU runs failed)")
        elif test.get(m) is None or not lo <= test[m] <= hi:
            bad.append(f"{m} {test.get(m)} outside the CPU spread [{lo:.4f}, {hi:.4f}]")
    bad += [
        f"{m} {test.get(m)} does not beat no_change's {no_change.get(m)} (every CPU seed does)"
        for m in SCORED
        if cpu_beat.get(m) and not beats(m, test.get(m), no_change.get(m))
    ]
    allowed = max(FP16_SKIPS[0], FP16_SKIPS[1] * steps) if "fp16" in label else 0
    if skipped > allowed:
        bad.append(f"{skipped} of {steps} optimizer steps skipped (allowed {allowed:g})")
    if bad:
        return result("fail", "; ".join(bad), **info)
    required = [m for m in SCORED if cpu_beat.get(m)]
    return result(
        "pass",
        f"outputs written, in the CPU spread, beats no_change on {', '.join(required) or '-'}, "
        f"{skipped} skipped steps" + ("" if run.ctx.device == "cpu" else ", on CUDA"),
        run_dir=str(out),
        **info,
    )


def check_train(run: CheckRun) -> dict:
    ctx = run.ctx
    dev, quick = ctx.device, ctx.args.quick
    screen, hidden, epochs = (TINY_SCREEN, 16, 1) if quick else ("{}", 64, 2)
    common = [f"data.synthetic={screen}", f"model.hidden_size={hidden}", f"train.epochs={epochs}"]
    n_seeds = ctx.args.cpu_seeds or (2 if dev == "cpu" else 3 if quick else 5)
    runs = device_runs(ctx)
    on_device = [r for r in runs if r[2] is None]
    threads = 1 if dev == "cpu" else max(1, ((os.cpu_count() or 2) - len(on_device)) // n_seeds)
    refs = {
        seed: single_run(
            run,
            run.folder / f"cpu_seed{seed}",
            [*common, f"seed={seed}", f"train.threads={threads}"],
            "cpu",
            f"train_cpu_seed{seed}",
        )
        for seed in range(1, n_seeds + 1)
    }
    # The CPU twin takes the GPU data path with device tensors that refuse host reads.
    device_env = run.env(**({"GEARS_DEVICE_STANDIN": "1"} if dev == "cpu" else {}))
    procs = {
        label: single_run(
            run,
            run.folder / label.replace("+", "_"),
            [*common, *over, "train.threads=1"],
            dev,
            f"train_{label}",
            device_env,
        )
        for label, over, why in on_device
    }
    configs = {label: result("skip", why) for label, _, why in runs if why}
    predict = result("skip", "the fp32 device run did not finish")
    predict_proc = None
    if "fp32" in procs and procs["fp32"].wait().rc == 0:
        predict_proc = start_predict(run, run.folder / "fp32", device_env)
    ref_metrics, problems, cpu_tests = {}, [], []
    for seed, proc in refs.items():
        out = run.folder / f"cpu_seed{seed}"
        bad = [proc.why()] if proc.wait().rc != 0 else run_dir_problems(out)
        if bad:
            problems.append(f"CPU seed {seed}: {'; '.join(bad)}")
            continue
        metrics = json.loads((out / "metrics.json").read_text())
        ref_metrics[seed] = {m: metrics["test"].get(m) for m in SCORED}
        cpu_tests.append((metrics["test"], metrics["baselines"].get("no_change", {})))
    interval = {}
    for m in E2E_METRICS:
        values = [v[m] for v in ref_metrics.values() if v[m] is not None]
        if len(values) >= 2:
            lo, hi = min(values), max(values)
            interval[m] = (lo - SPREAD_MARGIN * (hi - lo), hi + SPREAD_MARGIN * (hi - lo))
    cpu_beat = {
        m: bool(cpu_tests) and all(beats(m, t.get(m), nc.get(m)) for t, nc in cpu_tests)
        for m in SCORED
    }
    for label, proc in procs.items():
        out = run.folder / label.replace("+", "_")
        configs[label] = score_run(run, label, proc.wait(), out, interval, cpu_beat)
    if predict_proc is not None:
        predict = finish_predict(run, predict_proc)
    failed = [
        f"{label}: {r['reason'][:300]}" for label, r in configs.items() if r["status"] == "fail"
    ]
    failed += [f"predict: {predict['reason'][:300]}"] if predict["status"] == "fail" else []
    failed += [p[:300] for p in problems]
    ran = [label for label, r in configs.items() if r["status"] != "skip"]
    if failed:
        status = "fail"
        reason = "failed: " + "; ".join(failed)
    else:
        status = "pass"
        reason = (
            f"{', '.join(ran)} trained on {dev}: outputs written, test metrics in the spread of "
            f"{n_seeds} CPU seeds and beating no_change where they do; predict.py ran"
        )
    return result(
        status, reason, configs=configs, predict=predict, cpu_seeds=ref_metrics,
        interval={m: list(v) for m, v in interval.items()}, cpu_beats_no_change=cpu_beat,
        margin=f"{SPREAD_MARGIN:g} x range",
    )  # fmt: skip


def start_predict(run: CheckRun, run_dir: Path, env: dict) -> tuple[Proc, Path, Path]:
    info = json.loads((run_dir / "model" / "prediction.json").read_text())
    control = info.get("control_label", "ctrl")
    perts = [c for c in info["condition_spelling"] if c != control][:2]
    out = run.folder / "predict.h5ad"
    argv = ["--model", str(run_dir / "model"), "--perturbations", ",".join(perts)]
    argv += ["--cells-per-perturbation", "20", "--device", run.ctx.device, "--out", str(out)]
    probe = run.folder / "predict.probe.json"
    spec = {"kind": "run", "script": "predict", "argv": argv, "probe": str(probe)}
    return run.child(spec, "train_predict", env), out, probe


def finish_predict(run: CheckRun, started: tuple[Proc, Path, Path]) -> dict:
    import anndata
    import numpy as np

    proc, out, probe = started
    if proc.wait().rc != 0:
        return result("fail", proc.why())
    if not out.is_file():
        return result("fail", f"predict.py exited 0 but wrote no {out.name}")
    if why := cuda_evidence(run, probe):
        return result("fail", why)
    pred = anndata.read_h5ad(out)
    X = pred.X.toarray() if hasattr(pred.X, "toarray") else np.asarray(pred.X)
    if pred.n_obs < 40 or not np.isfinite(X).all():
        return result("fail", f"{out.name}: {pred.n_obs} cells, finite: {np.isfinite(X).all()}")
    return result("pass", f"fp32 model: {pred.n_obs} cells x {pred.n_vars} genes in {out.name}")


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
    "distributed.timeout_s=120",
]


# The planned row (train.cuda_graphs): synchronised batch-norm stays eager, so frozen instead.
DDP_PLANNED = [
    "distributed.sync_batchnorm=false",
    "train.freeze_batchnorm=true",
    "train.cuda_graphs=true",
]


def check_ddp(run: CheckRun) -> dict:
    ctx = run.ctx
    # (label, ranks, backend, device of the ranks, device of the 1-process run, overrides)
    variants = []
    if ctx.device == "cpu":
        variants.append(("gloo, 2 CPU ranks", 2, "gloo", "cpu", "cpu", []))
        variants.append(("gloo, 2 CPU ranks, planned", 2, "gloo", "cpu", "cpu", DDP_PLANNED))
    else:
        variants.append(("gloo, 2 ranks on 1 GPU", 2, "gloo", "cuda", "cuda:0", []))
        variants.append(
            ("gloo, 2 ranks on 1 GPU, CUDA graphs", 2, "gloo", "cuda", "cuda:0", DDP_PLANNED)
        )
        if ctx.gpus >= 2:
            n = min(ctx.gpus, 8)
            variants.append((f"nccl, {n} GPUs", n, "nccl", "cuda", "cuda:0", []))
    rows = {}
    for label, n, backend, device, single_device, extra in variants:
        name = f"{backend}{n}" + ("_planned" if extra else "")
        folder = run.folder / name
        single = folder / "single"
        one = single_run(
            run, single, [*DDP_PROTOCOL, *extra, f"train.batch_size={n * PER_RANK_BATCH}"],
            single_device, f"ddp_{name}_single",
        )  # fmt: skip
        multi = folder / "ranks"
        cmd = [sys.executable, "train_distributed.py", "--nproc", n, f"device={device}"]
        cmd += [f"distributed.backend={backend}", f"out_dir={multi}", "wandb.mode=disabled"]
        cmd += [f"data.data_dir={folder / 'ranks_data'}", *DDP_PROTOCOL, *extra]
        cmd += [f"train.batch_size={PER_RANK_BATCH}"]
        many = run.run(cmd, f"ddp_{name}_ranks")
        bad = [p.why() for p in (one.wait(), many) if p.rc != 0]
        bad += [why] if (why := cuda_evidence(run, Path(f"{single}.probe.json"))) else []
        if extra:  # the planned step, not its eager fallback (one line says why)
            bad += [
                f"{p.log.name}: {ln.strip()}"
                for p in (one, many)
                for ln in p.text().splitlines()
                if "train.cuda_graphs:" in ln
            ]
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


def check_restart(run: CheckRun) -> dict:
    """Kill rank 1 in epoch 2 under torchrun --max-restarts=1; compare with no kill."""
    cuda = run.ctx.device == "cuda"
    backend = "nccl" if cuda and run.ctx.gpus >= 2 else "gloo"
    overrides = [f"device={'cuda' if cuda else 'cpu'}", f"distributed.backend={backend}"]
    overrides += [f"data.synthetic={TINY_SCREEN}", "model.hidden_size=16", "train.epochs=3"]
    overrides += ["train.batch_size=16", "train.checkpoint_every=1", "train.plot_conditions=1"]
    overrides += ["distributed.timeout_s=120", "wandb.mode=disabled"]
    env = {
        "GEARS_DETERMINISTIC": "1",
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        # run_multi_node.sh's setting: a process group per rendezvous (restarted ranks must not
        # find the killed attempt's keys; see tests/test_distributed.py).
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }

    def torchrun(name: str, extra_env: dict, restarts: int) -> Proc:
        out = run.folder / name
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc_per_node=2", f"--max-restarts={restarts}", "train_distributed.py"]
        cmd += [f"out_dir={out}", f"data.data_dir={out}_data", *overrides]
        return run.run(cmd, f"restart_{name}", run.env(**env, **extra_env))

    ref = torchrun("uninterrupted", {}, 0)
    if ref.rc != 0:
        return result("fail", f"uninterrupted run: {ref.why()}")
    per_epoch = last_step(run.folder / "uninterrupted") // 3
    if per_epoch < 2:
        return result("fail", f"{per_epoch} steps per epoch: cannot kill inside epoch 2")
    kill_step = per_epoch + per_epoch // 2 + 1  # optimizer steps count from 1
    killed = torchrun("killed", {"GEARS_FAULT_KILL": f"1:step:{kill_step}"}, 1)
    details = {"backend": backend, "kill_step": kill_step, "steps_per_epoch": per_epoch}
    if killed.rc != 0:
        return result("fail", f"killed run did not finish: {killed.why()}", **details)
    log = killed.text()
    if "resumed from" not in log or "epoch_0001.pt: after epoch 1 (step " not in log:
        return result("fail", f"no 'resumed from ...epoch_0001.pt' in {killed.log.name}", **details)
    same, diff, where = compare_weights(
        saved_weights(run.folder / "killed"), saved_weights(run.folder / "uninterrupted"), True
    )
    why = (
        f"rank 1 SIGKILLed at step {kill_step} (epoch 2, {per_epoch} steps/epoch, {backend}); "
        f"resumed from the epoch-1 checkpoint; final weights vs uninterrupted: "
        + ("bit-identical" if same else f"DIFFER, max |diff| {diff:.2e} at {where}")
    )
    return result("pass" if same else "fail", why, max_abs_diff=diff, **details)


def check_no_sync(run: CheckRun) -> dict:
    ctx = run.ctx
    precisions = ["fp32", "bf16"] + (["fp16"] if ctx.device == "cuda" else [])
    if ctx.device == "cuda" and not ctx.native_bf16:
        precisions.remove("bf16")
    out = run.folder / "no_sync.json"
    spec = {"kind": "no_sync", "device": ctx.device, "precisions": precisions, "out": str(out)}
    spec["data_dir"] = str(run.folder / "data")
    env = run.env(**({"GEARS_DEVICE_STANDIN": "1"} if ctx.device == "cpu" else {}))
    proc = run.child(spec, "no_sync", env).wait()
    if proc.rc != 0:
        return result("fail", proc.why())
    got = read_json(out)
    rows = got["rows"]
    if (why := cuda_evidence(run, out)) or not rows:
        return result("fail", why or "no step was watched", rows=rows)
    syncing = [r for r in rows if r["syncs"] or not r["steps"]]
    where = "; ".join(
        f"{r['precision']} {r['batching']} {r['batch']} ({', '.join(r['layouts'])}): "
        + (" | ".join(r["syncs"][:3]) or "no step")
        for r in syncing
    )
    watched = f"{sum(r['steps'] for r in rows)} steps ({', '.join(precisions)}; " + ", ".join(
        sorted({lay for r in rows for lay in r["layouts"]})
    )
    if syncing:
        return result("fail", f"host syncs in the training step: {where[:1500]}", rows=rows)
    return result("pass", f"{watched}): no op waits for the device", rows=rows)


# ====================================================================== stage speed
def screen_dir(ctx) -> Path:
    """The screen check's data folder: the .h5ad, gene2go and the store the speed checks open."""
    return ctx.work / "screen" / "data"


def check_screen(run: CheckRun) -> dict:
    summary = run.folder / "summary.json"
    mix = QUICK_MIX if run.ctx.args.quick else NORMAN_MIX
    spec = {"kind": "screen", "mix": mix, "data_dir": str(screen_dir(run.ctx)), "out": str(summary)}
    proc = run.child(spec, "screen").wait()
    if proc.rc != 0:
        return result("fail", proc.why())
    got = read_json(summary)
    per, distinct = got["cells_per_condition"], got["distinct_per_batch"]
    return result(
        "pass",
        f"{got['genes']} genes, {got['singles']} singles + {got['doubles']} doubles with "
        f"{per['min']}-{per['max']} cells (median {per['median']:.0f}), {got['control_cells']} "
        f"control cells; {got['train_examples']} training examples; distinct perturbations per "
        "random batch: " + ", ".join(f"{v:.0f} of {b}" for b, v in distinct.items()),
        mix=mix,
        **got,
    )  # fmt: skip


def check_speed(run: CheckRun, batch: int) -> dict:
    ctx = run.ctx
    if ctx.results.get("screen", {}).get("status") != "pass":
        return result("fail", "no screen (the screen check did not pass)")
    configs = [
        label for label, *_ in ENGINE_CONFIGS if ctx.device == "cuda" or label in CPU_CONFIGS
    ]
    if ctx.device == "cuda" and not ctx.native_bf16:
        configs = [c for c in configs if "bf16" not in c]
    steps, repeats = (5, 2) if ctx.args.quick or ctx.device == "cpu" else (20, 5)
    out = run.folder / "speed.json"
    spec = {"kind": "speed", "data_dir": str(screen_dir(ctx)), "batch": batch, "device": ctx.device}
    spec.update(steps=steps, repeats=repeats, configs=configs, out=str(out))
    proc = run.child(spec, f"speed_b{batch}").wait()
    if proc.rc != 0:
        return result("fail", proc.why())
    got = read_json(out)
    if why := cuda_evidence(run, out):
        return result("fail", why, **got)
    skipped = [label for label, *_ in ENGINE_CONFIGS if label not in configs]
    note = (
        f"; {', '.join(skipped)} skipped (CPU twin: inductor builds C++ for minutes, the "
        "planned bf16 step repeats the fp32 one)"
        if skipped
        else ""
    )
    line = ", ".join(f"{r['config']} {r['cells_per_s']:.0f}" for r in got["rows"])
    if "agreement" in got:
        agreement = got["agreement"]
        line += (
            f"; graphs vs eager after {agreement['steps']} steps: max parameter difference "
            f"{agreement['max_param_diff']:.2e} ({agreement['max_relative_diff']:.1e} of the "
            "tensor's largest value)"
        )
    return result("pass", f"batch {batch} cells/s: {line}{note}", **got)


def speed_targets(ctx, checks: dict) -> list[dict]:
    """Each engine row of the speed checks against TARGETS and MIN_X_BOUND (on CUDA)."""
    rows = []
    for name, r in checks.items():
        if not name.startswith("speed_b") or r.get("status") != "pass":
            continue
        batch = r["batch"]
        bounds = {x["precision"]: x["cells_per_s"] for x in r["rows"] if x["kind"] == "bound"}
        for x in r["rows"]:
            if x["kind"] != "engine":
                continue
            bound = bounds[x["precision"]]
            row = {
                "batch": batch, "config": x["config"], "cells_per_s": x["cells_per_s"],
                "target": TARGETS[batch], "bound_cells_per_s": bound,
                "x_bound": round(x["cells_per_s"] / bound, 3), "min_x_bound": MIN_X_BOUND,
            }  # fmt: skip
            misses = []
            graphs = x["config"].startswith("graphs")
            if not graphs:
                row["target"] = None  # eager and compiled rows: the bound only
            elif row["cells_per_s"] < row["target"]:
                misses.append(f"{row['cells_per_s']:,.0f} cells/s < {row['target']:,} target")
            eager = next((e for e in r["rows"] if e["config"] == f"eager {x['precision']}"), None)
            if graphs and eager is not None and x["cells_per_s"] < eager["cells_per_s"]:
                misses.append(
                    f"slower than eager {x['precision']} ({eager['cells_per_s']:,.0f} cells/s)"
                )
            if row["x_bound"] < MIN_X_BOUND:
                misses.append(
                    f"{row['x_bound']:.2f} x the bare bound ({bound:,.0f} cells/s) < {MIN_X_BOUND}"
                )
            if ctx.device != "cuda":
                row["status"], row["why"] = "n/a", "targets are for a GPU; the CPU twin reports"
            else:
                row["status"], row["why"] = ("miss", "; ".join(misses)) if misses else ("met", "")
            rows.append(row)
    return rows


CHECK_FUNCTIONS = {
    "train": check_train,
    "ddp": check_ddp,
    "restart": check_restart,
    "no_sync": check_no_sync,
    "screen": check_screen,
    "speed_b32": lambda run: check_speed(run, 32),
    "speed_b256": lambda run: check_speed(run, 256),
}


# ============================================================================ driver
def header(args, cuda: bool) -> dict:
    import torch
    from provenance import provenance

    h = {
        **provenance(),
        "command": shlex.join([sys.executable, *sys.argv]),
        "stage": args.stage,
        "device": args.device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "quick": args.quick,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if args.device == "cuda" and cuda:
        count = torch.cuda.device_count()
        props = torch.cuda.get_device_properties(0)
        h.update(
            gpus=[torch.cuda.get_device_name(i) for i in range(count)],
            gpu_count=count,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            compute_capability=f"{props.major}.{props.minor}",
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


class Job:
    """A check running in a thread of the harness (its work is in its child processes)."""

    def __init__(self, ctx, name: str, limit: float):
        self.run = CheckRun(ctx, name, limit)
        self.name, self.result = name, None
        self.t0 = time.monotonic()
        self.deadline = min(self.t0 + limit, ctx.stage_deadline)
        self.thread = threading.Thread(target=self.body, name=f"check-{name}", daemon=True)
        self.thread.start()

    def body(self) -> None:
        try:
            injected_fault(self.run)
            out = CHECK_FUNCTIONS[self.name](self.run)
        except CheckTimeout:
            return  # the harness has recorded the timeout
        except BaseException as e:  # a check that raises is a failed check, not a crash
            out = result(
                "fail", f"raised {type(e).__name__}: {str(e)[:500]}",
                traceback=traceback.format_exc()[-4000:],
            )  # fmt: skip
        self.result = out


def finish(ctx, name: str, entry: dict, out: dict, seconds: float) -> None:
    entry.clear()
    entry.update(name=name, **out, seconds=round(seconds, 1), **ctx.limits[name])
    print(f"[{name}] {out['status'].upper()} in {seconds:.0f}s: {out['reason'][:400]}", flush=True)


def run_checks(ctx, doc: dict) -> None:
    """Start the stage's checks (side by side, or one at a time), kill any past its limit or
    the stage's, record each as it ends; the JSON is rewritten after each."""
    entries = {e["name"]: e for e in doc["checks"]}
    pending, running = list(ctx.args.only), {}
    while pending or running:
        while pending and (ctx.parallel or not running):
            name = pending.pop(0)
            if time.monotonic() >= ctx.stage_deadline:
                out = result(
                    "fail", f"not started: the stage's {ctx.args.stage_limit:g}s were spent"
                )
                finish(ctx, name, entries[name], out, 0.0)
                continue
            limit = ctx.limits[name]["limit_s"]
            print(f"[{name}] running (budget {ctx.limits[name]['budget_s']}s, limit {limit:g}s)")
            entries[name].update(status="running", reason="started")
            running[name] = Job(ctx, name, limit)
            write_json(ctx.json_path, doc)
        time.sleep(0.2)
        for name, job in list(running.items()):
            now = time.monotonic()
            if not job.thread.is_alive():
                out = job.result or result("fail", "the check ended without a result")
            elif now >= job.deadline:
                job.run.timed_out.set()
                killed = sweep(job.run.tag)
                job.thread.join(10)
                which = "its limit" if job.deadline < ctx.stage_deadline else "the stage's limit"
                out = result(
                    "fail",
                    f"timed out after {now - job.t0:.0f}s ({which}); {killed} processes killed",
                )
            else:
                continue
            del running[name]
            ctx.results[name] = out
            finish(ctx, name, entries[name], out, time.monotonic() - job.t0)
            write_json(ctx.json_path, doc)


def verdict(ctx, doc: dict) -> int:
    failed = [f"{e['name']}: {e['reason'][:300]}" for e in doc["checks"] if e["status"] == "fail"]
    targets = speed_targets(ctx, ctx.results) if ctx.args.stage == "speed" else []
    missed = [
        f"batch {t['batch']} {t['config']}: {t['why']}" for t in targets if t["status"] == "miss"
    ]
    doc.update(targets=targets, failed=failed + missed, missed_targets=missed)
    doc["ok"] = not failed and not missed
    doc["exit_status"] = 0 if doc["ok"] else 1
    return doc["exit_status"]


def print_summary(doc: dict) -> None:
    print(f"\n{'check':<12}{'status':<8}{'seconds':>8}{'budget':>8}  why")
    for e in doc["checks"]:
        print(
            f"{e['name']:<12}{e['status']:<8}{e.get('seconds', 0):>8.0f}{e.get('budget_s', 0):>8}"
            f"  {e['reason'][:200]}"
        )
    for t in doc.get("targets", []):
        print(
            f"  batch {t['batch']:>4} {t['config']:<14}{t['cells_per_s']:>12,.0f} cells/s "
            f"(target {'bound only' if t['target'] is None else format(t['target'], ',')}), "
            f"x bound {t['x_bound']:.2f} (min {t['min_x_bound']}): "
            f"{t['status']} {t['why']}"
        )
    judged = [t for t in doc.get("targets", []) if t["status"] != "n/a"]
    passed = "every check passed" + (", every target met" if judged else "")
    if doc.get("targets") and not judged:
        passed += " (targets reported, not judged, on the CPU)"
    print(f"\n{passed}" if doc["ok"] else "\nFAILED:")
    for line in doc.get("failed", []):
        print(f"  {line}")


def archive_logs(ctx, path: Path) -> None:
    """The logs (each its last 256 KiB) in one .tar.gz, for a machine whose disk goes away."""
    logs = sorted((ctx.work / "logs").glob("*.log"))
    with tarfile.open(path.with_suffix(".tmp"), "w:gz") as tar:
        for log in logs:
            data = log.read_bytes()[-256 * 1024 :]
            info = tarfile.TarInfo(f"logs/{log.name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    os.replace(path.with_suffix(".tmp"), path)


def on_signal(signum, frame):
    raise Stopped(f"stopped by {signal.Signals(signum).name}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child_main(json.loads(argv[1]))
    if argv[:1] == ["--watchdog"]:
        watchdog_main(argv[1])
        return 0
    args = parse_args(argv)
    import torch

    json_path = args.json
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        json_path = json_path or str(Path(args.out) / f"gpu_check_{args.stage}.json")
    cuda = torch.cuda.is_available()
    doc = {"header": header(args, cuda), "stage": args.stage, "checks": []}
    print(f"gpu_check: {doc['header']['command']}")
    print(json.dumps({k: v for k, v in doc["header"].items() if k != "command"}), flush=True)
    if args.device == "cuda" and not cuda:
        why = (
            f"no CUDA device: torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees "
            "none; run on a GPU machine, or with --device cpu for the harness's CPU twin"
        )
        print(f"error: {why}", file=sys.stderr)
        doc.update(ok=False, exit_status=2, failed=[f"cuda: {why}"], missed_targets=[])
        doc["checks"] = [{"name": c, **result("fail", f"not run: {why}")} for c in args.only]
        write_json(json_path, doc)
        return 2
    work = Path(args.work or tempfile.mkdtemp(prefix=f"gears_gpu_check_{args.stage}_"))
    (work / "logs").mkdir(parents=True, exist_ok=True)
    run_id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    watchdog = subprocess.Popen(
        [sys.executable, __file__, "--watchdog", run_id], stdin=subprocess.PIPE,
        env=clean_env(), start_new_session=True,
    )  # fmt: skip
    cpu_twin = args.device == "cpu"
    limits = {
        name: {
            "budget_s": budget,
            "limit_s": args.timeout or (CPU_TWIN_LIMIT_S if cpu_twin else limit),
        }
        for name, (budget, limit) in STAGES[args.stage].items()
    }
    ctx = argparse.Namespace(
        args=args, device=args.device, work=work, run_id=run_id, json_path=json_path,
        results={}, limits=limits, parallel=PARALLEL[args.stage],
        stage_deadline=time.monotonic() + args.stage_limit,
        gpus=torch.cuda.device_count() if args.device == "cuda" else 0,
        native_bf16=bool(doc["header"].get("native_bf16", True)),
    )  # fmt: skip
    doc["run"] = {"work": str(work), "run_id": run_id, "stage_limit_s": args.stage_limit}
    doc["checks"] = [
        {"name": c, **result("pending", "not started"), **limits[c]} for c in args.only
    ]
    print(f"work folder (runs and logs): {work}", flush=True)
    previous = {
        s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    }
    t0 = time.monotonic()
    code = None
    try:
        run_checks(ctx, doc)
        code = verdict(ctx, doc)
    except Stopped as e:
        code = 143 if "SIGTERM" in str(e) else 130
        for entry in doc["checks"]:
            if entry["status"] in ("running", "pending"):
                entry.update(status="fail", reason=f"{e} during the stage; children killed")
        doc.update(ok=False, exit_status=code, failed=[str(e)], missed_targets=[])
        print(f"gpu_check: {e}; killing every child", flush=True)
    finally:
        killed = sweep(run_id, whole_run=True)
        watchdog.stdin.close()  # the watchdog sweeps once more and exits
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        doc["seconds"] = round(time.monotonic() - t0, 1)
        doc["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        if code is None:  # an error in the harness itself
            doc.update(ok=False, exit_status=1, failed=["the harness raised (see its output)"])
        doc["killed_at_exit"] = killed
        write_json(json_path, doc)
        if args.out:
            archive_logs(ctx, Path(args.out) / f"gpu_check_{args.stage}_logs.tar.gz")
    print_summary(doc)
    print(f"stage {args.stage}: {doc['seconds']:.0f}s of its {args.stage_limit:g}s")
    if json_path:
        print(f"results written to {json_path}")
    return code


if __name__ == "__main__":
    from gears.cli.exiting import run_and_exit  # exits once done, whatever threads are left

    run_and_exit(main)
