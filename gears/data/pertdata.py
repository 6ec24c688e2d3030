"""PertData: validate and process a Perturb-seq AnnData, split it, build graphs, serve tensors."""

from __future__ import annotations

import json
import time
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import scipy.sparse as sp

from gears.choices import CHOICES
from gears.data import de as de_mod
from gears.data.conditions import (
    CONDITION_KEY_CANDIDATES,
    CTRL,
    canonicalize_conditions,
    condition_genes,
    control_like_genes,
    detect_condition_key,
    genes_of,
    refuse_joined_gene_names,
)
from gears.data.loaders import EpochLoader, ExampleSet, ExpressionMatrix, eval_loader, train_loader
from gears.data.pooling import check_contexts
from gears.data.stream import not_counts_error
from gears.device import to_host
from gears.errors import GearsInputError
from gears.io import h5ad_error, read_h5ad

PROCESSED_NAME = "perturb_processed.h5ad"
N_DE = 20  # GEARS's "top-20 DE genes"
N_DE_RANKED = 200  # longest DE list the metrics use (top-200 variants)
# data.store=auto: an .h5ad whose file or dense float32 matrix is larger than this is processed
# out of core into a memory-mapped store; smaller ones are read whole and processed by scanpy
# (the reference path).
AUTO_STORE_BYTES = 1024**3


def _finite_values(X) -> np.ndarray:
    return X.data if sp.issparse(X) else np.asarray(X)


def _rows_with_nonfinite(X) -> np.ndarray:
    """Rows (cells) holding a NaN or infinite value (only run to word an error)."""
    if sp.issparse(X):
        X = sp.csr_matrix(X)
        bad_values = np.flatnonzero(~np.isfinite(X.data))
        return np.unique(np.searchsorted(X.indptr, bad_values, side="right") - 1)
    return np.flatnonzero(~np.isfinite(np.asarray(X)).all(axis=1))


def validate_adata(adata: ad.AnnData, condition_key: str = "condition") -> None:
    """Raise GearsInputError naming the first problem found in a raw AnnData."""
    if adata.n_obs == 0 or adata.n_vars == 0:
        raise GearsInputError(f"the AnnData is empty ({adata.n_obs} cells x {adata.n_vars} genes)")
    if condition_key not in adata.obs:
        raise GearsInputError(
            f"adata.obs has no {condition_key!r} column naming each cell's perturbation "
            f"(columns present: {list(adata.obs.columns)}); add it, spelled 'ctrl' / 'A+ctrl' / "
            "'A+B' (or 'control', 'A', 'A+B')"
        )
    missing = adata.obs[condition_key].isna()
    if missing.any():
        raise GearsInputError(
            f"{int(missing.sum())} cells have a missing (NaN/null) value in "
            f"obs[{condition_key!r}]; "
            "label them (e.g. 'ctrl') or drop them"
        )
    values = _finite_values(adata.X)
    n_bad = int(np.size(values) - np.isfinite(values).sum())
    if n_bad:
        first = [str(adata.obs_names[r]) for r in _rows_with_nonfinite(adata.X)[:5]]
        raise GearsInputError(
            f"adata.X has {n_bad} NaN or infinite expression values (cells {first} ...); "
            "drop those cells or fix them (e.g. re-run sc.pp.normalize_total + sc.pp.log1p on "
            "the raw counts) before processing"
        )
    if np.size(values) and values.min() < 0:
        raise GearsInputError(
            f"adata.X has negative values (min {values.min():.3g}); GEARS expects log-normalised "
            "counts (sc.pp.normalize_total then sc.pp.log1p), not scaled or centred data"
        )
    if np.size(values) and values.max() > np.finfo(np.float32).max:  # inf once stored
        raise GearsInputError(
            f"adata.X has values too large for float32 (max {values.max():.3g}); GEARS expects "
            "log-normalised counts (sc.pp.normalize_total then sc.pp.log1p)"
        )
    check_gene_names(adata)
    names = gene_names_of(adata)
    dup = names[names.duplicated()].unique()
    if len(dup):
        raise GearsInputError(
            f"{len(dup)} duplicate gene names, e.g. {list(dup[:5])}; make them unique "
            "(adata.var_names_make_unique()) or drop the duplicates"
        )


RAW_COUNT_MAX = 30  # log1p of normalised counts stays far below; raw UMI counts reach it


def check_not_raw_counts(values: np.ndarray, sample: int = 10_000_000) -> None:
    """Refuse raw counts: every value an integer and the maximum above RAW_COUNT_MAX. GEARS's
    loss and metrics assume log-normalised expression; raw counts would train and score without
    any error, on the wrong scale (a wrong result that looks right). A check of the first
    `sample` stored values keeps this cheap on large data."""
    head = np.asarray(values).reshape(-1)[:sample].astype(np.float32, copy=False)  # as stored
    if head.size and head.max() > RAW_COUNT_MAX and np.array_equal(head, np.round(head)):
        raise GearsInputError(
            f"adata.X looks like raw counts (every value is an integer, max {head.max():.0f}); "
            "GEARS expects log-normalised expression: set data.normalize=log1p (PertData: "
            "normalize='log1p') to normalise them, or run sc.pp.normalize_total(adata) then "
            "sc.pp.log1p(adata) first"
        )


def check_normalize(method: str) -> None:
    if method not in CHOICES["data.normalize"]:
        raise GearsInputError(
            f"normalize must be one of {CHOICES['data.normalize']}, got {method!r}"
        )


def median_total(totals: np.ndarray) -> float:
    """data.normalize=log1p's target: the median total of the cells with any counts."""
    totals = np.asarray(totals)
    return float(np.median(totals[totals > 0])) if (totals > 0).any() else 1.0


def context_labels(obs: pd.DataFrame, context_key: str | None) -> np.ndarray | None:
    """Each cell's context (obs[context_key] as text) [cells], None without a key; a missing
    column or a cell without a context is one GearsInputError naming the fix."""
    if context_key is None:
        return None
    if context_key not in obs:
        raise GearsInputError(
            f"data.context_key={context_key!r}: adata.obs has no such column (columns: "
            f"{list(obs.columns)}); name the column of each cell's context (e.g. its cell "
            "line), or set data.context_key=null for one context"
        )
    column = obs[context_key]
    missing = column.isna().values | (column.astype(str).str.strip() == "").values
    if missing.any():
        raise GearsInputError(
            f"{int(missing.sum())} cells have no value in obs[{context_key!r}] "
            "(data.context_key); label their context or drop them"
        )
    return column.astype(str).str.strip().values.astype(object)


def check_control_cells(n_ctrl: int) -> None:
    """DE tests each condition against the control cells: one cell has no variance."""
    if n_ctrl < 2:
        raise GearsInputError(
            f"only {n_ctrl} control cell: the DE test and the control mean need at least 2; "
            "add control cells (or label more cells with a control spelling)"
        )


def resolve_unmapped_perts(unmapped_perts: str | None, keep_unmapped_perts: bool = False) -> str:
    """The unmapped-perturbation policy from the new key and its deprecated boolean alias."""
    if unmapped_perts is None:
        return "keep" if keep_unmapped_perts else "error"
    if unmapped_perts not in CHOICES["data.unmapped_perts"]:
        raise GearsInputError(
            f"unmapped_perts={unmapped_perts!r} is not one of {CHOICES['data.unmapped_perts']}; "
            "use 'error', 'drop' (as the original GEARS) or 'keep'"
        )
    if keep_unmapped_perts and unmapped_perts != "keep":
        if unmapped_perts == "drop":
            raise GearsInputError(
                "data.keep_unmapped_perts=true (deprecated: means unmapped_perts=keep) "
                "contradicts data.unmapped_perts=drop; remove data.keep_unmapped_perts"
            )
        return "keep"  # the deprecated alias beats the default
    return unmapped_perts


def check_gene_names(adata: ad.AnnData) -> None:
    """Every gene needs a name: an empty or missing one (str() would make it 'nan' or
    'None') cannot be perturbed, predicted or matched to a model."""
    column = adata.var["gene_name"] if "gene_name" in adata.var else adata.var_names.to_series()
    blank = column.isna().values | (column.astype(str).str.strip() == "").values
    if blank.any():
        where = "var['gene_name']" if "gene_name" in adata.var else "var_names"
        raise GearsInputError(
            f"{int(blank.sum())} genes have an empty or missing gene name in {where} (rows "
            f"{np.flatnonzero(blank)[:5].tolist()}); name them or drop those genes"
        )


