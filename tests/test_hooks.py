"""Hook points: names, shapes, interventions, and the fused vs materialised compose paths."""

import dataclasses
from pathlib import Path

import pytest
import torch
from transformer_lens import ActivationCache

from dcinterp import DCFormerConfig, HookedDCFormer
from tests.numerics import assert_as_exact_as, float64_copy

FIXTURES = Path(__file__).parent / "fixtures"
B, T = 2, 24


@pytest.fixture(scope="module")
def pythia():
    return HookedDCFormer.from_pretrained(FIXTURES / "dcpythia-tiny")


@pytest.fixture(scope="module")
def dcformer():
    return HookedDCFormer.from_pretrained(FIXTURES / "dcformer-tiny")


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(0))


def expected_shapes(cfg: DCFormerConfig) -> dict[str, tuple]:
    H, E, D, R, M = cfg.n_heads, cfg.d_head, cfg.d_model, cfg.dcmha_rank, cfg.d_mlp
    shapes = {"hook_embed": (B, T, D), "ln_final.hook_normalized": (B, T, D), "ln_final.hook_scale": (B, T, 1)}
    for l in range(cfg.n_layers):
        b = f"blocks.{l}."
        for name in (
            "hook_resid_pre",
            "hook_resid_post",
            "hook_attn_out",
            "hook_mlp_out",
            "ln1.hook_normalized",
            "ln2.hook_normalized",
        ):
            shapes[b + name] = (B, T, D)
        if not cfg.parallel_residual:
            shapes[b + "hook_resid_mid"] = (B, T, D)
        shapes[b + "mlp.hook_pre"] = shapes[b + "mlp.hook_post"] = (B, T, M)
        for name in ("hook_q", "hook_k", "hook_v", "hook_rot_q", "hook_rot_k", "hook_z"):
            shapes[b + "attn." + name] = (B, T, H, E)
        for name in ("hook_attn_scores", "hook_composed_scores", "hook_pattern", "hook_composed_pattern"):
            shapes[b + "attn." + name] = (B, H, T, T)
        for stage in ("pre_compose", "post_compose"):
            s = f"{b}attn.{stage}."
            for name in ("hook_qw1", "hook_qw2", "hook_kw1", "hook_kw2"):
                shapes[s + name] = (B, T, R, H)
            shapes[s + "hook_qg"] = shapes[s + "hook_kg"] = (B, T, H)
            for name in ("hook_o_qp", "hook_o_kp", "hook_o_qg", "hook_o_kg"):
                shapes[s + name] = (B, H, T, T)
    return shapes


@pytest.mark.parametrize("which", ["pythia", "dcformer"])
def test_every_hook_exists_with_its_shape(which, request, tokens):
    model = request.getfixturevalue(which)
    logits, cache = model.run_with_cache(tokens)
    assert isinstance(cache, ActivationCache)
    assert logits.shape == (B, T, model.cfg.d_vocab)
    for name, shape in expected_shapes(model.cfg).items():
        assert name in model.hook_dict, name
        assert tuple(cache[name].shape) == shape, name


def test_hook_result_is_opt_in_and_sums_to_attn_out(pythia, tokens):
    _, cache = pythia.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_result"))
    assert len(cache) == 0
    pythia.set_use_attn_result(True)
    try:
        _, cache = pythia.run_with_cache(tokens)
    finally:
        pythia.set_use_attn_result(False)
    result = cache["blocks.1.attn.hook_result"]
    assert result.shape == (B, T, 4, 32)
    torch.testing.assert_close(result.sum(2) + pythia.blocks[1].attn.b_O, cache["blocks.1.hook_attn_out"])


@pytest.mark.parametrize(
    "stage, before, after",
    [
        ("pre_compose", "hook_attn_scores", "hook_composed_scores"),
        ("post_compose", "hook_pattern", "hook_composed_pattern"),
    ],
)
def test_branch_outputs_plus_input_equal_the_composed_tensor(pythia, tokens, stage, before, after):
    _, cache = pythia.run_with_cache(tokens)
    for l in range(pythia.cfg.n_layers):
        attn = f"blocks.{l}.attn."
        total = cache[attn + before] + sum(cache[f"{attn}{stage}.hook_o_{b}"] for b in ("qp", "kp", "qg", "kg"))
        torch.testing.assert_close(total, cache[attn + after], rtol=1e-5, atol=1e-5)


