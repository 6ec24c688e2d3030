"""Processing as one pipeline of plain functions: read -> validate -> normalise -> DE -> tables
(in memory), or read -> validate -> one streamed pass into the store -> tables (out of core).
Each stage lives in its own module; PertData holds the `Processed` result."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import scipy.sparse as sp

from gears.data import store as store_mod
from gears.data.conditions import (
    CONDITION_KEY_CANDIDATES,
    CTRL,
    condition_spelling,
    control_like_cells,
    control_like_note,
    detect_condition_key,
    label_conditions,
)
from gears.data.de import DE_KEYS, N_DE, DEIndex, compute_de, de_index, translate_de_keys
from gears.data.loaders import ExpressionMatrix
from gears.data.normalise import check_normalize, normalise
from gears.data.outofcore import build_store, store_params, store_root
from gears.data.pooling import check_contexts
from gears.data.read import (
    AUTO_STORE_BYTES,
    dataset_file,
    source_record,
    subset_cells,
    subset_mask,
    synthetic_gene2go,
    wants_store,
)
from gears.data.synthetic import SyntheticScreen, make_synthetic
from gears.data.validate import (
    check_controls,
    check_not_raw_counts,
    context_labels,
    finite_values,
    gene_names_of,
    validate_adata,
)
from gears.data.vocabulary import GeneSources, Vocabulary, refuse_unmatched, resolve_vocabulary
from gears.device import to_host
from gears.errors import GearsInputError
from gears.io import read_h5ad

Log = Callable[[str], None]


@dataclass(frozen=True)
class ReadOptions:
    """How a file's cells are read: its perturbation column (None: found by itself), the
    double separator, extra control labels, data.normalize and its target sum, and the
    context column (data.context_key)."""

    condition_key: str | None = None
    sep: str = "+"
    control_names: tuple[str, ...] = ()
    normalize: str = "none"
    context_key: str | None = None
    target_sum: float | None = None


@dataclass
class Processed:
    """What processing hands PertData: the processed cells and the tables over them."""

    dataset_name: str
    adata: ad.AnnData  # processed cells (from a store: obs and var only)
    expr: ExpressionMatrix  # [cells, genes] float32
    gene_names: pd.Index
    conditions: list[str]  # ctrl first, then sorted
    cell_condition: np.ndarray  # [cells] int64 into conditions
    vocab: Vocabulary
    de: DEIndex
    ctrl_mean: np.ndarray  # [genes] float64
    report: dict
    condition_key: str = "condition"
    condition_spelling: dict[str, str] = field(default_factory=dict)
    normalize_target_sum: float | None = None
    library_size: np.ndarray | None = None  # [cells] float64 (normalize='log1p')
    context_labels: tuple[str, np.ndarray] | None = None  # (column, [cells] str)
    store: store_mod.Store | None = None
    cond_means: np.ndarray | None = None  # [conditions, genes], memory-mapped from a store
    started: float = field(default_factory=time.perf_counter)  # when processing began


@dataclass(frozen=True)
class StoreSettings:
    """data.store (auto | memory | mmap), data.store_dir, data.chunk_cells, and the size above
    which data.store=auto processes a file out of core."""

    mode: str = "auto"
    store_dir: str | Path | None = None
    chunk_cells: int = 20000
    auto_bytes: int = AUTO_STORE_BYTES


def load_synthetic(
    params: dict, context_key: str | None, sources: GeneSources, log: Log
) -> tuple[Processed, SyntheticScreen, Path]:
    """The synthetic screen made from params, processed in memory, with its own GO
    annotations (written under data_dir once) unless sources name a GO file.
    -> (the result, the screen, the GO file)."""
    screen = make_synthetic(**params)
    gene2go = sources.gene2go
    if gene2go is None:  # rank 0 writes it; the others find it
        gene2go = synthetic_gene2go(sources.data_dir, params, screen.gene2go)
    opts = ReadOptions(context_key=context_key)
    processed = process_adata(
        "synthetic", screen.adata, opts, replace(sources, gene2go=gene2go),
        skip_calc_de=False, copy_x=True, log=log,
    )  # fmt: skip
    return processed, screen, gene2go


def load_file(
    data_name: str | None,
    data_path: str | Path | None,
    opts: ReadOptions,
    sources: GeneSources,
    settings: StoreSettings,
    *,
    subset: dict | None,
    pool_contexts: bool | None,
    log: Log,
) -> tuple[Processed, dict]:
    """A named dataset or an .h5ad file, processed in memory or out of core (data.store).
    -> (the result, how the file was read: read.source_record)."""
    name, path = dataset_file(data_name, data_path, sources.data_dir, sources.mirror_url)
    source = source_record(path, subset, opts.condition_key, opts.control_names, opts.normalize)
    if wants_store(path, settings.mode, settings.auto_bytes):
        processed = process_file(
            name, path, opts, sources, subset=subset, pool_contexts=pool_contexts,
            store_dir=settings.store_dir, chunk_cells=settings.chunk_cells, log=log,
        )  # fmt: skip
        return processed, source
    adata = subset_cells(read_h5ad(path), subset)
    if opts.context_key is None:
        check_contexts(
            adata, None, subset=subset, condition_key=opts.condition_key,
            control_names=opts.control_names, normalize=opts.normalize,
            pool_contexts=pool_contexts, log=log,
        )  # fmt: skip
    # Reuse DE results stored in the file (ours, or GEARS's keyed by condition_name).
    processed = process_adata(name, adata, opts, sources, skip_calc_de=True, copy_x=False, log=log)
    return processed, source


# ------------------------------------------------------------------------------- in memory
def process_adata(
    dataset_name: str,
    adata: ad.AnnData,
    opts: ReadOptions,
    sources: GeneSources,
    *,
    skip_calc_de: bool,
    copy_x: bool,
    log: Log,
) -> Processed:
    """Validate, canonicalise condition names, normalise, compute DE genes (or reuse those in
    adata.uns with skip_calc_de): the in-memory path, scanpy's reference arithmetic."""
    started = time.perf_counter()
    condition_key = detect_condition_key(adata.obs.columns, opts.condition_key)
    if opts.condition_key is None:
        others = [c for c in CONDITION_KEY_CANDIDATES if c in adata.obs and c != condition_key]
        log(
            f"perturbation column: obs[{condition_key!r}], found by itself"
            f"{f' (also present: {others})' if others else ''}; set "
            "data.condition_key to choose another"
        )
    validate_adata(adata, condition_key)
    cell_context = context_labels(adata.obs, opts.context_key)
    names = gene_names_of(adata)
    obs, gene_spellings, control_like = _labelled_obs(adata, condition_key, names, opts, log)
    conditions = obs["condition"].values
    fix = "data.control_names / control_names=(...) adds other spellings"
    check_controls(conditions, condition_key, gene_spellings, fix)
    if opts.normalize != "log1p":  # raw counts would train and score on the wrong scale
        check_not_raw_counts(finite_values(adata.X))
    # Perturbation genes are checked against GO before the (slower) DE step.
    vocab = resolve_vocabulary(sorted(set(conditions)), set(names), sources, control_like, log)
    keep = _drop_conditions(conditions, vocab.report, log)
    X = _float32(adata.X)
    if not keep.all():
        X, obs = X[keep], obs.iloc[keep]
    labels = None if cell_context is None else (opts.context_key, cell_context[keep])
    # Unfiltered, X may share memory with the caller's adata.X: normalise a copy then.
    norm = normalise(X, opts.normalize, copy_x and bool(keep.all()), opts.target_sum, log)
    refuse_unmatched(vocab)
    if norm.target_sum is not None:
        vocab.report["normalize"] = {"method": opts.normalize, "target_sum": norm.target_sum}
    if norm.X.max() > 50:
        log(
            f"warning: max expression {norm.X.max():.1f} looks like raw counts; GEARS "
            "expects log-normalised data (data.normalize=log1p normalises counts)"
        )
    processed = ad.AnnData(
        X=norm.X, obs=obs, var=pd.DataFrame({"gene_name": names.values}, index=names.values)
    )
    if skip_calc_de and all(k in adata.uns for k in DE_KEYS):
        processed.uns.update(translate_de_keys(dict(adata.uns), adata, condition_key))
    else:
        processed.uns.update(compute_de(processed, n_top=N_DE))
    spelling = condition_spelling(
        pd.Series(adata.obs[condition_key].astype(str).str.strip().values), conditions
    )
    return index_adata(
        dataset_name, processed, vocab, vocab.report, condition_key, spelling,
        norm.target_sum, norm.library_size, labels, started,
    )  # fmt: skip


