"""Grouped bar charts: TFLOP/s per head dim (fwd/bwd/fwdbwd), decode time over the HBM floor per batch size, or
the models mode's ratios against their bars per group."""

from __future__ import annotations

import argparse
import json


def _impl_order(rows: list[dict]) -> list[str]:
    names: dict[str, None] = {"flashtile": None} if any("flashtile" in r["ms"] for r in rows) else {}
    for r in rows:
        names.update(dict.fromkeys(r["ms"]))
    return list(names)


def _panels(rows: list[dict], key: str, n_impls: int, panel_height: float):
    """Rows grouped by ``key`` (sorted), and a figure with one panel per group sized for its bars."""
    # The object API with an explicit Agg canvas: no pyplot global state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    groups = {g: [r for r in rows if r[key] == g] for g in sorted({r[key] for r in rows})}
    widest = max(len(v) for v in groups.values())
    fig = Figure(figsize=(max(7.0, 0.35 * widest * (n_impls + 1)), panel_height * len(groups)))
    FigureCanvasAgg(fig)
    return groups, fig, fig.subplots(len(groups), 1, squeeze=False)[:, 0]


def plot_results(data: dict, path: str) -> None:
    """Draw ``{"meta", "rows"}`` (a bench JSON) to a PNG at ``path``."""

    rows, meta = data["rows"], data.get("meta", {})
    if not rows:
        raise ValueError("no rows to plot")
    if rows[0].get("mode") == "decode":
        plot_decode(data, path)
        return
    if "group" in rows[0]:
        plot_models(data, path)
        return
    impls = _impl_order(rows)
    per_dim, fig, axes = _panels(rows, "d", len(impls), 3.3)
    dims = list(per_dim)
    bar_w = 0.8 / len(impls)
    for ax, d in zip(axes, dims):
        rs = per_dim[d]
        for j, name in enumerate(impls):
            xs = [i + (j - (len(impls) - 1) / 2) * bar_w for i in range(len(rs))]
            vals = [r["tflops"].get(name) for r in rs]
            ax.bar(xs, [v or 0.0 for v in vals], bar_w, label=name, color=f"C{j}")
            if name == "flashtile":  # ours is the bar a reader looks for: give its number
                for x, v in zip(xs, vals):
                    if v is not None:
                        ax.text(x, v, f"{v:.0f}" if v >= 10 else f"{v:.2g}", ha="center", va="bottom",
                                fontsize=6)
            for x, v in zip(xs, vals):
                if v is None:  # a missing bar must read as "not measured", not as zero speed
                    ax.text(x, 0, "n/a", rotation=90, ha="center", va="bottom", fontsize=6)
        labels = []
        for r in rs:
            lab = f"{r['s']}\n{'causal' if r['causal'] else 'full'}"
            if len({r['mode'] for r in rows}) > 1:
                lab += f"\n{r['mode']}"
            if r.get("mismatch"):
                lab += "\nMISMATCH"
            labels.append(lab)
        ax.set_xticks(range(len(rs)))
        ax.set_xticklabels(labels, fontsize=7)
        for tick, r in zip(ax.get_xticklabels(), rs):
            if r.get("mismatch"):
                tick.set_color("red")
        ax.set_title(f"head dim {d}  (h={rs[0]['h']})", fontsize=9)
        ax.set_ylabel("TFLOP/s")
        top = max((v for r in rs for v in r["tflops"].values() if v is not None), default=1.0)
        ax.set_ylim(0, top * 1.2)  # headroom so the legend never covers a bar
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    axes[0].legend(fontsize=7, ncols=len(impls), loc="upper left")
    axes[-1].set_xlabel("sequence length (b = tokens // s)", fontsize=8)
    modes = ", ".join(dict.fromkeys(r["mode"] for r in rows))
    where = meta.get("gpu") or "CPU"
    fig.suptitle(f"{modes}  {rows[0].get('dtype', '')}  {where}  {meta.get('date', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_decode(data: dict, path: str) -> None:
    """Decode rows: one panel per batch size, bars = each implementation's time over the HBM floor
    (1.0 = reading the cache at copy bandwidth; the issue's bars are 1.15 at long caches, 2 at b=1 8k)."""

    rows, meta = data["rows"], data.get("meta", {})
    impls = list(dict.fromkeys(["flashtile"] + [name for r in rows for name in r["us"]]))
    per_b, fig, axes = _panels(rows, "b", len(impls), 3.0)
    batches = list(per_b)
    bar_w = 0.8 / len(impls)
    for ax, b in zip(axes, batches):
        rs = per_b[b]
        top = 1.0
        for j, name in enumerate(impls):
            xs = [i + (j - (len(impls) - 1) / 2) * bar_w for i in range(len(rs))]
            vals = [r["us"].get(name) / r["floor_us"] if r["us"].get(name) and r.get("floor_us") else None
                    for r in rs]
            top = max([top] + [v for v in vals if v is not None])
            ax.bar(xs, [v or 0.0 for v in vals], bar_w, label=name, color=f"C{j}")
            for x, v, r in zip(xs, vals, rs):
                if v is None:
                    ax.text(x, 0, "n/a", rotation=90, ha="center", va="bottom", fontsize=6)
                elif name == "flashtile":
                    ax.text(x, v, f"{r['us'][name]:.0f}us", ha="center", va="bottom", fontsize=6)
        for level, style in ((1.0, "-"), (1.15, ":")):
            ax.axhline(level, color="k", linestyle=style, linewidth=0.8)
        ax.set_xticks(range(len(rs)))
        ax.set_xticklabels([f"{r['seqlen_k'] // 1024}k" + ("\nMISMATCH" if r.get("mismatch") else "") for r in rs],
                           fontsize=7)
        ax.set_ylim(0, top * 1.2)
        ax.set_ylabel("time / HBM floor")
        ax.set_title(f"batch {b}  (h={rs[0]['h']}, h_k={rs[0]['h_k']}, d={rs[0]['d']})", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    axes[0].legend(fontsize=7, ncols=len(impls), loc="upper right")
    axes[-1].set_xlabel("cache length seqlen_k (labels: flashtile's time)", fontsize=8)
    graph = " (CUDA-graph replays)" if "--cuda-graph" in str(meta.get("command", "")) else ""
    fig.suptitle(f"decode {rows[0].get('dtype', '')}  {meta.get('gpu') or 'CPU'}  {meta.get('date', '')[:10]}{graph}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


VERDICT_COLORS = {"pass": "C2", "within noise": "C1", "fail": "C3"}


def plot_models(data: dict, path: str) -> None:
    """Models rows: one panel per group, one bar per row = the median baseline / subject time ratio, colored
    by its verdict, with the group's bar as a dashed line and the noise allowance as a band around it."""

    rows, meta = data["rows"], data.get("meta", {})
    noise = meta.get("bars", {}).get("noise", 0.0)
    per_group, fig, axes = _panels(rows, "group", 1, 3.0)
    order = dict.fromkeys(r["group"] for r in rows)  # the run's order (dv, sink, chunk), not the alphabet's
    for ax, group in zip(axes, order):
        rs = per_group[group]
        bar = rs[0]["bar"]
        vals = [r.get("ratio") for r in rs]
        ax.bar(range(len(rs)), [v or 0.0 for v in vals], 0.6,
               color=[VERDICT_COLORS.get(r.get("verdict"), "0.6") for r in rs])
        for x, v in enumerate(vals):
            if v is None:  # a missing bar must read as "not measured", not as a ratio of zero
                ax.text(x, 0, "n/a", rotation=90, ha="center", va="bottom", fontsize=6)
            else:
                ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=6)
        lo, hi = bar["min_ratio"] * (1 - noise), bar["min_ratio"] * (1 + noise)
        ax.axhspan(lo, hi, color="0.85", zorder=0)
        ax.axhline(bar["min_ratio"], color="k", linestyle="--", linewidth=0.8)
        labels = []
        for r in rs:
            lab = f"{r['mode']}\ns={r['s']}\n{'causal' if r['causal'] else 'full'}"
            lab += f"\nc={r['chunk']}" if r.get("chunk") else f"\nd={r['d']}"
            labels.append(lab + ("\nMISMATCH" if r.get("mismatch") else ""))
        ax.set_xticks(range(len(rs)))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylim(0, max([hi, *[v for v in vals if v is not None]]) * 1.2)
        ax.set_ylabel(f"/{bar['baseline']}")
        ax.set_title(f"{group}: {bar['text']}", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    where = meta.get("gpu") or "CPU"
    fig.suptitle(f"models  baseline / subject time  {rows[0].get('dtype', '')}  {where}  {meta.get('date', '')}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", metavar="RESULTS.json", help="a file written by fwd/bwd/fwdbwd/decode/models")
    p.add_argument("png", metavar="OUT.png")


def run(args) -> int:
    with open(args.results) as f:
        data = json.load(f)
    plot_results(data, args.png)
    print(f"wrote {args.png}")
    return 0