def test_fused_and_materialised_paths_agree(dcformer, tokens):
    """The no-hook forward (blocked on a CPU) against the materialised path, judged by float64 (tests/numerics.py)."""
    branches = lambda n: "hook_o_" in n  # noqa: E731
    with torch.no_grad():
        fused = dcformer(tokens)
        hooked, cache = dcformer.run_with_cache(tokens, names_filter=branches)
        exact, _ = float64_copy(dcformer).run_with_cache(tokens, names_filter=branches)
    assert len(cache) == 4 * 2 * dcformer.cfg.n_layers
    assert_as_exact_as(fused, hooked, exact, "logits")


def test_no_branch_tensors_are_built_without_hooks(dcformer, tokens, monkeypatch):
    import dcinterp.dcmha.materialised as materialised

    def fail(*args, **kwargs):
        raise AssertionError("branch outputs materialised with no hook attached")

    monkeypatch.setattr(materialised, "branch_outputs", fail)
    with torch.no_grad():
        dcformer(tokens)
        dcformer.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_pattern"))


def zero(x, hook):
    return torch.zeros_like(x)


def same_weights(model: HookedDCFormer, **change) -> HookedDCFormer:
    other = HookedDCFormer(dataclasses.replace(model.cfg, **change), init=False)
    other.load_state_dict(model.state_dict(), strict=False)
    return other


@pytest.mark.parametrize("branch", ["qp", "kp", "qg", "kg"])
def test_zeroing_a_branch_by_hook_equals_a_model_built_without_it(pythia, tokens, branch):
    hooks = [
        (f"blocks.{l}.attn.{stage}_compose.hook_o_{branch}", zero)
        for l in range(pythia.cfg.n_layers)
        for stage in ("pre", "post")
    ]
    without = same_weights(pythia, compose_branches=tuple(b for b in ("qp", "kp", "qg", "kg") if b != branch))
    with torch.no_grad():
        ablated = pythia.run_with_hooks(tokens, fwd_hooks=hooks)
        expected = without(tokens)
        original = pythia(tokens)
    torch.testing.assert_close(ablated, expected, rtol=1e-5, atol=1e-5)
    assert (ablated - original).abs().max() > 1e-4


@pytest.mark.parametrize("stage", ["pre", "post"])
def test_zeroing_a_stage_by_hook_equals_a_model_built_without_it(pythia, tokens, stage):
    hooks = [
        (f"blocks.{l}.attn.{stage}_compose.hook_o_{branch}", zero)
        for l in range(pythia.cfg.n_layers)
        for branch in ("qp", "kp", "qg", "kg")
    ]
    without = same_weights(pythia, compose_stages=("post",) if stage == "pre" else ("pre",))
    with torch.no_grad():
        torch.testing.assert_close(
            pythia.run_with_hooks(tokens, fwd_hooks=hooks), without(tokens), rtol=1e-5, atol=1e-5
        )


def test_zeroing_a_branch_in_one_layer_changes_only_what_follows(pythia, tokens):
    hook = "blocks.2.attn.post_compose.hook_o_kp"
    _, clean = pythia.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_resid_post"))
    with pythia.hooks(fwd_hooks=[(hook, zero)]):
        _, ablated = pythia.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_resid_post"))
    torch.testing.assert_close(ablated["blocks.1.hook_resid_post"], clean["blocks.1.hook_resid_post"])
    assert (ablated["blocks.2.hook_resid_post"] - clean["blocks.2.hook_resid_post"]).abs().max() > 1e-4


def test_a_config_without_a_branch_or_stage_runs_and_differs(pythia, tokens):
    outputs = {}
    for name, change in {
        "full": {},
        "no_kp": {"compose_branches": ("qp", "qg", "kg")},
        "query_wise": {"query_wise": True},
        "post_only": {"compose_stages": ("post",)},
        "mha": {"use_dcmha": False},
    }.items():
        model = same_weights(pythia, **change)
        with torch.no_grad():
            outputs[name] = model(tokens)
    torch.testing.assert_close(outputs["full"], pythia(tokens).detach())
    for name in ("no_kp", "query_wise", "post_only", "mha"):
        assert (outputs[name] - outputs["full"]).abs().max() > 1e-4, name


def test_query_wise_model_has_no_key_side_branches(pythia, tokens):
    model = same_weights(pythia, query_wise=True)
    _, cache = model.run_with_cache(tokens)
    assert "blocks.0.attn.pre_compose.hook_o_qp" in cache.keys()
    assert "blocks.0.attn.pre_compose.hook_o_kp" not in cache.keys()
    assert "blocks.0.attn.pre_compose.hook_kw1" not in cache.keys()


