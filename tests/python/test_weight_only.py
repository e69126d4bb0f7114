"""Weight-only experts (w4a16 / w8a16, issue 30): the round-to-nearest quantizer, GPTQ and
AWQ checkpoint tensors in and out of the layer's layout (read back from safetensors files
the tests write), fused_experts / the torch op / FusedMoE against the float64 layer on
the dequantized weights, and the bad-input classes."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import moelora  # noqa: E402
from moelora import reference, weight_only  # noqa: E402
from moelora_testing import HAS_TORCH_CUDA, TORCH_BACKENDS, rel_error, torch_device  # noqa: E402

E, TOP_K, H, I = 6, 2, 256, 128


def _routing(M, experts, device, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(M, experts, generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, -1), TOP_K)
    return weights.float().to(device), ids.int().to(device)


def _reference(x, w13, w2, weights, ids, **kw):
    return reference.fused_experts(x.double().cpu().numpy(), w13.double().cpu().numpy(),
                                   w2.double().cpu().numpy(), weights.double().cpu().numpy(),
                                   ids.cpu().numpy(), **kw)


# ---- the quantizer and the checkpoint formats ----------------------------------------

@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128, 0])
@pytest.mark.parametrize("zero_points", [False, True])
def test_quantizer_round_trips_and_bounds_the_error(bits, group, zero_points):
    torch.manual_seed(bits * 1000 + group + zero_points)
    w = torch.randn(3, 96, 256) * 0.05
    q, scales, zeros = weight_only.quantize_weight_only(w, bits, group, zero_points)
    assert q.dtype == torch.uint8 and int(q.max()) < (1 << bits)
    assert scales.shape == ((3, 96, 256 // group) if group else (3, 96))
    packed = weight_only.to_layer(q, bits)
    assert packed.shape == (3, 96, 256 * bits // 8)
    assert torch.equal(weight_only.unpack_int4(packed) if bits == 4 else packed, q)
    deq = weight_only.dequantize(packed, scales, zeros, bits, group)
    # Round to nearest: half a step (the group's scale) from most weights, up to a whole
    # step at the grid's ends (symmetric: [-2^(b-1), 2^(b-1) - 1] clips the largest value;
    # asymmetric: the rounded zero point shifts the grid; with 8 bits the bf16 scale's
    # rounding, 2^-9 relative over 255 steps, moves the far end by up to half a step more).
    step = scales.double().reshape(3, 96, -1).repeat_interleave(group or 256, dim=-1)
    error = (deq - w.double()).abs() / step
    assert float(error.max()) <= (1.0 if bits == 4 else 1.5) + 1e-3
    assert float(error.mean()) <= 0.26


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 128, 0])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
def test_gptq_tensors_round_trip(bits, group, sym, checkpoint_format):
    torch.manual_seed(7)
    w = torch.randn(64, 256)
    q, s, z = weight_only.quantize_weight_only(w, bits, group, not sym, scale_dtype=torch.float16)
    t = weight_only.to_gptq(q, s, z, bits, group, checkpoint_format)
    assert t["qweight"].dtype == torch.int32 and t["qweight"].shape == (256 * bits // 32, 64)
    assert t["qzeros"].shape == ((256 // group if group else 1), 64 * bits // 32)
    if sym and checkpoint_format == "gptq" and bits == 4:
        assert bool((t["qzeros"] == 0x77777777).all())  # v1 stores zero - 1
    packed, scales, zeros = weight_only.from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits,
                                                  group or -1, sym, checkpoint_format)
    assert torch.equal(packed, weight_only.to_layer(q, bits)) and torch.equal(scales, s)
    assert (zeros is None) == sym and (sym or torch.equal(zeros, z))


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("zero_point", [True, False])
def test_awq_tensors_round_trip_in_the_interleaved_order(group, zero_point):
    torch.manual_seed(8)
    q, s, z = weight_only.quantize_weight_only(torch.randn(64, 256), 4, group, zero_point, scale_dtype=torch.float16)
    t = weight_only.to_awq(q, s, z, group)
    assert t["qweight"].shape == (256, 8)
    # Column n of each 8 sits in nibble AWQ_ORDER.index(n % 8): nibble i holds column AWQ_ORDER[i].
    word = int(t["qweight"][0, 0]) & 0xFFFFFFFF
    nibbles = [(word >> (4 * i)) & 15 for i in range(8)]
    assert nibbles == [int(q[weight_only.AWQ_ORDER[i], 0]) for i in range(8)]
    packed, scales, zeros = weight_only.from_awq(t["qweight"], t["qzeros"], t["scales"], group, zero_point)
    assert torch.equal(packed, weight_only.to_layer(q, 4)) and torch.equal(scales, s)
    assert (zeros is None) == (not zero_point) and (not zero_point or torch.equal(zeros, z))


def test_checkpoint_errors_name_the_tensor():
    q, s, z = weight_only.quantize_weight_only(torch.randn(64, 256), 4, 128, True, scale_dtype=torch.float16)
    t = weight_only.to_gptq(q, s, z, 4, 128)
    bad_g_idx = t["g_idx"].clone()
    bad_g_idx[3] = 9
    with pytest.raises(ValueError, match=r"'w\.g_idx' expected group ids in \[0, 2\)"):
        weight_only.from_gptq(t["qweight"], t["qzeros"], t["scales"], bad_g_idx, 4, 128, False, name="w")
    act_order = t["g_idx"].flip(0).contiguous()
    with pytest.raises(ValueError, match="desc_act"):
        weight_only.from_gptq(t["qweight"], t["qzeros"], t["scales"], act_order, 4, 128, False)
    with pytest.raises(ValueError, match=r"'w\.qzeros' expected int32 \[2, 8\]"):
        weight_only.from_gptq(t["qweight"], t["qzeros"][:, :4], t["scales"], t["g_idx"], 4, 128, False, name="w")
    with pytest.raises(ValueError, match=r"'w\.scales' expected a float \[2, 64\]"):
        weight_only.from_gptq(t["qweight"], t["qzeros"], t["scales"][:1], t["g_idx"], 4, 128, False, name="w")
    with pytest.raises(ValueError, match="group_size"):
        weight_only.quantize_weight_only(torch.randn(8, 96), 4, 64)
    with pytest.raises(ValueError, match="bits"):
        weight_only.quantize_weight_only(torch.randn(8, 128), 3, 32)


# ---- the op ------------------------------------------------------------------------

@pytest.mark.parametrize("backend", TORCH_BACKENDS)
@pytest.mark.parametrize("scheme,group,zero_points", [("w4a16", 128, False), ("w4a16", 32, True),
                                                       ("w4a16", 0, True), ("w8a16", 0, False),
                                                       ("w8a16", 64, True)])
@pytest.mark.parametrize("M", [0, 1, 5, 100])
def test_fused_experts_matches_the_dequantized_layer(backend, scheme, group, zero_points, M):
    device = torch_device(backend)
    torch.manual_seed(M + group)
    q = moelora.quant_scheme(scheme, group_size=group, zero_points=zero_points)
    assert q.weight_only and q.weight_bits == (4 if scheme == "w4a16" else 8)
    w13, w2 = torch.randn(E, 2 * I, H) * 0.05, torch.randn(E, H, I) * 0.05
    p13, s13, z13 = moelora.quantize_weights(w13.to(torch.bfloat16), q)
    p2, s2, z2 = moelora.quantize_weights(w2.to(torch.bfloat16), q)
    x = torch.randn(M, H).to(torch.bfloat16)
    weights, ids = _routing(M, E, device, M)
    quant = moelora.MoeQuant(q, s13.to(device), s2.to(device), w13_zero=None if z13 is None else z13.to(device),
                             w2_zero=None if z2 is None else z2.to(device))
    out = moelora.fused_experts(x.to(device), p13.to(device), p2.to(device), weights, ids, quant=quant)
    ref = _reference(x, weight_only.dequantize(p13, s13, z13, q.weight_bits, group),
                     weight_only.dequantize(p2, s2, z2, q.weight_bits, group), weights, ids)
    assert out.shape == (M, H)
    if M:
        assert rel_error(out.float().cpu(), ref) <= 1e-2


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_torch_op_and_layer_with_lora_and_expert_map(backend):
    device = torch_device(backend)
    torch.manual_seed(3)
    expert_map = torch.tensor([0, -1, 1, 2, -1, 3], dtype=torch.int32)
    layer = moelora.FusedMoE(E, TOP_K, H, I, dtype=torch.bfloat16, device=device, expert_map=expert_map,
                             quant=moelora.quant_scheme("w4a16", group_size=64, zero_points=True), max_loras=2,
                             max_lora_rank=8)
    w13, w2 = torch.randn(4, 2 * I, H) * 0.05, torch.randn(4, H, I) * 0.05
    with pytest.raises(ValueError, match="not loaded"):
        layer(torch.randn(2, H, device=device).to(torch.bfloat16), torch.randn(2, E, device=device))
    layer.load_weights(w13, w2)
    assert layer.w13.dtype == torch.uint8 and layer.w13.shape == (4, 2 * I, H // 2)
    assert layer.w13_weight_scale.dtype == torch.bfloat16 and layer.w13_weight_zero.shape == (4, 2 * I, H // 64)
    x = torch.randn(7, H, device=device).to(torch.bfloat16)
    logits = torch.randn(7, E, device=device)
    weights, ids = layer.route(logits)
    deq13 = weight_only.dequantize(layer.w13.cpu(), layer.w13_weight_scale.cpu(), layer.w13_weight_zero.cpu(), 4, 64)
    deq2 = weight_only.dequantize(layer.w2.cpu(), layer.w2_weight_scale.cpu(), layer.w2_weight_zero.cpu(), 4, 64)
    ref = _reference(x, deq13, deq2, weights, ids, expert_map=expert_map.numpy())
    assert rel_error(layer(x, logits).float().cpu(), ref) <= 1e-2
    # An adapter in slot 1 on some tokens: the op adds its deltas on the dequantized layer.
    lora = {}
    for name, shape in (("w13_lora_a", (2, 2, 4, 8, H)), ("w13_lora_b", (2, 2, 4, I, 8)),
                        ("w2_lora_a", (2, 4, 8, I)), ("w2_lora_b", (2, 4, H, 8))):
        lora[name] = (torch.randn(shape) * 0.1).to(torch.bfloat16)
        getattr(layer, name).copy_(lora[name].to(device))
    layer.adapter_enabled.fill_(1)
    layer.adapter_scale.fill_(1.0)
    token_lora_ids = torch.tensor([1, -1, 0, 1, 1, -1, 0], dtype=torch.int32, device=device)
    out = layer(x, logits, token_lora_ids)
    ref_lora = reference.fused_experts(
        x.double().cpu().numpy(), deq13.numpy(), deq2.numpy(), weights.double().cpu().numpy(), ids.cpu().numpy(),
        expert_map=expert_map.numpy(),
        lora={"token_lora_ids": token_lora_ids.cpu().numpy(),
              "w13_lora_a": [a.double().numpy() for a in lora["w13_lora_a"]],
              "w13_lora_b": [b.double().numpy() for b in lora["w13_lora_b"]],
              "w2_lora_a": lora["w2_lora_a"].double().numpy(), "w2_lora_b": lora["w2_lora_b"].double().numpy(),
              "adapter_scale": np.ones(2)})
    assert rel_error(out.float().cpu(), ref_lora) <= 1e-2
    assert rel_error(out.float().cpu(), ref) > 1e-2  # the adapters are visible


@pytest.mark.skipif(not HAS_TORCH_CUDA, reason="needs torch with CUDA and moelora's CUDA backend")
def test_cuda_graph_and_torch_compile():
    device = torch.device("cuda")
    layer = moelora.FusedMoE(E, TOP_K, H, I, dtype=torch.bfloat16, device=device, quant="w4a16")
    layer.load_weights(torch.randn(E, 2 * I, H) * 0.05, torch.randn(E, H, I) * 0.05)
    x = torch.randn(4, H, device=device).to(torch.bfloat16)
    logits = torch.randn(4, E, device=device)
    eager = layer(x, logits)
    compiled = torch.compile(layer, fullgraph=True)
    assert torch.equal(compiled(x, logits), eager)
    graph = torch.cuda.CUDAGraph()
    static_x, static_logits = x.clone(), logits.clone()
    layer(static_x, static_logits)  # warm-up outside the graph
    with torch.cuda.graph(graph):
        static_out = layer(static_x, static_logits)
    static_x.copy_(torch.randn(4, H, device=device).to(torch.bfloat16))
    graph.replay()
    assert torch.equal(static_out, layer(static_x, static_logits))


# ---- checkpoints into FusedMoE -------------------------------------------------------

def _write_checkpoint(path, fmt, bits, group, zero_points, seed=5):
    """A Qwen-style MoE block's experts in GPTQ or AWQ tensors, and their float weights."""
    from safetensors.torch import save_file
    torch.manual_seed(seed)
    tensors, floats = {}, {}
    for e in range(E):
        for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            w = torch.randn(shape) * 0.05
            q, s, z = weight_only.quantize_weight_only(w, bits, group, zero_points, scale_dtype=torch.float16)
            t = weight_only.to_awq(q, s, z, group) if fmt == "awq" else weight_only.to_gptq(q, s, z, bits, group)
            for name, value in t.items():
                tensors[f"model.layers.0.mlp.experts.{e}.{proj}.{name}"] = value.contiguous()
            floats[(e, proj)] = weight_only.dequantize(weight_only.to_layer(q, bits), s, z, bits, group)
    save_file(tensors, str(path))
    return floats


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
@pytest.mark.parametrize("fmt,bits,group,zero_points", [("gptq", 4, 128, False), ("gptq", 4, 32, True),
                                                         ("gptq", 8, 64, False), ("awq", 4, 128, True),
                                                         ("awq", 4, 64, False)])
