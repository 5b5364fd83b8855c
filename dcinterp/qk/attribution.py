"""Why a head attends where it does: `qk_attribution`, head m's composed score at each key as a sum of terms, with
its tables (component pairs, source head x branch, components) and the post-compose head loadings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..checks import check_head, check_layer, prompt_position
from ..model import HookedDCFormer, at_least_float32
from ..qk_run import branch_weights, component_names, compose_branches, key_positions, layer_run, single_prompt
from .terms import (
    MAX_TERMS,
    REST,
    TERM_COLUMNS,
    Member,
    check_max_terms,
    check_table_size,
    component_frame,
    decompose,
    frame_table,
    named,
    pair_frame,
    present_terms,
    query_and_key_sides,
    score_scale,
    str_tokens,
)


@dataclass
class QKAttribution:
    """Head `head`'s composed score at (query_pos, s), for each s in key_pos, as a sum of terms (module docstring).

    The values of `terms` add up, per key, to `composed`, up to `gap`. Each source head's own score in `loadings` is
    `qk_attribution(model, tokens, layer, source_head, ...)`.

    Attributes:
        layer: the layer.
        head: the target head m.
        query_pos: the query position t.
        key_pos: the key positions s.
        components: the residual components' names (`embed`, `L{l}H{h}`, `MLP{l}`, `bias`).
        branches: the pre-compose branches (`skip`, `qp`, `kp`, `qg`, `kg`; `skip` alone for plain MHA).
        composed: the model's score at each key, `hook_composed_scores` (`hook_attn_scores` for plain MHA), in
            float32 [key].
        terms: one row per term, columns key_pos, query_component, key_component, source_head, branch, value; past
            `max_terms` the largest terms and one `rest` row per key (source_head `<NA>`).
        pairs: the terms summed over source heads and branches [key, component, component].
        head_branch: the terms summed over components [key, branch, head].
        query_marginal: a query component's terms, per source head [key, head, component].
        key_marginal: a key component's terms, per source head [key, head, component].
        totals: the float64 sum of every term, before any top-k [key].
        loadings: the post-compose head loadings, one row per (key_pos, source_head, branch): pattern P_n[t, s],
            weight W'_b[n, head], value = weight x pattern, adding up to `composed_pattern`.
        composed_pattern: `hook_composed_pattern` (`hook_pattern` for plain MHA) at each key [key].
        complete: every term is a row of `terms`.
        scale: the largest |score| of the head over the query's visible keys.
        tokens: the prompt [pos].
        str_tokens: the prompt's tokens as text, where the model has a tokenizer.
    """

    layer: int
    head: int
    query_pos: int
    key_pos: list[int]
    components: list[str]
    branches: list[str]
    composed: Float[Tensor, " key"]
    terms: pd.DataFrame
    pairs: Float[Tensor, "key component component"]
    head_branch: Float[Tensor, "key branch head"]
    query_marginal: Float[Tensor, "key head component"]
    key_marginal: Float[Tensor, "key head component"]
    totals: Float[Tensor, " key"]
    loadings: pd.DataFrame
    composed_pattern: Float[Tensor, " key"]
    complete: bool
    scale: float
    tokens: Int[Tensor, " pos"]
    str_tokens: list[str] | None = field(default=None, repr=False)

    def key_index(self, key_pos: int | None) -> int:
        """Where a key sits among this attribution's keys (its index in `key_pos`, `composed`, `pairs`, ...).

        Args:
            key_pos: One of `key_pos`, or None when the attribution has a single key.

        Returns:
            The key's index.

        Raises:
            ValueError: A key this attribution does not hold, or None when it holds several.
        """
        if key_pos is None:
            if len(self.key_pos) != 1:
                raise ValueError(f"key_pos: this attribution has {len(self.key_pos)} keys; name one of {self.key_pos}")
            return 0
        if key_pos not in self.key_pos:
            raise ValueError(f"key_pos={key_pos!r} is not one of this attribution's keys {self.key_pos}")
        return self.key_pos.index(key_pos)

    @property
    def sum_of_terms(self) -> pd.Series:
        """Per key, the sum of the rows of `terms` (float64)."""
        return self.terms.groupby("key_pos", sort=False)["value"].sum().reindex(self.key_pos)

    @property
    def gap(self) -> pd.Series:
        """sum_of_terms - composed, per key."""
        return self.sum_of_terms - pd.Series(self.composed.double().numpy(), index=self.key_pos)

    @property
    def relative_gap(self) -> float:
        """The largest |gap| over the keys, relative to `scale`."""
        return float(self.gap.abs().max()) / self.scale

    def summary(self) -> pd.DataFrame:
        """One row per key: key_pos, token, composed, sum_of_terms, gap, composed_pattern."""
        return pd.DataFrame(
            {
                "key_pos": self.key_pos,
                "token": [self.str_tokens[s] if self.str_tokens else None for s in self.key_pos],
                "composed": self.composed.double().numpy(),
                "sum_of_terms": self.sum_of_terms.to_numpy(),
                "gap": self.gap.to_numpy(),
                "composed_pattern": self.composed_pattern.double().numpy(),
            }
        )

    def pair_table(self, key_pos: int | None = None, top: int | None = None) -> pd.DataFrame:
        """[query component x key component] at one key, summed over source heads and branches (exact, every pair).

        Args:
            key_pos: one of `key_pos`; None where the attribution has a single key.
            top: keep the `top` rows and columns with the largest |sums|; None: all.

        Returns:
            The table, query components as rows.
        """
        return pair_frame(self.pairs[self.key_index(key_pos)], self.components, top)

    def head_branch_table(self, key_pos: int | None = None) -> pd.DataFrame:
        """[source head x branch] at one key, summed over components: W_b[n, head] * S_n[t, s].

        Args:
            key_pos: one of `key_pos`; None where the attribution has a single key.

        Returns:
            The table, source heads as rows.
        """
        table = self.head_branch[self.key_index(key_pos)].T
        return frame_table(table, list(range(table.shape[0])), self.branches, "source_head", "branch")

    def component_table(self, key_pos: int | None = None, source_head: int | None = None) -> pd.DataFrame:
        """Each component's terms summed on the query side and on the key side, at one key.

        Args:
            key_pos: one of `key_pos`; None where the attribution has a single key.
            source_head: sum through this source head only; None: through every one.

        Returns:
            One row per component: component, query, key.
        """
        k = self.key_index(key_pos)
        heads = slice(None) if source_head is None else slice(source_head, source_head + 1)
        query, key = self.query_marginal[k, heads].sum(0), self.key_marginal[k, heads].sum(0)
        return component_frame(query, key, self.components)

    def top_terms(self, k: int = 10, key_pos: int | None = None) -> pd.DataFrame:
        """The k terms with the largest |value|, `rest` rows left out.

        Args:
            k: how many terms.
            key_pos: the terms of this key only; None: of every key.

        Returns:
            The rows of `terms`, largest |value| first.
        """
        terms = self.terms if key_pos is None else self.terms[self.terms["key_pos"] == key_pos]
        terms = terms[terms["branch"] != REST]
        return terms.reindex(terms["value"].abs().sort_values(ascending=False).index).head(k)

    def __repr__(self) -> str:
        keys = ", ".join(
            f"{s}{f' {self.str_tokens[s]!r}' if self.str_tokens else ''}: {float(c):.4g}"
            for s, c in zip(self.key_pos[:6], self.composed[:6], strict=False)
        )
        more = f" (+{len(self.key_pos) - 6} keys)" if len(self.key_pos) > 6 else ""
        return (
            f"QKAttribution(L{self.layer}H{self.head} from query {self.query_pos}: {keys}{more}; "
            f"{len(self.terms)} rows{'' if self.complete else ' (top terms + rest)'}, "
            f"relative gap {self.relative_gap:.1e})"
        )


def _loadings(model: HookedDCFormer, run: dict[str, Tensor], t: int, keys: list[int], head: int) -> pd.DataFrame:
    """Post-compose head loadings: head's pattern at (t, s) as sum_{n, b} W'_b[n, head] P_n[t, s]."""
    branches = compose_branches(model, "post")
    key_index = torch.tensor(keys)
    pattern = at_least_float32(run["pattern"]).cpu()[:, key_index].T  # [key, head]
    W = branch_weights(model, run, "post", t, key_index, head)  # [key, branch, source head]
    present = present_terms(branches, head, model.cfg.n_heads)
    k, b, n = present[None].expand(len(keys), -1, -1).nonzero().unbind(1)
    return pd.DataFrame(
        {
            "key_pos": np.asarray(keys)[k.numpy()],
            "source_head": n.numpy(),
            "branch": np.asarray(branches, dtype=object)[b.numpy()],
            "pattern": pattern[k, n].double().numpy(),
            "weight": W[k, b, n].double().numpy(),
            "value": (W[k, b, n].double() * pattern[k, n].double()).numpy(),
        }
    )


@torch.no_grad()
def qk_attribution(
    model: HookedDCFormer,
    tokens: Int[Tensor, "batch pos"],
    layer: int,
    head: int,
    query_pos: int | str,
    key_pos: int | str | list | Tensor | None = None,
    batch_index: int = 0,
    max_terms: int = MAX_TERMS,
) -> QKAttribution:
    """Head `head`'s composed score from `query_pos` to each key of `key_pos`, as a sum of terms.

    A term is one (query component, key component, source head, branch), in float32 on the CPU. Positions are
    integers (negative from the end) or words (the last piece of the word's last occurrence). Only layers 0..layer
    run.

    Args:
        model: the model.
        tokens: one prompt [pos] or a batch [batch, pos].
        layer: the layer.
        head: the target head.
        query_pos: the query position or word.
        key_pos: one key position or word, several, or None for every key the query sees in this layer.
        batch_index: the prompt of a batch.
        max_terms: rows of `terms` at most; past it the largest terms and one `rest` row per key.

    Returns:
        The attribution.

    Raises:
        ValueError: a layer, head, position or word out of range, a key the query does not see (later, or outside a
            local window), `max_terms` not above the number of keys, or too many keys for the tables.
    """
    layer, head = check_layer(model, layer), check_head(model, head)
    prompt = single_prompt(model, tokens, batch_index)
    t = prompt_position(model, prompt, query_pos, "query_pos")
    keys = key_positions(model, prompt, layer, t, key_pos, "key_pos")
    max_terms = check_max_terms(max_terms, len(keys))
    components = component_names(model, layer)
    check_table_size(len(keys), len(components), "key_pos")
    run = layer_run(model, prompt, layer, t, [t, *keys])
    queries, sides = query_and_key_sides(model, run, layer, t, keys)
    weights = branch_weights(model, run, "pre", t, torch.tensor(keys), head)
    groups = ([Member(side, w)] for side, w in zip(sides, weights, strict=True))  # one key side at a time
    terms = decompose(queries, groups, len(keys), compose_branches(model, "pre"), head, max_terms)
    rows = named(terms.rows, components)
    rows.insert(0, "key_pos", np.asarray(keys)[rows.pop("group").to_numpy(dtype=int)])
    target = run["composed" if model.cfg.use_dcmha else "scores"]
    final = run["composed_pattern" if model.cfg.use_dcmha else "pattern"]
    key_index = torch.tensor(keys)
    return QKAttribution(
        layer=layer,
        head=head,
        query_pos=t,
        key_pos=keys,
        components=components,
        branches=compose_branches(model, "pre"),
        composed=at_least_float32(target[head]).cpu()[key_index],
        terms=rows[TERM_COLUMNS],
        pairs=terms.pairs,
        head_branch=terms.head_branch,
        query_marginal=terms.query_marginal,
        key_marginal=terms.key_marginal,
        totals=terms.totals,
        loadings=_loadings(model, run, t, keys, head),
        composed_pattern=at_least_float32(final[head]).cpu()[key_index],
        complete=terms.complete,
        scale=score_scale(model, run, layer, head, t, prompt.shape[1]),
        tokens=prompt[0].cpu(),
        str_tokens=str_tokens(model, prompt),
    )
