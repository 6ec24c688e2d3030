"""Tests for the planned evaluation forward (gears/train/graph_step.py ForwardRunner):
predict_deltas
in fixed-shape chunks on static buffers gives today's numbers, and is capturable (same ops for
every chunk, no host sync or host tensor, storage that never moves); the Trainer's validation
and the run's test evaluation use it with train.cuda_graphs on."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import tiny_split
from test_graph_step import _FakeCuda, _net, _trainer

from gears.model.batch import declared_covariates, reads_x
from gears.train.evaluate import EVAL_CHUNK, predict_deltas
from gears.train.graph_step import ForwardRunner


@pytest.fixture(scope="module")
def lines(tmp_path_factory):
    from test_batch import _screen

    return _screen(tmp_path_factory.mktemp("lines"), context=True)


def _inputs(pert_data, model, n: int, seed: int = 0):
    """n rows: perturbations of the screen's conditions (controls among them), random
    covariate codes of the model's categories, random control cells for a network reading x."""
    rng = np.random.default_rng(seed)
    net = model.model
    pert_index = pert_data.cond_pert_index[rng.integers(0, len(pert_data.cond_pert_index), n)]
    codes = {
        name: rng.integers(0, len(model.evaluator.categories[name]), n)
        for name in declared_covariates(net)
    }
    x = None
    if reads_x(net):
        X = pert_data.expr.numpy()
        x = np.asarray(X[rng.integers(0, X.shape[0], n)], dtype=np.float32)
    return np.asarray(pert_index), codes, x


def _randomise_batchnorm(net, seed: int = 0) -> None:
    """Running statistics away from their initial 0 / 1 (eval mode reads them)."""
    gen = torch.Generator().manual_seed(seed)
    for module in net.modules():
        if (
            isinstance(module, torch.nn.modules.batchnorm._BatchNorm)
            and module.running_mean is not None
        ):
            module.running_mean.copy_(torch.randn(module.running_mean.shape, generator=gen))
            module.running_var.copy_(torch.rand(module.running_var.shape, generator=gen) + 0.5)


# Tolerance: the runner's network propagates over the gene graphs as dense products
# (fixed_shape_graphs, as the planned training step) where eager uses sparse ones: the same
# sums in another order. And every forward renormalises GEARS's max-norm embedding rows in
# place, so two eager calls on a fresh network already differ by float32 rounding (~1.5e-8 on
# outputs of ~1). Seen: 3e-8 on the fast network, 0 on the other three.
ATOL, RTOL = 1e-6, 0.0


@pytest.mark.parametrize("kind", ["fast", "reference", "fork", "reads_x"])
def test_forward_runner_is_todays_predict_deltas(lines, kind):
    """150 rows (chunks of 64, 64 and 22 + 42 padding rows): the runner's change (and
    log-variance) equals today's eager predict_deltas on the fast network, the reference, the
    covariate fork and a network that reads x; a second call (other rows, same shapes) too."""
    torch.set_num_threads(1)
    model = _net(lines, kind)
    net = model.model
    _randomise_batchnorm(net)
    calls = [_inputs(lines, model, n, seed) for n, seed in ((150, 0), (70, 1))]
    eager = [predict_deltas(net, p, covariates=c, x=x) for p, c, x in calls]
    for rows in (EVAL_CHUNK, 48):  # (chunks of the runner's size)
        runner = ForwardRunner(net, capture=False, rows=rows)
        _same_as_eager(net, runner, calls, eager)
        assert len(runner.static) == 1  # one chunk shape


def _same_as_eager(net, runner, calls, eager) -> None:
    for (p, c, x), (delta, logvar) in zip(calls, eager, strict=True):
        got, got_logvar = predict_deltas(net, p, covariates=c, x=x, runner=runner)
        assert got.dtype == np.float64 and got.shape == delta.shape
        np.testing.assert_allclose(got, delta, atol=ATOL, rtol=RTOL)
        assert (got_logvar is None) == (logvar is None)
        if logvar is not None:
            np.testing.assert_allclose(got_logvar, logvar, atol=ATOL, rtol=RTOL)


