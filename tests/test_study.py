"""dcinterp.study (`python -m dcinterp.train summarize`): the table of a folder of runs, checked against a direct
computation from the recipe.json files of tests/fixtures/study_runs (hand-made results of 4 seeds: seeds 0-2 paired,
seed 3's DCMHA run stopped early, so its MHA run is unpaired)."""

import io
import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import scipy.stats

from dcinterp.study import (
    holm,
    paired_permutation_p,
    paired_t_power,
    read_runs,
    seeds_for_power,
    sign_flip_interval,
    subset_means,
    t_interval,
    write_summary,
)
from dcinterp.train.__main__ import main

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


def fixture_differences(runs: dict, row) -> np.ndarray:
    """The paired seeds' differences DCMHA - MHA of one row of the table, from the fixture's recipes."""
    return np.array(
        [
            fixture_accuracy(runs["dcmha", s], row["measure"], row["group"])
            - fixture_accuracy(runs["mha", s], row["measure"], row["group"])
            for s in PAIRED_SEEDS
        ]
    )


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    out = tmp_path_factory.mktemp("summary")
    table, left_out = write_summary(FIXTURE, out, level=0.95)
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


def test_intervals_are_the_sign_flip_test_inverted(table):
    """3 seeds: too few for 95%, so each row's interval is the range of its three differences, at its own level
    1 - 2/8 = 75% (the k = 1 case of Hartigan's subset means)."""
    runs = recipes()
    for _, row in table.iterrows():
        differences = fixture_differences(runs, row)
        assert (row["low"], row["high"]) == pytest.approx((differences.min(), differences.max()), abs=1e-12)
        assert row["level"] == 0.75


def test_subset_means_are_every_nonempty_subsets_mean():
    differences = np.array([0.3, -0.1, 0.7, 0.2])
    direct = [np.mean(pick) for k in range(1, 5) for pick in itertools.combinations(differences, k)]
    assert np.sort(subset_means(differences)) == pytest.approx(np.sort(direct), abs=1e-12)


def test_sign_flip_interval_inverts_the_test():
    """Every value inside the interval is one the one-sided sign-flip tests (by enumeration of the 2^8 signs) keep
    at the interval's level, every value outside one they reject; at 6 seeds the 95% interval is their range
    (62 of 64)."""
    differences = np.array([0.12, -0.05, 0.31, 0.02, 0.4, -0.2, 0.08, 0.15])
    low, high, level = sign_flip_interval(differences, 0.95)
    k = int(0.05 * 2**7)
    assert level == pytest.approx(1 - 2 * k / 2**8)
    signs = np.array(list(itertools.product((-1, 1), repeat=8)))

    def kept(delta: float) -> bool:  # neither one-sided test rejects delta at k / 2^n
        shifted = differences - delta
        flipped = (signs * shifted).mean(axis=1)
        return (flipped >= shifted.mean()).sum() > k and (flipped <= shifted.mean()).sum() > k

    for delta in np.linspace(differences.min() - 0.1, differences.max() + 0.1, 401):
        if abs(delta - low) > 1e-9 and abs(delta - high) > 1e-9:
            assert kept(delta) == (low < delta < high), delta
    six = np.array([9.2, 16.9, 7.6, 3.4, -26.8, 38.2])
    assert sign_flip_interval(six) == pytest.approx((-26.8, 38.2, 62 / 64))


def test_sign_flip_interval_covers_at_its_level_on_bimodal_differences():
    """On symmetric, bimodal differences (a lookup formed or not: +-0.3 around the true 0.05, plus noise), 6 seeds:
    the interval holds the true mean in 62/64 of 4,000 studies, within three standard errors."""
    rng = np.random.default_rng(0)
    studies = 0.05 + rng.choice([-0.3, 0.3], size=(4000, 6)) + rng.normal(0, 0.05, size=(4000, 6))
    covered = np.mean([low <= 0.05 <= high for low, high, _ in map(sign_flip_interval, studies)])
    assert abs(covered - 62 / 64) < 3 * np.sqrt(62 / 64 * 2 / 64 / 4000)


def test_t_interval_is_the_textbook_one():
    differences = np.array([0.092, 0.169, 0.076, 0.034, -0.268, 0.382])
    half = 2.570581836 * differences.std(ddof=1) / np.sqrt(6)  # t(0.975, 5)
    assert t_interval(differences) == pytest.approx((differences.mean() - half, differences.mean() + half), abs=1e-9)


def test_holm_by_hand():
    """Sorted 0.01, 0.03, 0.04 times 3, 2, 1: 0.03, 0.06, 0.04, made monotone: 0.03, 0.06, 0.06; capped at 1."""
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.031, 0.9]) == pytest.approx([1.0, 0.093, 1.0])


