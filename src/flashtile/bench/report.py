"""Run metadata, progress lines, the final table and the JSON file."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import shlex
import socket
import subprocess
import sys

import torch

from flashtile import config

MISSING = "-"


def _versions() -> dict:
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception:  # a missing Triton only matters to the timings, which fall back
        out["triton"] = None
    try:
        out["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception:
        out["cudnn"] = None
    try:
        import flashtile

        out["flashtile"] = getattr(flashtile, "__version__", None)
    except Exception:
        out["flashtile"] = None
    return out


GPU_LIMIT_FIELDS = ("serial", "clocks.max.sm", "clocks.max.mem", "power.limit", "power.max_limit")


def gpu_limits(uuid: str | None) -> dict | None:
    """The board's serial, maximum SM / memory clocks (MHz) and power limits (W) from nvidia-smi, for the GPU of
    this UUID (nvidia-smi's own indices follow PCI order and ignore CUDA_VISIBLE_DEVICES); None without a UUID or
    when nvidia-smi is missing or fails (the results file then says nothing rather than something wrong)."""
    if not uuid:
        return None
    try:
        cmd = ["nvidia-smi", f"--query-gpu={','.join(GPU_LIMIT_FIELDS)}", "--format=csv,noheader,nounits",
               "-i", uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    values = [v.strip() for v in res.stdout.strip().split(",")]
    if res.returncode != 0 or len(values) != len(GPU_LIMIT_FIELDS):
        return None
    return dict(zip(GPU_LIMIT_FIELDS, values))


def collect_meta(argv: list[str], device: str, program: str = "python -m flashtile.bench") -> dict:
    """What a reader needs to trust and reproduce the numbers. ``program``: what ran with ``argv`` (a script
    passes ``"python " + sys.argv[0]`` and ``sys.argv[1:]``)."""
    now = _dt.datetime.now().astimezone()
    meta = {"device": torch.device(device).type}
    if meta["device"] == "cuda":
        props = torch.cuda.get_device_properties(torch.device(device))
        meta["gpu"] = props.name
        meta["capability"] = f"{props.major}.{props.minor}"
        meta["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        # which GPU: two boards of one model differ by up to a few percent, enough to flip a kernel's
        # standing against a peer
        meta["gpu_uuid"] = str(getattr(props, "uuid", "")) or None
        # and what may explain it: the board's clock and power limits
        meta["gpu_limits"] = gpu_limits(meta["gpu_uuid"])
    else:
        meta["gpu"] = None
        meta["cpu"] = platform.processor() or platform.machine()
    meta.update(_versions())
    meta["date"] = now.isoformat(timespec="seconds")
    meta["command"] = f"{program} {shlex.join(argv)}".rstrip()
    meta["hostname"] = socket.gethostname()
    # the public settings in force (FLASHTILE_GLUON, FLASHTILE_FAST_LAUNCH, ...): a result file must say
    # which path it measured
    settings = config.get()
    meta["settings"] = {name: getattr(settings, field.name) for name, field in config.ENV_FIELDS.items()}
    return meta


def device_slug(meta: dict) -> str:
    name = meta.get("gpu") or "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def write_json(path: str, meta: dict, rows: list[dict]) -> None:
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:  # written whole then renamed, so a killed run leaves a valid file
        json.dump({"meta": meta, "rows": rows}, f, indent=1, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)


def _num(x: float | None, fmt: str) -> str:
    return MISSING if x is None else format(x, fmt)


def _tf(x: float | None) -> str:
    # GPU rows are hundreds of TFLOP/s; CPU smoke rows are hundredths, and should not print as 0.0.
    if x is None:
        return MISSING
    return format(x, ".1f") if x >= 10 else format(x, ".3g")


def _causal(row: dict) -> str:
    return "yes" if row["causal"] else "no"


def progress_line(i: int, n: int, row: dict, impls: list[str], seconds: float) -> str:
    parts = [f"{name} {_tf(row['tflops'].get(name))}" for name in impls]
    err = _num(row.get("max_err"), ".1e")
    if "max_err_grad" in row:
        err += f" grad {_num(row['max_err_grad'], '.1e')}"
    flag = "  MISMATCH" if row.get("mismatch") else ""
    if row.get("check_error"):
        flag += f"  ({row['check_error']})"
    return (f"[{i}/{n}] {row['mode']} d={row['d']} s={row['s']} b={row['b']} h={row['h']} "
            f"causal={_causal(row)}: " + " | ".join(parts) + " TFLOP/s"
            + f"  err {err}{flag}  ({seconds:.1f}s)")


def format_table(rows: list[dict], impls: list[str], meta: dict) -> str:
    """An aligned table: TFLOP/s per implementation, then flashtile/peer speed ratios."""
    if not rows:
        return "(no rows)"
    peers = [p for p in impls if p != "flashtile"]
    grads = any("max_err_grad" in r for r in rows)
    head = ["d", "s", "b", "h", "causal", *impls, *[f"ft/{p}" for p in peers], "max_err",
            *(["grad_err"] if grads else []), "flag"]
    body = []
    for r in rows:
        cells = [str(r["d"]), str(r["s"]), str(r["b"]), str(r["h"]), _causal(r)]
        cells += [_tf(r["tflops"].get(name)) for name in impls]
        cells += [_num(r.get("ratios", {}).get(p), ".2f") for p in peers]
        cells.append(_num(r.get("max_err"), ".1e"))
        if grads:
            cells.append(_num(r.get("max_err_grad"), ".1e"))
        cells.append("MISMATCH" if r.get("mismatch") else "")
        body.append(cells)
    widths = [max(len(h), *(len(c[j]) for c in body)) for j, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths)).rstrip()
    where = meta.get("gpu") or f"CPU ({meta.get('cpu')})"
    out = [f"{rows[0]['mode']}  TFLOP/s  {rows[0]['dtype']}  {where}   "
           "(ft/peer > 1: flashtile faster)", line(head), line(["-" * w for w in widths])]
    out += [line(c) for c in body]
    notes = _error_notes(rows)
    if notes:
        out.append("")
        out.append("not measured:")
        out += notes
    ceil = meta.get("ceilings")
    if ceil and "matmul_tflops" in ceil:
        out.append(f"ceilings: bf16 matmul {ceil['matmul_tflops']:.0f} TFLOP/s, "
                   f"copy {ceil['copy_tb_s']:.2f} TB/s")
    return "\n".join(out)


def _error_notes(rows: list[dict]) -> list[str]:
    # One line per (implementation, reason): a peer refusing every row should not print 36 lines.
    groups: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        errs = dict(r.get("errors", {}))
        if r.get("check_error"):
            errs["check"] = r["check_error"]
        for name, reason in errs.items():
            short = " ".join(reason.split())[:300] or "unknown error"
            groups.setdefault((name, short), []).append(f"d={r['d']} s={r['s']} {_causal(r)}")
    lines = []
    for (name, reason), where in groups.items():
        scope = "all rows" if len(where) == len(rows) else ", ".join(where[:6]) + (
            f" (+{len(where) - 6})" if len(where) > 6 else "")
        lines.append(f"  {name}: {reason}  [{scope}]")
    return lines


def eprint(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def resolve_device(requested: str | None) -> str | None:
    """The benchmark's device: ``--device`` if given, else cuda when torch sees one, else cpu; None (after
    saying why) when cuda is asked for and torch sees no CUDA device."""
    import torch

    device = requested or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        eprint("error: --device cuda, but torch sees no CUDA device (use --device cpu for a smoke test)")
        return None
    return device
