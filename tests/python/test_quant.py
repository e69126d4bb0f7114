"""Quantized experts (issue 28) from Python: the quantization ops (vLLM's names) bit for
bit against moelora.reference.quantize, fused_experts on fp8 / int8 experts against the
float64 reference of the same quantization, the torch custom ops (opcheck,
torch.compile, CUDA graphs), and the errors of bad scales."""

import numpy as np
import pytest

import moelora
from moelora import reference
from moelora_testing import (BACKENDS, HAS_TORCH_CUDA, TORCH_BACKENDS, ml_dtypes, rel_error, rng_for, rounded,
                             to_backend, to_numpy, torch, uniform)

pytestmark = pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes is not installed")

SCHEMES = ["fp8_block", "fp8_channel", "fp8_tensor", "int8_channel", "int8_block"]


def _values(q):
    """The 8-bit values of a quantized array (numpy or torch) as float64."""
    if torch is not None and isinstance(q, torch.Tensor):
        q = q.detach().cpu()
        return q.float().double().numpy() if q.dtype == torch.float8_e4m3fn else q.double().numpy()
    return np.asarray(q).astype(np.float64)


def _x(rng, shape, dtype="bfloat16", backend="numpy"):
    x = uniform(rng, shape, 3.0)
    x[0, : shape[1] // 2] = 0.0  # a zero half row: the absmax floor, where a group is all zeros
    return to_backend(rounded(x, dtype), backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "int8"])
@pytest.mark.parametrize("blocks", [(1, 128), (1, 64), (1, 0), (0, 0)], ids=["group128", "group64", "token", "tensor"])
def test_quantize_matches_reference_bit_for_bit(backend, dtype, blocks):
    x = _x(rng_for(11), (37, 512), backend=backend)
    q, scales = moelora.quantize(x, *blocks, dtype=dtype)
    ref_q, ref_scales = reference.quantize(to_numpy(x), *blocks, dtype)
    assert np.array_equal(to_numpy(scales).astype(np.float32), ref_scales)
    assert np.array_equal(_values(q), ref_q)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("column_major", [False, True])
