"""Gene graphs GEARS uses: GO-Jaccard and co-expression graphs, and the gene-annotation readers."""

from __future__ import annotations

import gzip
import hashlib
import io
import pickle
import re
from collections import Counter
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch

from gears.data.store import load_graph, save_graph
from gears.errors import GearsInputError

GO_FORMATS = (
    "GEARS's pickle gene2go_all.pkl (dict gene -> list/set of GO ids); "
    "TSV 'gene<TAB>GO:1,GO:2' (optionally .gz); "
    "GAF 2.x (.gaf or .gaf.gz); "
    "GMT 'term<TAB>description<TAB>gene<TAB>gene...' (.gmt or .gmt.gz)"
)

# Dense working blocks hold about this many entries, which bounds memory at ~10k genes.
_BLOCK_ENTRIES = 1 << 22


# ---------------------------------------------------------------------------------------------
# Readers
# ---------------------------------------------------------------------------------------------


def _gene2go_error(path: Path, problem: str) -> GearsInputError:
    return GearsInputError(
        f"cannot read gene -> GO annotations from {path}: {problem}. "
        f"Accepted formats: {GO_FORMATS}."
    )


def _is_gzip(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(2) == b"\x1f\x8b"


def _open_bytes(path: Path) -> io.BufferedIOBase:
    return gzip.open(path, "rb") if _is_gzip(path) else open(path, "rb")


def _text_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line without newline) of a plain or gzipped UTF-8 text file."""
    with _open_bytes(path) as raw, io.TextIOWrapper(raw, encoding="utf-8") as text:
        for number, line in enumerate(text, start=1):
            yield number, line.rstrip("\r\n")


class _PlainUnpickler(pickle.Unpickler):
    """Builds only plain containers and strings: a downloaded pickle cannot run code."""

    _ALLOWED = {("builtins", "set"), ("builtins", "frozenset"), ("builtins", "list")}

    def find_class(self, module: str, name: str):
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def _read_gene2go_pickle(path: Path) -> dict[str, set[str]]:
    with _open_bytes(path) as fh:
        obj = _PlainUnpickler(fh).load()
    if not isinstance(obj, dict):
        raise _gene2go_error(path, f"the pickle holds a {type(obj).__name__}, not a dict")
    out = {}
    for gene, terms in obj.items():
        if not isinstance(gene, str) or isinstance(terms, str | bytes):
            raise _gene2go_error(
                path, f"entry {gene!r}: expected gene symbol -> list/set of GO ids"
            )
        out[gene] = {str(t) for t in terms}
    return out


def _read_gene2go_tsv(path: Path) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    first = True
    for number, line in _text_lines(path):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) != 2:
            raise _gene2go_error(
                path, f"line {number} has {len(fields)} tab-separated fields, not 2"
            )
        gene, terms = fields[0].strip(), [t.strip() for t in re.split(r"[,;]", fields[1])]
        terms = [t for t in terms if t]
        # A header ('gene_symbol<TAB>go_ids') is the one first line whose terms are no GO ids.
        if first and not any(t.startswith("GO:") for t in terms):
            first = False
            continue
        first = False
        if gene and terms:
            out.setdefault(gene, set()).update(terms)
    return out


def _read_gene2go_gaf(path: Path) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for number, line in _text_lines(path):
        if not line.strip() or line.startswith("!"):
            continue
        fields = line.split("\t")
        if len(fields) < 7:
            raise _gene2go_error(
                path, f"GAF line {number} has {len(fields)} fields, expected 15-17"
            )
        symbol, qualifier, go_id, evidence = fields[2], fields[3], fields[4], fields[6]
        # NOT annotations assert the gene lacks the term; ND means "no data" (a placeholder).
        if "NOT" in qualifier.split("|") or evidence == "ND":
            continue
        out.setdefault(symbol, set()).add(go_id)
    return out


def _read_gene2go_gmt(path: Path) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for number, line in _text_lines(path):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) < 2:
            raise _gene2go_error(path, f"GMT line {number} has no description/gene columns")
        term = fields[0].strip()
        for gene in fields[2:]:
            gene = gene.strip()
            if gene:
                out.setdefault(gene, set()).add(term)
    return out


def _sniff_gene2go_format(path: Path) -> str:
    """'pickle', 'gaf', 'gmt' or 'tsv' from the file name, else from the first data line."""
    name = path.name.lower()
    stem = name[:-3] if name.endswith(".gz") else name
    for suffix, fmt in (
        (".pkl", "pickle"),
        (".pickle", "pickle"),
        (".gaf", "gaf"),
        (".gmt", "gmt"),
    ):
        if stem.endswith(suffix):
            return fmt
    with _open_bytes(path) as fh:
        head = fh.read(1 << 16)
    if head[:1] == b"\x80":  # pickle protocol >= 2 opcode
        return "pickle"
    if b"\x00" in head:
        raise _gene2go_error(path, "the file is binary and not a pickle")
    for line in head.decode("utf-8", errors="replace").splitlines():
        if line.startswith("!gaf-version"):
            return "gaf"
        if not line.strip() or line.startswith(("#", "!")):
            continue
        fields = line.split("\t")
        if len(fields) >= 15 and fields[4].startswith("GO:"):
            return "gaf"
        return "tsv" if len(fields) <= 2 else "gmt"
    raise _gene2go_error(path, "the file is empty")


def read_gene2go(path: str | Path) -> dict[str, set[str]]:
    """Gene symbol -> set of GO terms from any of the formats in ``GO_FORMATS``.

    The format comes from the file name (.pkl/.gaf/.gmt, optionally .gz) or else the content.
    GAF rows with qualifier NOT or evidence ND are skipped; GMT gene sets are inverted.
    """
    path = Path(path)
    if not path.is_file():
        raise _gene2go_error(path, "the file does not exist")
    readers = {
        "pickle": _read_gene2go_pickle,
        "tsv": _read_gene2go_tsv,
        "gaf": _read_gene2go_gaf,
        "gmt": _read_gene2go_gmt,
    }
    try:
        fmt = _sniff_gene2go_format(path)
        gene2go = readers[fmt](path)
    except GearsInputError:
        raise
    except (OSError, EOFError, UnicodeDecodeError, pickle.UnpicklingError, ValueError) as err:
        raise _gene2go_error(path, f"unreadable content ({type(err).__name__}: {err})") from err
    gene2go = {gene: terms for gene, terms in gene2go.items() if terms}
    if not gene2go:
        raise _gene2go_error(path, f"no gene -> GO annotations found (read as {fmt})")
    return gene2go


def read_aliases(path: str | Path) -> dict[str, list[str]]:
    """Alias or previous symbol -> official symbols from 'alias<TAB>SYMBOL[,SYMBOL]' (or .gz)."""
    path = Path(path)
    fix = "expected lines 'alias<TAB>SYMBOL[,SYMBOL]', optionally gzipped"
    if not path.is_file():
        raise GearsInputError(f"gene alias file {path} does not exist; {fix}")
    out: dict[str, list[str]] = {}
    try:
        for number, line in _text_lines(path):
            if not line.strip() or line.startswith("#"):
                continue
            fields = line.split("\t")
            if len(fields) != 2:
                raise GearsInputError(
                    f"gene alias file {path}, line {number}: {len(fields)} fields; {fix}"
                )
            alias = fields[0].strip()
            if number == 1 and alias.lower() == "alias":  # header
                continue
            symbols = out.setdefault(alias, [])
            for symbol in fields[1].split(","):
                symbol = symbol.strip()
                if symbol and symbol not in symbols:
                    symbols.append(symbol)
    except (OSError, EOFError, UnicodeDecodeError) as err:
        raise GearsInputError(f"gene alias file {path} is unreadable ({err}); {fix}") from err
    out = {alias: symbols for alias, symbols in out.items() if symbols}
    if not out:
        raise GearsInputError(f"gene alias file {path} holds no aliases; {fix}")
    return out


def resolve_symbols(
    genes: Sequence[str], known: Collection[str], aliases: dict[str, list[str]] | None
) -> tuple[dict[str, str], list[str]]:
    """Map genes absent from ``known`` onto official symbols through ``aliases``.

    Returns ``(renames, missing)``: ``renames[original] = symbol`` when exactly one of the alias's
    symbols is in ``known``; ``missing`` lists (in input order) genes found nowhere, genes whose
    alias is ambiguous (two or more known symbols), and genes whose rename would collide with
    another gene of ``genes`` (renaming would create duplicate nodes).
    """
    known = known if isinstance(known, set | frozenset | dict) else set(known)
    aliases = aliases or {}
    present = set(genes)
    renames: dict[str, str] = {}
    missing: list[str] = []
    for gene in genes:
        if gene in known:
            continue
        candidates = [s for s in aliases.get(gene, ()) if s in known]
        if len(candidates) == 1 and candidates[0] not in present:
            renames[gene] = candidates[0]
        else:
            missing.append(gene)
    claims = Counter(renames.values())
    if any(count > 1 for count in claims.values()):
        renames = {g: t for g, t in renames.items() if claims[t] == 1}
        missing = [g for g in genes if g not in known and g not in renames]
    return renames, missing


# ---------------------------------------------------------------------------------------------
# Graphs
# ---------------------------------------------------------------------------------------------


@dataclass
class GeneGraph:
    """A weighted directed gene graph in PyG layout (messages flow source -> target)."""

    genes: list[str]  # node order
    edge_index: torch.Tensor  # [2, edges] long; row 0 = source (neighbour), row 1 = target
    edge_weight: torch.Tensor  # [edges] float32

    @property
    def num_nodes(self) -> int:
        return len(self.genes)

    @property
    def num_edges(self) -> int:
        return int(self.edge_index.shape[1])


def _check_graph_args(genes: Sequence[str], top_k: int, threshold: float) -> list[str]:
    genes = [str(g) for g in genes]
    if len(set(genes)) != len(genes):
        seen: set[str] = set()
        dups = sorted({g for g in genes if g in seen or seen.add(g)})
        raise GearsInputError(f"gene list has duplicates {dups[:10]}; graph nodes must be unique")
    if int(top_k) != top_k or top_k < 0:
        raise GearsInputError(f"top_k must be an integer >= 0, got {top_k!r}")
    if not np.isfinite(threshold):
        raise GearsInputError(f"threshold must be a finite number, got {threshold!r}")
    return genes


def _select_top(weights: np.ndarray, keep: int, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of each row's ``keep`` largest entries that are > ``threshold``.

    weights: [targets, sources]. Ties at the cut go to the lower column index, so the result does
    not depend on the top-k algorithm. Output is row-major: sorted by row, then column.
    """
    if keep >= weights.shape[1]:
        return np.nonzero(weights > threshold)
    if keep == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    # torch.topk is several times faster than np.partition on these tie-heavy rows.
    kth = torch.topk(torch.from_numpy(weights), keep, dim=1, sorted=False).values
    kth = kth.min(dim=1, keepdim=True).values.numpy()  # [targets, 1] keep-th largest
    # Entries above both the cut and the threshold are always kept (fewer than `keep` per row).
    row, col = np.nonzero(weights > np.maximum(kth, threshold))
    # Entries equal to the cut fill the remaining places, lowest column first.
    tie_row, tie_col = np.nonzero((weights == kth) & (kth > threshold))
    if tie_row.size:
        room = keep - np.bincount(row, minlength=weights.shape[0])
        rank = np.arange(tie_row.size) - np.searchsorted(tie_row, tie_row, side="left")
        fill = rank < room[tie_row]
        row = np.concatenate([row, tie_row[fill]])
        col = np.concatenate([col, tie_col[fill]])
        order = np.lexsort((col, row))
        row, col = row[order], col[order]
    return row, col


