"""A run folder belongs to one run: a lock while the run lives, and no run writes over another's."""

from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path

import torch

from gears.device import to_device, to_host
from gears.errors import GearsInputError
from gears.train import checkpoint as ckpt
from gears.train.distributed import all_reduce_max, broadcast_object
from gears.train.faults import injected_delay

LOCK_NAME = ".gears.lock"
# How long a resuming rank 0 waits for the lock: under torchrun a restarted worker may start
# while its killed predecessor's loader processes, which share the lock, are still exiting.
RESUME_LOCK_WAIT_S = 15.0
# This process's locks by folder: a later run in the same process (python -m gears.cli.seeds, a
# notebook) takes over its own earlier run's lock instead of being refused by it.
_HELD: dict[str, RunFolder] = {}


class RunFolder:
    """Rank 0's hold on out_dir for the run's lifetime: an flock on out_dir/.gears.lock, which
    the kernel releases when the process ends, however it ends (a SIGKILL leaves no stale
    lock). Other ranks, and systems without flock, hold nothing."""

    def __init__(self, path: Path | None = None, fd: int | None = None):
        self.path, self.fd = path, fd

    def release(self) -> None:
        if self.fd is not None:
            try:
                import fcntl

                fcntl.flock(self.fd, fcntl.LOCK_UN)
            except (ImportError, OSError):
                pass
            os.close(self.fd)
            self.fd = None
        if self.path is not None and _HELD.get(str(self.path)) is self:
            del _HELD[str(self.path)]

    def __del__(self):
        try:
            self.release()
        except Exception:  # at interpreter shutdown modules may already be gone
            pass


def prior_outputs(folder: Path) -> list[str]:
    """What a finished or interrupted run left in `folder` that a new run would overwrite or
    resume from by mistake: metrics.json, a model/ folder, checkpoints. (config.yaml, plots/
    and wandb/ alone come from a run that stopped before its first checkpoint: nothing is lost
    by starting it again.)"""
    found = []
    if (folder / "metrics.json").exists():
        found.append("metrics.json")
    model = folder / "model"
    if model.is_dir() and any(model.iterdir()):
        found.append("model/")
    checkpoints = ckpt.list_checkpoints(folder / "checkpoints")
    if checkpoints:
        more = f" and {len(checkpoints) - 1} more" if len(checkpoints) > 1 else ""
        found.append(f"checkpoints/{checkpoints[-1].name}{more}")
    return found


def _lock(folder: Path, wait_s: float) -> RunFolder:
    """flock out_dir/.gears.lock (waiting up to wait_s), or a GearsInputError naming the run
    that holds it."""
    try:
        import fcntl
    except ImportError:  # no flock here (Windows): the folder check still applies
        return RunFolder(folder)
    held = _HELD.get(str(folder))
    if held is not None:  # this process's own earlier run, which has returned
        held.release()
    path = folder / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise GearsInputError(
            f"cannot write in out_dir {folder} ({e.strerror or e}); choose a writable out_dir"
        ) from None
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise GearsInputError(
                f"out_dir {folder} is in use by another live run ({holder}); two runs in one "
                "folder would overwrite each other's checkpoints and results. Wait for it to "
                "finish, or choose another out_dir"
            ) from None
        except OSError as e:  # a filesystem without locks (some network mounts)
            os.close(fd)
            print(
                f"warning: cannot lock {path} ({e.strerror or e}); a second run started on "
                "this out_dir would not be stopped",
                flush=True,
            )
            return RunFolder(folder)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    try:  # who holds it, for the refusal a second run prints (the lock works without it)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {stamp}\n".encode(), 0)
    except OSError:
        pass
    folder_lock = RunFolder(folder, fd)
    _HELD[str(folder)] = folder_lock
    return folder_lock


def _move_aside(folder: Path, log) -> Path:
    """Move everything in `folder` but the lock to <folder>.replaced-<date>-<time>[-n]/."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = folder.with_name(f"{folder.name}.replaced-{stamp}")
    n = 1
    while target.exists():
        target = folder.with_name(f"{folder.name}.replaced-{stamp}-{n}")
        n += 1
    try:
        target.mkdir()
        for entry in sorted(folder.iterdir()):
            if entry.name != LOCK_NAME:
                shutil.move(str(entry), str(target / entry.name))
    except OSError as e:
        raise GearsInputError(
            f"replace_out_dir=true: could not move the previous run's outputs from {folder} to "
            f"{target} ({e.strerror or e}); what was moved is there, the rest is in place. Make "
            "the folder's parent writable, or choose another out_dir"
        ) from None
    log(f"replace_out_dir=true: moved the previous run's outputs from {folder} to {target}")
    return target


def claim_on_rank_0(out_dir: str | Path, resume: bool, replace: bool, log=print) -> RunFolder:
    """Lock out_dir for this run and check what it holds: nothing of another run's (or
    `resume`, and a checkpoint to resume from, which the trainer then checks is this run's; or
    `replace`: move it aside). `replace` does nothing with `resume` (so that "the same command
    with train.resume=true" continues a run started with replace_out_dir=true). Raises a
    GearsInputError naming the folder and the choices otherwise."""
    folder = Path(out_dir)
    if folder.exists() and not folder.is_dir():
        raise GearsInputError(
            f"out_dir {folder} is a file, not a folder; choose another out_dir (or move the file)"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GearsInputError(
            f"cannot create out_dir {folder} ({e.strerror or e}); choose a writable out_dir"
        ) from None
    held = _lock(folder, RESUME_LOCK_WAIT_S if resume else 0.0)
    try:
        found = prior_outputs(folder)
        if not found:
            return held
        if resume and not any(f.startswith("checkpoints/") for f in found):
            raise GearsInputError(
                f"train.resume=true: out_dir {folder} holds a run's outputs ({', '.join(found)}) "
                "but no checkpoint to continue from. Choose another out_dir, or set "
                "replace_out_dir=true to move them aside and start afresh"
            )
        if resume:
            return held
        if replace:
            _move_aside(folder, log)
            return held
        raise GearsInputError(
            f"out_dir {folder} holds another run's outputs ({', '.join(found)}); a new run "
            "would overwrite them, and a later resume would continue the wrong run. Choose: "
            "another out_dir; train.resume=true to continue that run (refused if its data or "
            "settings differ); or replace_out_dir=true to move its outputs to "
            f"{folder.name}.replaced-<date>-<time>/ beside it and start afresh"
        )
    except BaseException:
        held.release()
        raise


def claim_run_folder(cfg, env) -> RunFolder:
    """Every rank calls this at the start of a run: rank 0 locks out_dir and checks it
    (claim_on_rank_0), resuming when any rank resumes (after a torchrun restart only some
    nodes count one); its refusal is raised on every rank, printed by rank 0 alone."""
    resume = cfg.train.resume
    if env.distributed:
        flag = to_device(torch.tensor(float(resume)), env.device)
        resume = bool(to_host(all_reduce_max(env, flag)).item())
    held, refusal = RunFolder(), None
    if env.is_main:
        try:
            held = claim_on_rank_0(cfg.out_dir, resume, cfg.replace_out_dir)
        except GearsInputError as e:
            refusal = str(e)
    if env.distributed:
        refusal = broadcast_object(env, refusal)
    if refusal is not None:
        injected_delay("refusal", env.rank)  # (a test hook: rank 0 last to raise)
        error = GearsInputError(refusal)
        error.reported = not env.is_main  # one line, from rank 0
        error.every_rank = True
        raise error
    return held
