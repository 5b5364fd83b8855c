"""The MLP: GELU (Pythia) or SwiGLU (Transformer++), with DCFormer++'s mgate where the config has one."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from ..config import DCFormerConfig


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
