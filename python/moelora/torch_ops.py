"""torch.ops.moelora.*: the moelora ops as torch custom ops (CPU and CUDA).

Registered with torch.library so they trace opaquely under torch.compile(fullgraph=True)
and replay under CUDA graphs: the kernels run on torch's current stream, allocate only
through torch, and never read device data on the host. Each op has a fake (meta)
implementation giving output shapes from input shapes alone.

Mirroring SGLang, fused_experts is functional (returns a new tensor) and
inplace_fused_experts writes into hidden_states.

Multi-LoRA: fused_experts_lora is fused_experts with the adapter state and stacks (the
required tensors first, then the options of fused_experts); fused_moe_lora adds the LoRA
delta of one expert GEMM into `out` (vLLM's fused_moe_lora); moe_lora_align_block_size
aligns over (expert, adapter) pairs. The adapter state (token_lora_ids, adapter_enabled,
adapter_scale) stays on the device, so one captured CUDA graph serves any mix of adapters.

sparse_mla_decode returns (out, lse) (FlashMLA's sparse decode: q [T, Hq, 576], kv
[S, 1, 576], indices [T, 1, topk]).

Quantized experts (issue 28): fused_experts_quant is fused_experts on fp8/int8 experts
(quant names the scheme: fp8_block, fp8_channel, fp8_tensor, int8_channel, int8_block;
static activation scales when a13_scale/a2_scale are given), or on weight-only experts
(issue 30: w4a16 / w8a16 with group_size, zero points when w13_zero/w2_zero are given);
fused_experts_lora takes the same optional quant arguments. per_token_group_quant, scaled_fp8_quant and
scaled_int8_quant follow vLLM's ops of those names.
"""

import torch

from . import ops as _ops

_lib = torch.library.Library("moelora", "DEF")

_register_fake = getattr(torch.library, "register_fake", None) or torch.library.impl_abstract

_FUSED_EXPERTS_ARGS = (
    "Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, str activation='silu', "
    "bool apply_router_weight_on_input=False, float routed_scaling_factor=1.0, "
    "Tensor? expert_map=None, int chunk_size=65536, float swiglu_alpha=1.702, "
    "float swiglu_limit=7.0")

_LORA_ARGS = (
    "Tensor token_lora_ids, Tensor[] w13_lora_a, Tensor[] w13_lora_b, Tensor w2_lora_a, Tensor w2_lora_b, "
    "Tensor? adapter_enabled=None, Tensor? adapter_scale=None")

_QUANT_ARGS = (
    "str quant, Tensor w13_scale, Tensor w2_scale, Tensor? a13_scale=None, Tensor? a2_scale=None, "
    "int quant_block_n=128, int quant_block_k=128")
# Weight-only schemes (w4a16 / w8a16): the group size, and zero points (zero_points when given).
_WEIGHT_ONLY_ARGS = "int group_size=128, Tensor? w13_zero=None, Tensor? w2_zero=None"
_OPTIONAL_QUANT_ARGS = (
    "str? quant=None, Tensor? w13_scale=None, Tensor? w2_scale=None, Tensor? a13_scale=None, "
    f"Tensor? a2_scale=None, int quant_block_n=128, int quant_block_k=128, {_WEIGHT_ONLY_ARGS}")

