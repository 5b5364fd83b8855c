"""Weight processing (dcinterp.processing): processed = raw in log-probabilities on every model layout, attention
hooks untouched, DCMHA's exceptions, and one residual-stream story that adds up to the logits on both.

Models: both embedded ones, the DCPythia and DCFormer++ fixtures (official formats), a tiny random GPT-NeoX.
"""

import warnings
from pathlib import Path

import pytest
import torch
from test_transformer_lens import save_tiny_pythia

from dcinterp import HookedDCFormer, logit_offset
from dcinterp.attribution import head_attribution
from dcinterp.circuits import head_diversity, ov_logits
from dcinterp.composition import compose_breakdown

FIXTURES = Path(__file__).parent / "fixtures"
PROCESS = dict(fold_ln=True, center_writing_weights=True, center_unembed=True, fold_value_biases=True)
MODELS = ["dcpythia-synth", "pythia-synth", "dcpythia-tiny", "dcformer-tiny", "gpt-neox"]
PROMPTS = ["Michelle has a burger . Michelle owns a kind of", "Ruth has a cat . Ruth owns a kind of"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, object]:
    return {
        "dcpythia-synth": "dcpythia-synth",
        "pythia-synth": "pythia-synth",
        "dcpythia-tiny": FIXTURES / "dcpythia-tiny",
        "dcformer-tiny": FIXTURES / "dcformer-tiny",
        "gpt-neox": save_tiny_pythia(tmp_path_factory.mktemp("neox")),
    }


