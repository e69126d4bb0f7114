// The small-batch kernels' W8A8 dot products (fused_experts_small_batch.cuh): 8-bit
// operands on m16n8k32 MMAs with their scales, and the warp teams that split an item's K.
#pragma once

#include <climits>
#include <type_traits>

#include "common/params.h"
#include "cuda/mma_sm80.cuh"
#include "cuda/small_batch_slots.cuh"

namespace moelora::cuda::small_batch {

// A warp multiplies 16 weight rows by up to kMmaVecs vectors (n8 tiles of 8). Lane
// (g, q) = (lane / 4, lane % 4) loads the 16 bytes at k0 + 16q of its rows g and g + 8 and
// of vector g of each tile; MMA t of the 64-byte step takes bytes [8t, 8t + 8) of those
// chunks as its fragments (a0/a1/b0: bytes 8t..8t+3, a2/a3/b1: 8t+4..8t+7). That relabels
// K inside each step the same way for rows and vectors, so every product is the whole
// dot product, with no shared memory and no shuffles. Lane (g, q) ends with the products
// of rows g and g + 8 with vectors 2q and 2q + 1 of each tile.
// NOTE: the CUDA-core version (fp8 pairs converted to fp32, dp4a for int8) issued ~160
// instructions per 16 weight bytes, needed 251 registers (one CTA an SM) and streamed
// fp8 GEMM1 at 32% of DRAM peak (ncu, H100, Qwen3-30B M = 1: 24 us, bf16's GEMM1 23 us).
// The MMAs left that kernel's time as it was (24 us, 133 instructions per 16 weight
// bytes: per-item costs over items of a few steps) but sped up the models with larger
// experts (docs/PERF_NOTES.md, issue 28 step 3). A cp.async ring of 8 steps a warp in
// shared memory instead of the register loads measured slower in every decode cell
// (Qwen3-30B M = 8: 146 -> 198 us; Mixtral M = 4: 382 -> 537 us; H100): not kept.
constexpr int kMmaStep = 64;    // bytes of K per step
constexpr int kMmaUnroll = 4;   // steps loaded before use: 8 16-byte weight loads a lane
// n8 tiles: vectors a pass. NOTE: two (16 vectors) spilled fp8 GEMM1 by 12-24 B under
// two CTAs an SM; an expert with more than 8 slots streams its rows once a pass.
constexpr int kMmaTiles = 1;
constexpr int kMmaVecs = 8 * kMmaTiles;

// MMA steps a K block of the block scales spans (1: no block scales).
__device__ __forceinline__ int steps_per_block(const detail::GemmQuantParams& q) {
  return q.w_scales == ScaleGranularity::kBlock ? int(q.block_k / kMmaStep) : 1;
}

// The scales of weight row `row` of `expert`, and of a's row `row`, in q's layout.
__device__ __forceinline__ const float* weight_scales(const detail::GemmQuantParams& q, int64_t expert, int64_t row) {
  const float* base = q.w_scale + expert * q.w_scale_stride_expert;
  switch (q.w_scales) {
    // block_n is a power of two (the API checks): a shift, not a 64-bit division per item.
    case ScaleGranularity::kBlock: return base + (row >> (__ffsll(q.block_n) - 1)) * q.w_scale_stride_n;
    case ScaleGranularity::kChannel: return base + row * q.w_scale_stride_n;
    default: return base;
  }
}
__device__ __forceinline__ const float* activation_scales(const detail::GemmQuantParams& q, int64_t row) {
  return q.a_scales == ScaleGranularity::kTensor ? q.a_scale : q.a_scale + row * q.a_scale_stride_row;
}

// One warp's 16-row product. Lane (g, q) passes its rows (row_lo: g, row_hi: g + 8), each
// tile's vector g (null: zeros), the scale rows of its rows and a's rows of each tile's
// vectors 2q and 2q + 1 (-1: a column past the pass, scale 0). acc[tile][i]: (row g, vector 2q),
// (g, 2q + 1), (g + 8, 2q), (g + 8, 2q + 1), scaled. Block scales fold each K block's
// partial products (one block_k = 128 is two steps) into acc; channel and tensor scales
// multiply the finished sums. int8 accumulates exactly in int32 between folds.
template <class E>
struct MmaRows {
  using Accum = std::conditional_t<std::is_same_v<E, int8_t>, int, float>;
  const E* row_lo;
  const E* row_hi;
  const E* vec[kMmaTiles];
  const float* w_scale[2];  // rows g, g + 8
  // a's rows (their scales) of vectors 2q, 2q + 1 of each tile; -1: past the pass.
  // NOTE: row indices, not pointers: four fewer registers kept fp8 swiglu_oai's GEMM1
  // from spilling under two CTAs an SM.
  int a_row[kMmaTiles][2];
};

// A pass's vectors, `n` slots from sorted_slot[pass] on: lane (g, q)'s vector g of each
// tile and a's rows of its vectors 2q and 2q + 1. row_of(slot): a's row of a slot (its
// token in x for GEMM1, the slot itself in act for GEMM2), of a_stride elements.
template <class E, class RowOf>
__device__ __forceinline__ void set_pass_vectors(MmaRows<E>& m, const int32_t* sorted_slot, int n, const E* a,
                                                 int64_t a_stride, RowOf row_of) {
  const int lane = int(threadIdx.x) % 32, g = lane / 4, q = lane % 4;
#pragma unroll
  for (int tile = 0; tile < kMmaTiles; ++tile) {
    const int v = tile * 8 + g;
    m.vec[tile] = v < n ? a + int64_t(row_of(sorted_slot[v])) * a_stride : nullptr;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int col = tile * 8 + 2 * q + c;
      m.a_row[tile][c] = col < n ? row_of(sorted_slot[col]) : -1;
    }
  }
}

