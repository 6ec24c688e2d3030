"""The README's main job at one thread (`python train_single.py train.threads=1`, on CPU) still
writes today's metrics.json and model.pt: tests/golden/default_run.json, written by
tests/golden/make_default_run.py, holds metrics.json without its timing fields and a summary
of every tensor of model.pt (shape, dtype, exact float64 sum and sum of squares, five values at
fixed indices). The test runs that script in a fresh process (the job through its command line,
no module of the package imported here) and compares its summary with the stored one.

Exact: every key of metrics.json and of the state_dict, every string, integer, None and list
(splits, condition lists, counts, best epoch), every shape and dtype. Floats: within REL_TOL,
relative (ABS_TOL near zero).

Why the job runs with make_default_run.py's PORTABLE_KERNELS (ATen's AVX2 kernels,
MKL_CBWR=COMPATIBLE), measured by `python tests/golden/isa_spread.py` at commit 92a0b28 on a
2-core AMD EPYC with AVX-512 (tests/golden/isa_spread.md): with the kernels a CPU picks itself,
another instruction set moves the outputs far more than any useful tolerance. ATen's plain
kernels (ATEN_CPU_CAPABILITY=default) changed 394 of 1,914 metrics (test mse by 2.8%,
pearson_delta by 6.9%, a fraction by 26%) and all 67 float tensors (by up to 2.2 times a
tensor's largest value; indv_w2 by 0.67); MKL's sgemm on its path for any x86 CPU
(MKL_CBWR=COMPATIBLE) alike: 395 metrics (up to 50%), 67 tensors (up to 2.1 times). 1,140 Adam
steps from a last-bit difference end as far apart as two seeds, so a tolerance that wide would
also pass a changed seed or learning rate. ATen's AVX2 kernels and MKL and oneDNN limited to AVX2
changed nothing here (this CPU's MKL already runs its AVX2 sgemm; an Intel CPU's AVX-512 one
differs). With PORTABLE_KERNELS, adding MKL and oneDNN limited to AVX2, numpy's AVX-512 loops
off and OpenBLAS on its Haswell kernels left every weight bit for bit and moved 125 metrics, all
of the `linear` baseline (float64 least squares), by at most 4.8e-15 relative (9.4e-16 absolute).
REL_TOL is 200 times that spread, ABS_TOL 100 times its absolute part, and both are far below
one float32 ulp of a weight (6e-8): a changed training step cannot pass. Load cannot move the
outputs: one thread, and the OpenMP wait policy that load switches decides no arithmetic (the
golden run and the measurement's runs were made beside other busy processes, equal bit for bit).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "golden" / "make_default_run.py"
GOLDEN = ROOT / "tests" / "golden" / "default_run.json"
REL_TOL = 1e-12
ABS_TOL = 1e-13


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def differences(got, want, path: str = "") -> list[str]:
    """Where got differs from want: exact for all but floats, floats within REL_TOL."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = [f"{path}.{k}: missing" for k in want if k not in got]
        out += [f"{path}.{k}: not in the golden file" for k in got if k not in want]
        for k in want:
            if k in got:
                out += differences(got[k], want[k], f"{path}.{k}")
        return out
    if isinstance(want, list) and isinstance(got, list):
        if len(got) != len(want):
            return [f"{path}: {len(got)} items, golden {len(want)}"]
        return [
            d for i, (g, w) in enumerate(zip(got, want)) for d in differences(g, w, f"{path}[{i}]")
        ]
    if type(got) is float and type(want) is float:
        if math.isclose(got, want, rel_tol=REL_TOL, abs_tol=ABS_TOL):
            return []
        return [f"{path}: {got!r}, golden {want!r}"]
    if type(got) is not type(want) or got != want:
        return [f"{path}: {got!r}, golden {want!r}"]
    return []


def test_differences_are_exact_but_for_floats():
    want = {"n": 3, "split": ["a", "b"], "x": 0.5, "gap": None}
    assert differences(dict(want), want) == []
    assert differences({**want, "x": 0.5 * (1 + 1e-13)}, want) == []
    assert differences({**want, "x": 0.5 * (1 + 1e-11)}, want) == [".x: 0.500000000005, golden 0.5"]
    assert differences({**want, "n": 3.0}, want) == [".n: 3.0, golden 3"]
    assert differences({**want, "split": ["a"]}, want) == [".split: 1 items, golden 2"]
    assert differences({**want, "gap": 0.0}, want) == [".gap: 0.0, golden None"]
    assert differences({"n": 3}, {"m": 3}) == [".m: missing", ".n: not in the golden file"]


@pytest.mark.slow
def test_default_run_equals_golden(tmp_path):
    if not {"avx2", "fma"} <= _cpu_flags():
        pytest.skip("needs an x86-64 CPU with AVX2 and FMA (the golden run's ATen kernels)")
    got_file = tmp_path / "got.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(got_file)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(got_file.read_text())
    want = json.loads(GOLDEN.read_text())
    assert got["produced_by"]["job"] == want["produced_by"]["job"]
    diff = differences(
        {k: got[k] for k in ("metrics", "tensors")}, {k: want[k] for k in ("metrics", "tensors")}
    )
    made, now = want["produced_by"], got["produced_by"]
    torch_note = (
        f" with torch {made['torch']}, this run with torch {now['torch']} (its kernels may round"
        " otherwise: regenerate if the upgrade is the cause)"
        if made["torch"] != now["torch"]
        else ""
    )
    n_tensors = sum(d.startswith(".tensors.") for d in diff)
    assert not diff, (
        f"{len(diff)} differences from the golden file ({n_tensors} in model.pt's tensors; made "
        f"at {made['commit']} by "
        f"`{made['command']}`{torch_note}):\n" + "\n".join(diff[:30])
    )
