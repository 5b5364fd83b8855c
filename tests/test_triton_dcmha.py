"""The fused Triton DCMHA through the cross-head maps (dcinterp/dcmha/maps.py) against DCMHA's formulas in float64.

On a machine without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py
before triton is first imported); with CUDA, natively.
Every comparison is judged against a float64 run of the same inputs: the fused float32 result may be at most a small
multiple of the float32 reference's own error (plus a floor, see `assert_as_exact`). The reference is DCMHA's
formulas written here with einsums (`reference`), and, for the reference checkpoints' layers, the model's own
materialised path. What the interpreter cannot check, that the kernels compile for a GPU, is checked by Triton's
compiler targeting an H100 (no GPU needed)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

import triton  # (after the skip)
import triton.language as tl

from dcinterp import HookedDCFormer
from dcinterp.dcmha import maps, maps_backward_kernels, maps_kernels
from dcinterp.dcmha.maps import BRANCHES, available, fused_dcmha
from tests.numerics import assert_as_exact_as
from tests.uninitialised import allocate_nan

FIXTURES = Path(__file__).parent / "fixtures"
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCKS = (16, 16)  # the smallest tiles: several query and key blocks at tiny shapes
TIMES_REFERENCE_ERROR = 4  # the fused float32 error, at most this multiple of the float32 reference's

pytestmark = pytest.mark.skipif(available(DEVICE) is not None, reason=str(available(DEVICE)))


@pytest.fixture(autouse=True)
def memory_never_written_is_nan(monkeypatch):
    """Every allocation the kernels do not write holds NaN (tests/uninitialised.py)."""
    allocate_nan(monkeypatch)


def compose(x, weights):
    """One compose stage on [b, h, t, s] by the formulas: x (1 + qg + kg) + the rank-R query- and key-wise terms."""
    if weights is None:
        return x
    qw1, qw2, kw1, kw2, qg, kg = weights
    out = x
    if qw1 is not None:
        out = out + torch.einsum("brts,btrm->bmts", torch.einsum("bnts,btrn->brts", x, qw1), qw2)
    if kw1 is not None:
        out = out + torch.einsum("brts,bsrm->bmts", torch.einsum("bnts,bsrn->brts", x, kw1), kw2)
    if qg is not None:
        out = out + x * qg.transpose(1, 2)[:, :, :, None]
    if kg is not None:
        out = out + x * kg.transpose(1, 2)[:, :, None, :]
    return out


def visible(t, past, window, official, real):
    """[b or 1, 1, t, s]: True where query t (position past + t) sees key s."""
    position = torch.arange(past, past + t)[:, None]
    key = torch.arange(past + t)[None, :]
    seen = key <= position
    if window is not None:
        seen &= key > position - window - int(official)
    if real is not None:
        seen = seen & (real[:, None, :].cpu() | (key == position))
    return seen[None, None] if seen.ndim == 2 else seen[:, None]


def reference(q, k, v, pre, post, *, window, official, past=0, real=None):
    """z by the formulas, one [b, h, t, s] tensor at a time."""
    scores = torch.einsum("bthe,bshe->bhts", q, k) / q.shape[-1] ** 0.5
    composed = compose(scores, pre)
    seen = visible(q.shape[1], past, window, official, real).to(q.device)
    pattern = composed.masked_fill(~seen, float("-inf")).softmax(-1)
    return torch.einsum("bhts,bshe->bthe", compose(pattern, post), v)


def make_inputs(b, t, h, e, rank, past=0, branches=("qp", "kp", "qg", "kg"), stages=("pre", "post"), seed=0):
    """q, k, v and the dynamic weights (float64, of the sizes the model's are: w1 RMS-normalised, gates tanh)."""
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).to(DEVICE)

    s = past + t
    q, k, v = draw(b, t, h, e), draw(b, s, h, e), draw(b, s, h, e)
    stage_weights = {}
    for stage in ("pre", "post"):
        w1 = {"q": draw(b, t, rank, h), "k": draw(b, s, rank, h)}
        w1 = {side: w / w.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() for side, w in w1.items()}
        weights = (
            w1["q"] if "qp" in branches else None,
            draw(b, t, rank, h, scale=0.3) if "qp" in branches else None,
            w1["k"] if "kp" in branches else None,
            draw(b, s, rank, h, scale=0.3) if "kp" in branches else None,
            draw(b, t, h).tanh() if "qg" in branches else None,
            draw(b, s, h).tanh() if "kg" in branches else None,
        )
        stage_weights[stage] = weights if stage in stages else None
    return q, k, v, stage_weights["pre"], stage_weights["post"]


def flat(pre, post):
    """The dynamic weights of both stages as one list, None for those that are off."""
    return [*(pre or (None,) * 6), *(post or (None,) * 6)]


def to(x, dtype, grad=False):
    """A detached copy of x (a tensor or a stage's weights) in dtype, requiring grad when `grad`."""
    if x is None:
        return None
    if isinstance(x, tuple):
        return tuple(to(w, dtype, grad) for w in x)
    return x.detach().to(dtype).requires_grad_(grad)


