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


def node_layout(
    graph: AttributionGraph, node_mask: Tensor, columns: dict[int, int] | None = None
) -> dict[int, tuple[float, float]]:
    """(x, y) of each kept node: x its position's column (nodes sharing a cell spread across it), y its row (-1
    tokens, 0 ... n_layers - 1 features and errors, n_layers logits).

    Args:
        graph: the graph.
        node_mask: the nodes kept (`prune_graph`).
        columns: {position: column} for the positions drawn (`shown_positions`); None: every position its own column,
            x = position. Nodes at a position not in it are left out.

    Returns:
        {node index: (x, y)}.
    """
    cells: dict[tuple[int, int], list[int]] = {}
    for index in node_mask.nonzero().flatten().tolist():
        node = graph.node(index)
        if columns is not None and node["pos"] not in columns:
            continue
        row = -1 if node["kind"] == "token" else node["layer"]
        column = node["pos"] if columns is None else columns[node["pos"]]
        cells.setdefault((column, row), []).append(index)
    layout = {}
    for (column, row), members in cells.items():
        for k, index in enumerate(members):
            offset = 0.0 if len(members) == 1 else -0.35 + 0.7 * k / (len(members) - 1)
            layout[index] = (column + offset, float(row))
    return layout


def shown_positions(graph: AttributionGraph, node_mask: Tensor, edge_mask: Tensor) -> list[int]:
    """The positions worth a column: those holding a kept feature, error or logit, or a node with a kept edge (the
    pruned graph keeps every token, most of them without an edge).

    Args:
        graph: the graph.
        node_mask: the nodes kept (`prune_graph`).
        edge_mask: the edges kept (`prune_graph`).

    Returns:
        The positions, sorted.
    """
    kept = set(node_mask.nonzero().flatten().tolist())
    linked = set(edge_mask.nonzero().flatten().tolist()) & kept
    positions = {graph.node(i)["pos"] for i in linked | {i for i in kept if graph.node(i)["kind"] != "token"}}
    return sorted(positions)


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


# A node's colour by kind (matplotlib's tab10 green, orange, purple and a grey), in the figure and the page alike.
KIND_COLOURS = {"token": "#2ca02c", "feature": "#595959", "error": "#ff7f0e", "logit": "#9467bd"}
KIND_NAMES = {"token": "token embedding", "feature": "transcoder feature", "error": "error node", "logit": "logit"}


