// moe_lora_expand_entries on CUDA: the LoRA expand on the segmented alignment, added into a
// GEMM's output rows by entry (fused_experts' grouped path, whose CUTLASS GEMMs take no
// expand in their K loops):
//   out[entry, col(c, j)] += t[entry, c * rank :] · lora_b[c][l, e, j]ᵀ
// for each entry whose adapter l the segmented shrink wrote (moe_lora_shrink: t by entry,
// already scaled by the adapter's scale). Other entries (no adapter, a disabled one,
// padding, an expert not local) are not touched. moe_lora_expand_activation does GEMM1's
// expand and the gated activation in one pass: it reads GEMM1's rows, adds their deltas in
// shared memory and writes only the activation, where the expand alone would write GEMM1's rows
// back for the activation kernel to read again.
//
// A CTA takes 64 entries (four 16-row groups, one a warp; a group lies in one block of the
// alignment, so one expert) and 64 output columns (the activation: the 128 gate and up
// columns of 64 outputs), both slices together: the MMA's K runs over [slice 0's rank |
// slice 1's rank], and an output column's lora_b row holds its own slice's values and
// zeros in the other's, which serves the interleaved layout (gate and up alternating) and
// the split one alike. A block's entries hold runs of a few adapters (the segmented
// alignment pads only where an expert ends): the CTA lists its (expert, adapter) pairs once,
// and each warp with rows of a pair masks its other rows out of the MMA's A fragments.
// Where the mean (expert, adapter) run is long (kStreamMinMeanRun), a CTA walks several
// column tiles (a stride of them): its rows, pairs and t tile are read once, and where its
// pairs fit a stage the next column tile's output rows and lora_b tiles load (cp.async)
// while this one computes (also at shorter runs where a CTA walks many: streams_by_rule).
// Elsewhere the expands run by 16-entry groups where those fit (moe_lora_expand_groups.cu),
// else a CTA takes one column tile, its pairs in rounds. The sums are added into the output
// rows in shared memory, which leave as 16-byte rows.
//
// NOTE: the first version (16 entries x 64 columns of one slice a CTA, 2-byte loads and
// read-modify-writes after a chain of index loads) ran at ~12 ps an output element on an
// H200 (0.33 TB/s of read-modify-write: 1.4 ms of Qwen3-30B's LoRA layer at M = 4096,
// reports/gpu/2026-11-29-h200x2-8dc7e77-issue31.txt). The second (this tiling, each pair's
// lora_b tile loaded behind a barrier in turn, the output rows in registers) ran at
// 1.1 TB/s at M = 4096 and ~12 us a CTA at M = 256, where a tile holds ~9 pairs
// (reports/gpu/2026-11-29-h200-8bde123-issue31-lora-prefill.txt).
#include <cute/arch/copy_sm80.hpp>

#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>

#include "common/params.h"
#include "cuda/cuda_check.h"
#include "cuda/device_info.h"
#include "cuda/gated_activation.cuh"
#include "cuda/launch.cuh"
#include "cuda/moe_lora_tiles.cuh"
#include "cuda/numeric.cuh"

