// The sm90 tile kernel's weight-only B operand (issue 30; FusedMoeSm90Config::kWeightOnly):
// the producer warpgroup turns packed weight tiles into the ring's 16-bit B slots, so
// the consumers run the same wgmmas as for bf16/fp16 experts and no dense copy of the
// experts ever reaches memory.
//
// Per K step of a tile:
//   - thread 0 has TMA-loaded the step's packed rows (kBlockN x 32 bytes for 4-bit, 64
//     for 8-bit; the bf16 weight boxes' placement, no swizzle) into a staging ring
//     kStaging steps ahead, each slot with its own transaction barrier;
//   - every producer thread converts its kBlockN / 128 rows (weight_only_convert.cuh:
//     exact q - zero, one rounding for the scale, as dequantize_experts) and stores the
//     16-byte chunks where the 128-byte swizzle puts them (the layout the weight TMA
//     writes for 16-bit experts);
//   - fence.proxy.async (wgmma reads through the async proxy), a producer-wide named
//     barrier (every thread is done with the staging slot, which thread 0 then refills),
//     and one arrival of thread 0 on the ring slot's full barrier, whose count has one
//     more for it.
// NOTE: a thread converts whole rows (8 or 16 words), not one 16-byte chunk of 16 rows:
// a row's scale and zero point change at most once a step, so a thread loads one or two
// of each a step, before its barrier waits, instead of sixteen.
#pragma once

#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "common/params.h"
#include "cuda/weight_only_convert.cuh"

namespace moelora::cuda {

// The CUDA type of a cute element, for the conversions.
template <class E>
struct CudaElement;
template <>
struct CudaElement<cute::bfloat16_t> {
  using type = __nv_bfloat16;
};
template <>
struct CudaElement<cute::half_t> {
  using type = __half;
};

// TMA coordinates (dims 1 and 2 of the weight maps) of weight box b of the tile at
// output column n0: box b holds tile rows [b * kBoxRows, +kBoxRows); gated, the gate (b
// even) or up (b odd) rows of output columns n0 + (b / 2) * kBoxRows + [0, kBoxRows).
template <class Config>
__device__ __forceinline__ void weight_box_coords(const detail::GemmParams& p, int64_t n0, int b, bool interleaved,
                                                  int32_t& c1, int32_t& c2) {
  const int32_t row = int32_t(p.gated ? n0 + (b / 2) * Config::kBoxRows : n0 + b * Config::kBoxRows);
  const int32_t half = p.gated ? b % 2 : 0;
  c1 = interleaved ? half : row;
  c2 = interleaved ? row : half;
}

template <class Config>
struct Sm90WeightOnlyProducer {
  using T = typename CudaElement<typename Config::Element>::type;
  static constexpr int kBits = Config::kWeightBits;
  static constexpr int kThreads = Config::kProducerThreads;
  static constexpr int kRows = Config::kBlockN / kThreads;        // rows a thread converts
  static constexpr int kVectors = Config::kPackedRowBytes / 16;  // 16-byte loads a row: 2 or 4
  static constexpr int kChunks = Config::kBlockK / 8;           // 16-byte outputs a row
  static_assert(Config::kBlockN % kThreads == 0 && Config::kBlockK == 64, "whole rows a thread, 64 weights a step");

  const detail::WeightOnlyParams& q;
  int64_t K;
  int expert = 0;
  int32_t weight_row[kRows];  // the expert's weight row of tile row threadIdx.x + 128 j; -1: none
  // This step's scale and zero point of each row: [j][0] for k0 .. k0 + 31, [j][1] for
  // k0 + 32 .. k0 + 63 (another group only with groups of 32).
  weight_only::GroupCodes<T> codes[kRows][2];

  // The tile's weight rows, as weight_box_coords places them.
  __device__ __forceinline__ void start_tile(const detail::GemmParams& p, int tile_expert, int64_t n0) {
    expert = tile_expert;
    const bool interleaved = p.gated && p.activation == detail::ActivationKind::kSwigluOai;
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      const int r = int(threadIdx.x) + kThreads * j;
      const int box = r / Config::kBoxRows;
      int64_t col = n0 + r, row = col;
      if (p.gated) {
        col = n0 + (box / 2) * Config::kBoxRows + r % Config::kBoxRows;
        row = interleaved ? 2 * col + box % 2 : (box % 2) * p.N + col;
      }
      weight_row[j] = col < p.N ? int32_t(row) : -1;
    }
  }

