"""Bad input generated rather than listed (hypothesis): AnnData screens for
PertData.new_data_process and the .h5ad loader (in memory and out of core), config overrides for
every key through load_config, and custom split files. Every generated case must be accepted and
processed correctly or refused with a GearsInputError naming the problem: never another
exception, a traceback or a silently wrong result.

Profiles (tests/conftest.py): `ci` (default) replays a fixed, bounded set of cases;
`pytest tests/test_fuzz.py --hypothesis-profile=thorough` draws many more."""

from __future__ import annotations

import inspect
import json
import math
import pickle
import warnings
from dataclasses import fields, is_dataclass
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import yaml
from helpers import write_gene2go
from hypothesis import assume, event, given, note, settings
from hypothesis import strategies as st

from gears.config import Config, load_config, valid_keys
from gears.data.conditions import CONTROL_SPELLINGS
from gears.data.pertdata import PertData
from gears.errors import GearsInputError


def scaled(factor: float) -> settings:
    """This test's share of the loaded profile's example budget."""
    return settings(max_examples=max(1, int(settings.default.max_examples * factor)))


# ------------------------------------------------------------------------------ AnnData screens
IN_GO = ["G0", "G1", "G2", "G3", "G4", "G5", "Ä6"]  # measured or not, all in the GO source
NO_GO = ["M7", "M8"]  # measured genes without GO terms: their conditions are dropped
UNKNOWN = ["ZZ9", "g0"]  # in neither (g0: case matters): refused with unmapped_perts="error"
GENE_POOL = IN_GO + NO_GO
CONTROL_LABELS = ["ctrl", "control", "Control", "CTRL", " non-targeting ", "ctrl+ctrl"]
ODD_LABELS = ["", " ", "+", "G0+", "+G1", "G0+G1+G2", "G1+G1", "ctrl+G0+G1", "ZZ9", "g0", None]
CONDITION_COLUMNS = ["condition", "perturbation", "target_gene", "label"]  # label: not detected


