"""Models saved by cell-gears 0.1.2 (`GEARS.save_model`): read without running code, mapped onto
GEARSNet, with the gene and perturbation vocabulary rebuilt from the user's data as cell-gears
builds it. docs/cell_gears_models.md is the user's guide.

A cell-gears model folder holds `config.pkl` (a plain pickle of model_initialize's arguments plus
`device`, `num_genes`, `num_perts`, and the GO and co-expression graphs as tensors) and
`model.pt` (the state_dict of its GEARS_Model). It holds no gene or perturbation names: index i
of the model means the i-th gene of `adata.var.gene_name` and the i-th name of cell-gears's
`pert_list` (see cell_gears_vocabulary).
"""

from __future__ import annotations

import io
import pickle
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from torch import nn

from gears.config import ModelConfig
from gears.data.conditions import CTRL, condition_genes
from gears.data.graphs import _open_bytes, _PlainUnpickler, read_gene2go
from gears.device import to_device
from gears.errors import GearsInputError
from gears.model.batch import ModelBatch
from gears.model.kernels import gcn_normalised_csr
from gears.torch_compat import tensor_pickle_globals
from gears.train.saved_model import SavedVocabulary

CONFIG_PICKLE, WEIGHTS_FILE = "config.pkl", "model.pt"

# config.pkl keys, by what becomes of them.
MODEL_KEYS = (
    "hidden_size",
    "num_go_gnn_layers",
    "num_gene_gnn_layers",
    "uncertainty",
    "uncertainty_reg",
    "direction_lambda",
)
GRAPH_KEYS = ("G_go", "G_go_weight", "G_coexpress", "G_coexpress_weight")
# Graph-building settings, recorded under the names this project's config.json uses for them.
GRAPH_SETTINGS = {
    "num_similar_genes_go_graph": "num_similar_genes_go_graph",
    "num_similar_genes_co_express_graph": "num_similar_genes_co_express_graph",
    "coexpress_threshold": "coexpress_threshold",
}
# decoder_hidden_size: a model_initialize argument cell-gears's network never reads.
# device: where cell-gears ran it; here the GEARS object's device decides.
IGNORED_KEYS = ("decoder_hidden_size", "device")
REQUIRED_KEYS = (
    "hidden_size",
    "num_go_gnn_layers",
    "num_gene_gnn_layers",
    "uncertainty",
    "num_genes",
    "num_perts",
    *GRAPH_KEYS,
)
KNOWN_KEYS = (*MODEL_KEYS, *GRAPH_KEYS, *GRAPH_SETTINGS, *IGNORED_KEYS)
KNOWN_KEYS += ("num_genes", "num_perts", "no_perturb")

# model.pt parameters cell-gears builds but its forward never uses (no effect on a prediction).
UNUSED_WEIGHTS = re.compile(r"^(pert_w\.(weight|bias)|bn_pert_base_trans\.\w+)$")
# cell-gears's MLP is Sequential(Linear, BatchNorm1d, ReLU, Linear, BatchNorm1d, ...): entry 3j
# is our linears.j, entry 3j + 1 our norms.j (entries 3j + 2 are ReLUs, without weights).
MLP_NAMES = ("emb_trans_v2", "pert_fuse", "recovery_w", "cross_gene_state", "uncertainty_w")
_CG_MLP = re.compile(rf"^({'|'.join(MLP_NAMES)})\.network\.(\d+)\.(\w+)$")
_OUR_MLP = re.compile(rf"^({'|'.join(MLP_NAMES)})\.(linears|norms)\.(\d+)\.(\w+)$")


def is_cell_gears_folder(path: str | Path) -> bool:
    """A folder written by cell-gears's save_model: config.pkl + model.pt, no config.json."""
    path = Path(path)
    return (
        (path / CONFIG_PICKLE).is_file()
        and (path / WEIGHTS_FILE).is_file()
        and not (path / "config.json").exists()
    )


