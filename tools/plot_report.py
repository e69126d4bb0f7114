#!/usr/bin/env python3
"""A GPU report as a picture: percent of the roofline floor against the token count M, one
panel per model, one line per series (bf16 / each 8-bit scheme, with or without LoRA of
each rank), from one or more report JSONs (moelora_bench --json, quant_bench --json, or a
tools/gpu_report.sh report; where two give the same model, series and M, the later one's
row is drawn). The PNG is written beside the first report unless -o says.

    python3 tools/plot_report.py reports/gpu/<report>.json [more.json ...] [-o out.png]
"""
import argparse
import json
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt  # noqa: E402


def series_of(row):
    """The line a row belongs to: 'bf16', 'fp8_block', ... plus ' + LoRA r=R'."""
    quant = row.get("quant") or {}
    name = quant.get("scheme") or row.get("dtype", "?")
    lora = row.get("lora")
    if isinstance(lora, dict) and lora.get("rank"):
        name += f" + LoRA r={lora['rank']}"
    return name


def load_rows(paths):
    rows = {}  # (model, series, M) -> row: a later report's row replaces an earlier one's
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        for row in report["rows"] if isinstance(report, dict) else report:
            if row.get("op") == "fused_experts" and row.get("pct_floor") is not None and row.get("M"):
                rows[(row["model"], series_of(row), row["M"])] = row
    rows = list(rows.values())
    if not rows:
        raise SystemExit(f"plot_report: no fused_experts rows with pct_floor in {', '.join(paths)}")
    return rows


def plot(rows, title, out):
    models = sorted({r["model"] for r in rows}, key=lambda m: [r["model"] for r in rows].index(m))
    series = sorted({series_of(r) for r in rows}, key=lambda s: (s.split(" + ")[0] != "bf16", s))
    columns = min(3, len(models))
    lines = math.ceil(len(models) / columns)
    fig, axes = plt.subplots(lines, columns, figsize=(5.2 * columns, 3.6 * lines), squeeze=False, sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, model in enumerate(models):
        ax = axes[index // columns][index % columns]
        for k, name in enumerate(series):
            points = sorted((r["M"], r["pct_floor"]) for r in rows if r["model"] == model and series_of(r) == name)
            if points:
                ax.plot([m for m, _ in points], [p for _, p in points], marker="o", markersize=3,
                        color=colors[k % len(colors)], linestyle="--" if "LoRA" in name else "-", label=name)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 105)
        ax.axhline(100, color="grey", linewidth=0.6)
        ax.set_title(model, fontsize=10)
        ax.set_xlabel("tokens M")
        ax.grid(True, linewidth=0.3)
        if index % columns == 0:
            ax.set_ylabel("% of the roofline floor")
    for index in range(len(models), lines * columns):
        axes[index // columns][index % columns].axis("off")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", help="report JSON files")
    parser.add_argument("-o", "--output", help="the PNG (default: beside the first report, .png)")
    parser.add_argument("--title", help="the figure's title (default: the reports' names)")
    args = parser.parse_args(argv)
    rows = load_rows(args.reports)
    out = args.output or os.path.splitext(args.reports[0])[0] + ".png"
    title = args.title or "moelora, % of the roofline floor: " + ", ".join(os.path.basename(p) for p in args.reports)
    plot(rows, title, out)
    print(f"plot_report: {len(rows)} rows -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
