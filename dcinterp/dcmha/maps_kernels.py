"""The Triton kernels of DCMHA through the cross-head maps (`dcinterp.dcmha.maps` launches them): inner helpers, then
the forward's four kernels, then the backward's.

Each kernel is a plain function here, jitted at the first call of `fused_dcmha` by `jit` (`dcinterp.dcmha.jit`:
Triton decides when a function is jitted whether it runs natively or under its interpreter). A program holds tiles
of one head, [1, queries, keys] (the leading axis kept so that the loaders serve every tile alike), or, in the kernels
that make the maps, [RP, queries, keys] summed over the heads one at a time. The kernels of one head a program walk
the blocks that every query of a block sees whole in a loop without masks, the others (the diagonal, a window's first
keys, the prompt's last queries, any with padding) in a masked loop, as FlashAttention does (`_seen`). The kernels that
only make maps make them for every pair of a tile, unmasked: what no query sees is dropped where the maps are read. The
maps' tiles are loaded masked by their buffer's bounds alone, so that the loads are vectors.

Index names: b batch, t queries, s keys, h/m/n heads, e head dim, r rank.
"""

from __future__ import annotations

from .jit import LateJit, tl

_INTERPRETED = False  # the kernels' constant: whether they run under Triton's interpreter (set by `jit`)

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


def _rows(x, row, idx, ok, h_idx, h_ok, e, e_ok, N, H, E):
    """A [heads, positions, head-dim chunk] tile of a [b, N, H, E] tensor (q, k, v or dz), in its own dtype."""
    offsets = ((row * N + idx[None, :, None]) * H + h_idx[:, None, None]) * E + e[None, None, :]
    mask = h_ok[:, None, None] & ok[None, :, None] & e_ok[None, None, :]
    return tl.load(x + offsets, mask=mask, other=0.0)


def _visible(row, t_idx, t_ok, s_idx, s_ok, real, S, past, span, PADDING: tl.constexpr):
    """[queries, keys]: True where query t (position past + t) sees key s: s <= past + t, s > past + t - span (a
    local window; span beyond every key for a global layer), and s real unless it is the query itself."""
    position = past + t_idx[:, None]
    seen = (s_idx[None, :] <= position) & (s_idx[None, :] > position - span) & t_ok[:, None] & s_ok[None, :]
    if PADDING:
        is_real = tl.load(real + row * S + s_idx, mask=s_ok, other=0) != 0
        seen = seen & (is_real[None, :] | (s_idx[None, :] == position))
    return seen


def _online_softmax(running_max, running_sum, composed):
    """The softmax's running max and sum ([heads, queries]) after one more block of keys ([heads, queries, keys],
    -inf where hidden)."""
    new_max = tl.maximum(running_max, tl.max(composed, axis=2))
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    running_sum = running_sum * tl.exp(running_max - shift) + tl.sum(tl.exp(composed - shift[:, :, None]), axis=2)
    return new_max, running_sum


def _row_values(x, row, h_idx, h_ok, t_idx, t_ok, H, T, other):
    """x[row, h, t] of a float32 [b, H, T] tensor (the softmax's row max and sum, or D) as [heads, queries];
    `other` where a head or query is not real."""
    at = (row * H + h_idx[:, None]) * T + t_idx[None, :]
    return tl.load(x + at, mask=h_ok[:, None] & t_ok[None, :], other=other)


def _store_row_values(x, row, h_idx, h_ok, t_idx, t_ok, H, T, value):
    """x[row, h, t] = value ([heads, queries]) where the head and query are real."""
    at = (row * H + h_idx[:, None]) * T + t_idx[None, :]
    tl.store(x + at, value, mask=h_ok[:, None] & t_ok[None, :])


def _store_statistics(row_max, row_sum, running_max, running_sum, row, h_idx, h_ok, t_idx, t_ok, H, T):
    """Each (head, query)'s final max and sum into [b, H, T] buffers, and returned; a row with no visible key gets
    max 0 and sum 1 (no NaN later)."""
    running_max = tl.where(running_max == float("-inf"), 0.0, running_max)
    running_sum = tl.where(running_sum == 0.0, 1.0, running_sum)
    _store_row_values(row_max, row, h_idx, h_ok, t_idx, t_ok, H, T, running_max)
    _store_row_values(row_sum, row, h_idx, h_ok, t_idx, t_ok, H, T, running_sum)
    return running_max, running_sum


