"""The paired study's table: the accuracies of a folder of runs, and the paired difference DCMHA - MHA per seed.

    python -m dcinterp.train --seeds 0-4 --out runs/study ...     # RUNS_DIR/seed<N>/<name>/recipe.json
    python -m dcinterp.train summarize runs/study                 # runs/study/summary.csv and summary.md
    python -m dcinterp.train summarize runs/study --head-diversity    # + each run's head diversity (Fig. 5)
    python -m dcinterp.train summarize runs/study --figures figs     # + the study's figures (PNG), see below
    python -m dcinterp.train summarize runs/study-heldout --trained-on runs/study   # + held_out_change rows

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

The interval is a percentile bootstrap over seeds, paired: a resample draws n seeds with replacement from the n
paired seeds, each with both its twins, and takes the mean of their differences; the interval holds the central
`level` of those means. Over seeds, because a seed is the unit the experiment repeats: it fixes the
initialisation and the data of both twins, and what varies most from one seed to another is whether and when a
model forms the lookup, not the evaluation samples. The evaluation samples are the same for both twins, so their
own noise largely cancels in the paired difference, and recipe.json keeps accuracies per group, not per answer
(a bootstrap over seeds and samples would need every answer's result). Paired, because a seed's twins are not
independent draws: resampling them apart would count the seed's shared luck as architecture noise. With few
seeds this interval is narrow (5 seeds give at most 126 distinct resamples, and it cannot see beyond the seeds
drawn): read it with the per-seed differences beside it. Resamples are drawn with numpy's `default_rng(seed)`,
the same seed draws for every row.

The p column is the exact paired permutation test of "no difference" (Fisher's sign-flip test, two-sided, by
`scipy.stats.permutation_test`): under the null hypothesis each seed's difference is as likely to have the other
sign, so p is the share of the 2^n sign assignments whose mean difference is at least as far from zero as the one
observed. It assumes nothing about the differences' distribution, and its smallest value is 2 / 2^n: 0.25 with
3 seeds, 0.0625 with 5, 0.0078 with 8; no result of 5 seeds reaches p < 0.05.

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
    """One run's accuracies, as its recipe.json records them."""

    path: Path
    arch: str
    seed: int
    config: dict
    accuracy: dict  # {eval set: {(measure, group): accuracy}}
    per_task: dict = field(default_factory=dict)  # {eval set: {task id: accuracy}}, where recipe.json has them
    history: list = field(default_factory=list)  # recipe["history"]: the logged steps, some with eval_accuracy
    started_from: dict | None = None  # {"path", "step", "answer_loss"} of the shared start, for a forked run
    diversity: HeadDiversity | None = None  # filled by add_head_diversity

    @property
    def folder(self) -> Path:
        return self.path.parent


def read_run(path: Path) -> RunResult | str:
    """The run's result, or why it is left out (one line)."""
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
    """(the finished runs under `runs_dir`, the lines saying which were left out and why)."""
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
    """Every run of the folder trained with the same settings but those of MAY_DIFFER (and, between the
    architectures, MAY_DIFFER_BETWEEN_ARCHES), and no seed has two runs of one architecture: else the pairs would
    compare more than the architecture (and its parameter-matched width)."""
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
    """Each architecture's d_mlp where they differ (a parameter-matched study), else None."""
    widths = {run.arch: run.config.get("d_mlp") for run in runs}
    return widths if len(set(widths.values())) > 1 else None


def width_lines(runs: list[RunResult]) -> list[str]:
    """A sentence for summary.md's header where the architectures' MLPs differ (a parameter-matched study)."""
    widths = mlp_widths(runs)
    if widths is None:
        return []
    return [
        "The architectures' MLPs differ (a parameter-matched study): "
        + ", ".join(f"{arch.upper()} d_mlp {width}" for arch, width in sorted(widths.items()))
        + "."
    ]


def check_same_recipe(run: RunResult, other: RunResult, why: str, may_differ: tuple = MAY_DIFFER) -> None:
    """`run` trained with `other`'s settings, but those of `may_differ`; else a ValueError naming the first key."""
    for key in sorted(set(run.config) | set(other.config)):
        if key not in may_differ and run.config.get(key) != other.config.get(key):
            raise ValueError(
                f"{run.path}: train_config {key}={run.config.get(key)!r}, but {other.path} has "
                f"{other.config.get(key)!r}: {why}"
            )


