"""Figures of the paired study (`dcinterp.study`, `python -m dcinterp.train summarize RUNS_DIR --figures DIR`):
DCMHA - MHA per QK pattern and OV transformation, the held-out combinations, every run's head diversity and the
learning curves."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure

from .style import PAGE_WIDTH, SMALLEST_TYPE, draw_caption, draw_title

STUDY_ARCHES = {"dcmha": ("DCMHA", "tab:red"), "mha": ("MHA", "tab:blue")}  # label, colour in every study figure
HELD_OUT_LABELS = {
    "held_out_combos": "the never-seen combinations (left out of training by --exclude-combos)",
    "default_combo_tasks": "the default split's combination tasks (trained on: no --exclude-combos)",
}


def _paired_seeds(table) -> list[int]:
    """The seeds with both twins' values in some row of the table."""
    seeds = sorted({int(c.removeprefix("dcmha_seed")) for c in table.columns if c.startswith("dcmha_seed")})
    both = [s for s in seeds if f"mha_seed{s}" in table]
    return [s for s in both if (table[f"dcmha_seed{s}"].notna() & table[f"mha_seed{s}"].notna()).any()]


def _interval_label(table) -> str:
    """ "95% paired bootstrap over seeds" from the table's attrs (summary_table's interval, less its details)."""
    return table.attrs.get("interval", "interval").split(" (")[0]


def _seed_differences(row, seeds: list[int]) -> list[tuple[int, float]]:
    """(seed, DCMHA - MHA) of the seeds with both twins in the row."""
    pairs = [(s, row.get(f"dcmha_seed{s}", np.nan), row.get(f"mha_seed{s}", np.nan)) for s in seeds]
    return [(s, d - m) for s, d, m in pairs if not (np.isnan(d) or np.isnan(m))]


def _difference_rows(
    ax,
    rows,
    labels: list[str],
    seeds: list[int],
    interval: str,
    means: bool = True,
    scale: float = 100.0,
    unit: str = "%",
) -> np.ndarray:
    """Per row (top to bottom): the interval [low, high] as a bar, the mean difference as a tick, each seed's own
    difference as a dot (spread vertically by seed), each architecture's mean written at the right (`means`, in
    `unit`); zero line. Returns every x drawn, for the caller's limits (`_pad_limits`)."""
    drawn = [0.0]
    y = np.arange(len(rows))
    low, high = scale * rows["low"].to_numpy(float), scale * rows["high"].to_numpy(float)
    ax.barh(y, high - low, left=low, height=0.5, color="0.8", edgecolor="0.4", label=interval)
    ax.scatter(scale * rows["difference"], y, marker="|", s=300, color="black", linewidths=2, label="mean", zorder=3)
    for i, seed in enumerate(seeds):
        offset = 0.3 * (i - (len(seeds) - 1) / 2) / max(1, len(seeds) - 1)
        points = [(j, d) for j, (_, row) in enumerate(rows.iterrows()) for s, d in _seed_differences(row, [seed])]
        if points:
            rows_of, values = zip(*points, strict=True)
            drawn += [scale * v for v in values]
            ax.scatter(
                scale * np.array(values),
                np.array(rows_of) + offset,
                s=14,
                color=f"C{i}",
                zorder=4,
                label=f"seed {seed}",
            )
    number = ".1f" if unit == "%" else "+.1f"  # an accuracy, or a change
    for j, (_, row) in enumerate(rows.iterrows() if means else []):
        ax.text(
            1.02,
            j,
            f"DCMHA {scale * row['dcmha']:{number}}{unit}, MHA {scale * row['mha']:{number}}{unit}",
            transform=ax.get_yaxis_transform(),
            va="center",
            fontsize=SMALLEST_TYPE,
        )
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_yticks(y, labels)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.grid(alpha=0.3, axis="x")
    return np.concatenate([drawn, low, high])


