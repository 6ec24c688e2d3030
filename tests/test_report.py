"""gears/eval/report.py: the run's final table says which protocol and epoch it scored, carries each
column's n and marks columns over fewer perturbations; the console agrees with metrics.json."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from helpers import run_train_cli, tiny_split

from gears.eval.report import TABLE_METRICS, print_table, table_lines, train_fit_line, value_text
from gears.train.evaluate import Evaluator


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


def _subgroup_results() -> dict:
    """combo_seen2 has 3 doubles; additive forms 2 of them (one double's gene was seen only in
    validation), and `matched` scores every predictor on those 2."""
    results = _results()
    results["baseline_subgroups"] = {
        "no_change": {"combo_seen2": _row(7, mse_de=0.9), "unseen_single": _row(15, mse_de=0.8)},
        "train_mean": {"combo_seen2": _row(7, mse_de=0.6), "unseen_single": _row(15, mse_de=0.31)},
        "additive": {"combo_seen2": _row(6, mse_de=0.1173)},
        "linear": {"combo_seen2": _row(7, mse_de=0.7), "unseen_single": _row(15, mse_de=0.4)},
    }
    results["test_conditions"] = {
        "all": [f"C{i}" for i in range(36)],
        "combo_seen2": [f"C{i}" for i in range(7)],
        "unseen_single": [f"C{i}" for i in range(7, 22)],
    }
    results["matched"] = {
        "additive": {
            "conditions": [f"C{i}" for i in range(6)],
            "scores": {
                "gears": _row(6, mse_de=0.7001),
                "no_change": _row(6, mse_de=0.9002),
                "train_mean": _row(6, mse_de=0.6003),
                "additive": _row(6, mse_de=0.1173),
                "linear": _row(6, mse_de=0.7004),
            },
        }
    }
    return results


def _line(lines: list[str], label: str) -> list[str]:
    """The values of the table row whose label is `label` (a label may hold spaces)."""
    (line,) = [x for x in lines if x.startswith(label + " ") and len(x) > len(label)]
    return line[len(label) :].split()


def test_every_subgroup_row_carries_the_baselines_beside_gears():
    """The console printed subgroups for gears alone; the baselines' subgroups were only in
    metrics.json, though docs/metrics.md says to compare train_mean on unseen_single."""
    lines = table_lines(_subgroup_results())
    assert _line(lines, "unseen_single mse_de") == ["0.5000", "0.8000", "0.3100", "-", "0.4000"]
    assert _line(lines, "unseen_single n") == ["15", "15", "15", "-", "15"]
    assert _line(lines, "combo_seen2 mse_de") == ["0.7251", "0.9000", "0.6000", "0.1173", "0.7000"]
    assert _line(lines, "combo_seen2 n") == ["7", "7", "7", "6*", "7"]
    assert _line(lines, "combo_seen2 pearson_delta")[0] == "0.5000"


def test_additive_and_gears_are_compared_over_the_same_doubles():
    """additive covered 6 of combo_seen2's 7 doubles and the table set it beside gears's 7:
    a row scores every predictor on additive's doubles, and a note says which and why."""
    lines = table_lines(_subgroup_results())
    assert _line(lines, "additive's set mse_de") == [
        "0.7001",
        "0.9002",
        "0.6003",
        "0.1173",
        "0.7004",
    ]
    assert _line(lines, "additive's set n") == ["6"] * 5
    text = "\n".join(lines)
    assert "additive's set: the 6 test perturbations additive can form" in text
    assert "6 of combo_seen2's 7" in text
    assert "compare gears with additive on this row" in " ".join(text.split())


def test_linear_equal_to_no_change_is_explained_under_the_table():
    results = _results()
    results["baselines"]["linear"] = dict(results["baselines"]["no_change"])
    text = " ".join("\n".join(table_lines(results)).split())
    assert "linear equals no_change here" in text and "docs/metrics.md" in text
    assert "linear equals" not in "\n".join(table_lines(_results()))


def test_held_out_lists_the_test_perturbations_per_subgroup():
    from gears.eval.report import held_out

    groups = {"combo_seen2": ["A+B", "C+D", "X+Y"], "unseen_single": ["E+ctrl"], "combo_seen0": []}
    sets = held_out(["A+B", "E+ctrl", "C+D", "A+B"], groups)
    assert sets == {
        "all": ["A+B", "E+ctrl", "C+D"],
        "combo_seen2": ["A+B", "C+D"],
        "unseen_single": ["E+ctrl"],
    }


def test_matched_scores_every_predictor_on_the_smaller_columns_perturbations():
    """gears's per-perturbation metrics averaged over the perturbations additive covers, by
    hand, against matched_scores."""
    from gears.eval.report import matched_scores

    conds = ["A+B", "C+D", "E+ctrl"]
    scored = {
        "gears": {"conditions": conds, "per_condition": {"mse_de": np.array([1.0, 2.0, 9.0])}},
        "no_change": {"conditions": conds, "per_condition": {"mse_de": np.array([3.0, 5.0, 7.0])}},
        "additive": {"conditions": ["C+D"], "per_condition": {"mse_de": np.array([0.5])}},
    }
    out = matched_scores(scored)
    assert list(out) == ["additive"]
    assert out["additive"]["conditions"] == ["C+D"]
    scores = out["additive"]["scores"]
    assert scores["gears"]["mse_de"] == 2.0 and scores["gears"]["n_conditions"] == 1
    assert scores["no_change"]["mse_de"] == 5.0 and scores["additive"]["mse_de"] == 0.5


