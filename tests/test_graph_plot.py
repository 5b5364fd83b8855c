"""A pruned attribution graph drawn (dcinterp.plotting.graph): every kept node placed in its position's column and its
layer's row, attention edges labelled with their largest part, and an interactive page that needs no network."""

import re

import pytest

from dcinterp import HookedDCFormer
from dcinterp.attribution_graph import attribution_graph, edge_labels, edge_parts, prune_graph
from dcinterp.plotting.graph import KIND_NAMES, node_layout, plot_attribution_graph, shown_positions, write_graph_html
from dcinterp.transcoders import random_transcoders
from tests.test_graph import PROMPT


@pytest.fixture(scope="module")
def drawn():
    model = HookedDCFormer.from_pretrained("dcpythia-synth").eval().requires_grad_(False)
    transcoders = random_transcoders(model, 64, seed=3)
    tokens = model.to_tokens(PROMPT, prepend_bos=False)[0]
    graph = attribution_graph(model, transcoders, tokens)
    node_mask, edge_mask, _ = prune_graph(graph)
    return model, transcoders, graph, node_mask, edge_mask, model.to_str_tokens(tokens)


def test_layout_puts_nodes_in_their_cells(drawn):
    _, _, graph, node_mask, _, _ = drawn
    layout = node_layout(graph, node_mask)
    assert set(layout) == set(node_mask.nonzero().flatten().tolist())
    for index, (x, y) in layout.items():
        node = graph.node(index)
        assert abs(x - node["pos"]) < 0.5
        assert y == {"token": -1, "logit": graph.n_layers}.get(node["kind"], node["layer"])


def test_edge_labels_name_the_largest_part(drawn):
    model, transcoders, graph, _, edge_mask, _ = drawn
    labels = edge_labels(model, transcoders, graph, edge_mask)
    assert labels
    (target, source), label = max(labels.items(), key=lambda item: abs(graph.adjacency_matrix[item[0]].item()))
    assert graph.node(target)["pos"] != graph.node(source)["pos"]
    parts = edge_parts(model, transcoders, graph, target, source)
    top = parts[parts.branch != "residual"].value.abs().idxmax()
    layer, head, source_head, branch = parts.loc[top, ["layer", "head", "source_head", "branch"]]
    assert label.startswith(f"L{layer} H{head}<-H{source_head} {branch} (")
    assert all(graph.node(t)["pos"] != graph.node(s)["pos"] for t, s in labels)


def test_figure_and_page(drawn, tmp_path):
    model, transcoders, graph, node_mask, edge_mask, tokens = drawn
    labels = edge_labels(model, transcoders, graph, edge_mask)
    fig = plot_attribution_graph(graph, node_mask, edge_mask, tokens, labels, title="lookup")
    (ax,) = fig.axes
    positions = shown_positions(graph, node_mask, edge_mask)  # every kept edge's two ends, and no token left alone
    ends = {graph.node(i)["pos"] for i in edge_mask.nonzero().flatten().tolist()}
    assert ends <= set(positions) < set(range(graph.n_pos))
    shown = [t.get_text() for t in ax.get_xticklabels()]
    assert shown == [f"{tokens[pos].replace(chr(10), chr(92) + 'n')} ({pos})" for pos in positions]
    assert len(ax.lines) == int(edge_mask.sum())
    kinds = {graph.node(i)["kind"] for i in node_mask.nonzero().flatten().tolist()}
    (legend,) = fig.legends  # every kind of node drawn is named
    assert {KIND_NAMES[kind] for kind in kinds} <= {text.get_text() for text in legend.get_texts()}
    renderer = fig.canvas.get_renderer()
    boxes = [text.get_window_extent(renderer) for text in ax.texts]  # the edge labels: as many as fit, none hidden
    assert 0 < len(boxes) <= 8 and {text.get_text() for text in ax.texts} <= set(labels.values())
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])
    every = plot_attribution_graph(graph, node_mask, edge_mask, tokens, labels, every_position=True)
    assert len(every.axes[0].get_xticklabels()) == graph.n_pos
    page = write_graph_html(
        graph, node_mask, edge_mask, tmp_path / "graph.html", tokens, labels, title="lookup"
    ).read_text()
    assert "<title>lookup</title>" in page
    assert not re.search(r"<script[^>]+src=", page)  # plotly.js inlined: the page opens offline
