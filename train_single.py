"""Train GEARS on one device: `python train_single.py [--config FILE] [key=value ...]`."""

from gears.distributed import init_distributed
from gears.run import config_from_args, guarded, parse_args, run


def main(argv=None):
    args = parse_args(argv, "Train GEARS on one device (CPU or one GPU).")
    cfg = config_from_args(args)
    env = init_distributed(cfg.device, "auto", gpu_ids=cfg.distributed.gpu_ids)
    if env.world_size > 1:
        raise SystemExit(
            "train_single.py runs one process; use train_distributed.py under torchrun"
        )
    return run(cfg, env)


if __name__ == "__main__":
    guarded(main)
