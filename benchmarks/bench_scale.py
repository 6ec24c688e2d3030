"""Genome-scale screens: out-of-core processing, one shared store, N-process training memory.

python benchmarks/bench_scale.py --cells 90000 --genes 5000 --perts 230 --nproc 2 --steps 50 \\
    --json norman.json                                                       # Norman size
python benchmarks/bench_scale.py --cells 221273 --genes 18080 --perts 150 --nproc 2 --steps 30 \\
    --json vcc.json                                                          # VCC size
python benchmarks/bench_scale.py --cells 1000000 --genes 8000 --perts 2000 --nproc 2 --steps 30 \\
    --json replogle.json                                                     # Replogle size
python benchmarks/bench_scale.py --memory-table --genes 18080 --batches 8 16 32   # per batch
python benchmarks/bench_scale.py --quick                                     # smoke run

Steps, each in fresh processes so that peak figures belong to one phase:
1. write: a synthetic screen as a backed .h5ad with CSR X, generated and written in row chunks
   (h5py, never the whole matrix in memory): ~10% non-zero, singles only, 10% control cells,
   each perturbation knocks its gene down and shifts a module of 20 genes.
2. process: `PertData(store="mmap").load(path)`: the chunked pass (validation, per-condition
   sums, streamed t-test DE) writing the store. Time and the process's peak RSS.
3. graphs: split + GO graph + co-expression graph over control + training cells (streamed,
   cached in the store for the ranks). Time and peak RSS.
4. train: `--nproc` gloo processes on CPU, each opening the store (memory-mapped), building
   GEARS and training `--steps` DDP steps. The parent samples every rank's PSS from
   /proc/PID/smaps_rollup (shared pages counted once across ranks) every 0.2 s; the node figure
   is the peak of the ranks' summed PSS. cells/s over the timed steps (after a warm-up) and the
   full-epoch time projected from it.
5. `--compare-memory` (dense stores only): the same training, one process, expression in
   memory (store=memory) vs memory-mapped (store=mmap), cells/s side by side.

The JSON (`--json FILE`) holds {"cells", "genes", "process_s", "process_peak_rss_gb",
"rank_peak_pss_gb": [...], "node_peak_pss_gb", "train_cells_per_s", "projected_epoch_s"} plus
the details (input size, graph time, store layout, the memory comparison).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GB = 1024**3


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", type=int, default=90_000)
    p.add_argument("--genes", type=int, default=5_000)
    p.add_argument("--perts", type=int, default=230, help="single perturbations")
    p.add_argument("--density", type=float, default=0.1, help="fraction of non-zero entries")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=50, help="timed training steps per rank")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=32, help="per-rank batch")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--chunk-cells", type=int, default=20_000)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--workdir", default=None, help="default: a temp dir under /tmp, removed")
    p.add_argument("--keep", action="store_true", help="keep the workdir (input + store)")
    p.add_argument(
        "--graph-cells",
        type=int,
        default=0,
        help="estimate the co-expression graph from this many random control + "
        "training cells (0 = all, as the product does); a benchmark shortcut for "
        "the largest sizes, recorded in the JSON",
    )
    p.add_argument(
        "--compare-memory",
        action="store_true",
        help="also time 1-process training with the matrix in memory vs mmap",
    )
    p.add_argument(
        "--gather",
        type=int,
        default=0,
        help="also time this many training batches gathered (no model) from the "
        "memory-mapped store vs an in-memory copy, in one process",
    )
    p.add_argument(
        "--memory-table",
        action="store_true",
        help="only: peak memory of training steps per batch size at --genes",
    )
    p.add_argument("--batches", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--quick", action="store_true", help="small and short: a smoke run")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--store-mode", default="mmap", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.cells, args.genes, args.perts = 6_000, 800, 30
        args.steps, args.warmup, args.chunk_cells = 8, 2, 1_000
        args.batches = [8, 16]
    return args


# ------------------------------------------------------------------------------------ writing
def gene_names(n: int) -> list[str]:
    return [f"GENE{i:05d}" for i in range(n)]


def write_screen(
    path: Path,
    cells: int,
    genes: int,
    perts: int,
    density: float,
    seed: int = 0,
    chunk: int = 2_000,
) -> dict:
    """A synthetic screen written as an anndata-readable .h5ad with CSR X, chunk by chunk.

    Cells get `ctrl` (10%) or one of `perts` singles perturbing GENE00000..; a perturbed cell's
    gene is knocked down to zero and a module of 20 genes shifted by +0.7 (so DE is real).
    Memory: O(chunk x genes), never the matrix.
    """
    import anndata as ad
    import h5py
    import pandas as pd

    rng = np.random.default_rng(seed)
    names = gene_names(genes)
    labels = np.array(["ctrl"] + [f"{g}+ctrl" for g in names[:perts]])
    probs = np.full(perts + 1, 0.9 / perts)
    probs[0] = 0.1
    cond = rng.choice(perts + 1, size=cells, p=probs)
    gene_rate = np.clip(rng.gamma(2.0, density / 2.0, genes), 0.005, 0.9).astype(np.float32)
    gene_level = rng.gamma(4.0, 0.4, genes).astype(np.float32)
    modules = rng.integers(0, genes, size=(perts + 1, 20))
    obs = pd.DataFrame(
        {"condition": pd.Categorical(labels[cond])},
        index=pd.Index([f"cell{i}" for i in range(cells)]),
    )
    var = pd.DataFrame(index=pd.Index(names))
    with h5py.File(path, "w") as f:
        f.attrs["encoding-type"], f.attrs["encoding-version"] = "anndata", "0.1.0"
        ad.io.write_elem(f, "obs", obs)
        ad.io.write_elem(f, "var", var)
        for empty in ("uns", "obsm", "varm", "obsp", "varp", "layers"):
            ad.io.write_elem(f, empty, {})
        X = f.create_group("X")
        X.attrs["encoding-type"], X.attrs["encoding-version"] = "csr_matrix", "0.1.0"
        X.attrs["shape"] = (cells, genes)
        data = X.create_dataset("data", (0,), np.float32, maxshape=(None,), chunks=(1 << 18,))
        indices = X.create_dataset(
            "indices",
            (0,),
            np.int32,
            maxshape=(None,),  # genes < 2^31
            chunks=(1 << 18,),
        )
        indptr = np.zeros(cells + 1, np.int64)
        nnz = 0
        for start in range(0, cells, chunk):
            stop = min(start + chunk, cells)
            c = cond[start:stop]
            mask = rng.random((stop - start, genes), dtype=np.float32) < gene_rate
            rows = np.arange(stop - start)
            for k in range(20):  # the module genes are expressed more often in their condition
                mask[rows, modules[c, k]] |= c > 0
            mask[rows[c > 0], c[c > 0] - 1] = False  # knock-down (gene i is perturbation i+1)
            r, col = np.nonzero(mask)
            values = gene_level[col] * rng.gamma(4.0, 0.25, col.size).astype(np.float32)
            shifted = (modules[c[r]] == col[:, None]).any(1) & (c[r] > 0)
            values[shifted] += 0.7
            values = np.log1p(values).astype(np.float32)
            data.resize((nnz + col.size,))
            indices.resize((nnz + col.size,))
            data[nnz:] = values
            indices[nnz:] = col.astype(np.int32)
            indptr[start + 1 : stop + 1] = nnz + np.cumsum(np.bincount(r, minlength=stop - start))
            nnz += col.size
        # One index dtype for indices and indptr, as scipy expects of a CSR matrix.
        X.create_dataset("indptr", data=indptr.astype(np.int32 if nnz < 2**31 else np.int64))
    return {"nnz": int(nnz), "input_gb": path.stat().st_size / GB}


def write_gene2go(path: Path, genes: int, perts: int, seed: int = 0) -> None:
    """GO terms for the perturbed genes (the only ones the GO graph needs)."""
    rng = np.random.default_rng(seed + 1)
    lines = []
    for g in gene_names(genes)[:perts]:
        terms = {f"GO:{t:07d}" for t in rng.integers(0, max(perts // 2, 10), 6)}
        lines.append(f"{g}\t{','.join(sorted(terms))}")
    path.write_text("\n".join(lines) + "\n")


# ------------------------------------------------------------------------------------ children
def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB


def status_gb(field: str) -> float:
    """A kB field of /proc/self/status (VmRSS, VmHWM) in GB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / GB
    raise KeyError(field)


