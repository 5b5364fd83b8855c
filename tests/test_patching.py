"""Branch ablation, activation patching and attribution patching of the compose sites."""

import dataclasses

import pytest
import torch

from dcinterp import HookedDCFormer
from dcinterp.attribution import target_value
from dcinterp.config import DCFormerConfig
from dcinterp.patching import (
    BRANCH_OUTPUTS,
    DYNAMIC_WEIGHTS,
    SITE_NAMES,
    Component,
    LogitDiff,
    Site,
    ablation_hooks,
    activation_patching,
    attribution_deltas,
    attribution_patching,
    branch_ablation,
    branch_components,
    cache_sites,
    everywhere_components,
    layer_components,
    patch_hook,
    patching_deltas,
    site_gradients,
    sites,
    stage_components,
    zero_weight_hooks,
)
from dcinterp.synth import contrast_pairs, tokenize_pairs
from tests.numerics import assert_as_exact_as, float64_copy


@pytest.fixture(scope="module")
def model():
    model = HookedDCFormer.from_pretrained("dcpythia-synth")
    model.eval()
    model.requires_grad_(False)
    return model


@pytest.fixture(scope="module")
def pairs(model):
    return tokenize_pairs(contrast_pairs(2, n=4, seed=0, tokenizer=model.tokenizer), model.tokenizer)


def switched(model, **changes):
    """The same weights in a model built with another config (its compose switched off by the config)."""
    other = HookedDCFormer(dataclasses.replace(model.cfg, **changes), model.tokenizer, init=False)
    missing, unexpected = other.load_state_dict(model.state_dict(), strict=False)
    assert not missing and all("W_dyn" in key for key in unexpected)
    return other.eval()


# --------------------------------------------------------------------------------------------------
# Ablation
@pytest.mark.parametrize("branch", ["qp", "kp", "qg", "kg"])
def test_zeroing_a_branch_everywhere_is_the_model_built_without_it(model, pairs, branch):
    without = switched(model, compose_branches=tuple(b for b in ("qp", "kp", "qg", "kg") if b != branch))
    component = Component(
        tuple(site for site in sites(model, BRANCH_OUTPUTS) if site.branch == branch), "all", "all", branch
    )
    with torch.no_grad():
        hooked = model.run_with_hooks(pairs.clean, fwd_hooks=ablation_hooks(component))
        expected = without(pairs.clean)
    torch.testing.assert_close(hooked, expected, atol=1e-4, rtol=1e-4)
    assert (model(pairs.clean) - expected).abs().max() > 1e-2  # the branch matters, so the test can fail

    (row,) = branch_ablation(
        model, pairs.clean, pairs.clean_answer, [component], position=pairs.position, target_type="logprob"
    ).itertuples()
    expected_value = target_value(without, pairs.clean, pairs.clean_answer, pairs.position, "logprob").mean()
    assert row.ablated == pytest.approx(expected_value.item(), abs=1e-4)


