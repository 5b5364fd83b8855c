"""The paired study's table: the accuracies of a folder of runs, and the paired difference DCMHA - MHA per seed.

    python -m dcinterp.train --seeds 0-4 --out runs/study ...     # RUNS_DIR/seed<N>/<name>/recipe.json
    python -m dcinterp.train summarize runs/study                 # runs/study/summary.csv and summary.md
    python -m dcinterp.train summarize runs/study --head-diversity    # + each run's head diversity (Fig. 5)
    python -m dcinterp.train summarize runs/study --figures figs     # + the study's figures (PNG), see below
    python -m dcinterp.train summarize runs/study-heldout --trained-on runs/study   # + held_out_change rows
    python -m dcinterp.train summarize --from-table docs/study-data --out DIR   # the study page's tables (below)

One module per step, every name importable from `dcinterp.study`:

    runs          read_runs, read_screen, add_head_diversity, add_held_out_change: a folder of runs read, paired
                  by seed; the screen of their starts; head diversity (QK normalised per head, OV raw)
    statistics    sign_flip_interval, paired_permutation_p: the interval and p over seeds; t_interval, holm,
                  paired_t_power, seeds_for_power: the t tools the study page compares them with
    tables        read_study, summary_table, markdown, write_study: the study's table (summary.csv, summary.md)
    page          read_table_data, page_tables: the study page's tables from its committed data (docs/study-data)
    figures       write_figures, write_table_figures: the study's figures (dcinterp.plotting's plot_study_*)
    command       main: `python -m dcinterp.train summarize`
"""

from .command import (
    main,
    summarize_table,
)
from .figures import (
    write_figures,
    write_table_figures,
)
from .page import (
    ARM_NAMES,
    EXPLORATORY,
    PATTERN_NAMES,
    TABLE_FILES,
    TableData,
    exploratory_markdown,
    exploratory_table,
    least_p,
    lookup_markdown,
    matched_markdown,
    measure_label,
    page_tables,
    per_seed_markdown,
    points,
    power_markdown,
    primary_endpoint,
    primary_markdown,
    read_table_data,
    screen_markdown,
    seeds_named,
    table_values,
)
from .runs import (
    ARCHES,
    DIVERSITY_NORMALIZE,
    LOWER_IS_AHEAD,
    MAY_DIFFER,
    MAY_DIFFER_BETWEEN_ARCHES,
    MEASURES,
    SCREEN_COLUMNS,
    WEIGHTS,
    RunResult,
    add_head_diversity,
    add_held_out_change,
    check_one_recipe,
    check_same_recipe,
    check_trained_on_every_task,
    diversity_frame,
    diversity_measures,
    learning_curves,
    loss_or_nan,
    mlp_widths,
    read_run,
    read_runs,
    read_screen,
    read_screened_out,
    run_values,
    same_start,
    screen_lines,
    width_lines,
)
from .statistics import (
    MAX_EXACT_SEEDS,
    holm,
    paired_permutation_p,
    paired_t_power,
    seeds_for_power,
    sign_flip_interval,
    subset_means,
    t_interval,
)
from .tables import (
    Study,
    markdown,
    paired_table,
    read_study,
    summary_table,
    write_study,
    write_summary,
)

__all__ = [
    "ARCHES",
    "MEASURES",
    "LOWER_IS_AHEAD",
    "WEIGHTS",
    "DIVERSITY_NORMALIZE",
    "MAY_DIFFER",
    "MAY_DIFFER_BETWEEN_ARCHES",
    "RunResult",
    "read_run",
    "read_runs",
    "check_one_recipe",
    "mlp_widths",
    "width_lines",
    "check_same_recipe",
    "add_held_out_change",
    "check_trained_on_every_task",
    "SCREEN_COLUMNS",
    "loss_or_nan",
    "same_start",
    "read_screened_out",
    "read_screen",
    "screen_lines",
    "add_head_diversity",
    "diversity_measures",
    "run_values",
    "diversity_frame",
    "learning_curves",
    "MAX_EXACT_SEEDS",
    "subset_means",
    "sign_flip_interval",
    "t_interval",
    "holm",
    "paired_t_power",
    "seeds_for_power",
    "paired_permutation_p",
    "summary_table",
    "paired_table",
    "markdown",
    "Study",
    "read_study",
    "write_summary",
    "write_study",
    "write_figures",
    "TABLE_FILES",
    "ARM_NAMES",
    "EXPLORATORY",
    "PATTERN_NAMES",
    "TableData",
    "read_table_data",
    "table_values",
    "points",
    "measure_label",
    "exploratory_table",
    "least_p",
    "exploratory_markdown",
    "primary_endpoint",
    "primary_markdown",
    "screen_markdown",
    "per_seed_markdown",
    "matched_markdown",
    "seeds_named",
    "lookup_markdown",
    "power_markdown",
    "page_tables",
    "write_table_figures",
    "main",
    "summarize_table",
]
