"""HookedDCFormer: DCFormer (Xiao et al., ICML 2024) as a TransformerLens `HookedRootModule`.

The whole model is in this file. Every intermediate that an interpretability study needs sits behind a
`HookPoint` named by where it is, as in TransformerLens (`blocks.3.attn.hook_pattern`). Index names in
einsums: b batch, p/t/s positions (query t, key s), h/n/m heads, e head dim, d model dim, r rank,
c dynamic-weight branch, k dynamic-weight hidden unit.

DCMHA in one layer (x = the normed residual input of the attention):
    scores A = q k^T / sqrt(d_head)                                  hook_attn_scores    [b, h, t, s]
    A' = A + o_qp + o_kp + o_qg + o_kg       (pre-compose)           hook_composed_scores
    P = softmax(A')                                                  hook_pattern
    P' = P + o_qp + o_kp + o_qg + o_kg       (post-compose)          hook_composed_pattern
    z = P' v,  out = z W_O                                           hook_z
with, for query t and key s,
    o_qp[m,t,s] = sum_r (sum_n A[n,t,s] qw1[t,r,n]) qw2[t,r,m]   and o_kp the same with key-side weights at s,
    o_qg[n,t,s] = A[n,t,s] qg[t,n],   o_kg[n,t,s] = A[n,t,s] kg[s,n].
The dynamic weights (qw1, qw2, kw1, kw2, qg, kg for each stage) are computed from x by a small FFN.
Both score hooks hold the dtype's minimum at the keys a query may not see (future keys, keys outside a local
window), as TransformerLens does. docs/hooks.md maps every hook to the paper's equations.
How a layer computes this (every tensor above materialised, or a block of queries at a time on the CPU, or the fused
Triton kernels on CUDA, ...) is chosen per call by `dcinterp.dcmha.choose_path`: `Attention.forward` computes z by its
hooked `materialised_z`, or by `dcinterp.dcmha.attend` on every other path.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Iterable
from typing import Literal

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn
from transformer_lens import HookedRootModule
from transformer_lens.hook_points import HookPoint

from . import dcmha
from .config import DCFormerConfig
from .dcmha import materialised
from .kv_cache import DCFormerKeyValueCache
from .loading import dispatch, load_tokenizer, open_checkpoint, stream_weights
from .loading import save_pretrained as save_checkpoint
from .processing import DCActivationCache
from .tl_api import TransformerLensAPI

# The hooks TransformerLens' get_act_name does not know: in blocks.{layer}.attn, and in its compose stages.
DCMHA_ACT_NAMES = ("composed_scores", "composed_pattern")
COMPOSE_ACT_NAMES = ("qw1", "qw2", "kw1", "kw2", "qg", "kg", "o_qp", "o_kp", "o_qg", "o_kg")

BRANCH_DYN_INDEX = {"pre": (0, 1), "post": (2, 3)}  # dynamic-weight branches c: [pre q, pre k, post q, post k]


def _gradient_needed(tensors: Iterable[Tensor]) -> bool:
    """Whether autograd will need a gradient through an operation on these tensors (read only in grad mode, and only
    up to the first that requires grad: a module's parameters are walked only then)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _hooked(hook: HookPoint) -> bool:
    """Whether anything reads or sets the hook point: a TransformerLens or torch hook, or a wrapped forward."""
    return bool(hook.fwd_hooks or hook.bwd_hooks or hook._forward_hooks or hook._backward_hooks) or _wrapped(hook)


def _wrapped(hook: HookPoint) -> bool:
    """nnsight reads and sets a module's output by replacing its `forward`; it intervenes only while one of its
    traces is active, so outside them the fused compose path stays. accelerate's device hooks (`_hf_hook`) only move
    tensors; any other replaced forward counts as a reader."""
    forward = hook.__dict__.get("forward")
    if forward is None:
        return False
    active = getattr(getattr(forward, "state", None), "active", None)
    if active is None:
        return not hasattr(hook, "_hf_hook")
    try:
        return active()[0] is not None
    except Exception:  # noqa: BLE001 (nnsight's internals changed: count the hook point as read)
        return True


def at_least_float32(x: Tensor) -> Tensor:
    """x in float32 if it is in a half dtype, else as it is: the norms, the rotary embedding and the softmaxes
    compute in at least float32, and a float64 run stays float64 throughout (it judges the others)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class Norm(nn.Module):
    """LayerNorm (with bias) or RMSNorm, computed in at least float32, with TransformerLens' hook names."""

    def __init__(self, d: int, kind: str, eps: float):
        super().__init__()
        self.kind, self.eps = kind, eps
        self.w = nn.Parameter(torch.ones(d))
        self.b = nn.Parameter(torch.zeros(d)) if kind == "LN" else None
        self.hook_scale = HookPoint()  # [batch, pos, 1]
        self.hook_normalized = HookPoint()  # [batch, pos, d_model], after weight and bias

    def forward(self, x: Float[Tensor, "b p d"]) -> Float[Tensor, "b p d"]:
        dtype = x.dtype
        x = at_least_float32(x)
        if self.kind == "LN":
            x = x - x.mean(-1, keepdim=True)
        scale = self.hook_scale((x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        x = (x / scale).to(dtype) * self.w
        if self.b is not None:
            x = x + self.b
        return self.hook_normalized(x)


class HeadRMSNorm(nn.Module):
    """QK-norm: RMSNorm with a learned scale over the head dim (eps 1e-6).

    `hook_inv_scale` [batch, pos, head, 1] (float32; float64 in a float64 run) is rsqrt(mean x² + eps), what
    multiplies each head's q or k: a hook that returns the clean run's value freezes the QK-norm (dcinterp.qk's
    causal checks). The inverse is hooked, not the norms' `hook_scale` divisor, so that the arithmetic is the
    released code's whether or not anything reads it."""

    def __init__(self, d_head: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.w = nn.Parameter(torch.ones(d_head))
        self.hook_inv_scale = HookPoint()

    def forward(self, x: Float[Tensor, "b p h e"]) -> Float[Tensor, "b p h e"]:
        xf = at_least_float32(x)
        inv_scale = self.hook_inv_scale(torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))
        return (xf * inv_scale).to(x.dtype) * self.w


def apply_rotary(
    x: Float[Tensor, "b p h e"],
    rotary_dim: int,
    base: float,
    table_dtype: torch.dtype = torch.float32,
    positions: Int[Tensor, "*batch pos"] | None = None,
) -> Float[Tensor, "b p h e"]:
    """Rotary embedding on the first `rotary_dim` dims, "half" pairing (dim j rotates with j + rotary_dim/2).

    table_dtype: the cos/sin tables are rounded to it (the authors' inference code uses float16).
    positions: of x's positions, for the whole batch or per row (default 0, 1, ...; a key-value cache or left
    padding gives others).
    """
    return rotate(x, rotary_dim, rotary_tables(rotary_dim, base, x.shape[1], x.device, table_dtype, positions))


def rotary_tables(
    rotary_dim: int,
    base: float,
    n_positions: int,
    device,
    table_dtype: torch.dtype = torch.float32,
    positions: Int[Tensor, "*batch pos"] | None = None,
) -> tuple[Float[Tensor, "*batch pos 1 half"], Float[Tensor, "*batch pos 1 half"]] | None:
    """`apply_rotary`'s cos and sin tables (float32, rounded to `table_dtype` first) for `n_positions` positions
    (`positions`, default 0, 1, ...): one layer's q and k share them. None where nothing rotates."""
    if rotary_dim == 0:
        return None
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even (dims rotate in pairs), not {rotary_dim}")
    if positions is None:
        positions = torch.arange(n_positions, device=device)
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, device=device, dtype=torch.float32) / rotary_dim)
    angles = (positions.to(device, torch.float32)[..., None] * inv_freq)[..., None, :]  # [(b,) p, 1, half]
    return angles.cos().to(table_dtype).float(), angles.sin().to(table_dtype).float()


def model_rotary_tables(
    cfg: DCFormerConfig, n_positions: int, device, positions: Int[Tensor, "*batch pos"] | None = None
) -> tuple[Tensor, Tensor] | None:
    """The rotary tables of `cfg`'s layers (rounded to float16 under the official-inference convention, as the
    authors' inference code): every layer's, since they share rotary_dim and base."""
    table = torch.float16 if cfg.window == "official-inference" else torch.float32
    return rotary_tables(cfg.rotary_dim, cfg.rotary_base, n_positions, device, table, positions)


def rotate(x: Float[Tensor, "b p h e"], rotary_dim: int, tables: tuple[Tensor, Tensor] | None) -> Tensor:
    """x rotated by `rotary_tables`' (cos, sin) on its first `rotary_dim` dims, in at least float32."""
    if tables is None:
        return x
    cos, sin = tables
    half = rotary_dim // 2
    xf = at_least_float32(x)
    x1, x2, rest = xf[..., :half], xf[..., half:rotary_dim], xf[..., rotary_dim:]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)
    return rotated.to(x.dtype)


