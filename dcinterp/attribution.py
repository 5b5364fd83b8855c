"""Which attention heads matter for a prediction: integrated gradients over one gate per head.

The paper (App. G) finds L16-H11 by integrated gradients (Sundararajan et al., 2017) "on all attention heads'
outputs". Heads of successive layers are not independent inputs (head (l, h) changes what every later head
computes), so attributing to each layer's output separately, as captum's multi-layer `LayerIntegratedGradients`
does, breaks the completeness axiom. Here every head gets a gate alpha[l, h] that scales its output `hook_z`
around a baseline,

    z[l, h] <- baseline[l, h] + alpha[l, h] * (z[l, h] - baseline[l, h])     (z as computed in that very pass)

and captum's `IntegratedGradients` integrates the target f(alpha) along the straight line from alpha = 0
(every head at its baseline at once) to alpha = 1 (the model as it is). Completeness then holds for this joint
path: the head scores sum to f(model) - f(all heads at baseline), up to the quadrature error of `n_steps`.

Conventions (docs/conventions.md), each one argument away:
- target_type: the explained quantity, the token's "logit" (default), "logprob" or "prob" at a position, or any
  function of the logits. The paper says only "attribution scores" (App. G); the three can rank heads differently.
- path: "joint" (default, above) or "per-layer": each layer's heads integrated on their own, the other layers as
  they are, as captum's `LayerIntegratedGradients` run layer by layer does. Per layer, the scores sum to
  f(model) - f(that layer's heads at baseline); summed over layers they do not add up to the total effect.
Baselines: zero head output (default), the mean head output over a reference batch, or a tensor you pass.
Targets may be words where the model has a tokenizer: the first token of the word after a space.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import pandas as pd
import torch
from captum.attr import IntegratedGradients
from jaxtyping import Float, Int
from torch import Tensor

from .checks import (
    check_finite,
    check_head,
    check_layer,
    check_position,
    check_token_ids,
    check_tokens,
    real_lengths,
    word_token,
)
from .model import HookedDCFormer, at_least_float32

TargetFn = Callable[[Tensor, Tensor], Tensor]  # (logits [N, pos, vocab], tokens [N, pos]) -> [N]
Target = int | str | Tensor | TargetFn
TargetType = Literal["logit", "logprob", "prob"]
TARGET_TYPES = ("logit", "logprob", "prob")
Path = Literal["joint", "per-layer"]
COMPLETENESS_SHARE = 0.05  # head_attribution warns where |delta| exceeds this share of |f(input) - f(baseline)|
IG_METHODS = ("gausslegendre", "riemann_trapezoid", "riemann_middle", "riemann_left", "riemann_right")  # captum's
Baseline = Literal["zero", "mean"] | Tensor


def _head_name(layer: int, head: int) -> str:
    return f"L{layer}H{head}"


@dataclass
class HeadAttribution:
    """Integrated-gradients scores of every head for a batch of prompts.

    `per_prompt[i].sum()` equals `f_input[i] - f_baseline[i]` up to `delta[i]`.

    Attributes:
        scores: the mean over prompts [layer, head].
        per_prompt: each prompt's scores [batch, layer, head].
        delta: the completeness error [batch]: per_prompt.sum((1, 2)) - (f_input - f_baseline).
        f_input: the target with every head as it is (alpha = 1) [batch].
        f_baseline: the target with every head at its baseline (alpha = 0) [batch].
        by_task: the mean scores of each task's prompts [layer, head], by task label.
        target_type: "logit", "logprob" or "prob".
        path: "joint" or "per-layer".
        f_layer_baseline: path="per-layer" only: the target with one layer's heads at baseline, the others as they
            are [batch, layer].
    """

    scores: Float[Tensor, "layer head"]
    per_prompt: Float[Tensor, "batch layer head"]
    delta: Float[Tensor, " batch"]
    f_input: Float[Tensor, " batch"]
    f_baseline: Float[Tensor, " batch"]
    by_task: dict[Hashable, Float[Tensor, "layer head"]] = field(default_factory=dict)
    target_type: str = "logit"
    path: str = "joint"
    f_layer_baseline: Float[Tensor, "batch layer"] | None = None

    def __repr__(self) -> str:
        n_layers, n_heads = self.scores.shape
        top = ", ".join(f"{_head_name(l, h)} {self.scores[l, h]:+.3f}" for l, h in self.top_heads(3))
        gap = (self.f_input - self.f_baseline).mean()
        return (
            f"HeadAttribution({self.target_type}, path={self.path}, {self.per_prompt.shape[0]} prompt(s), "
            f"{n_layers} layers x {n_heads} heads; top {top}; sum {self.per_prompt.sum((1, 2)).mean():.3f} "
            f"for a total effect of {gap:.3f})"
        )

    def top_heads(self, k: int = 5) -> list[tuple[int, int]]:
        """The k (layer, head) pairs with the largest mean score.

        Args:
            k: how many pairs.

        Returns:
            The pairs, largest score first.
        """
        flat = self.scores.flatten().topk(min(k, self.scores.numel())).indices
        n_heads = self.scores.shape[1]
        return [(int(i) // n_heads, int(i) % n_heads) for i in flat]

    def to_frame(self) -> pd.DataFrame:
        """One row per head: layer, head, score (mean over prompts), and one column per task if any."""
        n_layers, n_heads = self.scores.shape
        frame = pd.DataFrame(
            {
                "layer": [l for l in range(n_layers) for _ in range(n_heads)],
                "head": [h for _ in range(n_layers) for h in range(n_heads)],
                "score": self.scores.flatten().tolist(),
            }
        )
        for task, scores in self.by_task.items():
            frame[f"score[{task}]"] = scores.flatten().tolist()
        return frame


# --------------------------------------------------------------------------------------------------
# The gated model: f(alpha) for a batch of gate settings
def head_baseline(
    model: HookedDCFormer, baseline: Baseline = "zero", reference_tokens: Int[Tensor, "ref pos"] | None = None
) -> Float[Tensor, "layer ... head d_head"] | None:
    """The head outputs that alpha = 0 stands for.

    Args:
        model: the model.
        baseline: "zero" (head output zero), "mean" (mean `hook_z` over the reference batch's real tokens; the
            trailing pad tokens of the model's tokenizer do not count) or a tensor, taken as is:
            [layer, head, d_head] or [layer, pos, head, d_head].
        reference_tokens: the reference batch [ref, pos], for "mean".

    Returns:
        None for zero, else a tensor that broadcasts against `hook_z` [batch, pos, head, d_head] once indexed by
        layer.

    Raises:
        ValueError: an unknown `baseline`, or "mean" without `reference_tokens`.
    """
    if isinstance(baseline, Tensor):
        return baseline
    if baseline == "zero":
        return None
    if baseline != "mean":
        raise ValueError(f"baseline must be 'zero', 'mean' or a tensor, not {baseline!r}")
    if reference_tokens is None:
        raise ValueError("baseline='mean' needs reference_tokens (the reference batch)")
    reference_tokens = check_tokens(model, reference_tokens, "reference_tokens")
    real = (
        torch.arange(reference_tokens.shape[1], device=reference_tokens.device)
        < real_lengths(model, reference_tokens)[:, None]
    )  # pads (the tokenizer's, trailing) never count
    names = [f"blocks.{l}.attn.hook_z" for l in range(model.cfg.n_layers)]
    with torch.no_grad():
        _, cache = model.run_with_cache(reference_tokens, names_filter=names, stop_at_layer=model.cfg.n_layers)
    return torch.stack([at_least_float32(cache[name])[real.to(cache[name].device)].mean(0) for name in names])


def gate_hooks(alpha: Float[Tensor, "batch layer head"], baseline: Tensor | None) -> list[tuple[str, Callable]]:
    """Forward hooks that set every head's `hook_z` to baseline + alpha * (z - baseline).

    Args:
        alpha: the gates [batch, layer, head].
        baseline: from `head_baseline` (None: zero).

    Returns:
        (hook name, hook) pairs, one per layer, for `run_with_hooks`.
    """

    def make_hook(layer: int):
        def hook(z: Float[Tensor, "batch pos head d_head"], hook) -> Tensor:
            # In float32 whatever the model's dtype: a bfloat16 gate would round the quadrature's points
            # (alpha = 0.0199 has 3 significant digits) and its gradient sum(dz * (z - base)).
            gate = at_least_float32(alpha[:, layer, None, :, None])
            if baseline is None:
                return (at_least_float32(z) * gate).to(z.dtype)
            base = at_least_float32(baseline[layer])
            return (base + gate * (at_least_float32(z) - base)).to(z.dtype)

        return hook

    return [(f"blocks.{l}.attn.hook_z", make_hook(l)) for l in range(alpha.shape[1])]


def final_normed(
    model: HookedDCFormer, resid: Float[Tensor, "batch pos d_model"], position: int | Int[Tensor, " batch"] = -1
) -> Float[Tensor, "batch d_model"]:
    """The residual stream entering the unembedding at each prompt's `position`, through the final norm, in float32.

    Float32 because a bfloat16 logit has 3 significant digits: IG's completeness gap would be its noise.

    Args:
        model: the model.
        resid: the final residual stream [batch, pos, d_model].
        position: one position, or one per prompt [batch].

    Returns:
        [batch, d_model].
    """
    rows = torch.arange(resid.shape[0], device=resid.device)
    position = torch.as_tensor(position, device=resid.device).expand(resid.shape[0])
    return model.ln_final(at_least_float32(resid[rows, position][:, None]))[:, 0]


def answer_logits(
    model: HookedDCFormer, final: Float[Tensor, "batch d_model"], answer: Tensor
) -> Float[Tensor, " batch"]:
    """The logit of each prompt's answer token from `final_normed`, without the [batch, d_vocab] logits.

    Args:
        model: the model.
        final: from `final_normed` [batch, d_model].
        answer: one token id, or one per prompt [batch].

    Returns:
        [batch].
    """
    answer = torch.as_tensor(answer, device=model.W_U.device).expand(final.shape[0])
    return (final * at_least_float32(model.W_U[:, answer].T)).sum(-1) + at_least_float32(model.b_U[answer])


def answer_log_probs(model: HookedDCFormer, final: Float[Tensor, "batch d_model"]) -> Float[Tensor, "batch d_vocab"]:
    """Log-probabilities over the vocabulary from `final_normed` (unembedded in the model's dtype).

    Args:
        model: the model.
        final: from `final_normed` [batch, d_model].

    Returns:
        [batch, d_vocab], float32.
    """
    return at_least_float32(model.unembed(final.to(model.W_U.dtype))).log_softmax(-1)


def target_value(
    model: HookedDCFormer,
    tokens: Int[Tensor, "batch pos"],
    target: Target,
    position: int | Int[Tensor, " batch"] = -1,
    target_type: TargetType = "logit",
    fwd_hooks: Sequence[tuple[str, Callable]] = (),
) -> Float[Tensor, " batch"]:
    """The target for each prompt: a token's logit, log-probability or probability at `position`, or a function's value.

    With a token target only the final residual at `position` is unembedded (no [batch, pos, vocab] logits).

    Args:
        model: the model.
        tokens: prompts [batch, pos].
        target: a token id, one per prompt [batch], or a function `target(logits, tokens) -> [batch]`.
        position: one position, or one per prompt [batch].
        target_type: "logit", "logprob" or "prob" of a token target.
        fwd_hooks: hooks to run the model with.

    Returns:
        The target [batch], float32.

    Raises:
        ValueError: an unknown `target_type`.
    """
    if callable(target):
        logits = model.run_with_hooks(tokens, fwd_hooks=list(fwd_hooks))
        return at_least_float32(target(logits, tokens))
    resid = model.run_with_hooks(tokens, fwd_hooks=list(fwd_hooks), stop_at_layer=model.cfg.n_layers)
    rows = torch.arange(tokens.shape[0], device=resid.device)
    final = final_normed(model, resid, position)
    answer = torch.as_tensor(target, device=resid.device).expand(tokens.shape[0])
    if target_type == "logit":
        return answer_logits(model, final, answer)
    if target_type == "logprob":
        return answer_log_probs(model, final)[rows, answer]
    if target_type == "prob":
        return answer_log_probs(model, final).exp()[rows, answer]
    raise ValueError(f"target_type must be one of {TARGET_TYPES}, not {target_type!r}")


def _gated_target(model: HookedDCFormer, target: Target, target_type: str, baseline: Tensor | None) -> Callable:
    """f(alpha, tokens, position, answer) for captum: every argument's first dim is the (expanded) batch."""

    def forward(alpha: Tensor, tokens: Tensor, position: Tensor, answer: Tensor) -> Tensor:
        goal = target if callable(target) else answer
        return target_value(model, tokens, goal, position, target_type, gate_hooks(alpha, baseline))

    return forward


# --------------------------------------------------------------------------------------------------
# Attribution and ablation
def check_target_inputs(model: HookedDCFormer, tokens, target: Target, position, target_type: str):
    """The inputs of an attribution to a target, checked (one-line errors naming the argument at fault).

    Args:
        model: The model.
        tokens: Token ids [batch, pos] (or [pos]: one prompt).
        target: A word (its first piece), one token id or one per prompt, or a function of the final logits.
        position: The position read, one or one per prompt (negative counts from the end).
        target_type: One of `TARGET_TYPES`.

    Returns:
        (tokens [batch, pos] on the model's input device, target as token ids or the function, position).

    Raises:
        ValueError: An argument out of range or of the wrong shape.
    """
    tokens = check_tokens(model, tokens)
    if not isinstance(target_type, str) or target_type not in TARGET_TYPES:
        raise ValueError(f"target_type must be one of {TARGET_TYPES}, not {target_type!r}")
    position = check_position(position, tokens.shape[1], "position")
    if isinstance(target, str):
        target = word_token(model, target, piece="first", name="target")
    elif not callable(target):
        check_token_ids(target, model.cfg.d_vocab, "target")
        if torch.as_tensor(target).numel() not in (1, tokens.shape[0]) or torch.as_tensor(target).ndim > 1:
            raise ValueError(
                f"target must be one token id or one per prompt ({tokens.shape[0]}), "
                f"not shape {tuple(torch.as_tensor(target).shape)}"
            )
    if torch.as_tensor(position).ndim > 1 or torch.as_tensor(position).numel() not in (1, tokens.shape[0]):
        raise ValueError(
            f"position must be one position or one per prompt ({tokens.shape[0]}), "
            f"not shape {tuple(torch.as_tensor(position).shape)}"
        )
    return tokens, target, position


def _integrate(forward: Callable, ones: Tensor, args: tuple, n_steps: int, method: str, internal_batch_size) -> Tensor:
    ig = IntegratedGradients(forward)
    attributions = ig.attribute(
        ones,
        baselines=torch.zeros_like(ones),
        additional_forward_args=args,
        n_steps=n_steps,
        method=method,
        internal_batch_size=internal_batch_size,
    )
    return at_least_float32(attributions.detach())


def warn_incomplete(
    total_score: Tensor, total_effect: Tensor, n_steps: int, method: str, dtype, stacklevel: int = 3
) -> None:
    """Warn, with the numbers, where the scores miss more than COMPLETENESS_SHARE of the total effect.

    Args:
        total_score: the summed scores, per prompt (or per prompt and layer).
        total_effect: f(input) - f(baseline), of the same shape.
        n_steps: the steps used, named in the warning.
        method: the quadrature used, named in the warning.
        dtype: the model's dtype, named in the warning.
        stacklevel: the frame the warning points at: the caller of the function that calls this one.
    """
    gap = (total_score - total_effect).abs()
    share = gap / total_effect.abs()
    over = (share > COMPLETENESS_SHARE) & (gap > 1e-4)
    if over.any():
        worst = int(share.masked_fill(~over, 0).flatten().argmax())
        warnings.warn(
            f"head_attribution: the scores miss {share.flatten()[worst]:.1%} of the total effect "
            f"({total_effect.flatten()[worst]:.4g}, gap {gap.flatten()[worst]:.3g}) in {int(over.sum())} of "
            f"{over.numel()} prompt(s){' x layers' if over.ndim > 1 else ''}, more than {COMPLETENESS_SHARE:.0%}, "
            f"with n_steps={n_steps}, method={method!r} in {dtype}: raise n_steps"
            + (
                ""
                if dtype == torch.float32
                else " (more steps do not lower half precision's rounding floor: load the model in float32 for that)"
            )
            + "; docs/conventions.md, 'Half precision and IG completeness'",
            stacklevel=stacklevel,
        )


def _one_layer(forward: Callable, layer: int, n_layers: int) -> Callable:
    """f(alpha of one layer [N, head]) with every other layer's gates at 1."""

    def layer_forward(alpha: Tensor, *args) -> Tensor:
        ones = torch.ones(alpha.shape[0], n_layers, alpha.shape[1], device=alpha.device, dtype=alpha.dtype)
        return forward(torch.cat([ones[:, :layer], alpha[:, None], ones[:, layer + 1 :]], dim=1), *args)

    return layer_forward


def head_attribution(
    model: HookedDCFormer,
    tokens: Int[Tensor, "batch pos"],
    target: Target,
    position: int | Int[Tensor, " batch"] = -1,
    target_type: TargetType = "logit",
    baseline: Baseline = "zero",
    reference_tokens: Int[Tensor, "ref pos"] | None = None,
    tasks: Sequence[Hashable] | None = None,
    n_steps: int = 50,
    internal_batch_size: int | None = None,
    method: str = "gausslegendre",
    path: Path = "joint",
) -> HeadAttribution:
    """Integrated gradients of a target with respect to every head's output, one score per (layer, head).

    The cost is about `n_steps` forward+backward passes over the batch. For many prompts, `head_attribution_sweep`
    takes them a batch at a time, across processes.

    Args:
        model: the model.
        tokens: prompts [batch, pos]; right-padded is fine with `position` per prompt.
        target: a token id, one per prompt [batch], a word (its first token after a space; needs a tokenizer), or a
            function `(logits [N, pos, vocab], tokens [N, pos]) -> [N]`.
        position: the position whose token target is explained: one, or one per prompt [batch].
        target_type: what of a token target is explained: "logit", "logprob" or "prob".
        baseline: "zero" (head output zero), "mean" (mean head output over `reference_tokens`) or a tensor
            ([layer, head, d_head] or [layer, pos, head, d_head]).
        reference_tokens: the reference batch [ref, pos] of a "mean" baseline.
        tasks: one label per prompt; `by_task` then holds the mean scores of each task.
        n_steps: as in captum's `IntegratedGradients.attribute`.
        internal_batch_size: caps the rows per pass (at least one step, i.e. the whole batch); None: every step in
            one pass (batch * n_steps rows). Set it on large models.
        method: the quadrature, as in captum.
        path: "joint" (every head's gate moves at once; completeness holds for the whole model) or "per-layer" (one
            layer at a time, the others as they are; completeness holds per layer only; n_layers times the cost).

    Returns:
        The scores, per prompt and their mean, with the completeness check's numbers.

    Raises:
        ValueError: a bad argument, named.
    """
    _check_ig_arguments(n_steps, method, internal_batch_size, path)
    tokens, target, position = check_target_inputs(model, tokens, target, position, target_type)
    if tasks is not None and len(tasks) != tokens.shape[0]:
        raise ValueError(f"tasks has {len(tasks)} labels for {tokens.shape[0]} prompts")
    base = head_baseline(model, baseline, reference_tokens)
    result = _attribute(model, tokens, target, position, target_type, base, n_steps, internal_batch_size, method, path)
    _warn_if_incomplete(result, n_steps, method, model.cfg.dtype)
    result.by_task = mean_by_task(result.per_prompt, tasks)
    return result


def _check_ig_arguments(n_steps, method, internal_batch_size, path) -> None:
    if path not in ("joint", "per-layer"):
        raise ValueError(f"path must be 'joint' or 'per-layer', not {path!r}")
    if not isinstance(n_steps, int) or isinstance(n_steps, bool) or n_steps < 1:
        raise ValueError(f"n_steps must be a positive integer, not {n_steps!r}")
    if method not in IG_METHODS:
        raise ValueError(f"method must be one of {IG_METHODS}, not {method!r}")
    if internal_batch_size is not None and (not isinstance(internal_batch_size, int) or internal_batch_size < 1):
        raise ValueError(f"internal_batch_size must be a positive integer or None, not {internal_batch_size!r}")


def _attribute(
    model: HookedDCFormer,
    tokens: Tensor,
    target,
    position,
    target_type: str,
    base: Tensor | None,
    n_steps: int,
    internal_batch_size: int | None,
    method: str,
    path: str,
) -> HeadAttribution:
    """`head_attribution` of checked inputs, without tasks and without the completeness warning."""
    batch, device = tokens.shape[0], tokens.device
    position_t = torch.as_tensor(position, device=device).expand(batch).contiguous()
    answer_t = torch.as_tensor(0 if callable(target) else target, device=device).expand(batch).contiguous()
    forward = _gated_target(model, target, target_type, base)
    args = (tokens, position_t, answer_t)

    ones = torch.ones(batch, model.cfg.n_layers, model.cfg.n_heads, device=device)
    f_layer_baseline = None
    if path == "joint":
        per_prompt = _integrate(forward, ones, args, n_steps, method, internal_batch_size)
    else:
        per_layer = [
            _integrate(
                _one_layer(forward, layer, model.cfg.n_layers), ones[:, 0], args, n_steps, method, internal_batch_size
            )
            for layer in range(model.cfg.n_layers)
        ]
        per_prompt = torch.stack(per_layer, dim=1)
        with torch.no_grad():
            f_layer_baseline = torch.stack(
                [
                    _one_layer(forward, layer, model.cfg.n_layers)(torch.zeros_like(ones[:, 0]), *args)
                    for layer in range(model.cfg.n_layers)
                ],
                dim=1,
            )

    with torch.no_grad():
        f_input = forward(ones, *args)
        f_baseline = forward(torch.zeros_like(ones), *args)

    def rerun():  # where a non-finite number appears, at three points of the path
        for value in (1.0, 0.5, 0.0):
            alpha = torch.full_like(ones, value, requires_grad=True)
            with torch.enable_grad():
                torch.autograd.grad(forward(alpha, *args).sum(), alpha)

    check_finite(
        model, {"an attribution": per_prompt, "f(input)": f_input, "f(baseline)": f_baseline}, "head_attribution", rerun
    )
    delta = per_prompt.sum((1, 2)) - (f_input - f_baseline)
    return HeadAttribution(
        per_prompt.mean(0), per_prompt, delta, f_input, f_baseline, {}, target_type, path, f_layer_baseline
    )


def _warn_if_incomplete(result: HeadAttribution, n_steps: int, method: str, dtype) -> None:
    """`warn_incomplete` for a result, pointing at the code that called `head_attribution` (or the sweep)."""
    if result.path == "joint":
        total_score, total_effect = result.per_prompt.sum((1, 2)), result.f_input - result.f_baseline
    else:
        total_score, total_effect = result.per_prompt.sum(2), result.f_input[:, None] - result.f_layer_baseline
    warn_incomplete(total_score, total_effect, n_steps, method, dtype, stacklevel=4)


def mean_by_task(per_prompt: Tensor, tasks: Sequence[Hashable] | None) -> dict[Hashable, Tensor]:
    """The mean scores of each task's prompts, in the order the labels first appear.

    Args:
        per_prompt: scores [batch, layer, head].
        tasks: one label per prompt (None: no task).

    Returns:
        [layer, head] per label.
    """
    by_task = {}
    for task in dict.fromkeys(tasks or ()):
        rows = torch.tensor([t == task for t in tasks], device=per_prompt.device)
        by_task[task] = per_prompt[rows].mean(0)
    return by_task


def head_attribution_sweep(
    model: HookedDCFormer,
    tokens: Int[Tensor, "batch pos"],
    target: Target,
    position: int | Int[Tensor, " batch"] = -1,
    target_type: TargetType = "logit",
    baseline: Baseline = "zero",
    reference_tokens: Int[Tensor, "ref pos"] | None = None,
    tasks: Sequence[Hashable] | None = None,
    n_steps: int = 50,
    internal_batch_size: int | None = None,
    method: str = "gausslegendre",
    path: Path = "joint",
    batch_size: int = 8,
) -> HeadAttribution:
    """`head_attribution` over many prompts, `batch_size` prompts per call, shared between processes under `torchrun`.

    Same arguments and result as `head_attribution`, on the CPU. A prompt's scores depend on that prompt alone, so the
    result is `head_attribution` of all the prompts at once up to float32 rounding (a batch's shapes change the order
    of some sums), and each prompt's row is what `head_attribution` gives on its batch, bit for bit. A "mean" baseline
    is computed once, from `reference_tokens`, for every batch. Under `torchrun` (an initialised torch.distributed
    group) each process attributes every world_size-th batch; the rows are gathered, so every process returns what
    one process computes, bit for bit (`dcinterp.distributed`). The completeness warning, if any, comes once, over
    every prompt.

    Args:
        model: as `head_attribution`.
        tokens: as `head_attribution`.
        target: as `head_attribution`.
        position: as `head_attribution`.
        target_type: as `head_attribution`.
        baseline: as `head_attribution`.
        reference_tokens: as `head_attribution`.
        tasks: as `head_attribution`.
        n_steps: as `head_attribution`.
        internal_batch_size: as `head_attribution`.
        method: as `head_attribution`.
        path: as `head_attribution`.
        batch_size: prompts per call of `head_attribution`.

    Returns:
        The scores of every prompt, on the CPU.

    Raises:
        ValueError: a bad argument, named.
    """
    from . import distributed

    _check_ig_arguments(n_steps, method, internal_batch_size, path)
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, not {batch_size!r}")
    tokens, target, position = check_target_inputs(model, tokens, target, position, target_type)
    n = tokens.shape[0]
    if tasks is not None and len(tasks) != n:
        raise ValueError(f"tasks has {len(tasks)} labels for {n} prompts")
    base = head_baseline(model, baseline, reference_tokens)
    positions = torch.as_tensor(position, device=tokens.device).expand(n)
    targets = None if callable(target) else torch.as_tensor(target, device=tokens.device).expand(n)
    batches = [slice(start, min(start + batch_size, n)) for start in range(0, n, batch_size)]
    parts = {}
    for i in distributed.my_batches(len(batches)):
        rows = batches[i]
        part = _attribute(
            model,
            tokens[rows],
            target if targets is None else targets[rows],
            positions[rows],
            target_type,
            base,
            n_steps,
            internal_batch_size,
            method,
            path,
        )
        parts[i] = distributed.to_cpu(
            (part.per_prompt, part.delta, part.f_input, part.f_baseline, part.f_layer_baseline)
        )
    gathered = distributed.in_order(distributed.gather(parts), len(batches))
    per_prompt, delta, f_input, f_baseline = (torch.cat([part[k] for part in gathered]) for k in range(4))
    f_layer_baseline = None if path == "joint" else torch.cat([part[4] for part in gathered])
    result = HeadAttribution(
        per_prompt.mean(0), per_prompt, delta, f_input, f_baseline, {}, target_type, path, f_layer_baseline
    )
    if distributed.rank_and_size()[0] == 0:  # every process holds the same numbers: one warning
        _warn_if_incomplete(result, n_steps, method, model.cfg.dtype)
    result.by_task = mean_by_task(per_prompt, tasks)
    return result


@dataclass
class HeadAblation:
    """The target's change (mean over prompts) when one head at a time is set to its baseline; NaN where not run.

    Negative: the head helps the target.

    Attributes:
        effect: the mean change of the target [layer, head].
        clean: the target with every head as it is [batch].
        heads: the (layer, head) pairs that were ablated.
        target_type: "logit", "logprob" or "prob".
    """

    effect: Float[Tensor, "layer head"]
    clean: Float[Tensor, " batch"]
    heads: list[tuple[int, int]]
    target_type: str = "logit"

    def __repr__(self) -> str:
        ranked = ", ".join(f"{_head_name(l, h)} {self.effect[l, h]:+.3f}" for l, h in self.top_heads(3))
        return (
            f"HeadAblation({self.target_type}, {len(self.heads)} of {self.effect.numel()} heads ablated; "
            f"largest drops {ranked}; clean target {self.clean.mean():.3f})"
        )

    def top_heads(self, k: int = 5) -> list[tuple[int, int]]:
        """The k ablated heads whose ablation lowers the target most.

        Args:
            k: how many heads.

        Returns:
            (layer, head) pairs, largest drop first.
        """
        return sorted(self.heads, key=lambda lh: float(self.effect[lh]))[:k]

    def median(self) -> float:
        """The median effect over the ablated heads."""
        return float(torch.stack([self.effect[lh] for lh in self.heads]).median())

    def to_frame(self) -> pd.DataFrame:
        """One row per ablated head: layer, head, effect."""
        return pd.DataFrame(
            [(l, h, float(self.effect[l, h])) for l, h in self.heads], columns=["layer", "head", "effect"]
        )


@torch.no_grad()
def head_ablation(
    model: HookedDCFormer,
    tokens: Int[Tensor, "batch pos"],
    target: Target,
    heads: Sequence[tuple[int, int]] | None = None,
    position: int | Int[Tensor, " batch"] = -1,
    target_type: TargetType = "logit",
    baseline: Baseline = "zero",
    reference_tokens: Int[Tensor, "ref pos"] | None = None,
) -> HeadAblation:
    """Change of the target (mean over prompts) when one head at a time is set to its baseline.

    Same target and baseline conventions as `head_attribution`.

    Args:
        model: the model.
        tokens: prompts [batch, pos].
        target: as `head_attribution`.
        heads: the (layer, head) pairs to ablate, one forward each (None: every head). On a large model pass the
            top heads of `head_attribution` and a few others; the others are NaN.
        position: as `head_attribution`.
        target_type: as `head_attribution`.
        baseline: as `head_attribution`.
        reference_tokens: as `head_attribution`.

    Returns:
        The effect of each ablated head.

    Raises:
        ValueError: a bad argument, named.
    """
    tokens, target, position = check_target_inputs(model, tokens, target, position, target_type)
    cfg = model.cfg
    heads = heads if heads is not None else [(l, h) for l in range(cfg.n_layers) for h in range(cfg.n_heads)]
    if (
        isinstance(heads, (str, Tensor))
        or not heads
        or not all(isinstance(lh, (tuple, list)) and len(lh) == 2 for lh in heads)
    ):
        raise ValueError(f"heads must be a non-empty list of (layer, head) pairs, not {heads!r}")
    heads = [(check_layer(model, l, "heads: layer"), check_head(model, h, "heads: head")) for l, h in heads]
    base = head_baseline(model, baseline, reference_tokens)
    alpha = torch.ones(tokens.shape[0], cfg.n_layers, cfg.n_heads, device=tokens.device)
    clean = target_value(model, tokens, target, position, target_type)
    effect = torch.full((cfg.n_layers, cfg.n_heads), float("nan"))
    for layer, head in heads:
        alpha[:, layer, head] = 0
        ablated = target_value(model, tokens, target, position, target_type, gate_hooks(alpha, base))
        alpha[:, layer, head] = 1
        effect[layer, head] = (ablated - clean).mean().item()
    check_finite(
        model,
        {"the clean target": clean, **{f"the effect of L{l}H{h}": effect[l, h] for l, h in heads}},
        "head_ablation",
        lambda: target_value(model, tokens, target, position, target_type),
    )
    return HeadAblation(effect, clean.cpu(), heads, target_type)
