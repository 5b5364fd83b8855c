"""Every figure renders, has a title, axis labels and token/head labels, no caption baked in, and stays legible
shrunk into the docs' 690-px column; renders go to /tmp/dcinterp-figs."""

import random
import re
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest
import torch
from matplotlib.figure import Figure

from dcinterp import DCFormerConfig, HookedDCFormer, plotting
from dcinterp.attribution import head_attribution
from dcinterp.circuits import head_diversity
from dcinterp.composition import attention_distributions, compose_breakdown, composition_map
from dcinterp.synth import load_catalog
from dcinterp.synth.accuracy import accuracy_tables
from dcinterp.synth.evaluate import RESULT_COLUMNS

FIXTURE = Path(__file__).resolve().parents[1] / "tests/fixtures/dcpythia-tiny"
OUT = Path("/tmp/dcinterp-figs")
WORDS = "Michelle has a burger . Helen has a papaya . Carol has a cannon . Michelle owns a kind of".split()
QUERY, KEY = len(WORDS) - 1, 3  # 'of' -> 'burger'


@pytest.fixture(scope="module")
def fixture_model() -> HookedDCFormer:
    return HookedDCFormer.from_pretrained(FIXTURE)


@pytest.fixture(scope="module")
def random_model() -> HookedDCFormer:
    torch.manual_seed(0)
    return HookedDCFormer(DCFormerConfig(n_layers=2, d_model=32, n_heads=4, d_head=8, d_mlp=64, d_vocab=50))


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randint(3, 50, (1, len(WORDS)))  # made-up ids, labelled with WORDS


def texts(fig: Figure) -> list[str]:
    found = [t.get_text() for t in (fig._suptitle, fig._supxlabel) if t]
    found += [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    for ax in fig.axes:
        found += [ax.get_title(), ax.get_title("left"), ax.get_xlabel(), ax.get_ylabel()]
        found += [t.get_text() for t in ax.get_xticklabels() + ax.get_yticklabels() + ax.texts]
        if ax.get_legend():
            found += [t.get_text() for t in [ax.get_legend().get_title(), *ax.get_legend().get_texts()]]
    return [t for t in found if t]


COLUMN_PX = 690  # the docs page's content column
SMALLEST_PX = 9  # type shorter than this, once the figure is shrunk into the column, is hard to read


def smallest_type_px(fig: Figure, dpi: float = 130) -> tuple[float, str]:
    """The smallest visible text of the figure, in pixels, as a reader of the docs page sees it (saved at `dpi`,
    shrunk to the column where it is wider), and that text."""
    scale = min(1.0, COLUMN_PX / (fig.get_figwidth() * dpi))
    sizes = [
        (text.get_fontsize() * dpi / 72 * scale, text.get_text())
        for text in fig.findobj(lambda artist: hasattr(artist, "get_fontsize") and hasattr(artist, "get_text"))
        if text.get_visible() and text.get_text().strip() and (text.axes is None or text.axes.get_visible())
    ]
    return min(sizes)


def colorbar_labels(fig: Figure) -> list[str]:
    return [ax.get_ylabel() or ax.get_xlabel() for ax in fig.axes if ax.get_label() == "<colorbar>"]


def check(fig, name: str, must_show: list[str], smallest_px: float = SMALLEST_PX) -> None:
    assert isinstance(fig, Figure)
    assert fig.get_figwidth() <= plotting.PAGE_WIDTH, f"{name}: wider than the page"
    size, text = smallest_type_px(fig)
    assert size >= smallest_px, f"{name}: {text!r} is {size:.1f} px in the docs column"
    shown = "\n".join(texts(fig))
    main = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
    assert fig._suptitle is not None or all(ax.get_title() or ax.get_title("left") for ax in main)
    assert all(ax.get_xlabel() or ax.get_ylabel() for ax in main if ax.images or ax.lines or ax.patches)
    for text in must_show:
        assert text in shown, (name, text)
    assert fig._supxlabel is None, f"{name}: a caption baked into the image (captions are the page's text)"
    OUT.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT / f"{name}.png", dpi=100)


