"""Predicted cells for a list of perturbations, as an .h5ad (the Virtual Cell Challenge layout).

    python predict.py --model RUN_DIR/model --perturbations FILE_OR_LIST \\
        [--cells-per-perturbation N | --counts CSV] --out pred.h5ad [--real REAL.h5ad]

FILE: one perturbation a line; LIST: comma-separated; spelled as the training data spells them
('KLF1', 'KLF1+ctrl', 'KLF1+MAP2K6'). --counts takes VCC's pert_counts_Validation.csv
(target_gene,n_cells,median_umi_per_cell); without --perturbations it predicts every row.
The control cells come from the model folder (a sample saved with the model; see
gears/predict.py). --real scores the prediction with cell-eval's vcc profile and writes
<out>.metrics.json.

A model folder saved by cell-gears 0.1.2 (config.pkl + model.pt) also needs the data it was
trained on, which gives the gene and perturbation order and the control cells
(docs/cell_gears_models.md):

    python predict.py --model CELL_GEARS_MODEL --data DATA_PATH/DATASET/perturb_processed.h5ad \
        --gene2go DATA_PATH/gene2go_all.pkl [--gene-set essential_all_data_pert_genes.pkl] \
        --perturbations FEV,FEV+SAMD1 --out pred.h5ad
"""

import argparse
import json
from pathlib import Path

from gears.errors import GearsInputError
from gears.run import guarded


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model",
        required=True,
        help="saved model folder (RUN_DIR/model), or a cell-gears model folder (with --data, "
        "--gene2go)",
    )
    parser.add_argument(
        "--data", help="cell-gears model: the .h5ad it was trained on (perturb_processed.h5ad)"
    )
    parser.add_argument("--gene2go", help="cell-gears model: the gene2go_all.pkl it used")
    parser.add_argument(
        "--gene-set",
        help="cell-gears model trained with its default perturbation graph: "
        "essential_all_data_pert_genes.pkl (or the gene_set_path it was given)",
    )
    parser.add_argument(
        "--perturbations",
        help="file with one perturbation a line, or a comma-separated list (default with "
        "--counts: every perturbation of the counts file)",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--cells-per-perturbation",
        type=int,
        default=None,
        help="predicted cells per perturbation (default 100)",
    )
    size.add_argument("--counts", help="CSV of cells per perturbation: target_gene,n_cells,...")
    parser.add_argument("--out", required=True, help="output .h5ad")
    parser.add_argument(
        "--control-cells",
        type=int,
        default=None,
        help="control cells to include (default: every control cell saved with the model, or "
        "the control row of --counts)",
    )
    parser.add_argument("--real", help="real .h5ad to score against with cell-eval (vcc profile)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the control-cell draws")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | auto")
    parser.add_argument("--threads", type=int, default=1, help="cell-eval threads (--real)")
    return parser.parse_args(argv)


def main(argv=None):
    from gears.predict import (
        DEFAULT_CELLS_PER_PERTURBATION,
        cell_eval_scores,
        load_model,
        predict_cells,
        print_cell_eval_table,
        read_counts,
        read_perturbations,
        real_cells_for_scoring,
        require_cell_eval,
    )

    args = parse_args(argv)
    out = Path(args.out)
    if out.suffix != ".h5ad":
        raise GearsInputError(f"--out {out} must end in .h5ad")
    if args.real is not None:
        require_cell_eval()  # before any work: say how to install it
    if args.cells_per_perturbation is not None and args.cells_per_perturbation < 1:
        raise GearsInputError("--cells-per-perturbation must be >= 1")
    if args.perturbations is None and args.counts is None:
        raise GearsInputError("give --perturbations (a file or a comma-separated list) or --counts")
    model, info, controls = load_model(
        args.model, args.device, data=args.data, gene2go=args.gene2go, gene_set=args.gene_set
    )
    control_label = info.get("control_label", "ctrl")
    n_control = args.control_cells
    if args.counts is not None:
        counts = read_counts(args.counts, info.get("condition_key", "condition"))
        if n_control is None and control_label in counts:
            n_control = counts[control_label]
        counts.pop(control_label, None)
        labels = read_perturbations(args.perturbations) if args.perturbations else list(counts)
        missing = [p for p in labels if p not in counts]
        if missing:
            raise GearsInputError(f"--counts has no row for {missing[:20]}")
        n_cells = [counts[p] for p in labels]
    else:
        labels = read_perturbations(args.perturbations)
        n_cells = [args.cells_per_perturbation or DEFAULT_CELLS_PER_PERTURBATION] * len(labels)
    if n_control is not None and n_control < 1:
        raise GearsInputError("--control-cells must be >= 1 (cell-eval needs control cells)")

    out.parent.mkdir(parents=True, exist_ok=True)
    # Written a chunk of cells at a time: memory never holds the whole prediction.
    pred = predict_cells(model, info, controls, labels, n_cells, n_control, args.seed, out=out)
    key = info.get("condition_key", "condition")
    print(
        f"wrote {out}: {pred.n_obs} cells x {pred.n_vars} genes ({len(labels)} perturbations, "
        f"{int((~pred.obs['predicted']).sum())} control cells); obs[{key!r}], "
        f"uns['gears_mean_prediction']"
        + (", layers['log_variance']" if model.config.get("uncertainty") else ""),
        flush=True,
    )
    if args.real is not None:
        import anndata as ad

        pred = ad.read_h5ad(out)  # cell-eval scores cells in memory
        real, scored = real_cells_for_scoring(args.real, info, list(pred.var_names), pred)
        outdir = out.with_name(f"{out.stem}_cell_eval")
        scores = {"gears": cell_eval_scores(scored, real, key, control_label, outdir, args.threads)}
        metrics = out.with_name(f"{out.stem}.metrics.json")
        metrics.write_text(json.dumps({"cell_eval": scores}, indent=1))
        print_cell_eval_table(scores)
        print(f"wrote {metrics} and cell-eval's tables in {outdir}/", flush=True)
    return pred


if __name__ == "__main__":
    guarded(main)
