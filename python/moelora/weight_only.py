"""Weight-only experts (w4a16 / w8a16, issue 30): the round-to-nearest quantizer, the
layer's packed layout, and GPTQ / AWQ checkpoint tensors in and out of it.

The layer's layout (include/moelora/ops.h, FusedExpertsQuant), per linear w [N, K]
(nn.Linear orientation, out x in) with group size G (0: one group per row):
  packed  uint8 [N, K / 2] (4-bit: byte k // 2 holds k, the even k in the low nibble)
          or [N, K] (8-bit)
  scales  [N, K / G] (or [N]) in the layer dtype
  zeros   uint8 [N, K / G] (or [N]), one value a byte; None: symmetric (8 / 128)
  w[n, k] = (q[n, k] - zero[n, k // G]) * scale[n, k // G]

GPTQ (AutoGPTQ / GPTQModel, "gptq" v1 and "gptq_v2"), per linear:
  qweight int32 [K / PF, N], packed along K (PF = 32 / bits values a word, the lowest k
          in the lowest bits); qzeros int32 [K / G, N / PF], packed along N; scales
          [K / G, N] fp16; g_idx int32 [K] (the group of each k). v1 stores zero - 1.
AWQ (AutoAWQ "gemm"), 4-bit only: qweight int32 [K, N / 8] and qzeros [K / G, N / 8],
  packed along N in the order [0, 2, 4, 6, 1, 3, 5, 7] (nibble i holds column
  AWQ_ORDER[i] of its 8); scales [K / G, N]; true zero points.
Every error is a ValueError naming the tensor and what was expected.
"""

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of a word holds column AWQ_ORDER[i] of its 8
GROUP_SIZES = (32, 64, 128)


def _error(op, message):
    return ValueError(f"moelora.{op}: {message}")


def _check_bits(op, bits, allowed=(4, 8)):
    if bits not in allowed:
        raise _error(op, f"argument 'bits' expected one of {allowed}, got {bits}")


def _groups(op, K, group_size):
    if group_size == 0:
        return 1, K
    if group_size not in GROUP_SIZES:
        raise _error(op, f"argument 'group_size' expected one of {GROUP_SIZES} or 0 (per channel), got {group_size}")
    if K % group_size != 0:
        raise _error(op, f"argument 'group_size' expected a divisor of K = {K}, got {group_size}")
    return K // group_size, group_size


def quantize_weight_only(w, bits=4, group_size=128, zero_points=False, scale_dtype=None):
    """Round-to-nearest quantization of w [..., N, K] (float) per group of group_size
    along K (0: per row), as GPTQ's quantizer: symmetric (zero_points False, sym=True):
    scale = 2 absmax / (2^bits - 1), zero = 2^(bits-1); asymmetric: scale = (max - min) /
    (2^bits - 1) over the group's range widened to hold 0, zero = round(-min / scale).
    q = clamp(round(w / scale) + zero, 0, 2^bits - 1). Returns (q uint8 [..., N, K]
    unpacked, scales [..., N, K / G] (or [..., N]) in scale_dtype (w's dtype when None;
    rounded before q is computed, so q, zero and scale describe the values exactly), zeros
    uint8 of the scales' shape or None)."""
    op = "quantize_weight_only"
    _check_bits(op, bits)
    w = torch.as_tensor(w)
    if w.dim() < 2 or not w.is_floating_point():
        raise _error(op, f"argument 'w' expected a float tensor [..., N, K], got {w.dtype} {list(w.shape)}")
    K = w.shape[-1]
    groups, size = _groups(op, K, group_size)
    maxq = (1 << bits) - 1
    scale_dtype = scale_dtype or (w.dtype if w.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16)
    wg = w.double().reshape(*w.shape[:-1], groups, size)
    if zero_points:
        lo = wg.amin(dim=-1).clamp(max=0.0)
        hi = wg.amax(dim=-1).clamp(min=0.0)
        scale = ((hi - lo) / maxq).clamp(min=1e-8).to(scale_dtype).double()
        zero = torch.round(-lo / scale).clamp(0, maxq)
    else:
        absmax = wg.abs().amax(dim=-1)
        scale = (2.0 * absmax / maxq).clamp(min=1e-8).to(scale_dtype).double()
        zero = torch.full_like(scale, float(1 << (bits - 1)))
    q = torch.round(wg / scale[..., None]) + zero[..., None]
    q = q.clamp(0, maxq).to(torch.uint8).reshape(w.shape)
    squeeze = (lambda t: t[..., 0]) if group_size == 0 else (lambda t: t)
    scales = squeeze(scale.to(scale_dtype))
    zeros = squeeze(zero.to(torch.uint8)) if zero_points else None
    return q, scales, zeros


