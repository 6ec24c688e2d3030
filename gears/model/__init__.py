"""The network classes by model.impl: the built-in fast (network.py) and reference
(reference.py), or a fork's class named `path/to/file.py:Class` or `module:Class`; which code a
saved model folder may run; and which of a network's buffers are its fixed graphs."""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
import traceback
from pathlib import Path, PurePath

from torch import nn

from gears.config import _coerce
from gears.errors import GearsInputError
from gears.model.contract import declared_options, graph_buffer_names  # noqa: F401 (re-exported)
from gears.model.network import GEARSNet
from gears.model.reference import GEARSReference

NETWORKS = {"fast": GEARSNet, "reference": GEARSReference}
# The modules a model folder's config.json may name as `module:Class` (this package's own
# networks); any other module, or a file outside the folder, is refused before it is imported.
BUILTIN_PACKAGE = "gears.model"
TRUST_FLAGS = "--trust-model-code (predict.py) or trust_code=True (GEARS.load_pretrained)"
_FILE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\.py")


def is_class_spec(impl: str) -> bool:
    """Whether model.impl names a class (`file.py:Class`, `module:Class`), not a built-in."""
    return ":" in impl


def spec_file(impl: str) -> Path | None:
    """The Python file a `path/to/file.py:Class` spec names, else None."""
    where = impl.rsplit(":", 1)[0]
    return Path(where) if is_class_spec(impl) and where.endswith(".py") else None


