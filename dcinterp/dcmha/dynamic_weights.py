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
`dcinterp.dcmha.dynamic_weights_path` takes it up to `dcinterp.dcmha.FUSED_DYNAMIC_WEIGHTS_POSITIONS` positions:
past them torch's matmuls are faster, since each program reads all of its branch's W_in, which cuBLAS tiles better
(docs/benchmarks.md, "DCMHA's thresholds").

Backward: torch's ops take about twenty launches for x's gradient alone. With gradients the kernel keeps the gelu's
input (float32 [4, p, K]), and `_dynamic_weights_backward_kernel` (one program per block of positions and branch)
recomputes the hidden units and w1 before its norm from it, and gives the gradients of the gelu's and the tanh's
inputs, dpre [p, 4, K] and dgate [p, 4, H]; then x's is two matmuls, dpre W_in^T + dgate W_gate^T (the weights'
gradients, where they require grad, are matmuls and sums of the same).

The kernels are jitted at their first call (`dcinterp.dcmha.jit`).

Index names: p positions (batch and sequence flattened), d model dim, c branch, k hidden unit, r rank, h head.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from .families import compile_refusals
from .jit import LateJit, cdiv, checked_once, next_power_of_2, signature, tl

_INTERPRETED = False  # the kernel's constant: whether it runs under Triton's interpreter (set by `jit`)

BLOCK_POSITIONS = 16  # positions per program (tl.dot's smallest tile)
BLOCK_DIM = 64  # a chunk of the model dim, summed over in turn
BACKWARD_WARPS = 8  # the backward's tiles spill less than with 4 (benchmarks/kernel_resources.py)

DynamicWeights = tuple[Float[Tensor, "b p 4 r h"], Float[Tensor, "b p 4 r h"], Float[Tensor, "b p 4 h"]]


def torch_dynamic_weights(x: Float[Tensor, "b p d"], W_in, b_in, W_out, W_gate, b_gate) -> DynamicWeights:
    """The dynamic weights by torch's ops, differentiable: the reference the kernel is tested against.

    Args:
        x: the layer's normed input [b, p, d].
        W_in: [d, 4, K].
        b_in: [4, K], or None.
        W_out: [4, K, 2R, H].
        W_gate: [d, 4, H].
        b_gate: [4, H], or None.

    Returns:
        (w1, w2 [b, p, 4, R, H], gates [b, p, 4, H]), in x's and the weights' promoted dtype.
    """
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


# --- the kernels (plain functions, jitted by `jit` at first use) ---------------------------------------------------
# (the kernel's long argument list packed, not one a line)
# fmt: off


def _dot(a, b, HALF: tl.constexpr):
    """a @ b, float32 result: products in a and b's half dtype (natively), else in IEEE float32."""
    if HALF and not _INTERPRETED:
        return tl.dot(a, b, out_dtype=tl.float32)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


def _dynamic_weights_kernel(
    x, W_in, b_in, W_out, W_gate, b_gate, w1, w2, gates, pre,
    P, D, K, H, R,
    BP: tl.constexpr, BD: tl.constexpr, KP: tl.constexpr, HP: tl.constexpr,
    IN_BIAS: tl.constexpr, GATE_BIAS: tl.constexpr, HALF: tl.constexpr, SAVE: tl.constexpr,
):
    """Branch c's w1, w2 [4, P, R, H] and gates [4, P, H] (branch-major) of a block of BP positions; x [P, D]. KP, HP:
    K and H padded to powers of two (the padding loads as 0, which gelu and the products keep 0). HALF: x, W_in and
    W_gate share a half dtype. SAVE: the gelu's input also stored, in float32, to pre [4, P, K] (for the backward)."""
    c, p, p_ok, k, k_ok, h, h_ok = _program_indices(P, K, H, BP, KP, HP)
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
    if SAVE:
        tl.store(pre + (c * P + p[:, None]) * K + k[None, :], hidden, mask=p_ok[:, None] & k_ok[None, :])
    hidden = _gelu(hidden)
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


def _program_indices(P, K, H, BP: tl.constexpr, KP: tl.constexpr, HP: tl.constexpr):
    """A program's branch c, its block of positions p, the hidden units k and heads h, each with its bounds' mask."""
    p = tl.program_id(0) * BP + tl.arange(0, BP)
    k = tl.arange(0, KP)
    h = tl.arange(0, HP)
    return tl.program_id(1), p, p < P, k, k < K, h, h < H


def _gelu(u):
    """Exact (erf) gelu."""
    return 0.5 * u * (1.0 + tl.math.erf(u * 0.7071067811865476))


def _gelu_slope(u):
    """d gelu(u) / du = Phi(u) + u phi(u)."""
    return 0.5 * (1.0 + tl.math.erf(u * 0.7071067811865476)) + u * tl.exp(-0.5 * u * u) * 0.3989422804014327


