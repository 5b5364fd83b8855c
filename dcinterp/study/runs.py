"""The runs of a study read: each finished run's accuracies, the screen of its starts, its head diversity.

Every finished run's recipe.json under the folder is read (runs stopped early, or not evaluated, are listed and
left out). The DCMHA and MHA runs are paired by seed: the twins of a seed share the data order and the initial
weights of everything they share (`dcinterp.train`), so their difference is the architecture's, not the draw's.
Runs trained on every task (`--trained-on DIR`) give what each run lost on the combinations it left out
(`add_held_out_change`).

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from ..train.recipe import DEFAULT_RECORD, split_tasks  # DEFAULT_RECORD: a setting added since a run was trained

if TYPE_CHECKING:
    from ..circuits import HeadDiversity


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
    from ..circuits import HeadDiversity, head_diversity
    from ..model import HookedDCFormer

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
