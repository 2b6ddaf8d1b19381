"""Does cuDNN's warp shape close its lead at b = 32? (H200 probe, session 17)

Usage: PYTHONPATH=src python scripts/probe_decode_gluon_warp_keys.py --out probe.json [--rows "32,8192;32,65536"]

cuDNN's b = 32 decode kernel has 16 query rows and 4 warps along the keys of 128-key tiles. Nsight Compute
(session 17) has it moving the same bytes as ours at 1% higher DRAM throughput. The kernel in
kernels/gluon_decode_warp_keys.py gives each warp a quarter of every tile with its own online softmax (rank-3
`mma.sync` layouts, warps on the first dimension), merged once after the loop, and rings of K / V slots filled
by 16-byte cp.async, each warp copying its own keys.

Times single-call CUDA-graph replays (triton.testing.do_bench_cudagraph) of flashtile's default, each ring
shape (BLOCK_N, NUM_BUFFERS; both fit two programs an SM), SDPA cuDNN on head-major copies (as `bench decode`
gives it) and flashtile again; checks each Gluon output against flashtile's, also on ragged rows. GQA 32 / 8,
d = 128, bf16.
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

RINGS = ((64, 2), (64, 3))  # 64 and 96 KB of shared memory: two programs an SM
H, H_K, D = 32, 8, 128


def gluon_call(q, k_cache, v_cache, lens, block_n: int, buffers: int):
    """The Gluon warps-along-keys kernel on the contiguous cache, unsplit, one program per (batch row, kv head)."""
    from flashtile.kernels.gluon_decode_warp_keys import _gluon_decode_warp_keys_kernel

    b = k_cache.shape[0]
    out = torch.empty_like(q)
    scale = D ** -0.5 * 1.4426950408889634

    def run():
        _gluon_decode_warp_keys_kernel[(b * H_K,)](
            q, k_cache, v_cache, out, lens, scale, H_K, H // H_K, q.stride(0), q.stride(2), k_cache.stride(0),
            k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            out.stride(0), out.stride(2), HEAD_DIM=D, BLOCK_N=block_n, NUM_BUFFERS=buffers, num_warps=4)
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
    ap.add_argument("--rounds", type=int, default=1, help="timing rounds after the checks, implementations alternated")
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
        # ragged rows (lengths off the tile grid, one of 1 key): the masks and the zero-filled copies
        ragged = torch.randint(1, s, (b,), device="cuda", dtype=torch.int32)
        ragged[0] = 1
        ref_r = flashtile_call(q, k, v, ragged).float()
        for block_n, buffers in RINGS:
            name = f"gluon_n{block_n}_x{buffers}"
            if isinstance(row[name], float):
                row[name + "_ragged_max_diff"] = (gluon_call(q, k, v, ragged, block_n, buffers)().float()
                                                  - ref_r).abs().max().item()
                print(name, "ragged", row[name + "_ragged_max_diff"], flush=True)
        row["cudnn"] = timed(cudnn)
        row["flashtile_again"] = timed(ft)
        # more rounds, every implementation once a round in the same order (lists of us)
        impls = {"flashtile": ft, "cudnn": cudnn}
        impls.update({f"gluon_n{bn}_x{nb}": gluon_call(q, k, v, lens, bn, nb) for bn, nb in RINGS
                      if isinstance(row[f"gluon_n{bn}_x{nb}"], float)})
        row["rounds"] = {name: [] for name in impls}
        for _ in range(args.rounds - 1):
            for name, fn in impls.items():
                row["rounds"][name].append(timed(fn))
        print(row, flush=True)
        rows.append(row)
        del ft, cudnn, k, v, k_head, v_head
        torch.cuda.empty_cache()
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%d"), "timing": "do_bench_cudagraph, us, one call per replay",
            "shape": "GQA 32/8, d 128, bf16, one query token, contiguous cache",
            "kernel": "kernels/gluon_decode_warp_keys.py"}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
