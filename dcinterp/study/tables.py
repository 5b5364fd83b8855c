"""The study's table from its runs: summary.csv, summary.md and screen.csv.

The table has one row per evaluation set (released, generated_seed0, test_set) and measure: the overall accuracy,
the accuracy per QK pattern and per OV transformation, and the accuracy on the held-out combinations (the tasks a
run left out with `--exclude-combos`, or the default split's tasks when it left none out) and, for runs that left
combinations out, on each of them (`held_out_combo` rows, one per combination: the mean of its tasks' accuracies,
every task having as many answers). Given `--trained-on DIR`, the same seeds' runs trained on every task, it adds
what each run lost for never seeing them (`held_out_change` rows: its accuracy on the left-out tasks, all and per
combination, minus its twin's under DIR), which sets apart "composes a new combination better" from "learned the
pattern or the transformation better". Its columns: each architecture's mean over the paired seeds, the mean
paired difference DCMHA - MHA with its interval, the number of seeds in which DCMHA is ahead, and each run's own
accuracy (`dcmha_seed0`, `mha_seed0`, ...).

The interval and p are `dcinterp.study.statistics`'s; the runs are read by `dcinterp.study.runs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from .runs import (
    ARCHES,
    LOWER_IS_AHEAD,
    MEASURES,
    RunResult,
    add_head_diversity,
    add_held_out_change,
    read_runs,
    read_screen,
    run_values,
    screen_lines,
    width_lines,
)
from .statistics import paired_permutation_p, sign_flip_interval


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
