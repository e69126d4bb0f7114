// moe_lora_expand_groups on CUDA: moe_lora_expand_entries' contract (the LoRA expand on the
// segmented alignment, added into a GEMM's output rows by entry) by 16-entry groups:
//   out[entry, j] += t[entry, c * rank :] · lora_b[c][l, e, j]ᵀ
// for each entry whose adapter l the segmented shrink wrote (t already scaled); and
// moe_lora_expand_activation_groups, moe_lora_expand_activation's (GEMM1's rows plus their
// deltas through the gated activation) the same way.
//
// A CTA takes one 16-entry group of the alignment (one block, so one expert) and 128 output
// columns; each of its 4 warps takes 32 of them and works alone (no CTA barrier): it reads
// the group's entries (slot, adapter; load_warp_tile_rows), then issues every copy it needs
// at once (cp.async: the t rows, its output rows and each of the group's adapters' lora_b
// rows, up to pairs_per_round adapters a round), waits once, runs one m16n8k16 MMA chain an
// adapter with the other adapters' rows masked out of the A fragments, adds the sums to its
// output rows in shared memory and writes the rows with an adapter back as 16-byte vectors.
//
// Why (docs/wip/design-lora-expand-groups.md): the peer's expand (one (adapter, expert) a
// 16-slot block, 128 columns, its loads issued together) ran GEMM2's expand 2.2-2.9x faster
// than moe_lora_expand_entries_kernel (64 entries x 64 columns a CTA, 5 CTAs an SM, four
// barriers between its index loads and its stores) at M <= 1024 (H200, dfb4c78: 130.5 against
// 296.9 us at DeepSeek-V3 M = 1024). Here a warp's chain is the peer's: the index loads, one
// round of copies, the MMAs, the stores; 64 registers and 26 KB of shared memory a CTA at
// rank 16 (8 CTAs an SM). Measured on an H200 (LoRA r16, 4 adapters): GEMM2's expand 297 ->
// 259 us at DeepSeek-V3 M = 1024 (the peer's 130.5: short of it), the join 37 -> 34; the layer
// 0.91-0.99x at mean runs of 2-16 entries, 1.04-1.12x at >= 32, where the column tiles stream
// instead (moe_lora_expand_entries.cu's rule picks: expand_by_groups).
#include <cute/arch/copy_sm80.hpp>

#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>
#include <type_traits>

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

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kWarpColumns = 32;  // a warp's output columns: two 16-column MMA fragments
constexpr int kFragments = kWarpColumns / 16;
constexpr int kCtaColumns = kWarps * kWarpColumns;
constexpr int kOutPitch = kWarpColumns + kPad;  // a warp's output tile row (elements)
// lora_b tiles a warp holds at once: as many as this many bytes take (rank 16, one slice:
// 1.5 KB a tile, so 3; rank 64: 1), at most kMaxRoundPairs. At rank 16 a warp's shared memory
// is then 6.5 KB, 26 KB a CTA: 8 CTAs an SM, as its 64 registers allow.
constexpr int kRoundPairBytes = 4608;
constexpr int kMaxRoundPairs = 4;

// Row pitch (elements) of the t and lora_b tiles at k_extent (slices x padded rank) columns.
__host__ __device__ constexpr int tile_pitch(int k_extent) { return k_extent + kPad; }

// A warp's shared memory (elements of T): t [16][pitch], its output rows [16][kOutPitch], then
// pairs_per_round lora_b tiles [kWarpColumns][pitch].
__host__ __device__ constexpr int warp_elements(int k_extent, int pairs_per_round) {
  return kTileRows * tile_pitch(k_extent) + kTileRows * kOutPitch + pairs_per_round * kWarpColumns * tile_pitch(k_extent);
}

// lora_b tiles a warp holds at once at k_extent columns.
template <typename T>
__host__ __device__ constexpr int pairs_per_round(int k_extent) {
  const int pairs = kRoundPairBytes / (kWarpColumns * tile_pitch(k_extent) * int(sizeof(T)));
  return pairs < 1 ? 1 : pairs > kMaxRoundPairs ? kMaxRoundPairs : pairs;
}

