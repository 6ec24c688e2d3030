"""The entry points' start and end (gears/run.py): the command line, and how a run exits."""

from __future__ import annotations

from gears.run import config_from_args, parse_args


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
