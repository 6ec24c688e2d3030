"""The perturbation vocabulary: the measured and perturbed genes the GO source knows (through
aliases), their GO sets, and what data.unmapped_perts does with the others."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gears.choices import CHOICES
from gears.data import graphs
from gears.data.conditions import condition_genes, genes_of
from gears.data.read import gene2go_source
from gears.errors import GearsInputError


@dataclass(frozen=True)
class GeneSources:
    """Where the vocabulary comes from: PertData's gene2go, gene_aliases and unmapped_perts
    (GEARS's gene2go_all.pkl, downloaded into data_dir from mirror_url, when gene2go is None)."""

    gene2go: str | Path | None
    aliases: str | Path | None
    unmapped_perts: str
    data_dir: Path
    mirror_url: str | None = None

    def go_file(self) -> Path:
        return gene2go_source(self.gene2go, self.data_dir, self.mirror_url)


@dataclass
class Vocabulary:
    """pert_names [P] (the GO graph's nodes, the model's perturbation rows), their index and GO
    sets, the report of renamed and dropped genes, and a deferred error (`unmatched`)."""

    pert_names: np.ndarray
    node_map_pert: dict[str, int]
    gene2go: dict[str, set[str]]
    report: dict
    # Gene names of another kind than the GO source's and the labels' (Ensembl ids beside
    # symbols, say): raised by refuse_unmatched once the value checks have had their say.
    unmatched: str | None = None


def resolve_unmapped_perts(unmapped_perts: str | None, keep_unmapped_perts: bool = False) -> str:
    """The unmapped-perturbation policy from the new key and its deprecated boolean alias."""
    if unmapped_perts is None:
        return "keep" if keep_unmapped_perts else "error"
    if unmapped_perts not in CHOICES["data.unmapped_perts"]:
        raise GearsInputError(
            f"unmapped_perts={unmapped_perts!r} is not one of {CHOICES['data.unmapped_perts']}; "
            "use 'error', 'drop' (as the original GEARS) or 'keep'"
        )
    if keep_unmapped_perts and unmapped_perts != "keep":
        if unmapped_perts == "drop":
            raise GearsInputError(
                "data.keep_unmapped_perts=true (deprecated: means unmapped_perts=keep) "
                "contradicts data.unmapped_perts=drop; remove data.keep_unmapped_perts"
            )
        return "keep"  # the deprecated alias beats the default
    return unmapped_perts


def refuse_unmatched(vocab: Vocabulary | None) -> None:
    """Raise the error resolve_vocabulary found: measured genes that match neither a perturbed
    gene nor the GO source (the data would train, wrongly, without a word)."""
    if vocab is not None and vocab.unmatched:
        raise GearsInputError(vocab.unmatched)


def resolve_vocabulary(
    conditions: list[str],
    measured: set[str],
    sources: GeneSources,
    control_like: dict[str, int],
    log: Callable[[str], None],
) -> Vocabulary:
    """Perturbation vocabulary = measured and perturbed genes known to the GO source."""
    source = sources.go_file()
    unmapped_perts = sources.unmapped_perts
    gene2go = graphs.read_gene2go(source)
    aliases = graphs.read_aliases(sources.aliases) if sources.aliases else None
    perturbed = genes_of(conditions)
    candidates = sorted(measured | set(perturbed))
    renames, missing = graphs.resolve_symbols(candidates, gene2go.keys(), aliases)
    missing = set(missing)
    unmatched = _unmatched_message(measured, perturbed, missing, source)
    _refuse_unknown(perturbed, missing, measured, source, unmapped_perts)
    dropped = (
        []
        if unmapped_perts == "keep"
        else [c for c in conditions if any(g in missing for g in condition_genes(c))]
    )
    vocab = [g for g in candidates if g not in missing]
    if unmapped_perts == "keep":
        vocab = sorted(set(vocab) | set(perturbed))
    report = {
        "renamed_genes": {g: renames[g] for g in perturbed if g in renames},
        "dropped_conditions": dropped,
        "perturbed_genes_without_go": sorted(set(perturbed) & missing),
    }
    if control_like:
        report["control_like_genes"] = dict(control_like)
    _log_vocabulary(report, dropped, log)
    return Vocabulary(
        pert_names=np.array(vocab),
        node_map_pert={g: i for i, g in enumerate(vocab)},
        gene2go={g: set(gene2go.get(renames.get(g, g), ())) for g in vocab},
        report=report,
        unmatched=unmatched,
    )


def _unmatched_message(
    measured: set[str], perturbed: list[str], missing: set[str], source: Path
) -> str | None:
    if measured and not (set(measured) - missing) and not set(measured) & set(perturbed):
        # Training would run with no GO edge on any measured gene and no perturbed gene
        # measured.
        return (
            f"none of the {len(measured)} measured gene names (e.g. {sorted(measured)[:3]}) "
            f"is a perturbed gene (e.g. {perturbed[:3]}) or in the GO source {source}: the "
            "gene names are likely another kind of identifier. Put gene symbols in "
            "adata.var['gene_name'] (or var_names), or pass a matching data.gene2go / "
            "data.gene_aliases"
        )
    return None


def _refuse_unknown(
    perturbed: list[str], missing: set[str], measured: set[str], source: Path, policy: str
) -> None:
    unknown = sorted(g for g in perturbed if g in missing and g not in measured)
    if unknown and policy == "error":
        more = f" (and {len(unknown) - 20} more)" if len(unknown) > 20 else ""
        raise GearsInputError(
            f"{len(unknown)} perturbed gene(s) are neither measured genes nor in the GO "
            f"source {source} (even through aliases): {unknown[:20]}{more}. "
            "Check their spelling or pass gene_aliases=..., then choose "
            "data.unmapped_perts (PertData(unmapped_perts=...)): 'error' (this message), "
            "'drop' (remove their conditions, as the original GEARS) or 'keep' (keep them "
            "without GO edges)"
        )


def _log_vocabulary(report: dict, dropped: list[str], log: Callable[[str], None]) -> None:
    if report["renamed_genes"]:
        log(
            f"renamed {len(report['renamed_genes'])} perturbed gene(s) to match the "
            f"GO source: {report['renamed_genes']}"
        )
    if dropped:
        log(
            f"dropped {len(dropped)} condition(s) whose genes have no GO annotation "
            f"(GEARS cannot place them in the GO graph): {dropped[:10]}"
            f"{' ...' if len(dropped) > 10 else ''}"
        )


def cond_pert_index(conditions: list[str], node_map_pert: dict[str, int]) -> np.ndarray:
    """[conditions, 2] int64: each condition's perturbed genes as rows of pert_names, -1 pads."""
    index = np.full((len(conditions), 2), -1, dtype=np.int64)
    for c, name in enumerate(conditions):
        for slot, gene in enumerate(condition_genes(name)):
            index[c, slot] = node_map_pert[gene]
    return index
