// moe_lora_delta on CUDA: the LoRA delta of an expert GEMM in two launches.
//   shrink: intermediate[s, c, :rank] = a[s / a_top_k] · lora_a[c][l, e]ᵀ
//   expand: out[s, col(c, j)] (+)= scale[l] · intermediate[s, c] · lora_b[c][l, e, j]ᵀ (× w_s)
// See LoraDeltaParams (src/common/params.h) for the contract.
//
// Work comes in row tiles of kTileRows slots that share one (expert, adapter): a 16-row
// slice of a block of the virtual alignment, or a single slot in the per-slot mode (small
// batch, straight from topk_ids). A tile whose adapter is -1 or disabled, or whose
// expert is -1, skips the LoRA work (a uniform branch per CTA); without add_inputs the
// expand writes its rows' zeros.
// On the segmented alignment (fused_experts' fused path) only the shrink runs here, t by
// entry, split over K (moe_lora_shrink_segmented_kernel); the expand is in the GEMM.
// 16-bit types run on the tensor cores (mma.sync 16x8x16, fp32 accumulation); fp32 runs the
// same tiles on CUDA cores. Ranks are padded to 16 inside the kernels (zero rows of
// lora_a and zero columns of lora_b in shared memory); callers never pad.
// NOTE: a first, separate-kernel path (fused_experts with adapters adds the delta after
// each GEMM). Seed 003's fusion into the expert GEMM is the next step (docs/PERF_NOTES.md).
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm80.hpp>

#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>

#include "common/params.h"
#include "cuda/cuda_check.h"
#include "cuda/device_info.h"
#include "cuda/launch.cuh"
#include "cuda/mma_sm80.cuh"
#include "cuda/moe_lora_tiles.cuh"
#include "cuda/numeric.cuh"

