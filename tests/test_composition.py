from pathlib import Path

import pytest
import torch

from dcinterp import DCFormerConfig, HookedDCFormer
from dcinterp.composition import attention_distributions, compose_breakdown, composition_map
from dcinterp.dcmha.materialised import branch_outputs

FIXTURE = Path(__file__).resolve().parents[1] / "tests/fixtures/dcpythia-tiny"
HOOKS = {"pre": ("hook_attn_scores", "hook_composed_scores"), "post": ("hook_pattern", "hook_composed_pattern")}


def tiny(**overrides) -> HookedDCFormer:
    torch.manual_seed(0)
    cfg = dict(n_layers=2, d_model=32, n_heads=4, d_head=8, d_mlp=64, d_vocab=50)
    model = HookedDCFormer(DCFormerConfig(**{**cfg, **overrides}))
    with torch.no_grad():  # larger dynamic weights than the training init, so every branch visibly matters
        for block in model.blocks if model.cfg.use_dcmha else []:
            block.attn.W_dyn_out.mul_(300)
            block.attn.W_dyn_gate.mul_(20)
    return model


@pytest.fixture(scope="module")
def models() -> dict[str, HookedDCFormer]:
    return {"tiny": tiny(), "fixture": HookedDCFormer.from_pretrained(FIXTURE), "query_wise": tiny(query_wise=True)}


@pytest.mark.parametrize("name", ["tiny", "fixture", "query_wise"])
@pytest.mark.parametrize("stage", ["pre", "post"])
def test_breakdown_sums_and_matches_the_model(models, name, stage):
    model = models[name]
    torch.manual_seed(3)
    tokens = torch.randint(0, 50, (2, 11))
    layer = model.cfg.n_layers - 1
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: f"blocks.{layer}.attn" in n)
    before_hook, after_hook = HOOKS[stage]
    for t, s in [(9, 4), (7, 7), (5, 0), (10, 3)]:  # last: a key in the past, where every branch is nonzero
        b = compose_breakdown(model, tokens, layer, t, s, stage, batch_index=1)
        parts = b.before + b.o_qp + b.o_qg + b.o_kp + b.o_kg
        assert torch.equal(parts, b.composed)  # exactly the sum of the five parts
        attn = f"blocks.{layer}.attn"
        torch.testing.assert_close(b.before, cache[f"{attn}.{before_hook}"][1, :, t, s])
        torch.testing.assert_close(b.composed, cache[f"{attn}.{after_hook}"][1, :, t, s], atol=1e-5, rtol=1e-5)
        for branch, value in b.branches.items():
            key = f"{attn}.{stage}_compose.hook_o_{branch}"
            expected = cache[key][1, :, t, s] if key in cache.cache_dict else torch.zeros(4)
            torch.testing.assert_close(value, expected, atol=1e-5, rtol=1e-5)
        assert b.w_q1.shape == b.w_k2.shape == (4, 2) and b.w_qg.shape == (4,)
        torch.testing.assert_close(
            b.w_k1, cache[f"{attn}.{stage}_compose.hook_kw1"][1, s].T if name != "query_wise" else torch.zeros(4, 2)
        )
    if name == "query_wise":
        assert torch.all(b.o_kp == 0) and torch.all(b.o_kg == 0)
    else:
        assert all(v.abs().max() > 1e-4 for v in b.branches.values())  # the test exercises every branch


@pytest.mark.parametrize("stage", ["pre", "post"])
def test_composition_map_reproduces_the_composed_vector(models, stage):
    model = models["tiny"]
    tokens = torch.randint(0, 50, (1, 9))
    b = compose_breakdown(model, tokens, 1, 8, 2, stage)
    W = composition_map(model, tokens, 1, 8, 2, stage)
    torch.testing.assert_close(b.before @ W, b.composed, atol=1e-6, rtol=1e-5)
    # Row n of W is what a unit attention on head n becomes: check it with the model's own branch formulas.
    eye = torch.eye(4)[:, :, None, None]  # [n, head, 1, 1]: basis vector n as batch row n
    weights = [w.T[None, None].expand(4, 1, 2, 4) for w in (b.w_q1, b.w_q2, b.w_k1, b.w_k2)]
    gates = [g[None, None].expand(4, 1, 4) for g in (b.w_qg, b.w_kg)]
    rows = eye + sum(branch_outputs(eye, *weights, *gates).values())
    torch.testing.assert_close(rows[:, :, 0, 0], W, atol=1e-6, rtol=1e-5)
    no_identity = composition_map(model, tokens, 1, 8, 2, stage, include_identity=False)
    torch.testing.assert_close(W - no_identity, torch.eye(4))


