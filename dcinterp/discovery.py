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

**Edge patching** (`circuit_metric`): the model runs with every edge outside the circuit carrying its value on the
corrupted prompt. A receiver's input is the circuit run's residual stream less, for each cut sender, the
sender's output in the circuit run minus its output on the corrupted run. A cut compose edge replaces A_n in
that one term by the corrupted run's A_n, the dynamic weights being those of the circuit run. The full graph
gives the clean run and the empty graph the corrupted run, by construction. The run goes block by block through
the model's own modules (`ln1`, `attn` with split q/k/v inputs, `ln2`, `mlp`), with its hooks on the compose.

**Scores** (`edge_scores`): an edge's first-order effect on the metric when it is cut,
    residual: (out_s(corrupted) - out_s(clean)) . d metric / d input_r
    compose:  sum_{t,s} (A_n(corrupted) - A_n(clean)) W_b[n, m] d metric / d A'_m
EAP takes the gradient on the clean run (one forward on each prompt, one backward). EAP-IG averages it over
`n_steps` runs whose input embeddings go from the corrupted prompt's to the clean one's (alpha = k / n_steps,
k = 1..n_steps; for a compose edge the average is of W_b * gradient, both from the same run). The gradients flow
through activations only (zero offsets added at the receivers), so frozen weights are fine.

