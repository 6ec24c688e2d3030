"""Train/validation/test splits of perturbation conditions: GEARS's split types, seeded and exact.

A split assigns every condition of a dataset (``ctrl``, ``A+ctrl``, ``A+B`` with A < B) to exactly
one of train, val and test, or lists it in ``held_out`` when a split type drops it to keep a
held-out gene from leaking into training. The semantics follow GEARS (``DataSplitter`` in
``gears/data_utils.py`` and ``PertData.prepare_split``), with these differences, all deliberate:

- Randomness comes from one local ``np.random.default_rng(seed)``, never the global numpy seed,
  and inputs are sorted first, so the same condition set and seed give the same split on every
  machine and process whatever order the conditions arrive in.
- Test (and validation) genes and perturbations are sampled without replacement. GEARS drew them
  with replacement in ``get_split_list``, so its combo and single splits held out fewer genes
  than ``test_size`` asked for.
- ``combo_seen1`` holds out (drops) the doubles whose two genes are both test genes. GEARS's
  hold-out test there could never fire, so its combo_seen1 test set also held seen0 doubles.
- ``simulation_single`` works: doubles are listed in ``held_out`` (GEARS crashed on them and on
  unpacking its return value) and it has ``unseen_single`` subgroups for test and val.
- ``no_test`` draws its validation set from the doubles as GEARS does, but from the singles when
  the data has no doubles (GEARS left val empty there and training failed on a missing 'val').
  Its fraction is ``val_size`` (GEARS used ``test_size``; both default to 0.1).
- The simulation validation stage uses ``1 - val_size`` for both of its fractions, which is
  GEARS's hard-coded 0.9 at the default ``val_size=0.1``.
- Every failure is a ``GearsInputError`` that says what the split needs and what the data has.

As in GEARS, validation is carved out of the training part after the test set is fixed. In the
simulation splits, "seen" therefore means seen in train + val: the second stage can turn the seen
gene of a test combo_seen1 double into a validation gene.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from gears.choices import SPLIT_TYPES
from gears.data.graphs import _PlainUnpickler
from gears.errors import GearsInputError
from gears.io import atomic_write

SIMULATION_SUBGROUPS = ("combo_seen0", "combo_seen1", "combo_seen2", "unseen_single")
_SET_NAMES = ("train", "val", "test")
# Bump when the assignment algorithm changes, so cached splits made by older code are not reused.
_ALGORITHM_VERSION = 1
# Split types whose held-out part is defined by genes; the others hold out perturbations.
_GENE_TYPES = ("simulation", "simulation_single", "single", "combo_seen0", "combo_seen1")


@dataclass
class Split:
    """One split of a dataset's conditions. Lists are sorted; the four lists are disjoint.

    ``subgroups`` is ``{'test': {name: [...]}, 'val': {name: [...]}}`` with the names in
    ``SIMULATION_SUBGROUPS`` for ``simulation``, only ``unseen_single`` for
    ``simulation_single``, and ``{}`` for the other types. ``held_out`` lists the conditions a
    combo or single split dropped (they are in no set) so that nothing vanishes silently.
    """

    split_type: str
    train: list[str]
    val: list[str]
    test: list[str]
    subgroups: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    held_out: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """A printable table of ctrl / single / double counts per set, subgroup and hold-out."""
        rows = [(name, getattr(self, name)) for name in _SET_NAMES]
        for set_name, groups in self.subgroups.items():
            rows += [(f"  {set_name}/{name}", conds) for name, conds in groups.items()]
        rows.append(("held_out", self.held_out))
        width = max(len(name) for name, _ in rows)
        lines = [f"split '{self.split_type}'", f"{'':<{width}}  ctrl  singles  doubles  total"]
        for name, conds in rows:
            n_ctrl = sum(c == "ctrl" for c in conds)
            n_single = sum(_arity(c) == 1 for c in conds)
            n_double = len(conds) - n_ctrl - n_single
            lines.append(
                f"{name:<{width}}  {n_ctrl:>4}  {n_single:>7}  {n_double:>7}  {len(conds):>5}"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """A JSON-able copy: ``{'split_type', 'train', 'val', 'test', 'subgroups', 'held_out'}``."""
        return {
            "split_type": self.split_type,
            **{name: list(getattr(self, name)) for name in _SET_NAMES},
            "subgroups": {s: {k: list(v) for k, v in g.items()} for s, g in self.subgroups.items()},
            "held_out": list(self.held_out),
        }

    @classmethod
    def from_dict(cls, d: dict) -> Split:
        """Rebuild a split written by ``to_dict`` (e.g. from a cache file); checks its shape."""
        if not isinstance(d, dict) or d.get("split_type") not in SPLIT_TYPES:
            raise GearsInputError(
                "a stored split must be a dict made by Split.to_dict with 'split_type' one of "
                f"{', '.join(SPLIT_TYPES)}; delete the cached split file to rebuild it"
            )
        lists = {}
        for name in (*_SET_NAMES, "held_out"):
            lists[name] = _string_list(d.get(name, []), f"stored split entry '{name}'")
        subgroups = d.get("subgroups", {})
        if not isinstance(subgroups, dict) or not all(
            isinstance(g, dict) for g in subgroups.values()
        ):
            raise GearsInputError("stored split entry 'subgroups' must map set names to dicts")
        subgroups = {
            s: {k: _string_list(v, f"stored subgroup {s}/{k}") for k, v in g.items()}
            for s, g in subgroups.items()
        }
        return cls(split_type=d["split_type"], subgroups=subgroups, **lists)


class _Stage(NamedTuple):
    """One carve of a perturbation list: what stays, what is held out, what is dropped."""

    kept: list[str]
    held: list[str]
    subgroups: dict[str, list[str]]
    dropped: list[str]


def make_split(
    conditions: Sequence[str],
    split_type: str = "simulation",
    *,
    seed: int = 1,
    train_gene_set_size: float = 0.75,
    combo_seen2_train_frac: float = 0.75,
    test_size: float = 0.1,
    val_size: float = 0.1,
    test_perts: Sequence[str] | None = None,
    test_pert_genes: Sequence[str] | None = None,
    only_test_set_perts: bool = False,
    split_dict: dict | None = None,
) -> Split:
    """Split the conditions of a dataset into train / val / test the way GEARS does.

    ``conditions`` holds every condition in the data, ``ctrl`` included, in canonical spelling.
    ``ctrl`` always goes to train (test for ``no_split``). What each type puts in test:

    - ``simulation``: ``int(n_genes * train_gene_set_size)`` perturbed genes are sampled as seen.
      Test = singles of unseen genes (``unseen_single``) + doubles with no seen gene
      (``combo_seen0``) + doubles with one seen gene (``combo_seen1``) + the doubles with both
      genes seen that were not among the ``combo_seen2_train_frac`` sampled for training
      (``combo_seen2``). Train = seen singles + those sampled doubles. Val is carved out of train
      the same way with both fractions ``1 - val_size``, and has the same subgroups.
    - ``simulation_single``: the same for singles only: test = ``unseen_single``; every double is
      listed in ``held_out``.
    - ``combo_seen0``: ``int(n_singles * test_size)`` test genes are sampled. Test = their singles
      + doubles with both genes among them; doubles with exactly one test gene are held out.
    - ``combo_seen1``: test = singles of the test genes + doubles with exactly one test gene;
      doubles with two test genes are held out.
    - ``combo_seen2``: test = ``int(n_doubles * test_size)`` sampled doubles (or ``test_perts``);
      nothing is held out.
    - ``single``: test = singles of the test genes; every double with a test gene is held out.
    - ``no_test``: no test set; val = ``int(n_doubles * val_size)`` sampled doubles (singles when
      the data has no doubles) or ``test_perts``.
    - ``no_split``: every condition, ``ctrl`` included, in test; train and val empty.
    - ``custom``: the sets of ``split_dict`` (see ``load_split_dict``); conditions it does not
      list are held out.

    For the four combo/single types val is carved out of train by the same procedure with
    ``val_size``, and its hold-outs are dropped too. ``test_pert_genes`` (and the genes of
    ``test_perts``) fix the unseen/test genes of the gene-based types; with
    ``only_test_set_perts`` a simulation split makes exactly those genes unseen. Raises
    ``GearsInputError`` for unknown types, bad arguments, and data too small for the split.
    """
    if split_type not in SPLIT_TYPES:
        raise GearsInputError(
            f"unknown split type {split_type!r}; choose one of {', '.join(SPLIT_TYPES)}"
        )
    conds = _check_conditions(conditions, need_ctrl=split_type != "no_split")
    _check_options(
        split_type, seed, train_gene_set_size, combo_seen2_train_frac, test_size, val_size,
        test_perts, test_pert_genes, only_test_set_perts, split_dict,
    )  # fmt: skip
    perts = [c for c in conds if c != "ctrl"]

    if split_type == "no_split":
        return Split(split_type, train=[], val=[], test=conds)
    if split_type == "custom":
        sets = _validate_split_dict(split_dict, conds, source="split_dict")
        train = sorted(set(sets["train"]) | {"ctrl"})
        val = [c for c in sets["val"] if c != "ctrl"]
        test = [c for c in sets["test"] if c != "ctrl"]
        listed = set(train) | set(val) | set(test)
        if not any(c != "ctrl" for c in train):
            raise GearsInputError(
                "split 'custom' needs at least one perturbation in 'train'; split_dict lists "
                f"{len(listed) - 1} of the data's {len(perts)} perturbations, none in train"
            )
        return Split(split_type, train, val, test, held_out=[c for c in conds if c not in listed])

    rng = np.random.default_rng(seed)
    fixed_genes, fixed_perts = _fixed_test_set(split_type, perts, test_perts, test_pert_genes)
    subgroups: dict[str, dict[str, list[str]]] = {}
    if split_type in ("simulation", "simulation_single"):
        with_doubles = split_type == "simulation"
        first = _simulation_stage(
            perts, rng, train_gene_set_size, combo_seen2_train_frac, split_type=split_type,
            role="test", forced=fixed_genes, only_forced=only_test_set_perts,
            with_doubles=with_doubles,
        )  # fmt: skip
        second = _simulation_stage(
            first.kept, rng, 1 - val_size, 1 - val_size, split_type=split_type,
            role="validation", with_doubles=with_doubles,
        )  # fmt: skip
        subgroups = {"test": first.subgroups, "val": second.subgroups}
    elif split_type == "no_test":
        first = _Stage(perts, [], {}, [])
        second = _holdout_stage(
            perts, rng, split_type, val_size, role="validation", given=fixed_perts
        )
    else:
        given = fixed_perts if split_type == "combo_seen2" else fixed_genes
        first = _holdout_stage(perts, rng, split_type, test_size, role="test", given=given)
        second = _holdout_stage(first.kept, rng, split_type, val_size, role="validation")
    return Split(
        split_type,
        train=sorted([*second.kept, "ctrl"]),
        val=sorted(second.held),
        test=sorted(first.held),
        subgroups=subgroups,
        held_out=sorted([*first.dropped, *second.dropped]),
    )


def load_split_dict(path: str | Path, conditions: Sequence[str]) -> dict[str, list[str]]:
    """Read a custom split ``{'train': [...], 'val': [...], 'test': [...]}`` from JSON or pickle.

    'val' and 'test' may be missing (empty). Doubles may be spelled in either gene order and are
    returned canonical and sorted. Raises ``GearsInputError`` for a missing or unreadable file,
    malformed content, a condition listed in two sets, or conditions absent from ``conditions``.
    Only load pickles you trust: unpickling can run code.
    """
    path = Path(path)
    if not path.is_file():
        raise GearsInputError(
            f"custom split file {path} does not exist; write a JSON file "
            "{'train': [...], 'val': [...], 'test': [...]} of condition names there"
        )
    raw = path.read_bytes()
    readers = [_read_json, _read_pickle]
    if path.suffix.lower() in (".pkl", ".pickle"):
        readers.reverse()
    content, errors = None, []
    for reader in readers:
        try:
            content = reader(raw)
            break
        except Exception as exc:  # any parse failure means "try the other format"
            errors.append(f"{reader.__name__[6:]}: {exc}")
    else:
        raise GearsInputError(
            f"custom split file {path} is neither JSON nor a pickle ({'; '.join(errors)}); "
            'write it as JSON: {"train": [...], "val": [...], "test": [...]}'
        )
    conds = _check_conditions(conditions, need_ctrl=False)
    return _validate_split_dict(content, conds, source=f"custom split file {path}")


def split_key(conditions: Sequence[str], **params: Any) -> str:
    """A stable 16-hex-digit sha1 of the condition set and every ``make_split`` parameter.

    Parameters left out take ``make_split``'s defaults, so explicit defaults give the same key;
    condition order and the order inside ``test_perts`` / ``test_pert_genes`` do not matter.
    Use it to name cached split files.
    """
    signature = inspect.signature(make_split).parameters
    defaults = {name: p.default for name, p in signature.items() if name != "conditions"}
    unknown = sorted(set(params) - set(defaults))
    if unknown:
        raise GearsInputError(
            f"split_key got unknown parameters {unknown}; make_split takes {sorted(defaults)}"
        )
    merged = {**defaults, **params}
    for name in ("train_gene_set_size", "combo_seen2_train_frac", "test_size", "val_size"):
        merged[name] = float(merged[name])
    merged["seed"] = int(merged["seed"])
    merged["split_type"] = str(merged["split_type"])
    merged["only_test_set_perts"] = bool(merged["only_test_set_perts"])
    for name in ("test_perts", "test_pert_genes"):
        if merged[name] is not None:
            merged[name] = sorted({str(x) for x in merged[name]})
    if merged["split_dict"] is not None:
        merged["split_dict"] = {
            str(k): sorted({_canonical(str(c)) or str(c) for c in v})
            for k, v in merged["split_dict"].items()
        }
    payload = {
        "version": _ALGORITHM_VERSION,
        "conditions": sorted({str(c) for c in conditions}),
        "params": merged,
    }
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def cached_split(conditions: Sequence[str], folder: Path, **params: Any) -> Split:
    """``make_split`` cached as JSON in ``folder`` (``<split_type>_<split_key>.json``): a damaged
    cache file is made again and rewritten, a read-only folder only costs recomputation."""
    key = split_key(conditions, **params)
    cache = folder / f"{params['split_type']}_{key}.json"
    if cache.exists():
        try:
            return Split.from_dict(json.loads(cache.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged cache file: make the split again and rewrite it
    params = dict(params)
    split = params.pop("split_type")
    result = make_split(conditions, split, **params)
    try:
        text = json.dumps(result.to_dict())
        atomic_write(cache, lambda tmp: tmp.write_text(text))
    except (OSError, GearsInputError):
        pass
    return result


# --- the two carving procedures --------------------------------------------------------------


def _simulation_stage(
    perts: list[str],
    rng: np.random.Generator,
    seen_frac: float,
    seen2_train_frac: float,
    *,
    split_type: str,
    role: str,
    forced: frozenset[str] = frozenset(),
    only_forced: bool = False,
    with_doubles: bool = True,
) -> _Stage:
    """GEARS's ``get_simulation_split(_single)``: hold out unseen genes and seen2 doubles."""
    singles, doubles = _by_arity(perts)
    dropped = [] if with_doubles else doubles
    pool = perts if with_doubles else singles
    genes = _genes_of(pool)
    where = "the data" if role == "test" else "the training part left after the test set"
    if only_forced:
        seen = set(genes) - forced
    else:
        n_seen = int(len(genes) * seen_frac)
        if n_seen < 1:
            frac_name = "train_gene_set_size" if role == "test" else "1 - val_size"
            raise GearsInputError(
                f"split '{split_type}': the {role} stage keeps int(n_genes * {frac_name}) = "
                f"int({len(genes)} * {seen_frac:g}) = 0 genes seen, so it needs at least "
                f"{_min_count(seen_frac)} perturbed genes; {where} has {_describe(pool)}"
            )
        candidates = [g for g in genes if g not in forced]
        if n_seen > len(candidates):
            raise GearsInputError(
                f"split '{split_type}': {len(forced)} genes are forced unseen, leaving "
                f"{len(candidates)} of {len(genes)} perturbed genes to choose {n_seen} seen genes "
                f"from (train_gene_set_size={seen_frac:g}); force fewer genes, lower "
                "train_gene_set_size, or set only_test_set_perts=True"
            )
        seen = set(_sample(rng, candidates, n_seen))
    n_seen_of = {d: sum(g in seen for g in _genes(d)) for d in doubles}
    unseen_single = [s for s in singles if _genes(s)[0] not in seen]
    seen_singles = [s for s in singles if _genes(s)[0] in seen]
    subgroups = {"unseen_single": unseen_single}
    held, kept = list(unseen_single), list(seen_singles)
    if with_doubles:
        both_seen = [d for d in doubles if n_seen_of[d] == 2]
        seen2_train = set(_sample(rng, both_seen, int(len(both_seen) * seen2_train_frac)))
        subgroups = {
            "combo_seen0": [d for d in doubles if n_seen_of[d] == 0],
            "combo_seen1": [d for d in doubles if n_seen_of[d] == 1],
            "combo_seen2": [d for d in both_seen if d not in seen2_train],
            "unseen_single": unseen_single,
        }
        held = sorted(c for name in SIMULATION_SUBGROUPS for c in subgroups[name])
        kept = sorted([*seen_singles, *seen2_train])
    _check_stage(kept, held, split_type, role, where, pool, f"{len(seen)} seen genes")
    return _Stage(kept, held, subgroups, dropped)