def _labelled_obs(
    adata: ad.AnnData, condition_key: str, names: pd.Index, opts: ReadOptions, log: Log
) -> tuple[pd.DataFrame, set[str], dict[str, int]]:
    """The processed obs: each cell's canonical `condition`, then every other obs column (a
    context or a covariate a network reads may be any of them)."""
    obs = pd.DataFrame(index=adata.obs_names.astype(str))
    raw = adata.obs[condition_key].values
    obs["condition"], gene_spellings = label_conditions(raw, names, opts.sep, opts.control_names)
    control_like = control_like_cells(gene_spellings, obs["condition"].values)
    if control_like:
        log(control_like_note(control_like))
    for extra in adata.obs.columns:
        if extra not in (condition_key, "condition"):
            values = adata.obs[extra]
            if values.dtype == object:  # None or mixed types: h5ad cannot store them
                values = values.astype(str).where(values.notna()).astype("category")
            obs[extra] = values.values
    return obs, gene_spellings, control_like


def _drop_conditions(conditions: np.ndarray, report: dict, log: Log) -> np.ndarray:
    """Drop the conditions without GO annotation (report['dropped_conditions']) and those with
    a single cell (no DE test possible); -> the cells kept [cells] bool."""
    counts = pd.Series(conditions).value_counts()
    few = sorted(c for c in counts.index[counts < 2] if c != CTRL)
    if few:
        report["dropped_conditions_too_few_cells"] = few
        log(f"dropped {len(few)} condition(s) with a single cell (no DE test possible): {few[:10]}")
    drop = set(report["dropped_conditions"]) | set(few)
    report["dropped_conditions"] = sorted(drop)
    report["dropped_condition_cells"] = {c: int(counts[c]) for c in sorted(drop)}
    keep = ~np.isin(conditions, sorted(drop)) if drop else np.ones(len(conditions), bool)
    if (conditions[keep] != CTRL).sum() == 0:
        raise GearsInputError(
            f"no perturbed cells are left after dropping {sorted(drop)[:10]} (genes without "
            "GO annotation or conditions with one cell)"
        )
    return keep


