"""Training and evaluation throughput of the engine beside the bare per-cell bound, in one run.

python benchmarks/bench_train.py --genes 1000 --hidden 64 --batch 32 --threads 1
python benchmarks/bench_train.py --quick          # smoke run, < 60 s

Every ratio printed is between numbers measured side by side in this process (same data, same
threads, same load), never against a figure from another run; the one exception, cell-gears when
it is not installed, is printed as a labelled reference figure.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CELL_GEARS_REFERENCE = 210  # cells/s, DESIGN.md section 3 (cell-gears 0.1.2, G=1000, H=64, B=32)
GROUP_CELLS = 4  # grouped batching: batch / 4 perturbations x 4 cells
ENGINE_CONFIGS = [
    ("random", "fp32"),
    ("random", "bf16"),
    ("grouped", "fp32"),
    ("grouped", "bf16"),
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--genes", type=int, default=1000)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=None, help="timed steps per repeat (default 25)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats, median reported")
    p.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads")
    p.add_argument("--singles", type=int, default=150)
    p.add_argument("--doubles", type=int, default=100)
    p.add_argument("--cells-per-condition", type=int, default=50)
    p.add_argument("--quick", action="store_true", help="small and short: a smoke test (< 60 s)")
    p.add_argument("--no-memory", action="store_true", help="skip the per-config subprocesses")
    p.add_argument(
        "--profile", action="store_true", help="torch.profiler top ops of three engine configs"
    )
    p.add_argument(
        "--wait-load",
        type=float,
        default=None,
        help="before measuring, wait (up to 15 min) for the 1-min load average to fall below this",
    )
    p.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # fresh-process child mode
    args = p.parse_args(argv)
    if args.quick:
        args.genes = min(args.genes, 300)
        args.singles, args.doubles = min(args.singles, 40), min(args.doubles, 30)
        args.cells_per_condition = min(args.cells_per_condition, 20)
    args.steps = args.steps or (5 if args.quick else 25)
    args.repeats = args.repeats or (1 if args.quick else 5)
    return args


# Threads must be fixed before torch starts its OpenMP pool.
ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)
    os.environ["MKL_NUM_THREADS"] = str(ARGS.threads)
    # scanpy's DE step runs numba kernels whose OpenMP layer calls omp_set_num_threads(
    # NUMBA_NUM_THREADS) on the libgomp torch shares: unpinned, it silently switches torch to
    # every core (see also set_threads after the data build).
    os.environ["NUMBA_NUM_THREADS"] = str(min(ARGS.threads, os.cpu_count() or 1))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(ROOT))
from gears.train.runtime import tune_allocator  # noqa: E402


# --------------------------------------------------------------------------------------- data
def set_threads(threads: int) -> None:
    """Pin torch's (and numba's) threads with the project's helper, and check that nothing
    changed them behind our back."""
    from gears.train.runtime import set_threads as pin_threads

    if pin_threads(threads) != threads:
        raise RuntimeError(f"torch runs {torch.get_num_threads()} threads, asked for {threads}")


def build_data(args, data_dir: Path):
    """Synthetic screen via PertData (which writes its own gene2go), simulation split."""
    from gears.data.pertdata import PertData

    params = dict(
        n_genes=args.genes,
        n_single=args.singles,
        n_double=args.doubles,
        cells_per_condition=args.cells_per_condition,
        n_control_cells=1000 if not args.quick else 300,
        n_modules=max(2, min(12, args.genes // 20)),
        seed=0,
    )
    pert_data = PertData(data_dir, verbose=False).load("synthetic", synthetic_params=params)
    pert_data.prepare_split("simulation", seed=1)
    return pert_data


def build_net(pert_data, hidden: int) -> torch.nn.Module:
    from gears.compat.api import GEARS

    torch.manual_seed(0)
    return GEARS(pert_data, device="cpu").model_initialize(hidden_size=hidden).model


# ------------------------------------------------------------------------- bare per-cell bound
class BareCellLayers(nn.Module):
    """Only GEARS's per-cell layers, each cell its own row, native BatchNorm1d.

    forward(h [B*G, H]) -> [B, G]: BN -> ReLU -> MLP [H, 2H, H] -> per-gene decoder ->
    cross-gene MLP [G, H, H] -> second per-gene decoder (no embeddings, graphs, or dedup).
    """

    def __init__(self, genes: int, hidden: int):
        super().__init__()
        G, H = genes, hidden
        self.genes = G
        self.bn_in = nn.BatchNorm1d(H)
        self.recovery = nn.Sequential(
            nn.Linear(H, 2 * H), nn.BatchNorm1d(2 * H), nn.ReLU(),
            nn.Linear(2 * H, H), nn.BatchNorm1d(H),
        )  # fmt: skip
        self.cross = nn.Sequential(
            nn.Linear(G, H), nn.BatchNorm1d(H), nn.ReLU(), nn.Linear(H, H), nn.BatchNorm1d(H)
        )
        self.w1 = nn.Parameter(torch.randn(G, H) * 0.1)
        self.b1 = nn.Parameter(torch.zeros(G))
        self.w2 = nn.Parameter(torch.randn(G, H + 1) * 0.1)
        self.b2 = nn.Parameter(torch.zeros(G))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        rows = h.shape[0] // self.genes
        out = self.recovery(torch.relu(self.bn_in(h))).reshape(rows, self.genes, -1)
        w = (out * self.w1).sum(-1) + self.b1  # [B, G]
        cross = self.cross(w)  # [B, H]
        return w * self.w2[:, 0] + cross @ self.w2[:, 1:].t() + self.b2


def bare_runner(genes: int, hidden: int, rows: int, precision: str, steps: int = 1, device="cpu"):
    """A closure doing `steps` forward + backward + Adam steps of BareCellLayers on `rows` rows
    -> the cells they stand for (`rows` per step). Adam runs the engine's kernel (fused on CPU
    and CUDA), so the bound is no slower than the engine where both do the same work; fp16
    (CUDA) steps through a GradScaler, as the engine's do. On CUDA the closure does not
    synchronise: the caller times it between synchronisations."""
    from gears.train.engine import autocast_dtype, optimizer_kernel

    device = torch.device(device)
    torch.manual_seed(0)
    model = BareCellLayers(genes, hidden).to(device)
    kernel = optimizer_kernel("adam", device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=5e-4, **kernel)
    h = torch.randn(rows * genes, hidden, device=device)
    y = torch.randn(rows, genes, device=device)
    dtype = autocast_dtype(precision, device)
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)

    def run() -> int:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                pred = model(h)
            loss = torch.nn.functional.mse_loss(pred.float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return rows * steps

    return run


def make_trainer(
    pert_data, net, args, batching: str, precision: str, device="cpu", tf32: bool = False
):
    """The engine's Trainer and training loader for one configuration. On CUDA the loader keeps
    the expression matrix on the GPU when it fits (the path train_single.py takes)."""
    from gears.config import ModelConfig, TrainConfig
    from gears.train.distributed import DistEnv
    from gears.train.engine import Trainer

    device = torch.device(device)
    cfg = TrainConfig(
        epochs=1,
        batch_size=args.batch,
        precision=precision,
        tf32=tf32,
        batching=batching,
        cells_per_group=GROUP_CELLS,
        limit_batches=args.steps,
    )
    env = DistEnv(device=device)
    trainer = Trainer(net, pert_data, cfg, ModelConfig(hidden_size=args.hidden), env)
    loader = pert_data.get_dataloader(
        args.batch,
        128,
        batching=batching,
        cells_per_group=GROUP_CELLS,
        device=device,
        pin_memory=device.type == "cuda",
    )["train_loader"]
    if len(loader) < args.steps:
        raise SystemExit(f"only {len(loader)} {batching} batches per epoch; lower --steps")
    return trainer, loader


def engine_runner(
    pert_data, net0, args, batching: str, precision: str, device="cpu", tf32: bool = False
):
    """A closure running Trainer.train_epoch on `steps` real batches -> cells trained."""
    trainer, loader = make_trainer(
        pert_data, copy.deepcopy(net0), args, batching, precision, device, tf32
    )
    epoch = iter(range(1, 1 << 30))

    def run() -> int:
        return trainer.train_epoch(loader, next(epoch), progress=False)[1]

    return run


def distinct_per_batch(pert_data, args, batching: str) -> tuple[float, float]:
    """(mean distinct perturbations per batch, ms per batch of the loader alone)."""
    loader = pert_data.get_dataloader(
        args.batch, 128, batching=batching, cells_per_group=GROUP_CELLS
    )["train_loader"]
    loader.set_epoch(1)
    distinct, t0 = [], time.perf_counter()
    for i, batch in enumerate(loader):
        if i == args.steps:
            break
        distinct.append(len(batch.uniq_cond))
    return float(np.mean(distinct)), 1e3 * (time.perf_counter() - t0) / len(distinct)


def measure_interleaved(runners: dict, repeats: int) -> dict:
    """Median seconds per call of each runner; repeats interleave the runners, so a change of
    machine load during the run hits every configuration alike instead of biasing one ratio."""
    for run in runners.values():
        run()  # warm-up
    seconds = {k: [] for k in runners}
    for _ in range(repeats):
        for key, run in runners.items():
            t0 = time.perf_counter()
            run()
            seconds[key].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in seconds.items()}


# ----------------------------------------------------------------------------- peak memory
def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child_main(args) -> None:
    """One configuration in a fresh process: peak RSS over warm-up + timed steps, and the
    steps' cells/s with the allocator state of a fresh training process."""
    spec = json.loads(args.child)
    tune_allocator()
    set_threads(args.threads)
    warm = 5
    if spec["kind"] == "bare":
        warm_up = bare_runner(args.genes, args.hidden, args.batch, spec["precision"], warm)
        timed = bare_runner(args.genes, args.hidden, args.batch, spec["precision"], args.steps)
    else:
        state = torch.load(spec["state"], weights_only=False)
        set_threads(args.threads)
        trainer, loader = make_trainer(
            state["pert_data"], state["net"], args, spec["batching"], spec["precision"]
        )

        def warm_up():
            trainer.cfg.limit_batches = warm
            trainer.train_epoch(loader, 0, progress=False)

        def timed():
            trainer.cfg.limit_batches = args.steps
            return trainer.train_epoch(loader, 1, progress=False)[1]

    # Reset the kernel's high-water mark (VmHWM) to the current RSS: what follows is training.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kb("VmRSS")
    warm_up()
    t0 = time.perf_counter()
    cells = timed()
    rate = cells / (time.perf_counter() - t0)
    print(
        json.dumps(
            {
                "before_mb": before / 1024,
                "peak_mb": _status_kb("VmHWM") / 1024,
                "cells_per_s": rate,
            }
        )
    )


