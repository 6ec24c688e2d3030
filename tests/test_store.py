"""The processed store, out-of-core processing and the streamed DE test (gears/data/store.py,
gears/data/stream.py, de.de_from_stats, PertData.process_backed)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import torch
from helpers import tiny_gene2go, tiny_screen, write_gene2go

from gears.data import de, store, stream
from gears.data.conditions import CTRL, canonicalize_conditions
from gears.data.loaders import EpochBatch
from gears.data.pertdata import PertData
from gears.errors import GearsInputError

ROOT = Path(__file__).resolve().parents[1]


def random_screen(
    n_cells: int = 1500, n_genes: int = 120, n_conditions: int = 12, seed: int = 0
) -> ad.AnnData:
    """Sparse log-normalised-looking counts with all-zero and control-only genes (tie cases)."""
    rng = np.random.default_rng(seed)
    genes = [f"G{i:03d}" for i in range(n_genes)]
    raw = rng.choice(["control", *genes[:n_conditions]], n_cells)
    X = rng.random((n_cells, n_genes)).astype(np.float32)
    X[X < 0.85] = 0
    X = np.log1p(20 * X).astype(np.float32)
    X[:, 7] = 0  # zero everywhere: score 0 in every condition
    X[raw != "control", 9] = 0  # expressed in controls only: a dropout gene
    for i, g in enumerate(genes[:n_conditions]):  # knock-down of the perturbed gene
        X[raw == g, i] *= 0.1
    obs = pd.DataFrame({"condition": raw}, index=[f"c{i}" for i in range(n_cells)])
    return ad.AnnData(X=sp.csr_matrix(X), obs=obs, var=pd.DataFrame(index=genes))


def streamed_de(adata: ad.AnnData, chunk_cells: int = 97) -> tuple[dict, dict]:
    """(scanpy's compute_de, de_from_stats over a chunked pass) on canonical conditions."""
    adata = adata.copy()
    adata.X = adata.X.astype(np.float32)  # as PertData stores it before either DE path
    adata.obs["condition"] = canonicalize_conditions(adata.obs["condition"].values)
    reference = de.compute_de(adata)
    conditions = [CTRL, *sorted(set(adata.obs["condition"]) - {CTRL})]
    codes = pd.Index(conditions).get_indexer(adata.obs["condition"])
    stats = stream.stream_condition_stats(
        adata.X,
        adata.n_obs,
        codes,
        len(conditions),
        adata.n_vars,
        chunk_cells,
        moments=de.scanpy_aggregates(),
    )
    streamed = de.de_from_stats(
        conditions,
        stats.sums,
        stats.sumsq,
        stats.counts,
        np.asarray(adata.var_names),
        moments=stats.moments,
    )
    return reference, streamed


def assert_same_de(reference: dict, streamed: dict) -> None:
    assert set(reference[de.RANK_KEY]) == set(streamed[de.RANK_KEY])
    for key in de.DE_KEYS:
        for cond, ref in reference[key].items():
            np.testing.assert_array_equal(
                np.asarray(streamed[key][cond]), np.asarray(ref), err_msg=f"{key} of {cond}"
            )


@pytest.mark.parametrize("sparse", [False, True])
def test_streamed_de_equals_scanpy_tiny_screen(sparse):
    adata = tiny_screen()
    if sparse:
        adata.X = sp.csr_matrix(adata.X)
    reference, streamed = streamed_de(adata, chunk_cells=7)
    assert_same_de(reference, streamed)
    # The hand-made truths hold in the streamed result too (a wrong test could not pass).
    assert streamed[de.RANK_KEY]["G00+ctrl"][0] == "G00"
    assert "G21" not in streamed[de.TOP_NON_DROPOUT_KEY]["G00+ctrl"]


@pytest.mark.parametrize("sparse", [False, True])
def test_streamed_de_equals_scanpy_random_screen(sparse):
    adata = random_screen()
    if not sparse:
        adata.X = adata.X.toarray()
    reference, streamed = streamed_de(adata)
    assert_same_de(reference, streamed)
    # The all-zero gene ties at score 0 with other genes: the tie order must match too.
    ranked = streamed[de.RANK_KEY]["G000+ctrl"]
    assert list(ranked).index("G007") > 10


def test_streamed_de_equals_scanpy_real_screen(shared_data):
    adata = ad.read_h5ad(shared_data / "perturbench_devel.h5ad")
    conditions = adata.obs["condition"].astype(str)
    keep = conditions.isin(conditions.value_counts().index[:40]) | (conditions == "control")
    reference, streamed = streamed_de(adata[keep.values].copy(), chunk_cells=500)
    assert_same_de(reference, streamed)


def test_streamed_de_equals_scanpy_real_screen_dense(shared_data):
    """The same screen as a dense matrix: scanpy >= 1.12 updates its running moments with every
    value of a dense row, zeros included, and rounds differently than on the sparse one."""
    adata = ad.read_h5ad(shared_data / "perturbench_devel.h5ad")
    adata.X = adata.X.toarray()
    reference, streamed = streamed_de(adata, chunk_cells=500)
    assert_same_de(reference, streamed)


def tied_screen(seed: int = 0, n_copies: int = 40) -> ad.AnnData:
    """random_screen plus genes that each hold gene G020's values shuffled among the cells of
    every condition: equal t statistics on paper, which only the arithmetic's rounding orders.
    scanpy 1.11 (E[x^2] - mean^2) and 1.12 (Welford's running update) order them differently."""
    adata = random_screen(n_cells=1500, n_genes=60, seed=seed)
    rng = np.random.default_rng(seed + 1)
    X, conditions = adata.X.toarray(), adata.obs["condition"].values
    copies = np.repeat(X[:, [20]], n_copies, axis=1)
    for c in np.unique(conditions):
        rows = np.flatnonzero(conditions == c)
        for i in range(n_copies):
            copies[rows, i] = X[rng.permutation(rows), 20]
    genes = [*adata.var_names, *(f"T{i:03d}" for i in range(n_copies))]
    return ad.AnnData(
        X=sp.csr_matrix(np.hstack([X, copies])), obs=adata.obs, var=pd.DataFrame(index=genes)
    )


@pytest.mark.parametrize("sparse", [True, False])
def test_streamed_de_equals_installed_scanpy_on_tied_genes(sparse):
    """Gene for gene what the installed scanpy ranks, where the two scanpy versions disagree
    (each version's arithmetic misorders the other's ties in all 12 conditions)."""
    adata = tied_screen()
    if not sparse:
        adata.X = adata.X.toarray()
    reference, streamed = streamed_de(adata)
    assert_same_de(reference, streamed)


def test_welch_scores_match_scipy():
    from scipy import stats as scipy_stats

    rng = np.random.default_rng(3)
    a, b = rng.random((30, 5)), rng.random((11, 5)) + 0.2
    sums = np.stack([a.sum(0), b.sum(0)])
    sumsq = np.stack([(a.astype(np.float32) ** 2).sum(0), (b.astype(np.float32) ** 2).sum(0)])
    scores = de.welch_scores(sums.astype(np.float64), sumsq.astype(np.float64), np.array([30, 11]))
    expected = scipy_stats.ttest_ind(b, a, equal_var=False).statistic
    np.testing.assert_allclose(scores[1], expected, rtol=1e-5)
    assert np.all(scores[0] == 0)


def test_chunk_validation_names_the_cells():
    X = np.ones((10, 3), np.float32)
    X[7, 1] = np.nan
    with pytest.raises(GearsInputError, match="cells 6-8"):
        stream.stream_condition_stats(X, 10, np.zeros(10, np.int64), 1, 3, chunk_cells=3)
    X[7, 1] = -1
    with pytest.raises(GearsInputError, match="negative"):
        stream.stream_condition_stats(sp.csr_matrix(X), 10, np.zeros(10, np.int64), 1, 3, 4)


# ------------------------------------------------------------------------------ PertData store
@pytest.fixture()
def screen_file(tmp_path) -> tuple[Path, Path]:
    adata = random_screen(n_cells=900, n_genes=60, n_conditions=10)
    path = tmp_path / "screen.h5ad"
    adata.write_h5ad(path)
    go = write_gene2go(tmp_path / "go.tsv", tiny_gene2go(list(adata.var_names)))
    return path, go


def load(tmp_path, path, go, mode, **kwargs) -> PertData:
    return PertData(
        tmp_path / "data",
        gene2go=go,
        store=mode,
        verbose=False,
        chunk_cells=kwargs.pop("chunk_cells", 101),
        **kwargs,
    ).load(data_path=path)


@pytest.mark.parametrize("layout", ["dense", "csr"])
def test_backed_processing_equals_in_memory(tmp_path, screen_file, monkeypatch, layout):
    path, go = screen_file
    if layout == "csr":
        monkeypatch.setattr(store, "DENSE_STORE_LIMIT_BYTES", 0)
    memory = load(tmp_path, path, go, "memory")
    backed = load(tmp_path, path, go, "mmap")
    assert backed.store is not None and backed.store.meta["layout"] == layout
    assert memory.store is None
    assert backed.conditions == memory.conditions
    for name in (
        "cell_condition",
        "cond_pert_index",
        "de_ranked_idx",
        "de_idx",
        "non_dropout_de_idx",
        "non_zero_mask",
    ):
        np.testing.assert_array_equal(getattr(backed, name), getattr(memory, name), err_msg=name)
    np.testing.assert_allclose(backed.condition_means(), memory.condition_means(), atol=1e-6)
    np.testing.assert_allclose(backed.ctrl_mean, memory.ctrl_mean, atol=1e-6)
    rows = np.arange(0, 900, 7)
    np.testing.assert_array_equal(backed.expr.rows(rows).numpy(), memory.expr.rows(rows).numpy())
    for pd_ in (memory, backed):
        pd_.prepare_split("simulation", seed=1)
    g_mem, g_back = memory.coexpress_graph(5, 0.05), backed.coexpress_graph(5, 0.05)
    assert g_mem.num_edges > len(memory.gene_names)  # more than the self edges
    assert torch.equal(g_mem.edge_index, g_back.edge_index)
    torch.testing.assert_close(g_mem.edge_weight, g_back.edge_weight, atol=1e-6, rtol=0)
    batch = next(iter(backed.get_dataloader(16)["train_loader"]))
    assert batch.x.shape == (16, 60) and batch.x.dtype == torch.float32


def test_coexpression_rows_equal_copied_subset():
    from gears.data import graphs

    X = random_screen(n_cells=400, n_genes=40).X.toarray()
    rows = np.sort(np.random.default_rng(0).choice(400, 250, replace=False))
    genes = [f"g{i}" for i in range(40)]
    copied = graphs.coexpression_graph(X[rows], genes, 5, 0.1)
    for matrix in (X, sp.csr_matrix(X)):
        streamed = graphs.coexpression_graph(matrix, genes, 5, 0.1, rows=rows)
        assert torch.equal(copied.edge_index, streamed.edge_index)
        torch.testing.assert_close(copied.edge_weight, streamed.edge_weight, atol=1e-6, rtol=0)


def store_dirs(tmp_path) -> list[Path]:
    return sorted(p for p in (tmp_path / "data").rglob("store/*") if p.is_dir())


def test_store_reused_then_rebuilt_on_changes(tmp_path, screen_file):
    path, go = screen_file
    first = load(tmp_path, path, go, "mmap")
    built = store_dirs(tmp_path)
    assert len(built) == 1
    stamp = (built[0] / "X.npy").stat().st_mtime_ns
    again = load(tmp_path, path, go, "mmap", chunk_cells=50)  # chunking is no parameter
    assert store_dirs(tmp_path) == built
    assert (built[0] / "X.npy").stat().st_mtime_ns == stamp
    assert again.store.path == first.store.path
    # A processing parameter: a subset of the cells.
    PertData(tmp_path / "data", gene2go=go, store="mmap", verbose=False).load(
        data_path=path, subset={"condition": ["control", "G001", "G002"]}
    )
    assert len(store_dirs(tmp_path)) == 2
    # Another GO source (decides which conditions are kept).
    go2 = write_gene2go(
        tmp_path / "go2.tsv",
        {g: t for g, t in tiny_gene2go([f"G{i:03d}" for i in range(60)]).items() if g != "G003"},
    )
    dropped = load(tmp_path, path, go2, "mmap")
    assert len(store_dirs(tmp_path)) == 3
    assert "G003+ctrl" not in dropped.conditions and "G003+ctrl" in first.conditions
    # The input itself changes (same size and name, new content).
    adata = ad.read_h5ad(path)
    adata.X = adata.X * 0.5
    adata.write_h5ad(path)
    changed = load(tmp_path, path, go, "mmap")
    assert len(store_dirs(tmp_path)) == 4
    np.testing.assert_allclose(
        changed.condition_means(), 0.5 * first.condition_means(), rtol=1e-6, atol=1e-7
    )


def test_failed_build_leaves_no_store(tmp_path, screen_file, monkeypatch):
    path, go = screen_file

    def broken(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(stream, "stream_condition_stats", broken)
    with pytest.raises(KeyboardInterrupt):
        load(tmp_path, path, go, "mmap")
    root = tmp_path / "data" / "screen" / "store"
    assert list(root.iterdir()) == []  # neither a committed store nor a temp directory
    monkeypatch.undo()
    assert load(tmp_path, path, go, "mmap").store is not None


def test_store_mode_auto_and_errors(tmp_path, screen_file, monkeypatch):
    from gears.data import pertdata

    path, go = screen_file
    assert load(tmp_path, path, go, "auto").store is None  # small file: scanpy in memory
    # A dense matrix above the limit goes out of core even when the (sparse) file is small.
    monkeypatch.setattr(pertdata, "AUTO_STORE_BYTES", 900 * 60 * 4 - 1)
    assert path.stat().st_size < pertdata.AUTO_STORE_BYTES
    assert load(tmp_path, path, go, "auto").store is not None
    with pytest.raises(GearsInputError, match="data.store"):
        PertData(tmp_path, store="disk")
    adata = ad.read_h5ad(path)
    adata.X.data[5] = np.inf
    adata.write_h5ad(tmp_path / "bad.h5ad")
    with pytest.raises(GearsInputError, match="NaN or infinite"):
        load(tmp_path, tmp_path / "bad.h5ad", go, "mmap")


def test_npy_appender_round_trip(tmp_path):
    out = store.NpyAppender(tmp_path / "a.npy", np.float32, (3,))
    blocks = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones((5, 3), np.float32)]
    for b in blocks:
        out.append(b)
    out.close()
    stored = np.load(tmp_path / "a.npy", mmap_mode="r")
    np.testing.assert_array_equal(stored, np.concatenate(blocks))


@pytest.mark.slow
def test_persistent_workers_follow_the_epoch(tmp_path, screen_file):
    path, go = screen_file
    pd_ = load(tmp_path, path, go, "mmap")
    pd_.prepare_split("simulation", seed=1)
    inline = pd_.get_dataloader(8)["train_loader"]
    workers = pd_.get_dataloader(8, num_workers=1)["train_loader"]
    for epoch in (0, 1, 2):
        for loader in (inline, workers):
            loader.set_epoch(epoch)
        for a, b in zip(list(inline)[:3], list(workers)[:3], strict=True):
            assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert isinstance(EpochBatch(0, [1]), tuple)


# ------------------------------------------------------------------- two ranks share the store
RANK_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    from gears.data.loaders import ExpressionMatrix
    from gears.data.store import Store

    def private_kb():
        fields = dict(l.split(":", 1) for l in open("/proc/self/smaps_rollup") if ":" in l)
        return sum(int(fields[k].split()[0]) for k in ("Private_Clean", "Private_Dirty"))

    before = private_kb()
    expr = ExpressionMatrix.shared(Store(sys.argv[1]).matrix())
    total = 0.0
    for start in range(0, expr.shape[0], 512):  # every row gathered, as training batches are
        total += float(expr.rows(np.arange(start, min(start + 512, expr.shape[0]))).sum())
    print(before, private_kb(), total, flush=True)
    sys.stdin.readline()  # stay alive while the parent reads the other rank
""")


def mapping_kb(pid: int, name: str) -> dict[str, int]:
    """Pss / Private_* (kB) summed over the mappings of file `name` in /proc/PID/smaps."""
    out: dict[str, int] = {"Pss": 0, "Private_Clean": 0, "Private_Dirty": 0, "Rss": 0}
    inside = False
    for line in open(f"/proc/{pid}/smaps"):
        head = line.split()
        if head and "-" in head[0] and ":" not in head[0]:  # a mapping header line
            inside = line.rstrip().endswith(name)
        elif inside and head and head[0].rstrip(":") in out:
            out[head[0].rstrip(":")] += int(head[1])
    return out


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux /proc")
def test_two_ranks_share_one_copy_of_the_store(tmp_path):
    n_cells, n_genes = 12_000, 2_000  # 96 MB of float32
    writer = store.StoreWriter(tmp_path, "k", n_genes, "dense")
    rng = np.random.default_rng(0)
    for _ in range(n_cells // 1000):
        writer.append_rows(rng.random((1000, n_genes), dtype=np.float32))
    path = writer.commit({"x": np.zeros(1)}, {})
    matrix_kb = n_cells * n_genes * 4 // 1024
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    ranks, reports = [], []
    try:
        for _ in range(2):  # the second starts once the first has read every row
            proc = subprocess.Popen(
                [sys.executable, "-c", RANK_SCRIPT, str(path)],
                cwd=ROOT,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            ranks.append(proc)
            reports.append(proc.stdout.readline().split())
        time.sleep(0.2)
        smaps = [mapping_kb(p.pid, str(path / "X.npy")) for p in ranks]
    finally:
        for proc in ranks:
            proc.stdin.write("\n")
            proc.stdin.close()
            proc.wait(timeout=60)
    (before0, after0, total0), (before1, after1, total1) = reports
    assert float(total0) == float(total1) > 0
    # The first rank, alone, holds the matrix as its private (clean) pages on top of a fixed
    # overhead (torch's first ops, temporaries: ~16-24 MB, whatever the matrix size); the second
    # maps the same pages, so it grows by that overhead only, not by another copy. Compared rank
    # with rank, so the fixed overhead cancels instead of eating into a threshold.
    grew0, grew1 = int(after0) - int(before0), int(after1) - int(before1)
    assert grew0 > matrix_kb * 0.9, (reports, matrix_kb)
    assert grew1 < grew0 - matrix_kb // 2, (reports, matrix_kb)
    # The matrix counts once in the node: PSS splits the shared file pages between the ranks,
    # and neither rank holds a private page of it.
    for s in smaps:
        assert s["Rss"] > matrix_kb * 0.9, smaps
        assert abs(s["Pss"] - matrix_kb / 2) < matrix_kb * 0.1, smaps
        assert s["Private_Clean"] + s["Private_Dirty"] < matrix_kb * 0.05, smaps


def test_expression_stays_on_the_host_for_cpu_and_csr():
    from gears.data.loaders import ExpressionMatrix

    X = np.arange(12, dtype=np.float32).reshape(4, 3)
    dense, csr = ExpressionMatrix(X), ExpressionMatrix.shared(sp.csr_matrix(X))
    assert not dense.place(torch.device("cpu")) and not csr.place("cuda")
    assert dense.dense.device.type == "cpu"
    for expr in (dense, csr):
        np.testing.assert_array_equal(expr.rows(np.array([2, 0])).numpy(), X[[2, 0]])


def test_backed_detects_the_condition_column_and_refuses_counts(tmp_path, screen_file):
    path, go = screen_file
    adata = ad.read_h5ad(path)
    adata.obs = adata.obs.rename(columns={"condition": "perturbation"})
    adata.write_h5ad(tmp_path / "renamed.h5ad")
    memory = load(tmp_path, path, go, "memory")
    backed = load(tmp_path, tmp_path / "renamed.h5ad", go, "mmap")
    assert backed.condition_key == "perturbation" and backed.store is not None
    assert backed.conditions == memory.conditions
    assert backed.condition_spelling["ctrl"] == "control"
    # Log-normalised values with normalize=log1p: refused out of core as in memory.
    with pytest.raises(GearsInputError, match="expects raw counts"):
        PertData(tmp_path / "data", gene2go=go, store="mmap", verbose=False).load(
            data_path=path, normalize="log1p"
        )


# ---------------------------------------------------- raw counts out of core, as in memory
def counts_screen(n_cells: int = 700, n_genes: int = 60, seed: int = 1) -> ad.AnnData:
    """Raw UMI-like integer counts (max well above RAW_COUNT_MAX), one all-zero cell."""
    rng = np.random.default_rng(seed)
    adata = random_screen(n_cells=n_cells, n_genes=n_genes, n_conditions=10, seed=seed)
    rate = np.exp(2.0 * adata.X.toarray()) - 1  # log-like values back to a counts scale
    X = rng.poisson(rate * rng.uniform(0.5, 4.0, (n_cells, 1))).astype(np.float32)
    X[3] = 0  # a cell without counts: left as zeros, outside the median total
    adata.X = sp.csr_matrix(X)
    return adata


@pytest.fixture()
def counts_file(tmp_path) -> tuple[Path, Path]:
    adata = counts_screen()
    assert adata.X.max() > 100 and float(adata.X.sum(axis=1).min()) == 0
    path = tmp_path / "counts.h5ad"
    adata.write_h5ad(path)
    go = write_gene2go(tmp_path / "go.tsv", tiny_gene2go(list(adata.var_names)))
    return path, go


def test_backed_refuses_raw_counts_with_the_in_memory_message(tmp_path, counts_file):
    path, go = counts_file
    with pytest.raises(GearsInputError, match="looks like raw counts") as memory:
        load(tmp_path, path, go, "memory")
    with pytest.raises(GearsInputError, match="looks like raw counts") as backed:
        load(tmp_path, path, go, "mmap")
    assert str(backed.value) == str(memory.value)
    assert store_dirs(tmp_path) == []  # nothing half-built left behind


@pytest.mark.parametrize("layout", ["dense", "csr"])
def test_backed_normalises_counts_like_in_memory(tmp_path, counts_file, monkeypatch, layout):
    """data.normalize=log1p out of core: the same median target, the same normalised matrix
    (bit for bit), means, DE tables and report as scanpy's normalize_total + log1p in memory;
    the normalised store is not reused for the unnormalised file."""
    path, go = counts_file
    if layout == "csr":
        monkeypatch.setattr(store, "DENSE_STORE_LIMIT_BYTES", 0)

    def log1p(mode: str) -> PertData:
        return PertData(
            tmp_path / "data", gene2go=go, store=mode, verbose=False, chunk_cells=97
        ).load(data_path=path, normalize="log1p")

    memory, backed = log1p("memory"), log1p("mmap")
    assert backed.store is not None and backed.store.meta["layout"] == layout
    assert memory.normalize_target_sum > 0
    assert backed.normalize_target_sum == memory.normalize_target_sum
    assert backed.report["normalize"] == memory.report["normalize"]
    assert backed.conditions == memory.conditions
    rows = np.arange(700)
    np.testing.assert_array_equal(backed.expr.rows(rows).numpy(), memory.expr.rows(rows).numpy())
    assert float(backed.expr.rows(rows).max()) < 10  # log1p scale, not counts
    for name in ("cell_condition", "de_ranked_idx", "non_dropout_de_idx", "non_zero_mask"):
        np.testing.assert_array_equal(getattr(backed, name), getattr(memory, name), err_msg=name)
    np.testing.assert_allclose(backed.condition_means(), memory.condition_means(), atol=1e-6)
    with pytest.raises(GearsInputError, match="looks like raw counts"):
        load(tmp_path, path, go, "mmap")  # normalize=none: refused, not the log1p store
    # Already log-normalised values with normalize=log1p: the in-memory refusal, word for word.
    logged = tmp_path / "logged.h5ad"
    ad.AnnData(X=memory.expr.rows(rows).numpy(), obs=ad.read_h5ad(path).obs).write_h5ad(logged)
    errors = []
    for mode in ("memory", "mmap"):
        with pytest.raises(GearsInputError, match="expects raw counts") as err:
            PertData(tmp_path / "data", gene2go=go, store=mode, verbose=False).load(
                data_path=logged, normalize="log1p"
            )
        errors.append(str(err.value))
    assert errors[0] == errors[1]
