// fused_moe on Hopper tensor cores (sm_90a): warp-specialised, persistent, wgmma.
//
// A CTA of three warpgroups loops over output tiles [kBlockM entries of
// sorted_token_ids (one expert: kBlockM divides the block size), kBlockN weight rows]:
//   - warpgroup 0, the producer (56 registers a thread): weight tiles by TMA (one
//     thread), activation rows by cp.async from all 128 threads, since the rows are
//     gathered (row = slot / top_k) and TMA on Hopper cannot gather;
//   - warpgroups 1 and 2, the consumers (224 registers; a 64 x 256 accumulator takes
//     128): wgmma from the shared-memory ring into fp32 accumulators, then the
//     epilogue. kBlockM = 128: each consumer owns 64 rows and the whole width;
//     kBlockM = 64: each owns half the width.
// The ring has kStages slots with two mbarriers each: `full` (129 arrivals: one per
// producer thread through cp.async.mbarrier.arrive.noinc, one from the TMA thread with
// the weight bytes as its transaction count) and `empty` (one arrival per consumer warp
// once the wgmmas that read the slot have retired). The producer runs ahead into the
// next tile while the consumers store this one, so the next tile's loads overlap the
// epilogue (the tensor cores still idle during it: the two consumers share one tile).
//
// Persistence: the grid is at most one CTA per SM, and CTA b takes tiles b, b + grid, ...
// in a grouped raster (kGroupM m-tiles down each N column before moving right), so the
// CTAs working at one time share one expert's weight slab in L2. The tile count comes
// from the device-side num_tokens_post_padded; no host sync.
//
// Gated GEMM (GemmParams::gated): the TMA boxes place gate and up rows so that every
// consumer thread holds both inputs of its outputs (GatedTileColumn, with slices of
// kBlockN / kWarpgroupsN columns); the epilogue applies the activation in registers.
//
// LoRA (issue 4) adds a low-rank wgmma on the A tile already in the ring inside the K
// loop, and one more before the epilogue; the slot tables are reused as they are.
#pragma once

#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include <algorithm>
#include <string>

#include "common/params.h"
#include "cuda/cuda_check.h"
#include "cuda/device_info.h"
#include "cuda/fused_moe_tile.cuh"
#include "cuda/gated_activation.cuh"
#include "cuda/launch.cuh"
#include "cuda/tensor_map.h"

namespace moelora::cuda {

template <class Element_, int kBlockM_, int kBlockN_>
struct FusedMoeSm90Config {
  using Element = Element_;  // cute::bfloat16_t or cute::half_t
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kBlockK = 64;  // 128 bytes: one 128B-swizzle row
  static constexpr int kProducerThreads = 128;
  static constexpr int kConsumerThreads = 256;
  static constexpr int kThreads = kProducerThreads + kConsumerThreads;
  static constexpr int kConsumerWarps = kConsumerThreads / 32;
  // wgmma batches a consumer leaves in flight when it waits: 1 overlaps consecutive K
  // steps but holds two ring slots. NOTE: 0 (one slot held, the pipe drained each step)
  // measured the same on H100 at M = 4096 (Qwen3-30B, Mixtral, DeepSeek): the ring
  // depth is not what limits the large-M tiles.
  static constexpr int kMmaInFlight = 1;
  static constexpr int kGroupM = 8;  // raster group (m-tiles per N sweep)
  static_assert(kBlockM == 64 || kBlockM == 128, "kBlockM must be 64 or 128");
  static_assert(kBlockN == 128 || kBlockN == 256, "kBlockN must be 128 or 256");

  static constexpr int kWarpgroupsM = kBlockM / 64;
  static constexpr int kWarpgroupsN = 2 / kWarpgroupsM;
  // Columns one consumer warpgroup holds: the slice of the gated layout.
  static constexpr int kSlice = kBlockN / kWarpgroupsN;
  // TMA boxes of weight rows: half a slice each (a gate or an up half), 2 * kWarpgroupsN a stage.
  static constexpr int kBoxRows = kSlice / 2;
  static constexpr int kBoxes = kBlockN / kBoxRows;
  using MmaAtom = decltype(cute::GMMA::ss_op_selector<Element, Element, float,
                                                      cute::Shape<cute::_64, cute::Int<kSlice>, cute::Int<kBlockK>>>());
  using TiledMma = decltype(cute::make_tiled_mma(
      MmaAtom{}, cute::Layout<cute::Shape<cute::Int<kWarpgroupsM>, cute::Int<kWarpgroupsN>, cute::_1>>{}));

