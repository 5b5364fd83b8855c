"""The host's grid arithmetic (dcinterp.dcmha.jit) gives what Triton's own constexpr functions give."""

import pytest

from dcinterp.dcmha.jit import cdiv, next_power_of_2

triton = pytest.importorskip("triton")


def test_cdiv_and_next_power_of_2_equal_tritons():
    for n in range(1, 3000):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 16, 48, 64, 2048):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
