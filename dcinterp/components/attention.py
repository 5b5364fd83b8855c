"""One attention layer: q, k, v, DCMHA's dynamic weights and compose stages (or plain MHA), z, the output."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable

import torch
from jaxtyping import Bool, Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from .. import dcmha
from ..config import DCFormerConfig
from .compose import Compose
from .helpers import hooked
from .norms import HeadRMSNorm
from .rotary import model_rotary_tables, rotate

BRANCH_DYN_INDEX = {"pre": (0, 1), "post": (2, 3)}  # dynamic-weight branches c: [pre q, pre k, post q, post k]


def _gradient_needed(tensors: Iterable[Tensor]) -> bool:
    """Whether autograd will need a gradient through an operation on these tensors (read only in grad mode, and only
    up to the first that requires grad: a module's parameters are walked only then)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


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
        if hooked(self.hook_attn_scores):
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
        square_read = hooked(self.hook_attn_scores) or hooked(self.hook_pattern)
        if self.cfg.use_dcmha:
            square_read = square_read or hooked(self.hook_composed_scores) or hooked(self.hook_composed_pattern)
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
