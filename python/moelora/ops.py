"""The moelora ops for numpy arrays and torch tensors.

Every function accepts numpy arrays (float32, float16, ml_dtypes.bfloat16, int32, int64,
and for quantized experts int8 and ml_dtypes.float8_e4m3fn) or torch tensors on the CPU
or a CUDA device; all array arguments of one call live on
one device. Outputs not passed in are allocated here, with the framework and on the
device of the op's first array argument. CUDA work is queued on torch's current stream
of that device and nothing synchronises the host, so every op can be captured in a CUDA
graph.

Shapes use M = tokens, E = experts, H = hidden size, I = intermediate size.
A bad argument raises ValueError (moelora.Error) naming the op and the argument.
"""

import contextlib
import dataclasses
import sys

import numpy as np

from . import _ext

__all__ = [
    "MoeLora",
    "MoeQuant",
    "per_token_group_quant",
    "quant_scheme",
    "quantize",
    "quantize_weights",
    "scaled_fp8_quant",
    "scaled_int8_quant",
    "fused_experts",
    "fused_moe",
    "fused_moe_lora",
    "gelu_and_mul",
    "moe_align_block_size",
    "moe_lora_align_block_size",
    "moe_sum_reduce",
    "silu_and_mul",
    "sparse_mla_decode",
    "swiglu_oai_and_mul",
]

# fused_experts slices its workspace into 256-byte aligned pieces (ops.h).
WORKSPACE_ALIGNMENT = 256

_ACTIVATIONS = {
    "silu": _ext.Activation.silu,
    "gelu": _ext.Activation.gelu,
    "swiglu_oai": _ext.Activation.swiglu_oai,
}

_NUMPY_DTYPES = {"int32": np.int32, "float32": np.float32, "int8": np.int8}

# The 8-bit element types of quantized experts, by the names the library uses.
QUANT_DTYPES = ("float8_e4m3fn", "int8")

# Multi-LoRA limits of the library (include/moelora/ops.h).
MAX_LORA_RANK = _ext.MAX_LORA_RANK
MAX_LORA_ADAPTERS = _ext.MAX_LORA_ADAPTERS

# Sparse MLA decode (include/moelora/ops.h): q/kv rows of 576 lanes, out rows of 512.
MLA_HEAD_DIM = _ext.MLA_HEAD_DIM
MLA_VALUE_DIM = _ext.MLA_VALUE_DIM


def align_capacity(num_slots, block_size, num_experts, min_fn=min):
    """(max_num_tokens_padded, max_num_blocks), as moe_align_block_size_capacity computes
    them, in plain arithmetic so that it also runs on torch's symbolic sizes (the fake
    implementation of torch.ops.moelora.moe_align_block_size under dynamic shapes, which
    passes torch.sym_min): every non-empty group (each expert, and the dropped slots)
    pads by at most block_size - 1 entries, and at most num_slots groups are non-empty."""
    max_num_tokens_padded = num_slots + min_fn(num_experts + 1, num_slots) * (block_size - 1)
    return max_num_tokens_padded, (max_num_tokens_padded + block_size - 1) // block_size


def lora_align_capacity(num_slots, block_size, num_experts, max_loras, min_fn=min):
    """(max_num_tokens_padded, max_num_blocks) of moe_lora_align_block_size: the capacity
    of moe_align_block_size over the virtual experts, one per (expert, adapter or none)
    pair. Plain arithmetic, like align_capacity, for torch's symbolic sizes."""
    return align_capacity(num_slots, block_size, num_experts * (max_loras + 1), min_fn)


def _torch():
    """torch if it has been imported, else None: a torch tensor can only exist then, so
    the numpy path never pays for importing torch."""
    return sys.modules.get("torch")


def _is_torch_tensor(x):
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def _error(op, name, message):
    return _ext.Error(f"moelora.{op}: argument '{name}' {message}")


def _view(op, name, x):
    """The TensorView of one array argument; errors name the op and the argument."""
    if isinstance(x, np.ndarray):
        # numpy cannot export bfloat16 or fp8 through DLPack: pass the bits and name the dtype.
        if x.dtype.name == "bfloat16":
            array, dtype = x.view(np.uint16), "bfloat16"
        elif x.dtype.name == "float8_e4m3fn":
            array, dtype = x.view(np.uint8), "float8_e4m3fn"
        else:
            array, dtype = x, None
    elif _is_torch_tensor(x):
        # DLPack refuses tensors that require grad; the ops never record autograd.
        array, dtype = x.detach(), None
        if x.dtype == _torch().float8_e4m3fn:
            array, dtype = array.view(_torch().uint8), "float8_e4m3fn"
    else:
        raise TypeError(f"moelora.{op}: argument '{name}' expected a numpy array or a torch "
                        f"tensor, got {type(x).__name__}")
    try:
        return _ext.view(array, dtype)
    except _ext.Error as exc:
        reason = str(exc).removeprefix("moelora.view: ")
        raise _error(op, name, f"is not usable: {reason}") from None
    except TypeError:
        # nanobind found no DLPack or buffer export (e.g. an object or structured dtype).
        raise _error(op, name, f"has an unsupported dtype {x.dtype}") from None


def _optional_view(op, name, x):
    return None if x is None else _view(op, name, x)


