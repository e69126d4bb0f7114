// fused_moe on Hopper tensor cores (sm_90a): warp-specialised, persistent, wgmma,
// optionally in 2-CTA clusters that share the weight tile.
//
// A CTA of three warpgroups loops over output tiles [kBlockM entries of
// sorted_token_ids (one expert: kBlockM divides the block size), kBlockN weight rows]:
//   - warpgroup 0, the producer (56 registers a thread): weight tiles by TMA (one
//     thread), activation rows by cp.async from all 128 threads, since the rows are
//     gathered (row = slot / top_k) and TMA on Hopper cannot gather; or, when the rows
//     are in sorted order (GemmParams::a_rows_sorted: GEMM2 of fused_experts, whose
//     GEMM1 stored the activation by entry, and GEMM1 on a sorted copy of x,
//     MoeKernelConfig::sorted_input), the whole A tile as one TMA box. NOTE: the
//     gathered cp.async rows cost far more than their bytes: dropping them sped
//     Mixtral's layer at M = 4096 up ~1.5x, dropping the twice larger weight tiles 1.15x;
//     one TMA box per gathered row was slower still (H100, docs/PERF_NOTES.md step 6);
//   - warpgroups 1 and 2, the consumers (224 registers; a 64 x 256 accumulator takes
//     128): wgmma from the shared-memory ring into fp32 accumulators, then the
//     epilogue. kBlockM = 128: each consumer owns 64 rows and the whole width;
//     kBlockM = 64: each owns half the width.
// The ring has kStages slots with two mbarriers each: `full` (129 arrivals: one per
// producer thread through cp.async.mbarrier.arrive.noinc, or a plain arrival with sorted
// rows, and one from the TMA thread with the TMA bytes as its transaction count) and
// `empty` (one arrival per consumer warp of every CTA of the cluster once the wgmmas that
// read the slot have retired). The producer runs ahead into the next tile while the
// consumers store this one. NOTE: with sorted rows the producer still reads its
// (unwritten, unused) row table before each wait: left as measured (step 6).
//
// Clusters (kClusterM = 2): the two CTAs take the two m-tiles of a pair (2p, 2p + 1) in
// the same n column; when both belong to one expert, each loads half of the weight
// boxes by TMA multicast into both CTAs, halving the weight traffic from L2. A pair that
// straddles two experts loads unshared. To keep the ring slots safe to multicast into,
// every consumer warp releases a slot in both CTAs, so the pair walks its tiles in
// lockstep (both have the same K steps per tile); a CTA whose own tile is past the end
// or not on this rank still turns its ring with empty stages. Before exit, the producer
// waits until every slot is released (the partner's last arrivals land in this CTA's
// shared memory). NOTE: measured on H100 at M = 4096, clusters gain 0-4% (Mixtral most):
// L2 traffic is not what limits these tiles (vLLM's Triton kernel moves as many L2 bytes
// per FLOP with the same 128 x 256 tile and runs its GEMMs in 697 us where this kernel
// takes ~950 on Qwen3-30B). Nor is DRAM: ordered tiles (below) cut Mixtral's GEMM1 DRAM
// reads at M = 4096 from 9.9 to 4.3 GB but its time only from 4.38 to 4.07 ms (ncu,
// H100; docs/PERF_NOTES.md, step 5): the tensor pipe waits on the ring's fill.
// NOTE: a ping-pong version (64-row tiles, one consumer warpgroup each, producer-owned
// per-tile tables one tile ahead) measured 10% slower and, before an order barrier was
// added, read stale slots: ring barriers are waited on by parity, so a warpgroup that
// runs a whole tile ahead sees an older phase of a slot as its own (docs/PERF_NOTES.md,
// step 3).
//
// Persistence: the grid is at most one CTA per SM (and no more clusters than fit at
// once), and the tiles follow a grouped raster (kGroupM m-tiles down each N column before
// moving right), so the CTAs working at one time share one expert's weight slab in L2.
// Cluster c takes cluster tiles c, c + clusters, ... (static), or, with a tile counter,
// the next tile in raster order as it frees up (Sm90TileQueue). The tile count comes
// from the device-side num_tokens_post_padded; no host sync.
//
// Gated GEMM (GemmParams::gated): the TMA boxes place gate and up rows so that every
// consumer thread holds both inputs of its outputs (GatedTileColumn, with slices of
// kBlockN / kWarpgroupsN columns); the epilogue applies the activation in registers.
//
// Epilogue: each quad of lanes holds 8 adjacent columns of a row as four pairs; a 4 x 4
// transpose of packed pairs across the quad gives every lane 8 adjacent columns, stored
// as one 16-byte write. NOTE: the pair-wise 4-byte stores used 8 of every 32 bytes a
// sector moved (ncu) and cost ~220 us of the 1260 us layer (Qwen3-30B, M = 4096).
//
// Fused LoRA expand (GemmParams::lora_t, issue 4): on the segmented alignment (plain
// expert blocks whose entries run adapter by adapter), a tile runs a few more K steps
// through the same ring and wgmmas: each adapter of its block owns S * rank K columns, A =
// the rows of the shrink's output t [entries, S * rank] whose entry has that adapter (zero
// for the others), B = that adapter's lora_b rows for the tile's columns, block-diagonal
// over the slices (gate rows read t's gate columns, up rows the up ones). So the delta
// lands in the accumulators before the epilogue's routed weight and activation. The
// producer loads both by cp.async (t's rows are consecutive entries; lora_b's rows follow
// the weight boxes' placement). NOTE: the shrink x · Aᵀ runs as its own kernel: done in
// this K loop (seed 003), every n-tile of a row block would repeat it, S * r / kBlockN
// more wgmma work on every tile (GEMM1 at r = 64: +50%), where the expand's steps add
// (adapters in the block) * S * r / K. NOTE: blocks of one (expert, adapter) each (the
// virtual alignment) cost ~4x the base tiles at 4 adapters, mostly padding rows
// (Mixtral M = 64: 2.9 ms against 1.0 without adapters; docs/PERF_NOTES.md, step 2).
#pragma once

