"""Checkpoints: the whole training state, written atomically, loaded with clear errors."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from gears.errors import GearsInputError

_NAME = re.compile(r"^epoch_(\d+)\.pt$")


def atomic_save(obj: Any, path: str | Path) -> Path:
    """torch.save into a temp file in the same folder, fsync, then rename over `path`: a crash or
    kill at any moment leaves either the old file or the new one, never a torn file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def load(path: str | Path, map_location="cpu") -> dict:
    """Load a checkpoint or model file; a truncated or foreign file is a GearsInputError."""
    path = Path(path)
    if not path.exists():
        raise GearsInputError(f"checkpoint {path} does not exist")
    try:
        return torch.load(path, map_location=map_location, weights_only=False)
    except Exception as e:
        raise GearsInputError(
            f"checkpoint {path} is unreadable ({type(e).__name__}: {e}); it is truncated or "
            "not a GEARS checkpoint. Delete it to resume from the previous one."
        ) from None


def list_checkpoints(folder: str | Path) -> list[Path]:
    """Epoch checkpoints in `folder`, oldest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def checkpoint_path(folder: str | Path, epoch: int) -> Path:
    return Path(folder) / f"epoch_{epoch:04d}.pt"


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
    """Keep the newest `keep` checkpoints (the previous one survives a corrupt newest)."""
    for path in list_checkpoints(folder)[:-keep]:
        path.unlink(missing_ok=True)
