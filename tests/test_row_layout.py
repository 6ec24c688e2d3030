"""How the engine lays out a batch's rows: distinct perturbations (weighted batch-norm), one row
per cell (native batch-norm) or distinct rows padded for torch.compile. All give one result."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers import tiny_split

from gears.compat.api import GEARS
from gears.config import TrainConfig
from gears.data.pertdata import PertData
from gears.model.batch import ModelBatch
from gears.model.rows import pad_rows, row_bucket, row_layout, use_cell_rows
from gears.train.distributed import DistEnv
from gears.train.engine import (
    CELL_ROWS,
    WEIGHTED_ROWS,
    EqualRows,
    RepeatRows,
    Trainer,
    seed_everything,
)
from tests.test_network import _biases_cancelled_by_bn


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> PertData:
    return tiny_split(tmp_path_factory.mktemp("data"))


def _trainer(pd_: PertData, **cfg) -> Trainer:
    seed_everything(0)
    model = GEARS(pd_, device="cpu").model_initialize(hidden_size=16)
    return Trainer(model.model, pd_, TrainConfig(**cfg), model.model_config(), DistEnv())


def _batch(pd_: PertData, n_distinct: int, repeats: list[int]):
    """One cell of each of n_distinct training conditions (control included), then `repeats[k]`
    more cells of condition k: uneven counts."""
    ds = pd_.example_set("train")
    conds = np.unique(ds.cond)[:n_distinct]
    ids = [
        np.flatnonzero(ds.cond == c)[: 1 + (repeats[k] if k < len(repeats) else 0)]
        for k, c in enumerate(conds)
    ]
    return ds[np.concatenate(ids)]


def _loss_grads_buffers(trainer: Trainer, batch, layout):
    trainer.net.train()
    trainer.net.zero_grad()
    loss = trainer.loss_on(batch, layout)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.net.named_parameters() if p.grad is not None}
    bufs = {n: b.clone() for n, b in trainer.net.named_buffers() if "running" in n}
    return loss.detach(), grads, bufs


def _assert_same(a, b, cancelled: set[str], rtol: float = 1e-4) -> None:
    """Same loss, gradients and running statistics. `cancelled`: biases that a batch-norm
    cancels (true gradient 0): each side's is float noise, required to be tiny rather than
    equal to the other side's noise."""
    loss_a, grads_a, bufs_a = a
    loss_b, grads_b, bufs_b = b
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=0)
    assert grads_a.keys() == grads_b.keys()
    largest = max(g.abs().max().item() for g in grads_b.values())
    for name in grads_b:
        if name in cancelled:
            for grads in (grads_a, grads_b):
                assert grads[name].abs().max() < 1e-5 * largest, name
            continue
        # Gradients that are small but not cancelled by design: a float-noise floor.
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=rtol, atol=1e-6 * largest)
    for name in bufs_b:
        torch.testing.assert_close(bufs_a[name], bufs_b[name], rtol=rtol, atol=1e-7, msg=name)


def test_layouts_are_a_tagged_type_and_the_older_spellings_still_read():
    """A layout is one of four frozen classes (code dispatches on its type); None, a number and
    "cells", the spellings the engine once used, read as the layouts they meant."""
    from gears.model.rows import Layout, as_layout

    assert as_layout(None) == WEIGHTED_ROWS and as_layout("cells") == CELL_ROWS
    assert as_layout(4) == EqualRows(4.0) and as_layout(2.0) == EqualRows(2.0)
    assert as_layout(CELL_ROWS) is CELL_ROWS
    repeat = row_layout(torch.tensor([8.0, 4.0, 4.0, 4.0]))
    assert as_layout(repeat) is repeat
    for counts in ([4.0, 4.0], [8.0, 4.0, 4.0, 4.0], [2.0] + [1.0] * 13, [5.0, 3.0, 1.0]):
        assert isinstance(row_layout(torch.tensor(counts)), Layout)
    with pytest.raises(TypeError, match="not a row layout"):
        as_layout("rows")


def test_row_layout_rule():
    assert use_cell_rows(26, 32) and not use_cell_rows(24, 32) and not use_cell_rows(8, 32)
    assert [row_bucket(n) for n in (1, 7, 8, 9, 16, 17, 26, 33)] == [8, 8, 8, 16, 16, 32, 32, 64]


def test_engine_picks_layout_from_host_counts(tiny):
    trainer = _trainer(tiny)
    assert trainer.row_layout(torch.tensor([4.0, 4.0, 4.0])) == EqualRows(
        4.0
    )  # uniform: native kernel
    assert trainer.row_layout(torch.tensor([2.0] + [1.0] * 13)) == CELL_ROWS  # 14 rows, 15 cells
    assert trainer.row_layout(torch.tensor([5.0, 3.0, 1.0])) == WEIGHTED_ROWS  # 3 rows for 9 cells
    compiled = _trainer(tiny, compile=True)
    assert compiled.row_layout(torch.tensor([2.0] + [1.0] * 13)) == WEIGHTED_ROWS  # padded instead


