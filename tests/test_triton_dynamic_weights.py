"""DCMHA's dynamic weights in one Triton kernel (dcinterp/dcmha/dynamic_weights.py) against torch's ops in float64,
and the model's choice between them (`dcinterp.dcmha.dynamic_weights_path`).

On a machine without CUDA the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py
before triton is first imported). The model takes the kernel only on CUDA: here the path's device check is told the
tensors are on CUDA (they stay on this CPU) and the real kernel runs interpreted. Every comparison is judged against a
float64 run of the same inputs: the kernel's error at most TIMES_REFERENCE_ERROR times that of torch's ops in the same
dtype, plus a floor of 8 units of that dtype's rounding of the largest entry."""

import os
import warnings

import pytest
import torch

pytest.importorskip("triton")

from dcinterp import HookedDCFormer, dcmha
from dcinterp.dcmha import dynamic_weights, families
from dcinterp.dcmha.dynamic_weights import fused_dynamic_weights, torch_dynamic_weights
from dcinterp.dcmha.jit import available
from tests.numerics import float64_copy
from tests.told_cuda import CUDA, told_cuda
from tests.uninitialised import allocate_nan

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TIMES_REFERENCE_ERROR = 4
OUTPUTS = ("w1", "w2", "gates")

pytestmark = pytest.mark.skipif(available(DEVICE) is not None, reason=str(available(DEVICE)))


@pytest.fixture(autouse=True)
def memory_never_written_is_nan(monkeypatch):
    """Every allocation the kernels do not write holds NaN (tests/uninitialised.py)."""
    allocate_nan(monkeypatch)


def make_weights(batch, positions, D, K, H, R, biases, seed=0):
    """x and the five parameters in float64, of the sizes a model's are (projections scaled by 1 / sqrt(fan-in))."""
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).to(DEVICE)

    return (
        draw(batch, positions, D),
        draw(D, 4, K, scale=D**-0.5),
        draw(4, K) if biases else None,
        draw(4, K, 2 * R, H, scale=K**-0.5),
        draw(D, 4, H, scale=D**-0.5),
        draw(4, H, scale=0.5) if biases else None,
    )


def assert_as_exact(new, reference, exact, what, dtype=torch.float32):
    """max|new - exact| <= TIMES_REFERENCE_ERROR max|reference - exact| + 8 eps(dtype) max|exact|."""
    new_error = (new.double() - exact).abs().max().item()
    allowed = TIMES_REFERENCE_ERROR * (reference.double() - exact).abs().max().item()
    allowed += 8 * torch.finfo(dtype).eps * exact.abs().max().item()
    assert new_error <= allowed, f"{what}: {new_error:.3g} > {allowed:.3g}"


def check(inputs, dtype=torch.float32):
    exact = torch_dynamic_weights(*inputs)
    cast = [None if t is None else t.to(dtype) for t in inputs]
    reference, fused = torch_dynamic_weights(*cast), fused_dynamic_weights(*cast)
    for name, new, ref, ex in zip(OUTPUTS, fused, reference, exact, strict=True):
        assert new.shape == ex.shape and new.dtype == dtype, (name, new.shape, new.dtype)
        assert_as_exact(new, ref, ex, name, dtype)
        # branch-major: each branch's weights reach the compose kernels without a copy (a launch each)
        assert all(new[:, :, c].is_contiguous() for c in range(4)), name


@pytest.mark.parametrize(
    "batch, positions, D, K, H, R, biases",
    [
        (2, 19, 37, 12, 3, 2, True),
        (1, 33, 50, 20, 5, 1, False),
        (1, 1, 16, 24, 6, 2, True),  # one position: a decoding step
        (2, 5, 64, 128, 32, 2, False),  # K = 4 H, as the released models have
    ],
    ids=["odd-sizes-biases", "rank-1", "one-position", "32-heads"],
)
def test_the_kernel_gives_torchs_dynamic_weights(batch, positions, D, K, H, R, biases):
    check(make_weights(batch, positions, D, K, H, R, biases))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    """Half inputs, sums in float32, results rounded once: no further from float64 than torch's ops in that dtype."""
    check(make_weights(2, 17, 40, 12, 3, 2, True, seed=1), dtype)


# The backward.

INPUTS = ("x", "W_in", "b_in", "W_out", "W_gate", "b_gate")


