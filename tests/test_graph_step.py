"""Tests for gears/train/graph_step.py: the epoch plan yields the training loader's batches, and the
planned step is capturable (same ops for every batch of a bucket, storage that never moves, no
host sync, no attribute rebound) and trains to today's numbers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import tiny_split

from gears.data.pertdata import PertData
from gears.train.engine import set_train_mode
from gears.train.graph_step import EpochPlan, row_buckets


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> PertData:
    return tiny_split(tmp_path_factory.mktemp("data"))


def test_row_buckets_are_a_few_multiples_of_eight():
    assert row_buckets(32) == (8, 16, 24, 32)
    assert row_buckets(256) == (64, 128, 192, 256)
    assert row_buckets(5) == (8,)
    assert row_buckets(32, per_cell=True) == (32,)


def _same_batch(plan: EpochPlan, i: int, batch, covariates=()) -> None:
    """Plan batch i (read at its bucket) equals the loader's batch, padding rows weighing 0."""
    got = plan.read(plan.bucket[i], i)
    U = len(batch.uniq_cond)
    assert plan.bucket[i] >= U
    assert torch.equal(got.x, batch.x) and torch.equal(got.y, batch.y)
    assert torch.equal(got.inverse, batch.inverse)
    assert torch.equal(got.uniq_cond[:U], batch.uniq_cond)
    assert torch.equal(got.uniq_pert_index[:U], batch.uniq_pert_index)
    assert torch.equal(got.counts[:U], batch.counts)
    assert float(got.n_groups) == U
    assert not got.counts[U:].any() and bool((got.uniq_pert_index[U:] == -1).all())
    assert sorted(got.uniq_covariates) == sorted(batch.uniq_covariates)
    for name, codes in batch.uniq_covariates.items():
        assert torch.equal(got.uniq_covariates[name][:U], codes)


@pytest.mark.parametrize(
    ("seed", "world", "batching", "batch_size"),
    [(1, 1, "random", 8), (3, 2, "random", 4), (2, 1, "block", 16), (5, 3, "block", 8)],
)
def test_plan_yields_the_loaders_batches(tiny, seed, world, batching, batch_size):
    """Batch by batch, across seeds, epochs, world sizes and every rank's DDP shard."""
    kept, tiny.seed = tiny.seed, seed
    try:
        _compare_ranks(tiny, world, batching, batch_size)
    finally:
        tiny.seed = kept


def _compare_ranks(tiny, world, batching, batch_size):
    for rank in range(world):
        loaders = tiny.get_dataloader_distributed(
            batch_size, 64, world_size=world, rank=rank, batching=batching, block_size=16
        )
        loader = loaders["train_loader"]
        plan = EpochPlan(loader, torch.device("cpu"))
        for epoch in (0, 3):
            loader.set_epoch(epoch)
            plan.set_epoch(epoch)
            batches = list(loader)
            assert len(plan) == len(batches) > 0
            for i, batch in enumerate(batches):
                _same_batch(plan, i, batch)


def test_plan_carries_covariate_groups(tiny):
    """Groups of (condition, covariate codes), ordered as the loader's np.unique orders them."""
    rng = np.random.default_rng(0)
    codes = {"context": rng.integers(0, 3, tiny.adata.n_obs)}
    loader = tiny.get_dataloader_distributed(8, 64, covariates=codes)["train_loader"]
    plan = EpochPlan(loader, torch.device("cpu"))
    loader.set_epoch(1)
    plan.set_epoch(1)
    for i, batch in enumerate(loader):
        _same_batch(plan, i, batch)


