"""Tests for gears/data/conditions.py: every accepted spelling, the errors, the vector version."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from gears.data.conditions import (
    canonical_condition,
    canonicalize_conditions,
    condition_genes,
    genes_of,
    is_double,
    is_single,
)
from gears.errors import GearsInputError


@pytest.mark.parametrize(
    "raw",
    [
        "ctrl",
        "control",
        "non-targeting",
        "CTRL",
        "Control",
        "NON-TARGETING",
        "Non-Targeting",
        "nontargeting",
        "non_targeting",
        "NT",
        "safe-targeting",
        "  control  ",
        "ctrl+ctrl",
    ],
)
def test_control_spellings_map_to_ctrl(raw):
    assert canonical_condition(raw) == "ctrl"


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("KLF1", "KLF1+ctrl"),
        ("KLF1+ctrl", "KLF1+ctrl"),
        ("ctrl+KLF1", "KLF1+ctrl"),
        ("KLF1+CTRL", "KLF1+ctrl"),
        ("Control+KLF1", "KLF1+ctrl"),
        ("non-targeting+KLF1", "KLF1+ctrl"),
        (" KLF1 + ctrl ", "KLF1+ctrl"),
        ("KLF1+SET", "KLF1+SET"),
        ("SET+KLF1", "KLF1+SET"),
        ("SET+KLF1+ctrl", "KLF1+SET"),
        # Python str order: upper case sorts before lower case, digits before letters.
        ("abc+ABC", "ABC+abc"),
        ("MAP2K6+MAP2K3", "MAP2K3+MAP2K6"),
    ],
)
def test_perturbation_spellings(raw, expected):
    assert canonical_condition(raw) == expected


def test_gene_symbol_case_is_kept():
    # Only the control word is case-insensitive; gene symbols keep their case.
    assert canonical_condition("Klf1") == "Klf1+ctrl"
    assert canonical_condition("klf1+Set") == "Set+klf1"


def test_double_is_sorted_and_idempotent():
    for a, b in [("B", "A"), ("A", "B"), ("ZNF1", "AAA2"), ("G10", "G9")]:
        expected = f"{min(a, b)}+{max(a, b)}"
        assert canonical_condition(f"{a}+{b}") == expected
        assert canonical_condition(expected) == expected


def test_custom_separator():
    assert canonical_condition("B_A", sep="_") == "A+B"
    assert canonical_condition("A_ctrl", sep="_") == "A+ctrl"
    assert canonical_condition("ctrl_A", sep="_") == "A+ctrl"
    assert canonical_condition("A", sep="_") == "A+ctrl"
    assert canonical_condition("non_targeting", sep="_") == "ctrl"
    assert canonical_condition("control", sep="_") == "ctrl"


def test_custom_control_names():
    assert canonical_condition("NegCtrl0", control_names=("negctrl0",)) == "ctrl"
    assert canonical_condition("negctrl0+KLF1", control_names=("NegCtrl0",)) == "KLF1+ctrl"
    # Without the custom name it is read as a gene.
    assert canonical_condition("NegCtrl0") == "NegCtrl0+ctrl"
    # The built-in spellings still work alongside custom ones.
    assert canonical_condition("control", control_names=("NegCtrl0",)) == "ctrl"


@pytest.mark.parametrize("raw", ["A+B+C", "C+B+A", "A+B+C+ctrl", "A_B_C"])
def test_three_genes_rejected(raw):
    sep = "_" if "_" in raw else "+"
    with pytest.raises(GearsInputError, match="3 genes"):
        canonical_condition(raw, sep=sep)


@pytest.mark.parametrize("raw", ["A+A", "KLF1+KLF1"])
def test_same_gene_twice_rejected(raw):
    with pytest.raises(GearsInputError, match="same gene twice"):
        canonical_condition(raw)


@pytest.mark.parametrize("raw", ["", "  ", "A+", "+A", "A++B", "ctrl+", "A+ +B"])
def test_empty_gene_name_rejected(raw):
    with pytest.raises(GearsInputError, match="empty gene name"):
        canonical_condition(raw)


def test_errors_are_value_errors_naming_the_condition():
    with pytest.raises(ValueError, match=r"'X\+Y\+Z'"):
        canonical_condition("X+Y+Z")


def test_canonicalize_conditions_over_series():
    raw = pd.Series(
        ["control", "B+A", "A", "ctrl+A", "A+ctrl", "control", "C", "A+B"],
        index=[f"cell{i}" for i in [7, 3, 1, 0, 2, 5, 4, 6]],  # index order must not matter
    )
    out = canonicalize_conditions(raw)
    assert isinstance(out, np.ndarray)
    assert out.shape == (8,)
    assert out.tolist() == ["ctrl", "A+B", "A+ctrl", "A+ctrl", "A+ctrl", "ctrl", "C+ctrl", "A+B"]
    # Element-wise identical to the scalar version.
    assert out.tolist() == [canonical_condition(v) for v in raw]


def test_canonicalize_conditions_categorical_list_and_options():
    cat = pd.Series(pd.Categorical(["b_a", "NT", "a", "b_a"]))
    assert canonicalize_conditions(cat, sep="_").tolist() == ["a+b", "ctrl", "a+ctrl", "a+b"]
    assert canonicalize_conditions(["x", "neg"], control_names=["NEG"]).tolist() == [
        "x+ctrl",
        "ctrl",
    ]
    assert canonicalize_conditions([]).shape == (0,)


def test_canonicalize_conditions_raises_on_any_bad_value():
    with pytest.raises(GearsInputError, match="A\\+B\\+C"):
        canonicalize_conditions(["ctrl", "A", "A+B+C"])


def test_condition_helpers():
    assert condition_genes("ctrl") == []
    assert condition_genes("A+ctrl") == ["A"]
    assert condition_genes("A+B") == ["A", "B"]
    assert is_single("A+ctrl") and not is_single("A+B") and not is_single("ctrl")
    assert is_double("A+B") and not is_double("A+ctrl") and not is_double("ctrl")
    assert genes_of(["ctrl", "C+ctrl", "A+C", "B+ctrl"]) == ["A", "B", "C"]
