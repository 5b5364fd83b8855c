"""DCMHA in blocks of queries: the no-hook path of `Attention` on a CPU (docs/hooked-model.md#speed-the-blocked-path).

Every step of DCMHA is independent across query rows once the keys are known: the scores of a block of queries,
its pre-compose, the mask, the softmax, the post-compose and `P V` need only that block's rows and the keys those
rows see. So the attention runs one block of queries at a time, in a layout where the head axis sits between the
query and the key axes, `[query, head, key]`:
- the query-side maps (skip, `qg` gate and the `qw1`/`qw2` projection of a query make one H x H map per query,
  `W[t] = I + diag(qg[t]) + qw2[t]^T qw1[t]`) are one batched matmul over the block's queries;
- the key-side branches (`kg`, `kw1`/`kw2`, one map per key) are broadcast multiply-adds over contiguous keys, in
  their low-rank form (the key-side weights are kept key-last, `[rank, head, key]`, as the key-value cache holds
  them);
- a block reads only the keys its queries may see: keys after the block's last query, and keys before a local
  window, are never computed (their pattern is exactly 0, and the compose mixes heads per (query, key) pair, so a
  hidden pair only ever feeds itself);
- a block's `[query, head, key]` tiles stay in cache, and the forward never holds `[b, h, t, s]`;
- with several torch threads, the blocks are shared among as many Python threads, each running its ops on one
  core (`each_block`), rather than every small op being split across the cores.

Gradients come from one `torch.autograd.Function` for the whole attention: its forward keeps only q, k, v and the
dynamic weights, and its backward recomputes each block and applies the transposed maps (no per-branch tensor is
saved). Under `create_graph=True` (second derivatives) the backward instead reruns the blocks under autograd, so
that its gradients can be differentiated again. The result equals `Compose`'s materialised path up to float
rounding (tests/test_blocked.py).

Index names: b batch, t queries, s keys, h/m/n heads, e head dim, r rank.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

from .inputs import AttentionInputs

TILE_ELEMENTS = 1 << 19  # a block's (query, head, key) entries, at most (2 MiB in float32)
MIN_BLOCK, MAX_BLOCK = 16, 512  # queries per block


@dataclass(frozen=True)
class Plan:
    """Which keys each query sees, and which queries make a block.

    Attributes:
        past: cached positions before the first query (queries are positions past .. past + n - 1, keys 0 ..).
        window: a local layer's window; None for a global layer.
        extra: 1 for the "official-inference" semantics (window + 1 keys), else 0.
        scale: 1 / sqrt(d_head).
        area: a block's queries x keys, at most (per head), unless that leaves fewer than min_block queries.
        min_block: queries in a block, at least.
        max_block: queries in a block, at most.
    """

    past: int
    window: int | None
    extra: int
    scale: float
    area: int
    min_block: int = 1
    max_block: int = MAX_BLOCK

    def first_key(self, t: int) -> int:
        """The first key query t (of this input) may see."""
        return 0 if self.window is None else max(0, self.past + t - self.window + 1 - self.extra)

    def blocks(self, n_queries: int):
        """(t0, t1, s0, s1): queries t0 .. t1 - 1 (of this input) see keys within s0 .. s1 - 1 (of all keys).

        A block of b queries from t0 sees b + c keys, c = past + t0 - s0: the largest b with b (b + c) <= area
        (under causal masking the early blocks of a global layer are the wide ones)."""
        t0 = 0
        while t0 < n_queries:
            s0 = self.first_key(t0)
            c = self.past + t0 - s0
            rows = int((math.sqrt(c * c + 4 * self.area) - c) / 2)
            t1 = min(n_queries, t0 + max(self.min_block, min(self.max_block, rows)))
            yield t0, t1, s0, self.past + t1
            t0 = t1


def plan(n_heads: int, d_head: int, past: int, window: int | None, official: bool) -> Plan:
    """The blocks for one attention call: tiles of about TILE_ELEMENTS (query, head, key) entries.

    Args:
        n_heads: h.
        d_head: e.
        past: cached positions before the queries.
        window: a local layer's window; None for a global layer.
        official: the "official-inference" semantics (window + 1 keys).

    Returns:
        The call's `Plan`.
    """
    extra = int(official and window is not None)
    return Plan(past, window, extra, d_head**-0.5, TILE_ELEMENTS // n_heads, MIN_BLOCK, MAX_BLOCK)


def query_map(qw1: Tensor | None, qw2: Tensor | None, qg: Tensor | None, n_heads: int) -> Tensor | None:
    """A query's skip, gate and projection branches as one map, `I + diag(qg[t]) + qw2[t]^T qw1[t]`.

    Args:
        qw1: the query-side projection's first weights [b, t, r, h], None with the branch off.
        qw2: its second weights [b, t, r, h].
        qg: the query-side gate [b, t, h], None with the branch off.
        n_heads: h.

    Returns:
        W [b, t, h, h] with out[m] = sum_n W[t, m, n] x[n]; None with neither branch (the skip alone).
    """
    if qw1 is None and qg is None:
        return None
    if qg is not None:
        W = torch.diag_embed(1 + qg)
    else:
        W = torch.eye(n_heads, dtype=qw1.dtype, device=qw1.device).expand(*qw1.shape[:2], -1, -1)
    if qw1 is not None:
        W = W + torch.einsum("btrm,btrn->btmn", qw2, qw1)
    return W


def compose(
    x: Float[Tensor, "t h s"], W: Tensor | None, kw1: Tensor | None, kw2: Tensor | None, kg: Tensor | None
) -> tuple[Float[Tensor, "t h s"], list[Tensor]]:
    """One compose stage on a block: W[t] x[t] + x kg + sum_r (sum_n x kw1[r]) kw2[r].

    Args:
        x: the block's scores or pattern [t, h, s].
        W: the block's query maps [t, h, h] (`query_map`), None for the skip alone.
        kw1: the key-side projection's first weights [r, h, s], None with the branch off.
        kw2: its second weights [r, h, s].
        kg: the key-side gate [h, s], None with the branch off.

    Returns:
        The composed block [t, h, s], and the hidden sums (sum_n x kw1[r], [t, 1, s] each) the backward reuses.
    """
    y = torch.bmm(W, x) if W is not None else x.clone(memory_format=torch.contiguous_format)
    if kg is not None:
        y.addcmul_(x, kg)
    hidden = []
    if kw1 is not None:
        for r in range(kw1.shape[0]):
            hidden.append((x * kw1[r]).sum(1, keepdim=True))
            y.addcmul_(hidden[-1], kw2[r])
    return y, hidden


def compose_backward(
    gy: Tensor, x: Tensor, W, kw1, kw2, kg, hidden: list[Tensor], want_W: bool, key_grads: dict, keys: slice
) -> tuple[Tensor, Tensor | None]:
    """The gradients through `compose` of one block.

    Args:
        gy: the gradient of `compose`'s output [t, h, s].
        x: its input [t, h, s].
        W: its query maps, or None.
        kw1: its key-side weights, or None.
        kw2: the same.
        kg: the same.
        hidden: the hidden sums `compose` returned.
        want_W: whether W's gradient is wanted.
        key_grads: the key side's gradients (name -> [r, h, all keys] or [h, all keys], float32), into which this
            block's are added at `keys`.
        keys: the block's keys among all keys.

    Returns:
        x's gradient, and W's (None unless `want_W`).
    """
    gx = torch.bmm(W.transpose(1, 2), gy) if W is not None else gy.clone(memory_format=torch.contiguous_format)
    gW = torch.bmm(gy, x.transpose(1, 2)) if W is not None and want_W else None
    if kg is not None:
        gx.addcmul_(gy, kg)
        if "kg" in key_grads:
            key_grads["kg"][:, keys] += (gy * x).sum(0)
    if kw1 is not None:
        for r in range(kw1.shape[0]):
            g_hidden = (gy * kw2[r]).sum(1, keepdim=True)
            gx.addcmul_(g_hidden, kw1[r])
            if "kw2" in key_grads:
                key_grads["kw2"][r, :, keys] += (gy * hidden[r]).sum(0)
            if "kw1" in key_grads:
                key_grads["kw1"][r, :, keys] += (x * g_hidden).sum(0)
    return gx, gW


def _stage(weights: tuple, bi: int, t0: int, t1: int, s0: int, s1: int) -> tuple:
    """A stage's weights (W, kw1, kw2, kg) for batch row bi, queries t0 .. t1 - 1, keys s0 .. s1 - 1."""
    W, kw1, kw2, kg = weights
    return (
        None if W is None else W[bi, t0:t1],
        None if kw1 is None else kw1[bi, :, :, s0:s1],
        None if kw2 is None else kw2[bi, :, :, s0:s1],
        None if kg is None else kg[bi, :, s0:s1],
    )


