"""The compose's dynamic weights, traced to the residual components they read (the other half of `dcinterp.qk`).

`dcinterp.qk` freezes the dynamic weights at the run's values. They are computed too: a stage's query-side weights
(qw1, qw2, qg) by a small FFN from the normed stream x = ln1(resid) at the query, the key-side ones (kw1, kw2, kg)
from x at the key (Eq. 5-6). With ln1's scale frozen, x is a sum of the same components as in `dcinterp.qk`
(`normed_components`), and each weight is attributed to them, by one of:

- "ig", integrated gradients from a baseline x0 (the zero input by default: every dynamic weight is then 0 on the
  released models, whose FFN has no bias): component i gets (x_i - x0_i) . mean over the path of the Jacobian at
  x0 + alpha (x - x0), by Gauss-Legendre quadrature on `n_steps` nodes. Complete: the attributions add up to
  f(x) - f(x0) up to the quadrature (`delta` reports the gap).
- "linear", the linearisation at the run (gradient x input): component i gets J(x) (x_i - x0_i). Not complete (the
  FFN is not linear); first order in each component.

What the weights do to head m's composed value at (t, s) with the stage's input A (scores for "pre", the pattern
for "post") frozen is g = sum_n A_n (W[n, m] - [n = m]): the compose's contribution beyond the skip connection,
g_query(x_t) + g_key(x_s). `weight_attribution` attributes g too, on each side.

`compose_change` compares two prompts. The composed value is bilinear in (A, W), so its change splits exactly:
A2 W2 - A1 W1 = (A2 - A1)(W1 + W2)/2 + (A1 + A2)/2 (W2 - W1), the scores' part and the weights' part, per source
head and branch; the weights' part is then attributed to the components along the straight path from the other
prompt's normed stream to this one's (IG), and, for pre-compose, the scores' part to component pairs (exact).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from .checks import check_head, check_layer, prompt_position
from .model import HookedDCFormer, at_least_float32
from .qk_run import (
    branch_weights,
    component_names,
    compose_branches,
    key_positions,
    layer_run,
    normed_components,
    residual_components,
    side_vectors,
    single_prompt,
)

METHODS = ("ig", "linear")
SIDE_WEIGHTS = {"query": ("qw1", "qw2", "qg"), "key": ("kw1", "kw2", "kg")}
WEIGHT_INDEX = {"qw1": 0, "qw2": 1, "kw1": 2, "kw2": 3, "qg": 4, "kg": 5}  # in Attention.dynamic_weights' tuple
STAGE_INPUT = {"pre": "scores", "post": "pattern"}


def quadrature(n_steps: int, method: str, from_zero: bool = False) -> tuple[Tensor, Tensor]:
    """(alphas, weights) on [0, 1]: Gauss-Legendre nodes for "ig", the single point 1 for "linear".

    Args:
        n_steps: the Gauss-Legendre nodes ("ig").
        method: "ig" or "linear".
        from_zero: the path starts at the zero input, where w_q1 / w_k1 (RMS-normalised over heads, eps 1e-6) jump
            from 0 to unit scale within alpha ~ 1e-3; the nodes are then alpha = u^3 (Gauss-Legendre in u, weights
            3 u^2 du), which puts them where the jump is, so that the sum stays complete.

    Returns:
        The nodes alpha [step] and their weights [step], float32.
    """
    if method == "linear":
        return torch.ones(1), torch.ones(1)
    nodes, weights = np.polynomial.legendre.leggauss(n_steps)
    u, du = (nodes + 1) / 2, weights / 2
    alphas, weights = (u**3, 3 * u**2 * du) if from_zero else (u, du)
    return torch.tensor(alphas, dtype=torch.float32), torch.tensor(weights, dtype=torch.float32)


def _check_stage(model: HookedDCFormer, stage: str) -> None:
    if not model.cfg.use_dcmha:
        raise ValueError("this model has plain multi-head attention: it has no dynamic compose weights")
    if stage not in ("pre", "post"):
        raise ValueError(f"stage must be 'pre' or 'post', not {stage!r}")
    if stage not in model.cfg.compose_stages:
        raise ValueError(f"stage: this model has no {stage}-compose (compose_stages={model.cfg.compose_stages})")


def _check_method(method: str, n_steps) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be 'ig' or 'linear', not {method!r}")
    if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < 1:
        raise ValueError(f"n_steps must be a positive integer, not {n_steps!r}")


def _side_weights(model: HookedDCFormer, layer: int, stage: str, side: str, x: Tensor) -> dict[str, Tensor]:
    """The stage's dynamic weights of one side computed from normed inputs x [n, d_model] (one position each),
    by the model's own FFN; each [n, ...] in float32 (zeros for a branch the model does not run)."""
    attn = model.blocks[layer].attn
    dtype = attn.W_dyn_in.dtype
    weights = attn.dynamic_weights(x.to(attn.W_dyn_in.device, dtype)[:, None])[stage]
    active = model.cfg.active_branches
    out = {}
    for name in SIDE_WEIGHTS[side]:
        branch = "qp" if name in ("qw1", "qw2") else "kp" if name in ("kw1", "kw2") else name
        value = at_least_float32(weights[WEIGHT_INDEX[name]][:, 0])
        out[name] = value if branch in active else torch.zeros_like(value)
    return out