def _float32(X):
    """X as float32, dense or CSR with one index dtype."""
    X = sp.csr_matrix(X, dtype=np.float32) if sp.issparse(X) else np.asarray(X, np.float32)
    if sp.issparse(X) and X.indices.dtype != X.indptr.dtype:
        # Files may carry int32 indices with int64 indptr; scipy's kernels need one dtype.
        X.indices, X.indptr = X.indices.astype(np.int64), X.indptr.astype(np.int64)
    return X


def index_adata(
    dataset_name: str,
    adata: ad.AnnData,
    vocab: Vocabulary,
    report: dict,
    condition_key: str,
    spelling: dict[str, str],
    target_sum: float | None,
    library_size: np.ndarray | None,
    labels: tuple[str, np.ndarray] | None,
    started: float | None = None,
) -> Processed:
    """The tables over a processed AnnData (obs['condition'], var['gene_name'], DE in uns)."""
    gene_names = pd.Index(adata.var["gene_name"].astype(str).values)
    cell_cond = adata.obs["condition"].astype(str).values
    conditions = sorted(set(cell_cond), key=lambda c: (c != CTRL, c))
    cell_condition = pd.Index(conditions).get_indexer(cell_cond).astype(np.int64)
    expr = ExpressionMatrix(adata.X)
    ctrl_rows = np.flatnonzero(cell_condition == conditions.index(CTRL))
    ctrl_mean = np.asarray(to_host(expr.rows(ctrl_rows).mean(0)).numpy(), np.float64)
    return Processed(
        dataset_name=dataset_name,
        adata=adata,
        expr=expr,
        gene_names=gene_names,
        conditions=conditions,
        cell_condition=cell_condition,
        vocab=vocab,
        de=de_index(adata.uns, conditions, gene_names),
        ctrl_mean=ctrl_mean,
        report=report,
        condition_key=condition_key,
        condition_spelling=spelling,
        normalize_target_sum=target_sum,
        library_size=library_size,
        context_labels=labels,
        started=time.perf_counter() if started is None else started,
    )


