"""Tests for gears.data.splits: GEARS split semantics rebuilt from first principles."""

from __future__ import annotations

import inspect
import json
import os
import pickle
import random
import subprocess
import sys
from pathlib import Path

import pytest

from gears.data.splits import (
    SIMULATION_SUBGROUPS,
    SPLIT_TYPES,
    Split,
    load_split_dict,
    make_split,
    split_key,
)
from gears.errors import GearsInputError

GENES = [f"G{i:02d}" for i in range(30)]
# Neighbours (i, i+1) and (i, i+5) for i < 20: 40 distinct doubles, no wrap-around.
DOUBLES = sorted({f"{GENES[i]}+{GENES[i + d]}" for d in (1, 5) for i in range(20)})
SINGLES = [f"{g}+ctrl" for g in GENES]
CONDITIONS = ["ctrl", *SINGLES, *DOUBLES]
RANDOM_TYPES = [t for t in SPLIT_TYPES if t not in ("no_split", "custom")]
ROOT = Path(__file__).resolve().parents[1]


def genes(condition: str) -> set[str]:
    return {g for g in condition.split("+") if g != "ctrl"}


def singles_of(conds) -> list[str]:
    return [c for c in conds if c.endswith("+ctrl")]


def doubles_of(conds) -> list[str]:
    return [c for c in conds if c != "ctrl" and not c.endswith("+ctrl")]


def single_genes(conds) -> set[str]:
    return {next(iter(genes(c))) for c in singles_of(conds)}


def n_in(condition: str, gene_set: set[str]) -> int:
    return len(genes(condition) & gene_set)


def assert_partition(split: Split, conditions) -> None:
    parts = [split.train, split.val, split.test, split.held_out]
    for part in parts:
        assert part == sorted(set(part)), "lists are sorted and free of duplicates"
    total = sum(len(p) for p in parts)
    union = set().union(*map(set, parts))
    assert total == len(union), "train, val, test and held_out are disjoint"
    assert union == set(conditions), "every condition is in exactly one list"


def test_fixture_shape():
    assert len(DOUBLES) == 40 and len(SINGLES) == 30
    assert all(a < b for a, b in (d.split("+") for d in DOUBLES))


@pytest.mark.parametrize("split_type", RANDOM_TYPES + ["no_split"])
def test_every_type_partitions_the_conditions(split_type):
    split = make_split(CONDITIONS, split_type)
    assert split.split_type == split_type
    assert_partition(split, CONDITIONS)
    if split_type == "no_split":
        assert split.test == sorted(CONDITIONS) and split.train == split.val == []
    else:
        assert "ctrl" in split.train and "ctrl" not in split.val + split.test
        assert split.val and any(c != "ctrl" for c in split.train)
        assert bool(split.test) == (split_type != "no_test")


def test_simulation_subgroups_from_first_principles():
    split = make_split(CONDITIONS, "simulation", seed=3)
    test_groups, val_groups = split.subgroups["test"], split.subgroups["val"]
    assert tuple(test_groups) == SIMULATION_SUBGROUPS == tuple(val_groups)

    # Stage 1: int(30 * 0.75) = 22 genes are seen; their singles are in train or val.
    seen = single_genes(split.train + split.val)
    assert len(seen) == 22
    assert test_groups["unseen_single"] == sorted(f"{g}+ctrl" for g in set(GENES) - seen)
    assert len(test_groups["unseen_single"]) == 8
    for name, count in (("combo_seen0", 0), ("combo_seen1", 1), ("combo_seen2", 2)):
        assert all(n_in(d, seen) == count for d in test_groups[name]), name
    assert split.test == sorted(c for g in test_groups.values() for c in g)
    # Doubles with fewer than two seen genes all go to test; of the both-seen doubles,
    # int(n * 0.75) are trained on (train + val) and the rest are combo_seen2.
    assert sorted(test_groups["combo_seen0"] + test_groups["combo_seen1"]) == sorted(
        d for d in DOUBLES if n_in(d, seen) < 2
    )
    both_seen = [d for d in DOUBLES if n_in(d, seen) == 2]
    trained_doubles = doubles_of(split.train + split.val)
    assert set(trained_doubles) | set(test_groups["combo_seen2"]) == set(both_seen)
    assert len(trained_doubles) == int(len(both_seen) * 0.75)

    # Stage 2 on the training part: int(22 * 0.9) = 19 genes stay seen in train.
    train_seen = single_genes(split.train)
    assert len(train_seen) == 19 and train_seen < seen
    assert val_groups["unseen_single"] == singles_of(split.val)
    assert len(val_groups["unseen_single"]) == 3
    for name, count in (("combo_seen0", 0), ("combo_seen1", 1), ("combo_seen2", 2)):
        assert all(n_in(d, train_seen) == count for d in val_groups[name]), name
    assert split.val == sorted(c for g in val_groups.values() for c in g)
    assert all(n_in(d, train_seen) == 2 for d in doubles_of(split.train))
    stage2_both = [d for d in trained_doubles if n_in(d, train_seen) == 2]
    assert len(doubles_of(split.train)) == int(len(stage2_both) * 0.9)
    assert split.held_out == []


