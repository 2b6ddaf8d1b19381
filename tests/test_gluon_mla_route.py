"""Which MLA decode calls the Gluon kernel takes (backends/triton/decode/gluon_mla.py), on CPU: each refusal
names its reason; DeepSeek's shape on an sm_90 GPU is taken."""

import pytest
import torch

from flashtile import config
from flashtile.backends.triton.decode import gluon_mla


def _call(**change):
    q = torch.empty(2, 1, 16, 64, dtype=torch.bfloat16)
    qv = torch.empty(2, 1, 16, 512, dtype=torch.bfloat16)
    kc = torch.empty(2, 256, 1, 64, dtype=torch.bfloat16)
    vc = torch.empty(2, 256, 1, 512, dtype=torch.bfloat16)
    kw = dict(block_table=None, cache_batch_idx=None, cache_leftpad=None, rotary_cos=None, window_left=-1,
              window_right=-1, softcap=0.0, alibi_slopes=None, learnable_sink=None, attention_chunk=0)
    tensors = dict(q=q, qv=qv, k_cache=kc, v_cache=vc)
    for key, val in change.items():
        (tensors if key in tensors else kw)[key] = val
    return gluon_mla.refusal(tensors["q"], tensors["qv"], tensors["k_cache"], tensors["v_cache"], **kw)


@pytest.fixture
def sm90(monkeypatch):
    monkeypatch.setattr(gluon_mla, "capability", lambda device: (9, 0))
    monkeypatch.setattr(torch.Tensor, "device", property(lambda t: torch.device("cuda")), raising=False)


def test_cpu_tensors_are_refused():
    assert "sm_90" in _call()


@pytest.mark.usefixtures("sm90")
@pytest.mark.parametrize("change,reason", [
    (dict(qv=None), "qv"),
    (dict(q=torch.empty(2, 1, 16, 64)), "dtype"),
    (dict(v_cache=torch.empty(2, 256, 1, 256, dtype=torch.bfloat16)), "head dims"),
    (dict(k_cache=torch.empty(2, 256, 2, 64, dtype=torch.bfloat16)), "kv heads"),
    (dict(cache_batch_idx=torch.zeros(2, dtype=torch.int32)), "cache_batch_idx"),
    (dict(window_left=128, window_right=0), "window"),
    (dict(softcap=30.0), "softcap"),
    (dict(learnable_sink=torch.zeros(16)), "sink"),
    (dict(attention_chunk=128), "chunk"),
    (dict(block_table=torch.zeros(2, 1, dtype=torch.int32), k_cache=torch.empty(8, 16, 1, 64, dtype=torch.bfloat16),
          v_cache=torch.empty(8, 16, 1, 512, dtype=torch.bfloat16)), "pages of 16"),
    # every batch row's keys one after another is what the 2-D descriptor reads: a cut of a longer cache is not
    (dict(v_cache=torch.empty(2, 512, 1, 512, dtype=torch.bfloat16)[:, :256]), "rows"),
])
def test_refusals_name_the_reason(change, reason):
    assert reason in _call(**change)


@pytest.mark.usefixtures("sm90")
def test_deepseek_shape_is_taken():
    assert _call() is None
    assert _call(window_right=0) is None  # causal
    with config.override(gluon=False):
        assert "FLASHTILE_GLUON" in _call()
