"""Host arithmetic of the Triton launches: grids, block sizes, and the signature by which a call's checked arguments
are recognised. Triton's own `triton.cdiv` and `triton.next_power_of_2` are constexpr functions that cost the host
about 2 us a call (Triton 3.9), a dozen calls a layer."""


def cdiv(n: int, d: int) -> int:
    """n / d rounded up."""
    return -(-n // d)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def signature(*tensors) -> tuple:
    """What a launch's checks and settings depend on: each tensor's shape, dtype and device (None for None)."""
    return tuple(None if x is None else (x.shape, x.dtype, x.device) for x in tensors)
