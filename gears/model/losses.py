"""GEARS's autofocus + direction loss and the uncertainty loss, vectorised over groups."""

from __future__ import annotations

import torch

from gears.model.kernels import invariant_sum


def _group_weights(
    inverse: torch.Tensor,
    counts: torch.Tensor,
    gene_mask: torch.Tensor,
    n_groups: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-example weight 1 / (U * n_group * genes_in_mask): GEARS's mean over groups of means.

    inverse [B] group of each example, counts [U] examples per group, gene_mask [U, G] bool.
    n_groups: U as a 0-dim tensor when the groups are padded (padding groups: count 0, no
    example) -> [B, G] weights, zero outside each group's gene mask.
    """
    n_genes = gene_mask.sum(1).clamp(min=1).to(counts.dtype)  # [U]
    if n_groups is None:
        per_group = 1.0 / (counts.shape[0] * counts * n_genes)  # [U]
    else:  # (padding groups clamped to 1 cell: finite, and read by no example)
        per_group = 1.0 / (n_groups * counts.clamp(min=1) * n_genes)
    return gene_mask.to(counts.dtype)[inverse] * per_group[inverse].unsqueeze(1)


def abs_pow(d: torch.Tensor, power: float) -> torch.Tensor:
    """|d|^power. GEARS's default power 4 (gamma = 2) as (d^2)^2: pow with exponent 4 takes
    CPU's generic std::pow path, far slower than two squares on [32, 1000] (measured in
    benchmarks/README.md, finding 11)."""
    return d.square().square() if power == 4.0 else d.abs().pow(power)


def direction_surrogate(delta: torch.Tensor, temperature: float) -> torch.Tensor:
    """A differentiable sign: tanh(delta / temperature). (GEARS's torch.sign has zero gradient.)"""
    return torch.tanh(delta / temperature)


class _FocalDirectionLossFn(torch.autograd.Function):
    """sum(W * (|pred - y|^power + lam * (sign(y - ctrl) - tanh((pred - ctrl) / T))^2)) with an
    analytic gradient to pred: the ~15 autograd nodes of the expression (each allocating a
    [B, G] tensor) in a few in-place passes. Gradient to pred only (y, W, ctrl are data)."""

    @staticmethod
    def forward(ctx, pred, y, weights, ctrl_mean, power, lam, temperature):
        diff = pred - y
        err = abs_pow(diff, power)
        tanh = ((pred - ctrl_mean) / temperature).tanh_()
        miss = torch.sign(y - ctrl_mean).sub_(tanh)  # sign(y - ctrl) - tanh(...)
        total = invariant_sum(weights * err.add_(miss.square(), alpha=lam))
        ctx.save_for_backward(diff, tanh, miss, weights)
        ctx.power, ctx.lam, ctx.temperature = power, lam, temperature
        return total

    @staticmethod
    def backward(ctx, grad):
        diff, tanh, miss, weights = ctx.saved_tensors
        power, lam, temperature = ctx.power, ctx.lam, ctx.temperature
        # d|d|^p = p |d|^(p-1) sign(d); d(m^2) = -2 m (1 - tanh^2) / T.
        d_err = diff.abs().pow_(power - 1).mul_(torch.sign(diff)).mul_(power)
        d_dir = tanh.square().neg_().add_(1).mul_(miss).mul_(2 * lam / temperature)
        return d_err.sub_(d_dir).mul_(weights).mul_(grad), None, None, None, None, None, None


def gears_loss(
    pred: torch.Tensor,
    y: torch.Tensor,
    inverse: torch.Tensor,
    counts: torch.Tensor,
    gene_mask: torch.Tensor,
    ctrl_mean: torch.Tensor,
    *,
    gamma: float = 2.0,
    direction_lambda: float = 0.1,
    direction_temperature: float = 0.1,
    logvar: torch.Tensor | None = None,
    uncertainty_reg: float = 1.0,
    n_groups: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean over perturbation groups of mean |pred - y|^(2+gamma) on the group's expressed genes,
    plus `direction_lambda` x mean (sign(y - ctrl) - tanh((pred - ctrl)/T))^2.

    pred, y [B, G]; inverse [B]; counts [U] float; gene_mask [U, G] bool (GEARS: genes with
    non-zero mean in the perturbation; every gene for control); ctrl_mean [G].
    With `logvar` [B, G] the focal term becomes err + reg * (exp(-logvar) * err + logvar): the
    Gaussian negative log-likelihood term that GEARS's uncertainty loss lacks (without the
    `+ logvar` penalty, logvar -> +inf minimises it). n_groups: the real groups (a 0-dim
    tensor) when counts [U] is padded with groups of count 0 (gears/train/graph_step.py).
    """
    weights = _group_weights(inverse, counts.float(), gene_mask, n_groups)
    if logvar is None:
        return _FocalDirectionLossFn.apply(
            pred.float(),
            y.float(),
            weights,
            ctrl_mean,
            2.0 + gamma,
            float(direction_lambda),
            float(direction_temperature),
        )
    err = abs_pow(pred.float() - y.float(), 2.0 + gamma)
    logvar = logvar.float()
    err = err + uncertainty_reg * (torch.exp(-logvar) * err + logvar)
    direction = (
        torch.sign(y.float() - ctrl_mean)
        - direction_surrogate(pred.float() - ctrl_mean, direction_temperature)
    ).pow(2)
    return invariant_sum(weights * (err + direction_lambda * direction))
