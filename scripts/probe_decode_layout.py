"""Is cuDNN's lead on long decode rows the memory layout? (H200 probe)

Usage: PYTHONPATH=src python scripts/probe_decode_layout.py --out probe_decode_layout.json

`bench decode` gives SDPA (flash, cuDNN) head-major (b, h_k, s, d) copies of the cache, so each
kv head's keys are one contiguous stream; flashtile reads the FlashAttention layout (b, s, h_k, d),
where a kv head's key rows are 256-byte pieces 2 KiB apart (d = 128, 8 kv heads, bf16). On the
memory-bound rows (b = 8 / 32, long caches) cuDNN has been 1%-3% faster. This times, as
single-call CUDA-graph replays (triton.testing.do_bench_cudagraph) on the decode table's shape
(GQA 32/8, d 128, bf16, one query token):
- flashtile on the (b, s, h_k, d) cache (``ft_seq_major``), and on a (b, s, h_k, d) *view* of a
  head-major buffer (``ft_head_major``: the kernel takes any strides);
- SDPA cuDNN on head-major tensors (``cudnn_head_major``) and on the transposed view of the
  sequence-major cache (``cudnn_seq_major``, if cuDNN accepts those strides; else its error).
If ft_head_major beats ft_seq_major by about cuDNN's lead, the gap is the layout, not the kernel.
"""

import argparse
import functools
import json
import time

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile


def timed(fn) -> float | str:
    try:
        fn()
        torch.cuda.synchronize()
        return round(triton.testing.do_bench_cudagraph(fn, rep=50) * 1000, 1)
    except Exception as e:  # a layout a backend refuses: record why
        return f"{type(e).__name__}: {str(e)[:160]}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="8,16384;8,65536;32,16384;32,65536")
    args = ap.parse_args()
    h, h_k, d = 32, 8, 128
    rows = []
    for item in args.rows.split(";"):
        b, s = (int(x) for x in item.split(","))
        q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
        k_seq = torch.randn(b, s, h_k, d, device="cuda", dtype=torch.bfloat16)
        v_seq = torch.randn_like(k_seq)
        k_head = k_seq.transpose(1, 2).contiguous()  # (b, h_k, s, d) memory
        v_head = v_seq.transpose(1, 2).contiguous()
        lens = torch.full((b,), s, device="cuda", dtype=torch.int32)
        q_sdpa = q.transpose(1, 2)  # (b, h, 1, d)

        def cudnn(kk, vv, q_sdpa=q_sdpa):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q_sdpa, kk, vv, enable_gqa=True)

        def ft(kk, vv, q=q, lens=lens):
            return flashtile.flash_attn_with_kvcache(q, kk, vv, cache_seqlens=lens)

        k_hv, v_hv = k_head.transpose(1, 2), v_head.transpose(1, 2)  # (b, s, h_k, d) views, head-major memory
        k_st, v_st = k_seq.transpose(1, 2), v_seq.transpose(1, 2)  # (b, h_k, s, d) views, sequence-major
        row = {"b": b, "seqlen_k": s,
               "ft_seq_major": timed(functools.partial(ft, k_seq, v_seq)),
               "ft_head_major": timed(functools.partial(ft, k_hv, v_hv)),
               "cudnn_head_major": timed(functools.partial(cudnn, k_head, v_head)),
               "cudnn_seq_major": timed(functools.partial(cudnn, k_st, v_st))}
        a = flashtile.flash_attn_with_kvcache(q, k_seq, v_seq, cache_seqlens=lens)
        c = flashtile.flash_attn_with_kvcache(q, k_head.transpose(1, 2), v_head.transpose(1, 2), cache_seqlens=lens)
        row["layouts_bitwise_equal"] = bool(torch.equal(a, c))
        print(row, flush=True)
        rows.append(row)
        del k_seq, v_seq, k_head, v_head, k_hv, v_hv, k_st, v_st
        torch.cuda.empty_cache()
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%d"), "timing": "do_bench_cudagraph, us, one call per replay",
            "shape": "GQA 32/8, d 128, bf16, one query token"}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
