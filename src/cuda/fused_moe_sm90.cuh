// fused_moe on Hopper tensor cores with wgmma (sm_90a), for tiles of 64 or 128 rows.
//
// One CTA of two warpgroups computes a [kBlockM, kBlockN] tile of out for kBlockM
// consecutive entries of sorted_token_ids (one expert: kBlockM divides the alignment
// block size). kBlockM = 128: each warpgroup owns 64 rows and the whole N width;
// kBlockM = 64: each owns half the N width. Both operands are K-major in 128-byte
// swizzled shared memory, as wgmma reads them.
//
// Loads: every thread issues cp.async for fixed rows at one fixed 16-byte K column.
// Activation rows are gathered (row = slot / top_k), so TMA cannot fetch A; the weight
// slab could come by TMA, but cp.async from 256 threads is ~12 instructions per thread
// per K step of ~1000 tensor-core cycles, far from the issue limit.
//
// Pipeline (kStages shared-memory slots, prefetch distance kStages - 2): at step k the
// CTA waits for tile k, issues the loads of tile k + kStages - 2, then the wgmmas of tile
// k, and waits until only they are in flight. The slot overwritten at step k last held
// tile k - 2, whose wgmmas every warpgroup retired before the barrier of step k; tile
// k - 1's may still run, which keeps the tensor cores fed across the barrier.
//
// The raster walks kGroupM m-tiles down each N column before moving right, so the CTAs
// in flight share the weight slab of one expert in L2 instead of re-reading it per
// m-tile (prefill re-reads weights ceil(slots_e / kBlockM) times otherwise).
//
// The epilogue is the mma.sync kernel's: routed weight, round, scatter rows by slot.
// LoRA (issue 4) adds a low-rank wgmma on the A tile already in shared memory inside the
// K loop, and one more before the epilogue; the slot/weight tables are reused as is.
#pragma once

#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include <string>

#include "common/params.h"
#include "cuda/cuda_check.h"
#include "cuda/fused_moe_tile.cuh"
#include "cuda/launch.cuh"

namespace moelora::cuda {

template <class Element_, int kBlockM_, int kBlockN_>
struct FusedMoeSm90Config {
  using Element = Element_;  // cute::bfloat16_t or cute::half_t
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kBlockK = 64;  // 128 bytes: one 128B-swizzle row
  static constexpr int kThreads = 256;  // two warpgroups
  static constexpr int kGroupM = 8;     // raster group (m-tiles per N sweep)
  static_assert(kBlockM == 64 || kBlockM == 128, "kBlockM must be 64 or 128");
  static_assert(kBlockN == 128 || kBlockN == 256, "kBlockN must be 128 or 256");

  static constexpr int kWarpgroupsM = kBlockM / 64;
  static constexpr int kWarpgroupsN = 2 / kWarpgroupsM;
  using MmaAtom = decltype(cute::GMMA::ss_op_selector<Element, Element, float,
                                                      cute::Shape<cute::_64, cute::Int<kBlockN / kWarpgroupsN>,
                                                                  cute::Int<kBlockK>>>());
  using TiledMma = decltype(cute::make_tiled_mma(
      MmaAtom{}, cute::Layout<cute::Shape<cute::Int<kWarpgroupsM>, cute::Int<kWarpgroupsN>, cute::_1>>{}));

  // NOTE: ~200 KB of ring leaves room for the slot tables under the 227 KB limit;
  // 6 slots already cover HBM latency at the tensor-core rate, more only add fill time.
  static constexpr int kStageBytes = (kBlockM + kBlockN) * kBlockK * int(sizeof(Element));
  static constexpr int kStages = (200 * 1024) / kStageBytes < 6 ? (200 * 1024) / kStageBytes : 6;
  static_assert(kStages >= 3, "the pipeline needs three slots");

  using SmemAtom = cute::GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutA = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockK>, cute::Int<kStages>>{}));
  using SmemLayoutB = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockK>, cute::Int<kStages>>{}));
  static constexpr int kSmemElementsA = cute::cosize(SmemLayoutA{});
  static constexpr int kSmemElementsB = cute::cosize(SmemLayoutB{});
  // 1024-byte aligned ring (the 128B swizzle repeats every 8 rows of 128 bytes).
  static constexpr size_t kSmemBytes =
      1024 + (kSmemElementsA + kSmemElementsB) * sizeof(Element) + kBlockM * (sizeof(int32_t) + sizeof(float));

  static constexpr int kChunksPerRow = kBlockK * int(sizeof(Element)) / 16;  // 8
  static constexpr int kRowsPerPass = kThreads / kChunksPerRow;               // 32
  static constexpr int kChunksA = kBlockM / kRowsPerPass;
  static constexpr int kChunksB = kBlockN / kRowsPerPass;
};

