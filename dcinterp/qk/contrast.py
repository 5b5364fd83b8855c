"""Why s rather than s': `qk_contrast`, the difference of a head's composed scores at two keys (what moves the
softmax between them) as a sum of terms.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    component_frame,
    decompose,
    frame_table,
    named,
    pair_frame,
    query_and_key_sides,
    score_scale,
    str_tokens,
)


@dataclass
class QKContrast:
    """Why head `head` scores key_pos above other_key_pos: difference = A'[t, s] - A'[t, s'] as a sum of terms.

    A term is value(i, j, n, b) at s minus the same term at s': the query side is the same, the key side and the
    key-side weights (kp, kg) change.

    Attributes:
        layer: the layer.
        head: the target head m.
        query_pos: the query position t.
        key_pos: the key s.
        other_key_pos: the key s'.
        components: the residual components' names.
        branches: the pre-compose branches.
        difference: the model's composed score at s minus at s'.
        terms: the columns of `QKAttribution.terms` (key_pos = s) and other_key_pos; its values add up to
            `difference`.
        pairs: the terms summed over source heads and branches [component, component].
        head_branch: the terms summed over components [branch, head].
        query_marginal: a query component's terms, per source head [head, component].
        key_marginal: a key component's terms, per source head [head, component].
        total: the float64 sum of every term.
        complete: every term is a row of `terms`.
        scale: the largest |score| of the head over the query's visible keys.
        str_tokens: the prompt's tokens as text, where the model has a tokenizer.
    """

    layer: int
    head: int
    query_pos: int
    key_pos: int
    other_key_pos: int
    components: list[str]
    branches: list[str]
    difference: float
    terms: pd.DataFrame
    pairs: Float[Tensor, "component component"]
    head_branch: Float[Tensor, "branch head"]
    query_marginal: Float[Tensor, "head component"]
    key_marginal: Float[Tensor, "head component"]
    total: float
    complete: bool
    scale: float
    str_tokens: list[str] | None = field(default=None, repr=False)

    @property
    def sum_of_terms(self) -> float:
        return float(self.terms["value"].sum())

    @property
    def gap(self) -> float:
        return self.sum_of_terms - self.difference

    @property
    def relative_gap(self) -> float:
        return abs(self.gap) / self.scale

    def pair_table(self, top: int | None = None) -> pd.DataFrame:
        """[query component x key component], summed over source heads and branches.

        Args:
            top: keep the `top` rows and columns with the largest |sums|; None: all.

        Returns:
            The table, query components as rows.
        """
        return pair_frame(self.pairs, self.components, top)

    def head_branch_table(self) -> pd.DataFrame:
        """[source head x branch], summed over components."""
        return frame_table(
            self.head_branch.T, list(range(self.head_branch.shape[1])), self.branches, "source_head", "branch"
        )

    def component_table(self, source_head: int | None = None) -> pd.DataFrame:
        """Each component's terms summed on the query side and on the key side.

        Args:
            source_head: sum through this source head only; None: through every one.

        Returns:
            One row per component: component, query, key.
        """
        heads = slice(None) if source_head is None else slice(source_head, source_head + 1)
        return component_frame(self.query_marginal[heads].sum(0), self.key_marginal[heads].sum(0), self.components)

    def top_terms(self, k: int = 10) -> pd.DataFrame:
        """The k terms with the largest |value|, `rest` rows left out.

        Args:
            k: how many terms.

        Returns:
            The rows of `terms`, largest |value| first.
        """
        terms = self.terms[self.terms["branch"] != REST]
        return terms.reindex(terms["value"].abs().sort_values(ascending=False).index).head(k)

    def __repr__(self) -> str:
        def name(s):
            return f"{s} {self.str_tokens[s]!r}" if self.str_tokens else str(s)

        return (
            f"QKContrast(L{self.layer}H{self.head} from query {self.query_pos}: key {name(self.key_pos)} over "
            f"{name(self.other_key_pos)} by {self.difference:.4g}; {len(self.terms)} rows, relative gap "
            f"{self.relative_gap:.1e})"
        )


@torch.no_grad()
def qk_contrast(
    model: HookedDCFormer,
    tokens: Int[Tensor, "batch pos"],
    layer: int,
    head: int,
    query_pos: int | str,
    key_pos: int | str,
    other_key_pos: int | str,
    batch_index: int = 0,
    max_terms: int = MAX_TERMS,
) -> QKContrast:
    """Why `head` attends to key_pos rather than other_key_pos from query_pos.

    The difference of the two composed scores (what moves the softmax between them) as a sum of terms, float32 on
    the CPU.

    Args:
        model: the model.
        tokens: the prompt [pos], or a batch [batch, pos] of which `batch_index` picks one.
        layer: the head's layer.
        head: the head whose two scores are compared.
        query_pos: the query, a position or word.
        key_pos: the key s, a position or word.
        other_key_pos: the key s', a position or word.
        batch_index: the prompt of a batch.
        max_terms: rows of `terms` at most; past it the largest terms and one `rest` row.

    Returns:
        The contrast.

    Raises:
        ValueError: as `qk_attribution`, a key that is not one position, or the same key twice.
    """
    layer, head = check_layer(model, layer), check_head(model, head)
    prompt = single_prompt(model, tokens, batch_index)
    t = prompt_position(model, prompt, query_pos, "query_pos")
    (s,) = key_positions(model, prompt, layer, t, _one(key_pos, "key_pos"), "key_pos")
    (other,) = key_positions(model, prompt, layer, t, _one(other_key_pos, "other_key_pos"), "other_key_pos")
    if s == other:
        raise ValueError(f"other_key_pos is key_pos (position {s}): a contrast needs two different keys")
    max_terms = check_max_terms(max_terms, 1)
    components = component_names(model, layer)
    run = layer_run(model, prompt, layer, t, [t, s, other])
    queries, sides = query_and_key_sides(model, run, layer, t, [s, other])
    weights = branch_weights(model, run, "pre", t, torch.tensor([s, other]), head)
    members = [Member(side, w, sign) for side, w, sign in zip(sides, weights, (1.0, -1.0), strict=True)]
    terms = decompose(queries, [members], 1, compose_branches(model, "pre"), head, max_terms)
    rows = named(terms.rows, components).drop(columns="group")
    rows.insert(0, "key_pos", s)
    rows["other_key_pos"] = other
    target = at_least_float32(run["composed" if model.cfg.use_dcmha else "scores"][head]).cpu()
    return QKContrast(
        layer=layer,
        head=head,
        query_pos=t,
        key_pos=s,
        other_key_pos=other,
        components=components,
        branches=compose_branches(model, "pre"),
        difference=float(target[s]) - float(target[other]),
        terms=rows[[*TERM_COLUMNS, "other_key_pos"]],
        pairs=terms.pairs[0],
        head_branch=terms.head_branch[0],
        query_marginal=terms.query_marginal[0],
        key_marginal=terms.key_marginal[0],
        total=float(terms.totals[0]),
        complete=terms.complete,
        scale=score_scale(model, run, layer, head, t, prompt.shape[1]),
        str_tokens=str_tokens(model, prompt),
    )


def _one(position, name: str):
    if position is None or isinstance(position, (list, tuple)) or isinstance(position, Tensor) and position.ndim:
        raise ValueError(f"{name} must be one position or word, not {position!r}")
    return position
