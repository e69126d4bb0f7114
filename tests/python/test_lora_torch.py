"""Multi-LoRA with torch: the custom ops (values, schemas and fake kernels, torch.compile),
FusedMoE's adapter slots (load / unload / swap in place, PEFT directories in the per-expert
and packed 3-D layouts, errors) and one CUDA graph replayed over changing adapter mixes."""

import json
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import moelora  # noqa: E402
from moelora import layer as layer_module  # noqa: E402
from moelora import reference  # noqa: E402
from moelora_testing import (TORCH_BACKENDS, LoraStacks, MoeProblem, adapter_state, assert_close,  # noqa: E402
                             poisoned, rng_for, to_backend, to_numpy, torch_device, uniform, write_safetensors)

requires_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and moelora.cuda_available()),
                                   reason="needs torch with CUDA and moelora's CUDA backend")


def _seed(*parts):
    return zlib.crc32(repr(parts).encode())


def _sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


# ---- the custom ops ------------------------------------------------------------------

def test_lora_ops_are_registered():
    for name in ("moe_lora_align_block_size", "fused_moe_lora", "fused_experts_lora"):
        assert hasattr(torch.ops.moelora, name), name


class _OpProblem:
    """A fused_experts problem with adapters, as torch tensors on `backend`."""

    def __init__(self, seed, backend, dtype="float32", num_tokens=9, num_experts=6, top_k=2, H=32, I=16, L=4, rank=8,
                 w13_slices=2, activation="silu", fraction=0.6):
        self.p = MoeProblem(seed, num_tokens=num_tokens, num_experts=num_experts, top_k=top_k, hidden_size=H,
                            intermediate_size=I, dtype=dtype, backend=backend, activation=activation)
        rng = rng_for(seed + 1)
        self.lora_ids_np, self.enabled_np, self.scale_np = adapter_state(rng, num_tokens, L, fraction, disabled=[1])
        self.w13 = LoraStacks(rng, L, num_experts, rank, H, 2 * I, w13_slices, dtype, backend)
        self.w2 = LoraStacks(rng, L, num_experts, rank, I, H, 1, dtype, backend)
        self.lora_ids = to_backend(self.lora_ids_np, backend)
        self.enabled = to_backend(self.enabled_np, backend)
        self.scale = to_backend(self.scale_np, backend)
        self.L, self.activation = L, activation

    def op_args(self):
        return (*self.p.args(), self.lora_ids, self.w13.a, self.w13.b, self.w2.a[0], self.w2.b[0], self.enabled,
                self.scale)

    def reference(self, **options):
        lora = moelora.MoeLora(self.lora_ids_np, self.w13.a_np, self.w13.b_np, self.w2.a_np[0], self.w2.b_np[0],
                               self.enabled_np, self.scale_np)
        return self.p.reference(lora=lora, **options)


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
def test_lora_custom_ops_match_the_reference(backend, activation):
    dtype = "float32"
    q = _OpProblem(_seed("ops", backend, activation), backend, activation=activation)
    out = torch.ops.moelora.fused_experts_lora(*q.op_args(), activation=activation, routed_scaling_factor=1.5)
    assert_close(out, q.reference(routed_scaling_factor=1.5), dtype)
    per_slot = torch.ops.moelora.fused_experts_lora(*q.op_args(), activation=activation, no_combine=True)
    assert_close(per_slot, q.reference(no_combine=True), dtype)

    # moe_lora_align_block_size + fused_moe_lora on GEMM1's output of the base layer.
    p = q.p
    sorted_ids, expert_ids, block_lora_ids, count = torch.ops.moelora.moe_lora_align_block_size(
        p.topk_ids, q.lora_ids, q.L, 16, 6, q.enabled)
    capacity = moelora.moe_lora_align_block_size_capacity(p.topk_ids.numel(), 16, 6, q.L)
    assert (sorted_ids.shape[0], expert_ids.shape[0], block_lora_ids.shape[0], count.shape[0]) == \
        (*capacity, capacity[1], 1)
    assert sorted_ids.dtype == expert_ids.dtype == block_lora_ids.dtype == count.dtype == torch.int32
    base = torch.zeros(p.topk_ids.numel(), 32, device=p.x.device)
    for aligned in (False, True):
        out = torch.full_like(base, float("nan"))
        extra = (sorted_ids, expert_ids, block_lora_ids, count, 16) if aligned else ()
        result = torch.ops.moelora.fused_moe_lora(out, p.x, p.topk_ids, q.lora_ids, q.w13.a, q.w13.b, q.enabled,
                                                  q.scale, None, False, False,
                                                  activation == "swiglu_oai", *extra)
        assert result is None
        expected = reference.fused_moe_lora(to_numpy(base), p.x_np, p.topk_ids_np, q.lora_ids_np, q.w13.a_np,
                                            q.w13.b_np, q.enabled_np, q.scale_np, add_inputs=False,
                                            interleaved_slices=activation == "swiglu_oai")
        assert_close(out, expected, dtype)


