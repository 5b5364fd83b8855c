"""The study's figures as PNGs, drawn by dcinterp.plotting's plot_study_*: a folder of runs' (`--figures DIR`),
and those the study page's committed data can draw (`--from-table DATA_DIR --figures DIR`).
"""

from __future__ import annotations

from pathlib import Path

from .page import TableData, table_values
from .runs import diversity_frame, learning_curves, mlp_widths
from .tables import Study, paired_table


def write_figures(study: Study, figures_dir: Path) -> list[Path]:
    """The study's figures as PNGs (dcinterp.plotting: plot_study_*).

    Args:
        study: from `read_study`.
        figures_dir: where the PNGs go, made if need be.

    Returns:
        The paths written.
    """
    from ..plotting import (
        plot_study_differences,
        plot_study_head_diversity,
        plot_study_held_out,
        plot_study_learning_curves,
    )

    figures_dir.mkdir(parents=True, exist_ok=True)
    table = study.table
    widths = mlp_widths(study.runs)
    baseline = "MHA" if widths is None else f"MHA (d_mlp {widths['mha']})"
    figures = {}
    for eval_set in table.loc[table["measure"].isin(["qk_pattern", "ov_transformation"]), "eval_set"].unique():
        figures[f"differences_{eval_set}.png"] = plot_study_differences(table, eval_set, baseline=baseline)
    if (table["measure"] == "held_out_combos").any():
        figures["held_out_combos.png"] = plot_study_held_out(table)
    diversity = diversity_frame(study.runs)
    if not diversity.empty:
        config = study.runs[0].config  # one recipe's runs: the same shape
        figures["head_diversity.png"] = plot_study_head_diversity(
            diversity, marks=(config["n_heads"], config["d_head"])
        )
    curves = learning_curves(study.runs)
    if not curves.empty:
        figures["learning_curves.png"] = plot_study_learning_curves(curves)
    written = []
    for name, fig in figures.items():
        fig.savefig(figures_dir / name, dpi=120)
        written.append(figures_dir / name)
    return written


def write_table_figures(data: TableData, figures_dir: Path, level: float = 0.95) -> list[Path]:
    """The study page's figures that its data can draw: DCMHA - MHA per seed and per measure.

    study_differences_released.png (every task trained) and study_heldout_differences_released.png (8 tasks never
    trained).

    Args:
        data: the page's data.
        figures_dir: where the PNGs go, made if need be.
        level: the least level of the sign-flip interval.

    Returns:
        The paths written.
    """
    from ..plotting import plot_study_differences

    figures_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for study, name in (
        ("full", "study_differences_released.png"),
        ("held_out", "study_heldout_differences_released.png"),
    ):
        table = paired_table(table_values(data, study, {"dcmha": "dcmha", "mha": "mha"}), level)
        plot_study_differences(table, "released").savefig(figures_dir / name, dpi=120)
        written.append(figures_dir / name)
    return written