def pack_int4(q):
    """q uint8 [..., K] (values < 16, K even) -> [..., K / 2]: byte j = q[2j] | q[2j+1] << 4."""
    q = torch.as_tensor(q, dtype=torch.uint8)
    if q.shape[-1] % 2 != 0:
        raise _error("pack_int4", f"argument 'q' expected an even last dim, got {list(q.shape)}")
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed):
    """The inverse of pack_int4: [..., K / 2] -> [..., K]."""
    packed = torch.as_tensor(packed, dtype=torch.uint8)
    out = torch.stack((packed & 15, packed >> 4), dim=-1)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_zeros_int4(zeros):
    """4-bit zero points [..., N, G] one a byte -> packed along N [..., N / 2, G] (the even
    n in the low nibble: vLLM's moe_wna16 w13_qzeros)."""
    zeros = torch.as_tensor(zeros, dtype=torch.uint8)
    return zeros[..., 0::2, :] | (zeros[..., 1::2, :] << 4)


def to_layer(q, bits):
    """Unpacked q [..., N, K] -> the layer's packed bytes (4-bit packed along K)."""
    return pack_int4(q) if bits == 4 else torch.as_tensor(q, dtype=torch.uint8).contiguous()


def dequantize(packed, scales, zeros, bits, group_size, dtype=torch.float64):
    """The layer's weights back as floats: packed [..., N, K*bits/8], scales [..., N, G]
    (or [..., N]), zeros like the scales (or packed [..., N / 2, G] for 4-bit) or None."""
    q = unpack_int4(packed) if bits == 4 else torch.as_tensor(packed, dtype=torch.uint8)
    K = q.shape[-1]
    groups, size = _groups("dequantize", K, group_size)
    scales = torch.as_tensor(scales)
    s = scales.reshape(*scales.shape[:-1], groups) if group_size else scales[..., None]
    s = s.to(dtype)
    if zeros is None:
        z = torch.full_like(s, float(1 << (bits - 1)))
    else:
        zeros = torch.as_tensor(zeros, dtype=torch.uint8)
        if group_size == 0:
            zeros = zeros[..., None]
        if bits == 4 and zeros.shape[-2] * 2 == q.shape[-2]:  # packed along N
            zeros = torch.stack((zeros & 15, zeros >> 4), dim=-2).reshape(*zeros.shape[:-2], -1, zeros.shape[-1])
        z = zeros.to(dtype)
    qg = q.to(dtype).reshape(*q.shape[:-1], groups, size)
    return ((qg - z[..., None]) * s[..., None]).reshape(q.shape)


# ---- GPTQ -------------------------------------------------------------------------

def _pack_words(values, bits, dim):
    """Pack unsigned values along `dim` into int32 words, the lowest index in the lowest bits."""
    per_word = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    if v.shape[-1] % per_word != 0:
        raise _error("pack", f"expected a multiple of {per_word} values along the packed dim, got {v.shape[-1]}")
    v = v.reshape(*v.shape[:-1], -1, per_word)
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    words = (v << shifts).sum(dim=-1)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words.movedim(-1, dim)


def _unpack_words(words, bits, dim):
    per_word = 32 // bits
    w = words.to(torch.int64).movedim(dim, -1) & 0xFFFFFFFF
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    v = (w[..., None] >> shifts) & ((1 << bits) - 1)
    return v.reshape(*w.shape[:-1], -1).to(torch.uint8).movedim(-1, dim)


