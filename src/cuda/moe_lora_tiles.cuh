// The LoRA delta kernels' shared pieces (moe_lora.cu, moe_lora_shrink_segmented.cu,
// moe_lora_expand_entries.cu): tile constants, the mma.sync 16x16 tiles over shared memory,
// the output element of a row, and the shrink GEMVs' warp dot product.
#pragma once

#include <cute/arch/mma_sm80.hpp>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "common/params.h"
#include "cuda/mma_sm80.cuh"
#include "cuda/numeric.cuh"

namespace moelora::cuda::lora_tiles {

using detail::LoraDeltaParams;

constexpr int kTileRows = 16;                 // slots per tile: the mma M
constexpr int kMaxRankPadded = 128;           // kMaxLoraRank, padded to 16
constexpr int kExpandColumns = 64;            // output columns per expand CTA
constexpr int kExpandThreads = 128;           // 4 warps: one 16-column output fragment each
constexpr int kGemvThreads = 256;             // the GEMV kernels: a warp an item
// Adapters the segmented alignment tracks: the bits of block_lora_masks.
constexpr int kMaxAdapters = int(kMaxLoraAdapters);
static_assert(kMaxAdapters <= 64, "block_lora_masks holds an adapter a bit");

template <typename T>
constexpr bool kTensorCores = sizeof(T) == 2;
// Row pitch padding (elements) against shared-memory bank conflicts; keeps rows 16-byte
// aligned for ldmatrix and the 16-byte copies.
constexpr int kPad = 8;

__host__ __device__ constexpr int round_up16(int v) { return (v + 15) / 16 * 16; }

// Tensor-core tiles: acc (two mma.m16n8k16 C fragments, n 0-7 and n 8-15; lane holds rows
// lane / 4 (+8) at columns 2 (lane % 4) (+1) of each) += a[16, k_extent] · b[16, k_extent]ᵀ,
// both row-major in shared memory; a and b are this lane's ldmatrix.x4 row addresses
// (mma_lane_a / mma_lane_b) as 32-bit shared offsets, k_extent a multiple of 16.
// NOTE: WMMA's load_matrix_sync compiled to 32 generic 2-byte loads a fragment, and a
// generic pointer converted per call costs 3 instructions; in the segmented shrink that
// was its largest instruction cost (ncu, DeepSeek M = 512: 177 M instructions at 2.25 IPC
// for 460 MB of lora_a in 343 us).
template <typename T>
__device__ __forceinline__ void mma_16x16_accumulate(float (&acc)[8], uint32_t a, uint32_t b, int k_extent) {
  using Mma = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, cute::SM80_16x8x16_F32BF16BF16F32_TN,
                                 cute::SM80_16x8x16_F32F16F16F32_TN>;
#pragma unroll 4
  for (int kk = 0; kk < k_extent; kk += 16) {
    uint32_t a0, a1, a2, a3, b0, b1, b2, b3;
    ldmatrix_x4(a + kk * sizeof(T), a0, a1, a2, a3);
    ldmatrix_x4(b + kk * sizeof(T), b0, b1, b2, b3);
    Mma::fma(acc[0], acc[1], acc[2], acc[3], a0, a1, a2, a3, b0, b1, acc[0], acc[1], acc[2], acc[3]);
    Mma::fma(acc[4], acc[5], acc[6], acc[7], a0, a1, a2, a3, b2, b3, acc[4], acc[5], acc[6], acc[7]);
  }
}

// This lane's ldmatrix.x4 element offset in a 16-row tile at pitch ld: for a, rows 0-7 /
// 8-15 at k 0 / 8; for b, rows (n) 0-7 at k 0 / 8, then 8-15.
__device__ __forceinline__ int mma_lane_a(int ld) {
  const int lane = threadIdx.x % 32;
  return (lane % 16) * ld + (lane / 16) * 8;
}
__device__ __forceinline__ int mma_lane_b(int ld) {
  const int lane = threadIdx.x % 32;
  return (lane % 8 + (lane / 16) * 8) * ld + (lane / 8 % 2) * 8;
}

// acc of mma_16x16_accumulate into a row-major fp32 [16, 16] tile at pitch ld.
__device__ __forceinline__ void store_mma_16x16(float* tile, int ld, const float (&acc)[8]) {
  const int lane = threadIdx.x % 32;
  float* out = tile + (lane / 4) * ld + (lane % 4) * 2;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    out[h * 8] = acc[4 * h];
    out[h * 8 + 1] = acc[4 * h + 1];
    out[8 * ld + h * 8] = acc[4 * h + 2];
    out[8 * ld + h * 8 + 1] = acc[4 * h + 3];
  }
}

