"""CPU twins of GPU mixed precision: fp16 autocast through the whole GEARSNet at 5,000 genes."""

from __future__ import annotations

import copy

import torch

from gears.config import ModelConfig
from gears.model.batch import ModelBatch
from gears.model.network import GEARSNet

G, P, H = 5000, 60, 32
SCALE = 2.0**16  # what GradScaler multiplies the loss by (its default initial scale)


def _graph(n: int, n_edges: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.randint(0, n, (n_edges,), generator=gen)
    dst = (src + torch.randint(1, n, (n_edges,), generator=gen)) % n
    return torch.stack([src, dst]), torch.rand(n_edges, generator=gen) + 0.1


def _step(net: GEARSNet, rows, counts, target, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward + backward as the engine runs it: autocast, loss in fp32, the loss scaled
    like GradScaler does in fp16 (small gradients would flush to zero) and unscaled after."""
    scale = SCALE if dtype == torch.float16 else 1.0
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        out = net(ModelBatch(rows, counts))
    loss = (counts[:, None] * (out.float() - target) ** 2).sum() / (counts.sum() * G)
    (loss * scale).backward()
    for p in net.parameters():
        if p.grad is not None:
            p.grad /= scale
    return out.float().detach(), loss.detach()


def test_fp16_autocast_at_5000_genes_is_finite_and_matches_fp32():
    """32 cells over 25 perturbations (uneven counts, so every batch-norm takes the weighted
    path). fp16 autocast: running statistics finite, output and loss equal to fp32's, every
    gradient within 15% (norm) of fp32's. The tolerance is set by the network's conditioning,
    not by overflow: the gradients of the layers before batch-norms over 25 nearly equal rows
    move by 2-4% when fp32 runs on the parameters rounded to fp16, and fp16 activations give
    ~7%. The defect this guards against gave running_var = inf and exactly zero gradients to
    the embeddings (an error of 100%), which the end of the test reproduces by hand."""
    gen = torch.Generator().manual_seed(0)
    go, co = _graph(P, 400, gen), _graph(G, 20_000, gen)
    torch.manual_seed(0)
    net32 = GEARSNet(ModelConfig(hidden_size=H), G, P, *go, *co)
    net16 = copy.deepcopy(net32)
    rows = torch.randint(0, P, (25, 2), generator=gen)
    rows[torch.rand(25, generator=gen) < 0.7, 1] = -1
    rows[0] = -1  # the control row
    counts = torch.ones(25)
    counts[:5] = torch.tensor([4.0, 3.0, 2.0, 2.0, 1.0])  # 32 cells, uneven
    assert counts.sum() == 32
    target = torch.randn(25, G, generator=gen)

    seen = {}
    # The first batch-norm over the [25 * G, 2H] cell-gene rows (bn_pert_base normalises its
    # cell-gene sum from [G, H] and [25, H] terms without forming the rows).
    hook = net16.recovery_w.norms[0].register_forward_hook(
        lambda mod, args, out: seen.update(x=args[0].detach(), w=args[1])
    )
    out32, loss32 = _step(net32, rows, counts, target, None)
    out16, loss16 = _step(net16, rows, counts, target, torch.float16)
    hook.remove()

    for name, buf in net16.named_buffers():
        if name.endswith(("running_mean", "running_var")):
            assert buf.dtype == torch.float32 and torch.isfinite(buf).all(), name
    torch.testing.assert_close(
        net16.bn_pert_base.running_var, net32.bn_pert_base.running_var, rtol=2e-2, atol=1e-4
    )
    assert (out16 - out32).norm() / out32.norm() < 1e-2
    assert abs(loss16 - loss32) < 1e-3 * loss32
    for (name, p32), (_, p16) in zip(net32.named_parameters(), net16.named_parameters()):
        assert (p32.grad is None) == (p16.grad is None), name
        if p32.grad is None or p32.grad.norm() < 1e-5 * loss32:  # biases cancelled by BN
            continue
        assert torch.isfinite(p16.grad).all(), name
        rel = ((p16.grad - p32.grad).norm() / p32.grad.norm()).item()
        assert rel < 0.15, f"{name}: fp16 gradient off by {rel:.3f} (norm) from fp32"
    for name in ("pert_emb", "gene_emb", "emb_pos"):
        assert getattr(net16, name).weight.grad.abs().max() > 0, name

    # The old statistics, by hand: that batch-norm's input [25 * G, 2H] in fp16 with its row
    # weights, summed unnormalised in an fp16 matmul (what autocast did to `w @ x`): the sums
    # reach ~32 * G * mean(x^2) > 65,504 and overflow; the normalised fp32 sum stays finite.
    x, w = seen["x"], seen["w"]
    assert x.dtype == torch.float16 and x.shape == (25 * G, 2 * H)
    with torch.autocast("cpu", dtype=torch.float16):
        old_second_moment = w @ (x.float() * x.float())
    assert not torch.isfinite(old_second_moment).all()
    new_second_moment = (w / w.sum()) @ (x.float() * x.float())
    assert torch.isfinite(new_second_moment).all()
