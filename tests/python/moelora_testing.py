"""Shared helpers of the Python tests: backends, dtypes, random problems, comparisons.

A "backend" is where the arrays live: "numpy", "torch-cpu" or "torch-cuda". Data is
generated in numpy (float32), rounded to the test dtype, and the reference sees exactly
the rounded values the op sees.
"""

import numpy as np
import pytest

import moelora
from moelora import reference

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None

try:
    import torch
except ImportError:
    torch = None

HAS_TORCH_CUDA = torch is not None and torch.cuda.is_available() and moelora.cuda_available()

BACKENDS = [
    pytest.param("numpy", id="numpy"),
    pytest.param("torch-cpu", id="torch-cpu",
                 marks=pytest.mark.skipif(torch is None, reason="torch is not installed")),
    pytest.param("torch-cuda", id="torch-cuda",
                 marks=pytest.mark.skipif(not HAS_TORCH_CUDA,
                                          reason="needs torch with CUDA and moelora's CUDA backend")),
]
TORCH_BACKENDS = BACKENDS[1:]

DTYPES = [
    pytest.param("float32", id="fp32"),
    pytest.param("float16", id="fp16"),
    pytest.param("bfloat16", id="bf16",
                 marks=pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes is not installed")),
]

# ||out - ref|| / ||ref|| bounds against the float64 reference.
TOLERANCE = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 1e-2}


def numpy_dtype(dtype):
    if dtype == "bfloat16":
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def torch_dtype(dtype):
    return getattr(torch, dtype)


def torch_device(backend):
    return "cuda" if backend == "torch-cuda" else "cpu"


def rng_for(seed):
    return np.random.default_rng(seed)


def uniform(rng, shape, scale=1.0):
    """float32 uniform in [-scale, scale)."""
    return (rng.random(shape, dtype=np.float32) * 2.0 - 1.0) * np.float32(scale)


def rounded(array, dtype):
    """A float32 (or int) numpy array rounded to `dtype` ('float32'|'float16'|'bfloat16'),
    as a numpy array of that dtype."""
    return np.asarray(array).astype(numpy_dtype(dtype))


def to_backend(array, backend):
    """A numpy array (any moelora dtype, ml_dtypes.bfloat16 included) on `backend`."""
    if backend == "numpy":
        return array
    if array.dtype.name == "bfloat16":
        # Exact: every bfloat16 value is a float32 value.
        tensor = torch.from_numpy(np.ascontiguousarray(array.astype(np.float32))).to(torch.bfloat16)
    elif array.dtype.name == "float8_e4m3fn":
        # The same bits, reinterpreted (torch cannot import ml_dtypes' fp8).
        tensor = torch.from_numpy(np.ascontiguousarray(array).view(np.uint8)).view(torch.float8_e4m3fn)
    else:
        tensor = torch.from_numpy(np.ascontiguousarray(array))
    # A copy even on the CPU: the reference's numpy inputs must not change when an op
    # writes into its torch inputs (inplace).
    return tensor.to(torch_device(backend), copy=True)


def sparse_experts_to_backend(weights, experts, backend):
    """weights [E, ...] numpy whose only nonzero experts are `experts`, on `backend`,
    copying just those experts (full MoE weights are large and mostly unused in a test)."""
    if backend == "numpy":
        return weights
    tensor = torch.zeros(weights.shape, dtype=torch_dtype(weights.dtype.name), device=torch_device(backend))
    for expert in experts:
        tensor[int(expert)] = to_backend(weights[int(expert)], backend)
    return tensor


def to_numpy(x):
    """Any backend array -> numpy float64 (floats) or int64 (ints)."""
    if torch is not None and isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        if x.dtype.is_floating_point:
            return x.double().numpy()
        return x.long().numpy()
    x = np.asarray(x)
    if x.dtype.kind in "iu":
        return x.astype(np.int64)
    return x.astype(np.float64)


def full(shape, value, dtype, backend):
    """An array filled with `value` (NaN poisons outputs) on `backend`."""
    return to_backend(np.full(shape, value, dtype=numpy_dtype(dtype)), backend)


