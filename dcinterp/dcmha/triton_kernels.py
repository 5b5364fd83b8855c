"""DCMHA fused in Triton kernels: the attention's forward and backward without any [b, h, t, s] tensor.

Two forwards: without gradients, the forward through the cross-head maps (four kernels, each head alone, its output
in registers; the faster); with them, the tiles forward (one kernel, every head of a tile together), whose row
statistics the backward's recomputation reproduces bit for bit (the forward through the maps sums in another order:
its statistics would leave the softmax's gradient a few float32 units off, more than the tests allow).

One DCMHA layer, per batch row (t queries, s keys, n/m heads, e head dim, r rank, scale = 1 / sqrt(e)):
    S[n, t, s] = scale q[t, n] . k[s, n]
    A = compose(S, pre),  P = softmax over the visible keys of A,  P' = compose(P, post)
    z[t, m] = sum_s P'[m, t, s] v[s, m]
    compose(X)[m, t, s] = X[m] (1 + qg[t, m] + kg[s, m]) + sum_r (sum_n X[n] qw1[t, r, n]) qw2[t, r, m]
                                                           + sum_r (sum_n X[n] kw1[s, r, n]) kw2[s, r, m]
The compose mixes the heads of one (query, key) pair and nothing else, so a tile of queries x keys of the tiles
kernels holds every head, `[heads, queries, keys]` (heads padded to a power of two, the padding masked), and reads
only its own queries' and keys' dynamic weights, in their low-rank form.

Forward through the maps (`_forward_through_maps`). The compose mixes heads only through rank-R maps of [queries,
keys] that every head shares: hq[r] = sum_n qw1[t, r, n] S[n] and hk[r] = sum_n kw1[s, r, n] S[n] before the softmax,
gq[r] = sum_n qw1'[t, r, n] P[n] and gk[r] after it. Four kernels:
- `_pre_maps_kernel`, per (query block, key block) tile that any query sees: hq and hk, summing each head's scores;
- `_row_statistics_kernel`, per (head, query block): the head's pre-composed scores from its own q k^T, its gates and
  the maps, and its softmax max and sum, online over the keys;
- `_post_maps_kernel`, per tile: gq and gk, summing each head's probabilities;
- `_head_output_kernel`, per (head, query block): the probabilities again, post-composed with the maps, times v,
  accumulated in registers as FlashAttention does.
The maps are kept in a [b, 4R, t, s] buffer (bfloat16 / float16 for such inputs, float32 otherwise) of at most
`MAPS_BYTES`: a longer prompt goes a chunk of queries at a time. So memory grows with the prompt times the chunk, not
with the heads: 4R numbers a (query, key) pair against the materialised path's dozen a head.

Tiles forward (`_forward_kernel`, grid (query blocks, batch rows), one program per block of queries of one row): pass 1
over the keys the block's queries see (keys after its last query, and before a local window, are not even read)
computes the scores, the pre-compose, the mask and each (head, query)'s running softmax max and sum; pass 2
recomputes them, normalises with the final statistics, applies the post-compose and accumulates P' V. Only q, k, v,
the dynamic weights and the per-(head, query) max and sum are kept for the backward: memory grows with the prompt,
not with its square. A decoding step (`past` cached positions, 1 to 16 new queries) is the same kernel: one launch
per layer, its one block of queries against every key it sees.

Backward (FlashAttention's recomputation; the post-compose makes the softmax's `D = sum_s P dP` a pass of its own,
where FlashAttention takes rowsum(dz z)):

- `_backward_query_kernel`, per block of queries: pass 1 recomputes P, dP' = dz v, dP through the transposed
  post-compose and D; pass 2 gives dA = P (dP - D), dS through the transposed pre-compose, and every sum over keys:
  dq and the gradients of both stages' qw1, qw2, qg.
- `_backward_key_kernel`, per block of keys, over the queries that see it: every sum over queries, dk, dv and the
  gradients of both stages' kw1, kw2, kg.

Registers: a program holds [heads, queries, keys] tiles (32 x 16 x 16 at 32 heads, the default `BLOCKS`). Every
head's q rows or output rows at e = 128 would be 64K floats more, so the head dim is walked in chunks of 32 (QK^T and
P' V are `tl.dot`s batched over the heads, one chunk at a time), and the sums over key or query blocks (z, dq, dk,
dv, the weights' gradients) are added into float32 buffers in global memory, each row owned by exactly one program.
Nothing is summed by atomics and every loop runs in a fixed order, so the same inputs give the same bits. Compiled
by Triton 3.9 for an H100 (sm_90, bfloat16, eight warps; no GPU is needed to compile, as tests/test_triton_dcmha.py
does), 32 heads of 128 take 64 KiB of shared memory and spill 0.6-0.9 KiB a thread; 16 heads of 64 spill 40 bytes
in the key-side backward, none elsewhere. Timed and profiled on an H100 (docs/hooked-model.md, "GPU"): one program
of 8 warps an SM (246-255 registers a thread), latency-bound, 7% of the SM's compute throughput.

float32 inputs use IEEE float32 products (not TF32); float16 / bfloat16 inputs multiply in their own dtype, like
FlashAttention, and everything accumulates in float32. Not supported: second derivatives (`create_graph=True`: the
backward raises; the materialised path gives them).

Triton decides when a kernel is decorated whether it runs natively or under its CPU interpreter
(`TRITON_INTERPRET=1`), so the kernels are decorated at their first use, not when dcinterp is imported.

Index names: b batch, t queries, s keys, h/m/n heads, e head dim, r rank.
"""

from __future__ import annotations

import os
from typing import Literal

import torch
from jaxtyping import Bool, Float
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError as error:  # dcinterp runs without triton; available() says why the kernels cannot
    triton = tl = None
    _IMPORT_ERROR = f"triton is not installed ({error})"
else:
    _IMPORT_ERROR = None

BLOCKS = (16, 16, 32)  # a tile's queries and keys, and a chunk of the head dim (powers of two, at least 16)
# The forward through the maps: the launches of its two kernels that sum the maps over the heads (tiles of BQ queries
# by BK keys), and of its two of one head a program; the fastest of a sweep on an NVIDIA H200 (bfloat16, 32 heads of
# 128, rank 2, 4,096 tokens: benchmarks/results/h200-2026-11-27-maps-sweep-*.jsonl). With programs of 2 or 4 heads
# (tiles [heads, queries, keys], products batched over the heads) the output kernel took 2.8 to 66 times as long.
MAPS_KERNELS = dict(BQ=64, BK=32, num_warps=4, num_stages=3)
HEAD_KERNELS = dict(BQ=64, BK=32, num_warps=4, num_stages=2)
MAPS_BYTES = 256 * 2**20  # the forward through the maps holds at most this much of them at a time
BRANCHES = ("qw1", "qw2", "kw1", "kw2", "qg", "kg")  # a stage's dynamic weights, in this order
QUERY_SIDE, KEY_SIDE = (0, 1, 4, 6, 7, 10), (2, 3, 5, 8, 9, 11)  # both stages' weights of [b, t, ...] and [b, s, ...]


def available(device: torch.device) -> str | None:
    """None when the fused kernels can run on `device` (CUDA with Triton importable, or TRITON_INTERPRET=1 on a CPU),
    else the one-line reason."""
    device = torch.device(device)
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 6):
        return f"the fused kernels need Triton 3.6 or newer (found {triton.__version__})"
    interpreted = _kernels_interpreted()
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available"
        return None
    if device.type == "cpu":
        if not interpreted:
            return "the Triton kernels run on a CPU only under TRITON_INTERPRET=1 (set before their first use)"
        return None
    return f"the Triton kernels do not run on {device.type}"


def _kernels_interpreted() -> bool:
    """Whether the kernels run (or, not decorated yet, would run) under Triton's interpreter."""
    if _decorated:
        return _decorated_interpreted
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# --- the kernels (plain functions, decorated by `_decorate` at first use) ------------------------------------------
# (the kernels' long argument lists packed, not one a line)
# fmt: off


def _dot(a, b, HALF: tl.constexpr):
    """a @ b over the last two axes, float32 result: IEEE float32 products, or products of a rounded to b's half
    dtype and b (the interpreter's bfloat16 dot is wrong, so there the same products, exact in float32, are taken
    in float32)."""
    if HALF and not _INTERPRETED:
        return tl.dot(a.to(b.dtype), b, out_dtype=tl.float32)
    if HALF:
        a = a.to(b.dtype)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


