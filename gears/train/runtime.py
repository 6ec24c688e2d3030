"""Process-level CPU runtime: OpenMP waits (governed by load), thread counts per rank, allocator
thresholds."""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
import socket
import sys
import threading
import time
from pathlib import Path

import torch

# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_INT_MAX = 2**31 - 1  # mallopt takes a C int: ~2 GiB is the largest threshold

# Ranks of this process's node that share its cores (set by `share_cores`; 1 for one process).
_sharers = 1


def wait_passively(environ=None) -> bool:
    """Make idle OpenMP threads sleep at once instead of spinning: OMP_WAIT_POLICY=PASSIVE in
    `environ` (default os.environ), unless the user set OMP_WAIT_POLICY or GOMP_SPINCOUNT.

    libgomp (torch's, MKL's and numba's OpenMP here) reads it once, when torch loads it, so
    this takes effect in processes started afterwards (mp.spawn's workers inherit it); the
    entry points do the same before importing gears, which imports torch. libgomp's default
    spins a waiting thread for 300,000 pauses (milliseconds) before sleeping, so when another
    process holds a core a thread spins away its time slice waiting for a descheduled partner,
    at each parallel region of a training step: beside one busy process the default job took
    far longer than at 1 thread, and scanpy's numba t-test (the same libgomp) far longer a call
    than with passive waits (the spinning arms are measured in docs/performance.md, "Under
    load"). The policy changes when threads run, never how work is split: the same thread
    count gives the same numbers.
    Returns True when it set the policy."""
    environ = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return False
    if environ.get(GOVERNED_WAITS) == "governed":  # an entry point's: its ranks govern them
        return False
    environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


def usable_cores() -> int:
    """The physical cores this process may run on: the CPUs of its affinity mask
    (`os.sched_getaffinity`: taskset, cpusets, Slurm's binding), hyperthread siblings counted
    once, as torch's own default counts them. At least 1."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            package = (topology / "physical_package_id").read_text().strip()
            cores.add((package, (topology / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


def user_thread_count(environ=None, launcher_pid: int | None = None) -> int | None:
    """OMP_NUM_THREADS when the user set it, else None. torchrun sets OMP_NUM_THREADS=1 for its
    workers when it starts several per node and the user set none: that 1 is torchrun's, told
    apart by its absence from the environment torchrun itself started with (/proc/<launcher>/
    environ; launcher_pid: default this process's parent). Where that cannot be read the 1 is
    kept: it never oversubscribes."""
    environ = os.environ if environ is None else environ
    value = environ.get("OMP_NUM_THREADS", "").strip()
    if not value:
        return None
    try:
        n = int(value.split(",")[0])
    except ValueError:
        return None
    if n == 1 and "TORCHELASTIC_RUN_ID" in environ:
        if not _launcher_set_omp(os.getppid() if launcher_pid is None else launcher_pid):
            return None
    return max(1, n)


def _launcher_set_omp(pid: int) -> bool:
    """Whether process `pid` started with OMP_NUM_THREADS in its environment (True if unknown).
    An empty read is unknown too: a process that is still exec'ing (the kernel has not yet
    placed its environment) or has no memory left reads as no environment at all."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return True
    return not raw or b"\0OMP_NUM_THREADS=" in b"\0" + raw


