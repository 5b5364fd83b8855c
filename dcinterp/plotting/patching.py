"""Figures of `dcinterp.patching` and of the branch ablation (`python -m dcinterp.synth ablate`): patching tables on
one shared scale, attribution patching against exact patching, and accuracy changes when a branch is switched off."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping

import numpy as np
from matplotlib.figure import Figure

from .style import PAGE_WIDTH, SMALLEST_TYPE, draw_caption, draw_title


def _patching_limit(values: np.ndarray) -> float:
    """The colour scale's half-width: the largest magnitude (1 where everything is 0)."""
    finite = np.abs(values[np.isfinite(values)])
    return float(finite.max()) if finite.size and finite.max() > 0 else 1.0


def _centred_heatmap(ax, values: np.ndarray, limit: float, fontsize: float = SMALLEST_TYPE, digits: int = 2):
    """A heatmap on the diverging colormap over [-limit, limit], each cell's value written in it."""
    image = ax.imshow(values, cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto")
    for (row, col), value in np.ndenumerate(values):
        if np.isfinite(value):
            text = f"{value:+.{digits}f}" if round(value, digits) != 0 else "0"
            ax.text(
                col,
                row,
                text,
                ha="center",
                va="center",
                fontsize=fontsize,
                color="white" if abs(value) > 0.6 * limit else "black",
            )
    return image


def _patching_grid(frame) -> tuple[np.ndarray, list[str], list[str], str]:
    """Rows stage.site, columns layers (one value per site) or heads (per-head frames of one layer)."""
    frame = frame.assign(row=frame["stage"] + "." + frame["site"])
    per_head = (frame["head"] != "all").any()
    column = "head" if per_head else "layer"
    if per_head and frame["layer"].nunique() > 1:
        frame = frame.assign(row="L" + frame["layer"].astype(str) + " " + frame["row"])
    rows = list(dict.fromkeys(frame["row"]))
    columns = list(dict.fromkeys(frame[column]))
    grid = frame.pivot(index="row", columns=column, values="effect").reindex(index=rows, columns=columns)
    return grid.to_numpy(dtype=float), rows, [str(c) for c in columns], column


def plot_patching(frames: Mapping[str, object], title: str | None = None, caption: str | None = None) -> Figure:
    """Patching tables side by side on one shared scale.

    Rows: stage.site; columns: layers, or heads for per-head tables. Red: patching raises the clean-minus-corrupt
    logit difference (denoising restores it), blue: lowers it (noising removes it); 1 = all of the difference.

    Args:
        frames: `activation_patching` / `attribution_patching` frames, keyed by the panel's title.
        title: The figure's title; none by default.
        caption: A line drawn under the figure.

    Returns:
        The figure.
    """
    grids = {name: _patching_grid(frame) for name, frame in frames.items()}
    limit = max(_patching_limit(values) for values, *_ in grids.values())
    n_rows = max(len(rows) for _, rows, _, _ in grids.values())
    n_cols = max(len(cols) for _, _, cols, _ in grids.values())
    width = min(PAGE_WIDTH, 1.6 + (0.55 * n_cols + 1.3) * len(grids))
    fig = Figure(figsize=(width, 1.4 + 0.27 * n_rows), layout="constrained")
    axes = fig.subplots(1, len(grids), squeeze=False, sharey=True)[0]
    for ax, (name, (values, rows, cols, column)) in zip(axes, grids.items(), strict=True):
        image = _centred_heatmap(ax, values, limit)
        ax.set_xticks(range(len(cols)), cols)
        ax.set_yticks(range(len(rows)), rows)
        ax.set_xlabel(column)
        ax.set_title(textwrap.fill(name, 24), fontsize=10)
    fig.colorbar(image, ax=list(axes), label="effect (share of clean - corrupt LD)", shrink=0.8)
    if title:
        draw_title(fig, title)
    draw_caption(fig, caption)
    return fig


def plot_patching_agreement(exact, estimate, title: str | None = None) -> Figure:
    """Attribution patching against exact patching, one point per site (and head), with y = x.

    The title gives the number of rows and Spearman's rho. Effect: share of the clean - corrupt logit difference.

    Args:
        exact: The `activation_patching` frame.
        estimate: The `attribution_patching` frame of the same sites, in the same row order.
        title: The title's first words; default "attribution vs exact patching".

    Returns:
        The figure.
    """
    from scipy.stats import spearmanr

    x, y = exact["effect"].to_numpy(float), estimate["effect"].to_numpy(float)
    limit = _patching_limit(np.concatenate([x, y])) * 1.05
    fig = Figure(figsize=(4.6, 4.6), layout="constrained")
    ax = fig.subplots()
    ax.axline((0, 0), slope=1, color="grey", lw=0.8, ls="--", label="y = x")
    ax.axhline(0, color="lightgrey", lw=0.6)
    ax.axvline(0, color="lightgrey", lw=0.6)
    colors = {"pre": "tab:orange", "post": "tab:blue"}
    for stage, color in colors.items():
        rows = (exact["stage"] == stage).to_numpy()
        ax.scatter(x[rows], y[rows], s=14, color=color, alpha=0.7, label=f"{stage}-compose sites")
    ax.set_xlim(-limit, limit)
    ax.set_ylim(-limit, limit)
    ax.set_xlabel("activation patching (exact)")
    ax.set_ylabel("attribution patching (first order)")
    ax.legend(fontsize=SMALLEST_TYPE, loc="upper left")
    rho = spearmanr(x, y).statistic
    heading = title or "attribution vs exact patching"
    ax.set_title(textwrap.fill(f"{heading}: {len(x)} rows, Spearman rho = {rho:.2f}", 50), fontsize=10)
    return fig


def plot_ablation_table(table, title: str | None = None) -> Figure:
    """Accuracy change against the full model (row 'none') when each part of the compose is switched off.

    One shared scale in percentage points. Columns: all samples, by QK pattern, by OV transformation; their labels
    give the full model's accuracy in brackets. Chance (a random candidate of the line) is about 35%.

    Args:
        table: `dcinterp.synth.ablate.ablation_table(...)`: columns ablated, accuracy, qk:* and ov:*, with a row
            whose ablated is 'none'.
        title: The title; default "compose switched off".

    Returns:
        The figure.
    """
    columns = ["accuracy", *[c for c in table.columns if c.startswith(("qk:", "ov:"))]]
    full = table[table["ablated"] == "none"].iloc[0]
    ablated = table[table["ablated"] != "none"]
    values = 100 * (ablated[columns].to_numpy(float) - full[columns].to_numpy(float)[None])
    limit = _patching_limit(values)
    width = min(PAGE_WIDTH, max(6.0, 2.5 + 0.55 * len(columns)))
    fig = Figure(figsize=(width, 2.4 + 0.3 * len(ablated)), layout="constrained")
    ax = fig.subplots()
    image = _centred_heatmap(ax, values, limit, fontsize=SMALLEST_TYPE, digits=0)
    labels = [f"{'all' if c == 'accuracy' else c[3:]}\n({100 * full[c]:.0f}%)" for c in columns]
    ax.set_xticks(range(len(columns)), labels, rotation=90, fontsize=SMALLEST_TYPE)
    ax.set_yticks(range(len(ablated)), list(ablated["ablated"]), fontsize=SMALLEST_TYPE)
    ax.axvline(0.5, color="black", lw=0.8)
    n_qk = sum(c.startswith("qk:") for c in columns)
    ax.axvline(0.5 + n_qk, color="black", lw=0.8)
    ax.set_ylabel("switched off (in every layer, or one layer's compose)")
    fig.colorbar(image, ax=ax, label="accuracy change (points)", shrink=0.8)
    ax.set_title(textwrap.fill(title or "compose switched off", 60), fontsize=10)
    return fig
