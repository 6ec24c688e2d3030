"""Process-group setup: rank (torchrun, Slurm or single), device, backend, collectives.

Order of a distributed run (gears/cli/launch.py): rendezvous store -> data built in
stages over the store (no collective, no watchdog) -> process group -> training -> gathered
predictions -> `release` (barrier, destroy) -> rank-0-only scoring with no group left to time out.
"""

from __future__ import annotations

import datetime
import gc
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

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


DEFAULT_MASTER_PORT = 29500
SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 20000  # ports 20000-39999, below the ephemeral range
# Step ids Slurm gives the batch script, the extern step and salloc's interactive step: a process
# there is not one task of a multi-task `srun`, whatever SLURM_NTASKS says.
_NON_TASK_STEPS = {"batch", "extern", "interactive", "4294967290", "4294967291", "4294967292"}
_NON_TASK_STEPS |= {"4294967293", "4294967294", "4294967295"}


def default_master_port() -> int:
    """29500, or under Slurm a port derived from the job id (20000 + id % 20000), so that two
    jobs sharing a node do not collide. run_multi_node.sh derives the same number."""
    job = os.environ.get("SLURM_JOB_ID", "")
    if job.isdigit():
        return SLURM_PORT_BASE + int(job) % SLURM_PORT_SPAN
    return DEFAULT_MASTER_PORT


def in_srun_task() -> bool:
    """True in a task of an `srun` job step (SLURM_PROCID and a real SLURM_STEP_ID); False in
    the batch script itself, where SLURM_NTASKS describes the allocation, not this process."""
    step = os.environ.get("SLURM_STEP_ID", os.environ.get("SLURM_STEPID"))
    return "SLURM_PROCID" in os.environ and step is not None and step not in _NON_TASK_STEPS


def set_local_rank_env(rank: int, world_size: int, port: int, addr: str = "127.0.0.1") -> None:
    """The variables torchrun sets for local rank `rank` of a one-node group of `world_size`
    (used by `train_distributed.py --nproc N`'s mp.spawn workers, the tests and the benchmarks)."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR=addr,
        MASTER_PORT=str(port),
    )


def slurm_to_env() -> None:
    """Under `srun` without torchrun, derive RANK/WORLD_SIZE/MASTER_ADDR from Slurm's variables."""
    if "RANK" in os.environ or not in_srun_task():
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    os.environ["WORLD_SIZE"] = os.environ.get("SLURM_NTASKS", "1")
    if "MASTER_ADDR" not in os.environ:
        # The step's nodes: a step may run on a subset of the job's, without its first host.
        nodelist = os.environ.get("SLURM_STEP_NODELIST", os.environ.get("SLURM_JOB_NODELIST"))
        nodelist = nodelist or "127.0.0.1"
        os.environ["MASTER_ADDR"] = first_slurm_host(nodelist)
    os.environ.setdefault("MASTER_PORT", str(default_master_port()))


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