def add_held_out_change(runs: list[RunResult], trained_on: list[RunResult], trained_on_dir: Path) -> list[str]:
    """Give every run that left combinations out its `held_out_change` rows: per combination, and for all of them
    (group `held_out_combos`), its accuracy on their tasks minus that of its twin trained on every task (the run of
    the same seed and architecture under `trained_on_dir`, from the same start). 0 is nothing lost for never
    having seen them. The lines returned name the runs that have no such twin."""
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
    """The twin trained on every task, with the run's recipe otherwise, from the run's start."""
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
    """A start's answer loss; NaN where none was logged (dcinterp.train writes null then)."""
    return np.nan if value is None else float(value)


def same_start(a: dict, b: dict) -> bool:
    """Whether two rows of the screen name one start (the same checkpoint, step and answer loss, NaN or not)."""
    same_loss = np.array_equal([a["answer_loss"]], [b["answer_loss"]], equal_nan=True)
    return (a["start"], a["step"]) == (b["start"], b["step"]) and same_loss


def read_screened_out(path: Path) -> dict:
    """A screened_out.json as a row of the screen."""
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
    """One row per seed (SCREEN_COLUMNS): the seeds screened out (their screened_out.json) and the seeds kept (their
    runs' started_from; the threshold is started_from's own if it has one, else the screened-out seeds' when they
    agree on one). Empty when no run started from a shared start and no seed was screened out."""
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
    """The screen in a sentence for summary.md's header (none without a screen)."""
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
    """Load each run's model from its folder and set `run.diversity` (Fig. 5; the QK and OV curves as the module's
    docstring says). A few hundredths of a second per model of the study's size, after torch's import."""
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
    """The head_diversity rows of one run (module docstring): area, k = n_heads, k = d_head, for QK and OV."""
    values = {}
    for circuit in ("qk", "ov"):
        curve = getattr(diversity, circuit).double().mean(0)  # over layers
        values[f"{circuit}_area"] = float(curve.mean())
        for k in sorted({n_heads, d_head}):
            if k <= len(curve):
                values[f"{circuit}_k{k}"] = float(curve[k - 1])
    return values


def run_values(run: RunResult) -> dict:
    """{eval set: {(measure, group): value}}: the run's accuracies, and its head diversity under WEIGHTS."""
    values = dict(run.accuracy)
    if run.diversity is not None:
        measures = diversity_measures(run.diversity, run.config["n_heads"], run.config["d_head"])
        values[WEIGHTS] = {("head_diversity", name): value for name, value in measures.items()}
    return values


def diversity_frame(runs: list[RunResult]) -> pd.DataFrame:
    """Long format for the figure: arch, seed, circuit, components (k), captured (the mean over layers)."""
    rows = [
        (run.arch, run.seed, circuit, k + 1, value)
        for run in runs
        if run.diversity is not None
        for circuit in ("qk", "ov")
        for k, value in enumerate(getattr(run.diversity, circuit).double().mean(0).tolist())
    ]
    return pd.DataFrame(rows, columns=["arch", "seed", "circuit", "components", "captured"])


def learning_curves(runs: list[RunResult]) -> pd.DataFrame:
    """Long format for the figure: arch, seed, step, eval_accuracy (the probe logged every --eval-every steps), and
    start_step (the shared start's step, NaN for a run that did not fork from one)."""
    rows = [
        (run.arch, run.seed, entry["step"], entry["eval_accuracy"], (run.started_from or {}).get("step", np.nan))
        for run in runs
        for entry in run.history
        if entry.get("eval_accuracy") is not None
    ]
    return pd.DataFrame(rows, columns=["arch", "seed", "step", "eval_accuracy", "start_step"])


