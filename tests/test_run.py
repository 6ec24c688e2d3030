"""The entry points' start and end (gears/cli/job.py): the command line, and how a run exits."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from gears.cli.job import config_from_args, guarded, parse_args
from gears.errors import GearsInputError, TrainingStopped


def test_overrides_are_taken_anywhere_on_the_command_line(tmp_path):
    """`key=value` after `--config FILE` (or between options) is an override like any other,
    not an 'unrecognized argument'."""
    config = tmp_path / "exp.yaml"
    config.write_text("train:\n  epochs: 3\n  lr: 0.002\n")
    args = parse_args(
        ["train.epochs=5", "--config", str(config), "train.limit_batches=5", "seed=4"], "test"
    )
    assert args.config == str(config)
    assert args.overrides == ["train.epochs=5", "train.limit_batches=5", "seed=4"]
    cfg = config_from_args(args)
    assert (cfg.train.epochs, cfg.train.limit_batches, cfg.seed) == (5, 5, 4)
    assert cfg.train.lr == 0.002  # the file's value where no override names the key

    def nproc(parser):
        parser.add_argument("--nproc", type=int)

    launcher = parse_args(["a=1", "--nproc", "2", "b=2", "--config", "x.yaml", "c=3"], "t", nproc)
    assert (launcher.nproc, launcher.config) == (2, "x.yaml")
    assert launcher.overrides == ["a=1", "b=2", "c=3"]


def _exit_of(main) -> int:
    with pytest.raises(SystemExit) as info:
        guarded(main)
    return info.value.code


def test_exit_statuses(capsys):
    """Bad input 2 with one line; a stop on SIGTERM 0 and on SIGINT 130 (a shell's status for
    Ctrl-C), the checkpoint's message printed by the trainer; a Ctrl-C before training 130 with
    one line and no traceback."""

    def bad():
        raise GearsInputError("the problem and the fix")

    def stopped(signum):
        def main():
            raise TrainingStopped("stopped", signum)

        return main

    def interrupted():
        raise KeyboardInterrupt

    assert _exit_of(bad) == 2
    assert capsys.readouterr().err == "error: the problem and the fix\n"
    assert _exit_of(stopped(signal.SIGTERM)) == 0
    assert _exit_of(stopped(signal.SIGINT)) == 130
    assert capsys.readouterr().err == ""
    assert _exit_of(interrupted) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("interrupted (SIGINT)")
    assert "train.resume=true" in err


EXIT_SCRIPT = """
import atexit, sys, threading, time
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from gears.errors import GearsInputError
from gears.cli.job import command

out = Path(sys.argv[1])
atexit.register(lambda: (out / "atexit").write_text("ran"))

def late_writer():
    time.sleep(0.3)
    (out / "thread").write_text("joined")

def main():
    threading.Thread(target=late_writer).start()
    print("unflushed", end="")
    sys.stderr.write("err unflushed")
    if sys.argv[2] == "bad":
        raise GearsInputError("the problem and the fix")
    if sys.argv[2] == "exit":
        sys.exit("a message")

command(main)
print("not reached")
"""


@pytest.mark.parametrize(("how", "status"), [("ok", 0), ("bad", 2), ("exit", 1)])
def test_a_command_ends_as_a_normal_exit_would_without_the_teardown(tmp_path, how, status):
    """command() skips the interpreter's teardown (os._exit) but first does what a normal exit
    does: joins non-daemon threads, runs atexit handlers, flushes stdout and stderr, and exits
    with guarded()'s status (sys.exit's message printed as Python prints it)."""
    import subprocess
    import sys

    script = tmp_path / "cmd.py"
    script.write_text(EXIT_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path), how, str(Path(__file__).resolve().parents[1])],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},  # buffered output
    )
    assert done.returncode == status, done.stderr
    assert done.stdout == "unflushed"
    assert done.stderr.startswith("err unflushed")
    if how == "bad":
        assert done.stderr.endswith("error: the problem and the fix\n")
    if how == "exit":
        assert done.stderr.endswith("a message\n")
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "joined"


LEFTOVERS_SCRIPT = """
import atexit, json, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from tqdm import tqdm
from gears.cli.exiting import run_and_exit
from gears.cli.job import command

