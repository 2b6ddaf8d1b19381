"""The learnable sink's gradient in one pass over ``out`` and ``dout``.

``d loss / d sink_h = -sum over the head's rows of exp(sink_h - lse) * rowsum(dout * out)`` (ops.sink_grad
derives it). One program reduces ``BLOCK_S`` rows of one (batch, head) and writes its partial sum; the host
adds the partials in a fixed order, so the gradient is deterministic. Reading the two bf16 tensors once is
the whole cost: the PyTorch expression it replaces upcast both to fp32 and wrote the product back, several
times the traffic of the backward's own delta pass.
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["seqlen"])
def _sink_grad_kernel(OUT, DOUT, LSE, SINK, PARTIAL, seqlen, n_heads,
                      stride_ob, stride_os, stride_oh, stride_db, stride_ds, stride_dh,
                      stride_lb, stride_lh, stride_ls,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    pid_s = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    rows = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < seqlen
    ok = row_ok[:, None] & (cols < HEAD_DIM)[None, :]
    rows64 = rows.to(tl.int64)
    o = tl.load(OUT + batch.to(tl.int64) * stride_ob + head * stride_oh + rows64[:, None] * stride_os
                + cols[None, :], mask=ok, other=0.0)
    do = tl.load(DOUT + batch.to(tl.int64) * stride_db + head * stride_dh + rows64[:, None] * stride_ds
                 + cols[None, :], mask=ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    lse = tl.load(LSE + batch.to(tl.int64) * stride_lb + head * stride_lh + rows64 * stride_ls, mask=row_ok,
                  other=float("inf"))
    sink = tl.load(SINK + head).to(tl.float32)
    # a row that saw nothing has lse = +inf or out = 0: it adds 0 (tl.where keeps 0 * inf out of the sum)
    weight = tl.where(row_ok, tl.exp(sink - lse), 0.0)
    part = -tl.sum(tl.where(row_ok, weight * delta, 0.0), axis=0)
    tl.store(PARTIAL + (pid_s * tl.num_programs(2) + batch) * n_heads + head, part)