FIXED_SUBKEYS = ("timing", "history")  # metrics.json keys documented one sub-key a row
METRICS_MD = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def _documented_file_keys() -> dict[str, str]:
    """docs/metrics.md's "The file" table: every key its first column names -> its row."""
    table = METRICS_MD.read_text().split("## The file")[1].split("\n## ")[0]
    rows = {}
    for line in table.splitlines():
        if line.startswith("| `"):
            first, what = line.split("|")[1:3]
            for key in re.findall(r"`([\w.]+)`", first):
                rows[key] = what.strip()
    return rows


def _file_keys(metrics: dict) -> set[str]:
    """The keys of a metrics.json as the page names them: top level, and `a.b` for the
    FIXED_SUBKEYS dicts."""
    keys = set()
    for key, value in metrics.items():
        if key in FIXED_SUBKEYS:
            keys |= {f"{key}.{sub}" for sub in value}
        else:
            keys.add(key)
    return keys


@pytest.fixture(scope="module")
def default_run(tiny_cli_run):
    """A whole run on the TINY screen with the default settings: (its folder, its stdout). The
    session's tiny_cli_run (tests/conftest.py: run_train_cli's defaults), only read here."""
    return tiny_cli_run


@pytest.mark.slow
def test_metrics_md_documents_every_key_of_a_runs_metrics_json(default_run):
    """Key by key, as tests/test_docs.py checks configuration.md against config.py: a key the
    run writes has a row, and a documented key the run lacks is one written "only with" a
    setting. The page said `history` held per-epoch records; it holds one list per field."""
    folder, _ = default_run
    metrics = json.loads((folder / "metrics.json").read_text())
    rows = _documented_file_keys()
    written = _file_keys(metrics)
    assert written - set(rows) == set(), "docs/metrics.md has no row for these keys"
    absent = {k for k in set(rows) - written if not rows[k].startswith("only with")}
    assert absent == set(), "docs/metrics.md documents keys a default run does not write"
    assert isinstance(metrics["history"]["train_loss"], list)
    assert len(metrics["history"]["val"]) == metrics["timing"]["epochs"]


@pytest.mark.slow
def test_a_run_lists_its_held_out_perturbations_and_prints_every_predictor_per_subgroup(
    default_run, tmp_path
):
    folder, out = default_run
    metrics = json.loads((folder / "metrics.json").read_text())
    split = tiny_split(tmp_path)  # the run's data and split (seed 1, simulation)
    test = [c for c in split.set2conditions["test"] if c != "ctrl"]
    listed = metrics["test_conditions"]
    assert sorted(listed["all"]) == sorted(test)
    assert set(listed) - {"all"} == set(metrics["subgroups"])
    for name, members in listed.items():
        if name != "all":
            assert sorted(members) == sorted(split.subgroup["test_subgroup"][name])
            assert metrics["subgroups"][name]["n_conditions"] == len(members)
    lines = out.splitlines()
    cols = ["gears", *metrics["baselines"]]
    for name in metrics["subgroups"]:
        rows = {"gears": metrics["subgroups"][name]}
        rows.update({c: metrics["baseline_subgroups"][c].get(name, {}) for c in cols[1:]})
        assert _line(lines, f"{name} mse_de") == [value_text(rows[c].get("mse_de")) for c in cols]
    additive = metrics["matched"]["additive"]
    train = set(split.set2conditions["train"])
    for double in additive["conditions"]:  # doubles whose two singles were trained
        assert double in listed["combo_seen2"]
        assert all(f"{g}+ctrl" in train for g in double.split("+"))
    scores = additive["scores"]
    assert set(scores) == set(cols)
    assert {row["n_conditions"] for row in scores.values()} == {len(additive["conditions"])}
    assert _line(lines, "additive's set mse_de") == [value_text(scores[c]["mse_de"]) for c in cols]


def test_no_change_validation_scores_the_control_mean_on_the_validation_set(tmp_path):
    """The level loss.png draws under the validation curve (metrics.json `val_no_change`): the
    validation mse_de of predicting the control mean, by hand."""
    from gears.eval.report import no_change_validation

    pert_data = tiny_split(tmp_path)
    ev = Evaluator(pert_data)
    scored = no_change_validation(ev, pert_data.ctrl_mean)
    view = ev.set_view("val")
    ctrl = np.asarray(pert_data.ctrl_mean, dtype=np.float64)
    by_hand = []
    for cond, truth in zip(view["conditions"], view["truth_mean"]):
        de = [g for g in pert_data.de_idx[pert_data.cond_to_id[cond]] if g >= 0]
        by_hand.append(np.mean((ctrl[de] - truth[de]) ** 2))
    assert scored["mse_de"] == pytest.approx(np.mean(by_hand), rel=1e-9)
    assert scored["pearson_delta"] == 0.0
    pert_data.set2conditions["val"] = ["ctrl"]
    assert no_change_validation(Evaluator(pert_data), pert_data.ctrl_mean) == {}
