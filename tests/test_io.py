"""Writing .h5ad files under any pandas and anndata (gears/io.py: write_h5ad, writable_frame)."""

from __future__ import annotations

import ast
from pathlib import Path

import anndata as ad
import h5py
import numpy as np
import pandas as pd
import pytest

from gears.io import write_h5ad

ROOT = Path(__file__).resolve().parents[1]

# pandas 3's default text dtype (pandas 2.3: future.infer_string) and the nullable "string".
STRING_DTYPES = [pd.StringDtype(na_value=np.nan), pd.StringDtype()]


def text_screen(dtype) -> ad.AnnData:
    """Text in every place anndata writes it: obs and var names, columns, categories, uns."""

    def text(values):
        return pd.array(values, dtype=dtype)

    obs = pd.DataFrame(
        {
            "condition": text(["A+ctrl", "ctrl", "A+ctrl"]),
            "guide": pd.Categorical(
                ["g1", "g2", "g1"], categories=pd.Index(["g1", "g2"], dtype=dtype)
            ),
            "cell_id": text(["u", "v", "w"]),
            "n_counts": [1.0, 2.0, 3.0],
        },
        index=pd.Index(["c1", "c2", "c3"], dtype=dtype),
    )
    var = pd.DataFrame({"gene_id": text(["E1", "E2"])}, index=pd.Index(["A", "B"], dtype=dtype))
    adata = ad.AnnData(X=np.arange(6, dtype=np.float32).reshape(3, 2), obs=obs, var=var)
    adata.uns["table"] = pd.DataFrame({"gene": text(["A", "B"])})
    adata.uns["nested"] = {"table": pd.DataFrame({"gene": text(["B"])})}
    adata.raw = adata.copy()
    return adata


def encodings(path: Path) -> set[str]:
    """Every encoding-type written in the file."""
    found = set()
    with h5py.File(path, "r") as f:
        f.visititems(lambda _, item: found.add(str(item.attrs.get("encoding-type", ""))))
    return found - {""}


@pytest.mark.parametrize("view", [False, True], ids=["object", "view"])
@pytest.mark.parametrize("dtype", STRING_DTYPES, ids=["str", "string"])
def test_write_h5ad_writes_pandas_string_text_as_plain_strings(tmp_path, dtype, view):
    """anndata 0.12 refused these columns ("allow_write_nullable_strings is False") and 0.13
    writes them as nullable-string-array, which anndata < 0.11 cannot read: written through
    write_h5ad they are plain string arrays, read back equal, and the caller's object is as it
    was. A view (adata[rows], as the VCC layouts write) with a layer writes the same."""
    adata = text_screen(dtype)
    adata.layers["counts"] = adata.X * 2
    if view:
        adata = adata[[True, True, True]]
    before = {name: adata.obs[name].dtype for name in adata.obs.columns}
    path = tmp_path / "text.h5ad"
    write_h5ad(adata, path)
    assert "nullable-string-array" not in encodings(path)
    back = ad.read_h5ad(path)
    assert list(back.obs_names) == ["c1", "c2", "c3"] and list(back.var_names) == ["A", "B"]
    for name in ("condition", "guide", "cell_id"):
        assert list(back.obs[name].astype(str)) == list(adata.obs[name].astype(str)), name
    np.testing.assert_array_equal(back.obs["n_counts"], [1.0, 2.0, 3.0])
    assert list(back.var["gene_id"].astype(str)) == ["E1", "E2"]
    assert list(back.uns["table"]["gene"].astype(str)) == ["A", "B"]
    assert list(back.uns["nested"]["table"]["gene"].astype(str)) == ["B"]
    np.testing.assert_array_equal(back.X, adata.X)
    np.testing.assert_array_equal(back.layers["counts"], adata.X * 2)
    assert list(back.raw.var["gene_id"].astype(str)) == ["E1", "E2"]
    np.testing.assert_array_equal(back.raw.X, adata.raw.X)
    assert {name: adata.obs[name].dtype for name in adata.obs.columns} == before


def h5ad_writes_around_gears_io(root: Path) -> list[str]:
    """Places in root/gears that write an .h5ad past gears.io: any `<obj>.write_h5ad` (called
    or passed on) and write_elem of obs, var or uns not wrapped in gears.io's writable_*."""
    found = []
    for path in sorted((root / "gears").rglob("*.py")):
        if path.name == "io.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "write_h5ad":
                found.append((path, node.lineno))
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", getattr(node.func, "attr", None)) == "write_elem"
                and len(node.args) >= 3
                and getattr(node.args[1], "value", None) in ("obs", "var", "uns")
                and not getattr(getattr(node.args[2], "func", None), "id", "").startswith("writ")
            ):
                found.append((path, node.lineno))
    return [f"{path.relative_to(root)}:{line}" for path, line in sorted(found)]


def test_every_h5ad_write_in_the_package_goes_through_gears_io():
    """A new `adata.write_h5ad(...)`, or write_elem(f, "obs", frame), would write pandas 3's
    text in a way anndata 0.12 refuses: the package writes through gears.io."""
    assert h5ad_writes_around_gears_io(ROOT) == []


def test_the_write_finder_finds_each_kind(tmp_path):
    (tmp_path / "gears").mkdir()
    (tmp_path / "gears" / "m.py").write_text(
        "adata.write_h5ad(p)\n"
        "atomic_write(out, processed.write_h5ad)\n"
        'write_elem(f, "obs", plan.obs)\n'
        'write_elem(f, "uns", writable_uns(uns))\n'
        'msg = "adata.write_h5ad(...)"\n'
    )
    assert h5ad_writes_around_gears_io(tmp_path) == ["gears/m.py:1", "gears/m.py:2", "gears/m.py:3"]