// acc[f] (rows 0-15 x columns 16f..16f+15) += t_tile's rows · the lora_b tile's columns over
// k_extent, with the rows of other adapters masked out of the A fragments: low / high say
// whether rows lane / 4 (a0, a2) and lane / 4 + 8 (a1, a3) are this adapter's. a_base and
// b_base: this lane's ldmatrix addresses (mma_lane_a / mma_lane_b at pitch) in the t tile and
// in the lora_b tile [16 kFragments columns][pitch]. The expands' MMA chain for one adapter.
template <typename T, int kFragments>
__device__ __forceinline__ void mma_adapter_rows(float (&acc)[kFragments][8], uint32_t a_base, uint32_t b_base,
                                                 int pitch, int k_extent, bool low, bool high) {
  using Mma = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, cute::SM80_16x8x16_F32BF16BF16F32_TN,
                                 cute::SM80_16x8x16_F32F16F16F32_TN>;
  for (int kk = 0; kk < k_extent; kk += 16) {
    uint32_t a0, a1, a2, a3;
    ldmatrix_x4(a_base + kk * sizeof(T), a0, a1, a2, a3);
    if (!low) a0 = a2 = 0;
    if (!high) a1 = a3 = 0;
#pragma unroll
    for (int f = 0; f < kFragments; ++f) {
      uint32_t b0, b1, b2, b3;
      ldmatrix_x4(b_base + (f * 16 * pitch + kk) * sizeof(T), b0, b1, b2, b3);
      Mma::fma(acc[f][0], acc[f][1], acc[f][2], acc[f][3], a0, a1, a2, a3, b0, b1, acc[f][0], acc[f][1], acc[f][2],
               acc[f][3]);
      Mma::fma(acc[f][4], acc[f][5], acc[f][6], acc[f][7], a0, a1, a2, a3, b2, b3, acc[f][4], acc[f][5], acc[f][6],
               acc[f][7]);
    }
  }
}

// The entries the alignment filled (at most its capacity); call after the wait.
__device__ __forceinline__ int64_t used_entries(const LoraDeltaParams& p) {
  return min(int64_t(*p.num_tokens_post_padded), p.max_num_tokens_padded);
}

// acc[j] += A[16 rows, 32 K] · B_j[32 K, 8]ᵀ for the warp-tile shrink (moe_lora_shrink_segmented.cu),
// each operand row one 16-byte load a lane: lane (g = lane / 4, c = lane % 4) holds K elements
// k + 8c .. k + 8c + 7 of A rows g and g + 8 (a[0], a[1]) and of B_j's row (column) g, and gives
// elements 0-1 / 2-3 to the first k16 step's fragment positions 2c / 2c + 8, 4-5 / 6-7 to the
// second's. A position's K element depends only on c, the same lanes in A and in B, so the
// products pair the same K elements: a permutation of the sum over K. acc[j]: rows g (0, 1) and
// g + 8 (2, 3), columns 2c (+1) of column tile j.
template <typename T, int kColTiles>
__device__ __forceinline__ void mma_rows_32k(float (&acc)[kColTiles][4], const uint4 (&a)[2],
                                             const uint4 (&b)[kColTiles]) {
#pragma unroll
  for (int j = 0; j < kColTiles; ++j) {
    mma_16x8x16<T>(acc[j], a[0].x, a[1].x, a[0].y, a[1].y, b[j].x, b[j].y);
    mma_16x8x16<T>(acc[j], a[0].z, a[1].z, a[0].w, a[1].w, b[j].z, b[j].w);
  }
}

// An entry of the segmented alignment, as every LoRA kernel reads it: its block's expert (-1:
// none, or not on this rank), its slot (-1: padding) and its adapter (-1: no adapter, an
// adapter past kMaxAdapters or not in its block's mask, or no expert or slot). `entry` < the
// used entries; call after the wait.
struct EntryRow {
  int expert = -1;
  int slot = -1;
  int lora = -1;
};
// The four index loads are issued before any of their values is tested: one memory round trip
// where the chain of checks it replaced (expert, then slot, then adapter, then the mask) took
// four. ncu's source page of the groups expand (H200, DeepSeek-V3 M = 256, GEMM2's) put 19% of
// its stall samples on that chain.
__device__ __forceinline__ EntryRow load_entry_row(const LoraDeltaParams& p, int64_t entry) {
  const int64_t block = entry / p.block_size;
  const int expert = p.expert_ids[block];
  const int slot = p.sorted_token_ids[entry];
  const int lora = p.entry_lora_ids[entry];
  const uint64_t mask = p.block_lora_masks[block];
  EntryRow row;
  row.expert = expert >= 0 && expert < p.num_experts ? expert : -1;
  row.slot = slot >= 0 && slot < p.num_slots ? slot : -1;
  if (row.expert >= 0 && row.slot >= 0 && lora >= 0 && lora < kMaxAdapters && (mask >> lora & 1)) row.lora = lora;
  return row;
}

