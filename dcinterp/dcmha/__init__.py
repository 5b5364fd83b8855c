"""The ways one attention layer is computed, and the one function that picks among them (`choose_path`).

Paths, and when `choose_path` takes each (first rule that applies):
- `materialised` (`Attention.materialised_z`, the compose forms of `dcinterp.dcmha.materialised`): every
  `[b, h, t, s]` tensor built and passed through its hook. Taken when a hook, a `run_with_cache` entry or an
  nnsight trace reads or sets a square tensor of the layer (scores, patterns, a branch output), or a functorch
  transform (`vmap`, `grad`, ...) is active; on any device.
- `sdpa`: plain MHA (`use_dcmha=False`) otherwise, by `torch.nn.functional.scaled_dot_product_attention`.
- `triton` (`dcinterp.dcmha.triton_kernels.fused_dcmha`: without gradients its forward through the cross-head
  maps, with them the forward and fused backward that `triton_kernels.BACKWARD` names: through the maps, 2.2-3.3x
  faster than through the tiles on an H100, or through the tiles): DCMHA on CUDA where the kernels run, in
  float32, float16 or bfloat16 (float64 takes the paths after this one), for every prompt when
  no gradient is needed (`FUSED_MIN_KEYS_WITHOUT_GRADIENTS`), and for prompts of at least `FUSED_MIN_KEYS` keys
  when one is. Shorter prompts with gradients take the materialised path and cached decoding steps the few-queries
  one, where the kernels measured slower (the numbers are beside the thresholds; `FUSED_DECODING = True` sends
  decoding steps to the kernels too); but a shorter prompt with gradients takes the kernels where what the
  materialised path would keep for the backward, in this layer and the layers after it (`materialised_saved_bytes`),
  would take more than `MATERIALISED_MEMORY_FRACTION` of the device's free memory. Where the kernels
  cannot run (no Triton, an old one, or Triton refusing to build them for the card at their first launch, e.g. past
  its shared memory: that call is then computed by `materialised.attend`), one warning per reason names why, and
  the next rules apply.
- `few_queries` (`Attention.few_queries_z`: `materialised_z`'s arithmetic in the fewest operations, the key side in
  its low-rank form, as the cache holds it): a cached step of at most `FEW_QUERIES` new queries. Its pattern
  between the two matmuls (both stages' compose, the mask, the softmax: `dcinterp.dcmha.decoding`) takes two Triton
  launches on CUDA where the kernels run and no gradient is needed, torch's ops (about twenty) otherwise, as
  `decoding_pattern_path` says.
- `blocked` (`dcinterp.dcmha.blocked`: a block of queries at a time, never a `[b, h, t, s]` tensor): on the CPU.
- `materialised` on any other device.

The dynamic weights (w1, w2 and the gates of every branch, from the layer's input) are computed one of two ways,
said by `dynamic_weights_path` (`dcinterp.dcmha.dynamic_weights`):
- `triton` (`fused_dynamic_weights`, one kernel launch in place of about a dozen, and with gradients a backward of
  one launch and two matmuls in place of about twenty ops): on CUDA where the Triton kernels run, in float32,
  float16 or bfloat16, for at most `FUSED_DYNAMIC_WEIGHTS_POSITIONS` positions (batch times sequence: past those,
  torch's matmuls are faster), when no functorch transform is active. Triton refusing to build a kernel for the
  card (forward or backward) says so in one warning, and the device's calls then take torch's ops.
- `torch` (`torch_dynamic_weights`): otherwise.

Every path gives z equal to the materialised one up to float rounding. The hooks on the dynamic weights
(`hook_qw1`, ..., `hook_kg`) act on every path: the weights pass through them before the path is taken.
Second derivatives (`create_graph=True`) are exact on every path: the blocked path differentiates its blocks
again, and the Triton path recomputes its backward with `materialised.attend` (its kernels' backward is first
order only), the dynamic weights' kernel with torch's ops.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch
from torch import Tensor

from .. import devices
from . import materialised

Path = Literal["materialised", "few_queries", "blocked", "triton", "sdpa"]
DynamicWeightsPath = Literal["triton", "torch"]
DecodingPatternPath = Literal["triton", "torch"]

FEW_QUERIES = 16  # with a key-value cache, up to this many new queries take a decoding path
# Where the fused kernels pay on a GPU, from one layer's attention on an NVIDIA H100 (bfloat16, 32 heads of 128,
# benchmarks/bench_gpu_attention.py) against the materialised arithmetic: forward 1.82x its time at 1,024 keys,
# 0.93x at 2,048, 0.69-0.79x at 4,096-8,192; forward + backward 2.65x, 1.35x, 1.01-1.05x; peak memory 1/21 to 1/170
# of its. A decoding step took 4.3x (1,024 keys) and 18.6x (4,096) the materialised step's time (one program walks
# every key): decoding keeps the few-queries path. With gradients those figures are the tiles' backward; through the
# maps one layer took 2.2-3.3x less (H100, 512-4,096 tokens), a whole 6.9B-wide model's forward + backward 0.53x the
# materialised path's at 2,048 tokens, 1.18x at 128 (benchmarks/results/h100-2026-11-27-quick-maps-fmk0.txt); at
# 512-1,024 not measured, so the threshold stays.
FUSED_MIN_KEYS = 2048
# Without gradients the kernels' forward goes through the cross-head maps (triton_kernels): on an NVIDIA H200 (the same
# layer, one run: benchmarks/results/h200-2026-11-27-maps-sweep-1.jsonl) 0.70 ms against the materialised path's 1.1
# ms at 512 keys, 0.98 against 2.6 at 1,024, 6.9 against 28.6 at 4,096, memory growing with the prompt alone; whole
# models at 128 tokens within 10% of the materialised path either way. So it is taken at every length.
FUSED_MIN_KEYS_WITHOUT_GRADIENTS = 0
FUSED_DECODING = False
# Below FUSED_MIN_KEYS a gradient takes the materialised path only while the [b, h, t, s] tensors it keeps for the
# backward, of this layer and the layers after it, would take at most this fraction of the device's free memory. On
# the H100 that path held 1.4-4.9x the SDPA twin's memory at 512-1,024 tokens (the kernels 1.02-1.09x from 2,048):
# at 1,024 tokens, 469 MB a layer of DCPythia-6.9B's width, 15 GB for its 32 layers, where a 24 GB card has about
# 9.5 GB beside the weights. The rest of the memory goes to what every path keeps (the twin's 190 MB a layer
# there, the MLPs' and the residual stream's activations, the logits) and to the backward's passing tensors.
MATERIALISED_MEMORY_FRACTION = 0.25
# Up to this many positions the fused dynamic weights are faster than torch's ops (an H100, the 6.9B width: bfloat16
# 0.06 against 0.18-0.27 ms at 16-512 positions, 0.09 against 0.17 at 2,048, 0.38 against 0.17 at 8,192; float32
# 0.12 against 0.15 at 16-512, 0.39 against 0.28 at 2,048)
FUSED_DYNAMIC_WEIGHTS_POSITIONS = 1024

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the Triton kernels compute in
_warned: set[str] = set()  # the warnings already given, so that each is said once per process
_refused: dict[str, str] = {}  # per device, why Triton refused to compile the kernels for it (its first launch)
_refused_dynamic_weights: dict[str, str] = {}  # the same, for the dynamic weights' kernel
_refused_decoding: dict[str, str] = {}  # the same, for the decoding step's kernels


def materialised_saved_bytes(batch: int, heads: int, queries: int, keys: int, dtype: torch.dtype) -> int:
    """The bytes of the [b, h, t, s] tensors the materialised path keeps for the backward of one layer with every
    branch on (fewer with some off): the input of each compose stage's two maps (four), the softmax's output in
    float32 or wider, and the pattern for P' V (counted in tests/test_dcmha_dispatch.py)."""
    softmax_itemsize = max(dtype.itemsize, torch.float32.itemsize)
    return batch * heads * queries * keys * (5 * dtype.itemsize + softmax_itemsize)


