"""Which compose branch does the work: activation patching and attribution patching of DCMHA.

Everything here runs the model's own forward through its hooks (`run_with_hooks`, `run_with_cache`), at the compose
sites of `dcinterp.ablation` (a `Site` is one hook of a compose stage, a branch output or a dynamic weight, in a
layer and a stage, optionally one head of it). Branch ablation (`branch_ablation`, the components, `mean_activations`,
`ablation_hooks`, `zero_weight_hooks`) lives in `dcinterp.ablation`, and this module re-exports its names.

- `activation_patching`: every site's activation copied from one prompt of a contrast pair into the other's run.
  "noising" runs the clean prompt with the corrupted activation, "denoising" the corrupted prompt with the clean
  one. The metric is the logit difference LD = logit(clean answer) - logit(corrupted answer) at the answer's
  position, and `effect` = (mean LD patched - mean LD of the run patched into) / (mean LD clean - mean LD corrupt):
  the share of the clean-minus-corrupt difference restored (denoising, 0 to 1) or, negative, removed (noising,
  0 to -1). Means over the batch are taken before dividing, so a pair with a small difference cannot blow it up.
- `attribution_patching`: the first-order estimate of the same table, gradient x (source - activation), from
  one forward and backward pass of the run patched into and one forward pass of the other prompt, whatever the
  number of sites. The gradient is taken at the run patched into: the clean one for noising (as in AtP, Kramar
  et al. 2024), the corrupted one for denoising. It flows through the activations (a zero tensor added at each
  site), not the weights, so frozen parameters are fine and no `.grad` is written. A pre-compose branch feeds a
  softmax that may saturate, where the first-order estimate can be far off (docs/patching.md shows a site whose
  sign it gets wrong); `softmax="exact"` carries pre-compose sites through their layer's softmax exactly
  and linearises only the rest (AtP*'s fix). The default is the plain first-order estimate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from .ablation import (  # noqa: F401 (re-exported: the names users import from dcinterp.patching)
    BRANCH_OUTPUTS,
    BRANCH_WEIGHTS,
    DYNAMIC_WEIGHTS,
    OUTPUT_HEAD_WEIGHT,
    SITE_BRANCH,
    SITE_NAMES,
    STAGES,
    Component,
    MeanOver,
    Site,
    ablation_hooks,
    branch_ablation,
    branch_components,
    check_components,
    check_sites,
    everywhere_components,
    layer_components,
    mean_activations,
    sites,
    stage_components,
    zero_weight_hooks,
)
from .attribution import answer_logits, final_normed
from .checks import check_finite, check_position, check_token_ids, check_tokens
from .dcmha.materialised import branch_outputs
from .model import HookedDCFormer, at_least_float32, visible_keys
from .synth.contrast import PairTokens

Direction = Literal["noising", "denoising"]
Softmax = Literal["linear", "exact"]
Metric = Callable[[HookedDCFormer, Tensor, Sequence], Tensor]  # (model, tokens, fwd_hooks) -> [batch]
FRAME_COLUMNS = ["layer", "stage", "site", "branch", "head", "effect", "delta"]


# --------------------------------------------------------------------------------------------------
# The metric
@dataclass(frozen=True)
class LogitDiff:
    """logit(clean answer) - logit(corrupted answer) at each prompt's answer position: [batch].

    Called as a metric: `LogitDiff(...)(model, tokens, fwd_hooks)`.

    Attributes:
        clean_answer: the clean answer's token id [batch].
        corrupt_answer: the corrupted answer's token id [batch].
        position: the answer's position: one, or one per prompt [batch].
    """

    clean_answer: Int[Tensor, " batch"]
    corrupt_answer: Int[Tensor, " batch"]
    position: int | Int[Tensor, " batch"] = -1

    def __call__(
        self, model: HookedDCFormer, tokens: Int[Tensor, "batch pos"], fwd_hooks: Sequence[tuple[str, Callable]] = ()
    ) -> Float[Tensor, " batch"]:
        resid = model.run_with_hooks(tokens, fwd_hooks=list(fwd_hooks), stop_at_layer=model.cfg.n_layers)
        final = final_normed(model, resid, self.position)
        return answer_logits(model, final, self.clean_answer) - answer_logits(model, final, self.corrupt_answer)


# --------------------------------------------------------------------------------------------------
# Patching: the raw change of the mean metric, one value per site
def cache_sites(
    model: HookedDCFormer, tokens: Int[Tensor, "batch pos"], hook_names: Sequence[str]
) -> dict[str, Tensor]:
    """The activations at the given hooks for a batch of prompts (no gradients).

    Args:
        model: the model.
        tokens: the prompts [batch, pos].
        hook_names: the hooks.

    Returns:
        Each hook's activation.
    """
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=list(hook_names), stop_at_layer=model.cfg.n_layers)
    return {name: cache[name] for name in hook_names}


def patch_hook(site: Site, source: Tensor) -> tuple[str, Callable]:
    """A forward hook that replaces the site's part of its activation by the same part of `source`.

    Args:
        site: the site.
        source: the activation to copy from, of the hook's shape.

    Returns:
        (hook name, hook).
    """

    def hook(x: Tensor, hook) -> Tensor:
        if site.head is None:
            return source.to(x.dtype)
        x = x.clone()
        x[site.index()] = source[site.index()].to(x.dtype)
        return x

    return site.hook_name, hook


@torch.no_grad()
def patching_deltas(
    model: HookedDCFormer,
    tokens: Int[Tensor, "batch pos"],
    sources: dict[str, Tensor],
    metric: Metric,
    site_list: Sequence[Site],
) -> Float[Tensor, " site"]:
    """Exact: mean metric with each site patched from `sources`, less the unpatched mean metric (a forward each).

    Args:
        model: the model.
        tokens: the run patched into [batch, pos].
        sources: the activations patched in, by hook name.
        metric: `metric(model, tokens, fwd_hooks) -> [batch]`, e.g. a `LogitDiff`.
        site_list: the sites.

    Returns:
        One delta per site [site].
    """
    base = metric(model, tokens, []).mean()
    return torch.stack(
        [metric(model, tokens, [patch_hook(site, sources[site.hook_name])]).mean() - base for site in site_list]
    )


def site_gradients(
    model: HookedDCFormer, tokens: Int[Tensor, "batch pos"], metric: Metric, hook_names: Sequence[str]
) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]:
    """The mean metric, and its gradient and the activation at each hook, from one forward and one backward.

    A zero tensor added at each hook carries the gradient, so it is the total derivative of the metric with respect to
    that activation, through every later site as well.

    Args:
        model: the model.
        tokens: the prompts [batch, pos].
        metric: `metric(model, tokens, fwd_hooks) -> [batch]`.
        hook_names: the hooks.

    Returns:
        (the mean metric, the gradient at each hook, the activation at each hook).
    """
    offsets, activations = {}, {}

    def hook(x: Tensor, hook) -> Tensor:
        offsets[hook.name] = torch.zeros_like(x, requires_grad=True)
        activations[hook.name] = x.detach()
        return x + offsets[hook.name]

    with torch.enable_grad():
        value = metric(model, tokens, [(name, hook) for name in hook_names]).mean()
        grads = torch.autograd.grad(value, [offsets[name] for name in hook_names], allow_unused=True)
    gradients = {
        name: torch.zeros_like(activations[name]) if g is None else g for name, g in zip(hook_names, grads, strict=True)
    }
    return value.detach(), gradients, activations


def attribution_deltas(
    model: HookedDCFormer,
    tokens: Int[Tensor, "batch pos"],
    sources: dict[str, Tensor],
    metric: Metric,
    site_list: Sequence[Site],
    softmax: Softmax = "linear",
) -> Float[Tensor, " site"]:
    """First order: gradient . (source - activation) over each site's part, from one forward and backward.

    Args:
        model: the model.
        tokens: the run patched into [batch, pos].
        sources: the activations patched in, by hook name.
        metric: `metric(model, tokens, fwd_hooks) -> [batch]`.
        site_list: the sites.
        softmax: "linear", or "exact" (AtP*'s fix for saturated attention, Kramar et al. 2024): a pre-compose site's
            change is carried through its layer's softmax exactly, and only the rest of the model is linearised, as
            gradient at `hook_pattern` . (softmax(scores + change) - softmax(scores)).

    Returns:
        One estimated delta per site [site].
    """
    if softmax not in ("linear", "exact"):
        raise ValueError(f"softmax must be 'linear' or 'exact', not {softmax!r}")
    exact = [site for site in site_list if softmax == "exact" and site.stage == "pre"]
    hook_names = list(
        dict.fromkeys(
            [site.hook_name for site in site_list] + [name for site in exact for name in _softmax_inputs(site)]
        )
    )
    _, gradients, activations = site_gradients(model, tokens, metric, hook_names)
    products = {
        name: at_least_float32(gradients[name] * (sources[name] - activations[name]))
        for name in dict.fromkeys(site.hook_name for site in site_list)
    }
    return torch.stack(
        [
            _through_softmax(model, site, sources, activations, gradients)
            if site in exact
            else products[site.hook_name][site.index()].sum()
            for site in site_list
        ]
    )


def _softmax_inputs(site: Site) -> list[str]:
    """What carrying a pre-compose site through its softmax needs: scores, composed scores, pattern, weights."""
    attn = f"blocks.{site.layer}.attn"
    names = [f"{attn}.hook_attn_scores", f"{attn}.hook_composed_scores", f"{attn}.hook_pattern"]
    return names + [f"{attn}.pre_compose.hook_{name}" for name in BRANCH_WEIGHTS[site.branch]]


def _through_softmax(
    model: HookedDCFormer,
    site: Site,
    sources: dict[str, Tensor],
    activations: dict[str, Tensor],
    gradients: dict[str, Tensor],
) -> Tensor:
    """gradient at the pattern . the pattern's exact change when the pre-compose site takes its source value."""
    attn = f"blocks.{site.layer}.attn"
    composed = activations[f"{attn}.hook_composed_scores"]
    # The score hooks hold the dtype's minimum at hidden keys (as TransformerLens): mixed by the compose
    # weights they would overflow, so hidden entries enter as 0 and the mask is added once, at the softmax.
    hidden = ~visible_keys(composed.shape[-1], model.blocks[site.layer].attn.window, composed.device, model.cfg.window)
    if site.name in BRANCH_OUTPUTS:
        change = torch.zeros_like(activations[site.hook_name])
        change[site.index()] = (sources[site.hook_name] - activations[site.hook_name])[site.index()]
    else:  # recompute the branch output with the patched weight
        weights = {name: activations[f"{attn}.pre_compose.hook_{name}"] for name in BRANCH_WEIGHTS[site.branch]}
        patched = dict(weights)
        patched[site.name] = weights[site.name].clone()
        patched[site.name][site.index()] = sources[site.hook_name][site.index()]
        scores = activations[f"{attn}.hook_attn_scores"].masked_fill(hidden, 0)
        change = branch_outputs(scores, **patched)[site.branch] - branch_outputs(scores, **weights)[site.branch]
    composed, change = (
        at_least_float32(composed.masked_fill(hidden, 0)),
        at_least_float32(change.masked_fill(hidden, 0)),
    )
    before = composed.masked_fill(hidden, float("-inf")).softmax(-1)
    after = (composed + change).masked_fill(hidden, float("-inf")).softmax(-1)
    return (at_least_float32(gradients[f"{attn}.hook_pattern"]) * (after - before)).sum()


# --------------------------------------------------------------------------------------------------
# Patching tables
def activation_patching(
    model: HookedDCFormer,
    pairs: PairTokens,
    direction: Direction = "noising",
    per_head: bool = False,
    names: Sequence[str] = SITE_NAMES,
    layers: Sequence[int] | None = None,
) -> pd.DataFrame:
    """Exact activation patching of every site (one forward pass per site, or per site and head).

    Args:
        model: a DCMHA model.
        pairs: `dcinterp.synth.tokenize_pairs(contrast_pairs(...), model.tokenizer)`, or your own `PairTokens`.
        direction: "noising" (the clean run, corrupted activations) or "denoising" (the other way).
        per_head: one row per site and head.
        names: the hooks, among SITE_NAMES.
        layers: the layers (None: all).

    Returns:
        Columns layer, stage, site, branch, head, effect (normalised, see the module docstring), delta (the raw change
        of the mean logit difference).

    Raises:
        ValueError: a bad argument, named.
    """
    return _patching_table(model, pairs, direction, per_head, names, layers, patching_deltas)


def attribution_patching(
    model: HookedDCFormer,
    pairs: PairTokens,
    direction: Direction = "noising",
    per_head: bool = False,
    names: Sequence[str] = SITE_NAMES,
    layers: Sequence[int] | None = None,
    softmax: Softmax = "linear",
) -> pd.DataFrame:
    """The first-order estimate of `activation_patching`, same rows and columns, from one backward pass.

    Args:
        model: a DCMHA model.
        pairs: as `activation_patching`.
        direction: as `activation_patching`.
        per_head: as `activation_patching`.
        names: as `activation_patching`.
        layers: as `activation_patching`.
        softmax: "linear" (the plain first-order estimate) or "exact" (pre-compose sites carried through their
            layer's softmax exactly, as AtP* does for attention scores; see `attribution_deltas`).

    Returns:
        The rows of `activation_patching`, estimated.

    Raises:
        ValueError: a bad argument, named.
    """
    if softmax not in ("linear", "exact"):
        raise ValueError(f"softmax must be 'linear' or 'exact', not {softmax!r}")

    def deltas(model, tokens, sources, metric, site_list):
        return attribution_deltas(model, tokens, sources, metric, site_list, softmax)

    return _patching_table(model, pairs, direction, per_head, names, layers, deltas)


def check_pairs(model: HookedDCFormer, pairs: PairTokens) -> tuple[Tensor, ...]:
    """The pairs' tensors on the model's device, checked.

    Args:
        model: the model.
        pairs: the tokenized contrast pairs.

    Returns:
        (clean, corrupt, clean_answer, corrupt_answer, position).

    Raises:
        ValueError: one line naming `pairs`.
    """
    if not all(hasattr(pairs, field) for field in ("clean", "corrupt", "clean_answer", "corrupt_answer", "position")):
        raise TypeError(f"pairs must be a PairTokens (dcinterp.synth.tokenize_pairs), not {type(pairs).__name__}")
    clean, corrupt = (
        check_tokens(model, pairs.clean, "pairs.clean"),
        check_tokens(model, pairs.corrupt, "pairs.corrupt"),
    )
    if clean.shape != corrupt.shape:
        raise ValueError(
            f"pairs: clean tokens {tuple(clean.shape)} and corrupted {tuple(corrupt.shape)} differ in shape"
        )
    batch = clean.shape[0]
    answers = []
    for field in ("clean_answer", "corrupt_answer", "position"):
        value = torch.as_tensor(getattr(pairs, field)).to(clean.device)
        if value.shape != (batch,):
            raise ValueError(f"pairs.{field} must hold one value per pair ({batch}), not shape {tuple(value.shape)}")
        answers.append(value)
    check_token_ids(answers[0], model.cfg.d_vocab, "pairs.clean_answer")
    check_token_ids(answers[1], model.cfg.d_vocab, "pairs.corrupt_answer")
    position = check_position(answers[2], clean.shape[1], "pairs.position")
    return clean, corrupt, answers[0], answers[1], position


def _patching_table(model, pairs, direction, per_head, names, layers, deltas_of) -> pd.DataFrame:
    if direction not in ("noising", "denoising"):
        raise ValueError(f"direction must be 'noising' or 'denoising', not {direction!r}")
    if not isinstance(per_head, bool):
        raise TypeError(f"per_head must be True or False, not {per_head!r}")
    clean, corrupt, clean_answer, corrupt_answer, position = check_pairs(model, pairs)
    metric = LogitDiff(clean_answer, corrupt_answer, position)
    site_list = sites(model, names, layers, per_head)
    hook_names = list(dict.fromkeys(site.hook_name for site in site_list))
    base, source = (clean, corrupt) if direction == "noising" else (corrupt, clean)
    with torch.no_grad():
        ld_clean, ld_corrupt = metric(model, clean).mean(), metric(model, corrupt).mean()
    scale = (ld_clean - ld_corrupt).item()
    if abs(scale) < 1e-6:
        raise ValueError(
            "pairs: the clean and corrupted prompts give the same mean logit difference "
            f"({ld_clean.item():.4g}); there is nothing to restore"
        )
    deltas = deltas_of(model, base, cache_sites(model, source, hook_names), metric, site_list).cpu()
    values = {
        f"the change at {site.hook_name}" + ("" if site.head is None else f" head {site.head}"): delta
        for site, delta in zip(site_list, deltas, strict=True)
    }
    check_finite(
        model,
        {"the clean-minus-corrupt logit difference": torch.tensor(scale), **values},
        "patching",
        lambda: site_gradients(model, base, metric, hook_names),
    )
    return pd.DataFrame(
        {
            "layer": [site.layer for site in site_list],
            "stage": [site.stage for site in site_list],
            "site": [site.name for site in site_list],
            "branch": [site.branch for site in site_list],
            "head": ["all" if site.head is None else site.head for site in site_list],
            "effect": (deltas / scale).tolist(),
            "delta": deltas.tolist(),
        },
        columns=FRAME_COLUMNS,
    )