def _mask_block(mask: Tensor, bi: int, t0: int, t1: int, s0: int, s1: int) -> Tensor:
    """The additive mask of a block, [t, 1, s] (the mask is [t, s], or [b, 1, t, s] with padding)."""
    return (mask[t0:t1, s0:s1] if mask.ndim == 2 else mask[bi, 0, t0:t1, s0:s1])[:, None]


def _attend_block(qh, kh, vh, mask, pre, post, bi, t0, t1, s0, s1):
    """The forward of one block, [t, h, s] each: the scores A, the pattern P, the composed pattern D, and the
    hidden sums of both compose stages."""
    A = torch.bmm(qh[bi, :, t0:t1], kh[bi, :, s0:s1].transpose(1, 2)).transpose(0, 1)  # q pre-scaled
    C, hidden_pre = compose(A, *_stage(pre, bi, t0, t1, s0, s1))
    C += _mask_block(mask, bi, t0, t1, s0, s1)
    P = C.softmax(-1)
    D, hidden_post = compose(P, *_stage(post, bi, t0, t1, s0, s1))
    return A, P, D, hidden_pre, hidden_post


def each_block(work, blocks: list, threads: int) -> None:
    """work(k, block) for every block: in turn (k = 0), or on `threads` Python threads, each op on one core.

    The blocks are independent and their ops small: a core per block keeps each tile in that core's cache and
    spares the cores a barrier at every op (which a machine busy with other work makes slow). The blocks a thread
    takes depend on the number of threads only, so results are the same from run to run.

    Args:
        work: called as work(k, block), k the thread.
        blocks: the blocks, in order.
        threads: with more than one (and more than one block), thread k takes blocks k, k + threads, ...
    """
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def run(k: int, mine: list) -> None:
        # Grad and inference modes are per thread: a worker takes the caller's. Autocast stays off: the blocks
        # compute in float32 (or float64) whatever the caller's autocast.
        with torch.inference_mode(inference), torch.set_grad_enabled(grad), torch.autocast("cpu", enabled=False):
            for block in mine:
                work(k, block)

    if threads <= 1 or len(blocks) <= 1:
        run(0, blocks)
        return
    torch.set_num_threads(1)  # what threads that start now run their ops on (torch reads it per thread)
    try:
        with ThreadPoolExecutor(threads) as pool:
            for future in [pool.submit(run, k, blocks[k::threads]) for k in range(threads)]:
                future.result()
    finally:
        torch.set_num_threads(threads)


