"""GPU tests of the Gluon paged-decode kernel (FLASHTILE_DECODE_GLUON_PAGED=1, an experiment:
backends/triton/gluon_decode.py, kernels/gluon_decode_paged.py): against the reference and close to the
Triton kernel (another order of operations, so not bit for bit) for 16- / 32- / 64-token pages, d = 64 /
128, bf16 and fp16, GQA groups of 1, 4 and 64, split and not, with an append and an empty row. NaN in
every pool slot outside a row's pages, with the table padded by -1, must not reach the output, and a
graph-captured step replays with new lengths. Run alone: gpu_check.sh tests-decode-gluon-paged."""

import pytest
import torch

from flashtile import flash_attn_with_kvcache
from flashtile.backends.triton import decode as triton_launcher
from flashtile.backends.triton import gluon_decode as launcher
from spies import record_launch_meta
from test_gpu_kvcache import _assert_paths_close, _capture, _check, _check_pages_outside_rows_never_read, _inputs

pytestmark = [pytest.mark.gpu, pytest.mark.gluon]


@pytest.fixture(autouse=True)
def _sm90():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon decode kernel is sm_90 only")


@pytest.mark.parametrize("b,cap,page,s_new,d,dtype,num_splits,h,h_k", [
    (1, 8192, 16, 0, 128, torch.bfloat16, 0, 32, 8), (2, 5000, 16, 1, 128, torch.bfloat16, 0, 32, 8),
    (3, 3000, 32, 2, 64, torch.float16, 0, 32, 8), (8, 8192, 64, 0, 128, torch.bfloat16, 0, 32, 8),
    (40, 2048, 16, 1, 128, torch.bfloat16, 0, 32, 8), (2, 1000, 16, 0, 128, torch.bfloat16, 1, 32, 8),
    (1, 300, 16, 1, 128, torch.bfloat16, 7, 32, 8), (3, 2000, 64, 0, 64, torch.bfloat16, 0, 8, 8),
    (2, 3000, 16, 1, 128, torch.float16, 0, 64, 1), (4, 4096, 32, 0, 128, torch.float16, 5, 16, 4)])
def test_gluon_paged_against_reference_and_triton(monkeypatch, b, cap, page, s_new, d, dtype, num_splits, h, h_k):
    q, kc, vc, kw = _inputs(b, 1, s_new, h, h_k, d, cap, dtype, page=page, seed=b + page)
    if b > 1 and s_new == 0:
        kw["cache_seqlens"][1] = 0  # an empty row: out 0, lse +inf (and, split, empty splits)
    monkeypatch.setattr(launcher, "OVERRIDE", True)
    metas = record_launch_meta(monkeypatch, triton_launcher, triton_launcher._decode_kernel)
    _check(q, kc, vc, kw, causal=True, num_splits=num_splits)
    assert not metas, "the call went to the Triton decode kernel"
    outs = []
    for on in (False, True):
        monkeypatch.setattr(launcher, "OVERRIDE", on)
        outs.append(flash_attn_with_kvcache(q, kc.clone(), vc.clone(), causal=True, num_splits=num_splits,
                                            return_softmax_lse=True, **kw))
    _assert_paths_close(outs)


def test_gluon_paged_never_reads_outside_the_rows_pages(monkeypatch):
    monkeypatch.setattr(launcher, "OVERRIDE", True)
    _check_pages_outside_rows_never_read()


def test_gluon_paged_in_a_cuda_graph(monkeypatch):
    monkeypatch.setattr(launcher, "OVERRIDE", True)
    q, kc, vc, kw = _inputs(2, 1, 0, 32, 8, 128, 8192, torch.bfloat16, page=16, seed=11)
    lens = kw.pop("cache_seqlens")
    static_lens = lens.clone()
    graph, out = _capture(lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=static_lens, causal=True, **kw))
    for t in (0, 37, -500):
        new_lens = (lens + t).clamp(0, 8192)  # lengths inside the cache, as the contract asks
        static_lens.copy_(new_lens)
        graph.replay()
        torch.cuda.synchronize()
        ref = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=new_lens, causal=True, **kw)
        assert torch.equal(out, ref)


def test_gluon_paged_pdl_chain_in_a_graph(monkeypatch):
    """Four layers' calls captured in one graph with programmatic dependent launch forced on, each layer's
    query the previous layer's output (a kernel that read before its wait would see a stale input), against
    the same chain launched ordinarily: bit for bit."""
    monkeypatch.setattr(launcher, "OVERRIDE", True)
    layers = [_inputs(1, 1, 0, 32, 8, 128, 8192, torch.bfloat16, page=16, seed=20 + i) for i in range(4)]
    q0 = layers[0][0]

    def chain():
        q = q0
        for _, kc, vc, kw in layers:
            q = flash_attn_with_kvcache(q, kc, vc, causal=True, **kw)
        return q

    monkeypatch.setattr(triton_launcher, "PDL_OVERRIDE", False)
    ref = chain()
    monkeypatch.setattr(triton_launcher, "PDL_OVERRIDE", True)
    graph, out = _capture(chain)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)
