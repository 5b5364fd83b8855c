"""A cached decoding step's attention pattern: DCMHA's pre-compose, the mask, the softmax and the post-compose of a few
new queries against every key, by torch's ops or in two Triton launches.

A decoding step with no hook on a square tensor takes the few-queries path (`few_queries.few_queries_z`): the scores
and `P' V` are two batched matmuls, and between them `torch_decoding_pattern` launches about twenty kernels a layer
(each stage's compose in its low-rank form, `materialised.compose_decoding`, the mask and the softmax). At one new
token a GPU step costs its launches, not its arithmetic (benchmarks/bench_decode_ops.py counts them), so on CUDA
`fused_decoding_pattern` computes the same in two launches, each split over the keys so that a long cache keeps many
SMs busy (one program per (batch row and query, block of keys)):
- `_decoding_logits_kernel`: every head's pre-composed, scaled and masked scores of its block (a [heads, keys]
  tile: the compose mixes the heads of one (query, key) pair and nothing else), kept in float32, and each head's
  softmax max and sum over the block;
- `_decoding_pattern_kernel`: the blocks' statistics combined into each head's, the probabilities, and the
  post-compose, rounded once to the scores' dtype.

For one query t and key s (n/m heads, r rank; the key side as the cache holds it, key-last):
    compose(X)[m, s] = X[m, s] (1 + qg[t, m] + kg[m, s]) + sum_r (sum_n X[n, s] qw1[t, r, n]) qw2[t, r, m]
                                                         + sum_r (sum_n X[n, s] kw1[r, n, s]) kw2[r, m, s]
    P = softmax over s of (compose(S, pre) / sqrt(d_head) + mask),   P' = compose(P, post)
The compose sees the hidden keys' scores, which the mask then hides (as `Attention.hook_scores_for_compose` passes
them with no hook attached).

The kernels have no backward: `dcinterp.dcmha.few_queries.decoding_pattern_path` takes them only where no gradient
is needed.

The kernels are jitted at their first call (`dcinterp.dcmha.jit`).

Index names: b batch, t queries, s keys, h/m/n heads, r rank.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from . import materialised
from .jit import LateJit, cdiv, checked_once, next_power_of_2, signature, tl

# A program's [heads, keys] tile holds this many numbers (keys a program: this over the heads padded to a power of two,
# at least 16): the largest tile that spills nothing at 32 heads (benchmarks/kernel_resources.py).
TILE = 2048

Stage = tuple[Tensor | None, ...] | None  # (qw1, qw2, kw1, kw2, qg, kg), the key side key-last; None: stage off


def torch_decoding_pattern(
    scores: Float[Tensor, "b h t s"], mask: Tensor, pre: Stage, post: Stage, scale: float
) -> Float[Tensor, "b h t s"]:
    """A decoding step's pattern P' by torch's ops, differentiable.

    The compose is linear in the scores, so `scale` scales the composed scores, with the mask added in the same
    operation. In a half dtype the softmax is one operation (the kernels compute in float32 and round once).

    Args:
        scores: q . k [b, h, t, s], unscaled.
        mask: additive, [t, s] or [b, 1, t, s].
        pre: the pre-compose's (qw1, qw2 [b, t, r, h], kw1, kw2 [b, r, h, s], qg [b, t, h], kg [b, h, s]), any None
            for a branch that is off; None for a stage that is off.
        post: the post-compose's, the same.
        scale: what multiplies the composed scores, 1 / sqrt(d_head).

    Returns:
        P' [b, h, t, s] in the scores' dtype.
    """
    if pre is not None:
        qw1, qw2, kw1, kw2, qg, kg = pre
        scores = materialised.compose_decoding(scores, qw1, qw2, qg, kw1, kw2, kg)
    pattern = torch.add(mask.to(scores.dtype), scores, alpha=scale).softmax(-1)  # summed in float32 in a half dtype
    if post is not None:
        qw1, qw2, kw1, kw2, qg, kg = post
        pattern = materialised.compose_decoding(pattern, qw1, qw2, qg, kw1, kw2, kg)
    return pattern


# --- the kernels (plain functions, jitted by `jit` at first use) ---------------------------------------------------
# (the kernels' long argument lists packed, not one a line)
# fmt: off


def _compose(x, b, t, s, s_ok, h, h_ok,
             qw1, qw2, qg, kw1, kw2, kg, q_sb, q_st, g_sb, g_st, k_sb, k_sf, k_ss, kg_sb, kg_sh, kg_ss,
             H, R: tl.constexpr, QP: tl.constexpr, KP: tl.constexpr, QG: tl.constexpr, KG: tl.constexpr):
    """compose(x) of one query t's [heads, keys] tile x, float32; the branches named by QP, KP, QG, KG are on. The
    query side's weights qw1, qw2 [b, t, r, h] and qg [b, t, h] are strided by (q_sb, q_st) and (g_sb, g_st) over
    (b, t), contiguous over (r, h); the key side's kw1, kw2 [b, r, h, s] by (k_sb, k_sf, k_ss) over (b, r h, s),
    kg [b, h, s] by (kg_sb, kg_sh, kg_ss)."""
    ok = h_ok[:, None] & s_ok[None, :]
    out = x
    if QG:
        gate = tl.load(qg + b * g_sb + t * g_st + h, mask=h_ok, other=0.0).to(tl.float32)
        out += x * gate[:, None]
    if KG:
        gate = tl.load(kg + b * kg_sb + h[:, None] * kg_sh + s[None, :] * kg_ss, mask=ok, other=0.0)
        out += x * gate.to(tl.float32)
    if QP:
        for r in tl.static_range(R):
            w1 = tl.load(qw1 + b * q_sb + t * q_st + r * H + h, mask=h_ok, other=0.0).to(tl.float32)
            w2 = tl.load(qw2 + b * q_sb + t * q_st + r * H + h, mask=h_ok, other=0.0).to(tl.float32)
            out += w2[:, None] * tl.sum(w1[:, None] * x, axis=0)[None, :]
    if KP:
        for r in tl.static_range(R):
            at = b * k_sb + (r * H + h[:, None]) * k_sf + s[None, :] * k_ss
            w1 = tl.load(kw1 + at, mask=ok, other=0.0).to(tl.float32)
            w2 = tl.load(kw2 + at, mask=ok, other=0.0).to(tl.float32)
            out += w2 * tl.sum(w1 * x, axis=0)[None, :]
    return out


def _program_block(T, S, H, HP: tl.constexpr, BK: tl.constexpr):
    """This program's row (b T + t) and block of keys, its batch row and query, its heads h and keys s with what of
    them is real (h_ok, s_ok, and ok for the [heads, keys] tile)."""
    row, block = tl.program_id(0), tl.program_id(1)
    h = tl.arange(0, HP)
    s = block * BK + tl.arange(0, BK)
    h_ok, s_ok = h < H, s < S
    return row, block, row // T, row % T, h, h_ok, s, s_ok, h_ok[:, None] & s_ok[None, :]


def _finite(top):
    """A max over logits, -inf (every one hidden, or padding) as 0: exp(-inf - 0) = 0, where exp(-inf + inf) = NaN."""
    return tl.where(top == float("-inf"), 0.0, top)


def _decoding_logits_kernel(
    scores, mask, logits, block_max, block_sum,
    qw1, qw2, qg, kw1, kw2, kg, q_sb, q_st, g_sb, g_st, k_sb, k_sf, k_ss, kg_sb, kg_sh, kg_ss,
    T, S, H, scale, s_sb, s_sh, s_st, m_sb, m_st, m_ss,
    HP: tl.constexpr, BK: tl.constexpr, R: tl.constexpr,
    QP: tl.constexpr, KP: tl.constexpr, QG: tl.constexpr, KG: tl.constexpr,
):
    """Program (row = b T + t, block): logits[row, h, s] = compose(S, pre) scale + mask over the block's keys, float32,
    and each head's max and sum of exp(logits - max) over them in block_max, block_sum [rows, blocks, HP]."""
    row, block, b, t, h, h_ok, s, s_ok, ok = _program_block(T, S, H, HP, BK)
    x = tl.load(scores + b * s_sb + h[:, None] * s_sh + t * s_st + s[None, :], mask=ok, other=0.0).to(tl.float32)
    x = _compose(x, b, t, s, s_ok, h, h_ok,
                 qw1, qw2, qg, kw1, kw2, kg, q_sb, q_st, g_sb, g_st, k_sb, k_sf, k_ss, kg_sb, kg_sh, kg_ss,
                 H, R, QP, KP, QG, KG)
    added = tl.load(mask + b * m_sb + t * m_st + s * m_ss, mask=s_ok, other=0.0).to(tl.float32)
    x = tl.where(ok, x * scale + added[None, :], float("-inf"))
    tl.store(logits + (row * H + h[:, None]) * S + s[None, :], x, mask=ok)
    top = tl.max(x, axis=1)
    at = (row * tl.num_programs(1) + block) * HP + h
    tl.store(block_max + at, top)
    tl.store(block_sum + at, tl.sum(tl.exp(x - _finite(top)[:, None]), axis=1))  # 0 where every logit is -inf