  static constexpr int kStageBytesA = kBlockM * kBlockK * int(sizeof(Element));
  static constexpr int kStageBytesB = kBlockN * kBlockK * int(sizeof(Element));
  static constexpr int kStageBytes = kStageBytesA + kStageBytesB;
  // Shared memory past the ring: 1024 bytes of alignment slack, two barriers a slot,
  // and two tiles' slot/weight tables.
  static constexpr int kTableBytes = 2 * kBlockM * int(sizeof(int32_t) + sizeof(float));
  static constexpr int kRingBudget = 232448 - 1024 - 16 * 8 - kTableBytes;  // 227 KB opt-in limit
  // NOTE: more than 8 slots adds nothing (8 already cover ~2 us of loads at 64 x 128).
  static constexpr int kStages = kRingBudget / kStageBytes < 8 ? kRingBudget / kStageBytes : 8;
  static_assert(kStages >= 3, "the pipeline needs three slots");

  using SmemAtom = cute::GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutA = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockK>, cute::Int<kStages>>{}));
  using SmemLayoutB = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockK>, cute::Int<kStages>>{}));
  static constexpr int kSmemElementsA = cute::cosize(SmemLayoutA{});
  static constexpr int kSmemElementsB = cute::cosize(SmemLayoutB{});
  static constexpr size_t kSmemBytes =
      1024 + size_t(kStages) * kStageBytes + 2 * kStages * sizeof(uint64_t) + kTableBytes;

  // Activation-row copies: each producer thread owns one 16-byte K column of fixed rows.
  static constexpr int kChunksPerRow = kBlockK * int(sizeof(Element)) / 16;  // 8
  static constexpr int kRowsPerPass = kProducerThreads / kChunksPerRow;      // 16
  static constexpr int kChunksA = kBlockM / kRowsPerPass;
};

// m-tile and n-tile of persistent tile t in the grouped raster.
template <int kGroupM>
__device__ __forceinline__ void sm90_tile_coord(int64_t t, int64_t num_m_tiles, int64_t num_n_tiles, int64_t& m_tile,
                                                int64_t& n_tile) {
  const int64_t tiles_per_group = int64_t(kGroupM) * num_n_tiles;
  const int64_t group = t / tiles_per_group;
  const int64_t first_m = group * kGroupM;
  const int64_t group_rows = min(int64_t(kGroupM), num_m_tiles - first_m);
  const int64_t local = t - group * tiles_per_group;
  m_tile = first_m + local % group_rows;
  n_tile = local / group_rows;
}

