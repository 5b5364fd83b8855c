"""Placing a model: devices, accelerate device maps with CPU and disk offload, and the run_with_cache guard."""

import pytest
import torch
from safetensors.torch import load_file

from dcinterp import CacheTooLarge, DCFormerKeyValueCache, HookedDCFormer, estimate_cache, memory
from dcinterp.attribution import head_attribution
from dcinterp.composition import compose_breakdown

FIXTURE = "tests/fixtures/dcpythia-tiny"
OFFLOADED = {
    "embed": "cpu",
    "blocks.0": "cpu",
    "blocks.1": "disk",
    "blocks.2": "cpu",
    "blocks.3": "disk",
    "ln_final": "cpu",
    "unembed": "cpu",
}


@pytest.fixture(scope="module")
def reference():
    return HookedDCFormer.from_pretrained(FIXTURE)


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory):
    return HookedDCFormer.from_pretrained(
        FIXTURE, device_map=OFFLOADED, offload_folder=tmp_path_factory.mktemp("offload")
    )


@pytest.fixture(scope="module")
def tokens():
    return load_file(f"{FIXTURE}/expected.safetensors")["input_ids"]


def test_offloaded_model_keeps_its_weights_on_disk(offloaded, tmp_path):
    assert offloaded.hf_device_map == OFFLOADED
    assert offloaded.blocks[1].attn.W_Q.device.type == "meta"  # read from the offload folder at each forward
    assert offloaded.blocks[0].attn.W_Q.device.type == "cpu"
    assert offloaded.cfg.device == "cpu"


def test_offloaded_model_gives_the_same_logits_and_cache(reference, offloaded, tokens):
    expected = load_file(f"{FIXTURE}/expected.safetensors")["logits"]
    torch.testing.assert_close(offloaded(tokens), reference(tokens), rtol=0, atol=0)
    assert (offloaded(tokens) - expected).abs().max() < 1e-4
    _, cache = reference.run_with_cache(tokens)
    _, offloaded_cache = offloaded.run_with_cache(tokens)
    assert set(cache.keys()) == set(offloaded_cache.keys())
    for name in cache.keys():
        torch.testing.assert_close(offloaded_cache[name], cache[name], rtol=0, atol=0, msg=name)


def test_hooks_intervene_on_an_offloaded_model(reference, offloaded, tokens):
    hook = ("blocks.3.attn.post_compose.hook_o_kp", lambda x, hook: 0 * x)
    torch.testing.assert_close(
        offloaded.run_with_hooks(tokens, fwd_hooks=[hook]),
        reference.run_with_hooks(tokens, fwd_hooks=[hook]),
        rtol=0,
        atol=0,
    )


def test_analyses_run_on_an_offloaded_model(reference, offloaded, tokens):
    a = compose_breakdown(reference, tokens[0], layer=3, query_pos=20, key_pos=17)
    b = compose_breakdown(offloaded, tokens[0], layer=3, query_pos=20, key_pos=17)
    torch.testing.assert_close(b.composed, a.composed, rtol=0, atol=0)
    torch.testing.assert_close(b.o_kp, a.o_kp, rtol=0, atol=0)
    ig_a = head_attribution(reference, tokens[:1], target=5, n_steps=4)
    ig_b = head_attribution(offloaded, tokens[:1], target=5, n_steps=4)
    torch.testing.assert_close(ig_b.scores, ig_a.scores, rtol=1e-6, atol=1e-7)


def test_auto_device_map_on_a_cpu_only_machine_places_everything_on_the_cpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    model = HookedDCFormer.from_pretrained(FIXTURE, device_map="auto")
    assert {p.device.type for p in model.parameters()} == {"cpu"}


def test_bad_device_and_device_map_are_one_line_errors():
    with pytest.raises(ValueError, match=r"device_map: 'blocks.9' is not a module of the model"):
        HookedDCFormer.from_pretrained(FIXTURE, device_map={"blocks.9": "cpu"})
    with pytest.raises(ValueError, match=r"device_map does not place weight 'blocks.1.ln1.w'"):
        HookedDCFormer.from_pretrained(FIXTURE, device_map={"embed": "cpu", "blocks.0": "cpu"})
    with pytest.raises(ValueError, match=r"offload_folder"):
        HookedDCFormer.from_pretrained(FIXTURE, device_map=OFFLOADED)
    with pytest.raises(ValueError, match=r"^device 'gpu0' is not a torch device; available: cpu"):
        HookedDCFormer.from_pretrained(FIXTURE, device="gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(
            ValueError,
            match=r"^device 'cuda' is not available on this machine \(torch .* has no "
            r"CUDA support\); available: cpu$",
        ):
            HookedDCFormer.from_pretrained(FIXTURE, device="cuda")


