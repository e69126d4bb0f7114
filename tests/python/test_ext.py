"""The binding itself: view(), the TensorView it builds, errors, sizes and build facts."""

import numpy as np
import pytest

import moelora
from moelora import ops
from moelora_testing import ml_dtypes

_ext = moelora._ext


def test_version_and_build_facts():
    assert moelora.version() == moelora.__version__
    assert moelora.version().count(".") == 2
    assert isinstance(moelora.cuda_available(), bool)


def test_error_is_a_value_error():
    assert issubclass(moelora.Error, ValueError)


@pytest.mark.parametrize("dtype", ["float32", "float16", "int32", "int64"])
def test_view_reads_dtype_shape_strides_and_pointer(dtype):
    array = np.zeros((3, 5, 2), dtype=dtype)
    view = moelora.view(array)
    assert view.dtype == dtype
    assert view.shape == (3, 5, 2)
    assert view.strides == (10, 2, 1)
    assert view.rank == 3
    assert view.numel() == 30
    assert view.is_contiguous()
    assert view.device == "cpu"
    assert view.data_ptr == array.ctypes.data
    assert dtype in repr(view)


@pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes is not installed")
def test_view_bfloat16_through_the_dtype_override():
    array = np.zeros((4, 6), dtype=ml_dtypes.bfloat16)
    view = moelora.view(array.view(np.uint16), "bfloat16")
    assert view.dtype == "bfloat16"
    assert view.shape == (4, 6)
    assert view.data_ptr == array.ctypes.data


def test_view_strides_are_in_elements_and_pointer_is_offset():
    base = np.zeros((8, 9), dtype=np.float32)
    sliced = base[2::2, 1::3]
    view = moelora.view(sliced)
    assert view.shape == (3, 3)
    assert view.strides == (18, 3)
    assert not view.is_contiguous()
    assert view.data_ptr == base.ctypes.data + (2 * 9 + 1) * 4


def test_view_of_empty_and_zero_rank_arrays():
    assert moelora.view(np.zeros((0, 4), dtype=np.float32)).shape == (0, 4)
    assert moelora.view(np.zeros((), dtype=np.int32)).rank == 0


def test_view_accepts_read_only_arrays():
    array = np.arange(6, dtype=np.int32).reshape(2, 3)
    array.flags.writeable = False
    assert moelora.view(array).data_ptr == array.ctypes.data


@pytest.mark.parametrize("dtype", ["float64", "bool", "uint16", "int16", "complex64"])
def test_view_rejects_unsupported_dtypes_by_name(dtype):
    with pytest.raises(ValueError, match=dtype):
        moelora.view(np.zeros((2, 2), dtype=dtype))


def test_view_rejects_rank_above_the_maximum():
    with pytest.raises(ValueError, match="rank 5"):
        moelora.view(np.zeros((1, 1, 1, 1, 1), dtype=np.float32))


def test_view_dtype_override_must_match_the_element_width():
    with pytest.raises(ValueError, match="bfloat16"):
        moelora.view(np.zeros(4, dtype=np.float32), "bfloat16")
    with pytest.raises(ValueError, match="float8"):
        moelora.view(np.zeros(4, dtype=np.uint8), "float8")


def test_view_rejects_non_arrays():
    with pytest.raises(TypeError):
        moelora.view([1.0, 2.0])


def test_activation_enum():
    assert {a.name for a in moelora.Activation} == {"silu", "gelu", "swiglu_oai"}


@pytest.mark.parametrize("block_size", [16, 32, 64, 100, 256])
@pytest.mark.parametrize("num_experts", [1, 8, 128, 257])
def test_align_capacity_formula_matches_the_library(block_size, num_experts):
    for num_slots in (0, 1, 7, 128, 1000, 65536 * 8):
        expected = moelora.moe_align_block_size_capacity(num_slots, block_size, num_experts)
        assert ops.align_capacity(num_slots, block_size, num_experts) == expected
        max_padded, max_blocks = expected
        assert max_blocks * block_size >= max_padded >= num_slots


def test_fused_experts_block_size_is_monotone_and_honours_an_override():
    sizes = [moelora.fused_experts_block_size(m, 8, 128) for m in (1, 16, 64, 256, 1024, 8192)]
    assert sizes == sorted(sizes)
    assert set(sizes) <= {16, 32, 64, 128, 256}
    assert moelora.fused_experts_block_size(4096, 8, 128, block_size=32) == 32


def test_fused_experts_workspace_size_grows_with_tokens_and_is_aligned():
    def size(num_tokens, **options):
        return moelora.fused_experts_workspace_size(num_tokens, 8, 128, 2048, 768, "bfloat16", **options)

    assert size(0) > 0
    assert size(1) % 256 == 0
    assert size(1) < size(16) < size(512)
    # Chunking bounds the workspace by the chunk, not by M.
    assert size(4096, chunk_size=256) == size(256, chunk_size=256)
    with pytest.raises(ValueError, match="float64"):
        moelora.fused_experts_workspace_size(1, 8, 128, 2048, 768, "float64")