def plot_attribution_graph(
    graph: AttributionGraph,
    node_mask: Tensor,
    edge_mask: Tensor,
    token_labels: list[str] | None = None,
    labels: dict[tuple[int, int], str] | None = None,
    title: str | None = None,
    max_labels: int = 8,
    every_position: bool = False,
) -> Figure:
    """A pruned graph as a matplotlib figure: a column per position (by default only the positions with a kept
    edge or a kept node other than a token: `shown_positions`), a row per layer; nodes coloured by kind (legend),
    edges by sign and weight, the strongest `max_labels` labelled edges named where their labels overlap nothing.

    Args:
        graph: the graph.
        node_mask: the nodes kept (`prune_graph`).
        edge_mask: the edges kept (`prune_graph`).
        token_labels: the prompt's tokens, for the x axis (default: their ids).
        labels: `attribution_graph.edge_labels`, shown on the strongest labelled edges.
        title: the figure's title.
        max_labels: how many edge labels at most.
        every_position: a column for every position of the prompt.

    Returns:
        The figure.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.lines import Line2D

    positions = list(range(graph.n_pos)) if every_position else shown_positions(graph, node_mask, edge_mask)
    columns = {pos: column for column, pos in enumerate(positions)}
    layout = node_layout(graph, node_mask, columns)
    edges = _edges(graph, edge_mask, layout)
    scale = max((abs(w) for _, _, w in edges), default=1.0) or 1.0
    # About 8 inches for a few dozen columns: shown at a docs page's width, the 9-point text stays readable.
    width = min(18.0, max(6.5, 1.5 + 0.25 * len(positions)))
    fig = Figure(figsize=(width, 1.2 * (graph.n_layers + 2) + 1.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for t, s, w in sorted(edges, key=lambda e: abs(e[2])):
        (x0, y0), (x1, y1) = layout[s], layout[t]
        ax.plot([x0, x1], [y0, y1], color="tab:blue" if w > 0 else "tab:red", lw=0.3 + 3 * abs(w) / scale, alpha=0.6)
    kinds = {index: graph.node(index)["kind"] for index in layout}
    for kind, colour in KIND_COLOURS.items():
        points = [layout[index] for index in layout if kinds[index] == kind]
        if points:
            ax.scatter(*zip(*points, strict=True), s=36, color=colour, zorder=3, label=KIND_NAMES[kind])
    tokens = token_labels or [str(t) for t in graph.run.tokens.tolist()]
    ticks = [f"{str(tokens[pos]).replace(chr(10), chr(92) + 'n')} ({pos})" for pos in positions]
    ax.set_xticks(range(len(positions)), ticks, rotation=45, ha="right", rotation_mode="anchor", fontsize=9)
    rows = ["tokens", *(f"layer {layer}" for layer in range(graph.n_layers)), "logits"]
    ax.set_yticks(range(-1, graph.n_layers + 1), rows, fontsize=9)
    ax.set_xlim(-0.7, len(positions) - 0.3)
    ax.set_ylim(-1.5, graph.n_layers + 0.5)
    ax.set_xlabel(
        "position (token and index)" if every_position else "positions with a kept edge (token, index)",
        fontsize=9,
    )
    ax.set_title(title or "attribution graph (pruned)", fontsize=11)
    handles, names = ax.get_legend_handles_labels()
    handles += [Line2D([], [], color="tab:blue", lw=2), Line2D([], [], color="tab:red", lw=2)]
    names += ["positive edge", "negative edge"]
    fig.legend(handles, names, loc="outside lower center", ncols=3, fontsize=9, frameon=False)
    _label_edges(fig, ax, layout, edges, labels or {}, max_labels)
    return fig


def _label_edges(fig: Figure, ax, layout: dict, edges: list, labels: dict, max_labels: int) -> None:
    """Name the strongest labelled edges, each at the first point along it (from the middle out) where its text
    overlaps no other label and no node; an edge with no such point stays unnamed."""
    strongest = sorted(((abs(w), t, s) for t, s, w in edges if (t, s) in labels), reverse=True)[:max_labels]
    if not strongest:
        return
    fig.canvas.draw()  # the constrained layout settles: the labels' extents are final from here
    renderer = fig.canvas.get_renderer()
    nodes = ax.transData.transform(list(layout.values()))
    frame = ax.get_window_extent(renderer)
    placed = []
    for _, t, s in strongest:
        (x0, y0), (x1, y1) = layout[s], layout[t]
        for f in (0.5, 0.4, 0.6, 0.3, 0.7, 0.2, 0.8, 0.12, 0.88):
            text = ax.text(
                x0 + f * (x1 - x0),
                y0 + f * (y1 - y0),
                labels[(t, s)],
                fontsize=9,
                ha="center",
                va="center",
                color="0.1",
                zorder=4,
                bbox=dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none", alpha=0.85),
            )
            text.set_in_layout(False)
            box = text.get_window_extent(renderer).expanded(1.05, 1.15)
            near_node = box.padded(4).count_contains(nodes) > 0
            inside = frame.contains(box.x0, box.y0) and frame.contains(box.x1, box.y1)
            if inside and not near_node and not any(box.overlaps(other) for other in placed):
                placed.append(box)
                break
            text.remove()


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
    for kind, colour in KIND_COLOURS.items():
        indices = [i for i in layout if graph.node(i)["kind"] == kind]
        activations = [graph.activation_values[i].item() if i < graph.n_features else 0.0 for i in indices]
        hover = [
            f"{node_label(graph, i)}<br>activation {a:.4g}<br>input {graph.node_inputs[i].item():.4g}"
            for i, a in zip(indices, activations, strict=True)
        ]
        fig.add_trace(
            go.Scatter(
                x=[layout[i][0] for i in indices],
                y=[layout[i][1] for i in indices],
                mode="markers",
                marker=dict(size=9, color=colour),
                hoverinfo="text",
                text=hover,
                name=KIND_NAMES[kind],
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
