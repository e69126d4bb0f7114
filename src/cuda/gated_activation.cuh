// The gated activations, shared by the activation kernel and the GEMM epilogues that
// fuse them (GemmParams::gated), and the weight-row layout of a gated GEMM tile.
#pragma once

#include "common/params.h"
#include "cuda/numeric.cuh"

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

// Gate and up of the kVec output columns [col, col + kVec) from one row of a gated
// GEMM's output [2 * width]: its halves (gate, then up), or for swiglu_oai gpt-oss's
// interleaved pairs (element 2i is gate i, 2i + 1 is up i). kVec > 1: 16-byte loads
// (Vec16<T>::kSize columns; rows and col aligned to them).
template <typename T, detail::ActivationKind kKind, int kVec>
__device__ __forceinline__ void load_gate_up(const T* in, int64_t width, int64_t col, T (&gate)[kVec], T (&up)[kVec]) {
  if constexpr (kKind == detail::ActivationKind::kSwigluOai) {
    T pairs[2 * kVec];
    if constexpr (kVec > 1) {
      *reinterpret_cast<Vec16<T>*>(pairs) = *reinterpret_cast<const Vec16<T>*>(in + 2 * col);
      *reinterpret_cast<Vec16<T>*>(pairs + kVec) = *reinterpret_cast<const Vec16<T>*>(in + 2 * col + kVec);
    } else {
      pairs[0] = in[2 * col];
      pairs[1] = in[2 * col + 1];
    }
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      gate[i] = pairs[2 * i];
      up[i] = pairs[2 * i + 1];
    }
  } else if constexpr (kVec > 1) {
    *reinterpret_cast<Vec16<T>*>(gate) = *reinterpret_cast<const Vec16<T>*>(in + col);
    *reinterpret_cast<Vec16<T>*>(up) = *reinterpret_cast<const Vec16<T>*>(in + width + col);
  } else {
    gate[0] = in[col];
    up[0] = in[width + col];
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