def _head_value(weights: dict[str, Tensor], side: str, A: Tensor, head: int) -> Tensor:
    """g of one side for each row: sum_n A_n (w1^T w2)[n, head] + A_head * gate[head]."""
    w1, w2, gate = (weights[name] for name in SIDE_WEIGHTS[side])
    low_rank = torch.einsum("xrn,n,xr->x", w1, A, w2[:, :, head])
    return low_rank + A[head] * gate[:, head]


def _attribute_side(
    model: HookedDCFormer,
    layer: int,
    stage: str,
    side: str,
    x: Float[Tensor, "component d_model"],
    baseline: Float[Tensor, "component d_model"],
    A: Float[Tensor, " head"],
    head: int,
    method: str,
    n_steps: int,
    with_weights: bool,
) -> dict:
    """One side at one position: g's attribution per component [component], and each weight's [component, ...]."""
    device = model.blocks[layer].attn.W_dyn_in.device
    x, baseline, A = x.to(device), baseline.to(device), A.to(device)
    delta = x - baseline  # [component, d]
    start, end = baseline.sum(0), x.sum(0)
    alphas, quad = quadrature(n_steps, method, from_zero=not bool(start.any()))
    path = (start + alphas.to(device)[:, None] * (end - start)).requires_grad_(True)  # [steps, d]
    with torch.enable_grad():
        values = _head_value(_side_weights(model, layer, stage, side, path), side, A, head)
        (gradient,) = torch.autograd.grad(values.sum(), path)
    mean_gradient = (quad.to(device)[:, None] * at_least_float32(gradient)).sum(0)
    out = {"scores": delta @ mean_gradient}
    if with_weights:

        def flat(point: Tensor) -> Tensor:
            weights = _side_weights(model, layer, stage, side, point[None])
            return torch.cat([w[0].flatten() for w in weights.values()])

        jacobians = torch.func.vmap(torch.func.jacrev(flat))(path.detach())  # [steps, outputs, d]
        mean_jacobian = (quad.to(device)[:, None, None] * at_least_float32(jacobians)).sum(0)
        per_component = delta @ mean_jacobian.T  # [component, outputs], in the order of `flat`
        out["weights"] = {}
        for name, w in _side_weights(model, layer, stage, side, end[None]).items():
            out["weights"][name], per_component = per_component[:, : w[0].numel()], per_component[:, w[0].numel() :]
            out["weights"][name] = out["weights"][name].unflatten(1, w.shape[1:]).cpu()
    with torch.no_grad():
        ends = _side_weights(model, layer, stage, side, torch.stack([start, end]))
        out["at_baseline"], out["at_input"] = (float(v) for v in _head_value(ends, side, A, head))
        out["weights_at_input"] = {name: w[1].cpu() for name, w in ends.items()}
        out["weights_at_baseline"] = {name: w[0].cpu() for name, w in ends.items()}
    return out


