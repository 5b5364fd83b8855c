"""The paired study's table: the accuracies of a folder of runs, and the paired difference DCMHA - MHA per seed.

    python -m dcinterp.train --seeds 0-4 --out runs/study ...     # RUNS_DIR/seed<N>/<name>/recipe.json
    python -m dcinterp.train summarize runs/study                 # runs/study/summary.csv and summary.md
    python -m dcinterp.train summarize runs/study --head-diversity    # + each run's head diversity (Fig. 5)
    python -m dcinterp.train summarize runs/study --figures figs     # + the study's figures (PNG), see below
    python -m dcinterp.train summarize runs/study-heldout --trained-on runs/study   # + held_out_change rows
    python -m dcinterp.train summarize --from-table docs/study-data --out DIR   # the study page's tables (below)

Every finished run's recipe.json under the folder is read (runs stopped early, or not evaluated, are listed and
left out). The DCMHA and MHA runs are paired by seed: the twins of a seed share the data order and the initial
weights of everything they share (`dcinterp.train`), so their difference is the architecture's, not the draw's.
The table has one row per evaluation set (released, generated_seed0, test_set) and measure: the overall accuracy,
the accuracy per QK pattern and per OV transformation, and the accuracy on the held-out combinations (the tasks a
run left out with `--exclude-combos`, or the default split's tasks when it left none out) and, for runs that left
combinations out, on each of them (`held_out_combo` rows, one per combination: the mean of its tasks' accuracies,
every task having as many answers). Given `--trained-on DIR`, the same seeds' runs trained on every task, it adds
what each run lost for never seeing them (`held_out_change` rows: its accuracy on the left-out tasks, all and per
combination, minus its twin's under DIR), which sets apart "composes a new combination better" from "learned the
pattern or the transformation better". Its columns: each
architecture's mean over the paired seeds, the mean paired difference DCMHA - MHA with its interval, the number of
seeds in which DCMHA is ahead, and each run's own accuracy (`dcmha_seed0`, `mha_seed0`, ...).

The interval is the sign-flip test inverted (Hartigan's subset means): the 2^n - 1 means of the nonempty subsets
of the n seeds' differences cut the line into 2^n gaps, and when the differences are symmetric about their true
mean, each gap holds it with probability 1 / 2^n; the interval from the k-th smallest subset mean to the k-th
largest holds it with probability 1 - 2k / 2^n exactly, k the largest that keeps this at `level` or more (column
`level`: the interval's exact level). Over seeds, because a seed is the unit the experiment repeats: it fixes the
initialisation and the data of both twins, and what varies most from one seed to another is whether and when a
model forms the lookup, not the evaluation samples (which are the same for both twins, so their own noise largely
cancels in the paired difference). Paired, because a seed's twins are not independent draws. Why not a percentile
bootstrap: over few seeds it covers the true mean less often than it says (at 6 seeds, 81-86% of the time for a
95% interval); why not a t interval: the outcomes are bimodal (a model forms a lookup or does not), far from
normal. At 6 seeds the 95% interval is the range of the six differences (its exact level 62/64 = 96.9%); at 5 or
fewer no interval reaches 95%, and the range is given with its lower level.

The p column is the exact paired permutation test of "no difference" (Fisher's sign-flip test, two-sided, by
`scipy.stats.permutation_test`): under the null hypothesis each seed's difference is as likely to have the other
sign, so p is the share of the 2^n sign assignments whose mean difference is at least as far from zero as the one
observed. It assumes nothing about the differences' distribution but their symmetry, and its smallest value is
2 / 2^n: 0.25 with 3 seeds, 0.0625 with 5, 0.031 with 6, 0.0078 with 8. The interval and p are one test read two
ways: at 6 seeds, the 95% interval excludes 0 exactly when every seed's difference has the same sign, p = 0.031.

The screen. A study's runs may start from a shared start (a run stopped at the end of the focus phase, where the
twins are still the same model): a forked run's recipe.json names it under `started_from` (path, step, and its
answer_loss: the mean answer-token loss over its last 100 steps), and a seed whose start did not form the lookup is
screened out, with `seed<N>/screened_out.json` (seed, start, step, answer_loss, threshold, reason) and no runs. The
header of summary.md then lists the seeds kept and those screened out with their start's answer loss and the
threshold, and screen.csv has one row per seed (seed, kept, answer_loss, threshold, step, start, reason).

Head diversity (`--head-diversity`; `--figures` computes it too). Each run's model is loaded from its folder and
`circuits.head_diversity` (Fig. 5) gives, per layer, the cumulative share of variance captured by the first k
principal components of the layer's concatenated QK circuits and of its OV circuits. The study's models have
QK-norm, under which one head's QK scale is free (docs/conventions.md), so the QK curves are computed with
`normalize="head"` and the OV curves as the paper does (`normalize="none"`). Rows of eval_set `weights`, measure
`head_diversity`, each a share of variance (in % in summary.md), from the curve averaged over layers:
`qk_area`/`ov_area`, the curve's mean over all its k (the area under it: 1 when one component holds everything,
about 0.5 when every component holds as much); `qk_k4`/`ov_k4`, at k = n_heads (4 components: all of it if
each head were one direction); `qk_k16`/`ov_k16`, at k = d_head (one head's rank: all of it if the 4 heads read
and wrote one common subspace). Lower is more diverse heads, so a negative difference says DCMHA's heads are more
diverse, and on these rows `dcmha_ahead` counts the seeds in which DCMHA's share is lower.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import scipy.stats

from .cli import Parser, check_writable_dir
from .train.recipe import DEFAULT_RECORD, split_tasks  # DEFAULT_RECORD: a setting added since a run was trained

if TYPE_CHECKING:
    from .circuits import HeadDiversity

ARCHES = ("dcmha", "mha")
MEASURES = (
    "overall",
    "qk_pattern",
    "ov_transformation",
    "held_out_combos",
    "held_out_combo",
    "held_out_change",
    "head_diversity",
)
LOWER_IS_AHEAD = ("head_diversity",)  # measures on which DCMHA is ahead when its value is lower
WEIGHTS = "weights"  # the eval_set of the rows read from the weights, not from an evaluation
DIVERSITY_NORMALIZE = {"qk": "head", "ov": "none"}  # see the module's docstring
MAY_DIFFER = ("seed", "arch", "threads", "max_minutes", "log_every", "eval_every")  # in one study: not what is learned
# ... and between the architectures, one value each: a parameter-matched twin's wider MLP (`--d-mlp`, widened from the
# shared start by dcinterp.train)
MAY_DIFFER_BETWEEN_ARCHES = ("d_mlp",)


@dataclass
class RunResult:
    """One run's accuracies, as its recipe.json records them.

    Attributes:
        path: the run's recipe.json.
        arch: "dcmha" or "mha".
        seed: the run's seed.
        config: its train_config, with DEFAULT_RECORD's values for settings added since it was trained.
        accuracy: {eval set: {(measure, group): accuracy}}.
        per_task: {eval set: {task id: accuracy}}, where recipe.json has them.
        history: recipe["history"]: the logged steps, some with eval_accuracy.
        started_from: {"path", "step", "answer_loss"} of the shared start, for a forked run; else None.
        diversity: the run's head diversity, set by `add_head_diversity`; else None.
    """

    path: Path
    arch: str
    seed: int
    config: dict
    accuracy: dict
    per_task: dict = field(default_factory=dict)
    history: list = field(default_factory=list)
    started_from: dict | None = None
    diversity: HeadDiversity | None = None

    @property
    def folder(self) -> Path:
        return self.path.parent


def read_run(path: Path) -> RunResult | str:
    """One run's result, from its recipe.json.

    Args:
        path: the run's recipe.json.

    Returns:
        The run's result, or why it is left out (one line): stopped early, or not evaluated.

    Raises:
        ValueError: the file is not a dcinterp.train recipe, or its started_from lacks the start's step and loss.
    """
    try:
        recipe = json.loads(path.read_text())
        config, evaluated = {**DEFAULT_RECORD, **recipe["train_config"]}, recipe.get("accuracy")
        arch, seed = config["arch"], int(recipe["seed"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not a dcinterp.train recipe ({type(e).__name__}: {e})") from e
    if recipe.get("stopped_early"):
        return f"{path}: stopped early at step {recipe.get('steps')} (continue it with --resume)"
    if not evaluated:
        return f"{path}: not evaluated (python -m dcinterp.train --eval-only)"
    accuracy, per_task = {}, {}
    for eval_set, entry in evaluated.items():
        if not isinstance(entry, dict) or "accuracy" not in entry:
            continue
        if entry.get("per_task"):
            per_task[eval_set] = entry["per_task"]
        values = {("overall", "all"): entry["accuracy"]}
        for measure, key in (("qk_pattern", "by_qk_pattern"), ("ov_transformation", "by_ov_transformation")):
            values.update({(measure, group): value for group, value in entry.get(key, {}).items()})
        for key in ("held_out_combos", "default_combo_tasks"):  # the left-out tasks, else the default split's
            held = entry.get(key)
            if held and held.get("accuracy") is not None:
                values[("held_out_combos", key)] = held["accuracy"]
                break
        if entry.get("held_out_combos") and entry.get("per_task"):
            for combo in config["exclude_combos"]:
                tasks = [entry["per_task"].get(task) for task in split_tasks(combo)[1]]
                if None not in tasks:
                    values[("held_out_combo", combo)] = float(np.mean(tasks))
        accuracy[eval_set] = values
    started_from = recipe.get("started_from")
    if started_from is not None and not (
        isinstance(started_from, dict) and {"step", "answer_loss"} <= started_from.keys()
    ):
        raise ValueError(f"{path}: started_from must hold the start's path, step and answer_loss, not {started_from!r}")
    return RunResult(path, arch, seed, config, accuracy, per_task, recipe.get("history") or [], started_from)


def read_runs(runs_dir: Path) -> tuple[list[RunResult], list[str]]:
    """The finished runs under a folder, checked to be one recipe.

    Args:
        runs_dir: the study's folder, holding `RUNS_DIR/seed<N>/<name>/recipe.json`.

    Returns:
        (the finished runs, the lines saying which were left out and why).

    Raises:
        ValueError: no such folder, no recipe.json under it, an unreadable recipe, or runs of different recipes
            (`check_one_recipe`).
    """
    if not runs_dir.is_dir():
        raise ValueError(f"{runs_dir}: no such folder of runs")
    paths = sorted(runs_dir.rglob("recipe.json"))
    if not paths:
        raise ValueError(f"{runs_dir}: no recipe.json under it (a run writes OUT/seed<N>/<name>/recipe.json)")
    runs, left_out = [], []
    for path in paths:
        result = read_run(path)
        (left_out if isinstance(result, str) else runs).append(result)
    check_one_recipe(runs)
    return runs, left_out


def check_one_recipe(runs: list[RunResult]) -> None:
    """Checks that the runs of a folder differ only where a study may.

    Every run must have trained with the same settings but those of MAY_DIFFER (and, between the architectures,
    MAY_DIFFER_BETWEEN_ARCHES), and no seed may have two runs of one architecture: else the pairs would compare more
    than the architecture (and its parameter-matched width).

    Args:
        runs: the folder's runs.

    Raises:
        ValueError: naming the run and the first setting at fault, or a seed's second run of one architecture.
    """
    seen: dict[tuple[str, int], Path] = {}
    first_of_arch: dict[str, RunResult] = {}
    for run in runs:
        if (run.arch, run.seed) in seen:
            raise ValueError(
                f"{run.path}: a second {run.arch} run of seed {run.seed} (the first: {seen[run.arch, run.seed]})"
            )
        seen[run.arch, run.seed] = run.path
        check_same_recipe(run, runs[0], "summarize one recipe's runs at a time", MAY_DIFFER + MAY_DIFFER_BETWEEN_ARCHES)
        check_same_recipe(run, first_of_arch.setdefault(run.arch, run), f"one {run.arch} recipe a study")


def mlp_widths(runs: list[RunResult]) -> dict[str, int] | None:
    """Each architecture's d_mlp where they differ (a parameter-matched study).

    Args:
        runs: the study's runs.

    Returns:
        {arch: d_mlp}, or None where every run has one width.
    """
    widths = {run.arch: run.config.get("d_mlp") for run in runs}
    return widths if len(set(widths.values())) > 1 else None


def width_lines(runs: list[RunResult]) -> list[str]:
    """A sentence for summary.md's header where the architectures' MLPs differ (a parameter-matched study).

    Args:
        runs: the study's runs.

    Returns:
        The sentence in a list, or an empty list.
    """
    widths = mlp_widths(runs)
    if widths is None:
        return []
    return [
        "The architectures' MLPs differ (a parameter-matched study): "
        + ", ".join(f"{arch.upper()} d_mlp {width}" for arch, width in sorted(widths.items()))
        + "."
    ]


def check_same_recipe(run: RunResult, other: RunResult, why: str, may_differ: tuple = MAY_DIFFER) -> None:
    """Checks that `run` trained with `other`'s settings, but those of `may_differ`.

    Args:
        run: the run checked.
        other: the run it is compared with.
        why: the end of the error message: what the check is for.
        may_differ: the train_config keys that may differ.

    Raises:
        ValueError: naming the first key that differs.
    """
    for key in sorted(set(run.config) | set(other.config)):
        if key not in may_differ and run.config.get(key) != other.config.get(key):
            raise ValueError(
                f"{run.path}: train_config {key}={run.config.get(key)!r}, but {other.path} has "
                f"{other.config.get(key)!r}: {why}"
            )


def add_held_out_change(runs: list[RunResult], trained_on: list[RunResult], trained_on_dir: Path) -> list[str]:
    """Gives every run that left combinations out its `held_out_change` rows.

    Per combination, and for all of them (group `held_out_combos`): its accuracy on their tasks minus that of its
    twin trained on every task (the run of the same seed and architecture under `trained_on_dir`, from the same
    start). 0 is nothing lost for never having seen them.

    Args:
        runs: the study's runs; their `accuracy` gains the rows.
        trained_on: the runs trained on every task.
        trained_on_dir: their folder, for the messages.

    Returns:
        The lines naming the runs that have no such twin.

    Raises:
        ValueError: a twin that left tasks out too, or differs from its run in recipe or start.
    """
    twins = {(run.arch, run.seed): run for run in trained_on}
    missing = []
    for run in runs:
        combos = run.config["exclude_combos"]
        if not combos:
            continue
        twin = twins.get((run.arch, run.seed))
        if twin is None:
            missing.append(
                f"{run.path}: no {run.arch} run of seed {run.seed} under {trained_on_dir} (no held_out_change)"
            )
            continue
        check_trained_on_every_task(run, twin)
        groups = {"held_out_combos": split_tasks(combos)[1], **{combo: split_tasks(combo)[1] for combo in combos}}
        for eval_set, never_seen in run.per_task.items():
            trained = twin.per_task.get(eval_set, {})
            for group, tasks in groups.items():
                if all(task in never_seen and task in trained for task in tasks):
                    change = np.mean([never_seen[t] for t in tasks]) - np.mean([trained[t] for t in tasks])
                    run.accuracy[eval_set][("held_out_change", group)] = float(change)
    return missing


def check_trained_on_every_task(run: RunResult, twin: RunResult) -> None:
    """Checks that the twin trained on every task, with the run's recipe otherwise, from the run's start.

    Args:
        run: a run that left combinations out.
        twin: the run of the same seed and architecture trained on every task.

    Raises:
        ValueError: the twin left tasks out, differs in another setting, or started elsewhere.
    """
    if twin.config["exclude_combos"]:
        left_out = ", ".join(twin.config["exclude_combos"])
        raise ValueError(f"{twin.path}: left {left_out} out; --trained-on needs runs trained on every task")
    why = "the twin trained on every task must share the rest of the recipe"
    check_same_recipe(twin, run, why, may_differ=(*MAY_DIFFER, "exclude_combos"))
    start, twin_start = run.started_from or {}, twin.started_from or {}
    if (start.get("path"), start.get("step")) != (twin_start.get("path"), twin_start.get("step")):
        raise ValueError(
            f"{twin.path}: started from {twin_start or 'scratch'}, but {run.path} from {start or 'scratch'}"
        )


SCREEN_COLUMNS = ("seed", "kept", "answer_loss", "threshold", "step", "start", "reason")


def loss_or_nan(value) -> float:
    """A start's answer loss; NaN where none was logged (dcinterp.train writes null then).

    Args:
        value: the logged loss, or None.

    Returns:
        The loss as a float.
    """
    return np.nan if value is None else float(value)


def same_start(a: dict, b: dict) -> bool:
    """Whether two rows of the screen name one start (the same checkpoint, step and answer loss, NaN or not).

    Args:
        a: a row of the screen.
        b: another.

    Returns:
        True where they name one start.
    """
    same_loss = np.array_equal([a["answer_loss"]], [b["answer_loss"]], equal_nan=True)
    return (a["start"], a["step"]) == (b["start"], b["step"]) and same_loss


def read_screened_out(path: Path) -> dict:
    """A screened_out.json as a row of the screen.

    Args:
        path: a seed's screened_out.json.

    Returns:
        The row, with the keys of SCREEN_COLUMNS.

    Raises:
        ValueError: the file is not a screened-out seed's record, naming it.
    """
    try:
        entry = json.loads(path.read_text())
        return {
            "seed": int(entry["seed"]),
            "kept": False,
            "answer_loss": loss_or_nan(entry["answer_loss"]),
            "threshold": float(entry["threshold"]),
            "step": int(entry["step"]),
            "start": str(entry["start"]),
            "reason": str(entry.get("reason", "")),
        }
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"{path}: not a screened-out seed's record ({type(e).__name__}: {e}); "
            "expected seed, start, step, answer_loss, threshold"
        ) from e


def read_screen(runs_dir: Path, runs: list[RunResult]) -> pd.DataFrame:
    """One row per seed: the seeds screened out and the seeds kept.

    The seeds screened out come from their screened_out.json, the seeds kept from their runs' started_from; a kept
    seed's threshold is started_from's own if it has one, else the screened-out seeds' when they agree on one.

    Args:
        runs_dir: the study's folder.
        runs: its finished runs.

    Returns:
        The screen, columns SCREEN_COLUMNS; empty when no run started from a shared start and no seed was screened
        out.

    Raises:
        ValueError: a seed screened out twice, or screened out and run, or twins that started from different starts.
    """
    screened: dict[int, tuple[dict, Path]] = {}
    for path in sorted(runs_dir.rglob("screened_out.json")):
        row = read_screened_out(path)
        if row["seed"] in screened:
            raise ValueError(f"{path}: seed {row['seed']} is screened out twice (also in {screened[row['seed']][1]})")
        ran = [run.path for run in runs if run.seed == row["seed"]]
        if ran:
            raise ValueError(f"{path}: seed {row['seed']} is screened out, but {ran[0]} is a finished run of it")
        screened[row["seed"]] = (row, path)
    thresholds = {row["threshold"] for row, _ in screened.values()}
    shared_threshold = next(iter(thresholds)) if len(thresholds) == 1 else np.nan
    kept: dict[int, tuple[dict, Path]] = {}
    for run in runs:
        start = run.started_from
        if start is None:
            continue
        row = {
            "seed": run.seed,
            "kept": True,
            "answer_loss": loss_or_nan(start["answer_loss"]),
            "threshold": float(start.get("threshold", shared_threshold)),
            "step": int(start["step"]),
            "start": str(start.get("path", "")),
            "reason": "",
        }
        if run.seed in kept:
            twin, twin_path = kept[run.seed]
            if not same_start(twin, row):
                raise ValueError(
                    f"{run.path}: started_from {row['start']} (step {row['step']}, answer_loss {row['answer_loss']}),"
                    f" but its twin {twin_path} started from {twin['start']} (step {twin['step']}, answer_loss "
                    f"{twin['answer_loss']}): the twins of a seed share one start"
                )
        kept[run.seed] = (row, run.path)
    if not kept and not screened:
        return pd.DataFrame(columns=list(SCREEN_COLUMNS))
    for seed in sorted({run.seed for run in runs} - set(kept)):  # ran without a shared start, in a screened study
        kept[seed] = (
            {
                "seed": seed,
                "kept": True,
                "answer_loss": np.nan,
                "threshold": np.nan,
                "step": np.nan,
                "start": "",
                "reason": "no started_from in its recipe.json",
            },
            Path(),
        )
    rows = sorted([row for row, _ in [*kept.values(), *screened.values()]], key=lambda row: row["seed"])
    return pd.DataFrame(rows, columns=list(SCREEN_COLUMNS))


def screen_lines(screen: pd.DataFrame) -> list[str]:
    """The screen in a sentence for summary.md's header.

    Args:
        screen: from `read_screen`.

    Returns:
        The sentence in a list; empty without a screen.
    """
    if screen.empty:
        return []
    known = screen.dropna(subset=["answer_loss"])
    steps, thresholds = sorted(set(known["step"].astype(int))), sorted(set(known["threshold"].dropna()))
    common = [f"at step {steps[0]}"] if len(steps) == 1 else []
    common += [f"threshold {thresholds[0]:g}"] if len(thresholds) == 1 else []

    def seed(row) -> str:
        if pd.isna(row.answer_loss):
            return f"{row.seed} ({row.reason or 'no answer loss logged'})"
        details = [f"{row.answer_loss:.3f}"]
        details += [f"step {int(row.step)}"] if len(steps) > 1 else []
        details += [f"threshold {row.threshold:g}"] if len(thresholds) > 1 and not pd.isna(row.threshold) else []
        return f"{row.seed} ({', '.join(details)}{': ' + row.reason if row.reason else ''})"

    kept = [seed(row) for row in screen.itertuples() if row.kept]
    dropped = [seed(row) for row in screen.itertuples() if not row.kept]
    return [
        f"Screen of the shared starts (each seed's start answer loss{', ' + ', '.join(common) if common else ''}): "
        f"kept seeds {', '.join(kept) or 'none'}; screened out seeds {', '.join(dropped) or 'none'}."
    ]


def add_head_diversity(runs: list[RunResult]) -> None:
    """Loads each run's model from its folder and sets `run.diversity`.

    Fig. 5's curves; QK and OV normalised as the module's docstring says.

    Args:
        runs: the runs; each gains its `diversity`.

    Raises:
        ValueError: a run's model cannot be loaded, naming its folder.
    """
    from .circuits import HeadDiversity, head_diversity
    from .model import HookedDCFormer

    for run in runs:
        try:
            model = HookedDCFormer.from_pretrained(run.folder)
        except (OSError, ValueError) as e:
            raise ValueError(f"{run.folder}: cannot load the run's model for its head diversity ({e})") from None
        qk = head_diversity(model, normalize=DIVERSITY_NORMALIZE["qk"])
        ov = head_diversity(model, normalize=DIVERSITY_NORMALIZE["ov"])
        options = {**qk.options, "normalize": dict(DIVERSITY_NORMALIZE)}
        run.diversity = HeadDiversity(qk.layers, qk.qk, ov.ov, options, max(qk.bound, ov.bound))


def diversity_measures(diversity: HeadDiversity, n_heads: int, d_head: int) -> dict[str, float]:
    """The head_diversity rows of one run (module docstring): area, k = n_heads, k = d_head, for QK and OV.

    Args:
        diversity: the run's head diversity.
        n_heads: heads per layer.
        d_head: the head dimension.

    Returns:
        {name: share of variance}, names such as qk_area, qk_k4, ov_k16.
    """
    values = {}
    for circuit in ("qk", "ov"):
        curve = getattr(diversity, circuit).double().mean(0)  # over layers
        values[f"{circuit}_area"] = float(curve.mean())
        for k in sorted({n_heads, d_head}):
            if k <= len(curve):
                values[f"{circuit}_k{k}"] = float(curve[k - 1])
    return values


def run_values(run: RunResult) -> dict:
    """The run's accuracies, and its head diversity under WEIGHTS.

    Args:
        run: the run.

    Returns:
        {eval set: {(measure, group): value}}.
    """
    values = dict(run.accuracy)
    if run.diversity is not None:
        measures = diversity_measures(run.diversity, run.config["n_heads"], run.config["d_head"])
        values[WEIGHTS] = {("head_diversity", name): value for name, value in measures.items()}
    return values


def diversity_frame(runs: list[RunResult]) -> pd.DataFrame:
    """The runs' head-diversity curves in long format, for the figure.

    Args:
        runs: the runs; those without `diversity` are left out.

    Returns:
        Columns arch, seed, circuit, components (k), captured (the mean over layers).
    """
    rows = [
        (run.arch, run.seed, circuit, k + 1, value)
        for run in runs
        if run.diversity is not None
        for circuit in ("qk", "ov")
        for k, value in enumerate(getattr(run.diversity, circuit).double().mean(0).tolist())
    ]
    return pd.DataFrame(rows, columns=["arch", "seed", "circuit", "components", "captured"])


def learning_curves(runs: list[RunResult]) -> pd.DataFrame:
    """The runs' probe accuracies in long format, for the figure.

    Args:
        runs: the runs.

    Returns:
        Columns arch, seed, step, eval_accuracy (the probe logged every --eval-every steps), and start_step (the
        shared start's step, NaN for a run that did not fork from one).
    """
    rows = [
        (run.arch, run.seed, entry["step"], entry["eval_accuracy"], (run.started_from or {}).get("step", np.nan))
        for run in runs
        for entry in run.history
        if entry.get("eval_accuracy") is not None
    ]
    return pd.DataFrame(rows, columns=["arch", "seed", "step", "eval_accuracy", "start_step"])


MAX_EXACT_SEEDS = 20  # up to 2^20 subsets enumerated; beyond, SAMPLED_SUBSETS drawn at random


def subset_means(differences: np.ndarray, seed: int = 0) -> np.ndarray:
    """The means of the nonempty subsets of the differences, unsorted.

    Args:
        differences: the n seeds' paired differences.
        seed: the random seed of the subsets drawn for more than MAX_EXACT_SEEDS differences.

    Returns:
        The 2^n - 1 subset means; for more than MAX_EXACT_SEEDS differences, those of 2^20 subsets drawn at random
        with numpy's `default_rng(seed)`.
    """
    differences = np.asarray(differences, dtype=float)
    if len(differences) <= MAX_EXACT_SEEDS:
        sums, counts = np.zeros(1), np.zeros(1, dtype=np.int64)
        for value in differences:  # each subset without the value, then with it
            sums, counts = np.concatenate([sums, sums + value]), np.concatenate([counts, counts + 1])
        return sums[1:] / counts[1:]
    picks = np.random.default_rng(seed).random((2**20, len(differences))) < 0.5
    picks = picks[picks.any(axis=1)]
    return (picks @ differences) / picks.sum(axis=1)


def sign_flip_interval(differences: np.ndarray, level: float = 0.95) -> tuple[float, float, float]:
    """The sign-flip test inverted (module docstring): (low, high, the interval's exact level).

    Args:
        differences: each seed's paired difference.
        level: the least level wanted; with too few seeds for it, the range of the differences at its own level.

    Returns:
        The k-th smallest and k-th largest subset mean and 1 - 2k / 2^n, k = max(1, floor((1 - level) 2^(n-1))).
    """
    n = len(differences)
    means = np.sort(subset_means(differences))
    if n > MAX_EXACT_SEEDS:
        low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
        return float(low), float(high), level
    k = max(1, int(np.floor((1 - level) * 2 ** (n - 1) + 1e-9)))
    return float(means[k - 1]), float(means[len(means) - k]), 1 - 2 * k / 2**n


def t_interval(differences: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """The paired t interval of the mean difference (it assumes normal differences), for comparison.

    Args:
        differences: each seed's paired difference.
        level: the confidence level.

    Returns:
        (low, high).
    """
    differences = np.asarray(differences, dtype=float)
    half = scipy.stats.t.ppf((1 + level) / 2, len(differences) - 1) * scipy.stats.sem(differences)
    return float(differences.mean() - half), float(differences.mean() + half)


def holm(p_values) -> np.ndarray:
    """Holm's step-down adjustment of a family of p-values (family-wise error), in their order.

    Args:
        p_values: the family's p-values.

    Returns:
        The adjusted p-values, in the order given.
    """
    p_values = np.asarray(p_values, dtype=float)
    order = np.argsort(p_values)
    steps = p_values[order] * (len(p_values) - np.arange(len(p_values)))
    adjusted = np.empty_like(p_values)
    adjusted[order] = np.minimum(1.0, np.maximum.accumulate(steps))
    return adjusted


def paired_t_power(effect: float, sd: float, seeds: int, alpha: float = 0.05) -> float:
    """The power of the two-sided paired t test to detect a mean difference `effect`.

    The noncentral t; the sign-flip test's power is close to it, and a little lower at few seeds, where its p-values
    are coarse.

    Args:
        effect: the mean difference to detect.
        sd: the differences' standard deviation.
        seeds: the pairs.
        alpha: the test's level.

    Returns:
        The power.
    """
    df, shift = seeds - 1, effect / sd * np.sqrt(seeds)
    critical = scipy.stats.t.ppf(1 - alpha / 2, df)
    return float(scipy.stats.nct.sf(critical, df, shift) + scipy.stats.nct.cdf(-critical, df, shift))


def seeds_for_power(effect: float, sd: float, power: float = 0.8, alpha: float = 0.05) -> int:
    """The fewest pairs at which `paired_t_power` reaches `power`.

    Args:
        effect: the mean difference to detect.
        sd: the differences' standard deviation.
        power: the power wanted.
        alpha: the test's level.

    Returns:
        The number of pairs, at least 2.
    """
    seeds = 2
    while paired_t_power(effect, sd, seeds, alpha) < power:
        seeds += 1
    return seeds


def paired_permutation_p(differences: np.ndarray) -> float:
    """Exact two-sided sign-flip permutation test of a zero mean paired difference (every 2^n sign assignment).

    Args:
        differences: each seed's paired difference.

    Returns:
        The p-value; 1 for one seed or where every difference is zero.
    """
    if len(differences) < 2 or not np.any(differences):
        return 1.0  # one seed, or every difference zero: every sign assignment is as far from zero as the observed
    result = scipy.stats.permutation_test(
        (differences,), np.mean, permutation_type="samples", n_resamples=np.inf, alternative="two-sided"
    )
    return float(result.pvalue)


def summary_table(runs: list[RunResult], level: float = 0.95) -> pd.DataFrame:
    """The study's table: one row per (eval_set, measure, group); the module's docstring has the columns.

    Args:
        runs: the study's runs.
        level: the least level of the sign-flip interval.

    Returns:
        The table; `attrs["interval"]` says which interval.
    """
    return paired_table({(run.arch, run.seed): run_values(run) for run in runs}, level)


def paired_table(values_of: dict[tuple[str, int], dict], level: float = 0.95) -> pd.DataFrame:
    """The table of `summary_table` from each run's values.

    Args:
        values_of: {(arch, seed): {eval set: {(measure, group): value}}}.
        level: the least level of the sign-flip interval.

    Returns:
        The table; `attrs["interval"]` says which interval.
    """
    by_arch = {arch: sorted(s for a, s in values_of if a == arch) for arch in ARCHES}
    seeds = sorted({s for _, s in values_of})
    eval_sets = list(dict.fromkeys(eval_set for values in values_of.values() for eval_set in values))  # recipe order
    rows_index = sorted(
        {(eval_set, *key) for values in values_of.values() for eval_set, entry in values.items() for key in entry},
        key=lambda row: (eval_sets.index(row[0]), MEASURES.index(row[1]), row[2]),
    )
    rows = []
    for eval_set, measure, group in rows_index:
        accuracy = {
            (arch, s): values_of[arch, s].get(eval_set, {}).get((measure, group))
            for arch in ARCHES
            for s in by_arch[arch]
        }
        paired = [s for s in seeds if accuracy.get(("dcmha", s)) is not None and accuracy.get(("mha", s)) is not None]
        differences = np.array([accuracy["dcmha", s] - accuracy["mha", s] for s in paired], dtype=float)
        low, high, exact_level = sign_flip_interval(differences, level) if len(paired) else (np.nan, np.nan, np.nan)
        row = {
            "eval_set": eval_set,
            "measure": measure,
            "group": group,
            "dcmha": np.mean([accuracy["dcmha", s] for s in paired]) if paired else np.nan,
            "mha": np.mean([accuracy["mha", s] for s in paired]) if paired else np.nan,
            "difference": differences.mean() if paired else np.nan,
            "low": low,
            "high": high,
            "level": exact_level,
            "p": paired_permutation_p(differences) if len(paired) else np.nan,
            "seeds": len(paired),
            "dcmha_ahead": int((differences < 0).sum() if measure in LOWER_IS_AHEAD else (differences > 0).sum()),
        }
        for s in seeds:
            for arch in ARCHES:
                value = accuracy.get((arch, s))
                row[f"{arch}_seed{s}"] = np.nan if value is None else value
        rows.append(row)
    table = pd.DataFrame(rows)
    table.attrs["interval"] = f"sign-flip interval over seeds (the test inverted, at least {level:.0%}; column level)"
    return table


def markdown(table: pd.DataFrame) -> str:
    """The table in markdown, accuracies and differences in percent.

    Args:
        table: from `summary_table`.

    Returns:
        The markdown table, ending with a newline.
    """
    percent = [
        c for c in table.columns if c not in ("eval_set", "measure", "group", "p", "level", "seeds", "dcmha_ahead")
    ]
    lines = ["| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    for _, row in table.iterrows():
        cells = [
            (
                ""
                if pd.isna(row[c])
                else f"{100 * row[c]:+.1f}"
                if c in ("difference", "low", "high")
                else f"{100 * row[c]:.1f}"
            )
            if c in percent
            else ("" if pd.isna(row[c]) else f"{row[c]:.3g}")
            if c in ("p", "level")
            else str(row[c])
            for c in table.columns
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


@dataclass
class Study:
    """A folder of runs read: the runs, the lines saying which were left out, the table and the screen.

    Attributes:
        runs_dir: the study's folder.
        runs: its finished runs.
        left_out: the lines saying which runs were left out and why.
        table: from `summary_table`.
        screen: from `read_screen`.
        trained_on: the folder of the runs trained on every task, for `held_out_change`; else None.
    """

    runs_dir: Path
    runs: list[RunResult]
    left_out: list[str]
    table: pd.DataFrame
    screen: pd.DataFrame
    trained_on: Path | None = None


def read_study(
    runs_dir: Path, head_diversity: bool = False, trained_on: Path | None = None, level: float = 0.95
) -> Study:
    """Reads the runs and the screen, and makes the table.

    Args:
        runs_dir: the study's folder.
        head_diversity: load each run's model for its head diversity.
        trained_on: the folder of the same seeds' runs trained on every task, for the `held_out_change` rows; None:
            none.
        level: the least level of the sign-flip interval.

    Returns:
        The study.

    Raises:
        ValueError: no finished, evaluated run, or as `read_runs`, `read_screen` and `add_held_out_change`.
    """
    runs, left_out = read_runs(runs_dir)
    if not runs:
        raise ValueError(f"{runs_dir}: no finished, evaluated run ({len(left_out)} left out: {left_out[0]})")
    screen = read_screen(runs_dir, runs)
    if trained_on is not None:
        left_out += add_held_out_change(runs, read_runs(trained_on)[0], trained_on)
    if head_diversity:
        add_head_diversity(runs)
    return Study(runs_dir, runs, left_out, summary_table(runs, level), screen, trained_on)


def write_summary(
    runs_dir: Path,
    out_dir: Path | None = None,
    head_diversity: bool = False,
    trained_on: Path | None = None,
    level: float = 0.95,
) -> tuple[pd.DataFrame, list[str]]:
    """Reads the runs and writes summary.csv and summary.md, and screen.csv if the study has a screen.

    Args:
        runs_dir: the study's folder.
        out_dir: where the files go; None: `runs_dir`.
        head_diversity: load each run's model for its head diversity.
        trained_on: the folder of the runs trained on every task, for `held_out_change`; None: none.
        level: the least level of the sign-flip interval.

    Returns:
        (the table, the lines saying which runs were left out).

    Raises:
        ValueError: as `read_study`.
    """
    study = read_study(runs_dir, head_diversity, trained_on, level)
    write_study(study, out_dir or runs_dir)
    return study.table, study.left_out


def write_study(study: Study, out_dir: Path) -> None:
    """Writes summary.csv, summary.md (its header says what the columns mean) and screen.csv if there is a screen.

    Args:
        study: from `read_study`.
        out_dir: where the files go, made if need be.
    """
    runs, table = study.runs, study.table
    out_dir.mkdir(parents=True, exist_ok=True)
    table.to_csv(out_dir / "summary.csv", index=False)
    if not study.screen.empty:
        study.screen.to_csv(out_dir / "screen.csv", index=False)
    pairs = sorted({run.seed for run in runs if run.arch == "dcmha"} & {run.seed for run in runs if run.arch == "mha"})
    header = [
        f"Runs under `{study.runs_dir}`: {len(runs)} ({', '.join(f'{r.arch} seed {r.seed}' for r in runs)}); "
        f"paired seeds: {', '.join(map(str, pairs)) or 'none'}.",
        *screen_lines(study.screen),
        *width_lines(runs),
        f"difference = DCMHA - MHA (percentage points), low/high: {table.attrs['interval']}; "
        "p: exact paired sign-flip permutation test of no difference (two-sided; at least 2 / 2^seeds); "
        "dcmha_ahead: seeds in which DCMHA is ahead.",
        *(
            [
                "head_diversity rows (eval_set weights): the share of variance captured by the first k principal "
                "components of the heads' concatenated circuits, in %; lower = more diverse heads, so DCMHA is ahead "
                "where its share is lower (QK normalised per head, OV raw; dcinterp.study's docstring)."
            ]
            if (table["measure"] == "head_diversity").any()
            else []
        ),
        *(
            [
                "held_out_change rows: each run's accuracy on the combinations it never saw minus its twin's, the "
                f"run of the same seed and architecture under `{study.trained_on}` that trained on them (from the "
                "same start); 0 = nothing lost for never seeing them, and DCMHA is ahead where it loses less."
            ]
            if (table["measure"] == "held_out_change").any()
            else []
        ),
        *(f"Left out: {line}" for line in study.left_out),
    ]
    (out_dir / "summary.md").write_text("\n\n".join(header) + "\n\n" + markdown(table))


def write_figures(study: Study, figures_dir: Path) -> list[Path]:
    """The study's figures as PNGs (dcinterp.plotting: plot_study_*).

    Args:
        study: from `read_study`.
        figures_dir: where the PNGs go, made if need be.

    Returns:
        The paths written.
    """
    from .plotting import (
        plot_study_differences,
        plot_study_head_diversity,
        plot_study_held_out,
        plot_study_learning_curves,
    )

    figures_dir.mkdir(parents=True, exist_ok=True)
    table = study.table
    widths = mlp_widths(study.runs)
    baseline = "MHA" if widths is None else f"MHA (d_mlp {widths['mha']})"
    figures = {}
    for eval_set in table.loc[table["measure"].isin(["qk_pattern", "ov_transformation"]), "eval_set"].unique():
        figures[f"differences_{eval_set}.png"] = plot_study_differences(table, eval_set, baseline=baseline)
    if (table["measure"] == "held_out_combos").any():
        figures["held_out_combos.png"] = plot_study_held_out(table)
    diversity = diversity_frame(study.runs)
    if not diversity.empty:
        config = study.runs[0].config  # one recipe's runs: the same shape
        figures["head_diversity.png"] = plot_study_head_diversity(
            diversity, marks=(config["n_heads"], config["d_head"])
        )
    curves = learning_curves(study.runs)
    if not curves.empty:
        figures["learning_curves.png"] = plot_study_learning_curves(curves)
    written = []
    for name, fig in figures.items():
        fig.savefig(figures_dir / name, dpi=120)
        written.append(figures_dir / name)
    return written


# The study page's tables and figures, from the data committed beside the page (docs/study-data/, whose README
# says where each number comes from): the runs' own folders are not kept, so the page is regenerated from these.

TABLE_FILES = {
    "accuracy": ("accuracy.csv", ("study", "eval_set", "measure", "group", "arch", "seed", "accuracy")),
    "screen": ("screen.csv", ("seed", "kept", "answer_loss", "threshold", "step")),
    "held_out_change": ("held_out_change.csv", ("seed", "difference")),
    "person_answer": ("person_answer.csv", ("study", "arch", "seed", "answers")),
}
ARM_NAMES = {
    ("full", "dcmha"): "DCMHA, every task",
    ("full", "mha"): "MHA, every task",
    ("full", "mha_matched"): "parameter-matched MHA, every task",
    ("held_out", "dcmha"): "DCMHA, 8 tasks never trained",
    ("held_out", "mha"): "MHA, 8 tasks never trained",
}
# (study, {the data's arch: the table's slot}, seeds or None for all, label): every comparison but the primary one
EXPLORATORY = (
    ("full", {"dcmha": "dcmha", "mha": "mha"}, None, "DCMHA - MHA, every task trained"),
    ("full", {"mha_matched": "dcmha", "mha": "mha"}, None, "matched MHA - plain MHA"),
    ("full", {"dcmha": "dcmha", "mha_matched": "mha"}, None, "DCMHA - matched MHA"),
    ("full", {"dcmha": "dcmha", "mha_matched": "mha"}, (3, 4, 11, 13), "DCMHA - matched MHA, seeds 3, 4, 11, 13"),
    ("held_out", {"dcmha": "dcmha", "mha": "mha"}, None, "DCMHA - MHA, 8 tasks never trained"),
)
PATTERN_NAMES = {
    "same-person": "same person",
    "other-person": "other person",
    "odd-one-out": "odd one out",
    "matching-person": "matching person",
    "not-matching-person": "not-matching person",
}


@dataclass
class TableData:
    """The committed data of the study page, in percent as the page prints them.

    Attributes:
        accuracy: one row per model and measure: study, eval_set, measure, group, arch, seed, accuracy.
        screen: one row per seed: seed, kept, answer_loss, threshold, step.
        held_out_change: the primary endpoint per seed: seed, difference (points).
        person_answer: one row per model: study, arch, seed, answers (yes, part, no), and the two rates.
    """

    accuracy: pd.DataFrame
    screen: pd.DataFrame
    held_out_change: pd.DataFrame
    person_answer: pd.DataFrame


def read_table_data(data_dir: Path) -> TableData:
    """The CSV files of TABLE_FILES under `data_dir` ('#' lines are their provenance).

    Args:
        data_dir: the study page's data folder (docs/study-data).

    Returns:
        The data.

    Raises:
        ValueError: a file cannot be read or lacks a column, naming the file.
    """
    frames = {}
    for key, (name, columns) in TABLE_FILES.items():
        path = data_dir / name
        try:
            frame = pd.read_csv(path, comment="#")
        except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError) as e:
            raise ValueError(f"{path}: cannot read the study's data ({type(e).__name__}: {e})") from None
        missing = [c for c in columns if c not in frame.columns]
        if missing:
            raise ValueError(f"{path}: no column {', '.join(missing)} (expected {', '.join(columns)})")
        frames[key] = frame
    return TableData(**frames)


def table_values(data: TableData, study: str, arches: dict[str, str], seeds=None) -> dict:
    """One study's accuracies from the page's data, in the form `paired_table` takes.

    Args:
        data: the page's data.
        study: "full" or "held_out".
        arches: {the data's arch: the table's slot ("dcmha" or "mha")}.
        seeds: the seeds kept; None: all.

    Returns:
        {(slot, seed): {eval set: {(measure, group): accuracy as a fraction}}}.
    """
    rows = data.accuracy[(data.accuracy["study"] == study) & data.accuracy["arch"].isin(list(arches))]
    values: dict = {}
    for row in rows.itertuples():
        if seeds is None or row.seed in seeds:
            entry = values.setdefault((arches[row.arch], int(row.seed)), {}).setdefault(row.eval_set, {})
            entry[row.measure, row.group] = row.accuracy / 100
    return values


def points(value: float, sign: bool = True) -> str:
    """A fraction in percent (points), to 0.1.

    Args:
        value: the fraction.
        sign: write the sign of a positive value too.

    Returns:
        The text.
    """
    return f"{100 * value:+.1f}" if sign else f"{100 * value:.1f}"


def measure_label(measure: str, group: str) -> str:
    """How the page names a row: "every task", "same person", "never seen: same person : superclass", ...

    Args:
        measure: one of MEASURES.
        group: the row's group.

    Returns:
        The label.
    """
    if measure == "held_out_combo":
        pattern, transformation = group.split(":")
        return f"never seen: {PATTERN_NAMES[pattern]} : {transformation}"
    return {"overall": "every task", "held_out_combos": "the 8 never-seen tasks"}.get(
        measure, PATTERN_NAMES.get(group, group)
    )


def exploratory_table(data: TableData, level: float = 0.95) -> pd.DataFrame:
    """Every comparison of EXPLORATORY with paired seeds, with its Holm-adjusted p over them all.

    Args:
        data: the page's data.
        level: the least level of the sign-flip interval.

    Returns:
        The rows of `paired_table` of each comparison, with columns comparison and holm.
    """
    parts = []
    for study, arches, seeds, label in EXPLORATORY:
        table = paired_table(table_values(data, study, arches, seeds), level)
        parts.append(table[table["seeds"] > 0].assign(comparison=label))
    table = pd.concat(parts, ignore_index=True)
    table["holm"] = holm(table["p"])
    return table


def least_p(seeds: int) -> float:
    """The smallest two-sided sign-flip p that `seeds` pairs can give: 2 / 2^seeds.

    Args:
        seeds: the pairs.

    Returns:
        The p-value.
    """
    return 2 / 2**seeds


def exploratory_markdown(table: pd.DataFrame) -> str:
    """`exploratory_table` as the page prints it.

    Means, difference with its interval and level, p uncorrected and Holm-adjusted, the seeds ahead with the least p
    that many seeds can give.

    Args:
        table: from `exploratory_table`.

    Returns:
        The markdown table.
    """
    lines = [
        "| comparison | measure | mean | difference (interval, its level) | p, uncorrected | p, Holm | ahead "
        "(least p) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row, previous in zip(table.itertuples(), [None, *table["comparison"]], strict=False):
        comparison = "" if row.comparison == previous else row.comparison  # named on its first row only
        lines.append(
            f"| {comparison} | {measure_label(row.measure, row.group)} | {points(row.dcmha, False)} / "
            f"{points(row.mha, False)} | {points(row.difference)} ({points(row.low)} to {points(row.high)}; "
            f"{row.level:.1%}) | {row.p:.2g} | {row.holm:.2g} | {row.dcmha_ahead} of {row.seeds} "
            f"({least_p(row.seeds):.2g}) |"
        )
    return "\n".join(lines) + "\n"


def primary_endpoint(data: TableData, level: float = 0.95) -> dict:
    """The primary endpoint: what never seeing the 8 tasks cost DCMHA minus what it cost MHA, per seed (points).

    Args:
        data: the page's data.
        level: the least level of the sign-flip interval.

    Returns:
        mean, low, high, level (the sign-flip interval's exact one), t (the t interval), p, ahead, seeds, sd.
    """
    differences = data.held_out_change["difference"].to_numpy(dtype=float)
    low, high, exact_level = sign_flip_interval(differences, level)
    return {
        "mean": differences.mean(),
        "low": low,
        "high": high,
        "level": exact_level,
        "t": t_interval(differences, level),
        "p": paired_permutation_p(differences),
        "ahead": int((differences > 0).sum()),
        "seeds": len(differences),
        "sd": differences.std(ddof=1),
    }


def primary_markdown(endpoint: dict, level: float = 0.95) -> str:
    """The primary endpoint's row: mean, sign-flip interval with its level, t interval, p, seeds ahead.

    Args:
        endpoint: from `primary_endpoint`.
        level: the t interval's level, for the header.

    Returns:
        The markdown table.
    """
    e = endpoint
    return (
        "| DCMHA - MHA (negative: DCMHA lost more) | interval: sign-flip test inverted (its level) "
        f"| {level:.0%} t interval | p | DCMHA ahead (least p) |\n|---|---|---|---|---|\n"
        f"| {e['mean']:+.1f} points | {e['low']:+.1f} to "
        f"{e['high']:+.1f} ({e['level']:.1%}) | {e['t'][0]:+.1f} to {e['t'][1]:+.1f} | {e['p']:.2g} | "
        f"{e['ahead']} of {e['seeds']} ({least_p(e['seeds']):.2g}) |\n"
    )


def screen_markdown(screen: pd.DataFrame) -> str:
    """The seeds kept and screened out, with the kept share and its exact (Clopper-Pearson) 95% interval.

    Args:
        screen: the page's screen data, one row per seed with its start's answer loss.

    Returns:
        The markdown table.
    """
    kept, dropped = screen[screen["kept"]], screen[~screen["kept"]]
    rate = len(kept) / len(screen)
    ci = scipy.stats.binomtest(len(kept), len(screen)).proportion_ci(0.95, method="exact")

    def seeds(rows) -> str:
        return ", ".join(
            f"{row.seed} ({row.answer_loss:.{2 if row.answer_loss >= 1 else 3}f})" for row in rows.itertuples()
        )

    step = int(screen["step"].iloc[0])
    return (
        f"| | seeds (the start's answer loss at step {step:,}) |\n|---|---|\n"
        f"| kept, {len(kept)} of {len(screen)} ({rate:.0%}; 95% interval {ci.low:.0%} to {ci.high:.0%}) | "
        f"{seeds(kept)} |\n| screened out | {seeds(dropped)} |\n"
    )


def per_seed_markdown(data: TableData, study: str, rows: list[tuple[str, str]]) -> str:
    """Per seed, `DCMHA / MHA` in %, one row per (measure, group).

    Args:
        data: the page's data.
        study: "full" or "held_out".
        rows: the (measure, group) rows, in order.

    Returns:
        The markdown table.
    """
    accuracy = data.accuracy[data.accuracy["study"] == study]
    seeds = sorted(accuracy["seed"].unique())
    lines = ["| | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|---|" + "---|" * len(seeds)]
    for measure, group in rows:
        at = accuracy[(accuracy["measure"] == measure) & (accuracy["group"] == group)].set_index(["arch", "seed"])
        cells = [f"{at.loc[('dcmha', s), 'accuracy']:.1f} / {at.loc[('mha', s), 'accuracy']:.1f}" for s in seeds]
        lines.append(f"| {measure_label(measure, group)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def matched_markdown(data: TableData) -> str:
    """Per seed, the overall accuracy of DCMHA, its plain MHA twin and the parameter-matched MHA, and their means.

    Args:
        data: the page's data.

    Returns:
        The markdown table.
    """
    overall = data.accuracy[(data.accuracy["study"] == "full") & (data.accuracy["measure"] == "overall")]
    wide = overall.pivot(index="seed", columns="arch", values="accuracy")[["dcmha", "mha", "mha_matched"]]
    lines = ["| seed | DCMHA | plain MHA twin | matched MHA |", "|---|---|---|---|"]
    lines += [f"| {seed} | " + " | ".join(f"{v:.1f}" for v in row) + " |" for seed, row in wide.iterrows()]
    lines.append("| mean | " + " | ".join(f"{v:.1f}" for v in wide.mean()) + " |")
    return "\n".join(lines) + "\n"


def seeds_named(seeds: list[int]) -> str:
    """ "seed 3" or "seeds 3, 4".

    Args:
        seeds: the seeds.

    Returns:
        The text.
    """
    return ("seed " if len(seeds) == 1 else "seeds ") + ", ".join(map(str, seeds))


def lookup_markdown(data: TableData) -> str:
    """Each arm's rate of answering the two person-answer patterns beside its mean accuracy.

    The mean accuracy is over every task, released data; then Fisher's exact test of every task trained against 8
    tasks never trained.

    Args:
        data: the page's data.

    Returns:
        The markdown table and the test's sentence.
    """
    answers, overall = data.person_answer, data.accuracy[data.accuracy["measure"] == "overall"]
    lines = ["| runs | answer the person-answer patterns | mean accuracy, every task (%) |", "|---|---|---|"]
    for (study, arch), name in ARM_NAMES.items():
        arm = answers[(answers["study"] == study) & (answers["arch"] == arch)]
        yes, part = sorted(arm.loc[arm["answers"] == "yes", "seed"]), sorted(arm.loc[arm["answers"] == "part", "seed"])
        said = f"{len(yes)} of {len(arm)}" + (f" ({seeds_named(yes)})" if yes else "")
        said += f", {seeds_named(part)} in part" if part else ""
        mean = overall.loc[(overall["study"] == study) & (overall["arch"] == arch), "accuracy"].mean()
        lines.append(f"| {name} | {said} | {mean:.1f} |")
    full, held = answers[answers["study"] == "full"], answers[answers["study"] == "held_out"]
    table = [[(f["answers"] == "yes").sum(), (f["answers"] != "yes").sum()] for f in (full, held)]
    p = scipy.stats.fisher_exact(table).pvalue
    return (
        "\n".join(lines)
        + f"\n\nEvery task trained, {table[0][0]} of {len(full)} models; 8 tasks never trained, {table[1][0]} of "
        f"{len(held)} (seed 18's in part counted as no): Fisher's exact test p = {p:.2f} (exploratory, uncorrected).\n"
    )


def power_markdown(data: TableData, endpoint: dict, small: float = 5.0, power: float = 0.8) -> str:
    """The power of the paired test at the study's seeds, and the seeds that `power` would need.

    The kept seeds (and shared starts, at the screen's rate) that `power` at the observed effect and at `small`
    points would need, for the overall difference and for the primary endpoint.

    Args:
        data: the page's data.
        endpoint: from `primary_endpoint`.
        small: the smaller effect, in points.
        power: the power wanted.

    Returns:
        The markdown table.
    """
    overall = paired_table(table_values(data, "full", {"dcmha": "dcmha", "mha": "mha"}))
    row = overall[overall["measure"] == "overall"].iloc[0]
    seeds = [c for c in overall.columns if c.startswith("dcmha_seed")]
    differences = 100 * np.array([row[c] - row[c.replace("dcmha", "mha")] for c in seeds])
    kept_rate = data.screen["kept"].mean()
    columns = {
        "DCMHA - MHA, every task": (differences.mean(), differences.std(ddof=1), len(differences)),
        "primary endpoint": (endpoint["mean"], endpoint["sd"], endpoint["seeds"]),
    }

    def need(effect: float, sd: float) -> str:
        n = seeds_for_power(abs(effect), sd, power)
        return f"{n} (about {int(np.ceil(n / kept_rate))} starts)"

    rows = {
        "spread of the paired differences (SD over seeds)": lambda m, sd, n: f"{sd:.1f} points",
        "power at this many seeds to detect the observed mean": lambda m, sd, n: (
            f"{paired_t_power(abs(m), sd, n):.0%} at {n} seeds ({m:+.1f} points)"
        ),
        f"kept seeds for {power:.0%} power at the observed mean": lambda m, sd, n: need(m, sd),
        f"kept seeds for {power:.0%} power at {small:g} points": lambda m, sd, n: need(small, sd),
    }
    lines = ["| | " + " | ".join(columns) + " |", "|---|---|---|"]
    lines += [f"| {label} | " + " | ".join(cell(*c) for c in columns.values()) + " |" for label, cell in rows.items()]
    return "\n".join(lines) + "\n"


def page_tables(data: TableData, level: float = 0.95) -> dict[str, str]:
    """Every table of the study page, in markdown (the page quotes each verbatim; tests/test_study.py).

    Args:
        data: the page's data.
        level: the least level of the sign-flip interval.

    Returns:
        The tables by name: screen, primary, pairs, matched, held_out, lookup, exploratory, power.
    """
    endpoint = primary_endpoint(data, level)
    qk = [
        ("qk_pattern", g)
        for g in ("same-person", "other-person", "odd-one-out", "matching-person", "not-matching-person")
    ]
    held = [
        ("held_out_combo", g)
        for g in (
            "same-person:superclass",
            "other-person:capability",
            "matching-person:country",
            "not-matching-person:opposite",
        )
    ]
    return {
        "screen": screen_markdown(data.screen),
        "primary": primary_markdown(endpoint, level),
        "pairs": per_seed_markdown(data, "full", [("overall", "all"), *qk]),
        "matched": matched_markdown(data),
        "held_out": per_seed_markdown(
            data, "held_out", [*held, ("held_out_combos", "held_out_combos"), ("overall", "all")]
        ),
        "lookup": lookup_markdown(data),
        "exploratory": exploratory_markdown(exploratory_table(data, level)),
        "power": power_markdown(data, endpoint),
    }


def write_table_figures(data: TableData, figures_dir: Path, level: float = 0.95) -> list[Path]:
    """The study page's figures that its data can draw: DCMHA - MHA per seed and per measure.

    study_differences_released.png (every task trained) and study_heldout_differences_released.png (8 tasks never
    trained).

    Args:
        data: the page's data.
        figures_dir: where the PNGs go, made if need be.
        level: the least level of the sign-flip interval.

    Returns:
        The paths written.
    """
    from .plotting import plot_study_differences

    figures_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for study, name in (
        ("full", "study_differences_released.png"),
        ("held_out", "study_heldout_differences_released.png"),
    ):
        table = paired_table(table_values(data, study, {"dcmha": "dcmha", "mha": "mha"}), level)
        plot_study_differences(table, "released").savefig(figures_dir / name, dpi=120)
        written.append(figures_dir / name)
    return written


def main(argv: list[str] | None = None) -> None:
    """`python -m dcinterp.train summarize`: a study's table (and figures) from its runs, or the page's from its data.

    Args:
        argv: the command's arguments; None: `sys.argv[1:]`.

    Raises:
        SystemExit: a bad argument or a study that cannot be read: one line on stderr, exit 2.
    """
    parser = Parser(prog="python -m dcinterp.train summarize", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "runs_dir", metavar="RUNS_DIR", nargs="?", help="a folder of runs (recipe.json files, at any depth)"
    )
    parser.add_argument(
        "--from-table",
        metavar="DATA_DIR",
        default=None,
        help="instead of RUNS_DIR: the study page's committed data (docs/study-data); prints the page's tables "
        "(and writes them to --out DIR as tables.md; --figures DIR: the figures its data can draw)",
    )
    parser.add_argument("--out", default=None, help="write summary.csv and summary.md here (default: RUNS_DIR)")
    parser.add_argument("--level", type=float, default=0.95, help="the interval's level (default %(default)s)")
    parser.add_argument(
        "--head-diversity",
        action="store_true",
        help="load each run's model and add its head diversity (Fig. 5) as rows of the table",
    )
    parser.add_argument(
        "--trained-on",
        metavar="DIR",
        default=None,
        help="the same seeds' runs trained on every task: adds what each run lost on the combinations it left out "
        "(held_out_change rows)",
    )
    parser.add_argument(
        "--figures",
        metavar="DIR",
        default=None,
        help="write the study's figures (PNG) to DIR; computes the head diversity too",
    )
    args = parser.parse_args(argv)
    if not 0 < args.level < 1:
        parser.error(f"--level {args.level}: expected a number between 0 and 1")
    if (args.runs_dir is None) == (args.from_table is None):
        parser.error("give a folder of runs (RUNS_DIR) or --from-table DATA_DIR, one of the two")
    if args.from_table is not None:
        return summarize_table(parser, args)
    runs_dir = Path(args.runs_dir)
    out_dir = Path(args.out) if args.out else runs_dir
    figures_dir = Path(args.figures) if args.figures else None
    try:
        if figures_dir is not None:
            check_writable_dir(figures_dir, "--figures")
        study = read_study(
            runs_dir,
            head_diversity=args.head_diversity or figures_dir is not None,
            trained_on=Path(args.trained_on) if args.trained_on else None,
            level=args.level,
        )
        write_study(study, out_dir)
    except ValueError as e:
        parser.error(str(e))
    written = [out_dir / "summary.csv", out_dir / "summary.md"]
    if not study.screen.empty:
        written.append(out_dir / "screen.csv")
    if figures_dir is not None:
        written += write_figures(study, figures_dir)
    print((out_dir / "summary.md").read_text())
    print(f"written: {', '.join(map(str, written))}", file=sys.stderr)


def summarize_table(parser: Parser, args) -> None:
    """`summarize --from-table`: the study page's tables printed (and written to --out), its figures drawn.

    Args:
        parser: the command's parser, for its errors.
        args: the parsed arguments.

    Raises:
        SystemExit: a folder that cannot be written or data that cannot be read: one line on stderr, exit 2.
    """
    out_dir, figures_dir = (Path(d) if d else None for d in (args.out, args.figures))
    try:
        for folder, flag in ((out_dir, "--out"), (figures_dir, "--figures")):
            if folder is not None:
                check_writable_dir(folder, flag)
        data = read_table_data(Path(args.from_table))
        text = "".join(f"<!-- {name} -->\n{table}\n" for name, table in page_tables(data, args.level).items())
        written = write_table_figures(data, figures_dir, args.level) if figures_dir is not None else []
    except ValueError as e:
        parser.error(str(e))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "tables.md").write_text(text)
        written.insert(0, out_dir / "tables.md")
    print(text)
    if written:
        print(f"written: {', '.join(map(str, written))}", file=sys.stderr)
