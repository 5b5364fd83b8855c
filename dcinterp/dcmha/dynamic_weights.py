"""DCMHA's dynamic weights from a layer's input: by torch's ops, or in one fused Triton kernel.

For each position x [D] and each of the four branches c (pre-compose query, pre-compose key, post-compose query,
post-compose key; K hidden units, H heads, R the rank):
    hidden[c] = gelu(x W_in[:, c] + b_in[c])              W_in [D, 4, K], b_in [4, K] or None (exact erf gelu)
    w[c, j] = hidden[c] W_out[c, :, j]                    W_out [4, K, 2R, H], j < 2R
    w1[c, r] = RMSNorm over heads of w[c, r] (no scale, eps 1e-6, in float32),   w2[c, r] = w[c, R + r]
    gates[c] = tanh(x W_gate[:, c] + b_gate[c])           W_gate [D, 4, H], b_gate [4, H] or None

`torch_dynamic_weights` takes about a dozen kernel launches (two matmuls, a bias, gelu, an einsum, the RMS norm's
pow, mean, rsqrt and products, another bias, tanh); at the short prompts most analyses use, a GPU waits on those
launches, not on the arithmetic. `fused_dynamic_weights` computes the same in one launch (`_dynamic_weights_kernel`,
one program per block of positions and branch; float32 sums, no intermediate rounding to a half dtype). Half inputs
are multiplied in their dtype (the products are exact in float32, as in cuBLAS), float32 ones in IEEE float32 (not
TF32); the interpreter, whose bfloat16 dot is wrong, takes the same products in float32.
It has no backward: `dcinterp.dcmha.dynamic_weights_path` takes it only where no gradient is needed, and only up to
`dcinterp.dcmha.FUSED_DYNAMIC_WEIGHTS_POSITIONS` positions. Timed on an H100 (Triton 3.6, the 6.9B width: d_model
4096, 32 heads, K 128, R 2; each call's wall time, launches included): bfloat16 0.06 ms against torch's 0.18-0.27 ms
at 16 to 512 positions, 0.09 against 0.17 at 2,048, 0.38 against 0.17 at 8,192 (each program reads all of its
branch's W_in, which cuBLAS tiles better); float32 0.12 against 0.15 at 16 to 512, 0.39 against 0.28 at 2,048.

Triton decides when a kernel is decorated whether it runs natively or under its CPU interpreter (`TRITON_INTERPRET=1`),
so the kernel is decorated at its first use, not when dcinterp is imported (Triton's own functions, tl.sum and the like,
are decorated when triton is imported: the variable must be set before that).

Index names: p positions (batch and sequence flattened), d model dim, c branch, k hidden unit, r rank, h head.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from ._grids import cdiv, checked_once, next_power_of_2, signature

try:
    import triton
    import triton.language as tl
except ImportError:  # dcinterp runs without triton; dcinterp.dcmha.triton_unavailable says why the kernel cannot
    triton = tl = None

BLOCK_POSITIONS = 16  # positions per program (tl.dot's smallest tile)
BLOCK_DIM = 64  # a chunk of the model dim, summed over in turn

DynamicWeights = tuple[Float[Tensor, "b p 4 r h"], Float[Tensor, "b p 4 r h"], Float[Tensor, "b p 4 h"]]


def torch_dynamic_weights(x: Float[Tensor, "b p d"], W_in, b_in, W_out, W_gate, b_gate) -> DynamicWeights:
    """(w1, w2, gates) by torch's ops, differentiable: the reference the kernel is tested against."""
    R = W_out.shape[2] // 2
    hidden = (x @ W_in.flatten(1)).unflatten(-1, W_in.shape[1:])  # [b, p, c, k]
    hidden = F.gelu(hidden + b_in if b_in is not None else hidden)
    w = torch.einsum("bpck,ckrh->bpcrh", hidden, W_out)
    w1, w2 = w[:, :, :, :R], w[:, :, :, R:]
    # RMSNorm without scale over heads, in at least float32: in float16 the backward of rsqrt overflows (the mean
    # square can be ~4e-4, where d rsqrt/du = -u^-1.5 / 2 is ~6.5e4, past float16's 65504).
    w1f = w1.to(torch.promote_types(w1.dtype, torch.float32))
    w1 = (w1f * torch.rsqrt(w1f.pow(2).mean(-1, keepdim=True) + 1e-6)).to(w1.dtype)
    gates = (x @ W_gate.flatten(1)).unflatten(-1, W_gate.shape[1:])  # [b, p, c, h]
    gates = torch.tanh(gates + b_gate if b_gate is not None else gates)
    return w1, w2, gates


