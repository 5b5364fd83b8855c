"""Edge scores: each edge's first-order effect on the metric when it is cut, by EAP and EAP-IG.

    residual: (out_s(corrupted) - out_s(clean)) . d metric / d input_r
    compose:  sum_{t,s} (A_n(corrupted) - A_n(clean)) W_b[n, m] d metric / d A'_m

EAP takes the gradient on the clean run (one forward on each prompt, one backward). EAP-IG averages it over
`n_steps` runs whose input embeddings go from the corrupted prompt's to the clean one's (alpha = k / n_steps,
k = 1..n_steps; for a compose edge the average is of W_b * gradient, both from the same run). The gradients flow
through activations only (zero offsets added at the receivers), so frozen weights are fine.
"""

from __future__ import annotations

from typing import Literal

import torch
from jaxtyping import Float
from torch import Tensor

from .. import distributed
from ..model import HookedDCFormer, at_least_float32
from ..synth.contrast import PairTokens
from .forward import MetricKind, Run, batch_slices, graph_forward, pairs_on
from .graph import Graph, build_graph

METHODS = ("eap", "eap-ig")


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
    clean, corrupt, full_metric = pairs_on(model, pairs, metric)
    n = clean.shape[0]
    batches = batch_slices(n, batch_size)
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
