"""torch.ops.moelora.*: values against the reference, schemas and fake kernels (opcheck),
torch.compile(fullgraph=True), CUDA-graph capture with new inputs between replays,
streams and devices, and the FusedMoE nn.Module."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import moelora  # noqa: E402
from moelora import reference  # noqa: E402
from moelora_testing import (TORCH_BACKENDS, MoeProblem, assert_close, poisoned, rng_for, rounded,  # noqa: E402
                             to_backend, to_numpy, torch_device, uniform)

requires_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and moelora.cuda_available()),
                                   reason="needs torch with CUDA and moelora's CUDA backend")

OP_NAMES = ("moe_align_block_size", "fused_moe", "silu_and_mul", "gelu_and_mul", "swiglu_oai_and_mul",
            "moe_sum_reduce", "fused_experts", "inplace_fused_experts")


def test_ops_are_registered():
    for name in OP_NAMES:
        assert hasattr(torch.ops.moelora, name), name


def _align_inputs(backend, seed, M=9, top_k=2, E=6):
    rng = rng_for(seed)
    ids = np.argsort(rng.random((M, E)), axis=1)[:, :top_k].astype(np.int32)
    return to_backend(ids, backend), ids


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_custom_ops_match_the_reference(backend):
    dtype = "float32"
    rng = rng_for(201)
    block_size = 16

    ids, ids_np = _align_inputs(backend, 202)
    M, top_k = ids_np.shape
    E, K, N = 6, 24, 40
    sorted_ids, expert_ids, count = torch.ops.moelora.moe_align_block_size(ids, block_size, E)
    capacity = moelora.moe_align_block_size_capacity(M * top_k, block_size, E)
    assert (sorted_ids.shape[0], expert_ids.shape[0], count.shape[0]) == (*capacity, 1)
    assert sorted_ids.dtype == expert_ids.dtype == count.dtype == torch.int32
    _, ref_experts, ref_count, _ = reference.moe_align_block_size(ids_np, block_size, E)
    assert int(count.item()) == ref_count
    assert (to_numpy(expert_ids)[:ref_count // block_size] == ref_experts).all()

    a_np = rounded(uniform(rng, (M, K)), dtype)
    w_np = rounded(uniform(rng, (E, N, K)), dtype)
    weights_np = rng.random((M, top_k), dtype=np.float32)
    out = poisoned((M * top_k, N), dtype, backend)
    result = torch.ops.moelora.fused_moe(to_backend(a_np, backend), to_backend(w_np, backend), out, sorted_ids,
                                         expert_ids, count, to_backend(weights_np, backend), True, top_k,
                                         block_size)
    assert result is None
    expected = reference.fused_moe(a_np, w_np, to_numpy(sorted_ids), to_numpy(expert_ids), to_numpy(count), M * top_k,
                                   topk_weights=weights_np, mul_routed_weight=True, top_k=top_k,
                                   block_size=block_size)
    assert_close(out, expected, dtype)

    x_np = rounded(uniform(rng, (2, 7, 64), 5.0), dtype)
    x = to_backend(x_np, backend)
    assert_close(torch.ops.moelora.silu_and_mul(x), reference.silu_and_mul(x_np), dtype)
    assert_close(torch.ops.moelora.gelu_and_mul(x), reference.gelu_and_mul(x_np), dtype)
    assert_close(torch.ops.moelora.swiglu_oai_and_mul(x, 1.5, 3.0), reference.swiglu_oai_and_mul(x_np, 1.5, 3.0),
                 dtype)
    y_np = rounded(uniform(rng, (5, 3, 32)), dtype)
    assert_close(torch.ops.moelora.moe_sum_reduce(to_backend(y_np, backend), 2.0),
                 reference.moe_sum_reduce(y_np, 2.0), dtype)


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
@pytest.mark.parametrize("activation", ["silu", "gelu", "swiglu_oai"])
def test_fused_experts_ops_functional_and_inplace(backend, activation):
    dtype = "float32"
    p = MoeProblem(seed=211, num_tokens=13, num_experts=8, top_k=3, hidden_size=48, intermediate_size=32,
                   dtype=dtype, backend=backend, activation=activation)
    x_before = p.x.clone()
    out = torch.ops.moelora.fused_experts(*p.args(), activation=activation, routed_scaling_factor=1.5)
    assert torch.equal(p.x, x_before)  # functional: the input is untouched
    assert_close(out, p.reference(routed_scaling_factor=1.5), dtype)
    per_slot = torch.ops.moelora.fused_experts(*p.args(), activation=activation, no_combine=True)
    assert_close(per_slot, p.reference(no_combine=True), dtype)
    expected = p.reference()
    assert torch.ops.moelora.inplace_fused_experts(*p.args(), activation=activation, chunk_size=4) is None
    assert_close(p.x, expected, dtype)


@pytest.mark.skipif(not hasattr(torch.library, "opcheck"), reason="torch.library.opcheck needs torch >= 2.4")
@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_opcheck(backend):
    """Schemas (mutation and aliasing), fake kernels and AOT dispatch with dynamic shapes."""
    device = torch_device(backend)
    p = MoeProblem(seed=221, num_tokens=5, num_experts=4, top_k=2, hidden_size=32, intermediate_size=16,
                   dtype="float32", backend=backend)
    x, w13, w2, weights, ids = p.args()
    torch.library.opcheck(torch.ops.moelora.fused_experts, (x, w13, w2, weights, ids))
    torch.library.opcheck(torch.ops.moelora.fused_experts, (x, w13, w2, weights, ids),
                          {"no_combine": True, "activation": "gelu"})
    torch.library.opcheck(torch.ops.moelora.inplace_fused_experts, (x.clone(), w13, w2, weights, ids))
    torch.library.opcheck(torch.ops.moelora.silu_and_mul, (torch.randn(3, 8, device=device),))
    torch.library.opcheck(torch.ops.moelora.gelu_and_mul, (torch.randn(2, 3, 8, device=device),))
    torch.library.opcheck(torch.ops.moelora.swiglu_oai_and_mul, (torch.randn(3, 8, device=device), 1.702, 7.0))
    torch.library.opcheck(torch.ops.moelora.moe_sum_reduce, (torch.randn(3, 2, 8, device=device), 0.5))
    # The CUDA kernel orders slots inside an expert group by atomics, so two runs may
    # differ there: compare only schema and fake shapes on CUDA.
    align_utils = (("test_schema", "test_faketensor") if backend == "torch-cuda"
                   else ("test_schema", "test_autograd_registration", "test_faketensor",
                         "test_aot_dispatch_dynamic"))
    torch.library.opcheck(torch.ops.moelora.moe_align_block_size, (ids, 16, 4), test_utils=align_utils)
    sorted_ids, expert_ids, count = torch.ops.moelora.moe_align_block_size(ids, 16, 4)
    out = torch.empty(x.shape[0] * 2, 2 * 16, device=device)
    torch.library.opcheck(torch.ops.moelora.fused_moe,
                          (x, w13, out, sorted_ids, expert_ids, count, weights, True, 2, 16))


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(backend, compile_backend):
    # inductor on the CPU compiles C++ kernels for the ops around fused_experts: ~25 s on 2
    # cores with torch 2.11 and a cold cache.
    p = MoeProblem(seed=231, num_tokens=6, num_experts=8, top_k=2, hidden_size=32, intermediate_size=16,
                   dtype="float32", backend=backend)

    def moe(x, w13, w2, weights, ids):
        return torch.ops.moelora.fused_experts(x * 2.0, w13, w2, weights, ids) + 1.0

    torch._dynamo.reset()
    expected = reference.fused_experts(2.0 * p.x_np.astype(np.float64), p.w13_np, p.w2_np, p.topk_weights_np,
                                       p.topk_ids_np) + 1.0
    # A fresh compile, not a cached graph: a cache once hid a schema inductor could not lower.
    with torch._inductor.config.patch(force_disable_caches=True):
        compiled = torch.compile(moe, fullgraph=True, backend=compile_backend)
        assert_close(compiled(*p.args()), expected, "float32")


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_torch_compile_dynamic_shapes_and_inplace(backend):
    """One dynamic-shape graph serves several token counts (the fake kernels see symbolic M)."""

    def moe(x, w13, w2, weights, ids):
        sorted_ids, expert_ids, count = torch.ops.moelora.moe_align_block_size(ids, 16, 8)
        y = x.clone()
        torch.ops.moelora.inplace_fused_experts(y, w13, w2, weights, ids)
        return y, count

    torch._dynamo.reset()
    compiled = torch.compile(moe, fullgraph=True, dynamic=True, backend="aot_eager")
    for seed, num_tokens in ((241, 5), (242, 11), (243, 17)):
        p = MoeProblem(seed=seed, num_tokens=num_tokens, num_experts=8, top_k=2, hidden_size=32,
                       intermediate_size=16, dtype="float32", backend=backend)
        y, count = compiled(*p.args())
        assert_close(y, p.reference(), "float32")
        assert int(count.item()) == reference.moe_align_block_size(p.topk_ids_np, 16, 8)[2]


@requires_cuda
def test_cuda_graph_replays_new_inputs():
    """One captured graph serves any routing: copy new inputs in, replay, new results."""
    pytest.importorskip("ml_dtypes")
    dtype = "bfloat16"
    shape = dict(num_tokens=24, num_experts=16, top_k=4, hidden_size=64, intermediate_size=48, dtype=dtype)
    p = MoeProblem(seed=251, backend="torch-cuda", **shape)
    static = [t.clone() for t in (p.x, p.topk_weights, p.topk_ids)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph, as torch recommends
        torch.ops.moelora.fused_experts(static[0], p.w13, p.w2, static[1], static[2])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = torch.ops.moelora.fused_experts(static[0], p.w13, p.w2, static[1], static[2])
    for seed in (252, 253, 254):
        q = MoeProblem(seed=seed, backend="numpy", **shape)
        q.w13_np, q.w2_np = p.w13_np, p.w2_np  # same weights, new activations and routing
        static_out.fill_(float("nan"))
        for dst, src in zip(static, (q.x_np, q.topk_weights_np, q.topk_ids_np)):
            dst.copy_(to_backend(src, "torch-cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(static_out, q.reference(), dtype)


@requires_cuda
def test_ops_run_on_the_current_stream():
    p = MoeProblem(seed=261, num_tokens=40, num_experts=8, top_k=2, hidden_size=64, intermediate_size=32,
                   dtype="float16", backend="torch-cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x = p.x * 1.0  # produced on the side stream: the op must order after it
        out = moelora.fused_experts(x, p.w13, p.w2, p.topk_weights, p.topk_ids)
        out = out + 0.0
    side.synchronize()
    assert_close(out, p.reference(), "float16")


@requires_cuda
def test_mixed_devices_are_rejected_by_name():
    p = MoeProblem(seed=262, num_tokens=4, num_experts=4, top_k=2, hidden_size=16, intermediate_size=8,
                   dtype="float32", backend="torch-cuda")
    x, w13, w2, weights, ids = p.args()
    with pytest.raises(ValueError, match="'w13'"):
        moelora.fused_experts(x, w13.cpu(), w2, weights, ids)
    with pytest.raises(ValueError, match="'topk_ids'"):
        moelora.fused_experts(x, w13, w2, weights, ids.cpu())


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_tensors_requiring_grad_are_accepted(backend):
    p = MoeProblem(seed=271, num_tokens=6, num_experts=4, top_k=2, hidden_size=16, intermediate_size=8,
                   dtype="float32", backend=backend)
    w13 = torch.nn.Parameter(p.w13.clone())
    out = moelora.fused_experts(p.x, w13, p.w2, p.topk_weights, p.topk_ids)
    assert_close(out, p.reference(), "float32")


# ---- the nn.Module -------------------------------------------------------------------

def _layer_with_weights(backend, seed, E, top_k, H, I, **kwargs):
    torch.manual_seed(seed)
    layer = moelora.FusedMoE(num_experts=E, top_k=top_k, hidden_size=H, intermediate_size=I,
                             dtype=torch.float32, device=torch_device(backend), **kwargs)
    E_local = layer.num_local_experts
    w13 = torch.randn(E_local, 2 * I, H) / H ** 0.5
    w2 = torch.randn(E_local, H, I) / I ** 0.5
    layer.load_weights(w13, w2)
    return layer, w13.numpy(), w2.numpy()


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_moe_layer_module(backend, renormalize):
    device = torch_device(backend)
    E, top_k, H, I, M = 8, 2, 64, 32, 10
    layer, w13, w2 = _layer_with_weights(backend, 281, E, top_k, H, I, renormalize=renormalize,
                                         routed_scaling_factor=1.25)
    assert not layer.w13.requires_grad
    x = torch.randn(2, M // 2, H, device=device)
    logits = torch.randn(M, E, device=device)
    out = layer(x, logits)
    assert out.shape == x.shape

    weights, ids = layer.route(logits)
    probs = np.exp(to_numpy(logits))
    probs /= probs.sum(-1, keepdims=True)
    ref_ids = np.argsort(-probs, axis=1)[:, :top_k]
    assert (np.sort(to_numpy(ids), 1) == np.sort(ref_ids, 1)).all()
    ref_weights = np.take_along_axis(probs, to_numpy(ids), 1)
    if renormalize:
        ref_weights /= ref_weights.sum(-1, keepdims=True)
    assert np.allclose(to_numpy(weights), ref_weights, rtol=1e-5)

    expected = reference.fused_experts(to_numpy(x).reshape(M, H), w13, w2, to_numpy(weights), to_numpy(ids),
                                       routed_scaling_factor=1.25)
    assert_close(out.reshape(M, H), expected, "float32")
    assert_close(layer.forward_routed(x.reshape(M, H), weights, ids), expected, "float32")


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_fused_moe_layer_expert_parallel_ranks_sum_to_the_full_layer(backend):
    device = torch_device(backend)
    E, top_k, H, I, M = 8, 3, 32, 16, 12
    full, w13, w2 = _layer_with_weights(backend, 291, E, top_k, H, I)
    owner = np.arange(E) % 2  # rank r holds the experts e with e % 2 == r
    total = None
    for rank in (0, 1):
        mine = np.flatnonzero(owner == rank)
        expert_map = np.full(E, -1, dtype=np.int32)
        expert_map[mine] = np.arange(mine.size)
        shard = moelora.FusedMoE(num_experts=E, top_k=top_k, hidden_size=H, intermediate_size=I,
                                 expert_map=expert_map, dtype=torch.float32, device=device)
        assert shard.num_local_experts == mine.size
        shard.load_weights(torch.from_numpy(w13[mine]), torch.from_numpy(w2[mine]))
        torch.manual_seed(292)
        x = torch.randn(M, H, device=device)
        logits = torch.randn(M, E, device=device)
        part = shard(x, logits)
        total = part if total is None else total + part
    assert_close(total, to_numpy(full(x, logits)).astype(np.float64), "float32")


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_fused_moe_layer_compiles(backend):
    device = torch_device(backend)
    layer, _, _ = _layer_with_weights(backend, 301, 8, 2, 32, 16, activation="gelu")
    x = torch.randn(7, 32, device=device)
    logits = torch.randn(7, 8, device=device)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert_close(compiled(x, logits), to_numpy(layer(x, logits)), "float32")


def test_fused_moe_layer_rejects_bad_configuration():
    with pytest.raises(ValueError, match="activation"):
        moelora.FusedMoE(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8, activation="relu")
    with pytest.raises(ValueError, match="top_k"):
        moelora.FusedMoE(num_experts=4, top_k=5, hidden_size=8, intermediate_size=8)
    layer = moelora.FusedMoE(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8)
    with pytest.raises(ValueError, match="w13"):
        layer.load_weights(torch.zeros(4, 8, 8), torch.zeros(4, 8, 8))