def test_plan_keeps_its_storage_and_the_cursor_resumes(tiny):
    """A new epoch is uploaded into the same device storage; a resume within an epoch reads
    from the batch it stopped at (the cursor), as the loader skips to it."""
    loader = tiny.get_dataloader_distributed(8, 64)["train_loader"]
    plan = EpochPlan(loader, torch.device("cpu"))
    loader.set_epoch(0)
    plan.set_epoch(0)
    ptrs = {k: v.data_ptr() for k, v in plan.tensors.items()}
    loader.set_epoch(1)
    plan.set_epoch(1)
    assert {k: v.data_ptr() for k, v in plan.tensors.items()} == ptrs
    batches = list(loader)
    start = len(batches) // 2
    plan.cursor.fill_(start)
    for batch in batches[start:]:
        i = int(plan.cursor)
        got = plan.read(plan.bucket[i])
        assert torch.equal(got.x, batch.x) and torch.equal(got.inverse, batch.inverse)
        plan.cursor.add_(1)


def test_plan_refuses_batches_of_unequal_size(tiny):
    from gears.train.graph_step import PlanUnsupported

    # 16 cells per condition in groups of 5: remainder groups of 1 make smaller mixed steps
    loader = tiny.get_dataloader_distributed(10, 64, batching="grouped", cells_per_group=5)
    plan = EpochPlan(loader["train_loader"], torch.device("cpu"))
    with pytest.raises(PlanUnsupported, match="unequal size"):
        plan.set_epoch(0)


# ------------------------------------------------------------------------- the planned step
def _net(pert_data: PertData, kind: str):
    """The fast network, the reference, the fork that reads a context covariate, or a network
    that reads x; all from seed 0."""
    from test_batch import FORK, _reads_x_model

    from gears.compat.api import GEARS
    from gears.config import ModelConfig
    from gears.train.engine import seed_everything

    if kind == "reads_x":
        return _reads_x_model(pert_data)
    seed_everything(0)
    impl = {"fast": "fast", "reference": "reference", "fork": FORK}[kind]
    return GEARS(pert_data, device="cpu").initialize(ModelConfig(hidden_size=8, impl=impl))


def _trainer(pert_data: PertData, kind: str, planned: bool, double: bool = False, **kw):
    from gears.config import TrainConfig
    from gears.model.batch import declared_covariates
    from gears.train.distributed import DistEnv
    from gears.train.engine import Trainer

    model = _net(pert_data, kind)
    if double:
        model.model.double()
    cfg = TrainConfig(**{"epochs": 2, "batch_size": 8, "cuda_graphs": planned, **kw})
    covariates = model.evaluator.cell_covariates(declared_covariates(model.model))
    loaders = pert_data.get_dataloader_distributed(cfg.batch_size, 64, covariates=covariates)
    trainer = Trainer(model.model, pert_data, cfg, model.model_config(), DistEnv())
    return trainer, {"train_loader": loaders["train_loader"]}


@pytest.fixture(scope="module")
def lines(tmp_path_factory) -> PertData:
    from test_batch import _screen

    return _screen(tmp_path_factory.mktemp("lines"), context=True)


def _copy_state(src, dst) -> None:
    """dst's parameters, buffers and optimizer state set to src's, in place."""
    dst.net.load_state_dict(src.net.state_dict())
    for p_src, p_dst in zip(src.net.parameters(), dst.net.parameters(), strict=True):
        for key, value in src.opt.state.get(p_src, {}).items():
            if torch.is_tensor(value) and key in dst.opt.state.get(p_dst, {}):
                dst.opt.state[p_dst][key].copy_(value)


def _max_diff(a: dict, b: dict) -> tuple[float, str]:
    return max(
        ((b[k].double() - v.double()).abs().max().item(), k)
        for k, v in a.items()
        if v.is_floating_point()
    )


