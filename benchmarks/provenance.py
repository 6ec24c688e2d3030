"""Where a benchmark's numbers came from: the commit, the command, the machine and its load.

Every benchmark writes `provenance()` into its JSON, so a figure in the docs can name the
commit and the command that produced it. A commit marked `-dirty` had uncommitted changes to
tracked files: such numbers are not reproducible from the commit alone.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def provenance(argv: list[str] | None = None) -> dict:
    """{"commit", "command", "date", "machine"} of this process (argv: the command's arguments,
    default sys.argv)."""
    commit = _git("rev-parse", "--short=12", "HEAD") or "unknown"
    if _git("status", "--porcelain", "--untracked-files=no"):
        commit += "-dirty"
    argv = sys.argv if argv is None else argv
    return {
        "commit": commit,
        "command": shlex.join(["python", *argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
        f"load {os.getloadavg()[0]:.1f} at start",
    }