// The scales of K block kb of a lane's four products (rows g, g + 8 times its vectors 2q,
// 2q + 1 of tile t; 0 past the pass), in acc's order. The loads carry no branches, so a
// fold waits on one round trip for all four, not on four in turn.
template <class E>
__device__ __forceinline__ void block_scales(const detail::GemmQuantParams& q, const MmaRows<E>& m, int t, int kb,
                                             float (&scale)[4]) {
  const float w_lo = m.w_scale[0][kb * q.w_scale_stride_k], w_hi = m.w_scale[1][kb * q.w_scale_stride_k];
  float a[2];
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const int a_row = m.a_row[t][c];
    const float value = activation_scales(q, max(a_row, 0))[kb * q.a_scale_stride_k];
    a[c] = a_row >= 0 ? value : 0.f;
  }
  scale[0] = w_lo * a[0];
  scale[1] = w_lo * a[1];
  scale[2] = w_hi * a[0];
  scale[3] = w_hi * a[1];
}

// Steps [step_begin, step_end) of K (64 bytes each; a team's slice, see MmaTeams, which
// begins on a K block).
// NOTE: a round issues all its loads before its first MMA: the weights', the vectors' and
// the scales of the round's first two K blocks. Loaded at their use (the vector's chunk
// before each step's MMAs, each scale behind a branch at each fold), they made a chain of
// L1/L2 round trips a step, and the kernels issued one instruction every 11 cycles a warp
// (ncu, H100, Qwen3-30B fp8_block M = 1: GEMM1 22.4 us, GEMM2 18.0 us for 12.6 MB).
template <class E>
__device__ __forceinline__ void warp_mma_rows(const detail::GemmQuantParams& q, const MmaRows<E>& m, int num_tiles,
                                              int K, int step_begin, int step_end, float (&acc)[kMmaTiles][4]) {
  using Accum = typename MmaRows<E>::Accum;
  const int lane_k = 16 * (int(threadIdx.x) % 4);
  const bool block = q.w_scales == ScaleGranularity::kBlock;
  const int block_steps = steps_per_block(q);
  // The last K block (the prefetch of a round's second block stops there).
  const int last_block = ((K + kMmaStep - 1) / kMmaStep - 1) / block_steps;
  Accum part[kMmaTiles][4] = {};
#pragma unroll
  for (int t = 0; t < kMmaTiles; ++t) {
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[t][i] = 0.f;
  }
  // Folds the partial products into acc, times the block's scales (block) or 1.
  auto fold = [&](int t, const float (&scale)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      acc[t][i] = fmaf(float(part[t][i]), scale[i], acc[t][i]);
      part[t][i] = Accum(0);
    }
  };
  int kb = step_begin / block_steps;  // the K block of the next fold
  int block_left = block_steps;       // its steps not yet multiplied
  const int steps = step_end;
  for (int s0 = step_begin; s0 < steps; s0 += kMmaUnroll) {
    uint4 lo[kMmaUnroll], hi[kMmaUnroll], vec[kMmaUnroll][kMmaTiles];
#pragma unroll
    for (int u = 0; u < kMmaUnroll; ++u) {
      const int k = (s0 + u) * kMmaStep + lane_k;
      const bool in = k < K;
      lo[u] = in ? load_streaming(m.row_lo + k) : make_uint4(0, 0, 0, 0);
      hi[u] = in ? load_streaming(m.row_hi + k) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kMmaUnroll; ++u) {
      const int k = (s0 + u) * kMmaStep + lane_k;
#pragma unroll
      for (int t = 0; t < kMmaTiles; ++t) {
        vec[u][t] = k < K && m.vec[t] ? *reinterpret_cast<const uint4*>(m.vec[t] + k) : make_uint4(0, 0, 0, 0);
      }
    }
    // A round of kMmaUnroll = 4 steps ends at most two blocks when a block is two steps
    // or more (block_k >= 128); a third fold (block_k = 64) loads its scales there.
    float first[kMmaTiles][4], second[kMmaTiles][4];
    if (block) {
#pragma unroll
      for (int t = 0; t < kMmaTiles; ++t) {
        block_scales(q, m, t, kb, first[t]);
        block_scales(q, m, t, min(kb + 1, last_block), second[t]);
      }
    }
    int folds = 0;
#pragma unroll
    for (int u = 0; u < kMmaUnroll; ++u) {
      const int step = s0 + u;
      if (step >= steps) break;
#pragma unroll
      for (int t = 0; t < kMmaTiles; ++t) {
        if (t >= num_tiles) break;
        mma_8bit_16x8x32(part[t], lo[u].x, hi[u].x, lo[u].y, hi[u].y, vec[u][t].x, vec[u][t].y);
        mma_8bit_16x8x32(part[t], lo[u].z, hi[u].z, lo[u].w, hi[u].w, vec[u][t].z, vec[u][t].w);
      }
      // A K block (or the slice) ends with this step (warp-uniform): its products, times its scales.
      if (block && (--block_left == 0 || step + 1 == steps)) {
#pragma unroll
        for (int t = 0; t < kMmaTiles; ++t) {
          if (t >= num_tiles) break;
          float scale[4];
          if (folds < 2) {
#pragma unroll
            for (int i = 0; i < 4; ++i) scale[i] = folds == 0 ? first[t][i] : second[t][i];
          } else {
            block_scales(q, m, t, kb, scale);
          }
          fold(t, scale);
        }
        ++folds;
        ++kb;
        block_left = block_steps;
      }
    }
  }
  if (!block) {
    const float one[4] = {1.f, 1.f, 1.f, 1.f};
#pragma unroll
    for (int t = 0; t < kMmaTiles; ++t) {
      fold(t, one);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int a_row = m.a_row[t][i & 1];
        acc[t][i] *= a_row >= 0 ? *m.w_scale[i >> 1] * *activation_scales(q, a_row) : 0.f;
      }
    }
  }
}

