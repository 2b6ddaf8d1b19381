"""``decode``: one-token attention over a KV cache, flashtile beside SDPA and the HBM floor.

Each row is (batch b, cache length seqlen_k) at GQA 32 query / 8 kv heads, d = 128, bf16 (the
decode table of BASELINES.md). flashtile runs ``flash_attn_with_kvcache`` on a contiguous cache and
on paged caches (pages scattered in a random order, as an allocator leaves them) of each
``--pages`` size; the peers are torch SDPA's flash and cuDNN backends on (b, h, s, d) copies.
``floor`` is the time to read the cache once at the device-to-device copy bandwidth measured in the
same process (a copy also writes, so a kernel that only reads can come in a little under it).
Times are microseconds (median).

``--layers N`` times N calls per measurement, each on its own cache (N decoder layers of one model
step; every implementation gets the same N), and reports the time per call. Paged layers share one
block table (each layer its own page pool, the same page ids), as serving engines keep one table
per sequence for all layers. With ``--cuda-graph``
this is how a serving engine runs decode: one graph holding every layer, so the host's graph launch
(several microseconds on a slow CPU) is paid once per step, not once per attention call. The caches
are distinct and do_bench clears the L2 cache before each measurement, so every call reads its
cache from HBM. N shrinks for a row whose N caches would pass ``LAYER_BYTES_BUDGET``.

``--mla`` times multi-head latent attention (DeepSeek's decode in absorbed form: ``qv``) instead: one latent kv
head of d = 64 rope dims (k_cache) and dv = 512 latent dims (v_cache) for h = 128 query heads, b = 32 and 64 at
4k-32k keys, contiguous and in 64-token pages. No SDPA backend takes ``qv``, so flashtile runs alone; ``floor`` is
the latent cache's bytes at the copy bandwidth (the issue's bar: 1.3x of it) and ``compute`` the call's tensor
FLOPs (``2 * b * h * seqlen_k * (d + 2 dv)``: the scores' d + dv and the output's dv multiply-adds a key) at a
bf16 matmul's rate measured in the same process. At h = 128 the two floors are close: the call is about as bound by
the tensor cores as by HBM. Outputs are checked against a float64 computation on the first two batch rows.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flashtile.bench import paths, report
from flashtile.bench.timing import bench, bench_graph

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_BATCHES = (1, 8, 32)
DEFAULT_SEQLENS = (8192, 16384, 32768, 65536, 131072)
DEFAULT_PAGES = (16, 256)
PEER_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION"}
# --quick: plumbing on CPU in a second or two
QUICK = dict(batches=(1, 2), seqlens=(64, 200), heads=4, kv_heads=2, d=32, pages=(16,))
# max |out - SDPA| relative to max |SDPA| above which a row is flagged (a few ulps of bf16)
REL_TOLERANCE = 0.02
# --layers: the N caches of one row stay under this many bytes, N shrinking to fit (the big rows need
# no layering: their call time dwarfs a launch)
LAYER_BYTES_BUDGET = 16 << 30
# --mla: DeepSeek's latent head (V2 / V3 / R1), and the rows
MLA = dict(batches=(32, 64), seqlens=(4096, 8192, 16384, 32768), heads=128, kv_heads=1, d=64, dv=512, pages=(64,))
MLA_QUICK = dict(batches=(1, 2), seqlens=(64, 200), heads=4, kv_heads=1, d=16, dv=64, pages=(16,))
MLA_FLOOR_BAR = 1.3  # the bar: within 1.3x of the latent cache's HBM floor


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("shapes")
    g.add_argument("--batch", type=int, nargs="+", metavar="B", help=f"batch sizes (default {DEFAULT_BATCHES})")
    g.add_argument("--seqlens", type=int, nargs="+", metavar="S",
                   help=f"cache lengths seqlen_k (default {DEFAULT_SEQLENS})")
    g.add_argument("--heads", type=int, default=None, help="query heads (default 32)")
    g.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default 8)")
    g.add_argument("--d", type=int, default=None, help="head dim (default 128; --mla: 64)")
    g.add_argument("--dv", type=int, default=None, help="--mla: the latent (v_cache) head dim (default 512)")
    g.add_argument("--mla", action="store_true",
                   help="multi-head latent attention with qv: h=128 query heads on one latent kv head, d=64, dv=512, "
                        "b 32 and 64, 4k-32k keys, 64-token pages (explicit options win); flashtile alone")
    g.add_argument("--pages", type=int, nargs="*", metavar="P",
                   help=f"page sizes of the paged variants (default {DEFAULT_PAGES}; none: contiguous only)")
    g.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    g.add_argument("--quick", action="store_true", help="tiny smoke-test shapes (explicit options win)")
    r = p.add_argument_group("run")
    r.add_argument("--peers", nargs="*", choices=tuple(PEER_BACKENDS), default=None,
                   metavar="PEER", help="SDPA backends beside flashtile: flash cudnn (default both; none with --mla)")
    r.add_argument("--num-splits", type=int, default=0, help="flashtile's num_splits (0 = heuristic)")
    r.add_argument("--new-tokens", type=int, default=0, metavar="N",
                   help="flashtile's calls also append N keys a row, as a serving step does (the cache's last N, "
                        "written back in place, so the keys attended equal the peers'; default 0)")
    r.add_argument("--head-major", action="store_true",
                   help="also time flashtile (as flashtile-hm, in the rounds) on the peers' head-major caches: "
                        "(b, h_k, s, d) storage passed as its (b, s, h_k, d) view, so each kv head's keys are "
                        "one contiguous stream as the peers read them")
    r.add_argument("--rounds", type=_positive_int, default=1, metavar="R",
                   help="time the peers and flashtile (contiguous) R times each, alternating which goes first, "
                        "and report each one's median (default 1: peers first, then flashtile, once)")
    r.add_argument("--cuda-graph", action="store_true",
                   help="time a CUDA-graph replay of each call (removes Python launch overhead)")
    r.add_argument("--layers", type=int, default=1, metavar="N",
                   help="time N calls on N distinct caches per measurement and report the time per call "
                        "(a model step's N layers; with --cuda-graph, one graph launch per N calls)")
    r.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available")
    r.add_argument("--plot", metavar="PATH.png", help="also draw time over the HBM floor per batch size")
    r.add_argument("--warmup", type=float, default=25, metavar="MS")
    r.add_argument("--rep", "--reps", dest="rep", type=float, default=100, metavar="MS")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--no-check", dest="check", action="store_false", help="skip comparing outputs with SDPA")
    r.add_argument("--fail-on-mismatch", action="store_true")
    o = p.add_argument_group("output")
    o.add_argument("--out", metavar="PATH.json",
                   help="JSON results (default: decode_<gpu>_<date>.json under ~/.cache/flashtile/bench, "
                        "or $XDG_CACHE_HOME/flashtile/bench; never the working directory)")


def _time(fn, device: str, args) -> float:
    """Median microseconds of ``fn()``, optionally as a CUDA-graph replay."""
    if args.cuda_graph and torch.device(device).type == "cuda":
        return bench_graph(fn, device, args.warmup, args.rep) * 1e3
    return bench(fn, device, args.warmup, args.rep) * 1e3


def _page_order(k_cache: torch.Tensor, page: int, gen: torch.Generator) -> torch.Tensor:
    """A random placement of the cache's pages in the pool (int64, (b * pages per row,)), as an
    allocator leaves them."""
    b, s = k_cache.shape[:2]
    return torch.randperm(b * -(-s // page), generator=gen, device="cpu").to(k_cache.device)


def _paged(k_cache: torch.Tensor, v_cache: torch.Tensor, page: int, order: torch.Tensor):
    """The same cache in pages of ``page`` tokens, page j of the flattened rows stored at ``order[j]``;
    returns the two pools and the block table."""
    b, s, h_k, d = k_cache.shape
    dv = v_cache.shape[-1]
    per_row = -(-s // page)
    n = b * per_row
    table = order.view(b, per_row).to(torch.int32)
    pages_k = k_cache.new_zeros(n, page, h_k, d)
    pages_v = v_cache.new_zeros(n, page, h_k, dv)
    pad = per_row * page - s
    src_k = torch.nn.functional.pad(k_cache, (0, 0, 0, 0, 0, pad)).view(n, page, h_k, d)
    src_v = torch.nn.functional.pad(v_cache, (0, 0, 0, 0, 0, pad)).view(n, page, h_k, dv)
    pages_k[order] = src_k
    pages_v[order] = src_v
    return pages_k, pages_v, table


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"[:400]


def _flashtile_calls(q, caches, lens, page, num_splits, gen, new_tokens=0, qv=None):
    """One ``flash_attn_with_kvcache`` call per layer's cache: contiguous (``page`` None) or paged,
    every layer's pool laid out in one page order (so the layers share one block table, as a model's
    do; its values are equal, and the first layer's tensor serves them all). With ``new_tokens`` N each
    call appends N keys, as a serving step does: the cache's own last N keys and values, written back
    into their slots (cache_seqlens = lens - N), so every call attends over the same keys as the peers.
    ``qv``: MLA calls (--mla)."""
    from flashtile import flash_attn_with_kvcache

    calls = []
    extra = {} if qv is None else {"qv": qv}
    order = None if page is None else _page_order(caches[0][0], page, gen)
    table = None
    sk = caches[0][0].shape[1]
    ft_lens = lens - new_tokens if new_tokens else lens  # once here: inside a call it would be one more launch
    for kc, vc in caches:
        k_new = kc[:, sk - new_tokens:].clone() if new_tokens else None
        v_new = vc[:, sk - new_tokens:].clone() if new_tokens else None
        if page is not None:
            kc, vc, layer_table = _paged(kc, vc, page, order)
            table = layer_table if table is None else table  # the first layer's serves them all
        calls.append(lambda kc=kc, vc=vc, table=table, k_new=k_new, v_new=v_new: flash_attn_with_kvcache(
            q, kc, vc, k=k_new, v=v_new, cache_seqlens=ft_lens, block_table=table, num_splits=num_splits, **extra))
    return calls


def _time_in_rounds(timers: list, rounds: int, row: dict) -> None:
    """Time every (name, timer) ``rounds`` times, round r starting at implementation r (mod their
    number): an order effect (heat, clocks, memory state) then lands on each in turn instead of always
    on the last. Each one's median goes to ``row["us"]``; with rounds > 1 its samples to
    ``row["rounds_us"]``. One that fails is recorded in ``row["errors"]`` and dropped, samples and all.
    A function of its own so that no local outlives it holding a timer (and the tensors it times)."""
    times: dict = {name: [] for name, _ in timers}
    for r in range(rounds):
        start = r % len(timers) if timers else 0
        for name, timer in timers[start:] + timers[:start]:
            if name not in times:
                continue
            try:
                times[name].append(timer())
            except Exception as e:
                row["errors"][name] = _describe(e)
                times.pop(name)
                if isinstance(e, torch.cuda.OutOfMemoryError):
                    torch.cuda.empty_cache()
    for name, _ in timers:
        ts = times.get(name)
        row["us"][name] = statistics.median(ts) if ts else None
        if rounds > 1 and ts:
            row.setdefault("rounds_us", {})[name] = ts


def _positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def run_row(b: int, sk: int, h: int, h_k: int, d: int, args, device: str, copy_tb_s: float | None) -> dict:
    dtype = DTYPES[args.dtype]
    kv_bytes = 2 * b * sk * h_k * d * torch.empty((), dtype=dtype).element_size()
    row = {"mode": "decode", "b": b, "seqlen_k": sk, "h": h, "h_k": h_k, "d": d, "dtype": args.dtype,
           "kv_bytes": kv_bytes, "us": {}, "ratios": {}, "errors": {}, "max_rel_err": None, "mismatch": False,
           "floor_us": kv_bytes / (copy_tb_s * 1e12) * 1e6 if copy_tb_s else None}
    seed = args.seed + b * 1000003 + sk
    gen = torch.Generator(device="cpu").manual_seed(seed)  # page orders
    # the data is drawn where it lives: CPU draws cost ~3.5 s a GB, most of a long GPU run's time
    data_gen = torch.Generator(device=device).manual_seed(seed)
    try:
        q, k_cache, v_cache = (torch.randn(*shape, generator=data_gen, device=device, dtype=dtype)
                               for shape in ((b, 1, h, d), (b, sk, h_k, d), (b, sk, h_k, d)))
    except torch.cuda.OutOfMemoryError as e:
        row["errors"]["all"] = _describe(e)
        return row
    lens = torch.full((b,), sk, dtype=torch.int32, device=device)
    ref = None
    qt = q.transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def check(name, out):
        if ref is None or out is None:
            return
        err = (out.float() - ref.float()).abs().max().item() / max(ref.float().abs().max().item(), 1e-6)
        row["max_rel_err"] = max(row["max_rel_err"] or 0.0, err)
        if not err <= REL_TOLERANCE:
            row["mismatch"] = True
            row.setdefault("mismatched", []).append(name)

    layers = max(1, min(args.layers, LAYER_BYTES_BUDGET // max(kv_bytes, 1)))
    row["layers"] = layers
    # the other layers' caches: copies of the first (their values do not matter for timing)
    caches = [(k_cache, v_cache)] + [(k_cache.clone(), v_cache.clone()) for _ in range(layers - 1)]

    def per_call_us(calls):
        return _time(lambda: [c() for c in calls], device, args) / len(calls)

    # peers first: their (b, h, s, d) copies are freed before the paged caches are built
    peer_caches = [(kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()) for kc, vc in caches]
    if args.check:
        try:
            ref = sdpa(qt, *peer_caches[0], enable_gqa=True).transpose(1, 2)
        except Exception as e:
            row["check_error"] = "SDPA reference failed: " + _describe(e)
    # every timed implementation as (name, zero-argument function timing one measurement); the peers'
    # calls run under their SDPA backend
    timers = []
    for name in dict.fromkeys(args.peers):
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            if name == "cudnn" and torch.device(device).type != "cuda":
                raise RuntimeError("SDPA's cuDNN backend needs a CUDA device")
            backend = getattr(SDPBackend, PEER_BACKENDS[name])
            peer_calls = [lambda kt=kt, vt=vt: sdpa(qt, kt, vt, enable_gqa=True) for kt, vt in peer_caches]
            with sdpa_kernel(backend):
                peer_calls[0]()

            def timer(calls=peer_calls, backend=backend):
                with sdpa_kernel(backend):
                    return per_call_us(calls)

            timers.append((name, timer))
        except Exception as e:
            row["us"][name] = None
            row["errors"][name] = _describe(e)
    variants = [("flashtile", caches)]
    if args.head_major:
        variants.append(("flashtile-hm", [(kt.transpose(1, 2), vt.transpose(1, 2)) for kt, vt in peer_caches]))
    for name, layer_caches in variants:
        try:
            calls = _flashtile_calls(q, layer_caches, lens, None, args.num_splits, gen, args.new_tokens)
            check(name, calls[0]())
            timers.append((name, lambda calls=calls: per_call_us(calls)))
        except Exception as e:
            row["us"][name] = None
            row["errors"][name] = _describe(e)
            if isinstance(e, torch.cuda.OutOfMemoryError):
                torch.cuda.empty_cache()
    _time_in_rounds(timers, args.rounds, row)
    # free the peers' copies before the paged caches are built (the closures hold them too)
    timers = timer = peer_calls = peer_caches = calls = variants = layer_caches = None

    for page in args.pages or ():
        name = f"flashtile-p{page}"
        try:
            calls = _flashtile_calls(q, caches, lens, page, args.num_splits, gen, args.new_tokens)
            check(name, calls[0]())
            row["us"][name] = per_call_us(calls)
        except Exception as e:
            row["us"][name] = None
            row["errors"][name] = _describe(e)
            if isinstance(e, torch.cuda.OutOfMemoryError):
                torch.cuda.empty_cache()
        calls = None
    caches = None
    ft = row["us"].get("flashtile")
    for name, us in row["us"].items():
        if name != "flashtile":
            row["ratios"][name] = us / ft if us and ft else None
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return row


def _mla_reference(q, qv, k_cache, v_cache, rows: int) -> torch.Tensor:
    """The first ``rows`` batch rows' output of the MLA call, in float64 on the device: per row and kv head, one
    (tokens x heads of the group, keys) score matrix, never the cache repeated for every query head."""
    b, sq, h, d = q.shape
    h_k, dv = k_cache.shape[2], v_cache.shape[-1]
    g = h // h_k
    scale = (d + dv) ** -0.5
    out = torch.empty(rows, sq, h, dv, device=q.device, dtype=torch.float64)
    for i in range(rows):
        for kh in range(h_k):
            heads = slice(kh * g, (kh + 1) * g)
            k, v = k_cache[i, :, kh].double(), v_cache[i, :, kh].double()
            s = (q[i, :, heads].double() @ k.T + qv[i, :, heads].double() @ v.T) * scale  # (sq, g, keys)
            out[i, :, heads] = torch.softmax(s, dim=-1) @ v
    return out


def run_mla_row(b: int, sk: int, h: int, h_k: int, d: int, dv: int, args, device: str, copy_tb_s: float | None,
                tflops: float | None) -> dict:
    """One --mla row: flashtile on the contiguous latent cache and on each page size, against both floors."""
    dtype = DTYPES[args.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    kv_bytes = b * sk * h_k * (d + dv) * itemsize
    flops = 2.0 * b * h * sk * (d + 2 * dv)
    row = {"mode": "decode-mla", "b": b, "seqlen_k": sk, "h": h, "h_k": h_k, "d": d, "dv": dv, "dtype": args.dtype,
           "kv_bytes": kv_bytes, "flops": flops, "us": {}, "ratios": {}, "x_floor": {}, "tb_s": {}, "errors": {},
           "max_rel_err": None, "mismatch": False,
           "floor_us": kv_bytes / (copy_tb_s * 1e12) * 1e6 if copy_tb_s else None,
           "compute_floor_us": flops / (tflops * 1e12) * 1e6 if tflops else None}
    seed = args.seed + b * 1000003 + sk
    gen = torch.Generator(device="cpu").manual_seed(seed)  # page orders
    data_gen = torch.Generator(device=device).manual_seed(seed)
    try:
        q, qv, k_cache, v_cache = (torch.randn(*shape, generator=data_gen, device=device, dtype=dtype)
                                   for shape in ((b, 1, h, d), (b, 1, h, dv), (b, sk, h_k, d), (b, sk, h_k, dv)))
    except torch.cuda.OutOfMemoryError as e:
        row["errors"]["all"] = _describe(e)
        return row
    lens = torch.full((b,), sk, dtype=torch.int32, device=device)
    ref_rows = min(b, 2)
    ref = _mla_reference(q, qv, k_cache, v_cache, ref_rows) if args.check else None
    layers = max(1, min(args.layers, LAYER_BYTES_BUDGET // max(kv_bytes, 1)))
    row["layers"] = layers
    caches = [(k_cache, v_cache)] + [(k_cache.clone(), v_cache.clone()) for _ in range(layers - 1)]
    for page in [None, *(args.pages or ())]:
        name = "flashtile" if page is None else f"flashtile-p{page}"
        try:
            calls = _flashtile_calls(q, caches, lens, page, args.num_splits, gen, args.new_tokens, qv=qv)
            out = calls[0]()
            if ref is not None:
                err = ((out[:ref_rows].double() - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()
                row["max_rel_err"] = max(row["max_rel_err"] or 0.0, err)
                if not err <= REL_TOLERANCE:
                    row["mismatch"] = True
                    row.setdefault("mismatched", []).append(name)
            us = _time(lambda calls=calls: [c() for c in calls], device, args) / len(calls)
            row["us"][name] = us
            row["x_floor"][name] = us / row["floor_us"] if row["floor_us"] else None
            row["tb_s"][name] = kv_bytes / (us * 1e-6) / 1e12
        except Exception as e:
            row["us"][name] = None
            row["errors"][name] = _describe(e)
            if isinstance(e, torch.cuda.OutOfMemoryError):
                torch.cuda.empty_cache()
        calls = None
    caches = None
    ft = row["us"].get("flashtile")
    for name, us in row["us"].items():
        if name != "flashtile":
            row["ratios"][name] = us / ft if us and ft else None
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return row


def format_mla_table(rows: list[dict], names: list[str], meta: dict) -> str:
    head = ["b", "seqlen_k", *names, "floor", "compute", *[f"{n}/floor" for n in names],
            *[f"{n} TB/s" for n in names], "rel_err", "flag"]
    body = []
    for r in rows:
        cells = [str(r["b"]), str(r["seqlen_k"])] + [_fmt(r["us"].get(n)) for n in names]
        cells += [_fmt(r["floor_us"]), _fmt(r["compute_floor_us"])]
        cells += [_fmt(r["x_floor"].get(n), ".2f") for n in names] + [_fmt(r["tb_s"].get(n), ".2f") for n in names]
        over = [n for n in names if (r["x_floor"].get(n) or 0) > MLA_FLOOR_BAR]
        flags = (["MISMATCH"] if r["mismatch"] else []) + ([f">{MLA_FLOOR_BAR}x floor"] if over else [])
        body.append(cells + [_fmt(r["max_rel_err"], ".1e"), " ".join(flags)])
    widths = [max(len(h), *(len(c[j]) for c in body)) for j, h in enumerate(head)] if body else []
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths)).rstrip()
    first = rows[0] if rows else {}
    where = meta.get("gpu") or f"CPU ({meta.get('cpu')})"
    out = [f"decode MLA (qv)  microseconds  {first.get('dtype')}  h={first.get('h')} h_k={first.get('h_k')} "
           f"d={first.get('d')} dv={first.get('dv')}  {where}   (floor: the latent cache at copy bandwidth; compute: "
           f"its FLOPs at matmul rate; the bar: {MLA_FLOOR_BAR}x floor)", line(head), line(["-" * w for w in widths])]
    out += [line(c) for c in body]
    notes = sorted({f"  {n}: {e}" for r in rows for n, e in r["errors"].items()})
    if notes:
        out += ["", "not measured:", *notes]
    return "\n".join(out)


def _fmt(x, spec=".1f") -> str:
    return report.MISSING if x is None else format(x, spec)


def format_table(rows: list[dict], names: list[str], meta: dict) -> str:
    head = ["b", "seqlen_k", *names, "floor", *[f"{n}/ft" for n in names if n != "flashtile"], "rel_err", "flag"]
    body = []
    for r in rows:
        cells = [str(r["b"]), str(r["seqlen_k"])] + [_fmt(r["us"].get(n)) for n in names] + [_fmt(r["floor_us"])]
        cells += [_fmt(r["ratios"].get(n), ".2f") for n in names if n != "flashtile"]
        cells += [_fmt(r["max_rel_err"], ".1e"), "MISMATCH" if r["mismatch"] else ""]
        body.append(cells)
    widths = [max(len(h), *(len(c[j]) for c in body)) for j, h in enumerate(head)] if body else []
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths)).rstrip()
    first = rows[0] if rows else {}
    where = meta.get("gpu") or f"CPU ({meta.get('cpu')})"
    out = [f"decode  microseconds  {first.get('dtype')}  h={first.get('h')} h_k={first.get('h_k')} "
           f"d={first.get('d')}  {where}   (peer/ft > 1: flashtile faster)", line(head),
           line(["-" * w for w in widths])]
    out += [line(c) for c in body]
    notes = sorted({f"  {n}: {e}" for r in rows for n, e in r["errors"].items()})
    if notes:
        out += ["", "not measured:", *notes]
    return "\n".join(out)


def run(args) -> int:
    device = report.resolve_device(args.device)
    if device is None:
        return 2
    if args.mla:
        q = MLA_QUICK if args.quick else MLA
        if args.peers:
            report.eprint("error: --mla times flashtile alone (no SDPA backend takes qv); drop --peers")
            return 2
        args.peers = []
    else:
        q = QUICK if args.quick else {}
        if args.peers is None:
            args.peers = list(PEER_BACKENDS)
    batches = args.batch or q.get("batches", DEFAULT_BATCHES)
    seqlens = args.seqlens or q.get("seqlens", DEFAULT_SEQLENS)
    h = args.heads or q.get("heads", 32)
    h_k = args.kv_heads or q.get("kv_heads", 8)
    d = args.d or q.get("d", 128)
    dv = args.dv or q.get("dv", d)
    if args.pages is None:
        args.pages = list(q.get("pages", DEFAULT_PAGES))
    if not 0 <= args.new_tokens <= min(seqlens):
        report.eprint(f"error: --new-tokens must be between 0 and the shortest --seqlens ({min(seqlens)}), "
                      f"got {args.new_tokens}")
        return 2
    meta = report.collect_meta(args.argv if hasattr(args, "argv") else [], device)
    meta.update(mode="decode-mla" if args.mla else "decode", dtype=args.dtype, heads=h, kv_heads=h_k, d=d,
                **({"dv": dv} if args.mla else {}), pages=list(args.pages),
                num_splits=args.num_splits, cuda_graph=bool(args.cuda_graph and device == "cuda"),
                layers=args.layers, new_tokens=args.new_tokens, head_major=bool(args.head_major))
    meta["timing"] = {"warmup_ms": args.warmup, "rep_ms": args.rep, "stat": "median", "unit": "us"}
    from flashtile.bench.ceilings import copy_tb_s

    try:  # the floor's bandwidth, read in this process (a smaller buffer on CPU keeps smoke runs fast)
        nbytes = (1 << 30) if device == "cuda" else (1 << 24)
        meta["copy_tb_s"] = copy_tb_s(device, nbytes, args.warmup, args.rep)
    except Exception as e:
        meta["copy_tb_s"] = None
        report.eprint(f"note: copy bandwidth not measured ({_describe(e)}); no floor column")
    if args.mla:
        from flashtile.bench.ceilings import matmul_tflops

        try:  # the compute floor's rate: a bf16 matmul (a small one on CPU keeps smoke runs fast)
            meta["matmul_tflops"] = matmul_tflops(device, 8192 if device == "cuda" else 256, args.warmup, args.rep)
        except Exception as e:
            meta["matmul_tflops"] = None
            report.eprint(f"note: matmul rate not measured ({_describe(e)}); no compute column")
    names = (["flashtile"] + ["flashtile-hm"] * bool(args.head_major) + [f"flashtile-p{p}" for p in args.pages]
             + list(dict.fromkeys(args.peers)))
    out_path = args.out or paths.default_out_path("decode", meta)
    rows = []
    shapes = [(b, s) for b in batches for s in seqlens]
    t_start = time.perf_counter()
    for i, (b, s) in enumerate(shapes, 1):
        t0 = time.perf_counter()
        if args.mla:
            row = run_mla_row(b, s, h, h_k, d, dv, args, device, meta["copy_tb_s"], meta["matmul_tflops"])
        else:
            row = run_row(b, s, h, h_k, d, args, device, meta["copy_tb_s"])
        rows.append(row)
        parts = " | ".join(f"{n} {_fmt(row['us'].get(n))}" for n in names)
        report.eprint(f"[{i}/{len(shapes)}] {meta['mode']} b={b} seqlen_k={s}: {parts} us  "
                      f"floor {_fmt(row['floor_us'])}{'  MISMATCH' if row['mismatch'] else ''}  "
                      f"({time.perf_counter() - t0:.1f}s)")
        report.write_json(out_path, meta, rows)
    meta["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    meta["device_props"] = _device_props(device)  # what the decode routes were chosen on
    report.write_json(out_path, meta, rows)
    print(format_mla_table(rows, names, meta) if args.mla else format_table(rows, names, meta))
    print(f"\nwrote {out_path}")
    if args.plot:
        from flashtile.bench.plot import plot_decode

        try:
            plot_decode({"meta": meta, "rows": rows}, args.plot)
            print(f"wrote {args.plot}")
        except ImportError as e:  # the numbers are already saved; a plot can be made later
            report.eprint(f"note: no plot ({e}); later: python -m flashtile.bench plot {out_path} {args.plot}")
    mismatches = sum(r["mismatch"] for r in rows)
    if mismatches:
        report.eprint(f"WARNING: {mismatches} row(s) where flashtile disagrees with SDPA (MISMATCH)")
    return 1 if mismatches and args.fail_on_mismatch else 0


def _device_props(device: str) -> dict | None:
    """The device properties the decode routes depend on (backends/triton/decode/route.py), for the results' meta."""
    try:
        from flashtile.backends.triton.decode.route import device_props
    except ImportError:  # no triton: the CPU path only
        return None
    import dataclasses

    return dataclasses.asdict(device_props(torch.device(device)))
