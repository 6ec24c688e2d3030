"""Evaluation once per perturbation: predicted mean profiles, GEARS metrics, subgroups."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch

from gears.choices import CHOICES
from gears.data.conditions import CTRL
from gears.device import to_device, to_host
from gears.distributed import DistEnv, all_gather_objects
from gears.errors import GearsInputError

EVAL_CHUNK = 64  # conditions per forward; fixed so results do not depend on the world size
EVAL_PAIRING_EPOCH = 0  # evaluation pairs each cell with the control drawn for epoch 0
# How a perturbation's predicted mean is formed from the network's predicted change:
# all = change + mean of all control cells (exact: x enters the network only as a residual);
# paired = change + mean of the control cells paired with its cells (GEARS's protocol, which
# adds the sampling noise of ~50 random control cells to every prediction).


@torch.no_grad()
def predict_deltas(
    net: torch.nn.Module, pert_index: np.ndarray, env: DistEnv | None = None
) -> tuple[np.ndarray, np.ndarray | None]:
    """The network's response (and log-variance) per perturbation row, batch-norm in eval mode.

    pert_index [C, P] -> delta [C, G] float64 (logvar [C, G] or None). Chunks of EVAL_CHUNK rows
    are dealt round-robin to ranks and gathered, so every rank gets the full, identical result.
    """
    env = env or DistEnv()
    was_training = net.training
    net.eval()
    device = next(net.parameters()).device
    chunks = np.array_split(np.arange(len(pert_index)), max(1, -(-len(pert_index) // EVAL_CHUNK)))
    mine = {}
    for c in range(env.rank, len(chunks), env.world_size):
        out = net(to_device(torch.as_tensor(pert_index[chunks[c]]), device))
        delta, logvar = out if isinstance(out, tuple) else (out, None)
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


def segment_mean(X, codes: np.ndarray, rows: np.ndarray, n_groups: int) -> np.ndarray:
    """Mean of X[rows[i]] over i per group codes[i], via a sparse indicator. -> [groups, genes]."""
    n = len(codes)
    ind = sp.csr_matrix((np.ones(n), (codes, rows)), shape=(n_groups, X.shape[0]))
    sums = ind @ X
    sums = sums.toarray() if sp.issparse(sums) else np.asarray(sums)
    return sums / np.maximum(np.bincount(codes, minlength=n_groups), 1)[:, None]


class Evaluator:
    """Scores a model on a split set with every cell's truth, caching the data-only parts."""

    def __init__(
        self,
        pert_data,
        env: DistEnv | None = None,
        net: torch.nn.Module | None = None,
        control_mean: str = "all",
    ):
        if control_mean not in CHOICES["eval.control_mean"]:
            raise GearsInputError(
                f"eval.control_mean must be one of {CHOICES['eval.control_mean']}, "
                f"got {control_mean!r}"
            )
        self.pd = pert_data
        self.env = env or DistEnv()
        self.net = net
        self.control_mean = control_mean
        self._cache: dict = {}

    def set_view(self, set_name: str) -> dict:
        """Conditions (no ctrl) of a set, their cells, truth means, mean paired control."""
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
        X = pd_.expr.numpy()
        view = {
            "conditions": conds,
            "cond_ids": ids,
            "rows": ds.rows[examples],
            "cell_condition": local,
            "truth_mean": segment_mean(X, local, ds.rows[examples], len(conds)),
            "pair_mean": segment_mean(
                X, local, ds.control_rows(examples, EVAL_PAIRING_EPOCH), len(conds)
            ),
        }
        self._cache[set_name] = view
        return view

    def control_means(self, set_name: str) -> np.ndarray:
        """The control profile each condition's predicted change is added to -> [C, G]."""
        view = self.set_view(set_name)
        if self.control_mean == "paired":
            return view["pair_mean"]
        return np.broadcast_to(np.asarray(self.pd.ctrl_mean, np.float64), view["pair_mean"].shape)

    def predict_means(self, set_name: str, net: torch.nn.Module | None = None) -> np.ndarray:
        """Mean predicted profile per condition [C, G] = response + control mean (see
        eval.control_mean: all control cells by default, or the cells paired with its cells)."""
        view = self.set_view(set_name)
        delta, _ = predict_deltas(
            net or self.net, self.pd.cond_pert_index[view["cond_ids"]], self.env
        )
        return delta + self.control_means(set_name)

    def quick(self, set_name: str, net: torch.nn.Module | None = None) -> dict[str, float]:
        """The per-epoch validation metrics: mse, mse_de, pearson, pearson_delta (means)."""
        view = self.set_view(set_name)
        if not view["conditions"]:
            return {}
        pred = self.predict_means(set_name, net)
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
        from gears import metrics

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
