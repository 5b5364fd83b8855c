from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dcinterp import DCFormerConfig, HookedDCFormer
from dcinterp.circuits import (
    HeadDiversity,
    concat_spectrum,
    cumulative_variance,
    head_diversity,
    layer_diversity,
    ov_circuit,
    ov_logits,
    ov_top_tokens,
    qk_circuit,
)

FIXTURE = Path(__file__).resolve().parents[1] / "tests/fixtures/dcpythia-tiny"


def tiny(**overrides) -> HookedDCFormer:
    torch.manual_seed(0)
    cfg = dict(n_layers=2, d_model=32, n_heads=4, d_head=8, d_mlp=64, d_vocab=50)
    model = HookedDCFormer(DCFormerConfig(**{**cfg, **overrides}))
    with torch.no_grad():  # non-trivial norm weights and biases, so the hand computation checks them
        for name, p in model.named_parameters():
            if name.endswith((".w", ".b", "b_in", "b_out")):
                p.add_(torch.randn_like(p) * 0.3)
    return model


def layer_norm(x, norm):
    x = x - x.mean(-1, keepdim=True)
    return x / (x.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt() * norm.w + norm.b


# --------------------------------------------------------------------------------------------------
# OV token projection (Eq. 12)
@pytest.mark.parametrize("use_mlp, final_norm", [(True, False), (False, False), (True, True)])
def test_ov_logits_by_hand(use_mlp, final_norm):
    model = tiny()
    tokens = torch.tensor([3, 17, 42])
    layer, head = 1, 2
    x = model.W_E[tokens]
    if use_mlp:
        mlp = model.blocks[0].mlp
        hidden = F.gelu(layer_norm(x, model.blocks[0].ln2) @ mlp.W_in + mlp.b_in)
        x = x + hidden @ mlp.W_out + mlp.b_out
    attn = model.blocks[layer].attn
    out = layer_norm(x, model.blocks[layer].ln1) @ attn.W_V[head] @ attn.W_O[head]
    if final_norm:
        out = layer_norm(out, model.ln_final)
    expected = out @ model.W_U
    got = ov_logits(model, layer, head, tokens, use_mlp=use_mlp, final_norm=final_norm)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


class WordTokenizer:
    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)


def test_ov_top_tokens_table():
    model = tiny()
    model.tokenizer = WordTokenizer()
    frame = ov_top_tokens(model, 0, 1, [5, 9], k=4)
    assert list(frame.columns) == ["input", "rank", "token", "logit", "input_str", "token_str"]
    assert len(frame) == 8 and frame["input"].tolist() == [5] * 4 + [9] * 4
    top = ov_logits(model, 0, 1, [5, 9]).topk(4)
    assert frame["token"].tolist() == top.indices.flatten().tolist()
    assert frame.loc[frame["input"] == 9, "logit"].is_monotonic_decreasing
    assert frame["token_str"][0] == f"w{frame['token'][0]}"
    table = frame.pivot(index="input_str", columns="rank", values="token_str")
    assert table.shape == (2, 4)


def test_ov_logits_half_precision_and_mha():
    model = HookedDCFormer.from_pretrained(FIXTURE)
    full = ov_logits(model, 2, 3, [4, 5])
    half = ov_logits(model.to(torch.bfloat16), 2, 3, [4, 5])
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, full, atol=0.1 * full.abs().max().item(), rtol=0.05)
    assert ov_logits(tiny(use_dcmha=False), 1, 0, [1]).shape == (1, 50)


def test_circuits_as_factored_matrices():
    model = tiny()
    qk, ov = qk_circuit(model, 1, 3), ov_circuit(model, 1, 3)
    attn = model.blocks[1].attn
    torch.testing.assert_close(qk.AB, attn.W_Q[3] @ attn.W_K[3].T)
    torch.testing.assert_close(ov.AB, attn.W_V[3] @ attn.W_O[3])
    layer_qk = qk_circuit(model, 1)
    assert layer_qk.shape == (4, 32, 32)
    torch.testing.assert_close(layer_qk.AB, model.QK.AB[1])
    torch.testing.assert_close(ov_circuit(model, 0).AB, model.OV.AB[0])