# ----------------------------------------------------------------------------- out of core
def process_file(
    dataset_name: str,
    path: Path,
    opts: ReadOptions,
    sources: GeneSources,
    *,
    subset: dict | None,
    pool_contexts: bool | None,
    store_dir: str | Path | None,
    chunk_cells: int,
    log: Log,
) -> Processed:
    """Process an .h5ad out of core into the shared store (or reuse it), then serve from it:
    the file is opened in anndata's backed mode, X stays on disk (gears.data.outofcore)."""
    check_normalize(opts.normalize)
    started = time.perf_counter()
    backed = read_h5ad(path, backed="r")  # obs and var only; X stays on disk
    try:
        chosen = detect_condition_key(backed.obs.columns, opts.condition_key)
        if opts.condition_key is None:
            log(
                f"perturbation column: obs[{chosen!r}], found by itself; set "
                "data.condition_key to choose another"
            )
        opts = replace(opts, condition_key=chosen)
        context_labels(backed.obs, opts.context_key)  # a missing column fails before any work
        if opts.context_key is None:
            check_contexts(
                backed, subset_mask(backed.obs, subset, strict=False), subset=subset,
                condition_key=chosen, control_names=opts.control_names,
                normalize=opts.normalize, pool_contexts=pool_contexts, log=log,
            )  # fmt: skip
        root = store_root(store_dir, sources.data_dir, dataset_name)
        opened = _open_or_build(
            dataset_name, path, backed, root, opts, subset, sources, chunk_cells, log
        )
        raw = backed.obs[chosen].astype(str).str.strip()
        canon, _ = label_conditions(raw.values, gene_names_of(backed), opts.sep, opts.control_names)
        spelling = condition_spelling(raw, canon)
    finally:
        backed.file.close()
    processed = index_store(dataset_name, opened, sources, chosen, spelling, opts.context_key, log)
    return replace(processed, started=started)


def _open_or_build(dataset_name, path, backed, root, opts, subset, sources, chunk_cells, log):
    """The store of this input and these parameters: opened when built before (by this
    process or another rank), else built first. -> store.Store."""
    key = store_mod.store_key(
        store_mod.input_fingerprint(path), store_params(opts, subset, sources)
    )
    opened = store_mod.open_store(root, key)
    if opened is not None:
        log(f"reusing the processed store {opened.path}")
        return opened
    build_store(dataset_name, path, backed, root, key, opts, subset, sources, chunk_cells, log)
    opened = store_mod.open_store(root, key)
    if opened is None and (root / key).exists():
        raise GearsInputError(
            f"the processed store {root / key} exists but cannot be read (damaged, "
            "or written by another version); delete that folder to rebuild it"
        )
    if opened is None:
        raise GearsInputError(
            f"the processed store {root / key} was not written; "
            "check that data.store_dir is writable"
        )
    return opened