def _blocks(plan: Plan, batch: int, n_queries: int) -> list[tuple[int, int, int, int, int]]:
    """(batch row, t0, t1, s0, s1) of every block."""
    return [(bi, *block) for bi in range(batch) for block in plan.blocks(n_queries)]


def _forward(qh, kh, vh, mask, pre, post, plan: Plan, threads: int | None = None) -> Float[Tensor, "b h t e"]:
    b, h, n, e = qh.shape
    z = qh.new_empty(b, h, n, e)

    def work(_, block):
        bi, t0, t1, s0, s1 = block
        D = _attend_block(qh, kh, vh, mask, pre, post, *block)[2]
        z[bi, :, t0:t1] = torch.bmm(D.transpose(0, 1), vh[bi, :, s0:s1])

    each_block(work, _blocks(plan, b, n), torch.get_num_threads() if threads is None else threads)
    return z


class BlockedDCMHA(torch.autograd.Function):
    """z = DCMHA(q, k, v) with a backward that recomputes each block (see the module docstring)."""

    @staticmethod
    def forward(ctx, qh, kh, vh, mask, plan, *weights):
        pre, post = weights[:4], weights[4:]
        ctx.plan = plan
        ctx.save_for_backward(qh, kh, vh, mask, *weights)
        with torch.no_grad():
            return _forward(qh, kh, vh, mask, pre, post, plan)

    @staticmethod
    def backward(ctx, gz):
        qh, kh, vh, mask, *weights = ctx.saved_tensors
        pre, post = tuple(weights[:4]), tuple(weights[4:])
        needs = ctx.needs_input_grad  # (qh, kh, vh, mask, plan, *pre, *post)
        if torch.is_grad_enabled():  # create_graph=True: second derivatives, through the blocks' own autograd
            return _differentiable_backward(ctx.plan, gz, qh, kh, vh, mask, weights, needs)
        b, h, n, e = qh.shape
        blocks = _blocks(ctx.plan, b, n)
        threads = torch.get_num_threads() if len(blocks) > 1 else 1
        gq = torch.zeros_like(qh) if needs[0] else None
        W_grads = [torch.zeros_like(stage[0]) if needs[first] else None for stage, first in ((pre, 5), (post, 9))]

        def summed():
            """What blocks add up, at every key (a copy per thread, added at the end in a fixed order)."""
            out = {"k": torch.zeros_like(kh) if needs[1] else None, "v": torch.zeros_like(vh) if needs[2] else None}
            for stage, first, name in ((pre, 5, "pre"), (post, 9, "post")):
                wanted = {key: w for i, (key, w) in enumerate(zip(NAMES, stage, strict=True)) if i and needs[first + i]}
                out[name] = {key: torch.zeros_like(w) for key, w in wanted.items()}
            return out

        sums = [summed() for _ in range(threads)]

        def work(thread, block):
            bi, t0, t1, s0, s1 = block
            acc, keys = sums[thread], slice(s0, s1)
            A, P, D, hidden_pre, hidden_post = _attend_block(qh, kh, vh, mask, pre, post, *block)
            gzb = gz[bi, :, t0:t1]  # [h, t, e]
            if acc["v"] is not None:
                acc["v"][bi, :, keys] += torch.bmm(D.permute(1, 2, 0), gzb)
            gD = torch.bmm(gzb, vh[bi, :, keys].transpose(1, 2)).transpose(0, 1)  # [t, h, s]
            post_key_grads = {key: g[bi] for key, g in acc["post"].items()}
            gP, gW = compose_backward(
                gD, P, *_stage(post, *block), hidden_post, W_grads[1] is not None, post_key_grads, keys
            )
            if gW is not None:
                W_grads[1][bi, t0:t1] = gW
            gC = torch._softmax_backward_data(gP, P, -1, P.dtype)
            pre_key_grads = {key: g[bi] for key, g in acc["pre"].items()}
            gA, gW = compose_backward(
                gC, A, *_stage(pre, *block), hidden_pre, W_grads[0] is not None, pre_key_grads, keys
            )
            if gW is not None:
                W_grads[0][bi, t0:t1] = gW
            gA = gA.transpose(0, 1)  # [h, t, s]
            if gq is not None:
                gq[bi, :, t0:t1] = torch.bmm(gA, kh[bi, :, keys])
            if acc["k"] is not None:
                acc["k"][bi, :, keys] += torch.bmm(gA.transpose(1, 2), qh[bi, :, t0:t1])

        each_block(work, blocks, threads)
        total = sums[0]
        for other in sums[1:]:
            for key in ("k", "v"):
                if total[key] is not None:
                    total[key] += other[key]
            for name in ("pre", "post"):
                for key, g in total[name].items():
                    g += other[name][key]
        stage_grads = [
            (W_grads[i], *(total[name].get(key) for key in NAMES[1:])) for i, name in enumerate(("pre", "post"))
        ]
        return gq, total["k"], total["v"], None, None, *stage_grads[0], *stage_grads[1]


