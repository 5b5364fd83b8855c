"""Edge-level circuit discovery: exact edge patching against brute-force re-runs through the model's own hooks,
EAP scores against the gradient formula by hand, faithfulness of the full and the empty graph, selection."""

import pytest
import torch

from dcinterp import HookedDCFormer
from dcinterp.config import DCFormerConfig
from dcinterp.dcmha.materialised import branch_outputs
from dcinterp.discovery import (
    CircuitEvaluator,
    Graph,
    build_graph,
    edge_scores,
    faithfulness_curve,
    greedy_circuit,
    top_n_circuit,
)
from dcinterp.synth.contrast import PairTokens

WEIGHTS = ("qw1", "qw2", "kw1", "kw2", "qg", "kg")
SHAPES = {
    "parallel": dict(parallel_residual=True),  # DCPythia
    "sequential": dict(
        parallel_residual=False,
        normalization_type="RMS",
        act_fn="swiglu",
        use_bias=False,
        mgate_dim=2,
        window_size=3,
        window_type="LG",
    ),  # DCFormer++
    "mha": dict(use_dcmha=False),  # Pythia
}


def tiny(shape: str) -> HookedDCFormer:
    torch.manual_seed(0)
    cfg = DCFormerConfig(
        n_layers=2,
        d_model=16,
        n_heads=3,
        d_head=4,
        d_mlp=16,
        d_vocab=23,
        dcmha_rank=2,
        dyn_hidden_dim=6,
        **SHAPES[shape],
    )
    model = HookedDCFormer(cfg)
    model.init_weights(std=0.3)
    with torch.no_grad():  # a compose strong enough that every edge matters
        for name, p in model.named_parameters():
            if "W_dyn_out" in name:
                p.mul_(400.0)
            if "W_dyn_gate" in name:
                p.mul_(20.0)
    return model.eval().requires_grad_(False)


def random_pairs(model: HookedDCFormer, n: int = 3, pos: int = 6) -> PairTokens:
    generator = torch.Generator().manual_seed(1)
    clean = torch.randint(0, model.cfg.d_vocab, (n, pos), generator=generator)
    corrupt = clean.clone()
    corrupt[:, 1] = (clean[:, 1] + 5) % model.cfg.d_vocab
    corrupt[:, 3] = (clean[:, 3] + 7) % model.cfg.d_vocab
    return PairTokens(clean, corrupt, torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6]), torch.full((n,), pos - 1))


def logit_diff(model, pairs, fwd_hooks=()):
    logits = model.run_with_hooks(pairs.clean, fwd_hooks=list(fwd_hooks))
    rows = torch.arange(pairs.clean.shape[0])
    final = logits[rows, pairs.position]
    return (final[rows, pairs.clean_answer] - final[rows, pairs.corrupt_answer]).mean().item()


@pytest.fixture(scope="module", params=list(SHAPES))
def setup(request):
    model = tiny(request.param)
    pairs = random_pairs(model)
    graph = build_graph(model)
    return model, pairs, graph, CircuitEvaluator(model, graph, pairs)


def caches(model, pairs):
    model.set_use_attn_result(True)
    try:
        _, clean = model.run_with_cache(pairs.clean)
        _, corrupt = model.run_with_cache(pairs.corrupt)
    finally:
        model.set_use_attn_result(False)
    return clean, corrupt


def sender_output(cache, name: str) -> torch.Tensor:
    if name == "embed":
        return cache["hook_embed"]
    if name.startswith("MLP"):
        return cache[f"blocks.{name[3:]}.hook_mlp_out"]
    layer, head = name[1:].split("H")
    return cache[f"blocks.{layer}.attn.hook_result"][:, :, int(head)]


def stage_input(model, cache, layer: int, stage: str) -> torch.Tensor:
    if stage == "post":
        return cache[f"blocks.{layer}.attn.hook_pattern"]
    scores = cache[f"blocks.{layer}.attn.hook_attn_scores"]
    return scores.masked_fill(scores <= torch.finfo(scores.dtype).min / 2, 0.0)


