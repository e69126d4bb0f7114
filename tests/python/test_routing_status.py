"""fused_experts' routing status word (issue 33): the CUDA kernels OR a bit into an int32
the caller passes when they meet an id they cannot use (the CPU backend raises); bad
status arguments are refused by name."""

import numpy as np
import pytest

import moelora
from moelora_testing import HAS_TORCH_CUDA, TORCH_BACKENDS, MoeProblem

E, H, I, TOP_K = 6, 32, 16, 2


def _problem(M, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, H)).astype(np.float32)
    w13 = (rng.standard_normal((E, 2 * I, H)) / np.sqrt(H)).astype(np.float32)
    w2 = (rng.standard_normal((E, H, I)) / np.sqrt(I)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:TOP_K] for _ in range(M)]).astype(np.int32)
    weights = np.full((M, TOP_K), 0.5, np.float32)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("bad,what", [(np.zeros(2, np.int32), "size 1"), (np.zeros(1, np.float32), "int32"),
                                      (np.zeros((1, 1), np.int32), "rank")])
def test_bad_status_arguments_are_named(bad, what):
    x, w13, w2, weights, ids = _problem(5)
    with pytest.raises(moelora.Error, match="'routing_status'"):
        moelora.fused_experts(x, w13, w2, weights, ids, routing_status=bad)


def test_cpu_raises_for_bad_ids_with_or_without_a_word():
    x, w13, w2, weights, ids = _problem(5)
    status = np.zeros(1, np.int32)
    out = moelora.fused_experts(x, w13, w2, weights, ids, routing_status=status)
    assert status[0] == 0 and np.isfinite(out).all()
    ids[2, 1] = E + 1
    with pytest.raises(moelora.Error, match="'topk_ids' expected values in"):
        moelora.fused_experts(x, w13, w2, weights, ids, routing_status=status)


@pytest.mark.skipif(not HAS_TORCH_CUDA, reason="needs torch with CUDA and moelora's CUDA backend")
@pytest.mark.parametrize("M", [4, 300])
def test_cuda_bad_ids_set_the_bit_and_drop_their_slots(M):
    import torch
    x, w13, w2, weights, ids = (torch.from_numpy(a).cuda() for a in _problem(M, seed=M))
    x, w13, w2 = x.bfloat16(), w13.bfloat16(), w2.bfloat16()
    status = torch.zeros(1, dtype=torch.int32, device="cuda")
    dropped = ids.clone()
    dropped[1, 0] = -1
    expected = moelora.fused_experts(x, w13, w2, weights, dropped, routing_status=status)
    assert int(status.item()) == 0, "-1 is a dropped slot, not an error"
    ids[1, 0] = E + 4
    out = moelora.fused_experts(x, w13, w2, weights, ids, routing_status=status)
    assert int(status.item()) == moelora.ROUTING_BAD_EXPERT_ID
    err = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
    assert err <= 1e-3, f"the bad id's slot is dropped, as -1's (rel_err {err:.2e})"


@pytest.mark.skipif(not HAS_TORCH_CUDA, reason="needs torch with CUDA and moelora's CUDA backend")
def test_cuda_graph_replays_report_each_routing():
    import torch
    x, w13, w2, weights, ids = (torch.from_numpy(a).cuda() for a in _problem(8, seed=3))
    x, w13, w2 = x.bfloat16(), w13.bfloat16(), w2.bfloat16()
    status = torch.zeros(1, dtype=torch.int32, device="cuda")
    moelora.fused_experts(x, w13, w2, weights, ids, routing_status=status)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        status.zero_()
        moelora.fused_experts(x, w13, w2, weights, ids, routing_status=status)
    good = ids[0, 0].item()
    for bad in (True, False, True):
        ids[0, 0] = E if bad else good
        graph.replay()
        torch.cuda.synchronize()
        assert int(status.item()) == (moelora.ROUTING_BAD_EXPERT_ID if bad else 0)


