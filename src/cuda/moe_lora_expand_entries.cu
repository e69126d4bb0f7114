// moe_lora_expand_entries on CUDA: the LoRA expand on the segmented alignment, added into a
// GEMM's output rows by entry (fused_experts' grouped path, whose CUTLASS GEMMs take no
// expand in their K loops):
//   out[entry, col(c, j)] += t[entry, c * rank :] · lora_b[c][l, e, j]ᵀ
// for each entry whose adapter l the segmented shrink wrote (moe_lora_shrink: t by entry,
// already scaled by the adapter's scale). Other entries (no adapter, a disabled one,
// padding, an expert not local) are not touched. moe_lora_expand_activation does GEMM1's
// expand and the gated activation in one pass: it reads GEMM1's rows, adds their deltas in
// registers and writes only the activation, where the expand alone would write GEMM1's rows
// back for the activation kernel to read again.
//
// A CTA takes 64 entries (four 16-row groups, one a warp; a group lies in one block of the
// alignment, so one expert) and 64 output columns (the activation: the 128 gate and up
// columns of 64 outputs), both slices together: the MMA's K runs over [slice 0's rank |
// slice 1's rank], and an output column's lora_b row holds its own slice's values and
// zeros in the other's, which serves the interleaved layout (gate and up alternating) and
// the split one alike. A block's entries hold runs of a few adapters (the segmented
// alignment pads only where an expert ends): the CTA takes each (expert, adapter) of its
// groups in turn, one lora_b tile for every warp with rows of that pair, each warp masking
// its other rows out of the MMA's A fragments.
//
// NOTE: the first version (16 entries x 64 columns of one slice a CTA, 2-byte loads and
// read-modify-writes after a chain of index loads) ran at ~12 ps an output element on an
// H200 (0.33 TB/s of read-modify-write: 1.4 ms of Qwen3-30B's LoRA layer at M = 4096,
// reports/gpu/2026-11-29-h200x2-8dc7e77-issue31.txt). Here a CTA does 4x the outputs, reads
// its index arrays in one round trip, issues its output rows' loads before its MMAs, and
// moves 16 bytes an access where the rank, strides and pointers allow (kVectors).
#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>

#include "common/params.h"
#include "cuda/cuda_check.h"
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

constexpr int kMaxAdapters = 64;     // kMaxLoraAdapters: bits of block_lora_masks
constexpr int kRows = 64;            // entries a CTA: four 16-row groups, one a warp
constexpr int kThreads = 128;        // 4 warps
constexpr int kGroups = kRows / 16;  // row groups (warps)
constexpr int kOutColumns = 64;      // output columns a CTA (the activation's: 128 GEMM1 columns)

// Row pitch (elements) of the t and lora_b tiles: both slices' padded ranks, plus kPad.
__host__ __device__ constexpr int tile_pitch(int rank, int slices) { return slices * round_up16(rank) + kPad; }
// fp32 staging row pitch (words) of kColumns sums, against bank conflicts.
__host__ __device__ constexpr int stage_pitch(int columns) { return columns + 4; }

// Dynamic shared memory: the t tile [kRows][pitch] and the lora_b tile [kColumns][pitch]
// of T, then the fp32 staging of the sums [kRows][stage_pitch].
__host__ __device__ constexpr int64_t smem_bytes(int columns, int rank, int slices, int element_bytes) {
  return int64_t(kRows + columns) * tile_pitch(rank, slices) * element_bytes +
         int64_t(kRows) * stage_pitch(columns) * 4;
}

// The dynamic shared memory's tiles (smem_bytes): t [kRows][pitch] and lora_b
// [columns][pitch] of T, then the fp32 sums [kRows][stage_pitch(columns)].
template <typename T>
struct TileBuffers {
  T* t;
  T* b;
  float* stage;
  __device__ __forceinline__ TileBuffers(unsigned char* smem, int columns, int pitch)
      : t(reinterpret_cast<T*>(smem)), b(t + kRows * pitch), stage(reinterpret_cast<float*>(b + columns * pitch)) {}
};