@pytest.mark.parametrize("which", ["random", "fixture"])
def test_attribution_heatmap(which, random_model, fixture_model, prompt):
    model = random_model if which == "random" else fixture_model
    result = head_attribution(model, prompt, 7, n_steps=8)
    layer, head = result.top_heads(1)[0]
    fig = plotting.plot_head_attribution(result, top_k=3)
    check(fig, f"attribution_{which}", ["layer", "head", f"L{layer}H{head}"])
    # the colour bar says what the scores are, with their unit
    (label,) = colorbar_labels(fig)
    assert " ".join(label.split()) == "attribution to the answer's logit (logit units) (symmetric-log scale)"
    interactive = plotting.plot_head_attribution_plotly(result)
    assert isinstance(interactive, go.Figure) and interactive.layout.title.text
    check(plotting.plot_head_attribution(torch.randn(32, 32), top_k=5), "attribution_32x32", ["layer", "head"])


@pytest.mark.parametrize("which", ["random", "fixture"])
def test_composition_figures(which, random_model, fixture_model, prompt):
    model = random_model if which == "random" else fixture_model
    layer = 1
    b = compose_breakdown(model, prompt, layer, QUERY, KEY, "post")
    check(
        plotting.plot_compose_breakdown(b, WORDS[QUERY], WORDS[KEY]),
        f"breakdown_{which}",
        ["'of' -> 'burger'", "w_k1 (head x rank)", "w_k2 (rank x head)", "= A'", f"L{layer}H0", "head"],
    )
    check(plotting.plot_compose_breakdown(b, side="q"), f"breakdown_q_{which}", ["w_q1 (head x rank)", "pos 19"])
    fig = plotting.plot_compose_breakdown(b, WORDS[QUERY], WORDS[KEY])
    # three quantities, three colour bars: the gathered attention is not on the dynamic weights' scale
    assert colorbar_labels(fig) == ["attention weight", "dynamic weight\nw_k1, w_k2", "gathered\nattention"]
    gathered = next(ax for ax in fig.axes if ax.get_title().startswith("A @ w_k1"))
    expected = (b.before[None] @ b.w_k1).abs().max()
    assert np.isclose(gathered.images[0].get_clim()[1], float(expected), rtol=1e-5)
    # one naming of the heads, one number format
    head_labels = {t.get_text() for ax in fig.axes for t in ax.get_yticklabels() + ax.get_xticklabels()}
    assert {f"L{layer}H{h}" for h in range(4)} <= head_labels and not {"0", "3"} & (head_labels - {"0", "1"})
    numbers = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert numbers and all(re.fullmatch(r"-?\d+\.\d\d", n) for n in numbers), numbers
    maps = {
        f"L{layer} post 'of'->'burger'": composition_map(model, prompt, layer, QUERY, KEY),
        "same, without identity": composition_map(model, prompt, layer, QUERY, KEY, include_identity=False),
        f"L{layer} pre 'of'->'Michelle'": composition_map(model, prompt, layer, QUERY, 0, "pre"),
    }
    check(
        plotting.plot_composition_maps(maps),
        f"composition_maps_{which}",
        ["source head j", "composed head h", "'of'->'burger'"],
    )
    assert isinstance(plotting.plot_composition_map_plotly(maps["same, without identity"]), go.Figure)
    d = attention_distributions(model, prompt, layer, QUERY, heads=[0, 2])
    fig = plotting.plot_attention_distributions(d, WORDS, w_k1_heads=[0, 1, 2, 3], rank_index=1, highlight=[KEY])
    check(
        fig, f"attention_{which}", ["burger", "Michelle", f"L{layer}H2", "key token", "'of'", "after composition (A')"]
    )
    bars = [ax for ax in fig.axes if ax.patches]
    assert len({ax.get_ylim() for ax in bars}) == 1 and len(fig.legends) == 1  # one scale, one legend
    assert all(ax.get_legend() is None for ax in bars)


def test_plotly_page_has_a_title_and_opens_offline(tmp_path):
    fig = plotting.plot_composition_map_plotly(torch.eye(4), title="layer 2 map ('of' -> <burger>)")
    head = plotting.write_plotly_page(fig, tmp_path / "map.html").read_text().split("<body>")[0]
    assert "<title>layer 2 map (&#x27;of&#x27; -&gt; &lt;burger&gt;)</title>" in head  # escaped, in the <head>
    page = (tmp_path / "map.html").read_text()
    assert "<script src=" not in page  # plotly.js inlined
    assert plotting.write_plotly_page(fig, tmp_path / "map.html").read_text() == page  # a rerun writes the same page
    untitled = plotting.write_plotly_page(go.Figure(), tmp_path / "untitled_figure.html").read_text()
    assert "<title>untitled_figure</title>" in untitled.split("<body>")[0]


