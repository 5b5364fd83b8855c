"""A decoding step's pattern in two Triton launches (dcinterp/dcmha/decoding.py) against torch's ops in float64, and
the model's choice between them (`dcinterp.dcmha.few_queries.decoding_pattern_path`).

On a machine without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py
before triton is first imported). The model takes them only on CUDA: here the path's device check is told the tensors
are on CUDA (they stay on this CPU) and the real kernels run interpreted. Every comparison is judged against a float64
run of the same inputs (tests/numerics.py): the kernels' error at most a few times that of torch's ops in the same
dtype."""

import warnings

import pytest
import torch

pytest.importorskip("triton")

from hypothesis import given, seed, settings
from hypothesis import strategies as st

from dcinterp.dcmha import decoding, families, few_queries
from dcinterp.dcmha.decoding import fused_decoding_pattern, torch_decoding_pattern
from dcinterp.dcmha.jit import available
from tests.numerics import EPS32, assert_as_exact_as, float64_copy
from tests.test_decode_step import CASES, CHUNKS, cached_steps, every_square_tensor_hooked, load
from tests.told_cuda import CUDA, told_cuda
from tests.uninitialised import allocate_nan

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BRANCHES = ("qp", "kp", "qg", "kg")
HIDDEN = torch.finfo(torch.float32).min  # what the model's masks hold at a hidden key
DEFAULT_TILE = decoding.TILE

pytestmark = pytest.mark.skipif(available(DEVICE) is not None, reason=str(available(DEVICE)))


@pytest.fixture(autouse=True)
def memory_never_written_is_nan(monkeypatch):
    """Every allocation the kernels do not write holds NaN (tests/uninitialised.py)."""
    allocate_nan(monkeypatch)


@pytest.fixture(autouse=True)
def blocks_of_16_keys(monkeypatch):
    """Programs of 16 keys (the fewest), so that a few dozen keys make several blocks whose statistics combine;
    test_the_default_tile keeps the default."""
    monkeypatch.setattr(decoding, "TILE", 16)


def make_inputs(batch, heads, queries, keys, rank, pre="qp kp qg kg", post="qp kp qg kg", mask="padded", seed=0):
    """scores, mask and both stages in float64, on DEVICE. A stage's string names its branches that are on (None: the
    stage is off). `mask`: "causal-like" [t, s] (the last queries see more keys) or "padded" [b, 1, t, s] (the
    second row's first keys hidden as well)."""
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).to(DEVICE)

    scores = draw(batch, heads, queries, keys, scale=3.0)
    hidden = torch.arange(keys)[None, :] > torch.arange(keys - queries, keys)[:, None]  # [t, s]
    additive = torch.zeros(queries, keys, dtype=torch.float64).masked_fill(hidden, HIDDEN)
    if mask == "padded":
        additive = additive.expand(batch, 1, queries, keys).clone()
        additive[-1, :, :, : min(5, keys - 1)] = HIDDEN

    def stage(branches):
        if branches is None:
            return None
        on = branches.split()
        return (
            *((draw(batch, queries, rank, heads), draw(batch, queries, rank, heads)) if "qp" in on else (None, None)),
            *((draw(batch, rank, heads, keys), draw(batch, rank, heads, keys)) if "kp" in on else (None, None)),
            draw(batch, queries, heads, scale=0.5) if "qg" in on else None,
            draw(batch, heads, keys, scale=0.5) if "kg" in on else None,
        )

    return scores, additive.to(DEVICE), stage(pre), stage(post)


def cast(inputs, dtype):
    scores, mask, pre, post = inputs
    stages = [None if s is None else tuple(None if w is None else w.to(dtype) for w in s) for s in (pre, post)]
    return scores.to(dtype), mask.float(), *stages


def check(inputs, dtype=torch.float32, what=""):
    """The kernels against torch's ops in `dtype`, float64 the judge (half dtypes: a floor of 8 of their units)."""
    scale = 0.3
    exact = torch_decoding_pattern(*inputs, scale=scale)
    reference = torch_decoding_pattern(*cast(inputs, dtype), scale=scale)
    new = fused_decoding_pattern(*cast(inputs, dtype), scale=scale)
    assert new.dtype == dtype and new.shape == exact.shape
    floor = 16 if dtype == torch.float32 else 8 * torch.finfo(dtype).eps / EPS32
    assert_as_exact_as(new.float(), reference.float(), exact, what or str(dtype), factor=4, floor_eps=floor)