def _pad_limits(ax, values: np.ndarray, pad: float = 0.06) -> None:
    """x limits around every value drawn, with a margin (the dots at the bars' ends stay whole)."""
    values = values[np.isfinite(values)]
    lo, hi = float(values.min()), float(values.max())
    margin = pad * (hi - lo) if hi > lo else 1.0
    ax.set_xlim(lo - margin, hi + margin)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def plot_study_differences(
    table, eval_set: str, title: str | None = None, caption: str | None = None, baseline: str = "MHA"
) -> Figure:
    """The paired study's claim per QK pattern and OV transformation on one evaluation set.

    For all tasks (top), each QK pattern, each OV transformation and, for runs that left combinations out of
    training, the never-seen combinations (all of them, then each) and, where the table has them, what never seeing
    them cost (`held_out_change`: the accuracy there minus the twin's trained on them): the mean paired difference
    DCMHA - MHA in percentage points (black tick) with its interval (grey bar: the table's low/high), each seed's own
    difference (a dot, one colour per seed), and each architecture's mean written at the right; right of zero, DCMHA
    is ahead (on the last panel: it lost less).

    Args:
        table: `dcinterp.study.summary_table(...)`.
        eval_set: The evaluation set whose rows are drawn.
        title: The title; default the evaluation set, the baseline and the number of seeds.
        caption: A line drawn under the figure.
        baseline: The MHA runs' name in the title and the axis (e.g. "MHA (d_mlp 304)" in a parameter-matched
            study).

    Returns:
        The figure.

    Raises:
        ValueError: The table has no rows of `eval_set`.
    """
    rows = table[table["eval_set"] == eval_set]
    seeds = _paired_seeds(table)
    never_seen = ((rows["measure"] == "held_out_combos") & (rows["group"] == "held_out_combos")) | (
        rows["measure"] == "held_out_combo"
    )  # the table's order: all the left-out tasks, then each combination
    panels = [
        (rows[rows["measure"] == measure], label)
        for measure, label in (
            ("overall", "all tasks"),
            ("qk_pattern", "QK pattern"),
            ("ov_transformation", "OV transformation"),
        )
        if (rows["measure"] == measure).any()
    ]
    if (rows["measure"] == "held_out_combo").any():
        panels.append((rows[never_seen], "never-seen combination"))
    if (rows["measure"] == "held_out_change").any():
        change = rows[rows["measure"] == "held_out_change"]
        change = change.sort_values("group", key=lambda group: group != "held_out_combos", kind="stable")  # all first
        panels.append((change, "never seen, against the twin trained on it"))
    if not panels:
        raise ValueError(f"eval_set {eval_set!r}: no rows in the table (it has {sorted(set(table['eval_set']))})")
    heights = [len(part) + 1.2 for part, _ in panels]
    interval = _interval_label(table)
    fig = Figure(figsize=(PAGE_WIDTH, 0.32 * sum(heights) + 1.4), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, height_ratios=heights, squeeze=False)[:, 0]
    drawn = []
    for ax, (part, label) in zip(axes, panels, strict=True):
        labels = ["all tasks"] if label == "all tasks" else list(part["group"])
        if part["measure"].iloc[0] in ("held_out_combos", "held_out_combo", "held_out_change"):
            labels[0] = f"all {len(labels) - 1} combinations"
        unit = " points" if part["measure"].iloc[0] == "held_out_change" else "%"
        drawn.append(_difference_rows(ax, part, labels, seeds, interval, unit=unit))
        if label != "all tasks":
            ax.set_title(label, fontsize=10, loc="left")
    _pad_limits(axes[-1], np.concatenate(drawn))  # shared by the panels
    axes[-1].set_xlabel(f"DCMHA - {baseline} accuracy (percentage points)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(
        handles, labels, loc="outside lower center", ncol=min(len(labels), 4), fontsize=SMALLEST_TYPE, frameon=False
    )
    draw_title(fig, title or f"{eval_set}: DCMHA - {baseline} accuracy, paired by seed ({_plural(len(seeds), 'seed')})")
    draw_caption(fig, caption)
    return fig


def plot_study_held_out(table, title: str | None = None, caption: str | None = None) -> Figure:
    """The held-out combinations (`held_out_combos` rows of the summary table), per evaluation set.

    Left: each seed's MHA and DCMHA accuracy joined by a line (its colour: the seed), the means in black. Right:
    the mean paired difference DCMHA - MHA with its interval (the table's low/high). The title says which tasks
    these are: the combinations the runs left out of training (--exclude-combos), or, when they left none out,
    the default split's combination tasks, which they trained on.

    Args:
        table: `dcinterp.study.summary_table(...)`.
        title: The title; default says which tasks these are.
        caption: A line drawn under the figure.

    Returns:
        The figure.

    Raises:
        ValueError: The table has no held_out_combos rows.
    """
    rows = table[table["measure"] == "held_out_combos"]
    if rows.empty:
        raise ValueError("the table has no held_out_combos rows (no run recorded held-out or default combo tasks)")
    seeds = _paired_seeds(table)
    eval_sets = list(rows["eval_set"])
    fig = Figure(figsize=(PAGE_WIDTH, 4.2), layout="constrained")
    pairs_ax, diff_ax = fig.subplots(1, 2, width_ratios=[2.2, 1])
    for j, (_, row) in enumerate(rows.iterrows()):
        x = np.array([3 * j, 3 * j + 1])
        for i, seed in enumerate(seeds):
            mha, dcmha = row.get(f"mha_seed{seed}", np.nan), row.get(f"dcmha_seed{seed}", np.nan)
            if not (np.isnan(mha) or np.isnan(dcmha)):
                pairs_ax.plot(
                    x, 100 * np.array([mha, dcmha]), color=f"C{i}", marker="o", linewidth=1, label=f"seed {seed}"
                )
        pairs_ax.plot(x, 100 * np.array([row["mha"], row["dcmha"]]), color="black", linewidth=2.5, label="mean")
    pairs_ax.set_xticks(
        [x for j in range(len(eval_sets)) for x in (3 * j, 3 * j + 1)], ["MHA", "DCMHA"] * len(eval_sets)
    )
    for j, eval_set in enumerate(eval_sets):
        pairs_ax.text(3 * j + 0.5, -0.12, eval_set, transform=pairs_ax.get_xaxis_transform(), ha="center", va="top")
    pairs_ax.set_ylabel("accuracy (%)")
    pairs_ax.grid(alpha=0.3, axis="y")
    handles, labels = pairs_ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    pairs_ax.legend(unique.values(), unique.keys(), fontsize=SMALLEST_TYPE, loc="best")
    pairs_ax.set_title("each seed's twins", fontsize=10)
    drawn = _difference_rows(diff_ax, rows, eval_sets, seeds, _interval_label(table), means=False)  # means: left
    _pad_limits(diff_ax, drawn)
    diff_ax.set_xlabel("DCMHA - MHA (points)")
    diff_ax.set_title("paired difference", fontsize=10)
    which = HELD_OUT_LABELS.get(str(rows["group"].iloc[0]), str(rows["group"].iloc[0]))
    draw_title(fig, title or f"Accuracy on {which}")
    draw_caption(fig, caption)
    return fig