def _holdout_stage(
    perts: list[str],
    rng: np.random.Generator,
    split_type: str,
    frac: float,
    *,
    role: str,
    given: Iterable[str] | None = None,
) -> _Stage:
    """GEARS's ``get_split_list``: hold out the perturbations of sampled genes or doubles."""
    singles, doubles = _by_arity(perts)
    where = "the data" if role == "test" else "the training part left after the test set"
    frac_name = "val_size" if role == "validation" else "test_size"
    if split_type in ("single", "combo_seen0", "combo_seen1"):
        if given:
            chosen = set(given)
        else:
            n_chosen = int(len(singles) * frac)
            if n_chosen < 1:
                raise GearsInputError(
                    f"split '{split_type}': the {role} stage samples int(n_singles * {frac_name})"
                    f" = int({len(singles)} * {frac:g}) = 0 {role} genes, so it needs at least "
                    f"{_min_count(frac)} single perturbations; {where} has {_describe(perts)}. "
                    f"Raise {frac_name} or use a split type that suits the data"
                )
            chosen = set(_sample(rng, _genes_of(perts), n_chosen))
        n_in = {d: sum(g in chosen for g in _genes(d)) for d in doubles}
        held_doubles_with = {"single": (), "combo_seen0": (2,), "combo_seen1": (1,)}[split_type]
        dropped_with = {"single": (1, 2), "combo_seen0": (1,), "combo_seen1": (2,)}[split_type]
        held = [s for s in singles if _genes(s)[0] in chosen]
        held += [d for d in doubles if n_in[d] in held_doubles_with]
        dropped = [d for d in doubles if n_in[d] in dropped_with]
        detail = f"{len(chosen)} {role} genes"
    else:  # combo_seen2 and no_test hold out whole perturbations
        pool, kind = (
            (doubles, "double") if doubles or split_type == "combo_seen2" else (singles, "single")
        )
        if given:
            held = sorted(set(given))
        else:
            n_held = int(len(pool) * frac)
            if n_held < 1:
                raise GearsInputError(
                    f"split '{split_type}': the {role} stage samples int(n_{kind}s * {frac_name}) "
                    f"= int({len(pool)} * {frac:g}) = 0 {kind} perturbations, so it needs at least "
                    f"{_min_count(frac)} {kind}s; {where} has {_describe(perts)}. "
                    f"Raise {frac_name} or use a split type that suits the data"
                )
            held = _sample(rng, pool, n_held)
        dropped = []
        detail = f"{len(held)} {role} perturbations"
    gone = set(held) | set(dropped)
    kept = [p for p in perts if p not in gone]
    _check_stage(kept, sorted(held), split_type, role, where, perts, detail)
    return _Stage(kept, sorted(held), {}, sorted(dropped))


