"""Assembles the GPU report of DESIGN.md from the pieces tools/gpu_report.sh writes.

Usage: make_report.py --commit SHA --ctest ctest.xml --pytest pytest.xml --bench bench.json [more.json...]
                      [--sanitizer-logs LOG...] --out report.json
The rows of every bench file (moelora_bench, quant_bench, sparse_mla_bench) go into
report.json as the benches wrote them (quant_bench's with their "quant" object); the
ceilings are the first file's, with the 8-bit GEMM rates (fp8_tflops, int8_tops) of the
first file that has them (quant_bench). Prints a short table of the bf16/fp16 layer rows
last, then, when there are LoRA rows (--lora-rank; "lora" not null, with "lora_tax" and
"tax_floor"), the LoRA tax per model and M at each rank, then the quantized layer rows
per scheme (and their LoRA tax), then the sparse MLA rows against issue 5's targets.
"""
import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import xml.etree.ElementTree as ET


def junit_counts(path):
    """(passed, failed, skipped) of a JUnit XML file; zeros when it is missing."""
    if not path or not os.path.exists(path):
        return 0, 0, 0
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    tests = failed = skipped = 0
    for suite in suites:
        tests += int(suite.get("tests", 0))
        failed += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped += int(suite.get("skipped", suite.get("disabled", 0)))
    return tests - failed - skipped, failed, skipped