@pytest.mark.parametrize(
    "batch, heads, queries, keys, rank",
    [
        (2, 6, 1, 150, 2),  # heads not a power of two; keys not a multiple of the block
        (1, 32, 1, 300, 2),  # the released models' heads
        (2, 4, 16, 17, 1),  # FEW_QUERIES new queries, rank 1
        (1, 3, 2, 1, 2),  # one key
    ],
    ids=["6-heads", "32-heads", "16-queries-rank-1", "one-key"],
)
@pytest.mark.parametrize("mask", ["causal-like", "padded"])
def test_the_kernels_give_torchs_pattern(batch, heads, queries, keys, rank, mask):
    check(make_inputs(batch, heads, queries, keys, rank, mask=mask))


def test_the_default_tile(monkeypatch):
    monkeypatch.setattr(decoding, "TILE", DEFAULT_TILE)
    assert decoding.TILE // 32 < 300
    check(make_inputs(1, 32, 1, 300, 2))


@pytest.mark.parametrize("stage", ["pre", "post"])
@pytest.mark.parametrize("branches", [None, "qp", "kp", "qg", "kg", "qg kg", "qp kg"])
def test_each_set_of_branches(stage, branches):
    """Each stage alone with each set of branches on (the other stage off); None: no compose at all."""
    on = {"pre": None, "post": None, stage: branches}
    check(make_inputs(2, 5, 2, 70, 2, **on), what=f"{stage}: {branches}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    """Half inputs, float32 sums, the pattern rounded once: no further from float64 than torch's ops in that dtype."""
    check(make_inputs(2, 6, 2, 90, 2, seed=1), dtype)


@seed(20261127)
@settings(max_examples=12, deadline=None)
@given(
    heads=st.integers(1, 9),
    queries=st.integers(1, 4),
    keys=st.integers(1, 140),
    rank=st.integers(1, 2),
    pre=st.sampled_from([None, "qp", "kp qg", "qp kp qg kg"]),
    post=st.sampled_from([None, "kg", "qp kp", "qp kp qg kg"]),
    draw=st.integers(0, 2**16),
)
def test_random_shapes(heads, queries, keys, rank, pre, post, draw):
    check(make_inputs(2, heads, queries, keys, rank, pre=pre, post=post, seed=draw), what=f"{pre} / {post}")


def test_strided_weights_are_read_where_they_lie():
    """The cache's key side is a view of one [b, features, capacity] buffer and the query side a branch of the
    dynamic weights' [b, t, 4, r, h]: the kernels read them without a copy, and equal torch's ops on them."""
    scores, mask, pre, _ = make_inputs(2, 4, 1, 40, 2)
    buffer = torch.randn(2, 2 * 2 * 4 + 4, 64, dtype=torch.float64, device=DEVICE)[:, :, :40]  # kw1, kw2, kg
    kw1, kw2, kg = buffer.split([8, 8, 4], dim=1)
    w = torch.randn(2, 1, 4, 2, 4, dtype=torch.float64, device=DEVICE)
    stage = (w[:, :, 0], w[:, :, 1], kw1.unflatten(1, (2, 4)), kw2.unflatten(1, (2, 4)), pre[4], kg)
    assert not stage[0].is_contiguous() and not stage[2].is_contiguous()
    check((scores, mask, stage, stage))


def test_an_empty_batch_gives_an_empty_pattern():
    scores, mask, pre, post = cast(make_inputs(2, 3, 1, 9, 2), torch.float32)
    empty = [tuple(None if w is None else w[:0] for w in stage) for stage in (pre, post)]
    pattern = fused_decoding_pattern(scores[:0], mask[:0], *empty, 0.3)
    assert pattern.shape == (0, 3, 1, 9) and pattern.dtype == torch.float32


def test_bad_input_says_which_argument():
    scores, mask, pre, post = cast(make_inputs(1, 3, 1, 9, 2), torch.float32)
    fused_decoding_pattern(scores, mask, pre, post, 0.3)  # checked once: other arguments still are
    with pytest.raises(ValueError, match="mask must be"):
        fused_decoding_pattern(scores, mask[:, :, :, :4], pre, post, 0.3)
    with pytest.raises(ValueError, match="post kg must be"):
        fused_decoding_pattern(scores, mask, pre, (*post[:5], post[5][:, :2]), 0.3)
    with pytest.raises(ValueError, match="scores must be float32"):
        fused_decoding_pattern(scores.double(), mask, pre, post, 0.3)
    with pytest.raises(ValueError, match="one rank"):
        fused_decoding_pattern(scores, mask, pre, (post[0][:, :, :1], post[1][:, :, :1], *post[2:]), 0.3)
    with pytest.raises(ValueError, match="pre gives w1 without w2"):
        fused_decoding_pattern(scores, mask, (pre[0], None, *pre[2:]), post, 0.3)


def test_arguments_are_checked_once_a_signature(monkeypatch):
    """A step with the same shapes, dtypes and devices as one before skips the checks; any of them changed (the next
    step's one more key) is checked again."""
    checked = []
    check = decoding._check
    monkeypatch.setattr(decoding, "_check", lambda *args: checked.append(args) or check(*args))
    monkeypatch.setattr(decoding, "_ranks", {})
    scores, mask, pre, post = cast(make_inputs(1, 3, 1, 9, 2), torch.float32)
    first, again = (fused_decoding_pattern(scores, mask, pre, post, 0.3) for _ in range(2))
    assert len(checked) == 1 and torch.equal(first, again)
    key_side = (2, 3, 5)  # kw1, kw2 [b, r, h, s], kg [b, h, s]
    fewer_keys = [tuple(w[..., :8] if i in key_side else w for i, w in enumerate(stage)) for stage in (pre, post)]
    fused_decoding_pattern(scores[..., :8], mask[..., :8], *fewer_keys, 0.3)
    assert len(checked) == 2


# The model's choice.


@pytest.mark.parametrize(
    "facts, path",
    [
        (dict(), "triton"),
        (dict(device=torch.device("cpu")), "torch"),
        (dict(gradient_needed=True), "torch"),
        (dict(dtypes={torch.float64}), "torch"),
        (dict(dtypes={torch.bfloat16, torch.float32}), "triton"),
        (dict(refused={"cuda": "past its shared memory"}), "torch"),
        (dict(refused={"cuda:1": "past its shared memory"}), "triton"),
        (dict(unavailable="triton is not installed"), "torch"),
    ],
)
def test_the_rules(monkeypatch, facts, path):
    facts = {"device": CUDA, "dtypes": {torch.float32}, "gradient_needed": False, **facts}
    unavailable = facts.pop("unavailable", None)
    monkeypatch.setattr(families, "triton_unavailable", lambda device: unavailable)
    monkeypatch.setattr(families.FUSED, "refused", {})
    monkeypatch.setattr(families.DECODING, "refused", facts.pop("refused", {}))
    assert few_queries.decoding_pattern_path(**facts) == path


# The model-level tests run the model on this CPU, its kernels interpreted (tests/test_decode_step.py's helpers keep
# the cache there); where CUDA is present the kernel-level tests above run natively instead.
on_the_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the model-level checks run on a CPU")


@pytest.fixture
def on_cuda(monkeypatch):
    """decoding_pattern_path told the tensors are on CUDA (they stay on this CPU, where the kernels run interpreted);
    returns the paths taken, in order, and counts the kernels' calls."""
    return told_cuda(monkeypatch, few_queries, "decoding_pattern_path", decoding, "fused_decoding_pattern", DEVICE)


def decoding_run(name, semantics, dtype, monkeypatch):
    """The model (global and local layers), tokens of two rows, the second left-padded, and its mask."""
    model = load(name).to(dtype)
    monkeypatch.setattr(model.cfg, "window", semantics)
    tokens = torch.randint(3, model.cfg.d_vocab, (2, CHUNKS[-1][1]), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(tokens)
    mask[1, :3] = 0
    return model, tokens, mask


# every model shape of tests/test_decode_step.py once, both window semantics, its bfloat16 case
MODEL_CASES = [
    ("dcpythia-tiny", "official-inference", torch.float32),
    ("dcformer-tiny", "training", torch.float32),
    ("query-wise", "official-inference", torch.float32),
    ("pre-only", "training", torch.float32),
    ("partial-rotary", "official-inference", torch.float32),
    ("dcpythia-tiny", "training", torch.bfloat16),
]
assert set(MODEL_CASES) <= set(CASES)


@on_the_cpu_only
@pytest.mark.parametrize("name, semantics, dtype", MODEL_CASES, ids=[" ".join(map(str, c)) for c in MODEL_CASES])
def test_the_model_decodes_with_the_kernels(name, semantics, dtype, on_cuda, monkeypatch):
    """Every cached step of one to FEW_QUERIES tokens takes the kernels in every layer, and its logits equal the
    hooked (materialised) step's, float64 the judge: global and local layers, a left-padded row."""
    model, tokens, mask = decoding_run(name, semantics, dtype, monkeypatch)
    fused = cached_steps(model, tokens, mask)
    steps = len(CHUNKS) - 1  # the prompt is no decoding step
    assert on_cuda["paths"] == ["triton"] * model.cfg.n_layers * steps and on_cuda["calls"] == len(on_cuda["paths"])
    with every_square_tensor_hooked(model):
        hooked = cached_steps(model, tokens, mask)
    model64 = float64_copy(model)
    with every_square_tensor_hooked(model64):
        exact = cached_steps(model64, tokens, mask)
    floor = 16 if dtype == torch.float32 else 8 * torch.finfo(dtype).eps / EPS32
    for (a, b), new, reference, exact_logits in zip(CHUNKS, fused, hooked, exact, strict=True):
        assert_as_exact_as(new, reference, exact_logits, f"{name}, {semantics}, tokens {a}:{b}", floor_eps=floor)


@on_the_cpu_only
def test_with_gradients_a_step_takes_torchs_ops(on_cuda, monkeypatch):
    model, tokens, mask = decoding_run("dcpythia-tiny", "training", torch.float32, monkeypatch)
    model.requires_grad_(True)
    with torch.enable_grad():
        from dcinterp.kv_cache import DCFormerKeyValueCache

        cache = DCFormerKeyValueCache.init_cache(model.cfg, "cpu", batch_size=2)
        model(tokens[:, :20], attention_mask=mask[:, :20], past_kv_cache=cache)
        model(tokens[:, 20:21], attention_mask=mask[:, 20:21], past_kv_cache=cache)[:, -1].sum().backward()
    assert on_cuda["paths"] == ["torch"] * model.cfg.n_layers and on_cuda["calls"] == 0
    assert model.W_E.grad is not None and model.W_E.grad.abs().sum() > 0


@on_the_cpu_only
def test_a_card_the_kernels_do_not_fit_gives_one_warning_and_torchs_result(on_cuda, monkeypatch):
    """Triton refusing to build the kernels at their first launch: one warning, that step by torch's ops, and the
    device told (`decoding_pattern_path` then answers "torch" for it: test_the_rules)."""
    OutOfResources = pytest.importorskip("triton.runtime.errors").OutOfResources

    def refuse(*args, **kwargs):
        raise OutOfResources(232_000, 101_376, "shared memory")

    monkeypatch.setattr(decoding, "fused_decoding_pattern", refuse)
    model, tokens, mask = decoding_run("dcformer-tiny", "training", torch.float32, monkeypatch)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = cached_steps(model, tokens, mask)
    said = [str(w.message) for w in record if "decoding" in str(w.message)]
    assert len(said) == 1 and "take torch's ops: Triton cannot build the decoding kernels" in said[0]
    assert families.DECODING.refused == {str(model.W_E.device): said[0].split(": ", 1)[1]}
    monkeypatch.setattr(few_queries, "decoding_pattern_path", lambda **facts: "torch")
    for new, reference in zip(out, cached_steps(model, tokens, mask), strict=True):
        torch.testing.assert_close(new, reference, rtol=0, atol=0)
