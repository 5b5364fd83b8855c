"""The paired study's table: the accuracies of a folder of runs, and the paired difference DCMHA - MHA per seed.

    python -m dcinterp.train --seeds 0-4 --out runs/study ...     # RUNS_DIR/seed<N>/<name>/recipe.json
    python -m dcinterp.train summarize runs/study                 # runs/study/summary.csv and summary.md

Every finished run's recipe.json under the folder is read (runs stopped early, or not evaluated, are listed and
left out). The DCMHA and MHA runs are paired by seed: the twins of a seed share the data order and the initial
weights of everything they share (`dcinterp.train`), so their difference is the architecture's, not the draw's.
The table has one row per evaluation set (released, generated_seed0, test_set) and measure: the overall accuracy,
the accuracy per QK pattern and per OV transformation, and the accuracy on the held-out combinations (the tasks a
run left out with `--exclude-combos`, or the default split's tasks when it left none out). Its columns: each
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
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from .cli import Parser

ARCHES = ("dcmha", "mha")
MEASURES = ("overall", "qk_pattern", "ov_transformation", "held_out_combos")
MAY_DIFFER = ("seed", "arch", "threads", "max_minutes", "log_every", "eval_every")  # in one study: not what is learned


@dataclass
class RunResult:
    """One run's accuracies, as its recipe.json records them."""

    path: Path
    arch: str
    seed: int
    config: dict
    accuracy: dict  # {eval set: {(measure, group): accuracy}}


def read_run(path: Path) -> RunResult | str:
    """The run's result, or why it is left out (one line)."""
    try:
        recipe = json.loads(path.read_text())
        config, evaluated = recipe["train_config"], recipe.get("accuracy")
        arch, seed = config["arch"], int(recipe["seed"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not a dcinterp.train recipe ({type(e).__name__}: {e})") from e
    if recipe.get("stopped_early"):
        return f"{path}: stopped early at step {recipe.get('steps')} (continue it with --resume)"
    if not evaluated:
        return f"{path}: not evaluated (python -m dcinterp.train --eval-only)"
    accuracy = {}
    for eval_set, entry in evaluated.items():
        if not isinstance(entry, dict) or "accuracy" not in entry:
            continue
        values = {("overall", "all"): entry["accuracy"]}
        for measure, key in (("qk_pattern", "by_qk_pattern"), ("ov_transformation", "by_ov_transformation")):
            values.update({(measure, group): value for group, value in entry.get(key, {}).items()})
        held = entry.get("held_out_combos") or entry.get("default_combo_tasks")
        if held and held.get("accuracy") is not None:
            values[("held_out_combos", "all")] = held["accuracy"]
        accuracy[eval_set] = values
    return RunResult(path, arch, seed, config, accuracy)


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
    """Every run of the folder trained with the same settings but those of MAY_DIFFER, and no seed has two runs of
    one architecture: else the pairs would compare more than the architecture."""
    seen: dict[tuple[str, int], Path] = {}
    for run in runs:
        if (run.arch, run.seed) in seen:
            raise ValueError(
                f"{run.path}: a second {run.arch} run of seed {run.seed} (the first: {seen[run.arch, run.seed]})"
            )
        seen[run.arch, run.seed] = run.path
        first = runs[0]
        for key in sorted(set(run.config) | set(first.config)):
            if key not in MAY_DIFFER and run.config.get(key) != first.config.get(key):
                raise ValueError(
                    f"{run.path}: train_config {key}={run.config.get(key)!r}, but {first.path} has "
                    f"{first.config.get(key)!r}: summarize one recipe's runs at a time"
                )


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


def summary_table(runs: list[RunResult], level: float = 0.95, n_resamples: int = 10_000, seed: int = 0) -> pd.DataFrame:
    """One row per (eval_set, measure, group); see the module's docstring for the columns."""
    by_arch = {arch: {run.seed: run for run in runs if run.arch == arch} for arch in ARCHES}
    seeds = sorted({run.seed for run in runs})
    eval_sets = list(dict.fromkeys(eval_set for run in runs for eval_set in run.accuracy))  # as the recipes list them
    rows_index = sorted(
        {(eval_set, *key) for run in runs for eval_set, values in run.accuracy.items() for key in values},
        key=lambda row: (eval_sets.index(row[0]), MEASURES.index(row[1]), row[2]),
    )
    rows = []
    for eval_set, measure, group in rows_index:
        accuracy = {
            (arch, s): run.accuracy.get(eval_set, {}).get((measure, group))
            for arch in ARCHES
            for s, run in by_arch[arch].items()
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
            "seeds": len(paired),
            "dcmha_ahead": int((differences > 0).sum()),
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
    percent = [c for c in table.columns if c not in ("eval_set", "measure", "group", "seeds", "dcmha_ahead")]
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
            else str(row[c])
            for c in table.columns
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_summary(runs_dir: Path, out_dir: Path | None = None, **bootstrap) -> tuple[pd.DataFrame, list[str]]:
    """Read the runs, write summary.csv and summary.md to `out_dir` (default: `runs_dir`); (table, left out)."""
    runs, left_out = read_runs(runs_dir)
    if not runs:
        raise ValueError(f"{runs_dir}: no finished, evaluated run ({len(left_out)} left out: {left_out[0]})")
    table = summary_table(runs, **bootstrap)
    out_dir = out_dir or runs_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    table.to_csv(out_dir / "summary.csv", index=False)
    pairs = sorted({run.seed for run in runs if run.arch == "dcmha"} & {run.seed for run in runs if run.arch == "mha"})
    header = [
        f"Runs under `{runs_dir}`: {len(runs)} ({', '.join(f'{r.arch} seed {r.seed}' for r in runs)}); "
        f"paired seeds: {', '.join(map(str, pairs)) or 'none'}.",
        f"difference = DCMHA - MHA (percentage points), low/high: {table.attrs['interval']}; "
        "dcmha_ahead: seeds in which DCMHA is ahead.",
        *(f"Left out: {line}" for line in left_out),
    ]
    (out_dir / "summary.md").write_text("\n\n".join(header) + "\n\n" + markdown(table))
    return table, left_out


def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog="python -m dcinterp.train summarize", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs_dir", metavar="RUNS_DIR", help="a folder of runs (recipe.json files, at any depth)")
    parser.add_argument("--out", default=None, help="write summary.csv and summary.md here (default: RUNS_DIR)")
    parser.add_argument("--level", type=float, default=0.95, help="the interval's level (default %(default)s)")
    parser.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="the bootstrap's random seed (default %(default)s)")
    args = parser.parse_args(argv)
    if not 0 < args.level < 1:
        parser.error(f"--level {args.level}: expected a number between 0 and 1")
    if args.resamples < 1:
        parser.error(f"--resamples {args.resamples}: expected at least 1")
    runs_dir = Path(args.runs_dir)
    out_dir = Path(args.out) if args.out else None
    try:
        write_summary(runs_dir, out_dir, level=args.level, n_resamples=args.resamples, seed=args.seed)
    except ValueError as e:
        parser.error(str(e))
    written = out_dir or runs_dir
    print((written / "summary.md").read_text())
    print(f"written: {written / 'summary.csv'}, {written / 'summary.md'}", file=sys.stderr)
