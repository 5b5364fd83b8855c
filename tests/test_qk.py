"""QK attribution through the compose (dcinterp.qk, dcinterp.qk_weights): the terms add up to the model's composed
score on every shape and dtype, plain MHA reduces to Kamath et al.'s terms computed here by hand, removing a
component with the norms and weights frozen changes the score by exactly its terms, the contrastive form is the
difference of two keys' terms, and the dynamic weights' attributions are complete where the method is."""

import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from dcinterp import DCFormerConfig, HookedDCFormer
from dcinterp.processing import process_weights_
from dcinterp.qk import (
    REST,
    causal_checks,
    check_terms,
    component_names,
    layer_run,
    normed_components,
    qk_attribution,
    qk_contrast,
    residual_components,
)
from dcinterp.qk_weights import compose_change, weight_attribution

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SHAPES = {
    "parallel": dict(rotary_pct=0.5),  # DCPythia: LayerNorm, parallel block, QK-norm, partial rotary
    "sequential": dict(  # DCFormer++: RMSNorm, sequential block, SwiGLU with mgate, local/global windows
        parallel_residual=False,
        normalization_type="RMS",
        act_fn="swiglu",
        use_bias=False,
        mgate_dim=2,
        window_size=3,
        window_type="LG",
    ),
    "query_wise": dict(query_wise=True),  # only the query-side branches
    "post_only": dict(compose_stages=("post",)),  # no pre-compose: the composed score is the head's own
    "mha": dict(use_dcmha=False),  # Pythia
    "mha_no_qk_norm": dict(use_dcmha=False, use_qk_norm=False, rotary_pct=0.25),  # GPT-NeoX as released
}
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 4e-2}  # relative to the score's scale


