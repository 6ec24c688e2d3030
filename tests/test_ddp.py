"""DDP on CPU (gloo, real processes): N ranks x batch b equals 1 process x batch N*b; sharded
evaluation equals single-process evaluation."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from helpers import join_local_gloo

from gears.config import DistributedConfig, TrainConfig
from gears.data.pertdata import PertData
from gears.train.distributed import DistEnv, cleanup, find_free_port
from gears.train.engine import Trainer
from gears.train.evaluate import Evaluator

WORLD = 2
SGD = dict(epochs=1, schedule="constant", optimizer="sgd", lr=0.01, weight_decay=0.0, grad_clip=0.0)


def _setup(data_dir: Path):
    # Imported here so spawned children find the helpers next to this file.
    from helpers import TINY
    from test_engine import ListLoader, build, group_batches

    pd_ = PertData(data_dir, verbose=False).load("synthetic", synthetic_params=TINY)
    pd_.prepare_split("simulation", seed=1)
    return pd_, build, group_batches, ListLoader


def _train(rank: int, world: int, data_dir: Path, sync_bn: bool, freeze_bn: bool, env: DistEnv):
    """Batches of 2 whole perturbation groups; rank r takes every world-th one, so the ranks'
    step-k batches together are the single process's step-k batch of 2*world groups."""
    pd_, build, group_batches, ListLoader = _setup(data_dir)
    model = build(pd_)
    batches = group_batches(pd_, 8, 4, 2 if world > 1 else 2 * WORLD)
    mine = batches[rank::world] if world > 1 else batches
    cfg = TrainConfig(freeze_batchnorm=freeze_bn, **SGD)
    trainer = Trainer(
        model.model,
        pd_,
        cfg,
        model.model_config(),
        env,
        dist_cfg=DistributedConfig(sync_batchnorm=sync_bn),
    )
    trainer.fit({"train_loader": ListLoader(mine)}, progress=False)
    ev = Evaluator(pd_, env, model.model)
    return {
        "state": {k: v.detach().cpu().clone() for k, v in model.model.state_dict().items()},
        "steps": trainer.step,
        "test_pred": ev.predict_means("test"),
        "val": ev.quick("val"),
    }


# The batch-norm settings the tests compare, each trained by the same 2-rank world in turn.
SETTINGS = {  # name: (distributed.sync_batchnorm, train.freeze_batchnorm)
    "sync-batchnorm": (True, False),
    "frozen-batchnorm": (False, True),
    "unsynchronised": (False, False),
}


def _worker(rank: int, world: int, port: int, out: str):
    env = join_local_gloo(rank, world, port)
    try:
        results = {
            name: _train(rank, world, Path(out) / f"data{rank}", sync_bn, freeze_bn, env)
            for name, (sync_bn, freeze_bn) in SETTINGS.items()
        }
        if rank == 0:
            with open(Path(out) / "rank0.pkl", "wb") as f:
                pickle.dump(results, f)
    finally:
        cleanup(env)


@pytest.fixture(scope="module")
def dist_runs(tmp_path_factory) -> dict:
    """Rank 0's result for each of SETTINGS: one mp.spawn of WORLD gloo ranks trains them one
    after the other (each from a fresh build(), seeded, on freshly loaded data), so the
    processes start and join their group once for the three tests."""
    out = tmp_path_factory.mktemp("ddp")
    mp.spawn(_worker, args=(WORLD, find_free_port(), str(out)), nprocs=WORLD, join=True)
    with open(out / "rank0.pkl", "rb") as f:
        return pickle.load(f)


def _assert_same_state(a: dict, b: dict) -> None:
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4, msg=k)


@pytest.mark.slow
@pytest.mark.parametrize(
    "sync_bn,freeze_bn", [(True, False), (False, True)], ids=["sync-batchnorm", "frozen-batchnorm"]
)
def test_two_ranks_equal_one_process_with_double_batch(tmp_path, dist_runs, sync_bn, freeze_bn):
    """With synchronised (or frozen) batch-norm, 2 gloo ranks with batch b reach the parameters
    of 1 process with batch 2b; predictions and metrics agree too."""
    torch.set_num_threads(1)
    dist_run = dist_runs["sync-batchnorm" if sync_bn else "frozen-batchnorm"]
    single = _train(0, 1, tmp_path / "single", sync_bn, freeze_bn, DistEnv())
    assert dist_run["steps"] == single["steps"] == 2
    _assert_same_state(dist_run["state"], single["state"])
    np.testing.assert_allclose(dist_run["test_pred"], single["test_pred"], atol=1e-5)
    assert dist_run["val"]["mse_de"] == pytest.approx(single["val"]["mse_de"], rel=1e-5)


@pytest.mark.slow
def test_unsynchronised_batchnorm_differs(tmp_path, dist_runs):
    """The equality above needs synchronised statistics: per-rank batch-norm statistics differ
    from the large batch's, and so do the weights (the test can fail)."""
    torch.set_num_threads(1)
    dist_run = dist_runs["unsynchronised"]
    single = _train(0, 1, tmp_path / "single", False, False, DistEnv())
    diffs = [
        (dist_run["state"][k].float() - single["state"][k].float()).abs().max().item()
        for k in single["state"]
    ]
    assert max(diffs) > 1e-4
