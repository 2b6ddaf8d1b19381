"""The launchers' host helpers: integer helpers agree with Triton's (which are slow on the host), and
the device-capability lookup is cached."""

import torch
import triton

from flashtile import config
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


def test_arch_of_keys_the_config_tables(monkeypatch):
    from flashtile.backends.triton import host

    assert host.arch_of(torch.device("cpu")) == "interpret"
    for cap, arch in (((9, 0), "sm90"), ((8, 0), "default"), ((10, 0), "default")):
        monkeypatch.setattr(host, "capability", lambda device, cap=cap: cap)
        assert host.arch_of(torch.device("cuda", 0)) == arch


class _SmallSharedMemoryKernel:
    """Stands in for a JIT kernel on a GPU whose shared memory fits at most ``fits`` stages."""

    __name__ = "_fake_kernel"

    def __init__(self, fits, name="shared memory"):
        self.fits, self.name, self.tried = fits, name, []

    def __getitem__(self, grid):
        def run(*args, num_warps, num_stages, **meta):
            from triton.runtime.errors import OutOfResources

            self.tried.append(num_stages)
            if num_stages > self.fits:
                raise OutOfResources(50000 * num_stages, 101376, self.name)
            return ("ran", grid, num_stages, meta)

        return run


def test_launch_drops_stages_until_the_config_fits_and_remembers(monkeypatch):
    import pytest

    from flashtile.backends.triton import host

    monkeypatch.setattr(host, "_REDUCED_STAGES", {})
    kern = _SmallSharedMemoryKernel(fits=2)
    x = torch.zeros(4, dtype=torch.float16)
    with pytest.warns(RuntimeWarning, match="_fake_kernel with 4 pipeline stages"):
        assert host.launch(kern, (3,), x, 7, num_warps=4, num_stages=4, BLOCK=64) == ("ran", (3,), 2, {"BLOCK": 64})
    assert kern.tried == [4, 3, 2]
    kern.tried.clear()
    assert host.launch(kern, (3,), x, 7, num_warps=4, num_stages=4, BLOCK=64)[2] == 2
    assert kern.tried == [2]  # remembered: no failing attempts on later calls
    # another dtype or constexpr is another config, tried at its own table value first
    kern.tried.clear()
    host.launch(kern, (3,), x.float(), 7, num_warps=4, num_stages=2, BLOCK=64)
    assert kern.tried == [2]


def test_launch_reraises_what_fewer_stages_cannot_fix(monkeypatch):
    import pytest
    from triton.runtime.errors import OutOfResources

    from flashtile.backends.triton import host

    monkeypatch.setattr(host, "_REDUCED_STAGES", {})
    with pytest.raises(OutOfResources):  # registers: stages are not the problem
        host.launch(_SmallSharedMemoryKernel(fits=0, name="registers"), (1,), num_warps=4, num_stages=3)
    kern = _SmallSharedMemoryKernel(fits=0)
    with pytest.raises(OutOfResources):  # nothing fits: the error, no warning about a retry that failed
        host.launch(kern, (1,), num_warps=4, num_stages=2)
    assert kern.tried == [2, 1]


def test_launch_memo_is_keyed_by_the_table_value(monkeypatch):
    import pytest

    from flashtile.backends.triton import host

    monkeypatch.setattr(host, "_REDUCED_STAGES", {})
    kern = _SmallSharedMemoryKernel(fits=2)
    with pytest.warns(RuntimeWarning, match="with 3 pipeline stages .* runs with 2"):
        host.launch(kern, (1,), num_warps=4, num_stages=3)
    kern.fits, kern.tried = 1, []  # e.g. another alignment specialisation needs less
    host.launch(kern, (1,), num_warps=4, num_stages=3)
    assert kern.tried == [2, 1]
    assert list(host._REDUCED_STAGES.values()) == [1]  # one entry, under the table's 3
    kern.tried = []
    host.launch(kern, (1,), num_warps=4, num_stages=3)
    assert kern.tried == [1]


def test_sweeps_see_the_table_config_fail(monkeypatch):
    import pytest
    from triton.runtime.errors import OutOfResources

    from flashtile.backends.triton import host

    monkeypatch.setattr(host, "_REDUCED_STAGES", {})
    kern = _SmallSharedMemoryKernel(fits=2)
    with pytest.warns(RuntimeWarning):
        host.launch(kern, (1,), num_warps=4, num_stages=3)
    kern.tried = []
    with config.override(reduce_stages_on_oor=False), pytest.raises(OutOfResources):
        host.launch(kern, (1,), num_warps=4, num_stages=3)  # neither the memo nor a retry: the config as asked
    assert kern.tried == [3]
