"""Attribution graphs (dcinterp.attribution_graph): on every model shape the suite tests and on the embedded models,
the replacement with its error nodes gives the model's logits; every feature's and logit's input is the sum of its
incoming edges and its constant; removing a source in the replacement (patterns and norm scales frozen, the other
nodes held) moves every target by exactly its edge; an edge's parts by layer, head, source head and compose branch
add up to it; the pattern's terms add up to the composed pattern and to each post-compose branch's hook. Each
float32 identity is judged against the float64 run of the same inputs (tests/numerics.py)."""

import pytest
import torch

from dcinterp import HookedDCFormer
from dcinterp.attribution_graph import (
    BRANCHES,
    AttributionGraph,
    attribution_graph,
    edge_parts,
    graph_scores,
    live_removal,
    pattern_terms,
    prune_graph,
    replacement_forward,
    salient_logits,
    target_inputs,
)
from dcinterp.transcoders import load_transcoders, random_transcoders
from tests.numerics import assert_as_exact_as, float64_copy
from tests.test_qk import SHAPES, tiny

EMBEDDED = ("dcpythia-synth", "pythia-synth")
PROMPT = "< Michelle has cake. Brian has a shotgun. George has a peach. >. George possesses a kind of"  # task 2


def graphs(model: HookedDCFormer, tokens: torch.Tensor, d_transcoder: int) -> dict:
    """The graph of a prompt in float32 and in float64, the same weights (transcoders of float32 values)."""
    transcoders = random_transcoders(model, d_transcoder, scale=1.0, seed=3)
    model64 = float64_copy(model)
    transcoders64 = [float64_copy(tc) for tc in transcoders]
    g32 = attribution_graph(model, transcoders, tokens, batch_size=16)
    g64 = attribution_graph(model64, transcoders64, tokens, batch_size=16)
    assert torch.equal(g32.active_features, g64.active_features), "float32 and float64 activate other features"
    assert torch.equal(g32.logit_tokens, g64.logit_tokens)
    return dict(model32=model, model64=model64, tc32=transcoders, tc64=transcoders64, g32=g32, g64=g64, tokens=tokens)


@pytest.fixture(scope="module", params=[*SHAPES, *EMBEDDED])
def case(request) -> dict:
    if request.param in EMBEDDED:
        model = HookedDCFormer.from_pretrained(request.param).eval().requires_grad_(False)
        tokens = model.to_tokens(PROMPT, prepend_bos=False)[0]
        return graphs(model, tokens, 96)
    model = tiny(request.param)
    tokens = torch.randint(0, model.cfg.d_vocab, (9,), generator=torch.Generator().manual_seed(1))
    return graphs(model, tokens, 24)


def target_rows(graph: AttributionGraph) -> torch.Tensor:
    """The nodes with incoming edges: features and logits."""
    return torch.cat(
        [torch.arange(graph.n_features), torch.arange(graph.logit_index(0), graph.logit_index(graph.n_logits))]
    )


def test_replacement_reproduces_logits(case):
    outputs = {
        bits: replacement_forward(case[f"model{bits}"], case[f"tc{bits}"], case[f"g{bits}"].run).logits[0]
        for bits in ("32", "64")
    }
    with torch.no_grad():
        logits32 = case["model32"](case["tokens"][None])[0]
        logits64 = case["model64"](case["tokens"][None])[0]
    assert_as_exact_as(outputs["32"], logits32, logits64, "replacement logits")
    assert (outputs["64"] - logits64).abs().max() <= 1e-12 * logits64.abs().max()


def test_node_inputs_are_their_edges_and_constant(case):
    g32, g64 = case["g32"], case["g64"]
    rows = target_rows(g32)
    assert g32.n_features > 20 and g32.n_logits >= 1
    summed = {bits: (g.adjacency_matrix.sum(1) + g.constant_inputs)[rows] for bits, g in (("32", g32), ("64", g64))}
    assert_as_exact_as(summed["32"], g32.node_inputs[rows], g64.node_inputs[rows], "sum of edges + constant")
    exact = g64.node_inputs[rows]
    assert (summed["64"] - exact).abs().max() <= 1e-12 * exact.abs().max()
    # The model's own feature pre-activations and demeaned logits, not the replacement's: the same numbers.
    run = g64.run
    for i, (layer, pos, feature) in enumerate(g64.active_features.tolist()[:50]):
        tc = case["tc64"][layer]
        own = run.mlp_inputs[layer][pos] @ tc.W_enc[:, feature] + tc.b_enc[feature]
        assert abs(own - g64.node_inputs[i]) <= 1e-12 * max(1.0, abs(own))
    logits = run.logits[-1]
    own = logits[g64.logit_tokens] - logits.mean()
    assert torch.allclose(own, g64.node_inputs[g64.logit_index(0) :], rtol=0, atol=1e-12 * logits.abs().max())


