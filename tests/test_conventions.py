"""The switchable conventions of docs/conventions.md that live in the model: window semantics and rotary."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dcinterp import HookedDCFormer
from dcinterp.config import DCFormerConfig
from dcinterp.model import apply_rotary, attention_mask

FIXTURES = Path(__file__).parent / "fixtures"


def test_window_semantics_admit_window_or_window_plus_one_keys():
    training = attention_mask(6, 2, "cpu") == 0
    official = attention_mask(6, 2, "cpu", semantics="official-inference") == 0
    assert training[5].tolist() == [False, False, False, False, True, True]
    assert official[5].tolist() == [False, False, False, True, True, True]
    assert (attention_mask(6, None, "cpu", semantics="official-inference") == attention_mask(6, None, "cpu")).all()


def test_official_inference_window_reproduces_the_authors_inference_logits():
    """Logits from the authors' unpatched modeling_dcpythia.py on 24 tokens, window 8 (see the .md beside it)."""
    model = HookedDCFormer.from_pretrained(FIXTURES / "dcpythia-tiny")
    official = load_file(FIXTURES / "dcpythia-tiny" / "expected_official_inference.safetensors")
    training = load_file(FIXTURES / "dcpythia-tiny" / "expected.safetensors")
    assert torch.equal(official["input_ids"], training["input_ids"])
    with torch.no_grad():
        default = model(official["input_ids"])
        model.cfg.window = "official-inference"
        matched = model(official["input_ids"])
    assert (matched - official["logits"]).abs().max() < 1e-4
    assert (default - training["logits"]).abs().max() < 1e-4
    assert (default - official["logits"]).abs().max() > 0.5  # the two conventions really differ here


def test_window_option_is_validated():
    with pytest.raises(ValueError, match="window must be one of"):
        DCFormerConfig(n_layers=1, d_model=8, n_heads=2, d_head=4, d_mlp=8, d_vocab=5, window="inference")


def test_odd_rotary_dim_rounds_down_to_pairs_and_keeps_every_dimension():
    cfg = DCFormerConfig(n_layers=1, d_model=12, n_heads=2, d_head=6, d_mlp=8, d_vocab=5, rotary_pct=0.5)
    assert cfg.rotary_dim == 2  # 6 * 0.5 = 3 -> 2
    x = torch.randn(1, 5, 2, 6)
    y = apply_rotary(x, cfg.rotary_dim, 10000.0)
    assert y.shape == x.shape
    assert torch.equal(y[..., 2:], x[..., 2:])  # the odd dim passes through
    assert torch.allclose(y[..., :2].norm(dim=-1), x[..., :2].norm(dim=-1), atol=1e-6)  # a rotation
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        apply_rotary(x, 3, 10000.0)
    model = HookedDCFormer(cfg)
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, 5)


def test_float16_rotary_tables_are_rounded():
    x = torch.randn(1, 300, 1, 8)
    exact, rounded = apply_rotary(x, 8, 10000.0), apply_rotary(x, 8, 10000.0, torch.float16)
    assert 0 < (exact - rounded).abs().max() < 1e-2
