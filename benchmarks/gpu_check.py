"""GPU check: what only a machine with CUDA GPUs can verify. One command, a table, --json FILE.

python benchmarks/gpu_check.py                       # every visible GPU; ~5-15 min
python benchmarks/gpu_check.py --steps 100 --json gpu_check.json
python benchmarks/gpu_check.py --nproc 4             # DDP part on 4 GPUs (default: all visible)

1 GPU: fp32 / bf16 / fp16 (GradScaler) training for --steps steps each on a synthetic screen:
the loss stays finite and ends close to fp32's, cells/s beside the bare per-cell layers bound
measured the same way on the same GPU, and peak GPU memory. With 2+ GPUs (NCCL, through the
project's own launcher): N ranks with batch b equal 1 rank with batch N*b (synchronised
batch-norm; parameters within tolerance), throughput per world size and scaling efficiency,
and a worker SIGKILLed mid-epoch under `torchrun --max-restarts 1` that resumes and finishes.
Without CUDA it says so and exits 0 (the CPU twins of these checks are in tests/).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

PRECISIONS = ("fp32", "bf16", "fp16")
LOSS_REL_TOL = 0.05  # final loss of bf16 / fp16 runs vs fp32 (same seed, same batches)
PARAM_TOL = dict(rtol=1e-3, atol=1e-4)  # N ranks vs 1 rank: NCCL and GPU atomics reorder sums


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--genes", type=int, default=1000)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=300, help="training steps per precision")
    p.add_argument("--singles", type=int, default=150)
    p.add_argument("--doubles", type=int, default=100)
    p.add_argument("--cells-per-condition", type=int, default=50)
    p.add_argument("--nproc", type=int, default=None, help="GPUs for the DDP part (default all)")
    p.add_argument("--skip-ddp", action="store_true", help="only the 1-GPU part")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON")
    args = p.parse_args(argv)
    args.quick = False
    return args


def write_json(path: str | None, doc: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"figures written to {path}")


# ------------------------------------------------------------------------------- 1 GPU
def synchronised_seconds(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def autocast_dtype(precision: str):
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def bare_bound(args, device: torch.device, precision: str) -> float:
    """Cells/s of the bare per-cell layers (bench_train's BareCellLayers) on this GPU."""
    from bench_train import BareCellLayers

    torch.manual_seed(0)
    model = BareCellLayers(args.genes, args.hidden).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=5e-4, fused=True)
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")
    h = torch.randn(args.batch * args.genes, args.hidden, device=device)
    y = torch.randn(args.batch, args.genes, device=device)
    dtype = autocast_dtype(precision)

    def steps(n):
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
                pred = model(h)
            loss = torch.nn.functional.mse_loss(pred.float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

    steps(10)  # warm-up (cuBLAS handles, autotuning)
    n = max(args.steps // 2, 20)
    return args.batch * n / synchronised_seconds(lambda: steps(n))


def train_one_gpu(args, pert_data, net0, device: torch.device, precision: str) -> dict:
    """The project's Trainer on real loaders: epoch losses, cells/s, peak memory."""
    from gears.config import ModelConfig, TrainConfig
    from gears.distributed import DistEnv
    from gears.engine import Trainer

    cfg = TrainConfig(epochs=1, batch_size=args.batch, precision=precision, log_every=10**9)
    trainer = Trainer(
        copy.deepcopy(net0), pert_data, cfg, ModelConfig(hidden_size=args.hidden),
        DistEnv(device=device),
    )  # fmt: skip
    loader = pert_data.get_dataloader(args.batch, 128, pin_memory=True)["train_loader"]
    trainer.cfg.limit_batches = 10
    trainer.train_epoch(loader, 0, progress=False)  # warm-up: cuBLAS handles, allocator
    torch.cuda.reset_peak_memory_stats(device)
    losses, cells, seconds, done, epoch = [], 0, 0.0, 0, 1
    while done < args.steps:
        trainer.cfg.limit_batches = min(len(loader), args.steps - done)
        result = []
        seconds += synchronised_seconds(
            lambda result=result, epoch=epoch: result.append(
                trainer.train_epoch(loader, epoch, progress=False)
            )
        )
        losses.append(result[0][0])
        cells += result[0][1]
        done += trainer.cfg.limit_batches
        epoch += 1
    return {
        "final_loss": losses[-1],
        "finite": all(math.isfinite(v) for v in losses),
        "cells_per_s": cells / seconds,
        "peak_mem_mb": torch.cuda.max_memory_allocated(device) / 2**20,
    }


# ------------------------------------------------------------------------------- N GPUs
def launch(cmd: list[str], env: dict, log: Path, timeout: float = 3600) -> int:
    with open(log, "w") as f:
        return subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                              timeout=timeout).returncode  # fmt: skip


def run_config(out: Path, overrides: list[str]) -> list[str]:
    return [
        "data.dataset=synthetic",
        f"out_dir={out}",
        "train.epochs=1",
        "train.schedule=constant",
        "train.early_stopping_patience=0",
        "distributed.sync_batchnorm=true",
        "wandb.mode=disabled",
        *overrides,
    ]


def load_state(run_dir: Path) -> dict:
    """The saved network weights of a finished run (api.GEARS.save_model's model.pt)."""
    state = torch.load(run_dir / "model" / "model.pt", map_location="cpu", weights_only=False)
    return state["state_dict"]


def ddp_checks(args, nproc: int, work: Path) -> dict:
    """N ranks == 1 rank, throughput per world size, kill-and-restart under torchrun."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    synthetic = (
        f"data.synthetic={{n_genes: {args.genes}, n_single: {args.singles}, "
        f"n_double: {args.doubles}, cells_per_condition: {args.cells_per_condition}}}"
    )
    common = [
        synthetic,
        f"data.data_dir={work / 'runs_data'}",  # every run reads the same synthetic screen
        f"model.hidden_size={args.hidden}",
        "train.batching=grouped",
    ]
    results: dict = {"world": {}}
    # Throughput per world size, per-rank batch fixed (weak scaling).
    for world in sorted({1, 2, nproc}):
        out = work / f"world{world}"
        cmd = [sys.executable, "train_distributed.py", "--nproc", str(world)]
        cmd += run_config(out, [*common, f"train.batch_size={args.batch}"])
        rc = launch(cmd, env, work / f"world{world}.log")
        metrics = json.loads((out / "metrics.json").read_text()) if rc == 0 else {}
        results["world"][world] = {
            "returncode": rc,
            "cells_per_s": metrics.get("timing", {}).get("train_cells_per_s"),
        }
    base = results["world"][1]["cells_per_s"]
    for world, r in results["world"].items():
        cps = r["cells_per_s"]
        r["scaling_efficiency"] = cps / (world * base) if cps and base else None

    # N ranks x batch b == 1 rank x batch N*b (grouped batches, synchronised batch-norm).
    single = work / "equal_single"
    cmd = [sys.executable, "train_single.py"]
    cmd += run_config(single, [*common, f"train.batch_size={nproc * args.batch}", "device=cuda:0"])
    rc1 = launch(cmd, env, work / "equal_single.log")
    multi = work / f"world{nproc}"
    same = None
    if rc1 == 0 and results["world"][nproc]["returncode"] == 0:
        a, b = load_state(single), load_state(multi)
        diffs = {
            k: (a[k].float() - b[k].float()).abs().max().item()
            for k in a
            if a[k].is_floating_point()
        }
        same = all(
            torch.allclose(a[k].float(), b[k].float(), **PARAM_TOL)
            for k in a
            if a[k].is_floating_point()
        )
        results["n_ranks_equal_1_rank"] = {"equal": same, "max_abs_diff": max(diffs.values())}
    else:
        results["n_ranks_equal_1_rank"] = {"equal": None, "error": "a run failed (see logs)"}

    # Kill-and-restart: rank 1 SIGKILLed at step 5 of the first attempt; torchrun restarts.
    out = work / "restart"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "--max-restarts=1", "train_distributed.py"]  # fmt: skip
    cmd += run_config(out, [*common, f"train.batch_size={args.batch}", "train.epochs=2"])
    renv = {**env, "GEARS_FAULT_KILL": "1:step:5", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    rc = launch(cmd, renv, work / "restart.log")
    log = (work / "restart.log").read_text()
    results["kill_and_restart"] = {
        "returncode": rc,
        "completed": rc == 0 and (out / "metrics.json").exists(),
        "resumed": "resumed from" in log or "train.resume: no checkpoint" in log,
    }
    return results


# ------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device visible (torch "
            f"{torch.__version__}, cuda {torch.version.cuda}); nothing to check here. "
            "Run it on a GPU machine; the CPU twins of these checks run in `pytest`."
        )
        write_json(args.json, {"cuda": False})
        return 0
    from bench_train import build_data, build_net

    from gears.runtime import tune_allocator

    tune_allocator()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    name = torch.cuda.get_device_name(device)
    count = torch.cuda.device_count()
    print(f"gpu_check: {count} x {name}, torch {torch.__version__}, cuda {torch.version.cuda}")
    doc: dict = {"cuda": True, "device": name, "gpus": count, "single": {}}
    precisions = [
        p
        for p in PRECISIONS
        if p != "bf16" or torch.cuda.is_bf16_supported(including_emulation=False)
    ]
    with tempfile.TemporaryDirectory(prefix="gears_gpu_check_") as tmp:
        work = Path(tmp)
        pert_data = build_data(args, work / "data")
        net0 = build_net(pert_data, args.hidden)
        for precision in precisions:
            run = train_one_gpu(args, pert_data, net0, device, precision)
            run["bound_cells_per_s"] = bare_bound(args, device, precision)
            doc["single"][precision] = run
        ref = doc["single"]["fp32"]["final_loss"]
        print(f"\n1 GPU, {args.steps} steps, G={args.genes}, H={args.hidden}, batch {args.batch}")
        print(f"{'precision':<10}{'final loss':>12}{'vs fp32':>9}{'cells/s':>10}{'bound':>10}"
              f"{'x bound':>9}{'peak MB':>9}  ok")  # fmt: skip
        ok = True
        for precision, r in doc["single"].items():
            rel = abs(r["final_loss"] / ref - 1)
            r["ok"] = bool(r["finite"] and rel < LOSS_REL_TOL)
            ok &= r["ok"]
            print(
                f"{precision:<10}{r['final_loss']:>12.4f}{rel:>9.3f}{r['cells_per_s']:>10.0f}"
                f"{r['bound_cells_per_s']:>10.0f}"
                f"{r['cells_per_s'] / r['bound_cells_per_s']:>9.2f}{r['peak_mem_mb']:>9.0f}"
                f"  {'yes' if r['ok'] else 'NO'}"
            )
        nproc = min(args.nproc or count, count)
        if nproc >= 2 and not args.skip_ddp:
            ddp = ddp_checks(args, nproc, work)
            doc["ddp"] = ddp
            print(f"\nNCCL DDP (per-rank batch {args.batch}, grouped batches)")
            print(f"{'ranks':>6}{'cells/s':>10}{'efficiency':>12}")
            for world, r in ddp["world"].items():
                eff = r["scaling_efficiency"]
                cps = r["cells_per_s"]
                print(f"{world:>6}{(cps or float('nan')):>10.0f}"
                      f"{(eff if eff is not None else float('nan')):>12.2f}")  # fmt: skip
            eq = ddp["n_ranks_equal_1_rank"]
            print(f"{nproc} ranks == 1 rank (parameters, {PARAM_TOL}): {eq}")
            print(f"kill-and-restart under torchrun: {ddp['kill_and_restart']}")
            ok &= bool(eq.get("equal")) and ddp["kill_and_restart"]["completed"]
        else:
            print("\nDDP part skipped: needs 2+ GPUs" + (" (--skip-ddp)" if args.skip_ddp else ""))
    doc["ok"] = bool(ok)
    write_json(args.json, doc)
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED (see the table above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