class Compose(nn.Module):
    """One `Compose` stage of DCMHA (pre-compose on scores, or post-compose on probabilities).

    With no hook on a branch output, the branches are added into one output tensor in place (fused path);
    with a hook (or a cache) on any of them, each branch is computed as its own tensor and passed through
    its hook, and what the hooks return is summed (materialised path).
    """

    def __init__(self, cfg: DCFormerConfig, stage: str):
        super().__init__()
        self.stage = stage  # "pre" or "post"
        self.branches = cfg.active_branches
        self.rank = cfg.dcmha_rank
        for name in ("qw1", "qw2", "kw1", "kw2"):
            setattr(self, f"hook_{name}", HookPoint())  # [batch, pos, rank, head]
        self.hook_qg = HookPoint()  # [batch, pos, head]
        self.hook_kg = HookPoint()
        for branch in ("qp", "kp", "qg", "kg"):
            setattr(self, f"hook_o_{branch}", HookPoint())  # [batch, head, query, key]
        self.branch_output_hooks = [getattr(self, f"hook_o_{b}") for b in self.branches]  # of the branches on

    def dynamic_weights(self, qw1, qw2, kw1, kw2, qg, kg) -> tuple[Tensor | None, ...]:
        """Pass the stage's dynamic weights through their hooks; None for the branches that are off."""
        qp, kp = "qp" in self.branches, "kp" in self.branches
        return (
            self.hook_qw1(qw1) if qp else None,
            self.hook_qw2(qw2) if qp else None,
            self.hook_kw1(kw1) if kp else None,
            self.hook_kw2(kw2) if kp else None,
            self.hook_qg(qg) if "qg" in self.branches else None,
            self.hook_kg(kg) if "kg" in self.branches else None,
        )

    def branches_read(self) -> bool:
        """Whether a hook (or the cache) asks for a branch output, so that each branch is its own tensor."""
        return any(_hooked(hook) for hook in self.branch_output_hooks)

    def forward(
        self, A: Float[Tensor, "b h t s"], qw1, qw2, kw1, kw2, qg, kg, past_kv_cache_entry=None
    ) -> Float[Tensor, "b h t s"]:
        """With `past_kv_cache_entry` (dcinterp.kv_cache), the key-side weights given are the new positions'; those
        of every key come from the cache, where the new ones are stored."""
        qw1, qw2, kw1, kw2, qg, kg = self.dynamic_weights(qw1, qw2, kw1, kw2, qg, kg)
        if past_kv_cache_entry is not None:
            kw1, kw2, kg = past_kv_cache_entry.append_key_compose(self.stage, kw1, kw2, kg)  # key-last
            if A.shape[2] <= dcmha.FEW_QUERIES and not self.branches_read():
                return materialised.compose_few_queries(A, qw1, qw2, qg, kw1, kw2, kg)
            kw1, kw2, kg = (None if w is None else w.movedim(-1, 1) for w in (kw1, kw2, kg))
        if self.branches_read():
            out = A
            for branch, o in materialised.branch_outputs(A, qw1, qw2, kw1, kw2, qg, kg).items():
                out = out + getattr(self, f"hook_o_{branch}")(o)
            return out
        return materialised.compose_fused(A, qw1, qw2, kw1, kw2, qg, kg)


def project_heads(x: Float[Tensor, "b p d"], W: Float[Tensor, "h d e"]) -> Float[Tensor, "b p h e"]:
    """x W[h] for every head. Without a graph, one matmul per head that reads W where it lies (the einsum gathers W
    into a [d, h e] copy at every call: most of a decoding step's time); with one, the einsum, whose backward
    gives x's gradient without a [h, b p, d] intermediate. The result is a view of a [h, b, p, e] tensor."""
    if torch.is_grad_enabled() and (x.requires_grad or W.requires_grad):
        return torch.einsum("bpd,hde->bphe", x, W)
    b, p, d = x.shape
    return torch.bmm(x.reshape(1, b * p, d).expand(W.shape[0], -1, -1), W).unflatten(1, (b, p)).permute(1, 2, 0, 3)


