"""What a trained model scores, apart from how it was trained and where results are written:
GEARS's metrics on the test set beside the baselines' and on the training set (the fit),
then cell-eval's and cell-eval2's scores; each returned as plain dicts (metrics.json's parts).

The predictions to score are gathered by every rank (`gather_predictions`, collectives); all
the rest runs on rank 0 alone, after the ranks have left the process group."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gears.config import Config
from gears.data.conditions import condition_genes
from gears.eval import vcc2026
from gears.eval.baselines import baseline_predictions
from gears.eval.predicted_cells import score_test_set
from gears.eval.predictor import Predictor
from gears.eval.report import held_out, matched_scores, no_change_validation
from gears.train.evaluate import Evaluator


@dataclass
class Predictions:
    """The model's mean predictions [C, G] for the test and training perturbations, in the
    evaluator's order; None for a set without perturbations."""

    test: np.ndarray | None
    train: np.ndarray | None


@dataclass
class Scores:
    """results: metrics.json's scores (val_no_change, test, subgroups, baselines,
    baseline_subgroups, and where there is a test set test_conditions, matched and with
    eval.control_mean=paired paired_control_alone; where there is a training set train_fit and
    train_fit_baselines). conditions: the test units' conditions; baseline_means: baseline ->
    [units, G] its predicted means on them (what the plots and the scorers compare with)."""

    results: dict
    tested: bool = False  # whether the split has test perturbations (then test is scored)
    conditions: list[str] = field(default_factory=list)
    baseline_means: dict[str, np.ndarray] = field(default_factory=dict)


def perturbed(pert_data, set_name: str) -> list[str]:
    """A split set's conditions other than the control."""
    return [c for c in pert_data.set2conditions.get(set_name, []) if c != "ctrl"]


def gather_predictions(evaluator: Evaluator, pert_data) -> Predictions:
    """The test and training predictions; every rank takes part (each is gathered)."""
    test = evaluator.predict_means("test") if perturbed(pert_data, "test") else None
    train = evaluator.predict_means("train") if perturbed(pert_data, "train") else None
    return Predictions(test, train)


def score(evaluator: Evaluator, pert_data, predictions: Predictions, control_mean: str) -> Scores:
    """GEARS's metrics and the baselines' on the test set, and the fit on the training set
    (rank 0). control_mean: the protocol the predictions used (eval.control_mean)."""
    results = {
        "val_no_change": no_change_validation(evaluator, pert_data.ctrl_mean),
        "test": {},
        "subgroups": {},
        "baselines": {},
        "baseline_subgroups": {},
    }
    scores = Scores(results)
    if predictions.test is not None:
        scores = test_scores(evaluator, pert_data, predictions.test, control_mean, results)
    if predictions.train is not None:
        results.update(train_fit(evaluator, pert_data, predictions.train))
    return scores


def test_scores(
    evaluator: Evaluator, pert_data, pred_mean: np.ndarray, control_mean: str, results: dict
) -> Scores:
    """GEARS's metrics on the test set (overall and per subgroup) and every baseline's beside
    them, written into results. pred_mean: [C, G] the model's test predictions."""
    scored = evaluator.full("test", pred_mean=pred_mean)
    full_by_predictor = {"gears": scored}
    results["test"] = scored["summary"].pop("overall")
    results["subgroups"] = scored["summary"]
    view = evaluator.set_view("test")
    train_conds = perturbed(pert_data, "train")
    train_means = dict(zip(train_conds, pert_data.condition_means(train_conds)))
    baseline_means = baseline_predictions(
        train_means, pert_data.ctrl_mean, view["conditions"], list(pert_data.gene_names)
    )
    for name, bpred in baseline_means.items():
        if np.isnan(bpred).all():
            continue
        full_by_predictor[name] = evaluator.full("test", pred_mean=bpred)
        b = full_by_predictor[name]["summary"]
        results["baselines"][name] = b.pop("overall")
        results["baseline_subgroups"][name] = b
    groups = (pert_data.subgroup or {}).get("test_subgroup") or {}
    results["test_conditions"] = held_out(view["conditions"], groups)
    results["matched"] = matched_scores(full_by_predictor)
    if control_mean == "paired":  # what the protocol adds, for the report
        control = evaluator.control_means("test")
        results["paired_control_alone"] = evaluator.full("test", pred_mean=control)["summary"][
            "overall"
        ]
    return Scores(results, True, evaluator.set_view("test")["conditions"], baseline_means)


def train_fit(evaluator: Evaluator, pert_data, pred_mean: np.ndarray) -> dict:
    """GEARS's metrics on the training perturbations (how well the kept model fits what it was
    trained on) beside the baselines on the same perturbations; rank 0 only.

    pred_mean: [C, G] the model's mean predictions for evaluator.set_view("train")["conditions"].
    Returns {"train_fit": {metric: value}, "train_fit_baselines": {baseline: {metric: value}}}.
    The baselines see these perturbations' own means (train_mean averages them, additive sums
    their singles), so this is a fit comparison, not a generalisation one.
    """
    conditions = evaluator.set_view("train")["conditions"]
    fit = evaluator.full("train", pred_mean=pred_mean)["summary"]["overall"]
    train_means = dict(zip(conditions, pert_data.condition_means(conditions)))
    baselines = {}
    for name, bpred in baseline_predictions(
        train_means, pert_data.ctrl_mean, conditions, list(pert_data.gene_names)
    ).items():
        if not np.isnan(bpred).all():
            baselines[name] = evaluator.full("train", pred_mean=bpred)["summary"]["overall"]
    return {"train_fit": fit, "train_fit_baselines": baselines}


def cell_eval_scores(
    cfg: Config, pert_data, predictor: Predictor, conditions, baseline_means, out: Path
) -> dict:
    """cell-eval's vcc profile on the test perturbations for GEARS and every baseline, each
    turned into cells the same way (control cell + predicted change), its files in
    out/cell_eval. Rank 0 only."""
    delta, _ = predictor.predict_changes([condition_genes(c) for c in conditions])
    deltas = {"gears": delta}
    deltas.update({name: m - pert_data.ctrl_mean[None, :] for name, m in baseline_means.items()})
    t0 = time.perf_counter()
    scores = score_test_set(
        pert_data,
        conditions,
        deltas,
        out / "cell_eval",
        seed=cfg.seed,
        threads=cfg.train.threads or -1,
    )
    print(
        f"cell-eval scored {len(scores)} predictors in {time.perf_counter() - t0:.1f}s", flush=True
    )
    return scores


def cell_eval2_scores(
    cfg: Config, pert_data, predictor: Predictor, conditions, baseline_means, out: Path
) -> dict:
    """cell-eval2's Virtual Cell Challenge 2026 scores of the test split for GEARS and every
    baseline (gears.eval.vcc2026.test_split_scores). Rank 0 only."""
    return vcc2026.test_split_scores(cfg, pert_data, predictor.net, conditions, baseline_means, out)
