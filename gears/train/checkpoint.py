"""Checkpoints: the whole training state, written atomically, loaded safely with clear errors.

Every file is written to a temp file in the same folder, fsynced, renamed over the target and the
folder fsynced: a crash, SIGKILL or full disk at any moment leaves the old file or the new one.
Loading uses `torch.load(weights_only=True)`: a checkpoint holds only tensors and plain Python
values, so no code in a shared file ever runs, and the archive's CRCs are checked (a flipped bit
is refused, not loaded as a wrong weight). A checkpoint carries FORMAT_VERSION, the config that
made it, a hash of the data vocabulary (gene names + perturbation names) and the run's
fingerprint (run_fingerprint: every setting, the data, split and graphs), which a resume must
match (check_resume: RESUME_MAY_CHANGE lists the keys that may differ).
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import re
import signal
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gears.device import to_host
from gears.errors import GearsInputError
from gears.io import CHECKPOINT_NAME, atomic_write

FORMAT_VERSION = 2


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

    written = atomic_write(path, write)
    mark_readable(written)
    return written


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
    if zipfile.is_zipfile(path) and not is_readable(path):
        # torch.load does not check the archive's CRCs: a flipped bit in a tensor loads as a
        # silently wrong weight. The CRC pass catches it.
        raise _unreadable(path, ValueError("a CRC check of its contents failed: it is damaged"))
    if not isinstance(state, dict):
        raise GearsInputError(
            f"{path} holds a {type(state).__name__}, not a GEARS checkpoint (a dict with "
            "'format'); pass a file written by GEARS (save_model / checkpoints/epoch_*.pt)"
        )
    return state


def _unreadable(path: Path, e: Exception) -> GearsInputError:
    return GearsInputError(
        f"checkpoint {path} is unreadable ({type(e).__name__}: {str(e)[:200]}); it is truncated, "
        "damaged or not a GEARS checkpoint. Move it away to resume from the previous one."
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
        "it was written with; to start afresh instead, choose another out_dir (for a run: or "
        "set replace_out_dir=true, which moves the old outputs aside)"
    )


def list_checkpoints(folder: str | Path) -> list[Path]:
    """Checkpoints in `folder`, oldest first (by epochs, then steps into the next epoch)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [
        ((int(m.group(1)), int(m.group(2) or 0)), p)
        for p in folder.iterdir()
        if (m := CHECKPOINT_NAME.match(p.name))
    ]
    return [p for _, p in sorted(found)]


def checkpoint_path(folder: str | Path, epoch: int, step_in_epoch: int = 0) -> Path:
    """epoch: epochs completed; step_in_epoch: optimizer steps into the next (preemption).
    epoch_0001_step_000014.pt: after epoch 1 and 14 steps of epoch 2 (see position)."""
    tail = f"_step_{step_in_epoch:06d}" if step_in_epoch else ""
    return Path(folder) / f"epoch_{epoch:04d}{tail}.pt"


def position(epochs_done: int, steps_into_next: int, steps_in_all: int) -> str:
    """Where a run stands, counted as its checkpoints are named and its epoch lines are
    numbered (epoch 1 is the first): "epoch 1 + 14 steps of epoch 2 (step 78 in all)" is
    epoch_0001_step_000014.pt, "epoch 2 (step 128 in all)" is epoch_0002.pt. Steps are
    optimizer steps (train.grad_accum_steps batches each)."""
    into = f" + {steps_into_next} steps of epoch {epochs_done + 1}" if steps_into_next else ""
    return f"epoch {epochs_done}{into} (step {steps_in_all} in all)"


class NoReadableCheckpoint(GearsInputError):
    """Checkpoint files exist, and none of them loads: there is nothing to resume from."""


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


def load_for_resume(folder: str | Path, map_location="cpu", log=print) -> dict | None:
    """load_latest for a resume: None when the folder holds no checkpoint file at all, and
    NoReadableCheckpoint when it holds some and none loads (that is not "no checkpoint": a
    resume starting from scratch there would silently drop the run)."""
    state = load_latest(folder, map_location, log)
    found = list_checkpoints(folder)
    if state is None and found:
        names = [p.name for p in reversed(found)]
        raise NoReadableCheckpoint(
            f"none of the {len(found)} checkpoint file(s) in {folder} can be read "
            f"({', '.join(names[:5])}{' ...' if len(names) > 5 else ''}: truncated, damaged "
            "or not GEARS checkpoints), so there is nothing to resume from. Move them away to "
            "keep them, or start the run afresh with replace_out_dir=true (which moves this "
            "run's outputs aside)"
        )
    return state


# Checkpoint files known to be whole, by (path, inode, size, mtime): the file atomic_save just
# wrote, and others once checked (a zip CRC pass, no unpickling).
_VERIFIED: set[tuple[str, int, int, int]] = set()


