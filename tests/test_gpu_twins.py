"""CPU twins of the GPU and cluster paths (GPU_REVIEW.md defects 1, 3, 4, 7, 8, 11, 12, 13, 14):
device choice per rank, resuming files written on another device, DDP's broadcast list, rank
-independent evaluation, rank-0 work beyond the collective timeout, Slurm launch variables.
What only a real GPU can show is listed in docs/gpus_and_clusters.md."""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import zipfile
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from helpers import TINY, join_local_gloo
from test_distributed import TINY_RUN, _env, _launch, _metrics, clean_launch_env  # noqa: F401
from test_engine import ListLoader, build, group_batches

from gears.cli.job import load_pert_data
from gears.cli.launch import batch_script_note, launched_externally
from gears.config import Config, DistributedConfig, TrainConfig
from gears.data.pertdata import PertData
from gears.errors import GearsInputError
from gears.train import checkpoint as ckpt
from gears.train.distributed import (
    DistEnv,
    build_in_stages,
    cleanup,
    default_master_port,
    find_free_port,
    resolve_device,
    set_tf32,
    slurm_to_env,
)
from gears.train.engine import (
    Trainer,
    graph_buffer_names,
    optimizer_kernel,
    rng_state,
    set_rng_state,
)
from gears.train.evaluate import predict_deltas
from gears.train.state import TrainState

ROOT = Path(__file__).resolve().parents[1]
GRAPHS = {"go_edge_index", "go_edge_weight", "co_edge_index", "co_edge_weight"}


# ------------------------------------------------------------------ device per rank (4, 12)
def test_cuda_n_with_several_processes_is_refused_before_looking_for_gpus():
    # device_count=0: the contradiction is named, not "no CUDA device".
    for count in (0, 8):
        with pytest.raises(GearsInputError, match=r"device=cuda:1 with 2 processes.*same GPU"):
            resolve_device("cuda:1", local_rank=0, world_size=2, device_count=count)
    assert resolve_device("cuda:1", 0, 1, None, 2) == torch.device("cuda", 1)


def test_short_or_wrong_gpu_ids_name_rank_local_rank_and_ids():
    with pytest.raises(GearsInputError, match=r"rank 5 \(local_rank 1\).*gpu_ids=\[3\]"):
        resolve_device("cuda", local_rank=1, world_size=8, gpu_ids=[3], device_count=0, rank=5)
    with pytest.raises(GearsInputError, match=r"local_rank 1.*names GPU 7.*only 4 GPU"):
        resolve_device("cuda", local_rank=1, world_size=2, gpu_ids=[0, 7], device_count=4)
    with pytest.raises(GearsInputError, match=r"gpu_ids=\[0\] has 1 entries but this node runs 2"):
        resolve_device("cuda", 0, 2, [0], 0, local_world_size=2)
    with pytest.raises(GearsInputError, match="names a GPU twice"):
        resolve_device("cuda", 0, 2, [1, 1], 4)
    with pytest.raises(GearsInputError, match="non-negative"):
        resolve_device("cuda", 0, 2, [0, -1], 4)
    with pytest.raises(GearsInputError, match="4 processes on this node but only 2 GPU"):
        resolve_device("cuda", 3, 4, None, 2, local_world_size=4)
    with pytest.raises(GearsInputError, match="no CUDA device"):
        resolve_device("cuda", 0, 1, None, 0)
    with pytest.raises(GearsInputError, match="only 2 GPU"):
        resolve_device("cuda:2", 0, 1, None, 2)


def test_device_of_each_rank():
    assert resolve_device("cuda", 1, 2, [2, 3], 4) == torch.device("cuda", 3)
    assert resolve_device("auto", 1, 2, [2, 3], 4) == torch.device("cuda", 3)
    # Slurm binding one GPU per task: every task sees one device, local ranks 0..3.
    assert resolve_device("cuda", 3, 8, None, 1) == torch.device("cuda", 0)
    assert resolve_device("cuda", 2, 8, None, 4, local_world_size=4) == torch.device("cuda", 2)
    # No GPU: auto is the CPU, and gpu_ids (for GPU machines) do not matter.
    assert resolve_device("auto", 3, 4, [0], 0) == torch.device("cpu")
    assert resolve_device("cpu", 3, 4, [0], 4) == torch.device("cpu")