# ---------------------------------------------------------------------------------- config.pkl
def _storage_from_bytes(data: bytes):
    """A tensor storage pickled by plain pickle: torch.save's bytes of one storage. torch's own
    reader (torch.storage._load_from_bytes) loads them with weights_only=False; this reads them
    with weights_only=True, which rebuilds storages and refuses anything else."""
    if not isinstance(data, bytes):
        raise pickle.UnpicklingError(f"a tensor storage must be bytes, not {type(data).__name__}")
    try:
        # cell-gears saved its graphs on its device: storages tagged cuda:0 load on any machine.
        storage = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        named = re.search(r"GLOBAL ([\w.]+)", str(e))  # torch names the global it refused
        if named:
            raise RefusedGlobal(f"{named.group(1)} (inside a tensor's storage bytes)") from None
        raise
    if not isinstance(storage, torch.storage.TypedStorage | torch.UntypedStorage):
        raise pickle.UnpicklingError(f"tensor storage bytes hold a {type(storage).__name__}")
    return storage


class RefusedGlobal(pickle.UnpicklingError):
    """config.pkl names a class or function outside the allow-list; `name` is module.qualname."""

    def __init__(self, name: str):
        super().__init__(f"refusing to load {name}")
        self.name = name


class ConfigUnpickler(pickle.Unpickler):
    """Unpickles plain values (numbers, strings, lists, dicts, ...) and tensors, nothing else.

    Tensors are rebuilt as torch.load(weights_only=True) rebuilds them (_rebuild_tensor_v2 with
    an OrderedDict of backward hooks), their storage bytes read by _storage_from_bytes; every
    other global a pickle names is refused (RefusedGlobal) before it is imported or called."""

    ALLOWED = {
        **tensor_pickle_globals(),  # torch._utils._rebuild_tensor_v2, _rebuild_parameter
        ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
        ("collections", "OrderedDict"): OrderedDict,
        ("torch", "device"): torch.device,
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
    }

    def find_class(self, module: str, name: str):
        found = self.ALLOWED.get((module, name))
        if found is None:
            raise RefusedGlobal(f"{module}.{name}")
        return found

    def persistent_load(self, pid):
        raise pickle.UnpicklingError(f"persistent id {str(pid)[:80]!r} (not a plain pickle)")


def read_config(path: str | Path) -> dict:
    """cell-gears's config.pkl as a dict, read by ConfigUnpickler: a pickle naming anything but
    plain values and tensors is refused (GearsInputError naming it) and nothing in it runs."""
    path = Path(path)
    if not path.is_file():
        raise GearsInputError(f"{path} does not exist; a cell-gears model folder has config.pkl")
    try:
        with open(path, "rb") as f:
            config = ConfigUnpickler(f).load()
    except RefusedGlobal as e:
        raise GearsInputError(
            f"{path} was refused: it names {e.name}, which is neither a plain value nor a tensor, "
            "and unpickling it could run code, so nothing in it was loaded. A config.pkl written "
            "by cell-gears's GEARS.save_model holds only hyperparameters and tensors; use that "
            "file, or re-save the model with cell-gears"
        ) from None
    except Exception as e:
        raise GearsInputError(
            f"{path} is unreadable as cell-gears's config.pkl ({type(e).__name__}: "
            f"{str(e)[:200]}); it is truncated or not written by cell-gears's GEARS.save_model"
        ) from None
    if not isinstance(config, dict):
        raise GearsInputError(
            f"{path} holds a {type(config).__name__}, not cell-gears's config dict"
        )
    return config


def _int_value(config: dict, key: str, path: Path, low: int = 1) -> int:
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise GearsInputError(f"{path}: {key} is {value!r}; expected an integer >= {low}")
    return value


def _bool_value(config: dict, key: str, path: Path) -> bool:
    value = config[key]
    if not isinstance(value, bool):
        raise GearsInputError(f"{path}: {key} is {value!r}; expected True or False")
    return value


def _number(config: dict, key: str, path: Path) -> float:
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not np.isfinite(value):
        raise GearsInputError(f"{path}: {key} is {value!r}; expected a finite number")
    return float(value)


