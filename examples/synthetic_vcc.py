"""Write a synthetic stand-in for the Virtual Cell Challenge files (same layout, raw counts).

    python examples/synthetic_vcc.py data/vcc_synthetic

writes adata_Training.h5ad, adata_Validation.h5ad (the held-out perturbations' real cells),
pert_counts_Validation.csv and gene2go.tsv (see docs/predictions.md).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gears.data.synthetic import write_vcc_example  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder")
    parser.add_argument("--genes", type=int, default=200)
    parser.add_argument("--perturbations", type=int, default=45)
    parser.add_argument("--cells-per-perturbation", type=int, default=60)
    parser.add_argument("--control-cells", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    paths = write_vcc_example(
        args.folder,
        seed=args.seed,
        n_genes=args.genes,
        n_perturbations=args.perturbations,
        cells_per_perturbation=args.cells_per_perturbation,
        n_control_cells=args.control_cells,
    )
    for name, path in paths.items():
        print(f"{name}: {path}")