def _check_stage(
    kept: list[str], held: list[str], split_type: str, role: str, where: str, pool: list[str],
    detail: str,
) -> None:  # fmt: skip
    """Both sides of a carve must be non-empty: a split without train or test is useless."""
    for name, part in (("training", kept), (role, held)):
        if not part:
            raise GearsInputError(
                f"split '{split_type}' left the {name} set empty ({detail}); {where} has "
                f"{_describe(pool)}. The split needs perturbations on both sides: use more "
                "perturbations, change the fractions or fixed test genes, or pick another split"
            )


# --- validation ------------------------------------------------------------------------------


def _check_conditions(conditions: Sequence[str], *, need_ctrl: bool) -> list[str]:
    """Sorted unique conditions, after checking each is a canonical GEARS spelling."""
    if isinstance(conditions, str):
        raise GearsInputError("conditions must be a list of condition names, not one string")
    conds = sorted({str(c) for c in conditions})
    bad = [c for c in conds if _canonical(c) != c]
    if bad:
        raise GearsInputError(
            f"{len(bad)} conditions are not canonical GEARS spellings ('ctrl', 'A+ctrl', 'A+B' "
            f"with A < B), e.g. {bad[:5]}; canonicalise condition names before splitting"
        )
    if need_ctrl and "ctrl" not in conds:
        raise GearsInputError(
            "the conditions have no 'ctrl'; every split except 'no_split' needs control cells"
        )
    return conds


