"""Static weight analysis of attention heads: QK/OV circuits, OV token projection (Eq. 12), head diversity (Fig. 5).

These read weights only, so they apply to DCMHA and plain-MHA models alike. They ignore what the weights
do not show: rotary, QK-norm and (for DCMHA) the dynamic composition of heads.

OV token projection (App. G.1, Eq. 12), for a head (layer l, head h) and input token x:
    x = Embed(x);  x = x + MLP_0(LN_0^mlp(x))  (the "first MLP", optional);
    logits = Unembed(LN_l^attn(x) W_V^h W_O^h)  (optionally with the final norm before Unembed).

Head diversity (Cordonnier et al., 2020; paper Fig. 5): per layer, concatenate the heads' d_model x d_model
circuits side by side into one d_model x (n_heads * d_model) matrix M and report the cumulative share of
sum(sigma^2) captured by its first k singular values (uncentred PCA). A curve that rises slower means more
diverse heads. As in the paper: QK circuits W_Q^h W_K^hT; OV circuits written W_O W_V (the paper's column-vector
convention), i.e. (W_V^h W_O^h)^T in TransformerLens' row-vector one: the heads' write directions are compared.
M is never built: with M = concat_h(L_h R_h), M M^T = sum_h L_h (R_h R_h^T) L_h^T = Z Z^T for
Z = concat_h(L_h S_h) with S_h S_h^T = R_h R_h^T (S_h from the d_head x d_head Gram of R_h), so the spectrum
comes from the min(d_model, n_heads * d_head)-sized Gram matrix of Z.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens import FactoredMatrix

from .model import HookedDCFormer


# --------------------------------------------------------------------------------------------------
# Circuits as FactoredMatrix
def qk_circuit(model: HookedDCFormer, layer: int, head: int | None = None) -> FactoredMatrix:
    """W_Q W_K^T of one head [d_model, d_model], or of every head of the layer [head, d_model, d_model]."""
    attn = model.blocks[layer].attn
    W_Q, W_K = (attn.W_Q, attn.W_K) if head is None else (attn.W_Q[head], attn.W_K[head])
    return FactoredMatrix(W_Q, W_K.transpose(-2, -1))


def ov_circuit(model: HookedDCFormer, layer: int, head: int | None = None) -> FactoredMatrix:
    """W_V W_O of one head [d_model, d_model], or of every head of the layer [head, d_model, d_model]."""
    attn = model.blocks[layer].attn
    W_V, W_O = (attn.W_V, attn.W_O) if head is None else (attn.W_V[head], attn.W_O[head])
    return FactoredMatrix(W_V, W_O)


# --------------------------------------------------------------------------------------------------
# OV token projection (Eq. 12)
@torch.no_grad()
def ov_logits(
    model: HookedDCFormer,
    layer: int,
    head: int,
    tokens: Int[Tensor, "n"] | list[int],
    use_mlp: bool = True,
    final_norm: bool = False,
) -> Float[Tensor, "n d_vocab"]:
    """The logits that head (layer, head)'s OV circuit writes for each input token on its own (Eq. 12).

    use_mlp: add the first MLP's output to the embedding (the paper's choice); final_norm: apply the final
    norm before unembedding. The OV product runs in float32; the unembedding in the model's dtype.
    """
    tokens = torch.as_tensor(tokens, device=model.W_E.device).flatten()
    x = model.W_E[tokens][None]  # [1, n, d_model]
    if use_mlp:
        block = model.blocks[0]
        x = x + block.mlp(block.ln2(x))
    attn = model.blocks[layer].attn
    x = model.blocks[layer].ln1(x)[0].float()
    out = (x @ attn.W_V[head].float()) @ attn.W_O[head].float()  # [n, d_model]
    out = out.to(model.W_U.dtype)
    if final_norm:
        out = model.ln_final(out[None])[0]
    return (out @ model.W_U).float()


def ov_top_tokens(
    model: HookedDCFormer,
    layer: int,
    head: int,
    tokens: Int[Tensor, "n"] | list[int],
    k: int = 10,
    use_mlp: bool = True,
    final_norm: bool = False,
) -> pd.DataFrame:
    """The top-k output tokens of head (layer, head)'s OV circuit for each input token (Eq. 12).

    One row per (input, rank): input, rank, token, logit, and input_str / token_str when the model has a
    tokenizer. `frame.pivot(index="input_str", columns="rank", values="token_str")` gives the paper's table.
    """
    tokens = torch.as_tensor(tokens).flatten()
    top = ov_logits(model, layer, head, tokens, use_mlp, final_norm).topk(k, dim=-1)
    frame = pd.DataFrame({
        "input": tokens.repeat_interleave(k).tolist(),
        "rank": list(range(k)) * len(tokens),
        "token": top.indices.flatten().tolist(),
        "logit": top.values.flatten().tolist(),
    })
    if model.tokenizer is not None:
        decode = {i: model.tokenizer.decode([i]) for i in set(frame["input"]) | set(frame["token"])}
        frame["input_str"] = frame["input"].map(decode)
        frame["token_str"] = frame["token"].map(decode)
    return frame


# --------------------------------------------------------------------------------------------------
# Head diversity (Fig. 5)
def concat_spectrum(
    left: Float[Tensor, "head d_model d_head"], right: Float[Tensor, "head d_head d_out"]
) -> Float[Tensor, "k"]:
    """Squared singular values (descending) of M = concat_h(left[h] @ right[h]) along columns, without M.

    k = min(d_model, head * d_head): M has no more nonzero singular values. Computed in the inputs' dtype
    (pass float32 or float64).
    """
    gram = right @ right.transpose(-2, -1)  # [head, d_head, d_head] = R_h R_h^T
    eigvals, eigvecs = torch.linalg.eigh(gram)
    factor = eigvecs * eigvals.clamp_min(0).sqrt()[:, None, :]  # S_h with S_h S_h^T = R_h R_h^T
    Z = (left @ factor).transpose(0, 1).flatten(1)  # [d_model, head * d_head], Z Z^T = M M^T
    small = Z.T @ Z if Z.shape[1] <= Z.shape[0] else Z @ Z.T
    return torch.linalg.eigvalsh(small).flip(0).clamp_min(0)


def cumulative_variance(sigma2: Float[Tensor, "... k"]) -> Float[Tensor, "... k"]:
    """Share of the total variance captured by the first 1..k principal components."""
    return sigma2.cumsum(-1) / sigma2.sum(-1, keepdim=True)


def layer_diversity(
    W_Q: Float[Tensor, "head d_model d_head"],
    W_K: Float[Tensor, "head d_model d_head"],
    W_V: Float[Tensor, "head d_model d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    dtype: torch.dtype = torch.float32,
) -> tuple[Float[Tensor, "k"], Float[Tensor, "k"]]:
    """Cumulative captured variance of one layer's concatenated QK circuits and OV circuits."""
    W_Q, W_K, W_V, W_O = (w.detach().to(dtype) for w in (W_Q, W_K, W_V, W_O))
    qk = concat_spectrum(W_Q, W_K.transpose(-2, -1))  # concat_h W_Q^h W_K^hT
    ov = concat_spectrum(W_O.transpose(-2, -1), W_V.transpose(-2, -1))  # concat_h W_O^hT W_V^hT (paper: W_O W_V)
    return cumulative_variance(qk), cumulative_variance(ov)


