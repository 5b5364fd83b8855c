"""Which path computes each attention call (dcinterp.dcmha.choose_path), and that every path computes the same z.

- the rules, one case each: a hook on each square tensor, a functorch transform, a cached decoding step, CPU and
  CUDA (a device object: no GPU is needed to choose), the Triton kernels available or not (one warning per reason);
- through the model: the path each layer took (`Attention.path_for`, recorded at the dispatch);
- the Triton path's plumbing on this CPU: a stand-in `maps` (the fused kernels' module) whose `fused_dcmha` is the
  float64-checked materialised formula built from the kernel's own arguments (window, semantics, past, real), with
  a backward that refuses `create_graph`, as the real kernels' does; the model on "CUDA" then equals the materialised
  path, forward, gradients, padding, the cache, and second derivatives (which fall back on `materialised.attend`);
- plain MHA by `scaled_dot_product_attention` against the einsum-softmax path: causal, local windows of both
  semantics, left padding, the key-value cache in chunks, float32 judged by float64 (tests/numerics.py).
"""

import copy
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

import dcinterp.dcmha as dcmha
from dcinterp import DCFormerConfig, HookedDCFormer, devices
from dcinterp.dcmha import materialised
from dcinterp.kv_cache import DCFormerKeyValueCache
from dcinterp.model import attention_mask
from tests.numerics import assert_as_exact_as, float64_copy, hessian_vector_product
from tests.told_cuda import forget_refusals

FIXTURES = Path(__file__).parent / "fixtures"
CPU, CUDA = torch.device("cpu"), torch.device("cuda")
GiB = 2**30
ROOM = int(dcmha.MATERIALISED_MEMORY_FRACTION * GiB)  # what the materialised path may keep of 1 GiB free
SQUARE_HOOKS = [
    "hook_attn_scores",
    "hook_composed_scores",
    "hook_pattern",
    "hook_composed_pattern",
    *(f"{stage}_compose.hook_o_{b}" for stage in ("pre", "post") for b in ("qp", "kp", "qg", "kg")),
]


@pytest.fixture
def kernels(monkeypatch):
    """A stand-in for the fused kernels' module, dcinterp.dcmha.maps: available (its `reason` None) or not, its
    `fused_dcmha` the materialised formula. Its calls are recorded."""
    module = types.ModuleType("dcinterp.dcmha.maps")
    module.reason = None
    module.calls = []
    module.available = lambda device: module.reason

    def fused_dcmha(q, k, v, pre, post, *, window, official, past=0, real=None, fallback=None):
        module.calls.append(dict(queries=q.shape[1], keys=k.shape[1], window=window, past=past, real=real))
        semantics = "official-inference" if official else "training"
        mask = attention_mask(q.shape[1], window, q.device, q.dtype, semantics, past, real)
        weights = [w for stage in (pre, post) for w in (stage or (None,) * 6)]
        return FirstOrderOnly.apply(mask, fallback, module.refusal, q, k, v, *weights)

    module.refusal = None  # an error the stand-in's backward takes as Triton refusing the backward's kernels
    module.fused_dcmha = fused_dcmha
    monkeypatch.setitem(sys.modules, "dcinterp.dcmha.maps", module)
    monkeypatch.setattr(dcmha, "maps", module, raising=False)
    forget_refusals(monkeypatch)
    return module


@pytest.fixture
def card_memory(monkeypatch):
    """The card's free memory as `dcinterp.devices.free_memory` gives it (80 GiB unless a test sets `.free`), only ever
    asked of CUDA; `.asked` counts the calls."""
    card = types.SimpleNamespace(free=80 * GiB, asked=0)

    def free_memory(device):
        assert torch.device(device).type == "cuda"
        card.asked += 1
        return card.free

    monkeypatch.setattr(devices, "free_memory", free_memory)
    return card