def load_pert_data(args, work: Path, verbose: bool = False):
    from gears.data.pertdata import PertData

    pd_ = PertData(
        work / "data",
        gene2go=work / "gene2go.tsv",
        store=args.store_mode,
        chunk_cells=args.chunk_cells,
        verbose=verbose,
    )
    pd_.load(data_path=work / "screen.h5ad")
    return pd_


def child_process(args, work: Path) -> dict:
    import gears.data.pertdata  # noqa: F401 - imports are not processing time

    t0 = time.perf_counter()
    pd_ = load_pert_data(args, work)
    return {
        "process_s": time.perf_counter() - t0,
        "process_peak_rss_gb": peak_rss_gb(),
        "layout": pd_.store.meta["layout"] if pd_.store else "memory",
        "conditions": len(pd_.conditions),
    }


def child_graphs(args, work: Path) -> dict:
    pd_ = load_pert_data(args, work)
    t0 = time.perf_counter()
    pd_.prepare_split("simulation", seed=1)
    go = pd_.go_graph()
    if args.graph_cells:
        # Shortcut: the graph of a random subset, cached under the all-cells key that the
        # training ranks look up (the product itself always uses every cell).
        from gears.data import graphs

        rows = np.union1d(pd_.set_rows("train")[0], pd_.ctrl_rows)
        subset = np.sort(
            np.random.default_rng(0).choice(rows, min(args.graph_cells, len(rows)), replace=False)
        )
        pd_._stored_graph(
            ("coexpress", 20, 0.4, rows),
            lambda: graphs.coexpression_graph(
                pd_.expr.numpy(), list(pd_.gene_names), 20, 0.4, rows=subset
            ),
        )
    co = pd_.coexpress_graph()
    return {
        "graph_s": time.perf_counter() - t0,
        "graph_peak_rss_gb": peak_rss_gb(),
        "graph_cells": args.graph_cells or "all",
        "go_edges": go.num_edges,
        "coexpress_edges": co.num_edges,
        "train_examples": int(len(pd_.set_rows("train")[0])),
    }


