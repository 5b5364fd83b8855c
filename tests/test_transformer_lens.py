"""A TransformerLens user's toolbox on HookedDCFormer: patching, head detection, test_prompt, SVDInterpreter, the
cache's logit lens and decompositions, generate, start_at_layer; and, for a Pythia load built by `transformers`,
every hook TransformerLens' own TransformerBridge also has, value by value.

Models: the two embedded ones (DCMHA and plain MHA) and a tiny random GPT-NeoX saved by `transformers` here.
"""

import contextlib
import io
import json
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
from transformer_lens import SVDInterpreter, head_detector, patching
from transformer_lens.utilities import test_prompt as tl_test_prompt

import dcinterp
from dcinterp import DCFormerConfig, HookedDCFormer, get_act_name
from dcinterp.model import visible_keys
from tests.numerics import assert_as_exact_as, float64_copy

FIXTURES = Path(__file__).parent / "fixtures"
EMBEDDED_TOKENIZER = Path(dcinterp.__file__).parent / "checkpoints" / "pythia-synth" / "tokenizer.json"
CLEAN, CORRUPTED = "Ruth owns a cat .", "Ruth owns a dog ."  # same length: the patching pair
PROMPT = "Michelle has a burger . Michelle owns a kind of"

# The sweeps with another signature (a corrupted cache and a source head too): test_direct_path_patching.
DIRECT_PATH = {"get_act_patch_direct_path", "get_act_patch_direct_path_all_sources"}
# Hooks of one side only, for the Pythia load: ours (rotary as its own hook) / the bridge's module wrappers.
ONLY_OURS_BY_DESIGN = {"hook_rot_q", "hook_rot_k"}  # TransformerLens' HookedTransformer names; the bridge has none
BRIDGE_ONLY = re.compile(r"(hook_in|hook_out|hook_cos|hook_sin|hook_hidden_states|hook_unembed)$")