def test_head_diversity_figure(random_model, fixture_model):
    torch.manual_seed(1)
    mha = HookedDCFormer(
        DCFormerConfig(n_layers=2, d_model=32, n_heads=4, d_head=8, d_mlp=64, d_vocab=50, use_dcmha=False)
    )
    results = {
        "random (DCMHA)": head_diversity(random_model),
        "random (MHA)": head_diversity(mha),
        "fixture (DCMHA, 4 layers)": head_diversity(fixture_model),
    }
    fig = plotting.plot_head_diversity(results, per_layer=True)
    check(
        fig,
        "head_diversity",
        [
            "number of principal components k",
            "cumulative captured variance",
            "QK circuits (W_Q W_K^T)",
            "OV circuits (W_V W_O)",
            "minus random (MHA)",
        ],
    )
    verdict = plotting.diversity_verdict(results)  # the curves in numbers, for the page beside the figure
    assert "The paper (Fig. 5)" in verdict and "lower in" in verdict
    difference = fig.axes[2].lines  # QK, the first model minus the others: per layer (same depth), then the mean
    first, second = results["random (DCMHA)"], results["random (MHA)"]
    assert first.qk.shape == second.qk.shape
    mean = next(line for line in difference if line.get_linewidth() > 2).get_ydata()
    assert np.allclose(mean, (first.qk - second.qk).mean(0).numpy(), atol=1e-6)


def synthetic_results() -> pd.DataFrame:
    """Per-answer results of two made-up checkpoints on the catalog's 74 tasks, 3 samples each."""
    catalog = load_catalog()
    rng = random.Random(0)
    rows = []
    for checkpoint, skill in (("dcpythia-synth", 0.7), ("pythia-synth", 0.5)):
        for task in catalog.tasks.values():
            for sample in range(3):
                for k in range(2, 8):
                    rows.append(
                        {
                            "checkpoint": checkpoint,
                            "sample": sample,
                            "task": task.id,
                            "qk_pattern": task.qk_pattern,
                            "ov_transformation": task.ov_transformation,
                            "k_shot": k,
                            "answer": "a",
                            "predicted": "a",
                            "correct": rng.random() < skill,
                            "nll": 0.5,
                            "n_tokens": 1,
                        }
                    )
    return pd.DataFrame(rows, columns=RESULT_COLUMNS)


def test_synthetic_eval_figure():
    tables = accuracy_tables(synthetic_results(), n_resamples=200)
    fig = plotting.plot_synthetic_eval(tables)
    check(
        fig,
        "synthetic_eval",
        [
            "shots K",
            "same-person",
            "superclass",
            "chance (37%)",
            "no\nsample",
            "dcpythia-synth minus pythia-synth",
            "bootstrap interval",
            "leaves out 0",
        ],
    )
    # the combination heatmaps share one 0-100% scale, the cells' unit; the difference map is centred at zero
    images = [ax.images[0] for ax in fig.axes if ax.images]
    assert [image.get_clim() for image in images[:2]] == [(0, 100), (0, 100)]
    assert "accuracy (%)" in colorbar_labels(fig)
    low, high = images[2].get_clim()
    assert low == -high and images[2].get_cmap().name.startswith("RdBu")
    # each difference carries its paired interval, and exactly the significant ones are framed
    difference = tables["difference"].set_index(["qk_pattern", "ov_transformation"])
    diff_axis = images[2].axes
    intervals = [t.get_text().split("\n")[1] for t in diff_axis.texts]
    assert len(intervals) == len(difference) and all(i.startswith("[") for i in intervals)
    assert len(diff_axis.patches) == int(difference["significant"].sum()) > 0
    # an interval bar for every (checkpoint, QK pattern), and the chance dashes at 1/3 and 1/2
    qk_axis = next(ax for ax in fig.axes if ax.get_title() == "Accuracy by QK pattern")
    assert len(qk_axis.patches) == 2 * 5
    chance = sorted({round(float(x), 3) for segment in qk_axis.collections[-1].get_segments() for x in segment[:, 0]})
    assert chance == [0.333, 0.5]
    one = accuracy_tables(synthetic_results().query("checkpoint == 'pythia-synth'"), interval="wilson", n_resamples=10)
    check(plotting.plot_synthetic_eval(one), "synthetic_eval_one_checkpoint", ["Wilson interval", "pythia-synth"])