_SCHEMAS = {
    "moe_align_block_size":
        "moe_align_block_size(Tensor topk_ids, int block_size, int num_experts, "
        "Tensor? expert_map=None) -> (Tensor, Tensor, Tensor)",
    "fused_moe":
        "fused_moe(Tensor a, Tensor w, Tensor(a!) out, Tensor sorted_token_ids, Tensor expert_ids, "
        "Tensor num_tokens_post_padded, Tensor? topk_weights=None, bool mul_routed_weight=False, "
        "int top_k=1, int block_size=64) -> ()",
    "silu_and_mul": "silu_and_mul(Tensor input) -> Tensor",
    "gelu_and_mul": "gelu_and_mul(Tensor input) -> Tensor",
    "swiglu_oai_and_mul":
        "swiglu_oai_and_mul(Tensor input, float alpha=1.702, float limit=7.0) -> Tensor",
    "moe_sum_reduce": "moe_sum_reduce(Tensor input, float routed_scaling_factor=1.0) -> Tensor",
    "fused_experts":
        f"fused_experts(Tensor hidden_states, {_FUSED_EXPERTS_ARGS}, bool no_combine=False) -> Tensor",
    "inplace_fused_experts":
        f"inplace_fused_experts(Tensor(a!) hidden_states, {_FUSED_EXPERTS_ARGS}) -> ()",
    "moe_lora_align_block_size":
        "moe_lora_align_block_size(Tensor topk_ids, Tensor token_lora_ids, int max_loras, int block_size, "
        "int num_experts, Tensor? adapter_enabled=None, Tensor? expert_map=None) -> (Tensor, Tensor, Tensor, Tensor)",
    "fused_moe_lora":
        "fused_moe_lora(Tensor(a!) out, Tensor a, Tensor topk_ids, Tensor token_lora_ids, Tensor[] lora_a, "
        "Tensor[] lora_b, Tensor? adapter_enabled=None, Tensor? adapter_scale=None, Tensor? topk_weights=None, "
        "bool mul_routed_weight=False, bool add_inputs=True, bool interleaved_slices=False, "
        "Tensor? sorted_token_ids=None, Tensor? expert_ids=None, Tensor? block_lora_ids=None, "
        "Tensor? num_tokens_post_padded=None, int block_size=0) -> ()",
    "fused_experts_lora":
        "fused_experts_lora(Tensor hidden_states, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, "
        f"{_LORA_ARGS}, str activation='silu', bool apply_router_weight_on_input=False, "
        "float routed_scaling_factor=1.0, Tensor? expert_map=None, int chunk_size=65536, "
        f"float swiglu_alpha=1.702, float swiglu_limit=7.0, bool no_combine=False, {_OPTIONAL_QUANT_ARGS}) -> Tensor",
    "fused_experts_quant":
        f"fused_experts_quant(Tensor hidden_states, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, "
        f"{_QUANT_ARGS}, str activation='silu', bool apply_router_weight_on_input=False, "
        "float routed_scaling_factor=1.0, Tensor? expert_map=None, int chunk_size=65536, "
        f"float swiglu_alpha=1.702, float swiglu_limit=7.0, bool no_combine=False, {_WEIGHT_ONLY_ARGS}) -> Tensor",
    "per_token_group_quant":
        "per_token_group_quant(Tensor x, int group_size=128, str dtype='float8_e4m3fn', "
        "bool column_major_scales=False) -> (Tensor, Tensor)",
    "scaled_fp8_quant":
        "scaled_fp8_quant(Tensor x, Tensor? scale=None, bool use_per_token_if_dynamic=False) -> (Tensor, Tensor)",
    "scaled_int8_quant": "scaled_int8_quant(Tensor x, Tensor? scale=None) -> (Tensor, Tensor)",
    "sparse_mla_decode":
        "sparse_mla_decode(Tensor q, Tensor kv, Tensor indices, float softmax_scale, Tensor? topk_length=None, "
        "Tensor? attn_sink=None, int num_splits=0) -> (Tensor, Tensor)",
}


# ---- real implementations (CPU and CUDA) -------------------------------------------

def _moe_align_block_size(topk_ids, block_size, num_experts, expert_map=None):
    return _ops.moe_align_block_size(topk_ids, block_size, num_experts, expert_map)


def _fused_moe(a, w, out, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights=None,
               mul_routed_weight=False, top_k=1, block_size=64):
    _ops.fused_moe(a, w, out, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights,
                   mul_routed_weight, top_k, block_size)


def _silu_and_mul(input):
    return _ops.silu_and_mul(input)


