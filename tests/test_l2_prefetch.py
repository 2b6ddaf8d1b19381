"""The decode kernel's L2 prefetch-size knob (FLASHTILE_DECODE_L2_PREFETCH): the PTX rewrite and its validation."""

import pytest

from flashtile.kernels import l2_prefetch

PTX = """\tcp.async.cg.shared.global [ %r15 + 0 ], [ %rd22 + 0 ], 0x10, %r141;
\tcp.async.ca.shared.global [ %r16 + 0 ], [ %rd23 + 0 ], 0x4;
\tcp.async.cg.shared.global [ %r17 + 0 ], [ %rd24 + 0 ], 0x10;
\tcp.async.commit_group;
"""


def test_hint_goes_on_every_cg_copy_and_nothing_else():
    out = l2_prefetch.add_hint(PTX, 256)
    assert out.count("cp.async.cg.shared.global.L2::256B [") == 2
    assert "cp.async.ca.shared.global [" in out  # 4-byte copies keep their form
    assert "cp.async.commit_group;" in out
    assert l2_prefetch.add_hint(out, 256).count(".L2::256B") == 2  # an already-hinted copy is left alone


@pytest.mark.parametrize("value, size", [("", 0), ("0", 0), ("64", 64), ("128", 128), ("256", 256)])
def test_setting_reads_the_variable(monkeypatch, value, size):
    monkeypatch.setenv("FLASHTILE_DECODE_L2_PREFETCH", value)
    assert l2_prefetch.setting() == size


@pytest.mark.parametrize("value", ["32", "512", "on", "1"])
def test_setting_rejects_other_values(monkeypatch, value):
    monkeypatch.setenv("FLASHTILE_DECODE_L2_PREFETCH", value)
    with pytest.raises(ValueError, match="FLASHTILE_DECODE_L2_PREFETCH"):
        l2_prefetch.setting()
