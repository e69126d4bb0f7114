// moe_lora_shrink on CUDA: the LoRA shrink on the segmented alignment, t by entry, for
// fused_experts' paths (the fused GEMMs' lora_t, the grouped path's moe_lora_expand_entries):
//   t[entry, c * rank + i] = scale[l] · a[row(entry)] · lora_a[c][l, e, i]ᵀ
// Small chunks and short (expert, adapter) runs take 16-entry warp tiles
// (moe_lora_shrink_warp_tiles_kernel), the rest row tiles of 64 entries split over K
// (moe_lora_shrink_segmented_kernel).
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm80.hpp>

#include <algorithm>
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

// ---- shrink on the segmented alignment (fused_experts' fused path) ------------------------
// t[entry, c * rank + i] = scale[l] · a[row(entry)] · lora_a[c][l, e, i]ᵀ for each entry of
// an enabled adapter l (row = the entry with a_rows_by_entry, else slot / a_top_k).
//
// Grid (tiles of kSegGroupRows entries, K splits): a CTA takes 64 consecutive entries of the
// alignment (several blocks where block_size < 64, as the grouped path's 16) and a K range.
// Its rows fall in runs of one (expert, adapter) (the segmented alignment keeps an expert's
// entries together and, inside it, each adapter's), and a pass takes a few consecutive runs:
// [pass rows, runs * slices * rank_padded] = rows · [the runs' lora_a rows]ᵀ on mma.sync,
// both operands through a cp.async ring, as deep as the pass's rows let kSegRingBytes be;
// each row keeps its own run's columns.
// With several splits each CTA writes fp32 partial sums, and the group's last CTA to
// arrive adds them in split order (the result does not depend on arrival order), scales
// and writes t.
// NOTE: measured on H100 (docs/PERF_NOTES.md, issue 4 step 3): one CTA per 16 entries and
// slice walking K in 64-element steps was latency-bound (Mixtral M = 64, r = 16: 2.97 ms
// layer against 1.06 base); whole 128-row blocks per CTA with per-chunk address math
// were instruction-bound (0.3 issues/cycle, 168 registers, 1 CTA/SM; Mixtral M = 4096
// GEMM2 shrink 482 us for 240 MB). Hence 64-row groups, source rows resolved once per
// pass, and splits that fill the SMs. A group was once one block's rows: on the grouped
// path's 16-row blocks that made 16-row passes, each re-reading its pair's lora_a (twice
// the bytes of its rows of a at rank 16 with 2 slices) with 2 of the 8 warps at work
// (H200, Qwen3-30B M = 4096: ~265 us for GEMM1's shrink, the peer's 59;
// reports/gpu/2026-11-29-h200-8bde123-issue31-lora-prefill.txt). Hence runs across blocks.
constexpr int kSegThreads = 256;          // 8 warps, up to kSegFragsPerWarp accumulators each
constexpr int kSegBK = 64;                // K elements a ring slot holds: 128 bytes of bf16
constexpr int kSegLd = kSegBK + kPad;     // smem row pitch (elements)
constexpr int kSegGroupRows = 64;         // rows a CTA takes: a pass is [64, 128] at most
constexpr int kSegPassCols = 128;
constexpr int kSegMaxPassPairs = kSegPassCols / 16;  // runs a pass takes at most (16 columns each)
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

struct SegmentedShrinkSplit {
  int splits;       // CTAs per row group along K
  int64_t k_chunk;  // K a split covers, a multiple of kSegBK
};

static_assert(kSegThreads % kSegPassCols == 0, "whole rows of threads over a pass's columns");
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

