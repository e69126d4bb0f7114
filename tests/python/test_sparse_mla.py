"""sparse_mla_decode against the float64 numpy reference, on numpy arrays and torch
tensors (CPU and, where present, CUDA), and as the torch custom op."""

import numpy as np
import pytest

import moelora
from moelora import reference
from moelora_testing import BACKENDS, HAS_TORCH_CUDA, poisoned, rel_error, rng_for, rounded, sync, to_backend, to_numpy

try:
    import torch
except ImportError:
    torch = None

D, DV = 576, 512


def problem(seed, num_tokens, num_heads, num_rows, topk, backend, masked=False):
    rng = rng_for(seed)
    q = rounded(rng.standard_normal((num_tokens, num_heads, D), dtype=np.float32), "bfloat16")
    kv = rounded(rng.standard_normal((num_rows, 1, D), dtype=np.float32), "bfloat16")
    indices = rng.integers(0, num_rows, (num_tokens, 1, topk)).astype(np.int32)
    if masked:
        mask = rng.random(indices.shape) < 0.3
        indices[mask] = rng.choice(np.array([-1, -5, num_rows, num_rows + 9], dtype=np.int32), int(mask.sum()))
        indices[num_tokens // 2] = -1  # one token with no valid index
    return q, kv, indices, [to_backend(x, backend) for x in (q, kv, indices)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_heads,topk,masked", [(16, 64, False), (64, 128, True), (128, 192, False), (20, 100, True)])
def test_sparse_mla_decode_matches_reference(backend, num_heads, topk, masked):
    pytest.importorskip("ml_dtypes")
    num_tokens, num_rows, scale = 4, 300, 1 / 24
    q, kv, indices, (q_b, kv_b, indices_b) = problem(num_heads + topk, num_tokens, num_heads, num_rows, topk, backend,
                                                     masked)
    rng = rng_for(5)
    sink = (rng.standard_normal(num_heads) + 2).astype(np.float32)
    length = rng.integers(-1, topk + 3, num_tokens).astype(np.int32)
    out = poisoned((num_tokens, num_heads, DV), "bfloat16", backend)
    lse = poisoned((num_tokens, num_heads), "float32", backend)
    moelora.sparse_mla_decode(q_b, kv_b, indices_b, scale, topk_length=to_backend(length, backend),
                              attn_sink=to_backend(sink, backend), out=out, lse=lse)
    sync(backend)
    ref_out, ref_lse = reference.sparse_mla_decode(q, kv, indices, scale, topk_length=length, attn_sink=sink)
    assert rel_error(out, ref_out) <= 1e-2
    got_lse = to_numpy(lse)
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(got_lse), empty)
    assert np.all(to_numpy(out)[empty] == 0)
    assert rel_error(got_lse[~empty], ref_lse[~empty]) <= 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_mla_decode_allocates_outputs(backend):
    pytest.importorskip("ml_dtypes")
    q, kv, indices, args = problem(3, 2, 16, 100, 64, backend)
    out = moelora.sparse_mla_decode(*args, 0.05)
    out2, lse = moelora.sparse_mla_decode(*args, 0.05, return_lse=True)
    sync(backend)
    ref_out, ref_lse = reference.sparse_mla_decode(q, kv, indices, 0.05)
    assert tuple(out.shape) == (2, 16, DV) and tuple(lse.shape) == (2, 16)
    assert rel_error(out, ref_out) <= 1e-2 and rel_error(out2, ref_out) <= 1e-2
    assert rel_error(lse, ref_lse) <= 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_mla_decode_rejects_bad_arguments(backend):
    pytest.importorskip("ml_dtypes")
    _, _, _, (q, kv, indices) = problem(4, 2, 16, 100, 64, backend)
    with pytest.raises(ValueError, match="argument 'q' expected size 576 on dim 2"):
        moelora.sparse_mla_decode(q[:, :, :512], kv, indices, 0.05)
    with pytest.raises(ValueError, match="argument 'indices' expected size 2 on dim 0"):
        moelora.sparse_mla_decode(q, kv, indices[:1], 0.05)
    with pytest.raises(ValueError, match="argument 'softmax_scale' expected a finite value > 0"):
        moelora.sparse_mla_decode(q, kv, indices, -1.0)


@pytest.mark.skipif(torch is None, reason="torch is not installed")
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not HAS_TORCH_CUDA, reason="needs torch with CUDA and moelora's CUDA backend"))])
def test_sparse_mla_decode_torch_op_compiles(device):
    pytest.importorskip("ml_dtypes")
    backend = "torch-cuda" if device == "cuda" else "torch-cpu"
    q, kv, indices, (q_t, kv_t, indices_t) = problem(6, 3, 64, 400, 256, backend, masked=True)

    def attend(q, kv, indices):
        return torch.ops.moelora.sparse_mla_decode(q, kv, indices, 0.04)

    out, lse = torch.compile(attend, fullgraph=True)(q_t, kv_t, indices_t)
    sync(backend)
    ref_out, ref_lse = reference.sparse_mla_decode(q, kv, indices, 0.04)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert rel_error(out, ref_out) <= 1e-2
    finite = ~np.isneginf(ref_lse)
    assert rel_error(to_numpy(lse)[finite], ref_lse[finite]) <= 1e-3
