"""GEARS as the paper and cell-gears 0.1.2 write it: one row per cell, plain nn.BatchNorm1d,
autograd only. The place to change the model first; gears/model/network.py is the same function
computed fast, and tests/test_reference_oracle.py holds it to this one.

Differences from cell-gears 0.1.2's GEARS_Model.forward, all of them deliberate:
- it returns the predicted change (the caller adds the control cell x: pred = delta + x);
- the co-expression SGConv runs on each cell's genes (GEARS ran it on the B*G stacked rows with
  the edges of the first G, so only the first cell of a batch saw the graph);
- a graph's normalised adjacency (PyG's gcn_norm, as SGConv computes it every call) is computed
  once, and SGConv(K=1)'s product is written out: sum over edges j -> i of w_ij x_j, then Linear;
- the fusion MLP runs on every cell with its batch-norm statistics taken over the perturbed
  cells (batch_norm_over), not on the perturbed cells picked out: the same numbers, without the
  forward waiting for the host to count them on a GPU.
Parameter names and shapes are GEARSNet's, so one state_dict loads into both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.nn.conv.gcn_conv import gcn_norm
from torch_geometric.utils import coalesce

from gears.config import ModelConfig
from gears.errors import GearsInputError


class SGConv(nn.Module):
    """PyG's SGConv(K=1): Linear(A x), with A = D^-1/2 (A + I) D^-1/2 given as normalised edges."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.lin = nn.Linear(in_channels, out_channels)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor, edge_weight: torch.Tensor):
        """x [N, in]; edge_index [2, E] (source, target); edge_weight [E] -> [N, out]"""
        source, target = edge_index
        messages = edge_weight.unsqueeze(1) * x.index_select(0, source)
        return self.lin(torch.zeros_like(x).index_add_(0, target, messages))


