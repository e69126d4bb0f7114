"""A float64 numpy reference of every moelora op, for tests and for checking results.

Inputs may be numpy arrays of any float dtype (ml_dtypes.bfloat16 included) or of int
ids; everything is computed in float64. The semantics are those of
include/moelora/ops.h.
"""

import math

import numpy as np

__all__ = [
    "dequantize",
    "effective_lora_ids",
    "fused_experts",
    "fused_moe",
    "fused_moe_lora",
    "gelu_and_mul",
    "lora_delta",
    "moe_align_block_size",
    "moe_lora_align_block_size",
    "moe_sum_reduce",
    "quantize",
    "silu_and_mul",
    "swiglu_oai_and_mul",
]

_erf = np.frompyfunc(math.erf, 1, 1)


def _f64(x):
    return np.asarray(x).astype(np.float64)


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _silu(x):
    return x * _sigmoid(x)


def _gelu(x):
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)).astype(np.float64))


def silu_and_mul(x):
    """x [*, 2I] -> [*, I] = silu(gate) * up, gate = x[..., :I], up = x[..., I:]."""
    x = _f64(x)
    width = x.shape[-1] // 2
    return _silu(x[..., :width]) * x[..., width:]


def gelu_and_mul(x):
    """x [*, 2I] -> [*, I] = gelu(gate) * up with the exact (erf) GELU."""
    x = _f64(x)
    width = x.shape[-1] // 2
    return _gelu(x[..., :width]) * x[..., width:]


def swiglu_oai_and_mul(x, alpha=1.702, limit=7.0):
    """gpt-oss SwiGLU on interleaved x [*, 2I] -> [*, I]."""
    x = _f64(x)
    gate = np.minimum(x[..., 0::2], limit)
    up = np.clip(x[..., 1::2], -limit, limit)
    return (up + 1.0) * gate * _sigmoid(alpha * gate)


_ACTIVATIONS = {
    "silu": lambda h, alpha, limit: silu_and_mul(h),
    "gelu": lambda h, alpha, limit: gelu_and_mul(h),
    "swiglu_oai": swiglu_oai_and_mul,
}


def moe_sum_reduce(x, routed_scaling_factor=1.0):
    """x [M, top_k, H] -> [M, H] = routed_scaling_factor * sum over top_k."""
    return routed_scaling_factor * _f64(x).sum(axis=1)


def moe_align_block_size(topk_ids, block_size, num_experts, expert_map=None):
    """The used part of moe_align_block_size's outputs, slots in ascending order per group.

    topk_ids [M, top_k] (-1 = dropped); expert_map [num_experts] global -> local or -1.
    Returns (sorted_token_ids [num_tokens_post_padded] int32, expert_ids
    [num_tokens_post_padded // block_size] int32, num_tokens_post_padded: int, groups),
    groups being (start, stop) ranges of sorted_token_ids, one per non-empty expert group
    in order (the order of slots inside a group is not part of the contract).
    """
    ids = np.asarray(topk_ids).astype(np.int64).reshape(-1)
    keys = [(e, -1) for e in range(num_experts)] + [(-1, -1)]
    sorted_ids, block_experts, _, count, groups = _align_groups(ids, np.full(ids.size, -1), keys, block_size,
                                                                expert_map)
    return sorted_ids, block_experts, count, groups


