"""Every moelora op against the float64 numpy reference, on numpy arrays and on torch
tensors (CPU and, where present, CUDA): fresh random data per test, outputs poisoned
with NaN before the run and checked fully written."""

import zlib

import numpy as np
import pytest

import moelora
from moelora import reference
from moelora_testing import (BACKENDS, DTYPES, MoeProblem, assert_close, poisoned, rng_for, rounded, sync,
                             to_backend, to_numpy, uniform)

# (name, E, top_k, H, I, activation, M, experts with weights): the brief's shapes at
# reduced M; only the routed experts get weights, the others are never read.
WORKLOADS = [
    ("qwen3-30b-a3b", 128, 8, 2048, 768, "silu", 1, 8),
    ("qwen3-30b-a3b", 128, 8, 2048, 768, "silu", 16, 16),
    ("olmoe-1b-7b", 64, 8, 2048, 1024, "silu", 16, 12),
    ("deepseek-v3-tp8", 256, 8, 7168, 256, "silu", 3, 10),
    ("gpt-oss-120b", 128, 4, 2880, 2880, "swiglu_oai", 2, 6),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda w: f"{w[0]}-M{w[6]}")
def test_fused_experts_workloads_bf16(backend, workload):
    pytest.importorskip("ml_dtypes")
    name, E, top_k, H, I, activation, M, used = workload
    p = MoeProblem(seed=zlib.crc32(name.encode()) % 1000 + M, num_tokens=M, num_experts=E, top_k=top_k, hidden_size=H,
                   intermediate_size=I, dtype="bfloat16", backend=backend, experts_used=used,
                   activation=activation)
    out = poisoned((M, H), "bfloat16", backend)
    moelora.fused_experts(*p.args(), activation=activation, out=out)
    sync(backend)
    assert_close(out, p.reference(), "bfloat16")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu", "swiglu_oai"])
def test_fused_experts_small_every_dtype(backend, dtype, activation):
    # K = H = 40 and N = 2I = 2 * 24: no tile divides them.
    p = MoeProblem(seed=11, num_tokens=33, num_experts=8, top_k=2, hidden_size=40, intermediate_size=24,
                   dtype=dtype, backend=backend, activation=activation)
    out = moelora.fused_experts(*p.args(), activation=activation)
    sync(backend)
    assert_close(out, p.reference(), dtype)


