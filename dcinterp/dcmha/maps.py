"""DCMHA fused in Triton kernels through the cross-head maps: the host side (launches, autograd Function, entry point).

The kernels, in `dcinterp.dcmha.maps_kernels` (the forward's) and `dcinterp.dcmha.maps_backward_kernels`, compute
the attention's forward and backward without any [b, h, t, s] tensor. One DCMHA layer, per batch row (t queries,
s keys, n/m heads, e head dim, r rank, scale = 1 / sqrt(e)):
    S[n, t, s] = scale q[t, n] . k[s, n]
    A = compose(S, pre),  P = softmax over the visible keys of A,  P' = compose(P, post)
    z[t, m] = sum_s P'[m, t, s] v[s, m]
    compose(X)[m, t, s] = X[m] (1 + qg[t, m] + kg[s, m]) + sum_r (sum_n X[n] qw1[t, r, n]) qw2[t, r, m]
                                                           + sum_r (sum_n X[n] kw1[s, r, n]) kw2[s, r, m]
The compose mixes heads only through rank-R maps of [queries, keys] that every head shares: hq[r] = sum_n qw1[t, r, n]
S[n] and hk[r] = sum_n kw1[s, r, n] S[n] before the softmax, gq[r] and gk[r] of P after it. With the maps kept in a
[b, 4R, chunk, s] buffer, each head is computed alone, FlashAttention's way.

Forward (`_forward_through_maps`), four kernels: `product_maps_kernel` (hq, hk per tile of queries x keys, the heads
summed), `row_statistics_kernel` (each head's softmax max and sum, online over the keys), `post_maps_kernel` (gq,
gk) and `head_output_kernel` (each head's probabilities, post-composed with the maps, times v). Backward
(`_backward_through_maps`, FlashAttention's recomputation): the forward's maps again, bit for bit, then the gradient
maps of the post-compose (`product_maps_kernel` on dz, v), D = sum_s P dP (`row_gradient_kernel`), the gradient maps
of the pre-compose (`pre_gradient_maps_kernel`), and each head's query side (`head_query_gradient_kernel`) and key
side (`head_key_gradient_kernel`). The backward recomputes what the forward computed, in the same order, so that the
row statistics the forward saved fit its recomputed scores bit for bit.

The maps, and in the backward their gradients, take at most `maps_room(q)` bytes, a multiple of the queries': a longer
prompt goes a chunk of queries at a time, so that memory grows with the prompt, not with its square, nor with the
heads. Nothing is summed by atomics and every loop runs in a fixed order, so the same inputs give the same bits.
float32 inputs multiply by 3xTF32 (about float32's precision, on the tensor cores), float16 / bfloat16 ones in their
own dtype; everything accumulates in float32. Second derivatives (`create_graph=True`) are not computed by the
kernels: the backward takes `fused_dcmha`'s `fallback`. What each kernel takes of a card (registers, spills, shared
memory) is read without one by benchmarks/kernel_resources.py.

Index names: b batch, t queries, s keys, h/m/n heads, e head dim, r rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from . import maps_backward_kernels as backward_kernels
from . import maps_kernels as kernels
from .jit import available, cdiv, checked_once, next_power_of_2, signature

try:
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources
except ImportError:  # dcinterp runs without triton: `available` says why the kernels cannot
    OutOfResources = CompilationError = ()  # (nothing to catch)

__all__ = ["FusedDCMHA", "available", "fused_dcmha", "maps_room"]

# The launch settings of the kernels that sum the maps over the heads (tiles of BQ queries by BK keys), of those of one
# head a program, and of the backward's own: the fastest of a sweep (docs/benchmarks.md, "The maps kernels' launch
# settings"). Above a head dim of 128 the key side's tiles of 32 queries spill (benchmarks/kernel_resources.py).
MAPS_KERNELS = dict(BQ=64, BK=32, num_warps=4, num_stages=3)
HEAD_KERNELS = dict(BQ=64, BK=32, num_warps=4, num_stages=2)
GRADIENT_KERNELS = dict(BQ=64, BK=32, num_warps=4, num_stages=2)
KEY_GRADIENT_KERNELS = dict(BQ=32, BK=64, num_warps=8, num_stages=2)
KEY_GRADIENT_KERNELS_WIDE_HEADS = dict(KEY_GRADIENT_KERNELS, BQ=16)
# The kernels hold at most MAPS_TIMES_QUERIES times the bytes of the call's queries q of maps at a time, so that the
# maps grow with the prompt, not with its square: never less than MAPS_MIN_BYTES (a short prompt's maps in one chunk,
# the fewest launches) nor more than MAPS_BYTES
MAPS_TIMES_QUERIES = 4
MAPS_MIN_BYTES = 32 * 2**20
MAPS_BYTES = 256 * 2**20
BRANCHES = ("qw1", "qw2", "kw1", "kw2", "qg", "kg")  # a stage's dynamic weights, in this order
QUERY_SIDE, KEY_SIDE = (0, 1, 4, 6, 7, 10), (2, 3, 5, 8, 9, 11)  # both stages' weights of [b, t, ...] and [b, s, ...]
# fallback(refusal, dz, q, k, v, weights) -> gradients of (q, k, v, *weights): `fused_dcmha`'s backward where its own
# kernels cannot give them
Fallback = Callable[[Exception | None, Tensor, Tensor, Tensor, Tensor, tuple], tuple]


class _Launch:
    """What every kernel of one call is given besides the tensors: shapes, the mask's past and span, which branches
    are on (the kernels' constexpr flags), the launch settings."""

    def __init__(self, q: Tensor, k: Tensor, weights: tuple, window, official, past, real, blocks):
        batch, self.n_queries, self.n_heads, self.d_head = q.shape
        self.batch, self.n_keys = batch, k.shape[1]
        self.past = past
        # query p sees key s when p - span < s <= p: a local window's span is its keys (one more for "official-
        # inference"); a global layer's is beyond every key
        self.span = window + int(official) if window is not None else self.n_keys + 1
        self.scale = self.d_head**-0.5
        ranks = {w.shape[2] for w, name in zip(weights, BRANCHES * 2, strict=True) if w is not None and name[1] == "w"}
        self.rank = ranks.pop() if ranks else 1
        self.flags = {
            f"{stage}_{branch}": weights[offset + index] is not None
            for stage, offset in (("PRE", 0), ("POST", 6))
            for branch, index in (("QP", 0), ("KP", 2), ("QG", 4), ("KG", 5))
        }
        self.flags["PADDING"] = real is not None
        self.flags["HALF"] = q.dtype != torch.float32
        # the constexpr arguments of the kernels through the maps, built once for all their launches of the call
        blocks_given = {} if blocks is None else dict(BQ=blocks[0], BK=blocks[1])
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


def key_gradient_kernels(d_head: int) -> dict:
    """The key side's launch settings at a head dim.

    Args:
        d_head: e.

    Returns:
        A copy of `KEY_GRADIENT_KERNELS`, or above 128 of `KEY_GRADIENT_KERNELS_WIDE_HEADS`.
    """
    return dict(KEY_GRADIENT_KERNELS_WIDE_HEADS if d_head > 128 else KEY_GRADIENT_KERNELS)


def _pointers(tensors, stand_in: Tensor) -> list[Tensor]:
    """The tensors, with `stand_in` for each that is None (the kernels never read a branch that is off)."""
    return [stand_in if w is None else w for w in tensors]


def _run(kernel, grid, settings: dict, *args, **constants) -> None:
    """kernel[grid](*args, **constants, **settings), `settings` a call's launch settings (BQ, BK, num_warps,
    num_stages, ...). Where the card's shared memory cannot hold the loads they pipeline (Triton's OutOfResources at
    the first launch: on a card of 99 KiB a block, the key side's, and more at a head dim of 256), the launch again
    without software pipelining, num_stages=1: the same arithmetic in the same order, its loads not prefetched.
    `settings` (the call's `_Launch`'s) keeps it, so that later calls of the same signature take it at once."""
    try:
        kernel[grid](*args, **constants, **settings)
    except OutOfResources:
        if settings["num_stages"] == 1:
            raise
        settings["num_stages"] = 1
        kernel[grid](*args, **constants, **settings)


def _chunk_of_queries(launch: _Launch, q: Tensor, buffers: int) -> int:
    """How many queries the kernels through the maps take at a time: `buffers` [b, 4R, chunk, s] buffers of maps in
    the room `maps_room` gives, a multiple of the blocks of queries (so that every tile, and every sum in it, is the
    same whatever the chunk)."""
    block_queries = max(launch.maps_kernels["BQ"], launch.head_kernels["BQ"], launch.gradient_kernels["BQ"])
    bytes_a_query = buffers * launch.batch * 4 * launch.rank * launch.n_keys * _maps_dtype(launch, q).itemsize
    return max(block_queries, maps_room(q) // bytes_a_query // block_queries * block_queries)


def maps_room(q: Tensor) -> int:
    """The bytes of maps (and, in the backward, of their gradients) the kernels hold at a time.

    Args:
        q: the call's queries.

    Returns:
        MAPS_TIMES_QUERIES times q's bytes, within MAPS_MIN_BYTES..MAPS_BYTES.
    """
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
            kernels.product_maps_kernel, tiles, summed, q, k, maps, pre_qw1, pre_kw1, *scalars, FIRST=0, QP=pre["QP"],
            KP=pre["KP"], HALF=flags["HALF"],
        )  # fmt: skip
    _run(
        kernels.row_statistics_kernel, heads, one_head, q, k, maps, *stats, real, pre_qw2, pre_kw2, pre_qg, pre_kg,
        *scalars, **pre, **masks,
    )  # fmt: skip
    if flags["POST_QP"] or flags["POST_KP"]:
        _run(
            kernels.post_maps_kernel, tiles, summed, q, k, maps, *stats, real, pre_qw2, pre_kw2, pre_qg, pre_kg,
            post_qw1, post_kw1, *scalars, **launch.post_maps, **masks,
        )  # fmt: skip
    _run(
        kernels.head_output_kernel, heads, one_head, q, k, v, z, maps, *stats, real, pre_qw2, pre_kw2, pre_qg, pre_kg,
        post_qw2, post_kw2, post_qg, post_kg, *scalars, **launch.branches, **masks,
    )  # fmt: skip
    return z, *stats


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
            kernels.product_maps_kernel, tiles, summed, q, k, maps, pre_qw1, pre_kw1, *scalars, FIRST=0,
            QP=flags["PRE_QP"], KP=flags["PRE_KP"], HALF=flags["HALF"],
        )  # fmt: skip
    if _any_map(launch, ("POST",)):
        _run(
            kernels.post_maps_kernel, tiles, summed, q, k, maps, row_max, row_sum, real, pre_qw2, pre_kw2, pre_qg,
            pre_kg, post_qw1, post_kw1, *scalars, **launch.post_maps, **masks,
        )  # fmt: skip
        _run(
            kernels.product_maps_kernel, tiles, summed, dz, v, grads, post_qw2, post_kw2, *scalars[:-1], 1.0,
            FIRST=2 * launch.rank, QP=flags["POST_QP"], KP=flags["POST_KP"], HALF=flags["HALF"],
        )  # fmt: skip
    gradients = (pre_qw2, pre_kw2, pre_qg, pre_kg, post_qw1, post_kw1, post_qg, post_kg)
    _run(
        backward_kernels.row_gradient_kernel, heads, gradient, q, k, v, dz, maps, grads, *statistics, *gradients,
        *scalars, **both, **masks,
    )  # fmt: skip
    if _any_map(launch, ("PRE",)):
        _run(
            backward_kernels.pre_gradient_maps_kernel, gradient_tiles, gradient, q, k, v, dz, maps, grads, *statistics,
            *gradients, *scalars, **both, **masks,
        )  # fmt: skip
    _run(
        backward_kernels.head_query_gradient_kernel, heads, gradient, q, k, v, dz, maps, grads, *statistics, *pointers,
        dq, *_pointers(d_query_side, dq), *scalars, **both, **masks,
    )  # fmt: skip
    _run(
        backward_kernels.head_key_gradient_kernel, key_heads, key_gradient, q, k, v, dz, maps, grads, *statistics,
        *pointers, dk, dv, *_pointers(d_key_side, dk), *scalars, **both, **masks, ADD=add,
    )  # fmt: skip
    return [dq, *d_query_side]