The metric is the logit difference logit(clean answer) - logit(corrupted answer) at the answer's position, or the
clean answer's log-probability, averaged over the contrast pairs. Faithfulness of a circuit is
(m(circuit) - m(corrupted)) / (m(clean) - m(corrupted)).
"""

from __future__ import annotations

import contextlib
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from . import distributed
from .attribution import answer_log_probs, answer_logits, final_normed
from .model import HookedDCFormer, at_least_float32, attention_mask, visible_keys
from .synth.contrast import PairTokens

STAGE_INPUT = {"pre": "scores", "post": "pattern"}  # what A_n is, by stage (the hook it is read from)
STAGE_OUTPUT = {"pre": "composed_scores", "post": "composed_pattern"}
COMPOSE_BRANCHES = ("qp", "kp", "qg", "kg", "skip")
METHODS = ("eap", "eap-ig")
MetricKind = Literal["logit_diff", "logprob"]
EDGE_COLUMNS = ["source", "target", "kind", "layer", "stage", "branch", "source_head", "target_head"]


# --------------------------------------------------------------------------------------------------
# The graph
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


# --------------------------------------------------------------------------------------------------
# The metric
@dataclass(frozen=True)
class Metric:
    """Per prompt: logit(clean answer) - logit(corrupted answer) or log p(clean answer), at the answer's position.

    Read from the residual stream entering the unembedding.

    Attributes:
        clean_answer: [batch].
        corrupt_answer: [batch].
        position: the answer's position [batch].
        kind: "logit_diff" or "logprob".
    """

    clean_answer: Int[Tensor, " batch"]
    corrupt_answer: Int[Tensor, " batch"]
    position: Int[Tensor, " batch"]
    kind: MetricKind = "logit_diff"

    def __call__(self, model: HookedDCFormer, final: Float[Tensor, "batch pos d"]) -> Float[Tensor, " batch"]:
        normed = final_normed(model, final, self.position)
        if self.kind == "logit_diff":
            return answer_logits(model, normed, self.clean_answer) - answer_logits(model, normed, self.corrupt_answer)
        logprobs = answer_log_probs(model, normed)
        return logprobs.gather(-1, self.clean_answer.to(logprobs.device)[:, None])[:, 0]

    def rows(self, index) -> "Metric":
        """The metric of some prompts only.

        Args:
            index: selects prompts, as a tensor index.

        Returns:
            A Metric of those rows.
        """
        return Metric(self.clean_answer[index], self.corrupt_answer[index], self.position[index], self.kind)

    def repeat(self, k: int) -> "Metric":
        """The metric of the prompts repeated `k` times, as `Tensor.repeat` repeats a batch.

        Args:
            k: how many times.

        Returns:
            A Metric of k * batch rows.
        """
        return Metric(self.clean_answer.repeat(k), self.corrupt_answer.repeat(k), self.position.repeat(k), self.kind)


# --------------------------------------------------------------------------------------------------
# One run through the graph
@dataclass
class Run:
    """What one pass through the graph computed (all detached), and the receivers' gradient offsets.

    Attributes:
        final: the logits receiver's input [batch, pos, d_model].
        outputs: each sender's output [sender, batch, pos, d_model].
        stage_inputs: (layer, stage) -> A [batch, head, query, key].
        weights: (layer, stage) -> {qw1, qw2, kw1, kw2, qg, kg}.
        offsets: edge-group key or (stage, layer) -> a zero offset with a gradient.
        resid_in: gradient runs: layer -> the stream entering the block.
    """

    final: Tensor
    outputs: Tensor
    stage_inputs: dict = field(default_factory=dict)
    weights: dict = field(default_factory=dict)
    offsets: dict = field(default_factory=dict)
    resid_in: dict = field(default_factory=dict)


@contextlib.contextmanager
def _attn_result(model: HookedDCFormer):
    before = model.cfg.use_attn_result
    model.cfg.use_attn_result = True
    try:
        yield
    finally:
        model.cfg.use_attn_result = before


def compose_correction(D: Float[Tensor, "b n t s"], weights: dict, cut: dict[str, Tensor]) -> Tensor:
    """What the cut compose edges of one stage take off A'.

    The sum over cut (n, m, branch) of D_n * W_branch[n, m], with D = A(circuit run) - A(corrupted run) and the
    dynamic weights those of the circuit run.

    Args:
        D: A(circuit run) - A(corrupted run) [b, n, t, s].
        weights: the circuit run's dynamic weights of the stage.
        cut: the cut edges' mask of each branch.

    Returns:
        The correction [b, n, t, s].
    """
    out = torch.zeros_like(D)
    if "qp" in cut and cut["qp"].any():
        W = torch.einsum("btrn,btrm->btnm", weights["qw1"], weights["qw2"]) * cut["qp"]
        out = out + torch.einsum("bnts,btnm->bmts", D, W)
    if "kp" in cut and cut["kp"].any():
        W = torch.einsum("bsrn,bsrm->bsnm", weights["kw1"], weights["kw2"]) * cut["kp"]
        out = out + torch.einsum("bnts,bsnm->bmts", D, W)
    if "qg" in cut and cut["qg"].any():
        out = out + D * (weights["qg"] * cut["qg"]).transpose(1, 2)[:, :, :, None]
    if "kg" in cut and cut["kg"].any():
        out = out + D * (weights["kg"] * cut["kg"]).transpose(1, 2)[:, :, None, :]
    if "skip" in cut and cut["skip"].any():
        out = out + D * cut["skip"][None, :, None, None]
    return out


def graph_forward(
    model: HookedDCFormer,
    graph: Graph,
    tokens: Int[Tensor, "batch pos"],
    circuit: Bool[Tensor, " edge"] | None = None,
    corrupted: Run | None = None,
    embed: Float[Tensor, "batch pos d"] | None = None,
    track_grad: bool = False,
) -> Run:
    """One forward through the graph: the clean run, or the circuit run with the edges outside it corrupted.

    Args:
        model: the model.
        graph: its graph.
        tokens: the prompts [batch, pos].
        circuit: a bool [edge] mask (None: the clean run).
        corrupted: the corrupted run, whose values the edges outside `circuit` carry.
        embed: replaces the input embeddings [batch, pos, d] (EAP-IG's interpolation).
        track_grad: add a zero offset with a gradient at every receiver and composed stage output.

    Returns:
        What the pass computed.
    """
    cfg = model.cfg
    H = cfg.n_heads
    cuts = None
    if circuit is not None and not bool(circuit.all()):
        if corrupted is None:
            raise ValueError("graph_forward: a circuit with cut edges needs the corrupted run")
        if track_grad:
            raise ValueError("graph_forward: track_grad is for runs of the full graph (clean or interpolated inputs)")
        cuts = {
            key: part.to(model.cfg.dtype) for key, part in graph.split((~circuit.bool()).to(model.input_device)).items()
        }
    tokens = tokens.to(model.input_device)
    resid = model.hook_embed(model.embed(tokens)) if embed is None else embed
    b, p, d = resid.shape
    outputs = resid.new_zeros((len(graph.senders), b, p, d))
    outputs[0] = resid.detach()
    diff = outputs - corrupted.outputs if cuts is not None else None  # filled in as senders are computed
    run = Run(final=resid, outputs=outputs)

    def receive(key, base: Tensor, n_senders: int, per_head: bool) -> Tensor:
        x = base[:, :, None].expand(b, p, H, d) if per_head else base
        if cuts is not None and cuts[key].any():
            spec = "sbpd,sh->bphd" if per_head else "sbpd,s->bpd"
            x = x - torch.einsum(spec, diff[:n_senders], cuts[key])
        if track_grad:
            run.offsets[key] = torch.zeros(x.shape, dtype=x.dtype, device=x.device, requires_grad=True)
            x = x + run.offsets[key]
        return x

    hooks, results = [], {}
    for layer, block in enumerate(model.blocks):
        attn = f"blocks.{layer}.attn"
        hooks.append((f"{attn}.hook_result", _store(results, layer)))
        if track_grad:  # q, k, v receivers: gradients at q, k, v, taken back to the stream after the backward pass
            hooks += [(f"{attn}.hook_{part}", _offset_hook(run, (f"hook_{part}", layer))) for part in ("q", "k", "v")]
        if not graph.dcmha:
            continue
        hidden = visible_keys(p, block.attn.window, resid.device, cfg.window).logical_not()
        for stage in graph.stages:
            run.weights[(layer, stage)] = {}
            for name in ("qw1", "qw2", "kw1", "kw2", "qg", "kg"):
                hooks.append((f"{attn}.{stage}_compose.hook_{name}", _store(run.weights[(layer, stage)], name)))
            hooks.append(
                (
                    f"{attn}.hook_{'attn_scores' if stage == 'pre' else 'pattern'}",
                    _store_stage_input(run.stage_inputs, (layer, stage), hidden),
                )
            )
            cut = None if cuts is None else {branch: cuts[(stage, layer, branch)] for branch in graph.branches}
            hooks.append(
                (
                    f"{attn}.hook_{STAGE_OUTPUT[stage]}",
                    _compose_output_hook(run, layer, stage, cut, corrupted, track_grad),
                )
            )

    masks = {}
    with _attn_result(model), model.hooks(fwd_hooks=hooks):
        for layer, block in enumerate(model.blocks):
            S = graph.senders_before(layer)
            window = block.attn.window
            if window not in masks:
                masks[window] = attention_mask(p, window, resid.device, resid.dtype, semantics=cfg.window)
            if track_grad:
                # No per-head copies of the stream (3 x heads x d_model per position, kept for the backward pass):
                # one normed input with a zero offset; `_attention_receiver_grads` splits its gradient afterwards.
                run.resid_in[layer] = resid.detach()
                run.offsets[("x", layer)] = torch.zeros(
                    (b, p, d), dtype=resid.dtype, device=resid.device, requires_grad=True
                )
                attn_out = block.attn(block.ln1(resid) + run.offsets[("x", layer)], masks[window])
            else:
                q_in, k_in, v_in = (receive((part, layer), resid, S, True) for part in ("q", "k", "v"))
                x = receive(("compose", layer), resid, S, False) if graph.dcmha else resid
                qkv = tuple(block.ln1(part) for part in (q_in, k_in, v_in))
                attn_out = block.attn(block.ln1(x), masks[window], qkv)
            head_out = results.pop(layer).detach()  # [b, p, H, d]
            outputs[S : S + H] = head_out.permute(2, 0, 1, 3)
            if diff is not None:
                diff[S : S + H] = outputs[S : S + H] - corrupted.outputs[S : S + H]
            mlp_base = resid if cfg.parallel_residual else resid + attn_out
            mlp_out = block.mlp(block.ln2(receive(("mlp", layer), mlp_base, graph.mlp_senders(layer), False)))
            outputs[S + H] = mlp_out.detach()
            if diff is not None:
                diff[S + H] = outputs[S + H] - corrupted.outputs[S + H]
            resid = resid + attn_out + mlp_out if cfg.parallel_residual else mlp_base + mlp_out
        run.final = receive(("logits",), resid, len(graph.senders), False)
    return run


def _store(into: dict, key):
    def hook(x: Tensor, hook) -> Tensor:
        into[key] = x.detach()
        return x

    return hook


def _offset_hook(run: Run, key):
    def hook(x: Tensor, hook) -> Tensor:
        run.offsets[key] = torch.zeros_like(x, requires_grad=True)
        return x + run.offsets[key]

    return hook


def _attention_receiver_grads(model: HookedDCFormer, graph: Graph, run: Run, grads: dict, layer: int) -> dict:
    """Per head, d metric / d (the stream entering its q, k and v), and d metric / d (the stream entering the compose
    weight generator), [rows, pos, head, d_model] and [rows, pos, d_model], from the gradients of a run without
    per-head copies: at q, k, v (`hook_q`, ...), taken back through QK-norm and W_Q, W_K, W_V to the normed input,
    and at the normed input itself (all readers together; the compose generator's part is what q, k, v leave).
    Each part then goes back through ln1 at the block's input, as if each head had its own copy of the stream."""
    block = model.blocks[layer]
    attn, H = block.attn, model.cfg.n_heads
    resid = run.resid_in[layer]
    with torch.no_grad():
        normed = block.ln1(resid)
    parts = []
    for part, W, bias in (("q", attn.W_Q, attn.b_Q), ("k", attn.W_K, attn.b_K), ("v", attn.W_V, attn.b_V)):
        g = grads[(f"hook_{part}", layer)]
        if part != "v" and model.cfg.use_qk_norm:
            linear = torch.einsum("bpd,hde->bphe", normed, W)
            linear = (linear + bias if bias is not None else linear).detach().requires_grad_(True)
            with torch.enable_grad():
                g = torch.autograd.grad((attn.q_norm if part == "q" else attn.k_norm)(linear), linear, g)[0]
        parts.append(torch.einsum("bphe,hde->bphd", g, W))
    cotangent = torch.cat(parts, dim=2)  # [rows, pos, 3 * head, d_model], normed space
    if graph.dcmha:
        cotangent = torch.cat([cotangent, (grads[("x", layer)] - cotangent.sum(2))[:, :, None]], dim=2)
    copies = resid[:, :, None].expand(-1, -1, cotangent.shape[2], -1).clone().requires_grad_(True)
    with torch.enable_grad():
        g = torch.autograd.grad(block.ln1(copies), copies, cotangent)[0]
    out = {"q": g[:, :, :H], "k": g[:, :, H : 2 * H], "v": g[:, :, 2 * H : 3 * H]}
    if graph.dcmha:
        out["compose"] = g[:, :, 3 * H]
    return out


def _store_stage_input(into: dict, key, hidden: Tensor):
    def hook(x: Tensor, hook) -> Tensor:
        # hook_attn_scores holds the dtype's minimum at hidden keys; the compose reads 0 there
        into[key] = x.detach().masked_fill(hidden, 0.0)
        return x

    return hook


def _compose_output_hook(run: Run, layer: int, stage: str, cut: dict | None, corrupted: Run | None, track_grad: bool):
    def hook(x: Tensor, hook) -> Tensor:
        if cut is not None and any(bool(c.any()) for c in cut.values()):
            D = run.stage_inputs[(layer, stage)] - corrupted.stage_inputs[(layer, stage)]
            x = x - compose_correction(D, run.weights[(layer, stage)], cut).to(x.dtype)
        if track_grad:
            run.offsets[(stage, layer)] = torch.zeros_like(x, requires_grad=True)
            x = x + run.offsets[(stage, layer)]
        return x

    return hook


# --------------------------------------------------------------------------------------------------
# Exact evaluation
def _pairs_on(model: HookedDCFormer, pairs: PairTokens, metric: MetricKind) -> tuple[Tensor, Tensor, Metric]:
    device = model.input_device
    clean, corrupt = pairs.clean.to(device), pairs.corrupt.to(device)
    if clean.shape != corrupt.shape:
        raise ValueError(
            f"pairs: clean tokens {tuple(clean.shape)} and corrupted {tuple(corrupt.shape)} differ in shape"
        )
    if metric not in ("logit_diff", "logprob"):
        raise ValueError(f"metric must be 'logit_diff' or 'logprob', not {metric!r}")
    return (
        clean,
        corrupt,
        Metric(pairs.clean_answer.to(device), pairs.corrupt_answer.to(device), pairs.position.to(device), metric),
    )


def _batches(n: int, batch_size: int | None) -> list[slice]:
    size = n if batch_size is None else batch_size
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


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
        self.clean, self.corrupt, self._metric = _pairs_on(self.model, self.pairs, self.metric)
        self.batches = _batches(self.clean.shape[0], self.batch_size)
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
# Scores
def _accumulate_scores(
    model: HookedDCFormer, graph: Graph, scores: dict, run: Run, grads: dict, delta: Tensor, delta_A: dict
) -> None:
    """Add each edge's (corrupted - clean value) . gradient from one backward pass (summed over its rows)."""
    attention = {}
    for group in graph.groups:
        key = group.key
        if key[0] in ("q", "k", "v", "compose"):
            if key[1] not in attention:
                attention[key[1]] = _attention_receiver_grads(model, graph, run, grads, key[1])
            g = attention[key[1]][key[0]]
        elif key[0] in ("mlp", "logits"):
            g = grads[key]
        else:
            continue
        spec = "sbpd,bphd->sh" if key[0] in ("q", "k", "v") else "sbpd,bpd->s"
        scores[key] += torch.einsum(spec, delta[: group.shape[0]], _fold(g, delta.shape[1]))
    for (layer, stage), dA in delta_A.items():
        # with IG the rows hold several steps: W and G of each step go together, so the sum over rows comes last
        k = grads[(stage, layer)].shape[0] // dA.shape[0]
        G_full = at_least_float32(grads[(stage, layer)])
        dA_full = at_least_float32(dA.repeat(k, 1, 1, 1))
        W = run.weights[(layer, stage)]
        for branch in graph.branches:
            key = (stage, layer, branch)
            if branch == "qp":
                X = torch.einsum("bnts,bmts->btnm", dA_full, G_full)
                scores[key] += (X * at_least_float32(torch.einsum("btrn,btrm->btnm", W["qw1"], W["qw2"]))).sum((0, 1))
            elif branch == "kp":
                Y = torch.einsum("bnts,bmts->bsnm", dA_full, G_full)
                scores[key] += (Y * at_least_float32(torch.einsum("bsrn,bsrm->bsnm", W["kw1"], W["kw2"]))).sum((0, 1))
            elif branch == "qg":
                scores[key] += (dA_full * G_full * at_least_float32(W["qg"]).transpose(1, 2)[:, :, :, None]).sum(
                    (0, 2, 3)
                )
            elif branch == "kg":
                scores[key] += (dA_full * G_full * at_least_float32(W["kg"]).transpose(1, 2)[:, :, None, :]).sum(
                    (0, 2, 3)
                )
            else:
                scores[key] += (dA_full * G_full).sum((0, 2, 3))


def _fold(x: Tensor, batch: int) -> Tensor:
    """Rows [steps * batch, ...] summed over the steps: [batch, ...]."""
    return at_least_float32(x).reshape(-1, batch, *x.shape[1:]).sum(0)


def edge_scores(
    model: HookedDCFormer,
    pairs: PairTokens,
    method: Literal["eap", "eap-ig"] = "eap-ig",
    n_steps: int = 5,
    metric: MetricKind = "logit_diff",
    batch_size: int | None = 8,
    ig_batch_size: int | None = None,
    graph: Graph | None = None,
) -> Float[Tensor, " edge"]:
    """Each edge's estimated change of the mean metric when it alone is cut (corrupted), in `graph.edges` order.

    Args:
        model: the model.
        pairs: the tokenized contrast pairs.
        method: "eap" (gradient on the clean run) or "eap-ig" (gradient averaged over `n_steps` runs whose input
            embeddings go from the corrupted prompt's to the clean one's).
        n_steps: EAP-IG's steps (Hanna et al. 2024 use 5).
        metric: "logit_diff" or "logprob".
        batch_size: pairs per pass (None: all).
        ig_batch_size: IG steps per pass (rows = batch_size * ig_batch_size; None: all `n_steps` at once), which
            bounds the memory as `attribution.head_attribution` does.
        graph: the model's graph (None: built).

    Returns:
        One score per edge [edge].

    Raises:
        ValueError: a bad argument, named.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, not {method!r}")
    if n_steps < 1:
        raise ValueError(f"n_steps must be positive, not {n_steps}")
    graph = graph or build_graph(model)
    clean, corrupt, full_metric = _pairs_on(model, pairs, metric)
    n = clean.shape[0]
    batches = _batches(n, batch_size)
    partials = {}  # batch -> its pairs' share of every edge's score
    for i in distributed.my_batches(len(batches)):
        index = batches[i]
        scores = {g.key: torch.zeros(g.shape, device=model.input_device) for g in graph.groups}
        with torch.no_grad():
            corrupted = graph_forward(model, graph, corrupt[index])
            clean_run = graph_forward(model, graph, clean[index])
        delta = at_least_float32(corrupted.outputs - clean_run.outputs)
        delta_A = {
            key: at_least_float32(corrupted.stage_inputs[key] - clean_run.stage_inputs[key])
            for key in clean_run.stage_inputs
        }
        rows_metric = full_metric.rows(index)
        if method == "eap":
            alphas = [1.0]
        else:
            alphas = [(k + 1) / n_steps for k in range(n_steps)]
        chunk = len(alphas) if ig_batch_size is None else ig_batch_size
        embed_clean, embed_corrupt = clean_run.outputs[0], corrupted.outputs[0]
        for start in range(0, len(alphas), chunk):
            steps = torch.tensor(alphas[start : start + chunk], device=embed_clean.device, dtype=embed_clean.dtype)
            k = len(steps)
            embed = embed_corrupt[None] + steps[:, None, None, None] * (embed_clean - embed_corrupt)[None]
            embed = embed.reshape(-1, *embed_clean.shape[1:])
            tokens = clean[index].repeat(k, 1)
            with torch.enable_grad():
                run = graph_forward(model, graph, tokens, embed=embed, track_grad=True)
                value = rows_metric.repeat(k)(model, run.final).sum() / (n * len(alphas))
                keys = list(run.offsets)
                grads = dict(
                    zip(
                        keys,
                        torch.autograd.grad(value, [run.offsets[key] for key in keys], allow_unused=True),
                        strict=True,
                    )
                )
            grads = {key: torch.zeros_like(run.offsets[key]) if g is None else g.detach() for key, g in grads.items()}
            _accumulate_scores(model, graph, scores, run, grads, delta, delta_A)
            del run, grads
        partials[i] = graph.flatten(scores).cpu()
    # Every batch's part added in batch order, whichever process computed it: one process's sum, bit for bit.
    return distributed.sum_in_order(partials, len(batches), torch.zeros(len(graph)))


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