class Attention(nn.Module):
    """One attention layer: DCMHA (Eqs. 4-8 of the module docstring, every tensor behind its hook) or plain MHA.

    Args:
        cfg: the model's configuration.
        layer: the layer's index, which sets its window (`cfg.layer_window`).
    """

    def __init__(self, cfg: DCFormerConfig, layer: int):
        super().__init__()
        self.cfg = cfg
        self.window = cfg.layer_window(layer)
        self.layers_from_here = cfg.n_layers - layer  # this one and those after it
        H, D, E = cfg.n_heads, cfg.d_model, cfg.d_head
        self.W_Q = nn.Parameter(torch.empty(H, D, E))
        self.W_K = nn.Parameter(torch.empty(H, D, E))
        self.W_V = nn.Parameter(torch.empty(H, D, E))
        self.W_O = nn.Parameter(torch.empty(H, E, D))
        if cfg.use_bias:
            self.b_Q = nn.Parameter(torch.zeros(H, E))
            self.b_K = nn.Parameter(torch.zeros(H, E))
            self.b_V = nn.Parameter(torch.zeros(H, E))
            self.b_O = nn.Parameter(torch.zeros(D))
        else:
            self.b_Q = self.b_K = self.b_V = self.b_O = None
        if cfg.use_qk_norm:
            self.q_norm, self.k_norm = HeadRMSNorm(E), HeadRMSNorm(E)

        if cfg.use_dcmha:
            # The dynamic-weight FFN of Eqs. (5)-(6), all four branches c = [pre q, pre k, post q, post k] at once.
            # Official names: W_dyn_in = dyn_w_proj.dw1, W_dyn_out = dyn_w_proj.qkw, W_dyn_gate = dyn_w_proj.dd.
            K, R = cfg.dyn_hidden_dim, cfg.dcmha_rank
            self.W_dyn_in = nn.Parameter(torch.empty(D, 4, K))
            self.W_dyn_out = nn.Parameter(torch.empty(4, K, 2 * R, H))
            self.W_dyn_gate = nn.Parameter(torch.empty(D, 4, H))
            # Biases only a folded LayerNorm gives them (dcinterp.processing): None in the released models.
            self.register_parameter("b_dyn_in", None)  # [4, K]
            self.register_parameter("b_dyn_gate", None)  # [4, H]
            self.pre_compose = Compose(cfg, "pre") if "pre" in cfg.compose_stages else None
            self.post_compose = Compose(cfg, "post") if "post" in cfg.compose_stages else None
            self.hook_composed_scores = HookPoint()  # [batch, head, query, key], after pre-compose, masked
            self.hook_composed_pattern = HookPoint()  # [batch, head, query, key], what multiplies V

        # Only with cfg.use_split_qkv_input: the residual stream entering the block, one copy per head for each
        # of q, k, v (before ln1), as TransformerLens' forks for direct path patching.
        self.hook_q_input = HookPoint()  # [batch, pos, head, d_model]
        self.hook_k_input = HookPoint()
        self.hook_v_input = HookPoint()
        self.hook_q = HookPoint()  # [batch, pos, head, d_head], after QK-norm, before rotary
        self.hook_k = HookPoint()
        self.hook_v = HookPoint()
        self.hook_rot_q = HookPoint()
        self.hook_rot_k = HookPoint()
        self.hook_attn_scores = HookPoint()  # [batch, head, query, key], before pre-compose, masked
        self.hook_pattern = HookPoint()  # [batch, head, query, key], softmax, before post-compose
        self.hook_z = HookPoint()  # [batch, pos, head, d_head]
        self.hook_result = HookPoint()  # [batch, pos, head, d_model], only with cfg.use_attn_result

    def dynamic_weights(self, x: Float[Tensor, "b p d"]) -> dict[str, tuple[Tensor, ...]]:
        """The dynamic weights of Eqs. (5)-(6), before their hooks (`dcinterp.dcmha.compute_dynamic_weights`).

        Args:
            x: the layer's normed input.

        Returns:
            Per stage ("pre", "post"): (qw1, qw2, kw1, kw2 [b, p, rank, head], qg, kg [b, p, head]).
        """
        params = (self.W_dyn_in, self.b_dyn_in, self.W_dyn_out, self.W_dyn_gate, self.b_dyn_gate)
        w1, w2, gates = (w.unbind(2) for w in dcmha.compute_dynamic_weights(x, *params))  # per branch c
        weights = {}
        for stage, (cq, ck) in BRANCH_DYN_INDEX.items():
            weights[stage] = (w1[cq], w2[cq], w1[ck], w2[ck], gates[cq], gates[ck])
        return weights

    def hook_scores_for_compose(self, scores: Float[Tensor, "b h t s"], mask: Float[Tensor, "t s"]) -> Tensor:
        """`hook_attn_scores` of a DCMHA layer: the hook sees hidden keys at the dtype's minimum, as in TransformerLens.

        Pre-compose mixes heads per (query, key) pair, so a hidden pair only ever feeds itself; but the minimum
        mixed by the compose weights would overflow to inf and give NaN (inf - inf). So the hidden entries go
        into the compose as 0, and with no hook attached the mask is skipped (the entries it hides are never
        used: the composed scores are masked again before the softmax). When a hook or the cache shows the
        pre-compose branch outputs, they are 0 at hidden keys.

        Args:
            scores: the scaled scores A [b, h, t, s].
            mask: the additive mask, [t, s] or [b, 1, t, s].

        Returns:
            What the pre-compose takes: the scores, 0 at hidden keys where anything reads them.
        """
        if _hooked(self.hook_attn_scores):
            scores = self.hook_attn_scores(scores + mask)
        elif self.pre_compose is None or not self.pre_compose.branches_read():
            return scores
        return scores.masked_fill(mask != 0, 0.0)

    def forward(
        self,
        x: Float[Tensor, "b p d"],
        mask: Float[Tensor, "t s"] | Float[Tensor, "b 1 t s"],
        qkv_input: tuple[Tensor, ...] | None = None,
        positions: Tensor | None = None,
        past_kv_cache_entry=None,
        real: Bool[Tensor, "b s"] | None = None,
        rotary: tuple[Tensor, Tensor] | None = None,
    ) -> Float[Tensor, "b p d"]:
        """q, k, v (Eq. 4 and rotary), then z by the path `path_for` picks, then the output projection.

        Args:
            x: the normed input [b, p, d].
            mask: 0 where a query sees a key, else the dtype's minimum (`attention_mask`), [t, s] or [b, 1, t, s].
            qkv_input: per-head normed inputs [b, p, h, d] of q, k and v, when split (cfg.use_split_qkv_input);
                the dynamic compose weights still read `x`.
            positions: rotary positions of x's tokens; None: 0, 1, ...
            past_kv_cache_entry: this layer's `DCFormerKeyValueCacheEntry`; the keys are then the cached ones and
                x's.
            real: [b, s], False at padded keys, of every key (cached ones first), as `mask` hides them; None: no
                padding beyond what a [t, s] mask says. The fused kernels read it in place of the mask.
            rotary: the rotary tables of these positions (`model_rotary_tables`), which the model computes once for
                all layers; None: computed here.

        Returns:
            The layer's output [b, p, d].
        """
        cfg = self.cfg
        if qkv_input is None:
            q, k, v = project_heads(x, self.W_Q), project_heads(x, self.W_K), project_heads(x, self.W_V)
        else:
            q, k, v = (
                torch.einsum("bphd,hde->bphe", xi, W)
                for xi, W in zip(qkv_input, (self.W_Q, self.W_K, self.W_V), strict=True)
            )
        if self.b_Q is not None:
            q, k, v = q + self.b_Q, k + self.b_K, v + self.b_V
        if cfg.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        tables = rotary if rotary is not None else model_rotary_tables(cfg, q.shape[1], q.device, positions)
        q = self.hook_rot_q(rotate(q, cfg.rotary_dim, tables))
        k = self.hook_rot_k(rotate(k, cfg.rotary_dim, tables))
        path = self.path_for(x, mask, q.shape[1], past_kv_cache_entry, real)
        if past_kv_cache_entry is not None:
            k, v = past_kv_cache_entry.append(k, v)
        if path == "materialised":  # Eqs. (4)-(8) with every [b, h, t, s] tensor through its hook
            z = self.materialised_z(x, q, k, v, mask, past_kv_cache_entry)
        else:
            z = dcmha.attend(path, self.attention_inputs(x, q, k, v, mask, past_kv_cache_entry, real))
        z = self.hook_z(z)
        if cfg.use_attn_result:
            out = self.hook_result(torch.einsum("bthe,hed->bthd", z, self.W_O)).sum(2)
        else:
            out = torch.einsum("bthe,hed->btd", z, self.W_O)
        return out + self.b_O if self.b_O is not None else out

    def path_for(
        self, x: Tensor, mask: Tensor, n_queries: int, past_kv_cache_entry=None, real: Tensor | None = None
    ) -> dcmha.Path:
        """Which path computes this call's z, by `dcinterp.dcmha.choose_path`'s rules.

        The materialised one when anything reads or sets a [b, h, t, s] tensor of this layer (a hook, a cache or an
        nnsight trace on the scores, the patterns or a branch output) or a functorch transform is active.

        Args:
            x: the normed input [b, p, d].
            mask: the additive mask, [t, s] or [b, 1, t, s].
            n_queries: t.
            past_kv_cache_entry: this layer's cache entry, or None.
            real: [b, s], False at padded keys; None without padding beyond the mask.

        Returns:
            The path's name.
        """
        square_read = _hooked(self.hook_attn_scores) or _hooked(self.hook_pattern)
        if self.cfg.use_dcmha:
            square_read = square_read or _hooked(self.hook_composed_scores) or _hooked(self.hook_composed_pattern)
            square_read = square_read or any(
                c is not None and c.branches_read() for c in (self.pre_compose, self.post_compose)
            )
        keys, gradient_needed = mask.shape[-1], _gradient_needed(itertools.chain((x,), self.parameters()))
        kept = 0  # what the materialised path would keep for the backward, this layer's and the later ones'
        if gradient_needed:
            kept = self.layers_from_here * dcmha.materialised_saved_bytes(
                x.shape[0], self.cfg.n_heads, n_queries, keys, x.dtype
            )
        return dcmha.choose_path(
            dcmha=self.cfg.use_dcmha,
            device=x.device,
            square_tensor_read=square_read,
            functorch_active=torch._C._are_functorch_transforms_active(),
            cached_queries=None if past_kv_cache_entry is None else n_queries,
            padding_as_mask_only=mask.ndim == 4 and real is None,
            keys=keys,
            gradient_needed=gradient_needed,
            materialised_bytes=kept,
            dtype=x.dtype,
        )

    def attention_inputs(
        self, x: Float[Tensor, "b p d"], q, k, v, mask, past_kv_cache_entry=None, real: Tensor | None = None
    ) -> dcmha.AttentionInputs:
        """What `dcinterp.dcmha.attend` takes: q, k, v of every key, the mask, and each stage's dynamic weights.

        Args:
            x: the layer's normed input, from which the dynamic weights are computed.
            q: the queries [b, t, h, e] after rotary.
            k: the keys [b, s, h, e] of every key (the cache's first).
            v: the values [b, s, h, e], the same.
            mask: the additive mask, [t, s] or [b, 1, t, s].
            past_kv_cache_entry: this layer's cache entry, where the new key side is stored.
            real: [b, s], False at padded keys; None without padding beyond the mask.

        Returns:
            The inputs; with a cache, the key side as it holds it (key-last).
        """
        stages = self.composed_weights(x, past_kv_cache_entry) if self.cfg.use_dcmha else [None, None]
        official = self.cfg.window == "official-inference"
        return dcmha.AttentionInputs(
            q, k, v, mask, *stages, self.window, official, real, key_last=past_kv_cache_entry is not None
        )

    def composed_weights(self, x: Float[Tensor, "b p d"], past_kv_cache_entry=None) -> list[tuple | None]:
        """Each stage's dynamic weights after their hooks, the key side of every key.

        Args:
            x: the layer's normed input.
            past_kv_cache_entry: this layer's cache entry: the new key side is stored there, and every key's read.

        Returns:
            Per stage (pre, post): (qw1, qw2, kw1, kw2, qg, kg), None for a branch or stage that is off. The key side
            in the hooks' layout (kw1, kw2 [b, s, rank, head], kg [b, s, head]); with a cache, as it holds it
            (kw1, kw2 [b, rank, head, s], kg [b, head, s]).
        """
        dyn = self.dynamic_weights(x)
        stages = []
        for compose in (self.pre_compose, self.post_compose):
            if compose is None:
                stages.append(None)
                continue
            qw1, qw2, kw1, kw2, qg, kg = compose.dynamic_weights(*dyn[compose.stage])
            if past_kv_cache_entry is not None:
                kw1, kw2, kg = past_kv_cache_entry.append_key_compose(compose.stage, kw1, kw2, kg)
            stages.append((qw1, qw2, kw1, kw2, qg, kg))
        return stages

    def materialised_z(self, x, q, k, v, mask, past_kv_cache_entry=None) -> Float[Tensor, "b t h e"]:
        """z with every [b, h, t, s] tensor of the layer computed and passed through its hook (Eqs. 4-8).

        Args:
            x: the normed input [b, p, d], from which the dynamic weights are computed.
            q: the queries [b, t, h, e] after rotary.
            k: the keys [b, s, h, e] of every key.
            v: the values [b, s, h, e].
            mask: the additive mask, [t, s] or [b, 1, t, s].
            past_kv_cache_entry: this layer's cache entry, where the new key side is stored; or None.

        Returns:
            z [b, t, h, e].
        """
        cfg = self.cfg
        scores = torch.einsum("bthe,bshe->bhts", q, k) / math.sqrt(cfg.d_head)
        mask = mask.to(scores.dtype)
        if cfg.use_dcmha:
            scores = self.hook_scores_for_compose(scores, mask)
            dyn = self.dynamic_weights(x)
            if self.pre_compose is not None:
                scores = self.pre_compose(scores, *dyn["pre"], past_kv_cache_entry=past_kv_cache_entry)
            scores = self.hook_composed_scores(scores + mask)
        else:
            scores = self.hook_attn_scores(scores + mask)
        pattern = self.hook_pattern(
            scores.softmax(-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(scores.dtype)
        )
        if cfg.use_dcmha:
            if self.post_compose is not None:
                pattern = self.post_compose(pattern, *dyn["post"], past_kv_cache_entry=past_kv_cache_entry)
            pattern = self.hook_composed_pattern(pattern)
        return torch.einsum("bhts,bshe->bthe", pattern, v)


class MLP(nn.Module):
    """GELU MLP (Pythia) or SwiGLU (Transformer++), optionally with DCFormer++'s mgate."""

    def __init__(self, cfg: DCFormerConfig):
        super().__init__()
        self.cfg = cfg
        self.W_in = nn.Parameter(torch.empty(cfg.d_model, cfg.d_mlp))
        self.W_out = nn.Parameter(torch.empty(cfg.d_mlp, cfg.d_model))
        self.b_in = nn.Parameter(torch.zeros(cfg.d_mlp)) if cfg.use_bias else None
        self.b_out = nn.Parameter(torch.zeros(cfg.d_model)) if cfg.use_bias else None
        if cfg.act_fn == "swiglu":
            self.W_gate = nn.Parameter(torch.empty(cfg.d_model, cfg.d_mlp))
            self.hook_pre_linear = HookPoint()  # [batch, pos, d_mlp]: x W_in
        if cfg.mgate_dim:
            self.W_mgate = nn.Parameter(torch.empty(cfg.d_model, cfg.mgate_dim))
            self.hook_mgate = HookPoint()  # [batch, pos, mgate_dim]: softmax group weights
        self.hook_pre = HookPoint()  # [batch, pos, d_mlp]: pre-activation (the gate's, for SwiGLU)
        self.hook_post = HookPoint()  # [batch, pos, d_mlp]: what multiplies W_out

    def forward(self, x: Float[Tensor, "b p d"]) -> Float[Tensor, "b p d"]:
        if self.cfg.act_fn == "gelu":
            pre = x @ self.W_in
            post = F.gelu(self.hook_pre(pre + self.b_in if self.b_in is not None else pre))
        else:
            post = F.silu(self.hook_pre(x @ self.W_gate)) * self.hook_pre_linear(x @ self.W_in)
        if self.cfg.mgate_dim:
            groups = self.hook_mgate(
                (x @ self.W_mgate).softmax(-1, dtype=torch.promote_types(x.dtype, torch.float32)).to(x.dtype)
            )
            post = (post.unflatten(-1, (self.cfg.mgate_dim, -1)) * groups[..., None]).flatten(-2)
        out = self.hook_post(post) @ self.W_out
        return out + self.b_out if self.b_out is not None else out


class TransformerBlock(nn.Module):
    hook_out_is_single_residual_stream = True  # TransformerLens' logit lens reads hook_resid_post as the stream

    def __init__(self, cfg: DCFormerConfig, layer: int):
        super().__init__()
        self.cfg = cfg
        self.ln1 = Norm(cfg.d_model, cfg.normalization_type, cfg.norm_eps)
        self.ln2 = Norm(cfg.d_model, cfg.normalization_type, cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.hook_resid_pre = HookPoint()  # [batch, pos, d_model]
        self.hook_attn_in = HookPoint()  # [batch, pos, head, d_model]: per-head copies for q, k, v (cfg.use_attn_in)
        if not cfg.parallel_residual:
            self.hook_resid_mid = HookPoint()
        self.hook_attn_out = HookPoint()
        self.hook_mlp_in = HookPoint()  # [batch, pos, d_model]: a copy of the stream into ln2 (cfg.use_hook_mlp_in)
        self.hook_mlp_out = HookPoint()
        self.hook_resid_post = HookPoint()

    def split_qkv_input(self, resid_pre: Float[Tensor, "b p d"]) -> tuple[Float[Tensor, "b p h d"], ...]:
        """One copy of the stream per head, as TransformerLens: through `hook_attn_in` (use_attn_in: a hook on one
        head's copy reaches that head's q, k and v), then one for each of q, k, v through its fork hook
        (use_split_qkv_input: that head's q, k or v alone), then ln1."""
        copies = resid_pre[:, :, None].expand(-1, -1, self.cfg.n_heads, -1)
        if self.cfg.use_attn_in:
            copies = self.hook_attn_in(copies.clone())
        if not self.cfg.use_split_qkv_input:
            normed = self.ln1(copies)
            return normed, normed, normed
        forks = (self.attn.hook_q_input, self.attn.hook_k_input, self.attn.hook_v_input)
        return tuple(self.ln1(fork(copies.clone())) for fork in forks)

    def forward(
        self,
        resid_pre: Float[Tensor, "b p d"],
        mask: Float[Tensor, "t s"],
        positions: Tensor | None = None,
        past_kv_cache_entry=None,
        real: Bool[Tensor, "b s"] | None = None,
        rotary: tuple[Tensor, Tensor] | None = None,
    ) -> Float[Tensor, "b p d"]:
        """`rotary`: the rotary tables of the positions (`Attention.forward`), None to compute them here."""
        resid_pre = self.hook_resid_pre(resid_pre)
        per_head = self.cfg.use_split_qkv_input or self.cfg.use_attn_in
        qkv_input = self.split_qkv_input(resid_pre) if per_head else None
        attn_in = self.ln1(resid_pre)
        attn_out = self.hook_attn_out(self.attn(attn_in, mask, qkv_input, positions, past_kv_cache_entry, real, rotary))
        if self.cfg.parallel_residual:
            mlp_out = self.hook_mlp_out(self.mlp(self.ln2(self.mlp_in(resid_pre))))
            return self.hook_resid_post(resid_pre + attn_out + mlp_out)
        resid_mid = self.hook_resid_mid(resid_pre + attn_out)
        mlp_out = self.hook_mlp_out(self.mlp(self.ln2(self.mlp_in(resid_mid))))
        return self.hook_resid_post(resid_mid + mlp_out)

    def mlp_in(self, resid: Float[Tensor, "b p d"]) -> Float[Tensor, "b p d"]:
        """The stream the MLP reads: through `hook_mlp_in` as a copy where cfg.use_hook_mlp_in (TransformerLens'
        fork, so that a patch there reaches the MLP alone)."""
        return self.hook_mlp_in(resid.clone()) if self.cfg.use_hook_mlp_in else resid


class Embed(nn.Module):
    """Token embedding, as TransformerLens' `Embed` (`model.embed.W_E`)."""

    def __init__(self, cfg: DCFormerConfig):
        super().__init__()
        self.W_E = nn.Parameter(torch.empty(cfg.d_vocab, cfg.d_model))

    def forward(self, tokens: Int[Tensor, "b p"]) -> Float[Tensor, "b p d"]:
        return self.W_E[tokens]


class Unembed(nn.Module):
    """Unembedding, as TransformerLens' `Unembed` (`model.unembed.W_U`, `model.unembed.b_U`).

    DCFormer and Pythia have no unembedding bias: `b_U` reads as zeros until weight processing folds the final
    LayerNorm's bias into it (then it is a parameter, and the forward adds it)."""

    def __init__(self, cfg: DCFormerConfig):
        super().__init__()
        self.W_U = nn.Parameter(torch.empty(cfg.d_model, cfg.d_vocab))
        self.register_parameter("b_U", None)

    def __getattr__(self, name: str):
        value = super().__getattr__(name)
        if name == "b_U" and value is None:
            return self.W_U.new_zeros(self.W_U.shape[1])
        return value

    def forward(self, resid: Float[Tensor, "b p d"]) -> Float[Tensor, "b p v"]:
        logits = resid @ self.W_U
        bias = self._parameters["b_U"]
        return logits + bias if bias is not None else logits


def visible_keys(n: int, window: int | None, device, semantics: str = "training", past: int = 0) -> Bool[Tensor, "t s"]:
    """True where query t may see key s: s <= t, and for a local layer t - window < s ("training": `window`
    keys) or t - window <= s ("official-inference": window + 1 keys). With `past` cached positions, the n queries
    are positions past..past+n-1 and the keys 0..past+n-1 ([n, past + n])."""
    t = torch.arange(past, past + n, device=device)[:, None]
    s = torch.arange(past + n, device=device)[None, :]
    allowed = s <= t
    if window is not None:
        allowed &= s > t - window - int(semantics == "official-inference")
    return allowed


def attention_mask(
    n: int,
    window: int | None,
    device,
    dtype=torch.float32,
    semantics: str = "training",
    past: int = 0,
    real: Bool[Tensor, "b s"] | None = None,
) -> Float[Tensor, "t s"] | Float[Tensor, "b 1 t s"]:
    """The same as an additive mask: 0 where query t may see key s, else the dtype's minimum (as TransformerLens).

    Added to the scores it gives the minimum at hidden keys (an add: faster than masked_fill on a CPU).
    `real` [b, past + n], False at padding: padded keys are hidden too (a padded query sees itself), per row."""
    visible = visible_keys(n, window, device, semantics, past)
    if real is not None:
        itself = torch.arange(past, past + n, device=device)[:, None] == torch.arange(past + n, device=device)
        visible = visible & (real.to(device)[:, None, :] | itself)
        visible = visible[:, None]  # [b, 1, t, s]
    return torch.zeros(visible.shape, device=device, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)


_attention_mask = attention_mask  # HookedDCFormer.forward's argument of that name shadows it


class HookedDCFormer(TransformerLensAPI, HookedRootModule):
    """DCFormer with every part of DCMHA exposed as a hook point. See the module docstring for the math.

    `model(tokens)` gives logits [batch, pos, d_vocab]; `run_with_cache`, `run_with_hooks`, `hooks()` work as
    in TransformerLens. Load checkpoints with `HookedDCFormer.from_pretrained(path_or_name)`.

    TransformerLens' accessors (`W_Q`, `OV`, `to_tokens`, `generate`, ...) come from `dcinterp.tl_api`.
    """

    def __init__(self, cfg: DCFormerConfig, tokenizer=None, init: bool = True):
        super().__init__()
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.cache_memory_fraction: float | None = 0.5  # run_with_cache's guard (see dcinterp.memory)
        self.weight_processing: dict[str, bool] = {}  # what process_weights_ did (dcinterp.processing)
        self.use_activation_grads = False  # set_use_activation_grads: the forward starts an autograd graph
        self.allow_unknown_tokens = False  # to_tokens: unknown words raise (True: one warning line)
        self.embed = Embed(cfg)
        self.hook_embed = HookPoint()  # [batch, pos, d_model]
        self.blocks = nn.ModuleList(TransformerBlock(cfg, layer) for layer in range(cfg.n_layers))
        self.ln_final = Norm(cfg.d_model, cfg.normalization_type, cfg.norm_eps)
        self.unembed = Unembed(cfg)
        if init:
            self.init_weights()
        self.setup()

    def setup(self) -> None:
        """TransformerLens' setup, plus the names TransformerLens gives hooks that sit elsewhere here, for hooks by
        name and cache lookups (caches hold the real names): TransformerBridge's `blocks.{l}.hook_in` (=
        hook_resid_pre) and `hook_out` (= hook_resid_post), HookedTransformer's `blocks.{l}.hook_q_input` (=
        `blocks.{l}.attn.hook_q_input`), `hook_k_input`, `hook_v_input` (what `get_act_name("q_input", l)` gives)."""
        super().setup()
        self.hook_aliases = {}
        for layer in range(len(self.blocks)):
            self.hook_aliases[f"blocks.{layer}.hook_in"] = f"blocks.{layer}.hook_resid_pre"
            self.hook_aliases[f"blocks.{layer}.hook_out"] = f"blocks.{layer}.hook_resid_post"
            for qkv in "qkv":
                self.hook_aliases[f"blocks.{layer}.hook_{qkv}_input"] = f"blocks.{layer}.attn.hook_{qkv}_input"
        for alias, name in self.hook_aliases.items():
            self.mod_dict[alias] = self.mod_dict[name]

    # ----------------------------------------------------------------------------------------------
    # Forward
    def forward(
        self,
        input: Int[Tensor, "b p"] | str | list[str] | Float[Tensor, "b p d"],
        return_type: Literal["logits", "loss", "both"] | None = "logits",
        loss_per_token: bool = False,
        prepend_bos: bool | None = None,
        start_at_layer: int | None = None,
        tokens: Int[Tensor, "b p"] | None = None,
        stop_at_layer: int | None = None,
        attention_mask: Int[Tensor, "b p"] | None = None,
        past_kv_cache: DCFormerKeyValueCache | None = None,
        padding_side: Literal["left", "right"] | None = None,
    ):
        """Logits (or loss) for tokens or text, as TransformerLens' forward.

        `stop_at_layer=l` returns the residual stream entering block l. `start_at_layer=l` takes that residual
        stream as `input` and runs blocks l onwards (pass `tokens` as well for a loss).
        `attention_mask` [batch, pos]: 1 for real tokens, 0 for padding; padded keys are hidden, each row's rotary
        positions count from its first real token, so a row gives what its prompt alone would, and a loss leaves
        the padding out. As in TransformerLens, where the padding side is "left" (`padding_side`, else the
        tokenizer's `padding_side`) and no mask is given, the mask is the leading pad tokens
        (`pad_attention_mask`); text is padded on that side. `past_kv_cache` (a `DCFormerKeyValueCache`): the
        input continues the cached positions, and is added to the cache (docs/generation.md).
        """
        if start_at_layer is None:
            tokens, attention_mask = self._tokens_and_mask(
                input, prepend_bos, padding_side, attention_mask, return_type
            )
            resid = self.hook_embed(self._graph_start(self.embed(tokens)))
        else:
            resid = self._graph_start(input.to(self.input_device))
        n = resid.shape[1]
        past, real, positions = 0, None, None
        own_mask = attention_mask  # [batch, pos] of this input, for the loss
        if past_kv_cache is not None:
            past = past_kv_cache.n_tokens
            if attention_mask is None:
                attention_mask = torch.ones(resid.shape[:2], dtype=torch.long)
            attention_mask = past_kv_cache.append_attention_mask(attention_mask)
            positions = torch.arange(past, past + n, device=resid.device)
        if attention_mask is not None:
            if attention_mask.shape != (resid.shape[0], past + n):
                raise ValueError(
                    f"attention_mask: shape {tuple(attention_mask.shape)}, expected [batch, pos] = "
                    f"{[resid.shape[0], n]}"
                )
            if not attention_mask.bool().all():
                real = attention_mask.to(resid.device).bool()
                positions = (real.cumsum(1) - 1).clamp_min(0)[:, past:]
        masks = {}
        rotary = model_rotary_tables(self.cfg, n, resid.device, positions)  # every layer's
        for layer in range(len(self.blocks))[start_at_layer:stop_at_layer]:  # a ModuleList's slice builds a new list
            block = self.blocks[layer]
            window = block.attn.window
            if window not in masks:
                masks[window] = _attention_mask(n, window, resid.device, resid.dtype, self.cfg.window, past, real)
            entry = None if past_kv_cache is None else past_kv_cache[layer]
            resid = block(resid, masks[window], positions, entry, real, rotary)
        if stop_at_layer is not None:
            return resid
        logits = self.unembed(self.ln_final(resid))
        if return_type == "logits":
            return logits
        if tokens is None:
            raise ValueError("forward: return_type 'loss' with start_at_layer needs the tokens (tokens=...)")
        loss = lm_cross_entropy(logits, tokens.to(logits.device), loss_per_token, own_mask)
        if return_type == "loss":
            return loss
        if return_type == "both":
            return logits, loss
        return None

    def _tokens_and_mask(self, input, prepend_bos, padding_side, attention_mask, return_type):
        """Token ids for `input` (text is tokenized, padded on `padding_side`, else the tokenizer's) and the
        attention mask: the one given, else, on a left padding side, the leading pad tokens masked out (as
        TransformerLens). Right padding stays unmasked, as in TransformerLens; a loss over right-padded text then
        counts the pads, and says so."""
        side = self._padding_side(padding_side)
        text = isinstance(input, (str, list))
        tokens = self.to_tokens(input, prepend_bos=prepend_bos, padding_side=side) if text else input
        tokens = tokens.to(self.input_device)
        if attention_mask is not None or getattr(self.tokenizer, "pad_token_id", None) is None:
            return tokens, attention_mask
        bos = self.cfg.default_prepend_bos if prepend_bos is None else prepend_bos
        if side == "left":
            return tokens, pad_attention_mask(self.tokenizer, tokens, bos, side)
        if return_type in ("loss", "both") and isinstance(input, list):
            pads = int((pad_attention_mask(self.tokenizer, tokens, bos, side) == 0).sum())
            if pads:
                warnings.warn(
                    f"forward: the loss counts the {pads} pad tokens of right-padded text, as TransformerLens "
                    "does; padding_side='left' (or an attention_mask) leaves them out",
                    stacklevel=5,  # the caller of model(...)
                )
        return tokens, None

    def _graph_start(self, resid: Tensor) -> Tensor:
        """With frozen weights nothing needs a graph, so the forward keeps none, unless a backward hook is attached
        or `set_use_activation_grads(True)`: then the stream starts one, and activation gradients flow."""
        if resid.requires_grad or not torch.is_grad_enabled():
            return resid
        if self.use_activation_grads or any(hook.bwd_hooks for hook in self.hook_dict.values()):
            return resid.detach().requires_grad_(True)
        return resid

    def set_use_activation_grads(self, use_activation_grads: bool) -> None:
        """Let `model(tokens)[...].backward()` reach the activations (and backward hooks) with frozen weights.

        Attaching a backward hook (`add_hook(name, fn, "bwd")`, `run_with_cache(incl_bwd=True)`) does it by
        itself; the weights stay frozen and get no gradient. The gradients equal an unfrozen model's."""
        self.use_activation_grads = use_activation_grads

    def run_with_cache(
        self,
        *args,
        return_cache_object: bool = True,
        remove_batch_dim: bool = False,
        allow_large_cache: bool = False,
        **kwargs,
    ):
        """As `HookedRootModule.run_with_cache`, returning a TransformerLens `ActivationCache`.

        Before running, the cache is estimated from the shapes (`dcinterp.estimate_cache`); one that would take
        more than `model.cache_memory_fraction` (default 0.5) of the free memory where it lands is refused with
        a `CacheTooLarge` line, unless `allow_large_cache=True` (or the fraction is None).
        """
        if not allow_large_cache and self.cache_memory_fraction is not None and args:
            from .memory import check_cache_fits, estimate_cache

            estimate = estimate_cache(
                self,
                args[0],
                kwargs.get("names_filter"),
                kwargs.get("incl_bwd", False),
                kwargs.get("device"),
                kwargs.get("past_kv_cache"),
            )
            check_cache_fits(self, estimate, self.cache_memory_fraction)
        out, cache = super().run_with_cache(*args, remove_batch_dim=remove_batch_dim, **kwargs)
        if return_cache_object:
            cache = DCActivationCache(cache, self, has_batch_dim=not remove_batch_dim)
        return out, cache

    def loss_fn(
        self,
        logits: Float[Tensor, "b p v"],
        tokens: Int[Tensor, "b p"],
        attention_mask: Int[Tensor, "b p"] | None = None,
        per_token: bool = False,
    ) -> Tensor:
        """Next-token cross-entropy, as TransformerLens' `loss_fn` (positions where a token or the next one is
        masked out are left out of the mean, and 0 per token)."""
        return lm_cross_entropy(logits, tokens.to(logits.device), per_token, attention_mask)

    def set_use_attn_result(self, use_attn_result: bool) -> None:
        """Compute `blocks.{l}.attn.hook_result` (per-head outputs in the residual basis) or not."""
        self.cfg.use_attn_result = use_attn_result

    def set_use_split_qkv_input(self, use_split_qkv_input: bool) -> None:
        """Give each head its own copy of the stream for q, k and v (`attn.hook_q_input`, ...), or not.

        What TransformerLens' direct path patching switches on. In a DCMHA layer the dynamic compose weights
        keep reading the shared normed input: a patch on one head's copy reaches that head's q, k or v only."""
        self.cfg.use_split_qkv_input = use_split_qkv_input

    def set_use_hook_mlp_in(self, use_hook_mlp_in: bool) -> None:
        """Fork the stream into each MLP through `blocks.{l}.hook_mlp_in` (a copy: a patch there reaches that MLP
        alone), as TransformerLens."""
        self.cfg.use_hook_mlp_in = use_hook_mlp_in

    def set_use_attn_in(self, use_attn_in: bool) -> None:
        """Give each head its own copy of the stream for q, k and v together (`blocks.{l}.hook_attn_in`), or not,
        as TransformerLens. In a DCMHA layer the dynamic compose weights keep reading the shared normed input."""
        self.cfg.use_attn_in = use_attn_in

    # ----------------------------------------------------------------------------------------------
    # Weights
    @torch.no_grad()
    def init_weights(self, std: float = 0.02, identity_compose: bool = False) -> None:
        """Initialise for training: normal(std) projections, the official DCMHA initialisation.

        The parameters a plain-MHA model has too are drawn first, in its order, and DCMHA's dynamic-weight
        projections (`W_dyn_*`) last: a DCMHA model and its `use_dcmha=False` twin seeded alike start from the
        same shared weights. `identity_compose` starts the compose at the identity: the second factor of the
        low-rank projections (`qw2`, `kw2`) and the gates are zero, so every branch output is 0 and the model
        computes what its MHA twin does."""
        cfg = self.cfg
        # A stable sort into the order of the first releases (embedding and unembedding, then the blocks).
        embeddings = ("embed.W_E", "unembed.W_U")
        mha_first = sorted(self.named_parameters(), key=lambda named: ("W_dyn" in named[0], named[0] not in embeddings))
        for name, p in mha_first:
            if name.endswith((".w",)):
                p.fill_(1.0)
            elif name.split(".")[-1].startswith("b"):
                p.zero_()
            elif name.endswith("W_dyn_in"):
                p.normal_(0, math.sqrt(2 / (cfg.d_model + cfg.dyn_hidden_dim)))
            elif name.endswith("W_dyn_out"):
                H, R = cfg.n_heads, cfg.dcmha_rank
                p.normal_(0, 0.02 / (math.sqrt(2 * H * R) * (H + R)))
                if identity_compose:
                    p[:, :, R:].zero_()  # w2 = 0 (not w1 as well: at w1 = w2 = 0 neither has a gradient)
            elif name.endswith("W_dyn_gate"):
                p.normal_(0, 0.05 * math.sqrt(2 / (cfg.n_heads + cfg.d_model)))
                if identity_compose:
                    p.zero_()
            elif name.endswith(("W_O", "W_out")):
                p.normal_(0, std / math.sqrt(2 * cfg.n_layers))
            else:
                p.normal_(0, std)

    def _apply(self, fn, recurse=True):
        """What `to`, `half`, `bfloat16`, `cuda`, ... run: then `cfg.dtype` and `cfg.device` say what the weights
        are and where the forward starts, as TransformerLens' `to` keeps them (code that reads `model.cfg.dtype`
        after `model.to(torch.bfloat16)` sees bfloat16)."""
        out = super()._apply(fn, recurse)
        W_E = self.embed.W_E
        if W_E.is_floating_point():
            self.cfg.dtype = W_E.dtype
        if W_E.device.type != "meta":
            self.cfg.device = str(W_E.device)
        return out

    @property
    def input_device(self) -> torch.device:
        """Where the forward starts: the embedding's device (its execution device when accelerate offloads it)."""
        device = self.embed.W_E.device
        return torch.device(self.cfg.device) if device.type == "meta" and self.cfg.device else device

    # ----------------------------------------------------------------------------------------------
    # Loading and saving (see dcinterp.loading)
    @classmethod
    def from_pretrained(
        cls,
        path_or_name,
        dtype=None,
        device=None,
        device_map=None,
        max_memory=None,
        offload_folder=None,
        fold_ln: bool = False,
        center_writing_weights: bool = False,
        center_unembed: bool = False,
        fold_value_biases: bool = False,
        refactor_factored_attn_matrices: bool = False,
    ) -> "HookedDCFormer":
        """Load a local checkpoint directory (DCPythia, DCFormer, GPT-NeoX/Pythia, dcinterp) or an embedded model.

        The weights come as released (the paper's Eq. 12 reads the raw norms), as TransformerLens 4's
        `TransformerBridge`; TransformerLens' processing is one argument away: `fold_ln=True,
        center_writing_weights=True, center_unembed=True` (and `fold_value_biases=True`), done in place before
        dispatch (`dcinterp.processing`, docs/weight-processing.md).

        The weights stream from the (memory-mapped) files straight into `dtype` on `device`, or across devices
        with `device_map` ("auto", "balanced", "sequential" or {module name: device}, with `max_memory` as in
        Hugging Face and `offload_folder` for "disk"). The model comes back in eval mode with its parameters
        frozen; `model.train().requires_grad_(True)` unfreezes it for fine-tuning.
        """
        checkpoint = open_checkpoint(path_or_name, dtype)
        with torch.device("meta"):
            model = cls(checkpoint.cfg, init=False)
        device_map = stream_weights(model, checkpoint, device, device_map, max_memory, offload_folder)
        model.tokenizer = load_tokenizer(checkpoint.directory)
        model.weight_processing = checkpoint.weight_processing
        processing = dict(
            fold_ln=fold_ln,
            center_writing_weights=center_writing_weights,
            center_unembed=center_unembed,
            fold_value_biases=fold_value_biases,
            refactor_factored_attn_matrices=refactor_factored_attn_matrices,
        )
        if any(processing.values()):  # in place, before accelerate's hooks: no second copy of the weights
            model.process_weights_(**processing)
        dispatch(model, device_map, offload_folder)
        return model.eval().requires_grad_(False)  # inference: no autograd graph over the weights

    def save_pretrained(self, directory) -> None:
        """Write `config.json`, `model.safetensors` and the tokenizer (if any) to a directory."""
        save_checkpoint(self, directory)


def pad_attention_mask(
    tokenizer, tokens: Int[Tensor, "b p"], prepend_bos: bool, padding_side: Literal["left", "right"]
) -> Int[Tensor, "b p"]:
    """TransformerLens' `get_attention_mask`: 0 at the leading (left padding) or trailing (right) pad tokens, else
    1; a BOS that shares the pad token's id stays visible where BOS was prepended."""
    mask = torch.ones_like(tokens)
    real = tokens.ne(tokenizer.pad_token_id)
    if padding_side == "right":
        mask[real.flip(-1).cumsum(-1).flip(-1) == 0] = 0
        return mask
    leading = real.cumsum(-1) == 0
    mask[leading] = 0
    if prepend_bos and tokenizer.bos_token_id == tokenizer.pad_token_id:
        mask[torch.arange(len(mask)), (leading.sum(-1) - 1).clamp_min(0)] = 1
    return mask


def lm_cross_entropy(
    logits: Float[Tensor, "b p v"],
    tokens: Int[Tensor, "b p"],
    per_token: bool = False,
    attention_mask: Int[Tensor, "b p"] | None = None,
) -> Tensor:
    """Next-token cross-entropy; per token [batch, pos-1] or the mean (over unmasked pairs, as TransformerLens)."""
    logprobs = at_least_float32(logits[:, :-1]).log_softmax(-1)
    loss = -logprobs.gather(-1, tokens[:, 1:, None])[..., 0]
    kept = torch.ones_like(loss, dtype=torch.bool)
    if attention_mask is not None:
        mask = attention_mask.to(loss.device).bool()
        kept = mask[:, :-1] & mask[:, 1:]
        loss = loss.masked_fill(~kept, 0.0)
    if per_token:
        return loss
    if not kept.any():  # a mean over nothing would be NaN
        raise ValueError(
            "loss: no token has a next token to predict (every row has fewer than two real tokens); "
            "loss_per_token=True gives the empty per-token table"
        )
    return loss.sum() / kept.sum()


def get_act_name(name: str, layer: int | None = None, layer_type: str | None = None) -> str:
    """TransformerLens' `get_act_name`, knowing DCMHA's hooks as well.

    `get_act_name("composed_pattern", 2)` is `blocks.2.attn.hook_composed_pattern`; a compose stage's hooks take
    the stage as layer_type: `get_act_name("o_kp", 16, "post")` is `blocks.16.attn.post_compose.hook_o_kp`.
    Every other name goes to TransformerLens unchanged.
    """
    from transformer_lens.utilities import get_act_name as tl_get_act_name

    if layer is not None and name in DCMHA_ACT_NAMES:
        return f"blocks.{layer}.attn.hook_{name}"
    if layer is not None and name in COMPOSE_ACT_NAMES:
        stage = (layer_type or "").removesuffix("_compose")
        if stage not in ("pre", "post"):
            raise ValueError(f"get_act_name: {name!r} is a compose-stage hook; pass layer_type 'pre' or 'post'")
        return f"blocks.{layer}.attn.{stage}_compose.hook_{name}"
    return tl_get_act_name(name, layer, layer_type)
