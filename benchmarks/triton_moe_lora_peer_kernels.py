"""The LoRA side of the same-run Triton peer (issue 31): our own kernels of the contract of
vLLM's fused_moe_lora (a LoRA shrink and expand per MoE GEMM, adapters per token), not
vLLM's code. Import after choosing TRITON_INTERPRET, as triton_moe_peer_kernels.

Per (token, expert) slot s with adapter l = token_lora[s // top_k] >= 0 and expert e:
    GEMM1: c1[s, slice] += scale[l] * B13[slice, l, e] @ (A13[slice, l, e] @ x[s // top_k])   (gate, up)
    GEMM2: c2[s]        += w[s] * scale[l] * B2[l, e] @ (A2[l, e] @ act[s])                    (routed weight)
The shrink writes inter[slice, s, :rank] (bf16, as vLLM's intermediate cache); the expand
reads it and adds into the base GEMM's output. Two ways to assign work, both in the
config search of a cell:
- aligned: slots grouped by (adapter, expert), each group padded to BLOCK_SIZE_M
  (lora_align_block_size, vLLM's moe_lora_align_block_size contract: padding = num_slots,
  one adapter and one expert an M-block, blocks of no adapter skipped);
- per slot (vLLM's naive block assignment, its small-batch path): one program a slot, the
  adapter and expert read from token_lora and topk_ids; no alignment at all.
"""
import torch
import triton
import triton.language as tl

from triton_moe_peer_kernels import INTERPRET


@triton.jit
def slot_block(pid_m, sorted_ids_ptr, block_expert_ptr, block_lora_ptr, ntpp_ptr, topk_ids_ptr, token_lora_ptr,
               num_slots, top_k, BLOCK_M: tl.constexpr, PER_SLOT: tl.constexpr):
    """(slots [BLOCK_M], valid, expert, adapter) of M-block pid_m; adapter < 0: no work."""
    offs = tl.arange(0, BLOCK_M)
    if PER_SLOT:
        slot = tl.where(offs == 0, pid_m, num_slots)
        expert = tl.load(topk_ids_ptr + pid_m)
        lora = tl.load(token_lora_ptr + pid_m // top_k)
    else:
        slot = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + offs)
        expert = tl.load(block_expert_ptr + pid_m)
        lora = tl.load(block_lora_ptr + pid_m)
        lora = tl.where(pid_m * BLOCK_M < tl.load(ntpp_ptr), lora, -1)
    return slot.to(tl.int64), slot < num_slots, expert.to(tl.int64), lora.to(tl.int64)


@triton.jit
def lora_shrink_kernel(in_ptr, a_ptr, inter_ptr, sorted_ids_ptr, block_expert_ptr, block_lora_ptr, ntpp_ptr,
                       topk_ids_ptr, token_lora_ptr, K, R, num_slots, top_k, rows_per_token,
                       s_in_m, s_in_k, s_a_slice, s_a_l, s_a_e, s_a_r, s_a_k, s_i_slice, s_i_m, s_i_r,
                       BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_R: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
                       PER_SLOT: tl.constexpr, DOT_F32: tl.constexpr):
    """inter[slice, s, :R] = A[slice, l, e] @ in[s // rows_per_token] for the block's slots."""
    pid_m, sl = tl.program_id(0), tl.program_id(1)
    slot, valid, expert, lora = slot_block(pid_m, sorted_ids_ptr, block_expert_ptr, block_lora_ptr, ntpp_ptr,
                                           topk_ids_ptr, token_lora_ptr, num_slots, top_k, BLOCK_SIZE_M, PER_SLOT)
    if lora < 0:
        return
    ks = tl.arange(0, BLOCK_SIZE_K)
    rs = tl.arange(0, BLOCK_SIZE_R)
    in_ptrs = in_ptr + (slot // rows_per_token)[:, None] * s_in_m + ks[None, :] * s_in_k
    a_ptrs = a_ptr + sl * s_a_slice + lora * s_a_l + expert * s_a_e + rs[None, :] * s_a_r + ks[:, None] * s_a_k
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_R), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        k_ok = ks < K - k * BLOCK_SIZE_K
        x = tl.load(in_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_ptrs, mask=k_ok[:, None] & (rs[None, :] < R), other=0.0)
        if DOT_F32:  # interpreter only (its tl.dot multiplies bf16 as raw bits)
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        acc = tl.dot(x, a, acc)
        in_ptrs += BLOCK_SIZE_K * s_in_k
        a_ptrs += BLOCK_SIZE_K * s_a_k
    i_ptrs = inter_ptr + sl * s_i_slice + slot[:, None] * s_i_m + rs[None, :] * s_i_r
    tl.store(i_ptrs, acc.to(inter_ptr.dtype.element_ty), mask=valid[:, None] & (rs[None, :] < R))