def test_composition_maps_share_one_centred_scale_and_wrap():
    torch.manual_seed(0)
    maps = {f"key {i}": torch.randn(4, 4) * (i + 1) for i in range(20)}
    fig = plotting.plot_composition_maps(maps, ncols=5)
    check(fig, "composition_maps_grid", ["key 19", "source head j", "C[h, j]"])
    panels = [ax for ax in fig.axes if ax.images]
    columns = len({round(ax.get_position().x0, 3) for ax in panels})
    assert len(panels) == 20 and columns == 2 and len({round(ax.get_position().y0, 3) for ax in panels}) == 10
    without = plotting.plot_composition_maps(maps, label="(C - I)[h, j]")
    assert colorbar_labels(without) == ["(C - I)[h, j]"]  # the quantity drawn names the colour bar
    limit = max(float(W.abs().max()) for W in maps.values())
    assert {ax.images[0].get_clim() for ax in panels} == {(-limit, limit)}
    assert len([ax for ax in fig.axes if ax.get_label() == "<colorbar>"]) == 1
    # numbers in the 4 x 4 cells, and C = W^T: row h, column j holds W[j, h]
    first = panels[0]
    assert len(first.texts) == 16
    assert first.texts[1].get_text() == f"{float(maps['key 0'][1, 0]):.2f}"  # cell (row 0, column 1)


def test_composition_along_sequence_leaves_keys_out_of_reach_blank():
    values = {
        "layer 0 (4-token window)": torch.tensor([float("nan")] * 6 + [1.0, 2.0, 3.0, 4.0]),
        "layer 1": torch.arange(10.0),
    }
    fig = plotting.plot_composition_along_sequence(values, WORDS[:10], query_pos=9)
    check(fig, "composition_along_sequence", ["||W - I||_F", "Michelle", "layer 0 (4-token window)"])
    local = fig.axes[0].lines[0].get_ydata()
    assert np.isnan(local[:6]).all() and not np.isnan(local[6:]).any()


def test_attribution_scale_keeps_small_heads_visible():
    scores = torch.tensor([[18.0, 0.5, -0.4], [1.2, -2.0, 0.1]])
    fig = plotting.plot_head_attribution(scores, top_k=2)
    check(fig, "attribution_symlog", ["L0H0", "-2", "0.5"])
    assert [" ".join(label.split()) for label in colorbar_labels(fig)] == ["attribution score (symmetric-log scale)"]
    ticks = [t for t in fig.axes[1].get_yticks() if -18 <= t <= 18]
    assert ticks == [-10.0, -1.0, 0.0, 1.0, 10.0]  # round numbers, not +-limit/10
    image = fig.axes[0].images[0]
    small = image.norm(np.array([0.5, -0.4]))
    assert abs(small[0] - 0.5) > 0.15 and abs(small[1] - 0.5) > 0.15  # visibly coloured, not white
    assert image.norm(0.0) == pytest.approx(0.5)  # centred at zero
    linear = plotting.plot_head_attribution(scores, color_scale="linear").axes[0].images[0]
    assert abs(linear.norm(np.array([0.5]))[0] - 0.5) < 0.02
    with pytest.raises(ValueError, match="color_scale"):
        plotting.plot_head_attribution(scores, color_scale="log")


def test_no_pyplot_state():
    import matplotlib.pyplot as plt

    assert plt.get_fignums() == []


def test_embedded_model_figures():
    """The App. G case study on the embedded model: find the top head, then Fig. 7 and 8 for it, and Fig. 5."""
    model = HookedDCFormer.from_pretrained("dcpythia-synth")
    prompt = "\n< Michelle has a burger. Helen has a papaya. Carol has a cannon. >. Michelle has a kind of"
    tokens = model.to_tokens(prompt)
    words = model.to_str_tokens(prompt)
    with torch.no_grad():
        answer = int(model(tokens)[0, -1].argmax())
    result = head_attribution(model, tokens, answer, target_type="logprob", n_steps=32)
    check(plotting.plot_head_attribution(result, top_k=5), "embedded_attribution", ["layer", "head"])
    layer, head = result.top_heads(1)[0]
    query = tokens.shape[1] - 1
    d = attention_distributions(model, tokens, layer, query, heads=[head, *[h for h in range(3) if h != head][:2]])
    key = int(d.after[0].argmax())
    b = compose_breakdown(model, tokens, layer, query, key, "post")
    check(plotting.plot_compose_breakdown(b, words[query], words[key]), "embedded_breakdown", ["w_k1 (head x rank)"])
    check(plotting.plot_attention_distributions(d, words), "embedded_attention", [f"L{layer}H{head}"])
    check(
        plotting.plot_composition_maps(
            {f"L{layer} post {words[query]!r}->{words[key]!r}": composition_map(model, tokens, layer, query, key)}
        ),
        "embedded_composition_map",
        ["source head j"],
    )
    results = {"dcpythia-synth": head_diversity(model)}
    results["pythia-synth"] = head_diversity(HookedDCFormer.from_pretrained("pythia-synth"))
    check(plotting.plot_head_diversity(results), "embedded_head_diversity", ["number of principal components"])


