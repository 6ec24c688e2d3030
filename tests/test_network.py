"""Tests for gears/model/network.py and kernels.py: weighted batch-norm, dedup, GEARSNet wiring."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from opcount import SyncGuard
from torch import nn

from gears.config import ModelConfig
from gears.model.batch import ModelBatch
from gears.model.kernels import (
    WeightedBatchNorm1d,
    _BlockWeightedBatchNormFn,
    csr_to_padded_rows,
    gather_rows,
    gene_decode,
    output_layer,
)
from gears.model.network import GEARSNet, all_rows_max_norm

G, P, H = 24, 10, 8  # genes, perturbable genes, hidden size


# ----------------------------------------------------------------------------- helpers
def _graph(n: int, n_edges: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weighted directed graph on n nodes without self loops: ([2, E], [E])."""
    src = torch.randint(0, n, (n_edges,), generator=gen)
    dst = (src + torch.randint(1, n, (n_edges,), generator=gen)) % n
    return torch.stack([src, dst]), torch.rand(n_edges, generator=gen) + 0.1


def _make_net(
    seed: int = 0, uncertainty: bool = False, go_seed: int = 0, co_seed: int = 0
) -> GEARSNet:
    """A tiny GEARSNet in float64 (weights from `seed`) with random GO and co-expression graphs."""
    go = _graph(P, 40, torch.Generator().manual_seed(100 + go_seed))
    co = _graph(G, 60, torch.Generator().manual_seed(200 + co_seed))
    torch.manual_seed(seed)
    return GEARSNet(ModelConfig(hidden_size=H, uncertainty=uncertainty), G, P, *go, *co).double()


# Distinct perturbation rows of a batch: control, singles, doubles (-1 padded).
UNIQ = torch.tensor([[-1, -1], [0, -1], [1, 3], [2, -1], [4, 5], [3, -1]])
# Which distinct row each of 14 cells has: repeated perturbations, two controls, order mixed.
INVERSE = torch.tensor([0, 1, 1, 2, 0, 3, 1, 4, 2, 4, 1, 5, 3, 1])
COUNTS = torch.bincount(INVERSE, minlength=len(UNIQ))


def _cell_loss(out, inverse: torch.Tensor, gathered: bool, seed: int = 7) -> torch.Tensor:
    """A loss that treats every cell differently (own control x, target y, per-cell weight)."""
    gen = torch.Generator().manual_seed(seed)
    n = len(inverse)
    x = torch.randn(n, G, generator=gen, dtype=torch.float64)
    y = torch.randn(n, G, generator=gen, dtype=torch.float64)
    c = torch.rand(n, 1, generator=gen, dtype=torch.float64) + 0.5
    delta, logvar = out if isinstance(out, tuple) else (out, None)
    if gathered:
        delta = delta[inverse]
        logvar = None if logvar is None else logvar[inverse]
    loss = (c * ((delta + x - y) ** 2)).sum() + (c * torch.tanh(delta) ** 3).sum()
    if logvar is not None:
        loss = loss + (c * (torch.exp(-logvar) * (delta + x - y) ** 2 + logvar)).sum()
    return loss


def _assert_close(
    a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5, name: str = "", floor: float = 1e-12
) -> None:
    """max|a - b| <= tol * max|b| + floor. Batch-norm statistics are computed in float32 even
    for a float64 net, so exactness holds to float32 rounding relative to the tensor's scale."""
    assert a.shape == b.shape, name
    err = (a.double() - b.double()).abs().max().item()
    scale = b.double().abs().max().item()
    assert err <= tol * scale + floor, f"{name}: max error {err:.3g} vs scale {scale:.3g}"


def _max_grad(net: nn.Module) -> float:
    return max(p.grad.abs().max().item() for p in net.parameters() if p.grad is not None)


def _assert_same_state(a: nn.Module, b: nn.Module, tol: float = 1e-5) -> None:
    """Same parameter gradients and the same buffers (running stats, batches tracked).
    Gradients that are zero by design (biases cancelled by batch-norm) are float32 noise, so
    the comparison has a floor relative to the largest gradient."""
    floor = 1e-6 * _max_grad(b)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert (pa.grad is None) == (pb.grad is None), name
        if pa.grad is not None:
            _assert_close(pa.grad, pb.grad, tol, name, floor)
    for (name, ba), (_, bb) in zip(a.named_buffers(), b.named_buffers()):
        # Some running means are ~1e-8 (a batch-norm input that is itself normalised).
        _assert_close(ba, bb, tol, name, floor=1e-7)