# --- the kernel (a plain function, decorated by `_decorate` at first use) ------------------------------------------
# (the kernel's long argument list packed, not one a line)
# fmt: off


def _dot(a, b, HALF: tl.constexpr):
    """a @ b, float32 result: products in a and b's half dtype (natively), else in IEEE float32."""
    if HALF and not _INTERPRETED:
        return tl.dot(a, b, out_dtype=tl.float32)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


def _dynamic_weights_kernel(
    x, W_in, b_in, W_out, W_gate, b_gate, w1, w2, gates,
    P, D, K, H, R,
    BP: tl.constexpr, BD: tl.constexpr, KP: tl.constexpr, HP: tl.constexpr,
    IN_BIAS: tl.constexpr, GATE_BIAS: tl.constexpr, HALF: tl.constexpr,
):
    """Branch c's w1, w2 [4, P, R, H] and gates [4, P, H] (branch-major) of a block of BP positions; x [P, D]. KP, HP:
    K and H padded to powers of two (the padding loads as 0, which gelu and the products keep 0). HALF: x, W_in and
    W_gate share a half dtype."""
    c = tl.program_id(1)
    p = tl.program_id(0) * BP + tl.arange(0, BP)
    p_ok = p < P
    k = tl.arange(0, KP)
    k_ok = k < K
    h = tl.arange(0, HP)
    h_ok = h < H
    hidden = tl.zeros([BP, KP], dtype=tl.float32)
    gate = tl.zeros([BP, HP], dtype=tl.float32)
    for start in range(0, D, BD):
        d = start + tl.arange(0, BD)
        d_ok = d < D
        xs = tl.load(x + p[:, None] * D + d[None, :], mask=p_ok[:, None] & d_ok[None, :], other=0.0)
        W = tl.load(W_in + (d[:, None] * 4 + c) * K + k[None, :], mask=d_ok[:, None] & k_ok[None, :], other=0.0)
        hidden += _dot(xs, W, HALF)
        W = tl.load(W_gate + (d[:, None] * 4 + c) * H + h[None, :], mask=d_ok[:, None] & h_ok[None, :], other=0.0)
        gate += _dot(xs, W, HALF)
    if IN_BIAS:
        hidden += tl.load(b_in + c * K + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
    hidden = 0.5 * hidden * (1.0 + tl.math.erf(hidden * 0.7071067811865476))
    if GATE_BIAS:
        gate += tl.load(b_gate + c * H + h, mask=h_ok, other=0.0).to(tl.float32)[None, :]
    # tanh(g) = sign(g) (1 - e) / (1 + e), e = exp(-2 |g|) <= 1: no overflow at any g
    e = tl.exp(-2.0 * tl.abs(gate))
    gate = tl.where(gate < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e)
    rows = c * P + p[:, None]
    tl.store(gates + rows * H + h[None, :], gate.to(gates.dtype.element_ty), mask=p_ok[:, None] & h_ok[None, :])
    for r in range(R):
        ok = p_ok[:, None] & h_ok[None, :]
        W = tl.load(W_out + ((c * K + k[:, None]) * 2 * R + r) * H + h[None, :], mask=k_ok[:, None] & h_ok[None, :],
                    other=0.0)
        value = tl.dot(hidden, W.to(tl.float32), input_precision="ieee")  # [BP, HP]
        value = value * tl.math.rsqrt(tl.sum(value * value, axis=1) / H + 1e-6)[:, None]  # the padded heads are 0
        tl.store(w1 + (rows * R + r) * H + h[None, :], value.to(w1.dtype.element_ty), mask=ok)
        W = tl.load(W_out + ((c * K + k[:, None]) * 2 * R + R + r) * H + h[None, :],
                    mask=k_ok[:, None] & h_ok[None, :], other=0.0)
        value = tl.dot(hidden, W.to(tl.float32), input_precision="ieee")
        tl.store(w2 + (rows * R + r) * H + h[None, :], value.to(w2.dtype.element_ty), mask=ok)


# fmt: on

_decorated = False
_INTERPRETED = False  # the kernel's constant, set by _decorate


def _decorate() -> None:
    """Decorate the kernels with triton.jit, once (natively, or under the interpreter if TRITON_INTERPRET=1 now)."""
    global _decorated, _dynamic_weights_kernel, _dot, _INTERPRETED
    if not _decorated:
        _INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
        _dot, _dynamic_weights_kernel = triton.jit(_dot), triton.jit(_dynamic_weights_kernel)
        _decorated = True


def fused_dynamic_weights(x: Float[Tensor, "b p d"], W_in, b_in, W_out, W_gate, b_gate) -> DynamicWeights:
    """(w1, w2, gates) of `torch_dynamic_weights` in one Triton launch, without a backward (the result is detached).

    Each result in the dtype torch's ops give it (x's and the weights' promoted dtype), stored branch-major (each
    branch's `w1[:, :, c]` contiguous: what the compose kernels read without a copy); float32, float16 or bfloat16
    inputs, summed in float32."""
    arguments = (x, W_in, b_in, W_out, W_gate, b_gate)
    checked_once(_checked, signature(*arguments), lambda: _check(*arguments))
    _decorate()
    batch, positions, D = x.shape
    K, H, R = W_in.shape[2], W_gate.shape[2], W_out.shape[2] // 2
    P = batch * positions
    w_dtype = _promoted(x, W_in, b_in, W_out)
    # branch-major, so that each branch's weights (what the compose kernels take) are contiguous without a copy
    w1 = torch.empty(4, batch, positions, R, H, dtype=w_dtype, device=x.device)
    w2 = torch.empty_like(w1)
    gates = torch.empty(4, batch, positions, H, dtype=_promoted(x, W_gate, b_gate), device=x.device)
    W_in, W_out, W_gate = W_in.contiguous(), W_out.contiguous(), W_gate.contiguous()
    b_in = W_in if b_in is None else b_in.contiguous()  # never read without IN_BIAS
    b_gate = W_gate if b_gate is None else b_gate.contiguous()
    half = x.dtype == W_in.dtype == W_gate.dtype != torch.float32
    _dynamic_weights_kernel[(cdiv(P, BLOCK_POSITIONS), 4)](
        x.reshape(P, D).contiguous(), W_in, b_in, W_out, W_gate, b_gate, w1, w2, gates,
        P, D, K, H, R,
        BP=BLOCK_POSITIONS, BD=BLOCK_DIM, KP=max(16, next_power_of_2(K)), HP=max(16, next_power_of_2(H)),
        IN_BIAS=b_in is not W_in, GATE_BIAS=b_gate is not W_gate, HALF=half, num_warps=4,
    )  # fmt: skip
    return w1.permute(1, 2, 0, 3, 4), w2.permute(1, 2, 0, 3, 4), gates.permute(1, 2, 0, 3)


def _promoted(*tensors) -> torch.dtype:
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


_checked: dict[tuple, None] = {}  # the signatures (`_grids.signature`) of the arguments already checked


def _check(x, W_in, b_in, W_out, W_gate, b_gate) -> None:
    """One clear line naming the argument at fault."""
    if x.ndim != 3:
        raise ValueError(f"fused_dynamic_weights: x must be [b, p, d] (got {list(x.shape)})")
    D = x.shape[2]
    if W_in.ndim != 3 or W_in.shape[:2] != (D, 4):
        raise ValueError(f"fused_dynamic_weights: W_in must be [{D}, 4, K] (got {list(W_in.shape)})")
    K = W_in.shape[2]
    if W_gate.ndim != 3 or W_gate.shape[:2] != (D, 4):
        raise ValueError(f"fused_dynamic_weights: W_gate must be [{D}, 4, H] (got {list(W_gate.shape)})")
    H = W_gate.shape[2]
    if W_out.ndim != 4 or W_out.shape[:2] != (4, K) or W_out.shape[3] != H or W_out.shape[2] < 2 or W_out.shape[2] % 2:
        raise ValueError(f"fused_dynamic_weights: W_out must be [4, {K}, 2R, {H}] (got {list(W_out.shape)})")
    for name, bias, shape in (("b_in", b_in, (4, K)), ("b_gate", b_gate, (4, H))):
        if bias is not None and bias.shape != shape:
            raise ValueError(f"fused_dynamic_weights: {name} must be {list(shape)} or None (got {list(bias.shape)})")
    tensors = {"x": x, "W_in": W_in, "b_in": b_in, "W_out": W_out, "W_gate": W_gate, "b_gate": b_gate}
    for name, t in tensors.items():
        if t is not None and t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"fused_dynamic_weights: {name} must be float32, float16 or bfloat16 (got {t.dtype})")
        if t is not None and t.device != x.device:
            raise ValueError(f"fused_dynamic_weights: {name} must be on x's device, {x.device} (got {t.device})")
