"""GEARSNet: gene embeddings over a co-expression graph, perturbation embeddings over a GO graph."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch_geometric.nn import SGConv


class _AllReduceSum(torch.autograd.Function):
    """Differentiable sum over processes: the gradient of a sum is the sum of the gradients."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class _WeightedBatchNormFn(torch.autograd.Function):
    """Batch-norm with per-row weights: forward and an analytic backward in few passes.

    With w_i the rows' multiplicities and W = sum(w): mu = sum(w x) / W,
    var = sum(w (x - mu)^2) / W, xhat = (x - mu) * r, r = 1 / sqrt(var + eps),
    y = gamma xhat + beta,
    and dx = r gamma (dy - (w / W) (sum(dy) + xhat sum(dy xhat))): the usual batch-norm gradient
    with the stats' terms scaled by each row's weight (w = 1 gives the standard formula).
    """

    @staticmethod
    def forward(ctx, x, w, gamma, beta, eps):
        total = w.sum().clamp(min=1e-12)  # all-zero weights (no perturbed row): output = beta
        mean = (w @ x) / total
        centred = x - mean
        var = (w @ (centred * centred)) / total
        r = torch.rsqrt(var + eps)
        xhat = centred.mul_(r)
        ctx.save_for_backward(xhat, w / total, r, gamma)
        return torch.addcmul(beta, xhat, gamma), mean, var

    @staticmethod
    def backward(ctx, dy, _dmean, _dvar):
        xhat, w_frac, r, gamma = ctx.saved_tensors
        dbeta = dy.sum(0)
        dgamma = (dy * xhat).sum(0)
        t = torch.addcmul(dbeta, xhat, dgamma).mul_(w_frac.unsqueeze(1))
        dx = (dy - t).mul_(r * gamma)
        return dx, None, dgamma, dbeta, None


