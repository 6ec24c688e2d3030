"""How far the 1-thread default run's outputs move between instruction sets: the measurement
behind tests/test_golden.py's PORTABLE_KERNELS and REL_TOL, written to tests/golden/isa_spread.md.

    python tests/golden/isa_spread.py              # trains 7 runs (~8 min on one core)
    python tests/golden/isa_spread.py --runs DIR   # reuses DIR/<twin>/run where it exists

Each twin is the job of make_default_run.py (`python train_single.py train.threads=1
device=cpu wandb.mode=disabled`) under environment variables that make this CPU run the kernels
another x86 CPU would: ATen's AVX2 or plain (no vector extension) kernels instead of AVX-512,
MKL's sgemm and oneDNN limited to AVX2 or on MKL's path for any x86 CPU, numpy's AVX-512 loops
off and OpenBLAS on its Haswell kernels. The twins of the first table run with the kernels this
CPU picks itself and are compared with the run under no variable; those of the second run with
PORTABLE_KERNELS and are compared with the run under those alone. Per twin: the largest relative
difference of a float in metrics.json (timing aside), and per tensor of model.pt the largest
elementwise difference over the tensor's largest absolute value.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
from make_default_run import JOB, PORTABLE_KERNELS, ROOT, job_env

OTHER_ISA = {
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR",
    "OPENBLAS_CORETYPE": "Haswell",
}
OWN = {  # name: variables, run with the kernels this CPU picks
    "own": {},
    "aten_avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "aten_default": {"ATEN_CPU_CAPABILITY": "default"},
    "mkl_onednn_avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "mkl_cbwr_compatible": {"MKL_CBWR": "COMPATIBLE"},
}
PINNED = {  # name: variables added to PORTABLE_KERNELS
    "portable": {},
    "portable_other_isa": OTHER_ISA,
}


def train(folder: Path, extra: dict[str, str], portable: bool) -> Path:
    run = folder / "run"
    if (run / "metrics.json").exists():
        return run
    env = (
        job_env() if portable else {k: v for k, v in job_env().items() if k not in PORTABLE_KERNELS}
    )
    cmd = [sys.executable, *JOB, f"out_dir={run}", f"data.data_dir={folder / 'data'}"]
    done = subprocess.run(cmd, cwd=ROOT, env={**env, **extra}, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{folder.name} failed:\n{done.stderr[-3000:]}")
    return run


def load(run: Path) -> tuple[dict, dict]:
    metrics = json.loads((run / "metrics.json").read_text())
    metrics.pop("timing", None)
    flat: dict = {}

    def walk(prefix, v):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else k, x)
        elif isinstance(v, list):
            for i, x in enumerate(v):
                walk(f"{prefix}[{i}]", x)
        else:
            flat[prefix] = v

    walk("", metrics)
    state = torch.load(run / "model" / "model.pt", map_location="cpu", weights_only=True)
    return flat, state["state_dict"]


def spread(ref: Path, twin: Path) -> tuple[dict, dict]:
    """(metric -> relative difference, tensor -> max |difference| / max |value|)."""
    (m0, s0), (m1, s1) = load(ref), load(twin)
    assert m0.keys() == m1.keys() and s0.keys() == s1.keys()
    metrics = {}
    for k, a in m0.items():
        b = m1[k]
        if isinstance(a, float):
            metrics[k] = abs(a - b) / abs(a) if a else abs(b)
        else:
            metrics[k] = 0.0 if a == b else float("inf")
    tensors = {}
    for k, a in s0.items():
        a, b = a.double(), s1[k].double()
        scale = a.abs().max().item() if a.numel() else 0.0
        diff = (a - b).abs().max().item() if a.numel() else 0.0
        tensors[k] = diff / scale if scale else diff
    return metrics, tensors


def table(ref: Path, twins: dict[str, Path]) -> list[str]:
    results = {name: spread(ref, run) for name, run in twins.items()}
    names = list(results)
    lines = [
        "| | " + " | ".join(names) + " |",
        "| --- |" + " --- |" * len(names),
        "| metrics differing | "
        + " | ".join(
            f"{sum(v > 0 for v in m.values())} of {sum(1 for _ in m)}" for m, _ in results.values()
        )
        + " |",
        "| largest metric difference | "
        + " | ".join(f"{max(m.values()):.3g}" for m, _ in results.values())
        + " |",
        "| tensors differing | "
        + " | ".join(f"{sum(v > 0 for v in t.values())} of {len(t)}" for _, t in results.values())
        + " |",
    ]
    for key in ("test.mse", "test.pearson_delta", "test.mse_de", "val_best.mse"):
        lines.append(
            f"| metric `{key}` | " + " | ".join(f"{m[key]:.3g}" for m, _ in results.values()) + " |"
        )
    for key in next(iter(results.values()))[1]:
        lines.append(
            f"| tensor `{key}` | " + " | ".join(f"{t[key]:.3g}" for _, t in results.values()) + " |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, help="folder of the twins' runs (kept)")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("isa_spread.md"))
    args = parser.parse_args()
    runs = args.runs or Path(__import__("tempfile").mkdtemp(prefix="gears_isa_"))
    own = {n: train(runs / n, env, portable=False) for n, env in OWN.items()}
    pinned = {n: train(runs / n, env, portable=True) for n, env in PINNED.items()}
    commit = subprocess.run(
        ["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in open("/proc/cpuinfo")
            if ln.startswith("model name")
        ),
        "?",
    )
    pin = " ".join(f"{k}={v}" for k, v in PORTABLE_KERNELS.items())
    other = " ".join(f"{k}={v!r}" if " " in v else f"{k}={v}" for k, v in OTHER_ISA.items())
    out = [
        "# The default run across instruction sets",
        "",
        f"`python tests/golden/isa_spread.py` at commit {commit}, {cpu} "
        f"(ATen capability {torch.backends.cpu.get_cpu_capability()}), torch {torch.__version__}, "
        f"{datetime.now(timezone.utc):%Y-%m-%d}. The job: `python {' '.join(JOB)}`. Relative "
        "differences: a metric's |difference| / |value|; a tensor's largest elementwise "
        "|difference| / its largest |value|.",
        "",
        "With the kernels this CPU picks, against the run under no variable:",
        "",
        *table(own["own"], {n: r for n, r in own.items() if n != "own"}),
        "",
        f"With `{pin}` (PORTABLE_KERNELS), against the run under those alone; "
        f"`portable_other_isa` adds `{other}`:",
        "",
        *table(pinned["portable"], {n: r for n, r in pinned.items() if n != "portable"}),
        "",
    ]
    args.out.write_text("\n".join(out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