def test_gloo_ranks_may_share_a_gpu_nccl_ranks_may_not():
    """Two ranks on one GPU: refused for NCCL (it rejects duplicate GPUs), allowed for gloo,
    which benchmarks/gpu_check.py uses to test 2 processes on a 1-GPU machine."""
    with pytest.raises(GearsInputError, match="2 processes on this node but only 1 GPU"):
        resolve_device("cuda", 1, 2, None, 1, local_world_size=2)
    for local_rank in (0, 1):
        got = resolve_device("cuda", local_rank, 2, None, 1, local_world_size=2, share_gpus=True)
        assert got == torch.device("cuda", 0)


@pytest.mark.slow
def test_launcher_refuses_cuda_0_with_two_processes_in_one_line(tmp_path):
    """`train_distributed.py --nproc 2 device=cuda:0`: exit 2, one line, before any work (the
    other contradictions take the same path; their messages are checked above)."""
    args = ["device=cuda:0"]
    names = ["device=cuda:0", "2 processes"]
    cmd = [sys.executable, str(ROOT / "train_distributed.py"), "--nproc", "2"]
    cmd += [f"out_dir={tmp_path / 'run'}", f"data.data_dir={tmp_path / 'data'}", *args]
    result = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
    for name in names:
        assert name in lines[0]
    assert not (tmp_path / "run").exists()


def test_tf32_is_off_unless_asked_and_only_touches_cuda():
    """fp32 means fp32 by default (train.tf32=false), even after an earlier run in the same
    process switched TF32 on; the CPU has no TF32 and its flags are left alone."""
    assert TrainConfig().tf32 is False
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        torch.set_float32_matmul_precision("high")
        set_tf32(torch.device("cpu"), True)
        set_tf32(torch.device("cpu"), False)
        assert torch.get_float32_matmul_precision() == "high"
        set_tf32(torch.device("cuda", 0), True)  # sets flags only; needs no GPU
        assert torch.get_float32_matmul_precision() == "high"
        assert torch.backends.cudnn.allow_tf32
        set_tf32(torch.device("cuda", 0), TrainConfig().tf32)
        assert torch.get_float32_matmul_precision() == "highest"
        assert not torch.backends.cudnn.allow_tf32
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]


def test_fused_adam_on_cuda_and_cpu_foreach_elsewhere():
    assert optimizer_kernel("adam", torch.device("cuda", 1)) == {"fused": True, "foreach": None}
    assert optimizer_kernel("adamw", torch.device("cuda", 0))["fused"] is True
    assert optimizer_kernel("adam", torch.device("cpu")) == {"fused": True, "foreach": None}
    assert optimizer_kernel("adam", torch.device("meta")) == {"fused": None, "foreach": True}
    assert optimizer_kernel("sgd", torch.device("cuda", 0)) == {"fused": None, "foreach": True}
    assert optimizer_kernel("sgd", torch.device("cpu")) == {"fused": None, "foreach": True}


# ------------------------------------------------------------------------- resume (1, 14)
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[PertData, Path]:
    """A 1-epoch run's checkpoint folder, written through Trainer.save_checkpoint."""
    tmp = tmp_path_factory.mktemp("twins")
    pd_ = PertData(tmp / "data", verbose=False).load("synthetic", synthetic_params=TINY)
    pd_.prepare_split("simulation", seed=1)
    model = build(pd_)
    cfg = TrainConfig(epochs=1, limit_batches=3, schedule="constant", batch_size=32)
    trainer = Trainer(model.model, pd_, cfg, model.model_config(), DistEnv(), out_dir=tmp / "run")
    trainer.fit(pd_.get_dataloader_distributed(32, 64), progress=False)
    return pd_, tmp / "run"


