"""Circuits: their exact metric and faithfulness (`CircuitEvaluator`), circuits chosen from edge scores (top n, greedy
from the logits, random), the faithfulness curve, the smallest faithful circuit, and Spearman's rank correlation.

Faithfulness of a circuit is (m(circuit) - m(corrupted)) / (m(clean) - m(corrupted)).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from .. import distributed
from ..model import HookedDCFormer
from ..synth.contrast import PairTokens
from .forward import MetricKind, batch_slices, graph_forward, pairs_on
from .graph import Graph, build_graph


# --------------------------------------------------------------------------------------------------
# Exact evaluation
@dataclass
class CircuitEvaluator:
    """Exact metric of circuits on a fixed set of pairs: the corrupted runs are computed once.

    `evaluator(circuit)` is the mean metric with the edges outside `circuit` (a bool [edge] mask) corrupted;
    `faithfulness(circuit)` is (m(circuit) - m(corrupted)) / (m(clean) - m(corrupted)).

    Under `torchrun` (an initialised torch.distributed group) each process keeps the corrupted runs of every
    world_size-th batch of pairs and computes only those; every call gathers each pair's metric and averages them as
    one process does, so every process returns what one process returns, bit for bit (`dcinterp.distributed`). Every
    process must then make the same calls, on the same pairs.

    Attributes:
        model: the model.
        graph: its graph.
        pairs: the tokenized contrast pairs.
        metric: "logit_diff" or "logprob".
        batch_size: pairs per pass (None: all at once).
    """

    model: HookedDCFormer
    graph: Graph
    pairs: PairTokens
    metric: MetricKind = "logit_diff"
    batch_size: int | None = None

    def __post_init__(self):
        self.clean, self.corrupt, self._metric = pairs_on(self.model, self.pairs, self.metric)
        self.batches = batch_slices(self.clean.shape[0], self.batch_size)
        self.mine = distributed.my_batches(len(self.batches))  # the batches this process computes
        with torch.no_grad():
            self.corrupted = {
                i: graph_forward(self.model, self.graph, self.corrupt[self.batches[i]]) for i in self.mine
            }
            self.m_corrupt = self._mean(
                {i: self._metric.rows(self.batches[i])(self.model, run.final) for i, run in self.corrupted.items()}
            )
            self.m_clean = self(torch.ones(len(self.graph), dtype=torch.bool))
        if abs(self.m_clean - self.m_corrupt) < 1e-6:
            raise ValueError(
                "pairs: the clean and corrupted prompts give the same mean metric "
                f"({self.m_clean:.4g}); there is nothing to restore"
            )

    def _mean(self, values: dict[int, Tensor]) -> float:
        """The mean over every pair of the per-pair values of each batch (gathered from every process)."""
        gathered = distributed.in_order(distributed.gather(distributed.to_cpu(values)), len(self.batches))
        return torch.cat([v.to(self.clean.device) for v in gathered]).mean().item()

    @torch.no_grad()
    def __call__(self, circuit: Bool[Tensor, " edge"]) -> float:
        circuit = torch.as_tensor(circuit, dtype=torch.bool)
        if circuit.shape != (len(self.graph),):
            raise ValueError(
                f"circuit: expected a bool mask of {len(self.graph)} edges, got shape {tuple(circuit.shape)}"
            )
        values = {}
        for i, corrupted in self.corrupted.items():
            run = graph_forward(self.model, self.graph, self.clean[self.batches[i]], circuit, corrupted)
            values[i] = self._metric.rows(self.batches[i])(self.model, run.final)
        return self._mean(values)

    def faithfulness(self, circuit: Bool[Tensor, " edge"]) -> float:
        """(m(circuit) - m(corrupted)) / (m(clean) - m(corrupted)).

        Args:
            circuit: a bool [edge] mask.

        Returns:
            The faithfulness.
        """
        return (self(circuit) - self.m_corrupt) / (self.m_clean - self.m_corrupt)

    def single_edge_effects(self, edges: Sequence[int]) -> list[float]:
        """Exact effect of cutting each edge alone: m(every edge but it) - m(clean).

        Args:
            edges: the edges' indices.

        Returns:
            One effect per edge.
        """
        effects = []
        for edge in edges:
            circuit = torch.ones(len(self.graph), dtype=torch.bool)
            circuit[edge] = False
            effects.append(self(circuit) - self.m_clean)
        return effects


def circuit_metric(
    model: HookedDCFormer,
    pairs: PairTokens,
    circuit: Bool[Tensor, " edge"],
    metric: MetricKind = "logit_diff",
    graph: Graph | None = None,
) -> float:
    """The mean metric over the pairs' clean prompts with every edge outside `circuit` carrying its corrupted value.

    Args:
        model: the model.
        pairs: the tokenized contrast pairs.
        circuit: a bool [edge] mask.
        metric: "logit_diff" or "logprob".
        graph: the model's graph (None: built).

    Returns:
        The mean metric.
    """
    graph = graph or build_graph(model)
    return CircuitEvaluator(model, graph, pairs, metric)(circuit)


# --------------------------------------------------------------------------------------------------
# Circuits from scores
def top_n_circuit(scores: Float[Tensor, " edge"], n: int) -> Bool[Tensor, " edge"]:
    """The n edges of largest |score|.

    Args:
        scores: [edge].
        n: how many edges.

    Returns:
        A bool [edge] mask.
    """
    circuit = torch.zeros(len(scores), dtype=torch.bool)
    circuit[scores.abs().argsort(descending=True, stable=True)[:n]] = True
    return circuit


def greedy_circuit(graph: Graph, scores: Float[Tensor, " edge"], n: int) -> Bool[Tensor, " edge"]:
    """n edges grown from the logits, each connected to the logits.

    At each step the edge of largest |score| among those whose target already reaches the logits through the
    circuit (through chosen edges, and inside a head or layer from q/k/v and the compose weights to the head's
    output).

    Args:
        graph: the graph.
        scores: [edge].
        n: how many edges.

    Returns:
        A bool [edge] mask.
    """
    preds: dict[str, list[str]] = {}
    nodes = {e.source for e in graph.edges} | {e.target for e in graph.edges}
    for node in nodes:
        for succ in graph.implicit_successors(node):
            preds.setdefault(succ, []).append(node)
    by_target: dict[str, list[int]] = {}
    for i, edge in enumerate(graph.edges):
        by_target.setdefault(edge.target, []).append(i)
    magnitude = scores.abs().tolist()
    alive, heap = set(), []

    def activate(node: str) -> None:
        todo = [node]
        while todo:
            current = todo.pop()
            if current in alive:
                continue
            alive.add(current)
            for i in by_target.get(current, []):
                heapq.heappush(heap, (-magnitude[i], i))
            todo.extend(preds.get(current, []))

    activate("logits")
    circuit = torch.zeros(len(graph), dtype=torch.bool)
    count = 0
    while heap and count < n:
        _, i = heapq.heappop(heap)
        if circuit[i]:
            continue
        circuit[i] = True
        count += 1
        activate(graph.edges[i].source)
    return circuit


def random_circuit(n_edges: int, n: int, generator: torch.Generator) -> Bool[Tensor, " edge"]:
    """n edges drawn at random.

    Args:
        n_edges: the graph's edges.
        n: how many edges.
        generator: draws them.

    Returns:
        A bool [edge] mask.
    """
    circuit = torch.zeros(n_edges, dtype=torch.bool)
    circuit[torch.randperm(n_edges, generator=generator)[:n]] = True
    return circuit


SELECTIONS = {"top-n": lambda graph, scores, n: top_n_circuit(scores, n), "greedy": greedy_circuit}


def default_counts(n_edges: int) -> list[int]:
    """0, 1, 2, 3, 5, 7, 10, 15, 20, 30, 50, 70, 100, ... up to the full graph.

    Args:
        n_edges: the graph's edges.

    Returns:
        The circuit sizes.
    """
    counts, scale = [0], 1
    while scale < n_edges:
        counts += [int(c * scale) for c in (1, 1.5, 2, 3, 5, 7) if c * scale < n_edges and c * scale == int(c * scale)]
        scale *= 10
    return counts + [n_edges]


def faithfulness_curve(
    evaluator: CircuitEvaluator,
    scores: dict[str, Tensor],
    counts: Sequence[int] | None = None,
    selections: Sequence[str] = ("top-n", "greedy"),
    random_repeats: int = 3,
    seed: int = 0,
) -> pd.DataFrame:
    """Exact faithfulness of circuits of `counts` edges chosen from each method's scores by each selection.

    Args:
        evaluator: computes the faithfulness.
        scores: one score per edge [edge], by method.
        counts: the circuit sizes (None: `default_counts`).
        selections: "top-n" and/or "greedy".
        random_repeats: random circuits per size, whose mean is the "random" row.
        seed: seeds the random circuits.

    Returns:
        Columns method, selection, edges, faithfulness.
    """
    graph = evaluator.graph
    counts = default_counts(len(graph)) if counts is None else sorted(set(counts))
    rows = []
    for method, method_scores in scores.items():
        for selection in selections:
            for n in counts:
                circuit = SELECTIONS[selection](graph, method_scores, n)
                rows.append((method, selection, int(circuit.sum()), evaluator.faithfulness(circuit)))
    generator = torch.Generator().manual_seed(seed)
    for n in counts:
        if random_repeats:
            values = [evaluator.faithfulness(random_circuit(len(graph), n, generator)) for _ in range(random_repeats)]
            rows.append(("random", "random", n, float(np.mean(values))))
    return pd.DataFrame(rows, columns=["method", "selection", "edges", "faithfulness"])


def smallest_faithful_circuit(
    evaluator: CircuitEvaluator, scores: Tensor, selection: str = "top-n", threshold: float = 0.8
) -> tuple[int, float]:
    """The smallest n whose circuit reaches `threshold` faithfulness, by bisection over n, with its faithfulness.

    Faithfulness is assumed to grow with n, as it nearly does for score-ranked circuits.

    Args:
        evaluator: computes the faithfulness.
        scores: one score per edge [edge].
        selection: "top-n" or "greedy".
        threshold: the faithfulness to reach.

    Returns:
        (n, its faithfulness).
    """
    graph = evaluator.graph
    low, high = 0, len(graph)  # f(low) < threshold <= f(high)

    def f(n: int) -> float:
        return evaluator.faithfulness(SELECTIONS[selection](graph, scores, n))

    best = f(high)
    while high - low > 1:
        middle = (low + high) // 2
        value = f(middle)
        if value >= threshold:
            high, best = middle, value
        else:
            low = middle
    return high, best


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (average ranks for ties).

    Args:
        a: one sequence.
        b: another, as long.

    Returns:
        The correlation.
    """
    a, b = pd.Series(list(a), dtype=float), pd.Series(list(b), dtype=float)
    if len(a) < 2:
        return float("nan")
    return float(a.rank().corr(b.rank()))