@pytest.mark.parametrize("kind", ["fast", "reference", "fork", "reads_x"])
def test_planned_step_is_todays_step(lines, kind):
    """50 steps over 2 epochs (the cosine schedule filling the tensor learning rate in place):
    from the same state, each planned step (padded weighted rows, dense graph products, fused
    capturable Adam) leaves parameters, buffers and optimizer state within 1e-6 of today's eager
    step (its row layouts), on the fast network, the reference, a fork reading a covariate and
    a network reading x. In float64, each step from a common state: in float32 the summation
    order alone moves a gradient that is zero by design (a bias before a batch-norm) by
    rounding noise, which Adam turns into a full step (lr), and training is chaotic at these
    settings (a 1e-10 difference grows ~4x a step)."""
    torch.set_num_threads(1)  # (the suite's fixture restores the count)
    eager, loaders = _trainer(lines, kind, planned=False, double=True)
    planned, planned_loaders = _trainer(lines, kind, planned=True, double=True)
    runner = planned.step_runner(planned_loaders["train_loader"])
    assert runner is not None
    steps = 0
    for epoch in (0, 1):
        for t in (eager, planned):
            set_train_mode(t.model, t.net, False)
        loaders["train_loader"].set_epoch(epoch)
        planned_loaders["train_loader"].set_epoch(epoch)
        runner.plan.set_epoch(epoch)
        runner.begin_epoch(0)
        for i, batch in enumerate(loaders["train_loader"]):
            _copy_state(eager, planned)
            eager.train_step(batch, eager.row_layout(batch.counts), True)
            runner.run(i)
            diff, name = _max_diff(eager.net.state_dict(), planned.net.state_dict())
            assert diff <= 1e-6, (epoch, i, name, diff)
            for p_e, p_p in zip(eager.net.parameters(), planned.net.parameters()):
                for key, value in eager.opt.state[p_e].items():
                    got = planned.opt.state[p_p][key]
                    assert (got.double() - value.double()).abs().max() <= 1e-6, (i, key)
            steps += 1
            if steps == 50:
                return
        for t in (eager, planned):
            t.sched.step()
        assert float(planned.opt.param_groups[0]["lr"]) == eager.opt.param_groups[0]["lr"]
    raise AssertionError(f"only {steps} steps")


@pytest.mark.parametrize("kind", ["fast"])
def test_planned_training_learns_as_eager(lines, kind):
    """Trainer.fit with train.cuda_graphs=true on CPU (the runner without the capture): the
    same epoch losses as eager steps to float rounding, the same step count."""
    eager, loaders = _trainer(lines, kind, planned=False)
    eager.fit(loaders, progress=False)
    planned, loaders = _trainer(lines, kind, planned=True)
    planned.fit(loaders, progress=False)
    assert planned.runner is not None and planned.step == eager.step >= 50
    assert planned.history.train_loss == pytest.approx(eager.history.train_loss, rel=1e-4)


# --------------------------------------------------------------- capturable: CPU proofs
def _runner(pert_data: PertData, batch_size: int = 8, kind: str = "fast"):
    planned, loaders = _trainer(pert_data, kind, planned=True, batch_size=batch_size)
    loader = loaders["train_loader"]
    runner = planned.step_runner(loader)
    set_train_mode(planned.model, planned.net, False)
    loader.set_epoch(0)
    runner.plan.set_epoch(0)
    runner.begin_epoch(0)
    runner.run(0)  # the first step allocates the gradients and the optimizer state
    return planned, runner


def _same_bucket_pair(plan: EpochPlan) -> tuple[int, int]:
    """Two batches after the first with the same bucket and different numbers of groups."""
    groups = plan.host["n_groups"]
    for i in range(1, len(plan)):
        for j in range(i + 1, len(plan)):
            if plan.bucket[i] == plan.bucket[j] and groups[i] != groups[j]:
                return i, j
    raise AssertionError("no two batches of one bucket with different groups")


@pytest.mark.parametrize("kind", ["fast", "reads_x"])
def test_batches_of_a_bucket_dispatch_identical_ops(lines, kind):
    """Forward and backward, clipping and Adam: the same op names, shapes, dtypes and
    non-tensor arguments for two batches of one bucket with different numbers of distinct
    perturbations (today's eager step lays them out differently: different ops)."""
    from opcount import OpRecorder

    torch.set_num_threads(1)
    trainer, runner = _runner(lines, 32, kind)
    i, j = _same_bucket_pair(runner.plan)
    recorded = []
    for k in range(1, j + 1):
        recorder = OpRecorder()
        with recorder:
            runner.run(k)
        recorded.append(recorder.ops)
    first, second = recorded[i - 1], recorded[j - 1]
    assert len(first) > 100
    assert first == second