def resolve_device(
    spec: str,
    local_rank: int = 0,
    world_size: int = 1,
    gpu_ids: list | None = None,
    device_count: int = 0,
    rank: int | None = None,
    local_world_size: int | None = None,
    share_gpus: bool = False,
) -> torch.device:
    """The device of one process: a pure function of the config and what the node has, so every
    contradiction is a clear error on any machine (tests exercise it without a GPU).

    spec: auto | cpu | cuda | cuda:N; gpu_ids: the GPUs local ranks 0, 1, ... use (None: local
    rank modulo the visible GPUs, which also covers Slurm binding one GPU per task);
    device_count: CUDA devices visible; local_world_size: processes on this node when a
    launcher says so (torchrun's LOCAL_WORLD_SIZE), to refuse two ranks on one GPU unless
    `share_gpus` (gloo, which, unlike NCCL, runs several ranks on one GPU: tests and checks).
    """
    who = f"rank {local_rank if rank is None else rank} (local_rank {local_rank})"
    if spec.startswith("cuda:") and world_size > 1:
        raise GearsInputError(
            f"device={spec} with {world_size} processes (WORLD_SIZE={world_size}) would put "
            "every rank on the same GPU; use device=cuda (one GPU per local rank) and "
            "distributed.gpu_ids=[...] to choose which GPUs"
        )
    if gpu_ids is not None and spec in ("cuda", "auto"):
        ids = list(gpu_ids)
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
            raise GearsInputError(f"distributed.gpu_ids={ids} must be non-negative GPU indices")
        if len(set(ids)) != len(ids):
            raise GearsInputError(f"distributed.gpu_ids={ids} names a GPU twice")
        needed = max(local_rank + 1, local_world_size or 0)
        if needed > len(ids) and (spec == "cuda" or device_count > 0):
            raise GearsInputError(
                f"{who}: distributed.gpu_ids={ids} has {len(ids)} entries but this node runs "
                f"{'at least ' if local_world_size is None else ''}{needed} processes; give one "
                "GPU id per process on a node"
            )
    if spec == "auto":
        spec = "cuda" if device_count > 0 else "cpu"
    if spec.startswith("cuda") and device_count == 0:
        raise GearsInputError(f"device={spec} but no CUDA device is available; use device=cpu")
    if spec == "cuda":
        if gpu_ids is not None:
            index = int(gpu_ids[local_rank])
            if index >= device_count:
                raise GearsInputError(
                    f"{who}: distributed.gpu_ids={list(gpu_ids)} names GPU {index}, but only "
                    f"{device_count} GPU(s) are visible (0..{device_count - 1}; check "
                    "CUDA_VISIBLE_DEVICES)"
                )
            return torch.device("cuda", index)
        if local_world_size is not None and local_world_size > device_count and not share_gpus:
            raise GearsInputError(
                f"{who}: {local_world_size} processes on this node but only {device_count} "
                "GPU(s) visible; start one process per GPU (--nproc_per_node / NPROC_PER_NODE)"
            )
        return torch.device("cuda", local_rank % device_count)
    if spec.startswith("cuda:"):
        index = spec.split(":", 1)[1]
        if not index.isdigit() or int(index) >= device_count:
            raise GearsInputError(
                f"device={spec}: only {device_count} GPU(s) are visible (cuda:0..cuda:"
                f"{device_count - 1})"
            )
        return torch.device("cuda", int(index))
    try:
        return torch.device(spec)
    except RuntimeError:
        raise GearsInputError(
            f"device={spec!r} is not a device (auto, cpu, cuda, cuda:N)"
        ) from None


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_device(
    spec: str,
    local_rank: int = 0,
    gpu_ids: list | None = None,
    world_size: int = 1,
    share_gpus: bool = False,
) -> torch.device:
    """resolve_device for this process and node; a CUDA device becomes the current device, so
    that code using the current device (bf16 support checks, new tensors) uses this GPU."""
    if gpu_ids and spec != "cpu":
        check_gpu_ids(gpu_ids, visible_gpus())  # ids for GPUs this machine does not have
    local_world = os.environ.get("LOCAL_WORLD_SIZE")
    dev = resolve_device(
        spec,
        local_rank,
        world_size,
        gpu_ids,
        visible_gpus(),
        rank=int(os.environ.get("RANK", local_rank)),
        local_world_size=int(local_world) if local_world and world_size > 1 else None,
        share_gpus=share_gpus,
    )
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # GPU-only
    return dev


def set_tf32(device: torch.device, enabled: bool) -> None:
    """TF32 for fp32 matmuls and convolutions on CUDA when `enabled` (train.tf32), full fp32
    otherwise; the flags are process-wide, so both values are set explicitly. Nothing changes on
    CPU, which has no TF32."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high" if enabled else "highest")  # GPU-only
        torch.backends.cudnn.allow_tf32 = enabled  # GPU-only


def init_distributed(
    device: str = "auto",
    backend: str = "auto",
    timeout_s: int = 1800,
    gpu_ids: list | None = None,
    store: dist.Store | None = None,
) -> DistEnv:
    """Join the process group described by the environment (torchrun or Slurm); world size 1
    without those variables. Backend: NCCL when the device is CUDA, gloo otherwise.

    store: the rendezvous store from `rendezvous_store` when the caller already used it (to
    prepare the data before the group existed); None: env:// rendezvous."""
    slurm_to_env()
    rank, local_rank, world_size = launch_ranks()
    dev = choose_device(device, local_rank, gpu_ids, world_size, share_gpus=backend == "gloo")
    if world_size == 1:
        return DistEnv(0, 0, 1, dev, None)
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend == "nccl" and dev.type != "cuda":
        raise GearsInputError("distributed.backend=nccl needs CUDA devices; use gloo on CPU")
    addr = os.environ.get("MASTER_ADDR", "?")
    port = os.environ.get("MASTER_PORT", "?")
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if store is not None:
            store.set_timeout(timeout)
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            # Binds the NCCL communicator to this GPU now (eager init, no barrier warning).
            device_id=dev if dev.type == "cuda" else None,  # GPU-only
        )
    except Exception as e:  # rendezvous failures come in many exception types
        raise RuntimeError(
            f"rank {rank}/{world_size} could not join the process group at {addr}:{port} "
            f"({backend}, timeout {timeout_s}s): {e}. Check that every rank started, that "
            "MASTER_ADDR/MASTER_PORT are reachable from all nodes and the port is free."
        ) from e
    return DistEnv(rank, local_rank, world_size, dev, backend)


def rendezvous_store(wait_s: float) -> tuple[dist.Store, int, int]:
    """The launcher's key-value store (rank 0's TCPStore, or torchrun's agent store) before any
    process group exists: (store, rank, world_size). Waiting on its keys is not a collective, so
    no collective timeout or NCCL watchdog applies; `init_distributed(store=...)` reuses it."""
    timeout = datetime.timedelta(seconds=wait_s)
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    return store, rank, world_size