def _check_options(
    split_type: str, seed: Any, train_gene_set_size: float, combo_seen2_train_frac: float,
    test_size: float, val_size: float, test_perts: Any, test_pert_genes: Any,
    only_test_set_perts: bool, split_dict: Any,
) -> None:  # fmt: skip
    """Reject arguments that are out of range or that the split type would silently ignore."""
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise GearsInputError(f"seed must be an integer, got {seed!r}")
    ranges = {
        "train_gene_set_size": (train_gene_set_size, 0.0, 1.0, False, True),
        "combo_seen2_train_frac": (combo_seen2_train_frac, 0.0, 1.0, True, True),
        "test_size": (test_size, 0.0, 1.0, False, False),
        "val_size": (val_size, 0.0, 1.0, False, False),
    }
    for name, (value, low, high, low_ok, high_ok) in ranges.items():
        inside = (low <= value if low_ok else low < value) and (
            value <= high if high_ok else value < high
        )
        if not isinstance(value, int | float) or not inside:
            lo, hi = "[" if low_ok else "(", "]" if high_ok else ")"
            raise GearsInputError(f"{name} must be in {lo}{low:g}, {high:g}{hi}, got {value!r}")
    for name, value in (("test_perts", test_perts), ("test_pert_genes", test_pert_genes)):
        if isinstance(value, str):
            raise GearsInputError(
                f"{name} must be a list of names, not one string; e.g. {value!r}.split('_')"
            )
    takes_test_perts = (*_GENE_TYPES, "combo_seen2", "no_test")
    if test_perts is not None and split_type not in takes_test_perts:
        raise GearsInputError(f"split '{split_type}' does not use test_perts")
    if test_pert_genes is not None and split_type not in _GENE_TYPES:
        raise GearsInputError(
            f"split '{split_type}' does not use test_pert_genes; it holds out perturbations, "
            "so pass test_perts"
        )
    if only_test_set_perts and split_type not in ("simulation", "simulation_single"):
        raise GearsInputError("only_test_set_perts applies to the simulation splits only")
    if only_test_set_perts and not (test_perts or test_pert_genes):
        raise GearsInputError("only_test_set_perts=True needs test_pert_genes or test_perts")
    if (split_dict is not None) != (split_type == "custom"):
        raise GearsInputError(
            "split 'custom' needs split_dict (see load_split_dict), and only 'custom' takes it"
        )


