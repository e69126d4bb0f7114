// The small-batch kernels' weight-only dot products (w4a16 / w8a16, issue 30): packed
// weights streamed once from DRAM, dequantized in registers, multiplied on bf16/fp16
// m16n8k16 MMAs against the 16-bit vectors (swap-AB: 16 weight rows fill the MMA's M,
// the slots of a pass its N of 8).
//
// Lane (g, q) = (lane / 4, lane % 4) of a warp loads, per step of 64 packed bytes, the 16
// bytes at 16q of its rows g and g + 8 (4-bit: 32 weights, k = 32q .. 32q + 31 of the
// step; 8-bit: 16) and the same k of its vector g. The MMA's k order inside a step is
// free as long as rows and vectors agree, so each lane feeds its own 16 bytes.
// weight_only_convert.cuh converts each 32-bit word; the 4-bit pairs come as (k_i, k_i+4),
// and the vector's pairs are permuted the same way (PRMT (x_i, x_{i+4})).
// A lane's 16 bytes lie in one scale group (groups of 32, 64, 128 or a whole row), so a
// lane loads one scale and one zero point per row a step. Where a whole step (128 4-bit
// or 64 8-bit weights of K) lies in one group, the MMAs take the exact q - zero and the
// step's sums are scaled in fp32; smaller groups multiply each pair by its scale first,
// the only rounding before the fp32 sums, as dequantizing to bf16/fp16 would do.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "common/params.h"
#include "cuda/mma_sm80.cuh"
#include "cuda/numeric.cuh"
#include "cuda/small_batch_mma.cuh"
#include "cuda/small_batch_slots.cuh"
#include "cuda/weight_only_convert.cuh"

