"""Compares two GPU reports (tools/make_report.py's JSON) cell by cell.

Usage: compare_reports.py OLD.json NEW.json [--scheme bf16] [--threshold 0.02]

Cells are the fused_experts rows on CUDA of one scheme ("bf16" takes bf16 and fp16 rows without
a quant scheme; "all" every scheme), matched on (model, M, scheme, LoRA setting); of several
rows of one key the last, as make_report's peer table takes them. Prints each cell's time in
both reports, new / old, and ours / peer in each; then, per M, the geometric mean of new / old
and of the peer's new / old. Reports a lease apart differ by the lease too: its drift shows in
the peer's column and in the cells whose kernels did not change, so a change is read against
those, not against 1.0 (the fifty-third session's 36bb65e: the cells at M = 1-8 and >= 256
within 0.5%, its sm80 cells at M = 16-64 2-8% slower). Last, the cells that moved past the
threshold and, in each report, the cells within 2% of the peer or faster.
"""
import argparse
import json
import math
import sys

from make_report import peer_key  # a cell's key, as make_report matches bench rows to the peer's


def load_cells(path, scheme):
    try:
        with open(path) as f:
            rows = json.load(f)["rows"]
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"compare_reports: {path}: not a report with rows ({e})")
    cells = {}
    for row in rows:
        if row.get("op") != "fused_experts" or row.get("device") != "cuda" or not row.get("time_us"):
            continue
        key = peer_key(row)
        if scheme == "all" or key[2] == scheme:
            cells[key] = row  # the last row of a key
    return cells


def geomean(values):
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def lora_label(lora):
    return "base" if lora is None else f"r{lora[0]} n{lora[1]} s{lora[2]:g}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--scheme", default="bf16", help='a quant scheme ("bf16": none), or "all"')
    ap.add_argument("--threshold", type=float, default=0.02, help="new / old past 1 +- this is a move")
    args = ap.parse_args()
    old, new = load_cells(args.old, args.scheme), load_cells(args.new, args.scheme)
    keys = sorted(set(old) & set(new), key=lambda k: (k[2], k[3] is not None, k[3] or (), k[0], k[1]))
    if not keys:
        sys.exit(f"compare_reports: no {args.scheme} cell in both reports")
    ratio = lambda row: row["time_us"] / row["peer_us"] if row.get("peer_us") else None
    fmt = lambda x: f"{x:7.3f}" if x else f"{'-':>7}"
    print(f"{'model':18} {'M':>5} {'scheme':>7} {'lora':>12} | {'old_us':>9} {'new_us':>9} {'new/old':>7} | "
          f"{'old/peer':>8} {'new/peer':>8}")
    for k in keys:
        o, n = old[k], new[k]
        print(f"{k[0]:18} {k[1]:>5} {k[2]:>7} {lora_label(k[3]):>12} | {o['time_us']:>9.1f} {n['time_us']:>9.1f} "
              f"{n['time_us'] / o['time_us']:>7.3f} | {fmt(ratio(o)):>8} {fmt(ratio(n)):>8}")
    print("by M: geomean of new / old (ours), and of the peer's new / old where both reports have it")
    for M in sorted({k[1] for k in keys}):
        ours = [new[k]["time_us"] / old[k]["time_us"] for k in keys if k[1] == M]
        peer = [new[k]["peer_us"] / old[k]["peer_us"] for k in keys
                if k[1] == M and old[k].get("peer_us") and new[k].get("peer_us")]
        peer_text = f"{geomean(peer):.3f} ({len(peer)} cells)" if peer else "-"
        print(f"  M = {M:>5}: ours {geomean(ours):.3f} ({len(ours)} cells), peer {peer_text}")
    moved = [(new[k]["time_us"] / old[k]["time_us"], k) for k in keys]
    for name, picked in (("slower", [m for m in moved if m[0] > 1 + args.threshold]),
                         ("faster", [m for m in moved if m[0] < 1 - args.threshold])):
        cells = ", ".join(f"{k[0]} M={k[1]} {lora_label(k[3])} {r:.3f}" for r, k in sorted(picked, reverse=name == "slower"))
        print(f"{name} by more than {args.threshold:.0%}: {len(picked)} of {len(keys)} cells{': ' + cells if cells else ''}")
    for label, cells in (("old", old), ("new", new)):
        with_peer = [k for k in keys if ratio(cells[k])]
        within = sum(ratio(cells[k]) <= 1.02 for k in with_peer)
        print(f"{label}: within 2% of the peer or faster in {within} of {len(with_peer)} cells")


if __name__ == "__main__":
    main()