def _graph(config: dict, index_key: str, weight_key: str, nodes: int, what: str, path: Path):
    """(edge_index [2, E] int64, edge_weight [E] float32) of one graph, checked."""
    edge_index, weight = config[index_key], config[weight_key]
    for key, value in ((index_key, edge_index), (weight_key, weight)):
        if not torch.is_tensor(value):
            raise GearsInputError(
                f"{path}: {key} is a {type(value).__name__}, not a tensor (cell-gears saves the "
                "graph it trained with as tensors)"
            )
    if edge_index.dim() != 2 or edge_index.shape[0] != 2 or edge_index.is_floating_point():
        raise GearsInputError(
            f"{path}: {index_key} has shape {tuple(edge_index.shape)} and dtype "
            f"{edge_index.dtype}; expected integer edge indices of shape [2, edges]"
        )
    if weight.shape != (edge_index.shape[1],) or not weight.is_floating_point():
        raise GearsInputError(
            f"{path}: {weight_key} has shape {tuple(weight.shape)} ({weight.dtype}); expected "
            f"one float per edge of {index_key}, shape ({edge_index.shape[1]},)"
        )
    if edge_index.numel() and (edge_index.min() < 0 or edge_index.max() >= nodes):
        raise GearsInputError(
            f"{path}: {index_key} has node indices outside [0, {nodes}) ({what}); the graph and "
            "the model's sizes disagree"
        )
    if not torch.isfinite(weight).all():
        raise GearsInputError(f"{path}: {weight_key} has NaN or infinite edge weights")
    return edge_index.long().contiguous(), weight.float().contiguous()


def parse_config(config: dict, path: str | Path = CONFIG_PICKLE):
    """cell-gears's config dict -> (ModelConfig, settings, graphs).

    settings: {"num_genes", "num_perts"} and the graph-building settings; graphs: ((go_edge_index,
    go_edge_weight), (coexpress_edge_index, coexpress_edge_weight)). An unknown key, a missing
    one, a bad value or an option this network does not have (no_perturb=True) is refused by name.
    """
    path = Path(path)
    unknown = sorted(str(k) for k in config if k not in KNOWN_KEYS)
    if unknown:
        raise GearsInputError(
            f"{path} has key(s) {unknown} that this loader does not know (it reads cell-gears "
            f"0.1.2's: {', '.join(KNOWN_KEYS)}); the model may need code this project lacks, so "
            "it is not loaded"
        )
    missing = [k for k in REQUIRED_KEYS if k not in config]
    if missing:
        raise GearsInputError(f"{path} lacks {missing}: not a complete cell-gears config.pkl")
    if config.get("no_perturb", False) is not False:
        raise GearsInputError(
            f"{path}: no_perturb={config['no_perturb']!r} is not supported (cell-gears's "
            "no_perturb model predicts the control cell unchanged and has no trained network); "
            "only models with no_perturb=False load"
        )
    num_genes = _int_value(config, "num_genes", path)
    num_perts = _int_value(config, "num_perts", path)
    values = {
        "hidden_size": _int_value(config, "hidden_size", path),
        "num_go_gnn_layers": _int_value(config, "num_go_gnn_layers", path),
        "num_gene_gnn_layers": _int_value(config, "num_gene_gnn_layers", path),
        "uncertainty": _bool_value(config, "uncertainty", path),
    }
    for key in ("uncertainty_reg", "direction_lambda"):
        if key in config:
            values[key] = _number(config, key, path)
    settings = {"num_genes": num_genes, "num_perts": num_perts}
    for key, ours in GRAPH_SETTINGS.items():
        if key in config:
            settings[ours] = _number(config, key, path)
    go = _graph(config, "G_go", "G_go_weight", num_perts, f"num_perts = {num_perts}", path)
    co = _graph(
        config, "G_coexpress", "G_coexpress_weight", num_genes, f"num_genes = {num_genes}", path
    )
    return ModelConfig(**values), settings, (go, co)