def gene_names_of(adata: ad.AnnData) -> pd.Index:
    """Gene symbols: var['gene_name'] when present (GEARS's files), else var_names."""
    if "gene_name" in adata.var:
        return pd.Index(adata.var["gene_name"].astype(str).values)
    return pd.Index(adata.var_names.astype(str))


def source_record(path: Path, subset, condition_key, control_names, normalize: str) -> dict:
    """How a file was read (PertData._source), so that a context view reads it again alike."""
    return dict(
        path=path,
        subset=dict(subset or {}),
        condition_key=condition_key,
        control_names=tuple(control_names),
        normalize=normalize,
    )


class PertData:
    """A Perturb-seq screen ready for GEARS: conditions, DE genes, splits, gene graphs, tensors.

    data_dir: where datasets are cached and processed files written.
    gene2go: path of a gene -> GO source (GEARS pickle, TSV, GAF, GMT); None = the dataset's
      default (the synthetic screen's own annotations, or GEARS's gene2go_all.pkl downloaded).
    gene_aliases: optional `alias<TAB>SYMBOL` table used for symbols missing from the GO source.
    unmapped_perts: what to do with conditions perturbing a gene that is neither measured nor in
      the GO source: "error" (default: stop, listing the genes), "drop" (GEARS: remove those
      conditions; `report["dropped_condition_cells"]` lists them with their cell counts) or
      "keep" (keep them, without GO edges). Measured genes without GO terms are dropped as GEARS
      does, except with "keep".
    keep_unmapped_perts: deprecated spelling of unmapped_perts="keep".
    mirror_url: base URL of a mirror of GEARS's public files (see gears.data.download); None
      reads the GEARS_MIRROR_URL environment variable, else Harvard Dataverse.
    """

    def __init__(
        self,
        data_dir: str | Path = "data",
        gene2go: str | Path | None = None,
        gene_aliases: str | Path | None = None,
        keep_unmapped_perts: bool = False,
        seed: int = 1,
        verbose: bool = True,
        store: str = "auto",
        store_dir: str | Path | None = None,
        chunk_cells: int = 20000,
        unmapped_perts: str | None = None,
        mirror_url: str | None = None,
    ):
        self.data_dir = Path(data_dir)
        self.gene2go_user = gene2go  # as given; the synthetic screen brings its own otherwise
        self.gene2go_path = gene2go
        self.gene_aliases_path = gene_aliases
        self.unmapped_perts = resolve_unmapped_perts(unmapped_perts, keep_unmapped_perts)
        self.keep_unmapped_perts = self.unmapped_perts == "keep"
        self.mirror_url = mirror_url
        self.seed = seed
        self.verbose = verbose
        self.adata: ad.AnnData | None = None
        self.dataset_name: str | None = None
        self.split = None
        self.set2conditions: dict[str, list[str]] | None = None
        self.subgroup: dict | None = None
        self.dataloader: dict[str, EpochLoader] | None = None
        # The arguments the current loaders were built with (GEARS.train compares them with its
        # training config instead of silently training on loaders built for other settings).
        self.dataloader_settings: dict | None = None
        self.report: dict = {}
        self._graphs: dict = {}
        self.synthetic = None
        if store not in CHOICES["data.store"]:
            raise GearsInputError(
                f"data.store must be one of {CHOICES['data.store']}, got {store!r}"
            )
        self.store_mode = store  # auto | memory | mmap (see _wants_store)
        self.store_dir = store_dir
        self.chunk_cells = chunk_cells
        self.store = None  # the open gears.data.store.Store when the data came from one
        self._cond_means = None
        # The input's own spelling: its perturbation column, and per canonical condition the
        # first raw name seen (e.g. 'non-targeting', 'KLF1'); predictions are written with them.
        self.condition_key: str = "condition"
        self.condition_spelling: dict[str, str] = {}
        self.normalize_target_sum: float | None = None  # set by normalize='log1p'
        # Raw counts' totals per cell [cells] (normalize='log1p'): the depth that counts output
        # (gears/counts.py) gives predicted cells.
        self.library_size: np.ndarray | None = None
        # Contexts (e.g. cell lines; data.context_key): set by set_context_key, which load
        # calls with its context_key.
        self.context_key: str | None = None
        self.contexts: list[str] = []  # the context names ([] without a context key)
        self.cell_context: np.ndarray | None = None  # [cells] code into contexts
        self.context_ctrl_means: np.ndarray | None = None  # [contexts, genes] float64
        self.context: str | None = None  # the one context a context_view holds
        # Each cell's context as read with the cells [cells] (str), and the column it came
        # from: set_context_key codes these (a memory-mapped store keeps no other obs column).
        self._context_labels: tuple[str, np.ndarray] | None = None
        self._source: dict | None = None  # how a file was read (context views re-read it)
        self._control_like: dict[str, int] = {}  # genes spelled like a control: cells
        self._unmatched_genes: str | None = None  # see refuse_unmatched_genes

    def _log(self, msg: str) -> None:
        if self.verbose:
            print(msg, flush=True)

    # ----------------------------------------------------------------------------------- loading
    def load(
        self,
        data_name: str | None = None,
        data_path: str | Path | None = None,
        synthetic_params: dict | None = None,
        subset: dict | None = None,
        condition_key: str | None = None,
        control_names: tuple[str, ...] = (),
        normalize: str = "none",
        context_key: str | None = None,
        target_sum: float | None = None,
        pool_contexts: bool | None = None,
    ) -> PertData:
        """Load a named dataset (`synthetic`, `norman`, `adamson`, `dixit`,
        `replogle_k562_essential`, `replogle_rpe1_essential`) or a processed/raw `.h5ad` path
        (a file, or a folder holding perturb_processed.h5ad).

        subset: keep only cells whose obs columns hold the given value(s), e.g.
        {"dataset": "norman19"} or {"cell_type": ["K562", "RPE1"]}.
        condition_key, control_names, normalize, context_key, target_sum: as in
        new_data_process (files only).
        pool_contexts: what to do, without a context_key, with a file whose kept cells span
        several contexts (an obs column naming cell lines or types; gears.data.pooling): False
        refuses naming the column (what train_single.py does), True pools them, None (the
        default here) pools them and says so (set_context_key may follow).
        """
        from gears.data import download

        if data_name == "synthetic":
            from gears.data.synthetic import make_synthetic, write_gene2go_tsv

            params = dict(synthetic_params or {})
            self.synthetic = make_synthetic(**params)
            self.gene2go_path = self.gene2go_user
            if self.gene2go_path is None:
                tag = "_".join(f"{k}{v}" for k, v in sorted(params.items())) or "default"
                path = self.data_dir / "synthetic" / f"gene2go_{tag}.tsv.gz"
                if not path.exists():  # rank 0 writes it; the others find it (no write at all)
                    from gears.checkpoint import CheckpointWriteError, atomic_write

                    # Whole or absent, even with two runs sharing data_dir; a full disk is one
                    # error line and leaves no temp file.
                    try:
                        atomic_write(
                            path, lambda tmp: write_gene2go_tsv(self.synthetic.gene2go, tmp, True)
                        )
                    except (OSError, CheckpointWriteError) as e:
                        why = e.strerror if isinstance(e, OSError) and e.strerror else e
                        raise GearsInputError(
                            f"could not write the synthetic screen's GO file {path} "
                            f"({why}): data.data_dir must be a writable folder; "
                            "point data.data_dir at one"
                        ) from None
                self.gene2go_path = path
            return self.new_data_process(
                "synthetic", self.synthetic.adata, write=False, context_key=context_key
            )
        if data_name is not None and data_path is None:
            if data_name not in download.DATASETS:
                p = Path(data_name)
                if p.suffix == ".h5ad" or p.is_dir():
                    return self.load(
                        data_path=p,
                        subset=subset,
                        condition_key=condition_key,
                        control_names=control_names,
                        normalize=normalize,
                        context_key=context_key,
                        target_sum=target_sum,
                        pool_contexts=pool_contexts,
                    )
                raise GearsInputError(
                    f"unknown dataset {data_name!r}; use 'synthetic', one of "
                    f"{sorted(download.DATASETS)}, or a path to an .h5ad file"
                )
            data_path = download.fetch_dataset(
                data_name, self.data_dir, base_url=download.base_url(self.mirror_url)
            )
        self.gene2go_path = self.gene2go_user
        if data_path is None:
            raise GearsInputError("PertData.load needs data_name or data_path")
        path = Path(data_path)
        if path.is_dir():
            path = path / PROCESSED_NAME
        if not path.exists():
            raise GearsInputError(f"no .h5ad file at {path}")
        name = data_name or (path.parent.name if path.name == PROCESSED_NAME else path.stem)
        if self._wants_store(path):
            return self.process_backed(
                name,
                path,
                subset=subset,
                condition_key=condition_key,
                control_names=tuple(control_names),
                normalize=normalize,
                context_key=context_key,
                target_sum=target_sum,
                pool_contexts=pool_contexts,
            )
        self._source = source_record(path, subset, condition_key, control_names, normalize)
        adata = read_h5ad(path)
        for column, wanted in (subset or {}).items():
            if column not in adata.obs:
                raise GearsInputError(
                    f"subset: adata.obs has no column {column!r} "
                    f"(columns: {list(adata.obs.columns)})"
                )
            wanted = wanted if isinstance(wanted, (list, tuple)) else [wanted]
            keep = adata.obs[column].astype(str).isin([str(w) for w in wanted]).values
            if not keep.any():
                raise GearsInputError(f"subset: no cell has obs[{column!r}] in {wanted}")
            adata = adata[keep].copy()
        if context_key is None:
            check_contexts(
                adata,
                None,
                subset=subset,
                condition_key=condition_key,
                control_names=control_names,
                normalize=normalize,
                pool_contexts=pool_contexts,
                log=self._log,
            )
        # Reuse DE results stored in the file (ours, or GEARS's keyed by condition_name).
        return self.new_data_process(
            name,
            adata,
            condition_key=condition_key,
            control_names=tuple(control_names),
            normalize=normalize,
            skip_calc_de=True,
            write=False,
            copy_x=False,
            context_key=context_key,
            target_sum=target_sum,
        )

    def new_data_process(
        self,
        dataset_name: str,
        adata: ad.AnnData,
        *,
        condition_key: str | None = None,
        sep: str = "+",
        control_names: tuple[str, ...] = (),
        skip_calc_de: bool = False,
        write: bool = True,
        normalize: str = "none",
        copy_x: bool = True,
        context_key: str | None = None,
        target_sum: float | None = None,
    ) -> PertData:
        """Validate, canonicalise condition names, compute DE genes, write the processed h5ad.

        Accepts `ctrl`/`control`/`non-targeting`, `A`, `A+ctrl`, `ctrl+A`, `A+B` (separator `sep`).
        condition_key: the obs column naming each cell's perturbation; None = the first of
        `condition`, `perturbation`, `target_gene`, `gene`, `guide_target` present (printed).
        normalize: `none` (X is already log-normalised) or `log1p` (X holds raw counts: scale
        each cell to the median total count, then log1p, as cell-eval and the Virtual Cell
        Challenge do; the caller's AnnData is left unchanged unless copy_x=False, which saves a
        copy of X when the caller hands the AnnData over, as `load` does). target_sum: scale
        each cell to this total instead of the median (a context view keeps the whole data's).
        The raw totals are kept as `library_size`.
        context_key: the obs column naming each cell's context (e.g. its cell line): `contexts`
        and `context_view` then serve one context at a time.
        DE results go to `.uns` under the keys in gears.data.de.DE_KEYS, keyed by condition.
        """
        t0 = time.perf_counter()
        chosen = detect_condition_key(adata.obs.columns, condition_key)
        if condition_key is None:
            others = [c for c in CONDITION_KEY_CANDIDATES if c in adata.obs and c != chosen]
            self._log(
                f"perturbation column: obs[{chosen!r}], found by itself"
                f"{f' (also present: {others})' if others else ''}; set "
                "data.condition_key to choose another"
            )
        condition_key = chosen
        validate_adata(adata, condition_key)
        cell_context = context_labels(adata.obs, context_key)
        names = gene_names_of(adata)
        obs = pd.DataFrame(index=adata.obs_names.astype(str))
        gene_spellings = control_like_genes(names, control_names)
        refuse_joined_gene_names(adata.obs[condition_key].values, names, sep)
        obs["condition"] = canonicalize_conditions(
            adata.obs[condition_key].values, sep, control_names, gene_spellings
        )
        self._report_control_like_genes(gene_spellings, obs["condition"].values)
        # Spellings as written, less surrounding blanks (' G000 ' is G000 for the model too).
        raw_names = adata.obs[condition_key].astype(str).str.strip().values
        self.condition_key = condition_key
        self.condition_spelling = (
            pd.Series(raw_names).groupby(obs["condition"].values, sort=False).first().to_dict()
        )
        # Every other obs column is kept: a context (data.context_key) or a covariate a
        # network reads may be any of them.
        for extra in adata.obs.columns:
            if extra not in (condition_key, "condition"):
                values = adata.obs[extra]
                if values.dtype == object:  # None or mixed types: h5ad cannot store them
                    values = values.astype(str).where(values.notna()).astype("category")
                obs[extra] = values.values
        conditions = obs["condition"].values
        if not (conditions == CTRL).any():
            raise GearsInputError(
                f"no control cells: none of obs[{condition_key!r}] is 'ctrl', 'control' or "
                "'non-targeting' (data.control_names / control_names=(...) adds other spellings)"
                + _gene_spelling_hint(gene_spellings)
            )
        if (conditions == CTRL).all():
            raise GearsInputError("every cell is a control: the data has no perturbed cells")
        check_control_cells(int((conditions == CTRL).sum()))
        if normalize != "log1p":  # raw counts would train and score on the wrong scale
            check_not_raw_counts(_finite_values(adata.X))
        # Perturbation genes are checked against GO before the (slower) DE step.
        self._resolve_perturbations(sorted(set(conditions)), set(names))
        counts = pd.Series(conditions).value_counts()
        few = sorted(c for c in counts.index[counts < 2] if c != CTRL)
        if few:
            self.report["dropped_conditions_too_few_cells"] = few
            self._log(
                f"dropped {len(few)} condition(s) with a single cell (no DE test "
                f"possible): {few[:10]}"
            )
        drop = set(self.report["dropped_conditions"]) | set(few)
        self.report["dropped_conditions"] = sorted(drop)
        self.report["dropped_condition_cells"] = {c: int(counts[c]) for c in sorted(drop)}
        keep = ~np.isin(conditions, sorted(drop)) if drop else np.ones(len(conditions), bool)
        if (conditions[keep] != CTRL).sum() == 0:
            raise GearsInputError(
                f"no perturbed cells are left after dropping {sorted(drop)[:10]} (genes without "
                "GO annotation or conditions with one cell)"
            )
        X = adata.X
        X = sp.csr_matrix(X, dtype=np.float32) if sp.issparse(X) else np.asarray(X, np.float32)
        if sp.issparse(X) and X.indices.dtype != X.indptr.dtype:
            # Files may carry int32 indices with int64 indptr; scipy's kernels need one dtype.
            X.indices, X.indptr = X.indices.astype(np.int64), X.indptr.astype(np.int64)
        if not keep.all():
            X, obs = X[keep], obs.iloc[keep]
        self._context_labels = None if cell_context is None else (context_key, cell_context[keep])
        # Unfiltered, X may share memory with the caller's adata.X: normalise a copy then.
        X = self._normalize(X, normalize, copy=copy_x and bool(keep.all()), target_sum=target_sum)
        self.refuse_unmatched_genes()
        if self.normalize_target_sum is not None:
            self.report["normalize"] = {
                "method": normalize,
                "target_sum": self.normalize_target_sum,
            }
        if X.max() > 50:
            self._log(
                f"warning: max expression {X.max():.1f} looks like raw counts; GEARS "
                "expects log-normalised data (data.normalize=log1p normalises counts)"
            )
        processed = ad.AnnData(
            X=X, obs=obs, var=pd.DataFrame({"gene_name": names.values}, index=names.values)
        )
        uns_old = dict(adata.uns) if skip_calc_de else {}
        if skip_calc_de and all(k in uns_old for k in de_mod.DE_KEYS):
            processed.uns.update(self._translate_de_keys(uns_old, adata, condition_key))
        else:
            processed.uns.update(de_mod.compute_de(processed, n_top=N_DE))
        self._setup(dataset_name, processed)
        if write:
            out = self.data_dir / dataset_name / PROCESSED_NAME
            from gears.checkpoint import atomic_write
            from gears.io import write_h5ad

            # temp + fsync + rename: never torn
            atomic_write(out, lambda tmp: write_h5ad(processed, tmp))
            self._log(f"wrote {out}")
        self._log(
            f"processed {dataset_name}: {processed.n_obs} cells x {processed.n_vars} genes, "
            f"{len(self.conditions)} conditions in {time.perf_counter() - t0:.1f}s"
        )
        return self

    def _report_control_like_genes(self, gene_spellings: set[str], conditions) -> None:
        """Say so when a label spelled like a control was read as a measured gene of that name
        (CTRL): the cells per such gene go to report['control_like_genes'] (kept by
        _resolve_perturbations, which starts the report afresh)."""
        self._control_like = {}
        if gene_spellings:
            counts = pd.Series(np.asarray(conditions, dtype=object)).value_counts()
            for gene in sorted(gene_spellings):
                n = int(sum(k for c, k in counts.items() if gene in condition_genes(str(c))))
                if n:
                    self._control_like[gene] = n
        if self._control_like:
            self._log(
                f"labels spelled like a control but naming a measured gene were read as "
                f"perturbations of that gene (cells: {self._control_like}); if they are control "
                "cells, add that exact spelling to data.control_names"
            )

    def _normalize(self, X, method: str, copy: bool, target_sum: float | None = None):
        """normalize='log1p': raw counts -> log1p(counts scaled to the median cell total, or to
        target_sum); the totals are kept as library_size."""
        self.normalize_target_sum = None
        self.library_size = None
        check_normalize(method)
        if method == "none":
            return X
        import scanpy as sc

        values = _finite_values(X)
        if np.size(values) and np.any(values != np.round(values)):
            raise not_counts_error()
        totals = np.asarray(X.sum(axis=1)).ravel()
        target = median_total(totals) if target_sum is None else float(target_sum)
        work = ad.AnnData(X=X.copy() if copy else X)
        sc.pp.normalize_total(work, target_sum=target)
        sc.pp.log1p(work)
        self.normalize_target_sum = target
        self.library_size = totals.astype(np.float64)
        self._log(
            f"normalised raw counts: each cell scaled to {target:.0f} counts "
            f"({'the median' if target_sum is None else 'as the whole data'}), then log1p"
        )
        return work.X

    def _translate_de_keys(self, uns: dict, adata: ad.AnnData, condition_key: str) -> dict:
        """GEARS's own files key DE results by `condition_name`; re-key them by condition."""
        if "condition_name" in adata.obs:
            canon = canonicalize_conditions(
                adata.obs[condition_key].values, genes=control_like_genes(gene_names_of(adata))
            )
            name_to_cond = dict(zip(adata.obs["condition_name"].astype(str), canon))
        else:
            name_to_cond = {}
        # Gene lists hold var_names (Ensembl ids in GEARS's files): map them to symbols.
        id_to_symbol = pd.Series(gene_names_of(adata), index=adata.var_names.astype(str))
        out = {}
        for key in de_mod.DE_KEYS:
            out[key] = {}
            for k, v in uns[key].items():
                v = np.asarray(v)
                if v.dtype.kind in "OUS":
                    v = id_to_symbol.reindex(v.astype(str)).fillna("").values.astype(str)
                out[key][name_to_cond.get(k, k)] = v
        return out

    # --------------------------------------------------------------------------------- internals
    def _setup(self, dataset_name: str, adata: ad.AnnData) -> None:
        """Index conditions and genes, resolve perturbation genes against GO, build tables."""
        self.dataset_name = dataset_name
        self.store, self._cond_means = None, None
        self.gene_names = pd.Index(adata.var["gene_name"].astype(str).values)
        cell_cond = adata.obs["condition"].astype(str).values
        self.node_map = {g: i for i, g in enumerate(self.gene_names)}
        self.adata = adata
        self.conditions = sorted(set(cell_cond), key=lambda c: (c != CTRL, c))
        self.cond_to_id = {c: i for i, c in enumerate(self.conditions)}
        self.ctrl_id = self.cond_to_id[CTRL]
        self.cell_condition = pd.Index(self.conditions).get_indexer(cell_cond).astype(np.int64)
        self.ctrl_rows = np.flatnonzero(self.cell_condition == self.ctrl_id)
        self.expr = ExpressionMatrix(adata.X)
        self.n_genes = len(self.gene_names)

        self.cond_pert_index = np.full((len(self.conditions), 2), -1, dtype=np.int64)
        for c, name in enumerate(self.conditions):
            for slot, gene in enumerate(condition_genes(name)):
                self.cond_pert_index[c, slot] = self.node_map_pert[gene]

        # DE tables: [C, 200] DE-ranked genes, [C, 20] non-dropout DE, [C, G] loss mask.
        ranked, non_dropout, non_zero_mask = _de_arrays(adata.uns, self.conditions, self.gene_names)
        self.de_ranked_idx = ranked
        self.de_idx = ranked[:, :N_DE].copy()
        self.non_dropout_de_idx = non_dropout
        self.non_zero_mask = non_zero_mask
        self.ctrl_mean = np.asarray(
            to_host(self.expr.rows(self.ctrl_rows).mean(0)).numpy(), np.float64
        )
        self.split = self.set2conditions = self.subgroup = self.dataloader = None
        self._graphs = {}
        # Contexts belong to the cells just loaded: those read with them, else none.
        self.set_context_key(self._context_labels[0] if self._context_labels else None)

    def _resolve_perturbations(self, conditions: list[str], measured: set[str]) -> None:
        """Perturbation vocabulary = measured and perturbed genes known to the GO source."""
        from gears.data import graphs

        source = self._gene2go_source()
        gene2go = graphs.read_gene2go(source)
        aliases = graphs.read_aliases(self.gene_aliases_path) if self.gene_aliases_path else None
        perturbed = genes_of(conditions)
        candidates = sorted(measured | set(perturbed))
        renames, missing = graphs.resolve_symbols(candidates, gene2go.keys(), aliases)
        missing = set(missing)
        self._unmatched_genes = None
        if measured and not (set(measured) - missing) and not set(measured) & set(perturbed):
            # Gene names of another kind (Ensembl ids beside symbol labels, say): training would
            # run with no GO edge on any measured gene and no perturbed gene measured. Raised
            # by refuse_unmatched_genes once the value checks have had their say.
            self._unmatched_genes = (
                f"none of the {len(measured)} measured gene names (e.g. {sorted(measured)[:3]}) "
                f"is a perturbed gene (e.g. {perturbed[:3]}) or in the GO source {source}: the "
                "gene names are likely another kind of identifier. Put gene symbols in "
                "adata.var['gene_name'] (or var_names), or pass a matching data.gene2go / "
                "data.gene_aliases"
            )
        unknown = sorted(g for g in perturbed if g in missing and g not in measured)
        if unknown and self.unmapped_perts == "error":
            more = f" (and {len(unknown) - 20} more)" if len(unknown) > 20 else ""
            raise GearsInputError(
                f"{len(unknown)} perturbed gene(s) are neither measured genes nor in the GO "
                f"source {source} (even through aliases): {unknown[:20]}{more}. "
                "Check their spelling or pass gene_aliases=..., then choose "
                "data.unmapped_perts (PertData(unmapped_perts=...)): 'error' (this message), "
                "'drop' (remove their conditions, as the original GEARS) or 'keep' (keep them "
                "without GO edges)"
            )
        dropped = (
            []
            if self.unmapped_perts == "keep"
            else [c for c in conditions if any(g in missing for g in condition_genes(c))]
        )
        vocab = [g for g in candidates if g not in missing]
        if self.unmapped_perts == "keep":
            vocab = sorted(set(vocab) | set(perturbed))
        self.pert_names = np.array(vocab)
        self.node_map_pert = {g: i for i, g in enumerate(vocab)}
        self.gene2go = {g: set(gene2go.get(renames.get(g, g), ())) for g in vocab}
        self.report = {
            "renamed_genes": {g: renames[g] for g in perturbed if g in renames},
            "dropped_conditions": dropped,
            "perturbed_genes_without_go": sorted(set(perturbed) & missing),
        }
        if self._control_like:
            self.report["control_like_genes"] = dict(self._control_like)
        if self.report["renamed_genes"]:
            self._log(
                f"renamed {len(self.report['renamed_genes'])} perturbed gene(s) to match the "
                f"GO source: {self.report['renamed_genes']}"
            )
        if dropped:
            self._log(
                f"dropped {len(dropped)} condition(s) whose genes have no GO annotation "
                f"(GEARS cannot place them in the GO graph): {dropped[:10]}"
                f"{' ...' if len(dropped) > 10 else ''}"
            )

    def refuse_unmatched_genes(self) -> None:
        """Raise the error _resolve_perturbations found: measured genes that match neither a
        perturbed gene nor the GO source (the data would train, wrongly, without a word)."""
        if self._unmatched_genes:
            raise GearsInputError(self._unmatched_genes)

    def _gene2go_source(self) -> Path:
        if self.gene2go_path is not None:
            return Path(self.gene2go_path)
        from gears.data import download

        return download.fetch_gene2go(self.data_dir, base_url=download.base_url(self.mirror_url))

    # ---------------------------------------------------------------------------------- splits
    def prepare_split(
        self,
        split: str = "simulation",
        seed: int = 1,
        train_gene_set_size: float = 0.75,
        combo_seen2_train_frac: float = 0.75,
        combo_single_split_test_set_fraction: float = 0.1,
        test_perts: list[str] | None = None,
        only_test_set_perts: bool = False,
        test_pert_genes: list[str] | None = None,
        split_dict_path: str | Path | None = None,
        val_size: float = 0.1,
    ) -> PertData:
        """Make one of the GEARS split types; cached under data_dir keyed by every parameter."""
        from gears.data import splits

        if self.adata is None:
            raise GearsInputError(
                "load data before prepare_split (PertData.load / new_data_process)"
            )
        params = dict(
            split_type=split,
            seed=seed,
            train_gene_set_size=train_gene_set_size,
            combo_seen2_train_frac=combo_seen2_train_frac,
            test_size=combo_single_split_test_set_fraction,
            val_size=val_size,
            test_perts=sorted(test_perts) if test_perts else None,
            test_pert_genes=sorted(test_pert_genes) if test_pert_genes else None,
            only_test_set_perts=only_test_set_perts,
        )
        split_dict = None
        if split == "custom":
            if split_dict_path is None:
                raise GearsInputError("split 'custom' needs split_dict_path (a JSON/pickle file)")
            split_dict = splits.load_split_dict(split_dict_path, self.conditions)
            params["split_dict"] = split_dict
        key = splits.split_key(self.conditions, **params)
        cache = self.data_dir / (self.dataset_name or "data") / "splits" / f"{split}_{key}.json"
        result = None
        if cache.exists():
            try:
                result = splits.Split.from_dict(json.loads(cache.read_text()))
            except (OSError, ValueError, KeyError, TypeError):
                result = None  # a damaged cache file: make the split again and rewrite it
        if result is None:
            params.pop("split_type")
            params.pop("split_dict", None)
            result = splits.make_split(self.conditions, split, split_dict=split_dict, **params)
            try:
                from gears.checkpoint import atomic_write

                text = json.dumps(result.to_dict())
                atomic_write(cache, lambda tmp: tmp.write_text(text))
            except (OSError, GearsInputError):
                pass  # a read-only data_dir only costs recomputation
        self.split = result
        self.seed = seed
        self.set2conditions = {"train": result.train, "val": result.val, "test": result.test}
        self.subgroup = {f"{k}_subgroup": v for k, v in result.subgroups.items()}
        # The co-expression graph depends on the training cells.
        self._graphs = {k: v for k, v in self._graphs.items() if k[0] != "coexpress"}
        self._log(result.summary())
        return self

    def set_rows(self, set_name: str) -> tuple[np.ndarray, np.ndarray]:
        """Cell rows and condition ids of a split set ('train', 'val', 'test')."""
        if self.set2conditions is None:
            raise GearsInputError("call prepare_split before asking for split sets")
        ids = [self.cond_to_id[c] for c in self.set2conditions[set_name] if c in self.cond_to_id]
        rows = np.flatnonzero(np.isin(self.cell_condition, ids))
        return rows, self.cell_condition[rows]

    def example_set(
        self, set_name: str, seed: int | None = None, covariates: dict | None = None
    ) -> ExampleSet:
        """A split set's examples; each cell paired with a control cell of its own context
        (set_context_key), and with covariates (name -> a code per cell row) batches grouped by
        (condition, codes)."""
        rows, cond = self.set_rows(set_name)
        return ExampleSet(
            self.expr,
            rows,
            cond,
            self.ctrl_rows,
            self.ctrl_id,
            self.cond_pert_index,
            self.de_idx,
            seed=self.seed if seed is None else seed,
            context=self.cell_context,
            covariates=covariates,
        )

    # ------------------------------------------------------------------------------- contexts
    def set_context_key(self, context_key: str | None) -> PertData:
        """Name the obs column holding each cell's context (data.context_key, e.g. the cell
        line): `contexts` lists its values, `cell_context` codes each cell, every context's
        control mean is kept (`context_ctrl_means`), and every cell is paired with a control
        cell of its own context. None: one context (all control cells). Call after loading."""
        from gears.data.covariates import categories_of, encode, obs_values

        self.context_key, self.contexts = context_key, []
        self.cell_context = self.context_ctrl_means = None
        self.dataloader = None  # loaders built before pair across contexts
        if context_key is None:
            return self
        labels = self._context_labels
        if labels is not None and labels[0] == context_key:
            values = labels[1]  # read with the cells (a store keeps no other obs column)
        else:
            values = obs_values(self.adata.obs, context_key)
        self.contexts = categories_of(values)
        self.cell_context = encode(values, self.contexts, "context")
        ctrl_context = self.cell_context[self.ctrl_rows]
        without = [c for i, c in enumerate(self.contexts) if not (ctrl_context == i).any()]
        if without:
            raise GearsInputError(
                f"data.context_key={context_key!r}: context(s) {without} have no control cells; "
                "each context's cells are paired with its own controls: drop those contexts "
                "(data.subset) or choose another column"
            )
        X = self.expr.numpy()
        indicator = sp.csr_matrix(
            (np.ones(len(ctrl_context)), (ctrl_context, self.ctrl_rows)),
            shape=(len(self.contexts), X.shape[0]),
        )
        sums = indicator @ X
        sums = sums.toarray() if sp.issparse(sums) else np.asarray(sums)
        self.context_ctrl_means = sums / np.bincount(ctrl_context)[:, None]
        return self

    # --------------------------------------------------------------------------------- loaders
    def get_dataloader(
        self, batch_size: int, test_batch_size: int | None = None, **kwargs
    ) -> dict[str, EpochLoader]:
        """train/val/test loaders (GEARS names: train_loader, val_loader, test_loader)."""
        return self.get_dataloader_distributed(batch_size, test_batch_size, 1, 0, **kwargs)

    def get_dataloader_distributed(
        self,
        batch_size: int,
        test_batch_size: int | None = None,
        world_size: int = 1,
        rank: int = 0,
        num_workers: int = 0,
        batching: str = "random",
        cells_per_group: int = 4,
        pin_memory: bool = False,
        block_size: int = 1024,
        device=None,
        covariates: dict[str, np.ndarray] | None = None,
    ) -> dict[str, EpochLoader]:
        """Training shards via a seeded DistributedSampler; evaluation sharded without padding.

        device: a CUDA device keeps a dense matrix that fits (ExpressionMatrix.place) on the
        GPU and gathers batches there; with num_workers > 0 batches are gathered on the host.
        covariates: name -> a code per cell row, carried by the batches (example_set).
        """
        if self.set2conditions is None:
            raise GearsInputError("call prepare_split before get_dataloader")
        if device is not None and self.expr.place(device, gather_on_device=num_workers == 0):
            pin_memory = False  # batches are born on the GPU: nothing to pin
        test_batch_size = test_batch_size or batch_size
        loaders = {}
        for name in ("train", "val", "test"):
            if not self.set2conditions.get(name):
                continue
            ds = self.example_set(name, covariates=covariates)
            if name == "train":
                loaders["train_loader"] = train_loader(
                    ds,
                    batch_size,
                    seed=self.seed,
                    world_size=world_size,
                    rank=rank,
                    batching=batching,
                    cells_per_group=cells_per_group,
                    num_workers=num_workers,
                    pin_memory=pin_memory,
                    block_size=block_size,
                )
            else:
                loaders[f"{name}_loader"] = eval_loader(
                    ds,
                    test_batch_size,
                    world_size=world_size,
                    rank=rank,
                    num_workers=num_workers,
                    pin_memory=pin_memory,
                )
        self.dataloader = loaders
        self.dataloader_settings = {
            "batch_size": batch_size,
            "test_batch_size": test_batch_size,
            "world_size": world_size,
            "rank": rank,
            "num_workers": num_workers,
            "batching": batching,
            "cells_per_group": cells_per_group,
            "block_size": block_size,
            "covariates": tuple(covariates or ()),
        }
        return loaders

    # ---------------------------------------------------------------------------------- graphs
    def go_graph(self, top_k: int = 20, threshold: float = 0.1):
        """GO Jaccard similarity graph over the perturbation vocabulary (`pert_names`)."""
        from gears.data import graphs

        key = ("go", top_k, threshold)
        if key not in self._graphs:
            self._graphs[key] = graphs.go_graph(
                list(self.pert_names), self.gene2go, top_k, threshold
            )
        return self._graphs[key]

    def coexpress_graph(self, top_k: int = 20, threshold: float = 0.4):
        """Gene co-expression graph from control + training cells (needs a split)."""
        from gears.data import graphs

        key = ("coexpress", top_k, threshold)
        if key not in self._graphs:
            rows, _ = self.set_rows("train")
            rows = np.union1d(rows, self.ctrl_rows)
            self._graphs[key] = self._stored_graph(
                ("coexpress", top_k, threshold, rows),
                lambda: graphs.coexpression_graph(
                    self.expr.numpy(), list(self.gene_names), top_k, threshold, rows=rows
                ),
            )
        return self._graphs[key]

    def _stored_graph(self, key: tuple, build):
        """A graph cached in the store directory (rank 0 builds it, the other ranks read it)."""
        from gears.data import graphs
        from gears.data import store as store_mod

        if self.store is None:
            return build()
        import hashlib

        digest = hashlib.sha256(repr(key[:-1]).encode() + np.asarray(key[-1]).tobytes())
        name = f"graph_{key[0]}_{digest.hexdigest()[:16]}"
        cached = store_mod.load_graph(self.store.path, name)
        if cached is not None:
            return graphs.GeneGraph(
                list(self.gene_names),
                torch_from(cached["edge_index"]),
                torch_from(cached["edge_weight"]),
            )
        graph = build()
        try:
            store_mod.save_graph(
                self.store.path,
                name,
                {"edge_index": graph.edge_index.numpy(), "edge_weight": graph.edge_weight.numpy()},
            )
        except OSError:
            pass  # a read-only store only costs recomputation
        return graph

    # ------------------------------------------------------------------------------- summaries
    def condition_means(self, conditions: list[str] | None = None) -> np.ndarray:
        """Observed mean profile per condition. -> [len(conditions), genes] float64."""
        if self._cond_means is None:
            self._cond_means = de_mod.condition_means(
                self.expr.numpy(), self.cell_condition, len(self.conditions)
            )
        means = np.asarray(self._cond_means, dtype=np.float64)
        if conditions is None:
            return means
        return means[[self.cond_to_id[c] for c in conditions]]

    # ------------------------------------------------------------------------- context views
    def context_view(self, name: str) -> PertData:
        """One context's cells as a PertData of their own: its cells and control cells, its
        control mean and its DE genes (against its own control cells), the conditions it holds
        (each with at least 2 cells), with the genes, perturbation vocabulary (pert_names and
        their GO sets) and normalisation of the whole data, so that one model's perturbation
        rows index every view alike. Not split: call prepare_split on it. `view.context` names
        it. In memory a view copies its rows of the processed matrix; from a store it is
        processed into a store of its own (data.store), out of core like its parent."""
        if self.cell_context is None:
            raise GearsInputError(
                "this data has no contexts: set data.context_key (PertData.load(context_key=...)) "
                "to the obs column naming each cell's context"
            )
        if name not in self.contexts:
            raise GearsInputError(
                f"unknown context {name!r} of obs[{self.context_key!r}]; contexts: {self.contexts}"
            )
        view = PertData(
            self.data_dir,
            gene2go=self.gene2go_path,
            gene_aliases=self.gene_aliases_path,
            seed=self.seed,
            verbose=self.verbose,
            store=self.store_mode,
            store_dir=self.store_dir,
            chunk_cells=self.chunk_cells,
            unmapped_perts=self.unmapped_perts,
            mirror_url=self.mirror_url,
        )
        view.gene2go_user = self.gene2go_user
        dataset = f"{self.dataset_name}__{_safe_name(name)}"
        if self.store is not None:
            src = self._source
            subset = {**src["subset"], self.context_key: [name]}
            view.process_backed(
                dataset,
                src["path"],
                condition_key=self.condition_key,
                control_names=src["control_names"],
                subset=subset,
                normalize=src["normalize"],
                context_key=self.context_key,
                target_sum=self.normalize_target_sum,
            )
        else:
            view._setup_context(self, name, dataset)
        view._share_vocabulary(self)
        view.context = name
        view._source = self._source
        return view

    def _setup_context(self, parent: PertData, name: str, dataset: str) -> None:
        """context_view in memory: the parent's processed rows of one context, DE recomputed."""
        rows = np.flatnonzero(parent.cell_context == parent.contexts.index(name))
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
        processed.uns.update(de_mod.compute_de(processed, n_top=N_DE))
        self._share_vocabulary(parent)
        self.report = {
            "dropped_conditions": sorted(few),
            "dropped_conditions_too_few_cells": sorted(few),
        }
        if parent.report.get("normalize"):
            self.report["normalize"] = parent.report["normalize"]
        present = set(conditions.tolist())
        self.condition_key = parent.condition_key
        self.condition_spelling = {
            c: v for c, v in parent.condition_spelling.items() if c in present
        }
        self.normalize_target_sum = parent.normalize_target_sum
        self.library_size = None if parent.library_size is None else parent.library_size[rows]
        self._context_labels = (parent.context_key, np.full(len(rows), name, dtype=object))
        self._setup(dataset, processed)

    def _share_vocabulary(self, parent: PertData) -> None:
        """The parent's perturbation vocabulary and GO sets (and the rows they index)."""
        self.pert_names = parent.pert_names
        self.node_map_pert = parent.node_map_pert
        self.gene2go = parent.gene2go
        if getattr(self, "conditions", None) is not None and hasattr(self, "cond_pert_index"):
            for c, condition in enumerate(self.conditions):
                for slot, gene in enumerate(condition_genes(condition)):
                    self.cond_pert_index[c, slot] = self.node_map_pert[gene]
            self._graphs = {}

    # ------------------------------------------------------------------- out-of-core and store
    def _wants_store(self, path: Path) -> bool:
        """data.store: mmap always, memory never, auto when the file or its dense matrix is
        larger than AUTO_STORE_BYTES."""
        if self.store_mode != "auto":
            return self.store_mode == "mmap"
        if path.stat().st_size > AUTO_STORE_BYTES:
            return True
        import h5py

        try:
            with h5py.File(path, "r") as f:
                shape = (
                    tuple(f["X"].attrs["shape"]) if isinstance(f["X"], h5py.Group) else f["X"].shape
                )
        except (OSError, KeyError):
            return False  # not an h5ad we can inspect: the in-memory reader reports the problem
        return int(np.prod(shape)) * 4 > AUTO_STORE_BYTES

    def _store_root(self, dataset_name: str) -> Path:
        if self.store_dir is not None:
            return Path(self.store_dir)
        return self.data_dir / dataset_name / "store"

    def _store_params(
        self,
        condition_key: str,
        sep: str,
        control_names: tuple[str, ...],
        subset: dict | None,
        normalize: str = "none",
        context_key: str | None = None,
        target_sum: float | None = None,
    ) -> dict:
        """Every parameter the processed result depends on (the store key is a hash of these)."""
        from gears.data.store import DENSE_STORE_LIMIT_BYTES, input_fingerprint

        def fingerprint(path) -> dict | None:
            return input_fingerprint(path) if path is not None else None

        # normalize, contexts and a given target sum join the key only when used: stores built
        # before they existed stay valid (a log1p store now also holds the library sizes).
        normalized = {"normalize": normalize, "library_size": True} if normalize != "none" else {}
        if context_key is not None:
            normalized["context_key"] = context_key
        if target_sum is not None:
            normalized["target_sum"] = float(target_sum)
        return {
            **normalized,
            "condition_key": condition_key,
            "sep": sep,
            "control_names": sorted(control_names),
            "subset": {
                k: sorted(map(str, v if isinstance(v, (list, tuple)) else [v]))
                for k, v in sorted((subset or {}).items())
            },
            "gene2go": fingerprint(self._gene2go_source()),
            "gene_aliases": fingerprint(self.gene_aliases_path),
            "keep_unmapped_perts": self.keep_unmapped_perts,
            "n_de": N_DE,
            "n_de_ranked": N_DE_RANKED,
            "dense_limit": DENSE_STORE_LIMIT_BYTES,
        }

    def process_backed(
        self,
        dataset_name: str,
        path: str | Path,
        *,
        condition_key: str | None = None,
        sep: str = "+",
        control_names: tuple[str, ...] = (),
        subset: dict | None = None,
        normalize: str = "none",
        context_key: str | None = None,
        target_sum: float | None = None,
        pool_contexts: bool | None = None,
    ) -> PertData:
        """Process an .h5ad out of core into the shared store (or reuse it), then serve from it.

        The file is opened in anndata's backed mode and read in `chunk_cells` row chunks: never
        the whole matrix in memory. One pass validates values, sums and sums of squares per
        condition (means, dropout sets, scanpy's t-test DE ranking via de.de_from_stats) and
        writes the kept rows to the store. The store lives in `store_dir` (default
        <data_dir>/<dataset>/store) under a key over the input and every processing parameter,
        so a second process (another rank) with the same inputs memory-maps it instead.
        Raw counts are refused, or normalised with normalize='log1p' (to target_sum, else the
        median total; the totals are stored as library_size), as new_data_process does.
        context_key: as in new_data_process; each cell's context is stored with it.
        pool_contexts: as in load.
        """
        from gears.data import store as store_mod

        check_normalize(normalize)
        path = Path(path)
        t0 = time.perf_counter()
        self._source = source_record(path, subset, condition_key, control_names, normalize)
        backed = read_h5ad(path, backed="r")  # obs and var only; X stays on disk
        try:
            chosen = detect_condition_key(backed.obs.columns, condition_key)
            if condition_key is None:
                self._log(
                    f"perturbation column: obs[{chosen!r}], found by itself; set "
                    "data.condition_key to choose another"
                )
            context_labels(backed.obs, context_key)  # a missing column fails before any work
            if context_key is None:
                keep = np.ones(backed.n_obs, dtype=bool)
                for column, wanted in (subset or {}).items():
                    if column in backed.obs:  # a missing one is named by _build_store
                        wanted = wanted if isinstance(wanted, (list, tuple)) else [wanted]
                        keep &= backed.obs[column].astype(str).isin([str(w) for w in wanted]).values
                check_contexts(
                    backed,
                    keep,
                    subset=subset,
                    condition_key=chosen,
                    control_names=control_names,
                    normalize=normalize,
                    pool_contexts=pool_contexts,
                    log=self._log,
                )
            key = store_mod.store_key(
                store_mod.input_fingerprint(path),
                self._store_params(
                    chosen, sep, control_names, subset, normalize, context_key, target_sum
                ),
            )
            root = self._store_root(dataset_name)
            opened = store_mod.open_store(root, key)
            if opened is None:
                self._build_store(
                    dataset_name,
                    path,
                    backed,
                    root,
                    key,
                    condition_key=chosen,
                    sep=sep,
                    control_names=control_names,
                    subset=subset,
                    normalize=normalize,
                    context_key=context_key,
                    target_sum=target_sum,
                )
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
            else:
                self._log(f"reusing the processed store {opened.path}")
            raw = backed.obs[chosen].astype(str).str.strip()
            gene_spellings = control_like_genes(gene_names_of(backed), control_names)
            refuse_joined_gene_names(raw.values, gene_names_of(backed), sep)
            canon = canonicalize_conditions(raw.values, sep, control_names, gene_spellings)
            self.condition_key = chosen
            self.condition_spelling = raw.groupby(canon, sort=False).first().to_dict()
        finally:
            backed.file.close()
        self.context_key = context_key
        self._setup_from_store(dataset_name, opened)
        self._log(
            f"{dataset_name}: {self.adata.n_obs} cells x {self.n_genes} genes, "
            f"{len(self.conditions)} conditions from the {opened.meta['layout']} store in "
            f"{time.perf_counter() - t0:.1f}s"
        )
        return self

    def _build_store(
        self,
        dataset_name: str,
        path: Path,
        backed: ad.AnnData,
        root: Path,
        key: str,
        *,
        condition_key: str,
        sep: str,
        control_names: tuple[str, ...],
        subset: dict | None,
        normalize: str = "none",
        context_key: str | None = None,
        target_sum: float | None = None,
    ) -> None:
        """One chunked pass over the backed file -> a committed store (temp dir + rename).
        normalize='log1p' reads the file twice: cell totals (the median target) first."""
        import h5py

        from gears.data import store as store_mod
        from gears.data import stream

        names = gene_names_of(backed)
        if backed.n_obs == 0 or backed.n_vars == 0:
            raise GearsInputError(
                f"the AnnData is empty ({backed.n_obs} cells x {backed.n_vars} genes)"
            )
        check_gene_names(backed)
        if condition_key not in backed.obs:
            raise GearsInputError(
                f"adata.obs has no {condition_key!r} column naming each cell's perturbation "
                f"(columns present: {list(backed.obs.columns)})"
            )
        raw = backed.obs[condition_key]
        if raw.isna().any():
            raise GearsInputError(
                f"{int(raw.isna().sum())} cells have a missing (NaN/null) value in "
                f"obs[{condition_key!r}]; label them (e.g. 'ctrl') or drop them"
            )
        dup = names[names.duplicated()].unique()
        if len(dup):
            raise GearsInputError(
                f"{len(dup)} duplicate gene names, e.g. {list(dup[:5])}; make them unique "
                "(adata.var_names_make_unique()) or drop the duplicates"
            )
        keep = np.ones(backed.n_obs, dtype=bool)
        for column, wanted in (subset or {}).items():
            if column not in backed.obs:
                raise GearsInputError(f"subset: adata.obs has no column {column!r}")
            wanted = wanted if isinstance(wanted, (list, tuple)) else [wanted]
            keep &= backed.obs[column].astype(str).isin([str(w) for w in wanted]).values
        gene_spellings = control_like_genes(names, control_names)
        refuse_joined_gene_names(raw.values, names, sep)
        conditions = canonicalize_conditions(raw.values, sep, control_names, gene_spellings)
        conditions = np.where(keep, conditions, "")
        self._report_control_like_genes(gene_spellings, conditions[keep])
        present = sorted(set(conditions[keep]))
        if CTRL not in present:
            raise GearsInputError(
                f"no control cells: none of obs[{condition_key!r}] is 'ctrl', 'control' or "
                "'non-targeting' (pass control_names=(...) for other spellings)"
                + _gene_spelling_hint(gene_spellings)
            )
        if present == [CTRL]:
            raise GearsInputError("every cell is a control: the data has no perturbed cells")
        check_control_cells(int((conditions[keep] == CTRL).sum()))
        self._resolve_perturbations(present, set(names))
        counts = pd.Series(conditions[keep]).value_counts()
        few = sorted(c for c in counts.index[counts < 2] if c != CTRL)
        drop = set(self.report["dropped_conditions"]) | set(few)
        self.report["dropped_conditions_too_few_cells"] = few
        self.report["dropped_conditions"] = sorted(drop)
        kept_conditions = sorted(set(present) - drop, key=lambda c: (c != CTRL, c))
        if len(kept_conditions) < 2:
            raise GearsInputError(
                f"no perturbed cells are left after dropping {sorted(drop)[:10]} (genes "
                "without GO annotation or conditions with one cell)"
            )
        codes = pd.Index(kept_conditions).get_indexer(conditions).astype(np.int64)
        n_kept = int((codes >= 0).sum())
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
        layout = store_mod.choose_layout(n_kept, len(names), nnz)
        try:
            writer = store_mod.StoreWriter(
                root,
                key,
                len(names),
                layout,
                index_dtype=np.int32 if (nnz or 0) < 2**31 - 1 else np.int64,
            )
        except OSError as e:
            raise _store_write_error(root, e) from None
        try:
            # Raw counts: what check_not_raw_counts reads in memory (the subset's cells, the
            # dropped conditions' included), or normalised as _normalize does.
            probe, inspect, transform = stream.CountsProbe(), None, None
            extra_tables = {}
            if context_key is not None:
                contexts = context_labels(backed.obs, context_key)[codes >= 0]
                extra_tables["cell_context"] = contexts.astype(str)
            if normalize == "log1p":
                totals = stream.count_totals(backed.X, backed.n_obs, codes >= 0, self.chunk_cells)
                target = median_total(totals) if target_sum is None else float(target_sum)
                extra_tables["library_size"] = totals.astype(np.float64)
                self.report["normalize"] = {"method": normalize, "target_sum": target}
                self._log(
                    f"normalised raw counts: each cell scaled to {target:.0f} counts (the "
                    "median), then log1p"
                )

                def transform(block):
                    return stream.normalize_log1p(block, target)
            else:

                def inspect(start, block):
                    probe.add(block[np.flatnonzero(keep[start : start + block.shape[0]])])
                    if probe.seen >= probe.sample:  # decided: no need to read on
                        check_not_raw_counts(probe.summary())

            stats = stream.stream_condition_stats(
                backed.X,
                backed.n_obs,
                codes,
                len(kept_conditions),
                len(names),
                self.chunk_cells,
                sink=writer.append_rows,
                inspect=inspect,
                transform=transform,
                moments=de_mod.scanpy_aggregates(),
            )
            check_not_raw_counts(probe.summary())
            self.refuse_unmatched_genes()
            if stats.max_value > 50:
                self._log(
                    f"warning: max expression {stats.max_value:.1f} looks like raw "
                    "counts; GEARS expects log-normalised data"
                )
            uns = dict(backed.uns)
            if all(k in uns for k in de_mod.DE_KEYS):  # DE results shipped with the file
                de = self._translate_de_keys(uns, backed, condition_key)
            else:
                de = de_mod.de_from_stats(
                    kept_conditions,
                    stats.sums,
                    stats.sumsq,
                    stats.counts,
                    np.asarray(names),
                    n_top=N_DE,
                    n_ranked=N_DE_RANKED,
                    moments=stats.moments,
                )
            ranked, non_dropout, non_zero_mask = _de_arrays(de, kept_conditions, names)
            means = stats.means
            np.save(writer.tmp / "means.npy", means)
            cell_codes = codes[codes >= 0].astype(np.int32)
            writer.commit(
                tables={
                    "conditions": np.array(kept_conditions, dtype=str),
                    "cell_condition": cell_codes,
                    "gene_names": np.asarray(names, dtype=str),
                    "de_ranked": ranked.astype(np.int32),
                    "non_dropout_de": non_dropout.astype(np.int32),
                    "non_zero_mask": non_zero_mask,
                    **extra_tables,
                },
                meta={
                    "dataset": dataset_name,
                    "source": str(path),
                    "report": self.report,
                    "n_input_cells": int(backed.n_obs),
                },
            )
        except BaseException as e:
            writer.abort()  # the temp folder goes: nothing half-written is left in the store
            if isinstance(e, OSError) and e.errno is not None:  # a write (h5py reads: no errno)
                raise _store_write_error(root, e) from None
            damaged = (OSError, RuntimeError, KeyError, ValueError, TypeError)  # from h5py
            if isinstance(e, damaged) and not isinstance(e, GearsInputError):
                raise h5ad_error(path, e) from None
            raise
        self._log(f"wrote the processed store {root / key} ({layout}, {n_kept} cells)")

    def _setup_from_store(self, dataset_name: str, opened) -> None:
        """The state `_setup` builds, from a store's tables; expression memory-mapped, not read."""
        t = opened.tables
        self.store = opened
        self.dataset_name = dataset_name
        self.report = opened.meta.get("report", {})
        self.normalize_target_sum = self.report.get("normalize", {}).get("target_sum")
        self.library_size = t["library_size"] if "library_size" in t else None
        self._context_labels = (
            (self.context_key, t["cell_context"].astype(object)) if "cell_context" in t else None
        )
        self.gene_names = pd.Index(t["gene_names"].astype(str))
        self.node_map = {g: i for i, g in enumerate(self.gene_names)}
        self.conditions = [str(c) for c in t["conditions"]]
        self.cond_to_id = {c: i for i, c in enumerate(self.conditions)}
        self.ctrl_id = self.cond_to_id[CTRL]
        self.cell_condition = t["cell_condition"].astype(np.int64)
        self.ctrl_rows = np.flatnonzero(self.cell_condition == self.ctrl_id)
        self.n_genes = len(self.gene_names)
        # The perturbation vocabulary (and GO sets) come from the GO source, cheap to re-read.
        report = dict(self.report)
        self._resolve_perturbations(self.conditions, set(self.gene_names))
        self.report = report
        self.cond_pert_index = np.full((len(self.conditions), 2), -1, dtype=np.int64)
        for c, name in enumerate(self.conditions):
            for slot, gene in enumerate(condition_genes(name)):
                self.cond_pert_index[c, slot] = self.node_map_pert[gene]
        self.de_ranked_idx = t["de_ranked"].astype(np.int64)
        self.de_idx = self.de_ranked_idx[:, :N_DE].copy()
        self.non_dropout_de_idx = t["non_dropout_de"].astype(np.int64)
        self.non_zero_mask = t["non_zero_mask"]
        self._cond_means = np.load(opened.path / "means.npy", mmap_mode="r")
        self.ctrl_mean = np.array(self._cond_means[self.ctrl_id], dtype=np.float64)
        self.expr = ExpressionMatrix.shared(opened.matrix())
        obs = pd.DataFrame(
            {"condition": pd.Categorical.from_codes(self.cell_condition, self.conditions)},
            index=pd.RangeIndex(len(self.cell_condition)).astype(str),
        )
        self.adata = ad.AnnData(
            obs=obs,
            var=pd.DataFrame({"gene_name": self.gene_names.values}, index=self.gene_names.values),
        )
        self.split = self.set2conditions = self.subgroup = self.dataloader = None
        self._graphs = {}
        # Contexts belong to the cells just loaded: those read with them, else none.
        self.set_context_key(self._context_labels[0] if self._context_labels else None)

    def __repr__(self) -> str:
        if self.adata is None:
            return f"PertData(data_dir={str(self.data_dir)!r}, no data loaded)"
        return (
            f"PertData({self.dataset_name}: {self.adata.n_obs} cells x {self.n_genes} genes, "
            f"{len(self.conditions)} conditions, {len(self.pert_names)} perturbable genes)"
        )