@pytest.fixture(scope="module")
def go_file(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("fuzz_go")
    terms = {g: {"GO:0000001", f"GO:{100 + i // 2:07d}"} for i, g in enumerate(IN_GO)}
    return write_gene2go(folder / "go.tsv", terms)


def _labels(clean: bool) -> st.SearchStrategy:
    """One cell's perturbation label, spelled as users do (and some as they should not)."""
    perturbable = [*IN_GO, *NO_GO[:1]]
    gene = st.sampled_from(perturbable)
    single = st.builds(
        lambda g, form: form.format(g=g), gene, st.sampled_from(["{g}", "{g}+ctrl", "ctrl+{g}"])
    )
    double = st.builds(lambda a, b: f"{a}+{b}", gene, gene)
    odd = st.sampled_from(ODD_LABELS) | st.text(max_size=4)
    kind = st.sampled_from(
        ["single", "double", "single", "double", "control", "odd"][: 5 if clean else 6]
    )
    return kind.flatmap(
        lambda k: {
            "control": st.sampled_from(CONTROL_LABELS),
            "single": single,
            "double": double,
            "odd": odd,
        }[k]
    )


@st.composite
def screens(draw, counts: bool | None = None) -> dict:
    """A small AnnData with the knobs that matter, and what was planted in it. Half are clean
    (every fault below off) so that acceptance is exercised as much as refusal."""
    clean = draw(st.booleans())
    n_genes = draw(st.sampled_from([6, 4, 2, 1, 0][: 4 if clean else 5]))
    genes = draw(st.permutations(GENE_POOL))[:n_genes]
    gene_fault = draw(st.sampled_from([None] * 6 + ["duplicate", "empty", "missing"]))
    gene_fault = None if clean else gene_fault
    if n_genes < 2 and gene_fault == "duplicate":
        gene_fault = None
    if gene_fault == "duplicate":
        genes = [*genes[:-1], genes[0]]
    elif n_genes and gene_fault == "empty":
        genes = [*genes[:-1], draw(st.sampled_from(["", " "]))]
    n_cells = draw(st.sampled_from([40, 20, 8, 3, 1, 0][: 3 if clean else 6]))
    # Mostly controls and a few conditions with several cells each, so that most screens are valid.
    kinds = draw(st.lists(_labels(clean), min_size=1, max_size=4))
    weights = draw(st.lists(st.integers(1, 6), min_size=len(kinds), max_size=len(kinds)))
    raw = [kinds[i] for i, w in enumerate(weights) for _ in range(w)]
    raw = (["ctrl"] * draw(st.sampled_from([4, 2, 6, 0])) + raw) * (n_cells // max(len(raw), 1) + 1)
    raw = raw[:n_cells]
    dtype = draw(st.sampled_from(["float32", "float64", "int32", "uint8", "bool", "float16"]))
    counts = (not clean and draw(st.booleans())) if counts is None else counts
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    X = rng.poisson(40 if counts else 2, (n_cells, n_genes)).astype(np.float64)
    if not counts:
        X = np.log1p(X * rng.random(X.shape))
    value_fault = draw(st.sampled_from([None, "nan", "inf", "negative", "huge"]))
    value_fault = None if clean else value_fault
    if X.size and value_fault:  # (a cast below may turn it into another fault, or none)
        where = (int(rng.integers(n_cells)), int(rng.integers(n_genes)))
        X[where] = {"nan": np.nan, "inf": np.inf, "negative": -0.5, "huge": 1e300}[value_fault]
    if dtype != "float64" and not (value_fault in ("nan", "inf", "huge") and dtype != "float32"):
        with np.errstate(invalid="ignore", over="ignore"):
            X = X.astype(dtype)
    layout = draw(st.sampled_from(["dense", "csr", "csc"]))
    if layout != "dense" and X.dtype != np.float16:  # scipy has no float16 matrices
        X = (sp.csr_matrix if layout == "csr" else sp.csc_matrix)(X)
    column = draw(st.sampled_from(CONDITION_COLUMNS[: 3 if clean else 4]))
    obs = pd.DataFrame(index=[f"cell{i}" for i in range(n_cells)])
    obs[column] = pd.Series(raw, index=obs.index, dtype=object)
    # Extra columns: ones GEARS copies, and another perturbation-like column that must lose
    # to the first of condition / perturbation / target_gene present.
    for extra in draw(st.sets(st.sampled_from(["cell_type", "dose_val", *CONDITION_COLUMNS]))):
        if extra not in obs:
            options = st.sampled_from(["K562", "", "Ä", None, 1.5, "G0+G1+G2"])
            pair = draw(st.lists(options, min_size=2, max_size=2))
            obs[extra] = pd.Series([pair[i % 2] for i in range(n_cells)], obs.index, object)
    if draw(st.booleans()):
        obs = obs.astype({column: "category"})
    column = next((c for c in CONDITION_COLUMNS[:3] if c in obs), column)  # the one read
    raw = obs[column].astype(object).where(obs[column].notna(), None).tolist()
    var = pd.DataFrame(index=[f"ENSG{i}" for i in range(n_genes)])
    if gene_fault == "missing" and n_genes:
        var["gene_name"] = pd.Series(genes, index=var.index, dtype=object)
        var.iloc[-1, 0] = None
    elif draw(st.booleans()):
        var["gene_name"] = genes
    else:
        var.index = pd.Index(genes, dtype=object)
        var.index.name = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # anndata warns about duplicate or empty names
        adata = ad.AnnData(X=X, obs=obs, var=var)
    return {
        "adata": adata,
        "raw": raw,
        "genes": list(genes),
        "column": column,
        "gene_fault": gene_fault if n_genes else None,
        "dtype": dtype,
    }


def canonical(label) -> str | None:
    """GEARS's spelling of a label, written out independently; None if it is not one."""
    if label is None:
        return None
    text = str(label).strip()
    if text.lower() in CONTROL_SPELLINGS:
        return "ctrl"
    parts = [p.strip() for p in text.split("+")]
    genes = [p for p in parts if p.lower() not in CONTROL_SPELLINGS]
    if "" in genes or len(genes) > 2 or (len(genes) == 2 and genes[0] == genes[1]):
        return None
    if not genes:
        return "ctrl"
    return f"{genes[0]}+ctrl" if len(genes) == 1 else "+".join(sorted(genes))


def expected_problems(case: dict) -> list[str]:
    """Words the refusal must contain, one entry per problem planted (empty: must be accepted)."""
    adata, raw, genes = case["adata"], case["raw"], case["genes"]
    problems = []
    if adata.n_obs == 0 or adata.n_vars == 0:
        problems.append("is empty")
    if case["column"] not in ("condition", "perturbation", "target_gene"):
        problems.append("perturbation column")
    if problems:
        return problems
    if any(r is None for r in raw):
        problems.append("missing")
    values = adata.X.data if sp.issparse(adata.X) else np.asarray(adata.X)
    values = np.asarray(values, dtype=np.float64).ravel()
    finite = values[np.isfinite(values)]
    if finite.size < values.size:
        problems.append("NaN or infinite")
    if finite.size and finite.min() < 0:
        problems.append("negative")
    if finite.size and np.abs(finite).max() > np.finfo(np.float32).max:
        problems.append("too large")
    if case["gene_fault"] == "duplicate":
        problems.append("duplicate gene names")
    if case["gene_fault"] in ("empty", "missing"):
        problems.append("empty or missing gene name")
    canon = [canonical(r) for r in raw if r is not None]
    if any(c is None for c in canon):
        problems.append("condition")
    if problems:
        return problems
    if "ctrl" not in canon:
        return ["no control cells"]
    if set(canon) == {"ctrl"}:
        return ["every cell is a control"]
    if canon.count("ctrl") < 2:
        return ["only 1 control cell"]
    values = values.astype(np.float32)
    if values.size and values.max() > 30 and np.array_equal(values, np.round(values)):
        return ["raw counts"]
    perturbed = {g for c in canon for g in c.split("+") if g != "ctrl"}
    if not set(genes) & set(IN_GO) and not set(genes) & perturbed:  # ids of another kind?
        return ["measured gene names"]
    if perturbed - set(IN_GO) - set(genes):
        return ["neither measured genes nor in the GO"]
    kept = kept_conditions(canon, genes)
    if kept == ["ctrl"]:
        return ["no perturbed cells are left"]
    return []


def kept_conditions(canon: list[str], genes: list[str]) -> list[str]:
    """Conditions that survive processing: a known perturbation (GO) and at least two cells."""
    counts = pd.Series(canon).value_counts()
    keep = []
    for cond, n in counts.items():
        perts = [g for g in cond.split("+") if g != "ctrl"]
        if cond == "ctrl" or (n >= 2 and all(g in IN_GO for g in perts)):
            keep.append(cond)
    return sorted(keep, key=lambda c: (c != "ctrl", c))


def check_processed(p: PertData, case: dict) -> None:
    """An accepted screen: canonical conditions, the right cells, X unchanged, sane tables."""
    adata, raw, genes = case["adata"], case["raw"], case["genes"]
    canon = np.array([canonical(r) for r in raw], dtype=object)
    kept = kept_conditions(list(canon), genes)
    assert p.conditions == kept
    assert list(p.gene_names) == genes
    rows = np.flatnonzero(np.isin(canon, kept))
    assert [p.conditions[i] for i in p.cell_condition] == canon[rows].tolist()
    dense = adata.X.toarray() if sp.issparse(adata.X) else np.asarray(adata.X)
    want = np.asarray(dense, dtype=np.float32)[rows]
    np.testing.assert_array_equal(p.expr.rows(np.arange(len(rows))).numpy(), want)
    ctrl = want[canon[rows] == "ctrl"]
    np.testing.assert_allclose(p.ctrl_mean, ctrl.mean(0), rtol=1e-5, atol=1e-6)
    assert np.isfinite(p.ctrl_mean).all() and np.isfinite(p.condition_means()).all()
    assert p.de_idx.shape == (len(kept), min(20, len(genes)))
    assert ((p.de_idx >= -1) & (p.de_idx < len(genes))).all()
    dropped = set(canon[~np.isin(canon, kept)])
    assert set(p.report["dropped_conditions"]) == dropped
    for cond in p.conditions[1:]:  # every kept perturbation has a GO-graph node per gene
        assert all(g in p.node_map_pert for g in cond.split("+") if g != "ctrl")


def _outcome(call):
    try:
        return call(), None
    except GearsInputError as e:
        return None, e


@scaled(1.0)
@given(case=screens(), write=st.booleans())
def test_new_data_process_accepts_or_refuses_by_name(case, write, go_file, tmp_path_factory):
    adata = case["adata"]
    expected = expected_problems(case)
    note(f"raw labels {case['raw']}, genes {case['genes']}, expected {expected}")
    folder = tmp_path_factory.mktemp("fuzz_process")
    p = PertData(folder, gene2go=go_file, verbose=False)
    before = adata.copy()
    result, error = _outcome(lambda: p.new_data_process("fuzz", adata, write=write))
    event("refused" if error is not None else "accepted")
    if expected:
        assert error is not None, f"accepted although {expected}"
        assert any(word in str(error) for word in expected), (str(error), expected)
    else:
        assert error is None, f"refused a valid screen: {error}"
        check_processed(result, case)
        if write:  # the processed file reloads to the same screen
            again = PertData(folder, gene2go=go_file, verbose=False).load(data_path=folder / "fuzz")
            assert again.conditions == result.conditions
            np.testing.assert_array_equal(again.cell_condition, result.cell_condition)
    # The caller's AnnData is never changed.
    dense = lambda X: X.toarray() if sp.issparse(X) else np.asarray(X)
    np.testing.assert_array_equal(dense(adata.X), dense(before.X))
    assert adata.obs.equals(before.obs)


def _loaded(folder: Path, go: Path, path: Path, store: str, normalize: str):
    p = PertData(folder, gene2go=go, verbose=False, store=store, chunk_cells=7)
    return _outcome(lambda: p.load(data_path=path, normalize=normalize))


@scaled(0.8)
@given(
    normalize_case=st.sampled_from(["none", "log1p"]).flatmap(
        lambda n: st.tuples(st.just(n), screens(counts=True if n == "log1p" else None))
    )
)
def test_h5ad_in_memory_and_out_of_core_agree(normalize_case, go_file, tmp_path_factory):
    """The same .h5ad through both readers: refused by both (the same words), or accepted by
    both with the same conditions, cells, expression (bit for bit) and DE tables."""
    normalize, case = normalize_case
    folder = tmp_path_factory.mktemp("fuzz_h5ad")
    path = folder / "screen.h5ad"
    adata = case["adata"].copy()
    for column in adata.obs:  # metadata as files hold it (h5ad cannot store mixed objects)
        if column != case["column"] and adata.obs[column].dtype == object:
            adata.obs[column] = adata.obs[column].astype(str).astype("category")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            adata.write_h5ad(path)
    except Exception as e:  # anndata cannot store it: nothing for the readers to see
        note(f"anndata cannot write it: {e}")
        assume(False)
    memory, m_err = _loaded(folder / "memory", go_file, path, "memory", normalize)
    backed, b_err = _loaded(folder / "mmap", go_file, path, "mmap", normalize)
    note(f"in memory: {m_err}; out of core: {b_err}")
    event("refused" if m_err else "accepted")
    if m_err is None and sp.isspmatrix_csc(case["adata"].X):  # rows from columns: refused
        assert b_err is not None and "by column (CSC)" in str(b_err), b_err
        return
    assert (m_err is None) == (b_err is None), (m_err, b_err)
    if m_err is not None:
        return
    assert backed.store is not None and memory.store is None
    assert backed.conditions == memory.conditions
    assert list(backed.gene_names) == list(memory.gene_names)
    rows = np.arange(len(memory.cell_condition))
    np.testing.assert_array_equal(backed.cell_condition, memory.cell_condition)
    np.testing.assert_array_equal(backed.expr.rows(rows).numpy(), memory.expr.rows(rows).numpy())
    for name in ("de_ranked_idx", "non_dropout_de_idx", "non_zero_mask"):
        np.testing.assert_array_equal(getattr(backed, name), getattr(memory, name), err_msg=name)
    assert backed.normalize_target_sum == memory.normalize_target_sum
    assert backed.report.get("dropped_conditions") == memory.report.get("dropped_conditions")


# ----------------------------------------------------------------------- config overrides
def _field_types(cls=Config, prefix: str = "") -> dict[str, str]:
    """Dotted key -> its annotation as written in gears/config.py ('int', 'str | None', ...)."""
    out = {}
    for f in fields(cls):
        default = f.default_factory() if callable(f.default_factory) else None
        if is_dataclass(default):
            out.update(_field_types(type(default), f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = str(f.type)
    return out


FIELD_TYPES = _field_types()


def test_every_config_key_is_fuzzed():
    assert sorted(FIELD_TYPES) == sorted(valid_keys())
    assert set(DOMAIN) <= set(FIELD_TYPES)


INT64 = 2**63
# The documented domain of every numeric key (docs/configuration.md): (low, high, low open).
DOMAIN = {
    "seed": (0, INT64 - 1, False),
    "split.seed": (0, INT64 - 1, False),
    "data.chunk_cells": (1, None, False),
    "data.go_top_k": (1, None, False),
    "data.go_threshold": (0.0, 1.0, False),
    "data.coexpress_top_k": (1, None, False),
    "data.coexpress_threshold": (0.0, 1.0, False),
    "split.train_gene_set_size": (0.0, 1.0, True),
    "split.combo_seen2_train_frac": (0.0, 1.0, False),
    "split.test_size": (0.0, 1.0, True),
    "split.val_size": (0.0, 1.0, True),
    "model.hidden_size": (1, None, False),
    "model.num_go_gnn_layers": (1, None, False),
    "model.num_gene_gnn_layers": (1, None, False),
    "model.uncertainty_reg": (0.0, None, False),
    "model.direction_lambda": (0.0, None, False),
    "model.direction_temperature": (0.0, None, True),
    "model.gamma": (0.0, None, False),
    "train.epochs": (1, None, False),
    "train.batch_size": (1, None, False),
    "train.test_batch_size": (1, None, False),
    "train.lr": (0.0, None, True),
    "train.weight_decay": (0.0, None, False),
    "train.step_gamma": (0.0, 1.0, True),
    "train.grad_clip": (0.0, None, False),
    "train.grad_accum_steps": (1, None, False),
    "train.cells_per_group": (1, None, False),
    "train.block_size": (1, None, False),
    "train.checkpoint_every": (1, None, False),
    "train.early_stopping_patience": (0, None, False),
    "train.limit_batches": (0, None, False),
    "train.num_workers": (0, None, False),
    "train.log_every": (1, None, False),
    "train.plot_conditions": (0, None, False),
    "train.threads": (0, None, False),
    "distributed.master_port": (0, 65535, False),
    "distributed.timeout_s": (1, None, False),
    "distributed.data_wait_s": (1, None, False),
}
SPECIAL_TEXT = [
    "", " ", "null", "None", "~", "yes", "no", "on", "off", "true", "1", "0", "-1", "1e3", "1e400",
    "0o10", "0x1F", "1_000", "1.10", ".inf", "-.inf", ".nan", "nan", "inf", "[", "]", "{", "}",
    "[1, 2", "{a: 1", "a: b", ": x", "#x", "- a", "'", '"', "2024-01-01", "12:30:00", "&a", "*a",
    "!!python/object/apply:os.system ['true']", "!!binary aGk=", "!!set {a}", "cuda:0", "cpu",
    "adam", "Ä", "a=b", "ctrl+A", "\t", "%",
]  # fmt: skip
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 2, 65536, 2**31, 2**63, 2**64]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 0.5, 1.0, 1.5, -1.0, 1e-300, 1e300]),
    st.text(max_size=8),
    st.sampled_from(SPECIAL_TEXT),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=5,
)


