"""Smoke tests of benchmarks/bench_train.py (the quick run prints every table row) and of
benchmarks/gpu_check.py's harness on the CPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_train_quick_prints_every_row(tmp_path):
    json_path = tmp_path / "figures.json"
    env = {**os.environ, "PYTHONPATH": ""}
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_train.py"),
            "--quick",
            "--threads",
            "1",
            "--json",
            str(json_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    number = r"\s+\d+(\.\d+)?"
    for precision in ("fp32", "bf16"):
        for row in (
            r"bare per-cell layers bound \(32 rows\)",
            r"bare layers on 8 rows \(deduplicated bound\)",
            r"engine, random batches",
            r"engine, grouped \(8 perts x 4 cells\)",
        ):
            # name, precision, cells/s, ratio to the bound, distinct perturbations per batch
            assert re.search(row + r"\s+" + precision + number * 3, text), (row, precision, text)
    for label in ("mean predictions", r"quick\('test'\)", r"full\('test'\)"):
        assert re.search(label + r".*" + number * 2 + r"\s+\d+x", text), (label, text)
    assert "peak RSS" in text and "cell-gears" in text
    # Per-perturbation and per-cell evaluation are the same computation in eval mode.
    diff = re.search(r"max \|mean prediction ours - per-cell\| = (\S+)", text)
    assert diff is not None and float(diff.group(1)) < 1e-4
    # A random batch of 32 cells from ~70 perturbations has fewer distinct ones than cells,
    # a grouped batch at most 8.
    grouped = re.search(
        r"engine, grouped \(8 perts x 4 cells\)\s+fp32" + number * 2 + r"\s+(\S+)", text
    )
    assert grouped is not None and float(grouped.group(3)) <= 8
    # --json: the figures in the documented layout, cells/s medians.
    figures = json.loads(json_path.read_text())
    provenance = {"commit", "command", "date", "machine"}  # benchmarks/provenance.py
    assert set(figures) == {"threads", "bound", "dedup_bound", "engine", "cell_gears"} | provenance
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True)
    if head.returncode == 0:  # a checkout: the figures name its commit
        assert figures["commit"].startswith(head.stdout.decode().strip())
    assert "bench_train.py" in figures["command"]
    assert figures["threads"] == 1
    for key in ("bound", "dedup_bound"):
        assert set(figures[key]) == {"fp32", "bf16"} and min(figures[key].values()) > 0
    engine = {"random_fp32", "random_bf16", "grouped_fp32", "grouped_bf16"}
    assert set(figures["engine"]) == engine and min(figures["engine"].values()) > 0
    assert figures["cell_gears"] is None or figures["cell_gears"] > 0
    bound = re.search(r"bare per-cell layers bound \(32 rows\)\s+fp32\s+(\d+)", text)
    assert abs(float(bound.group(1)) - figures["bound"]["fp32"]) <= 1  # the table's figure


GPU_CHECK = ROOT / "benchmarks" / "gpu_check.py"


def _gpu_check(*args, env: dict | None = None, timeout: float = 300):
    return subprocess.run(
        [sys.executable, str(GPU_CHECK), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": "", **(env or {})},
    )


def test_gpu_check_without_cuda_says_so_and_exits_0(tmp_path):
    json_path = tmp_path / "gpu.json"
    out = _gpu_check("--json", json_path, env={"CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "no CUDA device visible" in out.stdout
    doc = json.loads(json_path.read_text())
    assert doc["ok"] is True and doc["header"]["device"] is None
    names = ["e2e", "ddp", "restart", "throughput", "cell_gears", "projection"]
    assert [c["name"] for c in doc["checks"]] == names
    assert all(c["status"] == "skip" and "no CUDA" in c["reason"] for c in doc["checks"])


@pytest.mark.slow
def test_gpu_check_on_cpu_trains_end_to_end_and_records_a_raising_check(tmp_path):
    """The harness on the CPU: train_single.py, its outputs, the CPU seeds' spread and
    predict.py pass; a check that raises is a "fail" line with the reason, not a traceback."""
    json_path = tmp_path / "gpu.json"
    out = _gpu_check(
        "--device", "cpu", "--quick", "--only", "e2e,ddp", "--precisions", "fp32",
        "--json", json_path, "--work", tmp_path / "work",
        env={"GEARS_GPU_CHECK_FAULT": "ddp:raise", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert out.returncode == 1, out.stderr[-3000:]  # a check failed
    doc = json.loads(json_path.read_text())
    assert doc["header"]["device"] == "cpu" and doc["ok"] is False
    e2e, ddp = doc["checks"]
    assert (e2e["name"], ddp["name"]) == ("e2e", "ddp")
    assert e2e["status"] == "pass", e2e["reason"]
    assert e2e["configs"]["fp32"]["status"] == "pass"
    assert e2e["predict"]["status"] == "pass", e2e["predict"]["reason"]
    assert "fp16 needs CUDA" in e2e["configs"]["fp16"]["reason"]
    assert "TF32" in e2e["configs"]["fp32+tf32"]["reason"]
    lo, hi = e2e["interval"]["mse_de"]
    assert lo <= e2e["configs"]["fp32"]["metrics"]["mse_de"] <= hi
    assert ddp["status"] == "fail" and "injected failure" in ddp["reason"]
    table = out.stdout[out.stdout.index("check ") :]
    assert re.search(r"e2e\s+pass\s+\d+\s+\S", table) and re.search(r"ddp\s+fail", table)


def test_gpu_check_time_limit_kills_the_check_and_leaves_a_failing_json(tmp_path):
    """A check past its limit (here one waiting on a child that never ends) is stopped, its
    child killed, and the JSON says "fail" with the reason; the other checks still report."""
    json_path = tmp_path / "gpu.json"
    out = _gpu_check(
        "--device", "cpu", "--only", "restart,projection", "--timeout", "3", "--json", json_path,
        "--work", tmp_path / "work", env={"GEARS_GPU_CHECK_FAULT": "restart:hang"}, timeout=120,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr[-3000:]
    restart, projection = json.loads(json_path.read_text())["checks"]
    assert restart["status"] == "fail" and "timed out after 3s" in restart["reason"]
    assert projection["status"] == "skip" and "throughput" in projection["reason"]
    hang_log = str(tmp_path / "work" / "logs" / "restart_hang.log")
    alive = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if hang_log in cmdline.read_bytes().decode(errors="replace"):
                alive.append(cmdline.parent.name)
        except OSError:
            continue
    assert not alive, f"the timed-out check's child is still running: {alive}"
