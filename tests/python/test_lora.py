"""Multi-LoRA ops against the float64 reference, on numpy arrays and torch tensors (CPU and,
where present, CUDA): moe_lora_align_block_size, fused_moe_lora (per slot and over the
virtual alignment) and fused_experts with adapters. Fresh random data per check; outputs
poisoned with NaN before each run (or, where the op adds into them, filled with random
values) and checked fully written."""

import zlib

import numpy as np
import pytest

import moelora
from moelora import ops, reference
from moelora_testing import (BACKENDS, DTYPES, LoraStacks, MoeProblem, adapter_state, assert_close, poisoned,
                             rng_for, rounded, route, sync, to_backend, to_numpy, uniform)

RANKS = [1, 8, 16, 64, 128]
NUM_ADAPTERS = [1, 4, 16, 64]
FRACTIONS = [pytest.param(0.0, id="0pct"), pytest.param(0.5, id="50pct"), pytest.param(1.0, id="100pct")]
SLICE_MODES = [pytest.param((1, False), id="1slice"), pytest.param((2, False), id="2slices"),
               pytest.param((2, True), id="2slices-interleaved")]


def _seed(*parts):
    """A seed of its own for every parametrisation (fresh data per check)."""
    return zlib.crc32(repr(parts).encode())


def _disabled(num_loras):
    """Disable about a quarter of the slots (none when there is one)."""
    return list(range(1, num_loras, 4))


class DeltaProblem:
    """A random fused_moe_lora problem: a GEMM's input and output, routing and adapter state."""

    def __init__(self, seed, backend, dtype, num_tokens=11, top_k=2, num_experts=5, K=40, N=24, num_loras=4, rank=8,
                 num_slices=2, fraction=0.5, disabled=None, per_slot_rows=False, dropped=True, ranks=None):
        rng = rng_for(seed)
        self.backend, self.dtype = backend, dtype
        self.num_slots = num_tokens * top_k
        self.ids_np = route(rng, num_tokens, top_k, list(range(num_experts)))
        if dropped and num_tokens > 2:
            self.ids_np[1, -1] = -1
        rows = self.num_slots if per_slot_rows else num_tokens
        self.a_np = rounded(uniform(rng, (rows, K), np.sqrt(3.0)), dtype)
        self.lora_ids_np, self.enabled_np, self.scale_np = adapter_state(
            rng, num_tokens, num_loras, fraction, _disabled(num_loras) if disabled is None else disabled)
        self.weights_np = rng.random((num_tokens, top_k), dtype=np.float32) + np.float32(0.05)
        self.out_np = rounded(uniform(rng, (self.num_slots, N), 2.0), dtype)  # the base GEMM's output
        self.stacks = LoraStacks(rng, num_loras, num_experts, rank, K, N, num_slices, dtype, backend, ranks=ranks)
        self.num_loras, self.num_experts = num_loras, num_experts
        self.ids = to_backend(self.ids_np, backend)
        self.a = to_backend(self.a_np, backend)
        self.lora_ids = to_backend(self.lora_ids_np, backend)
        self.enabled = to_backend(self.enabled_np, backend)
        self.scale = to_backend(self.scale_np, backend)
        self.weights = to_backend(self.weights_np, backend)

    def out(self, add_inputs):
        """The output to pass: the base GEMM's output when the op adds into it, else NaN."""
        if add_inputs:  # a copy: the op writes into it, and out_np is the reference's input
            return to_backend(self.out_np.copy(), self.backend)
        return poisoned(self.out_np.shape, self.dtype, self.backend)

    def run(self, add_inputs=True, interleaved=False, aligned=False, block_size=16, **options):
        out = self.out(add_inputs)
        alignment = None
        if aligned:
            alignment = (*moelora.moe_lora_align_block_size(self.ids, self.lora_ids, self.num_loras, block_size,
                                                            self.num_experts, adapter_enabled=self.enabled),
                         block_size)
        result = moelora.fused_moe_lora(out, self.a, self.ids, self.lora_ids, self.stacks.a, self.stacks.b,
                                        adapter_enabled=self.enabled, adapter_scale=self.scale,
                                        add_inputs=add_inputs, interleaved_slices=interleaved, alignment=alignment,
                                        **options)
        assert result is out
        sync(self.backend)
        return out

    def reference(self, add_inputs=True, interleaved=False, **options):
        return reference.fused_moe_lora(self.out_np, self.a_np, self.ids_np, self.lora_ids_np, self.stacks.a_np,
                                        self.stacks.b_np, self.enabled_np, self.scale_np, add_inputs=add_inputs,
                                        interleaved_slices=interleaved, **options)