#include <cute/arch/cluster_sm90.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include <algorithm>

#include "common/params.h"
#include "cuda/cuda_check.h"
#include "cuda/device_info.h"
#include "cuda/fused_moe_lora_steps.cuh"
#include "cuda/fused_moe_sm90_schedule.cuh"
#include "cuda/fused_moe_sm90_weight_only.cuh"
#include "cuda/fused_moe_tile.cuh"
#include "cuda/gated_activation.cuh"
#include "cuda/launch.cuh"
#include "cuda/tensor_map.h"

namespace moelora::cuda {

template <class Element_, int kBlockM_, int kBlockN_, int kClusterM_, int kWeightBits_ = 16, bool kFusedLora_ = true>
struct FusedMoeSm90Config {
  using Element = Element_;  // cute::bfloat16_t or cute::half_t
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kClusterM = kClusterM_;  // CTAs sharing one weight tile (m-tiles 2p, 2p + 1)
  // 16: the experts' weights are Element; 4 or 8: packed weight-only experts that the
  // consumers convert (fused_moe_sm90_weight_only.cuh), in 1-CTA clusters.
  static constexpr int kWeightBits = kWeightBits_;
  static constexpr bool kWeightOnly = kWeightBits < 16;
  // The fused LoRA expand's K steps (GemmParams::lora_t, 1-CTA clusters). Weight-only
  // instances come with and without (their consumers read lora_b themselves): the expand's
  // code cost the 128 x 256 4-bit instance 160 more bytes of spills (nvcc 13.0), which
  // calls without adapters need not pay.
  static constexpr bool kFusedLora = kFusedLora_ && kClusterM == 1;
  static constexpr int kBlockK = 64;  // 128 bytes: one 128B-swizzle row
  static constexpr int kProducerThreads = 128;
  static constexpr int kConsumerThreads = 256;
  static constexpr int kThreads = kProducerThreads + kConsumerThreads;
  static constexpr int kConsumerWarps = kConsumerThreads / 32;
  // Registers a thread of each role (setmaxnreg): the 168 a thread of the launch bounds
  // redistributed, 56 + 2 x 224 = 3 x 168 (an increment beyond that pool never returns).
  static constexpr int kProducerRegisters = 56;
  static constexpr int kConsumerRegisters = 224;
  static_assert(kProducerRegisters + 2 * kConsumerRegisters <= 3 * 168, "the launch's registers");
  // Named barriers: the consumer warpgroups' (tile tables); weight-only, the B buffer's
  // converters (both consumer warpgroups, or each its own slice: + the warpgroup).
  static constexpr int kConsumerBarrier = 1;
  static constexpr int kConvertBarrier = 2;
  // wgmma batches a consumer leaves in flight when it waits: 1 overlaps consecutive K
  // steps but holds two ring slots. NOTE: 0 (one slot held, the pipe drained each step)
  // measured the same on H100 at M = 4096 (Qwen3-30B, Mixtral, DeepSeek).
  static constexpr int kMmaInFlight = 1;
  static constexpr int kGroupM = 8;  // raster group (m-tiles per N sweep)
  static_assert(kBlockM == 64 || kBlockM == 128, "kBlockM must be 64 or 128");
  static_assert(kBlockN == 128 || kBlockN == 256, "kBlockN must be 128 or 256");
  static_assert(kClusterM == 1 || kClusterM == 2, "kClusterM must be 1 or 2");
  static_assert(kGroupM % kClusterM == 0, "a raster group holds whole clusters");
  static_assert(kWeightBits == 16 || ((kWeightBits == 4 || kWeightBits == 8) && kClusterM == 1),
                "weight-only tiles are 4- or 8-bit, each CTA converting its own weights");

  static constexpr int kWarpgroupsM = kBlockM / 64;
  static constexpr int kWarpgroupsN = 2 / kWarpgroupsM;
  // Columns one consumer warpgroup holds: the slice of the gated layout.
  static constexpr int kSlice = kBlockN / kWarpgroupsN;
  // TMA boxes of weight rows: half a slice each (a gate or an up half), 2 * kWarpgroupsN a stage.
  static constexpr int kBoxRows = kSlice / 2;
  static constexpr int kBoxes = kBlockN / kBoxRows;
  static_assert(kBoxes % kClusterM == 0, "the CTAs of a cluster load equal shares of the boxes");
  using MmaAtom = decltype(cute::GMMA::ss_op_selector<Element, Element, float,
                                                      cute::Shape<cute::_64, cute::Int<kSlice>, cute::Int<kBlockK>>>());
  using TiledMma = decltype(cute::make_tiled_mma(
      MmaAtom{}, cute::Layout<cute::Shape<cute::Int<kWarpgroupsM>, cute::Int<kWarpgroupsN>, cute::_1>>{}));

