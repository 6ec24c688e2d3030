"""The commands: the training job behind train_single.py and train_distributed.py, its run
folder, contexts and seeds, the launcher, and `python -m gears.cli.check_model`."""