# --------------------------------------------------------------------------------------------------
# One prompt
@dataclass
class WeightAttribution:
    """A stage's dynamic weights at (query_pos, key_pos), and head `head`'s compose value, by component.

    Attributes:
        layer: the layer.
        head: the target head m.
        query_pos: the query position t.
        key_pos: the key position s.
        stage: "pre" or "post".
        method: "ig" or "linear".
        n_steps: the quadrature's nodes (1 for "linear").
        components: the residual components' names.
        target: sum_n A_n (W[n, head] - [n = head]) at the run, with the stage input A frozen: the composed value
            less the skip connection.
        baseline_value: the same at the baseline (the zero normed input).
        scores: one row per component, its share of `target` through the query-side weights ("query") and through
            the key-side ones ("key"); they add up to target - baseline_value, up to `delta` (the quadrature for
            "ig"; for "linear", what the linearisation misses).
        weights: each weight's attribution by name: qw1, qw2 [component, rank, head]; qg [component, head]; kw1,
            kw2, kg at the key; adding up to `weight_values[name]` - `weight_baselines[name]` for "ig".
        weight_values: each weight at the run.
        weight_baselines: each weight at the baseline.
    """

    layer: int
    head: int
    query_pos: int
    key_pos: int
    stage: str
    method: str
    n_steps: int
    components: list[str]
    target: float
    baseline_value: float
    scores: pd.DataFrame
    weights: dict[str, Float[Tensor, "component ..."]]
    weight_values: dict[str, Tensor]
    weight_baselines: dict[str, Tensor]

    @property
    def delta(self) -> float:
        """sum of the attributions - (target - baseline_value)."""
        return float(self.scores[["query", "key"]].to_numpy().sum()) - (self.target - self.baseline_value)

    @property
    def weight_gaps(self) -> dict[str, float]:
        """Per weight, the largest |sum over components - (value - baseline)| (the quadrature's gap for "ig")."""
        return {
            name: float((value.sum(0) - (self.weight_values[name] - self.weight_baselines[name])).abs().max())
            for name, value in self.weights.items()
        }

    def __repr__(self) -> str:
        return (
            f"WeightAttribution(L{self.layer}H{self.head} {self.stage}-compose at ({self.query_pos}, {self.key_pos}), "
            f"{self.method}: target {self.target:.4g}, baseline {self.baseline_value:.4g}, delta {self.delta:.1e})"
        )


@torch.no_grad()
def weight_attribution(
    model: HookedDCFormer,
    tokens: Int[Tensor, "batch pos"],
    layer: int,
    head: int,
    query_pos: int | str,
    key_pos: int | str,
    stage: str = "pre",
    method: str = "ig",
    n_steps: int = 64,
    batch_index: int = 0,
) -> WeightAttribution:
    """Attributes the stage's dynamic weights at (query_pos, key_pos), and head's compose value, to the components.

    The residual components are those of `dcinterp.qk` (module docstring), in float32 on the CPU.

    Args:
        model: a DCMHA model.
        tokens: one prompt [pos] or a batch [batch, pos].
        layer: the layer.
        head: the target head.
        query_pos: the query position or word.
        key_pos: the key position or word.
        stage: "pre" or "post" compose.
        method: "ig" (integrated gradients from the zero normed input) or "linear" (at the run).
        n_steps: the Gauss-Legendre nodes of "ig".
        batch_index: the prompt of a batch.

    Returns:
        The attribution.

    Raises:
        ValueError: a plain MHA model, a stage the model lacks, an unknown method, a bad `n_steps`, or a layer,
            head or position out of range.
    """
    layer, head = check_layer(model, layer), check_head(model, head)
    _check_stage(model, stage)
    _check_method(method, n_steps)
    prompt = single_prompt(model, tokens, batch_index)
    t = prompt_position(model, prompt, query_pos, "query_pos")
    (s,) = key_positions(model, prompt, layer, t, _one_key(key_pos), "key_pos")
    run = layer_run(model, prompt, layer, t, [t, s])
    normed = _normed(model, run, layer, [t, s])
    A = at_least_float32(run[STAGE_INPUT[stage]][:, s])
    sides = {
        side: _attribute_side(
            model, layer, stage, side, x, torch.zeros_like(x), A, head, method, n_steps, with_weights=True
        )
        for side, x in zip(("query", "key"), normed, strict=True)
    }
    return WeightAttribution(
        layer=layer,
        head=head,
        query_pos=t,
        key_pos=s,
        stage=stage,
        method=method,
        n_steps=n_steps if method == "ig" else 1,
        components=component_names(model, layer),
        target=sides["query"]["at_input"] + sides["key"]["at_input"],
        baseline_value=sides["query"]["at_baseline"] + sides["key"]["at_baseline"],
        scores=_component_rows(component_names(model, layer), sides),
        weights={name: w.cpu() for side in sides.values() for name, w in side["weights"].items()},
        weight_values={name: w for side in sides.values() for name, w in side["weights_at_input"].items()},
        weight_baselines={name: w for side in sides.values() for name, w in side["weights_at_baseline"].items()},
    )


