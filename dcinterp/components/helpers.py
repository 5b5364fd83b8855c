"""What the components share: the float32 floor of their arithmetic, and whether a hook point is read."""

from __future__ import annotations

import torch
from torch import Tensor
from transformer_lens.hook_points import HookPoint


def at_least_float32(x: Tensor) -> Tensor:
    """x in float32 if it is in a half dtype, else as it is: the norms, the rotary embedding and the softmaxes
    compute in at least float32, and a float64 run stays float64 throughout (it judges the others)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def hooked(hook: HookPoint) -> bool:
    """Whether anything reads or sets the hook point: a TransformerLens or torch hook, or a wrapped forward.

    Args:
        hook: the hook point.

    Returns:
        True where a hook, a cache or a replaced forward (an active nnsight trace) reads it.
    """
    return bool(hook.fwd_hooks or hook.bwd_hooks or hook._forward_hooks or hook._backward_hooks) or _wrapped(hook)


def _wrapped(hook: HookPoint) -> bool:
    """nnsight reads and sets a module's output by replacing its `forward`; it intervenes only while one of its
    traces is active, so outside them the fused compose path stays. accelerate's device hooks (`_hf_hook`) only move
    tensors; any other replaced forward counts as a reader."""
    forward = hook.__dict__.get("forward")
    if forward is None:
        return False
    active = getattr(getattr(forward, "state", None), "active", None)
    if active is None:
        return not hasattr(hook, "_hf_hook")
    try:
        return active()[0] is not None
    except Exception:  # noqa: BLE001 (nnsight's internals changed: count the hook point as read)
        return True
