"""Host arithmetic of the Triton launches: grids, block sizes, and the arguments' checks made once a signature.
Triton's own `triton.cdiv` and `triton.next_power_of_2` are constexpr functions that cost the host about 2 us a call
(Triton 3.9), a dozen calls a layer; the checks of a layer's arguments cost the host more than its launch."""

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def cdiv(n: int, d: int) -> int:
    """n / d rounded up."""
    return -(-n // d)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def signature(*tensors) -> tuple:
    """What a launch's checks and settings depend on: each tensor's shape, dtype and device (None for None)."""
    return tuple(None if x is None else (x.shape, x.dtype, x.device) for x in tensors)


def checked_once(seen: dict, key: tuple, check: Callable[[], T]) -> T:
    """What `check()` gives for arguments of this key (their `signature` and options), calling it only the first
    time the key is seen: a layer called again with the same shapes, as every layer of a forward is, skips its
    checks. Arguments that fail raise every time (their key is not kept); the 256 latest keys are."""
    if key not in seen:
        value = check()
        if len(seen) >= 256:
            seen.clear()
        seen[key] = value
    return seen[key]
