"""One transformer block: the norms, attention and MLP on the residual stream, sequential or parallel."""

from __future__ import annotations

from jaxtyping import Bool, Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from ..config import DCFormerConfig
from .attention import Attention
from .mlp import MLP
from .norms import Norm


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
