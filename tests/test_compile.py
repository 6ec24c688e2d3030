"""train.compile: the network traces without graph breaks, padded batches compile a few times,
and a compiled Trainer learns. The aot_eager backend (dynamo + AOT autograd, no C++ codegen)
keeps these tests in seconds on CPU; inductor compiles the same graphs."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter

from gears.model.network import pad_rows
from tests.test_network import COUNTS, UNIQ, _make_net


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("counts", [COUNTS.float(), 3.0], ids=["row-counts", "uniform"])
def test_network_traces_without_graph_breaks(counts):
    net = _make_net().float().train()
    explained = torch._dynamo.explain(net)(UNIQ, counts)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def _random_rows(n_rows: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.randint(0, 10, (n_rows, 2), generator=gen)
    rows[torch.rand(n_rows, generator=gen) < 0.5, 1] = -1
    return rows, torch.randint(1, 4, (n_rows,), generator=gen).float()


def test_padded_batches_compile_once_per_bucket():
    """Batches with 3..30 distinct rows, padded, hit the buckets 8, 16, 32: three compilations
    for twelve batches (forward and backward); unpadded, every new row count would compile."""
    gen = torch.Generator().manual_seed(0)
    net = _make_net().float().train()
    counter = CompileCounter()
    compiled = torch.compile(net, backend=counter, dynamic=False)
    sizes = [3, 5, 8, 12, 7, 16, 9, 30, 20, 4, 17, 13]
    for n_rows in sizes:
        rows, counts = pad_rows(*_random_rows(n_rows, gen))
        out = compiled(rows, counts)[:n_rows]
        out.square().mean().backward()
    assert counter.frame_count == 3

    torch._dynamo.reset()
    unpadded = CompileCounter()
    compiled = torch.compile(_make_net().float().train(), backend=unpadded, dynamic=False)
    for n_rows in sizes[:3]:
        compiled(*_random_rows(n_rows, gen))
    assert unpadded.frame_count == 3  # the failure the padding prevents


def test_compiled_trainer_learns_as_eager(monkeypatch, tmp_path):
    """train.compile=true on a tiny screen: the loss decreases, and every epoch's loss is the
    eager Trainer's (the padded rows change nothing; aot_eager runs the same kernels)."""
    from gears.api import GEARS
    from gears.config import TrainConfig
    from gears.data.pertdata import PertData
    from gears.distributed import DistEnv
    from gears.engine import Trainer, seed_everything

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    pd_ = PertData(tmp_path, verbose=False)
    pd_.load(
        "synthetic",
        synthetic_params={
            "n_genes": 40,
            "n_single": 10,
            "n_double": 6,
            "cells_per_condition": 12,
            "n_control_cells": 64,
            "n_modules": 3,
        },
    )
    pd_ = pd_.prepare_split("simulation", seed=1)
    losses = {}
    for compiled in (False, True):
        seed_everything(0)
        model = GEARS(pd_, device="cpu").model_initialize(hidden_size=16)
        cfg = TrainConfig(
            epochs=3, batch_size=8, limit_batches=8, lr=5e-3, schedule="constant", compile=compiled
        )
        loaders = pd_.get_dataloader_distributed(cfg.batch_size, 64)
        trainer = Trainer(model.model, pd_, cfg, model.model_config(), DistEnv())
        assert (trainer.model is not trainer.net) == compiled  # the compiled wrapper
        history = trainer.fit({"train_loader": loaders["train_loader"]}, progress=False)
        losses[compiled] = history.train_loss
    assert losses[True][-1] < losses[True][0], losses
    # Float summation order differs (weighted vs native batch-norm), over 3 epochs of steps.
    np.testing.assert_allclose(losses[True], losses[False], rtol=2e-3)
