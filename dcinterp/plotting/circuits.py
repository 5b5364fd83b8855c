"""Figures of `dcinterp.circuits`: head diversity, the cumulative captured variance of QK and OV circuits (Fig. 5),
and the same in numbers for the page beside the figure."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping

import numpy as np
from matplotlib.figure import Figure

from ..circuits import HeadDiversity
from .style import PAGE_WIDTH, draw_caption, draw_title, to_numpy


def plot_head_diversity(
    results: HeadDiversity | Mapping[str, HeadDiversity],
    per_layer: bool = False,
    title: str | None = None,
    caption: str | None = None,
) -> Figure:
    """Fig. 5: mean cumulative captured variance of concatenated QK (left) and OV (right) circuits.

    Against the number of principal components, one line per model. With two or more models a second row shows the
    first model's curves minus each other's (below zero: the first model's heads are more diverse), per layer (thin)
    and their mean (thick). `diversity_verdict(results)` says what the curves show in numbers, for the page beside
    the figure.

    Args:
        results: One `HeadDiversity`, or one per model keyed by the model's name (the first is the one compared).
        per_layer: Whether to draw each layer's curve as a thin line too.
        title: The title; default "Head diversity: concatenated per-layer circuits (lower = more diverse heads)".
        caption: A line drawn under the figure.

    Returns:
        The figure.
    """
    results = {"model": results} if isinstance(results, HeadDiversity) else dict(results)
    names = list(results)
    compare = len(results) > 1
    fig = Figure(figsize=(PAGE_WIDTH, 8.4 if compare else 4.4), layout="constrained")
    axes = fig.subplots(2 if compare else 1, 2, squeeze=False, sharex=True)
    styles = ["-", "--", ":", "-."]
    for col, circuit in enumerate(("qk", "ov")):
        ax = axes[0, col]
        for i, (name, result) in enumerate(results.items()):
            curves = to_numpy(getattr(result, circuit))
            k = np.arange(1, curves.shape[1] + 1)
            if per_layer:
                for curve in curves:
                    ax.plot(k, curve, color=f"C{i}", linewidth=0.6, alpha=0.35, linestyle=styles[i % 4])
            ax.plot(
                k,
                curves.mean(0),
                color=f"C{i}",
                linewidth=2.2,
                linestyle=styles[i % 4],
                label=f"{name}: area {curves.mean():.3f}",
            )
        ax.plot([0, k[-1]], [0, 1], color="grey", linestyle=":", linewidth=1, label="all components equal")
        ax.set_title("QK circuits (W_Q W_K^T)" if circuit == "qk" else "OV circuits (W_V W_O)", fontsize=10)
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(alpha=0.3)
        ax.set_ylabel("cumulative captured variance")
        if compare:
            ax = axes[1, col]
            first = to_numpy(getattr(results[names[0]], circuit))
            for i, name in enumerate(names[1:], start=1):
                other = to_numpy(getattr(results[name], circuit))
                if other.shape[1] != first.shape[1]:  # another d_model: the components do not pair up
                    continue
                if other.shape == first.shape:  # the same depth: layer by layer
                    for curve in first - other:
                        ax.plot(k, curve, color=f"C{i}", linewidth=0.6, alpha=0.4)
                ax.plot(
                    k,
                    first.mean(0) - other.mean(0),
                    color=f"C{i}",
                    linewidth=2.2,
                    linestyle=styles[i % 4],
                    label=textwrap.fill(f"minus {name}: mean over layers (thin: each layer)", 32),
                )
            ax.axhline(0, color="black", linewidth=0.8)
            ax.set_title(
                textwrap.fill(f"{names[0]} minus the other model{'s' if len(names) > 2 else ''}", 40), fontsize=10
            )
            ax.set_ylabel(f"difference (below 0: {names[0].split(' ')[0]}\nmore diverse)")
            ax.legend(fontsize=8, loc="upper right")
            ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("number of principal components k")
    draw_title(fig, title or "Head diversity: concatenated per-layer circuits (lower = more diverse heads)")
    draw_caption(fig, caption)
    return fig


def diversity_verdict(results: Mapping[str, HeadDiversity]) -> str:
    """What the head-diversity curves say, in numbers.

    Each model's area under its mean curve per circuit, and, with two or more models, in how many layers the second
    is lower than the first, which is the paper's Fig. 5 finding for DCFormer against Transformer.

    Args:
        results: A `HeadDiversity` per model, keyed by the model's name.

    Returns:
        A few sentences for the page beside the figure.
    """
    names = list(results)
    areas = "; ".join(
        f"{name}: QK {to_numpy(r.qk).mean():.3f}, OV {to_numpy(r.ov).mean():.3f}" for name, r in results.items()
    )
    text = f"Area under the mean curve (lower = more diverse) {areas}."
    if len(names) > 1:
        first, second = results[names[0]], results[names[1]]
        for circuit in ("qk", "ov"):
            a, b = to_numpy(getattr(first, circuit)), to_numpy(getattr(second, circuit))
            text += f" {circuit.upper()}: {names[0]} minus {names[1]} {a.mean() - b.mean():+.3f}"
            if a.shape == b.shape:
                text += f", lower in {int((a.mean(1) < b.mean(1)).sum())} of {len(a)} layers"
            text += "."
        text += " The paper (Fig. 5) finds DCFormer's heads more diverse, markedly for QK."
    return text