class FirstOrderOnly(torch.autograd.Function):
    """`materialised.attend` with the real kernels' backward contract: first order, and where that cannot be had
    (create_graph=True, or `refusal` given: Triton refusing the backward's kernels) `fallback`'s gradients, or an
    error without one."""

    @staticmethod
    def forward(ctx, mask, fallback, refusal, q, k, v, *weights):
        ctx.mask, ctx.fallback, ctx.refusal = mask, fallback, refusal
        ctx.save_for_backward(q, k, v, *weights)
        with torch.no_grad():
            return materialised.attend(q, k, v, mask, *restage(weights))

    @staticmethod
    def backward(ctx, gz):
        q, k, v, *weights = ctx.saved_tensors
        if torch.is_grad_enabled() or ctx.refusal is not None:
            if ctx.fallback is None:
                raise ctx.refusal or RuntimeError("fused_dcmha: no second derivatives (create_graph=True)")
            return None, None, None, *ctx.fallback(ctx.refusal, gz, q, k, v, tuple(weights))
        inputs = [None if x is None else x.detach().requires_grad_(True) for x in (q, k, v, *weights)]
        with torch.enable_grad():
            z = materialised.attend(*inputs[:3], ctx.mask, *restage(inputs[3:]))
            live = [x for x in inputs if x is not None]
            grads = iter(torch.autograd.grad(z, live, gz, allow_unused=True))
        return None, None, None, *(None if x is None else next(grads) for x in inputs)


def restage(weights):
    """(pre, post) of the twelve weights, a stage None where every one of its weights is."""
    return tuple(None if all(w is None for w in stage) else tuple(stage) for stage in (weights[:6], weights[6:]))


@pytest.fixture
def paths(monkeypatch):
    """The path of every attention call, in order."""
    seen = []
    choose = dcmha.choose_path

    def spy(**facts):
        seen.append(choose(**facts))
        return seen[-1]

    monkeypatch.setattr(dcmha, "choose_path", spy)
    return seen


@pytest.fixture
def on_cuda(monkeypatch, paths):
    """choose_path told the tensors are on CUDA (they stay on this CPU): the Triton path's plumbing, testable here.
    The kernels then take every prompt and decoding step, whatever their length (the defaults are in test_the_rules)."""
    monkeypatch.setattr(dcmha, "FUSED_MIN_KEYS", 0)
    monkeypatch.setattr(dcmha, "FUSED_DECODING", True)
    choose = dcmha.choose_path
    monkeypatch.setattr(dcmha, "choose_path", lambda **facts: choose(**{**facts, "device": CUDA}))
    return paths


# The rules.


@pytest.mark.parametrize(
    "facts, cpu_path, cuda_path",
    [
        (dict(), "blocked", "triton"),
        (dict(square_tensor_read=True), "materialised", "materialised"),
        (dict(functorch_active=True), "materialised", "materialised"),
        (dict(cached_queries=1), "few_queries", "few_queries"),  # decoding: the kernels measured slower
        (dict(cached_queries=dcmha.FEW_QUERIES, keys=8192), "few_queries", "few_queries"),
        (dict(cached_queries=dcmha.FEW_QUERIES + 1), "blocked", "triton"),
        (dict(keys=dcmha.FUSED_MIN_KEYS - 1), "blocked", "materialised"),  # a short prompt: the kernels measured slower
        (dict(keys=dcmha.FUSED_MIN_KEYS), "blocked", "triton"),
        (dict(cached_queries=dcmha.FEW_QUERIES + 1, keys=dcmha.FUSED_MIN_KEYS - 1), "blocked", "materialised"),
        # with a gradient below FUSED_MIN_KEYS, what the materialised path keeps against the free memory (1 GiB here)
        (dict(keys=dcmha.FUSED_MIN_KEYS - 1, materialised_bytes=ROOM), "blocked", "materialised"),
        (dict(keys=dcmha.FUSED_MIN_KEYS - 1, materialised_bytes=ROOM + 1), "blocked", "triton"),
        (dict(keys=16, materialised_bytes=GiB, square_tensor_read=True), "materialised", "materialised"),
        (dict(keys=16, materialised_bytes=GiB, cached_queries=1), "few_queries", "few_queries"),
        (dict(dtype=torch.float64), "blocked", "materialised"),  # the kernels compute in float32, float16, bfloat16
        (dict(dtype=torch.bfloat16), "blocked", "triton"),
        (dict(dtype=torch.float64, cached_queries=1), "few_queries", "few_queries"),
        (dict(keys=16, gradient_needed=False), "blocked", "triton"),  # no gradient: the forward through the maps
        (dict(keys=dcmha.FUSED_MIN_KEYS - 1, gradient_needed=False), "blocked", "triton"),
        (dict(cached_queries=1, gradient_needed=False), "few_queries", "few_queries"),
        (dict(cached_queries=1, square_tensor_read=True), "materialised", "materialised"),
        (dict(padding_as_mask_only=True), "blocked", "materialised"),
        (dict(dcmha=False), "sdpa", "sdpa"),
        (dict(dcmha=False, square_tensor_read=True), "materialised", "materialised"),
        (dict(dcmha=False, functorch_active=True), "materialised", "materialised"),
    ],
)
def test_the_rules(kernels, card_memory, facts, cpu_path, cuda_path):
    card_memory.free = GiB
    facts = {"dcmha": True, "square_tensor_read": False, **facts}
    assert dcmha.choose_path(device=CPU, **facts) == cpu_path
    assert dcmha.choose_path(device=CUDA, **facts) == cuda_path
    other_path = "materialised" if cpu_path == "blocked" else cpu_path  # the blocked path is the CPU's alone
    assert dcmha.choose_path(device=torch.device("mps"), **facts) == other_path


