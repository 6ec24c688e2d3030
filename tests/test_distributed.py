"""The launchers with real processes on CPU (gloo): mp.spawn, torchrun, two-"node"
run_multi_node.sh, torchrun restarts after a killed worker, a taken port, Slurm variables and
train_multi_gpu. No mocks of torch.distributed: every multi-process test starts real processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import TINY, TINY_CLI, final_train_state

from gears.cli.launch import launched_externally
from gears.train import checkpoint as ckpt
from gears.train.distributed import find_free_port, first_slurm_host, init_distributed, slurm_to_env

ROOT = Path(__file__).resolve().parents[1]
TABLE_HEADER = "test metrics (mean over perturbations"
TIMEOUT_S = 300  # a wedged launcher fails the test instead of hanging the suite
# The same tiny run for every launcher, so their results can be compared with each other.
TINY_RUN = (
    "wandb.mode=disabled",
    "device=cpu",
    f"data.synthetic={TINY_CLI}",
    "model.hidden_size=16",
    "train.epochs=3",
    "distributed.timeout_s=60",  # a broken rendezvous errors out within a minute
)
# Launcher state inherited from the shell running pytest would change what the scripts do.
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK")
LAUNCH_PREFIXES = ("SLURM_", "TORCHELASTIC_", "GEARS_FAULT", "TORCH_DISABLE_SHARE")


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCH_VARS and not k.startswith(LAUNCH_PREFIXES)
    }
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def _descendants(pid: int) -> list[int]:
    """Every process below `pid`. torchrun starts its workers in sessions of their own, so a
    process-group kill would leave them running."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


class Launched:
    """A command running in the background with stdout/stderr in files (two concurrent
    launchers cannot block on full pipes)."""

    def __init__(self, cmd: list[str], logs: Path, env: dict[str, str], cwd: Path = ROOT):
        self.out, self.err = logs.with_suffix(".out"), logs.with_suffix(".err")
        self.t0 = time.perf_counter()
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=cwd)

    def wait(self, timeout: float = TIMEOUT_S) -> Launched:
        try:
            self.returncode = self.proc.wait(timeout=max(timeout - self.elapsed(), 1))
        except subprocess.TimeoutExpired:
            for pid in [*_descendants(self.proc.pid), self.proc.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.wait()
            self.returncode = None
        self.seconds = self.elapsed()
        self.stdout, self.stderr = self.out.read_text(), self.err.read_text()
        return self

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def ok(self) -> bool:
        return self.returncode == 0

    def why(self) -> str:
        status = "timed out" if self.returncode is None else f"exit {self.returncode}"
        return f"{status} after {self.seconds:.0f}s; stderr tail:\n{self.stderr[-3000:]}"


def _launch(logs: Path, *cmd: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> Launched:
    return Launched(list(cmd), logs, env or _env(), cwd)


def _train_args(out_dir: Path, data_dir: Path, *extra: str) -> list[str]:
    return [f"out_dir={out_dir}", f"data.data_dir={data_dir}", *TINY_RUN, *extra]


def _spawn_run(tmp: Path, *extra: str, env=None) -> Launched:
    script = str(ROOT / "train_distributed.py")
    args = _train_args(tmp / "run", tmp / "data", *extra)
    return _launch(tmp / "log", sys.executable, script, "--nproc", "2", *args, env=env).wait()


def _torchrun(
    tmp: Path, *torchrun_args: str, env=None, timeout: float = TIMEOUT_S, extra=()
) -> Launched:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [*torchrun_args, str(ROOT / "train_distributed.py")]
    cmd += _train_args(tmp / "run", tmp / "data", *extra)
    return _launch(tmp / "log", *cmd, env=env).wait(timeout)


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return ckpt.load(run_dir / "model" / "model.pt")["state_dict"]


def _metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-6, rtol=1e-6, msg=k)


def _assert_same_test_metrics(got: dict, want: dict) -> None:
    """Test metrics overall and per subgroup agree (None stands for NaN in metrics.json)."""
    for section in ("test", "subgroups"):
        assert got[section].keys() == want[section].keys(), section
    pairs = [(got["test"], want["test"], "test")]
    pairs += [(got["subgroups"][k], v, k) for k, v in want["subgroups"].items()]
    for a, b, where in pairs:
        for key, value in b.items():
            if value is None:
                assert a[key] is None, (where, key)
            else:
                assert a[key] == pytest.approx(value, rel=1e-6, abs=1e-9), (where, key)


def _assert_run_dir(run_dir: Path, world_size: int) -> dict:
    """The outputs train_single.py writes, with the world size recorded."""
    assert (run_dir / "config.yaml").is_file()
    metrics = _metrics(run_dir)
    for key in ("test", "subgroups", "baselines", "timing"):
        assert metrics[key], key
    assert metrics["world_size"] == world_size
    assert metrics["effective_batch_size"] == 32 * world_size
    assert metrics["timing"]["epochs"] == 3
    assert set(metrics["subgroups"]) >= {"unseen_single"}
    assert (run_dir / "model" / "model.pt").is_file()
    assert (run_dir / "model" / "config.json").is_file()
    assert [p.name for p in ckpt.list_checkpoints(run_dir / "checkpoints")] == [
        "epoch_0002.pt",
        "epoch_0003.pt",
    ]
    plots = sorted(p.name for p in (run_dir / "plots").glob("*.png"))
    assert "loss.png" in plots and len(plots) > 1  # loss curve and example perturbations
    return metrics


def _steps_per_epoch(run_dir: Path) -> int:
    state = ckpt.load(ckpt.list_checkpoints(run_dir / "checkpoints")[-1])
    return state["step"] // state["epoch"]


# One run per launcher, shared by the tests that compare launchers with each other.
@pytest.fixture(scope="module")
def spawn_run(tmp_path_factory) -> Launched:
    return _spawn_run(tmp_path_factory.mktemp("spawn"))


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory) -> Launched:
    return _torchrun(tmp_path_factory.mktemp("torchrun"))