class _FakeGraph:
    """A captured chunk shape: replay runs the runner's forward function for it."""

    def __init__(self, runner, key):
        self.runner, self.key = runner, key

    def replay(self):
        self.runner.replays += 1
        self.runner.forward_fn(self.key)

    def pool(self):
        return ("pool", id(self.runner))


def test_forward_runner_captured_with_the_standin(lines, capsys):
    """The capture path with the training step's stand-in for torch.cuda's graphs: one graph
    per chunk shape, in one pool, replayed for every chunk, the uncaptured runner's numbers
    exactly; a capture that fails says so in one line and evaluates on, the same numbers."""
    torch.set_num_threads(1)
    model = _net(lines, "fast")
    net = model.model
    p, c, _ = _inputs(lines, model, 150)
    predict_deltas(net, p, covariates=c)  # the embedding rows renormalised (see ATOL)
    plain = ForwardRunner(net, capture=False, rows=EVAL_CHUNK)
    want, _ = predict_deltas(net, p, covariates=c, runner=plain)
    key = (p.shape[1], None, ())
    for fail in (None, RuntimeError("operation not permitted when stream is capturing")):
        runner = ForwardRunner(net, capture=True, rows=EVAL_CHUNK)
        runner.cuda, runner.replays = _FakeCuda(fail), 0
        runner.new_graph = lambda key, r=runner: _FakeGraph(r, key)
        got, _ = predict_deltas(net, p, covariates=c, runner=runner)
        assert np.array_equal(got, want)
        err = capsys.readouterr().err
        if fail is None:
            assert list(runner.graphs) == [key] and runner.replays == 3
            assert runner.cuda.captures == 1 and runner.cuda.pools == [None]
            assert runner.pool == ("pool", id(runner))
            assert "capturing" not in err
            predict_deltas(net, p, covariates=c, runner=runner)
            assert runner.cuda.captures == 1
            first = next(net.parameters())
            first.data = first.data.clone()  # (as loading a state with assign=True does)
            predict_deltas(net, p, covariates=c, runner=runner)
            assert runner.cuda.captures == 2
        else:
            assert runner.graphs == {key: None} and not runner.capture and runner.replays == 0
            assert [line for line in err.splitlines() if "train.cuda_graphs" in line] == [
                "train.cuda_graphs: capturing the evaluation forward failed (RuntimeError: "
                "operation not permitted when stream is capturing); evaluating with eager "
                "forwards"
            ]


# --------------------------------------------------------------- capturable: CPU proofs
@pytest.mark.parametrize("kind", ["fast", "reads_x"])
def test_chunks_of_a_shape_dispatch_identical_ops_and_keep_storage(lines, kind):
    """A full chunk and a padded one (64 and 22 real rows, other perturbations): the forward
    dispatches the same ops in the same shapes, and the static inputs and outputs, parameters
    and buffers keep their storage (today's eager chunks of 64 and 22 rows differ)."""
    from opcount import OpRecorder

    torch.set_num_threads(1)
    model = _net(lines, kind)
    net = model.model.eval()
    runner = ForwardRunner(net, capture=False, rows=EVAL_CHUNK)
    calls = [_inputs(lines, model, n, seed) for n, seed in ((64, 0), (22, 1))]
    with torch.no_grad():
        runner.run(*_args(calls[0]))  # the first call allocates the outputs
        (key,) = runner.static
        pointers = [t.data_ptr() for t in runner.static[key].values()], runner.storage()
        recorded = []
        for call in calls:
            recorder = OpRecorder()
            runner.run(*_args(call))
            with recorder:
                runner.forward_fn(key)
            recorded.append(recorder.ops)
            assert ([t.data_ptr() for t in runner.static[key].values()], runner.storage()) == (
                pointers
            )
    assert len(recorded[0]) > 50 and recorded[0] == recorded[1]
    eager = []
    for n, _ in ((64, 0), (22, 1)):
        recorder = OpRecorder()
        p, c, x = _inputs(lines, model, n)
        with recorder:
            predict_deltas(net, p, covariates=c, x=x)
        eager.append([op for op in recorder.ops if "copy" not in op[0]])
    assert eager[0] != eager[1]


def _args(call):
    p, c, x = call
    return p, None if x is None else torch.as_tensor(x), c


