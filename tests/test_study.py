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

from dcinterp.study import paired_bootstrap_interval, paired_permutation_p, read_runs, write_summary
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
        differences = fixture_differences(runs, row)
        draws = np.random.default_rng(7).integers(0, 3, size=(4000, 3))
        direct = np.quantile(differences[draws].mean(axis=1), [0.025, 0.975])
        assert (row["low"], row["high"]) == pytest.approx(tuple(direct), abs=1e-12)
        exact = np.array([differences[list(pick)].mean() for pick in itertools.product(range(3), repeat=3)])
        slack = 0.01 + 1e-12
        for end, tail in ((row["low"], 0.025), (row["high"], 0.975)):
            assert (exact < end - 1e-12).mean() <= tail + slack and (exact <= end + 1e-12).mean() >= tail - slack


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
    table, _ = write_summary(runs_dir, tmp_path / "out", n_resamples=400)
    same_widths, _ = write_summary(FIXTURE, tmp_path / "same", n_resamples=400)
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
        write_figures(read_study(runs_dir, n_resamples=100), tmp_path / "figures")
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
    main(["summarize", str(FIXTURE), "--out", str(tmp_path), "--resamples", "500"])
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

    return read_study(forked_runs, head_diversity=True, level=0.95, n_resamples=2000, seed=3)


def test_the_screen_lists_the_seeds_kept_and_screened_out(forked_runs, tmp_path):
    table, _ = write_summary(forked_runs, tmp_path, n_resamples=200)
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
    write_summary(FIXTURE, tmp_path, n_resamples=200)
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
    table, _ = write_summary(runs_dir, tmp_path, n_resamples=200)
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
    table, left_out = write_summary(heldout, tmp_path / "out", trained_on=full, n_resamples=200)
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
        _, left_out = write_summary(heldout, tmp_path / "out", trained_on=full, n_resamples=50)
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
    write_summary(runs_dir, tmp_path / "out", n_resamples=200)
    screen = pd.read_csv(tmp_path / "out" / "screen.csv")
    assert screen["answer_loss"].isna().tolist() == [False, False, True, False, True]
    header = (tmp_path / "out" / "summary.md").read_text().split("\n| ")[0]
    assert "kept seeds 0 (0.031), 1 (0.041), 2 (no answer loss logged), 3 (0.061)" in header
    assert "screened out seeds 4 (the shared start did not form the lookup)" in header
