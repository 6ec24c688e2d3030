"""The planned step under DDP (gears/train/graph_step.py, CPU, gloo, 2 real processes): the local
part
(forward, loss, backward into one flat gradient buffer) and the clip + optimizer part planned,
the flat gradient averaged by one all-reduce between them. 2 ranks x batch b reach the
parameters of 1 process x batch 2b and of eager DDP; two steps of a bucket dispatch the same ops
and move no storage on every rank."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from helpers import join_local_gloo, tiny_split

from gears.train.distributed import DistEnv, cleanup, find_free_port

WORLD = 2
CELLS = 16  # every condition of the tiny split has 16 cells (control: 8 x 16)
SGD = dict(
    epochs=2,
    schedule="constant",
    optimizer="sgd",
    lr=0.01,
    weight_decay=0.0,
    grad_clip=0.0,
    freeze_batchnorm=True,
)


def _trainer(
    pert_data, env: DistEnv, planned: bool, batching: str, batch_size: int, unused=False, **kw
):
    from gears.compat.api import GEARS
    from gears.config import ModelConfig, TrainConfig
    from gears.train.engine import Trainer, seed_everything

    seed_everything(0)
    model = GEARS(pert_data, device="cpu").initialize(ModelConfig(hidden_size=8))
    cfg = TrainConfig(**{**SGD, "batch_size": batch_size, "cuda_graphs": planned, **kw})
    loaders = pert_data.get_dataloader_distributed(
        batch_size,
        64,
        world_size=env.world_size,
        rank=env.rank,
        batching=batching,
        cells_per_group=CELLS,
    )
    if unused:  # a parameter the forward never reads (eager DDP's optimizer skips it)
        model.model.register_parameter("unused_weight", torch.nn.Parameter(torch.ones(3)))
    trainer = Trainer(model.model, pert_data, cfg, model.model_config(), env)
    return trainer, loaders["train_loader"]


def _state(trainer) -> dict:
    return {k: v.detach().clone() for k, v in trainer.net.state_dict().items()}


def _fit(pert_data, env: DistEnv, planned: bool, batch_size: int) -> dict:
    """Batches of whole conditions (grouped, one group of 16 cells per rank and step): the
    ranks' step-k batches together are the single process's step-k batch, each group weighing
    what it weighs there (a mean over groups of means over cells)."""
    trainer, loader = _trainer(pert_data, env, planned, "grouped", batch_size)
    trainer.fit({"train_loader": loader}, progress=False)
    return {"state": _state(trainer), "steps": trainer.step, "planned": trainer.runner is not None}


def _worker(rank: int, world: int, port: int, out: str):
    """Every job of JOBS in turn on one group of ranks, each on freshly loaded data (the jobs
    seed and build their own trainers); rank 0 writes job -> result."""
    env = join_local_gloo(rank, world, port)
    try:
        results = {
            job: run(tiny_split(Path(out) / f"data{rank}_{job}"), env) for job, run in JOBS.items()
        }
        if rank == 0:
            with open(Path(out) / "rank0.pkl", "wb") as f:
                pickle.dump(results, f)
    finally:
        cleanup(env)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> dict:
    """Rank 0's result of each job: one mp.spawn of WORLD gloo ranks for the module's four
    tests (the processes start and join their group once)."""
    out = tmp_path_factory.mktemp("ranks")
    mp.spawn(_worker, args=(WORLD, find_free_port(), str(out)), nprocs=WORLD, join=True)
    with open(out / "rank0.pkl", "rb") as f:
        return pickle.load(f)


def _eager_and_planned(pert_data, env: DistEnv) -> dict:
    return {
        "eager": _fit(pert_data, env, planned=False, batch_size=CELLS),
        "planned": _fit(pert_data, env, planned=True, batch_size=CELLS),
    }


def _assert_same_state(a: dict, b: dict) -> None:  # (tests/test_ddp.py's tolerance)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4, msg=k)


@pytest.mark.slow
def test_two_planned_ranks_equal_one_planned_process_and_eager_ddp(tmp_path, spawned):
    """2 gloo ranks with the planned step at batch b: the parameters of 1 process with the
    planned step at batch 2b, and of 2 ranks with eager DDP (frozen batch-norm, as
    tests/test_ddp.py's equality needs)."""
    torch.set_num_threads(1)
    ranks = spawned["eager_and_planned"]
    single = _fit(tiny_split(tmp_path / "single"), DistEnv(), True, WORLD * CELLS)
    assert ranks["planned"]["planned"] and single["planned"]
    assert not ranks["eager"]["planned"]
    assert ranks["planned"]["steps"] == ranks["eager"]["steps"] == single["steps"] > 4
    _assert_same_state(ranks["planned"]["state"], single["state"])
    _assert_same_state(ranks["planned"]["state"], ranks["eager"]["state"])


def _ops_and_storage(pert_data, env: DistEnv) -> dict:
    """On this rank: two steps of one bucket (different numbers of groups) dispatch the same
    ops, collectives included, and no storage moves or attribute is rebound over the steps."""
    from opcount import OpRecorder
    from test_graph_step import _ids, _same_bucket_pair

    from gears.train.engine import set_train_mode

    trainer, loader = _trainer(
        pert_data, env, True, "random", 32, unused=True, optimizer="adam", weight_decay=5e-4
    )
    runner = trainer.step_runner(loader)
    assert runner is not None
    set_train_mode(trainer.model, trainer.net, False)
    loader.set_epoch(0)
    runner.plan.set_epoch(0)
    runner.begin_epoch(0)
    runner.run(0)  # the first step creates the optimizer state

    def pointers():
        tensors = runner.state_tensors() + list(runner.plan.tensors.values())
        tensors += [g["lr"] for g in trainer.opt.param_groups]
        return [t.data_ptr() for t in tensors]

    before, ids = pointers(), _ids(trainer, runner)
    i, j = _same_bucket_pair(runner.plan)
    recorded = []
    for k in range(1, len(runner.plan)):  # (every rank runs every step: collectives)
        recorder = OpRecorder()
        with recorder:
            runner.run(k)
        recorded.append(_same_objects(recorder.ops))
        assert pointers() == before
        assert _ids(trainer, runner) == ids
    first, second = recorded[i - 1], recorded[j - 1]
    assert len(first) > 100 and first == second
    assert sum("c10d.allreduce_" in op for op in first) == 1
    # The parameter no rank used has no gradient and Adam (weight decay 5e-4) left it alone.
    unused = trainer.net.unused_weight
    assert unused.grad is None and torch.equal(unused.detach(), torch.ones(3))

    # Rank 0's batch-norm statistics on every rank after the broadcast that opens a step (each
    # rank's own batches moved them apart in its last step), as DDP's before a forward.
    def gathered():
        stats = {n: b.clone() for n, b in trainer.net.named_buffers() if "running" in n}
        out = [None] * env.world_size
        torch.distributed.all_gather_object(out, stats)
        return out

    apart = gathered()
    assert any(not torch.equal(v, apart[1][k]) for k, v in apart[0].items())
    runner.broadcast_buffers()
    together = gathered()
    assert all(torch.equal(v, together[1][k]) for k, v in together[0].items())
    assert all(torch.equal(v, together[0][k]) for k, v in apart[0].items())
    everyone = [None] * env.world_size  # the same bucket for step k on every rank
    torch.distributed.all_gather_object(everyone, runner.plan.bucket)
    assert all(b == everyone[0] for b in everyone)
    return {"buckets": everyone}


def _same_objects(ops: list) -> list:
    """The ops with the addresses of the objects a collective is handed (a ScriptObject made
    per call) blanked: its repr is all the recorder keeps of it."""
    import re

    return [re.sub(r" object at 0x[0-9a-f]+", " object", repr(op)) for op in ops]


class _PartGraph:
    """A captured part of a DDP step (test_graph_step's stand-in): replay runs it."""

    def __init__(self, runner, key):
        self.runner, self.key = runner, key

    def replay(self):
        if self.key == "update":
            self.runner.update_fn()
        else:
            self.runner.local_fn(self.key[1])

    def pool(self):
        return ("pool", id(self.runner))


def _captured(pert_data, env: DistEnv) -> dict:
    """On this rank, with test_graph_step's stand-in for torch.cuda's graphs: each bucket's
    local part and the update are captured once (warm-ups undone) and replayed around the
    all_reduce, training exactly as the uncaptured planned step."""
    from test_graph_step import _FakeCuda

    from gears.train.engine import set_train_mode

    runners = []
    for capture in (False, True):
        trainer, loader = _trainer(pert_data, env, True, "random", 32, optimizer="adam")
        runner = trainer.step_runner(loader)
        if capture:
            runner.capture, runner.cuda = True, _FakeCuda()
            runner.new_graph = lambda key, r=runner: _PartGraph(r, key)
        set_train_mode(trainer.model, trainer.net, False)
        loader.set_epoch(0)
        runner.plan.set_epoch(0)
        runner.begin_epoch(0)
        runners.append(runner)
    plain, captured = runners
    for i in range(len(plain.plan)):
        plain.run(i)
        captured.run(i)
        for a, b in zip(plain.state_tensors(), captured.state_tensors(), strict=True):
            assert torch.equal(a, b), i
    keys = {("local", b) for b in captured.plan.bucket} | {"update"}
    assert set(captured.graphs) == keys and captured.cuda.captures == len(keys)
    return {"keys": sorted(map(str, keys))}


def _wrapper(pert_data, env: DistEnv) -> dict:
    """On this rank: the planned step's trainer holds no DistributedDataParallel (its reducer
    keeps every parameter's gradient accumulator alive from the stream it was built on, and a
    capture on a side stream then fails: "operation failed due to a previous error during
    capture" on the GPU), yet every rank starts from rank 0's parameters and buffers, as DDP's
    constructor makes them; a run whose plan is refused at its first epoch gets the wrapper."""
    from torch.nn.parallel import DistributedDataParallel

    from gears.compat.api import GEARS
    from gears.config import ModelConfig, TrainConfig
    from gears.train.engine import Trainer, seed_everything

    def ddp(trainer) -> bool:
        return isinstance(
            getattr(trainer.model, "_orig_mod", trainer.model), DistributedDataParallel
        )

    out = {}
    for accum in (1, 2):  # (grad_accum_steps=2: the plan is refused, eager DDP steps)
        seed_everything(env.rank)  # a different initialisation on each rank
        model = GEARS(pert_data, device="cpu").initialize(ModelConfig(hidden_size=8))
        for b in model.model.buffers():
            if b.is_floating_point():
                b.fill_(float(env.rank))
        cfg = TrainConfig(batch_size=8, cuda_graphs=True, grad_accum_steps=accum)
        trainer = Trainer(model.model, pert_data, cfg, model.model_config(), env)
        mine = torch.cat(
            [t.detach().reshape(-1).double() for t in trainer.net.state_dict().values()]
        )
        gathered = [torch.zeros_like(mine) for _ in range(env.world_size)]
        torch.distributed.all_gather(gathered, mine)
        before = ddp(trainer)
        loader = pert_data.get_dataloader_distributed(
            8, 64, world_size=env.world_size, rank=env.rank
        )["train_loader"]
        runner = trainer.step_runner(loader)
        out[accum] = {
            "ddp_before": before,
            "ddp_after": ddp(trainer),
            "planned": runner is not None,
            "same_start": all(torch.equal(gathered[0], g) for g in gathered),
        }
    return out


JOBS = {
    "eager_and_planned": _eager_and_planned,
    "ops_and_storage": _ops_and_storage,
    "captured": _captured,
    "wrapper": _wrapper,
}


@pytest.mark.slow
def test_planned_ddp_steps_of_a_bucket_dispatch_identical_ops_and_keep_storage(spawned):
    """On each of 2 ranks: the ops of two steps of one bucket (the broadcasts, the local part,
    one all_reduce, the update) are identical, no storage moves, no attribute is rebound, and
    the ranks agree on every step's bucket."""
    torch.set_num_threads(1)
    result = spawned["ops_and_storage"]
    assert len(result["buckets"]) == WORLD


def test_only_synchronised_batchnorm_keeps_ddp_eager():
    """Under DDP the planned step is refused for distributed.sync_batchnorm alone (its batch
    statistics are all-reduced inside the forward), with the reason; plain DDP is planned."""
    from types import SimpleNamespace

    from gears.config import DistributedConfig, TrainConfig
    from gears.train.engine import planned_step_refusal

    loader = SimpleNamespace(batch_sampler=[], dataset=None)

    def trainer(sync_bn: bool):
        return SimpleNamespace(
            cfg=TrainConfig(cuda_graphs=True),
            scaler=torch.amp.GradScaler("cuda", enabled=False),
            env=SimpleNamespace(distributed=True, world_size=WORLD),
            dist_cfg=DistributedConfig(sync_batchnorm=sync_bn),
        )

    assert planned_step_refusal(trainer(False), loader) is None
    why = planned_step_refusal(trainer(True), loader)
    assert why is not None and "distributed.sync_batchnorm=true" in why


@pytest.mark.slow
def test_planned_ddp_parts_captured_with_the_standin_train_as_uncaptured(spawned):
    """The capture path under DDP on each of 2 ranks (see _captured): the graphs of the local
    parts and of the update, replayed around the all_reduce, train as the uncaptured steps."""
    torch.set_num_threads(1)
    result = spawned["captured"]
    assert "update" in result["keys"] and any("local" in k for k in result["keys"])


def test_planned_ddp_builds_no_wrapper_and_starts_every_rank_from_rank_0(spawned):
    """See _wrapper: on 2 gloo ranks initialised differently, the planned trainer has no
    DistributedDataParallel and every rank holds rank 0's parameters and buffers; with the plan
    refused (gradient accumulation) the wrapper is built at the first epoch."""
    torch.set_num_threads(1)
    result = spawned["wrapper"]
    assert result[1] == {
        "ddp_before": False,
        "ddp_after": False,
        "planned": True,
        "same_start": True,
    }
    assert result[2] == {
        "ddp_before": False,
        "ddp_after": True,
        "planned": False,
        "same_start": True,
    }