def gradients(function, inputs, output_grads, wanted, dtype=torch.float32):
    """The gradients of `wanted` (names in INPUTS) of <function(inputs), output_grads>, inputs cast to dtype."""
    cast = [
        None if t is None else t.to(dtype).requires_grad_(name in wanted)
        for name, t in zip(INPUTS, inputs, strict=True)
    ]
    outputs = function(*cast)
    pairs = [(o, g.to(dtype)) for o, g in zip(outputs, output_grads, strict=True) if g is not None]
    chosen = [t for name, t in zip(INPUTS, cast, strict=True) if name in wanted]
    return torch.autograd.grad([o for o, _ in pairs], chosen, [g for _, g in pairs])


def output_gradients(inputs, seed=2, strided=False):
    """Random gradients of (w1, w2, gates) [b, p, 4, ...]; `strided`: w1's and w2's stored with rank and head
    swapped (the kernel then reads a contiguous copy)."""
    generator = torch.Generator().manual_seed(seed)
    x, _, _, W_out, W_gate, _ = inputs
    R, H = W_out.shape[2] // 2, W_gate.shape[2]
    weight = (*x.shape[:2], 4, R, H)
    draw = [
        torch.randn(*shape, generator=generator, dtype=torch.float64) for shape in (weight, weight, weight[:-2] + (H,))
    ]
    if strided:
        draw[:2] = [g.transpose(-1, -2).contiguous().transpose(-1, -2) for g in draw[:2]]
    return [g.to(DEVICE) for g in draw]


def check_gradients(inputs, output_grads, wanted, dtype=torch.float32):
    exact = gradients(torch_dynamic_weights, inputs, output_grads, wanted, torch.float64)
    reference = gradients(torch_dynamic_weights, inputs, output_grads, wanted, dtype)
    fused = gradients(fused_dynamic_weights, inputs, output_grads, wanted, dtype)
    names = [name for name in INPUTS if name in wanted]
    for name, new, ref, ex in zip(names, fused, reference, exact, strict=True):
        assert new.shape == ex.shape and new.dtype == dtype, (name, new.shape, new.dtype)
        assert_as_exact(new, ref, ex, f"d{name}", dtype)


@pytest.mark.parametrize(
    "batch, positions, D, K, H, R, biases, strided",
    [
        (2, 19, 37, 12, 3, 2, True, False),
        (1, 33, 50, 20, 5, 1, False, True),
        (1, 1, 16, 24, 6, 2, True, False),
        (2, 5, 64, 128, 32, 2, False, True),
    ],
    ids=["odd-sizes-biases", "rank-1-strided", "one-position", "32-heads-strided"],
)
def test_the_kernels_gradients_are_torchs(batch, positions, D, K, H, R, biases, strided):
    """Every input's gradient (the weights' too) against torch's ops, float64-judged; the outputs' gradients in the
    layout the model gives them or with their trailing dims permuted."""
    inputs = make_weights(batch, positions, D, K, H, R, biases)
    check_gradients(inputs, output_gradients(inputs, strided=strided), INPUTS if biases else INPUTS[:2] + ("W_out",))


def test_the_inputs_gradient_alone_and_an_output_unused():
    """As an attribution asks: x's gradient only (the weights frozen), and gates that reach no loss."""
    inputs = make_weights(2, 9, 24, 16, 4, 2, True, seed=3)
    w1, w2, _ = output_gradients(inputs)
    check_gradients(inputs, (w1, w2, None), ("x",))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_gradients(dtype):
    inputs = make_weights(2, 17, 40, 12, 3, 2, True, seed=1)
    check_gradients(inputs, output_gradients(inputs), INPUTS, dtype)


def test_second_derivatives_are_torchs():
    """Under create_graph=True the backward is torch's ops, recomputed: a Hessian-vector product of x through the
    kernel equals torch's, float64-judged."""
    inputs = make_weights(1, 7, 24, 16, 4, 2, True, seed=4)
    direction = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    def hessian_vector(function, dtype):
        x = inputs[0].to(dtype).requires_grad_(True)
        w1, w2, gates = function(x, *[None if t is None else t.to(dtype) for t in inputs[1:]])
        loss = (w1.sin().sum() + (w2 * w2).sum() + gates.pow(3).sum()) / 10
        (dx,) = torch.autograd.grad(loss, x, create_graph=True)
        return torch.autograd.grad((dx * direction.to(dtype).to(DEVICE)).sum(), x)[0]

    exact = hessian_vector(torch_dynamic_weights, torch.float64)
    assert_as_exact(hessian_vector(fused_dynamic_weights, torch.float32),
                    hessian_vector(torch_dynamic_weights, torch.float32), exact, "Hessian-vector product")  # fmt: skip