def _one_key(key_pos):
    if key_pos is None or isinstance(key_pos, (list, tuple)) or isinstance(key_pos, Tensor) and key_pos.ndim:
        raise ValueError(f"key_pos must be one position or word, not {key_pos!r}")
    return key_pos


def _normed(model: HookedDCFormer, run: dict, layer: int, positions: list[int]) -> Tensor:
    """The normed components [position, component, d_model] at positions."""
    at = torch.tensor(positions)
    return normed_components(model, run, layer, residual_components(model, run, layer, at), at)


def _component_rows(components: list[str], sides: dict) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "component": components,
            "query": sides["query"]["scores"].double().cpu().numpy(),
            "key": sides["key"]["scores"].double().cpu().numpy(),
        }
    )


# --------------------------------------------------------------------------------------------------
# Two prompts: how much of the change comes from the weights, how much from the scores
@dataclass
class ComposeChange:
    """Head `head`'s composed value in `tokens` against `other_tokens`, split into what A and W change.

    `change` = composed - other = scores_part + weights_part (bilinear midpoint rule, exact), A the stage input
    (scores or pattern) and W the dynamic weights.

    Attributes:
        layer: the layer.
        head: the target head m.
        stage: "pre" or "post".
        query_pos: the query position in `tokens`.
        key_pos: the key position in `tokens`.
        other_query_pos: the query position in `other_tokens`.
        other_key_pos: the key position in `other_tokens`.
        components: the residual components' names.
        composed: the composed value in `tokens`.
        other: the composed value in `other_tokens`.
        scores_part: the part of the change that A makes.
        weights_part: the part of the change that W makes.
        by_branch: one row per (source_head, branch) with its scores and weights parts.
        weights_by_component: the weights' part attributed to the components (integrated gradients from the other
            prompt's normed stream; adds up to weights_part up to `delta`).
        scores_by_pair: pre-compose only: the scores' part as a [query component x key component] table (exact),
            the weights held at their mean; None for post-compose.
        n_steps: the quadrature's nodes.
    """

    layer: int
    head: int
    stage: str
    query_pos: int
    key_pos: int
    other_query_pos: int
    other_key_pos: int
    components: list[str]
    composed: float
    other: float
    scores_part: float
    weights_part: float
    by_branch: pd.DataFrame
    weights_by_component: pd.DataFrame
    scores_by_pair: pd.DataFrame | None
    n_steps: int

    @property
    def change(self) -> float:
        return self.composed - self.other

    @property
    def delta(self) -> float:
        """sum of weights_by_component - weights_part (the quadrature's gap)."""
        return float(self.weights_by_component[["query", "key"]].to_numpy().sum()) - self.weights_part

    def __repr__(self) -> str:
        return (
            f"ComposeChange(L{self.layer}H{self.head} {self.stage}: {self.other:.4g} -> {self.composed:.4g}, "
            f"change {self.change:+.4g} = scores {self.scores_part:+.4g} + weights {self.weights_part:+.4g})"
        )