def _run_dir(launched: Launched) -> Path:
    return launched.out.parent / "run"


@pytest.mark.slow
def test_spawn_nproc_2_writes_the_single_process_outputs(spawn_run):
    assert spawn_run.ok(), spawn_run.why()
    _assert_run_dir(_run_dir(spawn_run), world_size=2)
    assert spawn_run.stdout.count(TABLE_HEADER) == 1  # rank 0 alone reports
    assert spawn_run.stdout.count("wrote ") == 1
    assert "x 2 process(es)" in spawn_run.stdout
    assert "Traceback" not in spawn_run.stderr


@pytest.mark.slow
def test_spawn_nproc_2_trains_with_the_planned_step(tmp_path):
    """train.cuda_graphs=true under DDP (CPU, gloo): the planned step trains (no line saying
    the run fell back to eager steps) and the run writes the single-process outputs."""
    run = _spawn_run(tmp_path, "train.cuda_graphs=true")
    assert run.ok(), run.why()
    assert "train.cuda_graphs" not in run.stdout + run.stderr
    _assert_run_dir(_run_dir(run), world_size=2)
    assert run.stdout.count(TABLE_HEADER) == 1
    assert "Traceback" not in run.stderr


@pytest.mark.slow
def test_torchrun_equals_spawn(torchrun_run, spawn_run):
    """Same config and seed under two launchers: the same model, to float precision."""
    assert torchrun_run.ok(), torchrun_run.why()
    assert spawn_run.ok(), spawn_run.why()
    metrics = _assert_run_dir(_run_dir(torchrun_run), world_size=2)
    assert torchrun_run.stdout.count(TABLE_HEADER) == 1
    _assert_same_weights(_run_dir(torchrun_run), _run_dir(spawn_run))
    _assert_same_test_metrics(metrics, _metrics(_run_dir(spawn_run)))