NAMES = ("W", "kw1", "kw2", "kg")  # a stage's weights, in the order BlockedDCMHA takes them


def _differentiable_backward(plan: Plan, gz, qh, kh, vh, mask, weights, needs) -> tuple:
    """The gradients as BlockedDCMHA.backward returns them, computed so that they can be differentiated again
    (`torch.autograd.grad(..., create_graph=True)`, Hessian-vector products): the forward's blocks rerun under
    autograd, one at a time, and torch's own backward of them. It costs what the materialised path costs."""
    inputs = (qh, kh, vh, mask, None, *weights)
    wanted = [i for i, needed in enumerate(needs) if needed and inputs[i] is not None]
    with torch.enable_grad():
        z = _forward(qh, kh, vh, mask, tuple(weights[:4]), tuple(weights[4:]), plan, threads=1)
        grads = torch.autograd.grad(z, [inputs[i] for i in wanted], gz, create_graph=True, allow_unused=True)
    out = [None] * len(inputs)
    for i, g in zip(wanted, grads, strict=True):
        out[i] = g if g is not None else torch.zeros_like(inputs[i])
    return tuple(out)


def blocked_dcmha(
    q: Float[Tensor, "b t h e"],
    k: Float[Tensor, "b s h e"],
    v: Float[Tensor, "b s h e"],
    mask: Tensor,
    pre: tuple[Tensor | None, ...],
    post: tuple[Tensor | None, ...],
    plan: Plan,
) -> Float[Tensor, "b t h e"]:
    """z of DCMHA a block of queries at a time, without the [b, h, t, s] tensors.

    Args:
        q: the queries [b, t, h, e], after rotary.
        k: the keys [b, s, h, e] of every key, cached ones first.
        v: the values [b, s, h, e].
        mask: additive, [t, s] or [b, 1, t, s].
        pre: the pre-compose's (W [b, t, h, h] from `query_map`, kw1, kw2 [b, r, h, s], kg [b, h, s]), None for a
            branch that is off.
        post: the post-compose's, the same.
        plan: the blocks (`plan`).

    Returns:
        z [b, t, h, e] in q's dtype.
    """
    # float16 and bfloat16 are computed in float32: on a CPU their matmuls are far slower than float32's, and the
    # materialised path's rounding at every step is then not repeated (tests/test_blocked.py: closer to float32).
    dtype = torch.promote_types(q.dtype, torch.float32)
    qh = (q.to(dtype) * plan.scale).transpose(1, 2).contiguous()  # [b, h, t, e], scaled: A is one matmul
    kh = k.to(dtype).transpose(1, 2).contiguous()
    vh = v.to(dtype).transpose(1, 2).contiguous()
    mask = mask.to(dtype)
    pre, post = (tuple(None if w is None else w.to(dtype) for w in stage) for stage in (pre, post))
    weights = (*pre, *post)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (qh, kh, vh, *weights)):
        z = BlockedDCMHA.apply(qh, kh, vh, mask, plan, *weights)
    else:
        z = _forward(qh, kh, vh, mask, pre, post, plan)
    return z.transpose(1, 2).to(q.dtype)


def blocked_z(inputs: AttentionInputs) -> Float[Tensor, "b t h e"]:
    """z of DCMHA a block of queries at a time: the blocked path.

    Args:
        inputs: the call's inputs; each stage's query side becomes one map per query (`query_map`), its key side
            is taken key-last.

    Returns:
        z [b, t, h, e] in q's dtype, equal to the materialised path's up to float rounding.
    """
    n_heads, d_head = inputs.q.shape[2:]
    stages = []
    for stage in inputs.stages(key_last=True):
        if stage is None:
            stages.append((None, None, None, None))
            continue
        qw1, qw2, kw1, kw2, qg, kg = stage
        W = query_map(qw1, qw2, qg, n_heads)
        stages.append((W, *(None if w is None else w.contiguous() for w in (kw1, kw2, kg))))
    schedule = plan(n_heads, d_head, inputs.past, inputs.window, inputs.official)
    return blocked_dcmha(inputs.q, inputs.k, inputs.v, inputs.mask, stages[0], stages[1], schedule)
