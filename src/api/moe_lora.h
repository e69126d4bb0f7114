// LoRA validation and parameters shared by fused_moe_lora, moe_lora_align_block_size and
// fused_experts: the adapter state, a GEMM's stacks, and one GEMM's delta.
#pragma once

#include <cstdint>
#include <string>

#include "api/validate.h"
#include "common/params.h"
#include "moelora/ops.h"

namespace moelora::detail {

// Groups of the virtual alignment: (expert, adapter or none) pairs.
inline int64_t lora_groups(int64_t num_experts, int64_t max_loras) { return num_experts * (max_loras + 1); }

void check_max_loras(const char* op, int64_t max_loras);

// token_lora_ids [num_tokens] int32 (CPU: values in [-1, max_loras)), adapter_enabled and
// adapter_scale [max_loras].
LoraAdapterParams lora_adapter_params(const char* op, const MoeLoraAdapters& a, int64_t num_tokens,
                                      int64_t max_loras, const Device& device, const char* device_of);

// A GEMM's stacks: every slice lora_a [L, E, r, K], lora_b [L, E, N / S, r], dtype of the
// GEMM, unit stride on the last dim. `name` prefixes the argument names ("w13_" ...).
struct LoraStack {
  int64_t max_loras, rank, N_slice;
  int num_slices;
  LoraSliceParams slices[2];
};
LoraStack lora_stack(const char* op, const std::string& name, const MoeLoraWeights& w, int64_t num_experts,
                     int64_t K, int64_t N, DType dtype, const Device& device, const char* device_of);

// The tensors a LoRA op reads, for check_disjoint_writes: the adapter state, and one
// GEMM's stacks (lora_a[c] named a_name, lora_b[c] b_name; num_slices already checked).
void append_lora_reads(const MoeLoraAdapters& adapters, NamedViews& read);
void append_lora_reads(const MoeLoraWeights& w, const char* a_name, const char* b_name, NamedViews& read);

// One GEMM's LoRA delta in the per-slot mode (topk_ids [M, top_k] gives each slot's
// expert); with_blocks() switches it to the blocks of a LoRA alignment.
struct LoraDelta {
  LoraDeltaParams p{};
  LoraDelta(const LoraStack& st, bool interleaved, const TensorView& a, int64_t a_top_k, int64_t num_experts,
            const TensorView& out, bool add_inputs, const TensorView* topk_weights,
            const LoraAdapterParams& adapters, const TensorView& topk_ids, const TensorView* expert_map,
            int64_t num_global_experts, void* intermediate);
  LoraDelta& with_blocks(const int32_t* sorted_token_ids, int64_t max_num_tokens_padded, const int32_t* expert_ids,
                         const int32_t* block_lora_ids, int64_t max_num_blocks, const int32_t* num_tokens_post_padded,
                         int64_t block_size);
};

}  // namespace moelora::detail
