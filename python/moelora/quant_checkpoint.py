"""Quantized expert weights from checkpoints, for FusedMoE.load_quantized_experts.

Two layouts, per expert and projection (nn.Linear orientation, [out, in]):
- DeepSeek-V3 / Qwen3-FP8 (block scales): <prefix>.experts.<e>.<proj>.weight fp8 e4m3
  and <proj>.weight_scale_inv [ceil(out/128), ceil(in/128)] float32 (the factor that
  multiplies the fp8 values back, despite the name).
- per-tensor / per-channel (compressed-tensors, fp8 or int8): <proj>.weight,
  <proj>.weight_scale ([] or [1] per tensor, [out] or [out, 1] per channel) and, for
  static activation scales, <proj>.input_scale ([] or [1]).
- weight-only (issue 30): GPTQ (qweight, qzeros, scales, g_idx) or AWQ (qweight, qzeros,
  scales) per expert and projection: read_weight_only_experts.
<proj> is gate_proj / up_proj / down_proj, or Mixtral's w1 / w3 / w2. The layer's
w13 [E, 2I, H] stacks gate rows then up rows (gpt-oss's interleaved rows are not a
checkpoint layout of this kind). Every error is a ValueError naming the key.
"""

import torch

from . import ops as _ops

_PROJECTIONS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def _error(message):
    return ValueError(f"FusedMoE.load_quantized_experts: {message}")


def _projection_names(tensors, prefix):
    for names in _PROJECTIONS:
        if f"{prefix}.experts.0.{names[0]}.weight" in tensors:
            return names
    raise _error(f"no expert weights under '{prefix}.experts.0.' (expected gate_proj/up_proj/down_proj "
                 f"or w1/w3/w2 .weight keys)")


def _get(tensors, key):
    if key not in tensors:
        raise _error(f"key '{key}' is missing")
    return torch.as_tensor(tensors[key])


def _requantize(q, old_scale, new_scale, scheme):
    """q (fp8/int8) with scale old_scale, re-expressed with the larger new_scale."""
    if float(old_scale) == float(new_scale):
        return q
    values = q.float() * float(old_scale)
    scale = torch.tensor([[float(new_scale)]], dtype=torch.float32)
    requantized, _ = _ops.quantize(values, 0, 0, scheme.element, scales=scale, static_scales=True)
    return requantized