def network_class(
    impl: str, folder: str | Path | None = None, trust_code: bool = False
) -> type[nn.Module]:
    """The network class model.impl names: "fast", "reference", `path/to/file.py:Class` (the
    path relative to the working directory) or `module:Class` (an importable module): the
    user's own choice for training.

    folder: a saved model folder whose config.json gave impl. Its impl may name only the copy
    of the fork's file kept in that folder (by its bare file name; save_model copies it) or a
    class of gears.model, checked before anything is imported, and the folder's file runs only
    with trust_code (the user read it and trusts it). Anything else is an error naming what is
    missing."""
    if impl in NETWORKS:
        return NETWORKS[impl]
    if not is_class_spec(impl):
        raise GearsInputError(
            f"model.impl={impl!r} is neither a built-in network {tuple(NETWORKS)} nor a class "
            "'path/to/file.py:ClassName' or 'module:ClassName'"
        )
    where, name = impl.rsplit(":", 1)
    origin = f" (named by {Path(folder) / 'config.json'})" if folder is not None else ""
    if folder is not None:
        path = folder_code(impl, Path(folder), trust_code)
        module = _module_from_file(path, impl) if path is not None else _import(where, impl, origin)
    elif spec_file(impl) is not None:
        path = spec_file(impl)
        if not path.is_file():
            raise GearsInputError(f"model.impl={impl!r}: no file {path} (from {Path.cwd()})")
        module = _module_from_file(path.resolve(), impl)
    else:
        module = _import(where, impl)
    cls = getattr(module, name, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise GearsInputError(
            f"model.impl={impl!r}{origin}: {where} defines no torch.nn.Module class {name!r}"
        )
    return cls


def network_options(network: type, extra: dict, impl: str) -> dict:
    """A network's own options, resolved: the class's `options` ({name: default}) updated with
    `extra` (model.extra), each value read as its default's type. An unknown name is refused,
    naming the options the network accepts."""
    declared = declared_options(network)
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


def folder_code(impl: str, folder: Path, trust_code: bool) -> Path | None:
    """The file of `folder` that a model folder's impl names (None: a gears.model module),
    refused by name when impl points anywhere else or, for a file, without trust_code.
    Reads names only: nothing is imported here."""
    where, name = impl.rsplit(":", 1)
    config = folder / "config.json"
    if not name.isidentifier():
        raise GearsInputError(
            f"{config} names model.impl={impl!r}: {name!r} is not a class name; the folder was "
            "edited or damaged (save the model again from its run)"
        )
    if not where.endswith(".py"):
        if where == BUILTIN_PACKAGE or where.startswith(BUILTIN_PACKAGE + "."):
            return None
        raise GearsInputError(
            f"{config} names model.impl={impl!r}, which names the module {where!r}: a model "
            f"folder may run only its own copy of a fork's file (NAME.py:Class) or a class of "
            f"{BUILTIN_PACKAGE}; train the fork as model.impl=path/to/file.py:Class so that "
            "save_model copies the file into the folder"
        )
    bare = PurePath(where.replace("\\", "/")).name
    path = folder / bare
    inside = path.resolve().parent == folder.resolve()
    if not _FILE_NAME.fullmatch(bare) or not path.is_file() or not inside:
        raise GearsInputError(
            f"{config} names model.impl={impl!r}, but the folder has no file {bare}: a model "
            "folder runs only the copy of the fork's file saved in it (never a path elsewhere); "
            "copy the whole model folder, or save the model again from its run"
        )
    if not trust_code:
        raise GearsInputError(
            f"the model folder {folder} runs its own code, {path} (class {name}): read it, and "
            f"if you trust it pass {TRUST_FLAGS}"
        )
    return path


def _import(where: str, impl: str, origin: str = ""):
    try:
        return importlib.import_module(where)
    except ImportError as e:
        raise GearsInputError(
            f"model.impl={impl!r}{origin}: cannot import {where!r} ({e})"
        ) from None


def fork_files(path: Path) -> list[Path]:
    """A fork's file and the modules beside it that it imports (`import my_layers`, `from
    my_layers import Foo` with my_layers.py in the same folder), theirs too: what save_model
    copies into a model folder and what a resume's fingerprint hashes. Packages (folders) beside
    the fork are not followed."""
    path = Path(path)
    found, todo = [path], [path]
    while todo:
        try:
            tree = ast.parse(todo.pop().read_bytes())
        except (SyntaxError, ValueError, OSError):
            continue  # (the import itself names a syntax error)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                tops = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops = [node.module.split(".")[0]]
            else:
                continue
            for top in tops:
                sibling = path.parent / f"{top}.py"
                if sibling.is_file() and sibling not in found:
                    found.append(sibling)
                    todo.append(sibling)
    return found


def code_digest(cls: type) -> str | None:
    """`file.py sha256:<16 hex>` of a fork class's source file and the modules beside it that
    it imports (fork_files); None for the built-in networks and classes with no source file."""
    if cls in NETWORKS.values():
        return None
    try:
        source = Path(inspect.getsourcefile(cls))
    except (TypeError, OSError):
        return None
    if not source.is_file():
        return None
    h = hashlib.sha256()
    for path in fork_files(source):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return f"{source.name} sha256:{h.hexdigest()[:16]}"


def _module_from_file(path: Path, impl: str):
    """A fork's file imported under a name unique to its path and content (an edited file is
    imported again), with its own folder searched first while it runs (modules beside it);
    an import that fails is one GearsInputError naming the file and line."""
    code = path.read_bytes()
    key = hashlib.sha1(str(path).encode() + b"\0" + code).hexdigest()[:10]
    name = f"gears_fork_{path.stem}_{key}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (dataclasses and pickling look classes up by module)
    folder = str(path.parent)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise GearsInputError(f"model.impl={impl!r}: {_import_failure(e, path)}") from None
    finally:
        sys.path.remove(folder)
    return module


def _import_failure(error: Exception, path: Path) -> str:
    """Where and why importing a fork's file failed: the innermost line of the fork's folder
    (its file, or a module beside it), the error's type and first line."""
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if isinstance(error, SyntaxError):
        where = f"{error.filename or path}, line {error.lineno}"
        return f"importing {path} failed: {where}: SyntaxError: {error.msg}; fix the file"
    frames = [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if Path(f.filename).parent == path.parent
    ]
    where = f"{frames[-1].filename}, line {frames[-1].lineno}" if frames else str(path)
    return (
        f"importing {path} failed: {where}: {type(error).__name__}: {message}; fix the file (a "
        "module it imports must be installed or sit beside it)"
    )
