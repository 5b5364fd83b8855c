"""Figures of `dcinterp.discovery`: faithfulness against circuit size, and a circuit drawn layer by layer."""

from __future__ import annotations

import numpy as np
import torch
from matplotlib.figure import Figure

from .style import PAGE_WIDTH, SMALLEST_TYPE, draw_caption, to_numpy

BRANCH_COLORS = {"qp": "tab:orange", "kp": "tab:green", "qg": "tab:purple", "kg": "tab:brown", "skip": "tab:olive"}
# A residual edge's colour says which input of its receiver it feeds: a head's q, k or v, or another node's input.
INPUT_COLORS = {"q": "tab:blue", "k": "tab:red", "v": "black", "other": "tab:cyan"}


def plot_faithfulness(curve, title: str | None = None, caption: str | None = None) -> Figure:
    """Faithfulness against circuit size, one line per (method, selection).

    Faithfulness = (m(circuit) - m(corrupted)) / (m(clean) - m(corrupted)), by exact edge patching. The random-edges
    baseline is grey with crosses, the 80% mark a green dash-dot line, both in the legend.

    Args:
        curve: `dcinterp.discovery.faithfulness_curve(...)`: columns method, selection, edges, faithfulness.
        title: The title; default "faithfulness of circuits".
        caption: A line drawn under the figure.

    Returns:
        The figure.
    """
    fig = Figure(figsize=(6.0, 4.2), layout="constrained")
    ax = fig.subplots()
    styles = {"top-n": "-", "greedy": "--"}
    colors = dict(
        zip(
            [m for m in dict.fromkeys(curve["method"]) if m != "random"],
            ["tab:blue", "tab:red", "tab:green"],
            strict=False,
        )
    )
    for (method, selection), rows in curve.groupby(["method", "selection"], sort=False):
        rows = rows.sort_values("edges")
        if method == "random":
            ax.plot(
                rows["edges"], rows["faithfulness"], "-", color="0.55", marker="x", ms=4, label="random edges (mean)"
            )
        else:
            ax.plot(
                rows["edges"],
                rows["faithfulness"],
                styles.get(selection, "-"),
                color=colors[method],
                marker="o",
                ms=3,
                label=f"{method}, {selection}",
            )
    ax.axhline(1, color="black", lw=0.6)
    ax.axhline(0.8, color="tab:green", lw=1.0, ls="-.", label="80% faithful")
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xlim(0, curve["edges"].max() * 1.05)
    ax.set_xlabel("edges in the circuit (the others corrupted)")
    ax.set_ylabel("faithfulness")
    ax.legend(fontsize=SMALLEST_TYPE, handlelength=3.5)
    ax.set_title(title or "faithfulness of circuits", fontsize=10)
    draw_caption(fig, caption)
    return fig


