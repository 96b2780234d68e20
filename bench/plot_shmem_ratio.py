#!/usr/bin/env python3
"""Draws mori / NVSHMEM against message size from the CSV files of shmem_bench and nvshmem_bench (one run, one
machine) as one SVG file, standard library only: put bandwidth (best over the block counts, block and warp
scope; above 1 is better) and put-with-signal and single-value ping-pong latency (NVSHMEM / mori, so that above 1
is better there too).

usage: plot_shmem_ratio.py MORI.csv[,MORI2.csv...] NVSHMEM.csv[,NVSHMEM2.csv...] OUT.svg [--title TEXT]
(several files of one side, comma-separated: each point the best over them, as compare_shmem.py takes them)
"""
import argparse
import csv
import html
import math

BANDWIDTH = [("put_bw", "put_bw, block scope", "#1f77b4"), ("put_bw_warp", "put_bw, warp scope", "#2ca02c")]
LATENCY = [("signal_latency_thread", "put-with-signal, thread", "#d62728"),
           ("signal_latency_warp", "put-with-signal, warp", "#ff7f0e"),
           ("signal_latency_block", "put-with-signal, block", "#9467bd"),
           ("p_latency", "single-value put", "#8c564b")]


def load(paths):
    """{bench: {size: best value}}: the highest bandwidth or the lowest latency over the block counts (and over
    the comma-separated files)."""
    rows = {}
    for path in paths.split(","):
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                size, value = int(r["size"]), float(r["value"])
                better = max if r["unit"] == "GBps" else min
                per = rows.setdefault(r["bench"], {})
                per[size] = better(per[size], value) if size in per else value
    return rows


def human(n):
    for shift, name in ((30, "G"), (20, "M"), (10, "K")):
        if n >= 1 << shift:
            return f"{n >> shift}{name}"
    return f"{n}B"


def panel(out, x0, y0, w, h, title, series, sizes, ratio_max):
    """One chart: ratio against log2(size); series = [(label, colour, {size: ratio})]."""
    lo, hi = math.log2(min(sizes)), math.log2(max(sizes))
    span = max(hi - lo, 1)

    def px(size):
        return x0 + (math.log2(size) - lo) / span * w

    def py(ratio):
        return y0 + h - min(ratio, ratio_max) / ratio_max * h

    out.append(f'<text x="{x0}" y="{y0 - 10}" font-size="14" font-weight="bold">{html.escape(title)}</text>')
    out.append(f'<rect x="{x0}" y="{y0}" width="{w}" height="{h}" fill="none" stroke="#888"/>')
    step = 0.25 if ratio_max <= 2 else 0.5
    r = 0.0
    while r <= ratio_max + 1e-9:
        y = py(r)
        out.append(f'<line x1="{x0}" y1="{y:.1f}" x2="{x0 + w}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(f'<text x="{x0 - 6}" y="{y + 4:.1f}" font-size="11" text-anchor="end">{r:.2f}</text>')
        r += step
    y1 = py(1.0)
    out.append(f'<line x1="{x0}" y1="{y1:.1f}" x2="{x0 + w}" y2="{y1:.1f}" stroke="#000" stroke-dasharray="4 3"/>')
    for s in sizes:
        x = px(s)
        out.append(f'<text x="{x:.1f}" y="{y0 + h + 16}" font-size="10" text-anchor="middle">{human(s)}</text>')
    for i, (label, colour, points) in enumerate(series):
        pts = sorted(points.items())
        if not pts:
            continue
        path = " ".join(f"{px(s):.1f},{py(v):.1f}" for s, v in pts)
        out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        for s, v in pts:
            out.append(f'<circle cx="{px(s):.1f}" cy="{py(v):.1f}" r="3" fill="{colour}"><title>'
                       f'{html.escape(label)} {human(s)}: {v:.2f}</title></circle>')
        ly = y0 + 14 + 16 * i
        out.append(f'<line x1="{x0 + 10}" y1="{ly - 4}" x2="{x0 + 30}" y2="{ly - 4}" stroke="{colour}" stroke-width="2"/>')
        out.append(f'<text x="{x0 + 36}" y="{ly}" font-size="11">{html.escape(label)}</text>')


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mori")
    ap.add_argument("nvshmem")
    ap.add_argument("out")
    ap.add_argument("--title", default="mori / NVSHMEM")
    a = ap.parse_args()
    m, n = load(a.mori), load(a.nvshmem)

    bw = []
    for bench, label, colour in BANDWIDTH:
        common = set(m.get(bench, {})) & set(n.get(bench, {}))
        bw.append((label, colour, {s: m[bench][s] / n[bench][s] for s in common if n[bench][s] > 0}))
    lat = []
    for bench, label, colour in LATENCY:
        common = set(m.get(bench, {})) & set(n.get(bench, {}))
        lat.append((label, colour, {s: n[bench][s] / m[bench][s] for s in common if m[bench][s] > 0}))
    bw_sizes = sorted({s for _, _, p in bw for s in p})
    lat_sizes = sorted({s for _, _, p in lat for s in p})
    if not bw_sizes and not lat_sizes:
        raise SystemExit("plot_shmem_ratio: the two files share no rows")

    out = ['<svg xmlns="http://www.w3.org/2000/svg" width="980" height="420" font-family="sans-serif">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="20" y="24" font-size="16" font-weight="bold">{html.escape(a.title)}</text>']
    if bw_sizes:
        ratio_max = max(2.0, math.ceil(max(v for _, _, p in bw for v in p.values()) * 2) / 2)
        panel(out, 60, 70, 520, 290, "bandwidth: mori / NVSHMEM (above 1: mori faster)", bw, bw_sizes, ratio_max)
    if lat_sizes:
        ratio_max = max(2.0, math.ceil(max(v for _, _, p in lat for v in p.values()) * 2) / 2)
        panel(out, 660, 70, 290, 290, "latency: NVSHMEM / mori (above 1: mori faster)", lat, lat_sizes, ratio_max)
    out.append("</svg>")
    with open(a.out, "w") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
