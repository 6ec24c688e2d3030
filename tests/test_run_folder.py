"""gears/cli/run_folder.py: a run folder belongs to one run. Another run's outputs are never written
over (a new out_dir, train.resume=true or replace_out_dir=true), and a live run's lock refuses a
second one and dies with its process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import TINY_CLI

from gears.cli.run_folder import LOCK_NAME, claim_on_rank_0, prior_outputs
from gears.errors import GearsInputError
from gears.train import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[1]


def _finished_run(folder: Path) -> None:
    """The files a finished run leaves."""
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "model.pt").write_bytes(b"weights")
    (folder / "checkpoints").mkdir()
    ckpt.checkpoint_path(folder / "checkpoints", 2).write_bytes(b"state")
    (folder / "metrics.json").write_text("{}")
    (folder / "config.yaml").write_text("seed: 1\n")


def test_a_folder_holding_another_run_is_refused_naming_the_choices(tmp_path):
    run = tmp_path / "run"
    _finished_run(run)
    with pytest.raises(GearsInputError) as info:
        claim_on_rank_0(run, resume=False, replace=False)
    message = str(info.value)
    assert f"out_dir {run} holds another run's outputs" in message
    assert "metrics.json, model/, checkpoints/epoch_0002.pt" in message
    for choice in ("another out_dir", "train.resume=true", "replace_out_dir=true"):
        assert choice in message
    assert (run / "metrics.json").read_text() == "{}"  # nothing touched
    claim_on_rank_0(run, resume=True, replace=False).release()  # the same run, continued


def test_what_counts_as_another_runs_outputs(tmp_path):
    """A run stopped before its first checkpoint leaves config.yaml and plots/ only: starting
    it again loses nothing. An empty model/ folder is nothing either."""
    run = tmp_path / "run"
    (run / "plots").mkdir(parents=True)
    (run / "model").mkdir()
    (run / "config.yaml").write_text("seed: 1\n")
    assert prior_outputs(run) == []
    claim_on_rank_0(run, resume=False, replace=False).release()
    (run / "metrics.json").write_text("{}")
    assert prior_outputs(run) == ["metrics.json"]


def test_resume_without_a_checkpoint_in_a_finished_folder_is_refused(tmp_path):
    run = tmp_path / "run"
    _finished_run(run)
    ckpt.checkpoint_path(run / "checkpoints", 2).unlink()
    with pytest.raises(GearsInputError, match="but no checkpoint to continue from"):
        claim_on_rank_0(run, resume=True, replace=False)


def test_replace_moves_the_old_outputs_aside_and_deletes_nothing(tmp_path):
    run = tmp_path / "run"
    _finished_run(run)
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    claim_on_rank_0(run, resume=False, replace=True).release()
    (aside,) = tmp_path.glob("run.replaced-*")
    assert sorted(p.relative_to(aside) for p in aside.rglob("*")) == before
    assert [p.name for p in run.iterdir()] == [LOCK_NAME]
    # With train.resume=true, replace_out_dir does nothing: "the same command with
    # train.resume=true" continues a run that replace_out_dir=true started.
    _finished_run(run)
    claim_on_rank_0(run, resume=True, replace=True).release()
    assert len(list(tmp_path.glob("run.replaced-*"))) == 1 and prior_outputs(run)


def test_out_dir_that_is_a_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("mine")
    with pytest.raises(GearsInputError, match="is a file, not a folder; choose another out_dir"):
        claim_on_rank_0(path, resume=False, replace=False)
    assert path.read_text() == "mine"


_HOLDER = textwrap.dedent(
    """
    import sys, time
    from gears.cli.run_folder import claim_on_rank_0
    held = claim_on_rank_0(sys.argv[1], resume=False, replace=False)
    print("held", flush=True)
    time.sleep(120)
    """
)


def test_a_live_runs_lock_refuses_a_second_run_and_dies_with_it(tmp_path):
    """The lock is an flock: held while its process lives, gone when it is SIGKILLed (no stale
    lock to clean up by hand)."""
    run = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(run)], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(GearsInputError) as info:
            claim_on_rank_0(run, resume=False, replace=False)
        assert f"out_dir {run} is in use by another live run (pid {holder.pid} on" in str(
            info.value
        )
        assert "Wait for it to finish, or choose another out_dir" in str(info.value)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    claim_on_rank_0(run, resume=True, replace=False).release()


_TAKE = textwrap.dedent(
    """
    import fcntl, os, sys
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        sys.exit("held")
    print("took")
    """
)


def test_a_refused_claim_lets_another_process_take_the_folder(tmp_path):
    """A refusal (another run's outputs; a resume with no checkpoint) releases the lock it took
    to look: a notebook that was refused must not keep a later run, in another process, out of
    the folder."""
    refused = tmp_path / "outputs"
    _finished_run(refused)
    no_checkpoint = tmp_path / "no_checkpoint"
    no_checkpoint.mkdir()
    (no_checkpoint / "metrics.json").write_text("{}")
    for run, resume in ((refused, False), (no_checkpoint, True)):
        with pytest.raises(GearsInputError):
            claim_on_rank_0(run, resume=resume, replace=False)
        took = subprocess.run(
            [sys.executable, "-c", _TAKE, str(run / LOCK_NAME)], capture_output=True, text=True
        )
        assert (took.returncode, took.stdout.strip()) == (0, "took"), (run.name, took.stderr)


# ------------------------------------------------------------------------ end to end (the CLI)
# One run per folder through train_single.py, the resume rule and the full-disk advice:
# tests/test_resume.py. Here: the refusal with two processes.


@pytest.mark.slow
def test_every_rank_stops_cleanly_when_rank_0_refuses_the_folder(tmp_path):
    """Two spawned processes into a finished run's folder: one error line, exit 2."""
    run, data = tmp_path / "run", tmp_path / "data"
    _finished_run(run)
    cmd = [
        sys.executable,
        str(ROOT / "train_distributed.py"),
        "--nproc",
        "2",
        f"out_dir={run}",
        f"data.data_dir={data}",
        "wandb.mode=disabled",
        "device=cpu",
        f"data.synthetic={TINY_CLI}",
        "model.hidden_size=16",
        "distributed.timeout_s=60",
    ]
    # Rank 0 raises last, as under load: its line must still come before the ranks exit
    # (rank 1 left at once and the launcher killed rank 0 before it printed).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GEARS_TEST_SLOW_RANK0": "refusal:3"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    refusals = [line for line in done.stderr.splitlines() if "holds another run's outputs" in line]
    assert len(refusals) == 1, done.stderr[-3000:]
    assert (run / "metrics.json").read_text() == "{}"