  static constexpr int kStageBytesA = kBlockM * kBlockK * int(sizeof(Element));
  static constexpr int kStageBytesB = kBlockN * kBlockK * int(sizeof(Element));
  // Weight-only: a ring slot holds A and the step's packed weight rows; the consumers
  // convert those into one of three 16-bit B buffers (kBSlots): a warpgroup converts step
  // i while the other may still run step i - 2's wgmma (each waits for its own i - 1's).
  static constexpr int kPackedRowBytes = kBlockK * kWeightBits / 8;
  static constexpr int kPackedStageBytes = kWeightOnly ? kBlockN * kPackedRowBytes : 0;
  static constexpr int kBBufferBytes = kWeightOnly ? 3 * kStageBytesB : 0;
  static constexpr int kStageBytes = kStageBytesA + (kWeightOnly ? kPackedStageBytes : kStageBytesB);
  // Activation-row copies: each producer thread owns one 16-byte K column of fixed rows.
  static constexpr int kChunksPerRow = kBlockK * int(sizeof(Element)) / 16;  // 8
  static constexpr int kRowsPerPass = kProducerThreads / kChunksPerRow;      // 16
  static constexpr int kChunksA = kBlockM / kRowsPerPass;
  // Shared memory past the ring: 1024 bytes of alignment slack, two barriers a slot,
  // two tiles' slot/weight tables for the consumers, and the producer's row table.
  static constexpr int kTableBytes =
      2 * kBlockM * int(sizeof(int32_t) + sizeof(float)) + kChunksA * kProducerThreads * int(sizeof(int32_t));
  // The ordered tile queue (Sm90TileQueue): entries and two barriers each.
  static constexpr int kTileQueueDepth = 4;
  static constexpr int kTileQueueBytes = kTileQueueDepth * int(2 * sizeof(uint64_t) + sizeof(int32_t));
  static constexpr int kRingBudget = 232448 - 1024 - 16 * 8 - kTileQueueBytes - kTableBytes;  // 227 KB opt-in limit
  // NOTE: more than 8 slots adds nothing (8 already cover ~2 us of loads at 64 x 128).
  static constexpr int kStagesFit = (kRingBudget - kBBufferBytes) / kStageBytes;
  static constexpr int kStages = kStagesFit < 8 ? kStagesFit : 8;
  static_assert(kStages >= 3, "the pipeline needs three slots");

  using SmemAtom = cute::GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutA = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockK>, cute::Int<kStages>>{}));
  static constexpr int kBSlots = kWeightOnly ? 3 : kStages;  // the ring's B slots, or the B buffers
  using SmemLayoutB = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockK>, cute::Int<kBSlots>>{}));
  static constexpr int kSmemElementsA = cute::cosize(SmemLayoutA{});
  static constexpr int kSmemElementsB = cute::cosize(SmemLayoutB{});
  static constexpr size_t kSmemBytes = 1024 + size_t(kStages) * kStageBytes + kBBufferBytes +
                                       2 * kStages * sizeof(uint64_t) + kTileQueueBytes + kTableBytes;
};

// Lane q of each quad holds word w[j] for column group j of a 4-group block (its own
// columns 2q, 2q + 1 of the group); afterwards it holds t[p] = lane p's word of group q,
// i.e. the 8 adjacent columns of group q in order. Selects, not register indexing, so
// the arrays stay in registers.
__device__ __forceinline__ void quad_transpose(const uint32_t (&w)[4], uint32_t (&t)[4]) {
  const int q = threadIdx.x % 4;
  auto pick = [&](int i) { return i == 0 ? w[0] : i == 1 ? w[1] : i == 2 ? w[2] : w[3]; };
#pragma unroll
  for (int i = 0; i < 4; ++i) t[i] = 0;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int peer = q ^ r;
    const uint32_t got = r == 0 ? pick(q) : __shfl_xor_sync(0xffffffffu, pick(peer), r);
#pragma unroll
    for (int i = 0; i < 4; ++i) t[i] = peer == i ? got : t[i];
  }
}

template <class T>
__device__ __forceinline__ uint32_t pack_pair(float v0, float v1) {
  cute::array<T, 2> pair;
  pair[0] = T(v0);
  pair[1] = T(v1);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

// kCount int32 from shared memory (16-byte aligned, kCount a multiple of 4) with vector
// shared loads; the pointer is generic, so the compiler would otherwise emit generic loads.
template <int kCount>
__device__ __forceinline__ void load_shared_rows(const int32_t* src, int32_t (&dst)[kCount]) {
  static_assert(kCount % 4 == 0, "vector loads of four");
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(src));
#pragma unroll
  for (int i = 0; i < kCount; i += 4) {
    asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(dst[i]), "=r"(dst[i + 1]), "=r"(dst[i + 2]), "=r"(dst[i + 3])
                 : "r"(address + 4 * i)
                 : "memory");
  }
}

// 16-byte store to global memory. NOTE: a uint4 store through a cast pointer compiled
// to four 4-byte stores (nvcc 13.0).
__device__ __forceinline__ void store_global_16(void* ptr, const uint32_t (&v)[4]) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3])
               : "memory");
}

// The epilogue of one consumer warpgroup's accumulator: routed weight, activation
// (gated), rounding, rows scattered by slot. Templated on the activation so that the
// unrolled loops carry no per-value branches.
//
// Fragment value v = c + 2 * h + 4 * g holds row +8h and element c of the column pair
// of column group g (8 columns); gated, the second half of the fragment holds the up
// columns kSlice / 2 to the right of the gate columns in the first half.
template <class Config>
struct Sm90TileOutput {
  using T = typename Config::Element;
  const detail::GemmParams& p;
  const int32_t* tile_slot;  // [kBlockM], -1 = padding
  const float* tile_weight;  // [kBlockM]
  int64_t n0;                // first output column of the tile
  int64_t entry0;            // first entry of the tile (GemmParams::out_rows_sorted)
  bool vector_store;         // 16-byte stores: row-contiguous out, N % 8 == 0, aligned rows
  bool paired;               // 4-byte pair stores: row-contiguous out, even strides, aligned