def test_only_the_requested_layer_runs(models, monkeypatch):
    model = models["fixture"]

    def forbidden(*args, **kwargs):
        raise AssertionError("a later layer ran")

    monkeypatch.setattr(model.blocks[2], "forward", forbidden)
    tokens = torch.randint(0, 97, (1, 8))
    compose_breakdown(model, tokens, 1, 7, 1, "post")
    attention_distributions(model, tokens, 1, 7)


def test_attention_distributions(models):
    model = models["fixture"]
    tokens = torch.randint(0, 97, (2, 10))
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: "blocks.3.attn" in n)
    d = attention_distributions(model, tokens, 3, 6, heads=[1, 3], batch_index=1)
    assert d.before.shape == d.after.shape == (2, 7) and d.w_k1.shape == (7, 4, 2)
    torch.testing.assert_close(d.before, cache["blocks.3.attn.hook_pattern"][1, [1, 3], 6, :7])
    torch.testing.assert_close(d.after, cache["blocks.3.attn.hook_composed_pattern"][1, [1, 3], 6, :7])
    torch.testing.assert_close(d.w_k1, cache["blocks.3.attn.post_compose.hook_kw1"][1, :7].transpose(1, 2))
    torch.testing.assert_close(d.before.sum(-1), torch.ones(2))

    mha = tiny(use_dcmha=False)
    plain = attention_distributions(mha, tokens % 50, 1, 5)
    assert plain.w_k1 is None and torch.equal(plain.before, plain.after) and plain.before.shape == (4, 6)


def test_errors_and_half_precision():
    with pytest.raises(ValueError, match="plain multi-head"):
        compose_breakdown(tiny(use_dcmha=False), torch.zeros(1, 4, dtype=torch.long), 0, 3, 1)
    post_only = tiny(compose_stages=("post",))
    with pytest.raises(ValueError, match="no pre-compose"):
        compose_breakdown(post_only, torch.zeros(1, 4, dtype=torch.long), 0, 3, 1, "pre")
    half = tiny().to(torch.bfloat16)
    tokens = torch.randint(0, 50, (1, 8))
    b = compose_breakdown(half, tokens, 1, 7, 2, "post")
    with torch.no_grad():
        _, cache = half.run_with_cache(tokens, names_filter="blocks.1.attn.hook_composed_pattern")
    assert b.composed.dtype == torch.float32
    torch.testing.assert_close(
        b.composed, cache["blocks.1.attn.hook_composed_pattern"][0, :, 7, 2].float(), atol=2e-2, rtol=2e-2
    )


