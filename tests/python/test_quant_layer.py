"""FusedMoE on quantized experts (issue 28): weights quantized on load or loaded with their
scales, checkpoints in the DeepSeek-V3 (weight_scale_inv) and per-tensor (weight_scale,
input_scale) layouts, against the float64 reference of the same quantization."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import moelora  # noqa: E402
from moelora import reference  # noqa: E402
from moelora_testing import TORCH_BACKENDS, ml_dtypes, rel_error, torch_device  # noqa: E402

pytestmark = pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes is not installed")

E, TOP_K, H, I = 6, 2, 256, 128


def _dequantized(layer, name):
    q = getattr(layer, name).detach().cpu().float().double().numpy()
    s = getattr(layer, f"{name}_weight_scale").detach().cpu().double().numpy()
    scheme = layer.quant_scheme
    if scheme.weight_scales.name == "block":
        return reference.dequantize(q, s, scheme.block_n, scheme.block_k)
    s = s.reshape(E, -1, 1) if s.ndim == 2 else s.reshape(E, 1, 1)
    return reference.dequantize(q, s, 1 if scheme.weight_scales.name == "channel" else 0, 0)


def _reference(layer, x, logits):
    weights, ids = layer.route(logits)
    scheme = layer.quant_scheme
    spec = {"dtype": scheme.element, "activation_scales": scheme.activation_scales.name, "block_k": scheme.block_k,
            "layer_dtype": ml_dtypes.bfloat16}
    if scheme.static_activation_scales:
        spec["a13_scale"] = float(layer.w13_input_scale.item())
        spec["a2_scale"] = float(layer.w2_input_scale.item())
    return reference.fused_experts(x.float().cpu().numpy().astype(ml_dtypes.bfloat16), _dequantized(layer, "w13"),
                                   _dequantized(layer, "w2"), weights.cpu().numpy(), ids.cpu().numpy(), quant=spec)


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
@pytest.mark.parametrize("scheme", ["fp8_block", "fp8_channel", "fp8_tensor", "int8_channel"])
def test_quantized_layer_quantizes_on_load(backend, scheme):
    device = torch_device(backend)
    torch.manual_seed(1)
    layer = moelora.FusedMoE(E, TOP_K, H, I, dtype=torch.bfloat16, device=device, quant=scheme)
    assert layer.w13.dtype == (torch.int8 if scheme.startswith("int8") else torch.float8_e4m3fn)
    layer.load_weights(torch.randn(E, 2 * I, H) * 0.05, torch.randn(E, H, I) * 0.05)
    x = torch.randn(9, H, device=device).to(torch.bfloat16)
    logits = torch.randn(9, E, device=device)
    out = layer(x, logits)
    assert rel_error(out.float(), _reference(layer, x, logits)) <= 1e-2


def _deepseek_checkpoint(prefix, scheme_name):
    """Per-expert fp8 weights with 128x128 weight_scale_inv blocks, as DeepSeek-V3 ships them."""
    tensors = {}
    for e in range(E):
        for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            q, s = moelora.quantize_weights((torch.randn(1, *shape) * 0.05).to(torch.bfloat16), scheme_name)
            tensors[f"{prefix}.experts.{e}.{proj}.weight"] = q[0]
            tensors[f"{prefix}.experts.{e}.{proj}.weight_scale_inv"] = s[0]
    return tensors


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_deepseek_checkpoint_round_trip(backend, tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    prefix = "model.layers.3.mlp"
    tensors = _deepseek_checkpoint(prefix, "fp8_block")
    path = tmp_path / "experts.safetensors"
    safetensors.save_file(tensors, str(path))
    layer = moelora.FusedMoE(E, TOP_K, H, I, dtype=torch.bfloat16, device=torch_device(backend), quant="fp8_block")
    layer.load_quantized_experts(path, prefix)
    e = 4
    expected = torch.cat([tensors[f"{prefix}.experts.{e}.gate_proj.weight"],
                          tensors[f"{prefix}.experts.{e}.up_proj.weight"]]).view(torch.uint8)
    assert torch.equal(layer.w13[e].cpu().view(torch.uint8), expected)
    assert torch.equal(layer.w2_weight_scale[e].cpu(), tensors[f"{prefix}.experts.{e}.down_proj.weight_scale_inv"])
    x = torch.randn(5, H, device=torch_device(backend)).to(torch.bfloat16)
    logits = torch.randn(5, E, device=x.device)
    assert rel_error(layer(x, logits).float(), _reference(layer, x, logits)) <= 1e-2


def test_per_tensor_checkpoint_requantizes_gate_and_up_and_takes_static_input_scales():
    prefix = "model.layers.0.block_sparse_moe"
    tensors = {}
    for e in range(E):
        for proj, shape, w_scale, in_scale in (("w1", (I, H), 0.002, 0.02), ("w3", (I, H), 0.003, 0.01),
                                               ("w2", (H, I), 0.004, 0.05)):
            w = torch.randn(shape) * 0.2
            scale = torch.tensor([w_scale])
            q, _ = moelora.quantize(w, 0, 0, "float8_e4m3fn", scales=scale.reshape(1, 1), static_scales=True)
            tensors[f"{prefix}.experts.{e}.{proj}.weight"] = q
            tensors[f"{prefix}.experts.{e}.{proj}.weight_scale"] = scale
            tensors[f"{prefix}.experts.{e}.{proj}.input_scale"] = torch.tensor([in_scale])
    scheme = moelora.quant_scheme("fp8_tensor", static_activation_scales=True)
    layer = moelora.FusedMoE(E, TOP_K, H, I, dtype=torch.bfloat16, quant=scheme)
    layer.load_quantized_experts(tensors, prefix)
    assert torch.allclose(layer.w13_weight_scale, torch.full((E,), 0.003))  # the larger of gate's and up's
    assert float(layer.w13_input_scale) == pytest.approx(0.02) and float(layer.w2_input_scale) == pytest.approx(0.05)
    # w1 re-expressed at w3's scale: values within one fp8 step of the original.
    original = tensors[f"{prefix}.experts.0.w1.weight"].float() * 0.002
    assert torch.allclose(layer.w13[0, :I].float() * 0.003, original, rtol=0.07, atol=1e-3)
    x = torch.randn(7, H).to(torch.bfloat16)
    logits = torch.randn(7, E)
    assert rel_error(layer(x, logits).float(), _reference(layer, x, logits)) <= 1e-2


def test_bad_scales_and_checkpoints_are_named():
    layer = moelora.FusedMoE(E, TOP_K, H, I, dtype=torch.bfloat16, quant="fp8_channel")
    q13, s13 = moelora.quantize_weights(torch.randn(E, 2 * I, H).to(torch.bfloat16), "fp8_channel")
    q2, s2 = moelora.quantize_weights(torch.randn(E, H, I).to(torch.bfloat16), "fp8_channel")
    s13[1, 3] = float("nan")
    with pytest.raises(ValueError, match="w13_weight_scale expected finite scales > 0"):
        layer.load_weights(q13, q2, s13, s2)
    with pytest.raises(ValueError, match=r"w2_weight_scale expected shape \[6, 256\]"):
        layer.load_weights(q13, q2, s13.nan_to_num(1.0), s2[:, :-1])
    with pytest.raises(ValueError, match="key 'm.experts.0.gate_proj.weight_scale' is missing"):
        layer.load_quantized_experts({"m.experts.0.gate_proj.weight": q13[0, :I]}, "m")
    plain = moelora.FusedMoE(E, TOP_K, H, I, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="no quantization scheme"):
        plain.load_quantized_experts({}, "m")