@pytest.mark.slow
def test_run_multi_node_two_nodes_on_localhost(tmp_path):
    """Two torchrun agents on 127.0.0.1 meet through the default c10d rendezvous (the agent that
    binds MASTER_PORT first hosts the store, the other joins it as a client)."""
    port = find_free_port()
    script = str(ROOT / "run_multi_node.sh")
    args = _train_args(tmp_path / "run", tmp_path / "data")
    nodes = [
        _launch(
            tmp_path / f"node{rank}",
            "bash",
            script,
            *args,
            env=_env(
                NNODES="2",
                NODE_RANK=str(rank),
                NPROC_PER_NODE="1",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                PYTHON=sys.executable,
            ),
        )
        for rank in (0, 1)
    ]
    for node in nodes:
        node.wait()
        assert node.ok(), node.why()
        assert f"rendezvous c10d at 127.0.0.1:{port}" in node.stderr
    _assert_run_dir(tmp_path / "run", world_size=2)
    # c10d assigns the global ranks, so either node may hold rank 0; exactly one reports.
    assert sum(node.stdout.count(TABLE_HEADER) for node in nodes) == 1


def _two_nodes(tmp_path: Path, args: list[str], cwds: list[Path], **env: str) -> list[Launched]:
    """run_multi_node.sh as node 0 and node 1 on 127.0.0.1, one process each, node k in cwds[k]."""
    port = str(find_free_port())
    nodes = [
        _launch(
            tmp_path / f"node{rank}",
            "bash",
            str(ROOT / "run_multi_node.sh"),
            *args,
            env=_env(
                NNODES="2",
                NODE_RANK=str(rank),
                NPROC_PER_NODE="1",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                PYTHON=sys.executable,
                **env,
            ),
            cwd=cwds[rank],
        )
        for rank in (0, 1)
    ]
    return [node.wait() for node in nodes]


@pytest.mark.slow
def test_restart_on_node_local_disks_resumes_every_rank_from_rank_0s_checkpoint(
    tmp_path, torchrun_run
):
    """Two "nodes" without a shared filesystem: each runs in its own folder with relative
    out_dir and data_dir (the same path on two local disks). Rank 1 is SIGKILLed mid-epoch 2
    under MAX_RESTARTS=1; only rank 0's node holds the epoch-1 checkpoint, yet every restarted
    rank must resume from it and the run must end exactly where the uninterrupted one did."""
    assert torchrun_run.ok(), torchrun_run.why()
    reference = _run_dir(torchrun_run)
    per_epoch = _steps_per_epoch(reference)
    kill_step = per_epoch + per_epoch // 2 + 1
    disks = [tmp_path / "disk0", tmp_path / "disk1"]
    for disk in disks:
        disk.mkdir()
    nodes = _two_nodes(
        tmp_path,
        _train_args(Path("run"), Path("data")),
        disks,
        MAX_RESTARTS="1",
        GEARS_FAULT_KILL=f"1:step:{kill_step}",
    )
    for node in nodes:
        assert node.ok(), node.why()
    assert any("exitcode: -9" in node.stderr for node in nodes)  # the fault really happened
    # c10d assigns the global ranks: rank 0's node alone holds the run folder.
    written = [disk / "run" for disk in disks if (disk / "run" / "metrics.json").exists()]
    assert len(written) == 1, written
    (main,) = [node for node in nodes if TABLE_HEADER in node.stdout]
    assert "resumed from" in main.stdout and "epoch_0001.pt: after epoch 1 (step " in main.stdout
    other = disks[1 - disks.index(written[0].parent)]
    assert not (other / "run" / "checkpoints").exists() or not any(
        (other / "run" / "checkpoints").iterdir()
    )
    _assert_same_weights(written[0], reference)
    got, want = _metrics(written[0]), _metrics(reference)
    _assert_same_test_metrics(got, want)
    assert got["history"]["train_loss"] == pytest.approx(want["history"]["train_loss"], rel=1e-6)


