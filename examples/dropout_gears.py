"""GEARS with dropout on what each cell adds to the genes: a stochastic fork with an option.

A fork of the reference network (gears/model/reference.py). It declares one option of its own,
`dropout` (default 0.1), which a config sets as model.extra.dropout; the model folder's
config.json records it, so load_pretrained and predict.py rebuild the same network. Train and
check it with

    python train_single.py model.impl=examples/dropout_gears.py:DropoutGEARS model.extra.dropout=0.2
    python -m gears.cli.check_model model.impl=examples/dropout_gears.py:DropoutGEARS \\
        model.extra.dropout=0.2

check_model compares it with dropout off (its nn.Dropout modules in evaluation mode, batch-norm
still training) and in evaluation mode, and says so. docs/changing_the_model.md walks through it.
"""

from __future__ import annotations

import torch
from torch import nn

from gears.model.batch import ModelBatch
from gears.model.reference import GEARSReference


class DropoutGEARS(GEARSReference):
    """GEARSReference with dropout on each cell's fused perturbation embedding."""

    options = {"dropout": 0.1}  # model.extra.<name>: default; other names are refused

    def __init__(self, cfg, *args, **kwargs):
        super().__init__(cfg, *args, **kwargs)
        p = cfg.extra["dropout"]  # resolved by the engine: the default when not set
        if not 0.0 <= p < 1.0:
            from gears.errors import GearsInputError

            raise GearsInputError(f"model.extra.dropout must be in [0, 1), got {p}")
        self.dropout = nn.Dropout(p)  # no weights: GEARSNet's state_dict loads unchanged

    def cell_embedding(self, cells: ModelBatch) -> torch.Tensor:
        """What each cell adds to every gene's embedding, [B, H], some of it dropped."""
        return self.dropout(super().cell_embedding(cells))