// Output column j (of num_slices * N_slice) as its slice and the column within it.
__device__ __forceinline__ void column_slice(const LoraDeltaParams& p, int64_t j, int& c, int64_t& jn) {
  if (p.interleaved_slices) {
    c = int(j % p.num_slices);
    jn = j / p.num_slices;
  } else {
    c = int(j / p.N_slice);
    jn = j % p.N_slice;
  }
}

// The CTA's rows: each row's adapter (-1: nothing to add), and whether the row holds a slot
// of a local expert at all (the activation's rows); each 16-row group's expert and adapters.
struct TileRows {
  int lora[kRows];
  bool live[kRows];
  int group_expert[kGroups];
  unsigned long long group_adapters[kGroups];
};

// Reads the tile's index arrays (one round trip: the entries' slots and adapters, the
// blocks' experts and masks). Ends with a barrier; returns whether any row has an adapter.
// Rows past `used` are neither live nor LoRA rows.
__device__ __forceinline__ bool load_tile_rows(const LoraDeltaParams& p, int64_t entry0, int64_t used, TileRows& rows) {
  const int tid = threadIdx.x;
  if (tid < kGroups) rows.group_adapters[tid] = 0;
  if (tid < kRows) {
    const int64_t entry = entry0 + tid;
    int l = -1, expert = -1;
    bool live = false;
    if (entry < used) {
      const int64_t block = entry / p.block_size;
      const int32_t slot = p.sorted_token_ids[entry];
      const int32_t entry_lora = p.entry_lora_ids[entry];
      expert = p.expert_ids[block];
      const unsigned long long mask = p.block_lora_masks[block];
      live = slot >= 0 && slot < p.num_slots && expert >= 0 && expert < p.num_experts;
      if (live && entry_lora >= 0 && entry_lora < kMaxAdapters && (mask >> entry_lora & 1)) l = entry_lora;
    }
    rows.lora[tid] = l;
    rows.live[tid] = live;
    // A 16-row group lies in one block (block_size % 16 == 0): one expert.
    if (tid % 16 == 0) rows.group_expert[tid / 16] = expert >= 0 && expert < p.num_experts ? expert : -1;
  }
  const bool any = __syncthreads_or(tid < kRows && rows.lora[tid] >= 0);
  if (tid < kRows && rows.lora[tid] >= 0) atomicOr(&rows.group_adapters[tid / 16], 1ull << rows.lora[tid]);
  return any;  // group_adapters are read after the caller's next barrier
}

// One run of a tile row: a 16-byte vector (kVectors) or one element from src, or zeros
// where !load (src is then not read).
template <typename T, bool kVectors>
__device__ __forceinline__ void copy_or_zero(T* dst, const T* src, bool load) {
  if constexpr (kVectors) {
    Vec16<T> v;
    if (load) {
      v = *reinterpret_cast<const Vec16<T>*>(src);
    } else {
#pragma unroll
      for (int e = 0; e < Vec16<T>::kSize; ++e) v.v[e] = from_float<T>(0.f);
    }
    *reinterpret_cast<Vec16<T>*>(dst) = v;
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
    copy_or_zero<T, kVectors>(t_tile + r * pitch + k, t + (entry0 + r) * t_cols + c * rank + kr, load);
  }
}

