"""Appending new keys/values to a KV cache, with the rotary embedding fused into the key write.

One program writes one new token of one batch row: all ``h_k`` heads of its key (rotated) and its
value, into a contiguous cache row (``cache_batch_idx`` picks it) or into the page that
``block_table`` maps its absolute position to. Any page size works: the page is looked up per
token. ``_rotary_rows`` is shared with the decode kernel, which rotates the queries as it loads them.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _rotary_rows(row_ptrs, offs_d, pos, row_ok, COS, SIN, stride_cos, seqlen_ro,
                 HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Load rows ``row_ptrs`` [R] (each the start of a head-dim vector) rotated at ``pos`` [R]; fp32 [R, BLOCK_D].

    Channel j < ROTARY_DIM becomes ``x[j] * cos + sign * x[partner] * sin`` with its pair partner
    (j ^ 1 interleaved, j +- ROTARY_DIM/2 otherwise) and sign -1 on the first of the pair. Channels
    past ROTARY_DIM, and positions past the table, load cos = 1 and sin = 0: they pass unchanged.
    """
    HALF: tl.constexpr = ROTARY_DIM // 2
    in_d = offs_d < HEAD_DIM
    rot = offs_d < ROTARY_DIM
    x = tl.load(row_ptrs[:, None] + offs_d[None, :], mask=row_ok[:, None] & in_d[None, :], other=0.0)
    if INTERLEAVED:
        partner = offs_d ^ 1
        idx = offs_d // 2
        first = (offs_d % 2) == 0
    else:
        partner = tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)
        idx = tl.where(offs_d < HALF, offs_d, offs_d - HALF)
        first = offs_d < HALF
    rmask = row_ok[:, None] & rot[None, :]
    xp = tl.load(row_ptrs[:, None] + partner[None, :], mask=rmask, other=0.0)
    tmask = rmask & (pos < seqlen_ro)[:, None]
    cs_off = pos.to(tl.int64)[:, None] * stride_cos + idx[None, :]
    c = tl.load(COS + cs_off, mask=tmask, other=1.0).to(tl.float32)
    s = tl.load(SIN + cs_off, mask=tmask, other=0.0).to(tl.float32)
    sign = tl.where(first, -1.0, 1.0)
    return x.to(tl.float32) * c + sign[None, :] * xp.to(tl.float32) * s


# Lengths change between calls; specialising on them would only recompile. Strides stay specialised
# so the stores can be vectorised (see kernels/attn_bwd.py).
@triton.jit(do_not_specialize=["cache_len_const", "s_new", "seqlen_ro", "capacity"])
def _kv_append_kernel(
    # pointers
    K_NEW, V_NEW, K_CACHE, V_CACHE, SEQLENS, BATCH_IDX, BLOCK_TABLE, COS, SIN,
    # sizes
    cache_len_const, s_new, num_kv_heads, page_size, capacity, seqlen_ro,
    # strides
    stride_knb, stride_knt, stride_knh,
    stride_vnb, stride_vnt, stride_vnh,
    stride_kcb, stride_kcn, stride_kch,
    stride_vcb, stride_vcn, stride_vch,
    stride_bt_b, stride_cos,
    # constexprs
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SEQLENS: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr, PAGED: tl.constexpr, ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    # USE_PDL: launched as a programmatic dependent of the kernel before it (a layer's last decode kernel, in a
    # step of layers), it waits for that kernel's end and writes before reading anything, then lets the decode
    # kernel after it start launching (that one waits for this grid's end before its first read)
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    # flat grid (axis 0, up to 2^31 - 1 programs; axis 1 would cap the batch at 65535): pid = b * s_new + t
    pid = tl.program_id(0)
    t = pid % s_new
    b = pid // s_new
    if HAS_SEQLENS:
        cache_len = tl.load(SEQLENS + b)
    else:
        cache_len = cache_len_const
    pos = cache_len + t  # absolute cache position of this new token
    if pos < capacity:  # a token past the cache's end is dropped, never written out of bounds
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        h_ok = offs_h < num_kv_heads
        mask = h_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
        b64 = b.to(tl.int64)
        if PAGED:
            page = tl.load(BLOCK_TABLE + b64 * stride_bt_b + pos // page_size).to(tl.int64)
            k_dst = K_CACHE + page * stride_kcb + (pos % page_size) * stride_kcn
            v_dst = V_CACHE + page * stride_vcb + (pos % page_size) * stride_vcn
        else:
            row = b64
            if HAS_BATCH_IDX:
                row = tl.load(BATCH_IDX + b).to(tl.int64)
            k_dst = K_CACHE + row * stride_kcb + pos.to(tl.int64) * stride_kcn
            v_dst = V_CACHE + row * stride_vcb + pos.to(tl.int64) * stride_vcn
        k_src = K_NEW + b64 * stride_knb + t.to(tl.int64) * stride_knt + offs_h * stride_knh
        if ROTARY_DIM > 0:
            k = _rotary_rows(k_src, offs_d, pos + offs_h * 0, h_ok, COS, SIN, stride_cos, seqlen_ro,
                             HEAD_DIM, ROTARY_DIM, INTERLEAVED)
        else:
            k = tl.load(k_src[:, None] + offs_d[None, :], mask=mask, other=0.0)
        tl.store(k_dst + offs_h[:, None] * stride_kch + offs_d[None, :], k.to(K_CACHE.dtype.element_ty), mask=mask)
        v = tl.load(V_NEW + b64 * stride_vnb + t.to(tl.int64) * stride_vnt + offs_h[:, None] * stride_vnh
                    + offs_d[None, :],
                    mask=mask, other=0.0)
        tl.store(v_dst + offs_h[:, None] * stride_vch + offs_d[None, :], v.to(V_CACHE.dtype.element_ty), mask=mask)
