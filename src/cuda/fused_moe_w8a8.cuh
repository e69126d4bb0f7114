// fused_moe on 8-bit operands (W8A8, issue 28) with mma.sync: fp8 e4m3 (m16n8k32, sm_89+)
// or int8 (m16n8k32, s32 accumulation, sm_80+).
//
// The structure is fused_moe_sm80.cuh's: one CTA per [kBlockM, kBlockN] tile of one
// expert's block, activation rows gathered by slot with cp.async into a swizzled ring,
// the expert's weight rows [N, K] K-contiguous ("TN"), fp32 results scaled by the routed
// weight (and put through the activation for a gated GEMM) and stored from registers.
// What the 8-bit types change:
// - A K tile is 128 elements (128 bytes: one swizzled row), which is also the K extent of
//   a block scale (GemmQuantParams::block_k == 128 on CUDA).
// - kBlockScales: each K tile's product lands in a fresh partial accumulator and is
//   added into the fp32 result times a_scale[row, kt] · w_scale[row of w / block_n, kt];
//   the tile's scales ride in the same cp.async groups as its operands.
// - Channel / tensor scales: one accumulator over all of K (exact int32 for int8), scaled
//   once in the epilogue by the row's and the column's scale.
// Out is bf16 or fp16 (GemmParams::dtype), chosen at run time: a uniform branch in the
// store, not another set of instances.
#pragma once

#include <cute/tensor.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "common/params.h"
#include "cuda/cuda_check.h"
#include "cuda/fused_moe_tile.cuh"
#include "cuda/gated_activation.cuh"
#include "cuda/launch.cuh"
#include "cuda/mma_sm80.cuh"

namespace moelora::cuda {

// kStages_ 0: as many stages as ~80 KB of operands hold (at most 8). kMinBlocks_: CTAs an
// SM the registers must allow (__launch_bounds__).
template <class Element_, int kBlockM_, int kBlockN_, bool kBlockScales_, int kStages_ = 0, int kMinBlocks_ = 1>
struct FusedMoeW8A8Config {
  using Element = Element_;  // cute::float_e4m3_t or int8_t
  static constexpr bool kFp8 = std::is_same_v<Element, cute::float_e4m3_t>;
  static constexpr bool kBlockScales = kBlockScales_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kBlockK = 128;  // 128 bytes: one swizzled smem row, one scale block
  static constexpr int kThreads = 128;
  static_assert(kBlockM == 16 || kBlockM == 32 || kBlockM == 64, "kBlockM must be 16, 32 or 64");
  static_assert(kBlockN == 64 || kBlockN == 128, "kBlockN must be 64 or 128");
  static_assert(kBlockN <= kThreads && kBlockM <= kThreads, "one thread loads each row's and column's scale");
  // NOTE: as fused_moe_sm80.cuh: ~80 KB of operands in flight per CTA for the weight
  // stream of small tiles (Little's law), at least three stages.
  static constexpr int kStageBytes = (kBlockM + kBlockN) * kBlockK;
  static constexpr int kStagesByBytes = (80 * 1024) / kStageBytes > 8 ? 8 : (80 * 1024) / kStageBytes;
  static constexpr int kStages = kStages_ > 0 ? kStages_ : kStagesByBytes;
  static constexpr int kMinBlocks = kMinBlocks_;
  static_assert(kStages >= 3, "the pipeline needs three slots");

  static constexpr int kWarpsM = kBlockM >= 32 ? 2 : 1;
  static constexpr int kWarpsN = 4 / kWarpsM;
  using MmaOp = std::conditional_t<kFp8, cute::SM89_16x8x32_F32E4M3E4M3F32_TN, cute::SM80_16x8x32_S32S8S8S32_TN>;
  // Each warp takes 16 columns (two n8 atoms) so one ldmatrix.x4 feeds B, as in the
  // 16-bit kernel: the 8-bit k32 fragments have the same register layout as bf16 k16.
  using TiledMma = decltype(cute::make_tiled_mma(
      MmaOp{}, cute::Layout<cute::Shape<cute::Int<kWarpsM>, cute::Int<kWarpsN>, cute::_1>>{},
      cute::Tile<cute::Int<16 * kWarpsM>, cute::Int<16 * kWarpsN>, cute::_32>{}));

