"""Train GEARS on one device: `python train_single.py [--config FILE] [key=value ...]`."""

import os

# OpenMP waits spin while the CPUs are free and go short while other processes use them
# (gears.train.runtime.WaitGovernor), unless the user chose: libgomp reads OMP_WAIT_POLICY and
# GOMP_SPINCOUNT once, when torch loads, so the choice is read before importing gears.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GEARS_OMP_WAITS"] = "governed"
    os.environ.setdefault("KMP_BLOCKTIME", "0")  # Intel OpenMP builds (no governor): no spinning
# MKL's strict mode: the same matrix products at any thread count, which lets the training
# thread count follow the load (gears.train.runtime.ThreadPolicy). MKL reads it at its first call.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

from gears.cli.job import command, config_from_args, parse_args, run  # noqa: E402
from gears.train.distributed import DistEnv, choose_device  # noqa: E402


def main(argv=None):
    args = parse_args(argv, "Train GEARS on one device (CPU or one GPU).")
    cfg = config_from_args(args)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        print(
            f"train_single.py runs one process; ignoring WORLD_SIZE={os.environ['WORLD_SIZE']} "
            "(use train_distributed.py for several)",
            flush=True,
        )
    # One process by construction: never joins a process group, whatever the environment says.
    return run(cfg, DistEnv(device=choose_device(cfg.device, 0, cfg.distributed.gpu_ids)))


if __name__ == "__main__":
    from gears.train.runtime import govern_waits

    govern_waits()  # spinning OpenMP waits while the CPUs are free, short ones while not
    command(main)