// A 16-entry tile of the segmented alignment in a warp (block_size % 16 == 0: one block, one
// expert), for the warp-tile shrink and the groups expand: the tile's expert (-1: none or not
// local; then no lane has a row), lanes 0-15 their entry's slot (-1: none, padding or past
// `used`) and adapter (load_entry_row's), and the tile's adapters. Warp-uniform but for the
// lanes' own entries. entry0 < used; call after the wait.
struct WarpTileRows {
  int expert = -1;
  int slot = -1;
  int lora = -1;
  uint64_t adapters = 0;
};
__device__ __forceinline__ WarpTileRows load_warp_tile_rows(const LoraDeltaParams& p, int64_t entry0, int64_t used) {
  WarpTileRows rows;
  const int lane = threadIdx.x % 32;
  // Lanes 16-31 and entries past `used` read entry0's row (in range, the same block) and keep
  // only its expert.
  const bool own_entry = lane < kTileRows && entry0 + lane < used;
  const EntryRow entry = load_entry_row(p, own_entry ? entry0 + lane : entry0);
  rows.expert = entry.expert;
  if (rows.expert < 0) return rows;  // warp-uniform: one block
  if (own_entry) {
    rows.slot = entry.slot;
    rows.lora = entry.lora;
  }
  static_assert(kMaxAdapters <= 64, "a tile's adapters as two 32-bit halves");
  const uint32_t low = __reduce_or_sync(0xffffffffu, rows.lora >= 0 && rows.lora < 32 ? 1u << rows.lora : 0u);
  const uint32_t high = __reduce_or_sync(0xffffffffu, rows.lora >= 32 ? 1u << (rows.lora - 32) : 0u);
  rows.adapters = uint64_t(high) << 32 | low;
  return rows;
}

// Whether the mean (expert, adapter) run of the segmented alignment, num_slots / (num_experts
// * max_loras), is at least `entries`: the LoRA kernels' choice between tiles that share one
// pair's operands over many rows and tiles that take many pairs (host side, from the shapes).
inline bool mean_run_at_least(const LoraDeltaParams& p, int64_t entries) {
  return p.num_slots >= entries * std::max<int64_t>(p.num_experts * p.adapters.max_loras, 1);
}

// Whether every row the expand kernels move (moe_lora_expand_entries.cu, moe_lora_expand_groups.cu)
// is whole 16-byte vectors at 16-byte addresses: the rank (t and lora_b rows), the strides in
// elements and the base pointers.
inline bool vectors_fit(const LoraDeltaParams& p, int element_bytes) {
  const int per_vector = 16 / element_bytes;
  bool fit = p.rank % per_vector == 0 && p.out_stride_n == 1 && p.out_stride_row % per_vector == 0 &&
             p.N_slice * p.num_slices % per_vector == 0 && aligned16(p.out) && aligned16(p.intermediate);
  for (int c = 0; c < p.num_slices; ++c) {
    const detail::LoraSliceParams& sl = p.slices[c];
    fit = fit && aligned16(sl.lora_b) && sl.b_stride_lora % per_vector == 0 && sl.b_stride_expert % per_vector == 0 &&
          sl.b_stride_n % per_vector == 0;
  }
  return fit;
}

// Output column j (of num_slices * N_slice) as its slice and the column within it. One slice:
// no division; columns below 2^31 (every model's): a 32-bit one, a few instructions where a
// 64-bit division takes ~70.
__device__ __forceinline__ void column_slice(const LoraDeltaParams& p, int64_t j, int& c, int64_t& jn) {
  if (p.num_slices == 1) {
    c = 0;
    jn = j;
    return;
  }
  if (j <= INT32_MAX && p.N_slice <= INT32_MAX) {
    const uint32_t j32 = uint32_t(j), slices = uint32_t(p.num_slices), n_slice = uint32_t(p.N_slice);
    const uint32_t q = p.interleaved_slices ? j32 / slices : j32 / n_slice;
    c = int(p.interleaved_slices ? j32 - q * slices : q);
    jn = p.interleaved_slices ? int64_t(q) : int64_t(j32 - q * n_slice);
    return;
  }
  if (p.interleaved_slices) {
    c = int(j % p.num_slices);
    jn = j / p.num_slices;
  } else {
    c = int(j / p.N_slice);
    jn = j % p.N_slice;
  }
}

