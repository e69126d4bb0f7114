// The alignment's backend parameters, shared by the alignment ops and fused_experts.
#pragma once

#include <cstdint>

#include "common/params.h"
#include "moelora/ops.h"

namespace moelora::detail {

// moe_align_block_size_capacity over num_groups alignment groups (experts, or LoRA's
// (expert, adapter) pairs), for arguments already checked: the ops' and the layer's.
AlignCapacity align_capacity(int64_t num_slots, int64_t block_size, int64_t num_groups);

// Fills AlignParams from the (already checked) tensors; the LoRA fields stay unset.
AlignParams align_params(const TensorView& topk_ids, int64_t block_size, int64_t num_experts,
                         const TensorView* expert_map, const TensorView& sorted_token_ids,
                         const TensorView& expert_ids, const TensorView& num_tokens_post_padded);

}  // namespace moelora::detail
