"""The norms: LayerNorm or RMSNorm over the model dim (`ln1`, `ln2`, `ln_final`), and QK-norm over the head dim."""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from .helpers import at_least_float32


class Norm(nn.Module):
    """LayerNorm (with bias) or RMSNorm, computed in at least float32, with TransformerLens' hook names."""

    def __init__(self, d: int, kind: str, eps: float):
        super().__init__()
        self.kind, self.eps = kind, eps
        self.w = nn.Parameter(torch.ones(d))
        self.b = nn.Parameter(torch.zeros(d)) if kind == "LN" else None
        self.hook_scale = HookPoint()  # [batch, pos, 1]
        self.hook_normalized = HookPoint()  # [batch, pos, d_model], after weight and bias

    def forward(self, x: Float[Tensor, "b p d"]) -> Float[Tensor, "b p d"]:
        dtype = x.dtype
        x = at_least_float32(x)
        if self.kind == "LN":
            x = x - x.mean(-1, keepdim=True)
        scale = self.hook_scale((x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        x = (x / scale).to(dtype) * self.w
        if self.b is not None:
            x = x + self.b
        return self.hook_normalized(x)


class HeadRMSNorm(nn.Module):
    """QK-norm: RMSNorm with a learned scale over the head dim (eps 1e-6).

    `hook_inv_scale` [batch, pos, head, 1] (float32; float64 in a float64 run) is rsqrt(mean x² + eps), what
    multiplies each head's q or k: a hook that returns the clean run's value freezes the QK-norm (dcinterp.qk's
    causal checks). The inverse is hooked, not the norms' `hook_scale` divisor, so that the arithmetic is the
    released code's whether or not anything reads it."""

    def __init__(self, d_head: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.w = nn.Parameter(torch.ones(d_head))
        self.hook_inv_scale = HookPoint()

    def forward(self, x: Float[Tensor, "b p h e"]) -> Float[Tensor, "b p h e"]:
        xf = at_least_float32(x)
        inv_scale = self.hook_inv_scale(torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))
        return (xf * inv_scale).to(x.dtype) * self.w
