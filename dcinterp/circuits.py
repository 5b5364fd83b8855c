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
comes from the min(d_model, n_heads * d_head)-sized Gram matrix of Z. For a large model the first k components
come from block Lanczos on Z^T Z instead (`top_spectrum`), with the total variance from the trace ||Z||_F^2, so
the first k cumulative shares are exact to a checked bound (docs/head-diversity.md).

What the paper leaves open (docs/conventions.md), each an argument of `head_diversity`:
- qk_norm: "fold" (default) multiplies the QK-norm scales into W_Q and W_K (q = norm(x W_Q) * g_q, so the
  bilinear form is W_Q diag(g_q g_k) W_K^T up to the per-vector normalisation); "ignore" reads W_Q, W_K raw.
- normalize: "none" (default, the paper's reading) or "head": each head's circuit scaled to unit Frobenius norm
  before concatenation. With QK-norm, rescaling one head's W_Q leaves the model's output unchanged but moves the
  raw QK curve: only normalize="head" makes the QK curve of a QK-norm model well defined, and only QK curves
  computed that way are comparable between QK-norm and plain models. OV circuits are not normalised by the model,
  so their raw scale is meaningful.
- axis: "columns" (default: heads side by side, d_model x H*d_model, the write/read directions compared) or
  "rows" (stacked, H*d_model x d_model).
- spectrum: "sigma2" (default: variance, as PCA) or "sigma" (singular values).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm
from transformer_lens import FactoredMatrix

from .checks import check_head, check_layer, word_token
from .config import parse_dtype
from .model import HookedDCFormer, at_least_float32
from .processing import require_raw_weights


# --------------------------------------------------------------------------------------------------
# Circuits as FactoredMatrix
def qk_circuit(model: HookedDCFormer, layer: int, head: int | None = None) -> FactoredMatrix:
    """The QK circuit W_Q W_K^T of one head, or of every head of a layer.

    Args:
        model: the model whose weights are read.
        layer: the layer.
        head: one head, or None for every head of the layer.

    Returns:
        A FactoredMatrix [d_model, d_model], or [head, d_model, d_model] for every head.

    Raises:
        ValueError: `layer` or `head` is not in the model.
    """
    attn = model.blocks[check_layer(model, layer)].attn
    head = None if head is None else check_head(model, head)
    W_Q, W_K = (attn.W_Q, attn.W_K) if head is None else (attn.W_Q[head], attn.W_K[head])
    return FactoredMatrix(W_Q, W_K.transpose(-2, -1))


def ov_circuit(model: HookedDCFormer, layer: int, head: int | None = None) -> FactoredMatrix:
    """The OV circuit W_V W_O of one head, or of every head of a layer.

    Args:
        model: the model whose weights are read.
        layer: the layer.
        head: one head, or None for all of them.

    Returns:
        A FactoredMatrix: [d_model, d_model] for one head, [head, d_model, d_model] for all.

    Raises:
        ValueError: a layer or head the model does not have.
    """
    attn = model.blocks[check_layer(model, layer)].attn
    head = None if head is None else check_head(model, head)
    W_V, W_O = (attn.W_V, attn.W_O) if head is None else (attn.W_V[head], attn.W_O[head])
    return FactoredMatrix(W_V, W_O)


# --------------------------------------------------------------------------------------------------
# OV token projection (Eq. 12)
def input_ids(model: HookedDCFormer, tokens) -> Tensor:
    """Token ids from ids or words.

    Args:
        model: the model; its tokenizer turns words into ids.
        tokens: token ids (an int, a list or a tensor), a word, or a list mixing ids and words. Each word must be
            one token.

    Returns:
        The ids [n].

    Raises:
        ValueError: a word splits into several tokens (named), or `tokens` holds no integer id.
        TypeError: `tokens` is neither ids nor words.
    """
    if isinstance(tokens, str):
        tokens = [tokens]
    if isinstance(tokens, (list, tuple)) and any(isinstance(t, str) for t in tokens):
        tokens = [word_token(model, t, piece="only", name="tokens") if isinstance(t, str) else t for t in tokens]
    try:
        ids = torch.as_tensor(tokens).flatten()
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"tokens must be token ids or words, not {tokens!r}") from None
    if ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"tokens must be one or more integer token ids or words, not {tokens!r}")
    return ids


