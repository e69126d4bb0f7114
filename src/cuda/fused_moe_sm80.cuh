// fused_moe on the tensor cores with mma.sync (sm_80; also runs on sm_90).
//
// One CTA computes a [kBlockM, kBlockN] tile of out for kBlockM consecutive entries of
// sorted_token_ids (all of one expert, since kBlockM divides the alignment block size)
// and kBlockN output columns. Activation rows are gathered (row = slot / top_k) with
// cp.async into a kStages-deep shared-memory ring; the expert's weight rows [N, K]
// are K-contiguous, so both operands are "TN" for the MMA. The fp32 accumulators are
// scaled by the routed weight (and, for a gated GEMM, put through the activation) and
// stored straight from registers.
//
// On Hopper it remains the decode kernel: with 16-row tiles the MMA shape wastes little
// when a handful of tokens meet an expert, and small tiles (kBlockN = 64) put more CTAs
// on the weight stream; fused_moe_sm90.cuh takes the tiles of 64 rows and more.
//
// Fused LoRA expand (GemmParams::lora_t): as in fused_moe_sm90.cuh, a tile of a block
// with adapters runs popc(mask) * S * rank / kBlockK more K tiles through the same ring:
// A = the tile's rows of t whose entry has the column's adapter, B = that adapter's
// lora_b rows for the tile's columns, block-diagonal over the slices.
#pragma once

#include <cute/tensor.hpp>

#include <string>

#include "common/params.h"
#include "cuda/cuda_check.h"
#include "cuda/fused_moe_lora_steps.cuh"
#include "cuda/fused_moe_tile.cuh"
#include "cuda/gated_activation.cuh"
#include "cuda/launch.cuh"

namespace moelora::cuda {

template <class Element_, int kBlockM_, int kBlockN_>
struct FusedMoeSm80Config {
  using Element = Element_;  // cute::bfloat16_t or cute::half_t
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kBlockK = 64;  // 128 bytes of bf16: one swizzled smem row
  static constexpr int kThreads = 128;
  static_assert(kBlockM == 16 || kBlockM == 32 || kBlockM == 64, "kBlockM must be 16, 32 or 64");
  static_assert(kBlockN == 64 || kBlockN == 128, "kBlockN must be 64 or 128");
  // NOTE: decode streams weights with few CTAs per SM, so bytes in flight per CTA set
  // the bandwidth (Little's law: ~1.5 us of HBM latency under load). Deepen the ring
  // to ~80 KB whatever the tile: 8 slots for 16x64, 4 for 64x128. Two CTAs still fit.
  static constexpr int kStageBytes = (kBlockM + kBlockN) * kBlockK * 2;
  static constexpr int kStages = (80 * 1024) / kStageBytes > 8 ? 8 : (80 * 1024) / kStageBytes;
  static_assert(kStages >= 3, "the pipeline needs three slots");

  // 4 warps: 2x2 when the tile has >= 32 rows, else 1x4 along N.
  static constexpr int kWarpsM = kBlockM >= 32 ? 2 : 1;
  static constexpr int kWarpsN = 4 / kWarpsM;
  using MmaOp = std::conditional_t<std::is_same_v<Element, cute::bfloat16_t>,
                                   cute::SM80_16x8x16_F32BF16BF16F32_TN, cute::SM80_16x8x16_F32F16F16F32_TN>;
  // NOTE: the Tile permutation gives each warp 16 columns (two n8 atoms), so one
  // ldmatrix.x4 feeds B as well as A.
  using TiledMma = decltype(cute::make_tiled_mma(
      MmaOp{}, cute::Layout<cute::Shape<cute::Int<kWarpsM>, cute::Int<kWarpsN>, cute::_1>>{},
      cute::Tile<cute::Int<16 * kWarpsM>, cute::Int<16 * kWarpsN>, cute::_16>{}));

