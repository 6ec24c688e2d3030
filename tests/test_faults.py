"""Faults, for real: SIGKILL in the middle of a checkpoint write and a full disk (RLIMIT_FSIZE)
in subprocesses; NaN/inf losses and GradScaler skips. SIGTERM with exact resume, reruns giving
the same metrics.json and the rank-0-only write audit run with the CLI runs they share:
tests/test_engine.py (1 process) and tests/test_distributed.py (2 processes)."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    TINY_CLI,
    final_train_state,
    metrics_without_timing,
    run_train_cli,
    tiny_gene2go,
    tiny_screen,
    write_gene2go,
)

from gears.compat.api import GEARS
from gears.config import TrainConfig
from gears.data.pertdata import PertData
from gears.errors import NonFiniteLossError
from gears.train import checkpoint as ckpt
from gears.train.distributed import DistEnv
from gears.train.engine import Trainer, seed_everything

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300
# --------------------------------------------------------------------- writes that fail midway
_WRITER = textwrap.dedent(
    """
    import resource, sys, torch
    from gears.train import checkpoint as ckpt
    from gears.errors import GearsInputError
    path, limit = sys.argv[1], int(sys.argv[2])
    if limit:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # Python ignores SIGXFSZ
    try:
        ckpt.atomic_save({"format": 2, "version": 2, "w": torch.ones(1_000_000)}, path)
    except GearsInputError as e:
        print(type(e).__name__, e)
        sys.exit(2)
    """
)


def _write_in_subprocess(path: Path, limit: int = 0, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _WRITER, str(path), str(limit)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def test_sigkill_during_checkpoint_write_keeps_the_previous_checkpoint(tmp_path):
    folder = tmp_path / "checkpoints"
    ckpt.atomic_save({"version": 1}, ckpt.checkpoint_path(folder, 1))
    newest = ckpt.checkpoint_path(folder, 2)
    ckpt.atomic_save({"version": 1}, newest)
    killed = _write_in_subprocess(newest, env={"GEARS_FAULT_KILL_WRITE": newest.name})
    assert killed.returncode == -9, killed.stderr
    stray = [p for p in folder.iterdir() if ".tmp" in p.name]
    assert len(stray) == 1 and stray[0].stat().st_size > 0  # the half-written temp file
    assert ckpt.load(newest) == {"version": 1}  # the rename never happened
    assert ckpt.load_latest(folder)["version"] == 1
    ckpt.atomic_save({"version": 3}, ckpt.checkpoint_path(folder, 3))
    ckpt.prune(folder)  # the next successful save clears the dead process's temp file
    assert not [p for p in folder.iterdir() if ".tmp" in p.name]


def test_disk_full_on_checkpoint_write_is_a_clear_error_keeping_the_previous(tmp_path):
    path = ckpt.checkpoint_path(tmp_path / "checkpoints", 1)
    ckpt.atomic_save({"version": 1}, path)
    full = _write_in_subprocess(path, limit=256 * 1024)  # the new file needs 4 MB
    assert full.returncode == 2, full.stderr
    assert "CheckpointWriteError" in full.stdout
    assert str(path) in full.stdout and "disk is full" in full.stdout
    assert "previous file is kept" in full.stdout and "train.resume=true" in full.stdout
    assert "Traceback" not in full.stderr
    assert ckpt.load(path) == {"version": 1}
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # temp file removed


_DATA_WRITER = textwrap.dedent(
    """
    import resource, sys
    from gears.data.pertdata import PertData
    from gears.errors import GearsInputError
    data_dir, h5ad, gene2go = sys.argv[1:4]
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))  # every write fails: EFBIG, as a full disk
    try:
        if h5ad == "synthetic":
            PertData(data_dir, verbose=False).load("synthetic", synthetic_params={"n_genes": 60})
        else:
            PertData(data_dir, gene2go=gene2go, verbose=False, store="mmap").load(data_path=h5ad)
    except GearsInputError as e:
        print(e)
        sys.exit(2)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("writer", ["synthetic GO file", "processed store"])