def _weight(w, row, idx, ok, r, h_idx, h_ok, N, R, H):
    """A dynamic weight's [heads, positions] tile: w[row, idx, r, h] of a [b, N, R, H] tensor (R = 1 for a gate)."""
    offsets = ((row * N + idx[None, :]) * R + r) * H + h_idx[:, None]
    return tl.load(w + offsets, mask=h_ok[:, None] & ok[None, :], other=0.0).to(tl.float32)


def _accumulate(buffer, row, idx, ok, r, h_idx, h_ok, N, R, H, value):
    """buffer[row, idx, r, h] += value ([heads, positions]) in a float32 [b, N, R, H] buffer this program owns."""
    offsets = ((row * N + idx[None, :]) * R + r) * H + h_idx[:, None]
    mask = h_ok[:, None] & ok[None, :]
    tl.store(buffer + offsets, tl.load(buffer + offsets, mask=mask, other=0.0) + value, mask=mask)
    tl.debug_barrier()  # every thread holding a copy of an entry has stored it before any reads it again


def _rows(x, row, idx, ok, h_idx, h_ok, e, e_ok, N, H, E):
    """A [heads, positions, head-dim chunk] tile of a [b, N, H, E] tensor (q, k, v or dz), in its own dtype."""
    offsets = ((row * N + idx[None, :, None]) * H + h_idx[:, None, None]) * E + e[None, None, :]
    mask = h_ok[:, None, None] & ok[None, :, None] & e_ok[None, None, :]
    return tl.load(x + offsets, mask=mask, other=0.0)


def _accumulate_rows(buffer, row, idx, ok, h_idx, h_ok, e, e_ok, N, H, E, value):
    """buffer[row, idx, h, e] += value ([heads, positions, chunk]), a float32 [b, N, H, E] buffer this program owns."""
    offsets = ((row * N + idx[None, :, None]) * H + h_idx[:, None, None]) * E + e[None, None, :]
    mask = h_ok[:, None, None] & ok[None, :, None] & e_ok[None, None, :]
    tl.store(buffer + offsets, tl.load(buffer + offsets, mask=mask, other=0.0) + value, mask=mask)
    tl.debug_barrier()


def _visible(row, t_idx, t_ok, s_idx, s_ok, real, S, past, span, PADDING: tl.constexpr):
    """[queries, keys]: True where query t (position past + t) sees key s: s <= past + t, s > past + t - span (a
    local window; span beyond every key for a global layer), and s real unless it is the query itself."""
    position = past + t_idx[:, None]
    seen = (s_idx[None, :] <= position) & (s_idx[None, :] > position - span) & t_ok[:, None] & s_ok[None, :]
    if PADDING:
        is_real = tl.load(real + row * S + s_idx, mask=s_ok, other=0) != 0
        seen = seen & (is_real[None, :] | (s_idx[None, :] == position))
    return seen


def _scores(q, k, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, T, S, H, E, scale, BE: tl.constexpr, HALF):
    """S = scale q k^T for every head: [heads, queries, keys], float32, the head dim walked in chunks of BE."""
    scores = tl.zeros((h_idx.shape[0], t_idx.shape[0], s_idx.shape[0]), dtype=tl.float32)
    for e0 in range(0, E, BE):
        e = e0 + tl.arange(0, BE)
        e_ok = e < E
        q_rows = _rows(q, row, t_idx, t_ok, h_idx, h_ok, e, e_ok, T, H, E)
        k_rows = _rows(k, row, s_idx, s_ok, h_idx, h_ok, e, e_ok, S, H, E)
        scores = scores + _dot(q_rows, tl.permute(k_rows, (0, 2, 1)), HALF)
    return scores * scale


def _compose(
    x, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, T, S, H, R, qw1, qw2, kw1, kw2, qg, kg, QP: tl.constexpr,
    KP: tl.constexpr, QG: tl.constexpr, KG: tl.constexpr
):
    """One compose stage on a [heads, queries, keys] tile: the skip, the gates and the rank-R projections."""
    y = x
    if QG:
        y = y + x * _weight(qg, row, t_idx, t_ok, 0, h_idx, h_ok, T, 1, H)[:, :, None]
    if KG:
        y = y + x * _weight(kg, row, s_idx, s_ok, 0, h_idx, h_ok, S, 1, H)[:, None, :]
    if QP:
        for r in range(R):
            hidden = tl.sum(x * _weight(qw1, row, t_idx, t_ok, r, h_idx, h_ok, T, R, H)[:, :, None], axis=0)
            y = y + hidden[None, :, :] * _weight(qw2, row, t_idx, t_ok, r, h_idx, h_ok, T, R, H)[:, :, None]
    if KP:
        for r in range(R):
            hidden = tl.sum(x * _weight(kw1, row, s_idx, s_ok, r, h_idx, h_ok, S, R, H)[:, None, :], axis=0)
            y = y + hidden[None, :, :] * _weight(kw2, row, s_idx, s_ok, r, h_idx, h_ok, S, R, H)[:, None, :]
    return y


def _compose_backward(
    x, gy, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, T, S, H, R, qw1, qw2, kw1, kw2, qg, kg, d_qw1, d_qw2, d_kw1,
    d_kw2, d_qg, d_kg, QP: tl.constexpr, KP: tl.constexpr, QG: tl.constexpr, KG: tl.constexpr, SIDE: tl.constexpr
):
    """x's gradient given y = compose(x)'s, gy; with SIDE 1 also adds the query-side weights' gradients (sums over
    this tile's keys) into d_qw1, d_qw2, d_qg, with SIDE 2 the key side's (sums over its queries), with 0 neither."""
    gx = gy
    if QG:
        gx = gx + gy * _weight(qg, row, t_idx, t_ok, 0, h_idx, h_ok, T, 1, H)[:, :, None]
        if SIDE == 1:
            _accumulate(d_qg, row, t_idx, t_ok, 0, h_idx, h_ok, T, 1, H, tl.sum(gy * x, axis=2))
    if KG:
        gx = gx + gy * _weight(kg, row, s_idx, s_ok, 0, h_idx, h_ok, S, 1, H)[:, None, :]
        if SIDE == 2:
            _accumulate(d_kg, row, s_idx, s_ok, 0, h_idx, h_ok, S, 1, H, tl.sum(gy * x, axis=1))
    if QP:
        for r in range(R):
            w1 = _weight(qw1, row, t_idx, t_ok, r, h_idx, h_ok, T, R, H)[:, :, None]
            g_hidden = tl.sum(gy * _weight(qw2, row, t_idx, t_ok, r, h_idx, h_ok, T, R, H)[:, :, None], axis=0)
            gx = gx + g_hidden[None, :, :] * w1
            if SIDE == 1:
                hidden = tl.sum(x * w1, axis=0)
                _accumulate(d_qw2, row, t_idx, t_ok, r, h_idx, h_ok, T, R, H, tl.sum(hidden[None, :, :] * gy, axis=2))
                _accumulate(d_qw1, row, t_idx, t_ok, r, h_idx, h_ok, T, R, H, tl.sum(g_hidden[None, :, :] * x, axis=2))
    if KP:
        for r in range(R):
            w1 = _weight(kw1, row, s_idx, s_ok, r, h_idx, h_ok, S, R, H)[:, None, :]
            g_hidden = tl.sum(gy * _weight(kw2, row, s_idx, s_ok, r, h_idx, h_ok, S, R, H)[:, None, :], axis=0)
            gx = gx + g_hidden[None, :, :] * w1
            if SIDE == 2:
                hidden = tl.sum(x * w1, axis=0)
                _accumulate(d_kw2, row, s_idx, s_ok, r, h_idx, h_ok, S, R, H, tl.sum(hidden[None, :, :] * gy, axis=1))
                _accumulate(d_kw1, row, s_idx, s_ok, r, h_idx, h_ok, S, R, H, tl.sum(g_hidden[None, :, :] * x, axis=1))
    return gx


