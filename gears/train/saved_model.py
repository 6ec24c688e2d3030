"""A saved model folder's files: what GEARS.save_model writes beside the weights, and what
GEARS.load_pretrained and predict.py read without the training data.

    model/config.json         the model's hyperparameters, gene and perturbation lists
    model/model.pt            weights, graphs and the mean control expression
    model/control_cells.h5ad  a seeded sample of processed control cells (genes in model order;
                              obs['library_size']: their raw totals, when trained from counts)
    model/prediction.json     the input's condition column, control and condition spellings,
                              normalisation, and the context of a model of one context
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import scipy.sparse as sp
import torch

from gears.config import ModelConfig
from gears.data.conditions import CTRL
from gears.device import to_host
from gears.errors import GearsInputError
from gears.io import atomic_write, read_json, write_h5ad
from gears.model import fork_files, spec_file
from gears.train import checkpoint as ckpt

MODEL_FILE, CONFIG_FILE = "model.pt", "config.json"
CONTROL_CELLS_FILE = "control_cells.h5ad"
PREDICTION_FILE = "prediction.json"
MAX_SAVED_CONTROL_CELLS = 2000


def control_sample_rows(ctrl_rows: np.ndarray, max_cells: int, seed: int = 0) -> np.ndarray:
    """At most max_cells of ctrl_rows, drawn without replacement by a seeded generator, sorted."""
    ctrl_rows = np.asarray(ctrl_rows)
    if len(ctrl_rows) <= max_cells:
        return ctrl_rows
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(ctrl_rows, size=max_cells, replace=False))


def csr_rows(X, rows: np.ndarray) -> sp.csr_matrix:
    part = X[rows]
    return sp.csr_matrix(part, dtype=np.float32)


def atomic_write_h5ad(adata: ad.AnnData, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write_h5ad(adata, tmp)
    tmp.replace(path)


def write_prediction_inputs(
    pert_data, path: str | Path, max_cells: int = MAX_SAVED_CONTROL_CELLS, seed: int = 0
) -> None:
    """Save control cells and the input's spelling next to a model (called by save_model)."""
    path = Path(path)
    rows = control_sample_rows(pert_data.ctrl_rows, max_cells, seed)
    X = csr_rows(pert_data.expr.numpy(), rows)
    names = pert_data.adata.obs_names.astype(str).values[rows]
    genes = list(pert_data.gene_names)
    obs = pd.DataFrame(index=names)
    library = getattr(pert_data, "library_size", None)
    if library is not None:  # raw counts' totals: the depth of counts output (gears/eval/counts.py)
        obs["library_size"] = np.asarray(library, dtype=np.float64)[rows]
    controls = ad.AnnData(X=X, obs=obs, var=pd.DataFrame(index=genes))
    atomic_write_h5ad(controls, path / CONTROL_CELLS_FILE)
    spelling = dict(getattr(pert_data, "condition_spelling", {}) or {})
    info = {
        "condition_key": getattr(pert_data, "condition_key", "condition"),
        "control_label": spelling.get(CTRL, CTRL),
        "condition_spelling": spelling,
        "normalize_target_sum": getattr(pert_data, "normalize_target_sum", None),
        "n_control_cells": int(len(pert_data.ctrl_rows)),
        "n_saved_control_cells": int(len(rows)),
        "context_key": getattr(pert_data, "context_key", None),
        "context": getattr(pert_data, "context", None),
    }
    tmp = path / f".{PREDICTION_FILE}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(info, indent=1))
    tmp.replace(path / PREDICTION_FILE)


def checkpoint_meta(gene_names: list[str], pert_names: list[str], model_cfg: ModelConfig) -> dict:
    """The data vocabulary hash and model size a saved model.pt must match (config.json and
    model.pt from different runs are refused by name, not by a tensor shape error)."""
    vocab = ckpt.vocab_hash(gene_names, pert_names)
    return {"vocab_hash": vocab, **model_cfg.shape_fields()}


def write_model_folder(
    path: str | Path,
    network: torch.nn.Module,
    model_cfg: ModelConfig,
    config: dict,
    graphs: dict,
    pert_data,
    seed: int,
) -> None:
    """A folder with config.json and model.pt (weights without any DDP `module.` prefix, plus
    the graphs and gene lists, so loading needs no graph rebuild), and for predict.py
    control_cells.h5ad and prediction.json (write_prediction_inputs). A fork's network file
    (model.impl=path/to/file.py:Class) is copied in with the modules beside it that it imports
    (gears.model.fork_files), and loads from there (with trust_code).

    config: config.json's hyperparameters and graph settings (gears.train.build); graphs: "go" and
    "coexpress" -> (edge_index, edge_weight); pert_data: the PertData (or a folder's
    SavedVocabulary) whose gene and perturbation names and control mean are saved."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    gene_names, pert_names = list(pert_data.gene_names), list(pert_data.pert_names)
    meta = dict(config, gene_names=gene_names, pert_names=pert_names)
    text = json.dumps(meta, indent=1)
    atomic_write(path / CONFIG_FILE, lambda tmp: tmp.write_text(text))
    state = {
        "format": ckpt.FORMAT_VERSION,
        "meta": checkpoint_meta(gene_names, pert_names, model_cfg),
        "state_dict": network.state_dict(),
        "graphs": {k: (to_host(v[0]), to_host(v[1])) for k, v in graphs.items()},
        "ctrl_expression": torch.as_tensor(np.asarray(pert_data.ctrl_mean)),
    }
    ckpt.atomic_save(state, path / MODEL_FILE)
    fork = spec_file(model_cfg.impl)
    if fork is not None:  # the fork's code beside its weights (network_class reads it)
        source = Path(inspect.getsourcefile(type(network)))
        for file in fork_files(source):
            text = file.read_text()
            name = fork.name if file == source else file.name
            atomic_write(path / name, lambda tmp, text=text: tmp.write_text(text))
    if hasattr(pert_data, "ctrl_rows"):  # a PertData, not a folder's vocabulary
        # Control cells and the input's spelling, so predict.py needs no dataset.
        write_prediction_inputs(pert_data, path, seed=seed)


def read_control_cells(path: Path) -> ad.AnnData:
    """A model folder's control_cells.h5ad; a damaged one (truncated copy, full disk at save)
    is one GearsInputError naming it, not a reader's traceback."""
    try:
        return ad.read_h5ad(path)
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise GearsInputError(
            f"{path} is unreadable ({first}): the file is truncated or damaged. Save the model "
            "again from its run (GEARS.save_model) or copy the model folder again"
        ) from None


def read_model_json(folder: str | Path, name: str) -> dict:
    """A model folder's config.json or prediction.json as a dict; a missing, empty, truncated
    or edited-invalid file is a GearsInputError naming it and what to do (not a JSONDecodeError).
    predict.py and GEARS.load_pretrained read the folder through this."""
    return read_json(
        Path(folder) / name,
        f"the model folder's {name}",
        "it is written by GEARS.save_model (train.py writes <out_dir>/model/): restore it from "
        "the run folder, or save the model again",
    )


class SavedVocabulary:
    """What GEARS needs of a PertData to load weights and predict, read from a model folder."""

    def __init__(self, gene_names: list[str], pert_names: list[str], ctrl_mean: np.ndarray):
        self.gene_names = pd.Index(gene_names)
        self.pert_names = np.array(pert_names)
        self.node_map_pert = {g: i for i, g in enumerate(pert_names)}
        self.ctrl_mean = np.asarray(ctrl_mean, dtype=np.float64)