# --- the forward through the cross-head maps: four kernels, each head alone but for the maps ----------------------
# The compose mixes heads only through rank-R maps of [queries, keys], shared by every head: the pre-compose's
# hq[r] = sum_n qw1[t, r, n] S[n] and hk[r] = sum_n kw1[s, r, n] S[n], the post-compose's gq[r] = sum_n qw1'[t, r, n]
# P[n] and gk[r] alike. Kept in a [b, 4R, t, s] buffer (`maps`, j = r, R + r, 2R + r, 3R + r), they let each head be
# computed alone, FlashAttention's way, its output accumulated in registers; the two maps kernels sum over the heads
# one at a time. A head's tiles are [1, queries, keys] (the leading axis: the tiles kernels' loaders serve as they are).


def _head_dot(a, b, HALF: tl.constexpr):
    """One head's [1, m, k] @ [1, k, n] tiles, as a 2D product: half tiles as `_dot` takes them, float32 ones by
    3xTF32 (`_tf32x3_dot`), on the tensor cores. In IEEE float32 (FMA, no tensor core) the kernels through the maps
    need so many registers that ptxas keeps most of them to 32 and spills kilobytes a thread; by 3xTF32 they do not
    (benchmarks/kernel_resources.py --dtype float32)."""
    a, b = tl.reshape(a, (a.shape[1], a.shape[2])), tl.reshape(b, (b.shape[1], b.shape[2]))
    if HALF:
        product = _dot(a, b, HALF)
    else:
        product = _tf32x3_dot(a.to(tl.float32), b.to(tl.float32))
    return tl.reshape(product, (1, a.shape[0], b.shape[1]))


def _tf32x3_dot(a, b):
    """a @ b of float32 tiles as three TF32 products, big x big + big x small + small x big, each operand split into
    its TF32 rounding (big) and the TF32 rounding of the rest (small): about float32's precision (what is dropped,
    small x small, is some 2^-22 of a product). Triton's input_precision="tf32x3" natively; its interpreter ignores
    input_precision, so there the three products are written out, and the CPU's tests judge what a card computes."""
    if not _INTERPRETED:
        return tl.dot(a, b, input_precision="tf32x3")
    a_big, b_big = _tf32(a), _tf32(b)
    product = tl.dot(_tf32(a - a_big), b_big, input_precision="ieee")
    product = tl.dot(a_big, _tf32(b - b_big), product, input_precision="ieee")
    return tl.dot(a_big, b_big, product, input_precision="ieee")


