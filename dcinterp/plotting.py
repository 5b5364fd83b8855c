"""Figures for the results of `attribution`, `composition`, `circuits`, the synthetic evaluation and the study.

Every function takes results (tensors, dataclasses, DataFrames), never a model, and returns a figure
(`matplotlib.figure.Figure`, or `plotly.graph_objects.Figure` for the `*_plotly` ones); nothing is shown.
Figures are built without pyplot (no global state, no open windows): `fig.savefig(path)`, or in a notebook with
the inline backend (`%matplotlib inline`) end a cell with `fig`; a plotly figure becomes a page that opens offline
with `write_plotly_page(fig, path)`.
Token labels are optional everywhere (`str_tokens`, `query_token`, ...): pass `model.to_str_tokens(prompt)`.

Conventions: signed values use a diverging colormap centred at zero, with one scale shared by every panel of a
figure that shows the same quantity and a colour bar per quantity, labelled with it; small heatmaps carry their
numbers, in one format per figure. Figures are at most `PAGE_WIDTH` inches wide with type of at least
`SMALLEST_TYPE` points, so that they stay legible shrunk into a docs page's 690-px column; a wider layout
stacks its panels. Captions belong to the page (or the notebook's markdown), not the image: each docstring says
what its figure shows, and `caption=` draws a line under the figure where one is wanted.

    plot_head_attribution            layer x head heatmap of IG scores, top heads marked
    plot_composition_maps            H x H composition maps C = W^T (Fig. 1 style), wrapped into a grid
    plot_composition_along_sequence  how far the composition map is from the identity, key by key
    plot_compose_breakdown           one attention vector through a Compose stage (Fig. 7 style)
    plot_attention_distributions     attention before/after composition and w_k1 along the sequence (Fig. 8)
    plot_qk_attribution              why a head attends to a key: component pairs, source head x branch, checks
    plot_qk_keys_plotly              the same for every key of a query, interactive
    plot_head_diversity              cumulative captured variance of QK / OV circuits, models compared (Fig. 5)
    plot_synthetic_eval              synthetic-task accuracy with intervals and chance (Table 5, Fig. 6)
    plot_study_differences           the paired study: DCMHA - MHA per QK pattern / OV transformation, per seed
    plot_study_held_out              the paired study: each seed's twins on the held-out combinations
    plot_study_head_diversity        the paired study: Fig. 5's curves of every run, per architecture
    plot_study_learning_curves       the paired study: probe accuracy against the step, the shared start marked
"""

from __future__ import annotations

import html
import re
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
import torch
from matplotlib import colormaps
from matplotlib.colors import SymLogNorm
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from .attribution import HeadAttribution
from .circuits import HeadDiversity
from .composition import AttentionDistributions, ComposeBreakdown

DIVERGING = "RdBu_r"
SEQUENTIAL = "viridis"  # for values in [0, 1] (accuracies)
MAX_ANNOTATED_CELLS = 200  # heatmaps with more cells than this are not annotated
# A figure W inches wide shown in a 690-px column is scaled by 690 / (W dpi), so f-point type is 9.6 f / W px
# there, whatever the dpi: 7.5 inches and 8-point type give 10 px.
PAGE_WIDTH = 7.5
SMALLEST_TYPE = 8


def _np(x) -> np.ndarray:
    return x.detach().float().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=float)


def _symmetric_limit(*arrays: np.ndarray) -> float:
    """The largest |value| over all arrays (1 if they are all zero): the shared limit of a diverging scale."""
    values = np.concatenate([np.ravel(a) for a in arrays]) if arrays else np.zeros(0)
    limit = float(np.nanmax(np.abs(values))) if values.size and not np.all(np.isnan(values)) else 1.0
    return limit if limit > 0 else 1.0


def _diverging(ax, values: np.ndarray, limit: float | None = None, norm=None):
    """A heatmap centred on zero (blue negative, red positive); returns the image for a colorbar."""
    if norm is not None:
        return ax.imshow(values, cmap=DIVERGING, norm=norm, aspect="auto")
    limit = limit or _symmetric_limit(values)
    return ax.imshow(values, cmap=DIVERGING, vmin=-limit, vmax=limit, aspect="auto")


def _head_ticks(ax, n: int, axis: str, labels: Sequence[str] | None = None, max_ticks: int = 40) -> None:
    step = max(1, int(np.ceil(n / max_ticks)))
    ticks = list(range(0, n, step))
    names = [labels[i] for i in ticks] if labels is not None else [str(i) for i in ticks]
    if axis == "x":
        ax.set_xticks(ticks, names, rotation=90 if labels is not None else 0)
    else:
        ax.set_yticks(ticks, names)


def _fmt(value: float) -> str:
    """Two decimals, one format for every cell (a value that rounds to zero is written 0.00, never -0.00)."""
    return f"{value + 0.0:.2f}" if round(value, 2) != 0 else "0.00"


def _annotate(ax, values: np.ndarray, fontsize: float = SMALLEST_TYPE, limit: float | None = None, fmt=_fmt) -> None:
    """Write each cell's value on a heatmap drawn by `_diverging`, in white on the dark cells."""
    if values.size > MAX_ANNOTATED_CELLS:
        return
    limit = limit or _symmetric_limit(values)
    for (row, col), value in np.ndenumerate(values):
        if not np.isnan(value):
            ax.text(
                col,
                row,
                fmt(value),
                ha="center",
                va="center",
                fontsize=fontsize,
                color="white" if abs(value) > 0.6 * limit else "black",
            )


def _quote(token: str | None) -> str:
    return "" if token is None else repr(str(token))


def token_label(token: str) -> str:
    """A token as a tick label: line breaks and tabs written out, leading/trailing spaces shown as '·'."""
    text = str(token).replace("\n", "\\n").replace("\t", "\\t")
    stripped = text.strip(" ")
    left, right = len(text) - len(text.lstrip(" ")), len(text) - len(text.rstrip(" "))
    return "·" * left + stripped + "·" * right if stripped else "·" * len(text)


def _caption(fig: Figure, text: str | None) -> None:
    """The caller's caption as a line under the figure (wrapped to its width), laid out by the constrained layout;
    none without one (a page says what its figure shows)."""
    if text:
        width = max(50, int(fig.get_figwidth() * 12))
        fig.supxlabel(textwrap.fill(text, width), fontsize=9, color="0.2", x=0.01, ha="left")