@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_layer_tracks_its_routing_and_compiles(compile_backend):
    torch = pytest.importorskip("torch")
    layer = moelora.FusedMoE(E, TOP_K, H, I, dtype=torch.float32, track_routing=True)
    x, logits = torch.randn(5, H), torch.randn(5, E)
    out = layer(x, logits)
    assert layer.routing_errors() == [] and torch.isfinite(out).all()
    torch._dynamo.reset()
    # A fresh compile: a cached graph hid torch 2.11's mis-lowering of an optional mutable
    # argument (torch_ops.py's "_tracked" ops) on one machine and not on another.
    with torch._inductor.config.patch(force_disable_caches=True):
        compiled = torch.compile(layer, fullgraph=True, backend=compile_backend)
        assert torch.allclose(compiled(x, logits), out)
    assert layer.routing_errors() == []
    with pytest.raises(ValueError, match="track_routing=False"):
        moelora.FusedMoE(E, TOP_K, H, I).routing_errors()


@pytest.mark.skipif(not HAS_TORCH_CUDA, reason="needs torch with CUDA and moelora's CUDA backend")
def test_cuda_compiled_layer_sets_the_word():
    """The word's mutation survives functionalization: a compiled forward with a bad id sets the bit."""
    import torch
    layer = moelora.FusedMoE(E, TOP_K, H, I, dtype=torch.bfloat16, device="cuda", track_routing=True)
    x = torch.randn(6, H, device="cuda").bfloat16()
    weights = torch.full((6, TOP_K), 0.5, device="cuda")
    ids = torch.tensor([[0, 1]] * 6, dtype=torch.int32, device="cuda")
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        compiled = torch.compile(layer.forward_routed, fullgraph=True)
        good = compiled(x, weights, ids)
        assert layer.routing_errors() == []
        ids[2, 0] = -7
        bad = compiled(x, weights, ids)
    assert layer.routing_errors() == ["expert id out of range"]
    assert torch.equal(bad[:2], good[:2]) and torch.equal(bad[3:], good[3:])


@pytest.mark.skipif(not HAS_TORCH_CUDA, reason="needs torch with CUDA and moelora's CUDA backend")
def test_cuda_layer_reports_bad_expert_and_adapter_ids():
    import torch
    layer = moelora.FusedMoE(E, TOP_K, H, I, dtype=torch.bfloat16, device="cuda", track_routing=True, max_loras=2,
                             max_lora_rank=8)
    x = torch.randn(6, H, device="cuda").bfloat16()
    weights = torch.full((6, TOP_K), 0.5, device="cuda")
    ids = torch.tensor([[0, 1]] * 6, dtype=torch.int32, device="cuda")
    layer.forward_routed(x, weights, ids)
    assert layer.routing_errors() == []
    ids[4, 1] = E + 2
    layer.forward_routed(x, weights, ids)
    assert layer.routing_errors() == ["expert id out of range"]
    assert layer.routing_errors() == [], "reset"
    lora_ids = torch.tensor([0, 1, -1, 7, 0, 1], dtype=torch.int32, device="cuda")
    layer.forward_routed(x, weights, ids.clamp(max=E - 1), lora_ids)
    assert layer.routing_errors() == ["adapter id out of range"]


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_tracked_op_schema_and_fake(backend):
    """fused_experts_tracked: the untracked op's arguments plus the word, declared mutated."""
    torch = pytest.importorskip("torch")
    p = MoeProblem(seed=37, num_tokens=5, num_experts=4, top_k=2, hidden_size=32, intermediate_size=16,
                   dtype="float32", backend=backend)
    status = torch.zeros(1, dtype=torch.int32, device=p.x.device)
    torch.library.opcheck(torch.ops.moelora.fused_experts_tracked, p.args(), {"routing_status": status},
                          test_utils=("test_schema", "test_faketensor"))
    out = torch.ops.moelora.fused_experts_tracked(*p.args(), routing_status=status)
    assert torch.equal(out, torch.ops.moelora.fused_experts(*p.args())) and int(status.item()) == 0