def fresh_process(args, spec: dict) -> dict | None:
    """Run child_main in a subprocess (same threads and sizes) and read its JSON line."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    cmd += ["--genes", str(args.genes), "--hidden", str(args.hidden), "--batch", str(args.batch)]
    cmd += ["--threads", str(args.threads), "--steps", str(args.steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        print(f"  subprocess failed for {spec}: {out.stderr.strip()[-300:]}")
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------- evaluation
def per_cell_means(pert_data, net, cond_ids) -> tuple[torch.Tensor, int]:
    """GEARS's way: the network on every test cell (batches of 128, one row per cell), then
    the mean per perturbation. -> ([len(cond_ids), G] float64, cells)"""
    loader = pert_data.get_dataloader(32, 128)["test_loader"]
    sums = torch.zeros(len(pert_data.conditions), pert_data.n_genes, dtype=torch.float64)
    n = torch.zeros(len(pert_data.conditions), dtype=torch.float64)
    from gears.model.batch import ModelBatch

    was_training = net.training
    net.eval()
    cells = 0
    with torch.no_grad():
        for batch in loader:
            pred = net(ModelBatch(batch.pert_index)) + batch.x  # eval-mode batch-norm: per row
            sums.index_add_(0, batch.cond, pred.double())
            n.index_add_(0, batch.cond, torch.ones(len(batch), dtype=torch.float64))
            cells += len(batch)
    net.train(was_training)
    ids = torch.as_tensor(cond_ids)
    return sums[ids] / n[ids, None], cells


def evaluation_comparison(pert_data, net) -> dict:
    from gears.train.distributed import DistEnv
    from gears.train.evaluate import Evaluator

    # Paired controls, like per-cell evaluation, so the two give the same means.
    ev = Evaluator(pert_data, DistEnv(), net, control_mean="paired")
    t0 = time.perf_counter()
    ev.quick("test")  # cold: builds the cached test view (truth means, paired controls)
    quick_cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    ours = ev.predict_means("test")
    predict_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ev.quick("test")
    quick_s = time.perf_counter() - t0
    ev.full("test")  # first call caches the top-variable genes
    t0 = time.perf_counter()
    ev.full("test")
    full_s = time.perf_counter() - t0

    view = ev.set_view("test")
    t0 = time.perf_counter()
    theirs, cells = per_cell_means(pert_data, net, view["cond_ids"])
    per_cell_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ev.full("test", pred_mean=theirs.numpy())  # the same metrics on the per-cell means
    metrics_s = time.perf_counter() - t0
    metrics_quick_s = max(quick_s - predict_s, 0.0)
    return {
        "conditions": len(view["conditions"]),
        "cells": cells,
        "predict": (predict_s, per_cell_s),
        "quick": (quick_s, per_cell_s + metrics_quick_s),
        "full": (full_s, per_cell_s + metrics_s),
        "quick_cold": quick_cold,
        "max_abs_diff": float((torch.as_tensor(ours) - theirs).abs().max()),
    }


# ------------------------------------------------------------------------------- cell-gears
CELL_GEARS_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    import anndata, torch
    torch.set_num_threads({threads})
    # The cell-gears package: this process runs outside the project tree (python -P, cwd=work).
    from gears import GEARS, PertData
    from gears.utils import loss_fct
    work = {work!r}
    adata = anndata.read_h5ad(os.path.join(work, "screen.h5ad"))
    pd_ = PertData(work, default_pert_graph=False)  # gene2go_all.pkl is there: no download
    pd_.new_data_process("bench", adata)
    pd_.prepare_split("simulation", seed=1)
    pd_.get_dataloader({batch}, 128)
    # GEARS() indexes X with a boolean Series, which CSR rejects in current scipy: dense for
    # that call only (its co-expression step wants CSR back).
    X = pd_.adata.X
    pd_.adata.X = X.toarray()
    device = {device!r}
    model = GEARS(pd_, device=device)
    pd_.adata.X = X
    model.model_initialize(hidden_size={hidden})
    net = model.model
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, weight_decay=5e-4)
    net.train()

    def run(n):  # the body of cell-gears's GEARS.train loop, without its per-epoch evaluation
        cells = 0
        for step, batch in enumerate(pd_.dataloader["train_loader"]):
            if step == n:
                break
            batch = batch.to(device)  # as its train loop does (a no-op on the CPU)
            opt.zero_grad()
            pred = net(batch)
            loss = loss_fct(pred, batch.y, batch.pert, ctrl=model.ctrl_expression,
                            dict_filter=model.dict_filter, direction_lambda=0.1)
            loss.backward()
            torch.nn.utils.clip_grad_value_(net.parameters(), clip_value=1.0)
            opt.step()
            cells += batch.num_graphs
        return cells

    torch.set_num_threads({threads})  # its DE step (scanpy -> numba) may have reset them
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    run(3)
    rates = []
    for _ in range({repeats}):
        sync()
        t0 = time.perf_counter()
        cells = run({steps})
        sync()
        rates.append(cells / (time.perf_counter() - t0))
    print(json.dumps({{"cells_per_s": sorted(rates)[len(rates) // 2],
                      "threads": torch.get_num_threads()}}))
    """
)