def _trainer(pd_: PertData, out_dir: Path, device: str = "cpu", **kw) -> Trainer:
    model = build(pd_, seed=5)  # other initial weights: resume must replace them
    cfg = TrainConfig(
        **{"epochs": 2, "limit_batches": 3, "schedule": "constant", "batch_size": 32, **kw}
    )
    env = DistEnv(device=torch.device(device))
    return Trainer(model.model, pd_, cfg, model.model_config(), env, out_dir=out_dir)


def _as_written_on_cuda(src: Path, dst: Path, fused: bool = True, planned: bool = False) -> None:
    """`src` as a CUDA process would have written it: every storage tagged cuda:0, the CUDA RNG
    states of two GPUs (the older format) and fused (or foreach) Adam's parameter groups; with
    `planned`, each learning rate the float32 tensor of a planned step (graph_step.tensor_lr)."""
    state = ckpt.load(src)
    state["rng"]["cuda"] = [torch.get_rng_state(), torch.get_rng_state()]
    for group in state["optimizer"]["param_groups"]:
        group.update(fused=True if fused else None, foreach=None if fused else True)
        if planned:
            group["lr"] = torch.tensor(group["lr"], dtype=torch.float32)
    dst.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, dst)
    with zipfile.ZipFile(dst) as z:
        entries = {name: z.read(name) for name in z.namelist()}
    pkl = next(n for n in entries if n.endswith("/data.pkl"))
    cpu = b"X\x03\x00\x00\x00cpu"  # the location string, pickled once and memoised after
    assert entries[pkl].count(cpu) == 1
    entries[pkl] = entries[pkl].replace(cpu, b"X\x06\x00\x00\x00cuda:0")
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as z:
        for name, data in entries.items():
            z.writestr(name, data)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-writer", "foreach-writer"])
def test_checkpoint_written_on_cuda_resumes_on_cpu(tiny_run, tmp_path, fused):
    """Also from a foreach writer (an older checkpoint): the resumed run uses this device's
    kernel, with Adam's step counters where it wants them."""
    pd_, run = tiny_run
    src = ckpt.list_checkpoints(run / "checkpoints")[-1]
    foreign = tmp_path / "checkpoints" / src.name
    _as_written_on_cuda(src, foreign, fused=fused)
    if not torch.cuda.is_available():  # the file really is a CUDA file: plain loading fails
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(foreign, weights_only=False)
    trainer = _trainer(pd_, tmp_path)
    assert trainer.resume()
    want = ckpt.load(src)
    assert (trainer.epoch, trainer.step) == (want["epoch"], want["step"])
    assert trainer.state == TrainState.from_checkpoint(want)
    for k, v in want["model"].items():
        assert torch.equal(trainer.net.state_dict()[k], v), k
    assert torch.equal(torch.get_rng_state(), want["rng"]["torch"])
    for group in trainer.opt.param_groups:  # this device's kernel, not the writer's
        assert (group["fused"], group["foreach"]) == (True, None)
    steps = [s["step"] for s in trainer.opt.state.values()]
    assert steps and all(s.device.type == "cpu" for s in steps)
    trainer.fit({"train_loader": ListLoader(group_batches(pd_, 8, 4, 2))}, progress=False)
    assert trainer.epoch == 2 and all(p.isfinite().all() for p in trainer.net.parameters())