def _align_groups(ids, slot_lora, keys, block_size, expert_map):
    """Slots grouped by the (expert, adapter) keys in order (expert -1: the dropped slots),
    each group padded with the sentinel ids.size to a multiple of block_size.
    Returns (sorted_token_ids, expert_ids, block_lora_ids, num_tokens_post_padded, groups)."""
    num_slots = ids.size
    sorted_ids, block_experts, block_loras, groups = [], [], [], []
    for expert, lora in keys:
        if expert == -1:
            slots = np.flatnonzero(ids == -1)
        else:
            slots = np.flatnonzero((ids == expert) & (slot_lora == lora))
        if slots.size == 0:
            continue
        num_blocks = -(-slots.size // block_size)
        padded = np.full(num_blocks * block_size, num_slots, dtype=np.int64)
        padded[:slots.size] = slots
        groups.append((len(sorted_ids), len(sorted_ids) + padded.size))
        sorted_ids.extend(padded.tolist())
        if expert == -1:
            block_expert = -1
        elif expert_map is not None:
            block_expert = int(np.asarray(expert_map)[expert])
        else:
            block_expert = expert
        block_experts.extend([block_expert] * num_blocks)
        block_loras.extend([lora] * num_blocks)
    return (np.asarray(sorted_ids, dtype=np.int32), np.asarray(block_experts, dtype=np.int32),
            np.asarray(block_loras, dtype=np.int32), len(sorted_ids), groups)


def effective_lora_ids(token_lora_ids, max_loras, adapter_enabled=None):
    """The adapter each token runs with: token_lora_ids[m] when it is in [0, max_loras) and
    enabled (adapter_enabled[l] != 0), else -1 (base only). int64 [M]."""
    ids = np.asarray(token_lora_ids).astype(np.int64).reshape(-1)
    valid = (ids >= 0) & (ids < max_loras)
    if adapter_enabled is not None:
        enabled = np.asarray(adapter_enabled).astype(np.int64).reshape(-1) != 0
        valid &= enabled[np.clip(ids, 0, max_loras - 1)]
    return np.where(valid, ids, -1)


def moe_lora_align_block_size(topk_ids, token_lora_ids, max_loras, block_size, num_experts, adapter_enabled=None,
                              expert_map=None):
    """The used part of moe_lora_align_block_size's outputs.

    Groups are (expert, adapter) pairs in expert-major order, an expert's base-only group
    (adapter -1: no adapter, or a disabled one) before its adapters 0..L-1, then the
    trailing group of dropped slots (expert -1, adapter -1).
    Returns (sorted_token_ids, expert_ids, block_lora_ids, num_tokens_post_padded: int,
    groups), as moe_align_block_size (the order of slots inside a group is free).
    """
    ids = np.asarray(topk_ids).astype(np.int64)
    top_k = ids.shape[1] if ids.ndim == 2 else 1
    ids = ids.reshape(-1)
    slot_lora = np.repeat(effective_lora_ids(token_lora_ids, max_loras, adapter_enabled), top_k)
    keys = [(e, l) for e in range(num_experts) for l in range(-1, max_loras)] + [(-1, -1)]
    return _align_groups(ids, slot_lora, keys, block_size, expert_map)


def _slice_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _lora_matrices(lora_a, lora_b, lora, expert):
    """[(A [r, K], B [N/S, r]) per slice] of one (adapter, expert) in float64."""
    return [(_f64(a[lora, expert]), _f64(b[lora, expert])) for a, b in zip(lora_a, lora_b)]


def _apply_delta(rows, matrices, scale, interleaved_slices):
    """The LoRA delta of input rows [n, K] -> [n, N] = scale * B (A row) per slice, the
    slices' columns in blocks (c * N/S + j) or interleaved (j * S + c)."""
    num_slices = len(matrices)
    parts = [(rows @ a.T) @ b.T * scale for a, b in matrices]
    width = parts[0].shape[1]
    delta = np.empty((rows.shape[0], width * num_slices))
    for c, part in enumerate(parts):
        if interleaved_slices:
            delta[:, c::num_slices] = part
        else:
            delta[:, c * width:(c + 1) * width] = part
    return delta


def lora_delta(a, topk_ids, token_lora_ids, lora_a, lora_b, adapter_enabled=None, adapter_scale=None,
               interleaved_slices=False):
    """The per-slot LoRA delta of an expert GEMM, following the ops.h contract literally:
        delta[s, col(c, j)] = scale[l] * sum_i lora_b[c][l, e, j, i] * sum_k lora_a[c][l, e, i, k] * a[row(s), k]
    for slot s = m * top_k + j with token m's adapter l (enabled, in range) and expert e =
    topk_ids[m, j] >= 0; zero rows for the other slots. a [M, K] (row = s // top_k) or
    [M * top_k, K] (row = s). lora_a / lora_b: lists of 1 or 2 slices (or one array).
    Returns (delta [M * top_k, N] float64, active [M * top_k] bool)."""
    lora_a, lora_b = _slice_list(lora_a), _slice_list(lora_b)
    ids = np.asarray(topk_ids).astype(np.int64)
    num_tokens, top_k = ids.shape
    num_slots = num_tokens * top_k
    max_loras = lora_a[0].shape[0]
    a = _f64(a)
    rows_per_slot = 1 if a.shape[0] == num_slots else top_k  # a row = slot // rows_per_slot
    scales = np.ones(max_loras) if adapter_scale is None else _f64(adapter_scale).reshape(-1)
    slot_lora = np.repeat(effective_lora_ids(token_lora_ids, max_loras, adapter_enabled), top_k)
    slot_expert = ids.reshape(-1)
    active = (slot_lora >= 0) & (slot_expert >= 0)
    width = lora_b[0].shape[2] * len(lora_b)
    delta = np.zeros((num_slots, width))
    for lora, expert in set(zip(slot_lora[active].tolist(), slot_expert[active].tolist())):
        slots = np.flatnonzero(active & (slot_lora == lora) & (slot_expert == expert))
        delta[slots] = _apply_delta(a[slots // rows_per_slot], _lora_matrices(lora_a, lora_b, lora, expert),
                                    scales[lora], interleaved_slices)
    return delta, active


def fused_moe_lora(out, a, topk_ids, token_lora_ids, lora_a, lora_b, adapter_enabled=None, adapter_scale=None,
                   topk_weights=None, mul_routed_weight=False, add_inputs=True, interleaved_slices=False):
    """fused_moe_lora's result [M * top_k, N] float64 from its input `out` (read only when
    add_inputs): rows of slots with an adapter and an expert get (out if add_inputs else
    0) + delta (times the routed weight when mul_routed_weight); the other rows keep out
    (add_inputs) or are zero."""
    delta, active = lora_delta(a, topk_ids, token_lora_ids, lora_a, lora_b, adapter_enabled, adapter_scale,
                               interleaved_slices)
    if mul_routed_weight:
        delta *= _f64(topk_weights).reshape(-1)[:, None]
    base = _f64(out).reshape(delta.shape) if add_inputs else np.zeros_like(delta)
    return np.where(active[:, None], base + delta, base)


def fused_moe(a, w, sorted_token_ids, expert_ids, num_tokens_post_padded, num_slots, topk_weights=None,
              mul_routed_weight=False, top_k=1, block_size=64):
    """The grouped GEMM, following the contract literally.

    Returns out [num_slots, N] float64 with NaN in the rows no block writes.
    """
    a = _f64(a)
    sorted_token_ids = np.asarray(sorted_token_ids).astype(np.int64).reshape(-1)
    expert_ids = np.asarray(expert_ids).astype(np.int64).reshape(-1)
    used = int(np.asarray(num_tokens_post_padded).reshape(-1)[0])
    weights = None if topk_weights is None else _f64(topk_weights).reshape(-1)
    out = np.full((num_slots, w.shape[1]), np.nan)
    for block in range(used // block_size):
        slots = sorted_token_ids[block * block_size:(block + 1) * block_size]
        slots = slots[slots < num_slots]
        expert = int(expert_ids[block])
        if expert == -1:
            out[slots] = 0.0
            continue
        rows = a[slots // top_k] @ _f64(w[expert]).T
        if mul_routed_weight:
            rows *= weights[slots][:, None]
        out[slots] = rows
    return out


def _lora_field(lora, name):
    if isinstance(lora, dict):
        return lora.get(name)
    return getattr(lora, name, None)


_QMAX = {"float8_e4m3fn": 448.0, "int8": 127.0}


def quantize(x, block_rows, block_cols, dtype, scales=None):
    """moelora's quantize in float32, as the op computes it: x [..., R, C] -> (q [..., R, C]
    as float64 holding the 8-bit values, scales [..., ceil(R/br), ceil(C/bc)] float32), one
    scale per block of block_rows x block_cols (0: the whole dim). Dynamic scales:
    max(absmax, 1e-10) / qmax; given `scales` (static) are used as they are.
    q = x / scale in float32, clamped to +-qmax, rounded to fp8 e4m3 (nearest even) or
    int8 (half to even)."""
    import ml_dtypes  # fp8 rounding

    x32 = np.asarray(x).astype(np.float32)
    lead, (rows, cols) = x32.shape[:-2], x32.shape[-2:]
    br, bc = block_rows or max(rows, 1), block_cols or max(cols, 1)
    nrb, ncb = -(-rows // br), -(-cols // bc)
    qmax = np.float32(_QMAX[dtype])
    out_scales = np.empty(lead + (nrb, ncb), np.float32) if scales is None else np.broadcast_to(
        np.asarray(scales, np.float32), lead + (nrb, ncb))
    q = np.empty(x32.shape, np.float64)
    for rb in range(nrb):
        for cb in range(ncb):
            block = x32[..., rb * br:(rb + 1) * br, cb * bc:(cb + 1) * bc]
            if scales is None:
                absmax = np.abs(block).max(axis=(-2, -1)) if block.size else np.zeros(lead, np.float32)
                out_scales[..., rb, cb] = np.maximum(absmax, np.float32(1e-10)) / qmax
            scale = out_scales[..., rb, cb][..., None, None].astype(np.float32)
            v = np.clip(block / scale, -qmax, qmax).astype(np.float32)
            v = v.astype(ml_dtypes.float8_e4m3fn) if dtype == "float8_e4m3fn" else np.rint(v)
            q[..., rb * br:(rb + 1) * br, cb * bc:(cb + 1) * bc] = v.astype(np.float64)
    return q, np.array(out_scales)


def dequantize(q, scales, block_rows, block_cols):
    """q [..., R, C] times the scale of its block (scales [..., ceil(R/br), ceil(C/bc)]), float64."""
    q = _f64(q)
    rows, cols = q.shape[-2:]
    br, bc = block_rows or max(rows, 1), block_cols or max(cols, 1)
    s = _f64(scales)
    s = np.repeat(np.repeat(s, br, axis=-2)[..., :rows, :], bc, axis=-1)[..., :cols]
    return q * s


def _quantized_rows(values, granularity, block_k, dtype, static_scale):
    """Activation rows [n, K] quantized as fused_experts does (per token group of block_k,
    per row, or per tensor; static when static_scale is given) and dequantized."""
    shape = {"block": (1, block_k), "channel": (1, 0), "tensor": (0, 0)}[granularity]
    scales = None if static_scale is None else np.float32(static_scale)
    q, s = quantize(values, *shape, dtype, scales=scales)
    return dequantize(q, s, *shape)


def fused_experts(hidden_states, w13, w2, topk_weights, topk_ids, activation="silu", no_combine=False,
                  apply_router_weight_on_input=False, routed_scaling_factor=1.0, expert_map=None,
                  swiglu_alpha=1.702, swiglu_limit=7.0, lora=None, quant=None):
    """The MoE layer in float64, per slot (m, j) with expert e = topk_ids[m, j]:
    y[m, j] = act(x[m] @ w13[e].T) @ w2[e].T, weighted by topk_weights[m, j] (on GEMM1's
    output when apply_router_weight_on_input, else on y); zero for a dropped slot (e = -1)
    or an expert whose expert_map entry is -1 (w13/w2 indexed by expert_map[e]).
    Returns [M, H] = routed_scaling_factor * sum_j y[m, j], or y [M, top_k, H] with
    no_combine (no scaling).

    lora: None, or an object or dict with the fields of moelora.MoeLora (numpy arrays):
    token_lora_ids, w13_lora_a / w13_lora_b (lists of 1 or 2 slices), w2_lora_a,
    w2_lora_b, adapter_enabled, adapter_scale. A token with an enabled adapter l adds
    scale[l] * B (A h) to each GEMM's output before what follows reads it: the w13 delta
    before the activation (and the router weight on input), the w2 delta before the
    routed weight. Two w13 slices are gate and up: halves of w13's rows, or with
    swiglu_oai its even and odd rows; one slice covers w13's 2I rows in their order.

    quant: None, or a dict for quantized experts (one chunk): w13 / w2 are then the
    dequantized weights, and x and the activation are quantized as the op does:
    {"dtype": "float8_e4m3fn"|"int8", "activation_scales": "block"|"channel"|"tensor",
    "block_k": 128, "a13_scale": None|float, "a2_scale": None|float (static scales),
    "layer_dtype": the numpy dtype GEMM1's output is rounded to before the activation, and
    the activation before its quantization}.
    """
    x = _f64(hidden_states)
    ids = np.asarray(topk_ids).astype(np.int64)
    weights = _f64(topk_weights)
    num_tokens, top_k = ids.shape
    hidden_size = w2.shape[1]
    act = _ACTIVATIONS[activation]
    local_ids = ids.copy()
    if expert_map is not None:
        mapping = np.asarray(expert_map).astype(np.int64)
        local_ids = np.where(ids >= 0, mapping[np.maximum(ids, 0)], -1)
    token_lora = np.full(num_tokens, -1)  # no adapter: the loops below add no delta
    if lora is not None:
        w13_lora_a = _slice_list(_lora_field(lora, "w13_lora_a"))
        w13_lora_b = _slice_list(_lora_field(lora, "w13_lora_b"))
        w2_lora_a = _slice_list(_lora_field(lora, "w2_lora_a"))
        w2_lora_b = _slice_list(_lora_field(lora, "w2_lora_b"))
        max_loras = w13_lora_a[0].shape[0]
        token_lora = effective_lora_ids(_lora_field(lora, "token_lora_ids"), max_loras,
                                        _lora_field(lora, "adapter_enabled"))
        scale = _lora_field(lora, "adapter_scale")
        scales = np.ones(max_loras) if scale is None else _f64(scale).reshape(-1)
        interleaved = activation == "swiglu_oai" and len(w13_lora_a) == 2
    if quant is not None:
        return _fused_experts_quant(x, w13, w2, weights, local_ids, act, quant, no_combine,
                                    apply_router_weight_on_input, routed_scaling_factor, swiglu_alpha, swiglu_limit)
    per_slot = np.zeros((num_tokens, top_k, hidden_size))
    for expert in np.unique(local_ids[local_ids >= 0]):
        tokens, ks = np.nonzero(local_ids == expert)
        h = x[tokens] @ _f64(w13[expert]).T
        slot_lora = token_lora[tokens]
        for l in np.unique(slot_lora[slot_lora >= 0]):
            rows = slot_lora == l
            h[rows] += _apply_delta(x[tokens[rows]], _lora_matrices(w13_lora_a, w13_lora_b, l, expert),
                                    scales[l], interleaved)
        if apply_router_weight_on_input:
            h *= weights[tokens, ks][:, None]
        a = act(h, swiglu_alpha, swiglu_limit)
        y = a @ _f64(w2[expert]).T
        for l in np.unique(slot_lora[slot_lora >= 0]):
            rows = slot_lora == l
            y[rows] += _apply_delta(a[rows], _lora_matrices(w2_lora_a, w2_lora_b, l, expert), scales[l], False)
        if not apply_router_weight_on_input:
            y *= weights[tokens, ks][:, None]
        per_slot[tokens, ks] = y
    if no_combine:
        return per_slot
    return routed_scaling_factor * per_slot.sum(axis=1)


def _fused_experts_quant(x, w13, w2, weights, local_ids, act, quant, no_combine, weight_on_input,
                         routed_scaling_factor, swiglu_alpha, swiglu_limit):
    """fused_experts with quantized experts (see fused_experts' `quant`), without LoRA."""
    num_tokens, top_k = local_ids.shape
    hidden_size, inter = w2.shape[1], w2.shape[2]
    dtype, granularity, block_k = quant["dtype"], quant["activation_scales"], quant.get("block_k", 128)
    xq = _quantized_rows(x, granularity, block_k, dtype, quant.get("a13_scale"))
    acts = np.zeros((num_tokens * top_k, inter))
    for expert in np.unique(local_ids[local_ids >= 0]):
        tokens, ks = np.nonzero(local_ids == expert)
        h = xq[tokens] @ _f64(w13[expert]).T
        if weight_on_input:
            h *= weights[tokens, ks][:, None]
        # GEMM1's output reaches the activation in the layer dtype on every path.
        acts[tokens * top_k + ks] = act(_f64(h.astype(quant["layer_dtype"])), swiglu_alpha, swiglu_limit)
    acts = _f64(acts.astype(quant["layer_dtype"]))
    aq = _quantized_rows(acts, granularity, block_k, dtype, quant.get("a2_scale"))
    per_slot = np.zeros((num_tokens, top_k, hidden_size))
    for expert in np.unique(local_ids[local_ids >= 0]):
        tokens, ks = np.nonzero(local_ids == expert)
        y = aq[tokens * top_k + ks] @ _f64(w2[expert]).T
        if not weight_on_input:
            y *= weights[tokens, ks][:, None]
        per_slot[tokens, ks] = y
    if no_combine:
        return per_slot
    return routed_scaling_factor * per_slot.sum(axis=1)


def sparse_mla_decode(q, kv, indices, softmax_scale, topk_length=None, attn_sink=None):
    """Sparse MLA decode in float64: (out [T, Hq, 512], lse [T, Hq]).

    Entry i of token t is valid when i < topk_length[t] (clamped to [0, topk]) and
    indices[t, 0, i] is in [0, S); duplicates count each time. out = softmax over the
    valid entries (with e^sink in the denominator when attn_sink is given) times the first
    512 lanes of their kv rows; rows with no valid entry give zeros and lse -inf.
    """
    q = _f64(q)
    kv = _f64(kv)[:, 0, :]
    indices = np.asarray(indices).astype(np.int64)[:, 0, :]
    num_tokens, num_heads, _ = q.shape
    topk = indices.shape[1]
    value_dim = 512
    out = np.zeros((num_tokens, num_heads, value_dim))
    lse = np.full((num_tokens, num_heads), -np.inf)
    for t in range(num_tokens):
        length = topk if topk_length is None else min(max(int(topk_length[t]), 0), topk)
        rows = [int(r) for r in indices[t, :length] if 0 <= r < kv.shape[0]]
        if not rows:
            continue
        keys = kv[rows]                                  # [n, 576]
        logits = softmax_scale * (q[t] @ keys.T)         # [Hq, n]
        peak = logits.max(axis=1, keepdims=True)
        weights = np.exp(logits - peak)
        total = weights.sum(axis=1, keepdims=True)
        denominator = total if attn_sink is None else total + np.exp(_f64(attn_sink)[:, None] - peak)
        out[t] = (weights @ keys[:, :value_dim]) / denominator
        lse[t] = (peak + np.log(total))[:, 0]
    return out, lse