@torch.no_grad()
def ov_logits(
    model: HookedDCFormer,
    layer: int,
    head: int,
    tokens: Int[Tensor, " n"] | list[int],
    use_mlp: bool = True,
    final_norm: bool = False,
) -> Float[Tensor, "n d_vocab"]:
    """The logits that a head's OV circuit writes for each input token on its own (Eq. 12).

    The OV product runs in float32; the unembedding in the model's dtype.

    Args:
        model: the model, with its raw weights (not TransformerLens-processed).
        layer: the head's layer.
        head: the head.
        tokens: input token ids [n], or words where the model has a tokenizer (each one token).
        use_mlp: add the first MLP's output to the embedding (the paper's choice).
        final_norm: apply the final norm before unembedding.

    Returns:
        The logits [n, d_vocab], float32.

    Raises:
        ValueError: a layer, head or token id out of range, or processed weights.
    """
    require_raw_weights(model, "ov_logits (Eq. 12)")
    layer, head = check_layer(model, layer), check_head(model, head)
    tokens = input_ids(model, tokens).to(model.input_device)
    if not ((tokens >= 0) & (tokens < model.cfg.d_vocab)).all():
        raise ValueError(f"tokens: ids must be in 0..{model.cfg.d_vocab - 1}")
    x = model.W_E[tokens][None]  # [1, n, d_model]
    if use_mlp:
        block = model.blocks[0]
        x = x + block.mlp(block.ln2(x))
    attn = model.blocks[layer].attn
    x = at_least_float32(model.blocks[layer].ln1(x)[0])
    out = (x @ at_least_float32(attn.W_V[head])) @ at_least_float32(attn.W_O[head])  # [n, d_model]
    out = out.to(model.W_U.dtype)
    if final_norm:
        out = model.ln_final(out[None])[0]
    return at_least_float32(out @ model.W_U)


def ov_top_tokens(
    model: HookedDCFormer,
    layer: int,
    head: int,
    tokens: Int[Tensor, " n"] | list[int],
    k: int = 10,
    use_mlp: bool = True,
    final_norm: bool = False,
) -> pd.DataFrame:
    """The top-k output tokens of a head's OV circuit for each input token (Eq. 12).

    `frame.pivot(index="input_str", columns="rank", values="token_str")` gives the paper's table.

    Args:
        model: the model, with its raw weights.
        layer: the head's layer.
        head: the head.
        tokens: input token ids [n], or words where the model has a tokenizer (each one token).
        k: how many output tokens per input.
        use_mlp: add the first MLP's output to the embedding (the paper's choice).
        final_norm: apply the final norm before unembedding.

    Returns:
        One row per (input, rank): input, rank, token, logit, and input_str / token_str when the model has a
        tokenizer.

    Raises:
        ValueError: `k` is not in 1..d_vocab, or as `ov_logits`.
    """
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= model.cfg.d_vocab:
        raise ValueError(f"k={k!r} must be an integer in 1..{model.cfg.d_vocab} (the vocabulary's size)")
    tokens = input_ids(model, tokens)
    top = ov_logits(model, layer, head, tokens, use_mlp, final_norm).topk(k, dim=-1)
    frame = pd.DataFrame(
        {
            "input": tokens.repeat_interleave(k).tolist(),
            "rank": list(range(k)) * len(tokens),
            "token": top.indices.flatten().tolist(),
            "logit": top.values.flatten().tolist(),
        }
    )
    if model.tokenizer is not None:
        decode = {i: model.tokenizer.decode([i]) for i in set(frame["input"]) | set(frame["token"])}
        frame["input_str"] = frame["input"].map(decode)
        frame["token_str"] = frame["token"].map(decode)
    return frame


# --------------------------------------------------------------------------------------------------
# Head diversity (Fig. 5)
def concat_spectrum(
    left: Float[Tensor, "head d_model d_head"], right: Float[Tensor, "head d_head d_out"]
) -> Float[Tensor, " k"]:
    """Squared singular values of M = concat_h(left[h] @ right[h]) along columns, without forming M.

    Computed in the inputs' dtype (pass float32 or float64).

    Args:
        left: the heads' left factors [head, d_model, d_head].
        right: the heads' right factors [head, d_head, d_out].

    Returns:
        The squared singular values [k], descending, k = min(d_model, head * d_head): M has no more nonzero ones.
    """
    Z = concat_factor(left, right)  # [d_model, head * d_head], Z Z^T = M M^T
    return torch.linalg.eigvalsh(gram_lower(Z)).flip(0).clamp_min(0)