  // 8 rows x 128 bytes, the 16-byte chunks XOR-swizzled by row: conflict-free ldmatrix.
  using SmemAtom = decltype(cute::composition(
      cute::Swizzle<3, 4, 3>{},
      cute::Layout<cute::Shape<cute::_8, cute::Int<kBlockK>>, cute::Stride<cute::Int<kBlockK>, cute::_1>>{}));
  using SmemLayoutA = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockK>, cute::Int<kStages>>{}));
  using SmemLayoutB = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockK>, cute::Int<kStages>>{}));
  using SmemCopyAtom = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Element>;

  static constexpr int kSmemElementsA = cute::cosize(SmemLayoutA{});
  static constexpr int kSmemElementsB = cute::cosize(SmemLayoutB{});
  // Operands, then per stage the K tile's row and column scales (kBlockScales), then
  // the tile's slots, routed weights and (channel / tensor) row and column scales.
  static constexpr int kScaleFloats = kBlockScales ? kStages * (kBlockM + kBlockN) : kBlockM + kBlockN;
  static constexpr size_t kSmemBytes = kSmemElementsA + kSmemElementsB + kScaleFloats * sizeof(float) +
                                       kBlockM * (sizeof(int32_t) + sizeof(float));

  static constexpr int kChunksPerRow = kBlockK / 16;
  static constexpr int kChunksA = kBlockM * kChunksPerRow / kThreads;
  static constexpr int kChunksB = kBlockN * kChunksPerRow / kThreads;
  static_assert(kChunksA >= 1 && kChunksB >= 1, "tile too small for the thread count");
};

// 4 bytes global -> shared by cp.async (zeros when !ok), in the current commit group.
__device__ __forceinline__ void cp_async_4_zfill(float* smem, const float* src, bool ok) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(smem)), "l"(src), "r"(ok ? 4 : 0));
}

