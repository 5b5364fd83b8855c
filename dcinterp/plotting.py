"""Figures for the results of `attribution`, `composition`, `circuits` and the synthetic evaluation.

Every function takes results (tensors, dataclasses, dicts), never a model, and returns a figure
(`matplotlib.figure.Figure`, or `plotly.graph_objects.Figure` for the `*_plotly` ones); nothing is shown.
Figures are built without pyplot (no global state, no open windows): `fig.savefig(path)`, or in a notebook with
the inline backend (`%matplotlib inline`) end a cell with `fig`.
Token labels are optional everywhere (`str_tokens`, `query_token`, ...): pass `model.to_str_tokens(prompt)`.

    plot_head_attribution        layer x head heatmap of IG scores, top heads marked
    plot_composition_maps        H x H composition maps (Fig. 1 style)
    plot_compose_breakdown       one attention vector through a Compose stage (Fig. 7 style)
    plot_attention_distributions attention before/after composition and w_k1 along the sequence (Fig. 8)
    plot_head_diversity          cumulative captured variance of QK / OV circuits, models side by side (Fig. 5)
    plot_synthetic_eval          synthetic-task accuracy by shots, task, QK pattern, OV transformation (Table 5, Fig. 6)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import plotly.graph_objects as go
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from .attribution import HeadAttribution
from .circuits import HeadDiversity
from .composition import AttentionDistributions, ComposeBreakdown

DIVERGING = "RdBu_r"


def _np(x) -> np.ndarray:
    return x.detach().float().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=float)


def _symmetric_limit(values: np.ndarray) -> float:
    limit = float(np.nanmax(np.abs(values))) if values.size else 1.0
    return limit if limit > 0 else 1.0


def _diverging(ax, values: np.ndarray):
    """A heatmap centred on zero (blue negative, red positive); returns the image for a colorbar."""
    limit = _symmetric_limit(values)
    return ax.imshow(values, cmap=DIVERGING, vmin=-limit, vmax=limit, aspect="auto")


def _head_ticks(ax, n: int, axis: str, labels: Sequence[str] | None = None, max_ticks: int = 40) -> None:
    step = max(1, int(np.ceil(n / max_ticks)))
    ticks = list(range(0, n, step))
    names = [labels[i] for i in ticks] if labels is not None else [str(i) for i in ticks]
    if axis == "x":
        ax.set_xticks(ticks, names, rotation=90 if labels is not None else 0)
    else:
        ax.set_yticks(ticks, names)


def _fmt(value: float) -> str:
    return f"{value:.2f}" if value == 0 or abs(value) >= 0.005 else f"{value:.0e}"


def _annotate(ax, values: np.ndarray, fontsize: int = 7) -> None:
    """Write each cell's value on a heatmap drawn by `_diverging`, in white on the dark cells."""
    limit = _symmetric_limit(values)
    for (row, col), value in np.ndenumerate(values):
        ax.text(col, row, _fmt(value), ha="center", va="center", fontsize=fontsize,
                color="white" if abs(value) > 0.6 * limit else "black")


def _quote(token: str | None) -> str:
    return "" if token is None else repr(str(token))


