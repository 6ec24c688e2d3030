"""Tests for gears/opcount.py and what it guards: the weighted batch-norm's ops do not grow with
the distinct perturbations of a batch (each op is a kernel launch on a GPU); SyncGuard refuses
the ops that make the host wait for the device, and lets fixed-shape ops run."""

from __future__ import annotations

import pytest
import torch

from gears.model.kernels import WeightedBatchNorm1d, _BlockWeightedBatchNormFn
from gears.opcount import HostSyncError, OpCounter, SyncGuard


def _weighted_bn_ops(blocks: int, dtype: torch.dtype, per_block=None) -> int:
    """Ops of one training forward + backward of the block-weighted batch-norm over
    [blocks * 50, 8] rows with uneven block weights: through WeightedBatchNorm1d, or (per_block
    given) its autograd Function with that choice of kernels."""
    gen = torch.Generator().manual_seed(blocks)
    x = (torch.randn(blocks * 50, 8, generator=gen) * 2 + 1).to(dtype).requires_grad_()
    counts = torch.arange(blocks, dtype=torch.float32) % 3 + 1
    bn = WeightedBatchNorm1d(8).to(torch.float64 if dtype == torch.float64 else torch.float32)
    with OpCounter() as counter:
        if per_block is None:
            y = bn(x, counts.repeat_interleave(50), blocks)
        else:
            f = counts / counts.sum()
            y = _BlockWeightedBatchNormFn.apply(x, f, bn.weight, bn.bias, bn.eps, blocks, per_block)
            y = y[0]
        y.float().square().sum().backward()
    assert torch.isfinite(x.grad).all()
    return counter.total()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_weighted_batchnorm_ops_do_not_depend_on_the_blocks(dtype):
    """The block-weighted batch-norm (GEARSNet's cell-gene rows, one block per distinct
    perturbation) dispatches as many ops for 2 blocks as for 64 (46): it ran one native kernel
    per block forward and backward (54 ops for 2 blocks, 74 for 7, 302 for 64)."""
    assert _weighted_bn_ops(2, dtype) == _weighted_bn_ops(7, dtype) == _weighted_bn_ops(64, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weighted_batchnorm_half_precision_ops_do_not_depend_on_the_blocks(dtype):
    """Half precision as on a GPU (per_block=False; on CPU the default keeps one native kernel
    per block, whose ops grow with the blocks, because those kernels read bf16 blocks directly
    where the batched passes would stream fp32 copies: benchmarks/README.md)."""
    counts = [_weighted_bn_ops(n, dtype, per_block=False) for n in (2, 7, 64)]
    assert counts[0] == counts[1] == counts[2], counts
    assert _weighted_bn_ops(7, dtype, per_block=True) > counts[1]  # (the CPU default)


# ------------------------------------------------------------------------------- host syncs
SYNCING = {
    ".item()": lambda t: t.sum().item(),
    "float()": lambda t: float(t.sum()),
    "if tensor": lambda t: bool(t.sum() > 0),
    ".tolist()": lambda t: t.tolist(),
    ".numpy()": lambda t: t.numpy(),
    "torch.tensor": lambda t: torch.tensor([1.0, 2.0]),
    "torch.equal": lambda t: torch.equal(t, t),
    "nonzero": lambda t: t.nonzero(),
    "masked_select": lambda t: t.masked_select(t > 0),
    "boolean-mask index": lambda t: t[t > 0],
    "boolean-mask assignment": lambda t: t.clone().__setitem__(t > 0, 0.0),
    "unique": lambda t: torch.unique(t),
    "unique_consecutive": lambda t: torch.unique_consecutive(t),
    "repeat_interleave": lambda t: t.repeat_interleave(torch.tensor([1, 2, 3])),
    "bincount": lambda t: torch.bincount(torch.zeros(3, dtype=torch.long)),
}


@pytest.mark.parametrize("name", list(SYNCING))
def test_sync_guard_refuses_ops_that_wait_for_the_device(name):
    """Each of these reads a device value on the host or has an output size that depends on
    the data: SyncGuard raises, naming the call; allowed() lets it run."""
    t = torch.tensor([1.0, -2.0, 3.0])
    guard = SyncGuard(cuda=False)
    with guard:
        with pytest.raises(HostSyncError, match="test_ops.py"):
            SYNCING[name](t)
        with guard.allowed():
            SYNCING[name](t)


def test_sync_guard_lets_fixed_shape_ops_run():
    """Long-index gathers, repeat_interleave with output_size and where() do not wait."""
    t = torch.tensor([1.0, -2.0, 3.0])
    with SyncGuard(cuda=False):
        repeats = torch.ones(3, dtype=torch.long)
        out = t.repeat_interleave(repeats, output_size=3) + t[torch.arange(3)]
        out = torch.where(out > 0, out, 0.0).index_select(0, torch.zeros(2, dtype=torch.long))
    assert out.tolist() == [2.0, 2.0]