namespace moelora::cuda {
namespace {

using detail::LoraDeltaParams;
using namespace lora_tiles;

constexpr int kShrinkThreads = 256;           // 8 warps: one 16-column rank fragment each

// K elements a shrink stage holds: 128 bytes a row.
template <typename T>
constexpr int kShrinkK = 128 / int(sizeof(T));

// The expert and adapter of one tile (its slots sit in shared memory; -1 marks an empty row).
struct Tile {
  int expert = -1;
  int lora = -1;
  bool active = false;  // expert and adapter valid, adapter enabled
};

__device__ __forceinline__ int64_t load_topk_id(const LoraDeltaParams& p, int64_t slot) {
  const int64_t token = slot / p.top_k, j = slot - token * p.top_k;
  const int64_t offset = token * p.topk_ids_stride_token + j * p.topk_ids_stride_k;
  return p.topk_ids_int64 ? static_cast<const int64_t*>(p.topk_ids)[offset]
                          : int64_t(static_cast<const int32_t*>(p.topk_ids)[offset]);
}

// Whether tile t's expert and adapter are valid and the adapter enabled.
__device__ __forceinline__ bool tile_active(const LoraDeltaParams& p, const Tile& t) {
  return t.expert >= 0 && t.expert < p.num_experts && t.lora >= 0 && t.lora < p.adapters.max_loras &&
         (p.adapters.adapter_enabled == nullptr || p.adapters.adapter_enabled[t.lora] != 0);
}

// The (expert, adapter) of a slot in the per-slot mode.
__device__ __forceinline__ Tile slot_tile(const LoraDeltaParams& p, int64_t slot) {
  Tile t;
  const int64_t e = load_topk_id(p, slot);
  t.expert = e >= 0 && e < p.num_global_experts ? (p.expert_map ? p.expert_map[e] : int(e)) : -1;
  t.lora = p.adapters.token_lora_ids[(slot / p.top_k) * p.adapters.token_lora_ids_stride];
  if (int32_t* status = p.adapters.routing_status) {  // fused_experts' word: the ids it cannot use
    if (e < -1 || e >= p.num_global_experts) atomicOr(status, kRoutingBadExpertId);
    if (t.lora < -1 || t.lora >= p.adapters.max_loras) atomicOr(status, kRoutingBadAdapterId);
  }
  t.active = tile_active(p, t);
  return t;
}

// The factor on slot s's delta: the adapter's scale (× the slot's routed weight).
__device__ __forceinline__ float delta_weight(const LoraDeltaParams& p, const Tile& t, int64_t s) {
  float w = p.adapters.adapter_scale ? p.adapters.adapter_scale[t.lora] : 1.f;
  if (p.topk_weights) {
    w *= p.topk_weights[(s / p.topk_weights_cols) * p.topk_weights_stride_row +
                        (s % p.topk_weights_cols) * p.topk_weights_stride_col];
  }
  return w;
}

// Number of tiles the grid covers (host: from capacities; device-side counts decide
// which of them have work).
inline int64_t num_tiles(const LoraDeltaParams& p) {
  return p.sorted_token_ids ? p.max_num_blocks * (p.block_size / kTileRows) : p.num_slots;
}

// Fills slots[kTileRows] (shared) and returns the tile's (expert, adapter). Every thread
// calls it; thread r < kTileRows writes slots[r]. Returns false when the tile lies past
// the used length (the CTA has nothing to do, not even zeros).
__device__ bool load_tile(const LoraDeltaParams& p, int64_t tile, int* slots, Tile& t) {
  if (p.sorted_token_ids) {
    const int64_t tiles_per_block = p.block_size / kTileRows;
    const int64_t block = tile / tiles_per_block;
    const int64_t entry0 = block * p.block_size + (tile - block * tiles_per_block) * kTileRows;
    const int64_t used = used_entries(p);
    if (entry0 >= used) return false;
    t.expert = p.expert_ids[block];
    t.lora = p.block_lora_ids[block];
    t.active = tile_active(p, t);
    if (threadIdx.x < kTileRows) {
      const int64_t entry = entry0 + threadIdx.x;
      const int64_t s = entry < used ? p.sorted_token_ids[entry] : -1;
      slots[threadIdx.x] = s >= 0 && s < p.num_slots ? int(s) : -1;
    }
  } else {
    t = slot_tile(p, tile);
    if (threadIdx.x < kTileRows) slots[threadIdx.x] = threadIdx.x == 0 ? int(tile) : -1;
  }
  return true;
}

// ---- shrink -----------------------------------------------------------------------------
// Grid (tiles, slices). intermediate[s, c, i] = Σ_k a[s / a_top_k, k] · lora_a[c][l, e, i, k].
// kVecLoads: 16-byte loads of a and lora_a (K % 8 == 0, aligned rows).
template <typename T, bool kVecLoads>
__global__ void __launch_bounds__(kShrinkThreads) moe_lora_shrink_kernel(const LoraDeltaParams p) {
  constexpr int BK = kShrinkK<T>;
  __shared__ int slots[kTileRows];
  __shared__ alignas(32) T a_tile[kTileRows][BK + kPad];
  __shared__ alignas(32) T lora_tile[kMaxRankPadded][BK + kPad];
  __shared__ alignas(32) float result[kTileRows][kMaxRankPadded + 4];

  wait_for_previous_kernel();
  Tile t;
  if (!load_tile(p, blockIdx.x, slots, t)) return;
  __syncthreads();
  if (t.active) {
    const int c = blockIdx.y;
    const int rank = int(p.rank), rank_padded = round_up16(rank);
    const detail::LoraSliceParams& sl = p.slices[c];
    const T* a = static_cast<const T*>(p.a);
    const T* lora_a = static_cast<const T*>(sl.lora_a) + t.lora * sl.a_stride_lora + t.expert * sl.a_stride_expert;
    const int warp = threadIdx.x / 32;
    const T zero = from_float<T>(0.f);

    float acc[8] = {};  // a 16 x 16 mma tile, or (fp32) outputs threadIdx.x + j * kShrinkThreads
    for (int64_t k0 = 0; k0 < p.K; k0 += BK) {
      if constexpr (kVecLoads) {
        // K % kVec == 0: a vector is wholly inside K or wholly past it.
        constexpr int kVec = Vec16<T>::kSize, kVecsPerRow = BK / kVec;
        Vec16<T> zeros;
  #pragma unroll
        for (int v = 0; v < kVec; ++v) zeros.v[v] = zero;
        for (int i = threadIdx.x; i < kTileRows * kVecsPerRow; i += kShrinkThreads) {
          const int r = i / kVecsPerRow, k = (i % kVecsPerRow) * kVec;
          const int s = slots[r];
          *reinterpret_cast<Vec16<T>*>(&a_tile[r][k]) =
              s >= 0 && k0 + k < p.K ? *reinterpret_cast<const Vec16<T>*>(a + (s / p.a_top_k) * p.a_stride_row + k0 + k)
                                     : zeros;
        }
        for (int i = threadIdx.x; i < rank_padded * kVecsPerRow; i += kShrinkThreads) {
          const int r = i / kVecsPerRow, k = (i % kVecsPerRow) * kVec;
          *reinterpret_cast<Vec16<T>*>(&lora_tile[r][k]) =
              r < rank && k0 + k < p.K ? *reinterpret_cast<const Vec16<T>*>(lora_a + r * sl.a_stride_rank + k0 + k)
                                       : zeros;
        }
      } else {
        for (int i = threadIdx.x; i < kTileRows * BK; i += kShrinkThreads) {
          const int r = i / BK, k = i % BK;
          const int s = slots[r];
          a_tile[r][k] = s >= 0 && k0 + k < p.K ? a[(s / p.a_top_k) * p.a_stride_row + k0 + k] : zero;
        }
        for (int i = threadIdx.x; i < rank_padded * BK; i += kShrinkThreads) {
          const int r = i / BK, k = i % BK;
          lora_tile[r][k] = r < rank && k0 + k < p.K ? lora_a[r * sl.a_stride_rank + k0 + k] : zero;
        }
      }
      __syncthreads();
      if constexpr (kTensorCores<T>) {
        if (warp * 16 < rank_padded) {
          mma_16x16_accumulate<T>(acc, smem_addr(&a_tile[0][0] + mma_lane_a(BK + kPad)),
                                  smem_addr(&lora_tile[warp * 16][0] + mma_lane_b(BK + kPad)), BK);
        }
      } else {
        // Thread o computes outputs o + j * kShrinkThreads of the [16, rank_padded] tile.
        for (int j = 0; j < 8; ++j) {
          const int o = threadIdx.x + j * kShrinkThreads;
          if (o >= kTileRows * rank_padded) break;
          const int r = o / rank_padded, i = o % rank_padded;
          float sum = 0.f;
          for (int k = 0; k < BK; ++k) sum += to_float(a_tile[r][k]) * to_float(lora_tile[i][k]);
          acc[j] += sum;
        }
      }
      __syncthreads();
    }
    if constexpr (kTensorCores<T>) {
      if (warp * 16 < rank_padded) store_mma_16x16(&result[0][warp * 16], kMaxRankPadded + 4, acc);
    } else {
      for (int j = 0; j < 8; ++j) {
        const int o = threadIdx.x + j * kShrinkThreads;
        if (o >= kTileRows * rank_padded) break;
        result[o / rank_padded][o % rank_padded] = acc[j];
      }
    }
    __syncthreads();
    T* out = static_cast<T*>(p.intermediate);
    for (int i = threadIdx.x; i < kTileRows * rank; i += kShrinkThreads) {
      const int r = i / rank, col = i % rank;
      if (slots[r] >= 0) out[(int64_t(slots[r]) * p.num_slices + c) * rank + col] = from_float<T>(result[r][col]);
    }
  }
  allow_next_kernel_launch();
}

// ---- shrink on the segmented alignment (fused_experts' fused path) ------------------------
// t[entry, c * rank + i] = scale[l] · a[row(entry)] · lora_a[c][l, e, i]ᵀ for each entry of
// an enabled adapter l (row = the entry with a_rows_by_entry, else slot / a_top_k).
//
// Grid (blocks, K splits, row groups of kSegGroupRows): a CTA takes up to 64 rows of one
// block of the alignment and a K range, and each adapter run among its rows in turn:
// [run rows, slices * rank_padded] = rows · lora_aᵀ on mma.sync, both operands through a
// cp.async ring (the adapter's lora_a rows of every slice in one pass), as deep as the
// pass's rows let kSegRingBytes be.
// With several splits each CTA writes fp32 partial sums, and the group's last CTA to
// arrive adds them in split order (the result does not depend on arrival order), scales
// and writes t.
// NOTE: measured on H100 (docs/PERF_NOTES.md, issue 4 step 3): one CTA per 16 entries and
// slice walking K in 64-element steps was latency-bound (Mixtral M = 64, r = 16: 2.97 ms
// layer against 1.06 base); whole 128-row blocks per CTA with per-chunk address math
// were instruction-bound (0.3 issues/cycle, 168 registers, 1 CTA/SM; Mixtral M = 4096
// GEMM2 shrink 482 us for 240 MB). Hence 64-row groups, source rows resolved once per
// pass, and splits that fill the SMs.
constexpr int kSegThreads = 256;          // 8 warps, up to kSegFragsPerWarp accumulators each
constexpr int kSegBK = 64;                // K elements a ring slot holds: 128 bytes of bf16
constexpr int kSegLd = kSegBK + kPad;     // smem row pitch (elements)
constexpr int kSegGroupRows = 64;         // rows a CTA takes: a pass is [64, 128] at most
constexpr int kSegPassCols = 128;
// The ring: 4 slots of the largest pass ([64 + 128 rows, kSegLd] of 16-bit), so two CTAs
// fit an SM. A pass cuts it into as many slots as its rows allow (kSegMaxStages at most):
// a run of a few rows and rank 16 has slots of 48 rows, 16 of them.
constexpr size_t kSegRingBytes = size_t(4) * (kSegGroupRows + kSegPassCols) * kSegLd * 2;
constexpr int kSegMaxStages = 16;
constexpr int kSegFragsPerWarp = kSegGroupRows / 16 * kSegPassCols / 16 / (kSegThreads / 32);
constexpr int kSegChunkRounds = (kSegGroupRows + kSegPassCols) / (kSegThreads / 8);  // 16-byte chunks per thread
constexpr int kSegMaxBlockSize = 256;     // kMaxBlockSize
constexpr int kSegMaxSplits = 32;
constexpr int kSegMinSplitK = 256;        // K a split covers at least (amortises the group's setup)
constexpr int kSegMaxAdapters = 64;       // kMaxLoraAdapters: bits of block_lora_masks

struct SegmentedShrinkSplit {
  int splits;       // CTAs per row group along K
  int64_t k_chunk;  // K a split covers, a multiple of kSegBK
  int group_rows;   // min(block_size, kSegGroupRows)
  int pass_cols;    // min(slices * rank_padded, kSegPassCols)
};

// The fp32 result tile of a pass takes the ring's place once the pass's K loop is done.
static_assert(size_t(kSegGroupRows) * (kSegPassCols + 4) * sizeof(float) <= kSegRingBytes);

// cp.async.wait_group takes an immediate: the ring's depth is chosen per pass.
__device__ __forceinline__ void cp_async_wait_pending(int pending) {
  switch (pending) {
#define MOELORA_WAIT_CASE(n) \
  case n:                    \
    cute::cp_async_wait<n>(); \
    break;
    MOELORA_WAIT_CASE(1) MOELORA_WAIT_CASE(2) MOELORA_WAIT_CASE(3) MOELORA_WAIT_CASE(4) MOELORA_WAIT_CASE(5)
    MOELORA_WAIT_CASE(6) MOELORA_WAIT_CASE(7) MOELORA_WAIT_CASE(8) MOELORA_WAIT_CASE(9) MOELORA_WAIT_CASE(10)
    MOELORA_WAIT_CASE(11) MOELORA_WAIT_CASE(12) MOELORA_WAIT_CASE(13) MOELORA_WAIT_CASE(14)
#undef MOELORA_WAIT_CASE
    default:
      cute::cp_async_wait<0>();
  }
}

template <typename T, bool kAsync>
__global__ void __launch_bounds__(kSegThreads, 2) moe_lora_shrink_segmented_kernel(const LoraDeltaParams p,
                                                                               const SegmentedShrinkSplit split) {
  static_assert(kTensorCores<T>, "the fused path runs 16-bit types");
  constexpr int kVec = Vec16<T>::kSize, kChunksPerRow = kSegBK / kVec;
  extern __shared__ __align__(128) unsigned char seg_smem[];
  __shared__ int row_lora[kSegGroupRows];  // each group row's adapter, -1: none or padding
  __shared__ int row_a[kSegGroupRows];     // its row of a
  __shared__ int run_begin[kSegMaxAdapters], run_end[kSegMaxAdapters];
  __shared__ uint64_t group_mask;
  __shared__ bool last_split;

  wait_for_previous_kernel();
  // The GEMM after this kernel may launch now: with GemmParams::lora_late_wait it streams
  // its base K steps beside this shrink and waits before reading lora_t; without it, it
  // waits at entry. Every kernel before this one has completed (the wait above).
  allow_next_kernel_launch();
  const int64_t block = blockIdx.x;
  const int rows_in_group = split.group_rows;
  const int64_t entry0 = block * p.block_size + int64_t(blockIdx.z) * rows_in_group;  // the group's first entry
  const int64_t used = used_entries(p);
  const int expert = entry0 < used ? p.expert_ids[block] : -1;
  const uint64_t block_mask = expert >= 0 && expert < p.num_experts ? p.block_lora_masks[block] : 0;
  if (block_mask == 0) return;  // the same in every split of the group: none counts
  if (threadIdx.x == 0) group_mask = 0;
  for (int l = threadIdx.x; l < kSegMaxAdapters; l += kSegThreads) run_begin[l] = INT_MAX, run_end[l] = -1;
  __syncthreads();
  if (int(threadIdx.x) < rows_in_group) {
    const int r = threadIdx.x;
    const int64_t entry = entry0 + r;
    const int slot = entry < used ? p.sorted_token_ids[entry] : -1;
    int l = slot >= 0 && slot < p.num_slots ? p.entry_lora_ids[entry] : -1;
    l = l >= 0 && l < kSegMaxAdapters && (block_mask >> l & 1) ? l : -1;
    row_lora[r] = l;
    row_a[r] = l < 0 ? -1 : p.a_rows_by_entry ? int(entry) : slot / int(p.a_top_k);
    if (l >= 0) {
      atomicMin(&run_begin[l], r);
      atomicMax(&run_end[l], r + 1);
      atomicOr(reinterpret_cast<unsigned long long*>(&group_mask), 1ull << l);
    }
  }
  __syncthreads();
  const uint64_t mask = group_mask;
  if (mask == 0) return;  // the same in every split of the group

  const int rank = int(p.rank), rank_padded = round_up16(rank);
  const int cols = p.num_slices * rank_padded;  // t's columns, each slice padded to 16
  const int t_cols = p.num_slices * rank;
  const int64_t k_begin = int64_t(blockIdx.y) * split.k_chunk;
  const int64_t k_end = min(p.K, k_begin + split.k_chunk);
  const int num_k_tiles = int((k_end - k_begin + kSegBK - 1) / kSegBK);
  const T* a = static_cast<const T*>(p.a);
  T* t = static_cast<T*>(p.intermediate);
  T* ring = reinterpret_cast<T*>(seg_smem);
  uint32_t ring_addr = cute::cast_smem_ptr_to_uint(seg_smem);
  asm volatile("" : "+r"(ring_addr));  // opaque, so ptxas keeps it rather than rebuilding it at every copy
  float* result = reinterpret_cast<float*>(seg_smem);
  const int result_ld = split.pass_cols + 4;
  const int warp = threadIdx.x / 32;
  // A thread copies the chunks at one K column of rows threadIdx.x / 8 + 32 j.
  const int k_col = (threadIdx.x % kChunksPerRow) * kVec;
  const int row_base = threadIdx.x / kChunksPerRow;
  constexpr int kRowsPerRound = kSegThreads / kChunksPerRow;

  for (uint64_t pending = mask; pending != 0; pending &= pending - 1) {
    const int l = __ffsll(static_cast<long long>(pending)) - 1;
    // The run: consecutive rows in the segmented alignment (rows of other adapters inside
    // it would load as zeros).
    const int r0 = run_begin[l], rows = run_end[l] - r0, rows_padded = round_up16(rows);
    for (int c0 = 0; c0 < cols; c0 += split.pass_cols) {
      const int pass_cols = min(split.pass_cols, cols - c0);
      const int frag_cols = pass_cols / 16, num_frags = rows_padded / 16 * frag_cols;
      // A slot holds the run's rows of a, then the pass's lora_a rows.
      const int stage_rows = rows_padded + pass_cols, stage_elems = stage_rows * kSegLd;
      const int stages = min(kSegMaxStages, int(kSegRingBytes / (size_t(stage_elems) * sizeof(T))));
      // Each chunk's source at k_begin and offset in a slot, resolved once for the pass, so
      // a k-tile's copy is a pointer step, an add and the cp.async. has_src bit j: chunk j
      // has a source (else zeros: src[j] is then row 0 of a, a valid address never read).
      const T* src[kSegChunkRounds];
      int dst[kSegChunkRounds];  // element offset in the slot, -1: no chunk
      uint32_t has_src = 0;
#pragma unroll
      for (int j = 0; j < kSegChunkRounds; ++j) {
        const int row = row_base + j * kRowsPerRound;
        src[j] = a;
        dst[j] = row < stage_rows ? row * kSegLd + k_col : -1;
        if (row < rows_padded) {
          if (row < rows && row_lora[r0 + row] == l) {
            src[j] = a + int64_t(row_a[r0 + row]) * p.a_stride_row + k_begin + k_col;
            has_src |= 1u << j;
          }
        } else if (row < stage_rows) {
          const int n = c0 + row - rows_padded, c = n / rank_padded, i_rank = n - c * rank_padded;
          const detail::LoraSliceParams& sl = p.slices[c];
          if (i_rank < rank) {
            src[j] = static_cast<const T*>(sl.lora_a) + l * sl.a_stride_lora + expert * sl.a_stride_expert +
                     i_rank * sl.a_stride_rank + k_begin + k_col;
            has_src |= 1u << j;
          }
        }
      }
      const int k_left = int(k_end - k_begin) - k_col;  // K this thread's chunks have from k_begin + k_col
      auto load_stage = [&](int slot, int k_tile) {
        const int k = k_tile * kSegBK;
        const bool k_in = k < k_left;  // K % 8 == 0: a chunk is all in or out
        // The step is 0 past the end, so every address stays inside its row (never read then).
        const int k_step = k_in ? k : 0;
        const uint32_t slot_addr = ring_addr + uint32_t(slot * stage_elems * sizeof(T));
#pragma unroll
        for (int j = 0; j < kSegChunkRounds; ++j) {
          if (dst[j] < 0) continue;
          if constexpr (kAsync) {
            cp_async_16_zfill(slot_addr + uint32_t(dst[j] * sizeof(T)), src[j] + k_step, (has_src >> j & 1) && k_in);
          } else {
            const int chunk_left = (has_src >> j & 1) ? k_left - k : 0;
#pragma unroll
            for (int v = 0; v < kVec; ++v) {
              ring[slot * stage_elems + dst[j] + v] = v < chunk_left ? src[j][k + v] : from_float<T>(0.f);
            }
          }
        }
      };
      // This warp's fragments: 16 x 16 tiles f = warp + 8 j of the pass's [rows_padded,
      // pass_cols] result, each two mma.m16n8k16 (n halves) fed by ldmatrix.x4. Lane
      // offsets: A's matrices are rows 0-7 / 8-15 at k 0 / 8, B's n 0-7 at k 0 / 8, then n 8-15.
      const int a_lane = mma_lane_a(kSegLd), b_lane = rows_padded * kSegLd + mma_lane_b(kSegLd);
      int a_off[kSegFragsPerWarp], b_off[kSegFragsPerWarp];
      float acc[kSegFragsPerWarp][8];
#pragma unroll
      for (int j = 0; j < kSegFragsPerWarp; ++j) {
        const int f = warp + 8 * j;
        a_off[j] = (f / max(frag_cols, 1)) * 16 * kSegLd + a_lane;
        b_off[j] = (f % max(frag_cols, 1)) * 16 * kSegLd + b_lane;
#pragma unroll
        for (int v = 0; v < 8; ++v) acc[j][v] = 0.f;
      }

      for (int stage = 0; stage < stages - 1; ++stage) {
        if (stage < num_k_tiles) load_stage(stage, stage);
        cute::cp_async_fence();
      }
      for (int k_tile = 0, slot = 0; k_tile < num_k_tiles; ++k_tile, slot = slot + 1 == stages ? 0 : slot + 1) {
        cp_async_wait_pending(stages - 2);
        __syncthreads();  // k_tile's slot is full; every warp is done with the slot refilled below
        if (k_tile + stages - 1 < num_k_tiles) load_stage(slot == 0 ? stages - 1 : slot - 1, k_tile + stages - 1);
        cute::cp_async_fence();
        const uint32_t slot_addr = ring_addr + uint32_t(slot * stage_elems * sizeof(T));
#pragma unroll
        for (int j = 0; j < kSegFragsPerWarp; ++j) {
          if (warp + 8 * j < num_frags) {
            mma_16x16_accumulate<T>(acc[j], slot_addr + a_off[j] * sizeof(T), slot_addr + b_off[j] * sizeof(T), kSegBK);
          }
        }
      }
      cute::cp_async_wait<0>();
      __syncthreads();  // the ring is idle: the result tile takes its place
#pragma unroll
      for (int j = 0; j < kSegFragsPerWarp; ++j) {
        const int f = warp + 8 * j;
        if (f < num_frags) {
          store_mma_16x16(result + (f / frag_cols) * 16 * result_ld + (f % frag_cols) * 16, result_ld, acc[j]);
        }
      }
      __syncthreads();
      const float scale = p.adapters.adapter_scale ? p.adapters.adapter_scale[l] : 1.f;
      for (int i = threadIdx.x; i < rows * pass_cols; i += kSegThreads) {
        const int row = i / pass_cols, n = i - row * pass_cols;
        const int c = (c0 + n) / rank_padded, i_rank = (c0 + n) - c * rank_padded;
        if (row_lora[r0 + row] != l || i_rank >= rank) continue;
        const int64_t at = (entry0 + r0 + row) * t_cols + c * rank + i_rank;
        const float v = result[row * result_ld + n];
        if (split.splits == 1) {
          t[at] = from_float<T>(scale * v);
        } else {
          p.shrink_partials[int64_t(blockIdx.y) * p.segmented_entries * t_cols + at] = v;
        }
      }
      __syncthreads();  // the next pass refills the ring
    }
  }
  if (split.splits > 1) {
    // The last CTA of the group: partial sums visible device-wide before the arrival.
    int32_t& arrivals = p.shrink_counters[entry0 / 16];
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
      last_split = atomicAdd(&arrivals, 1) == split.splits - 1;
      if (last_split) arrivals = 0;  // zero for the next shrink
    }
    __syncthreads();
    if (last_split) {
      __threadfence();
      const int64_t split_stride = p.segmented_entries * t_cols;
      for (int i = threadIdx.x; i < rows_in_group * t_cols; i += kSegThreads) {
        const int r = i / t_cols;
        const int l = row_lora[r];
        if (l < 0) continue;
        const int64_t at = (entry0 + r) * t_cols + (i - r * t_cols);
        float sum = 0.f;
        for (int s = 0; s < split.splits; ++s) sum += __ldcg(p.shrink_partials + s * split_stride + at);
        t[at] = from_float<T>((p.adapters.adapter_scale ? p.adapters.adapter_scale[l] : 1.f) * sum);
      }
    }
  }
}

// ---- expand -----------------------------------------------------------------------------
// Grid (tiles, slices, column chunks of kExpandColumns).
template <typename T>
__global__ void __launch_bounds__(kExpandThreads) moe_lora_expand_kernel(const LoraDeltaParams p) {
  __shared__ int slots[kTileRows];
  __shared__ alignas(32) T t_tile[kTileRows][kMaxRankPadded + kPad];
  __shared__ alignas(32) T lora_tile[kExpandColumns][kMaxRankPadded + kPad];
  __shared__ alignas(32) float result[kTileRows][kExpandColumns + 4];

  wait_for_previous_kernel();
  Tile t;
  if (!load_tile(p, blockIdx.x, slots, t)) return;
  __syncthreads();
  const int c = blockIdx.y;
  const int64_t n0 = int64_t(blockIdx.z) * kExpandColumns;
  const int columns = p.N_slice - n0 < kExpandColumns ? int(p.N_slice - n0) : kExpandColumns;
  T* out = static_cast<T*>(p.out);
  if (!t.active) {
    if (!p.add_inputs) {
      for (int i = threadIdx.x; i < kTileRows * columns; i += kExpandThreads) {
        const int s = slots[i / columns];
        if (s >= 0) out[out_offset(p, s, c, n0 + i % columns)] = from_float<T>(0.f);
      }
    }
    return;
  }
  const int rank = int(p.rank), rank_padded = round_up16(rank);
  const detail::LoraSliceParams& sl = p.slices[c];
  const T* lora_b = static_cast<const T*>(sl.lora_b) + t.lora * sl.b_stride_lora + t.expert * sl.b_stride_expert;
  const T* inter = static_cast<const T*>(p.intermediate);
  const T zero = from_float<T>(0.f);
  for (int i = threadIdx.x; i < kTileRows * rank_padded; i += kExpandThreads) {
    const int r = i / rank_padded, k = i % rank_padded;
    const int s = slots[r];
    t_tile[r][k] = s >= 0 && k < rank ? inter[(int64_t(s) * p.num_slices + c) * rank + k] : zero;
  }
  for (int i = threadIdx.x; i < kExpandColumns * rank_padded; i += kExpandThreads) {
    const int n = i / rank_padded, k = i % rank_padded;
    lora_tile[n][k] = n < columns && k < rank ? lora_b[(n0 + n) * sl.b_stride_n + k] : zero;
  }
  __syncthreads();
  const int warp = threadIdx.x / 32;
  if constexpr (kTensorCores<T>) {
    float acc[8] = {};
    mma_16x16_accumulate<T>(acc, smem_addr(&t_tile[0][0] + mma_lane_a(kMaxRankPadded + kPad)),
                            smem_addr(&lora_tile[warp * 16][0] + mma_lane_b(kMaxRankPadded + kPad)), rank_padded);
    store_mma_16x16(&result[0][warp * 16], kExpandColumns + 4, acc);
  } else {
    for (int o = threadIdx.x; o < kTileRows * kExpandColumns; o += kExpandThreads) {
      const int r = o / kExpandColumns, n = o % kExpandColumns;
      float sum = 0.f;
      for (int k = 0; k < rank_padded; ++k) sum += to_float(t_tile[r][k]) * to_float(lora_tile[n][k]);
      result[r][n] = sum;
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kTileRows * columns; i += kExpandThreads) {
    const int r = i / columns, n = i % columns;
    const int s = slots[r];
    if (s < 0) continue;
    const int64_t at = out_offset(p, s, c, n0 + n);
    const float base = p.add_inputs ? to_float(out[at]) : 0.f;
    out[at] = from_float<T>(base + delta_weight(p, t, s) * result[r][n]);
  }
  allow_next_kernel_launch();
}

// ---- per-slot mode (small batch): CUDA-core GEMV kernels ----------------------------------
// NOTE: at decode the tile kernels above left the GPU idle: a handful of CTAs each walked
// K in 64-element steps (Qwen3-30B M = 1: 88 us for the four delta launches, H100).
// Here every (slot, slice, rank row) dot product is a warp of 16-byte loads over K, and
// the expand a thread per output column.
constexpr int kGemvThreads = 256;
constexpr int kExpandGemvColumns = kGemvThreads;

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

// Warp per item (slot, slice, rank row): intermediate[s, c, i] = a[s / a_top_k] · lora_a[c][l, e, i].
// K % 8 == 0 and 16-byte aligned rows (checked by the launcher).
template <typename T>
__global__ void __launch_bounds__(kGemvThreads) moe_lora_shrink_gemv_kernel(const LoraDeltaParams p) {
  wait_for_previous_kernel();
  // The next kernel may launch now: the expand waits for this one, and the small-batch
  // GEMMs (late_delta_wait) stream their weights beside it. Nothing launched after this
  // kernel writes what it reads before its own wait.
  allow_next_kernel_launch();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t items = p.num_slots * p.num_slices * p.rank;
  for (int64_t item = int64_t(blockIdx.x) * (kGemvThreads / 32) + warp; item < items;
       item += int64_t(gridDim.x) * (kGemvThreads / 32)) {
    const int64_t i = item % p.rank, slice_slot = item / p.rank;
    const int c = int(slice_slot % p.num_slices);
    const int64_t s = slice_slot / p.num_slices;
    const Tile t = slot_tile(p, s);
    if (!t.active) continue;
    const detail::LoraSliceParams& sl = p.slices[c];
    const T* a_row = static_cast<const T*>(p.a) + (s / p.a_top_k) * p.a_stride_row;
    const T* lora_row = static_cast<const T*>(sl.lora_a) + t.lora * sl.a_stride_lora + t.expert * sl.a_stride_expert +
                        i * sl.a_stride_rank;
    const float acc = warp_dot_rows(a_row, lora_row, p.K, lane);
    if (lane == 0) static_cast<T*>(p.intermediate)[(s * p.num_slices + c) * p.rank + i] = from_float<T>(acc);
  }
}

// Grid (slots, slices, column chunks): thread j of the chunk computes output column j of
// the slot's slice from the slot's rank vector (shared) and row j of lora_b.
template <typename T>
__global__ void __launch_bounds__(kGemvThreads) moe_lora_expand_gemv_kernel(const LoraDeltaParams p) {
  __shared__ float t_row[kMaxRankPadded];
  // The next kernel may launch before this one's wait: this grid launched only once every
  // shrink CTA had passed its own wait, so all that came before the shrink is complete,
  // and nothing after this kernel reads the shrink's output (only this kernel does) or
  // reads this kernel's before its own wait. The small-batch GEMMs (late_delta_wait) then
  // stream their weights beside the shrink too. Every CTA that the next grid waits on is
  // resident by then (each one has triggered), so an early grid cannot starve them.
  allow_next_kernel_launch();
  wait_for_previous_kernel();
  const int64_t s = blockIdx.x;
  const int c = blockIdx.y;
  const int64_t j = int64_t(blockIdx.z) * kExpandGemvColumns + threadIdx.x;
  const Tile t = slot_tile(p, s);
  const int rank = int(p.rank);
  if (t.active && int(threadIdx.x) < rank) {
    t_row[threadIdx.x] = to_float(static_cast<const T*>(p.intermediate)[(s * p.num_slices + c) * rank + threadIdx.x]);
  }
  __syncthreads();
  if (j >= p.N_slice) return;
  T* out = static_cast<T*>(p.out);
  const int64_t at = out_offset(p, s, c, j);
  if (!t.active) {
    if (!p.add_inputs) out[at] = from_float<T>(0.f);
    return;
  }
  const detail::LoraSliceParams& sl = p.slices[c];
  const T* lora_row = static_cast<const T*>(sl.lora_b) + t.lora * sl.b_stride_lora + t.expert * sl.b_stride_expert +
                      j * sl.b_stride_n;
  float acc = 0.f;
  for (int i = 0; i < rank; ++i) acc = fmaf(t_row[i], to_float(lora_row[i]), acc);
  out[at] = from_float<T>((p.add_inputs ? to_float(out[at]) : 0.f) + delta_weight(p, t, s) * acc);
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

template <typename T>
void launch(const LoraDeltaParams& p, cudaStream_t stream) {
  const int64_t tiles = num_tiles(p);
  if (tiles <= 0) return;
  if (tiles > INT32_MAX) throw Error("moelora.fused_moe_lora: too many row tiles (" + std::to_string(tiles) + ")");
  const int64_t column_chunks = (p.N_slice + kExpandColumns - 1) / kExpandColumns;
  if (column_chunks > 65535) {
    throw Error("moelora.fused_moe_lora: argument 'out' expected at most " + std::to_string(65535 * kExpandColumns) +
                " columns per slice on CUDA, got " + std::to_string(p.N_slice));
  }
  if (p.sorted_token_ids == nullptr && shrink_gemv_loadable<T>(p)) {
    // Per-slot mode: GEMV kernels over every (slot, slice, rank row) and output column.
    const int64_t warps = p.num_slots * p.num_slices * p.rank;
    const int64_t ctas = std::min<int64_t>((warps + kGemvThreads / 32 - 1) / (kGemvThreads / 32), 8 * 1024);
    launch_kernel(moe_lora_shrink_gemv_kernel<T>, dim3(unsigned(ctas)), dim3(kGemvThreads), 0, stream, p);
    const int64_t chunks = (p.N_slice + kExpandGemvColumns - 1) / kExpandGemvColumns;
    if (p.num_slots > INT32_MAX || chunks > 65535) {
      throw Error("moelora.fused_moe_lora: too many slots or columns for the per-slot kernels");
    }
    launch_kernel(moe_lora_expand_gemv_kernel<T>, dim3(unsigned(p.num_slots), unsigned(p.num_slices), unsigned(chunks)),
                  dim3(kGemvThreads), 0, stream, p);
    return;
  }
  launch_kernel(shrink_gemv_loadable<T>(p) ? moe_lora_shrink_kernel<T, true> : moe_lora_shrink_kernel<T, false>,
                dim3(unsigned(tiles), unsigned(p.num_slices)), dim3(kShrinkThreads), 0, stream, p);
  launch_kernel(moe_lora_expand_kernel<T>, dim3(unsigned(tiles), unsigned(p.num_slices), unsigned(column_chunks)),
                dim3(kExpandThreads), 0, stream, p);
}

// K splits so that the row groups with work fill the SMs three times over (two CTAs fit
// an SM; at small M a handful of blocks hold every entry: Mixtral M = 16 has at most 9),
// each split at least kSegMinSplitK long and all of them within the partial-sum scratch.
SegmentedShrinkSplit segmented_shrink_split(const LoraDeltaParams& p) {
  auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  SegmentedShrinkSplit s{};
  s.group_rows = int(std::min<int64_t>(p.block_size, kSegGroupRows));
  s.pass_cols = std::min(p.num_slices * round_up16(int(p.rank)), kSegPassCols);
  // Groups holding entries: the full ones, plus at most one partial group per expert.
  const int64_t busy_groups = ceil_div(p.num_slots, s.group_rows) + std::min(p.num_slots, p.num_experts);
  int64_t splits = std::clamp<int64_t>(ceil_div(3 * current_device_info().num_sms, busy_groups), 1, kSegMaxSplits);
  splits = std::min(splits, ceil_div(p.K, kSegMinSplitK));
  splits = p.shrink_partials && p.shrink_counters && p.segmented_entries > 0
               ? std::min(splits, p.shrink_partial_rows / p.segmented_entries)
               : 1;
  s.k_chunk = ceil_div(ceil_div(p.K, std::max<int64_t>(splits, 1)), kSegBK) * kSegBK;
  s.splits = int(ceil_div(p.K, s.k_chunk));
  return s;
}

// The segmented shrink as GEMVs over entries, a warp an item (entry, slice,
// rank row): t[entry, c * rank + i] = scale[l] · a[row(entry)] · lora_a[c][l, e, i], for the
// entries the segmented kernel writes (a slot, an adapter in the block's mask, a local
// expert). For small chunks, where the segmented kernel's CTAs walk K for a row or two
// (Qwen3-30B M = 16: ~29 us for GEMM1's shrink, H100). The entry count is read on the
// device: a persistent grid strides over the used entries' items. 16-byte loads
// (shrink_gemv_loadable).
template <typename T>
__global__ void __launch_bounds__(kGemvThreads) moe_lora_shrink_entries_gemv_kernel(const LoraDeltaParams p) {
  wait_for_previous_kernel();
  allow_next_kernel_launch();  // as the segmented kernel's
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t used = used_entries(p);
  const int64_t per_entry = p.num_slices * p.rank, t_cols = per_entry;
  const int64_t items = used * per_entry;
  for (int64_t item = int64_t(blockIdx.x) * (kGemvThreads / 32) + warp; item < items;
       item += int64_t(gridDim.x) * (kGemvThreads / 32)) {
    const int64_t entry = item / per_entry, ci = item - entry * per_entry;
    const int c = int(ci / p.rank);
    const int64_t i = ci - c * p.rank;
    const int slot = p.sorted_token_ids[entry];
    if (slot < 0 || slot >= p.num_slots) continue;
    const int64_t block = entry / p.block_size;
    const int expert = p.expert_ids[block];
    if (expert < 0 || expert >= p.num_experts) continue;
    const int l = p.entry_lora_ids[entry];
    if (l < 0 || l >= kSegMaxAdapters || !(p.block_lora_masks[block] >> l & 1)) continue;
    const detail::LoraSliceParams& sl = p.slices[c];
    const T* a_row = static_cast<const T*>(p.a) + (p.a_rows_by_entry ? entry : slot / p.a_top_k) * p.a_stride_row;
    const T* lora_row = static_cast<const T*>(sl.lora_a) + l * sl.a_stride_lora + expert * sl.a_stride_expert +
                        i * sl.a_stride_rank;
    const float acc = warp_dot_rows(a_row, lora_row, p.K, lane);
    if (lane == 0) {
      const float scale = p.adapters.adapter_scale ? p.adapters.adapter_scale[l] : 1.f;
      static_cast<T*>(p.intermediate)[entry * t_cols + c * p.rank + i] = from_float<T>(scale * acc);
    }
  }
}

// The largest chunk (slots) whose fused-path shrink runs as GEMVs over entries. H200, LoRA
// r16, 4 adapters (reports/gpu/2026-11-29-h200-issue31-patches-ab.txt): 0.88-0.97x the
// segmented kernel's layer time at 32-1024 slots, 0.98-0.99x at 2048 on DeepSeek-V3-TP8 and
// Qwen3-30B but 1.08x on OLMoE, 1.05-1.36x at 4096-8192: each warp re-reads its row of A,
// which the segmented kernel's tiles share.
constexpr int64_t kShrinkEntriesGemvMaxSlots = 1024;

}  // namespace

void moe_lora_shrink(const LoraDeltaParams& p, Stream stream) {
  if (p.sorted_token_ids == nullptr || p.entry_lora_ids == nullptr || p.block_lora_masks == nullptr ||
      p.block_size % kTileRows != 0 || p.block_size > kSegMaxBlockSize || p.rank > kMaxRankPadded ||
      p.dtype == DType::kFloat32) {
    throw std::logic_error("moelora.moe_lora_shrink: needs the segmented alignment, block_size % 16 == 0 (at most " +
                           std::to_string(kSegMaxBlockSize) + "), rank <= 128 and a 16-bit type");
  }
  if (p.max_num_blocks <= 0) return;
  if (p.max_num_blocks > INT32_MAX) {
    throw Error("moelora.fused_experts: too many LoRA blocks (" + std::to_string(p.max_num_blocks) + ")");
  }
  const SegmentedShrinkSplit split = segmented_shrink_split(p);
  dispatch_float(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (kTensorCores<T>) {
      if (p.num_slots <= kShrinkEntriesGemvMaxSlots && shrink_gemv_loadable<T>(p)) {
        // A persistent grid: the used entries are counted on the device.
        const int64_t warps = p.max_num_tokens_padded * p.num_slices * p.rank;
        const int64_t ctas = std::min<int64_t>((warps + kGemvThreads / 32 - 1) / (kGemvThreads / 32),
                                               int64_t(current_device_info().num_sms) * 8);
        launch_kernel(moe_lora_shrink_entries_gemv_kernel<T>, dim3(unsigned(std::max<int64_t>(ctas, 1))),
                      dim3(kGemvThreads), 0, static_cast<cudaStream_t>(stream), p);
        return;
      }
      const auto kernel = shrink_gemv_loadable<T>(p) ? moe_lora_shrink_segmented_kernel<T, true>
                                                     : moe_lora_shrink_segmented_kernel<T, false>;
      MOELORA_CUDA_CHECK(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSegRingBytes)));
      const unsigned groups = unsigned((p.block_size + split.group_rows - 1) / split.group_rows);
      launch_kernel(kernel, dim3(unsigned(p.max_num_blocks), unsigned(split.splits), groups), dim3(kSegThreads),
                    kSegRingBytes, static_cast<cudaStream_t>(stream), p, split);
    }
  });
}

void moe_lora_delta(const LoraDeltaParams& p, Stream stream) {
  if (p.rank > kMaxRankPadded) {
    throw Error("moelora.fused_moe_lora: rank expected at most " + std::to_string(kMaxRankPadded) + ", got " +
                std::to_string(p.rank));
  }
  if (p.sorted_token_ids && p.block_size % kTileRows != 0) {
    throw Error("moelora.fused_moe_lora: argument 'block_size' expected a multiple of 16 on CUDA, got " +
                std::to_string(p.block_size));
  }
  dispatch_float(p.dtype, [&](auto tag) { launch<decltype(tag)>(p, static_cast<cudaStream_t>(stream)); });
}

}  // namespace moelora::cuda