def _pre_composed(
    q, k, real, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, T, S, H, E, R, past, span, scale, qw1, qw2, kw1, kw2, qg,
    kg, QP: tl.constexpr, KP: tl.constexpr, QG: tl.constexpr, KG: tl.constexpr, BE: tl.constexpr, HALF: tl.constexpr,
    PADDING: tl.constexpr
):
    """A tile's scores S, its pre-composed scores A (-inf where hidden) and where it is visible, [heads, queries,
    keys] each (padded heads are hidden)."""
    scores = _scores(q, k, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, T, S, H, E, scale, BE, HALF)
    composed = _compose(
        scores, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, T, S, H, R, qw1, qw2, kw1, kw2, qg, kg, QP, KP, QG, KG
    )
    seen = _visible(row, t_idx, t_ok, s_idx, s_ok, real, S, past, span, PADDING)[None, :, :] & h_ok[:, None, None]
    return scores, tl.where(seen, composed, float("-inf")), seen


def _pattern(composed, seen, row_max, row_sum):
    """The softmax's probabilities from the row statistics (a hidden row's max is 0 and sum 1: no NaN)."""
    return tl.where(seen, tl.exp(composed - row_max[:, :, None]) / row_sum[:, :, None], 0.0)


def _online_softmax(running_max, running_sum, composed):
    """The softmax's running max and sum ([heads, queries]) after one more block of keys ([heads, queries, keys],
    -inf where hidden)."""
    new_max = tl.maximum(running_max, tl.max(composed, axis=2))
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    running_sum = running_sum * tl.exp(running_max - shift) + tl.sum(tl.exp(composed - shift[:, :, None]), axis=2)
    return new_max, running_sum


def _store_statistics(row_max, row_sum, running_max, running_sum, row, h_idx, h_ok, t_idx, t_ok, H, T):
    """Each (head, query)'s final max and sum into [b, H, T] buffers, and returned; a row with no visible key gets
    max 0 and sum 1 (no NaN later)."""
    running_max = tl.where(running_max == float("-inf"), 0.0, running_max)
    running_sum = tl.where(running_sum == 0.0, 1.0, running_sum)
    stats = (row * H + h_idx[:, None]) * T + t_idx[None, :]
    tl.store(row_max + stats, running_max, mask=h_ok[:, None] & t_ok[None, :])
    tl.store(row_sum + stats, running_sum, mask=h_ok[:, None] & t_ok[None, :])
    return running_max, running_sum


