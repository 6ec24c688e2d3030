"""train.compile under mixed precision: inductor-compiled bf16 and fp16 training steps through
Trainer.loss_on against eager ones, on every row layout the engine produces.

Both are compared with an fp32 eager step from the same weights: compiled and eager autocast
round at different places (inductor may keep a fused kernel's intermediates in fp32), so
neither equals the other, but the compiled step must be as close to fp32 as the eager one is.
bf16 keeps 8 significant bits (unit roundoff u = 2^-8 = 3.9e-3), fp16 11 (u = 2^-11 = 4.9e-4).
Through this ill-conditioned network (batch-norms over 16 nearly equal rows) eager bf16
gradients sit 0.07-35% (median 10%) from fp32's, fp16 ones 0.008-13% (median 0.25%).
Required, per tensor: |compiled - fp32| <= 2 |eager - fp32| + u |fp32| (norms), the u term
for tensors that eager happens to get almost exactly (the loss: 3e-6). Measured: the compiled
error is at most 1.35x eager's (median 1.00). Eager against fp32 is test_engine's and
test_mixed_precision's job.

Cold, inductor compiles two forward and two backward graphs (~2 CPU-minutes of C++ builds on
this machine); its on-disk cache makes later runs ~50 CPU-s."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch._dynamo
import torch._inductor.config
from helpers import tiny_split

from gears.compat.api import GEARS
from gears.config import TrainConfig
from gears.model.kernels import WeightedBatchNorm1d
from gears.train.distributed import DistEnv
from gears.train.engine import (
    CELL_ROWS,
    EqualRows,
    RepeatRows,
    Trainer,
    WeightedRows,
    seed_everything,
)
from tests.test_network import _biases_cancelled_by_bn

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}
K = 2.0  # the compiled step's error may be this multiple of eager's (measured: <= 1.35)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tiny screen, its initial weights and Trainers on copies of one network: fp32 eager,
    and per dtype eager and inductor-compiled. One compiled module per dtype serves every test
    (every batch below pads to 16 rows: one forward and one backward graph per dtype)."""
    torch._dynamo.reset()
    pd_ = tiny_split(tmp_path_factory.mktemp("data"))
    seed_everything(0)
    model = GEARS(pd_, device="cpu").model_initialize(hidden_size=16)
    initial = copy.deepcopy(model.model.state_dict())

    def trainer(precision: str, compiled: bool) -> Trainer:
        cfg = TrainConfig(precision="fp32" if precision == "fp32" else "bf16", compile=compiled)
        t = Trainer(copy.deepcopy(model.model), pd_, cfg, model.model_config(), DistEnv())
        # fp16 on CPU is refused by the config (a GPU precision whose GradScaler is CUDA's):
        # its autocast dtype is set by hand; the engine's GradScaler stays disabled.
        t.amp_dtype = DTYPES.get(precision)
        assert not t.scaler.is_enabled()
        return t

    trainers = {"fp32": trainer("fp32", False)}
    for name in DTYPES:
        trainers[name, False] = trainer(name, False)
        trainers[name, True] = trainer(name, True)
    # One compile thread: no worker pool to start for a few dozen small kernels.
    with torch._inductor.config.patch(compile_threads=1):
        yield pd_, initial, trainers
    torch._dynamo.reset()


def _batch(pd_, cells: list[int]):
    """cells[k] cells of the k-th training condition (the control first)."""
    ds = pd_.example_set("train")
    conds = np.unique(ds.cond)
    ids = [np.flatnonzero(ds.cond == c)[:n] for c, n in zip(conds, cells)]
    return ds[np.concatenate(ids)]


# Cells per condition, and the layout the eager engine picks (Trainer.row_layout). Compiled,
# the engine keeps distinct rows (counts uneven) or the common count, padded to 16 rows whose
# padding weighs 0; every layout is also run compiled as eager runs it.
BATCHES = {
    # 13 conditions, 16 cells: deduplication removes few rows -> one row per cell (16 rows,
    # native batch-norm when eager; no padding when compiled).
    "cell-rows": ([2, 2, 2] + [1] * 10, CELL_ROWS),
    # counts 2, 2, 4, 2, ...: 13 uniform rows of 2 cells (native batch-norm when eager).
    "repeat-rows": ([2, 2, 4] + [2] * 9, RepeatRows),
    # 12 conditions x 2 cells: one count for every row (native batch-norm when eager).
    "uniform": ([2] * 12, EqualRows),
    # a grouped batch with uneven blocks 4, 4, 4, 2, ...: the [U*G, H] batch-norms take
    # _BlockWeightedBatchNormFn, the [U, H] ones _WeightedBatchNormFn.
    "grouped-blocks": ([4, 4, 4] + [2] * 7, WeightedRows),
    # a random batch, uneven counts: the same weighted paths.
    "uneven": ([1, 5, 3, 1, 2, 1, 4, 1, 1, 2, 1], WeightedRows),
}