template <class Config>
__global__ void __launch_bounds__(Config::kThreads, 1)
    fused_moe_sm90_kernel(const __grid_constant__ detail::GemmParams p, const __grid_constant__ WeightTensorMap w_map) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using T = typename Config::Element;
  using Barrier = cutlass::arch::ClusterBarrier;
  constexpr int kBlockM = Config::kBlockM, kBlockN = Config::kBlockN, kBlockK = Config::kBlockK;
  constexpr int kStages = Config::kStages, kSlice = Config::kSlice;

  extern __shared__ uint8_t smem_raw[];
  T* smem_a = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  T* smem_b = smem_a + Config::kSmemElementsA;
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem_b + Config::kSmemElementsB);
  uint64_t* empty_bar = full_bar + kStages;
  int32_t* table_slot = reinterpret_cast<int32_t*>(empty_bar + kStages);  // [2][kBlockM], -1 = padding
  float* table_weight = reinterpret_cast<float*>(table_slot + 2 * kBlockM);  // [2][kBlockM]

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      Barrier::init(&full_bar[s], Config::kProducerThreads + 1);
      Barrier::init(&empty_bar[s], Config::kConsumerWarps);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  // Gated: kBlockN weight rows give kBlockN / 2 output columns.
  const int out_width = p.gated ? kBlockN / 2 : kBlockN;
  const int64_t num_n_tiles = (p.N + out_width - 1) / out_width;
  const int64_t num_k_tiles = (p.K + kBlockK - 1) / kBlockK;
  wait_for_previous_kernel();
  const int64_t num_m_tiles = *p.num_tokens_post_padded / kBlockM;  // a multiple of the block size
  const int64_t num_tiles = num_m_tiles * num_n_tiles;

  if (threadIdx.x < Config::kProducerThreads) {
    // ================= producer =================
    // NOTE: 48 spilled the row pointers of the 128-row tiles (ptxas); 56 + 2 x 224 fits 64K.
    cutlass::arch::warpgroup_reg_dealloc<56>();
    const T* a_base = static_cast<const T*>(p.a);
    const int k_col = (threadIdx.x % Config::kChunksPerRow) * (16 / int(sizeof(T)));
    const int row0 = threadIdx.x / Config::kChunksPerRow;
    const bool interleaved = p.activation == detail::ActivationKind::kSwigluOai;
    Tensor sA = make_tensor(make_smem_ptr(smem_a), typename Config::SmemLayoutA{});  // (BLK_M, BLK_K, STAGES)
    using CpAsync = SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint128_t>;
    int stage = 0;
    uint32_t phase = 1;  // a fresh barrier counts as having completed the phase before
    for (int64_t t = blockIdx.x; t < num_tiles; t += gridDim.x) {
      int64_t m_tile, n_tile;
      sm90_tile_coord<Config::kGroupM>(t, num_m_tiles, num_n_tiles, m_tile, n_tile);
      const int64_t entry0 = m_tile * kBlockM;
      const int expert = p.expert_ids[entry0 / p.block_size];
      if (expert < 0 || expert >= p.num_experts) continue;  // the consumers write zeros
      const T* a_row[Config::kChunksA];  // null for padding rows
#pragma unroll
      for (int i = 0; i < Config::kChunksA; ++i) {
        const int64_t entry = entry0 + row0 + i * Config::kRowsPerPass;
        const int32_t slot = entry < p.sorted_token_ids_size ? p.sorted_token_ids[entry] : -1;
        a_row[i] = slot >= 0 && slot < p.num_slots ? a_base + (slot / p.top_k) * p.a_stride_row : nullptr;
      }
      const int64_t n0 = n_tile * out_width;
      for (int64_t k_tile = 0; k_tile < num_k_tiles; ++k_tile) {
        Barrier::wait(&empty_bar[stage], phase);
        const int64_t k0 = k_tile * kBlockK;
        if (threadIdx.x == 0) {
          cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&full_bar[stage], Config::kStageBytesB);
#pragma unroll
          for (int b = 0; b < Config::kBoxes; ++b) {
            // Box b holds tile columns [b * kBoxRows, +kBoxRows): gated, the gate (b even)
            // or up (b odd) rows of output columns n0 + (b / 2) * kBoxRows + [0, kBoxRows).
            const int32_t row = int32_t(p.gated ? n0 + (b / 2) * Config::kBoxRows : n0 + b * Config::kBoxRows);
            const int32_t half = p.gated ? b % 2 : 0;
            T* dst = smem_b + stage * (kBlockN * kBlockK) + b * (Config::kBoxRows * kBlockK);
            SM90_TMA_LOAD_4D::copy(&w_map.map, &full_bar[stage], 0, dst, int32_t(k0), interleaved ? half : row,
                                   interleaved ? row : half, expert);
          }
        }
        const int64_t k = k0 + k_col;  // K % 8 == 0: a chunk is all in or all out
#pragma unroll
        for (int i = 0; i < Config::kChunksA; ++i) {
          const bool ok = a_row[i] != nullptr && k < p.K;
          CpAsync::copy(*reinterpret_cast<const uint128_t*>(ok ? a_row[i] + k : a_base),
                        *reinterpret_cast<uint128_t*>(&sA(row0 + i * Config::kRowsPerPass, k_col, stage)), ok);
        }
        cutlass::arch::cpasync_barrier_arrive_noinc(&full_bar[stage]);
        if (++stage == kStages) { stage = 0; phase ^= 1; }
      }
    }
    cp_async_wait<0>();
    allow_next_kernel_launch();
    return;
  }

  // ================= consumers =================
  cutlass::arch::warpgroup_reg_alloc<224>();
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
  T* out = static_cast<T*>(p.out);
  const bool paired = p.out_stride_n == 1 && p.out_stride_row % 2 == 0 && (reinterpret_cast<uintptr_t>(out) % 4) == 0;

  int stage = 0;
  uint32_t phase = 0;
  int table = 0;
  for (int64_t t = blockIdx.x; t < num_tiles; t += gridDim.x, table ^= 1) {
    int64_t m_tile, n_tile;
    sm90_tile_coord<Config::kGroupM>(t, num_m_tiles, num_n_tiles, m_tile, n_tile);
    const int64_t entry0 = m_tile * kBlockM;
    const int64_t n0 = n_tile * out_width;
    const int expert = p.expert_ids[entry0 / p.block_size];
    // Slot and routed weight of each row; two tables, so this tile's fill cannot race
    // the previous tile's epilogue reads (the barrier below orders the one before).
    int32_t* tile_slot = table_slot + table * kBlockM;
    float* tile_weight = table_weight + table * kBlockM;
    load_tile_slots<kBlockM>(p, entry0, tile_slot, tile_weight, thread, Config::kConsumerThreads);
    cutlass::arch::NamedBarrier::sync(Config::kConsumerThreads, 1);

    clear(acc);
    // Expert not on this rank (or a dropped slot): no K loop, the rows are written as zeros.
    if (expert >= 0 && expert < p.num_experts) {
      int release_stage = stage;
      int64_t released = 0;
      auto release = [&] {
        if (thread % 32 == 0) Barrier::arrive(&empty_bar[release_stage]);
        release_stage = release_stage + 1 == kStages ? 0 : release_stage + 1;
        ++released;
      };
      for (int64_t k_tile = 0; k_tile < num_k_tiles; ++k_tile) {
        Barrier::wait(&full_bar[stage], phase);
        // cp.async wrote the A slot through the generic proxy; wgmma reads it through the async one.
        cutlass::arch::fence_view_async_shared();
        warpgroup_fence_operand(acc);
        warpgroup_arrive();
#pragma unroll
        for (int kb = 0; kb < size<2>(tCrA); ++kb) {
          gemm(tiled_mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, stage), acc);
        }
        warpgroup_commit_batch();
        // kMmaInFlight batches stay in flight; the slots of the retired ones go back.
        warpgroup_wait<Config::kMmaInFlight>();
        warpgroup_fence_operand(acc);
        if (k_tile >= Config::kMmaInFlight) release();
        if (++stage == kStages) { stage = 0; phase ^= 1; }
      }
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc);
      while (released < num_k_tiles) release();
    }
    if (t + gridDim.x >= num_tiles) allow_next_kernel_launch();

    // ---- epilogue: routed weight, (activation,) round, scatter rows by slot ----
    // Accumulator pairs (i, i + 1) are adjacent columns of one row: stored as one 4-byte
    // word when out is row-contiguous. Gated: the fragment's second half holds the up
    // columns kSlice / 2 to the right of the gate columns in the first half.
    constexpr int kValues = decltype(size(acc))::value;
    // Stores outputs n and n + 1 of the row of fragment value i.
    auto store_pair = [&](int i, int64_t n, float v0, float v1) {
      const int32_t slot = tile_slot[get<0>(coord(i))];
      if (slot < 0 || n >= p.N) return;
      T* dst = out + slot * p.out_stride_row + n * p.out_stride_n;
      if (paired && n + 1 < p.N) {
        using Pair = cute::array<T, 2>;
        Pair v;
        v[0] = T(v0);
        v[1] = T(v1);
        *reinterpret_cast<Pair*>(dst) = v;
      } else {
        dst[0] = T(v0);
        if (n + 1 < p.N) dst[p.out_stride_n] = T(v1);
      }
    };
    if (p.gated) {
      constexpr int kHalf = kValues / 2;
#pragma unroll
      for (int i = 0; i < kHalf; i += 2) {
        // The routed weight scales the GEMM output (apply_router_weight_on_input): before the activation.
        const float w = tile_weight[get<0>(coord(i))];
        store_pair(i, n0 + GatedTileColumn<kSlice>(get<1>(coord(i))).out_col,
                   gated_activation(p, acc(i) * w, acc(i + kHalf) * w),
                   gated_activation(p, acc(i + 1) * w, acc(i + 1 + kHalf) * w));
      }
    } else {
#pragma unroll
      for (int i = 0; i < kValues; i += 2) {
        const float w = tile_weight[get<0>(coord(i))];
        store_pair(i, n0 + get<1>(coord(i)), acc(i) * w, acc(i + 1) * w);
      }
    }
  }
