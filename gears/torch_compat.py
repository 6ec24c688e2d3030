"""The private torch APIs the project calls, each behind one function with a test
(tests/test_torch_compat.py) that fails when a torch release changes it, instead of a user's run.

Every torch API the code calls exists in torch 2.11 (the GPU image's; checked against its
sources) and 2.13 (requirements.txt's pin); docs/gpus_and_clusters.md lists them with their first
release. None needs a version guard today; the private ones below may change in any release, so
each says what it does when its API is gone.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch import nn

from gears.errors import GearsInputError

# torch._functorch.config keys that make a compiled backward mean what eager's means
# (gears.train.engine.compiled_backward_as_eager says why each is needed).
COMPILED_BACKWARD_CONFIG = {
    "backward_pass_autocast": "off",
    "treat_parameters_as_free_to_save": False,
}


def torch_version() -> tuple[int, int]:
    """(major, minor) of the running torch: '2.11.0+cu130' -> (2, 11)."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def compiled_backward_config() -> contextlib.AbstractContextManager:
    """A context setting COMPILED_BACKWARD_CONFIG in torch._functorch.config (private).

    Without those keys a compiled backward silently differs from eager's (tests/
    test_compile_amp.py), so a torch that lacks one refuses train.compile with a GearsInputError
    naming the key."""
    try:
        import torch._functorch.config as functorch_config
    except ImportError as e:
        raise GearsInputError(
            f"train.compile=true needs torch._functorch.config, which torch {torch.__version__} "
            f"lacks ({e}); drop train.compile or use torch 2.11-2.13"
        ) from None
    missing = [k for k in COMPILED_BACKWARD_CONFIG if not hasattr(functorch_config, k)]
    if missing:
        raise GearsInputError(
            f"train.compile=true needs torch._functorch.config.{missing[0]}, which torch "
            f"{torch.__version__} lacks: its compiled backward would differ from eager's. "
            "Drop train.compile, or use torch 2.11-2.13"
        )
    return functorch_config.patch(**COMPILED_BACKWARD_CONFIG)


def ddp_ignore(module: nn.Module, names: list[str]) -> bool:
    """Tell DistributedDataParallel to leave these parameters / buffers of `module` alone (no
    broadcast, no gradient sync): DDP._set_params_and_buffers_to_ignore_for_model (private; a
    workaround torch says it will replace, pytorch#43690). Call it before wrapping `module`.

    Where it is gone, DDP broadcasts them from rank 0 every step: the same values (the graphs are
    identical on every rank), only slower; a warning says so and this returns False."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    set_ignored = getattr(DDP, "_set_params_and_buffers_to_ignore_for_model", None)
    if set_ignored is None:
        warnings.warn(
            f"torch {torch.__version__} has no DistributedDataParallel."
            "_set_params_and_buffers_to_ignore_for_model: DDP broadcasts the fixed graph buffers "
            "every step (same results, slower at genome scale)",
            stacklevel=2,
        )
        return False
    set_ignored(module, list(names))
    return True


def default_store():
    """The key-value store of the default process group (torch.distributed.distributed_c10d.
    _get_default_store, private): ranks wait on it for the data step without a collective. A
    torch without it raises a RuntimeError naming it (running the data step on every rank at
    once instead would race on the caches)."""
    from torch.distributed import distributed_c10d

    get_store = getattr(distributed_c10d, "_get_default_store", None)
    if get_store is None:
        raise RuntimeError(
            f"torch {torch.__version__} has no torch.distributed.distributed_c10d."
            "_get_default_store: pass the launcher's store to gears.cli.job.load_pert_data, or use "
            "torch 2.11-2.13"
        )
    return get_store()


def _batch_norm_types() -> tuple[type, ...]:
    base = getattr(nn.modules.batchnorm, "_BatchNorm", None)  # private: every batch-norm's base
    if isinstance(base, type):
        return (base,)
    # Documented fallback: the public classes (a forker's lazy batch-norm would be missed).
    return (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


BATCH_NORM_TYPES = _batch_norm_types()


def is_batch_norm(module: nn.Module) -> bool:
    """Whether `module` is a batch-norm of any kind (1d/2d/3d, sync, lazy, WeightedBatchNorm1d):
    an instance of torch.nn.modules.batchnorm._BatchNorm (private), or of the public classes
    where that is gone."""
    return isinstance(module, BATCH_NORM_TYPES)


def tensor_pickle_globals() -> dict[tuple[str, str], object]:
    """The globals a plain pickle of tensors names (module, name) -> the function torch rebuilds
    them with: torch._utils._rebuild_tensor_v2 and _rebuild_parameter (private). cell-gears's
    config.pkl was written by plain pickle, so gears.compat.cell_gears admits exactly these. A torch
    without one raises a RuntimeError naming it (such pickles then need that torch to load)."""
    import torch._utils

    found = {}
    for name in ("_rebuild_tensor_v2", "_rebuild_parameter"):
        function = getattr(torch._utils, name, None)
        if function is None:
            raise RuntimeError(
                f"torch {torch.__version__} has no torch._utils.{name}, which pickled tensors "
                "name: read cell-gears's config.pkl with torch 2.11-2.13"
            )
        found[("torch._utils", name)] = function
    return found


def dispatch_mode_base() -> type:
    """torch.utils._python_dispatch.TorchDispatchMode (documented, but in a private module): the
    base of a mode that sees every aten op a region dispatches (benchmarks/gpu_check.py's
    host-sync check). A torch without it raises a RuntimeError naming it."""
    try:
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError as e:
        raise RuntimeError(
            f"torch {torch.__version__} has no torch.utils._python_dispatch.TorchDispatchMode "
            f"({e}): the host-sync check cannot run on it"
        ) from None
    return TorchDispatchMode
