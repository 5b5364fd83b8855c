"""Figures of `dcinterp.composition`: composition maps (Fig. 1), a Compose stage broken down by branch (Fig. 7) and
the attention before and after composition along the sequence (Fig. 8)."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence

import numpy as np
import plotly.graph_objects as go
import torch
from matplotlib.figure import Figure

from ..composition import AttentionDistributions, ComposeBreakdown
from .style import (
    PAGE_WIDTH,
    SMALLEST_TYPE,
    annotate_cells,
    diverging_heatmap,
    diverging_heatmap_plotly,
    draw_caption,
    draw_title,
    head_ticks,
    symmetric_limit,
    to_numpy,
    token_label,
)


def _quote(token: str | None) -> str:
    return "" if token is None else repr(str(token))


def plot_composition_maps(
    maps: torch.Tensor | Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
    titles: Sequence[str] | None = None,
    head_labels: Sequence[str] | None = None,
    suptitle: str | None = None,
    ncols: int = 4,
    caption: str | None = None,
    label: str = "C[h, j]",
) -> Figure:
    """Fig. 1 style: one panel per H x H composition map, up to `ncols` panels a row.

    Each map W comes from `composition_map` (A' = A @ W) and is drawn as the paper's composition map C = W.T: row h is
    the composed head, column j the source head, A'_h = sum_j C[h, j] A_j. Red: head h takes on head j's attention,
    blue: it subtracts it. Diverging colours centred at zero with one scale for all panels; maps of up to 8 heads carry
    their numbers. A row holds fewer than `ncols` panels where it would be wider than `PAGE_WIDTH`. Pass maps without
    the identity (`include_identity=False`) to see the mixing, with `label="(C - I)[h, j]"`.

    Args:
        maps: One [head, head] map W, a sequence of them, or a mapping from panel title to map.
        titles: The panels' titles, where `maps` is not a mapping; default "map 0", "map 1", ...
        head_labels: A name per head for the ticks; default the heads' numbers.
        suptitle: The figure's title; default "Composition maps C (A'_h = sum_j C[h, j] A_j)".
        ncols: The most panels a row.
        caption: A line drawn under the figure.
        label: The colour bar's label.

    Returns:
        The figure.
    """
    if isinstance(maps, torch.Tensor) and maps.ndim == 2:
        maps = [maps]
    if isinstance(maps, Mapping):
        titles, maps = list(maps.keys()), list(maps.values())
    maps = [to_numpy(W).T for W in maps]
    titles = titles or [f"map {i}" for i in range(len(maps))]
    n_heads = maps[0].shape[0]
    size = min(3.4, 1.4 + 0.3 * n_heads)
    ncols = max(1, min(ncols, len(maps), int((PAGE_WIDTH - 1.4) // size)))
    nrows = -(-len(maps) // ncols)
    fig = Figure(figsize=(max(5.0, size * ncols + 1.4), size * nrows + 1.3), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    limit = symmetric_limit(*maps)
    for ax, C, title in zip(axes.flat, maps, titles, strict=False):
        image = diverging_heatmap(ax, C, limit)
        if n_heads <= 8:
            annotate_cells(ax, C, fontsize=SMALLEST_TYPE if n_heads <= 6 else 6, limit=limit)
        head_ticks(ax, n_heads, "x", head_labels)
        head_ticks(ax, n_heads, "y", head_labels)
        ax.set_xlabel("source head j")
        ax.set_ylabel("composed head h")
        ax.set_title(title, fontsize=10)
    for ax in axes.flat[len(maps) :]:
        ax.set_visible(False)
    fig.colorbar(image, ax=axes, shrink=0.8 if nrows > 1 else 0.9, label=label)
    draw_title(fig, suptitle or "Composition maps C (A'_h = sum_j C[h, j] A_j)")
    draw_caption(fig, caption)
    return fig


def plot_composition_map_plotly(W: torch.Tensor, title: str | None = None) -> go.Figure:
    """Interactive composition map C = W.T, diverging at zero; hover shows composed head, source head and weight.

    Args:
        W: One [head, head] map from `composition_map` (A' = A @ W); maps of up to 8 heads carry their numbers.
        title: The title; default "Composition map C".

    Returns:
        The plotly figure.
    """
    C = to_numpy(W).T
    heatmap = diverging_heatmap_plotly(
        C,
        zmid=0,
        colorbar=dict(title="C[h, j]"),
        texttemplate="%{z:.2f}" if C.shape[0] <= 8 else None,
        hovertemplate="composed head %{y} <- source head %{x}: %{z:.4g}<extra></extra>",
    )
    fig = go.Figure(heatmap)
    fig.update_layout(
        title=title or "Composition map C",
        xaxis_title="source head j",
        yaxis_title="composed head h",
        yaxis_autorange="reversed",
        xaxis_dtick=1,
        yaxis_dtick=1,
        width=620,
        height=560,
    )
    return fig


def _token_fontsize(n_tokens: int) -> float:
    """Type for one tick label per token along a `PAGE_WIDTH` axis: as large as the spacing allows."""
    return float(np.clip(PAGE_WIDTH * 72 / max(n_tokens, 1), 5, 10))


def plot_composition_along_sequence(
    values: Mapping[str, torch.Tensor | np.ndarray],
    str_tokens: Sequence[str] | None = None,
    query_pos: int | None = None,
    ylabel: str = "||W - I||_F",
    title: str | None = None,
    caption: str | None = None,
) -> Figure:
    """One line per entry of `values` (e.g. per layer): a value per key 0..query_pos.

    NaN where the key is out of reach (a local layer's window): the keys a layer can see are drawn, the others left
    blank. With the default `ylabel`, ||W - I||_F: how far the composition is from the identity (the root of the
    summed squares of the entries of W - I); 0 means every head keeps its own attention.

    Args:
        values: A [key] series per line, keyed by the line's legend label.
        str_tokens: The prompt's tokens, for the key ticks; default the positions.
        query_pos: The query's position, whose tick is drawn bold.
        ylabel: The y axis's label: what the values are.
        title: The title; default "How far the composition is from the identity, key by key".
        caption: A line drawn under the figure.

    Returns:
        The figure.
    """
    series = {name: to_numpy(v) for name, v in values.items()}
    n_keys = max(len(v) for v in series.values())
    labels = (
        [token_label(t) for t in str_tokens[:n_keys]] if str_tokens is not None else [str(i) for i in range(n_keys)]
    )
    fig = Figure(figsize=(PAGE_WIDTH, 4.6), layout="constrained")
    ax = fig.subplots()
    for i, (name, v) in enumerate(series.items()):
        ax.plot(np.arange(len(v)), v, marker="o", markersize=3, linewidth=1.4, color=f"C{i}", label=name)
    ax.set_xticks(range(n_keys), labels, rotation=90, fontsize=_token_fontsize(n_keys))
    if query_pos is not None and query_pos < n_keys:
        ax.get_xticklabels()[query_pos].set_fontweight("bold")
    ax.set_xlim(-0.5, n_keys - 0.5)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("key token")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(textwrap.fill(title or "How far the composition is from the identity, key by key", 70))
    draw_caption(fig, caption)
    return fig


def plot_compose_breakdown(
    breakdown: ComposeBreakdown,
    query_token: str | None = None,
    key_token: str | None = None,
    side: str = "k",
    title: str | None = None,
    caption: str | None = None,
) -> Figure:
    """Fig. 7 style: one attention entry through a Compose stage, branch by branch, two panels stacked.

    Top: each head's attention at this (query, key) before composition (A), what each branch adds (query-wise /
    key-wise projection O_qp / O_kp, gates O_qg / O_kg) and the sum A' (the columns add up exactly), one row per
    head, annotated. Bottom: the key's (or query's) low-rank dynamic weights, w_1 [head x rank], which gathers
    attention from the heads into rank components, and w_2 [rank x head], which shares it out again, as in the paper,
    and what w_1 gathers from A. Three diverging scales centred at zero, each with its colour bar: attention, dynamic
    weights, gathered attention. Heads are named L{layer}H{head} in every panel.

    Args:
        breakdown: The `ComposeBreakdown` of one (layer, stage, query, key).
        query_token: The query's token, for the title; default its position.
        key_token: The key's token, for the title; default its position.
        side: "k" for the key-wise weights w_k1, w_k2; "q" for the query-wise w_q1, w_q2.
        title: The title; default the layer, stage, tokens and positions.
        caption: A line drawn under the figure.

    Returns:
        The figure.
    """
    b = breakdown
    n_heads = len(b.before)
    heads = [f"L{b.layer}H{h}" for h in range(n_heads)]
    columns = np.stack([to_numpy(v) for v in (b.before, b.o_qp, b.o_qg, b.o_kp, b.o_kg, b.composed)], axis=1)
    w1, w2 = to_numpy(getattr(b, f"w_{side}1")), to_numpy(getattr(b, f"w_{side}2")).T  # [head, rank], [rank, head]
    gathered = to_numpy(b.before)[None] @ w1  # [1, rank]: what w_{side}1 gathers from all heads
    rank = w1.shape[1]
    annotate = n_heads <= 16
    cell = 0.36 if annotate else 0.18
    fig = Figure(figsize=(PAGE_WIDTH, cell * (2 * n_heads + rank + 1) + 4.2), layout="constrained")
    top, bottom = fig.subfigures(2, 1, height_ratios=[cell * n_heads + 1.7, cell * (n_heads + 1) + 2.5])

    ax = top.subplots()
    what = "attention weight" if b.stage == "post" else "attention score"
    image = diverging_heatmap(ax, columns)
    top.colorbar(image, ax=ax, label=what)
    ax.set_xticks(range(6), ["A", "+ O_qp", "+ O_qg", "+ O_kp", "+ O_kg", "= A'"])
    head_ticks(ax, n_heads, "y", heads)
    ax.set_xlabel("before composition, what each branch adds, composed")
    ax.set_ylabel("head")
    ax.set_title(f"{what} at this pair, branch by branch", fontsize=10)
    if annotate:
        annotate_cells(ax, columns)

    weight_axes = bottom.subplots(
        2, 2, gridspec_kw=dict(width_ratios=[rank + 1.5, n_heads], height_ratios=[n_heads, 1])
    )
    ax1, ax2, ax3 = weight_axes[0, 0], weight_axes[0, 1], weight_axes[1, 0]
    weight_axes[1, 1].set_visible(False)
    weight_limit = symmetric_limit(w1, w2)
    image = diverging_heatmap(ax1, w1, weight_limit)
    ax1.set_xticks(range(rank), [str(r) for r in range(rank)])
    head_ticks(ax1, n_heads, "y", heads)
    ax1.set_xlabel("rank r")
    ax1.set_ylabel("head")
    ax1.set_title(f"w_{side}1 (head x rank)", fontsize=10)
    diverging_heatmap(ax2, w2, weight_limit)
    ax2.set_yticks(range(rank), [str(r) for r in range(rank)])
    head_ticks(ax2, n_heads, "x", heads)
    ax2.set_ylabel("rank r")
    ax2.set_title(f"w_{side}2 (rank x head)", fontsize=10)
    bottom.colorbar(image, ax=[ax1, ax2], label=f"dynamic weight\nw_{side}1, w_{side}2")
    ax1.set_xlabel("")
    gathered_image = diverging_heatmap(ax3, gathered)
    ax3.set_xticks(range(rank), [str(r) for r in range(rank)])
    ax3.set_yticks([])
    ax3.set_xlabel("rank r")
    ax3.set_title(f"A @ w_{side}1 (gathered)", fontsize=10)
    bottom.colorbar(gathered_image, ax=ax3, location="right", label="gathered\nattention")
    if annotate:
        annotate_cells(ax1, w1, limit=weight_limit)
        annotate_cells(ax2, w2, limit=weight_limit)
        annotate_cells(ax3, gathered)
    pair = f"{_quote(query_token) or f'pos {b.query_pos}'} -> {_quote(key_token) or f'pos {b.key_pos}'}"
    draw_title(
        fig,
        title or f"Layer {b.layer} {b.stage}-compose of the attention {pair} (positions {b.query_pos}, {b.key_pos})",
    )
    draw_caption(fig, caption)
    return fig


def plot_attention_distributions(
    dist: AttentionDistributions,
    str_tokens: Sequence[str] | None = None,
    w_k1_heads: Sequence[int] | None = None,
    rank_index: int = 0,
    title: str | None = None,
    highlight: Sequence[int] = (),
    caption: str | None = None,
) -> Figure:
    """Fig. 8 style: a head's attention over the keys before and after composition, with w_k1 along the keys.

    Top, w_k1[key, head, rank_index] along the keys; below, one panel per chosen head with its attention over the
    keys before composition (grey: the head's own softmax, or pre-compose its scores) and after (blue: composition
    adds signed mixtures of the other heads' attention, so that post-compose A' is no longer a distribution), all on
    one scale.

    Args:
        dist: The `AttentionDistributions` of one layer, stage and query.
        str_tokens: The prompt's tokens, for the key ticks; default the positions.
        w_k1_heads: The heads whose w_k1 is drawn; default the chosen heads.
        rank_index: The rank component of w_k1 drawn.
        title: The title; default the layer and the query.
        highlight: Key positions whose labels are drawn bold and red (e.g. the key studied).
        caption: A line drawn under the figure.

    Returns:
        The figure.
    """
    n_keys = dist.before.shape[1]
    labels = (
        [token_label(t) for t in str_tokens[:n_keys]] if str_tokens is not None else [str(i) for i in range(n_keys)]
    )
    has_w = dist.w_k1 is not None
    n_rows = len(dist.heads) + has_w
    fig = Figure(figsize=(PAGE_WIDTH, 1.8 * n_rows + 1.8), layout="constrained")
    axes = fig.subplots(n_rows, 1, sharex=True, squeeze=False)[:, 0]
    x = np.arange(n_keys)
    if has_w:
        ax = axes[0]
        for head in w_k1_heads if w_k1_heads is not None else dist.heads:
            ax.plot(
                x,
                to_numpy(dist.w_k1[:, head, rank_index]),
                marker="o",
                markersize=3,
                linewidth=1,
                label=f"w_k1 of L{dist.layer}H{head}",
            )
        ax.axhline(0, color="grey", linewidth=0.6)
        ax.set_ylabel(f"w_k1[key, h, {rank_index}]")
        ax.set_title(
            f"{dist.stage}-compose key-wise weight w_k1 (rank component {rank_index}) at each key",
            fontsize=10,
            loc="left",
        )
        ax.legend(fontsize=SMALLEST_TYPE, ncol=4, loc="best", framealpha=0.9)
    what = "attention weight" if dist.stage == "post" else "attention score"
    limit = symmetric_limit(to_numpy(dist.before), to_numpy(dist.after))
    low = min(0.0, float(np.nanmin(to_numpy(dist.before))), float(np.nanmin(to_numpy(dist.after))))
    for ax, i, head in zip(axes[has_w:], range(len(dist.heads)), dist.heads, strict=True):
        ax.bar(x - 0.2, to_numpy(dist.before[i]), width=0.4, color="0.6", label="before composition (A)")
        ax.bar(x + 0.2, to_numpy(dist.after[i]), width=0.4, color="tab:blue", label="after composition (A')")
        ax.axhline(0, color="black", linewidth=0.6)
        ax.set_ylim(low * 1.08, limit * 1.08)
        ax.set_ylabel(what)
        ax.set_title(f"L{dist.layer}H{head}", fontsize=10, loc="left")
        ax.grid(alpha=0.3, axis="y")
    handles, names = axes[-1].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside lower center", ncol=2, fontsize=9)
    axes[-1].set_xticks(x, labels, rotation=90, fontsize=_token_fontsize(n_keys))
    for position in highlight:
        if 0 <= position < n_keys:
            axes[-1].get_xticklabels()[position].set(color="tab:red", fontweight="bold")
    axes[-1].set_xlabel("key token")
    query = labels[dist.query_pos] if dist.query_pos < len(labels) else str(dist.query_pos)
    draw_title(fig, title or f"Layer {dist.layer}: attention from query {query!r} (pos {dist.query_pos})")
    draw_caption(fig, caption)
    return fig