def poisoned(shape, dtype, backend):
    return full(shape, np.nan, dtype, backend)


def sync(backend):
    if backend == "torch-cuda":
        torch.cuda.synchronize()


def rel_error(out, ref):
    """||out - ref|| / ||ref|| (the absolute norm when ref is all zeros)."""
    out = to_numpy(out)
    ref = np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape, f"shape {out.shape} != reference shape {ref.shape}"
    denominator = np.linalg.norm(ref)
    return np.linalg.norm(out - ref) / (denominator if denominator > 0 else 1.0)


def assert_close(out, ref, dtype):
    """out fully written (no NaN left from the poison) and within the dtype's tolerance."""
    values = to_numpy(out)
    assert values.shape == np.shape(ref), f"shape {values.shape} != reference shape {np.shape(ref)}"
    assert not np.isnan(values).any(), f"{int(np.isnan(values).sum())} output values left unwritten (NaN)"
    error = rel_error(values, ref)
    assert error <= TOLERANCE[dtype], f"relative error {error:.3g} > {TOLERANCE[dtype]} for {dtype}"


def route(rng, num_tokens, top_k, experts):
    """topk_ids [num_tokens, top_k] int32: top_k distinct experts per token drawn from
    `experts` (a list of ids)."""
    experts = np.asarray(experts)
    choice = np.argsort(rng.random((num_tokens, experts.size)), axis=1)[:, :top_k]
    return experts[choice].astype(np.int32)


class MoeProblem:
    """A random fused_experts problem: numpy arrays rounded to `dtype` (the reference's
    inputs) and the same values on `backend` (the op's inputs)."""

    def __init__(self, seed, num_tokens, num_experts, top_k, hidden_size, intermediate_size, dtype,
                 backend, experts_used=None, ids_dtype=np.int32, activation="silu", expert_map=None):
        rng = rng_for(seed)
        self.dtype, self.backend, self.activation = dtype, backend, activation
        self.num_tokens, self.top_k = num_tokens, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        num_local = num_experts if expert_map is None else int((np.asarray(expert_map) >= 0).sum())
        if experts_used is None:
            experts_used = np.arange(num_experts)
        else:
            experts_used = np.sort(rng.choice(num_experts, experts_used, replace=False))
        self.topk_ids_np = route(rng, num_tokens, top_k, experts_used).astype(ids_dtype)
        # Weights are filled for every expert tokens may be routed to (tests may re-route
        # among them with set_topk_ids); the rest stay zero and are never read.
        if expert_map is None:
            local_used = experts_used
        else:
            mapped = np.asarray(expert_map)[experts_used]
            local_used = mapped[mapped >= 0]
        self.experts_used = experts_used
        self.w13_np = np.zeros((num_local, 2 * intermediate_size, hidden_size), dtype=numpy_dtype(dtype))
        self.w2_np = np.zeros((num_local, hidden_size, intermediate_size), dtype=numpy_dtype(dtype))
        # Unit-variance activations through both GEMMs.
        for expert in local_used:
            self.w13_np[expert] = rounded(uniform(rng, self.w13_np.shape[1:], np.sqrt(3.0 / hidden_size)), dtype)
            self.w2_np[expert] = rounded(uniform(rng, self.w2_np.shape[1:], np.sqrt(3.0 / intermediate_size)),
                                         dtype)
        self.x_np = rounded(uniform(rng, (num_tokens, hidden_size), np.sqrt(3.0)), dtype)
        self.topk_weights_np = rng.random((num_tokens, top_k), dtype=np.float32) + np.float32(0.05)
        self.expert_map_np = None if expert_map is None else np.asarray(expert_map, dtype=np.int32)

        self.x = to_backend(self.x_np, backend)
        self.w13 = sparse_experts_to_backend(self.w13_np, local_used, backend)
        self.w2 = sparse_experts_to_backend(self.w2_np, local_used, backend)
        self.topk_weights = to_backend(self.topk_weights_np, backend)
        self.topk_ids = to_backend(self.topk_ids_np, backend)
        self.expert_map = None if expert_map is None else to_backend(self.expert_map_np, backend)

    def set_topk_ids(self, topk_ids):
        """Re-route: topk_ids [M, top_k] numpy (ids among experts_used, or -1)."""
        self.topk_ids_np = np.asarray(topk_ids)
        self.topk_ids = to_backend(self.topk_ids_np, self.backend)

    def args(self):
        return self.x, self.w13, self.w2, self.topk_weights, self.topk_ids

    def reference(self, **options):
        options.setdefault("activation", self.activation)
        return reference.fused_experts(self.x_np, self.w13_np, self.w2_np, self.topk_weights_np,
                                       self.topk_ids_np, expert_map=self.expert_map_np, **options)


