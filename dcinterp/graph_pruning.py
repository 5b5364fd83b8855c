"""Pruning an attribution graph and scoring it: circuit-tracer 0.5's definitions (its `graph.py`), on the node order
of `dcinterp.attribution_graph`.

The influence of a node on the logits is the logit-probability-weighted sum over the paths from it, in the graph's
adjacency matrix with each row's absolute values normalised to sum to 1 (`normalize_matrix`, `compute_influence`).
`prune_graph` keeps the nodes, then the edges, that carry a share of that influence; `graph_scores` gives the
replacement score (the share of the tokens' and errors' influence that is the tokens') and the completeness score
(the influence-weighted share of each node's incoming edges that comes from non-error nodes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .attribution_graph import AttributionGraph


def normalize_matrix(matrix: Tensor) -> Tensor:
    """|A| with each row summing to 1 (rows of zeros stay zero).

    Args:
        matrix: an adjacency matrix [n_nodes, n_nodes].

    Returns:
        Its absolute values, each row divided by its sum.
    """
    normalized = matrix.abs()
    return normalized / normalized.sum(dim=1, keepdim=True).clamp(min=1e-10)


def compute_influence(A: Tensor, logit_weights: Tensor, max_iter: int = 1000) -> Tensor:
    """logit_weights (A + A^2 + ...), summed until the product vanishes (A of a graph is nilpotent).

    Args:
        A: a normalised adjacency matrix [n_nodes, n_nodes] (`normalize_matrix`).
        logit_weights: [n_nodes], the weight of each logit node (`logit_weights`).
        max_iter: the most products taken.

    Returns:
        Each node's influence on the logits [n_nodes].

    Raises:
        RuntimeError: no convergence in max_iter products.
    """
    current = logit_weights @ A
    influence = current
    for _ in range(max_iter):
        if not current.any():
            return influence
        current = current @ A
        influence = influence + current
    raise RuntimeError(f"influence: no convergence after {max_iter} iterations")


def find_threshold(scores: Tensor, threshold: float) -> Tensor:
    """The score above which the largest scores keep `threshold` of their total.

    Args:
        scores: non-negative scores, any shape flattened to one axis.
        threshold: the share of their total kept, between 0 and 1.

    Returns:
        The smallest score kept (a 0-d tensor).
    """
    sorted_scores = scores.sort(descending=True).values
    cumulative = sorted_scores.cumsum(0) / sorted_scores.sum()
    index = min(
        int(torch.searchsorted(cumulative, torch.tensor(threshold, dtype=cumulative.dtype))), len(cumulative) - 1
    )
    return sorted_scores[index]


def logit_weights(graph: AttributionGraph) -> Tensor:
    """The logits' probabilities at the logit nodes, 0 elsewhere.

    Args:
        graph: the graph.

    Returns:
        [n_nodes], in the adjacency matrix's dtype.
    """
    weights = torch.zeros(graph.adjacency_matrix.shape[0], dtype=graph.adjacency_matrix.dtype)
    weights[graph.logit_index(0) :] = graph.logit_probabilities.to(weights.dtype)
    return weights


def prune_graph(graph: AttributionGraph, node_threshold: float = 0.8, edge_threshold: float = 0.98):
    """Keep the nodes that carry `node_threshold` of the influence on the logits, then the edges that carry
    `edge_threshold` of it, then drop features and errors left without outgoing edges and features without
    incoming ones, until nothing changes (circuit-tracer's `prune_graph`).

    Args:
        graph: the graph.
        node_threshold: fraction of node influence kept.
        edge_threshold: fraction of edge influence kept.

    Returns:
        (node_mask [n_nodes], edge_mask [n_nodes, n_nodes], cumulative_scores [n_nodes]).

    Raises:
        ValueError: a threshold outside [0, 1].
    """
    for name, value in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"prune_graph: {name} must be between 0 and 1, not {value}")
    A, weights = graph.adjacency_matrix, logit_weights(graph)
    tail = graph.n_logits + graph.n_pos  # tokens and logits, always kept
    node_influence = compute_influence(normalize_matrix(A), weights)
    node_mask = node_influence >= find_threshold(node_influence, node_threshold)
    node_mask[-tail:] = True
    pruned = A.clone()
    pruned[~node_mask] = 0
    pruned[:, ~node_mask] = 0
    normalized = normalize_matrix(pruned)
    edge_scores = normalized * (compute_influence(normalized, weights) + weights)[:, None]
    edge_mask = edge_scores >= find_threshold(edge_scores.flatten(), edge_threshold)
    old = node_mask.clone()
    while True:
        node_mask[:-tail] &= edge_mask[:, :-tail].any(0)
        node_mask[: graph.n_features] &= edge_mask[: graph.n_features].any(1)
        if torch.equal(node_mask, old):
            break
        old = node_mask.clone()
        edge_mask[~node_mask] = False
        edge_mask[:, ~node_mask] = False
    sorted_scores, order = node_influence.sort(descending=True)
    cumulative = torch.zeros_like(node_influence)
    cumulative[order] = sorted_scores.cumsum(0) / sorted_scores.sum()
    return node_mask, edge_mask, cumulative


def graph_scores(graph: AttributionGraph) -> tuple[float, float]:
    """circuit-tracer's (replacement score, completeness score): the share of the tokens' and errors' influence on
    the logits that is the tokens', and the influence-weighted mean share of each node's incoming edge weight (in
    absolute value) that comes from non-error nodes.

    Args:
        graph: the graph.

    Returns:
        (replacement_score, completeness_score).
    """
    errors = slice(graph.error_index(0, 0), graph.token_index(0))
    tokens = slice(graph.token_index(0), graph.logit_index(0))
    weights = logit_weights(graph)
    normalized = normalize_matrix(graph.adjacency_matrix)
    influence = compute_influence(normalized, weights)
    token_influence, error_influence = influence[tokens].sum(), influence[errors].sum()
    replacement = token_influence / (token_influence + error_influence)
    non_error = 1 - normalized[:, errors].sum(-1)
    output_influence = influence + weights
    completeness = (non_error * output_influence).sum() / output_influence.sum()
    return replacement.item(), completeness.item()
