"""The rest of the TransformerLens model API on HookedDCFormer: loss_fn, get_token_position, to_tokens' keywords,
unknown words, unembed.b_U, and activation gradients with frozen weights."""

import warnings

import pytest
import torch
from transformer_lens.utilities import lm_cross_entropy_loss

from dcinterp import HookedDCFormer

PROMPT = "Michelle has a burger . Michelle owns a kind of"


@pytest.fixture(scope="module")
def model() -> HookedDCFormer:
    return HookedDCFormer.from_pretrained("dcpythia-synth")


def test_loss_fn_is_transformer_lens_cross_entropy(model):
    tokens = model.to_tokens([PROMPT, "Ruth owns a cat ."], padding_side="right")
    logits = model(tokens)
    torch.testing.assert_close(model.loss_fn(logits, tokens), lm_cross_entropy_loss(logits, tokens))
    torch.testing.assert_close(model.loss_fn(logits, tokens), model(tokens, return_type="loss"))
    mask = (tokens != model.tokenizer.pad_token_id).long()
    torch.testing.assert_close(
        model.loss_fn(logits, tokens, attention_mask=mask), lm_cross_entropy_loss(logits, tokens, attention_mask=mask)
    )
    per_token = model.loss_fn(logits, tokens, attention_mask=mask, per_token=True)
    assert per_token.shape == (2, tokens.shape[1] - 1) and not per_token[1, 5:].any()


def test_get_token_position(model):
    text = "Michelle has a burger . Michelle owns a kind of"
    assert model.get_token_position("Michelle", text) == 0
    assert model.get_token_position("Michelle", text, mode="last") == 5
    assert model.get_token_position("Michelle", text, prepend_bos=True) == 1
    tokens = model.to_tokens(text)
    assert model.get_token_position(model.to_single_token("burger"), tokens) == 3
    assert model.get_token_position("of", tokens[0], mode="last") == tokens.shape[1] - 1
    with pytest.raises(ValueError, match="does not occur"):
        model.get_token_position("cat", text)


def test_to_tokens_keywords(model):
    tokens = model.to_tokens(["a cat", "Ruth owns a cat"], padding_side="left", prepend_bos=True)
    pad, bos = model.tokenizer.pad_token_id, model.tokenizer.bos_token_id
    assert tokens[0, :2].tolist() == [pad, pad] and tokens[0, 2] == bos and tokens[1, 0] == bos
    long_text = " ".join(["cat"] * (model.cfg.n_ctx + 10))
    with pytest.warns(UserWarning, match=f"cut to the model's n_ctx = {model.cfg.n_ctx}"):
        assert model.to_tokens(long_text).shape == (1, model.cfg.n_ctx)  # truncate=True, as TransformerLens
    assert model.to_tokens(long_text, truncate=False).shape == (1, model.cfg.n_ctx + 10)
    assert model.to_tokens("a cat", move_to_device=False).device == torch.device("cpu")
    assert model.unembed.b_U.shape == (model.cfg.d_vocab,) and not model.unembed.b_U.any()
    assert [name for name, _ in model.tl_named_parameters()] == [name for name, _ in model.named_parameters()]


def test_unknown_words_are_named_never_silent(model):
    with pytest.raises(
        ValueError, match=r"to_tokens: not in the tokenizer's vocabulary .*'Zorblax', 'quux'.*allow_unknown"
    ):
        model.to_tokens("Ruth owns a Zorblax . a quux")
    with pytest.warns(
        UserWarning, match=r"to_tokens: not in the tokenizer's vocabulary \(they become \[UNK\]\): 'Zorblax'"
    ):
        tokens = model.to_tokens("Ruth owns a Zorblax", allow_unknown=True)
    assert tokens[0, -1] == model.tokenizer.unk_token_id
    model.allow_unknown_tokens = True  # for code that tokenizes for you (SAELens, test_prompt)
    try:
        with pytest.warns(UserWarning, match="'Zorblax'"):
            model("Ruth owns a Zorblax")
    finally:
        model.allow_unknown_tokens = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.to_tokens(PROMPT)  # known words: nothing said


