"""The graph of a model's components: senders, receivers, residual and compose edges, in one flat order.

Senders (embed, each head's output, each MLP's output) add into the residual stream; receivers (each head's q, k, v
input, each MLP's input, the logits, and a DCMHA layer's compose weight generator) read it. A residual edge joins a
sender to a receiver downstream of it; a compose edge joins head n's stage input A_n to head m's composed A'_m
through one branch (qp, kp, qg, kg, skip) of one stage (`dcinterp.discovery` draws the whole picture).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd
import torch
from torch import Tensor

from ..model import HookedDCFormer

STAGE_INPUT = {"pre": "scores", "post": "pattern"}  # what A_n is, by stage (the hook it is read from)
STAGE_OUTPUT = {"pre": "composed_scores", "post": "composed_pattern"}
COMPOSE_BRANCHES = ("qp", "kp", "qg", "kg", "skip")
EDGE_COLUMNS = ["source", "target", "kind", "layer", "stage", "branch", "source_head", "target_head"]


@dataclass(frozen=True)
class Edge:
    """One edge of the graph: a sender's output read by a receiver.

    Attributes:
        source: a node: embed, L1H2, MLP0; for a compose edge L1H2.scores or L1H2.pattern.
        target: a node: L2H0.q, L2.compose, MLP1, logits; for a compose edge L1H3.composed_scores (or _pattern).
        kind: "residual" or "compose".
        layer: the receiver's layer (n_layers for the logits).
        stage: a compose edge's stage, "pre" or "post".
        branch: a compose edge's branch.
        source_head: the sending head, if a head sends.
        target_head: the receiving head, if a head receives.
    """

    source: str
    target: str
    kind: str
    layer: int
    stage: str | None = None
    branch: str | None = None
    source_head: int | None = None
    target_head: int | None = None


@dataclass(frozen=True)
class EdgeGroup:
    """Edges stored as one tensor of `shape`, from `offset` in the flat edge order.

    Attributes:
        key: ("q" | "k" | "v", layer) [sender, head]; ("compose", layer) [sender]; ("mlp", layer) [sender];
            ("logits",) [sender]; (stage, layer, branch) [source head, target head] for qp/kp, [head] for
            qg/kg/skip.
        shape: the group's tensor shape.
        offset: where the group starts in the flat edge order.
    """

    key: tuple
    shape: tuple[int, ...]
    offset: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)


class Graph:
    """The edges of a model's computational graph, in one flat order (`edges`, `frame()`, masks, scores).

    Args:
        cfg: the model's config.
    """

    def __init__(self, cfg):
        self.cfg = cfg
        H, L = cfg.n_heads, cfg.n_layers
        self.dcmha = bool(cfg.use_dcmha)
        self.stages = [s for s in ("pre", "post") if s in cfg.compose_stages] if self.dcmha else []
        self.branches = [b for b in COMPOSE_BRANCHES if b == "skip" or b in cfg.active_branches]
        self.senders = ["embed"]
        for layer in range(L):
            self.senders += [f"L{layer}H{h}" for h in range(H)] + [f"MLP{layer}"]
        self.groups: list[EdgeGroup] = []
        self.edges: list[Edge] = []
        for layer in range(L):
            S = self.senders_before(layer)
            for part in ("q", "k", "v"):
                self._add(
                    (part, layer),
                    (S, H),
                    [
                        Edge(self.senders[s], f"L{layer}H{h}.{part}", "residual", layer, None, None, self._head(s), h)
                        for s in range(S)
                        for h in range(H)
                    ],
                )
            if self.dcmha:
                self._add(
                    ("compose", layer),
                    (S,),
                    [
                        Edge(self.senders[s], f"L{layer}.compose", "residual", layer, None, None, self._head(s))
                        for s in range(S)
                    ],
                )
                for stage in self.stages:
                    src, dst = STAGE_INPUT[stage], STAGE_OUTPUT[stage]
                    for branch in self.branches:
                        if branch in ("qp", "kp"):
                            pairs = [(n, m) for n in range(H) for m in range(H)]
                            shape = (H, H)
                        else:
                            pairs, shape = [(n, n) for n in range(H)], (H,)
                        self._add(
                            (stage, layer, branch),
                            shape,
                            [
                                Edge(
                                    f"L{layer}H{n}.{src}", f"L{layer}H{m}.{dst}", "compose", layer, stage, branch, n, m
                                )
                                for n, m in pairs
                            ],
                        )
            S_mlp = self.mlp_senders(layer)
            self._add(
                ("mlp", layer),
                (S_mlp,),
                [
                    Edge(self.senders[s], f"MLP{layer}", "residual", layer, None, None, self._head(s))
                    for s in range(S_mlp)
                ],
            )
        self._add(
            ("logits",),
            (len(self.senders),),
            [
                Edge(self.senders[s], "logits", "residual", L, None, None, self._head(s))
                for s in range(len(self.senders))
            ],
        )
        self.group = {g.key: g for g in self.groups}

    def _add(self, key, shape, edges) -> None:
        assert len(edges) == math.prod(shape)
        self.groups.append(EdgeGroup(key, shape, len(self.edges)))
        self.edges.extend(edges)

    def _head(self, sender: int) -> int | None:
        if sender == 0:
            return None
        index = (sender - 1) % (self.cfg.n_heads + 1)
        return None if index == self.cfg.n_heads else index

    def senders_before(self, layer: int) -> int:
        """How many senders write into the stream entering block `layer` (embed, then heads and MLP per layer).

        Args:
            layer: the block.

        Returns:
            The number of senders.
        """
        return 1 + layer * (self.cfg.n_heads + 1)

    def mlp_senders(self, layer: int) -> int:
        """Senders an MLP reads: those before its block, and in a sequential block its own layer's heads too.

        Args:
            layer: the MLP's block.

        Returns:
            The number of senders.
        """
        return self.senders_before(layer) + (0 if self.cfg.parallel_residual else self.cfg.n_heads)

    def __len__(self) -> int:
        return len(self.edges)

    def __repr__(self) -> str:
        counts = self.frame()["kind"].value_counts().to_dict()
        return (
            f"Graph({self.cfg.n_layers} layers x {self.cfg.n_heads} heads, {len(self.senders)} senders, "
            f"{len(self)} edges: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) + ")"
        )

    def split(self, flat: Tensor) -> dict[tuple, Tensor]:
        """A flat [edge] tensor as one tensor per edge group (views).

        Args:
            flat: one value per edge [edge].

        Returns:
            The group's tensor by group key.
        """
        return {g.key: flat[g.offset : g.offset + g.size].view(g.shape) for g in self.groups}

    def flatten(self, parts: dict[tuple, Tensor]) -> Tensor:
        """The inverse of `split`: one tensor per edge group as one flat [edge] tensor.

        Args:
            parts: the group's tensor by group key.

        Returns:
            [edge].
        """
        return torch.cat([parts[g.key].reshape(-1) for g in self.groups])

    def frame(self) -> pd.DataFrame:
        """One row per edge: source, target, kind, layer, stage, branch, source_head, target_head."""
        rows = [
            [e.source, e.target, e.kind, e.layer, e.stage, e.branch, e.source_head, e.target_head] for e in self.edges
        ]
        frame = pd.DataFrame(rows, columns=EDGE_COLUMNS)
        for column in ("source_head", "target_head"):
            frame[column] = frame[column].astype("Int64")
        return frame

    def counts(self) -> dict:
        """How many edges (residual, compose), senders and nodes the graph has."""
        kinds = pd.Series([e.kind for e in self.edges]).value_counts().to_dict()
        nodes = {e.source for e in self.edges} | {e.target for e in self.edges}
        return {
            "edges": len(self),
            "residual_edges": int(kinds.get("residual", 0)),
            "compose_edges": int(kinds.get("compose", 0)),
            "senders": len(self.senders),
            "nodes": len(nodes),
        }

    def to_networkx(self, circuit: Tensor | None = None, scores: Tensor | None = None):
        """The graph (or the edges of `circuit`) as a networkx MultiDiGraph, each edge with its attributes and `score`.

        The links inside a head or layer (q/k/v and the compose weights to the head's output) are edges of kind
        "internal". Needs networkx (`pip install networkx`).

        Args:
            circuit: a bool [edge] mask (None: every edge).
            scores: one score per edge [edge], set as each edge's `score`.

        Returns:
            A networkx MultiDiGraph.
        """
        import networkx as nx

        graph = nx.MultiDiGraph()
        chosen = range(len(self)) if circuit is None else torch.nonzero(torch.as_tensor(circuit))[:, 0].tolist()
        for i in chosen:
            edge = self.edges[i]
            attributes = {key: value for key, value in vars(edge).items() if key not in ("source", "target")}
            graph.add_edge(
                edge.source,
                edge.target,
                key=i,
                index=i,
                score=None if scores is None else float(scores[i]),
                **attributes,
            )
        for node in list(graph.nodes):
            todo = [node]
            while todo:
                current = todo.pop()
                for succ in self.implicit_successors(current):
                    if not graph.has_edge(current, succ, key="internal"):
                        graph.add_edge(current, succ, key="internal", kind="internal")
                        todo.append(succ)
        return graph

    # ---- connectivity: which nodes feed which inside a layer (not edges: they are never cut)
    def implicit_successors(self, node: str) -> list[str]:
        """The node(s) a node feeds inside its head or layer, without an edge in between.

        Args:
            node: a node's name.

        Returns:
            The names of the nodes it feeds.
        """
        if node.startswith("MLP") or node in ("logits", "embed"):
            return []
        if node.endswith(".compose"):
            layer = node.split(".")[0]
            return [f"{layer}H{m}.{STAGE_OUTPUT[s]}" for s in self.stages for m in range(self.cfg.n_heads)]
        head, _, part = node.partition(".")
        stages = self.stages
        if part in ("q", "k"):
            return [f"{head}.{STAGE_INPUT[stages[0]]}"] if stages else [head]
        if part == "v":
            return [head]
        if part == "composed_scores":
            return [f"{head}.pattern"] if "post" in stages else [head]
        if part == "composed_pattern":
            return [head]
        return []


def build_graph(model: HookedDCFormer) -> Graph:
    """The graph of a model's edges.

    Args:
        model: the model.

    Returns:
        Its `Graph`.
    """
    return Graph(model.cfg)
