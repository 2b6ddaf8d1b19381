"""Context parallelism with flashtile: one sequence split across ranks, checked against one process.

    torchrun --nproc-per-node 2 examples/context_parallel.py          # CPU (gloo) or GPUs (NCCL)

Every rank makes the same full batch (same seed), keeps its zigzag shard, runs zigzag ring attention
forward and backward on it, and compares its shard of the output and of dq with flash_attn_func on the
whole sequence. Rank 0 prints the largest differences.
"""

import gc
import os

import torch
import torch.distributed as dist

import flashtile.distributed as cp
from flashtile import flash_attn_func


def main():
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)

    torch.manual_seed(0)  # the same full batch on every rank
    b, s, h, h_kv, d = 1, 256 * world, 4, 2, 32
    q, k, v = (torch.randn(b, s, n, d, device=device, dtype=dtype) for n in (h, h_kv, h_kv))
    dout = torch.randn(b, s, h, d, device=device, dtype=dtype)

    # this rank's shard: chunks rank and 2*world-1-rank of the sequence cut into 2*world
    q_local, k_local, v_local = (cp.shard(x, world, rank, "zigzag").requires_grad_() for x in (q, k, v))
    out_local = cp.zigzag_ring_flash_attn_func(q_local, k_local, v_local, causal=True)
    out_local.backward(cp.shard(dout, world, rank, "zigzag"))

    # the same attention in one process, on the whole sequence
    q_full = q.clone().requires_grad_()
    out_full = flash_attn_func(q_full, k, v, causal=True)
    out_full.backward(dout)

    err_out = (out_local - cp.shard(out_full, world, rank, "zigzag")).abs().max()
    err_dq = (q_local.grad - cp.shard(q_full.grad, world, rank, "zigzag")).abs().max()
    errs = torch.stack([err_out, err_dq]).float()
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"{world} ranks, {s} tokens: max |out - single| = {errs[0]:.2e}, max |dq - single| = {errs[1]:.2e}")
    dist.barrier()  # no rank tears its process group down while another still talks to it
    # what autograd's graph still holds (saved tensors, gloo's finished works) is freed now, while the
    # interpreter is whole: freed during its shutdown, a gloo work can abort the process (pytorch#179291)
    del out_local, out_full, q_local, k_local, v_local, q_full
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