def plot_study_head_diversity(
    frame, marks: Sequence[int] = (), title: str | None = None, caption: str | None = None
) -> Figure:
    """Head diversity (Fig. 5's measure) of every run of the study.

    The cumulative share of variance captured by the first k principal components of the heads' concatenated QK
    circuits (left) and OV circuits (right), averaged over layers; each run thin, each architecture's mean over
    its runs thick (DCMHA red, MHA blue). Lower = more diverse heads.

    Args:
        frame: `dcinterp.study.diversity_frame(...)`: columns arch, seed, circuit, components, captured.
        marks: Values of k drawn as dotted lines (the table's k).
        title: The title; default "Head diversity of each run (lower = more diverse heads)".
        caption: A line drawn under the figure.

    Returns:
        The figure.
    """
    fig = Figure(figsize=(PAGE_WIDTH, 3.8), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    for ax, circuit in zip(axes, ("qk", "ov"), strict=True):
        part = frame[frame["circuit"] == circuit]
        for arch, (label, color) in STUDY_ARCHES.items():
            runs = part[part["arch"] == arch]
            if runs.empty:
                continue
            for _, curve in runs.groupby("seed"):
                ax.plot(curve["components"], curve["captured"], color=color, linewidth=0.7, alpha=0.5)
            mean = runs.groupby("components")["captured"].mean()
            n = runs["seed"].nunique()
            ax.plot(
                mean.index, mean.to_numpy(), color=color, linewidth=2.4, label=f"{label}: mean of {_plural(n, 'run')}"
            )
        for k in marks:
            ax.axvline(k, color="grey", linestyle=":", linewidth=1)
        ax.set_title("QK circuits (normalised per head)" if circuit == "qk" else "OV circuits", fontsize=10)
        ax.set_xlabel("number of principal components k")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=SMALLEST_TYPE, loc="lower right", title="thin: each run", title_fontsize=SMALLEST_TYPE)
    axes[0].set_ylabel("cumulative captured variance")
    draw_title(fig, title or "Head diversity of each run (lower = more diverse heads)")
    draw_caption(fig, caption)
    return fig


def plot_study_learning_curves(frame, title: str | None = None, caption: str | None = None) -> Figure:
    """The probe accuracy logged during training against the step.

    One colour per seed, DCMHA solid, MHA dashed; a dotted vertical line where the shared start ends (the step the
    runs forked from, when they did).

    Args:
        frame: `dcinterp.study.learning_curves(...)`: columns seed, arch, step, eval_accuracy (logged every
            --eval-every steps), start_step.
        title: The title; default "Learning curves: probe accuracy during training".
        caption: A line drawn under the figure.

    Returns:
        The figure.
    """
    fig = Figure(figsize=(PAGE_WIDTH, 3.8), layout="constrained")
    ax = fig.subplots()
    seeds = sorted(frame["seed"].unique())
    styles = {"dcmha": "-", "mha": "--"}
    for (seed, arch), run in frame.groupby(["seed", "arch"]):
        run = run.sort_values("step")
        ax.plot(
            run["step"],
            100 * run["eval_accuracy"],
            color=f"C{seeds.index(seed)}",
            linestyle=styles.get(arch, ":"),
            marker="o",
            markersize=3,
            label=f"seed {seed} {STUDY_ARCHES.get(arch, (arch,))[0]}",
        )
    for step in sorted(frame["start_step"].dropna().unique()):
        ax.axvline(step, color="black", linestyle=":", linewidth=1.2, label=f"shared start ends (step {step:g})")
    ax.set_xlabel("step")
    ax.set_ylabel("probe accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=SMALLEST_TYPE, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    draw_title(fig, title or "Learning curves: probe accuracy during training")
    draw_caption(fig, caption)
    return fig
