// Pieces every fused_moe kernel shares: the per-tile slot and routed-weight tables, and
// the zero rows of a tile whose expert is not on this rank.
#pragma once

#include "common/params.h"

namespace moelora::cuda {

// tile_slot[r] = the slot of entry entry0 + r of sorted_token_ids, or -1 for padding;
// tile_weight[r] = its routed weight (1 without topk_weights). Caller syncs after.
template <int kRows>
__device__ __forceinline__ void load_tile_slots(const detail::GemmParams& p, int64_t entry0, int32_t* tile_slot,
                                                float* tile_weight) {
  for (int r = threadIdx.x; r < kRows; r += blockDim.x) {
    const int64_t entry = entry0 + r;
    const int32_t slot = entry < p.sorted_token_ids_size ? p.sorted_token_ids[entry] : -1;
    const bool valid = slot >= 0 && slot < p.num_slots;
    tile_slot[r] = valid ? slot : -1;
    tile_weight[r] = valid && p.topk_weights
                         ? p.topk_weights[(slot / p.topk_weights_cols) * p.topk_weights_stride_row +
                                          (slot % p.topk_weights_cols) * p.topk_weights_stride_col]
                         : 1.f;
  }
}

// Expert not on this rank (or a dropped slot): the tile's rows are zeros.
template <class T, int kRows, int kCols>
__device__ __forceinline__ void write_zero_rows(const detail::GemmParams& p, int64_t n0, const int32_t* tile_slot) {
  T* out = static_cast<T*>(p.out);
  for (int i = threadIdx.x; i < kRows * kCols; i += blockDim.x) {
    const int r = i / kCols;
    const int64_t n = n0 + i % kCols;
    if (tile_slot[r] >= 0 && n < p.N) out[tile_slot[r] * p.out_stride_row + n * p.out_stride_n] = T(0.f);
  }
}

}  // namespace moelora::cuda