namespace moelora::cuda {
namespace {

using detail::ActivationKind;
using detail::ActivationQuantizeParams;
using detail::LoraDeltaParams;
using namespace lora_tiles;

constexpr int kRows = 64;            // entries a CTA: four 16-row groups, one a warp
constexpr int kThreads = 128;        // 4 warps
constexpr int kGroups = kRows / 16;  // row groups (warps)
// Output columns a CTA of the expand. NOTE: 64 columns (96 registers, 5 CTAs an SM, 44 KB of
// shared memory at rank 16 with one slice) moved 2.7 TB/s at Qwen3-30B M = 4096 (111 us, H200,
// b56ac77). 32 (80 registers, 6 CTAs an SM) lost in every cell: the LoRA layer 1.04-1.07x at
// DeepSeek-V3, 1.00-1.02x elsewhere (H200, dfb4c78: docs/perf_notes/issues-31-33.md).
constexpr int kOutColumns = 64;
// The activation's outputs a CTA, their gate and up columns 2x that. NOTE: at 64 outputs (128
// GEMM1 columns) a warp's 128 accumulator columns took 203-206 registers and, with 79 KB of
// shared memory, 2 CTAs an SM: the join ran at ~1 TB/s (178 us at Qwen3-30B M = 4096, H200,
// b56ac77). At 32 (128 registers, 4 CTAs an SM, 44 KB) it took 132 us there, and the LoRA layer
// 0.93-1.00x of 64's in 21 of 21 cells (H200, dfb4c78).
constexpr int kJoinOutputs = 32;
// (expert, adapter) pairs a tile can hold: at most one a row.
constexpr int kMaxPairs = kRows;
// Shared memory for one stage's lora_b tiles (stage_pairs = this over one tile's bytes, at
// least 1), both kernels' tiles 64 columns wide: the expand's 4 pairs at rank 16 with one
// slice, the activation's 2 with two. Two stages; a tile with more pairs takes them in rounds
// of both stages' tiles, unstreamed. At prefill a 64-entry tile mostly straddles two (expert,
// adapter) runs.
constexpr int64_t kStagePairBytesExpand = 12 * 1024;
constexpr int64_t kStagePairBytesActivation = 10 * 1024;
// CTAs a launch aims at when its CTAs stream column tiles (two to four waves).
constexpr int kStreamCtasPerSm = 8;
// Streaming pays where a tile holds few pairs: where the mean (expert, adapter) run,
// num_slots / (num_experts * max_loras), is at least this. Below it most tiles take their
// pairs in rounds and a column tile a CTA gives more CTAs. Measured on an H200 (LoRA r16,
// 4 adapters; docs/PERF_NOTES.md, issue 31): streamed / a column tile a CTA = 0.85-0.97
// at mean runs of 32-256 entries (M = 4096 on every model, OLMoE and Mixtral M = 1024),
// 0.99-1.13 at 4-16 (M = 256 on every model but OLMoE, 1024 on gpt-oss and Qwen3-30B).
constexpr int64_t kStreamMinMeanRun = kRows / 2;
// Streaming pays at short runs too where the runs hold at least kStreamMinShortRun entries and
// a streaming CTA walks at least kStreamMinColumnTiles column tiles (its rows, pairs and t tile
// read once for all of them, against a CTA's setup for each). Measured on an H200 (LoRA r16,
// 4 adapters, docs/perf_notes/issues-31-33.md): at DeepSeek-V3 M = 1024 (mean run 8) GEMM2's
// expand, 37 column tiles a streaming CTA, 297 -> 248 us (layer 0.964x); at DeepSeek-V3
// M = 256 (mean run 2, 28 a CTA) the layer 1.061x; at Qwen3-30B M = 256 (mean run 4, ~5 a
// CTA) GEMM2's expand 37.7 -> 49.1 us. Below kStreamMinMeanRun the expands run by 16-entry
// groups (moe_lora_expand_groups.cu) wherever those fit, which now beat this clause's streamed
// tiles too (expand_by_groups); it serves the column tiles where the groups do not fit.
constexpr int64_t kStreamMinShortRun = 8;
constexpr int64_t kStreamMinColumnTiles = 16;

// Row pitch (elements) of the t and lora_b tiles: both slices' padded ranks, plus kPad.
__host__ __device__ constexpr int tile_pitch(int rank, int slices) { return slices * round_up16(rank) + kPad; }
// Row pitch (elements) of the output tile of `columns` (T, 16-byte rows).
__host__ __device__ constexpr int out_pitch(int columns) { return columns + kPad; }
// One pair's lora_b tile [columns][pitch] in bytes.
__host__ __device__ constexpr int64_t pair_tile_bytes(int columns, int rank, int slices, int element_bytes) {
  return int64_t(columns) * tile_pitch(rank, slices) * element_bytes;
}

// How a launch walks its column tiles: CTA (x, y) takes column tiles y, y + gridDim.y, ...
struct ExpandLaunch {
  int column_tiles;  // of the kernel's columns
  int stage_pairs;   // lora_b tiles a stage holds
  bool stream;       // a tile's next column tile loads while it computes this one
};

// Dynamic shared memory: the t tile [kRows][pitch], two output tiles [kRows][out_pitch] (the
// rows' current values, then their sums) and two stages of stage_pairs lora_b tiles
// [columns][pitch], of T.
__host__ __device__ constexpr int64_t smem_bytes(int columns, int rank, int slices, int stage_pairs,
                                                 int element_bytes) {
  return (int64_t(kRows) * tile_pitch(rank, slices) + 2 * int64_t(kRows) * out_pitch(columns)) * element_bytes +
         2 * stage_pairs * pair_tile_bytes(columns, rank, slices, element_bytes);
}

template <typename T>
struct TileBuffers {
  T* t;          // [kRows][pitch]
  T* out_tiles;  // [2][kRows][out_pitch(columns)]
  T* b;          // [2 * stage_pairs][columns][pitch]
  int out_elems;
  __device__ __forceinline__ TileBuffers(unsigned char* smem, int columns, int pitch)
      : t(reinterpret_cast<T*>(smem)),
        out_tiles(t + kRows * pitch),
        b(out_tiles + 2 * kRows * out_pitch(columns)),
        out_elems(kRows * out_pitch(columns)) {}
  __device__ __forceinline__ T* out(int stage) const { return out_tiles + stage * out_elems; }
};

// The CTA's rows: each row's adapter (-1: nothing to add), and whether the row holds a slot
// of a local expert at all (the activation's rows); each 16-row group's expert and adapters;
// the tile's (expert, adapter) pairs, each once (build_pairs).
struct TileRows {
  int lora[kRows];
  bool live[kRows];
  int group_expert[kGroups];
  unsigned long long group_adapters[kGroups];
  int num_pairs;
  int pair_expert[kMaxPairs];
  int pair_lora[kMaxPairs];
};

// Reads the tile's index arrays (one round trip: the entries' slots and adapters, the
// blocks' experts and masks). Ends with a barrier; returns whether any row has an adapter.
// Rows past `used` are neither live nor LoRA rows.
__device__ __forceinline__ bool load_tile_rows(const LoraDeltaParams& p, int64_t entry0, int64_t used, TileRows& rows) {
  const int tid = threadIdx.x;
  if (tid < kGroups) rows.group_adapters[tid] = 0;
  if (tid < kRows) {
    const int64_t entry = entry0 + tid;
    EntryRow row;
    if (entry < used) row = load_entry_row(p, entry);
    rows.lora[tid] = row.lora;
    rows.live[tid] = row.slot >= 0 && row.expert >= 0;
    // A 16-row group lies in one block (block_size % 16 == 0): one expert.
    if (tid % 16 == 0) rows.group_expert[tid / 16] = row.expert;
  }
  const bool any = __syncthreads_or(tid < kRows && rows.lora[tid] >= 0);
  if (tid < kRows && rows.lora[tid] >= 0) atomicOr(&rows.group_adapters[tid / 16], 1ull << rows.lora[tid]);
  return any;  // group_adapters are read after the caller's next barrier
}

// The tile's (expert, adapter) pairs in group order, each once (a group's adapters less those
// an earlier group of the same expert has). One thread; group_adapters visible.
__device__ __forceinline__ void build_pairs(TileRows& rows) {
  int n = 0;
  for (int g = 0; g < kGroups; ++g) {
    const int expert = rows.group_expert[g];
    if (expert < 0) continue;
    unsigned long long pending = rows.group_adapters[g];
    for (int h = 0; h < g; ++h) {
      if (rows.group_expert[h] == expert) pending &= ~rows.group_adapters[h];
    }
    for (; pending != 0; pending &= pending - 1) {
      rows.pair_expert[n] = expert;
      rows.pair_lora[n] = __ffsll(static_cast<long long>(pending)) - 1;
      ++n;
    }
  }
  rows.num_pairs = n;
}

// One run of a tile row into shared memory: a 16-byte vector (kVectors: cp.async, waited for
// by the caller) or one element from src, or zeros where !load (src is then not read; it
// must still be a valid address for the cp.async).
template <typename T, bool kVectors>
__device__ __forceinline__ void copy_or_zero(T* dst, const T* src, bool load) {
  if constexpr (kVectors) {
    cp_async_16_zfill(smem_addr(dst), src, load);
  } else {
    *dst = load ? *src : from_float<T>(0.f);
  }
}

// t rows into the tile (both slices, zero past the rank and on rows with nothing to add).
template <typename T, bool kVectors>
__device__ __forceinline__ void load_t_tile(const LoraDeltaParams& p, int64_t entry0, const TileRows& rows, T* t_tile) {
  const int rank = int(p.rank), rank_padded = round_up16(rank), slices = p.num_slices;
  const int pitch = tile_pitch(rank, slices), k_extent = slices * rank_padded;
  const T* t = static_cast<const T*>(p.intermediate);
  const int64_t t_cols = int64_t(slices) * rank;
  constexpr int kStep = kVectors ? Vec16<T>::kSize : 1;
  const int per_row = k_extent / kStep;
  for (int i = threadIdx.x; i < kRows * per_row; i += kThreads) {
    const int r = i / per_row, k = (i % per_row) * kStep;
    const int c = k / rank_padded, kr = k % rank_padded;
    const bool load = rows.lora[r] >= 0 && kr < rank;
    copy_or_zero<T, kVectors>(t_tile + r * pitch + k, load ? t + (entry0 + r) * t_cols + c * rank + kr : t, load);
  }
}

// lora_b tiles: kBRowThreads threads a tile row (column), so that two adjacent threads copy
// the two 16-byte halves of a rank-16 row (one 32-byte sector); each thread takes
// kBRows<kColumns> rows, every kThreads / kBRowThreads-th (32 columns: half the threads one
// row, the other half none).
constexpr int kBRowThreads = 2;
template <int kColumns>
constexpr int kBRows = (kColumns * kBRowThreads + kThreads - 1) / kThreads;

// A thread's tile rows of a column tile's lora_b tiles (b_rows): each row's slice (-1: past
// the stack's columns) and its offset in that slice's stacks. The same for every pair, so
// computed once a column tile: a column's slice takes a 64-bit division.
template <int kColumns>
struct BRows {
  static_assert(kColumns * kBRowThreads % kThreads == 0 || kBRows<kColumns> == 1, "whole rows a thread");
  int slice[kBRows<kColumns>];
  int64_t offset[kBRows<kColumns>];  // jn * b_stride_n
};

__device__ __forceinline__ int b_row(int i) { return i * (kThreads / kBRowThreads) + int(threadIdx.x) / kBRowThreads; }

// column(n): the stack column (of num_slices * N_slice) of tile column n, or -1 past the end.
template <int kColumns, class Column>
__device__ __forceinline__ BRows<kColumns> b_rows(const LoraDeltaParams& p, Column column) {
  BRows<kColumns> rows;
#pragma unroll
  for (int i = 0; i < kBRows<kColumns>; ++i) {
    const int64_t j = b_row(i) < kColumns ? column(b_row(i)) : -1;
    rows.slice[i] = -1;
    rows.offset[i] = 0;
    if (j >= 0) {
      int64_t jn = 0;
      column_slice(p, j, rows.slice[i], jn);
      rows.offset[i] = jn * p.slices[rows.slice[i]].b_stride_n;
    }
  }
  return rows;
}

// (expert, l)'s lora_b rows of the tile's columns into b_tile [columns][pitch], each in its
// slice's K segment (zeros in the other's and past the rank); the thread's rows (b_rows).
// NOTE: this was, for each pair and each 16-byte copy, the copy's row and run (two runtime
// divisions), its column and slice (a 64-bit division) and its address: ~200 instructions
// a copy, with ~10 pairs a tile at Qwen3-30B M = 256. Measured (H200, LoRA r16, Qwen3-30B;
// reports/gpu/2026-11-30-h200-bbb4215-issue31-lora-index-math.txt): the join 105 -> 55 us
// and GEMM2's expand 55 -> 38 at M = 256; 253 -> 179 and 141 -> 111 at M = 4096.
template <typename T, bool kVectors, int kColumns>
__device__ __forceinline__ void load_b_tile(const LoraDeltaParams& p, int expert, int l, const BRows<kColumns>& rows,
                                            T* b_tile) {
  constexpr int kStep = kVectors ? Vec16<T>::kSize : 1;
  const int rank = int(p.rank), rank_padded = round_up16(rank);
  const int pitch = tile_pitch(rank, p.num_slices), k_extent = p.num_slices * rank_padded;
  const T* fallback = static_cast<const T*>(p.slices[0].lora_b);  // a valid address where nothing is read
  const int k0 = int(threadIdx.x) % kBRowThreads * kStep;
#pragma unroll
  for (int i = 0; i < kBRows<kColumns>; ++i) {
    if (kColumns * kBRowThreads < kThreads && b_row(i) >= kColumns) continue;  // no row of this tile
    const T* src = fallback;
    int segment = k_extent;  // past the end: zeros
    if (rows.slice[i] >= 0) {
      const detail::LoraSliceParams& sl = p.slices[rows.slice[i]];
      src = static_cast<const T*>(sl.lora_b) + l * sl.b_stride_lora + expert * sl.b_stride_expert + rows.offset[i];
      segment = rows.slice[i] * rank_padded;
    }
    T* dst = b_tile + b_row(i) * pitch;
    for (int k = k0; k < k_extent; k += kBRowThreads * kStep) {
      const int kr = k - segment;
      const bool load = kr >= 0 && kr < rank;
      copy_or_zero<T, kVectors>(dst + k, load ? src + kr : fallback, load);
    }
  }
}

// Pairs q0 .. q0 + count - 1 of the tile into acc (warp w: rows 16w..16w+15, columns
// 16f..16f+15 in acc[f]), pair q0 + q's lora_b tile at b_tiles + q tiles: each pair's MMAs on
// the warps with rows of it, the warp's other rows masked out of the A fragments (a0/a2 hold
// row lane / 4 of the 16, a1/a3 row lane / 4 + 8). Expects the tiles visible.
template <typename T, int kFragments>
__device__ __forceinline__ void mma_pairs(const LoraDeltaParams& p, const TileRows& rows, const T* t_tile,
                                          const T* b_tiles, int q0, int count, float (&acc)[kFragments][8]) {
  constexpr int kColumns = kFragments * 16;
  const int rank = int(p.rank), rank_padded = round_up16(rank);
  const int pitch = tile_pitch(rank, p.num_slices), k_extent = p.num_slices * rank_padded;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t a_base = smem_addr(t_tile + warp * 16 * pitch + mma_lane_a(pitch));
  const int group_expert = rows.group_expert[warp];
  const unsigned long long group_adapters = rows.group_adapters[warp];
  const int low_lora = rows.lora[warp * 16 + lane / 4], high_lora = rows.lora[warp * 16 + lane / 4 + 8];
  for (int q = 0; q < count; ++q) {
    const int l = rows.pair_lora[q0 + q];
    if (group_expert != rows.pair_expert[q0 + q] || !(group_adapters >> l & 1)) continue;
    const uint32_t b_base = smem_addr(b_tiles + q * kColumns * pitch + mma_lane_b(pitch));
    mma_adapter_rows<T, kFragments>(acc, a_base, b_base, pitch, k_extent, low_lora == l, high_lora == l);
  }
}

// The CTA's column tiles (ExpandLaunch) for a tile whose rows, pairs and t tile copies are
// in place (a barrier since build_pairs). column(ct, n): the stack column of column tile
// ct's tile column n, or -1. load_out(ct, out_tile): issues the copies of the tile's output
// rows (cp.async, or plain copies). finish(ct, out_tile): writes what the sums in out_tile
// make. Streamed (at most stage_pairs pairs): column tile i + 1's output rows and lora_b
// tiles load into the other stage while tile i computes. Otherwise each column tile in turn,
// its pairs in rounds of both stages' lora_b tiles.
template <typename T, bool kVectors, int kColumns, class Column, class LoadOut, class Finish>
__device__ __forceinline__ void expand_column_tiles(const LoraDeltaParams& p, const TileRows& rows,
                                                    const TileBuffers<T>& tiles, const ExpandLaunch& launch,
                                                    Column column, LoadOut load_out, Finish finish) {
  constexpr int kFragments = kColumns / 16;
  // This warp's 16 rows of an output tile (add_fragment_sums).
  const int warp_rows = int(threadIdx.x) / 32 * 16 * out_pitch(kColumns);
  const int b_elems = kColumns * tile_pitch(int(p.rank), p.num_slices);
  const int num_pairs = rows.num_pairs, stride = int(gridDim.y);
  if (launch.stream && num_pairs <= launch.stage_pairs) {
    auto issue = [&](int ct, int stage) {
      load_out(ct, tiles.out(stage));
      const BRows<kColumns> b_tile_rows = b_rows<kColumns>(p, [&](int n) { return column(ct, n); });
      for (int q = 0; q < num_pairs; ++q) {
        load_b_tile<T, kVectors, kColumns>(p, rows.pair_expert[q], rows.pair_lora[q], b_tile_rows,
                                           tiles.b + (stage * launch.stage_pairs + q) * b_elems);
      }
      cute::cp_async_fence();
    };
    int stage = 0;
    issue(int(blockIdx.y), 0);  // with the t tile's copies, issued before
#pragma unroll 1
    for (int ct = int(blockIdx.y); ct < launch.column_tiles; ct += stride, stage ^= 1) {
      if (ct + stride < launch.column_tiles) {
        issue(ct + stride, stage ^ 1);
      } else {
        cute::cp_async_fence();  // an empty group: the wait below still means this tile's
      }
      cute::cp_async_wait<1>();
      __syncthreads();  // this stage's tiles
      float acc[kFragments][8] = {};
      mma_pairs<T, kFragments>(p, rows, tiles.t, tiles.b + stage * launch.stage_pairs * b_elems, 0, num_pairs, acc);
      add_fragment_sums<T, kFragments>(tiles.out(stage) + warp_rows, acc);
      __syncthreads();  // the sums
      finish(ct, tiles.out(stage));
      __syncthreads();  // this stage is free for the tile after next
    }
    return;
  }
  const int round_pairs = 2 * launch.stage_pairs;
#pragma unroll 1
  for (int ct = int(blockIdx.y); ct < launch.column_tiles; ct += stride) {
    load_out(ct, tiles.out(0));
    const BRows<kColumns> b_tile_rows = b_rows<kColumns>(p, [&](int n) { return column(ct, n); });
    float acc[kFragments][8] = {};
    for (int q0 = 0; q0 < num_pairs; q0 += round_pairs) {
      const int count = min(round_pairs, num_pairs - q0);
      for (int q = 0; q < count; ++q) {
        load_b_tile<T, kVectors, kColumns>(p, rows.pair_expert[q0 + q], rows.pair_lora[q0 + q], b_tile_rows,
                                           tiles.b + q * b_elems);
      }
      cute::cp_async_fence();
      cute::cp_async_wait<0>();
      __syncthreads();  // the round's tiles (and, in the first, the output rows and the t tile)
      mma_pairs<T, kFragments>(p, rows, tiles.t, tiles.b, q0, count, acc);
      __syncthreads();  // the next round's lora_b tiles overwrite these
    }
    cute::cp_async_fence();
    cute::cp_async_wait<0>();  // the output rows, where no pair waited for them
    __syncthreads();
    add_fragment_sums<T, kFragments>(tiles.out(0) + warp_rows, acc);
    __syncthreads();  // the sums
    finish(ct, tiles.out(0));
    __syncthreads();  // the output tile is free for the next column tile
  }
}

// Grid (entry tiles of kRows, column tile strides: ExpandLaunch) over the stack's columns.
// The version before took one column tile a CTA and loaded its output rows (registers), then
// the t tile, then each pair's lora_b tile in turn behind a barrier: ~12 us a CTA at
// Qwen3-30B M = 256 (9 pairs a tile), 1.1 TB/s at M = 4096 (H200, ncu:
// reports/gpu/2026-11-29-h200-8bde123-issue31-lora-prefill.txt). Here the rows, the pairs and
// the t tile are read once for a CTA's column tiles, which stream (the next one's loads in
// flight) where the pairs fit a stage. 5 CTAs an SM: 96 registers (sm_90a: no spills; the
// sm_80 16-byte variant spills 4 bytes, and the grouped path runs on sm_90a), 44 KB of
// shared memory at rank 16 with 2 slices.
template <typename T, bool kVectors>
__global__ void __launch_bounds__(kThreads, 5)
    moe_lora_expand_entries_kernel(const LoraDeltaParams p, const ExpandLaunch launch) {
  static_assert(kTensorCores<T>, "the grouped path runs 16-bit types");
  constexpr int kColumns = kOutColumns, kOutPitch = out_pitch(kColumns);
  constexpr int kStep = kVectors ? Vec16<T>::kSize : 1;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ TileRows rows;
  const TileBuffers<T> tiles(smem, kColumns, tile_pitch(int(p.rank), p.num_slices));
  const int tid = threadIdx.x;

  wait_for_previous_kernel();
  const int64_t entry0 = int64_t(blockIdx.x) * kRows, used = used_entries(p);
  if (entry0 >= used) return;
  if (!load_tile_rows(p, entry0, used, rows)) return;  // nothing to add here
  load_t_tile<T, kVectors>(p, entry0, rows, tiles.t);
  __syncthreads();  // the groups' adapters
  if (tid == 0) build_pairs(rows);
  __syncthreads();

  const int64_t N = int64_t(p.num_slices) * p.N_slice;
  T* out = static_cast<T*>(p.out);
  auto column = [N](int ct, int n) -> int64_t {
    const int64_t j = int64_t(ct) * kColumns + n;
    return j < N ? j : -1;
  };
  // The rows with an adapter (zeros elsewhere; N % 8 == 0 with kVectors: a run is all in or out).
  auto load_out = [&](int ct, T* out_tile) {
    for (int i = tid; i < kRows * (kColumns / kStep); i += kThreads) {
      const int r = i / (kColumns / kStep), n = (i % (kColumns / kStep)) * kStep;
      const int64_t j = column(ct, n);
      const bool load = rows.lora[r] >= 0 && j >= 0;
      copy_or_zero<T, kVectors>(out_tile + r * kOutPitch + n,
                                load ? out + (entry0 + r) * p.out_stride_row + j * p.out_stride_n : out, load);
    }
  };
  auto finish = [&](int ct, const T* out_tile) {
    for (int i = tid; i < kRows * (kColumns / kStep); i += kThreads) {
      const int r = i / (kColumns / kStep), n = (i % (kColumns / kStep)) * kStep;
      const int64_t j = column(ct, n);
      if (rows.lora[r] < 0 || j < 0) continue;
      T* at = out + (entry0 + r) * p.out_stride_row + j * p.out_stride_n;
      if constexpr (kVectors) {
        *reinterpret_cast<Vec16<T>*>(at) = *reinterpret_cast<const Vec16<T>*>(out_tile + r * kOutPitch + n);
      } else {
        *at = out_tile[r * kOutPitch + n];
      }
    }
  };
  expand_column_tiles<T, kVectors, kColumns>(p, rows, tiles, launch, column, load_out, finish);
  allow_next_kernel_launch();
}

// GEMM1's rows [entries, 2I] (act.input; p describes the same rows as its `out`) plus their
// deltas, through the gated activation into [entries, I] (act.out), each sum rounded to T
// as the expand's write would, and the activation rounded to T as the activation kernel's.
// Column tile ct's tile column n < kOutputs is gate output o0 + n (o0 = kOutputs ct),
// n >= kOutputs its up (split halves: GEMM1 columns o0 + n and I + o0 + n - kOutputs;
// swiglu_oai's interleaved pairs: 2 o0 + n, the activation's gate and up then at 2i and
// 2i + 1). Grid (entry tiles of kRows, column tile strides over the I outputs). GEMM1's rows
// come in by cp.async whatever kVectors says (the launcher checks their 16-byte rows).
// 4 CTAs an SM (128 registers at most), 44 KB of shared memory at rank 16 with 2 slices (two
// stages of 2 pairs).
template <typename T, bool kVectors, ActivationKind kKind>
__global__ void __launch_bounds__(kThreads, 4)
    moe_lora_expand_activation_kernel(const LoraDeltaParams p, const ActivationQuantizeParams act,
                                      const ExpandLaunch launch) {
  static_assert(kTensorCores<T>, "the grouped path runs 16-bit types");
  constexpr int kOutputs = kJoinOutputs, kColumns = 2 * kOutputs, kOutPitch = out_pitch(kColumns);
  constexpr bool kPairs = kKind == ActivationKind::kSwigluOai;
  constexpr int kVec = Vec16<T>::kSize;  // columns a 16-byte copy and an activation step take
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ TileRows rows;
  const TileBuffers<T> tiles(smem, kColumns, tile_pitch(int(p.rank), p.num_slices));
  const int tid = threadIdx.x;

  wait_for_previous_kernel();
  const int64_t entry0 = int64_t(blockIdx.x) * kRows, used = used_entries(p);
  if (entry0 >= used) return;
  if (load_tile_rows(p, entry0, used, rows)) load_t_tile<T, kVectors>(p, entry0, rows, tiles.t);
  __syncthreads();  // the groups' adapters (none: no pairs)
  if (tid == 0) build_pairs(rows);
  __syncthreads();

  const int64_t width = act.width;  // I
  auto column = [width](int ct, int n) -> int64_t {
    const int64_t o0 = int64_t(ct) * kOutputs;
    const int64_t o = o0 + (kPairs ? n / 2 : n % kOutputs);  // the tile column's output
    if (o >= width) return -1;
    return kPairs ? 2 * o0 + n : (n < kOutputs ? o : width + o);
  };
  // The live rows (a run of 8 tile columns is 8 consecutive GEMM1 columns, all in or all out
  // as width % 8 == 0).
  const T* in = static_cast<const T*>(act.input);
  auto load_out = [&](int ct, T* out_tile) {
    for (int i = tid; i < kRows * (kColumns / kVec); i += kThreads) {
      const int r = i / (kColumns / kVec), n = (i % (kColumns / kVec)) * kVec;
      const int64_t j = column(ct, n);
      const bool load = rows.live[r] && j >= 0;
      cp_async_16_zfill(smem_addr(out_tile + r * kOutPitch + n), load ? in + (entry0 + r) * 2 * width + j : in, load);
    }
  };
  T* out = static_cast<T*>(act.out);
  auto finish = [&](int ct, const T* out_tile) {
    const int64_t o0 = int64_t(ct) * kOutputs;
    for (int i = tid; i < kRows * (kOutputs / kVec); i += kThreads) {
      const int r = i / (kOutputs / kVec), n = (i % (kOutputs / kVec)) * kVec;
      const int64_t o = o0 + n;
      if (!rows.live[r] || o >= width) continue;
      // The kVec outputs' sums in two 16-byte shared loads (16 2-byte ones before): kPairs, 2 kVec
      // interleaved (gate, up) columns; else kVec gates, then kVec ups.
      const T* sums = out_tile + r * kOutPitch;
      Vec16<T> parts[2];
      parts[0] = *reinterpret_cast<const Vec16<T>*>(sums + (kPairs ? 2 * n : n));
      parts[1] = *reinterpret_cast<const Vec16<T>*>(sums + (kPairs ? 2 * n + kVec : kOutputs + n));
      Vec16<T> result;
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const int gate = kPairs ? 2 * e : e, up = kPairs ? 2 * e + 1 : kVec + e;
        const float g = to_float(parts[gate / kVec].v[gate % kVec]);
        const float u = to_float(parts[up / kVec].v[up % kVec]);
        result.v[e] = from_float<T>(gated_activation<kKind>(g, u, act.alpha, act.limit));
      }
      *reinterpret_cast<Vec16<T>*>(out + (entry0 + r) * width + o) = result;
    }
  };
  expand_column_tiles<T, kVectors, kColumns>(p, rows, tiles, launch, column, load_out, finish);
  allow_next_kernel_launch();
}

void check_expand(const LoraDeltaParams& p, const char* op) {
  if (p.sorted_token_ids == nullptr || p.entry_lora_ids == nullptr || p.block_lora_masks == nullptr ||
      p.block_size % 16 != 0 || p.rank > kMaxRankPadded || p.num_slices < 1 || p.num_slices > 2 ||
      p.dtype == DType::kFloat32 || !p.add_inputs || p.topk_weights != nullptr || p.adapters.max_loras > kMaxAdapters) {
    throw std::logic_error(std::string("moelora.") + op +
                           ": needs the segmented alignment, block_size % 16 == 0, rank <= 128, 1-2 slices, a 16-bit "
                           "type, add_inputs, no routed weights and at most 64 adapters");
  }
}

// An expand's work: its entry tiles and `output_columns` in tiles of tile_outputs outputs, and
// the column tile strides that make about kStreamCtasPerSm CTAs an SM where its CTAs stream;
// the fused_experts error for one too large.
struct ExpandShape {
  int64_t tiles = 0, column_tiles = 0, stream_strides = 1;
};

ExpandShape expand_shape(const LoraDeltaParams& p, int64_t output_columns, int tile_outputs) {
  ExpandShape shape;
  shape.tiles = (p.max_num_tokens_padded + kRows - 1) / kRows;
  shape.column_tiles = (output_columns + tile_outputs - 1) / tile_outputs;
  if (shape.tiles > INT32_MAX || shape.column_tiles > 65535) {
    throw Error("moelora.fused_experts: too many LoRA rows or columns for the expand (" + std::to_string(shape.tiles) +
                " row tiles, " + std::to_string(shape.column_tiles) + " column tiles)");
  }
  const int64_t target = int64_t(current_device_info().num_sms) * kStreamCtasPerSm;
  if (shape.tiles > 0) {
    shape.stream_strides = std::clamp<int64_t>((target + shape.tiles - 1) / shape.tiles, 1, shape.column_tiles);
  }
  return shape;
}

// The rule: stream where the runs are long (kStreamMinMeanRun), or not too short and a
// streaming CTA would walk many column tiles (kStreamMinShortRun, kStreamMinColumnTiles).
bool streams_by_rule(const LoraDeltaParams& p, const ExpandShape& shape) {
  return mean_run_at_least(p, kStreamMinMeanRun) ||
         (mean_run_at_least(p, kStreamMinShortRun) &&
          shape.column_tiles >= kStreamMinColumnTiles * shape.stream_strides);
}

// Whether the expand runs by 16-entry groups (lora_expand_groups_use()): where they fit (16-byte
// rows, slices x padded rank <= kExpandGroupsMaxKExtent) and, by the rule, where the mean run
// is short of kStreamMinMeanRun. Measured on an H200 (LoRA r16, 4 adapters, both expands by
// groups against the column tiles by the rule): the layer 0.91-0.99x at M = 256 on every
// model and at M = 1024 on Qwen3-30B and gpt-oss (mean runs 2-16), 1.04-1.12x at M = 4096
// (mean runs >= 32, where the tiles stream). The groups also beat the column tiles streamed at
// short runs (streams_by_rule's second clause): DeepSeek-V3 M = 1024 (mean run 8, GEMM2's 112
// column tiles) 0.984x of the layer (H200, 5e60aaa's PROOF_AB: groups everywhere).
bool expand_by_groups(const LoraDeltaParams& p, bool vectors) {
  if (!vectors || !expand_groups_fit(p)) return false;
  switch (lora_expand_groups_use()) {
    case ExpandGroupsUse::kNever: return false;
    case ExpandGroupsUse::kAlways: return true;
    default: return !mean_run_at_least(p, kStreamMinMeanRun);
  }
}

// The grid (entry tiles, column tile strides) of the column tiles' kernels, a tile `columns`
// wide, and how its CTAs walk them: streamed by the rule (lora_expand_stream_use()), else a
// column tile a CTA.
dim3 expand_grid(const LoraDeltaParams& p, const ExpandShape& shape, int columns, int64_t stage_pair_bytes,
                 int element_bytes, ExpandLaunch& launch) {
  launch.column_tiles = int(shape.column_tiles);
  launch.stage_pairs = int(std::clamp<int64_t>(
      stage_pair_bytes / pair_tile_bytes(columns, int(p.rank), p.num_slices, element_bytes), 1, kMaxPairs));
  switch (lora_expand_stream_use()) {
    case ExpandStreamUse::kNever: launch.stream = false; break;
    case ExpandStreamUse::kAlways: launch.stream = true; break;
    default: launch.stream = streams_by_rule(p, shape);
  }
  const int64_t strides = launch.stream ? shape.stream_strides : shape.column_tiles;
  return dim3(unsigned(std::max<int64_t>(shape.tiles, 0)), unsigned(std::max<int64_t>(strides, 0)));
}

template <class... Args>
void launch_expand(void (*kernel)(Args...), dim3 grid, int64_t smem, Stream stream, const Args&... args) {
  if (grid.x == 0 || grid.y == 0) return;
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  // The whole unified memory as shared memory where it helps: 5 expand CTAs of 44 KB an SM.
  MOELORA_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
  launch_kernel(kernel, grid, dim3(kThreads), size_t(smem), static_cast<cudaStream_t>(stream), args...);
}

}  // namespace