def _step(trainer: Trainer, initial: dict, batch, layout) -> dict[str, torch.Tensor]:
    """One training forward and backward from the initial weights through loss_on -> the
    network's output rows (padding included), the loss, every gradient, and each batch-norm's
    running statistics' change (mean and variance, concatenated)."""
    trainer.net.load_state_dict(initial)
    trainer.model.train()
    trainer.opt.zero_grad(set_to_none=True)
    outputs = []
    model = trainer.model
    trainer.model = lambda inputs: outputs.append(model(inputs)) or outputs[-1]
    try:
        loss = trainer.loss_on(batch, layout)
    finally:
        trainer.model = model
    loss.backward()
    result = {"output": outputs[0].detach().float(), "loss": loss.detach()}
    for name, p in trainer.net.named_parameters():
        result[name] = p.grad.detach().clone()
    for name, m in trainer.net.named_modules():
        if isinstance(m, WeightedBatchNorm1d):
            result[f"{name}.running"] = torch.cat(
                [
                    m.running_mean - initial[f"{name}.running_mean"],
                    m.running_var - initial[f"{name}.running_var"],
                ]
            )
    return result


@pytest.mark.parametrize("case", list(BATCHES))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_compiled_amp_step_matches_eager(setup, dtype, case):
    """Output rows, loss, every gradient and every batch-norm's running-statistics update of a
    compiled autocast step are as close to fp32's as eager autocast's (module docstring), for
    the layout eager picks and the one the compiled engine picks. Biases that a batch-norm
    cancels (true gradient 0) must be float noise: below u times the largest gradient."""
    pd_, initial, trainers = setup
    cells, kind = BATCHES[case]
    batch = _batch(pd_, cells)
    eager, compiled, ref = trainers[dtype, False], trainers[dtype, True], trainers["fp32"]
    layouts = [eager.row_layout(batch.counts), compiled.row_layout(batch.counts)]
    assert isinstance(layouts[0], kind) if isinstance(kind, type) else layouts[0] == kind
    u = UNIT_ROUNDOFF[dtype]
    cancelled = _biases_cancelled_by_bn(ref.net)
    for layout in layouts[: 1 if layouts[1] == layouts[0] else 2]:
        r32 = _step(ref, initial, batch, layout)
        re = _step(eager, initial, batch, layout)
        rc = _step(compiled, initial, batch, layout)
        n = r32["output"].shape[0]
        assert rc["output"].shape[0] == 16 and torch.isfinite(rc["output"]).all()
        rc["output"] = rc["output"][:n]  # the padding rows stand for no cell
        largest = max(r32[name].norm() for name, _ in ref.net.named_parameters())
        for name in r32:
            where = f"{dtype} {case} {layout!r} {name}"
            if name in cancelled:
                for r in (re, rc):
                    assert r[name].norm() <= u * largest, (where, r[name].norm(), largest)
                continue
            err_c = (rc[name] - r32[name]).norm()
            err_e = (re[name] - r32[name]).norm()
            scale = r32[name].norm()
            assert err_c <= K * err_e + u * scale, (where, err_c / scale, err_e / scale)


def test_compiled_fp16_step_without_scaler_is_finite(setup):
    """A compiled fp16 step with the engine's GradScaler disabled produces no NaN or inf in the
    fused batch-norms, even when the cell-gene rows' variance (> 65,504) exceeds fp16's range:
    recovery_w's first Linear scaled up 1000x, so the [U*G, 2H] rows entering the block-weighted
    batch-norm have variances ~1e5, which fp16 statistics (or an fp16 variance from 1/rstd^2)
    turn into inf. Statistics are fp32: outputs (padding rows included), loss, gradients and
    running statistics finite, and the batch variance recorded in full."""
    pd_, initial, trainers = setup
    trainer = trainers["fp16", True]
    stressed = copy.deepcopy(initial)
    stressed["recovery_w.linears.0.weight"] = initial["recovery_w.linears.0.weight"] * 1000
    batch = _batch(pd_, BATCHES["grouped-blocks"][0])
    result = _step(trainer, stressed, batch, trainer.row_layout(batch.counts))
    for name, value in result.items():
        assert torch.isfinite(value).all(), name
    bn = trainer.net.recovery_w.norms[0]
    batch_var = bn.running_var - (1 - bn.momentum) * stressed["recovery_w.norms.0.running_var"]
    assert batch_var.max() / bn.momentum > 65504  # the stress is real: beyond fp16's range
    trainer.opt.step()
    for name, p in trainer.net.named_parameters():
        assert torch.isfinite(p).all(), name