def _fixed_test_set(
    split_type: str,
    perts: list[str],
    test_perts: Sequence[str] | None,
    test_pert_genes: Sequence[str] | None,
) -> tuple[frozenset[str], frozenset[str]]:
    """The (genes, perturbations) the caller fixed as held out, checked against the data."""
    if split_type in ("combo_seen2", "no_test"):
        given = frozenset(_canonical(str(p)) or str(p) for p in test_perts or [])
        if given:
            unknown = sorted(given - set(perts))
            if unknown:
                raise GearsInputError(
                    f"{len(unknown)} test_perts are not perturbations in the data, e.g. "
                    f"{unknown[:5]}"
                )
            if split_type == "combo_seen2" and any(_arity(p) != 2 for p in given):
                raise GearsInputError(
                    "split 'combo_seen2' takes only doubles ('A+B') as test_perts"
                )
        return frozenset(), given
    # GEARS passed gene names as test_perts for the simulation splits; accept genes or conditions.
    names = [*(test_pert_genes or []), *(test_perts or [])]
    genes = {g for name in names for g in _genes(str(name))}
    unknown = sorted(genes - set(_genes_of(perts)))
    if unknown:
        raise GearsInputError(
            f"{len(unknown)} fixed test genes are not perturbed in the data, e.g. {unknown[:5]}"
        )
    return frozenset(genes), frozenset()


