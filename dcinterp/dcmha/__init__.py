"""The ways one attention layer is computed: `choose_path` picks one per call, `attend` computes z by it.

Every path takes the call's `AttentionInputs` and gives z equal to the materialised one up to float rounding. The
first rule that applies decides:

| rule (the first that applies)                                      | path         | z by                      |
| ------------------------------------------------------------------ | ------------ | ------------------------- |
| a hook, cache or nnsight trace on a [b, h, t, s] tensor; functorch | materialised | Attention.materialised_z  |
| plain MHA (`use_dcmha=False`)                                      | sdpa         | sdpa.sdpa_z               |
| CUDA, the fused kernels run, a kernel dtype, no decoding step      | triton       | fused.triton_z            |
|   but a gradient under `FUSED_MIN_KEYS` keys that fits (1)         | materialised | Attention.materialised_z  |
| a cached step of at most `FEW_QUERIES` new queries                 | few_queries  | few_queries.few_queries_z |
| the CPU                                                            | blocked      | blocked.blocked_z         |
| any other device                                                   | materialised | Attention.materialised_z  |

(1) what the materialised path keeps for the backward, in this layer and the layers after it
(`materialised_saved_bytes`), takes at most `MATERIALISED_MEMORY_FRACTION` of the device's free memory.

Where the kernels cannot run (no Triton, an old one, a card that refused them: `families.FUSED`) one warning per
reason says why, and the later rules apply. The dynamic weights (from the layer's input, for every path) take one
Triton launch or torch's ops, as `dynamic_weights_path` says. The hooks on the dynamic weights (`hook_qw1`, ...,
`hook_kg`) act on every path: the weights pass through them before the path is taken. Second derivatives
(`create_graph=True`) are exact on every path.

To add a path: a module with a `*_z(inputs)` function, a rule in `choose_path`, an entry in `PATHS`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from .. import devices
from . import blocked, few_queries, fused, materialised, sdpa
from .families import DYNAMIC_WEIGHTS, FUSED, KERNEL_DTYPES
from .inputs import AttentionInputs, Stage

__all__ = [
    "AttentionInputs",
    "Path",
    "PATHS",
    "attend",
    "choose_path",
    "compute_dynamic_weights",
    "dynamic_weights_path",
    "materialised_saved_bytes",
    "triton_unavailable",
    "KERNEL_DTYPES",
    "Stage",
]

Path = Literal["materialised", "few_queries", "blocked", "triton", "sdpa"]
DynamicWeightsPath = Literal["triton", "torch"]

FEW_QUERIES = 16  # with a key-value cache, up to this many new queries take the few-queries path
# The prompt lengths from which the kernels take a call, with and without a gradient, and whether decoding steps
# take them: chosen by measurement (docs/benchmarks.md, "DCMHA's thresholds").
FUSED_MIN_KEYS = 2048
FUSED_MIN_KEYS_WITHOUT_GRADIENTS = 0
FUSED_DECODING = False
# Below FUSED_MIN_KEYS a gradient takes the materialised path only while the [b, h, t, s] tensors it keeps for the
# backward, of this layer and the layers after it, would take at most this fraction of the device's free memory: the
# rest goes to what every path keeps (activations, logits) and to the backward's passing tensors.
MATERIALISED_MEMORY_FRACTION = 0.25
# Up to this many positions (batch times sequence) the dynamic weights' kernel is taken: past them torch's matmuls
# are faster (docs/benchmarks.md, "DCMHA's thresholds").
FUSED_DYNAMIC_WEIGHTS_POSITIONS = 1024


def _unhooked_materialised_z(inputs: AttentionInputs) -> Tensor:
    return materialised.attend(inputs.q, inputs.k, inputs.v, inputs.mask, *inputs.stages(key_last=False))


PATHS: dict[str, Callable[[AttentionInputs], Tensor]] = {
    "materialised": _unhooked_materialised_z,  # the model takes its hooked `Attention.materialised_z` instead
    "sdpa": sdpa.sdpa_z,
    "triton": fused.triton_z,
    "few_queries": few_queries.few_queries_z,
    "blocked": blocked.blocked_z,
}


def attend(path: Path, inputs: AttentionInputs) -> Tensor:
    """z of one attention call by `path`.

    Args:
        path: what `choose_path` said. "materialised" here is the formula without hooks
            (`dcinterp.dcmha.materialised.attend`).
        inputs: the call's q, k, v, mask, window and dynamic weights.

    Returns:
        z [b, t, h, e].
    """
    return PATHS[path](inputs)


def materialised_saved_bytes(batch: int, heads: int, queries: int, keys: int, dtype: torch.dtype) -> int:
    """The bytes of [b, h, t, s] tensors the materialised path keeps for one layer's backward, every branch on.

    They are the input of each compose stage's two maps (four), the softmax's output in float32 or wider, and the
    pattern for P' V; fewer with some branches off (counted in tests/test_dcmha_dispatch.py).

    Args:
        batch: b.
        heads: h.
        queries: t.
        keys: s.
        dtype: the layer's input's.

    Returns:
        The bytes.
    """
    softmax_itemsize = max(dtype.itemsize, torch.float32.itemsize)
    return batch * heads * queries * keys * (5 * dtype.itemsize + softmax_itemsize)


def triton_unavailable(device: torch.device) -> str | None:
    """Why the fused kernels cannot run on `device`.

    Args:
        device: the device the tensors are on.

    Returns:
        None where they can, else the reason in one line.
    """
    return FUSED.unavailable(device)


def choose_path(
    *,
    dcmha: bool,
    device: torch.device,
    square_tensor_read: bool,
    functorch_active: bool = False,
    cached_queries: int | None = None,
    padding_as_mask_only: bool = False,
    keys: int | None = None,
    gradient_needed: bool = True,
    materialised_bytes: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Which path computes one attention call, by the table of this module's docstring.

    Args:
        dcmha: the layer is DCMHA, not plain MHA.
        device: the device the layer's input is on.
        square_tensor_read: a hook, cache or nnsight trace reads or sets a [b, h, t, s] tensor of the layer.
        functorch_active: `torch._C._are_functorch_transforms_active()`.
        cached_queries: with a key-value cache, the number of new queries; None without one.
        padding_as_mask_only: padded keys are hidden by the additive mask alone, without the [b, s] table of real
            keys the kernels take (a direct call of `Attention`).
        keys: how many keys the queries attend over, cached ones included; None: not known.
        gradient_needed: grad mode is on and the layer's input or a parameter requires grad.
        materialised_bytes: with a gradient, what the materialised path would keep for the backward in this layer
            and the layers after it (`materialised_saved_bytes` each); the free memory is asked only when it
            matters.
        dtype: the layer's input's.

    Returns:
        The path's name, a key of `PATHS`.
    """
    if square_tensor_read or functorch_active:
        return "materialised"
    if not dcmha:
        return "sdpa"
    decoding = cached_queries is not None and cached_queries <= FEW_QUERIES
    if device.type == "cuda" and not padding_as_mask_only and dtype in KERNEL_DTYPES:
        reason = triton_unavailable(device)
        if reason is None:
            if decoding and not FUSED_DECODING:
                return "few_queries"
            short = keys is not None and keys < (
                FUSED_MIN_KEYS if gradient_needed else FUSED_MIN_KEYS_WITHOUT_GRADIENTS
            )
            if short and not _too_large_for_memory(materialised_bytes, device):
                return "materialised"
            return "triton"
        FUSED.warn(reason, device)
    if decoding:
        return "few_queries"
    return "blocked" if device.type == "cpu" else "materialised"


