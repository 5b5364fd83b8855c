"""Half precision: the gradient-based analyses and the patching tables are finite in float16 and bfloat16 on the
embedded model and agree with float32 within the tolerances stated in docs/conventions.md; where a number
cannot be finite, one line names the hook where it appeared.

This CPU runs half-precision matmuls hundreds of times slower than float32: the batches are small."""

import warnings

import pytest
import torch

from dcinterp import HookedDCFormer
from dcinterp.attribution import head_ablation, head_attribution
from dcinterp.checks import NonFiniteError
from dcinterp.patching import activation_patching, attribution_patching, branch_ablation
from dcinterp.synth import contrast_pairs, tokenize_pairs

# Largest |effect - effect in float32| over the table (effects are shares of the clean-minus-corrupt difference),
# and for IG the largest |score difference| over the largest |score| (docs/conventions.md, "Half precision").
PATCHING_TOL = {torch.float16: 0.01, torch.bfloat16: 0.05}
IG_TOL = {torch.float16: 0.01, torch.bfloat16: 0.03}


def load(dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "float16 on the CPU is slow"
        return HookedDCFormer.from_pretrained("dcpythia-synth", dtype=dtype)


@pytest.fixture(scope="module")
def reference():
    return load(torch.float32)


@pytest.fixture(scope="module")
def pairs(reference):
    return tokenize_pairs(contrast_pairs(2, n=2, seed=0, tokenizer=reference.tokenizer), reference.tokenizer)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_patching_tables_are_finite_and_close_to_float32(reference, pairs, dtype):
    model = load(dtype)
    for table in (
        lambda m: attribution_patching(m, pairs),
        lambda m: attribution_patching(m, pairs, softmax="exact"),
        lambda m: activation_patching(m, pairs, names=["o_qp", "o_kp", "kw2", "qg"]),
    ):
        low, full = table(model), table(reference)
        assert low.effect.notna().all() and torch.isfinite(torch.tensor(low.effect.values)).all()
        assert (low.effect - full.effect).abs().max() < PATCHING_TOL[dtype]
        assert full.effect.abs().max() > 0.1  # the table is not all zeros, so the comparison means something
    low = branch_ablation(model, pairs.clean, pairs.clean_answer, position=pairs.position)
    full = branch_ablation(reference, pairs.clean, pairs.clean_answer, position=pairs.position)
    assert ((low.effect - full.effect).abs() / full.effect.abs().max()).max() < PATCHING_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_integrated_gradients_are_finite_and_close_to_float32(reference, pairs, dtype):
    args = dict(tokens=pairs.clean[:1], target=pairs.clean_answer[:1], position=pairs.position[:1], n_steps=16)
    low, full = head_attribution(load(dtype), **args), head_attribution(reference, **args)
    assert torch.isfinite(low.per_prompt).all() and torch.isfinite(low.delta).all()
    error = (low.per_prompt - full.per_prompt).abs().max() / full.per_prompt.abs().max()
    assert error < IG_TOL[dtype]


def test_float16_gradients_through_the_dynamic_weight_rms_do_not_overflow(pairs):
    """The issue's case: the RMS over heads of w1 has a float16 backward past 65504 (40 of 60 sites were NaN)."""
    model = load(torch.float16)
    x = model.blocks[0].ln1(model.embed(pairs.clean)).detach().requires_grad_(True)
    w1 = model.blocks[0].attn.dynamic_weights(x)["pre"][0]
    (grad,) = torch.autograd.grad(w1.float().sum() * 1e3, x)
    assert torch.isfinite(grad).all()


def test_a_non_finite_number_is_refused_with_the_hook_where_it_appeared(pairs):
    model = load(torch.float16)
    with torch.no_grad():
        model.blocks[1].attn.W_V.mul_(0).add_(6e4)  # v = x W_V overflows float16
    with pytest.raises(NonFiniteError, match=r"first appears in the activation at blocks\.1\.attn\.hook_v;"):
        attribution_patching(model, pairs, layers=[0])
    with pytest.raises(NonFiniteError, match=r"head_attribution: .*blocks\.1\.attn\.hook_v; float16 overflows"):
        head_attribution(model, pairs.clean[:1], pairs.clean_answer[:1], position=pairs.position[:1], n_steps=2)


def test_default_ig_in_bfloat16_is_complete_within_the_stated_share(pairs):
    """docs/conventions.md: the default (Gauss-Legendre, 50 steps) on the embedded model in bfloat16 stays below
    COMPLETENESS_SHARE of the total effect, and so does not warn."""
    from dcinterp.attribution import COMPLETENESS_SHARE

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the completeness warning would fail the test
        result = head_attribution(load(torch.bfloat16), pairs.clean, pairs.clean_answer, position=pairs.position)
    total = (result.f_input - result.f_baseline).abs()
    assert total.min() > 1 and (result.delta.abs() < COMPLETENESS_SHARE * total).all()


def test_a_large_completeness_gap_warns_with_the_numbers(reference, pairs):
    with pytest.warns(UserWarning, match=r"head_attribution: the scores miss .* of the total effect .* n_steps=2"):
        result = head_attribution(reference, pairs.clean, pairs.clean_answer, position=pairs.position, n_steps=2)
    assert (result.delta.abs() > 0.05 * (result.f_input - result.f_baseline).abs()).any()


def test_head_ablation_refuses_a_non_finite_number_with_its_hook(pairs):
    model = load(torch.float16)
    with torch.no_grad():
        model.blocks[2].mlp.W_in.mul_(0).add_(6e4)  # the MLP's pre-activation overflows float16
    with pytest.raises(NonFiniteError, match=r"head_ablation: .* first appears in the activation at blocks\.2\.mlp\."):
        head_ablation(model, pairs.clean[:1], pairs.clean_answer[:1], heads=[(0, 0)], position=pairs.position[:1])
