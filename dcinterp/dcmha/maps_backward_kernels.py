"""The Triton kernels of the backward of DCMHA through the cross-head maps (`dcinterp.dcmha.maps` launches them):
inner helpers, then the kernels.

FlashAttention's recomputation: `dcinterp.dcmha.maps` first launches the forward's maps kernels again (the maps, bit
for bit) and `product_maps_kernel` on dz and v (the gradient maps of the post-compose), then the kernels here: D =
sum_s P dP (`row_gradient_kernel`), the gradient maps of the pre-compose (`pre_gradient_maps_kernel`), and each
head's query side (`head_query_gradient_kernel`) and key side (`head_key_gradient_kernel`). They call the forward's
helpers (`dcinterp.dcmha.maps_kernels`: a head's tiles, its compose, the blocks of keys a loop walks), and are jitted
with them: `jit` jits the forward's module first, then rebinds each helper imported from it to its jitted function,
so that Triton finds a jitted function wherever a kernel here calls one.

Index names: b batch, t queries, s keys, h/m/n heads, e head dim, r rank.
"""

from __future__ import annotations

from .jit import LateJit, tl
from .maps_kernels import (
    add_head_to_maps,
    head_compose,
    head_dot,
    head_rows,
    load_statistics,
    masked_block,
    masked_blocks,
    row_values,
    seen_pairs,
    store_maps,
    store_row_values,
    tile_is_seen,
    tile_positions,
    whole_key_blocks,
)
from .maps_kernels import jit as forward_jit

# (the kernels' long argument lists packed, not one a line)
# fmt: off


# --- the backward through the maps: each head alone but for the maps and their gradients --------------------------
# The backward of the forward through the maps, by the same decomposition. With dP' = dz v^T, the post-compose's
# transpose mixes heads only through the gradients of its maps, dgq[r] = sum_m qw2'[t, r, m] dP'[m] and dgk[r]
# alike: dP[n] = dP'[n] (1 + qg' + kg') + sum_r dgq[r] qw1'[t, r, n] + sum_r dgk[r] kw1'[s, r, n], a compose with
# the w1 in the w2's place. Then dA = P (dP - D), D = sum_s P dP, and the pre-compose's transpose alike through
# dhq[r] = sum_m qw2[t, r, m] dA[m] and dhk[r]. The gradient maps are kept in a second [b, 4R, t, s] buffer
# (`grads`, j = r, R + r, 2R + r, 3R + r: dhq, dhk, dgq, dgk), beside the maps the forward's kernels recompute.


def _load_maps(maps, row, first, t_idx, s_idx, seen, T, S, R: tl.constexpr, RP: tl.constexpr):
    """maps[row, first + r] for every r where the pair is seen (0 elsewhere, and for r >= R): [RP, queries, keys],
    float32 (masked as the forward's `_load_map`)."""
    r_idx = tl.arange(0, RP)
    planes = maps + (row.to(tl.int64) * 4 * R + first) * T * S
    offsets = r_idx[:, None, None] * T * S + t_idx[None, :, None] * S + s_idx[None, None, :]
    mask = (r_idx < R)[:, None, None] & (t_idx < T)[None, :, None] & (s_idx < S)[None, None, :]
    tile = tl.load(planes + offsets, mask=mask)
    return tl.where(seen[None, :, :] & (r_idx < R)[:, None, None], tile.to(tl.float32), 0.0)


def _put_head_weights(buffer, row, idx, ok, n, N, H, R: tl.constexpr, RP: tl.constexpr, value, ADD: tl.constexpr):
    """buffer[row, idx, r, n] = value[r, positions] for every r < R, of a [b, N, R, H] buffer (a gate's: R = 1), in
    its dtype; ADD: += into a float32 buffer (the key side of a prompt's chunks of queries)."""
    r_idx = tl.arange(0, RP)
    offsets = ((row * N + idx[None, :]) * R + r_idx[:, None]) * H + n
    mask = (r_idx[:, None] < R) & ok[None, :]
    if ADD:
        value += tl.load(buffer + offsets, mask=mask, other=0.0)
    tl.store(buffer + offsets, value.to(buffer.dtype.element_ty), mask=mask)


def _put_head_rows(buffer, row, idx, ok, h_idx, h_ok, N, H, E, EP: tl.constexpr, value, ADD: tl.constexpr):
    """One head's rows of a [b, N, H, E] buffer = value ([1, positions, EP]), in its dtype; ADD: += into a float32
    buffer."""
    e = tl.arange(0, EP)
    offsets = ((row * N + idx[None, :, None]) * H + h_idx[:, None, None]) * E + e[None, None, :]
    mask = h_ok[:, None, None] & ok[None, :, None] & (e < E)[None, None, :]
    if ADD:
        value += tl.load(buffer + offsets, mask=mask, other=0.0)
    tl.store(buffer + offsets, value.to(buffer.dtype.element_ty), mask=mask)


