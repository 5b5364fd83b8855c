"""A cached decoding step with no hook (the lean few-queries path: `compose_decoding`, the shared rotary tables,
the cache's appends) gives what the hooked step gives (every branch output built and passed through its hook, the
reference), judged against the hooked step in float64 (tests/numerics.py): global and local layers of both window
semantics, a left-padded batch, and chunks of one to `FEW_QUERIES` new tokens; float32, and one bfloat16 case."""

from pathlib import Path

import pytest
import torch

import dcinterp.dcmha as dcmha
from dcinterp import DCFormerConfig, HookedDCFormer
from dcinterp.dcmha import materialised
from dcinterp.kv_cache import DCFormerKeyValueCache
from tests.numerics import assert_as_exact_as, float64_copy

FIXTURES = Path(__file__).parent / "fixtures"
SIZE = dict(n_layers=2, d_model=32, n_heads=4, d_head=8, d_mlp=64, d_vocab=50, n_ctx=64, window_size=5)
RANDOM = {
    "query-wise": dict(query_wise=True, window_type="LG"),
    "pre-only": dict(compose_stages=("pre",), window_type="LG"),
    "partial-rotary": dict(rotary_pct=0.25, window_type="LG", window="official-inference"),
}
FLOAT32_CASES = [
    (name, semantics, torch.float32)
    for name in ["dcpythia-tiny", "dcformer-tiny", *RANDOM]
    for semantics in ["training", "official-inference"]
]
CASES = [*FLOAT32_CASES, ("dcpythia-tiny", "training", torch.bfloat16)]  # bfloat16: the softmax in the half dtype
CHUNKS = [(0, 20), (20, 21), (21, 22), (22, 25), (25, 25 + dcmha.FEW_QUERIES)]  # a prompt, then 1, 1, 3, 16 tokens


def load(name: str) -> HookedDCFormer:
    if name in RANDOM:
        torch.manual_seed(0)
        return HookedDCFormer(DCFormerConfig(**SIZE, **RANDOM[name])).eval().requires_grad_(False)
    return HookedDCFormer.from_pretrained(FIXTURES / name)


def every_square_tensor_hooked(model: HookedDCFormer):
    """A no-op hook on every pattern and branch output: each layer takes the materialised path, per-branch tensors."""
    names = ("hook_pattern", "hook_o_qp", "hook_o_kp", "hook_o_qg", "hook_o_kg")
    return model.hooks(fwd_hooks=[(lambda name: name.endswith(names), lambda x, hook: None)])


def cached_steps(model: HookedDCFormer, tokens: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """The logits of each chunk of CHUNKS, fed in turn through one cache."""
    cache = DCFormerKeyValueCache.init_cache(model.cfg, "cpu", batch_size=tokens.shape[0])
    with torch.no_grad():
        return [model(tokens[:, a:b], attention_mask=mask[:, a:b], past_kv_cache=cache) for a, b in CHUNKS]


@pytest.mark.parametrize("name, semantics, dtype", CASES)
def test_a_no_hook_decoding_step_equals_the_hooked_one(name, semantics, dtype, monkeypatch):
    model = load(name).to(dtype)
    monkeypatch.setattr(model.cfg, "window", semantics)
    assert any(model.cfg.layer_window(layer) for layer in range(model.cfg.n_layers)), "a local layer is tested"
    n = CHUNKS[-1][1]
    tokens = torch.randint(3, model.cfg.d_vocab, (2, n), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(tokens)
    mask[1, :3] = 0  # the second row left-padded
    model64 = float64_copy(model)
    paths, choose = [], dcmha.choose_path

    def spy(**facts):
        paths.append(choose(**facts))
        return paths[-1]

    monkeypatch.setattr(dcmha, "choose_path", spy)
    lean = cached_steps(model, tokens, mask)
    assert paths.count("few_queries") == model.cfg.n_layers * (len(CHUNKS) - 1)
    with every_square_tensor_hooked(model):
        hooked = cached_steps(model, tokens, mask)
    with every_square_tensor_hooked(model64):
        exact = cached_steps(model64, tokens, mask)
    for (a, b), new, reference, exact_logits in zip(CHUNKS, lean, hooked, exact, strict=True):
        assert_as_exact_as(new, reference, exact_logits, f"{name}, {semantics}, tokens {a}:{b}")


@pytest.mark.parametrize("branches", ["qp", "kp", "qg", "kg", "qp kp", "qg kg", "qp kg", "qp kp qg kg"])
@pytest.mark.parametrize("queries", [1, 3])
def test_compose_decoding_is_compose_few_queries(branches, queries):
    """The fewest-operations compose of a decoding step against the few-queries compose (float64 the judge), for each
    set of branches that are on."""
    generator = torch.Generator().manual_seed(0)
    b, h, r, s = 2, 4, 2, 9

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    A = randn(b, h, queries, s)
    weights = dict(qw1=randn(b, queries, r, h), qw2=randn(b, queries, r, h), qg=randn(b, queries, h))
    weights.update(kw1=randn(b, r, h, s), kw2=randn(b, r, h, s), kg=randn(b, h, s))
    on = {
        name
        for branch in branches.split()
        for name in {"qp": ["qw1", "qw2"], "kp": ["kw1", "kw2"]}.get(branch, [branch])
    }
    weights = {name: w if name in on else None for name, w in weights.items()}
    as32 = {name: None if w is None else w.float() for name, w in weights.items()}
    exact = materialised.compose_few_queries(A, **weights)
    reference = materialised.compose_few_queries(A.float(), **as32)
    assert_as_exact_as(materialised.compose_decoding(A.float(), **as32), reference, exact, branches)


def test_a_batched_step_copies_nothing_of_the_cache(monkeypatch):
    """The cache holds keys and values head-major, so that a step's scores and P V are one batched matmul over (batch,
    head): with position-major storage torch copied every cached key and value for them at each step of a batch of
    more than one (a clone a matmul, found by counting a step's operations)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    seen, few_queries_z = [], dcmha.PATHS["few_queries"]

    def recorded(inputs):
        with Ops() as ops:
            z = few_queries_z(inputs)
        seen.append(ops.names)
        return z

    monkeypatch.setitem(dcmha.PATHS, "few_queries", recorded)
    model = load("dcpythia-tiny")
    tokens = torch.randint(3, model.cfg.d_vocab, (3, 24), generator=torch.Generator().manual_seed(0))
    cache = DCFormerKeyValueCache.init_cache(model.cfg, "cpu", batch_size=3)
    with torch.no_grad():
        model(tokens[:, :20], past_kv_cache=cache)
        for position in range(20, 24):  # one token a step
            model(tokens[:, position : position + 1], past_kv_cache=cache)
    assert len(seen) == model.cfg.n_layers * 4
    copies = {name for names in seen for name in names if name in ("aten::clone", "aten::copy_", "aten::contiguous")}
    assert not copies, copies