def assert_as_exact(fused, single, exact, what):
    """|fused - exact| <= TIMES_REFERENCE_ERROR |single - exact| + 8 eps max|exact|: fused and single (the reference
    in the same dtype) against exact (float64), each by its largest error. The floor, a few float32 roundings of the
    tensor's largest entry (8 eps: about 1e-6), is for sums with cancellations (the softmax's P (dP - D), summed
    again into a weight's gradient): the reference's largest error may fall on a well-conditioned entry where the
    fused path's falls on an ill-conditioned one, summed in another order. A wrong term errs by the entries' size."""
    assert_as_exact_as(fused, single, exact, what, factor=TIMES_REFERENCE_ERROR, floor_eps=8)


def check(
    inputs,
    *,
    window=None,
    official=False,
    past=0,
    real=None,
    gradients=True,
    blocks=BLOCKS,
    dtype=torch.float32,
):
    """The fused forward and the gradients of every input (for a random dz) against the float64 reference and the
    reference in `dtype` (float32 unless told); without gradients, the forward alone."""
    q, k, v, pre, post = inputs
    options = dict(window=window, official=official, past=past, real=real)
    fused = {"maps": dict(blocks=blocks)}
    runs = {}
    for name, run_dtype in (("exact", torch.float64), ("single", dtype), *((name, dtype) for name in fused)):
        args = [to(x, run_dtype, gradients) for x in (q, k, v, pre, post)]
        z = fused_dcmha(*args, **options, **fused[name]) if name in fused else reference(*args, **options)
        leaves = [x for x in args[:3] + flat(*args[3:]) if x is not None]
        grads = []
        if gradients:
            dz = torch.randn(z.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEVICE)
            grads = torch.autograd.grad(z, leaves, dz.to(run_dtype))
        runs[name] = (z, grads)
    names = [n for n, x in zip(["q", "k", "v"] + [f"{s} {b}" for s in ("pre", "post") for b in BRANCHES],
                               [q, k, v, *flat(pre, post)], strict=True) if x is not None]  # fmt: skip
    for path in fused:
        assert_as_exact(runs[path][0], runs["single"][0], runs["exact"][0], f"z ({path})")
        for i, name in enumerate(names if gradients else []):
            assert_as_exact(runs[path][1][i], runs["single"][1][i], runs["exact"][1][i], f"d {name} ({path})")


@pytest.mark.parametrize(
    "b, t, h, e, rank",
    [(2, 19, 3, 24, 2), (1, 20, 6, 16, 1), (1, 19, 4, 32, 2), (1, 33, 1, 16, 2), (1, 21, 3, 16, 3)],
    ids=["heads-3-dim-24", "heads-6-rank-1", "heads-4-dim-32", "one-head", "rank-3"],
)
def test_global_layer(b, t, h, e, rank):
    """Blocks of 16 queries and keys, the last one short: one-head's 33 queries make three, the second seeing the
    first block of keys whole (the loops without masks). The rows of a batch apart (heads-3-dim-24); head dims of
    one chunk of 16, one and a half, two; ranks 1 to 3."""
    check(make_inputs(b, t, h, e, rank))


def test_default_blocks_at_a_large_models_width():
    """32 heads of 128 (DCPythia-6.9B's), the default launches, 3 new queries against 50 cached keys."""
    check(make_inputs(1, 3, 32, 128, 2, past=50), past=50, blocks=None)


@pytest.mark.parametrize(
    "window, official", [(1, False), (5, True), (20, False)], ids=["1-training", "5-official", "20-training"]
)
def test_local_window(window, official):
    """One semantics a window (alternating): the kernels see a window only as its span, and the two semantics differ
    by one key of it."""
    check(make_inputs(1, 35, 3, 16, 2), window=window, official=official)


@pytest.mark.parametrize(
    "t, past, window, official",
    [(70, 0, 40, False), (45, 20, None, False), (52, 9, 33, True)],
    ids=["window-40", "global-after-20-cached", "window-33-official-after-9-cached"],
)
def test_blocks_seen_whole_and_masked_ones_together(t, past, window, official):
    """Blocks of 16 queries that see blocks of 16 keys whole (the kernels' loops without masks) between masked ones
    (a window's first keys, the diagonal, the prompt's last queries), with the blocks offset by a cache."""
    inputs = make_inputs(1, t, 2, 16, 2, past=past)
    check(inputs, past=past, window=window, official=official)


def test_padding():
    """Left padding in one row, holes in the other: padded keys are hidden, except from their own query."""
    real = torch.ones(2, 29, dtype=torch.bool)
    real[0, :7] = False
    real[1, [3, 4, 17, 28]] = False
    check(make_inputs(2, 29, 3, 16, 2), real=real.to(DEVICE))


@pytest.mark.parametrize(
    "past, t, window",
    [(30, 1, None), (27, 5, None), (40, 5, 8), (3, 16, 5)],
    ids=["1-new", "5-new", "5-new-window", "16-new"],
)
def test_cache(past, t, window):
    """Decoding: a few new queries (positions past ..) against every cached key, the key-side weights of all of them."""
    real = torch.ones(1, past + t, dtype=torch.bool)
    real[0, :2] = False
    check(make_inputs(1, t, 4, 16, 2, past=past), past=past, window=window, real=real.to(DEVICE))