def test_kernels_that_cannot_run_give_one_warning_per_reason_and_the_materialised_path(kernels):
    kernels.reason = "the card has 99 KiB of shared memory, the kernels need 160"
    facts = dict(dcmha=True, device=CUDA, square_tensor_read=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [dcmha.choose_path(**facts) for _ in range(3)] == ["materialised"] * 3
        assert dcmha.choose_path(**facts, cached_queries=1) == "few_queries"
        kernels.reason = "Triton 2.0 is too old"
        assert dcmha.choose_path(**facts) == "materialised"
    assert [str(w.message) for w in caught] == [
        "DCMHA on cuda takes the materialised path: the card has 99 KiB of shared memory, the kernels need 160",
        "DCMHA on cuda takes the materialised path: Triton 2.0 is too old",
    ]


def test_kernels_that_cannot_be_imported_are_not_available(monkeypatch):
    monkeypatch.setitem(sys.modules, "dcinterp.dcmha.maps", None)  # an import of it raises ImportError
    monkeypatch.delattr(dcmha, "maps", raising=False)
    forget_refusals(monkeypatch)
    assert dcmha.triton_unavailable(CUDA).startswith("the Triton kernels cannot be imported")
    with pytest.warns(UserWarning, match="DCMHA on cuda takes the materialised path: the Triton kernels cannot be"):
        assert dcmha.choose_path(dcmha=True, device=CUDA, square_tensor_read=False) == "materialised"


@pytest.mark.parametrize("before, after", [(None, "1"), ("1", None)])
def test_the_interpreter_switched_after_triton_was_imported_is_one_line(before, after):
    """TRITON_INTERPRET=1 set (or unset) after triton was imported: Triton's own functions (tl.sum, ...) were built
    the other way, and the kernels would fail deep inside Triton. The kernels are not available, and say why."""
    pytest.importorskip("triton")
    switch = "os.environ.pop('TRITON_INTERPRET', None)" if after is None else "os.environ['TRITON_INTERPRET'] = '1'"
    script = (
        f"import os, torch, triton\n{switch}\nimport dcinterp.dcmha as dcmha\n"
        "print(dcmha.triton_unavailable(torch.device('cpu')))\nprint(dcmha.triton_unavailable(torch.device('cuda')))"
    )
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    if before is not None:
        environment["TRITON_INTERPRET"] = before
    run = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    said = "set after triton was imported" if after == "1" else "unset after triton was imported under it"
    assert run.stdout.count(f"TRITON_INTERPRET=1 was {said}") == 2, run.stdout


# Through the model.


@pytest.fixture(scope="module")
def model():
    return HookedDCFormer.from_pretrained(FIXTURES / "dcformer-tiny")


@pytest.fixture(scope="module")
def model64(model):
    return float64_copy(model)


def tokens_for(model, batch=2, length=21, seed=0):
    return torch.randint(3, model.cfg.d_vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_a_forward_with_no_hook_is_blocked_on_the_cpu(model, paths):
    with torch.no_grad():
        model(tokens_for(model))
    assert paths == ["blocked"] * model.cfg.n_layers


@pytest.mark.parametrize("hook", SQUARE_HOOKS)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_hook_on_a_square_tensor_keeps_that_layer_materialised(model, hook, device, request):
    paths = request.getfixturevalue("paths" if device == "cpu" else "on_cuda")
    if device == "cuda":
        request.getfixturevalue("kernels")
    fast = "blocked" if device == "cpu" else "triton"
    with model.hooks(fwd_hooks=[(f"blocks.1.attn.{hook}", lambda x, hook: None)]), torch.no_grad():
        model(tokens_for(model))
    assert paths == [fast, "materialised", *[fast] * (model.cfg.n_layers - 2)]


def test_a_functorch_transform_keeps_the_materialised_path(model, paths):
    tokens = tokens_for(model, batch=1, length=6)
    embeddings = model.embed(tokens).detach()
    torch.func.grad(lambda x: model(x, start_at_layer=0)[0, -1, 0])(embeddings)
    assert set(paths) == {"materialised"}


def test_a_short_prompt_takes_the_kernels_without_gradients_only(model, kernels, card_memory, paths, monkeypatch):
    """On CUDA with the kernels (the default thresholds): a 12-token prompt takes the Triton path under no_grad (its
    forward through the maps) and the materialised one when a gradient is needed, to the input or to the weights;
    the free memory is asked only then."""
    choose = dcmha.choose_path
    monkeypatch.setattr(dcmha, "choose_path", lambda **facts: choose(**{**facts, "device": CUDA}))
    tokens = tokens_for(model, batch=1, length=12)
    n = model.cfg.n_layers
    model(tokens)  # the weights are frozen, as loaded: no gradient is needed
    assert card_memory.asked == 0
    embeddings = model.embed(tokens).detach().requires_grad_(True)
    model(embeddings, start_at_layer=0)  # a gradient to the input
    model.requires_grad_(True)
    try:
        model(tokens)  # gradients to the weights
    finally:
        model.requires_grad_(False)
    assert paths == ["triton"] * n + ["materialised"] * 2 * n
    assert card_memory.asked == 2 * n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_materialised_path_keeps_what_its_estimate_says(model, dtype):
    """With every branch on, the [b, h, t, s] tensors autograd keeps for a layer's backward on the materialised path
    are `materialised_saved_bytes`, byte for byte (distinct storages, counted as they are saved); with branches off,
    fewer."""
    b, t = 2, 48
    full = copy.deepcopy(model).to(dtype)
    cfg = copy.deepcopy(model.cfg)
    cfg.compose_branches = ("qp", "qg")  # the key side off
    query_side = HookedDCFormer(cfg).to(dtype)
    square = b * model.cfg.n_heads * t * t

    def kept(m):
        attn = m.blocks[1].attn.requires_grad_(True)
        x = torch.randn(b, t, m.cfg.d_model, dtype=dtype, generator=torch.Generator().manual_seed(0))
        q, k, v = (torch.randn(b, t, m.cfg.n_heads, m.cfg.d_head, dtype=dtype).requires_grad_() for _ in range(3))
        storages = {}

        def pack(tensor):
            if tensor.numel() >= square:
                storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            attn.materialised_z(x, q, k, v, attention_mask(t, attn.window, x.device, dtype))
        return sum(storages.values())

    estimate = dcmha.materialised_saved_bytes(b, model.cfg.n_heads, t, t, dtype)
    assert kept(full) == estimate
    assert 0 < kept(query_side) < estimate


def test_a_gradient_takes_the_kernels_in_the_layers_whose_materialised_tensors_would_not_fit(
    model, kernels, card_memory, paths, monkeypatch
):
    """Below FUSED_MIN_KEYS a gradient takes the materialised path while what it keeps for this layer and the layers
    after it takes at most MATERIALISED_MEMORY_FRACTION of the card's free memory: every layer on a large card, the
    kernels first and then the materialised path where the free memory fits fewer layers, the kernels everywhere on
    a small card."""
    choose = dcmha.choose_path
    monkeypatch.setattr(dcmha, "choose_path", lambda **facts: choose(**{**facts, "device": CUDA}))
    n, batch, length = model.cfg.n_layers, 2, 12
    layer = dcmha.materialised_saved_bytes(batch, model.cfg.n_heads, length, length, torch.float32)
    embeddings = model.embed(tokens_for(model, batch, length)).detach().requires_grad_(True)
    for layers_that_fit, expected in [
        (n, ["materialised"] * n),
        (2, ["triton"] * (n - 2) + ["materialised"] * 2),
        (0.99, ["triton"] * n),
    ]:
        card_memory.free = int(layers_that_fit * layer / dcmha.MATERIALISED_MEMORY_FRACTION)
        paths.clear()
        model(embeddings, start_at_layer=0)
        assert paths == expected, layers_that_fit


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_cache_takes_the_decoding_path_for_a_few_queries(model, device, request):
    paths = request.getfixturevalue("paths" if device == "cpu" else "on_cuda")
    if device == "cuda":
        request.getfixturevalue("kernels")
    tokens = tokens_for(model, length=40)
    cache = DCFormerKeyValueCache.init_cache(model.cfg, "cpu", batch_size=2)
    with torch.no_grad():
        for start, stop in ((0, 20), (20, 37), (37, 40)):  # 20, 17 (> FEW_QUERIES), 3 new queries
            model(tokens[:, start:stop], past_kv_cache=cache)
    n = model.cfg.n_layers
    if device == "cpu":
        assert paths == ["blocked"] * 2 * n + ["few_queries"] * n
    else:
        assert paths == ["triton"] * 3 * n


# The Triton path's plumbing (a stand-in kernel).


def run(model, tokens, mask=None, chunks=None):
    """Logits (through the cache in `chunks`, if given) and the gradients of the loss to the embeddings and to
    every attention weight."""
    weights = [p for n, p in model.named_parameters() if ".attn." in n]
    for p in weights:
        p.requires_grad_(True)
    try:
        if chunks is None:
            embeddings = model.embed(tokens).detach().requires_grad_(True)
            logits = model(embeddings, start_at_layer=0, attention_mask=mask)
        else:
            cache = DCFormerKeyValueCache.init_cache(model.cfg, tokens.device, batch_size=tokens.shape[0])
            embeddings = model.embed(tokens).detach().requires_grad_(True)
            logits = torch.cat(
                [
                    model(embeddings[:, a:b], start_at_layer=0, attention_mask=mask[:, a:b], past_kv_cache=cache)
                    for a, b in chunks
                ],
                dim=1,
            )
        loss = logits.log_softmax(-1)[..., 5].sum()
        return tuple(x.cpu() for x in (logits.detach(), *torch.autograd.grad(loss, [embeddings, *weights])))
    finally:
        for p in weights:
            p.requires_grad_(False)


def all_branches_hooked(model):
    return model.hooks(fwd_hooks=[(lambda name: "hook_o_" in name, lambda x, hook: None)])


@pytest.mark.parametrize("case", ["prompt", "left padding", "cache, left padding", "official-inference"])
def test_the_triton_path_equals_the_materialised_path(model, model64, kernels, on_cuda, case, monkeypatch):
    tokens = tokens_for(model, length=26)
    mask = torch.ones_like(tokens)
    if "padding" in case:
        mask[1, :7] = 0
    chunks = [(0, 15), (15, 24), (24, 26)] if "cache" in case else None
    if case == "official-inference":
        monkeypatch.setattr(model.cfg, "window", "official-inference")
        monkeypatch.setattr(model64.cfg, "window", "official-inference")
    out = run(model, tokens, mask, chunks)
    assert set(on_cuda) == {"triton"} and len(kernels.calls) == len(on_cuda)
    windows = {call["window"] for call in kernels.calls}
    assert windows == {None, model.cfg.window_size}  # the local layers' windows reach the kernel
    if "padding" in case:
        assert all(call["real"] is not None and call["real"].shape == (2, call["keys"]) for call in kernels.calls)
    if chunks:
        assert [call["past"] for call in kernels.calls[:: model.cfg.n_layers]] == [0, 15, 24]
    with all_branches_hooked(model):
        reference = run(model, tokens, mask, chunks)
    with all_branches_hooked(model64):
        exact = run(model64, tokens, mask, chunks)
    assert set(on_cuda[len(kernels.calls) :]) == {"materialised"}
    for i, (a, b, c) in enumerate(zip(out, reference, exact, strict=True)):
        assert_as_exact_as(a, b, c, f"{case} [{i}]")


@pytest.fixture
def real_kernels(monkeypatch):
    """The Triton kernels themselves: natively with CUDA, else under Triton's interpreter (when TRITON_INTERPRET=1 was
    set before triton was imported, as tests/conftest.py sets it for the whole run on a machine without CUDA)."""
    maps = pytest.importorskip("dcinterp.dcmha.maps")
    reason = maps.available(CUDA if torch.cuda.is_available() else CPU)
    if reason is not None:
        pytest.skip(reason)
    monkeypatch.setattr(dcmha, "triton_unavailable", lambda device: None)
    return maps


@pytest.mark.parametrize("case", ["prompt, left padding", "cache"])
def test_the_real_kernels_through_the_model_equal_the_materialised_path(model, model64, real_kernels, on_cuda, case):
    """The model on the Triton path with the real kernels (not the stand-in): logits and every gradient. With CUDA
    the model runs on the GPU (natively compiled kernels), else on this CPU under the interpreter."""
    device = CUDA if torch.cuda.is_available() else CPU
    on_device = copy.deepcopy(model).to(device)
    tokens = tokens_for(model, length=20)
    mask = torch.ones_like(tokens)
    if "padding" in case:
        mask[1, :5] = 0
    chunks = [(0, 12), (12, 17), (17, 20)] if case == "cache" else None
    out = run(on_device, tokens.to(device), mask.to(device), chunks)
    assert set(on_cuda) == {"triton"}
    with all_branches_hooked(on_device):
        reference = run(on_device, tokens.to(device), mask.to(device), chunks)
    with all_branches_hooked(model64):
        exact = run(model64, tokens, mask, chunks)
    for i, (a, b, c) in enumerate(zip(out, reference, exact, strict=True)):
        assert_as_exact_as(a, b, c, f"{case} [{i}]")


def test_a_card_the_kernels_do_not_fit_gives_one_warning_and_the_materialised_result(model, model64, kernels, on_cuda):
    """Triton refusing to build the kernels for the card (here: past its shared memory) at their first launch: one
    warning, the call computed by the materialised formula, and later calls told the kernels are unavailable."""
    OutOfResources = pytest.importorskip("triton.runtime.errors").OutOfResources

    def refuse(*args, **kwargs):
        raise OutOfResources(232_000, 101_376, "shared memory")

    kernels.fused_dcmha = refuse
    tokens = tokens_for(model)
    with warnings.catch_warnings(record=True) as record, torch.no_grad():
        warnings.simplefilter("always")
        out = model(tokens)
    said = [str(w.message) for w in record if "materialised path" in str(w.message)]
    assert len(said) == 1 and "Triton cannot build the fused kernels for it (out of resource: shared memory" in said[0]
    assert dcmha.triton_unavailable(CPU) == said[0].split(": ", 1)[1]  # the device the tensors are on
    with all_branches_hooked(model), all_branches_hooked(model64), torch.no_grad():
        reference, exact = model(tokens), model64(tokens)
    assert_as_exact_as(out, reference, exact, "logits")


def test_a_card_the_backward_kernels_do_not_fit_gives_one_warning_and_the_materialised_gradients(
    model, model64, kernels, on_cuda
):
    """The forward's kernels built, the backward's refused at their first launch (as the first call with gradients
    launches them): one warning, the gradients of the materialised formula, no traceback from inside autograd."""
    OutOfResources = pytest.importorskip("triton.runtime.errors").OutOfResources

    kernels.refusal = OutOfResources(110_592, 101_376, "shared memory")
    tokens = tokens_for(model, length=12)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = run(model, tokens)
    said = [str(w.message) for w in record if "materialised path" in str(w.message)]
    assert len(said) == 1 and "Triton cannot build the fused kernels for it (out of resource: shared memory" in said[0]
    with all_branches_hooked(model), all_branches_hooked(model64):
        reference, exact = run(model, tokens), run(model64, tokens)
    for i, (a, b, c) in enumerate(zip(out, reference, exact, strict=True)):
        assert_as_exact_as(a, b, c, f"[{i}]")


def test_second_derivatives_on_the_triton_path_fall_back_on_the_materialised_formula(model, model64, kernels, on_cuda):
    """The kernels' backward refuses create_graph; a Hessian-vector product still equals the materialised one."""
    tokens = tokens_for(model, batch=1, length=12)
    direction = torch.randn((1, 12, model.cfg.d_model), generator=torch.Generator().manual_seed(0))

    def hvp(model):
        return hessian_vector_product(model, tokens, direction)

    with pytest.raises(RuntimeError, match="no second derivatives"):  # the stand-in kernel alone refuses
        q = torch.randn(1, 4, 2, 3, requires_grad=True)
        z = kernels.fused_dcmha(q, q, q, None, None, window=None, official=False)
        torch.autograd.grad(torch.autograd.grad(z.sum(), q, create_graph=True)[0].sum(), q)
    out = hvp(model)
    assert set(on_cuda) == {"triton"}
    with all_branches_hooked(model):
        reference = hvp(model)
    with all_branches_hooked(model64):
        exact = hvp(model64)
    assert_as_exact_as(out, reference, exact, "Hessian-vector product")


def test_a_hook_on_a_dynamic_weight_acts_on_the_triton_path(model, model64, kernels, on_cuda):
    tokens = tokens_for(model)
    edit = [("blocks.1.attn.pre_compose.hook_kw2", lambda x, hook: 3 * x)]
    with torch.no_grad(), model.hooks(fwd_hooks=edit), model64.hooks(fwd_hooks=edit):
        edited = model(tokens)
        assert set(on_cuda) == {"triton"}
        with all_branches_hooked(model), all_branches_hooked(model64):
            reference, exact = model(tokens), model64(tokens)
    assert_as_exact_as(edited, reference, exact, "logits")
    with torch.no_grad():
        assert (model(tokens) - edited).abs().max() > 1e-3  # the edit did something


# Plain MHA by scaled_dot_product_attention.


@pytest.fixture(scope="module")
def mha_models():
    """A plain-MHA model per window layout, and its float64 copy."""
    out = {}
    for name, window in {"global": {}, "windows": dict(window_type="LG", window_size=5)}.items():
        torch.manual_seed(0)
        cfg = DCFormerConfig(
            n_layers=2, d_model=32, n_heads=4, d_head=8, d_mlp=64, d_vocab=50, n_ctx=64, use_dcmha=False, **window
        )
        model = HookedDCFormer(cfg).eval().requires_grad_(False)
        out[name] = (model, float64_copy(model))
    return out


def pattern_hooked(model):
    return model.hooks(fwd_hooks=[(lambda name: name.endswith("hook_pattern"), lambda x, hook: None)])


@pytest.mark.parametrize("layout", ["global", "windows", "windows, official-inference"])
@pytest.mark.parametrize("case", ["prompt", "left padding", "cache", "cache, left padding"])
def test_plain_mha_by_sdpa_equals_the_einsum_path(mha_models, layout, case, paths, monkeypatch):
    model, model64 = mha_models[layout.split(",")[0]]
    if "official" in layout:
        monkeypatch.setattr(model.cfg, "window", "official-inference")
        monkeypatch.setattr(model64.cfg, "window", "official-inference")
    tokens = tokens_for(model, length=19)
    mask = torch.ones_like(tokens)
    if "padding" in case:
        mask[0, :6] = 0
    chunks = [(0, 8), (8, 18), (18, 19)] if "cache" in case else None
    out = run(model, tokens, mask, chunks)
    calls = len(paths)
    with pattern_hooked(model):
        reference = run(model, tokens, mask, chunks)
    with pattern_hooked(model64):
        exact = run(model64, tokens, mask, chunks)
    assert paths == ["sdpa"] * calls + ["materialised"] * 2 * calls
    for i, (a, b, c) in enumerate(zip(out, reference, exact, strict=True)):
        assert_as_exact_as(a, b, c, f"{layout}, {case} [{i}]")
