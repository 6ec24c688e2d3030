"""GEARS as the paper and cell-gears 0.1.2 write it: one row per cell, plain nn.BatchNorm1d,
autograd only. The place to change the model first; gears/model/network.py is the same function
computed fast, and tests/test_reference_oracle.py holds it to this one.

Differences from cell-gears 0.1.2's GEARS_Model.forward, all of them deliberate:
- it takes a ModelBatch (gears/model/batch.py) and returns the predicted change (the control
  cell x is added outside, by gears.model.batch.predicted_expression);
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

from gears.config import ModelConfig
from gears.errors import GearsInputError
from gears.model.batch import ModelBatch


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
    """GEARS's MLP: Linear -> BatchNorm1d -> ReLU per layer, the final ReLU dropped. The fast
    network's MLP is this one with count-weighted batch-norms (norm_class), given the row
    weights as extra arguments: mlp(x, weight, blocks)."""

    norm_class = nn.BatchNorm1d

    def __init__(self, sizes: list[int]):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
        self.norms = nn.ModuleList(self.norm_class(b) for b in sizes[1:])

    def forward(self, x: torch.Tensor, *norm_args, rows: torch.Tensor | None = None):
        """x [N, in] -> [N, out]; norm_args go to each batch-norm (the fast network's row
        weights). rows [N] bool: the batch is these rows alone (each batch-norm's statistics
        come from them, batch_norm_over); every row is computed, the caller keeps the rows it
        asked for."""
        last = len(self.linears) - 1
        for i, (linear, norm) in enumerate(zip(self.linears, self.norms)):
            if rows is None:
                x = norm(linear(x), *norm_args)
            else:
                x = batch_norm_over(norm, linear(x), rows)
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


def gears_layers(
    net: nn.Module,
    cfg: ModelConfig,
    num_genes: int,
    num_perts: int,
    conv: type[nn.Module] = SGConv,
    mlp: type[nn.Module] = MLP,
    norm: type[nn.Module] = nn.BatchNorm1d,
) -> None:
    """Declare GEARS's layers on `net`: the one layer list of both networks (the fast one
    passes its graph convolution, MLP and batch-norm classes). Created in this order, so one
    seed gives both the same initial weights; their forwards, which the oracle compares, stay
    apart."""
    G, H = num_genes, cfg.hidden_size
    # GEARS's embeddings: rows renormalised to norm <= 1 when looked up (max_norm=True).
    net.gene_emb = nn.Embedding(G, H, max_norm=1.0)
    net.emb_pos = nn.Embedding(G, H, max_norm=1.0)
    net.pert_emb = nn.Embedding(num_perts, H, max_norm=1.0)
    net.bn_emb = norm(H)
    net.layers_emb_pos = nn.ModuleList(conv(H, H) for _ in range(cfg.num_gene_gnn_layers))
    net.sim_layers = nn.ModuleList(conv(H, H) for _ in range(cfg.num_go_gnn_layers))
    net.emb_trans_v2 = mlp([H, H, H])
    net.pert_fuse = mlp([H, H, H])
    net.bn_pert_base = norm(H)
    net.recovery_w = mlp([H, 2 * H, H])
    net.indv_w1 = nn.Parameter(torch.empty(G, H))
    net.indv_b1 = nn.Parameter(torch.empty(G, 1))
    net.cross_gene_state = mlp([G, H, H])
    net.indv_w2 = nn.Parameter(torch.empty(1, G, H + 1))
    net.indv_b2 = nn.Parameter(torch.empty(1, G))
    for p in (net.indv_w1, net.indv_b1, net.indv_w2, net.indv_b2):
        nn.init.xavier_normal_(p)
    if cfg.uncertainty:
        net.uncertainty_w = mlp([H, 2 * H, H, 1])


class GEARSReference(nn.Module):
    """The GEARS network, one row per cell. forward(ModelBatch(pert_index [U, P], counts)) ->
    change [U, G] (and logvar [U, G] with uncertainty), GEARSNet's contract: row u stands for
    counts[u] cells, so it is repeated that many times, the per-cell batch runs
    (forward_cells: gene_embeddings, cell_embedding, decode), and each row's first cell is
    returned (its copies are equal). The training engine gives it one row per cell (counts 1)."""

    reads_x = False  # GEARS: x enters only as a residual, added outside (predicted_expression)
    covariates = ()  # a fork declares the per-cell codes it reads, e.g. ("context",)
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
        # PyG's own normalisation, so the oracle shares no code with the fast model's
        # (kernels.gcn_normalised_csr). Imported here: PyG's import pulls in torch._dynamo (which
        # delays every command's start) and only this class needs it.
        from torch_geometric.nn.conv.gcn_conv import gcn_norm
        from torch_geometric.utils import coalesce

        super().__init__()
        self.num_genes, self.num_perts, self.uncertainty = num_genes, num_perts, cfg.uncertainty
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

        gears_layers(self, cfg, num_genes, num_perts)

    def graph_buffer_names(self) -> list[str]:
        """The fixed-graph buffers (identical on every rank: DDP must not broadcast them)."""
        return list(self._graph_buffers)

    def forward(self, batch: ModelBatch):
        """batch.pert_index [U, P] (-1 padded); batch.counts [U] whole numbers >= 1 or one
        number for every row. -> change [U, G] (, logvar [U, G])."""
        cells, first = cell_rows(batch)
        out = self.forward_cells(cells)
        if first is None:
            return out
        return tuple(o[first] for o in out) if isinstance(out, tuple) else out[first]

    def forward_cells(self, cells: ModelBatch):
        """cells: one row per cell (pert_index [B, P]) -> change [B, G] (, logvar [B, G])."""
        B, G = len(cells), self.num_genes
        if B < 2 and any(m.training for m in self.modules() if isinstance(m, nn.BatchNorm1d)):
            raise GearsInputError(
                "a training batch of one cell: batch-norm needs two or more cells to normalise; "
                "use train.batch_size >= 2 (or train.freeze_batchnorm=true)"
            )
        base = self.gene_embeddings(B)  # [B, G, H]
        # Cell x gene rows: each gene's embedding plus what the cell adds, [B * G, H].
        added = self.cell_embedding(cells)  # [B, H]
        h = torch.relu(self.bn_pert_base((base + added.unsqueeze(1)).reshape(B * G, -1)))
        return self.decode(h, B)

    def gene_embeddings(self, B: int) -> torch.Tensor:
        """Each cell's copy of the gene embeddings, smoothed over the co-expression graph ->
        [B, G, H]."""
        G = self.num_genes
        genes = torch.arange(G, device=self.indv_w1.device)
        emb = torch.relu(self.bn_emb(self.gene_emb(genes).repeat(B, 1)))  # [B * G, H] rows
        pos = self.emb_pos(genes)
        for i, layer in enumerate(self.layers_emb_pos):
            pos = layer(pos, self.co_edge_index, self.co_edge_norm)
            if i < len(self.layers_emb_pos) - 1:
                pos = torch.relu(pos)
        return self.emb_trans_v2(emb + 0.2 * pos.repeat(B, 1)).reshape(B, G, -1)

    def cell_embedding(self, cells: ModelBatch) -> torch.Tensor:
        """What each cell adds to every gene's embedding -> [B, H]: its perturbations'
        embeddings, smoothed over the GO graph, summed and fused (the perturbed cells alone
        make the fusion MLP's batch); zero for a control cell. A fork conditioning on the cell
        (a context, a dose) adds its term here."""
        pert_index = cells.pert_index
        pert = self.pert_emb(torch.arange(self.num_perts, device=pert_index.device))
        for i, layer in enumerate(self.sim_layers):
            pert = layer(pert, self.go_edge_index, self.go_edge_norm)
            if i < len(self.sim_layers) - 1:
                pert = torch.relu(pert)
        valid = pert_index >= 0
        summed = (F.embedding(pert_index.clamp(min=0), pert) * valid.unsqueeze(-1)).sum(1)
        perturbed = valid.any(1)
        fused = self.pert_fuse(summed, rows=perturbed)  # (a lone one: as GEARS feeds it twice)
        return torch.where(perturbed.unsqueeze(1), fused, 0.0)  # control cells add nothing

    def decode(self, h: torch.Tensor, B: int):
        """Cell x gene rows h [B * G, H] -> change [B, G] (, logvar [B, G]): the per-gene
        decoder, the cross-gene MLP over the whole predicted vector, the second per-gene
        layer."""
        G = self.num_genes
        out = self.recovery_w(h).reshape(B, G, -1)
        w = (out * self.indv_w1).sum(-1) + self.indv_b1[:, 0]  # per-gene decoder, [B, G]
        cross = self.cross_gene_state(w)  # the whole predicted vector, [B, H]
        both = torch.cat([w.unsqueeze(-1), cross.unsqueeze(1).expand(B, G, -1)], -1)
        change = (both * self.indv_w2).sum(-1) + self.indv_b2  # second per-gene layer, [B, G]
        if self.uncertainty:
            return change, self.uncertainty_w(h).reshape(B, G)
        return change


def cell_rows(batch: ModelBatch) -> tuple[ModelBatch, torch.Tensor | None]:
    """The per-cell batch that rows with these counts stand for: (batch with row u repeated
    counts[u] times, [B] rows, counts 1; the position of each row's first cell [U], or None
    when every row is one cell)."""
    counts, pert_index = batch.counts, batch.pert_index
    if counts is None:
        return batch, None
    # The cells the rows stand for set the batch's size, which the host must know: a number
    # is checked as a number (the engine's one row per cell passes 1.0), counts in a tensor are
    # read once (a wait for the device when they live on a GPU).
    if not torch.is_tensor(counts) and float(counts) == 1.0:
        return batch, None
    n = torch.as_tensor(counts).detach().to("cpu", torch.float64).expand(pert_index.shape[0])
    if not bool(((n >= 1) & (n == n.round())).all()):
        raise GearsInputError(
            f"model.impl=reference runs one row per cell: each row's count of cells must be a "
            f"whole number >= 1, got {n.tolist()}; give per-cell rows or whole counts"
        )
    if bool((n == 1).all()):
        return batch, None
    n = n.long()
    n_cells = int(n.sum())
    n = n.to(pert_index.device)

    def repeat(t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(n, 0, output_size=n_cells)

    cells = ModelBatch(
        repeat(pert_index),
        1.0,
        None if batch.x is None else repeat(batch.x),
        {name: repeat(codes) for name, codes in batch.covariates.items()},
    )
    return cells, n.cumsum(0) - n
