"""One run through the graph: the clean run, or the circuit run with the edges outside a circuit corrupted.

**Edge patching** (`graph_forward`): a receiver's input is the circuit run's residual stream less, for each cut
sender, the sender's output in the circuit run minus its output on the corrupted run. A cut compose edge replaces A_n
in that one term by the corrupted run's A_n, the dynamic weights being those of the circuit run
(`compose_correction`). The full graph gives the clean run and the empty graph the corrupted run, by construction.
The run goes block by block through the model's own modules (`ln1`, `attn` with split q/k/v inputs, `ln2`, `mlp`),
with its hooks on the compose. The metric (`Metric`) is read from the stream entering the unembedding.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Literal

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..attribution import answer_log_probs, answer_logits, final_normed
from ..model import HookedDCFormer, attention_mask, visible_keys
from ..synth.contrast import PairTokens
from .graph import STAGE_OUTPUT, Graph

MetricKind = Literal["logit_diff", "logprob"]


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
                # one normed input with a zero offset; `scores.edge_scores` splits its gradient afterwards.
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
# The pairs
def pairs_on(model: HookedDCFormer, pairs: PairTokens, metric: MetricKind) -> tuple[Tensor, Tensor, Metric]:
    """The pairs' clean and corrupted tokens on the model's input device, and their metric.

    Args:
        model: the model.
        pairs: the tokenized contrast pairs.
        metric: "logit_diff" or "logprob".

    Returns:
        (clean tokens, corrupted tokens, the metric of every pair).

    Raises:
        ValueError: tokens of different shapes, or an unknown metric.
    """
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


def batch_slices(n: int, batch_size: int | None) -> list[slice]:
    """The batches of n rows, `batch_size` at a time.

    Args:
        n: the rows.
        batch_size: rows per batch (None: all at once).

    Returns:
        One slice per batch.
    """
    size = n if batch_size is None else batch_size
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]
