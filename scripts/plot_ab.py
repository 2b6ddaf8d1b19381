"""Plot an A/B of two `python -m flashtile.bench` JSON files of the same rows (one setting each, e.g.
two values of FLASHTILE_DECODE_ROUTE): flashtile's time (decode) or TFLOP/s (attention) per row, B over A.

Usage: python scripts/plot_ab.py A.json B.json --labels "split" "rows" --out ab.png
"""

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _series(path: str):
    rows = json.load(open(path))["rows"]
    if "us" in rows[0]:  # decode: microseconds, lower is better
        return [f"b={r['b']} {r['seqlen_k'] // 1024}k" for r in rows], [r["us"]["flashtile"] for r in rows], "us"
    return ([f"d={r['d']} s={r['s']}{' c' if r['causal'] else ''}" for r in rows],
            [r["tflops"]["flashtile"] for r in rows], "TFLOP/s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--labels", nargs=2, default=["A", "B"])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    names, a, unit = _series(args.a)
    names_b, b, _ = _series(args.b)
    if names != names_b:
        raise SystemExit(f"the two files hold different rows: {names} vs {names_b}")
    ratio = [y / x for x, y in zip(a, b)]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(names)), 3.5))
    ax.bar(range(len(names)), ratio, color=["tab:green" if (r < 1) == (unit == "us") else "tab:red" for r in ratio])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(names)), names, rotation=45, ha="right")
    ax.set_ylabel(f"{args.labels[1]} / {args.labels[0]} ({unit})")
    ax.set_ylim(min(ratio + [1]) - 0.03, max(ratio + [1]) + 0.03)
    better = "lower" if unit == "us" else "higher"
    # two lines: one would run past the figure's edge for a few rows and long labels
    ax.set_title(f"{args.labels[1]} against {args.labels[0]}\nflashtile {unit} per row ({better} is better)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
