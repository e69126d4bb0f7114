"""torch.ops.moelora.*: schemas and fake kernels (opcheck), torch.compile(fullgraph=True),
CUDA-graph capture with new inputs between replays, and the FusedMoE nn.Module."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import moelora  # noqa: E402
from moelora_testing import TORCH_BACKENDS, MoeProblem, assert_close, torch_device  # noqa: E402

requires_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and moelora.cuda_available()),
                                   reason="needs torch with CUDA and moelora's CUDA backend")


def test_ops_are_registered():
    for name in ("moe_align_block_size", "fused_moe", "silu_and_mul", "gelu_and_mul", "swiglu_oai_and_mul",
                 "moe_sum_reduce", "fused_experts", "inplace_fused_experts"):
        assert hasattr(torch.ops.moelora, name), name


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_opcheck(backend):
    p = MoeProblem(seed=101, num_tokens=5, num_experts=4, top_k=2, hidden_size=32, intermediate_size=16,
                   dtype="float32", backend=backend)
    x, w13, w2, weights, ids = p.args()
    torch.library.opcheck(torch.ops.moelora.fused_experts, (x, w13, w2, weights, ids))
    torch.library.opcheck(torch.ops.moelora.inplace_fused_experts, (x.clone(), w13, w2, weights, ids))
    torch.library.opcheck(torch.ops.moelora.silu_and_mul, (torch.randn(3, 8, device=x.device),))
    torch.library.opcheck(torch.ops.moelora.moe_sum_reduce, (torch.randn(3, 2, 8, device=x.device), 0.5))


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_torch_compile_fullgraph(backend):
    p = MoeProblem(seed=102, num_tokens=6, num_experts=8, top_k=2, hidden_size=32, intermediate_size=16,
                   dtype="float32", backend=backend)

    def layer(x, w13, w2, weights, ids):
        return torch.ops.moelora.fused_experts(x * 1.0, w13, w2, weights, ids) + 0.0

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert_close(compiled(*p.args()), p.reference(), "float32")


@requires_cuda
def test_cuda_graph_replays_new_inputs():
    """One captured graph serves any routing: copy new inputs in, replay, new results."""
    dtype = "bfloat16"
    pytest.importorskip("ml_dtypes")
    p = MoeProblem(seed=103, num_tokens=24, num_experts=16, top_k=4, hidden_size=64, intermediate_size=48,
                   dtype=dtype, backend="torch-cuda")
    static = [t.clone() for t in (p.x, p.topk_weights, p.topk_ids)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph, as torch recommends
        torch.ops.moelora.fused_experts(static[0], p.w13, p.w2, static[1], static[2])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = torch.ops.moelora.fused_experts(static[0], p.w13, p.w2, static[1], static[2])
    for seed in (104, 105, 106):
        q = MoeProblem(seed=seed, num_tokens=24, num_experts=16, top_k=4, hidden_size=64, intermediate_size=48,
                       dtype=dtype, backend="numpy")
        # Same weights, new activations and routing.
        q.w13_np, q.w2_np = p.w13_np, p.w2_np
        static_out.fill_(float("nan"))
        for dst, src in zip(static, (q.x_np, q.topk_weights_np, q.topk_ids_np)):
            host = torch.from_numpy(np.ascontiguousarray(src.astype(np.float32) if src.dtype.name == "bfloat16"
                                                         else src))
            dst.copy_(host.to(dst.dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(static_out, q.reference(), dtype)


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_fused_moe_layer_module(backend):
    device = torch_device(backend)
    torch.manual_seed(107)
    E, top_k, H, I, M = 8, 2, 64, 32, 10
    layer = moelora.FusedMoE(num_experts=E, top_k=top_k, hidden_size=H, intermediate_size=I,
                             dtype=torch.float32, device=device)
    w13 = torch.randn(E, 2 * I, H) / H ** 0.5
    w2 = torch.randn(E, H, I) / I ** 0.5
    layer.load_weights(w13, w2)
    x = torch.randn(2, M // 2, H, device=device)
    logits = torch.randn(M, E, device=device)
    out = layer(x, logits)
    assert out.shape == x.shape
    weights, ids = layer.route(logits)
    assert torch.allclose(weights.sum(-1), torch.ones(M, device=device))
    from moelora import reference
    expected = reference.fused_experts(x.reshape(M, H).cpu().numpy(), w13.numpy(), w2.numpy(),
                                       weights.cpu().numpy(), ids.cpu().numpy())
    assert_close(out.reshape(M, H), expected, "float32")