// The tile's deltas into acc (warp w: rows 16w..16w+15, columns 16f..16f+15 in acc[f]):
// each (expert, adapter) of the CTA's groups once, in group order (a group's adapters less
// those an earlier group of the same expert took; uniform across the CTA). column(n) is the
// stack column (of num_slices * N_slice) of the tile's column n, or -1 past the end.
// Expects the t tile and rows.group_adapters visible (a barrier since they were written).
template <typename T, bool kVectors, int kFragments, class Column>
__device__ __forceinline__ void add_tile_deltas(const LoraDeltaParams& p, const TileRows& rows, const T* t_tile,
                                                T* b_tile, Column column, float (&acc)[kFragments][8]) {
  using Mma = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, cute::SM80_16x8x16_F32BF16BF16F32_TN,
                                 cute::SM80_16x8x16_F32F16F16F32_TN>;
  constexpr int kColumns = kFragments * 16;
  constexpr int kStep = kVectors ? Vec16<T>::kSize : 1;
  const int rank = int(p.rank), rank_padded = round_up16(rank);
  const int pitch = tile_pitch(rank, p.num_slices), k_extent = p.num_slices * rank_padded;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const uint32_t a_base = smem_addr(t_tile + warp * 16 * pitch + mma_lane_a(pitch));
  const uint32_t b_base = smem_addr(b_tile + mma_lane_b(pitch));
  for (int g = 0; g < kGroups; ++g) {
    const int expert = rows.group_expert[g];
    if (expert < 0) continue;
    unsigned long long pending = rows.group_adapters[g];
    for (int h = 0; h < g; ++h) {
      if (rows.group_expert[h] == expert) pending &= ~rows.group_adapters[h];
    }
    for (; pending != 0; pending &= pending - 1) {
      const int l = __ffsll(static_cast<long long>(pending)) - 1;
      // lora_b rows of the tile's columns for (expert, l), each in its slice's K segment.
      const int per_row = k_extent / kStep;
      for (int i = tid; i < kColumns * per_row; i += kThreads) {
        const int n = i / per_row, k = (i % per_row) * kStep;
        const int seg = k / rank_padded, kr = k % rank_padded;
        const int64_t j = column(n);
        int c = 0;
        int64_t jn = 0;
        bool load = j >= 0 && kr < rank;
        if (load) {
          column_slice(p, j, c, jn);
          load = c == seg;
        }
        const detail::LoraSliceParams& sl = p.slices[c];
        copy_or_zero<T, kVectors>(b_tile + n * pitch + k,
                                  static_cast<const T*>(sl.lora_b) + l * sl.b_stride_lora +
                                      expert * sl.b_stride_expert + jn * sl.b_stride_n + kr,
                                  load);
      }
      __syncthreads();
      // The warps of this expert with rows of l: MMAs with the other rows' A fragments zero
      // (a0/a2 hold row lane / 4 of the 16, a1/a3 row lane / 4 + 8).
      if (rows.group_expert[warp] == expert && (rows.group_adapters[warp] >> l & 1)) {
        const bool low = rows.lora[warp * 16 + lane / 4] == l, high = rows.lora[warp * 16 + lane / 4 + 8] == l;
        for (int kk = 0; kk < k_extent; kk += 16) {
          uint32_t a0, a1, a2, a3;
          ldmatrix_x4(a_base + kk * sizeof(T), a0, a1, a2, a3);
          if (!low) a0 = a2 = 0;
          if (!high) a1 = a3 = 0;
#pragma unroll
          for (int f = 0; f < kFragments; ++f) {
            uint32_t b0, b1, b2, b3;
            ldmatrix_x4(b_base + (f * 16 * pitch + kk) * sizeof(T), b0, b1, b2, b3);
            Mma::fma(acc[f][0], acc[f][1], acc[f][2], acc[f][3], a0, a1, a2, a3, b0, b1, acc[f][0], acc[f][1],
                     acc[f][2], acc[f][3]);
            Mma::fma(acc[f][4], acc[f][5], acc[f][6], acc[f][7], a0, a1, a2, a3, b2, b3, acc[f][4], acc[f][5],
                     acc[f][6], acc[f][7]);
          }
        }
      }
      __syncthreads();  // the next pair's lora_b tile overwrites this one
    }
  }
}

// acc into the staging tile [kRows][stage_pitch(16 * kFragments)] (this warp's 16 rows).
template <int kFragments>
__device__ __forceinline__ void stage_sums(float* stage, const float (&acc)[kFragments][8]) {
  constexpr int kPitch = stage_pitch(kFragments * 16);
  const int warp = threadIdx.x / 32;
#pragma unroll
  for (int f = 0; f < kFragments; ++f) store_mma_16x16(stage + warp * 16 * kPitch + f * 16, kPitch, acc[f]);
}

