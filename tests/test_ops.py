"""Tests for gears/opcount.py: SyncGuard refuses the ops that make the host wait for the
device, and lets fixed-shape ops run."""

from __future__ import annotations

import pytest
import torch

from gears.opcount import HostSyncError, SyncGuard

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