def _dynamic_weights_backward_kernel(
    pre, gates, W_out, dw1, dw2, dgates, dpre, dgate, du,
    P, K, H, R, dw1_c, dw1_p, dw2_c, dw2_p, dgates_c, dgates_p,
    BP: tl.constexpr, KP: tl.constexpr, HP: tl.constexpr, WEIGHTS: tl.constexpr,
):
    """Branch c's gradients, of a block of BP positions, from those of its w1, w2 and gates (dw1, dw2 [4, P, R, H],
    dgates [4, P, H], each of stride dw1_c, dw1_p, ... between branches and positions): dpre [P, 4, K], the gelu's
    input's (pre [4, P, K], saved by the forward), and dgate [P, 4, H], the tanh's (gates [4, P, H], its output);
    with WEIGHTS also du [P, 4, R, H], float32, the gradient of w1 before its RMS norm (for W_out's). The hidden
    units and w1 before its norm are recomputed in float32 as the forward computed them."""
    c, p, p_ok, k, k_ok, h, h_ok = _program_indices(P, K, H, BP, KP, HP)
    pk_ok = p_ok[:, None] & k_ok[None, :]
    ph_ok = p_ok[:, None] & h_ok[None, :]
    kh_ok = k_ok[:, None] & h_ok[None, :]
    u_in = tl.load(pre + (c * P + p[:, None]) * K + k[None, :], mask=pk_ok, other=0.0)
    hidden = _gelu(u_in)
    d_hidden = tl.zeros([BP, KP], dtype=tl.float32)
    for r in range(R):
        W = tl.load(W_out + ((c * K + k[:, None]) * 2 * R + r) * H + h[None, :], mask=kh_ok, other=0.0).to(tl.float32)
        u = tl.dot(hidden, W, input_precision="ieee")  # [BP, HP], w1 before its norm (the padded heads 0)
        norm = tl.math.rsqrt(tl.sum(u * u, axis=1) / H + 1e-6)[:, None]
        y = u * norm
        dy = tl.load(dw1 + c * dw1_c + p[:, None] * dw1_p + r * H + h[None, :], mask=ph_ok, other=0.0).to(tl.float32)
        d_u = norm * (dy - y * (tl.sum(y * dy, axis=1) / H)[:, None])
        if WEIGHTS:
            tl.store(du + ((p[:, None] * 4 + c) * R + r) * H + h[None, :], d_u, mask=ph_ok)
        d_hidden += tl.dot(d_u, tl.trans(W), input_precision="ieee")
        W = tl.load(W_out + ((c * K + k[:, None]) * 2 * R + R + r) * H + h[None, :], mask=kh_ok, other=0.0)
        dv = tl.load(dw2 + c * dw2_c + p[:, None] * dw2_p + r * H + h[None, :], mask=ph_ok, other=0.0).to(tl.float32)
        d_hidden += tl.dot(dv, tl.trans(W.to(tl.float32)), input_precision="ieee")
    d_pre = d_hidden * _gelu_slope(u_in)
    tl.store(dpre + (p[:, None] * 4 + c) * K + k[None, :], d_pre.to(dpre.dtype.element_ty), mask=pk_ok)
    gate = tl.load(gates + (c * P + p[:, None]) * H + h[None, :], mask=ph_ok, other=0.0).to(tl.float32)
    d_gate = tl.load(dgates + c * dgates_c + p[:, None] * dgates_p + h[None, :], mask=ph_ok, other=0.0)
    d_gate = d_gate.to(tl.float32) * (1.0 - gate * gate)
    tl.store(dgate + (p[:, None] * 4 + c) * H + h[None, :], d_gate.to(dgate.dtype.element_ty), mask=ph_ok)


# fmt: on

jit = LateJit(
    globals(),
    ("_dot", "_gelu", "_gelu_slope", "_program_indices", "_dynamic_weights_kernel", "_dynamic_weights_backward_kernel"),
)