@triton.jit
def lora_expand_kernel(inter_ptr, b_ptr, c_ptr, scale_ptr, topk_w_ptr, sorted_ids_ptr, block_expert_ptr,
                       block_lora_ptr, ntpp_ptr, topk_ids_ptr, token_lora_ptr, N, R, num_slots, top_k,
                       s_i_slice, s_i_m, s_i_r, s_b_slice, s_b_l, s_b_e, s_b_n, s_b_r, s_c_m, s_c_n,
                       BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_R: tl.constexpr,
                       PER_SLOT: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, DOT_F32: tl.constexpr):
    """c[s, slice * N + n] += scale[l] (* w[s]) * B[slice, l, e, n] @ inter[slice, s] for the block's slots."""
    pid_m, pid_n, sl = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot, valid, expert, lora = slot_block(pid_m, sorted_ids_ptr, block_expert_ptr, block_lora_ptr, ntpp_ptr,
                                           topk_ids_ptr, token_lora_ptr, num_slots, top_k, BLOCK_SIZE_M, PER_SLOT)
    if lora < 0:
        return
    rs = tl.arange(0, BLOCK_SIZE_R)
    cols = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    r_ok, n_ok = rs < R, cols < N
    h = tl.load(inter_ptr + sl * s_i_slice + slot[:, None] * s_i_m + rs[None, :] * s_i_r,
                mask=valid[:, None] & r_ok[None, :], other=0.0)
    b = tl.load(b_ptr + sl * s_b_slice + lora * s_b_l + expert * s_b_e + cols[None, :] * s_b_n + rs[:, None] * s_b_r,
                mask=r_ok[:, None] & n_ok[None, :], other=0.0)
    if DOT_F32:
        h = h.to(tl.float32)
        b = b.to(tl.float32)
    else:
        h = h.to(b.dtype)  # an fp32 inter (the selftest's exact check) meets bf16 B
    acc = tl.dot(h, b) * tl.load(scale_ptr + lora)
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(topk_w_ptr + slot, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + slot[:, None] * s_c_m + (sl * N + cols)[None, :] * s_c_n
    mask = valid[:, None] & n_ok[None, :]
    base = tl.load(c_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptrs, (base + acc).to(c_ptr.dtype.element_ty), mask=mask)


def lora_align_block_size(topk_ids, token_lora, E, num_adapters, bm):
    """Slots grouped by (adapter, expert), each group padded to bm (plain torch, host side,
    not timed; sized for the worst case, so a captured graph covers any routing).
    Returns (sorted_ids, block_expert, block_lora, num_tokens_post_padded); padding holds
    num_slots, blocks past the total hold adapter -1."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    n, dev = flat.numel(), flat.device
    top_k = topk_ids.shape[1]
    lora = token_lora.to(torch.int64).repeat_interleave(top_k)
    groups = num_adapters * E
    key = torch.where(lora >= 0, lora * E + flat, groups)  # slots of no adapter: past every group
    counts = torch.bincount(key, minlength=groups + 1)[:groups]
    padded = (counts + bm - 1) // bm * bm
    cap_blocks = triton.cdiv(min(n + groups * (bm - 1), n * bm), bm)
    sorted_ids = torch.full((max(cap_blocks, 1) * bm,), n, dtype=torch.int32, device=dev)
    order = torch.argsort(key, stable=True)
    keyed = order[key[order] < groups]
    k_of = key[keyed]
    rank = torch.arange(keyed.numel(), device=dev) - (torch.cumsum(counts, 0) - counts)[k_of]
    sorted_ids[(torch.cumsum(padded, 0) - padded)[k_of] + rank] = keyed.to(torch.int32)
    block_group = torch.repeat_interleave(torch.arange(groups, device=dev), padded // bm)
    block_expert = torch.zeros(max(cap_blocks, 1), dtype=torch.int32, device=dev)
    block_lora = torch.full((max(cap_blocks, 1),), -1, dtype=torch.int32, device=dev)
    block_expert[:block_group.numel()] = (block_group % E).to(torch.int32)
    block_lora[:block_group.numel()] = (block_group // E).to(torch.int32)
    return sorted_ids, block_expert, block_lora, padded.sum().reshape(1).to(torch.int32)


def lcfg(mode, bm, bn_or_bk, warps=4, stages=2):
    """A LoRA kernel config: mode 'aligned' or 'per_slot'; bn_or_bk: the shrink's
    BLOCK_SIZE_K or the expand's BLOCK_SIZE_N."""
    return dict(mode=mode, BLOCK_SIZE_M=bm, BLOCK_SIZE_X=bn_or_bk, num_warps=warps, num_stages=stages)


def lora_launchers(inp, a, b, c, inter, routing, top_k, rows_per_token, shrink_cfg, expand_cfg, topk_w=None):
    """(shrink, expand) launches of one GEMM's LoRA. a [S, L, E, r, K], b [S, L, E, N, r]
    (S slices: 2 for w13's gate and up, 1 for w2), inter [S, slots, r] bf16, c [slots, S * N].
    routing: dict(ids=topk_ids flat int32, token_lora int32, scale fp32 [L], aligned=fn(bm))."""
    S, L, E, R, K = a.shape
    N = b.shape[3]
    BR = max(16, triton.next_power_of_2(R))
    slots = c.shape[0]

    def operands(cfg):
        bm = cfg["BLOCK_SIZE_M"]
        if cfg["mode"] == "per_slot":
            dummy = routing["ids"]
            return (dummy, dummy, dummy, dummy), slots, True, 16
        sorted_ids, block_expert, block_lora, ntpp = routing["aligned"](bm)
        return (sorted_ids, block_expert, block_lora, ntpp), block_expert.numel(), False, bm

    (s_ids, b_exp, b_lora, ntpp), blocks, per_slot, bm = operands(shrink_cfg)
    shrink_grid = (blocks, S)
    shrink_args = (inp, a, inter, s_ids, b_exp, b_lora, ntpp, routing["ids"], routing["token_lora"], K, R, slots,
                   top_k, rows_per_token, inp.stride(0), inp.stride(1), *a.stride(), *inter.stride())
    shrink_meta = dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_R=BR, BLOCK_SIZE_K=shrink_cfg["BLOCK_SIZE_X"], PER_SLOT=per_slot,
                       DOT_F32=INTERPRET, num_warps=shrink_cfg["num_warps"], num_stages=shrink_cfg["num_stages"])
    (e_ids, e_exp, e_lora, e_ntpp), e_blocks, e_per_slot, e_bm = operands(expand_cfg)
    bn = expand_cfg["BLOCK_SIZE_X"]
    expand_grid = (e_blocks, triton.cdiv(N, bn), S)
    tw = topk_w if topk_w is not None else routing["scale"]  # unread unless MUL_ROUTED_WEIGHT
    expand_args = (inter, b, c, routing["scale"], tw, e_ids, e_exp, e_lora, e_ntpp, routing["ids"],
                   routing["token_lora"], N, R, slots, top_k, *inter.stride(), *b.stride(), c.stride(0), c.stride(1))
    expand_meta = dict(BLOCK_SIZE_M=e_bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_R=BR, PER_SLOT=e_per_slot,
                       MUL_ROUTED_WEIGHT=topk_w is not None, DOT_F32=INTERPRET, num_warps=expand_cfg["num_warps"],
                       num_stages=expand_cfg["num_stages"])
    return (lambda: lora_shrink_kernel[shrink_grid](*shrink_args, **shrink_meta),
            lambda: lora_expand_kernel[expand_grid](*expand_args, **expand_meta))


