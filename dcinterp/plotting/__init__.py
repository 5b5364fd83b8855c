"""Figures for the results of `attribution`, `composition`, `qk`, `circuits`, `patching`, `discovery`, the synthetic
evaluation, the study and attribution graphs: one module per analysis family, every name importable from
`dcinterp.plotting`.

Every function takes results (tensors, dataclasses, DataFrames), never a model, and returns a figure
(`matplotlib.figure.Figure`, or `plotly.graph_objects.Figure` for the `*_plotly` ones); nothing is shown.
Figures are built without pyplot (no global state, no open windows): `fig.savefig(path)`, or in a notebook with
the inline backend (`%matplotlib inline`) end a cell with `fig`; a plotly figure becomes a page that opens offline
with `write_plotly_page(fig, path)`.
Token labels are optional everywhere (`str_tokens`, `query_token`, ...): pass `model.to_str_tokens(prompt)`.

Conventions (`style`): signed values use a diverging colormap centred at zero, with one scale shared by every panel
of a figure that shows the same quantity and a colour bar per quantity, labelled with it; small heatmaps carry their
numbers, in one format per figure. Figures are at most `PAGE_WIDTH` inches wide with type of at least
`SMALLEST_TYPE` points, so that they stay legible shrunk into a docs page's 690-px column; a wider layout
stacks its panels. Captions belong to the page (or the notebook's markdown), not the image: each docstring says
what its figure shows, and `caption=` draws a line under the figure where one is wanted.

    style         conventions and shared helpers; token_label, write_plotly_page (a plotly figure as a page)
    attribution   plot_head_attribution             layer x head heatmap of IG scores, top heads marked
                  plot_head_attribution_plotly      the same, interactive
    composition   plot_composition_maps             H x H composition maps C = W^T (Fig. 1 style), in a grid
                  plot_composition_map_plotly       one map, interactive
                  plot_composition_along_sequence   how far the composition map is from the identity, key by key
                  plot_compose_breakdown            one attention vector through a Compose stage (Fig. 7 style)
                  plot_attention_distributions      attention before/after composition and w_k1 (Fig. 8)
    qk            plot_qk_attribution               why a head attends to a key: component pairs, source head x
                                                    branch, checks
                  plot_qk_keys_plotly               the same for every key of a query, interactive
    circuits      plot_head_diversity               cumulative captured variance of QK / OV circuits (Fig. 5)
                  diversity_verdict                 what those curves say, in numbers
    synthetic     plot_synthetic_eval               synthetic-task accuracy with intervals and chance (Table 5, Fig. 6)
    patching      plot_patching                     patching tables side by side on one scale
                  plot_patching_agreement           attribution patching against exact patching
                  plot_ablation_table               accuracy change when each part of the compose is switched off
    discovery     plot_faithfulness                 faithfulness against circuit size
                  plot_circuit                      a circuit drawn layer by layer
    study         plot_study_differences            DCMHA - MHA per QK pattern / OV transformation, per seed
                  plot_study_held_out               each seed's twins on the held-out combinations
                  plot_study_head_diversity         Fig. 5's curves of every run, per architecture
                  plot_study_learning_curves        probe accuracy against the step, the shared start marked
    graph         plot_attribution_graph            a pruned attribution graph: tokens, features by layer, logits
                  write_graph_html                  the same as an offline interactive page
"""

from .attribution import plot_head_attribution, plot_head_attribution_plotly
from .circuits import diversity_verdict, plot_head_diversity
from .composition import (
    plot_attention_distributions,
    plot_compose_breakdown,
    plot_composition_along_sequence,
    plot_composition_map_plotly,
    plot_composition_maps,
)
from .discovery import BRANCH_COLORS, INPUT_COLORS, plot_circuit, plot_faithfulness
from .graph import plot_attribution_graph, write_graph_html
from .patching import plot_ablation_table, plot_patching, plot_patching_agreement
from .qk import plot_qk_attribution, plot_qk_keys_plotly
from .study import (
    HELD_OUT_LABELS,
    STUDY_ARCHES,
    plot_study_differences,
    plot_study_head_diversity,
    plot_study_held_out,
    plot_study_learning_curves,
)
from .style import (
    DIVERGING,
    MAX_ANNOTATED_CELLS,
    PAGE_WIDTH,
    SEQUENTIAL,
    SMALLEST_TYPE,
    token_label,
    write_plotly_page,
)
from .synthetic import plot_synthetic_eval

__all__ = [
    "BRANCH_COLORS",
    "DIVERGING",
    "HELD_OUT_LABELS",
    "INPUT_COLORS",
    "MAX_ANNOTATED_CELLS",
    "PAGE_WIDTH",
    "SEQUENTIAL",
    "SMALLEST_TYPE",
    "STUDY_ARCHES",
    "diversity_verdict",
    "plot_ablation_table",
    "plot_attribution_graph",
    "plot_attention_distributions",
    "plot_circuit",
    "plot_compose_breakdown",
    "plot_composition_along_sequence",
    "plot_composition_map_plotly",
    "plot_composition_maps",
    "plot_faithfulness",
    "plot_head_attribution",
    "plot_head_attribution_plotly",
    "plot_head_diversity",
    "plot_patching",
    "plot_patching_agreement",
    "plot_qk_attribution",
    "plot_qk_keys_plotly",
    "plot_study_differences",
    "plot_study_head_diversity",
    "plot_study_held_out",
    "plot_study_learning_curves",
    "plot_synthetic_eval",
    "token_label",
    "write_graph_html",
    "write_plotly_page",
]