// 125-128 registers at 2 CTAs an SM; the !kAsync variants (operands not 16-byte aligned,
// element copies) spill 4-28 bytes, the cp.async ones nothing (nvcc 13.0).
template <typename T, bool kAsync>
__global__ void __launch_bounds__(kSegThreads, 2) moe_lora_shrink_segmented_kernel(const LoraDeltaParams p,
                                                                               const SegmentedShrinkSplit split) {
  static_assert(kTensorCores<T>, "the fused path runs 16-bit types");
  constexpr int kVec = Vec16<T>::kSize, kChunksPerRow = kSegBK / kVec;
  extern __shared__ __align__(128) unsigned char seg_smem[];
  __shared__ int row_lora[kSegGroupRows];    // each group row's adapter, -1: none or padding
  __shared__ int row_expert[kSegGroupRows];  // its expert (rows with an adapter)
  __shared__ int row_a[kSegGroupRows];       // its row of a
  __shared__ uint32_t run_bits[2][kSegGroupRows / 32];  // rows that begin [0] and end [1] a run
  // The pass's runs (kSegMaxPassPairs at most): rows [begin, end), adapter, expert, scale;
  // and each group row's run in the pass (-1: none).
  __shared__ int pass_begin[kSegMaxPassPairs], pass_end[kSegMaxPassPairs];
  __shared__ int pass_lora[kSegMaxPassPairs], pass_expert[kSegMaxPassPairs];
  __shared__ float pass_scale[kSegMaxPassPairs];
  __shared__ int row_pass_pair[kSegGroupRows];
  __shared__ bool last_split;

  wait_for_previous_kernel();
  // The GEMM after this kernel may launch now: with GemmParams::lora_late_wait it streams
  // its base K steps beside this shrink and waits before reading lora_t; without it, it
  // waits at entry. Every kernel before this one has completed (the wait above).
  allow_next_kernel_launch();
  constexpr int rows_in_group = kSegGroupRows;
  const int64_t entry0 = int64_t(blockIdx.x) * kSegGroupRows;  // the group's first entry
  const int64_t used = used_entries(p);
  if (entry0 >= used) return;  // the same in every split of the group: none counts
  if (int(threadIdx.x) < rows_in_group) {
    const int r = threadIdx.x;
    const int64_t entry = entry0 + r;
    EntryRow row;
    if (entry < used) row = load_entry_row(p, entry);
    const int l = row.lora;
    row_lora[r] = l;
    row_expert[r] = l < 0 ? -1 : row.expert;
    row_a[r] = l < 0 ? -1 : p.a_rows_by_entry ? int(entry) : row.slot / int(p.a_top_k);
  }
  __syncthreads();
  // Runs: maximal stretches of rows with one (expert, adapter). A pair split by other rows
  // makes two runs (two passes), never a wrong row.
  if (int(threadIdx.x) < rows_in_group) {
    const int r = threadIdx.x, l = row_lora[r], e = row_expert[r];
    const bool begins = l >= 0 && (r == 0 || row_lora[r - 1] != l || row_expert[r - 1] != e);
    const bool ends = l >= 0 && (r + 1 == rows_in_group || row_lora[r + 1] != l || row_expert[r + 1] != e);
    const uint32_t begin_bits = __ballot_sync(0xffffffffu, begins), end_bits = __ballot_sync(0xffffffffu, ends);
    if (r % 32 == 0) run_bits[0][r / 32] = begin_bits, run_bits[1][r / 32] = end_bits;
  }
  __syncthreads();
  static_assert(kSegGroupRows == 64 && kSegThreads >= kSegGroupRows, "the runs' bits are two warps' ballots");
  uint64_t run_begins = uint64_t(run_bits[0][1]) << 32 | run_bits[0][0];
  uint64_t run_ends = uint64_t(run_bits[1][1]) << 32 | run_bits[1][0];
  if (run_begins == 0) return;  // the same in every split of the group

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
  const int warp = threadIdx.x / 32;
  // Runs a pass takes: as many as their lora_a rows fit kSegPassCols (at rank 16: 4 with 2
  // slices, 8 with one), so that short runs (a few rows each at M <= 1024 on 128 experts)
  // share a pass's K loop; the rows between them load as zeros. Wider pairs take their
  // column passes alone.
  const int pairs_per_pass = cols <= kSegPassCols / 2 ? kSegPassCols / cols : 1;
  // A thread copies the chunks at one K column of rows threadIdx.x / 8 + 32 j.
  const int k_col = (threadIdx.x % kChunksPerRow) * kVec;
  const int row_base = threadIdx.x / kChunksPerRow;
  constexpr int kRowsPerRound = kSegThreads / kChunksPerRow;

  while (run_begins != 0) {
    // The pass: the next `count` runs, rows r0 .. r0 + rows - 1 (run q's lora_a rows are the
    // pass's columns q * cols ..).
    const int count = min(pairs_per_pass, __popcll(run_begins));
    if (threadIdx.x == 0) {
      uint64_t begins = run_begins, ends = run_ends;
      for (int q = 0; q < count; ++q, begins &= begins - 1, ends &= ends - 1) {
        const int b = __ffsll(static_cast<long long>(begins)) - 1;
        pass_begin[q] = b;
        pass_end[q] = __ffsll(static_cast<long long>(ends));
        pass_lora[q] = row_lora[b];
        pass_expert[q] = row_expert[b];
        pass_scale[q] = p.adapters.adapter_scale ? p.adapters.adapter_scale[row_lora[b]] : 1.f;
      }
    }
    // Every thread takes the pass's runs off its masks alike; r0 is the first run's first row,
    // r0 + rows the last run's end.
    const int r0 = __ffsll(static_cast<long long>(run_begins)) - 1;
    for (int q = 1; q < count; ++q) run_begins &= run_begins - 1, run_ends &= run_ends - 1;
    const int rows = __ffsll(static_cast<long long>(run_ends)) - r0, rows_padded = round_up16(rows);
    run_begins &= run_begins - 1, run_ends &= run_ends - 1;
    __syncthreads();  // the pass's runs
    if (int(threadIdx.x) < rows_in_group) {
      int pair = -1;
      for (int q = 0; q < count; ++q) {
        if (int(threadIdx.x) >= pass_begin[q] && int(threadIdx.x) < pass_end[q]) pair = q;
      }
      row_pass_pair[threadIdx.x] = pair;
    }
    __syncthreads();
    const int total_cols = count * cols;
    for (int c0 = 0; c0 < total_cols; c0 += kSegPassCols) {
      const int pass_cols = min(kSegPassCols, total_cols - c0);
      const int result_ld = pass_cols + 4;
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
          if (row < rows && row_pass_pair[r0 + row] >= 0) {
            src[j] = a + int64_t(row_a[r0 + row]) * p.a_stride_row + k_begin + k_col;
            has_src |= 1u << j;
          }
        } else if (row < stage_rows) {
          const int column = c0 + row - rows_padded, q = column / cols, n = column - q * cols;
          const int c = n / rank_padded, i_rank = n - c * rank_padded;
          const detail::LoraSliceParams& sl = p.slices[c];
          if (i_rank < rank) {
            src[j] = static_cast<const T*>(sl.lora_a) + pass_lora[q] * sl.a_stride_lora +
                     pass_expert[q] * sl.a_stride_expert + i_rank * sl.a_stride_rank + k_begin + k_col;
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
      // Each row's own run's columns (the pass computed every run's for every row). A thread
      // keeps one column of the pass (its run, slice and rank index: divisions once a pass)
      // and takes every kResultRowStep-th row.
      // NOTE: this was a (row, column) pair a step, each with three runtime divisions: ~90
      // instructions an element, 32 elements a thread in a pass of 4 runs at rank 16 (~3
      // passes a tile at Qwen3-30B M = 256). Measured with the expands' change below (H200,
      // LoRA r16; reports/gpu/2026-11-30-h200-bbb4215-issue31-lora-index-math.txt): the two
      // shrinks 68 -> 61 and 31 -> 26 us at Qwen3-30B M = 256.
      constexpr int kResultRowStep = kSegThreads / kSegPassCols;
      const int n = int(threadIdx.x) % kSegPassCols;
      if (n < pass_cols) {
        const int column = c0 + n, q = column / cols, nc = column - q * cols;
        const int c = nc / rank_padded, i_rank = nc - c * rank_padded;
        if (i_rank < rank) {
          const int64_t column_at = int64_t(c) * rank + i_rank;
          const float scale = pass_scale[q];
          float* partials =
              split.splits == 1 ? nullptr : p.shrink_partials + int64_t(blockIdx.y) * p.segmented_entries * t_cols;
          for (int row = int(threadIdx.x) / kSegPassCols; row < rows; row += kResultRowStep) {
            if (row_pass_pair[r0 + row] != q) continue;
            const int64_t at = (entry0 + r0 + row) * t_cols + column_at;
            const float v = result[row * result_ld + n];
            if (partials == nullptr) {
              t[at] = from_float<T>(scale * v);
            } else {
              partials[at] = v;
            }
          }
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

// K splits so that the row groups with work fill the SMs three times over (two CTAs fit
// an SM; at small M a handful of blocks hold every entry: Mixtral M = 16 has at most 9),
// each split at least kSegMinSplitK long and all of them within the partial-sum scratch.
SegmentedShrinkSplit segmented_shrink_split(const LoraDeltaParams& p) {
  auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  SegmentedShrinkSplit s{};
  // Groups holding entries: the slots' and at most block_size - 1 padding entries an expert.
  const int64_t busy_groups =
      ceil_div(p.num_slots + std::min(p.num_slots, p.num_experts) * (p.block_size - 1), kSegGroupRows);
  int64_t splits = std::clamp<int64_t>(ceil_div(3 * current_device_info().num_sms, busy_groups), 1, kSegMaxSplits);
  splits = std::min(splits, ceil_div(p.K, kSegMinSplitK));
  splits = p.shrink_partials && p.shrink_counters && p.segmented_entries > 0
               ? std::min(splits, p.shrink_partial_rows / p.segmented_entries)
               : 1;
  s.k_chunk = ceil_div(ceil_div(p.K, std::max<int64_t>(splits, 1)), kSegBK) * kSegBK;
  s.splits = int(ceil_div(p.K, s.k_chunk));
  return s;
}

// ---- shrink by warp tiles (short runs) ----------------------------------------------------
// A CTA takes one 16-entry tile of the alignment (inside one block: one expert), one of the
// tile's adapters and up to kWarpTileColTiles * 8 of one slice's lora_a rows; its four warps
// take a quarter of K each, each lane copying its own operands of a batch of steps by cp.async
// into shared slots only it reads back, then building mma.m16n8k16 fragments from them; the
// warps add their sums in shared memory in warp order (the result does not depend on timing).
// No barrier in the K loop, no partial sums in global memory; t is written once, for the
// tile's rows of that adapter only.
// The fragments from 16-byte loads: mma_rows_32k (moe_lora_tiles.cuh).
// NOTE: why not the segmented kernel at short runs (ncu, H200, Qwen3-30B LoRA r16 M = 256,
// 2048 slots, mean run 4 entries; docs/perf_notes/issues-31-33.md): its GEMM1 shrink took
// 61.7 us for ~70 MB (1.16 TB/s), SMs active 60% of the time, 0.36 issues a cycle a
// scheduler at 22% occupancy: 7 K splits x ~3 passes a 64-entry group, each pass with its
// prologue, barriers, result tile and partial sums for 5 k-tiles of work. A first version
// (a warp a tile and adapter over all of K) measured 0.955x of the layer at Qwen3-30B
// M = 256 and 1024 but 1.058x at DeepSeek-V3-TP8 M = 1024, whose K = 7168 made ~3,200 long
// warps, 1.5 waves by estimate: hence K over the CTA's warps (4x the warps, each a quarter
// as long). That (this kernel) measured, H200, LoRA r16 x 4 adapters, layer time against the
// segmented shrink: at M = 256 Qwen3-30B 0.942x, OLMoE 0.914x, Qwen3-235B 0.986x, gpt-oss and
// Mixtral 0.999x, at M = 1024 0.97-1.00x; but DeepSeek-V3-TP8 (K = 7168) still 1.021x at M = 256 and
// 1.063x at M = 1024 (its GEMM1 shrink 308 us): hence kWarpTilesMaxK.
constexpr int kWarpTileWarps = 4;         // K quarters
constexpr int kWarpTileThreads = kWarpTileWarps * 32;
constexpr int kWarpTileAdapterWays = 4;   // grid z: CTA z takes its tile's adapters z, z + 4, ...
constexpr int kWarpTileColTiles = 4;      // n8 column tiles a CTA takes at most (32 lora_a rows)
// The warp tiles where the mean (expert, adapter) run num_slots / (num_experts * max_loras)
// is below this: longer runs fill the segmented kernel's 64-entry groups and passes, whose
// shared lora_a tiles then serve many rows. At M = 4096 (mean runs 32-512) the layer took
// 1.08-1.47x with warp-tile kernels at every run length (H200; this shrink with warp-tile
// expands, which lost everywhere and were dropped: docs/perf_notes/issues-31-33.md).
constexpr int64_t kWarpTilesMaxMeanRun = 32;
// And where K is at most this. The register-operand version lost at K = 7168 (above); with its
// operands staged by cp.async (one wait a batch) it wins there: DeepSeek-V3-TP8 forced onto
// the warp tiles took 0.938x of the layer at M = 256 and 0.978x at M = 1024 (H200, this
// commit's lease). K = 14336 (Mixtral's GEMM2) is measured only below 1024 slots (where it
// wins: kWarpTilesAnyRunMaxSlots); past them its runs are long anyway (64 entries at M = 1024).
constexpr int64_t kWarpTilesMaxK = 8192;
// And at mean runs up to twice as long where K is at most kWarpTilesShortK: with every GEMM's
// shrink forced onto the warp tiles (H200, 64300e1's lease, the layer against the default)
// OLMoE M = 1024 (mean run 32, K 2048 / 1024) took 0.939x and gpt-oss-120b M = 4096 (32,
// K 2880) 0.986x, but DeepSeek-V3-TP8 M = 4096 (32, GEMM1's K 7168) 1.021x and Qwen3-30B
// M = 4096 (64) 1.024x.
constexpr int64_t kWarpTilesMaxMeanRunShortK = 2 * kWarpTilesMaxMeanRun;
constexpr int64_t kWarpTilesShortK = 4096;
// Chunks of at most this many slots take the warp tiles at every run length and K (past it,
// the bounds above). There they replaced GEMVs over entries (a warp an (entry, slice,
// rank row), re-reading its row of A for every rank row): H200, LoRA r16 x 4 adapters, M =
// 16-256 (at most 1024 slots), the layer took 0.93-1.01x of a rebuilt entries GEMV's time
// and, at M = 16, 0.95-1.00x of the old one's, Mixtral's GEMM2 (K = 14336) included
// (docs/perf_notes/issues-31-33.md, forty-ninth session).
constexpr int64_t kWarpTilesAnyRunMaxSlots = 1024;

// Grid (16-entry tiles, slices x column chunks, adapter ways). Needs shrink_gemv_loadable
// (16-byte rows, K % 8 == 0) and block_size % 16 == 0.
// Rank <= 16 (2 column tiles): at most 96 registers, 5 CTAs an SM (35 KB of shared memory
// each); unbounded, ptxas took 100 (4 CTAs); at 6 CTAs (80) it spilled 8 bytes on sm_90a.
template <typename T, int kColTiles, int kSteps>
__global__ void __launch_bounds__(kWarpTileThreads, kColTiles == 2 ? 5 : 1)
    moe_lora_shrink_warp_tiles_kernel(const LoraDeltaParams p) {
  static_assert(kTensorCores<T>, "mma.m16n8k16 on 16-bit types");
  __shared__ float partial_sums[kWarpTileWarps - 1][kColTiles * 4][32];  // warps 1-3's, lane-major
  // A lane's own 16-byte operands of kSteps steps (rows g, g + 8 of a, then its lora_a rows),
  // staged by cp.async: each lane reads back only what it copied (no barrier).
  __shared__ uint4 staged[kWarpTileWarps][kSteps][2 + kColTiles][32];
  wait_for_previous_kernel();
  allow_next_kernel_launch();  // as the segmented kernel's
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t entry0 = int64_t(blockIdx.x) * kTileRows;
  const int64_t used = used_entries(p);
  if (entry0 >= used) return;  // the CTA's
  const WarpTileRows tile = load_warp_tile_rows(p, entry0, used);
  if (tile.expert < 0) return;  // the CTA's
  const int expert = tile.expert, row_lora = tile.lora;
  // Lanes 0-15: their entry's row of a.
  const int row_a = tile.slot < 0 ? 0 : p.a_rows_by_entry ? int(entry0 + lane) : tile.slot / int(p.a_top_k);
  uint64_t adapters = tile.adapters;
  for (unsigned skip = 0; skip < blockIdx.z; ++skip) adapters &= adapters - 1;
  if (adapters == 0) return;  // the CTA's (every warp read the same rows)

  const int rank = int(p.rank), col_chunks = ((rank + 7) / 8 + kColTiles - 1) / kColTiles;
  const int slice = int(blockIdx.y) / col_chunks, n0 = (int(blockIdx.y) - slice * col_chunks) * kColTiles * 8;
  const detail::LoraSliceParams& sl = p.slices[slice];
  const int g = lane / 4, c = lane % 4;
  const int lora_g = __shfl_sync(0xffffffffu, row_lora, g), lora_g8 = __shfl_sync(0xffffffffu, row_lora, g + 8);
  const int a_g = __shfl_sync(0xffffffffu, row_a, g), a_g8 = __shfl_sync(0xffffffffu, row_a, g + 8);
  const T* a = static_cast<const T*>(p.a);
  T* t = static_cast<T*>(p.intermediate);
  const int64_t t_cols = int64_t(p.num_slices) * rank;
  const int k_lane = 8 * c;  // this lane's K offset in a 32-element step
  // This warp's quarter of K, whole 32-element steps but the last quarter's end.
  const int64_t k_quarter = (p.K + 32 * kWarpTileWarps - 1) / (32 * kWarpTileWarps) * 32;
  const int64_t k_begin = min(p.K, warp * k_quarter), k_end = min(p.K, k_begin + k_quarter);
  while (adapters != 0) {
    const int l = __ffsll(static_cast<long long>(adapters)) - 1;
    for (unsigned drop = 0; drop < gridDim.z && adapters != 0; ++drop) adapters &= adapters - 1;
    // A row of A or B that has no operand (another adapter's row, a column past the rank)
    // loads another row, one that another lane of the same instruction reads (the tile's first
    // row of adapter l, lora_a's last row of the rank: no extra sectors): its products land
    // only in rows or columns of the result that are not written. So the loads need no
    // predicate and the compiler keeps kSteps steps of them in flight.
    const int first = __ffs(__ballot_sync(0xffffffffu, lane < kTileRows && row_lora == l)) - 1;
    const int a_first = __shfl_sync(0xffffffffu, row_a, first);
    const bool has_row[2] = {lora_g == l, lora_g8 == l};
    const T* a_rows[2] = {a + int64_t(has_row[0] ? a_g : a_first) * p.a_stride_row + k_lane,
                          a + int64_t(has_row[1] ? a_g8 : a_first) * p.a_stride_row + k_lane};
    const T* lora = static_cast<const T*>(sl.lora_a) + l * sl.a_stride_lora + expert * sl.a_stride_expert + k_lane;
    const T* b_rows[kColTiles];
#pragma unroll
    for (int j = 0; j < kColTiles; ++j) b_rows[j] = lora + min(n0 + 8 * j + g, rank - 1) * sl.a_stride_rank;
    float acc[kColTiles][4] = {};
    auto load = [](const T* row, int64_t k) { return __ldg(reinterpret_cast<const uint4*>(row + k)); };
    int64_t k = k_begin;
    for (; k + 32 * kSteps <= k_end; k += 32 * kSteps) {
      // kSteps steps' copies first (the warp's bytes in flight), one wait, then their MMAs.
      // NOTE: copies, not loads into registers: with loads, ptxas interleaved them with the
      // MMAs (4 loads, an MMA that waits, 2 more loads, ...), so a batch waited ~5 times
      // (ncu source page, H200, Qwen3-30B M = 1024, 026da31: 77% of the stall samples long
      // scoreboard on the HMMAs, 23.6% occupancy at 106 registers).
      __syncwarp();  // the last batch's reads of these slots come first (the lane's own: orders them)
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          cp_async_16_zfill(smem_addr(&staged[warp][s][h][lane]), a_rows[h] + k + 32 * s, true);
        }
#pragma unroll
        for (int j = 0; j < kColTiles; ++j) {
          cp_async_16_zfill(smem_addr(&staged[warp][s][2 + j][lane]), b_rows[j] + k + 32 * s, true);
        }
      }
      cute::cp_async_fence();
      cute::cp_async_wait<0>();
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        const uint4 av[2] = {staged[warp][s][0][lane], staged[warp][s][1][lane]};
        uint4 bv[kColTiles];
#pragma unroll
        for (int j = 0; j < kColTiles; ++j) bv[j] = staged[warp][s][2 + j][lane];
        mma_rows_32k<T, kColTiles>(acc, av, bv);
      }
    }
    // The quarter's last steps one at a time; past its end both operands are zeros (k_end is
    // a multiple of 32 or K, and K % 8 == 0: a lane's 8 elements are all in or out).
    for (; k < k_end; k += 32) {
      const bool in = k + k_lane < k_end;
      const uint4 zero = make_uint4(0, 0, 0, 0);
      uint4 av[2], bv[kColTiles];
#pragma unroll
      for (int h = 0; h < 2; ++h) av[h] = in ? load(a_rows[h], k) : zero;
#pragma unroll
      for (int j = 0; j < kColTiles; ++j) bv[j] = in ? load(b_rows[j], k) : zero;
      mma_rows_32k<T, kColTiles>(acc, av, bv);
    }
    // Warps 1-3's sums through shared memory; warp 0 adds them in warp order and writes t.
    if (warp > 0) {
#pragma unroll
      for (int j = 0; j < kColTiles; ++j) {
#pragma unroll
        for (int v = 0; v < 4; ++v) partial_sums[warp - 1][4 * j + v][lane] = acc[j][v];
      }
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
      for (int w = 0; w < kWarpTileWarps - 1; ++w) {
#pragma unroll
        for (int j = 0; j < kColTiles; ++j) {
#pragma unroll
          for (int v = 0; v < 4; ++v) acc[j][v] += partial_sums[w][4 * j + v][lane];
        }
      }
      // acc[j]: rows g (0, 1) and g + 8 (2, 3), columns n0 + 8j + 2c (+1).
      const float scale = p.adapters.adapter_scale ? p.adapters.adapter_scale[l] : 1.f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (!has_row[h]) continue;
        T* t_row = t + (entry0 + g + 8 * h) * t_cols + int64_t(slice) * rank;
#pragma unroll
        for (int j = 0; j < kColTiles; ++j) {
#pragma unroll
          for (int v = 0; v < 2; ++v) {
            const int n = n0 + 8 * j + 2 * c + v;
            if (n < rank) t_row[n] = from_float<T>(scale * acc[j][2 * h + v]);
          }
        }
      }
    }
    __syncthreads();  // the partial sums are read before the next adapter's
  }
}

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
      const WarpTilesUse use = lora_shrink_warp_tiles_use();
      const bool by_rule = p.num_slots <= kWarpTilesAnyRunMaxSlots ||
                           (!mean_run_at_least(p, kWarpTilesMaxMeanRun) && p.K <= kWarpTilesMaxK) ||
                           (!mean_run_at_least(p, kWarpTilesMaxMeanRunShortK) && p.K <= kWarpTilesShortK);
      if (shrink_gemv_loadable<T>(p) &&
          (use == WarpTilesUse::kAlways || (use == WarpTilesUse::kByRule && by_rule))) {
        // Every 16-entry tile of the capacity (the used ones are read on the device).
        const int64_t tiles = (p.max_num_tokens_padded + kTileRows - 1) / kTileRows;
        const int ways = int(std::clamp<int64_t>(p.adapters.max_loras, 1, kWarpTileAdapterWays));
        // Rank <= 16: two column tiles a CTA, four K steps' loads in flight a warp; else four, two.
        const int col_tiles = int((p.rank + 7) / 8), cta_col_tiles = col_tiles <= 2 ? 2 : kWarpTileColTiles;
        const auto kernel = cta_col_tiles == 2 ? moe_lora_shrink_warp_tiles_kernel<T, 2, 4>
                                               : moe_lora_shrink_warp_tiles_kernel<T, kWarpTileColTiles, 2>;
        // 5 CTAs of 35 KB an SM: the carveout to shared memory.
        MOELORA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                                cudaSharedmemCarveoutMaxShared));
        const int col_chunks = (col_tiles + cta_col_tiles - 1) / cta_col_tiles;
        launch_kernel(kernel, dim3(unsigned(tiles), unsigned(p.num_slices * col_chunks), unsigned(ways)),
                      dim3(kWarpTileThreads), 0, static_cast<cudaStream_t>(stream), p);
        return;
      }
      const auto kernel = shrink_gemv_loadable<T>(p) ? moe_lora_shrink_segmented_kernel<T, true>
                                                     : moe_lora_shrink_segmented_kernel<T, false>;
      MOELORA_CUDA_CHECK(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSegRingBytes)));
      const int64_t groups = (p.max_num_tokens_padded + kSegGroupRows - 1) / kSegGroupRows;
      launch_kernel(kernel, dim3(unsigned(groups), unsigned(split.splits)), dim3(kSegThreads), kSegRingBytes,
                    static_cast<cudaStream_t>(stream), p, split);
    }
  });
}

}  // namespace moelora::cuda
