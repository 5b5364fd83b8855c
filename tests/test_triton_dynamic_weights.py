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
from dcinterp.dcmha import dynamic_weights
from dcinterp.dcmha.dynamic_weights import fused_dynamic_weights, torch_dynamic_weights
from dcinterp.dcmha.triton_kernels import available
from tests.numerics import float64_copy
from tests.told_cuda import CUDA, told_cuda

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TIMES_REFERENCE_ERROR = 4
OUTPUTS = ("w1", "w2", "gates")

pytestmark = pytest.mark.skipif(available(DEVICE) is not None, reason=str(available(DEVICE)))


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
        (dict(gradient_needed=True), "torch"),
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
    facts = {"device": CUDA, "dtypes": {torch.float32}, "positions": 100, "gradient_needed": False, **facts}
    unavailable = facts.pop("unavailable", None)
    monkeypatch.setattr(dcmha, "triton_unavailable", lambda device: unavailable)
    monkeypatch.setattr(dcmha, "_refused_dynamic_weights", facts.pop("refused", {}))
    assert dcmha.dynamic_weights_path(**facts) == path


@pytest.fixture
def on_cuda(monkeypatch):
    """dynamic_weights_path told the tensors are on CUDA (they stay on this CPU, where the kernel runs interpreted);
    returns the paths taken, in order, and counts the kernel's calls."""
    return told_cuda(
        monkeypatch,
        "dynamic_weights_path",
        dynamic_weights,
        "fused_dynamic_weights",
        "_refused_dynamic_weights",
        DEVICE,
    )


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


def test_with_gradients_the_model_takes_torchs_ops(models, on_cuda):
    model, _ = models
    tokens = tokens_for(model, batch=1, length=9)
    embeddings = model.embed(tokens).detach().requires_grad_(True)
    model(embeddings, start_at_layer=0)[0, -1].sum().backward()
    assert on_cuda["paths"] == ["torch"] * model.cfg.n_layers and on_cuda["calls"] == 0
    assert embeddings.grad is not None and embeddings.grad.abs().sum() > 0


def test_a_card_the_kernel_does_not_fit_gives_one_warning_and_torchs_result(models, on_cuda, monkeypatch):
    """Triton refusing to build the kernel at its first launch: one warning, that call by torch's ops, and the
    device the tensors are on told (`dynamic_weights_path` then answers "torch" for it: test_the_rules)."""
    OutOfResources = pytest.importorskip("triton.runtime.errors").OutOfResources

    def refuse(*args):
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
    assert dcmha._refused_dynamic_weights == {str(device): said[0].split(": ", 1)[1]}
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
