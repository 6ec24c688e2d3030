"""The Virtual Cell Challenge 2026 score of a run's test split: cell-eval2's vcc2026 preset.

cell-eval2 (Arc Institute; `pip install -r requirements-eval.txt`) defines the 2026 score:
six members, each raw value u rescaled as s = (u - b) / (r - b) with the member's own clamps,
where b is the value of the preset's mean-response baseline (one average perturbation response
emitted for every perturbation, built from the same real cells and scored as a submission) and
r the replicate anchor (the real cells scored against themselves: each perturbation's cells
and the controls split in two disjoint halves, one half scored against the other, five seeded
splits averaged). 0 is the baseline, 1 a repeat of the experiment; a context's score is the
mean of the six. Here b and r are computed by cell-eval2's own builders
(`build_generic_baseline`, `compute_replicate_anchor`) on the test split's real cells, and each
member is rescaled by its catalog policy (`score_one`), as `cell-eval2 score --real-bundle`
does; `tests/test_vcc2026.py` checks the numbers against that command.

What is not the official procedure: the official baseline averages only constructs passing a
cell-count and knock-down filter, and its reference data is downsampled to 400 cells per
perturbation at a median of 20,000 UMI per cell; here every test perturbation's cells count,
as they are. DE runs on pdex (CPU, `DE_BACKEND`); the challenge's bundles were built with a
GPU engine, and DE numbers differ between engines.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import scipy.sparse as sp

from gears.data.conditions import CTRL, condition_genes
from gears.errors import GearsInputError
from gears.eval.counts import raw_counts
from gears.eval.predicted_cells import CountsSpec, counts_spec, prediction_adata
from gears.model.batch import declared_covariates, reads_x
from gears.train.evaluate import predict_deltas
from gears.train.saved_model import MAX_SAVED_CONTROL_CELLS, control_sample_rows

PRESET = "vcc2026"
DE_BACKEND = "pdex"  # a CPU engine: 'auto' picks gpudge on a CUDA host, or refuses without it
# The scored members, in cell-eval2's catalog order (cell_eval2.competition.competition_members).
MEMBERS = (
    "pds_cosine",
    "expr_mse_unbiased_capped_norm",
    "de_wilcoxon_lfc_nmae",
    "de_wilcoxon_direction_fidelity_yield_raw",
    "de_wilcoxon_direction_reach_raw",
    "de_wilcoxon_sig_jaccard",
)
LOWER_IS_BETTER = ("de_wilcoxon_lfc_nmae", "expr_mse_unbiased_capped_norm")
INSTALL = (
    "cell-eval2 is not installed; install the optional evaluation extra with "
    "`pip install -r requirements-eval.txt` (Python >= 3.11; it keeps the project's "
    "torch/numpy/pandas)"
)


def require_cell_eval2() -> None:
    """Raise GearsInputError with the install line when cell-eval2 or its CPU DE engine is
    missing."""
    try:
        import cell_eval2  # noqa: F401
        import pdex  # noqa: F401
    except ImportError:
        raise GearsInputError(INSTALL) from None


def require_scorable(cfg, network, per_context: bool) -> None:
    """eval.cell_eval2 scores one context's model at a time, its test cells turned into cells
    as predict.py writes them (a saved control cell plus its perturbation's change): one model
    across contexts, or a network that reads the control cell or covariates, is refused before
    training, by name. per_context: gears.cli.contexts.one_model_per_context(cfg)."""
    if reads_x(network) or declared_covariates(network):
        reads = "x" if reads_x(network) else list(declared_covariates(network))
        raise GearsInputError(
            f"eval.cell_eval2 scores networks that read neither the control cell nor "
            f"covariates; {network.__name__} reads {reads}: set eval.cell_eval2=false, or "
            "train one model per context with a network that does not read the context"
        )
    if cfg.data.context_key is not None and not per_context:
        raise GearsInputError(
            "eval.cell_eval2 scores each context on its own, one model per context: set "
            "data.context_models=auto (or per_context), or eval.cell_eval2=false"
        )


def vcc2026_config(
    pert_col: str,
    control: str,
    input_type: str = "counts",
    threads: int = -1,
    target_gene_map: dict[str, str | None] | None = None,
):
    """The vcc2026 preset with this data's perturbation column and control label, on the CPU
    (device cpu, DE_BACKEND), at input_type counts (the challenge) or lognorm."""
    from dataclasses import replace

    from cell_eval2 import EvalConfig

    cfg = EvalConfig.from_preset(PRESET)
    return replace(
        cfg,
        pert_col=pert_col,
        control=control,
        input_type=input_type,
        device="cpu",
        num_threads=threads,
        gather_threads=threads,
        target_gene_map=target_gene_map or None,
        de=replace(cfg.de, backend=DE_BACKEND),
    )


def target_gene_map(labels: Sequence[str], genes: Sequence[str]) -> dict[str, str | None]:
    """Each perturbation label's target gene for cell-eval2's target-gene exclusion: the label
    itself when it names a measured gene, else None (declared to have none: a gene outside
    the panel, or a double)."""
    measured = set(genes)
    return {label: (label if label in measured else None) for label in labels}


def _mean_row(agg) -> dict[str, float]:
    row = agg.filter(agg["statistic"] == "mean").drop("statistic").to_dicts()[0]
    return {k: (math.nan if v is None else float(v)) for k, v in row.items()}


def _named_member(text: str, members: Sequence[str]) -> str | None:
    """The member a cell-eval2 refusal names (its lfc_nmae reference says 'lfc_nmae')."""
    for m in sorted(members, key=len, reverse=True):
        if m in text:
            return m
    if "lfc_nmae" in text and "de_wilcoxon_lfc_nmae" in members:
        return "de_wilcoxon_lfc_nmae"
    return None


def _scoring_members(call, members: list[str], unscored: dict[str, str]):
    """call(members) -> (its result, the members it ran with). cell-eval2 refuses a whole
    computation when one member cannot be formed on this reference (on small data: too few
    genes clear a significance gate, or the panel's summed effect is not positive); such a
    member is left out, with cell-eval2's reason in `unscored`, and the others computed."""
    members = list(members)
    while members:
        try:
            return call(members), members
        except ValueError as e:
            culprit = _named_member(str(e), members)
            if culprit is None:
                raise
            unscored[culprit] = f"cell-eval2 refused it: {str(e).splitlines()[0][:300]}"
            members.remove(culprit)
    raise GearsInputError(
        "cell-eval2 can form no vcc2026 member on this test split (too few perturbations, "
        f"cells or responding genes): {unscored}"
    )


def scale_problem(member: str, baseline: float, replicate: float) -> str | None:
    """Why a member has no 0 = baseline, 1 = replicate scale on this split (cell-eval2's own
    reason: its policy refuses the replicate as an anchor, or the two ends leave no headroom),
    or None when it has one."""
    return _policy(member, baseline, replicate)[1]


def _policy(member: str, baseline: float, replicate: float):
    """(the member's catalog policy anchored at the replicate, None) or (None, the reason)."""
    from dataclasses import replace

    from cell_eval2.catalog import CATALOG
    from cell_eval2.scoring import is_degenerate

    ends = f"replicate {_num(replicate)}, mean-response baseline {_num(baseline)}"
    if not all(v is not None and math.isfinite(float(v)) for v in (baseline, replicate)):
        return None, f"no usable scale: an end is missing or not finite ({ends})"
    try:
        policy = replace(
            CATALOG[member].scoring, anchor=float(replicate), allow_negative_baseline=False
        )
    except ValueError as e:  # a replicate on the wrong side of the metric's worst value
        return None, f"no usable scale ({ends}): cell-eval2 refused the anchor: {e}"
    if is_degenerate(float(baseline), policy):
        return None, (
            f"no usable scale ({ends}): the replicate is not better than the baseline on this "
            "split (cell-eval2's is_degenerate)"
        )
    return policy, None


def _num(value) -> str:
    return "None" if value is None else f"{float(value):.4g}"


def rescale(member: str, raw: float, baseline: float, replicate: float) -> float | None:
    """A member's raw value on the 0 = baseline, 1 = replicate scale, with the clamps and
    penalty shape of its cell-eval2 catalog policy (as `score --real-bundle`); None when the
    two ends leave no usable scale (scale_problem says why). Never raises for any ends."""
    from cell_eval2.scoring import score_one

    policy, _ = _policy(member, baseline, replicate)
    if policy is None:
        return None
    value = None if raw is None or not math.isfinite(raw) else float(raw)
    return float(score_one(value, float(baseline), policy))


def score_vcc2026(
    predictions: dict[str, ad.AnnData],
    real: ad.AnnData,
    pert_col: str,
    control: str,
    input_type: str = "counts",
    threads: int = -1,
    outdir: str | Path | None = None,
) -> dict:
    """cell-eval2's vcc2026 score of each predicted AnnData against `real` (one context):
    predictions name -> cells (same genes as real, obs[pert_col] with real's labels).

    Returns {"preset", "input_type", "cell_eval2_version", "de_backend", "members",
    "baseline": {member: b}, "replicate": {member: r}, "unscored": {member: reason},
    "n_perturbations", "predictors": {name: {"raw": {member: u}, "scaled": {member: s},
    "score": mean of the scaled members, "scored_members": the members that mean is over}}}.
    A member without a usable scale on this split (its replicate not better than the baseline,
    too few cells or responding genes) is unscored with cell-eval2's reason, never an error.
    outdir: each predictor's aggregate (agg_<name>.csv)
    and the baseline's and anchor's values (anchors.csv)."""
    require_cell_eval2()
    from dataclasses import replace

    import cell_eval2
    from cell_eval2 import aggregate_metrics_wide, build_generic_baseline, compute_metrics
    from cell_eval2.anchor import compute_replicate_anchor
    from cell_eval2.run import metric_output_names

    # cell-eval2 reports every omitted perturbation and engine choice at WARNING level; its
    # numbers and ours are in metrics.json.
    for name in ("cell_eval2", "pdex"):
        logging.getLogger(name).setLevel(logging.ERROR)
    labels = sorted(set(real.obs[pert_col].astype(str)) - {control})
    tmap = target_gene_map(labels, list(real.var_names))
    cfg = vcc2026_config(pert_col, control, input_type, threads, tmap)
    emit = "dispersed" if input_type == "counts" else "tile"
    t0 = time.perf_counter()
    unscored: dict[str, str] = {}

    def baseline_of(members):
        return build_generic_baseline(
            real, config=replace(cfg, metrics=members), emit=emit, allow_degenerate=True
        )

    base, members = _scoring_members(baseline_of, list(MEMBERS), unscored)
    baseline = _mean_row(base.agg)
    for m in members:
        if not math.isfinite(baseline.get(m, math.nan)):
            unscored[m] = "no baseline value: no perturbation passes its reference-side gate"
    members = [m for m in members if m not in unscored]
    computed = list(members)  # raw values of these are reported even if they get no scale

    def replicate_of(members):
        _, anchor = compute_replicate_anchor(real, config=replace(cfg, metrics=members))
        return dict(zip(anchor["metric"].to_list(), anchor["replicate"].to_list()))

    replicate, members = _scoring_members(replicate_of, members, unscored)
    scored_cfg = replace(cfg, metrics=computed)
    names = metric_output_names(scored_cfg)
    scalable = []
    for m in members:
        problem = scale_problem(m, baseline[m], replicate[m])
        if problem is None:
            scalable.append(m)
        else:
            unscored[m] = problem
    out = {
        "preset": PRESET,
        "input_type": input_type,
        "cell_eval2_version": cell_eval2.__version__,
        "de_backend": DE_BACKEND,
        "baseline_emit": emit,
        "members": list(MEMBERS),
        "n_perturbations": len(labels),
        "baseline": {m: _finite(baseline.get(m)) for m in MEMBERS},
        "replicate": {m: _finite(replicate.get(m)) for m in MEMBERS},
        "unscored": {m: unscored[m] for m in MEMBERS if m in unscored},
        "predictors": {},
    }
    tables = {}
    for name, pred in predictions.items():
        try:
            agg = aggregate_metrics_wide(
                compute_metrics(pred, real, config=scored_cfg), metrics=names
            )
        except ValueError as e:  # cell-eval2 refuses this prediction: the others still count
            why = f"cell-eval2 could not score it: {str(e).splitlines()[0][:300]}"
            out["predictors"][name] = _unscored_predictor(why)
            continue
        tables[name] = agg
        raw = _mean_row(agg)
        scaled = {
            m: (
                rescale(m, raw.get(m, math.nan), baseline[m], replicate[m])
                if m in scalable
                else None
            )
            for m in MEMBERS
        }
        used = [m for m in MEMBERS if scaled[m] is not None]
        out["predictors"][name] = {
            "raw": {m: _finite(raw.get(m)) for m in MEMBERS},
            "scaled": scaled,
            "score": float(np.mean([scaled[m] for m in used])) if used else None,
            "n_scored": len(used),
            "scored_members": used,  # the members its score is the mean of
        }
    out["seconds"] = round(time.perf_counter() - t0, 1)
    if outdir is not None:
        outdir = Path(outdir)
        outdir.mkdir(parents=True, exist_ok=True)
        for name, agg in tables.items():
            agg.write_csv(outdir / f"agg_{name}.csv")
        base.agg.write_csv(outdir / "agg_mean_baseline.csv")
        pd.DataFrame({"baseline": out["baseline"], "replicate": out["replicate"]}).rename_axis(
            "member"
        ).to_csv(outdir / "anchors.csv")
    return out


def _unscored_predictor(why: str) -> dict:
    return {
        "raw": dict.fromkeys(MEMBERS),
        "scaled": dict.fromkeys(MEMBERS),
        "score": None,
        "n_scored": 0,
        "scored_members": [],
        "error": why,
    }


def _finite(value) -> float | None:
    return None if value is None or not math.isfinite(float(value)) else float(value)


# ------------------------------------------------------------------------- a run's test split
def test_split_scores(
    cfg, pert_data, net, conditions: Sequence[str], baseline_means: dict, out: Path
) -> dict:
    """The vcc2026 score of GEARS and of this project's baselines on a run's test split (one
    context), rank 0 only. Real side: the context's control cells and the test perturbations'
    cells, as raw counts rebuilt from the processed cells and their library sizes (data
    trained from counts, input_type counts), else as the log-normalised values (input_type
    lognorm). Predicted side, per predictor: as many cells per perturbation as real ones, each
    a control cell plus the predicted change (as predict.py), turned into counts by
    eval.counts_sampler at the real perturbation's median depth (what the challenge's counts
    file gives). A baseline that does not predict every test perturbation (additive on
    singles) is left out, named under "not_scored"."""
    require_cell_eval2()
    t0 = time.perf_counter()
    counts = pert_data.normalize_target_sum is not None and pert_data.library_size is not None
    input_type = "counts" if counts else "lognorm"
    key = pert_data.condition_key
    spelling = pert_data.condition_spelling
    control = spelling.get(CTRL, CTRL).strip()
    labels = [_label(c, spelling) for c in conditions]
    genes = [str(g) for g in pert_data.gene_names]
    X_all = pert_data.expr.numpy()
    ids = np.array([pert_data.cond_to_id[c] for c in conditions], dtype=np.int64)
    test_rows = np.flatnonzero(np.isin(pert_data.cell_condition, ids))
    rows = np.r_[pert_data.ctrl_rows, test_rows]
    X = _dense(X_all, rows)
    library = None
    if counts:
        library = np.asarray(pert_data.library_size, dtype=np.float64)
        X = raw_counts(X, library[rows], pert_data.normalize_target_sum)
    id_label = dict(zip(ids.tolist(), labels))
    real_labels = [control] * len(pert_data.ctrl_rows) + [
        id_label[i] for i in pert_data.cell_condition[test_rows].tolist()
    ]
    real = ad.AnnData(
        X=sp.csr_matrix(X, dtype=np.float32),
        obs=pd.DataFrame(
            {key: pd.Categorical(real_labels)},
            index=pd.Index([f"real{i}" for i in range(len(rows))]),
        ),
        var=pd.DataFrame(index=genes),
    )
    # The control cells predictions start from: the sample a saved model keeps (predict.py).
    pool = control_sample_rows(pert_data.ctrl_rows, MAX_SAVED_CONTROL_CELLS, cfg.seed)
    controls = ad.AnnData(
        X=sp.csr_matrix(_dense(X_all, pool)),
        obs=pd.DataFrame(index=[f"ctrl{i}" for i in range(len(pool))]),
        var=pd.DataFrame(index=genes),
    )
    n_real = pd.Series(real_labels[len(pert_data.ctrl_rows) :]).value_counts()
    n_cells = [int(n_real[label]) for label in labels]
    spec = None
    if counts:
        depth = (
            pd.Series(library[test_rows])
            .groupby(np.array(real_labels[len(pert_data.ctrl_rows) :]))
            .median()
        )
        pool_library = library[pool]
        spec = CountsSpec(
            target_sum=float(pert_data.normalize_target_sum),
            library_size=pool_library,
            depth=np.array([depth[label] for label in labels]) / float(np.median(pool_library)),
            sampler=cfg.eval.counts_sampler,
            seed=int(cfg.seed),
        )
    delta, _ = predict_deltas(net, pert_data.cond_pert_index[ids])
    deltas = {"gears": delta}
    deltas.update({n: m - pert_data.ctrl_mean[None, :] for n, m in baseline_means.items()})
    predictions, not_scored = {}, {}
    for name, d in deltas.items():
        if np.isnan(d).any():
            not_scored[name] = "does not predict every test perturbation"
            continue
        if spec is not None and spec.sampler == "nb":
            info = {"normalize_target_sum": spec.target_sum}
            controls.obs["library_size"] = spec.library_size
            nb = counts_spec(info, controls, d, "nb", spec.seed)
            run_spec = spec._replace(theta=nb.theta, unit_rate=nb.unit_rate)
        else:
            run_spec = spec
        predictions[name] = prediction_adata(
            labels,
            list(conditions),
            d,
            n_cells,
            controls,
            key,
            control,
            seed=cfg.seed,
            counts=run_spec,
        )
    threads = cfg.train.threads or -1
    where = Path(out) / "cell_eval2"
    scores = score_vcc2026(predictions, real, key, control, input_type, threads, where)
    scores["not_scored"] = not_scored
    scores["counts_sampler"] = cfg.eval.counts_sampler if counts else None
    print(
        f"cell-eval2 ({PRESET}, {input_type}) scored {len(predictions)} predictors on "
        f"{len(labels)} test perturbations in {time.perf_counter() - t0:.1f}s",
        flush=True,
    )
    return scores


def _label(condition: str, spelling: dict[str, str]) -> str:
    """A condition in the data's own spelling (bare symbols when the data writes them so)."""
    if condition in spelling:
        return spelling[condition].strip()
    genes = condition_genes(condition)
    return genes[0] if len(genes) == 1 else condition


def _dense(X, rows: np.ndarray) -> np.ndarray:
    part = X[rows]
    return np.asarray(part.toarray() if sp.issparse(part) else part, dtype=np.float32)


# ----------------------------------------------------------------------------------- tables
def print_vcc2026_table(scores: dict, title: str = "") -> None:
    """Each member's raw value and its rescaled score per predictor, beside the baseline and
    replicate ends it is scaled between."""
    if not scores or not scores.get("predictors"):
        return
    cols = list(scores["predictors"])
    width = max(len(m) for m in MEMBERS) + 2
    print(
        f"\ncell-eval2 {PRESET} ({scores['input_type']}{title}; {scores['n_perturbations']} "
        "test perturbations; scaled: 0 = mean-response baseline, 1 = replicate; lower raw "
        f"{' and '.join(LOWER_IS_BETTER)} is better)"
    )
    head = ["baseline", "replicate", *cols]
    print("member".ljust(width) + "".join(c[:11].rjust(12) for c in head))
    for m in MEMBERS:
        raw = [scores["baseline"][m], scores["replicate"][m]]
        raw += [scores["predictors"][c]["raw"][m] for c in cols]
        print(m.ljust(width) + "".join(_cell(v) for v in raw))
        scaled = [None, None] + [scores["predictors"][c]["scaled"][m] for c in cols]
        print(
            "  scaled".ljust(width) + "".join(_cell(v, blank=i < 2) for i, v in enumerate(scaled))
        )
    print(
        "score (mean scaled)".ljust(width)
        + " " * 24
        + "".join(_cell(scores["predictors"][c]["score"]) for c in cols)
    )
    for m, why in scores.get("unscored", {}).items():
        print(f"  {m} unscored: {why}")


def _cell(value, blank: bool = False) -> str:
    if blank:
        return " " * 12
    return ("-" if value is None else f"{value:.4f}").rjust(12)
