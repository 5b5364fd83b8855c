"""Accuracies on the synthetic tasks with confidence intervals and chance levels, ready to plot (Table 5, Fig. 6).

From the per-answer results of `dcinterp.synth.evaluate.evaluate` (one row per checkpoint, sample and answer):

    tables = accuracy_tables(results)                    # {"overall", "k_shot", "qk_pattern", ...}: DataFrames
    tables["difference"]                                 # two checkpoints: first minus second, paired intervals
    tables["qk_pattern"]                                 # checkpoint, qk_pattern, accuracy, low, high, chance, ...

Intervals (`interval=`, at `level`, default 95%):
- "bootstrap" (default): percentile bootstrap over samples. The six answers of a sample share its context and are
  not independent, so the samples are resampled, each with all its answers.
- "wilson": the Wilson score interval, treating every answer as an independent trial; narrower, since it ignores
  that answers of one sample go together.

Chance: the accuracy of picking uniformly among the line's candidates, the items (or persons) its facts name
whose transformation could be the answer: three for the person lookups, two distinct items for odd-one-out.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .catalog import QK_PATTERNS

CHANCE_BY_QK_PATTERN = {pattern: 1 / 2 if pattern == "odd-one-out" else 1 / 3 for pattern in QK_PATTERNS}
GROUPINGS = ("overall", "k_shot", "qk_pattern", "ov_transformation", "task", "combination")
INTERVALS = ("bootstrap", "wilson")
TABLE_COLUMNS = ["accuracy", "low", "high", "chance", "answers", "samples"]


def chance_per_answer(results: pd.DataFrame) -> pd.Series:
    """The chance of each answer from its task's QK pattern.

    Args:
        results: the per-answer results of `evaluate`, with a "qk_pattern" column.

    Returns:
        One chance per row; NaN for an unknown pattern.
    """
    return results["qk_pattern"].map(CHANCE_BY_QK_PATTERN).astype(float)


def accuracy_table(
    results: pd.DataFrame,
    by: str | list[str] | None = None,
    interval: str = "bootstrap",
    level: float = 0.95,
    n_resamples: int = 2000,
    seed: int = 0,
) -> pd.DataFrame:
    """Accuracy per checkpoint (and per value of `by`) with its interval, chance, answers and samples.

    Args:
        results: the per-answer results of `evaluate` (checkpoint, task, sample, correct, qk_pattern, ...).
        by: the column or columns to group by besides the checkpoint; None: per checkpoint only.
        interval: "bootstrap" (over samples) or "wilson" (over answers).
        level: the interval's confidence level.
        n_resamples: the bootstrap's resamples.
        seed: the bootstrap's random seed.

    Returns:
        One row per group: its keys, accuracy, low, high, chance, answers, samples; `attrs["interval"]` says which
        interval.

    Raises:
        ValueError: an unknown `interval`, or `level` outside (0, 1).
    """
    if interval not in INTERVALS:
        raise ValueError(f"interval={interval!r}: expected one of {', '.join(INTERVALS)}")
    if not 0 < level < 1:
        raise ValueError(f"level={level!r}: expected a number between 0 and 1")
    keys = ["checkpoint", *([by] if isinstance(by, str) else by or [])]
    rows = []
    for values, group in results.assign(chance=chance_per_answer(results)).groupby(keys, sort=False):
        correct = group["correct"].to_numpy(dtype=float)
        low, high = (
            bootstrap_interval(group, level, n_resamples, seed)
            if interval == "bootstrap"
            else wilson_interval(int(correct.sum()), len(correct), level)
        )
        rows.append(
            [
                *values,
                correct.mean(),
                low,
                high,
                group["chance"].mean(),
                len(group),
                group[["task", "sample"]].drop_duplicates().shape[0],
            ]
        )
    table = pd.DataFrame(rows, columns=[*keys, *TABLE_COLUMNS])
    table.attrs["interval"] = (
        f"{level:.0%} bootstrap interval over samples"
        if interval == "bootstrap"
        else f"{level:.0%} Wilson interval over answers"
    )
    return table


def accuracy_tables(
    results: pd.DataFrame, interval: str = "bootstrap", level: float = 0.95, n_resamples: int = 2000, seed: int = 0
) -> dict[str, pd.DataFrame]:
    """`accuracy_table` for each of GROUPINGS, and the difference of the first two checkpoints.

    Args:
        results: the per-answer results of `evaluate`.
        interval: "bootstrap" or "wilson", as in `accuracy_table`.
        level: the intervals' confidence level.
        n_resamples: the bootstrap's resamples.
        seed: the bootstrap's random seed.

    Returns:
        One table per grouping ("combination": per QK pattern and OV transformation), and with two or more
        checkpoints "difference": `difference_table` of the first two per combination.
    """
    by = {"overall": None, "combination": ["qk_pattern", "ov_transformation"]}
    tables = {
        name: accuracy_table(results, by.get(name, name), interval, level, n_resamples, seed) for name in GROUPINGS
    }
    checkpoints = list(dict.fromkeys(results["checkpoint"]))
    if len(checkpoints) > 1:
        tables["difference"] = difference_table(
            results, checkpoints[0], checkpoints[1], by["combination"], level, n_resamples, seed
        )
    return tables


def difference_table(
    results: pd.DataFrame,
    first: str,
    second: str,
    by: str | list[str] | None = None,
    level: float = 0.95,
    n_resamples: int = 2000,
    seed: int = 0,
) -> pd.DataFrame:
    """The accuracy of checkpoint `first` minus that of `second`, with a paired bootstrap interval.

    The percentile bootstrap runs over the samples both checkpoints answered: each resample draws samples with
    replacement and scores both checkpoints on the same draw.

    Args:
        results: the per-answer results of `evaluate`.
        first: the checkpoint whose accuracy is subtracted from.
        second: the checkpoint subtracted.
        by: the column or columns to group by; None: one row.
        level: the interval's confidence level.
        n_resamples: the bootstrap's resamples.
        seed: the bootstrap's random seed.

    Returns:
        One row per group: its keys, difference, low, high, significant (the interval leaves out zero), samples.
    """
    keys = [by] if isinstance(by, str) else list(by or [])
    sample = ["task", "sample"]
    counts = results.groupby(["checkpoint", *keys, *sample], sort=False)["correct"].agg(["sum", "count"])
    paired = counts.loc[first].join(counts.loc[second], how="inner", lsuffix="_first", rsuffix="_second")
    rng = np.random.default_rng(seed)
    tail = (1 - level) / 2
    rows = []
    for values, group in paired.groupby(level=keys, sort=False) if keys else [((), paired)]:
        c = group.to_numpy(float)  # sum_first, count_first, sum_second, count_second per sample
        difference = c[:, 0].sum() / c[:, 1].sum() - c[:, 2].sum() / c[:, 3].sum()
        draws = rng.integers(0, len(c), size=(n_resamples, len(c)))
        resampled = c[draws, 0].sum(1) / c[draws, 1].sum(1) - c[draws, 2].sum(1) / c[draws, 3].sum(1)
        low, high = np.quantile(resampled, [tail, 1 - tail])
        values = values if isinstance(values, tuple) else (values,)
        rows.append([*values, difference, float(low), float(high), bool(low > 0 or high < 0), len(c)])
    table = pd.DataFrame(rows, columns=[*keys, "difference", "low", "high", "significant", "samples"])
    table.attrs["interval"] = f"{level:.0%} paired bootstrap interval over samples"
    table.attrs["checkpoints"] = (first, second)
    return table


def wilson_interval(successes: int, trials: int, level: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (scipy's).

    Args:
        successes: the correct answers.
        trials: the answers.
        level: the confidence level.

    Returns:
        (low, high).
    """
    from scipy.stats import binomtest

    interval = binomtest(successes, trials).proportion_ci(confidence_level=level, method="wilson")
    return float(interval.low), float(interval.high)


def bootstrap_interval(
    group: pd.DataFrame, level: float = 0.95, n_resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap of the accuracy over samples.

    Each resample draws samples with replacement, and an accuracy is the correct answers over the answers of the
    samples drawn.

    Args:
        group: per-answer results (task, sample, correct) of one group.
        level: the confidence level.
        n_resamples: the resamples.
        seed: the random seed.

    Returns:
        (low, high).
    """
    per_sample = group.groupby(["task", "sample"], sort=False)["correct"].agg(["sum", "count"]).to_numpy(float)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(per_sample), size=(n_resamples, len(per_sample)))
    accuracies = per_sample[draws, 0].sum(1) / per_sample[draws, 1].sum(1)
    tail = (1 - level) / 2
    low, high = np.quantile(accuracies, [tail, 1 - tail])
    return float(low), float(high)