def _validate_split_dict(d: Any, conditions: list[str], *, source: str) -> dict[str, list[str]]:
    """Check a custom split's shape, spelling, disjointness and conditions; return it canonical."""
    if not isinstance(d, dict) or "train" not in d:
        raise GearsInputError(
            f"{source} must be a dict {{'train': [...], 'val': [...], 'test': [...]}}, got "
            f"{type(d).__name__}{'' if not isinstance(d, dict) else ' without a train key'}"
        )
    extra = sorted(str(k) for k in d if k not in _SET_NAMES)
    if extra:
        raise GearsInputError(f"{source} has unknown keys {extra}; use {list(_SET_NAMES)}")
    sets: dict[str, list[str]] = {}
    for name in _SET_NAMES:
        entries = _string_list(d.get(name, []), f"{source} entry '{name}'")
        spelled = {c: _canonical(c) for c in entries}
        bad = [c for c, canon in spelled.items() if canon is None]
        if bad:
            raise GearsInputError(
                f"{source} entry '{name}' has names that are not conditions ('ctrl', 'A+ctrl', "
                f"'A+B'), e.g. {bad[:5]}"
            )
        sets[name] = sorted(set(spelled.values()))
    for i, a in enumerate(_SET_NAMES):
        for b in _SET_NAMES[i + 1 :]:
            both = sorted(set(sets[a]) & set(sets[b]))
            if both:
                raise GearsInputError(
                    f"{source} lists {len(both)} conditions in both '{a}' and '{b}', "
                    f"e.g. {both[:5]}"
                )
    known = set(conditions)
    unknown = sorted({c for name in _SET_NAMES for c in sets[name]} - known)
    if unknown:
        raise GearsInputError(
            f"{source} names {len(unknown)} conditions that are not in the data, e.g. "
            f"{unknown[:5]}; the data has {len(known)} conditions. Fix their spelling or remove "
            "them from the file (PertData.conditions lists the data's conditions; "
            "PertData.report['dropped_conditions'] those dropped at load)"
        )
    return sets


