"""The blocked DCMHA path (dcinterp.dcmha.blocked): what a forward with nothing on a [b, h, t, s] tensor runs on a CPU.

Against the materialised path (an identity hook on every compose branch output, so that each branch is its own
tensor, as run_with_cache computes them), on every model shape (parallel DCPythia and sequential DCFormer++ blocks,
windows of both semantics, QK-norm or none, mgate, switched-off branches and stages, rank 3):
- each attention layer on the same inputs, alone, with left padding and with the key-value cache: its output, and
  the gradients to its input and its weights;
- the whole model: logits, every layer's z, gradients to an input, to the activations and to the weights (and
  through the cache in chunks);
in float32 by the float64-judged rule of tests/numerics.py (the blocked path at most a few times as far from the
materialised path's float64 result as the materialised path's own float32 result), and in float16 and bfloat16
within the materialised path's own distance from float32.
Blocks are made small (5 queries), so that a prompt spans several blocks, a partial last one, and key ranges that
start inside a local window. The blocked function itself is checked against a dense float64 formula and by
gradcheck, and its blocks against the keys each query sees.
"""

from pathlib import Path

import pytest
import torch

import dcinterp.dcmha.blocked as blocked
from dcinterp import DCFormerConfig, HookedDCFormer
from dcinterp.kv_cache import DCFormerKeyValueCache
from dcinterp.model import attention_mask, visible_keys
from tests.numerics import assert_as_exact_as, float64_copy, hessian_vector_product

FIXTURES = Path(__file__).parent / "fixtures"
SIZE = dict(n_layers=2, d_model=32, n_heads=4, d_head=8, d_mlp=64, d_vocab=50, n_ctx=96, window_size=7)
RANDOM = {
    "mgate": dict(normalization_type="RMS", parallel_residual=False, act_fn="swiglu", mgate_dim=4, window_type="LG"),
    "no-qk-norm-no-bias": dict(use_qk_norm=False, use_bias=False, window_type=None),
    "query-wise": dict(query_wise=True, window_type="GL"),
    "pre-only": dict(compose_stages=("pre",), window_type="LG"),
    "some-branches": dict(compose_branches=("qp", "kg"), window_type="LG"),
    "rank-3": dict(dcmha_rank=3, window_type="LG"),
}
MODELS = ["dcpythia-tiny", "dcformer-tiny", "official-inference", *RANDOM]
T = 23


def load(name: str) -> HookedDCFormer:
    if name in RANDOM:
        torch.manual_seed(0)
        model = HookedDCFormer(DCFormerConfig(**SIZE, **RANDOM[name])).eval().requires_grad_(False)
        with torch.no_grad():  # the official initialisation's compose is tiny: make every branch matter
            for block in model.blocks:
                block.attn.W_dyn_out.normal_(0, 0.3)
                block.attn.W_dyn_gate.normal_(0, 0.3)
        return model
    model = HookedDCFormer.from_pretrained(FIXTURES / ("dcpythia-tiny" if name == "official-inference" else name))
    if name == "official-inference":
        model.cfg.window = "official-inference"
    return model


@pytest.fixture(scope="module")
def models() -> dict[str, HookedDCFormer]:
    return {name: load(name) for name in MODELS}


@pytest.fixture(scope="module")
def models64(models) -> dict[str, HookedDCFormer]:
    """The same models in float64: the reference for float32 rounding."""
    return {name: float64_copy(model) for name, model in models.items()}


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(blocked, "TILE_ELEMENTS", 1)
    monkeypatch.setattr(blocked, "MIN_BLOCK", 5)


@pytest.fixture
def calls(monkeypatch) -> list:
    """The blocked path's calls, one per layer that took it."""
    seen = []
    original = blocked.blocked_dcmha

    def spy(*args, **kwargs):
        seen.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(blocked, "blocked_dcmha", spy)
    return seen


def tokens_for(model, batch=2, length=T, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.cfg.d_vocab, (batch, length), generator=generator)


def materialised(model):
    """Every compose branch output through an identity hook: the materialised path of every layer."""
    return model.hooks(fwd_hooks=[(lambda name: "hook_o_" in name, lambda x, hook: None)])