def brute_force_hooks(model, graph, edge, clean, corrupt):
    """Hooks on the model's own forward that cut one edge (everything else clean), written from the edge's meaning."""
    cfg = model.cfg
    if edge.kind == "compose":
        layer, stage, n, m = edge.layer, edge.stage, edge.source_head, edge.target_head
        A, A_corrupt = stage_input(model, clean, layer, stage), stage_input(model, corrupt, layer, stage)
        attn = f"blocks.{layer}.attn"
        if edge.branch == "skip":

            def hook(x, hook):
                x = x.clone()
                x[:, m] += (A_corrupt - A)[:, n]
                return x

            return [(f"{attn}.hook_{'composed_scores' if stage == 'pre' else 'composed_pattern'}", hook)]
        weights = {w: clean[f"{attn}.{stage}_compose.hook_{w}"] for w in WEIGHTS}
        A_mixed = A.clone()
        A_mixed[:, n] = A_corrupt[:, n]
        patched = branch_outputs(A_mixed, **weights)[edge.branch][:, m]

        def hook(x, hook):
            x = x.clone()
            x[:, m] = patched
            return x

        return [(f"{attn}.{stage}_compose.hook_o_{edge.branch}", hook)]

    delta = sender_output(corrupt, edge.source) - sender_output(clean, edge.source)
    if edge.target == "logits":

        def hook(x, hook):
            return x + delta

        return [(f"blocks.{cfg.n_layers - 1}.hook_resid_post", hook)]
    layer, block = edge.layer, model.blocks[edge.layer]
    if edge.target.startswith("MLP"):
        resid = clean[f"blocks.{layer}.hook_resid_{'pre' if cfg.parallel_residual else 'mid'}"]
        out = block.mlp(block.ln2(resid + delta))
        return [(f"blocks.{layer}.hook_mlp_out", lambda x, hook: out)]
    if edge.target.endswith(".compose"):
        dyn = block.attn.dynamic_weights(block.ln1(clean[f"blocks.{layer}.hook_resid_pre"] + delta))
        return [
            (f"blocks.{layer}.attn.{stage}_compose.hook_{w}", lambda x, hook, v=value: v)
            for stage in cfg.compose_stages
            for w, value in zip(WEIGHTS, dyn[stage], strict=True)
        ]
    part, head = edge.target[-1], edge.target_head

    def hook(x, hook):
        x = x.clone()
        x[:, :, head] += delta
        return x

    return [(f"blocks.{layer}.attn.hook_{part}_input", hook)]


def one_of_each(graph: Graph) -> list[int]:
    """Edges of every type: (kind, receiver part, stage, branch), a few of each."""
    seen, chosen = {}, []
    for i, edge in enumerate(graph.edges):
        part = edge.target.split(".")[-1] if "." in edge.target else edge.target.rstrip("0123456789")
        key = (edge.kind, part, edge.stage, edge.branch, edge.source_head == edge.target_head)
        if seen.get(key, 0) < 2 and (edge.layer > 0 or edge.kind == "compose"):
            seen[key] = seen.get(key, 0) + 1
            chosen.append(i)
    return chosen


def test_graph_counts():
    for shape in SHAPES:
        model = tiny(shape)
        graph = build_graph(model)
        H, L = 3, 2
        senders = 1 + L * (H + 1)
        residual = sum(3 * (1 + l * (H + 1)) * H for l in range(L)) + senders
        residual += sum(1 + l * (H + 1) + (H if shape == "sequential" else 0) for l in range(L))
        compose = 0
        if shape != "mha":
            residual += sum(1 + l * (H + 1) for l in range(L))
            compose = L * 2 * (2 * H * H + 3 * H)
        assert graph.counts()["residual_edges"] == residual
        assert graph.counts()["compose_edges"] == compose
        assert len(graph.frame()) == len(graph)


