"""gears/report.py: the run's final table says which protocol and epoch it scored, carries each
column's n and marks columns over fewer perturbations; the console agrees with metrics.json."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from helpers import run_train_cli, tiny_split

from gears.evaluate import Evaluator
from gears.report import TABLE_METRICS, print_table, table_lines, train_fit_line, value_text


def _row(n: int, **values) -> dict:
    row = dict.fromkeys(TABLE_METRICS, 0.5)
    row.update(values, n_conditions=n)
    return row


def _results(**extra) -> dict:
    """A metrics.json as a run writes it: no_change's Pearson values are 0 (a constant
    prediction), additive covers 7 of 36 perturbations, one value is null (NaN)."""
    no_change = _row(36, pearson_delta=0.0, pearson_delta_de=0.0, mse=0.0541)
    results = {
        "control_mean": "all",
        "select": "last",
        "best_epoch": 10,
        "val_best": {"mse": 0.07, "mse_de": 0.87},
        "timing": {"epochs": 10},
        "test": _row(36, mse=0.0600, pearson_delta=0.0944),
        "subgroups": {"combo_seen2": _row(7, mse_de=0.7251), "unseen_single": _row(15)},
        "baselines": {
            "no_change": no_change,
            "train_mean": _row(36, pearson_delta_de=None),
            "additive": _row(7, mse_de=0.1173),
            "linear": _row(36),
        },
        "train_fit": _row(53, mse_de=0.3434, pearson_delta=0.3445),
        "train_fit_baselines": {
            "no_change": _row(53, mse_de=0.5730, pearson_delta=0.0),
            "train_mean": _row(53, mse_de=0.5216, pearson_delta=0.2263),
        },
    }
    results.update(extra)
    return results


def test_train_fit_prints_a_constant_predictions_pearson_as_the_json_holds_it():
    """no_change's pearson_delta is 0.0 in metrics.json; the train-fit line printed `nan` for it
    (0.0 is falsy: `value or nan`) while the table printed 0.0000."""
    line = train_fit_line(_results())
    assert "no_change mse_de 0.5730 pearson_delta 0.0000" in line
    assert "nan" not in line.lower()
    assert "gears mse_de 0.3434 pearson_delta 0.3445" in line


def test_console_table_values_equal_metrics_json(capsys):
    """Every number of the printed table is the JSON value rounded to 4 decimals; null is '-'."""
    results = _results()
    print_table(results)
    out = capsys.readouterr().out
    assert "nan" not in out.lower()
    cols = ["gears", *results["baselines"]]
    rows = {"gears": results["test"], **results["baselines"]}
    for metric in TABLE_METRICS:
        (line,) = [x for x in out.splitlines() if x.split() and x.split()[0] == metric]
        printed = line.split()[1:]
        assert printed == [value_text(rows[c][metric]) for c in cols], metric
    assert re.search(r"^pearson_delta_de\s+0\.5000\s+0\.0000\s+-\s", out, re.M)


def test_every_column_carries_its_n_and_fewer_perturbations_are_marked():
    lines = table_lines(_results())
    header = next(x for x in lines if x.startswith("metric"))
    assert header.split()[1:] == ["gears", "no_change", "train_mean", "additive*", "linear"]
    (n_line,) = [x for x in lines if x.startswith("n (perturbations)")]
    assert n_line.split()[2:] == ["36", "36", "36", "7*", "36"]
    (note,) = [x for x in lines if x.startswith("* additive")]
    assert "over 7 of the 36 test perturbations" in note and "combo_seen2" in note
    # a column with as many perturbations as gears is not marked
    full = _results()
    full["baselines"]["additive"]["n_conditions"] = 36
    assert not [x for x in table_lines(full) if "*" in x]


def test_the_table_names_the_protocol_and_the_kept_epoch_with_its_rule():
    lines = table_lines(_results())
    assert any(x.startswith("protocol: eval.control_mean=all:") for x in lines)
    assert "kept: epoch 10 of 10 (train.select=last: the final model)" in lines

    paired = _results(
        control_mean="paired",
        select="val_mse_de",
        best_epoch=3,
        timing={"epochs": 20},
        paired_control_alone=_row(36, mse=0.0701),
    )
    text = "\n".join(table_lines(paired))
    assert "protocol: eval.control_mean=paired (GEARS's)" in text
    assert "the paired control means alone score mse 0.0701 (no_change 0.0541)" in text
    assert "kept: epoch 3 of 20 (train.select=val_mse_de: lowest validation mse on the top-20 " in (
        text
    )
    assert "validation mse_de 0.8700)" in text


def test_paired_control_alone_is_the_score_of_the_paired_control_means(tmp_path):
    """What the run writes as paired_control_alone (the scorer given the paired control means as
    the prediction) against an independent computation: the mse of each test perturbation's
    paired-control mean and its cells' mean, averaged."""
    pert_data = tiny_split(tmp_path)
    ev = Evaluator(pert_data, control_mean="paired")
    control = ev.control_means("test")
    scored = ev.full("test", pred_mean=control)["summary"]["overall"]
    view = ev.set_view("test")
    by_hand = np.mean(((view["pair_mean"] - view["truth_mean"]) ** 2).mean(axis=1))
    assert scored["mse"] == pytest.approx(by_hand, rel=1e-9)
    no_change = np.mean(((pert_data.ctrl_mean[None, :] - view["truth_mean"]) ** 2).mean(axis=1))
    assert scored["mse"] != pytest.approx(no_change, rel=1e-3)  # the paired means are not exact


@pytest.mark.slow
def test_a_paired_run_explains_its_table(tmp_path):
    """GEARS's protocol and selection rule end to end: the console says which protocol and epoch,
    metrics.json holds what the paired control means alone score, and both agree."""
    run = run_train_cli(
        tmp_path / "run",
        tmp_path / "data",
        "eval.control_mean=paired",
        "train.select=val_mse_de",
        "train.schedule=step",
    )
    assert run.returncode == 0, run.stderr[-2000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    alone = metrics["paired_control_alone"]
    out = run.stdout
    assert "protocol: eval.control_mean=paired (GEARS's)" in out
    assert f"alone score mse {alone['mse']:.4f} (no_change " in out
    assert f"kept: epoch {metrics['best_epoch']} of 3 (train.select=val_mse_de" in out
    (line,) = [x for x in out.splitlines() if x.startswith("mse ")]
    cols = ["gears", *metrics["baselines"]]
    rows = {"gears": metrics["test"], **metrics["baselines"]}
    assert line.split()[1:] == [value_text(rows[c]["mse"]) for c in cols]
    assert "nan" not in out.lower()
