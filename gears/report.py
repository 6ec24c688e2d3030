"""What a finished run prints: the test table (protocol, kept epoch, n per column), the train fit.

Everything printed comes from the run's `metrics.json` contents (`results`), so the console and
the file agree; a value the file holds as null (NaN: undefined, e.g. a Pearson over fewer than
two genes) prints as "-". A constant prediction (`no_change`) has Pearson 0 in both, as in GEARS
(docs/metrics.md).
"""

from __future__ import annotations

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
    "additive": "the doubles whose two singles were trained: compare it with gears on "
    "subgroup combo_seen2, not overall",
}
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


def table_lines(results: dict) -> list[str]:
    """The test table: a column per predictor, its n, and a mark on columns over fewer
    perturbations than gears's (explained below the table)."""
    rows = {"gears": results["test"], **results.get("baselines", {})}
    cols = list(rows)
    n = {c: rows[c].get("n_conditions") for c in cols}
    fewer = [c for c in cols if n[c] is not None and n["gears"] and n[c] < n["gears"]]
    width = max(len(m) for m in TABLE_METRICS) + 2
    heads = [c + (FEWER if c in fewer else "") for c in cols]
    lines = [TABLE_HEADER, *protocol_lines(results)]
    lines.append("metric".ljust(width) + "".join(h.rjust(12) for h in heads))
    for m in TABLE_METRICS:
        lines.append(m.ljust(width) + "".join(value_text(rows[c].get(m), 12) for c in cols))
    counts = [("-" if n[c] is None else str(n[c])) + (FEWER if c in fewer else "") for c in cols]
    lines.append("n (perturbations)".ljust(width) + "".join(t.rjust(12) for t in counts))
    for c in fewer:
        why = COVERAGE.get(c, "the perturbations it can predict")
        lines.append(f"{FEWER} {c}: over {n[c]} of the {n['gears']} test perturbations ({why})")
    for name, sub in results.get("subgroups", {}).items():
        lines.append(
            f"  subgroup {name}: mse_de {value_text(sub.get('mse_de'))}, "
            f"pearson_delta {value_text(sub.get('pearson_delta'))} "
            f"({sub.get('n_conditions', 0)} perturbations)"
        )
    return lines


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