def _decoding_pattern_kernel(
    logits, block_max, block_sum, pattern,
    qw1, qw2, qg, kw1, kw2, kg, q_sb, q_st, g_sb, g_st, k_sb, k_sf, k_ss, kg_sb, kg_sh, kg_ss,
    T, S, H, n_blocks, p_sb, p_sh, p_st,
    HP: tl.constexpr, BK: tl.constexpr, R: tl.constexpr,
    QP: tl.constexpr, KP: tl.constexpr, QG: tl.constexpr, KG: tl.constexpr,
):
    """Program (row, block): each head's softmax statistics from every block's, then pattern[b, h, t, s] =
    compose(P, post) over the block's keys, P = exp(logits - max) / sum."""
    row, block, b, t, h, h_ok, s, s_ok, ok = _program_block(T, S, H, HP, BK)
    row_max = tl.full([HP], float("-inf"), tl.float32)
    for j in range(n_blocks):
        row_max = tl.maximum(row_max, tl.load(block_max + (row * n_blocks + j) * HP + h))
    row_max = _finite(row_max)
    row_sum = tl.zeros([HP], tl.float32)
    for j in range(n_blocks):
        at = (row * n_blocks + j) * HP + h
        row_sum += tl.load(block_sum + at) * tl.exp(tl.load(block_max + at) - row_max)
    row_sum = tl.where(h_ok, row_sum, 1.0)  # the padding heads', never stored
    x = tl.load(logits + (row * H + h[:, None]) * S + s[None, :], mask=ok, other=float("-inf"))
    p = tl.where(ok, tl.exp(x - row_max[:, None]) / row_sum[:, None], 0.0)
    p = _compose(p, b, t, s, s_ok, h, h_ok,
                 qw1, qw2, qg, kw1, kw2, kg, q_sb, q_st, g_sb, g_st, k_sb, k_sf, k_ss, kg_sb, kg_sh, kg_ss,
                 H, R, QP, KP, QG, KG)
    tl.store(pattern + b * p_sb + h[:, None] * p_sh + t * p_st + s[None, :], p.to(pattern.dtype.element_ty),
             mask=ok)