def _head_gradients(
    q_rows, k_rows, dz_rows, v_rows, maps, grads, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, seen, maxima, sums,
    d_row, T, S, H, R: tl.constexpr, scale, pre_qw1, pre_qw2, pre_kw1, pre_kw2, pre_qg, pre_kg, post_qw1, post_kw1,
    post_qg, post_kg, PRE_QP: tl.constexpr, PRE_KP: tl.constexpr, PRE_QG: tl.constexpr, PRE_KG: tl.constexpr,
    POST_QP: tl.constexpr, POST_KP: tl.constexpr, POST_QG: tl.constexpr, POST_KG: tl.constexpr, DOWN_TO: tl.constexpr,
    HALF: tl.constexpr
):
    """One head's [1, queries, keys] tiles of the backward, 0 where a pair is hidden: S, P, dP' and dP; with DOWN_TO
    2 also dA (from the rows' D, d_row), with 3 also dS (from the pre-compose's gradient maps). What is not computed
    is returned as dP, and the weights it needs are not read (pre_qw1, pre_kw1 below 3)."""
    scores = tl.where(seen[None, :, :], head_dot(q_rows, tl.permute(k_rows, (0, 2, 1)), HALF) * scale, 0.0)
    composed = head_compose(
        scores, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, seen, T, S, H, R, maps, 0, pre_qw2, pre_kw2, pre_qg,
        pre_kg, PRE_QP, PRE_KP, PRE_QG, PRE_KG
    )
    pattern = tl.where(seen[None, :, :], tl.exp(composed - maxima[:, :, None]) / sums[:, :, None], 0.0)
    d_composed_pattern = tl.where(seen[None, :, :], head_dot(dz_rows, tl.permute(v_rows, (0, 2, 1)), HALF), 0.0)
    d_pattern = head_compose(
        d_composed_pattern, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, seen, T, S, H, R, grads, 2 * R, post_qw1,
        post_kw1, post_qg, post_kg, POST_QP, POST_KP, POST_QG, POST_KG
    )
    d_pattern = tl.where(seen[None, :, :], d_pattern, 0.0)
    d_composed = d_pattern
    d_scores = d_pattern
    if DOWN_TO >= 2:
        d_composed = tl.where(seen[None, :, :], pattern * (d_pattern - d_row[:, :, None]), 0.0)
        d_scores = d_composed
    if DOWN_TO == 3:
        d_scores = head_compose(
            d_composed, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, seen, T, S, H, R, grads, 0, pre_qw1, pre_kw1,
            pre_qg, pre_kg, PRE_QP, PRE_KP, PRE_QG, PRE_KG
        )
        d_scores = tl.where(seen[None, :, :], d_scores, 0.0) * scale
    return scores, pattern, d_composed_pattern, d_pattern, d_composed, d_scores


def _add_weight_gradients(
    d_pre_gate, d_pre_w1, d_pre_w2, d_post_gate, d_post_w1, d_post_w2, scores, pattern, d_composed_pattern,
    d_composed, maps, grads, row, t_idx, t_ok, s_idx, s_ok, seen, T, S, R: tl.constexpr, RP: tl.constexpr,
    PRE_GATE: tl.constexpr, PRE_PROJECTION: tl.constexpr, POST_GATE: tl.constexpr, POST_PROJECTION: tl.constexpr,
    SIDE: tl.constexpr, SUMMED: tl.constexpr
):
    """One head's gradients of one side's dynamic weights of both stages (SIDE 0: the query side's qg, qw1, qw2,
    summed over a tile's keys; 1: the key side's, over its queries) with one [1, queries, keys] tile's terms added:
    a gate's is the sum of dX' X, w2's of dX' times the stage's map, w1's of the map's gradient times X (X: the
    scores before the pre-compose, the pattern before the post-compose). SUMMED: the tile's sums added ([1 or RP,
    positions] accumulators); else its products, in accumulators of the tile's shape, summed once after the loop
    (`_summed_weight_gradients`)."""
    if PRE_GATE:
        d_pre_gate += _tile_sum(d_composed * scores, 2 - SIDE, SUMMED)
    if PRE_PROJECTION:  # the pre-compose's maps are planes SIDE R .. SIDE R + R - 1
        planes = _load_maps(maps, row, SIDE * R, t_idx, s_idx, seen, T, S, R, RP)
        d_pre_w2 += _tile_sum(d_composed * planes, 2 - SIDE, SUMMED)
        planes = _load_maps(grads, row, SIDE * R, t_idx, s_idx, seen, T, S, R, RP)
        d_pre_w1 += _tile_sum(planes * scores, 2 - SIDE, SUMMED)
    if POST_GATE:
        d_post_gate += _tile_sum(d_composed_pattern * pattern, 2 - SIDE, SUMMED)
    if POST_PROJECTION:  # the post-compose's, (2 + SIDE) R ..
        planes = _load_maps(maps, row, (2 + SIDE) * R, t_idx, s_idx, seen, T, S, R, RP)
        d_post_w2 += _tile_sum(d_composed_pattern * planes, 2 - SIDE, SUMMED)
        planes = _load_maps(grads, row, (2 + SIDE) * R, t_idx, s_idx, seen, T, S, R, RP)
        d_post_w1 += _tile_sum(planes * pattern, 2 - SIDE, SUMMED)
    return d_pre_gate, d_pre_w1, d_pre_w2, d_post_gate, d_post_w1, d_post_w2