T = TypeVar("T")


class _PeerFailed(GearsInputError):
    """Another rank's data step failed; its message is passed on."""


def _wait_key(store: dist.Store, key: str, wait_s: float, rank: int, whom: str, told: str) -> None:
    try:
        store.wait([key], datetime.timedelta(seconds=wait_s))
        value = store.get(key)
    except Exception as e:  # DistStoreError on timeout, or the store host went away
        raise GearsInputError(
            f"rank {rank} waited for {whom} to prepare the data and gave up after at most "
            f"{wait_s:.0f}s ({type(e).__name__}). If the data step legitimately takes longer, "
            "raise distributed.data_wait_s; otherwise see that rank's error."
        ) from None
    if value != b"ok":
        store.add(told, 1)  # the failing rank waits (briefly) until every rank has read it
        raise _PeerFailed(
            f"rank {rank}: {whom} failed to prepare the data ({value.decode(errors='replace')})"
        )


def build_in_stages(
    build: Callable[[], T],
    store: dist.Store,
    rank: int,
    local_rank: int,
    world_size: int,
    wait_s: float,
    prefix: str = "gears/data",
) -> T:
    """Every rank's `build()` (loading the data) before the process group exists, writers first.

    Rank 0 builds alone (downloads, processes, writes caches). Then the local rank 0 of every
    other node builds: it reads rank 0's caches on a shared filesystem, or writes its node's own
    copy on node-local disks. Then the remaining ranks of each node read their node's cache. No
    two processes of a node write the same cache at once. Waits use the store with `wait_s` (the
    generous distributed.data_wait_s), never the collective timeout; a failure in a writer is
    passed on so the waiting ranks stop at once with its message.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent store outlives a restart: keep each attempt's keys apart (the count
        # only agrees across nodes for single-node restarts; run_multi_node.sh disables the
        # shared store, and then every attempt's store is new and holds no stale keys).
        prefix = f"{prefix}/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    node_key = f"{prefix}/node/{socket.gethostname()}"
    first_key = f"{prefix}/rank0"
    told = f"{prefix}/told"
    try:
        if rank != 0 and local_rank == 0:
            _wait_key(store, first_key, wait_s, rank, "rank 0", told)
        elif rank != 0:
            _wait_key(store, node_key, wait_s, rank, "local rank 0 of this node", told)
        result = build()
    except BaseException as e:
        if rank == 0 or local_rank == 0:  # writers tell the ranks waiting for them
            msg = str(e) if isinstance(e, _PeerFailed) else f"rank {rank}: {type(e).__name__}: {e}"
            for key in (first_key, node_key) if rank == 0 else (node_key,):
                store.set(key, msg[:2000])
        if rank == 0:  # the store lives in this process: keep it up until they have read it
            deadline = time.monotonic() + 10
            while store.add(told, 0) < world_size - 1 and time.monotonic() < deadline:
                time.sleep(0.1)
        raise
    if rank == 0:
        store.set(first_key, "ok")
    if local_rank == 0 or rank == 0:
        store.set(node_key, "ok")
    # Nobody joins the group (whose connect timeout is the collective one) before all are ready.
    if store.add(f"{prefix}/built", 1) == world_size:
        store.set(f"{prefix}/all", "ok")
    _wait_key(store, f"{prefix}/all", wait_s, rank, "the other ranks", told)
    return result


def release(env: DistEnv) -> DistEnv:
    """Leave the process group together, on every rank at the same point: a barrier, then
    destroy. Returns this rank's env without a group, for rank-0-only work that may take longer
    than any collective timeout (scoring, baselines, plots). The caller drops its DDP wrapper
    first: a reducer freed later from a Python dealloc with the GIL held used to be what
    destroyed the gloo group and joined its worker thread, which waited for the GIL (a hang:
    benchmarks/README.md, finding 6)."""
    if not (env.distributed and dist.is_initialized()):
        return env
    gc.collect()  # free unreferenced DDP reducers now, while the group is still alive
    dist.barrier()
    _destroy_group()
    return DistEnv(env.rank, env.local_rank, env.world_size, env.device, None)


def _destroy_group() -> None:
    # The last collective's work may still be releasing its tensors on gloo's thread, which
    # takes the GIL: give it the GIL first. A group whose last owner (a DDP reducer) is freed
    # from Python later joins that thread with the GIL held and hangs if the thread still waits.
    time.sleep(0.05)
    dist.destroy_process_group()


def cleanup(env: DistEnv) -> None:
    """Destroy the group if `release` did not (an error path: no barrier, a peer may be gone)."""
    if env.distributed and dist.is_initialized():
        gc.collect()
        _destroy_group()


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
