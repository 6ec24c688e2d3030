"""Which ops of a CPU training epoch give other bits at 1 thread than at N.

Every aten op of `Trainer.train_epoch` on a synthetic screen runs twice on the same inputs, at 1
thread and at N, and the ops whose floating-point outputs differ are listed with their input
shapes. An op run inside `gears.model.kernels.on_one_thread` (torch at one thread when it is
dispatched) is run at one thread both times, as in training. Uninitialised outputs (`empty`,
`empty_like`) are skipped. This is how the ops that keep a run's bits from following the
thread count were found (docs/performance.md, "Under load"); run it on a fork's network to see
what would keep its thread count fixed.

    python benchmarks/thread_bits.py --genes 1000 --threads 2 --steps 6

MKL reads MKL_CBWR at its first call: this script sets the entry points' strict mode unless you
set MKL_CBWR; `MKL_CBWR= python benchmarks/thread_bits.py` (empty) leaves MKL's default and shows
the matrix products that then split their sums by thread.
"""

from __future__ import annotations

import os

os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")  # as the entry points, before torch loads MKL

import argparse  # noqa: E402
import collections  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves, tree_map  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_train  # noqa: E402

UNINITIALISED = ("aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty")


class ThreadBits(TorchDispatchMode):
    """Runs each op at 1 thread on copies of its inputs, then at `threads` on the real ones,
    and counts the ops whose floating-point outputs differ."""

    def __init__(self, threads: int):
        super().__init__()
        self.threads = threads
        self.total, self.differ = collections.Counter(), collections.Counter()
        self.shapes: dict[str, set[str]] = collections.defaultdict(set)

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.get_num_threads() == 1 or str(func).startswith(UNINITIALISED):
            return func(*args, **kwargs)  # on_one_thread's ops: one thread in training too
        copy = tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, (args, kwargs))
        torch.set_num_threads(1)
        try:
            one = func(*copy[0], **copy[1])
        finally:
            torch.set_num_threads(self.threads)
        out = func(*args, **kwargs)
        name = str(func)
        self.total[name] += 1
        for a, b in zip(tree_leaves(one), tree_leaves(out)):
            if (
                isinstance(a, torch.Tensor)
                and a.layout == torch.strided
                and a.dtype.is_floating_point
                and not torch.equal(a, b)
            ):
                self.differ[name] += 1
                inputs = [tuple(t.shape) for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
                self.shapes[name].add(str(inputs))
                break
        return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--genes", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    screen = types.SimpleNamespace(
        genes=args.genes, singles=40, doubles=20, cells_per_condition=40, quick=False,
        batch=32, hidden=64, steps=args.steps,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        pert_data = bench_train.build_data(screen, Path(tmp) / "data")
        net = bench_train.build_net(pert_data, screen.hidden)
        trainer, loader = bench_train.make_trainer(pert_data, net, screen, "random", "fp32")
        torch.set_num_threads(args.threads)
        bits = ThreadBits(args.threads)
        with bits:
            trainer.train_epoch(loader, 1, progress=False)
    print(f"MKL_CBWR={os.environ.get('MKL_CBWR', '')!r}, 1 thread against {args.threads}, "
          f"{args.steps} steps at {args.genes} genes: {sum(bits.total.values())} ops compared, "
          f"{sum(bits.differ.values())} with other bits")  # fmt: skip
    for name, n in bits.differ.most_common():
        print(f"  {n} of {bits.total[name]} {name}  inputs {sorted(bits.shapes[name])[:3]}")


if __name__ == "__main__":
    main()
