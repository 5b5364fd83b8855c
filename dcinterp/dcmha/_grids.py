"""Host arithmetic of the Triton launches' grids and block sizes. Triton's own `triton.cdiv` and
`triton.next_power_of_2` are constexpr functions that cost the host about 2 us a call (Triton 3.9), a dozen calls a
layer."""


def cdiv(n: int, d: int) -> int:
    """n / d rounded up."""
    return -(-n // d)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()