  // 8 rows x 64 halves, XOR-swizzled so ldmatrix reads are bank-conflict free.
  using SmemAtom = decltype(cute::composition(
      cute::Swizzle<3, 3, 3>{},
      cute::Layout<cute::Shape<cute::_8, cute::Int<kBlockK>>, cute::Stride<cute::Int<kBlockK>, cute::_1>>{}));
  using SmemLayoutA = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockK>, cute::Int<kStages>>{}));
  using SmemLayoutB = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockK>, cute::Int<kStages>>{}));
  using SmemCopyAtom = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Element>;

  static constexpr int kSmemElementsA = cute::cosize(SmemLayoutA{});
  static constexpr int kSmemElementsB = cute::cosize(SmemLayoutB{});
  static constexpr size_t kSmemBytes =
      (kSmemElementsA + kSmemElementsB) * sizeof(Element) + kBlockM * (sizeof(int32_t) + sizeof(float));

  // 16-byte chunks per operand row per K tile, and the chunks each thread copies.
  static constexpr int kChunksPerRow = kBlockK * int(sizeof(Element)) / 16;
  static_assert(kThreads % kChunksPerRow == 0, "a thread keeps one K column across its chunks");
  static constexpr int kChunksA = kBlockM * kChunksPerRow / kThreads;
  static constexpr int kChunksB = kBlockN * kChunksPerRow / kThreads;
  static_assert(kChunksA >= 1 && kChunksB >= 1, "tile too small for the thread count");
};