def _flow(value) -> str:
    """A value as one would type it in YAML flow style on the command line."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6, allow_unicode=True)
    return text.removesuffix("\n").removesuffix("\n...").removesuffix("...").strip()


def _nested(key: str, value) -> dict:
    out: dict = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


def _get(cfg: Config, key: str):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _typed_as_declared(value, annotation: str) -> bool:
    optional = "None" in annotation
    if value is None:
        return optional
    base = annotation.replace(" | None", "")
    if base.startswith("list["):  # list[str], list[int]: a list of exactly that type
        item = base[5:-1]
        return type(value) is list and all(_typed_as_declared(v, item) for v in value)
    if base == "int":
        return type(value) is int and -INT64 <= value < INT64
    if base == "float":
        return type(value) is float and math.isfinite(value)
    if base == "bool":
        return type(value) is bool
    if base == "str":
        return type(value) is str
    if base == "list":
        return type(value) is list
    if base == "dict":
        return type(value) is dict
    raise AssertionError(f"no rule for {annotation}")


def check_config(cfg: Config, tmp: Path) -> None:
    """An accepted config: every value of its declared type and inside its documented domain,
    and config.yaml (as a run writes it) reloads to the same config."""
    for key, annotation in FIELD_TYPES.items():
        value = _get(cfg, key)
        assert _typed_as_declared(value, annotation), (key, value, annotation)
        if key in DOMAIN and value is not None:
            low, high, open_low = DOMAIN[key]
            assert value > low if open_low else value >= low, (key, value)
            assert high is None or value <= high, (key, value)
    for key in ("data.control_names",):
        assert all(type(v) is str for v in _get(cfg, key)), (key, _get(cfg, key))
    gpu_ids = cfg.distributed.gpu_ids
    assert gpu_ids is None or all(type(i) is int and i >= 0 for i in gpu_ids), gpu_ids
    for column, wanted in cfg.data.subset.items():
        items = wanted if isinstance(wanted, list) else [wanted]
        assert type(column) is str and all(isinstance(w, str | int | float) for w in items)
    from gears.data.synthetic import make_synthetic

    assert set(cfg.data.synthetic) <= set(inspect.signature(make_synthetic).parameters)
    cfg.save(tmp / "config.yaml")
    assert load_config(tmp / "config.yaml") == cfg


NULL_TEXT = ("null", "none")  # a str | None key reads these spellings as null (documented)


def _expected_text(text: str, annotation: str):
    """What a str key must hold after `key=text` on the command line: YAML's reading when that
    is a string (quotes honoured), else the text as typed (never 'True' for yes, '8' for 0o10);
    null for a key that takes it. Raises LookupError where the value must be refused."""
    try:
        parsed = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        parsed = text.strip()
    if parsed is None or (isinstance(parsed, str) and parsed.lower() in NULL_TEXT):
        if "None" in annotation:
            return None
        if parsed is None:
            raise LookupError(f"{text!r} is null for a key that cannot be null")
    return parsed if isinstance(parsed, str) else text.strip()


def _plausible(annotation: str) -> st.SearchStrategy:
    """Values of roughly the key's own type, edges included (half of the generated cases)."""
    base = annotation.replace(" | None", "")
    return {
        "int": st.integers(-3, 70000) | st.sampled_from([2**63 - 1, 2**63, -(2**63) - 1]),
        "float": st.floats(-2.0, 3.0) | st.sampled_from([math.nan, math.inf, 1e308, 5e-324]),
        "bool": st.booleans() | st.sampled_from(["yes", "off", "1", "maybe"]),
        "str": st.text(max_size=8) | st.sampled_from(SPECIAL_TEXT),
        "list": st.lists(scalars, max_size=3),
        "list[str]": st.lists(st.text(max_size=4) | scalars, max_size=3),
        "list[int]": st.lists(st.integers(-2, 9) | scalars, max_size=3),
        "dict": st.dictionaries(
            st.text(max_size=12) | st.sampled_from(["n_genes", "seed"]), values
        ),
    }[base]