def _forward_kernel(
    q, k, v, z, row_max, row_sum, real, pre_qw1, pre_qw2, pre_kw1, pre_kw2, pre_qg, pre_kg, post_qw1, post_qw2,
    post_kw1, post_kw2, post_qg, post_kg, T, S, H, E, R, past, span, scale, HP: tl.constexpr, BQ: tl.constexpr,
    BK: tl.constexpr, BE: tl.constexpr, PRE_QP: tl.constexpr, PRE_KP: tl.constexpr, PRE_QG: tl.constexpr,
    PRE_KG: tl.constexpr, POST_QP: tl.constexpr, POST_KP: tl.constexpr, POST_QG: tl.constexpr, POST_KG: tl.constexpr,
    PADDING: tl.constexpr, HALF: tl.constexpr
):
    """z (added into a zeroed float32 [b, T, H, E]) and the softmax's row max and sum ([b, H, T]) of one block of
    queries (program 0's axis) of one batch row (axis 1)."""
    t0 = tl.program_id(0) * BQ
    row = tl.program_id(1)
    t_idx = t0 + tl.arange(0, BQ)
    t_ok = t_idx < T
    h_idx = tl.arange(0, HP)
    h_ok = h_idx < H
    first_key = tl.maximum(past + t0 - span + 1, 0)
    end_key = tl.minimum(past + t0 + BQ, S)

    running_max = tl.full((HP, BQ), float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros((HP, BQ), dtype=tl.float32)
    for s0 in range(first_key, end_key, BK):
        s_idx = s0 + tl.arange(0, BK)
        s_ok = s_idx < end_key  # keys past the block's last query are not even read
        _, composed, _ = _pre_composed(
            q, k, real, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, T, S, H, E, R, past, span, scale, pre_qw1, pre_qw2,
            pre_kw1, pre_kw2, pre_qg, pre_kg, PRE_QP, PRE_KP, PRE_QG, PRE_KG, BE, HALF, PADDING
        )
        running_max, running_sum = _online_softmax(running_max, running_sum, composed)
    running_max, running_sum = _store_statistics(
        row_max, row_sum, running_max, running_sum, row, h_idx, h_ok, t_idx, t_ok, H, T
    )

    for s0 in range(first_key, end_key, BK):
        s_idx = s0 + tl.arange(0, BK)
        s_ok = s_idx < end_key
        _, composed, seen = _pre_composed(
            q, k, real, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, T, S, H, E, R, past, span, scale, pre_qw1, pre_qw2,
            pre_kw1, pre_kw2, pre_qg, pre_kg, PRE_QP, PRE_KP, PRE_QG, PRE_KG, BE, HALF, PADDING
        )
        pattern = _pattern(composed, seen, running_max, running_sum)
        pattern = _compose(
            pattern, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, T, S, H, R, post_qw1, post_qw2, post_kw1, post_kw2,
            post_qg, post_kg, POST_QP, POST_KP, POST_QG, POST_KG
        )
        for e0 in range(0, E, BE):
            e = e0 + tl.arange(0, BE)
            e_ok = e < E
            v_rows = _rows(v, row, s_idx, s_ok, h_idx, h_ok, e, e_ok, S, H, E)
            _accumulate_rows(z, row, t_idx, t_ok, h_idx, h_ok, e, e_ok, T, H, E, _dot(pattern, v_rows, HALF))


def _backward_query_kernel(
    q, k, v, dz, row_max, row_sum, row_d, dq, real, pre_qw1, pre_qw2, pre_kw1, pre_kw2, pre_qg, pre_kg, post_qw1,
    post_qw2, post_kw1, post_kw2, post_qg, post_kg, d_pre_qw1, d_pre_qw2, d_pre_qg, d_post_qw1, d_post_qw2, d_post_qg,
    T, S, H, E, R, past, span, scale, HP: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, BE: tl.constexpr,
    PRE_QP: tl.constexpr, PRE_KP: tl.constexpr, PRE_QG: tl.constexpr, PRE_KG: tl.constexpr, POST_QP: tl.constexpr,
    POST_KP: tl.constexpr, POST_QG: tl.constexpr, POST_KG: tl.constexpr, PADDING: tl.constexpr, HALF: tl.constexpr
):
    """The query side of the backward for one block of queries: D = sum_s P dP (stored in row_d for the key side),
    dq and the gradients of both stages' qw1, qw2, qg (added into zeroed float32 buffers)."""
    t0 = tl.program_id(0) * BQ
    row = tl.program_id(1)
    t_idx = t0 + tl.arange(0, BQ)
    t_ok = t_idx < T
    h_idx = tl.arange(0, HP)
    h_ok = h_idx < H
    first_key = tl.maximum(past + t0 - span + 1, 0)
    end_key = tl.minimum(past + t0 + BQ, S)
    stats = (row * H + h_idx[:, None]) * T + t_idx[None, :]
    stats_ok = h_ok[:, None] & t_ok[None, :]
    maxima = tl.load(row_max + stats, mask=stats_ok, other=0.0)
    sums = tl.load(row_sum + stats, mask=stats_ok, other=1.0)

    d_row = tl.zeros((HP, BQ), dtype=tl.float32)
    for s0 in range(first_key, end_key, BK):
        s_idx = s0 + tl.arange(0, BK)
        s_ok = s_idx < end_key  # keys past the block's last query are not even read
        _, composed, seen = _pre_composed(
            q, k, real, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, T, S, H, E, R, past, span, scale, pre_qw1, pre_qw2,
            pre_kw1, pre_kw2, pre_qg, pre_kg, PRE_QP, PRE_KP, PRE_QG, PRE_KG, BE, HALF, PADDING
        )
        pattern = _pattern(composed, seen, maxima, sums)
        d_composed_pattern = _scores(dz, v, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, T, S, H, E, 1.0, BE, HALF)
        d_pattern = _compose_backward(
            pattern, d_composed_pattern, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, T, S, H, R, post_qw1, post_qw2,
            post_kw1, post_kw2, post_qg, post_kg, d_post_qw1, d_post_qw2, d_post_qw1, d_post_qw2, d_post_qg, d_post_qg,
            POST_QP, POST_KP, POST_QG, POST_KG, 1
        )
        d_row = d_row + tl.sum(pattern * d_pattern, axis=2)
    tl.store(row_d + stats, d_row, mask=stats_ok)

    for s0 in range(first_key, end_key, BK):
        s_idx = s0 + tl.arange(0, BK)
        s_ok = s_idx < end_key
        scores, composed, seen = _pre_composed(
            q, k, real, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, T, S, H, E, R, past, span, scale, pre_qw1, pre_qw2,
            pre_kw1, pre_kw2, pre_qg, pre_kg, PRE_QP, PRE_KP, PRE_QG, PRE_KG, BE, HALF, PADDING
        )
        pattern = _pattern(composed, seen, maxima, sums)
        d_composed_pattern = _scores(dz, v, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, T, S, H, E, 1.0, BE, HALF)
        d_pattern = _compose_backward(
            pattern, d_composed_pattern, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, T, S, H, R, post_qw1, post_qw2,
            post_kw1, post_kw2, post_qg, post_kg, d_post_qw1, d_post_qw2, d_post_qw1, d_post_qw2, d_post_qg, d_post_qg,
            POST_QP, POST_KP, POST_QG, POST_KG, 0
        )
        d_composed = pattern * (d_pattern - d_row[:, :, None])
        d_scores = _compose_backward(
            scores, d_composed, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, T, S, H, R, pre_qw1, pre_qw2, pre_kw1,
            pre_kw2, pre_qg, pre_kg, d_pre_qw1, d_pre_qw2, d_pre_qw1, d_pre_qw2, d_pre_qg, d_pre_qg, PRE_QP, PRE_KP,
            PRE_QG, PRE_KG, 1
        )
        d_scores = d_scores * scale
        for e0 in range(0, E, BE):
            e = e0 + tl.arange(0, BE)
            e_ok = e < E
            k_rows = _rows(k, row, s_idx, s_ok, h_idx, h_ok, e, e_ok, S, H, E)
            _accumulate_rows(dq, row, t_idx, t_ok, h_idx, h_ok, e, e_ok, T, H, E, _dot(d_scores, k_rows, HALF))


def _backward_key_kernel(
    q, k, v, dz, row_max, row_sum, row_d, dk, dv, real, pre_qw1, pre_qw2, pre_kw1, pre_kw2, pre_qg, pre_kg, post_qw1,
    post_qw2, post_kw1, post_kw2, post_qg, post_kg, d_pre_kw1, d_pre_kw2, d_pre_kg, d_post_kw1, d_post_kw2, d_post_kg,
    T, S, H, E, R, past, span, scale, HP: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, BE: tl.constexpr,
    PRE_QP: tl.constexpr, PRE_KP: tl.constexpr, PRE_QG: tl.constexpr, PRE_KG: tl.constexpr, POST_QP: tl.constexpr,
    POST_KP: tl.constexpr, POST_QG: tl.constexpr, POST_KG: tl.constexpr, PADDING: tl.constexpr, HALF: tl.constexpr
):
    """The key side of the backward for one block of keys (program 0's axis), over the queries that see it: dk, dv
    and the gradients of both stages' kw1, kw2, kg (added into zeroed float32 buffers)."""
    s0 = tl.program_id(0) * BK
    row = tl.program_id(1)
    s_idx = s0 + tl.arange(0, BK)
    s_ok = (s_idx < S) & (s_idx > past - span)  # keys before the first query's window are not even read
    h_idx = tl.arange(0, HP)
    h_ok = h_idx < H
    first_query = tl.maximum(s0 - past, 0)
    end_query = tl.minimum(s0 + BK - 1 + span - past, T)

    for t0 in range(first_query, end_query, BQ):
        t_idx = t0 + tl.arange(0, BQ)
        t_ok = t_idx < end_query  # nor queries past the last that sees the block
        stats = (row * H + h_idx[:, None]) * T + t_idx[None, :]
        stats_ok = h_ok[:, None] & t_ok[None, :]
        maxima = tl.load(row_max + stats, mask=stats_ok, other=0.0)
        sums = tl.load(row_sum + stats, mask=stats_ok, other=1.0)
        d_row = tl.load(row_d + stats, mask=stats_ok, other=0.0)
        scores, composed, seen = _pre_composed(
            q, k, real, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, T, S, H, E, R, past, span, scale, pre_qw1, pre_qw2,
            pre_kw1, pre_kw2, pre_qg, pre_kg, PRE_QP, PRE_KP, PRE_QG, PRE_KG, BE, HALF, PADDING
        )
        pattern = _pattern(composed, seen, maxima, sums)
        composed_pattern = _compose(
            pattern, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, T, S, H, R, post_qw1, post_qw2, post_kw1, post_kw2,
            post_qg, post_kg, POST_QP, POST_KP, POST_QG, POST_KG
        )
        for e0 in range(0, E, BE):  # dv first: P' is then no longer held
            e = e0 + tl.arange(0, BE)
            e_ok = e < E
            dz_rows = _rows(dz, row, t_idx, t_ok, h_idx, h_ok, e, e_ok, T, H, E)
            d_values = _dot(tl.permute(composed_pattern, (0, 2, 1)), dz_rows, HALF)
            _accumulate_rows(dv, row, s_idx, s_ok, h_idx, h_ok, e, e_ok, S, H, E, d_values)
        d_composed_pattern = _scores(dz, v, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, T, S, H, E, 1.0, BE, HALF)
        d_pattern = _compose_backward(
            pattern, d_composed_pattern, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, T, S, H, R, post_qw1, post_qw2,
            post_kw1, post_kw2, post_qg, post_kg, d_post_kw1, d_post_kw2, d_post_kw1, d_post_kw2, d_post_kg, d_post_kg,
            POST_QP, POST_KP, POST_QG, POST_KG, 2
        )
        d_composed = pattern * (d_pattern - d_row[:, :, None])
        d_scores = _compose_backward(
            scores, d_composed, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, T, S, H, R, pre_qw1, pre_qw2, pre_kw1,
            pre_kw2, pre_qg, pre_kg, d_pre_kw1, d_pre_kw2, d_pre_kw1, d_pre_kw2, d_pre_kg, d_pre_kg, PRE_QP, PRE_KP,
            PRE_QG, PRE_KG, 2
        )
        d_scores = d_scores * scale
        for e0 in range(0, E, BE):
            e = e0 + tl.arange(0, BE)
            e_ok = e < E
            q_rows = _rows(q, row, t_idx, t_ok, h_idx, h_ok, e, e_ok, T, H, E)
            d_keys = _dot(tl.permute(d_scores, (0, 2, 1)), q_rows, HALF)
            _accumulate_rows(dk, row, s_idx, s_ok, h_idx, h_ok, e, e_ok, S, H, E, d_keys)


# --- the forward through the cross-head maps: four kernels, each head alone but for the maps ----------------------
# The compose mixes heads only through rank-R maps of [queries, keys], shared by every head: the pre-compose's
# hq[r] = sum_n qw1[t, r, n] S[n] and hk[r] = sum_n kw1[s, r, n] S[n], the post-compose's gq[r] = sum_n qw1'[t, r, n]
# P[n] and gk[r] alike. Kept in a [b, 4R, t, s] buffer (`maps`, j = r, R + r, 2R + r, 3R + r), they let each head be
# computed alone, FlashAttention's way, its output accumulated in registers; the two maps kernels sum over the heads
# one at a time. A head's tiles are [1, queries, keys] (the leading axis: the tiles kernels' loaders serve as they are).


def _head_dot(a, b, HALF: tl.constexpr):
    """`_dot` of one head's [1, m, k] and [1, k, n] tiles, as a 2D product."""
    product = _dot(tl.reshape(a, (a.shape[1], a.shape[2])), tl.reshape(b, (b.shape[1], b.shape[2])), HALF)
    return tl.reshape(product, (1, a.shape[1], b.shape[2]))


def _head_weights(w, row, idx, ok, n, N, H, R, RP: tl.constexpr):
    """w[row, idx, r, n] of head n for every r: [RP, positions], float32, of a [b, N, R, H] tensor."""
    r_idx = tl.arange(0, RP)
    offsets = ((row * N + idx[None, :]) * R + r_idx[:, None]) * H + n
    return tl.load(w + offsets, mask=(r_idx[:, None] < R) & ok[None, :], other=0.0).to(tl.float32)


def _load_map(maps, row, j, t_idx, t_ok, s_idx, s_ok, seen, T, S, R: tl.constexpr):
    """maps[row, j] where the pair is seen (0 elsewhere): [queries, keys], float32. (Loaded whole tile rows, so that
    the loads are vectors; entries no query sees were never written, and are dropped after the load.)"""
    plane = maps + (row.to(tl.int64) * 4 * R + j) * T * S  # 64-bit only here: a plane itself fits 32 bits
    tile = tl.load(plane + t_idx[:, None] * S + s_idx[None, :], mask=t_ok[:, None] & s_ok[None, :], other=0.0)
    return tl.where(seen, tile.to(tl.float32), 0.0)


def _store_maps(maps, row, first, t_idx, t_ok, s_idx, s_ok, T, S, R: tl.constexpr, RP: tl.constexpr, value):
    """maps[row, first + r, t, s] = value[r, t, s]."""
    r_ok = tl.arange(0, RP) < R
    mask = r_ok[:, None, None] & t_ok[None, :, None] & s_ok[None, None, :]
    planes = maps + (row.to(tl.int64) * 4 * R + first) * T * S
    offsets = tl.arange(0, RP)[:, None, None] * T * S + t_idx[None, :, None] * S + s_idx[None, None, :]
    tl.store(planes + offsets, value.to(maps.dtype.element_ty), mask=mask)


def _head_scores(q_rows, k, row, s_idx, s_ok, h_idx, h_ok, S, H, E, scale, EP: tl.constexpr, HALF: tl.constexpr):
    """S = scale q k^T of one head: [1, queries, keys], float32, from its query rows ([1, queries, EP])."""
    e = tl.arange(0, EP)
    k_rows = _rows(k, row, s_idx, s_ok, h_idx, h_ok, e, e < E, S, H, E)
    return _head_dot(q_rows, tl.permute(k_rows, (0, 2, 1)), HALF) * scale


def _head_compose(
    x, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, seen, T, S, H, R: tl.constexpr, maps, first, qw2, kw2, qg, kg,
    QP: tl.constexpr, KP: tl.constexpr, QG: tl.constexpr, KG: tl.constexpr
):
    """One compose stage on one head's [1, queries, keys] tile, its cross-head terms read from the stage's maps
    (maps[first + r] query-wise, maps[first + R + r] key-wise)."""
    y = x
    if QG:
        y = y + x * _weight(qg, row, t_idx, t_ok, 0, h_idx, h_ok, T, 1, H)[:, :, None]
    if KG:
        y = y + x * _weight(kg, row, s_idx, s_ok, 0, h_idx, h_ok, S, 1, H)[:, None, :]
    for r in tl.static_range(R):
        if QP:
            hidden = _load_map(maps, row, first + r, t_idx, t_ok, s_idx, s_ok, seen, T, S, R)
            y = y + hidden[None, :, :] * _weight(qw2, row, t_idx, t_ok, r, h_idx, h_ok, T, R, H)[:, :, None]
        if KP:
            hidden = _load_map(maps, row, first + R + r, t_idx, t_ok, s_idx, s_ok, seen, T, S, R)
            y = y + hidden[None, :, :] * _weight(kw2, row, s_idx, s_ok, r, h_idx, h_ok, S, R, H)[:, None, :]
    return y


def _head_pattern(
    q_rows, k, maps, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, seen, T, S, H, E, R: tl.constexpr, scale, qw2, kw2,
    qg, kg, maxima, sums, QP: tl.constexpr, KP: tl.constexpr, QG: tl.constexpr, KG: tl.constexpr, EP: tl.constexpr,
    HALF: tl.constexpr, NORMALISED: tl.constexpr
):
    """One head's pre-composed scores (-inf where hidden) or, NORMALISED, its probabilities from the row statistics
    ([1, queries] each)."""
    scores = _head_scores(q_rows, k, row, s_idx, s_ok, h_idx, h_ok, S, H, E, scale, EP, HALF)
    composed = _head_compose(
        scores, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, seen, T, S, H, R, maps, 0, qw2, kw2, qg, kg, QP, KP, QG,
        KG
    )
    if NORMALISED:
        return tl.where(seen[None, :, :], tl.exp(composed - maxima[:, :, None]) / sums[:, :, None], 0.0)
    return tl.where(seen[None, :, :], composed, float("-inf"))


def _head_rows(x, row, idx, ok, h_idx, h_ok, N, H, E, EP: tl.constexpr):
    """One head's rows of a [b, N, H, E] tensor: [1, positions, EP] (the head dim padded), in its dtype."""
    e = tl.arange(0, EP)
    return _rows(x, row, idx, ok, h_idx, h_ok, e, e < E, N, H, E)


def _tile_is_seen(t0, s0, past, span, BQ: tl.constexpr, BK: tl.constexpr):
    """Whether any query of the block starting at t0 sees any key of the block starting at s0."""
    return (s0 <= past + t0 + BQ - 1) & (s0 + BK - 1 > past + t0 - span)


def _pre_maps_kernel(
    q, k, maps, qw1, kw1, T, S, H, E, R: tl.constexpr, past, span, scale, RP: tl.constexpr, EP: tl.constexpr,
    BQ: tl.constexpr, BK: tl.constexpr, QP: tl.constexpr, KP: tl.constexpr, HALF: tl.constexpr
):
    """The pre-compose's maps hq (j < R) and hk (R <= j < 2R) of one (key block, query block) tile (program axes 0,
    1) of one batch row (axis 2), summed over the heads one at a time; tiles no query sees are skipped."""
    s0 = tl.program_id(0) * BK
    t0 = tl.program_id(1) * BQ
    row = tl.program_id(2)
    if _tile_is_seen(t0, s0, past, span, BQ, BK):
        t_idx = t0 + tl.arange(0, BQ)
        t_ok = t_idx < T
        s_idx = s0 + tl.arange(0, BK)
        s_ok = s_idx < S
        q_maps = tl.zeros((RP, BQ, BK), dtype=tl.float32)
        k_maps = tl.zeros((RP, BQ, BK), dtype=tl.float32)
        for n in range(H):
            head = n + tl.arange(0, 1)
            q_rows = _head_rows(q, row, t_idx, t_ok, head, head < H, T, H, E, EP)
            scores = _head_scores(q_rows, k, row, s_idx, s_ok, head, head < H, S, H, E, scale, EP, HALF)
            if QP:
                q_maps += scores * _head_weights(qw1, row, t_idx, t_ok, n, T, H, R, RP)[:, :, None]
            if KP:
                k_maps += scores * _head_weights(kw1, row, s_idx, s_ok, n, S, H, R, RP)[:, None, :]
        if QP:
            _store_maps(maps, row, 0, t_idx, t_ok, s_idx, s_ok, T, S, R, RP, q_maps)
        if KP:
            _store_maps(maps, row, R, t_idx, t_ok, s_idx, s_ok, T, S, R, RP, k_maps)


def _row_statistics_kernel(
    q, k, maps, row_max, row_sum, real, qw2, kw2, qg, kg, T, S, H, E, R: tl.constexpr, past, span, scale,
    EP: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, QP: tl.constexpr, KP: tl.constexpr,
    QG: tl.constexpr, KG: tl.constexpr, PADDING: tl.constexpr, HALF: tl.constexpr
):
    """The softmax's max and sum of one head (program axis 0) over one block of queries (axis 1) of one batch row
    (axis 2), over every key those queries see (online, one pass)."""
    h_idx = tl.program_id(0) + tl.arange(0, 1)
    h_ok = h_idx < H
    t0 = tl.program_id(1) * BQ
    row = tl.program_id(2)
    t_idx = t0 + tl.arange(0, BQ)
    t_ok = t_idx < T
    first_key = tl.maximum(past + t0 - span + 1, 0) // BK * BK  # aligned, so that whole vectors load
    end_key = tl.minimum(past + t0 + BQ, S)
    q_rows = _head_rows(q, row, t_idx, t_ok, h_idx, h_ok, T, H, E, EP)
    running_max = tl.full((1, BQ), float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros((1, BQ), dtype=tl.float32)
    for s0 in range(first_key, end_key, BK):
        s_idx = s0 + tl.arange(0, BK)
        s_ok = s_idx < end_key  # keys past the block's last query are not even read
        seen = _visible(row, t_idx, t_ok, s_idx, s_ok, real, S, past, span, PADDING)
        composed = _head_pattern(
            q_rows, k, maps, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, seen, T, S, H, E, R, scale, qw2, kw2, qg,
            kg, running_max, running_sum, QP, KP, QG, KG, EP, HALF, False
        )
        running_max, running_sum = _online_softmax(running_max, running_sum, composed)
    _store_statistics(row_max, row_sum, running_max, running_sum, row, h_idx, h_ok, t_idx, t_ok, H, T)


def _post_maps_kernel(
    q, k, maps, row_max, row_sum, real, pre_qw2, pre_kw2, pre_qg, pre_kg, post_qw1, post_kw1, T, S, H, E,
    R: tl.constexpr, past, span, scale, RP: tl.constexpr, EP: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
    PRE_QP: tl.constexpr, PRE_KP: tl.constexpr, PRE_QG: tl.constexpr, PRE_KG: tl.constexpr, POST_QP: tl.constexpr,
    POST_KP: tl.constexpr, PADDING: tl.constexpr, HALF: tl.constexpr
):
    """The post-compose's maps gq (2R <= j < 3R) and gk (3R <= j < 4R) of one (key block, query block) tile (program
    axes 0, 1) of one batch row (axis 2): every head's probabilities, one head at a time, summed."""
    s0 = tl.program_id(0) * BK
    t0 = tl.program_id(1) * BQ
    row = tl.program_id(2)
    if _tile_is_seen(t0, s0, past, span, BQ, BK):
        t_idx = t0 + tl.arange(0, BQ)
        t_ok = t_idx < T
        s_idx = s0 + tl.arange(0, BK)
        s_ok = s_idx < S
        seen = _visible(row, t_idx, t_ok, s_idx, s_ok, real, S, past, span, PADDING)
        q_maps = tl.zeros((RP, BQ, BK), dtype=tl.float32)
        k_maps = tl.zeros((RP, BQ, BK), dtype=tl.float32)
        for n in range(H):
            head = n + tl.arange(0, 1)
            stats = (row * H + head[:, None]) * T + t_idx[None, :]
            maxima = tl.load(row_max + stats, mask=t_ok[None, :], other=0.0)
            sums = tl.load(row_sum + stats, mask=t_ok[None, :], other=1.0)
            pattern = _head_pattern(
                _head_rows(q, row, t_idx, t_ok, head, head < H, T, H, E, EP), k, maps, row, t_idx, t_ok, s_idx,
                s_ok, head, head < H, seen, T, S, H, E, R, scale, pre_qw2, pre_kw2, pre_qg, pre_kg, maxima, sums,
                PRE_QP, PRE_KP, PRE_QG, PRE_KG, EP, HALF, True
            )
            if POST_QP:
                q_maps += pattern * _head_weights(post_qw1, row, t_idx, t_ok, n, T, H, R, RP)[:, :, None]
            if POST_KP:
                k_maps += pattern * _head_weights(post_kw1, row, s_idx, s_ok, n, S, H, R, RP)[:, None, :]
        if POST_QP:
            _store_maps(maps, row, 2 * R, t_idx, t_ok, s_idx, s_ok, T, S, R, RP, q_maps)
        if POST_KP:
            _store_maps(maps, row, 3 * R, t_idx, t_ok, s_idx, s_ok, T, S, R, RP, k_maps)


def _head_output_kernel(
    q, k, v, z, maps, row_max, row_sum, real, pre_qw2, pre_kw2, pre_qg, pre_kg, post_qw2, post_kw2, post_qg, post_kg,
    T, S, H, E, R: tl.constexpr, past, span, scale, EP: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
    PRE_QP: tl.constexpr, PRE_KP: tl.constexpr, PRE_QG: tl.constexpr, PRE_KG: tl.constexpr,
    POST_QP: tl.constexpr, POST_KP: tl.constexpr, POST_QG: tl.constexpr, POST_KG: tl.constexpr, PADDING: tl.constexpr,
    HALF: tl.constexpr
):
    """z of one head (program axis 0) for one block of queries (axis 1) of one batch row (axis 2): its probabilities,
    post-composed with the maps, times v, accumulated over the keys in registers."""
    h_idx = tl.program_id(0) + tl.arange(0, 1)
    h_ok = h_idx < H
    t0 = tl.program_id(1) * BQ
    row = tl.program_id(2)
    t_idx = t0 + tl.arange(0, BQ)
    t_ok = t_idx < T
    first_key = tl.maximum(past + t0 - span + 1, 0)
    end_key = tl.minimum(past + t0 + BQ, S)
    stats = (row * H + h_idx[:, None]) * T + t_idx[None, :]
    maxima = tl.load(row_max + stats, mask=h_ok[:, None] & t_ok[None, :], other=0.0)
    sums = tl.load(row_sum + stats, mask=h_ok[:, None] & t_ok[None, :], other=1.0)
    q_rows = _head_rows(q, row, t_idx, t_ok, h_idx, h_ok, T, H, E, EP)
    out = tl.zeros((1, BQ, EP), dtype=tl.float32)
    for s0 in range(first_key // BK * BK, end_key, BK):  # aligned, so that whole vectors load
        s_idx = s0 + tl.arange(0, BK)
        s_ok = s_idx < end_key
        seen = _visible(row, t_idx, t_ok, s_idx, s_ok, real, S, past, span, PADDING)
        pattern = _head_pattern(
            q_rows, k, maps, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, seen, T, S, H, E, R, scale, pre_qw2, pre_kw2,
            pre_qg, pre_kg, maxima, sums, PRE_QP, PRE_KP, PRE_QG, PRE_KG, EP, HALF, True
        )
        pattern = _head_compose(
            pattern, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, seen, T, S, H, R, maps, 2 * R, post_qw2, post_kw2,
            post_qg, post_kg, POST_QP, POST_KP, POST_QG, POST_KG
        )
        # keys of the aligned block before the first visible one were loaded, never used: 0, whatever they hold
        values = _head_rows(v, row, s_idx, s_ok, h_idx, h_ok, S, H, E, EP)
        values = tl.where((s_idx >= first_key)[None, :, None], values, 0.0).to(v.dtype.element_ty)
        out += _head_dot(tl.where(seen[None, :, :], pattern, 0.0), values, HALF)
    e = tl.arange(0, EP)
    offsets = ((row * T + t_idx[None, :, None]) * H + h_idx[:, None, None]) * E + e[None, None, :]
    mask = h_ok[:, None, None] & t_ok[None, :, None] & (e[None, None, :] < E)
    tl.store(z + offsets, out.to(z.dtype.element_ty), mask=mask)

# fmt: on

_KERNELS = (
    "_dot",
    "_weight",
    "_accumulate",
    "_rows",
    "_accumulate_rows",
    "_visible",
    "_scores",
    "_compose",
    "_compose_backward",
    "_pre_composed",
    "_pattern",
    "_online_softmax",
    "_store_statistics",
    "_forward_kernel",
    "_backward_query_kernel",
    "_backward_key_kernel",
    "_head_dot",
    "_head_weights",
    "_load_map",
    "_store_maps",
    "_head_scores",
    "_head_compose",
    "_head_pattern",
    "_head_rows",
    "_tile_is_seen",
    "_pre_maps_kernel",
    "_row_statistics_kernel",
    "_post_maps_kernel",
    "_head_output_kernel",
)
_decorated = False
_decorated_interpreted = False
_INTERPRETED = False  # the kernels' constant, set by _decorate


def _decorate() -> None:
    """Decorate the kernels with triton.jit, once (natively, or under the interpreter if TRITON_INTERPRET=1 now)."""
    global _decorated, _decorated_interpreted
    if _decorated:
        return
    _decorated_interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
    module = globals()
    module["_INTERPRETED"] = tl.constexpr(_decorated_interpreted)
    for name in _KERNELS:
        module[name] = triton.jit(module[name])
    _decorated = True


# --- the launches --------------------------------------------------------------------------------------------------


class _Launch:
    """What every kernel of one call is given besides the tensors: shapes, the mask's past and span, which branches
    are on (the kernels' constexpr flags), the block sizes."""

    def __init__(self, q: Tensor, k: Tensor, weights: tuple, window, official, past, real, blocks, map_blocks):
        batch, self.n_queries, self.n_heads, self.d_head = q.shape
        self.batch, self.n_keys = batch, k.shape[1]
        self.past = past
        # query p sees key s when p - span < s <= p: a local window's span is its keys (one more for "official-
        # inference"); a global layer's is beyond every key
        self.span = window + int(official) if window is not None else self.n_keys + 1
        self.scale = self.d_head**-0.5
        ranks = {w.shape[2] for w, name in zip(weights, BRANCHES * 2, strict=True) if w is not None and name[1] == "w"}
        self.rank = ranks.pop() if ranks else 1
        self.block_queries, self.block_keys, self.block_dim = blocks
        blocks_given = {} if map_blocks is None else dict(BQ=map_blocks[0], BK=map_blocks[1])
        self.maps_kernels, self.head_kernels = dict(MAPS_KERNELS, **blocks_given), dict(HEAD_KERNELS, **blocks_given)
        self.flags = {
            f"{stage}_{branch}": weights[offset + index] is not None
            for stage, offset in (("PRE", 0), ("POST", 6))
            for branch, index in (("QP", 0), ("KP", 2), ("QG", 4), ("KG", 5))
        }
        self.flags["PADDING"] = real is not None
        self.flags["HALF"] = q.dtype != torch.float32

    def scalars(self) -> tuple:
        return (self.n_queries, self.n_keys, self.n_heads, self.d_head, self.rank, self.past, self.span, self.scale)

    def constants(self) -> dict:
        blocks = dict(BQ=self.block_queries, BK=self.block_keys, BE=self.block_dim)
        # num_stages=1: no software pipelining, whose early loads could read a float32 accumulator (z, dq, ...) before
        # the previous iteration stored it
        padded_heads = triton.next_power_of_2(self.n_heads)
        launch = dict(num_warps=_num_warps(padded_heads), num_stages=1)
        return dict(HP=padded_heads, **blocks, **self.flags, **launch)


def _num_warps(padded_heads: int) -> int:
    """Warps a program. Swept on an NVIDIA H100 (bfloat16, causal, 2,048 and 4,096 tokens, against 8 warps): 16 heads
    of 64 took 0.69x the time with 4 warps, forward and forward + backward; 32 heads of 128 took 0.84-1.21x (the
    backward slower); 16 warps took 1.5-2.3x everywhere (128 registers a thread: the [32 heads, 16, 16] tiles
    spill)."""
    return 4 if padded_heads <= 16 else 8


def _pointers(tensors, stand_in: Tensor) -> list[Tensor]:
    """The tensors, with `stand_in` for each that is None (the kernels never read a branch that is off)."""
    return [stand_in if w is None else w for w in tensors]


def _forward(launch: _Launch, q, k, v, real, weights) -> tuple[Tensor, Tensor, Tensor]:
    """z (in q's dtype) and the softmax's row max and sum ([b, h, t], float32)."""
    z = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    stats = torch.empty(2, launch.batch, launch.n_heads, launch.n_queries, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(launch.n_queries, launch.block_queries), launch.batch)
    _forward_kernel[grid](
        q, k, v, z, stats[0], stats[1], q if real is None else real, *_pointers(weights, q),
        *launch.scalars(), **launch.constants(),
    )  # fmt: skip
    return z.to(q.dtype), stats[0], stats[1]


def _forward_through_maps(launch: _Launch, q, k, v, real, weights) -> tuple[Tensor, Tensor, Tensor]:
    """z (in q's dtype) and the softmax's row max and sum ([b, h, t], float32), by the four kernels of the forward
    through the cross-head maps: the pre-compose's maps, each head's row statistics, the post-compose's maps, each
    head's output. The maps of at most MAPS_BYTES are held at a time: longer prompts go a chunk of queries at a time
    (each against every key it sees, the chunks' own cache-like `past`)."""
    batch, n_queries, n_keys = launch.batch, launch.n_queries, launch.n_keys
    any_map = any(launch.flags[f"{stage}_{branch}"] for stage in ("PRE", "POST") for branch in ("QP", "KP"))
    maps_dtype = q.dtype if launch.flags["HALF"] else torch.float32
    block_queries = max(launch.maps_kernels["BQ"], launch.head_kernels["BQ"])
    bytes_a_query = batch * 4 * launch.rank * n_keys * maps_dtype.itemsize
    chunk = max(block_queries, MAPS_BYTES // bytes_a_query // block_queries * block_queries)
    maps = None
    if any_map:
        maps = torch.empty(batch, 4 * launch.rank, min(chunk, n_queries), n_keys, dtype=maps_dtype, device=q.device)
    outputs = []
    for first in range(0, n_queries, chunk):
        last = min(first + chunk, n_queries)
        part = [w if w is None or i not in QUERY_SIDE else w[:, first:last].contiguous() for i, w in enumerate(weights)]
        outputs.append(
            _maps_launches(launch, q[:, first:last].contiguous(), k, v, real, part, maps, launch.past + first)
        )
    if len(outputs) == 1:
        return outputs[0]
    z, row_max, row_sum = zip(*outputs, strict=True)
    return torch.cat(z, dim=1), torch.cat(row_max, dim=-1), torch.cat(row_sum, dim=-1)


def _maps_launches(launch: _Launch, q, k, v, real, weights, maps, past) -> tuple[Tensor, Tensor, Tensor]:
    """The four kernels on the queries q (at positions past, past + 1, ...) against every key k, v."""
    flags, batch, n_queries, n_heads = launch.flags, q.shape[0], q.shape[1], launch.n_heads
    scalars = (n_queries, launch.n_keys, n_heads, launch.d_head, launch.rank, past, launch.span, launch.scale)
    head_dim = dict(EP=max(16, triton.next_power_of_2(launch.d_head)))
    summed = dict(RP=triton.next_power_of_2(launch.rank), **head_dim, **launch.maps_kernels)
    one_head = dict(**head_dim, **launch.head_kernels)
    pre_qw1, pre_qw2, pre_kw1, pre_kw2, pre_qg, pre_kg, post_qw1, post_qw2, post_kw1, post_kw2, post_qg, post_kg = (
        _pointers(weights, q)
    )
    branches = ("QP", "KP", "QG", "KG")
    pre = {branch: flags[f"PRE_{branch}"] for branch in branches}
    both = {f"{stage}_{branch}": flags[f"{stage}_{branch}"] for stage in ("PRE", "POST") for branch in branches}
    masks = dict(PADDING=flags["PADDING"], HALF=flags["HALF"])
    maps = q if maps is None else maps
    stats = torch.empty(2, batch, n_heads, n_queries, dtype=torch.float32, device=q.device)
    z = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    real = q if real is None else real
    tiles = (triton.cdiv(launch.n_keys, summed["BK"]), triton.cdiv(n_queries, summed["BQ"]), batch)
    heads = (n_heads, triton.cdiv(n_queries, one_head["BQ"]), batch)
    if pre["QP"] or pre["KP"]:
        _pre_maps_kernel[tiles](
            q, k, maps, pre_qw1, pre_kw1, *scalars, QP=pre["QP"], KP=pre["KP"], HALF=flags["HALF"], **summed
        )
    _row_statistics_kernel[heads](
        q, k, maps, *stats, real, pre_qw2, pre_kw2, pre_qg, pre_kg, *scalars, **pre, **masks, **one_head
    )
    if flags["POST_QP"] or flags["POST_KP"]:
        post_maps = {name: on for name, on in both.items() if name not in ("POST_QG", "POST_KG")}
        _post_maps_kernel[tiles](
            q, k, maps, *stats, real, pre_qw2, pre_kw2, pre_qg, pre_kg, post_qw1, post_kw1, *scalars, **post_maps,
            **masks, **summed,
        )  # fmt: skip
    _head_output_kernel[heads](
        q, k, v, z, maps, *stats, real, pre_qw2, pre_kw2, pre_qg, pre_kg, post_qw2, post_kw2, post_qg, post_kg,
        *scalars, **both, **masks, **one_head,
    )  # fmt: skip
    return z, stats[0], stats[1]


def _backward(launch: _Launch, q, k, v, real, weights, row_max, row_sum, dz) -> tuple:
    """The gradients of q, k, v and of each dynamic weight (None for a weight that is None)."""
    float32 = dict(dtype=torch.float32, device=q.device)
    dq, dk, dv = (torch.zeros(x.shape, **float32) for x in (q, k, v))
    d_weights = [None if w is None else torch.zeros(w.shape, **float32) for w in weights]
    d_row = torch.empty(launch.batch, launch.n_heads, launch.n_queries, **float32)
    tensors = (q, k, v, dz.contiguous(), row_max, row_sum, d_row)
    real = q if real is None else real
    query_side = _pointers([d_weights[i] for i in QUERY_SIDE], dq)
    key_side = _pointers([d_weights[i] for i in KEY_SIDE], dk)
    grid = (triton.cdiv(launch.n_queries, launch.block_queries), launch.batch)
    _backward_query_kernel[grid](
        *tensors, dq, real, *_pointers(weights, q), *query_side, *launch.scalars(), **launch.constants()
    )
    grid = (triton.cdiv(launch.n_keys, launch.block_keys), launch.batch)
    _backward_key_kernel[grid](
        *tensors, dk, dv, real, *_pointers(weights, q), *key_side, *launch.scalars(), **launch.constants()
    )
    d_weights = [None if d is None else d.to(w.dtype) for d, w in zip(d_weights, weights, strict=True)]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *d_weights


_FORWARDS = {"maps": _forward_through_maps, "tiles": _forward}


class FusedDCMHA(torch.autograd.Function):
    """z of DCMHA whose backward is the fused kernels': the forward saves the inputs and the row statistics only."""

    @staticmethod
    def forward(ctx, launch: _Launch, q, k, v, real, *weights):
        z, row_max, row_sum = _forward(launch, q, k, v, real, weights)  # the statistics the backward recomputes
        ctx.launch = launch
        ctx.save_for_backward(q, k, v, real, row_max, row_sum, *weights)
        return z

    @staticmethod
    def backward(ctx, dz):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "the fused Triton DCMHA has no second derivatives (create_graph=True): use the materialised path"
            )
        q, k, v, real, row_max, row_sum, *weights = ctx.saved_tensors
        dq, dk, dv, *d_weights = _backward(ctx.launch, q, k, v, real, weights, row_max, row_sum, dz)
        return None, dq, dk, dv, None, *d_weights


def fused_dcmha(
    q: Float[Tensor, "b t h e"],
    k: Float[Tensor, "b s h e"],
    v: Float[Tensor, "b s h e"],
    pre: tuple | None,
    post: tuple | None,
    *,
    window: int | None,
    official: bool,
    past: int = 0,
    real: Bool[Tensor, "b s"] | None = None,
    blocks: tuple[int, int, int] = BLOCKS,
    forward: Literal["maps", "tiles"] = "maps",
    map_blocks: tuple[int, int] | None = None,
) -> Float[Tensor, "b t h e"]:
    """z of DCMHA, differentiable in q, k, v and every dynamic weight (fused backward). s = past + t.

    pre, post: each stage's dynamic weights (qw1, qw2, kw1, kw2, qg, kg), or None for a stage that is off; any member
    None for a branch that is off. qw1, qw2: [b, t, r, h]; kw1, kw2: [b, s, r, h]; qg: [b, t, h]; kg: [b, s, h].
    window: a local layer's window (None: global), `official` for the "official-inference" semantics (window + 1
    keys). real: False at padded keys (a query always sees itself). blocks: queries and keys of a tile and the chunk
    of the head dim for the tiles kernels, powers of two of at least 16. forward: which forward computes z when no
    gradient is needed ("maps", the faster, or "tiles"); with gradients, always "tiles" (this module's docstring).
    map_blocks: queries and keys of a tile of the four kernels of the forward through the maps (None: MAPS_KERNELS'
    and HEAD_KERNELS'). Second derivatives (create_graph=True) raise: take the materialised path for them."""
    reason = available(q.device)
    if reason is not None:
        raise RuntimeError(f"fused_dcmha: {reason}")
    _decorate()
    for name, stage in (("pre", pre), ("post", post)):
        if stage is not None and len(stage) != 6:
            raise ValueError(
                f"fused_dcmha: {name} must be (qw1, qw2, kw1, kw2, qg, kg) or None (got {len(stage)} items)"
            )
    weights = tuple(None if w is None else w.contiguous() for w in (*(pre or (None,) * 6), *(post or (None,) * 6)))
    _check(q, k, v, weights, past, real, window, blocks, forward, map_blocks)
    if real is not None:
        real = real.to(device=q.device, dtype=torch.int8).contiguous()
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    launch = _Launch(q, k, weights, window, official, past, real, blocks, map_blocks)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, *weights)):
        return FusedDCMHA.apply(launch, q, k, v, real, *weights)
    return _FORWARDS[forward](launch, q, k, v, real, weights)[0]


def _check(q, k, v, weights, past, real, window, blocks, forward, map_blocks) -> None:
    """One clear line naming the argument at fault."""
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise ValueError(f"fused_dcmha: q, k, v must be [b, t, h, e], [b, s, h, e] (got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)})")  # fmt: skip
    b, t, h, e = q.shape
    devices = {x.device for x in (q, k, v, real, *weights) if x is not None}
    if len(devices) > 1:
        raise ValueError(
            f"fused_dcmha: every tensor must be on q's device, {q.device} (got {sorted(map(str, devices))})"
        )
    if k.shape[0] != b or k.shape[2:] != q.shape[2:] or k.shape[1] != past + t:
        raise ValueError(
            f"fused_dcmha: k and v must be [b, past + t, h, e] = {[b, past + t, h, e]}, got {list(k.shape)}"
        )
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"fused_dcmha: q, k, v must share a float32/float16/bfloat16 dtype (got {q.dtype}, "
                         f"{k.dtype}, {v.dtype})")  # fmt: skip
    for stage, offset in (("pre", 0), ("post", 6)):
        for name, w in zip(BRANCHES, weights[offset : offset + 6], strict=True):
            if w is None:
                continue
            positions = t if name[0] == "q" else past + t
            expected = [b, positions, h] if name[1] == "g" else [b, positions, w.shape[2] if w.ndim == 4 else 0, h]
            if list(w.shape) != expected or (name[1] == "w" and w.shape[2] < 1):
                raise ValueError(f"fused_dcmha: {stage} {name} must be {expected} (got {list(w.shape)})")
        for first, second in (("qw1", "qw2"), ("kw1", "kw2")):
            i, j = offset + BRANCHES.index(first), offset + BRANCHES.index(second)
            if (weights[i] is None) != (weights[j] is None) or (
                weights[i] is not None and weights[i].shape != weights[j].shape
            ):
                raise ValueError(f"fused_dcmha: {stage} {first} and {second} must be given together, of one shape")
    ranks = {w.shape[2] for w in weights if w is not None and w.ndim == 4}
    if len(ranks) > 1:
        raise ValueError(f"fused_dcmha: every projection weight must have one rank (got ranks {sorted(ranks)})")
    if real is not None and (real.shape != (b, past + t) or real.dtype != torch.bool):
        raise ValueError(
            f"fused_dcmha: real must be a bool [b, past + t] = {[b, past + t]} (got {real.dtype} {list(real.shape)})"
        )
    if window is not None and window < 1:
        raise ValueError(f"fused_dcmha: window must be at least 1 (got {window})")
    if len(blocks) != 3 or any(n < 16 or n & (n - 1) for n in blocks):
        raise ValueError(f"fused_dcmha: blocks must be three powers of two of at least 16 (got {blocks})")
    if map_blocks is not None and (len(map_blocks) != 2 or any(n < 16 or n & (n - 1) for n in map_blocks)):
        raise ValueError(f"fused_dcmha: map_blocks must be two powers of two of at least 16 (got {map_blocks})")
    if forward not in _FORWARDS:
        raise ValueError(f"fused_dcmha: forward must be one of {sorted(_FORWARDS)} (got {forward!r})")