def query(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def peer_key(row):
    """Rows of the bench and of the Triton peer match on (model, M, scheme, LoRA rank,
    adapters and share); bf16 and the base layer: scheme "bf16", LoRA None."""
    lora = row.get("lora")
    lora = None if not lora else (int(lora["rank"]), int(lora["adapters"]), float(lora["share"]))
    return row["model"], int(row["M"]), (row.get("quant") or {}).get("scheme", "bf16"), lora


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--commit", required=True)
    ap.add_argument("--ctest", nargs="+", help="ctest --output-junit files (several: a suite run in parts, "
                                               "ctest -I ranges over device calls)")
    ap.add_argument("--pytest")
    ap.add_argument("--bench", required=True, nargs="+")
    ap.add_argument("--sanitizer-logs", nargs="*", default=[])
    ap.add_argument("--sanitizer-state", help="tools/sanitizer_sweep.py's state: each tool's summary over the "
                                              "whole CUDA suite goes into the report's sanitizer.sweep")
    ap.add_argument("--out", required=True)
    ap.add_argument("--peer", nargs="+", help="triton_fused_moe_compare.py --json rows (bf16, 8-bit schemes, LoRA): "
                                              "their time goes into the matching rows as peer_us")
    # A report assembled off the GPU machine from files it wrote: say what ran there.
    ap.add_argument("--gpu")
    ap.add_argument("--driver")
    ap.add_argument("--cuda")
    args = ap.parse_args()

    gpu = args.gpu or query(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]).splitlines()[0]
    driver = args.driver or query(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).splitlines()[0]
    nvcc = query(["nvcc", "--version"])
    cuda = args.cuda or (nvcc.split("release ")[-1].split(",")[0] if "release" in nvcc else "unknown")
    bench = None
    ceilings_8bit = {}
    for path in args.bench:
        with open(path) as f:
            part = json.load(f)
        if not ceilings_8bit and "fp8_tflops" in part["ceilings"]:
            ceilings_8bit = {k: part["ceilings"][k] for k in ("fp8_tflops", "int8_tops")}
        if bench is None:
            bench = part
        else:
            # Floors are time over a ceiling: rows measured against other ceilings (a bench run
            # without --ceilings takes the nominal H100's) would mix percentages of two floors.
            first, this = bench["ceilings"], part["ceilings"]
            if bool(first.get("measured")) != bool(this.get("measured")) or \
                    abs(this["copy_tbps"] / first["copy_tbps"] - 1) > 0.03 or \
                    abs(this["bf16_tflops"] / first["bf16_tflops"] - 1) > 0.03:
                sys.exit(f"make_report.py: {path}: its ceilings ({this['copy_tbps']:.2f} TB/s, "
                         f"{this['bf16_tflops']:.0f} TFLOP/s, measured {bool(this.get('measured'))}) are not "
                         f"{args.bench[0]}'s ({first['copy_tbps']:.2f} TB/s, {first['bf16_tflops']:.0f} TFLOP/s, "
                         f"measured {bool(first.get('measured'))}): run its bench with --ceilings")
            bench["rows"] += part["rows"]
    if args.peer:
        peer = {}
        for path in args.peer:
            with open(path) as f:
                peer.update({peer_key(r): r for r in json.load(f)})
        for r in bench["rows"]:
            p = peer.get(peer_key(r)) if r.get("op", "fused_experts") == "fused_experts" else None
            if p:
                r["peer_us"] = round(p["two_gemm_us"], 3)
                r["peer"] = ("triton fused_moe_kernel (vLLM contract, benchmarks/triton_fused_moe_compare.py): the two "
                             "GEMMs" + (" and the four LoRA kernels (shrink, expand a GEMM)" if r.get("lora") else ""))
    # 8-bit rows next to the bf16 layer's row of the same cell (moelora_bench and quant_bench
    # share weights' seeds and routings): the issue's "fp8 time <= 0.62x bf16" check.
    bf16_us = {(r["model"], r["M"]): r["time_us"] for r in bench["rows"]
               if r.get("op", "fused_experts") == "fused_experts" and r.get("quant") is None and r.get("lora") is None
               and r.get("dtype", "bf16") == "bf16"}
    for r in bench["rows"]:
        if r.get("quant") and r.get("lora") is None and (r["model"], r["M"]) in bf16_us:
            r["bf16_us"] = bf16_us[(r["model"], r["M"])]
            r["vs_bf16"] = round(r["time_us"] / r["bf16_us"], 4)
    c_pass, c_fail, c_skip = (sum(counts) for counts in zip((0, 0, 0), *map(junit_counts, args.ctest or [])))
    p_pass, p_fail, p_skip = junit_counts(args.pytest)
    sanitizer = {}
    for log in args.sanitizer_logs:
        if os.path.exists(log):
            with open(log) as f:
                text = f.read()
            summary = [line for line in text.splitlines() if "ERROR SUMMARY" in line or "RACECHECK SUMMARY" in line]
            sanitizer[os.path.basename(log)] = summary[-1] if summary else "no summary (see log)"
    if args.sanitizer_state:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import sanitizer_sweep
        with open(args.sanitizer_state) as f:
            sanitizer["sweep"] = sanitizer_sweep.summarize(json.load(f),
                                                           sanitizer_sweep.load_known(sanitizer_sweep.KNOWN))
    report = {
        "commit": args.commit,
        "date": datetime.date.today().isoformat(),
        "gpu": gpu,
        "driver": driver,
        "cuda": cuda,
        "ceilings": {**{k: bench["ceilings"][k] for k in ("copy_tbps", "bf16_tflops")}, **ceilings_8bit},
        "ceilings_measured": bench["ceilings"].get("measured", False),
        "tests": {"passed": c_pass + p_pass, "failed": c_fail + p_fail, "skipped": c_skip + p_skip},
        "tests_by_suite": {
            "ctest": {"passed": c_pass, "failed": c_fail, "skipped": c_skip},
            "pytest": {"passed": p_pass, "failed": p_fail, "skipped": p_skip},
        },
        "sanitizer": sanitizer,
        "rows": bench["rows"],
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"{gpu} | driver {driver} | cuda {cuda} | commit {args.commit[:12]}")
    rates_8bit = (f", fp8 {ceilings_8bit['fp8_tflops']:.0f} TFLOP/s, int8 {ceilings_8bit['int8_tops']:.0f} TOP/s"
                  if ceilings_8bit else "")
    print(f"ceilings: copy {report['ceilings']['copy_tbps']:.2f} TB/s, bf16 {report['ceilings']['bf16_tflops']:.0f} TFLOP/s"
          + rates_8bit)
    print(f"tests: ctest {c_pass} passed {c_fail} failed {c_skip} skipped | pytest {p_pass} passed {p_fail} failed {p_skip} skipped")
    for name, line in sanitizer.items():
        print(f"{name}: {line}")
    all_layer_rows = [r for r in bench["rows"] if r.get("op", "fused_experts") == "fused_experts"]
    layer_rows = [r for r in all_layer_rows if r.get("quant") is None]
    base_rows = [r for r in layer_rows if r.get("lora") is None]
    print(f"{'model':16} {'M':>5} {'time_us':>10} {'floor_us':>9} {'%floor':>7} {'TB/s':>6} {'TFLOP/s':>8} "
          f"{'rel_err':>9} {'base_us':>10} {'speedup':>7}")
    speedups = []
    for r in base_rows:
        err = "-" if r["rel_err"] is None else f"{r['rel_err']:.2e}"
        base = r.get("baseline_us")
        speedup = base / r["time_us"] if base else None
        if speedup:
            speedups.append(speedup)
        print(f"{r['model']:16} {r['M']:>5} {r['time_us']:>10.1f} {r['floor_us']:>9.1f} {r['pct_floor']:>7.1f} "
              f"{r['tbps']:>6.2f} {r['tflops']:>8.1f} {err:>9} "
              f"{(f'{base:.1f}' if base else '-'):>10} {(f'{speedup:.2f}' if speedup else '-'):>7}")
    if speedups:
        geomean = math.exp(sum(math.log(x) for x in speedups) / len(speedups))
        print(f"speed-up over the previous kernels: geomean {geomean:.3f}, min {min(speedups):.3f}, "
              f"max {max(speedups):.3f} over {len(speedups)} cells")
    small = [r for r in base_rows if r["M"] <= 64]
    large = [r for r in base_rows if r["M"] >= 4096]
    if small:
        print(f"M <= 64: min {min(r['pct_floor'] for r in small):.1f}% of floor "
              f"({sum(r['pct_floor'] >= 85 for r in small)}/{len(small)} cells >= 85%)")
    if large:
        print(f"M >= 4096: min {min(r['pct_floor'] for r in large):.1f}% of floor "
              f"({sum(r['pct_floor'] >= 75 for r in large)}/{len(large)} cells >= 75%)")
    print_lora_tax(layer_rows)
    print_lora_peer(layer_rows)
    print_quant([r for r in all_layer_rows if r.get("quant") is not None])
    print_sparse_mla([r for r in bench["rows"] if r.get("op") == "sparse_mla_decode"])