def index_store(
    dataset_name: str,
    opened: store_mod.Store,
    sources: GeneSources,
    condition_key: str,
    spelling: dict[str, str],
    context_key: str | None,
    log: Log,
) -> Processed:
    """The tables index_adata builds, from a store's; expression memory-mapped, not read."""
    t = opened.tables
    report = opened.meta.get("report", {})
    gene_names = pd.Index(t["gene_names"].astype(str))
    conditions = [str(c) for c in t["conditions"]]
    cell_condition = t["cell_condition"].astype(np.int64)
    # The perturbation vocabulary (and GO sets) come from the GO source, cheap to re-read.
    vocab = resolve_vocabulary(conditions, set(gene_names), sources, {}, log)
    cond_means = np.load(opened.path / "means.npy", mmap_mode="r")
    obs = pd.DataFrame(
        {"condition": pd.Categorical.from_codes(cell_condition, conditions)},
        index=pd.RangeIndex(len(cell_condition)).astype(str),
    )
    de = DEIndex(
        t["de_ranked"].astype(np.int64), t["non_dropout_de"].astype(np.int64), t["non_zero_mask"]
    )
    labels = (context_key, t["cell_context"].astype(object)) if "cell_context" in t else None
    return Processed(
        dataset_name=dataset_name,
        adata=ad.AnnData(
            obs=obs, var=pd.DataFrame({"gene_name": gene_names.values}, index=gene_names.values)
        ),
        expr=ExpressionMatrix.shared(opened.matrix()),
        gene_names=gene_names,
        conditions=conditions,
        cell_condition=cell_condition,
        vocab=vocab,
        de=de,
        ctrl_mean=np.array(cond_means[conditions.index(CTRL)], dtype=np.float64),
        report=dict(report),
        condition_key=condition_key,
        condition_spelling=spelling,
        normalize_target_sum=report.get("normalize", {}).get("target_sum"),
        library_size=t["library_size"] if "library_size" in t else None,
        context_labels=labels,
        store=opened,
        cond_means=cond_means,
    )


# -------------------------------------------------------------------------------- contexts
def process_context(
    parent: Processed,
    context_key: str,
    cell_context: np.ndarray,
    contexts: list[str],
    name: str,
    dataset: str,
) -> Processed:
    """One context's cells of processed data (in memory), as data of their own: its rows of
    the processed matrix, DE recomputed against its own control cells, the conditions it holds
    with at least 2 cells, and the parent's genes, vocabulary and normalisation."""
    rows = np.flatnonzero(cell_context == contexts.index(name))
    conditions = np.asarray(parent.conditions, dtype=object)[parent.cell_condition[rows]]
    counts = pd.Series(conditions).value_counts()
    if counts.get(CTRL, 0) < 2:
        raise GearsInputError(
            f"context {name!r} has {counts.get(CTRL, 0)} control cell(s); its DE genes and "
            "control mean need at least 2"
        )
    few = sorted(c for c in counts.index[counts < 2] if c != CTRL)
    keep = ~np.isin(conditions, few)
    rows, conditions = rows[keep], conditions[keep]
    if not (conditions != CTRL).any():
        raise GearsInputError(f"context {name!r} has no perturbed cells")
    X = parent.expr.numpy()
    X = X[rows] if not sp.issparse(X) else sp.csr_matrix(X)[rows]
    obs = pd.DataFrame(
        {"condition": conditions.astype(str)},
        index=parent.adata.obs_names.astype(str).values[rows],
    )
    names = parent.gene_names
    processed = ad.AnnData(
        X=X, obs=obs, var=pd.DataFrame({"gene_name": names.values}, index=names.values)
    )
    processed.uns.update(compute_de(processed, n_top=N_DE))
    report = {"dropped_conditions": sorted(few), "dropped_conditions_too_few_cells": sorted(few)}
    if parent.report.get("normalize"):
        report["normalize"] = parent.report["normalize"]
    present = set(conditions.tolist())
    spelling = {c: v for c, v in parent.condition_spelling.items() if c in present}
    library = None if parent.library_size is None else parent.library_size[rows]
    labels = (context_key, np.full(len(rows), name, dtype=object))
    return index_adata(
        dataset, processed, parent.vocab, report, parent.condition_key, spelling,
        parent.normalize_target_sum, library, labels,
    )  # fmt: skip