  template <bool kGated, detail::ActivationKind kAct, bool kZero, class Acc>
  __device__ __forceinline__ float output(const Acc& acc, int v, float w) const {
    constexpr int kValues = decltype(cute::size(acc))::value;
    if constexpr (kZero) {
      return 0.f;
    } else if constexpr (kGated) {
      // The routed weight scales the GEMM output (apply_router_weight_on_input): before the activation.
      return gated_activation<kAct>(acc(v) * w, acc(v + kValues / 2) * w, p.alpha, p.limit);
    } else {
      return acc(v) * w;
    }
  }

  // Output row of tile row `row` (slot >= 0): its slot, or its entry when sorted.
  __device__ __forceinline__ int64_t out_row(int32_t slot, int row) const {
    return p.out_rows_sorted ? entry0 + row : int64_t(slot);
  }

  template <bool kGated>
  __device__ __forceinline__ int64_t out_col(int tile_col) const {
    return n0 + (kGated ? GatedTileColumn<Config::kSlice>(tile_col).out_col : tile_col);
  }

  // kZero: the rows of a tile whose expert is not on this rank; the accumulators are not
  // read (nothing outside the wgmmas may write them: see the consumer loop).
  template <bool kGated, detail::ActivationKind kAct, bool kZero, class Acc, class Coord>
  __device__ __forceinline__ void store(const Acc& acc, const Coord& coord) const {
    using cute::get;
    constexpr int kValues = decltype(cute::size(acc))::value;
    constexpr int kGroups = (kGated ? kValues / 2 : kValues) / 4;  // column groups holding outputs
    T* out = static_cast<T*>(p.out);
    if (vector_store) {
      static_assert(kGroups % 4 == 0, "quads transpose blocks of 4 column groups");
      const int quad_lane = threadIdx.x % 4;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = get<0>(coord(2 * h));
        const int32_t slot = tile_slot[row];
        const float w = tile_weight[row];
#pragma unroll
        for (int g0 = 0; g0 < kGroups; g0 += 4) {
          uint32_t words[4], chunk[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int v = 2 * h + 4 * (g0 + j);
            words[j] = pack_pair<T>(output<kGated, kAct, kZero>(acc, v, w), output<kGated, kAct, kZero>(acc, v + 1, w));
          }
          quad_transpose(words, chunk);
          // This lane's chunk: all 8 columns of column group g0 + quad_lane.
          const int64_t n = out_col<kGated>(get<1>(coord(2 * h + 4 * (g0 + quad_lane))) - 2 * quad_lane);
          if (slot >= 0 && n < p.N) store_global_16(out + out_row(slot, row) * p.out_stride_row + n, chunk);
        }
      }
      return;
    }
    // Outputs n and n + 1 of the row of fragment value v, as one 4-byte word when paired.
#pragma unroll
    for (int v = 0; v < (kGated ? kValues / 2 : kValues); v += 2) {
      const int row = get<0>(coord(v));
      const int32_t slot = tile_slot[row];
      const int64_t n = out_col<kGated>(get<1>(coord(v)));
      if (slot < 0 || n >= p.N) continue;
      const float w = tile_weight[row];
      T* dst = out + out_row(slot, row) * p.out_stride_row + n * p.out_stride_n;
      const float v0 = output<kGated, kAct, kZero>(acc, v, w), v1 = output<kGated, kAct, kZero>(acc, v + 1, w);
      if (paired && n + 1 < p.N) {
        *reinterpret_cast<uint32_t*>(dst) = pack_pair<T>(v0, v1);
      } else {
        dst[0] = T(v0);
        if (n + 1 < p.N) dst[p.out_stride_n] = T(v1);
      }
    }
  }
};

// TMA coordinates (dims 1 and 2 of the weight maps) of weight box b of the tile at
// output column n0: box b holds tile rows [b * kBoxRows, +kBoxRows); gated, the gate (b
// even) or up (b odd) rows of output columns n0 + (b / 2) * kBoxRows + [0, kBoxRows).
template <class Config>
__device__ __forceinline__ void weight_box_coords(const detail::GemmParams& p, int64_t n0, int b, bool interleaved,
                                                  int32_t& c1, int32_t& c2) {
  const int32_t row = int32_t(p.gated ? n0 + (b / 2) * Config::kBoxRows : n0 + b * Config::kBoxRows);
  const int32_t half = p.gated ? b % 2 : 0;
  c1 = interleaved ? half : row;
  c2 = interleaved ? row : half;
}

