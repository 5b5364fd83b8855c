"""Figures of `dcinterp.qk`: why a head attends to a key, by component pair, source head x branch and component,
with the causal checks beside the terms; and every key of a query in one interactive page."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping

import numpy as np
import plotly.graph_objects as go
from matplotlib.figure import Figure

from .style import (
    PAGE_WIDTH,
    SMALLEST_TYPE,
    annotate_cells,
    diverging_heatmap,
    diverging_heatmap_plotly,
    draw_caption,
    draw_title,
    to_numpy,
    token_label,
)


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
    """Why a head attends to a key (`dcinterp.qk`), from the result's tables; means over samples work the same way.

    One column per quantity (`label`, then the contrast's), its panels stacked: the quantity as a sum over
    (query component, key component) pairs, each pair summed over source heads and branches (the `top` components
    by size, in the first column's order in every panel; an 'others' row and column sum the rest where some are
    left out); then, for a DCMHA model, by source head n and compose branch b (W_b[n, m] times head n's pre-compose
    score) and each source head's total (plain MHA has no branches: the panel is left out); then each
    component's terms on the query side and on the key side (bars) with, where checked, the score lost when it is
    removed from every head's query (or key) input with ln1, the QK-norm and the dynamic weights frozen (x: sits
    on the bar end), with the norms free (circle) and with the dynamic weights free too (triangle: the component
    also leaves what the compose weights read). Each heatmap has its own colour bar, labelled with what it sums
    to: the panels of a column are on one scale when they show the same quantity.

    Args:
        pairs: The [query component x key component] table (`pair_table()`).
        head_branch: The [source head x branch] table (`head_branch_table()`).
        components: The `component_table()` (columns component, query, key); without it, no bars.
        checks: The `causal_checks()` table (columns component, side, source_head, estimate, frozen, norms,
            weights); without it, no markers.
        layer: The layer, to name the source heads L{layer}H{n}; default their numbers alone.
        top: How many components to show.
        title: The title; default "QK attribution: the head's composed score at one (query, key)".
        caption: A line drawn under the figure.
        contrast: The same tables of a `QKContrast` (keys pairs, head_branch, components, checks, label,
            head_branch_label), drawn as a second column.
        label: What `pairs` adds up to.
        head_branch_label: What the source head x branch table adds up to, where it is not what `pairs` adds up to
            (e.g. `pairs` holds one edge's terms and `head_branch` the whole score); default `label`.

    Returns:
        The figure.
    """
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
    draw_title(fig, title or "QK attribution: the head's composed score at one (query, key)")
    draw_caption(fig, caption)
    return fig


def _draw_qk_pairs(fig, ax, values, row_names, col_names, label: str, left: bool) -> None:
    image = diverging_heatmap(ax, values)
    annotate_cells(ax, values, fontsize=7 if len(col_names) > 7 else SMALLEST_TYPE)
    ax.set_xticks(range(len(col_names)), col_names, rotation=90)
    ax.set_yticks(range(len(row_names)), row_names if left else [""] * len(row_names))
    _label_panel(
        fig, ax, image, f"{label}: by component pair (i, j)", label, "key component j", "query component i", left
    )


def _draw_qk_head_branch(fig, ax, table, layer, label: str, left: bool) -> None:
    table = table[(table != 0).any(axis=1)] if (table != 0).any(axis=None) else table
    hb = table.to_numpy(dtype=float)
    hb = np.hstack([hb, hb.sum(1, keepdims=True)])  # and each source head's total
    image = diverging_heatmap(ax, hb)
    annotate_cells(ax, hb)
    ax.axvline(hb.shape[1] - 1.5, color="black", linewidth=1.5)
    heads = [f"L{layer}H{n}" if layer is not None else str(n) for n in table.index]
    ax.set_xticks(range(hb.shape[1]), [*table.columns, "sum"])
    ax.set_yticks(range(hb.shape[0]), heads if left else [""] * len(heads))
    _label_panel(fig, ax, image, f"{label}: by source head x branch", label, "compose branch b", "source head n", left)


def _label_panel(fig, ax, image, title: str, label: str, xlabel: str, ylabel: str, left: bool) -> None:
    """A heatmap panel's axis labels (the y label on the left column only), title and colour bar below."""
    ax.set_xlabel(xlabel)
    if left:
        ax.set_ylabel(ylabel)
    ax.set_title(textwrap.fill(title, 34), fontsize=10)
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
    """Every key of a `QKAttribution` in one interactive page; hover shows the values, one diverging scale per row.

    The composed score at each key (top row), then, per key, the score by source head and branch, by query component
    and by key component (the `top` components with the largest shares over the keys).

    Args:
        attribution: A `QKAttribution` over several keys.
        top: How many query (and key) components to show.
        title: The title; default the head and the query.

    Returns:
        The plotly figure.
    """
    from plotly.subplots import make_subplots

    a = attribution
    tokens = [token_label(a.str_tokens[s]) if a.str_tokens else "" for s in a.key_pos]
    x = [f"{s} {t}".strip() for s, t in zip(a.key_pos, tokens, strict=True)]
    hb = to_numpy(a.head_branch)  # [key, branch, head]
    present = np.abs(hb).sum(0) > 0  # [branch, head]
    rows_hb = [(b, n) for n in range(hb.shape[2]) for b in range(hb.shape[1]) if present[b, n]]
    hb_values = np.stack([hb[:, b, n] for b, n in rows_hb]) if rows_hb else np.zeros((0, len(x)))
    hb_names = [f"L{a.layer}H{n} {a.branches[b]}" for b, n in rows_hb]
    query, key = to_numpy(a.query_marginal.sum(1)), to_numpy(a.key_marginal.sum(1))  # [key, component]
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
    fig.add_trace(go.Bar(x=x, y=to_numpy(a.composed), name="composed score", marker_color="#4c72b0"), row=1, col=1)
    fig.add_trace(
        go.Scatter(
            x=x, y=to_numpy(a.composed_pattern), name="composed pattern", mode="lines+markers", line_color="#c44e52"
        ),
        row=1,
        col=1,
    )
    for row, (values, names, label) in enumerate(
        [(hb_values, hb_names, "source head, branch"), (*parts[0], "query component"), (*parts[1], "key component")],
        start=2,
    ):
        fig.add_trace(
            diverging_heatmap_plotly(
                values,
                x=x,
                y=names,
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
