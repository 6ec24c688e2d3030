"""Train the README's main job at one thread and summarise its outputs: the golden file of
tests/test_golden.py.

    python tests/golden/make_default_run.py               # rewrites tests/golden/default_run.json
    python tests/golden/make_default_run.py --out got.json            # another file (the test's)
    python tests/golden/make_default_run.py --from-run DIR --out got.json   # a finished run

The job is `python train_single.py` with `train.threads=1` (the thread count decides the
weights), `device=cpu`, `wandb.mode=disabled` and its out_dir and data_dir in a temporary folder,
run in a fresh process from the repository root with the kernels of PORTABLE_KERNELS (about 75 s
on one core; 45 s with the kernels this CPU picks itself, whose weights differ on another CPU).
The summary:
  metrics  metrics.json without its `timing` fields (the only part a rerun may change)
  tensors  per tensor of model/model.pt's state_dict: shape, dtype, sum and sum of squares of
           its values as float64 (math.fsum: the same on every CPU) and the values at five fixed
           flat indices (first, quarter, middle, three quarters, last)
and the commit, command and machine that produced it. Only the command line and the run's
files are used, no module of the package: the summary stays comparable while the package is
rearranged.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "default_run.json"
JOB = ["train_single.py", "train.threads=1", "device=cpu", "wandb.mode=disabled"]
COMMAND = "python tests/golden/make_default_run.py"
# The kernels every x86-64 CPU with AVX2 runs alike: ATen's AVX2 kernels (not AVX-512 where the
# CPU has it) and MKL's conditional-numerical-reproducibility path for any x86 CPU (its sgemm
# otherwise picks kernels by CPU maker and instruction set). Without them the weights of this
# job move by up to twice their largest value between instruction sets (docs/testing.md).
PORTABLE_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE"}
# Variables that pick other kernels or make the job a rank of a group: not inherited.
NOT_INHERITED = ("ATEN_CPU_CAPABILITY", "MKL_", "ONEDNN_", "DNNL_", "NPY_", "OPENBLAS_CORETYPE")
NOT_INHERITED_EXACT = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")


def job_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(NOT_INHERITED) and k not in NOT_INHERITED_EXACT
    }
    return {**env, **PORTABLE_KERNELS}


def train(tmp: Path) -> Path:
    """The default job into tmp/run (its synthetic screen written to tmp/data)."""
    cmd = [sys.executable, *JOB, f"out_dir={tmp / 'run'}", f"data.data_dir={tmp / 'data'}"]
    done = subprocess.run(
        cmd, cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=1200
    )
    if done.returncode != 0:
        sys.exit(f"the default job failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return tmp / "run"


def tensor_summary(t: torch.Tensor) -> dict:
    """Sums by math.fsum (correctly rounded, so the same on every CPU; a float32's square is
    exact in float64) of the values as float64."""
    flat = t.detach().reshape(-1).to(torch.float64).tolist()
    n = len(flat)
    idx = sorted({0, n // 4, n // 2, (3 * n) // 4, n - 1}) if n else []
    return {
        "shape": list(t.shape),
        "dtype": str(t.dtype).removeprefix("torch."),
        "sum": math.fsum(flat),
        "sumsq": math.fsum(x * x for x in flat),
        "values": {str(i): flat[i] for i in idx},
    }


def summarise(run: Path) -> dict:
    metrics = json.loads((run / "metrics.json").read_text())
    metrics.pop("timing", None)
    saved = torch.load(run / "model" / "model.pt", map_location="cpu", weights_only=True)
    state = saved["state_dict"]
    return {
        "metrics": metrics,
        "tensors": {k: tensor_summary(v) for k, v in state.items()},
    }


def provenance() -> dict:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()

    return {
        "commit": git("rev-parse", "--short=12", "HEAD"),
        "uncommitted_changes": bool(git("status", "--porcelain", "--untracked-files=no")),
        "command": COMMAND,
        "job": " ".join(f"{k}={v}" for k, v in PORTABLE_KERNELS.items())
        + " python "
        + " ".join(JOB),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=GOLDEN, help="the summary to write")
    parser.add_argument("--from-run", type=Path, help="summarise this finished run folder")
    args = parser.parse_args()
    if args.from_run:
        summary = summarise(args.from_run)
    else:
        with tempfile.TemporaryDirectory(prefix="gears_golden_") as tmp:
            summary = summarise(train(Path(tmp)))
    summary = {"produced_by": provenance(), **summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