template <class Config>
__global__ void __launch_bounds__(Config::kThreads, Config::kMinBlocks) fused_moe_w8a8_kernel(const detail::GemmParams p) {
  using namespace cute;
  using T = typename Config::Element;
  constexpr int kBlockM = Config::kBlockM, kBlockN = Config::kBlockN, kBlockK = Config::kBlockK;
  constexpr int kStages = Config::kStages, kThreads = Config::kThreads;
  const detail::GemmQuantParams& q = p.quant;

  extern __shared__ uint128_t smem_raw[];
  T* smem_a = reinterpret_cast<T*>(smem_raw);
  T* smem_b = smem_a + Config::kSmemElementsA;
  float* scale_a = reinterpret_cast<float*>(smem_b + Config::kSmemElementsB);  // [stages?][kBlockM]
  float* scale_w = scale_a + (Config::kBlockScales ? kStages * kBlockM : kBlockM);  // [stages?][kBlockN]
  int32_t* tile_slot = reinterpret_cast<int32_t*>(scale_w + (Config::kBlockScales ? kStages * kBlockN : kBlockN));
  float* tile_weight = reinterpret_cast<float*>(tile_slot + kBlockM);

  const int out_width = p.gated ? kBlockN / 2 : kBlockN;
  const int64_t num_n_tiles = (p.N + out_width - 1) / out_width;
  const int64_t m_tile = blockIdx.x / num_n_tiles;
  const int64_t n0 = (blockIdx.x % num_n_tiles) * out_width;
  const int64_t entry0 = m_tile * kBlockM;
  wait_for_previous_kernel();
  if (entry0 >= *p.num_tokens_post_padded) return;
  const int expert = p.expert_ids[entry0 / p.block_size];
  const bool has_expert = expert >= 0 && expert < p.num_experts;

  load_tile_slots<kBlockM>(p, entry0, tile_slot, tile_weight);
  __syncthreads();

  // The weight row of tile column c (gate and up rows for a gated tile); -1 past N.
  auto weight_row = [&](int c) -> int64_t {
    if (p.gated) {
      const GatedTileColumn<kBlockN> col(c);
      return n0 + col.out_col < p.N ? gated_weight_row(p, n0 + col.out_col, col.up) : -1;
    }
    return n0 + c < p.N ? n0 + c : -1;
  };
  // Row and column scales: this thread's row (threadIdx.x < kBlockM) and column.
  const int my_row = int(threadIdx.x), my_col = int(threadIdx.x);
  const bool row_ok = my_row < kBlockM && tile_slot[min(my_row, kBlockM - 1)] >= 0 && has_expert;
  const int64_t my_a_row = row_ok ? tile_slot[my_row] / p.top_k : 0;
  const int64_t my_w_row = my_col < kBlockN && has_expert ? weight_row(my_col) : -1;
  const float* w_scale_expert = q.w_scale + (has_expert ? expert : 0) * q.w_scale_stride_expert;

  // ---- gmem -> smem ---------------------------------------------------------------
  const T* a_base = static_cast<const T*>(p.a);
  const T* w_expert = static_cast<const T*>(p.w) + (has_expert ? expert : 0) * p.w_stride_expert;
  const int k_col = (threadIdx.x % Config::kChunksPerRow) * 16;
  const T* a_row[Config::kChunksA];
  const T* b_row[Config::kChunksB];
#pragma unroll
  for (int i = 0; i < Config::kChunksA; ++i) {
    const int r = (threadIdx.x + i * kThreads) / Config::kChunksPerRow;
    a_row[i] = tile_slot[r] >= 0 ? a_base + (tile_slot[r] / p.top_k) * p.a_stride_row : nullptr;
  }
#pragma unroll
  for (int i = 0; i < Config::kChunksB; ++i) {
    const int c = (threadIdx.x + i * kThreads) / Config::kChunksPerRow;
    const int64_t row = weight_row(c);
    b_row[i] = row >= 0 ? w_expert + row * p.w_stride_n : nullptr;
  }

  Tensor sA = make_tensor(make_smem_ptr(smem_a), typename Config::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(smem_b), typename Config::SmemLayoutB{});
  using CpAsync = SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint128_t>;

  const int64_t num_k_tiles = has_expert ? (p.K + kBlockK - 1) / kBlockK : 0;
  auto load_stage = [&](int stage, int64_t k_tile) {
    const int64_t k = k_tile * kBlockK + k_col;  // K % 16 == 0: a chunk is all in or all out
#pragma unroll
    for (int i = 0; i < Config::kChunksA; ++i) {
      const int r = (threadIdx.x + i * kThreads) / Config::kChunksPerRow;
      const bool ok = a_row[i] != nullptr && k < p.K;
      CpAsync::copy(*reinterpret_cast<const uint128_t*>(ok ? a_row[i] + k : a_base),
                    *reinterpret_cast<uint128_t*>(&sA(r, k_col, stage)), ok);
    }
#pragma unroll
    for (int i = 0; i < Config::kChunksB; ++i) {
      const int r = (threadIdx.x + i * kThreads) / Config::kChunksPerRow;
      const bool ok = b_row[i] != nullptr && k < p.K;
      CpAsync::copy(*reinterpret_cast<const uint128_t*>(ok ? b_row[i] + k : w_expert),
                    *reinterpret_cast<uint128_t*>(&sB(r, k_col, stage)), ok);
    }
    if constexpr (Config::kBlockScales) {
      // Padding rows and columns past N get scale 0: their products are never stored.
      if (my_row < kBlockM) {
        cp_async_4_zfill(scale_a + stage * kBlockM + my_row,
                         q.a_scale + my_a_row * q.a_scale_stride_row + k_tile * q.a_scale_stride_k, row_ok);
      }
      if (my_col < kBlockN) {
        cp_async_4_zfill(scale_w + stage * kBlockN + my_col,
                         w_scale_expert + (my_w_row >= 0 ? my_w_row / q.block_n : 0) * q.w_scale_stride_n +
                             k_tile * q.w_scale_stride_k,
                         my_w_row >= 0);
      }
    }
    cp_async_fence();
  };
  if constexpr (!Config::kBlockScales) {
    // One scale per row (token) or per tensor, one per column (channel) or per expert.
    if (my_row < kBlockM) {
      scale_a[my_row] =
          row_ok ? q.a_scale[q.a_scales == ScaleGranularity::kChannel ? my_a_row * q.a_scale_stride_row : 0] : 0.f;
    }
    if (my_col < kBlockN) {
      scale_w[my_col] = my_w_row >= 0 ? w_scale_expert[q.w_scales == ScaleGranularity::kChannel
                                                           ? my_w_row * q.w_scale_stride_n
                                                           : 0]
                                      : 0.f;
    }
  }

  // ---- MMA partitions ----------------------------------------------------------
  typename Config::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_slice(threadIdx.x);
  Tensor tCrA = thr_mma.partition_fragment_A(sA(_, _, 0));
  Tensor tCrB = thr_mma.partition_fragment_B(sB(_, _, 0));
  Tensor acc = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});  // int32 (int8) or fp32
  clear(acc);
  Tensor result = make_fragment_like<float>(acc);  // fp32, scaled
  clear(result);
  Tensor coord = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));

  auto s2r_copy_a = make_tiled_copy_A(typename Config::SmemCopyAtom{}, tiled_mma);
  auto s2r_thr_a = s2r_copy_a.get_slice(threadIdx.x);
  Tensor tXsA = s2r_thr_a.partition_S(sA);
  Tensor tXrA = s2r_thr_a.retile_D(tCrA);
  auto s2r_copy_b = make_tiled_copy_B(typename Config::SmemCopyAtom{}, tiled_mma);
  auto s2r_thr_b = s2r_copy_b.get_slice(threadIdx.x);
  Tensor tXsB = s2r_thr_b.partition_S(sB);
  Tensor tXrB = s2r_thr_b.retile_D(tCrB);

  // ---- mainloop ---------------------------------------------------------------------
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_k_tiles) load_stage(s, s); else cp_async_fence();
  }
  for (int64_t k_tile = 0; k_tile < num_k_tiles; ++k_tile) {
    cp_async_wait<kStages - 2>();
    // NOTE: this barrier also retires the reads of the stage refilled just below.
    __syncthreads();
    const int64_t next = k_tile + kStages - 1;
    if (next < num_k_tiles) load_stage(int(next % kStages), next); else cp_async_fence();
    const int stage = int(k_tile % kStages);
#pragma unroll
    for (int kk = 0; kk < size<2>(tCrA); ++kk) {
      copy(s2r_copy_a, tXsA(_, _, kk, stage), tXrA(_, _, kk));
      copy(s2r_copy_b, tXsB(_, _, kk, stage), tXrB(_, _, kk));
      gemm(tiled_mma, acc, tCrA(_, _, kk), tCrB(_, _, kk), acc);
    }
    if constexpr (Config::kBlockScales) {
      const float* sa = scale_a + stage * kBlockM;
      const float* sw = scale_w + stage * kBlockN;
#pragma unroll
      for (int i = 0; i < size(acc); ++i) {
        result(i) += float(acc(i)) * (sa[get<0>(coord(i))] * sw[get<1>(coord(i))]);
      }
      clear(acc);
    }
  }
  cp_async_wait<0>();
  allow_next_kernel_launch();
  if constexpr (!Config::kBlockScales) {
    __syncthreads();  // the scales written above, by other threads
#pragma unroll
    for (int i = 0; i < size(acc); ++i) result(i) = float(acc(i)) * (scale_a[get<0>(coord(i))] * scale_w[get<1>(coord(i))]);
  }

  // ---- epilogue: routed weight, (activation,) round to bf16/fp16, scatter by slot -----
  const bool bf16 = p.dtype == DType::kBFloat16;
  auto store = [&](int64_t slot, int64_t n, float v) {
    const int64_t offset = slot * p.out_stride_row + n * p.out_stride_n;
    if (bf16) {
      static_cast<__nv_bfloat16*>(p.out)[offset] = __float2bfloat16_rn(v);
    } else {
      static_cast<__half*>(p.out)[offset] = __float2half_rn(v);
    }
  };
  // GEMM1's gate and up reach the activation rounded to the layer dtype, as on the grouped
  // path (a layer-dtype tensor between GEMM1 and the activation) and in the reference.
  auto rounded = [&](float v) {
    return bf16 ? __bfloat162float(__float2bfloat16_rn(v)) : __half2float(__float2half_rn(v));
  };
  if (p.gated) {
    constexpr int kHalf = decltype(size(result))::value / 2;
#pragma unroll
    for (int i = 0; i < kHalf; ++i) {
      const int r = get<0>(coord(i));
      const int64_t n = n0 + GatedTileColumn<kBlockN>(get<1>(coord(i))).out_col;
      const int32_t slot = tile_slot[r];
      if (slot < 0 || n >= p.N) continue;
      const float w = tile_weight[r];
      store(slot, n, gated_activation(p, rounded(result(i) * w), rounded(result(i + kHalf) * w)));
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < size(result); ++i) {
    const int r = get<0>(coord(i));
    const int64_t n = n0 + get<1>(coord(i));
    const int32_t slot = tile_slot[r];
    if (slot >= 0 && n < p.N) store(slot, n, result(i) * tile_weight[r]);
  }
}

