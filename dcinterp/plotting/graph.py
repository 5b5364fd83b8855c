"""A pruned attribution graph drawn: a matplotlib figure and a self-contained plotly page (plotly.js inlined: it opens
offline). Token embeddings along the bottom, features and error nodes of each layer in a row above, the logits at the
top; one column per prompt position. Edges are drawn with a width by |weight| (blue positive, red negative); an edge
that moves between positions went through attention, and `dcinterp.attribution_graph.edge_labels` names the head,
source head and branch of its largest part.
"""

from __future__ import annotations

import html
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
from matplotlib.figure import Figure
from torch import Tensor

from ..attribution_graph import AttributionGraph


def node_layout(graph: AttributionGraph, node_mask: Tensor) -> dict[int, tuple[float, float]]:
    """(x, y) of each kept node: x its position (nodes sharing a cell spread across it), y its row (-1 tokens,
    0 ... n_layers - 1 features and errors, n_layers logits)."""
    cells: dict[tuple[int, int], list[int]] = {}
    for index in node_mask.nonzero().flatten().tolist():
        node = graph.node(index)
        row = -1 if node["kind"] == "token" else node["layer"]
        cells.setdefault((node["pos"], row), []).append(index)
    layout = {}
    for (pos, row), members in cells.items():
        for k, index in enumerate(members):
            offset = 0.0 if len(members) == 1 else -0.35 + 0.7 * k / (len(members) - 1)
            layout[index] = (pos + offset, float(row))
    return layout


def node_label(graph: AttributionGraph, index: int, token_str=str) -> str:
    """A short name: `L1 f37 @5`, `err L1 @5`, `tok 'has' @5`, `logit 'food'`."""
    node = graph.node(index)
    if node["kind"] == "feature":
        return f"L{node['layer']} f{node['feature']} @{node['pos']}"
    if node["kind"] == "error":
        return f"err L{node['layer']} @{node['pos']}"
    if node["kind"] == "token":
        return f"tok {token_str(node['token'])!r} @{node['pos']}"
    return f"logit {token_str(node['token'])!r}"


def _edges(graph: AttributionGraph, edge_mask: Tensor, layout: dict) -> list[tuple[int, int, float]]:
    targets, sources = edge_mask.nonzero(as_tuple=True)
    return [
        (t, s, graph.adjacency_matrix[t, s].item())
        for t, s in zip(targets.tolist(), sources.tolist(), strict=True)
        if t in layout and s in layout
    ]


def plot_attribution_graph(
    graph: AttributionGraph,
    node_mask: Tensor,
    edge_mask: Tensor,
    token_labels: list[str] | None = None,
    labels: dict[tuple[int, int], str] | None = None,
    title: str | None = None,
    max_labels: int = 8,
) -> Figure:
    """A pruned graph as a matplotlib figure.

    Args:
        graph: the graph.
        node_mask: the nodes kept (`prune_graph`).
        edge_mask: the edges kept (`prune_graph`).
        token_labels: the prompt's tokens, for the x axis (default: their ids).
        labels: `attribution_graph.edge_labels`, shown on the strongest labelled edges.
        title: the figure's title.
        max_labels: how many edge labels at most.

    Returns:
        The figure.
    """
    layout = node_layout(graph, node_mask)
    edges = _edges(graph, edge_mask, layout)
    scale = max((abs(w) for _, _, w in edges), default=1.0) or 1.0
    fig = Figure(figsize=(min(18.0, max(8.0, 0.25 * graph.n_pos)), 1.4 * (graph.n_layers + 2)), layout="constrained")
    ax = fig.add_subplot()
    for t, s, w in sorted(edges, key=lambda e: abs(e[2])):
        (x0, y0), (x1, y1) = layout[s], layout[t]
        ax.plot([x0, x1], [y0, y1], color="tab:blue" if w > 0 else "tab:red", lw=0.3 + 3 * abs(w) / scale, alpha=0.6)
    colours = {"feature": "0.35", "error": "tab:orange", "token": "tab:green", "logit": "tab:purple"}
    for index, (x, y) in layout.items():
        ax.scatter([x], [y], s=28, color=colours[graph.node(index)["kind"]], zorder=3)
    strongest = sorted(((abs(w), t, s) for t, s, w in edges if labels and (t, s) in labels), reverse=True)
    for rank, (_, t, s) in enumerate(strongest[:max_labels]):
        (x0, y0), (x1, y1) = layout[s], layout[t]
        f = 0.2 + 0.6 * rank / max(1, min(max_labels, len(strongest)) - 1)  # staggered along the edges: no pile-up
        ax.annotate(labels[(t, s)], (x0 + f * (x1 - x0), y0 + f * (y1 - y0)), fontsize=6, ha="center", color="0.15")
    tokens = token_labels or [str(t) for t in graph.run.tokens.tolist()]
    ax.set_xticks(range(graph.n_pos), [str(t).replace("\n", "\\n") for t in tokens], rotation=90, fontsize=7)
    rows = ["tokens", *(f"layer {layer}" for layer in range(graph.n_layers)), "logits"]
    ax.set_yticks(range(-1, graph.n_layers + 1), rows)
    ax.set_xlim(-0.7, graph.n_pos - 0.3)
    ax.set_title(title or "attribution graph (pruned)", fontsize=10)
    return fig


