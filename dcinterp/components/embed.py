"""The token embedding (`model.embed`)."""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from ..config import DCFormerConfig


class Embed(nn.Module):
    """Token embedding, as TransformerLens' `Embed` (`model.embed.W_E`)."""

    def __init__(self, cfg: DCFormerConfig):
        super().__init__()
        self.W_E = nn.Parameter(torch.empty(cfg.d_vocab, cfg.d_model))

    def forward(self, tokens: Int[Tensor, "b p"]) -> Float[Tensor, "b p d"]:
        return self.W_E[tokens]