@pytest.mark.parametrize("name", ["fixture", "query_wise"])
def test_composition_maps_along_keys_match_each_pair(models, name):
    from dcinterp.composition import composition_maps_along_keys

    model, tokens = models[name], torch.randint(0, 50, (1, 12), generator=torch.Generator().manual_seed(5))
    for stage in ("pre", "post"):
        maps = composition_maps_along_keys(model, tokens, 1, 9, stage)
        assert maps.shape == (10, 4, 4)
        for s in (0, 4, 9):
            expected = composition_map(model, tokens, 1, 9, s, stage)
            torch.testing.assert_close(maps[s], expected, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# Donor heads, argument checks, frames
def hand_breakdown():
    """3 heads, rank 1, only the key-wise projection: W = w_k1 @ w_k2.T (a ComposeBreakdown)."""
    from dcinterp.composition import ComposeBreakdown

    z3, z31 = torch.zeros(3), torch.zeros(3, 1)
    before = torch.tensor([0.5, 0.01, 0.3])  # head 1 barely attends to the key
    w_k1 = torch.tensor([[0.2], [-3.0], [0.1]])  # ... but weighs most in w_k1
    w_k2 = torch.tensor([[1.0], [2.0], [1.5]])
    o_kp = (before @ w_k1) @ w_k2.T
    return ComposeBreakdown(0, 5, 2, "post", before, z3, z3, o_kp, z3, before + o_kp, z31, z31, w_k1, w_k2, z3, z3)


def test_donors_by_contribution_and_by_w_k1_by_hand():
    from dcinterp.composition import donor_heads

    b = hand_breakdown()
    # contribution of head n to head 0: A[n] * w_k1[n] * w_k2[0] = [0.1, -0.03, 0.03]
    donors = donor_heads(b, head=0, k=2)
    torch.testing.assert_close(donors.contribution, torch.tensor([0.1, -0.03, 0.03]))
    assert donors.donors == [2]  # head 1 lowers head 0's attention: no donor

    # the w_k1 rule picks head 1 (|w_k1| = 3) although it has 0.01 attention and lowers head 0's attention
    assert donor_heads(b, head=0, k=1, rule="w_k1").donors == [1]
    # delivered by the rank component: (A @ w_k1) * w_k2[0] = (0.1 - 0.03 + 0.03) * 1
    torch.testing.assert_close(donors.delivered, torch.tensor([0.1]))
    frame = donors.to_frame()
    assert frame["head"].tolist() == [1, 2] and frame["donor"].tolist() == [False, True]
    assert "H2" in repr(donors)
    # contributions add up to the change of head 0's attention (no other branch here)
    torch.testing.assert_close(donors.contribution.sum(), b.composed[0] - b.before[0])
    with pytest.raises(ValueError, match="rule must be one of"):
        donor_heads(b, head=0, rule="largest")
    with pytest.raises(ValueError, match="head=3 is out of range"):
        donor_heads(b, head=3)


def test_breakdown_frame_sums(models):
    b = compose_breakdown(models["tiny"], torch.randint(0, 50, (1, 8)), 1, 7, 3)
    frame = b.to_frame()
    parts = frame[["before", "o_qp", "o_qg", "o_kp", "o_kg"]].sum(1)
    assert (parts - frame["composed"]).abs().max() < 1e-5 and "ComposeBreakdown(L1" in repr(b)


def test_positions_layers_and_heads_are_checked(models):
    model = models["tiny"]
    tokens = torch.randint(0, 50, (1, 8))
    with pytest.raises(ValueError, match=r"layer=2 is out of range: the model has layers 0..1"):
        compose_breakdown(model, tokens, 2, 7, 3)
    with pytest.raises(ValueError, match=r"query_pos=8 is out of range: the prompt has positions 0..7"):
        compose_breakdown(model, tokens, 1, 8, 3)
    with pytest.raises(ValueError, match="key_pos=6 comes after query_pos=4"):
        compose_breakdown(model, tokens, 1, 4, 6)
    with pytest.raises(ValueError, match="heads=4 is out of range"):
        attention_distributions(model, tokens, 1, 7, heads=[4])
    with pytest.raises(ValueError, match="batch_index=1 is out of range"):
        composition_map(model, tokens, 1, 7, 3, batch_index=1)
    assert compose_breakdown(model, tokens, -1, -1, 3).layer == 1


def test_positions_may_be_words():
    model = HookedDCFormer.from_pretrained("dcpythia-synth")
    tokens = model.to_tokens("Michelle has a burger. Helen has a burger. Michelle owns a kind of")
    by_word = compose_breakdown(model, tokens, 2, "of", "burger")
    assert (by_word.query_pos, by_word.key_pos) == (tokens.shape[1] - 1, 8)  # the last "burger"
    with pytest.raises(ValueError, match="key_pos='papaya' does not occur in the prompt"):
        compose_breakdown(model, tokens, 2, "of", "papaya")