def forward_and_z(model, *args, **kwargs):
    """Logits and every layer's hook_z (a hook there leaves the blocked path on)."""
    z = {}

    def keep(x, hook):
        z[hook.name] = x.detach().clone()

    with model.hooks(fwd_hooks=[(lambda name: name.endswith("hook_z"), keep)]), torch.no_grad():
        return model(*args, **kwargs), z


def largest(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def assert_paths_agree(blocked_out, materialised_out, exact_out, what=""):
    """Each tensor of the blocked path's output (a tensor, or a tuple, list or dict of them) as near float64 as the
    materialised path's (tests/numerics.py)."""
    if isinstance(exact_out, dict):
        assert blocked_out.keys() == materialised_out.keys() == exact_out.keys()
        for key in exact_out:
            assert_as_exact_as(blocked_out[key], materialised_out[key], exact_out[key], f"{what} {key}")
    elif isinstance(exact_out, (tuple, list)):
        assert len(blocked_out) == len(materialised_out) == len(exact_out)
        for i, (a, b, c) in enumerate(zip(blocked_out, materialised_out, exact_out, strict=True)):
            assert_paths_agree(a, b, c, f"{what}[{i}]")
    else:
        assert_as_exact_as(blocked_out, materialised_out, exact_out, what)


def materialised_pair(model, model64, compute):
    """compute(model) by the materialised path in float32, and in float64."""
    with materialised(model):
        reference = compute(model)
    with materialised(model64):
        exact = compute(model64)
    return reference, exact


@pytest.mark.parametrize("name", MODELS)
def test_forward_equals_the_materialised_path(models, models64, name, calls):
    model = models[name]
    tokens = tokens_for(model)
    out = forward_and_z(model, tokens)
    assert len(calls) == model.cfg.n_layers  # every layer went through the blocked path
    reference, exact = materialised_pair(model, models64[name], lambda m: forward_and_z(m, tokens))
    assert len(calls) == model.cfg.n_layers  # and none with the hooks on
    assert_paths_agree(out, reference, exact, name)


def input_and_weight_grads(model, tokens, attention_mask=None):
    """The loss's gradient to the embeddings (a leaf, as integrated gradients takes it) and to every parameter of
    the attention layers."""
    weights = [p for n, p in model.named_parameters() if ".attn." in n]
    for p in weights:
        p.requires_grad_(True)
    try:
        embeddings = model.embed(tokens).detach().requires_grad_(True)
        loss = model(embeddings, start_at_layer=0, tokens=tokens, attention_mask=attention_mask, return_type="loss")
        return torch.autograd.grad(loss, [embeddings, *weights])
    finally:
        for p in weights:
            p.requires_grad_(False)


@pytest.mark.parametrize("name", MODELS)
def test_gradients_equal_the_materialised_path(models, models64, name, calls):
    model = models[name]
    tokens = tokens_for(model)
    grads = input_and_weight_grads(model, tokens)
    assert calls
    reference, exact = materialised_pair(model, models64[name], lambda m: input_and_weight_grads(m, tokens))
    assert_paths_agree(grads, reference, exact, name)
    assert grads[0].abs().max() > 0


def test_activation_gradients_equal_the_materialised_path(models, models64, calls):
    """With frozen weights and set_use_activation_grads, as attribution patching reads them."""
    model = models["dcformer-tiny"]
    tokens = tokens_for(model)

    def grads(model):
        kept = {}

        def keep(x, hook):
            kept[hook.name] = x.detach().clone()

        names = lambda name: name.endswith(("hook_resid_pre", "hook_q", "hook_v", "hook_kw1", "hook_qg"))  # noqa: E731
        model.set_use_activation_grads(True)
        try:
            with model.hooks(bwd_hooks=[(names, keep)]):
                model(tokens, return_type="loss").backward()
        finally:
            model.set_use_activation_grads(False)
        return kept

    blocked_grads = grads(model)
    assert len(calls) == model.cfg.n_layers
    reference, exact = materialised_pair(model, models64["dcformer-tiny"], grads)
    assert len(reference) == 7 * model.cfg.n_layers  # kw1 and qg of both stages
    assert_paths_agree(blocked_grads, reference, exact)


@pytest.mark.parametrize("name", ["dcpythia-tiny", "dcformer-tiny", "official-inference", "query-wise"])
def test_left_padding_equals_the_materialised_path(models, models64, name, calls):
    model = models[name]
    tokens = tokens_for(model, batch=3)
    mask = torch.ones_like(tokens)
    mask[1, :4] = 0
    mask[2, :11] = 0  # more pads than a window: a padded query sees itself alone

    def compute(model):
        return forward_and_z(model, tokens, attention_mask=mask), input_and_weight_grads(model, tokens, mask)

    out = compute(model)
    assert calls
    assert_paths_agree(out, *materialised_pair(model, models64[name], compute), name)


def layer_inputs(model, length, mask=None):
    """Every layer's normed attention input on a prompt (from the materialised path)."""
    tokens = tokens_for(model, length=length)
    with materialised(model):
        _, cache = model.run_with_cache(
            tokens, attention_mask=mask, names_filter=lambda n: n.endswith("ln1.hook_normalized")
        )
    return [cache[f"blocks.{l}.ln1.hook_normalized"] for l in range(model.cfg.n_layers)]


def run_layer(attn, x, mask, chunks, real=None):
    """The layer's output on x, given in chunks of positions against a key-value cache entry (one chunk: none), and
    the gradients of a fixed random projection of it to x and to the layer's weights."""
    from dcinterp.kv_cache import DCFormerKeyValueCacheEntry

    weights = [p for p in attn.parameters()]
    x = x.detach().requires_grad_(True)
    entry = DCFormerKeyValueCacheEntry() if len(chunks) > 1 else None
    outs = []
    for start, stop in chunks:
        n, cfg = stop - start, attn.cfg
        visible = None if real is None else real[:, :stop]
        chunk_mask = attention_mask(n, attn.window, "cpu", x.dtype, cfg.window, start, visible)
        positions = torch.arange(start, stop)
        if visible is not None:
            positions = (visible.cumsum(1) - 1).clamp_min(0)[:, start:]
        outs.append(attn(x[:, start:stop], chunk_mask, None, positions, entry))
    out = torch.cat(outs, dim=1)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    for p in weights:
        p.requires_grad_(True)
    try:
        grads = torch.autograd.grad((out * cotangent).sum(), [x, *weights], allow_unused=True)
    finally:
        for p in weights:
            p.requires_grad_(False)
    return out.detach(), [g for g in grads if g is not None]


LAYER_MODES = {  # chunks of a 38-token prompt, and whether row 1 is left-padded
    "prompt": ([(0, 38)], False),
    "left padding": ([(0, 38)], True),
    "cache": ([(0, 20), (20, 38)], False),
    "cache, left padding": ([(0, 17), (17, 38)], True),
}


@pytest.mark.parametrize("mode", LAYER_MODES)
@pytest.mark.parametrize("name", MODELS)
def test_each_layer_equals_the_materialised_path(models, models64, name, mode, calls):
    """Each attention layer alone on the same input: output and gradients. Chunks after the first run with the
    earlier keys (and their compose key side) from the cache; a row padded with 9 tokens on the left has queries
    that see themselves alone."""
    model = models[name]
    chunks, padded = LAYER_MODES[mode]
    real = None
    if padded:
        real = torch.ones(2, 38, dtype=torch.bool)
        real[1, :9] = False
    xs = layer_inputs(model, 38, None if real is None else real.long())
    for l, block in enumerate(model.blocks):
        out = run_layer(block.attn, xs[l], None, chunks, real)
        assert len(calls) == (l + 1) * len(chunks)
        with materialised(model):
            reference = run_layer(block.attn, xs[l], None, chunks, real)
        with materialised(models64[name]):
            exact = run_layer(models64[name].blocks[l].attn, xs[l].double(), None, chunks, real)
        assert len(calls) == (l + 1) * len(chunks)
        assert_paths_agree(out, reference, exact, f"{name} layer {l}")


@pytest.mark.parametrize("name", ["dcpythia-tiny", "dcformer-tiny", "official-inference", "pre-only"])
@pytest.mark.parametrize("padded", [False, True])
def test_the_cache_in_chunks_equals_the_materialised_full_forward(models, models64, name, padded, calls):
    """A prompt of 20 into the cache, then 18 tokens (both blocked, the second with 20 cached keys), then 3 (the
    decoding path): the full forward's rows."""
    model = models[name]
    tokens = tokens_for(model, length=41)
    mask = torch.ones_like(tokens)
    if padded:
        mask[1, :6] = 0
    cache = DCFormerKeyValueCache.init_cache(model.cfg, "cpu", batch_size=2)
    chunks = []
    with torch.no_grad():
        for start, stop in ((0, 20), (20, 38), (38, 41)):
            chunks.append(model(tokens[:, start:stop], attention_mask=mask[:, start:stop], past_kv_cache=cache))
    assert [shape[1] for shape in calls] == [20] * model.cfg.n_layers + [18] * model.cfg.n_layers
    reference, exact = materialised_pair(model, models64[name], lambda m: forward_and_z(m, tokens, attention_mask=mask))
    assert_paths_agree(torch.cat(chunks, dim=1), reference[0], exact[0], name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_as_close_to_float32_as_the_materialised_path(models, dtype, calls):
    """In float16 and bfloat16 the two paths round differently; the blocked one stays within the materialised
    path's own distance from float32 (times 1.5, plus a few units of the format), forward and gradients."""
    model = models["dcformer-tiny"]
    tokens = tokens_for(model, length=16)
    full = input_and_weight_grads(model, tokens)
    full_logits, _ = forward_and_z(model, tokens)
    low = HookedDCFormer(model.cfg, init=False)
    low.load_state_dict(model.state_dict())
    low = low.to(dtype).requires_grad_(False)
    logits, _ = forward_and_z(low, tokens)
    grads = input_and_weight_grads(low, tokens)
    with materialised(low):
        ref_logits, _ = forward_and_z(low, tokens)
        ref_grads = input_and_weight_grads(low, tokens)
    eps = torch.finfo(dtype).eps
    assert torch.isfinite(logits).all()
    assert largest(logits, full_logits) <= 1.5 * largest(ref_logits, full_logits) + 4 * eps
    for g, r, f in zip(grads, ref_grads, full, strict=True):
        scale = f.abs().max().item()
        assert torch.isfinite(g).all()
        assert largest(g, f) <= 1.5 * largest(r, f) + 4 * eps * scale


SQUARE_HOOKS = [
    "hook_attn_scores",
    "hook_composed_scores",
    "hook_pattern",
    "hook_composed_pattern",
    *(f"{stage}_compose.hook_o_{b}" for stage in ("pre", "post") for b in ("qp", "kp", "qg", "kg")),
]


@pytest.mark.parametrize("hook", SQUARE_HOOKS)
def test_a_hook_on_a_square_tensor_keeps_that_layer_materialised(models, hook, calls):
    """Only the hooked layer leaves the blocked path, and the hook sees what run_with_cache caches."""
    model = models["dcpythia-tiny"]
    tokens = tokens_for(model)
    name = f"blocks.1.attn.{hook}"
    seen = {}

    def keep(x, hook):
        seen[hook.name] = x.clone()

    with model.hooks(fwd_hooks=[(name, keep)]), torch.no_grad():
        logits = model(tokens)
    assert len(calls) == model.cfg.n_layers - 1
    cached_logits, cache = model.run_with_cache(tokens, names_filter=name)
    assert len(calls) == 2 * (model.cfg.n_layers - 1)  # run_with_cache of that hook alone: the same
    torch.testing.assert_close(seen[name], cache[name], rtol=0, atol=0)
    torch.testing.assert_close(logits, cached_logits, rtol=0, atol=0)  # the same paths


def test_a_hook_on_a_dynamic_weight_acts_in_the_blocked_path(models, models64, calls):
    """Weight hooks (hook_kw2, hook_qg, ...) stay on the blocked path, and what they return is what composes."""
    model = models["dcformer-tiny"]
    tokens = tokens_for(model)
    edits = [
        ("blocks.1.attn.pre_compose.hook_kw2", lambda x, hook: 3 * x),
        ("blocks.2.attn.post_compose.hook_qg", lambda x, hook: torch.zeros_like(x)),
    ]
    with model.hooks(fwd_hooks=edits), models64["dcformer-tiny"].hooks(fwd_hooks=edits):
        logits, _ = forward_and_z(model, tokens)
        assert len(calls) == model.cfg.n_layers
        reference, exact = materialised_pair(model, models64["dcformer-tiny"], lambda m: forward_and_z(m, tokens)[0])
    assert_paths_agree(logits, reference, exact)
    assert largest(logits, forward_and_z(model, tokens)[0]) > 1e-3  # the edits did something


def test_no_square_tensor_is_built_without_hooks(models, monkeypatch):
    import dcinterp.dcmha.materialised as materialised

    def fail(*args, **kwargs):
        raise AssertionError("a [b, h, t, s] compose ran with no hook attached")

    for name in ("branch_outputs", "compose_fused", "compose_few_queries"):
        monkeypatch.setattr(materialised, name, fail)
    with torch.no_grad():
        models["dcpythia-tiny"](tokens_for(models["dcpythia-tiny"]))


# The blocked function itself, in float64.


def dense(q, k, v, mask, pre, post, scale):
    """DCMHA with every [b, h, t, s] tensor: the formula of dcinterp.model's docstring."""

    def stage(X, W, kw1, kw2, kg):
        Y = X if W is None else torch.einsum("btmn,bnts->bmts", W, X)
        if kg is not None:
            Y = Y + X * kg[:, :, None, :]
        if kw1 is not None:
            hidden = torch.einsum("bnts,brns->brts", X, kw1)
            Y = Y + torch.einsum("brts,brms->bmts", hidden, kw2)
        return Y

    A = torch.einsum("bthe,bshe->bhts", q, k) * scale
    P = (stage(A, *pre) + mask).softmax(-1)
    return torch.einsum("bhts,bshe->bthe", stage(P, *post), v)


def random_case(official: bool, padded: bool, branches: str, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_(True)

    b, n, past, h, e, r, window = 2, 5, 2, 2, 3, 2, 3
    s = past + n
    real = None
    if padded:
        real = torch.ones(b, s, dtype=torch.bool)
        real[1, :3] = False
    mask = attention_mask(n, window, "cpu", torch.float64, "official-inference" if official else "training", past, real)
    stages = []
    for _ in range(2):
        W = randn(b, n, h, h) if "q" in branches else None
        kw1, kw2 = (randn(b, r, h, s), randn(b, r, h, s)) if "k" in branches else (None, None)
        kg = randn(b, h, s) if "g" in branches else None
        stages.append((W, kw1, kw2, kg))
    plan = blocked.Plan(past=past, window=window, extra=int(official), scale=0.5, area=1, min_block=2, max_block=2)
    return (randn(b, n, h, e), randn(b, s, h, e), randn(b, s, h, e)), mask, stages, plan


def of_inputs(mask, pre, post, plan):
    """blocked_dcmha as a function of (q, k, v, then every weight that is not None), as gradcheck calls it."""

    def f(*args):
        it = iter(args)
        q, k, v = next(it), next(it), next(it)
        pre_ = tuple(None if t is None else next(it) for t in pre)
        post_ = tuple(None if t is None else next(it) for t in post)
        return blocked.blocked_dcmha(q, k, v, mask, pre_, post_, plan)

    return f


@pytest.mark.parametrize("official", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("branches", ["qkg", "q", "kg", ""])
def test_blocked_function_equals_the_dense_formula_and_passes_gradcheck(official, padded, branches):
    (q, k, v), mask, (pre, post), plan = random_case(official, padded, branches)
    out = blocked.blocked_dcmha(q, k, v, mask, pre, post, plan)
    torch.testing.assert_close(out, dense(q, k, v, mask, pre, post, plan.scale), rtol=1e-12, atol=1e-12)
    inputs = [t for t in (q, k, v, *pre, *post) if t is not None]
    f = of_inputs(mask, pre, post, plan)

    # Every entry of the Jacobian in one case, a random projection of it (seeded) in the others.
    torch.manual_seed(0)
    full = branches == "qkg" and official and padded
    assert torch.autograd.gradcheck(f, inputs, atol=1e-8, rtol=1e-6, fast_mode=not full)


@pytest.mark.parametrize("semantics", ["training", "official-inference"])
@pytest.mark.parametrize("window", [None, 1, 4, 9])
@pytest.mark.parametrize("past", [0, 3, 20])
def test_blocks_leave_out_only_keys_no_query_of_the_block_sees(semantics, window, past):
    extra = int(semantics == "official-inference" and window is not None)
    for n, area, least, most in ((1, 1, 1, 1), (5, 1, 2, 2), (17, 1, 5, 5), (40, 60, 1, 16), (40, 200, 3, 50)):
        visible = visible_keys(n, window, "cpu", semantics, past)
        plan = blocked.Plan(past, window, extra, 1.0, area, least, most)
        covered = torch.zeros(n, dtype=torch.long)
        for t0, t1, s0, s1 in plan.blocks(n):
            assert not visible[t0:t1, :s0].any() and not visible[t0:t1, s1:].any()
            assert visible[t0:t1, s0].any() and visible[t0:t1, s1 - 1].any()  # and no more than they need
            assert least <= t1 - t0 <= most or t1 == n
            assert (t1 - t0) * (s1 - s0) <= area or t1 - t0 <= least  # within the area, unless at the least
            covered[t0:t1] += 1
        assert (covered == 1).all()


def test_blocks_on_two_threads_give_what_one_thread_gives(models, models64, calls):
    """With two torch threads the blocks run on two Python threads, each op on one core: the forward is the same
    bit for bit, the gradients (summed over blocks in another order) the same within float32 rounding, and the
    thread count is restored."""
    model = models["dcformer-tiny"]
    tokens = tokens_for(model, length=38)
    one = forward_and_z(model, tokens)[0], input_and_weight_grads(model, tokens)
    torch.set_num_threads(2)
    try:
        two = forward_and_z(model, tokens)[0], input_and_weight_grads(model, tokens)
        with torch.inference_mode():  # as synth eval runs (grad and inference modes are per thread)
            inference = model(tokens)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)
    assert torch.equal(one[0], two[0]) and torch.equal(one[0], inference)
    exact = materialised_pair(model, models64["dcformer-tiny"], lambda m: input_and_weight_grads(m, tokens))[1]
    assert_paths_agree(two[1], one[1], exact)


@pytest.mark.parametrize("branches", ["qkg", ""])
def test_second_derivatives_pass_gradgradcheck(branches):
    """Under create_graph=True (Hessian-vector products) the backward's gradients can be differentiated again."""
    (q, k, v), mask, (pre, post), plan = random_case(official=True, padded=True, branches=branches, seed=1)
    inputs = [t for t in (q, k, v, *pre, *post) if t is not None]
    f = of_inputs(mask, pre, post, plan)

    torch.manual_seed(0)
    assert torch.autograd.gradgradcheck(f, inputs, atol=1e-8, rtol=1e-6, fast_mode=True)


def test_a_hessian_vector_product_through_the_model_equals_the_materialised_paths(models, models64, calls):
    model = models["dcformer-tiny"]
    tokens = tokens_for(model, batch=1, length=12)
    direction = torch.randn((1, 12, model.cfg.d_model), generator=torch.Generator().manual_seed(0))

    def hvp(model):
        return hessian_vector_product(model, tokens, direction)

    blocked_hvp = hvp(model)
    assert calls, "the blocked path ran"
    assert_paths_agree(blocked_hvp, *materialised_pair(model, models64["dcformer-tiny"], hvp))


@pytest.mark.parametrize("name", MODELS)
def test_the_float64_reference_computes_in_float64(models64, name):
    """The run that judges the float32 ones is float64 throughout (norms, rotary, softmax, compose): its blocked and
    materialised paths agree to float64 rounding (they were 1e-8 apart when the norms and softmaxes were cast to
    float32), and every activation it caches is float64."""
    model = models64[name]
    tokens = torch.randint(0, model.cfg.d_vocab, (2, T), generator=torch.Generator().manual_seed(0))
    blocked_logits = model(tokens)  # no hook: the blocked path
    materialised_logits, cache = model.run_with_cache(tokens)  # every [b, h, t, s] hook: the materialised path
    torch.testing.assert_close(blocked_logits, materialised_logits, rtol=0, atol=1e-11)
    assert {activation.dtype for activation in cache.values()} == {torch.float64}