def to_gptq(q, scales, zeros, bits, group_size, checkpoint_format="gptq"):
    """One linear's GPTQ tensors from quantize_weight_only's (q [N, K] unpacked, scales
    [N, K / G], zeros or None: symmetric, stored as 2^(bits-1)). Returns a dict of
    qweight, qzeros, scales (fp16 unless given fp16/bf16: kept), g_idx; v1 ("gptq") stores
    zero - 1 (wrapping 0 to 2^bits - 1, as AutoGPTQ's packing does)."""
    op = "to_gptq"
    _check_bits(op, bits)
    q = torch.as_tensor(q, dtype=torch.uint8)
    N, K = q.shape
    groups, size = _groups(op, K, group_size)
    s = scales if group_size else scales[:, None]
    z = zeros if zeros is not None else torch.full((N, groups), 1 << (bits - 1), dtype=torch.uint8)
    z = z if group_size or zeros is None else z[:, None]
    z = z.to(torch.int64)
    if checkpoint_format == "gptq":
        z = (z - 1) % (1 << bits)
    elif checkpoint_format != "gptq_v2":
        raise _error(op, f"argument 'checkpoint_format' expected 'gptq' or 'gptq_v2', got {checkpoint_format!r}")
    return {
        "qweight": _pack_words(q.t(), bits, 0),            # [K / PF, N]
        "qzeros": _pack_words(z.t(), bits, 1),             # [G, N / PF]
        "scales": s.t().contiguous(),                      # [G, N]
        "g_idx": (torch.arange(K, dtype=torch.int32) // size).to(torch.int32),
    }


def from_gptq(qweight, qzeros, scales, g_idx=None, bits=4, group_size=128, sym=True, checkpoint_format="gptq",
              name="gptq"):
    """One linear's GPTQ tensors -> the layer's (packed [N, K*bits/8], scales [N, K / G] or
    [N] (group_size 0 / -1), zeros [N, K / G] or None when sym). desc_act checkpoints
    (a g_idx other than k // group_size) are refused: the layer applies scale groups in
    K order. `name` prefixes the messages (the checkpoint key)."""
    op = "from_gptq"
    _check_bits(op, bits)
    group_size = 0 if group_size in (-1, None) else int(group_size)
    qweight = torch.as_tensor(qweight)
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise _error(op, f"'{name}.qweight' expected int32 [K * {bits} / 32, N], got {qweight.dtype} "
                         f"{list(qweight.shape)}")
    per_word = 32 // bits
    K, N = qweight.shape[0] * per_word, qweight.shape[1]
    groups, size = _groups(op, K, group_size)
    scales = torch.as_tensor(scales)
    if tuple(scales.shape) != (groups, N) or scales.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise _error(op, f"'{name}.scales' expected a float [{groups}, {N}] (K / group_size, N), got "
                         f"{scales.dtype} {list(scales.shape)}")
    if g_idx is not None:
        g_idx = torch.as_tensor(g_idx)
        if tuple(g_idx.shape) != (K,):
            raise _error(op, f"'{name}.g_idx' expected [{K}] (K), got {list(g_idx.shape)}")
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            raise _error(op, f"'{name}.g_idx' expected group ids in [0, {groups}), got "
                             f"[{int(g_idx.min())}, {int(g_idx.max())}]")
        if not torch.equal(g_idx.to(torch.int64), torch.arange(K) // size):
            raise _error(op, f"'{name}.g_idx' is not k // group_size: desc_act (act-order) checkpoints are not "
                             f"supported (the layer applies scale groups in K order); requantize without desc_act")
    q = _unpack_words(qweight, bits, 0).t()  # [N, K]
    zeros = None
    if not sym:
        qzeros = torch.as_tensor(qzeros)
        if qzeros.dtype != torch.int32 or tuple(qzeros.shape) != (groups, N // per_word) or N % per_word:
            raise _error(op, f"'{name}.qzeros' expected int32 [{groups}, {N // per_word}] (K / group_size, "
                             f"N * {bits} / 32), got {qzeros.dtype} {list(qzeros.shape)}")
        z = _unpack_words(qzeros, bits, 1).t().to(torch.int64)  # [N, G]
        if checkpoint_format == "gptq":
            z = (z + 1) % (1 << bits)
        elif checkpoint_format != "gptq_v2":
            raise _error(op, f"argument 'checkpoint_format' expected 'gptq' or 'gptq_v2', got {checkpoint_format!r}")
        zeros = z.to(torch.uint8).contiguous()
        if group_size == 0:
            zeros = zeros[:, 0].contiguous()
    s = scales.t().contiguous()
    if group_size == 0:
        s = s[:, 0].contiguous()
    return to_layer(q, bits), s, zeros


# ---- AWQ --------------------------------------------------------------------------

def _awq_pack(values):
    """values [..., N] (4-bit) -> int32 [..., N / 8] in AWQ's interleaved order."""
    if values.shape[-1] % 8 != 0:
        raise _error("to_awq", f"expected N a multiple of 8, got {values.shape[-1]}")
    v = values.to(torch.int64).reshape(*values.shape[:-1], -1, 8)[..., list(AWQ_ORDER)]
    words = (v << (torch.arange(8, dtype=torch.int64) * 4)).sum(dim=-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def _awq_unpack(words):
    w = words.to(torch.int64) & 0xFFFFFFFF
    nibbles = (w[..., None] >> (torch.arange(8, dtype=torch.int64) * 4)) & 15  # nibble i
    columns = torch.empty_like(nibbles)
    columns[..., list(AWQ_ORDER)] = nibbles  # column AWQ_ORDER[i] <- nibble i
    return columns.reshape(*w.shape[:-1], -1).to(torch.uint8)


def to_awq(q, scales, zeros, group_size):
    """One linear's AWQ tensors (4-bit) from quantize_weight_only's: qweight [K, N / 8],
    qzeros [K / G, N / 8] (symmetric: 8), scales [K / G, N]."""
    q = torch.as_tensor(q, dtype=torch.uint8)
    N, K = q.shape
    groups, _ = _groups("to_awq", K, group_size)
    s = scales if group_size else scales[:, None]
    z = zeros if zeros is not None else torch.full((N, groups), 8, dtype=torch.uint8)
    z = z if group_size or zeros is None else z[:, None]
    return {"qweight": _awq_pack(q.t()), "qzeros": _awq_pack(z.t()), "scales": s.t().contiguous()}


def from_awq(qweight, qzeros, scales, group_size=128, zero_point=True, name="awq"):
    """One linear's AWQ tensors -> the layer's (packed [N, K / 2], scales [N, K / G],
    zeros [N, K / G], or None when zero_point is False)."""
    op = "from_awq"
    qweight = torch.as_tensor(qweight)
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise _error(op, f"'{name}.qweight' expected int32 [K, N / 8], got {qweight.dtype} {list(qweight.shape)}")
    K, N = qweight.shape[0], qweight.shape[1] * 8
    groups, _ = _groups(op, K, 0 if group_size in (-1, None) else int(group_size))
    scales = torch.as_tensor(scales)
    if tuple(scales.shape) != (groups, N) or scales.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise _error(op, f"'{name}.scales' expected a float [{groups}, {N}] (K / group_size, N), got "
                         f"{scales.dtype} {list(scales.shape)}")
    q = _awq_unpack(qweight).t()  # [N, K]
    zeros = None
    if zero_point:
        qzeros = torch.as_tensor(qzeros)
        if qzeros.dtype != torch.int32 or tuple(qzeros.shape) != (groups, N // 8):
            raise _error(op, f"'{name}.qzeros' expected int32 [{groups}, {N // 8}] (K / group_size, N / 8), "
                             f"got {qzeros.dtype} {list(qzeros.shape)}")
        zeros = _awq_unpack(qzeros).t().contiguous()
    s = scales.t().contiguous()
    if group_size in (0, -1, None):
        s = s[:, 0].contiguous()
        zeros = zeros[:, 0].contiguous() if zeros is not None else None
    return to_layer(q, 4), s, zeros
