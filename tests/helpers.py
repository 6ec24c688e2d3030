"""Tiny hand-made screens and gene -> GO files shared by the data-layer tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd

# Small enough that loading takes ~1 s, large enough for every split type at its defaults.
SYNTHETIC_PARAMS = dict(
    n_genes=60, n_single=20, n_double=20, cells_per_condition=6, n_control_cells=40, n_modules=4
)

# The engine tests' screen: small enough to train a few epochs in seconds, and the same
# parameters spelled for a command-line override (data.synthetic=...).
TINY = {
    "n_genes": 60,
    "n_single": 16,
    "n_double": 12,
    "cells_per_condition": 16,
    "n_control_cells": 128,
    "n_modules": 4,
}
TINY_CLI = (
    "{n_genes: 60, n_single: 16, n_double: 12, cells_per_condition: 16, "
    "n_control_cells: 128, n_modules: 4}"
)


def tiny_split(folder: Path):
    """The TINY synthetic screen loaded into `folder` with a seed-1 simulation split."""
    from gears.data.pertdata import PertData

    pert_data = PertData(folder, verbose=False)
    pert_data.load("synthetic", synthetic_params=TINY)
    return pert_data.prepare_split("simulation", seed=1)


def join_local_gloo(rank: int, world: int, port: int):
    """In a spawned test worker: the launcher variables for one local gloo rank, one thread, then
    join the group. Returns the DistEnv."""
    import os

    import torch

    from gears.train.distributed import init_distributed, set_local_rank_env

    set_local_rank_env(rank, world, port)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    return init_distributed("cpu", "gloo", timeout_s=120)


GENES = [f"G{i:02d}" for i in range(25)]
# Raw spellings as users write them -> the canonical name the pipeline must produce.
RAW_TO_CANONICAL = {
    "control": "ctrl",
    "G00": "G00+ctrl",
    "ctrl+G01": "G01+ctrl",
    "G02+ctrl": "G02+ctrl",
    "G03": "G03+ctrl",
    "G03+G00": "G00+G03",
}
UP = {"G00+ctrl": "G00", "G01+ctrl": "G01", "G03+ctrl": "G03"}  # gene raised 4 units
DOWN = {"G02+ctrl": "G02"}  # gene lowered from 5 to ~0.1
ALWAYS_ZERO = "G20"  # zero in every cell: a true zero, non-dropout everywhere
DROPPED_IN_G00 = "G21"  # expressed in ctrl, zero in G00+ctrl: a dropout there
ONLY_IN_G01 = "G22"  # zero in ctrl, expressed in G01+ctrl


def tiny_screen(cells_per_condition: int = 12, n_ctrl: int = 30, seed: int = 0) -> ad.AnnData:
    """A hand-made screen over GENES with raw spellings (RAW_TO_CANONICAL) and known DE genes.

    X [cells, 25] dense float32 >= 0: baseline 1 + |noise| (G02 baseline 5); in each condition of
    UP its gene is +4, in DOWN its gene drops to ~0.1; G20/G21/G22 follow the comments above.
    """
    rng = np.random.default_rng(seed)
    raw = np.repeat(
        list(RAW_TO_CANONICAL),
        [n_ctrl if r == "control" else cells_per_condition for r in RAW_TO_CANONICAL],
    )
    canon = np.array([RAW_TO_CANONICAL[r] for r in raw])
    idx = {g: i for i, g in enumerate(GENES)}
    X = 1.0 + 0.3 * np.abs(rng.standard_normal((len(raw), len(GENES))))
    X[:, idx["G02"]] += 4.0
    for cond, gene in UP.items():
        X[canon == cond, idx[gene]] += 4.0
    X[canon == "G00+G03", idx["G00"]] += 4.0
    X[canon == "G00+G03", idx["G03"]] += 4.0
    for cond, gene in DOWN.items():
        X[canon == cond, idx[gene]] = 0.1 * rng.random((canon == cond).sum())
    X[:, idx[ALWAYS_ZERO]] = 0.0
    X[canon == "G00+ctrl", idx[DROPPED_IN_G00]] = 0.0
    X[canon != "G01+ctrl", idx[ONLY_IN_G01]] = 0.0
    obs = pd.DataFrame({"condition": raw}, index=[f"cell{i:03d}" for i in range(len(raw))])
    return ad.AnnData(X=X.astype(np.float32), obs=obs, var=pd.DataFrame(index=GENES))


def tiny_gene2go(genes: list[str] = GENES) -> dict[str, set[str]]:
    """Every gene gets a shared term, a term shared with its neighbour and one of its own."""
    return {
        g: {"GO:0000001", f"GO:{100 + i // 2:07d}", f"GO:{900 + i:07d}"}
        for i, g in enumerate(genes)
    }


def write_gene2go(path: Path, gene2go: dict[str, set[str]]) -> Path:
    """`gene<TAB>GO:1,GO:2` lines, the TSV format PertData reads."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"{g}\t{','.join(sorted(t))}" for g, t in sorted(gene2go.items())]
    path.write_text("\n".join(lines) + "\n")
    return path


