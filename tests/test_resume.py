"""One out_dir, one run, end to end (train_single.py in subprocesses): a second run never writes
over the first, a resume continues the same run or refuses (changing nothing), the keys a resume
may change leave the result bit for bit where the uninterrupted run ends, and the full-disk
advice ("run again with train.resume=true") continues the right run."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers import TINY_CLI, final_train_state, metrics_without_timing

from gears.cli.run_folder import LOCK_NAME
from gears.train import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[1]


def _train(out: Path, data: Path, *extra: str, env=None, file_limit: int | None = None):
    """train_single.py on the tiny screen (hidden 16, 2 epochs, one thread), started; extra
    overrides come last. file_limit: the largest file it may write (RLIMIT_FSIZE: a full disk
    for any file above it)."""

    def limit():
        if file_limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))

    cmd = [
        sys.executable,
        str(ROOT / "train_single.py"),
        f"out_dir={out}",
        f"data.data_dir={data}",
        "wandb.mode=disabled",
        "device=cpu",
        f"data.synthetic={TINY_CLI}",
        "model.hidden_size=16",
        "train.epochs=2",
        "train.plot_conditions=0",
        *extra,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        preexec_fn=limit,
        cwd=ROOT,
    )


def _done(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _ok(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    done = _done(proc)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _one_error_line(proc: subprocess.Popen) -> str:
    done = _done(proc)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    return errors[0]


@pytest.mark.slow
def test_one_out_dir_one_run(tmp_path):
    """Run A (seed 1) lives in `run`; run B (seed 2, step schedule) is refused while A lives
    (both used to exit 0, B's config.yaml beside A's model) and after A finished (it used to
    overwrite metrics.json and model/ and keep A's checkpoints). B with replace_out_dir=true is
    killed after epoch 1; resuming it with train.lr=0.5 is refused (the checkpoint's rate was
    kept while config.yaml recorded 0.5) and changes nothing; resuming with train.epochs raised
    to 3 and keys that may change (another data_dir with the same data, logging, checkpoint
    period) meets a full disk at its next checkpoint; the advised command then ends where an
    uninterrupted 3-epoch run B ends, bit for bit (before, the folder still held A's
    checkpoints and the resume continued run A)."""
    data, run = tmp_path / "data", tmp_path / "run"
    b = ("seed=2", "train.schedule=step")
    reference = _train(tmp_path / "reference", tmp_path / "reference_data", *b, "train.epochs=3")
    first = _train(run, data, env={"GEARS_TEST_SLOW_RANK0": "data:25"})
    deadline = time.monotonic() + 120
    while not (run / LOCK_NAME).exists() or not (run / LOCK_NAME).read_text():
        assert time.monotonic() < deadline and first.poll() is None, _done(first).stderr
        time.sleep(0.2)
    line = _one_error_line(_train(run, data, *b))
    assert f"out_dir {run} is in use by another live run (pid {first.pid} on" in line
    _ok(first)
    metrics = (run / "metrics.json").read_bytes()
    line = _one_error_line(_train(run, data, *b))
    assert f"out_dir {run} holds another run's outputs (metrics.json, model/, checkpoints/" in line
    assert (run / "metrics.json").read_bytes() == metrics

    b += ("replace_out_dir=true",)
    killed = _done(_train(run, data, *b, env={"GEARS_FAULT_KILL": "0:epoch:1"}))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    (aside,) = tmp_path.glob("run.replaced-*")  # run A, moved whole
    assert (aside / "metrics.json").read_bytes() == metrics
    written = (run / "config.yaml").read_text()
    line = _one_error_line(_train(run, data, *b, "train.resume=true", "train.lr=0.5"))
    assert "train.lr: checkpoint 0.001 vs now 0.5" in line
    assert (run / "config.yaml").read_text() == written
    assert [p.name for p in ckpt.list_checkpoints(run / "checkpoints")] == ["epoch_0001.pt"]

    command = (
        *b,
        "train.epochs=3",
        "train.resume=true",
        "train.log_every=2",
        "train.checkpoint_every=1",
        "distributed.timeout_s=77",
    )
    full = _train(run, tmp_path / "other_data", *command, file_limit=128 * 1024)
    line = _one_error_line(full)
    assert "epoch_0002.pt: the disk is full or a size/quota limit was hit" in line
    assert line.endswith("and run again with train.resume=true")
    resumed = _ok(_train(run, tmp_path / "other_data", *command))
    assert "epoch_0001.pt: after epoch 1 (step" in resumed.stdout
    _ok(reference)
    got = ckpt.load(run / "model" / "model.pt")["state_dict"]
    want = ckpt.load(tmp_path / "reference" / "model" / "model.pt")["state_dict"]
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert metrics_without_timing(run) == metrics_without_timing(tmp_path / "reference")
    assert final_train_state(run) == final_train_state(tmp_path / "reference")
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert (config["seed"], config["train"]["epochs"], config["train"]["log_every"]) == (2, 3, 2)


def test_a_resume_with_a_changed_fork_file_is_refused_naming_it(tmp_path):
    """Only the model.impl string was compared: a fork file edited between the checkpoint and
    the resume continued the run with other code. Now its content (sha256) is part of the
    run's fingerprint; the unchanged file resumes."""
    fork = tmp_path / "my_fork.py"
    source = "from gears.model.network import GEARSNet\n\n\nclass Net(GEARSNet):\n    pass\n"
    fork.write_text(source)
    run, data = tmp_path / "run", tmp_path / "data"
    args = (f"model.impl={fork}:Net", "train.epochs=1", "train.schedule=step")
    _ok(_train(run, data, *args))
    fork.write_text(source + "    # edited after the checkpoint\n")
    line = _one_error_line(_train(run, data, *args, "train.epochs=2", "train.resume=true"))
    assert "cannot resume" in line and "my_fork.py sha256:" in line, line
    fork.write_text(source)
    resumed = _ok(_train(run, data, *args, "train.epochs=2", "train.resume=true"))
    assert "resumed from" in resumed.stdout