def test_full_graph_is_the_clean_run_and_empty_graph_the_corrupted_one(setup):
    model, pairs, graph, evaluator = setup
    assert evaluator.m_clean == pytest.approx(logit_diff(model, pairs), abs=1e-4)
    corrupted = PairTokens(pairs.corrupt, pairs.corrupt, pairs.clean_answer, pairs.corrupt_answer, pairs.position)
    assert evaluator.m_corrupt == pytest.approx(logit_diff(model, corrupted), abs=1e-4)
    assert abs(evaluator.m_clean - evaluator.m_corrupt) > 0.05  # the pairs differ, so the test can fail
    assert evaluator.faithfulness(torch.ones(len(graph), dtype=torch.bool)) == pytest.approx(1.0, abs=1e-5)
    assert evaluator.faithfulness(torch.zeros(len(graph), dtype=torch.bool)) == pytest.approx(0.0, abs=1e-5)


def test_single_edge_patching_equals_a_brute_force_rerun(setup):
    model, pairs, graph, evaluator = setup
    clean, corrupt = caches(model, pairs)
    chosen = one_of_each(graph)
    kinds = {graph.edges[i].kind for i in chosen}
    assert kinds == ({"residual"} if not model.cfg.use_dcmha else {"residual", "compose"})
    model.set_use_split_qkv_input(True)
    try:
        effects = evaluator.single_edge_effects(chosen)
        for i, effect in zip(chosen, effects, strict=True):
            edge = graph.edges[i]
            with torch.no_grad():
                expected = logit_diff(model, pairs, brute_force_hooks(model, graph, edge, clean, corrupt))
            assert effect == pytest.approx(expected - evaluator.m_clean, abs=2e-4), edge
    finally:
        model.set_use_split_qkv_input(False)
    assert max(abs(e) for e in effects) > 1e-2


def test_cutting_a_branch_is_the_branch_recomputed_from_the_corrupted_input_and_clean_weights():
    model = tiny("parallel")
    pairs = random_pairs(model)
    graph = build_graph(model)
    evaluator = CircuitEvaluator(model, graph, pairs)
    clean, corrupt = caches(model, pairs)
    for layer, stage, branch in [(1, "pre", "qp"), (0, "post", "kp"), (1, "post", "qg"), (0, "pre", "kg")]:
        circuit = torch.tensor(
            [not (e.kind == "compose" and (e.layer, e.stage, e.branch) == (layer, stage, branch)) for e in graph.edges]
        )
        attn = f"blocks.{layer}.attn"
        weights = {w: clean[f"{attn}.{stage}_compose.hook_{w}"] for w in WEIGHTS}
        by_hand = branch_outputs(stage_input(model, corrupt, layer, stage), **weights)[branch]
        expected = logit_diff(model, pairs, [(f"{attn}.{stage}_compose.hook_o_{branch}", lambda x, hook, v=by_hand: v)])
        assert evaluator(circuit) == pytest.approx(expected, abs=1e-4)
        assert abs(expected - evaluator.m_clean) > 1e-3


