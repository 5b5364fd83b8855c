"""The Triton path: z by the fused kernels (`dcinterp.dcmha.maps.fused_dcmha`), never a [b, h, t, s] tensor.

Where the kernels cannot give a result, the materialised formula (`dcinterp.dcmha.materialised.attend`) does: Triton
refusing to build them for the card at their first launch (forward or backward: said once, and the device's later
calls take the materialised path), and second derivatives (`create_graph=True`), which the kernels' backward does not
compute.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from . import materialised
from .families import FUSED
from .inputs import AttentionInputs


def triton_z(inputs: AttentionInputs) -> Float[Tensor, "b t h e"]:
    """z of DCMHA by the fused Triton kernels, falling back on the materialised formula where they cannot.

    Args:
        inputs: the call's inputs; the kernels read `real` in place of a [b, 1, t, s] mask.

    Returns:
        z [b, t, h, e], differentiable in q, k, v and every dynamic weight.
    """
    from . import maps

    q, k, v, mask = inputs.q, inputs.k, inputs.v, inputs.mask
    pre, post = inputs.stages(key_last=False)

    def fallback(refusal, dz, q, k, v, weights):
        if refusal is not None:
            FUSED.refuse(refusal, q.device)
        inputs, second_order = (q, k, v, *weights), torch.is_grad_enabled()
        wanted = [x for x in inputs if x is not None and x.requires_grad]
        with torch.enable_grad():
            z = materialised.attend(q, k, v, mask, weights[:6] if pre else None, weights[6:] if post else None)
            grads = iter(torch.autograd.grad(z, wanted, dz, create_graph=second_order, allow_unused=True))
        return [next(grads) if x is not None and x.requires_grad else None for x in inputs]

    def kernels():
        return maps.fused_dcmha(
            q, k, v, pre, post, window=inputs.window, official=inputs.official, past=inputs.past, real=inputs.real,
            fallback=fallback,
        )  # fmt: skip

    return FUSED.run(q.device, kernels, lambda: materialised.attend(q, k, v, mask, pre, post))