def test_circuit_figure_says_which_input_an_edge_feeds_in_colours_of_its_own(random_model):
    from matplotlib.colors import to_rgb

    from dcinterp.discovery import build_graph

    graph = build_graph(random_model)
    firsts = {}  # the first residual edge into a head's q, k and v, into an MLP, and a compose edge
    for i, edge in enumerate(graph.edges):
        into = edge.target.rsplit(".", 1)[-1] if edge.target_head is not None else edge.target
        firsts.setdefault("compose" if edge.kind == "compose" else into if into in ("q", "k", "v") else into[:3], i)
    circuit = torch.zeros(len(graph.edges), dtype=torch.bool)
    circuit[list(firsts.values())] = True
    fig = plotting.plot_circuit(graph, torch.linspace(-1, 1, len(graph.edges)), circuit)
    ax = fig.axes[0]
    labels = [text.get_text() for text in fig.legends[0].get_texts()]
    arrows = {to_rgb(a.arrow_patch.get_edgecolor()) for a in ax.texts if getattr(a, "arrow_patch", None)}
    for part in "qkv":
        assert f"residual edge into a head's {part}" in labels
        assert to_rgb(plotting.INPUT_COLORS[part]) in arrows, f"no edge drawn in the colour of {part}"
    assert to_rgb(plotting.INPUT_COLORS["other"]) in arrows  # the MLP's input
    assert {"q", "k", "v"} <= {text.get_text() for text in ax.texts}  # the letters at the arrowheads
    curve = pd.DataFrame(
        {
            "method": ["eap"] * 3 + ["random"] * 3,
            "selection": ["top-n"] * 3 + ["random"] * 3,
            "edges": [0, 10, 100] * 2,
            "faithfulness": [0.0, 0.8, 1.0, 0.0, 0.1, 1.0],
        }
    )
    check(
        fig,
        "circuit",
        ["|score|", "compose skip", "ring: compose, a head to itself", "residual edge into MLP, W, logits"],
    )
    # every kind of edge in a colour of its own, and a key for the line widths, from the largest |score| down
    (legend,) = fig.legends
    kinds = [
        (h.get_label(), to_rgb(h.get_color()))
        for h in legend.legend_handles
        if h.get_label().startswith(("res", "com"))
    ]
    assert len({color for _, color in kinds}) == len(kinds), kinds
    widths = [h.get_linewidth() for h in legend.legend_handles if "|score|" in h.get_label()]
    assert len(widths) == 3 and widths == sorted(widths, reverse=True)
    faithfulness = plotting.plot_faithfulness(curve)
    check(faithfulness, "faithfulness", ["80% faithful", "random edges (mean)"])
    lines = {line.get_label(): line for line in faithfulness.axes[0].lines}
    mark, random_edges = lines["80% faithful"], lines["random edges (mean)"]
    assert (to_rgb(mark.get_color()), mark.get_linestyle()) != (
        to_rgb(random_edges.get_color()),
        random_edges.get_linestyle(),
    )