@dataclass
class HeadDiversity:
    """Cumulative captured variance per layer: entry [i, k-1] is the share of the first k components."""

    layers: list[int]
    qk: Float[Tensor, "layer k"]
    ov: Float[Tensor, "layer k"]

    @property
    def qk_mean(self) -> Float[Tensor, "k"]:
        return self.qk.mean(0)

    @property
    def ov_mean(self) -> Float[Tensor, "k"]:
        return self.ov.mean(0)

    def to_frame(self) -> pd.DataFrame:
        """Long format: circuit ("qk"/"ov"), layer ("mean" for the mean over layers), components, captured."""
        rows = []
        for circuit in ("qk", "ov"):
            values = getattr(self, circuit)
            for name, curve in [*zip(self.layers, values), ("mean", values.mean(0))]:
                rows += [(circuit, name, k + 1, v) for k, v in enumerate(curve.tolist())]
        return pd.DataFrame(rows, columns=["circuit", "layer", "components", "captured"])


@torch.no_grad()
def head_diversity(
    model: HookedDCFormer, layers: list[int] | None = None, dtype: torch.dtype = torch.float32
) -> HeadDiversity:
    """Fig. 5: the cumulative variance captured by the principal components of each layer's concatenated
    QK and OV circuits (lower: more diverse heads). One layer's weights at a time, in `dtype`, on their device.
    """
    layers = list(range(model.cfg.n_layers)) if layers is None else list(layers)
    qk, ov = [], []
    for layer in layers:
        attn = model.blocks[layer].attn
        curves = layer_diversity(attn.W_Q, attn.W_K, attn.W_V, attn.W_O, dtype)
        qk.append(curves[0].cpu())
        ov.append(curves[1].cpu())
    return HeadDiversity(layers, torch.stack(qk), torch.stack(ov))


def compare_head_diversity(models: dict[str, HookedDCFormer], **kwargs) -> dict[str, HeadDiversity]:
    """`head_diversity` of several models (e.g. {"DCPythia": dc, "Pythia": mha}), for `plot_head_diversity`."""
    return {name: head_diversity(model, **kwargs) for name, model in models.items()}
