"""The reference network (gears/model/reference.py) is the oracle of the fast one (network.py and
kernels.py): from the same weights, every output, every parameter's gradient and the running
statistics agree, at 1,000 genes and hidden size 64, for every row layout the engine gives the
fast network, in training and evaluation mode, and every fused kernel takes part.

Tolerances: max|fast - reference| <= tol * max|reference| per tensor (for gradients, plus tol
times the largest gradient: the biases before a batch-norm have zero gradient up to rounding).
float64: 1e-10 (measured <= 2e-14; 3.5e-12 on a batch of identical cells, allowed 1e-9 there);
after 6 Adam steps 1e-10 (measured 2e-12). float32 fast network against the float64 reference:
outputs and running statistics 2e-5 (measured 1.3e-6), gradients 5e-3 (measured 3e-4; the
float32 reference itself is further off, its batch-norm gradients cancel over 14,000 rows).
"""

from __future__ import annotations

import collections
import contextlib
import re

import pytest
import torch
import torch.distributed as dist

from gears.config import ModelConfig
from gears.errors import GearsInputError
from gears.model import kernels
from gears.model.batch import ModelBatch
from gears.model.network import GEARSNet
from gears.model.reference import GEARSReference

G, P, H = 1000, 120, 64  # genes, perturbable genes, hidden size
TOL64 = 1e-10
TOL32, GRAD_TOL32 = 2e-5, 5e-3  # float32 fast network against the float64 reference

# Every autograd Function of the fast path, and the compiled path's custom op.
FUNCTIONS = sorted(
    name
    for name, obj in vars(kernels).items()
    if isinstance(obj, type) and issubclass(obj, torch.autograd.Function)
) + ["graph_propagate"]


