"""FusedMoE: an inference Mixture-of-Experts layer (torch.nn.Module) on moelora, with
optional multi-LoRA adapter slots (see FusedMoE.load_adapter for the adapter formats)."""

import collections
import json
import math
import os
import re

import numpy as np
import torch

from . import ops as _ops
from . import quant_checkpoint
from . import torch_ops  # noqa: F401  (registers torch.ops.moelora.*)

__all__ = ["FusedMoE"]

_ACTIVATIONS = ("silu", "gelu", "swiglu_oai")
_LORA_BUFFERS = ("w13_lora_a", "w13_lora_b", "w2_lora_a", "w2_lora_b", "adapter_enabled", "adapter_scale")


class FusedMoE(torch.nn.Module):
    """A Mixture-of-Experts MLP: softmax top-k routing, then moelora.fused_experts.

    Weights (inference only: they do not require grad):
        w13 [E_local, 2I, H]: gate rows then up rows (interleaved gate/up for swiglu_oai).
        w2  [E_local, H, I].
    Expert parallelism: expert_map [num_experts] int32 maps a global expert id to its
    local index in w13/w2, or -1 for an expert held by another rank (those slots
    contribute zero here and the ranks' outputs are summed by the caller).

    Quantized experts (quant: 'fp8_block', 'fp8_channel', 'fp8_tensor', 'int8_channel',
    'int8_block' or a moelora.QuantScheme): w13 / w2 hold the scheme's 8-bit elements
    (torch.float8_e4m3fn or torch.int8) and the layer has the float32 parameters
        w13_weight_scale, w2_weight_scale: [E_local, ceil(N/128), ceil(K/128)] (block),
            [E_local, N] (channel) or [E_local] (tensor),
        w13_input_scale, w2_input_scale [1]: static activation scales (fp8_tensor with
            static_activation_scales), else absent;
    `dtype` is then the activations' (bf16 or fp16). load_weights takes the 8-bit weights
    with their scales, or bf16/fp16 weights that it quantizes; load_quantized_experts
    reads DeepSeek-V3 (weight_scale_inv) or per-tensor/per-channel (weight_scale,
    input_scale) checkpoints.

    The weights are allocated uninitialised (torch.empty): the layer's output is
    meaningless until load_weights (or load_quantized_experts) has filled them.

    Multi-LoRA (max_loras > 0): L = max_loras adapter slots of rank up to
    r = max_lora_rank, allocated once as buffers (the layer's dtype and device):
        w13_lora_a [2, L, E_local, r, H]   (slice 0 = gate, 1 = up)
        w13_lora_b [2, L, E_local, I, r]
        w2_lora_a  [L, E_local, r, I]
        w2_lora_b  [L, E_local, H, r]
        adapter_enabled [L] int32 (0 = empty slot), adapter_scale [L] float32.
    An adapter of rank below r is zero-padded in its slot (exact: padded rows of A and
    columns of B contribute nothing). load_adapter / unload_adapter copy into the slots
    in place, so the buffers' storage never moves (CUDA graphs captured over the layer
    see every later load). forward(..., token_lora_ids) picks each token's slot.
    """

    def __init__(self, num_experts, top_k, hidden_size, intermediate_size, activation="silu",
                 renormalize=True, routed_scaling_factor=1.0, expert_map=None, chunk_size=65536,
                 swiglu_alpha=1.702, swiglu_limit=7.0, dtype=None, device=None, max_loras=0, max_lora_rank=0,
                 quant=None):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"FusedMoE: activation expected one of {_ACTIVATIONS}, got {activation!r}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"FusedMoE: top_k expected a value in [1, {num_experts}], got {top_k}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.renormalize = renormalize
        self.routed_scaling_factor = routed_scaling_factor
        self.chunk_size = chunk_size
        self.swiglu_alpha = swiglu_alpha
        self.swiglu_limit = swiglu_limit

        if expert_map is None:
            self.num_local_experts = num_experts
            self.register_buffer("expert_map", None)
        else:
            expert_map = torch.as_tensor(expert_map, dtype=torch.int32, device=device)
            if expert_map.shape != (num_experts,):
                raise ValueError(f"FusedMoE: expert_map expected shape [{num_experts}], "
                                 f"got {list(expert_map.shape)}")
            self.num_local_experts = int((expert_map >= 0).sum().item())
            self.register_buffer("expert_map", expert_map)

        factory = dict(dtype=dtype, device=device)
        self.quant_scheme = None if quant is None else _ops.quant_scheme(quant)
        weights = factory if quant is None else dict(dtype=getattr(torch, self.quant_scheme.element), device=device)
        self.w13 = torch.nn.Parameter(
            torch.empty(self.num_local_experts, 2 * intermediate_size, hidden_size, **weights),
            requires_grad=False)
        self.w2 = torch.nn.Parameter(
            torch.empty(self.num_local_experts, hidden_size, intermediate_size, **weights),
            requires_grad=False)
        self._init_quant(device)
        self._init_lora(max_loras, max_lora_rank, factory)

    def _scale_shape(self, rows, cols):
        """The weight-scale shape of an [E_local, rows, cols] weight under the scheme."""
        q, E = self.quant_scheme, self.num_local_experts
        if q.weight_scales == _ops._ext.ScaleGranularity.block:
            return (E, -(-rows // q.block_n), -(-cols // q.block_k))
        return (E, rows) if q.weight_scales == _ops._ext.ScaleGranularity.channel else (E,)

    def _init_quant(self, device):
        names = ("w13_weight_scale", "w2_weight_scale", "w13_input_scale", "w2_input_scale")
        if self.quant_scheme is None:
            for name in names:
                self.register_parameter(name, None)
            return
        H, I = self.hidden_size, self.intermediate_size
        shapes = [self._scale_shape(2 * I, H), self._scale_shape(H, I)]
        shapes += [(1,), (1,)] if self.quant_scheme.static_activation_scales else [None, None]
        for name, shape in zip(names, shapes):
            value = None if shape is None else torch.nn.Parameter(
                torch.ones(shape, dtype=torch.float32, device=device), requires_grad=False)
            self.register_parameter(name, value)

    def _init_lora(self, max_loras, max_lora_rank, factory):
        for name, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"FusedMoE: {name} expected an int, got {type(value).__name__}")
        if not 0 <= max_loras <= _ops.MAX_LORA_ADAPTERS:
            raise ValueError(f"FusedMoE: max_loras expected a value in [0, {_ops.MAX_LORA_ADAPTERS}] "
                             f"(0: no adapters), got {max_loras}")
        if max_loras > 0 and not 1 <= max_lora_rank <= _ops.MAX_LORA_RANK:
            raise ValueError(f"FusedMoE: max_lora_rank expected a value in [1, {_ops.MAX_LORA_RANK}] "
                             f"with max_loras > 0, got {max_lora_rank}")
        if max_loras == 0 and max_lora_rank != 0:
            raise ValueError(f"FusedMoE: max_lora_rank expected 0 without adapter slots (max_loras=0), "
                             f"got {max_lora_rank}")
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        # The rank of the adapter in each slot (0: empty), kept on the host.
        self.adapter_ranks = [0] * max_loras
        if max_loras == 0:
            for name in _LORA_BUFFERS:
                self.register_buffer(name, None)
            return
        L, E, r = max_loras, self.num_local_experts, max_lora_rank
        H, I = self.hidden_size, self.intermediate_size
        self.register_buffer("w13_lora_a", torch.zeros(2, L, E, r, H, **factory))
        self.register_buffer("w13_lora_b", torch.zeros(2, L, E, I, r, **factory))
        self.register_buffer("w2_lora_a", torch.zeros(L, E, r, I, **factory))
        self.register_buffer("w2_lora_b", torch.zeros(L, E, H, r, **factory))
        self.register_buffer("adapter_enabled", torch.zeros(L, dtype=torch.int32, device=factory["device"]))
        self.register_buffer("adapter_scale", torch.zeros(L, dtype=torch.float32, device=factory["device"]))

    def extra_repr(self):
        text = (f"num_experts={self.num_experts}, num_local_experts={self.num_local_experts}, "
                f"top_k={self.top_k}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, activation={self.activation}, "
                f"renormalize={self.renormalize}, routed_scaling_factor={self.routed_scaling_factor}")
        if self.max_loras:
            text += f", max_loras={self.max_loras}, max_lora_rank={self.max_lora_rank}"
        if self.quant_scheme is not None:
            text += f", quant={self.quant_scheme.name}"
        return text

    @torch.no_grad()
    def load_weights(self, w13, w2, w13_scale=None, w2_scale=None, w13_input_scale=None, w2_input_scale=None):
        """Copy w13 [E_local, 2I, H] and w2 [E_local, H, I] (any dtype/device) into the layer.

        Quantized layers: the scheme's 8-bit w13/w2 with their scales (the layouts of the
        w13_weight_scale / w2_weight_scale parameters, and the input scales for static
        activation scales), or float weights without scales, quantized here with
        moelora.quantize_weights on the layer's device. Scales must be finite and > 0.
        Nothing is written when an argument is refused."""
        values = {"w13": torch.as_tensor(w13), "w2": torch.as_tensor(w2)}
        for name, value in values.items():
            if value.shape != getattr(self, name).shape:
                raise ValueError(f"FusedMoE.load_weights: {name} expected shape {list(getattr(self, name).shape)}, "
                                 f"got {list(value.shape)}")
        if self.quant_scheme is None:
            for name, value in values.items():
                getattr(self, name).copy_(value)
            return
        given = {"w13_weight_scale": w13_scale, "w2_weight_scale": w2_scale, "w13_input_scale": w13_input_scale,
                 "w2_input_scale": w2_input_scale}
        if w13_scale is None and w2_scale is None and values["w13"].is_floating_point() and \
                values["w13"].dtype != self.w13.dtype:
            # Float weights: quantized on load, on the layer's device.
            for name in ("w13", "w2"):
                q, scale = _ops.quantize_weights(values[name].to(self.w13.device), self.quant_scheme)
                values[name], given[f"{name}_weight_scale"] = q, scale
        for name, value in values.items():
            if value.dtype != self.w13.dtype:
                raise ValueError(f"FusedMoE.load_weights: {name} expected {self.w13.dtype} (scheme "
                                 f"{self.quant_scheme.name}) with its scales, or float weights to quantize, "
                                 f"got {value.dtype}")
        for name, value in given.items():
            param = getattr(self, name)
            if (param is None) != (value is None):
                raise ValueError(f"FusedMoE.load_weights: {name} expected "
                                 f"{'none' if param is None else 'a tensor of shape ' + str(list(param.shape))}"
                                 f" for scheme {self.quant_scheme!r}, got {'none' if value is None else 'a tensor'}")
            if value is None:
                continue
            value = torch.as_tensor(value).to(device=param.device, dtype=torch.float32)
            if value.shape != param.shape:
                raise ValueError(f"FusedMoE.load_weights: {name} expected shape {list(param.shape)}, "
                                 f"got {list(value.shape)}")
            if not bool(torch.isfinite(value).all()) or not bool((value > 0).all()):
                raise ValueError(f"FusedMoE.load_weights: {name} expected finite scales > 0, got NaN, inf or <= 0")
            given[name] = value
        for name, value in values.items():
            getattr(self, name).copy_(value)
        for name, value in given.items():
            if value is not None:
                getattr(self, name).copy_(value)

    @torch.no_grad()
    def load_quantized_experts(self, source, prefix):
        """Load this layer's quantized experts from a checkpoint (a .safetensors file, or a
        dict name -> tensor) in the DeepSeek-V3 layout (fp8 `weight` + `weight_scale_inv`
        per 128x128 block) or the per-tensor / per-channel layout (`weight_scale`,
        `input_scale`): see moelora.quant_checkpoint. prefix: the MoE block's module path
        (e.g. "model.layers.3.mlp"); experts are global ids (expert_map picks this rank's)."""
        if self.quant_scheme is None:
            raise ValueError("FusedMoE.load_quantized_experts: the layer has no quantization scheme (quant=None)")
        tensors = source if isinstance(source, dict) else _load_tensor_file(os.fspath(source))
        w13, w2, s13, s2, a13, a2 = quant_checkpoint.read_quantized_experts(
            tensors, prefix, self.quant_scheme, [e for e, _ in self._local_experts()], self.hidden_size,
            self.intermediate_size)
        self.load_weights(w13, w2, s13, s2, a13, a2)

    def _quant_args(self):
        """The quantization arguments of the torch ops (empty for a bf16/fp16 layer)."""
        q = self.quant_scheme
        if q is None:
            return {}
        return dict(quant=q.name, w13_scale=self.w13_weight_scale, w2_scale=self.w2_weight_scale,
                    a13_scale=self.w13_input_scale, a2_scale=self.w2_input_scale, quant_block_n=q.block_n,
                    quant_block_k=q.block_k)

    def route(self, router_logits):
        """router_logits [M, num_experts] -> (topk_weights [M, top_k] float32,
        topk_ids [M, top_k] int32): softmax over experts, top-k, optionally renormalised."""
        probs = torch.softmax(router_logits.float(), dim=-1)
        topk_weights, topk_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return topk_weights, topk_ids.to(torch.int32)

    def forward(self, hidden_states, router_logits, token_lora_ids=None):
        """hidden_states [*, H], router_logits [*, num_experts] -> [*, H].

        token_lora_ids [*] (the leading dims of hidden_states) int32|int64: each token's
        adapter slot, -1 = none; tokens of an empty or unloaded slot run base-only. None
        (or a layer without slots) runs the base layer."""
        topk_weights, topk_ids = self.route(router_logits.reshape(-1, self.num_experts))
        return self.forward_routed(hidden_states, topk_weights, topk_ids, token_lora_ids)

    def forward_routed(self, hidden_states, topk_weights, topk_ids, token_lora_ids=None):
        """hidden_states [*, H], topk_weights [M, top_k] float32, topk_ids [M, top_k]
        int32|int64 (M = the product of the leading dims), token_lora_ids [*] or [M]
        (optional) -> [*, H]."""
        leading = hidden_states.shape[:-1]
        options = dict(activation=self.activation, routed_scaling_factor=self.routed_scaling_factor,
                       expert_map=self.expert_map, chunk_size=self.chunk_size, swiglu_alpha=self.swiglu_alpha,
                       swiglu_limit=self.swiglu_limit)
        x = hidden_states.reshape(-1, self.hidden_size)
        if token_lora_ids is None and self.quant_scheme is not None:
            out = torch.ops.moelora.fused_experts_quant(x, self.w13, self.w2, topk_weights.float(), topk_ids,
                                                        **self._quant_args(), **options)
        elif token_lora_ids is None:
            out = torch.ops.moelora.fused_experts(x, self.w13, self.w2, topk_weights.float(), topk_ids, **options)
        else:
            if self.max_loras == 0:
                raise ValueError("FusedMoE.forward: token_lora_ids expected None for a layer without adapter "
                                 "slots (max_loras=0), got a tensor")
            if token_lora_ids.is_floating_point() or token_lora_ids.is_complex():
                raise ValueError(f"FusedMoE.forward: token_lora_ids expected an integer tensor, "
                                 f"got {token_lora_ids.dtype}")
            lora_ids = token_lora_ids.reshape(-1)
            if lora_ids.dtype != torch.int32:
                lora_ids = lora_ids.to(torch.int32)
            out = torch.ops.moelora.fused_experts_lora(
                x, self.w13, self.w2, topk_weights.float(), topk_ids, lora_ids, list(self.w13_lora_a.unbind(0)),
                list(self.w13_lora_b.unbind(0)), self.w2_lora_a, self.w2_lora_b, self.adapter_enabled,
                self.adapter_scale, **options, **self._quant_args())
        return out.reshape(*leading, self.hidden_size)

    # ---- multi-LoRA adapter slots ----------------------------------------------------

    def _check_slot(self, method, slot):
        if self.max_loras == 0:
            raise ValueError(f"FusedMoE.{method}: the layer has no adapter slots (constructed with max_loras=0)")
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.max_loras:
            raise ValueError(f"FusedMoE.{method}: slot expected an int in [0, {self.max_loras}), got {slot!r}")

    def _local_experts(self):
        """[(global expert, local index)] of the experts this layer holds."""
        if self.expert_map is None:
            return [(e, e) for e in range(self.num_experts)]
        mapping = self.expert_map.tolist()
        return [(e, local) for e, local in enumerate(mapping) if local >= 0]

    @torch.no_grad()
    def load_adapter(self, slot, source, prefix=None, scale=None, expert_param_layout=None):
        """Load a LoRA adapter of this layer's experts into `slot` (in place; an occupied
        slot is swapped) and enable it.

        source: a PEFT adapter directory (adapter_config.json + adapter_model.safetensors,
            or adapter_model.bin), a .safetensors (or torch .bin/.pt) file (with a sibling
            adapter_config.json read when present), or a dict name -> tensor (torch or numpy).
        prefix: the module path of this layer's MoE block, the keys' part before
            ".experts." (e.g. "model.layers.3.mlp"; keys may carry more in front, like
            PEFT's "base_model.model."). None: the keys must hold exactly one such block.
        scale: the adapter's scale (overrides the config). None: from adapter_config.json,
            lora_alpha / r (lora_alpha / sqrt(r) with use_rslora; alpha_pattern honoured),
            or 1.0 for a source without a config.
        expert_param_layout: for PEFT's packed 3-D expert adapters only (below), the layout
            of the base model's expert parameter the adapter was trained on: "in_out"
            ([E, in, out], gpt-oss: gate_up_proj [E, H, 2I]) or "out_in" ([E, out, in], as
            transformers' fused Mixtral / Qwen3-MoE experts: gate_up_proj [E, 2I, H]).
            None: from the shapes (an error when they cannot tell, i.e. H == 2I or H == I
            with only one projection adapted).

        Key layouts accepted (tensors in nn.Linear orientation unless said):
        - per expert (2-D): <prefix>.experts.<e>.{gate_proj|up_proj|down_proj}.lora_{A|B}.weight,
          or Mixtral's w1 (gate) / w3 (up) / w2 (down); gate/up lora_A [r, H], lora_B [I, r];
          down lora_A [r, I], lora_B [H, r]. A projection is adapted for all experts or none.
        - packed 3-D, PEFT's LoraConfig.target_parameters (ParamWrapper; as vLLM's
          is_3d_moe_weight loader reads it): <prefix>.experts.base_layer.lora_{A|B}.weight and
          <prefix>.experts.lora_{A|B}.weight (the two nested wrappers of gate_up_proj and
          down_proj, told apart by their shapes), lora_A [E*r, in] (row e*r + i),
          lora_B [out, r*E] (column i*E + e), in/out read from the parameter as PEFT does.
        - packed, named: <prefix>.experts.{gate_up_proj|down_proj}.lora_{A|B}.weight, either
          in PEFT's flat form above or stacked per expert: lora_A [E, r, in], lora_B [E, out, r].
        The gate_up output rows are w13's: halves (gate, up), or interleaved for swiglu_oai.
        Any rank up to max_lora_rank (zero-padded); experts are global ids (expert_map
        picks this rank's). Raises ValueError (nothing written) on a bad slot, a rank above
        max_lora_rank, or missing, unknown or mis-shaped keys.
        """
        self._check_slot("load_adapter", slot)
        tensors, config = read_adapter(source)
        layout = _ExpertShape(num_experts=self.num_experts, hidden_size=self.hidden_size,
                              intermediate_size=self.intermediate_size, max_rank=self.max_lora_rank,
                              interleaved_gate_up=self.activation == "swiglu_oai")
        parsed = parse_expert_lora(tensors, config, layout, prefix=prefix, scale=scale,
                                   expert_param_layout=expert_param_layout)
        # Assemble the whole slot on the host first: nothing is written before every key
        # has been checked.
        L_experts = self._local_experts()
        E, r = self.num_local_experts, self.max_lora_rank
        H, I = self.hidden_size, self.intermediate_size
        w13_a = torch.zeros(2, E, r, H)
        w13_b = torch.zeros(2, E, I, r)
        w2_a = torch.zeros(E, r, I)
        w2_b = torch.zeros(E, H, r)
        targets = {"gate": (w13_a[0], w13_b[0]), "up": (w13_a[1], w13_b[1]), "down": (w2_a, w2_b)}
        for role, (dst_a, dst_b) in targets.items():
            for expert, local in L_experts:
                pair = parsed.get(role, expert)
                if pair is None:
                    continue
                a, b = pair
                dst_a[local, :a.shape[0]] = a
                dst_b[local, :, :b.shape[1]] = b
        self.w13_lora_a[:, slot].copy_(w13_a.to(self.w13_lora_a.dtype))
        self.w13_lora_b[:, slot].copy_(w13_b.to(self.w13_lora_b.dtype))
        self.w2_lora_a[slot].copy_(w2_a.to(self.w2_lora_a.dtype))
        self.w2_lora_b[slot].copy_(w2_b.to(self.w2_lora_b.dtype))
        self.adapter_scale[slot].fill_(parsed.scale)
        self.adapter_enabled[slot].fill_(1)
        self.adapter_ranks[slot] = parsed.rank
        return parsed.rank

    @torch.no_grad()
    def unload_adapter(self, slot):
        """Zero `slot`'s stacks and disable it (in place); its tokens then run base-only."""
        self._check_slot("unload_adapter", slot)
        self.adapter_enabled[slot].fill_(0)
        self.adapter_scale[slot].fill_(0.0)
        self.w13_lora_a[:, slot].zero_()
        self.w13_lora_b[:, slot].zero_()
        self.w2_lora_a[slot].zero_()
        self.w2_lora_b[slot].zero_()
        self.adapter_ranks[slot] = 0


# ---- adapter files -------------------------------------------------------------------
#
# What load_adapter reads. The packed 3-D layout is PEFT's (peft/tuners/lora/layer.py,
# ParamWrapper, LoRA on a 3-D nn.Parameter through LoraConfig.target_parameters): the
# parameter [E, d1, d2] is read as [E, in, out]; lora_A = Linear(in, r * E) and lora_B =
# Linear(r * E, out), so lora_A.weight [E*r, in] reshapes to [E, r, in] and lora_B.weight
# [out, r*E] to [out, r, E], and the delta is einsum("ore,eri->eio"). Targeting both
# gate_up_proj and down_proj of one `experts` module nests the wrappers: the saved keys are
# "experts.lora_*" and "experts.base_layer.lora_*". vLLM's loader for these (lora/
# model_manager.py, _stack_moe_lora_weights, models with is_3d_moe_weight such as gpt-oss)
# reshapes the same way and takes base_layer as gate_up_proj; here the two are told apart by
# their shapes. vLLM's docs name the fused keys "experts.gate_up_proj.lora_A.weight", also
# accepted, flat as PEFT writes them or stacked per expert ([E, r, in] / [E, out, r], as
# SGLang normalises them).

_ROLE_OF_PROJ = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_PER_EXPERT_KEY = re.compile(
    r"(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.lora_(?P<ab>[AB])\.weight")
_PACKED_KEY = re.compile(r"(?P<proj>gate_up_proj|down_proj)\.lora_(?P<ab>[AB])\.weight")
_WRAPPER_KEY = re.compile(r"(?P<nest>(?:base_layer\.)*)lora_(?P<ab>[AB])\.weight")
_LAYOUTS = ("in_out", "out_in")

_ExpertShape = collections.namedtuple(
    "_ExpertShape", "num_experts hidden_size intermediate_size max_rank interleaved_gate_up")

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
}


