"""dcinterp.study (`python -m dcinterp.train summarize`): the table of a folder of runs, checked against a direct
computation from the recipe.json files of tests/fixtures/study_runs (hand-made results of 4 seeds: seeds 0-2 paired,
seed 3's DCMHA run stopped early, so its MHA run is unpaired)."""

import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dcinterp.study import paired_bootstrap_interval, read_runs, write_summary
from dcinterp.train import main

FIXTURE = Path(__file__).parent / "fixtures" / "study_runs"
PAIRED_SEEDS = (0, 1, 2)


def recipes() -> dict[tuple[str, int], dict]:
    out = {}
    for path in FIXTURE.rglob("recipe.json"):
        recipe = json.loads(path.read_text())
        if not recipe["stopped_early"]:
            out[recipe["train_config"]["arch"], recipe["seed"]] = recipe
    return out


def fixture_accuracy(recipe: dict, measure: str, group: str) -> float:
    entry = recipe["accuracy"]["released"]
    if measure == "overall":
        return entry["accuracy"]
    if measure == "held_out_combos":
        return entry["default_combo_tasks"]["accuracy"]
    return entry[f"by_{measure}"][group]


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    out = tmp_path_factory.mktemp("summary")
    table, left_out = write_summary(FIXTURE, out, level=0.95, n_resamples=4000, seed=7)
    assert len(left_out) == 1 and "seed3/dcpythia-synth" in left_out[0] and "stopped early" in left_out[0]
    assert (out / "summary.md").read_text().count("\n| released |") == len(table)
    pd.testing.assert_frame_equal(pd.read_csv(out / "summary.csv"), table, check_dtype=False)
    return table


def test_every_pattern_and_transformation_has_a_row(table):
    from dcinterp.synth.catalog import OV_TRANSFORMATIONS, QK_PATTERNS

    assert set(table.loc[table["measure"] == "qk_pattern", "group"]) == set(QK_PATTERNS)
    assert set(table.loc[table["measure"] == "ov_transformation", "group"]) == set(OV_TRANSFORMATIONS)
    assert len(table) == 1 + len(QK_PATTERNS) + len(OV_TRANSFORMATIONS) + 1 and set(table["eval_set"]) == {"released"}


def test_accuracies_and_paired_differences_are_those_of_the_runs(table):
    runs = recipes()
    for _, row in table.iterrows():
        dcmha = np.array([fixture_accuracy(runs["dcmha", s], row["measure"], row["group"]) for s in PAIRED_SEEDS])
        mha = np.array([fixture_accuracy(runs["mha", s], row["measure"], row["group"]) for s in PAIRED_SEEDS])
        assert row["seeds"] == 3 and row["dcmha_ahead"] == int((dcmha > mha).sum())
        assert row["dcmha"] == pytest.approx(dcmha.mean(), abs=1e-12)
        assert row["mha"] == pytest.approx(mha.mean(), abs=1e-12)
        assert row["difference"] == pytest.approx((dcmha - mha).mean(), abs=1e-12)
        for s in PAIRED_SEEDS:
            assert row[f"dcmha_seed{s}"] == fixture_accuracy(runs["dcmha", s], row["measure"], row["group"])
        assert row["mha_seed3"] == fixture_accuracy(runs["mha", 3], row["measure"], row["group"])  # unpaired: shown
        assert np.isnan(row["dcmha_seed3"])  # stopped early: left out