def test_forward_has_no_host_sync_or_host_tensor_under_the_standin(tmp_path, monkeypatch):
    """GEARS_DEVICE_STANDIN=1: the network and static buffers on the stand-in device; the
    forward a graph replays makes no host sync (SyncGuard), reads no host tensor and copies
    nothing from the host (the inputs are copied in before it, the outputs out after it)."""
    from opcount import HostTensorWatch, OpRecorder, SyncGuard

    from gears.device import STANDIN_ENV

    monkeypatch.setenv(STANDIN_ENV, "1")
    torch.set_num_threads(1)
    pert_data = tiny_split(tmp_path)
    from gears.compat.api import GEARS
    from gears.config import ModelConfig
    from gears.train.engine import seed_everything

    seed_everything(0)
    model = GEARS(pert_data, device="cpu").initialize(ModelConfig(hidden_size=8))
    net = model.model.eval()
    runner = ForwardRunner(net, capture=False, rows=EVAL_CHUNK)
    p = np.asarray(pert_data.cond_pert_index[:30])
    with torch.no_grad():
        runner.run(p, None, {})
        (key,) = runner.static
        device = list(runner.static[key].values()) + list(net.parameters()) + list(net.buffers())
        device += list(net._dense_graphs.values())  # (fixed_shape_graphs's, not buffers)
        recorder, host = OpRecorder(), HostTensorWatch(device)
        with SyncGuard(), recorder, host:
            for _ in range(2):
                runner.forward_fn(key)
    moves = [
        op
        for op in recorder.ops
        if "lift_fresh" in op[0] or ("copy" in op[0] and "'device'" in str(op[2]))
    ]
    assert len(recorder.ops) > 50
    assert host.found == [] and moves == []


# ------------------------------------------------------------------------------ wiring
def test_trainer_validates_and_the_run_tests_with_the_runner(lines):
    """train.cuda_graphs=true on CPU: the Trainer's per-epoch validation runs the evaluator's
    ForwardRunner (the one the run's test evaluation and GEARS.predict_changes then use), with
    eager's metrics; the default on CPU (null) keeps eager forwards and no runner."""
    torch.set_num_threads(1)
    kw = {"epochs": 1, "limit_batches": 3}
    planned, loaders = _trainer(lines, "fast", planned=True, **kw)
    loaders["val_loader"] = None
    planned.fit(loaders, progress=False)
    runner = planned.evaluator.forward_runner
    assert isinstance(runner, ForwardRunner) and runner.net is planned.net
    assert len(runner.static) == 1  # the validation's chunks ran through it
    val = planned.evaluator.quick("val")
    planned.evaluator.forward_runner = None
    assert planned.evaluator.quick("val") == pytest.approx(val, rel=1e-6, abs=1e-7)
    default, loaders = _trainer(lines, "fast", planned=None, **kw)
    loaders["val_loader"] = None
    default.fit(loaders, progress=False)
    assert default.runner is None and default.evaluator.forward_runner is None


def test_gears_train_leaves_the_runner_to_test_metrics_and_predictions(lines):
    """GEARS.train with train.cuda_graphs=true (the covariate fork): the run's test metrics
    (evaluator.predict_means, as gears/cli/job.py takes them) and GEARS.predict_changes go through
    the trained network's ForwardRunner, with eager's numbers."""
    torch.set_num_threads(1)
    model = _net(lines, "fork")
    model.train(epochs=1, limit_batches=2, batch_size=8, cuda_graphs=True, progress=False)
    runner = model.evaluator.forward_runner
    assert isinstance(runner, ForwardRunner) and runner.net is model.model
    (name,) = declared_covariates(model.model)
    value = model.evaluator.categories[name][1]
    perts = [[p] for p in model.pert_list[:3]]
    calls = []
    real = runner.run
    runner.run = lambda *a: calls.append(1) or real(*a)
    test = model.evaluator.predict_means("test")
    assert calls
    calls.clear()
    change = model.predict_changes(perts, {name: value})
    assert calls
    model.evaluator.forward_runner = None
    np.testing.assert_allclose(model.evaluator.predict_means("test"), test, atol=ATOL, rtol=0)
    eager, _ = model.predict_changes(perts, {name: value})
    np.testing.assert_allclose(eager, change[0], atol=ATOL, rtol=0)