# ---------------------------------------------------------------------------------- model.pt
def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """model.pt (a state_dict saved by torch.save) with weights_only=True, `module.` prefixes
    (a DataParallel model) removed."""
    path = Path(path)
    if not path.is_file():
        raise GearsInputError(f"{path} does not exist; a cell-gears model folder has model.pt")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise GearsInputError(
            f"{path} was refused: it holds Python objects other than tensors and plain values "
            f"({first[:200]}), which could run code when loaded; a model.pt written by "
            "cell-gears's save_model is a plain state_dict"
        ) from None
    except Exception as e:
        raise GearsInputError(
            f"{path} is unreadable ({type(e).__name__}: {str(e)[:200]}); it is truncated or not "
            "a torch state_dict"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise GearsInputError(f"{path} holds a {type(state).__name__}, not a state_dict")
    return {k.removeprefix("module."): v for k, v in state.items()}


def our_key(key: str) -> str | None:
    """Our GEARSNet state_dict key of a cell-gears key (None: a weight cell-gears never uses)."""
    if UNUSED_WEIGHTS.match(key):
        return None
    m = _CG_MLP.match(key)
    if m:
        name, entry, param = m.group(1), int(m.group(2)), m.group(3)
        layer, kind = divmod(entry, 3)
        if kind == 2:  # a ReLU: never has weights
            return f"{name}.network.{entry}.{param} (a ReLU)"
        return f"{name}.{'linears' if kind == 0 else 'norms'}.{layer}.{param}"
    return key


def cell_gears_key(key: str) -> str:
    """The cell-gears state_dict key of one of ours (for messages)."""
    m = _OUR_MLP.match(key)
    if m:
        name, kind, layer, param = m.group(1), m.group(2), int(m.group(3)), m.group(4)
        return f"{name}.network.{3 * layer + (0 if kind == 'linears' else 1)}.{param}"
    return key


def _cell_gears_shape(key: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape of ours as cell-gears stores it (indv_w1 is [G, H, 1] there, [G, H] here)."""
    return (*shape, 1) if key == "indv_w1" else shape


def map_state_dict(
    state: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], path: str | Path
) -> dict[str, torch.Tensor]:
    """cell-gears's state_dict -> ours, for a GEARSNet whose state_dict is `expected`.

    Renames the MLP entries (network.3j -> linears.j, network.3j+1 -> norms.j), reshapes indv_w1
    [G, H, 1] -> [G, H], drops the weights cell-gears never uses (pert_w, bn_pert_base_trans);
    every other key keeps its name. An unknown key, a missing one or a wrong shape is refused,
    named as cell-gears names it."""
    out, unknown, wrong = {}, [], []
    for key, value in state.items():
        ours = our_key(key)
        if ours is None:
            continue
        if ours not in expected or not torch.is_tensor(value):
            unknown.append(key)
            continue
        want = expected[ours]
        if key == "indv_w1" and value.dim() == 3 and value.shape[-1] == 1:
            value = value[..., 0]
        if tuple(value.shape) != tuple(want.shape):
            got = tuple(state[key].shape)
            wrong.append(f"{key} {got} (expected {_cell_gears_shape(ours, tuple(want.shape))})")
            continue
        out[ours] = value.to(want.dtype).clone()
    if unknown:
        raise GearsInputError(
            f"{path} has weight(s) this network does not have: {unknown[:10]}; it is not a "
            "cell-gears 0.1.2 GEARS_Model with the hyperparameters of config.pkl (or has a "
            "changed architecture), so it is not loaded"
        )
    if wrong:
        raise GearsInputError(
            f"{path} has weight(s) of the wrong shape for the network config.pkl describes: "
            f"{wrong[:10]}; config.pkl and model.pt come from different models"
        )
    missing = [cell_gears_key(k) for k in expected if k not in out]
    if missing:
        raise GearsInputError(
            f"{path} lacks weight(s) {missing[:10]} of the network config.pkl describes; "
            "config.pkl and model.pt come from different models, or the file is incomplete"
        )
    return out


# ---------------------------------------------------------------------------------- vocabulary
def _read_name_list(path: Path) -> list[str]:
    """A gene list: a pickle of a list/set/tuple of names (cell-gears's gene_set_path and
    essential_all_data_pert_genes.pkl), read without running code, or a text file, one a line."""
    with _open_bytes(path) as fh:
        head = fh.read(1)
    if head == b"\x80":  # a pickle (protocol >= 2)
        try:
            with _open_bytes(path) as fh:
                names = _PlainUnpickler(fh).load()
        except pickle.UnpicklingError as e:
            raise GearsInputError(f"gene set {path} was refused: {e}") from None
        if not isinstance(names, list | set | frozenset | tuple):
            raise GearsInputError(
                f"gene set {path} holds a {type(names).__name__}; expected a list of gene names"
            )
        return [str(n) for n in names]
    return [ln.strip() for ln in path.read_text().splitlines() if ln.strip()]


def _condition_genes(conditions: Iterable[str]) -> list[str]:
    """cell-gears's get_genes_from_perts: the genes of 'A+B' / 'A+ctrl' conditions."""
    return sorted({g for c in set(map(str, conditions)) for g in condition_genes(c)})


def cell_gears_vocabulary(
    gene_names: Iterable[str],
    conditions: Iterable[str],
    gene2go: Mapping[str, Iterable[str]] | str | Path,
    gene_set: Iterable[str] | str | Path | None = None,
) -> tuple[list[str], list[str]]:
    """(gene_list, pert_list) exactly as cell-gears 0.1.2 builds them (PertData.set_pert_genes).

    gene_names: adata.var['gene_name'] in order; conditions: adata.obs['condition'];
    gene2go: the gene2go_all.pkl cell-gears used (or its dict).
    gene_set: None for PertData(default_pert_graph=False) (candidates: the measured genes and
    the perturbed ones); for the default (default_pert_graph=True) the
    essential_all_data_pert_genes.pkl in cell-gears's data_path, or the gene_set_path given.
    pert_list = the sorted unique candidates that have a gene2go entry."""
    genes = [str(g) for g in gene_names]
    if isinstance(gene2go, str | Path):
        gene2go = read_gene2go(Path(gene2go))
    if gene_set is None:
        candidates = genes + _condition_genes(conditions)
    elif isinstance(gene_set, str | Path):
        candidates = _read_name_list(Path(gene_set))
    else:
        candidates = [str(g) for g in gene_set]
    perts = sorted({g for g in candidates if g in gene2go})
    return genes, perts


def check_go_graph(
    edge_index: torch.Tensor,
    edge_weight: torch.Tensor,
    pert_names: list[str],
    gene2go: Mapping[str, Iterable[str]],
    path: str | Path,
) -> None:
    """Refuse a perturbation vocabulary that does not name the GO graph's nodes.

    cell-gears's GO edge weights are Jaccard indices of the two genes' GO term sets; with the
    right vocabulary (same order), most non-self edges' weights equal the Jaccard index of the
    genes the vocabulary names. Fewer than half equal (within 1e-4): refused, naming examples.
    Skipped when gene2go lacks the genes' terms."""
    terms = {g: set(gene2go.get(g, ())) for g in pert_names}
    pairs = [
        (int(a), int(b), float(w))
        for a, b, w in zip(edge_index[0].tolist(), edge_index[1].tolist(), edge_weight.tolist())
        if a != b and terms[pert_names[a]] and terms[pert_names[b]]
    ]
    if not pairs:
        return
    bad = []
    for a, b, w in pairs:
        ta, tb = terms[pert_names[a]], terms[pert_names[b]]
        jaccard = len(ta & tb) / len(ta | tb)
        if abs(jaccard - w) > 1e-4:
            bad.append((pert_names[a], pert_names[b], w, jaccard))
    if len(bad) * 2 > len(pairs):
        examples = ", ".join(f"{a}-{b}: saved {w:.3f}, GO {j:.3f}" for a, b, w, j in bad[:3])
        raise GearsInputError(
            f"{path}: the perturbation vocabulary does not match the model's GO graph: "
            f"{len(bad)} of {len(pairs)} GO edges have weights unlike the Jaccard index of the "
            f"genes this vocabulary puts at their ends ({examples}). Rebuild the vocabulary "
            "from the data and gene2go_all.pkl the model was trained with (and gene_set for "
            "cell-gears's default_pert_graph=True; docs/cell_gears_models.md), or pass "
            "check_go_graph=False if the GO source differs from the one that built the graph"
        )


# ---------------------------------------------------------------------------------- predict()
# cell-gears's predict() runs PREDICT_CELLS randomly drawn control cells as one batch.
PREDICT_CELLS = 300
_CO_BUFFERS = tuple(f"co_adj_{p}{s}" for s in ("", "_t") for p in ("crow", "col", "values"))


class CellGearsPrediction(nn.Module):
    """A GEARSNet computing what cell-gears 0.1.2's predict() computes with the same weights.

    cell-gears runs a perturbation's PREDICT_CELLS sampled control cells as one batch, and its
    co-expression SGConv runs on the batch's cells x genes nodes with edges among the first
    cell's genes only: the first cell sees the co-expression graph, every other cell only its
    self-loops (as in its training, where the first cell of each batch of 32 saw it). The
    control cell enters only as a residual, so its mean prediction is exactly
    (delta with the graph + (PREDICT_CELLS - 1) x delta without it) / PREDICT_CELLS + the mean
    of the sampled control cells; the log-variance likewise. This module returns that mix of
    `net`'s two deltas (net itself applies the graph to every cell, this project's network).
    forward(ModelBatch(pert_index [U, P])) -> delta [U, G] (, logvar [U, G]); parameters are
    net's."""

    def __init__(self, net: nn.Module, cells: int = PREDICT_CELLS):
        super().__init__()
        self.net, self.cells = net, cells
        device = net.co_adj_values.device
        G = net.num_genes
        no_edges = (torch.zeros(2, 0, dtype=torch.long), torch.zeros(0))
        for suffix, transpose in (("", False), ("_t", True)):
            parts = gcn_normalised_csr(*no_edges, G, transpose)  # self-loops only: identity
            for name, tensor in zip(("crow", "col", "values"), parts):
                self.register_buffer(f"self_loops_{name}{suffix}", to_device(tensor, device), False)

    def forward(self, batch: ModelBatch):
        first_cell = self.net(batch)
        saved = {name: getattr(self.net, name) for name in _CO_BUFFERS}
        try:
            for name in _CO_BUFFERS:
                setattr(self.net, name, getattr(self, name.replace("co_adj_", "self_loops_")))
            other_cells = self.net(batch)
        finally:
            for name, tensor in saved.items():
                setattr(self.net, name, tensor)
        w = 1.0 / self.cells
        if isinstance(first_cell, tuple):
            return tuple(w * a + (1.0 - w) * b for a, b in zip(first_cell, other_cells))
        return w * first_cell + (1.0 - w) * other_cells


# ---------------------------------------------------------------------------------- loading
def load_into(model, path: str | Path, check_go: bool = True, cell_gears_predict: bool = True):
    """Load a cell-gears model folder into a GEARS object (GEARS.load_pretrained calls this).

    The GEARS object's vocabulary (model.gene_list, model.pert_list from its PertData) must be
    the one cell-gears trained with: sizes are checked against config.pkl, and the perturbation
    order against the GO graph when the vocabulary carries gene2go (check_go). With
    cell_gears_predict, predictions follow cell-gears's predict() (CellGearsPrediction); else
    this project's network applies the co-expression graph to every cell."""
    path = Path(path)
    config = read_config(path / CONFIG_PICKLE)
    model_cfg, settings, (go, co) = parse_config(config, path / CONFIG_PICKLE)
    genes, perts = len(model.gene_list), len(model.pert_list)
    if (settings["num_genes"], settings["num_perts"]) != (genes, perts):
        raise GearsInputError(
            f"the cell-gears model at {path} has {settings['num_genes']} genes and "
            f"{settings['num_perts']} perturbable genes, this data {genes} and {perts}. Its "
            "vocabulary comes from the data it was trained on: load it with the same adata "
            "(same genes, same order) and the same gene2go_all.pkl, and for cell-gears's "
            "default_pert_graph=True its essential_all_data_pert_genes.pkl "
            "(GEARS.from_cell_gears(..., gene_set=...); docs/cell_gears_models.md)"
        )
    gene2go = getattr(model.pert_data, "gene2go", None)
    if check_go and gene2go:
        check_go_graph(*go, [str(p) for p in model.pert_list], gene2go, path)
    weights = read_weights(path / WEIGHTS_FILE)
    model.model_cfg = model_cfg
    model.config = {**asdict(model_cfg), **settings, "go_threshold": 0.1}
    if "coexpress_threshold" not in settings:
        model.config["coexpress_threshold"] = 0.4
    model._build(*go, *co)
    mapped = map_state_dict(weights, model.model.state_dict(), path / WEIGHTS_FILE)
    model.model.load_state_dict({k: v.to(model.device) for k, v in mapped.items()})
    model.best_model = model.model
    if cell_gears_predict:
        model.cell_gears_net = CellGearsPrediction(model.model)
    return model


def control_mean(adata, condition_key: str = "condition") -> tuple[np.ndarray, np.ndarray]:
    """(rows of the control cells, their mean expression [genes] float64) of an AnnData
    (backed or in memory), read in row chunks."""
    cond = adata.obs[condition_key].astype(str).values
    rows = np.flatnonzero(cond == CTRL)
    if not len(rows):
        raise GearsInputError(
            f"the data has no control cells (obs[{condition_key!r}] == 'ctrl'); cell-gears's "
            "predictions are changes added to the control cells"
        )
    total = np.zeros(adata.n_vars, np.float64)
    for start in range(0, len(rows), 4096):
        block = adata.X[rows[start : start + 4096]]
        block = block.toarray() if hasattr(block, "toarray") else np.asarray(block)
        total += block.sum(0, dtype=np.float64)
    return rows, total / len(rows)


def vocabulary_of_data(
    adata,
    gene2go: Mapping[str, Iterable[str]] | str | Path,
    gene_set: Iterable[str] | str | Path | None = None,
):
    """What GEARS needs of a PertData to load a cell-gears model and predict, from the data
    cell-gears trained on (GEARS.from_cell_gears calls this).

    adata: the AnnData (or .h5ad path, read backed) cell-gears trained on, e.g. its
    <data_path>/<dataset>/perturb_processed.h5ad (var `gene_name`, obs `condition`); gene2go,
    gene_set: see cell_gears_vocabulary. -> a SavedVocabulary (gene and perturbation names,
    the mean of all the data's control cells, and the perturbations' GO terms for the GO-graph
    check)."""
    import anndata as ad

    if isinstance(adata, str | Path):
        if not Path(adata).is_file():
            raise GearsInputError(f"data file {adata} does not exist")
        adata = ad.read_h5ad(adata, backed="r")
    for where, key in (("var", "gene_name"), ("obs", "condition")):
        if key not in getattr(adata, where).columns:
            raise GearsInputError(
                f"the data has no {where}[{key!r}]; pass the AnnData cell-gears trained on "
                "(its perturb_processed.h5ad)"
            )
    if isinstance(gene2go, str | Path):
        gene2go = read_gene2go(Path(gene2go))
    genes, perts = cell_gears_vocabulary(
        adata.var["gene_name"], adata.obs["condition"], gene2go, gene_set
    )
    _, ctrl_mean = control_mean(adata)
    vocab = SavedVocabulary(genes, perts, ctrl_mean)
    vocab.gene2go = {p: set(gene2go[p]) for p in perts}
    return vocab
