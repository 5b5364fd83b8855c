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

One module per part, every name importable from `dcinterp.qk` (and, as before the split, the names of
`dcinterp.qk_run` that they read):

    terms         decompose and the helpers the results share (tables, argument checks, the score's scale)
    attribution   QKAttribution, qk_attribution      a head's composed score at each key as a sum of terms
    contrast      QKContrast, qk_contrast            the difference of two keys' scores as a sum of terms
    causal        QKCheck, check_terms,              a component removed from a head's query or key input
                  causal_checks
"""

from ..qk_run import (
    Intervention,
    branch_weights,
    component_names,
    compose_branches,
    key_positions,
    layer_run,
    normed_components,
    residual_components,
    side_vectors,
    single_prompt,
)
from .attribution import QKAttribution, qk_attribution
from .causal import SIDES, QKCheck, causal_checks, check_terms
from .contrast import QKContrast, qk_contrast
from .terms import DIAGONAL_BRANCHES, MAX_TABLE_BYTES, MAX_TERMS, REST, TERM_COLUMNS

__all__ = [
    "DIAGONAL_BRANCHES",
    "MAX_TABLE_BYTES",
    "MAX_TERMS",
    "REST",
    "SIDES",
    "TERM_COLUMNS",
    "Intervention",
    "QKAttribution",
    "QKCheck",
    "QKContrast",
    "branch_weights",
    "causal_checks",
    "check_terms",
    "component_names",
    "compose_branches",
    "key_positions",
    "layer_run",
    "normed_components",
    "qk_attribution",
    "qk_contrast",
    "residual_components",
    "side_vectors",
    "single_prompt",
]
