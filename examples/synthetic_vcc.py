"""Write a synthetic stand-in for the Virtual Cell Challenge files (same layout, raw counts).

    python examples/synthetic_vcc.py data/vcc_synthetic                  # the 2025 layout
    python examples/synthetic_vcc.py data/vcc2026_synthetic --layout 2026

2025: adata_Training.h5ad, adata_Validation.h5ad (the held-out perturbations' real cells),
pert_counts_Validation.csv (target_gene,n_cells,median_umi_per_cell) and gene2go.tsv.
2026: two contexts (cell lines, obs['cell_line']) with the same panel, obs['target'] with
'non-targeting' controls; adata_Training.h5ad, adata_Validation_<context>.h5ad per context,
pert_counts_Validation.csv (cell_line,target,n_cells,median_umi_per_cell) and gene2go.tsv.
See docs/predictions.md.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gears.data.synthetic import write_vcc2026_example, write_vcc_example  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder")
    parser.add_argument("--layout", choices=("2025", "2026"), default="2025")
    parser.add_argument("--genes", type=int, default=200)
    parser.add_argument("--perturbations", type=int, default=45)
    parser.add_argument("--cells-per-perturbation", type=int, default=60)
    parser.add_argument("--control-cells", type=int, default=600, help="per context in 2026")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write = write_vcc2026_example if args.layout == "2026" else write_vcc_example
    paths = write(
        args.folder,
        seed=args.seed,
        n_genes=args.genes,
        n_perturbations=args.perturbations,
        cells_per_perturbation=args.cells_per_perturbation,
        n_control_cells=args.control_cells,
    )
    for name, path in paths.items():
        print(f"{name}: {path}")