def test_simulation_fractions_and_fixed_unseen_genes():
    split = make_split(CONDITIONS, "simulation", train_gene_set_size=0.5, combo_seen2_train_frac=1)
    assert len(single_genes(split.train + split.val)) == 15
    assert split.subgroups["test"]["combo_seen2"] == []  # all both-seen doubles trained on

    forced = ["G00", "G07", "G13"]
    split = make_split(CONDITIONS, "simulation", test_pert_genes=forced)
    seen = single_genes(split.train + split.val)
    assert len(seen) == 22 and not seen & set(forced)
    # GEARS passes these genes as test_perts; condition spellings are accepted too.
    alt = make_split(CONDITIONS, "simulation", test_perts=["G00", "G07+ctrl", "G13"])
    assert alt == split

    only = make_split(CONDITIONS, "simulation", test_pert_genes=forced, only_test_set_perts=True)
    assert only.subgroups["test"]["unseen_single"] == ["G00+ctrl", "G07+ctrl", "G13+ctrl"]
    assert single_genes(only.train + only.val) == set(GENES) - set(forced)


def test_simulation_single_holds_out_doubles():
    split = make_split(CONDITIONS, "simulation_single")
    assert_partition(split, CONDITIONS)
    assert split.held_out == DOUBLES
    assert split.subgroups == {
        "test": {"unseen_single": split.test},
        "val": {"unseen_single": split.val},
    }
    assert (len(split.train), len(split.val), len(split.test)) == (19 + 1, 3, 8)
    assert not single_genes(split.train) & single_genes(split.val + split.test)


# For each type: which doubles go to test and which are dropped, by their number of test genes.
HOLDOUT_RULES = {
    "combo_seen0": ({2}, {1}),
    "combo_seen1": ({1}, {2}),
    "single": (set(), {1, 2}),
}


def expected_stage(conds, chosen, split_type):
    """(held, dropped, kept) for one carve, computed straight from GEARS's definitions."""
    to_test, to_drop = HOLDOUT_RULES[split_type]
    held = [s for s in singles_of(conds) if genes(s) <= chosen]
    held += [d for d in doubles_of(conds) if n_in(d, chosen) in to_test]
    dropped = [d for d in doubles_of(conds) if n_in(d, chosen) in to_drop]
    kept = [c for c in conds if c not in held and c not in dropped]
    return sorted(held), sorted(dropped), kept


@pytest.mark.parametrize("split_type", list(HOLDOUT_RULES))
@pytest.mark.parametrize("seed", [1, 2, 7])
def test_gene_holdout_splits_rebuilt_from_their_genes(split_type, seed):
    split = make_split(CONDITIONS, split_type, seed=seed)
    test_genes = single_genes(split.test)
    val_genes = single_genes(split.val)
    # int(30 singles * 0.1) = 3 distinct test genes, then int(27 * 0.1) = 2 validation genes.
    assert len(test_genes) == 3 and len(val_genes) == 2
    perts = [c for c in CONDITIONS if c != "ctrl"]
    test, dropped1, kept = expected_stage(perts, test_genes, split_type)
    val, dropped2, train = expected_stage(kept, val_genes, split_type)
    assert split.test == test and split.val == val
    assert split.held_out == sorted(dropped1 + dropped2)
    assert split.train == sorted([*train, "ctrl"])
    # No train double touches a held-out gene: nothing leaks.
    assert not any(genes(d) & (test_genes | val_genes) for d in doubles_of(split.train))


