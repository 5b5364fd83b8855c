"""The unembedding (`model.unembed`)."""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor, nn

from ..config import DCFormerConfig


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
