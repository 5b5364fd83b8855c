"""Plain multi-head attention (a model with `use_dcmha=False`) by torch's `scaled_dot_product_attention`."""

from __future__ import annotations

import contextlib

import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from .inputs import AttentionInputs

# A step with cached keys names its backends rather than leave them to torch's default choice, which can pick a slow
# one for an additive mask and a new key length each step (docs/benchmarks.md, "Plain MHA with a cache").
SDPA_BACKENDS_WITH_CACHE = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_z(inputs: AttentionInputs) -> Float[Tensor, "b t h e"]:
    """z of plain MHA by `scaled_dot_product_attention`.

    A prompt with causal masking alone says so (`is_causal`), which lets a GPU take its flash kernel; a step with
    cached keys takes `SDPA_BACKENDS_WITH_CACHE`.

    Args:
        inputs: the call's q, k, v, mask and window (no dynamic weights).

    Returns:
        z [b, t, h, e], in q's dtype.
    """
    q, k, v, mask = inputs.q, inputs.k, inputs.v, inputs.mask
    causal_only = mask.ndim == 2 and inputs.window is None and k.shape[1] == q.shape[1]
    cached = k.shape[1] != q.shape[1]
    with sdpa_kernel(SDPA_BACKENDS_WITH_CACHE) if cached and q.is_cuda else contextlib.nullcontext():
        z = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=None if causal_only else mask.to(q.dtype),
            is_causal=causal_only,
        )
    return z.transpose(1, 2)