def test_a_cache_filled_in_chunks():
    """A prompt run in chunks of 9, 1, 16 and 5 queries, each against the keys so far (a window of 6), gives the z
    of the whole prompt at once."""
    q, k, v, pre, post = [to(x, torch.float32) for x in make_inputs(1, 31, 3, 16, 2)]
    exact = reference(*[to(x, torch.float64) for x in (q, k, v, pre, post)], window=6, official=False)
    single = reference(q, k, v, pre, post, window=6, official=False)
    chunks = []
    for start, end in [(0, 9), (9, 10), (10, 26), (26, 31)]:
        stages = [
            (w[0][:, start:end], w[1][:, start:end], w[2][:, :end], w[3][:, :end], w[4][:, start:end], w[5][:, :end])
            for w in (pre, post)
        ]
        chunks.append(
            fused_dcmha(q[:, start:end], k[:, :end], v[:, :end], *stages, window=6, official=False, past=start)
        )
    assert_as_exact(torch.cat(chunks, 1), single, exact, "z")


@pytest.mark.parametrize(
    "branches, stages",
    [
        (("qp",), ("pre", "post")),
        (("kp",), ("pre", "post")),
        (("qg",), ("pre", "post")),
        (("kg",), ("pre", "post")),
        (("qp", "kp", "qg", "kg"), ("post",)),
        (("qp", "kp", "qg", "kg"), ("pre",)),
        ((), ()),
    ],
    ids=["qp-alone", "kp-alone", "qg-alone", "kg-alone", "pre-off", "post-off", "plain-attention"],
)
def test_branches_on_and_off(branches, stages):
    check(make_inputs(1, 21, 3, 16, 2, branches=branches, stages=stages))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    """Products in the half dtype, sums in float32: no further from float64 than the reference run in that dtype
    (whose softmax and sums round in it too), forward and backward."""
    q, k, v, pre, post = make_inputs(1, 24, 3, 16, 2)
    assert fused_dcmha(*[to(x, dtype) for x in (q, k, v, pre, post)], window=None, official=False).dtype == dtype
    check((q, k, v, pre, post), window=5, dtype=dtype)


@given(data=st.data())
@settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.generate],
)
@seed(0)  # fixed draws that do not depend on the test's source text (derandomize's would)
def test_any_combination(data):
    """Shapes, masks and branches drawn together: padding in a window against a cache, a stage with some branches."""
    heads, dim, rank = (
        data.draw(st.integers(1, 5)),
        data.draw(st.sampled_from([16, 24, 40])),
        data.draw(st.integers(1, 2)),
    )
    t, past = data.draw(st.integers(1, 24)), data.draw(st.sampled_from([0, 0, 3, 17]))
    window = data.draw(st.sampled_from([None, 1, 4, 9]))
    official = data.draw(st.booleans())
    branches = data.draw(st.sets(st.sampled_from(["qp", "kp", "qg", "kg"])))
    stages = data.draw(st.sets(st.sampled_from(["pre", "post"])))
    real = torch.rand(1, past + t, generator=torch.Generator().manual_seed(t)) > data.draw(st.sampled_from([0.0, 0.3]))
    inputs = make_inputs(1, t, heads, dim, rank, past=past, branches=branches, stages=stages, seed=t + past)
    check(inputs, window=window, official=official, past=past, real=real.to(DEVICE))


def test_keys_before_the_window_are_never_read():
    """Decoding 5 queries after 40 cached keys with a window of 6: NaN in the keys before the first query's window and
    in their weights changes no bit of z or of any gradient, and their gradients stay 0."""
    past, window = 40, 6
    clean = [to(x, torch.float32) for x in make_inputs(1, 5, 3, 16, 2, past=past)]
    poisoned = [to(x, torch.float32) for x in clean]
    hidden = slice(0, past - window + 1)  # query `past` sees keys after past - window
    for x in [poisoned[1], poisoned[2], *[w for i, w in enumerate(flat(*poisoned[3:])) if i % 6 in (2, 3, 5)]]:
        x[:, hidden] = float("nan")
    runs = []
    for q, k, v, pre, post in (clean, poisoned):
        inputs = [to(x, torch.float32, True) for x in (q, k, v, pre, post)]
        z = fused_dcmha(*inputs, window=window, official=False, past=past, blocks=BLOCKS)
        leaves = [x for x in inputs[:3] + flat(*inputs[3:]) if x is not None]
        runs.append([z, *torch.autograd.grad(z, leaves, torch.ones_like(z))])
    for first, second in zip(*runs, strict=True):
        assert torch.equal(first, second)
    assert not runs[1][2][:, hidden].any()  # dk


def test_same_inputs_give_the_same_bits():
    q, k, v, pre, post = [to(x, torch.float32, True) for x in make_inputs(1, 35, 3, 16, 2)]
    leaves = [x for x in (q, k, v, *flat(pre, post)) if x is not None]
    runs = []
    for _ in range(2):
        z = fused_dcmha(q, k, v, pre, post, window=7, official=False, blocks=BLOCKS)
        runs.append([z, *torch.autograd.grad(z, leaves, torch.ones_like(z))])
    for first, second in zip(*runs, strict=True):
        assert torch.equal(first, second)


