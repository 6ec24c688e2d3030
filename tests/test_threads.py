"""The CPU thread count changes no bit of a run (gears.model.kernels.on_one_thread, invariant_sum;
MKL's strict mode), so the training thread count may follow the load
(gears.train.runtime.ThreadPolicy). The oracle is always a run, or an op, at one thread."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import assert_same_run, user_env

from gears.config import Config
from gears.model.kernels import WeightedBatchNorm1d, invariant_sum
from gears.train import runtime
from gears.train.runtime import ThreadPolicy, fixed_threads_reason, usable_cores

ROOT = Path(__file__).resolve().parents[1]
# Above ATen's grain (32,768 elements) in every [cells, genes] tensor and batch-norm input.
WIDE_SCREEN = (
    "{n_genes: 2000, n_single: 16, n_double: 8, cells_per_condition: 16, "
    "n_control_cells: 128, n_modules: 8}"
)


def at_threads(n: int, fn):
    """fn() with torch at n threads, then torch's count as it was."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def _batch_norm_step(blocks: int | None):
    """Output, input gradient, weight and bias gradients and running statistics of one
    training-mode WeightedBatchNorm1d on [12,000, 64] rows (GEARSNet's cell-gene rows: 12
    blocks of 1,000 equal-weight rows with blocks=12; the native path with blocks=None)."""
    torch.manual_seed(0)
    x = (torch.randn(12000, 64) * 3 + 1).requires_grad_()
    dy = torch.randn(12000, 64)
    bn = WeightedBatchNorm1d(64)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    if blocks is None:
        y = bn(x)
    else:
        fractions = torch.rand(blocks, dtype=torch.float64).float()
        weight = fractions.repeat_interleave(12000 // blocks)
        y = bn(x, weight, blocks=blocks)
    y.backward(dy)
    return [y, x.grad, bn.weight.grad, bn.bias.grad, bn.running_mean, bn.running_var]


@pytest.mark.skipif(usable_cores() < 2, reason="needs 2 cores")
@pytest.mark.parametrize("blocks", [None, 12])
def test_training_batch_norm_has_the_same_bits_at_two_threads_as_at_one(blocks):
    """The training-mode native batch-norm kernels keep one partial sum per thread: without
    on_one_thread, 1 and 2 threads round the statistics and gradients differently."""
    one = at_threads(1, lambda: _batch_norm_step(blocks))
    two = at_threads(2, lambda: _batch_norm_step(blocks))
    for name, a, b in zip(("y", "dx", "dgamma", "dbeta", "mean", "var"), one, two):
        assert torch.equal(a, b), name


@pytest.mark.skipif(usable_cores() < 2, reason="needs 2 cores")
def test_invariant_sum_has_the_same_bits_at_any_thread_count():
    torch.manual_seed(0)
    x = torch.rand(32, 2000) * torch.rand(32, 1) * 1e3
    assert at_threads(1, lambda: invariant_sum(x)) == at_threads(2, lambda: invariant_sum(x))
    # What it replaces does not (above 32,768 elements the sum is split by threads), and below
    # that size it is the plain sum.
    assert at_threads(1, x.sum) != at_threads(2, x.sum)
    small = x[:16, :2000]
    assert torch.equal(invariant_sum(small), small.sum())


GEMM_PROBE = """
import torch
g = torch.Generator().manual_seed(0)
same = []
for m, k, n in [(10, 1000, 64), (10, 64, 1000), (10, 64, 64), (7, 3000, 64), (3, 5000, 128)]:
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    torch.set_num_threads(1)
    one = (a @ b, b.t() @ a.t())
    torch.set_num_threads(2)
    two = (a @ b, b.t() @ a.t())
    same.append(all(torch.equal(x, y) for x, y in zip(one, two)))
print(all(same))
"""


@pytest.mark.skipif(usable_cores() < 2, reason="needs 2 cores")
@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch is not an MKL build")
def test_mkl_strict_mode_gives_matrix_products_the_same_bits_at_any_thread_count():
    """Small-row products as GEARSNet's perturbation side computes them ([U, G] @ [G, H]), at 1
    and 2 threads, in a process started with the entry points' MKL_CBWR (MKL reads it at its
    first call). Seen failing with MKL_CBWR unset: on this machine's MKL four of the five
    shapes split their sums by thread."""
    got = subprocess.run(
        [sys.executable, "-c", GEMM_PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        env=user_env(MKL_CBWR=runtime.STRICT_MKL),
    )
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.strip() == "True"


def _config(**train) -> Config:
    cfg = Config()
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return cfg


def test_the_thread_count_is_fixed_where_it_could_change_a_bit(monkeypatch):
    """Only the built-in network, fp32, eager, without synchronised batch-norms, on a CPU with
    MKL's strict mode, with a load watch, at 2 threads or more follows the load."""
    governor = SimpleNamespace(usable=True, spinning=True, others=0.0)
    monkeypatch.setattr(runtime, "_governor", governor)
    monkeypatch.setenv("MKL_CBWR", "AUTO,STRICT")
    cpu = torch.device("cpu")
    assert fixed_threads_reason(_config(), cpu, 2) is None
    assert "CPU" in fixed_threads_reason(_config(), torch.device("cuda"), 2)
    assert "1 thread" in fixed_threads_reason(_config(), cpu, 1)
    assert "precision" in fixed_threads_reason(_config(precision="bf16"), cpu, 2)
    assert "compile" in fixed_threads_reason(_config(compile=True), cpu, 2)
    cfg = _config()
    cfg.model.impl = "reference"
    assert "model.impl=reference" in fixed_threads_reason(cfg, cpu, 2)
    cfg = _config()
    cfg.distributed.sync_batchnorm = True
    assert "sync_batchnorm" in fixed_threads_reason(cfg, cpu, 2)
    monkeypatch.setenv("MKL_CBWR", "AVX2")  # the user's own branch, without STRICT
    assert "strict" in fixed_threads_reason(_config(), cpu, 2)
    monkeypatch.setenv("MKL_CBWR", "AUTO,STRICT")
    monkeypatch.setattr(runtime, "_governor", None)  # in-process (a notebook): no load watch
    assert "load watch" in fixed_threads_reason(_config(), cpu, 2)


def test_thread_policy_drops_a_thread_per_busy_core_and_returns_when_free(monkeypatch):
    monkeypatch.delenv("GEARS_TEST_THREADS", raising=False)
    governor = SimpleNamespace(usable=True, spinning=True, others=0.0)
    policy = ThreadPolicy(8, governor, None)
    assert policy.wanted() == 8
    governor.spinning, governor.others = False, 1.0  # one busy core
    assert policy.wanted() == 7
    governor.others = 0.4  # part of one
    assert policy.wanted() == 7
    governor.others = 2.6
    assert policy.wanted() == 5
    governor.others = 20.0
    assert policy.wanted() == 1
    governor.spinning, governor.others = True, 0.1  # free again
    assert policy.wanted() == 8
    fixed = ThreadPolicy(8, governor, "train.compile=true")
    fixed.at_step()
    assert fixed.report() == "fixed (train.compile=true)"


def _train(out: Path, data: Path, *extra: str, **env: str) -> dict:
    """train_single.py on the wide screen (the user's environment without thread settings)."""
    args = [
        f"out_dir={out}",
        f"data.data_dir={data}",
        f"data.synthetic={WIDE_SCREEN}",
        "device=cpu",
        "wandb.mode=disabled",
        "train.epochs=2",
        "train.limit_batches=4",
        "train.plot_conditions=0",
        *extra,
    ]
    got = subprocess.run(
        [sys.executable, str(ROOT / "train_single.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=user_env(**env),
    )
    assert got.returncode == 0, got.stderr[-3000:]
    return json.loads((out / "metrics.json").read_text())


@pytest.mark.slow
@pytest.mark.skipif(usable_cores() < 2, reason="needs 2 cores")
def test_a_run_whose_thread_count_changes_every_step_equals_the_one_thread_run(tmp_path):
    """train_single.py at 2 threads, then 1, then 3 for two steps and round again, changed at
    step boundaries (GEARS_TEST_THREADS; the validation after epoch 1 at 3 threads, the test
    set's scoring after the last step at 3), on a screen whose every large tensor is above
    ATen's grain, against train.threads=1: the same weights, losses and metrics, bit for bit.
    Seen failing without on_one_thread in the batch-norms (every weight differed)."""
    data = tmp_path / "data"
    one = _train(tmp_path / "one", data, "train.threads=1")
    changing = _train(tmp_path / "changing", data, "train.threads=2", GEARS_TEST_THREADS="2,1,3,3")
    assert one["timing"]["thread_policy"] == "fixed (1 thread)"
    policy = changing["timing"]["thread_policy"]
    assert policy.startswith("follows load: 3 threads"), policy
    assert "2 threads" in policy and "1 thread " in policy, policy
    assert_same_run(tmp_path / "changing", tmp_path / "one")


@pytest.mark.slow
@pytest.mark.skipif(usable_cores() < 2, reason="needs 2 cores")
@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch is not an MKL build")
def test_no_op_of_a_training_epoch_gives_other_bits_at_two_threads():
    """benchmarks/thread_bits.py: every aten op of a few training steps at 1 and at 2 threads
    on the same inputs. Seen listing the batch-norms without on_one_thread, and the small
    matrix products with MKL_CBWR empty."""
    got = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "thread_bits.py"), "--genes", "400"]
        + ["--steps", "3"],
        capture_output=True,
        text=True,
        timeout=300,
        env=user_env(),
    )
    assert got.returncode == 0, got.stderr[-2000:]
    assert ", 0 with other bits" in got.stdout, got.stdout