# --------------------------------------------------------------------------------------------------
# Head diversity (Fig. 5)
def naive_layer_diversity(attn) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate the d_model x d_model circuits, then SVD (what `head_diversity` avoids)."""
    W_Q, W_K, W_V, W_O = (w.detach().double() for w in (attn.W_Q, attn.W_K, attn.W_V, attn.W_O))
    qk = torch.cat([W_Q[h] @ W_K[h].T for h in range(len(W_Q))], dim=1)
    ov = torch.cat([(W_V[h] @ W_O[h]).T for h in range(len(W_V))], dim=1)  # the paper's W_O W_V
    return tuple(cumulative_variance(torch.linalg.svdvals(m) ** 2) for m in (qk, ov))


@pytest.mark.parametrize("d_model, n_heads, d_head", [(32, 4, 8), (48, 4, 8), (16, 4, 8), (24, 3, 5)])
def test_head_diversity_equals_naive_svd(d_model, n_heads, d_head):
    model = tiny(d_model=d_model, n_heads=n_heads, d_head=d_head)
    result = head_diversity(model, dtype=torch.float64, qk_norm="ignore")  # raw W_Q W_K^T, as the naive one
    k = min(d_model, n_heads * d_head)
    assert result.qk.shape == result.ov.shape == (2, k) and result.layers == [0, 1]
    for layer in range(2):
        qk, ov = naive_layer_diversity(model.blocks[layer].attn)
        torch.testing.assert_close(result.qk[layer], qk[:k], atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(result.ov[layer], ov[:k], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(head_diversity(model, qk_norm="ignore").qk, result.qk.float(), atol=1e-4, rtol=1e-4)


def test_concat_spectrum_matches_svd_of_the_concatenation():
    torch.manual_seed(1)
    left, right = torch.randn(3, 10, 4, dtype=torch.float64), torch.randn(3, 4, 7, dtype=torch.float64)
    M = torch.cat(list(left @ right), dim=1)
    torch.testing.assert_close(concat_spectrum(left, right), torch.linalg.svdvals(M)[:10] ** 2)


def extreme_heads(kind: str, n_heads: int = 4, d_head: int = 8) -> dict[str, torch.Tensor]:
    """Identical heads (one circuit repeated) or orthogonal heads (each reads and writes its own block)."""
    d_model = n_heads * d_head
    if kind == "identical":
        torch.manual_seed(2)
        one = [torch.randn(d_model, d_head) for _ in range(4)]
        W_Q, W_K, W_V, O = (w.expand(n_heads, -1, -1) for w in one)
        return dict(W_Q=W_Q, W_K=W_K, W_V=W_V, W_O=O.transpose(1, 2))
    blocks = torch.eye(d_model).reshape(d_model, n_heads, d_head).transpose(0, 1)  # [head, d_model, d_head]
    return dict(W_Q=blocks, W_K=blocks, W_V=blocks, W_O=blocks.transpose(1, 2))


def test_head_diversity_extremes():
    identical = layer_diversity(**extreme_heads("identical"))
    orthogonal = layer_diversity(**extreme_heads("orthogonal"))
    for curve in identical:  # rank d_head: everything in the first 8 components (least diverse)
        torch.testing.assert_close(curve[7:], torch.ones(25), atol=1e-5, rtol=0)
        assert curve[6] < 1 - 1e-3
    linear = torch.arange(1, 33) / 32
    for curve in orthogonal:  # all 32 components equal: the diagonal (most diverse)
        torch.testing.assert_close(curve, linear, atol=1e-5, rtol=0)
    model = tiny()
    with torch.no_grad():  # a model whose layer 0 has identical heads and layer 1 orthogonal ones
        for layer, kind in enumerate(["identical", "orthogonal"]):
            for name, value in extreme_heads(kind).items():
                getattr(model.blocks[layer].attn, name).copy_(value)
    result = head_diversity(model, qk_norm="ignore")  # the raw weights set above (tiny() has random QK-norm scales)
    torch.testing.assert_close(result.qk[0], identical[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(result.ov[1], linear, atol=1e-5, rtol=0)
    random_model = head_diversity(tiny(), qk_norm="ignore")
    assert torch.all(result.qk[1] <= random_model.qk_mean + 1e-6)
    assert torch.all(random_model.qk_mean <= result.qk[0] + 1e-6)


def test_head_diversity_mha_half_and_frame():
    mha = head_diversity(tiny(use_dcmha=False), layers=[1])
    assert isinstance(mha, HeadDiversity) and mha.layers == [1] and mha.qk.shape == (1, 32)
    model = HookedDCFormer.from_pretrained(FIXTURE)
    full = head_diversity(model)
    half = head_diversity(model.to(torch.float16))
    assert half.qk.dtype == torch.float32
    torch.testing.assert_close(half.qk, full.qk, atol=2e-3, rtol=0)
    torch.testing.assert_close(full.qk_mean, full.qk.mean(0))
    frame = full.to_frame()
    assert set(frame["layer"]) == {0, 1, 2, 3, "mean"} and len(frame) == 2 * 5 * 32
    assert frame["captured"].between(0, 1 + 1e-6).all()


# --------------------------------------------------------------------------------------------------
# Head diversity conventions (docs/conventions.md)
def two_heads() -> dict[str, torch.Tensor]:
    """2 heads, d_model 2, d_head 1: QK circuits 2 e1 e1^T and e2 e2^T; OV circuits 3 e1 e1^T and e2 e2^T."""
    e1, e2 = torch.tensor([[1.0], [0.0]]), torch.tensor([[0.0], [1.0]])
    return dict(
        W_Q=torch.stack([2 * e1, e2]),
        W_K=torch.stack([e1, e2]),
        W_V=torch.stack([3 * e1, e2]),
        W_O=torch.stack([e1.T, e2.T]),
    )


def test_diversity_options_by_hand():
    w = two_heads()
    qk, ov = layer_diversity(**w)  # sigma^2: QK [4, 1] -> 0.8; OV [9, 1] -> 0.9
    assert qk.tolist() == pytest.approx([0.8, 1.0]) and ov.tolist() == pytest.approx([0.9, 1.0])
    qk, ov = layer_diversity(**w, spectrum="sigma")  # sigma: [2, 1] -> 2/3; [3, 1] -> 3/4
    assert qk[0].item() == pytest.approx(2 / 3) and ov[0].item() == pytest.approx(0.75)
    qk, ov = layer_diversity(**w, normalize="head")  # every head at unit norm: [1, 1] -> 0.5
    assert qk[0].item() == pytest.approx(0.5) and ov[0].item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="normalize must be one of"):
        layer_diversity(**w, normalize="layer")


def test_stacked_axis_equals_svd_of_the_stacked_concatenation():
    model = tiny()
    attn = model.blocks[1].attn
    result = head_diversity(model, layers=[1], dtype=torch.float64, qk_norm="ignore", axis="rows")
    W_Q, W_K, W_V, W_O = (w.detach().double() for w in (attn.W_Q, attn.W_K, attn.W_V, attn.W_O))
    qk = torch.cat([W_Q[h] @ W_K[h].T for h in range(4)], dim=0)
    ov = torch.cat([(W_V[h] @ W_O[h]).T for h in range(4)], dim=0)
    torch.testing.assert_close(result.qk[0], cumulative_variance(torch.linalg.svdvals(qk) ** 2))
    torch.testing.assert_close(result.ov[0], cumulative_variance(torch.linalg.svdvals(ov) ** 2))
    assert result.options["axis"] == "rows" and "HeadDiversity(1 layers" in repr(result)


def test_qk_norm_folding_and_head_normalisation():
    model = tiny()
    attn = model.blocks[0].attn
    folded = head_diversity(model, layers=[0], dtype=torch.float64)
    W_Q = attn.W_Q.detach().double() * attn.q_norm.w.detach().double()
    W_K = attn.W_K.detach().double() * attn.k_norm.w.detach().double()
    qk = torch.cat([W_Q[h] @ W_K[h].T for h in range(4)], dim=1)
    torch.testing.assert_close(folded.qk[0], cumulative_variance(torch.linalg.svdvals(qk) ** 2))
    # Rescaling one head's W_Q (and b_Q) leaves a QK-norm model's logits unchanged ...
    tokens = torch.randint(0, 50, (1, 12))
    with torch.no_grad():
        before = model(tokens)
        raw = head_diversity(model, dtype=torch.float64)
        per_head = head_diversity(model, dtype=torch.float64, normalize="head")
        attn.W_Q[2] *= 5
        attn.b_Q[2] *= 5
        after = model(tokens)
    assert (before - after).abs().max() < 1e-3
    # ... moves the raw QK curve, but not the per-head normalised one
    assert (head_diversity(model, dtype=torch.float64).qk - raw.qk).abs().max() > 0.05
    torch.testing.assert_close(head_diversity(model, dtype=torch.float64, normalize="head").qk, per_head.qk)


def test_ov_inputs_may_be_words_and_arguments_are_checked():
    model = HookedDCFormer.from_pretrained("dcpythia-synth")
    by_word = ov_top_tokens(model, 2, 0, ["burger", "papaya"], k=3)
    by_id = ov_top_tokens(model, 2, 0, model.tokenizer.convert_tokens_to_ids(["burger", "papaya"]), k=3)
    assert by_word.equals(by_id)
    with pytest.raises(ValueError, match="tokens='quokka' is not in the tokenizer's vocabulary"):
        ov_top_tokens(model, 2, 0, ["quokka"])
    with pytest.raises(ValueError, match=r"layer=3 is out of range: the model has layers 0..2"):
        ov_logits(model, 3, 0, [5])
    with pytest.raises(ValueError, match=r"head=-5 is out of range"):
        qk_circuit(model, 0, -5)
    with pytest.raises(ValueError, match="tokens: ids must be in"):
        ov_logits(model, 0, 0, [model.cfg.d_vocab])