def tiny(shape: str, dtype=torch.float32) -> HookedDCFormer:
    """3 layers, 3 heads, a compose strong enough that every branch matters, norms and biases off their init."""
    torch.manual_seed(0)
    cfg = DCFormerConfig(
        n_layers=3, d_model=16, n_heads=3, d_head=4, d_mlp=16, d_vocab=23, dyn_hidden_dim=6, **SHAPES[shape]
    )
    model = HookedDCFormer(cfg)
    model.init_weights(std=0.3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "W_dyn_out" in name:
                p.mul_(400.0)
            elif "W_dyn_gate" in name:
                p.mul_(20.0)
            elif name.endswith(".w"):
                p.add_(0.2 * torch.randn_like(p))
            elif name.split(".")[-1].startswith("b"):
                p.add_(0.1 * torch.randn_like(p))
    return model.eval().requires_grad_(False).to(dtype)


def prompt(model, n: int = 9, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, model.cfg.d_vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def composed(model, tokens, layer: int) -> torch.Tensor:
    name = f"blocks.{layer}.attn.hook_{'composed_scores' if model.cfg.use_dcmha else 'attn_scores'}"
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=[name])
    return cache[name][0].float()


@pytest.fixture(scope="module")
def models() -> dict[str, HookedDCFormer]:
    return {shape: tiny(shape) for shape in SHAPES}


def gpt_neox(tmp_path) -> HookedDCFormer:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPTNeoXConfig(
        vocab_size=31,
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=32,
        rotary_pct=0.25,
        use_parallel_residual=True,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = transformers.GPTNeoXForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "layernorm" in name:
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    return HookedDCFormer.from_pretrained(tmp_path)


# --------------------------------------------------------------------------------------------------
# The sum identity
@pytest.mark.parametrize("shape", list(SHAPES))
def test_terms_add_up_to_the_composed_score_at_every_key(models, shape):
    model = models[shape]
    tokens = prompt(model)
    for layer in (0, 2):
        result = qk_attribution(model, tokens, layer, 1, 8)
        expected = composed(model, tokens, layer)[1, 8, result.key_pos]
        torch.testing.assert_close(result.composed, expected, rtol=0, atol=0)
        scale = result.scale
        assert result.complete and (result.gap.abs() <= 1e-5 * scale).all(), result.gap
        assert set(result.terms.columns) == {
            "key_pos",
            "query_component",
            "key_component",
            "source_head",
            "branch",
            "value",
        }
        assert set(result.terms["query_component"]) <= set(component_names(model, layer))
        # every view adds up to the same score
        for k, s in enumerate(result.key_pos):
            for total in (
                result.pair_table(s).to_numpy().sum(),
                result.head_branch_table(s).to_numpy().sum(),
                result.component_table(s)["query"].sum(),
                result.component_table(s)["key"].sum(),
            ):
                assert abs(total - float(result.composed[k])) <= 1e-5 * scale
    if model.cfg.window_type:  # a local layer: only the window's keys
        assert qk_attribution(model, tokens, 0, 1, 8).key_pos == [6, 7, 8]


@pytest.mark.filterwarnings("ignore:fold_value_biases")  # b_V stays where post-compose rows do not sum to 1
@pytest.mark.parametrize("name", ["dcpythia-tiny", "dcformer-tiny", "processed", "gpt_neox"])
def test_terms_add_up_on_loaded_checkpoints(name, tmp_path):
    if name == "gpt_neox":
        model = gpt_neox(tmp_path)
    else:
        model = HookedDCFormer.from_pretrained(FIXTURES / ("dcpythia-tiny" if name == "processed" else name))
        if name == "processed":  # TransformerLens' processing: ln1 folded into W_Q, W_K and the compose FFN's biases
            process_weights_(model)
    tokens = prompt(model, 14, seed=2)
    layer = model.cfg.n_layers - 1
    result = qk_attribution(model, tokens, layer, 2, 13)
    assert result.relative_gap <= 1e-5, result.relative_gap
    assert len(result.components) == 1 + layer * (model.cfg.n_heads + 1) + 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", ["parallel", "sequential", "mha"])
def test_terms_add_up_in_half_precision(shape, dtype):
    model = tiny(shape, dtype)
    tokens = prompt(model)
    result = qk_attribution(model, tokens, 2, 1, 8)
    assert torch.isfinite(result.composed).all() and result.terms["value"].notna().all()
    assert result.relative_gap <= TOLERANCE[dtype], result.relative_gap
    contrast = qk_contrast(model, tokens, 2, 1, 8, 8, 6)
    assert contrast.relative_gap <= TOLERANCE[dtype]
    check = check_terms(model, result, "L1H0", "query", 0, 6)
    assert abs(check.frozen - check.estimate) <= TOLERANCE[dtype] * result.scale


def test_source_heads_own_scores_are_their_skip_terms(models):
    """Summed over components, source head n's terms are its pre-compose score S_n (hook_attn_scores)."""
    model = models["parallel"]
    tokens = prompt(model)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=["blocks.2.attn.hook_attn_scores"])
    scores = cache["blocks.2.attn.hook_attn_scores"][0]
    for n in range(3):
        result = qk_attribution(model, tokens, 2, n, 8, [3, 8])
        skip = result.terms[result.terms["branch"] == "skip"].groupby("key_pos")["value"].sum()
        torch.testing.assert_close(torch.tensor(skip.to_numpy()).float(), scores[n, 8, [3, 8]], atol=1e-5, rtol=1e-5)
        assert (result.terms.loc[result.terms["branch"].isin(["skip", "qg", "kg"]), "source_head"] == n).all()


def test_loadings_add_up_to_the_composed_pattern(models):
    for shape in ("parallel", "sequential", "mha"):
        model = models[shape]
        tokens = prompt(model)
        result = qk_attribution(model, tokens, 2, 1, 8)
        name = f"blocks.2.attn.hook_{'composed_pattern' if model.cfg.use_dcmha else 'pattern'}"
        with torch.no_grad():
            _, cache = model.run_with_cache(tokens, names_filter=[name])
        sums = result.loadings.groupby("key_pos")["value"].sum().reindex(result.key_pos)
        torch.testing.assert_close(
            torch.tensor(sums.to_numpy()).float(), cache[name][0, 1, 8, result.key_pos], atol=1e-6, rtol=1e-5
        )
        if not model.cfg.use_dcmha:
            assert set(result.loadings["branch"]) == {"skip"} and (result.loadings["source_head"] == 1).all()


# --------------------------------------------------------------------------------------------------
# Plain MHA: Kamath et al.'s QK attribution by hand
def rotation(position: int, d_head: int, rotary_dim: int, base: float) -> torch.Tensor:
    """The rotary map at a position as a [d_head, d_head] matrix (dim j rotates with j + rotary_dim / 2)."""
    R = torch.eye(d_head, dtype=torch.float64)
    half = rotary_dim // 2
    for j in range(half):
        angle = position * base ** (-2 * j / rotary_dim)
        c, s = math.cos(angle), math.sin(angle)
        R[j, j], R[j, j + half], R[j + half, j], R[j + half, j + half] = c, -s, s, c
    return R  # x_rotated = R @ x


@pytest.mark.parametrize("shape", ["mha", "mha_no_qk_norm"])
def test_mha_terms_equal_a_hand_computation(models, shape):
    model = models[shape]
    cfg = model.cfg
    tokens = prompt(model)
    layer, head, t, s = 2, 1, 8, 5
    result = qk_attribution(model, tokens, layer, head, t, s)
    assert set(result.terms["branch"]) == {"skip"} and (result.terms["source_head"] == head).all()
    model.set_use_attn_result(True)
    try:
        with torch.no_grad():
            _, cache = model.run_with_cache(tokens)
    finally:
        model.set_use_attn_result(False)
    parts = [cache["hook_embed"][0]]
    for earlier in range(layer):
        parts += list(cache[f"blocks.{earlier}.attn.hook_result"][0].unbind(1)) + [
            cache[f"blocks.{earlier}.hook_mlp_out"][0]
        ]
    parts.append(sum(model.blocks[e].attn.b_O for e in range(layer)).expand_as(parts[0]))
    parts = torch.stack(parts).double()  # [component, pos, d_model]
    attn, ln = model.blocks[layer].attn, model.blocks[layer].ln1
    scale = cache[f"blocks.{layer}.ln1.hook_scale"][0].double()  # [pos, 1]

    def side(p: int, W, b, norm) -> torch.Tensor:  # [component, d_head]
        x = (parts[:, p] - parts[:, p].mean(-1, keepdim=True)) / scale[p] * ln.w.double()
        x[-1] += ln.b.double()
        v = x @ W[head].double()
        v[-1] += b[head].double()
        if norm is not None:
            linear = v.sum(0)
            v = v / torch.sqrt(linear.pow(2).mean() + norm.eps) * norm.w.double()
        return v @ rotation(p, cfg.d_head, cfg.rotary_dim, cfg.rotary_base).T

    q = side(t, attn.W_Q, attn.b_Q, attn.q_norm if cfg.use_qk_norm else None)
    k = side(s, attn.W_K, attn.b_K, attn.k_norm if cfg.use_qk_norm else None)
    by_hand = q @ k.T / math.sqrt(cfg.d_head)  # [query component, key component]
    table = result.pair_table(s).to_numpy()
    torch.testing.assert_close(torch.tensor(table), by_hand, atol=1e-5, rtol=1e-4)
    frame = result.terms.pivot(index="query_component", columns="key_component", values="value")
    names = result.components
    torch.testing.assert_close(torch.tensor(frame.loc[names, names].to_numpy()), by_hand, atol=1e-5, rtol=1e-4)
    assert abs(by_hand.sum().item() - cache[f"blocks.{layer}.attn.hook_attn_scores"][0, head, t, s].item()) < 1e-5


def test_gpt_neox_checkpoint_reduces_to_mha_terms(tmp_path):
    model = gpt_neox(tmp_path)
    tokens = prompt(model, 10)
    result = qk_attribution(model, tokens, 2, 3, 9, [0, 4, 9])
    assert not model.cfg.use_dcmha and result.branches == ["skip"]
    assert result.relative_gap <= 1e-5 and (result.terms["source_head"] == 3).all()


# --------------------------------------------------------------------------------------------------
# Top-k, contrast, causal checks
def test_top_terms_keep_the_largest_and_the_rest_sums_the_others(models):
    model = models["parallel"]
    tokens = prompt(model)
    full = qk_attribution(model, tokens, 2, 1, 8, [2, 8])
    top = qk_attribution(model, tokens, 2, 1, 8, [2, 8], max_terms=40)
    assert full.complete and not top.complete and len(top.terms) <= 40
    rest = top.terms[top.terms["branch"] == REST]
    assert list(rest["key_pos"]) == [2, 8] and rest["source_head"].isna().all()
    assert (top.gap.abs() <= 1e-5 * top.scale).all()
    kept = top.terms[top.terms["branch"] != REST]
    largest = full.terms["value"].abs().nlargest(len(kept))
    assert sorted(kept["value"].abs().round(6)) == sorted(largest.round(6))
    torch.testing.assert_close(top.pairs, full.pairs)  # the tables stay exact


@pytest.mark.parametrize("shape", ["parallel", "sequential", "mha"])
def test_contrast_is_the_difference_of_two_keys_terms(models, shape):
    model = models[shape]
    tokens = prompt(model)
    s, other = 8, 7
    contrast = qk_contrast(model, tokens, 2, 1, 8, s, other)
    scores = composed(model, tokens, 2)[1, 8]
    assert abs(contrast.difference - float(scores[s] - scores[other])) < 1e-6
    assert abs(contrast.gap) <= 1e-5 * contrast.scale
    both = qk_attribution(model, tokens, 2, 1, 8, [s, other])
    keys = ["query_component", "key_component", "source_head", "branch"]
    at = {pos: both.terms[both.terms["key_pos"] == pos].set_index(keys)["value"] for pos in (s, other)}
    expected = (at[s] - at[other]).sort_index()
    got = contrast.terms.set_index(keys)["value"].sort_index()
    torch.testing.assert_close(torch.tensor(got.to_numpy()), torch.tensor(expected.to_numpy()), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(contrast.pairs, both.pairs[0] - both.pairs[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", ["parallel", "sequential", "query_wise", "mha"])
def test_removing_a_component_frozen_changes_the_score_by_its_terms(models, shape):
    model = models[shape]
    tokens = prompt(model)
    result = qk_attribution(model, tokens, 2, 1, 8, 6)
    for component, side, source_head in (
        ("L1H0", "query", None),
        ("embed", "key", None),
        ("MLP0", "query", 1),
        ("L0H1", "key", 0 if model.cfg.use_dcmha else 1),
        ("L0H2", "query", 2),
    ):
        check = check_terms(model, result, component, side, source_head)
        assert abs(check.frozen - check.estimate) <= 1e-5 * result.scale, check
        if not model.cfg.use_dcmha and source_head not in (None, 1):  # MHA: another head's input is not read
            assert check.estimate == 0 and abs(check.frozen) < 1e-6
    checks = causal_checks(model, result, k=2)
    assert len(checks) == (6 if model.cfg.use_dcmha else 4)  # MHA: no per-head check (only the head's own counts)
    assert ((checks["frozen"] - checks["estimate"]).abs() <= 1e-5 * result.scale).all()
    assert checks["norms"].notna().all()  # measured without freezing: a number, usually not the estimate
    assert (checks["norms"] - checks["estimate"]).abs().max() > 1e-4


def test_unfrozen_checks_move_the_weights_only_when_asked(models):
    model = models["parallel"]
    tokens = prompt(model)
    result = qk_attribution(model, tokens, 2, 1, 8, 6)
    check = check_terms(model, result, "L1H0", "query")
    assert check.weights is not None and abs(check.weights - check.norms) > 1e-4
    assert check_terms(models["mha"], qk_attribution(models["mha"], tokens, 2, 1, 8, 6), "L1H0").weights is None


# --------------------------------------------------------------------------------------------------
# Arguments
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(key_pos=[]), "key_pos is empty"),
        (dict(key_pos=9), "key_pos=9 is out of range"),
        (dict(query_pos=-10), "query_pos=-10 is out of range"),
        (dict(query_pos=4, key_pos=6), "key_pos=6 (position 6) is not visible from query_pos 4: it comes after"),
        (dict(layer=0, key_pos=2), "outside layer 0's local window of 3 keys"),
        (dict(layer=3), "layer=3 is out of range"),
        (dict(head=3), "head=3 is out of range"),
        (dict(max_terms=3), "max_terms must be an integer above the number of keys (3"),
        (dict(key_pos="burger"), "is a word, but the model has no tokenizer"),
        (dict(key_pos=1.5), "key_pos must be integer positions"),
        (dict(tokens=torch.zeros(1, 0, dtype=torch.long)), "tokens is empty"),
    ],
)
def test_bad_arguments_are_one_clear_line(models, kwargs, message):
    model = models["sequential"]
    args = dict(tokens=prompt(model), layer=2, head=1, query_pos=8, key_pos=None) | kwargs
    with pytest.raises((ValueError, TypeError)) as error:
        qk_attribution(model, **args)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_bad_contrast_and_check_arguments(models):
    model = models["parallel"]
    tokens = prompt(model)
    with pytest.raises(ValueError, match="a contrast needs two different keys"):
        qk_contrast(model, tokens, 2, 1, 8, 5, -4)
    with pytest.raises(ValueError, match="other_key_pos must be one position"):
        qk_contrast(model, tokens, 2, 1, 8, 5, [4, 5])
    result = qk_attribution(model, tokens, 2, 1, 8, [4, 5])
    with pytest.raises(ValueError, match="key_pos: this attribution has 2 keys"):
        check_terms(model, result, "embed")
    with pytest.raises(ValueError, match="component='L2H0' is not one of the layer's components"):
        check_terms(model, result, "L2H0", key_pos=4)
    with pytest.raises(ValueError, match="side must be 'query' or 'key'"):
        check_terms(model, result, "embed", "value", key_pos=4)
    with pytest.raises(ValueError, match="component='bias' holds ln1's bias"):
        check_terms(model, result, "bias", key_pos=4)


# --------------------------------------------------------------------------------------------------
# The dynamic weights' own inputs
@pytest.mark.parametrize("shape", ["parallel", "sequential"])
@pytest.mark.parametrize("stage", ["pre", "post"])
def test_weight_attribution_is_complete_from_zero(models, shape, stage):
    model = models[shape]
    tokens = prompt(model)
    result = weight_attribution(model, tokens, 2, 1, 8, 7, stage=stage, n_steps=128)
    assert result.baseline_value == 0.0  # no FFN bias: every dynamic weight is 0 at the zero input
    assert abs(result.delta) <= 1e-4 * max(1.0, abs(result.target)), result
    assert all(gap <= 1e-4 for gap in result.weight_gaps.values()), result.weight_gaps
    # the target is the composed value less the skip connection, with the stage input frozen
    hook = "composed_scores" if stage == "pre" else "composed_pattern"
    before = "attn_scores" if stage == "pre" else "pattern"
    names = [f"blocks.2.attn.hook_{hook}", f"blocks.2.attn.hook_{before}"]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=names)
    expected = cache[names[0]][0, 1, 8, 7] - cache[names[1]][0, 1, 8, 7]
    assert abs(result.target - float(expected)) < 1e-5
    assert result.weights["qw1"].shape == (len(result.components), 2, 3) and result.weights["kg"].shape[1:] == (3,)