def read_quantized_experts(tensors, prefix, scheme, local_experts, hidden_size, intermediate_size):
    """(w13, w2, w13_scale, w2_scale, a13_scale, a2_scale) of the experts `local_experts`
    (global ids, in local order) in the layouts fused_experts takes (quantize_weights'):
    scales [E, ceil(N/bn), ceil(K/bk)] (block), [E, N] (channel), [E] (tensor); the static
    activation scales [1] (the largest over the experts, as vLLM loads them) or None.
    Per-tensor schemes hold one scale per expert for w13: when a checkpoint's gate and up
    scales differ, the projection with the smaller one is requantized to the larger."""
    gate, up, down = _projection_names(tensors, prefix)
    block = scheme.weight_scales == _ops._ext.ScaleGranularity.block
    channel = scheme.weight_scales == _ops._ext.ScaleGranularity.channel
    element = getattr(torch, scheme.element)
    I, H = intermediate_size, hidden_size
    if block and I % scheme.block_n != 0:
        raise _error(f"block scales need the intermediate size ({I}) to be a multiple of block_n "
                     f"({scheme.block_n}): gate and up blocks would share w13's scale rows")
    w13, w2, s13, s2, in13, in2 = [], [], [], [], [], []
    for expert in local_experts:
        base = f"{prefix}.experts.{expert}"
        weights, scales = {}, {}
        for proj, shape in ((gate, (I, H)), (up, (I, H)), (down, (H, I))):
            key = f"{base}.{proj}.weight"
            w = _get(tensors, key)
            if tuple(w.shape) != shape or w.dtype != element:
                raise _error(f"key '{key}' expected {scheme.element} {list(shape)}, got {w.dtype} {list(w.shape)}")
            scale_key = f"{base}.{proj}.weight_scale_inv" if block else f"{base}.{proj}.weight_scale"
            s = _get(tensors, scale_key).float()
            rows, cols = shape
            expected = ((-(-rows // scheme.block_n), -(-cols // scheme.block_k)) if block
                        else (rows,) if channel else ())
            s = s.reshape(-1) if channel else s.reshape(()) if not block else s
            if tuple(s.shape) != expected:
                raise _error(f"key '{scale_key}' expected shape {list(expected)}, got {list(s.shape)}")
            weights[proj], scales[proj] = w, s
            if scheme.static_activation_scales:
                in_scale = _get(tensors, f"{base}.{proj}.input_scale").float().reshape(())
                (in2 if proj == down else in13).append(in_scale)
        if not block and not channel:
            top = torch.maximum(scales[gate], scales[up])
            weights[gate] = _requantize(weights[gate], scales[gate], top, scheme)
            weights[up] = _requantize(weights[up], scales[up], top, scheme)
            s13.append(top)
        else:
            s13.append(torch.cat([scales[gate], scales[up]], dim=0))
        w13.append(torch.cat([weights[gate], weights[up]], dim=0))
        w2.append(weights[down])
        s2.append(scales[down])
    a13 = torch.stack(in13).max().reshape(1) if in13 else None
    a2 = torch.stack(in2).max().reshape(1) if in2 else None
    return torch.stack(w13), torch.stack(w2), torch.stack(s13), torch.stack(s2), a13, a2


# ---- weight-only experts (GPTQ / AWQ, issue 30) -------------------------------------

def _weight_only_format(tensors, key, quant_config):
    """'gptq' or 'awq': the config's quant_method, else from the qweight's shape (GPTQ
    packs along K: [K / PF, N]; AWQ along N: [K, N / 8])."""
    method = (quant_config or {}).get("quant_method")
    if method in ("gptq", "awq"):
        return method
    if method is not None:
        raise _error(f"quant_config's quant_method expected 'gptq' or 'awq', got {method!r}")
    return "gptq" if f"{key}.g_idx" in tensors else "awq"


def read_weight_only_experts(tensors, prefix, scheme, local_experts, hidden_size, intermediate_size,
                             quant_config=None):
    """(w13, w2, w13_scale, w2_scale, w13_zero, w2_zero) of the experts `local_experts`
    (global ids, in local order) from GPTQ or AWQ tensors (<prefix>.experts.<e>.<proj>.
    qweight / qzeros / scales [/ g_idx]), in the layer's layout (moelora.weight_only):
    packed uint8 [E, N, K * bits / 8], scales [E, N, K / G] (or [E, N]) as stored, zero
    points uint8 [E, N, K / G] (or [E, N]) or None. quant_config: the checkpoint's
    quantization_config (quant_method 'gptq' / 'awq', bits, group_size, sym, desc_act,
    checkpoint_format 'gptq' / 'gptq_v2', zero_point); it must agree with the scheme."""
    from . import weight_only
    config = dict(quant_config or {})
    bits, group_size = scheme.weight_bits, scheme.group_size
    if int(config.get("bits", config.get("w_bit", bits))) != bits:
        raise _error(f"quant_config's bits {config.get('bits', config.get('w_bit'))} differ from scheme "
                     f"{scheme.name} ({bits} bits)")
    config_group = int(config.get("group_size", config.get("q_group_size", group_size or -1)))
    if (config_group if config_group > 0 else 0) != group_size:
        raise _error(f"quant_config's group_size {config_group} differs from the scheme's ({group_size}; 0: per "
                     f"channel, -1 in a checkpoint)")
    if config.get("desc_act") and group_size:
        raise _error("quant_config has desc_act (act-order): not supported (the layer applies scale groups in K "
                     "order); requantize without desc_act")
    gate, up, down = None, None, None
    for names in _PROJECTIONS:
        if f"{prefix}.experts.{local_experts[0] if local_experts else 0}.{names[0]}.qweight" in tensors:
            gate, up, down = names
    if gate is None:
        raise _error(f"no weight-only experts under '{prefix}.experts.' (expected gate_proj/up_proj/down_proj "
                     f"or w1/w3/w2 .qweight keys)")
    I, H = intermediate_size, hidden_size
    stacks = {name: [] for name in ("w13", "w2", "s13", "s2", "z13", "z2")}
    for expert in local_experts:
        parts = {}
        for proj, (N, K) in ((gate, (I, H)), (up, (I, H)), (down, (H, I))):
            key = f"{prefix}.experts.{expert}.{proj}"
            fmt = _weight_only_format(tensors, key, config)
            if fmt == "awq":
                if bits != 4:
                    raise _error(f"key '{key}.qweight': AWQ checkpoints are 4-bit, scheme {scheme.name} is {bits}")
                zero_point = bool(config.get("zero_point", scheme.zero_points))
                if zero_point != scheme.zero_points:
                    raise _error(f"quant_config's zero_point {zero_point} differs from the scheme's zero_points "
                                 f"{scheme.zero_points}")
                w, s, z = weight_only.from_awq(_get(tensors, f"{key}.qweight"),
                                               _get(tensors, f"{key}.qzeros") if zero_point else None,
                                               _get(tensors, f"{key}.scales"), group_size or -1, zero_point, name=key)
            else:
                sym = bool(config.get("sym", not scheme.zero_points))
                if sym == scheme.zero_points:
                    raise _error(f"quant_config's sym {sym} disagrees with the scheme's zero_points "
                                 f"{scheme.zero_points}")
                g_idx = tensors[f"{key}.g_idx"] if f"{key}.g_idx" in tensors else None
                w, s, z = weight_only.from_gptq(_get(tensors, f"{key}.qweight"),
                                                None if sym else _get(tensors, f"{key}.qzeros"),
                                                _get(tensors, f"{key}.scales"), g_idx, bits, group_size or -1, sym,
                                                config.get("checkpoint_format", "gptq"), name=key)
            expected = (N, K * bits // 8)
            if tuple(w.shape) != expected:
                raise _error(f"key '{key}.qweight' holds a [{w.shape[0]}, {w.shape[1] * 8 // bits}] (out, in) "
                             f"weight, expected [{N}, {K}]")
            parts[proj] = (w, s, z)
        stacks["w13"].append(torch.cat([parts[gate][0], parts[up][0]], dim=0))
        stacks["s13"].append(torch.cat([parts[gate][1], parts[up][1]], dim=0))
        stacks["w2"].append(parts[down][0])
        stacks["s2"].append(parts[down][1])
        if scheme.zero_points:
            stacks["z13"].append(torch.cat([parts[gate][2], parts[up][2]], dim=0))
            stacks["z2"].append(parts[down][2])
    zeros = (torch.stack(stacks["z13"]), torch.stack(stacks["z2"])) if scheme.zero_points else (None, None)
    return (torch.stack(stacks["w13"]), torch.stack(stacks["w2"]), torch.stack(stacks["s13"]),
            torch.stack(stacks["s2"])) + zeros
