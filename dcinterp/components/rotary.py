"""The rotary embedding of q and k: its cos/sin tables, and the rotation ("half" pairing)."""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..config import DCFormerConfig
from .helpers import at_least_float32


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
