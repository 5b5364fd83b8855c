"""Figures of the synthetic-task evaluation (`dcinterp.synth.accuracy`): accuracy by shots (Fig. 6), by QK pattern
and OV transformation (Table 5), per combination, and two checkpoints' paired difference."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from .style import DIVERGING, PAGE_WIDTH, SEQUENTIAL, SMALLEST_TYPE, draw_caption, draw_title, symmetric_limit


def _checkpoints(tables: Mapping) -> list[str]:
    return list(dict.fromkeys(tables["overall"]["checkpoint"]))


def _interval_bars(ax, table, column: str, checkpoints: list[str], categories: list[str]) -> None:
    """Horizontal bars per category and checkpoint with their intervals, and each category's chance as a dash."""
    height = 0.8 / len(checkpoints)
    positions = np.arange(len(categories))
    for i, checkpoint in enumerate(checkpoints):
        rows = table[table["checkpoint"] == checkpoint].set_index(column).reindex(categories)
        y = positions - 0.4 + height * (i + 0.5)
        error = [rows["accuracy"] - rows["low"], rows["high"] - rows["accuracy"]]
        ax.barh(
            y,
            rows["accuracy"],
            height,
            color=f"C{i}",
            label=checkpoint,
            xerr=error,
            error_kw=dict(ecolor="black", elinewidth=0.8, capsize=2),
        )
    chance = table.groupby(column, sort=False)["chance"].mean().reindex(categories)
    ax.vlines(
        chance, positions - 0.45, positions + 0.45, colors="black", linestyles="--", linewidth=1.2, label="chance"
    )
    ax.set_yticks(positions, categories)
    ax.set_ylim(len(categories) - 0.5, -0.5)
    ax.set_xlim(0, 1)
    ax.set_xlabel("accuracy")


def _combination_grid(table, checkpoint: str, qk_patterns: list[str], ov_transformations: list[str], value: str):
    rows = table[table["checkpoint"] == checkpoint].set_index(["qk_pattern", "ov_transformation"])
    return np.array([[rows[value].get((qk, ov), np.nan) for ov in ov_transformations] for qk in qk_patterns])


def _label_combination_axes(ax, qk_patterns: list[str], ov_transformations: list[str], left: bool) -> None:
    ax.set_xticks(range(len(ov_transformations)), ov_transformations, rotation=30, ha="right", rotation_mode="anchor")
    ax.set_yticks(range(len(qk_patterns)), qk_patterns if left else [""] * len(qk_patterns))
    ax.set_xlabel("OV transformation")
    if left:
        ax.set_ylabel("QK pattern")