def test_half_precision_on_the_cpu_says_so_in_one_line():
    with pytest.warns(UserWarning, match="bfloat16 on the CPU"):
        HookedDCFormer.from_pretrained(FIXTURE, dtype=torch.bfloat16)


# --------------------------------------------------------------------------------------------------
# The cache estimate and the guard
@pytest.mark.parametrize("name", ["tests/fixtures/dcpythia-tiny", "tests/fixtures/dcformer-tiny", "pythia-synth"])
def test_estimate_cache_is_exact(name):
    model = HookedDCFormer.from_pretrained(name)
    model.set_use_attn_result(True)
    model.set_use_split_qkv_input(True)
    model.set_use_hook_mlp_in(True)
    model.set_use_attn_in(True)
    try:
        tokens = torch.randint(0, 50, (2, 11))
        _, cache = model.run_with_cache(tokens)
        actual = {key: value.numel() * value.element_size() for key, value in cache.items()}
        assert estimate_cache(model, tokens).nbytes_by_hook == actual
        selected = lambda hook: hook.startswith("blocks.1.attn")  # noqa: E731
        _, cache = model.run_with_cache(tokens, names_filter=selected, incl_bwd=False)
        assert estimate_cache(model, tokens, selected).nbytes == sum(
            v.numel() * v.element_size() for v in cache.values()
        )
        past_kv_cache = DCFormerKeyValueCache.init_cache(model.cfg, model.input_device, batch_size=2)
        model(tokens, past_kv_cache=past_kv_cache)  # 11 positions cached, then 3 new ones
        estimate = estimate_cache(model, tokens[:, :3], past_kv_cache=past_kv_cache)
        _, cache = model.run_with_cache(tokens[:, :3], past_kv_cache=past_kv_cache)
        assert estimate.nbytes_by_hook == {key: value.numel() * value.element_size() for key, value in cache.items()}
        assert cache["blocks.0.attn.hook_pattern"].shape[-2:] == (3, 14)
    finally:
        model.set_use_attn_result(False)
        model.set_use_split_qkv_input(False)
        model.set_use_hook_mlp_in(False)
        model.set_use_attn_in(False)


def test_estimate_for_dcpythia_6_9b_at_2048_tokens():
    from dcinterp.loading import config_from_official
    from dcinterp.random_checkpoint import DCPYTHIA_6_9B

    with torch.device("meta"):
        model = HookedDCFormer(config_from_official(DCPYTHIA_6_9B, "config.json"), init=False)
    model.cfg.dtype = "bfloat16"
    full = estimate_cache(model, (1, 2048))
    # 42 hooks per layer (the QK-norm scales among them); 12 attention-sized: 4 score/pattern hooks and 4 branch
    # outputs in each of the 2 stages.
    attention_sized = 32 * 12 * 32 * 2048 * 2048 * 2
    assert full.n_tensors == 32 * 42 + 3 and full.nbytes > attention_sized
    one_layer = estimate_cache(model, (1, 2048), lambda name: name.startswith("blocks.16.attn"))
    assert one_layer.nbytes < full.nbytes / 30


def test_guard_refuses_an_oversized_cache_and_accepts_a_filtered_one(monkeypatch):
    model = HookedDCFormer.from_pretrained("dcpythia-synth")
    tokens = torch.randint(0, 100, (1, 64))
    full = estimate_cache(model, tokens).nbytes
    monkeypatch.setattr(memory, "free_memory", lambda device: full)  # the full cache would take all of it
    with pytest.raises(CacheTooLarge) as refused:
        model.run_with_cache(tokens)
    message = str(refused.value)
    assert "\n" not in message and f"{full / 2**30:.2f} GiB" in message and "names_filter" in message
    assert "allow_large_cache=True" in message
    _, cache = model.run_with_cache(tokens, names_filter=lambda name: name.startswith("blocks.2.attn"))
    assert len(cache) > 0
    _, cache = model.run_with_cache(tokens, allow_large_cache=True)
    assert sum(v.numel() * v.element_size() for v in cache.values()) == full
    model.cache_memory_fraction = None  # the guard switched off
    model.run_with_cache(tokens)