def make_routing(ids, token_lora, scale, E):
    """The per-cell routing the LoRA kernels read; aligned(bm) is cached per block size (a
    captured graph keeps pointing at the tensors)."""
    cache = {}
    num_adapters = scale.numel()

    def aligned(bm):
        if bm not in cache:
            cache[bm] = lora_align_block_size(ids, token_lora, E, num_adapters, bm)
        return cache[bm]
    return dict(ids=ids.reshape(-1).to(torch.int32).contiguous(), token_lora=token_lora.to(torch.int32).contiguous(),
                scale=scale.float().contiguous(), aligned=aligned)


def make_adapters(L, E, H, I, rank, M, share, seed, dev):
    """Adapter stacks (bf16; a13 [2, L, E, r, H], b13 [2, L, E, I, r], a2 [1, L, E, r, I],
    b2 [1, L, E, H, r]), scales [L] and each token's adapter (-1 for 1 - share of them)."""
    g = torch.Generator(device=dev).manual_seed(seed)

    def rnd(*shape, fan_in):
        return ((torch.rand(*shape, generator=g, device=dev) - 0.5) * (2 * fan_in ** -0.5)).to(torch.bfloat16)
    adapters = dict(a13=rnd(2, L, E, rank, H, fan_in=H), b13=rnd(2, L, E, I, rank, fan_in=rank),
                    a2=rnd(1, L, E, rank, I, fan_in=I), b2=rnd(1, L, E, H, rank, fan_in=rank),
                    scale=0.5 + torch.rand(L, generator=g, device=dev))
    token_lora = torch.randint(0, L, (M,), generator=g, device=dev, dtype=torch.int32)
    none = torch.rand(M, generator=g, device=dev) >= share
    adapters["token_lora"] = torch.where(none, torch.full_like(token_lora, -1), token_lora)
    return adapters