namespace moelora::cuda::small_batch {

using detail::WeightOnlyParams;
using namespace weight_only;  // the conversions

// 64 packed bytes a step (kMmaStep).
template <int kBits>
constexpr int kWeightsPerStep = kMmaStep * 8 / kBits;  // K of a step: 128 (4-bit) or 64 (8-bit)

// Steps of a packed row of K weights (the last may be partial).
template <int kBits>
__host__ __device__ constexpr int weight_only_steps(int K) {
  return (K + kWeightsPerStep<kBits> - 1) / kWeightsPerStep<kBits>;
}

// One warp's 16-row product over steps [step_begin, step_end) of the packed K: rows
// row_lo (g) and row_hi (g + 8) of `expert`, against kTiles n8 tiles of vectors (the
// lane's vector g of each: vec[t], never null: a lane with no vector of its own passes
// any valid one, whose product column nobody reads), into acc[t]: (row g, vector 2q),
// (g, 2q + 1), (g + 8, 2q), (g + 8, 2q + 1). K: weights a row. Two tiles (the aligned
// kernels' 16-entry blocks) convert each weight pair once for both.
// kScaleAfter (a step within one scale group: groups of at least a step's K, or one per
// row): the MMAs sum the exact q - zero, and each step's sums meet the rows' scales in
// fp32; the weights skip one multiply a pair. NOTE: the 4-bit instances streamed at
// 2.0-2.2 TB/s with the multiply (H100, Mixtral M = 1-16), issue-bound where the 8-bit
// ones, at half the weights a byte, reached 2.7 (docs/PERF_NOTES.md, issue 30).
// kZero: the rows have zero points or not (warp_weight_only_rows branches once an item).
template <class T, int kBits, bool kScaleAfter, ZeroPoints kZero, int kTiles>
__device__ __forceinline__ void warp_weight_only_rows_of(const WeightOnlyParams& q, int64_t expert, int64_t row_lo,
                                                         int64_t row_hi, const T* const (&vec)[kTiles], int K,
                                                         int step_begin, int step_end, float (&acc)[kTiles][4]) {
  constexpr int kLaneWeights = 128 / kBits;          // weights in a lane's 16 bytes: 32 or 16
  constexpr int kVecChunks = kLaneWeights / 8;       // 16-byte chunks of the vector a lane-step: 4 or 2
  constexpr int kStepWeights = kWeightsPerStep<kBits>;
  // Rounds of kStages steps' loads, then their MMAs: two steps with one tile (the decode
  // kernels) and with two tiles of 8-bit weights, one with two tiles of 4-bit weights
  // (the aligned kernels; four vector chunks a tile: two steps spilled 60-80 bytes), under
  // the 128 registers of two CTAs an SM. NOTE: pipelined instead (each step's MMAs while
  // the next step's loads fly, one CTA an SM for the registers), the aligned kernels ran
  // 15-25% slower (H100, w4a16: Qwen3-30B M = 64 186 -> 232 us, M = 1024 912 -> 1104;
  // docs/PERF_NOTES.md, issue 30): half the warps hid less than the pipeline won.
  constexpr int kStages = kTiles == 1 || kBits == 8 ? 2 : 1;
  const int lane_k = kLaneWeights * (int(threadIdx.x) % 4);  // the lane's first weight of a step
  // Everything a step adds to these is a 32-bit offset: the per-item index math is done.
  const uint8_t* w_lo = q.w + expert * q.w_stride_expert + row_lo * q.w_stride_n + lane_k * kBits / 8;
  const uint8_t* w_hi = q.w + expert * q.w_stride_expert + row_hi * q.w_stride_n + lane_k * kBits / 8;
  const T* x[kTiles];
#pragma unroll
  for (int t = 0; t < kTiles; ++t) x[t] = vec[t] + lane_k;
  WeightRowCodes<T, kBits> codes_lo, codes_hi;
  codes_lo.start(q, expert, row_lo);
  codes_hi.start(q, expert, row_hi);
  const int group_shift = q.group_size > 0 ? __ffs(int(q.group_size)) - 1 : 30;  // groups: powers of two
  struct Step {
    uint4 lo, hi, x[kTiles][kVecChunks];
    GroupCodes<T> c_lo, c_hi;
  };
  // A step's loads, all issued before any of a round's MMAs. Checked (the tail: a slice's
  // last round, or K's partial last step; K % 32 == 0, so a lane's chunk is whole or past
  // the row): past the slice or K, zeros meet zeros. Unchecked rounds carry no predicate
  // and no branch, so nothing waits on a load the compiler sank behind one (the scale
  // loads of a round's second step were, a second memory round trip a round).
  auto load = [&](Step& st, int step, auto checked) {
    constexpr bool kChecked = decltype(checked)::value;
    const int k = step * kStepWeights;  // the step's first weight
    const bool in = !kChecked || (step < step_end && k + lane_k < K);
    const int byte = k * kBits / 8;
    const uint4 zeros = make_uint4(0, 0, 0, 0);
    st.lo = in ? load_streaming(w_lo + byte) : zeros;
    st.hi = in ? load_streaming(w_hi + byte) : zeros;
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
#pragma unroll
      for (int c = 0; c < kVecChunks; ++c) {
        st.x[t][c] = in ? *reinterpret_cast<const uint4*>(x[t] + k + 8 * c) : zeros;
      }
    }
    // kScaleAfter: the step's one group; else the lane's. Clamped into the row.
    const int group_k = kChecked ? min(kScaleAfter ? k : k + lane_k, K - 1) : (kScaleAfter ? k : k + lane_k);
    const int group = group_k >> group_shift;
    st.c_lo = codes_lo.template load<kZero>(group);
    st.c_hi = codes_hi.template load<kZero>(group);
  };
  auto multiply = [&](const Step& st) {
    const GroupConstants<T> c_lo = codes_lo.constants(st.c_lo), c_hi = codes_hi.constants(st.c_hi);
    const uint32_t words_lo[4] = {st.lo.x, st.lo.y, st.lo.z, st.lo.w};
    const uint32_t words_hi[4] = {st.hi.x, st.hi.y, st.hi.z, st.hi.w};
    float part[kTiles][4] = {};
    float (&sums)[kTiles][4] = kScaleAfter ? part : acc;
#pragma unroll
    for (int wd = 0; wd < 4; ++wd) {
      uint32_t a_lo[4], a_hi[4];
      weight_pairs<T, kBits, !kScaleAfter>(words_lo[wd], c_lo, a_lo);
      weight_pairs<T, kBits, !kScaleAfter>(words_hi[wd], c_hi, a_hi);
#pragma unroll
      for (int t = 0; t < kTiles; ++t) {
        if constexpr (kBits == 4) {
          // Word wd holds k 8wd .. 8wd + 7 of the lane's 32: vector chunk wd, paired as the weights.
          const uint4 v = st.x[t][wd];
          const uint32_t b04 = __byte_perm(v.x, v.z, 0x5410), b15 = __byte_perm(v.x, v.z, 0x7632);
          const uint32_t b26 = __byte_perm(v.y, v.w, 0x5410), b37 = __byte_perm(v.y, v.w, 0x7632);
          mma_16x8x16<T>(sums[t], a_lo[0], a_hi[0], a_lo[1], a_hi[1], b04, b15);
          mma_16x8x16<T>(sums[t], a_lo[2], a_hi[2], a_lo[3], a_hi[3], b26, b37);
        } else {
          // Word wd holds k 4wd .. 4wd + 3 of the lane's 16: half of vector chunk wd / 2.
          const uint4 v = st.x[t][wd / 2];
          const uint32_t b01 = wd % 2 == 0 ? v.x : v.z, b23 = wd % 2 == 0 ? v.y : v.w;
          mma_16x8x16<T>(sums[t], a_lo[0], a_hi[0], a_lo[1], a_hi[1], b01, b23);
        }
      }
    }
    if constexpr (kScaleAfter) {
      // Every lane of the step read the same group: its rows' scales.
      const float s_lo = to_float(st.c_lo.scale), s_hi = to_float(st.c_hi.scale);
#pragma unroll
      for (int t = 0; t < kTiles; ++t) {
        acc[t][0] = fmaf(part[t][0], s_lo, acc[t][0]);
        acc[t][1] = fmaf(part[t][1], s_lo, acc[t][1]);
        acc[t][2] = fmaf(part[t][2], s_hi, acc[t][2]);
        acc[t][3] = fmaf(part[t][3], s_hi, acc[t][3]);
      }
    }
  };
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[t][i] = 0.f;
  }
  // Steps whose every lane chunk lies in K.
  const int full_end = min(step_end, K / kStepWeights);
  int s0 = step_begin;
  for (; s0 + kStages <= full_end; s0 += kStages) {
    Step stages[kStages];
#pragma unroll
    for (int i = 0; i < kStages; ++i) load(stages[i], s0 + i, std::false_type{});
#pragma unroll
    for (int i = 0; i < kStages; ++i) multiply(stages[i]);
  }
  for (; s0 < step_end; s0 += kStages) {
    Step stages[kStages];
#pragma unroll
    for (int i = 0; i < kStages; ++i) load(stages[i], s0 + i, std::true_type{});
#pragma unroll
    for (int i = 0; i < kStages; ++i) {
      if (s0 + i >= step_end) break;
      multiply(stages[i]);
    }
  }
}