// Grid (entry tiles of kRows, column tiles of kOutColumns over both slices).
// NOTE: at __launch_bounds__(kThreads) ptxas (CUDA 13.0) gave the fp16 kernel 80 registers
// and 72 bytes of spills; asking for 4 CTAs an SM it takes 117-126 and spills nothing.
template <typename T, bool kVectors>
__global__ void __launch_bounds__(kThreads, 4) moe_lora_expand_entries_kernel(const LoraDeltaParams p) {
  static_assert(kTensorCores<T>, "the grouped path runs 16-bit types");
  constexpr int kFragments = kOutColumns / 16, kPitch = stage_pitch(kOutColumns);
  constexpr int kVectorsPerThread = kRows * kOutColumns / 8 / kThreads;  // 16-byte output vectors
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ TileRows rows;
  const TileBuffers<T> tiles(smem, kOutColumns, tile_pitch(int(p.rank), p.num_slices));
  const int tid = threadIdx.x;

  wait_for_previous_kernel();
  const int64_t entry0 = int64_t(blockIdx.x) * kRows, used = used_entries(p);
  if (entry0 >= used) return;
  const int64_t N = int64_t(p.num_slices) * p.N_slice;
  const int64_t col0 = int64_t(blockIdx.y) * kOutColumns;
  if (!load_tile_rows(p, entry0, used, rows)) return;  // nothing to add here

  // This thread's output vectors (row, 8 columns), loaded now so that their latency runs
  // under the tiles' loads and the MMAs.
  using Vec = Vec16<T>;
  Vec prior[kVectorsPerThread];
  T* out = static_cast<T*>(p.out);
  if constexpr (kVectors) {
#pragma unroll
    for (int q = 0; q < kVectorsPerThread; ++q) {
      const int v = tid + q * kThreads, r = v / (kOutColumns / 8);
      const int64_t j = col0 + (v % (kOutColumns / 8)) * 8;
      if (rows.lora[r] >= 0 && j < N) prior[q] = *reinterpret_cast<const Vec*>(out + (entry0 + r) * p.out_stride_row + j);
    }
  }
  load_t_tile<T, kVectors>(p, entry0, rows, tiles.t);
  __syncthreads();  // the groups' adapters, the t tile

  float acc[kFragments][8] = {};
  add_tile_deltas<T, kVectors, kFragments>(
      p, rows, tiles.t, tiles.b, [col0, N](int n) { return col0 + n < N ? col0 + n : int64_t(-1); }, acc);
  stage_sums<kFragments>(tiles.stage, acc);
  __syncthreads();

  if constexpr (kVectors) {
#pragma unroll
    for (int q = 0; q < kVectorsPerThread; ++q) {
      const int v = tid + q * kThreads, r = v / (kOutColumns / 8), n = (v % (kOutColumns / 8)) * 8;
      const int64_t j = col0 + n;
      if (rows.lora[r] < 0 || j >= N) continue;
      Vec sum;
#pragma unroll
      for (int e = 0; e < Vec::kSize; ++e) sum.v[e] = from_float<T>(to_float(prior[q].v[e]) + tiles.stage[r * kPitch + n + e]);
      *reinterpret_cast<Vec*>(out + (entry0 + r) * p.out_stride_row + j) = sum;
    }
  } else {
    for (int i = tid; i < kRows * kOutColumns; i += kThreads) {
      const int r = i / kOutColumns, n = i % kOutColumns;
      const int64_t j = col0 + n;
      if (rows.lora[r] < 0 || j >= N) continue;
      const int64_t at = (entry0 + r) * p.out_stride_row + j * p.out_stride_n;
      out[at] = from_float<T>(to_float(out[at]) + tiles.stage[r * kPitch + n]);
    }
  }
  allow_next_kernel_launch();
}