def child_gather(args, work: Path) -> dict:
    """Batches/s of the training loader: matrix memory-mapped vs the same matrix in memory.

    Cold = first touch of the store's pages in this process (page faults), warm = again.
    Alternating rounds, best of each, so that machine load affects both alike.
    """
    import torch

    from gears.data.loaders import ExpressionMatrix

    torch.set_num_threads(args.threads)
    pd_ = load_pert_data(args, work)
    pd_.prepare_split("simulation", seed=1)
    mapped = pd_.expr
    in_memory = ExpressionMatrix(
        np.array(mapped.numpy()) if mapped.dense is not None else mapped.csr.copy()
    )

    def rate(expr, epoch: int) -> float:
        pd_.expr = expr
        loader = pd_.get_dataloader(args.batch)["train_loader"]
        loader.set_epoch(epoch)
        t0 = time.perf_counter()
        for i, _ in enumerate(loader):
            if i + 1 == args.gather:
                break
        return args.gather / (time.perf_counter() - t0)

    cold = rate(mapped, 0)
    rates: dict[str, list[float]] = {"memory": [], "mmap": []}
    for r in range(3):
        rates["memory"].append(rate(in_memory, r + 1))
        rates["mmap"].append(rate(mapped, r + 1))
    return {
        "gather_batches_per_s": {
            "mmap_cold": cold,
            "mmap_warm": max(rates["mmap"]),
            "memory": max(rates["memory"]),
        }
    }


