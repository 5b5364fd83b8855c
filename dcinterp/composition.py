"""What DCMHA's `Compose` does to one attention vector (paper Sec. 3, Eq. 7-8, Fig. 1, 7 and 8).

For a layer, a query position t and a key position s, a stage ("pre": on the scores before softmax; "post": on
the probabilities after it) maps the attention vector A = A[:, t, s] (one value per head) to

    A' = A + o_qp + o_qg + o_kp + o_kg = A @ W,
    W  = I + diag(w_qg + w_kg) + w_q1 @ w_q2.T + w_k1 @ w_k2.T          (H x H, the composition map)

where w_q1, w_q2, w_qg are computed from the query token and w_k1, w_k2, w_kg from the key token.
Here all four low-rank weights are [head, rank] matrices: w_q1 / w_k1 project heads down to rank,
w_q2 / w_k2 (the paper's R x H W_q2 / W_k2, transposed) project back up. `W[n, m]` is how much head n's
attention flows into head m; the paper's composition map C (A'_h = sum_j C[h, j] A_j, Fig. 1) is W.T.

Only the requested layer is computed (`stop_at_layer=layer + 1`), and only its hooks are cached.

Donor heads (Fig. 8): which heads' attention the key-wise branches hand to a given head. `donor_heads` ranks them
by their contribution A[n] * W[n, head] to the head's composed attention (default), or, as the paper's figure reads,
by |w_k1[n, r]| in the rank component r that gathers the most attention (rule="w_k1"); docs/conventions.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from .checks import check_head, check_key_before_query, check_layer, check_tokens, prompt_position
from .dcmha.materialised import branch_outputs
from .model import HookedDCFormer, at_least_float32, visible_keys

Stage = Literal["pre", "post"]
BRANCHES = ("qp", "qg", "kp", "kg")  # the order of the paper's Fig. 7
STAGE_HOOKS = {  # stage -> (hook before composition, hook after), names under blocks.{l}.attn
    "pre": ("hook_attn_scores", "hook_composed_scores"),
    "post": ("hook_pattern", "hook_composed_pattern"),
}
WEIGHT_HOOKS = ("qw1", "qw2", "kw1", "kw2", "qg", "kg")


@dataclass
class ComposeBreakdown:
    """One attention vector through one `Compose` stage: composed = before + o_qp + o_qg + o_kp + o_kg.

    Branches (and their weights) that the model does not run are zeros.

    Attributes:
        layer: the layer.
        query_pos: the query position t.
        key_pos: the key position s.
        stage: "pre" (scores) or "post" (probabilities).
        before: A[:, t, s], the scores or probabilities before composition [head].
        o_qp: the query-wise low-rank projection A @ w_q1 @ w_q2.T [head].
        o_qg: the query-wise gate A * w_qg [head].
        o_kp: the key-wise low-rank projection A @ w_k1 @ w_k2.T [head].
        o_kg: the key-wise gate A * w_kg [head].
        composed: A'[:, t, s], the exact sum of the five parts [head].
        w_q1: [head, rank].
        w_q2: [head, rank].
        w_k1: [head, rank].
        w_k2: [head, rank].
        w_qg: [head].
        w_kg: [head].
    """

    layer: int
    query_pos: int
    key_pos: int
    stage: Stage
    before: Float[Tensor, " head"]
    o_qp: Float[Tensor, " head"]
    o_qg: Float[Tensor, " head"]
    o_kp: Float[Tensor, " head"]
    o_kg: Float[Tensor, " head"]
    composed: Float[Tensor, " head"]
    w_q1: Float[Tensor, "head rank"]
    w_q2: Float[Tensor, "head rank"]
    w_k1: Float[Tensor, "head rank"]
    w_k2: Float[Tensor, "head rank"]
    w_qg: Float[Tensor, " head"]
    w_kg: Float[Tensor, " head"]

    @property
    def branches(self) -> dict[str, Tensor]:
        return {name: getattr(self, f"o_{name}") for name in BRANCHES}

    def __repr__(self) -> str:
        heads = ", ".join(
            f"H{h} {a:.3f}->{b:.3f}" for h, (a, b) in enumerate(zip(self.before, self.composed, strict=True))
        )
        return (
            f"ComposeBreakdown(L{self.layer} {self.stage}-compose at query {self.query_pos}, key {self.key_pos}: "
            f"{heads})"
        )

    def to_frame(self) -> pd.DataFrame:
        """One row per head: before, o_qp, o_qg, o_kp, o_kg, composed (before + the four = composed)."""
        columns = {"before": self.before, **{f"o_{n}": v for n, v in self.branches.items()}, "composed": self.composed}
        frame = pd.DataFrame({name: values.tolist() for name, values in columns.items()})
        return frame.rename_axis("head").reset_index()

    def composition_map(self, include_identity: bool = True) -> Float[Tensor, "head head"]:
        """W with composed = before @ W.

        Args:
            include_identity: include the skip connection I.

        Returns:
            W [head, head].
        """
        W = torch.diag(self.w_qg + self.w_kg) + self.w_q1 @ self.w_q2.T + self.w_k1 @ self.w_k2.T
        return W + torch.eye(len(W)) if include_identity else W


def _check_stage(model: HookedDCFormer, stage: str) -> None:
    if not model.cfg.use_dcmha:
        raise ValueError("this model has plain multi-head attention: there is no composition to break down")
    if stage not in STAGE_HOOKS:
        raise ValueError(f"stage must be 'pre' or 'post', not {stage!r}")
    if stage not in model.cfg.compose_stages:
        raise ValueError(f"this model has no {stage}-compose stage (compose_stages={model.cfg.compose_stages})")


def _single_prompt(model: HookedDCFormer, tokens, batch_index: int) -> Int[Tensor, "1 pos"]:
    tokens = check_tokens(model, tokens)
    if (
        isinstance(batch_index, bool)
        or not isinstance(batch_index, int)
        or not -tokens.shape[0] <= batch_index < tokens.shape[0]
    ):
        raise ValueError(f"batch_index={batch_index!r} is out of range: the batch has prompts 0..{tokens.shape[0] - 1}")
    batch_index %= tokens.shape[0]
    return tokens[batch_index : batch_index + 1]


def _query_key(model: HookedDCFormer, prompt: Tensor, query_pos, key_pos) -> tuple[int, int]:
    t, s = prompt_position(model, prompt, query_pos, "query_pos"), prompt_position(model, prompt, key_pos, "key_pos")
    check_key_before_query(t, s)
    return t, s


def _prompt_stage_activations(model: HookedDCFormer, tokens, layer: int, stage: str, batch_index: int):
    """(the chosen prompt [1, pos], its stage_activations in float32 on the CPU), after checking the stage."""
    _check_stage(model, stage)
    layer = check_layer(model, layer)
    prompt = _single_prompt(model, tokens, batch_index)
    return prompt, {k: at_least_float32(v).cpu() for k, v in stage_activations(model, prompt, layer, stage).items()}


@torch.no_grad()
def stage_activations(
    model: HookedDCFormer, tokens: Int[Tensor, "1 pos"], layer: int, stage: Stage
) -> dict[str, Tensor]:
    """One prompt's attention before/after the stage and the stage's dynamic weights, for one layer only.

    Args:
        model: the model.
        tokens: one prompt [1, pos].
        layer: the layer.
        stage: "pre" or "post".

    Returns:
        "before", "after" [head, query, key] and those of qw1, qw2, kw1, kw2 [pos, rank, head], qg, kg [pos, head]
        that the model runs.
    """
    attn = f"blocks.{layer}.attn"
    before, after = STAGE_HOOKS[stage]
    names = {"before": f"{attn}.{before}", "after": f"{attn}.{after}"}
    names |= {w: f"{attn}.{stage}_compose.hook_{w}" for w in WEIGHT_HOOKS}
    hooked = set(model.hook_dict)
    names = {key: name for key, name in names.items() if name in hooked}
    _, cache = model.run_with_cache(tokens, names_filter=list(names.values()), stop_at_layer=layer + 1)
    return {key: cache[name][0] for key, name in names.items() if name in cache.cache_dict}


def compose_breakdown(
    model: HookedDCFormer,
    tokens: Int[Tensor, "batch pos"],
    layer: int,
    query_pos: int | str,
    key_pos: int | str,
    stage: Stage = "post",
    batch_index: int = 0,
) -> ComposeBreakdown:
    """Break the composed attention of (query_pos, key_pos) in `layer` into its five parts (Fig. 7).

    Everything is returned in float32 on the CPU; only the chosen prompt is run.

    Args:
        model: a DCMHA model.
        tokens: one prompt [pos] or a batch [batch, pos].
        layer: the layer.
        query_pos: a position (negative counts from the end) or a word (the last piece of its last occurrence;
            needs a tokenizer).
        key_pos: as `query_pos`, at or before it.
        stage: "pre" or "post".
        batch_index: the prompt of a batch.

    Returns:
        The five parts, their sum and the dynamic weights.

    Raises:
        ValueError: a plain-MHA model, a stage the model lacks, or a position, layer or index out of range.
    """
    layer = check_layer(model, layer)
    prompt = _single_prompt(model, tokens, batch_index)
    t, s = _query_key(model, prompt, query_pos, key_pos)
    prompt, acts = _prompt_stage_activations(model, prompt, layer, stage, 0)
    H, R = model.cfg.n_heads, model.cfg.dcmha_rank
    weights = {  # [head, rank] for the projections, [head] for the gates; zeros where a branch is off
        "w_q1": acts["qw1"][t].T if "qw1" in acts else torch.zeros(H, R),
        "w_q2": acts["qw2"][t].T if "qw2" in acts else torch.zeros(H, R),
        "w_k1": acts["kw1"][s].T if "kw1" in acts else torch.zeros(H, R),
        "w_k2": acts["kw2"][s].T if "kw2" in acts else torch.zeros(H, R),
        "w_qg": acts["qg"][t] if "qg" in acts else torch.zeros(H),
        "w_kg": acts["kg"][s] if "kg" in acts else torch.zeros(H),
    }
    before = acts["before"][:, t, s]
    if not visible_keys(prompt.shape[1], model.blocks[layer].attn.window, "cpu", model.cfg.window)[t, s]:
        before = torch.zeros_like(before)  # a hidden key (future, or out of the window) enters the compose as 0
    outputs = branch_outputs(  # the model's own branch formulas, on a 1 x 1 (query, key) block
        before[None, :, None, None],
        weights["w_q1"].T[None, None],
        weights["w_q2"].T[None, None],
        weights["w_k1"].T[None, None],
        weights["w_k2"].T[None, None],
        weights["w_qg"][None, None],
        weights["w_kg"][None, None],
    )
    branches = {f"o_{name}": outputs[name][0, :, 0, 0] for name in BRANCHES}
    composed = before + branches["o_qp"] + branches["o_qg"] + branches["o_kp"] + branches["o_kg"]
    return ComposeBreakdown(layer, t, s, stage, before, **branches, composed=composed, **weights)


def composition_map(
    model: HookedDCFormer,
    tokens: Int[Tensor, "batch pos"],
    layer: int,
    query_pos: int | str,
    key_pos: int | str,
    stage: Stage = "post",
    batch_index: int = 0,
    include_identity: bool = True,
) -> Float[Tensor, "head head"]:
    """The H x H map W of one (query, key) pair: A'[:, t, s] = A[:, t, s] @ W (Sec. 3.1; Fig. 1 shows W.T).

    Args:
        model: a DCMHA model.
        tokens: as `compose_breakdown`.
        layer: as `compose_breakdown`.
        query_pos: as `compose_breakdown`.
        key_pos: as `compose_breakdown`.
        stage: as `compose_breakdown`.
        batch_index: as `compose_breakdown`.
        include_identity: include the skip connection I.

    Returns:
        W [head, head].
    """
    breakdown = compose_breakdown(model, tokens, layer, query_pos, key_pos, stage, batch_index)
    return breakdown.composition_map(include_identity)


def composition_maps_along_keys(
    model: HookedDCFormer,
    tokens: Int[Tensor, "batch pos"],
    layer: int,
    query_pos: int | str,
    stage: Stage = "post",
    batch_index: int = 0,
    include_identity: bool = True,
) -> Float[Tensor, "key head head"]:
    """W for (query_pos, s) at every key s <= query_pos, from one run: how the composition varies along the sequence.

    Args:
        model: a DCMHA model.
        tokens: as `compose_breakdown`.
        layer: as `compose_breakdown`.
        query_pos: as `compose_breakdown`.
        stage: as `compose_breakdown`.
        batch_index: as `compose_breakdown`.
        include_identity: include the skip connection I.

    Returns:
        W [key, head, head], keys 0..query_pos.
    """
    prompt = _single_prompt(model, tokens, batch_index)
    t = prompt_position(model, prompt, query_pos, "query_pos")
    prompt, acts = _prompt_stage_activations(model, prompt, layer, stage, 0)
    H = model.cfg.n_heads
    maps = torch.eye(H).expand(t + 1, H, H).clone() if include_identity else torch.zeros(t + 1, H, H)
    if "qw1" in acts:
        maps += acts["qw1"][t].T @ acts["qw2"][t]
    if "kw1" in acts:
        maps += torch.einsum("srn,srm->snm", acts["kw1"][: t + 1], acts["kw2"][: t + 1])
    gates = acts["qg"][t] if "qg" in acts else torch.zeros(H)
    gates = gates + acts["kg"][: t + 1] if "kg" in acts else gates.expand(t + 1, H)
    return maps + torch.diag_embed(gates)


@dataclass
class AttentionDistributions:
    """Attention of chosen heads from one query over keys 0..query_pos, before and after composition (Fig. 8).

    Attributes:
        layer: the layer.
        query_pos: the query position.
        stage: "pre" or "post".
        heads: the heads, one row each.
        before: the pattern (post) or scores (pre) before the stage [n_heads, key].
        after: after the stage [n_heads, key]; `before` for plain MHA.
        w_k1: the stage's key-wise w_k1 at each key [key, head, rank] (None if not run).
    """

    layer: int
    query_pos: int
    stage: Stage
    heads: list[int]
    before: Float[Tensor, "n_heads key"]
    after: Float[Tensor, "n_heads key"]
    w_k1: Float[Tensor, "key head rank"] | None

    def __repr__(self) -> str:
        tops = ", ".join(
            f"H{h} key {int(b.argmax())}->{int(a.argmax())}"
            for h, b, a in zip(self.heads, self.before, self.after, strict=True)
        )
        return (
            f"AttentionDistributions(L{self.layer} {self.stage}-compose from query {self.query_pos}, "
            f"most attended: {tops})"
        )

    def to_frame(self) -> pd.DataFrame:
        """One row per (head, key): head, key, before, after."""
        keys = self.before.shape[1]
        return pd.DataFrame(
            {
                "head": [h for h in self.heads for _ in range(keys)],
                "key": list(range(keys)) * len(self.heads),
                "before": self.before.flatten().tolist(),
                "after": self.after.flatten().tolist(),
            }
        )


def attention_distributions(
    model: HookedDCFormer,
    tokens: Int[Tensor, "batch pos"],
    layer: int,
    query_pos: int | str,
    heads: list[int] | None = None,
    stage: Stage = "post",
    batch_index: int = 0,
) -> AttentionDistributions:
    """The attention of `heads` from `query_pos` to every key up to it, before and after `stage`, and w_k1.

    Works on plain MHA too (then `after` equals `before` and `w_k1` is None). float32, on the CPU.

    Args:
        model: the model.
        tokens: one prompt [pos] or a batch [batch, pos].
        layer: the layer.
        query_pos: a position or a word, as `compose_breakdown`.
        heads: the heads (None: all).
        stage: "pre" or "post".
        batch_index: the prompt of a batch.

    Returns:
        The distributions of each head.

    Raises:
        ValueError: a layer, head, position or index out of range, or a stage the model lacks.
    """
    layer = check_layer(model, layer)
    prompt = _single_prompt(model, tokens, batch_index)
    t = prompt_position(model, prompt, query_pos, "query_pos")
    heads = list(range(model.cfg.n_heads)) if heads is None else [check_head(model, h, "heads") for h in heads]
    if model.cfg.use_dcmha:
        _check_stage(model, stage)
        acts = stage_activations(model, prompt, layer, stage)
    else:
        name = f"blocks.{layer}.attn.{STAGE_HOOKS[stage][0]}"
        with torch.no_grad():
            _, cache = model.run_with_cache(prompt, names_filter=[name], stop_at_layer=layer + 1)
        acts = {"before": cache[name][0], "after": cache[name][0]}
    before = at_least_float32(acts["before"][heads, t, : t + 1]).cpu()
    after = at_least_float32(acts["after"][heads, t, : t + 1]).cpu()
    w_k1 = at_least_float32(acts["kw1"][: t + 1].transpose(1, 2)).cpu() if "kw1" in acts else None
    return AttentionDistributions(layer, t, stage, heads, before, after, w_k1)


# --------------------------------------------------------------------------------------------------
# Donor heads (Fig. 8)
DONOR_RULES = ("contribution", "w_k1")


@dataclass
class Donors:
    """Which heads hand attention to `head` at one (query, key) pair, and by how much.

    Attributes:
        head: the receiving head.
        rule: the rule that ranked `donors`.
        donors: the donor heads, ranked.
        attention: A[:, t, s] before the stage [head].
        contribution: A[n] * W[n, head] (W without the identity): head n's share of the change of head's attention
            [head].
        w_k1_rank: the rank component with the largest |A @ w_k1| (the "w_k1" rule reads its column).
        delivered: (A @ w_k1[:, r]) * w_k2[head, r], what rank component r of the key-wise projection delivers to
            head [rank].
    """

    head: int
    rule: str
    donors: list[int]
    attention: Float[Tensor, " head"]
    contribution: Float[Tensor, " head"]
    w_k1_rank: int
    delivered: Float[Tensor, " rank"]

    def __repr__(self) -> str:
        names = ", ".join(f"H{n} ({self.contribution[n]:+.3f}, A {self.attention[n]:.3f})" for n in self.donors)
        return f"Donors(to H{self.head} by {self.rule}: {names})"

    def to_frame(self) -> pd.DataFrame:
        """One row per other head: head, attention, contribution, donor (whether it is one of `donors`)."""
        others = [n for n in range(len(self.attention)) if n != self.head]
        return pd.DataFrame(
            {
                "head": others,
                "attention": [float(self.attention[n]) for n in others],
                "contribution": [float(self.contribution[n]) for n in others],
                "donor": [n in self.donors for n in others],
            }
        )


def donor_heads(breakdown: ComposeBreakdown, head: int, k: int = 2, rule: str = "contribution") -> Donors:
    """The k heads whose attention the composition hands most to `head` at the breakdown's (query, key) pair.

    Args:
        breakdown: from `compose_breakdown`.
        head: the receiving head.
        k: how many donors.
        rule: "contribution": the largest positive A[n] * W[n, head], n != head, i.e. the heads that raise `head`'s
            attention most (fewer than k if fewer raise it). "w_k1": the largest |w_k1[n, r]| in the rank component r
            with the largest |A @ w_k1[:, r]|, which ignores how much attention head n has on the key and what w_k2
            delivers to `head` (the paper's reading of Fig. 8).

    Returns:
        The donors with each head's contribution.

    Raises:
        ValueError: `head` out of range or an unknown `rule`.
    """
    n_heads = len(breakdown.before)
    if not -n_heads <= head < n_heads:
        raise ValueError(f"head={head} is out of range: the layer has heads 0..{n_heads - 1}")
    if rule not in DONOR_RULES:
        raise ValueError(f"rule must be one of {DONOR_RULES}, not {rule!r}")
    head = head % n_heads
    A = breakdown.before
    W = breakdown.composition_map(include_identity=False)
    contribution = A * W[:, head]
    gathered = A @ breakdown.w_k1  # [rank]
    rank = int(gathered.abs().argmax())
    delivered = gathered * breakdown.w_k2[head]
    score = contribution if rule == "contribution" else breakdown.w_k1[:, rank].abs()
    ranked = [n for n in score.argsort(descending=True).tolist() if n != head]
    if rule == "contribution":  # a head that lowers `head`'s attention is no donor
        ranked = [n for n in ranked if contribution[n] > 0]
    return Donors(head, rule, ranked[:k], A, contribution, rank, delivered)