def test_todays_step_dispatches_different_ops_per_batch(lines):
    """The same two batches through today's eager step: their op sequences differ (the layout
    follows each batch's counts), which is why it could not be replayed as one graph."""
    from opcount import OpRecorder

    torch.set_num_threads(1)
    eager, loaders = _trainer(lines, "fast", planned=False, batch_size=32)
    plan = EpochPlan(loaders["train_loader"], torch.device("cpu"))
    loaders["train_loader"].set_epoch(0)
    plan.set_epoch(0)
    i, j = _same_bucket_pair(plan)
    batches = list(loaders["train_loader"])
    recorded = []
    for k in (i, j):
        recorder = OpRecorder()
        with recorder:
            eager.train_step(batches[k], eager.row_layout(batches[k].counts), True)
        recorded.append(recorder.ops)
    assert recorded[0] != recorded[1]


def _ids(trainer, runner) -> dict:
    """id() of every Python attribute a step could rebind: the modules', the optimizer's and its
    state's and groups', the runner's and the plan's, each parameter's .grad."""
    seen = {}
    for name, module in trainer.net.named_modules():
        for attr in ("__dict__", "_parameters", "_buffers", "_modules"):
            for key, value in getattr(module, attr).items():
                seen[(name, attr, key)] = id(value)
    for obj, label in ((trainer.opt, "opt"), (runner, "runner"), (runner.plan, "plan")):
        for key, value in vars(obj).items():
            seen[(label, key)] = id(value)
    for k, group in enumerate(trainer.opt.param_groups):
        seen.update({("group", k, key): id(v) for key, v in group.items()})
    for k, p in enumerate(runner.params):
        seen[("grad", k)] = id(p.grad)
        seen.update({("state", k, key): id(v) for key, v in trainer.opt.state[p].items()})
    seen.update({("plan.tensors", k): id(v) for k, v in runner.plan.tensors.items()})
    return seen


def test_step_keeps_storage_and_rebinds_no_attribute(lines):
    """Between steps, the storage of the parameters, gradients, optimizer state, buffers,
    learning rate, accumulators, cursor and plan does not move, and the step rebinds no Python
    attribute (what a replayed graph would not see)."""
    torch.set_num_threads(1)
    trainer, runner = _runner(lines, 8)

    def pointers():
        tensors = runner.state_tensors() + list(runner.plan.tensors.values())
        tensors += [g["lr"] for g in trainer.opt.param_groups]
        return [t.data_ptr() for t in tensors]

    before, ids = pointers(), _ids(trainer, runner)
    assert all(p.grad is not None for p in runner.params)
    assert all(trainer.opt.state[p] for p in runner.params)
    for i in (1, 2, 3):
        runner.run(i)
        assert pointers() == before
        assert _ids(trainer, runner) == ids
    assert int(runner.plan.cursor) == 4


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_step_has_no_host_sync_or_host_tensor_under_the_standin(tmp_path, monkeypatch, optimizer):
    """GEARS_DEVICE_STANDIN=1: the plan, model and optimizer on the stand-in device; the steps
    make no host sync (SyncGuard), read no host tensor, and copy nothing from the host. With
    each optimizer (SGD's foreach update reads a tensor learning rate on the host: a capture
    on a GPU then fails)."""
    from opcount import HostTensorWatch, OpRecorder, SyncGuard

    from gears.device import STANDIN_ENV

    monkeypatch.setenv(STANDIN_ENV, "1")
    torch.set_num_threads(1)
    pert_data = tiny_split(tmp_path)
    from gears.compat.api import GEARS
    from gears.config import ModelConfig, TrainConfig
    from gears.train.distributed import DistEnv
    from gears.train.engine import Trainer, seed_everything

    seed_everything(0)
    model = GEARS(pert_data, device="cpu").initialize(ModelConfig(hidden_size=8))
    cfg = TrainConfig(batch_size=8, cuda_graphs=True, optimizer=optimizer)
    loader = pert_data.get_dataloader_distributed(8, 64, device="cpu")["train_loader"]
    trainer = Trainer(model.model, pert_data, cfg, model.model_config(), DistEnv())
    runner = trainer.step_runner(loader)
    assert runner is not None
    set_train_mode(trainer.model, trainer.net, False)
    loader.set_epoch(0)
    runner.plan.set_epoch(0)
    runner.begin_epoch(0)
    runner.run(0)
    device = runner.state_tensors() + list(runner.plan.tensors.values()) + [runner.plan.expr]
    device += [g["lr"] for g in trainer.opt.param_groups] + list(trainer.net.buffers())
    device += list(trainer.net._dense_graphs.values())  # (fixed_shape_graphs's)
    device += [trainer.gene_mask, trainer.ctrl_mean]
    recorder, host = OpRecorder(), HostTensorWatch(device)
    with SyncGuard(), recorder, host:
        for i in (1, 2, 3):
            runner.run(i)
    # (a copy between devices names one; _to_copy without a device casts a dtype)
    moves = [
        op
        for op in recorder.ops
        if "lift_fresh" in op[0] or ("copy" in op[0] and "'device'" in str(op[2]))
    ]
    assert len(recorder.ops) > 300
    assert host.found == [] and moves == []