def test_intervals_are_the_paired_bootstrap_over_seeds(table):
    """Against a direct numpy computation: the same seeded resampling of the seeds' differences, and the exact
    bootstrap distribution (all 3^3 equally likely resamples of 3 seeds), which the interval's ends must cut at
    2.5% and 97.5% up to the resampling error of 4,000 draws."""
    runs = recipes()
    for _, row in table.iterrows():
        differences = np.array(
            [
                fixture_accuracy(runs["dcmha", s], row["measure"], row["group"])
                - fixture_accuracy(runs["mha", s], row["measure"], row["group"])
                for s in PAIRED_SEEDS
            ]
        )
        draws = np.random.default_rng(7).integers(0, 3, size=(4000, 3))
        direct = np.quantile(differences[draws].mean(axis=1), [0.025, 0.975])
        assert (row["low"], row["high"]) == pytest.approx(tuple(direct), abs=1e-12)
        exact = np.array([differences[list(pick)].mean() for pick in itertools.product(range(3), repeat=3)])
        slack = 0.01 + 1e-12
        for end, tail in ((row["low"], 0.025), (row["high"], 0.975)):
            assert (exact < end - 1e-12).mean() <= tail + slack and (exact <= end + 1e-12).mean() >= tail - slack


def test_pairing_removes_what_the_seeds_share(table):
    """odd-one-out: DCMHA is 5 points ahead at every seed, while the seeds' own accuracies spread over 30 points.
    Paired, the interval is the 5 points; resampling the twins apart would spread it over the seeds' spread."""
    row = table[(table["measure"] == "qk_pattern") & (table["group"] == "odd-one-out")].iloc[0]
    assert row["low"] == pytest.approx(0.05, abs=1e-9) and row["high"] == pytest.approx(0.05, abs=1e-9)
    assert row["mha_seed0"] - row["mha_seed1"] > 0.25


def test_a_higher_level_gives_a_wider_interval():
    differences = np.array([0.02, -0.01, 0.08, 0.15, 0.03])
    narrow = paired_bootstrap_interval(differences, level=0.5, n_resamples=2000, seed=0)
    wide = paired_bootstrap_interval(differences, level=0.95, n_resamples=2000, seed=0)
    assert wide[0] < narrow[0] < differences.mean() < narrow[1] < wide[1]
    assert differences.min() <= wide[0] and wide[1] <= differences.max()


def test_runs_of_another_recipe_are_refused_by_name(tmp_path):
    runs_dir = tmp_path / "runs"
    shutil.copytree(FIXTURE, runs_dir)
    odd = runs_dir / "seed1" / "pythia-synth" / "recipe.json"
    recipe = json.loads(odd.read_text())
    recipe["train_config"]["lr"] = 1e-3
    odd.write_text(json.dumps(recipe))
    with pytest.raises(ValueError, match=r"seed1/pythia-synth/recipe.json: train_config lr=0.001"):
        read_runs(runs_dir)


@pytest.mark.parametrize("problem", ["missing", "empty", "broken"])
def test_summarize_cli_errors_are_one_line(capsys, tmp_path, problem):
    runs_dir = tmp_path / "runs"
    if problem != "missing":
        runs_dir.mkdir()
    if problem == "broken":
        (runs_dir / "seed0").mkdir()
        (runs_dir / "seed0" / "recipe.json").write_text("{not json")
    with pytest.raises(SystemExit) as exit_info:
        main(["summarize", str(runs_dir)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m dcinterp.train summarize: error:") and len(err.splitlines()) == 1
    assert str(runs_dir) in err


def test_summarize_cli_writes_the_csv_and_markdown(capsys, tmp_path):
    main(["summarize", str(FIXTURE), "--out", str(tmp_path), "--resamples", "500"])
    out = capsys.readouterr().out
    assert "| released | qk_pattern | matching-person |" in out and "paired seeds: 0, 1, 2" in out
    assert (tmp_path / "summary.csv").exists() and (tmp_path / "summary.md").read_text().strip() == out.strip()


def test_summarize_help_is_fast():
    """Like `python -m dcinterp.train --help` (tests/test_cli.py): no torch to import for the table."""
    import subprocess
    import sys

    script = (
        "import sys; from dcinterp.train import main\n"
        "try:\n    main(['summarize', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "print('torch' in sys.modules)"
    )
    repo = Path(__file__).parents[1]
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=repo, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "RUNS_DIR" in result.stdout and result.stdout.strip().splitlines()[-1] == "False"