def paired_bootstrap_interval(
    differences: np.ndarray, level: float = 0.95, n_resamples: int = 10_000, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap of the mean paired difference: each resample draws the seeds (their differences)
    with replacement."""
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(differences), size=(n_resamples, len(differences)))
    means = differences[draws].mean(axis=1)
    tail = (1 - level) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return float(low), float(high)


def paired_permutation_p(differences: np.ndarray) -> float:
    """Exact two-sided sign-flip permutation test of a zero mean paired difference (every 2^n sign assignment)."""
    if len(differences) < 2 or not np.any(differences):
        return 1.0  # one seed, or every difference zero: every sign assignment is as far from zero as the observed
    result = scipy.stats.permutation_test(
        (differences,), np.mean, permutation_type="samples", n_resamples=np.inf, alternative="two-sided"
    )
    return float(result.pvalue)


def summary_table(runs: list[RunResult], level: float = 0.95, n_resamples: int = 10_000, seed: int = 0) -> pd.DataFrame:
    """One row per (eval_set, measure, group); see the module's docstring for the columns."""
    by_arch = {arch: {run.seed: run for run in runs if run.arch == arch} for arch in ARCHES}
    seeds = sorted({run.seed for run in runs})
    values_of = {(run.arch, run.seed): run_values(run) for run in runs}
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
        low, high = (
            paired_bootstrap_interval(differences, level, n_resamples, seed) if len(paired) else (np.nan, np.nan)
        )
        row = {
            "eval_set": eval_set,
            "measure": measure,
            "group": group,
            "dcmha": np.mean([accuracy["dcmha", s] for s in paired]) if paired else np.nan,
            "mha": np.mean([accuracy["mha", s] for s in paired]) if paired else np.nan,
            "difference": differences.mean() if paired else np.nan,
            "low": low,
            "high": high,
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
    table.attrs["interval"] = f"{level:.0%} paired bootstrap over seeds ({n_resamples} resamples, seed {seed})"
    return table


def markdown(table: pd.DataFrame) -> str:
    """The table in markdown, accuracies and differences in percent."""
    percent = [c for c in table.columns if c not in ("eval_set", "measure", "group", "p", "seeds", "dcmha_ahead")]
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
            if c == "p"
            else str(row[c])
            for c in table.columns
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


@dataclass
class Study:
    """A folder of runs read: the runs, the lines saying which were left out, the table and the screen."""

    runs_dir: Path
    runs: list[RunResult]
    left_out: list[str]
    table: pd.DataFrame
    screen: pd.DataFrame
    trained_on: Path | None = None


def read_study(runs_dir: Path, head_diversity: bool = False, trained_on: Path | None = None, **bootstrap) -> Study:
    """Read the runs (with their head diversity if asked, and their `held_out_change` against the runs under
    `trained_on` if given), the screen, and make the table."""
    runs, left_out = read_runs(runs_dir)
    if not runs:
        raise ValueError(f"{runs_dir}: no finished, evaluated run ({len(left_out)} left out: {left_out[0]})")
    screen = read_screen(runs_dir, runs)
    if trained_on is not None:
        left_out += add_held_out_change(runs, read_runs(trained_on)[0], trained_on)
    if head_diversity:
        add_head_diversity(runs)
    return Study(runs_dir, runs, left_out, summary_table(runs, **bootstrap), screen, trained_on)


def write_summary(
    runs_dir: Path,
    out_dir: Path | None = None,
    head_diversity: bool = False,
    trained_on: Path | None = None,
    **bootstrap,
) -> tuple[pd.DataFrame, list[str]]:
    """Read the runs, write summary.csv and summary.md (and screen.csv if the study has a screen) to `out_dir`
    (default: `runs_dir`); (table, left out)."""
    study = read_study(runs_dir, head_diversity, trained_on, **bootstrap)
    write_study(study, out_dir or runs_dir)
    return study.table, study.left_out


def write_study(study: Study, out_dir: Path) -> None:
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
    """The study's figures as PNGs in `figures_dir` (dcinterp.plotting: plot_study_*); the paths written."""
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


def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog="python -m dcinterp.train summarize", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs_dir", metavar="RUNS_DIR", help="a folder of runs (recipe.json files, at any depth)")
    parser.add_argument("--out", default=None, help="write summary.csv and summary.md here (default: RUNS_DIR)")
    parser.add_argument("--level", type=float, default=0.95, help="the interval's level (default %(default)s)")
    parser.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="the bootstrap's random seed (default %(default)s)")
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
    if args.resamples < 1:
        parser.error(f"--resamples {args.resamples}: expected at least 1")
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
            n_resamples=args.resamples,
            seed=args.seed,
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