def test_a_card_refusing_the_backward_kernel_takes_torchs_ops(monkeypatch):
    """Triton refusing to build the backward's kernel at its first launch: `on_refusal` is told, and the gradients
    are torch's ops' bit for bit; without `on_refusal` the error is raised."""
    OutOfResources = pytest.importorskip("triton.runtime.errors").OutOfResources
    inputs = [t.float().requires_grad_(True) for t in make_weights(1, 5, 16, 8, 2, 1, True, seed=6)]

    class Refused:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise OutOfResources(232_000, 101_376, "shared memory")

            return launch

    dynamic_weights.jit()
    monkeypatch.setattr(dynamic_weights, "_dynamic_weights_backward_kernel", Refused())
    told = []

    def loss(outputs):  # linear: the outputs' gradients do not depend on their rounding
        return sum((i + 1) * output.sum() for i, output in enumerate(outputs))

    grads = torch.autograd.grad(loss(fused_dynamic_weights(*inputs, on_refusal=told.append)), inputs)
    assert len(told) == 1 and isinstance(told[0], OutOfResources)
    expected = torch.autograd.grad(loss(torch_dynamic_weights(*inputs)), inputs)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(OutOfResources):
        torch.autograd.grad(loss(fused_dynamic_weights(*inputs)), inputs)


def test_bad_input_says_which_argument():
    x, W_in, b_in, W_out, W_gate, b_gate = [t.float() for t in make_weights(1, 3, 16, 8, 2, 1, True)]
    fused_dynamic_weights(x, W_in, b_in, W_out, W_gate, b_gate)  # checked once: other arguments still are
    with pytest.raises(ValueError, match="W_out must be"):
        fused_dynamic_weights(x, W_in, b_in, W_out[:, :, :1], W_gate, b_gate)
    with pytest.raises(ValueError, match="b_gate must be"):
        fused_dynamic_weights(x, W_in, b_in, W_out, W_gate, b_gate[:3])
    with pytest.raises(ValueError, match="x must be float32"):
        fused_dynamic_weights(x.double(), W_in, b_in, W_out, W_gate, b_gate)


# The model's choice.


@pytest.mark.parametrize(
    "facts, path",
    [
        (dict(), "triton"),
        (dict(device=torch.device("cpu")), "torch"),
        (dict(functorch_active=True), "torch"),
        (dict(dtypes={torch.float64}), "torch"),
        (dict(dtypes={torch.bfloat16}), "triton"),
        (dict(positions=dcmha.FUSED_DYNAMIC_WEIGHTS_POSITIONS), "triton"),
        (dict(positions=dcmha.FUSED_DYNAMIC_WEIGHTS_POSITIONS + 1), "torch"),
        (dict(refused={"cuda": "past its shared memory"}), "torch"),
        (dict(refused={"cuda:1": "past its shared memory"}), "triton"),
        (dict(unavailable="triton is not installed"), "torch"),
    ],
)
def test_the_rules(monkeypatch, facts, path):
    facts = {"device": CUDA, "dtypes": {torch.float32}, "positions": 100, **facts}
    unavailable = facts.pop("unavailable", None)
    monkeypatch.setattr(families, "triton_unavailable", lambda device: unavailable)
    monkeypatch.setattr(families.FUSED, "refused", {})
    monkeypatch.setattr(families.DYNAMIC_WEIGHTS, "refused", facts.pop("refused", {}))
    assert dcmha.dynamic_weights_path(**facts) == path


@pytest.fixture
def on_cuda(monkeypatch):
    """dynamic_weights_path told the tensors are on CUDA (they stay on this CPU, where the kernel runs interpreted);
    returns the paths taken, in order, and counts the kernel's calls."""
    return told_cuda(monkeypatch, dcmha, "dynamic_weights_path", dynamic_weights, "fused_dynamic_weights", DEVICE)


@pytest.fixture(scope="module", params=["dcpythia-tiny folded", "dcformer-tiny"])
def models(request):
    """The model, with the folded LayerNorm's biases b_dyn_in, b_dyn_gate (DCPythia) or without; its float64 copy."""
    name, *folded = request.param.split()
    model = HookedDCFormer.from_pretrained(os.path.join(FIXTURES, name), fold_ln=bool(folded), device=DEVICE)
    return model, float64_copy(model)