def test_linear_weight_attribution_is_the_derivative_along_each_component(models):
    """'linear' gives J(x) x_i: removing a small share h of component i changes the weights by h J(x) x_i."""
    model = models["parallel"]
    tokens = prompt(model)
    result = weight_attribution(model, tokens, 2, 1, 8, 7, method="linear")
    c = result.components.index("L1H1")
    h = 1e-3
    run = layer_run(model, tokens, 2, 8, [8])
    at = torch.tensor([8])
    x = normed_components(model, run, 2, residual_components(model, run, 2, at), at)[0]  # what the FFN reads
    attn = model.blocks[2].attn
    with torch.no_grad():
        base = attn.dynamic_weights(x.sum(0)[None, None])["pre"][4][0, 0]  # qg at the query
        moved = attn.dynamic_weights((x.sum(0) - h * x[c])[None, None])["pre"][4][0, 0]
    torch.testing.assert_close((base - moved) / h, result.weights["qg"][c], atol=2e-3, rtol=1e-2)


@pytest.mark.parametrize("stage", ["pre", "post"])
def test_compose_change_splits_exactly_into_scores_and_weights(models, stage):
    model = models["parallel"]
    tokens = prompt(model)
    other = tokens.clone()
    other[0, [3, 6]] = (other[0, [3, 6]] + 5) % model.cfg.d_vocab
    change = compose_change(model, tokens, other, 2, 1, 8, 7, stage=stage)
    hook = "composed_scores" if stage == "pre" else "composed_pattern"
    values = [composed_value(model, toks, hook) for toks in (tokens, other)]
    assert abs(change.composed - values[0]) < 1e-6 and abs(change.other - values[1]) < 1e-6
    assert abs(change.scores_part + change.weights_part - change.change) < 1e-5
    assert abs(change.by_branch[["scores", "weights"]].to_numpy().sum() - change.change) < 1e-5
    assert abs(change.delta) <= 1e-4 * max(1.0, abs(change.weights_part))
    assert abs(change.weights_part) > 1e-3 and abs(change.scores_part) > 1e-3  # both parts matter here
    if stage == "pre":
        assert abs(change.scores_by_pair.to_numpy().sum() - change.scores_part) < 1e-5
    else:
        assert change.scores_by_pair is None