def test_layer_reads_gptq_and_awq_checkpoints(backend, fmt, bits, group, zero_points, tmp_path):
    device = torch_device(backend)
    path = tmp_path / "model.safetensors"
    floats = _write_checkpoint(path, fmt, bits, group, zero_points)
    scheme = moelora.quant_scheme(f"w{bits}a16", group_size=group, zero_points=zero_points)
    layer = moelora.FusedMoE(E, TOP_K, H, I, dtype=torch.float16, device=device, quant=scheme)
    config = {"quant_method": fmt, "bits": bits, "group_size": group}
    config.update({"zero_point": zero_points} if fmt == "awq" else {"sym": not zero_points, "desc_act": False})
    layer.load_experts(str(path), "model.layers.0.mlp") if fmt == "gptq" and not zero_points else \
        layer.load_quantized_experts(str(path), "model.layers.0.mlp", quant_config=config)
    w13 = torch.stack([torch.cat([floats[(e, "gate_proj")], floats[(e, "up_proj")]]) for e in range(E)])
    w2 = torch.stack([floats[(e, "down_proj")] for e in range(E)])
    deq13 = weight_only.dequantize(layer.w13.cpu(), layer.w13_weight_scale.cpu(),
                                   None if layer.w13_weight_zero is None else layer.w13_weight_zero.cpu(), bits, group)
    assert torch.equal(deq13, w13)  # the checkpoint's values, exactly
    x = torch.randn(5, H, device=device).to(torch.float16)
    logits = torch.randn(5, E, device=device)
    weights, ids = layer.route(logits)
    assert rel_error(layer(x, logits).float().cpu(), _reference(x, w13, w2, weights, ids)) <= 1e-2