@torch.no_grad()
def compose_change(
    model: HookedDCFormer,
    tokens: Int[Tensor, "batch pos"],
    other_tokens: Int[Tensor, "batch pos"],
    layer: int,
    head: int,
    query_pos: int | str,
    key_pos: int | str,
    other_query_pos: int | str | None = None,
    other_key_pos: int | str | None = None,
    stage: str = "pre",
    n_steps: int = 32,
    batch_index: int = 0,
    other_batch_index: int = 0,
) -> ComposeChange:
    """How much of head's composed value's change from `other_tokens` to `tokens` comes from the scores and the weights.

    The split is exact; the class docstring says how.

    Args:
        model: a DCMHA model.
        tokens: one prompt [pos] or a batch [batch, pos].
        other_tokens: the prompt compared against, [pos] or [batch, pos].
        layer: the layer.
        head: the target head.
        query_pos: the query position or word in `tokens`.
        key_pos: the key position or word in `tokens`.
        other_query_pos: the query position or word in `other_tokens`; None: `query_pos`.
        other_key_pos: the key position or word in `other_tokens`; None: `key_pos`.
        stage: "pre" or "post" compose.
        n_steps: the Gauss-Legendre nodes of the weights' attribution.
        batch_index: the prompt of a batch `tokens`.
        other_batch_index: the prompt of a batch `other_tokens`.

    Returns:
        The change, split.

    Raises:
        ValueError: a plain MHA model, a stage the model lacks, a bad `n_steps`, or a layer, head or position out of
            range.
    """
    layer, head = check_layer(model, layer), check_head(model, head)
    _check_stage(model, stage)
    _check_method("ig", n_steps)
    runs, normed, A, W, positions = [], [], [], [], []
    for name, toks, index, q, k in (
        ("", tokens, batch_index, query_pos, key_pos),
        (
            "other_",
            other_tokens,
            other_batch_index,
            query_pos if other_query_pos is None else other_query_pos,
            key_pos if other_key_pos is None else other_key_pos,
        ),
    ):
        prompt = single_prompt(model, toks, index, f"{name}tokens", f"{name}batch_index")
        t = prompt_position(model, prompt, q, f"{name}query_pos")
        (s,) = key_positions(model, prompt, layer, t, _one_key(k), f"{name}key_pos")
        run = layer_run(model, prompt, layer, t, [t, s])
        runs.append(run)
        positions.append((t, s))
        normed.append(_normed(model, run, layer, [t, s]))
        A.append(at_least_float32(run[STAGE_INPUT[stage]][:, s]).cpu())
        W.append(branch_weights(model, run, stage, t, torch.tensor([s]), head)[0])  # [branch, source head]
    (A2, A1), (W2, W1) = A, W
    scores = (A2 - A1)[None] * (W1 + W2) / 2  # [branch, source head]
    weights = (A1 + A2)[None] / 2 * (W2 - W1)
    branches = compose_branches(model, stage)
    present = [
        (b, n)
        for b, branch in enumerate(branches)
        for n in range(model.cfg.n_heads)
        if branch not in ("skip", "qg", "kg") or n == head
    ]
    by_branch = pd.DataFrame(
        {
            "source_head": [n for _, n in present],
            "branch": [branches[b] for b, _ in present],
            "scores": [float(scores[b, n]) for b, n in present],
            "weights": [float(weights[b, n]) for b, n in present],
        }
    )
    A_mean = (A1 + A2) / 2
    sides = {
        side: _attribute_side(model, layer, stage, side, normed[0][i], normed[1][i], A_mean, head, "ig", n_steps, False)
        for i, side in enumerate(("query", "key"))
    }
    components = component_names(model, layer)
    pairs = _scores_by_pair(model, runs, layer, positions, (W1 + W2).sum(0) / 2, components) if stage == "pre" else None
    target = "composed" if stage == "pre" else "composed_pattern"
    (t2, s2), (t1, s1) = positions
    return ComposeChange(
        layer=layer,
        head=head,
        stage=stage,
        query_pos=t2,
        key_pos=s2,
        other_query_pos=t1,
        other_key_pos=s1,
        components=components,
        composed=float(runs[0][target][head, s2]),
        other=float(runs[1][target][head, s1]),
        scores_part=float(scores.double().sum()),
        weights_part=float(weights.double().sum()),
        by_branch=by_branch,
        weights_by_component=_component_rows(components, sides),
        scores_by_pair=pairs,
        n_steps=n_steps,
    )


def _scores_by_pair(model, runs, layer: int, positions, mean_weight: Tensor, components: list[str]) -> pd.DataFrame:
    """sum_n w_n (S_n(tokens) - S_n(other)) by (query component, key component), w_n the mean folded weight."""
    table = 0
    for sign, run, (t, s) in zip((1.0, -1.0), runs, positions, strict=True):
        at = torch.tensor([t, s])
        parts = residual_components(model, run, layer, at)
        Q = side_vectors(model, run, layer, parts[:1], at[:1], "q")[0]
        K = side_vectors(model, run, layer, parts[1:], at[1:], "k")[0]
        table = table + sign * ((Q * mean_weight.to(Q.device)[None, :, None]).flatten(1) @ K.flatten(1).T).cpu()
    frame = pd.DataFrame(table.double().numpy(), index=components, columns=components)
    frame.index.name, frame.columns.name = "query_component", "key_component"
    return frame