@pytest.mark.parametrize("which", ["random", "fixture"])
def test_qk_figures(which, random_model, fixture_model, prompt):
    from dcinterp.qk import causal_checks, qk_attribution, qk_contrast

    model = random_model if which == "random" else fixture_model
    qk = qk_attribution(model, prompt, 1, 2, QUERY, KEY)
    contrast = qk_contrast(model, prompt, 1, 2, QUERY, KEY, 0)
    checks = causal_checks(model, qk, k=2)
    fig = plotting.plot_qk_attribution(
        qk.pair_table(),
        qk.head_branch_table(),
        qk.component_table(),
        checks,
        layer=1,
        top=4,
        label="score(burger)",
        contrast=dict(pairs=contrast.pair_table(), head_branch=contrast.head_branch_table(), label="difference"),
    )
    check(fig, f"qk_{which}", ["query component i", "key component j", "L1H2", "kp", "sum", "others", "difference"])
    heatmaps = [ax for ax in fig.axes if ax.images and ax.get_label() != "<colorbar>"]
    shown = heatmaps[0].images[0].get_array()
    assert np.isclose(shown.sum(), float(qk.composed[0]), atol=1e-4)  # 'others' keeps the cells' sum the score
    # one order of the components in every panel: rows and columns of both pair maps, and the bars
    names = [[t.get_text() for t in ax.get_xticklabels()] for ax in fig.axes if "component j" in ax.get_xlabel()]
    rows = [t.get_text() for t in heatmaps[0].get_yticklabels()]
    bars = [t.get_text() for t in next(ax for ax in fig.axes if ax.containers).get_yticklabels()]
    assert names[0] == names[1] == rows == [*bars, "others"]
    # every heatmap has its own colour bar, named after what it adds up to
    assert len(colorbar_labels(fig)) == len(heatmaps) == 4
    assert sorted(colorbar_labels(fig)) == sorted(
        ["contribution to score(burger)"] * 2 + ["contribution to difference"] * 2
    )
    # no 'others' where every component is shown
    every = plotting.plot_qk_attribution(qk.pair_table(), qk.head_branch_table(), top=50)
    assert "others" not in "\n".join(texts(every))
    page = plotting.plot_qk_keys_plotly(qk_attribution(model, prompt, 1, 2, QUERY))
    assert isinstance(page, go.Figure) and len(page.data) == 5 and page.layout.title.text


def test_qk_figure_of_plain_mha_has_no_branch_panel():
    """Plain MHA's score is its own QK circuit alone: no source head x branch panel (it would be one cell wide)."""
    from dcinterp.qk import qk_attribution

    torch.manual_seed(2)
    mha = HookedDCFormer(
        DCFormerConfig(n_layers=2, d_model=32, n_heads=4, d_head=8, d_mlp=64, d_vocab=50, use_dcmha=False)
    )
    prompt = torch.randint(3, 50, (1, len(WORDS)))
    qk = qk_attribution(mha, prompt, 1, 2, QUERY, KEY)
    fig = plotting.plot_qk_attribution(qk.pair_table(), qk.head_branch_table(), qk.component_table(), label="score")
    check(fig, "qk_mha", ["query component i"])
    assert not any("branch" in ax.get_xlabel() for ax in fig.axes)
    assert not plotting.qk._composes(qk.head_branch_table())


def test_synth_qk_figure_titles_say_positions_in_words():
    """`synth qk`'s figure names its positions as a reader would, not by the command line's role names."""
    from dcinterp.synth.commands import qk_attribution as qk

    assert set(qk.ROLE_WORDS) == set(qk.ROLES)
    assert not any("-" in words for words in qk.ROLE_WORDS.values())  # 'after-person', 'other-source' spelled out
    assert qk._in_words("burger") == "'burger'" and qk._score_label("top") == "score at the key"


def test_patching_and_ablation_figures():
    """Patching tables side by side on one scale, the agreement scatter, the ablation table: legible, no text baked
    in beyond what the caller passes, the agreement's rho in its title."""
    rng = np.random.default_rng(0)
    sites = [(stage, site) for stage in ("pre", "post") for site in ("o_qp", "o_kp", "o_qg", "o_kg", "qw1", "kw1")]
    frame = pd.DataFrame(
        [
            {"layer": layer, "stage": stage, "site": site, "head": "all", "effect": rng.normal(0, 0.3)}
            for stage, site in sites
            for layer in range(3)
        ]
    )
    other = frame.assign(effect=frame["effect"] + rng.normal(0, 0.05, len(frame)))
    fig = plotting.plot_patching({"exact": frame, "first order": other, "third": frame}, title="patching")
    check(fig, "patching", ["pre.o_qp", "layer", "exact"])
    limit = max(frame["effect"].abs().max(), other["effect"].abs().max())
    assert {ax.images[0].get_clim() for ax in fig.axes if ax.images} == {(-limit, limit)}  # one scale
    assert plotting.plot_patching({"exact": frame}, caption="a caption")._supxlabel.get_text() == "a caption"
    agreement = plotting.plot_patching_agreement(frame, other)
    check(agreement, "patching_agreement", ["activation patching (exact)", "36 rows"])
    assert "rho = 0.9" in agreement.axes[0].get_title()
    columns = ["accuracy", "qk:same-person", "qk:other-person", "ov:copy", "ov:superclass", "ov:next"]
    table = pd.DataFrame(
        [{"ablated": name, **{c: rng.uniform(0.3, 0.9) for c in columns}} for name in ("none", "all", "L1.pre.qp")]
    )
    check(plotting.plot_ablation_table(table), "ablation", ["all\n(", "L1.pre.qp", "accuracy change (points)"])