def test_checkpoint_config_disagreeing_with_the_scheme_is_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    _write_checkpoint(path, "gptq", 4, 128, False)
    layer = moelora.FusedMoE(E, TOP_K, H, I, dtype=torch.bfloat16, quant="w4a16")
    for config, message in (({"quant_method": "gptq", "bits": 8}, "bits"),
                            ({"quant_method": "gptq", "group_size": 64}, "group_size"),
                            ({"quant_method": "gptq", "desc_act": True}, "desc_act"),
                            ({"quant_method": "gptq", "sym": False}, "sym")):
        with pytest.raises(ValueError, match=message):
            layer.load_quantized_experts(str(path), "model.layers.0.mlp", quant_config=config)
    assert not layer._weights_loaded  # nothing was written


# ---- bad input -----------------------------------------------------------------------

def test_bad_weight_only_arguments_are_named():
    q = moelora.quant_scheme("w4a16", group_size=128, zero_points=True)
    p13, s13, z13 = moelora.quantize_weights(torch.randn(E, 2 * I, H).to(torch.bfloat16), q)
    p2, s2, z2 = moelora.quantize_weights(torch.randn(E, H, I).to(torch.bfloat16), q)
    x = torch.randn(3, H).to(torch.bfloat16)
    weights, ids = _routing(3, E, "cpu", 1)
    out = torch.full((3, H), float("nan"), dtype=torch.bfloat16)

    def call(**changes):
        args = dict(w13=p13, w2=p2, quant=moelora.MoeQuant(q, s13, s2, w13_zero=z13, w2_zero=z2))
        args.update(changes)
        moelora.fused_experts(x, args["w13"], args["w2"], weights, ids, quant=args["quant"], out=out)

    cases = [
        (dict(w13=p13[:, :, :64]), "'w13'"),
        (dict(w2=p2.view(torch.int8)), "'w2' expected dtype uint8"),
        (dict(quant=moelora.MoeQuant(q, s13.float(), s2, w13_zero=z13, w2_zero=z2)), "'w13_scale'"),
        (dict(quant=moelora.MoeQuant(q, s13[:, :, :1], s2, w13_zero=z13, w2_zero=z2)), "'w13_scale'"),
        (dict(quant=moelora.MoeQuant(q, s13, s2, w13_zero=None, w2_zero=z2)), "'w13_zero'"),
        (dict(quant=moelora.MoeQuant(q, s13, s2, w13_zero=z13 * 0 + 200, w2_zero=z2)), r"\[0, 15\]"),
        (dict(quant=moelora.MoeQuant(moelora.quant_scheme("w4a16"), s13, s2, w13_zero=z13, w2_zero=z2)),
         "'w13_zero' expected none"),
        (dict(quant=moelora.MoeQuant(q, s13, s2, w13_zero=z13[:, :100], w2_zero=z2)), "'w13_zero'"),
    ]
    for changes, message in cases:
        with pytest.raises(moelora.Error, match=message):
            call(**changes)
        assert bool(out.isnan().all()), f"out was written ({message})"
    with pytest.raises(moelora.Error, match="group_size"):
        moelora.quant_scheme("w4a16", group_size=48)
    with pytest.raises(moelora.Error, match="divide"):
        q96 = moelora.quant_scheme("w8a16", group_size=64)
        moelora.fused_experts(torch.randn(3, 96).to(torch.bfloat16), torch.zeros(E, 2 * I, 96, dtype=torch.uint8),
                              torch.zeros(E, 96, I, dtype=torch.uint8), weights, ids,
                              quant=moelora.MoeQuant(q96, torch.ones(E, 2 * I, 1, dtype=torch.bfloat16),
                                                     torch.ones(E, 96, 2, dtype=torch.bfloat16)))
