"""Does a TMA ring close cuDNN's lead at b = 32? (H200 probe, session 16)

Usage: PYTHONPATH=src python scripts/probe_decode_gluon_contiguous.py --out probe.json [--rows "32,8192;32,65536"]

At b = 32 the Triton decode kernel runs at 2 stages so that two programs share an SM; Triton's pipeliner
then gives each of K and V one buffer, issues the next tile's copies at the end of an iteration and waits
for both at the top of the next, so a program has nothing in flight while it computes (the TTGIR of the
sm_90 build). cuDNN reaches 94.4% of DRAM peak against our 92.8% on the same bytes. Session 13's Gluon
decode kernel (kernels/gluon_decode_paged.py: a ring of NUM_BUFFERS K / V tiles landed by TMA, an mbarrier
per tile and tensor, one warp-group MMA per tile, the refill issued as soon as a slot's MMAs retire) lost
on 16-token pages, whose tiles took 16 small boxes; here it reads a contiguous cache as a pool of
BLOCK_N-token pages (page j of row r is r * capacity / BLOCK_N + j), one box per tile.

Times single-call CUDA-graph replays (triton.testing.do_bench_cudagraph) of flashtile's default, each ring
shape (BLOCK_N, NUM_BUFFERS; all fit two programs an SM), SDPA cuDNN on head-major copies (as `bench decode`
gives it) and flashtile again; checks each Gluon output against flashtile's. GQA 32 / 8, d = 128, bf16.
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

RINGS = ((64, 2), (64, 3), (32, 4), (128, 1))
H, H_K, D = 32, 8, 128


def gluon_call(q, k_cache, v_cache, lens, block_n: int, buffers: int):
    """The Gluon kernel on the contiguous cache seen as a pool of block_n-token pages, unsplit."""
    import triton.experimental.gluon.language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from flashtile.kernels.gluon_decode_paged import _gluon_paged_decode_kernel

    b, cap = k_cache.shape[:2]
    assert cap % block_n == 0
    per_row = cap // block_n
    table = torch.arange(b * per_row, device=q.device, dtype=torch.int32).view(b, per_row)
    layout = gl.NVMMASharedLayout.get_default_for([block_n, D], gl.bfloat16)
    descs = [TensorDescriptor(x.view(b * cap, H_K * D), [b * cap, H_K * D], [H_K * D, 1], [block_n, D], layout)
             for x in (k_cache, v_cache)]
    out = torch.empty_like(q)
    lse = torch.empty(b, H, 1, device=q.device, dtype=torch.float32)
    scale = D ** -0.5 * 1.4426950408889634

    def run():
        _gluon_paged_decode_kernel[(b * H_K,)](
            q, descs[0], descs[1], out, lse, out, lse, lens, table, scale, 0, H_K, H // H_K, per_row, b * per_row,
            q.stride(0), q.stride(2), out.stride(0), out.stride(2), lse.stride(0), lse.stride(1),
            0, 0, 0, 0, 0, 0, table.stride(0),
            HEAD_DIM=D, BLOCK_M=64, BLOCK_N=block_n, PAGE=block_n, NUM_BUFFERS=buffers, NUM_SPLITS=1, num_warps=4)
        return out

    return run


def flashtile_call(q, k, v, lens):
    return flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, causal=True)


def cudnn_call(q_sdpa, k_head, v_head):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q_sdpa, k_head, v_head, enable_gqa=True)


def timed(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return round(triton.testing.do_bench_cudagraph(fn, rep=100) * 1000, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="32,8192;32,65536")
    args = ap.parse_args()
    rows = []
    for item in args.rows.split(";"):
        b, s = (int(x) for x in item.split(","))
        q = torch.randn(b, 1, H, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, s, H_K, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        lens = torch.full((b,), s, device="cuda", dtype=torch.int32)
        k_head, v_head = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        q_sdpa = q.transpose(1, 2)

        ft = functools.partial(flashtile_call, q, k, v, lens)
        cudnn = functools.partial(cudnn_call, q_sdpa, k_head, v_head)
        ref = ft().float()
        row = {"b": b, "seqlen_k": s, "flashtile": timed(ft)}
        for block_n, buffers in RINGS:
            name = f"gluon_n{block_n}_x{buffers}"
            try:
                run = gluon_call(q, k, v, lens, block_n, buffers)
                err = (run().float() - ref).abs().max().item()
                row[name] = timed(run)
                row[name + "_max_diff"] = err
            except Exception as e:  # record why a shape failed, go on with the others
                row[name] = f"{type(e).__name__}: {str(e)[:200]}"
            print(name, row[name], row.get(name + "_max_diff"), flush=True)
        row["cudnn"] = timed(cudnn)
        row["flashtile_again"] = timed(ft)
        print(row, flush=True)
        rows.append(row)
        del ft, cudnn, k, v, k_head, v_head
        torch.cuda.empty_cache()
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%d"), "timing": "do_bench_cudagraph, us, one call per replay",
            "shape": "GQA 32/8, d 128, bf16, one query token, contiguous cache"}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