def test_engine_repeats_rows_when_counts_share_a_divisor(tiny):
    trainer = _trainer(tiny)
    layout = trainer.row_layout(torch.tensor([8.0, 4.0, 4.0, 4.0]))  # 5 rows of 4 cells
    assert isinstance(layout, RepeatRows) and layout.count == 4.0
    assert layout.repeats.tolist() == [2, 1, 1, 1]
    assert trainer.row_layout(torch.tensor([12.0, 4.0, 4.0])) == WEIGHTED_ROWS  # 5 rows > 3 + 1
    assert trainer.row_layout(torch.tensor([8.0, 4.0, 4.0, 1.0])) == WEIGHTED_ROWS  # divisor 1
    compiled = _trainer(tiny, compile=True)
    assert compiled.row_layout(torch.tensor([8.0, 4.0, 4.0, 4.0])) == WEIGHTED_ROWS


def test_repeated_rows_equal_deduplicated_rows(tiny):
    """Rows repeated to a common count (native batch-norm) = distinct rows weighted by counts:
    the same loss, gradients and running statistics (float32 rounding)."""
    batch = _batch(tiny, 12, [1, 1, 3] + [1] * 9)  # counts 2, 2, 4, 2, ...: 13 rows of 2
    assert sorted(batch.counts.tolist()) == [2.0] * 11 + [4.0]
    layout = _trainer(tiny).row_layout(batch.counts)
    assert isinstance(layout, RepeatRows) and layout.count == 2.0
    a, b = _trainer(tiny), _trainer(tiny)
    _assert_same(
        _loss_grads_buffers(a, batch, layout),
        _loss_grads_buffers(b, batch, None),
        _biases_cancelled_by_bn(a.net),
    )


def test_cell_rows_equal_deduplicated_rows(tiny):
    """One row per cell (native batch-norm) = distinct rows weighted by counts: the same loss,
    gradients and running statistics (float32 rounding)."""
    batch = _batch(tiny, 12, [1, 2])  # 12 distinct conditions, 15 cells: uneven counts
    assert len(batch.counts) == 12 and len(batch) == 15 and use_cell_rows(12, 15)
    a, b = _trainer(tiny), _trainer(tiny)
    _assert_same(
        _loss_grads_buffers(a, batch, CELL_ROWS),
        _loss_grads_buffers(b, batch, None),
        _biases_cancelled_by_bn(a.net),
    )


def test_cell_rows_comparison_can_fail(tiny):
    """The equality above is not vacuous: uniform weights on the distinct rows (ignoring the
    repeats) give another loss and other running statistics."""
    batch = _batch(tiny, 12, [1, 2])
    a, b = _trainer(tiny), _trainer(tiny)
    wrong = _loss_grads_buffers(a, batch, 1.0)
    right = _loss_grads_buffers(b, batch, CELL_ROWS)
    with pytest.raises(AssertionError):
        _assert_same(wrong, right, _biases_cancelled_by_bn(a.net))


def test_padded_rows_equal_unpadded_in_the_network(tiny):
    """Padding rows (controls standing for 0 cells) change no output row, gradient or statistic."""
    batch = _batch(tiny, 11, [3, 1, 2])
    net_a = copy.deepcopy(_trainer(tiny).net).train()
    net_b = copy.deepcopy(net_a)
    padded = pad_rows(ModelBatch(batch.uniq_pert_index, batch.counts))
    rows, counts = padded.pert_index, padded.counts
    assert rows.shape[0] == 16 and (rows[11:] == -1).all() and (counts[11:] == 0).all()
    out_a = net_a(ModelBatch(batch.uniq_pert_index, batch.counts))
    out_b = net_b(padded)[:11]
    torch.testing.assert_close(out_b, out_a, rtol=1e-5, atol=1e-6)
    target = torch.randn_like(out_a)
    ((out_a - target) ** 2).sum().backward()
    ((out_b - target) ** 2).sum().backward()
    largest = max(p.grad.abs().max().item() for p in net_a.parameters() if p.grad is not None)
    for (name, pa), (_, pb) in zip(net_a.named_parameters(), net_b.named_parameters()):
        if pa.grad is not None:  # float32 noise (biases cancelled by batch-norm): a floor
            torch.testing.assert_close(
                pb.grad,
                pa.grad,
                rtol=1e-4,
                atol=1e-5 * largest,
                msg=lambda m, name=name: f"{name}: {m}",
            )
    for (name, ba), (_, bb) in zip(net_a.named_buffers(), net_b.named_buffers()):
        torch.testing.assert_close(
            bb, ba, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}"
        )