def test_power_is_that_of_the_paired_t_test():
    """Against 40,000 simulated studies of normal differences: the share in which scipy's t test rejects."""
    rng = np.random.default_rng(1)
    draws = rng.normal(8.1, 21.1, size=(40_000, 6))
    simulated = np.mean(scipy.stats.ttest_1samp(draws, 0, axis=1).pvalue < 0.05)
    assert paired_t_power(8.1, 21.1, 6) == pytest.approx(simulated, abs=0.006)
    n = seeds_for_power(5.0, 21.1)
    assert paired_t_power(5.0, 21.1, n - 1) < 0.8 <= paired_t_power(5.0, 21.1, n)


def test_p_is_the_exact_sign_flip_test_of_the_paired_differences(table):
    """Against a direct enumeration of the 2^3 sign assignments of the seeds' differences."""
    runs = recipes()
    for _, row in table.iterrows():
        differences = fixture_differences(runs, row)
        flipped = np.array([np.mean(differences * signs) for signs in itertools.product((-1, 1), repeat=3)])
        direct = np.mean(np.abs(flipped) >= abs(differences.mean()) - 1e-12) if differences.any() else 1.0
        assert row["p"] == pytest.approx(direct, abs=1e-12)


@pytest.mark.parametrize(
    "differences, p",
    [
        ([0.1, 0.2, 0.05, 0.3, 0.01], 2 / 32),
        ([0.1, -0.1], 1.0),
        ([0.0, 0.0, 0.0], 1.0),
        ([0.3], 1.0),
        ([0.2, 0.1, -0.01], 0.5),
    ],
)
def test_permutation_p_by_hand(differences, p):
    """All five ahead: only the observed signs and their mirror are as far from zero (2 of 32); one seed's small
    deficit (-0.01) of three: the observed signs, all three ahead, and their two mirrors are as far (4 of 8)."""
    assert paired_permutation_p(np.array(differences)) == pytest.approx(p, abs=1e-12)


def test_pairing_removes_what_the_seeds_share(table):
    """odd-one-out: DCMHA is 5 points ahead at every seed, while the seeds' own accuracies spread over 30 points.
    Paired, the interval is the 5 points; an interval of the twins taken apart would spread over the seeds' spread."""
    row = table[(table["measure"] == "qk_pattern") & (table["group"] == "odd-one-out")].iloc[0]
    assert row["low"] == pytest.approx(0.05, abs=1e-9) and row["high"] == pytest.approx(0.05, abs=1e-9)
    assert row["mha_seed0"] - row["mha_seed1"] > 0.25


def test_a_higher_level_gives_a_wider_interval():
    differences = np.array([0.02, -0.01, 0.08, 0.15, 0.03, 0.05, -0.04, 0.1])
    narrow = sign_flip_interval(differences, level=0.5)
    wide = sign_flip_interval(differences, level=0.95)
    assert wide[0] < narrow[0] < differences.mean() < narrow[1] < wide[1] and narrow[2] < wide[2]
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


