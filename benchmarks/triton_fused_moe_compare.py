#!/usr/bin/env python3
"""Independent comparison: a Triton MoE GEMM with vLLM's `fused_moe` contract.

What it is: our own Triton implementation (written for this project, NOT vLLM's code
and NOT its tuned config tables) of the contract of vLLM's Triton fused MoE path:
`moe_align_block_size` (slots sorted by expert, each expert padded to a multiple of
BLOCK_SIZE_M with the padding value num_slots, one expert id per M-block, and
num_tokens_post_padded) plus `fused_moe_kernel` as `invoke_fused_moe_kernel` launches
it (A rows gathered as A[sorted_id // top_k], C = A @ w[expert]^T written at row
sorted_id, optional routed-weight multiply, grouped raster, fp32 accumulation, bf16 out).
The layer is GEMM1 (w13, [E, 2I, H]) -> silu(gate) * up -> GEMM2 (w2, [E, H, I], routed
weight applied) -> sum over top_k. Only the two GEMM kernels are timed, the way the
issue's independent benchmark counts vLLM ("for vLLM only its two GEMM kernels"):
alignment, activation and the top_k sum run in plain torch and are not timed, whereas
moelora_bench times our whole layer. Each GEMM gets its own small config search per
(model, M) cell (--quick: one heuristic config), so the Triton side is not handicapped;
unlike vLLM, the two GEMMs may even use different BLOCK_SIZE_M (own alignment each).

--scheme fp8_block / fp8_channel (issue 28): the same contract with W8A8 fp8 (e4m3fn) experts,
vLLM's `use_fp8_w8a8` paths, as our own kernel (moe_gemm_fp8_kernel; the kernels are in triton_moe_peer_kernels.py):
  fp8_block (DeepSeek-V3, Qwen3-FP8; vLLM block_shape=[128, 128]): weights [E, N, K] fp8 with
    fp32 scales [E, cdiv(N,128), cdiv(K,128)], one per 128x128 block; activations quantized
    dynamically per token group of 128 (scales [M, cdiv(K,128)]). Each 128-K group's fp8
    products are summed in fp32 (128 / BLOCK_SIZE_K dots), then added to the accumulator
    times a_scale[row, kb] * w_scale[e, n // 128, kb]; BLOCK_SIZE_K divides 128.
  fp8_channel (vLLM per_channel_quant=True): weights per output channel (scales [E, N]),
    activations dynamic per token (scales [M]); the fp32 accumulator is scaled once at the
    end by a_scale[row] * w_scale[e, n].
The layer: quantize x -> GEMM1 -> silu(gate) * up in bf16 -> quantize that the same way ->
GEMM2 (routed weight) -> sum. The weights are the bf16 ones quantized (max-abs / 448 per
block or channel). Quantizing x and the activation is plain torch (moelora::quantize's rule:
scale = max(absmax, 1e-10) / 448, q = saturate(round_to_nearest_even(x / scale))) and is NOT
timed, like the activation: in vLLM it is a separate launch too, so peer_us for fp8 rows is
the two GEMM kernels only. The float32 reference of an fp8 cell multiplies dequantized
weights by the activations quantized the same way (see reference()). Rows carry "quant":
null (bf16) or {"scheme", "group": 128 | null, "zero_point": false}; --ours/--report match
rows on (model, M, scheme), and --report writes the Triton time as the row's peer_us with
peer naming this script (DESIGN.md, "GPU reports").

--lora-rank R [--adapters A --lora-share S] (issue 31): a second row per cell, the layer with
LoRA adapters through our own kernels of vLLM's fused_moe_lora contract (a shrink and an
expand after each GEMM: triton_moe_lora_peer_kernels.py), its peer time the two GEMMs plus
the four LoRA kernels, each searched over per-slot (vLLM's small-batch path) and
(adapter, expert)-aligned configs; rows carry lora {rank, adapters, share} as
moelora_bench's LoRA rows and match them. The (adapter, expert) alignment is plain torch
and not timed, like the base alignment.

Timing mirrors benchmarks/moelora_bench.cpp: per GEMM, one CUDA graph holds the launches
for 4 input rotations (different x and routings, so L2 holds no weights from the launch
before), it is replayed --iters times, each replay timed with CUDA events; the median
replay time / 4 is the GEMM time. Every cell is checked first against a float32 torch
reference of the layer (relative error > 2e-2 aborts).

On the GPU machine (python3 with torch + triton, H100), from the repository root:
  python3 benchmarks/triton_fused_moe_compare.py --model qwen3-30b-a3b --json triton.json \
      [--ours ours.json]            # ours.json from: moelora_bench --model ... --json ours.json
  python3 benchmarks/triton_fused_moe_compare.py --model all --quick --json triton_all.json
  python3 benchmarks/triton_fused_moe_compare.py --model all --scheme fp8_block,fp8_channel --json triton_fp8.json
  python3 benchmarks/triton_fused_moe_compare.py --load triton.json --ours ours.json  # compare only
      [--report reports/gpu/<date>-h100-<sha>-triton.json --commit <sha>]  # both, the brief's keys
Without a GPU: TRITON_INTERPRET=1 python3 benchmarks/triton_fused_moe_compare.py --selftest --device cpu
    [--scheme bf16,fp8_block,fp8_channel]
(triton 3.6's interpreter fails with numpy 2.4, "only 0-dimensional arrays can be converted";
numpy 2.2 works; it loads, casts and multiplies fp8 exactly, so the fp8 kernel runs as is,
but it truncates fp32 -> bf16 stores, which the fp8 reference mirrors there).
--selftest on the GPU runs the same checks on real kernels.
"""
import argparse
import datetime
import json
import math
import os
import subprocess
import sys

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3-30b-a3b", help="NAME[,NAME...] or all")
    p.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192")
    p.add_argument("--quick", action="store_true", help="one heuristic config per M, no search")
    p.add_argument("--scheme", default="bf16", help="SCHEME[,SCHEME...]: bf16 (default), fp8_block "
                   "(W8A8, 128x128 weight blocks, per token group of 128), fp8_channel (W8A8, per output "
                   "channel, per token)")
    p.add_argument("--iters", type=int, default=30, help="timed graph replays per cell and GEMM")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--configs", help="an earlier --json of this script on the same GPU kind: each cell it has runs "
                   "the configs chosen there instead of a search (cells it lacks are searched)")
    p.add_argument("--ours", help="moelora_bench --json output to compare with")
    p.add_argument("--load", help="do not run: read rows from an earlier --json and print/compare")
    p.add_argument("--report", help="with --ours: write a reports/gpu-style JSON (the brief's keys) of both")
    p.add_argument("--commit", default="unknown", help="with --report: sha of the code measured")
    p.add_argument("--machine", default="{}", help="with --report: JSON overriding gpu, driver, cuda, triton, "
                   "torch (for --load on another machine than the one that measured)")
    p.add_argument("--lora-rank", type=int, default=0, help="also time the layer with LoRA at this rank (bf16): "
                   "a row per cell with lora {rank, adapters, share}, its peer time the two GEMMs plus the four "
                   "LoRA kernels (triton_moe_lora_peer_kernels.py)")
    p.add_argument("--adapters", type=int, default=4, help="with --lora-rank: adapters in the batch")
    p.add_argument("--lora-share", type=float, default=1.0, help="with --lora-rank: fraction of tokens with one")
    p.add_argument("--selftest", action="store_true", help="tiny shapes, correctness only")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


