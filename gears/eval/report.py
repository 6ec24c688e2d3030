"""What a finished run prints: the test table (protocol, kept epoch, n per column), every
predictor per test subgroup and on a smaller column's own perturbations, the train fit; and the
parts of `metrics.json` those rows need (`held_out`, `matched_scores`).

Everything printed comes from the run's `metrics.json` contents (`results`), so the console and
the file agree; a value the file holds as null (NaN: undefined, e.g. a Pearson over fewer than
two genes) prints as "-". A constant prediction (`no_change`) has Pearson 0 in both, as in GEARS
(docs/metrics.md).
"""

from __future__ import annotations

from gears.data.conditions import CTRL
from gears.train.metrics import summarize

TABLE_METRICS = (
    "mse",
    "mse_de",
    "pearson",
    "pearson_delta",
    "pearson_delta_de",
    "frac_correct_direction_top20_non_dropout",
    "frac_opposite_direction_top20_non_dropout",
)
TABLE_HEADER = (
    "test metrics (mean over perturbations; lower mse is better, higher pearson is better)"
)
# Marks a column that averages over fewer perturbations than GEARS's, and why a baseline may.
FEWER = "*"
COVERAGE = {
    "additive": "the doubles whose two singles were trained: compare it with gears on the "
    'rows "additive\'s set" below, over the same doubles (not overall, nor on combo_seen2)',
}
# Each subgroup's rows and each matched set's rows: these metrics, then n.
SUBGROUP_METRICS = ("mse_de", "pearson_delta")
COLUMN = 12
SELECT_RULES = {
    "last": "the final model",
    "val_mse": "lowest validation mse, all genes",
    "val_mse_de": "lowest validation mse on the top-20 DE genes, GEARS's rule",
}
FIT_COLUMNS = ("gears", "no_change", "train_mean")


def value_text(value, width: int = 0) -> str:
    """A metric as the console shows it: 4 decimals, "-" for a missing or null (NaN) value."""
    text = "-" if value is None or value != value else f"{value:.4f}"
    return text.rjust(width)


def protocol_lines(results: dict) -> list[str]:
    """Which control mean the predictions used, and which epoch's weights were scored."""
    protocol = results.get("control_mean", "all")
    if protocol == "paired":
        lines = [
            "protocol: eval.control_mean=paired (GEARS's): gears's mean = its predicted change + "
            "the mean of the control cells paired with its cells; the baselines' means are exact"
        ]
        alone = results.get("paired_control_alone") or {}
        if alone.get("mse") is not None:
            no_change = (results.get("baselines", {}).get("no_change") or {}).get("mse")
            lines.append(
                f"  the paired control means alone score mse {value_text(alone['mse'])} "
                f"(no_change {value_text(no_change)}): read gears's mse against that, or use "
                "eval.control_mean=all (docs/faithfulness.md#exact-mean-predictions)"
            )
    else:
        lines = [
            "protocol: eval.control_mean=all: predicted mean = predicted change + the mean of all "
            "control cells (exact; GEARS's paired protocol adds sampling noise)"
        ]
    select = results.get("select", "last")
    epochs = (results.get("timing") or {}).get("epochs")
    kept = f"kept: epoch {results.get('best_epoch', '?')}"
    if epochs:
        kept += f" of {epochs}"
    kept += f" (train.select={select}: {SELECT_RULES.get(select, select)}"
    val_best = results.get("val_best") or {}
    if select != "last" and val_best:
        key = "mse_de" if select == "val_mse_de" else "mse"
        kept += f", validation {key} {value_text(val_best.get(key))}"
    return [*lines, kept + ")"]


def held_out(conditions, groups: dict | None) -> dict[str, list[str]]:
    """The test perturbations as metrics.json lists them (`test_conditions`): "all" in the
    evaluator's order, then each subgroup's members among them (a subgroup with none is left
    out, as in `subgroups`). conditions: the test units' conditions (a condition appears once
    even when several covariate units share it); groups: subgroup -> condition names."""
    every = list(dict.fromkeys(conditions))
    present = set(every)
    out = {"all": every}
    for name, members in (groups or {}).items():
        kept = [c for c in members if c in present]
        if kept:
            out[name] = kept
    return out


def matched_scores(scored: dict[str, dict]) -> dict:
    """For each predictor scored on fewer test perturbations than gears (additive: the doubles
    whose singles were trained), those perturbations and every predictor's metrics over exactly
    them, so a column is compared with gears on the same perturbations (`matched`).

    scored: predictor -> `Evaluator.full` output ("conditions", "per_condition"), gears included.
    Returns {predictor: {"conditions": [...], "scores": {predictor: {metric: mean}}}}."""
    n_gears = len(scored["gears"]["conditions"])
    out = {}
    for name, own in scored.items():
        members = list(own["conditions"])
        if not members or len(members) >= n_gears:
            continue
        scores = {}
        for other, full in scored.items():
            row = summarize(full["per_condition"], full["conditions"], {"set": members}).get("set")
            if row is not None and row["n_conditions"] == len(members):
                scores[other] = row
        out[name] = {"conditions": members, "scores": scores}
    return out