def test_per_token_group_quant(backend, column_major):
    x = _x(rng_for(12), (9, 384), backend=backend)
    q, scales = moelora.per_token_group_quant(x, 128, "float8_e4m3fn", column_major_scales=column_major)
    assert tuple(scales.shape) == (9, 3)
    if column_major:
        strides = scales.stride() if torch is not None and isinstance(scales, torch.Tensor) else \
            tuple(s // 4 for s in scales.strides)
        assert strides == (1, 9)
    ref_q, ref_scales = reference.quantize(to_numpy(x), 1, 128, "float8_e4m3fn")
    assert np.array_equal(to_numpy(scales).astype(np.float32), ref_scales)
    assert np.array_equal(_values(q), ref_q)
    with pytest.raises(ValueError, match="'group_size' expected a divisor of K = 384"):
        moelora.per_token_group_quant(x, 100)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scaled_quant_static_dynamic_per_token(backend):
    x = _x(rng_for(13), (6, 256), backend=backend)
    xn = to_numpy(x)
    q, scale = moelora.scaled_fp8_quant(x)  # dynamic per tensor
    assert tuple(scale.shape) == (1,)
    assert np.array_equal(_values(q), reference.quantize(xn, 0, 0, "float8_e4m3fn")[0])
    q, scale = moelora.scaled_fp8_quant(x, use_per_token_if_dynamic=True)
    assert tuple(scale.shape) == (6, 1)
    assert np.array_equal(_values(q), reference.quantize(xn, 1, 0, "float8_e4m3fn")[0])
    static = to_backend(np.array([0.01], np.float32), backend)
    q, scale = moelora.scaled_fp8_quant(x, static)
    assert np.array_equal(_values(q), reference.quantize(xn, 0, 0, "float8_e4m3fn", scales=0.01)[0])
    q, scale = moelora.scaled_int8_quant(x)
    assert tuple(scale.shape) == (6, 1)
    assert np.array_equal(_values(q), reference.quantize(xn, 1, 0, "int8")[0])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantize_weights_layouts(scheme):
    w = rounded(uniform(rng_for(14), (3, 320, 256), 0.05), "bfloat16")
    q, scales = moelora.quantize_weights(w, scheme)
    expected = {"block": (3, 3, 2), "channel": (3, 320), "tensor": (3,)}[scheme.split("_")[1]]
    assert scales.shape == expected
    assert q.dtype.name == ("int8" if scheme.startswith("int8") else "float8_e4m3fn")


def _quant_layer(backend, scheme, seed, M=12, E=6, top_k=2, H=256, I=128, static=False, activation="silu"):
    """Inputs of a quantized layer on `backend`, and the reference's output."""
    rng = rng_for(seed)
    x = rounded(uniform(rng, (M, H)), "bfloat16")
    w13 = rounded(uniform(rng, (E, 2 * I, H), 1.0 / np.sqrt(H)), "bfloat16")
    w2 = rounded(uniform(rng, (E, H, I), 1.0 / np.sqrt(I)), "bfloat16")
    ids = np.stack([rng.permutation(E)[:top_k] for _ in range(M)]).astype(np.int32)
    weights = rng.random((M, top_k), dtype=np.float32)
    s = moelora.quant_scheme(scheme, static_activation_scales=static)
    w13_q, w13_s = moelora.quantize_weights(w13, s)
    w2_q, w2_s = moelora.quantize_weights(w2, s)
    blocks = {"block": (s.block_n, s.block_k), "channel": (1, 0), "tensor": (0, 0)}[s.weight_scales.name]

    def dequantized(q, scales):
        scales = np.asarray(scales).reshape(q.shape[0], *(scales.shape[1:] if scales.ndim == 3 else
                                                          (-1, 1) if scales.ndim == 2 else (1, 1)))
        return reference.dequantize(q, scales, *blocks)

    a13 = np.array([3.0 / 448], np.float32) if static else None
    a2 = np.array([0.5 / 448], np.float32) if static else None
    spec = {"dtype": s.element, "activation_scales": s.activation_scales.name, "block_k": s.block_k,
            "a13_scale": None if a13 is None else float(a13[0]), "a2_scale": None if a2 is None else float(a2[0]),
            "layer_dtype": ml_dtypes.bfloat16}
    w13_d, w2_d = dequantized(w13_q, w13_s), dequantized(w2_q, w2_s)

    def ref_for(hidden):
        return reference.fused_experts(hidden, w13_d, w2_d, weights, ids, activation=activation, quant=spec)

    ref = ref_for(x)
    _quant_layer.reference_for = ref_for  # the last layer's reference for new hidden states
    quant = moelora.MoeQuant(s, to_backend(w13_s, backend), to_backend(w2_s, backend),
                             None if a13 is None else to_backend(a13, backend),
                             None if a2 is None else to_backend(a2, backend))
    args = [to_backend(a, backend) for a in (x, w13_q, w2_q, weights, ids)]
    return args, quant, ref


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_fused_experts_quantized_matches_reference(backend, scheme):
    if backend == "torch-cuda" and scheme.startswith("fp8") and not torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("fp8 experts need sm_89+")
    args, quant, ref = _quant_layer(backend, scheme, seed=21)
    out = moelora.fused_experts(*args, quant=quant)
    assert rel_error(out, ref) <= 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_experts_static_scales_and_swiglu(backend):
    args, quant, ref = _quant_layer(backend, "fp8_tensor", seed=22, static=True, activation="swiglu_oai")
    out = moelora.fused_experts(*args, quant=quant, activation="swiglu_oai")
    assert rel_error(out, ref) <= 1e-2


def test_fused_experts_quantized_bad_arguments():
    args, quant, _ = _quant_layer("numpy", "fp8_block", seed=23, M=4)
    x, w13_q, w2_q, weights, ids = args
    with pytest.raises(ValueError, match="'w13' expected dtype float8_e4m3fn"):
        moelora.fused_experts(x, w13_q.astype(np.float32).astype(ml_dtypes.bfloat16), w2_q, weights, ids, quant=quant)
    bad = moelora.MoeQuant(quant.scheme, quant.w13_scale[:, :-1], quant.w2_scale)
    with pytest.raises(ValueError, match="'w13_scale' expected"):
        moelora.fused_experts(*args, quant=bad)
    nan_scales = quant.w2_scale.copy()
    nan_scales[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="'w2_scale' expected finite scales > 0"):
        moelora.fused_experts(*args, quant=moelora.MoeQuant(quant.scheme, quant.w13_scale, nan_scales))
    with pytest.raises(ValueError, match="'w13_scale' expected dtype float32"):
        moelora.fused_experts(*args, quant=moelora.MoeQuant(quant.scheme, quant.w13_scale.astype(ml_dtypes.bfloat16),
                                                             quant.w2_scale))
    with pytest.raises(ValueError, match="unknown scheme 'fp4'"):
        moelora.quant_scheme("fp4")


# ---- torch custom ops ------------------------------------------------------------------

@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_torch_quant_ops(backend):
    args, quant, ref = _quant_layer(backend, "fp8_block", seed=24)
    out = torch.ops.moelora.fused_experts_quant(*args, "fp8_block", quant.w13_scale, quant.w2_scale)
    assert rel_error(out, ref) <= 1e-2
    x = args[0]
    q, scales = torch.ops.moelora.per_token_group_quant(x, 128, "float8_e4m3fn", True)
    assert q.dtype == torch.float8_e4m3fn and scales.stride() == (1, x.shape[0])
    q, scale = torch.ops.moelora.scaled_fp8_quant(x)
    assert q.dtype == torch.float8_e4m3fn and tuple(scale.shape) == (1,)
    q, scale = torch.ops.moelora.scaled_int8_quant(x)
    assert q.dtype == torch.int8 and tuple(scale.shape) == (x.shape[0], 1)


@pytest.mark.skipif(torch is None or not hasattr(torch.library, "opcheck"), reason="needs torch >= 2.4")
@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_quant_opcheck(backend):
    args, quant, _ = _quant_layer(backend, "int8_channel", seed=25, M=5)
    torch.library.opcheck(torch.ops.moelora.fused_experts_quant.default,
                          (*args, "int8_channel", quant.w13_scale, quant.w2_scale))
    x = args[0]
    torch.library.opcheck(torch.ops.moelora.per_token_group_quant.default, (x, 128, "int8", False))
    torch.library.opcheck(torch.ops.moelora.scaled_fp8_quant.default, (x, None, True))


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_quant_torch_compile_fullgraph(backend):
    args, quant, ref = _quant_layer(backend, "fp8_channel", seed=26)

    def layer(x, w13, w2, weights, ids, s13, s2):
        return torch.ops.moelora.fused_experts_quant(x, w13, w2, weights, ids, "fp8_channel", s13, s2)

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    out = compiled(*args, quant.w13_scale, quant.w2_scale)
    assert rel_error(out, ref) <= 1e-2


@pytest.mark.skipif(not HAS_TORCH_CUDA, reason="needs torch with CUDA and moelora's CUDA backend")
@pytest.mark.parametrize("scheme,M,top_k,E", [("fp8_block", 12, 2, 6), ("fp8_block", 160, 8, 16),
                                              ("fp8_channel", 160, 8, 16), ("fp8_tensor", 160, 8, 16),
                                              ("int8_channel", 160, 8, 16)],
                         ids=["small", "grouped_fp8_block", "grouped_fp8_channel", "grouped_fp8_tensor",
                              "grouped_int8_channel"])
def test_quant_cuda_graph_replays_new_inputs(scheme, M, top_k, E):
    # 1280 slots take the grouped GEMMs on sm_90a (CUTLASS, device-side problem sizes).
    if scheme.startswith("fp8") and not torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("fp8 experts need sm_89+")
    args, quant, ref = _quant_layer("torch-cuda", scheme, seed=27, M=M, top_k=top_k, E=E)
    x = args[0]
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        moelora.fused_experts(static_x, *args[1:], quant=quant)  # warm-up outside the capture
        with torch.cuda.graph(graph, stream=stream):
            out = moelora.fused_experts(static_x, *args[1:], quant=quant)
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    assert rel_error(out, ref) <= 1e-2
    # New hidden states in the captured buffer: the replay follows them.
    ref_for = _quant_layer.reference_for
    x2 = rounded(uniform(rng_for(28), tuple(x.shape)), "bfloat16")
    static_x.copy_(to_backend(x2, "torch-cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_error(out, ref_for(x2)) <= 1e-2