def fused_dynamic_weights(
    x: Float[Tensor, "b p d"], W_in, b_in, W_out, W_gate, b_gate, on_refusal: Callable[[Exception], None] | None = None
) -> DynamicWeights:
    """The dynamic weights of `torch_dynamic_weights` in one Triton launch, and their gradients in one more.

    float32, float16 or bfloat16 inputs, summed in float32. With gradients (grad mode on and an argument requiring
    grad) the forward also keeps the gelu's input (float32, [4, p, K]), and the backward takes one launch for the
    gradients of every branch's hidden units and gates (`_dynamic_weights_backward_kernel`) and two matmuls for x's;
    the weights' (when they require grad) take five more of torch's ops. Second derivatives (`create_graph=True`) are
    torch's ops', recomputed; so is the backward where Triton refuses to build its kernel for the card.

    Args:
        x: the layer's normed input [b, p, d].
        W_in: [d, 4, K].
        b_in: [4, K], or None.
        W_out: [4, K, 2R, H].
        W_gate: [d, 4, H].
        b_gate: [4, H], or None.
        on_refusal: given Triton's error where it refuses to build the backward's kernel (without it, it is raised).

    Returns:
        (w1, w2 [b, p, 4, R, H], gates [b, p, 4, H]), each in the dtype torch's ops give it, stored branch-major
        (each branch's `w1[:, :, c]` contiguous: what the compose kernels read without a copy).

    Raises:
        ValueError: an argument's shape, dtype or device, named.
    """
    arguments = (x, W_in, b_in, W_out, W_gate, b_gate)
    checked_once(_checked, signature(*arguments), lambda: _check(*arguments))
    jit()
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in arguments):
        w1, w2, gates = FusedDynamicWeights.apply(on_refusal, *arguments)
    else:
        w1, w2, gates, _ = _forward(*arguments, save=False)
    return w1.permute(1, 2, 0, 3, 4), w2.permute(1, 2, 0, 3, 4), gates.permute(1, 2, 0, 3)


def _forward(x, W_in, b_in, W_out, W_gate, b_gate, save: bool) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The kernel's w1, w2 [4, b, p, R, H] and gates [4, b, p, H], branch-major, and (`save`) the gelu's input."""
    batch, positions, D = x.shape
    K, H, R = W_in.shape[2], W_gate.shape[2], W_out.shape[2] // 2
    P = batch * positions
    w_dtype = _promoted(x, W_in, b_in, W_out)
    # branch-major, so that each branch's weights (what the compose kernels take) are contiguous without a copy
    w1 = torch.empty(4, batch, positions, R, H, dtype=w_dtype, device=x.device)
    w2 = torch.empty_like(w1)
    gates = torch.empty(4, batch, positions, H, dtype=_promoted(x, W_gate, b_gate), device=x.device)
    pre = torch.empty(4, P, K, dtype=torch.float32, device=x.device) if save else None
    W_in, W_out, W_gate = W_in.contiguous(), W_out.contiguous(), W_gate.contiguous()
    b_in = W_in if b_in is None else b_in.contiguous()  # never read without IN_BIAS
    b_gate = W_gate if b_gate is None else b_gate.contiguous()
    half = x.dtype == W_in.dtype == W_gate.dtype != torch.float32
    _dynamic_weights_kernel[(cdiv(P, BLOCK_POSITIONS), 4)](
        x.reshape(P, D).contiguous(), W_in, b_in, W_out, W_gate, b_gate, w1, w2, gates, w1 if pre is None else pre,
        P, D, K, H, R,
        BP=BLOCK_POSITIONS, BD=BLOCK_DIM, KP=max(16, next_power_of_2(K)), HP=max(16, next_power_of_2(H)),
        IN_BIAS=b_in is not W_in, GATE_BIAS=b_gate is not W_gate, HALF=half, SAVE=save, num_warps=4,
    )  # fmt: skip
    return w1, w2, gates, pre


class FusedDynamicWeights(torch.autograd.Function):
    """The kernel's forward (keeping the gelu's input) and backward (`fused_dynamic_weights`); outputs branch-major."""

    @staticmethod
    def forward(ctx, on_refusal, x, W_in, b_in, W_out, W_gate, b_gate):
        w1, w2, gates, pre = _forward(x, W_in, b_in, W_out, W_gate, b_gate, save=True)
        ctx.on_refusal = on_refusal
        ctx.save_for_backward(x, W_in, b_in, W_out, W_gate, b_gate, pre, gates)
        return w1, w2, gates

    @staticmethod
    def backward(ctx, dw1, dw2, dgates):
        *inputs, pre, gates = ctx.saved_tensors
        needed = ctx.needs_input_grad[1:]
        x, _, _, W_out, _, _ = inputs
        shape = (4, x.shape[0], x.shape[1], W_out.shape[2] // 2, gates.shape[-1])
        dw1 = x.new_zeros(shape, dtype=gates.dtype) if dw1 is None else dw1  # an output nobody used
        dw2 = x.new_zeros(shape, dtype=gates.dtype) if dw2 is None else dw2
        dgates = torch.zeros_like(gates) if dgates is None else dgates
        if torch.is_grad_enabled():  # create_graph=True
            return None, *_torch_gradients(inputs, needed, (dw1, dw2, dgates))
        try:
            return None, *_backward(inputs, needed, pre, gates, dw1, dw2, dgates)
        except compile_refusals() as refusal:
            if ctx.on_refusal is None:
                raise
            ctx.on_refusal(refusal)
            return None, *_torch_gradients(inputs, needed, (dw1, dw2, dgates))


def _backward(inputs, needed, pre, gates, dw1, dw2, dgates) -> list[Tensor | None]:
    """The gradients of (x, W_in, b_in, W_out, W_gate, b_gate) where `needed`, from those of the branch-major
    outputs: the kernel gives those of every branch's hidden units (dpre) and gates (dgate), matmuls the rest."""
    x, W_in, b_in, W_out, W_gate, b_gate = inputs
    batch, positions, D = x.shape
    K, H, R = W_in.shape[2], W_gate.shape[2], W_out.shape[2] // 2
    P = batch * positions
    dpre = torch.empty(P, 4, K, dtype=W_in.dtype, device=x.device)
    dgate = torch.empty(P, 4, H, dtype=W_gate.dtype, device=x.device)
    du = torch.empty(P, 4, R, H, dtype=torch.float32, device=x.device) if needed[3] else None
    (dw1, dw1_c, dw1_p), (dw2, dw2_c, dw2_p), (dgates, dgates_c, dgates_p) = map(
        _by_branch_and_position, (dw1, dw2, dgates)
    )
    _dynamic_weights_backward_kernel[(cdiv(P, BLOCK_POSITIONS), 4)](
        pre, gates, W_out.contiguous(), dw1, dw2, dgates, dpre, dgate, dpre if du is None else du,
        P, K, H, R, dw1_c, dw1_p, dw2_c, dw2_p, dgates_c, dgates_p,
        BP=BLOCK_POSITIONS, KP=max(16, next_power_of_2(K)), HP=max(16, next_power_of_2(H)), WEIGHTS=du is not None,
        num_warps=BACKWARD_WARPS,
    )  # fmt: skip
    dpre, dgate = dpre.view(P, 4 * K), dgate.view(P, 4 * H)
    grads: list[Tensor | None] = [None] * 6
    if needed[0]:
        dx = dpre @ W_in.reshape(D, 4 * K).t()
        dx.addmm_(dgate.to(dx.dtype), W_gate.reshape(D, 4 * H).t().to(dx.dtype))
        grads[0] = dx.view(batch, positions, D).to(x.dtype)
    rows = x.reshape(P, D).t()
    if needed[1]:
        grads[1] = (rows.to(dpre.dtype) @ dpre).view(D, 4, K).to(W_in.dtype)
    if needed[2]:
        grads[2] = dpre.sum(0, dtype=torch.float32).view(4, K).to(b_in.dtype)
    if needed[3]:
        dw2 = dw2.permute(1, 2, 0, 3, 4).reshape(P, 4, R, H).float()
        grads[3] = torch.einsum("cpk,pcjh->ckjh", F.gelu(pre), torch.cat([du, dw2], dim=2)).to(W_out.dtype)
    if needed[4]:
        grads[4] = (rows.to(dgate.dtype) @ dgate).view(D, 4, H).to(W_gate.dtype)
    if needed[5]:
        grads[5] = dgate.sum(0, dtype=torch.float32).view(4, H).to(b_gate.dtype)
    return grads


