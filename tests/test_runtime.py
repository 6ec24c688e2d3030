"""gears/train/runtime.py: thread pools that stay set (data processing too), allocator
thresholds."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import SYNTHETIC_PARAMS

from gears.train.runtime import set_threads, tune_allocator


def test_set_threads_sets_torch_and_numba_and_zero_leaves_them():
    numba = pytest.importorskip("numba")
    before = torch.get_num_threads()
    try:
        assert set_threads(1) == 1 and torch.get_num_threads() == 1
        assert numba.get_num_threads() == 1
        assert set_threads(0) == 1  # 0: leave as is
        n = 2
        assert set_threads(n) == n and torch.get_num_threads() == n
        assert numba.get_num_threads() == min(n, numba.config.NUMBA_NUM_THREADS)
    finally:
        set_threads(before)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_tune_allocator_stops_page_faults_on_repeated_large_tensors():
    """In a fresh process: a 64 MB activation allocated and freed each step faults in all its
    pages every step with glibc's defaults (mmap / munmap), and about never once tuned."""
    code = textwrap.dedent(
        """
        import resource, torch
        from gears.train.runtime import tune_allocator

        def faults_per_step(steps=7):
            # The median step: robust to a stray fault burst on a shared machine.
            torch.empty(16 << 20).fill_(1.0)  # 64 MB, warm-up
            faults = []
            for _ in range(steps):
                start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                torch.empty(16 << 20).fill_(1.0)
                faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
            return sorted(faults)[steps // 2]

        default = faults_per_step()
        assert tune_allocator()
        tuned = faults_per_step()
        print(default, tuned)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={"MALLOC_ARENA_MAX": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": "."},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    default, tuned = map(float, out.stdout.split())
    pages = (64 << 20) / 4096
    assert default > 0.5 * pages  # the defect: every step faults the whole tensor in again
    assert tuned < 0.05 * pages


def test_tune_allocator_respects_user_setting(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert tune_allocator() is False


def test_processing_data_keeps_torch_thread_count(tmp_path):
    """In a fresh process at OMP_NUM_THREADS=1: scanpy's numba t-test (the DE step of processing
    a dataset) starts numba's OpenMP layer, which set torch's pool to NUMBA_NUM_THREADS. A run
    that processes its data then trained at another thread count (another summation order) than
    one that loads it processed, as a resumed run does."""
    code = textwrap.dedent(
        f"""
        import torch
        from gears.data.pertdata import PertData

        before = torch.get_num_threads()
        PertData({str(tmp_path)!r}, verbose=False).load(
            "synthetic", synthetic_params={SYNTHETIC_PARAMS!r}
        )
        print(before, torch.get_num_threads())
        """
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "2"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1", "1"]
