"""A saved model folder, ours or cell-gears's, as a GEARS ready to predict (predict.py): the
network, the prediction info (the input's perturbation column, control spelling, condition
spellings and normalisation) and the control cells predicted cells start from."""

from __future__ import annotations

import json
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import scipy.sparse as sp

from gears.compat import cell_gears
from gears.compat.api import GEARS
from gears.data.conditions import CTRL
from gears.errors import GearsInputError
from gears.train import checkpoint as ckpt
from gears.train.saved_model import (
    CONFIG_FILE,
    CONTROL_CELLS_FILE,
    MAX_SAVED_CONTROL_CELLS,
    MODEL_FILE,
    PREDICTION_FILE,
    SavedVocabulary,
    control_sample_rows,
    read_control_cells,
)


def load_model(
    path: str | Path,
    device: str = "cpu",
    data: str | Path | None = None,
    gene2go: str | Path | None = None,
    gene_set: str | Path | None = None,
    trust_code: bool = False,
):
    """A saved model folder -> (GEARS ready to predict, prediction info dict, control AnnData).
    trust_code: run the fork's file kept in the folder, if its config.json names one
    (predict.py --trust-model-code; GEARS.load_pretrained).

    A folder saved by cell-gears (config.pkl + model.pt) holds no names and no control cells:
    they come from `data` (the .h5ad it was trained on), `gene2go` and `gene_set`
    (load_cell_gears_model)."""
    path = Path(path)
    if cell_gears.is_cell_gears_folder(path):
        return load_cell_gears_model(path, device, data, gene2go, gene_set)
    if not (path / CONFIG_FILE).exists() or not (path / MODEL_FILE).exists():
        raise GearsInputError(
            f"{path} is not a saved GEARS model folder (no {CONFIG_FILE} / {MODEL_FILE}); "
            "pass RUN_DIR/model of a finished training run"
        )
    for needed in (CONTROL_CELLS_FILE, PREDICTION_FILE):
        if not (path / needed).exists():
            raise GearsInputError(
                f"{path} has no {needed}: the model was saved by an older version; load it "
                "with its PertData and call GEARS.save_model(path) again to add the control cells"
            )
    meta = json.loads((path / CONFIG_FILE).read_text())
    state = ckpt.load(path / MODEL_FILE, map_location="cpu")
    ctrl = np.asarray(state["ctrl_expression"], dtype=np.float64)  # saved as a tensor
    vocab = SavedVocabulary(meta["gene_names"], meta["pert_names"], ctrl)
    model = GEARS(vocab, device=device).load_pretrained(path, trust_code=trust_code)
    info = json.loads((path / PREDICTION_FILE).read_text())
    controls = read_control_cells(path / CONTROL_CELLS_FILE)
    if list(controls.var_names) != list(meta["gene_names"]):
        raise GearsInputError(f"{path / CONTROL_CELLS_FILE} does not match the model's genes")
    return model, info, controls


def load_cell_gears_model(
    path: Path,
    device: str,
    data: str | Path | None,
    gene2go: str | Path | None,
    gene_set: str | Path | None = None,
):
    """load_model for a cell-gears folder: the vocabulary rebuilt from `data` and `gene2go` as
    cell-gears builds it (gears.compat.cell_gears.cell_gears_vocabulary), the control cells a seeded
    sample of the data's (at most MAX_SAVED_CONTROL_CELLS), conditions spelled as GEARS spells
    them (obs 'condition': 'A+ctrl', 'A+B', 'ctrl')."""
    if data is None or gene2go is None:
        raise GearsInputError(
            f"{path} is a cell-gears model folder (config.pkl + model.pt): it holds no gene "
            "names and no control cells. Pass --data with the .h5ad it was trained on (its "
            "<data_path>/<dataset>/perturb_processed.h5ad) and --gene2go with its "
            "gene2go_all.pkl (plus --gene-set essential_all_data_pert_genes.pkl if it was "
            "trained with cell-gears's default perturbation graph); docs/cell_gears_models.md"
        )
    if not Path(data).is_file():
        raise GearsInputError(f"--data {data} does not exist")
    adata = ad.read_h5ad(data, backed="r")
    model = GEARS.from_cell_gears(path, adata, gene2go, gene_set, device=device)
    ctrl_rows = np.flatnonzero(adata.obs["condition"].astype(str).values == CTRL)
    rows = control_sample_rows(ctrl_rows, MAX_SAVED_CONTROL_CELLS, seed=0)
    controls = ad.AnnData(
        X=sp.csr_matrix(adata.X[rows], dtype=np.float32),
        obs=pd.DataFrame(index=adata.obs_names.astype(str).values[rows]),
        var=pd.DataFrame(index=list(model.gene_list)),
    )
    info = {
        "condition_key": "condition",
        "control_label": CTRL,
        "condition_spelling": {},
        "normalize_target_sum": None,
        "n_control_cells": int(len(ctrl_rows)),
        "n_saved_control_cells": int(len(rows)),
    }
    return model, info, controls
