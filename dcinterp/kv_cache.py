"""A key-value cache for DCMHA, used as TransformerLens' `HookedTransformerKeyValueCache` is.

    cache = DCFormerKeyValueCache.init_cache(model.cfg, model.input_device, batch_size=1)
    logits = model(prompt_tokens, past_kv_cache=cache)          # fills the cache
    logits = model(next_token[:, None], past_kv_cache=cache)    # one new position, the earlier ones from the cache

What a new token needs from the tokens before it, per layer:
- their keys (after QK-norm and rotary, `hook_rot_k`) and values, as in any transformer;
- in a DCMHA layer, the key side of both `Compose` stages: the key-wise projection weights `kw1`, `kw2` and the
  key-wise gate `kg` (paper Sec. 4.4: "we cache the results of key-wise computation of `Compose` along with the
  KVCache"). The new query's row of the composed scores and pattern is then its query-side weights (`qw1`, `qw2`,
  `qg`, from its own residual stream) applied to its row of scores, plus the cached key side applied per key:
      o_kp[m, t, s] = sum_r (sum_n A[n, t, s] kw1[s, r, n]) kw2[s, r, m],   o_kg[n, t, s] = A[n, t, s] kg[s, n].
The key side is stored key-last ([batch, rank, head, key], [batch, head, key]): for one query the branch is then two
broadcast multiply-adds over contiguous memory. A stage's kw1, kw2 and kg lie in one buffer, one above the other
([batch, 2 rank head + head, key]), so that a step appends them with one copy. `past_key_compose(stage)` gives them
in the hooks' layout.

Everything grows in place along the key axis (the capacity doubles when full), so a step costs no copy of the past.
The attention mask (1 for a real token, 0 for padding) of every position so far is kept too: it masks padded keys
and gives each row's rotary positions (counted from its first real token, as TransformerLens does), so a
left-padded batch generates what each prompt alone would. A frozen cache is read but not written: run several
continuations of one cached prefix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from jaxtyping import Float, Int
from torch import Tensor

from .config import DCFormerConfig


class GrowingTensor:
    """A tensor that grows along one dimension with amortised O(1) appends (its capacity doubles when full).

    Args:
        dim: the dimension it grows along.
    """

    def __init__(self, dim: int):
        self.dim = dim
        self.buffer: Tensor | None = None
        self.length = 0

    def _take(self, tensor: Tensor, n: int) -> Tensor:
        return tensor.narrow(self.dim, 0, n)

    @property
    def value(self) -> Tensor | None:
        return None if self.buffer is None else self._take(self.buffer, self.length)

    def append(self, new: Tensor, frozen: bool = False) -> Tensor:
        """The tensor with `new` appended.

        Args:
            new: the new part, of the stored tensor's shape but along `dim`.
            frozen: return the longer tensor without storing it.

        Returns:
            Everything so far, `new` last.
        """
        if self.buffer is None:
            if frozen:
                return new
            self.buffer = new.new_empty(new.shape)
            self.length = 0
        if frozen:
            return torch.cat([self.value, new.to(self.buffer)], dim=self.dim)
        if torch.is_grad_enabled() and (new.requires_grad or self.buffer.requires_grad):
            # A backward may still need the earlier steps' views of the buffer: grow a new one, never write in place.
            self.buffer = new if self.length == 0 else torch.cat([self.value, new.to(self.buffer)], dim=self.dim)
            self.length = self.buffer.shape[self.dim]
            return self.buffer
        needed = self.length + new.shape[self.dim]
        capacity = self.buffer.shape[self.dim]
        if needed > capacity:
            shape = list(self.buffer.shape)
            shape[self.dim] = max(needed, 2 * capacity)
            grown = self.buffer.new_empty(shape)
            self._take(grown, self.length).copy_(self.value)
            self.buffer = grown
        self.buffer.narrow(self.dim, self.length, new.shape[self.dim]).copy_(new)
        self.length = needed
        return self.value


@dataclass
class DCFormerKeyValueCacheEntry:
    """One layer's cache: keys and values [batch, pos_so_far, head, d_head], and per compose stage its key side.

    Keys and values are stored head-major, [batch, head, pos, d_head] (given and returned as views in the first
    layout): a new query's scores and P V are then one batched matmul over (batch, head) whatever the batch, where
    position-major storage made torch copy the whole cache for them at every step once the batch was above one.

    Attributes:
        keys: [batch, head, pos, d_head].
        values: [batch, head, pos, d_head].
        key_compose: stage -> its key side, key-last: kw1, kw2 [b, rank, head, s] and kg [b, head, s] (the branches
            that are on) one above the other in one buffer [b, features, s].
        key_compose_layout: stage -> (name, [rank, head] or [head]) of each piece of `key_compose`.
        frozen: appends are returned, not stored.
    """

    keys: GrowingTensor = field(default_factory=lambda: GrowingTensor(2))
    values: GrowingTensor = field(default_factory=lambda: GrowingTensor(2))
    key_compose: dict[str, GrowingTensor] = field(default_factory=dict)
    key_compose_layout: dict[str, list[tuple[str, tuple[int, ...]]]] = field(default_factory=dict)
    frozen: bool = False

    @property
    def past_keys(self) -> Float[Tensor, "batch pos_so_far head d_head"] | None:
        return None if self.keys.value is None else self.keys.value.transpose(1, 2)

    @property
    def past_values(self) -> Float[Tensor, "batch pos_so_far head d_head"] | None:
        return None if self.values.value is None else self.values.value.transpose(1, 2)

    def append(self, new_keys: Tensor, new_values: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of every position so far, the new ones last (stored unless frozen).

        Args:
            new_keys: [batch, new, head, d_head].
            new_values: [batch, new, head, d_head].

        Returns:
            (keys, values), each [batch, pos, head, d_head].
        """
        keys = self.keys.append(new_keys.transpose(1, 2), self.frozen)
        values = self.values.append(new_values.transpose(1, 2), self.frozen)
        return keys.transpose(1, 2), values.transpose(1, 2)

    def append_key_compose(
        self, stage: str, kw1: Tensor | None, kw2: Tensor | None, kg: Tensor | None
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """A compose stage's key side for the new positions in; that of every position so far out, key-last.

        Args:
            stage: "pre" or "post".
            kw1: [b, new, rank, head], or None where the branch is off.
            kw2: [b, new, rank, head], or None.
            kg: [b, new, head], or None.

        Returns:
            (kw1, kw2 [b, rank, head, s], kg [b, head, s]), None for branches that are off.

        Raises:
            ValueError: the branches differ from those of the earlier steps.
        """
        named = {name: w for name, w in (("kw1", kw1), ("kw2", kw2), ("kg", kg)) if w is not None}
        if not named:
            return None, None, None
        layout = [(name, tuple(w.shape[2:])) for name, w in named.items()]
        if self.key_compose_layout.setdefault(stage, layout) != layout:
            raise ValueError(
                f"past_kv_cache: the {stage}-compose key side holds {self.key_compose_layout[stage]}, "
                f"this step gives {layout}"
            )
        pieces = [w.flatten(2) for w in named.values()]
        new = (pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)).transpose(1, 2)  # [b, features, new]
        stored = self.key_compose.setdefault(stage, GrowingTensor(-1)).append(new, self.frozen)
        by_name = self._split_key_compose(stage, stored)
        return by_name.get("kw1"), by_name.get("kw2"), by_name.get("kg")

    def _split_key_compose(self, stage: str, stored: Tensor) -> dict[str, Tensor]:
        """The views of a stage's key-side buffer [b, features, s]: kw1, kw2 [b, rank, head, s], kg [b, head, s]."""
        layout = self.key_compose_layout[stage]
        pieces = stored.split([math.prod(shape) for _, shape in layout], dim=1)
        return {name: piece.unflatten(1, shape) for (name, shape), piece in zip(layout, pieces, strict=True)}

    def past_key_compose(self, stage: str) -> dict[str, Tensor]:
        """The cached key side of a compose stage in the hooks' layout.

        Args:
            stage: "pre" or "post".

        Returns:
            kw1, kw2 [b, pos, rank, head], kg [b, pos, head], of the branches cached.
        """
        stored = self.key_compose.get(stage)
        if stored is None or stored.value is None:
            return {}
        return {name: t.movedim(-1, 1) for name, t in self._split_key_compose(stage, stored.value).items()}