def test_eap_score_is_the_gradient_formula_by_hand():
    model = tiny("parallel")
    pairs = random_pairs(model)
    graph = build_graph(model)
    scores = edge_scores(model, pairs, "eap", graph=graph)
    clean, corrupt = caches(model, pairs)
    layer, head = 1, 2
    attn = f"blocks.{layer}.attn"
    # gradients of the mean logit difference at the receivers, from the model's own hooks
    grads = {}

    def keep(x, hook):
        offset = torch.zeros_like(x, requires_grad=True)
        grads[hook.name] = offset
        return x + offset

    names = [
        f"{attn}.hook_q_input",
        f"{attn}.hook_k_input",
        f"{attn}.hook_v_input",
        f"{attn}.hook_composed_scores",
        f"{attn}.hook_composed_pattern",
        "blocks.1.hook_resid_post",
    ]
    model.set_use_split_qkv_input(True)
    try:
        with torch.enable_grad():
            logit_diff_tensor(model, pairs, [(n, keep) for n in names])
    finally:
        model.set_use_split_qkv_input(False)
    g = {n: grads[n].grad for n in names}
    frame = graph.frame()

    def score_of(**where):
        rows = frame
        for key, value in where.items():
            rows = rows[rows[key] == value]
        assert len(rows) == 1, where
        return scores[rows.index[0]].item()

    for source in ("embed", "L0H1", "MLP0"):
        delta = sender_output(corrupt, source) - sender_output(clean, source)
        for part in ("q", "k", "v"):
            assert score_of(source=source, target=f"L{layer}H{head}.{part}") == pytest.approx(
                (delta * g[f"{attn}.hook_{part}_input"][:, :, head]).sum().item(), rel=1e-4, abs=1e-6
            )
    delta = sender_output(corrupt, "MLP1") - sender_output(clean, "MLP1")
    assert score_of(source="MLP1", target="logits") == pytest.approx(
        (delta * g["blocks.1.hook_resid_post"]).sum().item(), rel=1e-4, abs=1e-6
    )
    for stage, hook in (("pre", "hook_composed_scores"), ("post", "hook_composed_pattern")):
        A, A_corrupt = stage_input(model, clean, layer, stage), stage_input(model, corrupt, layer, stage)
        w = {n: clean[f"{attn}.{stage}_compose.hook_{n}"] for n in WEIGHTS}
        n, m = 0, 2
        W_qp = torch.einsum("btr,btr->bt", w["qw1"][..., n], w["qw2"][..., m])  # [b, t]
        by_hand = ((A_corrupt - A)[:, n] * W_qp[:, :, None] * g[f"{attn}.{hook}"][:, m]).sum().item()
        assert score_of(
            source=f"L{layer}H{n}.{'scores' if stage == 'pre' else 'pattern'}",
            branch="qp",
            target=f"L{layer}H{m}.composed_{'scores' if stage == 'pre' else 'pattern'}",
        ) == pytest.approx(by_hand, rel=1e-4, abs=1e-6)
        gate = ((A_corrupt - A)[:, m] * w["kg"][:, :, m][:, None, :] * g[f"{attn}.{hook}"][:, m]).sum().item()
        assert score_of(stage=stage, layer=layer, branch="kg", target_head=m) == pytest.approx(gate, rel=1e-4, abs=1e-6)


def logit_diff_tensor(model, pairs, hooks):
    logits = model.run_with_hooks(pairs.clean, fwd_hooks=hooks)
    rows = torch.arange(pairs.clean.shape[0])
    final = logits[rows, pairs.position]
    value = (final[rows, pairs.clean_answer] - final[rows, pairs.corrupt_answer]).mean()
    value.backward()
    return value.item()


def test_eap_ig_with_one_step_is_eap_and_steps_can_be_batched():
    model = tiny("sequential")
    pairs = random_pairs(model)
    graph = build_graph(model)
    eap = edge_scores(model, pairs, "eap", graph=graph)
    torch.testing.assert_close(edge_scores(model, pairs, "eap-ig", n_steps=1, graph=graph), eap, rtol=1e-4, atol=1e-6)
    whole = edge_scores(model, pairs, "eap-ig", n_steps=4, graph=graph)
    torch.testing.assert_close(
        edge_scores(model, pairs, "eap-ig", n_steps=4, graph=graph, ig_batch_size=3, batch_size=2),
        whole,
        rtol=1e-4,
        atol=1e-6,
    )
    assert (whole - eap).abs().max() > 1e-4


def test_greedy_circuit_is_connected_to_the_logits():
    model = tiny("parallel")
    graph = build_graph(model)
    scores = torch.randn(len(graph), generator=torch.Generator().manual_seed(0))
    circuit = greedy_circuit(graph, scores, 40)
    assert int(circuit.sum()) == 40
    chosen = [graph.edges[i] for i in torch.nonzero(circuit)[:, 0].tolist()]
    alive = {"logits"}
    for _ in range(len(chosen) + 1):  # every chosen edge's target reaches the logits through chosen edges
        for edge in chosen:
            if edge.target in alive or any(s in alive for s in _closure(graph, edge.target)):
                alive.add(edge.source)
    assert all(edge.source in alive for edge in chosen)
    assert int(top_n_circuit(scores, 7).sum()) == 7
    assert top_n_circuit(scores, 7)[scores.abs().argmax()]


def _closure(graph, node):
    out, todo = set(), [node]
    while todo:
        for succ in graph.implicit_successors(todo.pop()):
            if succ not in out:
                out.add(succ)
                todo.append(succ)
    return out