def save_tiny_pythia(directory: Path) -> Path:
    """A 2-layer GPT-NeoX (Pythia layout: parallel residual, rotary on a quarter of each head) with random weights."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(EMBEDDED_TOKENIZER),
        bos_token="[BOS]",
        eos_token="[EOS]",
        pad_token="[PAD]",
        unk_token="[UNK]",
    )
    config = GPTNeoXConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        rotary_pct=0.25,
        max_position_embeddings=64,
        use_parallel_residual=True,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    GPTNeoXForCausalLM(config).eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def pythia_dir(tmp_path_factory) -> Path:
    return save_tiny_pythia(tmp_path_factory.mktemp("tiny-pythia"))


@pytest.fixture(scope="module")
def models(pythia_dir) -> dict[str, HookedDCFormer]:
    return {name: HookedDCFormer.from_pretrained(name) for name in ("dcpythia-synth", "pythia-synth")} | {
        "hf-pythia": HookedDCFormer.from_pretrained(pythia_dir)
    }


MODEL_NAMES = ["dcpythia-synth", "pythia-synth", "hf-pythia"]


@pytest.fixture(scope="module")
def bridge(pythia_dir):
    from transformer_lens.model_bridge import TransformerBridge

    return TransformerBridge.boot_transformers(str(pythia_dir), device="cpu")


# --------------------------------------------------------------------------------------------------
# Config and weights
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_config_has_what_transformer_lens_reads(models, name):
    cfg = models[name].cfg
    assert cfg.device == "cpu" and cfg.n_key_value_heads is None and cfg.dtype is torch.float32
    assert cfg.positional_embedding_type == "rotary" and cfg.d_vocab_out == cfg.d_vocab
    assert cfg.use_split_qkv_input is False and cfg.use_attn_in is False
    again = DCFormerConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))  # config.json round trip
    assert again.to_dict() == cfg.to_dict() and again.dtype is torch.float32 and cfg.to_dict()["dtype"] == "float32"
    cfg_bf16 = DCFormerConfig.from_dict({**cfg.to_dict(), "dtype": "bfloat16"})
    assert cfg_bf16.dtype is torch.bfloat16 and cfg_bf16.torch_dtype is torch.bfloat16
    with pytest.raises(ValueError, match="dtype: 'int8' is not a floating-point"):
        DCFormerConfig.from_dict({**cfg.to_dict(), "dtype": "int8"})


def test_stacked_weights_and_biases(models):
    model = models["dcpythia-synth"]
    L, H, D, E, M = (model.cfg.n_layers, model.cfg.n_heads, model.cfg.d_model, model.cfg.d_head, model.cfg.d_mlp)
    shapes = {
        "b_Q": (L, H, E),
        "b_K": (L, H, E),
        "b_V": (L, H, E),
        "b_O": (L, D),
        "W_in": (L, D, M),
        "W_out": (L, M, D),
        "b_in": (L, M),
        "b_out": (L, D),
    }
    for name, shape in shapes.items():
        stacked = getattr(model, name)
        assert stacked.shape == shape, name
        part = "mlp" if name in ("W_in", "W_out", "b_in", "b_out") else "attn"
        assert torch.equal(stacked[1], getattr(getattr(model.blocks[1], part), name)), name
    assert torch.equal(model.b_U, torch.zeros(model.cfg.d_vocab))
    no_bias = HookedDCFormer(
        DCFormerConfig(
            n_layers=2, d_model=8, n_heads=2, d_head=4, d_mlp=16, d_vocab=10, use_bias=False, act_fn="swiglu"
        )
    )
    assert torch.equal(no_bias.b_Q, torch.zeros(2, 2, 4)) and torch.equal(no_bias.b_out, torch.zeros(2, 8))
    assert no_bias.W_gate.shape == (2, 8, 16)
    # accumulated_bias: what the attention and MLP biases add to the stream before a layer, as TransformerLens
    expected = model.blocks[0].attn.b_O + model.blocks[0].mlp.b_out + model.blocks[1].attn.b_O
    torch.testing.assert_close(model.accumulated_bias(1, mlp_input=True), expected)
    torch.testing.assert_close(model.accumulated_bias(2, include_mlp_biases=False), model.b_O[:2].sum(0))


# --------------------------------------------------------------------------------------------------
# Masked scores
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_score_hooks_are_masked_as_in_transformer_lens(models, name):
    model = models[name]
    tokens = model.to_tokens(PROMPT)
    logits, cache = model.run_with_cache(tokens)
    # caching does not change the forward beyond two paths' float32 rounding (judged by float64, tests/numerics.py)
    exact, _ = float64_copy(model).run_with_cache(tokens)
    assert_as_exact_as(model(tokens), logits, exact, "logits")
    future = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool).triu(1)
    for layer in range(model.cfg.n_layers):
        scores = cache["attn_scores", layer]
        hidden = ~visible_keys(tokens.shape[1], model.blocks[layer].attn.window, "cpu")  # future, or out of window
        assert (hidden >= future).all() and (hidden.sum() > future.sum()) == (
            model.blocks[layer].attn.window is not None
        )
        assert (scores[..., hidden] == torch.finfo(scores.dtype).min).all()
        assert (scores[..., ~hidden] > -1e4).all()
        if not model.cfg.use_dcmha:  # plain MHA: the pattern is the softmax of the scores hook, as in TransformerLens
            torch.testing.assert_close(scores.softmax(-1), cache["pattern", layer], rtol=0, atol=1e-7)
        else:
            composed = cache[f"blocks.{layer}.attn.hook_composed_scores"]
            torch.testing.assert_close(composed.softmax(-1), cache["pattern", layer], rtol=0, atol=1e-7)


def test_masked_scores_hooks_give_no_nan_forward_or_backward(models):
    """A hook on the DCMHA score hooks sees the mask; the compose still never mixes it in (no inf - inf)."""
    model = models["dcpythia-synth"]
    tokens = model.to_tokens(PROMPT)
    reference = model(tokens)
    names = [
        f"blocks.{layer}.attn.{hook}" for layer in range(3) for hook in ("hook_attn_scores", "hook_composed_scores")
    ]
    embed = model.embed.W_E.detach().clone().requires_grad_(True)

    def use_leaf(x, hook):
        return embed[tokens]

    def double_then_halve(x, hook):
        return (x * 2) / 2  # touches the masked entries: finfo.min * 2 is -inf

    hooks = [("hook_embed", use_leaf)] + [(name, double_then_halve) for name in names]
    logits = model.run_with_hooks(tokens, fwd_hooks=hooks)
    # two compose paths (hooked: materialised; reference: blocked), judged by float64 (tests/numerics.py)
    with torch.no_grad():
        exact = float64_copy(model).run_with_hooks(tokens, fwd_hooks=hooks[1:])
    assert_as_exact_as(reference, logits.detach(), exact, "logits")
    logits[0, -1].logsumexp(-1).backward()
    assert torch.isfinite(embed.grad).all() and embed.grad.abs().sum() > 0
    # A branch output cached alone is 0 at hidden keys too (the compose input is masked with 0 whenever it is shown)
    name = "blocks.2.attn.pre_compose.hook_o_kp"
    _, cache = model.run_with_cache(tokens, names_filter=[name])
    future = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool).triu(1)
    assert not cache[name][..., future].any() and cache[name][..., ~future].abs().sum() > 0


# --------------------------------------------------------------------------------------------------
# Patching
def patch_inputs(model):
    clean, corrupted = model.to_tokens(CLEAN), model.to_tokens(CORRUPTED)
    _, clean_cache = model.run_with_cache(clean)
    target = model.to_single_token("cat")
    return clean, corrupted, clean_cache, (lambda logits: logits[0, -1, target])


def act_patch_functions(model) -> list[str]:
    names = sorted(name for name in dir(patching) if name.startswith("get_act_patch"))
    assert DIRECT_PATH <= set(names)  # the list of exceptions is not stale
    skip = DIRECT_PATH | ({"get_act_patch_resid_mid"} if model.cfg.parallel_residual else set())
    return [name for name in names if name not in skip]


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_act_patch_function_runs(models, name):
    model = models[name]
    clean, corrupted, clean_cache, metric = patch_inputs(model)
    L, P, H = model.cfg.n_layers, clean.shape[1], model.cfg.n_heads
    results = {fn: getattr(patching, fn)(model, corrupted, clean_cache, metric) for fn in act_patch_functions(model)}
    assert len(results) == 17  # all of TransformerLens' sweeps but resid_mid (a parallel block has no resid_mid)
    shapes = {
        "get_act_patch_resid_pre": (L, P),
        "get_act_patch_attn_head_out_by_pos": (L, P, H),
        "get_act_patch_attn_head_pattern_dest_src_pos": (L, H, P, P),
        "get_act_patch_block_every": (3, L, P),
        "get_act_patch_attn_head_all_pos_every": (5, L, H),
        "get_act_patch_attn_head_v_all_pos": (L, H),
    }
    for fn, shape in shapes.items():
        assert results[fn].shape == shape, fn
    for fn, result in results.items():
        assert torch.isfinite(result).all(), fn
    # The runs differ only in the token at position 3: patching the stream entering layer 0 there makes the
    # corrupted run the clean one; anywhere else it changes nothing.
    clean_metric, corrupted_metric = metric(model(clean)), metric(model(corrupted))
    torch.testing.assert_close(results["get_act_patch_resid_pre"][0, 3], clean_metric)
    others = [p for p in range(P) if p != 3]
    torch.testing.assert_close(results["get_act_patch_resid_pre"][0, others], corrupted_metric.expand(P - 1))

    # One entry of a head sweep, by hand: layer 1, position 3 (the object), head 2's hook_z from the clean run.
    def patch_z(z, hook):
        z[:, 3, 2] = clean_cache["z", 1][:, 3, 2]
        return z

    by_hand = metric(model.run_with_hooks(corrupted, fwd_hooks=[(get_act_name("z", 1), patch_z)]))
    torch.testing.assert_close(results["get_act_patch_attn_head_out_by_pos"][1, 3, 2], by_hand)

    # And of a pattern sweep: layer 0, head 1, every position.
    def patch_pattern(pattern, hook):
        pattern[:, 1] = clean_cache["pattern", 0][:, 1]
        return pattern

    by_hand = metric(model.run_with_hooks(corrupted, fwd_hooks=[(get_act_name("pattern", 0), patch_pattern)]))
    torch.testing.assert_close(results["get_act_patch_attn_head_pattern_all_pos"][0, 1], by_hand)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_direct_path_patching(models, name):
    """Source head (0, 1)'s clean-minus-corrupted write, added to one destination head's q/k/v input only."""
    model = models[name]
    clean, corrupted, clean_cache, metric = patch_inputs(model)
    _, corrupted_cache = model.run_with_cache(corrupted)
    reference = model(corrupted)
    model.set_use_split_qkv_input(True)  # per-head input forks: the forward is unchanged
    torch.testing.assert_close(model(corrupted), reference, rtol=0, atol=1e-6)
    model.set_use_split_qkv_input(False)
    delta = (clean_cache["z", 0][:, :, 1] - corrupted_cache["z", 0][:, :, 1]) @ model.W_O[0, 1]
    for component in "qkv":
        result = patching.get_act_patch_direct_path(
            model, corrupted, clean_cache, corrupted_cache, metric, 0, 1, component=component, verbose=False
        )
        assert result.shape == (model.cfg.n_layers, model.cfg.n_heads) and not result[0].any()

        def add_delta(copies, hook):
            copies[:, :, 2] += delta
            return copies

        model.set_use_split_qkv_input(True)
        by_hand = metric(
            model.run_with_hooks(corrupted, fwd_hooks=[(f"blocks.1.attn.hook_{component}_input", add_delta)])
        )
        model.set_use_split_qkv_input(False)
        torch.testing.assert_close(result[1, 2], by_hand)
        assert not model.cfg.use_split_qkv_input  # restored by TransformerLens
    every = patching.get_act_patch_direct_path_all_sources(
        model, corrupted, clean_cache, corrupted_cache, metric, verbose=False
    )
    L, H = model.cfg.n_layers, model.cfg.n_heads
    assert every.shape == (L, H, L, H) and torch.isfinite(every).all()


def test_resid_mid_patching_on_a_sequential_model():
    model = HookedDCFormer.from_pretrained(FIXTURES / "dcformer-tiny")  # DCFormer++ layout: resid_mid exists
    torch.manual_seed(0)
    clean, corrupted = torch.randint(0, model.cfg.d_vocab, (2, 1, 6))
    _, clean_cache = model.run_with_cache(clean)

    def metric(logits):
        return logits[0, -1, 7]

    result = patching.get_act_patch_resid_mid(model, corrupted, clean_cache, metric)
    assert result.shape == (model.cfg.n_layers, 6)

    def patch(resid, hook):
        resid[:, 2] = clean_cache["resid_mid", 1][:, 2]
        return resid

    by_hand = metric(model.run_with_hooks(corrupted, fwd_hooks=[("blocks.1.hook_resid_mid", patch)]))
    torch.testing.assert_close(result[1, 2], by_hand)


def test_patching_matches_the_bridge(models, bridge):
    model = models["hf-pythia"]
    clean, corrupted, clean_cache, metric = patch_inputs(model)
    ours = patching.get_act_patch_attn_head_out_all_pos(model, corrupted, clean_cache, metric)
    _, bridge_cache = bridge.run_with_cache(clean)
    theirs = patching.get_act_patch_attn_head_out_all_pos(bridge.eval(), corrupted, bridge_cache, metric)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# Other utilities
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_detect_head(models, name):
    model = models[name]
    scores = head_detector.detect_head(model, PROMPT, "previous_token_head")
    assert scores.shape == (model.cfg.n_layers, model.cfg.n_heads) and scores.dtype == torch.float32
    _, cache = model.run_with_cache(model.to_tokens(PROMPT))
    pattern = cache["pattern", 1][0, 2]
    by_hand = pattern.diagonal(-1).sum() / pattern.sum()  # attention on the previous token, of all attention
    torch.testing.assert_close(scores[1, 2], by_hand)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_test_prompt_reports_the_answer_rank(models, name):
    model = models[name]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        tl_test_prompt("Michelle has a burger . Michelle owns a kind of", "food", model, prepend_space_to_answer=False)
    logits = model(model.to_tokens(PROMPT))[0, -1]
    rank = int((logits > logits[model.to_single_token("food")]).sum())
    assert f"Rank: {rank} " in out.getvalue()
    assert "Tokenized prompt: ['Michelle', 'has', 'a', 'burger'" in out.getvalue()


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_svd_interpreter(models, name):
    model = models[name]
    vectors = SVDInterpreter(model).get_singular_vectors("OV", layer_index=1, head_index=0, num_vectors=2)
    assert vectors.shape == (model.cfg.d_vocab, 1, 2)
    _, _, Vh = torch.linalg.svd(model.W_V[1, 0] @ model.W_O[1, 0])
    by_hand = model.W_U.T @ Vh[0]
    sign = torch.sign(by_hand @ vectors[:, 0, 0])
    torch.testing.assert_close(vectors[:, 0, 0], sign * by_hand, rtol=1e-4, atol=1e-4)
    assert SVDInterpreter(model).get_singular_vectors("w_in", layer_index=0, num_vectors=3).shape == (
        model.cfg.d_vocab,
        1,
        3,
    )


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_cache_logit_lens_and_decompositions(models, name):
    model = models[name]
    tokens = model.to_tokens(PROMPT)
    logits, cache = model.run_with_cache(tokens)
    lens = cache.logit_lens()
    assert lens.labels[-1] == "final_post" and len(lens.labels) == model.cfg.n_layers + 1
    torch.testing.assert_close(lens.values[-1, 0], logits[0, -1], rtol=0, atol=1e-4)  # the last entry is the model

    # accumulated_resid(apply_ln=True): the final norm applied to each stream entering a layer; the last one unembeds
    stack, labels = cache.accumulated_resid(apply_ln=True, return_labels=True)
    assert stack.shape == (model.cfg.n_layers + 1, 1, tokens.shape[1], model.cfg.d_model) and labels[1] == "1_pre"
    torch.testing.assert_close(stack[1], model.ln_final(cache["resid_pre", 1]), rtol=0, atol=1e-5)
    torch.testing.assert_close(stack[-1] @ model.W_U + model.b_U, logits, rtol=0, atol=1e-4)

    # get_full_resid_decomposition: heads, neurons, embedding and biases sum to the residual stream
    for layer, hook in [(None, f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"), (1, "blocks.1.hook_resid_pre")]:
        parts, labels = cache.get_full_resid_decomposition(layer, return_labels=True)
        assert len(labels) == len(parts) and labels[-1] == "bias" and "L0H0" in labels
        torch.testing.assert_close(parts.sum(0), cache[hook], rtol=0, atol=1e-4)


# --------------------------------------------------------------------------------------------------
# Forward options, tokens, generate
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_start_at_layer_equals_the_full_forward(models, name):
    model = models[name]
    tokens = model.to_tokens([PROMPT, PROMPT.replace("burger", "cat")])
    for layer in range(-model.cfg.n_layers, model.cfg.n_layers + 1):  # negative: counted from the end, as a slice
        resid = model(tokens, stop_at_layer=layer)
        torch.testing.assert_close(model(resid, start_at_layer=layer), model(tokens), rtol=0, atol=1e-5)
    loss = model(model(tokens, stop_at_layer=1), start_at_layer=1, tokens=tokens, return_type="loss")
    torch.testing.assert_close(loss, model(tokens, return_type="loss"))
    with pytest.raises(ValueError, match="needs the tokens"):
        model(model(tokens, stop_at_layer=1), start_at_layer=1, return_type="loss")


def test_to_str_tokens_on_batches_and_lists(models):
    model = models["dcpythia-synth"]
    tokens = model.to_tokens(["Ruth owns a cat", "Ruth owns a dog"])
    assert model.to_str_tokens(tokens) == [["Ruth", "owns", "a", "cat"], ["Ruth", "owns", "a", "dog"]]
    assert model.to_str_tokens(tokens[:1]) == ["Ruth", "owns", "a", "cat"]
    assert model.to_str_tokens(["a cat", "Ruth"]) == [["a", "cat"], ["Ruth"]]
    assert model.to_str_tokens("a cat", prepend_bos=True) == ["[BOS]", "a", "cat"]
    assert model.to_str_tokens(tokens[0, 3]) == ["cat"]
    import numpy as np

    assert model.to_str_tokens(np.array([tokens[0, 1].item()])) == ["owns"]


def test_get_act_name_knows_dcmha_hooks(models):
    model = models["dcpythia-synth"]
    for name in [
        get_act_name("composed_pattern", 2),
        get_act_name("composed_scores", 0),
        get_act_name("o_kp", 2, "post"),
        get_act_name("qw1", 1, "pre_compose"),
        get_act_name("pattern", 1),
    ]:
        assert name in model.hook_dict, name
    assert get_act_name("o_kp", 2, "post") == "blocks.2.attn.post_compose.hook_o_kp"
    with pytest.raises(ValueError, match="pass layer_type 'pre' or 'post'"):
        get_act_name("o_kp", 2)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_generate_greedy_equals_an_argmax_loop(models, name):
    model = models[name]
    tokens = model.to_tokens(PROMPT)
    expected = tokens
    for _ in range(4):
        expected = torch.cat([expected, model(expected)[:, -1].argmax(-1, keepdim=True)], dim=1)
    out = model.generate(tokens, max_new_tokens=4, do_sample=False, stop_at_eos=False)
    assert torch.equal(out, expected)
    text = model.generate(PROMPT, max_new_tokens=4, do_sample=False, stop_at_eos=False)
    assert text == model.to_string(expected[0])


def test_generate_stops_at_eos_samples_and_keeps_hooks_active(models):
    model = models["dcpythia-synth"]
    tokens = model.to_tokens(PROMPT)
    first = int(model(tokens)[0, -1].argmax())
    stopped = model.generate(tokens, max_new_tokens=5, do_sample=False, eos_token_id=first)
    assert stopped.shape[1] == tokens.shape[1] + 1 and stopped[0, -1] == first
    # hooks attached to the model act at every step: with the final norm zeroed every logit is 0 and argmax is id 0
    with model.hooks(fwd_hooks=[("ln_final.hook_normalized", lambda x, hook: 0 * x)]):
        hooked = model.generate(tokens, max_new_tokens=3, do_sample=False, stop_at_eos=False)
    assert hooked[0, -3:].tolist() == [0, 0, 0]
    torch.manual_seed(0)
    sampled = model.generate(tokens, max_new_tokens=3, top_k=1, stop_at_eos=False)  # top-1 sampling is greedy
    assert torch.equal(sampled, model.generate(tokens, max_new_tokens=3, do_sample=False, stop_at_eos=False))
    torch.manual_seed(0)
    hot = model.generate(tokens.repeat(8, 1), max_new_tokens=3, temperature=5.0, stop_at_eos=False)
    assert hot.shape == (8, tokens.shape[1] + 3) and len({tuple(row) for row in hot[:, -3:].tolist()}) > 1


# --------------------------------------------------------------------------------------------------
# Hook by hook against TransformerLens' TransformerBridge on the same Pythia checkpoint
def test_every_shared_hook_matches_the_bridge(models, bridge):
    model = models["hf-pythia"]
    tokens = model.to_tokens(PROMPT)
    assert torch.equal(tokens, bridge.to_tokens(PROMPT, prepend_bos=False))
    ours_logits, ours = model.run_with_cache(tokens)
    bridge_logits, theirs = bridge.run_with_cache(tokens)
    torch.testing.assert_close(ours_logits, bridge_logits, rtol=0, atol=1e-5)
    shared = set(ours.keys()) & set(theirs.keys())
    only_ours = {name.split(".")[-1] for name in set(ours.keys()) - shared}
    only_bridge = {name for name in set(theirs.keys()) - shared if not BRIDGE_ONLY.search(name)}
    assert only_ours == ONLY_OURS_BY_DESIGN and not only_bridge  # the only differences, listed above
    per_layer = [
        "hook_resid_pre",
        "hook_resid_post",
        "hook_attn_out",
        "hook_mlp_out",
        "ln1.hook_scale",
        "ln1.hook_normalized",
        "ln2.hook_normalized",
        "attn.hook_q",
        "attn.hook_k",
        "attn.hook_v",
        "attn.hook_attn_scores",
        "attn.hook_pattern",
        "attn.hook_z",
        "mlp.hook_pre",
        "mlp.hook_post",
    ]
    expected = {f"blocks.{l}.{hook}" for l in range(2) for hook in per_layer} | {"hook_embed", "ln_final.hook_scale"}
    assert expected <= shared
    for name in sorted(shared):
        message = f"{name}: {{}}"
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-5, msg=message.format)


# --------------------------------------------------------------------------------------------------
# The circuitsvis page, in a real headless browser
def chromium() -> str | None:
    return next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


def test_attention_page_is_self_contained(models, tmp_path):
    from dcinterp.views import write_attention_page

    path = write_attention_page(models["dcpythia-synth"], PROMPT, 2, tmp_path / "attention.html")
    page = path.read_text()
    assert "<script src" not in page and "unpkg" not in page and "cdn.jsdelivr" not in page
    assert page.count("CircuitsVis.render(") == 2  # before and after post-compose
    assert '"minValue": -' in page  # the composed pattern on a signed scale
    mha = write_attention_page(models["pythia-synth"], PROMPT, 1, tmp_path / "mha.html").read_text()
    assert mha.count("CircuitsVis.render(") == 1
    with pytest.raises(ValueError, match="layer: 3 is not a layer"):
        write_attention_page(models["pythia-synth"], PROMPT, 3, tmp_path / "bad.html")
    assert not (tmp_path / "bad.html").exists()


def render(page: Path, *mode: str) -> subprocess.CompletedProcess:
    """Chromium, headless, with every network request sent to a closed port: the page must need none."""
    command = [
        chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-extensions",
        "--proxy-server=127.0.0.1:9",
        "--virtual-time-budget=10000",
        "--window-size=1200,1400",
        *mode,
        page.as_uri(),
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=180, check=True, cwd=page.parent)


@pytest.mark.skipif(chromium() is None, reason="no chromium binary (.ci/run installs it; apt-get install chromium)")
def test_attention_page_renders_offline_in_chromium(models, tmp_path):
    """The views are drawn (DOM read back), and the token labels on their axes (screenshot against a blank-label twin).

    circuitsvis draws each pattern and its token labels on a <canvas>, so the labels are checked on the pixels."""
    import numpy as np
    from PIL import Image

    from dcinterp.views import write_attention_page

    model = models["dcpythia-synth"]
    page = write_attention_page(model, PROMPT, 2, tmp_path / "attention.html")
    dom = render(page, "--dump-dom").stdout
    assert len(re.findall(r">Head Selector", dom)) == 2 and len(re.findall(r">H0 Zoomed", dom)) == 2
    assert len(re.findall(r"<canvas[^>]*height=\"[1-9]", dom)) == 2 * (model.cfg.n_heads + 1)  # thumbnails + zoom
    blank = write_attention_page(model, PROMPT, 2, tmp_path / "blank.html", str_tokens=[""] * len(PROMPT.split()))
    shots = []
    for html_page in (page, blank):
        render(html_page, f"--screenshot={html_page.with_suffix('.png')}")
        shots.append(np.asarray(Image.open(html_page.with_suffix(".png")).convert("L"), dtype=float))
    differs = np.abs(shots[0] - shots[1]) > 40
    rows, cols = np.nonzero(differs)
    assert differs.sum() > 500  # the labels are drawn: the pages differ by their text alone
    assert cols.min() < shots[0].shape[1] * 0.25  # ... among them the query labels, left of the zoomed pattern


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_hook_attn_in_and_transformer_lens_input_names(models, name):
    """hook_attn_in: one copy per head for q, k and v together (TransformerLens' use_attn_in); the q/k/v forks
    answer to TransformerLens' names, blocks.{l}.hook_q_input, for hooks and cache lookups."""
    model = models[name]
    tokens = model.to_tokens(PROMPT) if model.tokenizer is not None else torch.randint(3, 50, (1, 9))
    reference, reference_cache = model.run_with_cache(tokens)
    delta = torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(0))

    def shift_head_2(copies, hook):
        copies[:, :, 2] += delta
        return copies

    model.set_use_attn_in(True)
    try:
        logits, cache = model.run_with_cache(tokens)
        with model.hooks(fwd_hooks=[("blocks.1.hook_attn_in", shift_head_2)]):
            _, patched = model.run_with_cache(tokens)
    finally:
        model.set_use_attn_in(False)
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)
    torch.testing.assert_close(cache["attn_in", 1][:, :, 0], reference_cache["resid_pre", 1])
    for act in ("q", "k", "v"):
        changed = (patched[act, 1] - reference_cache[act, 1]).abs().amax((0, 1, 3))
        assert changed[2] > 1e-3 and (changed[[0, 1]] == 0).all(), act  # head 2 alone
    model.set_use_split_qkv_input(True)
    try:
        seen = []
        model.run_with_hooks(tokens, fwd_hooks=[(get_act_name("q_input", 1), lambda x, hook: seen.append(hook.name))])
        _, cache = model.run_with_cache(tokens)
    finally:
        model.set_use_split_qkv_input(False)
    assert seen == ["blocks.1.attn.hook_q_input"]
    torch.testing.assert_close(cache["q_input", 1], cache["blocks.1.attn.hook_q_input"])
    torch.testing.assert_close(cache["blocks.1.hook_k_input"], cache["blocks.1.attn.hook_k_input"])


def test_composition_scores_and_padded_batches_match_transformer_bridge(pythia_dir):
    """TransformerLens' own TransformerBridge on the same tiny Pythia: the same composition scores, and for text
    padded on either side the same logits at the real positions and the same loss."""
    from transformer_lens.model_bridge import TransformerBridge

    ours = HookedDCFormer.from_pretrained(pythia_dir)
    bridge = TransformerBridge.boot_transformers(str(pythia_dir), device="cpu")
    for mode in "QKV":
        torch.testing.assert_close(ours.all_composition_scores(mode).scores, bridge.all_composition_scores(mode).scores)
    assert ours.all_head_labels == bridge.all_head_labels
    texts = [PROMPT, "Ruth owns a cat ."]
    for side in ("left", "right"):
        real = ours.to_tokens(texts, padding_side=side) != ours.tokenizer.pad_token_id
        torch.testing.assert_close(ours(texts, padding_side=side)[real], bridge(texts, padding_side=side)[real])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ours says that right padding counts the pads, as the bridge does
            ours_loss = ours(texts, padding_side=side, return_type="loss")
        torch.testing.assert_close(ours_loss, bridge(texts, padding_side=side, return_type="loss"))
