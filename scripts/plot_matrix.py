#!/usr/bin/env python3
"""Draws shmem_matrix's CSV (metric,from,to,value,unit) as two heat maps in one SVG file, standard library only.

usage: plot_matrix.py MATRIX.csv OUT.svg [--title TEXT] [--all-to-all-ms MS]
"""
import argparse
import csv
import html
import sys


def load(path):
    cells = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            cells.setdefault(row["metric"], {})[(int(row["from"]), int(row["to"]))] = float(row["value"])
    if not cells:
        sys.exit(f"plot_matrix: {path} holds no rows")
    return cells


def colour(t):
    """Light yellow (t = 0) to dark blue (t = 1)."""
    lo, hi = (255, 247, 188), (8, 48, 107)
    r, g, b = (round(a + (b - a) * t) for a, b in zip(lo, hi))
    return f"rgb({r},{g},{b})"


def heat_map(out, x0, y0, title, cells, n, fmt, unit):
    size = max(28, min(64, 480 // max(n, 1)))
    vals = list(cells.values())
    lo, hi = min(vals), max(vals)
    out.append(f'<text x="{x0}" y="{y0 - 28}" font-size="14" font-weight="bold">{html.escape(title)}</text>')
    out.append(f'<text x="{x0}" y="{y0 - 10}" font-size="11">row: from PE, column: to PE; '
               f'{fmt.format(lo)} .. {fmt.format(hi)} {html.escape(unit)}</text>')
    for i in range(n):
        out.append(f'<text x="{x0 - 6}" y="{y0 + i * size + size * 0.6}" font-size="11" text-anchor="end">{i}</text>')
        out.append(f'<text x="{x0 + i * size + size / 2}" y="{y0 + n * size + 14}" font-size="11" '
                   f'text-anchor="middle">{i}</text>')
        for j in range(n):
            x, y = x0 + j * size, y0 + i * size
            if (i, j) not in cells:
                out.append(f'<rect x="{x}" y="{y}" width="{size}" height="{size}" fill="#eee" stroke="#fff"/>')
                continue
            v = cells[(i, j)]
            t = 0.0 if hi == lo else (v - lo) / (hi - lo)
            ink = "#fff" if t > 0.55 else "#000"
            out.append(f'<rect x="{x}" y="{y}" width="{size}" height="{size}" fill="{colour(t)}" stroke="#fff"/>')
            out.append(f'<text x="{x + size / 2}" y="{y + size * 0.6}" font-size="{max(8, size // 4)}" '
                       f'text-anchor="middle" fill="{ink}">{fmt.format(v)}</text>')
    return n * size


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("svg")
    ap.add_argument("--title", default="mori SHMEM all-pairs matrix")
    ap.add_argument("--all-to-all-ms", type=float, default=None)
    a = ap.parse_args()
    cells = load(a.csv)
    n = 1 + max(max(max(k) for k in m) for m in cells.values())
    out = []
    y = 70
    x = 40
    width = 0
    for metric, title, fmt, unit in (("put_bw", "put bandwidth", "{:.0f}", "GB/s"),
                                     ("p_latency", "single-value ping-pong (half round trip)", "{:.2f}", "us")):
        if metric not in cells:
            continue
        side = heat_map(out, x, y, title, cells[metric], n, fmt, unit)
        x += side + 80
        width = x
    height = y + max(28, min(64, 480 // n)) * n + 40
    if a.all_to_all_ms is not None:
        out.append(f'<text x="40" y="{height}" font-size="12">all-to-all, 1 MiB per pair: '
                   f'{a.all_to_all_ms:.3f} ms</text>')
        height += 20
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif">',
           '<rect width="100%" height="100%" fill="#fff"/>',
           f'<text x="40" y="24" font-size="16" font-weight="bold">{html.escape(a.title)}</text>'] + out + ["</svg>"]
    with open(a.svg, "w") as f:
        f.write("\n".join(svg) + "\n")


if __name__ == "__main__":
    main()