def test_full_disk_in_data_dir_is_one_line_and_leaves_no_temp_file(tmp_path, writer):
    """The synthetic screen's GO table and the out-of-core store, written into data_dir with
    no room: one error line naming where, and nothing half-written left (a 0-byte temp file
    and an OSError traceback before)."""
    args = ["synthetic", ""]
    if writer == "processed store":
        go = write_gene2go(tmp_path / "go.tsv", tiny_gene2go())
        tiny_screen().write_h5ad(tmp_path / "screen.h5ad")
        args = [str(tmp_path / "screen.h5ad"), str(go)]
    data = tmp_path / "data"
    done = subprocess.run(
        [sys.executable, "-c", _DATA_WRITER, str(data), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert str(data) in done.stdout and "run again" in done.stdout
    assert done.stdout.count("\n") == 1
    left = [p for p in data.rglob("*") if p.is_file()]
    assert not left, left
    assert not [p for p in data.rglob("*tmp*")]


# ------------------------------------------------------------------------------------- SIGINT
@pytest.mark.slow
def test_sigint_mid_epoch_writes_a_checkpoint_exits_130_and_resumes_exactly(tmp_path, tiny_cli_run):
    """Ctrl-C is handled as SIGTERM is: the process stops at the next step, writes a mid-epoch
    checkpoint and exits 130 with one line (a KeyboardInterrupt traceback and no checkpoint
    before); train.resume=true then ends where the uninterrupted run (the session's
    tiny_cli_run, run_train_cli's defaults as here) ends."""
    data = tmp_path / "data"
    whole, _ = tiny_cli_run
    run = tmp_path / "run"
    stopped = run_train_cli(run, data, env={"GEARS_FAULT_KILL": "0:step:13:INT"})
    assert stopped.returncode == 130, stopped.stderr[-2000:]
    assert "Traceback" not in stopped.stderr and "KeyboardInterrupt" not in stopped.stderr
    assert (
        "SIGINT received: stopped after epoch 1 + 3 steps of epoch 2 (step 13 in all); wrote "
        in stopped.stdout
    )
    names = [p.name for p in ckpt.list_checkpoints(run / "checkpoints")]
    assert names == ["epoch_0001.pt", "epoch_0001_step_000003.pt"]
    resumed = run_train_cli(run, data, "train.resume=true")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert metrics_without_timing(run) == metrics_without_timing(whole)
    assert final_train_state(run) == final_train_state(whole)


@pytest.mark.slow
def test_ctrl_c_to_spawned_processes_stops_them_with_one_checkpoint(tmp_path):
    """Ctrl-C in a terminal signals the launcher and its workers together: the workers stop at
    a step boundary, rank 0 writes the checkpoint, every process exits 130 without a
    traceback (the launcher used to raise KeyboardInterrupt out of its join)."""
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        str(ROOT / "train_distributed.py"),
        "--nproc",
        "2",
        f"out_dir={run}",
        f"data.data_dir={tmp_path / 'data'}",
        "wandb.mode=disabled",
        "device=cpu",
        f"data.synthetic={TINY_CLI}",
        "model.hidden_size=16",
        "train.epochs=1000",
        "distributed.timeout_s=60",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not ckpt.list_checkpoints(run / "checkpoints"):
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.stderr.read()
            time.sleep(0.2)
        os.killpg(launcher.pid, signal.SIGINT)
        out, err = launcher.communicate(timeout=TIMEOUT_S)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert launcher.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert out.count("SIGINT received: stopped after ") == 1, out[-2000:]
    state = ckpt.load(ckpt.list_checkpoints(run / "checkpoints")[-1])
    assert state["epoch"] >= 1 and state["world_size"] == 2


# ------------------------------------------------------------------ non-finite losses (in process)
@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> PertData:
    tmp = tmp_path_factory.mktemp("nan")
    go = write_gene2go(tmp / "go.tsv", tiny_gene2go())
    p = PertData(tmp / "data", gene2go=go, verbose=False)
    p.new_data_process("tiny", tiny_screen(), write=False)
    return p.prepare_split("simulation", seed=1)


def _poisoned_trainer(tiny, bad_call: int, out_dir=None, **train_kw) -> Trainer:
    """A trainer whose network returns NaN on its `bad_call`-th forward."""
    seed_everything(0)
    model = GEARS(tiny, device="cpu").model_initialize(hidden_size=8)
    calls = [0]

    def poison(module, inputs, output):
        calls[0] += 1
        return output * float("nan") if calls[0] == bad_call else output

    model.model.register_forward_hook(poison)
    cfg = TrainConfig(epochs=2, batch_size=8, schedule="constant", **train_kw)
    return Trainer(model.model, tiny, cfg, model.model_config(), DistEnv(), out_dir=out_dir)


def _loaders(tiny, batch_size: int = 8) -> dict:
    return tiny.get_dataloader(batch_size, 16)


def test_nan_loss_names_epoch_step_and_the_batch_conditions(tiny, tmp_path):
    loaders = _loaders(tiny)
    trainer = _poisoned_trainer(tiny, bad_call=3, out_dir=tmp_path)
    loader = loaders["train_loader"]
    loader.set_epoch(0)
    third = [b for _, b in zip(range(3), loader, strict=False)][2]
    expected = [tiny.conditions[int(c)] for c in third.uniq_cond]
    with pytest.raises(NonFiniteLossError) as info:
        trainer.fit(loaders, progress=False)
    message = str(info.value)
    assert "in epoch 1, at step 3 in all (batch 3 of the epoch)" in message
    assert str(expected[:20]) in message
    assert "Lower train.lr" in message
    assert not (tmp_path / "checkpoints").exists()  # nothing written after the NaN


def test_inf_loss_is_caught_when_checked_at_the_logging_interval(tiny):
    """The GPU path reads the flag every log_every steps (no host sync per step): the bad
    batch is still the one reported."""
    loaders = _loaders(tiny)
    trainer = _poisoned_trainer(tiny, bad_call=2)
    trainer.check_every = 4
    with pytest.raises(
        NonFiniteLossError, match=r"in epoch 1, at step 2 in all \(batch 2 of the epoch\)"
    ):
        trainer.fit(loaders, progress=False)


def test_gradscaler_skipped_steps_are_counted_not_fatal(tiny):
    """fp16's GradScaler (the CPU twin: a CPU GradScaler) skips the step of a non-finite
    gradient, lowers the scale and goes on; the skip is counted per epoch."""
    loaders = _loaders(tiny)
    trainer = _poisoned_trainer(tiny, bad_call=2)
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    history = trainer.fit(loaders, progress=False)
    assert trainer.state.device_skips is None  # folded into the host count at the epoch's end
    assert trainer.state.skipped_steps == 1
    assert trainer.skipped_steps == 1
    assert history.skipped_steps == [1, 0]
    assert trainer.step == 2 * len(loaders["train_loader"])
    assert all(torch.isfinite(p).all() for p in trainer.net.parameters())
    assert np.isfinite(history.train_loss[1])


def test_gears_deterministic_selects_deterministic_kernels(monkeypatch):
    monkeypatch.setenv("GEARS_DETERMINISTIC", "1")
    before = os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    try:
        seed_everything(3)
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        if before is not None:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = before
    monkeypatch.setenv("GEARS_DETERMINISTIC", "0")
    seed_everything(3)
    assert not torch.are_deterministic_algorithms_enabled()


def test_nan_loss_in_a_process_group_names_the_rank(tiny):
    """The distributed path (flags all-reduced, the bad batch gathered from its rank) on a real
    one-process gloo group."""
    import torch.distributed as dist

    from gears.train.distributed import find_free_port

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1
    )
    try:
        seed_everything(0)
        model = GEARS(tiny, device="cpu").model_initialize(hidden_size=8)
        calls = [0]

        def poison(module, inputs, output):
            calls[0] += 1
            return output * float("inf") if calls[0] == 2 else output

        model.model.register_forward_hook(poison)
        env = DistEnv(0, 0, 1, torch.device("cpu"), "gloo")
        cfg = TrainConfig(epochs=1, batch_size=8)
        trainer = Trainer(model.model, tiny, cfg, model.model_config(), env)
        with pytest.raises(
            NonFiniteLossError, match=r"at step 2 in all \(batch 2 of the epoch\) on rank 0"
        ):
            trainer.fit(_loaders(tiny), progress=False)
    finally:
        # DDP's reducer holds the gloo group: freed after destroy_process_group (when this
        # function's locals die) it joins gloo's thread with the GIL held and hangs. Free it
        # first, as gears.train.distributed.release does.
        trainer = model = None
        gc.collect()
        dist.destroy_process_group()