@st.composite
def overrides(draw) -> tuple[str, object, str]:
    key = draw(st.sampled_from(sorted(FIELD_TYPES)))
    route = draw(st.sampled_from(["cli", "cli-text", "file", "json"]))
    if route == "cli-text":
        text = st.text(max_size=10).filter(lambda t: "\n" not in t and "\r" not in t)
        return key, draw(text | st.sampled_from(SPECIAL_TEXT)), route
    return key, draw(values | _plausible(FIELD_TYPES[key])), route


@scaled(6.0)
@given(case=overrides())
def test_config_overrides_are_typed_or_refused(case, tmp_path_factory):
    key, value, route = case
    tmp = tmp_path_factory.mktemp("cfg")
    annotation = FIELD_TYPES[key]
    base = annotation.replace(" | None", "").split("[")[0]
    text, path = None, None
    if route == "cli-text":
        text = value
    elif route == "cli":
        text = _flow(value)
    elif route == "json":
        text = json.dumps(value)
    else:
        path = tmp / "exp.yaml"
        path.write_text(yaml.safe_dump(_nested(key, value), allow_unicode=True))
    overrides = [] if text is None else [f"{key}={text}"]
    note(f"{route}: {overrides or path.read_text()!r} for {annotation}")
    must_refuse = value is None and "None" not in annotation  # null for a key that cannot be
    want = None
    if text is not None and base == "str":
        try:
            want = _expected_text(text, annotation)
        except LookupError:
            must_refuse = True
    try:
        cfg = load_config(path, overrides)
    except GearsInputError as e:
        event("refused")
        assert key in str(e) or route == "file" and key.split(".")[0] in str(e), str(e)
        return
    event("accepted")
    assert not must_refuse, f"accepted {value!r} for {key} ({annotation})"
    check_config(cfg, tmp)
    got = _get(cfg, key)
    if text is not None and base == "str":
        assert got == want, (got, text)
    elif route in ("cli", "file") and _typed_as_declared(value, annotation):
        assert got == value, (got, value)  # given in the key's own type: kept as given
    elif route in ("cli", "file") and base == "float" and type(value) is int:
        assert got == float(value)