#endif
}

// Launches the kernel for one (element type, tile) instance: one CTA per SM at most.
template <class Element, int kBlockM, int kBlockN>
void launch_fused_moe_sm90(const detail::GemmParams& p, cudaStream_t stream) {
  using Config = FusedMoeSm90Config<Element, kBlockM, kBlockN>;
  const int64_t num_m_tiles = p.max_num_blocks * (p.block_size / kBlockM);
  const int64_t out_width = p.gated ? kBlockN / 2 : kBlockN;
  const int64_t num_tiles = num_m_tiles * ((p.N + out_width - 1) / out_width);
  if (num_tiles == 0) return;
  const WeightTensorMap w_map = make_weight_tensor_map(p, Config::kBoxRows);
  auto kernel = fused_moe_sm90_kernel<Config>;
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(Config::kSmemBytes)));
  const int64_t grid = std::min<int64_t>(num_tiles, current_device_info().num_sms);
  launch_kernel(kernel, dim3(unsigned(grid)), dim3(Config::kThreads), Config::kSmemBytes, stream, p, w_map);
}

// The instances of one (element type, tile height): one translation unit each.
template <class T, int kBlockM>
void dispatch_fused_moe_sm90(const detail::GemmParams& p, int block_n, cudaStream_t stream) {
  switch (block_n) {
    case 128: launch_fused_moe_sm90<T, kBlockM, 128>(p, stream); break;
    case 256: launch_fused_moe_sm90<T, kBlockM, 256>(p, stream); break;
    default:
      throw Error("moelora.fused_moe: no sm90 instance for tile " + std::to_string(kBlockM) + "x" + std::to_string(block_n));
  }
}

}  // namespace moelora::cuda