def _error(message):
    return ValueError(f"FusedMoE.load_adapter: {message}")


def read_safetensors(path):
    """name -> CPU tensor of a .safetensors file, read without the safetensors package (its
    format: an 8-byte little-endian header length, a JSON header of dtype / shape /
    data_offsets per tensor, then the data)."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise _error(f"'{path}' is not a safetensors file (shorter than its header)")
    header_len = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8:8 + header_len])
    except ValueError:
        raise _error(f"'{path}' is not a safetensors file (its header is not JSON)") from None
    base = 8 + header_len
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise _error(f"tensor '{name}' of '{path}' has an unsupported dtype {info.get('dtype')!r}")
        begin, end = info["data_offsets"]
        shape = [int(d) for d in info["shape"]]
        if begin == end:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(bytearray(data[base + begin:base + end]), dtype=dtype)
        tensors[name] = flat.reshape(shape)
    return tensors


def _load_tensor_file(path):
    if path.endswith(".safetensors"):
        try:
            from safetensors.torch import load_file
        except ImportError:  # the format is simple enough to read without the package
            return read_safetensors(path)
        return load_file(path, device="cpu")
    return torch.load(path, map_location="cpu", weights_only=True)


def read_adapter(source):
    """(tensors: name -> tensor, config: dict or None) of a load_adapter source."""
    if isinstance(source, dict):
        return dict(source), None
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"FusedMoE.load_adapter: source expected a path or a dict name -> tensor, "
                        f"got {type(source).__name__}")
    path = os.fspath(source)
    if os.path.isdir(path):
        folder = path
        for name in ("adapter_model.safetensors", "adapter_model.bin"):
            if os.path.isfile(os.path.join(path, name)):
                weights = os.path.join(path, name)
                break
        else:
            raise _error(f"'{path}' holds no adapter_model.safetensors (nor adapter_model.bin)")
    elif os.path.isfile(path):
        folder, weights = os.path.dirname(path), path
    else:
        raise _error(f"source '{path}' is neither a directory nor a file")
    config = None
    config_path = os.path.join(folder, "adapter_config.json")
    if os.path.isfile(config_path):
        with open(config_path) as f:
            config = json.load(f)
    return _load_tensor_file(weights), config


def _as_float_tensor(name, value):
    if isinstance(value, np.ndarray):
        if value.dtype.name == "bfloat16":
            value = value.astype(np.float32)
        value = torch.from_numpy(np.ascontiguousarray(value))
    if not isinstance(value, torch.Tensor):
        raise _error(f"key '{name}' expected a tensor, got {type(value).__name__}")
    if not (value.is_floating_point()):
        raise _error(f"key '{name}' expected a floating-point tensor, got {value.dtype}")
    return value.detach().to("cpu", torch.float32)


def _select_prefix(keys, prefix):
    """{key: remainder after '<module prefix>.experts.'} of the keys of one MoE block."""
    by_prefix = collections.defaultdict(dict)
    for key in keys:
        parts = key.split(".")
        positions = [i for i, part in enumerate(parts) if part == "experts"]
        if not positions:
            continue
        i = positions[-1]
        by_prefix[".".join(parts[:i])][key] = ".".join(parts[i + 1:])
    if prefix is not None:
        prefix = prefix.strip(".")
        if prefix == "experts" or prefix.endswith(".experts"):
            prefix = prefix[:-len("experts")].rstrip(".")
        found = {p: v for p, v in by_prefix.items() if p == prefix or p.endswith("." + prefix) or not prefix}
    else:
        found = by_prefix
    described = sorted(by_prefix)[:6]
    if not found:
        where = f" under prefix '{prefix}'" if prefix is not None else ""
        raise _error(f"no expert LoRA keys ('<prefix>.experts.*.lora_A.weight'){where}; expert module prefixes "
                     f"in the source: {described or 'none'}")
    if len(found) > 1:
        raise _error(f"the source holds the experts of several layers {sorted(found)[:6]}: pass prefix= to "
                     f"choose one" if prefix is None else
                     f"prefix '{prefix}' matches several layers {sorted(found)[:6]}: pass a longer prefix")
    (module_prefix, remainders), = found.items()
    return module_prefix, remainders


class _ParsedAdapter:
    """The (A [r, K], B [N, r]) pairs, in nn.Linear orientation, of each role (gate, up,
    down) and global expert, with per-role scale folded into B; the slot's scale; the
    largest rank."""

    def __init__(self):
        self.pairs = {}
        self.scale = 1.0
        self.rank = 0

    def get(self, role, expert):
        return self.pairs.get((role, expert))


def _module_scale(config, module_name, rank):
    """PEFT's scaling of one LoRA module: lora_alpha / r, or / sqrt(r) with use_rslora;
    alpha_pattern entries override lora_alpha for the modules they match."""
    alpha = config.get("lora_alpha")
    if alpha is None:
        raise _error("adapter_config.json has no lora_alpha: pass scale=")
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.fullmatch(rf"(.*\.)?(?:{pattern})", module_name):
            alpha = value
            break
    return float(alpha) / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _check_config(config):
    peft_type = config.get("peft_type")
    if peft_type is not None and str(peft_type).upper() != "LORA":
        raise _error(f"adapter_config.json peft_type expected 'LORA', got {peft_type!r}")
    if config.get("use_dora"):
        raise _error("adapter_config.json use_dora: DoRA adapters are not supported")


def _check_rank(key, rank, max_rank):
    if rank < 1:
        raise _error(f"key '{key}' has rank {rank}; expected at least 1")
    if rank > max_rank:
        raise _error(f"key '{key}' has rank {rank}, above the layer's max_lora_rank {max_rank}")


def _per_expert_pairs(entries, shape, full_key):
    """entries: {(role, expert): {"A": tensor, "B": tensor}} -> {(role, expert): (A, B)}."""
    E, H, I = shape.num_experts, shape.hidden_size, shape.intermediate_size
    in_out = {"gate": (H, I), "up": (H, I), "down": (I, H)}  # (K, N) of each role
    pairs = {}
    roles = sorted({role for role, _ in entries})
    for role in roles:
        for expert in range(E):
            entry = entries.get((role, expert))
            if entry is None:
                raise _error(f"key '{full_key(role, expert, 'A')}' is missing: the {role} projection has adapters "
                             f"for some experts, and every one of the {E} experts needs one")
            for ab in ("A", "B"):
                if ab not in entry:
                    raise _error(f"key '{full_key(role, expert, ab)}' is missing")
            a, b = entry["A"], entry["B"]
            K, N = in_out[role]
            if a.dim() != 2 or a.shape[1] != K:
                raise _error(f"key '{full_key(role, expert, 'A')}' expected shape [r, {K}], got {list(a.shape)}")
            rank = a.shape[0]
            _check_rank(full_key(role, expert, "A"), rank, shape.max_rank)
            if b.dim() != 2 or tuple(b.shape) != (N, rank):
                raise _error(f"key '{full_key(role, expert, 'B')}' expected shape [{N}, {rank}], got {list(b.shape)}")
            pairs[(role, expert)] = (a, b)
    return pairs


def _flat_candidates(a, b, shape, roles):
    """[(role, layout)] that PEFT's flat packed tensors a [E*r, X], b [Y, r*E] fit."""
    H, I = shape.hidden_size, shape.intermediate_size
    dims = {("gate_up", "in_out"): (H, 2 * I), ("gate_up", "out_in"): (2 * I, H),
            ("down", "in_out"): (I, H), ("down", "out_in"): (H, I)}
    if a.dim() != 2 or b.dim() != 2:
        return []
    return [(role, layout) for (role, layout), xy in dims.items()
            if role in roles and (a.shape[1], b.shape[0]) == xy]


