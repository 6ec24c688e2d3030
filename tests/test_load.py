"""Training beside a busy core and ranks sharing a node (gears/train/runtime.py, the entry points):
idle
OpenMP threads spin only while the CPUs are free (WaitGovernor), and the ranks of one node divide
its cores."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import TINY_CLI, assert_same_run, user_env

from gears.train import checkpoint as ckpt
from gears.train.runtime import (
    GOVERNED_WAITS,
    cpu_sample,
    govern_waits,
    govern_waits_by_default,
    others_busy,
    sharing_ranks,
    usable_cores,
    user_thread_count,
    wait_passively,
)

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def _busy_core():
    """Another process spinning on a core meanwhile."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def _libgomp_settings(stderr: str) -> dict[str, str]:
    """libgomp's own report of its settings (OMP_DISPLAY_ENV=verbose, printed when it loads)."""
    return dict(re.findall(r"^\s+([A-Z_]+) = '([^']*)'", stderr, flags=re.M))


# ------------------------------------------------------------------------ passive OpenMP waits
def test_wait_passively_sets_the_policy_unless_the_user_chose_one():
    env: dict[str, str] = {}
    assert wait_passively(env) and env == {"OMP_WAIT_POLICY": "PASSIVE"}
    for mine in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "10000"}):
        env = dict(mine)
        assert not wait_passively(env) and env == mine


@pytest.mark.slow
@pytest.mark.parametrize("script", ["train_single.py", "train_distributed.py"])
def test_entry_points_load_openmp_with_governed_waits(script):
    """libgomp reads its wait policy once, when torch loads it: the scripts leave it libgomp's
    spinning default (300,000 pauses, ~11 ms) and mark it governed (WaitGovernor switches it
    to short waits while other processes use the CPUs); a user's choice is kept, ungoverned.
    (Before: OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT 0, which the second core never paid for.)"""
    cmd = [sys.executable, str(ROOT / script), "--help"]
    got = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env=user_env(OMP_DISPLAY_ENV="verbose")
    )
    assert got.returncode == 0, got.stderr[-2000:]
    settings = _libgomp_settings(got.stderr)
    assert settings.get("GOMP_SPINCOUNT") == "300000", settings
    env: dict[str, str] = {}
    assert govern_waits_by_default(env)
    # and MKL's strict mode, which lets the thread count follow the load (tests/test_threads.py)
    assert env == {GOVERNED_WAITS: "governed", "KMP_BLOCKTIME": "0", "MKL_CBWR": "AUTO,STRICT"}
    assert not wait_passively(env)  # spawn()'s call leaves governed waits to the ranks
    if script == "train_single.py":  # (both scripts share the two lines that decide)
        mine = user_env(OMP_DISPLAY_ENV="verbose", GOMP_SPINCOUNT="12345")
        kept = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=mine)
        assert _libgomp_settings(kept.stderr).get("GOMP_SPINCOUNT") == "12345"
        for user in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "0"}):
            assert not govern_waits_by_default(dict(user))
            assert govern_waits({**user, GOVERNED_WAITS: "governed"}) is None


def test_others_busy_counts_other_processes_cores():
    """Cores' worth of CPU time used by other processes between two samples: all busy time of
    the CPUs less this process's own (its spinning threads are not others)."""
    # 2 CPUs, 100 ticks each elapsed (200 in all); 150 busy ticks, 50 of them this process's.
    assert others_busy((1000, 5000, 300), (1150, 5200, 350), 2) == pytest.approx(1.0)
    assert others_busy((1000, 5000, 300), (1100, 5200, 400), 2) == 0.0  # all of it ours
    assert others_busy((0, 0, 0), (0, 0, 0), 2) == 0.0  # no time elapsed
    before = cpu_sample()
    assert len(before) == 3 and before[0] <= before[1]


GOVERNOR_SCRIPT = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from gears.train.runtime import WaitGovernor
torch.set_num_threads(2)
y = torch.randn(1_000_000)

def cpu_per_op():  # ops with short gaps, as a training step's: spinning fills the gaps
    t0 = os.times()
    for _ in range(100):
        y.add(1)
        time.sleep(0.004)
    t1 = os.times()
    return (t1.user + t1.system - t0.user - t0.system) / 100