// kCompactPrologue: the prologue's kStages - 1 loads in a loop, not unrolled: one copy of
// load_stage's code (with its LoRA branch) where unrolled there are kStages - 1 (16 x 128:
// 6,464 -> 4,584 SASS instructions on sm_90a, 164 registers against 120, still three CTAs an
// SM). A CTA of a 16-row GEMM at M = 16-64 lives a few microseconds and runs its code about
// once. Measured (H200, fifty-second session, same run): the layer 0.947-0.983x at Qwen3-30B
// and OLMoE M = 16-64 (both GEMMs 16 x 128), 0.983-0.988x at DeepSeek-V3's LoRA rows (GEMM2);
// on the 16 x 64 tile (gpt-oss, Mixtral M = 16, Qwen3-235B M = 64) 1.000-1.013x, so the
// 16 x 128 tile only (sm80_compact_prologue_enabled()).
template <class Config, bool kCompactPrologue = false>
__global__ void __launch_bounds__(Config::kThreads) fused_moe_sm80_kernel(const detail::GemmParams p) {
  using namespace cute;
  using T = typename Config::Element;
  constexpr int kBlockM = Config::kBlockM, kBlockN = Config::kBlockN, kBlockK = Config::kBlockK;
  constexpr int kStages = Config::kStages, kThreads = Config::kThreads;

  extern __shared__ uint128_t smem_raw[];
  T* smem_a = reinterpret_cast<T*>(smem_raw);
  T* smem_b = smem_a + Config::kSmemElementsA;
  int32_t* tile_slot = reinterpret_cast<int32_t*>(smem_b + Config::kSmemElementsB);  // [kBlockM], -1 = padding
  float* tile_weight = reinterpret_cast<float*>(tile_slot + kBlockM);                  // [kBlockM]

  // Gated: the tile's kBlockN weight rows give kBlockN / 2 output columns.
  const int out_width = p.gated ? kBlockN / 2 : kBlockN;
  const int64_t num_n_tiles = (p.N + out_width - 1) / out_width;
  const int64_t m_tile = blockIdx.x / num_n_tiles;
  const int64_t n0 = (blockIdx.x % num_n_tiles) * out_width;  // first output column
  const int64_t entry0 = m_tile * kBlockM;  // first entry of sorted_token_ids in this tile
  // lora_late_wait: the base K steps need nothing the shrink before this grid writes.
  const bool late_wait = p.lora_late_wait && p.lora_t != nullptr;
  if (!late_wait) wait_for_previous_kernel();
  // The count and the tile's expert in one round trip: the alignment writes -1 to every
  // block past the used ones, and the grid holds max_num_blocks * (block_size / kBlockM)
  // tiles, so the read is in bounds and initialized whether or not the tile is used.
  const int32_t num_used_entries = *p.num_tokens_post_padded;
  const int expert = p.expert_ids[entry0 / p.block_size];
  // Device-side count: tiles past the used length exit (the grid is sized from capacity).
  // With the late wait, CTA 0 waits whatever its path, so this grid completes only after
  // the shrink: the kernels after it (GEMM2's shrink shares lora_t) rely on that.
  if (entry0 >= num_used_entries) {
    if (late_wait && blockIdx.x == 0) wait_for_previous_kernel();
    return;
  }
  // Expert not on this rank (or a dropped slot): no K loop, the epilogue writes zeros.
  const bool has_expert = expert >= 0 && expert < p.num_experts;

  // ---- gmem -> smem: each thread copies fixed rows at one fixed K column ----------
  const T* a_base = static_cast<const T*>(p.a);
  const T* w_expert = static_cast<const T*>(p.w) + (has_expert ? expert : 0) * p.w_stride_expert;
  const int k_col = (threadIdx.x % Config::kChunksPerRow) * (16 / int(sizeof(T)));
  const T* b_row[Config::kChunksB];  // null past N
#pragma unroll
  for (int i = 0; i < Config::kChunksB; ++i) {
    const int c = (threadIdx.x + i * kThreads) / Config::kChunksPerRow;
    int64_t row = n0 + c;
    if (p.gated) {
      const GatedTileColumn<kBlockN> col(c);
      row = n0 + col.out_col < p.N ? gated_weight_row(p, n0 + col.out_col, col.up) : p.N;
    }
    b_row[i] = row < (p.gated ? 2 * p.N : p.N) ? w_expert + row * p.w_stride_n : nullptr;
  }

  Tensor sA = make_tensor(make_smem_ptr(smem_a), typename Config::SmemLayoutA{});  // (BLK_M, BLK_K, STAGES)
  Tensor sB = make_tensor(make_smem_ptr(smem_b), typename Config::SmemLayoutB{});  // (BLK_N, BLK_K, STAGES)
  using CpAsync = SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint128_t>;

  const int64_t num_k_tiles = has_expert ? (p.K + kBlockK - 1) / kBlockK : 0;
  // The weights of the first stages stream before the tile's slot table is read: they
  // depend on the expert alone, and the table is one or two more dependent global reads
  // (sorted_token_ids, then topk_weights), which every CTA otherwise paid before its
  // first weight byte was asked for. They join the first stage's commit group, so the
  // first wait covers them all.
  const int early_stages = int(num_k_tiles < kStages - 1 ? num_k_tiles : kStages - 1);
  auto load_stage_b = [&](int stage, int64_t k_tile) {
    const int64_t k = k_tile * kBlockK + k_col;  // K % 8 == 0: a chunk is all in or all out
#pragma unroll
    for (int i = 0; i < Config::kChunksB; ++i) {
      const int r = (threadIdx.x + i * kThreads) / Config::kChunksPerRow;
      const bool ok = b_row[i] != nullptr && k < p.K;
      CpAsync::copy(*reinterpret_cast<const uint128_t*>(ok ? b_row[i] + k : w_expert),
                    *reinterpret_cast<uint128_t*>(&sB(r, k_col, stage)), ok);
    }
  };
  for (int s = 0; s < early_stages; ++s) load_stage_b(s, s);

  // The routed weights wait until the first stages are asked for (below): only the
  // epilogue reads them, and GEMM2's are one more dependent read after the slots.
  load_tile_slot_ids<kBlockM>(p, entry0, tile_slot);
  __syncthreads();

  const T* a_row[Config::kChunksA];  // null for padding rows
#pragma unroll
  for (int i = 0; i < Config::kChunksA; ++i) {
    const int r = (threadIdx.x + i * kThreads) / Config::kChunksPerRow;
    a_row[i] = tile_slot[r] >= 0 ? a_base + (tile_slot[r] / p.top_k) * p.a_stride_row : nullptr;
  }

  // The block's adapters (fused LoRA expand) and their K tiles after the base ones.
  const uint64_t lora_mask = has_expert && p.lora_t != nullptr ? p.block_lora_masks[entry0 / p.block_size] : 0;
  const int64_t num_all_k_tiles = num_k_tiles + lora_k_steps<kBlockK>(p, lora_mask);
  auto load_lora_stage = [&](int stage, int64_t lora_tile) {
    if (late_wait) wait_for_previous_kernel();  // lora_t is the shrink's output
    const LoraKColumn col(p, lora_mask, int(lora_tile) * kBlockK + k_col);
    const T* t_rows = static_cast<const T*>(p.lora_t) + entry0 * p.lora_t_cols + col.t_col;
#pragma unroll
    for (int i = 0; i < Config::kChunksA; ++i) {
      const int r = (threadIdx.x + i * kThreads) / Config::kChunksPerRow;
      const bool ok = col.lora >= 0 && p.entry_lora_ids[entry0 + r] == col.lora;
      CpAsync::copy(*reinterpret_cast<const uint128_t*>(ok ? t_rows + r * p.lora_t_cols : a_base),
                    *reinterpret_cast<uint128_t*>(&sA(r, k_col, stage)), ok);
    }
    // Rows of the column's slice read lora_b, the others are zeros: its stride is the one.
    const T* b_base = col.lora_b<T>(p, expert);
    const int64_t b_stride = p.lora[col.slice].b_stride_n;
#pragma unroll
    for (int i = 0; i < Config::kChunksB; ++i) {
      const int c = (threadIdx.x + i * kThreads) / Config::kChunksPerRow;
      int64_t out_col = n0 + c;
      bool up = false;
      if (p.gated) {
        const GatedTileColumn<kBlockN> gated_col(c);
        out_col = n0 + gated_col.out_col;
        up = gated_col.up;
      }
      const LoraBRow b(p, out_col, up);
      const bool ok = col.lora >= 0 && b.slice == col.slice && out_col < p.N;
      CpAsync::copy(*reinterpret_cast<const uint128_t*>(ok ? b_base + b.row * b_stride : a_base),
                    *reinterpret_cast<uint128_t*>(&sB(c, k_col, stage)), ok);
    }
    cp_async_fence();
  };
  auto load_stage = [&](int stage, int64_t k_tile) {
    if (k_tile >= num_k_tiles) {
      load_lora_stage(stage, k_tile - num_k_tiles);
      return;
    }
    const int64_t k = k_tile * kBlockK + k_col;  // K % 8 == 0: a chunk is all in or all out
#pragma unroll
    for (int i = 0; i < Config::kChunksA; ++i) {
      const int r = (threadIdx.x + i * kThreads) / Config::kChunksPerRow;
      const bool ok = a_row[i] != nullptr && k < p.K;
      CpAsync::copy(*reinterpret_cast<const uint128_t*>(ok ? a_row[i] + k : a_base),
                    *reinterpret_cast<uint128_t*>(&sA(r, k_col, stage)), ok);
    }
    if (k_tile >= early_stages) load_stage_b(stage, k_tile);
    cp_async_fence();
  };

  // ---- MMA partitions ----------------------------------------------------------
  typename Config::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_slice(threadIdx.x);
  Tensor tCrA = thr_mma.partition_fragment_A(sA(_, _, 0));  // (MMA, MMA_M, MMA_K)
  Tensor tCrB = thr_mma.partition_fragment_B(sB(_, _, 0));  // (MMA, MMA_N, MMA_K)
  Tensor acc = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});  // (MMA, MMA_M, MMA_N)
  clear(acc);

  auto s2r_copy_a = make_tiled_copy_A(typename Config::SmemCopyAtom{}, tiled_mma);
  auto s2r_thr_a = s2r_copy_a.get_slice(threadIdx.x);
  Tensor tXsA = s2r_thr_a.partition_S(sA);  // (CPY, CPY_M, CPY_K, STAGES)
  Tensor tXrA = s2r_thr_a.retile_D(tCrA);   // (CPY, CPY_M, CPY_K)
  auto s2r_copy_b = make_tiled_copy_B(typename Config::SmemCopyAtom{}, tiled_mma);
  auto s2r_thr_b = s2r_copy_b.get_slice(threadIdx.x);
  Tensor tXsB = s2r_thr_b.partition_S(sB);  // (CPY, CPY_N, CPY_K, STAGES)
  Tensor tXrB = s2r_thr_b.retile_D(tCrB);   // (CPY, CPY_N, CPY_K)

  // ---- mainloop: kStages-1 tiles in flight while one is multiplied --------------
  if constexpr (kCompactPrologue) {
#pragma unroll 1
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < num_all_k_tiles) load_stage(s, s); else cp_async_fence();
    }
  } else {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < num_all_k_tiles) load_stage(s, s); else cp_async_fence();
    }
  }
  load_tile_routed_weights<kBlockM>(p, tile_slot, tile_weight);
  for (int64_t k_tile = 0; k_tile < num_all_k_tiles; ++k_tile) {
    cp_async_wait<kStages - 2>();
    // NOTE: this barrier also retires the reads of the stage refilled just below,
    // which was consumed in the previous iteration.
    __syncthreads();
    const int64_t next = k_tile + kStages - 1;
    if (next < num_all_k_tiles) load_stage(int(next % kStages), next); else cp_async_fence();
    const int stage = int(k_tile % kStages);
#pragma unroll
    for (int kk = 0; kk < size<2>(tCrA); ++kk) {
      copy(s2r_copy_a, tXsA(_, _, kk, stage), tXrA(_, _, kk));
      copy(s2r_copy_b, tXsB(_, _, kk, stage), tXrB(_, _, kk));
      gemm(tiled_mma, acc, tCrA(_, _, kk), tCrB(_, _, kk), acc);
    }
  }
  cp_async_wait<0>();
  if (late_wait && blockIdx.x == 0) wait_for_previous_kernel();  // see the early exit above
  __syncthreads();  // tile_weight (a K loop of no tiles has no barrier after its writes)
  allow_next_kernel_launch();

  // ---- epilogue: routed weight, (activation,) round, scatter rows by slot -------
  T* out = static_cast<T*>(p.out);
  Tensor coord = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));  // (MMA, MMA_M, MMA_N)
  if (p.gated) {
    // The fragment's second half (MMA_N index + MMA_N / 2) holds the columns kBlockN / 2
    // to the right: the up rows of the gate columns in the first half.
    constexpr int kHalf = decltype(size(acc))::value / 2;
#pragma unroll
    for (int i = 0; i < kHalf; ++i) {
      const int r = get<0>(coord(i));
      const int64_t n = n0 + GatedTileColumn<kBlockN>(get<1>(coord(i))).out_col;
      const int32_t slot = tile_slot[r];
      if (slot < 0 || n >= p.N) continue;
      const float w = tile_weight[r];
      out[slot * p.out_stride_row + n * p.out_stride_n] = T(gated_activation(p, acc(i) * w, acc(i + kHalf) * w));
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < size(acc); ++i) {
    const int r = get<0>(coord(i));
    const int64_t n = n0 + get<1>(coord(i));
    const int32_t slot = tile_slot[r];
    if (slot >= 0 && n < p.N) out[slot * p.out_stride_row + n * p.out_stride_n] = T(acc(i) * tile_weight[r]);
  }
}

