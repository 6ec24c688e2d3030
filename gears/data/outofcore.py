"""Out-of-core processing: one chunked pass over a backed .h5ad (validate, normalise, condition
statistics, DE) into a committed store (gears.data.store), never the whole matrix in memory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import anndata as ad
import h5py
import numpy as np
import pandas as pd

from gears.data import de as de_mod
from gears.data import stream
from gears.data.conditions import CTRL, control_like_cells, control_like_note, label_conditions
from gears.data.de import N_DE, N_DE_RANKED
from gears.data.normalise import median_total
from gears.data.read import subset_mask
from gears.data.store import (
    DENSE_STORE_LIMIT_BYTES,
    StoreWriter,
    choose_layout,
    input_fingerprint,
)
from gears.data.validate import (
    check_controls,
    check_not_raw_counts,
    context_labels,
    gene_names_of,
    validate_backed,
)
from gears.data.vocabulary import GeneSources, Vocabulary, refuse_unmatched, resolve_vocabulary
from gears.errors import GearsInputError
from gears.io import h5ad_error

Log = Callable[[str], None]


def store_root(store_dir: str | Path | None, data_dir: Path, dataset_name: str) -> Path:
    """data.store_dir, else <data_dir>/<dataset>/store."""
    if store_dir is not None:
        return Path(store_dir)
    return data_dir / dataset_name / "store"


def store_params(opts, subset: dict | None, sources: GeneSources) -> dict:
    """Every parameter the processed result depends on (the store key is a hash of these).
    opts: pipeline.ReadOptions with the perturbation column chosen."""

    def fingerprint(path) -> dict | None:
        return input_fingerprint(path) if path is not None else None

    # normalize, contexts and a given target sum join the key only when used: stores built
    # before they existed stay valid (a log1p store now also holds the library sizes).
    normalize = opts.normalize
    normalized = {"normalize": normalize, "library_size": True} if normalize != "none" else {}
    if opts.context_key is not None:
        normalized["context_key"] = opts.context_key
    if opts.target_sum is not None:
        normalized["target_sum"] = float(opts.target_sum)
    return {
        **normalized,
        "condition_key": opts.condition_key,
        "sep": opts.sep,
        "control_names": sorted(opts.control_names),
        "subset": {
            k: sorted(map(str, v if isinstance(v, (list, tuple)) else [v]))
            for k, v in sorted((subset or {}).items())
        },
        "gene2go": fingerprint(sources.go_file()),
        "gene_aliases": fingerprint(sources.aliases),
        "keep_unmapped_perts": sources.unmapped_perts == "keep",
        "n_de": N_DE,
        "n_de_ranked": N_DE_RANKED,
        "dense_limit": DENSE_STORE_LIMIT_BYTES,
    }


def build_store(
    dataset_name: str,
    path: Path,
    backed: ad.AnnData,
    root: Path,
    key: str,
    opts,
    subset: dict | None,
    sources: GeneSources,
    chunk_cells: int,
    log: Log,
) -> None:
    """One chunked pass over the backed file -> a committed store (temp dir + rename).
    normalize='log1p' reads the file twice: cell totals (the median target) first.
    opts: pipeline.ReadOptions with the perturbation column chosen."""
    names = gene_names_of(backed)
    validate_backed(backed, opts.condition_key)
    keep = subset_mask(backed.obs, subset, strict=True)
    raw = backed.obs[opts.condition_key]
    conditions, gene_spellings = label_conditions(raw.values, names, opts.sep, opts.control_names)
    conditions = np.where(keep, conditions, "")
    control_like = control_like_cells(gene_spellings, conditions[keep])
    if control_like:
        log(control_like_note(control_like))
    fix = "pass control_names=(...) for other spellings"
    check_controls(conditions[keep], opts.condition_key, gene_spellings, fix)
    present = sorted(set(conditions[keep]))
    vocab = resolve_vocabulary(present, set(names), sources, control_like, log)
    kept_conditions = _kept_conditions(conditions[keep], present, vocab.report)
    codes = pd.Index(kept_conditions).get_indexer(conditions).astype(np.int64)
    n_kept = int((codes >= 0).sum())
    nnz = _csr_nnz(path, codes)
    layout = choose_layout(n_kept, len(names), nnz)
    index_dtype = np.int32 if (nnz or 0) < 2**31 - 1 else np.int64
    try:
        writer = StoreWriter(root, key, len(names), layout, index_dtype=index_dtype)
    except OSError as e:
        raise store_write_error(root, e) from None
    try:
        tables = _stream_into(
            writer, backed, codes, keep, kept_conditions, opts, vocab, chunk_cells, log
        )
        meta = {"dataset": dataset_name, "source": str(path), "report": vocab.report}
        writer.commit(tables=tables, meta={**meta, "n_input_cells": int(backed.n_obs)})
    except BaseException as e:
        writer.abort()  # the temp folder goes: nothing half-written is left in the store
        if isinstance(e, OSError) and e.errno is not None:  # a write (h5py reads: no errno)
            raise store_write_error(root, e) from None
        damaged = (OSError, RuntimeError, KeyError, ValueError, TypeError)  # from h5py
        if isinstance(e, damaged) and not isinstance(e, GearsInputError):
            raise h5ad_error(path, e) from None
        raise
    log(f"wrote the processed store {root / key} ({layout}, {n_kept} cells)")


def _kept_conditions(conditions: np.ndarray, present: list[str], report: dict) -> list[str]:
    """The kept cells' conditions [cells] less those without GO annotation and those with a
    single cell (no DE test possible): ctrl first, then sorted. Records both in report."""
    counts = pd.Series(conditions).value_counts()
    few = sorted(c for c in counts.index[counts < 2] if c != CTRL)
    drop = set(report["dropped_conditions"]) | set(few)
    report["dropped_conditions_too_few_cells"] = few
    report["dropped_conditions"] = sorted(drop)
    kept = sorted(set(present) - drop, key=lambda c: (c != CTRL, c))
    if len(kept) < 2:
        raise GearsInputError(
            f"no perturbed cells are left after dropping {sorted(drop)[:10]} (genes "
            "without GO annotation or conditions with one cell)"
        )
    return kept


def _csr_nnz(path: Path, codes: np.ndarray) -> int | None:
    """The stored values of the kept rows (codes >= 0) of a CSR file, None for a dense X; a
    CSC one is refused (each chunk of rows would read the whole matrix)."""
    nnz = None
    try:
        with h5py.File(path, "r") as f:
            if isinstance(f["X"], h5py.Group):
                if f["X"].attrs.get("encoding-type") == "csc_matrix":
                    raise GearsInputError(
                        f"{path.name} stores X by column (CSC); out-of-core processing "
                        "reads rows, which would read the whole matrix per chunk. Rewrite "
                        "it by rows (adata.X = adata.X.tocsr(); adata.write_h5ad(...)) or "
                        "use data.store=memory"
                    )
                indptr = f["X"]["indptr"][:]
                nnz = int(np.diff(indptr)[codes >= 0].sum())
    except GearsInputError:
        raise
    except (OSError, RuntimeError, KeyError, ValueError, TypeError) as e:  # a damaged file
        raise h5ad_error(path, e) from None
    return nnz


def _stream_into(
    writer: StoreWriter,
    backed: ad.AnnData,
    codes: np.ndarray,
    keep: np.ndarray,
    kept_conditions: list[str],
    opts,
    vocab: Vocabulary,
    chunk_cells: int,
    log: Log,
) -> dict[str, np.ndarray]:
    """Stream the kept rows into the writer, normalised (log1p) or checked for raw counts as
    the in-memory path does; DE from the pass's statistics. -> the store's tables."""
    names = gene_names_of(backed)
    extra_tables = {}
    if opts.context_key is not None:
        contexts = context_labels(backed.obs, opts.context_key)[codes >= 0]
        extra_tables["cell_context"] = contexts.astype(str)
    probe = stream.CountsProbe()
    inspect, transform = _value_hooks(
        backed, codes, keep, probe, opts, vocab, extra_tables, chunk_cells, log
    )
    stats = stream.stream_condition_stats(
        backed.X,
        backed.n_obs,
        codes,
        len(kept_conditions),
        len(names),
        chunk_cells,
        sink=writer.append_rows,
        inspect=inspect,
        transform=transform,
        moments=de_mod.scanpy_aggregates(),
    )
    check_not_raw_counts(probe.summary())
    refuse_unmatched(vocab)
    if stats.max_value > 50:
        log(
            f"warning: max expression {stats.max_value:.1f} looks like raw "
            "counts; GEARS expects log-normalised data"
        )
    uns = dict(backed.uns)
    if all(k in uns for k in de_mod.DE_KEYS):  # DE results shipped with the file
        de = de_mod.translate_de_keys(uns, backed, opts.condition_key)
    else:
        de = de_mod.de_from_stats(
            kept_conditions, stats.sums, stats.sumsq, stats.counts, np.asarray(names),
            n_top=N_DE, n_ranked=N_DE_RANKED, moments=stats.moments,
        )  # fmt: skip
    ranked, non_dropout, non_zero_mask = de_mod.de_index(de, kept_conditions, names)
    np.save(writer.tmp / "means.npy", stats.means)
    return {
        "conditions": np.array(kept_conditions, dtype=str),
        "cell_condition": codes[codes >= 0].astype(np.int32),
        "gene_names": np.asarray(names, dtype=str),
        "de_ranked": ranked.astype(np.int32),
        "non_dropout_de": non_dropout.astype(np.int32),
        "non_zero_mask": non_zero_mask,
        **extra_tables,
    }


def _value_hooks(backed, codes, keep, probe, opts, vocab, extra_tables, chunk_cells, log):
    """The pass's per-chunk hooks: with normalize='log1p' a transform to the target total (a
    first pass reads the cell totals, kept as library_size), else an inspection of the kept
    cells' values for raw counts (what check_not_raw_counts reads in memory, the dropped
    conditions' cells included). -> (inspect, transform), one of them None."""
    if opts.normalize == "log1p":
        totals = stream.count_totals(backed.X, backed.n_obs, codes >= 0, chunk_cells)
        target = median_total(totals) if opts.target_sum is None else float(opts.target_sum)
        extra_tables["library_size"] = totals.astype(np.float64)
        vocab.report["normalize"] = {"method": opts.normalize, "target_sum": target}
        log(
            f"normalised raw counts: each cell scaled to {target:.0f} counts (the "
            "median), then log1p"
        )

        def transform(block):
            return stream.normalize_log1p(block, target)

        return None, transform

    def inspect(start, block):
        probe.add(block[np.flatnonzero(keep[start : start + block.shape[0]])])
        if probe.seen >= probe.sample:  # decided: no need to read on
            check_not_raw_counts(probe.summary())

    return inspect, None


def store_write_error(root: Path, error: OSError) -> GearsInputError:
    """A failed write into the processed store (disk full, quota, permissions): the temp folder
    is already removed; the message says where and what to do."""
    return GearsInputError(
        f"could not write the processed store in {root} ({error.strerror or error}); nothing "
        "was kept. Free space there, or point data.store_dir (or data.data_dir) to a larger "
        "writable disk, and run again"
    )