def child_train(args, work: Path) -> dict | None:
    """One rank: open the store, build GEARS, warm up, time `steps` DDP steps."""
    import torch

    from gears.compat.api import GEARS
    from gears.config import TrainConfig
    from gears.train.distributed import (
        DistEnv,
        barrier,
        cleanup,
        init_distributed,
        set_local_rank_env,
    )
    from gears.train.engine import Trainer

    torch.set_num_threads(args.threads)
    world = args.nproc if args.store_mode == "mmap" else 1
    if world > 1:
        set_local_rank_env(args.rank, world, args.port)
        env = init_distributed("cpu", "gloo", timeout_s=1800)
    else:
        env = DistEnv(device=torch.device("cpu"))
    try:
        pd_ = load_pert_data(args, work)
        pd_.prepare_split("simulation", seed=1)
        model = GEARS(pd_, device="cpu", env=env)
        model.model_initialize(hidden_size=args.hidden)
        cfg = TrainConfig(epochs=1, batch_size=args.batch, limit_batches=args.warmup)
        trainer = Trainer(model.model, pd_, cfg, model.model_config(), env)
        loader = pd_.get_dataloader_distributed(args.batch, args.batch, env.world_size, env.rank)[
            "train_loader"
        ]
        trainer.train_epoch(loader, 0, progress=False)
        cfg.limit_batches = args.steps
        barrier(env)
        t0 = time.perf_counter()
        _, cells = trainer.train_epoch(loader, 1, progress=False)  # ends in an all-reduce
        elapsed = time.perf_counter() - t0
        barrier(env)
        steps_per_epoch = len(loader)
        result = {
            "train_cells_per_s": cells / elapsed,
            "projected_epoch_s": steps_per_epoch * elapsed / args.steps,
            "steps_per_epoch": steps_per_epoch,
            "world": env.world_size,
            "rank_peak_rss_gb": peak_rss_gb(),
        }
        return result if env.is_main else None
    finally:
        if world > 1:
            cleanup(env)


def child_memory_table(args) -> dict:
    """Peak RSS of forward + backward + Adam steps of the network at one batch size."""
    import torch

    from gears.compat.api import GEARS
    from gears.config import ModelConfig, TrainConfig
    from gears.data.pertdata import PertData
    from gears.train.distributed import DistEnv
    from gears.train.engine import Trainer

    torch.set_num_threads(args.threads)
    work = Path(args.workdir)
    pd_ = PertData(work / "data", verbose=False)
    pd_.load(
        "synthetic",
        synthetic_params={
            "n_genes": args.genes,
            "n_single": 60,
            "n_double": 0,
            "cells_per_condition": 20,
            "n_control_cells": 400,
        },
    )
    pd_.prepare_split("simulation", seed=1)
    env = DistEnv(device=torch.device("cpu"))
    model = GEARS(pd_, device="cpu", env=env)
    model.model_initialize(hidden_size=args.hidden)
    # The data and graph build peak above training: reset the kernel's peak-RSS mark (VmHWM)
    # so that the figure is the model + optimizer + activations of training alone.
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = status_gb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    cfg = TrainConfig(epochs=1, batch_size=args.batch, limit_batches=args.steps)
    trainer = Trainer(model.model, pd_, cfg, ModelConfig(hidden_size=args.hidden), env)
    loader = pd_.get_dataloader(args.batch)["train_loader"]
    t0 = time.perf_counter()
    _, cells = trainer.train_epoch(loader, 0, progress=False)
    elapsed = time.perf_counter() - t0
    params = sum(p.numel() for p in model.model.parameters())
    return {
        "batch": args.batch,
        "peak_rss_gb": status_gb("VmHWM"),
        "before_train_gb": before,
        "cells_per_s": cells / elapsed,
        "params": params,
    }


# ------------------------------------------------------------------------------------- parent
def child_cmd(args, mode: str, work: Path, **extra) -> list[str]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        mode,
        "--workdir",
        str(work),
        "--cells",
        str(args.cells),
        "--genes",
        str(args.genes),
        "--perts",
        str(args.perts),
        "--nproc",
        str(args.nproc),
        "--steps",
        str(args.steps),
        "--graph-cells",
        str(args.graph_cells),
        "--warmup",
        str(args.warmup),
        "--batch",
        str(args.batch),
        "--hidden",
        str(args.hidden),
        "--threads",
        str(args.threads),
        "--chunk-cells",
        str(args.chunk_cells),
    ]
    for k, v in extra.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    return cmd


