"""Multi-process launching: torchrun/srun workers, mp.spawn with a free port, `train_multi_gpu`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.multiprocessing as mp

from gears.config import Config, load_config
from gears.distributed import check_port_free, cleanup, find_free_port, init_distributed
from gears.errors import GearsInputError


def launched_externally() -> bool:
    """True under torchrun (RANK set) or a multi-task srun (SLURM_NTASKS > 1)."""
    return "RANK" in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) > 1


def worker_main(cfg: Config) -> dict | None:
    """One rank: join the group from the environment, train, leave the group."""
    from gears.run import run

    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        cfg.train.resume = True  # a torchrun restart continues from the last checkpoint
    env = init_distributed(
        cfg.device, cfg.distributed.backend, cfg.distributed.timeout_s, cfg.distributed.gpu_ids
    )
    try:
        return run(cfg, env)
    finally:
        cleanup(env)


def _spawned(local_rank: int, nproc: int, cfg: Config, addr: str, port: int) -> None:
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(nproc),
        MASTER_ADDR=addr,
        MASTER_PORT=str(port),
    )
    from gears.run import guarded

    guarded(lambda: worker_main(cfg))


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
    if cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available()):
        available = torch.cuda.device_count()
        wanted = cfg.distributed.gpu_ids or list(range(nproc))
        if len(wanted) < nproc or max(wanted) >= available:
            raise GearsInputError(
                f"{nproc} processes need {nproc} GPUs; distributed.gpu_ids="
                f"{cfg.distributed.gpu_ids} but {available} are visible"
            )
    addr = cfg.distributed.master_addr
    port = cfg.distributed.master_port
    if port:
        check_port_free(addr, port)
    else:
        port = find_free_port(addr)
    mp.spawn(_spawned, args=(nproc, cfg, addr, port), nprocs=nproc, join=True)
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
    from gears.run import DEFAULT_CONFIG

    cfg = load_config(None, overrides, base=DEFAULT_CONFIG)
    return spawn(cfg, n_gpus or (len(gpu_ids) if gpu_ids else None))
