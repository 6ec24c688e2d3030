"""Reading user files (.h5ad, JSON) with one clear error naming the file and what was found;
writing .h5ad files the same under every pandas and anndata; file names made from names in
the data."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gears.errors import GearsInputError

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.+=-]")  # what a name from the data keeps in a file name
MAX_NAME = 100

# epoch_0003.pt: 3 epochs done; epoch_0003_step_000012.pt: 3 epochs + 12 optimizer steps of the
# 4th (written when a SIGTERM stopped training mid-epoch).
CHECKPOINT_NAME = re.compile(r"^epoch_(\d+)(?:_step_(\d+))?\.pt$")


class CheckpointWriteError(GearsInputError):
    """A file could not be written (disk full, quota, permissions); the old file is intact."""


def _fsync_dir(folder: Path) -> None:
    """Make a rename durable: fsync its folder (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _os_error_in(error: BaseException) -> OSError | None:
    """The OSError behind `error` (itself, or in its chain of causes), if any."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp_path)` on a temp file next to `path`, fsync it, rename it over `path` and
    fsync the folder. On any failure the temp file is removed and `path` is left as it was; an
    OSError (disk full, file too large, read-only) becomes a CheckpointWriteError saying so."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        try:
            write(tmp)
        except Exception as e:  # torch.save re-raises a failed write as a RuntimeError
            os_error = _os_error_in(e)
            if os_error is None:
                raise
            raise os_error from None
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as e:
        full = e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
        why = "the disk is full or a size/quota limit was hit" if full else "writing failed"
        kept = "the previous file is kept unchanged" if path.exists() else "nothing was written"
        raise CheckpointWriteError(
            f"could not write {path}: {why} ({e.strerror or e}); {kept}. Free space in "
            f"{path.parent} (or point out_dir / data.data_dir to a larger disk) and run again"
            + (" with train.resume=true" if CHECKPOINT_NAME.match(path.name) else "")
        ) from None
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def file_name(name: str) -> str:
    """A name from the data (a gene, condition, context) as one file name, never a path: any
    character but letters, digits and `_.+=-` becomes `_`, leading dots go (no `.`, `..` or
    hidden file), and a name that changed or was long gets 8 hex of its hash (two names never
    meet in one file). Plain names ("KLF1_ctrl") are kept as they are."""
    safe = _UNSAFE.sub("_", name).lstrip(".")
    if safe == name and 0 < len(safe) <= MAX_NAME:
        return safe
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{safe[:MAX_NAME]}_{digest}"


def describe_file(path: Path) -> str:
    """What a file that failed to parse holds, in words: empty, text (its first characters),
    a truncated HDF5 file, or other bytes."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as e:
        return f"it cannot be read ({e.strerror or e})"
    if size == 0:
        return "it is empty (0 bytes)"
    if head.startswith(HDF5_SIGNATURE):
        return f"it is an HDF5 file of {size:,} bytes"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return f"it holds {size:,} bytes starting {head[:8]!r}, not an HDF5 file"
    first = text.splitlines()[0][:40] if text.strip() else repr(text[:20])
    return f"it is text starting {first!r} ({size:,} bytes), not an HDF5 file"


def read_h5ad(path: str | Path, backed: str | None = None):
    """anndata.read_h5ad, with a GearsInputError naming the file and what it holds when it is
    missing, empty, truncated or not an .h5ad (a CSV renamed, say) instead of h5py's OSError."""
    import anndata as ad

    path = Path(path)
    if not path.exists():
        raise GearsInputError(f"no .h5ad file at {path}; check the path")
    if path.is_dir():
        raise GearsInputError(f"{path} is a folder, not an .h5ad file; give the file's path")
    try:
        return ad.read_h5ad(path, backed=backed)
    except (GearsInputError, KeyboardInterrupt):
        raise
    except MemoryError:
        raise GearsInputError(
            f"reading {path} ({path.stat().st_size:,} bytes) ran out of memory (or its header "
            "names impossible sizes: a damaged file); process it out of core with "
            "data.store=mmap, or use a machine with more memory"
        ) from None
    except Exception as e:
        raise h5ad_error(path, e) from None


def h5ad_error(path: Path, error: BaseException) -> GearsInputError:
    """The clear error for an .h5ad that anndata or h5py could not read."""
    found = describe_file(path)
    why = " ".join(str(error).split())[:160] or type(error).__name__
    if "truncated" in why:
        found += ", shorter than its header says (truncated: an interrupted copy or download?)"
    elif found.startswith("it is text"):
        found += " (a CSV or TSV table renamed .h5ad?)"
    return GearsInputError(
        f"{path} is not a readable .h5ad file: {found} ({type(error).__name__}: {why}). "
        "Copy it again, or write it with adata.write_h5ad (a table: read it with "
        "scanpy.read_csv first)"
    )


def read_json(path: str | Path, what: str, fix: str, expect: type = dict) -> Any:
    """A JSON file's content, or a GearsInputError naming the file, `what` it is, the problem
    (missing, empty, not UTF-8, invalid JSON at line:column, not a `expect`) and `fix`."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise GearsInputError(f"{what} {path} does not exist; {fix}") from None
    except OSError as e:
        raise GearsInputError(f"{what} {path} cannot be read ({e.strerror or e}); {fix}") from None
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise GearsInputError(
            f"{what} {path} is not UTF-8 text (starts {raw[:8]!r}); {fix}"
        ) from None
    except json.JSONDecodeError as e:
        found = "it is empty" if not raw.strip() else f"{e.msg} at line {e.lineno} column {e.colno}"
        raise GearsInputError(f"{what} {path} is not valid JSON ({found}); {fix}") from None
    except RecursionError:
        found = "nested too deeply"
        raise GearsInputError(f"{what} {path} is not valid JSON ({found}); {fix}") from None
    if not isinstance(value, expect):
        raise GearsInputError(
            f"{what} {path} holds a JSON {type(value).__name__}, not a {expect.__name__}; {fix}"
        )
    return value


# ------------------------------------------------------------------------------ writing .h5ad
# pandas 3 holds text in its own string dtype (pandas 2.3 with future.infer_string too);
# anndata 0.12 refuses to write it unless anndata.settings.allow_write_nullable_strings, and
# files written that way need anndata >= 0.11 to read. Every .h5ad the project writes goes
# through write_h5ad (or writable_frame/writable_uns for write_elem), which turns that text into
# plain object arrays: the same file under every pandas and anndata.


def _plain_text(values):
    """values with pandas' string dtype (in an Index, a Series or categories) as object."""
    import pandas as pd

    if isinstance(values.dtype, pd.StringDtype):
        return values.astype(object)
    if isinstance(values.dtype, pd.CategoricalDtype) and isinstance(
        values.cat.categories.dtype if isinstance(values, pd.Series) else values.categories.dtype,
        pd.StringDtype,
    ):
        cat = values.cat if isinstance(values, pd.Series) else values
        plain = pd.Categorical.from_codes(
            cat.codes, pd.Index(cat.categories, dtype=object), ordered=cat.ordered
        )
        return pd.Series(plain, index=values.index) if isinstance(values, pd.Series) else plain
    return values


def writable_frame(frame):
    """A shallow copy of a DataFrame whose string-dtype index, columns and categories are
    object arrays (the caller's frame is not changed)."""
    out = frame.copy(deep=False)
    out.index = _plain_text(out.index)
    for name in out.columns:
        out[name] = _plain_text(out[name])
    return out


def writable_uns(value):
    """uns (a dict, nested) with every DataFrame in it through writable_frame; a copy of the
    containers only."""
    import pandas as pd

    if isinstance(value, dict):
        return {k: writable_uns(v) for k, v in value.items()}
    if isinstance(value, pd.DataFrame):
        return writable_frame(value)
    if isinstance(value, pd.Series | pd.Index):
        return _plain_text(value)
    return value


def write_h5ad(adata, path: str | Path, **kwargs) -> None:
    """adata.write_h5ad(path, **kwargs) with its text as plain object arrays (writable_frame),
    whatever pandas and anndata are installed. The matrices are shared, not copied; adata is
    not changed."""
    import anndata as ad

    frames = {k: dict(getattr(adata, k)) for k in ("obsm", "varm")}
    for mapping in frames.values():
        for k, v in mapping.items():
            if hasattr(v, "columns"):
                mapping[k] = writable_frame(v)
    plain = ad.AnnData(
        X=adata.X,
        obs=writable_frame(adata.obs),
        var=writable_frame(adata.var),
        uns=writable_uns(dict(adata.uns)),
        # anndata 0.13 lists X among the layers, under the key None
        layers={k: v for k, v in adata.layers.items() if k is not None},
        obsp=dict(adata.obsp),
        varp=dict(adata.varp),
        **frames,
    )
    if adata.raw is not None:
        plain.raw = ad.AnnData(X=adata.raw.X, obs=plain.obs, var=writable_frame(adata.raw.var))
    plain.write_h5ad(path, **kwargs)