def test_a_cards_free_memory_counts_what_torchs_allocator_holds_unused(monkeypatch):
    """What the driver has free, and the blocks torch's caching allocator keeps after tensors are freed (reserved, not
    allocated), which the next tensors take first: without them a second call would see less room than the first."""
    GiB = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (3 * GiB, 80 * GiB))
    stats = {"reserved_bytes": {"all": {"current": 9 * GiB}}, "allocated_bytes": {"all": {"current": 4 * GiB}}}
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device: stats)
    fraction = 1.0
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: fraction, raising=False)
    assert memory.free_memory("cuda:0") == memory.free_memory(torch.device("cuda", 0)) == 8 * GiB
    fraction = 0.1  # the process may take 8 GiB of the card, and holds 4
    assert memory.free_memory("cuda:0") == 4 * GiB
    fraction, stats = 1.0, {}  # torch has not allocated on the card yet
    assert memory.free_memory("cuda:0") == 3 * GiB


# --------------------------------------------------------------------------------------------------
# On a GPU (run with the device tool; skipped on CPU-only machines such as CI's)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SPLIT = {
    "embed": 0,
    "blocks.0": 0,
    "blocks.1": "cpu",
    "blocks.2": 0,
    "blocks.3": "cpu",
    "ln_final": 0,
    "unembed": "cpu",
}


@needs_cuda
def test_split_across_the_gpu_and_the_cpu_gives_the_same_logits_and_cache(reference, tokens):
    on_gpu = HookedDCFormer.from_pretrained(FIXTURE, device="cuda")
    split = HookedDCFormer.from_pretrained(FIXTURE, device_map=SPLIT)
    assert split.blocks[1].attn.W_Q.device.type == "meta" and split.cfg.device == "cuda:0"
    torch.testing.assert_close(split(tokens), on_gpu(tokens), rtol=0, atol=0)
    torch.testing.assert_close(split(tokens).cpu(), reference(tokens), rtol=1e-4, atol=1e-4)
    _, cache = on_gpu.run_with_cache(tokens)
    _, split_cache = split.run_with_cache(tokens)
    for name in cache.keys():
        torch.testing.assert_close(split_cache[name], cache[name], rtol=0, atol=0, msg=name)
    a = compose_breakdown(on_gpu, tokens[0], layer=3, query_pos=20, key_pos=17)
    b = compose_breakdown(split, tokens[0], layer=3, query_pos=20, key_pos=17)
    torch.testing.assert_close(b.composed, a.composed, rtol=0, atol=0)


@needs_cuda
def test_auto_device_map_spills_to_the_cpu_under_max_memory(reference, tokens):
    model = HookedDCFormer.from_pretrained(FIXTURE, device_map="auto", max_memory={0: "200KB", "cpu": "1GB"})
    assert set(model.hf_device_map.values()) == {0, "cpu"}, model.hf_device_map
    torch.testing.assert_close(model(tokens).cpu(), reference(tokens), rtol=1e-4, atol=1e-4)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_on_the_gpu_loads_straight_to_it(reference, tokens, dtype):
    model = HookedDCFormer.from_pretrained(FIXTURE, dtype=dtype, device="cuda")
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("cuda", dtype)}
    logits = model(tokens.cuda()).float().cpu()
    assert (logits - reference(tokens)).abs().max() < (0.1 if dtype == torch.bfloat16 else 0.02)


@needs_cuda
def test_a_cards_free_memory_is_the_same_after_a_tensor_is_freed():
    """A freed tensor's memory stays with torch's caching allocator (the driver no longer counts it free); the free
    memory the dispatch and the cache guard ask counts it."""
    torch.cuda.empty_cache()  # no block kept from an earlier test for the tensor below to reuse
    before = memory.free_memory("cuda")
    tensor = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    assert memory.free_memory("cuda") <= before - tensor.nbytes + 2**20
    del tensor
    assert torch.cuda.mem_get_info()[0] <= before - 256 * 2**20 + 2**20  # still reserved by the allocator
    assert abs(memory.free_memory("cuda") - before) <= 2**20
    total = torch.cuda.mem_get_info()[1]
    torch.cuda.set_per_process_memory_fraction(0.25)
    try:
        assert memory.free_memory("cuda") == total // 4 - torch.cuda.memory_allocated()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
