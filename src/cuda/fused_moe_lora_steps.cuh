// The fused LoRA expand's extra K steps (GemmParams::lora_t), shared by the sm80 and sm90
// expert GEMMs. On the segmented alignment a block's adapters (block_lora_masks) each own
// lora_t_cols = S * rank K columns after the base K, in mask order: A is the shrink's
// output t [entries, S * rank] (rows of that adapter's entries, zeros elsewhere), B the
// adapter's lora_b rows for the tile's output columns, block-diagonal over the slices
// (a gate row reads t's gate columns [0, rank), an up row the up ones [rank, 2 rank)).
#pragma once

#include <cstdint>

#include "common/params.h"

namespace moelora::cuda {

// K tiles the expand adds for a block with these adapters.
template <int kBlockK>
__device__ __forceinline__ int lora_k_steps(const detail::GemmParams& p, uint64_t mask) {
  return int((__popcll(mask) * p.lora_t_cols + kBlockK - 1) / kBlockK);
}

// Bit position of the (j + 1)-th set bit of mask (j < popcount).
__device__ __forceinline__ int nth_set_bit(uint64_t mask, int j) {
  const uint32_t lo = uint32_t(mask), hi = uint32_t(mask >> 32);
  const int in_lo = __popc(lo);
  return j < in_lo ? int(__fns(lo, 0, j + 1)) : 32 + int(__fns(hi, 0, j - in_lo + 1));
}

// The adapter, t column and slice of expand column c (c from 0 over the extra K); lora
// -1 past the block's adapters (the last step's tail: zeros).
struct LoraKColumn {
  int lora, t_col, slice;
  __device__ __forceinline__ LoraKColumn(const detail::GemmParams& p, uint64_t mask, int c) {
    const int adapter_index = c / int(p.lora_t_cols);
    t_col = c - adapter_index * int(p.lora_t_cols);
    lora = adapter_index < __popcll(mask) ? nth_set_bit(mask, adapter_index) : -1;
    slice = min(t_col / int(p.lora_rank), p.lora_slices - 1);
  }
  // This column's element of row 0 of the adapter's lora_b for `expert` (any valid
  // address when lora is -1).
  template <typename T>
  __device__ __forceinline__ const T* lora_b(const detail::GemmParams& p, int expert) const {
    const detail::LoraSliceParams& sl = p.lora[slice];
    return static_cast<const T*>(sl.lora_b) + (lora >= 0 ? lora : 0) * sl.b_stride_lora + expert * sl.b_stride_expert +
           (t_col - slice * p.lora_rank);
  }
};

// The slice and lora_b row of a tile's weight row for output column out_col (the up row
// of a gated GEMM when `up`): with two slices gate and up are slices 0 and 1 of N rows
// each; one slice of a gated GEMM holds both halves like w13 (split, or interleaved for
// swiglu_oai).
struct LoraBRow {
  int slice;
  int64_t row;
  __device__ __forceinline__ LoraBRow(const detail::GemmParams& p, int64_t out_col, bool up) {
    const bool interleaved = p.activation == detail::ActivationKind::kSwigluOai;
    slice = p.gated && p.lora_slices == 2 && up ? 1 : 0;
    row = !p.gated || p.lora_slices == 2 ? out_col : interleaved ? 2 * out_col + (up ? 1 : 0) : (up ? p.N : 0) + out_col;
  }
};

}  // namespace moelora::cuda
