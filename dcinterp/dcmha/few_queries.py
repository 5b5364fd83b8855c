"""The few-queries path: a cached step of at most `dcinterp.dcmha.FEW_QUERIES` new queries, in the fewest operations.

The materialised arithmetic, with the key side in its low-rank form as the key-value cache holds it: the scores and
`P' V` are two batched matmuls, and the pattern between them (both stages' compose, the mask and the softmax) is
`dcinterp.dcmha.decoding`'s, by torch's ops or in two Triton launches (`decoding_pattern_path`). On a GPU a
decoding step costs the kernels it launches, not its arithmetic.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from jaxtyping import Float
from torch import Tensor

from .families import DECODING, KERNEL_DTYPES
from .inputs import AttentionInputs, Stage

DecodingPatternPath = Literal["triton", "torch"]


def decoding_pattern_path(
    *, device: torch.device, dtypes: set[torch.dtype], gradient_needed: bool
) -> DecodingPatternPath:
    """How a decoding step's pattern is computed.

    Args:
        device: the device the tensors are on.
        dtypes: those of the scores, the mask and the dynamic weights.
        gradient_needed: grad mode is on and an input requires grad (the kernels have no backward).

    Returns:
        "triton" (two launches) on CUDA where the decoding kernels run, in float32, float16 or bfloat16, without
        gradients; "torch" (about twenty launches) otherwise.
    """
    if device.type != "cuda" or gradient_needed or not dtypes <= set(KERNEL_DTYPES):
        return "torch"
    return "torch" if DECODING.unavailable(device) is not None else "triton"


def decoding_pattern(
    scores: Float[Tensor, "b h t s"], mask: Tensor, pre: Stage | None, post: Stage | None, scale: float
) -> Float[Tensor, "b h t s"]:
    """A decoding step's pattern P', by the path `decoding_pattern_path` picks.

    Args:
        scores: q . k, unscaled.
        mask: additive, [t, s] or [b, 1, t, s].
        pre: the pre-compose's weights, the key side key-last; None for a stage that is off.
        post: the post-compose's, the same.
        scale: what multiplies the composed scores, 1 / sqrt(d_head).

    Returns:
        P' [b, h, t, s]. Where Triton refuses to build the kernels for the card, that call and the device's later
        ones take torch's ops (said once).
    """
    from . import decoding

    weights = [w for stage in (pre, post) if stage is not None for w in stage if w is not None]
    path = decoding_pattern_path(
        device=scores.device,
        dtypes={scores.dtype, mask.dtype, *(w.dtype for w in weights)},
        gradient_needed=torch.is_grad_enabled() and any(t.requires_grad for t in (scores, *weights)),
    )
    if path == "torch":
        return decoding.torch_decoding_pattern(scores, mask, pre, post, scale)
    return DECODING.run(
        scores.device,
        lambda: decoding.fused_decoding_pattern(scores, mask, pre, post, scale),
        lambda: decoding.torch_decoding_pattern(scores, mask, pre, post, scale),
    )


def few_queries_z(inputs: AttentionInputs) -> Float[Tensor, "b t h e"]:
    """z of a cached step of a few queries: the scores, `decoding_pattern`, P' V.

    Args:
        inputs: the call's inputs (its dynamic weights' key side taken key-last).

    Returns:
        z [b, t, h, e], equal to the materialised path's up to float rounding.
    """
    q, k, v = inputs.q, inputs.k, inputs.v
    scores = q.transpose(1, 2) @ k.permute(0, 2, 3, 1)  # [b, h, t, s]
    pattern = decoding_pattern(scores, inputs.mask, *inputs.stages(key_last=True), scale=1 / math.sqrt(q.shape[-1]))
    return (pattern @ v.transpose(1, 2)).transpose(1, 2)