class _FakeCuda:
    """torch.cuda's capture API on the CPU: streams that do nothing, a graph context that runs
    its block (a real capture records it without running it: the runner undoes its effects
    either way), or raises `fail`."""

    def __init__(self, fail: Exception | None = None):
        self.fail, self.captures, self.pools = fail, 0, []

    class Stream:
        def wait_stream(self, other):
            pass

    def current_stream(self):
        return self.Stream()

    def stream(self, stream):
        import contextlib

        return contextlib.nullcontext()

    def graph(self, graph, pool=None):
        import contextlib

        self.pools.append(pool)
        if self.fail is not None:
            raise self.fail
        self.captures += 1
        return contextlib.nullcontext()


class _FakeGraph:
    """A captured bucket: replay runs the runner's step function for it."""

    def __init__(self, runner, bucket: int):
        self.runner, self.bucket = runner, bucket

    def replay(self):
        self.runner.step_fn(self.bucket)

    def pool(self):
        return ("pool", id(self.runner))


def _captured_runner(pert_data, fail=None):
    trainer, runner = _runner(pert_data, 32)
    runner.capture, runner.cuda = True, _FakeCuda(fail)
    runner.new_graph = lambda bucket: _FakeGraph(runner, bucket)
    return trainer, runner


@pytest.mark.parametrize(
    "fail", [None, RuntimeError("operation not permitted when stream is capturing")]
)
def test_capture_undoes_its_warm_up_and_replays_the_step(lines, capsys, fail):
    """The capture path with a stand-in for torch.cuda's graphs: the warm-up steps and the
    captured call leave no trace (parameters, buffers, optimizer state, accumulators, cursor),
    every bucket is captured once into one shared pool, and replays train exactly as the
    uncaptured step; a capture that fails says so in one line and trains on eagerly, the same."""
    torch.set_num_threads(1)
    plain_trainer, plain = _runner(lines, 32)
    trainer, runner = _captured_runner(lines, fail)
    for i in range(1, 8):
        plain.run(i)
        runner.run(i)
        for a, b in zip(plain.state_tensors(), runner.state_tensors(), strict=True):
            assert torch.equal(a, b), i
    buckets = {runner.plan.bucket[i] for i in range(1, 8)}
    err = capsys.readouterr().err
    if fail is None:
        assert set(runner.graphs) == buckets and runner.cuda.captures == len(buckets)
        assert runner.cuda.pools == [None] + [("pool", id(runner))] * (len(buckets) - 1)
        assert "capturing" not in err
        runner.begin_epoch(0)  # a new epoch keeps the graphs; storage that moved drops them
        assert set(runner.graphs) == buckets
        group = trainer.opt.param_groups[0]
        group["lr"] = group["lr"].clone()  # (as loading an optimizer state does)
        runner.begin_epoch(0)
        assert runner.graphs == {}
    else:
        assert runner.graphs == {runner.plan.bucket[1]: None} and not runner.capture
        lines_out = [line for line in err.splitlines() if "train.cuda_graphs" in line]
        assert lines_out == [
            "train.cuda_graphs: capturing the step failed (RuntimeError: operation not "
            "permitted when stream is capturing); training with eager steps"
        ]