def child_env(threads: int) -> dict:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "NUMBA_NUM_THREADS": str(threads),
    }


def run_child(args, mode: str, work: Path, **extra) -> dict:
    out = subprocess.run(
        child_cmd(args, mode, work, **extra),
        capture_output=True,
        text=True,
        env=child_env(args.threads),
    )
    if out.returncode != 0:
        raise SystemExit(f"{mode} child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def pss_kb(pid: int) -> tuple[int, int]:
    """(Pss, Pss_Anon) of a process in kB from /proc/PID/smaps_rollup; (0, 0) once it is gone.

    Pss_Anon is the process's own memory (model, optimizer, batches, tables); the rest of its
    PSS is its share of mapped files, mostly the store's pages, shared with the other ranks.
    """
    fields = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                fields[key] = value
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return 0, 0

    def kb(key: str) -> int:
        return int(fields[key].split()[0]) if key in fields else 0

    return kb("Pss"), kb("Pss_Anon")


def run_ranks(args, work: Path) -> dict:
    """Launch the ranks, sample their PSS until they exit -> rank 0's result + memory peaks."""
    from gears.train.distributed import find_free_port

    port = find_free_port()
    procs = [
        subprocess.Popen(
            child_cmd(args, "train", work, rank=r, port=port),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(args.threads),
        )
        for r in range(args.nproc)
    ]
    rank_peak, rank_anon_peak = [0] * args.nproc, [0] * args.nproc
    node_peak = node_anon_peak = 0
    outputs: list = [None] * args.nproc

    def drain(i: int) -> None:
        outputs[i] = procs[i].communicate()

    readers = [threading.Thread(target=drain, args=(i,), daemon=True) for i in range(args.nproc)]
    for t in readers:
        t.start()
    while any(p.poll() is None for p in procs):
        sample = [pss_kb(p.pid) for p in procs]
        rank_peak = [max(a, b[0]) for a, b in zip(rank_peak, sample, strict=True)]
        rank_anon_peak = [max(a, b[1]) for a, b in zip(rank_anon_peak, sample, strict=True)]
        node_peak = max(node_peak, sum(s[0] for s in sample))
        node_anon_peak = max(node_anon_peak, sum(s[1] for s in sample))
        time.sleep(0.2)
    for t in readers:
        t.join()
    for p, (_, err) in zip(procs, outputs, strict=True):
        if p.returncode != 0:
            raise SystemExit(f"a training rank failed:\n{err[-3000:]}")
    result = json.loads(outputs[0][0].strip().splitlines()[-1])
    result["rank_peak_pss_gb"] = [kb * 1024 / GB for kb in rank_peak]
    result["node_peak_pss_gb"] = node_peak * 1024 / GB
    result["rank_peak_pss_anon_gb"] = [kb * 1024 / GB for kb in rank_anon_peak]
    result["node_peak_pss_anon_gb"] = node_anon_peak * 1024 / GB
    return result


def free_gb() -> float:
    with open("/proc/meminfo") as fh:
        info = {line.split(":")[0]: int(line.split()[1]) for line in fh}
    return info["MemAvailable"] * 1024 / GB


def main_scale(args) -> dict:
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_scale_", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    print(
        f"machine: {os.cpu_count()} cores, {free_gb():.1f} GB available, load "
        f"{os.getloadavg()[0]:.1f}; workdir {work}",
        flush=True,
    )
    try:
        res: dict = {
            "cells": args.cells,
            "genes": args.genes,
            "perts": args.perts,
            "density": args.density,
            "nproc": args.nproc,
            "batch": args.batch,
            "hidden": args.hidden,
            "threads": args.threads,
            "steps": args.steps,
        }
        t0 = time.perf_counter()
        if not (work / "screen.h5ad").exists():
            res.update(
                write_screen(work / "screen.h5ad", args.cells, args.genes, args.perts, args.density)
            )
        res["input_gb"] = (work / "screen.h5ad").stat().st_size / GB
        write_gene2go(work / "gene2go.tsv", args.genes, args.perts)
        print(
            f"write: {time.perf_counter() - t0:.1f}s, {res['input_gb']:.2f} GB on disk", flush=True
        )
        res.update(run_child(args, "process", work))
        res["store_gb"] = (
            sum(f.stat().st_size for f in (work / "data").rglob("store/*/*") if f.is_file()) / GB
        )
        print(
            f"process: {res['process_s']:.1f}s, peak RSS {res['process_peak_rss_gb']:.2f} GB, "
            f"{res['layout']} store, {res['conditions']} conditions",
            flush=True,
        )
        res.update(run_child(args, "graphs", work))
        print(
            f"graphs: {res['graph_s']:.1f}s, peak RSS {res['graph_peak_rss_gb']:.2f} GB "
            f"({res['coexpress_edges']} co-expression edges, {res['train_examples']} "
            "training cells)",
            flush=True,
        )
        if args.nproc > 0:
            res.update(run_ranks(args, work))
            print(
                f"train ({args.nproc} ranks, batch {args.batch}/rank, {args.steps} steps): "
                f"{res['train_cells_per_s']:.0f} cells/s, projected epoch "
                f"{res['projected_epoch_s']:.0f}s; rank peak PSS "
                f"{', '.join(f'{g:.2f}' for g in res['rank_peak_pss_gb'])} GB (own memory "
                f"{', '.join(f'{g:.2f}' for g in res['rank_peak_pss_anon_gb'])} GB), node "
                f"peak {res['node_peak_pss_gb']:.2f} GB (store on disk "
                f"{res['store_gb']:.2f} GB)",
                flush=True,
            )
        if args.gather:
            res.update(run_child(args, "gather", work, gather=args.gather))
            g = res["gather_batches_per_s"]
            print(
                f"loader only, batch {args.batch}: in memory {g['memory']:.0f} batches/s, "
                f"memory-mapped {g['mmap_warm']:.0f} (first touch {g['mmap_cold']:.0f})",
                flush=True,
            )
        if args.compare_memory:
            rates = {}
            for mode in ("memory", "mmap", "memory", "mmap"):  # interleaved against drift
                r = run_child(args, "train", work, store_mode=mode, nproc=1)
                rates.setdefault(mode, []).append(r["train_cells_per_s"])
            res["memory_vs_mmap_cells_per_s"] = {m: max(v) for m, v in rates.items()}
            ratio = (
                res["memory_vs_mmap_cells_per_s"]["mmap"]
                / res["memory_vs_mmap_cells_per_s"]["memory"]
            )
            res["mmap_over_memory"] = ratio
            print(
                f"1 process: in memory {max(rates['memory']):.0f} cells/s, memory-mapped "
                f"{max(rates['mmap']):.0f} cells/s (ratio {ratio:.2f})",
                flush=True,
            )
        res["load_after"] = os.getloadavg()[0]
        return res
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