void moe_lora_expand_entries(const LoraDeltaParams& p, Stream stream) {
  check_expand(p, "moe_lora_expand_entries");
  dispatch_float(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (kTensorCores<T>) {
      const bool vectors = vectors_fit(p, int(sizeof(T)));
      if (expand_by_groups(p, vectors)) {
        moe_lora_expand_groups(p, stream);
        return;
      }
      const ExpandShape shape = expand_shape(p, p.N_slice * p.num_slices, kOutColumns);
      ExpandLaunch launch{};
      const dim3 grid = expand_grid(p, shape, kOutColumns, kStagePairBytesExpand, int(sizeof(T)), launch);
      const int64_t smem = smem_bytes(kOutColumns, int(p.rank), p.num_slices, launch.stage_pairs, int(sizeof(T)));
      if (vectors) {
        launch_expand(moe_lora_expand_entries_kernel<T, true>, grid, smem, stream, p, launch);
      } else {
        launch_expand(moe_lora_expand_entries_kernel<T, false>, grid, smem, stream, p, launch);
      }
    }
  });
}

void moe_lora_expand_activation(const LoraDeltaParams& p, const ActivationQuantizeParams& act, Stream stream) {
  check_expand(p, "moe_lora_expand_activation");
  if (act.element != act.dtype || act.dtype != p.dtype || p.N_slice * p.num_slices != 2 * act.width ||
      act.width % 8 != 0 || !aligned16(act.input) || !aligned16(act.out) || act.input != p.out ||
      act.max_num_tokens_padded != p.max_num_tokens_padded) {
    throw std::logic_error(
        "moelora.moe_lora_expand_activation: needs the expand's rows as the activation's input, 16-bit plain output, "
        "2 x width stack columns and 16-byte rows");
  }
  dispatch_float(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (kTensorCores<T>) {
      const bool vectors = vectors_fit(p, int(sizeof(T)));
      if (expand_by_groups(p, vectors)) {
        moe_lora_expand_activation_groups(p, act, stream);
        return;
      }
      const ExpandShape shape = expand_shape(p, act.width, kJoinOutputs);
      ExpandLaunch launch{};
      const dim3 grid = expand_grid(p, shape, 2 * kJoinOutputs, kStagePairBytesActivation, int(sizeof(T)), launch);
      const int64_t smem = smem_bytes(2 * kJoinOutputs, int(p.rank), p.num_slices, launch.stage_pairs, int(sizeof(T)));
      auto launch_kind = [&](auto kind_tag) {
        constexpr ActivationKind kKind = decltype(kind_tag)::value;
        if (vectors) {
          launch_expand(moe_lora_expand_activation_kernel<T, true, kKind>, grid, smem, stream, p, act, launch);
        } else {
          launch_expand(moe_lora_expand_activation_kernel<T, false, kKind>, grid, smem, stream, p, act, launch);
        }
      };
      switch (act.kind) {
        case ActivationKind::kSiluAndMul:
          launch_kind(std::integral_constant<ActivationKind, ActivationKind::kSiluAndMul>{});
          break;
        case ActivationKind::kGeluAndMul:
          launch_kind(std::integral_constant<ActivationKind, ActivationKind::kGeluAndMul>{});
          break;
        default: launch_kind(std::integral_constant<ActivationKind, ActivationKind::kSwigluOai>{});
      }
    }
  });
}

}  // namespace moelora::cuda
