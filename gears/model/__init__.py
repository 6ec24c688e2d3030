"""The network classes by model.impl: the built-in fast (network.py) and reference
(reference.py), or a fork's class named `path/to/file.py:Class` or `module:Class`; and which of a
network's buffers are its fixed graphs."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path

from torch import nn

from gears.errors import GearsInputError
from gears.model.network import GEARSNet
from gears.model.reference import GEARSReference

NETWORKS = {"fast": GEARSNet, "reference": GEARSReference}


def graph_buffer_names(net: nn.Module) -> list[str]:
    """The network's fixed graph buffers (identical on every rank, never to be broadcast)."""
    names = getattr(net, "graph_buffer_names", None)
    if callable(names):
        return list(names())
    return [n for n, _ in net.named_buffers() if "edge" in n.rsplit(".", 1)[-1]]


def is_class_spec(impl: str) -> bool:
    """Whether model.impl names a class (`file.py:Class`, `module:Class`), not a built-in."""
    return ":" in impl


def spec_file(impl: str) -> Path | None:
    """The Python file a `path/to/file.py:Class` spec names, else None."""
    where = impl.rsplit(":", 1)[0]
    return Path(where) if is_class_spec(impl) and where.endswith(".py") else None


def network_class(impl: str, folder: str | Path | None = None) -> type[nn.Module]:
    """The network class model.impl names: "fast", "reference", `path/to/file.py:Class` (the
    path relative to the working directory) or `module:Class` (an importable module).
    folder: a saved model folder; the copy of a fork's file kept there (save_model) is used
    first, so a model loads with the code it was trained with. Anything else is an error
    naming what is missing."""
    if impl in NETWORKS:
        return NETWORKS[impl]
    if not is_class_spec(impl):
        raise GearsInputError(
            f"model.impl={impl!r} is neither a built-in network {tuple(NETWORKS)} nor a class "
            "'path/to/file.py:ClassName' or 'module:ClassName'"
        )
    where, name = impl.rsplit(":", 1)
    path = spec_file(impl)
    if path is not None:
        saved = Path(folder) / path.name if folder is not None else None
        path = saved if saved is not None and saved.is_file() else path
        if not path.is_file():
            raise GearsInputError(f"model.impl={impl!r}: no file {path} (from {Path.cwd()})")
        module = _module_from_file(path.resolve())
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise GearsInputError(f"model.impl={impl!r}: cannot import {where!r} ({e})") from None
    cls = getattr(module, name, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise GearsInputError(
            f"model.impl={impl!r}: {where} defines no torch.nn.Module class {name!r}"
        )
    return cls


def network_options(network: type, extra: dict, impl: str) -> dict:
    """A network's own options, resolved: the class's `options` ({name: default}) updated with
    `extra` (model.extra), each value read as its default's type. An unknown name is refused,
    naming the options the network accepts."""
    from gears.config import _coerce

    declared = dict(getattr(network, "options", None) or {})
    unknown = sorted(set(extra) - set(declared))
    if unknown:
        accepted = ", ".join(f"{k} (default {v!r})" for k, v in declared.items()) or "none"
        raise GearsInputError(
            f"model.extra has {unknown}, which model.impl={impl!r} does not take; it accepts: "
            f"{accepted} (a fork declares its options as a class attribute, "
            "options = {name: default})"
        )
    resolved = {}
    for name, default in declared.items():
        value = extra.get(name, default)
        if default is not None and name in extra:
            value = _coerce(value, type(default), f"model.extra.{name}")
        resolved[name] = value
    return resolved


def _module_from_file(path: Path):
    """A fork's file imported once per process under a name unique to its path."""
    name = f"gears_fork_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (dataclasses and pickling look classes up by module)
    try:
        spec.loader.exec_module(module)
    except Exception:
        del sys.modules[name]
        raise
    return module