template <class T, int kBits, bool kScaleAfter, int kTiles = 1>
__device__ __forceinline__ void warp_weight_only_rows(const WeightOnlyParams& q, int64_t expert, int64_t row_lo,
                                                      int64_t row_hi, const T* const (&vec)[kTiles], int K,
                                                      int step_begin, int step_end, float (&acc)[kTiles][4]) {
  // NOTE: a branch on the zero-point pointer inside the step cost ~10 instructions a step
  // (pointer selects and predicates, SASS); once an item, nothing.
  if (q.zero) {
    warp_weight_only_rows_of<T, kBits, kScaleAfter, ZeroPoints::kYes>(q, expert, row_lo, row_hi, vec, K, step_begin,
                                                                      step_end, acc);
  } else {
    warp_weight_only_rows_of<T, kBits, kScaleAfter, ZeroPoints::kNo>(q, expert, row_lo, row_hi, vec, K, step_begin,
                                                                     step_end, acc);
  }
}

// A warp item's passes over the slots of distinct expert d (at most 8 a pass): each
// pass's products, summed over the team; its first warp then hands use(slot, product
// with row_lo, product with row_hi) for each of its lane's vectors. a: the vectors'
// rows (row_of(slot), a_stride elements apart).
template <class T, int kBits, bool kScaleAfter, int kCtaWarps, class RowOf, class Use>
__device__ __forceinline__ void weight_only_item_passes(const WeightOnlyParams& q, int64_t expert, int64_t row_lo,
                                                        int64_t row_hi, const SlotTables& t, int d, const T* a,
                                                        int64_t a_stride, RowOf row_of, int K,
                                                        const MmaTeams<kCtaWarps>& teams, float* red, Use use) {
  const int lane = int(threadIdx.x) % 32, g = lane / 4, quad = lane % 4;
  const int steps = weight_only_steps<kBits>(K);
  const int end = t.group_begin[d + 1];
  for (int pass = t.group_begin[d]; pass < end; pass += kMmaVecs) {
    const int n = min(kMmaVecs, end - pass);
    // Lanes past the pass's slots multiply its first slot's vector (their columns are not read).
    const T* const vec[1] = {a + int64_t(row_of(t.sorted_slot[pass + (g < n ? g : 0)])) * a_stride};
    float acc[kMmaTiles][4];
    warp_weight_only_rows<T, kBits, kScaleAfter>(q, expert, row_lo, row_hi, vec, K, teams.step_begin(),
                                                 teams.step_end(steps), acc);
    teams.reduce(acc, red);
    if (teams.member != 0) continue;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int col = 2 * quad + c;
      if (col < n) use(t.sorted_slot[pass + col], acc[0][c], acc[0][2 + c]);
    }
  }
}

}  // namespace moelora::cuda::small_batch
