"""The entry points' start and end (gears/run.py): the command line, and how a run exits."""

from __future__ import annotations

import signal

import pytest

from gears.errors import GearsInputError, TrainingStopped
from gears.run import config_from_args, guarded, parse_args


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
