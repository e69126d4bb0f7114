// The sm90 tile kernel's weight-only B operand (issue 30; FusedMoeSm90Config::kWeightOnly):
// the consumer warpgroups turn the packed weight tiles of the ring into 16-bit B buffers,
// so they run the same wgmmas as for bf16/fp16 experts and no dense copy of the experts
// ever reaches memory.
//
// Per K step of a tile:
//   - the producer's TMA has loaded the step's packed rows (kBlockN x 32 bytes for 4-bit,
//     64 for 8-bit; the bf16 weight boxes' placement, no swizzle) into the ring slot with
//     A, on the slot's full barrier;
//   - the threads that read a B row convert it (weight_only_convert.cuh: exact q - zero,
//     one rounding for the scale, as dequantize_experts) and store its 16-byte chunks
//     where the 128-byte swizzle puts them (the layout the weight TMA writes for 16-bit
//     experts), into one of three B buffers;
//   - fence.proxy.async (wgmma reads through the async proxy) and a named barrier of the
//     converting threads (both consumer warpgroups for 128-row tiles, whose wgmmas each
//     read all of B; a warpgroup alone for 64-row tiles, each reading its own slice), then
//     the wgmmas. The conversion of step i overlaps the tensor core's step i - 1.
// NOTE: the producer warpgroup converting (a staging ring, a named barrier a step) ran
// 2.3-2.6x slower than the bf16 layer (H100, Mixtral w8a16 M = 1024 / 4096): 4 warps of
// 56-104 registers cannot issue a stage's conversions in one wgmma step; the 8 consumer
// warps, idle while their wgmmas run, can.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "common/params.h"
#include "cuda/fused_moe_lora_steps.cuh"
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

template <class Config>
struct Sm90WeightOnlyConverter {
  using T = typename CudaElement<typename Config::Element>::type;
  static constexpr int kBits = Config::kWeightBits;
  // The converting group: both consumer warpgroups (one B for both), or each its slice.
  static constexpr bool kShared = Config::kWarpgroupsN == 1;
  static constexpr int kGroupThreads = kShared ? Config::kConsumerThreads : 128;
  static constexpr int kGroupRows = kShared ? Config::kBlockN : Config::kSlice;
  static constexpr int kThreadsPerRow = kGroupThreads / kGroupRows;  // 1 or 2
  static constexpr int kChunks = Config::kBlockK / 8 / kThreadsPerRow;  // 16-byte outputs a thread: 8 or 4
  static constexpr int kWords = kChunks * kBits / 4;                     // packed words a thread
  static_assert(kThreadsPerRow == 1 || kThreadsPerRow == 2, "one or two threads a row");
  static_assert(Config::kBlockK == 64 && kWords % 4 == 0, "64 weights a step, 16-byte loads");

  const detail::WeightOnlyParams& q;
  int64_t K;
  int row = 0;          // this thread's tile row
  int first_chunk = 0;  // its first 16-byte chunk (8 weights) of the row's 64
  // The tile's scale and zero-point rows of this thread's weight row, set once a tile so
  // that a step's codes cost a shift and an add (docs/PERF_NOTES.md issue 30 step 3:
  // the per-step `expert * stride + row * stride + group * stride` and the row and K
  // predicates as branches were most of the 834 instructions of a step).
  weight_only::WeightRowCodes<T, kBits> row_codes;
  int group_shift = 0;                // log2(group_size); per channel the K stride is 0
  bool two_groups = false;            // a step's 64 weights of a thread span two groups of 32
  // The step's scale and zero point: [0] for chunks 0-3 (k0 .. k0 + 31), [1] for chunks
  // 4-7 (another group only with groups of 32); and the next step's, loaded a step ahead.
  // NOTE: a step ahead (they were loaded behind the barrier, for the step right after),
  // the layer gained 8% (Qwen3-30B M = 4096, H100); ncu's L1TEX stalls (36% of the
  // warps' stalls) stayed, so those come from elsewhere (docs/PERF_NOTES.md issue 30 step 2).
  weight_only::GroupCodes<T> codes[2], next_codes[2];

  // The tile's weight row of this thread, as the weight boxes place them (weight_box_coords).
  // Rows past N take row 0's scales: a B row past N feeds only output columns past N,
  // which the epilogue drops, and its packed bytes (TMA zero fill) convert to finite
  // values, so no predicate is needed.
  __device__ __forceinline__ void start_tile(const detail::GemmParams& p, int tile_expert, int64_t n0, int thread) {
    const int group_thread = thread % kGroupThreads;
    row = (kShared ? 0 : (thread / 128) * Config::kSlice) + group_thread / kThreadsPerRow;
    first_chunk = (group_thread % kThreadsPerRow) * kChunks;
    const bool interleaved = p.gated && p.activation == detail::ActivationKind::kSwigluOai;
    const int box = row / Config::kBoxRows;
    int64_t col = n0 + row, w_row = col;
    if (p.gated) {
      col = n0 + (box / 2) * Config::kBoxRows + row % Config::kBoxRows;
      w_row = interleaved ? 2 * col + box % 2 : (box % 2) * p.N + col;
    }
    if (col >= p.N) w_row = 0;
    row_codes.start(q, tile_expert, w_row);
    group_shift = q.group_size > 0 ? __ffs(int(q.group_size)) - 1 : 0;
    two_groups = kChunks == 8 && q.group_size == 32;
  }