def write_graph_html(
    graph: AttributionGraph,
    node_mask: Tensor,
    edge_mask: Tensor,
    path: str | Path,
    token_labels: list[str] | None = None,
    labels: dict[tuple[int, int], str] | None = None,
    title: str = "attribution graph",
) -> Path:
    """A pruned graph as a self-contained interactive page: hover a node for its name, activation and input, an edge
    for its weight and (given `labels`) its largest attention part.

    Args:
        graph: the graph.
        node_mask: the nodes kept (`prune_graph`).
        edge_mask: the edges kept (`prune_graph`).
        path: the HTML file to write.
        token_labels: the prompt's tokens (default: their ids).
        labels: `attribution_graph.edge_labels`.
        title: the page's title.

    Returns:
        The path written.
    """
    layout = node_layout(graph, node_mask)
    edges = _edges(graph, edge_mask, layout)
    scale = max((abs(w) for _, _, w in edges), default=1.0) or 1.0
    fig = go.Figure()
    for t, s, w in edges:
        (x0, y0), (x1, y1) = layout[s], layout[t]
        text = f"{node_label(graph, s)} -> {node_label(graph, t)}: {w:.4g}"
        if labels and (t, s) in labels:
            text += f"<br>{html.escape(labels[(t, s)])}"
        fig.add_trace(
            go.Scatter(
                x=np.linspace(x0, x1, 5),
                y=np.linspace(y0, y1, 5),
                mode="lines",
                line=dict(width=0.5 + 4 * abs(w) / scale, color="royalblue" if w > 0 else "crimson"),
                opacity=0.6,
                hoverinfo="text",
                text=text,
                showlegend=False,
            )
        )
    indices = list(layout)
    hover = [
        f"{node_label(graph, i)}<br>activation {graph.activation_values[i].item() if i < graph.n_features else 0:.4g}"
        f"<br>input {graph.node_inputs[i].item():.4g}"
        for i in indices
    ]
    fig.add_trace(
        go.Scatter(
            x=[layout[i][0] for i in indices],
            y=[layout[i][1] for i in indices],
            mode="markers",
            marker=dict(
                size=9, color=[["feature", "error", "token", "logit"].index(graph.node(i)["kind"]) for i in indices]
            ),
            hoverinfo="text",
            text=hover,
            showlegend=False,
        )
    )
    tokens = token_labels or [str(t) for t in graph.run.tokens.tolist()]
    fig.update_layout(
        title=title,
        xaxis=dict(tickmode="array", tickvals=list(range(graph.n_pos)), ticktext=tokens),
        yaxis=dict(
            tickmode="array",
            tickvals=list(range(-1, graph.n_layers + 1)),
            ticktext=["tokens", *(f"layer {layer}" for layer in range(graph.n_layers)), "logits"],
        ),
        template="plotly_white",
    )
    path = Path(path)
    page = fig.to_html(include_plotlyjs=True, full_html=True, div_id=path.stem)
    path.write_text(page.replace("</head>", f"<title>{html.escape(title)}</title>\n</head>", 1), encoding="utf-8")
    return path
