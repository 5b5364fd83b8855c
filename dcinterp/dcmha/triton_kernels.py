"""DCMHA fused in Triton kernels: the attention's forward and backward without any [b, h, t, s] tensor.

Two ways, each a forward and its backward (`BACKWARD` says which gradients take; without gradients the forward
through the maps, the faster, is taken):
- through the cross-head maps: each head alone, FlashAttention's way, but for a few [queries, keys] maps shared by
  every head (four kernels forward, six backward);
- through tiles: every head of a tile of queries x keys together (one kernel forward, two backward).
A backward recomputes what its own forward computed, in the same order, so that the row statistics the forward saved
fit its recomputed scores bit for bit (the other forward's sums in another order would leave the softmax's gradient a
few float32 units off, more than the tests allow).

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
- `_product_maps_kernel`, per (query block, key block) tile that any query sees: hq and hk, summing each head's
  scores;
- `_row_statistics_kernel`, per (head, query block): the head's pre-composed scores from its own q k^T, its gates and
  the maps, and its softmax max and sum, online over the keys;
- `_post_maps_kernel`, per tile: gq and gk, summing each head's probabilities;
- `_head_output_kernel`, per (head, query block): the probabilities again, post-composed with the maps, times v,
  accumulated in registers as FlashAttention does.
The maps are kept in a [b, 4R, chunk, s] buffer (bfloat16 / float16 for such inputs, float32 otherwise) of at most
`maps_room(q)` bytes, 4 times the queries' own: a longer prompt goes a chunk of queries at a time. So memory grows
with the prompt, not with its square, nor with the heads: 4R numbers a (query, key) pair of the chunk against the
materialised path's dozen a head of every pair.

Tiles forward (`_forward_kernel`, grid (query blocks, batch rows), one program per block of queries of one row): pass 1
over the keys the block's queries see (keys after its last query, and before a local window, are not even read)
computes the scores, the pre-compose, the mask and each (head, query)'s running softmax max and sum; pass 2
recomputes them, normalises with the final statistics, applies the post-compose and accumulates P' V. Only q, k, v,
the dynamic weights and the per-(head, query) max and sum are kept for the backward: memory grows with the prompt,
not with its square. A decoding step (`past` cached positions, 1 to 16 new queries) is the same kernel: one launch
per layer, its one block of queries against every key it sees.

Backward through the tiles (FlashAttention's recomputation; the post-compose makes the softmax's `D = sum_s P dP` a
pass of its own, where FlashAttention takes rowsum(dz z)):

- `_backward_query_kernel`, per block of queries: pass 1 recomputes P, dP' = dz v, dP through the transposed
  post-compose and D; pass 2 gives dA = P (dP - D), dS through the transposed pre-compose, and every sum over keys:
  dq and the gradients of both stages' qw1, qw2, qg.
- `_backward_key_kernel`, per block of keys, over the queries that see it: every sum over queries, dk, dv and the
  gradients of both stages' kw1, kw2, kg.

Backward through the maps (`_backward_through_maps`). With dP' = dz v^T, the transposed post-compose mixes heads only
through the gradients of its maps, dgq[r] = sum_m qw2'[t, r, m] dP'[m] and dgk[r]; the transposed pre-compose, through
dhq[r] = sum_m qw2[t, r, m] dA[m] and dhk[r]. Each chunk of queries: the forward's two maps kernels again (hq, hk, gq,
gk, bit for bit), then
- `_product_maps_kernel` on dz, v: dgq and dgk, per tile;
- `_row_gradient_kernel`, per (head, query block): D = sum_s P dP over the keys;
- `_pre_gradient_maps_kernel`, per tile: dhq and dhk, summing each head's dA = P (dP - D);
- `_head_query_gradient_kernel`, per (head, query block), over its keys: dq and both stages' query-side weights'
  gradients, in registers;
- `_head_key_gradient_kernel`, per (head, key block), over the queries that see it: dk, dv and the key side's (the
  weights' products kept in tiles and summed over the queries once, after the loop), added to the earlier chunks'.
The gradient maps take a second buffer of the maps' size: both together in at most `maps_room(q)`.

The kernels through the maps of one head a program walk the blocks that every query of a block sees whole in a loop
without masks, the others (the diagonal, a window's first keys, the prompt's last queries, any with padding) in a
masked loop, as FlashAttention does (`_seen`). The kernels that only make maps (per pair: the post-compose's, the
pre-compose's gradient maps) make them for every pair of a tile, unmasked: what no query sees is dropped where the
maps are read. The maps' tiles are loaded masked by their buffer's bounds alone, so that the loads are vectors.

Registers, in the tiles kernels: a program holds [heads, queries, keys] tiles (32 x 16 x 16 at 32 heads, the default
`BLOCKS`). Every head's q rows or output rows at e = 128 would be 64K floats more, so the head dim is walked in
chunks of 32 (QK^T and P' V are `tl.dot`s batched over the heads, one chunk at a time), and the sums over key or
query blocks (z, dq, dk, dv, the weights' gradients) are added into float32 buffers in global memory, each row owned
by exactly one program. Nothing is summed by atomics and every loop runs in a fixed order, so the same inputs give
the same bits. Timed and profiled on an H100 (docs/gpu.md): one program of 8 warps an SM (246-255
registers a thread), latency-bound, 7% of the SM's compute throughput.

What each kernel takes of a card (registers, spills, shared memory), read without one: benchmarks/kernel_resources.py.
For the 24 GB cards of a workstation (sm_86: RTX 3090, A5000, A10; sm_89: RTX 4090, L4; 99 KiB of shared memory a
block) and the A100 (sm_80) every kernel fits at 32 heads of 128 and 256, some only unpipelined, which their launch
falls back on (`_run`), on sm_86 and sm_89: the key side's at 128, the output's and three of the backward's at 256.
Not timed on such a card.

float32 inputs use IEEE float32 products in the tiles kernels and 3xTF32 ones in the kernels through the maps
(`_tf32x3_dot`: float32's precision nearly, on the tensor cores; in IEEE products ptxas kept those to 32 registers,
spilling kilobytes); float16 / bfloat16 inputs multiply in their own dtype, like FlashAttention, and everything
accumulates in float32. Not computed by the kernels: second derivatives
(`create_graph=True`: the backward takes `fused_dcmha`'s `fallback`, the materialised formula in dcinterp's dispatch,
or raises without one).

Triton decides when a kernel is decorated whether it runs natively or under its CPU interpreter (`TRITON_INTERPRET=1`),
so the kernels are decorated at their first use, not when dcinterp is imported (Triton's own functions, tl.sum and the
like, are decorated when triton is imported: the variable must be set before that).

Index names: b batch, t queries, s keys, h/m/n heads, e head dim, r rank.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Literal

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from ._grids import cdiv, checked_once, next_power_of_2, signature

try:
    import triton
    import triton.language as tl
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources
except ImportError as error:  # dcinterp runs without triton (or an old one): available() says why the kernels cannot
    triton = tl = None
    OutOfResources = CompilationError = ()  # (nothing to catch)
    _TRITON_UNUSABLE = f"triton is not installed ({error})"
else:
    _TRITON_UNUSABLE = None
    if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 6):
        _TRITON_UNUSABLE = f"the fused kernels need Triton 3.6 or newer (found {triton.__version__})"

BLOCKS = (16, 16, 32)  # a tile's queries and keys, and a chunk of the head dim (powers of two, at least 16)
# The forward through the maps: the launches of its two kernels that sum the maps over the heads (tiles of BQ queries
# by BK keys), and of its two of one head a program; the fastest of a sweep on an NVIDIA H200 (bfloat16, 32 heads of
# 128, rank 2, 4,096 tokens: benchmarks/results/h200-2026-11-27-maps-sweep-*.jsonl). With programs of 2 or 4 heads
# (tiles [heads, queries, keys], products batched over the heads) the output kernel took 2.8 to 66 times as long.
MAPS_KERNELS = dict(BQ=64, BK=32, num_warps=4, num_stages=3)
HEAD_KERNELS = dict(BQ=64, BK=32, num_warps=4, num_stages=2)
# The backward through the maps' kernels of its own: the fastest of five launches each on an NVIDIA H100 (bfloat16, 32
# heads of 128, rank 2, 4,096 tokens, `benchmarks/sweep_gpu_maps.py --backward`: benchmarks/results/
# h100-2026-11-27-sweep-backward.txt): the query side's three kernels 21.0 ms against 24.1-28.8, the key side's 22.8
# ms against 27.4-48.9 (the earlier 8 warps and blocks of 16 queries)
GRADIENT_KERNELS = dict(BQ=64, BK=32, num_warps=4, num_stages=2)
KEY_GRADIENT_KERNELS = dict(BQ=32, BK=64, num_warps=8, num_stages=2)
# Above a head dim of 128 the key side's tiles of 32 queries leave ptxas no room: at 256 on sm_86 (Triton 3.9) it kept
# the kernel to 40 registers a thread, spilling 16 KB; with tiles of 16 queries, 255 registers and 1.5 KB (sm_90: 3.3
# KB against 2.2; benchmarks/kernel_resources.py). Not timed on a card.
KEY_GRADIENT_KERNELS_WIDE_HEADS = dict(KEY_GRADIENT_KERNELS, BQ=16)
# The kernels through the maps hold at most MAPS_TIMES_QUERIES times the bytes of the call's queries q of them at a
# time, so that the maps grow with the prompt, not with its square: never less than MAPS_MIN_BYTES (a short prompt's
# maps in one chunk, the fewest launches) nor more than MAPS_BYTES
MAPS_TIMES_QUERIES = 4
MAPS_MIN_BYTES = 32 * 2**20
MAPS_BYTES = 256 * 2**20
# Which kernels take the gradients: "maps" (the forward and backward through the maps) or "tiles" (the tiles forward
# and backward). One layer's forward + backward on an NVIDIA H100 (the same sweep): through the maps 3.2, 5.3, 15.1
# and 52.8 ms at 512, 1,024, 2,048 and 4,096 tokens, through the tiles 8.5, 17.3, 38.3 and 115 ms
BACKWARD = "maps"
BRANCHES = ("qw1", "qw2", "kw1", "kw2", "qg", "kg")  # a stage's dynamic weights, in this order
QUERY_SIDE, KEY_SIDE = (0, 1, 4, 6, 7, 10), (2, 3, 5, 8, 9, 11)  # both stages' weights of [b, t, ...] and [b, s, ...]
# fallback(refusal, dz, q, k, v, weights) -> gradients of (q, k, v, *weights): `fused_dcmha`'s backward where its own
# kernels cannot give them
Fallback = Callable[[Exception | None, Tensor, Tensor, Tensor, Tensor, tuple], tuple]


def available(device: torch.device) -> str | None:
    """None when the fused kernels can run on `device` (CUDA with Triton importable, or TRITON_INTERPRET=1 on a CPU),
    else the one-line reason."""
    device = torch.device(device)
    if _TRITON_UNUSABLE is not None:
        return _TRITON_UNUSABLE
    interpreted = _kernels_interpreted()
    if interpreted and not _triton_interpreted():
        return (
            "TRITON_INTERPRET=1 was set after triton was imported (Triton's own functions were built for a GPU "
            "then): set it before the first import of triton, or of anything that imports it"
        )
    if not interpreted and _triton_interpreted():
        return "TRITON_INTERPRET=1 was unset after triton was imported under it: unset it before the first import"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available"
        return None
    if device.type == "cpu":
        if not interpreted:
            return "the Triton kernels run on a CPU only under TRITON_INTERPRET=1 (set before triton is imported)"
        return None
    return f"the Triton kernels do not run on {device.type}"


def _kernels_interpreted() -> bool:
    """Whether the kernels run (or, not decorated yet, would run) under Triton's interpreter."""
    if _decorated:
        return _decorated_interpreted
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _triton_interpreted() -> bool:
    """Whether Triton's own functions (tl.sum, tl.max, ...), decorated when triton was imported, run under its
    interpreter: TRITON_INTERPRET was 1 then. The kernels calling them must run the same way."""
    interpreter = sys.modules.get("triton.runtime.interpreter")  # never imported by a native run
    return interpreter is not None and isinstance(tl.sum, interpreter.InterpretedFunction)


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
    maxima = _row_values(row_max, row, h_idx, h_ok, t_idx, t_ok, H, T, 0.0)
    sums = _row_values(row_sum, row, h_idx, h_ok, t_idx, t_ok, H, T, 1.0)

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
    _store_row_values(row_d, row, h_idx, h_ok, t_idx, t_ok, H, T, d_row)

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
        maxima = _row_values(row_max, row, h_idx, h_ok, t_idx, t_ok, H, T, 0.0)
        sums = _row_values(row_sum, row, h_idx, h_ok, t_idx, t_ok, H, T, 1.0)
        d_row = _row_values(row_d, row, h_idx, h_ok, t_idx, t_ok, H, T, 0.0)
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
    """One head's [1, m, k] @ [1, k, n] tiles, as a 2D product: half tiles as `_dot` takes them, float32 ones by
    3xTF32 (`_tf32x3_dot`), on the tensor cores. In IEEE float32 (FMA, no tensor core) the kernels through the maps
    need so many registers that ptxas keeps seven of eight to 32 and spills 8.6-35 KB a thread (Triton 3.6 and 3.9,
    sm_90, 32 heads of 128: benchmarks/kernel_resources.py --dtype float32); by 3xTF32, none, 0.06-3.3 KB."""
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