def _title(fig, text: str, fontsize: float = 11) -> None:
    """A figure title wrapped to the figure's width."""
    width = max(40, int(fig.get_figwidth() * 72 / (0.55 * fontsize)))
    fig.suptitle(textwrap.fill(text, width), fontsize=fontsize)


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


# --------------------------------------------------------------------------------------------------
# Attribution
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
    up to the total effect); red raises the target, blue lowers it. `label` names the colour bar with its unit
    (default, for a `HeadAttribution`: "attribution to the answer's logit (logit units)", or its log p / p).
    `color_scale="symlog"` (default): a symmetric-log diverging scale centred at zero, linear within 1/50 of the
    largest |score|, so that one dominant head does not wash out the others, with round ticks; "linear" for a
    plain one. Small grids carry their scores as numbers.
    """
    if label is None:
        target = scores.target_type if isinstance(scores, HeadAttribution) else None
        label = {
            "logit": "attribution to the answer's logit (logit units)",
            "logprob": "attribution to the answer's log p (nats)",
            "prob": "attribution to the answer's p (probability)",
        }.get(target, "attribution score")
    values = _np(scores.scores if isinstance(scores, HeadAttribution) else scores)
    n_layers, n_heads = values.shape
    limit = _symmetric_limit(values)
    if color_scale not in ("symlog", "linear"):
        raise ValueError(f"color_scale={color_scale!r}: expected 'symlog' or 'linear'")
    norm = SymLogNorm(linthresh=limit / 50, vmin=-limit, vmax=limit, base=10) if color_scale == "symlog" else None
    width = min(PAGE_WIDTH, max(5.5, 0.45 * n_heads + 3))
    fig = Figure(figsize=(width, max(3.8, 0.4 * n_layers + 2.4)), layout="constrained")
    ax = fig.subplots()
    image = _diverging(ax, values, limit, norm)
    ticks = _symlog_ticks(limit, limit / 50) if color_scale == "symlog" else None
    bar = fig.colorbar(
        image,
        ax=ax,
        ticks=ticks,
        format="%g",
        label=textwrap.fill(label, 36) + ("\n(symmetric-log scale)" if color_scale == "symlog" else ""),
    )
    bar.ax.minorticks_off()
    _annotate(
        ax,
        values,
        fontsize=SMALLEST_TYPE if n_heads <= 12 else 6,
        limit=limit * (0.1 if norm else 1),
        fmt=lambda v: _fmt(v) if abs(v) < 100 else f"{v:.0f}",
    )
    order = np.argsort(-values, axis=None)[:top_k]
    top = []
    for rank, flat in enumerate(order):
        layer, head = divmod(int(flat), n_heads)
        ax.add_patch(Rectangle((head - 0.5, layer - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=2))
        ax.text(head - 0.45, layer - 0.45, str(rank + 1), ha="left", va="top", fontsize=8, fontweight="bold")
        top.append(f"{rank + 1}: L{layer}H{head} ({_fmt(values[layer, head])})")
    _head_ticks(ax, n_heads, "x")
    _head_ticks(ax, n_layers, "y")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    heading = title or "Head attribution (integrated gradients)"
    lines = [", ".join(top[i : i + 3]) for i in range(0, len(top), 3)]
    ax.set_title("\n".join([*textwrap.wrap(heading, 60), *lines]), fontsize=10)
    _caption(fig, caption)
    return fig


def write_plotly_page(fig: go.Figure, path: str | Path, title: str | None = None) -> Path:
    """Write a plotly figure as a self-contained HTML page and return its path.

    plotly.js is inlined, so the page opens offline; its `<title>` (what a browser tab and a bookmark show) is
    `title`, or else the figure's own title, or else the file's name. plotly's `write_html` leaves it empty."""
    path = Path(path)
    title = title or fig.layout.title.text or path.stem
    page = fig.to_html(include_plotlyjs=True, full_html=True, div_id=path.stem)  # no random id: reruns are identical
    page, found = re.subn("</head>", lambda m: f"<title>{html.escape(title)}</title>\n</head>", page, count=1)
    if not found:  # never silent: a plotly whose page has no head would otherwise write a page without a title
        raise ValueError("fig: plotly's page has no </head> to put the title before")
    path.write_text(page, encoding="utf-8")
    return path


