"""nnsight (optional extra `nnsight`) on HookedDCFormer: every hook point's output read and set through
`NNsight(model)`, the compose branches included, equal to run_with_cache / run_with_hooks."""

import pytest
import torch

from dcinterp import HookedDCFormer

nnsight = pytest.importorskip("nnsight", reason="nnsight is an optional extra: pip install 'dcinterp[nnsight]'")

PROMPT = "Michelle has a burger . Michelle owns a kind of"
BRANCH = "blocks.1.attn.post_compose.hook_o_kp"


@pytest.fixture(scope="module")
def wrapped():
    model = HookedDCFormer.from_pretrained("dcpythia-synth")
    return model, nnsight.NNsight(model), model.to_tokens(PROMPT)


def envoy(nn_model, name: str):
    for part in name.split("."):
        nn_model = nn_model[int(part)] if part.isdigit() else getattr(nn_model, part)
    return nn_model


def test_nnsight_reads_every_hook_point(wrapped):
    model, nn_model, tokens = wrapped
    logits, cache = model.run_with_cache(tokens)
    names = list(cache.keys())
    assert (
        BRANCH in names and "blocks.2.attn.pre_compose.hook_kw1" in names and "blocks.0.attn.hook_attn_scores" in names
    )
    saved = {}
    with nn_model.trace(tokens):
        for name in sorted(names, key=names.index):  # in the order the forward runs them
            saved[name] = envoy(nn_model, name).output.save()
        out = nn_model.output.save()
    torch.testing.assert_close(out, logits, rtol=0, atol=1e-5)
    for name in names:
        torch.testing.assert_close(saved[name], cache[name], rtol=0, atol=1e-5, msg=name)


def test_nnsight_sets_a_branch_output_as_run_with_hooks(wrapped):
    model, nn_model, tokens = wrapped
    # A trace wraps every module, so every compose stage runs per branch in it; the same with hooks on every branch
    # (a fused stage differs from a per-branch one by float32 rounding: 1e-5 on these logits).
    branches = [name for name in model.hook_dict if ".hook_o_" in name and name != BRANCH]
    hooks = [(name, lambda x, hook: x) for name in branches] + [(BRANCH, lambda x, hook: torch.zeros_like(x))]
    expected = model.run_with_hooks(tokens, fwd_hooks=hooks)
    with nn_model.trace(tokens):
        branch = envoy(nn_model, BRANCH)
        branch.output = torch.zeros_like(branch.output)
        out = nn_model.output.save()
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    assert (out - model(tokens)).abs().max() > 1e-3  # the branch matters
    # outside a trace the wrapped model computes the compose fused again, as with no hook
    assert not model.blocks[1].attn.post_compose.branches_read()
    torch.testing.assert_close(model(tokens), model.run_with_hooks(tokens), rtol=0, atol=0)


@pytest.mark.parametrize(
    "name",
    [
        "blocks.0.attn.hook_attn_scores",
        "blocks.1.attn.pre_compose.hook_qw1",
        "blocks.2.attn.pre_compose.hook_o_qg",
        "blocks.1.attn.hook_composed_pattern",
        "blocks.2.mlp.hook_post",
    ],
)
def test_nnsight_sets_other_hook_points_as_run_with_hooks(wrapped, name):
    model, nn_model, tokens = wrapped
    expected = model.run_with_hooks(tokens, fwd_hooks=[(name, lambda x, hook: x * 0.5)])
    with nn_model.trace(tokens):
        point = envoy(nn_model, name)
        point.output = point.output * 0.5
        out = nn_model.output.save()
    # inside a trace every compose branch runs materialised; run_with_hooks fuses the ones it does not hook: the
    # summation order differs, so logits of size ~10 agree to float32 rounding
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    assert (out - model(tokens)).abs().max() > 1e-3
