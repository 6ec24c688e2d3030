"""The network contract: what a network class may declare, each declaration's default, and the
one accessor by which the rest of gears reads it.

A network is a `torch.nn.Module` called `net(batch: ModelBatch)` (gears/model/batch.py) that
returns the predicted change of each row's cells from their control cell, `[R, G]` (or
`(change, logvar)`). Everything below is optional: a class that declares none of it is a plain
GEARS-like network (reads neither x nor covariates, distinct-perturbation rows, no options).
`Network` spells the whole contract out for readers and type checkers; a fork need not
inherit from anything, and gears never asks `isinstance(net, Network)`: it reads each
declaration through its accessor here, which supplies the default.

Accessors take the network or its class (both carry class attributes); the ones that call a
method (graph_buffer_names, set_sync_batchnorm, fixed_shape_graphs) need an instance.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

from torch import nn


class Network(Protocol):
    """The declarations a network class may make (all optional; defaults in the accessors).

    reads_x: bool = False
        its output depends on each row's control cell x: the engine then gives it `batch.x`
        and one row per cell (no deduplication over perturbations).
    covariates: tuple[str, ...] = ()
        the named per-cell codes it reads (e.g. ("context",)): exactly these reach
        `batch.covariates`; "context" also makes one model train across contexts.
    per_cell_rows: bool = False
        training batches are laid out one row per cell even though x is not read (the
        reference network: its plain batch-norms see every cell).
    options: dict[str, object] = {}
        its own settings, {name: default}, set with model.extra.<name> (read as the
        default's type; other names are refused).
    graph_buffer_names() -> list[str]
        its fixed graph buffers, identical on every rank: never broadcast by DDP nor saved
        as step state. Default: the buffers whose last name part contains "edge".
    set_sync_batchnorm(enabled: bool) -> None
        synchronise its batch-norms across processes (distributed.sync_batchnorm=true needs
        it). Default: absent (the setting is refused by name).
    fixed_shape_graphs() -> None
        switch its graph propagation to fixed-shape kernels before a CUDA-graph step or
        forward is captured. Default: nothing to do.
    """

    reads_x: ClassVar[bool]
    covariates: ClassVar[tuple[str, ...]]
    per_cell_rows: ClassVar[bool]
    options: ClassVar[dict[str, object]]

    def graph_buffer_names(self) -> list[str]: ...

    def set_sync_batchnorm(self, enabled: bool) -> None: ...

    def fixed_shape_graphs(self) -> None: ...


def reads_x(net) -> bool:
    """Whether the network's output depends on the control cell x (default False)."""
    return bool(getattr(net, "reads_x", False))


def declared_covariates(net) -> tuple[str, ...]:
    """The covariate names the network reads, in declared order (default ())."""
    return tuple(getattr(net, "covariates", ()) or ())


def per_cell_rows(net) -> bool:
    """Whether the network declares per_cell_rows (default False)."""
    return bool(getattr(net, "per_cell_rows", False))


def one_row_per_cell(net) -> bool:
    """Whether training batches hold one row per cell: it reads x, or declares
    per_cell_rows."""
    return reads_x(net) or per_cell_rows(net)


def declared_options(net) -> dict:
    """The network's own options, {name: default} (default {}); a copy."""
    return dict(getattr(net, "options", None) or {})


def graph_buffer_names(net: nn.Module) -> list[str]:
    """The network's fixed graph buffers (identical on every rank, never to be broadcast):
    its graph_buffer_names(), else the buffers whose last name part contains "edge"."""
    names = getattr(net, "graph_buffer_names", None)
    if callable(names):
        return list(names())
    return [n for n, _ in net.named_buffers() if "edge" in n.rsplit(".", 1)[-1]]


def syncs_batchnorm(net) -> bool:
    """Whether the network can synchronise its batch-norms across processes."""
    return getattr(net, "set_sync_batchnorm", None) is not None


def set_sync_batchnorm(net: nn.Module, enabled: bool) -> None:
    """Tell a network that can (syncs_batchnorm) whether to synchronise its batch-norms; no
    effect on one that cannot."""
    if syncs_batchnorm(net):
        net.set_sync_batchnorm(enabled)


def fixed_shape_graphs(net: nn.Module) -> None:
    """Let the network switch to fixed-shape graph kernels (before a CUDA-graph capture), if
    it declares fixed_shape_graphs; else nothing."""
    method = getattr(net, "fixed_shape_graphs", None)
    if method is not None:
        method()