@pytest.mark.skipif(not hasattr(torch.library, "opcheck"), reason="torch.library.opcheck needs torch >= 2.4")
@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_lora_opcheck(backend):
    """Schemas (mutation and aliasing), fake kernels and AOT dispatch with dynamic shapes."""
    q = _OpProblem(_seed("opcheck", backend), backend, num_tokens=5, num_experts=4, H=32, I=16, L=3, rank=4)
    torch.library.opcheck(torch.ops.moelora.fused_experts_lora, q.op_args())
    torch.library.opcheck(torch.ops.moelora.fused_experts_lora, q.op_args(),
                          {"no_combine": True, "activation": "gelu"})
    p = q.p
    align_utils = (("test_schema", "test_faketensor") if backend == "torch-cuda"
                   else ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    torch.library.opcheck(torch.ops.moelora.moe_lora_align_block_size, (p.topk_ids, q.lora_ids, 3, 16, 4, q.enabled),
                          test_utils=align_utils)
    out = torch.randn(p.topk_ids.numel(), 32, device=p.x.device)
    torch.library.opcheck(torch.ops.moelora.fused_moe_lora,
                          (out, p.x, p.topk_ids, q.lora_ids, q.w13.a, q.w13.b, q.enabled, q.scale))
    aligned = torch.ops.moelora.moe_lora_align_block_size(p.topk_ids, q.lora_ids, 3, 16, 4, q.enabled)
    torch.library.opcheck(torch.ops.moelora.fused_moe_lora,
                          (out, p.x, p.topk_ids, q.lora_ids, q.w13.a, q.w13.b, q.enabled, q.scale, p.topk_weights,
                           True, True, False, *aligned, 16))


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_fused_experts_lora_compiles_with_dynamic_shapes(backend):
    def moe(x, w13, w2, weights, ids, lora_ids, a13, b13, a2, b2, enabled, scale):
        y = torch.ops.moelora.fused_experts_lora(x * 2.0, w13, w2, weights, ids, lora_ids, a13, b13, a2, b2, enabled,
                                                 scale)
        aligned = torch.ops.moelora.moe_lora_align_block_size(ids, lora_ids, 4, 16, 8, enabled)
        return y + 1.0, aligned[3]

    torch._dynamo.reset()
    compiled = torch.compile(moe, fullgraph=True, dynamic=True, backend="aot_eager")
    for num_tokens in (5, 11):
        q = _OpProblem(_seed("compile", backend, num_tokens), backend, num_tokens=num_tokens, num_experts=8)
        lora = moelora.MoeLora(q.lora_ids_np, q.w13.a_np, q.w13.b_np, q.w2.a_np[0], q.w2.b_np[0], q.enabled_np,
                               q.scale_np)
        p = q.p
        expected = reference.fused_experts(2.0 * p.x_np.astype(np.float64), p.w13_np, p.w2_np, p.topk_weights_np,
                                           p.topk_ids_np, lora=lora) + 1.0
        y, count = compiled(*q.op_args())
        assert_close(y, expected, "float32")
        assert int(count.item()) == reference.moe_lora_align_block_size(p.topk_ids_np, q.lora_ids_np, 4, 16, 8,
                                                                        q.enabled_np)[3]


# ---- FusedMoE's adapter slots ----------------------------------------------------------

class PerExpertAdapter:
    """A per-expert adapter: gate / up / down (A [E, r, K], B [E, N, r]) numpy float32."""

    def __init__(self, rng, E, H, I, rank, scale=1.0, projections=("gate", "up", "down")):
        shapes = {"gate": (H, I), "up": (H, I), "down": (I, H)}
        self.mats = {}
        for proj in projections:
            K, N = shapes[proj]
            self.mats[proj] = (uniform(rng, (E, rank, K), np.sqrt(3.0 / K)),
                               uniform(rng, (E, N, rank), np.sqrt(3.0 / rank)))
        self.E, self.H, self.I, self.rank, self.scale = E, H, I, rank, scale

    def lora_np(self, activation):
        """The adapter as fused_experts' stacks of one slot (two w13 slices)."""
        E, H, I, r = self.E, self.H, self.I, self.rank
        zero = {"gate": (np.zeros((E, r, H)), np.zeros((E, I, r))), "up": (np.zeros((E, r, H)), np.zeros((E, I, r))),
                "down": (np.zeros((E, r, I)), np.zeros((E, H, r)))}
        get = {proj: self.mats.get(proj, zero[proj]) for proj in zero}
        return moelora.MoeLora(None, [get["gate"][0][None], get["up"][0][None]],
                               [get["gate"][1][None], get["up"][1][None]], get["down"][0][None], get["down"][1][None],
                               None, np.array([self.scale]))

    def keys(self, prefix, names=("gate_proj", "up_proj", "down_proj")):
        out = {}
        for proj, name in zip(("gate", "up", "down"), names):
            if proj not in self.mats:
                continue
            a, b = self.mats[proj]
            for e in range(self.E):
                out[f"{prefix}.experts.{e}.{name}.lora_A.weight"] = a[e]
                out[f"{prefix}.experts.{e}.{name}.lora_B.weight"] = b[e]
        return out


class PackedAdapter:
    """A packed 3-D adapter: w13 (A13 [E, r, H], B13 [E, 2I, r] in w13's row order) and w2
    (A2 [E, r, I], B2 [E, H, r]), numpy float32."""

    def __init__(self, rng, E, H, I, rank, scale=1.0, projections=("gate_up", "down")):
        self.mats = {}
        if "gate_up" in projections:
            self.mats["gate_up"] = (uniform(rng, (E, rank, H), np.sqrt(3.0 / H)),
                                    uniform(rng, (E, 2 * I, rank), np.sqrt(3.0 / rank)))
        if "down" in projections:
            self.mats["down"] = (uniform(rng, (E, rank, I), np.sqrt(3.0 / I)),
                                 uniform(rng, (E, H, rank), np.sqrt(3.0 / rank)))
        self.E, self.H, self.I, self.rank, self.scale = E, H, I, rank, scale

    def lora_np(self, activation):
        """The adapter as fused_experts' stacks of one slot: one w13 slice in w13's row
        order (independent of the loader's split into gate and up)."""
        E, H, I, r = self.E, self.H, self.I, self.rank
        a13, b13 = self.mats.get("gate_up", (np.zeros((E, r, H)), np.zeros((E, 2 * I, r))))
        a2, b2 = self.mats.get("down", (np.zeros((E, r, I)), np.zeros((E, H, r))))
        return moelora.MoeLora(None, [a13[None]], [b13[None]], a2[None], b2[None], None, np.array([self.scale]))

    @staticmethod
    def peft_flat(a, b, layout):
        """PEFT's flat tensors of a parameter adapter whose delta, in nn.Linear orientation,
        is b[e] @ a[e]: lora_A [E*r, in] (row e*r + i), lora_B [out, r*E] (column i*E + e),
        in/out those of the parameter as PEFT reads it ([E, in, out] positionally)."""
        E, r = a.shape[0], a.shape[1]
        if layout == "in_out":  # parameter [E, K, N]: in = K, out = N; delta_param[e] = (b[e] a[e])^T
            A, B = a, b
        else:  # parameter [E, N, K]: in = N, out = K; delta_param[e] = b[e] a[e] = A[e]^T B[e]^T
            A, B = b.transpose(0, 2, 1), a.transpose(0, 2, 1)
        flat_a = A.reshape(E * r, A.shape[2])
        flat_b = B.transpose(1, 2, 0).reshape(B.shape[1], r * E)
        # PEFT's own delta (ParamWrapper.get_delta_weight) of these tensors, checked here.
        delta = np.einsum("ore,eri->eio", flat_b.reshape(flat_b.shape[0], r, E), flat_a.reshape(E, r, -1))
        linear = np.einsum("enr,erk->enk", b, a)
        np.testing.assert_allclose(delta, linear.transpose(0, 2, 1) if layout == "in_out" else linear, atol=1e-5)
        return flat_a, flat_b

    def keys(self, prefix, form="wrapper", layout="in_out", swap_wrappers=False):
        out = {}
        names = {"gate_up": "gate_up_proj", "down": "down_proj"}
        for i, (proj, (a, b)) in enumerate(self.mats.items()):
            if form == "stacked":
                ta, tb = a, b
            else:
                ta, tb = self.peft_flat(a, b, layout)
            if form == "wrapper":  # vLLM's convention: base_layer = gate_up_proj, outer = down_proj
                inner = proj == "gate_up" if not swap_wrappers else proj == "down"
                name = f"{prefix}.experts.base_layer" if inner else f"{prefix}.experts"
            else:
                name = f"{prefix}.experts.{names[proj]}"
            out[f"{name}.lora_A.weight"] = ta
            out[f"{name}.lora_B.weight"] = tb
        return out


def _layer(backend, seed, E=6, top_k=2, H=32, I=16, L=4, rank=16, activation="silu", **kwargs):
    torch.manual_seed(seed)
    layer = moelora.FusedMoE(num_experts=E, top_k=top_k, hidden_size=H, intermediate_size=I, activation=activation,
                             dtype=torch.float32, device=torch_device(backend), max_loras=L, max_lora_rank=rank,
                             **kwargs)
    E_local = layer.num_local_experts
    layer.load_weights(torch.randn(E_local, 2 * I, H) / H ** 0.5, torch.randn(E_local, H, I) / I ** 0.5)
    return layer


def _buffer_pointers(layer):
    return {name: getattr(layer, name).data_ptr() for name in
            ("w13_lora_a", "w13_lora_b", "w2_lora_a", "w2_lora_b", "adapter_enabled", "adapter_scale")}


def _expected(layer, x, logits, token_slots, adapters, local_experts=None):
    """The layer's output from the reference, token by token group: the tokens of slot l
    run the reference with adapter `adapters[l]` alone (in its own natural layout), the
    others (slot -1, or a slot absent from `adapters`) the base layer."""
    weights, ids = layer.route(logits)
    x_np, weights_np, ids_np = to_numpy(x), to_numpy(weights), to_numpy(ids)
    w13, w2 = to_numpy(layer.w13), to_numpy(layer.w2)
    expert_map = None if layer.expert_map is None else to_numpy(layer.expert_map)
    slots = np.asarray(token_slots)
    out = np.zeros(x_np.shape)
    for slot in set(slots.tolist()):
        rows = slots == slot
        lora = None
        if slot in adapters:
            lora = adapters[slot].lora_np(layer.activation)
            if local_experts is not None:  # the stacks of the local experts only
                lora = moelora.MoeLora(
                    None, [a[:, local_experts] for a in lora.w13_lora_a],
                    [b[:, local_experts] for b in lora.w13_lora_b], lora.w2_lora_a[:, local_experts],
                    lora.w2_lora_b[:, local_experts], None, lora.adapter_scale)
            lora.token_lora_ids = np.zeros(int(rows.sum()), dtype=np.int32)
        out[rows] = reference.fused_experts(x_np[rows], w13, w2, weights_np[rows], ids_np[rows],
                                            activation=layer.activation, expert_map=expert_map, lora=lora,
                                            routed_scaling_factor=layer.routed_scaling_factor)
    return out


def _inputs(layer, seed, num_tokens, slots):
    g = torch.Generator().manual_seed(seed)
    device = layer.w13.device
    x = torch.randn(num_tokens, layer.hidden_size, generator=g).to(device)
    logits = torch.randn(num_tokens, layer.num_experts, generator=g).to(device)
    token_slots = torch.tensor([slots[i % len(slots)] for i in range(num_tokens)], dtype=torch.int32, device=device)
    return x, logits, token_slots


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_layer_load_unload_swap_in_place(backend):
    layer = _layer(backend, _seed("layer", backend))
    E, H, I = 6, 32, 16
    rng = rng_for(_seed("layer-adapters", backend))
    pointers = _buffer_pointers(layer)
    first = PerExpertAdapter(rng, E, H, I, rank=4, scale=0.75)
    packed = PackedAdapter(rng, E, H, I, rank=16, scale=1.25)
    assert layer.load_adapter(0, first.keys("model.layers.0.mlp"), scale=0.75) == 4
    assert layer.load_adapter(2, packed.keys("model.layers.0.mlp", form="stacked"), scale=1.25) == 16
    assert layer.adapter_ranks == [4, 0, 16, 0]
    assert to_numpy(layer.adapter_enabled).tolist() == [1, 0, 1, 0]
    # Tokens of every kind: slot 0, slot 2, no adapter, and the empty slots 1 and 3.
    x, logits, slots = _inputs(layer, 1, 14, [0, 2, -1, 1, 0, 3, 2])
    out = poisoned((14, H), "float32", backend)
    out.copy_(layer(x, logits, slots))
    expected = _expected(layer, x, logits, to_numpy(slots), {0: first, 2: packed})
    assert_close(out, expected, "float32")
    assert not np.allclose(expected, _expected(layer, x, logits, to_numpy(slots), {}), atol=1e-3)
    assert_close(layer(x, logits), _expected(layer, x, logits, to_numpy(slots), {}), "float32")  # no ids: base

    # Swap slot 0 for an adapter of a higher rank, unload slot 2: same buffers.
    second = PerExpertAdapter(rng, E, H, I, rank=8, scale=2.0, projections=("gate", "down"))
    layer.load_adapter(0, second.keys("model.layers.0.mlp", names=("w1", "w3", "w2")), scale=2.0)
    layer.unload_adapter(2)
    assert _buffer_pointers(layer) == pointers
    assert layer.adapter_ranks == [8, 0, 0, 0]
    assert to_numpy(layer.adapter_enabled).tolist() == [1, 0, 0, 0]
    assert not to_numpy(layer.w13_lora_a[:, 2]).any() and not to_numpy(layer.w2_lora_b[2]).any()
    assert not to_numpy(layer.w13_lora_a[1, 0]).any()  # the swapped-in adapter has no up projection
    out = layer(x.reshape(2, 7, H), logits.reshape(2, 7, E), slots.reshape(2, 7).long())  # leading dims, int64
    assert out.shape == (2, 7, H)
    assert_close(out.reshape(14, H), _expected(layer, x, logits, to_numpy(slots), {0: second}), "float32")


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_layer_lora_expert_parallel(backend):
    expert_map = np.array([-1, 0, -1, 1, 2, -1], dtype=np.int32)  # this rank holds experts 1, 3, 4
    layer = _layer(backend, _seed("ep", backend), E=6, top_k=3, expert_map=expert_map)
    rng = rng_for(_seed("ep-adapters", backend))
    adapter = PerExpertAdapter(rng, 6, 32, 16, rank=8, scale=1.5)
    packed = PackedAdapter(rng, 6, 32, 16, rank=4)
    layer.load_adapter(1, adapter.keys("mlp"), scale=1.5)
    layer.load_adapter(3, packed.keys("mlp", form="wrapper"))
    x, logits, slots = _inputs(layer, 2, 12, [1, -1, 3])
    expected = _expected(layer, x, logits, to_numpy(slots), {1: adapter, 3: packed}, local_experts=[1, 3, 4])
    assert_close(layer(x, logits, slots), expected, "float32")


def _write_peft(folder, tensors, r, alpha, use_rslora=False, **config):
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(folder / "adapter_model.safetensors", tensors)
    config = dict(peft_type="LORA", r=r, lora_alpha=alpha, use_rslora=use_rslora, lora_dropout=0.0,
                  target_modules=["q_proj"], **config)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


PEFT_FORMS = [
    pytest.param(("per_expert", None, "silu"), id="2d-qwen-names"),
    pytest.param(("per_expert_mixtral", None, "silu"), id="2d-mixtral-names"),
    pytest.param(("wrapper", "in_out", "swiglu_oai"), id="3d-peft-gpt-oss"),
    pytest.param(("wrapper", "out_in", "silu"), id="3d-peft-transposed-param"),
    pytest.param(("wrapper-swapped", "in_out", "silu"), id="3d-peft-wrappers-by-shape"),
    pytest.param(("named", "in_out", "swiglu_oai"), id="3d-named-flat"),
    pytest.param(("stacked", None, "gelu"), id="3d-named-stacked"),
]


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
@pytest.mark.parametrize("form", PEFT_FORMS)
@pytest.mark.parametrize("use_rslora", [False, True], ids=["lora", "rslora"])
def test_layer_loads_peft_directories(tmp_path, backend, form, use_rslora):
    kind, layout, activation = form
    E, H, I, rank, alpha = 4, 48, 16, 8, 24
    layer = _layer(backend, _seed("peft", backend, form), E=E, H=H, I=I, L=2, rank=16, activation=activation)
    rng = rng_for(_seed("peft-adapter", backend, form, use_rslora))
    scale = alpha / (np.sqrt(rank) if use_rslora else rank)
    other_layer = PerExpertAdapter(rng, E, H, I, rank)  # layer 0's experts: not this layer's
    if kind.startswith("per_expert"):
        adapter = PerExpertAdapter(rng, E, H, I, rank, scale=scale)
        names = ("w1", "w3", "w2") if kind == "per_expert_mixtral" else ("gate_proj", "up_proj", "down_proj")
        prefix = "base_model.model.model.layers.1.block_sparse_moe" if names[0] == "w1" else \
            "base_model.model.model.layers.1.mlp"
        tensors = adapter.keys(prefix, names=names)
    else:
        adapter = PackedAdapter(rng, E, H, I, rank, scale=scale)
        prefix = "base_model.model.model.layers.1.mlp"
        form_name = {"wrapper-swapped": "wrapper"}.get(kind, kind)
        tensors = adapter.keys(prefix, form=form_name, layout=layout or "in_out",
                               swap_wrappers=kind == "wrapper-swapped")
    tensors.update(other_layer.keys("base_model.model.model.layers.0.mlp"))
    tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"] = np.ones((rank, H), np.float32)
    folder = _write_peft(tmp_path / "adapter", tensors, rank, alpha, use_rslora)
    short_prefix = prefix.replace("base_model.model.", "")
    assert layer.load_adapter(1, str(folder), prefix=short_prefix) == rank
    assert to_numpy(layer.adapter_scale)[1] == pytest.approx(scale, rel=1e-6)
    x, logits, slots = _inputs(layer, 3, 10, [1, -1, 0, 1])
    expected = _expected(layer, x, logits, to_numpy(slots), {1: adapter})
    assert_close(layer(x, logits, slots), expected, "float32")
    # The file itself (its sibling adapter_config.json gives the scale), and the dict.
    layer.unload_adapter(1)
    layer.load_adapter(0, folder / "adapter_model.safetensors", prefix=short_prefix + ".experts")
    assert to_numpy(layer.adapter_scale)[0] == pytest.approx(scale, rel=1e-6)
    layer.load_adapter(1, {k: torch.from_numpy(np.asarray(v)) for k, v in tensors.items()}, prefix=prefix,
                       scale=scale)
    x, logits, slots = _inputs(layer, 4, 8, [0, 1, -1])
    assert_close(layer(x, logits, slots), _expected(layer, x, logits, to_numpy(slots), {0: adapter, 1: adapter}),
                 "float32")


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_layer_folds_per_module_scales_into_b(tmp_path, backend):
    """alpha_pattern gives down_proj its own alpha: the slot keeps the common scale and
    down_proj's B carries the ratio."""
    E, H, I, rank = 4, 32, 16, 4
    layer = _layer(backend, _seed("fold", backend), E=E, H=H, I=I, L=1, rank=8)
    rng = rng_for(_seed("fold-adapter", backend))
    adapter = PerExpertAdapter(rng, E, H, I, rank)
    folder = _write_peft(tmp_path / "a", adapter.keys("model.layers.0.mlp"), rank, 8,
                         alpha_pattern={"down_proj": 32})
    layer.load_adapter(0, folder)
    assert to_numpy(layer.adapter_scale)[0] == pytest.approx(2.0)  # 8 / 4 for gate and up
    folded = PerExpertAdapter(rng, E, H, I, rank, scale=2.0)
    folded.mats = dict(adapter.mats)
    folded.mats["down"] = (adapter.mats["down"][0], adapter.mats["down"][1] * 4.0)  # (32 / 4) / 2
    x, logits, slots = _inputs(layer, 5, 9, [0, -1])
    assert_close(layer(x, logits, slots), _expected(layer, x, logits, to_numpy(slots), {0: folded}), "float32")


def test_layer_load_adapter_errors_write_nothing(tmp_path):
    E, H, I = 4, 32, 16
    layer = _layer("torch-cpu", 7, E=E, H=H, I=I, L=2, rank=8)
    rng = rng_for(8)
    good = PerExpertAdapter(rng, E, H, I, rank=8)
    layer.load_adapter(0, good.keys("mlp"))
    before = {name: getattr(layer, name).clone() for name in _buffer_pointers(layer)}
    keys = good.keys("mlp")
    high_rank = PerExpertAdapter(rng, E, H, I, rank=9).keys("mlp")
    missing = dict(keys)
    del missing["mlp.experts.2.up_proj.lora_A.weight"]
    no_b = dict(keys)
    del no_b["mlp.experts.0.down_proj.lora_B.weight"]
    bad_shape = dict(keys)
    bad_shape["mlp.experts.1.gate_proj.lora_B.weight"] = np.zeros((I + 1, 8), np.float32)
    dora = dict(keys)
    dora["mlp.experts.0.gate_proj.lora_magnitude_vector"] = np.zeros(I, np.float32)
    two_layers = dict(keys)
    two_layers.update(good.keys("other"))
    square = PackedAdapter(rng, E, H, H // 2, rank=4, projections=("gate_up",))  # H == 2I: layout unknowable
    square_layer = _layer("torch-cpu", 9, E=E, H=H, I=H // 2, L=1, rank=8)
    mixed = dict(keys)
    mixed.update(PackedAdapter(rng, E, H, I, rank=4).keys("mlp", form="named"))
    cases = [
        ("slot", lambda: layer.load_adapter(2, keys)),
        ("slot", lambda: layer.load_adapter(-1, keys)),
        ("rank 9.*max_lora_rank 8", lambda: layer.load_adapter(1, high_rank)),
        ("mlp.experts.2.up_proj.lora_A.weight.*missing", lambda: layer.load_adapter(1, missing)),
        ("mlp.experts.0.down_proj.lora_B.weight.*missing", lambda: layer.load_adapter(1, no_b)),
        ("mlp.experts.1.gate_proj.lora_B.weight.*shape", lambda: layer.load_adapter(1, bad_shape)),
        ("lora_magnitude_vector", lambda: layer.load_adapter(1, dora)),
        ("several layers", lambda: layer.load_adapter(1, two_layers)),
        ("no expert LoRA keys", lambda: layer.load_adapter(1, keys, prefix="model.layers.7.mlp")),
        ("no expert LoRA keys", lambda: layer.load_adapter(1, {"q_proj.lora_A.weight": np.zeros((8, H))})),
        ("expert_param_layout", lambda: square_layer.load_adapter(0, square.keys("mlp", form="wrapper"))),
        ("expert_param_layout", lambda: layer.load_adapter(1, keys, expert_param_layout="rows")),
        ("mixes", lambda: layer.load_adapter(1, mixed)),
        ("neither a directory nor a file", lambda: layer.load_adapter(1, str(tmp_path / "nothing"))),
        ("no adapter_model", lambda: layer.load_adapter(1, str(tmp_path))),
    ]
    for pattern, call in cases:
        with pytest.raises(ValueError, match=pattern):
            call()
            pytest.fail(f"no error for {pattern!r}")
        for name, value in before.items():
            assert torch.equal(getattr(layer, name), value), (pattern, name)
    # The packed layout, once named, loads (either reading fits the shapes).
    square_layer.load_adapter(0, square.keys("mlp", form="wrapper", layout="out_in"), expert_param_layout="out_in")
    x, logits, slots = _inputs(square_layer, 6, 6, [0])
    assert_close(square_layer(x, logits, slots), _expected(square_layer, x, logits, to_numpy(slots), {0: square}),
                 "float32")
    # A config the layer cannot use.
    folder = _write_peft(tmp_path / "dora", keys, 8, 16, use_dora=True)
    with pytest.raises(ValueError, match="DoRA"):
        layer.load_adapter(1, folder)
    with pytest.raises(TypeError, match="source"):
        layer.load_adapter(1, 42)


def test_layer_lora_configuration_errors():
    def make(**kwargs):
        return moelora.FusedMoE(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8, **kwargs)

    with pytest.raises(ValueError, match="max_loras"):
        make(max_loras=moelora.MAX_LORA_ADAPTERS + 1, max_lora_rank=8)
    with pytest.raises(ValueError, match="max_lora_rank"):
        make(max_loras=2, max_lora_rank=moelora.MAX_LORA_RANK + 1)
    with pytest.raises(ValueError, match="max_lora_rank"):
        make(max_loras=2)
    with pytest.raises(ValueError, match="max_lora_rank"):
        make(max_lora_rank=8)
    plain = make()
    assert plain.w13_lora_a is None and plain.max_loras == 0
    assert "w13_lora_a" not in plain.state_dict()
    with pytest.raises(ValueError, match="no adapter slots"):
        plain.load_adapter(0, {})
    with pytest.raises(ValueError, match="token_lora_ids"):
        plain(torch.zeros(3, 8), torch.zeros(3, 4), torch.zeros(3, dtype=torch.int32))
    with_slots = make(max_loras=2, max_lora_rank=4)
    assert "w13_lora_a" in with_slots.state_dict()
    assert tuple(with_slots.w13_lora_a.shape) == (2, 2, 4, 4, 8)
    with pytest.raises(ValueError, match="token_lora_ids"):
        with_slots(torch.zeros(3, 8), torch.zeros(3, 4), torch.zeros(3))


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_layer_with_adapters_compiles(backend):
    layer = _layer(backend, _seed("layer-compile", backend), L=2, rank=4)
    adapter = PerExpertAdapter(rng_for(11), 6, 32, 16, rank=4)
    layer.load_adapter(1, adapter.keys("mlp"))
    x, logits, slots = _inputs(layer, 7, 9, [1, -1, 0])
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert_close(compiled(x, logits, slots), _expected(layer, x, logits, to_numpy(slots), {1: adapter}), "float32")


def test_safetensors_reader_without_the_package(tmp_path):
    """load_adapter reads .safetensors without the safetensors package; its reader agrees
    with the package's writer on every float dtype."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(4, 2).to(torch.bfloat16), "c": torch.randn(7).half(),
               "d": torch.arange(6, dtype=torch.int64).reshape(2, 3), "empty": torch.zeros(0, 4)}
    path = tmp_path / "t.safetensors"
    safetensors_torch.save_file(tensors, str(path), metadata={"format": "pt"})
    read = layer_module.read_safetensors(str(path))
    assert sorted(read) == sorted(tensors)
    for name, value in tensors.items():
        assert read[name].dtype == value.dtype and torch.equal(read[name], value), name


def test_safetensors_test_writer_round_trips(tmp_path):
    values = {"x.lora_A.weight": np.arange(12, dtype=np.float32).reshape(3, 4)}
    write_safetensors(tmp_path / "w.safetensors", values)
    read = layer_module.read_safetensors(str(tmp_path / "w.safetensors"))
    assert np.array_equal(read["x.lora_A.weight"].numpy(), values["x.lora_A.weight"])


# ---- CUDA graphs ------------------------------------------------------------------------

@requires_cuda
def test_cuda_graph_replays_new_adapter_mixes():
    """One graph captured over FusedMoE with adapters serves any mix: new token_lora_ids,
    slots disabled, swapped or loaded between replays (all in place)."""
    pytest.importorskip("ml_dtypes")
    dtype = "bfloat16"
    E, top_k, H, I, L, rank, M = 8, 2, 64, 32, 4, 16, 24
    torch.manual_seed(12)
    layer = moelora.FusedMoE(num_experts=E, top_k=top_k, hidden_size=H, intermediate_size=I, dtype=torch.bfloat16,
                             device="cuda", max_loras=L, max_lora_rank=rank)
    layer.load_weights(torch.randn(E, 2 * I, H) / H ** 0.5, torch.randn(E, H, I) / I ** 0.5)
    rng = rng_for(13)
    # Adapter values exactly representable in bf16, so the reference sees what the layer holds.
    adapters = {0: PerExpertAdapter(rng, E, H, I, rank=8), 1: PackedAdapter(rng, E, H, I, rank=16),
                2: PerExpertAdapter(rng, E, H, I, rank=4), 3: PackedAdapter(rng, E, H, I, rank=2)}
    for adapter in adapters.values():
        adapter.mats = {k: tuple(m.astype(moelora_bf16()).astype(np.float32) for m in v)
                        for k, v in adapter.mats.items()}
    for slot in (0, 1, 2):
        adapters[slot].scale = 0.5 + slot
        layer.load_adapter(slot, adapters[slot].keys("mlp", **({} if slot != 1 else {"form": "stacked"})),
                           scale=adapters[slot].scale)
    static_x = torch.randn(M, H, device="cuda").to(torch.bfloat16)
    static_logits = torch.randn(M, E, device="cuda")
    static_slots = torch.zeros(M, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph
        layer(static_x, static_logits, static_slots)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(static_x, static_logits, static_slots)
    pointers = _buffer_pointers(layer)

    def replay_and_check(seed, slots, active):
        g = torch.Generator().manual_seed(seed)
        static_x.copy_(torch.randn(M, H, generator=g).to(torch.bfloat16))
        static_logits.copy_(torch.randn(M, E, generator=g))
        static_slots.copy_(torch.tensor([slots[i % len(slots)] for i in range(M)], dtype=torch.int32))
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        expected = _expected(layer, static_x, static_logits, to_numpy(static_slots), active)
        assert_close(static_out, expected, dtype)

    replay_and_check(21, [0, 1, 2, -1], {0: adapters[0], 1: adapters[1], 2: adapters[2]})
    replay_and_check(22, [2, 2, 0, 3], {0: adapters[0], 2: adapters[2]})  # slot 3 empty: base only
    layer.adapter_enabled[0] = 0  # disabled by hand
    replay_and_check(23, [0, 1, 1, -1, 2], {1: adapters[1], 2: adapters[2]})
    layer.adapter_enabled[0] = 1
    layer.unload_adapter(2)
    layer.load_adapter(3, adapters[3].keys("mlp", form="wrapper"), scale=2.0)  # loaded after capture
    adapters[3].scale = 2.0
    layer.load_adapter(1, adapters[2].keys("mlp"), scale=adapters[2].scale)  # swapped
    replay_and_check(24, [3, 1, 2, 0, -1, 3], {0: adapters[0], 1: adapters[2], 3: adapters[3]})
    replay_and_check(25, [-1], {})
    assert _buffer_pointers(layer) == pointers


def moelora_bf16():
    import ml_dtypes

    return ml_dtypes.bfloat16