ARGS = parse_args()
if ARGS.device == "cpu":  # the interpreter must be chosen before triton.jit runs
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton  # noqa: E402

from graph_timing import time_graph  # noqa: E402
from triton_moe_peer_kernels import (  # noqa: E402  (after the interpreter choice above)
    INTERPRET,
    align_block_size,
    FP8_MAX,
    ABSMAX_FLOOR,
    SCHEMES,
    quant_field,
    scheme_of,
    expand_scales,
    Q8,
    quant_weights,
    quant_act,
    gemm_launcher,
    silu_mul,
    rel_err,
)
from triton_moe_lora_peer_kernels import (  # noqa: E402
    lcfg,
    lora_launchers,
    lora_reference_delta,
    lora_rel_err,
    make_adapters,
    make_routing,
)

# name: (E, top_k, H, I, activation) -- same as kModels in benchmarks/moelora_bench.cpp.
MODELS = {
    "mixtral-8x7b": (8, 2, 4096, 14336, "silu"),
    "qwen3-30b-a3b": (128, 8, 2048, 768, "silu"),
    "qwen3-235b-a22b": (128, 8, 4096, 1536, "silu"),
    "deepseek-v3-tp8": (256, 8, 7168, 256, "silu"),
    "olmoe-1b-7b": (64, 8, 2048, 1024, "silu"),
    # gpt-oss uses a clamped swiglu; the activation is not timed, so the check uses
    # silu(gate) * up on the halves for it too (the GEMMs are identical either way).
    "gpt-oss-120b": (128, 4, 2880, 2880, "swiglu"),
}
ROTATIONS = 4  # input sets per graph, as kRotations in moelora_bench.cpp


def make_inputs(M, E, top_k, H, seed, dev):
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(M, H, generator=g, device=dev).to(torch.bfloat16)
    # top_k distinct experts per token, uniformly at random; softmax weights (positive).
    ids = torch.rand(M, E, generator=g, device=dev).topk(top_k, dim=1).indices.to(torch.int32)
    wts = torch.softmax(torch.randn(M, top_k, generator=g, device=dev), dim=1)
    return x, ids, wts


def cfg(bm, bn, bk, gm, warps, stages):
    return dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=gm,
                num_warps=warps, num_stages=stages)


# Candidate menus, picked by the average rows per expert (M * top_k / E): that, not M
# alone, decides how full a BLOCK_SIZE_M block gets. The first entry is the --quick pick.
MENU_SMALL = [cfg(16, 64, 128, 1, 4, 4), cfg(16, 64, 128, 1, 4, 3), cfg(16, 64, 128, 1, 4, 5),
              cfg(16, 64, 256, 1, 4, 3), cfg(16, 128, 128, 1, 4, 3), cfg(16, 128, 128, 1, 4, 4),
              cfg(16, 128, 256, 1, 4, 3)]
MENU_MID = [cfg(32, 128, 64, 1, 4, 4), cfg(32, 64, 128, 1, 4, 4), cfg(32, 128, 128, 1, 4, 3),
            cfg(64, 64, 64, 1, 4, 4), cfg(64, 128, 64, 1, 4, 4), cfg(64, 128, 64, 16, 4, 3),
            cfg(64, 128, 128, 1, 8, 3), cfg(64, 256, 64, 1, 8, 3)]
