"""The allowed values of every text option (config keys and the data layer's arguments)."""

from __future__ import annotations

SAMPLERS = (
    "rounding",
    "poisson",
    "multinomial",
    "nb",
)  # how counts are drawn (gears/eval/counts.py)
DEFAULT_SAMPLER = "rounding"  # scored best on the 2026 metrics (docs/predictions.md)

SPLIT_TYPES = (
    "simulation",
    "simulation_single",
    "combo_seen0",
    "combo_seen1",
    "combo_seen2",
    "single",
    "no_test",
    "no_split",
    "custom",
)

# model.impl also takes a fork's network class, `path/to/file.py:Class` or `module:Class`
# (gears.model.network_class); these are the built-in names.
CHOICES = {
    "model.impl": ("fast", "reference"),
    "train.schedule": ("step", "cosine", "constant"),
    "train.precision": ("fp32", "bf16", "fp16"),
    "train.optimizer": ("adam", "adamw", "sgd"),
    "train.select": ("last", "val_mse", "val_mse_de"),
    "train.batching": ("random", "grouped", "block"),
    "distributed.backend": ("auto", "nccl", "gloo"),
    "wandb.mode": ("disabled", "offline", "online"),
    "split.type": SPLIT_TYPES,
    "data.unmapped_perts": ("error", "drop", "keep"),
    "data.store": ("auto", "memory", "mmap"),
    "eval.control_mean": ("all", "paired"),
    "data.normalize": ("none", "log1p"),
    "eval.counts_sampler": SAMPLERS,
    "data.context_models": ("auto", "per_context", "joint"),
}
