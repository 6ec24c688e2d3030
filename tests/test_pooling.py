"""Contexts are never pooled silently (gears/data/pooling.py): a file whose cells span several
cell lines or types, loaded without data.context_key, is refused naming the column, its values
and the settings that choose; data.subset to one context, data.context_key or
data.pool_contexts=true load it."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from helpers import tiny_gene2go, tiny_screen, write_gene2go

from gears.cli.job import DEFAULT_CONFIG, load_pert_data
from gears.config import load_config
from gears.data.conditions import detect_condition_key
from gears.data.pertdata import PertData
from gears.data.pooling import check_contexts
from gears.data.synthetic import make_synthetic, make_vcc_layout
from gears.errors import GearsInputError
from gears.train.distributed import DistEnv


def _two_lines(tmp_path, column: str = "cell_line", shift: float = 3.0):
    """tiny_screen with every cell dealt to line A or B; B's genes shifted by `shift`."""
    adata = tiny_screen()
    line = np.where(np.arange(adata.n_obs) % 2 == 0, "lineA", "lineB")
    adata.obs[column] = pd.Categorical(line)
    adata.X[line == "lineB"] += np.linspace(0, shift, adata.n_vars, dtype=np.float32)
    path = tmp_path / "two_lines.h5ad"
    adata.write_h5ad(path)
    return path


def _load(tmp_path, path, **kw) -> PertData:
    go = write_gene2go(tmp_path / "go.tsv", tiny_gene2go())
    return PertData(tmp_path / "data", gene2go=go, verbose=False).load(data_path=path, **kw)


def test_a_named_context_column_is_refused_naming_it_its_values_and_the_settings(tmp_path):
    path = _two_lines(tmp_path, shift=0.0)  # a second value is enough for a cell_line column
    with pytest.raises(GearsInputError) as err:
        _load(tmp_path, path, pool_contexts=False)
    msg = str(err.value)
    assert "\n" not in msg
    for part in ("obs['cell_line']", "lineA, lineB", "data.context_key=cell_line",
                 "data.subset.cell_line=", "data.pool_contexts=true"):  # fmt: skip
        assert part in msg, (part, msg)


@pytest.mark.parametrize("store", ["memory", "mmap"])
def test_an_unnamed_column_that_splits_the_controls_is_refused(tmp_path, store):
    """A label column of any name whose control cells' expression separates (here: line B's
    genes shifted) is a context; the out-of-core path checks it too, before any store."""
    path = _two_lines(tmp_path, column="sample_origin")
    go = write_gene2go(tmp_path / "go.tsv", tiny_gene2go())
    data = PertData(tmp_path / "data", gene2go=go, verbose=False, store=store)
    with pytest.raises(GearsInputError, match=r"obs\['sample_origin'\] holds 2 contexts"):
        data.load(data_path=path, pool_contexts=False)
    assert not (tmp_path / "data" / "two_lines" / "store").exists()


def test_a_label_that_does_not_split_the_controls_is_no_context(tmp_path):
    """A random two-way label (a technical tag) and integer measurements load as before."""
    path = _two_lines(tmp_path, column="tag", shift=0.0)
    data = _load(tmp_path, path, pool_contexts=False)
    assert data.adata.n_obs > 0


def test_subset_context_key_or_pool_contexts_load_it(tmp_path):
    path = _two_lines(tmp_path)
    assert set(_load(tmp_path, path, subset={"cell_line": "lineA"}, pool_contexts=False)
               .adata.obs["cell_line"].astype(str)) == {"lineA"}  # fmt: skip
    assert _load(tmp_path, path, context_key="cell_line", pool_contexts=False).contexts == [
        "lineA",
        "lineB",
    ]
    assert _load(tmp_path, path, pool_contexts=True).adata.n_obs > 0


def test_the_config_path_refuses_by_default_and_pools_on_request(tmp_path):
    path = _two_lines(tmp_path)
    go = write_gene2go(tmp_path / "go.tsv", tiny_gene2go())
    common = [f"data.dataset={path}", f"data.gene2go={go}", f"data.data_dir={tmp_path / 'd'}"]
    cfg = load_config(overrides=common, base=DEFAULT_CONFIG)
    assert cfg.data.pool_contexts is False
    with pytest.raises(GearsInputError, match="data.pool_contexts=true"):
        load_pert_data(cfg, DistEnv(), split=False)
    pooled = load_config(overrides=[*common, "data.pool_contexts=true"], base=DEFAULT_CONFIG)
    assert load_pert_data(pooled, DistEnv(), split=False).adata.n_obs > 0


def test_the_embedded_screens_and_the_vcc_layout_are_not_refused():
    """The embedded screen (configs/default.yaml), and the VCC 2025 layout (one line, four
    technical batches, two guides per gene: configs/vcc.yaml) pass the check as they are."""
    assert load_config(base=DEFAULT_CONFIG).data.pool_contexts is False
    for adata, normalize in ((make_synthetic().adata, "none"), (make_vcc_layout()[0], "log1p")):
        obs = adata.obs
        is_control = (
            obs[detect_condition_key(obs.columns)].astype(str).isin(["ctrl", "non-targeting"])
        )
        assert is_control.sum() > 0
        check_contexts(
            adata, None, subset=None, condition_key=None, normalize=normalize, pool_contexts=False
        )


def test_the_real_multi_line_screen_is_refused_naming_cell_type(shared_data, tmp_path):
    """../shared/data/perturbench_devel.h5ad: K562 and three glioma lines. Pooled, their
    controls made one mean and the "DE genes" were line markers; now it stops. One part
    (data.subset.dataset=norman19: K562 alone) loads as configs/perturbench_norman.yaml does."""
    data = PertData(
        tmp_path,
        gene2go=shared_data / "gene2go_human.tsv.gz",
        gene_aliases=shared_data / "gene_aliases_human.tsv.gz",
        verbose=False,
        unmapped_perts="keep",
    )
    with pytest.raises(GearsInputError) as err:
        data.load(data_path=shared_data / "perturbench_devel.h5ad", pool_contexts=False)
    msg = str(err.value)
    assert "obs['cell_type'] holds 4 contexts (A172, T98G, U87MG, k562)" in msg, msg
    assert "data.context_key=cell_type" in msg and "data.pool_contexts=true" in msg
    with pytest.raises(GearsInputError, match=r"holds 3 contexts \(after data.subset"):
        data.load(
            data_path=shared_data / "perturbench_devel.h5ad",
            subset={"dataset": "mcfaline23"},
            pool_contexts=False,
        )
    data.load(
        data_path=shared_data / "perturbench_devel.h5ad",
        subset={"dataset": "norman19"},
        pool_contexts=False,
    )
    assert set(data.adata.obs["cell_type"].astype(str)) == {"k562"}


def test_the_python_api_pools_by_default_and_says_so(tmp_path, capsys):
    """PertData.load without pool_contexts (set_context_key may follow) loads the cells pooled
    and prints one note naming the column and how to keep them apart."""
    path = _two_lines(tmp_path)
    go = write_gene2go(tmp_path / "go.tsv", tiny_gene2go())
    data = PertData(tmp_path / "data", gene2go=go).load(data_path=path)
    out = capsys.readouterr().out
    assert "note: obs['cell_line'] holds 2 contexts (lineA, lineB)" in out, out
    assert "set_context_key('cell_line')" in out
    assert data.set_context_key("cell_line").contexts == ["lineA", "lineB"]