def print_sparse_mla(rows):
    """The sparse MLA rows, then issue 5's targets: memory-bound cells (Hq = 16, T >= 64)
    at >= 75% of the floor, compute-bound ones (Hq = 128, T >= 64) at >= 450 TFLOP/s, and
    T = 1 in <= 10 us."""
    if not rows:
        return
    print(f"{'Hq':>4} {'topk':>5} {'S':>7} {'T':>4} {'splits':>6} {'time_us':>9} {'floor_us':>9} {'%floor':>7} "
          f"{'TB/s':>6} {'TFLOP/s':>8} {'rel_err':>9}")
    for r in rows:
        err = "-" if r["rel_err"] is None else f"{r['rel_err']:.2e}"
        print(f"{r['Hq']:>4} {r['topk']:>5} {r['S']:>7} {r['T']:>4} {r.get('num_splits', '-'):>6} {r['time_us']:>9.1f} "
              f"{r['floor_us']:>9.1f} {r['pct_floor']:>7.1f} {r['tbps']:>6.2f} {r['tflops']:>8.1f} {err:>9}")
    targets = [
        ("memory-bound (Hq 16, T >= 64) >= 75% of floor", [r for r in rows if r["Hq"] == 16 and r["T"] >= 64],
         lambda r: r["pct_floor"] >= 75, lambda r: f"{r['pct_floor']:.1f}%"),
        ("compute-bound (Hq 128, T >= 64) >= 450 TFLOP/s", [r for r in rows if r["Hq"] == 128 and r["T"] >= 64],
         lambda r: r["tflops"] >= 450, lambda r: f"{r['tflops']:.0f} TFLOP/s"),
        ("T = 1 <= 10 us", [r for r in rows if r["T"] == 1], lambda r: r["time_us"] <= 10, lambda r: f"{r['time_us']:.1f} us"),
    ]
    for name, cells, ok, show in targets:
        if cells:
            worst = ", ".join(f"Hq {r['Hq']} topk {r['topk']} S {r['S']} T {r['T']}: {show(r)}"
                              for r in cells if not ok(r))
            print(f"sparse MLA {name}: {sum(ok(r) for r in cells)}/{len(cells)} cells" + (f"; missed: {worst}" if worst else ""))


