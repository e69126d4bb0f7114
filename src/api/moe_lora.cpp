// The LoRA validation of moe_lora.h, and the fused_moe_lora op with its workspace query.
#include "api/moe_lora.h"

#include <algorithm>
#include <string>

#include "api/api_util.h"
#include "api/validate.h"

namespace moelora {

using namespace detail;

// ---------------------------------------------------------------------------------
// LoRA: shared validation of the adapter state and the stacks.
namespace detail {

void check_max_loras(const char* op, int64_t max_loras) {
  if (max_loras < 1 || max_loras > kMaxLoraAdapters) {
    fail(op, "argument 'max_loras' expected a value in [1, " + std::to_string(kMaxLoraAdapters) + "], got " +
                 std::to_string(max_loras));
  }
}

// token_lora_ids [num_tokens] int32 (CPU: values in [-1, max_loras)), adapter_enabled and
// adapter_scale [max_loras].
LoraAdapterParams lora_adapter_params(const char* op, const MoeLoraAdapters& a, int64_t num_tokens,
                                      int64_t max_loras, const Device& device, const char* device_of) {
  ArgCheck(op, "token_lora_ids", a.token_lora_ids).rank(1).dtype(DType::kInt32).on(device, device_of)
      .dim(0, num_tokens, "tokens");
  if (a.adapter_enabled) {
    ArgCheck(op, "adapter_enabled", *a.adapter_enabled).rank(1).dtype(DType::kInt32).unit_stride(0)
        .on(device, device_of).dim(0, max_loras, "adapter slots");
  }
  if (a.adapter_scale) {
    ArgCheck(op, "adapter_scale", *a.adapter_scale).rank(1).dtype(DType::kFloat32).unit_stride(0)
        .on(device, device_of).dim(0, max_loras, "adapter slots");
  }
  check_cpu_ids(op, "token_lora_ids", a.token_lora_ids, -1, max_loras);
  return LoraAdapterParams{
      .token_lora_ids = static_cast<const int32_t*>(a.token_lora_ids.data),
      .token_lora_ids_stride = a.token_lora_ids.strides[0],
      .adapter_enabled = a.adapter_enabled ? static_cast<const int32_t*>(a.adapter_enabled->data) : nullptr,
      .adapter_scale = a.adapter_scale ? static_cast<const float*>(a.adapter_scale->data) : nullptr,
      .max_loras = max_loras,
  };
}

LoraStack lora_stack(const char* op, const std::string& name, const MoeLoraWeights& w, int64_t num_experts,
                     int64_t K, int64_t N, DType dtype, const Device& device, const char* device_of) {
  if (w.num_slices != 1 && w.num_slices != 2) {
    fail(op, "argument '" + name + "num_slices' expected 1 or 2, got " + std::to_string(w.num_slices));
  }
  if (N % w.num_slices != 0) {
    fail(op, "argument '" + name + "num_slices' expected to divide the GEMM's " + std::to_string(N) +
                 " output columns, got " + std::to_string(w.num_slices));
  }
  LoraStack st{};
  st.num_slices = w.num_slices;
  st.N_slice = N / w.num_slices;
  for (int c = 0; c < w.num_slices; ++c) {
    const std::string a_name = name + "lora_a[" + std::to_string(c) + "]";
    const std::string b_name = name + "lora_b[" + std::to_string(c) + "]";
    const TensorView& la = w.lora_a[c];
    const TensorView& lb = w.lora_b[c];
    ArgCheck(op, a_name.c_str(), la).rank(4).dtype(dtype).on(device, device_of).unit_stride(3)
        .dim(1, num_experts, "experts").dim(3, K, "the GEMM's K");
    if (c == 0) {
      st.max_loras = la.shape[0];
      st.rank = la.shape[2];
      if (st.max_loras < 1 || st.max_loras > kMaxLoraAdapters) {
        fail(op, "argument '" + a_name + "' expected 1 to " + std::to_string(kMaxLoraAdapters) +
                     " adapter slots on dim 0, got shape " + la.shape_string());
      }
      if (st.rank < 1 || st.rank > kMaxLoraRank) {
        fail(op, "argument '" + a_name + "' expected a rank (dim 2) in [1, " + std::to_string(kMaxLoraRank) +
                     "], got shape " + la.shape_string());
      }
    }
    ArgCheck(op, a_name.c_str(), la).dim(0, st.max_loras, "adapter slots, from the first slice")
        .dim(2, st.rank, "rank, from the first slice");
    ArgCheck(op, b_name.c_str(), lb).rank(4).dtype(dtype).on(device, device_of).unit_stride(3)
        .dim(0, st.max_loras, "adapter slots, from lora_a").dim(1, num_experts, "experts")
        .dim(2, st.N_slice, "the slice's output columns").dim(3, st.rank, "rank, from lora_a");
    st.slices[c] = LoraSliceParams{
        .lora_a = la.data, .a_stride_lora = la.strides[0], .a_stride_expert = la.strides[1],
        .a_stride_rank = la.strides[2],
        .lora_b = lb.data, .b_stride_lora = lb.strides[0], .b_stride_expert = lb.strides[1],
        .b_stride_n = lb.strides[2]};
  }
  return st;
}

LoraDelta::LoraDelta(const LoraStack& st, bool interleaved, const TensorView& a, int64_t a_top_k, int64_t num_experts,
                     const TensorView& out, bool add_inputs, const TensorView* topk_weights,
                     const LoraAdapterParams& adapters, const TensorView& topk_ids, const TensorView* expert_map,
                     int64_t num_global_experts, void* intermediate) {
  p.dtype = a.dtype;
  p.a = a.data;
  p.a_stride_row = a.strides[0];
  p.a_top_k = a_top_k;
  p.K = a.shape[1];
  p.N_slice = st.N_slice;
  p.rank = st.rank;
  p.num_slices = st.num_slices;
  p.slices[0] = st.slices[0];
  p.slices[1] = st.slices[1];
  p.interleaved_slices = interleaved;
  p.num_experts = num_experts;
  p.out = out.data;
  p.out_stride_row = out.strides[0];
  p.out_stride_n = out.strides[1];
  p.add_inputs = add_inputs;
  if (topk_weights) {
    p.topk_weights = static_cast<const float*>(topk_weights->data);
    p.topk_weights_cols = topk_ids.shape[1];
    p.topk_weights_stride_row = topk_weights->strides[0];
    p.topk_weights_stride_col = topk_weights->strides[1];
  }
  p.adapters = adapters;
  p.top_k = topk_ids.shape[1];
  p.num_slots = topk_ids.shape[0] * topk_ids.shape[1];
  p.intermediate = intermediate;
  p.topk_ids = topk_ids.data;
  p.topk_ids_int64 = topk_ids.dtype == DType::kInt64;
  p.topk_ids_stride_token = topk_ids.strides[0];
  p.topk_ids_stride_k = topk_ids.strides[1];
  p.expert_map = expert_map ? static_cast<const int32_t*>(expert_map->data) : nullptr;
  p.num_global_experts = num_global_experts;
}

LoraDelta& LoraDelta::with_blocks(const int32_t* sorted_token_ids, int64_t max_num_tokens_padded,
                                  const int32_t* expert_ids, const int32_t* block_lora_ids, int64_t max_num_blocks,
                                  const int32_t* num_tokens_post_padded, int64_t block_size) {
  p.sorted_token_ids = sorted_token_ids;
  p.max_num_tokens_padded = max_num_tokens_padded;
  p.expert_ids = expert_ids;
  p.block_lora_ids = block_lora_ids;
  p.max_num_blocks = max_num_blocks;
  p.num_tokens_post_padded = num_tokens_post_padded;
  p.block_size = block_size;
  return *this;
}

void append_lora_reads(const MoeLoraAdapters& adapters, NamedViews& read) {
  read.add(&adapters.token_lora_ids, "token_lora_ids");
  read.add(adapters.adapter_enabled, "adapter_enabled");
  read.add(adapters.adapter_scale, "adapter_scale");
}

void append_lora_reads(const MoeLoraWeights& w, const char* a_name, const char* b_name, NamedViews& read) {
  for (int c = 0; c < w.num_slices && c < 2; ++c) {
    read.add(&w.lora_a[c], a_name);
    read.add(&w.lora_b[c], b_name);
  }
}

}  // namespace detail

// ---------------------------------------------------------------------------------
int64_t fused_moe_lora_workspace_size(int64_t num_slots, int num_slices, int64_t rank, DType dtype) {
  const char* op = "fused_moe_lora_workspace_size";
  check_range(op, "num_slots", num_slots, 0, kMaxSlots);
  check_range(op, "num_slices", num_slices, 1, 2);
  check_range(op, "rank", rank, 1, kMaxLoraRank);
  if (dtype != DType::kFloat32 && dtype != DType::kFloat16 && dtype != DType::kBFloat16) {
    fail(op, std::string("argument 'dtype' expected float32|float16|bfloat16, got ") + dtype_name(dtype));
  }
  return round_up(std::max<int64_t>(num_slots * num_slices * rank * int64_t(dtype_size(dtype)), 1), 256);
}

void fused_moe_lora(const FusedMoeLoraArgs& args, Stream stream) {
  const char* op = "fused_moe_lora";
  const TensorView& a = args.a;
  float_dtype(ArgCheck(op, "a", a).rank(2).unit_stride(1));
  const Device device = a.device;
  ArgCheck(op, "topk_ids", args.topk_ids).rank(2).dtype_in({DType::kInt32, DType::kInt64}).on(device, "a");
  const int64_t M = args.topk_ids.shape[0], top_k = args.topk_ids.shape[1];
  const int64_t num_slots = M * top_k;
  if (top_k < 1) fail(op, "argument 'topk_ids' expected top_k >= 1, got shape " + args.topk_ids.shape_string());
  if (a.shape[0] != M && a.shape[0] != num_slots) {
    fail(op, "argument 'a' expected " + std::to_string(M) + " rows (one per token) or " + std::to_string(num_slots) +
                 " (one per slot), got shape " + a.shape_string());
  }
  ArgCheck(op, "out", args.out).rank(2).same_dtype(a, "a").on(device, "a").dim(0, num_slots, "slots = M * top_k")
      .no_overlap(a, "a");
  const int64_t K = a.shape[1], N = args.out.shape[1];
  const int64_t num_experts = args.weights.lora_a[0].rank == 4 ? args.weights.lora_a[0].shape[1] : 0;
  const LoraStack st = lora_stack(op, "", args.weights, num_experts, K, N, a.dtype, device, "a");
  const detail::LoraAdapterParams adapters = lora_adapter_params(op, args.adapters, M, st.max_loras, device, "a");
  check_cpu_ids(op, "topk_ids", args.topk_ids, -1, num_experts);
  const TensorView* topk_weights = nullptr;
  if (args.mul_routed_weight) {
    if (!args.topk_weights) fail(op, "argument 'topk_weights' expected a tensor when mul_routed_weight, got none");
    ArgCheck(op, "topk_weights", *args.topk_weights).rank(2).dtype(DType::kFloat32).on(device, "a")
        .dim(0, M, "tokens").dim(1, top_k, "top_k, from 'topk_ids'");
    topk_weights = args.topk_weights;
  }
  const bool blocks = args.sorted_token_ids != nullptr;
  if (blocks != (args.expert_ids != nullptr) || blocks != (args.block_lora_ids != nullptr) ||
      blocks != (args.num_tokens_post_padded != nullptr)) {
    fail(op, "argument 'sorted_token_ids' expected all four alignment tensors (sorted_token_ids, expert_ids, "
             "block_lora_ids, num_tokens_post_padded) or none, got some");
  }
  if (blocks) {
    check_block_size(op, args.block_size, /*multiple_of_16=*/false);
    ArgCheck(op, "sorted_token_ids", *args.sorted_token_ids).rank(1).dtype(DType::kInt32).unit_stride(0).on(device, "a");
    const int64_t blocks_needed = ceil_div(args.sorted_token_ids->shape[0], args.block_size);
    ArgCheck(op, "expert_ids", *args.expert_ids).rank(1).dtype(DType::kInt32).unit_stride(0).on(device, "a")
        .dim_at_least(0, blocks_needed, "one expert per block of 'sorted_token_ids'");
    ArgCheck(op, "block_lora_ids", *args.block_lora_ids).rank(1).dtype(DType::kInt32).unit_stride(0).on(device, "a")
        .dim_at_least(0, blocks_needed, "one adapter per block of 'sorted_token_ids'");
    ArgCheck(op, "num_tokens_post_padded", *args.num_tokens_post_padded)
        .rank(1).dtype(DType::kInt32).dim(0, 1, "a single count").on(device, "a");
    if (!on_cuda(a)) {
      // Readable on the CPU: an id outside its range would index past the stacks.
      const int64_t used = std::min<int64_t>(
          blocks_needed, ceil_div(*static_cast<const int32_t*>(args.num_tokens_post_padded->data), args.block_size));
      TensorView e = *args.expert_ids, l = *args.block_lora_ids;
      e.shape[0] = l.shape[0] = std::max<int64_t>(used, 0);
      check_cpu_ids(op, "expert_ids", e, -1, num_experts);
      check_cpu_ids(op, "block_lora_ids", l, -1, st.max_loras);
    }
  }
  const int64_t workspace_bytes = fused_moe_lora_workspace_size(num_slots, st.num_slices, st.rank, a.dtype);
  ArgCheck(op, "workspace", args.workspace).rank(1).on(device, "a").unit_stride(0);
  if (args.workspace.numel() * int64_t(dtype_size(args.workspace.dtype)) < workspace_bytes) {
    fail(op, "argument 'workspace' expected at least " + std::to_string(workspace_bytes) +
                 " bytes (fused_moe_lora_workspace_size), got " +
                 std::to_string(args.workspace.numel() * int64_t(dtype_size(args.workspace.dtype))));
  }
  if (reinterpret_cast<uintptr_t>(args.workspace.data) % 256 != 0) {
    fail(op, "argument 'workspace' expected a 256-byte aligned pointer, got an unaligned one");
  }
  NamedViews read = {{&a, "a"}, {&args.topk_ids, "topk_ids"}, {args.topk_weights, "topk_weights"},
                     {args.sorted_token_ids, "sorted_token_ids"}, {args.expert_ids, "expert_ids"},
                     {args.block_lora_ids, "block_lora_ids"}, {args.num_tokens_post_padded, "num_tokens_post_padded"}};
  append_lora_reads(args.adapters, read);
  append_lora_reads(args.weights, "lora_a", "lora_b", read);
  check_disjoint_writes(op, {{&args.out, "out"}, {&args.workspace, "workspace"}}, read);
  if (on_cuda(a)) require_cuda_backend(op);
  if (num_slots == 0) return;
  LoraDelta delta(st, args.weights.interleaved_slices, a, a.shape[0] == num_slots ? 1 : top_k, num_experts, args.out,
                  args.add_inputs, topk_weights, adapters, args.topk_ids, nullptr, num_experts, args.workspace.data);
  if (blocks) {
    delta.with_blocks(static_cast<const int32_t*>(args.sorted_token_ids->data), args.sorted_token_ids->shape[0],
                      static_cast<const int32_t*>(args.expert_ids->data),
                      static_cast<const int32_t*>(args.block_lora_ids->data),
                      std::min(args.expert_ids->shape[0], args.block_lora_ids->shape[0]),
                      static_cast<const int32_t*>(args.num_tokens_post_padded->data), args.block_size);
  }
  run_lora_delta(delta.p, device, stream);
}

}  // namespace moelora
