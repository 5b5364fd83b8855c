"""Why a head attends where it does: QK attribution through DCMHA's compose (Kamath, Ameisen et al. 2025).

For layer l, target head m, query position t and key position s, with ln1's scale, the QK-norm's scale and the
compose's dynamic weights frozen at the run's values, head m's composed score is exactly a sum of terms:

    A'_m[t, s] = sum_{n, b} W_b[n, m] S_n[t, s],     S_n[t, s] = sum_{i, j} <q_n^i(t), k_n^j(s)> / sqrt(d_head)

- i, j: the residual components entering layer l, named as the senders of `dcinterp.discovery`'s graph:
  `embed`, each earlier head `L{l'}H{h}` (its `hook_result`, without `b_O`), each earlier `MLP{l'}` (its
  `hook_mlp_out`, `b_out` included), and `bias`: the earlier layers' `b_O`, plus ln1's bias and `b_Q` / `b_K`
  on their way to q and k. The split is TransformerLens' `get_full_resid_decomposition` (`expand_neurons=False`).
- q_n^i(t): component i at the query through ln1 (centred for a LayerNorm, divided by the run's scale, times the
  norm's weight), `W_Q[n]`, the QK-norm (divided by the run's per-head scale, times its weight) and rotary (a
  rotation at position t: a linear map); k_n^j(s) likewise with `W_K`. Each side is kept per head as
  [component, head, d_head] vectors; a term is their dot product, never a stored 4-D array.
- b: the branches of pre-compose (Eq. 7), with W_b[n, m] at (t, s): `skip` (the identity), `qp` (qw1[t]^T qw2[t]),
  `kp` (kw1[s]^T kw2[s]), `qg` (diag qg[t]), `kg` (diag kg[s]). The diagonal ones (`skip`, `qg`, `kg`) have only
  n = m. On plain MHA only n = m and `skip` remain: Kamath et al.'s QK attribution of the pre-softmax score.

`qk_attribution` returns every term (or, past `max_terms`, the largest with the rest summed in one row per key,
so the rows always add up to the score), the tables summed over heads and branches (component pairs) and over
components (source head x branch), and the post-compose head loadings (head m's final pattern as
sum_{n, b} W'_b[n, m] P_n[t, s]). `qk_contrast` explains a difference of two keys' scores (what moves the
softmax). `check_terms` (and `causal_checks`, for the top components) removes a component from a head's query (or
key) input and measures the change, frozen (equal to the component's terms) and not. The dynamic weights' own
inputs: `dcinterp.qk_weights`; the run both read: `dcinterp.qk_run`. docs/qk-attribution.md has the method, the
measurements and what it finds.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from .checks import check_head, check_layer, prompt_position
from .model import HookedDCFormer, at_least_float32, visible_keys
from .qk_run import (
    Intervention,
    branch_weights,
    component_names,
    compose_branches,
    key_positions,
    layer_run,
    residual_components,
    side_vectors,
    single_prompt,
)
from .qk_run import (
    normed_components as normed_components,  # imported from here before it had its own module
)

DIAGONAL_BRANCHES = ("skip", "qg", "kg")  # W_b diagonal: head n feeds only head n
TERM_COLUMNS = ["key_pos", "query_component", "key_component", "source_head", "branch", "value"]
REST = "rest"  # query_component, key_component and branch of the row that sums the terms left out
MAX_TERMS = 100_000  # rows of `.terms` (the rest summed per key past it)
MAX_TABLE_BYTES = 2**30  # component-pair tables kept per key: beyond this, ask for fewer keys


# --------------------------------------------------------------------------------------------------
# The terms
@dataclass
class _Member:
    """One key's contribution to a group of keys: its key-side vectors, its branch weights, a sign."""

    keys: Float[Tensor, "component head d_head"]
    weights: Float[Tensor, "branch source_head"]
    sign: float = 1.0