@dataclass
class DCFormerKeyValueCache:
    """Per-layer caches and the attention mask of the positions so far.

    Attributes:
        entries: one per layer.
        previous_attention_mask: [batch, pos_so_far], 1 real, 0 padding.
        frozen: appends are returned, not stored.
    """

    entries: list[DCFormerKeyValueCacheEntry]
    previous_attention_mask: Int[Tensor, "batch pos_so_far"]
    frozen: bool = False

    @classmethod
    def init_cache(
        cls, cfg: DCFormerConfig, device: torch.device | str | None = None, batch_size: int = 1
    ) -> DCFormerKeyValueCache:
        """An empty cache for `cfg`'s layers.

        Each layer's tensors are made on the device of that layer's first keys, so models spread over devices work.

        Args:
            cfg: the model's config.
            device: where the attention mask lives (None: cfg.device, else the CPU).
            batch_size: prompts.

        Returns:
            The cache.
        """
        device = device if device is not None else (cfg.device or "cpu")
        return cls(
            [DCFormerKeyValueCacheEntry() for _ in range(cfg.n_layers)],
            torch.ones(batch_size, 0, dtype=torch.long, device=device),
        )

    @property
    def batch_size(self) -> int:
        return self.previous_attention_mask.shape[0]

    @property
    def n_tokens(self) -> int:
        """Positions cached so far (padding included)."""
        return self.previous_attention_mask.shape[1]

    def freeze(self) -> None:
        """Make later appends return the longer tensors without storing them (every layer)."""
        self.frozen = True
        for entry in self.entries:
            entry.frozen = True

    def unfreeze(self) -> None:
        """Store appends again (every layer)."""
        self.frozen = False
        for entry in self.entries:
            entry.frozen = False

    def append_attention_mask(self, attention_mask: Int[Tensor, "batch new"]) -> Int[Tensor, "batch pos_so_far"]:
        """The mask of every position so far with the new positions' appended (stored unless frozen).

        Args:
            attention_mask: the new positions' mask [batch, new].

        Returns:
            [batch, pos_so_far].
        """
        if attention_mask.shape[0] != self.batch_size:
            raise ValueError(
                f"past_kv_cache: the cache holds a batch of {self.batch_size}, the input has "
                f"{attention_mask.shape[0]} rows"
            )
        mask = self.previous_attention_mask
        updated = torch.cat([mask, attention_mask.to(mask.device, mask.dtype)], dim=1)
        if not self.frozen:
            self.previous_attention_mask = updated
        return updated

    def __getitem__(self, layer: int) -> DCFormerKeyValueCacheEntry:
        return self.entries[layer]

    def __len__(self) -> int:
        return len(self.entries)
