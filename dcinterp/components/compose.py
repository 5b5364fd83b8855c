"""One Compose stage of DCMHA (Eq. 4-8 in dcinterp.model's docstring): the branches that mix heads, and their hooks."""

from __future__ import annotations

from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from .. import dcmha
from ..config import DCFormerConfig
from ..dcmha import materialised
from .helpers import hooked


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
        return any(hooked(hook) for hook in self.branch_output_hooks)

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