def _tile_sum(x, axis: tl.constexpr, SUMMED: tl.constexpr):
    """x summed over `axis` if SUMMED, else x as it is."""
    if SUMMED:
        x = tl.sum(x, axis=axis)
    return x


def _summed_weight_gradients(d_pre_gate, d_pre_w1, d_pre_w2, d_post_gate, d_post_w1, d_post_w2, axis: tl.constexpr):
    """The accumulators of `_add_weight_gradients` (not SUMMED) summed over the tile's `axis`."""
    return (
        tl.sum(d_pre_gate, axis=axis), tl.sum(d_pre_w1, axis=axis), tl.sum(d_pre_w2, axis=axis),
        tl.sum(d_post_gate, axis=axis), tl.sum(d_post_w1, axis=axis), tl.sum(d_post_w2, axis=axis),
    )


def _store_weight_gradients(
    d_pre_g, d_pre_w1, d_pre_w2, d_post_g, d_post_w1, d_post_w2, d_pre_gate, d_pre_weights1, d_pre_weights2,
    d_post_gate, d_post_weights1, d_post_weights2, row, idx, ok, n, N, H, R: tl.constexpr, RP: tl.constexpr,
    PRE_GATE: tl.constexpr, PRE_PROJECTION: tl.constexpr, POST_GATE: tl.constexpr, POST_PROJECTION: tl.constexpr,
    ADD: tl.constexpr
):
    """Head n's sums of `_add_weight_gradients` put into the [b, N, R, H] (a gate's [b, N, H]) gradients of one
    side's weights (d_pre_g, ...), for positions idx of that side (ADD: added into float32 buffers)."""
    if PRE_GATE:
        _put_head_weights(d_pre_g, row, idx, ok, n, N, H, 1, 1, d_pre_gate, ADD)
    if PRE_PROJECTION:
        _put_head_weights(d_pre_w1, row, idx, ok, n, N, H, R, RP, d_pre_weights1, ADD)
        _put_head_weights(d_pre_w2, row, idx, ok, n, N, H, R, RP, d_pre_weights2, ADD)
    if POST_GATE:
        _put_head_weights(d_post_g, row, idx, ok, n, N, H, 1, 1, d_post_gate, ADD)
    if POST_PROJECTION:
        _put_head_weights(d_post_w1, row, idx, ok, n, N, H, R, RP, d_post_weights1, ADD)
        _put_head_weights(d_post_w2, row, idx, ok, n, N, H, R, RP, d_post_weights2, ADD)