def _product_maps_kernel(
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


def _row_gradient_kernel(
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


def _pre_gradient_maps_kernel(
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


def _head_query_gradient_kernel(
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


def _head_key_gradient_kernel(
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
    # the weights' gradients as products of the tiles' shape, summed over the queries once after the loop: per
    # iteration, a sum across the rows of a tile (spread over the warps) took most of the loop's instructions
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
    "_row_values",
    "_store_row_values",
    "_store_statistics",
    "_forward_kernel",
    "_backward_query_kernel",
    "_backward_key_kernel",
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
    "_product_maps_kernel",
    "_row_statistics_kernel",
    "_row_statistics_step",
    "_post_maps_kernel",
    "_head_output_kernel",
    "_head_output_step",
    "_load_maps",
    "_put_head_weights",
    "_put_head_rows",
    "_head_gradients",
    "_add_weight_gradients",
    "_tile_sum",
    "_summed_weight_gradients",
    "_store_weight_gradients",
    "_row_gradient_kernel",
    "_row_gradient_step",
    "_pre_gradient_maps_kernel",
    "_head_query_gradient_kernel",
    "_head_query_gradient_step",
    "_head_key_gradient_kernel",
    "_head_key_gradient_step",
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
        self.flags = {
            f"{stage}_{branch}": weights[offset + index] is not None
            for stage, offset in (("PRE", 0), ("POST", 6))
            for branch, index in (("QP", 0), ("KP", 2), ("QG", 4), ("KG", 5))
        }
        self.flags["PADDING"] = real is not None
        self.flags["HALF"] = q.dtype != torch.float32
        # the constexpr arguments of the kernels through the maps, built once for all their launches of the call
        blocks_given = {} if map_blocks is None else dict(BQ=map_blocks[0], BK=map_blocks[1])
        head_dim = dict(EP=max(16, next_power_of_2(self.d_head)))
        ranks = dict(RP=next_power_of_2(self.rank), **head_dim)
        self.maps_kernels = dict(MAPS_KERNELS, **blocks_given, **ranks)  # those that sum the maps over the heads
        self.head_kernels = dict(HEAD_KERNELS, **blocks_given, **head_dim)  # those of one head a program
        self.gradient_kernels = dict(GRADIENT_KERNELS, **blocks_given, **ranks)
        self.key_gradient_kernels = dict(key_gradient_kernels(self.d_head), **blocks_given, **ranks)
        self.masks = dict(PADDING=self.flags["PADDING"], HALF=self.flags["HALF"])
        self.pre_branches = {branch: self.flags[f"PRE_{branch}"] for branch in ("QP", "KP", "QG", "KG")}
        self.branches = {name: on for name, on in self.flags.items() if name.startswith(("PRE_", "POST_"))}
        self.post_maps = {name: on for name, on in self.branches.items() if name not in ("POST_QG", "POST_KG")}

    def scalars(self) -> tuple:
        return (self.n_queries, self.n_keys, self.n_heads, self.d_head, self.rank, self.past, self.span, self.scale)

    def constants(self) -> dict:
        blocks = dict(BQ=self.block_queries, BK=self.block_keys, BE=self.block_dim)
        # num_stages=1: no software pipelining, whose early loads could read a float32 accumulator (z, dq, ...) before
        # the previous iteration stored it
        padded_heads = next_power_of_2(self.n_heads)
        launch = dict(num_warps=_num_warps(padded_heads), num_stages=1)
        return dict(HP=padded_heads, **blocks, **self.flags, **launch)


def key_gradient_kernels(d_head: int) -> dict:
    """The key side's launch settings at this head dim."""
    return dict(KEY_GRADIENT_KERNELS_WIDE_HEADS if d_head > 128 else KEY_GRADIENT_KERNELS)


def _num_warps(padded_heads: int) -> int:
    """Warps a program. Swept on an NVIDIA H100 (bfloat16, causal, 2,048 and 4,096 tokens, against 8 warps): 16 heads
    of 64 took 0.69x the time with 4 warps, forward and forward + backward; 32 heads of 128 took 0.84-1.21x (the
    backward slower); 16 warps took 1.5-2.3x everywhere (128 registers a thread: the [32 heads, 16, 16] tiles
    spill)."""
    return 4 if padded_heads <= 16 else 8


def _pointers(tensors, stand_in: Tensor) -> list[Tensor]:
    """The tensors, with `stand_in` for each that is None (the kernels never read a branch that is off)."""
    return [stand_in if w is None else w for w in tensors]


def _run(kernel, grid, settings: dict, *args, **constants) -> None:
    """kernel[grid](*args, **constants, **settings), `settings` a call's launch settings (BQ, BK, num_warps,
    num_stages, ...). Where the card's shared memory cannot hold the loads they pipeline (Triton's OutOfResources at
    the first launch: on a card of 99 KiB a block, sm_86 or sm_89, the key side's, and more at a head dim of 256),
    the launch again without software pipelining, num_stages=1: the same arithmetic in the same order, its loads not
    prefetched. `settings` (the call's `_Launch`'s) keeps it, so that later calls of the same signature take it at
    once."""
    try:
        kernel[grid](*args, **constants, **settings)
    except OutOfResources:
        if settings["num_stages"] == 1:
            raise
        settings["num_stages"] = 1
        kernel[grid](*args, **constants, **settings)


def _forward(launch: _Launch, q, k, v, real, weights) -> tuple[Tensor, Tensor, Tensor]:
    """z (in q's dtype) and the softmax's row max and sum ([b, h, t], float32)."""
    z = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    stats = torch.empty(2, launch.batch, launch.n_heads, launch.n_queries, dtype=torch.float32, device=q.device)
    grid = (cdiv(launch.n_queries, launch.block_queries), launch.batch)
    _forward_kernel[grid](
        q, k, v, z, stats[0], stats[1], q if real is None else real, *_pointers(weights, q),
        *launch.scalars(), **launch.constants(),
    )  # fmt: skip
    return z.to(q.dtype), stats[0], stats[1]


def _chunk_of_queries(launch: _Launch, q: Tensor, buffers: int) -> int:
    """How many queries the kernels through the maps take at a time: `buffers` [b, 4R, chunk, s] buffers of maps in
    the room `maps_room` gives, a multiple of the blocks of queries (so that every tile, and every sum in it, is the
    same whatever the chunk)."""
    block_queries = max(launch.maps_kernels["BQ"], launch.head_kernels["BQ"], launch.gradient_kernels["BQ"])
    bytes_a_query = buffers * launch.batch * 4 * launch.rank * launch.n_keys * _maps_dtype(launch, q).itemsize
    return max(block_queries, maps_room(q) // bytes_a_query // block_queries * block_queries)


def maps_room(q: Tensor) -> int:
    """The bytes of maps (and, in the backward, of their gradients) the kernels through the maps hold at a time, for
    a call on the queries q: MAPS_TIMES_QUERIES times q's bytes, within MAPS_MIN_BYTES..MAPS_BYTES."""
    return min(MAPS_BYTES, max(MAPS_MIN_BYTES, MAPS_TIMES_QUERIES * q.numel() * q.element_size()))


def _maps_dtype(launch: _Launch, q: Tensor) -> torch.dtype:
    return q.dtype if launch.flags["HALF"] else torch.float32


def _any_map(launch: _Launch, stages=("PRE", "POST")) -> bool:
    return any(launch.flags[f"{stage}_{branch}"] for stage in stages for branch in ("QP", "KP"))


def _query_rows(weights: tuple, first: int, last: int) -> list:
    """The weights with the query-side ones cut to queries first..last (a chunk of the kernels through the maps)."""
    return [w if w is None or i not in QUERY_SIDE else w[:, first:last].contiguous() for i, w in enumerate(weights)]


def _forward_through_maps(launch: _Launch, q, k, v, real, weights) -> tuple[Tensor, Tensor, Tensor]:
    """z (in q's dtype) and the softmax's row max and sum ([b, h, t], float32), by the four kernels of the forward
    through the cross-head maps: the pre-compose's maps, each head's row statistics, the post-compose's maps, each
    head's output. The maps of at most MAPS_BYTES are held at a time: longer prompts go a chunk of queries at a time
    (each against every key it sees, the chunks' own cache-like `past`)."""
    n_queries, chunk = launch.n_queries, _chunk_of_queries(launch, q, buffers=1)
    maps = None
    if _any_map(launch):
        maps = torch.empty(
            launch.batch, 4 * launch.rank, min(chunk, n_queries), launch.n_keys, dtype=_maps_dtype(launch, q),
            device=q.device,
        )  # fmt: skip
    if chunk >= n_queries:
        return _maps_launches(launch, q, k, v, real, weights, maps, launch.past)
    outputs = []
    for first in range(0, n_queries, chunk):
        last = min(first + chunk, n_queries)
        part = _query_rows(weights, first, last)
        outputs.append(
            _maps_launches(launch, q[:, first:last].contiguous(), k, v, real, part, maps, launch.past + first)
        )
    z, row_max, row_sum = zip(*outputs, strict=True)
    return torch.cat(z, dim=1), torch.cat(row_max, dim=-1), torch.cat(row_sum, dim=-1)


def _maps_launches(launch: _Launch, q, k, v, real, weights, maps, past) -> tuple[Tensor, Tensor, Tensor]:
    """The four kernels on the queries q (at positions past, past + 1, ...) against every key k, v."""
    flags, batch, n_queries, n_heads = launch.flags, q.shape[0], q.shape[1], launch.n_heads
    scalars = (n_queries, launch.n_keys, n_heads, launch.d_head, launch.rank, past, launch.span, launch.scale)
    summed, one_head, pre, masks = launch.maps_kernels, launch.head_kernels, launch.pre_branches, launch.masks
    pre_qw1, pre_qw2, pre_kw1, pre_kw2, pre_qg, pre_kg, post_qw1, post_qw2, post_kw1, post_kw2, post_qg, post_kg = (
        _pointers(weights, q)
    )
    maps = q if maps is None else maps
    stats = torch.empty(2, batch, n_heads, n_queries, dtype=torch.float32, device=q.device).unbind()  # max, sum
    z = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    real = q if real is None else real
    tiles = (cdiv(launch.n_keys, summed["BK"]), cdiv(n_queries, summed["BQ"]), batch)
    heads = (n_heads, cdiv(n_queries, one_head["BQ"]), batch)
    if pre["QP"] or pre["KP"]:
        _run(
            _product_maps_kernel, tiles, summed, q, k, maps, pre_qw1, pre_kw1, *scalars, FIRST=0, QP=pre["QP"],
            KP=pre["KP"], HALF=flags["HALF"],
        )  # fmt: skip
    _run(
        _row_statistics_kernel, heads, one_head, q, k, maps, *stats, real, pre_qw2, pre_kw2, pre_qg, pre_kg,
        *scalars, **pre, **masks,
    )  # fmt: skip
    if flags["POST_QP"] or flags["POST_KP"]:
        _run(
            _post_maps_kernel, tiles, summed, q, k, maps, *stats, real, pre_qw2, pre_kw2, pre_qg, pre_kg, post_qw1,
            post_kw1, *scalars, **launch.post_maps, **masks,
        )  # fmt: skip
    _run(
        _head_output_kernel, heads, one_head, q, k, v, z, maps, *stats, real, pre_qw2, pre_kw2, pre_qg, pre_kg,
        post_qw2, post_kw2, post_qg, post_kg, *scalars, **launch.branches, **masks,
    )  # fmt: skip
    return z, *stats


def _backward_through_tiles(launch: _Launch, q, k, v, real, weights, row_max, row_sum, dz) -> tuple:
    """The gradients of q, k, v and of each dynamic weight (None for a weight that is None), by the tiles kernels."""
    float32 = dict(dtype=torch.float32, device=q.device)
    dq, dk, dv = (torch.zeros(x.shape, **float32) for x in (q, k, v))
    d_weights = [None if w is None else torch.zeros(w.shape, **float32) for w in weights]
    d_row = torch.empty(launch.batch, launch.n_heads, launch.n_queries, **float32)
    tensors = (q, k, v, dz.contiguous(), row_max, row_sum, d_row)
    real = q if real is None else real
    query_side = _pointers([d_weights[i] for i in QUERY_SIDE], dq)
    key_side = _pointers([d_weights[i] for i in KEY_SIDE], dk)
    grid = (cdiv(launch.n_queries, launch.block_queries), launch.batch)
    _backward_query_kernel[grid](
        *tensors, dq, real, *_pointers(weights, q), *query_side, *launch.scalars(), **launch.constants()
    )
    grid = (cdiv(launch.n_keys, launch.block_keys), launch.batch)
    _backward_key_kernel[grid](
        *tensors, dk, dv, real, *_pointers(weights, q), *key_side, *launch.scalars(), **launch.constants()
    )
    d_weights = [None if d is None else d.to(w.dtype) for d, w in zip(d_weights, weights, strict=True)]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *d_weights


def _backward_through_maps(launch: _Launch, q, k, v, real, weights, row_max, row_sum, dz) -> tuple:
    """The gradients of q, k, v and of each dynamic weight (None for a weight that is None), by the kernels through
    the maps, a chunk of queries at a time as the forward through the maps goes (its maps recomputed, bit for bit,
    beside their gradients: twice the forward's buffer in the same room, `maps_room`). The kernels store each
    gradient in its input's dtype; with several chunks, the key side's are added up in float32 buffers first."""
    n_queries, chunk = launch.n_queries, _chunk_of_queries(launch, q, buffers=2)
    maps = grads = q  # stand-ins, never read, where no branch has maps
    if _any_map(launch):
        shape = (launch.batch, 4 * launch.rank, min(chunk, n_queries), launch.n_keys)
        maps, grads = (torch.empty(shape, dtype=_maps_dtype(launch, q), device=q.device) for _ in range(2))
    add = chunk < n_queries  # several chunks: the key side's sums added up in float32 buffers
    key_inputs = (k, v, *(weights[i] for i in KEY_SIDE))
    if add:
        key_side = [
            None if x is None else torch.zeros(x.shape, dtype=torch.float32, device=q.device) for x in key_inputs
        ]
    else:
        key_side = [None if x is None else torch.empty_like(x) for x in key_inputs]
    dz = dz.contiguous()
    parts = []
    for first in range(0, n_queries, chunk):
        last = min(first + chunk, n_queries)
        part, rows, statistics = weights, (q, dz), (row_max, row_sum)
        if add:
            part = _query_rows(weights, first, last)
            rows = (q[:, first:last].contiguous(), dz[:, first:last].contiguous())
            statistics = (row_max[..., first:last].contiguous(), row_sum[..., first:last].contiguous())
        parts.append(
            _maps_backward_launches(
                launch, *rows, k, v, real, part, *statistics, maps, grads, key_side, add, launch.past + first
            )
        )
    query_side = parts[0]
    if add:
        query_side = [None if d[0] is None else torch.cat(d, dim=1) for d in zip(*parts, strict=True)]
        key_side = [None if d is None else d.to(x.dtype) for d, x in zip(key_side, key_inputs, strict=True)]
    d_weights = [None] * len(weights)
    for index, i in enumerate(QUERY_SIDE):
        d_weights[i] = query_side[1 + index]
    for index, i in enumerate(KEY_SIDE):
        d_weights[i] = key_side[2 + index]
    return query_side[0], key_side[0], key_side[1], *d_weights


def _maps_backward_launches(
    launch: _Launch, q, dz, k, v, real, weights, row_max, row_sum, maps, grads, key_side, add, past
) -> list:
    """The backward's kernels on the queries q (at positions past, past + 1, ...) against every key: dq and the
    query-side weights' gradients returned ([dq, *QUERY_SIDE's], in their dtypes), dk, dv and the key side's
    (`key_side`: [dk, dv, *KEY_SIDE's]) stored, or with `add` added into their float32 buffers."""
    flags, batch, n_queries, n_heads = launch.flags, q.shape[0], q.shape[1], launch.n_heads
    float32 = dict(dtype=torch.float32, device=q.device)
    scalars = (n_queries, launch.n_keys, n_heads, launch.d_head, launch.rank, past, launch.span, launch.scale)
    summed = launch.maps_kernels  # the maps as the forward computed them
    gradient, key_gradient = launch.gradient_kernels, launch.key_gradient_kernels
    both, masks = launch.branches, launch.masks
    pointers = _pointers(weights, q)
    pre_qw1, pre_qw2, pre_kw1, pre_kw2, pre_qg, pre_kg, post_qw1, post_qw2, post_kw1, post_kw2, post_qg, post_kg = (
        pointers
    )
    real = q if real is None else real
    row_d = torch.empty(batch, n_heads, n_queries, **float32)
    dq = torch.empty_like(q)
    d_query_side = [None if weights[i] is None else torch.empty_like(weights[i]) for i in QUERY_SIDE]
    dk, dv, *d_key_side = key_side
    tiles = (cdiv(launch.n_keys, summed["BK"]), cdiv(n_queries, summed["BQ"]), batch)
    gradient_tiles = (cdiv(launch.n_keys, gradient["BK"]), cdiv(n_queries, gradient["BQ"]), batch)
    heads = (n_heads, cdiv(n_queries, gradient["BQ"]), batch)
    key_heads = (n_heads, cdiv(launch.n_keys, key_gradient["BK"]), batch)
    statistics = (row_max, row_sum, row_d, real)
    if _any_map(launch, ("PRE",)):
        _run(
            _product_maps_kernel, tiles, summed, q, k, maps, pre_qw1, pre_kw1, *scalars, FIRST=0,
            QP=flags["PRE_QP"], KP=flags["PRE_KP"], HALF=flags["HALF"],
        )  # fmt: skip
    if _any_map(launch, ("POST",)):
        _run(
            _post_maps_kernel, tiles, summed, q, k, maps, row_max, row_sum, real, pre_qw2, pre_kw2, pre_qg, pre_kg,
            post_qw1, post_kw1, *scalars, **launch.post_maps, **masks,
        )  # fmt: skip
        _run(
            _product_maps_kernel, tiles, summed, dz, v, grads, post_qw2, post_kw2, *scalars[:-1], 1.0,
            FIRST=2 * launch.rank, QP=flags["POST_QP"], KP=flags["POST_KP"], HALF=flags["HALF"],
        )  # fmt: skip
    gradients = (pre_qw2, pre_kw2, pre_qg, pre_kg, post_qw1, post_kw1, post_qg, post_kg)
    _run(
        _row_gradient_kernel, heads, gradient, q, k, v, dz, maps, grads, *statistics, *gradients, *scalars, **both,
        **masks,
    )  # fmt: skip
    if _any_map(launch, ("PRE",)):
        _run(
            _pre_gradient_maps_kernel, gradient_tiles, gradient, q, k, v, dz, maps, grads, *statistics, *gradients,
            *scalars, **both, **masks,
        )  # fmt: skip
    _run(
        _head_query_gradient_kernel, heads, gradient, q, k, v, dz, maps, grads, *statistics, *pointers, dq,
        *_pointers(d_query_side, dq), *scalars, **both, **masks,
    )  # fmt: skip
    _run(
        _head_key_gradient_kernel, key_heads, key_gradient, q, k, v, dz, maps, grads, *statistics, *pointers, dk, dv,
        *_pointers(d_key_side, dk), *scalars, **both, **masks, ADD=add,
    )  # fmt: skip
    return [dq, *d_query_side]


_FORWARDS = {"maps": _forward_through_maps, "tiles": _forward}
# with gradients: each backward and the forward whose row statistics it recomputes with, bit for bit
_BACKWARDS = {"maps": (_forward_through_maps, _backward_through_maps), "tiles": (_forward, _backward_through_tiles)}


class FusedDCMHA(torch.autograd.Function):
    """z of DCMHA whose backward is the fused kernels': the forward saves the inputs and the row statistics only.
    Where the kernels cannot give the gradients (second derivatives; Triton refusing to build the backward's kernels
    for the card) the backward calls `fallback` (`fused_dcmha`'s), or raises without one."""

    @staticmethod
    def forward(ctx, launch: _Launch, backward: str, fallback, q, k, v, real, *weights):
        forward, ctx.backward = _BACKWARDS[backward]
        z, row_max, row_sum = forward(launch, q, k, v, real, weights)
        ctx.launch, ctx.fallback = launch, fallback
        ctx.save_for_backward(q, k, v, real, row_max, row_sum, *weights)
        return z

    @staticmethod
    def backward(ctx, dz):
        q, k, v, real, row_max, row_sum, *weights = ctx.saved_tensors
        if torch.is_grad_enabled():
            if ctx.fallback is None:
                raise RuntimeError(
                    "the fused Triton DCMHA has no second derivatives (create_graph=True): use the materialised path"
                )
            gradients = ctx.fallback(None, dz, q, k, v, weights)
        else:
            try:
                gradients = ctx.backward(ctx.launch, q, k, v, real, weights, row_max, row_sum, dz)
            except (OutOfResources, CompilationError) as refusal:  # the card's limits, not a bug
                if ctx.fallback is None:
                    raise
                gradients = ctx.fallback(refusal, dz, q, k, v, weights)
        dq, dk, dv, *d_weights = gradients
        return None, None, None, dq, dk, dv, None, *d_weights


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
    backward: Literal["maps", "tiles"] | None = None,
    map_blocks: tuple[int, int] | None = None,
    fallback: Fallback | None = None,
) -> Float[Tensor, "b t h e"]:
    """z of DCMHA, differentiable in q, k, v and every dynamic weight (fused backward). s = past + t.

    pre, post: each stage's dynamic weights (qw1, qw2, kw1, kw2, qg, kg), or None for a stage that is off; any member
    None for a branch that is off. qw1, qw2: [b, t, r, h]; kw1, kw2: [b, s, r, h]; qg: [b, t, h]; kg: [b, s, h].
    window: a local layer's window (None: global), `official` for the "official-inference" semantics (window + 1
    keys). real: False at padded keys (a query always sees itself). blocks: queries and keys of a tile and the chunk
    of the head dim for the tiles kernels, powers of two of at least 16. forward: which forward computes z when no
    gradient is needed ("maps", the faster, or "tiles"). backward: which kernels compute the gradients ("maps" or
    "tiles"; None: `BACKWARD`), each with the forward of the same name (this module's docstring). map_blocks: queries
    and keys of a tile of the kernels through the maps (None: MAPS_KERNELS' and HEAD_KERNELS'). fallback: what the
    backward takes where the kernels cannot, `fallback(refusal, dz, q, k, v, weights)` giving the gradients of q, k,
    v and of the twelve weights (pre's then post's, None for those that are None or want none): under
    create_graph=True (second derivatives; refusal None) and where Triton refuses to build the backward's kernels
    for the card (refusal its error, raised at their first launch). Without one those raise: the materialised path
    (`dcinterp.dcmha.materialised.attend`) gives second derivatives; dcinterp's dispatch falls back on it."""
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
    backward = BACKWARD if backward is None else backward
    launch = _launch_for(q, k, v, weights, past, real, window, official, blocks, forward, backward, map_blocks)
    if real is not None:
        real = real.to(device=q.device, dtype=torch.int8).contiguous()
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, *weights)):
        return FusedDCMHA.apply(launch, backward, fallback, q, k, v, real, *weights)
    return _FORWARDS[forward](launch, q, k, v, real, weights)[0]


_launches: dict[tuple, _Launch] = {}  # the calls' launches by their arguments' signature, each checked once


def _launch_for(q, k, v, weights, past, real, window, official, blocks, forward, backward, map_blocks) -> _Launch:
    """The call's `_Launch`, its arguments checked (`_check`) the first time their shapes, dtypes and devices are
    seen: a layer called again with the same shapes (every layer of a forward, every forward of a sweep) spends the
    host neither the checks nor the launch's settings again. The launch settings (`MAPS_KERNELS`, ...) are read when
    a signature is first seen: a sweep changing them clears `_launches`."""
    tensors = signature(q, k, v, real, *weights)
    key = (tensors, past, window, official, tuple(blocks), forward, backward, map_blocks and tuple(map_blocks))

    def checked() -> _Launch:
        _check(q, k, v, weights, past, real, window, blocks, forward, backward, map_blocks)
        return _Launch(q, k, weights, window, official, past, real, blocks, map_blocks)

    return checked_once(_launches, key, checked)


def _check(q, k, v, weights, past, real, window, blocks, forward, backward, map_blocks) -> None:
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
    ranks = {w.shape[2] for w in weights if w is not None and w.ndim == 4}
    if len(ranks) > 1:
        raise ValueError(f"fused_dcmha: every projection weight must have one rank (got ranks {sorted(ranks)})")
    r, s = max(ranks.pop() if ranks else 1, 1), past + t
    shapes = dict(qw1=(b, t, r, h), qw2=(b, t, r, h), kw1=(b, s, r, h), kw2=(b, s, r, h), qg=(b, t, h), kg=(b, s, h))
    for stage, offset in (("pre", 0), ("post", 6)):
        for name, w in zip(BRANCHES, weights[offset : offset + 6], strict=True):
            if w is not None and w.shape != shapes[name]:
                raise ValueError(f"fused_dcmha: {stage} {name} must be {list(shapes[name])} (got {list(w.shape)})")
        for first, second in ((0, 1), (2, 3)):
            if (weights[offset + first] is None) != (weights[offset + second] is None):
                raise ValueError(
                    f"fused_dcmha: {stage} {BRANCHES[first]} and {BRANCHES[second]} must be given together"
                )
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
    if backward not in _BACKWARDS:
        raise ValueError(f"fused_dcmha: backward must be one of {sorted(_BACKWARDS)} (got {backward!r})")
