"""Condition spellings: names found in the wild mapped to GEARS's `ctrl`, `A+ctrl`, `A+B`."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import pandas as pd

from gears.errors import GearsInputError

CTRL = "ctrl"
# Spellings of "no perturbation" seen in public screens (compared case-insensitively).
CONTROL_SPELLINGS = frozenset(
    {"ctrl", "control", "non-targeting", "nontargeting", "non_targeting", "nt", "safe-targeting"}
)
# obs columns that name each cell's perturbation in public files, in the order they are tried
# (GEARS / scPerturb / Virtual Cell Challenge 2025 / Replogle / guide-level tables / Virtual
# Cell Challenge 2026).
CONDITION_KEY_CANDIDATES = (
    "condition",
    "perturbation",
    "target_gene",
    "gene",
    "guide_target",
    "target",
)


def detect_condition_key(columns: Iterable[str], condition_key: str | None = None) -> str:
    """The obs column naming each cell's perturbation: `condition_key` when given (it must
    exist), else the first of CONDITION_KEY_CANDIDATES present. Raises GearsInputError."""
    columns = [str(c) for c in columns]
    if condition_key is not None:
        if condition_key not in columns:
            raise GearsInputError(
                f"adata.obs has no column {condition_key!r} (data.condition_key); columns "
                f"present: {columns}"
            )
        return condition_key
    for candidate in CONDITION_KEY_CANDIDATES:
        if candidate in columns:
            return candidate
    raise GearsInputError(
        f"adata.obs has none of the usual perturbation columns {list(CONDITION_KEY_CANDIDATES)} "
        f"(columns present: {columns}); set data.condition_key to the column naming each "
        "cell's perturbation"
    )


def canonical_condition(name: str, sep: str = "+", control_names: Iterable[str] = ()) -> str:
    """One condition name -> `ctrl`, `A+ctrl` or `A+B` (the two genes sorted).

    Accepts `ctrl`/`control`/`non-targeting` (and `control_names`), `A`, `A+ctrl`, `ctrl+A`, `A+B`,
    with `sep` as the separator of the input. Raises GearsInputError for more than two genes or an
    empty gene name.
    """
    controls = CONTROL_SPELLINGS | {c.lower() for c in control_names}
    text = str(name).strip()
    if text.lower() in controls:
        return CTRL
    parts = [p.strip() for p in text.split(sep)]
    genes = [p for p in parts if p.lower() not in controls]
    if any(g == "" for g in genes) or not parts:
        raise GearsInputError(
            f"condition {name!r} has an empty gene name (separator {sep!r}); spell conditions "
            f"'ctrl', 'A', 'A{sep}ctrl' or 'A{sep}B', or relabel/drop those cells"
        )
    if not genes:
        return CTRL
    if len(genes) == 1:
        return f"{genes[0]}+{CTRL}"
    if len(genes) == 2:
        a, b = sorted(genes)
        if a == b:
            raise GearsInputError(
                f"condition {name!r} names the same gene twice; write a single perturbation "
                f"as '{a}' or '{a}+ctrl', or relabel/drop those cells"
            )
        return f"{a}+{b}"
    raise GearsInputError(
        f"condition {name!r} perturbs {len(genes)} genes; GEARS models single and double "
        "perturbations only (drop these cells or split them into a separate analysis)"
    )


def canonicalize_conditions(
    values: Sequence[str] | pd.Series, sep: str = "+", control_names: Iterable[str] = ()
) -> np.ndarray:
    """Vector `canonical_condition`: each distinct spelling is parsed once. -> [cells] str."""
    series = pd.Series(np.asarray(values, dtype=object)).astype(str)
    codes, uniques = pd.factorize(series)
    mapped = np.array(
        [canonical_condition(u, sep=sep, control_names=control_names) for u in uniques],
        dtype=object,
    )
    return mapped[codes]


def condition_genes(condition: str) -> list[str]:
    """Genes a canonical condition perturbs: `ctrl` -> [], `A+ctrl` -> [A], `A+B` -> [A, B]."""
    return [g for g in condition.split("+") if g != CTRL]


def is_single(condition: str) -> bool:
    return len(condition_genes(condition)) == 1


def is_double(condition: str) -> bool:
    return len(condition_genes(condition)) == 2


def genes_of(conditions: Iterable[str]) -> list[str]:
    """Sorted unique genes perturbed by any of `conditions`."""
    return sorted({g for c in conditions for g in condition_genes(c)})
