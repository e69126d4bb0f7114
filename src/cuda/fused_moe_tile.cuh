// The per-tile slot and routed-weight tables of the fused_moe kernels.
#pragma once

#include "common/params.h"

namespace moelora::cuda {

// tile_slot[r] = the slot of entry entry0 + r of sorted_token_ids, or -1 for padding;
// tile_weight[r] = its routed weight (1 without topk_weights). Threads thread, thread +
// num_threads, ... fill it; the caller syncs them after.
template <int kRows>
__device__ __forceinline__ void load_tile_slots(const detail::GemmParams& p, int64_t entry0, int32_t* tile_slot,
                                                float* tile_weight, int thread, int num_threads) {
  for (int r = thread; r < kRows; r += num_threads) {
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

// Every thread of the block fills the tables.
template <int kRows>
__device__ __forceinline__ void load_tile_slots(const detail::GemmParams& p, int64_t entry0, int32_t* tile_slot,
                                                float* tile_weight) {
  load_tile_slots<kRows>(p, entry0, tile_slot, tile_weight, int(threadIdx.x), int(blockDim.x));
}

// The two halves of load_tile_slots, for a kernel that needs the slots before its first
// loads and the routed weights only in its epilogue: tile_slot first (every thread of the
// block; the caller syncs them after), then tile_weight from it (threads r < kRows, after
// that sync; the caller syncs again before the epilogue reads it).
template <int kRows>
__device__ __forceinline__ void load_tile_slot_ids(const detail::GemmParams& p, int64_t entry0, int32_t* tile_slot) {
  for (int r = int(threadIdx.x); r < kRows; r += int(blockDim.x)) {
    const int64_t entry = entry0 + r;
    const int32_t slot = entry < p.sorted_token_ids_size ? p.sorted_token_ids[entry] : -1;
    tile_slot[r] = slot >= 0 && slot < p.num_slots ? slot : -1;
  }
}
template <int kRows>
__device__ __forceinline__ void load_tile_routed_weights(const detail::GemmParams& p, const int32_t* tile_slot,
                                                         float* tile_weight) {
  for (int r = int(threadIdx.x); r < kRows; r += int(blockDim.x)) {
    const int32_t slot = tile_slot[r];
    tile_weight[r] = slot >= 0 && p.topk_weights
                         ? p.topk_weights[(slot / p.topk_weights_cols) * p.topk_weights_stride_row +
                                          (slot % p.topk_weights_cols) * p.topk_weights_stride_col]
                         : 1.f;
  }
}

}  // namespace moelora::cuda
