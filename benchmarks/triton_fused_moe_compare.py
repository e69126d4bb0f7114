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
vLLM's `use_fp8_w8a8` paths, as our own kernel (moe_gemm_fp8_kernel):
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
import statistics
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
    p.add_argument("--ours", help="moelora_bench --json output to compare with")
    p.add_argument("--load", help="do not run: read rows from an earlier --json and print/compare")
    p.add_argument("--report", help="with --ours: write a reports/gpu-style JSON (the brief's keys) of both")
    p.add_argument("--commit", default="unknown", help="with --report: sha of the code measured")
    p.add_argument("--machine", default="{}", help="with --report: JSON overriding gpu, driver, cuda, triton, "
                   "torch (for --load on another machine than the one that measured)")
    p.add_argument("--selftest", action="store_true", help="tiny shapes, correctness only")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


ARGS = parse_args()
if ARGS.device == "cpu":  # the interpreter must be chosen before triton.jit runs
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

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


@triton.jit
def grouped_tile(EM, N, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, GROUP_SIZE_M: tl.constexpr):
    """(pid_m, pid_n) of this program in the grouped raster: GROUP_SIZE_M consecutive
    M-blocks sweep N together so their B tiles (one expert's weights when the blocks share
    an expert) are reused from L2."""
    pid = tl.program_id(0)
    blocks_m = tl.cdiv(EM, BLOCK_SIZE_M)
    blocks_n = tl.cdiv(N, BLOCK_SIZE_N)
    per_group = GROUP_SIZE_M * blocks_n
    first_m = (pid // per_group) * GROUP_SIZE_M
    rows_in_group = tl.minimum(blocks_m - first_m, GROUP_SIZE_M)
    return first_m + (pid % per_group) % rows_in_group, (pid % per_group) // rows_in_group


@triton.jit
def load_k_step(a_ptrs, b_ptrs, valid, ks, k_left, EVEN_K: tl.constexpr):
    """One K step's A tile (rows of padding slots zero) and B tile; k_left = K minus the
    step's first k masks the last step unless EVEN_K."""
    if EVEN_K:
        a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
        b = tl.load(b_ptrs)
    else:
        k_ok = ks < k_left
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
    return a, b


@triton.jit
def store_slots(c_ptr, acc, slot, valid, cols, N, topk_w_ptr, stride_cm, stride_cn, MUL_ROUTED_WEIGHT: tl.constexpr):
    """The tile's rows into their slots of C (times the routed weight), padding rows skipped."""
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(topk_w_ptr + slot, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + slot[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < N))


@triton.jit
def moe_gemm_kernel(a_ptr, b_ptr, c_ptr, topk_w_ptr, sorted_ids_ptr, expert_ids_ptr, ntpp_ptr,
                    N, K, EM, num_slots,
                    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
                    GROUP_SIZE_M: tl.constexpr, TOP_K: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
                    EVEN_K: tl.constexpr, DOT_F32: tl.constexpr):
    pid_m, pid_n = grouped_tile(EM, N, BLOCK_SIZE_M, BLOCK_SIZE_N, GROUP_SIZE_M)
    # The grid is sized for the worst case (graph-capturable); blocks past the padded
    # total of this routing have nothing to do.
    if pid_m * BLOCK_SIZE_M >= tl.load(ntpp_ptr):
        return
    slot = tl.load(sorted_ids_ptr + pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)).to(tl.int64)
    valid = slot < num_slots  # padding entries hold num_slots
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    cols_b = (cols % N).to(tl.int64)  # wrap: B loads stay in bounds without a mask
    ks = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = a_ptr + (slot // TOP_K)[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + cols_b[None, :] * stride_bn + ks[:, None] * stride_bk
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        a, b = load_k_step(a_ptrs, b_ptrs, valid, ks, K - k * BLOCK_SIZE_K, EVEN_K)
        if DOT_F32:  # interpreter only: its tl.dot multiplies bf16 as raw uint16 bits
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk
    store_slots(c_ptr, acc, slot, valid, cols, N, topk_w_ptr, stride_cm, stride_cn, MUL_ROUTED_WEIGHT)



@triton.jit
def moe_gemm_fp8_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, topk_w_ptr, sorted_ids_ptr,
                        expert_ids_ptr, ntpp_ptr, N, K, EM, num_slots,
                        stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                        stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
                        GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
                        BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
                        GROUP_SIZE_M: tl.constexpr, TOP_K: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
                        EVEN_K: tl.constexpr):
    # W8A8 fp8 variant of moe_gemm_kernel (same raster, gather and scatter). A is fp8
    # [num_tokens, K] with fp32 scales a_scale, B fp8 [E, N, K] with fp32 scales b_scale.
    #   GROUP_K > 0 (block-wise): a_scale [num_tokens, cdiv(K, GROUP_K)] (one per token
    #     and K group), b_scale [E, cdiv(N, GROUP_N), cdiv(K, GROUP_K)]. Each K group's fp8
    #     products are summed into a fresh fp32 partial (GROUP_K // BLOCK_SIZE_K dots),
    #     which is then added to the accumulator times a_scale[row, kb] * b_scale[e, n // GROUP_N, kb].
    #   GROUP_K == 0 (per channel): a_scale [num_tokens] (per token), b_scale [E, N]; one
    #     fp32 accumulator over all of K, scaled once at the end by a_scale[row] * b_scale[e, n].
    pid_m, pid_n = grouped_tile(EM, N, BLOCK_SIZE_M, BLOCK_SIZE_N, GROUP_SIZE_M)
    if pid_m * BLOCK_SIZE_M >= tl.load(ntpp_ptr):
        return
    slot = tl.load(sorted_ids_ptr + pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)).to(tl.int64)
    valid = slot < num_slots
    rows = slot // TOP_K  # the A row (token) of each slot; out of range where not valid
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    cols_b = (cols % N).to(tl.int64)
    ks = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + cols_b[None, :] * stride_bn + ks[:, None] * stride_bk
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    if GROUP_K > 0:
        a_s_ptrs = a_scale_ptr + rows * stride_asm
        b_s_ptrs = b_scale_ptr + expert * stride_bse + (cols_b // GROUP_N) * stride_bsn
        for kb in range(0, tl.cdiv(K, GROUP_K)):
            part = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
            for kk in tl.static_range(GROUP_K // BLOCK_SIZE_K):
                # EVEN_K: K % GROUP_K == 0
                a, b = load_k_step(a_ptrs, b_ptrs, valid, ks, K - (kb * GROUP_K + kk * BLOCK_SIZE_K), EVEN_K)
                part = tl.dot(a, b, part)
                a_ptrs += BLOCK_SIZE_K * stride_ak
                b_ptrs += BLOCK_SIZE_K * stride_bk
            a_s = tl.load(a_s_ptrs + kb * stride_ask, mask=valid, other=0.0)
            b_s = tl.load(b_s_ptrs + kb * stride_bsk)
            acc += part * (a_s[:, None] * b_s[None, :])
    else:
        for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
            # EVEN_K: K % BLOCK_SIZE_K == 0
            a, b = load_k_step(a_ptrs, b_ptrs, valid, ks, K - k * BLOCK_SIZE_K, EVEN_K)
            acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_SIZE_K * stride_ak
            b_ptrs += BLOCK_SIZE_K * stride_bk
        a_s = tl.load(a_scale_ptr + rows * stride_asm, mask=valid, other=0.0)
        b_s = tl.load(b_scale_ptr + expert * stride_bse + cols_b * stride_bsn)
        acc = acc * (a_s[:, None] * b_s[None, :])
    store_slots(c_ptr, acc, slot, valid, cols, N, topk_w_ptr, stride_cm, stride_cn, MUL_ROUTED_WEIGHT)


def align_block_size(topk_ids, E, bm):
    """moe_align_block_size in plain torch (host side, not timed).

    Slot s = token * top_k + j. Returns (sorted_ids, expert_ids, num_tokens_post_padded)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    n, dev = flat.numel(), flat.device
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + bm - 1) // bm * bm
    # Worst case over all routings with n slots (what a graph-captured launch must cover):
    # every expert adds < bm padding rows, and at most n experts are non-empty.
    cap_blocks = triton.cdiv(min(n + E * (bm - 1), n * bm), bm)
    sorted_ids = torch.full((cap_blocks * bm,), n, dtype=torch.int32, device=dev)
    order = torch.argsort(flat, stable=True)
    e_of = flat[order]
    rank = torch.arange(n, device=dev) - (torch.cumsum(counts, 0) - counts)[e_of]
    sorted_ids[(torch.cumsum(padded, 0) - padded)[e_of] + rank] = order.to(torch.int32)
    block_experts = torch.repeat_interleave(torch.arange(E, device=dev), padded // bm)
    expert_ids = torch.zeros(cap_blocks, dtype=torch.int32, device=dev)
    expert_ids[: block_experts.numel()] = block_experts.to(torch.int32)
    return sorted_ids, expert_ids, padded.sum().reshape(1).to(torch.int32)


FP8_MAX = 448.0  # largest float8_e4m3fn magnitude
ABSMAX_FLOOR = 1e-10  # dynamic scales: max(absmax, floor) / FP8_MAX (moelora::kQuantAbsmaxFloor)

# Quantization schemes: (block_rows, block_cols) of the weight and activation scales
# (0: the whole dim), and the group recorded in the rows' "quant". The activation group
# on K is always the weight's, as in vLLM's W8A8 paths.
SCHEMES = {
    "bf16": None,
    # DeepSeek-V3 / Qwen3-FP8: 128x128 weight blocks, per token group of 128 activations.
    "fp8_block": dict(weight=(128, 128), act=(1, 128), group=128),
    # per output channel weights, per token activations.
    "fp8_channel": dict(weight=(1, 0), act=(1, 0), group=None),
}


def quant_field(scheme):
    """The rows' "quant" (DESIGN.md, GPU reports): null for bf16."""
    if SCHEMES[scheme] is None:
        return None
    return {"scheme": scheme, "group": SCHEMES[scheme]["group"], "zero_point": False}


def scheme_of(row):
    return (row.get("quant") or {}).get("scheme") or "bf16"


def expand_scales(s, br, bc, R, C):
    """Scales [..., cdiv(R, br), cdiv(C, bc)] -> one per element [..., R, C]."""
    return s.repeat_interleave(br, dim=-2).repeat_interleave(bc, dim=-1)[..., :R, :C]


def quantize_fp8(x, block_rows, block_cols):
    """x [..., R, C] -> (float8_e4m3fn [..., R, C], fp32 scales [..., cdiv(R, br), cdiv(C, bc)]),
    br x bc = block_rows x block_cols (0: the whole dim), dynamic scales, moelora::quantize's
    rule: scale = max(absmax of the block, 1e-10) / 448, q = saturate(round_to_nearest_even(x / scale))
    (an IEEE fp32 division; torch's float -> fp8 conversion rounds to nearest even)."""
    *lead, R, C = x.shape
    br, bc = block_rows or R, block_cols or C
    rb, cb = triton.cdiv(R, br), triton.cdiv(C, bc)
    xf = x.float()
    padded = torch.nn.functional.pad(xf, (0, cb * bc - C, 0, rb * br - R))  # zeros: absmax unchanged
    absmax = padded.abs().reshape(*lead, rb, br, cb, bc).amax(dim=(-3, -1))
    scales = absmax.clamp_min(ABSMAX_FLOOR) / FP8_MAX
    q = (xf / expand_scales(scales, br, bc, R, C)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scales


class Q8:
    """An fp8 W8A8 operand: elements q [..., R, C] and fp32 scales s [..., cdiv(R, br),
    cdiv(C, bc)], value = q * s. Per token / per channel scales (bc = 0: the whole K) are
    s [..., R, 1], i.e. vLLM's [M] and [E, N] with a trailing unit dim."""

    def __init__(self, x, block_rows, block_cols, per_leading=False):
        self.br, self.bc = block_rows, block_cols
        if per_leading:  # weights: one expert at a time (bounded temporaries)
            parts = [quantize_fp8(x[e], block_rows, block_cols) for e in range(x.shape[0])]
            self.q = torch.stack([p[0] for p in parts])
            self.s = torch.stack([p[1] for p in parts])
        else:
            self.q, self.s = quantize_fp8(x, block_rows, block_cols)
        self.shape = self.q.shape

    def dequant(self, index=None):
        """float32 values of the whole tensor, or of q[index] (one expert)."""
        q, s = (self.q, self.s) if index is None else (self.q[index], self.s[index])
        R, C = q.shape[-2:]
        return q.float() * expand_scales(s, self.br or R, self.bc or C, R, C)


def quant_weights(w, scheme):
    """[E, N, K] bf16 -> the scheme's weights (bf16: unchanged)."""
    return w if SCHEMES[scheme] is None else Q8(w, *SCHEMES[scheme]["weight"], per_leading=True)


def quant_act(x, scheme):
    """[rows, K] bf16 -> the scheme's GEMM input (bf16: unchanged). Not timed."""
    return x if SCHEMES[scheme] is None else Q8(x, *SCHEMES[scheme]["act"])


def fp8_gemm_launcher(a, w, c, align, top_k, cfg, topk_w=None):
    """gemm_launcher for Q8 operands (moe_gemm_fp8_kernel)."""
    sorted_ids, expert_ids, ntpp = align
    E, N, K = w.shape
    bm, bn, bk = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"]
    group_k = w.bc  # 0: per channel
    assert a.br == 1 and a.bc == group_k, "activation scales must be per token (group) on the weight's K group"
    assert group_k == 0 or group_k % bk == 0, f"BLOCK_SIZE_K {bk} must divide the K group {group_k}"
    EM = sorted_ids.numel()
    grid = (triton.cdiv(EM, bm) * triton.cdiv(N, bn),)
    tw = topk_w if topk_w is not None else c
    args = (a.q, a.s, w.q, w.s, c, tw, sorted_ids, expert_ids, ntpp, N, K, EM, c.shape[0],
            a.q.stride(0), a.q.stride(1), w.q.stride(0), w.q.stride(1), w.q.stride(2), c.stride(0), c.stride(1),
            a.s.stride(0), a.s.stride(1), w.s.stride(0), w.s.stride(1), w.s.stride(2))
    meta = dict(GROUP_N=w.br, GROUP_K=group_k, BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk,
                GROUP_SIZE_M=cfg["GROUP_SIZE_M"], TOP_K=top_k, MUL_ROUTED_WEIGHT=topk_w is not None,
                EVEN_K=K % (group_k or bk) == 0, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return lambda: moe_gemm_fp8_kernel[grid](*args, **meta)


def gemm_launcher(a, w, c, align, top_k, cfg, topk_w=None):
    """Binds one GEMM launch (invoke_fused_moe_kernel's job) and returns it as a callable."""
    if isinstance(w, Q8):
        return fp8_gemm_launcher(a, w, c, align, top_k, cfg, topk_w)
    sorted_ids, expert_ids, ntpp = align
    E, N, K = w.shape
    bm, bn, bk = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"]
    EM = sorted_ids.numel()
    grid = (triton.cdiv(EM, bm) * triton.cdiv(N, bn),)
    tw = topk_w if topk_w is not None else c  # unread unless MUL_ROUTED_WEIGHT
    args = (a, w, c, tw, sorted_ids, expert_ids, ntpp, N, K, EM, c.shape[0],
            a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), c.stride(0), c.stride(1))
    meta = dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=cfg["GROUP_SIZE_M"],
                TOP_K=top_k, MUL_ROUTED_WEIGHT=topk_w is not None, EVEN_K=K % bk == 0, DOT_F32=INTERPRET,
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return lambda: moe_gemm_kernel[grid](*args, **meta)


def silu_mul(c1):
    I = c1.shape[1] // 2
    return (torch.nn.functional.silu(c1[:, :I].float()) * c1[:, I:].float()).to(c1.dtype)


def layer(x, w13, w2, ids, wts, cfg1, cfg2, scheme="bf16"):
    """The whole layer through the two Triton GEMMs; returns [M, H] float32. w13, w2: the
    scheme's weights (quant_weights); x bf16. fp8: x and the bf16 activation are quantized
    (quant_act) before their GEMM."""
    M, H = x.shape
    E, top_k, I = w13.shape[0], ids.shape[1], w2.shape[2]
    c1 = torch.empty(M * top_k, 2 * I, dtype=x.dtype, device=x.device)
    gemm_launcher(quant_act(x, scheme), w13, c1, align_block_size(ids, E, cfg1["BLOCK_SIZE_M"]), top_k, cfg1)()
    act = silu_mul(c1)
    c2 = torch.empty(M * top_k, H, dtype=x.dtype, device=x.device)
    gemm_launcher(quant_act(act, scheme), w2, c2, align_block_size(ids, E, cfg2["BLOCK_SIZE_M"]), 1, cfg2,
                  wts.reshape(-1).contiguous())()
    return c2.view(M, top_k, H).float().sum(1)


def as_kernel_stores_bf16(t):
    """fp32 -> bf16 as the kernels' store rounds: to nearest even on the GPU; the interpreter
    (triton 3.6) truncates, whatever rounding is asked for."""
    if INTERPRET:
        return (t.float().contiguous().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
    return t.to(torch.bfloat16)


def reference(x, w13, w2, ids, wts, scheme="bf16"):
    """float32 torch reference of the same layer. bf16: no bf16 rounding of intermediates.
    fp8: the GEMMs in float32 on dequantized weights and on activations quantized the same
    way (quant_act); GEMM1's output is rounded to bf16 as the kernel stores it and silu_mul'd
    as the layer does before the activation is quantized, since a rounding difference there
    moves some elements by a whole fp8 step (~6%) and blurs the check (with the interpreter's
    truncating stores and round-to-nearest here: rel_err ~2e-2)."""
    I = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if SCHEMES[scheme] is None:
        xf = x.float()
        for e in ids.unique().tolist():
            tok, j = (ids == e).nonzero(as_tuple=True)
            h = xf[tok] @ w13[e].float().t()
            y = (torch.nn.functional.silu(h[:, :I]) * h[:, I:]) @ w2[e].float().t()
            out.index_add_(0, tok, y * wts[tok, j].unsqueeze(1))
        return out
    xd = quant_act(x, scheme).dequant()  # quantization is per row: rows may be picked after it
    for e in ids.unique().tolist():
        tok, j = (ids == e).nonzero(as_tuple=True)
        h = xd[tok] @ w13.dequant(e).t()
        act = quant_act(silu_mul(as_kernel_stores_bf16(h)), scheme).dequant()
        y = act @ w2.dequant(e).t()
        out.index_add_(0, tok, y * wts[tok, j].unsqueeze(1))
    return out


def rel_err(x, w13, w2, ids, wts, cfg1, cfg2, scheme="bf16"):
    ref = reference(x, w13, w2, ids, wts, scheme)
    out = layer(x, w13, w2, ids, wts, cfg1, cfg2, scheme)
    return ((out - ref).norm() / ref.norm()).item()


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


def time_graph(launches, iters):
    """Median over `iters` replays of one graph holding all `launches`, per launch, in us."""
    for f in launches:  # warm-up: Triton compiles here, outside the capture
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in launches:
            f()
    for _ in range(2):
        g.replay()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / len(launches))
    del g
    return statistics.median(times)


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


def bench_cell(name, M, w13, w2, args, scheme="bf16"):
    """w13, w2: the scheme's weights (quant_weights). Inputs are quantized outside the graphs."""
    E, top_k, H, I, _ = MODELS[name]
    dev = w13.q.device if isinstance(w13, Q8) else w13.device
    rots = [make_inputs(M, E, top_k, H, 1000 + 31 * r + M, dev) for r in range(ROTATIONS)]
    menu = menu_for(M, E, top_k, args.quick, scheme)
    # Correctness before timing, with the heuristic config for both GEMMs.
    x0, ids0, wts0 = rots[0]
    err = rel_err(x0, w13, w2, ids0, wts0, menu[0], menu[0], scheme)
    if not err <= 2e-2:
        sys.exit(f"FAILED: {name} {scheme} M={M} rel_err {err:.3e} > 2e-2 (config {menu[0]})")
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

    cfg1, us1 = tune("gemm1", menu, launches1, args.iters)
    for f in launches1(cfg1):  # GEMM2's real input: the activation of GEMM1's output
        f()
    acts = [quant_act(silu_mul(c), scheme) for c in c1]
    flat_w = [w.reshape(-1).contiguous() for _, _, w in rots]

    def launches2(c):
        return [gemm_launcher(acts[r], w2, c2[r], align(r, c["BLOCK_SIZE_M"]), 1, c, flat_w[r])
                for r in range(len(rots))]

    cfg2, us2 = tune("gemm2", menu, launches2, args.iters)
    if (cfg1, cfg2) != (menu[0], menu[0]):  # the winners are checked too
        err = max(err, rel_err(x0, w13, w2, ids0, wts0, cfg1, cfg2, scheme))
        if not err <= 2e-2:
            sys.exit(f"FAILED: {name} {scheme} M={M} rel_err {err:.3e} > 2e-2 ({cfg1} / {cfg2})")
    return dict(model=name, M=M, quant=quant_field(scheme), gemm1_us=us1, gemm2_us=us2, two_gemm_us=us1 + us2,
                gemm1_config=cfg1, gemm2_config=cfg2, rel_err=err)


def geomean(values):
    return math.exp(sum(map(math.log, values)) / len(values))


def short(c):
    return "{BLOCK_SIZE_M}x{BLOCK_SIZE_N}x{BLOCK_SIZE_K} g{GROUP_SIZE_M} w{num_warps} s{num_stages}".format(**c)


PEER = "triton-fused-moe (benchmarks/triton_fused_moe_compare.py: our Triton kernel of vLLM's fused_moe contract)"


def cell_key(row):
    """Rows of ours and of this script are matched on (model, M, quantization scheme)."""
    return row["model"], int(row["M"]), scheme_of(row)


def load_ours(ours_path):
    """moelora_bench --json rows of the plain layer (no LoRA: the peer has none)."""
    with open(ours_path) as f:
        data = json.load(f)
    rows = data["rows"] if isinstance(data, dict) else data
    return data, [r for r in rows if r.get("op", "fused_experts") == "fused_experts" and not r.get("lora")]


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
            ratios.setdefault(scheme_of(r), []).append(su)
        print(f"{r['model']:<16} {scheme_of(r):<11} {r['M']:>5} {r['gemm1_us']:>9.1f} {r['gemm2_us']:>9.1f} "
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
        by_scheme.setdefault(scheme_of(o), []).append(row["speedup_vs_triton"])
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
    print(f"selftest {scheme} passed (worst rel_err {worst:.2e})")


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
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference is true float32
    print(f"triton {triton.__version__} torch {torch.__version__} on {torch.cuda.get_device_name()}"
          f" | {'quick heuristic configs' if args.quick else 'per-cell config search'}")
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
                row = bench_cell(name, M, qw13, qw2, args, sch)
                rows.append(row)
                print(f"{name:<16} {sch:<11} M={M:<5} gemm1 {row['gemm1_us']:8.1f} us  "
                      f"gemm2 {row['gemm2_us']:8.1f} us  two-GEMM {row['two_gemm_us']:8.1f} us  rel_err {row['rel_err']:.1e}  "
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