def composed_value(model, tokens, hook: str) -> float:
    name = f"blocks.2.attn.hook_{hook}"
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=[name])
    return float(cache[name][0, 1, 8, 7])


def test_weight_functions_refuse_what_has_no_weights(models):
    tokens = prompt(models["mha"])
    with pytest.raises(ValueError, match="plain multi-head attention"):
        weight_attribution(models["mha"], tokens, 2, 1, 8, 7)
    with pytest.raises(ValueError, match="stage: this model has no pre-compose"):
        compose_change(models["post_only"], tokens, tokens, 2, 1, 8, 7)
    with pytest.raises(ValueError, match="method must be 'ig' or 'linear'"):
        weight_attribution(models["parallel"], tokens, 2, 1, 8, 7, method="saliency")
    with pytest.raises(ValueError, match="other_key_pos=12 is out of range"):
        compose_change(models["parallel"], tokens, tokens, 2, 1, 8, 7, other_key_pos=12)
    with pytest.raises(ValueError, match="other_tokens is empty"):
        compose_change(models["parallel"], tokens, tokens[:, :0], 2, 1, 8, 7)


def test_frames_are_plain_pandas(models):
    result = qk_attribution(models["parallel"], prompt(models["parallel"]), 1, 0, 4, 2)
    assert isinstance(result.terms, pd.DataFrame) and str(result.terms["source_head"].dtype) == "Int64"
    assert result.pair_table(top=3).shape == (3, 3)
    assert list(result.head_branch_table().columns) == ["skip", "qp", "kp", "qg", "kg"]
    assert "relative gap" in repr(result)