// GEMM1's rows [entries, 2I] (act.input; p describes the same rows as its `out`) plus their
// deltas, through the gated activation into [entries, I] (act.out), each sum rounded to T
// as the expand's write would, and the activation rounded to T as the activation kernel's.
// Tile column n < 64 is gate output o0 + n, n >= 64 its up (split halves: GEMM1 columns
// o0 + n and I + o0 + n - 64; swiglu_oai's interleaved pairs: 2 o0 + n, the activation's
// gate and up then at 2i and 2i + 1). Grid (entry tiles of kRows, output tiles of 64).
// 128 accumulator columns a warp: 149-153 registers at 3 CTAs an SM (the default bound
// left 128 and spilled 12 bytes in swiglu_oai's).
template <typename T, bool kVectors, ActivationKind kKind>
__global__ void __launch_bounds__(kThreads, 3) moe_lora_expand_activation_kernel(const LoraDeltaParams p,
                                                                              const ActivationQuantizeParams act) {
  static_assert(kTensorCores<T>, "the grouped path runs 16-bit types");
  constexpr int kColumns = 2 * kOutColumns, kFragments = kColumns / 16, kPitch = stage_pitch(kColumns);
  constexpr bool kPairs = kKind == ActivationKind::kSwigluOai;
  constexpr int kVec = 8;  // outputs a thread and step (16-byte rows of T)
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ TileRows rows;
  const TileBuffers<T> tiles(smem, kColumns, tile_pitch(int(p.rank), p.num_slices));
  const int tid = threadIdx.x;

  wait_for_previous_kernel();
  const int64_t entry0 = int64_t(blockIdx.x) * kRows, used = used_entries(p);
  if (entry0 >= used) return;
  const int64_t width = act.width;  // I
  const int64_t o0 = int64_t(blockIdx.y) * kOutColumns;
  const bool any_lora = load_tile_rows(p, entry0, used, rows);

  float acc[kFragments][8] = {};
  if (any_lora) {
    load_t_tile<T, kVectors>(p, entry0, rows, tiles.t);
    __syncthreads();  // the groups' adapters, the t tile
    add_tile_deltas<T, kVectors, kFragments>(
        p, rows, tiles.t, tiles.b,
        [o0, width](int n) -> int64_t {
          const int64_t o = o0 + (kPairs ? n / 2 : n % kOutColumns);  // the tile column's output
          if (o >= width) return -1;
          return kPairs ? 2 * o0 + n : (n < kOutColumns ? o : width + o);
        },
        acc);
  }
  stage_sums<kFragments>(tiles.stage, acc);
  __syncthreads();  // the staging; rows.live (load_tile_rows' barrier when any_lora is false)

  const T* in = static_cast<const T*>(act.input);
  T* out = static_cast<T*>(act.out);
  for (int i = tid; i < kRows * (kOutColumns / kVec); i += kThreads) {
    const int r = i / (kOutColumns / kVec), n = (i % (kOutColumns / kVec)) * kVec;
    const int64_t o = o0 + n;
    if (!rows.live[r] || o >= width) continue;
    T gate[kVec], up[kVec];
    load_gate_up<T, kKind, kVec>(in + (entry0 + r) * 2 * width, width, o, gate, up);
    const float* sums = tiles.stage + r * kPitch;
    T result[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const float g = to_float(from_float<T>(to_float(gate[e]) + sums[kPairs ? 2 * (n + e) : n + e]));
      const float u = to_float(from_float<T>(to_float(up[e]) + sums[kPairs ? 2 * (n + e) + 1 : kOutColumns + n + e]));
      result[e] = from_float<T>(gated_activation<kKind>(g, u, act.alpha, act.limit));
    }
    *reinterpret_cast<Vec16<T>*>(out + (entry0 + r) * width + o) = *reinterpret_cast<const Vec16<T>*>(result);
  }
  allow_next_kernel_launch();
}