def test_without_gradients_the_same_forward():
    """Under no_grad the kernels run without the autograd.Function: the same z, bit for bit."""
    inputs = [to(x, torch.float32, True) for x in make_inputs(1, 20, 3, 16, 1)]
    z = fused_dcmha(*inputs, window=None, official=False, blocks=BLOCKS)
    with torch.no_grad():
        assert torch.equal(z, fused_dcmha(*inputs, window=None, official=False, blocks=BLOCKS))


def test_a_card_without_room_for_the_pipelined_loads_takes_the_launch_unpipelined(monkeypatch):
    """Each kernel through the maps refused by the card while num_stages > 1 (Triton's OutOfResources, as a head dim of
    256 is on a 99 KiB card): the first of each group of kernels sharing settings is launched again with num_stages=1,
    and the rest of its group takes it at once; the same z and gradients bit for bit (here, under the interpreter); the
    call's settings keep it: the next call of the same shapes is refused nothing."""
    names = [
        "product_maps_kernel", "row_statistics_kernel", "post_maps_kernel", "head_output_kernel",
        "row_gradient_kernel", "pre_gradient_maps_kernel", "head_query_gradient_kernel", "head_key_gradient_kernel",
    ]  # fmt: skip
    inputs = make_inputs(1, 40, 3, 16, 2)

    def run():
        args = [to(x, torch.float32, True) for x in inputs]
        z = fused_dcmha(*args, window=None, official=False, blocks=BLOCKS)
        leaves = [x for x in args[:3] + flat(*args[3:]) if x is not None]
        return z, torch.autograd.grad(z, leaves, torch.ones_like(z))

    pipelined = run()
    refused, stages = [], {}

    class Refusing:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **constants):
                stages[self.kernel.fn.__name__] = constants["num_stages"]
                if constants["num_stages"] > 1:
                    refused.append(self.kernel.fn.__name__)
                    raise maps.OutOfResources(232_000, 101_376, "shared memory")
                return self.kernel[grid](*args, **constants)

            return launch

    for name in names:
        module = maps_kernels if hasattr(maps_kernels, name) else maps_backward_kernels
        monkeypatch.setattr(module, name, Refusing(getattr(module, name)))
    maps._launches.clear()
    unpipelined = run()
    first_of_each_group = ["product_maps_kernel", "row_statistics_kernel", "row_gradient_kernel"]
    assert refused == [*first_of_each_group, "head_key_gradient_kernel"] and stages == dict.fromkeys(names, 1)
    (z, grads), (z_unpipelined, grads_unpipelined) = pipelined, unpipelined
    assert torch.equal(z, z_unpipelined)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_unpipelined, strict=True))
    refused.clear()
    run()
    assert refused == []
    maps._launches.clear()


def test_the_backward_of_a_long_prompt_goes_a_chunk_of_queries_at_a_time(monkeypatch):
    """With room for the maps and their gradients of 16 queries only, the backward through the maps goes 16 queries
    at a time (3 chunks, the last one short, in a window), each chunk's key side added to the last's: the gradients
    of the whole prompt at once, bit for bit (the tiles, and the order of their sums, do not depend on the chunk),
    but for the key side's weights: a program sums their products over its queries once, after its loop, so that
    chunks sum them in another order; those within float32 rounding (float64-judged, with the whole prompt's)."""
    b, t, h, e, rank = 1, 45, 3, 16, 2
    inputs = make_inputs(b, t, h, e, rank)
    runs = []
    for room in (None, 2 * b * 4 * rank * t * 4 * 16):
        if room is not None:
            monkeypatch.setattr(maps, "MAPS_BYTES", room)
        calls = []
        launches = maps._maps_backward_launches
        monkeypatch.setattr(
            maps,
            "_maps_backward_launches",
            lambda *args, calls=calls, launches=launches: calls.append(args[1].shape[1]) or launches(*args),
        )
        args = [to(x, torch.float32, True) for x in inputs]
        z = fused_dcmha(*args, window=20, official=True, blocks=BLOCKS)
        leaves = [x for x in args[:3] + flat(*args[3:]) if x is not None]
        runs.append((calls, torch.autograd.grad(z, leaves, torch.ones_like(z))))
        monkeypatch.setattr(maps, "_maps_backward_launches", launches)
    assert runs[0][0] == [45] and runs[1][0] == [16, 16, 13]
    key_side = [3 + i for i in maps.KEY_SIDE]  # the key side's weights among the leaves q, k, v, ...
    for i, (whole, chunked) in enumerate(zip(runs[0][1], runs[1][1], strict=True)):
        if i not in key_side:
            assert torch.equal(whole, chunked)
    args = [to(x, torch.float64, True) for x in inputs]
    z = reference(*args, window=20, official=True)
    exact = torch.autograd.grad(z, [x for x in args[:3] + flat(*args[3:]) if x is not None], torch.ones_like(z))
    for i in key_side:
        assert_as_exact(runs[1][1][i], runs[0][1][i], exact[i], f"the key side's weight {i - 3}, by chunks")