def tokens_for(model, batch=2, length=21):
    tokens = torch.randint(3, model.cfg.d_vocab, (batch, length), generator=torch.Generator().manual_seed(0))
    return tokens.to(DEVICE)


def torch_path(monkeypatch):
    """From now on, every layer's dynamic weights by torch's ops."""
    monkeypatch.setattr(dcmha, "dynamic_weights_path", lambda **facts: "torch")


def test_without_gradients_the_model_takes_the_kernel_and_its_logits(models, on_cuda, monkeypatch):
    model, model64 = models
    tokens = tokens_for(model)
    with torch.no_grad():
        logits = model(tokens)
        exact = model64(tokens)  # float64: torch's ops
    n = model.cfg.n_layers
    assert on_cuda["paths"] == ["triton"] * n + ["torch"] * n and on_cuda["calls"] == n
    torch_path(monkeypatch)
    with torch.no_grad():
        reference = model(tokens)
    assert on_cuda["calls"] == n
    assert_as_exact(logits, reference, exact, "logits")


def test_with_gradients_the_model_takes_the_kernel_and_its_gradients(models, on_cuda, monkeypatch):
    """An integrated-gradients step (the gradient of a logit to the input embeddings): every layer's dynamic weights
    by the kernel, forward and backward, the gradient as near float64's as torch's ops'."""
    model, model64 = models

    def input_gradient(model):
        embeddings = model.embed(tokens_for(model, batch=1, length=9)).detach().requires_grad_(True)
        model(embeddings, start_at_layer=0)[0, -1].logsumexp(-1).backward()
        return embeddings.grad

    gradient = input_gradient(model)
    assert on_cuda["paths"] == ["triton"] * model.cfg.n_layers and on_cuda["calls"] == model.cfg.n_layers
    exact = input_gradient(model64)  # float64: torch's ops
    torch_path(monkeypatch)
    assert_as_exact(gradient, input_gradient(model), exact, "the input's gradient")


def test_a_card_the_kernel_does_not_fit_gives_one_warning_and_torchs_result(models, on_cuda, monkeypatch):
    """Triton refusing to build the kernel at its first launch: one warning, that call by torch's ops, and the
    device the tensors are on told (`dynamic_weights_path` then answers "torch" for it: test_the_rules)."""
    OutOfResources = pytest.importorskip("triton.runtime.errors").OutOfResources

    def refuse(*args, **kwargs):
        raise OutOfResources(232_000, 101_376, "shared memory")

    monkeypatch.setattr(dynamic_weights, "fused_dynamic_weights", refuse)
    model, _ = models
    tokens = tokens_for(model)
    with warnings.catch_warnings(record=True) as record, torch.no_grad():
        warnings.simplefilter("always")
        out = model(tokens)
    said = [str(w.message) for w in record if "dynamic weights" in str(w.message)]
    assert len(said) == 1 and "take torch's ops: Triton cannot build the dynamic weights' kernel" in said[0]
    device = model.W_E.device  # the tensors' ("cuda:0" where DEVICE is "cuda")
    assert families.DYNAMIC_WEIGHTS.refused == {str(device): said[0].split(": ", 1)[1]}
    torch_path(monkeypatch)
    with torch.no_grad():
        reference = model(tokens)
    torch.testing.assert_close(out, reference, rtol=0, atol=0)


def test_arguments_are_checked_once_a_signature(monkeypatch):
    """Called again with the same shapes, dtypes and devices, the kernel skips the checks; any of them changed is
    checked again."""
    checked = []
    check = dynamic_weights._check
    monkeypatch.setattr(dynamic_weights, "_check", lambda *args: checked.append(args) or check(*args))
    monkeypatch.setattr(dynamic_weights, "_checked", {})
    inputs = [t.float() for t in make_weights(1, 3, 16, 8, 2, 1, True)]
    first, again = fused_dynamic_weights(*inputs), fused_dynamic_weights(*inputs)
    assert len(checked) == 1 and all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    fused_dynamic_weights(inputs[0][:, :2], *inputs[1:])
    fused_dynamic_weights(*inputs[:2], None, *inputs[3:])
    assert len(checked) == 3
