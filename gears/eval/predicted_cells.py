"""Predicted cells as AnnData (the Virtual Cell Challenge layout) and scoring with cell-eval.

A predicted cell is a real control cell plus GEARS's predicted change for its perturbation
(GEARS's per-cell prediction: the network's output depends on the perturbation alone, the control
cell enters only as a residual), so one network forward per perturbation serves all its cells.
Log-expression cannot be negative, so predicted cells are clipped at 0 (cell-eval also rejects
negative values); the per-perturbation mean kept in `.uns` is GEARS.predict's, unclipped.

A saved model folder (GEARS.save_model; gears/train/saved_model.py) holds what prediction needs
besides the weights: `control_cells.h5ad` (a seeded sample of processed control cells, genes in
training order) and `prediction.json` (the input's perturbation column, control spelling,
condition spellings and normalisation).
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import anndata as ad
import numpy as np
import pandas as pd
import scipy.sparse as sp

from gears.choices import DEFAULT_SAMPLER
from gears.data.conditions import (
    CTRL,
    canonical_condition,
    canonicalize_conditions,
    condition_genes,
    detect_condition_key,
)
from gears.data.validate import gene_names_of
from gears.errors import GearsInputError
from gears.eval.counts import (
    MAX_COUNTS_PER_CELL,
    NB_MEAN_CELLS,
    ROWS_PER_DRAW,
    check_sampler,
    composition_rates,
    control_dispersion,
    raw_counts,
    sample_rows,
)
from gears.io import writable_frame, writable_uns
from gears.model.batch import declared_covariates, reads_x
from gears.train.saved_model import (
    CONFIG_FILE,
    MAX_SAVED_CONTROL_CELLS,
    control_sample_rows,
    csr_rows,
)

DEFAULT_CELLS_PER_PERTURBATION = 100
UNCERTAINTY_LAYER = "log_variance"
MEAN_KEY = "gears_mean_prediction"
OUTPUTS = ("lognorm", "counts")  # predict.py --output
COUNTS_KEY = "gears_counts"  # .uns: how counts output was drawn (sampler, seed, target sum)
PROVENANCE_KEY = "gears_provenance"  # .uns: the model folder, impl, config hash, code commit
CELL_EVAL_PROFILE = "vcc"
CELL_EVAL_INSTALL = (
    "cell-eval is not installed; install the optional evaluation extra with "
    "`pip install -r requirements-eval.txt` (it keeps the project's torch/numpy/pandas)"
)


# --------------------------------------------------------------------------- the request
def read_perturbations(spec: str) -> list[str]:
    """`--perturbations`: a file with one perturbation a line, or a comma-separated list."""
    path = Path(spec)
    if path.is_file():
        items = [line.strip() for line in path.read_text().splitlines()]
        items = [i for i in items if i and not i.startswith("#")]
    else:
        items = [i.strip() for i in spec.split(",") if i.strip()]
    if not items:
        raise GearsInputError(f"--perturbations {spec!r} names no perturbation")
    dup = sorted({i for i in items if items.count(i) > 1})
    if dup:
        raise GearsInputError(f"--perturbations lists {dup} more than once")
    return items


class CountsRequest(NamedTuple):
    """A cell-count CSV: cells asked per perturbation label (a control row included, under the
    data's control label) and, when the file has the column, the median UMI per cell asked."""

    n_cells: dict[str, int]
    median_umi: dict[str, float] | None


MAX_CELLS_PER_PERTURBATION = 1_000_000
MAX_PREDICTED_CELLS = 20_000_000  # obs alone would take GBs beyond this


def counts_contexts(path: str | Path, context_key: str | None) -> set[str] | None:
    """The contexts a --counts CSV lists (its `context_key` or `context` column), or None
    when it has no such column (it applies to every context)."""
    try:
        frame = pd.read_csv(path)
    except (OSError, ValueError, UnicodeDecodeError):
        return None  # read_counts says what is wrong with the file
    column = next((c for c in (context_key, "context") if c and c in frame.columns), None)
    if column is None:
        return None
    return set(frame[column].astype(str).str.strip())


def read_counts(
    path: str | Path,
    condition_key: str,
    context_key: str | None = None,
    context: str | None = None,
) -> CountsRequest:
    """A cell-count CSV, e.g. VCC's pert_counts_Validation.csv (target_gene,n_cells,
    median_umi_per_cell); the perturbation column is `condition_key`, `target` (2026),
    `target_gene` (2025) or the first column. A column named `context_key` (or `context`)
    restricts the rows to `context`, the model's; a file without one applies to every context.
    median_umi_per_cell sets the depth of counts output (`--output counts`)."""
    path = Path(path)
    if not path.is_file():
        raise GearsInputError(f"--counts file {path} does not exist")
    try:
        frame = pd.read_csv(path)
    except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise GearsInputError(
            f"--counts file {path} is empty or not a CSV ({first}); expected a header and "
            "rows like target_gene,n_cells,median_umi_per_cell"
        ) from None
    if "n_cells" not in frame.columns:
        raise GearsInputError(
            f"--counts file {path} has no 'n_cells' column (columns: {list(frame.columns)}); "
            "expected e.g. target_gene,n_cells,median_umi_per_cell"
        )
    context_col = next((c for c in (context_key, "context") if c and c in frame.columns), None)
    if context_col is not None and context is not None:
        listed = frame[context_col].astype(str).str.strip()
        if not (listed == context).any():
            raise GearsInputError(
                f"--counts file {path} has no rows for context {context!r} (column "
                f"{context_col!r} lists {sorted(set(listed))[:20]}); add its rows or predict "
                "another context's model"
            )
        frame = frame[(listed == context).values]
    if frame.empty:
        raise GearsInputError(f"--counts file {path} has no rows")
    candidates = (condition_key, "target", "target_gene")
    others = [c for c in frame.columns if c not in ("n_cells", "median_umi_per_cell", context_col)]
    key = next((k for k in candidates if k in frame.columns), others[0] if others else None)
    if key is None:
        raise GearsInputError(f"--counts file {path} has no perturbation column")
    labels = frame[key].astype(str).str.strip()
    counts = pd.to_numeric(frame["n_cells"], errors="coerce")
    bad = counts.isna() | (counts < 1) | (counts % 1 != 0) | (counts > MAX_CELLS_PER_PERTURBATION)
    if bad.any():
        raise GearsInputError(
            f"--counts: n_cells must be whole numbers from 1 to {MAX_CELLS_PER_PERTURBATION:,}; "
            f"bad rows: {labels[bad.values].tolist()[:20]}"
        )
    if counts.sum() > MAX_PREDICTED_CELLS:
        raise GearsInputError(
            f"--counts asks for {counts.sum():,.0f} cells; at most {MAX_PREDICTED_CELLS:,} are "
            "predicted in one file (split the request)"
        )
    if labels.duplicated().any():
        raise GearsInputError(f"--counts lists {sorted(set(labels[labels.duplicated()]))} twice")
    median = None
    if "median_umi_per_cell" in frame.columns:
        umi = pd.to_numeric(frame["median_umi_per_cell"], errors="coerce")
        bad = umi.isna() | ~np.isfinite(umi) | (umi <= 0) | (umi > MAX_COUNTS_PER_CELL)
        if bad.any():
            raise GearsInputError(
                f"--counts: median_umi_per_cell must be > 0 and <= {MAX_COUNTS_PER_CELL:,}; "
                f"bad rows: {labels[bad.values].tolist()[:20]}"
            )
        median = dict(zip(labels, umi.astype(float)))
    return CountsRequest(dict(zip(labels, counts.astype(np.int64).tolist())), median)


def resolve_perturbations(
    labels: Sequence[str], pert_vocabulary: dict[str, int], control_names: Sequence[str] = ()
) -> list[str]:
    """Canonical conditions of user spellings; every gene outside the model's vocabulary is
    listed in one GearsInputError."""
    conditions, unknown = [], []
    for label in labels:
        condition = canonical_condition(label, control_names=control_names)
        if condition == CTRL:
            raise GearsInputError(
                f"{label!r} is a control, not a perturbation; control cells are always included"
            )
        conditions.append(condition)
        unknown += [g for g in condition_genes(condition) if g not in pert_vocabulary]
    if unknown:
        unknown = sorted(set(unknown))
        raise GearsInputError(
            f"{len(unknown)} gene(s) are outside the model's perturbation vocabulary (genes "
            f"with GO annotations among its measured and perturbed genes): {unknown[:50]}"
            f"{' ...' if len(unknown) > 50 else ''}; they cannot be predicted"
        )
    dup = sorted({c for c in conditions if conditions.count(c) > 1})
    if dup:
        raise GearsInputError(f"perturbations {dup} are requested twice (in different spellings)")
    return conditions


# ---------------------------------------------------------------------------- predicted cells
class CellPlan(NamedTuple):
    """Which cells a prediction holds, before any expression is computed (small: ints per cell).

    obs: the output's obs (control cells first); source [N]: each cell's row in the saved
    control cells; which [N]: the perturbation whose change it gets (-1: a control cell)."""

    obs: pd.DataFrame
    source: np.ndarray
    which: np.ndarray


def plan_cells(
    labels: Sequence[str],
    conditions: Sequence[str],
    n_cells: Sequence[int],
    controls: ad.AnnData,
    condition_key: str,
    control_label: str,
    n_control: int | None = None,
    seed: int = 0,
    context: tuple[str, str] | None = None,
) -> CellPlan:
    """The cells of a prediction: n_control control cells (default all saved ones), then for
    each perturbation p, n_cells[p] control cells drawn without replacement while they last.
    context (obs column, name): every cell's context, for a model of one context."""
    rng = np.random.default_rng(seed)
    pool = controls.n_obs
    ctrl_idx = np.arange(pool) if n_control is None else _draw(rng, pool, n_control)
    source = np.concatenate([ctrl_idx, *(_draw(rng, pool, int(n)) for n in n_cells)])
    which = np.repeat(np.arange(-1, len(n_cells)), [len(ctrl_idx), *map(int, n_cells)])
    predicted = which >= 0
    label_col = np.where(predicted, np.asarray(labels, dtype=object)[which], control_label)
    cond_col = np.where(predicted, np.asarray(conditions, dtype=object)[which], CTRL)
    ctrl_names = controls.obs_names.astype(str).values
    names = [*ctrl_names[ctrl_idx]] + [
        f"pred{k:07d}-{lab}" for k, lab in enumerate(label_col[len(ctrl_idx) :])
    ]
    obs = pd.DataFrame(
        {
            condition_key: pd.Categorical(label_col),
            "gears_condition": pd.Categorical(cond_col),
            "control_cell": ctrl_names[source],
            "predicted": predicted,
        },
        index=pd.Index(names),
    )
    if context is not None:
        obs[context[0]] = pd.Categorical([context[1]] * len(obs))
    if not obs.index.is_unique:  # more control cells asked than saved: a cell appears twice
        obs.index = ad.utils.make_index_unique(obs.index)
    return CellPlan(obs, source, which)


def predicted_rows(
    plan: CellPlan, ctrl_X: np.ndarray, delta: np.ndarray, rows: slice
) -> np.ndarray:
    """The expression of plan's cells `rows`: control cell + its perturbation's change (float32,
    clipped at 0); control cells unchanged. ctrl_X [pool, G] and delta [P, G] float32."""
    out = ctrl_X[plan.source[rows]]
    which = plan.which[rows]
    hit = which >= 0
    out[hit] += delta[which[hit]]
    np.maximum(out, 0.0, out=out)
    return out


class CountsSpec(NamedTuple):
    """How a prediction's cells become integer counts (gears/eval/counts.py): the training
    normalisation's target sum, each saved control cell's library size [pool], each
    perturbation's depth factor [P] (the median UMI asked / the control cells' median; 1 keeps
    their depth), the sampler and its seed; for sampler nb the control cells' gene dispersions
    [G] and each perturbation's mean rate per library unit [P, G]."""

    target_sum: float
    library_size: np.ndarray
    depth: np.ndarray
    sampler: str
    seed: int
    theta: np.ndarray | None = None
    unit_rate: np.ndarray | None = None


def counts_spec(
    info: dict,
    controls: ad.AnnData,
    delta: np.ndarray,
    sampler: str = DEFAULT_SAMPLER,
    seed: int = 0,
    median_umi: Sequence[float] | None = None,
) -> CountsSpec:
    """The CountsSpec of a model folder's prediction: its normalisation (prediction.json),
    its control cells' library sizes (control_cells.h5ad obs['library_size']); median_umi [P]
    per perturbation (a counts file's median_umi_per_cell), None keeps the controls' depth."""
    check_sampler(sampler)
    target = info.get("normalize_target_sum")
    if target is None or "library_size" not in controls.obs:
        raise GearsInputError(
            "counts output needs the raw counts' scale, which this model does not have: it was "
            "trained on log-normalised data (data.normalize=none), or saved before library "
            "sizes were kept. Train it from raw counts with data.normalize=log1p "
            "(configs/vcc2026.yaml), or predict log-normalised cells (--output lognorm)"
        )
    library = controls.obs["library_size"].to_numpy(np.float64)
    depth = np.ones(len(delta))
    if median_umi is not None:
        depth = np.asarray(median_umi, dtype=np.float64) / float(np.median(library))
    theta = unit = None
    if sampler == "nb":
        ctrl_X = _dense_float32(controls.X)
        theta = control_dispersion(raw_counts(ctrl_X, library, target), library)
        unit = unit_rates(ctrl_X, np.asarray(delta, np.float32), seed)
    return CountsSpec(float(target), library, depth, sampler, int(seed), theta, unit)


def unit_rates(ctrl_X: np.ndarray, delta: np.ndarray, seed: int = 0) -> np.ndarray:
    """Each perturbation's mean predicted composition [P, G] (its rate per unit of library
    size): that of (control cell + change, clipped at 0), averaged over at most NB_MEAN_CELLS
    control cells."""
    rng = np.random.default_rng(seed)
    pick = rng.permutation(len(ctrl_X))[:NB_MEAN_CELLS]
    base = ctrl_X[pick]
    out = np.empty(delta.shape, dtype=np.float64)
    ones = np.ones(len(base))
    for p in range(len(delta)):
        out[p] = composition_rates(np.maximum(base + delta[p], 0.0), ones).mean(0)
    return out


def counts_rows(
    plan: CellPlan, ctrl_X: np.ndarray, delta: np.ndarray, rows: slice, spec: CountsSpec
) -> np.ndarray:
    """Integer counts of plan's cells `rows` [cells, G] float32: each predicted cell's
    log-normalised prediction (predicted_rows) turned into its rate with its control cell's
    library size times its perturbation's depth factor, then drawn by spec.sampler; control
    cells are their own raw counts. rows.start must be a multiple of ROWS_PER_DRAW."""
    x = predicted_rows(plan, ctrl_X, delta, rows)
    which = plan.which[rows]
    hit = which >= 0
    library = spec.library_size[plan.source[rows]]
    library = library * np.where(hit, spec.depth[np.maximum(which, 0)], 1.0)
    rate = composition_rates(x, library)
    if spec.unit_rate is not None:
        rate[hit] = library[hit, None] * spec.unit_rate[which[hit]]
    out = sample_rows(rate, rows.start, spec.seed, spec.sampler, spec.theta)
    out[~hit] = np.rint(rate[~hit])
    return out


def counts_uns(spec: CountsSpec) -> dict:
    return {
        "sampler": spec.sampler,
        "seed": spec.seed,
        "target_sum": spec.target_sum,
        "max_counts_per_cell": MAX_COUNTS_PER_CELL,
    }


@functools.cache
def code_commit() -> str:
    """The git commit of the code making the prediction (this package's checkout), with
    "+modified" when its tracked files differ from it; "unknown" without git or a checkout."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0 or not head.stdout.strip():
            return "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.stdout.strip() + ("+modified" if dirty.stdout.strip() else "")


def provenance_uns(model, output: str, sampler: str, seed: int) -> dict:
    """.uns['gears_provenance']: where a prediction came from. model_folder (absolute), the
    network (model.impl), sha256 of the folder's config.json (hyperparameters, vocabularies,
    the fork's options), the code's commit, the output, sampler and seed."""
    folder = getattr(model, "model_folder", None)
    config = Path(folder) / CONFIG_FILE if folder is not None else None
    model_cfg = getattr(model, "model_cfg", None)
    return {
        "model_folder": str(Path(folder).resolve()) if folder is not None else "unknown",
        "model_impl": getattr(model_cfg, "impl", None) or "unknown",
        "config_sha256": (
            hashlib.sha256(config.read_bytes()).hexdigest()
            if config is not None and config.is_file()
            else "unknown"
        ),
        "code_commit": code_commit(),
        "output": output,
        "sampler": sampler if output == "counts" else "none",
        "seed": int(seed),
    }


def prediction_uns(
    labels, conditions, delta, logvar, ctrl_mean, condition_key: str, control_label: str
) -> dict:
    """.uns of a prediction: GEARS.predict's per-perturbation means (unclipped, float64) and
    confidences, and the condition column's name and control label."""
    uns = {"gears_condition_key": condition_key, "gears_control_label": control_label}
    if ctrl_mean is not None:
        mean = {
            "perturbations": np.asarray(labels, dtype=str),
            "conditions": np.asarray(conditions, dtype=str),
            "mean": np.asarray(delta, dtype=np.float64) + np.asarray(ctrl_mean, np.float64),
        }
        if logvar is not None:
            mean["confidence"] = np.exp(-np.asarray(logvar, dtype=np.float64).mean(axis=1))
        uns[MEAN_KEY] = mean
    return uns


def _dense_float32(X) -> np.ndarray:
    return np.asarray(X.toarray() if sp.issparse(X) else X, dtype=np.float32)


def prediction_adata(
    labels: Sequence[str],
    conditions: Sequence[str],
    delta: np.ndarray,
    n_cells: Sequence[int],
    controls: ad.AnnData,
    condition_key: str,
    control_label: str,
    n_control: int | None = None,
    seed: int = 0,
    logvar: np.ndarray | None = None,
    ctrl_mean: np.ndarray | None = None,
    counts: CountsSpec | None = None,
    context: tuple[str, str] | None = None,
) -> ad.AnnData:
    """Predicted cells in memory (dense float32 X): for each perturbation p, n_cells[p] control
    cells drawn from `controls` (without replacement while they last) plus delta[p] [genes],
    clipped at 0; with `counts`, those cells as integer counts (counts_rows). write_prediction
    writes the same cells to a file in chunks.

    labels: the spelling written to obs[condition_key]; conditions: canonical names.
    delta [P, G]; logvar [P, G] -> layers['log_variance'] (NaN on the control cells).
    ctrl_mean [G]: with it, .uns['gears_mean_prediction'] holds delta + ctrl_mean per perturbation.
    The control cells (n_control of them, default all) come first, labelled control_label.
    context (obs column, name): written to every cell's obs.
    """
    _check_delta(delta, labels, controls)
    plan = plan_cells(
        labels,
        conditions,
        n_cells,
        controls,
        condition_key,
        control_label,
        n_control,
        seed,
        context,
    )
    rows = slice(0, len(plan.source))
    X = _rows_of(plan, _dense_float32(controls.X), np.asarray(delta, np.float32), rows, counts)
    out = ad.AnnData(X=X, obs=plan.obs, var=pd.DataFrame(index=controls.var_names.astype(str)))
    if logvar is not None:
        out.layers[UNCERTAINTY_LAYER] = _logvar_rows(plan, logvar, rows)
    out.uns.update(
        prediction_uns(labels, conditions, delta, logvar, ctrl_mean, condition_key, control_label)
    )
    if counts is not None:
        out.uns[COUNTS_KEY] = counts_uns(counts)
    return out


def _rows_of(plan, ctrl_X, delta32, rows: slice, counts: CountsSpec | None) -> np.ndarray:
    if counts is None:
        return predicted_rows(plan, ctrl_X, delta32, rows)
    return counts_rows(plan, ctrl_X, delta32, rows, counts)


def _check_delta(delta, labels, controls) -> None:
    if np.shape(delta) != (len(labels), controls.n_vars):
        raise GearsInputError(f"delta has shape {np.shape(delta)}; expected {len(labels)} x genes")


def _logvar_rows(plan: CellPlan, logvar: np.ndarray, rows: slice) -> np.ndarray:
    """layers['log_variance'] of cells `rows`: the perturbation's, NaN on control cells."""
    which = plan.which[rows]
    layer = np.full((len(which), np.shape(logvar)[1]), np.nan, dtype=np.float32)
    hit = which >= 0
    layer[hit] = np.asarray(logvar, dtype=np.float32)[which[hit]]
    return layer


CHUNK_BYTES = 64 * 2**20  # dense float32 rows computed at a time by write_prediction
MAX_INT32_NNZ = np.iinfo(np.int32).max  # cells x genes above this: 64-bit indptr and indices


class _GuardedFile(io.RawIOBase):
    """The file HDF5 writes a prediction through (h5py's file-object driver). A write that
    fails inside HDF5 (a full disk) leaves the library unable to close the file: the close
    raises, and the interpreter then dies of a segmentation fault. So no write fails here: the
    first failure is kept (`error`), and it and every later write go to memory, where reads
    find them, so HDF5 sees a consistent file to its close. The writer stops at the next chunk
    and reports the failure; memory then holds at most one chunk and the file's metadata."""

    def __init__(self, path: Path):
        super().__init__()
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._pos = 0
        self._size = 0
        self._unwritten: list[tuple[int, bytes]] = []  # (offset, data) after a failure, in order
        self.error: OSError | None = None

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if self.error is None:
            try:
                done = 0
                while done < len(view):
                    done += os.pwrite(self._fd, view[done:], self._pos + done)
            except OSError as e:
                self.error = e
        if self.error is not None:
            self._unwritten.append((self._pos, bytes(view)))
        self._pos += len(view)
        self._size = max(self._size, self._pos)
        return len(view)

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._size - self._pos))
        data = bytearray(os.pread(self._fd, n, self._pos)).ljust(n, b"\0")
        for offset, part in self._unwritten:  # in write order: a later write wins
            lo, hi = max(offset, self._pos), min(offset + len(part), self._pos + n)
            if lo < hi:
                data[lo - self._pos : hi - self._pos] = part[lo - offset : hi - offset]
        view[:n] = data
        self._pos += n
        return n

    def truncate(self, size: int | None = None) -> int:
        size = self._pos if size is None else size
        if self.error is None:
            try:
                os.ftruncate(self._fd, size)
            except OSError as e:
                self.error = e
        self._size = size
        return size

    def sync(self) -> None:
        """fsync the file; a failure (a full disk found late) becomes `error`."""
        if self.error is None:
            try:
                os.fsync(self._fd)
            except OSError as e:
                self.error = e

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