MENU_LARGE = [cfg(128, 128, 64, 16, 8, 3), cfg(64, 128, 64, 1, 4, 4), cfg(64, 128, 64, 16, 8, 4),
              cfg(128, 128, 64, 1, 8, 3), cfg(128, 128, 64, 16, 8, 4), cfg(128, 256, 64, 1, 8, 3),
              cfg(128, 256, 64, 16, 8, 3), cfg(64, 256, 64, 16, 8, 3)]


# fp8 (both schemes): BLOCK_SIZE_K divides 128 (fp8_block's K group; a smaller one takes
# 128 / BLOCK_SIZE_K dots per group before the scales), and an fp8 stage is half the bytes
# of a bf16 one, so K tiles are twice as long as in the bf16 menus.
MENU_FP8_SMALL = [cfg(16, 64, 128, 1, 4, 4), cfg(16, 64, 128, 1, 4, 3), cfg(16, 64, 128, 1, 4, 5),
                  cfg(16, 128, 128, 1, 4, 3), cfg(16, 128, 128, 1, 4, 4), cfg(16, 32, 128, 1, 4, 4),
                  cfg(16, 64, 64, 1, 4, 4)]
MENU_FP8_MID = [cfg(32, 128, 128, 1, 4, 4), cfg(32, 64, 128, 1, 4, 4), cfg(32, 128, 128, 1, 4, 3),
                cfg(64, 64, 128, 1, 4, 4), cfg(64, 128, 128, 1, 4, 4), cfg(64, 128, 128, 16, 4, 3),
                cfg(64, 128, 128, 1, 8, 3), cfg(64, 256, 128, 1, 8, 3)]
MENU_FP8_LARGE = [cfg(128, 128, 128, 16, 8, 3), cfg(64, 128, 128, 1, 4, 4), cfg(64, 128, 128, 16, 8, 4),
                  cfg(128, 128, 128, 1, 8, 3), cfg(128, 128, 128, 16, 8, 4), cfg(128, 256, 128, 1, 8, 3),
                  cfg(128, 256, 128, 16, 8, 3), cfg(64, 256, 128, 16, 8, 3)]


def menu_for(M, E, top_k, quick, scheme="bf16"):
    per_expert = M * top_k / E
    if SCHEMES[scheme] is None:
        menu = MENU_SMALL if per_expert <= 16 else MENU_MID if per_expert <= 128 else MENU_LARGE
    else:
        menu = MENU_FP8_SMALL if per_expert <= 16 else MENU_FP8_MID if per_expert <= 128 else MENU_FP8_LARGE
    return menu[:1] if quick else menu


