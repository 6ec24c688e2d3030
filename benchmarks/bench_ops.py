"""Ops dispatched per training step, by phase, at batch 32 and 256: the launch count of a GPU step.

python benchmarks/bench_ops.py                      # 1,000 genes, 300 singles + 200 doubles
python benchmarks/bench_ops.py --quick              # a small screen, eager only
python benchmarks/bench_ops.py --device cuda --json ops.json
python benchmarks/bench_ops.py --gpu-kernels       # on a CPU, the kernels a GPU would run

On a GPU this model is launch-bound (each op is at least one kernel launch, ~5-10 us of host
time in eager mode), so a step's op count bounds its speed whatever the arithmetic. For every
precision the device supports (fp32 and bf16; fp16 on CUDA), eager and compiled
(train.compile), random and grouped batching, this runs Trainer.train_epoch on real loader
batches and counts each step's ops by phase (loader, forward, loss, backward, optimizer,
bookkeeping) with opcount: eager steps with a TorchDispatchMode (every aten op that
reaches a kernel, forward and backward; views excluded: they launch nothing), compiled ones
with torch.profiler (top-level aten ops, views excluded, plus the kernels Inductor generated;
under a TorchDispatchMode a compiled graph runs eagerly). Counts do not depend on the machine's
load or speed. The mean over the steady steps (after each epoch's first) is printed, with the
batch's distinct perturbations and the row layout Trainer.row_layout chose.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GROUP_CELLS = 4  # grouped batching: batch / 4 perturbations x 4 cells, as bench_train.py


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--genes", type=int, default=1000)
    p.add_argument("--singles", type=int, default=300)
    p.add_argument("--doubles", type=int, default=200)
    p.add_argument("--cells-per-condition", type=int, default=50)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batches", default="32,256", help="batch sizes, comma-separated")
    p.add_argument("--steps", type=int, default=4, help="counted steps per configuration")
    p.add_argument("--device", default="cpu")
    p.add_argument("--precisions", default=None, help="default: every one the device supports")
    p.add_argument("--batching", default="random,grouped")
    p.add_argument("--no-compile", action="store_true", help="eager only")
    p.add_argument(
        "--gpu-kernels",
        action="store_true",
        help="on a CPU, count the kernels a GPU runs: no per-row / per-block loops for half "
        "precision (a CPU speed choice), and fp16 through a CPU GradScaler",
    )
    p.add_argument("--top", type=int, default=0, help="also print the N commonest ops of each")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="small screen, eager, 2 steps")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the counts as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.genes, args.singles, args.doubles = min(args.genes, 100), 60, 60
        args.cells_per_condition, args.steps, args.no_compile = 16, 2, True
    return args


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)
    os.environ["NUMBA_NUM_THREADS"] = str(min(ARGS.threads, os.cpu_count() or 1))

import torch  # noqa: E402
import torch._inductor.config  # noqa: E402

sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from opcount import PHASES, count_epoch  # noqa: E402
from provenance import provenance  # noqa: E402

# Inductor's CPU kernels are recorded by the profiler only when compiled with this on.
torch._inductor.config.cpp.enable_kernel_profile = True


def build_data(args, folder: Path):
    """The synthetic screen (PertData writes its own gene2go), simulation split."""
    from gears.data.pertdata import PertData

    params = dict(
        n_genes=args.genes,
        n_single=args.singles,
        n_double=args.doubles,
        cells_per_condition=args.cells_per_condition,
        n_control_cells=1000 if not args.quick else 200,
        n_modules=max(2, min(12, args.genes // 20)),
        seed=0,
    )
    pert_data = PertData(folder, verbose=False).load("synthetic", synthetic_params=params)
    pert_data.prepare_split("simulation", seed=1)
    return pert_data


def precisions(device: torch.device, asked: str | None, gpu_kernels: bool) -> list[str]:
    if asked:
        return asked.split(",")
    gpu = device.type == "cuda" or gpu_kernels
    return ["fp32", "bf16", "fp16"] if gpu else ["fp32", "bf16"]


def configuration(pert_data, net0, args, device, precision, compiled, batching, batch):
    """One configuration's steady-state counts: {phase: mean ops}, the total's mean and max,
    the commonest ops, distinct perturbations per batch and the row layouts chosen."""
    from gears.config import ModelConfig, TrainConfig
    from gears.train.distributed import DistEnv
    from gears.train.engine import Trainer

    # fp16 on a CPU (--gpu-kernels): fp16 autocast and a CPU GradScaler (the config refuses it)
    cpu_fp16 = precision == "fp16" and device.type != "cuda"
    cfg = TrainConfig(
        batch_size=batch,
        precision="fp32" if cpu_fp16 else precision,
        batching=batching,
        cells_per_group=GROUP_CELLS,
        compile=compiled,
    )
    env = DistEnv(device=device)
    trainer = Trainer(
        copy.deepcopy(net0), pert_data, cfg, ModelConfig(hidden_size=args.hidden), env
    )
    trainer.check_every = cfg.log_every  # the GPU's interval: the stop / NaN check stays out
    if cpu_fp16:
        trainer.amp_dtype, trainer.scaler = torch.float16, torch.amp.GradScaler("cpu")
    loader = pert_data.get_dataloader(
        batch, 128, batching=batching, cells_per_group=GROUP_CELLS, device=device
    )["train_loader"]
    loader.set_epoch(0)
    requests = list(itertools.islice(iter(loader.batch_sampler), args.steps + 1))
    if len(requests) < args.steps + 1:
        raise SystemExit(f"only {len(requests)} {batching} batches of {batch}; lower --steps")
    dataset = loader.dataset
    method = "profiler" if compiled else "dispatch"
    # Epoch 0 warms up (the optimizer's state; compiled: every row bucket the batches need).
    count_epoch(trainer, requests, dataset.__getitem__, epoch=0, method=method)
    steps = count_epoch(trainer, requests, dataset.__getitem__, epoch=1, method=method)[1:]
    layouts = [trainer.row_layout(dataset[r].counts).kind for r in requests[1:]]
    distinct = [len(set(dataset.cond[r].tolist())) for r in requests[1:]]
    totals = [sum(s.values()) for s in steps]
    phases = {p: statistics.mean(s[p] for s in steps) for p in PHASES}
    top = []
    if args.top and not compiled:
        from opcount import OpCounter

        counter = OpCounter()
        with counter:
            trainer.train_step(
                dataset[requests[1]].to(device),
                trainer.row_layout(dataset[requests[1]].counts),
                True,
            )
        top = Counter({op: n for (_, op), n in counter.by_op.items()}).most_common(args.top)
    return {
        "precision": precision,
        "compiled": compiled,
        "batching": batching,
        "batch": batch,
        "phases": phases,
        "mean": statistics.mean(totals),
        "max": max(totals),
        "distinct": statistics.mean(distinct),
        "layouts": sorted(set(layouts)),
        "counted_by": method,
        "top": top,
    }


def main(args) -> dict:
    from gears.compat.api import GEARS
    from gears.train.runtime import set_threads

    device = torch.device(args.device)
    if args.gpu_kernels:
        import gears.model.kernels

        gears.model.kernels._per_row = lambda x, other: False  # as on any non-CPU device
    with tempfile.TemporaryDirectory() as tmp:
        pert_data = build_data(args, Path(tmp))
        set_threads(args.threads)
        torch.manual_seed(0)
        net0 = GEARS(pert_data, device="cpu").model_initialize(hidden_size=args.hidden).model
        batches = [int(b) for b in args.batches.split(",")]
        rows = []
        for precision, compiled, batching in itertools.product(
            precisions(device, args.precisions, args.gpu_kernels),
            [False] if args.no_compile else [False, True],
            args.batching.split(","),
        ):
            for batch in batches:
                row = configuration(
                    pert_data, net0, args, device, precision, compiled, batching, batch
                )
                rows.append(row)
                print_row(row, batches)
    report = {
        "provenance": provenance(),
        "device": str(device),
        "torch": torch.__version__,
        "screen": {
            "genes": args.genes,
            "singles": args.singles,
            "doubles": args.doubles,
            "cells_per_condition": args.cells_per_condition,
            "hidden": args.hidden,
        },
        "counting": "eager: TorchDispatchMode, aten ops reaching a kernel, views excluded; "
        "compiled: torch.profiler, top-level aten ops (views excluded) + Inductor kernels",
        "gpu_kernels": bool(args.gpu_kernels),
        "rows": rows,
        "ratios": ratios(rows, batches),
    }
    print_ratios(report["ratios"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


HEADER_PRINTED = []


def print_row(row: dict, batches: list[int]) -> None:
    if not HEADER_PRINTED:
        HEADER_PRINTED.append(True)
        cols = "  ".join(f"{p:>11}" for p in PHASES)
        print(f"{'precision':<9} {'mode':<8} {'batching':<8} {'batch':>5} {'distinct':>8} "
              f"{'layout':<15} {cols}  {'total':>6} {'max':>5}")  # fmt: skip
    mode = "compiled" if row["compiled"] else "eager"
    cols = "  ".join(f"{row['phases'][p]:>11.1f}" for p in PHASES)
    print(
        f"{row['precision']:<9} {mode:<8} {row['batching']:<8} {row['batch']:>5} "
        f"{row['distinct']:>8.1f} {','.join(row['layouts']):<15} {cols}  {row['mean']:>6.1f} "
        f"{row['max']:>5}",
        flush=True,
    )
    for op, n in row["top"]:
        print(f"    {n:>5} {op}")


def ratios(rows: list[dict], batches: list[int]) -> list[dict]:
    """Per configuration: the largest batch's mean ops over the smallest's."""
    out = []
    key = lambda r: (r["precision"], r["compiled"], r["batching"])  # noqa: E731
    for k, group in itertools.groupby(sorted(rows, key=key), key=key):
        by_batch = {r["batch"]: r["mean"] for r in group}
        small, large = min(batches), max(batches)
        if small in by_batch and large in by_batch and small != large:
            out.append(
                {
                    "precision": k[0],
                    "compiled": k[1],
                    "batching": k[2],
                    f"ops_{small}": by_batch[small],
                    f"ops_{large}": by_batch[large],
                    "ratio": by_batch[large] / by_batch[small],
                }
            )
    return out


def print_ratios(rows: list[dict]) -> None:
    print("\nlargest batch / smallest batch, mean ops per step:")
    for r in rows:
        mode = "compiled" if r["compiled"] else "eager"
        sizes = [k for k in r if k.startswith("ops_")]
        print(
            f"  {r['precision']:<5} {mode:<8} {r['batching']:<8} "
            + "  ".join(f"{k[4:]}: {r[k]:.0f}" for k in sizes)
            + f"  ratio {r['ratio']:.2f}"
        )


if __name__ == "__main__":
    from gears.cli.exiting import run_and_exit  # exits once done, whatever threads are left

    run_and_exit(lambda: main(ARGS))