// Launches the kernel for one (element type, tile rows) instance.
template <class Element, int kBlockM, int kBlockN>
void launch_fused_moe_sm80(const detail::GemmParams& p, cudaStream_t stream) {
  using Config = FusedMoeSm80Config<Element, kBlockM, kBlockN>;
  const int64_t num_m_tiles = p.max_num_blocks * (p.block_size / kBlockM);
  const int64_t out_width = p.gated ? kBlockN / 2 : kBlockN;
  const int64_t num_tiles = num_m_tiles * ((p.N + out_width - 1) / out_width);
  if (num_tiles == 0) return;
  auto kernel = fused_moe_sm80_kernel<Config, false>;
  if constexpr (kBlockM == 16 && kBlockN == 128) {
    if (sm80_compact_prologue_enabled()) kernel = fused_moe_sm80_kernel<Config, true>;
  }
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(Config::kSmemBytes)));
  launch_kernel(kernel, dim3(unsigned(num_tiles)), dim3(Config::kThreads), Config::kSmemBytes, stream, p);
}

// The instances of one element type (one translation unit per type: they compile in parallel).
template <class T>
void dispatch_fused_moe_sm80(const detail::GemmParams& p, int block_m, int block_n, cudaStream_t stream) {
  switch (block_m * 1000 + block_n) {
    case 16064: launch_fused_moe_sm80<T, 16, 64>(p, stream); break;
    case 16128: launch_fused_moe_sm80<T, 16, 128>(p, stream); break;
    case 32064: launch_fused_moe_sm80<T, 32, 64>(p, stream); break;
    case 32128: launch_fused_moe_sm80<T, 32, 128>(p, stream); break;
    case 64064: launch_fused_moe_sm80<T, 64, 64>(p, stream); break;
    case 64128: launch_fused_moe_sm80<T, 64, 128>(p, stream); break;
    default:
      throw Error("moelora.fused_moe: no sm80 instance for tile " + std::to_string(block_m) + "x" + std::to_string(block_n));
  }
}

}  // namespace moelora::cuda
