// The gated activations, shared by the activation kernel and the GEMM epilogues that
// fuse them (GemmParams::gated), and the weight-row layout of a gated GEMM tile.
#pragma once

#include "common/params.h"

namespace moelora::cuda {

template <detail::ActivationKind kKind>
__device__ __forceinline__ float gated_activation(float gate, float up, float alpha, float limit) {
  using detail::ActivationKind;
  if constexpr (kKind == ActivationKind::kSiluAndMul) {
    return gate / (1.f + __expf(-gate)) * up;
  } else if constexpr (kKind == ActivationKind::kGeluAndMul) {
    return 0.5f * gate * (1.f + erff(gate * 0.70710678118654752f)) * up;
  } else {
    gate = fminf(gate, limit);
    up = fminf(fmaxf(up, -limit), limit);
    return (up + 1.f) * gate / (1.f + __expf(-alpha * gate));
  }
}

__device__ __forceinline__ float gated_activation(const detail::GemmParams& p, float gate, float up) {
  using detail::ActivationKind;
  switch (p.activation) {
    case ActivationKind::kSiluAndMul: return gated_activation<ActivationKind::kSiluAndMul>(gate, up, p.alpha, p.limit);
    case ActivationKind::kGeluAndMul: return gated_activation<ActivationKind::kGeluAndMul>(gate, up, p.alpha, p.limit);
    default: return gated_activation<ActivationKind::kSwigluOai>(gate, up, p.alpha, p.limit);
  }
}

// Layout of the weight rows of a gated tile. The accumulator columns of a tile fall in
// slices of kSlice columns (the columns one warp or warpgroup holds); in each slice the
// first half are gate rows and the second half the up rows of the same output columns.
// The MMA fragments then hand every thread a gate value and its up value (fragment
// index i and i + size/2), so the activation needs no data exchange.
template <int kSlice>
struct GatedTileColumn {
  int out_col;  // output column, relative to the tile's first output column
  bool up;
  __device__ __forceinline__ GatedTileColumn(int tile_col)
      : out_col((tile_col / kSlice) * (kSlice / 2) + tile_col % (kSlice / 2)), up(tile_col % kSlice >= kSlice / 2) {}
};

// Row of w for output column j (j < p.N): gate and up halves, or interleaved pairs (gpt-oss).
__device__ __forceinline__ int64_t gated_weight_row(const detail::GemmParams& p, int64_t j, bool up) {
  return p.activation == detail::ActivationKind::kSwigluOai ? 2 * j + (up ? 1 : 0) : (up ? p.N + j : j);
}

}  // namespace moelora::cuda