// Warps of a CTA in teams of `size` (1, 2, 4 or 8) that split an item's K steps: when
// there are fewer items than warps, one warp an item left most warps idle and each busy
// one streaming its 16 rows alone (fp8 GEMM1 of DeepSeek-V3 at M = 1: 256 units of 16
// rows x 7168 bytes for 2112 warps, 94 us). The size minimises each warp's rounds of
// kMmaUnroll steps: ceil(items / teams) x ceil(slice / kMmaUnroll). Slices are whole K
// blocks (block scales fold per block). Members sum into the team's first warp through
// shared memory, between the team's own barriers (named barrier 1 + team).
// kCtaWarps: the CTA's warps (GEMM2 on small H runs CTAs of 16; at most 15 teams of two
// or more warps, so their barrier ids stay within the 16 named barriers).
template <int kCtaWarps = kWarps>
struct MmaTeams {
  static_assert(kCtaWarps <= 16, "named barriers 1 + team");
  int size, team, count, member;  // count: teams in the CTA
  int slice_steps;
  // items: what the teams of all `ctas` CTAs share; steps: K's; steps_per_block: 1 unless block scales.
  // NOTE: 32-bit math (items < 2^31, see the callers): the 64-bit divisions were ~300
  // instructions a warp, a tenth of a decode warp's work.
  __device__ MmaTeams(int items, int ctas, int steps, int steps_per_block) {
    int best = INT_MAX;
    size = 1;
    for (int s = 1; s <= kCtaWarps; s *= 2) {
      const int slice = (steps + s - 1) / s;
      const int aligned = (slice + steps_per_block - 1) / steps_per_block * steps_per_block;
      const int teams = ctas * (kCtaWarps / s);
      const int rounds = (items + teams - 1) / teams * ((aligned + kMmaUnroll - 1) / kMmaUnroll);
      if (rounds < best) {
        best = rounds;
        size = s;
        slice_steps = aligned;
      }
    }
    const int warp = int(threadIdx.x) / 32;
    team = warp / size;
    count = kCtaWarps / size;
    member = warp % size;
  }
  __device__ int step_begin() const { return member * slice_steps; }
  __device__ int step_end(int steps) const { return min(steps, (member + 1) * slice_steps); }
  __device__ void sync() const {
    asm volatile("bar.sync %0, %1;" ::"r"(1 + team), "r"(32 * size) : "memory");
  }
  // acc summed over the team into its first warp (member 0); red: kMmaReduceFloats floats.
  __device__ void reduce(float (&acc)[kMmaTiles][4], float* red) const {
    if (size == 1) return;
    const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
#pragma unroll
    for (int t = 0; t < kMmaTiles; ++t) {
#pragma unroll
      for (int i = 0; i < 4; ++i) red[(warp * kMmaTiles * 4 + t * 4 + i) * 32 + lane] = acc[t][i];
    }
    sync();
    if (member == 0) {
      for (int m = 1; m < size; ++m) {
#pragma unroll
        for (int t = 0; t < kMmaTiles; ++t) {
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[t][i] += red[((warp + m) * kMmaTiles * 4 + t * 4 + i) * 32 + lane];
        }
      }
    }
    sync();  // red is rewritten by the next item
  }
};
template <int kCtaWarps>
constexpr int kMmaReduceFloatsFor = kCtaWarps * kMmaTiles * 4 * 32;
constexpr int kMmaReduceFloats = kMmaReduceFloatsFor<kWarps>;