  // Thread 0: the TMA loads of step k0's packed rows into a staging slot.
  __device__ __forceinline__ void load_step(const detail::GemmParams& p, const CUtensorMap* map, uint64_t* bar,
                                            uint8_t* slot, int64_t n0, int64_t k0) const {
    const bool interleaved = p.gated && p.activation == detail::ActivationKind::kSwigluOai;
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(bar, Config::kPackedStageBytes);
#pragma unroll
    for (int b = 0; b < Config::kBoxes; ++b) {
      int32_t c1, c2;
      weight_box_coords<Config>(p, n0, b, interleaved, c1, c2);
      cute::SM90_TMA_LOAD_4D::copy(map, bar, 0, slot + b * Config::kBoxRows * Config::kPackedRowBytes,
                                   int32_t(k0 * kBits / 8), c1, c2, expert);
    }
  }

  // Step k0's scales and zero points (issued before the producer's barrier waits).
  __device__ __forceinline__ void load_codes(int64_t k0) {
    const int64_t group = q.group_size > 0 ? k0 / q.group_size : 0;
    // K % 32 == 0 (the API's CUDA check): the step's second half is all in or all out.
    const bool second_group = q.group_size == 32 && k0 + 32 < K;
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      if (weight_row[j] < 0) continue;
      codes[j][0] = weight_only::load_group_codes<T, kBits>(q, expert, weight_row[j], group);
      codes[j][1] = second_group ? weight_only::load_group_codes<T, kBits>(q, expert, weight_row[j], group + 1)
                                 : codes[j][0];
    }
  }

  // Converts step k0's packed rows (staging slot) into the B slot sB_stage (kBlockN x 64).
  template <class SmemB>
  __device__ __forceinline__ void convert(const uint8_t* slot, SmemB sB_stage, int64_t k0) const {
    const bool second_half = k0 + 32 < K;
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      const int r = int(threadIdx.x) + kThreads * j;
      uint32_t words[4 * kVectors];
      const uint32_t src = static_cast<uint32_t>(__cvta_generic_to_shared(slot + r * Config::kPackedRowBytes));
#pragma unroll
      for (int v = 0; v < kVectors; ++v) {
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(words[4 * v]), "=r"(words[4 * v + 1]), "=r"(words[4 * v + 2]), "=r"(words[4 * v + 3])
                     : "r"(src + 16 * v));
      }
      const bool row_ok = weight_row[j] >= 0;
      weight_only::GroupConstants<T> c[2];
      if (row_ok) {
        c[0] = weight_only::make_group_constants<T>(codes[j][0]);
        c[1] = weight_only::make_group_constants<T>(codes[j][1]);
      }
#pragma unroll
      for (int chunk = 0; chunk < kChunks; ++chunk) {
        // Past K (the last step of K % 64 == 32) or past N: zeros (no scale was loaded).
        const bool ok = row_ok && (chunk < kChunks / 2 || second_half);
        uint32_t out[4] = {0, 0, 0, 0};
        if (ok) {
          const weight_only::GroupConstants<T>& cc = c[chunk / (kChunks / 2)];
          if constexpr (kBits == 4) {
            uint32_t pairs[4];
            weight_only::weight_pairs<T, 4, true>(words[chunk], cc, pairs);
            weight_only::natural_order(pairs, out);
          } else {
            uint32_t lo[4], hi[4];
            weight_only::weight_pairs<T, 8, true>(words[2 * chunk], cc, lo);
            weight_only::weight_pairs<T, 8, true>(words[2 * chunk + 1], cc, hi);
            out[0] = lo[0], out[1] = lo[1], out[2] = hi[0], out[3] = hi[1];
          }
        }
        const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(&sB_stage(r, 8 * chunk)));
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(dst), "r"(out[0]), "r"(out[1]), "r"(out[2]),
                     "r"(out[3])
                     : "memory");
      }
    }
  }
};

}  // namespace moelora::cuda