def _unflatten(key, a, b, layout, shape):
    """PEFT's flat packed pair -> stacked (A [E, r, K], B [E, N, r]) in nn.Linear orientation."""
    E = shape.num_experts
    if a.shape[0] % E != 0 or b.shape[1] != a.shape[0]:
        raise _error(f"key '{key}' expected lora_A [E*r, in] and lora_B [out, r*E] with E = {E} experts, got "
                     f"{list(a.shape)} and {list(b.shape)}")
    rank = a.shape[0] // E
    a3 = a.reshape(E, rank, a.shape[1])                  # [E, r, X]: row e*r + i
    b3 = b.reshape(b.shape[0], rank, E).permute(2, 0, 1)  # [E, Y, r]: column i*E + e
    if layout == "in_out":  # delta_e = (B_e A_e)^T of the [in, out] parameter: W_e += B_e A_e
        return a3, b3
    return b3.transpose(1, 2), a3.transpose(1, 2)         # W_e ([out, in]) += A_e^T B_e^T


def _packed_pairs(entries, shape, layout_hint, key_of):
    """entries: {name: {"A", "B", "role" (None: from the shapes)}} of the packed form ->
    {(role, expert): (A, B)} with gate_up split into gate and up."""
    E, H, I = shape.num_experts, shape.hidden_size, shape.intermediate_size
    resolved = {}  # name -> (role, stacked (A, B) or flat candidates)
    for name, entry in entries.items():
        for ab in ("A", "B"):
            if ab not in entry:
                raise _error(f"key '{key_of(name, ab)}' is missing")
        a, b, role = entry["A"], entry["B"], entry.get("role")
        if a.dim() == 3:  # stacked per expert, nn.Linear orientation
            K, N = {"gate_up": (H, 2 * I), "down": (I, H)}[role]
            if a.shape[0] != E or a.shape[2] != K:
                raise _error(f"key '{key_of(name, 'A')}' expected shape [{E}, r, {K}], got {list(a.shape)}")
            if b.dim() != 3 or tuple(b.shape) != (E, N, a.shape[1]):
                raise _error(f"key '{key_of(name, 'B')}' expected shape [{E}, {N}, {a.shape[1]}], got "
                             f"{list(b.shape)}")
            resolved[name] = (role, (a, b))
            continue
        roles = (role,) if role is not None else ("gate_up", "down")
        candidates = _flat_candidates(a, b, shape, roles)
        if not candidates:
            what = {"gate_up": f"in = {H}, out = {2 * I} (or transposed)", "down": f"in = {I}, out = {H} (or "
                    "transposed)"}
            raise _error(f"keys '{key_of(name, 'A')}' {list(a.shape)} and '{key_of(name, 'B')}' {list(b.shape)} "
                         f"fit no expert projection of this layer: expected lora_A [E*r, in], lora_B [out, r*E] "
                         f"with " + " or ".join(what[r] for r in roles))
        if len({r for r, _ in candidates}) > 1:  # cannot happen for I > 0; kept for clarity
            raise _error(f"keys '{key_of(name, 'A')}' fit both expert projections")
        resolved[name] = (candidates[0][0], candidates)
    roles = [role for role, _ in resolved.values()]
    if len(set(roles)) != len(roles):
        raise _error(f"the packed keys {sorted(entries)} adapt the same projection twice")
    # One parameter layout for the whole block: the hint, else what every flat pair allows.
    allowed = set(_LAYOUTS) if layout_hint is None else {layout_hint}
    for name, (role, value) in resolved.items():
        if isinstance(value, list):
            fits = {layout for _, layout in value}
            if layout_hint is not None and layout_hint not in fits:
                raise _error(f"keys '{key_of(name, 'A')}' do not fit expert_param_layout='{layout_hint}' (shapes "
                             f"{list(entries[name]['A'].shape)} and {list(entries[name]['B'].shape)})")
            allowed &= fits
    flat = [name for name, (_, value) in resolved.items() if isinstance(value, list)]
    if flat and not allowed:
        raise _error(f"the packed keys {sorted(flat)} disagree on the expert parameter layout (one reads as "
                     f"[E, in, out], the other as [E, out, in])")
    if flat and len(allowed) > 1:
        raise _error(f"cannot tell the expert parameter layout of '{key_of(flat[0], 'A')}' from its shapes "
                     f"(hidden_size {H}, intermediate_size {I}): pass expert_param_layout='in_out' ([E, in, out], "
                     f"gpt-oss) or 'out_in' ([E, out, in])")
    layout = next(iter(allowed)) if flat else None
    pairs = {}
    for name, (role, value) in resolved.items():
        a, b = value if not isinstance(value, list) else _unflatten(key_of(name, "A"), entries[name]["A"],
                                                                    entries[name]["B"], layout, shape)
        _check_rank(key_of(name, "A"), a.shape[1], shape.max_rank)
        if role == "gate_up":
            gate_b, up_b = ((b[:, 0::2], b[:, 1::2]) if shape.interleaved_gate_up else (b[:, :I], b[:, I:]))
            for expert in range(E):
                pairs[("gate", expert)] = (a[expert], gate_b[expert])
                pairs[("up", expert)] = (a[expert], up_b[expert])
        else:
            for expert in range(E):
                pairs[("down", expert)] = (a[expert], b[expert])
    return pairs