// A warp item's passes over the slots of its expert (distinct expert d of the tables, at
// most kMmaVecs slots a pass; a: the vectors' rows, row_of(slot) the row of a slot): each
// pass's products, summed over the team; its first warp then hands use(slot, product with
// row g, product with row g + 8) for each of its lane's vectors.
template <class E, int kCtaWarps, class RowOf, class Use>
__device__ __forceinline__ void mma_item_passes(const detail::GemmQuantParams& q, MmaRows<E>& m, const SlotTables& t,
                                                int d, const E* a, int64_t a_stride, RowOf row_of, int K, int steps,
                                                const MmaTeams<kCtaWarps>& teams, float* red, Use use) {
  const int quad = int(threadIdx.x) % 4;
  const int end = t.group_begin[d + 1];
  for (int pass = t.group_begin[d]; pass < end; pass += kMmaVecs) {
    const int n = min(kMmaVecs, end - pass);
    set_pass_vectors(m, t.sorted_slot + pass, n, a, a_stride, row_of);
    float acc[kMmaTiles][4];
    warp_mma_rows(q, m, (n + 7) / 8, K, teams.step_begin(), teams.step_end(steps), acc);
    teams.reduce(acc, red);
    if (teams.member != 0) continue;
#pragma unroll
    for (int tile = 0; tile < kMmaTiles; ++tile) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int col = tile * 8 + 2 * quad + c;
        if (col < n) use(t.sorted_slot[pass + col], acc[tile][c], acc[tile][2 + c]);
      }
    }
  }
}

}  // namespace moelora::cuda::small_batch