// The most slices x padded rank moe_lora_expand_groups takes (its per-warp t and lora_b tiles;
// GEMM2's expand up to rank 64, GEMM1's two slices up to rank 32).
constexpr int kExpandGroupsMaxKExtent = 64;
// The K of moe_lora_expand_groups' MMAs: slices x padded rank (its kernel's instance).
inline int expand_groups_k_extent(const LoraDeltaParams& p) { return p.num_slices * round_up16(int(p.rank)); }
// Whether moe_lora_expand_groups takes p's slices x padded rank (its callers also need vectors_fit).
inline bool expand_groups_fit(const LoraDeltaParams& p) { return expand_groups_k_extent(p) <= kExpandGroupsMaxKExtent; }

// Two adjacent elements of a tile row, moved as one 32-bit shared access.
template <typename T>
struct alignas(4) ElementPair {
  T v[2];
};

// A warp's 16 output rows in shared memory (row-major, pitch kFragments * 16 + kPad, from
// warp_rows) += acc (mma_adapter_rows' fragments), each sum rounded to T as a write to global
// memory would be. A lane's two columns of a fragment are adjacent (an even column, so 4-byte
// aligned): one 32-bit load and store each, where two 2-byte ones were (ncu at Qwen3-30B
// M = 4096, dfb4c78: the join's L1 67% busy, 36% of its shared wavefronts excessive).
template <typename T, int kFragments>
__device__ __forceinline__ void add_fragment_sums(T* warp_rows, const float (&acc)[kFragments][8]) {
  constexpr int kPitch = kFragments * 16 + kPad;
  const int lane = threadIdx.x % 32;
  T* rows = warp_rows + (lane / 4) * kPitch + (lane % 4) * 2;
#pragma unroll
  for (int f = 0; f < kFragments; ++f) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {  // rows lane / 4 and lane / 4 + 8
        auto* at = reinterpret_cast<ElementPair<T>*>(rows + half * 8 * kPitch + f * 16 + h * 8);
        ElementPair<T> sum = *at;
        sum.v[0] = from_float<T>(to_float(sum.v[0]) + acc[f][4 * h + 2 * half]);
        sum.v[1] = from_float<T>(to_float(sum.v[1]) + acc[f][4 * h + 2 * half + 1]);
        *at = sum;
      }
    }
  }
}

// Output element of slot s at column j of slice c.
__device__ __forceinline__ int64_t out_offset(const LoraDeltaParams& p, int64_t s, int c, int64_t j) {
  const int64_t col = p.interleaved_slices ? j * p.num_slices + c : c * p.N_slice + j;
  return s * p.out_stride_row + col * p.out_stride_n;
}

// a_row · lora_row over K, 16-byte loads strided over the warp's lanes, reduced across the
// warp (every lane gets the sum). K % Vec16 == 0 and 16-byte aligned rows (the launchers
// check shrink_gemv_loadable).
template <typename T>
__device__ __forceinline__ float warp_dot_rows(const T* a_row, const T* lora_row, int64_t K, int lane) {
  constexpr int kVec = Vec16<T>::kSize;
  float acc = 0.f;
  for (int64_t k = int64_t(lane) * kVec; k < K; k += 32 * kVec) {
    const Vec16<T> x = *reinterpret_cast<const Vec16<T>*>(a_row + k);
    const Vec16<T> w = *reinterpret_cast<const Vec16<T>*>(lora_row + k);
#pragma unroll
    for (int v = 0; v < kVec; ++v) acc = fmaf(to_float(x.v[v]), to_float(w.v[v]), acc);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
  return acc;
}

// The shrink GEMV's 16-byte loads: K a multiple of the vector, every row start aligned.
template <typename T>
bool shrink_gemv_loadable(const LoraDeltaParams& p) {
  constexpr int64_t kVec = Vec16<T>::kSize;
  bool ok = p.K % kVec == 0 && p.a_stride_row % kVec == 0 && aligned16(p.a);
  for (int c = 0; c < p.num_slices; ++c) {
    const detail::LoraSliceParams& sl = p.slices[c];
    ok = ok && aligned16(sl.lora_a) && sl.a_stride_lora % kVec == 0 && sl.a_stride_expert % kVec == 0 &&
         sl.a_stride_rank % kVec == 0;
  }
  return ok;
}

}  // namespace moelora::cuda::lora_tiles