def test_inspection_shows_unknown_words_as_unk_with_one_warning_line(model):
    """TransformerLens' Main_Demo cell `model.to_str_tokens("2342+2017=21445")`: what the model would read, and
    one warning naming the unknown words, pointing at the caller; to_tokens, which feeds the model, still raises."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert model.to_str_tokens("2342+2017=21445") == ["[UNK]", "+", "2017", "=", "[UNK]"]
        assert model.to_string("2342 + 2017") == "[UNK] + 2017"
        assert model.to_str_tokens(["Ruth has a Zorblax", "a quux"]) == [["Ruth", "has", "a", "[UNK]"], ["a", "[UNK]"]]
        assert model.to_string(["Ruth has a cat", "Ruth has a Zorblax"]) == ["Ruth has a cat", "Ruth has a [UNK]"]
    assert [str(w.message) for w in caught] == [
        "to_str_tokens: not in the tokenizer's vocabulary (they become [UNK]): '21445', '2342'",
        "to_string: not in the tokenizer's vocabulary (they become [UNK]): '2342'",
        "to_str_tokens: not in the tokenizer's vocabulary (they become [UNK]): 'Zorblax', 'quux'",
        "to_string: not in the tokenizer's vocabulary (they become [UNK]): 'Zorblax'",
    ]
    assert {w.filename for w in caught} == {__file__}  # the line of the user's call, not inside dcinterp
    with pytest.raises(ValueError, match=r"to_tokens: .*'21445', '2342'.*allow_unknown"):
        model.to_tokens("2342+2017=21445")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert model.to_str_tokens(PROMPT) == model.to_str_tokens(model.to_tokens(PROMPT))  # known words: silent
        assert model.to_string(PROMPT) == model.to_string(model.to_tokens(PROMPT)[0])


# --------------------------------------------------------------------------------------------------
# Activation gradients with frozen weights
def metric(logits):
    return logits[:, -1, 7].sum() - logits[:, -1, 3].sum()


def grads_through_hooks(model, tokens, names):
    grads = {}
    model.reset_hooks()
    for name in names:
        model.add_hook(name, lambda g, hook: grads.__setitem__(hook.name, g.detach().clone()), "bwd")
    metric(model(tokens)).backward()
    model.reset_hooks()
    return grads


def test_activation_gradients_with_frozen_weights(model):
    tokens = model.to_tokens([PROMPT, "Ruth has a cat . Ruth owns a kind of"])
    assert not any(p.requires_grad for p in model.parameters())
    assert not model(tokens).requires_grad  # a plain forward keeps no graph
    names = [
        "hook_embed",
        "blocks.1.hook_resid_pre",
        "blocks.2.attn.hook_z",
        "blocks.1.attn.hook_composed_pattern",
        "blocks.1.attn.post_compose.hook_o_kp",
        "blocks.0.attn.pre_compose.hook_qw1",
        "ln_final.hook_scale",
    ]
    frozen = grads_through_hooks(model, tokens, names)
    assert set(frozen) == set(names) and not any(p.grad is not None for p in model.parameters())
    unfrozen_model = HookedDCFormer.from_pretrained("dcpythia-synth").requires_grad_(True)
    unfrozen = grads_through_hooks(unfrozen_model, tokens, names)
    for name in names:
        torch.testing.assert_close(frozen[name], unfrozen[name], rtol=1e-5, atol=1e-6, msg=name)
        assert frozen[name].abs().sum() > 0, name
    # run_with_cache(incl_bwd=True) as TransformerLens: the gradients of the loss land in the cache
    _, cache = model.run_with_cache(
        tokens, return_type="loss", incl_bwd=True, names_filter=lambda name: name.endswith("hook_z")
    )
    assert cache["blocks.2.attn.hook_z_grad"].abs().sum() > 0
    assert not model(tokens).requires_grad  # the hooks are gone: no graph again
    # one documented call, for a backward with no hook attached
    model.set_use_activation_grads(True)
    try:
        model(tokens)[0, -1, 7].backward()  # what failed with "element 0 of tensors does not require grad"
        out = model(tokens)
        assert out.requires_grad and not any(p.requires_grad for p in model.parameters())
    finally:
        model.set_use_activation_grads(False)
    with torch.no_grad():
        model.add_hook("hook_embed", lambda g, hook: None, "bwd")
        assert not model(tokens).requires_grad  # no_grad wins
        model.reset_hooks()


def test_cfg_dtype_and_device_follow_the_weights_as_in_transformer_lens():
    from dcinterp import DCFormerConfig

    model = HookedDCFormer(DCFormerConfig(n_layers=1, d_model=16, n_heads=2, d_head=8, d_mlp=16, d_vocab=10, n_ctx=8))
    for convert, dtype in [
        (lambda m: m.to(torch.bfloat16), torch.bfloat16),
        (lambda m: m.half(), torch.float16),
        (lambda m: m.to(dtype=torch.float64), torch.float64),
        (lambda m: m.float(), torch.float32),
    ]:
        convert(model)
        assert model.cfg.dtype == dtype == model.blocks[0].attn.W_Q.dtype
    model.to("cpu")
    assert model.cfg.device == "cpu"


@pytest.mark.parametrize("mode", ["Q", "K", "V"])
def test_all_composition_scores_are_transformer_lens_scores_of_the_circuits(model, mode):
    scores = model.all_composition_scores(mode)
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    assert scores.shape == (n_layers, n_heads, n_layers, n_heads)
    assert model.all_head_labels[: n_heads + 1] == [f"L0H{h}" for h in range(n_heads)] + ["L1H0"]
    W_Q, W_K, W_V, W_O = (w.detach().double() for w in (model.W_Q, model.W_K, model.W_V, model.W_O))
    for l1, h1, l2, h2 in [(0, 0, 1, 1), (0, 2, 2, 3), (1, 3, 2, 0), (2, 1, 0, 1), (1, 1, 1, 2)]:
        writes = W_V[l1, h1] @ W_O[l1, h1]
        reads = {"Q": W_Q[l2, h2] @ W_K[l2, h2].T, "K": W_K[l2, h2] @ W_Q[l2, h2].T, "V": W_V[l2, h2] @ W_O[l2, h2]}
        expected = (writes @ reads[mode]).norm() / writes.norm() / reads[mode].norm() if l1 < l2 else 0.0
        assert float(scores[l1, h1, l2, h2]) == pytest.approx(float(expected), rel=1e-4, abs=1e-7)
    with pytest.raises(ValueError, match="mode must be 'Q', 'K' or 'V'"):
        model.all_composition_scores("O")


def test_to_single_str_token_inverts_to_single_token(model):
    assert model.to_single_str_token(model.to_single_token("food")) == "food"
    with pytest.raises(ValueError, match="an int token id"):
        model.to_single_str_token("food")


PROMPTS = ["Michelle has a burger .", "Helen has a papaya . Carol has a cannon . Helen owns"]


def test_pad_attention_mask_is_transformer_lens_get_attention_mask():
    from types import SimpleNamespace

    from transformer_lens.utilities import get_attention_mask

    from dcinterp.model import pad_attention_mask

    tokens = torch.tensor([[0, 0, 5, 0, 6], [0, 7, 8, 9, 0], [4, 5, 6, 0, 0]])
    for pad, bos in [(0, 3), (0, 0)]:
        tokenizer = SimpleNamespace(pad_token_id=pad, bos_token_id=bos, padding_side="right")
        for side in ("left", "right"):
            for prepend_bos in (False, True):
                expected = get_attention_mask(tokenizer, tokens, prepend_bos, padding_side=side)
                assert torch.equal(pad_attention_mask(tokenizer, tokens, prepend_bos, side), expected)


def test_left_padded_text_gives_each_prompt_alone_as_in_transformer_lens(model):
    alone = [model(p)[0, -1] for p in PROMPTS]
    logits = model(PROMPTS, padding_side="left")
    _, cache = model.run_with_cache(PROMPTS, padding_side="left")
    side = model.tokenizer.padding_side
    model.tokenizer.padding_side = "left"  # the TransformerLens recipe for batches: every forward pads and masks so
    try:
        tokens = model.to_tokens(PROMPTS)
        by_tokenizer = model(tokens)
        per_token = model(PROMPTS, return_type="loss", loss_per_token=True)
        loss = model(PROMPTS, return_type="loss")
    finally:
        model.tokenizer.padding_side = side
    assert tokens[0, 0] == model.tokenizer.pad_token_id  # padded on the left
    for i, last in enumerate(alone):
        torch.testing.assert_close(logits[i, -1], last, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(by_tokenizer[i, -1], last, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(
            model.unembed(model.ln_final(cache["resid_post", -1]))[i, -1], last, atol=1e-4, rtol=1e-4
        )
    own = [model(p, return_type="loss", loss_per_token=True)[0] for p in PROMPTS]
    assert loss.item() == pytest.approx(torch.cat(own).mean().item(), rel=1e-5)  # the pads are left out
    assert (per_token[0, : tokens.shape[1] - 1 - len(own[0])] == 0).all()


def test_an_attention_mask_leaves_padding_out_of_the_loss_as_transformer_lens(model):
    tokens = model.to_tokens(PROMPTS, padding_side="left")
    mask = (tokens != model.tokenizer.pad_token_id).long()
    logits, loss = model(tokens, attention_mask=mask, return_type="both")
    assert loss.item() == pytest.approx(lm_cross_entropy_loss(logits, tokens, mask).item(), rel=1e-6)
    with pytest.warns(UserWarning, match=r"the loss counts the \d+ pad tokens of right-padded text"):
        right = model(PROMPTS, return_type="loss")
    tokens = model.to_tokens(PROMPTS)
    assert right.item() == pytest.approx(lm_cross_entropy_loss(model(tokens), tokens).item(), rel=1e-6)


@pytest.mark.parametrize("name", ["dcpythia-synth", "tests/fixtures/dcformer-tiny"])  # parallel, sequential
def test_hook_mlp_in_forks_the_stream_into_the_mlp_as_in_transformer_lens(name):
    model = HookedDCFormer.from_pretrained(name)
    tokens = torch.randint(3, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    logits, cache = model.run_with_cache(tokens)
    assert "blocks.1.hook_mlp_in" not in cache
    model.set_use_hook_mlp_in(True)
    try:
        forked, fork_cache = model.run_with_cache(tokens)
        stream = "blocks.1.hook_resid_pre" if model.cfg.parallel_residual else "blocks.1.hook_resid_mid"
        torch.testing.assert_close(fork_cache["blocks.1.hook_mlp_in"], cache[stream])
        torch.testing.assert_close(forked, logits)
        delta = torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(1))
        patched = {}
        model.run_with_hooks(
            tokens,
            fwd_hooks=[
                ("blocks.1.hook_mlp_in", lambda x, hook: x + delta),
                (lambda n: n.startswith("blocks.1.hook"), lambda x, hook: patched.__setitem__(hook.name, x)),
            ],
        )
    finally:
        model.set_use_hook_mlp_in(False)
    assert not torch.allclose(patched["blocks.1.hook_mlp_out"], cache["blocks.1.hook_mlp_out"])
    torch.testing.assert_close(patched[stream], cache[stream])  # the stream itself is not patched
    torch.testing.assert_close(patched["blocks.1.hook_attn_out"], cache["blocks.1.hook_attn_out"])
    before_mlp = patched[stream] + (patched["blocks.1.hook_attn_out"] if model.cfg.parallel_residual else 0)
    torch.testing.assert_close(patched["blocks.1.hook_resid_post"], before_mlp + patched["blocks.1.hook_mlp_out"])


def test_empty_text_and_a_loss_over_nothing_are_one_clear_line(model):
    assert model("").shape == (1, 0, model.cfg.d_vocab)  # no tokens, no logits (was an IndexError on floats)
    assert model("", prepend_bos=True).shape[:2] == (1, 1)
    for text, kwargs in [("Ruth", {}), (["Ruth", "cat"], {"padding_side": "left"})]:
        with pytest.raises(ValueError, match="loss: no token has a next token to predict"):
            model(text, return_type="loss", **kwargs)
        assert model(text, return_type="loss", loss_per_token=True, **kwargs).shape[1] == 0