// kJoin false: moe_lora_expand_entries' rows (p.out), the CTA's 128 stack columns, the rows
// with an adapter written back. kJoin true: moe_lora_expand_activation's (act.input, GEMM1's
// rows [entries, 2I], the same rows as p.out), the CTA's 64 outputs (a warp's 16: its 32 tile
// columns are their gate and up columns, split (16 gates, then 16 ups) or interleaved
// (swiglu_oai)), every live row through the gated activation into act.out [entries, I].
// kKExtent: num_slices x padded rank (16, 32, 48 or 64), a template parameter so that every
// index a lane copies is worked out with constant divisors.
// NOTE: the per-copy index math was the kernel's time: under ncu (H200, DeepSeek-V3 M = 256,
// forty-seventh session) it issued 0.73-0.74 warps a scheduler at 45% occupancy, and of its
// warp instructions 22% were IMAD, 13% ISETP, ~20% more LOP3/LEA/IADD3/SHF, against 1% HMMA
// and 0.7% copies: each lora_b copy of each adapter took three shuffles, two divisions by
// run-time counts and a slice's parameters. A lane's copies of a lora_b tile are the same
// columns and K offsets for every adapter, so their sources are worked out once, before the
// adapters, and an adapter adds its stride.
template <typename T, bool kJoin, ActivationKind kKind, int kKExtent>
__global__ void __launch_bounds__(kThreads, 8)
    moe_lora_expand_groups_kernel(const LoraDeltaParams p, const ActivationQuantizeParams act) {
  static_assert(kTensorCores<T>, "the grouped path runs 16-bit types");
  static_assert(kKExtent % 16 == 0 && kKExtent <= kExpandGroupsMaxKExtent, "slices x padded rank");
  constexpr int kVec = Vec16<T>::kSize;
  constexpr bool kPairs = kKind == ActivationKind::kSwigluOai;
  constexpr int kWarpOutputs = kWarpColumns / 2;  // the join's
  constexpr int k_extent = kKExtent, pitch = tile_pitch(kKExtent), kPairsPerRound = pairs_per_round<T>(kKExtent);
  // A row's 16-byte vectors of t or of a lora_b column; a lane's copies of one lora_b tile
  // (32 columns) and of the t rows (16).
  constexpr int kTVectors = kKExtent / kVec;
  constexpr int kBCopies = kWarpColumns * kTVectors / 32, kTCopies = kTileRows * kTVectors / 32;
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int rank = int(p.rank), rank_padded = round_up16(rank);
  T* const t_tile = reinterpret_cast<T*>(smem) + warp * warp_elements(k_extent, kPairsPerRound);
  T* const out_tile = t_tile + kTileRows * pitch;
  T* const b_tiles = out_tile + kTileRows * kOutPitch;

  wait_for_previous_kernel();
  const int64_t entry0 = int64_t(blockIdx.x) * kTileRows, used = used_entries(p);
  const int64_t N = int64_t(p.num_slices) * p.N_slice, width = act.width;
  // The warp's first stack column (expand) or output (join).
  const int64_t first = int64_t(blockIdx.y) * (kJoin ? kWarps * kWarpOutputs : kCtaColumns) +
                        warp * (kJoin ? kWarpOutputs : kWarpColumns);
  if (entry0 >= used || first >= (kJoin ? width : N)) return;
  // Tile column n's stack column (GEMM1's, for the join), or -1 past the end. A run of kVec
  // tile columns from a multiple of kVec is kVec consecutive stack columns, all in or all out
  // (N, I multiples of kVec).
  auto column = [&](int n) -> int64_t {
    if constexpr (kJoin) {
      const int64_t o = first + (kPairs ? n / 2 : n % kWarpOutputs);
      if (o >= width) return -1;
      return kPairs ? 2 * first + n : (n < kWarpOutputs ? o : width + o);
    } else {
      return first + n < N ? first + n : -1;
    }
  };
  const WarpTileRows rows = load_warp_tile_rows(p, entry0, used);
  // Rows with an adapter (bit r: entry entry0 + r), the rows the warp reads and writes, and
  // each lane's two MMA rows' adapters.
  const uint32_t lora_rows = __ballot_sync(0xffffffffu, lane < kTileRows && rows.lora >= 0) & 0xffffu;
  const uint32_t io_rows = kJoin ? __ballot_sync(0xffffffffu, lane < kTileRows && rows.slot >= 0) & 0xffffu : lora_rows;
  if (io_rows == 0) return;  // nothing to add (or, joined, no row to activate) in this group
  const int low_lora = __shfl_sync(0xffffffffu, rows.lora, lane / 4);
  const int high_lora = __shfl_sync(0xffffffffu, rows.lora, lane / 4 + 8);

  // This lane's lora_b column (tile column lane; -1 past the end): its slice and offset in that
  // slice's stacks, computed once (column_slice); the copies below take them by shuffle.
  int my_slice = -1;
  int64_t my_offset = 0;
  if (const int64_t j = column(lane); j >= 0) {
    int64_t jn = 0;
    column_slice(p, j, my_slice, jn);
    my_offset = jn * p.slices[my_slice].b_stride_n;
  }

  // The t rows (zeros past the rank and on rows without an adapter) and the warp's rows.
  const T* t = static_cast<const T*>(p.intermediate);
  const int64_t t_cols = int64_t(p.num_slices) * rank;
  static_assert(kTCopies * 32 == kTileRows * kTVectors, "whole copies a lane");
#pragma unroll
  for (int m = 0; m < kTCopies; ++m) {
    const int i = lane + 32 * m, r = i / kTVectors, k = (i % kTVectors) * kVec;
    const int c = k / rank_padded, kr = k - c * rank_padded;
    const bool load = (lora_rows >> r & 1) && kr < rank;
    cp_async_16_zfill(smem_addr(t_tile + r * pitch + k), load ? t + (entry0 + r) * t_cols + c * rank + kr : t, load);
  }
  T* const out = static_cast<T*>(p.out);  // the join: act.input, the same rows
  const int64_t row_stride = kJoin ? 2 * width : p.out_stride_row;
  constexpr int kRowVectors = kWarpColumns / kVec;  // a row's
  for (int i = lane; i < kTileRows * kRowVectors; i += 32) {
    const int r = i / kRowVectors, n = (i % kRowVectors) * kVec;
    const int64_t j = column(n);
    const bool load = (io_rows >> r & 1) && j >= 0;
    cp_async_16_zfill(smem_addr(out_tile + r * kOutPitch + n), load ? out + (entry0 + r) * row_stride + j : out, load);
  }
  float acc[kFragments][8] = {};
  const uint32_t a_base = smem_addr(t_tile + mma_lane_a(pitch));
  const T* const fallback = static_cast<const T*>(p.slices[0].lora_b);  // a valid address where nothing is read
  // This lane's copy m of a lora_b tile: tile column n, K offset k; the row of that column's
  // slice at the expert (zeros in the other slices' K segments and past the rank), its source
  // at adapter 0 and the stride between adapters, the same for every adapter: worked out once
  // where a lane has at most 4 copies (k_extent <= 32; 8 would take 32 more registers and
  // spill, so at 48 and 64 each adapter's copies work them out again).
  struct BSource {
    const T* at_adapter0;
    int64_t stride;
    bool load;
  };
  auto b_source = [&](int m) {
    const int i = lane + 32 * m, n = i / kTVectors, k = (i % kTVectors) * kVec;
    const int slice = __shfl_sync(0xffffffffu, my_slice, n);
    const int64_t offset = __shfl_sync(0xffffffffu, my_offset, n);
    const int kr = k - slice * rank_padded;
    BSource b{fallback, 0, false};
    if (slice >= 0 && kr >= 0 && kr < rank) {
      const detail::LoraSliceParams& sl = p.slices[slice];
      b = {static_cast<const T*>(sl.lora_b) + rows.expert * sl.b_stride_expert + offset + kr, sl.b_stride_lora, true};
    }
    return b;
  };
  constexpr bool kSourcesOnce = kBCopies <= 4;
  BSource sources[kSourcesOnce ? kBCopies : 1];
  if constexpr (kSourcesOnce) {
#pragma unroll
    for (int m = 0; m < kBCopies; ++m) sources[m] = b_source(m);
  }
  uint64_t pending = rows.adapters;
  while (pending != 0) {
    // A round: up to kPairsPerRound adapters' lora_b tiles.
    int round_lora[kPairsPerRound];
    int count = 0;
#pragma unroll
    for (int q = 0; q < kPairsPerRound; ++q) {
      if (pending == 0) break;
      const int l = __ffsll(static_cast<long long>(pending)) - 1;
      pending &= pending - 1;
      round_lora[q] = l;
      count = q + 1;
      const uint32_t b_tile = smem_addr(b_tiles + q * kWarpColumns * pitch);
#pragma unroll(kSourcesOnce ? kBCopies : 1)
      for (int m = 0; m < kBCopies; ++m) {
        const int i = lane + 32 * m, n = i / kTVectors, k = (i % kTVectors) * kVec;
        BSource b;
        if constexpr (kSourcesOnce) {
          b = sources[m];
        } else {
          b = b_source(m);
        }
        cp_async_16_zfill(b_tile + (n * pitch + k) * int(sizeof(T)), b.load ? b.at_adapter0 + l * b.stride : fallback,
                          b.load);
      }
    }
    cute::cp_async_fence();
    cute::cp_async_wait<0>();
    __syncwarp();  // every lane's copies (the first round: the t and output rows too)
#pragma unroll
    for (int q = 0; q < kPairsPerRound; ++q) {
      if (q >= count) break;
      const int l = round_lora[q];
      const uint32_t b_base = smem_addr(b_tiles + q * kWarpColumns * pitch + mma_lane_b(pitch));
      mma_adapter_rows<T, kFragments>(acc, a_base, b_base, pitch, k_extent, low_lora == l, high_lora == l);
    }
    __syncwarp();  // the next round's lora_b tiles overwrite these
  }
  cute::cp_async_fence();
  cute::cp_async_wait<0>();  // the rows, where no adapter's round waited for them (the join)
  __syncwarp();

  add_fragment_sums<T, kFragments>(out_tile, acc);
  __syncwarp();  // the sums
  if constexpr (kJoin) {
    // Lane (r = lane / 2, h = lane % 2): row r's outputs first + 8h .. + 7, their gate and up
    // sums in two 16-byte shared loads, through the activation into act.out.
    const int r = lane / 2, h = lane % 2;
    const int64_t o = first + h * kVec;
    if ((io_rows >> r & 1) && o < width) {
      const T* sums = out_tile + r * kOutPitch;
      Vec16<T> parts[2];  // kPairs: 2 kVec interleaved (gate, up) columns; else kVec gates, then kVec ups
      parts[0] = *reinterpret_cast<const Vec16<T>*>(sums + (kPairs ? 2 * h * kVec : h * kVec));
      parts[1] = *reinterpret_cast<const Vec16<T>*>(sums + (kPairs ? 2 * h * kVec + kVec : kWarpOutputs + h * kVec));
      Vec16<T> result;
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const int gate = kPairs ? 2 * e : e, up = kPairs ? 2 * e + 1 : kVec + e;
        result.v[e] = from_float<T>(gated_activation<kKind>(to_float(parts[gate / kVec].v[gate % kVec]),
                                                             to_float(parts[up / kVec].v[up % kVec]), act.alpha,
                                                             act.limit));
      }
      *reinterpret_cast<Vec16<T>*>(static_cast<T*>(act.out) + (entry0 + r) * width + o) = result;
    }
  } else {
    for (int i = lane; i < kTileRows * kRowVectors; i += 32) {
      const int r = i / kRowVectors, n = (i % kRowVectors) * kVec;
      const int64_t j = column(n);
      if (!(io_rows >> r & 1) || j < 0) continue;
      *reinterpret_cast<Vec16<T>*>(out + (entry0 + r) * row_stride + j) =
          *reinterpret_cast<const Vec16<T>*>(out_tile + r * kOutPitch + n);
    }
  }
  allow_next_kernel_launch();
}

