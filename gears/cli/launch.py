"""Multi-process launching: torchrun/srun workers, mp.spawn with a free port, `train_multi_gpu`."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

from gears.cli.job import DEFAULT_CONFIG, command, load_pert_data, run
from gears.config import Config, load_config
from gears.errors import GearsInputError, TrainingStopped
from gears.train.distributed import (
    DistEnv,
    barrier,
    check_port_free,
    choose_device,
    cleanup,
    find_free_port,
    in_srun_task,
    init_distributed,
    rendezvous_store,
    resolve_device,
    set_local_rank_env,
    slurm_to_env,
    visible_gpus,
)
from gears.train.runtime import auto_threads, govern_waits, set_threads, share_cores, wait_passively


def launched_externally() -> bool:
    """True under torchrun (RANK set) or in one task of a multi-task srun step. The batch script
    of a multi-task allocation is not a task (SLURM_NTASKS > 1 there describes the allocation):
    there `python train_distributed.py` spawns local processes like on a workstation and says
    how to use every task (see `batch_script_note`)."""
    return "RANK" in os.environ or (in_srun_task() and int(os.environ.get("SLURM_NTASKS", "1")) > 1)


def batch_script_note() -> str | None:
    """What to tell a user who ran train_distributed.py in a multi-task batch script, not srun."""
    ntasks = int(os.environ.get("SLURM_NTASKS", "1") or 1)
    if "RANK" in os.environ or in_srun_task() or ntasks <= 1:
        return None
    return (
        f"note: SLURM_NTASKS={ntasks} but this process is the batch script, not an srun task; "
        "starting local processes on this node only (--nproc). To use every task run "
        "`srun python train_distributed.py ...` or ./run_multi_node.sh"
    )


def worker_main(cfg: Config) -> dict | None:
    """One rank: data first (before any process group, see `build_in_stages`), then join the
    group, train, gather predictions, leave the group; rank 0 then scores alone."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        cfg.train.resume = True  # a torchrun restart continues from the last checkpoint
    slurm_to_env()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # A device contradiction fails here, before any data work or rendezvous.
    share = cfg.distributed.backend == "gloo"
    device = choose_device(cfg.device, local_rank, cfg.distributed.gpu_ids, world_size, share)
    d = cfg.distributed
    store = None
    pert_data = None
    if world_size > 1:
        store, rank, world_size = rendezvous_store(d.data_wait_s)
        share_cores(store, rank, world_size)
        use_threads(cfg.train.threads or auto_threads())
        before_group = DistEnv(rank, local_rank, world_size, device, backend=None)
        pert_data = load_pert_data(cfg, before_group, store=store)
    env = init_distributed(cfg.device, d.backend, d.timeout_s, d.gpu_ids, store=store)
    try:
        return run(cfg, env, pert_data)
    except GearsInputError as e:
        if env.distributed and e.every_rank:
            # Rank 0 says it before any rank leaves: a launcher ends the other workers as soon
            # as the first one exits, which could cut rank 0 off before its line.
            if not e.reported:
                print(f"error: {e}", file=sys.stderr, flush=True)
                e.reported = True
            barrier(env)
        raise
    finally:
        cleanup(env)


def use_threads(n: int) -> None:
    """This rank's CPU threads from the start, so that ranks building their data at once (numba's
    DE kernels, torch's) divide the node's cores as training will; run() sets them again after
    the data step, which may have started numba's pool. n <= 0 leaves them as they are."""
    if n > 0 and "numba" not in sys.modules:
        os.environ.setdefault("NUMBA_NUM_THREADS", str(n))  # numba's pool size, read at import
    set_threads(n)


def _spawned(local_rank: int, nproc: int, cfg: Config, addr: str, port: int) -> None:
    set_local_rank_env(local_rank, nproc, port, addr)
    govern_waits()  # this rank's OpenMP waits (the launcher's environment marked them)

    command(lambda: worker_main(cfg))


def default_nproc(cfg: Config) -> int:
    if cfg.distributed.gpu_ids:
        return len(cfg.distributed.gpu_ids)
    if cfg.device != "cpu" and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 1


def spawn(cfg: Config, nproc: int | None = None) -> dict | None:
    """Start `nproc` local processes with torch.multiprocessing.spawn; returns rank 0's metrics."""
    nproc = nproc or default_nproc(cfg)
    if nproc < 1:
        raise GearsInputError(f"--nproc must be >= 1, got {nproc}")
    # Every rank's device, checked here so that a bad combination is one line, not N tracebacks.
    gpus = visible_gpus()
    for local_rank in range(nproc):
        resolve_device(
            cfg.device,
            local_rank,
            nproc,
            cfg.distributed.gpu_ids,
            gpus,
            local_world_size=nproc,
            share_gpus=cfg.distributed.backend == "gloo",
        )
    wait_passively()  # the workers' libgomp (train_multi_gpu's caller may have loaded torch)
    addr = cfg.distributed.master_addr
    port = cfg.distributed.master_port
    if port:
        check_port_free(addr, port)
    else:
        port = find_free_port(addr)
    # Ctrl-C reaches every process of the terminal's group: the workers stop at a step
    # boundary and write a checkpoint (exit 130); this process waits for them meanwhile
    # instead of raising KeyboardInterrupt out of the join.
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: None)
    except ValueError:  # not the main thread: no handler
        previous = None
    try:
        mp.spawn(_spawned, args=(nproc, cfg, addr, port), nprocs=nproc, join=True)
    except mp.ProcessExitedException as e:
        if e.exit_code == 2:  # bad input, which the worker has printed: no traceback here
            raise GearsInputError(f"process {e.error_index} stopped on the error above") from None
        if e.exit_code == 130:  # stopped by SIGINT, as rank 0 has printed
            raise TrainingStopped("stopped by SIGINT", signal.SIGINT) from None
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    metrics = Path(cfg.out_dir) / "metrics.json"
    return json.loads(metrics.read_text()) if metrics.exists() else None


def train_multi_gpu(
    pert_data_path: str,
    dataset_name: str,
    split_config: dict | None = None,
    args: dict | None = None,
    n_gpus: int | None = None,
    gpu_ids: list[int] | None = None,
) -> dict | None:
    """Python entry point (GEARS multi-GPU guide): train on `n_gpus` processes (GPUs when
    available, gloo CPU processes otherwise) and return the test metrics.

    pert_data_path: data folder; dataset_name: a dataset name or .h5ad path; split_config:
    split keys (type, seed, ...); args: any other config keys, dotted or by section
    ({'train': {'epochs': 5}} or {'train.epochs': 5}).
    """
    overrides = [f"data.data_dir={pert_data_path}", f"data.dataset={dataset_name}"]
    for key, value in (split_config or {}).items():
        overrides.append(f"split.{key}={json.dumps(value)}")
    for key, value in (args or {}).items():
        if isinstance(value, dict):
            overrides += [f"{key}.{k}={json.dumps(v)}" for k, v in value.items()]
        else:
            overrides.append(f"{key}={json.dumps(value)}")
    if gpu_ids is not None:
        overrides.append(f"distributed.gpu_ids={json.dumps(list(gpu_ids))}")
    cfg = load_config(None, overrides, base=DEFAULT_CONFIG)
    return spawn(cfg, n_gpus or (len(gpu_ids) if gpu_ids else None))