def plot_synthetic_eval(tables: Mapping, title: str | None = None, caption: str | None = None) -> Figure:
    """Accuracy on the synthetic tasks, panels stacked.

    Accuracy by shots K (Fig. 6) with its interval as a band; then by QK pattern (which fact to look up) and by OV
    transformation (what to answer with it), with intervals as error bars and chance (a random candidate of the
    line: 1/3, 1/2 for odd-one-out) as dashes; then each checkpoint's accuracy per (QK pattern, OV
    transformation) combination, in percent with its interval, on one shared 0-100% scale (grey: no sample of
    that combination); and with two or more checkpoints the first minus the second in percentage points with the
    paired interval of `tables["difference"]` in each cell, the differences whose interval leaves out zero in bold
    and framed (diverging, centred at zero).

    Args:
        tables: `dcinterp.synth.accuracy.accuracy_tables(results)`: the frames overall, k_shot, qk_pattern,
            ov_transformation, combination and, optionally, difference.
        title: The title; default "Synthetic-task evaluation".
        caption: A line drawn under the figure.

    Returns:
        The figure.
    """
    from matplotlib.ticker import PercentFormatter

    checkpoints = _checkpoints(tables)
    overall = tables["overall"].set_index("checkpoint")
    interval = tables["overall"].attrs.get("interval", "interval")
    compare = len(checkpoints) > 1
    qk_patterns = list(dict.fromkeys(tables["qk_pattern"]["qk_pattern"]))
    ov_transformations = list(dict.fromkeys(tables["ov_transformation"]["ov_transformation"]))
    map_height = 0.55 * len(qk_patterns) + 1.9
    heights = [3.2, 0.3 * max(len(qk_patterns), len(ov_transformations)) * len(checkpoints) + 1.6]
    heights += [map_height] * (len(checkpoints) + compare)
    fig = Figure(figsize=(PAGE_WIDTH, sum(heights) + 1.2), layout="constrained")
    rows = fig.subfigures(len(heights), 1, height_ratios=heights)

    ax = rows[0].subplots()
    by_k = tables["k_shot"]
    for i, checkpoint in enumerate(checkpoints):
        k_rows = by_k[by_k["checkpoint"] == checkpoint].sort_values("k_shot")
        o = overall.loc[checkpoint]
        ax.plot(
            k_rows["k_shot"],
            k_rows["accuracy"],
            marker="o",
            color=f"C{i}",
            label=f"{checkpoint}: {o['accuracy']:.1%} [{o['low']:.1%}, {o['high']:.1%}]",
        )
        ax.fill_between(k_rows["k_shot"], k_rows["low"], k_rows["high"], color=f"C{i}", alpha=0.2, linewidth=0)
    chance = float(tables["overall"]["chance"].mean())
    ax.axhline(chance, color="black", linestyle="--", linewidth=1.2, label=f"chance ({chance:.0%})")
    ax.set_xlabel("shots K (lines before the answer's line)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.grid(alpha=0.3)
    ax.legend(
        fontsize=SMALLEST_TYPE,
        loc="center left",
        bbox_to_anchor=(1.02, 0.5),
        title=f"overall [{interval}]",
        title_fontsize=SMALLEST_TYPE,
        frameon=False,
    )
    ax.set_title("Accuracy by number of shots", fontsize=10)

    bar_axes = rows[1].subplots(1, 2)
    for ax, column, label in zip(
        bar_axes, ("qk_pattern", "ov_transformation"), ("QK pattern", "OV transformation"), strict=True
    ):
        categories = qk_patterns if column == "qk_pattern" else ov_transformations
        _interval_bars(ax, tables[column], column, checkpoints, categories)
        ax.xaxis.set_major_formatter(PercentFormatter(1.0))
        ax.set_title(f"Accuracy by {label}", fontsize=10)
        ax.grid(alpha=0.3, axis="x")
    handles, labels = bar_axes[0].get_legend_handles_labels()
    rows[1].legend(handles, labels, loc="outside lower center", ncol=len(labels), fontsize=SMALLEST_TYPE, frameon=False)

    combinations = tables["combination"]
    cmap = colormaps[SEQUENTIAL].with_extremes(bad="0.9")
    for j, checkpoint in enumerate(checkpoints):
        ax = rows[2 + j].subplots()
        values, low, high = (
            _combination_grid(combinations, checkpoint, qk_patterns, ov_transformations, value)
            for value in ("accuracy", "low", "high")
        )
        image = ax.imshow(100 * values, cmap=cmap, vmin=0, vmax=100, aspect="auto")
        for (r, c), value in np.ndenumerate(values):
            text = "no\nsample" if np.isnan(value) else f"{value:.0%}\n{100 * low[r, c]:.0f}-{100 * high[r, c]:.0f}"
            color = "0.4" if np.isnan(value) else ("black" if value > 0.6 else "white")
            ax.text(c, r, text, ha="center", va="center", fontsize=SMALLEST_TYPE, color=color)
        _label_combination_axes(ax, qk_patterns, ov_transformations, left=True)
        ax.set_title(f"{checkpoint}: accuracy per combination, with its interval", fontsize=10)
        rows[2 + j].colorbar(image, ax=ax, label="accuracy (%)", shrink=0.9)

    if compare:
        difference = tables.get("difference")
        ax = rows[-1].subplots()
        diff = 100 * (
            _combination_grid(combinations, checkpoints[0], qk_patterns, ov_transformations, "accuracy")
            - _combination_grid(combinations, checkpoints[1], qk_patterns, ov_transformations, "accuracy")
        )
        limit = symmetric_limit(diff)
        image = ax.imshow(
            diff, cmap=colormaps[DIVERGING].with_extremes(bad="0.9"), vmin=-limit, vmax=limit, aspect="auto"
        )
        for (r, c), value in np.ndenumerate(diff):
            if np.isnan(value):
                continue
            text, significant = f"{round(value):+d}", False
            if difference is not None:
                cell = difference.set_index(["qk_pattern", "ov_transformation"]).loc[
                    (qk_patterns[r], ov_transformations[c])
                ]
                text += f"\n[{round(100 * cell['low']):+d}, {round(100 * cell['high']):+d}]"  # never -0
                significant = bool(cell["significant"])
            ax.text(
                c,
                r,
                text,
                ha="center",
                va="center",
                fontsize=SMALLEST_TYPE,
                color="white" if abs(value) > 0.6 * limit else "black",
                fontweight="bold" if significant else "normal",
            )
            if significant:
                ax.add_patch(Rectangle((c - 0.47, r - 0.47), 0.94, 0.94, fill=False, edgecolor="black", linewidth=1.5))
        _label_combination_axes(ax, qk_patterns, ov_transformations, left=True)
        ax.set_title(
            f"{checkpoints[0]} minus {checkpoints[1]}"
            + (" (framed: the paired 95% interval leaves out 0)" if difference is not None else ""),
            fontsize=10,
        )
        rows[-1].colorbar(image, ax=ax, label="difference\n(percentage points)", shrink=0.9)
    draw_title(fig, title or "Synthetic-task evaluation")
    draw_caption(fig, caption)
    return fig
