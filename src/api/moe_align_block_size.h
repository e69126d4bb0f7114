// The alignment's backend parameters, shared by the alignment ops and fused_experts.
#pragma once

#include <cstdint>

#include "common/params.h"
#include "moelora/tensor.h"

namespace moelora::detail {

// Fills AlignParams from the (already checked) tensors; the LoRA fields stay unset.
AlignParams align_params(const TensorView& topk_ids, int64_t block_size, int64_t num_experts,
                         const TensorView* expert_map, const TensorView& sorted_token_ids,
                         const TensorView& expert_ids, const TensorView& num_tokens_post_padded);

}  // namespace moelora::detail
