"""`python -m gears.cli.check_model [--config FILE] [key=value ...]`: the configured network
(model.impl, a fork's class included) against the network contract (gears/model/batch.py), and
the fast network (gears/model/network.py, kernels.py) against the reference
(gears/model/reference.py, or a fork of it with the same parameters) from the same weights,
layer by layer, on real batches of the configured screen (the embedded synthetic one by
default, offline). Exit 0 when every check passes and every layer agrees, 1 naming the first
failure.

The contract checks, which any network can run: its outputs have the declared shapes and are
finite; what it does not declare does not change its output (the control cell x, a covariate it
does not name); and unless it reads x, its distinct rows weighted by their cells give each cell
the same prediction and the loss the same gradients as one row per cell, in training and in
evaluation mode (a layer mixing rows, a plain BatchNorm1d or dropout, fails this one).

A fork whose training-mode output is random (dropout) cannot match one row per cell, or the
reference, draw for draw: check_model finds that out (two forwards from one state, two seeds)
and says in its first line how it compared it: with dropout off (its nn.Dropout modules in
evaluation mode, batch-norm still training) when that makes it deterministic, else in
evaluation mode only. The built-in networks are held to every training-mode check.

Each module both networks have by name is hooked; its output, the gradient reaching that output
and the gradients of its own parameters are compared. The fast network computes a batch's
distinct perturbations once (rows weighted by their cells), the reference every cell: rows are
matched by what they stand for (a distinct perturbation, a gene, a perturbable gene): every fast
row's output is compared with the reference's for the same thing, and gradients are summed over
the rows that stand for it.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections import defaultdict
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from gears.cli.job import DEFAULT_CONFIG, load_pert_data
from gears.compat.api import GEARS
from gears.config import Config, TrainConfig, load_config
from gears.model import NETWORKS, GEARSNet, is_class_spec
from gears.model.batch import ModelBatch, predicted_expression, split_output
from gears.model.contract import declared_covariates, per_cell_rows, reads_x
from gears.model.rows import batch_rows, cell_outputs, row_layout
from gears.torch_compat import is_batch_norm
from gears.train.distributed import DistEnv
from gears.train.engine import (
    CELL_ROWS,
    WEIGHTED_ROWS,
    CellRows,
    RepeatRows,
    Trainer,
    WeightedRows,
    seed_everything,
)

TOLERANCE = 1e-5  # relative to each tensor's scale (float64 nets, float32 loss: measured <= 2e-8)
# How a network's training mode is compared: as it is (deterministic), with its dropout modules
# in evaluation mode (a fork random through nn.Dropout), or not at all (random otherwise).
DETERMINISTIC, DROPOUT_OFF, EVAL_ONLY = "deterministic", "dropout off", "evaluation mode only"
RANDOMNESS = {
    DETERMINISTIC: "deterministic in training mode: compared in training and evaluation mode",
    DROPOUT_OFF: (
        "stochastic in training mode (dropout): training-mode checks ran with dropout off (its "
        "nn.Dropout modules in evaluation mode, batch-norm still training); evaluation-mode "
        "checks as usual"
    ),
    EVAL_ONLY: (
        "stochastic in training mode, and not through nn.Dropout modules: compared in "
        "evaluation mode only (training-mode checks skipped; use nn.Dropout modules to have "
        "them run with dropout off)"
    ),
}


@dataclass
class LayerResult:
    name: str
    output: float | None = None  # max relative error (None: not compared)
    gradient: float | None = None
    where: dict[str, str] = field(default_factory=dict)  # "output"/"gradient" -> first batch


@dataclass
class Report:
    layers: dict[str, LayerResult] = field(default_factory=dict)
    seen: set[str] = field(default_factory=set)  # modules called by either network
    tol: float = TOLERANCE
    problem: str = ""  # a failure before any layer could be compared
    contract: dict[str, str] = field(default_factory=dict)  # check -> "" (passed) or problem
    skipped: str = ""  # why the layer comparison did not run
    randomness: str = DETERMINISTIC  # how training mode was compared (RANDOMNESS)

    def first_departing(self) -> str | None:
        """The first layer (forward order) whose output departs; else the last whose gradient
        departs (the backward runs in reverse, so that is where it first went wrong)."""
        bad_out = [r.name for r in self.layers.values() if (r.output or 0) > self.tol]
        if bad_out:
            return bad_out[0]
        bad_grad = [r.name for r in self.layers.values() if (r.gradient or 0) > self.tol]
        return bad_grad[-1] if bad_grad else None

    @property
    def ok(self) -> bool:
        broken = any(self.contract.values())
        return not broken and not self.problem and self.first_departing() is None

    def table(self) -> str:
        lines = [f"randomness: {RANDOMNESS[self.randomness]}"]
        lines += [f"contract: {name}: {problem or 'ok'}" for name, problem in self.contract.items()]
        if self.problem:
            return "\n".join([*lines, f"check_model: {self.problem}"])
        if self.skipped:
            verdict = "OK" if self.ok else "FAILS"
            return "\n".join([*lines, f"layer comparison skipped: {self.skipped}", verdict])
        return "\n".join([*lines, self.layer_table()])

    def layer_table(self) -> str:
        width = max((len(n) for n in self.layers), default=5)
        lines = [f"{'layer':<{width}}  {'output':>9}  {'gradient':>9}", "-" * (width + 22)]
        fmt = lambda v: "-" if v is None else f"{v:9.1e}"  # noqa: E731
        for r in self.layers.values():
            mark = "  <-- departs" if max(r.output or 0, r.gradient or 0) > self.tol else ""
            lines.append(f"{r.name:<{width}}  {fmt(r.output):>9}  {fmt(r.gradient):>9}{mark}")
        not_compared = sorted(self.seen - set(self.layers))
        if not_compared:
            lines.append(f"not compared (no counterpart call): {', '.join(not_compared)}")
        first = self.first_departing()
        if first is None:
            lines.append(f"OK: every layer agrees within {self.tol:g} (relative to its scale)")
        else:
            where = self.layers[first].where
            what = "output" if "output" in where else "gradient"
            lines.append(
                f"DEPARTS first at {first}: its {what} in {where[what]} (tolerance {self.tol:g})"
            )
        return "\n".join(lines)


def _record(records: dict, name: str):
    def hook(module, inputs, output):
        out = output[0] if isinstance(output, tuple) else output
        if torch.is_tensor(out) and out.requires_grad:
            out.retain_grad()
        records[name].append(out)

    return hook


def _fast_keys(out: torch.Tensor, ctx: dict):
    """What each row of a fast-network module output stands for -> (kind, keys, rows): a
    distinct perturbation of the batch ("group"), one of its genes ("group x gene"), a gene or
    a perturbable gene ("pert"); rows selects the output's rows that have keys."""
    n_rows, groups, G = out.shape[0], ctx["row_group"], ctx["G"]
    if out.dim() == 3 and n_rows == len(groups) and out.shape[1] == ctx["fast_rows"].shape[1]:
        valid = ctx["fast_rows"] >= 0  # GO embeddings gathered per row and perturbation slot
        return "pert", ctx["fast_rows"][valid], valid
    if n_rows == len(groups):
        return "group", groups, slice(None)
    if n_rows == len(groups) * G:
        return "group x gene", (groups[:, None] * G + torch.arange(G)).reshape(-1), slice(None)
    if n_rows == G:
        return "gene", torch.arange(G), slice(None)
    if n_rows == ctx["n_perts"]:
        return "pert", torch.arange(n_rows), slice(None)
    return None, None, None