template <class Element, int kBlockM, int kBlockN, bool kBlockScales, int kStages = 0, int kMinBlocks = 1>
void launch_fused_moe_w8a8(const detail::GemmParams& p, cudaStream_t stream) {
  using Config = FusedMoeW8A8Config<Element, kBlockM, kBlockN, kBlockScales, kStages, kMinBlocks>;
  const int64_t num_m_tiles = p.max_num_blocks * (p.block_size / kBlockM);
  const int64_t out_width = p.gated ? kBlockN / 2 : kBlockN;
  const int64_t num_tiles = num_m_tiles * ((p.N + out_width - 1) / out_width);
  if (num_tiles == 0) return;
  auto kernel = fused_moe_w8a8_kernel<Config>;
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(Config::kSmemBytes)));
  launch_kernel(kernel, dim3(unsigned(num_tiles)), dim3(Config::kThreads), Config::kSmemBytes, stream, p);
}

// The instances of one element type: block_m 16 or, when the block size allows, 64
// (channel / tensor scales) or 32 (block scales).
// NOTE: 64 x 128 with block scales spilled (ptxas: 56 B stores, 312 B loads): the
// partial and the scaled accumulators are 128 registers a thread there.
// NOTE: 16-row tiles over K >= 512 are 64 weight rows wide, 4 stages, 5 CTAs an SM (91
// registers, 40 KB): measured on H100 (docs/PERF_NOTES.md, issue 28 step 7) against 16 x 128
// (4 stages, 3 CTAs an SM by its 168 registers), GEMM1 alone: OLMoE fp8_block M = 64 184.7 ->
// 177.9 us, Qwen3-30B M = 32 225.4 -> 217.4, DeepSeek-V3 M = 64 526.9 -> 507.9. Over
// DeepSeek-V3's GEMM2 (K = 256: two K tiles a CTA) 64-wide tiles were slower (M = 64
// 526.9 -> 529.1 us with 5 CTAs an SM, 550.4 with the registers' 4): those keep 128.
template <class Element>
void dispatch_fused_moe_w8a8(const detail::GemmParams& p, int block_m, cudaStream_t stream) {
  const bool block_scales = p.quant.w_scales == ScaleGranularity::kBlock;
  if (block_scales ? block_m < 32 : block_m != 64) {
    if (p.K >= 512) {
      block_scales ? launch_fused_moe_w8a8<Element, 16, 64, true, 4, 5>(p, stream)
                   : launch_fused_moe_w8a8<Element, 16, 64, false, 4, 5>(p, stream);
    } else {
      block_scales ? launch_fused_moe_w8a8<Element, 16, 128, true>(p, stream)
                   : launch_fused_moe_w8a8<Element, 16, 128, false>(p, stream);
    }
  } else if (block_scales) {
    launch_fused_moe_w8a8<Element, 32, 128, true>(p, stream);
  } else {
    launch_fused_moe_w8a8<Element, 64, 128, false>(p, stream);
  }
}

}  // namespace moelora::cuda