def test_faithfulness_curve_ends_at_one_and_zero():
    model = tiny("parallel")
    pairs = random_pairs(model)
    graph = build_graph(model)
    evaluator = CircuitEvaluator(model, graph, pairs)
    scores = edge_scores(model, pairs, "eap", graph=graph)
    curve = faithfulness_curve(evaluator, {"eap": scores}, counts=[0, 10, len(graph)], random_repeats=1)
    full = curve[curve.edges == len(graph)]
    assert full.faithfulness.to_numpy() == pytest.approx(1.0, abs=1e-5)
    assert curve[curve.edges == 0].faithfulness.to_numpy() == pytest.approx(0.0, abs=1e-5)
    assert set(curve.selection) == {"top-n", "greedy", "random"}


def test_logprob_metric_full_and_empty_graph_and_scores():
    model = tiny("sequential")
    pairs = random_pairs(model)
    graph = build_graph(model)
    evaluator = CircuitEvaluator(model, graph, pairs, metric="logprob")
    with torch.no_grad():
        logprobs = model(pairs.clean).log_softmax(-1)
    rows = torch.arange(pairs.clean.shape[0])
    assert evaluator.m_clean == pytest.approx(
        logprobs[rows, pairs.position, pairs.clean_answer].mean().item(), abs=1e-4
    )
    assert evaluator.faithfulness(torch.zeros(len(graph), dtype=torch.bool)) == pytest.approx(0.0, abs=1e-4)
    scores = edge_scores(model, pairs, "eap", metric="logprob", graph=graph)
    assert torch.isfinite(scores).all() and scores.abs().max() > 0


def test_bad_arguments_are_one_clear_error():
    model = tiny("mha")
    pairs = random_pairs(model)
    with pytest.raises(ValueError, match="method must be one of"):
        edge_scores(model, pairs, "acdc")
    with pytest.raises(ValueError, match="metric must be"):
        CircuitEvaluator(model, build_graph(model), pairs, metric="prob")
    evaluator = CircuitEvaluator(model, build_graph(model), pairs)
    with pytest.raises(ValueError, match="bool mask of"):
        evaluator(torch.ones(3, dtype=torch.bool))
    same = PairTokens(pairs.clean, pairs.clean, pairs.clean_answer, pairs.corrupt_answer, pairs.position)
    with pytest.raises(ValueError, match="nothing to restore"):
        CircuitEvaluator(model, build_graph(model), same)


def test_greedy_circuit_as_networkx_reaches_the_logits():
    nx = pytest.importorskip("networkx")
    model = tiny("parallel")
    graph = build_graph(model)
    scores = torch.randn(len(graph), generator=torch.Generator().manual_seed(3))
    circuit = greedy_circuit(graph, scores, 30)
    as_nx = graph.to_networkx(circuit, scores)
    real = [(u, v, d) for u, v, d in as_nx.edges(data=True) if d["kind"] != "internal"]
    assert len(real) == 30
    assert all(nx.has_path(as_nx, u, "logits") for u, _, _ in real)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_half_precision_model_gives_the_float32_circuit(shape, dtype):
    reference = tiny(shape)
    model = tiny(shape).to(dtype)  # as a TransformerLens user halves a model: cfg.dtype follows
    pairs, graph = random_pairs(reference), build_graph(reference)
    evaluator = CircuitEvaluator(model, graph, pairs)
    assert evaluator.m_clean == pytest.approx(logit_diff(model, pairs), abs=0.03)
    assert evaluator.faithfulness(torch.ones(len(graph), dtype=torch.bool)) == pytest.approx(1.0)
    assert evaluator.faithfulness(torch.zeros(len(graph), dtype=torch.bool)) == pytest.approx(0.0, abs=0.1)
    scores, exact = edge_scores(model, pairs, "eap", graph=graph), edge_scores(reference, pairs, "eap", graph=graph)
    assert scores.dtype == torch.float32 and bool(torch.isfinite(scores).all())
    ranks = lambda x: x.argsort().argsort().float()  # noqa: E731
    assert torch.corrcoef(torch.stack([ranks(scores), ranks(exact)]))[0, 1] > 0.95  # Spearman