def _ref_keys(kind: str, n_rows: int, ctx: dict) -> torch.Tensor | None:
    """The same for a reference output's rows (one per cell, or per cell and gene), or None."""
    inverse, G = ctx["batch"].inverse, ctx["G"]
    perturbed = (ctx["batch"].uniq_pert_index[inverse] >= 0).any(1)
    if kind == "group" and n_rows in (len(inverse), int(perturbed.sum())):
        # (the fusion MLP sees the perturbed cells alone)
        return inverse if n_rows == len(inverse) else inverse[perturbed]
    if kind == "group x gene" and n_rows == len(inverse) * G:
        return (inverse[:, None] * G + torch.arange(G)).reshape(-1)
    if kind == "gene" and n_rows % G == 0:
        return torch.arange(G).repeat(n_rows // G)
    if kind == "pert" and n_rows == ctx["n_perts"]:
        return torch.arange(n_rows)
    return None


def _by_key(t: torch.Tensor, keys: torch.Tensor, n: int, total: bool) -> torch.Tensor:
    """Rows of t by key -> [n, ...]: the sum of each key's rows (total), or one of them (the
    outputs of one key's rows are equal)."""
    flat = t.reshape(len(keys), -1)
    out = torch.zeros(n, flat.shape[1], dtype=flat.dtype)
    return out.index_add_(0, keys, flat) if total else out.index_copy_(0, keys, flat)


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    err = (a - b).abs().max().item() if a.numel() else 0.0
    return err / max(b.abs().max().item() if b.numel() else 0.0, floor, 1e-30)


def _compare_outputs(fast_out, ref_out, ctx) -> tuple[float | None, float | None]:
    """(output error, gradient error) of one module call; (None, None) when the rows cannot be
    matched. Every fast row is compared with the reference's output for what it stands for;
    gradients are summed over the rows (cells) that stand for the same thing."""
    kind, k_fast, rows = _fast_keys(fast_out, ctx)
    k_ref = None if kind is None else _ref_keys(kind, ref_out.shape[0], ctx)
    if k_ref is None:
        return None, None
    n = int(max(k_fast.max(), k_ref.max())) + 1
    in_ref = torch.zeros(n, dtype=torch.bool)
    in_ref[k_ref] = True
    mine = in_ref[k_fast]  # fast rows whose key the reference has (not the weight-0 controls)
    ref_rows = _by_key(ref_out.detach(), k_ref, n, total=False)
    out_err = _rel(
        fast_out.detach()[rows][mine],
        ref_rows[k_fast[mine]].reshape_as(fast_out.detach()[rows][mine]),
    )
    if fast_out.grad is None or ref_out.grad is None:
        return out_err, None
    shared = torch.zeros(n, dtype=torch.bool)
    shared[k_fast[mine]] = True
    grad_fast = _by_key(fast_out.grad[rows], k_fast, n, total=True)[shared]
    grad_ref = _by_key(ref_out.grad, k_ref, n, total=True)[shared]
    return out_err, _rel(grad_fast, grad_ref)


def _row_group(batch, layout) -> torch.Tensor:
    """The distinct perturbation (of the batch) each row of the fast network's call stands for,
    for Trainer.loss_on's row layouts."""
    U = batch.uniq_pert_index.shape[0]
    if isinstance(layout, RepeatRows):
        return torch.arange(U).repeat_interleave(layout.repeats)
    if isinstance(layout, CellRows):
        return batch.inverse
    return torch.arange(U)


def _randomise_batchnorms(net: nn.Module, seed: int) -> None:
    """Batch-norm affine parameters and running statistics away from their initial 1 and 0,
    which would hide a swapped or dropped term (and put every ReLU after them at its kink)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in net.modules():
            if is_batch_norm(m) and m.affine:
                n = m.num_features
                m.weight.copy_(torch.rand(n, generator=gen, dtype=torch.float64) + 0.5)
                m.bias.copy_(torch.randn(n, generator=gen, dtype=torch.float64) * 0.5)
                if m.running_mean is not None:
                    m.running_mean.copy_(torch.randn(n, generator=gen, dtype=torch.float64) * 0.1)
                    m.running_var.copy_(torch.rand(n, generator=gen, dtype=torch.float64) + 0.5)


def check_model(cfg: Config, pert_data=None, batches: int = 2, tol: float = TOLERANCE) -> Report:
    """The configured network's contract checks (contract_checks); then, when it is GEARSNet,
    the reference or a per-cell fork with GEARSNet's parameters, the layer comparison: the fast
    network and that one with its weights (float64), `batches` training batches of random and
    of grouped batching through Trainer.loss_on (the engine's row layouts for each, and the
    weighted one), then one in evaluation mode."""
    env = DistEnv()
    pert_data = pert_data or load_pert_data(cfg, env)
    report = Report(tol=tol)
    seed_everything(cfg.seed)
    configured = GEARS(pert_data, device="cpu").initialize(cfg.model, cfg.data)
    if is_class_spec(cfg.model.impl):  # a fork may be random in training (dropout)
        report.randomness = randomness(configured, cfg, pert_data)
    report.contract = contract_checks(configured, cfg, pert_data, batches, tol, report.randomness)
    seed_everything(cfg.seed)
    model_cfg = replace(cfg.model, impl="fast", extra={})  # (the fork's options are its own)
    api = GEARS(pert_data, device="cpu").initialize(model_cfg, cfg.data)
    fast = api.model.double()
    (go, go_w), (co, co_w) = api.graphs["go"], api.graphs["coexpress"]
    if isinstance(configured.model, GEARSNet):
        ref = NETWORKS["reference"](
            model_cfg, pert_data.n_genes, len(api.pert_list), go, go_w, co, co_w
        )
    elif per_cell_rows(configured.model):
        ref = configured.model  # the reference, or a fork of it
    else:
        report.skipped = f"{type(configured.model).__name__} does not take one row per cell"
        return report
    if set(ref.state_dict()) != set(fast.state_dict()) and not isinstance(
        configured.model, GEARSNet
    ):
        extra = sorted(set(ref.state_dict()) ^ set(fast.state_dict()))
        report.skipped = f"{type(ref).__name__} and GEARSNet differ in parameters {extra[:6]}"
        return report
    _randomise_batchnorms(fast, cfg.seed)
    missing, unexpected = ref.double().load_state_dict(fast.state_dict(), strict=False)
    if missing or unexpected:
        report.problem = (
            f"the fast network's weights do not load into the reference: missing {missing}, "
            f"unexpected {unexpected}; give both the same parameter names and shapes"
        )
        return report
    trainers = [
        Trainer(net, pert_data, TrainConfig(), model_cfg, env, evaluator=api.evaluator)
        for net in (fast, ref)
    ]
    names = sorted(
        {n for n, _ in fast.named_modules() if n} & {n for n, _ in ref.named_modules() if n}
    )
    records = {id(net): defaultdict(list) for net in (fast, ref)}
    handles = [
        module.register_forward_hook(_record(records[id(net)], name))
        for net in (fast, ref)
        for name, module in net.named_modules()
        if name in names
    ]
    runs = []
    for batching in ("random", "grouped"):
        loaders = pert_data.get_dataloader_distributed(
            cfg.train.batch_size, cfg.train.test_batch_size, batching=batching, cells_per_group=4
        )
        for i, batch in enumerate(loaders["train_loader"]):
            if i == batches:
                break
            engine = trainers[0].row_layout(batch.counts)  # and the weighted layout
            layouts = [engine] if isinstance(engine, WeightedRows) else [engine, WEIGHTED_ROWS]
            runs += [
                (f"{batching} batch {i}, rows {layout!r}", batch, layout) for layout in layouts
            ]
    runs.append(("evaluation mode, " + runs[-1][0], runs[-1][1], "eval"))
    if report.randomness == EVAL_ONLY:
        runs = runs[-1:]
    try:
        for where, batch, layout in runs:
            _run(fast, ref, trainers, records, batch, layout, where, report, len(api.pert_list))
    finally:
        for h in handles:
            h.remove()
    return report


def set_mode(net: nn.Module, train: bool, how: str = DETERMINISTIC) -> nn.Module:
    """net.train(train); with dropout off (how=DROPOUT_OFF) its dropout modules stay in
    evaluation mode while the rest trains."""
    net.train(train)
    if train and how == DROPOUT_OFF:
        for m in net.modules():
            if isinstance(m, nn.modules.dropout._DropoutNd):
                m.eval()
    return net


def randomness(model, cfg: Config, pert_data) -> str:
    """How to compare `model.model` in training mode: DETERMINISTIC when two forwards of one
    training batch from one state with two seeds agree; DROPOUT_OFF when they agree once its
    nn.Dropout modules are off; EVAL_ONLY otherwise."""
    net = copy.deepcopy(model.model).double()
    _randomise_batchnorms(net, cfg.seed)
    inputs = _batches(model, cfg, pert_data, 1)[0][1].inputs
    state = copy.deepcopy(net.state_dict())

    def draws_differ(how: str) -> bool:
        outs = []
        for seed in (1, 2):
            net.load_state_dict(state)  # (a forward moves the batch-norm statistics)
            with torch.random.fork_rng(), torch.no_grad():
                torch.manual_seed(seed)
                outs.append(split_output(set_mode(net, True, how)(inputs))[0])
        return _rel(outs[0], outs[1]) > 0

    if not draws_differ(DETERMINISTIC):
        return DETERMINISTIC
    return DROPOUT_OFF if not draws_differ(DROPOUT_OFF) else EVAL_ONLY


def _batches(model, cfg: Config, pert_data, n: int) -> list:
    """n random training batches with the network's covariates, and their rows ->
    [(batch, rows)]."""
    net = model.model
    names, wants_x = declared_covariates(net), reads_x(net)
    loaders = pert_data.get_dataloader_distributed(
        cfg.train.batch_size,
        cfg.train.test_batch_size,
        covariates=model.evaluator.cell_covariates(names),
    )
    taken = [b for _, b in zip(range(n), loaders["train_loader"])]
    return [
        (b, batch_rows(b, row_layout(b.counts, per_cell=wants_x), names, wants_x)) for b in taken
    ]


def contract_checks(
    model, cfg: Config, pert_data, batches: int, tol: float, how: str = DETERMINISTIC
) -> dict[str, str]:
    """The network contract, checked on `model.model` (a float64 copy, batch-norms drawn away
    from their initial statistics) with `batches` random training batches: check -> "" when it
    holds, else what went wrong. how: the training mode's randomness (RANDOMNESS); with
    EVAL_ONLY the distinct-rows check runs in evaluation mode alone."""
    net = copy.deepcopy(model.model).double()
    _randomise_batchnorms(net, cfg.seed)
    names, wants_x = declared_covariates(net), reads_x(net)
    taken = [b for b, _ in _batches(model, cfg, pert_data, batches)]
    checks = {"shapes": "", "undeclared inputs ignored": ""}
    if not wants_x:
        checks["distinct rows = one row per cell"] = ""
    G = pert_data.n_genes
    for i, batch in enumerate(taken):
        where = f"random batch {i}"
        layout = row_layout(batch.counts, per_cell=wants_x)
        rows = batch_rows(batch, layout, names, wants_x)
        for mode in ("train", "eval"):
            probe = set_mode(copy.deepcopy(net), mode == "train", how)
            try:
                out = probe(rows.inputs)
            except Exception as e:  # a network that fails on its declared inputs
                checks["shapes"] = checks["shapes"] or f"{where}, {mode}: {type(e).__name__}: {e}"
                continue
            checks["shapes"] = checks["shapes"] or _shape_problem(out, len(rows.inputs), G, where)
        checks["undeclared inputs ignored"] = checks["undeclared inputs ignored"] or _undeclared(
            net, rows.inputs, G, tol, where
        )
        if not wants_x and not checks["distinct rows = one row per cell"]:
            problem = ""
            for mode in ("eval",) if how == EVAL_ONLY else ("train", "eval"):
                problem = problem or _dedup_problem(
                    net, batch, names, pert_data, cfg, mode, tol, how
                )
            checks["distinct rows = one row per cell"] = problem and f"{where}: {problem}"
    return checks


def _shape_problem(out, n_rows: int, n_genes: int, where: str) -> str:
    """ "" when the output is change [R, G] (and logvar [R, G]) and finite; else why not."""
    parts = out if isinstance(out, tuple) else (out,)
    for name, t in zip(("change", "logvar"), parts):
        if not torch.is_tensor(t) or tuple(t.shape) != (n_rows, n_genes):
            shape = tuple(t.shape) if torch.is_tensor(t) else type(t).__name__
            return f"{where}: {name} is {shape}, the contract says [{n_rows}, {n_genes}]"
        if not bool(torch.isfinite(t).all()):
            return f"{where}: {name} has NaN or infinite values"
    return ""


def _undeclared(net: nn.Module, inputs: ModelBatch, n_genes: int, tol: float, where: str) -> str:
    """In evaluation mode: an x the network does not declare, and a covariate it does not
    name, leave its output unchanged."""
    probe = copy.deepcopy(net).eval()
    gen = torch.Generator().manual_seed(0)
    n = len(inputs)
    variants = {
        "a covariate it does not declare": replace(
            inputs,
            covariates={
                **inputs.covariates,
                "undeclared": torch.randint(0, 3, (n,), generator=gen),
            },
        )
    }
    if not reads_x(net):
        x = torch.rand(n, n_genes, generator=gen, dtype=torch.float64) * 3
        variants["a control cell x (reads_x is False)"] = replace(inputs, x=x)
    with torch.no_grad():
        try:
            base = split_output(probe(inputs))[0]
        except Exception as e:
            return f"{where}: fails on its declared inputs: {type(e).__name__}: {e}"
        for what, variant in variants.items():
            if _rel(split_output(probe(variant))[0], base) > tol:
                return f"{where}: its output changes with {what}: declare what it reads"
    return ""


def _dedup_problem(
    net, batch, names, pert_data, cfg: Config, mode: str, tol: float, how: str = DETERMINISTIC
) -> str:
    """The batch's distinct rows, weighted by their cells, against one row per cell, from the
    same weights and statistics: each cell's prediction and every parameter's gradient."""
    results = []
    for layout in (WEIGHTED_ROWS, CELL_ROWS):
        probe = set_mode(copy.deepcopy(net), mode == "train", how)
        trainer = Trainer(probe, pert_data, TrainConfig(), cfg.model, DistEnv())
        rows = batch_rows(batch, layout, names, False)
        change, _ = cell_outputs(probe(rows.inputs), rows)
        probe.zero_grad(set_to_none=True)
        probe.load_state_dict(net.state_dict())  # (the forward above moved the statistics)
        trainer.loss_on(batch, layout).backward()
        grads = {n: p.grad for n, p in probe.named_parameters() if p.grad is not None}
        results.append((predicted_expression(change.detach(), batch.x.double()), grads))
    (pred_rows, grad_rows), (pred_cells, grad_cells) = results
    err = _rel(pred_rows, pred_cells)
    if err > tol:
        return f"{mode} mode: cell predictions differ by {err:.1e} (relative)"
    largest = max((g.abs().max().item() for g in grad_cells.values()), default=0.0)
    for name, g in grad_cells.items():
        if name not in grad_rows:
            return f"{mode} mode: {name} has a gradient with one row per cell only"
        err = _rel(grad_rows[name], g, floor=tol * largest)
        if err > tol:
            return f"{mode} mode: the gradient of {name} differs by {err:.1e} (relative)"
    return ""


def _run(fast, ref, trainers, records, batch, layout, where, report, n_perts) -> None:
    train = layout != "eval"
    layout = WEIGHTED_ROWS if layout == "eval" else layout
    for net, trainer in zip((fast, ref), trainers):
        set_mode(net, train, report.randomness)
        net.zero_grad(set_to_none=True)
        records[id(net)].clear()
        trainer.loss_on(batch, CELL_ROWS if net is ref else layout).backward()
    row_group = _row_group(batch, layout)
    ctx = {
        "batch": batch,
        "row_group": row_group,
        "fast_rows": batch.uniq_pert_index[row_group],  # the fast network's rows [N, P]
        "n_perts": n_perts,
        "G": fast.num_genes,
    }
    largest = max(p.grad.abs().max().item() for p in ref.parameters() if p.grad is not None)
    fast_mods, ref_mods = dict(fast.named_modules()), dict(ref.named_modules())
    for name in records[id(ref)]:  # forward order of the reference
        f_calls, r_calls = records[id(fast)].get(name, []), records[id(ref)][name]
        if len(f_calls) != len(r_calls):
            continue
        for f_out, r_out in zip(f_calls, r_calls):
            out_err, grad_err = _compare_outputs(f_out, r_out, ctx)
            if out_err is None:
                continue
            own = [
                _rel(pf.grad, pr.grad, floor=report.tol * largest)
                for (_, pf), (_, pr) in zip(
                    fast_mods[name].named_parameters(recurse=False),
                    ref_mods[name].named_parameters(recurse=False),
                )
                if pf.grad is not None and pr.grad is not None
            ]
            grad_err = max([g for g in (grad_err, *own) if g is not None], default=None)
            result = report.layers.setdefault(name, LayerResult(name))
            _update(result, out_err, grad_err, where, report.tol)
    report.seen |= set(records[id(fast)]) | set(records[id(ref)])


def _update(result: LayerResult, out_err, grad_err, where: str, tol: float) -> None:
    result.output = max(result.output or 0, out_err)
    if grad_err is not None:
        result.gradient = max(result.gradient or 0, grad_err)
    for what, err in (("output", out_err), ("gradient", grad_err)):
        if err is not None and err > tol:
            result.where.setdefault(what, where)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gears.cli.check_model",
        description="Compare the fast network with the reference layer by layer.",
        epilog="overrides are dotted config keys, e.g. model.hidden_size=32",
    )
    parser.add_argument("--config", default=None, help="YAML file overriding configs/default.yaml")
    parser.add_argument("--batches", type=int, default=2, help="batches of each batching kind")
    parser.add_argument("--tol", type=float, default=TOLERANCE, help="relative tolerance")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides, base=DEFAULT_CONFIG)
    report = check_model(cfg, batches=args.batches, tol=args.tol)
    print(report.table())
    return 0 if report.ok else 1


if __name__ == "__main__":
    from gears.cli.job import command

    command(lambda: sys.exit(main()))