def test_editing_kw1_changes_o_kp_accordingly(pythia, tokens):
    stage = "blocks.2.attn.post_compose."
    _, clean = pythia.run_with_cache(tokens, names_filter=lambda n: n.startswith(stage))

    def double(x, hook):
        return 2 * x

    with pythia.hooks(fwd_hooks=[(stage + "hook_kw1", double)]):
        _, edited = pythia.run_with_cache(tokens, names_filter=lambda n: n.startswith(stage))
    # o_kp is linear in kw1; the other branches of this stage are untouched (same input pattern).
    torch.testing.assert_close(edited[stage + "hook_o_kp"], 2 * clean[stage + "hook_o_kp"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(edited[stage + "hook_o_qp"], clean[stage + "hook_o_qp"])


def test_hooks_intervene_on_the_forward(pythia, tokens):
    with torch.no_grad():
        clean = pythia(tokens)
        patched = pythia.run_with_hooks(tokens, fwd_hooks=[("blocks.3.attn.hook_composed_pattern", zero)])
        no_attn = pythia.run_with_hooks(tokens, fwd_hooks=[("blocks.3.attn.hook_z", zero)])
    assert (clean - patched).abs().max() > 1e-3
    torch.testing.assert_close(patched, no_attn)


def test_stop_at_layer_and_names_filter(pythia, tokens):
    resid = pythia(tokens, stop_at_layer=2)
    _, cache = pythia.run_with_cache(tokens, names_filter="blocks.1.hook_resid_post")
    assert list(cache.keys()) == ["blocks.1.hook_resid_post"]
    torch.testing.assert_close(resid, cache["blocks.1.hook_resid_post"])


def test_activation_cache_decompositions(pythia, tokens):
    logits, cache = pythia.run_with_cache(tokens)
    # Residual stream components add up to the final residual.
    components = cache.decompose_resid()
    torch.testing.assert_close(components.sum(0), cache["blocks.3.hook_resid_post"], rtol=1e-5, atol=1e-5)
    # Head results (plus the output bias) add up to each layer's attention output.
    heads = cache.stack_head_results(layer=-1)
    assert heads.shape == (4 * 4, B, T, 32)
    per_layer = heads.reshape(4, 4, B, T, 32).sum(1)
    for l in range(4):
        torch.testing.assert_close(
            per_layer[l] + pythia.blocks[l].attn.b_O, cache[f"blocks.{l}.hook_attn_out"], rtol=1e-5, atol=1e-5
        )
    # Logit attribution of the residual components adds up to the logit (less the final norm's bias term).
    target = torch.roll(tokens, -1, dims=1)  # any token per position will do
    attrs = cache.logit_attrs(components, tokens=target)
    bias_term = (pythia.ln_final.b @ pythia.W_U)[target]
    torch.testing.assert_close(
        attrs.sum(0) + bias_term, logits.gather(-1, target[..., None])[..., 0], rtol=1e-4, atol=1e-4
    )


def test_weight_helpers_have_transformer_lens_shapes(pythia):
    L, H, D, E = 4, 4, 32, 8
    assert pythia.W_Q.shape == pythia.W_K.shape == pythia.W_V.shape == (L, H, D, E)
    assert pythia.W_O.shape == (L, H, E, D)
    assert pythia.W_E.shape == (97, D) and pythia.W_U.shape == (D, 97)
    assert pythia.QK.shape == (L, H, D, D) and pythia.OV.shape == (L, H, D, D)
    cfg = pythia.cfg
    assert (cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_head, cfg.d_vocab) == (L, H, D, E, 97)


def test_loaded_models_are_frozen_for_inference(pythia, tokens):
    assert not pythia.training and not any(p.requires_grad for p in pythia.parameters())
    assert not pythia(tokens).requires_grad  # a plain forward keeps no autograd graph


def test_loss_and_backward_after_unfreezing(pythia, tokens):
    pythia.train().requires_grad_(True)  # what fine-tuning a loaded model takes
    try:
        loss = pythia(tokens, return_type="loss")
        assert loss.ndim == 0 and loss.item() > 0
        loss.backward()
        grads = [p.grad for p in pythia.parameters()]
        assert all(g is not None and torch.isfinite(g).all() for g in grads)
    finally:
        pythia.zero_grad(set_to_none=True)
        pythia.eval().requires_grad_(False)
