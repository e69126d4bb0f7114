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
// On the segmented alignment (fused_experts' fused and grouped paths) the shrink is
// moe_lora_shrink (moe_lora_shrink_segmented.cu) and the expand is in the GEMM or
// moe_lora_expand_entries.cu.
// 16-bit types run on the tensor cores (mma.sync 16x8x16, fp32 accumulation); fp32 runs the
// same tiles on CUDA cores. Ranks are padded to 16 inside the kernels (zero rows of
// lora_a and zero columns of lora_b in shared memory); callers never pad.
// NOTE: a first, separate-kernel path (fused_experts with adapters adds the delta after
// each GEMM). Seed 003's fusion into the expert GEMM is the next step (docs/PERF_NOTES.md).
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
constexpr int kExpandGemvColumns = kGemvThreads;

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

}  // namespace

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