def parse_expert_lora(tensors, config, shape, prefix=None, scale=None, expert_param_layout=None):
    """The adapter of one MoE block from a name -> tensor mapping (see FusedMoE.load_adapter)."""
    if expert_param_layout is not None and expert_param_layout not in _LAYOUTS:
        raise _error(f"expert_param_layout expected one of {_LAYOUTS} or None, got {expert_param_layout!r}")
    if config is not None:
        _check_config(config)
    module_prefix, remainders = _select_prefix(tensors.keys(), prefix)
    base = f"{module_prefix}.experts" if module_prefix else "experts"
    per_expert, packed, unknown = collections.defaultdict(dict), collections.defaultdict(dict), []
    for key, rest in remainders.items():
        match = _PER_EXPERT_KEY.fullmatch(rest)
        if match:
            expert = int(match["expert"])
            if expert >= shape.num_experts:
                raise _error(f"key '{key}' names expert {expert}; the layer has {shape.num_experts} experts")
            slot = per_expert[(_ROLE_OF_PROJ[match["proj"]], expert)]
            if match["ab"] in slot:
                raise _error(f"key '{key}' adapts the same projection as another key (gate_proj/w1, up_proj/w3 "
                             f"and down_proj/w2 are one projection each)")
            slot[match["ab"]] = _as_float_tensor(key, tensors[key])
            slot.setdefault("names", {})[match["ab"]] = key
            continue
        match = _PACKED_KEY.fullmatch(rest)
        if match:
            entry = packed[match["proj"]]
            entry["role"] = "gate_up" if match["proj"] == "gate_up_proj" else "down"
            entry[match["ab"]] = _as_float_tensor(key, tensors[key])
            continue
        match = _WRAPPER_KEY.fullmatch(rest)
        if match:
            depth = match["nest"].count("base_layer.")
            if depth > 1:
                raise _error(f"key '{key}': more than two nested expert parameter adapters are not supported")
            packed[f"wrapper{depth}"][match["ab"]] = _as_float_tensor(key, tensors[key])
            continue
        unknown.append(key)
    if unknown:
        raise _error(f"unsupported key '{unknown[0]}' under '{base}' (LoRA A/B weights of gate/up/down "
                     f"projections only; no DoRA, biases or other adapter types)"
                     + (f", and {len(unknown) - 1} more" if len(unknown) > 1 else ""))
    if per_expert and packed:
        raise _error(f"'{base}' mixes per-expert keys ('{base}.<e>.<proj>.lora_A.weight') with packed 3-D keys")
    if any(name.startswith("wrapper") for name in packed) and any(not n.startswith("wrapper") for n in packed):
        raise _error(f"'{base}' mixes PEFT's nested keys ('{base}.lora_A.weight') with named packed keys "
                     f"('{base}.gate_up_proj.lora_A.weight')")

    def per_expert_key(role, expert, ab):
        names = per_expert.get((role, expert), {}).get("names", {})
        if ab in names:
            return names[ab]
        proj = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}[role]
        return f"{base}.{expert}.{proj}.lora_{ab}.weight"

    def packed_key(name, ab):
        if name.startswith("wrapper"):
            return f"{base}.{'base_layer.' * int(name[len('wrapper'):])}lora_{ab}.weight"
        return f"{base}.{name}.lora_{ab}.weight"

    parsed = _ParsedAdapter()
    if per_expert:
        pairs = _per_expert_pairs(per_expert, shape, per_expert_key)
        module_names = {(role, e): per_expert_key(role, e, "A")[:-len(".lora_A.weight")] for role, e in pairs}
    else:
        pairs = _packed_pairs(packed, shape, expert_param_layout, packed_key)
        module_names = {}
        for name, entry in packed.items():
            module = packed_key(name, "A")[:-len(".lora_A.weight")]
            for role in (("gate", "up") if entry.get("role", "gate_up") == "gate_up" else ("down",)):
                for e in range(shape.num_experts):
                    module_names[(role, e)] = module
        if any(name.startswith("wrapper") for name in packed):
            # PEFT names both wrappers' module "<prefix>.experts" (patterns match that).
            module_names = {k: base for k in pairs}
    parsed.rank = max(a.shape[0] for a, _ in pairs.values())
    if scale is not None:
        parsed.scale = float(scale)
    elif config is None:
        parsed.scale = 1.0
    else:
        # One scale per slot: the most common module scale; other modules fold the ratio
        # into their B (alpha_pattern, or modules of different ranks).
        scales = {k: _module_scale(config, module_names[k], a.shape[0]) for k, (a, _) in pairs.items()}
        parsed.scale = collections.Counter(scales.values()).most_common(1)[0][0]
        if parsed.scale == 0.0:
            raise _error("the adapter's scale (lora_alpha) is 0")
        pairs = {k: (a, b * (scales[k] / parsed.scale) if scales[k] != parsed.scale else b)
                 for k, (a, b) in pairs.items()}
    parsed.pairs = pairs
    return parsed