template <class Config>
__global__ void __launch_bounds__(Config::kThreads, 1)
    fused_moe_sm90_kernel(const __grid_constant__ detail::GemmParams p, const __grid_constant__ WeightTensorMap w_map,
                          const __grid_constant__ ActivationTensorMap a_map) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using T = typename Config::Element;
  using Barrier = cutlass::arch::ClusterBarrier;
  constexpr int kBlockM = Config::kBlockM, kBlockN = Config::kBlockN, kBlockK = Config::kBlockK;
  constexpr int kStages = Config::kStages, kClusterM = Config::kClusterM;

  extern __shared__ uint8_t smem_raw[];
  T* smem_a = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  T* smem_b = smem_a + Config::kSmemElementsA;
  // Weight-only: the ring's packed weight rows [kStages][kBlockN][kPackedRowBytes] (none otherwise).
  uint8_t* smem_packed = reinterpret_cast<uint8_t*>(smem_b + Config::kSmemElementsB);
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem_packed + kStages * Config::kPackedStageBytes);
  uint64_t* empty_bar = full_bar + kStages;
  uint64_t* tile_queue = empty_bar + kStages;  // the ordered tile queue (Sm90TileQueue)
  int32_t* table_slot = reinterpret_cast<int32_t*>(tile_queue) + Config::kTileQueueBytes / 4;  // [2][kBlockM], -1 = padding
  float* table_weight = reinterpret_cast<float*>(table_slot + 2 * kBlockM);  // [2][kBlockM]
  // Row of a behind chunk i of producer thread t, [kProducerThreads][kChunksA] (16-byte
  // aligned), -1 for padding. NOTE: in shared memory, not registers: 8 rows (or
  // pointers) a thread held across the tile spilled the 56-register producer of the
  // 128-row tiles (ptxas).
  int32_t* producer_rows = reinterpret_cast<int32_t*>(table_weight + 2 * kBlockM);

  // NOTE: in a cluster of two, the shared memory layout (and so every barrier address)
  // is the same in both CTAs: remote arrivals and multicasts address the peer's copy.
  const int cta_rank = kClusterM > 1 ? int(cute::block_rank_in_cluster()) : 0;
  const int64_t cluster_id = blockIdx.x / kClusterM;
  const int64_t num_clusters = gridDim.x / kClusterM;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      Barrier::init(&full_bar[s], Config::kProducerThreads + 1);
      Barrier::init(&empty_bar[s], Config::kConsumerWarps * kClusterM);
    }
    for (int q = 0; q < Config::kTileQueueDepth; ++q) {
      Barrier::init(&tile_queue[q], 1);                                           // full: the taker
      // empty: every warp of the cluster (the leader's taker fills every CTA's queue)
      Barrier::init(&tile_queue[Config::kTileQueueDepth + q], Config::kThreads / 32 * kClusterM);
    }
    cutlass::arch::fence_barrier_init();
  }
  // The peer's barriers must be initialised before the first remote arrival or multicast.
  if constexpr (kClusterM > 1) {
    cute::cluster_sync();
  } else {
    __syncthreads();
  }

  // Gated: kBlockN weight rows give kBlockN / 2 output columns.
  const int out_width = p.gated ? kBlockN / 2 : kBlockN;
  const int64_t num_n_tiles = (p.N + out_width - 1) / out_width;
  const int64_t num_k_tiles = (p.K + kBlockK - 1) / kBlockK;
  wait_for_previous_kernel();
  const int64_t num_m_tiles = *p.num_tokens_post_padded / kBlockM;  // a multiple of the block size
  const int64_t num_m_groups = (num_m_tiles + kClusterM - 1) / kClusterM;
  const int64_t num_tiles = num_m_groups * num_n_tiles;  // cluster tiles
  // Ordered tiles need the counter (zeroed by the alignment kernel before this grid).
  const bool ordered = p.tile_counter != nullptr;
  Sm90TileQueue<Config::kTileQueueDepth, kClusterM> queue{tile_queue};
  int64_t static_next = cluster_id;
  // Every warp of the CTA calls this once per tile, in the same order.
  auto next_tile = [&]() -> int64_t {
    if (ordered) return queue.pop();
    const int64_t t = static_next;
    static_next += num_clusters;
    return t;
  };

  // NOTE: the warpgroup index through a shuffle, so the compiler knows the role branch is
  // warp-uniform (else every shuffle of the epilogue gets a divergence fallback).
  const int warpgroup = __shfl_sync(0xffffffffu, int(threadIdx.x) / 128, 0);
  if (warpgroup == 0) {
    // ================= producer =================
    cutlass::arch::warpgroup_reg_dealloc<Config::kProducerRegisters>();
    const T* a_base = static_cast<const T*>(p.a);
    const int k_col = (threadIdx.x % Config::kChunksPerRow) * (16 / int(sizeof(T)));
    const int row0 = threadIdx.x / Config::kChunksPerRow;
    const bool interleaved = p.activation == detail::ActivationKind::kSwigluOai;
    Tensor sA = make_tensor(make_smem_ptr(smem_a), typename Config::SmemLayoutA{});  // (BLK_M, BLK_K, STAGES)
    Tensor sB = make_tensor(make_smem_ptr(smem_b), typename Config::SmemLayoutB{});  // (BLK_N, BLK_K, STAGES)
    using CpAsync = SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint128_t>;
    int stage = 0;
    uint32_t phase = 1;  // a fresh barrier counts as having completed the phase before
    auto advance = [&] {
      if (++stage == kStages) { stage = 0; phase ^= 1; }
    };
    Sm90TileTaker<Config::kTileQueueDepth, kClusterM> taker{{tile_queue, 0, 1}};
    const bool takes = ordered && threadIdx.x == 0 && cta_rank == 0;
    if (takes) taker.start(p.tile_counter, int32_t(num_tiles));
    for (int64_t t = next_tile(); t < num_tiles; t = next_tile()) {
      if (takes) taker.advance(p.tile_counter, int32_t(num_tiles));
      int64_t m_group, n_tile;
      sm90_tile_coord<Config::kGroupM / kClusterM>(t, num_m_groups, num_n_tiles, m_group, n_tile);
      const auto tile = sm90_cluster_tile<kBlockM, kClusterM>(p, m_group, num_m_tiles, cta_rank);
      if (!tile.active) continue;  // the consumers write zeros
      const int64_t entry0 = tile.m_tile * kBlockM;
      // Each thread writes and later reads only its own entries: no barrier.
#pragma unroll
      for (int i = 0; i < Config::kChunksA && !p.a_rows_sorted; ++i) {
        const int64_t entry = entry0 + row0 + i * Config::kRowsPerPass;
        const int32_t slot = tile.own_loads && entry < p.sorted_token_ids_size ? p.sorted_token_ids[entry] : -1;
        producer_rows[threadIdx.x * Config::kChunksA + i] = slot >= 0 && slot < p.num_slots ? int32_t(slot / p.top_k) : -1;
      }
      const int64_t n0 = n_tile * out_width;
      for (int64_t k_tile = 0; k_tile < num_k_tiles; ++k_tile) {
        // This thread's rows, read before the wait so the load hides behind it. NOTE: one
        // generic load per chunk, each feeding its cp.async, made Mixtral's 128 x 256
        // tiles 6% slower than rows held in registers (H100, M = 1024..4096).
        int32_t rows[Config::kChunksA];
        load_shared_rows<Config::kChunksA>(producer_rows + threadIdx.x * Config::kChunksA, rows);
        Barrier::wait(&empty_bar[stage], phase);
        const int64_t k0 = k_tile * kBlockK;
        if (threadIdx.x == 0) {
          if (tile.own_loads) {
            // The whole weight tile lands here: this CTA's boxes and, shared, the peer's
            // (weight-only: the packed rows).
            constexpr int kWeightBytes = Config::kWeightOnly ? Config::kPackedStageBytes : Config::kStageBytesB;
            cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(
                &full_bar[stage], kWeightBytes + (p.a_rows_sorted ? Config::kStageBytesA : 0));
            if (p.a_rows_sorted) {
              // The tile's rows are consecutive entries: one box of kBlockM rows.
              SM90_TMA_LOAD_2D::copy(&a_map.map, &full_bar[stage], 0, smem_a + stage * (kBlockM * kBlockK), int32_t(k0),
                                     int32_t(entry0));
            }
#pragma unroll
            for (int b = 0; b < Config::kBoxes; ++b) {
              if (tile.shared && b % kClusterM != cta_rank) continue;
              int32_t c1, c2;
              weight_box_coords<Config>(p, n0, b, interleaved, c1, c2);
              if constexpr (Config::kWeightOnly) {
                uint8_t* packed = smem_packed + stage * Config::kPackedStageBytes + b * Config::kBoxRows * Config::kPackedRowBytes;
                SM90_TMA_LOAD_4D::copy(&w_map.map, &full_bar[stage], 0, packed, int32_t(k0 * Config::kWeightBits / 8), c1,
                                       c2, tile.expert);
                continue;
              }
              T* dst = smem_b + stage * (kBlockN * kBlockK) + b * (Config::kBoxRows * kBlockK);
              if (tile.shared) {
                SM90_TMA_LOAD_MULTICAST_4D::copy(&w_map.map, &full_bar[stage], uint16_t((1 << kClusterM) - 1), 0, dst,
                                                 int32_t(k0), c1, c2, tile.expert);
              } else {
                SM90_TMA_LOAD_4D::copy(&w_map.map, &full_bar[stage], 0, dst, int32_t(k0), c1, c2, tile.expert);
              }
            }
          } else {
            Barrier::arrive(&full_bar[stage]);  // an empty stage: the peer loads alone
          }
        }
        if (p.a_rows_sorted) {
          // Thread 0 loaded the A box with the weights; the other arrivals come from here.
          Barrier::arrive(&full_bar[stage]);
        } else {
          const int64_t k = k0 + k_col;  // K % 8 == 0: a chunk is all in or all out
          if (tile.own_loads) {
#pragma unroll
            for (int i = 0; i < Config::kChunksA; ++i) {
              const bool ok = rows[i] >= 0 && k < p.K;
              CpAsync::copy(*reinterpret_cast<const uint128_t*>(ok ? a_base + rows[i] * p.a_stride_row + k : a_base),
                            *reinterpret_cast<uint128_t*>(&sA(row0 + i * Config::kRowsPerPass, k_col, stage)), ok);
            }
          }
          cutlass::arch::cpasync_barrier_arrive_noinc(&full_bar[stage]);
        }
        advance();
      }
      if constexpr (Config::kFusedLora) {
        // Fused LoRA expand (GemmParams::lora_t): K steps over the block's adapters, each
        // owning lora_t_cols columns. A = the tile's rows of t (by entry) whose entry has
        // the column's adapter; B = that adapter's lora_b, block-diagonal over the slices
        // (slice s at [s * rank, +rank)). Every chunk by cp.async, zero filled elsewhere.
        const uint64_t mask = sm90_tile_lora_mask<kBlockM, kClusterM>(p, tile);
        const int lora_steps = lora_k_steps<kBlockK>(p, mask);
        // The adapter of each of this thread's A rows (+1, a byte each), read once for the
        // tile's steps. NOTE: read per chunk and step, and with each B row's slice, row and
        // stride worked out per chunk, a step cost ~2300 producer instructions a warp
        // against ~20 for a TMA step (ncu, Qwen3-30B M = 1024 GEMM2: +44% instructions,
        // +34% time for one step in 13).
        static_assert(Config::kChunksA <= 8 && Config::kBoxRows % Config::kRowsPerPass == 0);
        uint64_t row_loras = 0;
        if (lora_steps > 0) {
#pragma unroll
          for (int i = 0; i < Config::kChunksA; ++i) {
            const int lora = p.entry_lora_ids[entry0 + row0 + i * Config::kRowsPerPass];
            row_loras |= uint64_t(uint8_t(lora + 1)) << (8 * i);
          }
        }
        for (int kt = 0; kt < lora_steps; ++kt) {
          Barrier::wait(&empty_bar[stage], phase);
          if (threadIdx.x == 0) Barrier::arrive(&full_bar[stage]);  // the TMA thread's arrival, without bytes
          const LoraKColumn col(p, mask, kt * kBlockK + k_col);  // this thread's K column
          const T* t_rows = static_cast<const T*>(p.lora_t) + entry0 * p.lora_t_cols + col.t_col;
#pragma unroll
          for (int i = 0; i < Config::kChunksA; ++i) {
            const int row = row0 + i * Config::kRowsPerPass;
            const bool ok = col.lora >= 0 && int((row_loras >> (8 * i)) & 0xff) - 1 == col.lora;
            CpAsync::copy(*reinterpret_cast<const uint128_t*>(ok ? t_rows + row * p.lora_t_cols : a_base),
                          *reinterpret_cast<uint128_t*>(&sA(row, k_col, stage)), ok);
          }
          // Weight-only: the consumers read the step's B from lora_b themselves
          // (Sm90WeightOnlyConverter::lora_b): the ring has no 16-bit B slots.
          if constexpr (!Config::kWeightOnly) {
            // Rows of the column's slice read lora_b; the others (the other half of a gated
            // tile) are zeros, so the column's slice gives the stride.
            const T* b_col = col.lora_b<T>(p, tile.expert);
            const int64_t b_stride = p.lora[col.slice].b_stride_n;
#pragma unroll 1
            for (int i = 0; i < kBlockN / Config::kRowsPerPass; ++i) {
              const int row = row0 + i * Config::kRowsPerPass;
              // The output column of tile row `row` (the base weight boxes' placement); with
              // row0 < kRowsPerPass <= kBoxRows the box is i's.
              int64_t out_col = n0 + row;
              bool up = false;
              if (p.gated) {
                const int box = i * Config::kRowsPerPass / Config::kBoxRows;
                out_col = n0 + (box / 2) * Config::kBoxRows + (i * Config::kRowsPerPass) % Config::kBoxRows + row0;
                up = box % 2 == 1;
              }
              const LoraBRow b(p, out_col, up);
              const bool ok = col.lora >= 0 && b.slice == col.slice && out_col < p.N;
              CpAsync::copy(*reinterpret_cast<const uint128_t*>(ok ? b_col + b.row * b_stride : a_base),
                            *reinterpret_cast<uint128_t*>(&sB(row, k_col, stage)), ok);
            }
          }
          cutlass::arch::cpasync_barrier_arrive_noinc(&full_bar[stage]);
          advance();
        }
      }
    }
    if constexpr (kClusterM > 1) {
      if (takes) taker.drain();
      // The peer's consumers release their slots in this CTA too: wait for every slot's
      // last release before the CTA (and its shared memory) may go away.
      for (int s = 0; s < kStages; ++s) {
        Barrier::wait(&empty_bar[stage], phase);
        advance();
      }
    }
    cp_async_wait<0>();
    allow_next_kernel_launch();
    return;
  }

  // ================= consumers =================
  cutlass::arch::warpgroup_reg_alloc<Config::kConsumerRegisters>();
  const int thread = threadIdx.x - Config::kProducerThreads;  // 0..255
  Tensor sA = make_tensor(make_smem_ptr(smem_a), typename Config::SmemLayoutA{});  // (BLK_M, BLK_K, STAGES)
  Tensor sB = make_tensor(make_smem_ptr(smem_b), typename Config::SmemLayoutB{});  // (BLK_N, BLK_K, STAGES)
  typename Config::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_slice(thread);
  Tensor tCsA = thr_mma.partition_A(sA);  // (MMA, MMA_M, MMA_K, STAGES)
  Tensor tCsB = thr_mma.partition_B(sB);  // (MMA, MMA_N, MMA_K, STAGES)
  Tensor tCrA = thr_mma.make_fragment_A(tCsA);
  Tensor tCrB = thr_mma.make_fragment_B(tCsB);
  Tensor acc = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});  // (MMA, MMA_M, MMA_N)
  Tensor coord = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  static_assert(decltype(size<1>(acc))::value == 1 && decltype(size<2>(acc))::value == 1,
                "one wgmma atom per consumer warpgroup: value v = (column pair, row half, column group)");
  T* out = static_cast<T*>(p.out);
  const bool paired = p.out_stride_n == 1 && p.out_stride_row % 2 == 0 && (reinterpret_cast<uintptr_t>(out) % 4) == 0;
  // 16-byte stores: 8 columns of a row all in or all out, rows 16-byte aligned.
  const bool vector_store = p.out_stride_n == 1 && p.out_stride_row % 8 == 0 && p.N % 8 == 0 &&
                            (reinterpret_cast<uintptr_t>(out) % 16) == 0;

  int stage = 0;
  uint32_t phase = 0;
  int table = 0;
  // Weight-only: this thread's share of each step's conversion, and the B buffer it fills next.
  Sm90WeightOnlyConverter<Config> converter{p.weight_only, p.K};
  const uint32_t b_buffers = static_cast<uint32_t>(__cvta_generic_to_shared(smem_b));
  int b_buffer = 0;
  for (int64_t t = next_tile(); t < num_tiles; t = next_tile()) {
    int64_t m_group, n_tile;
    sm90_tile_coord<Config::kGroupM / kClusterM>(t, num_m_groups, num_n_tiles, m_group, n_tile);
    const auto tile = sm90_cluster_tile<kBlockM, kClusterM>(p, m_group, num_m_tiles, cta_rank);
    const int64_t entry0 = tile.m_tile * kBlockM;
    const int64_t n0 = n_tile * out_width;
    // Slot and routed weight of each row; two tables, alternating over the tiles this CTA
    // writes, so this tile's fill cannot race the previous tile's epilogue reads (the
    // barrier below orders the one before).
    int32_t* tile_slot = table_slot + table * kBlockM;
    float* tile_weight = table_weight + table * kBlockM;
    if (tile.own_real) {
      table ^= 1;
      load_tile_slots<kBlockM>(p, entry0, tile_slot, tile_weight, thread, Config::kConsumerThreads);
      cutlass::arch::NamedBarrier::sync(Config::kConsumerThreads, Config::kConsumerBarrier);
    }

    // Expert not on this rank (or only dropped slots): no wgmma, the epilogue writes zeros.
    if (tile.active) {
      // K steps of this tile: the base ones, then the fused LoRA expand's.
      const int64_t k_steps =
          num_k_tiles + (Config::kFusedLora ? lora_k_steps<kBlockK>(p, sm90_tile_lora_mask<kBlockM, kClusterM>(p, tile)) : 0);
      int release_stage = stage;
      int64_t released = 0;
      auto release = [&] {
        if (thread % 32 == 0) {
          Barrier::arrive(&empty_bar[release_stage]);
          if constexpr (kClusterM > 1) Barrier::arrive(&empty_bar[release_stage], uint32_t(cta_rank ^ 1), 1u);
        }
        release_stage = release_stage + 1 == kStages ? 0 : release_stage + 1;
        ++released;
      };
      auto next_stage = [&] {
        if (++stage == kStages) { stage = 0; phase ^= 1; }
      };
      if (tile.own_loads) {
        // The first wgmma overwrites the accumulators (no clear: ptxas serialises wgmmas
        // when ordinary instructions write their accumulators inside a pipeline stage).
        tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
        if constexpr (Config::kWeightOnly) {
          converter.start_tile(p, tile.expert, n0, thread);
          converter.load_codes(0);
          converter.take_codes();
        }
        for (int64_t k_tile = 0; k_tile < k_steps; ++k_tile) {
          Barrier::wait(&full_bar[stage], phase);
          int b_slot = stage;
          if constexpr (Config::kWeightOnly) {
            // This step's B buffer from the slot's packed rows, fenced for the wgmmas' proxy.
            static_assert(Config::kMmaInFlight <= 1, "three B buffers: one batch in flight a warpgroup");
            if (k_tile + 1 < num_k_tiles) converter.load_codes((k_tile + 1) * kBlockK);
            const uint32_t buffer = b_buffers + b_buffer * (kBlockN * kBlockK * int(sizeof(T)));
            if (!Config::kFusedLora || k_tile < num_k_tiles) {
              converter.convert(smem_packed + stage * Config::kPackedStageBytes, buffer);
            } else {
              // The tile's adapters again (one load, two shuffles): not held through the K loop.
              converter.lora_b(p, tile.expert, n0, sm90_tile_lora_mask<kBlockM, kClusterM>(p, tile),
                               int(k_tile - num_k_tiles), buffer);
            }
            cutlass::arch::fence_view_async_shared();
            converter.sync(thread);
            converter.take_codes();
            b_slot = b_buffer;
            b_buffer = b_buffer == 2 ? 0 : b_buffer + 1;
          }
          // cp.async wrote the A slot (and the LoRA steps' B slot) through the generic
          // proxy; wgmma reads them through the async one.
          if (!p.a_rows_sorted || k_tile >= num_k_tiles) cutlass::arch::fence_view_async_shared();
          warpgroup_fence_operand(acc);
          warpgroup_arrive();
#pragma unroll
          for (int kb = 0; kb < size<2>(tCrA); ++kb) {
            gemm(tiled_mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, b_slot), acc);
            tiled_mma.accumulate_ = GMMA::ScaleOut::One;
          }
          warpgroup_commit_batch();
          // kMmaInFlight batches stay in flight; the slots of the retired ones go back.
          warpgroup_wait<Config::kMmaInFlight>();
          warpgroup_fence_operand(acc);
          if (k_tile >= Config::kMmaInFlight) release();
          next_stage();
        }
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc);
      } else {
        // The peer loads alone: turn the ring with it (empty stages, released at once).
        for (int64_t k_tile = 0; k_tile < num_k_tiles; ++k_tile) {
          Barrier::wait(&full_bar[stage], phase);
          release();
          next_stage();
        }
      }
      while (released < k_steps) release();
    }
    // Static: this CTA's last tile (ordered: only the counter knows; the CTA's exit lets
    // the next kernel launch).
    if (!ordered && t + num_clusters >= num_tiles) allow_next_kernel_launch();
    if (!tile.own_real) continue;

    // ---- epilogue: routed weight, (activation,) round, scatter rows by slot ----
    const Sm90TileOutput<Config> tile_out{p, tile_slot, tile_weight, n0, entry0, vector_store, paired};
    using detail::ActivationKind;
    if (!tile.own_loads) {
      // Expert not on this rank (or only dropped slots): the rows are zeros.
      if (!p.gated) {
        tile_out.template store<false, ActivationKind::kSiluAndMul, true>(acc, coord);
      } else {
        tile_out.template store<true, ActivationKind::kSiluAndMul, true>(acc, coord);
      }
    } else if (!p.gated) {
      tile_out.template store<false, ActivationKind::kSiluAndMul, false>(acc, coord);
    } else if (p.activation == ActivationKind::kSiluAndMul) {
      tile_out.template store<true, ActivationKind::kSiluAndMul, false>(acc, coord);
    } else if (p.activation == ActivationKind::kGeluAndMul) {
      tile_out.template store<true, ActivationKind::kGeluAndMul, false>(acc, coord);
    } else {
      tile_out.template store<true, ActivationKind::kSwigluOai, false>(acc, coord);
    }
  }
#endif
}

}  // namespace moelora::cuda
