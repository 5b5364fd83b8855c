"""Which compose branch does the work, by ablation: the target's change when a branch or a stage is switched off.

Everything here runs the model's own forward through its hooks (`run_with_hooks`, `run_with_cache`). A *site*
is one hook of a compose stage: a branch output `o_qp, o_kp, o_qg, o_kg` ([batch, head, query, key]) or a
dynamic weight `qw1, qw2, kw1, kw2` ([batch, pos, rank, head]), `qg, kg` ([batch, pos, head]), in a layer and a
stage (pre- or post-compose), optionally restricted to one head. For a branch output the head is the output
head; for a dynamic weight it is the weight's last axis (the input head for `qw1`/`kw1`, the output head for
`qw2`/`kw2`, the gated head for `qg`/`kg`). A *component* is sites ablated together. `dcinterp.patching` patches
the same sites.

- `branch_ablation`: the target's change when a component (a branch, per head, a whole stage, a layer's whole
  compose, or a branch in every layer) is zeroed or mean-ablated. Zeroing a branch output is the model without
  that branch (as `DCFormerConfig(compose_branches=...)` builds it), the reading of the paper's Table 9.
- `mean_activations`: the mean a mean ablation puts in, over the real tokens of a right-padded batch.
- `ablation_hooks`, `zero_weight_hooks`: the forward hooks that ablate a component, on its branch outputs or on its
  dynamic weights (the compose's no-hook path).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import pandas as pd
import torch
from jaxtyping import Int
from torch import Tensor

from .attribution import Target, check_target_inputs, target_value
from .checks import check_finite, check_tokens, real_lengths
from .model import HookedDCFormer, at_least_float32, visible_keys

STAGES = ("pre", "post")
BRANCH_OUTPUTS = ("o_qp", "o_kp", "o_qg", "o_kg")
DYNAMIC_WEIGHTS = ("qw1", "qw2", "kw1", "kw2", "qg", "kg")
SITE_NAMES = BRANCH_OUTPUTS + DYNAMIC_WEIGHTS
SITE_BRANCH = {
    "o_qp": "qp",
    "qw1": "qp",
    "qw2": "qp",
    "o_kp": "kp",
    "kw1": "kp",
    "kw2": "kp",
    "o_qg": "qg",
    "qg": "qg",
    "o_kg": "kg",
    "kg": "kg",
}
BRANCH_WEIGHTS = {"qp": ("qw1", "qw2"), "kp": ("kw1", "kw2"), "qg": ("qg",), "kg": ("kg",)}


# --------------------------------------------------------------------------------------------------
# Sites and components
@dataclass(frozen=True)
class Site:
    """One compose hook (a branch output or a dynamic weight) of a layer and stage, optionally one head of it.

    Attributes:
        layer: the layer.
        stage: "pre" or "post".
        name: the hook, one of SITE_NAMES (o_qp, ..., qw1, ..., kg).
        head: one head of it (None: every head). For a branch output the output head; for a dynamic weight its last
            axis.
    """

    layer: int
    stage: str
    name: str
    head: int | None = None

    @property
    def hook_name(self) -> str:
        return f"blocks.{self.layer}.attn.{self.stage}_compose.hook_{self.name}"

    @property
    def branch(self) -> str:
        return SITE_BRANCH[self.name]

    @property
    def head_axis(self) -> int:
        return 1 if self.name in BRANCH_OUTPUTS else -1

    def index(self) -> tuple:
        """Indexes the site's part of the hook's tensor (all of it, or one head)."""
        if self.head is None:
            return (...,)
        return (slice(None), self.head) if self.head_axis == 1 else (..., self.head)


def sites(
    model: HookedDCFormer,
    names: Sequence[str] = SITE_NAMES,
    layers: Sequence[int] | None = None,
    per_head: bool = False,
) -> list[Site]:
    """Every site the model has (its compose stages and branches), layer by layer, stage, then `names` order.

    Args:
        model: a DCMHA model.
        names: the hooks, among SITE_NAMES.
        layers: the layers (None: all).
        per_head: one site per head of each hook.

    Returns:
        The sites.
    """
    cfg = model.cfg
    names = [names] if isinstance(names, str) else list(names)
    if not names:
        raise ValueError(f"names is empty: pass site names ({', '.join(SITE_NAMES)})")
    unknown = sorted({str(n) for n in names} - set(SITE_NAMES))
    if unknown:
        raise ValueError(f"names: unknown site {unknown[0]!r} (known: {', '.join(SITE_NAMES)})")
    if not cfg.use_dcmha:
        raise ValueError(f"{cfg.model_name} has no DCMHA (use_dcmha=False): it has no compose sites")
    layers = _check_layers(model, layers)
    heads = range(cfg.n_heads) if per_head else [None]
    return [
        Site(layer, stage, name, head)
        for layer in layers
        for stage in STAGES
        if stage in cfg.compose_stages
        for name in names
        if SITE_BRANCH[name] in cfg.active_branches
        for head in heads
    ]


def _check_layers(model: HookedDCFormer, layers: Sequence[int] | None) -> list[int]:
    n_layers = model.cfg.n_layers
    if isinstance(layers, int):
        layers = [layers]
    layers = list(range(n_layers)) if layers is None else list(layers)
    if not layers:
        raise ValueError("layers is empty: pass layer indices, or None for every layer")
    bad = [
        layer for layer in layers if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < n_layers
    ]
    if bad:
        raise ValueError(f"layers: {bad[0]} is not a layer of this {n_layers}-layer model")
    return layers


def check_sites(model: HookedDCFormer, site_list: Sequence[Site], name: str = "components") -> None:
    """Check that the model has each site (layer, stage, hook and head).

    Args:
        model: the model.
        site_list: the sites.
        name: the argument named in the error.

    Raises:
        ValueError: one line naming `name`, for a site this model does not have.
    """
    cfg = model.cfg
    for site in site_list:
        if not isinstance(site, Site):
            raise TypeError(f"{name}: {site!r} is not a Site")
        if not isinstance(site.layer, int) or not 0 <= site.layer < cfg.n_layers:
            raise ValueError(f"{name}: layer {site.layer!r} is not a layer of this {cfg.n_layers}-layer model")
        if site.stage not in cfg.compose_stages or not cfg.use_dcmha:
            raise ValueError(
                f"{name}: stage {site.stage!r} is not a compose stage of this model "
                f"(it has {', '.join(cfg.compose_stages) if cfg.use_dcmha else 'none'})"
            )
        if site.name not in SITE_NAMES or SITE_BRANCH[site.name] not in cfg.active_branches:
            raise ValueError(
                f"{name}: site {site.name!r} is not one of this model's ({', '.join(SITE_NAMES)}; "
                f"branches {', '.join(cfg.active_branches)})"
            )
        if site.head is not None and (not isinstance(site.head, int) or not 0 <= site.head < cfg.n_heads):
            raise ValueError(f"{name}: head {site.head!r} is out of range: the model has heads 0..{cfg.n_heads - 1}")


@dataclass(frozen=True)
class Component:
    """Branch outputs ablated together, with the labels of their row in a table ("all" where it spans).

    Attributes:
        sites: the sites ablated together.
        layer: the row's layer label.
        stage: the row's stage label.
        branch: the row's branch label.
        head: the row's head label.
    """

    sites: tuple[Site, ...]
    layer: int | str
    stage: str
    branch: str
    head: int | str = "all"


def branch_components(
    model: HookedDCFormer, per_head: bool = False, layers: Sequence[int] | None = None
) -> list[Component]:
    """One component per (layer, stage, branch), or per (layer, stage, branch, output head).

    Args:
        model: a DCMHA model.
        per_head: one component per output head.
        layers: the layers (None: all).

    Returns:
        The components.
    """
    return [
        Component((site,), site.layer, site.stage, site.branch, "all" if site.head is None else site.head)
        for site in sites(model, BRANCH_OUTPUTS, layers, per_head)
    ]


def check_components(model: HookedDCFormer, components: Sequence[Component]) -> None:
    """Check a list of components against the model.

    Args:
        model: the model.
        components: the components.

    Raises:
        ValueError: one line naming `components`, for an empty list, a non-Component or a site the model does not
            have.
    """
    if not components:
        raise ValueError("components is empty: pass at least one Component (default: branch_components(model))")
    for component in components:
        if not isinstance(component, Component):
            raise TypeError(f"components: {component!r} is not a Component")
        if not component.sites:
            raise ValueError(f"components: {component} has no sites")
        check_sites(model, component.sites)


def stage_components(model: HookedDCFormer, layers: Sequence[int] | None = None) -> list[Component]:
    """One component per (layer, stage): the stage's every branch.

    Args:
        model: a DCMHA model.
        layers: the layers (None: all).

    Returns:
        The components.
    """
    found = sites(model, BRANCH_OUTPUTS, layers)
    keys = dict.fromkeys((site.layer, site.stage) for site in found)
    return [Component(tuple(s for s in found if (s.layer, s.stage) == key), *key, "all") for key in keys]


def layer_components(model: HookedDCFormer, layers: Sequence[int] | None = None) -> list[Component]:
    """One component per layer: its whole compose, both stages.

    Args:
        model: a DCMHA model.
        layers: the layers (None: all).

    Returns:
        The components.
    """
    found = sites(model, BRANCH_OUTPUTS, layers)
    return [
        Component(tuple(s for s in found if s.layer == layer), layer, "all", "all")
        for layer in dict.fromkeys(site.layer for site in found)
    ]


def everywhere_components(model: HookedDCFormer) -> list[Component]:
    """The post-hoc Table 9: each (stage, branch) in every layer, each stage in every layer, all of the compose.

    Args:
        model: a DCMHA model.

    Returns:
        The components.
    """
    found = sites(model, BRANCH_OUTPUTS)
    keys = dict.fromkeys((site.stage, site.branch) for site in found)
    by_branch = [Component(tuple(s for s in found if (s.stage, s.branch) == key), "all", *key) for key in keys]
    by_stage = [
        Component(tuple(s for s in found if s.stage == stage), "all", stage, "all")
        for stage in dict.fromkeys(site.stage for site in found)
    ]
    return by_branch + by_stage + [Component(tuple(found), "all", "all", "all")]


# --------------------------------------------------------------------------------------------------
# Ablation
MeanOver = Literal["position", "token"]


def _real_entries(model: HookedDCFormer, hook_name: str, activation: Tensor, lengths: Tensor) -> Tensor:
    """Where a hook's activation belongs to a real token: [batch, 1, query, key] for a branch output (a real
    query and a key it sees), [batch, pos, 1, ...] for a dynamic weight."""
    n_pos = activation.shape[2] if hook_name.split("hook_")[-1] in BRANCH_OUTPUTS else activation.shape[1]
    real = torch.arange(n_pos, device=activation.device)[None, :] < lengths[:, None].to(activation.device)
    if hook_name.split("hook_")[-1] in BRANCH_OUTPUTS:
        window = model.blocks[int(hook_name.split(".")[1])].attn.window
        seen = visible_keys(n_pos, window, activation.device, model.cfg.window)
        return (real[:, :, None] & seen[None])[:, None]
    return real.reshape(*real.shape, *[1] * (activation.ndim - 2))


def mean_activations(
    model: HookedDCFormer,
    tokens: Int[Tensor, "batch pos"],
    hook_names: Sequence[str],
    over: MeanOver = "position",
    lengths: Int[Tensor, " batch"] | None = None,
    templates: Sequence | None = None,
    width: int | None = None,
) -> dict[str, Tensor]:
    """Each hook's mean activation over the real tokens of a right-padded batch: pads never count.

    Args:
        model: the model.
        tokens: the batch [batch, pos].
        hook_names: the hooks.
        over: "position": at each position (each query and key for a branch output), the mean over the prompts that
            have a real token there; positions align only within one template. "token": the mean over every real token
            of every prompt (every real query and a key it sees, for a branch output): one value per head (and rank),
            put at every position (a branch output's only where a query sees the key, 0 elsewhere, as in the model).
        lengths: real tokens per prompt [batch] (None: up to the trailing pad tokens of the model's tokenizer).
        templates: one label per prompt; each prompt then gets the mean over the prompts with its label.
        width: the positions of the batch the means will replace (None: as `tokens`); a per-position mean is cropped
            or padded with zeros.

    Returns:
        Per hook, [1 or batch (with templates), ...] as its activation.
    """
    if over not in ("position", "token"):
        raise ValueError(f"mean_over must be 'position' or 'token', not {over!r}")
    lengths = real_lengths(model, tokens, lengths)
    labels = [0] * tokens.shape[0] if templates is None else list(templates)
    if len(labels) != tokens.shape[0]:
        raise ValueError(f"templates has {len(labels)} labels for {tokens.shape[0]} prompts")
    groups = {
        label: torch.tensor([l == label for l in labels], device=tokens.device) for label in dict.fromkeys(labels)
    }
    width = tokens.shape[1] if width is None else width
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=list(hook_names), stop_at_layer=model.cfg.n_layers)
    means = {}
    for name in hook_names:
        activation = at_least_float32(cache[name])
        real = _real_entries(model, name, activation, lengths)
        output = name.split("hook_")[-1] in BRANCH_OUTPUTS
        by_group = {}
        for label, rows in groups.items():
            x, r = activation[rows], real[rows].expand_as(activation[rows])
            if over == "position":
                mean = (x * r).sum(0) / r.sum(0).clamp(min=1)
                n = min(width, mean.shape[1 if output else 0])
                fitted = (
                    mean.new_zeros(mean.shape[0], width, width) if output else mean.new_zeros(width, *mean.shape[1:])
                )
                if output:
                    fitted[:, :n, :n] = mean[:, :n, :n]
                else:
                    fitted[:n] = mean[:n]
                by_group[label] = fitted
            elif output:
                mean = (x * r).sum((0, 2, 3)) / r.sum((0, 2, 3)).clamp(min=1)  # [head]
                window = model.blocks[int(name.split(".")[1])].attn.window
                by_group[label] = mean[:, None, None] * visible_keys(width, window, activation.device, model.cfg.window)
            else:
                mean = (x * r).sum((0, 1)) / r.sum((0, 1)).clamp(min=1)  # [rank, head] or [head]
                by_group[label] = mean.expand(width, *mean.shape)
        means[name] = torch.stack([by_group[label] for label in labels]) if templates is not None else by_group[0][None]
    return means


def ablation_hooks(component: Component, means: dict[str, Tensor] | None = None) -> list[tuple[str, Callable]]:
    """Forward hooks that set the component's sites to zero, or to `means`.

    Args:
        component: the sites.
        means: from `mean_activations` (None: zero).

    Returns:
        (hook name, hook) pairs for `run_with_hooks`.
    """

    def make_hook(site: Site):
        def hook(x: Tensor, hook) -> Tensor:
            value = torch.zeros_like(x) if means is None else means[site.hook_name].to(x.dtype).expand_as(x)
            if site.head is None:
                return value.clone()
            x = x.clone()
            x[site.index()] = value[site.index()]
            return x

        return hook

    return [(site.hook_name, make_hook(site)) for site in component.sites]


OUTPUT_HEAD_WEIGHT = {"qp": "qw2", "kp": "kw2", "qg": "qg", "kg": "kg"}  # the weight whose last axis is the output head


def zero_weight_hooks(component: Component) -> list[tuple[str, Callable]]:
    """Forward hooks that switch the component's branches off through their dynamic weights.

    `qw1` and `qw2` of `o_qp` (`kw1`, `kw2` of `o_kp`; `qg`; `kg`) are set to zero, or, for one head, the output
    head's slice of `qw2` (`kw2`, `qg`, `kg`). The branch output is then exactly zero, so this is
    `ablation_hooks(component)` (zero ablation), but the compose keeps its no-hook path (`dcinterp.dcmha.blocked` on a
    CPU), without a [batch, head, query, key] tensor per branch; `synth.commands.ablate.ablation_table` takes it
    for that (its cost against zeroed outputs: `benchmarks/bench_ablate.py`, docs/benchmarks.md). The result is the
    model built without the branch (`DCFormerConfig(compose_branches=...)` or `compose_stages=...`) bit for bit, and
    zeroing the branch outputs up to float32 rounding (the no-hook path adds in another order).

    Args:
        component: the branches to switch off.

    Returns:
        (hook name, hook) pairs for `run_with_hooks`.
    """

    def zero(x: Tensor, hook) -> Tensor:
        return torch.zeros_like(x)

    def zero_head(head: int):
        def hook(x: Tensor, hook) -> Tensor:
            x = x.clone()
            x[..., head] = 0
            return x

        return hook

    hooks = []
    for site in component.sites:
        if site.name not in BRANCH_OUTPUTS:
            raise ValueError(f"components: {site.hook_name} is not a branch output ({', '.join(BRANCH_OUTPUTS)})")
        compose = f"blocks.{site.layer}.attn.{site.stage}_compose"
        if site.head is None:
            hooks += [(f"{compose}.hook_{name}", zero) for name in BRANCH_WEIGHTS[site.branch]]
        else:
            hooks.append((f"{compose}.hook_{OUTPUT_HEAD_WEIGHT[site.branch]}", zero_head(site.head)))
    return hooks


@torch.no_grad()
def branch_ablation(
    model: HookedDCFormer,
    tokens: Int[Tensor, "batch pos"],
    target: Target,
    components: Sequence[Component] | None = None,
    ablation: Literal["zero", "mean"] = "zero",
    reference_tokens: Int[Tensor, "ref pos"] | None = None,
    position: int | Int[Tensor, " batch"] = -1,
    target_type: Literal["logit", "logprob", "prob"] = "logit",
    mean_over: MeanOver = "position",
    templates: Sequence | None = None,
    lengths: Int[Tensor, " ref"] | None = None,
) -> pd.DataFrame:
    """The target's change (mean over prompts) when each component is ablated: one row per component.

    Args:
        model: a DCMHA model.
        tokens: prompts [batch, pos].
        target: as in `attribution.head_attribution`: a token id or [batch] of ids, a word, or a function of the
            logits.
        components: None: `branch_components(model)`; also `branch_components(model, per_head=True)`,
            `stage_components`, `layer_components`, `everywhere_components`, or your own.
        ablation: "zero" (the model without the branch, the paper's reading) or "mean": the mean over the real tokens
            of `reference_tokens`, by `mean_over`.
        reference_tokens: the prompts of a "mean" ablation [ref, pos] (None: `tokens`; pads never count).
        position: as in `attribution.head_attribution`.
        target_type: as in `attribution.head_attribution`.
        mean_over: "position": each position's mean over the prompts that have a real token there (with `templates`,
            over the prompts of the same template only). "token": the mean over all real tokens, the same at every
            position. docs/conventions.md compares the rules.
        templates: one label per prompt, e.g. the task id; needs `reference_tokens` None.
        lengths: the reference prompts' real tokens [ref] (None: up to the tokenizer's trailing pad tokens; pass
            `pairs.position + 1` where the tokenizer has no pad token).

    Returns:
        Columns layer, stage, branch, head, clean, ablated, effect (negative: the component helps the target).

    Raises:
        ValueError: a bad argument, named.
    """
    tokens, target, position = check_target_inputs(model, tokens, target, position, target_type)
    if mean_over not in ("position", "token"):
        raise ValueError(f"mean_over must be 'position' or 'token', not {mean_over!r}")
    if isinstance(components, (str, Component)):
        raise TypeError(f"components must be a list of Component, not {components!r}")
    components = branch_components(model) if components is None else list(components)
    check_components(model, components)
    means = None
    if ablation == "mean":
        if templates is not None and reference_tokens is not None:
            raise ValueError(
                "templates: per-template means need the tokens to be their own reference (reference_tokens=None)"
            )
        reference = tokens if reference_tokens is None else check_tokens(model, reference_tokens, "reference_tokens")
        names = list(dict.fromkeys(site.hook_name for c in components for site in c.sites))
        means = mean_activations(model, reference, names, mean_over, lengths, templates, tokens.shape[1])
        if mean_over == "position" and templates is None and len(reference) == 1:
            warnings.warn(
                "branch_ablation: a mean over one prompt is, at each position, that prompt's own activation, so "
                "every effect is 0: give several prompts (or reference_tokens=), or mean_over='token'",
                stacklevel=2,
            )
        if mean_over == "position" and reference_tokens is not None:
            longest = int(real_lengths(model, reference, lengths).max())
            if int(real_lengths(model, tokens).max()) > longest:
                raise ValueError(
                    f"reference_tokens: its prompts have at most {longest} real tokens, fewer than "
                    "tokens': no per-position mean at the later positions (use mean_over='token')"
                )
    elif ablation != "zero":
        raise ValueError(f"ablation must be 'zero' or 'mean', not {ablation!r}")
    clean = target_value(model, tokens, target, position, target_type)
    rows, values = [], {"the clean target": clean}
    for component in components:
        hooks = ablation_hooks(component, means)
        ablated = target_value(model, tokens, target, position, target_type, hooks)
        values[f"the target with {component.sites[0].hook_name} ablated"] = ablated
        rows.append(
            {
                "layer": component.layer,
                "stage": component.stage,
                "branch": component.branch,
                "head": component.head,
                "clean": clean.mean().item(),
                "ablated": ablated.mean().item(),
                "effect": (ablated - clean).mean().item(),
            }
        )
    check_finite(model, values, "branch_ablation", lambda: target_value(model, tokens, target, position, target_type))
    return pd.DataFrame(rows, columns=["layer", "stage", "branch", "head", "clean", "ablated", "effect"])
