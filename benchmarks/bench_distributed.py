"""Training throughput of the DDP engine with 1 and 2 gloo CPU processes, per-rank batch fixed.

python benchmarks/bench_distributed.py --genes 1000 --hidden 64 --batch 32 --threads 1
python benchmarks/bench_distributed.py --quick

Each configuration is launched the way `python train_distributed.py --nproc N` launches its
workers (torch.multiprocessing.spawn, env:// rendezvous on a free port, gloo on CPU) and runs
`Trainer.train_epoch` with `train.limit_batches`; the data and initial weights are built once
and shared through a file so every configuration trains the same network on the same screen.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--genes", type=int, default=1000)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch", type=int, default=32, help="per-process batch")
    p.add_argument("--steps", type=int, default=None, help="timed steps per repeat (default 30)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats, median reported")
    p.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads per process")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--batching", default="random", choices=("random", "grouped"))
    p.add_argument("--sync-batchnorm", action="store_true")
    p.add_argument("--singles", type=int, default=150)
    p.add_argument("--doubles", type=int, default=100)
    p.add_argument("--cells-per-condition", type=int, default=50)
    p.add_argument("--quick", action="store_true", help="small and short: a smoke run")
    p.add_argument(
        "--wait-load",
        type=float,
        default=None,
        help="before measuring, wait (up to 15 min) for the 1-min load to fall below",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.genes = min(args.genes, 300)
        args.singles, args.doubles = min(args.singles, 40), min(args.doubles, 30)
        args.cells_per_condition = min(args.cells_per_condition, 20)
    args.steps = args.steps or (6 if args.quick else 30)
    args.repeats = args.repeats or (1 if args.quick else 3)
    return args


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    # Spawned workers inherit the environment: it fixes their OpenMP pool before torch loads.
    os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)
    os.environ["MKL_NUM_THREADS"] = str(ARGS.threads)
    # Pinned so that scanpy's numba kernels (DE step) cannot reset the OpenMP pool torch uses.
    os.environ["NUMBA_NUM_THREADS"] = str(min(ARGS.threads, os.cpu_count() or 1))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def time_rank(env, args: argparse.Namespace, state_path: str, threads: int) -> dict | None:
    """Warm up, then time `repeats` epochs of `steps` batches on this rank -> rank 0's result."""
    from bench_train import GROUP_CELLS, set_threads

    from gears.config import DistributedConfig, ModelConfig, TrainConfig
    from gears.train.distributed import barrier
    from gears.train.engine import Trainer

    state = torch.load(state_path, weights_only=False)
    pert_data, net = state["pert_data"], state["net"]
    set_threads(threads)
    cfg = TrainConfig(
        epochs=1,
        batch_size=args.batch,
        precision=args.precision,
        batching=args.batching,
        cells_per_group=GROUP_CELLS,
        limit_batches=args.steps,
    )
    trainer = Trainer(
        net,
        pert_data,
        cfg,
        ModelConfig(hidden_size=args.hidden),
        env,
        dist_cfg=DistributedConfig(sync_batchnorm=args.sync_batchnorm),
    )
    loader = pert_data.get_dataloader_distributed(
        args.batch, 128, env.world_size, env.rank, batching=args.batching,
        cells_per_group=GROUP_CELLS,
    )["train_loader"]  # fmt: skip
    if len(loader) < args.steps:
        raise SystemExit(f"only {len(loader)} batches per rank; lower --steps")
    cfg.limit_batches = 5
    trainer.train_epoch(loader, 0, progress=False)  # warm-up (and DDP's first buckets)
    cfg.limit_batches = args.steps
    rates, step_s = [], []
    for r in range(args.repeats):
        barrier(env)
        t0 = time.perf_counter()
        # Ends in an all-reduce of the loss: every rank has finished when it returns.
        _, cells = trainer.train_epoch(loader, r + 1, progress=False)
        elapsed = time.perf_counter() - t0
        rates.append(cells / elapsed)
        step_s.append(elapsed / args.steps)
    if not env.is_main:
        return None
    return {
        "cells_per_s": statistics.median(rates),
        "step_ms": 1e3 * statistics.median(step_s),
        "params": sum(p.numel() for p in trainer.net.parameters() if p.requires_grad),
        "torch_threads": torch.get_num_threads(),
    }