governor = WaitGovernor()
assert governor.usable, "libgomp not found"
spinning = cpu_per_op()
governor.short_waits()
short = cpu_per_op()
governor.spinning_waits()
time.sleep(0.1)
again = cpu_per_op()
print(spinning, short, again)
"""


def test_governor_switches_libgomps_waits_without_changing_threads(tmp_path):
    """WaitGovernor.short_waits parks more libgomp threads than CPUs, so libgomp's waits between
    ops go short (the worker sleeps instead of spinning through the gaps: far less CPU per op);
    spinning_waits lets them go and spinning returns. Seen failing with short_waits a no-op."""
    if usable_cores() < 2:
        pytest.skip("needs 2 cores")
    script = tmp_path / "governor.py"
    script.write_text(GOVERNOR_SCRIPT)
    got = subprocess.run(
        [sys.executable, str(script), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
        env=user_env(OMP_NUM_THREADS="2"),
    )
    assert got.returncode == 0, got.stderr[-2000:]
    spinning, short, again = map(float, got.stdout.split())
    assert short < 0.5 * spinning and short < 0.5 * again, (spinning, short, again)


def test_governor_goes_short_beside_a_busy_core():
    """The watch switches to short waits within a few intervals of another process taking a
    core (on a shared machine it may be short already: the test fails only if it never goes)."""
    import time

    from gears.train.runtime import WaitGovernor

    if usable_cores() < 2:
        pytest.skip("needs 2 cores")
    governor = WaitGovernor(interval_s=0.2)
    if not governor.usable:
        pytest.skip("no libgomp loaded")
    try:
        governor.start()
        governor.spinning_waits()  # as if the CPUs had been free
        with _busy_core():
            deadline = time.monotonic() + 10
            while governor.spinning and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not governor.spinning
    finally:
        governor.stop()
        governor.spinning_waits()


@pytest.mark.slow
def test_busy_core_costs_no_spinning_cpu(tmp_path):
    """The default model on the default screen at the default thread count (2 here), beside a
    process spinning on a core, against train.threads=1 beside the same process. Training's CPU
    time (every thread) is the robust signal on a loaded machine: with libgomp's spinning waits
    the idle thread spun through the busy process's time slices, and the 2-thread run used
    several times the CPU of the 1-thread one (the whole job: 222 s user time for 219 s wall,
    against 18 s at 1 thread); waiting passively it does the 1-thread work plus the overhead of
    splitting it. The default run's thread count also follows the load (ThreadPolicy): it trains
    on one thread fewer than its cores and gets the weights of train.threads=1, bit for bit
    (at two threads throughout, every weight differed)."""
    if usable_cores() < 2:
        pytest.skip("needs 2 cores")
    timing = {}
    for threads in ("default", "1"):
        args = [
            f"out_dir={tmp_path / threads}",
            f"data.data_dir={tmp_path / 'data'}",
            "device=cpu",
            "wandb.mode=disabled",
            "train.epochs=1",
            "train.limit_batches=40",
            "train.plot_conditions=0",
        ]
        if threads == "1":
            args.append("train.threads=1")
        with _busy_core():
            got = subprocess.run(
                [sys.executable, str(ROOT / "train_single.py"), *args],
                capture_output=True,
                text=True,
                timeout=900,
                env=user_env(),
            )
        assert got.returncode == 0, got.stderr[-2000:]
        timing[threads] = json.loads((tmp_path / threads / "metrics.json").read_text())["timing"]
    assert timing["default"]["threads"] == usable_cores()  # one process: every core
    assert timing["1"]["threads"] == 1
    ratio = timing["default"]["train_cpu_s"] / timing["1"]["train_cpu_s"]
    assert ratio < 2.5, (ratio, timing)  # measured: 1.45 at load 20; spinning: 20
    # The thread count followed the load: one thread fewer beside the busy core (the watch
    # reads the load from the start, during the data step) ...
    policy = timing["default"]["thread_policy"]
    assert policy.startswith("follows load:") and f"{usable_cores() - 1} thread" in policy, policy
    # ... and changed no bit: the weights and metrics of the run at train.threads=1.
    assert_same_run(tmp_path / "default", tmp_path / "1")


# --------------------------------------------------------------------- ranks sharing a node
def test_sharing_ranks_counts_the_ranks_on_this_hosts_cores():
    mine = "a|0,1,2,3"
    shared = [mine, "a|0,1,2,3", "b|0,1,2,3"]  # launched by mp.spawn or torchrun on host a
    assert sharing_ranks(mine, shared) == 2
    bound = [mine, "a|4,5,6,7", "a|8,9"]  # srun tasks bound to their own CPUs
    assert sharing_ranks(mine, bound) == 1
    assert sharing_ranks(mine, [mine, "a|3,4"]) == 2  # any CPU in common divides


def test_torchruns_own_omp_num_threads_is_not_the_users(tmp_path):
    """torchrun sets OMP_NUM_THREADS=1 in its workers when the user set none; the user's own 1
    is kept. The launcher's starting environment tells them apart."""
    plain = user_env()
    users = user_env(OMP_NUM_THREADS="1")
    worker = {"OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "x"}
    for launcher_env, want in ((plain, None), (users, 1)):
        # A launcher that prints as its last step before waiting has finished exec'ing: its
        # environment is in place. (`sh -c "echo up; exec sleep 60"` printed before its exec,
        # and a read during the exec found no environment, which counts as "set".)
        cmd = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"]
        launcher = subprocess.Popen(cmd, env=launcher_env, stdout=subprocess.PIPE, text=True)
        try:
            assert launcher.stdout.readline() == "up\n"
            assert user_thread_count(worker, launcher_pid=launcher.pid) == want
        finally:
            launcher.kill()
            launcher.wait()
    assert user_thread_count({"OMP_NUM_THREADS": "3"}) == 3  # not torchrun's value
    assert user_thread_count({}) is None


def test_a_launcher_still_starting_keeps_the_users_omp_num_threads():
    """Read at once, a just-started process's /proc/<pid>/environ is often empty: the kernel
    places the environment after the parent resumes (about half of reads on a loaded machine).
    Empty is unknown, so the user's 1 is kept, never taken for torchrun's."""
    worker = {"OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "x"}
    for _ in range(40):
        launcher = subprocess.Popen(["sleep", "60"], env=user_env(OMP_NUM_THREADS="1"))
        try:
            assert user_thread_count(worker, launcher_pid=launcher.pid) == 1
        finally:
            launcher.kill()
            launcher.wait()


PROBE = textwrap.dedent(
    """
    import json, os, sys, time
    from gears.train.runtime import auto_threads, share_cores, usable_cores, user_thread_count

    def probe(local_rank, out, cpus):
        if local_rank is not None:  # mp.spawn: the variables train_distributed.py sets
            from gears.train.distributed import set_local_rank_env
            set_local_rank_env(local_rank, 2, int(os.environ["PROBE_PORT"]))
        if cpus:  # this rank's own CPUs, as srun binds each task
            os.sched_setaffinity(0, {int(c) for c in cpus.split(";")[int(os.environ["RANK"])]})
        from gears.train.distributed import rendezvous_store
        store, rank, world_size = rendezvous_store(120)
        sharers = share_cores(store, rank, world_size)
        report = dict(sharers=sharers, threads=auto_threads(), cores=usable_cores(),
                      user=user_thread_count())
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
        store.add("probe/done", 1)
        while rank == 0 and store.add("probe/done", 0) < world_size:  # it hosts the store
            time.sleep(0.05)

    if __name__ == "__main__":
        out, cpus, how = sys.argv[1], sys.argv[2], sys.argv[3]
        if how == "spawn":
            import torch.multiprocessing as mp
            mp.spawn(probe, args=(out, cpus), nprocs=2, join=True)
        else:
            probe(None, out, cpus)
    """
)


def _probe(tmp_path: Path, how: str, cpus: str = "", **env: str) -> list[dict]:
    from gears.train.distributed import find_free_port

    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    out = tmp_path / f"{how}{len(list(tmp_path.glob(how + '*')))}"
    out.mkdir()
    if how == "spawn":
        cmd = [sys.executable, str(script), str(out), cpus, how]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc_per_node", "2", str(script), str(out), cpus, how]
    env = user_env(PROBE_PORT=str(find_free_port("127.0.0.1")), PYTHONPATH=str(ROOT), **env)
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert got.returncode == 0, got.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_ranks_of_one_node_divide_its_cores_or_keep_their_own(tmp_path):
    """Real processes and the launchers' own stores. torchrun's workers inherit one CPU mask
    and divide its cores, and its OMP_NUM_THREADS=1 is recognised as its own, not the user's;
    mp.spawn's ranks bound to disjoint CPUs (as srun binds its tasks) keep theirs. (mp.spawn's
    ranks sharing a mask: test_spawned_ranks_train_on_their_share_of_the_cores.)"""
    for report in _probe(tmp_path, "torchrun"):
        assert report["sharers"] == 2, report
        assert report["user"] is None, report  # torchrun's 1 is not the user's
        assert report["threads"] == max(1, usable_cores() // 2), report
    if len(os.sched_getaffinity(0)) < 2:
        return
    first, second = sorted(os.sched_getaffinity(0))[:2]
    for report in _probe(tmp_path, "spawn", f"{first};{second}"):
        assert report == {**report, "sharers": 1, "threads": 1, "cores": 1}


@pytest.mark.slow
def test_spawned_ranks_train_on_their_share_of_the_cores(tmp_path):
    """`train_distributed.py --nproc 2` with no thread setting: rank 0 trained (metrics.json,
    and the checkpoint's record) on half the cores. Before, each rank kept torch's default,
    every core, so two ranks oversubscribed the node twice over."""
    cmd = [sys.executable, str(ROOT / "train_distributed.py"), "--nproc", "2"]
    cmd += [f"out_dir={tmp_path / 'run'}", f"data.data_dir={tmp_path / 'data'}"]
    cmd += ["device=cpu", "wandb.mode=disabled", f"data.synthetic={TINY_CLI}"]
    cmd += ["model.hidden_size=16", "train.epochs=1", "train.plot_conditions=0"]
    cmd += ["distributed.timeout_s=120"]
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=user_env())
    assert got.returncode == 0, got.stderr[-3000:]
    want = max(1, usable_cores() // 2)
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["timing"]["threads"] == want
    state = ckpt.load(ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")[-1])
    assert state["cpu_threads"] == want
