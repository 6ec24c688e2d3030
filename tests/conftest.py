"""Shared fixtures: the real data in ../shared/data (skipped with a message where absent)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parents[1]
# benchmarks/opcount.py: the tests count ops and host reads as the benchmarks do
sys.path.insert(0, str(ROOT / "benchmarks"))
SHARED_DATA = Path(os.environ.get("GEARS_SHARED_DATA", ROOT.parent / "shared" / "data"))

os.environ.setdefault("WANDB_MODE", "disabled")

# Property-based tests (tests/test_fuzz.py): "ci", the default, replays the same bounded set of
# generated cases on every run (seeded by the test's name, no example database writes);
# `pytest --hypothesis-profile=thorough` draws many more fresh cases for a local hunt.
_FUZZ = dict(
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.register_profile(
    "ci", derandomize=True, database=None, max_examples=50, print_blob=True, **_FUZZ
)
settings.register_profile("thorough", max_examples=2000, print_blob=True, **_FUZZ)
settings.load_profile("ci")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The folder with perturbench_devel.h5ad, gene2go_human.tsv.gz, gene_aliases_human.tsv.gz."""
    if not (SHARED_DATA / "perturbench_devel.h5ad").exists():
        pytest.skip(f"real data folder {SHARED_DATA} is absent (set GEARS_SHARED_DATA to use it)")
    return SHARED_DATA


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """Each test starts with the session's torch thread count: a test that sets it (the DDP
    tests pin 1 thread) or that runs scanpy's numba DE (which resets the OpenMP pool) would
    otherwise change the float summation order of every later test."""
    import torch

    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_cli_run(tmp_path_factory) -> tuple[Path, str]:
    """One uninterrupted train_single.py run with tests/helpers.py's run_train_cli defaults (the
    TINY screen, hidden 16, 3 epochs, one thread): (its folder, its stdout). The runs that must
    end where it ends (test_engine.py, test_faults.py) and the report tests (test_report.py)
    only read it, so the session trains it once."""
    from helpers import run_train_cli

    tmp = tmp_path_factory.mktemp("tiny_cli_run")
    done = run_train_cli(tmp / "run", tmp / "data", threads=1)
    assert done.returncode == 0, done.stderr[-2000:]
    return tmp / "run", done.stdout


@pytest.fixture(scope="session")
def vcc_run(tmp_path_factory) -> dict:
    """A tiny model trained on a synthetic VCC-layout file (tests/vcc_helpers.py)."""
    from vcc_helpers import train_vcc_run

    return train_vcc_run(tmp_path_factory.mktemp("vcc_run"))


# The variables a launcher sets for its processes. A test that leaves one behind (slurm_to_env
# writes os.environ itself) turns every later train_single.py / train_distributed.py subprocess
# into a rank of a group that never forms: fail that test, not the later ones.
_LAUNCH_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@pytest.fixture(autouse=True)
def _no_launch_variables_left_behind():
    before = {k: os.environ.get(k) for k in _LAUNCH_VARS}
    yield
    after = {k: os.environ.get(k) for k in _LAUNCH_VARS}
    if after != before:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        changed = {k: (before[k], after[k]) for k in _LAUNCH_VARS if before[k] != after[k]}
        pytest.fail(f"the test left launch variables changed (before, after): {changed}")