class MLP(nn.Module):
    """GEARS's MLP: Linear -> BatchNorm1d -> ReLU per layer, the final ReLU dropped."""

    def __init__(self, sizes: list[int]):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
        self.norms = nn.ModuleList(nn.BatchNorm1d(b) for b in sizes[1:])

    def forward(self, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, in] -> [N, out]. rows [N] bool: the batch is these rows alone (each batch-norm's
        statistics come from them, batch_norm_over); every row is computed, the caller keeps
        the rows it asked for."""
        last = len(self.linears) - 1
        for i, (linear, norm) in enumerate(zip(self.linears, self.norms)):
            x = norm(linear(x)) if rows is None else batch_norm_over(norm, linear(x), rows)
            if i < last:
                x = torch.relu(x)
        return x


def batch_norm_over(norm: nn.BatchNorm1d, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """norm(x[rows]) as nn.BatchNorm1d computes it, written for every row of x [N, C] (rows [N]
    bool): in training the batch statistics, and the running statistics' update, come from the
    selected rows only; other rows are normalised with them too (the caller drops them). Unlike
    x[rows], nothing waits for the host to count the rows (a sync on a GPU). GEARS feeds a lone
    row twice (batch-norm needs two); one row gives the same mean, zero variance and running
    update. No selected row: no update, as when norm is not called."""
    if not norm.training and norm.track_running_stats:
        return norm(x)  # running statistics: each row alone
    dtype = torch.promote_types(x.dtype, torch.float32)  # batch-norm accumulates in fp32
    xf, w = x.to(dtype), rows.to(dtype).unsqueeze(1)
    n = w.sum()
    mean = (w * xf).sum(0) / n.clamp(min=1)
    var = (w * (xf - mean) ** 2).sum(0) / n.clamp(min=1)  # biased, as batch-norm normalises
    y = (xf - mean) * torch.rsqrt(var + norm.eps)
    if norm.affine:
        y = y * norm.weight + norm.bias
    if norm.training and norm.track_running_stats:
        with torch.no_grad():
            seen = n > 0
            norm.num_batches_tracked.add_(seen.long())
            momentum = norm.momentum
            if momentum is None:  # cumulative average
                momentum = 1.0 / norm.num_batches_tracked.clamp(min=1).to(dtype)
            unbiased = var * (n.clamp(min=2) / (n.clamp(min=2) - 1))
            for stat, batch_stat in ((norm.running_mean, mean), (norm.running_var, unbiased)):
                moved = (1 - momentum) * stat + momentum * batch_stat.to(stat.dtype)
                stat.copy_(torch.where(seen, moved, stat))
    return y.to(x.dtype)


class GEARSReference(nn.Module):
    """The GEARS network, one row per cell. forward(pert_index [U, P], counts) -> delta [U, G]
    (and logvar [U, G] with uncertainty), GEARSNet's contract: row u stands for counts[u] cells,
    so it is repeated that many times, the per-cell batch runs, and each row's first cell is
    returned (its copies are equal). The training engine gives it one row per cell (counts 1)."""

    per_cell_rows = True  # the engine lays training batches out one row per cell

    def __init__(
        self,
        cfg: ModelConfig,
        num_genes: int,
        num_perts: int,
        go_edge_index: torch.Tensor,
        go_edge_weight: torch.Tensor,
        coexpress_edge_index: torch.Tensor,
        coexpress_edge_weight: torch.Tensor,
    ):
        super().__init__()
        G, H = num_genes, cfg.hidden_size
        self.num_genes, self.num_perts, self.uncertainty = G, num_perts, cfg.uncertainty
        # Normalised graphs: fixed, rebuilt from the data (non-persistent buffers, not saved).
        self._graph_buffers: list[str] = []
        for name, (ei, ew, n) in {
            "go": (go_edge_index, go_edge_weight, num_perts),
            "co": (coexpress_edge_index, coexpress_edge_weight, num_genes),
        }.items():
            ei, ew = gcn_norm(ei.long(), ew.float(), n, add_self_loops=True)
            ei, ew = coalesce(ei, ew, n)  # duplicate edges summed, as their messages would be
            for suffix, tensor in (("edge_index", ei), ("edge_norm", ew)):
                self.register_buffer(f"{name}_{suffix}", tensor, persistent=False)
                self._graph_buffers.append(f"{name}_{suffix}")

        # GEARS's embeddings: rows renormalised to norm <= 1 when looked up (max_norm=True).
        self.gene_emb = nn.Embedding(G, H, max_norm=1.0)
        self.emb_pos = nn.Embedding(G, H, max_norm=1.0)
        self.pert_emb = nn.Embedding(num_perts, H, max_norm=1.0)
        self.bn_emb = nn.BatchNorm1d(H)
        self.layers_emb_pos = nn.ModuleList(SGConv(H, H) for _ in range(cfg.num_gene_gnn_layers))
        self.sim_layers = nn.ModuleList(SGConv(H, H) for _ in range(cfg.num_go_gnn_layers))
        self.emb_trans_v2 = MLP([H, H, H])
        self.pert_fuse = MLP([H, H, H])
        self.bn_pert_base = nn.BatchNorm1d(H)
        self.recovery_w = MLP([H, 2 * H, H])
        self.indv_w1 = nn.Parameter(torch.empty(G, H))
        self.indv_b1 = nn.Parameter(torch.empty(G, 1))
        self.cross_gene_state = MLP([G, H, H])
        self.indv_w2 = nn.Parameter(torch.empty(1, G, H + 1))
        self.indv_b2 = nn.Parameter(torch.empty(1, G))
        for p in (self.indv_w1, self.indv_b1, self.indv_w2, self.indv_b2):
            nn.init.xavier_normal_(p)
        if cfg.uncertainty:
            self.uncertainty_w = MLP([H, 2 * H, H, 1])

    def graph_buffer_names(self) -> list[str]:
        """The fixed-graph buffers (identical on every rank: DDP must not broadcast them)."""
        return list(self._graph_buffers)

    def forward(self, pert_index: torch.Tensor, counts: torch.Tensor | float | None = None):
        """pert_index [U, P] (-1 padded); counts [U] whole numbers >= 1, one number for every
        row, or None (= 1). -> delta [U, G] (, logvar [U, G])."""
        cells, first = cell_rows(pert_index, counts)
        out = self.forward_cells(cells)
        if first is None:
            return out
        return tuple(o[first] for o in out) if isinstance(out, tuple) else out[first]

    def forward_cells(self, pert_index: torch.Tensor):
        """pert_index [B, P], one row per cell -> delta [B, G] (, logvar [B, G])."""
        B, G = pert_index.shape[0], self.num_genes
        if B < 2 and any(m.training for m in self.modules() if isinstance(m, nn.BatchNorm1d)):
            raise GearsInputError(
                "a training batch of one cell: batch-norm needs two or more cells to normalise; "
                "use train.batch_size >= 2 (or train.freeze_batchnorm=true)"
            )
        genes = torch.arange(G, device=pert_index.device)

        # Gene side: each cell's copy of the gene embeddings, [B * G, H] rows.
        emb = torch.relu(self.bn_emb(self.gene_emb(genes).repeat(B, 1)))
        pos = self.emb_pos(genes)
        for i, layer in enumerate(self.layers_emb_pos):
            pos = layer(pos, self.co_edge_index, self.co_edge_norm)
            if i < len(self.layers_emb_pos) - 1:
                pos = torch.relu(pos)
        base = self.emb_trans_v2(emb + 0.2 * pos.repeat(B, 1)).reshape(B, G, -1)

        # Perturbation side: every perturbation's embedding smoothed over the GO graph.
        pert = self.pert_emb(torch.arange(self.num_perts, device=pert_index.device))
        for i, layer in enumerate(self.sim_layers):
            pert = layer(pert, self.go_edge_index, self.go_edge_norm)
            if i < len(self.sim_layers) - 1:
                pert = torch.relu(pert)
        # Each perturbed cell's perturbation embeddings summed and fused (the perturbed cells
        # alone make the fusion MLP's batch); control cells add nothing.
        valid = pert_index >= 0
        summed = (F.embedding(pert_index.clamp(min=0), pert) * valid.unsqueeze(-1)).sum(1)
        perturbed = valid.any(1)
        fused = self.pert_fuse(summed, rows=perturbed)  # (a lone one: as GEARS feeds it twice)
        fused = torch.where(perturbed.unsqueeze(1), fused, 0.0)  # control cells add nothing

        # Cell x gene rows: gene embedding plus the cell's perturbation, [B * G, H].
        h = torch.relu(self.bn_pert_base((base + fused.unsqueeze(1)).reshape(B * G, -1)))
        out = self.recovery_w(h).reshape(B, G, -1)
        w = (out * self.indv_w1).sum(-1) + self.indv_b1[:, 0]  # per-gene decoder, [B, G]
        cross = self.cross_gene_state(w)  # the whole predicted vector, [B, H]
        both = torch.cat([w.unsqueeze(-1), cross.unsqueeze(1).expand(B, G, -1)], -1)
        delta = (both * self.indv_w2).sum(-1) + self.indv_b2  # second per-gene layer, [B, G]
        if self.uncertainty:
            return delta, self.uncertainty_w(h).reshape(B, G)
        return delta


def cell_rows(
    pert_index: torch.Tensor, counts: torch.Tensor | float | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The per-cell batch that rows with these counts stand for: (pert_index [U, P] with row u
    repeated counts[u] times [B, P], the position of each row's first cell [U] or None when
    every row is one cell)."""
    if counts is None:
        return pert_index, None
    # The cells the rows stand for set the batch's size, which the host must know: a number
    # is checked as a number (the engine's one row per cell passes 1.0), counts in a tensor are
    # read once (a wait for the device when they live on a GPU).
    if not torch.is_tensor(counts) and float(counts) == 1.0:
        return pert_index, None
    n = torch.as_tensor(counts).detach().to("cpu", torch.float64).expand(pert_index.shape[0])
    if not bool(((n >= 1) & (n == n.round())).all()):
        raise GearsInputError(
            f"model.impl=reference runs one row per cell: each row's count of cells must be a "
            f"whole number >= 1, got {n.tolist()}; give per-cell rows or whole counts"
        )
    if bool((n == 1).all()):
        return pert_index, None
    n = n.long()
    rows = pert_index.repeat_interleave(n.to(pert_index.device), 0, output_size=int(n.sum()))
    return rows, (n.cumsum(0) - n).to(pert_index.device)
