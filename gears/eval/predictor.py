"""Predictions of a network by gene names: predicted changes and means, the test set's units
and their plots; the one path of GEARS.predict, GI_predict, predict.py and a run's plots and
cell-eval scores."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from gears.data.conditions import CTRL, canonical_condition, condition_genes
from gears.data.covariates import CONTEXT, encode
from gears.device import to_host
from gears.errors import GearsInputError
from gears.eval.plots import plot_perturbation, split_baselines
from gears.model.batch import declared_covariates, predicted_expression, reads_x
from gears.train.evaluate import Evaluator, predict_deltas
from gears.train.saved_model import control_sample_rows

# A network that reads x predicts a perturbation's mean from this many control cells (a seeded
# sample), as cell-gears's predict() runs 300.
PREDICT_CONTROL_CELLS = 300


class Predictor:
    """net's predictions for pert_data's vocabulary. categories: covariate -> its values in code
    order (config.json's "covariates"); evaluator: the model's Evaluator (its test view, and its
    replayed forward with train.cuda_graphs); ctrl_expression: [G] the mean control profile a
    change is added to when no context's is asked for."""

    def __init__(
        self,
        pert_data,
        net: torch.nn.Module,
        categories: dict[str, list[str]],
        evaluator: Evaluator,
        ctrl_expression: np.ndarray,
    ):
        self.pert_data, self.net, self.categories = pert_data, net, categories
        self.evaluator, self.ctrl_expression = evaluator, ctrl_expression

    def pert_rows(self, pert_list: list[list[str]]) -> np.ndarray:
        """[len, 2] perturbation indices of each gene list (-1: no gene)."""
        rows = np.full((len(pert_list), 2), -1, dtype=np.int64)
        index = self.pert_data.node_map_pert
        for i, genes in enumerate(pert_list):
            genes = [genes] if isinstance(genes, str) else list(genes)
            genes = [g for g in genes if g != CTRL]
            if len(genes) > 2:
                raise GearsInputError(f"perturbation {genes} has more than two genes")
            for slot, gene in enumerate(genes):
                if gene not in index:
                    raise GearsInputError(
                        f"gene {gene!r} is not in the perturbation graph (genes with GO "
                        "annotations among the measured and perturbed genes); it cannot be "
                        "predicted. Choose genes from GEARS.pert_list (check the spelling), or "
                        "retrain with data.unmapped_perts=keep to include genes without GO terms"
                    )
                rows[i, slot] = index[gene]
        return rows

    def predict(self, pert_list: list[list[str]], covariates: dict[str, str] | None = None):
        """Mean expression after each perturbation, keyed 'A' or 'A_B' (GEARS.predict)."""
        delta, logvar = self.predict_changes(pert_list, covariates)
        keys = ["_".join(g for g in ([p] if isinstance(p, str) else p)) for p in pert_list]
        ctrl = self.control_mean(covariates)
        pred = {k: predicted_expression(delta[i], ctrl) for i, k in enumerate(keys)}
        if logvar is not None:
            return pred, {k: float(np.exp(-logvar[i].mean())) for i, k in enumerate(keys)}
        return pred

    def predict_changes(
        self, pert_list: list[list[str]], covariates: dict[str, str] | None = None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """The predicted change from control per perturbation, [len, G] float64, and the
        log-variance [len, G] or None (GEARS.predict_changes)."""
        net, rows = self.net, self.pert_rows(pert_list)
        codes = self.covariate_codes(declared_covariates(net), covariates, len(rows))
        runner = getattr(self.evaluator, "forward_runner", None)  # (train.cuda_graphs)
        if not reads_x(net):
            return predict_deltas(net, rows, covariates=codes, runner=runner)
        x = self.prediction_controls(covariates)  # [n, G]
        n = len(x)
        repeat = {k: np.repeat(v, n) for k, v in codes.items()}
        cells = np.repeat(rows, n, axis=0)
        x = np.tile(x, (len(rows), 1))
        change, logvar = predict_deltas(net, cells, covariates=repeat, x=x, runner=runner)
        mean = lambda a: None if a is None else a.reshape(len(rows), n, -1).mean(1)  # noqa: E731
        return mean(change), mean(logvar)

    def covariate_codes(self, names, values: dict[str, str] | None, n: int) -> dict:
        """Codes [n] of the given covariate values (each the same for every row)."""
        if not names:
            return {}
        values = values or {}
        missing = [name for name in names if name not in values]
        if missing:
            raise GearsInputError(
                f"this network reads covariates {list(names)}: give a value for {missing} "
                f"(e.g. covariates={{{missing[0]!r}: ...}}; the model knows "
                f"{self.categories[missing[0]][:10]})"
            )
        cats = self.categories
        return {name: np.repeat(encode([values[name]], cats[name], name), n) for name in names}

    def control_mean(self, covariates: dict[str, str] | None) -> np.ndarray:
        """The control mean a predicted change is added to: the context's when the data has
        contexts and a context is given, else all control cells'."""
        contexts = getattr(self.pert_data, "contexts", [])
        context = (covariates or {}).get(CONTEXT)
        if context is not None and context in contexts:
            return self.pert_data.context_ctrl_means[contexts.index(context)]
        return self.ctrl_expression

    def prediction_controls(self, covariates: dict[str, str] | None) -> np.ndarray:
        """The control cells a network that reads x predicts from -> [n, G] float32: a seeded
        sample of PREDICT_CONTROL_CELLS of the data's control cells (of the given context, when
        the data has contexts)."""
        pd_ = self.pert_data
        if not hasattr(pd_, "ctrl_rows"):
            raise GearsInputError(
                "this network reads the control cell x: predict needs control cells; load the "
                "model with its PertData (GEARS(pert_data).load_pretrained(path))"
            )
        rows = pd_.ctrl_rows
        context = (covariates or {}).get(CONTEXT)
        if context is not None and context in getattr(pd_, "contexts", []):
            rows = rows[pd_.cell_context[rows] == pd_.contexts.index(context)]
        rows = control_sample_rows(rows, PREDICT_CONTROL_CELLS, seed=0)
        return to_host(pd_.expr.rows(rows)).numpy()

    def test_units(self) -> list[tuple[str, dict[str, str]]]:
        """The scored units of the test set: (condition, {covariate: value}) in the
        evaluator's order ({} for a network that reads no covariate)."""
        view = self.evaluator.set_view("test")
        cats = self.categories
        return [
            (cond, {n: cats[n][int(c[i])] for n, c in view["covariates"].items()})
            for i, cond in enumerate(view["conditions"])
        ]

    def plot_perturbation(
        self,
        query: str,
        save_file: str | Path | None = None,
        covariates: dict[str, str] | None = None,
        *,
        baselines: dict | None = None,
        title: str = "",
    ):
        """GEARS's plot of one perturbation (GEARS.plot_perturbation)."""
        cond = canonical_condition(query)
        pred = self.predict([condition_genes(cond)], covariates)
        pred = pred[0] if isinstance(pred, tuple) else pred
        if baselines is None:
            baselines = split_baselines(self.pert_data, cond)
        return plot_perturbation(
            self.pert_data,
            cond,
            next(iter(pred.values())),
            save_file,
            baselines=baselines,
            title=title,
        )