@pytest.mark.parametrize("planned", [False, True], ids=["eager", "planned"])
def test_a_planned_gpu_runs_learning_rate_resumes_as_this_runs_own(tiny_run, tmp_path, planned):
    """A planned GPU run saves each learning rate as a float32 CUDA tensor; resume loads it as a
    CPU tensor. Kept so, a captured step on a GPU read it once, at its capture, and replayed that
    rate after the schedule had halved it (a resumed 2-rank run ended 2.4e-2 from the run that
    never stopped, in its first epoch after the capture). Resumed, the rate is a number, as in a
    fresh run; a planned run then steps with its own tensor (this device, its dtype), which the
    schedule fills in place."""
    pd_, run = tiny_run
    src = ckpt.list_checkpoints(run / "checkpoints")[-1]
    _as_written_on_cuda(src, tmp_path / "checkpoints" / src.name, planned=True)
    trainer = _trainer(pd_, tmp_path)
    trainer.planned = planned  # train.cuda_graphs=null's choice on a GPU (the checkpoint's)
    assert trainer.resume()
    rates = [group["lr"] for group in trainer.opt.param_groups]
    assert all(type(lr) is float for lr in rates), rates
    trainer.fit(pd_.get_dataloader_distributed(32, 64), progress=False)
    assert trainer.epoch == 2 and (trainer.runner is not None) == planned
    if planned:
        for group in trainer.opt.param_groups:
            lr = group["lr"]
            assert torch.is_tensor(lr) and lr.dtype == torch.float64, lr  # tensor_lr's, on CPU
            assert lr.data_ptr() in trainer.runner.storage()


@pytest.mark.filterwarnings("ignore:.*meta parameter")
def test_resume_loads_to_cpu_whatever_the_device(tiny_run):
    """The trainer on `meta` stands in for a GPU: the checkpoint must not be mapped to the
    trainer's device, or the RNG states arrive as non-CPU tensors (`set_rng_state` rejects them,
    as on CUDA)."""
    pd_, run = tiny_run
    trainer = _trainer(pd_, run, device="meta")
    assert trainer.resume()
    assert trainer.epoch == 1


def test_fp32_checkpoint_resumes_with_an_enabled_scaler(tiny_run):
    """An fp32 run saves a disabled GradScaler's empty state; fp16 (CUDA) then resumes with a
    fresh scaler. The enabled CPU scaler stands in for the CUDA one."""
    pd_, run = tiny_run
    assert ckpt.load(ckpt.list_checkpoints(run / "checkpoints")[-1])["scaler"] == {}
    trainer = _trainer(pd_, run)
    trainer.scaler = torch.amp.GradScaler("cpu", enabled=True)
    assert trainer.resume()
    assert trainer.scaler.get_scale() == 2.0**16


def test_rng_state_keeps_only_this_gpus_state():
    state = rng_state(torch.device("cpu"))
    assert "cuda" not in state
    expected = torch.rand(3)
    # A state from a GPU machine restores on the CPU (its CUDA part is not for this process).
    set_rng_state({**state, "cuda": [torch.get_rng_state()] * 4}, torch.device("cpu"))
    assert torch.equal(torch.rand(3), expected)


def test_the_data_step_builds_the_graphs_and_later_ranks_read_them(tmp_path, monkeypatch):
    """The co-expression and GO graphs are built in the staged data step (before the process
    group exists, rank 0 first), not in model_initialize by every rank at once; with the node's
    shared store the next rank reads rank 0's co-expression graph instead of computing it."""
    from gears.data import graphs
    from gears.data.synthetic import make_synthetic, write_gene2go_tsv

    screen = make_synthetic(**TINY)
    screen.adata.write_h5ad(tmp_path / "screen.h5ad")
    write_gene2go_tsv(screen.gene2go, tmp_path / "gene2go.tsv.gz")
    cfg = Config()
    cfg.data.dataset, cfg.data.data_dir = str(tmp_path / "screen.h5ad"), str(tmp_path / "data")
    cfg.data.gene2go, cfg.data.store = str(tmp_path / "gene2go.tsv.gz"), "mmap"
    built = load_pert_data(cfg, DistEnv())
    d = cfg.data
    assert ("go", d.go_top_k, d.go_threshold) in built._graphs
    assert ("coexpress", d.coexpress_top_k, d.coexpress_threshold) in built._graphs

    def recomputed(*args, **kwargs):
        raise AssertionError("a later rank computed the co-expression graph again")

    monkeypatch.setattr(graphs, "coexpression_graph", recomputed)
    later = load_pert_data(cfg, DistEnv(1, 1, 2, torch.device("cpu"), None))
    key = ("coexpress", d.coexpress_top_k, d.coexpress_threshold)
    assert torch.equal(later._graphs[key].edge_index, built._graphs[key].edge_index)