def main_memory_table(args) -> list[dict]:
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_scale_mem_", dir="/tmp"))
    rows = []
    try:
        print(
            f"peak memory of training at {args.genes} genes, hidden {args.hidden}, fp32, "
            f"CPU, {args.steps} steps (fresh process per batch size)"
        )
        print(f"{'batch':>6} {'peak RSS GB':>12} {'after build GB':>15} {'cells/s':>9}")
        for batch in args.batches:
            r = run_child(args, "memory", work, batch=batch)
            rows.append(r)
            print(
                f"{batch:>6} {r['peak_rss_gb']:>12.2f} {r['before_train_gb']:>15.2f} "
                f"{r['cells_per_s']:>9.1f}",
                flush=True,
            )
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return rows


def main() -> None:
    args = parse_args()
    if args.child is not None:
        work = Path(args.workdir)
        fn = {
            "process": child_process,
            "graphs": child_graphs,
            "train": child_train,
            "gather": child_gather,
            "memory": lambda a, w: child_memory_table(a),
        }[args.child]
        out = fn(args, work)
        if out is not None:
            print(json.dumps(out), flush=True)
        return
    result = main_memory_table(args) if args.memory_table else main_scale(args)
    if args.json:
        from provenance import provenance

        Path(args.json).write_text(json.dumps({**provenance(), **result}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    from gears.cli.exiting import run_and_exit  # exits once done, whatever threads are left

    run_and_exit(main)
