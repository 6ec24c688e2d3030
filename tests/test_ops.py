"""Tests for benchmarks/opcount.py and what it guards: the ops of a training step stay flat in the
distinct perturbations of a batch (each op is a kernel launch on a GPU), and no op in the steady
step makes the host wait for the device, in fp32, bf16 and fp16, in every row layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import tiny_split
from opcount import (
    HostSyncError,
    OpCounter,
    StepLoader,
    SyncGuard,
    count_epoch,
    guard_epoch,
)

import gears.model.kernels as kernels
from gears.compat.api import GEARS
from gears.config import TrainConfig
from gears.data.loaders import Batch
from gears.data.pertdata import PertData
from gears.model.batch import ModelBatch
from gears.model.kernels import WeightedBatchNorm1d, _BlockWeightedBatchNormFn
from gears.train.distributed import DistEnv
from gears.train.engine import (
    Trainer,
    seed_everything,
)

# The step's bounds (benchmarks/bench_ops.py prints the same counts on a 1,000-gene screen):
# batch 256 within 1.3x of batch 32's ops and under 700; batch 32 under 450.
GROWTH, MOST, MOST_AT_32 = 1.3, 700, 450


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> PertData:
    return tiny_split(tmp_path_factory.mktemp("data"))


def _trainer(pd_: PertData, precision: str = "fp32") -> Trainer:
    seed_everything(0)
    model = GEARS(pd_, device="cpu").model_initialize(hidden_size=16)
    trainer = Trainer(model.model, pd_, TrainConfig(), model.model_config(), DistEnv())
    trainer.check_every = trainer.cfg.log_every  # as on a GPU: the interval check stays out
    if precision == "bf16":
        trainer.amp_dtype = torch.bfloat16
    elif precision == "fp16":
        # fp16 is CUDA-only in the config; its CPU twin: fp16 autocast and a CPU GradScaler.
        trainer.amp_dtype = torch.float16
        trainer.scaler = torch.amp.GradScaler("cpu")
    return trainer


def _batch(pd_: PertData, counts: list[int], seed: int = 0) -> Batch:
    """A training batch of sum(counts) cells over len(counts) distinct perturbations (singles
    and doubles drawn from the vocabulary, so that there can be hundreds), cells in random
    order, random expression."""
    rng = np.random.default_rng(seed)
    n_perts, G, U = len(pd_.pert_names), pd_.n_genes, len(counts)
    pairs = {(int(rng.integers(n_perts)), -1) for _ in range(4 * U)}
    pairs |= {tuple(int(p) for p in rng.choice(n_perts, 2, replace=False)) for _ in range(8 * U)}
    uniq_pert_index = torch.tensor(sorted(pairs)[:U]).reshape(U, 2)
    assert len(uniq_pert_index) == U
    inverse = torch.from_numpy(rng.permutation(np.repeat(np.arange(U), counts)))
    uniq_cond = torch.from_numpy(rng.integers(0, len(pd_.conditions), U))
    B = int(sum(counts))
    gen = torch.Generator().manual_seed(seed)
    return Batch(
        x=torch.rand(B, G, generator=gen) * 3,
        y=torch.rand(B, G, generator=gen) * 3,
        pert_index=uniq_pert_index[inverse],
        cond=uniq_cond[inverse],
        de_idx=torch.full((B, 20), -1),
        uniq_cond=uniq_cond,
        uniq_pert_index=uniq_pert_index,
        inverse=inverse,
        counts=torch.tensor(counts, dtype=torch.float32),
        example=torch.arange(B),
    )


def _random_counts(batch: int, conditions: int, seed: int) -> list[int]:
    """Cells per distinct perturbation of a random batch: `batch` cells drawn uniformly from
    `conditions` perturbations (350: ~30 distinct among 32 cells, ~180 among 256)."""
    draws = np.random.default_rng(seed).integers(0, conditions, batch)
    return np.unique(draws, return_counts=True)[1].tolist()


# Cells per distinct perturbation in each row layout that Trainer.row_layout picks, at batch 32
# and 256 ("random": one row per cell at 32, weighted at 256, as on a 500-condition screen).
LAYOUTS = {
    "random": (lambda b, s: _random_counts(b, 350, s)),
    "weighted": (lambda b, s: [3, 1, 2, 2] * (b // 8)),  # uneven: the weighted batch-norms
    "repeat": (lambda b, s: [8] + [4] * (b // 4 - 2)),  # RepeatRows: uniform rows of 4
    "grouped": (lambda b, s: [4] * (b // 4)),  # equal counts: the native kernels
}


def _epoch(trainer: Trainer, batches: list[Batch], epoch: int) -> None:
    trainer.train_epoch(StepLoader(batches, lambda b: b, lambda i: None), epoch, progress=False)


def _steady_ops(trainer: Trainer, batches: list[Batch]) -> list[int]:
    """Ops of each step after the first (which creates the optimizer's state)."""
    return [sum(step.values()) for step in count_epoch(trainer, batches, lambda b: b)[1:]]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_step_ops_do_not_grow_with_distinct_perturbations(tiny, layout):
    """A whole training step (row layout, forward, loss, backward, clipping, Adam, the engine's
    bookkeeping) at batch 256 dispatches at most 1.3x the ops of batch 32 and at most 700,
    in every layout; a layout that both sizes share costs the same ops at both (420-424 a
    weighted step). When the weighted batch-norm over the [U*G, H] cell-gene rows ran one
    native kernel per distinct perturbation, forward and backward, a weighted step took 626
    ops at batch 32 and 1,522 at 256, and random batches 347 and 1,906."""
    trainer = _trainer(tiny)
    ops, kinds = {}, {}
    for size in (32, 256):
        batches = [_batch(tiny, LAYOUTS[layout](size, seed), seed) for seed in range(3)]
        kinds[size] = {trainer.row_layout(b.counts).kind for b in batches}
        ops[size] = _steady_ops(trainer, batches)
    expected = {"random": ("cells", "weighted"), "weighted": ("weighted",) * 2}
    expected.update(repeat=("repeat",) * 2, grouped=("uniform",) * 2)
    assert (kinds[32], kinds[256]) == tuple({k} for k in expected[layout])
    assert max(ops[32]) <= MOST_AT_32, ops
    assert max(ops[256]) <= min(GROWTH * min(ops[32]), MOST), ops
    if layout != "random":  # the same layout at both sizes: the same ops
        assert set(ops[32]) == set(ops[256]), ops


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


def test_sync_guard_names_the_projects_line_when_the_venv_is_inside_the_clone(
    tmp_path, monkeypatch
):
    """A clone whose virtual environment lives inside it (as CI's does): an installed package's
    frame is under the repository root too, but the refusal names the project's line that
    called into it, not the package's. Caught: the frame finder took the innermost frame that
    was not torch's or its own, i.e. the installed package's line."""
    import sys

    import opcount

    installed = tmp_path / ".venv" / "lib" / "python3" / "site-packages"
    installed.mkdir(parents=True)
    (installed / "opcount_fake_pkg.py").write_text("def select(t):\n    return t.nonzero()\n")
    (tmp_path / "opcount_fake_step.py").write_text(
        "import opcount_fake_pkg\n\n\ndef step(t):\n    return opcount_fake_pkg.select(t) + 1\n"
    )
    monkeypatch.syspath_prepend(str(installed))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(opcount, "ROOT", tmp_path.resolve(), raising=False)
    import opcount_fake_step

    t = torch.tensor([1.0, 0.0])
    try:
        with SyncGuard(cuda=False), pytest.raises(HostSyncError) as caught:
            opcount_fake_step.step(t)
    finally:
        for name in ("opcount_fake_step", "opcount_fake_pkg"):
            sys.modules.pop(name, None)
    message = str(caught.value)
    assert "opcount_fake_step.py:5 (step:" in message, message
    assert "site-packages" not in message, message


def test_sync_guard_lets_fixed_shape_ops_run():
    """Long-index gathers, repeat_interleave with output_size and where() do not wait."""
    t = torch.tensor([1.0, -2.0, 3.0])
    with SyncGuard(cuda=False):
        repeats = torch.ones(3, dtype=torch.long)
        out = t.repeat_interleave(repeats, output_size=3) + t[torch.arange(3)]
        out = torch.where(out > 0, out, 0.0).index_select(0, torch.zeros(2, dtype=torch.long))
    assert out.tolist() == [2.0, 2.0]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_steady_step_makes_no_host_sync(tiny, precision):
    """Every op of the steady training step (batch.to(device), forward, loss, backward,
    clipping, the optimizer step through the fp16 GradScaler, the engine's per-step
    bookkeeping), in each row layout, under SyncGuard: nothing waits for the device. The
    loader's gather is host work (numpy) and runs before; the row layout is chosen from host
    counts and the stop / non-finite check syncs at its interval by design: both run allowed.
    Caught: a boolean mask on the weighted batch-norm's weights (`w = w[w >= 0]`), which the
    earlier check (Python-level .item() / bool()) let through, and the two get_scale() reads
    per fp16 step that counted skipped steps."""
    trainer = _trainer(tiny, precision)
    batches = [_batch(tiny, LAYOUTS[k](32, 1), seed=i) for i, k in enumerate(LAYOUTS)]
    kinds = {trainer.row_layout(b.counts).kind for b in batches}
    assert kinds == {"cells", "weighted", "repeat", "uniform"}
    _epoch(trainer, batches, 0)  # warm-up: creates the optimizer's state
    guard = guard_epoch(trainer, batches, epoch=1)
    assert guard.refused == []
    assert trainer.step == 2 * len(batches)


def test_fp16_skipped_steps_are_counted_without_a_host_sync(tiny):
    """A step whose gradients overflow is skipped by the GradScaler and counted on the device
    under SyncGuard; the count reaches the history at the epoch's end."""
    trainer = _trainer(tiny, "fp16")
    batches = [_batch(tiny, LAYOUTS["weighted"](32, 0), seed=i) for i in range(3)]
    _epoch(trainer, batches, 0)
    loss_on = trainer.loss_on
    calls = iter(range(100))

    def overflowing(batch, layout=None):
        loss = loss_on(batch, layout)
        return loss * float("inf") if next(calls) == 1 else loss

    trainer.loss_on = overflowing
    scale = trainer.scaler.get_scale()
    guard_epoch(trainer, batches, epoch=1)
    assert trainer.skipped_steps == 1
    assert trainer.history.skipped_steps == [0, 1]
    assert trainer.scaler.get_scale() == scale / 2  # lowered once, then no growth yet
    assert all(torch.isfinite(p).all() for p in trainer.net.parameters())


def test_network_ops_are_flat_in_rows_on_the_gpu_path(tiny, monkeypatch):
    """GEARSNet's forward + backward in fp32, bf16 and fp16 with the GPU's kernel choices
    (no per-row CPU loops for half precision): the same ops for 8 rows as for 96."""
    monkeypatch.setattr(kernels, "_per_row", lambda x, other: False)
    net = GEARS(tiny, device="cpu").model_initialize(hidden_size=16).model.train()
    for dtype in (None, torch.bfloat16, torch.float16):
        ops = []
        for U in (8, 96):
            rows = _batch(tiny, [2] * U).uniq_pert_index
            counts = (torch.arange(U) % 3 + 1).float()
            net.zero_grad(set_to_none=True)
            with OpCounter() as counter:
                with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=bool(dtype)):
                    out = net(ModelBatch(rows, counts, n_cells=float(counts.sum())))
                out.float().square().mean().backward()
            ops.append(counter.total())
        assert ops[0] == ops[1], (dtype, ops)


@pytest.mark.slow
def test_bench_ops_quick_writes_every_row(tmp_path):
    """benchmarks/bench_ops.py --quick: a row per precision, batching and batch size whose
    phases add up to its total, the batch-size ratio of each, and the provenance fields."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "ops.json"
    cmd = [sys.executable, str(root / "benchmarks" / "bench_ops.py"), "--quick", "--json", str(out)]
    run = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert {"commit", "command", "date", "machine"} <= report["provenance"].keys()
    rows = report["rows"]
    keys = {(r["precision"], r["batching"], r["batch"]) for r in rows}
    assert keys == {
        (p, b, n) for p in ("fp32", "bf16") for b in ("random", "grouped") for n in (32, 256)
    }
    for row in rows:
        assert abs(sum(row["phases"].values()) - row["mean"]) < 1e-6
        assert row["phases"]["forward"] > 0 and row["phases"]["backward"] > 0
    fp32 = [r for r in report["ratios"] if r["precision"] == "fp32"]
    assert len(fp32) == 2 and all(r["ratio"] <= GROWTH for r in fp32)
    assert "ratio" in run.stdout