def removed(case, bits: str, source: int) -> torch.Tensor:
    """Every node's input in the replacement with `source` set to zero and every other source held."""
    model, transcoders, graph = case[f"model{bits}"], case[f"tc{bits}"], case[f"g{bits}"]
    run, node = graph.run, graph.node(source)
    embed = model.embed.W_E[run.tokens][None].clone()
    acts = [a.clone() for a in run.acts]
    errors = [e.clone() for e in run.errors]
    if node["kind"] == "feature":
        acts[node["layer"]][node["pos"], node["feature"]] = 0
    elif node["kind"] == "error":
        errors[node["layer"]][node["pos"]] = 0
    else:
        embed[0, node["pos"]] = 0
    with torch.no_grad():
        outputs = replacement_forward(model, transcoders, run, embed=embed, acts=acts, errors=errors)
    return target_inputs(model, transcoders, graph, outputs)[0]


def sources(graph: AttributionGraph) -> list[int]:
    """A few sources of every kind: features of each layer, error nodes, token embeddings."""
    layers = graph.active_features[:, 0]
    picked = [int((layers == layer).nonzero()[0]) for layer in range(graph.n_layers) if (layers == layer).any()]
    picked += [graph.error_index(0, graph.n_pos - 1), graph.error_index(graph.n_layers - 2, 1)]
    return picked + [graph.token_index(0), graph.token_index(graph.n_pos - 1)]


def test_removing_a_source_moves_each_target_by_its_edge(case):
    g32, g64 = case["g32"], case["g64"]
    rows = target_rows(g32)
    for source in sources(g32):
        moved = {bits: removed(case, bits, source) - case[f"g{bits}"].node_inputs for bits in ("32", "64")}
        edge = -g32.adjacency_matrix[rows, source]
        assert_as_exact_as(edge, moved["32"][rows], moved["64"][rows], f"source {g32.node(source)}")
        exact = moved["64"][rows]
        assert (-g64.adjacency_matrix[rows, source] - exact).abs().max() <= 1e-12 * max(1.0, exact.abs().max())


def test_edge_parts_add_up_to_the_edge(case):
    g32, g64, model = case["g32"], case["g64"], case["model32"]
    targets = [g32.logit_index(0), int((g32.active_features[:, 0] == g32.n_layers - 1).nonzero()[-1])]
    sums32, edges32, edges64 = [], [], []
    for target in targets:
        picked = sources(g32)
        parts = edge_parts(model, case["tc32"], g32, target, picked)
        parts64 = edge_parts(case["model64"], case["tc64"], g64, target, picked)
        assert set(parts.branch) <= {"residual", *BRANCHES} and parts.source.unique().tolist() == picked
        sums32 += parts.groupby("source").value.sum()[picked].tolist()
        edges32 += g32.adjacency_matrix[target, picked].tolist()
        edges64 += g64.adjacency_matrix[target, picked].tolist()
        exact = g64.adjacency_matrix[target, picked]
        error64 = torch.tensor(parts64.groupby("source").value.sum()[picked].tolist(), dtype=torch.float64) - exact
        assert error64.abs().max() <= 1e-12 * max(1.0, exact.abs().max())
        attention = parts[parts.branch != "residual"]
        if not model.cfg.use_dcmha:  # plain MHA: heads only
            assert set(attention.branch) <= {"skip"} and (attention["head"] == attention["source_head"]).all()
        elif target == g32.logit_index(0):  # every branch of the compose carries a share of the logit's edges
            assert set(attention.branch) == set(BRANCHES) - ({"kp", "kg"} if model.cfg.query_wise else set())
        away = [source for source in picked if g32.node(source)["pos"] != g32.node(target)["pos"]]
        assert (parts[parts.source.isin(away) & (parts.branch == "residual")].value == 0).all()
        by_query = edge_parts(case["model64"], case["tc64"], g64, target, picked, by_query=True)
        moved = by_query[by_query.branch != "residual"]  # each part split by the query its head moves the source to
        assert (moved["query"] >= [g64.node(source)["pos"] for source in moved.source]).all()
        keys = ["source", "layer", "head", "source_head", "branch"]
        summed = by_query.groupby(keys, sort=False).value.sum().reset_index()
        assert summed[keys].equals(parts64[keys])
        assert (summed.value - parts64.value).abs().max() <= 1e-12 * max(1.0, parts64.value.abs().max())
    as_tensor = torch.tensor
    assert_as_exact_as(as_tensor(sums32), as_tensor(edges32), as_tensor(edges64, dtype=torch.float64), "edge parts")


