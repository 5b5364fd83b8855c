"""The terms of a head's composed score: the decomposition shared by `qk_attribution` and `qk_contrast`.

`decompose` sums every (group, query component, key component, source head, branch) term one source head at a time,
keeping the largest past `max_terms` and one `rest` row per group; the helpers around it check the arguments, name
the components and shape the tables both results show (`dcinterp.qk` has the formula).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from ..model import HookedDCFormer, at_least_float32, visible_keys
from ..qk_run import residual_components, side_vectors

DIAGONAL_BRANCHES = ("skip", "qg", "kg")  # W_b diagonal: head n feeds only head n
TERM_COLUMNS = ["key_pos", "query_component", "key_component", "source_head", "branch", "value"]
REST = "rest"  # query_component, key_component and branch of the row that sums the terms left out
MAX_TERMS = 100_000  # rows of `.terms` (the rest summed per key past it)
MAX_TABLE_BYTES = 2**30  # component-pair tables kept per key: beyond this, ask for fewer keys


# --------------------------------------------------------------------------------------------------
# The terms
@dataclass
class Member:
    """One key's contribution to a group of keys: its key-side vectors, its branch weights, a sign.

    Attributes:
        keys: the key-side vectors [component, head, d_head].
        weights: W_b[n, m] at the key [branch, source head].
        sign: +1, or -1 for the second key of a contrast.
    """

    keys: Float[Tensor, "component head d_head"]
    weights: Float[Tensor, "branch source_head"]
    sign: float = 1.0


@dataclass
class Terms:
    """What `decompose` returns for G groups (a group: one key, or two with signs + and - for a contrast).

    Attributes:
        pairs: summed over heads and branches [group, component, component].
        head_branch: summed over components [group, branch, head].
        query_marginal: summed over key components and branches [group, head, component].
        key_marginal: summed over query components and branches [group, head, component].
        totals: the float64 sum of every term [group].
        rows: the kept terms: group, query_component, key_component, source_head, branch, value.
        complete: every term is a row.
    """

    pairs: Float[Tensor, "group component component"]  # summed over heads and branches
    head_branch: Float[Tensor, "group branch head"]  # summed over components
    query_marginal: Float[Tensor, "group head component"]  # summed over key components and branches
    key_marginal: Float[Tensor, "group head component"]
    totals: Float[Tensor, " group"]  # float64 sum of every term
    rows: pd.DataFrame  # group, query_component, key_component, source_head, branch, value (kept terms)
    complete: bool


def present_terms(branches: list[str], head: int, H: int) -> Tensor:
    """Which terms exist: the diagonal branches feed head m from head m only.

    Args:
        branches: the branches.
        head: the target head m.
        H: the number of heads.

    Returns:
        A bool [branch, source head].
    """
    present = torch.ones(len(branches), H, dtype=torch.bool)
    for b, branch in enumerate(branches):
        if branch in DIAGONAL_BRANCHES:
            present[b] = False
            present[b, head] = True
    return present


def decompose(
    queries: Float[Tensor, "component head d_head"],
    groups: Iterable[list[Member]],
    n_groups: int,
    branches: list[str],
    head: int,
    max_terms: int,
) -> Terms:
    """Every (group, query component, key component, source head, branch) term, one source head at a time.

    Only the per-head query-side and key-side vectors are kept; head n's terms are
    sum over the group's keys of `sign * W_b[n, head] * <q_n^i, k_n^j>`, for the branches that feed `head` from n.
    With more terms than `max_terms`, the largest |value| are kept: a running top-k whose smallest kept |value|
    is the bar a later term must clear (one comparison per term), and the rest of each group goes in one row. The
    tables (pairs, source head x branch, marginals) are exact whatever is kept.

    Args:
        queries: the query-side vectors [component, head, d_head].
        groups: per group, its members (a key's key-side vectors, branch weights and sign).
        n_groups: how many groups.
        branches: the branches.
        head: the target head.
        max_terms: rows kept at most (one of them per group sums the rest).

    Returns:
        The terms and their tables.
    """
    C, H, E = queries.shape
    B = len(branches)
    device = queries.device
    present = present_terms(branches, head, H).to(device)
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
    return Terms(
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


def named(rows: pd.DataFrame, components: list[str]) -> pd.DataFrame:
    """Component indices as names (the rest row keeps its name).

    Args:
        rows: terms with integer query_component and key_component columns.
        components: the components' names.

    Returns:
        `rows`, its components named.
    """
    names = np.asarray([*components, REST], dtype=object)
    for column in ("query_component", "key_component"):
        values = rows[column].to_numpy(dtype=object)
        rows[column] = names[np.where(values == REST, len(components), values).astype(int)]
    return rows


# --------------------------------------------------------------------------------------------------
# Arguments and scale
def check_max_terms(max_terms, groups: int) -> int:
    """`max_terms`, checked: an integer above the number of groups (one row each sums the rest).

    Args:
        max_terms: the argument.
        groups: the number of groups (keys).

    Returns:
        max_terms.

    Raises:
        ValueError: not an integer above `groups`.
    """
    if isinstance(max_terms, bool) or not isinstance(max_terms, int) or max_terms <= groups:
        raise ValueError(
            f"max_terms must be an integer above the number of keys ({groups}: one row each sums the rest), "
            f"not {max_terms!r}"
        )
    return max_terms


def check_table_size(n_keys: int, n_components: int, name: str) -> None:
    """Refuses component-pair tables of more than `MAX_TABLE_BYTES`.

    Args:
        n_keys: the keys, one table each.
        n_components: the components.
        name: the argument named in the error.

    Raises:
        ValueError: the tables would be too large; it says how many keys fit.
    """
    nbytes = n_keys * n_components**2 * 4
    if nbytes > MAX_TABLE_BYTES:
        at_most = max(1, MAX_TABLE_BYTES // (n_components**2 * 4))
        raise ValueError(
            f"{name}: {n_keys} keys x {n_components}^2 component pairs need {nbytes / 2**30:.1f} GiB of tables; "
            f"ask for at most {at_most} keys at once"
        )


def str_tokens(model: HookedDCFormer, prompt: Tensor) -> list[str] | None:
    """The prompt's tokens as text.

    Args:
        model: the model.
        prompt: one prompt [1, pos].

    Returns:
        The tokens, or None where the model has no tokenizer.
    """
    if model.tokenizer is None:
        return None
    return model.tokenizer.convert_ids_to_tokens(prompt[0].tolist())


def score_scale(model: HookedDCFormer, run: dict[str, Tensor], layer: int, head: int, t: int, n: int) -> float:
    """The largest |score| of the head over the keys the query sees (what a gap is measured against).

    Args:
        model: the model.
        run: the layer's run (`qk_run.layer_run`).
        layer: the layer.
        head: the head.
        t: the query position.
        n: the prompt's length.

    Returns:
        The scale (at least 1e-30).
    """
    scores = at_least_float32(run["composed" if model.cfg.use_dcmha else "scores"][head]).cpu()
    visible = visible_keys(n, model.cfg.layer_window(layer), "cpu", model.cfg.window)[t]
    return max(float(scores[visible].abs().max()), 1e-30)


# --------------------------------------------------------------------------------------------------
# Views shared by the results
def frame_table(values: Tensor, index: list, columns: list, index_name: str, columns_name: str) -> pd.DataFrame:
    """A 2-D tensor as a float64 table with named axes.

    Args:
        values: [row, column].
        index: the rows' labels.
        columns: the columns' labels.
        index_name: the rows' axis name.
        columns_name: the columns' axis name.

    Returns:
        The table.
    """
    frame = pd.DataFrame(values.double().numpy(), index=index, columns=columns)
    frame.index.name, frame.columns.name = index_name, columns_name
    return frame


def pair_frame(pairs: Tensor, components: list[str], top: int | None) -> pd.DataFrame:
    """[query component x key component] as a table.

    Args:
        pairs: [component, component].
        components: the components' names.
        top: keep the `top` rows and columns with the largest |sums|; None: all.

    Returns:
        The table, query components as rows.
    """
    frame = frame_table(pairs, components, components, "query_component", "key_component")
    if top is None:
        return frame
    rows = frame.abs().sum(1).nlargest(top).index
    cols = frame.abs().sum(0).nlargest(top).index
    return frame.loc[rows, cols]


def component_frame(query: Tensor, key: Tensor, components: list[str]) -> pd.DataFrame:
    """One row per component: its terms summed as a query-side component and as a key-side one.

    Args:
        query: each component's query-side sum [component].
        key: each component's key-side sum [component].
        components: the components' names.

    Returns:
        Columns component, query, key.
    """
    return pd.DataFrame({"component": components, "query": query.double().numpy(), "key": key.double().numpy()})


def query_and_key_sides(model, run, layer: int, t: int, keys: list[int]):
    """The query-side vectors at t and the key-side vectors at each key, one key at a time.

    Args:
        model: the model.
        run: the layer's run (`qk_run.layer_run`).
        layer: the layer.
        t: the query position.
        keys: the key positions.

    Returns:
        (queries [component, head, d_head], an iterator of each key's [component, head, d_head]).
    """
    positions = torch.tensor([t])
    queries = side_vectors(model, run, layer, residual_components(model, run, layer, positions), positions, "q")[0]

    def key_sides():
        for s in keys:
            position = torch.tensor([s])
            yield side_vectors(model, run, layer, residual_components(model, run, layer, position), position, "k")[0]

    return queries, key_sides()