# ----------------------------------------------------------------------------- WeightedBatchNorm1d
def _assert_matches_batchnorm(wbn, ref, y, y_ref, x, x_ref) -> None:
    """Outputs, input and affine gradients and running statistics of a weighted batch-norm equal
    those of nn.BatchNorm1d on the per-cell rows."""
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(wbn.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(wbn.bias.grad, ref.bias.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(wbn.running_mean, ref.running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(wbn.running_var, ref.running_var, rtol=1e-5, atol=1e-6)


def _bn_pair(c: int = 5, seed: int = 0) -> tuple[WeightedBatchNorm1d, nn.BatchNorm1d]:
    torch.manual_seed(seed)
    wbn = WeightedBatchNorm1d(c).double()
    with torch.no_grad():  # non-trivial affine parameters and running stats
        wbn.weight.copy_(torch.rand(c) + 0.5)
        wbn.bias.copy_(torch.randn(c))
        wbn.running_mean.copy_(torch.randn(c))
        wbn.running_var.copy_(torch.rand(c) + 0.5)
    ref = nn.BatchNorm1d(c).double()
    ref.load_state_dict(wbn.state_dict())
    return wbn, ref


@pytest.mark.parametrize("weights", [[1, 1, 1, 1], [3, 1, 2, 5], [1, 4, 1, 1, 2, 7]])
def test_weighted_bn_equals_batchnorm_on_repeated_rows(weights):
    wbn, ref = _bn_pair()
    w = torch.tensor(weights)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(len(w), 5, generator=gen, dtype=torch.float64) * 3 + 1
    inverse = torch.repeat_interleave(torch.arange(len(w)), w)
    target = torch.randn(len(inverse), 5, generator=gen, dtype=torch.float64)

    xw = x.clone().requires_grad_()
    yw = wbn(xw, w)
    ((yw[inverse] - target) ** 3).sum().backward()
    xr = x.clone().requires_grad_()
    yr = ref(xr[inverse])  # the per-cell batch; autograd sums gradients over the repeats
    ((yr - target) ** 3).sum().backward()

    _assert_matches_batchnorm(wbn, ref, yw[inverse], yr, xw, xr)
    assert int(wbn.num_batches_tracked) == 1


def test_weighted_bn_running_stats_by_hand():
    """running = 0.9 old + 0.1 batch, with the unbiased n/(n-1) correction for n = total weight."""
    wbn, _ = _bn_pair(c=2)
    old_mean, old_var = wbn.running_mean.clone(), wbn.running_var.clone()
    x = torch.tensor([[1.0, 0.0], [2.0, 4.0], [4.0, -2.0]], dtype=torch.float64)
    w = torch.tensor([2.0, 1.0, 1.0])  # 4 cells: rows 1, 1, 2, 4 of column 0
    wbn(x, w)
    col0, col1 = [1.0, 1.0, 2.0, 4.0], [0.0, 0.0, 4.0, -2.0]
    for j, col in enumerate([col0, col1]):
        mean = sum(col) / 4
        var_unbiased = sum((v - mean) ** 2 for v in col) / 3
        assert wbn.running_mean[j].item() == pytest.approx(0.9 * old_mean[j].item() + 0.1 * mean)
        assert wbn.running_var[j].item() == pytest.approx(
            0.9 * old_var[j].item() + 0.1 * var_unbiased
        )


def test_weighted_bn_zero_weight_rows_are_excluded():
    wbn, ref = _bn_pair()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 5, generator=gen, dtype=torch.float64)
    w = torch.tensor([1.0, 0.0, 2.0, 1.0, 0.0])
    keep = w > 0
    y = wbn(x, w)
    y_ref = ref(x[keep].repeat_interleave(w[keep].long(), 0))
    torch.testing.assert_close(y[keep].repeat_interleave(w[keep].long(), 0), y_ref)
    torch.testing.assert_close(wbn.running_mean, ref.running_mean)
    torch.testing.assert_close(wbn.running_var, ref.running_var)
    # An excluded row is normalised with the other rows' statistics.
    kept = x[keep].repeat_interleave(w[keep].long(), 0)
    mean, var = kept.mean(0), kept.var(0, unbiased=False)
    expected = (x[~keep] - mean) / torch.sqrt(var + wbn.eps) * wbn.weight + wbn.bias
    torch.testing.assert_close(y[~keep], expected, rtol=1e-5, atol=1e-6)


def test_weighted_bn_scalar_weight_equals_repeating_every_row():
    wbn, ref = _bn_pair()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 5, generator=gen, dtype=torch.float64) * 2 - 1
    inverse = torch.arange(4).repeat_interleave(3)
    target = torch.randn(12, 5, generator=gen, dtype=torch.float64)
    xw = x.clone().requires_grad_()
    ((wbn(xw, 3.0)[inverse] - target) ** 2).sum().backward()
    xr = x.clone().requires_grad_()
    ((ref(xr[inverse]) - target) ** 2).sum().backward()
    torch.testing.assert_close(xw.grad, xr.grad)
    torch.testing.assert_close(wbn.weight.grad, ref.weight.grad)
    torch.testing.assert_close(wbn.bias.grad, ref.bias.grad)
    # n = 12 cells in the unbiased correction, not 4 rows.
    torch.testing.assert_close(wbn.running_var, ref.running_var)
    torch.testing.assert_close(wbn.running_mean, ref.running_mean)


def test_weighted_bn_no_weight_equals_batchnorm():
    wbn, ref = _bn_pair()
    x = torch.randn(6, 5, dtype=torch.float64)
    torch.testing.assert_close(wbn(x), ref(x))
    torch.testing.assert_close(wbn.running_var, ref.running_var)


def test_weighted_bn_eval_uses_running_stats():
    wbn, _ = _bn_pair()
    wbn.eval()
    x = torch.randn(3, 5, dtype=torch.float64)
    before = wbn.running_mean.clone()
    expected = (x - wbn.running_mean) / torch.sqrt(wbn.running_var + wbn.eps) * wbn.weight
    expected = expected + wbn.bias
    torch.testing.assert_close(wbn(x, torch.tensor([5.0, 1.0, 2.0])), expected)
    torch.testing.assert_close(wbn(x[:1], 4.0), expected[:1])
    assert torch.equal(wbn.running_mean, before)
    assert int(wbn.num_batches_tracked) == 0


@pytest.mark.parametrize("weight", [torch.tensor([1.0]), torch.tensor([3.0]), 3.0])
def test_weighted_bn_single_row_in_training(weight):
    """One distinct row standing for n identical cells: zero variance, output = beta."""
    wbn, ref = _bn_pair()
    x = torch.randn(1, 5, dtype=torch.float64)
    y = wbn(x, weight)
    # (x - mean) is float32 rounding, amplified by 1 / sqrt(eps): equal to beta within 1e-4.
    torch.testing.assert_close(y, wbn.bias.detach().unsqueeze(0), rtol=0, atol=1e-4)
    n = int(weight.item() if torch.is_tensor(weight) else weight)
    if n > 1:  # nn.BatchNorm1d on the n identical cells gives the same running stats
        ref(x.expand(n, 5))
        torch.testing.assert_close(wbn.running_mean, ref.running_mean)
        torch.testing.assert_close(wbn.running_var, ref.running_var)


def test_weighted_bn_momentum_none_is_cumulative_average():
    """momentum=None means a cumulative moving average in nn.BatchNorm1d."""
    torch.manual_seed(0)
    wbn = WeightedBatchNorm1d(3, momentum=None).double()
    ref = nn.BatchNorm1d(3, momentum=None).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    for _ in range(3):
        wbn(x, torch.ones(5))
        ref(x)
        x = 2 * x + 1
    torch.testing.assert_close(wbn.running_mean, ref.running_mean)
    torch.testing.assert_close(wbn.running_var, ref.running_var)


@pytest.mark.parametrize("block_weights", [[3, 1, 2, 5], [1, 1, 1, 1], [2, 0, 4, 1]])
def test_block_weighted_bn_equals_batchnorm_on_repeated_blocks(block_weights):
    """blocks=U (GEARSNet's [U*G, H] rows: every row of block u stands for w_u cells): output,
    gradients and running statistics equal nn.BatchNorm1d on the per-cell batch, in which each
    block is repeated w_u times (a zero-weight block takes no part in the statistics)."""
    wbn, ref = _bn_pair()
    w_block = torch.tensor(block_weights)
    k = 7  # rows per block
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(len(w_block) * k, 5, generator=gen, dtype=torch.float64) * 3 + 1
    w = w_block.repeat_interleave(k).double()
    cells = torch.cat(
        [torch.arange(u * k, (u + 1) * k).repeat(int(n)) for u, n in enumerate(w_block)]
    )
    target = torch.randn(len(cells), 5, generator=gen, dtype=torch.float64)

    xw = x.clone().requires_grad_()
    yw = wbn(xw, w, blocks=len(w_block))
    ((yw[cells] - target) ** 3).sum().backward()
    xr = x.clone().requires_grad_()
    yr = ref(xr[cells])
    ((yr - target) ** 3).sum().backward()

    _assert_matches_batchnorm(wbn, ref, yw[cells], yr, xw, xr)


@pytest.mark.parametrize("per_block", [None, False])  # CPU's default (per block), a GPU's
@pytest.mark.parametrize("even", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_block_weighted_bn_half_precision_statistics_and_gradient(dtype, even, per_block):
    """_BlockWeightedBatchNormFn on a half-precision input (never copied to fp32; the module
    routes half precision to the fp32-copy path for now): statistics are the float64 ones of
    the rounded input within fp32 rounding, and the input gradient is the
    float64 one within 2% of its scale, also when the upstream gradient has a large common
    part (100x its variation) that the batch-norm gradient must cancel. With even weights the
    true gradient is then ~100x smaller than dy; composing it from half-precision terms
    (r gamma dy - r gamma f sum(dy) - ...) leaves ~2^-9 of the common part: 10-13% errors
    (measured) in bf16. The native kernels cancel it in fp32."""
    gen = torch.Generator().manual_seed(5)
    blocks, k, c = 6, 2000, 4
    x = (torch.randn(blocks * k, c, generator=gen) * 2 + 3).to(dtype)
    w_block = torch.full((blocks,), 3.0) if even else torch.tensor([4.0, 1, 3, 2, 8, 1])
    w = w_block.repeat_interleave(k)
    dy = (100 + torch.randn(blocks * k, c, generator=gen)).to(dtype)
    bn = WeightedBatchNorm1d(c, momentum=1.0)
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([0.5, 1.0, 1.5, 2.0]))
    xh = x.clone().requires_grad_()
    f = w_block / w_block.sum()
    y, batch_mean, batch_var = _BlockWeightedBatchNormFn.apply(
        xh, f, bn.weight, bn.bias, bn.eps, blocks, per_block
    )
    assert y.dtype == dtype
    y.backward(dy)
    assert xh.grad.dtype == dtype

    xd = x.double().requires_grad_()
    frac = w.double() / w.double().sum()
    mean = frac @ xd
    var = frac @ (xd - mean) ** 2
    yd = (xd - mean) / torch.sqrt(var + bn.eps) * bn.weight.detach().double()
    yd.backward(dy.double())
    torch.testing.assert_close(batch_mean.double(), mean.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(batch_var.double(), var.detach(), rtol=1e-5, atol=0)
    assert (y.double() - yd).abs().max() < 2e-2 * yd.abs().max()  # the output's own rounding
    # Per channel: the gradient's error relative to that channel's gradient scale.
    err = (xh.grad.double() - xd.grad).abs().amax(0)
    assert (err < 2e-2 * xd.grad.abs().amax(0)).all(), (err / xd.grad.abs().amax(0)).tolist()
    # dgamma = sum(dy xhat), dbeta = sum(dy): fp32 sums of 12,000 terms, exact to fp32
    # accumulation relative to the sum of the terms' magnitudes (they cancel when even).
    terms = dy.double() * ((xd - mean) / torch.sqrt(var + bn.eps)).detach()
    gamma_err = (bn.weight.grad.double() - terms.sum(0)).abs()
    assert (gamma_err < 1e-6 * terms.abs().sum(0)).all(), gamma_err.tolist()
    torch.testing.assert_close(bn.bias.grad.double(), dy.double().sum(0), rtol=1e-5, atol=0)


def _outer_sum_case(seed: int = 8, genes: int = 7, rows: int = 4, c: int = 5):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(genes, c, generator=gen, dtype=torch.float64) * 2 + 1
    b = torch.randn(rows, c, generator=gen, dtype=torch.float64) * 0.5 - 1
    return a, b, gen


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("weight", [[3, 1, 2, 4], [3, 0, 2, 0], 2.0, None])
def test_outer_sum_relu_equals_batchnorm_on_the_rows(weight, mode):
    """outer_sum_relu(a, b, w) (statistics from a [G, C] and b [U, C] alone) equals
    relu(nn.BatchNorm1d) on the per-cell batch of rows a[g] + b[u], row u's genes repeated
    w_u times (a zero weight takes no part): output, gradients to a, b, gamma and beta, and
    the running statistics; in eval mode, the running statistics normalise."""
    wbn, ref = _bn_pair()
    wbn.train(mode == "train")
    ref.train(mode == "train")
    a, b, gen = _outer_sum_case()
    U, G = b.shape[0], a.shape[0]
    per_row = [1] * U if weight is None else [weight] * U if isinstance(weight, float) else weight
    cells = torch.cat([torch.full((int(n),), u) for u, n in enumerate(per_row)])
    # Per-cell row index into the [U*G] rows: every gene of each cell's row u.
    rows = (cells[:, None] * G + torch.arange(G)).reshape(-1)
    target = torch.randn(len(rows), 5, generator=gen, dtype=torch.float64)
    w = torch.tensor(weight, dtype=torch.float64) if isinstance(weight, list) else weight

    aw, bw = a.clone().requires_grad_(), b.clone().requires_grad_()
    yw = wbn.outer_sum_relu(aw, bw, w).reshape(U * G, -1)[rows]
    ((yw - target) ** 3).sum().backward()
    ar, br = a.clone().requires_grad_(), b.clone().requires_grad_()
    yr = torch.relu(ref((ar.unsqueeze(0) + br.unsqueeze(1)).reshape(U * G, -1)[rows]))
    ((yr - target) ** 3).sum().backward()

    torch.testing.assert_close(yw, yr, rtol=1e-5, atol=1e-6)
    for name, got, want in [
        ("a", aw.grad, ar.grad),
        ("b", bw.grad, br.grad),
        ("gamma", wbn.weight.grad, ref.weight.grad),
        ("beta", wbn.bias.grad, ref.bias.grad),
        ("running_mean", wbn.running_mean, ref.running_mean),
        ("running_var", wbn.running_var, ref.running_var),
    ]:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
    assert int(wbn.num_batches_tracked) == int(ref.num_batches_tracked)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_outer_sum_relu_under_autocast_has_fp32_statistics(dtype):
    """Under autocast the result is in the autocast dtype, the statistics are the float64 ones
    of the inputs within fp32 rounding (never summed in half precision), and the gradients to
    a and b are close to float64's."""
    G, U, c = 3000, 16, 4
    a, b, gen = _outer_sum_case(seed=9, genes=G, rows=U, c=c)
    a, b = (a * 3).float(), b.to(dtype)  # fused embeddings arrive in the autocast dtype
    w = torch.randint(1, 6, (U,), generator=gen).float()
    bn = WeightedBatchNorm1d(c, momentum=1.0)
    aw, bw = a.clone().requires_grad_(), b.clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype):
        y = bn.outer_sum_relu(aw, bw, w)
    assert y.dtype == dtype and y.shape == (U, G, c)
    dy = torch.randn(U, G, c, generator=gen).to(dtype)
    y.backward(dy)
    assert aw.grad.dtype == torch.float32 and bw.grad.dtype == dtype

    ad, bd = a.double().requires_grad_(), b.double().requires_grad_()
    x = (ad.unsqueeze(0) + bd.unsqueeze(1)).reshape(U * G, c)
    frac = (w.double() / w.double().sum()).repeat_interleave(G) / G
    mean = frac @ x
    var = frac @ (x - mean) ** 2
    yd = torch.relu((x - mean) / torch.sqrt(var + bn.eps)).reshape(U, G, c)
    yd.backward(dy.double())
    n = w.double().sum() * G
    torch.testing.assert_close(bn.running_mean.double(), mean.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(
        bn.running_var.double(), var.detach() * n / (n - 1), rtol=1e-5, atol=0
    )
    assert (y.double() - yd).abs().max() < 1e-2 * yd.abs().max()  # the output's own rounding
    # a's gradient: the mask of the once-rounded sum and fp32 sums (measured ~1e-6; adding a
    # and b rounded to bf16 first gave ~1.2%); b's: its sums over genes rounded to the autocast
    # dtype (measured 0.2% in bf16).
    assert (aw.grad.double() - ad.grad).norm() < 1e-3 * ad.grad.norm()
    assert (bw.grad.double() - bd.grad).norm() < 1e-2 * bd.grad.norm()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gene_decode_equals_autograd_expression(dtype):
    """gene_decode's Function (row by row on CPU) gives what autograd gives for
    (out * w1).sum(-1): the fp32 output and d_w1, and d_out in out's dtype (the same fp32
    products, rounded once)."""
    gen = torch.Generator().manual_seed(6)
    out = torch.randn(5, 30, 8, generator=gen).to(dtype)
    w1 = torch.randn(30, 8, generator=gen)
    grad = torch.randn(5, 30, generator=gen)
    results = []
    for fn in (gene_decode, lambda o, w: (o * w).sum(-1)):
        o, w = out.clone().requires_grad_(), w1.clone().requires_grad_()
        y = fn(o, w)
        y.backward(grad)
        results.append((y, o.grad, w.grad))
    for a, b in zip(*results):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert results[0][0].dtype == torch.float32 and results[0][1].dtype == dtype


# ----------------------------------------------------------------------------- all_rows_max_norm
def test_all_rows_max_norm_renormalises_long_rows_only():
    emb = nn.Embedding(6, 4)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(6, 4))
        emb.weight[0] = torch.tensor([3.0, 4.0, 0.0, 0.0])  # norm 5
        emb.weight[1] = torch.tensor([0.3, 0.4, 0.0, 0.0])  # norm 0.5
        emb.weight[2] = torch.tensor([0.6, 0.8, 0.0, 0.0])  # norm 1 exactly: not > 1
    before = emb.weight.detach().clone()
    out = all_rows_max_norm(emb)
    norms = before.norm(dim=1)
    long_rows = norms > 1
    assert long_rows.any() and (~long_rows).any()
    torch.testing.assert_close(
        out[long_rows].norm(dim=1), torch.ones(int(long_rows.sum())), rtol=0, atol=1e-6
    )
    torch.testing.assert_close(
        out[long_rows], before[long_rows] / norms[long_rows, None], rtol=0, atol=1e-6
    )
    assert torch.equal(out[~long_rows], before[~long_rows])
    # In place, and the parameter itself is returned so gradients reach it.
    assert out is emb.weight
    torch.testing.assert_close(emb.weight[0], torch.tensor([0.6, 0.8, 0.0, 0.0]))


def test_all_rows_max_norm_matches_torch_embedding_max_norm():
    torch.manual_seed(4)
    emb = nn.Embedding(10, 5)
    with torch.no_grad():
        emb.weight.mul_(torch.linspace(0.05, 1.5, 10).unsqueeze(1))
    ref_weight = emb.weight.detach().clone()
    looked_up = F.embedding(torch.arange(10), ref_weight, max_norm=1.0)  # renorms ref in place
    out = all_rows_max_norm(emb)
    torch.testing.assert_close(out.detach(), ref_weight, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.detach(), looked_up, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- GEARSNet: dedup
@pytest.mark.parametrize("uncertainty", [False, True])
def test_dedup_rows_with_counts_equal_per_cell_batch(uncertainty):
    net_u = _make_net(uncertainty=uncertainty)
    net_c = copy.deepcopy(net_u)
    net_u.train()
    net_c.train()
    out_u = net_u(ModelBatch(UNIQ, COUNTS))
    out_c = net_c(ModelBatch(UNIQ[INVERSE]))  # every cell its own row: the original GEARS batch
    if uncertainty:
        assert isinstance(out_u, tuple) and isinstance(out_c, tuple)
        _assert_close(out_u[1][INVERSE], out_c[1], name="logvar")
    delta_u = out_u[0] if uncertainty else out_u
    delta_c = out_c[0] if uncertainty else out_c
    _assert_close(delta_u[INVERSE], delta_c, name="delta")

    _cell_loss(out_u, INVERSE, gathered=True).backward()
    _cell_loss(out_c, INVERSE, gathered=False).backward()
    _assert_same_state(net_u, net_c)
    assert int(net_u.bn_pert_base.num_batches_tracked) == 1


def test_uniform_scalar_counts_equal_tensor_counts_and_repeated_cells():
    rows = UNIQ[1:5]
    nets = [_make_net() for _ in range(3)]
    out_scalar = nets[0](ModelBatch(rows, 3.0))
    out_tensor = nets[1](ModelBatch(rows, torch.full((len(rows),), 3)))
    inverse = torch.arange(len(rows)).repeat_interleave(3)
    out_cells = nets[2](ModelBatch(rows[inverse]))
    _assert_close(out_scalar, out_tensor)
    _assert_close(out_scalar[inverse], out_cells)
    _cell_loss(out_scalar, inverse, gathered=True).backward()
    _cell_loss(out_tensor, inverse, gathered=True).backward()
    _cell_loss(out_cells, inverse, gathered=False).backward()
    _assert_same_state(nets[0], nets[1])
    _assert_same_state(nets[0], nets[2])


def test_control_rows_take_no_part_in_fusion_statistics():
    """GEARS fuses the perturbed cells only: adding control cells to a batch leaves the fusion
    MLP's statistics (and so its running stats) as they were."""
    with_ctrl, without = _make_net(), _make_net()
    with_ctrl(ModelBatch(UNIQ, COUNTS))
    without(ModelBatch(UNIQ[1:], COUNTS[1:]))
    assert bool((UNIQ[0] == -1).all()) and bool((UNIQ[1:] >= 0).any(1).all())
    for (name, a), (_, b) in zip(
        with_ctrl.pert_fuse.named_buffers(), without.pert_fuse.named_buffers()
    ):
        _assert_close(a, b, name=name, floor=1e-7)
    # ...whereas the gene-level batch-norms see every cell.
    assert not torch.allclose(with_ctrl.bn_pert_base.running_var, without.bn_pert_base.running_var)


# ----------------------------------------------------------------------------- batch independence
def test_eval_row_output_independent_of_batch_position_and_company():
    net = _make_net().eval()
    with torch.no_grad():
        together = net(ModelBatch(UNIQ, COUNTS))
        for k in range(len(UNIQ)):
            alone = net(ModelBatch(UNIQ[k : k + 1]))
            torch.testing.assert_close(alone[0], together[k], rtol=1e-6, atol=1e-8)
        perm = torch.tensor([4, 2, 5, 0, 3, 1])
        torch.testing.assert_close(net(ModelBatch(UNIQ[perm], COUNTS[perm])), together[perm])


def test_train_output_is_permutation_equivariant():
    net_a = _make_net()
    net_b = copy.deepcopy(net_a)
    perm = torch.tensor([4, 2, 5, 0, 3, 1])
    out_a = net_a(ModelBatch(UNIQ, COUNTS))
    out_b = net_b(ModelBatch(UNIQ[perm], COUNTS[perm]))
    _assert_close(out_b, out_a[perm])


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_coexpression_graph_reaches_every_row(mode):
    """GEARS ran the co-expression SGConv on B*G nodes with edges for the first G only, so
    only the first cell of a batch saw the graph. Here a different graph changes every row."""
    net_a = _make_net(co_seed=1)
    net_b = _make_net(co_seed=2, seed=9)
    net_b.load_state_dict(net_a.state_dict())  # same weights; graphs are non-persistent buffers
    assert not torch.equal(net_a.co_edge_index, net_b.co_edge_index)
    assert torch.equal(net_a.go_edge_index, net_b.go_edge_index)
    for net in (net_a, net_b):
        net.train(mode == "train")
    with torch.no_grad():
        diff = (net_a(ModelBatch(UNIQ, COUNTS)) - net_b(ModelBatch(UNIQ, COUNTS))).abs().amax(1)
    assert (diff > 1e-6).all(), diff


def test_gathered_go_rows_equal_sgconv_over_every_perturbation():
    """pert_embeddings with one GO layer gathers each perturbation's neighbours (padded rows of
    the GO matrix): the same embeddings, gradients and network output as GEARS's SGConv over
    all perturbations, indexed; a net with two GO layers takes the full product."""
    net = _make_net()
    assert net.go_rows_gathered
    full = copy.deepcopy(net)
    full.go_rows_gathered = False
    index = torch.tensor([[3, 0], [9, 9], [5, 1]])
    _assert_close(net.pert_embeddings(index), full.pert_embeddings(index), tol=1e-12)
    loss_rows = _cell_loss(net(ModelBatch(UNIQ, COUNTS)), INVERSE, gathered=True)
    loss_full = _cell_loss(full(ModelBatch(UNIQ, COUNTS)), INVERSE, gathered=True)
    _assert_close(loss_rows, loss_full, tol=1e-12)
    loss_rows.backward()
    loss_full.backward()
    _assert_same_state(net, full, tol=1e-9)
    go = _graph(P, 40, torch.Generator().manual_seed(100))
    co = _graph(G, 60, torch.Generator().manual_seed(200))
    two_layers = ModelConfig(hidden_size=H, num_go_gnn_layers=2)
    assert not GEARSNet(two_layers, G, P, *go, *co).go_rows_gathered


def test_csr_to_padded_rows():
    """Rows as padded neighbour lists in CSR order, padding weight 0; None when a few long rows
    would make the padded storage more than 4x the entries."""
    dense = torch.tensor([[0.0, 2, 0, 3], [0, 0, 0, 0], [1, 0, 0, 0], [0, 4, 5, 6]])
    csr = dense.to_sparse_csr()
    index, weight = csr_to_padded_rows(csr.crow_indices(), csr.col_indices(), csr.values())
    assert index.shape == weight.shape == (4, 3)
    torch.testing.assert_close(weight, torch.tensor([[2.0, 3, 0], [0, 0, 0], [1, 0, 0], [4, 5, 6]]))
    assert index[0, :2].tolist() == [1, 3] and index[3].tolist() == [1, 2, 3]
    x = torch.randn(4, 5)
    torch.testing.assert_close((weight.unsqueeze(-1) * x[index]).sum(1), dense @ x)
    hub = torch.zeros(40, 40)
    hub[0] = 1.0  # one row of 40, the others of 1: 40 x 40 slots for 79 entries
    hub[1:, 0] = 1.0
    csr = hub.to_sparse_csr()
    assert csr_to_padded_rows(csr.crow_indices(), csr.col_indices(), csr.values()) is None


def test_gather_rows_sums_gradients_in_index_order():
    """x[index]'s backward (index_put_ with accumulate) adds float32 rows with atomics across
    threads on CPU once the gradient has 32,768 elements, so its sums changed from call to call
    (10 of 10 calls differed from the ordered sum, measured). gather_rows' gradient is the sum in
    index order, bit for bit, at 2 threads; its forward is x[index]."""
    torch.set_num_threads(2)  # (the suite's fixture restores the count)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 64, generator=gen).requires_grad_()
    index = torch.randint(0, 50, (40, 2, 20), generator=gen)  # a batch's GO neighbour lists
    grad = torch.randn(40, 2, 20, 64, generator=gen)  # 102,400 elements
    want = torch.zeros(50, 64)
    for j, i in enumerate(index.reshape(-1).tolist()):
        want[i] += grad.reshape(-1, 64)[j]
    assert torch.equal(gather_rows(x, index), x[index])
    for _ in range(10):
        x.grad = None
        gather_rows(x, index).backward(grad)
        assert torch.equal(x.grad, want)


def test_go_graph_changes_perturbed_rows_only_in_eval():
    net_a = _make_net()
    net_b = _make_net(go_seed=5, seed=9)  # another GO graph, the same co-expression graph
    net_b.load_state_dict(net_a.state_dict())
    assert torch.equal(net_a.co_edge_index, net_b.co_edge_index)
    net_a.eval()
    net_b.eval()
    with torch.no_grad():
        diff = (net_a(ModelBatch(UNIQ)) - net_b(ModelBatch(UNIQ))).abs().amax(1)
    assert diff[0] == 0  # control row: no perturbation embedding involved
    assert (diff[1:] > 1e-6).all(), diff


# ----------------------------------------------------------------------------- shapes and grads
def test_output_shapes():
    net = _make_net()
    assert net(ModelBatch(UNIQ, COUNTS)).shape == (len(UNIQ), G)
    net_unc = _make_net(uncertainty=True)
    delta, logvar = net_unc(ModelBatch(UNIQ, COUNTS))
    assert delta.shape == logvar.shape == (len(UNIQ), G)
    net_unc.eval()
    delta, logvar = net_unc(ModelBatch(UNIQ[:2]))
    assert delta.shape == logvar.shape == (2, G)


def _biases_cancelled_by_bn(net: nn.Module) -> set[str]:
    """Biases that shift every row of a batch-norm's batch equally, so that it cancels them
    (zero gradient by design, as in GEARS): each MLP Linear's; the co-expression SGConv's (one
    constant on every gene before emb_trans_v2's batch-norm); emb_trans_v2's last beta (one
    constant on every gene of every row before bn_pert_base)."""
    names = {n for n, _ in net.named_parameters() if ".linears." in n and n.endswith(".bias")}
    last = len(net.emb_trans_v2.norms) - 1
    return (
        names
        | {f"layers_emb_pos.{i}.lin.bias" for i in range(len(net.layers_emb_pos))}
        | {f"emb_trans_v2.norms.{last}.bias"}
    )


def test_every_parameter_that_should_learn_gets_gradient():
    net = _make_net(uncertainty=True)
    _cell_loss(net(ModelBatch(UNIQ, COUNTS)), INVERSE, gathered=True).backward()
    expected = {
        "gene_emb.weight",
        "emb_pos.weight",
        "pert_emb.weight",
        "bn_emb.weight",
        "bn_emb.bias",
        "layers_emb_pos.0.lin.weight",  # co-expression SGConv
        "sim_layers.0.lin.weight",  # GO SGConv
        "sim_layers.0.lin.bias",  # once in a single, twice in a double: not cancelled
        "bn_pert_base.weight",
        "bn_pert_base.bias",
        "indv_w1",
        "indv_b1",
        "indv_w2",
        "indv_b2",
    }
    for mlp, depth in [
        ("emb_trans_v2", 2),
        ("pert_fuse", 2),
        ("recovery_w", 2),
        ("cross_gene_state", 2),
        ("uncertainty_w", 3),
    ]:
        for i in range(depth):
            expected |= {
                f"{mlp}.linears.{i}.weight",
                f"{mlp}.norms.{i}.weight",
                f"{mlp}.norms.{i}.bias",
            }
    expected.discard(f"emb_trans_v2.norms.{len(net.emb_trans_v2.norms) - 1}.bias")
    cancelled = _biases_cancelled_by_bn(net)
    names = {n for n, _ in net.named_parameters()}
    assert expected | cancelled == names and not expected & cancelled
    # Float32 batch-norm statistics leave ~1e-7 relative noise on the cancelled gradients.
    largest = _max_grad(net)
    for name, p in net.named_parameters():
        if name in expected:
            assert p.grad is not None and p.grad.abs().max() > 1e-4 * largest, name
        else:
            assert p.grad is None or p.grad.abs().max() < 1e-5 * largest, name


def test_go_and_coexpression_embeddings_keep_learning_after_first_step():
    """The perturbation and positional embeddings sit before the SGConvs; every step must reach
    them (a layer that caches its propagated input would freeze them after the first forward)."""
    net = _make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(2):
        opt.zero_grad()
        _cell_loss(net(ModelBatch(UNIQ, COUNTS)), INVERSE, gathered=True).backward()
        for name in ("pert_emb.weight", "emb_pos.weight"):
            grad = dict(net.named_parameters())[name].grad
            assert grad is not None and grad.abs().max() > 1e-8, f"step {step}: {name}"
        opt.step()


def test_prediction_follows_loaded_weights():
    """A net that has already run, loaded with another net's weights, predicts like that net."""
    net_a, net_b = _make_net(seed=0), _make_net(seed=3)
    net_a.eval()
    net_b.eval()
    with torch.no_grad():
        net_a(ModelBatch(UNIQ))  # any earlier forward (e.g. an epoch of training)
        net_a.load_state_dict(net_b.state_dict())
        torch.testing.assert_close(net_a(ModelBatch(UNIQ)), net_b(ModelBatch(UNIQ)))


def test_double_is_order_free_and_not_a_single_or_a_sum():
    net = _make_net()
    a, b = 1, 3
    rows = torch.tensor([[a, b], [b, a], [a, -1], [b, -1], [-1, -1]])
    train_out = net(ModelBatch(rows, torch.tensor([2, 1, 3, 2, 2])))
    assert torch.equal(train_out[0], train_out[1])
    net.eval()
    with torch.no_grad():
        out = net(ModelBatch(rows))
    assert torch.equal(out[0], out[1])
    double, single_a, single_b, ctrl = out[0], out[2], out[3], out[4]
    for other in (single_a, single_b, single_a + single_b - ctrl):
        assert (double - other).abs().max() > 1e-4


@pytest.mark.parametrize("n_rows, counts", [(1, torch.tensor([8])), (4, None), (1, 8.0)])
def test_all_control_batch_trains_without_nan(n_rows, counts):
    """A batch of control cells only (one distinct row, or per-cell rows): GEARS skips the
    fusion MLP, so the output is finite and the fusion MLP's running stats stay finite."""
    net = _make_net()
    out = net(ModelBatch(torch.full((n_rows, 2), -1), counts))
    assert torch.isfinite(out).all()
    for name, buf in net.named_buffers():
        assert torch.isfinite(buf).all(), name


def test_single_distinct_perturbation_with_scalar_count_trains():
    """All cells of a batch share one perturbation: one row standing for 8 cells (the engine
    passes a scalar count when all counts are equal) must match the tensor-count path."""
    row = torch.tensor([[2, -1]])
    net_s, net_t = _make_net(), _make_net()
    out_t = net_t(ModelBatch(row, torch.tensor([8])))
    out_s = net_s(ModelBatch(row, 8.0))
    _assert_close(out_s, out_t)


# ----------------------------------------------------------------------------- bf16
def _bf16_vs_fp32(train: bool) -> tuple[torch.Tensor, torch.Tensor, GEARSNet]:
    net32 = _make_net().float().train(train)
    net16 = copy.deepcopy(net32)
    counts = COUNTS.float()
    with torch.set_grad_enabled(train):
        ref = net32(ModelBatch(UNIQ, counts))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = net16(ModelBatch(UNIQ, counts))
    assert out.shape == ref.shape and torch.isfinite(out).all()
    return out.float(), ref, net16


def test_bf16_autocast_eval_close_to_fp32():
    out, ref, _ = _bf16_vs_fp32(train=False)
    assert (out - ref).norm() / ref.norm() < 1e-2


def test_bf16_autocast_train_forward_close_and_backward_runs():
    out, ref, net16 = _bf16_vs_fp32(train=True)
    # Training-mode batch-norm over 5-6 rows amplifies rounding: perturbing this fp32 net's
    # weights by bf16's relative 2^-9 alone moves its output by ~2.5%, hence the wider bound.
    assert (out - ref).norm() / ref.norm() < 0.1
    out.square().mean().backward()
    grads = {n: p.grad for n, p in net16.named_parameters() if p.grad is not None}
    assert {"pert_emb.weight", "gene_emb.weight", "indv_w2"} <= set(grads)
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert grads["pert_emb.weight"].abs().max() > 0
    for name, buf in net16.named_buffers():  # running stats stay float32 and finite
        if name.endswith(("running_mean", "running_var")):
            assert buf.dtype == torch.float32 and torch.isfinite(buf).all(), name


# ----------------------------------------------------------------------------- fixed graphs
def test_fixed_graph_conv_equals_pyg_sgconv():
    """The once-normalised sparse product + Linear is PyG's SGConv(K=1): same output and input
    gradient on a random graph with duplicate edges, existing self-loops and an isolated node,
    and SGConv's state_dict loads into it unchanged (saved models keep loading)."""
    from torch_geometric.nn import SGConv

    from gears.model.kernels import gcn_normalised_csr, graph_propagate
    from gears.model.network import FixedGraphConv

    n, h = 30, 6
    gen = torch.Generator().manual_seed(5)
    ei, ew = _graph(n - 1, 120, gen)  # node n - 1 has no edge
    ei = torch.cat([ei, ei[:, :10], torch.tensor([[3, 7], [3, 7]])], 1)  # duplicates, self-loops
    ew = torch.cat([ew, ew[:10] * 0.5, torch.tensor([2.0, 0.3])])
    torch.manual_seed(0)
    ref = SGConv(h, h, K=1)
    ours = FixedGraphConv(h, h)
    ours.load_state_dict(ref.state_dict(), strict=True)
    graph = gcn_normalised_csr(ei, ew, n) + gcn_normalised_csr(ei, ew, n, transpose=True)
    x = torch.randn(n, h, generator=gen)
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y_ours = ref(x_ref, ei, ew), ours(x_ours, graph)
    torch.testing.assert_close(y_ours, y_ref, rtol=1e-5, atol=1e-6)
    target = torch.randn(n, h, generator=gen)
    ((y_ref - target) ** 3).sum().backward()
    ((y_ours - target) ** 3).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.lin.weight.grad, ref.lin.weight.grad, rtol=1e-5, atol=1e-6)
    # The isolated node keeps itself (self-loop weight 1 / degree 1), as in gcn_norm.
    torch.testing.assert_close(graph_propagate(*graph, x)[n - 1], x[n - 1])


def test_gcn_norm_is_pygs_bit_for_bit():
    """kernels.gcn_norm (written out so that the fast model never imports PyG) returns PyG's
    gcn_norm's edges and weights exactly: existing self-loops keep their weight, duplicates stay
    separate, an isolated node gets weight 1."""
    from torch_geometric.nn.conv.gcn_conv import gcn_norm as pyg_gcn_norm

    from gears.model.kernels import gcn_norm

    n = 40
    gen = torch.Generator().manual_seed(11)
    ei, ew = _graph(n - 1, 200, gen)  # node n - 1 has no edge
    ei = torch.cat([ei, ei[:, :15], torch.tensor([[3, 7, 9], [3, 7, 9]])], 1)
    ew = torch.cat([ew, ew[:15] * 0.25, torch.tensor([2.0, 0.3, 0.0])])
    ours, theirs = gcn_norm(ei, ew, n), pyg_gcn_norm(ei, ew, n, add_self_loops=True)
    assert torch.equal(ours[0], theirs[0])
    assert torch.equal(ours[1], theirs[1])


def test_the_fast_model_and_predict_start_without_pyg():
    """PyG's import pulls in torch._dynamo (~1.5 s of every command's start): only the reference
    model imports it."""
    import subprocess
    import sys

    code = (
        "import sys, gears.compat.api, gears.train.engine, gears.eval.predicted_cells\n"
        "print(sorted(m for m in ('torch_geometric', 'torch._dynamo') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_graph_buffers_are_listed_and_not_saved():
    net = _make_net()
    names = net.graph_buffer_names()
    buffers = dict(net.named_buffers())
    assert set(names) <= set(buffers)
    non_norm = {
        k for k in buffers if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))
    }
    assert set(names) == non_norm  # every graph buffer, and only those
    assert {"go_adj_values", "co_adj_values_t", "go_edge_index"} <= set(names)
    assert not set(names) & set(net.state_dict())  # rebuilt from the data, never saved
    keys = set(net.state_dict())
    assert {"layers_emb_pos.0.lin.weight", "sim_layers.0.lin.bias"} <= keys  # PyG's keys


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16])
def test_training_step_makes_no_host_sync(dtype):
    """No op that makes the host wait for the device in a training forward + backward
    (opcount.SyncGuard: a tensor read as a number or a condition, a tensor from Python
    data, an output whose size depends on the data such as boolean-mask indexing, nonzero,
    unique or repeat_interleave without output_size), for per-row counts with and without the
    host's cell count and for equal counts, in fp32 and under bf16 / fp16 autocast. The
    earlier form of this test refused only the Python-level reads (.item(), bool(), ...), and
    passed with `w = w[w >= 0]` (a boolean mask) in the weighted batch-norm."""
    cases = [(COUNTS.float(), None), (COUNTS.float(), float(COUNTS.sum()))]
    for counts, n_cells in [*cases, (3.0, None)]:
        net = _make_net().float()
        with SyncGuard(cuda=False):
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                out = net(ModelBatch(UNIQ, counts, n_cells=n_cells))
            out.float().square().mean().backward()
        assert int(net.bn_pert_base.num_batches_tracked) == 1
        assert net.recovery_w.norms[0].weight.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- mixed precision
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weighted_bn_statistics_are_fp32_under_autocast(dtype):
    """Under autocast the weighted statistics are the float64 ones of the (already rounded)
    input within fp32 rounding; half-precision statistics were off by ~4e-3 (bf16) or
    overflowed (fp16: unnormalised sums of 200,000 rows)."""
    gen = torch.Generator().manual_seed(3)
    n, c = 20_000, 4
    x = (torch.randn(n, c, generator=gen) * 2 + 3).to(dtype)
    w = torch.randint(1, 20, (n,), generator=gen).float()
    bn = WeightedBatchNorm1d(c, momentum=1.0)
    with torch.autocast("cpu", dtype=dtype):
        y = bn(x, w)
    assert y.dtype == dtype
    xd, wd = x.double(), w.double() / w.double().sum()
    mean = wd @ xd
    var = wd @ (xd - mean) ** 2
    n_cells = w.double().sum()
    torch.testing.assert_close(bn.running_mean.double(), mean, rtol=1e-5, atol=0)
    torch.testing.assert_close(
        bn.running_var.double(), var * n_cells / (n_cells - 1), rtol=1e-5, atol=0
    )
    yd = (xd - mean) / torch.sqrt(var + bn.eps)
    assert (y.double() - yd).abs().max() < 2e-2 * yd.abs().max()  # the output's own rounding


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_output_layer_equals_autograd_expression(dtype):
    """output_layer's one-node Function gives GEARS's expression and its autograd gradients."""
    torch.manual_seed(0)
    U, G, H = 5, 30, 8
    inputs = [
        torch.randn(U, G, dtype=dtype),
        torch.randn(U, H, dtype=dtype),
        torch.randn(1, G, H + 1, dtype=dtype),
        torch.randn(1, G, dtype=dtype),
    ]
    grad = torch.randn(U, G, dtype=dtype)

    def expression(w, cross, w2, b2):
        return w * w2[0][:, 0] + cross @ w2[0][:, 1:].t() + b2

    results = []
    for fn in (output_layer, expression):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = fn(*leaves)
        out.backward(grad)
        results.append([out.detach()] + [t.grad for t in leaves])
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for mine, ref in zip(*results):
        assert mine.dtype == ref.dtype and mine.shape == ref.shape
        assert torch.allclose(mine, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("counts", ["per_row", "equal", "none"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_running_statistics_carry_no_autograd_history(counts, precision):
    """Every batch-norm path updates its running statistics outside autograd: after a
    training forward and backward (weighted, native, block-weighted and outer-sum paths, with
    and without autocast) no buffer requires grad or holds a graph."""
    net = _make_net().float()
    arg = {"per_row": COUNTS.float(), "equal": 3.0, "none": None}[counts]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        out = net(ModelBatch(UNIQ, arg))
    out.float().square().sum().backward()
    norms = [m for m in net.modules() if isinstance(m, WeightedBatchNorm1d)]
    assert norms and all(int(m.num_batches_tracked) == 1 for m in norms)
    for name, buf in net.named_buffers():
        assert not buf.requires_grad and buf.grad_fn is None, name