def test_run_multi_node_help_names_every_variable():
    result = subprocess.run(
        ["bash", str(ROOT / "run_multi_node.sh"), "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        env=_env(),
    )
    assert result.returncode == 0
    for name in ("NNODES", "NODE_RANK", "NPROC_PER_NODE", "MASTER_ADDR", "MASTER_PORT"):
        assert name in result.stdout, name
    assert "MAX_RESTARTS" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "store",
    [
        # The documented setting (run_multi_node.sh exports it): with torchrun's default, the
        # workers' process group lives in the agent's rendezvous store, which keeps the killed
        # attempt's keys, so restarted ranks may dial a dead peer (pytorch/pytorch#135712; it
        # failed or hung in ~12 of 20 runs here under torch 2.13).
        pytest.param({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, id="store-per-rendezvous"),
    ],
)
def test_torchrun_restart_after_killed_worker_equals_uninterrupted(tmp_path, torchrun_run, store):
    """SIGKILL rank 1 mid-epoch 2; torchrun restarts both workers, which resume from the epoch-1
    checkpoint and must end exactly where the uninterrupted run ended."""
    assert torchrun_run.ok(), torchrun_run.why()
    reference = _run_dir(torchrun_run)
    per_epoch = _steps_per_epoch(reference)
    assert per_epoch >= 2
    kill_step = per_epoch + per_epoch // 2 + 1  # optimizer steps count from 1 on every rank
    env = _env(GEARS_FAULT_KILL=f"1:step:{kill_step}", **store)
    # Two attempts take ~2x an uninterrupted run; a wedged restart is cut off well before gloo's
    # own 5-minute connect timeout.
    run = _torchrun(tmp_path, "--max-restarts", "1", env=env, timeout=120)
    assert "exitcode: -9" in run.stderr, run.why()  # the fault really happened
    assert run.ok(), run.why()
    assert "resumed from" in run.stdout and "epoch_0001.pt: after epoch 1 (step " in run.stdout
    assert run.stdout.count(TABLE_HEADER) == 1
    _assert_same_weights(tmp_path / "run", reference)
    got, want = _metrics(tmp_path / "run"), _metrics(reference)
    _assert_same_test_metrics(got, want)
    assert got["history"]["train_loss"] == pytest.approx(want["history"]["train_loss"], rel=1e-6)


@pytest.mark.slow
def test_taken_master_port_is_a_clear_error(tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = _spawn_run(tmp_path, f"distributed.master_port={port}")
    assert run.returncode == 2, run.why()
    assert run.seconds < 60
    assert str(port) in run.stderr and "already in use" in run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "run").exists()  # refused before any work


SLURM = {  # task 5 of `srun` step 0 (the batch script itself has no step id; see test_gpu_twins)
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "8",
    "SLURM_JOB_NODELIST": "node[03-05,07],gpu1",
}


@pytest.fixture
def clean_launch_env(monkeypatch):
    # slurm_to_env writes os.environ itself: restore the whole environment afterwards, or RANK /
    # WORLD_SIZE leak into later tests (a train_single.py subprocess then waits for 8 ranks).
    # monkeypatch is undone first: a setenv over a value slurm_to_env wrote would otherwise put
    # that value back after the restore (RANK=5, WORLD_SIZE=8 leaked so into every later test).
    saved = dict(os.environ)
    for key in [*LAUNCH_VARS, *[k for k in os.environ if k.startswith(LAUNCH_PREFIXES)]]:
        monkeypatch.delenv(key, raising=False)
    yield monkeypatch
    monkeypatch.undo()
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize(
    "nodelist, head",
    [
        ("node[03-05,07],gpu1", "node03"),
        ("gpu7", "gpu7"),
        ("gpu1,node[03-05]", "gpu1"),
        ("node[1-2],gpu[3-4]", "node1"),
        ("rack2-n[010,002]", "rack2-n010"),
        ("10.0.0.5", "10.0.0.5"),
    ],
)
def test_first_slurm_host(nodelist, head):
    assert first_slurm_host(nodelist) == head


def test_slurm_to_env_derives_torch_variables(clean_launch_env):
    for key, value in SLURM.items():
        clean_launch_env.setenv(key, value)
    slurm_to_env()
    assert {k: os.environ[k] for k in LAUNCH_VARS[:5]} == {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "MASTER_ADDR": "node03",
        "MASTER_PORT": "29500",
    }
    assert launched_externally()


def test_master_addr_is_the_first_host_of_the_step_not_of_the_job(clean_launch_env):
    """A step may run on some of the job's nodes (srun --nodes=2 in a 4-node job, or after a
    node was excluded): the job's first host is then no rank's host."""
    for key, value in {**SLURM, "SLURM_STEP_NODELIST": "node[05,07]"}.items():
        clean_launch_env.setenv(key, value)
    slurm_to_env()
    assert os.environ["MASTER_ADDR"] == "node05"


def test_slurm_to_env_keeps_what_is_set(clean_launch_env):
    for key, value in SLURM.items():
        clean_launch_env.setenv(key, value)
    clean_launch_env.setenv("MASTER_ADDR", "head.cluster")
    clean_launch_env.setenv("MASTER_PORT", "12345")
    slurm_to_env()
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("head.cluster", "12345")
    assert os.environ["RANK"] == "5"
    # Under torchrun inside srun, torchrun's RANK wins over Slurm's task id.
    clean_launch_env.setenv("RANK", "2")
    clean_launch_env.setenv("WORLD_SIZE", "4")
    slurm_to_env()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("2", "4")


def test_slurm_to_env_outside_slurm_changes_nothing(clean_launch_env):
    before = dict(os.environ)
    slurm_to_env()
    assert dict(os.environ) == before
    assert not launched_externally()


def test_single_slurm_task_runs_without_a_process_group(clean_launch_env):
    for key, value in {**SLURM, "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}.items():
        clean_launch_env.setenv(key, value)
    assert not launched_externally()
    env = init_distributed("cpu")
    assert (env.rank, env.world_size, env.distributed) == (0, 1, False)
    assert not torch.distributed.is_initialized()


@pytest.mark.slow
def test_train_multi_gpu_on_cpu_returns_the_spawn_runs_metrics(
    tmp_path, clean_launch_env, spawn_run
):
    """The Python entry point with the CLI run's config gives the CLI run's model and metrics."""
    from gears.cli.launch import train_multi_gpu

    clean_launch_env.setenv("OMP_NUM_THREADS", "1")  # inherited by the spawned workers
    metrics = train_multi_gpu(
        str(tmp_path / "data"),
        "synthetic",
        split_config={"type": "simulation", "seed": 1},
        args={
            "out_dir": str(tmp_path / "run"),
            "device": "cpu",
            "wandb": {"mode": "disabled"},
            "model.hidden_size": 16,
            "train": {"epochs": 3},
            "distributed.timeout_s": 60,
            "data.synthetic": TINY,
        },
        n_gpus=2,
    )
    assert metrics == _metrics(tmp_path / "run")
    _assert_run_dir(tmp_path / "run", world_size=2)
    assert spawn_run.ok(), spawn_run.why()
    _assert_same_weights(tmp_path / "run", _run_dir(spawn_run))
    _assert_same_test_metrics(metrics, _metrics(_run_dir(spawn_run)))


def _metrics_without_timing(run_dir: Path) -> dict:
    metrics = _metrics(run_dir)
    metrics.pop("timing")
    return metrics


@pytest.mark.slow
def test_two_process_reruns_give_identical_metrics_json(torchrun_run, spawn_run):
    """Determinism with 2 processes: two launches of the same config and seed (torchrun and
    mp.spawn) write the same metrics.json bit for bit, timing aside."""
    assert torchrun_run.ok(), torchrun_run.why()
    assert spawn_run.ok(), spawn_run.why()
    got = _metrics_without_timing(_run_dir(torchrun_run))
    assert got == _metrics_without_timing(_run_dir(spawn_run))


@pytest.mark.slow
def test_sigterm_on_one_rank_then_resume_equals_uninterrupted(tmp_path, spawn_run):
    """Rank 1 alone gets SIGTERM mid-epoch 2: rank 0 learns it through the step-boundary
    all-reduce and writes the checkpoint (each rank's running loss in it), both exit 0, and
    train.resume=true ends where the uninterrupted run ended. Every write of both runs is
    audited: rank 1 writes nothing."""
    from helpers import audit_env, audited_writes

    assert spawn_run.ok(), spawn_run.why()
    audit = audit_env(tmp_path / "audit", tmp_path / "work")
    work = tmp_path / "work"
    work.mkdir()
    stop_at = _steps_per_epoch(_run_dir(spawn_run)) + 2
    stopped = _spawn_run(work, env=_env(GEARS_FAULT_KILL=f"1:step:{stop_at}:TERM", **audit))
    assert stopped.ok(), stopped.why()
    assert (
        stopped.stdout.count(
            f"SIGTERM received: stopped after epoch 1 + 2 steps of epoch 2 (step {stop_at} in all)"
        )
        == 1
    )
    names = [p.name for p in ckpt.list_checkpoints(work / "run" / "checkpoints")]
    assert names == ["epoch_0001.pt", "epoch_0001_step_000002.pt"]
    assert not (work / "run" / "metrics.json").exists()
    resumed = _spawn_run(work, "train.resume=true", env=_env(**audit))
    assert resumed.ok(), resumed.why()
    want = _metrics_without_timing(_run_dir(spawn_run))
    assert _metrics_without_timing(work / "run") == want
    assert final_train_state(work / "run") == final_train_state(_run_dir(spawn_run))
    writes = audited_writes(tmp_path / "audit")
    assert any(rank == "0" and "run/.metrics.json.tmp" in path for rank, _, path in writes)
    assert [w for w in writes if w[0] != "0"] == []


@pytest.mark.slow
def test_sigterm_on_both_ranks_at_once_writes_one_checkpoint_then_resumes(tmp_path, spawn_run):
    """Both ranks get SIGTERM at the same step (a preempted node): they agree to stop there,
    rank 0 writes the stop checkpoint once (every write audited), both exit 0, and
    train.resume=true ends where the uninterrupted run ended."""
    from helpers import audit_env, audited_writes

    assert spawn_run.ok(), spawn_run.why()
    audit = audit_env(tmp_path / "audit", tmp_path / "work")
    work = tmp_path / "work"
    work.mkdir()
    stop_at = _steps_per_epoch(_run_dir(spawn_run)) + 2
    stopped = _spawn_run(work, env=_env(GEARS_FAULT_KILL=f"all:step:{stop_at}:TERM", **audit))
    assert stopped.ok(), stopped.why()
    assert stopped.stdout.count("SIGTERM received") == 1
    assert (
        f"SIGTERM received: stopped after epoch 1 + 2 steps of epoch 2 (step {stop_at} in all)"
        in stopped.stdout
    )
    folder = work / "run" / "checkpoints"
    names = [p.name for p in ckpt.list_checkpoints(folder)]
    assert names == ["epoch_0001.pt", "epoch_0001_step_000002.pt"]
    assert sorted(p.name for p in folder.iterdir()) == names  # no temp file left
    writes = audited_writes(tmp_path / "audit")
    into_place = [w for w in writes if w[1] == "os.rename" and f"/.{names[1]}.tmp" in w[2]]
    assert [w[0] for w in into_place] == ["0"]  # written once, by rank 0
    assert [w for w in writes if w[0] != "0"] == []
    assert not (work / "run" / "metrics.json").exists()
    resumed = _spawn_run(work, "train.resume=true")
    assert resumed.ok(), resumed.why()
    assert (
        f"resumed from {folder / names[1]}: after epoch 1 + 2 steps of epoch 2 "
        f"(step {stop_at} in all)" in resumed.stdout
    )
    want = _metrics_without_timing(_run_dir(spawn_run))
    assert _metrics_without_timing(work / "run") == want
    assert final_train_state(work / "run") == final_train_state(_run_dir(spawn_run))


@pytest.mark.slow
def test_sigterm_to_the_torchrun_agent_stops_the_workers_cleanly(tmp_path, torchrun_run):
    """Slurm signals the launcher: SIGTERM to the torchrun agent (sent by rank 0's parent
    hook during epoch 2, so that training is certainly under way). The agent forwards it to both
    workers, which agree to stop, write one checkpoint and leave within torchrun's grace period
    (no SIGKILL); torchrun itself then exits 1 on its own SignalException, as it always does.
    Resuming under torchrun ends where the uninterrupted run ended."""
    assert torchrun_run.ok(), torchrun_run.why()
    reference = _run_dir(torchrun_run)
    at = _steps_per_epoch(reference) + 2
    run = _torchrun(tmp_path, env=_env(GEARS_FAULT_KILL=f"0:step:{at}:TERM:parent"))
    # torchrun exits 1 on its SignalException. Under load its agent (torch's process, none of
    # ours) sometimes aborts while the interpreter tears down after that exception: a C++
    # thread still joinable ("terminate called without an active exception", SIGABRT), seen
    # once in a 2-core CI run. Either way the agent has already stopped the workers, which is
    # what the assertions below check.
    agent_abort = run.returncode == -signal.SIGABRT and (
        "terminate called without an active exception" in run.stderr
    )
    assert run.returncode == 1 or agent_abort, run.why()
    assert "SignalException: Process" in run.stderr and "got signal: 15" in run.stderr
    assert run.stderr.count("closing signal SIGTERM") == 2, run.why()  # forwarded to both
    assert "Unable to shutdown process" not in run.stderr, run.why()  # no SIGKILL needed
    assert run.stdout.count("SIGTERM received: stopped after") == 1, run.stdout[-2000:]
    folder = tmp_path / "run" / "checkpoints"
    names = [p.name for p in ckpt.list_checkpoints(folder)]
    assert names[0] == "epoch_0001.pt" and len(names) == 2, names
    assert sorted(p.name for p in folder.iterdir()) == names
    assert not (tmp_path / "run" / "metrics.json").exists()
    resumed = _torchrun(tmp_path, extra=("train.resume=true",))
    assert resumed.ok(), resumed.why()
    assert f"resumed from {folder / names[1]}" in resumed.stdout
    _assert_same_weights(tmp_path / "run", reference)
    assert _metrics_without_timing(tmp_path / "run") == _metrics_without_timing(reference)


@pytest.mark.slow
def test_nan_loss_on_one_rank_stops_every_rank_with_one_message(tmp_path, spawn_run):
    """Rank 1 alone sees a NaN loss, at the last step of epoch 2: both ranks agree at the
    step-boundary all-reduce and stop before the epoch-end checkpoint; rank 0 prints the
    message (rank, step, the batch's conditions) once, before any rank exits; status 2, no
    traceback, no hang; the epoch-1 checkpoint is the only one and intact."""
    assert spawn_run.ok(), spawn_run.why()
    per_epoch = _steps_per_epoch(_run_dir(spawn_run))
    bad = 2 * per_epoch
    run = _spawn_run(tmp_path, env=_env(GEARS_FAULT_KILL=f"1:step:{bad}:NAN"))
    assert run.returncode == 2, run.why()
    message = (
        f"error: the training loss became NaN or infinite in epoch 2, at step {bad} in all "
        f"(batch {per_epoch} of the epoch) on rank 1; the batch's conditions: ['"
    )
    assert run.stderr.count("the training loss became NaN") == 1, run.stderr[-3000:]
    assert message in run.stderr and "No checkpoint was written after it" in run.stderr
    assert "Traceback" not in run.stderr
    assert "epoch 2/3:" not in run.stdout  # the epoch never finished
    folder = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["epoch_0001.pt"]
    state = ckpt.load(folder / "epoch_0001.pt")
    assert (state["epoch"], state["step"], state["partial"]) == (1, per_epoch, None)
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())
    assert not (tmp_path / "run" / "metrics.json").exists()
