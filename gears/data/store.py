"""The processed store: expression written once per node, memory-mapped by every local rank.

Layout of one store, a directory `<store_dir>/<key>/` (key = hash of the input and of every
processing parameter, see `store_key`):

  meta.json      version, key, layout ("dense" or "csr"), shape, dataset name, report
  X.npy          dense float32 [cells, genes]                       (layout "dense")
  X_data.npy     float32 [nnz], X_indices.npy / X_indptr.npy int32 or int64 (layout "csr")
  tables.npz     conditions, per-cell condition codes, gene names, DE tables, means

A store is built in `<key>.tmp-<pid>` and renamed into place once complete, so a reader either
sees a whole store or none; a crashed build leaves only a temp directory that the next build
replaces. Readers open the arrays with `np.load(mmap_mode="r")`: pages come from the page cache,
shared by every process on the node, and count once in the node's memory.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import zipfile
from pathlib import Path

import numpy as np

STORE_VERSION = 1
META_NAME = "meta.json"
TABLES_NAME = "tables.npz"
# Inputs up to this size are keyed by content (a renamed or touched copy reuses the store);
# larger ones by path, size and modification time (hashing 15 GB would cost minutes).
CONTENT_HASH_LIMIT_BYTES = 64 * 1024**2
# Dense float32 when the dense matrix is at most this large (or no larger than CSR would be).
DENSE_STORE_LIMIT_BYTES = 4 * 1024**3


def input_fingerprint(path: str | Path) -> dict:
    """What identifies an input file: its content hash when small, else path + size + mtime."""
    path = Path(path).resolve()
    stat = path.stat()
    if stat.st_size <= CONTENT_HASH_LIMIT_BYTES:
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
        return {"sha256": digest.hexdigest(), "size": stat.st_size}
    return {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def store_key(source: dict, params: dict) -> str:
    """A short hash over the input's fingerprint and every processing parameter."""
    blob = json.dumps(
        {"version": STORE_VERSION, "source": source, "params": params}, sort_keys=True, default=str
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def choose_layout(n_cells: int, n_genes: int, nnz: int | None) -> str:
    """'dense' when the float32 matrix is small enough or no larger than its CSR form."""
    dense_bytes = n_cells * n_genes * 4
    if dense_bytes <= DENSE_STORE_LIMIT_BYTES:
        return "dense"
    if nnz is not None and dense_bytes <= nnz * 8:
        return "dense"
    return "csr"


class NpyAppender:
    """Write a 1-D or 2-D .npy file by appending row blocks through a plain file handle.

    Written pages go to the page cache, not to this process's RSS (as a writable memmap would).
    The header is rewritten with the final row count on close; numpy pads headers so that the
    row count can grow in place.
    """

    def __init__(self, path: Path, dtype, row_shape: tuple[int, ...] = ()):
        self.path, self.dtype, self.row_shape = Path(path), np.dtype(dtype), tuple(row_shape)
        self.rows = 0
        self.fh = open(self.path, "wb")
        self.header_len = self._write_header()

    def _write_header(self) -> int:
        buf = io.BytesIO()
        np.lib.format.write_array_header_1_0(
            buf,
            {
                "descr": np.lib.format.dtype_to_descr(self.dtype),
                "fortran_order": False,
                "shape": (self.rows, *self.row_shape),
            },
        )
        self.fh.write(buf.getvalue())
        return len(buf.getvalue())

    def append(self, block: np.ndarray) -> None:
        block = np.ascontiguousarray(block, dtype=self.dtype)
        if block.shape[1:] != self.row_shape:
            raise ValueError(f"block shape {block.shape} does not match rows {self.row_shape}")
        self.fh.write(block.data)
        self.rows += block.shape[0]

    def close(self) -> None:
        self.fh.seek(0)
        if self._write_header() != self.header_len:  # pragma: no cover - numpy's padding rule
            raise RuntimeError(f"npy header of {self.path} changed length")
        self.fh.close()


class StoreWriter:
    """Builds one store in a temp directory; `commit` renames it into place (atomic)."""

    def __init__(self, root: Path, key: str, n_genes: int, layout: str, index_dtype=np.int32):
        self.root, self.key, self.layout = Path(root), key, layout
        self.root.mkdir(parents=True, exist_ok=True)
        self.tmp = self.root / f"{key}.tmp-{os.getpid()}"
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir()
        self.n_genes = n_genes
        if layout == "dense":
            self.dense = NpyAppender(self.tmp / "X.npy", np.float32, (n_genes,))
        else:
            self.data = NpyAppender(self.tmp / "X_data.npy", np.float32)
            self.indices = NpyAppender(self.tmp / "X_indices.npy", index_dtype)
            self.index_dtype = np.dtype(index_dtype)
            self.indptr = [np.zeros(1, np.int64)]
            self.nnz = 0

    def append_rows(self, block) -> None:
        """Append cell rows: a dense [rows, genes] array or a scipy CSR block."""
        import scipy.sparse as sp

        if self.layout == "dense":
            self.dense.append(block.toarray() if sp.issparse(block) else np.asarray(block))
            return
        block = sp.csr_matrix(block)
        self.data.append(block.data.astype(np.float32, copy=False))
        self.indices.append(block.indices.astype(self.index_dtype, copy=False))
        self.indptr.append(self.nnz + block.indptr[1:].astype(np.int64))
        self.nnz += int(block.indptr[-1])

    def commit(self, tables: dict[str, np.ndarray], meta: dict) -> Path:
        if self.layout == "dense":
            self.dense.close()
            n_cells = self.dense.rows
        else:
            self.data.close()
            self.indices.close()
            indptr = np.concatenate(self.indptr).astype(self.index_dtype)
            np.save(self.tmp / "X_indptr.npy", indptr)
            n_cells = len(indptr) - 1
        np.savez(self.tmp / TABLES_NAME, **tables)
        meta = {
            **meta,
            "version": STORE_VERSION,
            "key": self.key,
            "layout": self.layout,
            "shape": [n_cells, self.n_genes],
        }
        (self.tmp / META_NAME).write_text(json.dumps(meta, indent=1, default=str))
        final = self.root / self.key
        try:
            os.rename(self.tmp, final)
        except OSError:
            # Another process committed the same key first: its store is equivalent.
            shutil.rmtree(self.tmp, ignore_errors=True)
        return final

    def abort(self) -> None:
        for f in ("dense", "data", "indices"):
            if hasattr(self, f):
                try:
                    getattr(self, f).fh.close()
                except OSError:  # closing flushes: on a full disk that fails too
                    pass
        shutil.rmtree(self.tmp, ignore_errors=True)


class Store:
    """A committed store opened read-only; the expression arrays are memory-maps."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.meta = json.loads((self.path / META_NAME).read_text())
        if self.meta.get("version") != STORE_VERSION:
            raise ValueError(f"store {self.path} has version {self.meta.get('version')}")
        with np.load(self.path / TABLES_NAME, allow_pickle=False) as z:
            self.tables = {k: z[k] for k in z.files}

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.meta["shape"])

    def matrix(self):
        """The expression: a read-only np.memmap [cells, genes] or a scipy CSR over memmaps."""
        if self.meta["layout"] == "dense":
            return np.load(self.path / "X.npy", mmap_mode="r")
        import scipy.sparse as sp

        arrays = [
            np.load(self.path / f"X_{n}.npy", mmap_mode="r") for n in ("data", "indices", "indptr")
        ]
        csr = sp.csr_matrix(self.shape, dtype=np.float32)  # then swap in the memmaps, no copy
        csr.data, csr.indices, csr.indptr = arrays
        return csr


def open_store(root: str | Path, key: str) -> Store | None:
    """The committed store `<root>/<key>`, or None when it does not exist (or is unreadable)."""
    path = Path(root) / key
    if not (path / META_NAME).exists():
        return None
    try:
        return Store(path)
    except (OSError, ValueError, KeyError):
        return None


def save_graph(store_path: Path, name: str, arrays: dict[str, np.ndarray]) -> None:
    """A derived table (e.g. a co-expression graph) cached beside the store, written atomically."""
    tmp = store_path / f"{name}.tmp-{os.getpid()}.npz"
    try:
        np.savez(tmp, **arrays)
        os.replace(tmp, store_path / f"{name}.npz")
    finally:
        tmp.unlink(missing_ok=True)  # a full disk leaves no partial file behind


def load_graph(store_path: Path, name: str) -> dict[str, np.ndarray] | None:
    """A cached table, or None when absent or unreadable (then it is rebuilt and rewritten)."""
    path = store_path / f"{name}.npz"
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):
        return None
