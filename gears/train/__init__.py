"""Training: the engine (one loop for 1 or N processes), its state, checkpoints and saved model
folders, the process group and runtime, the validation pass and GEARS's metrics."""
