// The fused_experts op: its argument validation, and the orchestration that runs each
// chunk's plan (fused_experts_plan.h) on the backend ops. Both backends share it.
#include <algorithm>
#include <string>

#include "api/api_util.h"
#include "api/fused_experts_plan.h"
#include "api/fused_moe.h"
#include "api/kernel_config.h"
#include "api/moe_align_block_size.h"
#include "api/moe_lora.h"
#include "api/quant_check.h"
#include "api/validate.h"
#include "common/params.h"
#include "moelora/ops.h"

namespace moelora {

using namespace detail;

namespace {

// What validation derives from the arguments: the call's shape (global and local experts,
// LoRA slots and rank), the LoRA stacks and adapter state (zero without adapters), and
// the workspace layout.
struct ValidatedCall {
  FusedExpertsShape shape;
  LoraStack lora13, lora2;
  LoraAdapterParams lora_adapters;
  WorkspaceLayout layout;
  FusedExpertsQuantParams quant;  // quantized experts: each GEMM's scheme and weight scales
};

// fused_experts' routing status word (FusedExpertsArgs::routing_status), or null.
int32_t* routing_status_word(const FusedExpertsArgs& args) {
  return args.routing_status ? static_cast<int32_t*>(args.routing_status->data) : nullptr;
}

// Checks every argument of fused_experts; throws moelora::Error naming the first bad one.
ValidatedCall validate_fused_experts(const FusedExpertsArgs& args, const FusedExpertsOptions& options) {
  const char* op = "fused_experts";
  const TensorView& x = args.hidden_states;
  float_dtype(ArgCheck(op, "hidden_states", x).rank(2).unit_stride(1));
  const Device device = x.device;
  const int64_t M = x.shape[0], H = x.shape[1];
  // Quantized experts hold the scheme's 8-bit elements; the others the layer's dtype.
  if (args.quant) check_quant_scheme(op, args.quant->scheme);
  const DType weight_dtype = args.quant ? args.quant->scheme.element : x.dtype;
  // Weight-only 4-bit experts hold two weights a byte along K.
  const QuantScheme no_scheme{};
  const QuantScheme& scheme = args.quant ? args.quant->scheme : no_scheme;
  ArgCheck(op, "w13", args.w13).rank(3).dtype(weight_dtype).on(device, "hidden_states")
      .dim(2, packed_weight_cols(scheme, H),
           scheme.weight_only() && scheme.weight_bits == 4 ? "ceil(hidden size / 2), 4-bit weights packed along K"
                                                           : "hidden size, from 'hidden_states'");
  if (args.w13.shape[1] % 2 != 0) {
    fail(op, "argument 'w13' expected an even dim 1 (2 * intermediate size), got shape " + args.w13.shape_string());
  }
  const int64_t E_local = args.w13.shape[0], I = args.w13.shape[1] / 2;
  if (E_local < 1 || E_local > kMaxNumExperts) {
    fail(op, "argument 'w13' expected 1 to " + std::to_string(kMaxNumExperts) + " experts on dim 0, got shape " +
                 args.w13.shape_string());
  }
  ArgCheck(op, "w2", args.w2).rank(3).dtype(weight_dtype).on(device, "hidden_states")
      .dim(0, E_local, "experts, from 'w13'").dim(1, H, "hidden size")
      .dim(2, packed_weight_cols(scheme, I),
           scheme.weight_only() && scheme.weight_bits == 4 ? "ceil(intermediate size / 2), 4-bit weights packed along K"
                                                           : "intermediate size, from 'w13'");
  if (scheme.weight_only()) ArgCheck(op, "w13", args.w13).unit_stride(2), ArgCheck(op, "w2", args.w2).unit_stride(2);
  FusedExpertsQuantParams quant{};
  if (args.quant) quant = check_fused_experts_quant(op, args, E_local, H, I);
  ArgCheck(op, "topk_ids", args.topk_ids).rank(2).dtype_in({DType::kInt32, DType::kInt64})
      .on(device, "hidden_states").dim(0, M, "tokens, from 'hidden_states'");
  const int64_t top_k = args.topk_ids.shape[1];
  if (top_k < 1) fail(op, "argument 'topk_ids' expected top_k >= 1, got shape " + args.topk_ids.shape_string());
  ArgCheck(op, "topk_weights", args.topk_weights).rank(2).dtype(DType::kFloat32).on(device, "hidden_states")
      .dim(0, M, "tokens").dim(1, top_k, "top_k, from 'topk_ids'");
  int64_t E_global = E_local;
  if (args.expert_map) {
    ArgCheck(op, "expert_map", *args.expert_map).rank(1).dtype(DType::kInt32).unit_stride(0)
        .on(device, "hidden_states");
    E_global = args.expert_map->shape[0];
    if (E_global < 1 || E_global > kMaxNumExperts) {
      fail(op, "argument 'expert_map' expected 1 to " + std::to_string(kMaxNumExperts) + " experts, got shape " +
                   args.expert_map->shape_string());
    }
    check_cpu_ids(op, "expert_map", *args.expert_map, -1, E_local);
  }
  check_cpu_ids(op, "topk_ids", args.topk_ids, -1, E_global);
  if (options.no_combine) {
    ArgCheck(op, "out", args.out).rank(3).same_dtype(x, "hidden_states").on(device, "hidden_states").unit_stride(2)
        .dim(0, M, "tokens").dim(1, top_k, "top_k (no_combine)").dim(2, H, "hidden size");
    if (M > 0 && top_k > 1 && args.out.strides[0] != top_k * args.out.strides[1]) {
      fail(op, "argument 'out' expected dims 0 and 1 to merge (stride0 == top_k * stride1) with no_combine, got strides [" +
                   std::to_string(args.out.strides[0]) + ", " + std::to_string(args.out.strides[1]) + ", 1]");
    }
  } else {
    ArgCheck(op, "out", args.out).rank(2).same_dtype(x, "hidden_states").on(device, "hidden_states").unit_stride(1)
        .dim(0, M, "tokens").dim(1, H, "hidden size");
  }
  check_fused_experts_options(op, options);
  // LoRA: the stacks of both GEMMs and the adapter state.
  LoraStack lora13{}, lora2{};
  detail::LoraAdapterParams lora_adapters{};
  if (args.lora) {
    lora13 = lora_stack(op, "w13_", args.lora->w13, E_local, H, 2 * I, x.dtype, device, "hidden_states");
    lora2 = lora_stack(op, "w2_", args.lora->w2, E_local, I, H, x.dtype, device, "hidden_states");
    if (lora2.num_slices != 1) {
      fail(op, "argument 'w2_num_slices' expected 1 (w2 has one output slice), got " + std::to_string(lora2.num_slices));
    }
    ArgCheck(op, "w2_lora_a[0]", args.lora->w2.lora_a[0]).dim(0, lora13.max_loras, "adapter slots, from w13_lora_a");
    // The slices of w13 follow its row order: interleaved exactly for gpt-oss's two.
    const bool interleaved13 = options.activation == Activation::kSwigluOai && lora13.num_slices == 2;
    if (args.lora->w13.interleaved_slices != interleaved13 || args.lora->w2.interleaved_slices) {
      fail(op, std::string("argument 'w13_interleaved_slices' expected ") + (interleaved13 ? "true" : "false") +
                   " (true only for swiglu_oai with two slices; w2's false), got " +
                   (args.lora->w13.interleaved_slices ? "true" : "false") + " / w2 " +
                   (args.lora->w2.interleaved_slices ? "true" : "false"));
    }
    lora_adapters = lora_adapter_params(op, args.lora->adapters, M, lora13.max_loras, device, "hidden_states");
  }

  FusedExpertsShape shape{M, top_k, E_global, H, I, x.dtype, E_local};
  if (args.quant) shape.quant = args.quant->scheme;
  if (args.lora) {
    shape.max_loras = lora13.max_loras;
    shape.lora_rank = std::max(lora13.rank, lora2.rank);
  }
  check_fused_experts_shape(op, shape);
  WorkspaceLayout layout = workspace_layout(shape, options);
  ArgCheck(op, "workspace", args.workspace).rank(1).on(device, "hidden_states").unit_stride(0);
  const int64_t workspace_bytes = args.workspace.numel() * int64_t(dtype_size(args.workspace.dtype));
  if (workspace_bytes < layout.total && layout.weight_only_copies) {
    // The weight-only copies are a speed-up, not a need: a workspace without room for them
    // (e.g. sized by fused_experts_workspace_size for a larger call whose chunks run the
    // sm90 tiles) runs the chunks that would read them on the aligned kernels.
    const WorkspaceLayout lean = workspace_layout(shape, options, /*with_copies=*/false);
    if (workspace_bytes < lean.total) {
      fail(op, "argument 'workspace' expected at least " + std::to_string(lean.total) + " bytes (" +
                   std::to_string(layout.total) + " with room for the dequantized experts: " +
                   "fused_experts_workspace_size), got " + std::to_string(workspace_bytes));
    }
    layout = lean;
  }
  if (workspace_bytes < layout.total) {
    fail(op, "argument 'workspace' expected at least " + std::to_string(layout.total) +
                 " bytes (fused_experts_workspace_size), got " + std::to_string(workspace_bytes));
  }
  if (reinterpret_cast<uintptr_t>(args.workspace.data) % 256 != 0) {
    fail(op, "argument 'workspace' expected a 256-byte aligned pointer, got an unaligned one");
  }
  // out may be hidden_states itself (in place: then the workspace's check against out
  // covers it); nothing else it writes aliases what it reads.
  const bool inplace = detail::same_view(args.out, x);
  NamedViews read = {{inplace ? nullptr : &x, "hidden_states"}, {&args.w13, "w13"}, {&args.w2, "w2"},
                     {&args.topk_ids, "topk_ids"}, {&args.topk_weights, "topk_weights"},
                     {args.expert_map, "expert_map"}};
  if (args.quant) {
    const FusedExpertsQuant& q = *args.quant;
    for (const NamedView& v : {NamedView{&q.w13_scale, "w13_scale"}, NamedView{&q.w2_scale, "w2_scale"},
                               NamedView{q.a13_scale, "a13_scale"}, NamedView{q.a2_scale, "a2_scale"},
                               NamedView{q.w13_zero, "w13_zero"}, NamedView{q.w2_zero, "w2_zero"}}) {
      read.add(v.first, v.second);
    }
  }
  if (args.lora) {
    append_lora_reads(args.lora->adapters, read);
    append_lora_reads(args.lora->w13, "w13_lora_a", "w13_lora_b", read);
    append_lora_reads(args.lora->w2, "w2_lora_a", "w2_lora_b", read);
  }
  if (args.routing_status) {
    ArgCheck(op, "routing_status", *args.routing_status).rank(1).dtype(DType::kInt32).on(device, "hidden_states")
        .dim(0, 1, "one status word");
  }
  lora_adapters.routing_status = routing_status_word(args);
  check_disjoint_writes(op, {{&args.out, "out"}, {&args.workspace, "workspace"}, {args.routing_status, "routing_status"}},
                        read);
  if (on_cuda(x)) require_cuda_backend(op);
  return ValidatedCall{shape, lora13, lora2, lora_adapters, layout, quant};
}

// Quantizes a chunk's rows input [rows, cols] into out [rows, cols] and scales, with the
// plan's activation blocks (per token group, per row, or per tensor over the chunk; the
// caller's static scale when static_scales).
void quantize_rows(const TensorView& input, const TensorView& out, const TensorView& scales,
                   const FusedExpertsChunkPlan& plan, bool static_scales, Device device, Stream stream) {
  run_quantize(quantize_params(QuantizeArgs{input, out, scales, plan.quant_block_rows, plan.quant_block_cols,
                                            static_scales}),
               device, stream);
}

// An alignment of fused_experts' ids: its kernels also report bad ids and expert_map
// values into the routing status word.
AlignParams routed(AlignParams p, const FusedExpertsArgs& args) {
  p.routing_status = routing_status_word(args);
  p.num_local_experts = args.w13.shape[0];
  return p;
}

#ifdef MOELORA_WITH_CUDA
// The small-batch kernels' parameters for one chunk: x_chunk, ids and weights are the
// chunk's rows; act is GEMM1's output in the workspace, out_chunk the chunk's first row.
detail::SmallBatchMoeParams small_batch_params(const FusedExpertsArgs& args, const FusedExpertsOptions& options,
                                               const TensorView& x_chunk, const TensorView& ids,
                                               const TensorView& weights, void* act, void* out_chunk,
                                               int64_t num_experts, detail::ActivationKind kind) {
  return detail::SmallBatchMoeParams{
      .dtype = x_chunk.dtype,
      .x = x_chunk.data,
      .x_stride_token = x_chunk.strides[0],
      .w13 = args.w13.data,
      .w13_stride_expert = args.w13.strides[0],
      .w13_stride_n = args.w13.strides[1],
      .w13_stride_k = args.w13.strides[2],
      .w2 = args.w2.data,
      .w2_stride_expert = args.w2.strides[0],
      .w2_stride_n = args.w2.strides[1],
      .w2_stride_k = args.w2.strides[2],
      .topk_ids = ids.data,
      .topk_ids_int64 = ids.dtype == DType::kInt64,
      .topk_ids_stride_token = ids.strides[0],
      .topk_ids_stride_k = ids.strides[1],
      .topk_weights = static_cast<const float*>(weights.data),
      .topk_weights_stride_token = weights.strides[0],
      .topk_weights_stride_k = weights.strides[1],
      .expert_map = args.expert_map ? static_cast<const int32_t*>(args.expert_map->data) : nullptr,
      .num_tokens = x_chunk.shape[0],
      .top_k = ids.shape[1],
      .num_experts = num_experts,
      .num_local_experts = args.w13.shape[0],
      .H = x_chunk.shape[1],
      .I = args.w13.shape[1] / 2,  // (w2.shape[2] is I / 2 for packed 4-bit weights)
      .act = act,
      .out = out_chunk,
      .out_stride_token = args.out.strides[0],
      .out_stride_k = options.no_combine ? args.out.strides[1] : 0,
      .no_combine = options.no_combine,
      .router_weight_on_input = options.apply_router_weight_on_input,
      .routed_scaling_factor = options.routed_scaling_factor,
      .activation = kind,
      .alpha = options.swiglu_alpha,
      .limit = options.swiglu_limit,
      .routing_status = routing_status_word(args),
  };
}

// The grouped path of one chunk (FusedExpertsChunkPlan::grouped), after x's quantization
// by token (W8A8 experts): the alignment in blocks of 16 with per-expert offsets and sizes,
// the GEMMs' device arrays, x's rows (and scales) gathered into expert order (and each
// slot's entry noted), GEMM1, the activation by entry (quantized, or rounded to the layer
// dtype for 16-bit experts), GEMM2, and the weighted top-k sum through the entries.
// With adapters (16-bit experts) `align` is the segmented alignment, and
// add_lora(gemm, a, K, d, N, activation) adds each GEMM's delta into its output rows
// d [entries, N] from its input rows a [entries, K], both by entry; for GEMM1 it also runs
// `activation` (the delta then joins GEMM1's rows on their way through it).
template <class AddLora>
void run_grouped_chunk(const FusedExpertsChunkPlan& plan, const FusedExpertsArgs& args,
                       const FusedExpertsOptions& options, ActivationKind kind, AlignParams align, AddLora&& add_lora,
                       Stream stream) {
  const GroupedExpertsParams& g = plan.grouped_params;
  // The GEMMs' operands: W8A8's quantized rows and scales, or the layer dtype's rows.
  const QuantScheme* scheme = plan.quantized ? &args.quant->scheme : nullptr;
  const DType element = scheme ? scheme->element : g.dtype;
  const ScaleGranularity activation_scales = scheme ? scheme->activation_scales : ScaleGranularity::kTensor;
  const TensorView& x_rows = scheme ? plan.x_quantized : plan.x;
  const Device device = args.hidden_states.device;
  const int64_t H = g.H, I = g.I, top_k = plan.topk_ids.shape[1];
  const int64_t entries = plan.capacity.max_num_tokens_padded;
  const auto* sorted = static_cast<const int32_t*>(plan.sorted_token_ids.data);
  const auto* ntpp = static_cast<const int32_t*>(plan.num_tokens_post_padded.data);
  align.group_entry_offsets = g.group_entry_offsets;
  align.group_sizes = g.group_sizes;
  run_align(align, device, stream);
  cuda::grouped_experts_args(g, stream);
  // x's rows by entry, and their scales (none to gather for one tensor scale).
  cuda::moe_gather_sorted_rows(
      GatherRowsParams{.dtype = element, .input = x_rows.data,
                       .input_stride_row = x_rows.strides[0], .out = g.a, .out_stride_row = H,
                       .sorted_token_ids = sorted, .num_tokens_post_padded = ntpp, .max_num_tokens_padded = entries,
                       .num_slots = plan.slots, .top_k = top_k, .width = H, .slot_entries = plan.slot_entries,
                       .expert_ids = static_cast<const int32_t*>(plan.expert_ids.data),
                       .block_size = plan.block_size},
      stream);
  if (scheme && activation_scales != ScaleGranularity::kTensor) {
    const int64_t scale_cols = plan.x_scales.shape[1];
    cuda::moe_gather_sorted_rows(
        GatherRowsParams{.dtype = DType::kFloat32, .input = plan.x_scales.data,
                         .input_stride_row = plan.x_scales.strides[0], .out = g.a_scales, .out_stride_row = scale_cols,
                         .sorted_token_ids = sorted, .num_tokens_post_padded = ntpp, .max_num_tokens_padded = entries,
                         .num_slots = plan.slots, .top_k = top_k, .width = scale_cols},
        stream);
  }
  cuda::grouped_experts_gemm(g, 1, stream);
  const bool tensor = activation_scales == ScaleGranularity::kTensor;
  const ActivationQuantizeParams activation{
      .dtype = g.dtype, .kind = kind, .alpha = options.swiglu_alpha, .limit = options.swiglu_limit, .input = g.d,
      .element = element, .out = g.a, .granularity = activation_scales,
      .scales = !scheme ? nullptr : tensor ? const_cast<float*>(g.act_tensor_scale) : g.a_scales,
      .static_scale = scheme && scheme->static_activation_scales, .amax = g.act_amax, .sorted_token_ids = sorted,
      .expert_ids = static_cast<const int32_t*>(plan.expert_ids.data), .num_tokens_post_padded = ntpp,
      .max_num_tokens_padded = entries, .num_slots = plan.slots, .block_size = plan.block_size, .width = I};
  if (args.lora) {
    add_lora(1, g.a, H, g.d, 2 * I, &activation);
  } else {
    cuda::moe_activation_quantize(activation, stream);
  }
  cuda::grouped_experts_gemm(g, 2, stream);
  if (args.lora) add_lora(2, g.a, I, g.d, H, nullptr);
  const TensorView& weights = plan.topk_weights;
  cuda::moe_sum_reduce(SumReduceParams{.dtype = g.dtype, .input = g.d, .input_stride_token = 0, .input_stride_k = H,
                                       .out = plan.out, .out_stride_token = args.out.strides[0],
                                       .num_tokens = plan.tokens, .top_k = top_k, .hidden = H,
                                       .scale = options.routed_scaling_factor, .slot_entries = plan.slot_entries,
                                       .topk_weights = static_cast<const float*>(weights.data),
                                       .topk_weights_stride_token = weights.strides[0],
                                       .topk_weights_stride_k = weights.strides[1]},
                       stream);
}
#endif

}  // namespace

void fused_experts(const FusedExpertsArgs& call_args, const FusedExpertsOptions& options, Stream stream) {
  const ValidatedCall call = validate_fused_experts(call_args, options);
  const FusedExpertsShape& shape = call.shape;
  const LoraStack& lora13 = call.lora13;
  const LoraStack& lora2 = call.lora2;
  const WorkspaceLayout& layout = call.layout;
  const TensorView& x = call_args.hidden_states;
  const int64_t M = shape.num_tokens;
  if (M == 0) return;
  // The arguments the kernels read: the caller's, but for weight-only experts on the dense
  // path, w13 and w2 as 16-bit experts: the chunks plan on them. The sm90 tiles read the
  // packed experts (plan.weight_only_tiles); a chunk on the copies (plan.weight_only_copies)
  // has them dequantized into the workspace once a call. Without copies in the layout the
  // views carry shapes only: no data (nothing reads them; a chunk without tiles then runs
  // the aligned kernels on the packed experts).
  FusedExpertsArgs args = call_args;
  const bool weight_only = call_args.quant && call_args.quant->scheme.weight_only();
  [[maybe_unused]] bool dense_written = false;  // CUDA builds only
  auto write_dense_experts = [&]() {
#ifdef MOELORA_WITH_CUDA
    if (dense_written) return;
    const int64_t E = shape.num_local_experts, H = shape.hidden_size, I = shape.intermediate_size;
    cuda::dequantize_experts(DequantizeExpertsParams{call.quant.w13, x.dtype, args.w13.data, E, 2 * I, H}, stream);
    cuda::dequantize_experts(DequantizeExpertsParams{call.quant.w2, x.dtype, args.w2.data, E, H, I}, stream);
    dense_written = true;
#endif
  };
  if (weight_only && layout.weight_only_dense && on_cuda(x)) {
    const int64_t E = shape.num_local_experts, H = shape.hidden_size, I = shape.intermediate_size;
    void* ws = call_args.workspace.data;
    args.w13 = TensorView::contiguous(layout.weight_only_copies ? byte_offset(ws, layout.dense_w13) : nullptr, x.dtype,
                                      {E, 2 * I, H}, x.device);
    args.w2 = TensorView::contiguous(layout.weight_only_copies ? byte_offset(ws, layout.dense_w2) : nullptr, x.dtype,
                                     {E, H, I}, x.device);
  }
  // CPU: the GEMMs read the packed weights themselves.
  const bool cpu_weight_only = weight_only && !on_cuda(x);
  auto with_packed_weights = [&](GemmParams& g, const WeightOnlyParams& w, int64_t K) {
    g.weight_only = w;
    g.K = K;  // w's packed bytes otherwise
  };

  const Device device = x.device;
  const DType dtype = x.dtype;
  const int64_t top_k = shape.top_k, H = shape.hidden_size, I = shape.intermediate_size;
  const int64_t E_local = shape.num_local_experts, E_global = shape.num_experts;
  void* ws = args.workspace.data;
  const int64_t chunk = std::max<int64_t>(options.chunk_size, 1);
  int32_t* block_lora_ids = args.lora ? static_cast<int32_t*>(byte_offset(ws, layout.block_lora_ids)) : nullptr;
  int32_t* entry_lora_ids = args.lora ? static_cast<int32_t*>(byte_offset(ws, layout.entry_lora_ids)) : nullptr;
  uint64_t* block_lora_masks = args.lora ? static_cast<uint64_t*>(byte_offset(ws, layout.block_lora_masks)) : nullptr;
  int32_t* lora_shrink_counters =
      args.lora ? static_cast<int32_t*>(byte_offset(ws, layout.lora_shrink_counters)) : nullptr;
  int32_t* tile_counters =
      on_cuda(x) && options.ordered_tiles ? static_cast<int32_t*>(byte_offset(ws, layout.tile_counters)) : nullptr;
  const ActivationKind kind = options.activation == Activation::kSilu   ? ActivationKind::kSiluAndMul
                              : options.activation == Activation::kGelu ? ActivationKind::kGeluAndMul
                                                                        : ActivationKind::kSwigluOai;
  // gpt-oss keeps gate and up interleaved in w13's rows: the slices follow.
  const bool interleaved13 = options.activation == Activation::kSwigluOai && lora13.num_slices == 2;

  for (int64_t begin = 0; begin < M; begin += chunk) {
    const FusedExpertsChunkPlan plan =
        plan_fused_experts_chunk(args, options, shape, layout, lora13, lora2, call.quant, begin, std::min(chunk, M - begin));
    const MoeKernelConfig& config = plan.config;
    const int64_t tokens = plan.tokens, slots = plan.slots, block_size = plan.block_size;
    const AlignCapacity& cap = plan.capacity;
    const TensorView& x_chunk = plan.x;
    const TensorView& ids = plan.topk_ids;
    const TensorView& weights = plan.topk_weights;
    const TensorView& sorted_chunk = plan.sorted_token_ids;
    const TensorView& expert_chunk = plan.expert_ids;
    const TensorView& ntpp = plan.num_tokens_post_padded;
    const TensorView& cache2 = plan.cache2;
    LoraAdapterParams chunk_adapters = call.lora_adapters;
    if (args.lora) chunk_adapters.token_lora_ids += begin * chunk_adapters.token_lora_ids_stride;
    // The LoRA delta of one GEMM of this chunk, added into its output rows (by slot)
    // before what follows reads them.
    auto add_lora_delta = [&](const LoraStack& st, bool interleaved, const TensorView& a, int64_t a_top_k,
                              const TensorView& gemm_out, bool weighted, bool aligned, bool add_inputs) {
      LoraDelta delta(st, interleaved, a, a_top_k, E_local, gemm_out, add_inputs, weighted ? &weights : nullptr,
                      chunk_adapters, ids, args.expert_map, E_global, byte_offset(ws, layout.lora_intermediate));
      // Slots from the chunk's virtual alignment, or one by one from topk_ids.
      if (aligned) {
        delta.with_blocks(static_cast<const int32_t*>(sorted_chunk.data), cap.max_num_tokens_padded,
                          static_cast<const int32_t*>(expert_chunk.data), block_lora_ids, cap.max_num_blocks,
                          static_cast<const int32_t*>(ntpp.data), block_size);
      }
      run_lora_delta(delta.p, device, stream);
    };
    // The delta of one GEMM on the segmented alignment: its shrink over the chunk's LoRA
    // blocks into the intermediate by entry (scaled), from a's rows (by entry, or slot /
    // a_top_k); `out` receives the expand where moe_lora_expand_entries adds it.
    auto segmented_delta = [&](const LoraStack& st, bool interleaved, const TensorView& a, int64_t a_top_k,
                               bool a_rows_by_entry, const TensorView& out) {
      LoraDelta delta(st, interleaved, a, a_top_k, E_local, out, /*add_inputs=*/true, nullptr, chunk_adapters, ids,
                      args.expert_map, E_global, byte_offset(ws, layout.lora_intermediate));
      delta.with_blocks(static_cast<const int32_t*>(sorted_chunk.data), cap.max_num_tokens_padded,
                        static_cast<const int32_t*>(expert_chunk.data), nullptr, cap.max_num_blocks,
                        static_cast<const int32_t*>(ntpp.data), block_size);
      delta.p.entry_lora_ids = entry_lora_ids;
      delta.p.block_lora_masks = block_lora_masks;
      delta.p.shrink_partials = static_cast<float*>(byte_offset(ws, layout.lora_shrink_partials));
      delta.p.shrink_partial_rows = layout.lora_shrink_partial_rows;
      delta.p.segmented_entries = align_capacity(slots, block_size, E_global).max_num_tokens_padded;
      delta.p.shrink_counters = lora_shrink_counters;
      delta.p.a_rows_by_entry = a_rows_by_entry;
      return delta;
    };
    // The fused path: GEMM g's shrink, then g takes the expand in its K loop.
    auto with_fused_lora = [&](GemmParams& g, const LoraStack& st, bool interleaved, const TensorView& a,
                               int64_t a_top_k, bool a_rows_by_entry) {
      void* lora_t = byte_offset(ws, layout.lora_intermediate);
      [[maybe_unused]] const LoraDelta shrink = segmented_delta(st, interleaved, a, a_top_k, a_rows_by_entry, a);
#ifdef MOELORA_WITH_CUDA
      cuda::moe_lora_shrink(shrink.p, stream);
#endif
      g.lora_t = lora_t;
#ifdef MOELORA_WITH_CUDA
      // The sm80 tiles wait for the shrink only before their first LoRA K step
      // (GemmParams::lora_late_wait); the other tile kernels ignore it.
      g.lora_late_wait = cuda::late_waits_enabled();
#endif
      g.block_lora_masks = block_lora_masks;
      g.entry_lora_ids = entry_lora_ids;
      g.lora_t_cols = st.num_slices * st.rank;
      g.lora_rank = st.rank;
      g.lora_slices = st.num_slices;
      g.lora[0] = st.slices[0];
      g.lora[1] = st.slices[1];
    };
    // The weighted top-k sum of GEMM2's rows by slot (gemm2_out: cache3) into `out`, unless
    // GEMM2 wrote `out` itself (direct).
    auto reduce_slots = [&]() {
      if (plan.direct) return;
      run_sum_reduce(SumReduceParams{.dtype = dtype, .input = plan.gemm2_out.data, .input_stride_token = top_k * H,
                                     .input_stride_k = H, .out = plan.out, .out_stride_token = args.out.strides[0],
                                     .num_tokens = tokens, .top_k = top_k, .hidden = H,
                                     .scale = options.routed_scaling_factor},
                     device, stream);
    };
    // The chunk's alignment: by expert, or with adapters by (expert, adapter) group, either
    // padded per group (block_lora_ids: the delta kernels' tiles) or segmented (padded where
    // an expert ends, the blocks of the plain expert alignment with their adapters' runs:
    // the fused and grouped paths, whose base GEMMs then see no per-adapter padding).
    auto chunk_alignment = [&](bool segmented) {
      AlignParams align =
          routed(align_params(ids, block_size, E_global, args.expert_map, sorted_chunk, expert_chunk, ntpp), args);
      if (args.lora) {
        align.max_loras = lora13.max_loras;
        align.token_lora_ids = chunk_adapters.token_lora_ids;
        align.token_lora_ids_stride = chunk_adapters.token_lora_ids_stride;
        align.adapter_enabled = chunk_adapters.adapter_enabled;
        if (segmented) {
          align.entry_lora_ids = entry_lora_ids;
          align.block_lora_masks = block_lora_masks;
          align.lora_shrink_counters = lora_shrink_counters;
        } else {
          align.block_lora_ids = block_lora_ids;
        }
      }
      return align;
    };
    // Quantized experts: x's rows quantized first; each GEMM's scales point at its input's.
    GemmQuantParams quant1 = call.quant.gemm1, quant2 = call.quant.gemm2;
    const bool static_scales = args.quant && args.quant->scheme.static_activation_scales;
    if (plan.quantized) {
      quantize_rows(x_chunk, plan.x_quantized, plan.x_scales, plan, static_scales, device, stream);
      quant1.a_scale = static_cast<const float*>(plan.x_scales.data);
      quant1.a_scale_stride_row = plan.x_scales.strides[0];
      quant1.a_scale_stride_k = plan.x_scales.strides[1];
      quant2.a_scale = static_cast<const float*>(plan.act_scales.data);
      quant2.a_scale_stride_row = plan.act_scales.strides[0];
      quant2.a_scale_stride_k = plan.act_scales.strides[1];
    }
    // GEMM2's input: the activation (cache2), quantized into act_quantized for quantized experts.
    auto gemm2_input = [&]() -> const TensorView& {
      if (!plan.quantized) return cache2;
      quantize_rows(cache2, plan.act_quantized, plan.act_scales, plan, static_scales, device, stream);
      return plan.act_quantized;
    };
    // The GEMMs read the packed experts (CPU, or the sm90 kernel), else their dense copies.
    const bool packed_gemms = cpu_weight_only || plan.weight_only_tiles;
    if (plan.weight_only_copies) write_dense_experts();
#ifdef MOELORA_WITH_CUDA
    if (plan.grouped) {
      // Adapters: each GEMM's delta on the segmented alignment, added into its rows by entry.
      // GEMM1's shrink reads x by token rather than GEMM1's gathered rows: x is top_k times
      // smaller and stays in L2 while the entries revisit its tokens (Qwen3-30B M = 4096:
      // 16 MB against 134 MB), where the gathered rows were evicted by GEMM1's own traffic.
      auto add_lora = [&](int gemm, void* a, int64_t K, void* d, int64_t N, const ActivationQuantizeParams* activation) {
        const int64_t entries = cap.max_num_tokens_padded;
        const LoraDelta delta =
            gemm == 1 ? segmented_delta(lora13, interleaved13, x_chunk, top_k, /*a_rows_by_entry=*/false,
                                        view2d(d, dtype, entries, N, N, 1, device))
                      : segmented_delta(lora2, false, view2d(a, dtype, entries, K, K, 1, device), 1,
                                        /*a_rows_by_entry=*/true, view2d(d, dtype, entries, N, N, 1, device));
        cuda::moe_lora_shrink(delta.p, stream);
        if (activation && cuda::lora_expand_activation_enabled()) {
          cuda::moe_lora_expand_activation(delta.p, *activation, stream);
        } else {
          cuda::moe_lora_expand_entries(delta.p, stream);
          if (activation) cuda::moe_activation_quantize(*activation, stream);
        }
      };
      run_grouped_chunk(plan, args, options, kind, chunk_alignment(/*segmented=*/true), add_lora, stream);
      continue;
    }
    if (plan.small_batch) {
      SmallBatchMoeParams small =
          small_batch_params(args, options, x_chunk, ids, weights, cache2.data, plan.out, E_global, kind);
      if (plan.weight_only) {
        small.w13q = call.quant.w13;
        small.w2q = call.quant.w2;
        // The layout has no dense experts: the decode kernels must take the chunk.
        if (!cuda::fused_experts_small_batch_supported(small)) {
          fail("fused_experts", "argument 'hidden_states' expected 16-byte aligned rows (strides multiples of 8) for " +
                                    std::string(quant_method_name(call_args.quant->scheme.method)) +
                                    " experts at this batch size, got stride " + std::to_string(x.strides[0]));
        }
      }
      if (plan.quantized) {
        small.x = plan.x_quantized.data;
        small.x_stride_token = plan.x_quantized.strides[0];
        small.quant13 = quant1;
        small.quant2 = quant2;
        small.act_quantized = plan.act_quantized.data;
      }
      // A chunk the kernels do not take (see SmallBatchMoeParams) runs the aligned path.
      if (cuda::fused_experts_small_batch_supported(small)) {
        if (!args.lora && !plan.quantized) {
          cuda::fused_experts_small_batch(small, stream);
          continue;
        }
        if (!args.lora) {
          cuda::fused_experts_small_batch(small, stream, /*stages=*/1);
          gemm2_input();
          cuda::fused_experts_small_batch(small, stream, /*stages=*/2);
          continue;
        }
        // With adapters: each GEMM's delta per slot (no alignment) into the cache1/cache3
        // region, added by the kernels before the activation and the routed weight.
        // NOTE: GEMM2's delta overwrites GEMM1's after GEMM1 has read it (stream order).
        SmallBatchMoeParams with_lora = small;
        // The delta kernels let the GEMMs launch once past their own waits (the expand at
        // entry), and the 16-bit GEMMs wait only where they first read a delta, CTA 0 on
        // every path: the weight streaming runs beside the delta kernels (H200, LoRA r16
        // M = 1: 2-7% faster, reports/gpu/2026-11-29-h200-issue31-patches-ab.txt). The W8A8
        // GEMM2 reads the quantized activation up front, so it waits.
        with_lora.late_delta_wait = !plan.quantized && cuda::late_waits_enabled();
        const TensorView& delta13 = plan.cache1;
        const TensorView& delta2 = plan.cache3;
        const TensorView act = view2d(cache2.data, dtype, slots, I, I, 1, device);
        add_lora_delta(lora13, interleaved13, x_chunk, top_k, delta13, false, /*aligned=*/false, /*add_inputs=*/false);
        with_lora.gate_up_delta = delta13.data;
        cuda::fused_experts_small_batch(with_lora, stream, /*stages=*/1);
        add_lora_delta(lora2, false, act, 1, delta2, false, /*aligned=*/false, /*add_inputs=*/false);
        with_lora.down_delta = delta2.data;
        gemm2_input();
        cuda::fused_experts_small_batch(with_lora, stream, /*stages=*/2);
        continue;
      }
    }
    if (plan.weight_only_aligned) {
      // Weight-only experts past the decode kernels: the alignment in blocks of 16, GEMM1
      // into cache2 by slot, GEMM2's weighted rows into gemm2_out (cache3, or `out` when
      // direct), then the top-k sum. With adapters, each GEMM's delta per slot first, as
      // the decode path takes them (GEMM2's in gemm2_out itself, which it reads in place).
      run_align(routed(align_params(ids, block_size, E_global, args.expert_map, sorted_chunk, expert_chunk, ntpp), args),
                device, stream);
      WeightOnlyAlignedParams aligned{
          .moe = small_batch_params(args, options, x_chunk, ids, weights, cache2.data, plan.out, E_global, kind),
          .sorted_token_ids = static_cast<const int32_t*>(sorted_chunk.data),
          .expert_ids = static_cast<const int32_t*>(expert_chunk.data),
          .num_tokens_post_padded = static_cast<const int32_t*>(ntpp.data),
          .max_num_blocks = cap.max_num_blocks,
          .down_out = plan.gemm2_out.data,
          .down_out_stride_slot = plan.gemm2_out.strides[0]};
      aligned.moe.w13q = call.quant.w13;
      aligned.moe.w2q = call.quant.w2;
      if (args.lora) {
        add_lora_delta(lora13, interleaved13, x_chunk, top_k, plan.cache1, false, /*aligned=*/false,
                       /*add_inputs=*/false);
        aligned.moe.gate_up_delta = plan.cache1.data;
      }
      cuda::fused_experts_weight_only_aligned(aligned, stream, 1);
      if (args.lora) {
        add_lora_delta(lora2, false, view2d(cache2.data, dtype, slots, I, I, 1, device), 1, plan.gemm2_out, false,
                       /*aligned=*/false, /*add_inputs=*/false);
        aligned.moe.down_delta = plan.gemm2_out.data;
      }
      cuda::fused_experts_weight_only_aligned(aligned, stream, 2);
      reduce_slots();
      continue;
    }
#endif
    AlignParams align = chunk_alignment(plan.fused_lora);
    align.tile_counters = tile_counters;
    align.num_tile_counters = tile_counters ? kNumTileCounters : 0;
    run_align(align, device, stream);
    const TensorView* gemm1_weights = options.apply_router_weight_on_input ? &weights : nullptr;
    if (plan.fused_activation) {
      // GEMM1 + activation: cache2[s] = act(x[s / top_k] · w13[e]ᵀ)   [slots, I]
      TensorView gemm1_input = x_chunk;
      if (plan.sorted_input) {
        gemm1_input = plan.x_sorted;
#ifdef MOELORA_WITH_CUDA
        cuda::moe_gather_sorted_rows(
            GatherRowsParams{.dtype = dtype, .input = x_chunk.data, .input_stride_row = x_chunk.strides[0],
                             .out = gemm1_input.data, .out_stride_row = H,
                             .sorted_token_ids = static_cast<const int32_t*>(sorted_chunk.data),
                             .num_tokens_post_padded = static_cast<const int32_t*>(ntpp.data),
                             .max_num_tokens_padded = cap.max_num_tokens_padded, .num_slots = slots,
                             .top_k = top_k, .width = H},
            stream);
#endif
      }
      if (plan.quantized) gemm1_input = plan.x_quantized;
      GemmParams gemm1 = gemm_params(gemm1_input, args.w13, cache2, sorted_chunk, expert_chunk, ntpp, gemm1_weights,
                                     top_k, block_size, config.gemm1);
      gemm1.quant = quant1;
      if (packed_gemms) with_packed_weights(gemm1, call.quant.w13, H);
      gemm1.a_rows_sorted = plan.sorted_input;
      gemm1.N = I;
      gemm1.num_slots = slots;  // the padding sentinel, whatever rows cache2 has
      gemm1.out_rows_sorted = plan.sorted_activation;
      gemm1.gated = true;
      gemm1.activation = kind;
      gemm1.alpha = options.swiglu_alpha;
      gemm1.limit = options.swiglu_limit;
      gemm1.tile_counter = config.gemm1.ordered ? tile_counters : nullptr;
      if (plan.fused_lora) with_fused_lora(gemm1, lora13, interleaved13, x_chunk, top_k, false);
      run_gemm(gemm1, device, stream);
    } else {
      // GEMM1: cache1[s] = x[s / top_k] · w13[e]ᵀ   [slots, 2I]; then cache2 = act(cache1)   [slots, I]
      const TensorView& cache1 = plan.cache1;
      GemmParams gemm1 = gemm_params(plan.quantized ? plan.x_quantized : x_chunk, args.w13, cache1, sorted_chunk,
                                     expert_chunk, ntpp, gemm1_weights, top_k, block_size, config.gemm1);
      gemm1.quant = quant1;
      if (packed_gemms) with_packed_weights(gemm1, call.quant.w13, H);
      gemm1.tile_counter = config.gemm1.ordered ? tile_counters : nullptr;
      run_gemm(gemm1, device, stream);
      if (args.lora) {
        add_lora_delta(lora13, interleaved13, x_chunk, top_k, cache1, options.apply_router_weight_on_input,
                       /*aligned=*/true, /*add_inputs=*/true);
      }
      run_activation(ActivationParams{.dtype = cache1.dtype, .out_dtype = dtype, .kind = kind, .input = cache1.data,
                                      .input_stride_row = 2 * I, .out = cache2.data, .out_stride_row = I,
                                      .num_rows = slots, .width = I, .alpha = options.swiglu_alpha,
                                      .limit = options.swiglu_limit},
                     device, stream);
    }

    // GEMM2 into plan.gemm2_out: `out` itself when direct, else cache3 for the reduction.
    const TensorView* gemm2_weights = options.apply_router_weight_on_input ? nullptr : &weights;
    const TensorView& cache3 = plan.gemm2_out;
    GemmParams gemm2 = gemm_params(gemm2_input(), args.w2, cache3, sorted_chunk, expert_chunk, ntpp, gemm2_weights, 1,
                                   block_size, config.gemm2);
    gemm2.quant = quant2;
    if (packed_gemms) with_packed_weights(gemm2, call.quant.w2, I);
    gemm2.tile_counter = tile_counters && config.gemm2.ordered ? tile_counters + 1 : nullptr;
    gemm2.a_rows_sorted = plan.sorted_activation;
    if (plan.fused_lora) with_fused_lora(gemm2, lora2, false, cache2, 1, plan.sorted_activation);
    run_gemm(gemm2, device, stream);
    if (args.lora && !plan.fused_lora) {
      add_lora_delta(lora2, false, cache2, 1, cache3, !options.apply_router_weight_on_input, /*aligned=*/true,
                     /*add_inputs=*/true);
    }

    reduce_slots();
  }
}

bool cuda_available() {
#ifdef MOELORA_WITH_CUDA
  return cuda::device_available();
#else
  return false;
#endif
}

}  // namespace moelora
