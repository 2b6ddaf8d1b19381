"""The launchers' host helpers: integer helpers agree with Triton's (which are slow on the host), and
the device-capability lookup is cached."""

import torch
import triton

from flashtile.backends.triton.host import cdiv, next_pow2


def test_cdiv_and_next_pow2_match_triton():
    for a in range(0, 300):
        for b in (1, 2, 3, 16, 64, 127):
            assert cdiv(a, b) == triton.cdiv(a, b)
    for x in range(1, 5000):
        assert next_pow2(x) == triton.next_power_of_2(x)


def test_capability_is_asked_once_per_device(monkeypatch):
    from flashtile.backends.triton import host

    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: calls.append(i) or (9, 0))
    host._capability.cache_clear()
    try:
        for _ in range(3):
            assert host.capability(torch.device("cuda", 1)) == (9, 0)
        assert calls == [1]
    finally:
        host._capability.cache_clear()
