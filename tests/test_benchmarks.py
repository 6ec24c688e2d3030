"""Smoke tests of benchmarks/bench_train.py (the quick run prints every table row) and of
benchmarks/gpu_check.py's harness in its CPU mode: no CUDA is an error, a check past its limit
and a killed harness leave no child, the host-sync watch, and each stage's JSON verdict."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
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
sys.path.insert(0, str(ROOT / "benchmarks"))


def _gpu_check(*args, env: dict | None = None, timeout: float = 300):
    return subprocess.run(
        [sys.executable, str(GPU_CHECK), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": "", **(env or {})},
    )


def _tagged(run_id: str) -> list[int]:
    """Processes of a gpu_check run: its children and theirs carry its tag."""
    from gpu_check import tagged_pids

    return tagged_pids(run_id, whole_run=True)


def _alive(pids: list[int]) -> list[int]:
    """The pids that are still running (not gone, not zombies)."""
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def _wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = condition()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"waited {timeout:g}s for {what}")


@pytest.mark.parametrize("device", [[], ["--device", "cuda"]], ids=["default", "cuda"])
def test_gpu_check_without_cuda_exits_non_zero_and_says_so(tmp_path, device):
    """A torch without CUDA on the GPU machine must not read as a pass (it exited 0, ok: true)."""
    json_path = tmp_path / "gpu.json"
    out = _gpu_check(
        "--stage", "correctness", *device, "--json", json_path, env={"CUDA_VISIBLE_DEVICES": ""}
    )
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [out.stderr.strip()]  # one line
    assert out.stderr.startswith("error: no CUDA device") and "--device cpu" in out.stderr
    doc = json.loads(json_path.read_text())
    assert doc["ok"] is False and doc["exit_status"] == 2
    assert doc["failed"][0].startswith("cuda: no CUDA device")
    assert [c["name"] for c in doc["checks"]] == ["train", "ddp", "restart", "no_sync"]
    assert all(c["status"] == "fail" and "not run" in c["reason"] for c in doc["checks"])


def test_gpu_check_kills_a_check_past_its_limit_with_its_children(tmp_path):
    """A check over its limit (here waiting on a child whose own child runs in a session of its
    own, as torchrun's workers) fails with the reason, every process it started is killed, and
    the next check still runs and reports."""
    json_path = tmp_path / "gpu.json"
    out = _gpu_check(
        "--stage", "correctness", "--device", "cpu", "--only", "no_sync,ddp", "--timeout", "8",
        "--json", json_path, "--work", tmp_path / "work",
        env={"GEARS_GPU_CHECK_FAULT": "no_sync:hang,ddp:raise"}, timeout=120,
    )  # fmt: skip
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    doc = json.loads(json_path.read_text())
    no_sync, ddp = doc["checks"]
    assert no_sync["status"] == "fail" and "timed out after" in no_sync["reason"]
    assert "(its limit); 2 processes killed" in no_sync["reason"], no_sync["reason"]
    assert no_sync["limit_s"] == 8 and no_sync["seconds"] < 30
    assert ddp["status"] == "fail" and "injected failure" in ddp["reason"]
    assert doc["ok"] is False and doc["exit_status"] == 1 and len(doc["failed"]) == 2
    assert not _alive(_tagged(doc["run"]["run_id"]))


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_a_killed_harness_leaves_no_child_behind(tmp_path, sig):
    """SIGTERM: the harness kills its children, says so in the JSON and exits 143. SIGKILL (no
    handler runs): its watchdog sees the harness's pipe close and kills them."""
    json_path = tmp_path / "gpu.json"
    harness = subprocess.Popen(
        [sys.executable, str(GPU_CHECK), "--stage", "correctness", "--device", "cpu"]
        + ["--only", "no_sync", "--json", str(json_path), "--work", str(tmp_path / "work")],
        env={**os.environ, "PYTHONPATH": "", "GEARS_GPU_CHECK_FAULT": "no_sync:hang"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        run_id = _wait_for(
            lambda: json_path.is_file() and json.loads(json_path.read_text())["run"]["run_id"],
            60,
            "the harness to start",
        )
        # The hanging child and its grandchild (in a session of its own).
        _wait_for(lambda: len(_alive(_tagged(run_id))) >= 2, 60, "the check's two processes")
        harness.send_signal(getattr(signal, sig))
        output, _ = harness.communicate(timeout=60)
    finally:
        harness.kill()
    if sig == "SIGTERM":
        assert harness.returncode == 143, output[-3000:]
        assert not _alive(_tagged(run_id))  # gone before the harness exits
        doc = json.loads(json_path.read_text())
        assert doc["ok"] is False and doc["exit_status"] == 143
        assert "stopped by SIGTERM" in doc["checks"][0]["reason"]
    _wait_for(lambda: not _alive(_tagged(run_id)), 15, "every child to be killed")
    watchdog = f"--watchdog {run_id}"
    _wait_for(
        lambda: not [
            p for p in Path("/proc").glob("[0-9]*/cmdline")
            if watchdog in p.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        ],
        15,
        "the watchdog to exit",
    )  # fmt: skip


def test_no_sync_counts_cuda_sync_warnings_not_the_debug_mode_notice():
    """child_no_sync's reading of the warnings torch.cuda.set_sync_debug_mode("warn") raises:
    the notice printed the first time the mode is switched on (it contains "Synchronization")
    is no sync; the warning of a synchronizing CUDA operation is."""
    import warnings

    from gpu_check import cuda_sync_warnings

    notice = (
        "Synchronization debug mode is a prototype feature and does not yet detect all "
        "synchronizing operations"
    )
    sync = "called a synchronizing CUDA operation"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn(notice, UserWarning, stacklevel=1)
        warnings.warn("an unrelated warning", UserWarning, stacklevel=1)
        assert cuda_sync_warnings(caught) == []
        warnings.warn(sync, UserWarning, stacklevel=1)
    assert cuda_sync_warnings(caught) == [f"CUDA: {sync}"]


def test_host_sync_watch_names_each_kind_of_sync(monkeypatch):
    """gpu_check's watch (the stand-in's device tensors standing in for CUDA ones): every op
    that makes the host wait for a device tensor is listed with its line, nothing else is."""
    import torch
    from gpu_check import watch_host_syncs

    from gears.device import STANDIN_ENV, to_device

    monkeypatch.setenv(STANDIN_ENV, "1")
    x = to_device(torch.tensor([3.0, -1.0, 2.0, 0.0]), "cpu")
    r = to_device(torch.tensor([1, 2, 0, 1]), "cpu")
    host = torch.tensor([1.0, -2.0])
    with watch_host_syncs() as found:
        x[x > 0]  # noqa: B018
        x.nonzero()
        torch.unique(x)
        x.repeat_interleave(r)
        x.masked_select(x > 1)
        x[x < 0] = 0.0
        x.repeat_interleave(r, output_size=4)  # size given: no wait
        torch.where(x > 0, x, 0.0).sum()
        host[host > 0]  # noqa: B018  (a host tensor: no device to wait for)
    kinds = [line.split(" at ")[0] for line in found]
    assert kinds == [
        "index with a boolean mask",
        "nonzero",
        "_unique2",
        "repeat_interleave without output_size",
        "masked_select",
        "index_put_ with a boolean mask",
    ], found
    assert all("test_benchmarks.py:" in line for line in found)


@pytest.mark.slow
def test_gpu_check_correctness_on_cpu_trains_and_reports_each_check(tmp_path):
    """The correctness stage's CPU twin: train_single.py in fp32 and bf16 under the device
    stand-in beside CPU seeds (outputs, spread, no_change) and predict.py pass; the host-sync
    watch passes; a check that raises is a "fail" with its reason; exit status 1."""
    json_path = tmp_path / "gpu.json"
    out = _gpu_check(
        "--stage", "correctness", "--device", "cpu", "--quick", "--only", "train,ddp,no_sync",
        "--json", json_path, "--work", tmp_path / "work", "--stage-limit", "900",
        env={"GEARS_GPU_CHECK_FAULT": "ddp:raise"}, timeout=900,
    )  # fmt: skip
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    doc = json.loads(json_path.read_text())
    assert doc["header"]["device"] == "cpu" and doc["stage"] == "correctness"
    assert doc["ok"] is False and doc["exit_status"] == 1
    train, ddp, no_sync = doc["checks"]
    assert (train["name"], ddp["name"], no_sync["name"]) == ("train", "ddp", "no_sync")
    for check in doc["checks"]:
        assert {"status", "reason", "seconds", "budget_s", "limit_s"} <= set(check)
        assert check["limit_s"] <= 240
    assert train["status"] == "pass", train["reason"]
    configs = train["configs"]
    assert configs["fp32"]["status"] == "pass" and configs["bf16"]["status"] == "pass"
    assert "fp16 needs CUDA" in configs["fp16"]["reason"]
    assert (
        "TF32" in configs["fp32+tf32"]["reason"] and "inductor" in configs["bf16+compile"]["reason"]
    )
    for label in ("fp32", "bf16"):
        row = configs[label]
        lo, hi = train["interval"]["mse_de"]
        assert lo <= row["metrics"]["mse_de"] <= hi and row["skipped_steps"] == 0
        for metric, beat in train["cpu_beats_no_change"].items():
            if beat:  # where every CPU seed beats no_change, so does the device run
                lower = metric.startswith("mse")
                better = row["metrics"][metric] < row["no_change"][metric]
                assert better == lower, (label, metric)
    assert train["predict"]["status"] == "pass", train["predict"]["reason"]
    assert ddp["status"] == "fail" and "injected failure" in ddp["reason"]
    assert no_sync["status"] == "pass", no_sync["reason"]
    layouts = {lay for row in no_sync["rows"] for lay in row["layouts"]}
    assert {"equal counts", "per-cell rows", "weighted rows", "planned step"} <= layouts
    planned = [row for row in no_sync["rows"] if row["layouts"] == ["planned step"]]
    assert planned and all(row["steps"] == 4 and row["syncs"] == [] for row in planned)
    assert doc["failed"] == [f"ddp: {ddp['reason']}"]
    table = out.stdout[out.stdout.index("check ") :]
    assert re.search(r"train\s+pass\s+\d+\s+150", table) and re.search(r"ddp\s+fail", table)


@pytest.mark.slow
def test_gpu_check_speed_on_cpu_measures_norman_mix_against_the_targets(tmp_path):
    """The speed stage's CPU twin: a screen with Norman's mix of conditions, cells/s of the
    engine beside the bare bound at batch 32, each row against the targets (reported, not
    judged, on the CPU); --out writes the JSON and the logs."""
    out_dir = tmp_path / "out"
    out = _gpu_check(
        "--stage", "speed", "--device", "cpu", "--quick", "--only", "screen,speed_b32",
        "--out", out_dir, "--work", tmp_path / "work", "--stage-limit", "900", timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    doc = json.loads((out_dir / "gpu_check_speed.json").read_text())
    with tarfile.open(out_dir / "gpu_check_speed_logs.tar.gz") as tar:
        assert {"logs/screen.log", "logs/speed_b32.log"} <= set(tar.getnames())
    assert doc["ok"] is True and doc["exit_status"] == 0 and doc["failed"] == []
    screen, speed = doc["checks"]
    assert screen["status"] == "pass" and speed["status"] == "pass", doc["checks"]
    assert (screen["singles"], screen["doubles"]) == (105, 131)
    assert 10 <= screen["cells_per_condition"]["min"] <= screen["cells_per_condition"]["max"] <= 30
    assert screen["control_cells"] == 500
    rows = {r["config"]: r for r in speed["rows"]}
    assert set(rows) == {"bound fp32", "bound bf16", "eager fp32", "eager bf16", "graphs fp32"}
    assert all(r["cells_per_s"] > 0 and r["warmup_s"] > 0 for r in rows.values())
    # the planned step ran (not captured on the CPU), beside the eager one from one start
    assert rows["graphs fp32"]["planned"] and rows["graphs fp32"]["graphs_captured"] == []
    assert not rows["eager fp32"]["planned"]
    # engine rows: a whole epoch's rate, its setup (the plan's upload) paid once, not per block
    for config in ("eager fp32", "eager bf16", "graphs fp32"):
        r = rows[config]
        assert r["epoch_setup_ms"] > 0 and r["epoch_steps"] >= speed["steps"]
        epoch_s = (r["epoch_steps"] * r["step_ms"] + r["epoch_setup_ms"]) / 1e3
        assert r["cells_per_s"] == pytest.approx(32 * r["epoch_steps"] / epoch_s, rel=1e-2)
        assert r["block_step_ms"] >= r["step_ms"]
    agreement = speed["agreement"]
    assert agreement["steps"] == 20 and agreement["planned"] and agreement["max_param_diff"] >= 0
    assert 0 <= agreement["max_relative_diff"] and agreement["worst_relative"]
    assert set(speed["graphs_vs_eager_fp32"]) == {"step_ms", "cells_per_s", "speedup"}
    targets = {t["config"]: t for t in doc["targets"]}
    assert set(targets) == {"eager fp32", "eager bf16", "graphs fp32"}
    for config, t in targets.items():
        bound = rows[f"bound {rows[config]['precision']}"]["cells_per_s"]
        target = 20_000 if config.startswith("graphs") else None
        assert t["batch"] == 32 and t["target"] == target and t["min_x_bound"] == 0.8
        assert t["x_bound"] == pytest.approx(rows[config]["cells_per_s"] / bound, abs=1e-3)
        assert t["status"] == "n/a"
    assert "compiled bf16 skipped" in speed["reason"]


def test_bench_load_ratios_are_the_medians_the_table_names():
    """benchmarks/bench_load.py's summary: medians per load and arm over successful runs only,
    and the ratios the targets name (busy: default / threads=1; idle: threads=1 / default)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_load import summarise, table

    names = ["1 rank, default", "1 rank, train.threads=1"]

    def run(kind, name, wall, exit_code=0):
        return {"load": kind, "arm": name, "wall_s": wall, "cpu_s": wall, "exit": exit_code}

    runs = [
        run("idle", names[0], 10.0),
        run("idle", names[0], 12.0),
        run("idle", names[0], 99.0, exit_code=1),  # a failed run counts, its time does not
        run("idle", names[1], 13.0),
        run("busy", names[0], 30.0),
        run("busy", names[1], 20.0),
    ]
    summary = summarise(runs, names, ["idle", "busy"])
    cell = summary["cells"]["idle | 1 rank, default"]
    assert (cell["runs"], cell["failed"], cell["wall_s"]) == (3, 1, 11.0)
    ratios = summary["ratios"]
    assert ratios["busy: 1 rank default / threads=1 (target <= 1.5)"] == 1.5
    assert ratios["idle: 1 rank threads=1 / default (second core's gain)"] == 13.0 / 11.0
    assert ratios["busy / idle: 1 rank, default"] == 30.0 / 11.0
    assert ratios["busy: 2 ranks default / threads=1 (target <= 1.5)"] is None  # not run
    text = table(summary)
    assert "| idle | 1 rank, default | 3 (1 failed) | 11.0 |" in text
    assert "| busy: 1 rank default / threads=1 (target <= 1.5) | 1.50 |" in text


def test_gpu_check_targets_hold_the_replayed_step_to_the_goal_and_to_eager():
    """On CUDA the replayed step ("graphs ...") must reach 20,000 / 100,000 cells/s and be no
    slower than eager of its precision; eager rows answer to the bare bound only."""
    import types

    import gpu_check

    def rows(eager, graphs):
        return [
            {"config": "bound fp32", "kind": "bound", "precision": "fp32", "cells_per_s": 30_000},
            {"config": "eager fp32", "kind": "engine", "precision": "fp32", "cells_per_s": eager},
            {"config": "graphs fp32", "kind": "engine", "precision": "fp32", "cells_per_s": graphs},
        ]

    ctx = types.SimpleNamespace(device="cuda")
    checks = {"speed_b32": {"status": "pass", "batch": 32, "rows": rows(25_000, 24_500)}}
    got = {r["config"]: r for r in gpu_check.speed_targets(ctx, checks)}
    assert got["eager fp32"]["target"] is None and got["eager fp32"]["status"] == "met"
    assert (
        got["graphs fp32"]["status"] == "miss" and "slower than eager" in got["graphs fp32"]["why"]
    )
    checks["speed_b32"]["rows"] = rows(2_300, 19_000)
    got = {r["config"]: r for r in gpu_check.speed_targets(ctx, checks)}
    assert "19,000 cells/s < 20,000 target" in got["graphs fp32"]["why"]
    checks["speed_b32"]["rows"] = rows(2_300, 26_000)
    got = {r["config"]: r for r in gpu_check.speed_targets(ctx, checks)}
    assert got["graphs fp32"]["status"] == "met"