def concat_factor(
    left: Float[Tensor, "head d_model d_head"], right: Float[Tensor, "head d_head d_out"]
) -> Float[Tensor, "d_model n"]:
    """A factor Z with Z Z^T = M M^T for M = concat_h(left[h] right[h]): Z = concat_h(left[h] S_h).

    S_h S_h^T = right[h] right[h]^T: S_h is the Cholesky factor, or, where a head's Gram matrix is singular, comes
    from its eigendecomposition.

    Args:
        left: the heads' left factors [head, d_model, d_head].
        right: the heads' right factors [head, d_head, d_out].

    Returns:
        Z [d_model, head * d_head].
    """
    gram = right @ right.transpose(-2, -1)
    factor, info = torch.linalg.cholesky_ex(gram)
    if bool(info.any()):
        eigvals, eigvecs = torch.linalg.eigh(gram)
        factor = eigvecs * eigvals.clamp_min(0).sqrt()[:, None, :]
    return (factor.mT @ left.mT).flatten(0, 1).T  # a view of Z^T, built in place: [head * d_head, d_model]


def gram_lower(Z: Float[Tensor, "m n"], block: int = 512) -> Float[Tensor, "r r"]:
    """The smaller Gram matrix of Z, on and below the diagonal only, which is all `torch.linalg.eigvalsh` reads.

    Computed a block row at a time, so that the blocks above the diagonal are never computed (docs/head-diversity.md);
    above the diagonal it holds zeros, the blocks next to the diagonal aside.

    Args:
        Z: the matrix [m, n].
        block: rows per block.

    Returns:
        Z^T Z or Z Z^T, whichever is smaller: [r, r], r = min(m, n).
    """
    Zt = Z.T if Z.shape[1] <= Z.shape[0] else Z  # [r, *]: the Gram matrix is Zt @ Zt^T
    r = Zt.shape[0]
    gram = Zt.new_zeros(r, r)
    for start in range(0, r, block):
        end = min(start + block, r)
        gram[start:end, :end] = Zt[start:end] @ Zt[:end].T
    return gram


@dataclass
class TopSpectrum:
    """The k largest squared singular values of a matrix, its total sum(sigma^2), and a bound on the error of their
    cumulative sums relative to the total.

    Attributes:
        sigma2: the k largest squared singular values [k], descending.
        total: sum(sigma^2) over every singular value, ||Z||_F^2.
        bound: the error bound on each cumulative sum relative to `total` (0 from a full eigendecomposition).
        krylov_dim: the size of the Krylov space that reached the bound (0: full eigendecomposition).
    """

    sigma2: Float[Tensor, " k"]
    total: float
    bound: float
    krylov_dim: int


