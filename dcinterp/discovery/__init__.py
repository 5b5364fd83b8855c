"""Edge-level circuit discovery in DCFormer: EAP and EAP-IG on a graph whose heads also talk inside a layer.

The graph (as in EAP, Syed et al. 2023, and EAP-IG, Hanna et al. 2024) has *senders*, whose outputs add into the
residual stream, and *receivers*, which read it:
    senders    embed, each head's output L{l}H{h} (its `hook_result`), each MLP's output MLP{l}
    receivers  each head's q, k and v input (L{l}H{h}.q/.k/.v), each MLP's input MLP{l}, the logits, and in a
               DCMHA layer the compose dynamic-weight generator L{l}.compose (which reads the normed residual at
               the query, for qw1, qw2, qg, and at the key, for kw1, kw2, kg, apart from Q, K and V)
A *residual edge* joins a sender to a receiver downstream of it (parallel blocks: an MLP reads the stream
entering its block; sequential blocks: also its own layer's heads). DCMHA adds *compose edges* inside a layer,
one per (layer, stage, branch, source head n, target head m): the term head n's stage input A_n (the scores
before pre-compose, the probabilities before post-compose) adds to head m's composed A'_m (Eqs. 7-8):

    A'_m = sum_n A_n * (W_qp[t, n, m] + W_kp[s, n, m]) + A_m * (qg[t, m] + kg[s, m] + 1)
           with W_qp[t] = qw1[t]^T qw2[t] (query-wise), W_kp[s] = kw1[s]^T kw2[s] (key-wise)

so branches `qp`, `kp` give H x H edges, the gates `qg`, `kg` and the `skip` connection H diagonal ones.
A plain-MHA model gets the same graph without compose edges and compose nodes.

**Edge patching** (`circuit_metric`, `forward`): the model runs with every edge outside the circuit carrying its
value on the corrupted prompt; the full graph gives the clean run and the empty graph the corrupted run.

**Scores** (`edge_scores`, `scores`): an edge's first-order effect on the metric when it is cut, EAP's gradient on
the clean run or EAP-IG's averaged over inputs from the corrupted prompt's embeddings to the clean one's.

The metric is the logit difference logit(clean answer) - logit(corrupted answer) at the answer's position, or the
clean answer's log-probability, averaged over the contrast pairs. Faithfulness of a circuit is
(m(circuit) - m(corrupted)) / (m(clean) - m(corrupted)).

One module per part, every name importable from `dcinterp.discovery`:

    graph      Edge, EdgeGroup, Graph, build_graph        the senders, receivers and edges, in one flat order
    forward    Metric, Run, graph_forward,                one run through the graph: clean, or a circuit's with the
               compose_correction                         edges outside it corrupted
    scores     edge_scores                                EAP and EAP-IG edge scores
    circuits   CircuitEvaluator, circuit_metric,          exact metric and faithfulness of circuits, circuits from
               top_n_circuit, greedy_circuit,             scores, the faithfulness curve, the smallest faithful
               random_circuit, faithfulness_curve,        circuit, Spearman's rank correlation
               smallest_faithful_circuit, spearman
"""

from .circuits import (
    SELECTIONS,
    CircuitEvaluator,
    circuit_metric,
    default_counts,
    faithfulness_curve,
    greedy_circuit,
    random_circuit,
    smallest_faithful_circuit,
    spearman,
    top_n_circuit,
)
from .forward import Metric, MetricKind, Run, compose_correction, graph_forward
from .graph import COMPOSE_BRANCHES, EDGE_COLUMNS, STAGE_INPUT, STAGE_OUTPUT, Edge, EdgeGroup, Graph, build_graph
from .scores import METHODS, edge_scores

__all__ = [
    "COMPOSE_BRANCHES",
    "EDGE_COLUMNS",
    "METHODS",
    "SELECTIONS",
    "STAGE_INPUT",
    "STAGE_OUTPUT",
    "CircuitEvaluator",
    "Edge",
    "EdgeGroup",
    "Graph",
    "Metric",
    "MetricKind",
    "Run",
    "build_graph",
    "circuit_metric",
    "compose_correction",
    "default_counts",
    "edge_scores",
    "faithfulness_curve",
    "graph_forward",
    "greedy_circuit",
    "random_circuit",
    "smallest_faithful_circuit",
    "spearman",
    "top_n_circuit",
]