def test_a_capturing_runner_replays_its_first_step_too(lines, capsys):
    """A process's first step (which allocates the gradients and the optimizer state) is run and
    undone, then captured and replayed like every other: a run resumed in a new process then
    takes the replayed kernels at every step, as the run that never stopped did (on a GPU an
    uncaptured step may round differently: a resumed 2-rank run differed by 2.4e-2). The
    state after each step equals the uncaptured runner's."""
    torch.set_num_threads(1)
    plain_trainer, plain = _runner(lines, 32)  # (its first step is uncaptured: no capture)
    trainer, loaders = _trainer(lines, "fast", planned=True, batch_size=32)
    loader = loaders["train_loader"]
    runner = trainer.step_runner(loader)
    runner.capture, runner.cuda = True, _FakeCuda()
    runner.new_graph = lambda bucket: _FakeGraph(runner, bucket)
    set_train_mode(trainer.model, trainer.net, False)
    loader.set_epoch(0)
    runner.plan.set_epoch(0)
    runner.begin_epoch(0)
    runner.run(0)
    assert set(runner.graphs) == {runner.plan.bucket[0]}
    for i in range(1, 5):
        for a, b in zip(plain.state_tensors(), runner.state_tensors(), strict=True):
            assert torch.equal(a, b), i
        plain.run(i)
        runner.run(i)
    assert "capturing" not in capsys.readouterr().err


def test_capture_warms_up_and_captures_on_the_batch_it_captures(lines, capsys):
    """The warm-up calls and the capture each start from the state before them: they read the
    batch being captured, not the cursor's next ones, which may belong to a larger bucket (their
    groups then index past the captured bucket's rows) or lie past the epoch's last batch (the
    plan's rows indexed out of range: a device-side assert on a GPU). Captured at the epoch's
    last batch here: a warm-up that moved the cursor reads past the plan."""
    torch.set_num_threads(1)
    trainer, runner = _captured_runner(lines)
    plan, read = runner.plan, runner.plan.read
    cursors = []

    def reading(bucket, index=None):
        cursors.append(int(plan.cursor))
        return read(bucket, index)

    plan.read = reading
    last = len(plan) - 1
    assert last >= 3
    plan.cursor.fill_(last)
    runner.run(last)
    assert "capturing" not in capsys.readouterr().err
    assert runner.graphs.get(plan.bucket[last]) is not None
    # two warm-up calls, the capture (the stand-in runs it) and the replay: all at `last`
    assert cursors == [last] * 4 and int(plan.cursor) == last + 1


@pytest.mark.parametrize("check_every", [1, 4])
def test_planned_nan_loss_names_epoch_step_and_the_batch_conditions(tiny, tmp_path, check_every):
    """The planned step's device flag (the first bad batch of the epoch) read at the check
    interval: the same NonFiniteLossError as the eager step's, naming the bad batch."""
    from test_faults import _poisoned_trainer

    from gears.errors import NonFiniteLossError

    loaders = tiny.get_dataloader(8, 16)
    trainer = _poisoned_trainer(tiny, bad_call=3, out_dir=tmp_path, cuda_graphs=True)
    trainer.check_every = check_every
    loader = loaders["train_loader"]
    loader.set_epoch(0)
    third = [b for _, b in zip(range(3), loader, strict=False)][2]
    expected = [tiny.conditions[int(c)] for c in third.uniq_cond]
    with pytest.raises(NonFiniteLossError) as info:
        trainer.fit(loaders, progress=False)
    assert trainer.runner is not None
    message = str(info.value)
    assert "in epoch 1, at step 3 in all (batch 3 of the epoch)" in message
    assert str(expected[:20]) in message
    assert not (tmp_path / "checkpoints").exists()