template <class Config>
__global__ void __launch_bounds__(Config::kThreads, 1) fused_moe_sm90_kernel(const detail::GemmParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using T = typename Config::Element;
  constexpr int kBlockM = Config::kBlockM, kBlockN = Config::kBlockN, kBlockK = Config::kBlockK;
  constexpr int kStages = Config::kStages, kPrefetch = kStages - 2;

  extern __shared__ uint8_t smem_raw[];
  T* smem_a = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  T* smem_b = smem_a + Config::kSmemElementsA;
  int32_t* tile_slot = reinterpret_cast<int32_t*>(smem_b + Config::kSmemElementsB);  // [kBlockM], -1 = padding
  float* tile_weight = reinterpret_cast<float*>(tile_slot + kBlockM);                  // [kBlockM]

  // ---- grouped raster: blockIdx -> (m_tile, n_tile) -------------------------------
  const int64_t num_n_tiles = (p.N + kBlockN - 1) / kBlockN;
  const int64_t num_m_tiles = p.max_num_blocks * (p.block_size / kBlockM);
  const int64_t tiles_per_group = int64_t(Config::kGroupM) * num_n_tiles;
  const int64_t group = blockIdx.x / tiles_per_group;
  const int64_t first_m = group * Config::kGroupM;
  const int64_t group_rows = min(int64_t(Config::kGroupM), num_m_tiles - first_m);
  const int64_t local = blockIdx.x - group * tiles_per_group;
  const int64_t m_tile = first_m + local % group_rows;
  const int64_t n0 = (local / group_rows) * kBlockN;
  const int64_t entry0 = m_tile * kBlockM;

  wait_for_previous_kernel();
  // Device-side count: tiles past the used length exit (the grid is sized from capacity).
  if (entry0 >= *p.num_tokens_post_padded) return;
  const int expert = p.expert_ids[entry0 / p.block_size];

  load_tile_slots<kBlockM>(p, entry0, tile_slot, tile_weight);
  __syncthreads();

  T* out = static_cast<T*>(p.out);
  if (expert < 0 || expert >= p.num_experts) {
    // Expert not on this rank (or a dropped slot): its rows are zeros.
    allow_next_kernel_launch();
    write_zero_rows<T, kBlockM, kBlockN>(p, n0, tile_slot);
    return;
  }

  // ---- gmem -> smem: each thread copies fixed rows at one fixed K column ----------
  const T* a_base = static_cast<const T*>(p.a);
  const T* w_expert = static_cast<const T*>(p.w) + expert * p.w_stride_expert;
  const int k_col = (threadIdx.x % Config::kChunksPerRow) * (16 / int(sizeof(T)));
  const int row0 = threadIdx.x / Config::kChunksPerRow;
  const T* a_row[Config::kChunksA];  // null for padding rows
  const T* b_row[Config::kChunksB];  // null past N
#pragma unroll
  for (int i = 0; i < Config::kChunksA; ++i) {
    const int r = row0 + i * Config::kRowsPerPass;
    a_row[i] = tile_slot[r] >= 0 ? a_base + (tile_slot[r] / p.top_k) * p.a_stride_row : nullptr;
  }
#pragma unroll
  for (int i = 0; i < Config::kChunksB; ++i) {
    const int64_t n = n0 + row0 + i * Config::kRowsPerPass;
    b_row[i] = n < p.N ? w_expert + n * p.w_stride_n : nullptr;
  }

  Tensor sA = make_tensor(make_smem_ptr(smem_a), typename Config::SmemLayoutA{});  // (BLK_M, BLK_K, STAGES)
  Tensor sB = make_tensor(make_smem_ptr(smem_b), typename Config::SmemLayoutB{});  // (BLK_N, BLK_K, STAGES)
  using CpAsync = SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint128_t>;

  const int64_t num_k_tiles = (p.K + kBlockK - 1) / kBlockK;
  auto load_stage = [&](int stage, int64_t k_tile) {
    const int64_t k = k_tile * kBlockK + k_col;  // K % 8 == 0: a chunk is all in or all out
#pragma unroll
    for (int i = 0; i < Config::kChunksA; ++i) {
      const bool ok = a_row[i] != nullptr && k < p.K;
      CpAsync::copy(*reinterpret_cast<const uint128_t*>(ok ? a_row[i] + k : a_base),
                    *reinterpret_cast<uint128_t*>(&sA(row0 + i * Config::kRowsPerPass, k_col, stage)), ok);
    }
#pragma unroll
    for (int i = 0; i < Config::kChunksB; ++i) {
      const bool ok = b_row[i] != nullptr && k < p.K;
      CpAsync::copy(*reinterpret_cast<const uint128_t*>(ok ? b_row[i] + k : w_expert),
                    *reinterpret_cast<uint128_t*>(&sB(row0 + i * Config::kRowsPerPass, k_col, stage)), ok);
    }
  };

  // ---- wgmma partitions: descriptors into the ring ---------------------------------
  typename Config::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_slice(threadIdx.x);
  Tensor tCsA = thr_mma.partition_A(sA);  // (MMA, MMA_M, MMA_K, STAGES)
  Tensor tCsB = thr_mma.partition_B(sB);  // (MMA, MMA_N, MMA_K, STAGES)
  Tensor tCrA = thr_mma.make_fragment_A(tCsA);
  Tensor tCrB = thr_mma.make_fragment_B(tCsB);
  Tensor acc = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});  // (MMA, MMA_M, MMA_N)
  clear(acc);

