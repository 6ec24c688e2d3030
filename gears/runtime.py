"""Process-level CPU runtime settings: OpenMP waits, thread pools, allocator thresholds."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import sys

import torch

# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_INT_MAX = 2**31 - 1  # mallopt takes a C int: ~2 GiB is the largest threshold


def wait_passively(environ=None) -> bool:
    """Make idle OpenMP threads sleep at once instead of spinning: OMP_WAIT_POLICY=PASSIVE in
    `environ` (default os.environ), unless the user set OMP_WAIT_POLICY or GOMP_SPINCOUNT.

    libgomp (torch's, MKL's and numba's OpenMP here) reads it once, when torch loads it, so
    this takes effect in processes started afterwards (mp.spawn's workers inherit it); the
    entry points do the same before importing gears, which imports torch. libgomp's default
    spins a waiting thread for 300,000 pauses (~11 ms on a recent Xeon) before sleeping, so
    when another process holds a core a thread spins away its time slice waiting for a
    descheduled partner, at each of the ~250 parallel regions of a training step: the default
    job with 3 epochs took 219 s beside one busy process, against 18 s at 1 thread, and
    scanpy's numba t-test took 86 ms a call instead of 0.12 ms on a loaded machine. The policy
    changes when threads run, never how work is split: the same thread count gives the same
    numbers. Returns True when it set the policy."""
    environ = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return False
    environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


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


@contextlib.contextmanager
def torch_threads_kept():
    """Give torch back its intra-op thread count on exit. scanpy's numba t-test starts numba's
    OpenMP layer, which sets the libgomp pool torch shares to NUMBA_NUM_THREADS (every logical
    core, whatever OMP_NUM_THREADS said): a run that computes DE would then train at another
    thread count, so with another float summation order, than one that loads it processed
    (a resumed run on a real dataset)."""
    before = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def tune_allocator(mmap_threshold: int = 1 << 30, trim_threshold: int = _INT_MAX) -> bool:
    """Keep large freed blocks in glibc's heap instead of returning them to the kernel.

    By default glibc serves each large activation from a fresh mmap and unmaps it on free, so a
    CPU training step takes ~19,000 minor page faults (each page zeroed again); raising
    M_MMAP_THRESHOLD and M_TRIM_THRESHOLD makes freed activations reusable (random fp32 step
    119 -> 105 ms, benchmarks/README.md finding 5). Peak memory is unchanged; the process keeps
    its high-water mark instead of giving pages back between steps. A no-op (False) without
    glibc, e.g. on macOS, Windows or musl, and when MALLOC_MMAP_THRESHOLD_ is set by the user.
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