@dataclass
class _Terms:
    """What `_decompose` returns for G groups (a group: one key, or two with signs + and - for a contrast)."""

    pairs: Float[Tensor, "group component component"]  # summed over heads and branches
    head_branch: Float[Tensor, "group branch head"]  # summed over components
    query_marginal: Float[Tensor, "group head component"]  # summed over key components and branches
    key_marginal: Float[Tensor, "group head component"]
    totals: Float[Tensor, " group"]  # float64 sum of every term
    rows: pd.DataFrame  # group, query_component, key_component, source_head, branch, value (kept terms)
    complete: bool


def _present(branches: list[str], head: int, H: int) -> Tensor:
    """[branch, source head]: whether the term exists (the diagonal branches feed head m from head m only)."""
    present = torch.ones(len(branches), H, dtype=torch.bool)
    for b, branch in enumerate(branches):
        if branch in DIAGONAL_BRANCHES:
            present[b] = False
            present[b, head] = True
    return present


def _decompose(
    queries: Float[Tensor, "component head d_head"],
    groups: Iterable[list[_Member]],
    n_groups: int,
    branches: list[str],
    head: int,
    max_terms: int,
) -> _Terms:
    """Every (group, query component, key component, source head, branch) term, one source head at a time.

    Only the per-head query-side and key-side vectors are kept; head n's terms are
    sum over the group's keys of sign * W_b[n, head] * <q_n^i, k_n^j>, for the branches that feed `head` from n.
    With more terms than `max_terms`, the largest |value| are kept: a running top-k whose smallest kept |value|
    is the bar a later term must clear (one comparison per term), and the rest of each group goes in one row. The
    tables (pairs, source head x branch, marginals) are exact whatever is kept."""
    C, H, E = queries.shape
    B = len(branches)
    device = queries.device
    present = _present(branches, head, H).to(device)
    G = n_groups
    complete = G * C * C * int(present.sum()) <= max_terms
    keep = max_terms - G  # room for one rest row per group
    pairs = torch.zeros(G, C, C, device=device)
    head_branch = torch.zeros(G, B, H, dtype=torch.float64, device=device)
    query_marginal = torch.zeros(G, H, C, device=device)
    key_marginal = torch.zeros(G, H, C, device=device)
    totals = torch.zeros(G, dtype=torch.float64)
    kept_values, kept_index = torch.zeros(0, device=device), torch.zeros(0, 5, dtype=torch.long, device=device)
    bar = -1.0  # |value| a term must exceed to be kept: the smallest kept one, once `keep` are kept
    q_sum = queries.sum(0)  # [head, d_head]
    q_sum64 = queries.double().sum(0)
    for g, members in enumerate(groups):
        members = [(m.keys.to(device), m.weights.to(device), m.sign) for m in members]
        for K, W, sign in members:
            folded = W.sum(0)  # [head]: every branch's weight on head n
            pairs[g] += sign * (queries * folded[None, :, None]).flatten(1) @ K.flatten(1).T
            query_marginal[g] += sign * folded[:, None] * torch.einsum("ine,ne->ni", queries, K.sum(0))
            key_marginal[g] += sign * folded[:, None] * torch.einsum("ne,jne->nj", q_sum, K)
            scores = torch.einsum("ne,ne->n", q_sum64, K.double().sum(0))  # S_n, summed over both sides' components
            head_branch[g] += sign * W.double() * scores[None]
        head_branch[g] *= present
        totals[g] = float(head_branch[g].sum())
        for n in range(H):
            branch_index = present[:, n].nonzero()[:, 0]  # the branches that feed `head` from head n
            products = [(sign * W[branch_index, n], queries[:, n] @ K[:, n].T) for K, W, sign in members]
            if len(products) == 1 and bar >= 0 and not complete:  # one key: |w_b M| > bar iff |M| > bar / |w_b|
                (weights, M), size = products[0], products[0][1].numel()
                magnitude = M.abs().flatten()
                chosen = torch.cat(
                    [b * size + (magnitude > bar / abs(w)).nonzero()[:, 0] for b, w in enumerate(weights.tolist()) if w]
                    or [torch.zeros(0, dtype=torch.long, device=device)]
                )
                chosen_values = weights[chosen // size] * M.flatten()[chosen % size]
            else:
                values = sum(weights[:, None, None] * M[None] for weights, M in products).flatten()
                if complete or values.numel() <= keep and bar < 0:
                    chosen = torch.arange(values.numel(), device=device)
                elif bar < 0:
                    chosen = values.abs().topk(keep).indices
                else:
                    chosen = (values.abs() > bar).nonzero()[:, 0]
                chosen_values = values[chosen]
            b, i, j = torch.unravel_index(chosen, (len(branch_index), C, C))
            index = torch.stack([torch.full_like(b, g), branch_index[b], torch.full_like(b, n), i, j], dim=1)
            kept_values, kept_index = torch.cat([kept_values, chosen_values]), torch.cat([kept_index, index])
            if not complete and len(kept_values) >= keep:
                top = kept_values.abs().topk(keep).indices
                kept_values, kept_index = kept_values[top], kept_index[top]
                bar = float(kept_values.abs().min())
    rows = _term_rows(kept_values.cpu(), kept_index.cpu(), branches)
    if not complete:
        kept = rows.groupby("group")["value"].sum().reindex(range(G), fill_value=0.0)
        rest = pd.DataFrame(
            {
                "group": range(G),
                "query_component": REST,
                "key_component": REST,
                "source_head": pd.array([pd.NA] * G, dtype="Int64"),
                "branch": REST,
                "value": totals.numpy() - kept.to_numpy(),
            }
        )
        rows = pd.concat([rows, rest], ignore_index=True)
    return _Terms(
        pairs.cpu(),
        at_least_float32(head_branch).cpu(),
        query_marginal.cpu(),
        key_marginal.cpu(),
        totals,
        rows,
        complete,
    )


def _term_rows(values: Tensor, index: Tensor, branches: list[str]) -> pd.DataFrame:
    """index columns: group, branch, source head, query component, key component (components as integers)."""
    index = index.numpy()
    return pd.DataFrame(
        {
            "group": index[:, 0],
            "query_component": index[:, 3],
            "key_component": index[:, 4],
            "source_head": pd.array(index[:, 2], dtype="Int64"),
            "branch": np.asarray(branches, dtype=object)[index[:, 1]] if len(index) else [],
            "value": values.double().numpy(),
        }
    )


def _named(rows: pd.DataFrame, components: list[str]) -> pd.DataFrame:
    """Component indices as names (the rest row keeps its name)."""
    names = np.asarray([*components, REST], dtype=object)
    for column in ("query_component", "key_component"):
        values = rows[column].to_numpy(dtype=object)
        rows[column] = names[np.where(values == REST, len(components), values).astype(int)]
    return rows


# --------------------------------------------------------------------------------------------------
# Arguments and scale
def _check_max_terms(max_terms, groups: int) -> int:
    if isinstance(max_terms, bool) or not isinstance(max_terms, int) or max_terms <= groups:
        raise ValueError(
            f"max_terms must be an integer above the number of keys ({groups}: one row each sums the rest), "
            f"not {max_terms!r}"
        )
    return max_terms


def _check_table_size(n_keys: int, n_components: int, name: str) -> None:
    nbytes = n_keys * n_components**2 * 4
    if nbytes > MAX_TABLE_BYTES:
        at_most = max(1, MAX_TABLE_BYTES // (n_components**2 * 4))
        raise ValueError(
            f"{name}: {n_keys} keys x {n_components}^2 component pairs need {nbytes / 2**30:.1f} GiB of tables; "
            f"ask for at most {at_most} keys at once"
        )


def _str_tokens(model: HookedDCFormer, prompt: Tensor) -> list[str] | None:
    if model.tokenizer is None:
        return None
    return model.tokenizer.convert_ids_to_tokens(prompt[0].tolist())


def _score_scale(model: HookedDCFormer, run: dict[str, Tensor], layer: int, head: int, t: int, n: int) -> float:
    """The largest |score| of the head over the keys the query sees (what a gap is measured against)."""
    scores = at_least_float32(run["composed" if model.cfg.use_dcmha else "scores"][head]).cpu()
    visible = visible_keys(n, model.cfg.layer_window(layer), "cpu", model.cfg.window)[t]
    return max(float(scores[visible].abs().max()), 1e-30)


# --------------------------------------------------------------------------------------------------
# Views shared by the results
def _frame_table(values: Tensor, index: list, columns: list, index_name: str, columns_name: str) -> pd.DataFrame:
    frame = pd.DataFrame(values.double().numpy(), index=index, columns=columns)
    frame.index.name, frame.columns.name = index_name, columns_name
    return frame


def _pair_frame(pairs: Tensor, components: list[str], top: int | None) -> pd.DataFrame:
    frame = _frame_table(pairs, components, components, "query_component", "key_component")
    if top is None:
        return frame
    rows = frame.abs().sum(1).nlargest(top).index
    cols = frame.abs().sum(0).nlargest(top).index
    return frame.loc[rows, cols]


def _component_frame(query: Tensor, key: Tensor, components: list[str]) -> pd.DataFrame:
    """One row per component: its terms summed as a query-side component and as a key-side one."""
    return pd.DataFrame({"component": components, "query": query.double().numpy(), "key": key.double().numpy()})


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
        return _pair_frame(self.pairs[self.key_index(key_pos)], self.components, top)

    def head_branch_table(self, key_pos: int | None = None) -> pd.DataFrame:
        """[source head x branch] at one key, summed over components: W_b[n, head] * S_n[t, s].

        Args:
            key_pos: one of `key_pos`; None where the attribution has a single key.

        Returns:
            The table, source heads as rows.
        """
        table = self.head_branch[self.key_index(key_pos)].T
        return _frame_table(table, list(range(table.shape[0])), self.branches, "source_head", "branch")

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
        return _component_frame(query, key, self.components)

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
    present = _present(branches, head, model.cfg.n_heads)
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
    max_terms = _check_max_terms(max_terms, len(keys))
    components = component_names(model, layer)
    _check_table_size(len(keys), len(components), "key_pos")
    run = layer_run(model, prompt, layer, t, [t, *keys])
    queries, sides = _sides(model, run, layer, t, keys)
    weights = branch_weights(model, run, "pre", t, torch.tensor(keys), head)
    groups = ([_Member(side, w)] for side, w in zip(sides, weights, strict=True))  # one key side at a time
    terms = _decompose(queries, groups, len(keys), compose_branches(model, "pre"), head, max_terms)
    rows = _named(terms.rows, components)
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
        scale=_score_scale(model, run, layer, head, t, prompt.shape[1]),
        tokens=prompt[0].cpu(),
        str_tokens=_str_tokens(model, prompt),
    )


def _sides(model, run, layer: int, t: int, keys: list[int]):
    """(query-side vectors at t [component, head, d_head], key-side vectors at each key, one at a time)."""
    positions = torch.tensor([t])
    queries = side_vectors(model, run, layer, residual_components(model, run, layer, positions), positions, "q")[0]

    def key_sides():
        for s in keys:
            position = torch.tensor([s])
            yield side_vectors(model, run, layer, residual_components(model, run, layer, position), position, "k")[0]

    return queries, key_sides()


# --------------------------------------------------------------------------------------------------
# Why s rather than s'
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
        return _pair_frame(self.pairs, self.components, top)

    def head_branch_table(self) -> pd.DataFrame:
        """[source head x branch], summed over components."""
        return _frame_table(
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
        return _component_frame(self.query_marginal[heads].sum(0), self.key_marginal[heads].sum(0), self.components)

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
    max_terms = _check_max_terms(max_terms, 1)
    components = component_names(model, layer)
    run = layer_run(model, prompt, layer, t, [t, s, other])
    queries, sides = _sides(model, run, layer, t, [s, other])
    weights = branch_weights(model, run, "pre", t, torch.tensor([s, other]), head)
    members = [_Member(side, w, sign) for side, w, sign in zip(sides, weights, (1.0, -1.0), strict=True)]
    terms = _decompose(queries, [members], 1, compose_branches(model, "pre"), head, max_terms)
    rows = _named(terms.rows, components).drop(columns="group")
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
        scale=_score_scale(model, run, layer, head, t, prompt.shape[1]),
        str_tokens=_str_tokens(model, prompt),
    )


def _one(position, name: str):
    if position is None or isinstance(position, (list, tuple)) or isinstance(position, Tensor) and position.ndim:
        raise ValueError(f"{name} must be one position or word, not {position!r}")
    return position


# --------------------------------------------------------------------------------------------------
# Causal checks: remove a component from a head's query (or key) input and measure
SIDES = ("query", "key")


@dataclass
class QKCheck:
    """One component removed from the query (or key) input of one source head (or all), at one (t, s).

    Every number is the score lost, clean - ablated, of head `head`'s composed score at (query_pos, key_pos).

    Attributes:
        layer: the layer.
        head: the target head.
        query_pos: the query position t.
        key_pos: the key position s.
        component: the component removed.
        side: "query" or "key".
        source_head: the source head whose input loses the component; None: every source head's.
        estimate: the component's terms: what removing it must take away when nothing else moves.
        frozen: measured with ln1's scale, the QK-norm's scale and the dynamic weights held at the clean run's values
            (equal to the estimate up to rounding).
        norms: measured with both norms recomputed (the weights still frozen: the split input reaches q or k alone).
        weights: DCMHA only: with the component also removed from what the compose's dynamic weights read at that
            position, so the weights move too; None for plain MHA.
    """

    layer: int
    head: int
    query_pos: int
    key_pos: int
    component: str
    side: str
    source_head: int | None
    estimate: float
    frozen: float
    norms: float
    weights: float | None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@torch.no_grad()
def check_terms(
    model: HookedDCFormer,
    attribution: QKAttribution,
    component: str,
    side: str = "query",
    source_head: int | None = None,
    key_pos: int | None = None,
) -> QKCheck:
    """Removes a component from a head's query or key input and compares the change with its terms.

    The removal goes through the split q/k inputs (`hook_q_input` / `hook_k_input`). Six forwards of layers
    0..layer (five for plain MHA); `causal_checks` shares the clean ones between checks.

    Args:
        model: the model `attribution` was run on.
        attribution: from `qk_attribution`.
        component: a residual component of the layer (not `bias`).
        side: "query" or "key".
        source_head: the source head whose input loses the component; None: every head's.
        key_pos: one of the attribution's keys; None where it has a single key.

    Returns:
        The check.

    Raises:
        ValueError: an unknown side, component or key, `bias`, or a source head out of range.
    """
    _check_arguments(model, attribution, component, side, source_head)
    attribution.key_index(key_pos)
    return _Checker(model, attribution, key_pos).check(component, side, source_head)


def _check_arguments(model, attribution: QKAttribution, component: str, side: str, source_head) -> list[int]:
    """The source heads a check removes the component from, after checking its arguments."""
    if side not in SIDES:
        raise ValueError(f"side must be 'query' or 'key', not {side!r}")
    if component not in attribution.components:
        raise ValueError(
            f"component={component!r} is not one of the layer's components ({attribution.components[0]}, ...)"
        )
    if component == "bias":
        raise ValueError(
            "component='bias' holds ln1's bias and b_Q / b_K besides the b_O's in the stream: it cannot be "
            "removed from a head's input; check a residual component (embed, L{l}H{h}, MLP{l})"
        )
    return list(range(model.cfg.n_heads)) if source_head is None else [check_head(model, source_head, "source_head")]


class _Checker:
    """The checks of one attribution at one key: the clean run and the clean scores are computed once."""

    def __init__(self, model: HookedDCFormer, attribution: QKAttribution, key_pos: int | None):
        self.model, self.attribution = model, attribution
        self.k = attribution.key_index(key_pos)
        layer, t, s = attribution.layer, attribution.query_pos, attribution.key_pos[self.k]
        prompt = attribution.tokens[None].to(model.input_device)
        run = layer_run(model, prompt, layer, t, [t, s])
        self.vectors = {
            "query": residual_components(model, run, layer, torch.tensor([t]))[0],
            "key": residual_components(model, run, layer, torch.tensor([s]))[0],
        }
        self.measure = Intervention(model, prompt, layer, run, t, s, attribution.head)
        self.clean_frozen, self.clean = self.measure(freeze=True), self.measure()

    def check(self, component: str, side: str, source_head: int | None) -> QKCheck:
        model, a, k = self.model, self.attribution, self.k
        heads = _check_arguments(model, a, component, side, source_head)
        c = a.components.index(component)
        marginal = a.query_marginal if side == "query" else a.key_marginal
        estimate = float(marginal[k, heads, c].double().sum())
        t, s = a.query_pos, a.key_pos[k]
        remove = ("q" if side == "query" else "k", t if side == "query" else s, heads, self.vectors[side][c])
        frozen = self.clean_frozen - self.measure(remove=remove, freeze=True)
        norms = self.clean - self.measure(remove=remove)
        weights = self.clean - self.measure(remove=remove, from_compose=True) if model.cfg.use_dcmha else None
        return QKCheck(a.layer, a.head, t, s, component, side, source_head, estimate, frozen, norms, weights)


@torch.no_grad()
def causal_checks(
    model: HookedDCFormer,
    attribution: QKAttribution,
    k: int = 3,
    key_pos: int | None = None,
    checks: list[tuple[str, str, int | None]] | None = None,
) -> pd.DataFrame:
    """`check_terms` at one key for each (component, side, source_head) of `checks`.

    Every argument is checked before the first forward.

    Args:
        model: the model `attribution` was run on.
        attribution: from `qk_attribution`.
        k: by default, the k components with the largest |terms| on each side, through every source head (`bias`
            left out), and, in a DCMHA model, for the largest single term, its two components through its source head
            alone.
        key_pos: one of the attribution's keys; None where it has a single key.
        checks: (component, side, source_head) triples; None: the default above.

    Returns:
        One row per check, the fields of `QKCheck`.

    Raises:
        ValueError: as `check_terms`.
    """
    index = attribution.key_index(key_pos)
    s = attribution.key_pos[index]
    if checks is None:
        table = attribution.component_table(s)
        table = table[table["component"] != "bias"]
        checks = []
        for side in SIDES:
            top = table.reindex(table[side].abs().sort_values(ascending=False).index).head(k)
            checks += [(component, side, None) for component in top["component"]]
        terms = attribution.top_terms(len(attribution.terms), s)
        best = terms[(terms["query_component"] != "bias") & (terms["key_component"] != "bias")]
        best = best.head(1 if model.cfg.use_dcmha else 0)  # plain MHA: only the head's own input counts
        for term in best.itertuples():
            checks += [
                (term.query_component, "query", int(term.source_head)),
                (term.key_component, "key", int(term.source_head)),
            ]
    for component, side, source_head in checks:  # every argument checked before the first forward
        _check_arguments(model, attribution, component, side, source_head)
    checker = _Checker(model, attribution, s)
    rows = [checker.check(component, side, source_head).to_dict() for component, side, source_head in checks]
    frame = pd.DataFrame(rows, columns=list(QKCheck.__dataclass_fields__))
    frame["source_head"] = frame["source_head"].astype("Int64")
    return frame