def _too_large_for_memory(nbytes: int, device: torch.device) -> bool:
    """Whether `nbytes` would take more than MATERIALISED_MEMORY_FRACTION of the device's free memory."""
    return nbytes > 0 and nbytes > MATERIALISED_MEMORY_FRACTION * devices.free_memory(device)


def dynamic_weights_path(
    *, device: torch.device, dtypes: set[torch.dtype], positions: int, functorch_active: bool = False
) -> DynamicWeightsPath:
    """How a layer's dynamic weights are computed.

    Args:
        device: the device the layer's input is on.
        dtypes: those of the layer's input and its W_dyn_* / b_dyn_* parameters.
        positions: the input's batch times sequence.
        functorch_active: `torch._C._are_functorch_transforms_active()`.

    Returns:
        "triton" (one launch, `dcinterp.dcmha.dynamic_weights.fused_dynamic_weights`) on CUDA where the kernel
        runs, in float32, float16 or bfloat16, at up to `FUSED_DYNAMIC_WEIGHTS_POSITIONS` positions, without a
        functorch transform; "torch" (`torch_dynamic_weights`) otherwise.
    """
    if device.type != "cuda" or functorch_active or positions > FUSED_DYNAMIC_WEIGHTS_POSITIONS:
        return "torch"
    if not dtypes <= set(KERNEL_DTYPES) or DYNAMIC_WEIGHTS.unavailable(device) is not None:
        return "torch"
    return "triton"


def compute_dynamic_weights(x: Tensor, W_in, b_in, W_out, W_gate, b_gate) -> tuple[Tensor, Tensor, Tensor]:
    """A layer's dynamic weights, by the path `dynamic_weights_path` picks.

    Args:
        x: the layer's normed input [b, p, d].
        W_in: [d, 4, K].
        b_in: [4, K] or None.
        W_out: [4, K, 2R, H].
        W_gate: [d, 4, H].
        b_gate: [4, H] or None.

    Returns:
        (w1, w2 [b, p, 4, R, H], gates [b, p, 4, H]). Where Triton refuses to build a kernel for the card (forward
        or backward), that call and the device's later ones take torch's ops (said once).
    """
    from . import dynamic_weights

    weights = (x, W_in, b_in, W_out, W_gate, b_gate)
    path = dynamic_weights_path(
        device=x.device,
        dtypes={t.dtype for t in weights if t is not None},
        positions=x.shape[0] * x.shape[1],
        functorch_active=torch._C._are_functorch_transforms_active(),
    )
    if path == "torch":
        return dynamic_weights.torch_dynamic_weights(*weights)
    return DYNAMIC_WEIGHTS.run(
        x.device,
        lambda: dynamic_weights.fused_dynamic_weights(
            *weights, on_refusal=lambda refusal: DYNAMIC_WEIGHTS.refuse(refusal, x.device)
        ),
        lambda: dynamic_weights.torch_dynamic_weights(*weights),
    )