class WeightedBatchNorm1d(nn.BatchNorm1d):
    """BatchNorm1d whose batch statistics weight each row by a multiplicity.

    A batch of B cells that share U < B perturbations is computed on U distinct rows; weighting
    row u by the number of cells it stands for gives exactly the statistics, gradients and
    running-stat update of the per-cell batch. A scalar weight (every row stands for the same
    number of cells) takes PyTorch's native kernel. `sync=True` all-reduces the weighted sums
    across processes: a SyncBatchNorm that also works with gloo on CPU.
    """

    sync: bool = False

    def forward(self, x: torch.Tensor, weight: torch.Tensor | float | None = None) -> torch.Tensor:
        """x [N, C]; weight [N] row multiplicities (0 excludes a row), a scalar, or None (= 1)."""
        if not self.training:
            return super().forward(x)
        distributed = self.sync and dist.is_available() and dist.is_initialized()
        tensor_weight = torch.is_tensor(weight) and weight.dim() == 1
        if not tensor_weight and not distributed and x.shape[0] > 1:
            n = x.shape[0] * (1.0 if weight is None else weight)
            with torch.no_grad():
                var, mean = torch.var_mean(x.float(), 0, correction=0)
            self._update_running(mean, var, n)
            # Native kernel with batch statistics; running stats updated above with n cells.
            return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        w = (
            weight.to(xf.dtype)
            if tensor_weight
            else torch.ones(x.shape[0], device=x.device, dtype=xf.dtype)
            * (1.0 if weight is None else weight)
        )
        if distributed:
            return self._sync_forward(xf, w).to(x.dtype)
        y, mean, var = _WeightedBatchNormFn.apply(xf, w, self.weight, self.bias, self.eps)
        self._update_running(mean, var, w.sum())
        return y.to(x.dtype)

    def _sync_forward(self, xf: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Weighted statistics summed over all processes (differentiable all-reduce). The mean
        and the centred second moment take one all-reduce each, as exact as the local path."""
        packed = _AllReduceSum.apply(torch.cat([w @ xf, w.sum().reshape(1)]))
        total = packed[-1].clamp(min=1e-12)
        mean = packed[:-1] / total
        centred = xf - mean
        var = _AllReduceSum.apply(w @ (centred * centred)) / total
        self._update_running(mean, var, packed[-1])
        return centred * torch.rsqrt(var + self.eps) * self.weight + self.bias

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, var: torch.Tensor, n) -> None:
        if not self.track_running_stats:
            return
        n = torch.as_tensor(n, dtype=torch.float32, device=mean.device)
        unbiased = var.detach().float() * (n / (n - 1).clamp(min=1))
        self.num_batches_tracked += 1
        m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        # A batch whose rows all weigh 0 (no perturbed cell) leaves the statistics alone.
        m = torch.where(n > 0, torch.tensor(m, device=n.device), torch.zeros((), device=n.device))
        self.running_mean.lerp_(mean.detach().to(self.running_mean.dtype), m)
        self.running_var.lerp_(unbiased.to(self.running_var.dtype), m)


def all_rows_max_norm(emb: nn.Embedding) -> torch.Tensor:
    """Every row of an embedding after renormalising rows of norm > 1 in place: GEARS's
    `nn.Embedding(max_norm=True)` looked up with arange, in one vectorised step instead of
    PyTorch's per-row renorm loop. -> [rows, H]"""
    with torch.no_grad():
        norms = emb.weight.norm(dim=1, keepdim=True)
        emb.weight.mul_(torch.where(norms > 1, 1.0 / (norms + 1e-7), torch.ones_like(norms)))
    return emb.weight


class MLP(nn.Module):
    """GEARS's MLP: Linear -> BatchNorm -> ReLU per layer, the final ReLU dropped."""

    def __init__(self, sizes: list[int]):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
        self.norms = nn.ModuleList(WeightedBatchNorm1d(b) for b in sizes[1:])

    def forward(self, x: torch.Tensor, weight=None) -> torch.Tensor:
        last = len(self.linears) - 1
        for i, (linear, norm) in enumerate(zip(self.linears, self.norms)):
            x = norm(linear(x), weight)
            if i < last:
                x = torch.relu(x)
        return x


class GEARSNet(nn.Module):
    """The GEARS network, computing the response to each distinct perturbation once.

    forward(pert_index [U, P], counts [U]) -> delta [U, G] (and logvar [U, G] with uncertainty);
    a cell's prediction is delta[its perturbation] + its control expression x. Gene-level work
    (embeddings, co-expression SGConv, GO SGConv over all perturbation embeddings) runs once per
    forward. `counts` are the cells each row stands for; batch-norm weights rows by them, so the
    result equals running every cell separately (GEARS's per-cell batch).
    """

    def __init__(
        self,
        num_genes: int,
        num_perts: int,
        go_edge_index: torch.Tensor,
        go_edge_weight: torch.Tensor,
        coexpress_edge_index: torch.Tensor,
        coexpress_edge_weight: torch.Tensor,
        hidden_size: int = 64,
        num_go_gnn_layers: int = 1,
        num_gene_gnn_layers: int = 1,
        uncertainty: bool = False,
    ):
        super().__init__()
        G, H = num_genes, hidden_size
        self.num_genes, self.num_perts, self.uncertainty = G, num_perts, uncertainty
        # Graphs are buffers: they move with .to(device) and are saved with the model.
        self.register_buffer("go_edge_index", go_edge_index.long(), persistent=False)
        self.register_buffer("go_edge_weight", go_edge_weight.float(), persistent=False)
        self.register_buffer("co_edge_index", coexpress_edge_index.long(), persistent=False)
        self.register_buffer("co_edge_weight", coexpress_edge_weight.float(), persistent=False)

        # Looked up whole with rows renormalised to norm <= 1 (GEARS: max_norm=True).
        self.gene_emb = nn.Embedding(G, H)
        self.emb_pos = nn.Embedding(G, H)
        self.pert_emb = nn.Embedding(num_perts, H)
        self.bn_emb = WeightedBatchNorm1d(H)
        self.layers_emb_pos = nn.ModuleList(SGConv(H, H, K=1) for _ in range(num_gene_gnn_layers))
        self.sim_layers = nn.ModuleList(SGConv(H, H, K=1) for _ in range(num_go_gnn_layers))
        self.emb_trans_v2 = MLP([H, H, H])
        self.pert_fuse = MLP([H, H, H])
        self.bn_pert_base = WeightedBatchNorm1d(H)
        self.recovery_w = MLP([H, 2 * H, H])
        self.indv_w1 = nn.Parameter(torch.empty(G, H))
        self.indv_b1 = nn.Parameter(torch.empty(G, 1))
        self.cross_gene_state = MLP([G, H, H])
        self.indv_w2 = nn.Parameter(torch.empty(1, G, H + 1))
        self.indv_b2 = nn.Parameter(torch.empty(1, G))
        for p in (self.indv_w1, self.indv_b1, self.indv_w2, self.indv_b2):
            nn.init.xavier_normal_(p)
        if uncertainty:
            self.uncertainty_w = MLP([H, 2 * H, H, 1])

    def set_sync_batchnorm(self, enabled: bool) -> None:
        for m in self.modules():
            if isinstance(m, WeightedBatchNorm1d):
                m.sync = enabled

    def gene_embeddings(self, n_cells) -> tuple[torch.Tensor, torch.Tensor]:
        """Cell-independent parts: base gene embedding [G, H] and GO-smoothed perts [P, H]."""
        emb = torch.relu(self.bn_emb(all_rows_max_norm(self.gene_emb), n_cells))
        pos = all_rows_max_norm(self.emb_pos)
        for i, layer in enumerate(self.layers_emb_pos):
            pos = layer(pos, self.co_edge_index, self.co_edge_weight)
            if i < len(self.layers_emb_pos) - 1:
                pos = torch.relu(pos)
        base = self.emb_trans_v2(emb + 0.2 * pos, n_cells)
        pert = all_rows_max_norm(self.pert_emb)
        for i, layer in enumerate(self.sim_layers):
            pert = layer(pert, self.go_edge_index, self.go_edge_weight)
            if i < len(self.sim_layers) - 1:
                pert = torch.relu(pert)
        return base, pert

    def forward(self, pert_index: torch.Tensor, counts: torch.Tensor | float | None = None):
        """pert_index [U, P] (-1 padded); counts [U] cells per row, or one number for every row
        (None = 1). -> delta [U, G] (, logvar [U, G])."""
        U, G = pert_index.shape[0], self.num_genes
        per_row = counts if torch.is_tensor(counts) and counts.dim() == 1 else None
        m = 1.0 if counts is None or per_row is not None else counts
        n_cells = per_row.sum() if per_row is not None else U * m
        base, pert_all = self.gene_embeddings(n_cells)

        # Fuse each row's perturbation embeddings by gather + masked sum (no loop over cells).
        valid = pert_index >= 0
        gathered = pert_all[pert_index.clamp(min=0)] * valid.unsqueeze(-1)  # [U, P, H]
        has_pert = valid.any(1)
        # Control rows take no part in the fusion MLP's batch statistics (weight 0), as in GEARS.
        fuse_w = has_pert.float() * (per_row if per_row is not None else m)
        fused = self.pert_fuse(gathered.sum(1), fuse_w)
        fused = fused * has_pert.unsqueeze(-1).to(fused.dtype)

        h = (base.unsqueeze(0) + fused.unsqueeze(1)).reshape(U * G, -1)  # [U*G, H]
        row_w = per_row.repeat_interleave(G) if per_row is not None else m
        h = torch.relu(self.bn_pert_base(h, row_w))
        out = self.recovery_w(h, row_w).reshape(U, G, -1)
        w = (out * self.indv_w1).sum(-1) + self.indv_b1[:, 0]  # per-gene decoder, [U, G]
        cross = self.cross_gene_state(w, per_row if per_row is not None else m)  # [U, H]
        w2 = self.indv_w2[0]
        delta = w * w2[:, 0] + cross @ w2[:, 1:].t() + self.indv_b2
        if self.uncertainty:
            logvar = self.uncertainty_w(h, row_w).reshape(U, G)
            return delta, logvar
        return delta
