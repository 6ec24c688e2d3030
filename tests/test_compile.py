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

from gears.model.batch import ModelBatch
from gears.model.rows import pad_rows
from tests.test_network import COUNTS, UNIQ, _make_net


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("counts", [COUNTS.float(), 3.0], ids=["row-counts", "uniform"])
def test_network_traces_without_graph_breaks(counts):
    net = _make_net().float().train()
    explained = torch._dynamo.explain(net)(ModelBatch(UNIQ, counts))
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
        out = compiled(pad_rows(ModelBatch(*_random_rows(n_rows, gen))))[:n_rows]
        out.square().mean().backward()
    assert counter.frame_count == 3

    torch._dynamo.reset()
    unpadded = CompileCounter()
    compiled = torch.compile(_make_net().float().train(), backend=unpadded, dynamic=False)
    for n_rows in sizes[:3]:
        compiled(ModelBatch(*_random_rows(n_rows, gen)))
    assert unpadded.frame_count == 3  # the failure the padding prevents


def _eager_and_compiled(tmp_path, epochs: int = 1):
    """Two Trainers on a tiny screen from the same initial weights: eager and train.compile."""
    from gears.compat.api import GEARS
    from gears.config import TrainConfig
    from gears.data.pertdata import PertData
    from gears.train.distributed import DistEnv
    from gears.train.engine import Trainer, seed_everything

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
    trainers = []
    for compiled in (False, True):
        seed_everything(0)
        model = GEARS(pd_, device="cpu").model_initialize(hidden_size=16)
        cfg = TrainConfig(
            epochs=epochs,
            batch_size=8,
            limit_batches=8,
            lr=5e-3,
            schedule="constant",
            compile=compiled,
        )
        trainer = Trainer(model.model, pd_, cfg, model.model_config(), DistEnv())
        assert (trainer.model is not trainer.net) == compiled  # the compiled wrapper
        trainers.append(trainer)
    loader = pd_.get_dataloader_distributed(8, 64)["train_loader"]
    return trainers[0], trainers[1], loader


def test_compiled_steps_match_eager(monkeypatch, tmp_path):
    """train.compile=true computes the eager loss and gradients, step by step: 6 batches along
    the eager trajectory (max-norm renormalisation included), the compiled network reloaded with
    the eager weights before each, so float noise never compounds (over whole epochs GEARS's
    max-norm renormalisation makes any two runs drift apart: 2.6% by epoch 4 here). aot_eager
    runs the same kernels; the padded rows and the weighted batch-norm sum in another order."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    eager, compiled, loader = _eager_and_compiled(tmp_path)
    loader.set_epoch(0)
    checked = set()
    for i, batch in enumerate(loader):
        if i == 6:
            break
        compiled.net.load_state_dict(eager.net.state_dict())
        losses, grads = [], []
        for trainer in (eager, compiled):
            trainer.model.train()
            trainer.opt.zero_grad(set_to_none=True)
            loss = trainer.loss_on(batch, trainer.row_layout(batch.counts))
            loss.backward()
            losses.append(loss.item())
            grads.append([p.grad for p in trainer.net.parameters()])
        assert abs(losses[1] - losses[0]) < 1e-5 * losses[0], (i, losses)
        names = [name for name, _ in eager.net.named_parameters()]
        for name, g_eager, g_compiled in zip(names, *grads):
            if g_eager.norm() < 1e-5 * losses[0]:  # biases before a batch-norm: float noise
                continue
            rel = ((g_compiled - g_eager).norm() / g_eager.norm()).item()
            assert rel < 2e-3, f"step {i}, {name}: compiled gradient off by {rel:.1e} (norm)"
            checked.add(name)
        eager.opt.step()
    assert len(checked) > 20, checked  # most parameters get a real gradient


def test_compiled_trainer_learns_as_eager(monkeypatch, tmp_path):
    """A compiled Trainer learns as the eager one: its 3-epoch training-loss drop lies within the
    spread of eager runs whose starting weights differ by float noise (x (1 +- 1e-7)), widened
    by 10% of eager's drop. One eager run is no reference: the runs are chaotic (GEARS's
    max-norm renormalisation), a 1e-7 nudge alone moved eager's drop from 0.112 to 0.0997.
    Step-by-step equality is test_compiled_steps_match_eager's job."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    eager_drops, compiled_drop = [], None
    for k, nudge in enumerate((0.0, 1e-7, -1e-7)):
        eager, compiled, loader = _eager_and_compiled(tmp_path / str(k), epochs=3)
        with torch.no_grad():
            for p in eager.net.parameters():
                p.mul_(1 + nudge)
        losses = eager.fit({"train_loader": loader}, progress=False).train_loss
        eager_drops.append(1 - losses[-1] / losses[0])
        if compiled_drop is None:
            losses = compiled.fit({"train_loader": loader}, progress=False).train_loss
            compiled_drop = 1 - losses[-1] / losses[0]
    print("DROPS eager", eager_drops, "compiled", compiled_drop)
    margin = 0.1 * float(np.median(eager_drops))
    assert min(eager_drops) > 0.02, eager_drops  # eager learns
    assert min(eager_drops) - margin < compiled_drop < max(eager_drops) + margin, (
        eager_drops,
        compiled_drop,
    )