# fmt: on

jit = LateJit(
    globals(), ("_compose", "_program_block", "_finite", "_decoding_logits_kernel", "_decoding_pattern_kernel")
)


def fused_decoding_pattern(
    scores: Float[Tensor, "b h t s"], mask: Tensor, pre: Stage, post: Stage, scale: float
) -> Float[Tensor, "b h t s"]:
    """`torch_decoding_pattern` in two Triton launches, computed in float32 and rounded once.

    The arguments may be strided views (the cache's key side is one).

    Args:
        scores: q . k [b, h, t, s], unscaled.
        mask: additive, [t, s] or [b, 1, t, s].
        pre: the pre-compose's (qw1, qw2 [b, t, r, h], kw1, kw2 [b, r, h, s], qg [b, t, h], kg [b, h, s]), any None
            for a branch that is off; None for a stage that is off.
        post: the post-compose's, the same.
        scale: what multiplies the composed scores, 1 / sqrt(d_head).

    Returns:
        P' [b, h, t, s] in the scores' dtype (float32, float16 or bfloat16), detached: the kernels have no backward.

    Raises:
        ValueError: an argument's shape or dtype, named.
    """
    arguments = signature(scores, mask, *(pre or (None,) * 6), *(post or (None,) * 6))
    rank = checked_once(_ranks, arguments, lambda: _check(scores, mask, pre, post))
    jit()
    batch, heads, queries, keys = scores.shape
    if scores.stride(3) != 1:
        scores = scores.contiguous()
    mask = mask.expand(batch, 1, queries, keys)  # a [t, s] mask: batch stride 0
    if scores.numel() == 0:  # an empty batch (or no query): nothing to launch
        return torch.empty_like(scores)
    padded_heads = next_power_of_2(heads)
    block_keys = max(16, TILE // padded_heads)
    rows, n_blocks = batch * queries, cdiv(keys, block_keys)
    logits = torch.empty(rows, heads, keys, dtype=torch.float32, device=scores.device)
    block_max = torch.empty(rows, n_blocks, padded_heads, dtype=torch.float32, device=scores.device)
    block_sum = torch.empty_like(block_max)
    pattern = torch.empty(batch, heads, queries, keys, dtype=scores.dtype, device=scores.device)
    constants = dict(HP=padded_heads, BK=block_keys, R=rank, num_warps=4)
    grid = (rows, n_blocks)
    _decoding_logits_kernel[grid](
        scores, mask, logits, block_max, block_sum, *_stage_arguments(pre, scores),
        queries, keys, heads, scale, *scores.stride()[:3], mask.stride(0), mask.stride(2), mask.stride(3),
        **_branches(pre), **constants,
    )  # fmt: skip
    _decoding_pattern_kernel[grid](
        logits, block_max, block_sum, pattern, *_stage_arguments(post, scores),
        queries, keys, heads, n_blocks, *pattern.stride()[:3],
        **_branches(post), **constants,
    )  # fmt: skip
    return pattern


def _branches(stage: Stage) -> dict[str, bool]:
    """The kernels' flags: which of the stage's branches are on."""
    on = [stage is not None and stage[i] is not None for i in (0, 2, 4, 5)]
    return dict(zip(("QP", "KP", "QG", "KG"), on, strict=True))


def _stage_arguments(stage: Stage, stand_in: Tensor) -> list:
    """A stage's six weights (qw1, qw2, qg, kw1, kw2, kg: `stand_in` for a branch that is off, never read) and their
    strides, as `_compose` takes them. A tensor whose layout those strides cannot say (qw1 and qw2 not alike, a
    rank and head that do not flatten) is copied first."""
    qw1, qw2, kw1, kw2, qg, kg = stage if stage is not None else (None,) * 6
    if qw1 is not None:
        if not _alike(qw1, qw2) or qw1.stride()[2:] != (qw1.shape[3], 1):
            qw1, qw2 = qw1.contiguous(), qw2.contiguous()
    if kw1 is not None:
        if not _alike(kw1, kw2) or kw1.stride(1) != kw1.shape[2] * kw1.stride(2):
            kw1, kw2 = kw1.contiguous(), kw2.contiguous()
    if qg is not None and qg.stride(2) != 1:
        qg = qg.contiguous()
    weights = [stand_in if w is None else w for w in (qw1, qw2, qg, kw1, kw2, kg)]
    strides = [
        *(qw1.stride()[:2] if qw1 is not None else (0, 0)),
        *(qg.stride()[:2] if qg is not None else (0, 0)),
        *((kw1.stride(0), kw1.stride(2), kw1.stride(3)) if kw1 is not None else (0, 0, 0)),
        *(kg.stride() if kg is not None else (0, 0, 0)),
    ]
    return weights + strides


def _alike(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and a.stride() == b.stride()


_ranks: dict[tuple, int] = {}  # the rank of each signature (`jit.signature`) of arguments already checked


def _check(scores: Tensor, mask: Tensor, pre: Stage, post: Stage) -> int:
    """The stages' rank (1 with no projection on); one clear line naming the argument at fault."""
    if scores.ndim != 4:
        raise ValueError(f"fused_decoding_pattern: scores must be [b, h, t, s] (got {list(scores.shape)})")
    b, h, t, s = scores.shape
    if scores.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"fused_decoding_pattern: scores must be float32, float16 or bfloat16 (got {scores.dtype})")
    if tuple(mask.shape) not in ((t, s), (b, 1, t, s)):
        raise ValueError(
            f"fused_decoding_pattern: mask must be [{t}, {s}] or [{b}, 1, {t}, {s}] (got {list(mask.shape)})"
        )
    stages = [(name, stage) for name, stage in (("pre", pre), ("post", post)) if stage is not None]
    ranks = {
        w.shape[2 if i < 2 else 1]
        for _, stage in stages
        for i, w in enumerate(stage[:4])
        if w is not None and w.ndim == 4
    }
    if len(ranks) > 1:
        raise ValueError(f"fused_decoding_pattern: every w1, w2 must have one rank (got {sorted(ranks)})")
    r = ranks.pop() if ranks else 1
    shapes = dict(qw1=(b, t, r, h), qw2=(b, t, r, h), kw1=(b, r, h, s), kw2=(b, r, h, s), qg=(b, t, h), kg=(b, h, s))
    for stage_name, stage in stages:
        for (name, shape), w in zip(shapes.items(), stage, strict=True):
            if w is not None and (w.shape != shape or w.device != scores.device):
                raise ValueError(
                    f"fused_decoding_pattern: {stage_name} {name} must be {list(shape)} on {scores.device} (got "
                    f"{list(w.shape)} on {w.device})"
                )
        if (stage[0] is None) != (stage[1] is None) or (stage[2] is None) != (stage[3] is None):
            raise ValueError(f"fused_decoding_pattern: {stage_name} gives w1 without w2 (or w2 without w1)")
    return r