def _by_branch_and_position(g: Tensor) -> tuple[Tensor, int, int]:
    """An output's gradient g [4, b, p, ...] as the backward kernel reads it: its trailing dims contiguous and (b, p)
    one index of positions (else a contiguous copy), with its strides between branches and between positions."""
    shape, strides = g.shape, g.stride()
    trailing = strides[-1] == 1 and (g.ndim == 4 or strides[-2] == shape[-1])  # (r, h) or (h,) contiguous
    if not (trailing and (shape[1] == 1 or strides[1] == shape[2] * strides[2])):
        g = g.contiguous()
    return g, g.stride(0), g.stride(2)


def _torch_gradients(inputs, needed, grads) -> list[Tensor | None]:
    """The gradients by torch's ops, the forward recomputed: second derivatives (with grad mode on, as under
    `create_graph=True`), and a card refusing the backward's kernel."""
    second_order = torch.is_grad_enabled()
    wanted = [t for t, need in zip(inputs, needed, strict=True) if need]
    with torch.enable_grad():
        w1, w2, gates = torch_dynamic_weights(*inputs)
        outputs = (w1.permute(2, 0, 1, 3, 4), w2.permute(2, 0, 1, 3, 4), gates.permute(2, 0, 1, 3))  # branch-major
        found = iter(torch.autograd.grad(outputs, wanted, grads, create_graph=second_order, allow_unused=True))
    return [next(found) if need else None for need in needed]


def _promoted(*tensors) -> torch.dtype:
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


_checked: dict[tuple, None] = {}  # the signatures (`jit.signature`) of the arguments already checked


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