// Launches the kernel over the groups of the alignment and `column_tiles` (128 stack columns,
// or 64 outputs, a CTA).
template <bool kJoin, ActivationKind kKind = ActivationKind::kSiluAndMul>
void launch_groups(const LoraDeltaParams& p, const ActivationQuantizeParams& act, int64_t column_tiles,
                   Stream stream) {
  const int k_extent = expand_groups_k_extent(p);
  const int64_t groups = (p.max_num_tokens_padded + kTileRows - 1) / kTileRows;
  if (groups > INT32_MAX || column_tiles > 65535) {
    throw Error("moelora.fused_experts: too many LoRA rows or columns for the expand (" + std::to_string(groups) +
                " row groups, " + std::to_string(column_tiles) + " column tiles)");
  }
  if (groups == 0 || column_tiles == 0) return;
  dispatch_float(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (kTensorCores<T>) {
      const auto launch = [&](auto k_extent_tag) {
        constexpr int kKExtent = decltype(k_extent_tag)::value;
        const int smem = kWarps * warp_elements(kKExtent, pairs_per_round<T>(kKExtent)) * int(sizeof(T));
        auto* kernel = moe_lora_expand_groups_kernel<T, kJoin, kKind, kKExtent>;
        MOELORA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        MOELORA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                                cudaSharedmemCarveoutMaxShared));
        launch_kernel(kernel, dim3(unsigned(groups), unsigned(column_tiles)), dim3(kThreads), size_t(smem),
                      static_cast<cudaStream_t>(stream), p, act);
      };
      // check_groups: a multiple of 16, at most 64. Every value for the join too: with w13 as
      // one LoRA slice (gate and up in one stack) its k_extent is the padded rank, 16 or 48
      // as well. (de2377a launched the join's 64 instance there: t copied past its row.)
      switch (k_extent) {
        case 16: launch(std::integral_constant<int, 16>{}); break;
        case 32: launch(std::integral_constant<int, 32>{}); break;
        case 48: launch(std::integral_constant<int, 48>{}); break;
        default: launch(std::integral_constant<int, 64>{});
      }
    }
  });
}

