"""The Triton kernels of DCMHA through the cross-head maps (`dcinterp.dcmha.maps` launches them): inner helpers, then
the forward's four kernels. The backward's kernels, in `dcinterp.dcmha.maps_backward_kernels`, call the helpers that
are public here.

Each kernel is a plain function here, jitted at the first call of `fused_dcmha` by `jit` (`dcinterp.dcmha.jit`:
Triton decides when a function is jitted whether it runs natively or under its interpreter). A program holds tiles
of one head, [1, queries, keys] (the leading axis kept so that the loaders serve every tile alike), or, in the kernels
that make the maps, [RP, queries, keys] summed over the heads one at a time. The kernels of one head a program walk
the blocks that every query of a block sees whole in a loop without masks, the others (the diagonal, a window's first
keys, the prompt's last queries, any with padding) in a masked loop, as FlashAttention does (`seen_pairs`). The
kernels that only make maps make them for every pair of a tile, unmasked: what no query sees is dropped where the maps
are read. The maps' tiles are loaded masked by their buffer's bounds alone, so that the loads are vectors.

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


def row_values(x, row, h_idx, h_ok, t_idx, t_ok, H, T, other):
    """x[row, h, t] of a float32 [b, H, T] tensor (the softmax's row max and sum, or D) as [heads, queries].

    Args:
        x: the [b, H, T] tensor.
        row: the batch row.
        h_idx: the heads.
        h_ok: which of them are real.
        t_idx: the queries.
        t_ok: which of them are real.
        H: the heads.
        T: the queries.
        other: the value where a head or query is not real.

    Returns:
        The values, [heads, queries].
    """
    at = (row * H + h_idx[:, None]) * T + t_idx[None, :]
    return tl.load(x + at, mask=h_ok[:, None] & t_ok[None, :], other=other)


def store_row_values(x, row, h_idx, h_ok, t_idx, t_ok, H, T, value):
    """x[row, h, t] = value where the head and query are real.

    Args:
        x: a float32 [b, H, T] tensor.
        row: the batch row.
        h_idx: the heads.
        h_ok: which of them are real.
        t_idx: the queries.
        t_ok: which of them are real.
        H: the heads.
        T: the queries.
        value: [heads, queries].
    """
    at = (row * H + h_idx[:, None]) * T + t_idx[None, :]
    tl.store(x + at, value, mask=h_ok[:, None] & t_ok[None, :])


def load_statistics(row_max, row_sum, row, h_idx, h_ok, t_idx, t_ok, H, T):
    """The softmax's row max and sum that `row_statistics_kernel` stored, of one head's queries.

    Args:
        row_max: the [b, H, T] float32 row maxima.
        row_sum: the [b, H, T] float32 row sums.
        row: the batch row.
        h_idx: the head, [1].
        h_ok: whether it is real.
        t_idx: the queries.
        t_ok: which of them are real.
        H: the heads.
        T: the queries.

    Returns:
        (maxima, sums), [1, queries] each: 0 and 1 where the head or query is not real.
    """
    maxima = row_values(row_max, row, h_idx, h_ok, t_idx, t_ok, H, T, 0.0)
    sums = row_values(row_sum, row, h_idx, h_ok, t_idx, t_ok, H, T, 1.0)
    return maxima, sums


def _store_statistics(row_max, row_sum, running_max, running_sum, row, h_idx, h_ok, t_idx, t_ok, H, T):
    """Each (head, query)'s final max and sum into [b, H, T] buffers, and returned; a row with no visible key gets
    max 0 and sum 1 (no NaN later)."""
    running_max = tl.where(running_max == float("-inf"), 0.0, running_max)
    running_sum = tl.where(running_sum == 0.0, 1.0, running_sum)
    store_row_values(row_max, row, h_idx, h_ok, t_idx, t_ok, H, T, running_max)
    store_row_values(row_sum, row, h_idx, h_ok, t_idx, t_ok, H, T, running_sum)
    return running_max, running_sum


# --- the forward through the cross-head maps: four kernels, each head alone but for the maps ----------------------
# The compose mixes heads only through rank-R maps of [queries, keys], shared by every head: the pre-compose's
# hq[r] = sum_n qw1[t, r, n] S[n] and hk[r] = sum_n kw1[s, r, n] S[n], the post-compose's gq[r] = sum_n qw1'[t, r, n]
# P[n] and gk[r] alike. Kept in a [b, 4R, t, s] buffer (`maps`, j = r, R + r, 2R + r, 3R + r), they let each head be
# computed alone, FlashAttention's way, its output accumulated in registers; the two maps kernels sum over the heads
# one at a time. A head's tiles are [1, queries, keys] (the leading axis: the tiles kernels' loaders serve as they are).


def head_dot(a, b, HALF: tl.constexpr):
    """One head's [1, m, k] @ [1, k, n] tiles, as a 2D product: half tiles as `_dot` takes them, float32 ones by
    3xTF32 (`_tf32x3_dot`), on the tensor cores. In IEEE float32 (FMA, no tensor core) the kernels through the maps
    need so many registers that ptxas keeps most of them to 32 and spills kilobytes a thread; by 3xTF32 they do not
    (benchmarks/kernel_resources.py --dtype float32).

    Args:
        a: [1, m, k].
        b: [1, k, n].
        HALF: whether the inputs are float16 / bfloat16.

    Returns:
        a @ b, [1, m, n] float32.
    """
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


def _store_planes(maps, row, first, t_idx, t_ok, s_idx, s_ok, T, S, R: tl.constexpr, RP: tl.constexpr, value):
    """maps[row, first + r, t, s] = value[r, t, s]."""
    r_ok = tl.arange(0, RP) < R
    mask = r_ok[:, None, None] & t_ok[None, :, None] & s_ok[None, None, :]
    planes = maps + (row.to(tl.int64) * 4 * R + first) * T * S
    offsets = tl.arange(0, RP)[:, None, None] * T * S + t_idx[None, :, None] * S + s_idx[None, None, :]
    tl.store(planes + offsets, value.to(maps.dtype.element_ty), mask=mask)


def add_head_to_maps(
    q_maps, k_maps, x, wq, wk, row, t_idx, t_ok, s_idx, s_ok, n, T, S, H, R: tl.constexpr, RP: tl.constexpr,
    QP: tl.constexpr, KP: tl.constexpr
):
    """Head n's term of a tile's query-wise and key-wise maps: x[n] times its weights wq[t, r, n], wk[s, r, n].

    Args:
        q_maps: the query-wise maps so far, [RP, queries, keys] float32.
        k_maps: the key-wise maps so far, alike.
        x: head n's [1, queries, keys] tile (scores, probabilities or a gradient of them).
        wq: the query-wise weights, a [b, T, R, H] tensor.
        wk: the key-wise weights, a [b, S, R, H] tensor.
        row: the batch row.
        t_idx: the tile's queries.
        t_ok: which of them are real.
        s_idx: the tile's keys.
        s_ok: which of them are real.
        n: the head.
        T: the queries.
        S: the keys.
        H: the heads.
        R: the rank.
        RP: R rounded up to a power of two.
        QP: whether the query-wise maps are made (else `q_maps` is returned as it is).
        KP: whether the key-wise maps are.

    Returns:
        (q_maps, k_maps) with head n's terms added.
    """
    if QP:
        q_maps += x * _head_weights(wq, row, t_idx, t_ok, n, T, H, R, RP)[:, :, None]
    if KP:
        k_maps += x * _head_weights(wk, row, s_idx, s_ok, n, S, H, R, RP)[:, None, :]
    return q_maps, k_maps


def store_maps(
    maps, row, first, t_idx, t_ok, s_idx, s_ok, T, S, R: tl.constexpr, RP: tl.constexpr, q_maps, k_maps,
    QP: tl.constexpr, KP: tl.constexpr
):
    """A tile's query-wise maps into maps[row, first + r] and its key-wise maps into maps[row, first + R + r].

    Args:
        maps: a [b, 4R, T, S] buffer (the maps or their gradients).
        row: the batch row.
        first: the first plane of the query-wise maps.
        t_idx: the tile's queries.
        t_ok: which of them are stored.
        s_idx: the tile's keys.
        s_ok: which of them are stored.
        T: the queries.
        S: the keys.
        R: the rank.
        RP: R rounded up to a power of two.
        q_maps: the query-wise maps, [RP, queries, keys].
        k_maps: the key-wise maps, alike.
        QP: whether the query-wise maps are stored.
        KP: whether the key-wise maps are.
    """
    if QP:
        _store_planes(maps, row, first, t_idx, t_ok, s_idx, s_ok, T, S, R, RP, q_maps)
    if KP:
        _store_planes(maps, row, first + R, t_idx, t_ok, s_idx, s_ok, T, S, R, RP, k_maps)


def _head_scores(q_rows, k, row, s_idx, s_ok, h_idx, h_ok, S, H, E, scale, EP: tl.constexpr, HALF: tl.constexpr):
    """S = scale q k^T of one head: [1, queries, keys], float32, from its query rows ([1, queries, EP])."""
    e = tl.arange(0, EP)
    k_rows = _rows(k, row, s_idx, s_ok, h_idx, h_ok, e, e < E, S, H, E)
    return head_dot(q_rows, tl.permute(k_rows, (0, 2, 1)), HALF) * scale


def head_compose(
    x, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, seen, T, S, H, R: tl.constexpr, maps, first, qw2, kw2, qg, kg,
    QP: tl.constexpr, KP: tl.constexpr, QG: tl.constexpr, KG: tl.constexpr
):
    """One compose stage on one head's [1, queries, keys] tile, its cross-head terms read from the stage's maps.

    Args:
        x: the head's tile (scores, probabilities, or a gradient of them), float32.
        row: the batch row.
        t_idx: the tile's queries.
        t_ok: which of them are real.
        s_idx: the tile's keys.
        s_ok: which of them are real.
        h_idx: the head, [1].
        h_ok: whether it is real.
        seen: [queries, keys], the pairs whose maps are read.
        T: the queries.
        S: the keys.
        H: the heads.
        R: the rank.
        maps: the [b, 4R, T, S] maps (or their gradients).
        first: the stage's first plane: maps[first + r] query-wise, maps[first + R + r] key-wise.
        qw2: the query-wise projection [b, T, R, H] (or its w1, in a backward).
        kw2: the key-wise projection [b, S, R, H], alike.
        qg: the query-wise gate [b, T, H].
        kg: the key-wise gate [b, S, H].
        QP: whether the query-wise projection is on.
        KP: whether the key-wise one is.
        QG: whether the query-wise gate is.
        KG: whether the key-wise one is.

    Returns:
        The composed tile, [1, queries, keys] float32.
    """
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
    composed = head_compose(
        scores, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, seen, T, S, H, R, maps, 0, qw2, kw2, qg, kg, QP, KP, QG,
        KG
    )
    if NORMALISED:
        return tl.where(seen[None, :, :], tl.exp(composed - maxima[:, :, None]) / sums[:, :, None], 0.0)
    return tl.where(seen[None, :, :], composed, float("-inf"))


def head_rows(x, row, idx, ok, h_idx, h_ok, N, H, E, EP: tl.constexpr):
    """One head's rows of a [b, N, H, E] tensor (q, k, v or dz).

    Args:
        x: the tensor.
        row: the batch row.
        idx: the positions.
        ok: which of them are real (0 elsewhere).
        h_idx: the head, [1].
        h_ok: whether it is real.
        N: the positions.
        H: the heads.
        E: the head dim.
        EP: E padded to a power of two, at least 16.

    Returns:
        [1, positions, EP], in x's dtype.
    """
    e = tl.arange(0, EP)
    return _rows(x, row, idx, ok, h_idx, h_ok, e, e < E, N, H, E)


def tile_positions(t0, s0, T, S, BQ: tl.constexpr, BK: tl.constexpr):
    """The queries and keys of the tile of BQ queries from t0 by BK keys from s0, and which of them are real.

    Args:
        t0: the tile's first query.
        s0: its first key.
        T: the queries.
        S: the keys.
        BQ: the tile's queries.
        BK: its keys.

    Returns:
        (t_idx, t_ok, s_idx, s_ok): the queries [BQ], whether each is below T, the keys [BK], whether each is below S.
    """
    t_idx = t0 + tl.arange(0, BQ)
    s_idx = s0 + tl.arange(0, BK)
    return t_idx, t_idx < T, s_idx, s_idx < S


def tile_is_seen(t0, s0, past, span, BQ: tl.constexpr, BK: tl.constexpr):
    """Whether any query of the block starting at t0 sees any key of the block starting at s0.

    Args:
        t0: the first query.
        s0: the first key.
        past: the keys before the first query's own.
        span: a query sees the keys after its position less span.
        BQ: the block's queries.
        BK: its keys.

    Returns:
        A boolean scalar.
    """
    return (s0 <= past + t0 + BQ - 1) & (s0 + BK - 1 > past + t0 - span)


# The kernels of one head a program walk a block's keys (or a key block's queries) in two loops, as FlashAttention
# does: the blocks of which every query sees every key, with no mask (`seen_pairs` not MASKED: the compiler drops every
# select on it), and the others, masked: the diagonal's, a window's first, the prompt's last, any with padding.
def seen_pairs(row, t_idx, t_ok, s_idx, s_ok, real, S, past, span, PADDING: tl.constexpr, MASKED: tl.constexpr):
    """Which query sees which key of a tile: `_visible`, MASKED; else True for every pair, known at compile time (a
    block seen whole).

    Args:
        row: the batch row.
        t_idx: the tile's queries.
        t_ok: which of them are real.
        s_idx: its keys.
        s_ok: which of them are read.
        real: the [b, S] mask of real keys (PADDING).
        S: the keys.
        past: the keys before the first query's own.
        span: a query sees the keys after its position less span.
        PADDING: whether `real` is given.
        MASKED: whether the tile needs the masks.

    Returns:
        [queries, keys] booleans.
    """
    if MASKED:
        return _visible(row, t_idx, t_ok, s_idx, s_ok, real, S, past, span, PADDING)
    return tl.full((t_idx.shape[0], s_idx.shape[0]), 1, tl.int1)


def whole_key_blocks(t0, start, end, past, span, T, S, BQ: tl.constexpr, BK: tl.constexpr, PADDING: tl.constexpr):
    """The blocks of keys [lo, hi) (BK apart from `start`, before `end`) of which every key is seen by every query of
    the block t0 .. t0 + BQ - 1.

    Args:
        t0: the block's first query.
        start: the first key block's start.
        end: the keys' end.
        past: the keys before the first query's own.
        span: a query sees the keys after its position less span.
        T: the queries.
        S: the keys.
        BQ: the block's queries.
        BK: a key block's keys.
        PADDING: whether keys may be pads (then no block is seen whole).

    Returns:
        (lo, hi); lo = hi = end where there are none (the prompt's last queries, padding).
    """
    lo = tl.maximum(start, (tl.maximum(past + t0 + BQ - span, 0) + BK - 1) // BK * BK)  # in the last query's window
    hi = tl.minimum(past + t0 + 1, S) // BK * BK  # up to the first query's own position
    if PADDING:
        hi = lo
    whole = (lo < hi) & (t0 + BQ <= T)
    return tl.where(whole, lo, end), tl.where(whole, hi, end)


def masked_blocks(start, lo, hi, end, B: tl.constexpr):
    """How many blocks, B apart from `start`, need the masks: those before `lo`, and those from `hi` before `end`.

    Args:
        start: the first block's start.
        lo: the first block seen whole (`whole_key_blocks`).
        hi: the end of the blocks seen whole.
        end: the end of the positions.
        B: a block's positions.

    Returns:
        The count.
    """
    return (lo - start + B - 1) // B + (end - hi + B - 1) // B


def masked_block(i, start, lo, hi, B: tl.constexpr):
    """Where the i-th block `masked_blocks` counts starts.

    Args:
        i: the block's number, from 0.
        start: the first block's start.
        lo: the first block seen whole.
        hi: the end of the blocks seen whole.
        B: a block's positions.

    Returns:
        The block's first position.
    """
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
    if tile_is_seen(t0, s0, past, span, BQ, BK):
        t_idx, t_ok, s_idx, s_ok = tile_positions(t0, s0, T, S, BQ, BK)
        q_maps = tl.zeros((RP, BQ, BK), dtype=tl.float32)
        k_maps = tl.zeros((RP, BQ, BK), dtype=tl.float32)
        for n in range(H):
            head = n + tl.arange(0, 1)
            a_rows = head_rows(a, row, t_idx, t_ok, head, head < H, T, H, E, EP)
            product = _head_scores(a_rows, b, row, s_idx, s_ok, head, head < H, S, H, E, scale, EP, HALF)
            # (written out: through `add_head_to_maps` the compiler builds this loop otherwise for a card)
            if QP:
                q_maps += product * _head_weights(wq, row, t_idx, t_ok, n, T, H, R, RP)[:, :, None]
            if KP:
                k_maps += product * _head_weights(wk, row, s_idx, s_ok, n, S, H, R, RP)[:, None, :]
        store_maps(maps, row, FIRST, t_idx, t_ok, s_idx, s_ok, T, S, R, RP, q_maps, k_maps, QP, KP)


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
    q_rows = head_rows(q, row, t_idx, t_ok, h_idx, h_ok, T, H, E, EP)
    running_max = tl.full((1, BQ), float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros((1, BQ), dtype=tl.float32)
    lo, hi = whole_key_blocks(t0, first_key, end_key, past, span, T, S, BQ, BK, PADDING)
    for i in range(0, masked_blocks(first_key, lo, hi, end_key, BK)):
        running_max, running_sum = _row_statistics_step(
            running_max, running_sum, masked_block(i, first_key, lo, hi, BK), q_rows, k, maps, real, qw2, kw2, qg,
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
    """The running max and sum with the keys s0 .. s0 + BK - 1 (MASKED: `seen_pairs`)."""
    s_idx = s0 + tl.arange(0, BK)
    s_ok = s_idx < end_key  # keys past the block's last query are not even read
    seen = seen_pairs(row, t_idx, t_ok, s_idx, s_ok, real, S, past, span, PADDING, MASKED)
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
    if tile_is_seen(t0, s0, past, span, BQ, BK):
        t_idx, t_ok, s_idx, s_ok = tile_positions(t0, s0, T, S, BQ, BK)
        # every pair computed, seen or not, unmasked: these maps are per pair, and dropped where no query sees it
        seen = seen_pairs(row, t_idx, t_ok, s_idx, s_ok, real, S, past, span, PADDING, False)
        q_maps = tl.zeros((RP, BQ, BK), dtype=tl.float32)
        k_maps = tl.zeros((RP, BQ, BK), dtype=tl.float32)
        for n in range(H):
            head = n + tl.arange(0, 1)
            maxima, sums = load_statistics(row_max, row_sum, row, head, head < H, t_idx, t_ok, H, T)
            pattern = _head_pattern(
                head_rows(q, row, t_idx, t_ok, head, head < H, T, H, E, EP), k, maps, row, t_idx, t_ok, s_idx,
                s_ok, head, head < H, seen, T, S, H, E, R, scale, pre_qw2, pre_kw2, pre_qg, pre_kg, maxima, sums,
                PRE_QP, PRE_KP, PRE_QG, PRE_KG, EP, HALF, True
            )
            q_maps, k_maps = add_head_to_maps(
                q_maps, k_maps, pattern, post_qw1, post_kw1, row, t_idx, t_ok, s_idx, s_ok, n, T, S, H, R, RP, POST_QP,
                POST_KP
            )
        store_maps(maps, row, 2 * R, t_idx, t_ok, s_idx, s_ok, T, S, R, RP, q_maps, k_maps, POST_QP, POST_KP)


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
    maxima, sums = load_statistics(row_max, row_sum, row, h_idx, h_ok, t_idx, t_ok, H, T)
    q_rows = head_rows(q, row, t_idx, t_ok, h_idx, h_ok, T, H, E, EP)
    out = tl.zeros((1, BQ, EP), dtype=tl.float32)
    start = first_key // BK * BK  # aligned, so that whole vectors load
    lo, hi = whole_key_blocks(t0, start, end_key, past, span, T, S, BQ, BK, PADDING)
    for i in range(0, masked_blocks(start, lo, hi, end_key, BK)):
        out = _head_output_step(
            out, masked_block(i, start, lo, hi, BK), q_rows, k, v, maps, real, maxima, sums, pre_qw2, pre_kw2,
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
    """out + P' V over the keys s0 .. s0 + BK - 1 (MASKED: `seen_pairs`)."""
    s_idx = s0 + tl.arange(0, BK)
    s_ok = s_idx < end_key
    seen = seen_pairs(row, t_idx, t_ok, s_idx, s_ok, real, S, past, span, PADDING, MASKED)
    pattern = _head_pattern(
        q_rows, k, maps, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, seen, T, S, H, E, R, scale, pre_qw2, pre_kw2,
        pre_qg, pre_kg, maxima, sums, PRE_QP, PRE_KP, PRE_QG, PRE_KG, EP, HALF, True
    )
    pattern = head_compose(
        pattern, row, t_idx, t_ok, s_idx, s_ok, h_idx, h_ok, seen, T, S, H, R, maps, 2 * R, post_qw2, post_kw2,
        post_qg, post_kg, POST_QP, POST_KP, POST_QG, POST_KG
    )
    values = head_rows(v, row, s_idx, s_ok, h_idx, h_ok, S, H, E, EP)
    if MASKED:  # keys of the aligned block before the first visible one were loaded, never used: 0, whatever they hold
        values = tl.where((s_idx >= first_key)[None, :, None], values, 0.0).to(v.dtype.element_ty)
        pattern = tl.where(seen[None, :, :], pattern, 0.0)
    return out + head_dot(pattern, values, HALF)

# fmt: on


jit = LateJit(globals(), (
    "_dot",
    "_weight",
    "_rows",
    "_visible",
    "_online_softmax",
    "row_values",
    "store_row_values",
    "load_statistics",
    "_store_statistics",
    "head_dot",
    "_tf32x3_dot",
    "_tf32",
    "_head_weights",
    "_load_map",
    "_store_planes",
    "add_head_to_maps",
    "store_maps",
    "_head_scores",
    "head_compose",
    "_head_pattern",
    "head_rows",
    "tile_positions",
    "tile_is_seen",
    "seen_pairs",
    "whole_key_blocks",
    "masked_blocks",
    "masked_block",
    "product_maps_kernel",
    "row_statistics_kernel",
    "_row_statistics_step",
    "post_maps_kernel",
    "head_output_kernel",
    "_head_output_step",
))  # fmt: skip
