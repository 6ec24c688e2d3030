"""Which counts sampler scores best on the 2026 metrics (cell-eval2's vcc2026 preset).

    python benchmarks/counts_samplers.py --json benchmarks/results/counts_samplers.json

Integer counts are drawn from a predicted log-normalised profile (gears/eval/counts.py); the
sampler decides only the noise the draw adds, so it is compared on predictions that do not
depend on a model: for every perturbation of a synthetic 2026-layout screen (raw counts, two
contexts), `observed` predicts its observed mean change (log-normalised mean minus the control
mean: the best a model of the mean can do) and `no_change` predicts none. Each prediction is
turned into cells as predict.py does (control cell + change, at the perturbation's median
depth) by each sampler, with --draws seeds, and scored against the real cells per context:
each member rescaled between cell-eval2's mean-response baseline (0) and replicate (1). The
sampler with the highest mean score for `observed` is DEFAULT_SAMPLER; the table prints every
member, so a sampler that trades one member for another shows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from provenance import provenance  # noqa: E402


def real_and_predictions(view, samplers, draws: int, seed: int):
    """One context: its real cells (raw counts) and, per (predictor, sampler, draw), cells."""
    import anndata as ad
    import pandas as pd
    import scipy.sparse as sp

    from gears.eval.counts import raw_counts
    from gears.eval.predicted_cells import CountsSpec, counts_spec, prediction_adata
    from gears.eval.vcc2026 import _dense, _label

    conditions = [c for c in view.conditions if c != "ctrl"]
    ids = np.array([view.cond_to_id[c] for c in conditions])
    labels = [_label(c, view.condition_spelling) for c in conditions]
    control = view.condition_spelling.get("ctrl", "ctrl")
    key = view.condition_key
    X = view.expr.numpy()
    pert_rows = np.flatnonzero(view.cell_condition != view.ctrl_id)
    rows = np.r_[view.ctrl_rows, pert_rows]
    library = np.asarray(view.library_size, np.float64)
    counts = raw_counts(_dense(X, rows), library[rows], view.normalize_target_sum)
    id_label = dict(zip(ids.tolist(), labels))
    real_labels = [control] * len(view.ctrl_rows) + [
        id_label[i] for i in view.cell_condition[pert_rows]
    ]
    genes = [str(g) for g in view.gene_names]
    real = ad.AnnData(
        X=sp.csr_matrix(counts),
        obs=pd.DataFrame({key: pd.Categorical(real_labels)}, index=[f"r{i}" for i in rows]),
        var=pd.DataFrame(index=genes),
    )
    controls = ad.AnnData(
        X=sp.csr_matrix(_dense(X, view.ctrl_rows)),
        obs=pd.DataFrame(
            {"library_size": library[view.ctrl_rows]},
            index=[f"c{i}" for i in view.ctrl_rows],
        ),
        var=pd.DataFrame(index=genes),
    )
    means = view.condition_means(conditions)
    deltas = {"observed": means - view.ctrl_mean[None, :], "no_change": np.zeros_like(means)}
    per_label = pd.Series(library[pert_rows]).groupby(np.array(real_labels[len(view.ctrl_rows) :]))
    n_cells = [int(per_label.size()[lab]) for lab in labels]
    median = [float(per_label.median()[lab]) for lab in labels]
    info = {"normalize_target_sum": view.normalize_target_sum}
    preds = {}
    for name, delta in deltas.items():
        for sampler in samplers:
            for d in range(draws):
                spec: CountsSpec = counts_spec(info, controls, delta, sampler, seed + d, median)
                preds[(name, sampler, d)] = prediction_adata(
                    labels,
                    conditions,
                    delta,
                    n_cells,
                    controls,
                    key,
                    control,
                    seed=seed + d,
                    counts=spec,
                )
    return real, preds, key, control


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--genes", type=int, default=200)
    p.add_argument("--perturbations", type=int, default=45)
    p.add_argument("--cells-per-perturbation", type=int, default=60)
    p.add_argument("--control-cells", type=int, default=300)
    p.add_argument("--draws", type=int, default=2, help="sampler seeds per (predictor, sampler)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--work", default="/tmp/gears_counts_samplers")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from gears.choices import SAMPLERS
    from gears.data.pertdata import PertData
    from gears.data.synthetic import make_vcc2026_layout, write_gene2go_tsv
    from gears.eval.vcc2026 import MEMBERS, score_vcc2026

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    adata, gene2go = make_vcc2026_layout(
        n_genes=args.genes,
        n_perturbations=args.perturbations,
        cells_per_perturbation=args.cells_per_perturbation,
        n_control_cells=args.control_cells,
    )
    adata.write_h5ad(work / "screen.h5ad")
    go = write_gene2go_tsv(gene2go, work / "gene2go.tsv")
    data = PertData(work / "data", gene2go=go, verbose=False).load(
        data_path=work / "screen.h5ad", normalize="log1p", context_key="cell_line"
    )
    t0 = time.perf_counter()
    rows = []
    for context in data.contexts:
        view = data.context_view(context)
        real, preds, key, control = real_and_predictions(view, SAMPLERS, args.draws, seed=0)
        names = {"-".join(map(str, k)): v for k, v in preds.items()}
        scores = score_vcc2026(names, real, key, control, "counts", args.threads)
        for (name, sampler, d), _ in preds.items():
            got = scores["predictors"][f"{name}-{sampler}-{d}"]
            rows.append(
                {
                    "context": context,
                    "predictor": name,
                    "sampler": sampler,
                    "draw": d,
                    "score": got["score"],
                    **{f"scaled_{m}": got["scaled"][m] for m in MEMBERS},
                    **{f"raw_{m}": got["raw"][m] for m in MEMBERS},
                }
            )
    import pandas as pd

    frame = pd.DataFrame(rows)
    cols = ["score", *(f"scaled_{m}" for m in MEMBERS)]
    table = frame.groupby(["predictor", "sampler"])[cols].mean().round(4)
    print(table.to_string())
    result = {
        **provenance(),
        "screen": {
            "genes": args.genes,
            "perturbations": args.perturbations,
            "cells_per_perturbation": args.cells_per_perturbation,
            "control_cells_per_context": args.control_cells,
            "contexts": data.contexts,
        },
        "draws": args.draws,
        "seconds": round(time.perf_counter() - t0, 1),
        "mean_over_contexts_and_draws": {
            f"{p}/{s}": row for (p, s), row in table.to_dict(orient="index").items()
        },
        "rows": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        head = "| predictor | sampler | " + " | ".join(cols) + " |"
        lines = [head, "|" + " --- |" * (len(cols) + 2)]
        for (pred, sampler), row in table.iterrows():
            lines.append(f"| {pred} | {sampler} | " + " | ".join(f"{v:.4f}" for v in row) + " |")
        Path(args.json).with_suffix(".md").write_text(
            f"commit {result['commit']}, `{result['command']}`, {result['date']}, "
            f"{result['machine']}\n\n" + "\n".join(lines) + "\n"
        )
    return result


if __name__ == "__main__":
    from gears.cli.exiting import run_and_exit  # exits once done, whatever threads are left

    run_and_exit(main)