def test_combo_splits_with_fixed_test_genes_hand_computed():
    fixed = ["G00", "G01", "G02", "G05", "G06"]
    both = ["G00+G01", "G00+G05", "G01+G02", "G01+G06", "G05+G06"]
    one = ["G02+G03", "G02+G07", "G04+G05", "G05+G10", "G06+G07", "G06+G11"]
    fixed_singles = [f"{g}+ctrl" for g in fixed]
    seen0 = make_split(CONDITIONS, "combo_seen0", test_pert_genes=fixed)
    assert seen0.test == sorted(fixed_singles + both)
    assert set(one) <= set(seen0.held_out)
    seen1 = make_split(CONDITIONS, "combo_seen1", test_pert_genes=fixed)
    assert seen1.test == sorted(fixed_singles + one)
    assert set(both) <= set(seen1.held_out)
    single = make_split(CONDITIONS, "single", test_pert_genes=fixed)
    assert single.test == fixed_singles
    assert set(both + one) <= set(single.held_out)


def test_combo_seen2_and_no_test_counts():
    split = make_split(CONDITIONS, "combo_seen2")
    # int(40 * 0.1) = 4 test doubles, int(36 * 0.1) = 3 validation doubles, nothing dropped.
    assert len(split.test) == 4 and len(split.val) == 3 and split.held_out == []
    assert doubles_of(split.test) == split.test and doubles_of(split.val) == split.val
    assert singles_of(split.train) == SINGLES
    chosen = ["G03+G04", "G10+G15"]
    fixed = make_split(CONDITIONS, "combo_seen2", test_perts=["G04+G03", "G10+G15"])
    assert fixed.test == chosen

    no_test = make_split(CONDITIONS, "no_test", val_size=0.2)
    assert no_test.test == [] and len(no_test.val) == 8 == len(doubles_of(no_test.val))
    # Singles-only data: validation comes from the singles instead of being empty.
    singles_only = make_split(["ctrl", *SINGLES], "no_test")
    assert len(singles_only.val) == 3 and singles_of(singles_only.val) == singles_only.val


def test_larger_test_size_is_respected():
    split = make_split(CONDITIONS, "single", test_size=0.2, val_size=0.25)
    assert len(split.test) == 6  # int(30 * 0.2)
    assert len(split.val) == 6  # int(24 * 0.25)


@pytest.mark.parametrize("split_type", ["single", "combo_seen0", "combo_seen1", "combo_seen2"])
def test_samples_are_drawn_without_replacement(split_type):
    # GEARS drew test genes with replacement: 3 draws from 30 repeat a gene ~10% of the time.
    for seed in range(60):
        split = make_split(CONDITIONS, split_type, seed=seed)
        if split_type == "combo_seen2":
            assert len(split.test) == 4
        else:
            assert len(singles_of(split.test)) == 3 and len(singles_of(split.val)) == 2


@pytest.mark.parametrize("split_type", RANDOM_TYPES)
def test_deterministic_and_order_independent(split_type):
    reference = make_split(CONDITIONS, split_type, seed=5)
    assert make_split(CONDITIONS, split_type, seed=5) == reference
    shuffled = list(CONDITIONS) * 2  # duplicates are ignored too
    random.Random(0).shuffle(shuffled)
    assert make_split(shuffled, split_type, seed=5) == reference
    assert make_split(CONDITIONS, split_type, seed=6) != reference


def test_same_split_in_another_process_with_other_hash_seed():
    code = (
        "import json, sys; from gears.data.splits import make_split; "
        "conds = json.loads(sys.argv[1]); "
        "types = json.loads(sys.argv[2]); "
        "print(json.dumps([make_split(conds, t, seed=4).to_dict() for t in types]))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(ROOT)}
    shuffled = list(CONDITIONS)
    random.Random(1).shuffle(shuffled)
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(shuffled), json.dumps(RANDOM_TYPES)],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    here = [make_split(CONDITIONS, t, seed=4).to_dict() for t in RANDOM_TYPES]
    assert json.loads(out.stdout) == here


def test_too_few_perturbations_say_what_is_needed():
    with pytest.raises(GearsInputError, match=r"at least 2 perturbed genes.*has 1 perturbed genes"):
        make_split(["ctrl", "A+ctrl"], "simulation")
    # Two genes: one seen, one unseen; then the validation stage has a single gene left.
    with pytest.raises(GearsInputError, match=r"validation stage.*at least 2 perturbed genes"):
        make_split(["ctrl", "A+ctrl", "B+ctrl"], "simulation")
    five = ["ctrl", "A+ctrl", "B+ctrl", "C+ctrl", "D+ctrl", "E+ctrl"]
    with pytest.raises(GearsInputError, match=r"at least 10 single perturbations.*5 single"):
        make_split(five, "single")
    with pytest.raises(GearsInputError, match=r"at least 10 doubles.*5 double perturbations"):
        make_split(["ctrl", "A+B", "A+C", "A+D", "B+C", "B+D"], "combo_seen2")
    with pytest.raises(GearsInputError, match=r"left the training set empty"):
        make_split(["ctrl", *SINGLES], "single", test_pert_genes=GENES)
    # Doubles only, and simulation_single drops them: no singles to split.
    with pytest.raises(GearsInputError, match=r"0 single and 0 double"):
        make_split(["ctrl", *DOUBLES], "simulation_single")