def test_a_parameter_matched_study_pairs_twins_of_other_widths(tmp_path):
    """The MHA twins may have a wider MLP than the DCMHA runs (a parameter-matched control), one width each: the
    table is the same as with equal widths, and summary.md's header says the widths; a second width of one
    architecture is refused by name."""
    runs_dir = tmp_path / "runs"
    shutil.copytree(FIXTURE, runs_dir)
    for path in runs_dir.glob("seed*/pythia-synth/recipe.json"):
        recipe = json.loads(path.read_text())
        recipe["train_config"]["d_mlp"] = 304
        path.write_text(json.dumps(recipe))
    table, _ = write_summary(runs_dir, tmp_path / "out")
    same_widths, _ = write_summary(FIXTURE, tmp_path / "same")
    pd.testing.assert_frame_equal(table, same_widths)
    widths = json.loads((FIXTURE / "seed0" / "dcpythia-synth" / "recipe.json").read_text())["train_config"]["d_mlp"]
    assert f"DCMHA d_mlp {widths}, MHA d_mlp 304." in (tmp_path / "out" / "summary.md").read_text()
    assert "d_mlp" not in (tmp_path / "same" / "summary.md").read_text()
    from dcinterp import plotting
    from dcinterp.study import read_study, write_figures

    drawn = []
    draw = plotting.plot_study_differences
    with pytest.MonkeyPatch.context() as patch:  # the figures name the wider MHA: their titles, read as drawn
        patch.setattr(plotting, "plot_study_differences", lambda *a, **k: drawn.append(draw(*a, **k)) or drawn[-1])
        write_figures(read_study(runs_dir), tmp_path / "figures")
    assert drawn and all("DCMHA - MHA (d_mlp 304) accuracy" in fig._suptitle.get_text() for fig in drawn)
    odd = runs_dir / "seed1" / "pythia-synth" / "recipe.json"
    recipe = json.loads(odd.read_text())
    recipe["train_config"]["d_mlp"] = 300
    odd.write_text(json.dumps(recipe))
    with pytest.raises(
        ValueError,
        match=r"seed1/pythia-synth/recipe.json: train_config d_mlp=300, but .* has 304: "
        r"one mha recipe a study",
    ):
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
    main(["summarize", str(FIXTURE), "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "| released | qk_pattern | matching-person |" in out and "paired seeds: 0, 1, 2" in out
    assert (tmp_path / "summary.csv").exists() and (tmp_path / "summary.md").read_text().strip() == out.strip()


def test_summarize_help_is_fast():
    """Like `python -m dcinterp.train --help` (tests/test_cli.py): no torch to import for the table."""
    import subprocess
    import sys

    script = (
        "import sys; from dcinterp.train.__main__ import main\n"
        "try:\n    main(['summarize', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "print('torch' in sys.modules)"
    )
    repo = Path(__file__).parents[1]
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=repo, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "RUNS_DIR" in result.stdout and result.stdout.strip().splitlines()[-1] == "False"


# --------------------------------------------------------------------------------------------------
# The screen, head diversity and figures: the fixture's runs, forked from shared starts at step 2,500 (seeds 0-3),
# seed 4 screened out, each run folder with a random model of the recipe's shape and a learning curve.
START_STEP = 2500
SCREENED = {"seed": 4, "start": "runs/starts/seed4/pythia-synth/checkpoint.pt", "step": START_STEP}
SCREENED |= {"answer_loss": 1.93, "threshold": 0.5, "reason": "the shared start did not form the lookup"}


def start_loss(seed: int) -> float:
    return 0.031 + 0.01 * seed


def probe_curve(arch: str, seed: int) -> list[dict]:
    """A made-up probe accuracy every 500 steps, the twins' the same until the shared start ends, distinct after."""
    return [
        {
            "step": s,
            "loss": 1.0,
            "eval_accuracy": round(0.1 + s / 10_000 + 0.02 * seed + 0.05 * (arch == "dcmha") * (s > START_STEP), 4),
        }
        for s in range(500, 5001, 500)
    ]


def fork(recipe: dict) -> dict:
    seed = recipe["seed"]
    started_from = {"path": f"runs/starts/seed{seed}/pythia-synth/checkpoint.pt", "step": START_STEP}
    return recipe | {"started_from": started_from | {"answer_loss": start_loss(seed)}}


@pytest.fixture(scope="module")
def forked_runs(tmp_path_factory):
    """FIXTURE's runs forked from shared starts, seed 4 screened out, and a random model in every run's folder
    (initialised from its own torch seed, so that no two runs have the same head diversity)."""
    import torch

    from dcinterp.model import HookedDCFormer
    from dcinterp.train import TrainConfig

    runs_dir = tmp_path_factory.mktemp("forked") / "runs"
    shutil.copytree(FIXTURE, runs_dir)
    for i, path in enumerate(sorted(runs_dir.rglob("recipe.json"))):
        recipe = json.loads(path.read_text())
        arch = recipe["train_config"]["arch"]
        recipe = fork(recipe) | {"history": probe_curve(arch, recipe["seed"])}
        path.write_text(json.dumps(recipe))
        torch.manual_seed(100 + i)
        HookedDCFormer(TrainConfig(**recipe["train_config"]).model_config(d_vocab=40)).save_pretrained(path.parent)
    (runs_dir / "seed4").mkdir()
    (runs_dir / "seed4" / "screened_out.json").write_text(json.dumps(SCREENED))
    return runs_dir


@pytest.fixture(scope="module")
def study(forked_runs):
    from dcinterp.study import read_study

    return read_study(forked_runs, head_diversity=True, level=0.95)


def test_the_screen_lists_the_seeds_kept_and_screened_out(forked_runs, tmp_path):
    table, _ = write_summary(forked_runs, tmp_path)
    screen = pd.read_csv(tmp_path / "screen.csv")
    assert list(screen["seed"]) == [0, 1, 2, 3, 4] and list(screen["kept"]) == [True] * 4 + [False]
    assert list(screen["answer_loss"]) == pytest.approx([start_loss(s) for s in range(4)] + [1.93], abs=1e-12)
    assert set(screen["threshold"]) == {0.5} and set(screen["step"]) == {START_STEP}
    header = (tmp_path / "summary.md").read_text().split("\n| ")[0]
    assert "Screen of the shared starts (each seed's start answer loss, at step 2500, threshold 0.5)" in header
    assert "kept seeds 0 (0.031), 1 (0.041), 2 (0.051), 3 (0.061)" in header
    assert "screened out seeds 4 (1.930: the shared start did not form the lookup)" in header
    assert 4 not in {int(c.removeprefix("mha_seed")) for c in table.columns if c.startswith("mha_seed")}


def test_without_a_screen_nothing_changes(tmp_path):
    write_summary(FIXTURE, tmp_path)
    assert not (tmp_path / "screen.csv").exists()
    assert "Screen" not in (tmp_path / "summary.md").read_text()


@pytest.mark.parametrize("problem", ["twins", "screened_with_runs", "broken_screen"])
def test_an_inconsistent_screen_is_refused_by_name(forked_runs, tmp_path, problem):
    runs_dir = tmp_path / "runs"
    shutil.copytree(forked_runs, runs_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    if problem == "twins":
        odd = runs_dir / "seed1" / "pythia-synth" / "recipe.json"
        recipe = json.loads(odd.read_text())
        recipe["started_from"]["answer_loss"] = 0.9
        odd.write_text(json.dumps(recipe))
        expected = r"seed1/pythia-synth/recipe.json: started_from .* but its twin .*seed1/dcpythia-synth"
    elif problem == "screened_with_runs":
        (runs_dir / "seed2" / "screened_out.json").write_text(json.dumps(SCREENED | {"seed": 2}))
        expected = r"seed2/screened_out.json: seed 2 is screened out, but .*seed2/.*recipe.json is a finished run"
    else:
        (runs_dir / "seed4" / "screened_out.json").write_text(json.dumps({"seed": 4}))
        expected = r"seed4/screened_out.json: not a screened-out seed's record \(KeyError"
    with pytest.raises(ValueError, match=expected):
        write_summary(runs_dir, tmp_path / "out")


def test_head_diversity_rows_pair_each_seeds_twins(study):
    """Each run's rows are Fig. 5's measure of the model in its own folder (QK normalised per head, OV raw), and the
    differences pair the twins of a seed; lower shares are DCMHA ahead."""
    from dcinterp.circuits import head_diversity
    from dcinterp.model import HookedDCFormer

    expected = {}
    for run in study.runs:
        model = HookedDCFormer.from_pretrained(run.folder)
        qk = head_diversity(model, normalize="head").qk.double().mean(0)
        ov = head_diversity(model, normalize="none").ov.double().mean(0)
        expected[run.arch, run.seed] = {
            **{f"{c}_area": float(curve.mean()) for c, curve in (("qk", qk), ("ov", ov))},
            **{f"{c}_k{k}": float(curve[k - 1]) for c, curve in (("qk", qk), ("ov", ov)) for k in (4, 16)},
        }
    rows = study.table[study.table["measure"] == "head_diversity"]
    assert set(rows["eval_set"]) == {"weights"} and set(rows["group"]) == set(expected["mha", 0])
    for _, row in rows.iterrows():
        dcmha = np.array([expected["dcmha", s][row["group"]] for s in PAIRED_SEEDS])
        mha = np.array([expected["mha", s][row["group"]] for s in PAIRED_SEEDS])
        assert len(set(dcmha) | set(mha)) == 6  # six different models
        for s in PAIRED_SEEDS:
            assert row[f"dcmha_seed{s}"] == pytest.approx(expected["dcmha", s][row["group"]], abs=1e-12)
        assert row["mha_seed3"] == pytest.approx(expected["mha", 3][row["group"]], abs=1e-12)
        assert row["difference"] == pytest.approx((dcmha - mha).mean(), abs=1e-12)
        assert row["dcmha_ahead"] == int((dcmha < mha).sum()) and row["seeds"] == 3
        draws = np.random.default_rng(3).integers(0, 3, size=(2000, 3))
        direct = np.quantile((dcmha - mha)[draws].mean(axis=1), [0.025, 0.975])
        assert (row["low"], row["high"]) == pytest.approx(tuple(direct), abs=1e-12)
        assert 0 < row["dcmha"] <= 1 and 0 < row["mha"] <= 1


def test_head_diversity_of_a_run_without_its_model_is_one_line(forked_runs, tmp_path, capsys):
    runs_dir = tmp_path / "runs"
    shutil.copytree(forked_runs, runs_dir)
    (runs_dir / "seed2" / "pythia-synth" / "model.safetensors").unlink()
    with pytest.raises(SystemExit) as exit_info:
        main(["summarize", str(runs_dir), "--head-diversity", "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert (
        len(err.splitlines()) == 1 and "seed2/pythia-synth: cannot load the run's model for its head diversity" in err
    )


def test_figures_cli_writes_every_figure(forked_runs, tmp_path, capsys):
    main(["summarize", str(forked_runs), "--out", str(tmp_path), "--figures", str(tmp_path / "figs")])
    names = sorted(p.name for p in (tmp_path / "figs").iterdir())
    assert names == ["differences_released.png", "head_diversity.png", "held_out_combos.png", "learning_curves.png"]
    assert "| weights | head_diversity | qk_k16 |" in capsys.readouterr().out


def test_figures_to_a_file_is_one_line(forked_runs, tmp_path, capsys):
    (tmp_path / "taken").write_text("")
    with pytest.raises(SystemExit):
        main(["summarize", str(forked_runs), "--out", str(tmp_path), "--figures", str(tmp_path / "taken")])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--figures" in err and "taken" in err


def bars(ax) -> list[float]:
    """left, right, left, right, ... of the bars of the axes' first bar container."""
    return [end for bar in ax.containers[0] for end in (bar.get_x(), bar.get_x() + bar.get_width())]


def collection_x(ax, label: str) -> list[float]:
    """The x of each point of the scatter labelled `label`."""
    return np.asarray(next(c for c in ax.collections if c.get_label() == label).get_offsets())[:, 0].tolist()


def test_difference_figure_draws_the_tables_numbers(study):
    from dcinterp.plotting import plot_study_differences

    fig = plot_study_differences(study.table, "released")
    rows = study.table[study.table["eval_set"] == "released"]
    measures = ("overall", "qk_pattern", "ov_transformation")
    assert len(fig.axes) == 3
    for ax, measure in zip(fig.axes, measures, strict=True):
        part = rows[rows["measure"] == measure]
        assert [t.get_text() for t in ax.get_yticklabels()] == (
            ["all tasks"] if measure == "overall" else list(part["group"])
        )
        ends = np.stack([100 * part["low"], 100 * part["high"]], axis=1).ravel()
        assert bars(ax) == pytest.approx(ends, abs=1e-9)
        assert collection_x(ax, "mean") == pytest.approx(100 * part["difference"].to_numpy(), abs=1e-9)
        for s in PAIRED_SEEDS:
            assert collection_x(ax, f"seed {s}") == pytest.approx(
                100 * (part[f"dcmha_seed{s}"] - part[f"mha_seed{s}"]).to_numpy(), abs=1e-9
            )
        assert not any(c.get_label() == "seed 3" for c in ax.collections)  # unpaired: no difference to draw
        assert [t.get_text() for t in ax.texts] == [
            f"DCMHA {100 * d:.1f}%, MHA {100 * m:.1f}%" for d, m in zip(part["dcmha"], part["mha"], strict=True)
        ]
        assert any(line.get_xdata()[0] == 0 for line in ax.lines)  # the zero line
    fig.savefig(io.BytesIO(), format="png")


def test_held_out_figure_joins_each_seeds_twins(study):
    from dcinterp.plotting import plot_study_held_out

    rows = study.table[study.table["measure"] == "held_out_combos"]
    fig = plot_study_held_out(study.table)
    pairs_ax, diff_ax = fig.axes
    lines = {line.get_label(): line.get_ydata() for line in pairs_ax.lines}
    row = rows.iloc[0]
    for s in PAIRED_SEEDS:
        assert lines[f"seed {s}"] == pytest.approx([100 * row[f"mha_seed{s}"], 100 * row[f"dcmha_seed{s}"]], abs=1e-9)
    assert lines["mean"] == pytest.approx([100 * row["mha"], 100 * row["dcmha"]], abs=1e-9)
    assert bars(diff_ax) == pytest.approx([100 * row["low"], 100 * row["high"]], abs=1e-9)
    assert "default split's combination tasks (trained on" in fig._suptitle.get_text()
    never_seen = study.table.assign(group=study.table["group"].replace("default_combo_tasks", "held_out_combos"))
    assert "never-seen combinations" in plot_study_held_out(never_seen)._suptitle.get_text()
    fig.savefig(io.BytesIO(), format="png")


def test_held_out_rows_name_the_tasks_they_are(tmp_path):
    runs_dir = tmp_path / "runs"
    shutil.copytree(FIXTURE, runs_dir)
    for path in runs_dir.rglob("recipe.json"):
        recipe = json.loads(path.read_text())
        if recipe.get("accuracy"):
            entry = recipe["accuracy"]["released"]
            entry["held_out_combos"] = entry["default_combo_tasks"] | {"accuracy": 0.25}
            path.write_text(json.dumps(recipe))
    runs, _ = read_runs(runs_dir)
    assert {run.accuracy["released"].get(("held_out_combos", "held_out_combos")) for run in runs} == {0.25}
    assert not any(("held_out_combos", "default_combo_tasks") in run.accuracy["released"] for run in runs)


def test_each_never_seen_combination_has_a_row_and_a_panel(tmp_path):
    """Runs that left two combinations out: one row per combination, the mean of its tasks' accuracies (each task
    has as many answers), paired like every row; the difference figure draws them in a fourth panel."""
    from dcinterp.plotting import plot_study_differences
    from dcinterp.train import split_tasks

    combos = ["same-person:superclass", "other-person:capability"]
    runs_dir = tmp_path / "runs"
    shutil.copytree(FIXTURE, runs_dir)
    rng = np.random.default_rng(0)
    per_task = {}
    for path in runs_dir.rglob("recipe.json"):
        recipe = json.loads(path.read_text())
        recipe["train_config"]["exclude_combos"] = combos
        if recipe.get("accuracy"):
            entry = recipe["accuracy"]["released"]
            entry["held_out_combos"] = entry.pop("default_combo_tasks")
            entry["per_task"] = {f"task{i}": round(float(rng.uniform()), 3) for i in range(74)}
            per_task[recipe["train_config"]["arch"], recipe["seed"]] = entry["per_task"]
        path.write_text(json.dumps(recipe))
    table, _ = write_summary(runs_dir, tmp_path)
    rows = table[table["measure"] == "held_out_combo"]
    assert list(rows["group"]) == sorted(combos)
    for _, row in rows.iterrows():
        tasks = split_tasks(row["group"])[1]
        assert len(tasks) == 2
        for arch in ("dcmha", "mha"):
            for seed in PAIRED_SEEDS:
                direct = np.mean([per_task[arch, seed][t] for t in tasks])
                assert row[f"{arch}_seed{seed}"] == pytest.approx(direct, abs=1e-12)
        differences = [row[f"dcmha_seed{s}"] - row[f"mha_seed{s}"] for s in PAIRED_SEEDS]
        assert row["difference"] == pytest.approx(np.mean(differences), abs=1e-12) and row["seeds"] == 3
    fig = plot_study_differences(table, "released")
    assert len(fig.axes) == 4 and fig.axes[3].get_title(loc="left") == "never-seen combination"
    assert [t.get_text() for t in fig.axes[3].get_yticklabels()] == ["all 2 combinations", *sorted(combos)]
    fig.savefig(io.BytesIO(), format="png")


def held_out_and_trained_on(tmp_path, combos) -> tuple[Path, Path, dict]:
    """Two copies of FIXTURE forked from the same starts: `heldout` left `combos` out, `full` trained on every
    task; random per-task accuracies, {(folder, arch, seed): per_task}."""
    rng = np.random.default_rng(1)
    per_task = {}
    for folder, left_out in (("heldout", combos), ("full", [])):
        shutil.copytree(FIXTURE, tmp_path / folder)
        for path in (tmp_path / folder).rglob("recipe.json"):
            recipe = fork(json.loads(path.read_text()))
            recipe["train_config"]["exclude_combos"] = left_out
            if recipe.get("accuracy"):
                entry = recipe["accuracy"]["released"]
                if left_out:
                    entry["held_out_combos"] = entry.pop("default_combo_tasks")
                entry["per_task"] = {f"task{i}": round(float(rng.uniform()), 3) for i in range(74)}
                per_task[folder, recipe["train_config"]["arch"], recipe["seed"]] = entry["per_task"]
            path.write_text(json.dumps(recipe))
    return tmp_path / "heldout", tmp_path / "full", per_task


def test_held_out_change_is_each_runs_loss_against_its_twin_trained_on_every_task(tmp_path):
    """`--trained-on`: per combination and for all of them, the mean accuracy of the left-out tasks minus that of
    the same seed and architecture's run that trained on them, paired DCMHA - MHA like every row; the difference
    figure draws them in a fifth panel."""
    from dcinterp.plotting import plot_study_differences
    from dcinterp.train import split_tasks

    combos = ["same-person:superclass", "other-person:capability"]
    heldout, full, per_task = held_out_and_trained_on(tmp_path, combos)
    table, left_out = write_summary(heldout, tmp_path / "out", trained_on=full)
    rows = table[table["measure"] == "held_out_change"]
    assert sorted(rows["group"]) == sorted(["held_out_combos", *combos])
    for _, row in rows.iterrows():
        tasks = split_tasks(combos if row["group"] == "held_out_combos" else row["group"])[1]
        assert len(tasks) == (4 if row["group"] == "held_out_combos" else 2)
        for arch in ("dcmha", "mha"):
            for seed in PAIRED_SEEDS:
                never_seen = np.mean([per_task["heldout", arch, seed][t] for t in tasks])
                trained = np.mean([per_task["full", arch, seed][t] for t in tasks])
                assert row[f"{arch}_seed{seed}"] == pytest.approx(never_seen - trained, abs=1e-12)
        differences = [row[f"dcmha_seed{s}"] - row[f"mha_seed{s}"] for s in PAIRED_SEEDS]
        assert row["difference"] == pytest.approx(np.mean(differences), abs=1e-12) and row["seeds"] == 3
        assert row["dcmha_ahead"] == sum(d > 0 for d in differences)  # ahead: lost less
    assert "held_out_change rows" in (tmp_path / "out" / "summary.md").read_text()
    fig = plot_study_differences(table, "released")
    assert len(fig.axes) == 5 and fig.axes[4].get_title(loc="left") == "never seen, against the twin trained on it"
    assert [t.get_text() for t in fig.axes[4].get_yticklabels()] == ["all 2 combinations", *sorted(combos)]
    fig.savefig(io.BytesIO(), format="png")


@pytest.mark.parametrize(
    "problem", ["twins left combinations out", "twins of another recipe", "twins of another start", "no twin"]
)
def test_trained_on_twins_are_checked_by_name(tmp_path, capsys, problem):
    heldout, full, _ = held_out_and_trained_on(tmp_path, ["same-person:superclass"])
    if problem == "no twin":
        shutil.rmtree(full / "seed1" / "pythia-synth")
        _, left_out = write_summary(heldout, tmp_path / "out", trained_on=full)
        assert any("no mha run of seed 1 under" in line and "no held_out_change" in line for line in left_out)
        return
    change = {"exclude_combos": ["other-person:capability"]} if "combinations" in problem else {"lr": 1.0}
    for path in full.rglob("recipe.json"):  # every run, so that the folder is one recipe of its own
        recipe = json.loads(path.read_text())
        if "start" in problem:
            recipe["started_from"]["step"] = 3000
        else:
            recipe["train_config"] |= change
        path.write_text(json.dumps(recipe))
    with pytest.raises(SystemExit) as exit_info:
        main(["summarize", str(heldout), "--out", str(tmp_path / "out"), "--trained-on", str(full)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    expected = {
        "twins left combinations out": "left other-person:capability out; --trained-on needs runs trained on every",
        "twins of another recipe": "train_config lr=1.0, but",
        "twins of another start": "started from {'path': 'runs/starts/seed0/pythia-synth/checkpoint.pt', 'step': 3000",
    }[problem]
    assert "full/seed0/dcpythia-synth/recipe.json: " + expected in err
    assert not (tmp_path / "out" / "summary.csv").exists()


def test_head_diversity_figure_draws_every_run_and_each_arches_mean(study):
    from dcinterp.plotting import plot_study_head_diversity
    from dcinterp.study import diversity_frame

    fig = plot_study_head_diversity(diversity_frame(study.runs), marks=(4, 16))
    for ax, circuit in zip(fig.axes, ("qk", "ov"), strict=True):
        thin = [line for line in ax.lines if line.get_linewidth() < 1]
        assert len(thin) == len(study.runs) == 7
        for arch, name in (("dcmha", "DCMHA"), ("mha", "MHA")):
            curves = [
                getattr(run.diversity, circuit).double().mean(0).numpy() for run in study.runs if run.arch == arch
            ]
            thick = next(line for line in ax.lines if line.get_label() == f"{name}: mean of {len(curves)} runs")
            assert thick.get_ydata() == pytest.approx(np.mean(curves, axis=0), abs=1e-12)
        assert sorted(line.get_xdata()[0] for line in ax.lines if line.get_linestyle() == ":") == [4, 16]
    fig.savefig(io.BytesIO(), format="png")


def test_learning_curves_figure_draws_each_runs_probe_and_the_start(study):
    from dcinterp.plotting import plot_study_learning_curves
    from dcinterp.study import learning_curves

    fig = plot_study_learning_curves(learning_curves(study.runs))
    lines = {line.get_label(): line for line in fig.axes[0].lines}
    for run in study.runs:
        line = lines[f"seed {run.seed} {'DCMHA' if run.arch == 'dcmha' else 'MHA'}"]
        curve = probe_curve(run.arch, run.seed)
        assert list(line.get_xdata()) == [entry["step"] for entry in curve]
        assert line.get_ydata() == pytest.approx([100 * entry["eval_accuracy"] for entry in curve], abs=1e-9)
        assert line.get_linestyle() == ("-" if run.arch == "dcmha" else "--")
    assert list(lines[f"shared start ends (step {START_STEP})"].get_xdata()) == [START_STEP, START_STEP]
    fig.savefig(io.BytesIO(), format="png")


def test_a_start_without_a_logged_answer_loss_is_reported_as_such(forked_runs, tmp_path):
    """dcinterp.train writes answer_loss null for a start that logged none (and screens such a seed out)."""
    runs_dir = tmp_path / "runs"
    shutil.copytree(forked_runs, runs_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    for path in (runs_dir / "seed2").rglob("recipe.json"):
        recipe = json.loads(path.read_text())
        recipe["started_from"]["answer_loss"] = None
        path.write_text(json.dumps(recipe))
    (runs_dir / "seed4" / "screened_out.json").write_text(json.dumps(SCREENED | {"answer_loss": None}))
    write_summary(runs_dir, tmp_path / "out")
    screen = pd.read_csv(tmp_path / "out" / "screen.csv")
    assert screen["answer_loss"].isna().tolist() == [False, False, True, False, True]
    header = (tmp_path / "out" / "summary.md").read_text().split("\n| ")[0]
    assert "kept seeds 0 (0.031), 1 (0.041), 2 (no answer loss logged), 3 (0.061)" in header
    assert "screened out seeds 4 (the shared start did not form the lookup)" in header


# --------------------------------------------------------------------------------------------------
# The study page (docs/study.md): every table it prints, regenerated from its committed data (docs/study-data).
REPO = Path(__file__).parents[1]
STUDY_DATA = REPO / "docs" / "study-data"
STUDY_PAGE = REPO / "docs" / "study.md"


@pytest.fixture(scope="module")
def study_data():
    from dcinterp.study import read_table_data

    return read_table_data(STUDY_DATA)


def test_the_study_page_prints_the_tables_its_data_give(study_data):
    """`summarize --from-table docs/study-data` regenerates each table of the page, character for character."""
    from dcinterp.study import page_tables

    page = STUDY_PAGE.read_text()
    for name, text in page_tables(study_data).items():
        assert text in page, f"docs/study.md does not print the {name} table that docs/study-data gives:\n{text}"


def test_the_primary_endpoint_is_its_data(study_data):
    """-12.7 points, p = 0.47 (30 of the 64 sign assignments as far from zero), the interval the range of the
    six seeds' values at 62/64."""
    from dcinterp.study import primary_endpoint

    values = study_data.held_out_change["difference"].to_numpy()
    endpoint = primary_endpoint(study_data)
    assert endpoint["mean"] == pytest.approx(values.mean()) and round(endpoint["mean"], 1) == -12.7
    assert endpoint["p"] == pytest.approx(30 / 64)
    assert (endpoint["low"], endpoint["high"], endpoint["level"]) == pytest.approx((-72.5, 19.0, 62 / 64))


def test_the_committed_data_agree_with_each_other(study_data):
    """The person-answer rates given for the models trained on every task are those of accuracy.csv; a model
    "answers" the two person-answer patterns where their mean is 2/3 or more (chance is 1/3), "in part" between
    1/2 and 2/3; the screen keeps exactly the seeds of the runs."""
    answers, accuracy = study_data.person_answer, study_data.accuracy
    rates = answers.dropna(subset=["matching_person", "not_matching_person"])
    for row in rates.itertuples():
        mean = (row.matching_person + row.not_matching_person) / 2
        assert row.answers == ("yes" if mean >= 200 / 3 else "part" if mean >= 50 else "no"), row
        if row.arch in ("dcmha", "mha") and row.study == "full":
            at = accuracy[
                (accuracy["study"] == "full") & (accuracy["arch"] == row.arch) & (accuracy["seed"] == row.seed)
            ]
            by_group = dict(zip(at["group"], at["accuracy"], strict=True))
            assert (by_group["matching-person"], by_group["not-matching-person"]) == (
                row.matching_person,
                row.not_matching_person,
            )
    kept = set(study_data.screen.loc[study_data.screen["kept"], "seed"])
    assert kept == set(accuracy["seed"]) == set(study_data.held_out_change["seed"]) == set(answers["seed"])
    assert (study_data.screen["kept"] == (study_data.screen["answer_loss"] < study_data.screen["threshold"])).all()


def test_summarize_from_table_cli(capsys, tmp_path):
    """The CLI prints the tables, writes them to --out, and draws the two figures the data can draw; a folder of
    runs and --from-table together, or a data folder without its files, are one line and exit 2."""
    main(["summarize", "--from-table", str(STUDY_DATA), "--out", str(tmp_path / "out"), "--figures", str(tmp_path)])
    out = capsys.readouterr().out
    assert (tmp_path / "out" / "tables.md").read_text().strip() == out.strip() and "<!-- primary -->" in out
    assert {p.name for p in tmp_path.glob("*.png")} == {
        "study_differences_released.png",
        "study_heldout_differences_released.png",
    }
    for argv, message in (
        (["summarize", str(FIXTURE), "--from-table", str(STUDY_DATA)], "one of the two"),
        (["summarize", "--from-table", str(tmp_path / "out")], "accuracy.csv: cannot read"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and len(err.splitlines()) == 1 and message in err, err
