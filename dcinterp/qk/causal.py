"""Causal checks of the terms: remove a component from a head's query (or key) input and measure the score lost,
frozen (equal to the component's terms), with the norms recomputed, and with the dynamic weights moving too.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch

from ..checks import check_head
from ..model import HookedDCFormer
from ..qk_run import Intervention, layer_run, residual_components
from .attribution import QKAttribution

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