def test_unknown_split_type_lists_all_types():
    with pytest.raises(GearsInputError) as info:
        make_split(CONDITIONS, "combo")
    assert all(t in str(info.value) for t in SPLIT_TYPES)


@pytest.mark.parametrize(
    ("conditions", "kwargs", "pattern"),
    [
        (["ctrl", "B+A"], {}, "not canonical"),
        (["ctrl", "ctrl+A"], {}, "not canonical"),
        (SINGLES, {}, "no 'ctrl'"),
        (CONDITIONS, {"test_perts": "G00_G01"}, "not one string"),
        (CONDITIONS, {"split_type": "combo_seen2", "test_pert_genes": ["G00"]}, "test_perts"),
        (CONDITIONS, {"split_type": "single", "test_pert_genes": ["NOPE"]}, "NOPE"),
        (CONDITIONS, {"split_type": "combo_seen2", "test_perts": ["G00+ctrl"]}, "only doubles"),
        (CONDITIONS, {"split_type": "custom"}, "split_dict"),
        (CONDITIONS, {"split_dict": {"train": []}}, "split_dict"),
        (CONDITIONS, {"only_test_set_perts": True}, "needs test_pert_genes"),
        (CONDITIONS, {"test_size": 0}, "test_size"),
        (CONDITIONS, {"seed": 1.5}, "seed"),
    ],
)
def test_bad_arguments_are_rejected(conditions, kwargs, pattern):
    with pytest.raises(GearsInputError, match=pattern):
        make_split(conditions, **kwargs)


def test_custom_split():
    split_dict = {
        "train": ["G01+G00", "G02+ctrl"],  # reversed spelling is canonicalised
        "val": ["G03+ctrl"],
        "test": ["ctrl", "G04+ctrl", "G04+G05"],  # ctrl is moved to train
    }
    split = make_split(CONDITIONS, "custom", split_dict=split_dict)
    assert split.train == ["G00+G01", "G02+ctrl", "ctrl"]
    assert split.val == ["G03+ctrl"] and split.test == ["G04+G05", "G04+ctrl"]
    assert_partition(split, CONDITIONS)
    assert len(split.held_out) == len(CONDITIONS) - 6
    with pytest.raises(GearsInputError, match=r"both 'train' and 'test'"):
        make_split(CONDITIONS, "custom", split_dict={"train": ["G00+ctrl"], "test": ["G00+ctrl"]})
    with pytest.raises(GearsInputError, match="at least one perturbation in 'train'"):
        make_split(CONDITIONS, "custom", split_dict={"train": ["ctrl"], "test": ["G00+ctrl"]})


def test_load_split_dict(tmp_path):
    content = {"train": ["G01+G00", "G02+ctrl"], "val": ["G03+ctrl"], "test": ["G04+ctrl"]}
    expected = {"train": ["G00+G01", "G02+ctrl"], "val": ["G03+ctrl"], "test": ["G04+ctrl"]}
    (tmp_path / "s.json").write_text(json.dumps(content))
    (tmp_path / "s.pkl").write_bytes(pickle.dumps(content))
    assert load_split_dict(tmp_path / "s.json", CONDITIONS) == expected
    assert load_split_dict(str(tmp_path / "s.pkl"), CONDITIONS) == expected
    (tmp_path / "t.json").write_text(json.dumps({"train": ["G00+ctrl"]}))
    assert load_split_dict(tmp_path / "t.json", CONDITIONS) == {
        "train": ["G00+ctrl"],
        "val": [],
        "test": [],
    }