def table_lines(results: dict) -> list[str]:
    """The test table: a column per predictor, its n, and a mark on columns over fewer
    perturbations than gears's (explained below the table); then every column per test subgroup
    and on each smaller column's own perturbations (`matched`)."""
    rows = {"gears": results["test"], **results.get("baselines", {})}
    cols = list(rows)
    n = {c: rows[c].get("n_conditions") for c in cols}
    fewer = [c for c in cols if n[c] is not None and n["gears"] and n[c] < n["gears"]]
    width = max(len(m) for m in TABLE_METRICS) + 2
    heads = [c + (FEWER if c in fewer else "") for c in cols]
    lines = [TABLE_HEADER, *protocol_lines(results)]
    lines.append("metric".ljust(width) + "".join(h.rjust(COLUMN) for h in heads))
    for m in TABLE_METRICS:
        lines.append(m.ljust(width) + "".join(value_text(rows[c].get(m), COLUMN) for c in cols))
    lines.append("n (perturbations)".ljust(width) + _counts(n, cols))
    for c in fewer:
        why = COVERAGE.get(c, "the perturbations it can predict")
        lines.append(f"{FEWER} {c}: over {n[c]} of the {n['gears']} test perturbations ({why})")
    lines += _subgroup_lines(results, cols, width)
    lines += _matched_lines(results, cols, width)
    lines += linear_note(results)
    return lines


def _counts(n: dict, cols: list[str]) -> str:
    """The n row: "-" for a column with no perturbation, FEWER on one with fewer than gears."""
    texts = []
    for c in cols:
        mark = FEWER if n.get(c) and n.get("gears") and n[c] < n["gears"] else ""
        texts.append(("-" if not n.get(c) else str(n[c])) + mark)
    return "".join(t.rjust(COLUMN) for t in texts)


def _block(label: str, rows: dict, cols: list[str], width: int) -> list[str]:
    """SUBGROUP_METRICS then n, each predictor's row (predictor -> {metric: value}) a column."""
    lines = [
        f"{label} {m}".ljust(width)
        + "".join(value_text(rows.get(c, {}).get(m), COLUMN) for c in cols)
        for m in SUBGROUP_METRICS
    ]
    n = {c: rows.get(c, {}).get("n_conditions") for c in cols}
    return [*lines, f"{label} n".ljust(width) + _counts(n, cols)]


def _subgroup_lines(results: dict, cols: list[str], width: int) -> list[str]:
    """Every predictor per test subgroup: each column over the subgroup's perturbations it
    covers (its n below; FEWER where that is fewer than gears's)."""
    subgroups = results.get("subgroups") or {}
    if not subgroups:
        return []
    per = results.get("baseline_subgroups") or {}
    lines = ["per test subgroup (each column over the subgroup's perturbations it covers):"]
    for name, sub in subgroups.items():
        rows = {"gears": sub, **{c: per.get(c, {}).get(name, {}) for c in cols[1:]}}
        lines += _block(name, rows, cols, width)
    return lines


def _matched_lines(results: dict, cols: list[str], width: int) -> list[str]:
    """Every predictor on a smaller column's own perturbations, and which they are."""
    lines = []
    groups = {k: v for k, v in (results.get("test_conditions") or {}).items() if k != "all"}
    for name, entry in (results.get("matched") or {}).items():
        members = entry.get("conditions") or []
        label = f"{name}'s set"
        lines += _block(label, entry.get("scores") or {}, cols, width)
        where = [
            f"{sum(c in set(group) for c in members)} of {sub}'s {len(group)}"
            for sub, group in groups.items()
            if any(c in set(group) for c in members)
        ]
        why = COVERAGE.get(name, "").split(":")[0] or "the perturbations it can predict"
        lines.append(
            f"{label}: the {len(members)} test perturbations {name} can form ({why}"
            + (f"; {', '.join(where)}" if where else "")
            + f"), every column over those {len(members)}: compare gears with {name} on this row"
        )
    if "additive" in (results.get("matched") or {}) and "combo_seen2" in groups:
        lines.append(
            "  (combo_seen2 counts a gene as seen when training or validation perturbs it; "
            "additive needs both singles among the training perturbations)"
        )
    return lines


def linear_note(results: dict) -> list[str]:
    """A line under the table when the linear baseline scores as no_change does (to the 4
    decimals shown): why, and where the docs say more."""
    base = results.get("baselines") or {}
    linear, no_change = base.get("linear"), base.get("no_change")
    if not linear or not no_change:
        return []
    if any(value_text(linear.get(m)) != value_text(no_change.get(m)) for m in ("mse", "mse_de")):
        return []
    return [
        "linear equals no_change here: it places a perturbation by its target genes' rows in "
        "the expression PCA, and (nearly) no perturbed gene is among the measured genes, so it "
        "predicts the control mean (docs/metrics.md#the-linear-baseline)"
    ]


def train_fit_line(results: dict) -> str | None:
    """GEARS's fit on the training perturbations beside no_change and train_mean, or None."""
    fit = results.get("train_fit")
    if not fit:
        return None
    fits = {"gears": fit, **results.get("train_fit_baselines", {})}
    parts = [
        f"{name} mse_de {value_text(row.get('mse_de'))} "
        f"pearson_delta {value_text(row.get('pearson_delta'))}"
        for name, row in fits.items()
        if name in FIT_COLUMNS
    ]
    return (
        f"train fit ({fit.get('n_conditions', 0)} training perturbations, the kept model): "
        + "; ".join(parts)
    )


def print_table(results: dict) -> None:
    """The run's final report on the console (rank 0): the test table, then the train fit."""
    print("\n" + "\n".join(table_lines(results)))
    fit = train_fit_line(results)
    if fit:
        print(fit)


def no_change_validation(evaluator, ctrl_mean) -> dict[str, float]:
    """no_change's per-epoch validation metrics (Evaluator.quick on the control mean): the
    level loss.png draws under the validation curve; {} without a validation perturbation."""
    import numpy as np

    if not [c for c in evaluator.pd.set2conditions.get("val", []) if c != CTRL]:
        return {}
    n_units = len(evaluator.set_view("val")["conditions"])
    if not n_units:
        return {}
    pred = np.tile(np.asarray(ctrl_mean, dtype=np.float64), (n_units, 1))
    return evaluator.quick("val", pred_mean=pred)