def _safe_name(name: str) -> str:
    """A context name as a file name part."""
    import re

    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(name)) or "context"


def _gene_spelling_hint(gene_spellings: set[str]) -> str:
    """The 'no control cells' error's note when a control-like spelling was read as a gene."""
    if not gene_spellings:
        return ""
    return (
        f"; labels spelled {sorted(gene_spellings)} were read as the measured gene(s) of that "
        "name: if they are your control cells, add that spelling to data.control_names"
    )


def _store_write_error(root: Path, error: OSError) -> GearsInputError:
    """A failed write into the processed store (disk full, quota, permissions): the temp folder
    is already removed; the message says where and what to do."""
    return GearsInputError(
        f"could not write the processed store in {root} ({error.strerror or error}); nothing "
        "was kept. Free space there, or point data.store_dir (or data.data_dir) to a larger "
        "writable disk, and run again"
    )


def torch_from(array: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(array))


def _de_arrays(
    de: dict, conditions: list[str], gene_names: pd.Index
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """DE dicts (DE_KEYS layout, keyed by condition) -> index tables.

    Returns ranked [C, min(200, G)] DE-ranked gene indices, non_dropout [C, 20] and the loss
    mask non_zero_mask [C, G] bool (ctrl keeps every gene, as GEARS's loss); -1 pads.
    """
    C, G = len(conditions), len(gene_names)
    ranked = np.full((C, min(N_DE_RANKED, G)), -1, dtype=np.int64)
    non_dropout = np.full((C, N_DE), -1, dtype=np.int64)
    non_zero_mask = np.ones((C, G), dtype=bool)
    for c, name in enumerate(conditions):
        if name == CTRL:
            continue
        if name not in de[de_mod.RANK_KEY]:
            raise GearsInputError(
                f"processed file lacks DE genes for condition {name!r}; "
                "re-run new_data_process without skip_calc_de"
            )
        idx = gene_names.get_indexer(np.asarray(de[de_mod.RANK_KEY][name]).astype(str))
        ranked[c, : min(len(idx), ranked.shape[1])] = idx[: ranked.shape[1]]
        nd = gene_names.get_indexer(np.asarray(de[de_mod.TOP_NON_DROPOUT_KEY][name]).astype(str))[
            :N_DE
        ]
        non_dropout[c, : len(nd)] = nd
        non_zero_mask[c] = False
        non_zero_mask[c, np.asarray(de[de_mod.NON_ZERO_KEY][name], dtype=np.int64)] = True
    return ranked, non_dropout, non_zero_mask