def print_quant(rows):
    """The quantized layer rows (quant_bench) per scheme: time against the 8-bit floor, the
    error against the quantized reference and against the bf16 layer; then per scheme the
    share of the floor reached and the largest error; then the LoRA tax on 8-bit experts."""
    if not rows:
        return
    label = lambda r: r["quant"]["scheme"] + ("/static" if r["quant"].get("activations") == "static" else "")
    schemes = list(dict.fromkeys(label(r) for r in rows))
    err = lambda v: "-" if v is None else f"{v:.2e}"
    print(f"{'model':16} {'M':>5} {'scheme':18} {'time_us':>10} {'floor_us':>9} {'%floor':>7} {'TB/s':>6} "
          f"{'TFLOP/s':>8} {'rel_err':>9} {'vs bf16':>9}")
    for r in rows:
        if r.get("lora") is None:
            print(f"{r['model']:16} {r['M']:>5} {label(r):18} {r['time_us']:>10.1f} {r['floor_us']:>9.1f} "
                  f"{r['pct_floor']:>7.1f} {r['tbps']:>6.2f} {r['tflops']:>8.1f} {err(r['rel_err']):>9} "
                  f"{err(r.get('rel_err_bf16')):>9}")
    for scheme in schemes:
        cells = [r for r in rows if label(r) == scheme and r.get("lora") is None]
        if not cells:
            continue
        pct = sorted(r["pct_floor"] for r in cells)
        errs = [r["rel_err"] for r in cells if r["rel_err"] is not None]
        print(f"{scheme}: % of floor min {pct[0]:.1f}, median {pct[len(pct) // 2]:.1f}, max {pct[-1]:.1f} over "
              f"{len(cells)} cells" + (f"; max rel_err {max(errs):.2e}" if errs else ""))
        vs_bf16 = [r["vs_bf16"] for r in cells if "vs_bf16" in r and 4 <= r["M"] <= 64]
        if vs_bf16:
            print(f"{scheme}: time / bf16 layer's at M = 4-64: max {max(vs_bf16):.3f} "
                  f"({sum(v <= 0.62 for v in vs_bf16)}/{len(vs_bf16)} cells <= 0.62)")
        peer = [r["peer_us"] / r["time_us"] for r in cells if r.get("peer_us")]
        if peer:
            geomean = math.exp(sum(math.log(x) for x in peer) / len(peer))
            print(f"{scheme}: peer time / ours: geomean {geomean:.3f}, min {min(peer):.3f} "
                  f"({sum(x < 0.97 for x in peer)}/{len(peer)} cells more than 3% slower than the peer)")
    for scheme in schemes:
        print_lora_tax([r for r in rows if label(r) == scheme], f" on {scheme} experts")


def print_lora_tax(rows, title=""):
    """Per model and M: the base time and the tax (time with LoRA / time without) at each
    rank, the floor's tax in brackets; then each rank's geomean and the LoRA rows' error.
    rows: one kind of expert (bf16/fp16, or one quantization scheme), named by title."""
    lora_rows = [r for r in rows if r.get("lora")]
    if not lora_rows:
        return
    key = lambda r: (r["lora"]["rank"], r["lora"]["adapters"], r["lora"]["share"])
    columns = sorted({key(r) for r in lora_rows})
    one_setting = len({c[1:] for c in columns}) == 1
    label = lambda c: f"r={c[0]}" if one_setting else f"r={c[0]} n={c[1]} s={c[2]}"
    base = {(r["model"], r["M"]): r for r in rows if r.get("lora") is None}
    tax = {(r["model"], r["M"], key(r)): r for r in lora_rows}
    cells = []
    for r in rows:  # the bench's order
        if r.get("lora") is None and (r["model"], r["M"]) not in cells:
            cells.append((r["model"], r["M"]))
    setting = f", {columns[0][1]} adapters, share {columns[0][2]}" if one_setting else ""
    print(f"LoRA tax{title}: time with LoRA / time without (floor's ratio){setting}")
    width = max(16, max(len(label(c)) for c in columns) + 2)
    print(f"{'model':16} {'M':>5} {'base_us':>10}" + "".join(f"{label(c):>{width}}" for c in columns))
    for model, M in cells:
        cols = []
        for c in columns:
            r = tax.get((model, M, c))
            # lora_tax null: the cell's row without LoRA failed (quant_bench)
            cols.append("-" if r is None or r["lora_tax"] is None else f"{r['lora_tax']:.3f} ({r['tax_floor']:.3f})")
        print(f"{model:16} {M:>5} {base[(model, M)]['time_us']:>10.1f}" + "".join(f"{x:>{width}}" for x in cols))
    for c in columns:
        taxes = [r["lora_tax"] for r in lora_rows if key(r) == c and r["lora_tax"] is not None]
        if not taxes:
            continue
        geomean = math.exp(sum(math.log(x) for x in taxes) / len(taxes))
        print(f"{label(c)}: tax geomean {geomean:.3f}, min {min(taxes):.3f}, max {max(taxes):.3f} over {len(taxes)} cells")
    errs = [r["rel_err"] for r in lora_rows if r.get("rel_err") is not None]
    if errs:
        print(f"LoRA rows: max rel_err {max(errs):.2e} over {len(errs)} checked rows")