def plot_circuit(graph, scores, circuit, title: str | None = None, caption: str | None = None) -> Figure:
    """A circuit drawn layer by layer.

    Embedding at the bottom, logits at the top, a row of heads per layer with its MLP on the right and (DCMHA) the
    compose-weight generator on the left. Residual edges are dark lines from a sender's output to a receiver,
    coloured by the input they feed (`INPUT_COLORS`: a head's q, k or v, which enter its bottom left, middle and
    right, marked with the letter where heads are few; or an MLP, the compose weights, the logits); compose edges are
    arcs inside their layer (pre-compose below the row of heads, post-compose above), coloured by branch
    (`BRANCH_COLORS`); a compose edge from a head to itself (the gates, the skip, a projection's diagonal) is a ring
    beside it, the branches side by side (qp, qg, kp, kg, skip from left to right). Every edge's line width follows
    |score|, with a key in the legend.

    Args:
        graph: The `dcinterp.discovery.Graph`.
        scores: A score per edge of the graph, [edge].
        circuit: A bool mask over the graph's edges, [edge]: the edges drawn.
        title: The title; default "circuit: N edges".
        caption: A line drawn under the figure.

    Returns:
        The figure.
    """
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyArrowPatch

    cfg = graph.cfg
    H, L = cfg.n_heads, cfg.n_layers
    chosen = np.flatnonzero(to_numpy(torch.as_tensor(circuit)).astype(bool))
    values = to_numpy(scores)
    largest = max(np.abs(values[chosen]).max() if len(chosen) else 1.0, 1e-12)

    def width(i):
        return 0.3 + 3.2 * abs(values[i]) / largest

    x_mlp, x_compose = H + 0.6, -1.4
    fig = Figure(
        figsize=(PAGE_WIDTH, min(max(4.5, 1.5 + 0.62 * (L + 2)), 26.0) + 1.8),  # the legend below the graph
        layout="constrained",
    )
    ax = fig.subplots()

    def sender_point(name: str) -> tuple[float, float]:
        if name == "embed":
            return (H - 1) / 2, -1.0
        if name.startswith("MLP"):
            return x_mlp, int(name[3:]) + 0.42
        layer, head = name[1:].split("H")
        return int(head), int(layer) + 0.12

    def receiver_point(name: str) -> tuple[float, float]:
        if name == "logits":
            return (H - 1) / 2, L + 0.1
        if name.startswith("MLP"):
            return x_mlp, int(name[3:]) + 0.22
        if name.endswith(".compose"):
            return x_compose, int(name[1:].split(".")[0])
        head, part = name.split(".")
        layer, h = head[1:].split("H")
        return int(h) + {"q": -0.22, "k": 0.0, "v": 0.22}[part], int(layer) - 0.22

    used_heads, fed_inputs = set(), set()
    for i in chosen:
        edge = graph.edges[i]
        if edge.kind == "compose":
            used_heads.update({(edge.layer, edge.source_head), (edge.layer, edge.target_head)})
            y = edge.layer + (-0.1 if edge.stage == "pre" else 0.1)
            color = BRANCH_COLORS[edge.branch]
            if edge.source_head == edge.target_head:  # rings of one size, side by side; |score| in their line
                offset = {"qp": -0.3, "qg": -0.15, "kp": 0.0, "kg": 0.15, "skip": 0.3}[edge.branch]
                ax.plot(
                    edge.source_head + offset,
                    y + (-0.14 if edge.stage == "pre" else 0.14),
                    "o",
                    mfc="white",
                    mec=color,
                    ms=7,
                    mew=0.4 + 0.7 * width(i),
                    zorder=4,
                )
            else:
                # arc3 bends an arc drawn left to right below for rad > 0; the bulge (rad x length) stays in the layer
                rad = (-0.3 if edge.stage == "post" else 0.3) / abs(edge.target_head - edge.source_head)
                rad = rad if edge.target_head > edge.source_head else -rad
                ax.add_patch(
                    FancyArrowPatch(
                        (edge.source_head, y),
                        (edge.target_head, y),
                        connectionstyle=f"arc3,rad={rad}",
                        arrowstyle="-|>",
                        mutation_scale=7,
                        color=color,
                        lw=width(i),
                        alpha=0.85,
                        zorder=3,
                    )
                )
            continue
        start, end = sender_point(edge.source), receiver_point(edge.target)
        if edge.source_head is not None:
            used_heads.add((int(edge.source[1:].split("H")[0]), edge.source_head))
        part = edge.target.rsplit(".", 1)[-1] if edge.target_head is not None else "other"
        if edge.target_head is not None:
            used_heads.add((edge.layer, edge.target_head))
            fed_inputs.add((part, end))
        ax.annotate(
            "",
            xy=end,
            xytext=start,
            zorder=2,
            arrowprops=dict(
                arrowstyle="-|>",
                color=INPUT_COLORS[part],
                lw=width(i),
                alpha=0.7,
                shrinkA=2,
                shrinkB=2,
                mutation_scale=6,
            ),
        )
    if H <= 16:  # the input's letter under each arrowhead that feeds a head
        for part, (x, y) in fed_inputs:
            ax.text(
                x, y - 0.07, part, color=INPUT_COLORS[part], ha="center", va="top", fontsize=SMALLEST_TYPE, zorder=6
            )
    # nodes
    for layer in range(L):
        ax.axhspan(layer - 0.4, layer + 0.55, color="0.96" if layer % 2 else "0.92", zorder=0)
        xs = np.arange(H)
        ax.scatter(xs, np.full(H, layer), s=12, color="0.75", zorder=1)
        for layer_, head in used_heads:
            if layer_ == layer:
                ax.scatter([head], [layer], s=60, marker="s", color="white", edgecolors="black", zorder=5)
                if H <= 40:
                    ax.text(head, layer, str(head), ha="center", va="center", fontsize=5 if H > 12 else 8, zorder=6)
        ax.text(
            x_mlp,
            layer + 0.32,
            f"MLP{layer}",
            ha="center",
            va="center",
            fontsize=SMALLEST_TYPE,
            bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="0.5"),
            zorder=5,
        )
        if graph.dcmha:
            ax.text(
                x_compose,
                layer,
                "W",
                ha="center",
                va="center",
                fontsize=SMALLEST_TYPE,
                bbox=dict(boxstyle="round,pad=0.2", fc="lightyellow", ec="0.5"),
                zorder=5,
            )
    for y, name in ((-1.0, "embed"), (L + 0.1, "logits")):
        ax.text(
            (H - 1) / 2,
            y,
            name,
            ha="center",
            va="center",
            fontsize=8,
            bbox=dict(boxstyle="round", fc="white", ec="black"),
            zorder=5,
        )
    ax.set_yticks(range(L), [f"L{layer}" for layer in range(L)], fontsize=7 if L > 12 else 9)
    step = max(1, H // 16)
    ax.set_xticks(range(0, H, step), [str(h) for h in range(0, H, step)], fontsize=SMALLEST_TYPE)
    ax.set_xlabel("head" + ("   (W: compose-weight generator, left)" if graph.dcmha else ""))
    ax.set_xlim(x_compose - 0.6 if graph.dcmha else -0.8, x_mlp + 0.8)
    ax.set_ylim(-1.5, L + 0.5)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    handles = [
        Line2D([], [], color=INPUT_COLORS[part], lw=1.5, label=f"residual edge into {name}")
        for part, name in [("q", "a head's q"), ("k", "a head's k"), ("v", "a head's v"), ("other", "MLP, W, logits")]
    ]
    if graph.dcmha:
        handles += [Line2D([], [], color=c, lw=2, label=f"compose {b}") for b, c in BRANCH_COLORS.items()]
        handles.append(
            Line2D([], [], ls="", marker="o", ms=7, mfc="white", mec="0.3", label="ring: compose, a head to itself")
        )
    handles += [
        Line2D([], [], color="0.3", lw=0.3 + 3.2 * share, label=f"|score| {share * largest:.2g}")
        for share in (1.0, 0.5, 0.1)
    ]
    fig.legend(handles=handles, fontsize=SMALLEST_TYPE, loc="outside lower center", ncol=2, frameon=False)
    ax.set_title(title or f"circuit: {len(chosen)} edges", fontsize=10)
    draw_caption(fig, caption)
    return fig