def load_pair(path, **processing):
    raw = HookedDCFormer.from_pretrained(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the skip lines are tested below
        processed = HookedDCFormer.from_pretrained(path, **(processing or PROCESS))
    return raw, processed


def some_tokens(model, batch=2, pos=12):
    torch.manual_seed(0)
    return torch.randint(0, model.cfg.d_vocab, (batch, pos))


@pytest.mark.parametrize("name", MODELS)
def test_processed_log_probs_equal_the_raw_ones(paths, name):
    raw, processed = load_pair(paths[name])
    tokens = some_tokens(raw)
    expected = raw(tokens).log_softmax(-1)
    torch.testing.assert_close(processed(tokens).log_softmax(-1), expected, rtol=0, atol=1e-4)
    for option in PROCESS:  # each step alone
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            one = HookedDCFormer.from_pretrained(paths[name], **{option: True})
        torch.testing.assert_close(one(tokens).log_softmax(-1), expected, rtol=0, atol=1e-4, msg=option)
    # center_unembed: logits with mean 0 over the vocabulary; no centring: logits themselves equal
    assert processed(tokens).mean(-1).abs().max() < 1e-4
    no_centring = HookedDCFormer.from_pretrained(paths[name], fold_ln=True)
    torch.testing.assert_close(no_centring(tokens), raw(tokens), rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", ["dcpythia-synth", "pythia-synth", "dcformer-tiny"])
def test_attention_hooks_are_unchanged_by_folding(paths, name):
    """q, k, v, the scores, every compose branch and dynamic weight, the patterns and z: the same numbers."""
    raw, processed = load_pair(paths[name], fold_ln=True, center_writing_weights=True, center_unembed=True)
    tokens = some_tokens(raw)

    def attention(hook):
        return ".attn." in hook and not hook.endswith(("_input", "hook_result"))

    _, raw_cache = raw.run_with_cache(tokens, names_filter=attention)
    _, cache = processed.run_with_cache(tokens, names_filter=attention)
    names = list(raw_cache.keys())
    if raw.cfg.use_dcmha:
        assert "blocks.1.attn.post_compose.hook_o_kp" in names and "blocks.0.attn.pre_compose.hook_kw1" in names
    assert len(names) >= 8 * raw.cfg.n_layers  # q, k, v, rot_q, rot_k, attn_scores, pattern, z (+ DCMHA's)
    for hook in names:
        torch.testing.assert_close(cache[hook], raw_cache[hook], rtol=1e-4, atol=1e-4, msg=hook)
    # what the norms see: the scales are unchanged too (centring the writers leaves a centred stream as it is)
    _, scales = processed.run_with_cache(tokens, names_filter=lambda hook: hook.endswith("hook_scale"))
    _, raw_scales = raw.run_with_cache(tokens, names_filter=lambda hook: hook.endswith("hook_scale"))
    for hook in raw_scales.keys():  # noqa: SIM118 (an ActivationCache)
        torch.testing.assert_close(scales[hook], raw_scales[hook], rtol=1e-4, atol=1e-5, msg=hook)


def test_dcmha_specific_folding(paths):
    raw = HookedDCFormer.from_pretrained("dcpythia-synth")
    with pytest.warns(UserWarning, match=r"fold_value_biases: left in b_V in layers \[0, 1, 2\]: after post-compose"):
        processed = HookedDCFormer.from_pretrained("dcpythia-synth", **PROCESS)
    # ln1's bias went into q, k, v and into the dynamic-weight FFN's new biases
    attn = processed.blocks[1].attn
    assert attn.b_dyn_in.shape == (4, raw.cfg.dyn_hidden_dim) and attn.b_dyn_gate.shape == (4, raw.cfg.n_heads)
    torch.testing.assert_close(
        attn.b_dyn_in, torch.einsum("d,dck->ck", raw.blocks[1].ln1.b, raw.blocks[1].attn.W_dyn_in)
    )
    assert torch.equal(
        attn.b_V, raw.blocks[1].attn.b_V + torch.einsum("d,hde->he", raw.blocks[1].ln1.b, raw.blocks[1].attn.W_V)
    )
    assert (processed.blocks[1].ln1.w == 1).all() and (processed.blocks[1].ln1.b == 0).all()
    # why b_V stays: the composed rows do not sum to 1
    _, cache = raw.run_with_cache(some_tokens(raw), names_filter="blocks.1.attn.hook_composed_pattern")
    sums = cache["blocks.1.attn.hook_composed_pattern"].sum(-1)
    assert sums.max() - sums.min() > 0.5
    # plain MHA: folded into b_O, b_V is 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mha = HookedDCFormer.from_pretrained("pythia-synth", **PROCESS)
    assert not mha.b_V.any() and mha.weight_processing == {k: True for k in PROCESS}
    # an RMSNorm model: no centring of the writing weights, one line
    with pytest.warns(UserWarning, match="center_writing_weights: skipped, the model's norms are RMSNorm"):
        rms = HookedDCFormer.from_pretrained(paths["dcformer-tiny"], center_writing_weights=True)
    assert rms.weight_processing["center_writing_weights"] is False
    with pytest.raises(ValueError, match="refactor_factored_attn_matrices: not possible with rotary"):
        HookedDCFormer.from_pretrained("pythia-synth", refactor_factored_attn_matrices=True)


def test_process_weights_in_place_equals_processing_at_load(paths):
    model = HookedDCFormer.from_pretrained("pythia-synth")
    pointers = {name: p.data_ptr() for name, p in model.named_parameters()}
    assert model.process_weights_() is model
    assert {name: p.data_ptr() for name, p in model.named_parameters() if name in pointers} == pointers  # no copies
    at_load = HookedDCFormer.from_pretrained("pythia-synth", **PROCESS)
    for (name, p), (_, q) in zip(model.named_parameters(), at_load.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    assert not any(p.requires_grad for p in model.parameters())
    assert HookedDCFormer.from_pretrained_no_processing("pythia-synth").weight_processing == {}


def test_a_processed_model_saves_and_loads(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = HookedDCFormer.from_pretrained("dcpythia-synth", **PROCESS)
    model.save_pretrained(tmp_path)
    again = HookedDCFormer.from_pretrained(tmp_path)
    tokens = some_tokens(model)
    torch.testing.assert_close(again(tokens), model(tokens), rtol=0, atol=0)
    assert again.unembed._parameters["b_U"] is not None and again.blocks[0].attn.b_dyn_in is not None
    assert again.weight_processing == model.weight_processing  # so Eq. 12 and Fig. 5 still refuse it
    with pytest.raises(ValueError, match="reads the released weights"):
        head_diversity(again)


@pytest.mark.parametrize("name", ["dcpythia-synth", "pythia-synth", "dcformer-tiny"])
@pytest.mark.parametrize("processed", [False, True], ids=["raw", "processed"])
def test_one_residual_story_adds_up_to_the_logits(paths, name, processed):
    raw, proc = load_pair(paths[name])
    model = proc if processed else raw
    tokens = some_tokens(model)
    logits, cache = model.run_with_cache(tokens)
    # tokens_to_residual_directions: W_U's columns, as TransformerLens
    target = torch.roll(tokens, -1, dims=1)
    assert torch.equal(model.tokens_to_residual_directions(target), model.W_U[:, target].movedim(0, -1))
    # a decomposition through apply_ln_to_stack, then W_U, plus the documented offset: the logits
    components = cache.decompose_resid(layer=-1)
    through_norm = cache.apply_ln_to_stack(components)
    torch.testing.assert_close(through_norm.sum(0) @ model.W_U + logit_offset(model), logits, rtol=0, atol=1e-4)
    attrs = cache.logit_attrs(components, tokens=target)
    torch.testing.assert_close(
        attrs.sum(0) + logit_offset(model)[target], logits.gather(-1, target[..., None])[..., 0], rtol=0, atol=1e-4
    )
    heads = cache.apply_ln_to_stack(cache.get_full_resid_decomposition(expand_neurons=False))
    torch.testing.assert_close(heads.sum(0), through_norm.sum(0), rtol=0, atol=1e-4)
    # the accumulated stream through the real final norm: W_U and b_U give the logits; it differs from the
    # decomposition's sum by the final norm's bias alone (0 once folded)
    accumulated = cache.accumulated_resid(apply_ln=True)
    torch.testing.assert_close(accumulated[-1] @ model.W_U + model.b_U, logits, rtol=0, atol=1e-4)
    bias = model.ln_final.b if model.ln_final.b is not None else 0
    torch.testing.assert_close(
        accumulated[-1] - through_norm.sum(0), bias + torch.zeros_like(accumulated[-1]), rtol=0, atol=1e-5
    )
    torch.testing.assert_close(
        accumulated[-1] @ model.tokens_to_residual_directions(0) + model.b_U[0], logits[..., 0], rtol=0, atol=1e-4
    )
    if hasattr(cache, "logit_lens"):  # TransformerLens 4
        torch.testing.assert_close(cache.logit_lens().values[-1], logits[:, -1], rtol=0, atol=1e-4)  # last position
    # neurons through the final norm, projected on a token's direction: the shortcut path equals the plain one
    direction = model.tokens_to_residual_directions(0)
    plain = cache.stack_neuron_results(-1, apply_ln=True) @ direction
    torch.testing.assert_close(
        cache.stack_neuron_results(-1, apply_ln=True, project_output_onto=direction), plain, rtol=0, atol=1e-5
    )
    if processed:  # the final norm is folded away: only its centring and scaling are left
        assert model.ln_final.w.eq(1).all() and (model.ln_final.b is None or not model.ln_final.b.any())


@pytest.mark.parametrize("name", ["dcpythia-synth", "pythia-synth"])
@pytest.mark.parametrize("processed", [False, True], ids=["raw", "processed"])
def test_transformer_lens_logit_difference_recipe(paths, name, processed):
    """Exploratory_Analysis_Demo's recipe: W_U's answer columns against apply_ln_to_stack(final resid)."""
    raw, proc = load_pair(paths[name], fold_ln=True, center_writing_weights=True, center_unembed=True)
    model = proc if processed else raw
    answers = torch.tensor([[model.to_single_token("food"), model.to_single_token("animal")]] * 2)
    answers[1] = answers[1].flip(0)  # as in the demo: every pair in both orders
    logits, cache = model.run_with_cache(model.to_tokens(PROMPTS))
    true = logits[:, -1].gather(-1, answers)
    true = true[:, 0] - true[:, 1]
    directions = model.unembed.W_U[:, answers].permute(1, 2, 0)
    scaled = cache.apply_ln_to_stack(cache["resid_post", -1][:, -1], layer=-1, pos_slice=-1)
    per_prompt = (scaled * (directions[:, 0] - directions[:, 1])).sum(-1)
    offset = logit_offset(model)
    torch.testing.assert_close(per_prompt + offset[answers[:, 0]] - offset[answers[:, 1]], true, rtol=0, atol=1e-4)
    torch.testing.assert_close(per_prompt.mean(), true.mean(), rtol=0, atol=1e-4)  # the pairs' offsets cancel
    assert true.abs().max() > 1  # not a trivial logit difference


def test_analyses_agree_or_refuse_on_a_processed_model(paths):
    raw, processed = load_pair("dcpythia-synth")
    tokens = raw.to_tokens(PROMPTS[:1])
    food = raw.to_single_token("food")
    ig = [head_attribution(m, tokens, food, target_type="logprob", n_steps=8).scores for m in (raw, processed)]
    torch.testing.assert_close(ig[1], ig[0], rtol=1e-3, atol=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        same_logits = HookedDCFormer.from_pretrained("dcpythia-synth", **{**PROCESS, "center_unembed": False})
    logit_ig = [head_attribution(m, tokens, food, n_steps=8) for m in (raw, same_logits)]
    torch.testing.assert_close(logit_ig[1].per_prompt, logit_ig[0].per_prompt, rtol=1e-3, atol=1e-3)
    parts = [compose_breakdown(m, tokens, 2, -1, 3) for m in (raw, processed)]
    for field in ("before", "after", "qp", "kp", "qg", "kg"):
        if hasattr(parts[0], field):
            torch.testing.assert_close(getattr(parts[1], field), getattr(parts[0], field), rtol=1e-4, atol=1e-4)
    # Eq. 12 and Fig. 5 read the released norms: a processed model says so instead of giving other numbers
    with pytest.raises(
        ValueError, match=r"ov_logits \(Eq. 12\): reads the released weights .*from_pretrained_no_processing"
    ):
        ov_logits(processed, 2, 0, [food])
    with pytest.raises(ValueError, match=r"head_diversity \(Fig. 5\): reads the released weights"):
        head_diversity(processed)
    ov_logits(raw, 2, 0, [food])


def test_processing_a_disk_offloaded_model_is_refused_in_one_line(tmp_path):
    device_map = {
        "embed": "cpu",
        "blocks.0": "cpu",
        "blocks.1": "disk",
        "blocks.2": "cpu",
        "ln_final": "cpu",
        "unembed": "cpu",
    }
    with pytest.raises(ValueError, match=r"process_weights_: 'blocks.1.\S+' is offloaded \(meta\)"):
        HookedDCFormer.from_pretrained("pythia-synth", device_map=device_map, offload_folder=tmp_path, fold_ln=True)