// Whether every row the kernels move is whole 16-byte vectors at 16-byte addresses: the
// rank (t and lora_b rows), the strides in elements and the base pointers.
bool vectors_fit(const LoraDeltaParams& p, int element_bytes) {
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

void check_expand(const LoraDeltaParams& p, const char* op) {
  if (p.sorted_token_ids == nullptr || p.entry_lora_ids == nullptr || p.block_lora_masks == nullptr ||
      p.block_size % 16 != 0 || p.rank > kMaxRankPadded || p.num_slices < 1 || p.num_slices > 2 ||
      p.dtype == DType::kFloat32 || !p.add_inputs || p.topk_weights != nullptr || p.adapters.max_loras > kMaxAdapters) {
    throw std::logic_error(std::string("moelora.") + op +
                           ": needs the segmented alignment, block_size % 16 == 0, rank <= 128, 1-2 slices, a 16-bit "
                           "type, add_inputs, no routed weights and at most 64 adapters");
  }
}

// The grid (entry tiles, column tiles), with the fused_experts error for one too large.
dim3 expand_grid(const LoraDeltaParams& p, int64_t output_columns) {
  const int64_t tiles = (p.max_num_tokens_padded + kRows - 1) / kRows;
  const int64_t column_tiles = (output_columns + kOutColumns - 1) / kOutColumns;
  if (tiles > INT32_MAX || column_tiles > 65535) {
    throw Error("moelora.fused_experts: too many LoRA rows or columns for the expand (" + std::to_string(tiles) +
                " row tiles, " + std::to_string(column_tiles) + " column tiles)");
  }
  return dim3(unsigned(std::max<int64_t>(tiles, 0)), unsigned(std::max<int64_t>(column_tiles, 0)));
}

template <class... Args>
void launch_expand(void (*kernel)(Args...), dim3 grid, int64_t smem, Stream stream, const Args&... args) {
  if (grid.x == 0 || grid.y == 0) return;
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  launch_kernel(kernel, grid, dim3(kThreads), size_t(smem), static_cast<cudaStream_t>(stream), args...);
}

}  // namespace

void moe_lora_expand_entries(const LoraDeltaParams& p, Stream stream) {
  check_expand(p, "moe_lora_expand_entries");
  const dim3 grid = expand_grid(p, p.N_slice * p.num_slices);
  dispatch_float(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (kTensorCores<T>) {
      const int64_t smem = smem_bytes(kOutColumns, int(p.rank), p.num_slices, int(sizeof(T)));
      if (vectors_fit(p, int(sizeof(T)))) {
        launch_expand(moe_lora_expand_entries_kernel<T, true>, grid, smem, stream, p);
      } else {
        launch_expand(moe_lora_expand_entries_kernel<T, false>, grid, smem, stream, p);
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
  const dim3 grid = expand_grid(p, act.width);
  dispatch_float(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (kTensorCores<T>) {
      const int64_t smem = smem_bytes(2 * kOutColumns, int(p.rank), p.num_slices, int(sizeof(T)));
      const bool vectors = vectors_fit(p, int(sizeof(T)));
      auto launch = [&](auto kind_tag) {
        constexpr ActivationKind kKind = decltype(kind_tag)::value;
        if (vectors) {
          launch_expand(moe_lora_expand_activation_kernel<T, true, kKind>, grid, smem, stream, p, act);
        } else {
          launch_expand(moe_lora_expand_activation_kernel<T, false, kKind>, grid, smem, stream, p, act);
        }
      };
      switch (act.kind) {
        case ActivationKind::kSiluAndMul:
          launch(std::integral_constant<ActivationKind, ActivationKind::kSiluAndMul>{});
          break;
        case ActivationKind::kGeluAndMul:
          launch(std::integral_constant<ActivationKind, ActivationKind::kGeluAndMul>{});
          break;
        default: launch(std::integral_constant<ActivationKind, ActivationKind::kSwigluOai>{});
      }
    }
  });
}

}  // namespace moelora::cuda
