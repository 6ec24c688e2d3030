"""GEARSNet: gene embeddings over a co-expression graph, perturbation embeddings over a GO graph.

The architecture of GEARS (Roohani et al., Nat Biotechnol 2023) computing each distinct
perturbation of a batch once; read it beside gears/model/reference.py, the same model written
with one row per cell in plain PyTorch. The fused kernels it calls (weighted batch-norm, the
sparse graph product, the per-gene layers) are in gears/model/kernels.py.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from gears.config import ModelConfig
from gears.device import to_device, to_host
from gears.errors import GearsInputError
from gears.model import reference
from gears.model.batch import ModelBatch
from gears.model.kernels import (
    CellWeights,
    WeightedBatchNorm1d,
    csr_to_padded_rows,
    gather_rows,
    gcn_normalised_csr,
    gene_decode,
    output_layer,
    propagate,
    statistics_dtype,
)
from gears.model.reference import gears_layers

# fixed_shape_graphs: a propagation matrix up to this size becomes a dense [N, N] matrix
# (20,000 genes: 1.6 GB in fp32, beyond it; 5,000 genes: 100 MB).
DENSE_GRAPH_BYTES = 1 << 30


class FixedGraphConv(nn.Module):
    """SGConv(K=1) over a fixed graph: the propagation matrix is normalised once (by the owner,
    into buffers) and applied as a sparse product, then the Linear. `lin` keeps PyG SGConv's
    state_dict key (`<name>.lin.weight/.lin.bias`), so models saved before still load."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.lin = nn.Linear(in_channels, out_channels)

    def forward(self, x: torch.Tensor, graph: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """x [N, in]; graph (crow, col, values, crow_t, col_t, values_t) -> [N, out]"""
        return self.lin(propagate(x, graph))


def all_rows_max_norm(emb: nn.Embedding) -> torch.Tensor:
    """Every row of an embedding after renormalising rows of norm > 1 in place: GEARS's
    `nn.Embedding(max_norm=True)` looked up with arange, in one vectorised step instead of
    PyTorch's per-row renorm loop. -> [rows, H]"""
    with torch.no_grad():
        # renorm_ scales rows of norm > 1 by 1 / (norm + 1e-7), as embedding_renorm_ does.
        emb.weight.renorm_(2, 0, 1.0)
    return emb.weight


class MLP(reference.MLP):
    """GEARS's MLP (gears/model/reference.py) with count-weighted batch-norms:
    mlp(x, weight, blocks) normalises rows weighted by the cells they stand for."""

    norm_class = WeightedBatchNorm1d


class GEARSNet(nn.Module):
    """The GEARS network, computing the response to each distinct perturbation once.

    forward(ModelBatch(pert_index [U, P], counts [U])) -> change [U, G] (and logvar [U, G] with
    uncertainty); a cell's prediction is its control expression x + change[its perturbation]
    (gears.model.batch.predicted_expression). It reads neither x nor covariates. Gene-level work
    (embeddings, co-expression SGConv, GO SGConv over all perturbation embeddings) runs once per
    forward. `counts` are the cells each row stands for; batch-norm weights rows by them, so the
    result equals running every cell separately (GEARS's per-cell batch).
    """

    reads_x = False  # x enters only as a residual, added outside (predicted_expression)
    covariates = ()

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
        G, num_go_gnn_layers = num_genes, cfg.num_go_gnn_layers
        self.num_genes, self.num_perts, self.uncertainty = G, num_perts, cfg.uncertainty
        # Graphs are non-persistent buffers: they move with .to(device), are rebuilt from the
        # data (not saved), and are listed by graph_buffer_names() so that DDP never broadcasts
        # them. The normalised propagation matrices (and their transposes, for the gradient)
        # are built once here: no gcn_norm (and its host syncs) in the forward.
        self._graph_buffers: list[str] = []
        # fixed_shape_graphs's dense products, by graph: derived from the graph buffers, so
        # kept out of the module's buffers (and of a run's fingerprint, which hashes those).
        self._dense_graphs: dict[str, torch.Tensor] = {}
        self._register_graph("go_edge_index", go_edge_index.long())
        self._register_graph("go_edge_weight", go_edge_weight.float())
        self._register_graph("co_edge_index", coexpress_edge_index.long())
        self._register_graph("co_edge_weight", coexpress_edge_weight.float())
        for name, (ei, ew, n) in {
            "go": (go_edge_index, go_edge_weight, num_perts),
            "co": (coexpress_edge_index, coexpress_edge_weight, num_genes),
        }.items():
            for suffix, transpose in (("", False), ("_t", True)):
                crow, col, values = gcn_normalised_csr(ei, ew, n, transpose)
                self._register_graph(f"{name}_adj_crow{suffix}", crow)
                self._register_graph(f"{name}_adj_col{suffix}", col)
                self._register_graph(f"{name}_adj_values{suffix}", values)
        # With one GO layer, a batch needs the smoothed embeddings of its own perturbations
        # only: the GO matrix's rows as padded neighbour lists gather them (U * P * K * H work
        # instead of the [num_perts, H] product and Linear each step; see pert_embeddings).
        padded = (
            csr_to_padded_rows(self.go_adj_crow, self.go_adj_col, self.go_adj_values)
            if num_go_gnn_layers == 1
            else None
        )
        self.go_rows_gathered = padded is not None
        if padded is not None:
            self._register_graph("go_nbr_index", padded[0])
            self._register_graph("go_nbr_weight", padded[1])

        # GEARS's layers, declared once (reference.gears_layers). The embeddings are read
        # whole, rows renormalised to norm <= 1 (all_rows_max_norm), not looked up.
        gears_layers(self, cfg, G, num_perts, FixedGraphConv, MLP, WeightedBatchNorm1d)

    def _register_graph(self, name: str, tensor: torch.Tensor) -> None:
        self.register_buffer(name, tensor, persistent=False)
        self._graph_buffers.append(name)

    def graph_buffer_names(self) -> list[str]:
        """Names (as in named_buffers()) of every fixed-graph buffer: identical on every rank by
        construction, so DDP must not broadcast them each step."""
        return list(self._graph_buffers)

    def fixed_shape_graphs(self, limit_bytes: int = DENSE_GRAPH_BYTES) -> None:
        """Propagate over the GO and co-expression graphs as dense [N, N] products from now on
        (each one's matrix at most limit_bytes; a larger one keeps the sparse product): no
        sparse tensor is built per call, so a captured step (gears/train/graph_step.py) holds only
        fixed-shape kernels. Same products to float rounding (summation order)."""
        for name in ("co",) if self.go_rows_gathered else ("go", "co"):
            crow, col, values = self._sparse_graph(name)[:3]
            if name in self._dense_graphs and self._dense_graphs[name].device == crow.device:
                continue
            n = crow.numel() - 1
            if n * n * values.element_size() > limit_bytes:
                continue
            with warnings.catch_warnings():  # (the CSR layout is labelled beta)
                warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
                dense = torch.sparse_csr_tensor(
                    to_host(crow), to_host(col), to_host(values), (n, n), check_invariants=False
                ).to_dense()
            self._dense_graphs[name] = to_device(dense, crow.device)

    def _graph(self, name: str) -> tuple[torch.Tensor, ...]:
        """(crow, col, values, crow_t, col_t, values_t) of the "go" or "co" propagation matrix,
        or (dense,) after fixed_shape_graphs (made again if the module moved since)."""
        dense = self._dense_graphs.get(name)
        if dense is not None:
            if dense.device != getattr(self, f"{name}_adj_crow").device:
                self.fixed_shape_graphs()
            return (self._dense_graphs[name],)
        return self._sparse_graph(name)

    def _sparse_graph(self, name: str) -> tuple[torch.Tensor, ...]:
        parts = ("crow", "col", "values")
        return tuple(
            getattr(self, f"{name}_adj_{p}{suffix}") for suffix in ("", "_t") for p in parts
        )

    def set_sync_batchnorm(self, enabled: bool) -> None:
        for m in self.modules():
            if isinstance(m, WeightedBatchNorm1d):
                m.sync = enabled

    def _check_batch_cells(self, n_cells: torch.Tensor | float) -> None:
        """A training batch must stand for two or more cells: batch-norm normalises over them
        (GEARS crashed on one cell; the weighted kernels would return each norm's bias).
        Checked where it costs no host read: n_cells a Python number (the engine gives one
        whenever a batch's rows are equal, a batch of one cell included)."""
        if torch.is_tensor(n_cells) or n_cells >= 2 or self.bn_emb.sync:
            return  # (synchronised: the cells of every process count)
        if any(m.training for m in self.modules() if isinstance(m, nn.BatchNorm1d)):
            raise GearsInputError(
                "a training batch of one cell: batch-norm needs two or more cells to normalise; "
                "use train.batch_size >= 2 (or train.freeze_batchnorm=true)"
            )

    def gene_embeddings(self, n_cells) -> torch.Tensor:
        """Cell-independent part: the base gene embedding [G, H]."""
        emb = torch.relu(self.bn_emb(all_rows_max_norm(self.gene_emb), n_cells))
        pos = all_rows_max_norm(self.emb_pos)
        co_graph = self._graph("co")
        for i, layer in enumerate(self.layers_emb_pos):
            pos = layer(pos, co_graph)
            if i < len(self.layers_emb_pos) - 1:
                pos = torch.relu(pos)
        return self.emb_trans_v2(emb + 0.2 * pos, n_cells)

    def pert_embeddings(self, index: torch.Tensor) -> torch.Tensor:
        """GO-smoothed embeddings of the perturbations `index` (any shape, values in
        [0, num_perts)) -> [*index.shape, H]. With one GO layer: each one's neighbours gathered
        and weighted (row i of the GO matrix times the embeddings), then the layer's Linear;
        else (or for a GO graph with a few very long rows) every perturbation's SGConv output,
        indexed. Both equal GEARS's SGConv over all perturbations, looked up."""
        emb = all_rows_max_norm(self.pert_emb)  # every row renormalised, as GEARS does
        if self.go_rows_gathered:
            weight = self.go_nbr_weight[index].unsqueeze(-1)  # [..., K, 1]
            neighbours = gather_rows(emb, self.go_nbr_index[index])  # [..., K, H]
            return self.sim_layers[0].lin((neighbours * weight).sum(-2))
        pert, go_graph = emb, self._graph("go")
        for i, layer in enumerate(self.sim_layers):
            pert = layer(pert, go_graph)
            if i < len(self.sim_layers) - 1:
                pert = torch.relu(pert)
        return gather_rows(pert, index)

    def forward(self, batch: ModelBatch):
        """batch.pert_index [U, P] (-1 padded); batch.counts [U] cells per row, or one number
        for every row; batch.n_cells: the sum of the counts as a Python number when the caller
        knows it on the host (the engine does): the batch-norms then need no device op to count
        the cells (~50 fewer ops a step). -> change [U, G] (, logvar [U, G])."""
        pert_index, counts, n_cells = batch.pert_index, batch.counts, batch.n_cells
        U, G = pert_index.shape[0], self.num_genes
        per_row = counts if torch.is_tensor(counts) and counts.dim() == 1 else None
        m = 1.0 if counts is None or per_row is not None else counts
        if per_row is None:
            n_cells = U * m
        elif n_cells is None:
            n_cells = per_row.sum()
        if self.training:
            self._check_batch_cells(n_cells)
        # Every cell-level batch-norm weighs row u by its share of the cells: divided once here,
        # in the statistics' dtype (fp32, float64 for a float64 net).
        row_w_u = m
        if per_row is not None:
            counts_s = per_row.to(statistics_dtype(self.indv_w1))
            total = counts_s.sum() if torch.is_tensor(n_cells) else n_cells
            # (clamped: rows of no cells get fractions 0 and finite statistics)
            safe = total.clamp(min=1e-12) if torch.is_tensor(total) else max(total, 1e-12)
            row_w_u = CellWeights(counts_s / safe, total)
        # Gene- and perturbation-level work runs in fp32 even under autocast: it is computed
        # once and broadcast to every cell, so its rounding errors are shared by the whole batch
        # instead of averaging out (bf16 training then drifts with the CPU's kernels and thread
        # count); it costs G*H (and U*H), 1/U of the cell-gene part (and no casts of the small
        # layers' weights). Only the [U*G, H] part runs in half precision.
        device = pert_index.device.type
        valid = pert_index >= 0
        has_pert = valid.any(1)
        with torch.autocast(device, enabled=False):
            base = self.gene_embeddings(n_cells)
            # Each row's perturbation embeddings fused by a masked sum (no loop over cells).
            gathered = self.pert_embeddings(pert_index.clamp(min=0)) * valid.unsqueeze(-1)
            # Control rows take no part in the fusion MLP's statistics (weight 0), as in GEARS.
            fuse_w = has_pert.to(base.dtype) * (per_row if per_row is not None else m)
            fused = self.pert_fuse(gathered.sum(1), fuse_w) * has_pert.unsqueeze(-1)

        # relu(bn_pert_base(base[g] + fused[u])) over the U*G cell-gene rows, [U*G, H].
        h = self.bn_pert_base.outer_sum_relu(base, fused, row_w_u).reshape(U * G, -1)
        blocks = U if per_row is not None else None  # each row's G genes share its weight
        out = self.recovery_w(h, row_w_u, blocks).reshape(U, G, -1)
        w = gene_decode(out, self.indv_w1) + self.indv_b1[:, 0]  # per-gene decoder, [U, G]
        # The cross-gene MLP runs in fp32 even under autocast: the rows of w differ only by
        # their perturbations' effects, small beside the per-gene part all rows share, so bf16
        # rounding of its [U, H] linear output is as large as those differences and its
        # batch-norm over U rows would normalise rounding noise (bf16 training then drifts
        # with the thread count's summation order). It costs U*G*H, no cell-gene term.
        # So does the second per-gene layer on it.
        with torch.autocast(w.device.type, enabled=False):
            cross = self.cross_gene_state(w.to(statistics_dtype(w)), row_w_u)  # [U, H]
            delta = output_layer(w, cross, self.indv_w2, self.indv_b2)
        if self.uncertainty:
            logvar = self.uncertainty_w(h, row_w_u, blocks).reshape(U, G)
            return delta, logvar
        return delta
