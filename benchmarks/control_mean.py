"""How much all-gene test mse the paired-control protocol costs, with no model involved.

    python benchmarks/control_mean.py [--seeds 1,2,3,4,5] [--config FILE] [key=value ...]

A perturbation's predicted mean is (predicted change) + (a control profile). With the change set
to zero, the control profile alone is scored: `all` (mean of all control cells, which is exactly
the `no_change` baseline) against `paired` (mean of the control cells randomly paired with the
perturbation's test cells, GEARS's protocol). Their difference is sampling noise that every model
scored with `eval.control_mean=paired` pays on top of its own error.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv=None) -> dict:
    from gears.cli.job import config_from_args, load_pert_data, parse_args
    from gears.cli.seeds import parse_seeds
    from gears.train.distributed import DistEnv
    from gears.train.evaluate import Evaluator

    def extra(parser):
        parser.add_argument("--seeds", default="1,2,3,4,5", help="split seeds")

    args = parse_args(argv, __doc__.splitlines()[0], extra)
    rows = {}
    print("seed  test perts  mse(all = no_change)  mse(paired)  paired - all")
    for seed in parse_seeds(args.seeds):
        args.overrides = [*args.overrides, f"split.seed={seed}"]
        pert_data = load_pert_data(config_from_args(args), DistEnv())
        view = Evaluator(pert_data).set_view("test")
        truth = view["truth_mean"]
        mse_all = float(((pert_data.ctrl_mean[None, :] - truth) ** 2).mean())
        mse_paired = float(((view["pair_mean"] - truth) ** 2).mean())
        rows[seed] = (mse_all, mse_paired)
        print(f"{seed:4d}  {len(truth):10d}  {mse_all:20.4f}  {mse_paired:11.4f}  "
              f"{mse_paired - mse_all:+.4f}", flush=True)  # fmt: skip
    gap = np.array([p - a for a, p in rows.values()])
    print(f"mean paired - all: {gap.mean():+.4f} (sd {gap.std(ddof=1) if len(gap) > 1 else 0:.4f})")
    return rows


if __name__ == "__main__":
    from gears.cli.exiting import run_and_exit  # exits once done, whatever threads are left

    run_and_exit(main)