def test_pattern_terms_add_up_to_the_pattern_and_the_branch_hooks(case):
    model, model64, g32, g64 = case["model32"], case["model64"], case["g32"], case["g64"]
    names = lambda name: ".post_compose.hook_o_" in name  # noqa: E731
    with torch.no_grad():
        _, cache = model64.run_with_cache(case["tokens"][None], names_filter=names)
    for layer in range(model.cfg.n_layers):
        terms = pattern_terms(model, g32.run, layer)
        terms64 = pattern_terms(model64, g64.run, layer)
        assert_as_exact_as(terms.sum((0, 1)), g32.run.patterns[layer], g64.run.patterns[layer], f"P' of {layer}")
        if not model.cfg.use_dcmha:  # plain MHA: P itself, on the skip branch, each head its own source
            assert torch.equal(terms64[0].sum(0), g64.run.patterns[layer]) and terms64[1:].abs().max() == 0
            assert torch.equal(terms64[0].diagonal(0, 0, 1).movedim(-1, 0), g64.run.patterns[layer])
            continue
        for b, branch in enumerate(BRANCHES[1:], 1):
            name = f"blocks.{layer}.attn.post_compose.hook_o_{branch}"
            if name in cache:
                hooked = cache[name][0]
                assert (terms64[b].sum(0) - hooked).abs().max() <= 1e-12 * max(1.0, hooked.abs().max())
            else:
                assert terms64[b].abs().max() == 0


def test_salient_logits_follow_circuit_tracer():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9, -1.0], dtype=torch.float64)
    p = logits.softmax(-1)  # 0.474 and 0.429 at tokens 1 and 3: two reach 0.5, one does not
    tokens, probs = salient_logits(logits, max_n_logits=10, desired_logit_prob=0.5)
    assert tokens.tolist() == [1, 3] and torch.equal(probs, p[[1, 3]])
    assert salient_logits(logits, max_n_logits=10, desired_logit_prob=0.4)[0].tolist() == [1]
    assert salient_logits(logits, max_n_logits=1)[0].tolist() == [1]


def toy_graph(adjacency: list[list[float]], n_features: int, n_layers: int, n_pos: int, probs: list[float]):
    """An AttributionGraph of a given adjacency (nodes: features, errors, tokens, logits), for pruning by hand."""
    A = torch.tensor(adjacency, dtype=torch.float64)
    zeros = torch.zeros(len(A), dtype=torch.float64)
    features = torch.tensor([[0, 0, f] for f in range(n_features)]).reshape(-1, 3)
    return AttributionGraph(
        None,
        features,
        torch.ones(n_features),
        torch.arange(len(probs)),
        torch.tensor(probs),
        A,
        zeros,
        zeros,
        n_layers,
        n_pos,
    )


def test_pruning_and_scores_by_hand():
    # Nodes: feature 0, feature 1, error (layer 0, pos 0), token 0, logit 0.
    # token -> f0 (3), token -> f1 (0.01), error -> f0 (1), f0 -> logit (2), f1 -> logit (0.01), token -> logit (1)
    A = [
        [0, 0, 1, 3, 0],
        [0, 0, 0, 0.01, 0],
        [0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0],
        [2, 0.01, 0, 1, 0],
    ]
    graph = toy_graph(A, n_features=2, n_layers=1, n_pos=1, probs=[1.0])
    node_mask, edge_mask, cumulative = prune_graph(graph, node_threshold=0.8, edge_threshold=0.98)
    # Influence on the logit: token 0.834 (1 + 2 * 3/4 + 0.01) / 3.01, f0 0.664, error 0.166, f1 0.003: sorted, their
    # cumulative shares are 0.50, 0.90, 1.00, 1.00, so 0.8 of it keeps the nodes down to f0's score: token and f0.
    assert node_mask.tolist() == [True, False, False, True, True]
    # Edges left: token -> f0 (score 2/3), f0 -> logit (2/3), token -> logit (1/3): 0.98 of 5/3 keeps all three.
    assert sorted(map(tuple, edge_mask.nonzero().tolist())) == [(0, 3), (4, 0), (4, 3)]
    assert cumulative.max() == pytest.approx(1.0)
    replacement, completeness = graph_scores(graph)
    influence_error, influence_token = (2 / 3.01) / 4, 1 / 3.01 + (2 / 3.01) * 0.75 + 0.01 / 3.01
    assert replacement == pytest.approx(influence_token / (influence_token + influence_error))
    weights = [2 / 3.01, 0.01 / 3.01, influence_error, influence_token, 1.0]  # influence + logit weight
    non_error = [0.75, 1, 1, 1, 1]
    assert completeness == pytest.approx(sum(w * f for w, f in zip(weights, non_error, strict=True)) / sum(weights))
    with pytest.raises(ValueError, match="node_threshold"):
        prune_graph(graph, node_threshold=1.5)