# --------------------------------------------------------------------------------------------------
# Attribution
def plot_head_attribution(
    scores: HeadAttribution | torch.Tensor, top_k: int = 3, title: str | None = None, label: str = "IG score"
) -> Figure:
    """Heatmap of one score per (layer, head), layer 0 at the top; the top_k heads boxed and named L{l}H{h}."""
    values = _np(scores.scores if isinstance(scores, HeadAttribution) else scores)
    n_layers, n_heads = values.shape
    fig = Figure(figsize=(max(5.0, 0.32 * n_heads + 2.5), max(3.5, 0.28 * n_layers + 1.8)), layout="constrained")
    ax = fig.subplots()
    image = _diverging(ax, values)
    fig.colorbar(image, ax=ax, label=label)
    order = np.argsort(-values, axis=None)[:top_k]
    top = []
    for rank, flat in enumerate(order):
        layer, head = divmod(int(flat), n_heads)
        ax.add_patch(Rectangle((head - 0.5, layer - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=2))
        ax.text(head, layer, str(rank + 1), ha="center", va="center", fontsize=8, fontweight="bold")
        top.append(f"{rank + 1}: L{layer}H{head} ({values[layer, head]:.3g})")
    _head_ticks(ax, n_heads, "x")
    _head_ticks(ax, n_layers, "y")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    heading = title or "Head attribution (integrated gradients)"
    lines = [", ".join(top[i : i + 3]) for i in range(0, len(top), 3)]
    ax.set_title("\n".join([heading, *lines]), fontsize=10)
    return fig


def plot_head_attribution_plotly(
    scores: HeadAttribution | torch.Tensor, title: str | None = None, label: str = "IG score"
) -> go.Figure:
    """Interactive version of `plot_head_attribution`: hover shows layer, head and score."""
    values = _np(scores.scores if isinstance(scores, HeadAttribution) else scores)
    limit = _symmetric_limit(values)
    heatmap = go.Heatmap(z=values, colorscale="RdBu", reversescale=True, zmin=-limit, zmax=limit,
                         colorbar=dict(title=label),
                         hovertemplate="L%{y}H%{x}<br>" + label + ": %{z:.4g}<extra></extra>")
    fig = go.Figure(heatmap)
    fig.update_layout(title=title or "Head attribution (integrated gradients)", xaxis_title="head",
                      yaxis_title="layer", yaxis_autorange="reversed")
    return fig


# --------------------------------------------------------------------------------------------------
# Composition
def plot_composition_maps(
    maps: torch.Tensor | Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
    titles: Sequence[str] | None = None,
    head_labels: Sequence[str] | None = None,
    suptitle: str | None = None,
) -> Figure:
    """Fig. 1 style: one panel per H x H map W (from `composition_map`, A' = A @ W).

    Drawn as the paper's composition map C = W.T: row h is the composed head, column j the source head,
    A'_h = sum_j C[h, j] A_j. Lighter is larger.
    """
    if isinstance(maps, torch.Tensor) and maps.ndim == 2:
        maps = [maps]
    if isinstance(maps, Mapping):
        titles, maps = list(maps.keys()), list(maps.values())
    maps = [_np(W).T for W in maps]
    titles = titles or [f"map {i}" for i in range(len(maps))]
    n_heads = maps[0].shape[0]
    size = min(4.5, 1.2 + 0.3 * n_heads)
    fig = Figure(figsize=(size * len(maps) + 1, size + 0.9), layout="constrained")
    axes = fig.subplots(1, len(maps), squeeze=False)
    for ax, C, title in zip(axes[0], maps, titles):
        image = ax.imshow(C, cmap="viridis")
        fig.colorbar(image, ax=ax, shrink=0.8)
        _head_ticks(ax, n_heads, "x", head_labels)
        _head_ticks(ax, n_heads, "y", head_labels)
        ax.set_xlabel("source head j")
        ax.set_ylabel("composed head h")
        ax.set_title(title, fontsize=10)
    fig.suptitle(suptitle or "Composition maps C (A'_h = sum_j C[h, j] A_j)")
    return fig


def plot_composition_map_plotly(W: torch.Tensor, title: str | None = None) -> go.Figure:
    """Interactive composition map C = W.T (hover: composed head, source head, weight)."""
    fig = go.Figure(go.Heatmap(z=_np(W).T, colorscale="Viridis",
                               hovertemplate="composed head %{y} <- source head %{x}: %{z:.4g}<extra></extra>"))
    fig.update_layout(title=title or "Composition map C", xaxis_title="source head j",
                      yaxis_title="composed head h", yaxis_autorange="reversed")
    return fig


def plot_compose_breakdown(
    breakdown: ComposeBreakdown,
    query_token: str | None = None,
    key_token: str | None = None,
    side: str = "k",
    title: str | None = None,
) -> Figure:
    """Fig. 7 style: the attention vector before composition, the four branch outputs, and the composed vector
    (columns A, O_qp, O_qg, O_kp, O_kg, A' with one row per head, annotated), next to the low-rank weights of
    one side (`side="k"`: w_k1 [head x rank] and w_k2 [rank x head], as in the paper; "q" for w_q1, w_q2).
    """
    b = breakdown
    n_heads = len(b.before)
    columns = np.stack([_np(v) for v in (b.before, b.o_qp, b.o_qg, b.o_kp, b.o_kg, b.composed)], axis=1)
    names = ["A", "O_qp", "O_qg", "O_kp", "O_kg", "A'"]
    w1, w2 = _np(getattr(b, f"w_{side}1")), _np(getattr(b, f"w_{side}2")).T  # [head, rank], [rank, head]
    rank = w1.shape[1]
    height = max(4.0, 0.32 * n_heads + 1.8)
    fig = Figure(figsize=(4.0 + 0.45 * rank + 0.25 * n_heads + 5.5, height), layout="constrained")
    grid = fig.add_gridspec(2, 3, width_ratios=[rank + 1.5, max(n_heads, 4) * 0.6, 9], height_ratios=[3, 1])

    ax1 = fig.add_subplot(grid[:, 0])
    image = _diverging(ax1, w1)
    fig.colorbar(image, ax=ax1, location="bottom", shrink=0.9)
    ax1.set_xticks(range(rank), [str(r) for r in range(rank)])
    _head_ticks(ax1, n_heads, "y")
    ax1.set_xlabel("rank r")
    ax1.set_ylabel("head")
    ax1.set_title(f"w_{side}1 (head x rank)", fontsize=10)

    ax2 = fig.add_subplot(grid[0, 1])
    image = _diverging(ax2, w2)
    fig.colorbar(image, ax=ax2, location="bottom", shrink=0.9)
    ax2.set_yticks(range(rank), [str(r) for r in range(rank)])
    _head_ticks(ax2, n_heads, "x")
    ax2.set_xlabel("head")
    ax2.set_ylabel("rank r")
    ax2.set_title(f"w_{side}2 (rank x head)", fontsize=10)

    ax4 = fig.add_subplot(grid[1, 1])
    hidden = _np(b.before)[None] @ w1  # [1, rank]: what w_{side}1 gathers from all heads
    _diverging(ax4, hidden)
    _annotate(ax4, hidden, fontsize=8)
    ax4.set_xticks(range(rank), [str(r) for r in range(rank)])
    ax4.set_yticks([])
    ax4.set_xlabel("rank r")
    ax4.set_title(f"A @ w_{side}1 (gathered)", fontsize=10)

    ax3 = fig.add_subplot(grid[:, 2])
    image = _diverging(ax3, columns)
    fig.colorbar(image, ax=ax3, label="attention weight" if b.stage == "post" else "attention score")
    ax3.set_xticks(range(6), [names[0], "+ O_qp", "+ O_qg", "+ O_kp", "+ O_kg", "= A'"])
    _head_ticks(ax3, n_heads, "y", [f"L{b.layer}H{h}" for h in range(n_heads)])
    ax3.set_xlabel("before composition, branch outputs, composed")
    ax3.set_ylabel("head")
    if n_heads <= 40:
        _annotate(ax3, columns)
    pair = f"{_quote(query_token) or f'pos {b.query_pos}'} -> {_quote(key_token) or f'pos {b.key_pos}'}"
    fig.suptitle(title or f"Layer {b.layer} {b.stage}-compose of the attention {pair} "
                 f"(query pos {b.query_pos}, key pos {b.key_pos})")
    return fig


def plot_attention_distributions(
    dist: AttentionDistributions,
    str_tokens: Sequence[str] | None = None,
    w_k1_heads: Sequence[int] | None = None,
    rank_index: int = 0,
    title: str | None = None,
) -> Figure:
    """Fig. 8 style: top, w_k1[key, head, rank_index] along the keys for `w_k1_heads` (default: the chosen
    heads); below, one panel per chosen head with its attention over the keys before and after composition.
    """
    n_keys = dist.before.shape[1]
    labels = [t.replace("\n", "\\n") for t in str_tokens[:n_keys]] if str_tokens is not None else \
        [str(i) for i in range(n_keys)]
    has_w = dist.w_k1 is not None
    n_rows = len(dist.heads) + has_w
    fig = Figure(figsize=(min(18.0, max(6.0, 0.38 * n_keys + 2)), 1.9 * n_rows + 1.0), layout="constrained")
    axes = fig.subplots(n_rows, 1, sharex=True, squeeze=False)
    axes = axes[:, 0]
    x = np.arange(n_keys)
    if has_w:
        ax = axes[0]
        for head in w_k1_heads if w_k1_heads is not None else dist.heads:
            ax.plot(x, _np(dist.w_k1[:, head, rank_index]), marker="o", markersize=3,
                    label=f"L{dist.layer}H{head}")
        ax.axhline(0, color="grey", linewidth=0.5)
        ax.set_ylabel(f"w_k1[:, h, {rank_index}]")
        ax.set_title(f"{dist.stage}-compose key-wise weight w_k1 (rank component {rank_index}) along the sequence",
                     fontsize=10)
        ax.legend(fontsize=7, ncol=4, loc="best")
    what = "attention weight" if dist.stage == "post" else "attention score"
    for ax, i, head in zip(axes[has_w:], range(len(dist.heads)), dist.heads):
        ax.bar(x - 0.2, _np(dist.before[i]), width=0.4, color="0.65", label="before composition")
        ax.bar(x + 0.2, _np(dist.after[i]), width=0.4, color="tab:blue", label="after composition")
        ax.axhline(0, color="grey", linewidth=0.5)
        ax.set_ylabel(what)
        ax.set_title(f"L{dist.layer}H{head}", fontsize=10, loc="left")
        ax.legend(fontsize=7, loc="best")
    axes[-1].set_xticks(x, labels, rotation=60, ha="right", rotation_mode="anchor", fontsize=8 if n_keys <= 40 else 6)
    axes[-1].set_xlabel("key token")
    query = labels[dist.query_pos] if dist.query_pos < len(labels) else str(dist.query_pos)
    fig.suptitle(title or f"Layer {dist.layer}: attention from query {query!r} (pos {dist.query_pos})")
    return fig


# --------------------------------------------------------------------------------------------------
# Head diversity
def plot_head_diversity(
    results: HeadDiversity | Mapping[str, HeadDiversity], per_layer: bool = False, title: str | None = None
) -> Figure:
    """Fig. 5: mean cumulative captured variance of concatenated QK (left) and OV (right) circuits against the
    number of principal components, one line per model (per_layer adds each layer as a thin line)."""
    results = {"model": results} if isinstance(results, HeadDiversity) else dict(results)
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    for ax, circuit in zip(axes, ("qk", "ov")):
        for i, (name, result) in enumerate(results.items()):
            curves = _np(getattr(result, circuit))
            k = np.arange(1, curves.shape[1] + 1)
            color = f"C{i}"
            if per_layer:
                for curve in curves:
                    ax.plot(k, curve, color=color, linewidth=0.5, alpha=0.3)
            ax.plot(k, curves.mean(0), color=color, linewidth=2,
                    label=f"{name} (mean over {len(curves)} layers; area {curves.mean():.3f})")
        ax.plot([0, k[-1]], [0, 1], color="grey", linestyle=":", linewidth=1, label="all components equal")
        ax.set_xlabel("number of principal components")
        ax.set_title("QK circuits (W_Q W_K^T)" if circuit == "qk" else "OV circuits (W_O W_V)")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("cumulative captured variance")
    fig.suptitle(title or "Head diversity: concatenated per-layer circuits (lower = more diverse heads)")
    return fig


# --------------------------------------------------------------------------------------------------
# Synthetic evaluation (Table 5, Fig. 6)
def _accuracy(value) -> float:
    return float(value["accuracy"] if isinstance(value, Mapping) else value)


def _grouped_bars(ax, summary: Mapping, key: str, horizontal: bool = False) -> None:
    categories = list(dict.fromkeys(c for result in summary.values() for c in result.get(key, {})))
    n = len(summary)
    width = 0.8 / max(n, 1)
    positions = np.arange(len(categories))
    for i, (name, result) in enumerate(summary.items()):
        values = [_accuracy(result[key][c]) if c in result.get(key, {}) else np.nan for c in categories]
        offset = positions - 0.4 + width * (i + 0.5)
        (ax.barh if horizontal else ax.bar)(offset, values, width, label=name, color=f"C{i}")
    if horizontal:
        ax.set_yticks(positions, categories, fontsize=7)
        ax.set_ylim(len(categories) - 0.5, -0.5)
        ax.set_xlabel("accuracy")
        ax.set_xlim(0, 1)
    else:
        ax.set_xticks(positions, categories, rotation=45, ha="right", rotation_mode="anchor", fontsize=8)
        ax.set_ylabel("accuracy")
        ax.set_ylim(0, 1)


def plot_synthetic_eval(summary: Mapping[str, Mapping], title: str | None = None) -> Figure:
    """Accuracy on the synthetic tasks from a `summary.json`-style dict
    {ckpt: {"accuracy", "ppl", "by_k": {"2": acc, ...}, "by_task": {...}, "by_qk_pattern": {...},
    "by_ov_transformation": {...}}}: overall (Table 5, in the legend), by shots K (Fig. 6), by QK pattern,
    by OV transformation and by task. Missing parts are left out; a value may also be {"accuracy": a, ...}."""
    has = {key: any(key in r for r in summary.values())
           for key in ("by_k", "by_qk_pattern", "by_ov_transformation", "by_task")}
    n_tasks = len({t for r in summary.values() for t in r.get("by_task", {})})
    n_panels = 1 + has["by_qk_pattern"] + has["by_ov_transformation"]
    fig = Figure(figsize=(4.7 * n_panels, 5 + (0.16 * n_tasks + 1 if has["by_task"] else 0)), layout="constrained")
    heights = [4] + ([0.16 * n_tasks + 1] if has["by_task"] else [])
    panels = [(key, label) for key, label in (("by_qk_pattern", "QK pattern"), ("by_ov_transformation",
              "OV transformation")) if has[key]]
    grid = fig.add_gridspec(len(heights), 1 + len(panels), height_ratios=heights)
    names = {n: f"{n}: acc {_accuracy(r.get('accuracy', np.nan)):.1%}"
             + (f", ppl {r['ppl']:.2f}" if "ppl" in r else "") for n, r in summary.items()}

    ax = fig.add_subplot(grid[0, 0])
    if has["by_k"]:
        for i, (name, result) in enumerate(summary.items()):
            shots = sorted(result.get("by_k", {}), key=int)
            ax.plot([int(k) for k in shots], [_accuracy(result["by_k"][k]) for k in shots], marker="o",
                    color=f"C{i}", label=names[name])
        ax.set_xlabel("shots K")
        ax.legend(fontsize=8)
        ax.set_title("Accuracy by number of shots")
    else:  # Table 5 only: overall accuracy (and perplexity) per checkpoint
        bars = ax.bar(range(len(summary)), [_accuracy(r.get("accuracy", np.nan)) for r in summary.values()],
                      color=[f"C{i}" for i in range(len(summary))])
        ax.bar_label(bars, [names[n].split(": ", 1)[1] for n in summary], fontsize=8)
        ax.set_xticks(range(len(summary)), list(summary))
        ax.set_xlabel("checkpoint")
        ax.set_title("Overall accuracy")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    for col, (key, label) in enumerate(panels, start=1):
        ax = fig.add_subplot(grid[0, col])
        _grouped_bars(ax, summary, key)
        ax.set_title(f"Accuracy by {label}")
        ax.set_xlabel(label)
        ax.set_ylabel("accuracy")
    if has["by_task"]:
        ax = fig.add_subplot(grid[1, :])
        _grouped_bars(ax, summary, "by_task", horizontal=True)
        ax.set_ylabel("task")
        ax.set_title("Accuracy by task")
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(alpha=0.3, axis="x")
    fig.suptitle(title or "Synthetic-task evaluation")
    return fig


# --------------------------------------------------------------------------------------------------
# Patching and branch ablation (dcinterp.patching, python -m dcinterp.synth ablate)
def _patching_limit(values: np.ndarray) -> float:
    """The colour scale's half-width: the largest magnitude (1 where everything is 0)."""
    finite = np.abs(values[np.isfinite(values)])
    return float(finite.max()) if finite.size and finite.max() > 0 else 1.0


def _centred_heatmap(ax, values: np.ndarray, limit: float, fontsize: int = 7, digits: int = 2):
    """A heatmap on the diverging colormap over [-limit, limit], each cell's value written in it."""
    image = ax.imshow(values, cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto")
    for (row, col), value in np.ndenumerate(values):
        if np.isfinite(value):
            text = f"{value:+.{digits}f}" if round(value, digits) != 0 else "0"
            ax.text(col, row, text, ha="center", va="center", fontsize=fontsize,
                    color="white" if abs(value) > 0.6 * limit else "black")
    return image


def _patching_grid(frame) -> tuple[np.ndarray, list[str], list[str], str]:
    """Rows stage.site, columns layers (one value per site) or heads (per-head frames of one layer)."""
    frame = frame.assign(row=frame["stage"] + "." + frame["site"])
    per_head = (frame["head"] != "all").any()
    column = "head" if per_head else "layer"
    if per_head and frame["layer"].nunique() > 1:
        frame = frame.assign(row="L" + frame["layer"].astype(str) + " " + frame["row"])
    rows = list(dict.fromkeys(frame["row"]))
    columns = list(dict.fromkeys(frame[column]))
    grid = frame.pivot(index="row", columns=column, values="effect").reindex(index=rows, columns=columns)
    return grid.to_numpy(dtype=float), rows, [str(c) for c in columns], column


def plot_patching(frames: Mapping[str, object], title: str | None = None, caption: str | None = None) -> Figure:
    """Patching tables (`activation_patching` / `attribution_patching` frames) side by side on one shared scale.

    Rows: stage.site; columns: layers, or heads for per-head tables. Red: patching raises the clean-minus-corrupt
    logit difference (denoising restores it), blue: lowers it (noising removes it); 1 = all of the difference.
    """
    grids = {name: _patching_grid(frame) for name, frame in frames.items()}
    limit = max(_patching_limit(values) for values, *_ in grids.values())
    n_rows = max(len(rows) for _, rows, _, _ in grids.values())
    n_cols = max(len(cols) for _, _, cols, _ in grids.values())
    fig = Figure(figsize=(1.6 + (0.55 * n_cols + 1.3) * len(grids), 1.4 + 0.27 * n_rows), layout="constrained")
    axes = fig.subplots(1, len(grids), squeeze=False, sharey=True)[0]
    for ax, (name, (values, rows, cols, column)) in zip(axes, grids.items()):
        image = _centred_heatmap(ax, values, limit)
        ax.set_xticks(range(len(cols)), cols)
        ax.set_yticks(range(len(rows)), rows)
        ax.set_xlabel(column)
        ax.set_title(name, fontsize=10)
    fig.colorbar(image, ax=list(axes), label="effect (share of clean - corrupt LD)", shrink=0.8)
    if title:
        fig.suptitle(title, fontsize=11)
    if caption:
        fig.text(0.01, 0.0, caption, fontsize=8, ha="left", va="bottom", wrap=True)
        fig.get_layout_engine().set(rect=(0, 0.05, 1, 0.95))
    return fig


def plot_patching_agreement(exact, estimate, title: str | None = None) -> Figure:
    """Attribution patching against exact patching, one point per site (and head), with y = x and Spearman's rho."""
    from scipy.stats import spearmanr

    x, y = exact["effect"].to_numpy(float), estimate["effect"].to_numpy(float)
    limit = _patching_limit(np.concatenate([x, y])) * 1.05
    fig = Figure(figsize=(4.6, 4.6), layout="constrained")
    ax = fig.subplots()
    ax.axline((0, 0), slope=1, color="grey", lw=0.8, ls="--", label="y = x")
    ax.axhline(0, color="lightgrey", lw=0.6)
    ax.axvline(0, color="lightgrey", lw=0.6)
    colors = {"pre": "tab:orange", "post": "tab:blue"}
    for stage, color in colors.items():
        rows = (exact["stage"] == stage).to_numpy()
        ax.scatter(x[rows], y[rows], s=14, color=color, alpha=0.7, label=f"{stage}-compose sites")
    ax.set_xlim(-limit, limit)
    ax.set_ylim(-limit, limit)
    ax.set_xlabel("activation patching (exact)")
    ax.set_ylabel("attribution patching (first order)")
    ax.legend(fontsize=7, loc="upper left")
    rho = spearmanr(x, y).statistic
    ax.set_title(title or "attribution vs exact patching", fontsize=10)
    fig.text(0.01, 0.0, f"{len(x)} rows; Spearman rho = {rho:.2f}. Effect: share of the clean - corrupt logit "
             "difference.", fontsize=7)
    fig.get_layout_engine().set(rect=(0, 0.04, 1, 0.96))
    return fig


def plot_ablation_table(table, title: str | None = None) -> Figure:
    """Accuracy change against the full model (row 'none') when each part of the compose is switched off.

    `table` is `dcinterp.synth.ablate.ablation_table(...)`: columns accuracy, qk:* and ov:*. One shared scale
    in percentage points; the column labels give the full model's accuracy.
    """
    columns = ["accuracy", *[c for c in table.columns if c.startswith(("qk:", "ov:"))]]
    full = table[table["ablated"] == "none"].iloc[0]
    ablated = table[table["ablated"] != "none"]
    values = 100 * (ablated[columns].to_numpy(float) - full[columns].to_numpy(float)[None])
    limit = _patching_limit(values)
    fig = Figure(figsize=(max(6.0, 2.5 + 0.55 * len(columns)), 2.0 + 0.3 * len(ablated)), layout="constrained")
    ax = fig.subplots()
    image = _centred_heatmap(ax, values, limit, fontsize=7, digits=0)
    labels = [f"{'all' if c == 'accuracy' else c[3:]}\n({100 * full[c]:.0f}%)" for c in columns]
    ax.set_xticks(range(len(columns)), labels, rotation=90, fontsize=7)
    ax.set_yticks(range(len(ablated)), list(ablated["ablated"]), fontsize=8)
    ax.axvline(0.5, color="black", lw=0.8)
    n_qk = sum(c.startswith("qk:") for c in columns)
    ax.axvline(0.5 + n_qk, color="black", lw=0.8)
    ax.set_ylabel("switched off (in every layer, or one layer's compose)")
    fig.colorbar(image, ax=ax, label="accuracy change (points)", shrink=0.8)
    ax.set_title(title or "compose switched off", fontsize=10)
    fig.text(0.01, 0.0, "Columns: all samples, by QK pattern, by OV transformation; in brackets the full model's "
             "accuracy. Chance (a random candidate of the line) is about 35%.", fontsize=7, wrap=True)
    fig.get_layout_engine().set(rect=(0, 0.04, 1, 0.96))
    return fig