def _tf32(x):
    """float32 x rounded to TF32 (10 bits of mantissa, to nearest, ties away from zero: the card's cvt.rna.tf32.f32)."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


def _head_weights(w, row, idx, ok, n, N, H, R, RP: tl.constexpr):
    """w[row, idx, r, n] of head n for every r: [RP, positions], float32, of a [b, N, R, H] tensor."""
    r_idx = tl.arange(0, RP)
    offsets = ((row * N + idx[None, :]) * R + r_idx[:, None]) * H + n
    return tl.load(w + offsets, mask=(r_idx[:, None] < R) & ok[None, :], other=0.0).to(tl.float32)


def _load_map(maps, row, j, t_idx, s_idx, seen, T, S, R: tl.constexpr):
    """maps[row, j] where the pair is seen (0 elsewhere): [queries, keys], float32. Masked by the buffer's bounds
    alone, not by the keys the caller reads (a window's first, a block's last: not multiples of a vector), so that
    the loads are vectors where S is a multiple of 16; what no query sees was never written, and `seen` drops it."""
    plane = maps + (row.to(tl.int64) * 4 * R + j) * T * S  # 64-bit only here: a plane itself fits 32 bits
    tile = tl.load(plane + t_idx[:, None] * S + s_idx[None, :], mask=(t_idx < T)[:, None] & (s_idx < S)[None, :])
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
            hidden = _load_map(maps, row, first + r, t_idx, s_idx, seen, T, S, R)
            y = y + hidden[None, :, :] * _weight(qw2, row, t_idx, t_ok, r, h_idx, h_ok, T, R, H)[:, :, None]
        if KP:
            hidden = _load_map(maps, row, first + R + r, t_idx, s_idx, seen, T, S, R)
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


# The kernels of one head a program walk a block's keys (or a key block's queries) in two loops, as FlashAttention
# does: the blocks of which every query sees every key, with no mask (`_seen` not MASKED: the compiler drops every
# select on it, about a third of such a loop's instructions), and the others, masked: the diagonal's, a window's first,
# the prompt's last, any with padding.
def _seen(row, t_idx, t_ok, s_idx, s_ok, real, S, past, span, PADDING: tl.constexpr, MASKED: tl.constexpr):
    """`_visible`, MASKED; else True for every pair, known at compile time (a block seen whole)."""
    if MASKED:
        return _visible(row, t_idx, t_ok, s_idx, s_ok, real, S, past, span, PADDING)
    return tl.full((t_idx.shape[0], s_idx.shape[0]), 1, tl.int1)


def _whole_key_blocks(t0, start, end, past, span, T, S, BQ: tl.constexpr, BK: tl.constexpr, PADDING: tl.constexpr):
    """The blocks of keys [lo, hi) (BK apart from `start`, before `end`) of which every key is seen by every query of
    the block t0 .. t0 + BQ - 1; lo = hi = end where there are none (the prompt's last queries, padding)."""
    lo = tl.maximum(start, (tl.maximum(past + t0 + BQ - span, 0) + BK - 1) // BK * BK)  # in the last query's window
    hi = tl.minimum(past + t0 + 1, S) // BK * BK  # up to the first query's own position
    if PADDING:
        hi = lo
    whole = (lo < hi) & (t0 + BQ <= T)
    return tl.where(whole, lo, end), tl.where(whole, hi, end)


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


def _masked_blocks(start, lo, hi, end, B: tl.constexpr):
    """How many blocks, B apart from `start`, need the masks: those before `lo`, and those from `hi` before `end`."""
    return (lo - start + B - 1) // B + (end - hi + B - 1) // B


def _masked_block(i, start, lo, hi, B: tl.constexpr):
    """Where the i-th block `_masked_blocks` counts starts."""
    before = (lo - start + B - 1) // B
    return tl.where(i < before, start + i * B, hi + (i - before) * B)


def product_maps_kernel(
    a, b, maps, wq, wk, T, S, H, E, R: tl.constexpr, past, span, scale, FIRST: tl.constexpr, RP: tl.constexpr,
    EP: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, QP: tl.constexpr, KP: tl.constexpr, HALF: tl.constexpr
):
    """maps[FIRST + r] = sum_n wq[t, r, n] X[n] and maps[FIRST + R + r] = sum_n wk[s, r, n] X[n], X[n] = scale a_n
    b_n^T, of one (key block, query block) tile (program axes 0, 1) of one batch row (axis 2), the heads summed one
    at a time; tiles no query sees are skipped. The pre-compose's maps hq, hk (a, b = q, k; its w1) and, in the
    backward, the gradients of the post-compose's (a, b = dz, v; its w2)."""
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
            a_rows = _head_rows(a, row, t_idx, t_ok, head, head < H, T, H, E, EP)
            product = _head_scores(a_rows, b, row, s_idx, s_ok, head, head < H, S, H, E, scale, EP, HALF)
            if QP:
                q_maps += product * _head_weights(wq, row, t_idx, t_ok, n, T, H, R, RP)[:, :, None]
            if KP:
                k_maps += product * _head_weights(wk, row, s_idx, s_ok, n, S, H, R, RP)[:, None, :]
        if QP:
            _store_maps(maps, row, FIRST, t_idx, t_ok, s_idx, s_ok, T, S, R, RP, q_maps)
        if KP:
            _store_maps(maps, row, FIRST + R, t_idx, t_ok, s_idx, s_ok, T, S, R, RP, k_maps)


def row_statistics_kernel(
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
    lo, hi = _whole_key_blocks(t0, first_key, end_key, past, span, T, S, BQ, BK, PADDING)
    for i in range(0, _masked_blocks(first_key, lo, hi, end_key, BK)):
        running_max, running_sum = _row_statistics_step(
            running_max, running_sum, _masked_block(i, first_key, lo, hi, BK), q_rows, k, maps, real, qw2, kw2, qg,
            kg, row, t_idx, t_ok, h_idx, h_ok, end_key, T, S, H, E, R, past, span, scale, EP, BK, QP, KP, QG, KG,
            PADDING, HALF, True
        )
    for s0 in range(lo, hi, BK):
        running_max, running_sum = _row_statistics_step(
            running_max, running_sum, s0, q_rows, k, maps, real, qw2, kw2, qg, kg, row, t_idx, t_ok, h_idx, h_ok,
            end_key, T, S, H, E, R, past, span, scale, EP, BK, QP, KP, QG, KG, PADDING, HALF, False
        )
    _store_statistics(row_max, row_sum, running_max, running_sum, row, h_idx, h_ok, t_idx, t_ok, H, T)


def _row_statistics_step(
    running_max, running_sum, s0, q_rows, k, maps, real, qw2, kw2, qg, kg, row, t_idx, t_ok, h_idx, h_ok, end_key, T,
    S, H, E, R: tl.constexpr, past, span, scale, EP: tl.constexpr, BK: tl.constexpr, QP: tl.constexpr,
    KP: tl.constexpr, QG: tl.constexpr, KG: tl.constexpr, PADDING: tl.constexpr, HALF: tl.constexpr,
    MASKED: tl.constexpr
):
    """The running max and sum with the keys s0 .. s0 + BK - 1 (MASKED: `_seen`)."""
    s_idx = s0 + tl.arange(0, BK)
    s_ok = s_idx < end_key  # keys past the block's last query are not even read
    seen = _seen(row, t_idx, t_ok, s_idx, s_ok, real, S, past, span, PADDING, MASKED)
    composed = _head_pattern(
        q_rows, k, maps, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, seen, T, S, H, E, R, scale, qw2, kw2, qg, kg,
        running_max, running_sum, QP, KP, QG, KG, EP, HALF, False
    )
    return _online_softmax(running_max, running_sum, composed)


def post_maps_kernel(
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
        # every pair computed, seen or not, unmasked: these maps are per pair, and dropped where no query sees it
        seen = _seen(row, t_idx, t_ok, s_idx, s_ok, real, S, past, span, PADDING, False)
        q_maps = tl.zeros((RP, BQ, BK), dtype=tl.float32)
        k_maps = tl.zeros((RP, BQ, BK), dtype=tl.float32)
        for n in range(H):
            head = n + tl.arange(0, 1)
            maxima = _row_values(row_max, row, head, head < H, t_idx, t_ok, H, T, 0.0)
            sums = _row_values(row_sum, row, head, head < H, t_idx, t_ok, H, T, 1.0)
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


def head_output_kernel(
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
    maxima = _row_values(row_max, row, h_idx, h_ok, t_idx, t_ok, H, T, 0.0)
    sums = _row_values(row_sum, row, h_idx, h_ok, t_idx, t_ok, H, T, 1.0)
    q_rows = _head_rows(q, row, t_idx, t_ok, h_idx, h_ok, T, H, E, EP)
    out = tl.zeros((1, BQ, EP), dtype=tl.float32)
    start = first_key // BK * BK  # aligned, so that whole vectors load
    lo, hi = _whole_key_blocks(t0, start, end_key, past, span, T, S, BQ, BK, PADDING)
    for i in range(0, _masked_blocks(start, lo, hi, end_key, BK)):
        out = _head_output_step(
            out, _masked_block(i, start, lo, hi, BK), q_rows, k, v, maps, real, maxima, sums, pre_qw2, pre_kw2,
            pre_qg, pre_kg, post_qw2, post_kw2, post_qg, post_kg, row, t_idx, t_ok, h_idx, h_ok, first_key, end_key,
            T, S, H, E, R, past, span, scale, EP, BK, PRE_QP, PRE_KP, PRE_QG, PRE_KG, POST_QP, POST_KP, POST_QG,
            POST_KG, PADDING, HALF, True
        )
    for s0 in range(lo, hi, BK):
        out = _head_output_step(
            out, s0, q_rows, k, v, maps, real, maxima, sums, pre_qw2, pre_kw2, pre_qg, pre_kg, post_qw2, post_kw2,
            post_qg, post_kg, row, t_idx, t_ok, h_idx, h_ok, first_key, end_key, T, S, H, E, R, past, span, scale, EP,
            BK, PRE_QP, PRE_KP, PRE_QG, PRE_KG, POST_QP, POST_KP, POST_QG, POST_KG, PADDING, HALF, False
        )
    e = tl.arange(0, EP)
    offsets = ((row * T + t_idx[None, :, None]) * H + h_idx[:, None, None]) * E + e[None, None, :]
    mask = h_ok[:, None, None] & t_ok[None, :, None] & (e[None, None, :] < E)
    tl.store(z + offsets, out.to(z.dtype.element_ty), mask=mask)


def _head_output_step(
    out, s0, q_rows, k, v, maps, real, maxima, sums, pre_qw2, pre_kw2, pre_qg, pre_kg, post_qw2, post_kw2, post_qg,
    post_kg, row, t_idx, t_ok, h_idx, h_ok, first_key, end_key, T, S, H, E, R: tl.constexpr, past, span, scale,
    EP: tl.constexpr, BK: tl.constexpr, PRE_QP: tl.constexpr, PRE_KP: tl.constexpr, PRE_QG: tl.constexpr,
    PRE_KG: tl.constexpr, POST_QP: tl.constexpr, POST_KP: tl.constexpr, POST_QG: tl.constexpr, POST_KG: tl.constexpr,
    PADDING: tl.constexpr, HALF: tl.constexpr, MASKED: tl.constexpr
):
    """out + P' V over the keys s0 .. s0 + BK - 1 (MASKED: `_seen`)."""
    s_idx = s0 + tl.arange(0, BK)
    s_ok = s_idx < end_key
    seen = _seen(row, t_idx, t_ok, s_idx, s_ok, real, S, past, span, PADDING, MASKED)
    pattern = _head_pattern(
        q_rows, k, maps, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, seen, T, S, H, E, R, scale, pre_qw2, pre_kw2,
        pre_qg, pre_kg, maxima, sums, PRE_QP, PRE_KP, PRE_QG, PRE_KG, EP, HALF, True
    )
    pattern = _head_compose(
        pattern, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, seen, T, S, H, R, maps, 2 * R, post_qw2, post_kw2,
        post_qg, post_kg, POST_QP, POST_KP, POST_QG, POST_KG
    )
    values = _head_rows(v, row, s_idx, s_ok, h_idx, h_ok, S, H, E, EP)
    if MASKED:  # keys of the aligned block before the first visible one were loaded, never used: 0, whatever they hold
        values = tl.where((s_idx >= first_key)[None, :, None], values, 0.0).to(v.dtype.element_ty)
        pattern = tl.where(seen[None, :, :], pattern, 0.0)
    return out + _head_dot(pattern, values, HALF)


# --- the backward through the maps: each head alone but for the maps and their gradients --------------------------
# The backward of the forward through the maps, by the same decomposition. With dP' = dz v^T, the post-compose's
# transpose mixes heads only through the gradients of its maps, dgq[r] = sum_m qw2'[t, r, m] dP'[m] and dgk[r]
# alike: dP[n] = dP'[n] (1 + qg' + kg') + sum_r dgq[r] qw1'[t, r, n] + sum_r dgk[r] kw1'[s, r, n], a compose with
# the w1 in the w2's place. Then dA = P (dP - D), D = sum_s P dP, and the pre-compose's transpose alike through
# dhq[r] = sum_m qw2[t, r, m] dA[m] and dhk[r]. The gradient maps are kept in a second [b, 4R, t, s] buffer
# (`grads`, j = r, R + r, 2R + r, 3R + r: dhq, dhk, dgq, dgk), beside the maps the forward's kernels recompute.


def _load_maps(maps, row, first, t_idx, s_idx, seen, T, S, R: tl.constexpr, RP: tl.constexpr):
    """maps[row, first + r] for every r where the pair is seen (0 elsewhere, and for r >= R): [RP, queries, keys],
    float32 (masked as `_load_map`'s)."""
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
    scores = tl.where(seen[None, :, :], _head_dot(q_rows, tl.permute(k_rows, (0, 2, 1)), HALF) * scale, 0.0)
    composed = _head_compose(
        scores, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, seen, T, S, H, R, maps, 0, pre_qw2, pre_kw2, pre_qg,
        pre_kg, PRE_QP, PRE_KP, PRE_QG, PRE_KG
    )
    pattern = tl.where(seen[None, :, :], tl.exp(composed - maxima[:, :, None]) / sums[:, :, None], 0.0)
    d_composed_pattern = tl.where(seen[None, :, :], _head_dot(dz_rows, tl.permute(v_rows, (0, 2, 1)), HALF), 0.0)
    d_pattern = _head_compose(
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
        d_scores = _head_compose(
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
    maxima = _row_values(row_max, row, h_idx, h_ok, t_idx, t_ok, H, T, 0.0)
    sums = _row_values(row_sum, row, h_idx, h_ok, t_idx, t_ok, H, T, 1.0)
    q_rows = _head_rows(q, row, t_idx, t_ok, h_idx, h_ok, T, H, E, EP)
    dz_rows = _head_rows(dz, row, t_idx, t_ok, h_idx, h_ok, T, H, E, EP)
    d_row = tl.zeros((1, BQ), dtype=tl.float32)
    start = first_key // BK * BK  # aligned, so that whole vectors load
    lo, hi = _whole_key_blocks(t0, start, end_key, past, span, T, S, BQ, BK, PADDING)
    for i in range(0, _masked_blocks(start, lo, hi, end_key, BK)):
        d_row = _row_gradient_step(
            d_row, _masked_block(i, start, lo, hi, BK), q_rows, k, v, dz_rows, maps, grads, real, maxima, sums,
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
    _store_row_values(row_d, row, h_idx, h_ok, t_idx, t_ok, H, T, d_row)


def _row_gradient_step(
    d_row, s0, q_rows, k, v, dz_rows, maps, grads, real, maxima, sums, pre_qw2, pre_kw2, pre_qg, pre_kg, post_qw1,
    post_kw1, post_qg, post_kg, row, t_idx, t_ok, h_idx, h_ok, first_key, end_key, T, S, H, E, R: tl.constexpr, past,
    span, scale, EP: tl.constexpr, BK: tl.constexpr, PRE_QP: tl.constexpr, PRE_KP: tl.constexpr,
    PRE_QG: tl.constexpr, PRE_KG: tl.constexpr, POST_QP: tl.constexpr, POST_KP: tl.constexpr, POST_QG: tl.constexpr,
    POST_KG: tl.constexpr, PADDING: tl.constexpr, HALF: tl.constexpr, MASKED: tl.constexpr
):
    """D's sums with the keys s0 .. s0 + BK - 1 (MASKED: `_seen`)."""
    s_idx = s0 + tl.arange(0, BK)
    s_ok = (s_idx < end_key) & (s_idx >= first_key)  # keys before the window are not read
    seen = _seen(row, t_idx, t_ok, s_idx, s_ok, real, S, past, span, PADDING, MASKED)
    k_rows = _head_rows(k, row, s_idx, s_ok, h_idx, h_ok, S, H, E, EP)
    v_rows = _head_rows(v, row, s_idx, s_ok, h_idx, h_ok, S, H, E, EP)
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
    if _tile_is_seen(t0, s0, past, span, BQ, BK):
        t_idx = t0 + tl.arange(0, BQ)
        t_ok = t_idx < T
        s_idx = s0 + tl.arange(0, BK)
        s_ok = s_idx < S
        # every pair computed, seen or not, unmasked: these maps are per pair, and dropped where no query sees it
        seen = _seen(row, t_idx, t_ok, s_idx, s_ok, real, S, past, span, PADDING, False)
        q_maps = tl.zeros((RP, BQ, BK), dtype=tl.float32)
        k_maps = tl.zeros((RP, BQ, BK), dtype=tl.float32)
        for n in range(H):
            head = n + tl.arange(0, 1)
            maxima = _row_values(row_max, row, head, head < H, t_idx, t_ok, H, T, 0.0)
            sums = _row_values(row_sum, row, head, head < H, t_idx, t_ok, H, T, 1.0)
            d_row = _row_values(row_d, row, head, head < H, t_idx, t_ok, H, T, 0.0)
            # (the pre-compose's w1 are not read down to dA: its w2 stand in)
            _, _, _, _, d_composed, _ = _head_gradients(
                _head_rows(q, row, t_idx, t_ok, head, head < H, T, H, E, EP),
                _head_rows(k, row, s_idx, s_ok, head, head < H, S, H, E, EP),
                _head_rows(dz, row, t_idx, t_ok, head, head < H, T, H, E, EP),
                _head_rows(v, row, s_idx, s_ok, head, head < H, S, H, E, EP), maps, grads, row, t_idx, t_ok, s_idx,
                s_ok, head, head < H, seen, maxima, sums, d_row, T, S, H, R, scale, pre_qw2, pre_qw2, pre_kw2,
                pre_kw2, pre_qg, pre_kg, post_qw1, post_kw1, post_qg, post_kg, PRE_QP, PRE_KP,
                PRE_QG, PRE_KG, POST_QP, POST_KP, POST_QG, POST_KG, 2, HALF
            )
            if PRE_QP:
                q_maps += d_composed * _head_weights(pre_qw2, row, t_idx, t_ok, n, T, H, R, RP)[:, :, None]
            if PRE_KP:
                k_maps += d_composed * _head_weights(pre_kw2, row, s_idx, s_ok, n, S, H, R, RP)[:, None, :]
        if PRE_QP:
            _store_maps(grads, row, 0, t_idx, t_ok, s_idx, s_ok, T, S, R, RP, q_maps)
        if PRE_KP:
            _store_maps(grads, row, R, t_idx, t_ok, s_idx, s_ok, T, S, R, RP, k_maps)


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
    maxima = _row_values(row_max, row, h_idx, h_ok, t_idx, t_ok, H, T, 0.0)
    sums = _row_values(row_sum, row, h_idx, h_ok, t_idx, t_ok, H, T, 1.0)
    d_row = _row_values(row_d, row, h_idx, h_ok, t_idx, t_ok, H, T, 0.0)
    q_rows = _head_rows(q, row, t_idx, t_ok, h_idx, h_ok, T, H, E, EP)
    dz_rows = _head_rows(dz, row, t_idx, t_ok, h_idx, h_ok, T, H, E, EP)
    d_queries = tl.zeros((1, BQ, EP), dtype=tl.float32)
    d_pre_gate = tl.zeros((1, BQ), dtype=tl.float32)
    d_post_gate = tl.zeros((1, BQ), dtype=tl.float32)
    d_pre_w1 = tl.zeros((RP, BQ), dtype=tl.float32)
    d_pre_w2 = tl.zeros((RP, BQ), dtype=tl.float32)
    d_post_w1 = tl.zeros((RP, BQ), dtype=tl.float32)
    d_post_w2 = tl.zeros((RP, BQ), dtype=tl.float32)
    sums_so_far = (d_queries, d_pre_gate, d_pre_w1, d_pre_w2, d_post_gate, d_post_w1, d_post_w2)
    start = first_key // BK * BK  # aligned, so that whole vectors load
    lo, hi = _whole_key_blocks(t0, start, end_key, past, span, T, S, BQ, BK, PADDING)
    for i in range(0, _masked_blocks(start, lo, hi, end_key, BK)):
        sums_so_far = _head_query_gradient_step(
            sums_so_far, _masked_block(i, start, lo, hi, BK), q_rows, k, v, dz_rows, maps, grads, real, maxima, sums,
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
    `_seen`)."""
    d_queries, d_pre_gate, d_pre_w1, d_pre_w2, d_post_gate, d_post_w1, d_post_w2 = sums_so_far
    s_idx = s0 + tl.arange(0, BK)
    s_ok = (s_idx < end_key) & (s_idx >= first_key)  # keys before the window are not read
    seen = _seen(row, t_idx, t_ok, s_idx, s_ok, real, S, past, span, PADDING, MASKED)
    k_rows = _head_rows(k, row, s_idx, s_ok, h_idx, h_ok, S, H, E, EP)
    scores, pattern, d_composed_pattern, _, d_composed, d_scores = _head_gradients(
        q_rows, k_rows, dz_rows, _head_rows(v, row, s_idx, s_ok, h_idx, h_ok, S, H, E, EP), maps, grads, row, t_idx,
        t_ok, s_idx, s_ok, h_idx, h_ok, seen, maxima, sums, d_row, T, S, H, R, scale, pre_qw1, pre_qw2, pre_kw1,
        pre_kw2, pre_qg, pre_kg, post_qw1, post_kw1, post_qg, post_kg, PRE_QP, PRE_KP, PRE_QG, PRE_KG, POST_QP,
        POST_KP, POST_QG, POST_KG, 3, HALF
    )
    d_queries += _head_dot(d_scores, k_rows, HALF)
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
    k_rows = _head_rows(k, row, s_idx, s_ok, h_idx, h_ok, S, H, E, EP)
    v_rows = _head_rows(v, row, s_idx, s_ok, h_idx, h_ok, S, H, E, EP)
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
    for i in range(0, _masked_blocks(first_query, lo, hi, end_query, BQ)):
        sums_so_far = _head_key_gradient_step(
            sums_so_far, _masked_block(i, first_query, lo, hi, BQ), q, dz, k_rows, v_rows, maps, grads, row_max,
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
    (MASKED: `_seen`)."""
    d_keys, d_values, d_pre_gate, d_pre_w1, d_pre_w2, d_post_gate, d_post_w1, d_post_w2 = sums_so_far
    t_idx = t0 + tl.arange(0, BQ)
    t_ok = t_idx < end_query  # nor queries past the last that sees the block
    maxima = _row_values(row_max, row, h_idx, h_ok, t_idx, t_ok, H, T, 0.0)
    sums = _row_values(row_sum, row, h_idx, h_ok, t_idx, t_ok, H, T, 1.0)
    d_row = _row_values(row_d, row, h_idx, h_ok, t_idx, t_ok, H, T, 0.0)
    q_rows = _head_rows(q, row, t_idx, t_ok, h_idx, h_ok, T, H, E, EP)
    dz_rows = _head_rows(dz, row, t_idx, t_ok, h_idx, h_ok, T, H, E, EP)
    seen = _seen(row, t_idx, t_ok, s_idx, s_ok, real, S, past, span, PADDING, MASKED)
    scores, pattern, d_composed_pattern, _, d_composed, d_scores = _head_gradients(
        q_rows, k_rows, dz_rows, v_rows, maps, grads, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, seen, maxima, sums,
        d_row, T, S, H, R, scale, pre_qw1, pre_qw2, pre_kw1, pre_kw2, pre_qg, pre_kg, post_qw1, post_kw1, post_qg,
        post_kg, PRE_QP, PRE_KP, PRE_QG, PRE_KG, POST_QP, POST_KP, POST_QG, POST_KG, 3, HALF
    )
    composed_pattern = _head_compose(
        pattern, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, seen, T, S, H, R, maps, 2 * R, post_qw2, post_kw2,
        post_qg, post_kg, POST_QP, POST_KP, POST_QG, POST_KG
    )
    composed_pattern = tl.where(seen[None, :, :], composed_pattern, 0.0)
    d_values += _head_dot(tl.permute(composed_pattern, (0, 2, 1)), dz_rows, HALF)
    d_keys += _head_dot(tl.permute(d_scores, (0, 2, 1)), q_rows, HALF)
    d_pre_gate, d_pre_w1, d_pre_w2, d_post_gate, d_post_w1, d_post_w2 = _add_weight_gradients(
        d_pre_gate, d_pre_w1, d_pre_w2, d_post_gate, d_post_w1, d_post_w2, scores, pattern, d_composed_pattern,
        d_composed, maps, grads, row, t_idx, t_ok, s_idx, s_ok, seen, T, S, R, RP, PRE_KG, PRE_KP, POST_KG, POST_KP,
        1, False
    )
    return d_keys, d_values, d_pre_gate, d_pre_w1, d_pre_w2, d_post_gate, d_post_w1, d_post_w2

# fmt: on


jit = LateJit(globals(), (
    "_dot",
    "_weight",
    "_rows",
    "_visible",
    "_online_softmax",
    "_row_values",
    "_store_row_values",
    "_store_statistics",
    "_head_dot",
    "_tf32x3_dot",
    "_tf32",
    "_head_weights",
    "_load_map",
    "_store_maps",
    "_head_scores",
    "_head_compose",
    "_head_pattern",
    "_head_rows",
    "_tile_is_seen",
    "_seen",
    "_whole_key_blocks",
    "_whole_query_blocks",
    "_masked_blocks",
    "_masked_block",
    "product_maps_kernel",
    "row_statistics_kernel",
    "_row_statistics_step",
    "post_maps_kernel",
    "head_output_kernel",
    "_head_output_step",
    "_load_maps",
    "_put_head_weights",
    "_put_head_rows",
    "_head_gradients",
    "_add_weight_gradients",
    "_tile_sum",
    "_summed_weight_gradients",
    "_store_weight_gradients",
    "row_gradient_kernel",
    "_row_gradient_step",
    "pre_gradient_maps_kernel",
    "head_query_gradient_kernel",
    "_head_query_gradient_step",
    "head_key_gradient_kernel",
    "_head_key_gradient_step",
))  # fmt: skip
