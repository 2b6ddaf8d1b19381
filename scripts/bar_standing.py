"""Issue 5's last bar, board by board: in each committed 8-layer decode table (`bench decode --cuda-graph --layers 8`
with the bar's batches, b = 1, 8, 32), the rows where cuDNN's median beat flashtile's, with the board's serial, the
class the run recorded (meta.board, since session 29) and the code's session (from the file name). The bar is the
H200's; tables from H100s (named in the file and in the GPU column) are other boards' readings, not the bar.

Usage: python scripts/bar_standing.py [benchmarks/results/decode_graph_layers8*_lease*.json ...]
"""

import glob
import json
import re
import sys

BAR_BATCHES = {1, 8, 32}


def standing(path: str) -> dict | None:
    with open(path) as f:
        data = json.load(f)
    rows = [r for r in data.get("rows", []) if r.get("b") in BAR_BATCHES and r.get("new_tokens", 0) == 0]
    if {r["b"] for r in rows} != BAR_BATCHES or "--new-tokens" in data["meta"].get("command", ""):
        return None  # not the bar's table (other batches, or serving steps with an append)
    behind = []
    for r in rows:
        ours, peer = r["us"].get("flashtile"), r["us"].get("cudnn")
        if ours and peer and peer < ours:
            behind.append(f"b={r['b']} {r['seqlen_k'] // 1024}k {peer / ours:.4f}")
    meta = data["meta"]
    session = re.search(r"session(\d+)", path)
    return {"file": path.rsplit("/", 1)[-1], "session": int(session.group(1)) if session else None,
            "gpu": meta.get("gpu", "?").replace("NVIDIA ", ""),
            "serial": meta.get("gpu_limits", {}).get("serial"), "board": (meta.get("board") or {}).get("class"),
            "read_tb_s": (meta.get("board") or {}).get("read_tb_s"),
            "rows": len(rows), "behind": behind}


def main() -> None:
    paths = sys.argv[1:] or sorted(glob.glob("benchmarks/results/decode_graph_layers8*_lease*.json"))
    found = [s for s in map(standing, paths) if s]
    found.sort(key=lambda s: (s["session"] or 0, s["file"]))
    for s in found:
        rate = f"{s['read_tb_s']:.2f} TB/s" if s["read_tb_s"] else "-"
        print(f"session {s['session']}  {s['file']}  {s['gpu']}  serial {s['serial']}  "
              f"class {s['board'] or '-'} ({rate})  {s['rows']} rows, "
              f"cuDNN ahead in {len(s['behind'])}: {', '.join(s['behind']) or '-'}")


if __name__ == "__main__":
    main()
