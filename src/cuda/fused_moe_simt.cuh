// fused_moe on CUDA cores: the general path for fp32 and for operands the tensor-core
// kernel cannot load with 16-byte copies (odd K, unit-stride-less or unaligned rows).
// Any strides. Tile: 16 entries of sorted_token_ids x 64 columns, fp32 in smem.
#pragma once

#include "common/params.h"
#include "cuda/cuda_check.h"
#include "cuda/fused_moe_tile.cuh"
#include "cuda/gated_activation.cuh"
#include "cuda/launch.cuh"
#include "cuda/numeric.cuh"

namespace moelora::cuda {

constexpr int kSimtBlockM = 16;  // divides every valid block_size (a multiple of 16)
constexpr int kSimtBlockN = 64;
constexpr int kSimtBlockK = 32;
constexpr int kSimtThreads = 256;  // thread t: row t / 16, columns (t % 16) * 4 .. +4

template <typename T>
__global__ void __launch_bounds__(kSimtThreads) fused_moe_simt_kernel(const detail::GemmParams p) {
  __shared__ float a_tile[kSimtBlockK][kSimtBlockM + 1];  // [BLK_K, BLK_M], +1 against bank conflicts
  __shared__ float b_tile[kSimtBlockK][kSimtBlockN + 1];  // [BLK_K, BLK_N]
  __shared__ int32_t tile_slot[kSimtBlockM];
  __shared__ float tile_weight[kSimtBlockM];

  // Gated: the tile's 64 weight rows give 32 output columns (GatedTileColumn<64>).
  const int out_width = p.gated ? kSimtBlockN / 2 : kSimtBlockN;
  const int64_t num_n_tiles = (p.N + out_width - 1) / out_width;
  const int64_t entry0 = (blockIdx.x / num_n_tiles) * kSimtBlockM;
  const int64_t n0 = (blockIdx.x % num_n_tiles) * out_width;  // first output column
  const int64_t weight_rows = p.gated ? 2 * p.N : p.N;
  wait_for_previous_kernel();
  if (entry0 >= *p.num_tokens_post_padded) return;
  const int expert = p.expert_ids[entry0 / p.block_size];
  load_tile_slots<kSimtBlockM>(p, entry0, tile_slot, tile_weight);
  __syncthreads();

  const int row = threadIdx.x / 16;
  const int col = (threadIdx.x % 16) * 4;
  const bool has_expert = expert >= 0 && expert < p.num_experts;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  if (has_expert) {
    const T* a = static_cast<const T*>(p.a);
    const T* w = static_cast<const T*>(p.w) + expert * p.w_stride_expert;
    for (int64_t k0 = 0; k0 < p.K; k0 += kSimtBlockK) {
      for (int i = threadIdx.x; i < kSimtBlockK * kSimtBlockM; i += kSimtThreads) {
        const int r = i / kSimtBlockK, k = i % kSimtBlockK;
        const int32_t slot = tile_slot[r];
        a_tile[k][r] = (slot >= 0 && k0 + k < p.K)
                           ? to_float(a[(slot / p.top_k) * p.a_stride_row + (k0 + k) * p.a_stride_k])
                           : 0.f;
      }
      for (int i = threadIdx.x; i < kSimtBlockK * kSimtBlockN; i += kSimtThreads) {
        const int c = i / kSimtBlockK, k = i % kSimtBlockK;
        int64_t n = n0 + c;
        if (p.gated) {
          const GatedTileColumn<kSimtBlockN> col(c);
          n = n0 + col.out_col < p.N ? gated_weight_row(p, n0 + col.out_col, col.up) : weight_rows;
        }
        b_tile[k][c] = (n < weight_rows && k0 + k < p.K) ? to_float(w[n * p.w_stride_n + (k0 + k) * p.w_stride_k]) : 0.f;
      }
      __syncthreads();
#pragma unroll 8
      for (int k = 0; k < kSimtBlockK; ++k) {
        const float av = a_tile[k][row];
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[j] += av * b_tile[k][col + j];
      }
      __syncthreads();
    }
  }
  T* out = static_cast<T*>(p.out);
  if (p.gated) {
    // Gate and up of an output column sit in different threads: meet in shared memory.
#pragma unroll
    for (int j = 0; j < 4; ++j) b_tile[row][col + j] = acc[j];
    __syncthreads();
    for (int i = threadIdx.x; i < kSimtBlockM * (kSimtBlockN / 2); i += kSimtThreads) {
      const int r = i / (kSimtBlockN / 2), j = i % (kSimtBlockN / 2);
      const int32_t slot = tile_slot[r];
      const int64_t n = n0 + j;
      if (slot < 0 || n >= p.N) continue;
      const float w = has_expert ? tile_weight[r] : 0.f;
      out[slot * p.out_stride_row + n * p.out_stride_n] =
          from_float<T>(gated_activation(p, b_tile[r][j] * w, b_tile[r][j + kSimtBlockN / 2] * w));
    }
    return;
  }
  const int32_t slot = tile_slot[row];
  if (slot < 0) return;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int64_t n = n0 + col + j;
    // Rows of a block whose expert is not on this rank are written as zeros.
    if (n < p.N) out[slot * p.out_stride_row + n * p.out_stride_n] = from_float<T>(has_expert ? acc[j] * tile_weight[row] : 0.f);
  }
}

template <typename T>
void launch_fused_moe_simt(const detail::GemmParams& p, cudaStream_t stream) {
  const int64_t out_width = p.gated ? kSimtBlockN / 2 : kSimtBlockN;
  const int64_t num_tiles = p.max_num_blocks * (p.block_size / kSimtBlockM) * ((p.N + out_width - 1) / out_width);
  if (num_tiles == 0) return;
  launch_kernel(fused_moe_simt_kernel<T>, dim3(unsigned(num_tiles)), dim3(kSimtThreads), 0, stream, p);
}

}  // namespace moelora::cuda
