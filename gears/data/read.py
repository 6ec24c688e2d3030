"""Where the cells come from: a named public dataset, an .h5ad path, or the synthetic screen;
the cells a subset keeps; the GO source; whether a file is processed out of core."""

from __future__ import annotations

from pathlib import Path

import anndata as ad
import h5py
import numpy as np
import pandas as pd

from gears.data import download
from gears.data.synthetic import write_gene2go_tsv
from gears.errors import GearsInputError
from gears.io import CheckpointWriteError, atomic_write

PROCESSED_NAME = "perturb_processed.h5ad"
# data.store=auto: an .h5ad whose file or dense float32 matrix is larger than this is processed
# out of core into a memory-mapped store; smaller ones are read whole and processed by scanpy
# (the reference path).
AUTO_STORE_BYTES = 1024**3


def dataset_file(
    data_name: str | None, data_path: str | Path | None, data_dir: Path, mirror_url: str | None
) -> tuple[str, Path]:
    """(dataset name, .h5ad path) of a named dataset (downloaded into data_dir), a path given
    as data_name, or data_path (a file, or a folder holding perturb_processed.h5ad)."""
    if data_name is not None and data_path is None:
        if data_name not in download.DATASETS:
            p = Path(data_name)
            if not (p.suffix == ".h5ad" or p.is_dir()):
                raise GearsInputError(
                    f"unknown dataset {data_name!r}; use 'synthetic', one of "
                    f"{sorted(download.DATASETS)}, or a path to an .h5ad file"
                )
            data_name, data_path = None, p
        else:
            data_path = download.fetch_dataset(
                data_name, data_dir, base_url=download.base_url(mirror_url)
            )
    if data_path is None:
        raise GearsInputError("PertData.load needs data_name or data_path")
    path = Path(data_path)
    if path.is_dir():
        path = path / PROCESSED_NAME
    if not path.exists():
        raise GearsInputError(f"no .h5ad file at {path}")
    return data_name or (path.parent.name if path.name == PROCESSED_NAME else path.stem), path


def gene2go_source(gene2go_path: str | Path | None, data_dir: Path, mirror_url: str | None) -> Path:
    """The GO source file: the one given, else GEARS's gene2go_all.pkl (downloaded once)."""
    if gene2go_path is not None:
        return Path(gene2go_path)
    return download.fetch_gene2go(data_dir, base_url=download.base_url(mirror_url))


def synthetic_gene2go(data_dir: Path, params: dict, gene2go: dict) -> Path:
    """The synthetic screen's GO annotations as a file under data_dir (written once, whole or
    absent even with two runs sharing data_dir; the other ranks find it)."""
    tag = "_".join(f"{k}{v}" for k, v in sorted(params.items())) or "default"
    path = data_dir / "synthetic" / f"gene2go_{tag}.tsv.gz"
    if not path.exists():
        # A full disk is one error line and leaves no temp file.
        try:
            atomic_write(path, lambda tmp: write_gene2go_tsv(gene2go, tmp, True))
        except (OSError, CheckpointWriteError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else e
            raise GearsInputError(
                f"could not write the synthetic screen's GO file {path} "
                f"({why}): data.data_dir must be a writable folder; "
                "point data.data_dir at one"
            ) from None
    return path


def subset_cells(adata: ad.AnnData, subset: dict | None) -> ad.AnnData:
    """The cells whose obs columns hold the given value(s) (a copy; adata itself without a
    subset)."""
    for column, wanted in (subset or {}).items():
        if column not in adata.obs:
            raise GearsInputError(
                f"subset: adata.obs has no column {column!r} (columns: {list(adata.obs.columns)})"
            )
        wanted = wanted if isinstance(wanted, (list, tuple)) else [wanted]
        keep = adata.obs[column].astype(str).isin([str(w) for w in wanted]).values
        if not keep.any():
            raise GearsInputError(f"subset: no cell has obs[{column!r}] in {wanted}")
        adata = adata[keep].copy()
    return adata


def subset_mask(obs: pd.DataFrame, subset: dict | None, strict: bool) -> np.ndarray:
    """[cells] bool: the cells a subset keeps. A missing column is an error when strict, else
    skipped (a later, strict pass names it)."""
    keep = np.ones(len(obs), dtype=bool)
    for column, wanted in (subset or {}).items():
        if column not in obs:
            if strict:
                raise GearsInputError(f"subset: adata.obs has no column {column!r}")
            continue
        wanted = wanted if isinstance(wanted, (list, tuple)) else [wanted]
        keep &= obs[column].astype(str).isin([str(w) for w in wanted]).values
    return keep


def wants_store(path: Path, store_mode: str, limit: int = AUTO_STORE_BYTES) -> bool:
    """data.store: mmap always, memory never, auto when the file or its dense matrix is
    larger than `limit` bytes."""
    if store_mode != "auto":
        return store_mode == "mmap"
    if path.stat().st_size > limit:
        return True
    try:
        with h5py.File(path, "r") as f:
            shape = tuple(f["X"].attrs["shape"]) if isinstance(f["X"], h5py.Group) else f["X"].shape
    except (OSError, KeyError):
        return False  # not an h5ad we can inspect: the in-memory reader reports the problem
    return int(np.prod(shape)) * 4 > limit


def source_record(path: Path, subset, condition_key, control_names, normalize: str) -> dict:
    """How a file was read (PertData._source), so that a context view reads it again alike."""
    return dict(
        path=path,
        subset=dict(subset or {}),
        condition_key=condition_key,
        control_names=tuple(control_names),
        normalize=normalize,
    )
