"""Generation with a key-value cache (dcinterp.kv_cache): the cached forward is the full forward's last rows, greedy
generation gives the same tokens with and without the cache, left-padded batches give what each prompt alone does.

Models: the official-format fixtures (DCPythia and DCFormer++ layouts, local windows of 8 keys), the embedded DCMHA
and MHA models (window 4), and random ones for what those lack: a GPT-NeoX layout (no QK-norm, partial rotary,
plain MHA) and DCMHA variants (query-wise only, pre-compose only).
"""

from pathlib import Path

import pytest
import torch

from dcinterp import DCFormerConfig, HookedDCFormer
from dcinterp.kv_cache import DCFormerKeyValueCache

FIXTURES = Path(__file__).parent / "fixtures"
SIZE = {
    "n_layers": 3,
    "d_model": 32,
    "n_heads": 4,
    "d_head": 8,
    "d_mlp": 64,
    "d_vocab": 50,
    "n_ctx": 64,
    "window_size": 5,
}
RANDOM = {
    "gpt-neox": {"use_dcmha": False, "use_qk_norm": False, "rotary_pct": 0.25, "window_type": None},
    "query-wise": {"query_wise": True, "window_type": "LGLL"},
    "pre-only": {"compose_stages": ("pre",), "window_type": "LG"},
}
MODELS = ["dcpythia-tiny", "dcformer-tiny", "dcpythia-synth", "pythia-synth", *RANDOM]


def load(name: str) -> HookedDCFormer:
    if name in RANDOM:
        torch.manual_seed(0)
        return HookedDCFormer(DCFormerConfig(**SIZE, **RANDOM[name])).eval()
    return HookedDCFormer.from_pretrained(FIXTURES / name if (FIXTURES / name).exists() else name)


@pytest.fixture(scope="module")
def models() -> dict[str, HookedDCFormer]:
    return {name: load(name) for name in MODELS}


