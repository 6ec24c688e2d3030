"""Tests for gears/data/loaders.py: batch contents, control pairing, distributed sharding,
grouped batches, and dense versus CSR expression."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from helpers import tiny_gene2go, tiny_screen, write_gene2go

from gears.data.loaders import (
    Batch,
    ExampleSet,
    ExpressionMatrix,
    GroupedBatchSampler,
    eval_loader,
    pairing_hash,
    train_loader,
)
from gears.data.pertdata import PertData
from gears.errors import GearsInputError

N_CTRL = 36  # train = 36 ctrl + 3 x 12 perturbed cells = 72 examples, divisible by 1..4
SPLIT = {"train": ["G00+ctrl", "G01+ctrl", "G02+ctrl"], "val": ["G03+ctrl"], "test": ["G00+G03"]}


@pytest.fixture(scope="module")
def pdata(tmp_path_factory) -> PertData:
    """The hand-made screen with a fixed custom split: train 72, val 12, test 12 examples."""
    folder = tmp_path_factory.mktemp("loaders")
    go = write_gene2go(folder / "gene2go.tsv", tiny_gene2go())
    p = PertData(folder, gene2go=go, verbose=False)
    p.new_data_process("tiny", tiny_screen(n_ctrl=N_CTRL), write=False)
    (folder / "split.json").write_text(json.dumps(SPLIT))
    return p.prepare_split("custom", seed=7, split_dict_path=folder / "split.json")


def X_of(p: PertData) -> np.ndarray:
    return np.asarray(p.adata.X, dtype=np.float32)


def subset(p: PertData, n: int, seed: int = 7, expr: ExpressionMatrix | None = None) -> ExampleSet:
    """An ExampleSet of the first n training cells (ctrl and perturbed cells interleaved)."""
    rows, cond = p.set_rows("train")
    order = np.argsort(rows % 7, kind="stable")[:n]  # mixes conditions into the first n
    return ExampleSet(
        expr or p.expr,
        rows[order],
        cond[order],
        p.ctrl_rows,
        p.ctrl_id,
        p.cond_pert_index,
        p.de_idx,
        seed=seed,
    )


def epoch_batches(loader, epoch: int) -> list[Batch]:
    loader.set_epoch(epoch)
    return list(loader)


def examples(batch: Batch) -> list[int]:
    return batch.example.tolist()


# ------------------------------------------------------------------------------ batch contents
def test_batch_shapes_dtypes_and_tables(pdata):
    loaders = pdata.get_dataloader(8, test_batch_size=5)
    assert set(loaders) == {"train_loader", "val_loader", "test_loader"}
    assert len(loaders["train_loader"]) == 72 // 8
    assert len(loaders["val_loader"]) == 3  # 12 examples in batches of 5, the last one short
    X = X_of(pdata)
    ds = loaders["train_loader"].dataset
    for batch in loaders["train_loader"]:
        B, G = len(batch), pdata.n_genes
        assert B == 8
        assert batch.x.shape == (B, G) and batch.y.shape == (B, G)
        assert batch.x.dtype == batch.y.dtype == torch.float32
        assert batch.pert_index.shape == (B, 2) and batch.pert_index.dtype == torch.long
        assert batch.cond.shape == (B,) and batch.cond.dtype == torch.long
        assert batch.de_idx.shape == (B, 20) and batch.de_idx.dtype == torch.long
        assert batch.inverse.dtype == batch.uniq_cond.dtype == torch.long
        # uniq_* / inverse / counts describe the batch's distinct conditions.
        assert batch.uniq_cond.tolist() == sorted(set(batch.cond.tolist()))
        assert torch.equal(batch.uniq_cond[batch.inverse], batch.cond)
        assert batch.counts.tolist() == np.bincount(batch.inverse.numpy()).tolist()
        assert batch.counts.sum().item() == B
        assert torch.equal(
            batch.uniq_pert_index, torch.from_numpy(pdata.cond_pert_index)[batch.uniq_cond]
        )
        # Per-example tables come from the condition; y is the example's own cell.
        cond = batch.cond.numpy()
        np.testing.assert_array_equal(batch.pert_index.numpy(), pdata.cond_pert_index[cond])
        np.testing.assert_array_equal(batch.de_idx.numpy(), pdata.de_idx[cond])
        rows = ds.rows[batch.example.numpy()]
        np.testing.assert_array_equal(cond, pdata.cell_condition[rows])
        np.testing.assert_array_equal(batch.y.numpy(), X[rows])
    ctrl = batch.cond == pdata.ctrl_id
    assert (batch.pert_index[ctrl] == -1).all() and (batch.de_idx[ctrl] == -1).all()
    moved = batch.to("cpu")
    assert torch.equal(moved.x, batch.x) and torch.equal(moved.counts, batch.counts)


def test_x_is_a_paired_control_cell(pdata):
    X = X_of(pdata)
    raw = np.asarray(pdata.adata.obs["condition"])
    ctrl_profiles = {
        r.tobytes(): i for i, r in zip(np.flatnonzero(raw == "ctrl"), X[raw == "ctrl"])
    }
    loader = pdata.get_dataloader(12)["train_loader"]
    seen_ctrl, seen_pert = 0, 0
    for epoch in (0, 1):
        for batch in epoch_batches(loader, epoch):
            is_ctrl = (batch.cond == pdata.ctrl_id).numpy()
            x, y = batch.x.numpy(), batch.y.numpy()
            assert all(row.tobytes() in ctrl_profiles for row in x)
            np.testing.assert_array_equal(x[is_ctrl], y[is_ctrl])  # control examples: x == y
            paired = loader.dataset.control_rows(batch.example.numpy(), epoch=epoch)
            np.testing.assert_array_equal(x, X[paired])
            assert np.isin(paired, pdata.ctrl_rows).all()
            seen_ctrl += is_ctrl.sum()
            seen_pert += (~is_ctrl).sum()
    assert seen_ctrl > 0 and seen_pert > 0


def test_pairing_is_deterministic_and_changes_with_epoch(pdata):
    a, b = pdata.example_set("train"), pdata.example_set("train")
    ex = np.arange(len(a))
    perturbed = ~a.is_ctrl
    for epoch in (0, 1, 5):
        np.testing.assert_array_equal(a.control_rows(ex, epoch), b.control_rows(ex, epoch))
        # Shuffled order, same draw per example.
        perm = np.random.default_rng(epoch).permutation(ex)
        np.testing.assert_array_equal(a.control_rows(perm, epoch), a.control_rows(ex, epoch)[perm])
    changed = a.control_rows(ex, 0) != a.control_rows(ex, 1)
    assert changed[perturbed].mean() > 0.8  # 1/36 chance each of repeating
    assert not changed[~perturbed].any()  # control examples always use their own cell
    other_seed = pdata.example_set("train", seed=8)
    assert (other_seed.control_rows(ex, 0) != a.control_rows(ex, 0))[perturbed].mean() > 0.8
    # The default epoch is the one set last.
    a.set_epoch(5)
    np.testing.assert_array_equal(a.control_rows(ex), b.control_rows(ex, 5))


def test_pairing_draws_spread_evenly():
    n_ctrl = 36
    across_examples = np.bincount(pairing_hash(3, 0, np.arange(36_000)) % np.uint64(n_ctrl))
    across_epochs = np.bincount(
        [int(pairing_hash(3, e, np.array([5]))[0] % np.uint64(n_ctrl)) for e in range(3600)],
        minlength=n_ctrl,
    )
    for counts, expected in ((across_examples, 1000), (across_epochs, 100)):
        assert counts.shape == (n_ctrl,)
        assert counts.min() > 0.6 * expected and counts.max() < 1.4 * expected


def test_loader_batches_reproducible_and_epoch_dependent(pdata):
    first = pdata.get_dataloader(8)["train_loader"]
    second = pdata.get_dataloader(8)["train_loader"]
    e0, e0_again = epoch_batches(first, 0), epoch_batches(second, 0)
    for b1, b2 in zip(e0, e0_again):
        assert torch.equal(b1.example, b2.example) and torch.equal(b1.x, b2.x)
    e1 = epoch_batches(first, 1)
    order0 = [i for b in e0 for i in examples(b)]
    order1 = [i for b in e1 for i in examples(b)]
    assert sorted(order0) == sorted(order1) == list(range(72))
    assert order0 != order1  # set_epoch reshuffles


def test_worker_processes_see_the_epoch(pdata):
    ds = pdata.example_set("train")
    inline = train_loader(ds, 8, seed=7)
    workers = train_loader(pdata.example_set("train"), 8, seed=7, num_workers=1)
    for b1, b2 in zip(epoch_batches(inline, 3), epoch_batches(workers, 3)):
        assert torch.equal(b1.example, b2.example) and torch.equal(b1.x, b2.x)


# ----------------------------------------------------------------------------------- sharding
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_training_shards_cover_every_example_once(pdata, world):
    n = len(pdata.example_set("train"))
    assert n == 72
    for epoch in (0, 1):
        seen = []
        for rank in range(world):
            loader = pdata.get_dataloader_distributed(2, world_size=world, rank=rank)
            seen += [i for b in epoch_batches(loader["train_loader"], epoch) for i in examples(b)]
        assert sorted(seen) == list(range(n)), (world, epoch)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_training_shards_drop_the_remainder_without_duplicates(pdata, world):
    """No padding duplicates: each rank takes n // world examples, none twice in an epoch, and
    the fewer than `world` examples left out change from epoch to epoch."""
    n = 25
    left_out = []
    for epoch in (2, 3, 4, 5):
        shards = []
        for rank in range(world):
            loader = train_loader(subset(pdata, n), 1, seed=7, world_size=world, rank=rank)
            loader.set_epoch(epoch)
            shards.append(list(loader.batch_sampler.sampler))  # the rank's indices for the epoch
        assert [len(s) for s in shards] == [n // world] * world
        seen = [i for s in shards for i in s]
        assert len(set(seen)) == len(seen)  # no example twice
        assert set(seen) <= set(range(n)) and n - len(seen) == n % world
        left_out.append(frozenset(set(range(n)) - set(seen)))
    if n % world:
        assert len(set(left_out)) > 1


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rank_batches_union_is_the_single_process_batch(pdata, world):
    b = 2
    single = train_loader(pdata.example_set("train"), world * b, seed=7)
    ranks = [
        pdata.get_dataloader_distributed(b, world_size=world, rank=r)["train_loader"]
        for r in range(world)
    ]
    assert all(len(r) == len(single) for r in ranks)
    for epoch in (0, 4):
        ref = epoch_batches(single, epoch)
        per_rank = [epoch_batches(r, epoch) for r in ranks]
        assert len(ref) == 72 // (world * b)
        for step, batch in enumerate(ref):
            parts = [pr[step] for pr in per_rank]
            assert all(len(p) == b for p in parts)
            union = torch.cat([p.example for p in parts])
            assert sorted(union.tolist()) == sorted(examples(batch)), (epoch, step)
            # The same example gets the same control cell whatever the world size.
            by_example = {e: row for p in parts for e, row in zip(examples(p), p.x)}
            for e, row in zip(examples(batch), batch.x):
                assert torch.equal(by_example[e], row)


@pytest.mark.parametrize("n, world, b", [(25, 3, 2), (24, 4, 3), (10, 4, 1), (11, 4, 1)])
def test_rank_step_count_matches_single_process(pdata, n, world, b):
    """N ranks with batch b take as many steps as 1 process with batch N*b, and every step
    matches, so the two runs make the same updates (DESIGN.md section 4)."""
    single = train_loader(subset(pdata, n), world * b, seed=7)
    ranks = [
        train_loader(subset(pdata, n), b, seed=7, world_size=world, rank=r) for r in range(world)
    ]
    ref = epoch_batches(single, 1)
    per_rank = [epoch_batches(r, 1) for r in ranks]
    assert [len(r) for r in per_rank] == [len(ref)] * world == [n // (world * b)] * world
    for step, batch in enumerate(ref):
        union = [i for r in per_rank for i in examples(r[step])]
        assert sorted(union) == sorted(examples(batch))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_eval_shards_cover_every_example_exactly_once(pdata, world):
    for n in (12, 25):
        ds = pdata.example_set("val") if n == 12 else subset(pdata, n)
        seen, xs = [], {}
        for rank in range(world):
            if n == 12:
                loader = pdata.get_dataloader_distributed(4, 5, world_size=world, rank=rank)[
                    "val_loader"
                ]
            else:
                loader = eval_loader(ds, 5, world_size=world, rank=rank)
            for batch in epoch_batches(loader, 3):
                seen += examples(batch)
                xs.update({e: row for e, row in zip(examples(batch), batch.x)})
        assert seen == list(range(n)), (world, n)  # in order, no padding duplicates
        expected_x = ds.expr.rows(ds.control_rows(np.arange(n), epoch=3))
        assert torch.equal(torch.stack([xs[e] for e in range(n)]), expected_x)


# ------------------------------------------------------------------------------ grouped batches
def grouped_cond(seed: int = 0) -> np.ndarray:
    """6 conditions x 8 examples, positions shuffled: [48] condition ids."""
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(6), 8))


def test_grouped_batches_are_k_conditions_of_m_cells():
    cond = grouped_cond()
    sampler = GroupedBatchSampler(cond, cells_per_group=4, groups_per_batch=2, seed=5)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 48 // 8
    for batch in batches:
        assert len(batch) == 8
        for group in (batch[:4], batch[4:]):
            assert len(set(cond[group])) == 1  # a group's cells share their condition
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(48))  # every group once, no repetition
    sampler.set_epoch(1)
    other = list(sampler)
    assert other != batches and sorted(i for b in other for i in b) == list(range(48))
    sampler.set_epoch(0)
    assert list(sampler) == batches


def test_grouped_uneven_condition_sizes():
    cond = np.repeat(np.arange(3), [5, 9, 3])  # groups of 4: 2 + 3 + 1 = 6 groups
    sampler = GroupedBatchSampler(cond, cells_per_group=4, groups_per_batch=2, seed=1)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 3
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(17))
    sizes = sorted(Counter(cond[flat]).values())
    assert sizes == [3, 5, 9]


def _single_and_ranks(cond, m: int, k: int, world: int, seed: int, epoch: int):
    """One process's sampler (K * world groups a step) and the world ranks' (K each) at `epoch`;
    checks that the ranks' step-k batches together are the single process's step-k batch and
    that no example repeats. -> (single sampler, its batches)"""
    single = GroupedBatchSampler(cond, m, k * world, seed=seed)
    ranks = [
        GroupedBatchSampler(cond, m, k, seed=seed, world_size=world, rank=r) for r in range(world)
    ]
    for sampler in (single, *ranks):
        sampler.set_epoch(epoch)
    ref = list(single)
    per_rank = [list(r) for r in ranks]
    assert all(len(p) == len(ref) == len(r) for p, r in zip(per_rank, ranks))
    for step, batch in enumerate(ref):
        assert [i for p in per_rank for i in p[step]] == batch  # rank order = group order
    seen = [i for p in per_rank for b in p for i in b]
    assert len(seen) == len(set(seen))
    return single, ref


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_grouped_rank_union_is_the_single_process_batch(world):
    cond = grouped_cond(1)  # 12 groups of 4
    for epoch in (0, 2):
        single, ref = _single_and_ranks(cond, 4, 1, world, seed=9, epoch=epoch)
        assert len(ref) == 12 // world == len(single)


def uneven_cond(seed: int = 3) -> np.ndarray:
    """30 conditions of 5-40 examples, positions shuffled (remainder groups of 1-3 cells)."""
    rng = np.random.default_rng(seed)
    return rng.permutation(np.repeat(np.arange(30), rng.integers(5, 41, 30)))


@pytest.mark.parametrize("world", [1, 2])
def test_grouped_steps_hold_groups_of_one_size(world):
    """A condition's remainder group (< M cells) shares its step with groups of its own size,
    so a batch's conditions carry equal cell counts; only the leftovers of each size (fewer
    than a step) mix, in at most (number of sizes - 1) steps. Every example at most once, the
    ranks' batches together are the single process's, and len() counts the steps."""
    cond = uneven_cond()
    m, k = 4, 3
    for epoch in (0, 1):
        single, ref = _single_and_ranks(cond, m, k, world, seed=2, epoch=epoch)
        _, _, group_size, steps = single._steps()
        steps = [group_size[step] for step in steps]  # each step's group sizes
        sizes = {int(z) for step in steps for z in step}
        assert sizes == {1, 2, 3, 4}  # the data has remainders of every size
        mixed = [step for step in steps if len(set(step)) > 1]
        assert len(mixed) <= len(sizes) - 1
        assert len(steps) == len(single) == sum(-(-np.bincount(cond) // m)) // (k * world)
        # Uniform steps: every condition in the batch has the same number of cells (or a
        # multiple, when two groups of one condition meet).
        uniform = 0
        for step, batch in zip(steps, ref):
            if len(set(step)) == 1:
                counts = np.bincount(cond[batch])
                counts = counts[counts > 0]
                assert (counts % step[0] == 0).all()
                uniform += 1
        assert uniform >= len(ref) - (len(sizes) - 1)


def test_grouped_loader_through_pertdata(pdata):
    loaders = pdata.get_dataloader_distributed(8, batching="grouped", cells_per_group=4)
    loader = loaders["train_loader"]
    batches = epoch_batches(loader, 0)
    assert len(batches) == len(loader) == 72 // 8  # 9 ctrl groups + 3 x 3 perturbed groups
    for batch in batches:
        cond = batch.cond.reshape(2, 4)
        assert (cond == cond[:, :1]).all()
        assert batch.uniq_cond.numel() <= 2
    with pytest.raises(GearsInputError, match="multiple"):
        pdata.get_dataloader_distributed(6, batching="grouped", cells_per_group=4)


# ------------------------------------------------------------------------- expression storage
def test_expression_matrix_dense_and_csr_agree(pdata):
    X = X_of(pdata).copy()
    X[X < 1.1] = 0.0  # make it genuinely sparse
    as_dense = ExpressionMatrix(sp.csr_matrix(X))
    as_csr = ExpressionMatrix(sp.csr_matrix(X), dense_limit_bytes=0)
    assert as_dense.dense is not None and as_csr.dense is None
    assert as_dense.shape == as_csr.shape == X.shape
    assert sp.issparse(as_csr.numpy()) and isinstance(as_dense.numpy(), np.ndarray)
    idx = np.array([5, 0, 5, len(X) - 1, 17])
    for m in (as_dense, as_csr):
        rows = m.rows(idx)
        assert rows.dtype == torch.float32 and rows.shape == (5, X.shape[1])
        np.testing.assert_array_equal(rows.numpy(), X[idx])
    np.testing.assert_array_equal(as_csr.numpy().toarray(), as_dense.numpy())
    # A dense input stays dense whatever the limit.
    assert ExpressionMatrix(X, dense_limit_bytes=0).dense is not None

    a = train_loader(subset(pdata, 40, expr=as_dense), 8, seed=7)
    b = train_loader(subset(pdata, 40, expr=as_csr), 8, seed=7)
    for b1, b2 in zip(epoch_batches(a, 1), epoch_batches(b, 1)):
        assert torch.equal(b1.x, b2.x) and torch.equal(b1.y, b2.y)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_block_shuffle_covers_each_example_once_and_reads_blocks(pdata, world):
    """batching=block: every example at most once per epoch across ranks (fewer than `world`
    left out), the ranks' orders interleave into the single-process order, and the order walks
    blocks of consecutive examples."""
    from gears.data.loaders import BlockShuffleSampler

    n, block = 103, 10
    single = BlockShuffleSampler(n, block, seed=3)
    single.set_epoch(1)
    order = single.order()
    assert sorted(order.tolist()) == list(range(n))
    # Each run of `block` positions (after the short last block lands) stays inside one block.
    assert len({int(i) // block for i in order[:block]}) == 1
    shards = []
    for rank in range(world):
        s = BlockShuffleSampler(n, block, seed=3, world_size=world, rank=rank)
        s.set_epoch(1)
        shards.append(list(s))
    assert all(len(x) == n // world for x in shards)
    seen = [i for x in shards for i in x]
    assert len(seen) == len(set(seen)) and n - len(seen) == n % world
    usable = order[: n - n % world]
    for rank in range(world):
        assert shards[rank] == usable[rank::world].tolist()
    other = BlockShuffleSampler(n, block, seed=3)
    other.set_epoch(2)
    assert other.order().tolist() != order.tolist()


def test_block_batching_loader(pdata):
    loaders = pdata.get_dataloader_distributed(8, batching="block", block_size=16)
    batch = next(iter(loaders["train_loader"]))
    assert batch.x.shape[0] == 8
