"""GEARS with a context embedding: one model across contexts (e.g. cell lines).

A fork of the reference network (gears/model/reference.py) in a few lines: it declares that it
reads the covariate `context` (the obs column data.context_key names), learns one embedding per
context, and adds it to what each cell adds to every gene's embedding. Train it with

    python train_single.py model.impl=examples/context_gears.py:ContextGEARS \\
        data.context_key=cell_type ...

docs/changing_the_model.md walks through it and compares it with one model per context.
"""

from __future__ import annotations

import torch
from torch import nn

from gears.model.batch import ModelBatch
from gears.model.reference import GEARSReference


class ContextGEARS(GEARSReference):
    """GEARSReference plus a learned embedding of each cell's context."""

    covariates = ("context",)  # the engine then gives it batch.covariates["context"]

    def __init__(self, cfg, num_genes, num_perts, *graphs, categories: dict[str, list[str]]):
        super().__init__(cfg, num_genes, num_perts, *graphs)
        # categories["context"]: the contexts seen in training, in code order (saved with
        # the model, so a code means the same context when it is loaded again).
        self.context_emb = nn.Embedding(len(categories["context"]), cfg.hidden_size)

    def cell_embedding(self, cells: ModelBatch) -> torch.Tensor:
        """The cell's perturbations (GEARS), plus its context: [B, H]."""
        return super().cell_embedding(cells) + self.context_emb(cells.covariates["context"])