# ---- moe_lora_align_block_size -------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("with_map", [False, True], ids=["no_map", "expert_map"])
def test_lora_align_groups_by_expert_and_adapter(backend, fraction, with_map):
    rng = rng_for(_seed("align", backend, fraction, with_map))
    M, top_k, E, L, block_size = 19, 3, 6, 5, 16
    ids_np = route(rng, M, top_k, list(range(E))).astype(np.int64 if with_map else np.int32)
    ids_np[2, 1] = ids_np[7, 0] = -1
    lora_ids_np, enabled_np, _ = adapter_state(rng, M, L, fraction, disabled=[3])
    expert_map = np.array([2, -1, 0, 1, -1, 3], dtype=np.int32) if with_map else None
    sorted_ids, expert_ids, block_lora_ids, count = moelora.moe_lora_align_block_size(
        to_backend(ids_np, backend), to_backend(lora_ids_np, backend), L, block_size, E,
        adapter_enabled=to_backend(enabled_np, backend),
        expert_map=None if expert_map is None else to_backend(expert_map, backend))
    sync(backend)
    capacity = moelora.moe_lora_align_block_size_capacity(M * top_k, block_size, E, L)
    assert (to_numpy(sorted_ids).shape[0], to_numpy(expert_ids).shape[0]) == capacity
    assert to_numpy(block_lora_ids).shape[0] == capacity[1]
    ref_sorted, ref_experts, ref_loras, ref_count, groups = reference.moe_lora_align_block_size(
        ids_np, lora_ids_np, L, block_size, E, enabled_np, expert_map)
    sorted_ids, expert_ids, block_lora_ids = to_numpy(sorted_ids), to_numpy(expert_ids), to_numpy(block_lora_ids)
    assert int(to_numpy(count)[0]) == ref_count
    used_blocks = ref_count // block_size
    assert (expert_ids[:used_blocks] == ref_experts).all()
    assert (block_lora_ids[:used_blocks] == ref_loras).all()
    assert (expert_ids[used_blocks:] == -1).all() and (block_lora_ids[used_blocks:] == -1).all()
    assert (sorted_ids[ref_count:] == M * top_k).all()
    for start, stop in groups:  # the order inside a group is free
        assert sorted(sorted_ids[start:stop]) == sorted(ref_sorted[start:stop])
    # Every block: one expert, one adapter; disabled adapters and -1 ids make base-only blocks.
    effective = reference.effective_lora_ids(lora_ids_np, L, enabled_np)
    for b in range(used_blocks):
        slots = sorted_ids[b * block_size:(b + 1) * block_size]
        slots = slots[slots < M * top_k]
        routed = ids_np.reshape(-1)[slots] != -1  # dropped slots: the trailing group, adapter -1
        assert (effective[slots // top_k][routed] == block_lora_ids[b]).all()
        assert routed.all() or block_lora_ids[b] == -1
    assert 3 not in block_lora_ids.tolist()
    if fraction == 0.0:
        assert (block_lora_ids == -1).all()


def test_lora_align_writes_every_entry_through_the_binding():
    """Outputs poisoned with a value that is no id; the binding fills every entry."""
    rng = rng_for(5)
    M, top_k, E, L, block_size = 13, 2, 4, 3, 32
    ids = route(rng, M, top_k, list(range(E)))
    lora_ids, enabled, _ = adapter_state(rng, M, L, 0.7)
    max_padded, max_blocks = moelora.moe_lora_align_block_size_capacity(M * top_k, block_size, E, L)
    outs = [np.full(n, -7777, dtype=np.int32) for n in (max_padded, max_blocks, max_blocks, 1)]
    moelora._ext.moe_lora_align_block_size(moelora.view(ids), moelora.view(lora_ids), moelora.view(enabled), L,
                                           block_size, E, None, *[moelora.view(o) for o in outs])
    assert all((o != -7777).all() for o in outs)
    assert outs[3][0] == reference.moe_lora_align_block_size(ids, lora_ids, L, block_size, E, enabled)[3]


@pytest.mark.parametrize("block_size", [16, 64, 256])
@pytest.mark.parametrize("num_experts", [1, 8, 128])
@pytest.mark.parametrize("max_loras", [1, 4, 64])
def test_lora_align_capacity_formula_matches_the_library(block_size, num_experts, max_loras):
    for num_slots in (0, 1, 7, 1000, 65536 * 8):
        expected = moelora.moe_lora_align_block_size_capacity(num_slots, block_size, num_experts, max_loras)
        assert ops.lora_align_capacity(num_slots, block_size, num_experts, max_loras) == expected
        max_padded, max_blocks = expected
        assert max_blocks * block_size >= max_padded >= num_slots


# ---- fused_moe_lora ------------------------------------------------------------------

def mixed_ranks(rank, num_loras):
    """Adapters of several ranks up to the stacks' rank (zero-padded past their own)."""
    return [max(1, rank >> (lora % 3)) for lora in range(num_loras)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("num_loras", NUM_ADAPTERS)
def test_fused_moe_lora_ranks_and_adapter_counts(backend, rank, num_loras):
    dtype = "float32"
    ranks = mixed_ranks(rank, num_loras)
    p = DeltaProblem(_seed("ranks", backend, rank, num_loras), backend, dtype, num_tokens=13, num_experts=3, K=24,
                     N=16, num_loras=num_loras, rank=rank, fraction=0.75, ranks=ranks)
    expected = p.reference()
    assert_close(p.run(), expected, dtype)
    assert_close(p.run(aligned=True, block_size=16), expected, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("add_inputs", [True, False], ids=["add_inputs", "overwrite"])
@pytest.mark.parametrize("slices", SLICE_MODES)
def test_fused_moe_lora_modes(backend, dtype, fraction, add_inputs, slices):
    num_slices, interleaved = slices
    p = DeltaProblem(_seed("modes", backend, dtype, fraction, add_inputs, slices), backend, dtype,
                     num_slices=num_slices, fraction=fraction)
    expected = p.reference(add_inputs=add_inputs, interleaved=interleaved)
    out = p.run(add_inputs=add_inputs, interleaved=interleaved)
    assert_close(out, expected, dtype)
    out = p.run(add_inputs=add_inputs, interleaved=interleaved, aligned=True, block_size=32)
    assert_close(out, expected, dtype)
    if fraction == 0.0:  # no token has an adapter: the rows are kept, or zeroed
        base = p.out_np.astype(np.float64) if add_inputs else np.zeros(p.out_np.shape)
        assert np.array_equal(to_numpy(out), base)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_moe_lora_disabled_adapters_and_scales(backend):
    """Tokens of a disabled slot get no delta; the scale multiplies the delta; a missing
    adapter_scale means 1; a missing adapter_enabled means all enabled."""
    dtype = "float32"
    p = DeltaProblem(_seed("disabled", backend), backend, dtype, num_loras=4, fraction=1.0, disabled=[0, 1, 2, 3])
    assert np.array_equal(to_numpy(p.run()), p.out_np.astype(np.float64))  # every adapter disabled
    p = DeltaProblem(_seed("enabled", backend), backend, dtype, num_loras=4, fraction=1.0, disabled=[2])
    expected = p.reference()
    assert_close(p.run(), expected, dtype)
    # Without the optional tensors: all enabled, scale 1.
    out = p.out(True)
    moelora.fused_moe_lora(out, p.a, p.ids, p.lora_ids, p.stacks.a, p.stacks.b)
    sync(backend)
    assert_close(out, reference.fused_moe_lora(p.out_np, p.a_np, p.ids_np, p.lora_ids_np, p.stacks.a_np,
                                               p.stacks.b_np), dtype)
    # Scales: doubling every scale doubles the delta.
    delta = expected - p.out_np
    p.scale = to_backend(p.scale_np * 2, backend)
    assert_close(p.run(), p.out_np + 2 * delta, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("aligned", [False, True], ids=["per_slot", "aligned"])
def test_fused_moe_lora_per_slot_rows_routed_weights_and_strided_out(backend, aligned):
    """GEMM2's shape (a row per slot), mul_routed_weight, dropped slots and an out view
    with padded rows: nothing outside the view is written."""
    dtype = "float16"
    p = DeltaProblem(_seed("gemm2", backend, aligned), backend, dtype, num_tokens=9, top_k=3, K=32, N=40,
                     num_slices=1, per_slot_rows=True, fraction=0.6)
    expected = p.reference(topk_weights=p.weights_np, mul_routed_weight=True)
    full_np = np.concatenate([np.full((p.num_slots, 3), np.nan, np.float16), p.out_np], axis=1)
    full = to_backend(full_np, backend)
    out = full[:, 3:]
    alignment = None
    if aligned:
        alignment = (*moelora.moe_lora_align_block_size(p.ids, p.lora_ids, p.num_loras, 16, p.num_experts,
                                                        adapter_enabled=p.enabled), 16)
    moelora.fused_moe_lora(out, p.a, p.ids, p.lora_ids, p.stacks.a, p.stacks.b, adapter_enabled=p.enabled,
                           adapter_scale=p.scale, topk_weights=p.weights, mul_routed_weight=True, alignment=alignment)
    sync(backend)
    assert_close(out, expected, dtype)
    assert np.isnan(to_numpy(full)[:, :3]).all()


# ---- fused_experts with adapters -----------------------------------------------------

class LoraMoeProblem(MoeProblem):
    """A MoeProblem with adapters on both GEMMs."""

    def __init__(self, seed, num_loras=4, rank=8, w13_slices=2, fraction=0.5, disabled=None, ranks=None, **kwargs):
        super().__init__(seed, **kwargs)
        rng = rng_for(seed + 7919)
        E = self.w13_np.shape[0]
        H, I = self.hidden_size, self.intermediate_size
        self.num_loras = num_loras
        self.lora_ids_np, self.enabled_np, self.scale_np = adapter_state(
            rng, self.num_tokens, num_loras, fraction, _disabled(num_loras) if disabled is None else disabled)
        self.w13_stacks = LoraStacks(rng, num_loras, E, rank, H, 2 * I, w13_slices, self.dtype, self.backend,
                                     ranks=ranks)
        self.w2_stacks = LoraStacks(rng, num_loras, E, rank, I, H, 1, self.dtype, self.backend, ranks=ranks)

    def lora(self):
        b = self.backend
        return moelora.MoeLora(to_backend(self.lora_ids_np, b), self.w13_stacks.a, self.w13_stacks.b,
                               self.w2_stacks.a[0], self.w2_stacks.b[0], adapter_enabled=to_backend(self.enabled_np, b),
                               adapter_scale=to_backend(self.scale_np, b))

    def lora_np(self):
        return moelora.MoeLora(self.lora_ids_np, self.w13_stacks.a_np, self.w13_stacks.b_np, self.w2_stacks.a_np[0],
                               self.w2_stacks.b_np[0], self.enabled_np, self.scale_np)

    def reference(self, **options):
        options.setdefault("lora", self.lora_np())
        return super().reference(**options)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu", "swiglu_oai"])
@pytest.mark.parametrize("w13_slices", [1, 2], ids=["w13-1slice", "w13-2slices"])
def test_fused_experts_lora_matches_reference(backend, dtype, activation, w13_slices):
    p = LoraMoeProblem(_seed("experts", backend, dtype, activation, w13_slices), w13_slices=w13_slices,
                       num_tokens=21, num_experts=6, top_k=2, hidden_size=40, intermediate_size=24, dtype=dtype,
                       backend=backend, activation=activation)
    out = poisoned((21, 40), dtype, backend)
    moelora.fused_experts(*p.args(), activation=activation, out=out, lora=p.lora())
    sync(backend)
    expected = p.reference()
    assert_close(out, expected, dtype)
    # The adapters matter here: the base layer alone is far from the expected output.
    base = p.reference(lora=None)
    assert np.linalg.norm(base - expected) > 0.1 * np.linalg.norm(expected)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("num_loras", NUM_ADAPTERS)
def test_fused_experts_lora_ranks_and_adapter_counts(backend, rank, num_loras):
    dtype = "float32"
    ranks = mixed_ranks(rank, num_loras)
    p = LoraMoeProblem(_seed("experts-ranks", backend, rank, num_loras), num_loras=num_loras, rank=rank,
                       ranks=ranks, fraction=0.8, num_tokens=10, num_experts=3, top_k=2, hidden_size=24,
                       intermediate_size=16, dtype=dtype, backend=backend)
    out = poisoned((10, 24), dtype, backend)
    moelora.fused_experts(*p.args(), out=out, lora=p.lora())
    sync(backend)
    assert_close(out, p.reference(), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_fused_experts_lora_token_fractions(backend, fraction):
    dtype = "float16"
    p = LoraMoeProblem(_seed("experts-fraction", backend, fraction), fraction=fraction, num_loras=16, rank=16,
                       num_tokens=33, num_experts=8, top_k=3, hidden_size=32, intermediate_size=16, dtype=dtype,
                       backend=backend)
    out = poisoned((33, 32), dtype, backend)
    moelora.fused_experts(*p.args(), out=out, lora=p.lora())
    sync(backend)
    assert_close(out, p.reference(), dtype)
    if fraction == 0.0:
        assert_close(out, p.reference(lora=None), dtype)


LORA_OPTIONS = [
    pytest.param(dict(inplace=True), id="inplace"),
    pytest.param(dict(no_combine=True), id="no_combine"),
    pytest.param(dict(chunk_size=5), id="chunked"),
    pytest.param(dict(apply_router_weight_on_input=True), id="weight_on_input"),
    pytest.param(dict(routed_scaling_factor=2.5), id="scaled"),
    pytest.param(dict(block_size=32), id="block32"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", LORA_OPTIONS)
def test_fused_experts_lora_options(backend, options):
    dtype = "float32"
    top_k = 1 if options.get("apply_router_weight_on_input") else 3
    p = LoraMoeProblem(_seed("experts-options", backend, sorted(options)), num_tokens=17, num_experts=8,
                       top_k=top_k, hidden_size=32, intermediate_size=24, dtype=dtype, backend=backend)
    expected = p.reference(**{k: v for k, v in options.items() if k not in ("inplace", "chunk_size", "block_size")})
    out = moelora.fused_experts(*p.args(), lora=p.lora(), **options)
    sync(backend)
    if options.get("inplace"):
        assert out is p.x
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_experts_lora_expert_parallel(backend):
    """expert_map: the stacks cover the local experts (those of w13), indexed by local id."""
    dtype = "float32"
    expert_map = np.array([0, -1, 1, -1, 2, -1, 3, -1], dtype=np.int32)
    p = LoraMoeProblem(_seed("experts-ep", backend), num_tokens=16, num_experts=8, top_k=3, hidden_size=32,
                       intermediate_size=16, dtype=dtype, backend=backend, expert_map=expert_map, fraction=0.7)
    assert p.w13_stacks.a_np[0].shape[1] == 4
    out = moelora.fused_experts(*p.args(), expert_map=p.expert_map, lora=p.lora())
    sync(backend)
    assert_close(out, p.reference(), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_experts_lora_disabled_adapters_run_base_only(backend):
    dtype = "float32"
    p = LoraMoeProblem(_seed("experts-disabled", backend), num_loras=3, fraction=1.0, disabled=[0, 1, 2],
                       num_tokens=12, num_experts=4, top_k=2, hidden_size=16, intermediate_size=16, dtype=dtype,
                       backend=backend)
    out = moelora.fused_experts(*p.args(), lora=p.lora())
    sync(backend)
    assert_close(out, p.reference(lora=None), dtype)


def test_fused_experts_workspace_size_grows_with_adapters():
    def size(**lora):
        return moelora.fused_experts_workspace_size(64, 8, 128, 2048, 768, "bfloat16", **lora)

    assert size(max_loras=4, lora_rank=16) > size()
    assert size(max_loras=4, lora_rank=64) >= size(max_loras=4, lora_rank=16)
    assert size(max_loras=4, lora_rank=16) % 256 == 0
    assert moelora.fused_moe_lora_workspace_size(100, 2, 16, "float16") >= 100 * 2 * 16 * 2
    assert moelora.fused_moe_lora_workspace_size(100, 2, 16, "float16") % 256 == 0


# ---- bad arguments -------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_lora_bad_arguments_name_the_argument(backend):
    dtype = "float32"
    p = DeltaProblem(_seed("bad", backend), backend, dtype, num_loras=4, rank=8)
    A, B = p.stacks.a, p.stacks.b
    b = backend

    def delta(**changes):
        args = dict(out=p.out(True), a=p.a, topk_ids=p.ids, token_lora_ids=p.lora_ids, lora_a=A, lora_b=B,
                    adapter_enabled=p.enabled, adapter_scale=p.scale)
        args.update(changes)
        return lambda: moelora.fused_moe_lora(**args)

    big_rank = to_backend(np.zeros((4, 5, moelora.MAX_LORA_RANK + 1, 40), np.float32), b)
    cases = [
        ("'lora_a'", delta(lora_a=A + A[:1])),                            # 3 slices
        ("'lora_b'", delta(lora_b=B[:1])),                                # slices disagree
        ("'lora_a\\[0\\]'", delta(lora_a=[big_rank, big_rank])),          # rank above 128
        ("'lora_a\\[0\\]'", delta(lora_a=[to_backend(p.stacks.a_np[0].astype(np.float16), b), A[1]])),  # dtype
        ("'lora_a\\[1\\]'", delta(lora_a=[A[0], to_backend(p.stacks.a_np[1][:, :, :, :20], b)])),  # K
        ("'lora_b\\[0\\]'", delta(lora_b=[to_backend(p.stacks.b_np[0][:, :, :5], b), B[1]])),      # N / S
        ("'token_lora_ids'", delta(token_lora_ids=to_backend(p.lora_ids_np.astype(np.int64), b))),
        ("'token_lora_ids'", delta(token_lora_ids=to_backend(p.lora_ids_np[:-1], b))),
        ("'adapter_enabled'", delta(adapter_enabled=to_backend(p.enabled_np[:2], b))),
        ("'adapter_scale'", delta(adapter_scale=to_backend(p.scale_np.astype(np.float16), b))),
        ("'out'", delta(out=to_backend(p.out_np[:-1].copy(), b))),
        ("'topk_weights'", delta(mul_routed_weight=True)),
        ("'alignment'", delta(alignment=(1, 2, 3))),
        ("'max_loras'", lambda: moelora.moe_lora_align_block_size(p.ids, p.lora_ids, 0, 16, 5)),
        ("'max_loras'", lambda: moelora.moe_lora_align_block_size(p.ids, p.lora_ids, moelora.MAX_LORA_ADAPTERS + 1,
                                                                  16, 5)),
        ("'block_size'", lambda: moelora.moe_lora_align_block_size(p.ids, p.lora_ids, 4, 8, 5)),
        ("'token_lora_ids'", lambda: moelora.moe_lora_align_block_size(p.ids, p.lora_ids[:3], 4, 16, 5)),
    ]
    if backend == "numpy":  # ids are read on the host only on the CPU
        bad_ids = p.lora_ids_np.copy()
        bad_ids[2] = 4  # == max_loras
        cases.append(("'token_lora_ids'", delta(token_lora_ids=bad_ids)))
        bad_ids = p.lora_ids_np.copy()
        bad_ids[0] = -2
        cases.append(("'token_lora_ids'", lambda: moelora.moe_lora_align_block_size(p.ids, bad_ids, 4, 16, 5)))
    for argument, call in cases:
        with pytest.raises(ValueError, match=argument):
            call()


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_experts_lora_bad_arguments_write_nothing(backend):
    dtype = "float32"
    p = LoraMoeProblem(_seed("experts-bad", backend), num_tokens=6, num_experts=4, top_k=2, hidden_size=16,
                       intermediate_size=8, dtype=dtype, backend=backend)
    good = p.lora()
    b = backend
    out = poisoned((6, 16), dtype, backend)

    def with_lora(**changes):
        fields = dict(vars(good))
        fields.update(changes)
        return lambda: moelora.fused_experts(*p.args(), out=out, lora=moelora.MoeLora(**fields))

    w13_a = p.w13_stacks.a_np
    big = to_backend(np.zeros((4, 4, moelora.MAX_LORA_RANK + 1, 16), np.float32), b)
    cases = [
        ("'w13_lora_a\\[0\\]'", with_lora(w13_lora_a=[big, big])),
        ("'w13_lora_a\\[0\\]'", with_lora(w13_lora_a=[to_backend(w13_a[0][:, :3], b), good.w13_lora_a[1]])),  # E
        ("'w13_lora_b'", with_lora(w13_lora_b=good.w13_lora_b[:1])),
        ("'w13_lora_a'", with_lora(w13_lora_a=good.w13_lora_a * 2, w13_lora_b=good.w13_lora_b * 2)),
        ("'w2_lora_a'", with_lora(w2_lora_a=[good.w2_lora_a, good.w2_lora_a])),
        ("'w2_lora_b\\[0\\]'", with_lora(w2_lora_b=to_backend(p.w2_stacks.b_np[0][:, :, :8], b))),
        ("'w2_lora_a\\[0\\]'", with_lora(w2_lora_a=to_backend(p.w2_stacks.a_np[0].astype(np.float16), b))),
        ("'token_lora_ids'", with_lora(token_lora_ids=to_backend(p.lora_ids_np[:4], b))),
        ("'adapter_enabled'", with_lora(adapter_enabled=to_backend(p.enabled_np.astype(np.float32), b))),
        ("'adapter_scale'", with_lora(adapter_scale=to_backend(p.scale_np[:1], b))),
    ]
    if backend == "numpy":
        bad = p.lora_ids_np.copy()
        bad[3] = p.num_loras
        cases.append(("'token_lora_ids'", with_lora(token_lora_ids=bad)))
    for argument, call in cases:
        with pytest.raises(ValueError, match=argument):
            call()
        assert np.isnan(to_numpy(out)).all()
    with pytest.raises(TypeError, match="'lora'"):
        moelora.fused_experts(*p.args(), lora={"token_lora_ids": p.lora_ids_np})


def test_fused_experts_binding_needs_every_lora_stack():
    p = LoraMoeProblem(_seed("binding"), num_tokens=4, num_experts=4, top_k=2, hidden_size=16, intermediate_size=8,
                       dtype="float32", backend="numpy")
    x, w13, w2, weights, ids = (moelora.view(t) for t in p.args())
    out = moelora.view(np.zeros((4, 16), np.float32))
    size = moelora.fused_experts_workspace_size(4, 2, 4, 16, 8, "float32", max_loras=4, lora_rank=8)
    workspace = ops._aligned_workspace(np.zeros(1, np.int32), size)
    with pytest.raises(ValueError, match="'w13_lora_a'"):
        moelora._ext.fused_experts(x, w13, w2, weights, ids, out, moelora.view(workspace),
                                   token_lora_ids=moelora.view(p.lora_ids_np))
    with pytest.raises(ValueError, match="'adapter_scale'"):
        moelora._ext.fused_experts(x, w13, w2, weights, ids, out, moelora.view(workspace),
                                   adapter_scale=moelora.view(p.scale_np))