def _gelu_and_mul(input):
    return _ops.gelu_and_mul(input)


def _swiglu_oai_and_mul(input, alpha=1.702, limit=7.0):
    return _ops.swiglu_oai_and_mul(input, alpha, limit)


def _moe_sum_reduce(input, routed_scaling_factor=1.0):
    return _ops.moe_sum_reduce(input, routed_scaling_factor=routed_scaling_factor)


# lora and quant are not schema arguments: fused_experts_lora and fused_experts_quant
# build them from theirs and run the same layer call.
def _fused_experts(hidden_states, w13, w2, topk_weights, topk_ids, activation="silu",
                   apply_router_weight_on_input=False, routed_scaling_factor=1.0, expert_map=None,
                   chunk_size=65536, swiglu_alpha=1.702, swiglu_limit=7.0, no_combine=False, routing_status=None,
                   lora=None, quant=None):
    return _ops.fused_experts(
        hidden_states, w13, w2, topk_weights, topk_ids, activation=activation, no_combine=no_combine,
        apply_router_weight_on_input=apply_router_weight_on_input,
        routed_scaling_factor=routed_scaling_factor, expert_map=expert_map, chunk_size=chunk_size,
        swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit, lora=lora, quant=quant, routing_status=routing_status)


def _inplace_fused_experts(hidden_states, w13, w2, topk_weights, topk_ids, activation="silu",
                           apply_router_weight_on_input=False, routed_scaling_factor=1.0,
                           expert_map=None, chunk_size=65536, swiglu_alpha=1.702, swiglu_limit=7.0):
    _ops.fused_experts(
        hidden_states, w13, w2, topk_weights, topk_ids, activation=activation, inplace=True,
        apply_router_weight_on_input=apply_router_weight_on_input,
        routed_scaling_factor=routed_scaling_factor, expert_map=expert_map, chunk_size=chunk_size,
        swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)


def _moe_lora_align_block_size(topk_ids, token_lora_ids, max_loras, block_size, num_experts, adapter_enabled=None,
                               expert_map=None):
    return _ops.moe_lora_align_block_size(topk_ids, token_lora_ids, max_loras, block_size, num_experts,
                                          adapter_enabled=adapter_enabled, expert_map=expert_map)


def _fused_moe_lora(out, a, topk_ids, token_lora_ids, lora_a, lora_b, adapter_enabled=None, adapter_scale=None,
                    topk_weights=None, mul_routed_weight=False, add_inputs=True, interleaved_slices=False,
                    sorted_token_ids=None, expert_ids=None, block_lora_ids=None, num_tokens_post_padded=None,
                    block_size=0):
    alignment = None
    if sorted_token_ids is not None or expert_ids is not None or block_lora_ids is not None \
            or num_tokens_post_padded is not None:
        # The op names the missing one when only some are given.
        alignment = (sorted_token_ids, expert_ids, block_lora_ids, num_tokens_post_padded, block_size)
    _ops.fused_moe_lora(out, a, topk_ids, token_lora_ids, list(lora_a), list(lora_b),
                        adapter_enabled=adapter_enabled, adapter_scale=adapter_scale, topk_weights=topk_weights,
                        mul_routed_weight=mul_routed_weight, add_inputs=add_inputs,
                        interleaved_slices=interleaved_slices, alignment=alignment)


def _moe_quant(quant, w13_scale, w2_scale, a13_scale, a2_scale, block_n, block_k, group_size=128, w13_zero=None,
               w2_zero=None):
    """The MoeQuant of the schema's quant arguments (None without a scheme); static
    activation scales when a13_scale is given; weight-only zero points when w13_zero is."""
    if quant is None:
        return None
    scheme = _ops.quant_scheme(quant, block_n, block_k, static_activation_scales=a13_scale is not None,
                               group_size=group_size, zero_points=w13_zero is not None)
    return _ops.MoeQuant(scheme, w13_scale, w2_scale, a13_scale, a2_scale, w13_zero, w2_zero)


