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


def control_like_genes(gene_names: Iterable[str], control_names: Iterable[str] = ()) -> set[str]:
    """Measured genes spelled like a control label (the human gene CTRL, mouse Ctrl): a label
    spelled exactly as one of them means that gene, not the control, unless `control_names`
    (data.control_names) lists that exact spelling."""
    given = {str(c) for c in control_names}
    controls = CONTROL_SPELLINGS | {c.lower() for c in given}
    return {str(g) for g in gene_names if str(g).lower() in controls and str(g) not in given}


def canonical_condition(
    name: str, sep: str = "+", control_names: Iterable[str] = (), genes: Iterable[str] = ()
) -> str:
    """One condition name -> `ctrl`, `A+ctrl` or `A+B` (the two genes sorted).

    Accepts `ctrl`/`control`/`non-targeting` (and `control_names`), `A`, `A+ctrl`, `ctrl+A`, `A+B`,
    with `sep` as the separator of the input; surrounding whitespace is dropped. `genes`: exact
    spellings that name a gene although they look like a control (control_like_genes). Raises
    GearsInputError for more than two genes or an empty gene name.
    """
    controls = CONTROL_SPELLINGS | {c.lower() for c in control_names}
    named_genes = set(genes)

    def is_control(part: str) -> bool:
        return part.lower() in controls and part not in named_genes

    text = str(name).strip()
    if is_control(text):
        return CTRL
    parts = [p.strip() for p in text.split(sep)]
    genes = [p for p in parts if not is_control(p)]
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
    values: Sequence[str] | pd.Series,
    sep: str = "+",
    control_names: Iterable[str] = (),
    genes: Iterable[str] = (),
) -> np.ndarray:
    """Vector `canonical_condition`: each distinct spelling is parsed once. -> [cells] str."""
    series = pd.Series(np.asarray(values, dtype=object)).astype(str)
    codes, uniques = pd.factorize(series)
    genes = set(genes)
    mapped = np.array(
        [canonical_condition(u, sep, control_names, genes) for u in uniques], dtype=object
    )
    return mapped[codes]


def refuse_joined_gene_names(
    values: Sequence[str] | pd.Series, measured: Iterable[str], sep: str = "+"
) -> None:
    """A GearsInputError when a condition label names a measured gene whose own name holds the
    separator (e.g. 'HLA+A'): GEARS joins the two genes of a double with it, and would read
    the label as a double (or triple) of the name's halves."""
    joined = [g for g in map(str, measured) if sep in g]
    if not joined:
        return
    labels = pd.unique(pd.Series(np.asarray(values, dtype=object)).astype(str).str.strip())
    for label in labels:
        padded = f"{sep}{label}{sep}"
        hits = [g for g in joined if f"{sep}{g}{sep}" in padded]
        if hits:
            parts = [p.strip() for p in label.split(sep)]
            raise GearsInputError(
                f"measured gene {hits[0]!r} contains {sep!r}, which GEARS uses to join the two "
                f"genes of a double: condition {label!r} would be read as the genes {parts}; "
                f"rename the gene without {sep!r} (e.g. {hits[0].replace(sep, '_')!r}) in "
                "var_names, in the condition labels and in the GO source"
            )


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


def label_conditions(
    values: Sequence[str] | pd.Series,
    gene_names: Iterable[str],
    sep: str = "+",
    control_names: Iterable[str] = (),
) -> tuple[np.ndarray, set[str]]:
    """Each cell's label -> its canonical condition [cells], and the measured genes spelled
    like a control (control_like_genes), whose labels were read as those genes."""
    gene_names = list(gene_names)
    gene_spellings = control_like_genes(gene_names, control_names)
    refuse_joined_gene_names(values, gene_names, sep)
    return canonicalize_conditions(values, sep, control_names, gene_spellings), gene_spellings


def control_like_cells(gene_spellings: set[str], conditions) -> dict[str, int]:
    """Per gene spelled like a control, the cells whose condition perturbs it."""
    found = {}
    if gene_spellings:
        counts = pd.Series(np.asarray(conditions, dtype=object)).value_counts()
        for gene in sorted(gene_spellings):
            n = int(sum(k for c, k in counts.items() if gene in condition_genes(str(c))))
            if n:
                found[gene] = n
    return found


def condition_spelling(raw: pd.Series, conditions: np.ndarray) -> dict[str, str]:
    """Per canonical condition, the first label spelled for it as written (less surrounding
    blanks): predictions are written with the input's own spelling."""
    return raw.groupby(conditions, sort=False).first().to_dict()


def control_like_note(control_like: dict[str, int]) -> str:
    """The line that says labels spelled like a control were read as a measured gene."""
    return (
        f"labels spelled like a control but naming a measured gene were read as "
        f"perturbations of that gene (cells: {control_like}); if they are control "
        "cells, add that exact spelling to data.control_names"
    )