def tune(name, menu, make_launches, iters):
    """Times every candidate briefly, then the best one with the full --iters."""
    if len(menu) == 1:
        return menu[0], time_graph(make_launches(menu[0]), iters)
    best = None
    for c in menu:
        try:
            us = time_graph(make_launches(c), max(5, iters // 3))
        except Exception as e:  # e.g. out of shared memory for this tile/stage count
            print(f"    {name} skip {c}: {type(e).__name__}: {str(e)[:80]}")
            continue
        if best is None or us < best[1]:
            best = (c, us)
    if best is None:
        raise RuntimeError(f"{name}: no candidate config ran")
    return best[0], time_graph(make_launches(best[0]), iters)


def chosen_configs(args, name, M, scheme, lora):
    """The row of --configs for this cell, or None."""
    return args.chosen.get(cell_key(dict(model=name, M=M, quant=quant_field(scheme), lora=lora)))


def bench_cell(name, M, w13, w2, args, scheme="bf16"):
    """w13, w2: the scheme's weights (quant_weights). Inputs are quantized outside the graphs."""
    E, top_k, H, I, _ = MODELS[name]
    dev = w13.q.device if isinstance(w13, Q8) else w13.device
    rots = [make_inputs(M, E, top_k, H, 1000 + 31 * r + M, dev) for r in range(ROTATIONS)]
    menu1 = menu2 = menu_for(M, E, top_k, args.quick, scheme)
    earlier = chosen_configs(args, name, M, scheme, None)
    if earlier:
        menu1, menu2 = [earlier["gemm1_config"]], [earlier["gemm2_config"]]
    # Correctness before timing, with the heuristic (or earlier) configs.
    x0, ids0, wts0 = rots[0]
    err = rel_err(x0, w13, w2, ids0, wts0, menu1[0], menu2[0], scheme)
    if not err <= 2e-2:
        sys.exit(f"FAILED: {name} {scheme} M={M} rel_err {err:.3e} > 2e-2 (configs {menu1[0]} / {menu2[0]})")
    xs = [quant_act(x, scheme) for x, _, _ in rots]
    c1 = [torch.empty(M * top_k, 2 * I, dtype=torch.bfloat16, device=dev) for _ in rots]
    c2 = [torch.empty(M * top_k, H, dtype=torch.bfloat16, device=dev) for _ in rots]
    aligns = {}

    def align(r, bm):  # cached: the captured graph keeps pointing at these tensors
        if (r, bm) not in aligns:
            aligns[r, bm] = align_block_size(rots[r][1], E, bm)
        return aligns[r, bm]

    def launches1(c):
        return [gemm_launcher(xs[r], w13, c1[r], align(r, c["BLOCK_SIZE_M"]), top_k, c)
                for r in range(len(rots))]

    cfg1, us1 = tune("gemm1", menu1, launches1, args.iters)
    for f in launches1(cfg1):  # GEMM2's real input: the activation of GEMM1's output
        f()
    acts = [quant_act(silu_mul(c), scheme) for c in c1]
    flat_w = [w.reshape(-1).contiguous() for _, _, w in rots]

    def launches2(c):
        return [gemm_launcher(acts[r], w2, c2[r], align(r, c["BLOCK_SIZE_M"]), 1, c, flat_w[r])
                for r in range(len(rots))]

    cfg2, us2 = tune("gemm2", menu2, launches2, args.iters)
    if (cfg1, cfg2) != (menu1[0], menu2[0]):  # the winners are checked too
        err = max(err, rel_err(x0, w13, w2, ids0, wts0, cfg1, cfg2, scheme))
        if not err <= 2e-2:
            sys.exit(f"FAILED: {name} {scheme} M={M} rel_err {err:.3e} > 2e-2 ({cfg1} / {cfg2})")
    row = dict(model=name, M=M, quant=quant_field(scheme), lora=None, gemm1_us=us1, gemm2_us=us2,
               two_gemm_us=us1 + us2, gemm1_config=cfg1, gemm2_config=cfg2, rel_err=err)
    if not args.lora_rank:
        return [row]
    if scheme != "bf16":
        sys.exit("--lora-rank: bf16 experts only")
    return [row, bench_lora_cell(name, M, w13, w2, rots, acts, c1, c2, row, args)]


# LoRA kernel menus (mode, BLOCK_SIZE_M, BLOCK_SIZE_K of the shrink / BLOCK_SIZE_N of the
# expand): per slot (vLLM's small-batch path) and aligned by (adapter, expert).
LORA_SHRINK_MENU = [lcfg("per_slot", 16, 64), lcfg("per_slot", 16, 128), lcfg("aligned", 16, 64),
                    lcfg("aligned", 32, 64), lcfg("aligned", 64, 64), lcfg("aligned", 64, 128, 8, 3)]
LORA_EXPAND_MENU = [lcfg("per_slot", 16, 64), lcfg("per_slot", 16, 128), lcfg("aligned", 16, 128),
                    lcfg("aligned", 32, 128), lcfg("aligned", 64, 128), lcfg("aligned", 64, 256, 8, 3)]


def lora_quick(M, E, top_k, args):
    """The --quick pick: per slot below one slot an (adapter, expert) group, else aligned
    blocks sized to the groups' fill."""
    per_group = M * top_k * args.lora_share / (E * args.adapters)
    bm = 16 if per_group <= 16 else 32 if per_group <= 64 else 64
    mode = "per_slot" if per_group < 1 else "aligned"
    return lcfg(mode, 16 if mode == "per_slot" else bm, 64), lcfg(mode, 16 if mode == "per_slot" else bm, 128)


def bench_lora_cell(name, M, w13, w2, rots, acts, c1, c2, base, args):
    """The LoRA row of a cell: the base GEMMs' times plus the four LoRA kernels (GEMM1's
    shrink and expand on gate/up, GEMM2's on the activation, routed weight applied), each
    tuned over its menu; checked against the float32 reference first."""
    E, top_k, H, I, _ = MODELS[name]
    dev = w13.device
    rank, L = args.lora_rank, args.adapters
    adapters = [make_adapters(L, E, H, I, rank, M, args.lora_share, 2000 + 17 * r + M, dev) for r in range(len(rots))]
    quick = lora_quick(M, E, top_k, args)
    x0, ids0, wts0 = rots[0]
    err = lora_rel_err(x0, w13, w2, ids0, wts0, adapters[0], base["gemm1_config"], base["gemm2_config"], quick * 2)
    if not err <= 2e-2:
        sys.exit(f"FAILED: {name} M={M} LoRA rank {rank}: rel_err {err:.3e} > 2e-2 ({quick})")
    routings = [make_routing(ids, a["token_lora"], a["scale"], E) for (_, ids, _), a in zip(rots, adapters)]
    inter1 = [torch.empty(2, M * top_k, rank, dtype=torch.bfloat16, device=dev) for _ in rots]
    inter2 = [torch.empty(1, M * top_k, rank, dtype=torch.bfloat16, device=dev) for _ in rots]
    flat_w = [w.reshape(-1).contiguous() for _, _, w in rots]

    def launches(gemm, which, shrink_cfg, expand_cfg):
        out = []
        for r, ((x, _, _), a) in enumerate(zip(rots, adapters)):
            if gemm == 1:
                pair = lora_launchers(x, a["a13"], a["b13"], c1[r], inter1[r], routings[r], top_k, top_k, shrink_cfg,
                                      expand_cfg)
            else:
                pair = lora_launchers(acts[r], a["a2"], a["b2"], c2[r], inter2[r], routings[r], top_k, 1, shrink_cfg,
                                      expand_cfg, flat_w[r])
            out.append(pair[which])
        return out

    earlier = chosen_configs(args, name, M, "bf16", {"rank": rank, "adapters": L, "share": args.lora_share})
    chosen, times = [], {}
    for gemm in (1, 2):
        for which, menu in ((0, LORA_SHRINK_MENU), (1, LORA_EXPAND_MENU)):
            menu = [quick[which]] if args.quick else menu
            if earlier:
                menu = [earlier["lora_configs"][len(chosen)]]
            # The expand reads the shrink's output: the shrink of the pick runs first.
            pick = chosen[-1] if which == 1 else None

            def make(c, gemm=gemm, which=which, pick=pick):
                if which == 0:
                    return launches(gemm, 0, c, quick[1])
                for f in launches(gemm, 0, pick, quick[1]):
                    f()
                return launches(gemm, 1, pick, c)
            c, us = tune(f"lora{gemm} {'shrink' if which == 0 else 'expand'}", menu, make, args.iters)
            chosen.append(c)
            times[f"lora{gemm}_{'shrink' if which == 0 else 'expand'}_us"] = us
    if tuple(chosen) != quick * 2:
        err = max(err, lora_rel_err(x0, w13, w2, ids0, wts0, adapters[0], base["gemm1_config"],
                                    base["gemm2_config"], chosen))
        if not err <= 2e-2:
            sys.exit(f"FAILED: {name} M={M} LoRA rank {rank}: rel_err {err:.3e} > 2e-2 ({chosen})")
    lora_us = sum(times.values())
    return dict(base, lora={"rank": rank, "adapters": L, "share": args.lora_share}, two_gemm_us=base["two_gemm_us"]
                + lora_us, base_two_gemm_us=base["two_gemm_us"], lora_us=lora_us, lora_configs=chosen,
                rel_err=err, **times)


def geomean(values):
    return math.exp(sum(map(math.log, values)) / len(values))


def short(c):
    return "{BLOCK_SIZE_M}x{BLOCK_SIZE_N}x{BLOCK_SIZE_K} g{GROUP_SIZE_M} w{num_warps} s{num_stages}".format(**c)


def kind_of(row):
    """The scheme, with "+lora" for LoRA rows: the geomeans are kept apart."""
    return scheme_of(row) + ("+lora" if row.get("lora") else "")


PEER = "triton-fused-moe (benchmarks/triton_fused_moe_compare.py: our Triton kernel of vLLM's fused_moe contract)"


def cell_key(row):
    """Rows of ours and of this script are matched on (model, M, quantization scheme, LoRA
    rank, adapters and share; None for the base layer)."""
    lora = row.get("lora")
    lora = None if not lora else (int(lora["rank"]), int(lora["adapters"]), float(lora["share"]))
    return row["model"], int(row["M"]), scheme_of(row), lora


def load_ours(ours_path):
    """moelora_bench --json rows of the layer, base and LoRA (--lora-rank)."""
    with open(ours_path) as f:
        data = json.load(f)
    rows = data["rows"] if isinstance(data, dict) else data
    return data, [r for r in rows if r.get("op", "fused_experts") == "fused_experts"]


def report(rows, ours_path):
    ours = {}
    if ours_path:
        for r in load_ours(ours_path)[1]:
            ours[cell_key(r)] = float(r["time_us"])
    print(f"\n{'model':<16} {'scheme':<11} {'M':>5} {'gemm1':>9} {'gemm2':>9} {'triton2':>9} {'ours':>9} "
          f"{'speedup':>8}  rel_err   configs (gemm1 | gemm2)")
    ratios = {}
    for r in rows:
        o = ours.get(cell_key(r))
        su = r["two_gemm_us"] / o if o else None
        if su:
            ratios.setdefault(kind_of(r), []).append(su)
        print(f"{r['model']:<16} {kind_of(r):<11} {r['M']:>5} {r['gemm1_us']:>9.1f} {r['gemm2_us']:>9.1f} "
              f"{r['two_gemm_us']:>9.1f} {(f'{o:.1f}' if o else '-'):>9} {(f'x{su:.2f}' if su else '-'):>8}  "
              f"{r['rel_err']:.1e}  {short(r['gemm1_config'])} | {short(r['gemm2_config'])}")
    if ours_path:
        if ratios:
            for sch, rs in ratios.items():
                print(f"speed-up ours vs triton two-GEMM, {sch} (triton_us / ours_us, >1 = ours faster): "
                      f"geomean x{geomean(rs):.3f} over {len(rs)} cells")
        else:
            print("no cell of --ours matches (model, M, scheme) of these rows")


def write_report(rows, ours_path, path, commit):
    """Our rows (moelora_bench --json) with the Triton times of the same cells merged in
    (peer_us, with peer naming it, and the triton_* details), plus the geomean speed-up and
    the roofline bound on it: triton_us / floor_us is the speed-up our layer would have at
    100% of its floor. Cells match on (model, M, quantization scheme)."""
    ours, ours_rows = load_ours(ours_path)
    triton_rows = {cell_key(r): r for r in rows}
    merged, speedups, bounds, by_scheme = [], [], [], {}
    for o in ours_rows:
        t = triton_rows.get(cell_key(o))
        if t is None:
            continue
        row = dict(o)
        row.update(peer_us=t["two_gemm_us"], peer=PEER,
                   triton_gemm1_us=t["gemm1_us"], triton_gemm2_us=t["gemm2_us"],
                   triton_two_gemm_us=t["two_gemm_us"], triton_rel_err=t["rel_err"],
                   triton_configs=[short(t["gemm1_config"]), short(t["gemm2_config"])],
                   speedup_vs_triton=t["two_gemm_us"] / o["time_us"],
                   roofline_speedup_vs_triton=t["two_gemm_us"] / o["floor_us"])
        speedups.append(row["speedup_vs_triton"])
        bounds.append(row["roofline_speedup_vs_triton"])
        if t.get("lora"):
            row.update(triton_lora_us=t["lora_us"], triton_base_two_gemm_us=t["base_two_gemm_us"],
                       triton_lora_configs=t["lora_configs"])
        by_scheme.setdefault(kind_of(o), []).append(row["speedup_vs_triton"])
        merged.append(row)
    machine = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "unknown",
               "cuda": torch.version.cuda, "triton": triton.__version__, "torch": torch.__version__}
    try:
        machine["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True).stdout.strip().splitlines()[0]
    except (OSError, IndexError):
        machine["driver"] = "unknown"
    machine.update(json.loads(ARGS.machine))
    report = {
        "commit": commit, "date": datetime.date.today().isoformat(), "gpu": machine["gpu"],
        "driver": machine["driver"], "cuda": machine["cuda"], "triton": machine["triton"], "torch": machine["torch"],
        "ceilings": ours.get("ceilings") if isinstance(ours, dict) else None,
        "tests": None,
        "tests_note": "no test suite in this run (a measurement); every Triton cell is checked "
                      "against a float32 torch reference (rel_err <= 2e-2)",
        "comparison": {
            "what": "time_us: our whole layer (align to reduce); peer_us = triton_two_gemm_us: the two GEMM "
                    "kernels of our Triton implementation of vLLM's fused_moe contract, config "
                    "searched per cell and GEMM (benchmarks/triton_fused_moe_compare.py); for fp8 "
                    "schemes the quantization of x and of the activation is not in peer_us "
                    "(separate launches in vLLM too)",
            "cells": len(merged), "geomean_speedup": geomean(speedups) if speedups else None,
            "min_speedup": min(speedups, default=None), "max_speedup": max(speedups, default=None),
            "cells_slower": sum(s < 1 for s in speedups),
            "geomean_roofline_speedup": geomean(bounds) if bounds else None,
            "geomean_speedup_by_scheme": {k: geomean(v) for k, v in by_scheme.items()},
        },
        "rows": merged,
    }
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")


def check_quantize(dev):
    """quantize_fp8 against its rule: scale shapes, per block max |q| = 448 (all-zero blocks:
    q = 0 and the floor scale), and |q * scale - x| within half an fp8 step of x / scale."""
    g = torch.Generator(device=dev).manual_seed(3)
    x = torch.randn(5, 300, generator=g, device=dev) * torch.logspace(-4, 3, 5, device=dev)[:, None]
    x[2] = 0.0
    w = torch.randn(2, 200, 300, generator=g, device=dev)
    w[1, 128:, 256:] = 0.0  # one all-zero (partial) block
    for t, br, bc, shape in ((x, 1, 128, (5, 3)), (x, 1, 0, (5, 1)), (w, 128, 128, (2, 2, 3)), (w, 1, 0, (2, 200, 1))):
        q = Q8(t, br, bc, per_leading=t.dim() == 3)
        assert tuple(q.s.shape) == shape, f"scales {tuple(q.s.shape)} != {shape}"
        R, C = t.shape[-2:]
        v = t / expand_scales(q.s, br or R, bc or C, R, C)
        bound = torch.maximum(v.abs() * 2.0 ** -4, torch.full_like(v, 2.0 ** -10)) * (1 + 1e-6) + 1e-6
        assert ((q.q.float() - v).abs() <= bound).all(), "quantize_fp8: an element is off by more than half a step"
        qa = q.q.float().abs()
        pad = torch.nn.functional.pad(qa, (0, -C % (bc or C), 0, -R % (br or R)))
        blk_max = pad.reshape(*q.s.shape[:-2], q.s.shape[-2], br or R, q.s.shape[-1], bc or C).amax(dim=(-3, -1))
        zero = q.s == ABSMAX_FLOOR / FP8_MAX
        assert ((blk_max == FP8_MAX) | zero).all() and (blk_max[zero] == 0).all(), "quantize_fp8: block max != 448"
        assert zero.any() == (t is x or bc == 128), "quantize_fp8: the all-zero block was not found"
    print("selftest quantize_fp8: scales, saturation and rounding bound ok")


def selftest(dev, scheme="bf16"):
    """Tiny shapes, correctness only (runs under TRITON_INTERPRET=1 on the CPU)."""
    torch.manual_seed(0)
    fp8 = SCHEMES[scheme] is not None
    if not fp8:
        # E, top_k, H, I, M: the 2nd has ragged N and K; in the 3rd every padded block is real,
        # so the grouped raster's last, partial group is exercised.
        cases = [(4, 2, 64, 32, 5), (8, 3, 80, 48, 37), (2, 2, 80, 48, 33)]
        cfgs = [cfg(16, 32, 32, 1, 4, 2), cfg(16, 64, 128, 4, 4, 2), cfg(32, 16, 16, 4, 4, 2), cfg(16, 32, 64, 2, 4, 2)]
    else:
        check_quantize(dev)
        # fp8: several 128-groups on N and K, the last one partial (1st: GEMM1 N 320, K 272;
        # GEMM2 N 272, K 160), K a multiple of 128 (2nd), K < 128 (3rd); BLOCK_SIZE_K 32 and 64
        # take 4 and 2 dots per K group, BLOCK_SIZE_N 256 spans two N groups.
        cases = [(4, 2, 272, 160, 9), (2, 2, 256, 128, 33), (8, 3, 80, 48, 37)]
        cfgs = [cfg(16, 32, 32, 1, 4, 2), cfg(16, 64, 128, 4, 4, 2), cfg(32, 16, 64, 4, 4, 2),
                cfg(16, 256, 128, 2, 4, 2)]
    # GEMMs alone: exact products, so only summation order differs (1e-5), except fp8 on the
    # GPU: on sm_90 Triton's fp8 dot keeps Hopper's reduced-precision accumulation
    # (max_num_imprecise_acc defaults to 2**30 there, as vLLM launches it), so 1e-3 there;
    # a wrong scale or row index costs >= 6e-2 on these cases.
    gemm_tol = 1e-3 if fp8 and not INTERPRET else 1e-5
    worst = 0.0
    for E, top_k, H, I, M in cases:
        w13 = quant_weights((0.05 * torch.randn(E, 2 * I, H, device=dev)).to(torch.bfloat16), scheme)
        w2 = quant_weights((0.05 * torch.randn(E, H, I, device=dev)).to(torch.bfloat16), scheme)
        x, ids, wts = make_inputs(M, E, top_k, H, 7, dev)
        s, e_ids, ntpp = align_block_size(ids, E, 16)  # every slot exactly once, right expert
        real = s[s < M * top_k].long()
        assert sorted(real.tolist()) == list(range(M * top_k)), "alignment lost or duplicated a slot"
        blk_of = (s < M * top_k).nonzero().squeeze(1) // 16
        assert torch.equal(e_ids[blk_of].long(), ids.reshape(-1)[real].long()), "slot in wrong expert block"
        assert int(ntpp) % 16 == 0
        # Exact indexing check: each GEMM alone with a float32 C against torch per slot
        # (the interpreter truncates fp32 -> bf16 stores, so the layer check is looser).
        # fp8: torch multiplies the dequantized operands, so the scales' indexing is checked too.
        slots, flat = torch.arange(M * top_k, device=dev), ids.reshape(-1).long()
        xin = quant_act(x, scheme)
        w13f, w2f = (w13.dequant(), w2.dequant()) if fp8 else (w13.float(), w2.float())
        ref1 = torch.einsum("sh,sih->si", (xin.dequant() if fp8 else x.float())[slots // top_k], w13f[flat])
        act = quant_act(silu_mul(ref1.to(x.dtype)), scheme)
        ref2 = torch.einsum("si,shi->sh", act.dequant() if fp8 else act.float(), w2f[flat]) * wts.reshape(-1, 1)
        for c in cfgs:
            al = align_block_size(ids, E, c["BLOCK_SIZE_M"])
            out1 = torch.zeros_like(ref1)
            gemm_launcher(xin, w13, out1, al, top_k, c)()
            out2 = torch.zeros_like(ref2)
            gemm_launcher(act, w2, out2, al, 1, c, wts.reshape(-1).contiguous())()
            e1, e2 = [((o - r).norm() / r.norm()).item() for o, r in ((out1, ref1), (out2, ref2))]
            print(f"selftest {scheme} GEMMs alone, fp32 C, {short(c)}: rel_err {e1:.1e} / {e2:.1e}")
            if not max(e1, e2) <= gemm_tol:
                sys.exit("selftest FAILED (GEMM indexing)")
        for c1 in cfgs:
            for c2 in cfgs[::-1][:2]:
                err = rel_err(x, w13, w2, ids, wts, c1, c2, scheme)
                worst = max(worst, err)
                print(f"selftest {scheme} E={E} top_k={top_k} H={H} I={I} M={M} {short(c1)} | {short(c2)}: "
                      f"rel_err {err:.2e}")
                if not err <= 2e-2:
                    sys.exit("selftest FAILED")
    if not fp8:
        worst = max(worst, selftest_lora(dev))
    print(f"selftest {scheme} passed (worst rel_err {worst:.2e})")


def selftest_lora(dev):
    """The LoRA kernels in both modes (per slot, aligned by adapter and expert) against the
    float32 reference, with tokens of no adapter, a rank below the padded 16 and ragged N;
    the alignment's slots and blocks checked exactly."""
    worst = 0.0
    for E, top_k, H, I, M, L, rank, share in ((3, 2, 64, 48, 9, 2, 8, 0.7), (4, 2, 80, 48, 21, 3, 16, 1.0)):
        w13 = (0.05 * torch.randn(E, 2 * I, H, device=dev)).to(torch.bfloat16)
        w2 = (0.05 * torch.randn(E, H, I, device=dev)).to(torch.bfloat16)
        x, ids, wts = make_inputs(M, E, top_k, H, 9, dev)
        adapters = make_adapters(L, E, H, I, rank, M, share, 3, dev)
        routing = make_routing(ids, adapters["token_lora"], adapters["scale"], E)
        s, b_exp, b_lora, ntpp = routing["aligned"](16)
        lora_of = adapters["token_lora"].long().repeat_interleave(top_k)
        real = s[s < M * top_k].long()
        assert sorted(real.tolist()) == (lora_of >= 0).nonzero().squeeze(1).tolist(), "LoRA alignment lost a slot"
        blk = (s < M * top_k).nonzero().squeeze(1) // 16
        assert torch.equal(b_exp[blk].long(), ids.reshape(-1)[real].long()) and \
            torch.equal(b_lora[blk].long(), lora_of[real]), "LoRA alignment: slot in a wrong block"
        # Each GEMM's shrink + expand alone into fp32 C and fp32 inter: exact products, so
        # only summation order differs (the GPU rounds inter to bf16 before the expand's dot).
        slots = M * top_k
        token_of, expert_of = torch.arange(slots, device=dev) // top_k, ids.reshape(-1).long()
        act = (0.5 * torch.randn(slots, I, device=dev)).to(torch.bfloat16)
        tol = 1e-5 if INTERPRET else 1e-2
        for mode, bm in (("per_slot", 16), ("aligned", 16), ("aligned", 32)):
            for inp, a, b, rows_per_token, topk_w, width, rows in (
                    (x, "a13", "b13", top_k, None, 2 * I, token_of),
                    (act, "a2", "b2", 1, wts.reshape(-1).contiguous(), H, torch.arange(slots, device=dev))):
                c = torch.zeros(slots, width, device=dev)
                inter = torch.empty(adapters[a].shape[0], slots, rank, device=dev)
                for launch in lora_launchers(inp, adapters[a], adapters[b], c, inter, routing, top_k, rows_per_token,
                                             lcfg(mode, bm, 32), lcfg(mode, bm, 32), topk_w):
                    launch()
                ref = lora_reference_delta(inp, adapters[a], adapters[b], adapters["scale"], rows, lora_of,
                                           expert_of)
                if topk_w is not None:
                    ref = ref * topk_w[:, None]
                e = ((c - ref).norm() / ref.norm()).item()
                print(f"selftest lora kernels alone ({a}, {mode} bm={bm}), fp32 C: rel_err {e:.1e}")
                if not e <= tol:
                    sys.exit("selftest FAILED (LoRA kernel indexing)")
        base = cfg(16, 32, 32, 1, 4, 2)
        for mode, bm in (("per_slot", 16), ("aligned", 16), ("aligned", 32)):
            cfgs = (lcfg(mode, bm, 32), lcfg(mode, bm, 32), lcfg(mode, bm, 64), lcfg(mode, bm, 16))
            err = lora_rel_err(x, w13, w2, ids, wts, adapters, base, base, cfgs)
            worst = max(worst, err)
            print(f"selftest lora E={E} M={M} adapters={L} rank={rank} share={share} {mode} bm={bm}: rel_err {err:.2e}")
            if not err <= 2e-2:
                sys.exit("selftest FAILED (LoRA)")
    return worst


def main(args):
    schemes = args.scheme.split(",")
    for sch in schemes:
        if sch not in SCHEMES:
            sys.exit(f"unknown scheme {sch}; known: {', '.join(SCHEMES)}")
    if args.selftest:
        for sch in schemes:
            selftest(args.device, sch)
        return
    if args.report and not args.ours:
        sys.exit("--report needs --ours")
    if args.load:
        with open(args.load) as f:
            rows = json.load(f)
        report(rows, args.ours)
        if args.report:
            write_report(rows, args.ours, args.report, args.commit)
        return
    if args.device != "cuda":
        sys.exit("timing needs --device cuda (use --selftest for the CPU interpreter)")
    names = list(MODELS) if args.model == "all" else args.model.split(",")
    for n in names:
        if n not in MODELS:
            sys.exit(f"unknown model {n}; known: {', '.join(MODELS)}")
    tokens = [int(t) for t in args.tokens.split(",")]
    args.chosen = {}
    if args.configs:
        with open(args.configs) as f:
            args.chosen = {cell_key(r): r for r in json.load(f)}
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference is true float32
    print(f"triton {triton.__version__} torch {torch.__version__} on {torch.cuda.get_device_name()}"
          f" | {'quick heuristic configs' if args.quick else 'per-cell config search'}"
          f"{f' (configs of {args.configs} where it has the cell)' if args.configs else ''}")
    rows = []
    for name in names:
        E, top_k, H, I, _ = MODELS[name]
        g = torch.Generator(device="cuda").manual_seed(11)
        # Weights ~ N(0, 0.02) as in moelora_bench; w13 rows 0..I-1 gate, I..2I-1 up.
        w13 = torch.randn(E, 2 * I, H, generator=g, device="cuda", dtype=torch.bfloat16).mul_(0.02)
        w2 = torch.randn(E, H, I, generator=g, device="cuda", dtype=torch.bfloat16).mul_(0.02)
        for sch in schemes:
            # fp8: the same bf16 weights quantized (128x128 blocks or per output channel).
            qw13, qw2 = quant_weights(w13, sch), quant_weights(w2, sch)
            for M in tokens:
                for row in bench_cell(name, M, qw13, qw2, args, sch):
                    rows.append(row)
                    label = f"+lora r={row['lora']['rank']}" if row["lora"] else sch
                    print(f"{name:<16} {label:<11} M={M:<5} gemm1 {row['gemm1_us']:8.1f} us  gemm2 "
                          f"{row['gemm2_us']:8.1f} us  peer {row['two_gemm_us']:8.1f} us  rel_err {row['rel_err']:.1e}  "
                          f"[{short(row['gemm1_config'])} | {short(row['gemm2_config'])}]", flush=True)
                if args.json:  # rewritten per cell so a cut-off run keeps what it measured
                    with open(args.json, "w") as f:
                        json.dump(rows, f, indent=1)
            del qw13, qw2
            torch.cuda.empty_cache()
        del w13, w2
        torch.cuda.empty_cache()
    report(rows, args.ours)
    if args.report:
        write_report(rows, args.ours, args.report, args.commit)


if __name__ == "__main__":
    main(ARGS)