def test_the_maps_of_a_long_prompt_go_a_chunk_of_queries_at_a_time(monkeypatch):
    """With room for the maps of 16 queries only, the forward through the maps goes 16 queries at a time (3 chunks,
    the last one short, in a window): the z of the whole prompt at once, judged against float64."""
    b, t, h, e, rank = 2, 45, 3, 16, 2
    monkeypatch.setattr(maps, "MAPS_BYTES", b * 4 * rank * t * 4 * 16)
    inputs = make_inputs(b, t, h, e, rank)
    calls = []
    launches = maps._maps_launches
    monkeypatch.setattr(maps, "_maps_launches", lambda *args: calls.append(args[1].shape[1]) or launches(*args))
    with torch.no_grad():
        z = fused_dcmha(*[to(x, torch.float32) for x in inputs], window=20, official=True, blocks=BLOCKS)
    assert calls == [16, 16, 13]
    options = dict(window=20, official=True)
    single = reference(*[to(x, torch.float32) for x in inputs], **options)
    assert_as_exact(z, single, reference(*[to(x, torch.float64) for x in inputs], **options), "z")


@pytest.mark.parametrize("heads, d_head", [(16, 64), (32, 128)], ids=["d_model-1024", "6.9b-wide"])
def test_the_maps_held_grow_with_the_prompt_not_its_square(heads, d_head):
    """At bench_gpu_dcmha.py's widths (bfloat16, rank 2), the kernels through the maps hold at a time at most 4 times
    the queries' bytes of maps, or 32 MiB where that is more (MAPS_MIN_BYTES: a prompt whose maps fit goes in one
    chunk), and never over 256 MiB (MAPS_BYTES): from 4,096 tokens at d_model 1024 they are a chunk of queries'."""
    mib, rank = 2**20, 2
    held = {}
    for t in (128, 1024, 2048, 4096, 8192, 32768):
        q = torch.empty(1, t, heads, d_head, dtype=torch.bfloat16, device="meta")
        side = [torch.empty(1, t, rank, heads, device="meta")] * 4 + [torch.empty(1, t, heads, device="meta")] * 2
        launch = maps._Launch(q, q, tuple(side * 2), None, False, 0, None, None)
        chunk = min(t, maps._chunk_of_queries(launch, q, buffers=1))
        held[t] = chunk * 4 * rank * t * 2
        room = min(256 * mib, max(32 * mib, 4 * q.numel() * 2))
        assert held[t] <= room, (t, held[t] / mib)
        block = max(launch.maps_kernels["BQ"], launch.head_kernels["BQ"], launch.gradient_kernels["BQ"])
        assert chunk == t or held[t] > room - block * 4 * rank * t * 2, "a chunk a block or more short of the room"
        assert (chunk == t) == (4 * rank * t * t * 2 <= room), t
    if heads == 16:
        assert {t: h / mib for t, h in held.items() if t >= 4096} == {4096: 32, 8192: 64, 32768: 256}
    else:
        assert held[2048] == 64 * mib and held[8192] == 256 * mib  # one chunk at 2,048 tokens, four at 8,192


def test_keys_before_the_window_change_nothing_through_the_maps():
    """The forward through the maps loads whole aligned key blocks, so it reads keys before a window: NaN in them
    and in their weights changes no bit of z."""
    past, window = 40, 6
    clean = [to(x, torch.float32) for x in make_inputs(1, 5, 3, 16, 2, past=past)]
    poisoned = [to(x, torch.float32) for x in clean]
    hidden = slice(0, past - window + 1)
    for x in [poisoned[1], poisoned[2], *[w for i, w in enumerate(flat(*poisoned[3:])) if i % 6 in (2, 3, 5)]]:
        x[:, hidden] = float("nan")
    with torch.no_grad():
        first, second = (
            fused_dcmha(*inputs, window=window, official=False, past=past, blocks=BLOCKS)
            for inputs in (clean, poisoned)
        )
    assert torch.equal(first, second)


def test_views_give_what_contiguous_tensors_give():
    """q, k, v as the model makes them (views of [h, b, p, e] tensors), key-side weights as views of key-last ones."""
    q, k, v, pre, post = [to(x, torch.float32) for x in make_inputs(2, 18, 3, 16, 2)]
    z = fused_dcmha(q, k, v, pre, post, window=None, official=False)
    views = [x.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3) for x in (q, k, v)]
    pre = (*pre[:2], *[w.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2) for w in pre[2:4]], *pre[4:])
    assert not views[0].is_contiguous() and not pre[2].is_contiguous()
    assert torch.equal(z, fused_dcmha(*views, pre, post, window=None, official=False))


def test_the_forward_saves_the_inputs_and_row_statistics_only():
    """What autograd keeps for the backward: the inputs themselves and [b, h, t] statistics, nothing [t, s]-sized."""
    inputs = [to(x, torch.float32, True) for x in make_inputs(2, 20, 3, 16, 2)]
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fused_dcmha(*inputs, window=None, official=False, blocks=BLOCKS)
    leaves = [x for x in inputs[:3] + flat(*inputs[3:]) if x is not None]
    statistics = [x for x in saved if not any(x is leaf for leaf in leaves)]
    assert len(saved) == len(leaves) + len(statistics)
    assert [tuple(x.shape) for x in statistics] == [(2, 3, 20)] * 2  # each (head, query)'s max and sum


