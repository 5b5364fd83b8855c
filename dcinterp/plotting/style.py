"""What every figure of `dcinterp.plotting` shares: its conventions, as constants, and the helpers that draw them.

Signed values use a diverging colormap centred at zero (`diverging_heatmap`), with one scale shared by every panel
of a figure that shows the same quantity (`symmetric_limit`); small heatmaps carry their numbers in one format
(`annotate_cells`, `format_cell`). Figures are at most `PAGE_WIDTH` inches wide with type of at least
`SMALLEST_TYPE` points. Titles and captions are wrapped to the figure's width (`draw_title`, `draw_caption`).
"""

from __future__ import annotations

import html
import re
import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
import torch
from matplotlib.figure import Figure

DIVERGING = "RdBu_r"
SEQUENTIAL = "viridis"  # for values in [0, 1] (accuracies)
MAX_ANNOTATED_CELLS = 200  # heatmaps with more cells than this are not annotated
# A figure W inches wide shown in a 690-px column is scaled by 690 / (W dpi), so f-point type is 9.6 f / W px
# there, whatever the dpi: 7.5 inches and 8-point type give 10 px.
PAGE_WIDTH = 7.5
SMALLEST_TYPE = 8


def to_numpy(x) -> np.ndarray:
    """A tensor or array-like as a float NumPy array, detached and on the CPU.

    Args:
        x: A tensor (any dtype or device) or anything `np.asarray` reads.

    Returns:
        The values as a float array (float32 from a tensor, float64 otherwise).
    """
    return x.detach().float().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=float)


def symmetric_limit(*arrays: np.ndarray) -> float:
    """The largest |value| over all arrays: the shared limit of a diverging scale.

    Args:
        *arrays: The values one scale must cover; NaNs are ignored.

    Returns:
        The largest absolute value, or 1.0 where every value is zero or NaN (or no array is given).
    """
    values = np.concatenate([np.ravel(a) for a in arrays]) if arrays else np.zeros(0)
    limit = float(np.nanmax(np.abs(values))) if values.size and not np.all(np.isnan(values)) else 1.0
    return limit if limit > 0 else 1.0


def diverging_heatmap(ax, values: np.ndarray, limit: float | None = None, norm=None):
    """A heatmap centred on zero: blue negative, red positive.

    Args:
        ax: The matplotlib axes to draw on.
        values: The [rows, columns] values.
        limit: The scale's half-width; default `symmetric_limit(values)`.
        norm: A matplotlib norm to use in place of the linear scale (e.g. `SymLogNorm`); `limit` is then unused.

    Returns:
        The image, for a colour bar.
    """
    if norm is not None:
        return ax.imshow(values, cmap=DIVERGING, norm=norm, aspect="auto")
    limit = limit or symmetric_limit(values)
    return ax.imshow(values, cmap=DIVERGING, vmin=-limit, vmax=limit, aspect="auto")


def diverging_heatmap_plotly(values: np.ndarray, **properties) -> go.Heatmap:
    """`diverging_heatmap` for plotly: a heatmap trace centred on zero, blue negative, red positive.

    Args:
        values: The [rows, columns] values; the scale's half-width is `symmetric_limit(values)`.
        **properties: Further `go.Heatmap` properties (colorbar, hovertemplate, x, y, ...).

    Returns:
        The heatmap trace.
    """
    limit = symmetric_limit(values)
    return go.Heatmap(z=values, colorscale="RdBu", reversescale=True, zmin=-limit, zmax=limit, **properties)


def head_ticks(ax, n: int, axis: str, labels: Sequence[str] | None = None, max_ticks: int = 40) -> None:
    """Tick labels for `n` heads (or layers) along one axis, at most `max_ticks` of them.

    Args:
        ax: The matplotlib axes.
        n: The number of rows or columns.
        axis: "x" or "y"; any other value labels y.
        labels: A name per position (written vertically on x); default the positions' numbers.
        max_ticks: The most ticks drawn; every k-th position is labelled beyond it.
    """
    step = max(1, int(np.ceil(n / max_ticks)))
    ticks = list(range(0, n, step))
    names = [labels[i] for i in ticks] if labels is not None else [str(i) for i in ticks]
    if axis == "x":
        ax.set_xticks(ticks, names, rotation=90 if labels is not None else 0)
    else:
        ax.set_yticks(ticks, names)