def _check_writable(op, name, x):
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        raise _error(op, name, "expected a writable array, got a read-only one")


def _launch(x):
    """(stream, device guard) for running an op on x's device.

    CUDA tensors use torch's current stream of their device, so the op orders after
    earlier torch work and is captured by an enclosing torch.cuda.graph."""
    if _is_torch_tensor(x) and x.is_cuda:
        torch = _torch()
        stream = torch.cuda.current_stream(x.device).cuda_stream
        if x.device.index != torch.cuda.current_device():
            return stream, torch.cuda.device(x.device)
        return stream, contextlib.nullcontext()
    return 0, contextlib.nullcontext()


def _empty(like, shape, dtype=None):
    """An uninitialised array of the same framework and device as `like`; dtype is
    'int32', 'float32', 'int8', 'float8_e4m3fn' or None for like's dtype."""
    shape = tuple(int(s) for s in shape)
    if _is_torch_tensor(like):
        torch = _torch()
        torch_dtype = like.dtype if dtype is None else getattr(torch, dtype)
        return torch.empty(shape, dtype=torch_dtype, device=like.device)
    if dtype == "float8_e4m3fn":
        import ml_dtypes  # numpy has no fp8: ml_dtypes' type, as for bfloat16
        return np.empty(shape, dtype=ml_dtypes.float8_e4m3fn)
    return np.empty(shape, dtype=like.dtype if dtype is None else _NUMPY_DTYPES[dtype])


def _data_address(x):
    return x.data_ptr() if _is_torch_tensor(x) else x.ctypes.data


