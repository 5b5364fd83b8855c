"""DCMHA's compose with the `[b, h, t, s]` tensors built: the reference path, and what every hook on a square
tensor of a layer reads.

Four forms of one compose stage, all equal up to float rounding (tests/test_hooks.py, tests/test_blocked.py):
- `branch_outputs`: the four branch outputs of Eq. (7) as separate tensors, what `hook_o_qp`, ... see;
- `compose_fused`: their sum with the skip connection, without per-branch tensors (Eq. 8's row plus column
  decomposition), the form taken when no hook reads a branch output;
- `compose_few_queries`: the same for a few queries against many cached keys (decoding with a key-value cache), and
  `compose_decoding` the same again in the fewest operations (a decoding step with no hook on a square tensor).

`attend` is the whole attention in this form as a plain function (no hooks): what the fused paths fall back on
for second derivatives.

Index names: b batch, t queries, s keys, h/m/n heads, e head dim, r rank.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Float
from torch import Tensor


def branch_outputs(A, qw1=None, qw2=None, kw1=None, kw2=None, qg=None, kg=None) -> dict[str, Tensor]:
    """The four branch outputs of Eq. (7) as separate tensors.

    Args:
        A: the stage's input [b, h, t, s]: the scores (pre-compose) or the pattern (post-compose).
        qw1: the query-side projection's first weights [b, t, r, h], None with the branch off.
        qw2: its second weights [b, t, r, h].
        kw1: the key-side projection's first weights [b, s, r, h], None with the branch off.
        kw2: its second weights [b, s, r, h].
        qg: the query-side gate [b, t, h], None with the branch off.
        kg: the key-side gate [b, s, h], None with the branch off.

    Returns:
        {"qp", "kp", "qg", "kg"} -> [b, h, t, s], for the branches whose weights are given.
    """
    out = {}
    if qw1 is not None:
        hidden = torch.einsum("bnts,btrn->brts", A, qw1)
        out["qp"] = torch.einsum("brts,btrm->bmts", hidden, qw2)
    if kw1 is not None:
        hidden = torch.einsum("bnts,bsrn->brts", A, kw1)
        out["kp"] = torch.einsum("brts,bsrm->bmts", hidden, kw2)
    if qg is not None:
        out["qg"] = A * qg.transpose(1, 2)[:, :, :, None]
    if kg is not None:
        out["kg"] = A * kg.transpose(1, 2)[:, :, None, :]
    return out


def compose_fused(A, qw1=None, qw2=None, kw1=None, kw2=None, qg=None, kg=None) -> Tensor:
    """A + o_qp + o_kp + o_qg + o_kg without per-branch tensors (Eq. 8's row plus column decomposition).

    The query-side branches and the skip connection make one H x H map per query, W_q[t] = I + diag(qg[t])
    + qw1[t]^T qw2[t], and the key-side ones one map per key, W_k[s] = diag(kg[s]) + kw1[s]^T kw2[s]; each is
    applied with one batched matmul (faster than the low-rank form on CPU, forward and backward). The products are
    written as matmuls of permuted views, each with its einsum beside it: torch.einsum computes the same products
    (on the CPU the same bits, forward and backward) through about twice the view operations.

    Args:
        A: the stage's input [b, h, t, s].
        qw1: the query-side projection's first weights [b, t, r, h], None with the branch off.
        qw2: its second weights [b, t, r, h].
        kw1: the key-side projection's first weights [b, s, r, h], None with the branch off.
        kw2: its second weights [b, s, r, h].
        qg: the query-side gate [b, t, h], None with the branch off.
        kg: the key-side gate [b, s, h], None with the branch off.

    Returns:
        The composed [b, h, t, s].
    """
    if qw1 is not None or qg is not None:
        W_q = torch.diag_embed(1 + qg) if qg is not None else torch.eye(A.shape[1], device=A.device, dtype=A.dtype)
        if qw1 is not None:
            W_q = W_q + qw1.transpose(2, 3) @ qw2  # btrn,btrm->btnm
        out = (A.permute(0, 2, 3, 1) @ W_q).permute(0, 3, 1, 2)  # bnts,btnm->bmts
    else:
        out = A
    if kw1 is not None or kg is not None:
        W_k = torch.diag_embed(kg) if kg is not None else 0
        if kw1 is not None:
            W_k = W_k + kw1.transpose(2, 3) @ kw2  # bsrn,bsrm->bsnm
        out = out + (A.permute(0, 3, 2, 1) @ W_k).permute(0, 3, 2, 1)  # bnts,bsnm->bmts
    return out


def compose_few_queries(A, qw1=None, qw2=None, qg=None, kw1=None, kw2=None, kg=None) -> Tensor:
    """`compose_fused` for a few queries against many cached keys, the key side key-last as the cache holds it.

    The key-wise branches are in their low-rank form, two broadcast multiply-adds over the keys: O(t s h r) where
    the per-key H x H maps would cost O(s h^2 r).

    Args:
        A: the stage's input [b, h, t, s].
        qw1: the query-side projection's first weights [b, t, r, h], None with the branch off.
        qw2: its second weights [b, t, r, h].
        qg: the query-side gate [b, t, h], None with the branch off.
        kw1: the key-side projection's first weights, key-last [b, r, h, s], None with the branch off.
        kw2: its second weights [b, r, h, s].
        kg: the key-side gate, key-last [b, h, s], None with the branch off.

    Returns:
        The composed [b, h, t, s].
    """
    out = compose_fused(A, qw1, qw2, qg=qg)
    if kw1 is not None:
        hidden = (A[:, None] * kw1[:, :, :, None, :]).sum(2)  # [b, r, t, s]
        out = out + (hidden[:, :, None] * kw2[:, :, :, None, :]).sum(1)
    if kg is not None:
        out = out + A * kg[:, :, None, :]
    return out


def compose_decoding(A, qw1=None, qw2=None, qg=None, kw1=None, kw2=None, kg=None) -> Tensor:
    """`compose_few_queries` in as few operations as the arithmetic allows: a GPU's decoding step costs its launches.

    What a cached step with no hook on a square tensor takes. Every branch is in its low-rank form; the skip
    connection and both gates are one multiply-add, A (1 + qg[t] + kg[s]); the query side's and the key side's
    projections sit side by side along the rank (qw1[t] beside kw1[s] for every pair), so that both branches take one
    product-and-sum into the hidden units and one out of them.

    Args:
        A: the stage's input [b, h, t, s].
        qw1: the query-side projection's first weights [b, t, r, h], None with the branch off.
        qw2: its second weights [b, t, r, h].
        qg: the query-side gate [b, t, h], None with the branch off.
        kw1: the key-side projection's first weights, key-last [b, r, h, s], None with the branch off.
        kw2: its second weights [b, r, h, s].
        kg: the key-side gate, key-last [b, h, s], None with the branch off.

    Returns:
        The composed [b, h, t, s].
    """
    b, h, t, s = A.shape
    gates = None
    if qg is not None:
        gates = qg.transpose(1, 2).unsqueeze(3)  # [b, h, t, 1]
    if kg is not None:
        gates = kg.unsqueeze(2) if gates is None else gates + kg.unsqueeze(2)  # [b, h, t, s]
    out = A if gates is None else torch.addcmul(A, A, gates)
    first, second = [], []  # [b, r, h, t, s] each
    if qw1 is not None:
        first.append(qw1.permute(0, 2, 3, 1).unsqueeze(4).expand(-1, -1, -1, -1, s))
        second.append(qw2.permute(0, 2, 3, 1).unsqueeze(4).expand(-1, -1, -1, -1, s))
    if kw1 is not None:
        first.append(kw1.unsqueeze(3).expand(-1, -1, -1, t, -1))
        second.append(kw2.unsqueeze(3).expand(-1, -1, -1, t, -1))
    if first:
        w1, w2 = (ws[0] if len(ws) == 1 else torch.cat(ws, dim=1) for ws in (first, second))
        hidden = (A.unsqueeze(1) * w1).sum(2)  # [b, r, t, s] (2r with both branches)
        out = out + (hidden.unsqueeze(2) * w2).sum(1)
    return out


def attend(
    q: Float[Tensor, "b t h e"],
    k: Float[Tensor, "b s h e"],
    v: Float[Tensor, "b s h e"],
    mask: Tensor,
    pre: tuple[Tensor | None, ...] | None,
    post: tuple[Tensor | None, ...] | None,
) -> Float[Tensor, "b t h e"]:
    """z of DCMHA with every [b, h, t, s] tensor, no hook: scores, pre-compose, mask, softmax, post-compose, P V.

    The compose sees hidden scores as 0, as `Attention.materialised_z` gives it them.

    Args:
        q: the queries [b, t, h, e].
        k: the keys [b, s, h, e].
        v: the values [b, s, h, e].
        mask: additive, [t, s] or [b, 1, t, s].
        pre: the pre-compose's (qw1, qw2, kw1, kw2, qg, kg) in the hooks' layout (kw1, kw2 [b, s, r, h], kg
            [b, s, h], every key); None for a stage that is off.
        post: the post-compose's, the same.

    Returns:
        z [b, t, h, e].
    """
    scores = torch.einsum("bthe,bshe->bhts", q, k) / math.sqrt(q.shape[-1])
    mask = mask.to(scores.dtype)
    if pre is not None:
        scores = compose_fused(scores.masked_fill(mask != 0, 0.0), *pre)
    pattern = (scores + mask).softmax(-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(scores.dtype)
    if post is not None:
        pattern = compose_fused(pattern, *post)
    return torch.einsum("bhts,bshe->bthe", pattern, v)