def test_pruned_graph_keeps_tokens_and_logits(case):
    graph = case["g64"]
    node_mask, edge_mask, _ = prune_graph(graph)
    assert node_mask[graph.token_index(0) :].all()
    kept = node_mask[: graph.token_index(0)]
    assert kept.sum() < len(kept)  # something was pruned
    assert not edge_mask[~node_mask].any() and not edge_mask[:, ~node_mask].any()
    replacement, completeness = graph_scores(graph)
    assert 0 < replacement < 1 and 0 < completeness < 1


CASE_STUDY = (  # docs/attribution-graphs.md's prompt: the case study's person lookup
    "\n< Ruth has a sweater. Steven has a taxi. Brian has a dog. >. Steven owns a kind of vehicle"
    "\n< Brian has a violin. Barbara has a pistol. Nancy has a banana. >. Nancy owns a kind of fruit"
    "\n< Michelle has a burger. Helen has a papaya. Carol has a cannon. >. Michelle owns a kind of"
)
DOCUMENTED = {  # features, kept nodes, kept edges, replacement, completeness, strongest edge into the logit, and
    # for the feature with the strongest edge: minus its edge, and its live removal's change of the logit
    "dcpythia-synth": (2288, 83, 27, 0.83, 0.93, 5.87, (-2.820, -0.366)),
    "pythia-synth": (2207, 83, 38, 0.79, 0.91, 5.60, (-1.170, -1.207)),
}


@pytest.mark.parametrize("name", list(DOCUMENTED))
def test_the_documented_person_lookup_graphs(name):
    model = HookedDCFormer.from_pretrained(name).eval().requires_grad_(False)
    transcoders = load_transcoders(name)
    tokens = model.to_tokens(CASE_STUDY)[0]
    graph = attribution_graph(model, transcoders, tokens)
    node_mask, edge_mask, _ = prune_graph(graph)
    features, nodes, edges, replacement, completeness, strongest, live = DOCUMENTED[name]
    assert model.tokenizer.decode(graph.logit_tokens.tolist()) == "food"
    assert (graph.n_features, int(node_mask.sum()), int(edge_mask.sum())) == (features, nodes, edges)
    assert [round(score, 2) for score in graph_scores(graph)] == [replacement, completeness]
    logit = graph.logit_index(0)
    top = int(graph.adjacency_matrix[logit].abs().argmax())
    assert graph.node(top) == dict(kind="token", layer=-1, pos=55, token=model.to_single_token("burger"))
    assert round(graph.adjacency_matrix[logit, top].item(), 2) == strongest
    parts = edge_parts(model, transcoders, graph, logit, edge_mask[logit].nonzero().flatten().tolist())
    attention = parts[parts.branch != "residual"]
    share = attention.groupby("branch").value.apply(lambda v: v.abs().sum()) / attention.value.abs().sum()
    cross = attention[attention["head"] != attention["source_head"]].value.abs().sum() / attention.value.abs().sum()
    feature = int(graph.adjacency_matrix[logit, : graph.n_features].abs().argmax())
    removal = (
        round(-graph.adjacency_matrix[logit, feature].item(), 3),
        round(live_removal(model, transcoders, graph, feature)[0].item(), 3),
    )
    assert removal == live
    if model.cfg.use_dcmha:  # the page's shares: skip 32%, qp 20%, kp 20%, qg 15%, kg 13%; 30% across heads
        assert share.round(2).to_dict() == {"kg": 0.13, "kp": 0.2, "qg": 0.15, "qp": 0.2, "skip": 0.32}
        assert round(cross, 2) == 0.3
    else:
        assert share.to_dict() == {"skip": 1.0} and cross == 0


def test_live_removal_is_the_model_run_without_the_source(case):
    """With nothing frozen, removing a token's embedding is the model run on embeddings without it (an independent
    route: `start_at_layer=0`); removing a feature moves the prediction."""
    model, graph = case["model64"], case["g64"]
    source = graph.token_index(graph.n_pos - 2)
    moved = live_removal(model, case["tc64"], graph, source)
    embed = model.embed.W_E[graph.run.tokens][None].clone()
    embed[0, -2] = 0
    with torch.no_grad():
        before = model(graph.run.tokens[None])[0, -1]
        after = model(embed, start_at_layer=0)[0, -1]
    tokens = graph.logit_tokens
    expected = (after[tokens] - after.mean()) - (before[tokens] - before.mean())
    assert (moved - expected).abs().max() <= 1e-12 * max(1.0, expected.abs().max())
    feature = int(graph.adjacency_matrix[graph.logit_index(0), : graph.n_features].abs().argmax())
    assert live_removal(model, case["tc64"], graph, feature).abs().max() > 0