def _whole_query_blocks(s0, start, end, past, span, S, BQ: tl.constexpr, BK: tl.constexpr, PADDING: tl.constexpr):
    """The blocks of queries [lo, hi) (BQ apart from `start`, before `end`) of which every query sees every key of
    the block s0 .. s0 + BK - 1; lo = hi = end where there are none."""
    lo = start + (tl.maximum(s0 + BK - 1 - past - start, 0) + BQ - 1) // BQ * BQ  # from the last key's own query
    last = tl.minimum(s0 + span - past - BQ, end - BQ) - start  # the last whole block's first query (from start)
    hi = start + (tl.maximum(last, 0) // BQ + 1) * BQ
    if PADDING:
        hi = lo
    whole = (lo < hi) & (last >= 0) & (s0 + BK <= S)
    return tl.where(whole, lo, end), tl.where(whole, hi, end)


def row_gradient_kernel(
    q, k, v, dz, maps, grads, row_max, row_sum, row_d, real, pre_qw2, pre_kw2, pre_qg, pre_kg, post_qw1, post_kw1,
    post_qg, post_kg, T, S, H, E, R: tl.constexpr, past, span, scale, RP: tl.constexpr, EP: tl.constexpr,
    BQ: tl.constexpr, BK: tl.constexpr, PRE_QP: tl.constexpr, PRE_KP: tl.constexpr, PRE_QG: tl.constexpr,
    PRE_KG: tl.constexpr, POST_QP: tl.constexpr, POST_KP: tl.constexpr, POST_QG: tl.constexpr, POST_KG: tl.constexpr,
    PADDING: tl.constexpr, HALF: tl.constexpr
):
    """The softmax's D = sum_s P dP of one head (program axis 0) over one block of queries (axis 1) of one batch row
    (axis 2), into row_d ([b, H, T]). (RP is not used: the gradient kernels' settings are passed whole.)"""
    h_idx = tl.program_id(0) + tl.arange(0, 1)
    h_ok = h_idx < H
    t0 = tl.program_id(1) * BQ
    row = tl.program_id(2)
    t_idx = t0 + tl.arange(0, BQ)
    t_ok = t_idx < T
    first_key = tl.maximum(past + t0 - span + 1, 0)
    end_key = tl.minimum(past + t0 + BQ, S)
    maxima, sums = load_statistics(row_max, row_sum, row, h_idx, h_ok, t_idx, t_ok, H, T)
    q_rows = head_rows(q, row, t_idx, t_ok, h_idx, h_ok, T, H, E, EP)
    dz_rows = head_rows(dz, row, t_idx, t_ok, h_idx, h_ok, T, H, E, EP)
    d_row = tl.zeros((1, BQ), dtype=tl.float32)
    start = first_key // BK * BK  # aligned, so that whole vectors load
    lo, hi = whole_key_blocks(t0, start, end_key, past, span, T, S, BQ, BK, PADDING)
    for i in range(0, masked_blocks(start, lo, hi, end_key, BK)):
        d_row = _row_gradient_step(
            d_row, masked_block(i, start, lo, hi, BK), q_rows, k, v, dz_rows, maps, grads, real, maxima, sums,
            pre_qw2, pre_kw2, pre_qg, pre_kg, post_qw1, post_kw1, post_qg, post_kg, row, t_idx, t_ok, h_idx, h_ok,
            first_key, end_key, T, S, H, E, R, past, span, scale, EP, BK, PRE_QP, PRE_KP, PRE_QG, PRE_KG, POST_QP,
            POST_KP, POST_QG, POST_KG, PADDING, HALF, True
        )
    for s0 in range(lo, hi, BK):
        d_row = _row_gradient_step(
            d_row, s0, q_rows, k, v, dz_rows, maps, grads, real, maxima, sums, pre_qw2, pre_kw2, pre_qg, pre_kg,
            post_qw1, post_kw1, post_qg, post_kg, row, t_idx, t_ok, h_idx, h_ok, first_key, end_key, T, S, H, E, R,
            past, span, scale, EP, BK, PRE_QP, PRE_KP, PRE_QG, PRE_KG, POST_QP, POST_KP, POST_QG, POST_KG, PADDING,
            HALF, False
        )
    store_row_values(row_d, row, h_idx, h_ok, t_idx, t_ok, H, T, d_row)


def _row_gradient_step(
    d_row, s0, q_rows, k, v, dz_rows, maps, grads, real, maxima, sums, pre_qw2, pre_kw2, pre_qg, pre_kg, post_qw1,
    post_kw1, post_qg, post_kg, row, t_idx, t_ok, h_idx, h_ok, first_key, end_key, T, S, H, E, R: tl.constexpr, past,
    span, scale, EP: tl.constexpr, BK: tl.constexpr, PRE_QP: tl.constexpr, PRE_KP: tl.constexpr,
    PRE_QG: tl.constexpr, PRE_KG: tl.constexpr, POST_QP: tl.constexpr, POST_KP: tl.constexpr, POST_QG: tl.constexpr,
    POST_KG: tl.constexpr, PADDING: tl.constexpr, HALF: tl.constexpr, MASKED: tl.constexpr
):
    """D's sums with the keys s0 .. s0 + BK - 1 (MASKED: `seen_pairs`)."""
    s_idx = s0 + tl.arange(0, BK)
    s_ok = (s_idx < end_key) & (s_idx >= first_key)  # keys before the window are not read
    seen = seen_pairs(row, t_idx, t_ok, s_idx, s_ok, real, S, past, span, PADDING, MASKED)
    k_rows = head_rows(k, row, s_idx, s_ok, h_idx, h_ok, S, H, E, EP)
    v_rows = head_rows(v, row, s_idx, s_ok, h_idx, h_ok, S, H, E, EP)
    # (the pre-compose's w1 are not read down to dP: its w2 stand in)
    _, pattern, _, d_pattern, _, _ = _head_gradients(
        q_rows, k_rows, dz_rows, v_rows, maps, grads, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, seen, maxima, sums,
        d_row, T, S, H, R, scale, pre_qw2, pre_qw2, pre_kw2, pre_kw2, pre_qg, pre_kg, post_qw1, post_kw1, post_qg,
        post_kg, PRE_QP, PRE_KP, PRE_QG, PRE_KG, POST_QP, POST_KP, POST_QG, POST_KG, 1, HALF
    )
    return d_row + tl.sum(pattern * d_pattern, axis=2)


def pre_gradient_maps_kernel(
    q, k, v, dz, maps, grads, row_max, row_sum, row_d, real, pre_qw2, pre_kw2, pre_qg, pre_kg, post_qw1, post_kw1,
    post_qg, post_kg, T, S, H, E, R: tl.constexpr, past, span, scale, RP: tl.constexpr, EP: tl.constexpr,
    BQ: tl.constexpr, BK: tl.constexpr, PRE_QP: tl.constexpr, PRE_KP: tl.constexpr, PRE_QG: tl.constexpr,
    PRE_KG: tl.constexpr, POST_QP: tl.constexpr, POST_KP: tl.constexpr, POST_QG: tl.constexpr, POST_KG: tl.constexpr,
    PADDING: tl.constexpr, HALF: tl.constexpr
):
    """The gradients of the pre-compose's maps, dhq (grads[j], j < R) and dhk (R <= j < 2R), of one (key block,
    query block) tile (program axes 0, 1) of one batch row (axis 2): every head's dA, one head at a time, summed."""
    s0 = tl.program_id(0) * BK
    t0 = tl.program_id(1) * BQ
    row = tl.program_id(2)
    if tile_is_seen(t0, s0, past, span, BQ, BK):
        t_idx, t_ok, s_idx, s_ok = tile_positions(t0, s0, T, S, BQ, BK)
        # every pair computed, seen or not, unmasked: these maps are per pair, and dropped where no query sees it
        seen = seen_pairs(row, t_idx, t_ok, s_idx, s_ok, real, S, past, span, PADDING, False)
        q_maps = tl.zeros((RP, BQ, BK), dtype=tl.float32)
        k_maps = tl.zeros((RP, BQ, BK), dtype=tl.float32)
        for n in range(H):
            head = n + tl.arange(0, 1)
            maxima, sums = load_statistics(row_max, row_sum, row, head, head < H, t_idx, t_ok, H, T)
            d_row = row_values(row_d, row, head, head < H, t_idx, t_ok, H, T, 0.0)
            # (the pre-compose's w1 are not read down to dA: its w2 stand in)
            _, _, _, _, d_composed, _ = _head_gradients(
                head_rows(q, row, t_idx, t_ok, head, head < H, T, H, E, EP),
                head_rows(k, row, s_idx, s_ok, head, head < H, S, H, E, EP),
                head_rows(dz, row, t_idx, t_ok, head, head < H, T, H, E, EP),
                head_rows(v, row, s_idx, s_ok, head, head < H, S, H, E, EP), maps, grads, row, t_idx, t_ok, s_idx,
                s_ok, head, head < H, seen, maxima, sums, d_row, T, S, H, R, scale, pre_qw2, pre_qw2, pre_kw2,
                pre_kw2, pre_qg, pre_kg, post_qw1, post_kw1, post_qg, post_kg, PRE_QP, PRE_KP,
                PRE_QG, PRE_KG, POST_QP, POST_KP, POST_QG, POST_KG, 2, HALF
            )
            q_maps, k_maps = add_head_to_maps(
                q_maps, k_maps, d_composed, pre_qw2, pre_kw2, row, t_idx, t_ok, s_idx, s_ok, n, T, S, H, R, RP, PRE_QP,
                PRE_KP
            )
        store_maps(grads, row, 0, t_idx, t_ok, s_idx, s_ok, T, S, R, RP, q_maps, k_maps, PRE_QP, PRE_KP)


def head_query_gradient_kernel(
    q, k, v, dz, maps, grads, row_max, row_sum, row_d, real, pre_qw1, pre_qw2, pre_kw1, pre_kw2, pre_qg, pre_kg,
    post_qw1, post_qw2, post_kw1, post_kw2, post_qg, post_kg, dq, d_pre_qw1, d_pre_qw2, d_pre_qg, d_post_qw1,
    d_post_qw2, d_post_qg, T, S, H, E, R: tl.constexpr, past, span, scale, RP: tl.constexpr, EP: tl.constexpr,
    BQ: tl.constexpr, BK: tl.constexpr, PRE_QP: tl.constexpr, PRE_KP: tl.constexpr, PRE_QG: tl.constexpr,
    PRE_KG: tl.constexpr, POST_QP: tl.constexpr, POST_KP: tl.constexpr, POST_QG: tl.constexpr, POST_KG: tl.constexpr,
    PADDING: tl.constexpr, HALF: tl.constexpr
):
    """The query side of the backward of one head (program axis 0) for one block of queries (axis 1) of one batch
    row (axis 2), summed over the keys in registers: dq and the gradients of both stages' qw1, qw2, qg, stored in
    their dtypes (each row is this program's alone)."""
    n = tl.program_id(0)
    h_idx = n + tl.arange(0, 1)
    h_ok = h_idx < H
    t0 = tl.program_id(1) * BQ
    row = tl.program_id(2)
    t_idx = t0 + tl.arange(0, BQ)
    t_ok = t_idx < T
    first_key = tl.maximum(past + t0 - span + 1, 0)
    end_key = tl.minimum(past + t0 + BQ, S)
    maxima, sums = load_statistics(row_max, row_sum, row, h_idx, h_ok, t_idx, t_ok, H, T)
    d_row = row_values(row_d, row, h_idx, h_ok, t_idx, t_ok, H, T, 0.0)
    q_rows = head_rows(q, row, t_idx, t_ok, h_idx, h_ok, T, H, E, EP)
    dz_rows = head_rows(dz, row, t_idx, t_ok, h_idx, h_ok, T, H, E, EP)
    d_queries = tl.zeros((1, BQ, EP), dtype=tl.float32)
    d_pre_gate = tl.zeros((1, BQ), dtype=tl.float32)
    d_post_gate = tl.zeros((1, BQ), dtype=tl.float32)
    d_pre_w1 = tl.zeros((RP, BQ), dtype=tl.float32)
    d_pre_w2 = tl.zeros((RP, BQ), dtype=tl.float32)
    d_post_w1 = tl.zeros((RP, BQ), dtype=tl.float32)
    d_post_w2 = tl.zeros((RP, BQ), dtype=tl.float32)
    sums_so_far = (d_queries, d_pre_gate, d_pre_w1, d_pre_w2, d_post_gate, d_post_w1, d_post_w2)
    start = first_key // BK * BK  # aligned, so that whole vectors load
    lo, hi = whole_key_blocks(t0, start, end_key, past, span, T, S, BQ, BK, PADDING)
    for i in range(0, masked_blocks(start, lo, hi, end_key, BK)):
        sums_so_far = _head_query_gradient_step(
            sums_so_far, masked_block(i, start, lo, hi, BK), q_rows, k, v, dz_rows, maps, grads, real, maxima, sums,
            d_row, pre_qw1, pre_qw2, pre_kw1, pre_kw2, pre_qg, pre_kg, post_qw1, post_kw1, post_qg, post_kg, row,
            t_idx, t_ok, h_idx, h_ok, first_key, end_key, T, S, H, E, R, past, span, scale, RP, EP, BK, PRE_QP,
            PRE_KP, PRE_QG, PRE_KG, POST_QP, POST_KP, POST_QG, POST_KG, PADDING, HALF, True
        )
    for s0 in range(lo, hi, BK):
        sums_so_far = _head_query_gradient_step(
            sums_so_far, s0, q_rows, k, v, dz_rows, maps, grads, real, maxima, sums, d_row, pre_qw1, pre_qw2,
            pre_kw1, pre_kw2, pre_qg, pre_kg, post_qw1, post_kw1, post_qg, post_kg, row, t_idx, t_ok, h_idx, h_ok,
            first_key, end_key, T, S, H, E, R, past, span, scale, RP, EP, BK, PRE_QP, PRE_KP, PRE_QG, PRE_KG,
            POST_QP, POST_KP, POST_QG, POST_KG, PADDING, HALF, False
        )
    d_queries, d_pre_gate, d_pre_w1, d_pre_w2, d_post_gate, d_post_w1, d_post_w2 = sums_so_far
    _put_head_rows(dq, row, t_idx, t_ok, h_idx, h_ok, T, H, E, EP, d_queries, False)
    _store_weight_gradients(
        d_pre_qg, d_pre_qw1, d_pre_qw2, d_post_qg, d_post_qw1, d_post_qw2, d_pre_gate, d_pre_w1, d_pre_w2,
        d_post_gate, d_post_w1, d_post_w2, row, t_idx, t_ok, n, T, H, R, RP, PRE_QG, PRE_QP, POST_QG, POST_QP, False
    )


def _head_query_gradient_step(
    sums_so_far, s0, q_rows, k, v, dz_rows, maps, grads, real, maxima, sums, d_row, pre_qw1, pre_qw2, pre_kw1,
    pre_kw2, pre_qg, pre_kg, post_qw1, post_kw1, post_qg, post_kg, row, t_idx, t_ok, h_idx, h_ok, first_key, end_key,
    T, S, H, E, R: tl.constexpr, past, span, scale, RP: tl.constexpr, EP: tl.constexpr, BK: tl.constexpr,
    PRE_QP: tl.constexpr, PRE_KP: tl.constexpr, PRE_QG: tl.constexpr, PRE_KG: tl.constexpr, POST_QP: tl.constexpr,
    POST_KP: tl.constexpr, POST_QG: tl.constexpr, POST_KG: tl.constexpr, PADDING: tl.constexpr, HALF: tl.constexpr,
    MASKED: tl.constexpr
):
    """The query side's sums (dq, then `_add_weight_gradients`' six) with the keys s0 .. s0 + BK - 1 (MASKED:
    `seen_pairs`)."""
    d_queries, d_pre_gate, d_pre_w1, d_pre_w2, d_post_gate, d_post_w1, d_post_w2 = sums_so_far
    s_idx = s0 + tl.arange(0, BK)
    s_ok = (s_idx < end_key) & (s_idx >= first_key)  # keys before the window are not read
    seen = seen_pairs(row, t_idx, t_ok, s_idx, s_ok, real, S, past, span, PADDING, MASKED)
    k_rows = head_rows(k, row, s_idx, s_ok, h_idx, h_ok, S, H, E, EP)
    scores, pattern, d_composed_pattern, _, d_composed, d_scores = _head_gradients(
        q_rows, k_rows, dz_rows, head_rows(v, row, s_idx, s_ok, h_idx, h_ok, S, H, E, EP), maps, grads, row, t_idx,
        t_ok, s_idx, s_ok, h_idx, h_ok, seen, maxima, sums, d_row, T, S, H, R, scale, pre_qw1, pre_qw2, pre_kw1,
        pre_kw2, pre_qg, pre_kg, post_qw1, post_kw1, post_qg, post_kg, PRE_QP, PRE_KP, PRE_QG, PRE_KG, POST_QP,
        POST_KP, POST_QG, POST_KG, 3, HALF
    )
    d_queries += head_dot(d_scores, k_rows, HALF)
    d_pre_gate, d_pre_w1, d_pre_w2, d_post_gate, d_post_w1, d_post_w2 = _add_weight_gradients(
        d_pre_gate, d_pre_w1, d_pre_w2, d_post_gate, d_post_w1, d_post_w2, scores, pattern, d_composed_pattern,
        d_composed, maps, grads, row, t_idx, t_ok, s_idx, s_ok, seen, T, S, R, RP, PRE_QG, PRE_QP, POST_QG, POST_QP,
        0, True
    )
    return d_queries, d_pre_gate, d_pre_w1, d_pre_w2, d_post_gate, d_post_w1, d_post_w2


def head_key_gradient_kernel(
    q, k, v, dz, maps, grads, row_max, row_sum, row_d, real, pre_qw1, pre_qw2, pre_kw1, pre_kw2, pre_qg, pre_kg,
    post_qw1, post_qw2, post_kw1, post_kw2, post_qg, post_kg, dk, dv, d_pre_kw1, d_pre_kw2, d_pre_kg, d_post_kw1,
    d_post_kw2, d_post_kg, T, S, H, E, R: tl.constexpr, past, span, scale, RP: tl.constexpr, EP: tl.constexpr,
    BQ: tl.constexpr, BK: tl.constexpr, PRE_QP: tl.constexpr, PRE_KP: tl.constexpr, PRE_QG: tl.constexpr,
    PRE_KG: tl.constexpr, POST_QP: tl.constexpr, POST_KP: tl.constexpr, POST_QG: tl.constexpr, POST_KG: tl.constexpr,
    PADDING: tl.constexpr, HALF: tl.constexpr, ADD: tl.constexpr
):
    """The key side of the backward of one head (program axis 0) for one block of keys (axis 1) of one batch row
    (axis 2), summed over the queries that see it in registers: dk, dv and the gradients of both stages' kw1, kw2,
    kg (their products accumulated in tiles, summed over the queries once, after the loop), stored in their dtypes
    (ADD: added into float32 buffers, where a long prompt's chunks of queries add up)."""
    n = tl.program_id(0)
    h_idx = n + tl.arange(0, 1)
    h_ok = h_idx < H
    s0 = tl.program_id(1) * BK
    row = tl.program_id(2)
    s_idx = s0 + tl.arange(0, BK)
    s_ok = (s_idx < S) & (s_idx > past - span)  # keys before the first query's window are not even read
    first_query = tl.maximum(s0 - past, 0)
    end_query = tl.minimum(s0 + BK - 1 + span - past, T)
    k_rows = head_rows(k, row, s_idx, s_ok, h_idx, h_ok, S, H, E, EP)
    v_rows = head_rows(v, row, s_idx, s_ok, h_idx, h_ok, S, H, E, EP)
    d_keys = tl.zeros((1, BK, EP), dtype=tl.float32)
    d_values = tl.zeros((1, BK, EP), dtype=tl.float32)
    # the weights' gradients as products of the tiles' shape, summed over the queries once after the loop: a sum
    # across the rows of a tile (spread over the warps) at every iteration would be most of the loop's instructions
    d_pre_gate = tl.zeros((1, BQ, BK), dtype=tl.float32)
    d_post_gate = tl.zeros((1, BQ, BK), dtype=tl.float32)
    d_pre_w1 = tl.zeros((RP, BQ, BK), dtype=tl.float32)
    d_pre_w2 = tl.zeros((RP, BQ, BK), dtype=tl.float32)
    d_post_w1 = tl.zeros((RP, BQ, BK), dtype=tl.float32)
    d_post_w2 = tl.zeros((RP, BQ, BK), dtype=tl.float32)
    sums_so_far = (d_keys, d_values, d_pre_gate, d_pre_w1, d_pre_w2, d_post_gate, d_post_w1, d_post_w2)
    lo, hi = _whole_query_blocks(s0, first_query, end_query, past, span, S, BQ, BK, PADDING)
    for i in range(0, masked_blocks(first_query, lo, hi, end_query, BQ)):
        sums_so_far = _head_key_gradient_step(
            sums_so_far, masked_block(i, first_query, lo, hi, BQ), q, dz, k_rows, v_rows, maps, grads, row_max,
            row_sum, row_d, real, pre_qw1, pre_qw2, pre_kw1, pre_kw2, pre_qg, pre_kg, post_qw1, post_qw2, post_kw1,
            post_kw2, post_qg, post_kg, row, s_idx, s_ok, h_idx, h_ok, end_query, T, S, H, E, R, past, span, scale, RP,
            EP, BQ, PRE_QP, PRE_KP, PRE_QG, PRE_KG, POST_QP, POST_KP, POST_QG, POST_KG, PADDING, HALF, True
        )
    for t0 in range(lo, hi, BQ):
        sums_so_far = _head_key_gradient_step(
            sums_so_far, t0, q, dz, k_rows, v_rows, maps, grads, row_max, row_sum, row_d, real, pre_qw1, pre_qw2,
            pre_kw1, pre_kw2, pre_qg, pre_kg, post_qw1, post_qw2, post_kw1, post_kw2, post_qg, post_kg, row, s_idx,
            s_ok, h_idx, h_ok, end_query, T, S, H, E, R, past, span, scale, RP, EP, BQ, PRE_QP, PRE_KP, PRE_QG,
            PRE_KG, POST_QP, POST_KP, POST_QG, POST_KG, PADDING, HALF, False
        )
    d_keys, d_values, d_pre_gate, d_pre_w1, d_pre_w2, d_post_gate, d_post_w1, d_post_w2 = sums_so_far
    d_pre_gate, d_pre_w1, d_pre_w2, d_post_gate, d_post_w1, d_post_w2 = _summed_weight_gradients(
        d_pre_gate, d_pre_w1, d_pre_w2, d_post_gate, d_post_w1, d_post_w2, 1
    )
    every_key = s_idx < S  # the keys no query sees among them too: their gradients are 0
    _put_head_rows(dk, row, s_idx, every_key, h_idx, h_ok, S, H, E, EP, d_keys, ADD)
    _put_head_rows(dv, row, s_idx, every_key, h_idx, h_ok, S, H, E, EP, d_values, ADD)
    _store_weight_gradients(
        d_pre_kg, d_pre_kw1, d_pre_kw2, d_post_kg, d_post_kw1, d_post_kw2, d_pre_gate, d_pre_w1, d_pre_w2,
        d_post_gate, d_post_w1, d_post_w2, row, s_idx, every_key, n, S, H, R, RP, PRE_KG, PRE_KP, POST_KG, POST_KP,
        ADD
    )


def _head_key_gradient_step(
    sums_so_far, t0, q, dz, k_rows, v_rows, maps, grads, row_max, row_sum, row_d, real, pre_qw1, pre_qw2, pre_kw1,
    pre_kw2, pre_qg, pre_kg, post_qw1, post_qw2, post_kw1, post_kw2, post_qg, post_kg, row, s_idx, s_ok, h_idx, h_ok,
    end_query, T, S, H, E, R: tl.constexpr, past, span, scale, RP: tl.constexpr, EP: tl.constexpr, BQ: tl.constexpr,
    PRE_QP: tl.constexpr, PRE_KP: tl.constexpr, PRE_QG: tl.constexpr, PRE_KG: tl.constexpr, POST_QP: tl.constexpr,
    POST_KP: tl.constexpr, POST_QG: tl.constexpr, POST_KG: tl.constexpr, PADDING: tl.constexpr, HALF: tl.constexpr,
    MASKED: tl.constexpr
):
    """The key side's sums (dk, dv, then `_add_weight_gradients`' six, in tiles) with the queries t0 .. t0 + BQ - 1
    (MASKED: `seen_pairs`)."""
    d_keys, d_values, d_pre_gate, d_pre_w1, d_pre_w2, d_post_gate, d_post_w1, d_post_w2 = sums_so_far
    t_idx = t0 + tl.arange(0, BQ)
    t_ok = t_idx < end_query  # nor queries past the last that sees the block
    maxima, sums = load_statistics(row_max, row_sum, row, h_idx, h_ok, t_idx, t_ok, H, T)
    d_row = row_values(row_d, row, h_idx, h_ok, t_idx, t_ok, H, T, 0.0)
    q_rows = head_rows(q, row, t_idx, t_ok, h_idx, h_ok, T, H, E, EP)
    dz_rows = head_rows(dz, row, t_idx, t_ok, h_idx, h_ok, T, H, E, EP)
    seen = seen_pairs(row, t_idx, t_ok, s_idx, s_ok, real, S, past, span, PADDING, MASKED)
    scores, pattern, d_composed_pattern, _, d_composed, d_scores = _head_gradients(
        q_rows, k_rows, dz_rows, v_rows, maps, grads, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, seen, maxima, sums,
        d_row, T, S, H, R, scale, pre_qw1, pre_qw2, pre_kw1, pre_kw2, pre_qg, pre_kg, post_qw1, post_kw1, post_qg,
        post_kg, PRE_QP, PRE_KP, PRE_QG, PRE_KG, POST_QP, POST_KP, POST_QG, POST_KG, 3, HALF
    )
    composed_pattern = head_compose(
        pattern, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, seen, T, S, H, R, maps, 2 * R, post_qw2, post_kw2,
        post_qg, post_kg, POST_QP, POST_KP, POST_QG, POST_KG
    )
    composed_pattern = tl.where(seen[None, :, :], composed_pattern, 0.0)
    d_values += head_dot(tl.permute(composed_pattern, (0, 2, 1)), dz_rows, HALF)
    d_keys += head_dot(tl.permute(d_scores, (0, 2, 1)), q_rows, HALF)
    d_pre_gate, d_pre_w1, d_pre_w2, d_post_gate, d_post_w1, d_post_w2 = _add_weight_gradients(
        d_pre_gate, d_pre_w1, d_pre_w2, d_post_gate, d_post_w1, d_post_w2, scores, pattern, d_composed_pattern,
        d_composed, maps, grads, row, t_idx, t_ok, s_idx, s_ok, seen, T, S, R, RP, PRE_KG, PRE_KP, POST_KG, POST_KP,
        1, False
    )
    return d_keys, d_values, d_pre_gate, d_pre_w1, d_pre_w2, d_post_gate, d_post_w1, d_post_w2

# fmt: on


jit = LateJit(globals(), (
    "_load_maps",
    "_put_head_weights",
    "_put_head_rows",
    "_head_gradients",
    "_add_weight_gradients",
    "_tile_sum",
    "_summed_weight_gradients",
    "_store_weight_gradients",
    "_whole_query_blocks",
    "row_gradient_kernel",
    "_row_gradient_step",
    "pre_gradient_maps_kernel",
    "head_query_gradient_kernel",
    "_head_query_gradient_step",
    "head_key_gradient_kernel",
    "_head_key_gradient_step",
), uses=(forward_jit,))  # fmt: skip