# ---- multi-LoRA ----------------------------------------------------------------------

def adapter_state(rng, num_tokens, num_loras, fraction=0.5, disabled=(), scale=True):
    """(token_lora_ids [M] int32, adapter_enabled [L] int32, adapter_scale [L] float32) as
    numpy: round(fraction * M) tokens (at random) get an adapter in [0, L), the others -1;
    the slots in `disabled` are disabled; scales in [0.5, 2) (all 1 without `scale`)."""
    ids = np.full(num_tokens, -1, dtype=np.int32)
    count = int(round(fraction * num_tokens))
    chosen = rng.permutation(num_tokens)[:count]
    ids[chosen] = rng.integers(0, num_loras, size=count)
    enabled = np.ones(num_loras, dtype=np.int32)
    enabled[list(disabled)] = 0
    scales = (rng.random(num_loras, dtype=np.float32) * 1.5 + 0.5) if scale else np.ones(num_loras, np.float32)
    return ids, enabled, scales.astype(np.float32)


class LoraStacks:
    """Random adapter stacks of one expert GEMM (out = a · wᵀ, K -> N) in `num_slices`
    output slices: lora_a[c] [L, E, rank, K], lora_b[c] [L, E, N / S, rank], rounded to
    `dtype` (numpy: a_np / b_np) and the same values on `backend` (a / b). Adapter l has
    rank ranks[l] <= rank (default: rank) and is zero-padded past it. Scaled so that
    B (A a) has about unit variance for unit-variance rows a, like the base GEMM's output."""

    def __init__(self, rng, num_loras, num_experts, rank, K, N, num_slices, dtype, backend, ranks=None):
        ranks = [rank] * num_loras if ranks is None else list(ranks)
        width = N // num_slices
        self.rank, self.num_slices = rank, num_slices
        self.a_np, self.b_np = [], []
        for _ in range(num_slices):
            a = np.zeros((num_loras, num_experts, rank, K), dtype=np.float32)
            b = np.zeros((num_loras, num_experts, width, rank), dtype=np.float32)
            for lora, r in enumerate(ranks):
                a[lora, :, :r] = uniform(rng, (num_experts, r, K), np.sqrt(3.0 / K))
                b[lora, :, :, :r] = uniform(rng, (num_experts, width, r), np.sqrt(3.0 / r))
            self.a_np.append(rounded(a, dtype))
            self.b_np.append(rounded(b, dtype))
        self.a = [to_backend(x, backend) for x in self.a_np]
        self.b = [to_backend(x, backend) for x in self.b_np]


def write_safetensors(path, tensors):
    """Write name -> numpy/torch array as a .safetensors file: with the safetensors
    package when installed, else by hand (the format: an 8-byte little-endian header
    length, a JSON header, the raw little-endian data). float32 only by hand."""
    try:
        from safetensors.numpy import save_file
    except ImportError:
        save_file = None
    arrays = {name: np.ascontiguousarray(to_numpy(value).astype(np.float32)) for name, value in tensors.items()}
    if save_file is not None:
        save_file(arrays, str(path))
        return
    import json
    header, offset = {}, 0
    for name, array in arrays.items():
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for array in arrays.values():
            f.write(array.astype("<f4").tobytes())