def worker(
    rank: int,
    world: int,
    threads: int,
    port: int,
    state_path: str,
    out_path: str,
    args: argparse.Namespace,
) -> None:
    """One rank of a `train_distributed.py --nproc N`-style launch."""
    from gears.train.distributed import cleanup, init_distributed, release, set_local_rank_env

    set_local_rank_env(rank, world, port)
    from gears.train.runtime import set_threads

    set_threads(threads)
    env = init_distributed("cpu", "gloo", timeout_s=300)
    try:
        result = time_rank(
            env, args, state_path, threads
        )  # DDP and its buffers are freed on return
        if result is not None:
            Path(out_path).write_text(json.dumps(result))
        env = release(env)  # the project's teardown order (barrier, collect, yield, destroy)
    finally:
        cleanup(env)
    from gears.cli.exiting import exit_quickly

    exit_quickly(0)  # this rank is done: it exits whatever threads a library left running


def run_config(world: int, threads: int, state: Path, tmp: Path, args) -> dict:
    from gears.train.distributed import find_free_port

    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["MKL_NUM_THREADS"] = str(threads)
    os.environ["NUMBA_NUM_THREADS"] = str(min(threads, os.cpu_count() or 1))
    out = tmp / f"result_{world}x{threads}.json"
    mp.spawn(
        worker,
        args=(world, threads, find_free_port(), str(state), str(out), args),
        nprocs=world,
        join=True,
    )
    return json.loads(out.read_text())


def main(args) -> None:
    from bench_train import build_data, build_net, load_average, wait_for_quiet

    print(
        f"bench_distributed: genes {args.genes}, hidden {args.hidden}, batch {args.batch} per "
        f"process, {args.threads} thread(s) per process, {args.precision}, {args.batching} "
        f"batches, steps {args.steps} x {args.repeats} repeats; torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs"
    )
    print(f"load average at start: {load_average()} (numbers are unreliable above ~1.5)")
    print("each configuration is launched `repeats` times, interleaved; medians reported")
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gears_bench_dist_") as tmp:
        tmp = Path(tmp)
        pert_data = build_data(args, tmp / "data")
        net = build_net(pert_data, args.hidden)
        state = tmp / "state.pt"
        torch.save({"pert_data": pert_data, "net": net}, state)
        wait_for_quiet(args.wait_load)
        load_before = load_average()
        configs = [(1, args.threads), (2, args.threads)]
        if 2 * args.threads <= (os.cpu_count() or 1):
            configs.append((1, 2 * args.threads))  # one process on the cores two would use
        # One launch per configuration and repeat, the configurations interleaved, so that a
        # change of machine load during the run hits them alike.
        once = argparse.Namespace(**{**vars(args), "repeats": 1})
        launches = {c: [] for c in configs}
        for _ in range(args.repeats):
            for c in configs:
                launches[c].append(run_config(*c, state, tmp, once))
        results = {
            c: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            for c, runs in launches.items()
        }
        load_after = load_average()

    base = results[(1, args.threads)]
    print(
        f"\n{'processes':>9}{'threads/proc':>14}{'global batch':>14}{'step ms':>10}"
        f"{'cells/s':>10}{'vs 1 proc':>11}"
    )
    for (world, _), r in results.items():  # threads/proc: as torch reported them in rank 0
        print(
            f"{world:>9}{int(r['torch_threads']):>14}{world * args.batch:>14}{r['step_ms']:>10.1f}"
            f"{r['cells_per_s']:>10.0f}{r['cells_per_s'] / base['cells_per_s']:>10.2f}x"
        )
    two = results[(2, args.threads)]
    n_params = int(base["params"])
    mb = n_params * 4 / 1e6
    print(
        f"\nall-reduce per optimizer step: {n_params:,} parameters x 4 bytes = {mb:.2f} MB of "
        f"fp32 gradients (DDP buckets, gloo); at 2 processes that is "
        f"{mb * 1e3 / two['step_ms']:.0f} MB/s of gradient traffic per rank."
    )
    print(
        f"note: this machine has {os.cpu_count()} CPU cores; 2 processes x {args.threads} "
        "thread(s) compete for the same cores and memory bandwidth, so the ratio measures "
        "CPU contention and gloo overhead, not how DDP scales across GPUs or nodes."
    )
    print(
        f"load average before / after the measurements: {load_before} / {load_after}; "
        f"total {time.perf_counter() - t_start:.0f}s"
    )
    worst = max(float(v.split()[0]) for v in (load_before, load_after))
    if worst > 1.5 + 2 * args.threads:  # the 2-process run itself adds ~2 x threads
        print(
            f"WARNING: 1-min load average reached {worst:.2f}: the machine was shared and "
            "these numbers are unreliable."
        )


if __name__ == "__main__":
    from gears.cli.exiting import run_and_exit  # exits once done, whatever threads are left

    run_and_exit(lambda: main(ARGS))