def prompt(model: HookedDCFormer, batch: int = 2, length: int = 12, seed: int = 0) -> torch.Tensor:
    """Random ids (not the special ones), longer than every local window here (8, 5 or 4 keys)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.cfg.d_vocab, (batch, length), generator=generator)


@pytest.mark.parametrize("semantics", ["training", "official-inference"])
@pytest.mark.parametrize("name", MODELS)
def test_cached_greedy_generation_equals_the_uncached_one(models, name, semantics, monkeypatch):
    model = models[name]
    monkeypatch.setattr(model.cfg, "window", semantics)
    tokens = prompt(model)
    cached = model.generate(tokens, max_new_tokens=12, do_sample=False, stop_at_eos=False)
    uncached = model.generate(tokens, max_new_tokens=12, do_sample=False, stop_at_eos=False, use_past_kv_cache=False)
    assert torch.equal(cached, uncached)
    # every new token's logits: one cached step per token against the full forward of the whole sequence
    cache = DCFormerKeyValueCache.init_cache(model.cfg, "cpu", batch_size=2)
    with torch.no_grad():
        steps = [model(tokens, past_kv_cache=cache)]
        steps += [model(cached[:, [i]], past_kv_cache=cache) for i in range(tokens.shape[1], cached.shape[1] - 1)]
        full = model(cached[:, :-1])
    assert cache.n_tokens == cached.shape[1] - 1 and cache[0].past_keys.shape[1] == cached.shape[1] - 1
    assert (torch.cat(steps, dim=1) - full).abs().max() < 1e-4


@pytest.mark.parametrize("name", ["dcpythia-tiny", "dcformer-tiny", "gpt-neox"])
def test_forward_with_a_cache_is_the_full_forward_in_chunks(models, name):
    """Chunks of 1, 5 (few queries: the low-rank key side) and 20 positions (the fused compose) against the cache."""
    model = models[name]
    tokens = prompt(model, length=36)
    cache = DCFormerKeyValueCache.init_cache(model.cfg, "cpu", batch_size=2)
    with torch.no_grad():
        full = model(tokens)
        chunks = [model(tokens[:, a:b], past_kv_cache=cache) for a, b in [(0, 10), (10, 11), (11, 16), (16, 36)]]
    assert (torch.cat(chunks, dim=1) - full).abs().max() < 1e-4


def test_hooks_see_the_new_tokens_row(models):
    """With a cache, each [b, h, t, s] hook holds the new token's row over every key so far (masked as in the full
    forward), each per-position hook the new position; branch-output hooks switch the compose to per-branch tensors."""
    model = models["dcpythia-tiny"]
    tokens = prompt(model, length=14)
    rows = [
        "blocks.0.attn.hook_attn_scores",
        "blocks.0.attn.hook_pattern",
        "blocks.2.attn.hook_composed_pattern",
        "blocks.2.attn.pre_compose.hook_o_kp",
        "blocks.1.attn.post_compose.hook_o_kg",
    ]  # [b, h, t, s]
    positions = ["blocks.1.attn.pre_compose.hook_kw1", "blocks.3.attn.hook_rot_k", "blocks.3.hook_resid_post"]
    _, full = model.run_with_cache(tokens, names_filter=rows + positions)
    cache = DCFormerKeyValueCache.init_cache(model.cfg, "cpu", batch_size=2)
    with torch.no_grad():
        model(tokens[:, :-1], past_kv_cache=cache)
    _, step = model.run_with_cache(tokens[:, -1:], names_filter=rows + positions, past_kv_cache=cache)
    for name in rows + positions:
        expected = full[name][:, :, -1:] if name in rows else full[name][:, -1:]
        assert step[name].shape == expected.shape, name
        assert (step[name] - expected).abs().max() < 1e-5, name


def test_a_hook_on_the_key_side_is_what_the_cache_keeps(models):
    """A hook's output on a new position's key-side compose weights is cached: later tokens read the patched value,
    as with a patched key in TransformerLens."""
    model = models["dcpythia-synth"]
    tokens = prompt(model, batch=1, length=8)
    zero_kg = ("blocks.1.attn.post_compose.hook_kg", lambda kg, hook: 0 * kg)
    with model.hooks(fwd_hooks=[zero_kg]):
        cached = model.generate(tokens, max_new_tokens=5, do_sample=False, stop_at_eos=False)
        full = model(cached)
    cache = DCFormerKeyValueCache.init_cache(model.cfg, "cpu")
    with model.hooks(fwd_hooks=[zero_kg]), torch.no_grad():
        model(cached[:, :-1], past_kv_cache=cache)
    assert cache[1].past_key_compose("post")["kg"].abs().max() == 0
    with model.hooks(fwd_hooks=[zero_kg]), torch.no_grad():
        assert (model(cached[:, -1:], past_kv_cache=cache)[:, -1] - full[:, -1]).abs().max() < 1e-4
        uncached = model.generate(tokens, max_new_tokens=5, do_sample=False, stop_at_eos=False, use_past_kv_cache=False)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("name", ["dcpythia-tiny", "dcformer-tiny", "pythia-synth", "gpt-neox"])
def test_left_padding_gives_each_prompt_alone(models, name):
    model = models[name]
    long, short = prompt(model, batch=1, length=13, seed=1), prompt(model, batch=1, length=9, seed=2)
    padded = torch.cat([long, torch.cat([torch.zeros(1, 4, dtype=torch.long), short], dim=1)])
    mask = torch.ones_like(padded)
    mask[1, :4] = 0
    with torch.no_grad():
        logits = model(padded, attention_mask=mask)
        assert (logits[0] - model(long)[0]).abs().max() < 1e-4
        assert (logits[1, 4:] - model(short)[0]).abs().max() < 1e-4
    for use_cache in (True, False):
        out = model.generate(
            padded,
            attention_mask=mask,
            max_new_tokens=10,
            do_sample=False,
            stop_at_eos=False,
            use_past_kv_cache=use_cache,
        )
        alone = [model.generate(p, max_new_tokens=10, do_sample=False, stop_at_eos=False) for p in (long, short)]
        assert torch.equal(out[0], alone[0][0]) and torch.equal(out[1, 4:], alone[1][0])


def test_a_list_of_prompts_is_padded_on_the_left(models):
    model = models["dcpythia-synth"]
    texts = ["Michelle has a burger . Michelle owns a kind of", "Ruth owns a cat ."]
    together = model.generate(texts, max_new_tokens=6, do_sample=False, stop_at_eos=False)
    alone = [model.generate(text, max_new_tokens=6, do_sample=False, stop_at_eos=False) for text in texts]
    assert together == alone
    model.tokenizer.padding_side = "left"  # the forward then reads a mask off the pads; generate gives its own
    try:
        for use_past_kv_cache in (True, False):
            kwargs = dict(max_new_tokens=6, do_sample=False, stop_at_eos=False, use_past_kv_cache=use_past_kv_cache)
            assert model.generate(texts, **kwargs) == alone
    finally:
        model.tokenizer.padding_side = "right"


def test_stop_at_eos_sampling_and_a_frozen_cache(models):
    model = models["dcformer-tiny"]
    tokens = prompt(model, batch=1)
    greedy = model.generate(tokens, max_new_tokens=6, do_sample=False, stop_at_eos=False)
    third = int(greedy[0, 14])
    stopped = model.generate(tokens, max_new_tokens=6, do_sample=False, eos_token_id=[third, 10**6])
    assert torch.equal(stopped, greedy[:, : 13 + greedy[0, 12:].tolist().index(third)])
    torch.manual_seed(0)
    sampled = model.generate(tokens.repeat(4, 1), max_new_tokens=4, temperature=3.0, top_p=0.9, stop_at_eos=False)
    torch.manual_seed(0)
    again = model.generate(
        tokens.repeat(4, 1), max_new_tokens=4, temperature=3.0, top_p=0.9, stop_at_eos=False, use_past_kv_cache=False
    )
    assert torch.equal(sampled, again)
    # a frozen cache: two continuations of one cached prefix, the cache unchanged
    cache = DCFormerKeyValueCache.init_cache(model.cfg, "cpu")
    with torch.no_grad():
        model(tokens, past_kv_cache=cache)
        cache.freeze()
        a, b = (model(torch.tensor([[t]]), past_kv_cache=cache)[0, -1] for t in (5, 6))
        assert cache.n_tokens == 12 and cache[2].past_values.shape[1] == 12
        assert (a - model(torch.cat([tokens, torch.tensor([[5]])], 1))[0, -1]).abs().max() < 1e-4
        assert (b - model(torch.cat([tokens, torch.tensor([[6]])], 1))[0, -1]).abs().max() < 1e-4


def test_a_cache_for_another_batch_is_one_clear_error(models):
    model = models["dcpythia-tiny"]
    cache = DCFormerKeyValueCache.init_cache(model.cfg, "cpu", batch_size=3)
    with pytest.raises(ValueError, match="cache holds a batch of 3, the input has 2 rows"):
        model(prompt(model), past_kv_cache=cache)


def test_generate_matches_transformer_lens_on_the_same_pythia(tmp_path):
    """TransformerLens' own TransformerBridge.generate (with its key-value cache) on a tiny Pythia saved by
    `transformers`: the same greedy tokens, for one prompt and for a list of prompts padded on the left."""
    from transformer_lens.model_bridge import TransformerBridge

    from tests.test_transformer_lens import PROMPT, save_tiny_pythia

    directory = save_tiny_pythia(tmp_path / "pythia")
    ours = HookedDCFormer.from_pretrained(directory)
    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu")
    tokens = ours.to_tokens(PROMPT)
    options = {"do_sample": False, "stop_at_eos": False, "verbose": False}
    assert torch.equal(
        ours.generate(tokens, max_new_tokens=8, **options), bridge.generate(tokens, max_new_tokens=8, **options)
    )
    texts = [PROMPT, "Ruth owns a cat ."]
    assert ours.generate(texts, max_new_tokens=6, **options) == bridge.generate(texts, max_new_tokens=6, **options)


def test_empty_prompts_are_one_line():
    model = HookedDCFormer.from_pretrained("dcpythia-synth")
    with pytest.raises(ValueError, match="generate: the prompt has no tokens"):
        model.generate("", max_new_tokens=2, verbose=False)
    with pytest.raises(ValueError, match="to_tokens: no text"):
        model.to_tokens([])