def canonical_by_hand(raw: str) -> str:
    """GEARS spelling of a `control` / `GENE` / `GENE1+GENE2` name, written out plainly."""
    if raw == "control":
        return "ctrl"
    genes = raw.split("+")
    if len(genes) == 1:
        return f"{genes[0]}+ctrl"
    return "+".join(sorted(genes))


# Loaded into test subprocesses through PYTHONPATH (see audit_env): logs each file write,
# rename, mkdir or delete under GEARS_AUDIT_ROOT with the writing process's RANK, so a test can
# prove that rank 0 alone writes. Writes from C code (h5py) are not seen; the tiny runs make none.
AUDIT_HOOK = """
import os, sys
_root, _log = os.environ.get("GEARS_AUDIT_ROOT"), os.environ.get("GEARS_AUDIT_LOG")
if _root and _log:
    _fd = os.open(f"{_log}.{os.getpid()}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    _WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def _hook(event, args):
        if event == "open":
            path, mode, flags = args
            if not (any(c in mode for c in "wax+") if isinstance(mode, str) else flags & _WRITE):
                return
        elif event in ("os.rename", "os.mkdir", "os.remove", "os.rmdir"):
            path = args[0]
        else:
            return
        if isinstance(path, (str, os.PathLike)) and os.fspath(path).startswith(_root):
            line = f"{os.environ.get('RANK', '0')} {event} {os.fspath(path)}\\n"
            os.write(_fd, line.encode())

    sys.addaudithook(_hook)
"""


def audit_env(audit_dir: Path, root: Path) -> dict[str, str]:
    """Environment variables that make test subprocesses log their writes under `root`."""
    import os

    audit_dir.mkdir(parents=True, exist_ok=True)
    (audit_dir / "sitecustomize.py").write_text(AUDIT_HOOK)
    return {
        "PYTHONPATH": os.pathsep.join([str(audit_dir), os.environ.get("PYTHONPATH", "")]),
        "GEARS_AUDIT_ROOT": str(root),
        "GEARS_AUDIT_LOG": str(audit_dir / "writes"),
    }


def audited_writes(audit_dir: Path) -> list[tuple[str, str, str]]:
    """(rank, event, path) of every logged write."""
    lines = []
    for log in Path(audit_dir).glob("writes.*"):
        lines += [tuple(line.split(" ", 2)) for line in log.read_text().splitlines()]
    return lines


ROOT = Path(__file__).resolve().parents[1]


def run_train_cli(
    out_dir: Path, data_dir: Path, *extra: str, env=None, threads: int = 1, tiny: bool = True
):
    """train_single.py on CPU in a fresh process, wandb off, at `threads` torch threads (set in
    its environment: the test process's own count says nothing). tiny: the TINY screen, hidden
    16, 3 epochs; else the default screen and model. `extra` overrides come last."""
    cmd = [
        sys.executable,
        str(ROOT / "train_single.py"),
        f"out_dir={out_dir}",
        f"data.data_dir={data_dir}",
        "wandb.mode=disabled",
        "device=cpu",
    ]
    if tiny:
        cmd += [f"data.synthetic={TINY_CLI}", "model.hidden_size=16", "train.epochs=3"]
    n = str(threads)
    full_env = {**os.environ, "OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, **(env or {})}
    return subprocess.run([*cmd, *extra], capture_output=True, text=True, env=full_env, timeout=600)


def metrics_without_timing(run_dir: Path) -> dict:
    """metrics.json without its timing fields (the only part allowed to differ on a rerun)."""
    metrics = json.loads((Path(run_dir) / "metrics.json").read_text())
    metrics.pop("timing")
    return metrics


def assert_same_run(run_dir: Path, reference: Path) -> None:
    """Same weights bit for bit, and the same metrics.json except its timing fields."""
    import torch

    from gears.train import checkpoint as ckpt

    got = ckpt.load(Path(run_dir) / "model" / "model.pt")["state_dict"]
    want = ckpt.load(Path(reference) / "model" / "model.pt")["state_dict"]
    assert got.keys() == want.keys()
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"{len(differ)} of {len(want)} tensors differ: {differ[:5]}"
    assert metrics_without_timing(run_dir) == metrics_without_timing(reference)


def final_train_state(run_dir: Path):
    """The TrainState of a run's newest checkpoint (after its last epoch, for a finished run)."""
    from gears.train import checkpoint as ckpt
    from gears.train.state import TrainState

    newest = ckpt.list_checkpoints(Path(run_dir) / "checkpoints")[-1]
    return TrainState.from_checkpoint(ckpt.load(newest))


# Settings a user's shell may hold; tests that start the scripts as a user would start from none.
THREAD_VARS = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "NUMBA_NUM_THREADS",
    "OMP_WAIT_POLICY",
    "GOMP_SPINCOUNT",
    "MKL_CBWR",
)
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def user_env(**extra: str) -> dict[str, str]:
    """The environment of a user who set no thread or launcher variable."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in THREAD_VARS
        and k not in LAUNCH_VARS
        and not k.startswith(("SLURM_", "TORCHELASTIC_", "GEARS_"))
    }
    return {**env, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", **extra}