def test_second_derivatives_raise_clearly():
    q, k, v, pre, post = [to(x, torch.float32, True) for x in make_inputs(1, 16, 2, 16, 1)]
    z = fused_dcmha(q, k, v, pre, post, window=None, official=False)
    with pytest.raises(RuntimeError, match="materialised path"):
        torch.autograd.grad(z.sum(), q, create_graph=True)


def by_reference(calls, window=None):
    """A `fallback` giving `reference`'s gradients (recorded: each call's refusal), differentiable under
    create_graph=True."""

    def fallback(refusal, dz, q, k, v, weights):
        calls.append(refusal)
        inputs, second_order = (q, k, v, *weights), torch.is_grad_enabled()
        wanted = [x for x in inputs if x is not None and x.requires_grad]
        with torch.enable_grad():
            z = reference(q, k, v, tuple(weights[:6]), tuple(weights[6:]), window=window, official=False)
            grads = iter(torch.autograd.grad(z, wanted, dz, create_graph=second_order))
        return [next(grads) if x is not None and x.requires_grad else None for x in inputs]

    return fallback


def test_a_fallback_gives_the_second_derivatives():
    """Under create_graph=True the backward is the fallback's (told no refusal): a Hessian-vector product of the
    kernels' z equals the formulas'."""
    inputs = make_inputs(1, 19, 2, 16, 2)
    direction = torch.randn(inputs[0].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def hvp(dtype, fused):
        q, k, v, pre, post = [to(x, dtype, True) for x in inputs]
        if fused:
            z = fused_dcmha(q, k, v, pre, post, window=7, official=False, fallback=by_reference(calls, window=7),
                            blocks=BLOCKS)  # fmt: skip
        else:
            z = reference(q, k, v, pre, post, window=7, official=False)
        (dq,) = torch.autograd.grad(z.pow(2).sum(), q, create_graph=True)
        return torch.autograd.grad((dq * direction.to(dtype)).sum(), q)[0]

    calls = []
    out = hvp(torch.float32, fused=True)
    assert calls == [None]
    assert_as_exact(out, hvp(torch.float32, fused=False), hvp(torch.float64, fused=False), "Hessian-vector product")


def test_a_card_refusing_the_backward_kernels_takes_the_fallback(monkeypatch):
    """Triton's OutOfResources at the backward's first launch reaches the fallback, whose gradients are the call's;
    without a fallback it is raised as it is."""
    OutOfResources = pytest.importorskip("triton.runtime.errors").OutOfResources
    refusal = OutOfResources(110_592, 101_376, "shared memory")

    def refused(*args):
        raise refusal

    monkeypatch.setattr(maps, "_backward_through_maps", refused)
    q, k, v, pre, post = [to(x, torch.float32, True) for x in make_inputs(1, 12, 2, 16, 1)]
    calls = []
    z = fused_dcmha(q, k, v, pre, post, window=None, official=False, fallback=by_reference(calls), blocks=BLOCKS)
    leaves = [q, k, v, *flat(pre, post)]
    grads = torch.autograd.grad(z.sum(), leaves)
    assert calls == [refusal]
    expected = torch.autograd.grad(reference(q, k, v, pre, post, window=None, official=False).sum(), leaves)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # the fallback's own gradients, as they are
    z = fused_dcmha(q, k, v, pre, post, window=None, official=False, blocks=BLOCKS)
    with pytest.raises(OutOfResources):
        z.sum().backward()


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(k=lambda k: k[:, :-1]), "k and v must be"),
        (dict(qw1=lambda w: w[:, :, :, :-1]), "pre qw1 must be"),
        (dict(real=lambda r: r[:, :-1]), "real must be"),
        (dict(blocks=(16, 24)), "blocks must be"),
        (dict(post=lambda weights: weights[:5]), "post must be"),
        (dict(v=lambda v: v.double()), "q, k, v must share"),
        (dict(blocks=(64, 8)), "blocks must be"),
        (dict(qw2=lambda w: None), "pre qw1 and qw2 must be given together"),
        (dict(qw1=lambda w: torch.cat([w, w], dim=2), qw2=lambda w: torch.cat([w, w], dim=2)), "every projection"),
    ],
    ids=["keys", "weight", "padding", "blocks", "stage", "dtype", "small-blocks", "pair", "ranks"],
)
def test_bad_input_says_which_argument(change, message):
    q, k, v, pre, post = [to(x, torch.float32) for x in make_inputs(1, 16, 2, 16, 1)]
    real = torch.ones(1, 16, dtype=torch.bool, device=DEVICE)
    with torch.no_grad():  # the right arguments first: their launch is cached, and the wrong ones still checked
        fused_dcmha(q, k, v, pre, post, window=None, official=False, real=real)
    if "k" in change:
        k, v = change["k"](k), change["k"](v)
    if "qw1" in change:
        pre = (change["qw1"](pre[0]), *pre[1:])
    if "qw2" in change:
        pre = (pre[0], change["qw2"](pre[1]), *pre[2:])
    if "real" in change:
        real = change["real"](real)
    if "post" in change:
        post = change["post"](post)
    if "v" in change:
        v = change["v"](v)
    blocks = change.get("blocks")
    with pytest.raises(ValueError, match=f"^fused_dcmha: {message}"):
        fused_dcmha(q, k, v, pre, post, window=None, official=False, real=real, blocks=blocks)