def _graph(genes: list[str], rows: list, cols: list, vals: list) -> GeneGraph:
    def cat(parts: list, dtype) -> np.ndarray:
        return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)

    target, source = cat(rows, np.int64), cat(cols, np.int64)
    return GeneGraph(
        genes=genes,
        edge_index=torch.from_numpy(np.stack([source, target])),
        edge_weight=torch.from_numpy(cat(vals, np.float32)),
    )


def go_graph(
    genes: Sequence[str], gene2go: dict[str, set[str]], top_k: int = 20, threshold: float = 0.1
) -> GeneGraph:
    """GEARS's GO graph: edge weight = Jaccard index of the two genes' GO-term sets.

    Each target keeps its ``top_k + 1`` highest-weight sources (the +1 is the self edge, Jaccard
    1, which GEARS keeps), then edges with weight > ``threshold``. Genes without GO terms are
    isolated nodes with no self edge either (Jaccard of two empty sets is undefined). Jaccard
    is computed in float64, so a weight of exactly 1/10 is not > 0.1, as in GEARS.
    Edges are sorted by target, then source.
    """
    genes = _check_graph_args(genes, top_k, threshold)
    annotated = np.array([i for i, g in enumerate(genes) if gene2go.get(g)], dtype=np.int64)
    if annotated.size == 0:
        return _graph(genes, [], [], [])
    term_lists = [list(set(gene2go[genes[i]])) for i in annotated]
    sizes = np.array([len(t) for t in term_lists], dtype=np.float64)
    _, term_index = np.unique(np.concatenate(term_lists).astype(str), return_inverse=True)
    membership = sp.csr_matrix(
        (
            np.ones(term_index.size),
            (np.repeat(np.arange(annotated.size), sizes.astype(np.int64)), term_index.ravel()),
        ),
        shape=(annotated.size, int(term_index.max()) + 1),
    )  # [annotated genes, terms], binary
    membership_t = membership.T.tocsr()
    block = max(1, _BLOCK_ENTRIES // annotated.size)
    rows, cols, vals = [], [], []
    for start in range(0, annotated.size, block):
        stop = min(start + block, annotated.size)
        inter = (membership[start:stop] @ membership_t).toarray()  # [block, annotated]
        union = np.add.outer(sizes[start:stop], sizes)
        union -= inter
        jaccard = np.divide(inter, union, out=inter)
        r, c = _select_top(jaccard, int(top_k) + 1, threshold)
        rows.append(annotated[start + r])
        cols.append(annotated[c])
        vals.append(jaccard[r, c])
    return _graph(genes, rows, cols, vals)


def _abs_correlation(X, rows: np.ndarray | None = None) -> np.ndarray:
    """|Pearson r| between the columns of X [cells, genes] -> [genes, genes] float32.

    rows: use only these cells, gathered a chunk at a time (X may be a memory-map or a CSR
    over memory-maps: the selected cells are never copied whole).
    Constant genes correlate 0 with everything, themselves included (GEARS maps NaN to 0).
    Rows are densified a chunk at a time; the Gram matrix accumulates in place (torch addmm).
    """
    if rows is None:
        n_cells, n_genes = X.shape
    else:
        rows = np.asarray(rows, dtype=np.int64)
        n_cells, n_genes = len(rows), X.shape[1]
    chunk = max(1, (1 << 24) // max(n_genes, 1))

    def part_at(start: int):
        part = X[start : start + chunk] if rows is None else X[rows[start : start + chunk]]
        return part.toarray() if sp.issparse(part) else np.asarray(part)

    if sp.issparse(X) and rows is None:
        X = sp.csr_matrix(X)
        mean = np.asarray(X.sum(axis=0, dtype=np.float64)).ravel() / max(n_cells, 1)
    elif rows is None:
        X = np.asarray(X)
        mean = X.mean(axis=0, dtype=np.float64)
    else:
        mean = np.zeros(n_genes)
        for start in range(0, n_cells, chunk):
            mean += part_at(start).sum(axis=0, dtype=np.float64)
        mean /= max(n_cells, 1)
    mean32 = torch.from_numpy(mean.astype(np.float32))
    gram = torch.zeros((n_genes, n_genes), dtype=torch.float32)
    # The Gram matrix is symmetric: accumulate only its blocks on and above the diagonal (about
    # half the work at thousands of genes; blocks of >= 1,024 genes keep the BLAS calls large),
    # then mirror them below it.
    n_blocks = max(1, min(8, n_genes // 1024))
    edges = [round(i * n_genes / n_blocks) for i in range(n_blocks + 1)]
    blocks = list(zip(edges[:-1], edges[1:]))
    for start in range(0, n_cells, chunk):
        part = part_at(start)
        centred = torch.from_numpy(np.asarray(part, dtype=np.float32)) - mean32
        for k, (i0, i1) in enumerate(blocks):
            for j0, j1 in blocks[k:]:
                gram[i0:i1, j0:j1].addmm_(centred[:, i0:i1].T, centred[:, j0:j1])
    for k, (i0, i1) in enumerate(blocks):  # exactly symmetric: r(a, b) == r(b, a)
        diag = gram[i0:i1, i0:i1]
        diag.copy_(torch.triu(diag) + torch.triu(diag, 1).T)
        for j0, j1 in blocks[k + 1 :]:
            gram[j0:j1, i0:i1] = gram[i0:i1, j0:j1].T
    norm = gram.diagonal().clamp_min(0).sqrt()
    # A tiny relative norm is float32 noise around a constant gene, not variation.
    scale = torch.where(norm > 1e-6 * (mean32.abs() + 1) * n_cells**0.5, 1 / norm, 0)
    for i0, i1 in blocks:  # one product per entry (s_a * s_b), so r stays symmetric
        gram[i0:i1].mul_(scale[i0:i1, None] * scale[None, :])
    corr = gram.abs_().clamp_(max=1.0)
    corr.diagonal().copy_((scale > 0).float())
    return corr.numpy()


def coexpression_graph(
    X,
    genes: Sequence[str],
    top_k: int = 20,
    threshold: float = 0.4,
    rows: np.ndarray | None = None,
) -> GeneGraph:
    """GEARS's co-expression graph: edge weight = |Pearson r| between genes over cells.

    X: [cells, genes] dense numpy or scipy sparse, log-normalised expression of the control and
    training cells, or of the cells ``rows`` only (gathered in chunks, never copied whole).
    Each target keeps its ``top_k + 1`` sources of largest |r| (the self edge, |r| = 1,
    included), then edges with |r| > ``threshold``. Constant genes have r = 0 with all
    genes, so they get no edges. Edges are sorted by target, then source.
    """
    genes = _check_graph_args(genes, top_k, threshold)
    if X.ndim != 2 or X.shape[1] != len(genes):
        raise GearsInputError(
            f"expression matrix has shape {X.shape} but {len(genes)} genes were given; "
            "pass X as [cells, genes] with one column per gene"
        )
    corr = _abs_correlation(X, rows)
    block = max(1, _BLOCK_ENTRIES // max(len(genes), 1))
    rows, cols, vals = [], [], []
    for start in range(0, len(genes), block):
        weights = corr[start : start + block]
        r, c = _select_top(weights, int(top_k) + 1, threshold)
        rows.append(start + r)
        cols.append(c)
        vals.append(weights[r, c])
    return _graph(genes, rows, cols, vals)


def stored_graph(store_path: Path, key: tuple, gene_names: list[str], build) -> GeneGraph:
    """A graph cached in a store's folder under a digest of `key` (its last item an array: the
    rows it was built from): rank 0 builds it with `build()`, the other ranks read it."""
    digest = hashlib.sha256(repr(key[:-1]).encode() + np.asarray(key[-1]).tobytes())
    name = f"graph_{key[0]}_{digest.hexdigest()[:16]}"
    cached = load_graph(store_path, name)
    if cached is not None:
        return GeneGraph(
            gene_names, _torch_from(cached["edge_index"]), _torch_from(cached["edge_weight"])
        )
    graph = build()
    try:
        save_graph(
            store_path,
            name,
            {"edge_index": graph.edge_index.numpy(), "edge_weight": graph.edge_weight.numpy()},
        )
    except OSError:
        pass  # a read-only store only costs recomputation
    return graph


def _torch_from(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array))
