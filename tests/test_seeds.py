"""gears/cli/seeds.py's summary: every column's n, a mark where a column averages over fewer
perturbations than GEARS's, and the protocol and selection rule of the seeds."""

from __future__ import annotations

from gears.cli.seeds import summarize_seeds, summary_markdown


def _row(n: int, value: float) -> dict:
    return {"mse": value, "mse_de": value, "pearson_delta": value, "n_conditions": n}


def _metrics(n_test: int, n_additive: int | None, value: float) -> dict:
    """One seed's metrics.json: additive scored on n_additive of n_test (None: on none)."""
    additive = {} if n_additive is None else {"additive": _row(n_additive, value)}
    fit_additive = {"additive": _row(53, value)}  # every training perturbation has its singles
    return {
        "best_epoch": 10,
        "select": "last",
        "control_mean": "all",
        "test": _row(n_test, value),
        "subgroups": {"unseen_single": _row(15, value)},
        "baselines": {"no_change": _row(n_test, 0.0), **additive},
        "baseline_subgroups": {"no_change": {"unseen_single": _row(15, 0.0)}},
        "train_fit": _row(53, value),
        "train_fit_baselines": {"no_change": _row(53, 0.0), **fit_additive},
    }


def _table(markdown: str, metric: str) -> list[list[str]]:
    block = markdown.split(f"**{metric}**")[1].split("**")[0]
    rows = [line for line in block.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def test_a_column_over_fewer_perturbations_carries_its_n_and_a_mark():
    """The additive column of the seed tables averaged over 5-7 (0-2 on the Norman subset)
    perturbations against 35-39 for the others, with nothing saying so."""
    summary = summarize_seeds({1: _metrics(36, 7, 0.1), 2: _metrics(35, 5, 0.3)})
    md = summary_markdown(summary)
    header, _, overall, unseen, fit = _table(md, "mse")
    assert header == ["subgroup (n)", "gears", "no_change", "additive"]
    assert overall == ["overall (35/36)", "0.200 ± 0.141", "0.000 ± 0.000", "0.200 ± 0.141 (5/7)*"]
    assert unseen == ["unseen_single (15)", "0.200 ± 0.141", "0.000 ± 0.000", "-"]
    assert fit == ["train fit (53)", "0.200 ± 0.141", "0.000 ± 0.000", "0.200 ± 0.141"]
    assert "*: over fewer perturbations than gears in that row" in md
    assert "additive covers only perturbations whose singles were trained" in md


def test_a_seed_where_a_column_scored_nothing_counts_as_fewer():
    summary = summarize_seeds({1: _metrics(13, 1, 0.1), 2: _metrics(14, None, 0.3)})
    overall = _table(summary_markdown(summary), "mse")[2]
    assert overall[3] == "0.100 (0/1)*"  # one seed's value: no sd


def test_the_summary_names_protocol_and_selection_rule():
    summary = summarize_seeds({1: _metrics(36, 7, 0.1), 2: _metrics(35, 5, 0.3)})
    assert summary["control_mean"] == ["all", "all"] and summary["select"] == ["last", "last"]
    md = summary_markdown(summary)
    assert "kept epoch per seed [10, 10]; eval.control_mean=all, train.select=last." in md
