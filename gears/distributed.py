"""Process-group setup: rank (torchrun, Slurm or single), device, backend, collectives."""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gears.errors import GearsInputError


@dataclass
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str | None = None  # None: no process group (world size 1)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def find_free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    """A taken port is a clear error, not a rendezvous hang."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise GearsInputError(
                f"distributed.master_port={port} on {host} is already in use ({e.strerror}); "
                "pick another port or set distributed.master_port=0 to choose a free one"
            ) from None


def slurm_to_env() -> None:
    """Under `srun` without torchrun, derive RANK/WORLD_SIZE/MASTER_ADDR from Slurm's variables."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    os.environ["WORLD_SIZE"] = os.environ.get("SLURM_NTASKS", "1")
    if "MASTER_ADDR" not in os.environ:
        nodelist = os.environ.get("SLURM_JOB_NODELIST", "127.0.0.1")
        os.environ["MASTER_ADDR"] = first_slurm_host(nodelist)
    os.environ.setdefault("MASTER_PORT", "29500")


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm nodelist like `node[03-05,07],gpu1` (what `scontrol show hostnames`
    prints first), without needing scontrol."""
    head = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist
    if "[" not in head:
        return head.strip()
    prefix, rest = head.split("[", 1)
    first = rest.split("]")[0].split(",")[0].split("-")[0]
    return prefix + first


def launch_ranks(environ=None) -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from the launcher's variables, or a GearsInputError naming
    the variable: WORLD_SIZE > 1 without RANK would make every process rank 0 and hang."""
    environ = os.environ if environ is None else environ
    values = {}
    for name, default in (("WORLD_SIZE", "1"), ("RANK", None), ("LOCAL_RANK", None)):
        raw = environ.get(name, default)
        try:
            values[name] = None if raw is None else int(raw)
        except ValueError:
            raise GearsInputError(
                f"environment variable {name}={raw!r} is not an integer; launch with torchrun "
                f"or srun (they set it), or unset {name} for a single process"
            ) from None
    world_size, rank = values["WORLD_SIZE"], values["RANK"]
    if world_size < 1:
        raise GearsInputError(f"environment variable WORLD_SIZE={world_size} must be >= 1")
    if rank is None:
        if world_size > 1:
            raise GearsInputError(
                f"WORLD_SIZE={world_size} is set but RANK is not, so every process would be "
                "rank 0; launch with torchrun / srun (they set RANK, LOCAL_RANK, WORLD_SIZE) or "
                "train_distributed.py --nproc N, or unset WORLD_SIZE for one process"
            )
        rank = 0
    if not 0 <= rank < world_size:
        raise GearsInputError(
            f"RANK={rank} is outside 0..{world_size - 1} (WORLD_SIZE={world_size}); every "
            "process needs a distinct RANK below WORLD_SIZE: let torchrun / srun set them"
        )
    local_rank = values["LOCAL_RANK"] or 0
    return rank, local_rank, world_size


def check_gpu_ids(gpu_ids: list | None, n_visible: int) -> None:
    """Every entry of distributed.gpu_ids must name a visible GPU (0..n_visible-1)."""
    if not gpu_ids:
        return
    bad = [g for g in gpu_ids if not isinstance(g, int) or not 0 <= g < n_visible]
    if bad:
        seen = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={seen})" if seen is not None else ""
        fix = f"use ids 0..{n_visible - 1}" if n_visible else "this machine has no usable CUDA GPU"
        raise GearsInputError(
            f"distributed.gpu_ids={list(gpu_ids)} names GPU(s) {bad}, but {n_visible} GPU(s) are "
            f"visible{where}; {fix}, or remove distributed.gpu_ids and set device=cpu to train on "
            "the CPU"
        )


def choose_device(spec: str, local_rank: int = 0, gpu_ids: list | None = None) -> torch.device:
    if gpu_ids and spec != "cpu":
        check_gpu_ids(gpu_ids, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cuda":
        if not torch.cuda.is_available():
            raise GearsInputError("device=cuda but no CUDA device is available; use device=cpu")
        index = gpu_ids[local_rank] if gpu_ids else local_rank % torch.cuda.device_count()
        return torch.device("cuda", int(index))
    if spec.startswith("cuda:") and not torch.cuda.is_available():
        raise GearsInputError(f"device={spec} but no CUDA device is available; use device=cpu")
    return torch.device(spec)


def init_distributed(
    device: str = "auto", backend: str = "auto", timeout_s: int = 300, gpu_ids: list | None = None
) -> DistEnv:
    """Join the process group described by the environment (torchrun or Slurm); world size 1
    without those variables. Backend: NCCL when the device is CUDA, gloo otherwise."""
    slurm_to_env()
    rank, local_rank, world_size = launch_ranks()
    dev = choose_device(device, local_rank, gpu_ids)
    if world_size == 1:
        return DistEnv(0, 0, 1, dev, None)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend == "nccl" and dev.type != "cuda":
        raise GearsInputError("distributed.backend=nccl needs CUDA devices; use gloo on CPU")
    addr = os.environ.get("MASTER_ADDR", "?")
    port = os.environ.get("MASTER_PORT", "?")
    try:
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except Exception as e:  # rendezvous failures come in many exception types
        raise RuntimeError(
            f"rank {rank}/{world_size} could not join the process group at {addr}:{port} "
            f"({backend}, timeout {timeout_s}s): {e}. Check that every rank started, that "
            "MASTER_ADDR/MASTER_PORT are reachable from all nodes and the port is free."
        ) from e
    return DistEnv(rank, local_rank, world_size, dev, backend)


def cleanup(env: DistEnv) -> None:
    if env.distributed and dist.is_initialized():
        dist.destroy_process_group()


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()


def broadcast_object(env: DistEnv, obj: Any, src: int = 0) -> Any:
    if not env.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_objects(env: DistEnv, obj: Any) -> list[Any]:
    if not env.distributed:
        return [obj]
    out: list[Any] = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


def all_reduce_mean(env: DistEnv, value: torch.Tensor) -> torch.Tensor:
    if not env.distributed:
        return value
    value = value.clone()
    dist.all_reduce(value)
    return value / env.world_size


def all_reduce_max(env: DistEnv, value: torch.Tensor) -> torch.Tensor:
    """Element-wise maximum over ranks (flags any rank raised)."""
    if not env.distributed:
        return value
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value