@pytest.mark.parametrize(
    ("content", "pattern"),
    [
        (["G00+ctrl"], "must be a dict"),
        ({"val": ["G00+ctrl"]}, "without a train key"),
        ({"train": "G00+ctrl"}, "must be a list"),
        ({"train": ["G00+ctrl", 3]}, "only strings"),
        ({"train": ["G00+ctrl"], "valid": []}, "unknown keys"),
        ({"train": ["G00"]}, "not conditions"),
        ({"train": ["G00+ctrl"], "val": ["ctrl+G00"]}, "both 'train' and 'val'"),
        ({"train": ["G00+ctrl", "ZZZ+ctrl", "G00+YYY"]}, r"2 conditions.*'G00\+YYY', 'ZZZ\+ctrl'"),
    ],
)
def test_load_split_dict_rejects_malformed_content(tmp_path, content, pattern):
    path = tmp_path / "split.json"
    path.write_text(json.dumps(content))
    with pytest.raises(GearsInputError, match=pattern):
        load_split_dict(path, CONDITIONS)


def test_load_split_dict_file_errors(tmp_path):
    with pytest.raises(GearsInputError, match="does not exist"):
        load_split_dict(tmp_path / "missing.json", CONDITIONS)
    (tmp_path / "junk.json").write_bytes(b"\x00not json{")
    with pytest.raises(GearsInputError, match="neither JSON nor a pickle"):
        load_split_dict(tmp_path / "junk.json", CONDITIONS)


def test_split_key_covers_every_parameter():
    base = split_key(CONDITIONS)
    assert len(base) == 16 and int(base, 16) >= 0
    shuffled = list(reversed(CONDITIONS))
    assert split_key(shuffled, split_type="simulation", seed=1, test_size=0.1) == base
    changed = {
        "split_type": "single",
        "seed": 2,
        "train_gene_set_size": 0.7,
        "combo_seen2_train_frac": 0.5,
        "test_size": 0.2,
        "val_size": 0.2,
        "test_perts": ["G00+ctrl"],
        "test_pert_genes": ["G00"],
        "only_test_set_perts": True,
        "split_dict": {"train": ["G00+ctrl"]},
    }
    params = set(inspect.signature(make_split).parameters) - {"conditions"}
    assert set(changed) == params, "every make_split parameter must be exercised here"
    keys = {name: split_key(CONDITIONS, **{name: value}) for name, value in changed.items()}
    assert len(set(keys.values()) | {base}) == len(changed) + 1
    assert split_key(CONDITIONS[:-1]) != base
    assert split_key(CONDITIONS, test_pert_genes=["G01", "G00"]) == split_key(
        CONDITIONS, test_pert_genes=["G00", "G01"]
    )
    with pytest.raises(GearsInputError, match="unknown parameters"):
        split_key(CONDITIONS, split="simulation")


def test_round_trip_and_summary():
    split = make_split(CONDITIONS, "simulation")
    again = Split.from_dict(json.loads(json.dumps(split.to_dict())))
    assert again == split
    single = make_split(CONDITIONS, "single")
    assert Split.from_dict(single.to_dict()) == single
    with pytest.raises(GearsInputError, match="split_type"):
        Split.from_dict({"split_type": "nope", "train": []})
    with pytest.raises(GearsInputError, match="train"):
        Split.from_dict({"split_type": "single", "train": "ctrl"})

    lines = split.summary().splitlines()
    test_row = next(line for line in lines if line.startswith("test "))
    n_single, n_double = len(singles_of(split.test)), len(doubles_of(split.test))
    assert test_row.split()[1:] == ["0", str(n_single), str(n_double), str(len(split.test))]
    seen1_row = next(line for line in lines if "test/combo_seen1" in line)
    assert seen1_row.split()[-1] == str(len(split.subgroups["test"]["combo_seen1"]))


def test_simulation_split_on_real_norman_conditions(shared_data):
    import anndata

    adata = anndata.read_h5ad(shared_data / "perturbench_devel.h5ad", backed="r")
    raw = adata.obs.loc[adata.obs["dataset"] == "norman19", "condition"].unique()
    adata.file.close()
    conds = [
        "ctrl"
        if c == "control"
        else f"{c}+ctrl"
        if "+" not in c
        else "+".join(sorted(c.split("+")))
        for c in raw
    ]
    assert len(singles_of(conds)) == 18 and len(doubles_of(conds)) == 15
    split = make_split(conds, "simulation", seed=1)
    assert_partition(split, conds)
    # Some Norman genes are perturbed only in doubles, so the seen set is not fully visible;
    # every gene in train + val is seen, which bounds each subgroup's count from above.
    trained = {g for c in split.train + split.val for g in genes(c)}
    test_groups = split.subgroups["test"]
    assert not single_genes(test_groups["unseen_single"]) & trained
    for name, most in (("combo_seen0", 0), ("combo_seen1", 1)):
        assert all(n_in(d, trained) <= most for d in test_groups[name]), name
