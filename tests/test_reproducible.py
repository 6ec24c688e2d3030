"""Bit-reproducible CPU training where summation order could change from run to run: 2 threads,
the default model (hidden 64) on the default synthetic screen. A rerun, a run killed after a
checkpoint and resumed, and a run stopped by SIGTERM mid-epoch and resumed all end with the
uninterrupted run's metrics.json (timing aside) and weights, bit for bit, on an idle machine and
with another process spinning on a core (each resume test runs one process of each kind).
tests/test_engine.py covers the same paths at one thread on the tiny screen, whose kernels are
too small to run in parallel."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_same_run, run_train_cli

from gears.train import checkpoint as ckpt

THREADS = 2
EPOCHS = 2
BATCHES = 8  # training batches per epoch (of 114)
SETTINGS = (
    f"train.epochs={EPOCHS}",
    f"train.limit_batches={BATCHES}",
    "train.plot_conditions=0",
    "seed=3",
)


def _run(out_dir: Path, data_dir: Path, *extra: str, env=None) -> subprocess.CompletedProcess:
    return run_train_cli(out_dir, data_dir, *SETTINGS, *extra, env=env, threads=THREADS, tiny=False)


@contextlib.contextmanager
def _load(kind: str):
    """'busy': another process spins on a core meanwhile, so the training threads are preempted
    at points that differ from run to run; 'idle': nothing else is started."""
    if kind == "idle":
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """One uninterrupted run on an idle machine, the one every test must reproduce."""
    tmp = tmp_path_factory.mktemp("reference")
    result = _run(tmp / "run", tmp / "data")
    assert result.returncode == 0, result.stderr[-2000:]
    state = ckpt.load(ckpt.list_checkpoints(tmp / "run" / "checkpoints")[-1])
    assert state["cpu_threads"] == THREADS  # the threads the test asked for, after the data
    return tmp / "run"


@pytest.mark.slow
@pytest.mark.parametrize("load", ["idle", "busy"])
def test_rerun_is_bitwise_identical(tmp_path, reference, load):
    with _load(load):
        again = _run(tmp_path / "again", tmp_path / "data")
    assert again.returncode == 0, again.stderr[-2000:]
    assert_same_run(tmp_path / "again", reference)


@pytest.mark.slow
def test_sigkill_after_checkpoint_then_resume_is_bitwise_identical(tmp_path, reference):
    """Killed while another process spins on a core, resumed on an idle machine."""
    run_dir, data = tmp_path / "run", tmp_path / "data"
    with _load("busy"):
        killed = _run(run_dir, data, env={"GEARS_FAULT_KILL": "0:epoch:1"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]  # after epoch 1's save
    resumed = _run(run_dir, data, "train.resume=true")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"epoch_0001.pt: after epoch 1 (step {BATCHES} in all)" in resumed.stdout
    assert_same_run(run_dir, reference)


@pytest.mark.slow
def test_sigterm_mid_epoch_then_resume_is_bitwise_identical(tmp_path, reference):
    """Periodic checkpoints off: the resumed run starts from the one SIGTERM wrote, 3 batches
    into epoch 2. Stopped on an idle machine, resumed while another process spins on a core."""
    run_dir, data = tmp_path / "run", tmp_path / "data"
    stop_at = BATCHES + 3
    rare = "train.checkpoint_every=100"
    stopped = _run(run_dir, data, rare, env={"GEARS_FAULT_KILL": f"0:step:{stop_at}:TERM"})
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    assert (
        f"SIGTERM received: stopped after epoch 1 + 3 steps of epoch 2 (step {stop_at} in all)"
        in stopped.stdout
    )
    with _load("busy"):
        resumed = _run(run_dir, data, rare, "train.resume=true")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f": after epoch 1 + 3 steps of epoch 2 (step {stop_at} in all)" in resumed.stdout
    assert_same_run(run_dir, reference)
