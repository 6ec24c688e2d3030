"""Train GEARS on one device: `python train_single.py [--config FILE] [key=value ...]`."""

import os

# Idle OpenMP threads sleep instead of spinning, unless the user chose (gears.runtime.
# wait_passively says why). libgomp reads this once, when torch loads: before importing gears.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

from gears.distributed import DistEnv, choose_device  # noqa: E402
from gears.run import command, config_from_args, parse_args, run  # noqa: E402


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
    command(main)
