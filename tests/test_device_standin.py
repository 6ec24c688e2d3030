"""The CPU stand-in for GPU memory (gears/device.py, GEARS_DEVICE_STANDIN=1): device tensors
refuse host reads, and the main job, predict.py and gears.cli.seeds run end to end with it, so a
forgotten host copy of a GPU tensor fails here instead of at the end of a GPU run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import TINY, TINY_CLI, tiny_split

from gears.device import (
    STANDIN_ENV,
    DeviceTensor,
    HostReadError,
    holds_device_memory,
    to_device,
    to_host,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@pytest.fixture
def standin(monkeypatch):
    monkeypatch.setenv(STANDIN_ENV, "1")


READS = {
    "Tensor.numpy()": lambda t: t.numpy(),
    "Tensor.tolist()": lambda t: t.tolist(),
    "Tensor.item()": lambda t: t.sum().item(),
    "float()": lambda t: float(t.sum()),
    "int()": lambda t: int(t.sum()),
    "bool()": lambda t: bool(t.sum() > 0),
    "Python index": lambda t: [0, 1, 2][t.long()[0]],
    "numpy conversion": lambda t: np.asarray(t),
    "pin_memory()": lambda t: t.pin_memory(),
    "Tensor.numpy() after .cpu()": lambda t: t.cpu().numpy(),  # .cpu() is no way out
}


@pytest.mark.parametrize("read", list(READS))
def test_device_tensors_refuse_host_reads_and_name_the_line(standin, read):
    x = to_device(torch.arange(3.0), "cpu")
    y = torch.nn.functional.relu(x * 2 + 1)  # torch ops keep it a device tensor
    assert isinstance(y, DeviceTensor)
    with pytest.raises(HostReadError, match=r"test_device_standin\.py:\d+ .*to_host"):
        READS[read](y)


def test_to_host_is_the_way_out(standin):
    y = to_device(torch.arange(3.0), "cpu") * 2
    host = to_host(y)
    assert type(host) is torch.Tensor and host.tolist() == [0.0, 2.0, 4.0]
    assert holds_device_memory("cpu") and holds_device_memory("cuda")


def test_without_the_standin_cpu_tensors_are_plain(monkeypatch):
    monkeypatch.delenv(STANDIN_ENV, raising=False)
    assert type(to_device(torch.ones(2), "cpu")) is torch.Tensor
    assert not holds_device_memory("cpu") and holds_device_memory("cuda")


def test_parameters_buffers_gradients_and_optimizer_states_are_device_tensors(standin, tmp_path):
    """module_to_device (GEARS._build, Trainer) places the model: a host read of a weight, a
    gradient, an optimizer state or a batch-norm statistic fails as it would on a GPU."""
    from gears.compat.api import GEARS
    from gears.config import TrainConfig
    from gears.model.batch import ModelBatch

    pert_data = tiny_split(tmp_path)
    model = GEARS(pert_data, device="cpu").model_initialize(hidden_size=8)
    net = model.model
    assert all(isinstance(p, DeviceTensor) for p in net.parameters())
    assert all(isinstance(p, torch.nn.Parameter) and p.requires_grad for p in net.parameters())
    assert all(isinstance(b, DeviceTensor) for b in net.buffers())
    model.train(train_cfg=TrainConfig(epochs=1, limit_batches=2), progress=False)
    state = [v for s in model.trainer.opt.state.values() for k, v in s.items() if k != "step"]
    assert state and all(isinstance(v, DeviceTensor) for v in state)
    batch = next(iter(pert_data.get_dataloader_distributed(8, device=torch.device("cpu"))[
        "train_loader"
    ]))  # fmt: skip
    net(ModelBatch(batch.uniq_pert_index, batch.counts)).float().pow(2).mean().backward()
    grads = [p.grad for p in net.parameters() if p.grad is not None]
    assert grads and all(isinstance(g, DeviceTensor) for g in grads)
    for read in (
        lambda: float(net.indv_b1.sum()),
        lambda: net.bn_emb.running_var.tolist(),
        lambda: grads[0].abs().max().item(),
        lambda: state[0].numpy(),
    ):
        with pytest.raises(HostReadError, match=r"test_device_standin\.py:\d+"):
            read()


def test_device_tensors_deep_copy_and_save_as_a_gpu_tensor_does(standin, tmp_path):
    """A deep copy (the engine's best_state) stays on the device, a parameter stays a parameter;
    torch.save writes plain tensors, which weights_only loading accepts (a checkpoint)."""
    import copy

    x = to_device(torch.arange(3.0), "cpu")
    assert isinstance(copy.deepcopy(x), DeviceTensor)
    torch.save({"x": x}, tmp_path / "x.pt")
    loaded = torch.load(tmp_path / "x.pt", weights_only=True)["x"]
    assert type(loaded) is torch.Tensor and loaded.tolist() == [0.0, 1.0, 2.0]

    from gears.device import module_to_device

    layer = module_to_device(torch.nn.Linear(3, 2), "cpu")
    twin = copy.deepcopy(layer)
    assert isinstance(twin.weight, DeviceTensor) and isinstance(twin.weight, torch.nn.Parameter)
    assert twin.weight is not layer.weight
    assert torch.equal(to_host(twin.weight), to_host(layer.weight))
    state = copy.deepcopy(layer.state_dict())
    assert isinstance(state["bias"], DeviceTensor)
    torch.save({"model": state}, tmp_path / "c.pt")
    loaded = torch.load(tmp_path / "c.pt", weights_only=True)["model"]
    assert type(loaded["weight"]) is torch.Tensor
    assert torch.equal(loaded["weight"], to_host(layer.weight))


def test_reference_network_trains_and_predicts_with_the_standin(standin, tmp_path):
    """model.impl=reference on the device path: its forward reads nothing on the host (it
    counted the perturbed cells with int() and selected them with a mask, ~4 syncs a forward)."""
    from gears.compat.api import GEARS
    from gears.config import ModelConfig, TrainConfig

    pert_data = tiny_split(tmp_path)
    model = GEARS(pert_data, device="cpu").initialize(ModelConfig(hidden_size=8, impl="reference"))
    assert type(model.model).__name__ == "GEARSReference"
    model.train(train_cfg=TrainConfig(epochs=1, limit_batches=3), progress=False)
    genes = [[str(g)] for g in pert_data.pert_names[:2]]
    pred = model.predict(genes)
    assert all(np.isfinite(v).all() for v in pred.values())


def test_cell_gears_model_predicts_on_the_device_path(standin):
    """A cell-gears folder (cell_gears.read_config, read_weights, load_into) and cell-gears's
    predict() protocol around it: every tensor the model holds is on the device, and the
    predictions are still cell-gears's."""
    from test_cell_gears_models import FIXTURE, GENE2GO, RECORDED, SCREEN, as_cell_gears

    from gears.compat.api import GEARS

    model = GEARS.from_cell_gears(FIXTURE / "model_plain", SCREEN, GENE2GO)
    held = dict(model.prediction_net().named_parameters()) | dict(
        model.prediction_net().named_buffers()
    )
    assert any(k.startswith("self_loops_") for k in held)  # cell-gears's protocol's own
    placed = {k: isinstance(v, DeviceTensor) for k, v in held.items()}
    assert all(placed.values()), [k for k, on in placed.items() if not on]
    pred, _ = as_cell_gears(model, "model_plain")
    np.testing.assert_allclose(pred, RECORDED["model_plain/pred"], rtol=0, atol=2e-5)


def test_a_second_loader_build_keeps_batches_on_the_device_and_unpinned(standin, tmp_path):
    """GEARS.train() again with another batch size, or get_dataloader_distributed(device=...)
    twice: the matrix is on the device already, so the batches are still born there and must
    not be pinned (pin_memory() of a GPU tensor fails). Loader workers (num_workers > 0) must
    never index device memory: the matrix goes back to the host for them."""
    pert_data = tiny_split(tmp_path)
    for batch_size in (16, 8):
        loaders = pert_data.get_dataloader_distributed(
            batch_size, device=torch.device("cpu"), pin_memory=True
        )
        assert loaders["train_loader"].loader.pin_memory is False
        batch = next(iter(loaders["train_loader"]))
        assert isinstance(batch.x, DeviceTensor) and len(batch) == batch_size
    loaders = pert_data.get_dataloader_distributed(
        8, device=torch.device("cpu"), num_workers=1, pin_memory=True
    )
    assert not isinstance(pert_data.expr.rows(np.array([0, 1])), DeviceTensor)
    assert loaders["train_loader"].loader.pin_memory is True


@pytest.fixture(scope="module")
def standin_run(tmp_path_factory):
    """The README's main job (small) with every device tensor refusing host reads: train,
    evaluate, baselines, cell-eval scoring, plots, metrics.json; then predict.py on its model."""
    from train_single import main as train_main

    out = tmp_path_factory.mktemp("standin")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(STANDIN_ENV, "1")
        args = [
            f"out_dir={out / 'run'}",
            f"data.data_dir={out / 'data'}",
            f"data.synthetic={TINY_CLI}",
            "wandb.mode=disabled",
            "device=cpu",
            "model.hidden_size=16",
            "train.epochs=2",
            "train.batching=grouped",
            "model.uncertainty=true",
            "train.plot_conditions=2",
        ]
        from vcc_helpers import HAS_CELL_EVAL

        if HAS_CELL_EVAL:
            args.append("eval.cell_eval=true")
        results = train_main(args)
    return out, results, HAS_CELL_EVAL


def test_main_job_runs_with_device_tensors_that_refuse_host_reads(standin_run):
    out, results, has_cell_eval = standin_run
    run = out / "run"
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["test"]["mse_de"] == pytest.approx(results["test"]["mse_de"])
    assert metrics["baselines"] and metrics["train_fit"]
    assert (run / "model" / "model.pt").is_file()
    plots = sorted(p.name for p in (run / "plots").glob("*.png"))
    assert "loss.png" in plots and len(plots) == 3  # loss curve and 2 perturbation plots
    if has_cell_eval:
        assert metrics["cell_eval"]


def test_predict_py_runs_with_the_standin(standin_run, monkeypatch):
    from predict import main as predict_main

    out, _, _ = standin_run
    monkeypatch.setenv(STANDIN_ENV, "1")
    config = json.loads((out / "run" / "model" / "config.json").read_text())
    perts = ",".join(config["pert_names"][:2])
    predict_main(
        ["--model", str(out / "run" / "model"), "--perturbations", perts]
        + ["--cells-per-perturbation", "5", "--out", str(out / "pred.h5ad"), "--device", "cpu"]
    )
    assert (out / "pred.h5ad").is_file()


def test_seeds_run_with_the_standin(tmp_path, monkeypatch):
    from gears.cli.seeds import main as seeds_main

    monkeypatch.setenv(STANDIN_ENV, "1")
    seeds_main(
        ["--seeds", "1,2", f"out_dir={tmp_path / 'seeds'}", f"data.data_dir={tmp_path / 'd'}"]
        + [f"data.synthetic={TINY_CLI}", "wandb.mode=disabled", "device=cpu"]
        + ["model.hidden_size=16", "train.epochs=1", "train.plot_conditions=1"]
    )
    assert (tmp_path / "seeds" / "seeds_summary.json").is_file()


@pytest.mark.slow
def test_two_processes_with_synchronised_batchnorm_run_with_the_standin(tmp_path):
    """gloo DDP in bf16 with the weighted SyncBatchNorm (its row weights stay on the device)."""
    import subprocess

    from test_distributed import _env

    cmd = [sys.executable, str(ROOT / "train_distributed.py"), "--nproc", "2"]
    cmd += [f"out_dir={tmp_path / 'run'}", f"data.data_dir={tmp_path / 'data'}"]
    cmd += [f"data.synthetic={TINY_CLI}", "wandb.mode=disabled", "device=cpu"]
    cmd += ["model.hidden_size=16", "train.epochs=1", "train.precision=bf16"]
    cmd += ["distributed.sync_batchnorm=true", "train.plot_conditions=1"]
    result = subprocess.run(
        cmd, capture_output=True, text=True, env=_env(**{STANDIN_ENV: "1"}), timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "run" / "metrics.json").is_file()


def test_the_standin_engages_in_the_main_job(standin, tmp_path):
    """The job above proves something only if its matrix and batches were device tensors."""
    from gears.compat.api import GEARS
    from gears.config import TrainConfig

    pert_data = tiny_split(tmp_path)
    model = GEARS(pert_data, device="cpu").model_initialize(hidden_size=8)
    model.train(train_cfg=TrainConfig(epochs=1, limit_batches=1), progress=False)
    assert isinstance(pert_data.expr.dense, DeviceTensor)
    assert TINY["n_genes"] == pert_data.expr.shape[1]