TEMP_MARK = ".tmp"


def temp_path(path: Path) -> Path:
    """Where `path` is written before it is renamed into place: hidden, named by the writer."""
    return path.with_name(f".{path.name}{TEMP_MARK}{os.getpid()}")


def remove_stale_temps(path: Path) -> list[Path]:
    """Temporary files of `path` left by writers that no longer run (a kill mid-write) ->
    removed, and listed; a live writer's is left alone."""
    removed = []
    for tmp in path.parent.glob(f".{path.name}{TEMP_MARK}*"):
        pid = tmp.name.rsplit(TEMP_MARK, 1)[-1]
        if pid.isdigit() and _alive(int(pid)) and int(pid) != os.getpid():
            continue
        tmp.unlink(missing_ok=True)
        removed.append(tmp)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def check_output_path(path: Path) -> None:
    """Refuse an output path that cannot take an .h5ad before any work is done."""
    if path.suffix != ".h5ad":
        raise GearsInputError(f"--out {path} must end in .h5ad")
    if path.is_dir():
        raise GearsInputError(f"--out {path} is a directory; give a file name ending in .h5ad")
    parent = path.parent
    if parent.exists() and not parent.is_dir():
        raise GearsInputError(f"--out {path}: {parent} is a file, not a folder")
    if parent.is_dir() and not os.access(parent, os.W_OK | os.X_OK):
        raise GearsInputError(f"--out {path}: the folder {parent} is not writable")


