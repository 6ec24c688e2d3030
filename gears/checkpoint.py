"""Checkpoints: the whole training state, written atomically, loaded safely with clear errors.

Every file is written to a temp file in the same folder, fsynced, renamed over the target and the
folder fsynced: a crash, SIGKILL or full disk at any moment leaves the old file or the new one.
Loading uses `torch.load(weights_only=True)`: a checkpoint holds only tensors and plain Python
values, so no code in a shared file ever runs. A checkpoint carries FORMAT_VERSION, the config
that made it and a hash of the data vocabulary (gene names + perturbation names).
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import pickle
import re
import signal
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from gears.errors import GearsInputError

FORMAT_VERSION = 2
# epoch_0003.pt: 3 epochs done; epoch_0003_step_000012.pt: 3 epochs + 12 optimizer steps of the
# 4th (written when a SIGTERM stopped training mid-epoch).
_NAME = re.compile(r"^epoch_(\d+)(?:_step_(\d+))?\.pt$")


class CheckpointWriteError(GearsInputError):
    """A file could not be written (disk full, quota, permissions); the old file is intact."""


def _fsync_dir(folder: Path) -> None:
    """Make a rename durable: fsync its folder (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _os_error_in(error: BaseException) -> OSError | None:
    """The OSError behind `error` (itself, or in its chain of causes), if any."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp_path)` on a temp file next to `path`, fsync it, rename it over `path` and
    fsync the folder. On any failure the temp file is removed and `path` is left as it was; an
    OSError (disk full, file too large, read-only) becomes a CheckpointWriteError saying so."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        try:
            write(tmp)
        except Exception as e:  # torch.save re-raises a failed write as a RuntimeError
            os_error = _os_error_in(e)
            if os_error is None:
                raise
            raise os_error from None
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as e:
        full = e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
        why = "the disk is full or a size/quota limit was hit" if full else "writing failed"
        kept = "the previous file is kept unchanged" if path.exists() else "nothing was written"
        raise CheckpointWriteError(
            f"could not write {path}: {why} ({e.strerror or e}); {kept}. Free space in "
            f"{path.parent} (or point out_dir / data.data_dir to a larger disk) and run again"
            + (" with train.resume=true" if _NAME.match(path.name) else "")
        ) from None
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def atomic_save(obj: Any, path: str | Path) -> Path:
    """torch.save `obj` to `path` atomically (see atomic_write)."""

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            if os.environ.get("GEARS_FAULT_KILL_WRITE") == Path(path).name:  # test hook
                buffer = io.BytesIO()
                torch.save(obj, buffer)
                f.write(buffer.getvalue()[: buffer.tell() // 2])  # half written, then killed
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            torch.save(obj, f)
            f.flush()

    return atomic_write(path, write)


def vocab_hash(gene_names: Iterable[str], pert_names: Iterable[str]) -> str:
    """sha256 (16 hex digits) of the gene and perturbation vocabularies, in order: two data
    sets give the same hash only if every index of the model means the same gene."""
    digest = hashlib.sha256()
    for part in (gene_names, pert_names):
        digest.update("\n".join(map(str, part)).encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def load(path: str | Path, map_location="cpu") -> dict:
    """Load a checkpoint or model file with weights_only=True. A missing, truncated or foreign
    file, or one holding Python objects (possible code), is a GearsInputError naming the file."""
    path = Path(path)
    if not path.exists():
        raise GearsInputError(f"checkpoint {path} does not exist; check the path")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        lines = [ln.strip() for ln in re.sub(r"\x1b\[[0-9;]*m", "", str(e)).splitlines()]
        why = [ln for ln in lines if ln.startswith("Unsupported")]  # torch names what it refused
        first = (why or lines or [type(e).__name__])[0]
        if "weights_only" in str(e).lower() or why:
            raise GearsInputError(
                f"checkpoint {path} was refused: it holds Python objects other than tensors and "
                f"plain values ({first[:200]}), which could run code when loaded. It is not a "
                "GEARS checkpoint of this version; use a checkpoint written by this code, or "
                "re-create it by training again"
            ) from None
        raise _unreadable(path, e) from None
    except Exception as e:
        raise _unreadable(path, e) from None
    if not isinstance(state, dict):
        raise GearsInputError(
            f"{path} holds a {type(state).__name__}, not a GEARS checkpoint (a dict with "
            "'format'); pass a file written by GEARS (save_model / checkpoints/epoch_*.pt)"
        )
    return state


def _unreadable(path: Path, e: Exception) -> GearsInputError:
    return GearsInputError(
        f"checkpoint {path} is unreadable ({type(e).__name__}: {str(e)[:200]}); it is truncated "
        "or not a GEARS checkpoint. Delete it to resume from the previous one."
    )


def check_compatible(state: dict, path: str | Path, expected: dict[str, Any]) -> None:
    """Refuse a checkpoint whose format or recorded settings differ from `expected`.

    expected: e.g. {"vocab_hash": ..., "model.hidden_size": 64, ...}; each differing key is named
    with both values (a named mismatch instead of a tensor shape error deep in torch)."""
    version = state.get("format")
    if version != FORMAT_VERSION:
        raise GearsInputError(
            f"checkpoint {path} has format {version!r}, this code reads format {FORMAT_VERSION}; "
            "it was written by another version of this code (or is not a GEARS checkpoint). "
            "Train again, or load it with the version that wrote it"
        )
    recorded = state.get("meta", {})
    diffs = [
        f"{key}: checkpoint {recorded.get(key)!r} vs now {want!r}"
        for key, want in expected.items()
        if recorded.get(key) != want
    ]
    if not diffs:
        return
    hint = ""
    if any(d.startswith("vocab_hash") for d in diffs):
        hint = (
            " The gene or perturbation vocabulary differs: use the same dataset, data.subset, "
            "GO source (data.gene2go) and data.unmapped_perts as the run that wrote it."
        )
    raise GearsInputError(
        f"checkpoint {path} does not match this run: {'; '.join(diffs)}.{hint} Use the settings "
        "it was written with, or a different out_dir (or train.resume=false) to start afresh"
    )


def list_checkpoints(folder: str | Path) -> list[Path]:
    """Checkpoints in `folder`, oldest first (by epochs, then steps into the next epoch)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [
        ((int(m.group(1)), int(m.group(2) or 0)), p)
        for p in folder.iterdir()
        if (m := _NAME.match(p.name))
    ]
    return [p for _, p in sorted(found)]


def checkpoint_path(folder: str | Path, epoch: int, step_in_epoch: int = 0) -> Path:
    """epoch: epochs completed; step_in_epoch: optimizer steps into the next (preemption)."""
    tail = f"_step_{step_in_epoch:06d}" if step_in_epoch else ""
    return Path(folder) / f"epoch_{epoch:04d}{tail}.pt"


def load_latest(folder: str | Path, map_location="cpu", log=print) -> dict | None:
    """The newest checkpoint that loads; an unreadable newer one is reported and skipped."""
    for path in reversed(list_checkpoints(folder)):
        try:
            state = load(path, map_location)
        except GearsInputError as e:
            log(f"warning: {e}")
            continue
        state["path"] = str(path)
        return state
    return None


def prune(folder: str | Path, keep: int = 2) -> None:
    """Keep the newest `keep` checkpoints (the previous one survives a corrupt newest) and remove
    temp files left by a process killed while writing (only rank 0 writes this folder)."""
    for path in list_checkpoints(folder)[:-keep]:
        path.unlink(missing_ok=True)
    for stale in Path(folder).glob(".epoch_*.pt.tmp*"):
        if not stale.name.endswith(f".tmp{os.getpid()}"):
            stale.unlink(missing_ok=True)
