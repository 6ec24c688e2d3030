"""Tests for gears/model/losses.py: gears_loss against hand values and a GEARS-style loop."""

from __future__ import annotations

import math

import pytest
import torch

from gears.model.losses import gears_loss

# 3 cells in 2 perturbation groups, 4 genes; group 0 keeps genes 0, 1, 3, group 1 genes 0, 2, 3.
INVERSE = torch.tensor([0, 1, 0])
COUNTS = torch.tensor([2.0, 1.0])
MASK = torch.tensor([[True, True, False, True], [True, False, True, True]])


def _loop_reference(pred, y, inverse, mask, ctrl, gamma, lam, temperature, logvar=None, reg=1.0):
    """GEARS's loss_fct written as plain loops over groups, cells and masked genes, with the
    differentiable tanh direction term and the log-variance penalty of the uncertainty loss."""
    pred, y, ctrl = pred.tolist(), y.tolist(), ctrl.tolist()
    logvar = None if logvar is None else logvar.tolist()
    groups = sorted(set(inverse.tolist()))
    total = 0.0
    for g in groups:
        cells = [i for i, gi in enumerate(inverse.tolist()) if gi == g]
        genes = [j for j, keep in enumerate(mask[g].tolist()) if keep]
        focal = direction = 0.0
        for i in cells:
            for j in genes:
                err = abs(pred[i][j] - y[i][j]) ** (2 + gamma)
                if logvar is not None:
                    err += reg * (math.exp(-logvar[i][j]) * err + logvar[i][j])
                focal += err
                diff = y[i][j] - ctrl[j]
                sign = (diff > 0) - (diff < 0)
                direction += (sign - math.tanh((pred[i][j] - ctrl[j]) / temperature)) ** 2
        total += (focal + lam * direction) / (len(cells) * len(genes))
    return total / len(groups)