# --------------------------------------------------------------------- DDP buffers (7, 11)
def _ddp_worker(rank: int, world: int, port: int, out: str) -> None:
    env = join_local_gloo(rank, world, port)
    try:
        # A caller's own script already in a group: rank 1 waits on the group's store while
        # rank 0 builds the shared data folder, then reads rank 0's files.
        cfg = Config()
        cfg.data.synthetic, cfg.data.data_dir = dict(TINY), str(Path(out) / "data")
        pd_ = load_pert_data(cfg, env)
        model = build(pd_)
        # Each rank its own batches, no synchronised batch-norm: running statistics diverge.
        batches = group_batches(pd_, 8, 4, 2)[rank::world]
        cfg = TrainConfig(epochs=1, schedule="constant", optimizer="sgd", lr=0.01)
        trainer = Trainer(
            model.model,
            pd_,
            cfg,
            model.model_config(),
            env,
            dist_cfg=DistributedConfig(sync_batchnorm=False),
        )
        broadcast = list(trainer.model.named_module_buffers)
        trainer.fit({"train_loader": ListLoader(batches)}, progress=False)
        rows = np.concatenate([pd_.cond_pert_index] * 4)[:150]  # 3 chunks: both ranks work
        delta, _ = predict_deltas(model.model, rows, env)
        result = {
            "broadcast": broadcast,
            "graphs": graph_buffer_names(model.model),
            "state": {k: v.detach().clone() for k, v in model.model.state_dict().items()},
            "delta": delta,
            "rows": rows,
        }
        with open(Path(out) / f"rank{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
        trainer = model = None  # free DDP while the group lives, as gears.cli.job does
    finally:
        cleanup(env)


@pytest.fixture(scope="module")
def ddp_ranks(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("ddp")
    mp.spawn(_ddp_worker, args=(2, find_free_port(), str(tmp)), nprocs=2, join=True)
    return [pickle.loads((tmp / f"rank{r}.pkl").read_bytes()) for r in (0, 1)]


@pytest.mark.slow
def test_ddp_broadcasts_no_graph(ddp_ranks):
    for result in ddp_ranks:
        graphs = set(result["graphs"])  # GEARSNet.graph_buffer_names(), or the *edge* buffers
        assert graphs, "no graph buffers found"
        assert not set(result["broadcast"]) & (graphs | GRAPHS)
        assert "bn_emb.running_mean" in result["broadcast"]  # the list is the real one


@pytest.mark.slow
def test_unsynchronised_ranks_evaluate_like_one_process_with_rank0_weights(ddp_ranks, tiny_run):
    rank0, rank1 = ddp_ranks
    for k, v in rank0["state"].items():  # batch-norm statistics included
        assert torch.equal(v, rank1["state"][k]), k
    assert any("running_var" in k for k in rank0["state"])
    np.testing.assert_array_equal(rank0["delta"], rank1["delta"])
    pd_, _ = tiny_run
    net = build(pd_).model
    net.load_state_dict(rank0["state"])
    single, _ = predict_deltas(net, rank0["rows"])
    np.testing.assert_allclose(rank0["delta"], single, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------- rank-0 work beyond the timeout (3)
@pytest.mark.slow
def test_slow_rank0_data_and_scoring_outlast_the_collective_timeout(tmp_path):
    """Rank 0's data step and its scoring each take twice distributed.timeout_s; the other rank
    waits for the data on the store (distributed.data_wait_s) and has left the group before
    the scoring, so no collective times out."""
    args = [f"out_dir={tmp_path / 'run'}", f"data.data_dir={tmp_path / 'data'}", *TINY_RUN]
    args += ["train.epochs=1", "train.limit_batches=3", "train.plot_conditions=0"]
    args += ["distributed.timeout_s=6"]
    run = _launch(
        tmp_path / "log",
        sys.executable,
        str(ROOT / "train_distributed.py"),
        "--nproc",
        "2",
        *args,
        env=_env(GEARS_TEST_SLOW_RANK0="data:12,scoring:12"),
    ).wait(400)
    assert run.ok(), run.why()
    assert run.seconds > 24  # both delays happened
    metrics = _metrics(tmp_path / "run")
    assert metrics["world_size"] == 2 and metrics["test"]["mse_de"] is not None


def _stage_threads(builds: list) -> list:
    """build_in_stages for ranks 0..n-1 (local ranks 0, 1, ...) as threads sharing a real
    TCPStore; returns each rank's result or exception."""
    port = find_free_port()
    stores = [
        torch.distributed.TCPStore(
            "127.0.0.1", port, len(builds), r == 0, timedelta(seconds=30), wait_for_workers=False
        )
        for r in range(len(builds))
    ]
    out: list = [None] * len(builds)

    def one(r: int) -> None:
        try:
            out[r] = build_in_stages(builds[r], stores[r], r, r, len(builds), wait_s=20)
        except Exception as e:
            out[r] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in range(len(builds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_data_is_built_by_rank_0_first_then_the_others():
    order = []

    def build(r: int, delay: float):
        def run():
            time.sleep(delay)
            order.append(r)
            return f"data{r}"

        return run

    # Rank 0 is the slowest, yet the others start only when it is done.
    assert _stage_threads([build(0, 0.5), build(1, 0.0), build(2, 0.0)]) == [
        "data0",
        "data1",
        "data2",
    ]
    assert order[0] == 0


def test_failed_rank_0_data_step_stops_the_waiting_ranks_with_its_message():
    def bad():
        raise GearsInputError("no .h5ad file at /x.h5ad")

    results = _stage_threads([bad, lambda: "never", lambda: "never"])
    assert all(isinstance(r, GearsInputError) for r in results), results
    assert all("no .h5ad file at /x.h5ad" in str(r) for r in results)


# ------------------------------------------------------------------- Slurm launching (13)
def test_master_port_from_the_slurm_job_id(clean_launch_env):  # noqa: F811
    assert default_master_port() == 29500
    clean_launch_env.setenv("SLURM_JOB_ID", "123457")
    assert default_master_port() == 20000 + 123457 % 20000
    for key, value in {"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}.items():
        clean_launch_env.setenv(key, value)
    slurm_to_env()
    assert os.environ["MASTER_PORT"] == str(20000 + 123457 % 20000)


@pytest.mark.parametrize("step", [None, "batch", "4294967294"])
def test_batch_script_is_not_a_worker(clean_launch_env, step):  # noqa: F811
    """`python train_distributed.py` in a 4-task sbatch script, outside srun: spawns locally."""
    for key, value in {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"}.items():
        clean_launch_env.setenv(key, value)
    if step is not None:
        clean_launch_env.setenv("SLURM_STEP_ID", step)
    assert not launched_externally()
    slurm_to_env()
    assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ
    assert "SLURM_NTASKS=4" in batch_script_note() and "srun" in batch_script_note()
    clean_launch_env.setenv("SLURM_STEP_ID", "0")  # the same variables inside `srun`
    assert launched_externally() and batch_script_note() is None


@pytest.mark.parametrize("step", [None, "batch", "interactive", "4294967290"])
def test_srun_gets_cpus_per_task(tmp_path, step):
    """run_multi_node.sh in a batch script or salloc's shell (step ids batch / interactive, as
    Slurm spells them or numbers them) launches srun, passing SLURM_CPUS_PER_TASK (since Slurm
    22.05 srun does not inherit it) and the job's port. A fake srun/scontrol records the
    call."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/sh\necho "port=$MASTER_PORT srun $*" > "$SRUN_LOG"\n')
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho node07\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    log = tmp_path / "srun.txt"
    env = _env(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        SLURM_JOB_ID="31337",
        SLURM_JOB_NODELIST="node[07-08]",
        SLURM_NNODES="2",
        SLURM_CPUS_PER_TASK="12",
        SRUN_LOG=str(log),
        NPROC_PER_NODE="4",
        PYTHON="true",
        **({} if step is None else {"SLURM_STEP_ID": step}),
    )
    result = subprocess.run(
        ["bash", str(ROOT / "run_multi_node.sh"), "train.epochs=1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    call = log.read_text()
    assert "--cpus-per-task=12" in call and "--nodes=2" in call
    assert call.startswith(f"port={20000 + 31337 % 20000} ")
    assert call.rstrip().endswith("train.epochs=1")


def test_download_part_file_is_per_process(tmp_path):
    from gears.data.download import _own_part

    dest = tmp_path / "f.bin"
    (tmp_path / "f.bin.part").write_bytes(b"12345")  # an interrupted earlier download
    mine = _own_part(dest)
    assert mine.name == f"f.bin.{socket.gethostname()}.{os.getpid()}.part"
    assert mine.read_bytes() == b"12345"  # claimed for resuming, by this process only
    assert _own_part(dest) == mine and not (tmp_path / "f.bin.part").exists()


# ------------------------------------------------ a cell-gears model saved on a GPU machine
def _config_pkl_as_written_on_cuda(config: dict) -> bytes:
    """cell-gears's config.pkl as its save_model writes it on a GPU machine: plain pickle, each
    tensor's storage a torch.save stream whose location is cuda:0 (cell-gears keeps its graphs
    on its device)."""
    import io

    cpu = b"X\x03\x00\x00\x00cpu"  # the location string as torch's legacy format pickles it

    class OnCuda(pickle.Pickler):
        def reducer_override(self, obj):
            if not isinstance(obj, torch.storage.TypedStorage):
                return NotImplemented
            raw = io.BytesIO()
            torch.save(obj, raw, _use_new_zipfile_serialization=False)
            data = raw.getvalue()
            assert data.count(cpu) == 1
            return torch.storage._load_from_bytes, (data.replace(cpu, b"X\x06\x00\x00\x00cuda:0"),)

    out = io.BytesIO()
    OnCuda(out, protocol=4).dump(config)
    return out.getvalue()


def test_cell_gears_config_saved_on_a_gpu_loads_on_the_cpu(tmp_path):
    """read_config maps the storages to the CPU (it loaded them where they were saved: on a
    machine without CUDA, "Attempting to deserialize object on a CUDA device"); the model then
    predicts what cell-gears recorded."""
    import shutil

    from test_cell_gears_models import FIXTURE, GENE2GO, RECORDED, SCREEN, as_cell_gears

    from gears.compat.api import GEARS
    from gears.compat.cell_gears import read_config

    config = read_config(FIXTURE / "model_plain" / "config.pkl")
    folder = tmp_path / "model_plain"
    shutil.copytree(FIXTURE / "model_plain", folder)
    (folder / "config.pkl").write_bytes(_config_pkl_as_written_on_cuda(config))
    if not torch.cuda.is_available():  # the file really names CUDA storages
        with pytest.raises(RuntimeError, match="CUDA"):
            pickle.loads((folder / "config.pkl").read_bytes())
    again = read_config(folder / "config.pkl")
    for key, value in config.items():
        if torch.is_tensor(value):
            assert again[key].device.type == "cpu" and torch.equal(again[key], value), key
        else:
            assert again[key] == value, key
    pred, _ = as_cell_gears(GEARS.from_cell_gears(folder, SCREEN, GENE2GO), "model_plain")
    np.testing.assert_allclose(pred, RECORDED["model_plain/pred"], rtol=0, atol=2e-5)


# -------------------------------------------- the reference network without host reads
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("selected", ["all", "some", "one", "none"])
def test_batch_norm_over_selected_rows_equals_batch_norm_of_those_rows(selected, momentum):
    """reference.batch_norm_over(norm, x, rows) against nn.BatchNorm1d on x[rows] (GEARS's lone
    row fed twice, no row: not called): outputs of the selected rows, gradients, running
    statistics and batch count, twice in a row (momentum None averages over the batches)."""
    import copy

    from gears.model.reference import batch_norm_over

    gen = torch.Generator().manual_seed(0)
    rows = {
        "all": torch.ones(9, dtype=torch.bool),
        "some": torch.tensor([1, 0, 1, 1, 0, 0, 1, 0, 1], dtype=torch.bool),
        "one": torch.arange(9) == 4,
        "none": torch.zeros(9, dtype=torch.bool),
    }[selected]
    ours = torch.nn.BatchNorm1d(5, momentum=momentum).double()
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5, generator=gen)
        ours.bias.normal_(0, 0.5, generator=gen)
        ours.running_mean.normal_(0, 0.1, generator=gen)
        ours.running_var.uniform_(0.5, 1.5, generator=gen)
    plain = copy.deepcopy(ours)
    for _ in range(2):
        x = torch.randn(9, 5, dtype=torch.float64, generator=gen) * 3 + 1
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        out = batch_norm_over(ours, x1, rows)[rows]
        n = int(rows.sum())
        if n:
            chosen = x2[rows]
            want = plain(chosen.repeat(2, 1))[:1] if n == 1 else plain(chosen)
            torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
            weights = torch.randn(want.shape, dtype=torch.float64, generator=gen)
            (out * weights).sum().backward()
            (want * weights).sum().backward()
            torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-10, atol=1e-12)
            for a, b in ((ours.weight, plain.weight), (ours.bias, plain.bias)):
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(
                getattr(ours, name), getattr(plain, name), rtol=1e-12, atol=0
            )
    assert int(ours.num_batches_tracked) == (2 if selected != "none" else 0)


def test_reference_forward_and_backward_wait_for_nothing_on_the_device(monkeypatch):
    """GEARSReference on device tensors (the stand-in), as the engine calls it (one row per
    cell: counts 1.0; evaluation: none), with control cells and a lone perturbed cell: no op
    of its forward or backward makes the host wait for the device (benchmarks/gpu_check.py's
    watch: int(), boolean masks, nonzero, repeat_interleave without a size, ...)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_check import watch_host_syncs
    from test_reference_oracle import _graph

    from gears.config import ModelConfig
    from gears.device import STANDIN_ENV, module_to_device, to_device
    from gears.model.batch import ModelBatch
    from gears.model.reference import GEARSReference

    monkeypatch.setenv(STANDIN_ENV, "1")
    torch.manual_seed(0)
    graphs = (*_graph(20, 4, 1), *_graph(100, 8, 2))  # GO over 20 perturbable genes, 100 genes
    net = module_to_device(GEARSReference(ModelConfig(hidden_size=16), 100, 20, *graphs), "cpu")
    batches = {
        "mixed": [[3, -1], [5, 7], [-1, -1], [3, -1], [-1, -1], [11, 2]],
        "lone perturbed cell": [[-1, -1], [4, -1], [-1, -1]],
        "controls only": [[-1, -1], [-1, -1]],
    }
    for name, rows in batches.items():
        pert_index = to_device(torch.tensor(rows), "cpu")
        for counts in (1.0, None):
            net.train()
            with watch_host_syncs() as found:
                delta = net(ModelBatch(pert_index, counts))
                delta.pow(2).mean().backward()
            assert found == [], (name, counts, found)
        net.eval()
        with watch_host_syncs() as found, torch.no_grad():
            net(ModelBatch(pert_index))
        assert found == [], (name, "eval", found)
