"""The loaded models reproduce the reference implementations' logits."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dcinterp import HookedDCFormer

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("name", ["dcpythia-tiny", "dcformer-tiny"])
def test_official_checkpoints_reproduce_reference_logits(name):
    model = HookedDCFormer.from_pretrained(FIXTURES / name)
    expected = load_file(FIXTURES / name / "expected.safetensors")
    with torch.no_grad():
        logits = model(expected["input_ids"])
    assert logits.shape == expected["logits"].shape
    assert (logits - expected["logits"]).abs().max().item() < 1e-4


def test_fixture_configs_are_read_as_documented():
    pythia = HookedDCFormer.from_pretrained(FIXTURES / "dcpythia-tiny").cfg
    assert (pythia.normalization_type, pythia.parallel_residual, pythia.act_fn, pythia.use_bias) == (
        "LN",
        True,
        "gelu",
        True,
    )
    assert pythia.rotary_dim == 2 and pythia.window_type == "LG"
    assert [pythia.layer_window(l) for l in range(4)] == [8, None, 8, None]
    dcformer = HookedDCFormer.from_pretrained(FIXTURES / "dcformer-tiny").cfg
    assert (dcformer.normalization_type, dcformer.parallel_residual, dcformer.act_fn) == ("RMS", False, "swiglu")
    assert [dcformer.layer_window(l) for l in range(4)] == [8, None, 8, 8]


def test_window_type_is_a_released_layout_or_any_local_global_pattern():
    from dcinterp.config import DCFormerConfig

    size = dict(n_layers=5, d_model=8, n_heads=2, d_head=4, d_mlp=16, d_vocab=10, n_ctx=32, window_size=4)
    assert [DCFormerConfig(**size, window_type="LGLL").layer_window(l) for l in range(5)] == [4, None, 4, 4, 4]
    assert [DCFormerConfig(**size, window_type="LGG").layer_window(l) for l in range(5)] == [4, None, None, 4, None]
    assert [DCFormerConfig(**size).layer_window(l) for l in range(5)] == [None] * 5
    with pytest.raises(ValueError, match="'LXG'"):
        DCFormerConfig(**size, window_type="LXG")


# Random weights amplify rounding from layer to layer, so the bound is on the mean relative error.
@pytest.mark.parametrize("dtype, tol", [(torch.float16, 0.02), (torch.bfloat16, 0.10)])
@pytest.mark.parametrize("name", ["dcpythia-tiny", "dcformer-tiny"])
def test_low_precision_loads_run_and_stay_close(name, dtype, tol):
    model = HookedDCFormer.from_pretrained(FIXTURES / name, dtype=dtype)
    assert all(p.dtype == dtype for p in model.parameters())
    expected = load_file(FIXTURES / name / "expected.safetensors")
    with torch.no_grad():
        logits = model(expected["input_ids"])
    assert logits.dtype == dtype
    assert torch.isfinite(logits).all()
    error = (logits.float() - expected["logits"]).abs().mean() / expected["logits"].abs().mean()
    assert error.item() < tol
    assert torch.nn.functional.cosine_similarity(logits.float().flatten(), expected["logits"].flatten(), dim=0) > 0.99


def tiny_gpt_neox(directory: Path, rotary_pct: float = 0.25):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPTNeoXConfig(
        vocab_size=61,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        rotary_pct=rotary_pct,
        rotary_emb_base=10000,
        use_parallel_residual=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = transformers.GPTNeoXForCausalLM(config).eval()
    with torch.no_grad():  # make the biases and norms non-trivial so their conversion is tested
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "layernorm" in name or "layer_norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(directory)
    return hf


@pytest.mark.parametrize("rotary_pct", [0.25, 1.0])
def test_gpt_neox_checkpoint_matches_transformers(tmp_path, rotary_pct):
    hf = tiny_gpt_neox(tmp_path, rotary_pct)
    model = HookedDCFormer.from_pretrained(tmp_path)
    assert not model.cfg.use_dcmha and model.cfg.rotary_pct == rotary_pct
    tokens = torch.randint(0, 61, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        logits = model(tokens)
    assert (logits - expected).abs().max().item() < 1e-4


def test_head_projections_read_the_weights_in_place_without_a_graph_and_agree_with_the_einsum():
    from dcinterp.model import project_heads

    generator = torch.Generator().manual_seed(0)
    x, W = torch.randn(3, 5, 16, generator=generator), torch.randn(4, 16, 8, generator=generator)
    expected = torch.einsum("bpd,hde->bphe", x, W)
    with torch.no_grad():
        fast = project_heads(x, W)
    assert fast.shape == (3, 5, 4, 8) and fast.permute(2, 0, 1, 3).is_contiguous()  # one matmul per head
    torch.testing.assert_close(fast, expected)
    x.requires_grad_(True)
    graph = project_heads(x, W)  # with a graph: the einsum, whose backward sums over heads in its matmul
    graph.pow(2).sum().backward()
    torch.testing.assert_close(x.grad, 2 * torch.einsum("bphe,hde->bpd", expected, W))
