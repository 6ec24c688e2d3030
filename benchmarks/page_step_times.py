"""Wall time of each command of a docs page, run as tests/test_docs.py runs it (a fresh copy of
the repository, each command in its own process, the page's doc-run edits applied).

    python benchmarks/page_step_times.py docs/predictions.md [--keep DIR]

Prints one line per command: seconds, then the command. Compare two Pythons or two commits
side by side on the same machine; a command that got slower in every process (a JIT compiled
again, an import) shows here where the page's total hides it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import test_docs  # noqa: E402 - the test's own extraction and workspace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("page", help="a page run by tests/test_docs.py, e.g. docs/predictions.md")
    parser.add_argument("--keep", type=Path, help="run in this folder and keep it")
    args = parser.parse_args()
    base = args.keep or Path(tempfile.mkdtemp(prefix="page_step_times_"))
    base.mkdir(parents=True, exist_ok=True)
    workspace = test_docs.Workspace(base)
    total = 0.0
    for block in test_docs.page_blocks(args.page):
        if test_docs.LANGS.get(block.lang) not in ("shell", "python"):
            continue
        for step in test_docs.plan(block):
            if step.skip or step.covered:
                continue
            start = time.perf_counter()
            workspace.run(step)
            took = time.perf_counter() - start
            total += took
            print(f"{took:7.1f} s  {' '.join(step.run.split())}", flush=True)
    print(f"{total:7.1f} s  in all ({sys.version.split()[0]}, {base})")


if __name__ == "__main__":
    main()
