"""FusedMoE: an inference Mixture-of-Experts layer (torch.nn.Module) on moelora, with
optional multi-LoRA adapter slots (see FusedMoE.load_adapter for the adapter formats)."""

import torch

from . import ops as _ops
from . import checkpoint, quant_checkpoint
# read_safetensors stays importable from here, where it was first.
from .adapter_files import _ExpertShape, parse_expert_lora, read_adapter, read_safetensors  # noqa: F401
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

    Weight-only experts (quant 'w4a16' / 'w8a16', or moelora.quant_scheme(name,
    group_size=, zero_points=)): w13 [E_local, 2I, H * bits / 8] and w2 [E_local, H,
    I * bits / 8] hold packed uint8 weights (4-bit: two a byte along K, the even k in the
    low nibble), w13_weight_scale [E_local, 2I, H / G] / w2_weight_scale [E_local, H, I / G]
    (or [E_local, N] per channel) in `dtype`, and with zero points w13_weight_zero /
    w2_weight_zero (uint8, the scales' shapes). load_quantized_experts reads GPTQ / AWQ
    checkpoints; load_weights quantizes float weights (round to nearest per group).

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

    Weights: initialised as torch.nn.Linear initialises its own (each expert's
    projections U(-1/sqrt(fan_in), 1/sqrt(fan_in))) until load_weights replaces them; a
    quantized layer refuses to run (ValueError) until load_weights or
    load_quantized_experts has filled it. Or pass experts=(w13, w2): tensors of those
    shapes (and of `dtype` / on `device` when given) that the layer takes as its
    weights, without a copy.

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
                 quant=None, experts=None, track_routing=False):
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
        q = self.quant_scheme
        self._scheme_fields = None if q is None else (str(q.name), bool(q.weight_only), int(q.group_size),
                                                      int(q.block_n), int(q.block_k))
        weights = factory if quant is None else dict(dtype=getattr(torch, self.quant_scheme.element), device=device)
        # Weight-only 4-bit experts hold two weights a byte along K.
        packed = 2 if self.quant_scheme is not None and self.quant_scheme.weight_only and \
            self.quant_scheme.weight_bits == 4 else 1
        shapes = {"w13": (self.num_local_experts, 2 * intermediate_size, hidden_size // packed),
                  "w2": (self.num_local_experts, hidden_size, intermediate_size // packed)}
        self._weight_only_scale_dtype = dtype or torch.bfloat16  # the activations' dtype
        # Quantized experts hold no meaningful value until loaded (their scales are ones):
        # forward refuses to run before load_weights / load_quantized_experts.
        self._weights_loaded = experts is not None or quant is None
        if experts is None:
            for name, shape in shapes.items():
                setattr(self, name, torch.nn.Parameter(torch.empty(shape, **weights), requires_grad=False))
            if quant is None:
                self._init_like_linear()
        else:
            self._adopt_experts(experts, shapes, weights)
        self._init_quant(device)
        self._init_lora(max_loras, max_lora_rank, factory)
        # The hidden size adapters are written for: hidden_size, or less when the layer's
        # x carries extra columns after the model's own (the transformers integration's
        # bias column); load_adapter zero-pads them.
        self.adapter_hidden_size = hidden_size
        # track_routing: an int32 word the CUDA kernels OR the kRouting* bits into (ids they
        # cannot use); read with routing_errors(). None: not passed (no cost).
        self.register_buffer("routing_status", torch.zeros(1, dtype=torch.int32, device=device)
                             if track_routing else None)
        # The rows of the adapters' intermediate dimension this layer holds: all of them, or
        # (tensor parallelism, moelora.distributed) a shard [start, start + intermediate_size)
        # of the full adapter_intermediate_size that load_adapter reads and slices.
        self.adapter_intermediate_size = intermediate_size
        self.adapter_intermediate_start = 0

    @torch.no_grad()
    def _init_like_linear(self):
        """Each expert's projections as torch.nn.Linear initialises its weight (kaiming
        uniform with a = sqrt(5): U(-1/sqrt(fan_in), 1/sqrt(fan_in)))."""
        if self.w13.device.type == "meta":
            return
        self.w13.uniform_(-self.hidden_size ** -0.5, self.hidden_size ** -0.5)
        self.w2.uniform_(-self.intermediate_size ** -0.5, self.intermediate_size ** -0.5)

    def _adopt_experts(self, experts, shapes, weights):
        """Takes (w13, w2) as the layer's weights without a copy (a model's expert tensors
        moved into the layer: moelora.integrations.transformers)."""
        if self.quant_scheme is not None:
            raise ValueError("FusedMoE: experts expected None for a quantized layer (load_weights quantizes or "
                             "takes the 8-bit weights with their scales)")
        if not isinstance(experts, (tuple, list)) or len(experts) != 2:
            raise ValueError("FusedMoE: experts expected a pair (w13, w2) of tensors")
        for name, value in zip(shapes, experts):
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"FusedMoE: experts' {name} expected a torch.Tensor, got {type(value).__name__}")
            device = value.device
            if weights["device"] is not None:
                wanted = torch.device(weights["device"])
                # "cuda" names any CUDA device; "cuda:1" only that one.
                if wanted.type != device.type or (wanted.index is not None and wanted.index != device.index):
                    device = wanted
            expected = dict(shape=shapes[name], dtype=weights["dtype"] or value.dtype, device=device)
            got = dict(shape=tuple(value.shape), dtype=value.dtype, device=value.device)
            if got != expected:
                raise ValueError(f"FusedMoE: experts' {name} expected shape {list(expected['shape'])}, "
                                 f"{expected['dtype']} on {expected['device']}, got shape {list(got['shape'])}, "
                                 f"{got['dtype']} on {got['device']}")
            setattr(self, name, torch.nn.Parameter(value.detach(), requires_grad=False))

    def _scale_shape(self, rows, cols):
        """The weight-scale shape of an [E_local, rows, cols] weight under the scheme."""
        q, E = self.quant_scheme, self.num_local_experts
        if q.weight_only:
            return (E, rows, cols // q.group_size) if q.group_size else (E, rows)
        if q.weight_scales == _ops._ext.ScaleGranularity.block:
            return (E, -(-rows // q.block_n), -(-cols // q.block_k))
        return (E, rows) if q.weight_scales == _ops._ext.ScaleGranularity.channel else (E,)

    def _init_quant(self, device):
        names = ("w13_weight_scale", "w2_weight_scale", "w13_input_scale", "w2_input_scale", "w13_weight_zero",
                 "w2_weight_zero")
        if self.quant_scheme is None:
            for name in names:
                self.register_parameter(name, None)
            return
        q, H, I = self.quant_scheme, self.hidden_size, self.intermediate_size
        if q.weight_only and (H % 2 or I % 2) and q.weight_bits == 4:
            raise ValueError(f"FusedMoE: {q.name} expected an even hidden_size and intermediate_size (two 4-bit "
                             f"weights a byte), got {H} and {I}")
        if q.weight_only and q.group_size and (H % q.group_size or I % q.group_size):
            raise ValueError(f"FusedMoE: {q.name} group_size {q.group_size} expected to divide hidden_size {H} and "
                             f"intermediate_size {I}")
        shapes = [self._scale_shape(2 * I, H), self._scale_shape(H, I)]
        shapes += [(1,), (1,)] if q.static_activation_scales else [None, None]
        # Weight-only: scales in the activations' dtype, zero points (one a byte) with zero_points.
        shapes += [shapes[0], shapes[1]] if q.weight_only and q.zero_points else [None, None]
        for i, (name, shape) in enumerate(zip(names, shapes)):
            dtype = torch.uint8 if i >= 4 else (self._weight_only_scale_dtype if q.weight_only else torch.float32)
            value = None if shape is None else torch.nn.Parameter(
                torch.ones(shape, dtype=dtype, device=device), requires_grad=False)
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

    def _given_or_refused(self, name, value):
        """A scale or zero-point argument of load_weights against its parameter: present
        exactly when the scheme has the parameter (ValueError otherwise); None when absent."""
        param = getattr(self, name)
        if (param is None) != (value is None):
            raise ValueError(f"FusedMoE.load_weights: {name} expected "
                             f"{'none' if param is None else 'a tensor of shape ' + str(list(param.shape))}"
                             f" for scheme {self.quant_scheme!r}, got {'none' if value is None else 'a tensor'}")
        return None if value is None else torch.as_tensor(value)

    @torch.no_grad()
    def _load_weight_only(self, values, w13_scale, w2_scale, w13_zero, w2_zero):
        """load_weights of a weight-only layer: packed uint8 w13 / w2 with their scales (and
        zero points), or float weights [E, 2I, H] / [E, H, I] quantized here (round to
        nearest per group). Nothing is written when an argument is refused."""
        q = self.quant_scheme
        given = {"w13_weight_scale": w13_scale, "w2_weight_scale": w2_scale, "w13_weight_zero": w13_zero,
                 "w2_weight_zero": w2_zero}
        float_shapes = {"w13": (self.num_local_experts, 2 * self.intermediate_size, self.hidden_size),
                        "w2": (self.num_local_experts, self.hidden_size, self.intermediate_size)}
        if w13_scale is None and w2_scale is None and values["w13"].is_floating_point():
            for name in ("w13", "w2"):
                if tuple(values[name].shape) != float_shapes[name]:
                    raise ValueError(f"FusedMoE.load_weights: float {name} expected shape {list(float_shapes[name])},"
                                     f" got {list(values[name].shape)}")
                float_weights = values[name].to(self.w13.device, self._weight_only_scale_dtype)
                packed, scale, zero = _ops.quantize_weights(float_weights, q)
                values[name], given[f"{name}_weight_scale"], given[f"{name}_weight_zero"] = packed, scale, zero
        for name, value in values.items():
            param = getattr(self, name)
            if value.dtype != torch.uint8 or value.shape != param.shape:
                raise ValueError(f"FusedMoE.load_weights: {name} expected uint8 {list(param.shape)} (scheme "
                                 f"{q.name}, packed) with its scales, or float weights to quantize, got "
                                 f"{value.dtype} {list(value.shape)}")
        for name, value in given.items():
            param, value = getattr(self, name), self._given_or_refused(name, value)
            if value is None:
                continue
            if value.shape != param.shape or (name.endswith("zero") and value.dtype != torch.uint8):
                raise ValueError(f"FusedMoE.load_weights: {name} expected {param.dtype} {list(param.shape)}, "
                                 f"got {value.dtype} {list(value.shape)}")
            if name.endswith("scale") and not bool(torch.isfinite(value).all()):
                raise ValueError(f"FusedMoE.load_weights: {name} expected finite scales, got NaN or inf")
            if name.endswith("zero") and int(value.max()) >= (1 << q.weight_bits):
                raise ValueError(f"FusedMoE.load_weights: {name} expected zero points below {1 << q.weight_bits}, "
                                 f"got {int(value.max())}")
            given[name] = value.to(device=param.device, dtype=param.dtype)
        for name, value in list(values.items()) + list(given.items()):
            if value is not None:
                getattr(self, name).copy_(value)
        self._weights_loaded = True

    @torch.no_grad()
    def load_weights(self, w13, w2, w13_scale=None, w2_scale=None, w13_input_scale=None, w2_input_scale=None,
                     w13_zero=None, w2_zero=None):
        """Copy w13 [E_local, 2I, H] and w2 [E_local, H, I] (any dtype/device) into the layer.

        Quantized layers: the scheme's 8-bit w13/w2 with their scales (the layouts of the
        w13_weight_scale / w2_weight_scale parameters, and the input scales for static
        activation scales), or float weights without scales, quantized here with
        moelora.quantize_weights on the layer's device. Scales must be finite and > 0.
        Weight-only layers (w4a16 / w8a16): packed uint8 w13 / w2 with scales in the layer
        dtype and, with zero points, w13_zero / w2_zero (uint8, one a byte); or float
        weights, quantized here (round to nearest per group).
        Nothing is written when an argument is refused."""
        values = {"w13": torch.as_tensor(w13), "w2": torch.as_tensor(w2)}
        if self.quant_scheme is not None and self.quant_scheme.weight_only:
            return self._load_weight_only(values, w13_scale, w2_scale, w13_zero, w2_zero)
        for name, value in values.items():
            if value.shape != getattr(self, name).shape:
                raise ValueError(f"FusedMoE.load_weights: {name} expected shape {list(getattr(self, name).shape)}, "
                                 f"got {list(value.shape)}")
        if self.quant_scheme is None:
            for name, value in values.items():
                getattr(self, name).copy_(value)
            self._weights_loaded = True
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
            param, value = getattr(self, name), self._given_or_refused(name, value)
            if value is None:
                continue
            value = value.to(device=param.device, dtype=torch.float32)
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
        self._weights_loaded = True

    @torch.no_grad()
    def load_experts(self, source, prefix):
        """Load this layer's experts from a model checkpoint: a .safetensors file, a folder
        of shards, or a dict name -> tensor, in any naming moelora.checkpoint reads (per
        expert gate_proj/up_proj/down_proj or Mixtral's w1/w3/w2, or the fused
        gate_up_proj / down_proj). prefix: the MoE block's path in the checkpoint (e.g.
        "model.layers.3.mlp", Mixtral's "model.layers.3.block_sparse_moe"). Only this
        rank's experts (expert_map) are read. A quantized layer takes a quantized
        checkpoint's 8-bit weights and scales (load_quantized_experts), or float weights
        that it quantizes. Checkpoints with expert biases (gpt-oss) load through
        moelora.integrations.transformers, whose block holds the biases."""
        reader = checkpoint.CheckpointReader(source)
        block = f"{prefix}.experts."
        if self.quant_scheme is not None and any(
                key.startswith(block) and key.endswith((".weight_scale_inv", ".weight_scale", ".qweight"))
                for key in reader):
            return self.load_quantized_experts(reader, prefix)
        experts = checkpoint.read_experts(reader, prefix, [e for e, _ in self._local_experts()], self.num_experts,
                                          self.hidden_size, self.intermediate_size)
        if experts.w13_bias is not None:
            raise ValueError(f"FusedMoE.load_experts: '{block}' holds expert biases (gpt-oss), which this layer has "
                             f"no place for: load it through moelora.integrations.transformers.load_experts")
        if experts.interleaved != (self.activation == "swiglu_oai"):
            raise ValueError(f"FusedMoE.load_experts: '{block}' holds {'interleaved' if experts.interleaved else 'halved'}"
                             f" gate/up rows, activation {self.activation!r} expects the other")
        self.load_weights(experts.w13, experts.w2)

    @torch.no_grad()
    def load_quantized_experts(self, source, prefix, quant_config=None):
        """Load this layer's quantized experts from a checkpoint (a .safetensors file, or a
        dict name -> tensor) in the DeepSeek-V3 layout (fp8 `weight` + `weight_scale_inv`
        per 128x128 block) or the per-tensor / per-channel layout (`weight_scale`,
        `input_scale`); weight-only layers from GPTQ or AWQ tensors (`qweight`, `qzeros`,
        `scales`, `g_idx`), with quant_config the checkpoint's quantization_config (bits,
        group_size, sym / zero_point, desc_act, checkpoint_format): see
        moelora.quant_checkpoint. prefix: the MoE block's module path (e.g.
        "model.layers.3.mlp"); experts are global ids (expert_map picks this rank's)."""
        if self.quant_scheme is None:
            raise ValueError("FusedMoE.load_quantized_experts: the layer has no quantization scheme (quant=None)")
        tensors = checkpoint.CheckpointReader(source)  # reads only the tensors asked for
        if self.quant_scheme.weight_only:
            w13, w2, s13, s2, z13, z2 = quant_checkpoint.read_weight_only_experts(
                tensors, prefix, self.quant_scheme, [e for e, _ in self._local_experts()], self.hidden_size,
                self.intermediate_size, quant_config)
            dtype = self._weight_only_scale_dtype
            self.load_weights(w13, w2, s13.to(dtype), s2.to(dtype), w13_zero=z13, w2_zero=z2)
            return
        w13, w2, s13, s2, a13, a2 = quant_checkpoint.read_quantized_experts(
            tensors, prefix, self.quant_scheme, [e for e, _ in self._local_experts()], self.hidden_size,
            self.intermediate_size)
        self.load_weights(w13, w2, s13, s2, a13, a2)

    def _quant_args(self):
        """The quantization arguments of the torch ops (empty for a bf16/fp16 layer).
        NOTE: the scheme's fields as plain Python values read once (_scheme_fields):
        torch.compile cannot trace calls into the nanobind QuantScheme."""
        if self.quant_scheme is None:
            return {}
        name, weight_only, group_size, block_n, block_k = self._scheme_fields
        if weight_only:
            return dict(quant=name, w13_scale=self.w13_weight_scale, w2_scale=self.w2_weight_scale,
                        group_size=group_size, w13_zero=self.w13_weight_zero, w2_zero=self.w2_weight_zero)
        return dict(quant=name, w13_scale=self.w13_weight_scale, w2_scale=self.w2_weight_scale,
                    a13_scale=self.w13_input_scale, a2_scale=self.w2_input_scale, quant_block_n=block_n,
                    quant_block_k=block_k)

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
        if not self._weights_loaded:
            raise ValueError(f"FusedMoE.forward: the quantized experts ({self.quant_scheme.name}) are not loaded: "
                             f"call load_weights(...) or load_quantized_experts(...) first")
        leading = hidden_states.shape[:-1]
        options = dict(activation=self.activation, routed_scaling_factor=self.routed_scaling_factor,
                       expert_map=self.expert_map, chunk_size=self.chunk_size, swiglu_alpha=self.swiglu_alpha,
                       swiglu_limit=self.swiglu_limit)
        # track_routing: the ops' "_tracked" twins OR what they meet into the word.
        suffix = ""
        if self.routing_status is not None:
            suffix, options["routing_status"] = "_tracked", self.routing_status
        x = hidden_states.reshape(-1, self.hidden_size)
        if token_lora_ids is None and self.quant_scheme is not None:
            out = getattr(torch.ops.moelora, "fused_experts_quant" + suffix)(
                x, self.w13, self.w2, topk_weights.float(), topk_ids, **self._quant_args(), **options)
        elif token_lora_ids is None:
            out = getattr(torch.ops.moelora, "fused_experts" + suffix)(x, self.w13, self.w2, topk_weights.float(),
                                                                       topk_ids, **options)
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
            out = getattr(torch.ops.moelora, "fused_experts_lora" + suffix)(
                x, self.w13, self.w2, topk_weights.float(), topk_ids, lora_ids, list(self.w13_lora_a.unbind(0)),
                list(self.w13_lora_b.unbind(0)), self.w2_lora_a, self.w2_lora_b, self.adapter_enabled,
                self.adapter_scale, **options, **self._quant_args())
        return out.reshape(*leading, self.hidden_size)

    def routing_errors(self, reset=True):
        """What the kernels met since the word was last reset (track_routing=True): a list
        of "expert id out of range", "adapter id out of range", "expert_map value out of
        range" (empty: none). Reads the word on the host (a synchronisation: call it when a
        batch is done, not inside a captured graph); reset zeroes it."""
        if self.routing_status is None:
            raise ValueError("FusedMoE.routing_errors: the layer does not track its routing (track_routing=False)")
        word = int(self.routing_status.item())
        if reset:
            self.routing_status.zero_()
        names = ((_ops._ext.ROUTING_BAD_EXPERT_ID, "expert id out of range"),
                 (_ops._ext.ROUTING_BAD_ADAPTER_ID, "adapter id out of range"),
                 (_ops._ext.ROUTING_BAD_EXPERT_MAP, "expert_map value out of range"))
        return [name for bit, name in names if word & bit]

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
        layout = _ExpertShape(num_experts=self.num_experts, hidden_size=self.adapter_hidden_size,
                              intermediate_size=self.adapter_intermediate_size, max_rank=self.max_lora_rank,
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
                # Tensor parallelism: gate/up's B rows and down's A columns of this shard.
                shard = slice(self.adapter_intermediate_start, self.adapter_intermediate_start + I)
                if role == "down":
                    a = a[:, shard]
                else:
                    b = b[shard]
                # Zero-padded: a rank below r, and (adapter_hidden_size < H) the extra
                # input columns of gate/up's A and output rows of down's B.
                dst_a[local, :a.shape[0], :a.shape[1]] = a
                dst_b[local, :b.shape[0], :b.shape[1]] = b
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