void check_groups(const LoraDeltaParams& p, const char* op) {
  if (!expand_groups_fit(p) || p.dtype == DType::kFloat32) {
    throw std::logic_error(std::string("moelora.") + op + ": needs slices x padded rank <= 64 and a 16-bit type");
  }
}

}  // namespace

void moe_lora_expand_groups(const LoraDeltaParams& p, Stream stream) {
  check_groups(p, "moe_lora_expand_groups");
  launch_groups<false>(p, ActivationQuantizeParams{}, (p.N_slice * p.num_slices + kCtaColumns - 1) / kCtaColumns,
                       stream);
}

void moe_lora_expand_activation_groups(const LoraDeltaParams& p, const ActivationQuantizeParams& act, Stream stream) {
  check_groups(p, "moe_lora_expand_activation_groups");
  const int64_t column_tiles = (act.width + kWarps * kWarpColumns / 2 - 1) / (kWarps * kWarpColumns / 2);
  switch (act.kind) {
    case ActivationKind::kSiluAndMul: launch_groups<true, ActivationKind::kSiluAndMul>(p, act, column_tiles, stream); break;
    case ActivationKind::kGeluAndMul: launch_groups<true, ActivationKind::kGeluAndMul>(p, act, column_tiles, stream); break;
    default: launch_groups<true, ActivationKind::kSwigluOai>(p, act, column_tiles, stream);
  }
}

}  // namespace moelora::cuda
