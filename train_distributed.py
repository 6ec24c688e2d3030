"""Train GEARS on N processes (DDP: NCCL on GPUs, gloo on CPU).

torchrun --standalone --nproc_per_node 4 train_distributed.py [key=value ...]
python train_distributed.py --nproc 4 [--config FILE] [key=value ...]   # mp.spawn
srun python train_distributed.py [key=value ...]                         # Slurm tasks
(run directly in a multi-task sbatch script, outside srun, it spawns --nproc local processes and
says so: only srun tasks are taken as workers)
"""

import os
import sys

# OpenMP waits spin while the CPUs are free and go short while other processes use them
# (gears.train.runtime.WaitGovernor), unless the user chose: libgomp reads OMP_WAIT_POLICY and
# GOMP_SPINCOUNT once, when torch loads, so the choice is read before importing gears.
# mp.spawn's workers inherit it; torchrun's and srun's workers run this file themselves.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GEARS_OMP_WAITS"] = "governed"
    os.environ.setdefault("KMP_BLOCKTIME", "0")  # Intel OpenMP builds (no governor): no spinning
# MKL's strict mode: the same matrix products at any thread count, which lets the training
# thread count follow the load (gears.train.runtime.ThreadPolicy). MKL reads it at its first call.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

from gears.cli.job import command, config_from_args, parse_args  # noqa: E402
from gears.cli.launch import (  # noqa: E402
    batch_script_note,
    launched_externally,
    spawn,
    worker_main,
)


def main(argv=None):
    args = parse_args(
        argv,
        "Train GEARS with DistributedDataParallel.",
        extra=lambda p: p.add_argument(
            "--nproc",
            type=int,
            default=None,
            help="processes to spawn (default: GPUs visible, else 1); ignored under torchrun/srun",
        ),
    )
    cfg = config_from_args(args)
    if launched_externally():
        return worker_main(cfg)
    note = batch_script_note()
    if note:
        print(note, file=sys.stderr, flush=True)
    return spawn(cfg, args.nproc)


if __name__ == "__main__":
    from gears.train.runtime import govern_waits

    govern_waits()  # spinning OpenMP waits while the CPUs are free, short ones while not
    command(main)
