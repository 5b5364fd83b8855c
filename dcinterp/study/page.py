"""The study page's tables, from the data committed beside the page (docs/study-data/, whose README says where
each number comes from): the runs' own folders are not kept, so the page is regenerated from these.

    python -m dcinterp.train summarize --from-table docs/study-data --out DIR   # the page's tables, DIR/tables.md
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import scipy.stats

from .statistics import holm, paired_permutation_p, paired_t_power, seeds_for_power, sign_flip_interval, t_interval
from .tables import paired_table

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