def test_zeroing_a_stage_or_all_compose_is_the_model_built_without_it(model, pairs):
    pre, post, everything = everywhere_components(model)[-3:]
    assert (pre.stage, post.stage, everything.stage) == ("pre", "post", "all")
    with torch.no_grad():
        for component, changes in [
            (pre, {"compose_stages": ("post",)}),
            (post, {"compose_stages": ("pre",)}),
            (everything, {"use_dcmha": False}),
        ]:
            hooked = model.run_with_hooks(pairs.clean, fwd_hooks=ablation_hooks(component))
            torch.testing.assert_close(hooked, switched(model, **changes)(pairs.clean), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("branch", ["qp", "kp", "qg", "kg"])
def test_zeroing_a_branch_through_its_dynamic_weights_is_the_model_built_without_it_bit_for_bit(model, pairs, branch):
    without = switched(model, compose_branches=tuple(b for b in ("qp", "kp", "qg", "kg") if b != branch))
    component = Component(
        tuple(site for site in sites(model, BRANCH_OUTPUTS) if site.branch == branch), "all", "all", branch
    )
    with torch.no_grad():
        by_weights = model.run_with_hooks(pairs.clean, fwd_hooks=zero_weight_hooks(component))
        by_outputs = model.run_with_hooks(pairs.clean, fwd_hooks=ablation_hooks(component))
        assert torch.equal(by_weights, without(pairs.clean))  # every term the zero weights feed is an exact 0
    torch.testing.assert_close(by_weights, by_outputs, atol=1e-4, rtol=1e-5)  # the branch sum in another order


def test_zeroing_stages_layers_and_heads_through_the_weights(model, pairs):
    pre, post, everything = everywhere_components(model)[-3:]
    with torch.no_grad():
        for component, changes in [
            (pre, {"compose_stages": ("post",)}),
            (post, {"compose_stages": ("pre",)}),
            (everything, {"use_dcmha": False}),
        ]:
            # the plain-MHA twin on its einsum path (a hook on its pattern), whose arithmetic is DCMHA's with the
            # compose zeroed, bit for bit (its no-hook path, scaled_dot_product_attention, rounds otherwise)
            pattern = (
                [(lambda name: name.endswith("hook_pattern"), lambda x, hook: None)] if "use_dcmha" in changes else []
            )
            expected = switched(model, **changes).run_with_hooks(pairs.clean, fwd_hooks=pattern)
            assert torch.equal(model.run_with_hooks(pairs.clean, fwd_hooks=zero_weight_hooks(component)), expected)
        for component in layer_components(model):  # a whole stage off: A + 0 either way
            assert torch.equal(
                model.run_with_hooks(pairs.clean, fwd_hooks=zero_weight_hooks(component)),
                model.run_with_hooks(pairs.clean, fwd_hooks=ablation_hooks(component)),
            )
        for component in branch_components(model, per_head=True, layers=[1]):
            torch.testing.assert_close(
                model.run_with_hooks(pairs.clean, fwd_hooks=zero_weight_hooks(component)),
                model.run_with_hooks(pairs.clean, fwd_hooks=ablation_hooks(component)),
                atol=1e-4,
                rtol=1e-5,
            )
    with pytest.raises(ValueError, match="hook_qw1 is not a branch output"):
        zero_weight_hooks(Component((Site(0, "pre", "qw1"),), 0, "pre", "qp"))


@pytest.mark.parametrize("output, weight", [("o_qp", "qw2"), ("o_kp", "kw2"), ("o_qg", "qg"), ("o_kg", "kg")])
def test_zeroing_one_layers_branch_equals_zeroing_the_weight_that_scales_it(model, pairs, output, weight):
    layer, stage = 2, "post"
    by_output = Component((Site(layer, stage, output),), layer, stage, output[2:])
    by_weight = Component((Site(layer, stage, weight),), layer, stage, output[2:])
    with torch.no_grad():
        a = model.run_with_hooks(pairs.clean, fwd_hooks=ablation_hooks(by_output))
        b = model.run_with_hooks(pairs.clean, fwd_hooks=ablation_hooks(by_weight))
        exact = float64_copy(model).run_with_hooks(pairs.clean, fwd_hooks=ablation_hooks(by_output))
    # zeroed output: the materialised compose; zeroed weight: the blocked one (judged by float64, tests/numerics.py)
    assert_as_exact_as(b, a, exact, "logits")


def test_every_head_zeroed_is_the_whole_branch_zeroed(model, pairs):
    heads = [c for c in branch_components(model, per_head=True) if (c.layer, c.stage, c.branch) == (2, "post", "kp")]
    assert [c.head for c in heads] == list(range(model.cfg.n_heads))
    all_heads = Component(tuple(site for c in heads for site in c.sites), 2, "post", "kp")
    (whole,) = [c for c in branch_components(model) if (c.layer, c.stage, c.branch) == (2, "post", "kp")]
    with torch.no_grad():
        torch.testing.assert_close(
            model.run_with_hooks(pairs.clean, fwd_hooks=ablation_hooks(all_heads)),
            model.run_with_hooks(pairs.clean, fwd_hooks=ablation_hooks(whole)),
        )


def test_mean_ablation_over_one_prompt_changes_nothing_and_says_so(model, pairs):
    with pytest.warns(UserWarning, match="a mean over one prompt is, at each position, that prompt's own activation"):
        table = branch_ablation(
            model, pairs.clean[:1], pairs.clean_answer[:1], ablation="mean", position=pairs.position[:1]
        )
    assert len(table) == model.cfg.n_layers * 2 * 4
    assert table.effect.abs().max() < 1e-4
    zeroed = branch_ablation(model, pairs.clean[:1], pairs.clean_answer[:1], position=pairs.position[:1])
    assert zeroed.effect.abs().max() > 0.1


def test_ablation_tables_label_their_rows(model, pairs):
    assert [(c.layer, c.stage) for c in stage_components(model)] == [(l, s) for l in range(3) for s in ("pre", "post")]
    assert [c.layer for c in layer_components(model)] == [0, 1, 2]
    assert all(len(c.sites) == 8 for c in layer_components(model))
    labels = [(c.stage, c.branch) for c in everywhere_components(model)]
    assert labels[:8] == [(s, b) for s in ("pre", "post") for b in ("qp", "kp", "qg", "kg")]
    with pytest.raises(ValueError, match="ablation must be 'zero' or 'mean'"):
        branch_ablation(model, pairs.clean, pairs.clean_answer, ablation="noise")
    with pytest.raises(ValueError, match="reference_tokens: its prompts have at most 5 real tokens"):
        branch_ablation(model, pairs.clean, pairs.clean_answer, ablation="mean", reference_tokens=pairs.clean[:, :5])


# --------------------------------------------------------------------------------------------------
# A model whose compose carries the whole difference between two prompts
def compose_only_model():
    """Tokens 1 and 2 differ only along a direction `delta` that only the dynamic-weight projections read.

    delta has zero mean and both embeddings have the same norm, so after LayerNorm they differ only along delta;
    W_Q, W_K, W_V, the MLP's W_in and W_U are projected off it and W_O, W_out write nothing along it. What moves
    the difference from position 1 to the last token is the compose alone.
    """
    torch.manual_seed(0)
    cfg = DCFormerConfig(n_layers=2, d_model=16, n_heads=4, d_head=4, d_mlp=32, d_vocab=8, rotary_pct=0.5)
    model = HookedDCFormer(cfg)
    delta = torch.randn(cfg.d_model)
    delta = (delta - delta.mean()) / (delta - delta.mean()).norm()
    P = torch.eye(cfg.d_model) - torch.outer(delta, delta)
    with torch.no_grad():
        model.W_E.copy_(model.W_E @ P)
        model.W_E[2] = model.W_E[1] - 0.05 * delta
        model.W_E[1] += 0.05 * delta
        model.W_U.copy_(P @ model.W_U)
        for block in model.blocks:
            attn, mlp = block.attn, block.mlp
            for W in (attn.W_Q, attn.W_K, attn.W_V):
                W.copy_(torch.einsum("dc,hce->hde", P, W))
            attn.W_O.copy_(attn.W_O @ P)
            mlp.W_in.copy_(P @ mlp.W_in)
            mlp.W_out.copy_(mlp.W_out @ P)
            attn.W_dyn_out.normal_(0, 0.5)  # a compose far from the identity
            attn.W_dyn_gate.normal_(0, 0.5)
    return model.eval().requires_grad_(False)


def test_patching_every_branch_from_the_corrupted_run_reproduces_it_where_the_compose_carries_the_difference():
    model = compose_only_model()
    clean, corrupt = torch.tensor([[3, 1, 5, 7, 4, 6]]), torch.tensor([[3, 2, 5, 7, 4, 6]])
    with torch.no_grad():
        clean_logits, corrupt_logits = model(clean), model(corrupt)
        assert (clean_logits - corrupt_logits).abs().max() > 1e-2
        for names in (BRANCH_OUTPUTS, DYNAMIC_WEIGHTS):
            site_list = sites(model, names)
            cache = cache_sites(model, corrupt, [site.hook_name for site in site_list])
            patched = model.run_with_hooks(clean, fwd_hooks=[patch_hook(s, cache[s.hook_name]) for s in site_list])
            torch.testing.assert_close(patched, corrupt_logits, atol=1e-5, rtol=1e-4)
        # layer 0's scores and values are the same in both runs: only its compose sees the difference
        names = ["blocks.0.attn.hook_attn_scores", "blocks.0.attn.hook_v"]
        a, b = cache_sites(model, clean, names), cache_sites(model, corrupt, names)
        assert all(torch.allclose(a[n], b[n], atol=1e-6) for n in names)
        names = ["blocks.0.attn.post_compose.hook_o_kp"]
        assert not torch.allclose(
            cache_sites(model, clean, names)[names[0]], cache_sites(model, corrupt, names)[names[0]]
        )


# --------------------------------------------------------------------------------------------------
# Activation patching
def test_patching_a_clean_activation_into_the_clean_run_changes_nothing(model, pairs):
    metric = LogitDiff(pairs.clean_answer, pairs.corrupt_answer, pairs.position)
    site_list = sites(model, per_head=False)
    cache = cache_sites(model, pairs.clean, [site.hook_name for site in site_list])
    exact = patching_deltas(model, pairs.clean, cache, metric, site_list)
    assert exact.abs().max() < 1e-4
    assert attribution_deltas(model, pairs.clean, cache, metric, site_list).abs().max() == 0


def test_patching_tables_have_one_row_per_site_and_head(model, pairs):
    exact = activation_patching(model, pairs, per_head=True, names=["o_kp", "qw1"], layers=[2])
    estimate = attribution_patching(model, pairs, per_head=True, names=["o_kp", "qw1"], layers=[2])
    assert len(exact) == 2 * 2 * model.cfg.n_heads
    keys = ["layer", "stage", "site", "branch", "head"]
    assert exact[keys].equals(estimate[keys])
    assert list(exact.columns) == keys + ["effect", "delta"]


def test_the_normalised_metric_is_the_share_restored(model, pairs):
    """Denoising every site of every layer at once is the clean run's output here: effect 1 by construction."""
    metric = LogitDiff(pairs.clean_answer, pairs.corrupt_answer, pairs.position)
    with torch.no_grad():
        ld_clean, ld_corrupt = metric(model, pairs.clean).mean(), metric(model, pairs.corrupt).mean()
    noised = activation_patching(model, pairs, "noising", names=["o_qp"], layers=[1])
    denoised = activation_patching(model, pairs, "denoising", names=["o_qp"], layers=[1])
    site = Site(1, "pre", "o_qp")
    corrupt_cache = cache_sites(model, pairs.corrupt, [site.hook_name])
    with torch.no_grad():
        patched = metric(model, pairs.clean, [patch_hook(site, corrupt_cache[site.hook_name])]).mean()
    row = noised[noised.stage == "pre"].iloc[0]
    assert row.effect == pytest.approx(((patched - ld_clean) / (ld_clean - ld_corrupt)).item(), abs=1e-5)
    assert row.delta == pytest.approx((patched - ld_clean).item(), abs=1e-4)
    assert (denoised.effect >= -0.2).all() and (noised.effect <= 0.2).all()


@pytest.mark.parametrize("softmax", ["linear", "exact"])
def test_attribution_patching_equals_exact_patching_for_a_small_perturbation(model, pairs, softmax):
    metric = LogitDiff(pairs.clean_answer, pairs.corrupt_answer, pairs.position)
    site_list = sites(model, per_head=softmax == "linear", layers=[1, 2])  # per head once: it takes a while
    names = list(dict.fromkeys(site.hook_name for site in site_list))
    clean, corrupt = cache_sites(model, pairs.clean, names), cache_sites(model, pairs.corrupt, names)
    eps = 1e-3
    nudged = {name: clean[name] + eps * (corrupt[name] - clean[name]) for name in names}
    exact = patching_deltas(model, pairs.clean, nudged, metric, site_list)
    estimate = attribution_deltas(model, pairs.clean, nudged, metric, site_list, softmax)
    scale = estimate.abs().max()
    assert scale > 1e-3
    torch.testing.assert_close(exact, estimate, atol=0.02 * scale, rtol=0.05)
    # at the full corruption the estimate is only first order: it may differ a lot
    assert (
        patching_deltas(model, pairs.clean, corrupt, metric, site_list)
        - attribution_deltas(model, pairs.clean, corrupt, metric, site_list, softmax)
    ).abs().max() > 10 * eps * scale


def test_carrying_pre_compose_sites_through_the_softmax_comes_closer_where_the_softmax_saturates(model, pairs):
    """Layer 1's pre-compose o_qp moves the output far more than its gradient says (a saturated softmax)."""
    rows = dict(names=["o_qp", "qw2"], layers=[1])
    exact = activation_patching(model, pairs, **rows)
    linear = attribution_patching(model, pairs, **rows)
    through_softmax = attribution_patching(model, pairs, softmax="exact", **rows)
    pre = (exact["stage"] == "pre").to_numpy()
    post = ~pre
    assert exact.effect[pre].iloc[0] < -0.5 and abs(linear.effect[pre].iloc[0]) < 0.1
    assert (
        abs(through_softmax.effect[pre].iloc[0] - exact.effect[pre].iloc[0])
        < abs(linear.effect[pre].iloc[0] - exact.effect[pre].iloc[0]) - 0.1
    )
    assert through_softmax.effect[post].tolist() == linear.effect[post].tolist()  # post-compose: unchanged
    with pytest.raises(ValueError, match="softmax must be 'linear' or 'exact'"):
        attribution_patching(model, pairs, softmax="approximately")


@pytest.mark.parametrize(
    "hook_name",
    [
        "blocks.0.attn.post_compose.hook_kw1",
        "blocks.1.attn.pre_compose.hook_qw1",
        "blocks.1.attn.post_compose.hook_o_kp",
        "blocks.2.attn.post_compose.hook_kw2",
    ],
)
def test_the_metric_gradient_matches_finite_differences(model, pairs, hook_name):
    """With every site hooked at once, the gradient at an early site still counts its paths through later ones."""
    metric = LogitDiff(pairs.clean_answer, pairs.corrupt_answer, pairs.position)
    every_hook = list(dict.fromkeys(site.hook_name for site in sites(model)))
    _, gradients, activations = site_gradients(model, pairs.clean, metric, every_hook)
    torch.manual_seed(0)
    direction = torch.randn_like(activations[hook_name]) * activations[hook_name].std()
    h = 1e-2

    def value_at(shift):
        hook = (hook_name, lambda x, hook: activations[hook_name] + shift * direction)
        with torch.no_grad():
            return metric(model, pairs.clean, [hook]).mean()

    numeric = (value_at(h) - value_at(-h)) / (2 * h)
    analytic = (gradients[hook_name] * direction).sum()
    assert analytic.abs() > 0.1
    assert analytic.item() == pytest.approx(numeric.item(), rel=1e-2)


def test_patching_names_bad_arguments(model, pairs):
    with pytest.raises(ValueError, match="direction must be 'noising' or 'denoising'"):
        activation_patching(model, pairs, direction="sideways")
    with pytest.raises(ValueError, match="unknown site 'o_xx'"):
        attribution_patching(model, pairs, names=["o_xx"])
    with pytest.raises(ValueError, match="layers: 3 is not a layer"):
        activation_patching(model, pairs, layers=[3])
    same = dataclasses.replace(pairs, corrupt=pairs.clean, corrupt_answer=pairs.clean_answer)
    with pytest.raises(ValueError, match="same mean logit difference"):
        attribution_patching(model, same)
    mha = HookedDCFormer.from_pretrained("pythia-synth")
    with pytest.raises(ValueError, match="has no DCMHA"):
        activation_patching(mha, pairs)
    assert len(SITE_NAMES) == 10


def test_attribution_patching_takes_its_gradient_through_the_activations_not_the_weights(pairs):
    model = HookedDCFormer.from_pretrained("dcpythia-synth").eval()
    model.requires_grad_(True)  # even with trainable weights, nothing is written to .grad
    frozen = attribution_patching(model, pairs, names=["o_kp"], layers=[2])
    assert all(p.grad is None for p in model.parameters())
    model.requires_grad_(False)
    again = attribution_patching(model, pairs, names=["o_kp"], layers=[2])
    assert frozen.effect.tolist() == pytest.approx(again.effect.tolist(), abs=1e-6)
