"""Every figure renders, has a title, axis labels and token/head labels; renders go to /tmp/dcinterp-figs."""

import random
from pathlib import Path

import plotly.graph_objects as go
import pytest
import torch
from matplotlib.figure import Figure

from dcinterp import DCFormerConfig, HookedDCFormer, plotting
from dcinterp.attribution import head_attribution
from dcinterp.circuits import head_diversity
from dcinterp.composition import attention_distributions, compose_breakdown, composition_map

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
    found = [fig._suptitle.get_text()] if fig._suptitle else []
    for ax in fig.axes:
        found += [ax.get_title(), ax.get_title("left"), ax.get_xlabel(), ax.get_ylabel()]
        found += [t.get_text() for t in ax.get_xticklabels() + ax.get_yticklabels() + ax.texts]
    return [t for t in found if t]


def check(fig, name: str, must_show: list[str]) -> None:
    assert isinstance(fig, Figure)
    shown = "\n".join(texts(fig))
    main = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
    assert fig._suptitle is not None or all(ax.get_title() or ax.get_title("left") for ax in main)
    assert all(ax.get_xlabel() or ax.get_ylabel() for ax in main if ax.images or ax.lines or ax.patches)
    for text in must_show:
        assert text in shown, (name, text)
    OUT.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT / f"{name}.png", dpi=100)


@pytest.mark.parametrize("which", ["random", "fixture"])
def test_attribution_heatmap(which, random_model, fixture_model, prompt):
    model = random_model if which == "random" else fixture_model
    result = head_attribution(model, prompt, 7, n_steps=8)
    layer, head = result.top_heads(1)[0]
    check(plotting.plot_head_attribution(result, top_k=3), f"attribution_{which}",
          ["layer", "head", f"L{layer}H{head}"])
    interactive = plotting.plot_head_attribution_plotly(result)
    assert isinstance(interactive, go.Figure) and interactive.layout.title.text
    check(plotting.plot_head_attribution(torch.randn(32, 32), top_k=5), "attribution_32x32", ["layer", "head"])


@pytest.mark.parametrize("which", ["random", "fixture"])
def test_composition_figures(which, random_model, fixture_model, prompt):
    model = random_model if which == "random" else fixture_model
    layer = 1
    b = compose_breakdown(model, prompt, layer, QUERY, KEY, "post")
    check(plotting.plot_compose_breakdown(b, WORDS[QUERY], WORDS[KEY]), f"breakdown_{which}",
          ["'of' -> 'burger'", "w_k1 (head x rank)", "w_k2 (rank x head)", "= A'", f"L{layer}H0", "head"])
    check(plotting.plot_compose_breakdown(b, side="q"), f"breakdown_q_{which}", ["w_q1 (head x rank)", "pos 19"])
    maps = {f"L{layer} post 'of'->'burger'": composition_map(model, prompt, layer, QUERY, KEY),
            "same, without identity": composition_map(model, prompt, layer, QUERY, KEY, include_identity=False),
            f"L{layer} pre 'of'->'Michelle'": composition_map(model, prompt, layer, QUERY, 0, "pre")}
    check(plotting.plot_composition_maps(maps), f"composition_maps_{which}",
          ["source head j", "composed head h", "'of'->'burger'"])
    assert isinstance(plotting.plot_composition_map_plotly(maps["same, without identity"]), go.Figure)
    d = attention_distributions(model, prompt, layer, QUERY, heads=[0, 2])
    check(plotting.plot_attention_distributions(d, WORDS, w_k1_heads=[0, 1, 2, 3], rank_index=1),
          f"attention_{which}", ["burger", "Michelle", f"L{layer}H2", "key token", "'of'"])


def test_head_diversity_figure(random_model, fixture_model):
    torch.manual_seed(1)
    mha = HookedDCFormer(DCFormerConfig(n_layers=2, d_model=32, n_heads=4, d_head=8, d_mlp=64, d_vocab=50,
                                        use_dcmha=False))
    results = {"fixture (DCMHA)": head_diversity(fixture_model), "random (DCMHA)": head_diversity(random_model),
               "random (MHA)": head_diversity(mha)}
    check(plotting.plot_head_diversity(results, per_layer=True), "head_diversity",
          ["number of principal components", "cumulative captured variance", "QK circuits (W_Q W_K^T)"])


def test_synthetic_eval_figure():
    rng = random.Random(0)
    summary = {
        ckpt: {"accuracy": acc, "ppl": ppl,
               "by_k": {str(k): min(1.0, acc + 0.03 * (k - 4) + rng.uniform(-0.03, 0.03)) for k in range(2, 8)},
               "by_task": {f"task{i}": rng.random() for i in range(74)},
               "by_qk_pattern": {p: rng.random() for p in ["same-person", "the-other", "different-in-set"]},
               "by_ov_transformation": {o: {"accuracy": rng.random(), "n": 12} for o in ["copy", "obj->superclass"]}}
        for ckpt, acc, ppl in [("dcpythia-synth", 0.39, 7.36), ("pythia-synth", 0.319, 10.05)]
    }
    check(plotting.plot_synthetic_eval(summary), "synthetic_eval",
          ["shots K", "task73", "same-person", "obj->superclass", "Accuracy by task"])
    check(plotting.plot_synthetic_eval({k: {"accuracy": v["accuracy"]} for k, v in summary.items()}),
          "synthetic_eval_overall_only", ["dcpythia-synth"])


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
    check(plotting.plot_composition_maps({f"L{layer} post {words[query]!r}->{words[key]!r}":
                                          composition_map(model, tokens, layer, query, key)}),
          "embedded_composition_map", ["source head j"])
    results = {"dcpythia-synth": head_diversity(model)}
    results["pythia-synth"] = head_diversity(HookedDCFormer.from_pretrained("pythia-synth"))
    check(plotting.plot_head_diversity(results), "embedded_head_diversity", ["number of principal components"])