def cell_gears_throughput(
    pert_data, args, work: Path, python: str | None = None, device: str = "cpu"
) -> tuple[str, float | None]:
    """cell-gears's own training loop on the same screen, when `python` (default: this one)
    has the package: (status, cells/s or None). device: where its model trains."""
    python = python or sys.executable
    probe = subprocess.run(
        [python, "-P", "-c", "import importlib.metadata as m; print(m.version('cell-gears'))"],
        cwd=work,
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        return "not installed", None
    version = probe.stdout.strip()
    import pickle

    import anndata
    import pandas as pd

    # Its input format: obs condition + cell_type, var gene_name; it computes DE genes itself.
    adata = anndata.AnnData(
        X=pert_data.adata.X,
        obs=pd.DataFrame(
            {
                "condition": pert_data.adata.obs["condition"].astype(str).values,
                "cell_type": "synthetic",
            },
            index=pert_data.adata.obs_names,
        ),
        var=pd.DataFrame(
            {"gene_name": list(pert_data.gene_names)}, index=list(pert_data.gene_names)
        ),
    )
    adata.write_h5ad(work / "screen.h5ad")
    with open(work / "gene2go_all.pkl", "wb") as f:
        pickle.dump({g: set(t) for g, t in pert_data.gene2go.items()}, f)
    # Its custom GO graph is a Python pair loop over a 25-process pool (minutes at 1,000 genes);
    # give it ours in its own file format (./data/go_essential_<name>.csv) so only its training
    # loop is timed. The graph's content does not change the cost of a step.
    go = pert_data.go_graph()
    names = np.asarray(pert_data.pert_names)
    (work / "data").mkdir(exist_ok=True)
    pd.DataFrame(
        {
            "source": names[go.edge_index[0].numpy()],
            "target": names[go.edge_index[1].numpy()],
            "importance": go.edge_weight.numpy(),
        }
    ).to_csv(work / "data" / "go_essential_bench.csv", index=False)
    script = CELL_GEARS_SCRIPT.format(
        threads=args.threads,
        work=str(work),
        batch=args.batch,
        hidden=args.hidden,
        steps=args.steps,
        repeats=args.repeats,
        device=device,
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # -P and a neutral cwd: `import gears` must find cell-gears, not this project.
    out = subprocess.run(
        [python, "-P", "-c", script],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if out.returncode != 0:
        return f"{version} installed but its loop failed: {out.stderr.strip()[-300:]}", None
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return f"{version} ({result['threads']} torch threads)", result["cells_per_s"]


# ---------------------------------------------------------------------------------- profile
def profile_engine(pert_data, net0, args, batching="random", precision="fp32") -> None:
    from torch.profiler import ProfilerActivity, profile

    trainer, loader = make_trainer(pert_data, copy.deepcopy(net0), args, batching, precision)
    trainer.cfg.limit_batches = 5
    trainer.train_epoch(loader, 0, progress=False)
    trainer.cfg.limit_batches = min(args.steps, 20)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.train_epoch(loader, 1, progress=False)
    print(f"\ntorch.profiler, engine {batching} {precision}, {trainer.cfg.limit_batches} steps:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


# ------------------------------------------------------------------------------------- main
def load_average() -> str:
    return "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def wait_for_quiet(max_load: float | None, timeout_s: float = 900) -> None:
    """Sleep until the 1-min load average is below max_load (the machine is shared)."""
    if max_load is None:
        return
    t0 = time.perf_counter()
    while os.getloadavg()[0] > max_load and time.perf_counter() - t0 < timeout_s:
        time.sleep(10)
    print(f"waited {time.perf_counter() - t0:.0f}s for load < {max_load}: now {load_average()}")


def json_figures(threads: int, rate: dict, B: int, U: int, cell_gears: float | None) -> dict:
    """The --json document: cells/s medians, the bounds beside the engine's figures."""
    from provenance import provenance

    return {
        **provenance(),
        "threads": threads,
        "bound": {p: rate[("bare", p, B)] for p in ("fp32", "bf16")},
        "dedup_bound": {p: rate[("bare", p, U)] for p in ("fp32", "bf16")},
        "engine": {f"{b}_{p}": rate[(b, p)] for b, p in ENGINE_CONFIGS},
        "cell_gears": cell_gears,
    }


def main(args) -> None:
    if args.child is not None:
        return child_main(args)
    # glibc keeps freed activations (no per-step page faults) for the bound and engine alike.
    allocator = "tuned" if tune_allocator() else "default"
    set_threads(args.threads)
    t_start = time.perf_counter()
    print(
        f"bench_train: genes {args.genes}, hidden {args.hidden}, batch {args.batch}, "
        f"threads {args.threads} (torch {torch.get_num_threads()}, OMP_NUM_THREADS "
        f"{os.environ.get('OMP_NUM_THREADS')}), steps {args.steps} x {args.repeats} repeats"
        f"{', quick' if args.quick else ''}; torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"allocator {allocator}"
    )
    print(f"load average at start: {load_average()} (numbers are unreliable above ~1.5)")
    sections = {}
    with tempfile.TemporaryDirectory(prefix="gears_bench_") as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        pert_data = build_data(args, tmp / "data")
        net = build_net(pert_data, args.hidden)
        set_threads(args.threads)  # the data build may have changed them (scanpy -> numba)
        n_train = len(pert_data.example_set("train"))
        sections["data"] = time.perf_counter() - t0
        print(
            f"data: {pert_data.adata.n_obs} cells, {len(pert_data.conditions) - 1} perturbations "
            f"({args.singles} singles + {args.doubles} doubles), {n_train} training examples; "
            f"built in {sections['data']:.1f}s"
        )
        wait_for_quiet(args.wait_load)
        load_before = load_average()

        # 1 + 2. The bare per-cell bound (and the same layers on the rows of a deduplicated
        # grouped batch) and the engine on real loaders, timed in interleaved repeats.
        t0 = time.perf_counter()
        B, U = args.batch, args.batch // GROUP_CELLS
        runners = {}
        for precision in ("fp32", "bf16"):
            for rows in (B, U):
                runners[("bare", precision, rows)] = bare_runner(
                    args.genes, args.hidden, rows, precision, args.steps
                )
        for batching, precision in ENGINE_CONFIGS:
            runners[(batching, precision)] = engine_runner(
                pert_data, net, args, batching, precision
            )
        seconds = measure_interleaved(runners, args.repeats)
        threads_used = torch.get_num_threads()
        # Cells per second; the U-row bare runs stand for B cells each (a deduplicated batch).
        rate = {k: B * args.steps / v for k, v in seconds.items()}
        batch_stats = {b: distinct_per_batch(pert_data, args, b) for b in ("random", "grouped")}
        load_mid = load_average()
        sections["training"] = time.perf_counter() - t0

        # 3. Peak memory (and cells/s as a fresh training process sees it), one subprocess per
        # configuration.
        t0 = time.perf_counter()
        memory = {}
        if not args.no_memory:
            state = tmp / "state.pt"
            torch.save({"pert_data": pert_data, "net": net}, state)
            specs = [(("bare", p), {"kind": "bare", "precision": p}) for p in ("fp32", "bf16")]
            specs += [
                ((b, p), {"kind": "engine", "batching": b, "precision": p, "state": str(state)})
                for b, p in ENGINE_CONFIGS
            ]
            if args.quick:
                specs = specs[2:3]  # engine, random, fp32
            for key, spec in specs:
                memory[key] = fresh_process(args, spec)
        sections["memory"] = time.perf_counter() - t0

        # 4. Evaluation: per perturbation versus per cell.
        set_threads(args.threads)
        t0 = time.perf_counter()
        ev = evaluation_comparison(pert_data, net)
        sections["evaluation"] = time.perf_counter() - t0

        # 5. cell-gears, when installed.
        t0 = time.perf_counter()
        status, cg_rate = cell_gears_throughput(pert_data, args, tmp)
        sections["cell-gears"] = time.perf_counter() - t0

    # ---------------------------------------------------------------------------- report
    def fresh(key, ref_key) -> tuple[str, str]:
        m, ref = memory.get(key), memory.get(ref_key)
        if not m:
            return "-", "-"
        peak = f"{m['peak_mb']:.0f} (+{m['peak_mb'] - m['before_mb']:.0f})"
        ratio = f"{m['cells_per_s']:.0f}" + (
            f" ({m['cells_per_s'] / ref['cells_per_s']:.2f})" if ref else ""
        )
        return ratio, peak

    print(
        f"\ntraining throughput (G={args.genes}, H={args.hidden}, batch {B}, torch threads "
        f"{threads_used}, load {load_before} -> {load_mid}); x bound = cells/s over the bare "
        "per-cell bound of the same precision"
    )
    print(
        f"{'configuration':<44}{'prec':>5}{'cells/s':>9}{'x bound':>9}{'perts/batch':>12}"
        f"{'fresh proc (x)':>16}{'peak RSS MB (+train)':>22}"
    )
    rows = []
    for precision in ("fp32", "bf16"):
        ref = rate[("bare", precision, B)]
        rows.append(
            (f"bare per-cell layers bound ({B} rows)", precision, ref, ref, B)
            + fresh(("bare", precision), ("bare", precision))
        )
        rows.append(
            (f"bare layers on {U} rows (deduplicated bound)", precision)
            + (rate[("bare", precision, U)], ref, U, "-", "-")
        )
    for batching, precision in ENGINE_CONFIGS:
        name = "engine, random batches"
        if batching == "grouped":
            name = f"engine, grouped ({U} perts x {GROUP_CELLS} cells)"
        rows.append(
            (name, precision, rate[(batching, precision)], rate[("bare", precision, B)])
            + (batch_stats[batching][0],)
            + fresh((batching, precision), ("bare", precision))
        )
    for name, precision, value, ref, distinct, fresh_rate, peak in rows:
        print(
            f"{name:<44}{precision:>5}{value:>9.0f}{value / ref:>9.2f}{distinct:>12.1f}"
            f"{fresh_rate:>16}{peak:>22}"
        )
    print(
        "perts/batch: distinct perturbations per batch (mean over the timed batches); the "
        "engine runs the network once per distinct perturbation. The U-row bound counts the "
        f"{B} cells its {U} rows stand for."
    )
    for batching in ("random", "grouped"):
        load_ms = batch_stats[batching][1]
        step_ms = 1e3 * seconds[(batching, "fp32")] / args.steps
        print(
            f"data loading ({batching}): {load_ms:.1f} ms of the engine's {step_ms:.1f} ms "
            f"fp32 step ({100 * load_ms / step_ms:.0f}%)"
        )
    if memory:
        print(
            "fresh proc: the same steps timed in a new process per configuration that loads "
            "data and model from a file (sequential, after 5 warm-up steps; ratio to the fresh "
            "bound in brackets). It differs from the interleaved columns by allocator history: "
            "large arrays freed earlier (data build, other configurations) raise glibc's mmap "
            "threshold, so later activations reuse heap pages instead of page-faulting new "
            "ones.\n"
            "peak RSS: kernel high-water mark (VmHWM) of that process, reset through "
            "/proc/self/clear_refs just before training; (+train) = peak minus the RSS before "
            "the first step (data and model already loaded)."
            + (" --quick measures one configuration." if args.quick else "")
        )
    else:
        print("peak RSS: not measured (--no-memory)")

    print(
        f"\nevaluation on {ev['conditions']} test perturbations ({ev['cells']} cells), same "
        "network; per-cell = the network on every test cell, one row per cell, batches of 128, "
        "then means per perturbation (cell-gears's way)"
    )
    print(f"{'':<42}{'ours s':>10}{'per-cell s':>12}{'ratio':>9}")
    labels = {
        "predict": "mean predictions",
        "quick": "quick('test') (+ 4 metrics)",
        "full": "full('test') (+ all GEARS metrics)",
    }
    for key, label in labels.items():
        ours, theirs = ev[key]
        print(f"{label:<42}{ours:>10.3f}{theirs:>12.3f}{theirs / ours:>8.0f}x")
    print(
        f"(target ratio >= 50x; quick('test') cold, building its cached view: "
        f"{ev['quick_cold']:.3f}s; per-cell columns reuse our metric code on per-cell means)"
    )
    print(f"max |mean prediction ours - per-cell| = {ev['max_abs_diff']:.2e}")

    if cg_rate is None:
        print(
            f"\ncell-gears: not measured ({status}). Reference figure, NOT measured here: "
            f"DESIGN.md reports ~{CELL_GEARS_REFERENCE} cells/s for cell-gears 0.1.2 at "
            "G=1000, H=64, batch 32 on this machine."
        )
    else:
        ours = rate[("random", "fp32")]
        print(
            f"\ncell-gears {status}: {cg_rate:.0f} cells/s (its own training step on its "
            f"PyG loader, same screen, batch {B}, fp32, measured after ours); engine random "
            f"fp32 = {ours / cg_rate:.1f}x cell-gears"
        )
    if args.profile:
        for batching, precision in (("random", "fp32"), ("grouped", "fp32"), ("random", "bf16")):
            profile_engine(pert_data, net, args, batching, precision)
    # The benchmark itself adds about `threads` to the load while it trains.
    before, during = float(load_before.split()[0]), float(load_mid.split()[0])
    if before > 1.5 or during > 1.5 + args.threads:
        print(
            f"\nWARNING: 1-min load average {before:.2f} before / {during:.2f} after the "
            "training measurements: the machine was shared and these numbers are unreliable."
        )
    if args.json:
        figures = json_figures(threads_used, rate, B, U, cg_rate)
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
        print(f"figures written to {args.json}")
    took = ", ".join(f"{k} {v:.0f}s" for k, v in sections.items())
    print(
        f"\nload average at end: {load_average()}; time: {took}; "
        f"total {time.perf_counter() - t_start:.0f}s"
    )


if __name__ == "__main__":
    from gears.cli.exiting import run_and_exit  # exits once done, whatever threads are left

    run_and_exit(lambda: main(ARGS))