def _fused_experts_lora(hidden_states, w13, w2, topk_weights, topk_ids, token_lora_ids, w13_lora_a, w13_lora_b,
                        w2_lora_a, w2_lora_b, adapter_enabled=None, adapter_scale=None, activation="silu",
                        apply_router_weight_on_input=False, routed_scaling_factor=1.0, expert_map=None,
                        chunk_size=65536, swiglu_alpha=1.702, swiglu_limit=7.0, no_combine=False, quant=None,
                        w13_scale=None, w2_scale=None, a13_scale=None, a2_scale=None, quant_block_n=128,
                        quant_block_k=128, group_size=128, w13_zero=None, w2_zero=None, routing_status=None):
    lora = _ops.MoeLora(token_lora_ids, list(w13_lora_a), list(w13_lora_b), w2_lora_a, w2_lora_b,
                        adapter_enabled=adapter_enabled, adapter_scale=adapter_scale)
    return _fused_experts(hidden_states, w13, w2, topk_weights, topk_ids, activation, apply_router_weight_on_input,
                          routed_scaling_factor, expert_map, chunk_size, swiglu_alpha, swiglu_limit, no_combine,
                          routing_status, lora=lora,
                          quant=_moe_quant(quant, w13_scale, w2_scale, a13_scale, a2_scale, quant_block_n,
                                           quant_block_k, group_size, w13_zero, w2_zero))


def _fused_experts_quant(hidden_states, w13, w2, topk_weights, topk_ids, quant, w13_scale, w2_scale, a13_scale=None,
                         a2_scale=None, quant_block_n=128, quant_block_k=128, activation="silu",
                         apply_router_weight_on_input=False, routed_scaling_factor=1.0, expert_map=None,
                         chunk_size=65536, swiglu_alpha=1.702, swiglu_limit=7.0, no_combine=False, group_size=128,
                         w13_zero=None, w2_zero=None, routing_status=None):
    return _fused_experts(hidden_states, w13, w2, topk_weights, topk_ids, activation, apply_router_weight_on_input,
                          routed_scaling_factor, expert_map, chunk_size, swiglu_alpha, swiglu_limit, no_combine,
                          routing_status,
                          quant=_moe_quant(quant, w13_scale, w2_scale, a13_scale, a2_scale, quant_block_n,
                                           quant_block_k, group_size, w13_zero, w2_zero))


def _per_token_group_quant(x, group_size=128, dtype="float8_e4m3fn", column_major_scales=False):
    return _ops.per_token_group_quant(x, group_size, dtype, column_major_scales)


# NOTE: a custom op's outputs must not alias its inputs: a static scale comes back as a copy.
def _scaled_fp8_quant(x, scale=None, use_per_token_if_dynamic=False):
    q, scales = _ops.scaled_fp8_quant(x, scale, use_per_token_if_dynamic)
    return q, scales.clone() if scale is not None else scales


def _scaled_int8_quant(x, scale=None):
    q, scales = _ops.scaled_int8_quant(x, scale)
    return q, scales.clone() if scale is not None else scales


# ---- fake implementations: shapes only ---------------------------------------------

def _moe_align_block_size_fake(topk_ids, block_size, num_experts, expert_map=None):
    max_num_tokens_padded, max_num_blocks = _ops.align_capacity(topk_ids.numel(), block_size, num_experts,
                                                                min_fn=torch.sym_min)
    device = topk_ids.device
    return (torch.empty((max_num_tokens_padded,), dtype=torch.int32, device=device),
            torch.empty((max_num_blocks,), dtype=torch.int32, device=device),
            torch.empty((1,), dtype=torch.int32, device=device))


def _fused_moe_fake(a, w, out, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights=None,
                    mul_routed_weight=False, top_k=1, block_size=64):
    return None