def test_arguments_are_checked_once_a_signature(monkeypatch):
    """A layer called again with the same shapes, dtypes and devices skips the checks (the host's time at short
    prompts); any of them changed is checked again."""
    checked = []
    check = maps._check
    monkeypatch.setattr(maps, "_check", lambda *args: checked.append(args) or check(*args))
    monkeypatch.setattr(maps, "_launches", {})
    q, k, v, pre, post = [to(x, torch.float32) for x in make_inputs(1, 16, 2, 16, 1)]
    with torch.no_grad():
        first = fused_dcmha(q, k, v, pre, post, window=None, official=False)
        again = fused_dcmha(q, k, v, pre, post, window=None, official=False)
        assert len(checked) == 1 and torch.equal(first, again)
        fused_dcmha(q, k, v, pre, post, window=8, official=False)
        fused_dcmha(q[:, 1:], k[:, 1:], v[:, 1:], *[[w[:, 1:] for w in s] for s in (pre, post)], window=None,
                    official=False)  # fmt: skip
    assert len(checked) == 3


BRANCH_OF = {"qw1": "qp", "qw2": "qp", "kw1": "kp", "kw2": "kp", "qg": "qg", "kg": "kg"}


@pytest.mark.parametrize("name", ["dcformer-tiny", "dcpythia-tiny", "official-inference"])
def test_the_models_layers(name):
    """Each layer of the reference checkpoints (local and global layers, QK-norm, rotary), fed what the model's hooks
    show (rotated q and k, v, each stage's dynamic weights), gives the z of the model's materialised path (hook_z
    under run_with_cache), judged against the model run in float64."""
    model = HookedDCFormer.from_pretrained(
        FIXTURES / ("dcpythia-tiny" if name == "official-inference" else name), device=DEVICE
    )
    if name == "official-inference":
        model.cfg.window = "official-inference"
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 21), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    _, single = model.run_with_cache(tokens)
    _, exact = model.to(torch.float64).run_with_cache(tokens)
    for layer, block in enumerate(model.blocks):
        attn = f"blocks.{layer}.attn"
        stages = [
            None if compose is None else tuple(
                single[f"{attn}.{compose.stage}_compose.hook_{w}"] if BRANCH_OF[w] in compose.branches else None
                for w in BRANCHES
            )
            for compose in (block.attn.pre_compose, block.attn.post_compose)
        ]  # fmt: skip
        q, k, v = (single[f"{attn}.hook_{hook}"] for hook in ("rot_q", "rot_k", "v"))
        official = model.cfg.window == "official-inference"
        z = fused_dcmha(q, k, v, *stages, window=block.attn.window, official=official)
        assert_as_exact(z, single[f"{attn}.hook_z"], exact[f"{attn}.hook_z"], f"layer {layer} z")


def _float32_products(x, rounded, a, b, product):
    """(a kernel, decorated by the test) TF32 roundings of x [16], and a [16, 16] @ b [16, 16] as the kernels through
    the maps take float32 tiles."""
    i = tl.arange(0, 16)
    tl.store(rounded + i, maps_kernels._tf32(tl.load(x + i)))
    m, n = tl.arange(0, 16)[:, None], tl.arange(0, 16)[None, :]
    a_tile = tl.reshape(tl.load(a + m * 16 + n), (1, 16, 16))
    b_tile = tl.reshape(tl.load(b + m * 16 + n), (1, 16, 16))
    tl.store(product + m * 16 + n, tl.reshape(maps_kernels.head_dot(a_tile, b_tile, False), (16, 16)))


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the interpreter's emulation of the card's 3xTF32")
def test_float32_products_are_3xtf32_as_on_a_card():
    """Under the interpreter (which ignores a dot's input_precision) the kernels through the maps write out the card's
    3xTF32 product: operands rounded to TF32 as cvt.rna.tf32.f32 (10 bits of mantissa, to nearest, ties away from
    zero), three products of big and small parts; the result within float32's error of the exact one."""
    maps_kernels.jit()
    kernel = triton.jit(_float32_products)
    ulp = 2.0**-10  # TF32's, at 1
    x = torch.tensor([1 + ulp / 2, 1 + ulp / 4, -(1 + 3 * ulp / 2), 1 + 3 * ulp / 4] + [0.0] * 12)
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(16, 16, generator=generator) for _ in range(2))
    rounded, product = torch.empty(16), torch.empty(16, 16)
    kernel[(1,)](x, rounded, a, b, product)
    assert rounded[:4].tolist() == [1 + ulp, 1.0, -(1 + 2 * ulp), 1 + ulp]
    exact = a.double() @ b.double()
    error = (product.double() - exact).abs().max().item()
    assert 0 < error < 64 * torch.finfo(torch.float32).eps * exact.abs().max().item()  # TF32 alone: ~1e-3 of it