def lora_reference_delta(inp, a, b, scale, token_of_row, lora_of_row, expert_of_row):
    """float32 per-row delta scale[l] * B[., l, e] @ (A[., l, e] @ inp[token_of_row]) over
    the slices, concatenated ([rows, S * N]); rows of no adapter get zero."""
    S, N = a.shape[0], b.shape[3]
    out = torch.zeros(token_of_row.numel(), S * N, dtype=torch.float32, device=inp.device)
    pairs = torch.stack([lora_of_row.long(), expert_of_row.long()], 1)
    for l, e in pairs[lora_of_row >= 0].unique(dim=0).tolist():
        rows = ((lora_of_row == l) & (expert_of_row == e)).nonzero(as_tuple=True)[0]
        x = inp[token_of_row[rows]].float()
        for sl in range(S):
            out[rows, sl * N:(sl + 1) * N] = scale[l].float() * ((x @ a[sl, l, e].float().t()) @ b[sl, l, e].float().t())
    return out


def lora_layer(x, w13, w2, ids, wts, adapters, cfg1, cfg2, lora_cfgs):
    """The layer with LoRA through the peer: the two base GEMMs (triton_moe_peer_kernels),
    each followed by its LoRA shrink and expand; lora_cfgs: (shrink1, expand1, shrink2,
    expand2). Returns [M, H] float32."""
    from triton_moe_peer_kernels import align_block_size, gemm_launcher, silu_mul
    M, H = x.shape
    E, top_k, I = w13.shape[0], ids.shape[1], w2.shape[2]
    slots, rank = M * top_k, adapters["a13"].shape[3]
    routing = make_routing(ids, adapters["token_lora"], adapters["scale"], E)
    c1 = torch.empty(slots, 2 * I, dtype=x.dtype, device=x.device)
    gemm_launcher(x, w13, c1, align_block_size(ids, E, cfg1["BLOCK_SIZE_M"]), top_k, cfg1)()
    inter1 = torch.empty(2, slots, rank, dtype=torch.bfloat16, device=x.device)
    for launch in lora_launchers(x, adapters["a13"], adapters["b13"], c1, inter1, routing, top_k, top_k,
                                 lora_cfgs[0], lora_cfgs[1]):
        launch()
    act = silu_mul(c1)
    c2 = torch.empty(slots, H, dtype=x.dtype, device=x.device)
    flat_w = wts.reshape(-1).contiguous()
    gemm_launcher(act, w2, c2, align_block_size(ids, E, cfg2["BLOCK_SIZE_M"]), 1, cfg2, flat_w)()
    inter2 = torch.empty(1, slots, rank, dtype=torch.bfloat16, device=x.device)
    for launch in lora_launchers(act, adapters["a2"], adapters["b2"], c2, inter2, routing, top_k, 1,
                                 lora_cfgs[2], lora_cfgs[3], flat_w):
        launch()
    return c2.view(M, top_k, H).float().sum(1)


def lora_reference(x, w13, w2, ids, wts, adapters):
    """float32 torch reference of lora_layer (no bf16 rounding of intermediates)."""
    M, H = x.shape
    top_k, I = ids.shape[1], w2.shape[2]
    slots = M * top_k
    token_of = torch.arange(slots, device=x.device) // top_k
    expert_of = ids.reshape(-1).long()
    lora_of = adapters["token_lora"].long()[token_of]
    h = torch.zeros(slots, 2 * I, dtype=torch.float32, device=x.device)
    for e in expert_of.unique().tolist():
        rows = (expert_of == e).nonzero(as_tuple=True)[0]
        h[rows] = x[token_of[rows]].float() @ w13[e].float().t()
    h += lora_reference_delta(x, adapters["a13"], adapters["b13"], adapters["scale"], token_of, lora_of, expert_of)
    act = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
    y = torch.zeros(slots, H, dtype=torch.float32, device=x.device)
    for e in expert_of.unique().tolist():
        rows = (expert_of == e).nonzero(as_tuple=True)[0]
        y[rows] = act[rows] @ w2[e].float().t()
    every = torch.arange(slots, device=x.device)
    y += lora_reference_delta(act, adapters["a2"], adapters["b2"], adapters["scale"], every, lora_of, expert_of)
    return (y * wts.reshape(-1, 1).float()).view(M, top_k, H).sum(1)


def lora_rel_err(x, w13, w2, ids, wts, adapters, cfg1, cfg2, lora_cfgs):
    ref = lora_reference(x, w13, w2, ids, wts, adapters)
    out = lora_layer(x, w13, w2, ids, wts, adapters, cfg1, cfg2, lora_cfgs)
    return ((out - ref).norm() / ref.norm()).item()