def plot_head_attribution_plotly(
    scores: HeadAttribution | torch.Tensor, title: str | None = None, label: str = "IG score"
) -> go.Figure:
    """Interactive version of `plot_head_attribution`: hover shows layer, head and score."""
    values = _np(scores.scores if isinstance(scores, HeadAttribution) else scores)
    limit = _symmetric_limit(values)
    heatmap = go.Heatmap(
        z=values,
        colorscale="RdBu",
        reversescale=True,
        zmin=-limit,
        zmax=limit,
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


# --------------------------------------------------------------------------------------------------
# Composition
def plot_composition_maps(
    maps: torch.Tensor | Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
    titles: Sequence[str] | None = None,
    head_labels: Sequence[str] | None = None,
    suptitle: str | None = None,
    ncols: int = 4,
    caption: str | None = None,
    label: str = "C[h, j]",
) -> Figure:
    """Fig. 1 style: one panel per H x H map W (from `composition_map`, A' = A @ W), up to `ncols` panels a row
    (fewer where the row would be wider than `PAGE_WIDTH`).

    Drawn as the paper's composition map C = W.T: row h is the composed head, column j the source head,
    A'_h = sum_j C[h, j] A_j. Red: head h takes on head j's attention, blue: it subtracts it. Diverging colours
    centred at zero with one scale for all panels, its colour bar labelled `label`; maps of up to 8 heads carry
    their numbers. Pass maps without the identity (`include_identity=False`) to see the mixing, with
    `label="(C - I)[h, j]"`.
    """
    if isinstance(maps, torch.Tensor) and maps.ndim == 2:
        maps = [maps]
    if isinstance(maps, Mapping):
        titles, maps = list(maps.keys()), list(maps.values())
    maps = [_np(W).T for W in maps]
    titles = titles or [f"map {i}" for i in range(len(maps))]
    n_heads = maps[0].shape[0]
    size = min(3.4, 1.4 + 0.3 * n_heads)
    ncols = max(1, min(ncols, len(maps), int((PAGE_WIDTH - 1.4) // size)))
    nrows = -(-len(maps) // ncols)
    fig = Figure(figsize=(max(5.0, size * ncols + 1.4), size * nrows + 1.3), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    limit = _symmetric_limit(*maps)
    for ax, C, title in zip(axes.flat, maps, titles, strict=False):
        image = _diverging(ax, C, limit)
        if n_heads <= 8:
            _annotate(ax, C, fontsize=SMALLEST_TYPE if n_heads <= 6 else 6, limit=limit)
        _head_ticks(ax, n_heads, "x", head_labels)
        _head_ticks(ax, n_heads, "y", head_labels)
        ax.set_xlabel("source head j")
        ax.set_ylabel("composed head h")
        ax.set_title(title, fontsize=10)
    for ax in axes.flat[len(maps) :]:
        ax.set_visible(False)
    fig.colorbar(image, ax=axes, shrink=0.8 if nrows > 1 else 0.9, label=label)
    _title(fig, suptitle or "Composition maps C (A'_h = sum_j C[h, j] A_j)")
    _caption(fig, caption)
    return fig


def plot_composition_map_plotly(W: torch.Tensor, title: str | None = None) -> go.Figure:
    """Interactive composition map C = W.T (hover: composed head, source head, weight), diverging at zero."""
    C = _np(W).T
    limit = _symmetric_limit(C)
    heatmap = go.Heatmap(
        z=C,
        colorscale="RdBu",
        reversescale=True,
        zmin=-limit,
        zmax=limit,
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
    """One line per entry of `values` (e.g. per layer): a value per key 0..query_pos, NaN where the key is out of
    reach (a local layer's window); the keys a layer can see are drawn, the others left blank. With the default
    `ylabel`, ||W - I||_F: how far the composition is from the identity (the root of the summed squares of the
    entries of W - I); 0 means every head keeps its own attention."""
    series = {name: _np(v) for name, v in values.items()}
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
    _caption(fig, caption)
    return fig


def plot_compose_breakdown(
    breakdown: ComposeBreakdown,
    query_token: str | None = None,
    key_token: str | None = None,
    side: str = "k",
    title: str | None = None,
    caption: str | None = None,
) -> Figure:
    """Fig. 7 style, two panels stacked. Top: each head's attention at this (query, key) before composition (A),
    what each branch adds (query-wise / key-wise projection O_qp / O_kp, gates O_qg / O_kg) and the sum A' (the
    columns add up exactly), one row per head, annotated. Bottom: the key's low-rank dynamic weights of one side
    (`side="k"`: w_k1 [head x rank], which gathers attention from the heads into rank components, and w_k2
    [rank x head], which shares it out again, as in the paper; "q" for w_q1, w_q2), and what w_k1 gathers from A.
    Three diverging scales centred at zero, each with its colour bar: attention, dynamic weights, gathered
    attention. Heads are named L{layer}H{head} in every panel.
    """
    b = breakdown
    n_heads = len(b.before)
    heads = [f"L{b.layer}H{h}" for h in range(n_heads)]
    columns = np.stack([_np(v) for v in (b.before, b.o_qp, b.o_qg, b.o_kp, b.o_kg, b.composed)], axis=1)
    w1, w2 = _np(getattr(b, f"w_{side}1")), _np(getattr(b, f"w_{side}2")).T  # [head, rank], [rank, head]
    gathered = _np(b.before)[None] @ w1  # [1, rank]: what w_{side}1 gathers from all heads
    rank = w1.shape[1]
    annotate = n_heads <= 16
    cell = 0.36 if annotate else 0.18
    fig = Figure(figsize=(PAGE_WIDTH, cell * (2 * n_heads + rank + 1) + 4.2), layout="constrained")
    top, bottom = fig.subfigures(2, 1, height_ratios=[cell * n_heads + 1.7, cell * (n_heads + 1) + 2.5])

    ax = top.subplots()
    what = "attention weight" if b.stage == "post" else "attention score"
    image = _diverging(ax, columns)
    top.colorbar(image, ax=ax, label=what)
    ax.set_xticks(range(6), ["A", "+ O_qp", "+ O_qg", "+ O_kp", "+ O_kg", "= A'"])
    _head_ticks(ax, n_heads, "y", heads)
    ax.set_xlabel("before composition, what each branch adds, composed")
    ax.set_ylabel("head")
    ax.set_title(f"{what} at this pair, branch by branch", fontsize=10)
    if annotate:
        _annotate(ax, columns)

    weight_axes = bottom.subplots(
        2, 2, gridspec_kw=dict(width_ratios=[rank + 1.5, n_heads], height_ratios=[n_heads, 1])
    )
    ax1, ax2, ax3 = weight_axes[0, 0], weight_axes[0, 1], weight_axes[1, 0]
    weight_axes[1, 1].set_visible(False)
    weight_limit = _symmetric_limit(w1, w2)
    image = _diverging(ax1, w1, weight_limit)
    ax1.set_xticks(range(rank), [str(r) for r in range(rank)])
    _head_ticks(ax1, n_heads, "y", heads)
    ax1.set_xlabel("rank r")
    ax1.set_ylabel("head")
    ax1.set_title(f"w_{side}1 (head x rank)", fontsize=10)
    _diverging(ax2, w2, weight_limit)
    ax2.set_yticks(range(rank), [str(r) for r in range(rank)])
    _head_ticks(ax2, n_heads, "x", heads)
    ax2.set_ylabel("rank r")
    ax2.set_title(f"w_{side}2 (rank x head)", fontsize=10)
    bottom.colorbar(image, ax=[ax1, ax2], label=f"dynamic weight\nw_{side}1, w_{side}2")
    ax1.set_xlabel("")
    gathered_image = _diverging(ax3, gathered)
    ax3.set_xticks(range(rank), [str(r) for r in range(rank)])
    ax3.set_yticks([])
    ax3.set_xlabel("rank r")
    ax3.set_title(f"A @ w_{side}1 (gathered)", fontsize=10)
    bottom.colorbar(gathered_image, ax=ax3, location="right", label="gathered\nattention")
    if annotate:
        _annotate(ax1, w1, limit=weight_limit)
        _annotate(ax2, w2, limit=weight_limit)
        _annotate(ax3, gathered)
    pair = f"{_quote(query_token) or f'pos {b.query_pos}'} -> {_quote(key_token) or f'pos {b.key_pos}'}"
    _title(
        fig,
        title or f"Layer {b.layer} {b.stage}-compose of the attention {pair} (positions {b.query_pos}, {b.key_pos})",
    )
    _caption(fig, caption)
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
    """Fig. 8 style: top, w_k1[key, head, rank_index] along the keys for `w_k1_heads` (default: the chosen
    heads); below, one panel per chosen head with its attention over the keys before and after composition,
    all on one scale. `highlight`: key positions whose labels are drawn bold and red (e.g. the key studied).
    Grey: the head's own attention (softmax; pre-compose: its scores); blue: after composition, which adds signed
    mixtures of the other heads' attention, so that post-compose A' is no longer a distribution.
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
                _np(dist.w_k1[:, head, rank_index]),
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
    limit = _symmetric_limit(_np(dist.before), _np(dist.after))
    low = min(0.0, float(np.nanmin(_np(dist.before))), float(np.nanmin(_np(dist.after))))
    for ax, i, head in zip(axes[has_w:], range(len(dist.heads)), dist.heads, strict=True):
        ax.bar(x - 0.2, _np(dist.before[i]), width=0.4, color="0.6", label="before composition (A)")
        ax.bar(x + 0.2, _np(dist.after[i]), width=0.4, color="tab:blue", label="after composition (A')")
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
    _title(fig, title or f"Layer {dist.layer}: attention from query {query!r} (pos {dist.query_pos})")
    _caption(fig, caption)
    return fig


# --------------------------------------------------------------------------------------------------
# QK attribution (dcinterp.qk)
def _top_pairs(pairs, top: int, rows=None, cols=None) -> tuple[np.ndarray, list[str], list[str]]:
    """The top rows and columns (by sum of |values|) of a [query x key component] table, or the given ones in their
    order, with an 'others' row and column holding the rest where some are left out, so that the cells still add up
    to the total."""
    values = pairs.to_numpy(dtype=float)
    index, columns = [str(i) for i in pairs.index], [str(j) for j in pairs.columns]
    if rows is None:
        rows = [index[i] for i in np.argsort(-np.abs(values).sum(1), kind="stable")[:top]]
    if cols is None:
        cols = [columns[j] for j in np.argsort(-np.abs(values).sum(0), kind="stable")[:top]]
    rows = [index.index(r) for r in rows if r in index]
    cols = [columns.index(c) for c in cols if c in columns]
    other_rows = [i for i in range(values.shape[0]) if i not in rows]
    other_cols = [j for j in range(values.shape[1]) if j not in cols]
    shown = values[np.ix_(rows, cols)]
    row_names, col_names = [index[i] for i in rows], [columns[j] for j in cols]
    if other_cols:
        shown = np.hstack([shown, values[np.ix_(rows, other_cols)].sum(1, keepdims=True)])
        col_names.append("others")
    if other_rows:
        last = values[np.ix_(other_rows, cols)].sum(0)
        if other_cols:
            last = np.append(last, values[np.ix_(other_rows, other_cols)].sum())
        shown = np.vstack([shown, last])
        row_names.append("others")
    return shown, row_names, col_names


def _composes(head_branch) -> bool:
    """Whether a source head x branch table comes from DCMHA: some head other than the explained one, or some
    branch other than its own score, contributes (plain MHA's table is the head's own score alone)."""
    nonzero = head_branch.loc[(head_branch != 0).any(axis=1), (head_branch != 0).any(axis=0)]
    return nonzero.shape[0] > 1 or nonzero.shape[1] > 1


def plot_qk_attribution(
    pairs,
    head_branch,
    components=None,
    checks=None,
    layer: int | None = None,
    top: int = 12,
    title: str | None = None,
    caption: str | None = None,
    contrast: Mapping | None = None,
    label: str = "the score",
    head_branch_label: str | None = None,
) -> Figure:
    """Why a head attends to a key (`dcinterp.qk`), from the result's tables: `pairs` [query component x key
    component] (`pair_table()`), `head_branch` [source head x branch] (`head_branch_table()`), `components`
    (`component_table()`: component, query, key) and `checks` (`causal_checks()`: component, side, source_head,
    estimate, frozen, norms, weights). Means over samples work the same way. `layer` labels the source heads
    L{layer}H{n}. `contrast`: the same tables of a `QKContrast` (keys pairs, head_branch, components, checks,
    label, head_branch_label), drawn as a second column. `head_branch_label`: what the source head x branch table
    adds up to, where it is not what `pairs` adds up to (default `label`; e.g. `pairs` holds one edge's terms and
    `head_branch` the whole score).

    One column per quantity (`label`, then the contrast's), its panels stacked: the quantity as a sum over
    (query component, key component) pairs, each pair summed over source heads and branches (the `top` components
    by size, in the first column's order in every panel; an 'others' row and column sum the rest where some are
    left out); then, for a DCMHA model, by source head n and compose branch b (W_b[n, m] times head n's pre-compose
    score) and each source head's total (plain MHA has no branches: the panel is left out); then each
    component's terms on the query side and on the key side (bars) with, where checked, the score lost when it is
    removed from every head's query (or key) input with ln1, the QK-norm and the dynamic weights frozen (x: sits
    on the bar end), with the norms free (circle) and with the dynamic weights free too (triangle: the component
    also leaves what the compose weights read). Each heatmap has its own colour bar, labelled with what it sums
    to: the panels of a column are on one scale when they show the same quantity."""
    columns = [
        dict(
            pairs=pairs,
            head_branch=head_branch,
            components=components,
            checks=checks,
            label=label,
            head_branch_label=head_branch_label,
        )
    ]
    if contrast is not None:
        columns.append(dict(contrast))
    if components is not None:  # one order of the components, largest first, for every row, column and bar
        table = components.set_index("component")
        size = table["query"].abs() + table["key"].abs()
    else:
        size = pairs.abs().sum(axis=1).add(pairs.abs().sum(axis=0), fill_value=0)
    order = [str(c) for c in size.sort_values(ascending=False, kind="stable").index[:top]]
    composes = _composes(head_branch)
    shown = [_top_pairs(column["pairs"], top, order, order) for column in columns]
    n_rows = len(shown[0][1])
    n_sources = int((head_branch != 0).any(axis=1).sum()) if (head_branch != 0).any(axis=None) else 1
    has_bars = any(column.get("components") is not None for column in columns)
    heights = [0.3 * n_rows + 2.0] + ([0.3 * n_sources + 1.8] if composes else [])
    heights += [0.28 * len(order) + 1.9] if has_bars else []
    fig = Figure(figsize=(PAGE_WIDTH if len(columns) > 1 else 5.0, sum(heights) + 1.0), layout="constrained")
    axes = fig.subplots(len(heights), len(columns), squeeze=False, gridspec_kw=dict(height_ratios=heights))
    for j, (column, (values, row_names, col_names)) in enumerate(zip(columns, shown, strict=True)):
        panel = iter(axes[:, j])
        _draw_qk_pairs(fig, next(panel), values, row_names, col_names, column["label"], left=j == 0)
        if composes:
            hb_label = column.get("head_branch_label") or column["label"]
            _draw_qk_head_branch(fig, next(panel), column["head_branch"], layer, hb_label, left=j == 0)
        if has_bars:
            _draw_qk_components(next(panel), column.get("components"), column.get("checks"), order, column, j == 0)
    _title(fig, title or "QK attribution: the head's composed score at one (query, key)")
    _caption(fig, caption)
    return fig


def _draw_qk_pairs(fig, ax, values, row_names, col_names, label: str, left: bool) -> None:
    image = _diverging(ax, values)
    _annotate(ax, values, fontsize=7 if len(col_names) > 7 else SMALLEST_TYPE)
    ax.set_xticks(range(len(col_names)), col_names, rotation=90)
    ax.set_yticks(range(len(row_names)), row_names if left else [""] * len(row_names))
    ax.set_xlabel("key component j")
    if left:
        ax.set_ylabel("query component i")
    ax.set_title(textwrap.fill(f"{label}: by component pair (i, j)", 34), fontsize=10)
    fig.colorbar(
        image, ax=ax, location="bottom", shrink=0.9, aspect=30, label=textwrap.fill(f"contribution to {label}", 34)
    )


def _draw_qk_head_branch(fig, ax, table, layer, label: str, left: bool) -> None:
    table = table[(table != 0).any(axis=1)] if (table != 0).any(axis=None) else table
    hb = table.to_numpy(dtype=float)
    hb = np.hstack([hb, hb.sum(1, keepdims=True)])  # and each source head's total
    image = _diverging(ax, hb)
    _annotate(ax, hb)
    ax.axvline(hb.shape[1] - 1.5, color="black", linewidth=1.5)
    heads = [f"L{layer}H{n}" if layer is not None else str(n) for n in table.index]
    ax.set_xticks(range(hb.shape[1]), [*table.columns, "sum"])
    ax.set_yticks(range(hb.shape[0]), heads if left else [""] * len(heads))
    ax.set_xlabel("compose branch b")
    if left:
        ax.set_ylabel("source head n")
    ax.set_title(textwrap.fill(f"{label}: by source head x branch", 34), fontsize=10)
    fig.colorbar(
        image, ax=ax, location="bottom", shrink=0.9, aspect=30, label=textwrap.fill(f"contribution to {label}", 34)
    )


def _draw_qk_components(ax, components, checks, order, column, legend: bool) -> None:
    if components is None:
        ax.set_visible(False)
        return
    table = components.assign(component=components["component"].astype(str)).set_index("component")
    table = table.reindex(order).fillna(0.0)
    y = np.arange(len(order))
    ax.barh(y - 0.2, table["query"], height=0.4, color="tab:orange", label="query side (terms)")
    ax.barh(y + 0.2, table["key"], height=0.4, color="tab:blue", label="key side (terms)")
    if checks is not None and len(checks):
        every_head = checks[checks["source_head"].isna() & checks["component"].isin(order)]
        markers = [("frozen", "x", "removed, norms and weights frozen"), ("norms", "o", "removed, norms free")]
        if "weights" in every_head and every_head["weights"].notna().any():
            markers.append(("weights", "^", "removed, norms and weights free"))
        for side, dy in (("query", -0.2), ("key", 0.2)):
            side_rows = every_head[every_head["side"] == side]
            where = [order.index(c) + dy for c in side_rows["component"]]
            for name, marker, legend in markers:
                ax.scatter(
                    side_rows[name],
                    where,
                    marker=marker,
                    color="black" if marker == "x" else None,
                    facecolor="none" if marker != "x" else None,
                    edgecolor="black" if marker != "x" else None,
                    zorder=3,
                    s=36,
                    label=legend if side == "query" else None,
                )
    ax.axvline(0, color="black", linewidth=0.6)
    ax.set_yticks(y, order if legend else [""] * len(order))  # one order in every panel: named on the left
    ax.set_ylim(len(order) - 0.5, -0.5)
    ax.set_xlabel(textwrap.fill(f"contribution to {column['label']}", 34))
    ax.set_title("by component, with causal checks" if checks is not None else "by component", fontsize=10)
    if legend:
        ax.legend(fontsize=SMALLEST_TYPE, loc="upper left", bbox_to_anchor=(0.0, -0.22), ncol=2, frameon=False)
    ax.grid(alpha=0.3, axis="x")


def plot_qk_keys_plotly(attribution, top: int = 10, title: str | None = None) -> go.Figure:
    """Every key of a `QKAttribution` in one interactive page: the composed score at each key (top row), then, per
    key, the score by source head and branch, by query component and by key component (the `top` components with
    the largest shares over the keys). Hover shows the values; one diverging scale per row."""
    from plotly.subplots import make_subplots

    a = attribution
    tokens = [token_label(a.str_tokens[s]) if a.str_tokens else "" for s in a.key_pos]
    x = [f"{s} {t}".strip() for s, t in zip(a.key_pos, tokens, strict=True)]
    hb = _np(a.head_branch)  # [key, branch, head]
    present = np.abs(hb).sum(0) > 0  # [branch, head]
    rows_hb = [(b, n) for n in range(hb.shape[2]) for b in range(hb.shape[1]) if present[b, n]]
    hb_values = np.stack([hb[:, b, n] for b, n in rows_hb]) if rows_hb else np.zeros((0, len(x)))
    hb_names = [f"L{a.layer}H{n} {a.branches[b]}" for b, n in rows_hb]
    query, key = _np(a.query_marginal.sum(1)), _np(a.key_marginal.sum(1))  # [key, component]
    parts = []
    for values in (query, key):
        order = np.argsort(-np.abs(values).sum(0), kind="stable")[:top]
        parts.append((values[:, order].T, [a.components[i] for i in order]))
    fig = make_subplots(
        rows=4,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.04,
        row_heights=[0.16, 0.28, 0.28, 0.28],
        subplot_titles=(
            "composed score (bars) and composed pattern (line)",
            "by source head and branch",
            "by query component (summed over key components)",
            "by key component (summed over query components)",
        ),
    )
    fig.add_trace(go.Bar(x=x, y=_np(a.composed), name="composed score", marker_color="#4c72b0"), row=1, col=1)
    fig.add_trace(
        go.Scatter(x=x, y=_np(a.composed_pattern), name="composed pattern", mode="lines+markers", line_color="#c44e52"),
        row=1,
        col=1,
    )
    for row, (values, names, label) in enumerate(
        [(hb_values, hb_names, "source head, branch"), (*parts[0], "query component"), (*parts[1], "key component")],
        start=2,
    ):
        limit = _symmetric_limit(values)
        fig.add_trace(
            go.Heatmap(
                z=values,
                x=x,
                y=names,
                colorscale="RdBu",
                reversescale=True,
                zmin=-limit,
                zmax=limit,
                zmid=0,
                showscale=False,
                hovertemplate="key %{x}<br>" + label + " %{y}: %{z:.4g}<extra></extra>",
            ),
            row=row,
            col=1,
        )
        fig.update_yaxes(autorange="reversed", row=row, col=1)
    query = f" ({a.str_tokens[a.query_pos]!r})" if a.str_tokens else ""
    fig.update_layout(
        title=title or f"L{a.layer}H{a.head}: why it attends where it does from query {a.query_pos}{query}",
        height=1000,
        width=max(900, 22 * len(x) + 300),
        legend=dict(orientation="h", y=1.02, x=1, xanchor="right"),
    )
    return fig


# --------------------------------------------------------------------------------------------------
# Head diversity
def plot_head_diversity(
    results: HeadDiversity | Mapping[str, HeadDiversity],
    per_layer: bool = False,
    title: str | None = None,
    caption: str | None = None,
) -> Figure:
    """Fig. 5: mean cumulative captured variance of concatenated QK (left) and OV (right) circuits against the
    number of principal components, one line per model (per_layer adds each layer as a thin line). With two or
    more models a second row shows the first model's curves minus each other's (below zero: the first model's
    heads are more diverse), per layer (thin) and their mean (thick). `diversity_verdict(results)` says what the
    curves show in numbers, for the page beside the figure."""
    results = {"model": results} if isinstance(results, HeadDiversity) else dict(results)
    names = list(results)
    compare = len(results) > 1
    fig = Figure(figsize=(PAGE_WIDTH, 8.4 if compare else 4.4), layout="constrained")
    axes = fig.subplots(2 if compare else 1, 2, squeeze=False, sharex=True)
    styles = ["-", "--", ":", "-."]
    for col, circuit in enumerate(("qk", "ov")):
        ax = axes[0, col]
        for i, (name, result) in enumerate(results.items()):
            curves = _np(getattr(result, circuit))
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
            first = _np(getattr(results[names[0]], circuit))
            for i, name in enumerate(names[1:], start=1):
                other = _np(getattr(results[name], circuit))
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
    _title(fig, title or "Head diversity: concatenated per-layer circuits (lower = more diverse heads)")
    _caption(fig, caption)
    return fig


def diversity_verdict(results: Mapping[str, HeadDiversity]) -> str:
    """What the curves say, in numbers: each model's area under its mean curve per circuit, and (two or more
    models) in how many layers the second is lower than the first, which is the paper's Fig. 5 finding for
    DCFormer against Transformer."""
    names = list(results)
    areas = "; ".join(f"{name}: QK {_np(r.qk).mean():.3f}, OV {_np(r.ov).mean():.3f}" for name, r in results.items())
    text = f"Area under the mean curve (lower = more diverse) {areas}."
    if len(names) > 1:
        first, second = results[names[0]], results[names[1]]
        for circuit in ("qk", "ov"):
            a, b = _np(getattr(first, circuit)), _np(getattr(second, circuit))
            text += f" {circuit.upper()}: {names[0]} minus {names[1]} {a.mean() - b.mean():+.3f}"
            if a.shape == b.shape:
                text += f", lower in {int((a.mean(1) < b.mean(1)).sum())} of {len(a)} layers"
            text += "."
        text += " The paper (Fig. 5) finds DCFormer's heads more diverse, markedly for QK."
    return text


# --------------------------------------------------------------------------------------------------
# Synthetic evaluation (Table 5, Fig. 6)
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
    """Accuracy on the synthetic tasks from `dcinterp.synth.accuracy.accuracy_tables(results)`, panels stacked.

    Accuracy by shots K (Fig. 6) with its interval as a band; then by QK pattern (which fact to look up) and by OV
    transformation (what to answer with it), with intervals as error bars and chance (a random candidate of the
    line: 1/3, 1/2 for odd-one-out) as dashes; then each checkpoint's accuracy per (QK pattern, OV
    transformation) combination, in percent with its interval, on one shared 0-100% scale (grey: no sample of
    that combination); and with two or more checkpoints the first minus the second in percentage points with the
    paired interval of `tables["difference"]` in each cell, the differences whose interval leaves out zero in bold
    and framed (diverging, centred at zero).
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
        limit = _symmetric_limit(diff)
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
    _title(fig, title or "Synthetic-task evaluation")
    _caption(fig, caption)
    return fig


# --------------------------------------------------------------------------------------------------
# Patching and branch ablation (dcinterp.patching, python -m dcinterp.synth ablate)
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
    """Patching tables (`activation_patching` / `attribution_patching` frames) side by side on one shared scale.

    Rows: stage.site; columns: layers, or heads for per-head tables. Red: patching raises the clean-minus-corrupt
    logit difference (denoising restores it), blue: lowers it (noising removes it); 1 = all of the difference.
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
        _title(fig, title)
    _caption(fig, caption)
    return fig


def plot_patching_agreement(exact, estimate, title: str | None = None) -> Figure:
    """Attribution patching against exact patching, one point per site (and head), with y = x; the title gives the
    number of rows and Spearman's rho. Effect: share of the clean - corrupt logit difference."""
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

    `table` is `dcinterp.synth.ablate.ablation_table(...)`: columns accuracy, qk:* and ov:*. One shared scale
    in percentage points. Columns: all samples, by QK pattern, by OV transformation; their labels give the full
    model's accuracy in brackets. Chance (a random candidate of the line) is about 35%.
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


# --------------------------------------------------------------------------------------------------
# Circuit discovery (dcinterp.discovery)
BRANCH_COLORS = {"qp": "tab:orange", "kp": "tab:green", "qg": "tab:purple", "kg": "tab:brown", "skip": "tab:olive"}
# A residual edge's colour says which input of its receiver it feeds: a head's q, k or v, or another node's input.
INPUT_COLORS = {"q": "tab:blue", "k": "tab:red", "v": "black", "other": "tab:cyan"}


def plot_faithfulness(curve, title: str | None = None, caption: str | None = None) -> Figure:
    """Faithfulness against circuit size, one line per (method, selection); the random-edges baseline grey with
    crosses, the 80% mark a green dash-dot line, both in the legend.

    Faithfulness = (m(circuit) - m(corrupted)) / (m(clean) - m(corrupted)), by exact edge patching.
    `curve` is `dcinterp.discovery.faithfulness_curve(...)`: columns method, selection, edges, faithfulness."""
    fig = Figure(figsize=(6.0, 4.2), layout="constrained")
    ax = fig.subplots()
    styles = {"top-n": "-", "greedy": "--"}
    colors = dict(
        zip(
            [m for m in dict.fromkeys(curve["method"]) if m != "random"],
            ["tab:blue", "tab:red", "tab:green"],
            strict=False,
        )
    )
    for (method, selection), rows in curve.groupby(["method", "selection"], sort=False):
        rows = rows.sort_values("edges")
        if method == "random":
            ax.plot(
                rows["edges"], rows["faithfulness"], "-", color="0.55", marker="x", ms=4, label="random edges (mean)"
            )
        else:
            ax.plot(
                rows["edges"],
                rows["faithfulness"],
                styles.get(selection, "-"),
                color=colors[method],
                marker="o",
                ms=3,
                label=f"{method}, {selection}",
            )
    ax.axhline(1, color="black", lw=0.6)
    ax.axhline(0.8, color="tab:green", lw=1.0, ls="-.", label="80% faithful")
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xlim(0, curve["edges"].max() * 1.05)
    ax.set_xlabel("edges in the circuit (the others corrupted)")
    ax.set_ylabel("faithfulness")
    ax.legend(fontsize=SMALLEST_TYPE, handlelength=3.5)
    ax.set_title(title or "faithfulness of circuits", fontsize=10)
    _caption(fig, caption)
    return fig


def plot_circuit(graph, scores, circuit, title: str | None = None, caption: str | None = None) -> Figure:
    """A circuit drawn layer by layer: embedding at the bottom, logits at the top, a row of heads per layer with
    its MLP on the right and (DCMHA) the compose-weight generator on the left. Residual edges are dark lines from
    a sender's output to a receiver, coloured by the input they feed (`INPUT_COLORS`: a head's q, k or v, which
    enter its bottom left, middle and right, marked with the letter where heads are few; or an MLP, the compose
    weights, the logits); compose edges are arcs inside their layer (pre-compose below the row of heads,
    post-compose above), coloured by branch; a compose edge from a head to itself (the gates, the skip, a
    projection's diagonal) is a ring beside it, the branches side by side (qp, qg, kp, kg, skip from left to right).
    Every edge's line width follows |score|, with a key in the legend.

    graph: `dcinterp.discovery.Graph`; scores: [edge] tensor; circuit: bool [edge] mask (the edges drawn)."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyArrowPatch

    cfg = graph.cfg
    H, L = cfg.n_heads, cfg.n_layers
    chosen = np.flatnonzero(_np(torch.as_tensor(circuit)).astype(bool))
    values = _np(scores)
    largest = max(np.abs(values[chosen]).max() if len(chosen) else 1.0, 1e-12)

    def width(i):
        return 0.3 + 3.2 * abs(values[i]) / largest

    x_mlp, x_compose = H + 0.6, -1.4
    fig = Figure(
        figsize=(PAGE_WIDTH, min(max(4.5, 1.5 + 0.62 * (L + 2)), 26.0) + 1.8),  # the legend below the graph
        layout="constrained",
    )
    ax = fig.subplots()

    def sender_point(name: str) -> tuple[float, float]:
        if name == "embed":
            return (H - 1) / 2, -1.0
        if name.startswith("MLP"):
            return x_mlp, int(name[3:]) + 0.42
        layer, head = name[1:].split("H")
        return int(head), int(layer) + 0.12

    def receiver_point(name: str) -> tuple[float, float]:
        if name == "logits":
            return (H - 1) / 2, L + 0.1
        if name.startswith("MLP"):
            return x_mlp, int(name[3:]) + 0.22
        if name.endswith(".compose"):
            return x_compose, int(name[1:].split(".")[0])
        head, part = name.split(".")
        layer, h = head[1:].split("H")
        return int(h) + {"q": -0.22, "k": 0.0, "v": 0.22}[part], int(layer) - 0.22

    used_heads, fed_inputs = set(), set()
    for i in chosen:
        edge = graph.edges[i]
        if edge.kind == "compose":
            used_heads.update({(edge.layer, edge.source_head), (edge.layer, edge.target_head)})
            y = edge.layer + (-0.1 if edge.stage == "pre" else 0.1)
            color = BRANCH_COLORS[edge.branch]
            if edge.source_head == edge.target_head:  # rings of one size, side by side; |score| in their line
                offset = {"qp": -0.3, "qg": -0.15, "kp": 0.0, "kg": 0.15, "skip": 0.3}[edge.branch]
                ax.plot(
                    edge.source_head + offset,
                    y + (-0.14 if edge.stage == "pre" else 0.14),
                    "o",
                    mfc="white",
                    mec=color,
                    ms=7,
                    mew=0.4 + 0.7 * width(i),
                    zorder=4,
                )
            else:
                # arc3 bends an arc drawn left to right below for rad > 0; the bulge (rad x length) stays in the layer
                rad = (-0.3 if edge.stage == "post" else 0.3) / abs(edge.target_head - edge.source_head)
                rad = rad if edge.target_head > edge.source_head else -rad
                ax.add_patch(
                    FancyArrowPatch(
                        (edge.source_head, y),
                        (edge.target_head, y),
                        connectionstyle=f"arc3,rad={rad}",
                        arrowstyle="-|>",
                        mutation_scale=7,
                        color=color,
                        lw=width(i),
                        alpha=0.85,
                        zorder=3,
                    )
                )
            continue
        start, end = sender_point(edge.source), receiver_point(edge.target)
        if edge.source_head is not None:
            used_heads.add((int(edge.source[1:].split("H")[0]), edge.source_head))
        part = edge.target.rsplit(".", 1)[-1] if edge.target_head is not None else "other"
        if edge.target_head is not None:
            used_heads.add((edge.layer, edge.target_head))
            fed_inputs.add((part, end))
        ax.annotate(
            "",
            xy=end,
            xytext=start,
            zorder=2,
            arrowprops=dict(
                arrowstyle="-|>",
                color=INPUT_COLORS[part],
                lw=width(i),
                alpha=0.7,
                shrinkA=2,
                shrinkB=2,
                mutation_scale=6,
            ),
        )
    if H <= 16:  # the input's letter under each arrowhead that feeds a head
        for part, (x, y) in fed_inputs:
            ax.text(
                x, y - 0.07, part, color=INPUT_COLORS[part], ha="center", va="top", fontsize=SMALLEST_TYPE, zorder=6
            )
    # nodes
    for layer in range(L):
        ax.axhspan(layer - 0.4, layer + 0.55, color="0.96" if layer % 2 else "0.92", zorder=0)
        xs = np.arange(H)
        ax.scatter(xs, np.full(H, layer), s=12, color="0.75", zorder=1)
        for layer_, head in used_heads:
            if layer_ == layer:
                ax.scatter([head], [layer], s=60, marker="s", color="white", edgecolors="black", zorder=5)
                if H <= 40:
                    ax.text(head, layer, str(head), ha="center", va="center", fontsize=5 if H > 12 else 8, zorder=6)
        ax.text(
            x_mlp,
            layer + 0.32,
            f"MLP{layer}",
            ha="center",
            va="center",
            fontsize=SMALLEST_TYPE,
            bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="0.5"),
            zorder=5,
        )
        if graph.dcmha:
            ax.text(
                x_compose,
                layer,
                "W",
                ha="center",
                va="center",
                fontsize=SMALLEST_TYPE,
                bbox=dict(boxstyle="round,pad=0.2", fc="lightyellow", ec="0.5"),
                zorder=5,
            )
    ax.text(
        (H - 1) / 2,
        -1.0,
        "embed",
        ha="center",
        va="center",
        fontsize=8,
        bbox=dict(boxstyle="round", fc="white", ec="black"),
        zorder=5,
    )
    ax.text(
        (H - 1) / 2,
        L + 0.1,
        "logits",
        ha="center",
        va="center",
        fontsize=8,
        bbox=dict(boxstyle="round", fc="white", ec="black"),
        zorder=5,
    )
    ax.set_yticks(range(L), [f"L{layer}" for layer in range(L)], fontsize=7 if L > 12 else 9)
    step = max(1, H // 16)
    ax.set_xticks(range(0, H, step), [str(h) for h in range(0, H, step)], fontsize=SMALLEST_TYPE)
    ax.set_xlabel("head" + ("   (W: compose-weight generator, left)" if graph.dcmha else ""))
    ax.set_xlim(x_compose - 0.6 if graph.dcmha else -0.8, x_mlp + 0.8)
    ax.set_ylim(-1.5, L + 0.5)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    handles = [
        Line2D([], [], color=INPUT_COLORS[part], lw=1.5, label=f"residual edge into {name}")
        for part, name in [("q", "a head's q"), ("k", "a head's k"), ("v", "a head's v"), ("other", "MLP, W, logits")]
    ]
    if graph.dcmha:
        handles += [Line2D([], [], color=c, lw=2, label=f"compose {b}") for b, c in BRANCH_COLORS.items()]
        handles.append(
            Line2D([], [], ls="", marker="o", ms=7, mfc="white", mec="0.3", label="ring: compose, a head to itself")
        )
    handles += [
        Line2D([], [], color="0.3", lw=0.3 + 3.2 * share, label=f"|score| {share * largest:.2g}")
        for share in (1.0, 0.5, 0.1)
    ]
    fig.legend(handles=handles, fontsize=SMALLEST_TYPE, loc="outside lower center", ncol=2, frameon=False)
    ax.set_title(title or f"circuit: {len(chosen)} edges", fontsize=10)
    _caption(fig, caption)
    return fig


# --------------------------------------------------------------------------------------------------
# The paired study (dcinterp.study: python -m dcinterp.train summarize RUNS_DIR --figures DIR)
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
    """The paired study's claim per QK pattern and OV transformation on one evaluation set, from
    `dcinterp.study.summary_table`: for all tasks (top), each QK pattern, each OV transformation and, for runs that
    left combinations out of training, the never-seen combinations (all of them, then each) and, where the table
    has them, what never seeing them cost (`held_out_change`: the accuracy there minus the twin's trained on them),
    the mean paired difference DCMHA - MHA in percentage points (black tick) with its interval (grey bar: the
    table's low/high), each seed's own difference (a dot, one colour per seed), and each architecture's mean
    written at the right; right of zero, DCMHA is ahead (on the last panel: it lost less). `baseline` names the MHA
    runs in the title and the axis (e.g. "MHA (d_mlp 304)" in a parameter-matched study)."""
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
    _title(fig, title or f"{eval_set}: DCMHA - {baseline} accuracy, paired by seed ({_plural(len(seeds), 'seed')})")
    _caption(fig, caption)
    return fig


def plot_study_held_out(table, title: str | None = None, caption: str | None = None) -> Figure:
    """The held-out combinations (`held_out_combos` rows of `dcinterp.study.summary_table`), per evaluation set.
    Left: each seed's MHA and DCMHA accuracy joined by a line (its colour: the seed), the means in black. Right:
    the mean paired difference DCMHA - MHA with its interval (the table's low/high). The title says which tasks
    these are: the combinations the runs left out of training (--exclude-combos), or, when they left none out,
    the default split's combination tasks, which they trained on."""
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
    _title(fig, title or f"Accuracy on {which}")
    _caption(fig, caption)
    return fig


def plot_study_head_diversity(
    frame, marks: Sequence[int] = (), title: str | None = None, caption: str | None = None
) -> Figure:
    """Head diversity (Fig. 5's measure) of every run of the study, from `dcinterp.study.diversity_frame`: the
    cumulative share of variance captured by the first k principal components of the heads' concatenated QK
    circuits (left) and OV circuits (right), averaged over layers; each run thin, each architecture's mean over
    its runs thick (DCMHA red, MHA blue). Lower = more diverse heads. `marks`: values of k drawn as dotted lines
    (the table's k)."""
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
    _title(fig, title or "Head diversity of each run (lower = more diverse heads)")
    _caption(fig, caption)
    return fig


def plot_study_learning_curves(frame, title: str | None = None, caption: str | None = None) -> Figure:
    """The probe accuracy logged during training (`eval_accuracy`, every --eval-every steps) against the step, from
    `dcinterp.study.learning_curves`: one colour per seed, DCMHA solid, MHA dashed; a dotted vertical line where the
    shared start ends (the step the runs forked from, when they did)."""
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
    _title(fig, title or "Learning curves: probe accuracy during training")
    _caption(fig, caption)
    return fig
