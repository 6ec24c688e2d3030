"""The private torch APIs behind gears/torch_compat.py: each exists and behaves as its wrapper
assumes (a torch upgrade that changes one fails here, not in a user's run), and each wrapper's
documented fallback or clear error where the API is gone."""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gears import torch_compat
from gears.errors import GearsInputError
from gears.model.kernels import WeightedBatchNorm1d


def test_torch_version_is_read_from_local_builds(monkeypatch):
    for version, expected in (("2.11.0+cu130", (2, 11)), ("2.13.0", (2, 13)), ("3.0.1a0", (3, 0))):
        monkeypatch.setattr(torch, "__version__", version)
        assert torch_compat.torch_version() == expected


# --------------------------------------------------------------- torch._functorch.config
def test_compiled_backward_config_keys_exist_and_are_patched_inside_only():
    import torch._functorch.config as config

    before = {k: getattr(config, k) for k in torch_compat.COMPILED_BACKWARD_CONFIG}
    # The defaults the wrapper changes (a changed default may make the patch unnecessary or wrong).
    assert before == {
        "backward_pass_autocast": "same_as_forward",
        "treat_parameters_as_free_to_save": True,
    }
    with torch_compat.compiled_backward_config():
        assert {
            k: getattr(config, k) for k in torch_compat.COMPILED_BACKWARD_CONFIG
        } == torch_compat.COMPILED_BACKWARD_CONFIG
    assert {k: getattr(config, k) for k in before} == before


def test_compiled_backward_config_without_a_key_refuses_compile_by_name(monkeypatch):
    keys = {**torch_compat.COMPILED_BACKWARD_CONFIG, "a_key_this_torch_lacks": 1}
    monkeypatch.setattr(torch_compat, "COMPILED_BACKWARD_CONFIG", keys)
    with pytest.raises(GearsInputError, match=r"train.compile=true needs .*a_key_this_torch_lacks"):
        torch_compat.compiled_backward_config()


# ---------------------------------------------------- DDP ignore list, default store (c10d)
class WithGraph(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.norm = nn.BatchNorm1d(2)
        self.register_buffer("graph", torch.arange(4.0), persistent=False)


@pytest.fixture
def one_rank_group():
    """A gloo group of one process (this one), destroyed afterwards."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ddp_ignore_keeps_the_named_buffers_out_of_ddps_broadcast(one_rank_group):
    module = WithGraph()
    assert torch_compat.ddp_ignore(module, ["graph"]) is True
    broadcast = set(DDP(module).named_module_buffers)
    assert "graph" not in broadcast and "norm.running_mean" in broadcast
    assert "graph" in set(DDP(WithGraph()).named_module_buffers)  # without the call it is there


def test_ddp_ignore_without_the_api_warns_and_returns_false(monkeypatch):
    monkeypatch.delattr(DDP, "_set_params_and_buffers_to_ignore_for_model")
    with pytest.warns(UserWarning, match="broadcasts the fixed graph buffers"):
        assert torch_compat.ddp_ignore(WithGraph(), ["graph"]) is False


def test_default_store_is_the_groups_key_value_store(one_rank_group):
    store = torch_compat.default_store()
    assert isinstance(store, dist.Store)
    store.set("data_step", "done")
    assert store.get("data_step") == b"done"


def test_default_store_without_the_api_is_a_clear_error(monkeypatch):
    from torch.distributed import distributed_c10d

    monkeypatch.delattr(distributed_c10d, "_get_default_store")
    with pytest.raises(RuntimeError, match="has no .*_get_default_store"):
        torch_compat.default_store()


# ----------------------------------------------------------------- batch-norm base class
def test_every_batch_norm_derives_from_the_private_base():
    base = nn.modules.batchnorm._BatchNorm
    assert torch_compat.BATCH_NORM_TYPES == (base,)
    norms = [nn.BatchNorm1d(2), nn.BatchNorm2d(2), nn.BatchNorm3d(2), nn.SyncBatchNorm(2)]
    norms += [nn.LazyBatchNorm1d(), WeightedBatchNorm1d(2)]
    assert all(torch_compat.is_batch_norm(m) for m in norms)
    assert not any(torch_compat.is_batch_norm(m) for m in (nn.LayerNorm(2), nn.Linear(2, 2)))


def test_batch_norm_types_fall_back_to_the_public_classes(monkeypatch):
    monkeypatch.delattr(nn.modules.batchnorm, "_BatchNorm")
    types = torch_compat._batch_norm_types()
    assert nn.BatchNorm1d in types and nn.SyncBatchNorm in types
    assert isinstance(WeightedBatchNorm1d(2), types)


# -------------------------------------------------------------- pickled tensors' globals
def _globals_named(data: bytes) -> set[tuple[str, str]]:
    """(module, name) of every global the pickle names, read by gears.compat.cell_gears's unpickler
    (which refuses any global it does not admit)."""
    from gears.compat.cell_gears import ConfigUnpickler

    named = set()

    class Recording(ConfigUnpickler):
        def find_class(self, module, name):
            named.add((module, name))
            return super().find_class(module, name)

    Recording(io.BytesIO(data)).load()
    return named


def test_plain_pickles_of_tensors_name_the_admitted_rebuilders():
    """cell-gears's config.pkl was written by plain pickle: its tensors (in cell-gears's own
    file, and pickled by this torch) name these globals, and nothing the reader refuses."""
    admitted = torch_compat.tensor_pickle_globals()
    fixture = Path(__file__).parent / "fixtures" / "cell_gears" / "model_plain" / "config.pkl"
    assert ("torch._utils", "_rebuild_tensor_v2") in _globals_named(fixture.read_bytes())
    tensor = pickle.dumps({"G_go": torch.arange(6).reshape(2, 3)})
    param = pickle.dumps(nn.Parameter(torch.ones(2)))
    assert set(admitted) <= _globals_named(tensor) | _globals_named(param)
    for (module, name), function in admitted.items():
        assert getattr(__import__(module, fromlist=[name]), name) is function


def test_tensor_pickle_globals_without_one_is_a_clear_error(monkeypatch):
    import torch._utils

    monkeypatch.delattr(torch._utils, "_rebuild_parameter")
    with pytest.raises(RuntimeError, match=r"no torch\._utils\._rebuild_parameter"):
        torch_compat.tensor_pickle_globals()


# ------------------------------------------------------------------------- dispatch mode
def test_dispatch_mode_base_sees_every_aten_op():
    seen = []

    class Record(torch_compat.dispatch_mode_base()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.arange(4.0)
    with Record():
        (x + 1).nonzero()
    assert seen == ["aten.add.Tensor", "aten.nonzero.default"]


def test_dispatch_mode_base_without_the_module_is_a_clear_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch.utils._python_dispatch", None)
    with pytest.raises(RuntimeError, match="TorchDispatchMode"):
        torch_compat.dispatch_mode_base()