  // Step k0's scales and zero points into next_codes (a step ahead of its conversion).
  __device__ __forceinline__ void load_codes(int64_t k0) {
    // K % 32 == 0 (the API's CUDA check): a thread's chunks, and the second half of a
    // step, are all in or all out; out (the last step of K % 64 == 32) they take the
    // last group's codes, loaded in bounds.
    const int64_t k = k0 + 8 * first_chunk;
    const int group = int((k < K ? k : K - 1) >> group_shift);
    next_codes[0] = row_codes.load(group);
    next_codes[1] = two_groups && k + 32 < K ? row_codes.load(group + 1) : next_codes[0];
  }

  // The loaded codes become the step's.
  __device__ __forceinline__ void take_codes() {
    codes[0] = next_codes[0];
    codes[1] = next_codes[1];
  }

  // Converts this thread's chunks of a step from the slot's packed rows into the B buffer
  // at shared address `buffer` (kBlockN rows of 128 bytes, 1024-byte aligned): chunk c of
  // row r at r * 128 + 16 * (c ^ r % 8), the 128-byte swizzle of the TMA and wgmma.
  // Chunks past K (the last step of K % 64 == 32) convert the TMA's zero fill: finite
  // values that meet A's zero-filled columns, so they need no predicate either.
  // 16 bytes of packed words at a time, converted and stored before the next load (the
  // volatile shared accesses keep that order): half the live words of loading them all
  // first, whose 128 x 256 w4 instance spilled (111 STL, 39 LDL).
  __device__ __forceinline__ void convert(const uint8_t* packed, uint32_t buffer) const {
    const uint32_t src = static_cast<uint32_t>(
        __cvta_generic_to_shared(packed + row * Config::kPackedRowBytes + first_chunk * kBits));  // 8 weights: kBits bytes
    weight_only::GroupConstants<T> c[2];
    c[0] = row_codes.constants(codes[0]);
    c[1] = row_codes.constants(codes[1]);
    constexpr int kChunksPerLoad = 4 * 4 / kBits;  // a 16-byte load: 4 chunks of 4-bit, 2 of 8-bit
    const uint32_t row_base = buffer + row * 128;
    const int swizzle = row % 8;
#pragma unroll
    for (int v = 0; v < kWords / 4; ++v) {
      uint32_t words[4];
      asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(words[0]), "=r"(words[1]), "=r"(words[2]), "=r"(words[3])
                   : "r"(src + 16 * v));
#pragma unroll
      for (int j = 0; j < kChunksPerLoad; ++j) {
        const int i = v * kChunksPerLoad + j;  // this thread's chunk
        const weight_only::GroupConstants<T>& cc = c[kChunks == 8 ? i / 4 : 0];
        uint32_t out[4];
        if constexpr (kBits == 4) {
          uint32_t pairs[4];
          weight_only::weight_pairs<T, 4, true>(words[j], cc, pairs);
          weight_only::natural_order(pairs, out);
        } else {
          uint32_t lo[4], hi[4];
          weight_only::weight_pairs<T, 8, true>(words[2 * j], cc, lo);
          weight_only::weight_pairs<T, 8, true>(words[2 * j + 1], cc, hi);
          out[0] = lo[0], out[1] = lo[1], out[2] = hi[0], out[3] = hi[1];
        }
        const uint32_t dst = row_base + 16 * ((first_chunk + i) ^ swizzle);
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(dst), "r"(out[0]), "r"(out[1]), "r"(out[2]),
                     "r"(out[3])
                     : "memory");
      }
    }
  }

  // A fused LoRA expand step (GemmParams::lora_t; step kt of the tile's adapter columns,
  // `mask` its adapters): this thread's chunks of its B row from the column's adapter's
  // lora_b, zeros where the column has no adapter or belongs to the other slice, stored as
  // convert() stores them. The ring's slots hold packed rows only, so the producer loads
  // just A (the shrink's t rows) for these steps and B comes from global memory here: an
  // adapter's [N, rank] rows are few, read by every tile of the expert (L2), and a tile
  // has one or two such steps against K / 64 converted ones.
  // The tile's output column of this thread's row and its gate/up half are worked out here
  // again (start_tile's placement), not kept through the K loop: the 128 x 256 consumers
  // are at their register limit (main spills there already).
  __device__ __forceinline__ void lora_b(const detail::GemmParams& p, int tile_expert, int64_t n0, uint64_t mask,
                                         int kt, uint32_t buffer) const {
    const int box = row / Config::kBoxRows;
    const int64_t out_col = p.gated ? n0 + (box / 2) * Config::kBoxRows + row % Config::kBoxRows : n0 + row;
    const LoraBRow b(p, out_col, p.gated && box % 2 == 1);
    const uint32_t row_base = buffer + row * 128;
    const int swizzle = row % 8;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int chunk = first_chunk + i;
      const LoraKColumn col(p, mask, kt * Config::kBlockK + 8 * chunk);
      uint4 v = make_uint4(0, 0, 0, 0);
      if (col.lora >= 0 && b.slice == col.slice && out_col < p.N) {
        v = *reinterpret_cast<const uint4*>(col.template lora_b<T>(p, tile_expert) + b.row * p.lora[col.slice].b_stride_n);
      }
      asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(row_base + 16 * (chunk ^ swizzle)), "r"(v.x),
                   "r"(v.y), "r"(v.z), "r"(v.w)
                   : "memory");
    }
  }

  // The converting group's barrier: every chunk of the B buffer stored before its wgmmas.
  __device__ __forceinline__ void sync(int thread) const {
    cutlass::arch::NamedBarrier::sync(kGroupThreads, Config::kConvertBarrier + (kShared ? 0 : thread / 128));
  }
};

}  // namespace moelora::cuda
