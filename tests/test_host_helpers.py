"""The launchers' plain-Python integer helpers agree with Triton's (which are slow on the host)."""

import triton

from flashtile.backends.triton.host import cdiv, next_pow2


def test_cdiv_and_next_pow2_match_triton():
    for a in range(0, 300):
        for b in (1, 2, 3, 16, 64, 127):
            assert cdiv(a, b) == triton.cdiv(a, b)
    for x in range(1, 5000):
        assert next_pow2(x) == triton.next_power_of_2(x)