SPLIT_LOOPS = {
    "row_statistics_kernel",
    "head_output_kernel",
    "row_gradient_kernel",
    "head_query_gradient_kernel",
    "head_key_gradient_kernel",
}


@pytest.mark.parametrize(
    "arch, head_dim, dtype, padding",
    [
        (90, 128, "bfloat16", False),  # Hopper: H100, H200
        (90, 256, "bfloat16", True),  # with padding: every block masked
        (86, 128, "bfloat16", False),  # a 24 GB workstation's Ampere: RTX 3090, A5000, A10 (sm_89's limit is the same)
        (86, 256, "bfloat16", False),
        (90, 128, "float32", False),  # float32's products by 3xTF32 in the kernels through the maps
    ],
)
def test_the_kernels_compile_for_a_card(arch, head_dim, dtype, padding):
    """benchmarks/kernel_resources.py: Triton's compiler, without a GPU, takes every kernel down to a binary for the
    card (32 heads, every branch on, pointers and sizes specialised as a launch's), within the shared memory a block
    may take there, the kernels through the maps unpipelined where their launch would be: what the interpreter never
    checks (layouts, dots, shared memory) is checked here, in a process of its own, where the kernels are decorated
    natively. Without padding, the kernels of one head a program have their loop of blocks seen whole, shorter than
    the masked one."""
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_resources.py"
    options = ["--arch", str(arch), "--head-dim", str(head_dim), "--dtype", dtype] + ["--padding"] * padding
    run = subprocess.run(
        [sys.executable, str(script), *options],
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    fits = dict(re.findall(r"^\| `(\w+)` \|.*\| (yes|unpipelined|no) \|$", run.stdout, re.MULTILINE))
    # some kernels through the maps fit sm_86 only unpipelined (num_stages=1), as their launch retries, as in float32
    expected = {"yes", "unpipelined"} if arch == 86 or dtype == "float32" else {"yes"}
    assert len(fits) == 12 and set(fits.values()) == expected, run.stdout
    # every kernel through the maps loops (over key or query blocks, or a tile's heads): its loop read in the binary;
    # none kept to 32 registers, spilling kilobytes a thread (as ptxas built them in float32 by IEEE FMA products)
    maps = re.findall(
        r"^\| `(?:product|row|post|head|pre)\w+` \|[^|]*\| (\d+) \| (\d+) \| (\d+), \d+, \d+, \d+ \|", run.stdout, re.M
    )
    assert len(maps) == 8 and all(int(instructions) > 100 for *_, instructions in maps), run.stdout
    assert all(int(registers) > 32 and int(spilled) < 8192 for registers, spilled, _ in maps), run.stdout
    # without padding the kernels of one head a program have a second loop, of the blocks seen whole, shorter
    rows = re.findall(r"^\| `(\w+)` \|(?:[^|]*\|){3} (\d+), \d+, \d+, \d+ \| (\d+|-) \|", run.stdout, re.M)
    unmasked = {name: (int(masked), int(loop)) for name, masked, loop in rows if loop != "-"}
    assert set(unmasked) == (set() if padding else SPLIT_LOOPS), run.stdout
    assert all(100 < loop < masked for masked, loop in unmasked.values()), run.stdout


def test_kernel_resources_reads_the_main_loop_of_a_listing(monkeypatch):
    """`main_loop`: the longest loop (a label to the branch back to it) of nvdisasm's listing, its instructions counted
    by opcode whatever their predicate; a kernel's closing branch to itself is no loop."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from kernel_resources import main_loop

    def instruction(address, text):
        return f"        /*{address:04x}*/                   {text} ;"

    listing = [
        instruction(0, "MOV R1, c[0x0][0x28]"),
        ".L_x_0:",
        instruction(16, "LDL R2, [R1]"),
        instruction(32, "@!P0 BRA `(.L_x_0)"),  # a short loop
        ".L_x_1:",
        instruction(48, "SHFL.BFLY PT, R3, R2, 0x1, 0x1f"),
        instruction(64, "BAR.SYNC.DEFER_BLOCKING 0x0"),
        instruction(80, "@P1 STL [R1+0x4], R3"),
        instruction(96, "FFMA R4, R3, R3, R4"),
        instruction(112, "@P2 BRA `(.L_x_1)"),  # the main loop
        instruction(128, "EXIT"),
        ".L_x_2:",
        instruction(144, "BRA `(.L_x_2)"),
    ]
    assert main_loop("\n".join(listing)) == dict(instructions=5, barriers=1, shuffles=1, local=1)
    assert main_loop("\n".join(listing[-2:])) == {}


@pytest.mark.parametrize(
    "argument, message",
    [(("--arch", "70"), "--arch must be one of [80, 86, 89, 90]"), (("--head-dim", "96"), "must be a power of two")],
)
def test_kernel_resources_says_what_is_wrong_in_one_line(argument, message):
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_resources.py"
    run = subprocess.run([sys.executable, str(script), *argument], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and message in run.stderr.strip().splitlines()[-1]
