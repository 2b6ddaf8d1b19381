"""The dQ launch's pipeline depth where q / k's head dim is split (192 = 128 + 64): SPLIT_DQ_STAGES on sm_90 for
16-bit inputs, unless the caller set the row (config.bwd_tiles, or a FLASHTILE_BWD_CONFIGS file with a row for
this call); a file holding other rows only leaves it alone. The kernels are not run: the launches are captured."""

import json

import pytest
import torch

from flashtile import config
from flashtile.backends.triton import attn_bwd as launcher
from flashtile.kernels.attn_bwd import BWD_CONFIGS
from flashtile.params import AttnParams


def _dq_stages(monkeypatch, d, dv, dtype=torch.float16, **settings):
    seen = []
    monkeypatch.setattr(launcher, "arch_of", lambda device: "sm90")
    monkeypatch.setattr(launcher, "run_kernel", lambda *a, **kw: None)
    monkeypatch.setattr(launcher, "launch", lambda kernel, grid, *a, **kw: seen.append((kernel, kw)))
    b, s, h = 1, 64, 2
    q, k = (torch.zeros(b, s, h, d, dtype=dtype) for _ in range(2))
    v, out, dout = (torch.zeros(b, s, h, dv, dtype=dtype) for _ in range(3))
    lse = torch.zeros(b, h, s)
    grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    with config.override(**settings):
        launcher.attn_bwd(dout, q, k, v, out, lse, AttnParams(softmax_scale=0.1, causal=True, window_right=0), *grads)
    return next(kw["num_stages"] for kernel, kw in seen if kernel is launcher._attn_bwd_dq_kernel)


def test_split_head_dims_take_the_deeper_pipeline(monkeypatch):
    table = BWD_CONFIGS[("sm90", 256)][1][3]
    assert _dq_stages(monkeypatch, 192, 128) == 3
    assert _dq_stages(monkeypatch, 192, 192) == 2
    assert _dq_stages(monkeypatch, 256, 256) == table  # not split: the table's row
    assert _dq_stages(monkeypatch, 192, 128, dtype=torch.float32) == table  # measured for 16-bit tiles only


@pytest.mark.parametrize("rows, want", [({"sm90,64": [[32, 64, 4, 1], [64, 64, 4, 1]]}, 3),
                                        ({"sm90,256": [[32, 64, 4, 1], [64, 64, 4, 1]]}, 1),
                                        ({"sm90,256,True": [[32, 64, 4, 1], [64, 64, 4, 2]]}, 2)])
def test_a_config_file_overrides_only_its_own_rows(monkeypatch, tmp_path, rows, want):
    path = tmp_path / "bwd.json"
    path.write_text(json.dumps(rows))
    assert _dq_stages(monkeypatch, 192, 128, bwd_configs=str(path)) == want


def test_bwd_tiles_setting_is_taken_as_it_is(monkeypatch):
    assert _dq_stages(monkeypatch, 192, 128, bwd_tiles=((16, 16, 4, 1), (16, 16, 4, 1))) == 1