def top_spectrum(
    Z: Float[Tensor, "m n"],
    k: int,
    tol: float = 1e-6,
    block: int | None = None,
    generator: torch.Generator | None = None,
) -> TopSpectrum:
    """The k largest eigenvalues of Z^T Z (squared singular values of Z) by block Lanczos, never forming Z^T Z.

    Block Lanczos with full reorthogonalisation; the total comes from the trace, ||Z||_F^2. The Krylov space grows
    until the error bound on every cumulative sum, relative to the total, is below `tol`. Ritz values never exceed
    the eigenvalues they approximate (Cauchy interlacing), so each cumulative error is at most that of the first
    k' >= k, and with residuals r_i that falls short by at most sum_{i<=k} ||r_i|| or, for any k' >= k,
    sum_{i<=k'} ||r_i||^2 / gap_k' with gap_k' = theta_k' - (theta_{k'+1} + ||r_{k'+1}||) (the quadratic residual
    bound, taken at the k' with the best ratio). The residuals come from the Lanczos relation A V = V T + Q R E^T,
    kept exact by adding the reorthogonalisation's coefficients to T: ||r_i|| = ||R y_i|| over the last block of the
    Ritz vector y_i.

    The bound is checked at 2k Krylov vectors, then a third of the way to where the log-linear decrease between the
    last two checks says it reaches `tol`, at most half as many vectors again: convergence speeds up, most on flat
    spectra (i.i.d. weights), whose first checks predict several times the vectors they need. Past half of n vectors
    the dense eigendecomposition of the Gram matrix costs less, and is computed instead (bound 0).

    Args:
        Z: the matrix [m, n].
        k: how many eigenvalues.
        tol: the error bound to reach on every cumulative sum, relative to the total.
        block: the Lanczos block size (None: between 8 and 32, from k).
        generator: draws the random start block (None: seeded 0, so that the same Z gives the same numbers).

    Returns:
        The spectrum, its total, the bound reached and the Krylov space's size.
    """
    small_side = Z.shape[1] <= Z.shape[0]
    n = min(Z.shape)
    block = block or min(32, max(8, k // 4))
    total = squared_norm(Z)
    capacity = n // 2
    if 2 * k + block > capacity or total == 0:
        return _full_top_spectrum(Z, k, total)
    generator = generator or torch.Generator().manual_seed(0)

    # Z and Z^T both row-major: then neither product reads a transposed matrix, which costs more over a run than
    # the copy (docs/head-diversity.md)
    Z, Zt = Z.contiguous(), Z.T.contiguous()

    def apply(X: Tensor) -> Tensor:
        return Zt @ (Z @ X) if small_side else Z @ (Zt @ X)

    V, AV, T = Z.new_empty(n, capacity), Z.new_empty(n, capacity), Z.new_zeros(capacity, capacity)  # T = V^T A V
    V[:, :block] = torch.linalg.qr(torch.randn(n, block, generator=generator).to(Z))[0]
    AV[:, :block] = apply(V[:, :block])
    T[:block, :block] = V[:, :block].T @ AV[:, :block]
    m, next_check, previous, best = block, 2 * k, None, math.inf
    while True:
        if m + block > capacity and m < next_check:
            return _full_top_spectrum(Z, k, total)
        last, local = slice(m - block, m), slice(max(0, m - 2 * block), m)
        W = AV[:, last] - V[:, local] @ T[local, last]  # the three-term recurrence, then one full pass
        coefficients = V[:, :m].T @ W
        W -= V[:, :m] @ coefficients
        T[:m, last] += coefficients
        T[last, : m - block] = T[: m - block, last].T
        Q, R = torch.linalg.qr(W)  # A V = V T + Q R E^T
        if m >= next_check:
            theta, Y = _ritz_pairs(T[:m, :m], k + block + 1)
            residuals = (R @ Y[m - block :]).double().norm(dim=0)
            bound = _cumulative_error_bound(theta, residuals, k) / total
            best = min(best, bound)  # Ritz values only grow with the Krylov space: an earlier bound still holds
            if best <= tol:
                return TopSpectrum(theta[:k].clamp_min(0).to(Z.dtype), total, best, m)
            step = 0.5 * m
            if previous is not None and 0 < bound < previous[1]:
                to_tol = math.log(bound / tol) * (m - previous[0]) / math.log(previous[1] / bound)
                step = min(to_tol / 3, step)
            next_check = m + block * max(1, round(step / block))
            previous = (m, bound)
            if m + block > capacity:
                return _full_top_spectrum(Z, k, total)
        V[:, m : m + block] = Q
        AV[:, m : m + block] = apply(Q)
        T[m : m + block, m : m + block] = Q.T @ AV[:, m : m + block]
        T[last, m : m + block] = R.T
        T[m : m + block, last] = R
        m += block


def squared_norm(Z: Tensor) -> float:
    """||Z||_F^2, accumulated in float64 a slice of rows at a time (no float64 copy of Z).

    Args:
        Z: the matrix [m, n].

    Returns:
        The squared Frobenius norm.
    """
    return float(sum(torch.sum(rows * rows, dtype=torch.float64) for rows in Z.split(256)))


def _ritz_pairs(T: Tensor, count: int) -> tuple[Float[Tensor, " count"], Float[Tensor, "m count"]]:
    """The `count` largest eigenpairs of the projected matrix T, descending, values in float64."""
    theta, Y = torch.linalg.eigh((T + T.T) / 2)  # in T's dtype: float32's rounding is far below tol
    count = min(count, T.shape[0])
    return theta.double().flip(0)[:count], Y.flip(1)[:, :count]


def _cumulative_error_bound(theta: Tensor, residuals: Tensor, k: int) -> float:
    """Bound on sum_{i<=k} (lambda_i - theta_i) from Ritz values and residual norms (see `top_spectrum`)."""
    linear = float(residuals[:k].sum())
    gaps = theta[k - 1 : -1] - theta[k:] - residuals[k:]  # after k' = k, k + 1, ...
    squares = residuals.pow(2).cumsum(0)[k - 1 : -1]  # sum_{i<=k'} ||r_i||^2
    quadratic = torch.where(gaps > 0, squares / gaps.clamp_min(1e-300), math.inf)
    return min(linear, float(quadratic.min())) if len(quadratic) else linear


def _full_top_spectrum(Z: Tensor, k: int, total: float) -> TopSpectrum:
    return TopSpectrum(torch.linalg.eigvalsh(gram_lower(Z)).flip(0)[:k].clamp_min(0), total, 0.0, 0)


def cumulative_variance(sigma2: Float[Tensor, "... k"], total: float | Tensor | None = None) -> Float[Tensor, "... k"]:
    """Share of the total variance captured by the first 1..k principal components.

    Args:
        sigma2: squared singular values [..., k], descending.
        total: the total variance (None: sigma2's sum).

    Returns:
        The cumulative shares [..., k].
    """
    return sigma2.cumsum(-1) / (sigma2.sum(-1, keepdim=True) if total is None else total)


Components = int | Literal["all", "auto"]
AUTO_FULL_SIZE = 1024  # components="auto": every component up to this Gram size, else the first AUTO_COMPONENTS
AUTO_COMPONENTS = 128
Normalize = Literal["none", "head"]
Axis = Literal["columns", "rows"]
Spectrum = Literal["sigma2", "sigma"]


def _check_choice(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, not {value!r}")


def circuits_spectrum(
    left: Float[Tensor, "head d_model d_head"],
    right: Float[Tensor, "head d_head d_out"],
    normalize: Normalize = "none",
    axis: Axis = "columns",
    components: int | None = None,
    tol: float = 1e-6,
) -> TopSpectrum:
    """Squared singular values of the heads' circuits left[h] @ right[h] concatenated along `axis`.

    Args:
        left: the heads' left factors [head, d_model, d_head].
        right: the heads' right factors [head, d_head, d_out].
        normalize: "head" scales each head's circuit to unit Frobenius norm first; "none" leaves them.
        axis: "columns" (side by side) or "rows" (stacked).
        components: None for all of them; else the first `components`, with the total from the trace
            (`top_spectrum`).
        tol: the error bound on the cumulative shares when `components` is set.

    Returns:
        The spectrum with its total and error bound.
    """
    if normalize == "head":  # ||L R||_F^2 = trace(L^T L R R^T)
        norms = torch.einsum("hde,hdf,hfo,hgo->h", left, left, right, right).clamp_min(1e-30).sqrt()
        left = left / norms[:, None, None]
    if axis == "rows":  # stacked: the spectrum of concat_h(C_h^T) side by side
        left, right = right.transpose(-2, -1), left.transpose(-2, -1)
    if components is None:
        sigma2 = concat_spectrum(left, right)
        return TopSpectrum(sigma2, float(sigma2.double().sum()), 0.0, 0)
    return top_spectrum(concat_factor(left, right), components, tol)


def resolve_components(components: Components, size: int, spectrum: str) -> int | None:
    """The number of components to compute for a Gram matrix of `size`.

    Args:
        components: "all", "auto" (all up to AUTO_FULL_SIZE, else AUTO_COMPONENTS) or a positive int.
        size: the Gram matrix's size.
        spectrum: "sigma" needs every singular value, so always gives all.

    Returns:
        The number of components, or None for all.

    Raises:
        ValueError: `components` is none of the above.
    """
    if components == "all" or spectrum == "sigma":  # sum(sigma) needs every singular value
        return None
    if components == "auto":
        return None if size <= AUTO_FULL_SIZE else AUTO_COMPONENTS
    if not isinstance(components, int) or components < 1:
        raise ValueError(f"components must be a positive int, 'all' or 'auto', not {components!r}")
    return None if components >= size else components


def layer_diversity(
    W_Q: Float[Tensor, "head d_model d_head"],
    W_K: Float[Tensor, "head d_model d_head"],
    W_V: Float[Tensor, "head d_model d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    dtype: torch.dtype = torch.float32,
    normalize: Normalize = "none",
    axis: Axis = "columns",
    spectrum: Spectrum = "sigma2",
    components: Components = "all",
    tol: float = 1e-6,
    return_bounds: bool = False,
):
    """Cumulative captured variance of one layer's concatenated QK circuits and OV circuits.

    Args:
        W_Q: [head, d_model, d_head].
        W_K: [head, d_model, d_head].
        W_V: [head, d_model, d_head].
        W_O: [head, d_head, d_model].
        dtype: what the spectra are computed in, float32 or float64.
        normalize: as `head_diversity`.
        axis: as `head_diversity`.
        spectrum: as `head_diversity`.
        components: as `head_diversity`.
        tol: as `head_diversity`.
        return_bounds: also return the error bound of each curve (0 for a full decomposition).

    Returns:
        (qk, ov) curves [k], and with `return_bounds` a third item (qk_bound, ov_bound).

    Raises:
        ValueError: an option not among its choices, or a `dtype` other than float32 and float64.
    """
    _check_choice("normalize", normalize, ("none", "head"))
    _check_choice("axis", axis, ("columns", "rows"))
    _check_choice("spectrum", spectrum, ("sigma2", "sigma"))
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(
            f"head diversity: dtype={dtype} is what the spectra are computed in, and torch.linalg has only float32 "
            "and float64 decompositions; pass one of those (any weights are read into it)"
        )
    W_Q, W_K, W_V, W_O = (w.detach().to(dtype) for w in (W_Q, W_K, W_V, W_O))
    k = resolve_components(components, min(W_Q.shape[1], W_Q.shape[0] * W_Q.shape[2]), spectrum)
    qk = circuits_spectrum(W_Q, W_K.transpose(-2, -1), normalize, axis, k, tol)  # concat_h W_Q^h W_K^hT
    # concat_h W_O^hT W_V^hT (paper: W_O W_V)
    ov = circuits_spectrum(W_O.transpose(-2, -1), W_V.transpose(-2, -1), normalize, axis, k, tol)
    if spectrum == "sigma":
        curves = cumulative_variance(qk.sigma2.sqrt()), cumulative_variance(ov.sigma2.sqrt())
    else:
        curves = cumulative_variance(qk.sigma2, qk.total), cumulative_variance(ov.sigma2, ov.total)
    return (*curves, (qk.bound, ov.bound)) if return_bounds else curves


@dataclass
class HeadDiversity:
    """Cumulative captured variance per layer: entry [i, k-1] is the share of the first k components.

    Attributes:
        layers: the layers, one row each.
        qk: the QK circuits' curves [layer, k].
        ov: the OV circuits' curves [layer, k].
        options: qk_norm, normalize, axis, spectrum and components, as computed.
        bound: the largest error bound on any entry (0: every spectrum from a full decomposition).
    """

    layers: list[int]
    qk: Float[Tensor, "layer k"]
    ov: Float[Tensor, "layer k"]
    options: dict = None
    bound: float = 0.0

    def __repr__(self) -> str:
        k = min(4, self.qk.shape[1])
        return (
            f"HeadDiversity({len(self.layers)} layers, {self.options}; mean captured by {k} components: "
            f"QK {self.qk_mean[k - 1]:.3f}, OV {self.ov_mean[k - 1]:.3f})"
        )

    @property
    def qk_mean(self) -> Float[Tensor, " k"]:
        return self.qk.mean(0)

    @property
    def ov_mean(self) -> Float[Tensor, " k"]:
        return self.ov.mean(0)

    def to_frame(self) -> pd.DataFrame:
        """Long format: circuit ("qk"/"ov"), layer ("mean" for the mean over layers), components, captured."""
        rows = []
        for circuit in ("qk", "ov"):
            values = getattr(self, circuit)
            for name, curve in [*zip(self.layers, values, strict=True), ("mean", values.mean(0))]:
                rows += [(circuit, name, k + 1, v) for k, v in enumerate(curve.tolist())]
        return pd.DataFrame(rows, columns=["circuit", "layer", "components", "captured"])


def folded_qk(model: HookedDCFormer, layer: int) -> tuple[Tensor, Tensor]:
    """W_Q, W_K of a layer with the QK-norm scales multiplied in (unchanged without QK-norm).

    Args:
        model: the model.
        layer: the layer.

    Returns:
        (W_Q, W_K), each [head, d_model, d_head].
    """
    attn = model.blocks[layer].attn
    if not model.cfg.use_qk_norm:
        return attn.W_Q, attn.W_K
    return attn.W_Q * attn.q_norm.w, attn.W_K * attn.k_norm.w


@torch.no_grad()
def head_diversity(
    model: HookedDCFormer,
    layers: list[int] | None = None,
    dtype: torch.dtype = torch.float32,
    qk_norm: Literal["fold", "ignore"] = "fold",
    normalize: Normalize = "none",
    axis: Axis = "columns",
    spectrum: Spectrum = "sigma2",
    components: Components = "auto",
    tol: float = 1e-6,
    progress: bool | None = None,
) -> HeadDiversity:
    """Fig. 5: the variance captured by the principal components of each layer's concatenated QK and OV circuits.

    Lower curves mean more diverse heads. One layer's weights at a time, in `dtype`, on their device. The options are
    the conventions of the module docstring; the defaults are the paper's reading, QK-norm folded in.

    Args:
        model: the model, with its raw weights.
        layers: the layers (None: all).
        dtype: what the spectra are computed in, float32 or float64.
        qk_norm: "fold" multiplies the QK-norm scales into W_Q and W_K; "ignore" reads them raw.
        normalize: "none" (the paper's reading) or "head" (each head's circuit at unit Frobenius norm).
        axis: "columns" (heads side by side) or "rows" (stacked).
        spectrum: "sigma2" (variance, as PCA) or "sigma" (singular values; always computes every one).
        components: how many components each curve has. "all": every one, a full eigendecomposition of the
            min(d_model, n_heads * d_head)-sized Gram matrix per circuit. An int k: the first k, by block Lanczos,
            each share exact to `tol` (a checked bound: `result.bound`) since the total variance is the trace.
            "auto": all up to a Gram size of AUTO_FULL_SIZE, else the first AUTO_COMPONENTS.
        tol: the error bound on each share when computed by block Lanczos.
        progress: a bar over the layers (None: on a model past AUTO_FULL_SIZE, whose layers take longest).

    Returns:
        One curve per layer and circuit, the options and the largest error bound.

    Raises:
        ValueError: an option not among its choices, a layer out of range, or processed weights.
    """
    require_raw_weights(model, "head_diversity (Fig. 5)")
    _check_choice("qk_norm", qk_norm, ("fold", "ignore"))
    dtype = parse_dtype(dtype)
    layers = list(range(model.cfg.n_layers)) if layers is None else [check_layer(model, l, "layers") for l in layers]
    qk, ov, bound = [], [], 0.0
    if progress is None:
        progress = min(model.cfg.d_model, model.cfg.n_heads * model.cfg.d_head) > AUTO_FULL_SIZE
    for layer in tqdm(layers, desc="head diversity", unit="layer", disable=not progress):
        attn = model.blocks[layer].attn
        W_Q, W_K = folded_qk(model, layer) if qk_norm == "fold" else (attn.W_Q, attn.W_K)
        qk_curve, ov_curve, bounds = layer_diversity(
            W_Q, W_K, attn.W_V, attn.W_O, dtype, normalize, axis, spectrum, components, tol, return_bounds=True
        )
        qk.append(qk_curve.cpu())
        ov.append(ov_curve.cpu())
        bound = max(bound, *bounds)
    options = {
        "qk_norm": qk_norm if model.cfg.use_qk_norm else "none",
        "normalize": normalize,
        "axis": axis,
        "spectrum": spectrum,
        "components": qk[0].shape[0],
    }
    return HeadDiversity(layers, torch.stack(qk), torch.stack(ov), options, bound)


def compare_head_diversity(models: dict[str, HookedDCFormer], **kwargs) -> dict[str, HeadDiversity]:
    """`head_diversity` of several models, for `plot_head_diversity`.

    Args:
        models: the models by name, e.g. {"DCPythia": dc, "Pythia": mha}.
        **kwargs: `head_diversity`'s options, the same for every model.

    Returns:
        Each model's result, by name.
    """
    return {name: head_diversity(model, **kwargs) for name, model in models.items()}
