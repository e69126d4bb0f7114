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


@pytest.mark.parametrize("ids_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("with_map", [False, True], ids=["no_map", "expert_map"])
def test_align_writes_every_output_entry(ids_dtype, with_map):
    """Through the raw binding, with outputs poisoned: used part as the reference, the
    rest sentinel / -1, dropped slots in a trailing -1 group."""
    rng = rng_for(81 + int(with_map))
    M, top_k, E, block_size = 11, 3, 7, 16
    ids = np.argsort(rng.random((M, E)), axis=1)[:, :top_k].astype(ids_dtype)
    ids[1, 2] = ids[6, 0] = -1
    expert_map = np.array([2, -1, 0, 1, -1, 3, -1], dtype=np.int32) if with_map else None
    max_padded, max_blocks = moelora.moe_align_block_size_capacity(M * top_k, block_size, E)
    sorted_ids = np.full(max_padded, -7777, dtype=np.int32)
    expert_ids = np.full(max_blocks, -7777, dtype=np.int32)
    count = np.full(1, -7777, dtype=np.int32)
    moelora._ext.moe_align_block_size(moelora.view(ids), block_size, E,
                                      None if expert_map is None else moelora.view(expert_map),
                                      moelora.view(sorted_ids), moelora.view(expert_ids), moelora.view(count))
    ref_sorted, ref_experts, ref_count, groups = reference.moe_align_block_size(ids, block_size, E, expert_map)
    assert count[0] == ref_count
    assert (expert_ids[:ref_count // block_size] == ref_experts).all()
    assert (expert_ids[ref_count // block_size:] == -1).all()
    assert (sorted_ids[ref_count:] == M * top_k).all()
    for start, stop in groups:  # the order inside a group is free
        assert sorted(sorted_ids[start:stop]) == sorted(ref_sorted[start:stop])
    assert ref_experts[-1] == -1  # the dropped slots' trailing group


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_gemm_on_per_slot_rows_with_strided_operands(backend):
    """GEMM2's shape: a holds one row per slot (top_k = 1 in fused_moe's terms); a, w and
    out are all non-contiguous views."""
    dtype = "float16"
    rng = rng_for(91)
    M, top_k, E, K, N, block_size = 10, 2, 4, 32, 48, 32
    ids_np = np.argsort(rng.random((M, E)), axis=1)[:, :top_k].astype(np.int32)
    a_full = rounded(uniform(rng, (M * top_k, 2 * K)), dtype)
    w_full = rounded(uniform(rng, (E, N, K + 8)), dtype)
    a_np, w_np = a_full[:, 1::2], w_full[:, :, 4:4 + K]  # column stride 2; padded rows
    weights_np = rng.random((M, top_k), dtype=np.float32)
    sorted_ids, expert_ids, count = moelora.moe_align_block_size(to_backend(ids_np, backend), block_size, E)
    out_full = poisoned((M * top_k, N + 5), dtype, backend)
    out = out_full[:, 5:]
    moelora.fused_moe(to_backend(a_full, backend)[:, 1::2], to_backend(w_full, backend)[:, :, 4:4 + K], out,
                      sorted_ids, expert_ids, count, topk_weights=to_backend(weights_np, backend),
                      mul_routed_weight=True, top_k=1, block_size=block_size)
    sync(backend)
    expected = reference.fused_moe(a_np, w_np, to_numpy(sorted_ids), to_numpy(expert_ids), to_numpy(count),
                                   M * top_k, topk_weights=weights_np, mul_routed_weight=True, top_k=1,
                                   block_size=block_size)
    assert_close(out, expected, dtype)
    assert np.isnan(to_numpy(out_full)[:, :5]).all()  # nothing written outside the view


@pytest.mark.parametrize("backend", BACKENDS)
def test_activations_on_strided_views_and_edge_sizes(backend):
    dtype = "float32"
    rng = rng_for(101)
    for rows, width in ((0, 16), (1, 1), (37, 100)):
        base_np = rounded(uniform(rng, (rows, 2 * width + 6), 3.0), dtype)
        x_np = base_np[:, 3:3 + 2 * width]  # row stride larger than the row
        x = to_backend(base_np, backend)[:, 3:3 + 2 * width]
        out_full = poisoned((rows, width + 2), dtype, backend)
        out = out_full[:, 1:1 + width]
        moelora.swiglu_oai_and_mul(x, alpha=1.2, limit=0.5, out=out)  # a small limit clamps often
        sync(backend)
        assert_close(out, reference.swiglu_oai_and_mul(x_np, 1.2, 0.5), dtype)
        assert np.isnan(to_numpy(out_full)[:, [0, -1]]).all()
        assert_close(moelora.silu_and_mul(x), reference.silu_and_mul(x_np), dtype)
    # 1-D input: one row.
    x_np = rounded(uniform(rng, (8,)), dtype)
    assert_close(moelora.gelu_and_mul(to_backend(x_np, backend)), reference.gelu_and_mul(x_np), dtype)
    # moe_sum_reduce over a strided top_k dim and into strided rows.
    y_full = rounded(uniform(rng, (6, 8, 24)), dtype)
    out_full = poisoned((6, 30), dtype, backend)
    moelora.moe_sum_reduce(to_backend(y_full, backend)[:, ::2], out=out_full[:, 3:27])
    sync(backend)
    assert_close(out_full[:, 3:27], reference.moe_sum_reduce(y_full[:, ::2]), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_experts_strided_routing_and_explicit_block_sizes(backend):
    dtype = "float32"
    p = MoeProblem(seed=111, num_tokens=19, num_experts=6, top_k=2, hidden_size=32, intermediate_size=24,
                   dtype=dtype, backend=backend)
    # topk_ids / topk_weights as column-strided views of wider arrays.
    wide_ids = np.zeros((19, 4), dtype=np.int32)
    wide_ids[:, ::2] = p.topk_ids_np
    wide_weights = np.zeros((19, 4), dtype=np.float32)
    wide_weights[:, ::2] = p.topk_weights_np
    ids = to_backend(wide_ids, backend)[:, ::2]
    weights = to_backend(wide_weights, backend)[:, ::2]
    expected = p.reference()
    for block_size in (16, 32, 128):
        out = poisoned((19, 32), dtype, backend)
        moelora.fused_experts(p.x, p.w13, p.w2, weights, ids, out=out, block_size=block_size)
        sync(backend)
        assert_close(out, expected, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_experts_inplace_with_chunks_and_top_k_1(backend):
    """Inplace across chunks (later chunks read rows earlier ones must not have
    overwritten) and top_k = 1, where GEMM2 writes straight into out."""
    dtype = "float32"
    for top_k, scale in ((1, 1.0), (1, 0.5), (3, 1.0)):
        p = MoeProblem(seed=121 + top_k, num_tokens=23, num_experts=5, top_k=top_k, hidden_size=32,
                       intermediate_size=16, dtype=dtype, backend=backend)
        expected = p.reference(routed_scaling_factor=scale)  # before x (numpy: x_np itself) is overwritten
        out = moelora.fused_experts(*p.args(), inplace=True, chunk_size=5, routed_scaling_factor=scale)
        sync(backend)
        assert out is p.x
        assert_close(out, expected, dtype)
    p = MoeProblem(seed=125, num_tokens=9, num_experts=5, top_k=1, hidden_size=32, intermediate_size=16,
                   dtype=dtype, backend=backend)
    assert_close(moelora.fused_experts(*p.args(), apply_router_weight_on_input=True),
                 p.reference(apply_router_weight_on_input=True), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments_write_nothing(backend):
    p = MoeProblem(seed=131, num_tokens=4, num_experts=4, top_k=2, hidden_size=16, intermediate_size=8,
                   dtype="float32", backend=backend)
    x, w13, w2, weights, ids = p.args()
    out = poisoned((4, 16), "float32", backend)
    with pytest.raises(ValueError, match="'w2'"):
        moelora.fused_experts(x, w13, w2[:, :, :4], weights, ids, out=out)
    assert np.isnan(to_numpy(out)).all()
    with pytest.raises(ValueError, match="'out'"):
        moelora.fused_experts(x, w13, w2, weights, ids, out=poisoned((4, 8), "float32", backend))
    with pytest.raises(ValueError, match="'inplace'"):
        moelora.fused_experts(x, w13, w2, weights, ids, inplace=True, no_combine=True)
    with pytest.raises(ValueError, match="'out'"):
        moelora.silu_and_mul(x, out=poisoned((4, 4), "float32", backend))
    with pytest.raises(ValueError, match="'limit'"):
        moelora.swiglu_oai_and_mul(x, limit=0.0)
    with pytest.raises(ValueError, match="'input'"):
        moelora.moe_sum_reduce(x)
    with pytest.raises(ValueError, match="'num_experts'"):
        moelora.moe_align_block_size(ids, 16, 0)
    with pytest.raises(ValueError, match="'expert_map'"):
        moelora.fused_experts(x, w13, w2, weights, ids, expert_map=to_backend(np.zeros(4, np.int64), backend))
    with pytest.raises(ValueError, match="'hidden_states'"):
        moelora.fused_experts(to_backend(np.zeros((4, 16), np.int32), backend), w13, w2, weights, ids)
    with pytest.raises(TypeError, match="'w13'"):
        moelora.fused_experts(x, [[1.0]], w2, weights, ids)


def test_read_only_outputs_and_unsupported_dtypes_are_named():
    x = np.ones((3, 8), dtype=np.float32)
    out = np.zeros((3, 4), dtype=np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="'out'"):
        moelora.silu_and_mul(x, out=out)
    with pytest.raises(ValueError, match="'input'.*float64"):
        moelora.silu_and_mul(x.astype(np.float64))
    with pytest.raises(ValueError, match="'topk_weights'"):
        moelora.fused_moe(x, np.ones((2, 4, 8), np.float32), np.zeros((3, 4), np.float32),
                          np.zeros(64, np.int32), np.zeros(4, np.int32), np.zeros(1, np.int32),
                          mul_routed_weight=True, block_size=16)
