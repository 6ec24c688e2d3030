"""How a finished process ends (stdlib only, so that any script can use it without loading torch):
at once, without the interpreter's teardown, and whatever threads a library left running."""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import traceback

# How long a command whose work is done waits for threads still running (other than executor
# workers, which their own exit hook ends at once): a library's thread that never ends (a
# monitor, a pool nobody shut down) must not keep a finished run alive.
EXIT_WAIT_S = 3.0


def exit_quickly(status: int, wait_s: float = EXIT_WAIT_S) -> None:
    """End the process without the interpreter's teardown, which frees the modules (torch, scanpy,
    numba, ...) object by object: a noticeable part of a short command's time, at the end of every
    command and of every rank (measured in docs/performance.md, "Under load"). What a normal exit
    does first still happens, in the same order: threading's exit hooks run (concurrent.futures'
    ends the idle workers of every executor pool: inductor's compile workers, which nobody shuts
    down), other non-daemon threads are joined, atexit handlers run (multiprocessing's, wandb's,
    logging's), stdout and stderr are flushed. Unlike a normal exit, the hooks and joins share one
    budget of wait_s seconds: a thread still running after it is left behind, never waited on
    forever. Outputs are closed before this point (files are written whole and renamed,
    gears.io)."""
    deadline = time.monotonic() + wait_s
    hooks = list(reversed(getattr(threading, "_threading_atexits", [])))
    if hooks:  # in a thread of their own: a pool's worker still busy would hold them
        runner = threading.Thread(target=_run_hooks, args=(hooks,), name="exit hooks", daemon=True)
        runner.start()
        runner.join(max(0.0, deadline - time.monotonic()))
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join(max(0.0, deadline - time.monotonic()))
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be said
            pass
    os._exit(status)


def _run_hooks(hooks) -> None:
    """threading's exit hooks (what threading._shutdown runs before it joins threads), each on
    its own: one that fails does not keep the others from running."""
    for hook in hooks:
        try:
            hook()
        except Exception:  # printed as a normal exit would print it; the exit goes on
            traceback.print_exc()


def run_and_exit(main) -> None:
    """A script's entry point that is not a training command (the benchmarks): main() as Python
    runs it (an exception or sys.exit ends the process as usual), then, once it returned,
    exit_quickly with its status (an int main returns, else 0)."""
    status = main()
    exit_quickly(status if isinstance(status, int) else 0)
