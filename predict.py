"""Predicted cells for a list of perturbations, as an .h5ad (the Virtual Cell Challenge layout).

    python predict.py --model RUN_DIR/model --perturbations FILE_OR_LIST \\
        [--cells-per-perturbation N | --counts CSV] --out pred.h5ad [--real REAL.h5ad]
    python predict.py --model RUN_DIR/model --counts pert_counts.csv --output counts --out pred.h5ad

FILE: one perturbation a line; LIST: comma-separated; spelled as the training data spells them
('KLF1', 'KLF1+ctrl', 'KLF1+MAP2K6'). --counts takes the challenge's pert_counts CSV
(target_gene or target, n_cells, median_umi_per_cell); without --perturbations it predicts every
row. --output lognorm (default) writes log-normalised expression; --output counts writes integer
counts (the 2026 challenge), drawn by --sampler at the control cells' depth or at the CSV's
median_umi_per_cell (gears/eval/counts.py). The control cells come from the model folder (a sample
saved with the model; see gears/eval/predicted_cells.py). --trust-model-code: a model folder whose
config.json
names a fork's class (model.impl=file.py:Class) runs that file, kept in the folder, only with this
flag; read the file first. --real scores a log-normalised prediction with
cell-eval's vcc profile and writes <out>.metrics.json.

A run with data.context_key has one model per context: --model RUN_DIR predicts each context's
model and writes <out stem>_<context>.h5ad per context; a counts CSV with that context column
gives each context its rows.

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

from gears.choices import DEFAULT_SAMPLER, SAMPLERS
from gears.cli.job import command
from gears.errors import GearsInputError


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
    parser.add_argument(
        "--output",
        choices=("lognorm", "counts"),
        default="lognorm",
        help="lognorm: log-normalised expression; counts: integer counts (2026 challenge)",
    )
    parser.add_argument(
        "--sampler",
        choices=SAMPLERS,
        default=DEFAULT_SAMPLER,
        help=(
            f"--output counts: how counts are drawn (default {DEFAULT_SAMPLER}; "
            "gears/eval/counts.py)"
        ),
    )
    parser.add_argument("--real", help="real .h5ad to score against with cell-eval (vcc profile)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the control-cell draws")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | auto")
    parser.add_argument(
        "--trust-model-code",
        action="store_true",
        help="run the network code a model folder carries (a fork's file that its config.json "
        "names); read the file first. Without it such a folder is refused and nothing runs",
    )
    parser.add_argument("--threads", type=int, default=1, help="cell-eval threads (--real)")
    return parser.parse_args(argv)


def model_folders(model: Path, out: Path) -> list[tuple[Path, Path]]:
    """(model folder, output file) pairs: one for a model folder; for a run with one model per
    context (its contexts.json), each context's model and <out stem>_<folder>.h5ad, where
    folder is the context's safe name (gears.cli.contexts.context_folder, as the run's folders)."""
    from gears.cli.contexts import SUMMARY_FILE, context_folders

    index = model / SUMMARY_FILE
    if not index.is_file():
        return [(model, out)]
    try:
        contexts = json.loads(index.read_text())["contexts"]
        contexts = {str(name): str(folder) for name, folder in contexts.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise GearsInputError(f"{index} is damaged; it lists a run's contexts") from None
    names = context_folders(contexts)
    root = model.resolve()
    pairs = []
    for name, folder in contexts.items():
        path = model / folder
        if not path.resolve().is_relative_to(root) or path.resolve() == root:
            raise GearsInputError(
                f"{index} lists context {name!r} at {folder!r}, outside the run's folder "
                f"{model}; a run writes each context's model under it: train the run again"
            )
        pairs.append((path, out.with_name(f"{out.stem}_{names[name]}{out.suffix}")))
    return pairs


def check_counts_contexts(model: Path, counts: str | None) -> None:
    """A --counts file with a context column must name only contexts the run has a model of
    (each context's model reads its own rows): any other row would be left unpredicted."""
    from gears.cli.contexts import SUMMARY_FILE
    from gears.eval.predicted_cells import counts_contexts

    index = model / SUMMARY_FILE
    if counts is None or not index.is_file():
        return
    info = json.loads(index.read_text())
    listed = counts_contexts(counts, info.get("context_key"))
    unknown = sorted(listed - set(info["contexts"])) if listed else []
    if unknown:
        raise GearsInputError(
            f"--counts file {counts} lists context(s) {unknown[:20]} that the run {model} has "
            f"no model of (its contexts: {sorted(info['contexts'])[:20]}); remove those rows, "
            "or predict them with a run trained on those contexts"
        )


def main(argv=None):
    from gears.eval.predicted_cells import (
        MAX_CELLS_PER_PERTURBATION,
        MAX_PREDICTED_CELLS,
        check_output_path,
        check_seed,
        require_cell_eval,
    )

    args = parse_args(argv)
    out = Path(args.out)
    check_output_path(out)  # before any work: a bad --out fails now, not after predicting
    check_seed(args.seed)
    if args.real is not None:
        if args.output == "counts":
            raise GearsInputError(
                "--real scores log-normalised cells with cell-eval's 2025 profile; score counts "
                "with cell-eval2 (cell-eval2 run --preset vcc2026, docs/predictions.md)"
            )
        require_cell_eval()  # before any work: say how to install it
    per = args.cells_per_perturbation
    if per is not None and not 1 <= per <= MAX_CELLS_PER_PERTURBATION:
        raise GearsInputError(
            f"--cells-per-perturbation must be from 1 to {MAX_CELLS_PER_PERTURBATION:,}, got {per}"
        )
    if args.perturbations is None and args.counts is None:
        raise GearsInputError("give --perturbations (a file or a comma-separated list) or --counts")
    if args.control_cells is not None and not 1 <= args.control_cells <= MAX_PREDICTED_CELLS:
        raise GearsInputError(
            "--control-cells must be >= 1 (cell-eval needs control cells) and at most "
            f"{MAX_PREDICTED_CELLS:,}"
        )
    targets = model_folders(Path(args.model), out)
    check_counts_contexts(Path(args.model), args.counts)
    for _, target in targets:
        check_output_path(target)
    preds = {}
    for folder, target in targets:
        preds[target] = predict_one(args, folder, target)
    return preds[out] if len(preds) == 1 and out in preds else preds


def predict_one(args, folder: Path, out: Path):
    """predict.py for one model folder, written to out."""
    from gears.compat.pretrained import load_model
    from gears.eval.predicted_cells import (
        DEFAULT_CELLS_PER_PERTURBATION,
        MAX_PREDICTED_CELLS,
        cell_eval_scores,
        predict_cells,
        print_cell_eval_table,
        read_counts,
        read_perturbations,
        real_cells_for_scoring,
    )

    model, info, controls = load_model(
        folder,
        args.device,
        data=args.data,
        gene2go=args.gene2go,
        gene_set=args.gene_set,
        trust_code=args.trust_model_code,
    )
    control_label = info.get("control_label", "ctrl")
    key = info.get("condition_key", "condition")
    n_control = args.control_cells
    median_umi = None
    if args.counts is not None:
        request = read_counts(args.counts, key, info.get("context_key"), info.get("context"))
        counts = dict(request.n_cells)
        if n_control is None and control_label in counts:
            n_control = counts[control_label]
        counts.pop(control_label, None)
        labels = read_perturbations(args.perturbations) if args.perturbations else list(counts)
        if not labels:
            where = f" for context {info['context']!r}" if info.get("context") else ""
            raise GearsInputError(
                f"--counts file {args.counts} lists no perturbation{where}, only "
                f"{control_label!r} rows; add the perturbations to predict there"
            )
        missing = [p for p in labels if p not in counts]
        if missing:
            raise GearsInputError(f"--counts has no row for {missing[:20]}")
        n_cells = [counts[p] for p in labels]
        if request.median_umi is not None and args.output == "counts":
            median_umi = [request.median_umi[p] for p in labels]
    else:
        labels = read_perturbations(args.perturbations)
        n_cells = [args.cells_per_perturbation or DEFAULT_CELLS_PER_PERTURBATION] * len(labels)
    if sum(n_cells) + (n_control or 0) > MAX_PREDICTED_CELLS:
        raise GearsInputError(
            f"{sum(n_cells):,} predicted cells asked; at most {MAX_PREDICTED_CELLS:,} are written "
            "in one file (split the request)"
        )

    out.parent.mkdir(parents=True, exist_ok=True)
    # Written a chunk of cells at a time: memory never holds the whole prediction.
    pred = predict_cells(
        model,
        info,
        controls,
        labels,
        n_cells,
        n_control,
        args.seed,
        out=out,
        output=args.output,
        sampler=args.sampler,
        median_umi=median_umi,
    )
    what = f"{args.output} ({args.sampler})" if args.output == "counts" else args.output
    print(
        f"wrote {out}: {pred.n_obs} cells x {pred.n_vars} genes, {what} ({len(labels)} "
        f"perturbations, {int((~pred.obs['predicted']).sum())} control cells); obs[{key!r}], "
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
    command(main)