def triton_unavailable(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on `device` (None when they can), as one line."""
    if str(device) in _refused:
        return _refused[str(device)]
    try:
        from . import triton_kernels
    except ImportError as error:
        return f"the Triton kernels cannot be imported ({error})"
    return triton_kernels.available(device)


def _warn_once(reason: str, device: torch.device, fallback: str = "DCMHA on {device} takes the materialised path"):
    message = f"{fallback.format(device=device)}: {reason}"
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


def _compile_refusals() -> tuple[type[Exception], ...]:
    """The errors by which Triton says it cannot build a kernel for the card at hand (shared memory, registers, an
    operation the card lacks), as opposed to a bug: those the dispatch answers with the materialised path."""
    try:
        from triton.compiler.errors import CompilationError
        from triton.runtime.errors import OutOfResources
    except ImportError:
        return ()
    return (OutOfResources, CompilationError)


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
    """Which path computes one attention call (the table in this module's docstring).

    `square_tensor_read`: a hook (or cache, or nnsight trace) reads or sets a [b, h, t, s] tensor of the layer;
    `functorch_active`: `torch._C._are_functorch_transforms_active()`; `cached_queries`: with a key-value cache,
    the number of new queries (None without one); `padding_as_mask_only`: padded keys are hidden by the additive
    mask alone, without the [b, s] table of real keys the kernels take (a direct call of `Attention`); `keys`: how
    many keys the queries attend over (cached ones included; None: not known, as many as the kernels need);
    `gradient_needed`: grad mode is on and the layer's input or a parameter requires grad; `materialised_bytes`:
    with a gradient, what the materialised path would keep for the backward in this layer and the layers after it
    (`materialised_saved_bytes` each; the device's free memory is asked only when it matters); `dtype`: the
    layer's input's (the kernels take float32, float16 and bfloat16; float64 takes the materialised path on CUDA)."""
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
        _warn_once(reason, device)
    if decoding:
        return "few_queries"
    return "blocked" if device.type == "cpu" else "materialised"


def _too_large_for_memory(nbytes: int, device: torch.device) -> bool:
    """Whether `nbytes` would take more than MATERIALISED_MEMORY_FRACTION of the device's free memory."""
    return nbytes > 0 and nbytes > MATERIALISED_MEMORY_FRACTION * devices.free_memory(device)


def dynamic_weights_path(
    *,
    device: torch.device,
    dtypes: set[torch.dtype],
    positions: int,
    functorch_active: bool = False,
) -> DynamicWeightsPath:
    """How a layer's dynamic weights are computed (this module's docstring): `dtypes`, those of the layer's input
    and its W_dyn_* / b_dyn_* parameters; `positions`: the input's batch times sequence."""
    if device.type != "cuda" or functorch_active or str(device) in _refused_dynamic_weights:
        return "torch"
    if positions > FUSED_DYNAMIC_WEIGHTS_POSITIONS:
        return "torch"
    if not dtypes <= set(KERNEL_DTYPES) or triton_unavailable(device) is not None:
        return "torch"
    return "triton"


def compute_dynamic_weights(path: DynamicWeightsPath, x: Tensor, W_in, b_in, W_out, W_gate, b_gate) -> tuple:
    """(w1, w2 [b, p, 4, R, H], gates [b, p, 4, H]) by `path` (`dynamic_weights_path`). Triton refusing to build
    a kernel for the card is said once; that call (or backward) and the device's later ones take torch's ops."""
    from . import dynamic_weights

    def refused(refusal: Exception) -> None:
        reason = f"Triton cannot build the dynamic weights' kernels for it ({str(refusal).splitlines()[0]})"
        _refused_dynamic_weights[str(x.device)] = reason
        _warn_once(reason, x.device, fallback="DCMHA's dynamic weights on {device} take torch's ops")

    weights = (x, W_in, b_in, W_out, W_gate, b_gate)
    if path == "torch":
        return dynamic_weights.torch_dynamic_weights(*weights)
    try:
        return dynamic_weights.fused_dynamic_weights(*weights, on_refusal=refused)
    except _compile_refusals() as refusal:
        refused(refusal)
        return dynamic_weights.torch_dynamic_weights(*weights)


def decoding_pattern_path(
    *, device: torch.device, dtypes: set[torch.dtype], gradient_needed: bool
) -> DecodingPatternPath:
    """How a decoding step's pattern (the few-queries path's compose, mask and softmax, `dcinterp.dcmha.decoding`) is
    computed: "triton" (two launches) on CUDA where the Triton kernels run, in float32, float16 or bfloat16, when
    no gradient is needed; "torch" (about twenty launches) otherwise. `dtypes`: those of the scores, the mask and
    the dynamic weights."""
    if device.type != "cuda" or gradient_needed or str(device) in _refused_decoding:
        return "torch"
    if not dtypes <= set(KERNEL_DTYPES) or triton_unavailable(device) is not None:
        return "torch"
    return "triton"


def compute_decoding_pattern(path: DecodingPatternPath, scores: Tensor, mask: Tensor, pre, post, scale: float):
    """A decoding step's pattern P' [b, h, t, s] by `path` (`decoding_pattern_path`). Triton refusing to build the
    kernels for the card is said once; that call and the device's later ones take torch's ops."""
    from . import decoding

    if path == "torch":
        return decoding.torch_decoding_pattern(scores, mask, pre, post, scale)
    try:
        return decoding.fused_decoding_pattern(scores, mask, pre, post, scale)
    except _compile_refusals() as refusal:
        reason = f"Triton cannot build the decoding kernels for it ({str(refusal).splitlines()[0]})"
        _refused_decoding[str(scores.device)] = reason
        _warn_once(reason, scores.device, fallback="DCMHA's decoding steps on {device} take torch's ops")
        return decoding.torch_decoding_pattern(scores, mask, pre, post, scale)


def triton_z(q, k, v, mask, pre, post, *, window: int | None, official: bool, past: int, real: Tensor | None):
    """z by the Triton kernels (`triton_kernels.fused_dcmha`; the arguments are its own, less `mask`, the additive
    mask of the same keys, with which `materialised.attend` gives the gradients where the kernels cannot: second
    derivatives, or a card refusing the backward's kernels)."""
    from . import triton_kernels

    def fallback(refusal, dz, q, k, v, weights):
        if refusal is not None:
            _refuse_kernels(refusal, q.device)
        inputs, second_order = (q, k, v, *weights), torch.is_grad_enabled()
        wanted = [x for x in inputs if x is not None and x.requires_grad]
        with torch.enable_grad():
            z = materialised.attend(q, k, v, mask, weights[:6] if pre else None, weights[6:] if post else None)
            grads = iter(torch.autograd.grad(z, wanted, dz, create_graph=second_order, allow_unused=True))
        return [next(grads) if x is not None and x.requires_grad else None for x in inputs]

    try:
        return triton_kernels.fused_dcmha(
            q, k, v, pre, post, window=window, official=official, past=past, real=real, fallback=fallback
        )
    except _compile_refusals() as refusal:  # the card's limits: said once, then the materialised path everywhere
        _refuse_kernels(refusal, q.device)
        return materialised.attend(q, k, v, mask, pre, post)


def _refuse_kernels(refusal: Exception, device: torch.device) -> None:
    """Triton refused to build the fused kernels for the device (at their first launch, forward or backward): said
    once, and the device's later calls take the materialised path."""
    reason = f"Triton cannot build the fused kernels for it ({str(refusal).splitlines()[0]})"
    _refused[str(device)] = reason
    _warn_once(reason, device)