def _gated_activation_fake(input, *args):
    return input.new_empty(tuple(input.shape[:-1]) + (input.shape[-1] // 2,))


def _moe_sum_reduce_fake(input, routed_scaling_factor=1.0):
    return input.new_empty((input.shape[0], input.shape[2]))


def _fused_experts_fake(hidden_states, w13, w2, topk_weights, topk_ids, activation="silu",
                        apply_router_weight_on_input=False, routed_scaling_factor=1.0, expert_map=None,
                        chunk_size=65536, swiglu_alpha=1.702, swiglu_limit=7.0, no_combine=False,
                        routing_status=None):
    if no_combine:
        return hidden_states.new_empty((hidden_states.shape[0], topk_ids.shape[1], hidden_states.shape[1]))
    return torch.empty_like(hidden_states, memory_format=torch.contiguous_format)


def _inplace_fused_experts_fake(hidden_states, *args, **kwargs):
    return None


def _moe_lora_align_block_size_fake(topk_ids, token_lora_ids, max_loras, block_size, num_experts,
                                    adapter_enabled=None, expert_map=None):
    max_num_tokens_padded, max_num_blocks = _ops.lora_align_capacity(topk_ids.numel(), block_size, num_experts,
                                                                     max_loras, min_fn=torch.sym_min)
    device = topk_ids.device
    return (torch.empty((max_num_tokens_padded,), dtype=torch.int32, device=device),
            torch.empty((max_num_blocks,), dtype=torch.int32, device=device),
            torch.empty((max_num_blocks,), dtype=torch.int32, device=device),
            torch.empty((1,), dtype=torch.int32, device=device))


def _fused_moe_lora_fake(out, *args, **kwargs):
    return None


def _layer_out_fake(hidden_states, topk_ids, no_combine):
    if no_combine:
        return hidden_states.new_empty((hidden_states.shape[0], topk_ids.shape[1], hidden_states.shape[1]))
    return torch.empty_like(hidden_states, memory_format=torch.contiguous_format)


# NOTE: full signatures: opcheck passes every schema argument positionally, so no_combine
# must be found by position too.
def _fused_experts_lora_fake(hidden_states, w13, w2, topk_weights, topk_ids, token_lora_ids, w13_lora_a, w13_lora_b,
                             w2_lora_a, w2_lora_b, adapter_enabled=None, adapter_scale=None, activation="silu",
                             apply_router_weight_on_input=False, routed_scaling_factor=1.0, expert_map=None,
                             chunk_size=65536, swiglu_alpha=1.702, swiglu_limit=7.0, no_combine=False, quant=None,
                             w13_scale=None, w2_scale=None, a13_scale=None, a2_scale=None, quant_block_n=128,
                             quant_block_k=128, group_size=128, w13_zero=None, w2_zero=None, routing_status=None):
    return _layer_out_fake(hidden_states, topk_ids, no_combine)


def _fused_experts_quant_fake(hidden_states, w13, w2, topk_weights, topk_ids, quant, w13_scale, w2_scale,
                              a13_scale=None, a2_scale=None, quant_block_n=128, quant_block_k=128, activation="silu",
                              apply_router_weight_on_input=False, routed_scaling_factor=1.0, expert_map=None,
                              chunk_size=65536, swiglu_alpha=1.702, swiglu_limit=7.0, no_combine=False,
                              group_size=128, w13_zero=None, w2_zero=None, routing_status=None):
    return _layer_out_fake(hidden_states, topk_ids, no_combine)


def _per_token_group_quant_fake(x, group_size=128, dtype="float8_e4m3fn", column_major_scales=False):
    rows, cols = x.shape
    groups = cols // group_size
    scales = (torch.empty((groups, rows), dtype=torch.float32, device=x.device).t() if column_major_scales
              else x.new_empty((rows, groups), dtype=torch.float32))
    return x.new_empty(x.shape, dtype=getattr(torch, dtype)), scales


def _scaled_quant_fake(x, scale, per_token, dtype):
    if scale is not None:
        scales = torch.empty_like(scale)
    else:
        scales = x.new_empty((x.shape[0], 1) if per_token else (1,), dtype=torch.float32)
    return x.new_empty(x.shape, dtype=dtype), scales


def _scaled_fp8_quant_fake(x, scale=None, use_per_token_if_dynamic=False):
    return _scaled_quant_fake(x, scale, use_per_token_if_dynamic, torch.float8_e4m3fn)


def _scaled_int8_quant_fake(x, scale=None):
    return _scaled_quant_fake(x, scale, True, torch.int8)


def _sparse_mla_decode(q, kv, indices, softmax_scale, topk_length=None, attn_sink=None, num_splits=0):
    return _ops.sparse_mla_decode(q, kv, indices, softmax_scale, topk_length=topk_length, attn_sink=attn_sink,
                                  num_splits=num_splits, return_lse=True)


def _sparse_mla_decode_fake(q, kv, indices, softmax_scale, topk_length=None, attn_sink=None, num_splits=0):
    return (q.new_empty((q.shape[0], q.shape[1], _ops.MLA_VALUE_DIM)),
            q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32))


_IMPLEMENTATIONS = {
    "moe_align_block_size": (_moe_align_block_size, _moe_align_block_size_fake),
    "fused_moe": (_fused_moe, _fused_moe_fake),
    "silu_and_mul": (_silu_and_mul, _gated_activation_fake),
    "gelu_and_mul": (_gelu_and_mul, _gated_activation_fake),
    "swiglu_oai_and_mul": (_swiglu_oai_and_mul, _gated_activation_fake),
    "moe_sum_reduce": (_moe_sum_reduce, _moe_sum_reduce_fake),
    "fused_experts": (_fused_experts, _fused_experts_fake),
    "inplace_fused_experts": (_inplace_fused_experts, _inplace_fused_experts_fake),
    "moe_lora_align_block_size": (_moe_lora_align_block_size, _moe_lora_align_block_size_fake),
    "fused_moe_lora": (_fused_moe_lora, _fused_moe_lora_fake),
    "fused_experts_lora": (_fused_experts_lora, _fused_experts_lora_fake),
    "fused_experts_quant": (_fused_experts_quant, _fused_experts_quant_fake),
    "per_token_group_quant": (_per_token_group_quant, _per_token_group_quant_fake),
    "scaled_fp8_quant": (_scaled_fp8_quant, _scaled_fp8_quant_fake),
    "scaled_int8_quant": (_scaled_int8_quant, _scaled_int8_quant_fake),
    "sparse_mla_decode": (_sparse_mla_decode, _sparse_mla_decode_fake),
}

# The layer ops that read routing ids have a "<op>_tracked" twin that takes the routing status
# word (issue 33; moelora.fused_experts(routing_status=)) as a required keyword argument the op
# mutates. Not an optional argument of the ops themselves: torch 2.11's inductor mis-lowers an
# op returning one Tensor whose optional mutable argument is None (it indexes the output:
# "getitem is not an OpOverload"), and the untracked call is the common one.
for _name in ("fused_experts", "fused_experts_lora", "fused_experts_quant"):
    _SCHEMAS[f"{_name}_tracked"] = (_SCHEMAS[_name].replace(f"{_name}(", f"{_name}_tracked(", 1)
                                    .replace(") -> Tensor", ", *, Tensor(a!) routing_status) -> Tensor"))
    _IMPLEMENTATIONS[f"{_name}_tracked"] = _IMPLEMENTATIONS[_name]

for _name, _schema in _SCHEMAS.items():
    _impl, _fake = _IMPLEMENTATIONS[_name]
    _lib.define(_schema)
    _lib.impl(_name, _impl, "CPU")
    _lib.impl(_name, _impl, "CUDA")
    _register_fake(f"moelora::{_name}", _fake, lib=_lib)
