"""Which keys a query sees (causal, local windows, padding), as booleans and as the additive mask of the scores."""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float
from torch import Tensor


def visible_keys(n: int, window: int | None, device, semantics: str = "training", past: int = 0) -> Bool[Tensor, "t s"]:
    """True where query t may see key s: s <= t, and for a local layer t - window < s ("training": `window`
    keys) or t - window <= s ("official-inference": window + 1 keys). With `past` cached positions, the n queries
    are positions past..past+n-1 and the keys 0..past+n-1 ([n, past + n])."""
    t = torch.arange(past, past + n, device=device)[:, None]
    s = torch.arange(past + n, device=device)[None, :]
    allowed = s <= t
    if window is not None:
        allowed &= s > t - window - int(semantics == "official-inference")
    return allowed


def attention_mask(
    n: int,
    window: int | None,
    device,
    dtype=torch.float32,
    semantics: str = "training",
    past: int = 0,
    real: Bool[Tensor, "b s"] | None = None,
) -> Float[Tensor, "t s"] | Float[Tensor, "b 1 t s"]:
    """The same as an additive mask: 0 where query t may see key s, else the dtype's minimum (as TransformerLens).

    Added to the scores it gives the minimum at hidden keys (an add: faster than masked_fill on a CPU).
    `real` [b, past + n], False at padding: padded keys are hidden too (a padded query sees itself), per row."""
    visible = visible_keys(n, window, device, semantics, past)
    if real is not None:
        itself = torch.arange(past, past + n, device=device)[:, None] == torch.arange(past + n, device=device)
        visible = visible & (real.to(device)[:, None, :] | itself)
        visible = visible[:, None]  # [b, 1, t, s]
    return torch.zeros(visible.shape, device=device, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)