def write_error(path: Path, error: OSError) -> GearsInputError:
    import shutil

    try:
        free = f"{shutil.disk_usage(path.parent).free / 1e9:.2f} GB free there"
    except OSError:
        free = "free space unknown"
    kept = f"the earlier {path.name} is unchanged" if path.exists() else "nothing was written"
    return GearsInputError(
        f"could not write {path}: {error.strerror or error} ({free}); {kept}. Free space "
        "or write elsewhere (--out), then run again"
    )


def write_prediction(
    path: str | Path,
    labels: Sequence[str],
    conditions: Sequence[str],
    delta: np.ndarray,
    n_cells: Sequence[int],
    controls: ad.AnnData,
    condition_key: str,
    control_label: str,
    n_control: int | None = None,
    seed: int = 0,
    logvar: np.ndarray | None = None,
    ctrl_mean: np.ndarray | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    counts: CountsSpec | None = None,
    context: tuple[str, str] | None = None,
    provenance: dict | None = None,
) -> tuple[CellPlan, dict]:
    """prediction_adata's cells written to an .h5ad a chunk of cells at a time, X as CSR float32
    (the layout `cell-eval prep` asks for; zeros not stored), so memory holds the control cells,
    the changes and one ~chunk_bytes chunk, never the output (60,000 cells x 18,080 genes is
    4.3 GB dense). Atomic: written to a hidden temporary file, synced, then renamed; a write
    that fails (a full disk) removes it, keeps any earlier file and raises one GearsInputError;
    temporary files of killed writers are removed first. provenance: .uns['gears_provenance']
    (provenance_uns). X's indptr and indices share one integer width (32-bit unless cells x
    genes exceeds 2**31 - 1), as scipy's sparse routines (scanpy's rank_genes_groups) require.
    -> (its CellPlan, its uns)"""
    import h5py
    from anndata.io import write_elem

    _check_delta(delta, labels, controls)
    path = Path(path)
    plan = plan_cells(
        labels,
        conditions,
        n_cells,
        controls,
        condition_key,
        control_label,
        n_control,
        seed,
        context,
    )
    ctrl_X, delta32 = _dense_float32(controls.X), np.asarray(delta, np.float32)
    n, n_genes = len(plan.source), controls.n_vars
    step = max(1, chunk_bytes // (4 * n_genes))
    if counts is not None:  # float64 rates, and draws keyed by blocks of ROWS_PER_DRAW cells
        step = max(1, chunk_bytes // (8 * n_genes) // ROWS_PER_DRAW) * ROWS_PER_DRAW
    uns = prediction_uns(labels, conditions, delta, logvar, ctrl_mean, condition_key, control_label)
    if counts is not None:
        uns[COUNTS_KEY] = counts_uns(counts)
    if provenance is not None:
        uns[PROVENANCE_KEY] = provenance
    remove_stale_temps(path)
    tmp = temp_path(path)
    try:
        handle = _GuardedFile(tmp)
    except OSError as e:
        raise write_error(path, e) from None
    try:
        with h5py.File(handle, "w") as f:
            f.attrs.update({"encoding-type": "anndata", "encoding-version": "0.1.0"})
            write_elem(f, "obs", writable_frame(plan.obs))
            write_elem(f, "var", writable_frame(pd.DataFrame(index=controls.var_names.astype(str))))
            write_elem(f, "uns", writable_uns(uns))
            for empty in ("obsm", "varm", "obsp", "varp", "layers"):
                write_elem(f, empty, {})
            X = f.create_group("X")
            X.attrs.update(
                {"encoding-type": "csr_matrix", "encoding-version": "0.1.0", "shape": (n, n_genes)}
            )
            data = X.create_dataset("data", (0,), np.float32, maxshape=(None,), chunks=(2**18,))
            # One width for indptr and indices, as scipy's sparse routines require: 32-bit
            # unless the cells could hold more nonzeros than that counts.
            index_dtype = np.int32 if n * n_genes <= MAX_INT32_NNZ else np.int64
            indices = X.create_dataset(
                "indices", (0,), index_dtype, maxshape=(None,), chunks=(2**18,)
            )
            indptr = np.zeros(n + 1, dtype=np.int64)
            layer = None
            if logvar is not None:
                layer = f["layers"].create_dataset(UNCERTAINTY_LAYER, (n, n_genes), np.float32)
                layer.attrs.update({"encoding-type": "array", "encoding-version": "0.2.0"})
            for start in range(0, n, step):
                if handle.error is not None:
                    break  # the disk is full: stop computing what cannot be written
                rows = slice(start, min(start + step, n))
                chunk = sp.csr_matrix(_rows_of(plan, ctrl_X, delta32, rows, counts))
                stored = data.shape[0]
                for dataset, values in ((data, chunk.data), (indices, chunk.indices)):
                    dataset.resize((stored + chunk.nnz,))
                    dataset[stored:] = values
                indptr[rows.start + 1 : rows.stop + 1] = stored + chunk.indptr[1:]
                if layer is not None:
                    layer[rows] = _logvar_rows(plan, logvar, rows)
            X.create_dataset("indptr", data=indptr.astype(index_dtype))
        handle.sync()
        handle.close()
        if handle.error is not None:
            raise write_error(path, handle.error)
        tmp.replace(path)
    finally:
        handle.close()
        tmp.unlink(missing_ok=True)
    return plan, uns


def data_spelling(
    conditions: Sequence[str], labels: Sequence[str], spelling: dict[str, str]
) -> list[str]:
    """Labels in the training data's own spelling: its name for a condition it holds, the bare
    symbol for a single when the data writes singles bare (the challenge's 'KLF1'), else the
    label as asked."""
    bare = any("+" not in raw for cond, raw in spelling.items() if len(condition_genes(cond)) == 1)
    out = []
    for condition, label in zip(conditions, labels):
        genes = condition_genes(condition)
        if condition in spelling:  # without blanks: ' G000 ' in a file is G000
            out.append(str(spelling[condition]).strip())
        elif bare and len(genes) == 1:
            out.append(genes[0])
        else:
            out.append(label)
    return out


def _draw(rng: np.random.Generator, pool: int, n: int) -> np.ndarray:
    """n indices into range(pool): a permutation while they last, then with replacement."""
    full, rest = divmod(n, pool)
    parts = [rng.permutation(pool) for _ in range(full)]
    parts.append(rng.choice(pool, size=rest, replace=False))
    return np.concatenate(parts).astype(np.int64)


def predict_cells(
    model,
    info: dict,
    controls: ad.AnnData,
    labels: Sequence[str],
    n_cells: Sequence[int],
    n_control: int | None = None,
    seed: int = 0,
    out: str | Path | None = None,
    output: str = "lognorm",
    sampler: str = DEFAULT_SAMPLER,
    median_umi: Sequence[float] | None = None,
) -> ad.AnnData:
    """Predicted AnnData for perturbations spelled as the data spells them (see prediction_adata).
    With `out`, the cells are written there in chunks (write_prediction) and what is returned is
    the file's AnnData without X and layers (obs, var, uns): the expression stays on disk.

    output: `lognorm` (log-normalised expression, as the model predicts it) or `counts`
    (integer counts drawn by `sampler` at the control cells' depth, or at median_umi [P] per
    perturbation; gears/eval/counts.py). A model of one context (prediction.json 'context') writes
    it to obs[its context key].

    One network forward per chunk of perturbations (GEARS.predict_changes), never one per cell.
    A network that reads the control cell x or covariates is refused: its cells need per-cell
    forwards or each cell's covariate values, which the saved control cells do not carry.
    """
    net = model.prediction_net()
    if reads_x(net) or declared_covariates(net):
        raise GearsInputError(
            f"predict.py writes cells for networks that read neither the control cell nor "
            f"covariates; {type(net).__name__} reads "
            f"{'x' if reads_x(net) else list(declared_covariates(net))}: use "
            "GEARS.predict(..., covariates=...) for its predicted means"
        )
    if output not in OUTPUTS:
        raise GearsInputError(f"output must be one of {OUTPUTS}, got {output!r}")
    check_seed(seed)
    control_names = [info.get("control_label", CTRL)]
    conditions = resolve_perturbations(labels, model.pert_data.node_map_pert, control_names)
    labels = data_spelling(conditions, labels, info.get("condition_spelling", {}))
    delta, logvar = model.predict_changes([condition_genes(c) for c in conditions])
    counts = None
    if output == "counts":
        counts = counts_spec(info, controls, delta, sampler, seed, median_umi)
    context = None
    if info.get("context") is not None:
        context = (info["context_key"], info["context"])
    args = (
        labels,
        conditions,
        delta,
        n_cells,
        controls,
        info.get("condition_key", "condition"),
        info.get("control_label", CTRL),
    )
    kwargs = dict(
        n_control=n_control,
        seed=seed,
        logvar=logvar,
        ctrl_mean=model.ctrl_expression,
        counts=counts,
        context=context,
    )
    provenance = provenance_uns(model, output, sampler, seed)
    if out is None:
        pred = prediction_adata(*args, **kwargs)
        pred.uns[PROVENANCE_KEY] = provenance
        return pred
    plan, uns = write_prediction(out, *args, **kwargs, provenance=provenance)
    return ad.AnnData(obs=plan.obs, var=pd.DataFrame(index=controls.var_names.astype(str)), uns=uns)


def check_seed(seed: int) -> int:
    """Seeds are numpy's: whole numbers from 0 to 2**63 - 1."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**63:
        raise GearsInputError(f"--seed must be a whole number from 0 to 2**63 - 1, got {seed}")
    return int(seed)


# -------------------------------------------------------------------------------- cell-eval
def require_cell_eval() -> None:
    """Raise GearsInputError with the install line when cell-eval is not importable."""
    try:
        import cell_eval  # noqa: F401
    except ImportError:
        raise GearsInputError(CELL_EVAL_INSTALL) from None


def cell_eval_scores(
    pred: ad.AnnData,
    real: ad.AnnData,
    pert_col: str,
    control_label: str,
    outdir: str | Path,
    threads: int = 1,
    de_real: str | Path | None = None,
) -> dict[str, float]:
    """cell-eval's `vcc` profile (DE overlap, perturbation discrimination, MAE) on predicted vs
    real cells: its per-metric mean over perturbations. Its per-perturbation and aggregate CSVs
    and DE tables (real_de.csv, pred_de.csv) are written to outdir; de_real reuses a real_de.csv
    of the same real cells. Both AnnData need the same genes in the same order and the same
    perturbation labels in obs[pert_col], control included."""
    require_cell_eval()
    import logging

    from cell_eval import MetricsEvaluator

    # cell-eval warns when its output folder exists; ours are fresh per run or overwritten.
    logging.getLogger("cell_eval").setLevel(logging.ERROR)
    evaluator = MetricsEvaluator(
        adata_pred=pred,
        adata_real=real,
        control_pert=control_label,
        pert_col=pert_col,
        num_threads=threads,
        outdir=str(outdir),
        de_real=None if de_real is None else str(de_real),
    )
    _, agg = evaluator.compute(profile=CELL_EVAL_PROFILE, write_csv=True)
    row = agg.filter(agg["statistic"] == "mean").drop("statistic").to_dicts()[0]
    scores = {k: (None if v is None else float(v)) for k, v in row.items()}
    labels = set(pred.obs[pert_col].astype(str))
    scores["n_perturbations"] = len(labels - {control_label})
    return scores


def real_cells_for_scoring(
    path: str | Path,
    info: dict,
    gene_names: Sequence[str],
    pred: ad.AnnData,
) -> tuple[ad.AnnData, ad.AnnData]:
    """A real .h5ad (the data's layout) -> (real cells, pred cells) ready for cell-eval: real
    labels re-spelled as the prediction's, genes in the model's order, raw counts normalised as
    in training, both restricted to the perturbations they share (plus control)."""
    path = Path(path)
    if not path.is_file():
        raise GearsInputError(f"--real file {path} does not exist")
    real = ad.read_h5ad(path)
    key = info.get("condition_key", "condition")
    key = detect_condition_key(real.obs.columns, key if key in real.obs else None)
    control_label = info.get("control_label", CTRL)
    canon = canonicalize_conditions(real.obs[key].astype(str).values, control_names=[control_label])
    pred_key = pred.uns.get("gears_condition_key", key)
    label_of = dict(zip(pred.obs["gears_condition"].astype(str), pred.obs[pred_key].astype(str)))
    label_of[CTRL] = control_label
    keep = np.isin(canon, list(label_of))
    if not (canon[keep] != CTRL).any():
        raise GearsInputError(f"{path} has no cells of the predicted perturbations in obs[{key!r}]")
    if not (canon[keep] == CTRL).any():
        raise GearsInputError(f"{path} has no control cells ({control_label!r}) in obs[{key!r}]")
    canon = canon[keep]
    column = pd.Index(gene_names_of(real)).get_indexer(list(gene_names))
    if (column < 0).any():
        missing = [g for g, c in zip(gene_names, column) if c < 0]
        raise GearsInputError(
            f"{path} lacks {len(missing)} of the model's genes, e.g. {missing[:10]}"
        )
    X = real.X[np.flatnonzero(keep)][:, column]
    X = sp.csr_matrix(X, dtype=np.float32) if sp.issparse(X) else np.asarray(X, np.float32)
    values = X.data if sp.issparse(X) else X
    target = info.get("normalize_target_sum")
    if target is not None and np.all(values == np.round(values)):
        from gears.data.stream import normalize_log1p  # scanpy's arithmetic, CSR without scanpy

        X = normalize_log1p(X, target)
    obs = pd.DataFrame(
        {pred_key: pd.Categorical([label_of[c] for c in canon])},
        index=real.obs_names.astype(str)[keep],
    )
    real_out = ad.AnnData(X=X, obs=obs, var=pd.DataFrame(index=list(gene_names)))
    shared = set(obs[pred_key].astype(str))
    dropped = sorted(set(pred.obs[pred_key].astype(str)) - shared)
    if dropped:
        print(
            f"scoring without {len(dropped)} predicted perturbation(s) absent from {path}: "
            f"{dropped[:10]}",
            flush=True,
        )
        pred = pred[pred.obs[pred_key].astype(str).isin(shared).values].copy()
    return real_out, pred


def score_test_set(
    pert_data,
    conditions: Sequence[str],
    deltas: dict[str, np.ndarray],
    outdir: str | Path,
    seed: int = 0,
    threads: int = 1,
) -> dict[str, dict[str, float]]:
    """cell-eval on a run's test perturbations: for each predictor (GEARS, baselines), cells =
    control cell + its predicted change [C, G] (rows NaN where it has no prediction), as many
    per perturbation as the real test cells; the real side is the test cells and the same
    control sample. Returns predictor -> cell-eval metric means."""
    require_cell_eval()
    key = pert_data.condition_key
    spelling = pert_data.condition_spelling
    control_label = spelling.get(CTRL, CTRL)
    labels = [spelling.get(c, c) for c in conditions]
    ctrl_rows = control_sample_rows(pert_data.ctrl_rows, MAX_SAVED_CONTROL_CELLS, seed)
    X_all = pert_data.expr.numpy()
    genes = [str(g) for g in pert_data.gene_names]
    controls = ad.AnnData(
        X=csr_rows(X_all, ctrl_rows),
        obs=pd.DataFrame(index=pert_data.adata.obs_names.astype(str).values[ctrl_rows]),
        var=pd.DataFrame(index=genes),
    )
    ids = np.array([pert_data.cond_to_id[c] for c in conditions], dtype=np.int64)
    test_rows = np.flatnonzero(np.isin(pert_data.cell_condition, ids))
    rows = np.r_[ctrl_rows, test_rows]
    id_label = dict(zip(ids.tolist(), labels))
    real_labels = [control_label] * len(ctrl_rows) + [
        id_label[i] for i in pert_data.cell_condition[test_rows].tolist()
    ]
    real_all = ad.AnnData(
        X=csr_rows(X_all, rows),
        obs=pd.DataFrame(
            {key: pd.Categorical(real_labels)},
            index=pert_data.adata.obs_names.astype(str).values[rows],
        ),
        var=pd.DataFrame(index=genes),
    )
    n_real = pd.Series(real_labels[len(ctrl_rows) :]).value_counts()
    scores = {}
    real_de = {}  # the real side's DE (the slow part) once per set of perturbations scored
    for name, delta in deltas.items():
        covered = ~np.isnan(delta).any(axis=1)
        if not covered.any():
            continue
        keep = [i for i in range(len(conditions)) if covered[i]]
        pred = prediction_adata(
            [labels[i] for i in keep],
            [conditions[i] for i in keep],
            delta[keep],
            [int(n_real[labels[i]]) for i in keep],
            controls,
            key,
            control_label,
            seed=seed,
        )
        wanted = {control_label, *(labels[i] for i in keep)}
        real = real_all[real_all.obs[key].astype(str).isin(wanted).values].copy()
        shared_de = real_de.get(frozenset(wanted))
        scores[name] = cell_eval_scores(
            pred, real, key, control_label, Path(outdir) / name, threads, shared_de
        )
        real_de.setdefault(frozenset(wanted), Path(outdir) / name / "real_de.csv")
    return scores


def print_cell_eval_table(scores: dict[str, dict[str, float]]) -> None:
    """cell-eval's vcc metrics, one column per predictor."""
    if not scores:
        return
    cols = list(scores)
    metrics = [m for m in next(iter(scores.values())) if m != "n_perturbations"]
    width = max(len(m) for m in [*metrics, "n_perturbations"]) + 2
    print(
        f"\ncell-eval ({CELL_EVAL_PROFILE} profile; mean over perturbations: lower mae is "
        "better, higher overlap / discrimination is better)"
    )
    print("metric".ljust(width) + "".join(c.rjust(12) for c in cols))
    for m in [*metrics, "n_perturbations"]:
        cells = []
        for c in cols:
            v = scores[c].get(m)
            text = "-" if v is None else (str(v) if m == "n_perturbations" else f"{v:.4f}")
            cells.append(text.rjust(12))
        print(m.ljust(width) + "".join(cells))
