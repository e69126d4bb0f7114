"""The Triton side of the same-run peer (benchmarks/triton_fused_moe_compare.py): our own
kernels of vLLM's fused_moe contract (moe_gemm_kernel, bf16; moe_gemm_fp8_kernel, W8A8 fp8
with block or channel scales), the alignment they read, the fp8 quantization of weights and
activations (moelora::quantize's rule), the layer they compose and its float reference.
Not vLLM's code. Import it after choosing TRITON_INTERPRET (the driver sets it for --device
cpu before triton.jit runs).
"""
import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


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