#pragma unroll
  for (int s = 0; s < kPrefetch; ++s) {
    if (s < num_k_tiles) load_stage(s, s);
    cp_async_fence();
  }
  for (int64_t k_tile = 0; k_tile < num_k_tiles; ++k_tile) {
    cp_async_wait<kPrefetch - 1>();
    // cp.async writes through the generic proxy; wgmma reads through the async proxy.
    cutlass::arch::fence_view_async_shared();
    __syncthreads();
    const int64_t next = k_tile + kPrefetch;
    if (next < num_k_tiles) load_stage(int(next % kStages), next);
    cp_async_fence();

    const int stage = int(k_tile % kStages);
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
#pragma unroll
    for (int kb = 0; kb < size<2>(tCrA); ++kb) {
      gemm(tiled_mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, stage), acc);
    }
    warpgroup_commit_batch();
    warpgroup_wait<1>();
    warpgroup_fence_operand(acc);
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);
  allow_next_kernel_launch();

  // ---- epilogue: routed weight, round, scatter rows by slot -------------------
  // Accumulator pairs (i, i + 1) are adjacent columns of one row: store them as one
  // 4-byte word when out is row-contiguous.
  Tensor coord = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  const bool paired = p.out_stride_n == 1 && p.out_stride_row % 2 == 0 && (reinterpret_cast<uintptr_t>(out) % 4) == 0;
#pragma unroll
  for (int i = 0; i < size(acc); i += 2) {
    const int r = get<0>(coord(i));
    const int64_t n = n0 + get<1>(coord(i));
    const int32_t slot = tile_slot[r];
    if (slot < 0 || n >= p.N) continue;
    const float w = tile_weight[r];
    T* dst = out + slot * p.out_stride_row + n * p.out_stride_n;
    if (paired && n + 1 < p.N) {
      using Pair = cute::array<T, 2>;
      Pair v;
      v[0] = T(acc(i) * w);
      v[1] = T(acc(i + 1) * w);
      *reinterpret_cast<Pair*>(dst) = v;
    } else {
      dst[0] = T(acc(i) * w);
      if (n + 1 < p.N) dst[p.out_stride_n] = T(acc(i + 1) * w);
    }
  }
#endif
}

// Launches the kernel for one (element type, tile) instance.
template <class Element, int kBlockM, int kBlockN>
void launch_fused_moe_sm90(const detail::GemmParams& p, cudaStream_t stream) {
  using Config = FusedMoeSm90Config<Element, kBlockM, kBlockN>;
  const int64_t num_m_tiles = p.max_num_blocks * (p.block_size / kBlockM);
  const int64_t num_n_tiles = (p.N + kBlockN - 1) / kBlockN;
  const int64_t num_tiles = num_m_tiles * num_n_tiles;
  if (num_tiles == 0) return;
  auto kernel = fused_moe_sm90_kernel<Config>;
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(Config::kSmemBytes)));
  launch_kernel(kernel, dim3(unsigned(num_tiles)), dim3(Config::kThreads), Config::kSmemBytes, stream, p);
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