def _data(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    pred = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    y = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    ctrl = torch.randn(4, generator=gen, dtype=torch.float64) * 0.3
    return pred, y, ctrl


def test_focal_term_by_hand():
    pred = torch.tensor([[1.0, 0.0, 9.0, 0.0], [0.0, 0.0, 2.0, 1.0], [0.0, 2.0, 9.0, 0.0]])
    y = torch.zeros(3, 4)
    loss = gears_loss(pred, y, INVERSE, COUNTS, MASK, torch.zeros(4), direction_lambda=0.0)
    # Group 0 = cells 0, 2 on genes 0, 1, 3: |1|^4 + |2|^4 = 17 over 2 cells x 3 genes.
    # Group 1 = cell 1 on genes 0, 2, 3: |2|^4 + |1|^4 = 17 over 1 cell x 3 genes.
    # (The 9s sit outside group 0's mask.) Mean over the 2 groups.
    assert loss.item() == pytest.approx((17 / 6 + 17 / 3) / 2)


def test_direction_term_by_hand():
    """pred = y = ctrl + (+1, -1, 0, 2): focal 0; tanh(pred - ctrl) against sign(y - ctrl)."""
    ctrl = torch.tensor([0.5, 0.5, 0.5, 0.5])
    offsets = torch.tensor([1.0, -1.0, 0.0, 2.0])
    y = (ctrl + offsets).expand(3, 4)
    pred = y.clone()
    loss = gears_loss(
        pred, y, INVERSE, COUNTS, MASK, ctrl, direction_lambda=0.5, direction_temperature=1.0
    )
    t1, t2 = math.tanh(1.0), math.tanh(2.0)
    per_gene = [(1 - t1) ** 2, (-1 + t1) ** 2, 0.0, (1 - t2) ** 2]
    group0 = 0.5 * 2 * (per_gene[0] + per_gene[1] + per_gene[3]) / (2 * 3)
    group1 = 0.5 * (per_gene[0] + per_gene[2] + per_gene[3]) / 3
    assert loss.item() == pytest.approx((group0 + group1) / 2, rel=1e-6)


@pytest.mark.parametrize(
    "gamma, lam, temperature", [(2.0, 0.1, 0.1), (1.0, 0.5, 0.7), (0.0, 0.0, 1.0)]
)
@pytest.mark.parametrize("with_logvar", [False, True])
def test_matches_loop_reference(gamma, lam, temperature, with_logvar):
    pred, y, ctrl = _data()
    logvar = torch.randn(3, 4, dtype=torch.float64) if with_logvar else None
    loss = gears_loss(
        pred,
        y,
        INVERSE,
        COUNTS,
        MASK,
        ctrl,
        gamma=gamma,
        direction_lambda=lam,
        direction_temperature=temperature,
        logvar=logvar,
        uncertainty_reg=0.3,
    )
    expected = _loop_reference(
        pred, y, INVERSE, MASK, ctrl, gamma, lam, temperature, logvar, reg=0.3
    )
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_direction_gradient_nonzero_when_focal_term_is_zero():
    """GEARS used torch.sign(pred - ctrl), whose gradient is zero: only the focal term trained.
    Here pred = y (focal value and gradient 0), and the direction term alone has a gradient:
    d/dpred of lam * w * (s - tanh(d / T))^2 = -2 lam w (s - tanh) (1 - tanh^2) / T."""
    _, y, ctrl = _data(1)
    pred = y.clone().requires_grad_()
    lam, temp = 0.2, 0.8
    gears_loss(
        pred, y, INVERSE, COUNTS, MASK, ctrl, direction_lambda=lam, direction_temperature=temp
    ).backward()
    assert pred.grad.abs().max() > 1e-3
    t = torch.tanh((y - ctrl) / temp)
    s = torch.sign(y - ctrl)
    n_groups = 2
    w = MASK[INVERSE].double() / (n_groups * COUNTS[INVERSE] * MASK.sum(1)[INVERSE]).unsqueeze(1)
    expected = -2 * lam * w * (s - t) * (1 - t * t) / temp
    torch.testing.assert_close(pred.grad, expected, rtol=1e-5, atol=1e-8)


def test_uncertainty_loss_minimised_at_finite_logvar():
    """For a fixed error e, reg * (exp(-v) e + v) has d/dv = reg (1 - e exp(-v)) = 0 at
    v = log e, and grows as v -> +inf (GEARS's loss without `+ v` falls to e as v -> +inf)."""
    pred = torch.tensor([[1.5]])
    y = torch.zeros(1, 1)
    err = 1.5**4
    one = (torch.tensor([0]), torch.tensor([1.0]), torch.tensor([[True]]), torch.zeros(1))

    def loss_at(v: float, grad: bool = False):
        lv = torch.tensor([[v]], requires_grad=grad)
        loss = gears_loss(pred, y, *one, direction_lambda=0.0, logvar=lv, uncertainty_reg=0.5)
        return loss, lv

    best = math.log(err)
    loss, lv = loss_at(best, grad=True)
    loss.backward()
    assert abs(lv.grad.item()) < 1e-5
    assert loss.item() == pytest.approx(err + 0.5 * (1 + best), rel=1e-6)
    for v in (best - 1, best + 1, best + 5, 50.0, 1e3):
        assert loss_at(v)[0].item() > loss.item()
    assert loss_at(1e3)[0].item() > 400  # no descent to -inf or to a floor as logvar grows
    loss_plus, lv = loss_at(best + 1, grad=True)
    loss_plus.backward()
    assert lv.grad.item() == pytest.approx(0.5 * (1 - math.exp(-1)), rel=1e-5)


def test_genes_outside_mask_do_not_matter():
    pred, y, ctrl = _data(2)
    logvar = torch.randn(3, 4, dtype=torch.float64)
    outside = ~MASK[INVERSE]  # [3, 4]
    base = gears_loss(pred, y, INVERSE, COUNTS, MASK, ctrl, logvar=logvar)
    pred2 = torch.where(outside, pred + 5.0, pred).requires_grad_()
    y2 = torch.where(outside, y - 3.0, y)
    logvar2 = torch.where(outside, logvar + 2.0, logvar)
    changed = gears_loss(pred2, y2, INVERSE, COUNTS, MASK, ctrl, logvar=logvar2)
    assert changed.item() == pytest.approx(base.item(), rel=1e-6)
    changed.backward()
    assert (pred2.grad[outside] == 0).all()
    assert (pred2.grad[~outside] != 0).all()


def test_groups_weigh_equally_whatever_their_size():
    """A mean per group, then over groups: repeating a group's cell does not change the loss."""
    pred, y, ctrl = _data(3)
    base = gears_loss(pred, y, INVERSE, COUNTS, MASK, ctrl)
    rep = torch.tensor([0, 1, 2, 1, 1])  # cell 1 (group 1) three times
    bigger = gears_loss(pred[rep], y[rep], INVERSE[rep], torch.tensor([2.0, 3.0]), MASK, ctrl)
    assert bigger.item() == pytest.approx(base.item(), rel=1e-6)


def test_bfloat16_inputs_are_computed_in_float32():
    pred, y, ctrl = _data(4)
    loss32 = gears_loss(pred.float(), y.float(), INVERSE, COUNTS, MASK, ctrl.float())
    loss16 = gears_loss(pred.bfloat16(), y.float(), INVERSE, COUNTS, MASK, ctrl.float())
    assert loss16.dtype == torch.float32
    assert loss16.item() == pytest.approx(loss32.item(), rel=2e-2)


@pytest.mark.parametrize("gamma, lam, temperature", [(2.0, 0.1, 0.1), (0.5, 1.0, 0.7)])
def test_analytic_gradient_equals_autograd_of_the_expression(gamma, lam, temperature):
    """gears_loss (without logvar) has a hand-written backward: its gradient to pred equals
    autograd's through the plain expression, at float32 rounding, away from pred = y (where
    |d|^(2 + gamma) has a kink for gamma < 1)."""
    gen = torch.Generator().manual_seed(4)
    pred = torch.randn(6, 50, generator=gen)
    y = pred + torch.randn(6, 50, generator=gen).sign() * (0.1 + torch.rand(6, 50, generator=gen))
    ctrl = torch.randn(50, generator=gen) * 0.3
    inverse = torch.tensor([0, 1, 2, 0, 1, 0])
    counts = torch.tensor([3.0, 2.0, 1.0])
    mask = torch.rand(3, 50, generator=gen) > 0.3
    p1 = pred.clone().requires_grad_()
    loss = gears_loss(
        p1, y, inverse, counts, mask, ctrl, gamma=gamma, direction_lambda=lam,
        direction_temperature=temperature,
    )  # fmt: skip
    loss.backward()
    p2 = pred.clone().requires_grad_()
    n_genes = mask.sum(1).float()
    w = mask.float()[inverse] / (3 * counts * n_genes)[inverse].unsqueeze(1)
    direction = (torch.sign(y - ctrl) - torch.tanh((p2 - ctrl) / temperature)) ** 2
    expected = (w * ((p2 - y).abs() ** (2 + gamma) + lam * direction)).sum()
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(p1.grad, p2.grad, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize(
    "name, value",
    [
        ("gamma", 1.5),
        ("direction_lambda", 0.7),
        ("direction_temperature", 0.5),
        ("uncertainty_reg", 0.3),
    ],
)
def test_the_trainer_passes_each_loss_parameter_of_the_model_config(name, value):
    """Trainer.cell_loss gives gears_loss every loss field of ModelConfig by name: a changed
    value reaches the loss (the uncertainty head's logvar given, so uncertainty_reg counts)."""
    from types import SimpleNamespace

    from gears.config import ModelConfig
    from gears.train.engine import Trainer

    pred, y, ctrl = _data(3)
    change = pred - torch.zeros(4, dtype=torch.float64)
    logvar = torch.full((3, 4), 0.2, dtype=torch.float64)
    batch = SimpleNamespace(
        x=torch.zeros(3, 4, dtype=torch.float64),
        y=y,
        inverse=INVERSE,
        counts=COUNTS,
        uniq_cond=torch.tensor([0, 1]),
    )
    cfg = ModelConfig(**{name: value})
    trainer = SimpleNamespace(model_cfg=cfg, gene_mask=MASK, ctrl_mean=ctrl)
    got = Trainer.cell_loss(trainer, batch, change, logvar)
    want = gears_loss(pred, y, INVERSE, COUNTS, MASK, ctrl, logvar=logvar, **{name: value})
    default = gears_loss(pred, y, INVERSE, COUNTS, MASK, ctrl, logvar=logvar)
    assert got.item() == pytest.approx(want.item(), rel=1e-12)
    assert got.item() != pytest.approx(default.item(), rel=1e-6)
