"""Train GEARS on one device: `python train_single.py [--config FILE] [key=value ...]`."""

import os

from gears.distributed import DistEnv, choose_device
from gears.run import config_from_args, guarded, parse_args, run


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
    guarded(main)
