"""Figures of `dcinterp.attribution`: one integrated-gradients score per (layer, head), static and interactive."""

from __future__ import annotations

import textwrap

import numpy as np
import plotly.graph_objects as go
import torch
from matplotlib.colors import SymLogNorm
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ..attribution import HeadAttribution
from .style import (
    PAGE_WIDTH,
    SMALLEST_TYPE,
    annotate_cells,
    diverging_heatmap,
    diverging_heatmap_plotly,
    draw_caption,
    format_cell,
    head_ticks,
    symmetric_limit,
    to_numpy,
)


def _symlog_ticks(limit: float, linthresh: float) -> list[float]:
    """Round ticks for a symmetric-log scale over [-limit, limit]: 0, the powers of ten from the linear range's
    edge up, and the largest round value (1, 2 or 5 times a power of ten) within the limit."""
    powers = [10.0**k for k in range(int(np.floor(np.log10(linthresh))), int(np.floor(np.log10(limit))) + 1)]
    powers = [p for p in powers if linthresh <= p <= limit]
    top = 10.0 ** np.floor(np.log10(limit))
    top = float(max(m * top for m in (1, 2, 5) if m * top <= limit))
    powers = powers[-2:]
    if not powers or top >= 4 * powers[-1]:  # a log scale crowds two ticks closer than that
        powers.append(top)
    positive = sorted(set(powers))
    return [-v for v in reversed(positive)] + [0.0] + positive


def plot_head_attribution(
    scores: HeadAttribution | torch.Tensor,
    top_k: int = 3,
    title: str | None = None,
    label: str | None = None,
    color_scale: str = "symlog",
    caption: str | None = None,
) -> Figure:
    """Heatmap of one score per (layer, head), layer 0 at the top; the top_k heads boxed and named L{l}H{h}.

    Each score is how much the target changes along the path that switches every head on at once (the scores add
    up to the total effect); red raises the target, blue lowers it. The symmetric-log scale is linear within 1/50 of
    the largest |score|, so that one dominant head does not wash out the others, and has round ticks. Small grids
    carry their scores as numbers.

    Args:
        scores: A `HeadAttribution`, or a [layer, head] tensor of scores.
        top_k: How many of the largest scores to box, rank and name in the title.
        title: The title; default "Head attribution (integrated gradients)".
        label: The colour bar's label, with its unit; default, for a `HeadAttribution`, "attribution to the
            answer's logit (logit units)" (or its log p / p), else "attribution score".
        color_scale: "symlog", a symmetric-log diverging scale centred at zero, or "linear".
        caption: A line drawn under the figure.

    Returns:
        The figure.

    Raises:
        ValueError: `color_scale` is neither "symlog" nor "linear".
    """
    if label is None:
        target = scores.target_type if isinstance(scores, HeadAttribution) else None
        label = {
            "logit": "attribution to the answer's logit (logit units)",
            "logprob": "attribution to the answer's log p (nats)",
            "prob": "attribution to the answer's p (probability)",
        }.get(target, "attribution score")
    values = to_numpy(scores.scores if isinstance(scores, HeadAttribution) else scores)
    n_layers, n_heads = values.shape
    limit = symmetric_limit(values)
    if color_scale not in ("symlog", "linear"):
        raise ValueError(f"color_scale={color_scale!r}: expected 'symlog' or 'linear'")
    norm = SymLogNorm(linthresh=limit / 50, vmin=-limit, vmax=limit, base=10) if color_scale == "symlog" else None
    width = min(PAGE_WIDTH, max(5.5, 0.45 * n_heads + 3))
    fig = Figure(figsize=(width, max(3.8, 0.4 * n_layers + 2.4)), layout="constrained")
    ax = fig.subplots()
    image = diverging_heatmap(ax, values, limit, norm)
    ticks = _symlog_ticks(limit, limit / 50) if color_scale == "symlog" else None
    bar = fig.colorbar(
        image,
        ax=ax,
        ticks=ticks,
        format="%g",
        label=textwrap.fill(label, 36) + ("\n(symmetric-log scale)" if color_scale == "symlog" else ""),
    )
    bar.ax.minorticks_off()
    annotate_cells(
        ax,
        values,
        fontsize=SMALLEST_TYPE if n_heads <= 12 else 6,
        limit=limit * (0.1 if norm else 1),
        fmt=lambda v: format_cell(v) if abs(v) < 100 else f"{v:.0f}",
    )
    order = np.argsort(-values, axis=None)[:top_k]
    top = []
    for rank, flat in enumerate(order):
        layer, head = divmod(int(flat), n_heads)
        ax.add_patch(Rectangle((head - 0.5, layer - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=2))
        ax.text(head - 0.45, layer - 0.45, str(rank + 1), ha="left", va="top", fontsize=8, fontweight="bold")
        top.append(f"{rank + 1}: L{layer}H{head} ({format_cell(values[layer, head])})")
    head_ticks(ax, n_heads, "x")
    head_ticks(ax, n_layers, "y")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    heading = title or "Head attribution (integrated gradients)"
    lines = [", ".join(top[i : i + 3]) for i in range(0, len(top), 3)]
    ax.set_title("\n".join([*textwrap.wrap(heading, 60), *lines]), fontsize=10)
    draw_caption(fig, caption)
    return fig


def plot_head_attribution_plotly(
    scores: HeadAttribution | torch.Tensor, title: str | None = None, label: str = "IG score"
) -> go.Figure:
    """Interactive version of `plot_head_attribution`: hover shows layer, head and score.

    Args:
        scores: A `HeadAttribution`, or a [layer, head] tensor of scores.
        title: The title; default "Head attribution (integrated gradients)".
        label: The colour bar's title and the hover's name of the score.

    Returns:
        The plotly figure.
    """
    values = to_numpy(scores.scores if isinstance(scores, HeadAttribution) else scores)
    heatmap = diverging_heatmap_plotly(
        values,
        colorbar=dict(title=label),
        hovertemplate="L%{y}H%{x}<br>" + label + ": %{z:.4g}<extra></extra>",
    )
    fig = go.Figure(heatmap)
    fig.update_layout(
        title=title or "Head attribution (integrated gradients)",
        xaxis_title="head",
        yaxis_title="layer",
        yaxis_autorange="reversed",
    )
    return fig