def test_planned_run_resumes_an_eager_checkpoint_with_a_capturable_optimizer(lines, tmp_path):
    """train.cuda_graphs=null: a run checkpointed on the CPU (eager steps: Adam not capturable)
    and resumed on a GPU (the planned step): the optimizer is capturable again (else every
    capture would fail) and trains on. The GPU's choice is stood in for by `planned`."""
    kw = {"limit_batches": 3, "schedule": "constant"}
    eager, loaders = _trainer(lines, "fast", planned=None, epochs=1, **kw)
    eager.out_dir = str(tmp_path)
    eager.fit(loaders, progress=False)
    assert eager.runner is None
    resumed, loaders = _trainer(lines, "fast", planned=None, epochs=2, **kw)
    resumed.out_dir, resumed.planned = str(tmp_path), True
    assert resumed.resume()
    assert all(g["capturable"] for g in resumed.opt.param_groups)
    resumed.fit(loaders, progress=False)
    assert resumed.runner is not None and resumed.step == 6


def test_planned_run_resumes_its_own_checkpoint(lines, tmp_path):
    """A planned run checkpointed and resumed by a planned run (a killed rank restarted): the
    checkpoint's fingerprint is the run's, not that of the dense graph products the planned step
    builds at its first epoch (a fingerprint taken after them refused the resume on a GPU:
    "these differ: graphs")."""
    kw = {"limit_batches": 3, "schedule": "constant"}
    first, loaders = _trainer(lines, "fast", planned=True, epochs=1, **kw)
    first.out_dir = str(tmp_path)
    first.fit(loaders, progress=False)
    assert first.runner is not None
    resumed, loaders = _trainer(lines, "fast", planned=True, epochs=2, **kw)
    resumed.out_dir = str(tmp_path)
    assert resumed.resume()
    resumed.fit(loaders, progress=False)
    assert resumed.runner is not None and resumed.step == 6
    # and where the run that never stopped ends, bit for bit
    whole, loaders = _trainer(lines, "fast", planned=True, epochs=2, **kw)
    whole.fit(loaders, progress=False)
    assert resumed.state == whole.state
    for key, value in whole.net.state_dict().items():
        assert torch.equal(resumed.net.state_dict()[key], value), key


@pytest.mark.slow
def test_compiled_network_inside_the_planned_step_is_the_planned_step(lines):
    """train.compile together with the planned step (the compiled network inside what a GPU
    captures): from the same state, each of 3 steps of one bucket equals the uncompiled planned
    step within 1e-6 (float64: parameters, buffers, optimizer state)."""
    torch.set_num_threads(1)  # (the suite's fixture restores the count)
    plain, plain_loaders = _trainer(lines, "fast", planned=True, double=True)
    compiled, compiled_loaders = _trainer(lines, "fast", planned=True, double=True, compile=True)
    runners = [
        t.step_runner(ld["train_loader"])
        for t, ld in ((plain, plain_loaders), (compiled, compiled_loaders))
    ]
    assert all(r is not None for r in runners)
    assert compiled.cfg.compile and runners[1].model is not compiled.net  # the compiled wrapper
    for t, r in zip((plain, compiled), runners, strict=True):
        set_train_mode(t.model, t.net, False)
        r.plan.set_epoch(0)
        r.begin_epoch(0)
    for i in range(3):
        _copy_state(plain, compiled)
        for r in runners:
            r.run(i)
        diff, name = _max_diff(plain.net.state_dict(), compiled.net.state_dict())
        assert diff <= 1e-6, (i, name, diff)
        for p_a, p_b in zip(plain.net.parameters(), compiled.net.parameters(), strict=True):
            for key, value in plain.opt.state[p_a].items():
                got = compiled.opt.state[p_b][key]
                assert (got.double() - value.double()).abs().max() <= 1e-6, (i, key)
