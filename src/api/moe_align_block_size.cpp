// The alignment ops: moe_align_block_size and moe_lora_align_block_size, their capacity
// queries, and the checks both share.
#include "api/moe_align_block_size.h"

#include <algorithm>
#include <string>

#include "api/api_util.h"
#include "api/moe_lora.h"
#include "moelora/ops.h"

namespace moelora {

using namespace detail;

namespace detail {

AlignParams align_params(const TensorView& topk_ids, int64_t block_size, int64_t num_experts,
                         const TensorView* expert_map, const TensorView& sorted_token_ids,
                         const TensorView& expert_ids, const TensorView& num_tokens_post_padded) {
  return AlignParams{
      .topk_ids = topk_ids.data,
      .topk_ids_int64 = topk_ids.dtype == DType::kInt64,
      .topk_ids_stride_token = topk_ids.strides[0],
      .topk_ids_stride_k = topk_ids.strides[1],
      .num_tokens = topk_ids.shape[0],
      .top_k = topk_ids.shape[1],
      .block_size = block_size,
      .num_experts = num_experts,
      .expert_map = expert_map ? static_cast<const int32_t*>(expert_map->data) : nullptr,
      .sorted_token_ids = static_cast<int32_t*>(sorted_token_ids.data),
      .max_num_tokens_padded = sorted_token_ids.shape[0],
      .expert_ids = static_cast<int32_t*>(expert_ids.data),
      .max_num_blocks = expert_ids.shape[0],
      .num_tokens_post_padded = static_cast<int32_t*>(num_tokens_post_padded.data),
  };
}

}  // namespace detail

// ---------------------------------------------------------------------------------
namespace detail {
AlignCapacity align_capacity(int64_t num_slots, int64_t block_size, int64_t num_groups) {
  // Every non-empty group (of num_experts experts + the trailing dropped-slot group)
  // pads by at most block_size - 1 entries, and at most num_slots groups are non-empty.
  // NOTE: the min keeps decode grids small: at M = 1, top_k = 8 and 256 experts the
  // GEMM grids cover 9 blocks instead of 257.
  const int64_t max_padded = num_slots + std::min(num_groups + 1, num_slots) * (block_size - 1);
  return {max_padded, ceil_div(max_padded, block_size)};
}
}  // namespace detail

AlignCapacity moe_align_block_size_capacity(int64_t num_slots, int64_t block_size, int64_t num_experts) {
  const char* op = "moe_align_block_size_capacity";
  check_range(op, "num_slots", num_slots, 0, kMaxSlots);
  check_block_size(op, block_size, /*multiple_of_16=*/false);
  check_range(op, "num_experts", num_experts, 1, kMaxNumExperts);
  return align_capacity(num_slots, block_size, num_experts);
}

namespace {

// The checks both alignment ops share; returns the backend's parameters. num_groups: the
// alignment groups (experts, or (expert, adapter) pairs) that size the outputs;
// block_lora_ids: the LoRA op's extra output, or null; reads: what the op reads besides
// topk_ids and expert_map (the LoRA op's adapter state).
detail::AlignParams checked_align_params(const char* op, const char* capacity_fn, const TensorView& topk_ids,
                                         int64_t block_size, int64_t num_experts, int64_t num_groups,
                                         const TensorView* expert_map, const TensorView& sorted_token_ids,
                                         const TensorView& expert_ids, const TensorView* block_lora_ids,
                                         const TensorView& num_tokens_post_padded, NamedViews reads) {
  const Device device = topk_ids.device;
  if (topk_ids.numel() > kMaxSlots) {
    fail(op, "argument 'topk_ids' expected at most " + std::to_string(kMaxSlots) + " slots (sorted ids are int32), got " +
                 topk_ids.shape_string());
  }
  const AlignCapacity cap = align_capacity(topk_ids.numel(), block_size, num_groups);
  ArgCheck(op, "sorted_token_ids", sorted_token_ids)
      .rank(1).dtype(DType::kInt32).unit_stride(0).on(device, "topk_ids")
      .dim_at_least(0, cap.max_num_tokens_padded, (std::string(capacity_fn) + "().max_num_tokens_padded").c_str());
  ArgCheck(op, "expert_ids", expert_ids)
      .rank(1).dtype(DType::kInt32).unit_stride(0).on(device, "topk_ids")
      .dim_at_least(0, cap.max_num_blocks, (std::string(capacity_fn) + "().max_num_blocks").c_str());
  ArgCheck(op, "num_tokens_post_padded", num_tokens_post_padded)
      .rank(1).dtype(DType::kInt32).dim(0, 1, "a single count").on(device, "topk_ids");
  if (block_lora_ids) {
    ArgCheck(op, "block_lora_ids", *block_lora_ids)
        .rank(1).dtype(DType::kInt32).unit_stride(0).on(device, "topk_ids")
        .dim(0, expert_ids.shape[0], "one adapter per block, as 'expert_ids'");
  }
  if (expert_map) {
    ArgCheck(op, "expert_map", *expert_map)
        .rank(1).dtype(DType::kInt32).unit_stride(0).dim(0, num_experts, "num_experts").on(device, "topk_ids");
  }
  reads.add(&topk_ids, "topk_ids");
  reads.add(expert_map, "expert_map");
  detail::check_disjoint_writes(op,
                                {{&sorted_token_ids, "sorted_token_ids"}, {&expert_ids, "expert_ids"},
                                 {block_lora_ids, "block_lora_ids"}, {&num_tokens_post_padded, "num_tokens_post_padded"}},
                                reads);
  if (int64_t(cap.max_num_tokens_padded) > INT32_MAX) {
    fail(op, "argument 'topk_ids' expected fewer slots (sorted ids are int32), got " + topk_ids.shape_string());
  }
  check_cpu_ids(op, "topk_ids", topk_ids, -1, num_experts);
  if (on_cuda(topk_ids)) require_cuda_backend(op);
  detail::AlignParams p = align_params(topk_ids, block_size, num_experts, expert_map, sorted_token_ids, expert_ids,
                                       num_tokens_post_padded);
  if (block_lora_ids) p.block_lora_ids = static_cast<int32_t*>(block_lora_ids->data);
  return p;
}

void check_align_args(const char* op, const TensorView& topk_ids, int64_t block_size, int64_t num_experts) {
  ArgCheck(op, "topk_ids", topk_ids).rank(2).dtype_in({DType::kInt32, DType::kInt64});
  check_block_size(op, block_size, /*multiple_of_16=*/false);
  if (num_experts < 1 || num_experts > kMaxNumExperts) {
    fail(op, "argument 'num_experts' expected a value in [1, " + std::to_string(kMaxNumExperts) + "], got " +
                 std::to_string(num_experts));
  }
}

}  // namespace

void moe_align_block_size(const TensorView& topk_ids, int64_t block_size, int64_t num_experts,
                          const TensorView* expert_map, const TensorView& sorted_token_ids,
                          const TensorView& expert_ids, const TensorView& num_tokens_post_padded,
                          Stream stream) {
  const char* op = "moe_align_block_size";
  check_align_args(op, topk_ids, block_size, num_experts);
  run_align(checked_align_params(op, "moe_align_block_size_capacity", topk_ids, block_size, num_experts, num_experts,
                                 expert_map, sorted_token_ids, expert_ids, nullptr, num_tokens_post_padded, {}),
            topk_ids.device, stream);
}

// ---------------------------------------------------------------------------------
// LoRA: the virtual alignment over (expert, adapter or none) pairs.
AlignCapacity moe_lora_align_block_size_capacity(int64_t num_slots, int64_t block_size, int64_t num_experts,
                                                 int64_t max_loras) {
  const char* op = "moe_lora_align_block_size_capacity";
  check_range(op, "num_slots", num_slots, 0, kMaxSlots);
  check_block_size(op, block_size, /*multiple_of_16=*/false);
  check_range(op, "num_experts", num_experts, 1, kMaxNumExperts);
  check_max_loras(op, max_loras);
  return align_capacity(num_slots, block_size, lora_groups(num_experts, max_loras));
}

void moe_lora_align_block_size(const TensorView& topk_ids, const MoeLoraAdapters& adapters, int64_t max_loras,
                               int64_t block_size, int64_t num_experts, const TensorView* expert_map,
                               const TensorView& sorted_token_ids, const TensorView& expert_ids,
                               const TensorView& block_lora_ids, const TensorView& num_tokens_post_padded,
                               Stream stream) {
  const char* op = "moe_lora_align_block_size";
  check_align_args(op, topk_ids, block_size, num_experts);
  check_max_loras(op, max_loras);
  const detail::LoraAdapterParams lora =
      lora_adapter_params(op, adapters, topk_ids.shape[0], max_loras, topk_ids.device, "topk_ids");
  NamedViews adapter_reads = {};
  append_lora_reads(adapters, adapter_reads);
  detail::AlignParams p = checked_align_params(op, "moe_lora_align_block_size_capacity", topk_ids, block_size,
                                               num_experts, lora_groups(num_experts, max_loras), expert_map,
                                               sorted_token_ids, expert_ids, &block_lora_ids, num_tokens_post_padded,
                                               adapter_reads);
  p.max_loras = max_loras;
  p.token_lora_ids = lora.token_lora_ids;
  p.token_lora_ids_stride = lora.token_lora_ids_stride;
  p.adapter_enabled = lora.adapter_enabled;
  run_align(p, topk_ids.device, stream);
}

}  // namespace moelora
