"""Evaluation once per perturbation: predicted mean profiles, GEARS metrics, subgroups."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch

from gears.choices import CHOICES
from gears.data.conditions import CTRL
from gears.data.covariates import cell_codes
from gears.device import to_device, to_host
from gears.errors import GearsInputError
from gears.model.batch import (
    ModelBatch,
    declared_covariates,
    predicted_expression,
    reads_x,
    split_output,
)
from gears.train import metrics
from gears.train.distributed import DistEnv, all_gather_objects

EVAL_CHUNK = 64  # conditions per forward; fixed so results do not depend on the world size
EVAL_PAIRING_EPOCH = 0  # evaluation pairs each cell with the control drawn for epoch 0
# How a perturbation's predicted mean is formed from the network's predicted change:
# all = change + mean of all control cells (exact: x enters the network only as a residual);
# paired = change + mean of the control cells paired with its cells (GEARS's protocol, which
# adds the sampling noise of ~50 random control cells to every prediction).


@torch.no_grad()
def predict_deltas(
    net: torch.nn.Module,
    pert_index: np.ndarray,
    env: DistEnv | None = None,
    covariates: dict[str, np.ndarray] | None = None,
    x=None,
    runner=None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """The network's predicted change (and log-variance) per row, batch-norm in eval mode.

    pert_index [N, P]; covariates: name -> [N] codes, of which the network is given the names
    it declares; x: for a network that reads x, each row's control cell, [N, G] or a function
    of row positions giving their [n, G] rows. -> change [N, G] float64 (logvar [N, G] or
    None). Chunks of EVAL_CHUNK rows are dealt round-robin to ranks and gathered, so every rank
    gets the full, identical result. runner: a ForwardRunner of this network
    (gears/train/graph_step.py,
    train.cuda_graphs) runs each chunk, EVAL_CHUNK rows padded, as a replayed graph; the same
    numbers to float rounding (tests/test_graph_eval.py).
    """
    env = env or DistEnv()
    was_training = net.training
    net.eval()
    device = next(net.parameters()).device
    codes = _declared_codes(net, covariates or {})
    wants_x = reads_x(net)
    if wants_x and x is None:
        raise GearsInputError("this network reads x: give each row's control cell")
    n = len(pert_index)
    if runner is not None and runner.net is net:  # fixed-size chunks, the last one padded
        size = runner.rows
        chunks = [np.arange(s, min(s + size, n)) for s in range(0, max(n, 1), size)]
    else:
        runner, chunks = None, np.array_split(np.arange(n), max(1, -(-n // EVAL_CHUNK)))
    mine = {}
    for c in range(env.rank, len(chunks), env.world_size):
        rows = chunks[c]
        if runner is not None:
            inputs = _rows_of(x, rows) if wants_x else None
            mine[c] = runner.run(pert_index[rows], inputs, {k: v[rows] for k, v in codes.items()})
            continue
        batch = ModelBatch(
            to_device(torch.as_tensor(pert_index[rows]), device),
            x=to_device(_rows_of(x, rows), device) if wants_x else None,
            covariates={k: to_device(torch.as_tensor(v[rows]), device) for k, v in codes.items()},
        )
        delta, logvar = split_output(net(batch))
        mine[c] = (
            to_host(delta.float()).numpy(),
            None if logvar is None else to_host(logvar.float()).numpy(),
        )
    net.train(was_training)
    gathered = {}
    for part in all_gather_objects(env, mine):
        gathered.update(part)
    deltas = [gathered[c][0] for c in range(len(chunks)) if len(chunks[c])]
    logvars = [gathered[c][1] for c in range(len(chunks)) if len(chunks[c])]
    delta = np.concatenate(deltas).astype(np.float64)
    logvar = None if logvars[0] is None else np.concatenate(logvars).astype(np.float64)
    return delta, logvar


def _declared_codes(net: torch.nn.Module, covariates: dict[str, np.ndarray]) -> dict:
    """The codes of the covariates the network declares, by name (a missing one is an error)."""
    names = declared_covariates(net)
    missing = [n for n in names if n not in covariates]
    if missing:
        raise GearsInputError(
            f"the network reads covariates {missing}; give their values (e.g. "
            f"GEARS.predict(..., covariates={{{missing[0]!r}: ...}}))"
        )
    return {n: np.asarray(covariates[n], dtype=np.int64) for n in names}


def _rows_of(x, rows: np.ndarray) -> torch.Tensor:
    """Rows `rows` of x ([N, G] array or tensor, or a function of row positions)."""
    if callable(x):
        return torch.as_tensor(x(rows), dtype=torch.float32)
    return torch.as_tensor(np.asarray(x)[rows], dtype=torch.float32)


def segment_mean(X, codes: np.ndarray, rows: np.ndarray, n_groups: int) -> np.ndarray:
    """Mean of X[rows[i]] over i per group codes[i], via a sparse indicator. -> [groups, genes]."""
    n = len(codes)
    ind = sp.csr_matrix((np.ones(n), (codes, rows)), shape=(n_groups, X.shape[0]))
    sums = ind @ X
    sums = sums.toarray() if sp.issparse(sums) else np.asarray(sums)
    return sums / np.maximum(np.bincount(codes, minlength=n_groups), 1)[:, None]


class Evaluator:
    """Scores a model on a split set with every cell's truth, caching the data-only parts.

    The unit scored is what the network's output depends on: a perturbation for GEARS (one row
    per condition: change + control mean, exact), a (perturbation, covariate values) group for
    a network that reads covariates (codes against `categories`, the model's), and for a
    network that reads x the mean over a unit's cells of each cell's prediction from its paired
    control cell (eval.control_mean=paired's cells, whatever control_mean says).
    """

    def __init__(
        self,
        pert_data,
        env: DistEnv | None = None,
        net: torch.nn.Module | None = None,
        control_mean: str = "all",
        categories: dict[str, list[str]] | None = None,
    ):
        self.pd = pert_data
        self.env = env or DistEnv()
        self.net = net
        self.control_mean = control_mean
        self.categories = dict(categories or {})
        self._cache: dict = {}
        # A ForwardRunner of `net` (gears/train/graph_step.py): set by the Trainer with
        # train.cuda_graphs on; predict_deltas then runs it (None: eager forwards).
        self.forward_runner = None

    @property
    def control_mean(self) -> str:
        """How a predicted mean is formed (eval.control_mean): all or paired."""
        return self._control_mean

    @control_mean.setter
    def control_mean(self, name: str) -> None:
        if name not in CHOICES["eval.control_mean"]:
            raise GearsInputError(
                f"eval.control_mean must be one of {CHOICES['eval.control_mean']}, got {name!r}"
            )
        self._control_mean = name

    def set_view(self, set_name: str) -> dict:
        """The units of a set (its conditions, no ctrl; with covariates, its distinct
        (condition, codes) groups), their cells, truth means, mean paired control.

        "conditions" [C] and "cond_ids" [C] name each unit's condition, "covariates" its codes
        (name -> [C]), "cell_condition" [cells] each cell's unit, "rows" and "pair_rows" the
        cells' rows and their paired control cells' (EVAL_PAIRING_EPOCH)."""
        if set_name in self._cache:
            return self._cache[set_name]
        pd_ = self.pd
        conds = [c for c in pd_.set2conditions[set_name] if c != CTRL and c in pd_.cond_to_id]
        ids = np.array([pd_.cond_to_id[c] for c in conds], dtype=np.int64)
        ds = pd_.example_set(set_name)
        keep = np.isin(ds.cond, ids)
        examples = np.flatnonzero(keep)
        order = np.argsort(ids)  # position of each example's condition within `conds`
        local = order[np.searchsorted(ids[order], ds.cond[examples])]
        rows, covariates = ds.rows[examples], {}
        names = declared_covariates(self.net) if self.net is not None else ()
        if names:  # units: the distinct (condition, covariate codes) of the cells
            codes = self.cell_covariates(names)
            key = np.stack([local, *(codes[n][rows] for n in names)], axis=1)
            units, local = np.unique(key, axis=0, return_inverse=True)
            local = local.reshape(-1)
            conds, ids = [conds[i] for i in units[:, 0]], ids[units[:, 0]]
            covariates = {n: units[:, i + 1] for i, n in enumerate(names)}
        X = pd_.expr.numpy()
        pair_rows = ds.control_rows(examples, EVAL_PAIRING_EPOCH)
        view = {
            "conditions": conds,
            "cond_ids": ids,
            "covariates": covariates,
            "rows": rows,
            "pair_rows": pair_rows,
            "cell_condition": local,
            "truth_mean": segment_mean(X, local, rows, len(conds)),
            "pair_mean": segment_mean(X, local, pair_rows, len(conds)),
        }
        self._cache[set_name] = view
        return view

    def cell_covariates(self, names: tuple[str, ...]) -> dict[str, np.ndarray]:
        """Each cell row's code [cells] per covariate, against the model's categories."""
        missing = [n for n in names if n not in self.categories]
        if missing:
            raise GearsInputError(
                f"the network reads covariates {missing}: give the Evaluator the model's "
                "categories (GEARS does), so codes mean what they meant in training"
            )
        return cell_codes(self.pd, {n: self.categories[n] for n in names})

    def control_means(self, set_name: str) -> np.ndarray:
        """The control profile each unit's predicted change is added to -> [C, G]: the mean of
        the control cells its cells are drawn from (all of them; with contexts, those of each
        cell's context), or with control_mean=paired the mean of the cells paired with its
        cells."""
        view = self.set_view(set_name)
        if self.control_mean == "paired":
            return view["pair_mean"]
        contexts = getattr(self.pd, "cell_context", None)
        if contexts is None:
            shape = view["pair_mean"].shape
            return np.broadcast_to(np.asarray(self.pd.ctrl_mean, np.float64), shape)
        if "context_mean" not in view:  # each cell's context's control mean, per unit
            n_units, n_contexts = len(view["conditions"]), len(self.pd.contexts)
            cells = sp.csr_matrix(
                (np.ones(len(view["rows"])), (view["cell_condition"], contexts[view["rows"]])),
                shape=(n_units, n_contexts),
            )
            share = cells.multiply(1.0 / np.maximum(cells.sum(1), 1)).tocsr()
            view["context_mean"] = np.asarray(share @ self.pd.context_ctrl_means)
        return view["context_mean"]

    def predict_means(self, set_name: str, net: torch.nn.Module | None = None) -> np.ndarray:
        """Mean predicted profile per unit [C, G] = its predicted change + its control mean
        (see control_means); for a network that reads x, the mean over the unit's cells of
        each cell's prediction from its paired control cell."""
        view, net = self.set_view(set_name), net or self.net
        if reads_x(net):
            return self._per_cell_means(view, net)
        delta, _ = predict_deltas(
            net,
            self.pd.cond_pert_index[view["cond_ids"]],
            self.env,
            view["covariates"],
            runner=self.forward_runner,
        )
        return predicted_expression(delta, self.control_means(set_name))

    def _per_cell_means(self, view: dict, net: torch.nn.Module) -> np.ndarray:
        """A network that reads x: every cell of the set through the network with its paired
        control cell, each prediction x + change, the mean per unit."""
        unit = view["cell_condition"]
        pert_index = self.pd.cond_pert_index[view["cond_ids"][unit]]
        covariates = {n: c[unit] for n, c in view["covariates"].items()}
        pair_rows = view["pair_rows"]

        def x(cells: np.ndarray) -> torch.Tensor:
            return to_host(self.pd.expr.rows(pair_rows[cells]))

        change, _ = predict_deltas(net, pert_index, self.env, covariates, x, self.forward_runner)
        X = self.pd.expr.numpy()
        pair = X[pair_rows]
        pair = pair.toarray() if sp.issparse(pair) else np.asarray(pair, np.float64)
        cells = predicted_expression(change, pair)
        return segment_mean(cells, unit, np.arange(len(unit)), len(view["conditions"]))

    def quick(
        self,
        set_name: str,
        net: torch.nn.Module | None = None,
        pred_mean: np.ndarray | None = None,
    ) -> dict[str, float]:
        """The per-epoch validation metrics: mse, mse_de, pearson, pearson_delta (means).
        pred_mean [C, G] scores given predictions (a baseline) instead of the network's."""
        view = self.set_view(set_name)
        if not view["conditions"]:
            return {}
        pred = self.predict_means(set_name, net) if pred_mean is None else pred_mean
        truth = view["truth_mean"]
        de = self.pd.de_idx[view["cond_ids"]]
        valid = de >= 0
        rows = np.arange(len(de))[:, None]
        err_de = (pred[rows, de.clip(0)] - truth[rows, de.clip(0)]) ** 2
        ctrl = self.pd.ctrl_mean
        return {
            "mse": float(np.mean((pred - truth) ** 2)),
            "mse_de": float(np.mean((err_de * valid).sum(1) / valid.sum(1).clip(1))),
            "pearson": float(np.mean(_rowwise_pearson(pred, truth))),
            "pearson_delta": float(np.mean(_rowwise_pearson(pred - ctrl, truth - ctrl))),
        }

    def full(
        self, set_name: str, pred_mean: np.ndarray | None = None, net: torch.nn.Module | None = None
    ) -> dict:
        """GEARS's whole metric set per condition, averaged overall and per subgroup.

        pred_mean [C, G] scores given predictions (baselines) instead of the network's.
        Returns {"per_condition": {metric: [C]}, "summary": {"overall": ..., subgroup: ...}}.
        """
        view = self.set_view(set_name)
        if pred_mean is None:
            pred_mean = self.predict_means(set_name, net)
        if "hvg" not in self._cache:
            self._cache["hvg"] = metrics.top_variable_genes(self.pd.condition_means(), 200)
        ids = view["cond_ids"]
        covered = ~np.isnan(pred_mean).any(1)  # baselines may not cover every condition
        X = self.pd.expr.numpy()
        cell_keep = covered[view["cell_condition"]]
        remap = np.cumsum(covered) - 1
        per = metrics.condition_metrics(
            pred_mean[covered],
            X[view["rows"][cell_keep]],
            remap[view["cell_condition"][cell_keep]],
            self.pd.ctrl_mean,
            self.pd.de_ranked_idx[ids[covered]],
            self.pd.non_dropout_de_idx[ids[covered]],
            self._cache["hvg"],
        )
        names = [c for c, k in zip(view["conditions"], covered) if k]
        groups = (self.pd.subgroup or {}).get(f"{set_name}_subgroup", {}) or {}
        summary = metrics.summarize(per, names, groups)
        return {"conditions": names, "per_condition": per, "summary": summary}


def _rowwise_pearson(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a - a.mean(1, keepdims=True)
    b = b - b.mean(1, keepdims=True)
    denom = np.sqrt((a * a).sum(1) * (b * b).sum(1))
    with np.errstate(invalid="ignore", divide="ignore"):
        r = (a * b).sum(1) / denom
    return np.nan_to_num(r)