def format_cell(value: float) -> str:
    """A heatmap cell's value in two decimals, one format for every cell.

    Args:
        value: The value.

    Returns:
        The text; a value that rounds to zero is written 0.00, never -0.00.
    """
    return f"{value + 0.0:.2f}" if round(value, 2) != 0 else "0.00"


def annotate_cells(
    ax, values: np.ndarray, fontsize: float = SMALLEST_TYPE, limit: float | None = None, fmt=format_cell
) -> None:
    """Write each cell's value on a heatmap drawn by `diverging_heatmap`, in white on the dark cells.

    Nothing is written on a heatmap of more than `MAX_ANNOTATED_CELLS` cells; NaN cells stay blank.

    Args:
        ax: The axes holding the heatmap.
        values: The [rows, columns] values drawn.
        fontsize: The type size, in points.
        limit: The colour scale's half-width, which sets where the text turns white (above 0.6 of it); default
            `symmetric_limit(values)`.
        fmt: How a value is written.
    """
    if values.size > MAX_ANNOTATED_CELLS:
        return
    limit = limit or symmetric_limit(values)
    for (row, col), value in np.ndenumerate(values):
        if not np.isnan(value):
            ax.text(
                col,
                row,
                fmt(value),
                ha="center",
                va="center",
                fontsize=fontsize,
                color="white" if abs(value) > 0.6 * limit else "black",
            )


def token_label(token: str) -> str:
    """A token as a tick label: line breaks and tabs written out, leading/trailing spaces shown as '·'.

    Args:
        token: The token's text, e.g. from `model.to_str_tokens(prompt)`.

    Returns:
        The label.
    """
    text = str(token).replace("\n", "\\n").replace("\t", "\\t")
    stripped = text.strip(" ")
    left, right = len(text) - len(text.lstrip(" ")), len(text) - len(text.rstrip(" "))
    return "·" * left + stripped + "·" * right if stripped else "·" * len(text)


def draw_caption(fig: Figure, text: str | None) -> None:
    """The caller's caption as a line under the figure, wrapped to its width and laid out by the constrained layout.

    Args:
        fig: The figure.
        text: The caption; nothing is drawn without one (a page says what its figure shows).
    """
    if text:
        width = max(50, int(fig.get_figwidth() * 12))
        fig.supxlabel(textwrap.fill(text, width), fontsize=9, color="0.2", x=0.01, ha="left")


def draw_title(fig, text: str, fontsize: float = 11) -> None:
    """A figure title wrapped to the figure's width.

    Args:
        fig: The figure (or subfigure).
        text: The title.
        fontsize: The type size, in points.
    """
    width = max(40, int(fig.get_figwidth() * 72 / (0.55 * fontsize)))
    fig.suptitle(textwrap.fill(text, width), fontsize=fontsize)


def write_plotly_page(fig: go.Figure, path: str | Path, title: str | None = None) -> Path:
    """Write a plotly figure as a self-contained HTML page.

    plotly.js is inlined, so the page opens offline, and the page has no random id, so a rerun writes the same
    bytes. plotly's own `write_html` leaves the page's `<title>` (what a browser tab and a bookmark show) empty.

    Args:
        fig: The plotly figure.
        path: The file to write.
        title: The page's `<title>`; default the figure's own title, or else the file's name.

    Returns:
        The path written.

    Raises:
        ValueError: plotly's page has no `</head>` to put the title before.
    """
    path = Path(path)
    title = title or fig.layout.title.text or path.stem
    page = fig.to_html(include_plotlyjs=True, full_html=True, div_id=path.stem)  # no random id: reruns are identical
    page, found = re.subn("</head>", lambda m: f"<title>{html.escape(title)}</title>\n</head>", page, count=1)
    if not found:  # never silent: a plotly whose page has no head would otherwise write a page without a title
        raise ValueError("fig: plotly's page has no </head> to put the title before")
    path.write_text(page, encoding="utf-8")
    return path
