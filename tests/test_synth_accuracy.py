"""Accuracy tables for the synthetic-task figure: intervals, chance and counts, by hand on tiny result frames."""

import numpy as np
import pandas as pd
import pytest

from dcinterp.synth.accuracy import (
    CHANCE_BY_QK_PATTERN,
    accuracy_table,
    accuracy_tables,
    bootstrap_interval,
    difference_table,
    wilson_interval,
)
from dcinterp.synth.evaluate import RESULT_COLUMNS


def results(
    correct_by_sample: dict[tuple[str, int], list[bool]], qk_pattern: dict[str, str], checkpoint: str = "model"
) -> pd.DataFrame:
    """A results frame as `evaluate` returns it: one row per answer (k_shot 2..7)."""
    rows = []
    for (task, sample), correct in correct_by_sample.items():
        for k, ok in enumerate(correct, start=2):
            rows.append(
                {
                    "checkpoint": checkpoint,
                    "sample": sample,
                    "task": task,
                    "qk_pattern": qk_pattern[task],
                    "ov_transformation": "copy",
                    "k_shot": k,
                    "answer": "x",
                    "predicted": "x" if ok else "y",
                    "correct": ok,
                    "nll": 0.1,
                    "n_tokens": 1,
                }
            )
    return pd.DataFrame(rows, columns=RESULT_COLUMNS)


def test_wilson_interval_matches_the_formula():
    # 8 of 10 at 95%: the Wilson score interval is (0.4902, 0.9433)
    low, high = wilson_interval(8, 10)
    assert low == pytest.approx(0.4902, abs=1e-4) and high == pytest.approx(0.9433, abs=1e-4)
    assert wilson_interval(0, 5)[0] == 0 and wilson_interval(5, 5)[1] == pytest.approx(1)


def test_bootstrap_resamples_whole_samples():
    # every sample is all right or all wrong: a resample's accuracy is a share of whole samples, in steps of 1/4
    frame = results(
        {("t", 0): [True] * 6, ("t", 1): [True] * 6, ("t", 2): [False] * 6, ("t", 3): [True] * 6}, {"t": "same-person"}
    )
    low, high = bootstrap_interval(frame, n_resamples=500)
    assert {low * 4 % 1, high * 4 % 1} <= {0.0} and low < 0.75 < high
    same = results({("t", i): [True] * 6 for i in range(5)}, {"t": "same-person"})
    assert bootstrap_interval(same) == (1.0, 1.0)


def test_accuracy_table_counts_chance_and_contains_the_accuracy():
    frame = pd.concat(
        [
            results(
                {("a", 0): [True, True, False, True, True, True], ("b", 0): [False] * 6},
                {"a": "same-person", "b": "odd-one-out"},
                checkpoint=name,
            )
            for name in ("dc", "mha")
        ]
    )
    for interval in ("bootstrap", "wilson"):
        table = accuracy_table(frame, "qk_pattern", interval=interval).set_index(["checkpoint", "qk_pattern"])
        row = table.loc[("dc", "same-person")]
        assert row["accuracy"] == pytest.approx(5 / 6) and row["answers"] == 6 and row["samples"] == 1
        assert row["chance"] == pytest.approx(1 / 3)
        assert table.loc[("mha", "odd-one-out"), "chance"] == pytest.approx(1 / 2)
        assert (table["low"] <= table["accuracy"] + 1e-12).all() and (table["accuracy"] <= table["high"] + 1e-12).all()
    overall = accuracy_table(frame, None).set_index("checkpoint")
    assert overall.loc["dc", "accuracy"] == pytest.approx(5 / 12)
    assert overall.loc["dc", "chance"] == pytest.approx((1 / 3 + 1 / 2) / 2)  # the mean over answers
    assert "bootstrap" in overall.attrs["interval"]


def test_wilson_is_narrower_than_the_sample_bootstrap_when_answers_go_together():
    rng = np.random.default_rng(0)
    frame = results({("t", i): [bool(rng.random() < 0.5)] * 6 for i in range(60)}, {"t": "same-person"})
    wilson = accuracy_table(frame, interval="wilson").iloc[0]
    bootstrap = accuracy_table(frame, interval="bootstrap").iloc[0]
    assert bootstrap["high"] - bootstrap["low"] > 1.8 * (wilson["high"] - wilson["low"])


def test_tables_and_bad_options():
    frame = results({("a", 0): [True] * 6}, {"a": "same-person"})
    tables = accuracy_tables(frame)
    assert set(tables) == {"overall", "k_shot", "qk_pattern", "ov_transformation", "task", "combination"}  # one model
    assert list(tables["combination"].columns[:3]) == ["checkpoint", "qk_pattern", "ov_transformation"]
    assert set(CHANCE_BY_QK_PATTERN.values()) == {1 / 3, 1 / 2}
    with pytest.raises(ValueError, match="interval='normal'"):
        accuracy_table(frame, interval="normal")
    with pytest.raises(ValueError, match="level=95"):
        accuracy_table(frame, level=95)


def test_difference_of_two_checkpoints_is_paired_by_sample():
    """The difference is the accuracies' difference; its interval comes from resampling the samples both answered,
    so two checkpoints that agree on every sample differ by exactly 0, however noisy each one is."""
    rng = np.random.default_rng(1)
    same = {("t", i): [bool(rng.random() < 0.5) for _ in range(6)] for i in range(40)}
    patterns = {"t": "same-person"}
    twins = pd.concat([results(same, patterns, "first"), results(same, patterns, "second")])
    row = difference_table(twins, "first", "second", ["qk_pattern", "ov_transformation"]).iloc[0]
    assert (row["difference"], row["low"], row["high"], row["significant"]) == (0.0, 0.0, 0.0, False)
    better = {key: [True] * 6 for key in same}
    apart = pd.concat([results(better, patterns, "first"), results(same, patterns, "second")])
    tables = accuracy_tables(apart, n_resamples=500)
    row = tables["difference"].iloc[0]
    accuracy = tables["combination"].set_index("checkpoint")["accuracy"]
    assert row["difference"] == pytest.approx(accuracy["first"] - accuracy["second"])
    assert row["low"] <= row["difference"] <= row["high"] and row["significant"] and row["samples"] == 40