def print_lora_peer(rows):
    """Issue 31's table: per model and M, the base row and each LoRA row against the
    same-run peer (peer_us), their % of the floor, and the points the LoRA row's % of the
    floor trails its base row's; then the issue's counts (within 2% of the peer, within 5
    points of the base at M <= 256, >= 65% of the floor at M >= 4096)."""
    lora_rows = [r for r in rows if r.get("lora") and r.get("peer_us")]
    if not lora_rows:
        return
    base = {(r["model"], r["M"]): r for r in rows if r.get("lora") is None}  # the LoRA grid's own base rows last
    ratio = lambda r: r["time_us"] / r["peer_us"] if r.get("peer_us") else None
    fmt = lambda x: "-" if x is None else f"{x:.2f}"
    # Points the LoRA row's % of the floor trails its base row's (None without a base row).
    pts = lambda r: base[(r["model"], r["M"])]["pct_floor"] - r["pct_floor"] if (r["model"], r["M"]) in base else None
    print("Against the peer (o/p: ours / peer; pts: the LoRA row's % of floor below its base row's)")
    print(f"{'model':16} {'M':>5} {'lora':>12} | {'base_us':>8} {'peer':>8} {'o/p':>5} {'%fl':>5} | "
          f"{'lora_us':>8} {'peer':>8} {'o/p':>5} {'%fl':>5} | {'pts':>5}")
    for r in lora_rows:
        b = base.get((r["model"], r["M"]))
        lora = f"r{r['lora']['rank']} n{r['lora']['adapters']} s{r['lora']['share']}"
        b_cols = (f"{b['time_us']:>8.1f} {(b.get('peer_us') or 0):>8.1f} {fmt(ratio(b)):>5} {b['pct_floor']:>5.1f}"
                  if b else f"{'-':>8} {'-':>8} {'-':>5} {'-':>5}")
        print(f"{r['model']:16} {r['M']:>5} {lora:>12} | {b_cols} | {r['time_us']:>8.1f} {r['peer_us']:>8.1f} "
              f"{fmt(ratio(r)):>5} {r['pct_floor']:>5.1f} | {(f'{pts(r):.1f}' if b else '-'):>5}")
    bases = [b for b in base.values() if b.get("peer_us")]
    if bases:
        print(f"base: within 2% of the peer or faster in {sum(ratio(b) <= 1.02 for b in bases)}/{len(bases)} cells")
    for setting in sorted({(r["lora"]["rank"], r["lora"]["adapters"], r["lora"]["share"]) for r in lora_rows}):
        cells = [r for r in lora_rows if (r["lora"]["rank"], r["lora"]["adapters"], r["lora"]["share"]) == setting]
        small = [r for r in cells if r["M"] <= 256 and pts(r) is not None]
        large = [r for r in cells if r["M"] >= 4096]
        print(f"LoRA r{setting[0]} n{setting[1]} s{setting[2]}: within 2% of the peer or faster in "
              f"{sum(ratio(r) <= 1.02 for r in cells)}/{len(cells)} cells; at M <= 256 within 5 points of the base "
              f"in {sum(pts(r) <= 5 for r in small)}/{len(small)}; "
              f"at M >= 4096 >= 65% of the floor in {sum(r['pct_floor'] >= 65 for r in large)}/{len(large)}")


if __name__ == "__main__":
    main()
