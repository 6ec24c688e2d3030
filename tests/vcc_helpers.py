"""A tiny model trained on a synthetic file in the Virtual Cell Challenge layout (shared by
test_vcc.py and test_predict.py through the session fixture `vcc_run` in conftest.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from gears.cli.job import run
from gears.config import load_config
from gears.data.synthetic import make_vcc_layout, write_gene2go_tsv
from gears.train.distributed import DistEnv

ROOT = Path(__file__).resolve().parents[1]
VCC_PARAMS = dict(
    n_genes=60, n_perturbations=10, cells_per_perturbation=20, n_control_cells=100, n_modules=3
)
HAS_CELL_EVAL = importlib.util.find_spec("cell_eval") is not None
NO_CELL_EVAL = "cell-eval is not installed (pip install -r requirements-eval.txt)"


def write_vcc_files(folder: Path) -> tuple[Path, Path]:
    """adata_Training.h5ad (raw counts, obs['target_gene']) and its GO source in folder."""
    folder.mkdir(parents=True, exist_ok=True)
    adata, gene2go = make_vcc_layout(**VCC_PARAMS)
    h5ad = folder / "adata_Training.h5ad"
    adata.write_h5ad(h5ad)
    return h5ad, write_gene2go_tsv(gene2go, folder / "gene2go.tsv")


def vcc_overrides(h5ad: Path, gene2go: Path, data_dir: Path) -> list[str]:
    """configs/vcc.yaml pointed at the synthetic file (no aliases; GO source of the screen)."""
    return [
        f"data.dataset={h5ad}",
        f"data.gene2go={gene2go}",
        "data.gene_aliases=null",
        f"data.data_dir={data_dir}",
    ]


def train_vcc_run(root: Path) -> dict:
    """Train 1 epoch with configs/vcc.yaml (uncertainty head on, cell-eval when importable)."""
    h5ad, gene2go = write_vcc_files(root / "vcc")
    out = root / "run"
    cfg = load_config(
        ROOT / "configs" / "vcc.yaml",
        [
            *vcc_overrides(h5ad, gene2go, root / "data"),
            f"out_dir={out}",
            "train.epochs=1",
            "model.hidden_size=16",
            "model.uncertainty=true",
            "train.plot_conditions=0",
            "wandb.mode=disabled",
            f"eval.cell_eval={str(HAS_CELL_EVAL).lower()}",
        ],
        base=ROOT / "configs" / "default.yaml",
    )
    run(cfg, DistEnv(device=torch.device("cpu")))
    return {
        "h5ad": h5ad,
        "gene2go": gene2go,
        "out": out,
        "model": out / "model",
        "cfg": cfg,
        "metrics": json.loads((out / "metrics.json").read_text()),
    }