class FusedDCMHA(torch.autograd.Function):
    """z of DCMHA whose backward is the kernels': the forward saves the inputs and the row statistics only.
    Where the kernels cannot give the gradients (second derivatives; Triton refusing to build the backward's kernels
    for the card) the backward calls `fallback` (`fused_dcmha`'s), or raises without one."""

    @staticmethod
    def forward(ctx, launch: _Launch, fallback, q, k, v, real, *weights):
        z, row_max, row_sum = _forward_through_maps(launch, q, k, v, real, weights)
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
                gradients = _backward_through_maps(ctx.launch, q, k, v, real, weights, row_max, row_sum, dz)
            except (OutOfResources, CompilationError) as refusal:  # the card's limits, not a bug
                if ctx.fallback is None:
                    raise
                gradients = ctx.fallback(refusal, dz, q, k, v, weights)
        dq, dk, dv, *d_weights = gradients
        return None, None, dq, dk, dv, None, *d_weights


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
    blocks: tuple[int, int] | None = None,
    fallback: Fallback | None = None,
) -> Float[Tensor, "b t h e"]:
    """z of DCMHA through the cross-head maps, differentiable in q, k, v and every dynamic weight.

    Index names: b batch, t queries, s = past + t keys, h heads, e head dim, r rank.

    Args:
        q: the queries [b, t, h, e], float32, float16 or bfloat16.
        k: the keys [b, s, h, e], in q's dtype.
        v: the values [b, s, h, e], in q's dtype.
        pre: the pre-compose's dynamic weights (qw1, qw2 [b, t, r, h], kw1, kw2 [b, s, r, h], qg [b, t, h],
            kg [b, s, h]), any of them None for a branch that is off; None for a stage that is off.
        post: the post-compose's, the same.
        window: a local layer's window; None for a global layer.
        official: the "official-inference" semantics (window + 1 keys).
        past: the cached positions before the queries.
        real: [b, s], False at padded keys (a query always sees itself).
        blocks: queries and keys of a tile, powers of two of at least 16; None: the launch settings'.
        fallback: what the backward takes where the kernels cannot: `fallback(refusal, dz, q, k, v, weights)` gives
            the gradients of q, k, v and of the twelve weights (pre's then post's, None for those that are None or
            want none), under create_graph=True (refusal None) and where Triton refuses to build the backward's
            kernels for the card (refusal its error). The materialised formula (`dcinterp.dcmha.materialised.attend`)
            gives them in the model's Triton path.

    Returns:
        z [b, t, h, e], in q's dtype.

    Raises:
        RuntimeError: the kernels cannot run on q's device (`available`); or, without a fallback, second derivatives
            were asked.
        ValueError: an argument's shape, dtype or device, named.
    """
    reason = available(q.device)
    if reason is not None:
        raise RuntimeError(f"fused_dcmha: {reason}")
    kernels.jit()
    backward_kernels.jit()
    for name, stage in (("pre", pre), ("post", post)):
        if stage is not None and len(stage) != 6:
            raise ValueError(
                f"fused_dcmha: {name} must be (qw1, qw2, kw1, kw2, qg, kg) or None (got {len(stage)} items)"
            )
    weights = tuple(None if w is None else w.contiguous() for w in (*(pre or (None,) * 6), *(post or (None,) * 6)))
    launch = _launch_for(q, k, v, weights, past, real, window, official, blocks)
    if real is not None:
        real = real.to(device=q.device, dtype=torch.int8).contiguous()
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, *weights)):
        return FusedDCMHA.apply(launch, fallback, q, k, v, real, *weights)
    return _forward_through_maps(launch, q, k, v, real, weights)[0]


_launches: dict[tuple, _Launch] = {}  # the calls' launches by their arguments' signature, each checked once


def _launch_for(q, k, v, weights, past, real, window, official, blocks) -> _Launch:
    """The call's `_Launch`, its arguments checked (`_check`) the first time their shapes, dtypes and devices are
    seen: a layer called again with the same shapes (every layer of a forward, every forward of a sweep) spends the
    host neither the checks nor the launch's settings again. The launch settings (`MAPS_KERNELS`, ...) are read when
    a signature is first seen: a sweep changing them clears `_launches`."""
    key = (signature(q, k, v, real, *weights), past, window, official, blocks and tuple(blocks))

    def checked() -> _Launch:
        _check(q, k, v, weights, past, real, window, blocks)
        return _Launch(q, k, weights, window, official, past, real, blocks)

    return checked_once(_launches, key, checked)


def _check(q, k, v, weights, past, real, window, blocks) -> None:
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
    if blocks is not None and (len(blocks) != 2 or any(n < 16 or n & (n - 1) for n in blocks)):
        raise ValueError(f"fused_dcmha: blocks must be two powers of two of at least 16 (got {blocks})")