def _graph(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k distinct in-neighbours per node, no self-loops, weights in [0.1, 1.1): a top-k graph
    as gears/data/graphs.py builds, ([2, n * k] source -> target, [n * k])."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(n, n, generator=gen).fill_diagonal_(-1.0)
    source = scores.topk(k, dim=1).indices.reshape(-1)
    target = torch.arange(n).repeat_interleave(k)
    return torch.stack([source, target]), torch.rand(n * k, generator=gen) + 0.1


GO, CO = _graph(P, 10, 1), _graph(G, 20, 2)


def _pair(uncertainty=False, layers=1, dtype=torch.float64) -> tuple[GEARSNet, GEARSReference]:
    """The fast network and the reference with the same weights (the same seed builds both;
    the batch-norms' affine parameters and running statistics then drawn at random)."""
    cfg = ModelConfig(
        hidden_size=H,
        uncertainty=uncertainty,
        num_go_gnn_layers=layers,
        num_gene_gnn_layers=layers,
    )
    torch.manual_seed(0)
    fast = GEARSNet(cfg, G, P, *GO, *CO).to(dtype)
    ref = GEARSReference(cfg, G, P, *GO, *CO).to(dtype)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # batch-norms away from their initial 1, 0 (a ReLU's kink at 0)
        for m in fast.modules():
            if isinstance(m, torch.nn.BatchNorm1d):
                n = m.num_features  # (drawn in float64 whatever the dtype: the same values)
                m.weight.copy_(torch.rand(n, generator=gen, dtype=torch.float64) + 0.5)
                m.bias.copy_(torch.randn(n, generator=gen, dtype=torch.float64) * 0.5)
                m.running_mean.copy_(torch.randn(n, generator=gen, dtype=torch.float64) * 0.1)
                m.running_var.copy_(torch.rand(n, generator=gen, dtype=torch.float64) + 0.5)
    ref.load_state_dict(fast.state_dict())
    return fast, ref


def _batch(case: str, seed: int = 3):
    """A batch as the engine hands it to the fast network: (distinct rows [U, P], counts, which
    row each cell is [B]). random: 14 cells drawn from 30 perturbations (repeats, two
    controls), weighted rows; grouped: 4 perturbations x 4 cells, one count for every row;
    unequal: counts 4, 4, 2, 2, 1, 1 (a control among them); cells: one row per cell;
    controls: 6 control cells (GEARS skips the fusion MLP); lone: 5 controls and one perturbed
    cell (GEARS feeds it to the fusion MLP twice)."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, P, (30, 2), generator=gen)
    pool[:12, 1] = -1  # singles
    pool[12:14] = -1  # controls
    if case == "grouped":
        rows = pool[torch.randperm(30, generator=gen)[:4]]
        return rows, 4.0, torch.arange(4).repeat_interleave(4)
    if case == "controls":
        return pool[12:13], 6.0, torch.zeros(6, dtype=torch.long)
    if case == "lone":
        return pool[11:13], torch.tensor([1, 5]), torch.tensor([1, 1, 0, 1, 1, 1])
    if case == "unequal":
        counts = torch.tensor([4, 4, 2, 2, 1, 1])
        rows = torch.cat([pool[10:13], pool[20:23]])
        return rows, counts, torch.arange(6).repeat_interleave(counts)
    cells = torch.cat([pool[12:14], pool[torch.randint(0, 30, (12,), generator=gen)]])
    cells[-2:] = cells[2]  # a perturbation with three cells
    if case == "cells":
        return cells, 1.0, torch.arange(len(cells))
    rows, inverse, counts = torch.unique(cells, dim=0, return_inverse=True, return_counts=True)
    return rows, counts, inverse


def _loss(out, inverse: torch.Tensor, seed: int = 7) -> torch.Tensor:
    """A loss that treats every cell differently (own control x, target y and weight), with
    GEARS's log-variance term when the uncertainty head is on."""
    delta, logvar = out if isinstance(out, tuple) else (out, None)
    gen = torch.Generator().manual_seed(seed)
    n, dtype = len(inverse), delta.dtype
    x, y = (torch.randn(n, G, generator=gen, dtype=torch.float64).to(dtype) for _ in range(2))
    c = (torch.rand(n, 1, generator=gen, dtype=torch.float64) + 0.5).to(dtype)
    err = delta[inverse] + x - y
    loss = (c * err**2).sum() + (c * torch.tanh(delta[inverse]) ** 3).sum()
    if logvar is not None:
        loss = loss + (c * (torch.exp(-logvar[inverse]) * err**2 + logvar[inverse])).sum()
    return loss


def _assert_close(a, b, tol: float, name: str, floor: float = 0.0) -> None:
    """max|a - b| <= tol * max|b| + floor (b the reference, in its own dtype)."""
    err = (a.double() - b.double()).abs().max().item()
    scale = b.double().abs().max().item()
    assert err <= tol * scale + floor, f"{name}: max error {err:.3g} vs scale {scale:.3g}"


def _assert_same_state(fast, ref, tol: float, grad_tol: float) -> None:
    """Every parameter's gradient (absent = zero: the reference skips the fusion MLP on a batch
    without perturbed cells) and every buffer (running statistics, batches counted)."""
    grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    floor = grad_tol * max(g.abs().max().item() for g in grads.values())
    for name, p in fast.named_parameters():
        got = p.grad if p.grad is not None else torch.zeros_like(p)
        _assert_close(got, grads.get(name, torch.zeros_like(p)), grad_tol, name, floor)
    _assert_same_buffers(fast, ref, tol)


def _assert_same_buffers(fast, ref, tol: float) -> None:
    """Running statistics (within tol of their scale, + tol) and batches counted (equal)."""
    ref_state = ref.state_dict()
    for name, value in fast.named_buffers():
        if name.endswith("num_batches_tracked"):
            assert int(value) == int(ref_state[name]), name
        elif name in ref_state:  # (the graphs are not in the state_dict)
            _assert_close(value, ref_state[name], tol, name, floor=tol)


def _compare(fast, ref, batch, train: bool, tol: float = TOL64, grad_tol: float = TOL64):
    """One forward and backward of each in train or eval mode: outputs, gradients, buffers."""
    rows, counts, inverse = batch
    for net in (fast, ref):
        net.train(train)
        net.zero_grad(set_to_none=True)
    out_fast, out_ref = fast(ModelBatch(rows, counts)), ref(ModelBatch(rows, counts))
    pairs = zip(out_fast, out_ref) if isinstance(out_fast, tuple) else [(out_fast, out_ref)]
    for name, (a, b) in zip(("delta", "logvar"), pairs):
        _assert_close(a, b, tol, f"{name} ({'train' if train else 'eval'})")
    _loss(out_fast, inverse).backward()
    _loss(out_ref, inverse).backward()
    _assert_same_state(fast, ref, tol, grad_tol)


@pytest.fixture(autouse=True)
def _one_thread():
    """One thread (conftest restores the count): the oracle's numbers do not depend on it, and
    on a busy 2-core machine two OpenMP threads wait on each other (a 1,000-row batch-norm
    took 48 ms instead of 0.3 ms)."""
    torch.set_num_threads(1)


@pytest.fixture
def calls(monkeypatch) -> collections.Counter:
    """(kernel, "forward" | "backward") -> calls, for every fused Function and the custom op."""
    counter = collections.Counter()
    for name in FUNCTIONS[:-1]:
        cls = getattr(kernels, name)
        apply, backward = cls.apply, cls.backward

        def counted_apply(*args, _apply=apply, _name=name):
            counter[_name, "forward"] += 1
            return _apply(*args)

        def counted_backward(ctx, *grads, _backward=backward, _name=name):
            counter[_name, "backward"] += 1
            return _backward(ctx, *grads)

        monkeypatch.setattr(cls, "apply", counted_apply)
        monkeypatch.setattr(cls, "backward", staticmethod(counted_backward))
    op = kernels.graph_propagate

    def counted_op(*args):  # the backward calls it again, with gradients off
        counter["graph_propagate", "forward" if torch.is_grad_enabled() else "backward"] += 1
        return op(*args)

    monkeypatch.setattr(kernels, "graph_propagate", counted_op)
    return counter


def _both(*names: str) -> set:
    return {(n, d) for n in names for d in ("forward", "backward")}


# The kernels each test runs. Evaluation: the outer sum with running statistics and the
# per-gene layers. Training with one count for every row: the fusion MLP (controls weigh 0) and
# the outer sum's batch-norm, and the native one on one thread for the gene-embedding rows
# (every row one weight); with a count per row also the block-weighted batch-norm.
EVAL = _both("_OuterSumReluFn", "_GraphPropagateFn", "_GeneDecodeFn", "_OutputLayerFn")
TRAIN = _both(
    "_NativeBatchNormFn",
    "_WeightedBatchNormFn",
    "_OuterSumBatchNormReluFn",
    "_GraphPropagateFn",
    "_GeneDecodeFn",
    "_OutputLayerFn",
)
WEIGHTED = TRAIN | _both("_BlockWeightedBatchNormFn")
EXPECTED = {
    "random": WEIGHTED | EVAL,
    "grouped": TRAIN | EVAL,
    "unequal": WEIGHTED | EVAL,
    "cells": TRAIN | EVAL,
    "controls": TRAIN | EVAL,
    "lone": WEIGHTED | EVAL,
    "sync": _both("_AllReduceSum") | EVAL,
    "compiled_branches": _both("graph_propagate", "_BlockWeightedBatchNormFn"),
}


@pytest.mark.parametrize(
    "case, uncertainty",
    [
        ("random", False),
        ("random", True),
        ("grouped", False),
        ("grouped", True),
        ("unequal", True),
        ("cells", False),
        ("controls", True),
        ("lone", False),
    ],
)
def test_fast_network_equals_reference(case, uncertainty, calls):
    """Training mode (batch statistics, one running-statistics update), then evaluation mode
    with the running statistics that step left. The unequal batch runs two GO and two
    co-expression layers (the full GO product instead of the gathered rows)."""
    fast, ref = _pair(uncertainty, layers=2 if case == "unequal" else 1)
    batch = _batch(case)
    # Six identical cells: the cross-gene batch-norm's variance is the reference's rounding
    # noise, which 1 / sqrt(eps) amplifies (3.5e-12 measured).
    tol = 1e-9 if case == "controls" else TOL64
    _compare(fast, ref, batch, train=True, tol=tol, grad_tol=tol)
    _compare(fast, ref, batch, train=False, tol=tol, grad_tol=tol)
    assert EXPECTED[case] <= set(calls), EXPECTED[case] - set(calls)


@contextlib.contextmanager
def _one_process_group():
    """A gloo process group of one process in memory (no network): sync-BN's code path."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_synchronised_batchnorm_equals_reference(calls):
    """distributed.sync_batchnorm's statistics (all-reduced weighted sums) on one process."""
    fast, ref = _pair(uncertainty=True)
    fast.set_sync_batchnorm(True)
    with _one_process_group():
        _compare(fast, ref, _batch("random"), train=True)
    assert EXPECTED["sync"] <= set(calls), EXPECTED["sync"] - set(calls)


def test_compiled_branches_equal_reference(monkeypatch, calls):
    """The branches the fast kernels take under torch.compile (the graph product as a custom
    op, fp32 block statistics from var_mean, plain expressions for the fused layers), run
    eagerly."""
    fast, ref = _pair()
    batch = _batch("unequal")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    _compare(fast, ref, batch, train=True)
    assert EXPECTED["compiled_branches"] <= set(calls)


def test_every_kernel_is_exercised():
    """Each Function of kernels.py (and the custom op), forward and backward, is in some
    test's expected set above, so a new kernel needs an oracle case."""
    covered = set().union(*EXPECTED.values())
    assert covered == _both(*FUNCTIONS), _both(*FUNCTIONS) ^ covered


def test_float32_equals_reference():
    """The fast network in float32 against the exact (float64) reference: outputs and running
    statistics within TOL32, gradients within GRAD_TOL32. (The float32 reference's own error
    is larger: per-cell batch-norm gradients cancel over its 14,000 rows.)"""
    fast, _ = _pair(uncertainty=True, dtype=torch.float32)
    _, ref = _pair(uncertainty=True)
    batch = _batch("random")
    _compare(fast, ref, batch, train=True, tol=TOL32, grad_tol=GRAD_TOL32)
    _compare(fast, ref, batch, train=False, tol=TOL32, grad_tol=GRAD_TOL32)


# Parameters whose gradient is zero in exact arithmetic: a shift of every row that the next
# batch-norm removes (each MLP Linear's bias; the co-expression layer's bias and emb_trans_v2's
# last batch-norm bias, added to every gene row). Their gradients are rounding noise, which Adam
# divides by its own size: trained, they drift apart at random (4e-4 in 6 steps, measured), and
# the running means that absorb them moved the two networks' predictions apart by 2e-3.
DEAD = re.compile(r"(linears\.\d+|layers_emb_pos\.0\.lin|emb_trans_v2\.norms\.1)\.bias$")


def test_dead_parameters_have_zero_gradient():
    _, ref = _pair(uncertainty=True)
    rows, counts, inverse = _batch("random")
    _loss(ref(ModelBatch(rows, counts)), inverse).backward()
    largest = max(p.grad.abs().max().item() for p in ref.parameters())
    dead = [(n, p.grad.abs().max().item()) for n, p in ref.named_parameters() if DEAD.search(n)]
    assert len(dead) == 13 and all(g <= 1e-12 * largest for _, g in dead), dead


def test_training_reaches_the_same_weights():
    """6 Adam steps of each from the same start over random, grouped and per-cell batches,
    the DEAD parameters frozen: the same parameters, running statistics and predictions."""
    fast, ref = _pair(uncertainty=True)
    opts = []
    for net in (fast, ref):
        live = [p for n, p in net.named_parameters() if not DEAD.search(n)]
        opts.append(torch.optim.Adam(live, lr=1e-3, weight_decay=5e-4))
    for step in range(6):
        rows, counts, inverse = _batch(("random", "grouped", "cells")[step % 3], seed=step)
        for net, opt in zip((fast, ref), opts):
            net.train()
            net.zero_grad()
            _loss(net(ModelBatch(rows, counts)), inverse, seed=step).backward()
            opt.step()
    ref_params = dict(ref.named_parameters())
    for name, p in fast.named_parameters():
        _assert_close(p.detach(), ref_params[name].detach(), TOL64, name)
    _assert_same_buffers(fast, ref, TOL64)
    rows = _batch("random", seed=9)[0]
    with torch.no_grad():
        fast.eval(), ref.eval()
        for a, b in zip(fast(ModelBatch(rows)), ref(ModelBatch(rows))):
            _assert_close(a, b, TOL64, "prediction after training")


# ----------------------------------------------------------------------------- bad input
def test_training_batch_of_one_cell_is_a_clear_error():
    fast, ref = _pair()
    one = torch.tensor([[3, -1]])
    for net in (fast, ref):
        with pytest.raises(GearsInputError, match="one cell"):
            net(ModelBatch(one, 1.0))
        net.eval()
        assert net(ModelBatch(one)).shape == (1, G)  # evaluation needs no batch statistics


def test_reference_needs_whole_counts():
    _, ref = _pair()
    with pytest.raises(GearsInputError, match="whole number"):
        ref(ModelBatch(torch.tensor([[1, -1], [2, -1]]), torch.tensor([1.5, 2.0])))
