"""A float64 numpy reference of every moelora op, for tests and for checking results.

Inputs may be numpy arrays of any float dtype (ml_dtypes.bfloat16 included) or of int
ids; everything is computed in float64. The semantics are those of
include/moelora/ops.h.
"""

import math

import numpy as np

__all__ = [
    "fused_experts",
    "fused_moe",
    "gelu_and_mul",
    "moe_align_block_size",
    "moe_sum_reduce",
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
    num_slots = ids.size
    sorted_ids, block_experts, groups = [], [], []
    # Experts in ascending id, then the trailing group of dropped slots (id -1).
    for expert in list(range(num_experts)) + [-1]:
        slots = np.flatnonzero(ids == expert)
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
    return (np.asarray(sorted_ids, dtype=np.int32), np.asarray(block_experts, dtype=np.int32),
            len(sorted_ids), groups)


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


def fused_experts(hidden_states, w13, w2, topk_weights, topk_ids, activation="silu", no_combine=False,
                  apply_router_weight_on_input=False, routed_scaling_factor=1.0, expert_map=None,
                  swiglu_alpha=1.702, swiglu_limit=7.0):
    """The MoE layer in float64, per slot (m, j) with expert e = topk_ids[m, j]:
    y[m, j] = act(x[m] @ w13[e].T) @ w2[e].T, weighted by topk_weights[m, j] (on GEMM1's
    output when apply_router_weight_on_input, else on y); zero for a dropped slot (e = -1)
    or an expert whose expert_map entry is -1 (w13/w2 indexed by expert_map[e]).
    Returns [M, H] = routed_scaling_factor * sum_j y[m, j], or y [M, top_k, H] with
    no_combine (no scaling).
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
    per_slot = np.zeros((num_tokens, top_k, hidden_size))
    for expert in np.unique(local_ids[local_ids >= 0]):
        tokens, ks = np.nonzero(local_ids == expert)
        h = x[tokens] @ _f64(w13[expert]).T
        if apply_router_weight_on_input:
            h *= weights[tokens, ks][:, None]
        y = act(h, swiglu_alpha, swiglu_limit) @ _f64(w2[expert]).T
        if not apply_router_weight_on_input:
            y *= weights[tokens, ks][:, None]
        per_slot[tokens, ks] = y
    if no_combine:
        return per_slot
    return routed_scaling_factor * per_slot.sum(axis=1)