def _string_list(value: Any, what: str) -> list[str]:
    """``value`` as a list of strings, or an error naming ``what``."""
    if isinstance(value, str | bytes) or not isinstance(value, list | tuple | set | np.ndarray):
        raise GearsInputError(
            f"{what} must be a list of condition names, got {type(value).__name__}"
        )
    bad = [v for v in value if not isinstance(v, str)]
    if bad:
        raise GearsInputError(f"{what} must hold only strings; found {bad[:3]!r}")
    return list(value)


def _read_json(raw: bytes) -> Any:
    return json.loads(raw.decode("utf-8"))


def _read_pickle(raw: bytes) -> Any:
    """GEARS's split pickles hold dicts of lists of names: nothing else is built, so a shared
    split file cannot run code."""
    import io

    return _PlainUnpickler(io.BytesIO(raw)).load()


# --- condition names -------------------------------------------------------------------------


def _canonical(condition: str) -> str | None:
    """The canonical spelling of a condition ('B+A' -> 'A+B', 'ctrl+A' -> 'A+ctrl'), or None."""
    if condition == "ctrl":
        return condition
    parts = condition.split("+")
    if len(parts) != 2 or not all(parts) or parts[0] == parts[1]:
        return None
    if "ctrl" in parts:
        return f"{parts[0] if parts[1] == 'ctrl' else parts[1]}+ctrl"
    return "+".join(sorted(parts))


def _genes(condition: str) -> list[str]:
    return [g for g in condition.split("+") if g != "ctrl"]


def _arity(condition: str) -> int:
    return len(_genes(condition))


def _by_arity(perts: list[str]) -> tuple[list[str], list[str]]:
    return [p for p in perts if _arity(p) == 1], [p for p in perts if _arity(p) == 2]


def _genes_of(perts: Iterable[str]) -> list[str]:
    return sorted({g for p in perts for g in _genes(p)})


def _describe(perts: list[str]) -> str:
    singles, doubles = _by_arity(perts)
    return (
        f"{len(_genes_of(perts))} perturbed genes, {len(singles)} single and "
        f"{len(doubles)} double perturbations"
    )


def _sample(rng: np.random.Generator, items: list[str], k: int) -> list[str]:
    """``k`` distinct items drawn uniformly from the sorted list ``items``, returned sorted."""
    picked = rng.choice(len(items), size=k, replace=False)
    return sorted(items[i] for i in picked)


def _min_count(frac: float) -> int:
    """The smallest n with int(n * frac) >= 1, as the split code computes it."""
    n = 1
    while int(n * frac) < 1:
        n += 1
    return n