def _file_key(path: Path) -> tuple[str, int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (str(path), st.st_ino, st.st_size, st.st_mtime_ns)


def mark_readable(path: str | Path) -> None:
    """Record that `path` (just written whole by atomic_save) loads."""
    key = _file_key(Path(path))
    if key is not None:
        _VERIFIED.add(key)


def is_readable(path: str | Path) -> bool:
    """Whether a checkpoint file is whole: torch.save writes a zip archive, and a truncated or
    damaged one fails its central directory or a member's CRC (read once, no unpickling)."""
    path = Path(path)
    key = _file_key(path)
    if key is None:
        return False
    if key in _VERIFIED:
        return True
    try:
        with zipfile.ZipFile(path) as archive:
            whole = archive.testzip() is None
    except (OSError, zipfile.BadZipFile, EOFError, ValueError, RuntimeError):
        whole = False
    if whole:
        _VERIFIED.add(key)
    return whole


def prune(folder: str | Path, keep: int = 2) -> None:
    """Keep the newest `keep` readable checkpoints (the previous one survives a corrupt newest)
    and remove temp files left by a process killed while writing (only rank 0 writes this
    folder). Only readable checkpoints count towards `keep`: an unreadable newer file never
    costs a good one, and is left for the user to inspect (load_latest skips it with a
    warning); files older than the kept ones are removed."""
    kept = 0
    for path in reversed(list_checkpoints(folder)):
        if kept >= keep:
            path.unlink(missing_ok=True)  # older than `keep` readable ones: never needed
        elif is_readable(path):
            kept += 1
    for stale in Path(folder).glob(".epoch_*.pt.tmp*"):
        if not stale.name.endswith(f".tmp{os.getpid()}"):
            stale.unlink(missing_ok=True)


# ---------------------------------------------------------------------- the run's fingerprint
# Config keys a resume may change: where files are, how the run is launched, watched or
# scheduled on the machine, and how fast it computes. None of them changes which batches are
# drawn or what a step computes (a path key's content is compared through the data fingerprint
# instead; another thread count or device changes only the last bits, and a resume at another
# thread count says so). A key ending in "." stands for its whole section. train.epochs may
# rise (see check_resume). Every other key, and the data, must match the checkpoint's.
RESUME_MAY_CHANGE = (
    "out_dir",
    "replace_out_dir",
    "device",
    "data.dataset",
    "data.data_dir",
    "data.gene2go",
    "data.gene_aliases",
    "data.mirror_url",
    "data.store",
    "data.store_dir",
    "data.chunk_cells",
    "split.split_dict_path",
    "train.resume",
    "train.checkpoint_every",
    "train.log_every",
    "train.plot_conditions",
    "train.num_workers",
    "train.threads",
    "eval.cell_eval",
    "distributed.backend",
    "distributed.gpu_ids",
    "distributed.master_addr",
    "distributed.master_port",
    "distributed.timeout_s",
    "distributed.data_wait_s",
    "distributed.find_unused_parameters",
    "distributed.static_graph",
    "distributed.gradient_as_bucket_view",
    "wandb.",
)
# What the data parts of a fingerprint mean, for the refusal message.
DATA_PARTS = {
    "data:shape": "the data's cells x genes",
    "data:genes": "the gene names and order",
    "data:conditions": "the condition names",
    "data:cell_conditions": "each cell's condition",
    "data:expression": "the expression of 256 cells spread over the matrix",
    "data:perturbable_genes": "the perturbation vocabulary (GO-mapped genes)",
    "split:sets": "the train/val/test conditions",
    "split:seed": "the split seed (it also pairs control cells)",
    "graphs": "the GO and co-expression graph edges",
    "world_size": "the number of processes (the effective batch)",
}
# ... and the code part, recorded only for a fork (training_state.fingerprint).
CODE_PARTS = {
    "code:network": "the fork's network file and the modules beside it that it imports, by content",
}
SAMPLED_CELLS = 256


def may_change_on_resume(key: str) -> bool:
    """Whether config key `key` may differ between a checkpoint and the run resuming it."""
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUME_MAY_CHANGE)


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, np.ndarray):
            h.update(str((part.dtype.str, part.shape)).encode())
            h.update(np.ascontiguousarray(part).tobytes())
        else:
            h.update(repr(part).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


# Config keys whose value is a free-form dict: one key of the fingerprint each, compared whole.
FREE_FORM_KEYS = ("data.synthetic", "data.subset", "model.extra")


def flat_config(config: dict, prefix: str = "") -> dict[str, Any]:
    """{'train': {'lr': 1e-3}} -> {'train.lr': 1e-3}; free-form dict keys (FREE_FORM_KEYS)
    stay whole values."""
    out = {}
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and dotted not in FREE_FORM_KEYS:
            out.update(flat_config(value, f"{dotted}."))
        else:
            out[dotted] = value
    return out


def run_fingerprint(
    config: dict[str, Any], pert_data, graph_buffers: dict[str, torch.Tensor], world_size: int
) -> dict[str, Any]:
    """What a resume must share with the checkpoint: every config key (dotted, flat) and a
    fingerprint of the data the run trains on, its split and its graphs.

    config: the run's settings, flat or nested ({'seed': 1, 'train': {...}}). pert_data: the
    split PertData. graph_buffers: the network's graph buffers by name (on any device).
    Costs one read of SAMPLED_CELLS cells; small values are kept as they are, tables as
    16-hex hashes."""
    X = pert_data.expr.numpy()  # the host copy (dense array or CSR), never a device read
    n_cells = X.shape[0]
    sample = np.unique(np.linspace(0, max(n_cells - 1, 0), SAMPLED_CELLS).astype(np.int64))
    rows = X[sample]
    rows = rows.toarray() if hasattr(rows, "toarray") else np.asarray(rows)
    sets = pert_data.set2conditions or {}
    graphs = {k: to_host(v).numpy() for k, v in sorted(graph_buffers.items()) if not v.is_meta}
    return {
        **flat_config(config),
        "world_size": int(world_size),
        "data:shape": [int(n_cells), int(X.shape[1])],
        "data:genes": _digest(list(map(str, pert_data.gene_names))),
        "data:conditions": _digest(list(map(str, pert_data.conditions))),
        "data:cell_conditions": _digest(np.asarray(pert_data.cell_condition, np.int64)),
        "data:expression": _digest(np.asarray(rows, np.float32)),
        "data:perturbable_genes": _digest(list(map(str, pert_data.pert_names))),
        "split:sets": _digest({k: sorted(map(str, v)) for k, v in sorted(sets.items())}),
        "split:seed": int(getattr(pert_data, "seed", 0)),
        # (omitted on the meta device, whose tensors hold no values: then not compared)
        **(
            {"graphs": _digest(*[part for item in graphs.items() for part in item])}
            if len(graphs) == len(graph_buffers)
            else {}
        ),
    }


def check_resume(state: dict, path: str | Path, now: dict[str, Any]) -> None:
    """Refuse to resume from checkpoint `state` (at `path`) unless it continues the same run:
    every part of `now` (run_fingerprint) but RESUME_MAY_CHANGE equal to the checkpoint's,
    train.epochs no fewer than the epochs done (and, under train.schedule=cosine, unchanged:
    the schedule's length is the number of epochs). Keys one side lacks are not compared (a
    checkpoint written through the Python API records no data.* keys)."""
    recorded = state.get("fingerprint")
    if recorded is None:
        raise GearsInputError(
            f"checkpoint {path} records no fingerprint of its run's data and settings (it was "
            "written by an earlier version of this code), so resuming from it cannot be checked "
            "to continue the same run. Start afresh: another out_dir, or replace_out_dir=true "
            "to move this run's outputs aside"
        )
    diffs = []
    for key in sorted(set(recorded) & set(now)):
        if key == "train.epochs" or may_change_on_resume(key) or recorded[key] == now[key]:
            continue
        meaning = DATA_PARTS.get(key) or CODE_PARTS.get(key)
        what = f" ({meaning})" if meaning else ""
        diffs.append(f"{key}{what}: checkpoint {recorded[key]!r} vs now {now[key]!r}")
    done, epochs = int(state.get("epoch", 0)), now.get("train.epochs")
    if epochs is not None:
        mid_epoch = bool(state.get("partial"))
        if epochs < done or (mid_epoch and epochs <= done):
            at = f"{done} epochs and part of the next" if mid_epoch else f"{done} epoch(s)"
            diffs.append(
                f"train.epochs: {epochs} is fewer than the checkpoint has trained ({at}); "
                f"ask for at least {done + mid_epoch}"
            )
        elif (
            epochs != recorded.get("train.epochs", epochs) and now.get("train.schedule") == "cosine"
        ):
            diffs.append(
                f"train.epochs: checkpoint {recorded['train.epochs']} vs now {epochs}, and under "
                "train.schedule=cosine every epoch's learning rate depends on it (train.epochs "
                "may rise under step or constant)"
            )
    if diffs:
        raise GearsInputError(
            f"cannot resume from {path}: it belongs to another run; these differ: "
            f"{'; '.join(diffs)}. Resume with the data and settings it was written with (its "
            "run folder's config.yaml; docs/reproducibility.md lists the keys a resume may "
            "change), or start a new run: another out_dir, or replace_out_dir=true to move this "
            "run's outputs aside"
        )
