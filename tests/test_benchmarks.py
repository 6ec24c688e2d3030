"""Smoke test of benchmarks/bench_train.py: the quick run completes and prints every table row."""

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
    assert set(figures) == {"threads", "bound", "dedup_bound", "engine", "cell_gears"}
    assert figures["threads"] == 1
    for key in ("bound", "dedup_bound"):
        assert set(figures[key]) == {"fp32", "bf16"} and min(figures[key].values()) > 0
    engine = {"random_fp32", "random_bf16", "grouped_fp32", "grouped_bf16"}
    assert set(figures["engine"]) == engine and min(figures["engine"].values()) > 0
    assert figures["cell_gears"] is None or figures["cell_gears"] > 0
    bound = re.search(r"bare per-cell layers bound \(32 rows\)\s+fp32\s+(\d+)", text)
    assert abs(float(bound.group(1)) - figures["bound"]["fp32"]) <= 1  # the table's figure


def test_gpu_check_without_cuda_says_so_and_exits_0(tmp_path):
    json_path = tmp_path / "gpu.json"
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--json", str(json_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": ""},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "no CUDA device visible" in out.stdout
    assert json.loads(json_path.read_text()) == {"cuda": False}