def auto_threads(sharers: int | None = None) -> int:
    """The CPU threads of `train.threads=0`: this process's usable cores divided among the ranks
    of its node that share them (`share_cores`, default 1: one process takes them all, as
    torch's own default does), or 0 (leave torch's count) when the user set OMP_NUM_THREADS,
    which torch read when it loaded. Never from measured load: where the thread count can change
    the float summation order, a rerun must get the same one (where it cannot, `ThreadPolicy`
    lowers the training thread's count while other processes use the CPUs)."""
    if user_thread_count() is not None:
        return 0
    return max(1, usable_cores() // (sharers or _sharers))


def share_cores(store, rank: int, world_size: int, prefix: str = "gears/cpus") -> int:
    """How many ranks of this node run on this process's cores, agreed through the launcher's
    store before the process group exists; remembered for `auto_threads`. Ranks started by
    mp.spawn or torchrun inherit one affinity mask and divide its cores; srun tasks bound to
    their own CPUs share nothing and keep theirs. Every rank must call it (each reads every
    other's entry). Returns the count (>= 1)."""
    global _sharers
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # keys outlive a restart
        prefix = f"{prefix}/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    try:
        mine = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        mine = list(range(os.cpu_count() or 1))
    me = f"{socket.gethostname()}|{','.join(map(str, mine))}"
    store.set(f"{prefix}/{rank}", me)
    entries = [store.get(f"{prefix}/{r}").decode() for r in range(world_size)]
    _sharers = sharing_ranks(me, entries)
    return _sharers


def sharing_ranks(me: str, entries: list[str]) -> int:
    """Of `entries` ("host|cpu,cpu,..." per rank, this one's among them), how many are on this
    host with at least one CPU in common with `me`: the ranks that divide these cores."""
    host, cpus = me.split("|")
    mine = set(cpus.split(","))
    return max(
        1,
        sum(
            1 for e in entries if e.split("|")[0] == host and mine & set(e.split("|")[1].split(","))
        ),
    )


def set_threads(n: int) -> int:
    """Use n CPU threads in torch (intra-op) and, when numba is already imported, in numba.

    Call it after the data is built: scanpy's differential-expression step runs numba kernels
    whose OpenMP layer calls omp_set_num_threads(NUMBA_NUM_THREADS) on the libgomp torch
    shares, silently replacing torch's thread count (benchmarks/README.md, finding 1).
    n <= 0 leaves everything as it is. Returns torch's thread count afterwards."""
    if n > 0:
        numba = sys.modules.get("numba")
        if numba is not None:
            # numba refuses more threads than NUMBA_NUM_THREADS, its pool size at import. Its
            # first call starts its threading layer, which resets the OpenMP pool: torch last.
            numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
        torch.set_num_threads(n)
    return torch.get_num_threads()


def tune_allocator(mmap_threshold: int = 1 << 30, trim_threshold: int = _INT_MAX) -> bool:
    """Keep large freed blocks in glibc's heap instead of returning them to the kernel.

    By default glibc serves each large activation from a fresh mmap and unmaps it on free, so a
    CPU training step takes thousands of minor page faults (each page zeroed again); raising
    M_MMAP_THRESHOLD and M_TRIM_THRESHOLD makes freed activations reusable and the step faster
    (the faults and the step's time are measured in benchmarks/README.md, finding 5). Peak
    memory is unchanged; the process keeps its high-water mark instead of giving pages back
    between steps. A no-op (False) without glibc, e.g. on macOS, Windows or musl, and when
    MALLOC_MMAP_THRESHOLD_ is set by the user.
    Returns True when both thresholds were set."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok_mmap = mallopt(_M_MMAP_THRESHOLD, min(int(mmap_threshold), _INT_MAX)) == 1
    ok_trim = mallopt(_M_TRIM_THRESHOLD, min(int(trim_threshold), _INT_MAX)) == 1
    return ok_mmap and ok_trim


# ---------------------------------------------------------------- spinning waits, governed by load
# The entry points (train_single.py, train_distributed.py) leave libgomp its default waits (a
# waiting thread spins 300,000 pauses before it sleeps; their time on one machine is in
# docs/performance.md, "Under load") and set this variable: the run then governs them
# (`govern_waits`). A user's OMP_WAIT_POLICY or GOMP_SPINCOUNT is kept as set.
GOVERNED_WAITS = "GEARS_OMP_WAITS"


def govern_waits_by_default(environ=None) -> bool:
    """In an entry point, before torch loads libgomp: unless the user set OMP_WAIT_POLICY or
    GOMP_SPINCOUNT, mark the waits as governed by this package (`govern_waits`). Returns True
    when it marked them. Also MKL's strict reproducible mode (`MKL_CBWR`, unless set): the
    same matrix products whatever the thread count (`ThreadPolicy`). (The scripts spell out the
    same lines: importing gears loads torch.)"""
    environ = os.environ if environ is None else environ
    environ.setdefault("MKL_CBWR", STRICT_MKL)
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return False
    environ[GOVERNED_WAITS] = "governed"
    # A torch built on Intel's OpenMP (libiomp5) has no libgomp to govern: its threads then go
    # to sleep at once, as under the passive waits before. libgomp does not read this variable.
    environ.setdefault("KMP_BLOCKTIME", "0")
    return True


def cpu_sample(cpus=None) -> tuple[int, int, int]:
    """(busy, total) clock ticks of `cpus` (default: this process's affinity) since boot, from
    /proc/stat, and this process's own CPU ticks (every thread: /proc/self/stat utime + stime)."""
    cpus = set(os.sched_getaffinity(0)) if cpus is None else set(cpus)
    busy = total = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
                continue
            ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
            total += sum(ticks)
            busy += sum(ticks) - ticks[3] - ticks[4]
    with open("/proc/self/stat") as f:
        stat = f.read().rsplit(")", 1)[1].split()
    return busy, total, int(stat[11]) + int(stat[12])  # fields 14, 15: utime, stime


def others_busy(before: tuple[int, int, int], after: tuple[int, int, int], n_cpus: int) -> float:
    """Cores' worth of CPU time that processes other than this one used on its CPUs between two
    `cpu_sample`s (steal time included: a hypervisor's other guests count as others)."""
    busy = after[0] - before[0]
    elapsed = (after[1] - before[1]) / max(1, n_cpus)  # ticks of one CPU
    if elapsed <= 0:
        return 0.0
    return max(0.0, busy - (after[2] - before[2])) / elapsed


def _loaded_libgomp():
    """The libgomp this process has loaded (torch's), as a ctypes library, or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            lib.GOMP_parallel.argtypes = [
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_uint,
                ctypes.c_uint,
            ]
            lib.omp_set_num_threads.argtypes = [ctypes.c_int]
            return lib
        except (OSError, AttributeError):
            continue
    return None


class WaitGovernor:
    """libgomp's spinning waits while this process has its CPUs to itself, short ones (100
    pauses, then sleep) while other processes use them, switched from a watch of /proc/stat.

    Spinning lets a thread that finishes its share of an op take the next op at once (the
    default job trains faster at 2 threads than at 1 on an idle 2-core machine), but beside a
    busy process the spinning thread burns the time slices its descheduled partner needs
    (training then takes longer than at 1 thread); both are measured in docs/performance.md,
    "Under load". libgomp fixes its spin counts when it loads, but it uses the short count
    whenever it manages more threads than the process has CPUs; the governor makes it so by
    parking a pool of that many idle libgomp threads in a thread of its own (asleep in a futex:
    no CPU), and lets them go when the CPUs are free again.

    Only when threads wait changes: never how many threads split an op, so never a result
    (the thread count stays what `auto_threads` chose, and reruns stay bit-identical; the
    count itself changes only through `ThreadPolicy`, where no bit depends on it)."""

    def __init__(
        self, interval_s: float = 0.5, engage_at: float = 0.3, release_below: float = 0.15
    ):
        self.interval_s, self.engage_at, self.release_below = interval_s, engage_at, release_below
        self.lib = _loaded_libgomp()
        self.cpus = sorted(os.sched_getaffinity(0))
        self.spinning = True
        self.switches = 0
        self.others = 0.0  # cores' worth other processes used at the last reading
        self._park = None  # the Event the parked pool's thread waits on
        self._stop = threading.Event()
        self._watch = None

    @property
    def usable(self) -> bool:
        return self.lib is not None and len(self.cpus) > 1

    def short_waits(self) -> None:
        """Park a pool of more libgomp threads than CPUs: libgomp's waits go short."""
        if self._park is not None or not self.usable:
            return
        park, parked = threading.Event(), threading.Event()
        noop = ctypes.cast(ctypes.CDLL(None).free, ctypes.c_void_p)  # free(NULL): does nothing
        n = len(self.cpus) + 1

        def hold():
            self.lib.omp_set_num_threads(n)  # this thread's own setting, not torch's threads
            self.lib.GOMP_parallel(noop, None, n, 0)
            parked.set()
            park.wait()  # on return, libgomp frees this thread's pool

        threading.Thread(target=hold, name="gears-short-omp-waits", daemon=True).start()
        parked.wait(10)
        self._park, self.spinning = park, False
        self.switches += 1

    def spinning_waits(self) -> None:
        if self._park is None:
            return
        self._park.set()
        self._park, self.spinning = None, True
        self.switches += 1

    def start(self) -> WaitGovernor:
        """Short waits at once (the CPUs' state is unknown), then the watch, every interval_s:
        others over engage_at cores -> short waits; under release_below twice -> spinning."""
        if not self.usable or self._watch is not None:
            return self
        self.short_waits()
        self._watch = threading.Thread(target=self._run, name="gears-omp-waits", daemon=True)
        self._watch.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        before, calm = cpu_sample(self.cpus), 0
        while not self._stop.wait(self.interval_s):
            after = cpu_sample(self.cpus)
            others = others_busy(before, after, len(self.cpus))
            before, self.others = after, others
            if others >= self.engage_at:
                calm = 0
                self.short_waits()
            elif others < self.release_below:
                calm += 1
                if calm >= 2:
                    self.spinning_waits()


_governor: WaitGovernor | None = None


def govern_waits(environ=None) -> WaitGovernor | None:
    """Start this process's WaitGovernor (once) where the entry point marked the waits as
    governed (`govern_waits_by_default`) and libgomp is loaded; else None. Called by the
    scripts' `__main__` and by each spawned rank, never on import (a notebook, pytest)."""
    global _governor
    environ = os.environ if environ is None else environ
    chosen = "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ
    if environ.get(GOVERNED_WAITS) != "governed" or chosen or not sys.platform.startswith("linux"):
        return None
    if _governor is None:
        _governor = WaitGovernor().start()
    return _governor


def wait_report() -> str:
    """How this process's OpenMP threads waited, for metrics.json: "governed: N switches, spinning
    now" (or "short now"), or "as set" where the user or the environment chose."""
    if _governor is None:
        return "as set"
    now = "spinning" if _governor.spinning else "short"
    return f"governed: {_governor.switches} switches, {now} now"


# ------------------------------------------------------------ the training thread count, by load
# MKL's strict conditional numerical reproducibility: its matrix products (gemm) give the same
# bits at any thread count (Intel's "strict CNR", AVX2 and later). MKL reads MKL_CBWR at its first
# call, so the entry points set it before importing gears, unless the user set MKL_CBWR.
STRICT_MKL = "AUTO,STRICT"


def strict_blas(environ=None) -> bool:
    """Whether torch's matrix products are the same at every thread count: an MKL build of torch
    run with MKL_CBWR in strict mode (the entry points set it)."""
    environ = os.environ if environ is None else environ
    return torch.backends.mkl.is_available() and "STRICT" in environ.get("MKL_CBWR", "").upper()


def fixed_threads_reason(cfg, device: torch.device, threads: int) -> str | None:
    """Why this run's CPU thread count cannot follow the load, or None when it can.

    It can where the thread count changes no bit of the run: the built-in network
    (model.impl=fast, whose training-mode batch-norms run on one thread,
    gears.model.kernels.on_one_thread) in fp32 on a CPU, eager, with MKL's strict mode, started
    by an entry point that governs the OpenMP waits (whose watch of the load it reads).
    tests/test_threads.py trains at 1, 2 and changing thread counts and compares every bit."""
    if device.type != "cpu":
        return "not a CPU run"
    if threads < 2:
        return f"{threads} thread"
    if _governor is None or not _governor.usable:
        return "no load watch (the OpenMP waits are not governed here)"
    if cfg.model.impl != "fast":
        return (
            f"model.impl={cfg.model.impl}: only the built-in network is checked to give the same "
            "bits at any thread count"
        )
    if cfg.train.precision != "fp32":
        return f"train.precision={cfg.train.precision}"
    if cfg.train.compile:
        return "train.compile=true"
    if cfg.distributed.sync_batchnorm:
        return "distributed.sync_batchnorm=true"
    if not strict_blas():
        return "MKL's strict mode is off (MKL_CBWR without STRICT, or not an MKL build of torch)"
    return None


class ThreadPolicy:
    """The training thread's CPU thread count: the run's count while its CPUs are free, fewer
    while other processes use them (one fewer per core's worth they use, at least one),
    changed only at a step boundary (`at_step`), from the WaitGovernor's watch of /proc/stat.

    Beside a busy process, two threads on what is left of one core wait for each other at every
    parallel op (training slower than at one thread: docs/performance.md, "Under load"); one
    thread does not. The count follows the load only where it changes no bit of the run
    (`fixed_threads_reason`); elsewhere it stays fixed, as before.

    GEARS_TEST_THREADS="2,1,1" (tests): the counts to take at successive step boundaries,
    cycled, instead of the watch's."""

    def __init__(self, threads: int, governor: WaitGovernor | None, fixed_reason: str | None):
        self.threads, self.governor, self.fixed_reason = threads, governor, fixed_reason
        self.now, self.switches, self.steps = threads, 0, 0
        self.seconds: dict[int, float] = {}  # training time at each count
        self.since: float | None = None  # training's clock: from the first step to `finish`
        schedule = os.environ.get("GEARS_TEST_THREADS", "")
        self.schedule = [max(1, int(n)) for n in schedule.split(",") if n.strip()]

    def wanted(self) -> int:
        if self.schedule:
            return self.schedule[(self.steps - 1) % len(self.schedule)]
        if self.governor.spinning:  # its watch found the CPUs free
            return self.threads
        return max(1, self.threads - math.ceil(self.governor.others - 0.05))

    def at_step(self) -> None:
        """At a step boundary, on the training thread (torch's thread count is per thread)."""
        if self.fixed_reason is not None:
            return
        self.steps += 1
        if self.since is None:
            self.since = time.perf_counter()
        self._take(self.wanted())

    def _take(self, n: int) -> None:
        if n != self.now:
            self._account()
            torch.set_num_threads(n)
            self.now, self.switches = n, self.switches + 1

    def _account(self, stop: bool = False) -> None:
        if self.since is None:
            return
        t = time.perf_counter()
        self.seconds[self.now] = self.seconds.get(self.now, 0.0) + t - self.since
        self.since = None if stop else t

    def report(self) -> str:
        """For metrics.json: "fixed (why)" or "follows load: 2 threads T2 s, 1 thread T1 s,
        N switches" (training seconds at each count)."""
        if self.fixed_reason is not None:
            return f"fixed ({self.fixed_reason})"
        spent = ", ".join(
            f"{n} thread{'s' * (n > 1)} {s:.1f} s"
            for n, s in sorted(self.seconds.items(), reverse=True)
        )
        return f"follows load: {spent}, {self.switches} switches"

    def finish(self) -> None:
        """After training: stop the clock. Evaluation and scoring then run at the count the load
        asks for now (no bit depends on it where the count follows the load)."""
        self._account(stop=True)
        if self.fixed_reason is None:
            self._take(self.wanted())


_policy: ThreadPolicy | None = None


def follow_load(threads: int, fixed_reason: str | None) -> ThreadPolicy:
    """This process's ThreadPolicy for a run at `threads` threads (fixed where `fixed_reason`)."""
    global _policy
    _policy = ThreadPolicy(threads, _governor, fixed_reason)
    return _policy


def run_threads() -> int:
    """The run's CPU thread count: its ThreadPolicy's while that follows the load (the training
    thread may be below it), else torch's."""
    return _policy.threads if threads_change_no_bit() else torch.get_num_threads()


def threads_change_no_bit() -> bool:
    """Whether this run's thread count changes no bit of it (its ThreadPolicy follows the load)."""
    return _policy is not None and _policy.fixed_reason is None


def at_step() -> None:
    """The training loop's step boundary: the thread count follows the load (`ThreadPolicy`)."""
    if _policy is not None:
        _policy.at_step()
