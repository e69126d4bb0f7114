// The grouped GEMM's backend parameters, shared by fused_moe and fused_experts.
#pragma once

#include <cstdint>

#include "common/params.h"
#include "moelora/ops.h"

namespace moelora::detail {

// Fills GemmParams for out[slot] = a[row] · w[expert]ᵀ over the aligned blocks; the
// fields of the fused paths (activation, LoRA, sorted rows, tile counter) stay unset.
GemmParams gemm_params(const TensorView& a, const TensorView& w, const TensorView& out,
                       const TensorView& sorted_token_ids, const TensorView& expert_ids,
                       const TensorView& num_tokens_post_padded, const TensorView* topk_weights, int64_t top_k,
                       int64_t block_size, GemmTile tile);

}  // namespace moelora::detail