def _aligned_workspace(like, nbytes):
    """A 1-D buffer of at least nbytes, 256-byte aligned, on like's device.

    Its elements are int32 because a TensorView has no byte dtype; fused_experts only
    counts the bytes."""
    words = -(-nbytes // 4)
    raw = _empty(like, (words + WORKSPACE_ALIGNMENT // 4,), "int32")
    # Allocators align int32 to at least 4 bytes, so the gap is a whole number of words.
    offset = (-_data_address(raw) % WORKSPACE_ALIGNMENT) // 4
    return raw[offset:offset + words]


def _dim(view, d):
    """view.shape[d], or 0 when the view has no such dim (the op then reports the rank)."""
    shape = view.shape
    return shape[d] if -len(shape) <= d < len(shape) else 0


def _rows_view(op, name, x, rows, width):
    """x viewed as [rows, width] without a copy (x is written through the view)."""
    if x.ndim == 2:
        return x
    if _is_torch_tensor(x):
        try:
            return x.view(rows, width)
        except RuntimeError:
            pass
    else:
        try:
            return np.reshape(x, (rows, width), copy=False)
        except ValueError:
            pass
        except TypeError:  # numpy < 2.1 has no copy argument: setting shape never copies
            flat = x.view()
            try:
                flat.shape = (rows, width)
                return flat
            except AttributeError:
                pass
    raise _error(op, name, f"expected leading dims that flatten without a copy, got shape "
                           f"{list(x.shape)} with strides {list(x.stride() if _is_torch_tensor(x) else x.strides)}")


def _activation_call(op, x, out, launch_args):
    """Run a gated activation [*, 2I] -> [*, I] by flattening the leading dims."""
    if x.ndim < 1:
        raise _error(op, "input", "expected shape [*, 2I], got a 0-d array")
    leading = tuple(x.shape[:-1])
    rows = int(np.prod(leading, dtype=np.int64))
    width = int(x.shape[-1]) // 2
    if out is None:
        out = _empty(x, leading + (width,))
    else:
        _check_writable(op, "out", out)
        if tuple(out.shape) != leading + (width,):
            raise _error(op, "out", f"expected shape {list(leading + (width,))} (input's leading dims "
                                    f"and half its last dim), got {list(out.shape)}")
    input_2d = x if x.ndim == 2 else x.reshape(rows, int(x.shape[-1]))
    out_2d = _rows_view(op, "out", out, rows, width)
    input_view = _view(op, "input", input_2d)
    out_view = _view(op, "out", out_2d)
    stream, guard = _launch(x)
    with guard:
        getattr(_ext, op)(input_view, out_view, *launch_args, stream=stream)
    return out


def _alignment_outputs(topk_ids, capacity):
    """sorted_token_ids, expert_ids and num_tokens_post_padded (int32, on topk_ids' device)
    for capacity = (max_num_tokens_padded, max_num_blocks)."""
    max_num_tokens_padded, max_num_blocks = capacity
    return (_empty(topk_ids, (max(max_num_tokens_padded, 0),), "int32"),
            _empty(topk_ids, (max(max_num_blocks, 0),), "int32"),
            _empty(topk_ids, (1,), "int32"))


def moe_align_block_size(topk_ids, block_size, num_experts, expert_map=None):
    """Group the routed slots by expert, padded to blocks of block_size.

    topk_ids [M, top_k] int32|int64 (-1 = dropped slot); expert_map [num_experts] int32,
    global -> local expert or -1, optional.
    Returns (sorted_token_ids [max_num_tokens_padded] int32, expert_ids [max_num_blocks]
    int32, num_tokens_post_padded [1] int32), allocated on topk_ids' device; sizes from
    moe_align_block_size_capacity(M * top_k, block_size, num_experts).
    """
    op = "moe_align_block_size"
    ids_view = _view(op, "topk_ids", topk_ids)
    map_view = _optional_view(op, "expert_map", expert_map)
    num_slots = int(np.prod(ids_view.shape, dtype=np.int64))
    sorted_token_ids, expert_ids, num_tokens_post_padded = _alignment_outputs(
        topk_ids, _ext.moe_align_block_size_capacity(num_slots, int(block_size), int(num_experts)))
    stream, guard = _launch(topk_ids)
    with guard:
        _ext.moe_align_block_size(
            ids_view, int(block_size), int(num_experts), map_view,
            _view(op, "sorted_token_ids", sorted_token_ids), _view(op, "expert_ids", expert_ids),
            _view(op, "num_tokens_post_padded", num_tokens_post_padded), stream=stream)
    return sorted_token_ids, expert_ids, num_tokens_post_padded


def _check_max_loras(op, max_loras):
    if isinstance(max_loras, bool) or not isinstance(max_loras, (int, np.integer)):
        raise _error(op, "max_loras", f"expected an int, got {type(max_loras).__name__}")
    if not 1 <= max_loras <= MAX_LORA_ADAPTERS:
        raise _error(op, "max_loras", f"expected a value in [1, {MAX_LORA_ADAPTERS}], got {max_loras}")
    return int(max_loras)


def moe_lora_align_block_size(topk_ids, token_lora_ids, max_loras, block_size, num_experts, adapter_enabled=None,
                              expert_map=None):
    """moe_align_block_size over (expert, adapter) pairs: every block holds the slots of one
    expert and one adapter (or of no adapter: base-only blocks, adapter -1).

    topk_ids [M, top_k] int32|int64 (-1 = dropped slot); token_lora_ids [M] int32, the
    adapter of each token in [0, max_loras) or -1; adapter_enabled [max_loras] int32
    (0 = disabled: its tokens run base-only), optional; expert_map as moe_align_block_size.
    Groups are ordered expert-major: all of an expert's groups are adjacent.
    Returns (sorted_token_ids [max_num_tokens_padded] int32, expert_ids [max_num_blocks]
    int32, block_lora_ids [max_num_blocks] int32 (-1 = base-only or unused block),
    num_tokens_post_padded [1] int32), allocated on topk_ids' device; sizes from
    moe_lora_align_block_size_capacity(M * top_k, block_size, num_experts, max_loras).
    """
    op = "moe_lora_align_block_size"
    max_loras = _check_max_loras(op, max_loras)
    ids_view = _view(op, "topk_ids", topk_ids)
    lora_ids_view = _view(op, "token_lora_ids", token_lora_ids)
    enabled_view = _optional_view(op, "adapter_enabled", adapter_enabled)
    map_view = _optional_view(op, "expert_map", expert_map)
    num_slots = int(np.prod(ids_view.shape, dtype=np.int64))
    capacity = _ext.moe_lora_align_block_size_capacity(num_slots, int(block_size), int(num_experts), max_loras)
    sorted_token_ids, expert_ids, num_tokens_post_padded = _alignment_outputs(topk_ids, capacity)
    block_lora_ids = _empty(topk_ids, (max(capacity[1], 0),), "int32")
    stream, guard = _launch(topk_ids)
    with guard:
        _ext.moe_lora_align_block_size(
            ids_view, lora_ids_view, enabled_view, max_loras, int(block_size), int(num_experts), map_view,
            _view(op, "sorted_token_ids", sorted_token_ids), _view(op, "expert_ids", expert_ids),
            _view(op, "block_lora_ids", block_lora_ids),
            _view(op, "num_tokens_post_padded", num_tokens_post_padded), stream=stream)
    return sorted_token_ids, expert_ids, block_lora_ids, num_tokens_post_padded


def fused_moe(a, w, out, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights=None,
              mul_routed_weight=False, top_k=1, block_size=64):
    """The grouped expert GEMM over aligned blocks, written into out.

    a [num_rows, K]; w [E, N, K]; out [num_rows * top_k, N] (a's dtype);
    out[s] = a[s // top_k] @ w[e].T (* topk_weights.flat[s] when mul_routed_weight) for the
    slots s of the blocks of sorted_token_ids; topk_weights [M, top_k] float32.
    sorted_token_ids, expert_ids, num_tokens_post_padded: from moe_align_block_size with
    the same block_size (a multiple of 16). Returns out.
    """
    op = "fused_moe"
    _check_writable(op, "out", out)
    a_view = _view(op, "a", a)
    stream, guard = _launch(a)
    with guard:
        _ext.fused_moe(
            a_view, _view(op, "w", w), _view(op, "out", out),
            _view(op, "sorted_token_ids", sorted_token_ids), _view(op, "expert_ids", expert_ids),
            _view(op, "num_tokens_post_padded", num_tokens_post_padded),
            _optional_view(op, "topk_weights", topk_weights),
            bool(mul_routed_weight), int(top_k), int(block_size), stream=stream)
    return out


def _is_array(x):
    return isinstance(x, np.ndarray) or _is_torch_tensor(x)


def _slices(op, name, x, allowed=(1, 2)):
    """A LoRA stack argument as a list of its output slices: a list or tuple of arrays (a
    single array is one slice)."""
    if _is_array(x):
        x = [x]
    elif isinstance(x, (list, tuple)):
        x = list(x)
    else:
        raise TypeError(f"moelora.{op}: argument '{name}' expected a list of arrays (one per output slice), "
                        f"got {type(x).__name__}")
    if len(x) not in allowed:
        expected = ("an array (or a list of one)" if allowed == (1,) else
                    f"a list of {' or '.join(str(n) for n in allowed)} arrays (one per output slice)")
        raise _error(op, name, f"expected {expected}, got a list of {len(x)}")
    return x


def _slice_views(op, name, slices):
    return [_view(op, f"{name}[{c}]", x) for c, x in enumerate(slices)]


def fused_moe_lora(out, a, topk_ids, token_lora_ids, lora_a, lora_b, adapter_enabled=None, adapter_scale=None,
                   topk_weights=None, mul_routed_weight=False, add_inputs=True, interleaved_slices=False,
                   alignment=None):
    """The LoRA delta of an expert GEMM, added into out (vLLM's fused_moe_lora).

    out [M * top_k, N]: the GEMM's output (a's dtype), written in place; a [M, K] (row =
    slot // top_k) or [M * top_k, K] (one row per slot); topk_ids [M, top_k] int32|int64
    local expert ids (-1 = dropped); token_lora_ids [M] int32 (-1 = no adapter);
    lora_a / lora_b: lists of S = 1 or 2 slices, lora_a[c] [L, E, r, K] and
    lora_b[c] [L, E, N / S, r] (a's dtype); slice c holds columns [c N/S, (c+1) N/S), or
    the columns n % S == c with interleaved_slices; adapter_enabled [L] int32 (0 =
    disabled) and adapter_scale [L] float32 (1 when absent) optional.
    For every slot whose token has an enabled adapter l and whose expert e is not -1:
        out[s] = (out[s] if add_inputs else 0) + scale[l] * B[l, e] @ (A[l, e] @ a[row(s)])
    times topk_weights.flat[s] (float32 [M, top_k]) when mul_routed_weight; every other
    row is kept with add_inputs, zeroed without.
    alignment: None (per slot; small batches) or (sorted_token_ids, expert_ids,
    block_lora_ids, num_tokens_post_padded, block_size) from moe_lora_align_block_size.
    Returns out.
    """
    op = "fused_moe_lora"
    _check_writable(op, "out", out)
    lora_a = _slices(op, "lora_a", lora_a)
    lora_b = _slices(op, "lora_b", lora_b)
    if len(lora_b) != len(lora_a):
        raise _error(op, "lora_b", f"expected {len(lora_a)} slices (as many as 'lora_a'), got {len(lora_b)}")
    if alignment is None:
        sorted_token_ids = expert_ids = block_lora_ids = num_tokens_post_padded = None
        block_size = 0
    else:
        if not isinstance(alignment, (list, tuple)) or len(alignment) != 5:
            raise _error(op, "alignment", "expected None or a tuple (sorted_token_ids, expert_ids, block_lora_ids, "
                                          "num_tokens_post_padded, block_size), got "
                                          + (f"{len(alignment)} items" if isinstance(alignment, (list, tuple))
                                             else type(alignment).__name__))
        sorted_token_ids, expert_ids, block_lora_ids, num_tokens_post_padded, block_size = alignment
    out_view = _view(op, "out", out)
    a_view = _view(op, "a", a)
    ids_view = _view(op, "topk_ids", topk_ids)
    lora_a_views = _slice_views(op, "lora_a", lora_a)
    lora_b_views = _slice_views(op, "lora_b", lora_b)
    num_slots = int(np.prod(ids_view.shape, dtype=np.int64))
    rank = min(max(_dim(lora_a_views[0], 2), 0), MAX_LORA_RANK)  # a bad rank is reported by the op
    dtype = a_view.dtype if a_view.dtype in ("float32", "float16", "bfloat16") else "float32"
    workspace_bytes = _ext.fused_moe_lora_workspace_size(num_slots, len(lora_a), rank, dtype)
    workspace = _aligned_workspace(a, max(workspace_bytes, 0))
    stream, guard = _launch(a)
    with guard:
        _ext.fused_moe_lora(
            out_view, a_view, ids_view, _view(op, "token_lora_ids", token_lora_ids), lora_a_views, lora_b_views,
            _view(op, "workspace", workspace), _optional_view(op, "adapter_enabled", adapter_enabled),
            _optional_view(op, "adapter_scale", adapter_scale), _optional_view(op, "topk_weights", topk_weights),
            bool(mul_routed_weight), bool(add_inputs), bool(interleaved_slices),
            _optional_view(op, "sorted_token_ids", sorted_token_ids), _optional_view(op, "expert_ids", expert_ids),
            _optional_view(op, "block_lora_ids", block_lora_ids),
            _optional_view(op, "num_tokens_post_padded", num_tokens_post_padded), int(block_size), stream=stream)
    return out


def silu_and_mul(x, out=None):
    """x [*, 2I] -> out [*, I] = silu(x[..., :I]) * x[..., I:]."""
    return _activation_call("silu_and_mul", x, out, ())


def gelu_and_mul(x, out=None):
    """x [*, 2I] -> out [*, I] = gelu(x[..., :I]) * x[..., I:] (exact erf GELU)."""
    return _activation_call("gelu_and_mul", x, out, ())


def swiglu_oai_and_mul(x, alpha=1.702, limit=7.0, out=None):
    """gpt-oss SwiGLU, x [*, 2I] interleaved (gate = x[..., 0::2], up = x[..., 1::2]) -> out [*, I]:
    gate = min(gate, limit); up = clamp(up, -limit, limit);
    out = (up + 1) * gate * sigmoid(alpha * gate)."""
    return _activation_call("swiglu_oai_and_mul", x, out, (float(alpha), float(limit)))


def moe_sum_reduce(x, out=None, routed_scaling_factor=1.0):
    """x [M, top_k, H] -> out [M, H] = routed_scaling_factor * sum over top_k."""
    op = "moe_sum_reduce"
    input_view = _view(op, "input", x)
    if out is None:
        out = _empty(x, (_dim(input_view, 0), _dim(input_view, -1)))
    else:
        _check_writable(op, "out", out)
    stream, guard = _launch(x)
    with guard:
        _ext.moe_sum_reduce(input_view, _view(op, "out", out), float(routed_scaling_factor),
                            stream=stream)
    return out


def sparse_mla_decode(q, kv, indices, softmax_scale, topk_length=None, attn_sink=None, num_splits=0, out=None,
                      lse=None, return_lse=False):
    """Sparse MLA decode attention (DeepSeek-V3.2 class; FlashMLA's sparse semantics).

    q [T, Hq, 576] bf16 (512 latent + 64 rope lanes), kv [S, 1, 576] bf16 (V = the first
    512 lanes), indices [T, 1, topk] int32 (entries < 0 or >= S are masked);
    topk_length [T] int32 (optional valid prefix of each token's indices), attn_sink [Hq]
    float32 (optional per-head logit in the softmax denominator only).
    Returns out [T, Hq, 512] bf16, and with return_lse (or lse given) also lse [T, Hq]
    float32: the natural-log sum of exp of the scaled logits, -inf for a row with no
    valid index (whose output is zeros). num_splits: 0 = chosen for the device.
    """
    op = "sparse_mla_decode"
    q_view = _view(op, "q", q)
    kv_view = _view(op, "kv", kv)
    indices_view = _view(op, "indices", indices)
    num_tokens, num_heads, topk = _dim(q_view, 0), _dim(q_view, 1), _dim(indices_view, -1)
    if out is None:
        out = _empty(q, (num_tokens, num_heads, MLA_VALUE_DIM))
    else:
        _check_writable(op, "out", out)
    if lse is None and return_lse:
        lse = _empty(q, (num_tokens, num_heads), "float32")
    elif lse is not None:
        _check_writable(op, "lse", lse)
    # Bad sizes are reported by the op; the clamps keep the workspace query sane until then.
    workspace_bytes = _ext.sparse_mla_decode_workspace_size(
        max(num_tokens, 0), min(max(num_heads, 1), _ext.MLA_MAX_HEADS), max(topk, 1), q_view,
        min(max(int(num_splits), 0), _ext.MLA_MAX_SPLITS))
    workspace = _aligned_workspace(q, max(workspace_bytes, 0))
    stream, guard = _launch(q)
    with guard:
        _ext.sparse_mla_decode(q_view, kv_view, indices_view, _view(op, "out", out), _view(op, "workspace", workspace),
                               float(softmax_scale), _optional_view(op, "lse", lse),
                               _optional_view(op, "topk_length", topk_length),
                               _optional_view(op, "attn_sink", attn_sink), int(num_splits), stream=stream)
    return (out, lse) if (return_lse or lse is not None) else out


# ---- quantization -------------------------------------------------------------------

def quant_scheme(name, block_n=128, block_k=128, static_activation_scales=False, group_size=128, zero_points=False):
    """The QuantScheme of 'fp8_block', 'fp8_channel', 'fp8_tensor', 'int8_channel' or
    'int8_block' (block_n, block_k, static_activation_scales), or of weight-only 'w4a16' /
    'w8a16' (group_size 32, 64, 128 or 0 per channel; zero_points) (include/moelora/quant.h);
    a QuantScheme is returned as it is."""
    if isinstance(name, _ext.QuantScheme):
        return name
    if not isinstance(name, str):
        raise TypeError(f"moelora.quant_scheme: expected a scheme name or a QuantScheme, got {type(name).__name__}")
    return _ext.quant_scheme(name, int(block_n), int(block_k), bool(static_activation_scales), int(group_size),
                             bool(zero_points))


def _quant_dtype(op, dtype):
    name = getattr(dtype, "name", None) or str(dtype).removeprefix("torch.")
    if name not in QUANT_DTYPES:
        raise _error(op, "dtype", f"expected one of {QUANT_DTYPES}, got {dtype!r}")
    return name


def quantize(x, block_rows=1, block_cols=128, dtype="float8_e4m3fn", scales=None, static_scales=False, out=None):
    """Quantize x [R, C] or [B, R, C] (bf16/fp16/fp32) to fp8 e4m3 or int8 with one float32
    scale per block of block_rows x block_cols elements (0: the whole dim).

    Dynamic (static_scales False): scale = max(absmax of the block, 1e-10) / qmax (448 or
    127), written to `scales` (allocated [B, ceil(R / block_rows), ceil(C / block_cols)]
    when None; any strides, e.g. column-major). Static: `scales` is read.
    q = round(x / scale) (fp8: nearest even, saturated to +-448; int8: half to even,
    clamped to [-128, 127]). Returns (q, scales)."""
    op = "quantize"
    dtype = _quant_dtype(op, dtype)
    x_view = _view(op, "input", x)
    shape = tuple(x_view.shape)
    if out is None:
        out = _empty(x, shape, dtype)
    else:
        _check_writable(op, "out", out)
    if scales is None:
        if static_scales:
            raise _error(op, "scales", "expected the static scales, got None")
        rows, cols = (shape[-2], shape[-1]) if len(shape) >= 2 else (0, 0)
        br = int(block_rows) if block_rows else max(rows, 1)
        bc = int(block_cols) if block_cols else max(cols, 1)
        scale_shape = shape[:-2] + (-(-rows // max(br, 1)), -(-cols // max(bc, 1)))
        scales = _empty(x, scale_shape, "float32")
    elif not static_scales:
        _check_writable(op, "scales", scales)
    stream, guard = _launch(x)
    with guard:
        _ext.quantize(x_view, _view(op, "out", out), _view(op, "scales", scales), int(block_rows), int(block_cols),
                      bool(static_scales), stream=stream)
    return out, scales


def _transposed_empty(like, rows, cols):
    """An uninitialised float32 [rows, cols] array with column-major strides."""
    if _is_torch_tensor(like):
        return _torch().empty((cols, rows), dtype=_torch().float32, device=like.device).t()
    return np.empty((cols, rows), dtype=np.float32).T


def per_token_group_quant(x, group_size=128, dtype="float8_e4m3fn", column_major_scales=False, out=None):
    """vLLM's per_token_group_quant_fp8 / _int8: x [M, K] -> (q [M, K], scales [M, K / group_size])
    with one scale per token and group of group_size columns (which must divide K);
    column_major_scales lays the scales out transposed (strides [1, M])."""
    op = "per_token_group_quant"
    x_view = _view(op, "x", x)
    if len(x_view.shape) != 2:
        raise _error(op, "x", f"expected shape [M, K], got {list(x_view.shape)}")
    rows, cols = x_view.shape
    if int(group_size) <= 0 or cols % int(group_size) != 0:
        raise _error(op, "group_size", f"expected a divisor of K = {cols}, got {group_size}")
    scales = _transposed_empty(x, rows, cols // int(group_size)) if column_major_scales else None
    return quantize(x, 1, int(group_size), dtype, scales=scales, out=out)


def scaled_fp8_quant(x, scale=None, use_per_token_if_dynamic=False, out=None):
    """vLLM's scaled_fp8_quant: x [M, K] -> (q fp8 [M, K], scale). With `scale` ([1]
    float32): static per-tensor. Without: dynamic per tensor (scale [1]), or per token
    (scale [M, 1]) with use_per_token_if_dynamic."""
    return _scaled_quant("scaled_fp8_quant", x, scale, use_per_token_if_dynamic, "float8_e4m3fn", out)


def scaled_int8_quant(x, scale=None, out=None):
    """vLLM's scaled_int8_quant (symmetric): x [M, K] -> (q int8 [M, K], scale). With
    `scale` ([1] float32): static per-tensor; without: dynamic per token (scale [M, 1])."""
    return _scaled_quant("scaled_int8_quant", x, scale, True, "int8", out)


def _scaled_quant(op, x, scale, per_token, dtype, out):
    x_view = _view(op, "x", x)
    if len(x_view.shape) != 2:
        raise _error(op, "x", f"expected shape [M, K], got {list(x_view.shape)}")
    if scale is not None:
        scale_2d = scale.reshape(1, 1) if scale.ndim != 2 else scale
        q, _ = quantize(x, 0, 0, dtype, scales=scale_2d, static_scales=True, out=out)
        return q, scale
    if per_token:
        return quantize(x, 1, 0, dtype, out=out)
    q, scales = quantize(x, 0, 0, dtype, out=out)
    return q, scales.reshape(1)


def quantize_weights(w, scheme):
    """Quantize expert weights w [E, N, K] (bf16/fp16/fp32) for a scheme (a name or a
    QuantScheme): returns (w_q [E, N, K] fp8/int8, w_scale) with w_scale [E, ceil(N /
    block_n), ceil(K / block_k)] (block), [E, N] (channel) or [E] (tensor), float32: the
    layouts fused_experts takes (DeepSeek-V3's weight_scale_inv for block scales).
    Weight-only schemes (torch tensors): (w_packed uint8, w_scale in w's dtype (bf16 for
    fp32), w_zero uint8 or None), round to nearest per group (weight_only.py)."""
    scheme = quant_scheme(scheme)
    if scheme.weight_only:
        from . import weight_only
        q, scales, zeros = weight_only.quantize_weight_only(w, scheme.weight_bits, scheme.group_size,
                                                           scheme.zero_points)
        return weight_only.to_layer(q, scheme.weight_bits), scales, zeros
    g = scheme.weight_scales
    if g == _ext.ScaleGranularity.block:
        return quantize(w, scheme.block_n, scheme.block_k, scheme.element)
    q, scales = quantize(w, 1 if g == _ext.ScaleGranularity.channel else 0, 0, scheme.element)
    return q, scales.reshape(scales.shape[0], -1) if g == _ext.ScaleGranularity.channel else scales.reshape(-1)


@dataclasses.dataclass
class MoeQuant:
    """Quantized experts, for fused_experts(..., quant=MoeQuant(...)).

    scheme: 'fp8_block', 'fp8_channel', 'fp8_tensor', 'int8_channel', 'int8_block' or a
    QuantScheme (quant_scheme(...)); w13 / w2 then hold its element type (fp8 e4m3 or
    int8) and w13_scale / w2_scale its float32 scales (quantize_weights' layouts);
    a13_scale / a2_scale ([1] float32): static activation scales of GEMM1's and GEMM2's
    inputs (fp8_tensor with static_activation_scales).
    Weight-only 'w4a16' / 'w8a16' (quant_scheme(name, group_size=, zero_points=)): w13 / w2
    hold packed uint8 weights, w13_scale / w2_scale are in the layer dtype [E, N, K / G]
    (or [E, N]), w13_zero / w2_zero the uint8 zero points with zero_points
    (include/moelora/ops.h, FusedExpertsQuant).
    """

    scheme: object
    w13_scale: object
    w2_scale: object
    a13_scale: object = None
    a2_scale: object = None
    w13_zero: object = None
    w2_zero: object = None


@dataclasses.dataclass
class MoeLora:
    """The adapters of one MoE layer, for fused_experts(..., lora=MoeLora(...)).

    token_lora_ids [M] int32: the adapter slot of each token, -1 = none.
    w13_lora_a / w13_lora_b: lists of 1 or 2 slices (a single array is one slice).
        Two slices (gate, up): w13_lora_a[c] [L, E, r, H], w13_lora_b[c] [L, E, I, r]; with
        swiglu_oai they are gate and up of gpt-oss's interleaved rows (even, odd).
        One slice: w13_lora_a[0] [L, E, r, H], w13_lora_b[0] [L, E, 2I, r] in w13's row order.
    w2_lora_a [L, E, r, I], w2_lora_b [L, E, H, r].
    adapter_enabled [L] int32 (0 = disabled slot), adapter_scale [L] float32 (1 when
    absent): optional. E = the experts of w13 (local experts); stacks in the layer's dtype.
    The layer computes h1 = x (w13[e] + scale B13 A13)^T, h2 = act(h1) (w2[e] + scale B2 A2)^T
    for the tokens with an enabled adapter.
    """

    token_lora_ids: object
    w13_lora_a: object
    w13_lora_b: object
    w2_lora_a: object
    w2_lora_b: object
    adapter_enabled: object = None
    adapter_scale: object = None


def _activation_enum(activation):
    if isinstance(activation, _ext.Activation):
        return activation
    try:
        return _ACTIVATIONS[activation]
    except (KeyError, TypeError):
        raise _error("fused_experts", "activation",
                     f"expected one of {sorted(_ACTIVATIONS)}, got {activation!r}") from None


def fused_experts(hidden_states, w13, w2, topk_weights, topk_ids, activation="silu", inplace=False,
                  no_combine=False, apply_router_weight_on_input=False, routed_scaling_factor=1.0,
                  expert_map=None, chunk_size=65536, swiglu_alpha=1.702, swiglu_limit=7.0, out=None,
                  block_size=0, lora=None, quant=None, routing_status=None):
    """The whole MoE layer: align -> GEMM1 -> activation -> GEMM2 -> reduce.

    hidden_states [M, H]; w13 [E_local, 2I, H] (gate rows then up rows; interleaved for
    swiglu_oai); w2 [E_local, H, I]; topk_weights [M, top_k] float32; topk_ids [M, top_k]
    int32|int64 global expert ids (-1 = dropped slot); expert_map [E_global] int32
    (global -> local or -1 for experts on other ranks, whose slots contribute zero).
    Returns out [M, H] (routed_scaling_factor * the weighted sum over the top_k experts),
    or [M, top_k, H] with no_combine. inplace writes into hidden_states and returns it.
    block_size 0 lets the library choose. lora: a MoeLora (multi-LoRA adapters), or None.
    quant: a MoeQuant (w13 / w2 hold fp8 or int8 experts, or packed 4/8-bit weight-only
    ones; include/moelora/ops.h FusedExpertsQuant gives the arithmetic), or None.
    routing_status: an int32 [1] tensor on hidden_states' device, or None: on CUDA the
    kernels OR moelora.ROUTING_BAD_EXPERT_ID (a topk id outside [-1, E_global)),
    ROUTING_BAD_ADAPTER_ID (a token_lora_ids value outside [-1, max_loras)) and
    ROUTING_BAD_EXPERT_MAP (an expert_map value outside [-1, E_local)) into it where they
    meet one, instead of dropping those slots silently; the caller zeroes it and reads it
    when it likes (no synchronisation here, so it works inside a CUDA graph). The CPU
    backend raises for the same ids.
    """
    op = "fused_experts"
    activation = _activation_enum(activation)
    if inplace:
        if no_combine:
            raise _error(op, "inplace", "cannot combine with no_combine (out is [M, top_k, H])")
        if out is not None and out is not hidden_states:
            raise _error(op, "out", "expected None or hidden_states itself when inplace")
        out = hidden_states
    x_view = _view(op, "hidden_states", hidden_states)
    w13_view = _view(op, "w13", w13)
    w2_view = _view(op, "w2", w2)
    weights_view = _view(op, "topk_weights", topk_weights)
    ids_view = _view(op, "topk_ids", topk_ids)
    map_view = _optional_view(op, "expert_map", expert_map)

    num_tokens, hidden_size = _dim(x_view, 0), _dim(x_view, -1)
    top_k = _dim(ids_view, -1)
    if out is None:
        shape = (num_tokens, top_k, hidden_size) if no_combine else (num_tokens, hidden_size)
        out = _empty(hidden_states, shape)
    else:
        _check_writable(op, "out", out)
    out_view = x_view if out is hidden_states else _view(op, "out", out)

    lora_args, max_loras, lora_rank = {}, 0, 0
    if lora is not None:
        if not isinstance(lora, MoeLora):
            raise TypeError(f"moelora.{op}: argument 'lora' expected a moelora.MoeLora or None, "
                            f"got {type(lora).__name__}")
        w13_lora_a = _slices(op, "w13_lora_a", lora.w13_lora_a)
        w13_lora_b = _slices(op, "w13_lora_b", lora.w13_lora_b)
        if len(w13_lora_b) != len(w13_lora_a):
            raise _error(op, "w13_lora_b", f"expected {len(w13_lora_a)} slices (as many as 'w13_lora_a'), "
                                           f"got {len(w13_lora_b)}")
        w2_lora_a = _slices(op, "w2_lora_a", lora.w2_lora_a, allowed=(1,))[0]
        w2_lora_b = _slices(op, "w2_lora_b", lora.w2_lora_b, allowed=(1,))[0]
        lora_args = dict(
            token_lora_ids=_view(op, "token_lora_ids", lora.token_lora_ids),
            w13_lora_a=_slice_views(op, "w13_lora_a", w13_lora_a),
            w13_lora_b=_slice_views(op, "w13_lora_b", w13_lora_b),
            w2_lora_a=_view(op, "w2_lora_a", w2_lora_a), w2_lora_b=_view(op, "w2_lora_b", w2_lora_b),
            adapter_enabled=_optional_view(op, "adapter_enabled", lora.adapter_enabled),
            adapter_scale=_optional_view(op, "adapter_scale", lora.adapter_scale))
        # Bad sizes are reported by the op; the clamps keep the workspace query sane until then.
        max_loras = min(max(_dim(lora_args["w13_lora_a"][0], 0), 0), MAX_LORA_ADAPTERS)
        lora_rank = min(max(_dim(lora_args["w13_lora_a"][0], 2), _dim(lora_args["w2_lora_a"], 2), 0),
                        MAX_LORA_RANK)

    quant_args, scheme = {}, None
    if quant is not None:
        if not isinstance(quant, MoeQuant):
            raise TypeError(f"moelora.{op}: argument 'quant' expected a moelora.MoeQuant or None, "
                            f"got {type(quant).__name__}")
        scheme = quant_scheme(quant.scheme)
        quant_args = dict(quant=scheme, w13_scale=_view(op, "w13_scale", quant.w13_scale),
                          w2_scale=_view(op, "w2_scale", quant.w2_scale),
                          a13_scale=_optional_view(op, "a13_scale", quant.a13_scale),
                          a2_scale=_optional_view(op, "a2_scale", quant.a2_scale),
                          w13_zero=_optional_view(op, "w13_zero", quant.w13_zero),
                          w2_zero=_optional_view(op, "w2_zero", quant.w2_zero))

    num_experts = _dim(map_view, 0) if map_view is not None else _dim(w13_view, 0)
    options = dict(
        activation=activation, swiglu_alpha=float(swiglu_alpha), swiglu_limit=float(swiglu_limit),
        apply_router_weight_on_input=bool(apply_router_weight_on_input), no_combine=bool(no_combine),
        routed_scaling_factor=float(routed_scaling_factor), chunk_size=int(chunk_size),
        block_size=int(block_size))
    # w13's rows are 2I for every scheme (w2's last dim is I / 2 for 4-bit weights).
    workspace_bytes = _ext.fused_experts_workspace_size(
        num_tokens, top_k, num_experts, hidden_size, _dim(w13_view, 1) // 2,
        x_view.dtype if x_view.dtype in ("float32", "float16", "bfloat16") else "float32",
        num_local_experts=_dim(w13_view, 0), max_loras=max_loras, lora_rank=lora_rank, quant=scheme, **options)
    workspace = _aligned_workspace(hidden_states, max(workspace_bytes, 0))

    stream, guard = _launch(hidden_states)
    with guard:
        _ext.fused_experts(x_view, w13_view, w2_view, weights_view, ids_view, out_view,
                           _view(op, "workspace", workspace), map_view, stream=stream, **options, **lora_args,
                           **quant_args, routing_status=_optional_view(op, "routing_status", routing_status))
    return out