out = Path(sys.argv[1])
pool = ThreadPoolExecutor(2, thread_name_prefix="pool")  # as inductor leaves its compile workers
stuck = threading.Event()

def alive_at_atexit():
    me = threading.current_thread()
    names = [t.name for t in threading.enumerate() if not t.daemon and t is not me]
    (out / "alive_at_atexit").write_text(json.dumps(names))

atexit.register(alive_at_atexit)

def main():
    pool.submit(int).result()
    pool.submit(int).result()
    # A library's thread that never ends:
    threading.Thread(target=stuck.wait, name="never-ends").start()
    for _ in tqdm(range(3), mininterval=0.01):  # tqdm's monitor thread
        time.sleep(0.02)
    print(f"done {time.time()}", flush=True)

run_and_exit(main) if sys.argv[3] == "run_and_exit" else command(main)
"""


@pytest.mark.parametrize("entry", ["command", "run_and_exit"])
def test_a_command_exits_whatever_threads_a_library_left_behind(tmp_path, entry):
    """Work done, a command exits within EXIT_WAIT_S of its last output even with an executor's
    idle workers (ended by concurrent.futures' exit hook, as a normal exit ends them), a tqdm
    monitor and a non-daemon thread that never ends (given up after EXIT_WAIT_S): the `python -c
    "...ThreadPoolExecutor(2).submit(int).result(); exit_quickly(0)"` of a compiled run's hang.
    command: the training commands' entry point; run_and_exit: the benchmarks'."""
    import json
    import subprocess
    import sys

    from gears.cli.exiting import EXIT_WAIT_S

    script = tmp_path / "leftovers.py"
    script.write_text(LEFTOVERS_SCRIPT)
    proc = subprocess.Popen(
        [
            sys.executable,
            str(script),
            str(tmp_path),
            str(Path(__file__).resolve().parents[1]),
            entry,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    ended = time.time()
    assert proc.returncode == 0, err
    last_output = float(out.split()[-1])
    assert ended - last_output < EXIT_WAIT_S + 15, (ended - last_output, EXIT_WAIT_S)
    # The pool's workers were ended by its own hook before atexit handlers ran, not abandoned.
    assert json.loads((tmp_path / "alive_at_atexit").read_text()) == ["never-ends"]


@pytest.mark.slow
def test_a_compiled_cpu_run_exits_once_its_outputs_are_written(tmp_path):
    """train.compile=true on CPU: inductor leaves compile workers (ThreadPoolExecutor threads)
    behind; the run still exits within EXIT_WAIT_S of printing `wrote ...` (it used to wait on
    them in Thread.join forever, in 4 of 7 runs of the default screen)."""
    import subprocess
    import sys

    from gears.cli.exiting import EXIT_WAIT_S
    from tests.helpers import TINY_CLI

    root = Path(__file__).resolve().parents[1]
    cmd = [
        sys.executable,
        str(root / "train_single.py"),
        f"out_dir={tmp_path / 'run'}",
        f"data.data_dir={tmp_path / 'data'}",
        "wandb.mode=disabled",
        "device=cpu",
        f"data.synthetic={TINY_CLI}",
        "model.hidden_size=16",
        "train.epochs=1",
        "train.plot_conditions=0",
        "train.compile=true",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines = []  # (time read, line)
    reader = threading.Thread(
        target=lambda: lines.extend((time.time(), line) for line in proc.stdout), daemon=True
    )
    reader.start()
    try:
        reader.join(timeout=900)  # the run's output, up to its end (or a hang)
        assert lines and lines[-1][1].startswith("wrote "), "".join(x for _, x in lines[-30:])
        try:
            proc.wait(timeout=max(0.0, lines[-1][0] + EXIT_WAIT_S + 30 - time.time()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {EXIT_WAIT_S + 30:.0f} s after: {lines[-1][1]}")
    finally:
        proc.kill()
    assert proc.returncode == 0, "".join(x for _, x in lines[-30:])