@scaled(2.0)
@given(
    text=st.one_of(
        st.text(max_size=40),
        st.binary(max_size=40).map(lambda b: b.decode("latin-1")),
        st.sampled_from(SPECIAL_TEXT),
        st.builds(
            lambda k, v: f"{k}: {v}\n",
            st.sampled_from(["train", "1", "true", "null", "[a]", "train.epochs", "'x'"]),
            st.sampled_from(SPECIAL_TEXT),
        ),
    ),
    binary=st.booleans(),
)
def test_config_file_content_is_read_or_refused(text, binary, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cfgfile")
    path = tmp / "exp.yaml"
    if binary:
        path.write_bytes(b"\xff\xfe\x00" + text.encode("utf-8", "surrogatepass"))
    else:
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        cfg = load_config(path)
    except GearsInputError as e:
        event("refused")
        assert str(path) in str(e) or "config key" in str(e), str(e)
        return
    event("accepted")
    check_config(cfg, tmp)


def test_config_path_that_is_a_folder(tmp_path):
    with pytest.raises(GearsInputError, match="is not a file"):
        load_config(tmp_path)


# --------------------------------------------------------------------------- custom split files
@pytest.fixture(scope="module")
def split_data(tmp_path_factory) -> PertData:
    from helpers import tiny_gene2go, tiny_screen

    tmp = tmp_path_factory.mktemp("fuzz_split")
    go = write_gene2go(tmp / "go.tsv", tiny_gene2go())
    p = PertData(tmp / "data", gene2go=go, verbose=False)
    return p.new_data_process("tiny", tiny_screen(), write=False)


SPLIT_NAMES = ["G00+ctrl", "G01+ctrl", "G02+ctrl", "G03+ctrl", "G00+G03", "ctrl"]
ODD_NAMES = [
    "G03+G00",
    "ctrl+G01",
    "G00",
    "G00+G00",
    "ctrl+ctrl",
    "X+ctrl",
    "",
    " G00+ctrl",
    "Ä+ctrl",
]
name = st.one_of(st.sampled_from(SPLIT_NAMES + ODD_NAMES), st.text(max_size=6))
entry = st.one_of(
    st.lists(name, max_size=5),
    st.lists(st.one_of(name, st.integers(), st.none(), st.binary(max_size=3)), max_size=3),
    st.sets(name, max_size=3),
    st.tuples(name, name),
    name,
    st.none(),
    st.integers(),
    st.dictionaries(name, name, max_size=2),
)


@st.composite
def nearly_valid_splits(draw) -> dict:
    """Disjoint sets of the data's conditions, then at most one thing bent out of shape."""
    names = draw(st.permutations(SPLIT_NAMES))
    cut1, cut2 = sorted(draw(st.lists(st.integers(0, len(names)), min_size=2, max_size=2)))
    content = {"train": names[:cut1], "val": names[cut1:cut2], "test": names[cut2:]}
    if draw(st.booleans()):
        del content[draw(st.sampled_from(["val", "test"]))]
    bend = draw(st.sampled_from([None, None, "spelling", "overlap", "unknown", "type"]))
    target = draw(st.sampled_from(sorted(content)))
    if bend == "spelling":
        content[target] = [*content[target], draw(st.sampled_from(ODD_NAMES))]
    elif bend == "overlap" and names:
        content[target] = [*content[target], names[0]]
    elif bend == "unknown":
        content[target] = [*content[target], draw(name)]
    elif bend == "type":
        content[target] = draw(entry)
    return content


split_content = st.one_of(
    nearly_valid_splits(),
    nearly_valid_splits(),
    st.fixed_dictionaries({"train": entry}, optional={"val": entry, "test": entry, "extra": entry}),
    st.dictionaries(st.sampled_from(["train", "val", "test", "Train", "", "1"]), entry),
    st.lists(name, max_size=3),
    name,
    st.none(),
)


def _split_bytes(content, form: str) -> bytes:
    if form == "json":
        return json.dumps(content, default=sorted).encode()
    if form == "pickle":
        return pickle.dumps(content)
    return json.dumps(content, default=sorted).encode()[:-1]  # cut short: malformed


@scaled(2.0)
@given(
    content=split_content,
    form=st.sampled_from(["json", "json", "pickle", "broken"]),
    suffix=st.sampled_from([".json", ".pkl", ".txt"]),
    garbage=st.sampled_from([None] * 5) | st.binary(max_size=30),
)
def test_custom_split_file_is_used_exactly_or_refused(
    content, form, suffix, garbage, split_data, tmp_path_factory
):
    path = tmp_path_factory.mktemp("split") / f"split{suffix}"
    path.write_bytes(garbage if garbage is not None else _split_bytes(content, form))
    note(f"{path.name}: {path.read_bytes()[:200]!r}")
    try:
        split_data.prepare_split("custom", split_dict_path=path)
    except GearsInputError as e:
        event("refused")
        assert str(path) in str(e) or "split 'custom'" in str(e), str(e)
        return
    event("accepted")
    assert garbage is None and form != "broken"  # nothing unreadable is taken for a split
    sets = split_data.set2conditions
    listed = {k: {canonical(c) for c in content.get(k, [])} for k in ("train", "val", "test")}
    known = set(split_data.conditions)
    assert set(sets["train"]) == (listed["train"] | {"ctrl"}) & known
    for k in ("val", "test"):
        assert set(sets[k]) == listed[k] - {"ctrl"}
    assert not set(sets["train"]) & set(sets["val"]) and not set(sets["val"]) & set(sets["test"])
    assert not set(sets["train"]) & set(sets["test"])
    assert set(sets["train"]) | set(sets["val"]) | set(sets["test"]) <= known
    assert set(split_data.split.held_out) == known - set().union(*map(set, sets.values()))
    assert any(c != "ctrl" for c in sets["train"])


# ---------------------------------------------------------------- damaged files of every kind
# A valid file, then one kind of damage a disk, a copy or an editor does: cut short (a killed
# copy or download), emptied, a flipped bit, bytes overwritten, inserted or zeroed.
DAMAGE = ["truncate", "truncate", "empty", "flip", "flip", "overwrite", "insert", "zeros"]


@st.composite
def damaged(draw, data: bytes) -> tuple[str, bytes]:
    """(kind, bytes): `data` with one kind of damage (never unchanged)."""
    kind = draw(st.sampled_from(DAMAGE))
    n = len(data)
    at = draw(st.integers(0, n - 1))
    if kind == "empty":
        return kind, b""
    if kind == "truncate":
        return kind, data[:at]
    if kind == "flip":
        out = bytearray(data)
        out[at] ^= 1 << draw(st.integers(0, 7))
        return kind, bytes(out)
    junk = draw(st.binary(min_size=1, max_size=24))
    if kind == "insert":
        return kind, data[:at] + junk + data[at:]
    if kind == "zeros":
        junk = bytes(len(junk))
    out = data[:at] + junk + data[at + len(junk) :]
    assume(out != data)
    return kind, out


def _corrupted_copy(tmp_path_factory, name: str, data: bytes) -> Path:
    path = tmp_path_factory.mktemp("damaged") / name
    path.write_bytes(data)
    return path


@pytest.fixture(scope="module")
def valid_files(tmp_path_factory, go_file) -> dict:
    """One valid file of each kind a run reads: a screen (.h5ad), a checkpoint, a saved model
    folder, a GO table, a config file; with what they hold when whole."""
    import torch
    from helpers import tiny_gene2go, tiny_screen

    from gears.compat.api import GEARS
    from gears.train import checkpoint as ckpt
    from gears.train.engine import seed_everything

    folder = tmp_path_factory.mktemp("valid")
    tiny_screen().write_h5ad(folder / "screen.h5ad")
    go = write_gene2go(folder / "go.tsv", tiny_gene2go())
    pert_data = PertData(folder / "data", gene2go=go, verbose=False)
    pert_data.load(data_path=folder / "screen.h5ad").prepare_split("simulation", seed=1)
    seed_everything(0)
    model = GEARS(pert_data, device="cpu").model_initialize(hidden_size=8)
    model.save_model(folder / "model")
    state = {
        "format": ckpt.FORMAT_VERSION,
        "epoch": 3,
        "model": {k: v.clone() for k, v in model.model.state_dict().items()},
        "history": {"train_loss": [0.5, 0.25], "val": [{"mse": 0.1}]},
        "rng": torch.get_rng_state(),
    }
    ckpt.atomic_save(state, folder / "epoch_0003.pt")
    genes = [[g] for g in pert_data.pert_names[:3]]
    return {
        "h5ad": (folder / "screen.h5ad").read_bytes(),
        "conditions": pert_data.conditions,
        "go": go.read_bytes(),
        "checkpoint": (folder / "epoch_0003.pt").read_bytes(),
        "state": state,
        "model": folder / "model",
        "pert_data": pert_data,
        "genes": genes,
        "predictions": model.predict(genes),
        "config": (ROOT_DIR / "configs" / "default.yaml").read_bytes(),
    }


ROOT_DIR = Path(__file__).resolve().parents[1]


def _same_state(a, b) -> bool:
    import torch

    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same_state, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


@scaled(0.6)
@given(data=st.data(), store=st.sampled_from(["memory", "mmap"]))
def test_damaged_h5ad_is_read_or_refused(data, store, valid_files, go_file, tmp_path_factory):
    """A damaged .h5ad is refused with a GearsInputError (naming the file when it cannot be read
    at all; a truncated one always is: its HDF5 superblock records the length), or read into a
    screen that passes every check (a flipped bit in an expression value cannot be seen: HDF5
    keeps no checksums)."""
    kind, raw = data.draw(damaged(valid_files["h5ad"]))
    path = _corrupted_copy(tmp_path_factory, "screen.h5ad", raw)
    go = write_gene2go(path.parent / "go.tsv", __import__("helpers").tiny_gene2go())
    note(f"{kind}: {len(raw)} of {len(valid_files['h5ad'])} bytes")
    p = PertData(path.parent / "data", gene2go=go, verbose=False, store=store)
    result, error = _outcome(lambda: p.load(data_path=path))
    event(f"{kind}: {'refused' if error else 'accepted'}")
    if error is not None:  # what was found: the file named when unreadable as a whole
        assert kind not in ("truncate", "empty") or str(path) in str(error), error
        return
    assert kind not in ("truncate", "empty")
    assert set(result.conditions) <= set(valid_files["conditions"]) | set(result.conditions)
    assert np.isfinite(result.ctrl_mean).all()


@scaled(1.0)
@given(data=st.data())
def test_damaged_checkpoint_loads_whole_or_is_refused(data, valid_files, tmp_path_factory):
    """A damaged checkpoint is refused naming the file, or loads exactly what was saved (a
    change in the archive's bookkeeping only): never a silently different weight."""
    from gears.errors import GearsInputError
    from gears.train import checkpoint as ckpt

    kind, raw = data.draw(damaged(valid_files["checkpoint"]))
    path = _corrupted_copy(tmp_path_factory, "epoch_0003.pt", raw)
    try:
        state = ckpt.load(path)
    except GearsInputError as e:
        event(f"{kind}: refused")
        assert str(path) in str(e)
        assert ckpt.load_latest(path.parent, log=lambda _: None) is None
        with pytest.raises(ckpt.NoReadableCheckpoint, match="none of the 1 checkpoint"):
            ckpt.load_for_resume(path.parent, log=lambda _: None)
        return
    event(f"{kind}: loaded")
    assert _same_state(state, valid_files["state"])


@scaled(0.6)
@given(data=st.data(), name=st.sampled_from(["config.json", "prediction.json"]))
def test_damaged_model_folder_json_is_read_or_refused(data, name, valid_files, tmp_path_factory):
    """config.json or prediction.json damaged: a GearsInputError naming it, or a folder that
    still predicts exactly what it did (only a setting the weights do not depend on can
    change unseen: model.pt records the rest)."""
    import shutil

    from gears.compat.api import GEARS
    from gears.errors import GearsInputError
    from gears.train.saved_model import read_model_json

    kind, raw = data.draw(damaged((valid_files["model"] / name).read_bytes()))
    folder = tmp_path_factory.mktemp("damaged_model") / "model"
    shutil.copytree(valid_files["model"], folder)
    (folder / name).write_bytes(raw)
    try:
        if name == "config.json":
            model = GEARS(valid_files["pert_data"], device="cpu").load_pretrained(folder)
            predictions = model.predict(valid_files["genes"])
        else:
            info = read_model_json(folder, name)
    except GearsInputError as e:
        event(f"{kind}: refused")
        assert name in str(e) or str(folder) in str(e), str(e)
        return
    event(f"{kind}: read")
    if name == "config.json":
        for key, value in valid_files["predictions"].items():
            np.testing.assert_array_equal(predictions[key], value)
    else:
        assert isinstance(info, dict)


@scaled(0.6)
@given(data=st.data())
def test_damaged_go_table_is_read_or_refused(data, valid_files, tmp_path_factory):
    """The gene -> GO table (a TSV) damaged: refused naming it, or read (its content is data:
    a changed GO term is another graph, not an error)."""
    from helpers import tiny_screen

    kind, raw = data.draw(damaged(valid_files["go"]))
    path = _corrupted_copy(tmp_path_factory, "go.tsv", raw)
    p = PertData(path.parent / "data", gene2go=path, verbose=False)
    result, error = _outcome(lambda: p.new_data_process("tiny", tiny_screen(), write=False))
    event(f"{kind}: {'refused' if error else 'accepted'}")
    if error is not None:
        assert str(path) in str(error), str(error)
        return
    assert set(result.conditions) <= set(valid_files["conditions"])


@scaled(1.0)
@given(data=st.data())
def test_damaged_config_file_is_read_or_refused(data, valid_files, tmp_path_factory):
    """configs/default.yaml damaged: refused naming the file or the key, or a config whose every
    value is typed and in range."""
    kind, raw = data.draw(damaged(valid_files["config"]))
    path = _corrupted_copy(tmp_path_factory, "default.yaml", raw)
    try:
        cfg = load_config(path)
    except GearsInputError as e:
        event(f"{kind}: refused")
        assert str(path) in str(e) or "config key" in str(e), str(e)
        return
    event(f"{kind}: read")
    check_config(cfg, path.parent)