OPTIONS = [
    pytest.param(dict(inplace=True), id="inplace"),
    pytest.param(dict(no_combine=True), id="no_combine"),
    pytest.param(dict(chunk_size=7), id="chunked"),
    pytest.param(dict(apply_router_weight_on_input=True), id="weight_on_input"),
    pytest.param(dict(routed_scaling_factor=2.5), id="scaled"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", OPTIONS)
def test_fused_experts_options(backend, options):
    dtype = "float16"
    p = MoeProblem(seed=21, num_tokens=20, num_experts=16, top_k=4, hidden_size=64, intermediate_size=32,
                   dtype=dtype, backend=backend)
    expected = p.reference(**{k: v for k, v in options.items() if k not in ("inplace", "chunk_size")})
    out = moelora.fused_experts(*p.args(), **options)
    sync(backend)
    if options.get("inplace"):
        assert out is p.x
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_experts_edges(backend):
    dtype = "float32"
    # M = 0: nothing to do, nothing to fail.
    p = MoeProblem(seed=31, num_tokens=0, num_experts=4, top_k=2, hidden_size=16, intermediate_size=16,
                   dtype=dtype, backend=backend)
    assert tuple(moelora.fused_experts(*p.args()).shape) == (0, 16)
    # top_k = 1, and all tokens on one expert (the other experts see no token).
    p = MoeProblem(seed=32, num_tokens=9, num_experts=6, top_k=1, hidden_size=24, intermediate_size=16,
                   dtype=dtype, backend=backend)
    p.set_topk_ids(np.full((9, 1), 3, dtype=np.int32))
    assert_close(moelora.fused_experts(*p.args()), p.reference(), dtype)
    # Dropped slots (id -1) contribute zero.
    p = MoeProblem(seed=33, num_tokens=7, num_experts=6, top_k=2, hidden_size=24, intermediate_size=16,
                   dtype=dtype, backend=backend)
    ids = p.topk_ids_np.copy()
    ids[::3, 1] = -1
    p.set_topk_ids(ids)
    assert_close(moelora.fused_experts(*p.args()), p.reference(), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_experts_expert_parallel_and_strided_input(backend):
    dtype = "float32"
    expert_map = np.array([0, -1, 1, -1, 2, -1, 3, -1], dtype=np.int32)  # this rank holds 0, 2, 4, 6
    p = MoeProblem(seed=41, num_tokens=24, num_experts=8, top_k=3, hidden_size=32, intermediate_size=16,
                   dtype=dtype, backend=backend, expert_map=expert_map, ids_dtype=np.int64)
    expected = p.reference()
    x_np = rounded(uniform(rng_for(42), (48, 32)), dtype)
    p.x_np = x_np[::2]  # every other row: a row stride of 2 * H
    p.x = to_backend(x_np, backend)[::2]
    out = moelora.fused_experts(*p.args(), expert_map=p.expert_map)
    sync(backend)
    assert_close(out, p.reference(), dtype)
    assert not np.allclose(to_numpy(out), expected)  # the strided input was really used


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_activations_and_reduce(backend, dtype):
    rng = rng_for(51)
    x_np = rounded(uniform(rng, (3, 5, 2 * 40), 4.0), dtype)  # [*, 2I] with two leading dims
    x = to_backend(x_np, backend)
    for op, ref in ((moelora.silu_and_mul, reference.silu_and_mul),
                    (moelora.gelu_and_mul, reference.gelu_and_mul),
                    (moelora.swiglu_oai_and_mul, reference.swiglu_oai_and_mul)):
        out = poisoned((3, 5, 40), dtype, backend)
        op(x, out=out)
        sync(backend)
        assert_close(out, ref(x_np), dtype)
    y_np = rounded(uniform(rng, (9, 4, 72)), dtype)
    out = poisoned((9, 72), dtype, backend)
    moelora.moe_sum_reduce(to_backend(y_np, backend), out=out, routed_scaling_factor=0.75)
    sync(backend)
    assert_close(out, reference.moe_sum_reduce(y_np, 0.75), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [16, 48, 64])
def test_align_then_grouped_gemm(backend, block_size):
    dtype = "float32"
    rng = rng_for(61 + block_size)
    M, top_k, E, K, N = 13, 3, 5, 40, 24
    ids_np = np.argsort(rng.random((M, E)), axis=1)[:, :top_k].astype(np.int32)
    a_np = rounded(uniform(rng, (M, K)), dtype)
    w_np = rounded(uniform(rng, (E, N, K)), dtype)
    weights_np = rng.random((M, top_k), dtype=np.float32)
    ids = to_backend(ids_np, backend)
    sorted_ids, expert_ids, count = moelora.moe_align_block_size(ids, block_size, E)
    out = poisoned((M * top_k, N), dtype, backend)
    moelora.fused_moe(to_backend(a_np, backend), to_backend(w_np, backend), out, sorted_ids, expert_ids, count,
                      topk_weights=to_backend(weights_np, backend), mul_routed_weight=True, top_k=top_k,
                      block_size=block_size)
    sync(backend)
    used = int(to_numpy(count)[0])
    assert used % block_size == 0
    slots = to_numpy(sorted_ids)[:used]
    assert sorted(slots[slots < M * top_k].tolist()) == list(range(M * top_k))  # each slot exactly once
    for b in range(used // block_size):
        block = slots[b * block_size:(b + 1) * block_size]
        real = block[block < M * top_k]
        assert (ids_np.reshape(-1)[real] == to_numpy(expert_ids)[b]).all()  # one expert per block
    expected = reference.fused_moe(a_np, w_np, to_numpy(sorted_ids), to_numpy(expert_ids), [used], M * top_k,
                                   topk_weights=weights_np, mul_routed_weight=True, top_k=top_k,
                                   block_size=block_size)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments_name_the_argument(backend):
    p = MoeProblem(seed=71, num_tokens=4, num_experts=4, top_k=2, hidden_size=16, intermediate_size=8,
                   dtype="float32", backend=backend)
    x, w13, w2, weights, ids = p.args()
    cases = [
        ("'w13'", lambda: moelora.fused_experts(x, w13[:, :, :8], w2, weights, ids)),
        ("'w2'", lambda: moelora.fused_experts(x, w13, w2[:2], weights, ids)),
        ("'topk_weights'", lambda: moelora.fused_experts(x, w13, w2, weights[:3], ids)),
        ("'topk_ids'", lambda: moelora.fused_experts(x, w13, w2, weights, to_backend(
            np.zeros((4, 2), dtype=np.float32), backend))),
        ("'input'", lambda: moelora.silu_and_mul(to_backend(np.ones((3, 5), dtype=np.float32), backend))),
        ("'block_size'", lambda: moelora.moe_align_block_size(ids, 8, 4)),
        ("'activation'", lambda: moelora.fused_experts(x, w13, w2, weights, ids, activation="relu")),
    ]
    if backend == "numpy":
        cases.append(("'topk_ids'", lambda: moelora.fused_experts(x, w13, w2, weights,
                                                                  np.full((4, 2), 9, dtype=np.int32))))
    for argument, call in cases:
        with pytest.raises(ValueError, match=argument):
            call()
