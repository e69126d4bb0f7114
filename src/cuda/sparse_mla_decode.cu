// sparse_mla_decode on CUDA: tensor-core flash decoding over gathered KV rows (mma.sync,
// sm_80 and later), the merge of the splits, and the launcher, which sends 64-head groups
// on an sm_90a build and device to the wgmma kernel (sparse_mla_decode_sm90.cu). See
// include/moelora/ops.h for the contract.
//
// A CTA takes one token, a group of 16/32/64 query heads and one split of the token's
// indices; it walks the split in blocks of kBlockKeys rows:
//   gather the block's KV rows (cp.async, 16 B a copy, masked rows zero-filled) into a
//   two-stage ring while the previous block computes (16-head CTAs with work for two an
//   SM: one stage, the other CTA's math covering the gather);
//   S = Q·Kᵀ over 576 lanes (Q stays in shared memory for the whole split);
//   online softmax in base 2 (running row max, rescaled accumulators);
//   O += P·V with V = the first 512 lanes of the same rows.
// One pass (num_splits == 1) normalises and writes out / lse; with splits each CTA writes
// its normalised bf16 part and its log2-sum-exp to the workspace and a second kernel
// merges the parts of every (token, head).
// Every shared tile is in rows of 16-byte chunks with the chunk index XORed by row % 8,
// so the 8 row addresses of every ldmatrix phase fall in distinct bank groups (rows are
// 1152 B, a multiple of 128: unswizzled, 8 rows would hit one bank group).
#include <cuda_bf16.h>
#include <cute/arch/copy_sm80.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/params.h"
#include "cuda/cuda_check.h"
#include "cuda/device_info.h"
#include "cuda/launch.cuh"
#include "cuda/mma_sm80.cuh"
#include "cuda/sparse_mla_decode.cuh"

namespace moelora::cuda {
namespace {

using detail::SparseMlaDecodeParams;

constexpr int kHeadDim = kMlaHeadLanes;
constexpr int kValueDim = kMlaValueLanes;
constexpr int kRowBytes = kHeadDim * 2;        // 1152: a q / kv row in shared memory
constexpr int kRowChunks = kRowBytes / 16;     // 72
constexpr int kBlockKeys = kMlaBlockKeys;
constexpr int kThreads = 256;                  // 8 warps
constexpr int kWarps = kThreads / 32;
constexpr int kLoadersPerRow = kThreads / kBlockKeys;  // 4 threads copy one kv row
constexpr int kKSteps = kHeadDim / 16;                 // 36 mma k-steps of Q·Kᵀ
constexpr float kLog2e = kMlaLog2e;
static_assert(kRowChunks % kLoadersPerRow == 0 && kRowChunks % 8 == 0);

// The shared-memory plan of a CTA with kHeadTiles 16-head mma tiles.
// QK: warp w scores head tile w % kHeadTiles against kWarpKeys keys (key group
// w / kHeadTiles); 16-head CTAs first split it over the lanes (kSplitQk).
// PV: warp w accumulates every head of the CTA over value lanes [64 w, 64 w + 64), so
// each V element is read from shared memory once a block.
// kStages_ 2: a two-stage ring, one CTA an SM. kStages_ 1: one stage; 16 heads: 110 KB,
// two CTAs an SM, so one CTA's gather overlaps the other's math and twice the rows are in
// flight (single_stage_for says when there is work for two CTAs an SM); 32 and 64 heads
// (115 and 156 KB, one an SM): the plan of parts whose CTAs cannot have the two-stage ring
// (190 and 230 KB), the A100's 163 KB among them.
template <int kHeadTiles_, int kStages_ = 2>
struct MlaCta {
  static constexpr int kHeadTiles = kHeadTiles_;
  static constexpr int kHeads = 16 * kHeadTiles;
  static constexpr int kStages = kStages_;
  static constexpr int kCtasPerSm = kStages == 1 && kHeadTiles == 1 ? 2 : 1;
  static_assert(kStages == 1 || kStages == 2);
  static constexpr int kKeyGroups = kWarps / kHeadTiles;
  static constexpr int kWarpKeys = kBlockKeys / kKeyGroups;  // 8, 16 or 32
  static constexpr int kWarpKeyTiles = kWarpKeys / 8;        // mma n-tiles of scores
  static constexpr int kWarpValueTiles = kValueDim / kWarps / 8;  // 8 n-tiles of 8 lanes
  static constexpr int kQBytes = kHeads * kRowBytes;
  static constexpr int kStageBytes = kBlockKeys * kRowBytes;
  static constexpr int kKvOffset = kQBytes;
  static constexpr int kPOffset = kKvOffset + kStages * kStageBytes;  // P [kHeads, kBlockKeys] bf16
  static constexpr int kReduceOffset = kPOffset + kHeads * kBlockKeys * 2;  // [kKeyGroups, kHeads] fp32
  static constexpr int kValidOffset = kReduceOffset + kKeyGroups * kHeads * 4;  // [kStages, kBlockKeys] u8
  // 16 heads: Q·Kᵀ split over the lanes (kSplitQk below); the partial scores, fp32
  // [2 key halves][4 lane quarters][4 n-tiles][32 lanes][4] in the mma accumulator layout.
  static constexpr bool kSplitQk = kHeadTiles == 1;
  static constexpr int kPartialOffset = kValidOffset + kStages * kBlockKeys;
  static constexpr int kSmemBytes = kPartialOffset + (kSplitQk ? kWarps * 4 * 32 * 16 : 0);
};
// NOTE: 64 heads fill 230,016 of the 232,448 bytes an sm_90 CTA may have.
static_assert(MlaCta<4>::kSmemBytes <= 232448);
static_assert(MlaCta<1, 1>::kCtasPerSm * (MlaCta<1, 1>::kSmemBytes + 1024) <= 228 * 1024);
// The one-stage plans fit an A100's CTA (166,912 bytes).
static_assert(MlaCta<4, 1>::kSmemBytes <= 166912);

template <int kHeadTiles, int kStages>
__global__ void __launch_bounds__(kThreads, MlaCta<kHeadTiles, kStages>::kCtasPerSm)
    sparse_mla_decode_kernel(const SparseMlaDecodeParams p, int num_head_groups, int blocks_per_split) {
  using Cta = MlaCta<kHeadTiles, kStages>;
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  wait_for_previous_kernel();
  const MlaCtaWork work = mla_cta_work(p, num_head_groups, Cta::kHeads, blocks_per_split, int(blockIdx.x));
  const int64_t token = work.token, split_begin = work.begin, split_end = work.end;
  const int split = work.split, head0 = work.head0, num_blocks = work.num_blocks;

  const uint32_t q_base = smem_addr(smem);
  const uint32_t kv_base = q_base + Cta::kKvOffset;
  const uint32_t p_base = q_base + Cta::kPOffset;
  float* reduce = reinterpret_cast<float*>(smem + Cta::kReduceOffset);
  uint8_t* key_valid = smem + Cta::kValidOffset;

  // ---- the gather: 4 threads a kv row, 18 chunks each ------------------------------
  const int load_key = tid / kLoadersPerRow, load_part = tid % kLoadersPerRow;
  const int32_t* token_indices = p.indices + token * p.indices_stride_token;
  const auto* kv_bytes = static_cast<const uint8_t*>(p.kv);
  auto read_row = [&](int block) -> int32_t {  // this thread's kv row in `block`, -1 = masked
    const int64_t pos = split_begin + int64_t(block) * kBlockKeys + load_key;
    if (pos >= split_end) return -1;
    const int32_t row = __ldg(token_indices + pos);
    return (row >= 0 && row < p.num_kv_rows) ? row : -1;
  };
  auto issue_block = [&](int block, int32_t row) {
    const int stage = block % Cta::kStages;
    const uint32_t dst = kv_base + stage * Cta::kStageBytes + load_key * kRowBytes;
    const uint8_t* src = kv_bytes + (row >= 0 ? int64_t(row) * p.kv_stride_row * 2 : 0);
#pragma unroll
    for (int i = 0; i < kRowChunks / kLoadersPerRow; ++i) {
      const int c = load_part + kLoadersPerRow * i;
      cp_async_16_zfill(dst + ((c ^ (load_key & 7)) << 4), src + c * 16, row >= 0);
    }
    if (load_part == 0) key_valid[stage * kBlockKeys + load_key] = row >= 0;
  };

  int32_t next_row = -1;
  if (num_blocks > 0) {
    const auto* q_bytes = static_cast<const uint8_t*>(p.q);
    for (int i = tid; i < Cta::kHeads * kRowChunks; i += kThreads) {
      const int r = i / kRowChunks, c = i % kRowChunks;
      const bool ok = head0 + r < p.num_heads;
      const uint8_t* src = q_bytes + (ok ? (token * p.q_stride_token + int64_t(head0 + r) * p.q_stride_head) * 2 : 0);
      cp_async_16_zfill(q_base + r * kRowBytes + ((c ^ (r & 7)) << 4), src + c * 16, ok);
    }
    issue_block(0, read_row(0));
    cute::cp_async_fence();
    if (num_blocks > 1) next_row = read_row(1);
  }

  // ---- per-lane ldmatrix offsets -----------------------------------------------------
  // Rows of an ldmatrix phase are 8 consecutive rows starting at a multiple of 8, so the
  // swizzle term is lane % 8. For an operand whose lanes 16-31 take the second 8-lane
  // chunk, chunk 2c + lane / 16 of an octet lands at ((2c) ^ (lane / 16 ^ lane % 8)) · 16.
  const int head_tile = warp % kHeadTiles, key_group = warp / kHeadTiles;
  uint32_t swizzled_hi[4], swizzled_mid[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    swizzled_hi[c] = uint32_t((2 * c) ^ ((lane >> 4) ^ (lane & 7))) << 4;
    swizzled_mid[c] = uint32_t((2 * c) ^ (((lane >> 3) & 1) ^ (lane & 7))) << 4;
  }
  // Q·Kᵀ's A rows (this warp's head tile) and B rows (its keys).
  const uint32_t q_lane = q_base + (head_tile * 16 + (lane & 15)) * kRowBytes;
  const int warp_key0 = key_group * Cta::kWarpKeys;

  const float scale_log2 = p.softmax_scale * kLog2e;
  float out_acc[kHeadTiles][Cta::kWarpValueTiles][4] = {};
  float row_max[kHeadTiles][2];  // running max (log2 units) of rows lane / 4 (+8) of each head tile
  float row_sum[2] = {0.0f, 0.0f};  // this lane's part of its QK rows' sums
#pragma unroll
  for (int mt = 0; mt < kHeadTiles; ++mt) row_max[mt][0] = row_max[mt][1] = -INFINITY;

  for (int block = 0; block < num_blocks; ++block) {
    const int stage = block % Cta::kStages;
    cute::cp_async_wait<0>();
    __syncthreads();  // block's rows landed; everyone is past the previous block's P·V
    auto issue_next = [&] {
      if (block + 1 < num_blocks) {
        issue_block(block + 1, next_row);
        cute::cp_async_fence();
        if (block + 2 < num_blocks) next_row = read_row(block + 2);
      }
    };
    if constexpr (Cta::kStages > 1) issue_next();
    const uint32_t kv_stage = kv_base + stage * Cta::kStageBytes;

    // ---- S = Q·Kᵀ --------------------------------------------------------------------
    float score[Cta::kWarpKeyTiles][4] = {};
    if constexpr (Cta::kSplitQk) {
      // 16 heads: warp (key half g = warp / 4, lane quarter c = warp % 4) scores keys
      // [32 g, 32 g + 32) over lanes [144 c, 144 c + 144) (9 k-steps, 4 independent
      // chains); the 4 quarters' partial scores are summed through shared memory, warp w
      // keeping keys [8 w, 8 w + 8) as below. NOTE: with every warp scoring 8 keys over
      // all 576 lanes, each read all of Q: 221 KB of ldmatrix a block, ~1.2 us of a T = 1
      // CTA's ~2 us of math at shared memory's 128 B/clk (H100 timeline); split, 110 KB.
      const int half = warp / 4, quarter = warp % 4;
      const uint32_t k_lane = kv_stage + (32 * half + (lane & 7) + ((lane >> 4) << 3)) * kRowBytes;
      float partial[4][4] = {};
#pragma unroll 3
      for (int i = 0; i < 9; ++i) {
        // k is not known at compile time here: the swizzled offsets are computed, not
        // indexed (a runtime index into swizzled_hi would put it in local memory).
        const int k = 9 * quarter + i;
        const uint32_t chunk_hi = uint32_t((2 * (k % 4)) ^ ((lane >> 4) ^ (lane & 7))) << 4;
        const uint32_t chunk_mid = uint32_t((2 * (k % 4)) ^ (((lane >> 3) & 1) ^ (lane & 7))) << 4;
        uint32_t a0, a1, a2, a3;
        ldmatrix_x4(q_lane + (k / 4) * 128 + chunk_hi, a0, a1, a2, a3);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          uint32_t b0, b1, b2, b3;
          ldmatrix_x4(k_lane + j * 16 * kRowBytes + (k / 4) * 128 + chunk_mid, b0, b1, b2, b3);
          mma_bf16_16x8x16(partial[2 * j], a0, a1, a2, a3, b0, b1);
          mma_bf16_16x8x16(partial[2 * j + 1], a0, a1, a2, a3, b2, b3);
        }
      }
      float4* partials = reinterpret_cast<float4*>(smem + Cta::kPartialOffset);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        partials[(warp * 4 + j) * 32 + lane] = make_float4(partial[j][0], partial[j][1], partial[j][2], partial[j][3]);
      }
      __syncthreads();
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float4 v = partials[((4 * half + c) * 4 + quarter) * 32 + lane];
        score[0][0] += v.x;
        score[0][1] += v.y;
        score[0][2] += v.z;
        score[0][3] += v.w;
      }
    } else {
      // 32 / 64 heads (one CTA an SM, one or two stages): even and odd k-steps accumulate
      // apart, two dependent chains of 18 mmas instead of one of 36 (T = 1: -1-3%, H100).
      float score_odd[Cta::kWarpKeyTiles][4] = {};
      const uint32_t k_lane = kv_stage + (warp_key0 + (lane & 7) + ((lane >> 4) << 3)) * kRowBytes;
#pragma unroll
      for (int k = 0; k < kKSteps; ++k) {
        float(&acc)[Cta::kWarpKeyTiles][4] = k % 2 ? score_odd : score;
        uint32_t a0, a1, a2, a3;
        ldmatrix_x4(q_lane + (k / 4) * 128 + swizzled_hi[k % 4], a0, a1, a2, a3);
#pragma unroll
        for (int j = 0; j < Cta::kWarpKeys / 16; ++j) {
          uint32_t b0, b1, b2, b3;
          ldmatrix_x4(k_lane + j * 16 * kRowBytes + (k / 4) * 128 + swizzled_mid[k % 4], b0, b1, b2, b3);
          mma_bf16_16x8x16(acc[2 * j], a0, a1, a2, a3, b0, b1);
          mma_bf16_16x8x16(acc[2 * j + 1], a0, a1, a2, a3, b2, b3);
        }
      }
#pragma unroll
      for (int j = 0; j < Cta::kWarpKeyTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) score[j][e] += score_odd[j][e];
      }
    }

    // ---- masking, row max across the key groups -------------------------------------
    float tile_max[2];
    // Scores scaled in place: folding the scale into the exponent, as the wgmma kernel does,
    // spilled the one-stage 64-head CTA at 255 registers.
    mla_mask_and_row_max<Cta::kWarpKeyTiles, true>(
        &score[0][0], key_valid + stage * kBlockKeys + warp_key0 + 2 * (lane & 3), scale_log2, tile_max);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if ((lane & 3) == 0) reduce[key_group * Cta::kHeads + head_tile * 16 + lane / 4 + 8 * h] = tile_max[h];
    }
    __syncthreads();

    // Every thread derives the same new max for each row it touches (its QK rows, and all
    // head tiles for P·V) from the same values, so no second exchange is needed.
    float rescale[kHeadTiles][2];
#pragma unroll
    for (int mt = 0; mt < kHeadTiles; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float m = row_max[mt][h];
#pragma unroll
        for (int g = 0; g < Cta::kKeyGroups; ++g) m = fmaxf(m, reduce[g * Cta::kHeads + mt * 16 + lane / 4 + 8 * h]);
        // A row with no valid key yet keeps max -inf; exponents then use 0 (no inf - inf).
        rescale[mt][h] = exp2f(row_max[mt][h] - (m == -INFINITY ? 0.0f : m));
        row_max[mt][h] = m;
      }
    }

    // ---- P = exp2(S - max) to shared memory as bf16 ---------------------------------
    // (this warp's head tile picked by unrolled selects: a runtime index into the
    // register arrays would put them in local memory)
    float own_max[2], own_rescale[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      own_max[h] = row_max[0][h];
      own_rescale[h] = rescale[0][h];
#pragma unroll
      for (int mt = 1; mt < kHeadTiles; ++mt) {
        if (mt == head_tile) {
          own_max[h] = row_max[mt][h];
          own_rescale[h] = rescale[mt][h];
        }
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float m = own_max[h] == -INFINITY ? 0.0f : own_max[h];
      const int row = head_tile * 16 + lane / 4 + 8 * h;
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < Cta::kWarpKeyTiles; ++j) {
        const float p0 = mla_exp2(score[j][2 * h] - m), p1 = mla_exp2(score[j][2 * h + 1] - m);
        sum += p0 + p1;
        const __nv_bfloat162 pair = __floats2bfloat162_rn(p0, p1);
        mla_store_p_pair(p_base, row, warp_key0 + j * 8 + 2 * (lane & 3), *reinterpret_cast<const uint32_t*>(&pair));
      }
      row_sum[h] = row_sum[h] * own_rescale[h] + sum;
    }
    __syncthreads();

    // ---- O = O · rescale + P·V ------------------------------------------------------
#pragma unroll
    for (int mt = 0; mt < kHeadTiles; ++mt) {
#pragma unroll
      for (int n = 0; n < Cta::kWarpValueTiles; ++n) {
        out_acc[mt][n][0] *= rescale[mt][0];
        out_acc[mt][n][1] *= rescale[mt][0];
        out_acc[mt][n][2] *= rescale[mt][1];
        out_acc[mt][n][3] *= rescale[mt][1];
      }
    }
    // V rows (keys) for ldmatrix.trans: lanes 8-15 take keys 8-15, lanes 16-31 the next 8 lanes.
    const uint32_t v_lane = kv_stage + ((lane & 7) + (((lane >> 3) & 1) << 3)) * kRowBytes + warp * 128;
#pragma unroll
    for (int ks = 0; ks < kBlockKeys / 16; ++ks) {
      uint32_t a[kHeadTiles][4];
#pragma unroll
      for (int mt = 0; mt < kHeadTiles; ++mt) {
        ldmatrix_x4(p_base + (mt * 16 + (lane & 15)) * (kBlockKeys * 2) + swizzled_hi[ks], a[mt][0], a[mt][1],
                    a[mt][2], a[mt][3]);
      }
#pragma unroll
      for (int pair = 0; pair < Cta::kWarpValueTiles / 2; ++pair) {
        uint32_t b0, b1, b2, b3;
        ldmatrix_x4_trans(v_lane + ks * 16 * kRowBytes + swizzled_hi[pair], b0, b1, b2, b3);
#pragma unroll
        for (int mt = 0; mt < kHeadTiles; ++mt) {
          mma_bf16_16x8x16(out_acc[mt][2 * pair], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b0, b1);
          mma_bf16_16x8x16(out_acc[mt][2 * pair + 1], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b2, b3);
        }
      }
    }
    if constexpr (Cta::kStages == 1) {
      __syncthreads();  // every warp is past this block's reads of the stage
      issue_next();
    }
  }
  allow_next_kernel_launch();

  // ---- row sums across the key groups -------------------------------------------------
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 1);
    row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 2);
  }
  __syncthreads();  // the last block's maxima are read
  if ((lane & 3) == 0) {
    reduce[key_group * Cta::kHeads + head_tile * 16 + lane / 4] = row_sum[0];
    reduce[key_group * Cta::kHeads + head_tile * 16 + lane / 4 + 8] = row_sum[1];
  }
  __syncthreads();

  // ---- epilogue: warp w holds value lanes [64 w, 64 w + 64) of every head --------------
#pragma unroll
  for (int mt = 0; mt < kHeadTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = mt * 16 + lane / 4 + 8 * h;
      const int head = head0 + row;
      const bool valid = head < p.num_heads;
      float sum = 0.0f;
#pragma unroll
      for (int g = 0; g < Cta::kKeyGroups; ++g) sum += reduce[g * Cta::kHeads + row];
      const float scale =
          valid ? mla_finish_row(p, token, split, head, row_max[mt][h], sum, warp == 0 && (lane & 3) == 0) : 0.0f;
      mla_store_row<Cta::kWarpValueTiles>(p, token, split, head, valid, scale, warp * 64,
                                          [&](int n, int e) { return out_acc[mt][n][2 * h + e]; });
    }
  }
}

// acc0, acc1 += w · the two bf16 lanes of a part packed in `word`.
__device__ __forceinline__ void add_weighted_pair(float w, uint32_t word, float& acc0, float& acc1) {
  const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&word));
  acc0 = fmaf(w, v.x, acc0);
  acc1 = fmaf(w, v.y, acc1);
}

// ---- merge of the splits: one CTA per (token, head), 4 value lanes a thread -------------
// NOTE: the first merge looped over the splits with a load, a test and a dependent load
// each: ~0.3 us per split of L2 latency (T = 1, 32 splits: 16 us of a 21 us op). Then the
// weights went to shared memory once and every part was loaded unconditionally (an empty
// split's part is zeros) 8 at a time. Now up to 32 parts a thread are loaded before the
// weights are even computed: T = 1, topk 2048 went 10.6 -> 7.9 us (Hq 16), 15.6 -> 12.7
// (Hq 128) on the H100.
constexpr int kMergeThreads = kValueDim / 4;
static_assert(kMlaMaxSplits <= kMergeThreads);

// kMergeBatch: parts a thread has in flight. 32 (96 registers with bf16 parts) for many
// splits (small T: few CTAs, latency-bound); 8 (40) otherwise: at T = 64, Hq 16 (4
// splits, 1024 CTAs) the 32-part version's registers, 166 with fp32 parts, cost
// occupancy, 19.4 -> 22.0 us (H100).
template <int kMergeBatch>
__global__ void __launch_bounds__(kMergeThreads) sparse_mla_merge_kernel(const SparseMlaDecodeParams p) {
  __shared__ float split_weight[kMlaMaxSplits];
  __shared__ float warp_max[kMergeThreads / 32], warp_sum[kMergeThreads / 32];
  const int64_t token = blockIdx.x / p.num_heads;
  const int head = int(blockIdx.x % p.num_heads);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  wait_for_previous_kernel();
  const auto* partial_out = static_cast<const __nv_bfloat16*>(p.workspace);
  const float* partial_lse = mla_partial_lse(p);
  const int64_t split_stride = p.num_tokens * p.num_heads;
  const int64_t slot0 = token * p.num_heads + head;
  // The first kMergeBatch parts are loaded before the weights, which they do not need:
  // one L2 round trip for the lse and these parts together.
  const __nv_bfloat16* part = partial_out + slot0 * kValueDim + tid * 4;
  auto load_part = [&](int s) { return __ldcg(reinterpret_cast<const uint2*>(part + s * split_stride * kValueDim)); };
  uint2 values[kMergeBatch];  // 4 bf16 lanes of a part
#pragma unroll
  for (int i = 0; i < kMergeBatch; ++i) {
    if (i < p.num_splits) values[i] = load_part(i);
  }
  // Thread s holds split s's log2-sum-exp; block max, then weights 2^(lse_s - max).
  const float lse = tid < p.num_splits ? partial_lse[tid * split_stride + slot0] : -INFINITY;
  float m = lse;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  if (lane == 0) warp_max[warp] = m;
  __syncthreads();
  m = warp_max[0];
#pragma unroll
  for (int w = 1; w < kMergeThreads / 32; ++w) m = fmaxf(m, warp_max[w]);
  if (m == -INFINITY) m = 0.0f;  // no split saw a valid key: every weight is 0
  const float weight = exp2f(lse - m);
  if (tid < p.num_splits) split_weight[tid] = weight;
  float sum = weight;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) warp_sum[warp] = sum;
  __syncthreads();
  sum = 0.0f;
#pragma unroll
  for (int w = 0; w < kMergeThreads / 32; ++w) sum += warp_sum[w];

  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int s0 = 0; s0 < p.num_splits; s0 += kMergeBatch) {
    if (s0 > 0) {
#pragma unroll
      for (int i = 0; i < kMergeBatch; ++i) {
        if (s0 + i < p.num_splits) values[i] = load_part(s0 + i);
      }
    }
#pragma unroll
    for (int i = 0; i < kMergeBatch; ++i) {
      if (s0 + i < p.num_splits) {
        const float w = split_weight[s0 + i];
        add_weighted_pair(w, values[i].x, acc.x, acc.y);
        add_weighted_pair(w, values[i].y, acc.z, acc.w);
      }
    }
  }
  allow_next_kernel_launch();
  const float inv = mla_out_row_scale(p, token, head, m, sum, mla_row_lse2(m, sum), tid == 0);
  auto* out = static_cast<__nv_bfloat16*>(p.out) + token * p.out_stride_token + head * p.out_stride_head + tid * 4;
  reinterpret_cast<__nv_bfloat162*>(out)[0] = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
  reinterpret_cast<__nv_bfloat162*>(out)[1] = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
}

// ---- merge of many rows: one warp per (token, head, half of the value lanes) -----------
// Lane l takes value lanes [256 half + 8 l, +8) of the row: one 16-byte load a part. Each
// warp reduces the row's log2-sum-exps itself (lane s holds splits s and s + 32), so no
// CTA barrier sits between the loads and the sums, and 2 warps a row instead of the
// CTA-per-row kernel's 4 put twice the rows in one wave. NOTE (H100, T 64, Hq 64, 2 splits,
// 4096 rows): 26.1 -> 22.7 us (topk 512, S 8K), 34.9 -> 32.5 (S 128K) against the
// CTA-per-row kernel; with few rows (T <= 8) it was 0.1-1 us slower.
// kBatch: parts a lane loads before the weights are known (4 registers each); the
// smallest that covers the splits, for occupancy.
constexpr int kMergeRowWarps = 8;  // a CTA: 4 rows
template <int kBatch>
__global__ void __launch_bounds__(kMergeRowWarps * 32) sparse_mla_merge_rows_kernel(const SparseMlaDecodeParams p) {
  static_assert(kMlaMaxSplits <= 64, "a lane holds two splits' lse");
  const int lane = threadIdx.x % 32;
  const int64_t num_rows = p.num_tokens * p.num_heads;
  const int64_t unit = int64_t(blockIdx.x) * kMergeRowWarps + threadIdx.x / 32;
  if (unit >= 2 * num_rows) return;  // the last CTA's spare warps
  const int64_t row = unit / 2;
  const int half = int(unit % 2);
  const int64_t token = row / p.num_heads;
  const int head = int(row % p.num_heads);
  wait_for_previous_kernel();
  const int num_splits = p.num_splits;
  const auto* part = static_cast<const __nv_bfloat16*>(p.workspace) + row * kValueDim + half * 256 + lane * 8;
  const int64_t part_stride = num_rows * kValueDim;
  auto load_part = [&](int s) { return __ldcg(reinterpret_cast<const uint4*>(part + s * part_stride)); };
  uint4 values[kBatch];
#pragma unroll
  for (int i = 0; i < kBatch; ++i) {
    if (i < num_splits) values[i] = load_part(i);
  }
  const float* lse = mla_partial_lse(p) + row;
  const float lse0 = lane < num_splits ? lse[lane * num_rows] : -INFINITY;
  const float lse1 = lane + 32 < num_splits ? lse[(lane + 32) * num_rows] : -INFINITY;
  float m = fmaxf(lse0, lse1);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  if (m == -INFINITY) m = 0.0f;  // no split saw a valid key: every weight is 0
  const float weight0 = exp2f(lse0 - m), weight1 = exp2f(lse1 - m);
  float sum = weight0 + weight1;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);

  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  for (int s0 = 0; s0 < num_splits; s0 += kBatch) {
    if (s0 > 0) {
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        if (s0 + i < num_splits) values[i] = load_part(s0 + i);
      }
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int s = s0 + i;  // the same in every lane
      if (s < num_splits) {
        const float w = __shfl_sync(0xffffffffu, s < 32 ? weight0 : weight1, s % 32);
        add_weighted_pair(w, values[i].x, acc[0], acc[1]);
        add_weighted_pair(w, values[i].y, acc[2], acc[3]);
        add_weighted_pair(w, values[i].z, acc[4], acc[5]);
        add_weighted_pair(w, values[i].w, acc[6], acc[7]);
      }
    }
  }
  allow_next_kernel_launch();
  const float inv = mla_out_row_scale(p, token, head, m, sum, mla_row_lse2(m, sum), half == 0 && lane == 0);
  uint32_t out_words[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(acc[2 * j] * inv, acc[2 * j + 1] * inv);
    out_words[j] = *reinterpret_cast<const uint32_t*>(&pair);
  }
  auto* out = static_cast<__nv_bfloat16*>(p.out) + token * p.out_stride_token + head * p.out_stride_head + half * 256 +
              lane * 8;
  if (mla_out_rows_16b(p)) {
    *reinterpret_cast<uint4*>(out) = make_uint4(out_words[0], out_words[1], out_words[2], out_words[3]);
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) reinterpret_cast<uint32_t*>(out)[j] = out_words[j];
  }
}
// Where the merge CTAs land matters as much as their loads. Launched under PDL while the
// split kernel drains, they can fill the few SMs already free (as many CTAs an SM as their
// registers allow), and those SMs then pull many rows' parts: our reading of why the
// CTA-per-row kernel gained from dynamic shared memory (it reads none) that admits only
// as many CTAs an SM as its grid needs. NOTE (H100): T 1, Hq 128, topk 2048 (32 splits)
// 12.0 -> 11.3 us (S 8K), 13.3 -> 12.5 (S 128K); T 8, Hq 64, topk 512 12.8 -> 11.1 and
// 13.2 -> 11.5.
int merge_spread_smem(int64_t num_ctas) {
  const DeviceInfo& d = current_device_info();
  const int64_t ctas_per_sm = (num_ctas + d.num_sms - 1) / d.num_sms;
  // From 12 an SM on, threads and registers bound the CTAs an SM.
  if (ctas_per_sm >= 12) return 0;
  // n = ctas_per_sm CTAs of S / (n + 1) - 768 bytes (each also holds 384 B of static
  // shared memory and the 1 KB the system reserves) fit an SM of S bytes when
  // n (n + 1) <= S / 640 B (n <= 11 on an A100, S = 164 KB, and an H100, 228 KB); n + 1
  // never do.
  return std::min(int(d.smem_per_sm / (ctas_per_sm + 1)) - 768, d.max_smem_per_cta);
}

void launch_merge(const SparseMlaDecodeParams& p, cudaStream_t stream) {
  const int64_t num_rows = p.num_tokens * p.num_heads;
  const int64_t num_sms = current_device_info().num_sms;
  // More rows than the CTA-per-row kernel runs at once (2048 threads an SM).
  if (num_rows * kMergeThreads > 2048 * num_sms) {
    const int n = p.num_splits;
    auto kernel = n <= 2    ? sparse_mla_merge_rows_kernel<2>
                  : n <= 4  ? sparse_mla_merge_rows_kernel<4>
                  : n <= 8  ? sparse_mla_merge_rows_kernel<8>
                  : n <= 16 ? sparse_mla_merge_rows_kernel<16>
                            : sparse_mla_merge_rows_kernel<32>;
    const int64_t num_ctas = (2 * num_rows + kMergeRowWarps - 1) / kMergeRowWarps;
    launch_kernel(kernel, dim3(unsigned(num_ctas)), dim3(kMergeRowWarps * 32), 0, stream, p);
    return;
  }
  auto kernel = p.num_splits > 8 ? sparse_mla_merge_kernel<32> : sparse_mla_merge_kernel<8>;
  const int smem = merge_spread_smem(num_rows);
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  launch_kernel(kernel, dim3(unsigned(num_rows)), dim3(kMergeThreads), smem, stream, p);
}

int64_t max_splits_for(int64_t topk) { return std::min<int64_t>((topk + kBlockKeys - 1) / kBlockKeys, kMlaMaxSplits); }

// Splits hold whole key blocks, or whole block pairs for the wgmma kernel (`pairs`), which
// takes blocks in pairs: an odd count a split scores a masked block beside the last one.
// NOTE (H100, T 8, Hq 128, topk 2048): 7 splits of 5 blocks took 27.9 / 30.3 us (S 8K /
// 128K), 8 splits of 4 took 25.8 / 28.7.
int64_t split_units(int64_t topk, bool pairs) {
  const int64_t key_blocks = (topk + kBlockKeys - 1) / kBlockKeys;
  return pairs ? (key_blocks + 1) / 2 : key_blocks;
}
// The split count a request resolves to: whole units per split, no empty split.
int64_t resolved_splits(int64_t topk, int64_t splits, bool pairs) {
  const int64_t units = split_units(topk, pairs);
  const int64_t units_per_split = (units + splits - 1) / splits;
  return (units + units_per_split - 1) / units_per_split;
}

// Head tiles a CTA takes: the fewest 16-head tiles that cover Hq (at most 4), fewer when
// even one key block a split would leave most SMs idle (T = 1, 2): smaller head groups
// multiply the CTAs, and the groups after the first read their kv rows from L2.
int head_tiles_for(int64_t num_tokens, int64_t num_heads, int64_t topk) {
  int tiles = num_heads <= 16 ? 1 : (num_heads <= 32 ? 2 : 4);
  const int64_t num_sms = current_device_info().num_sms;
  while (tiles > 1 && 2 * num_tokens * ((num_heads + 16 * tiles - 1) / (16 * tiles)) * max_splits_for(topk) < num_sms) {
    tiles /= 2;
  }
  return tiles;
}

// 16-head CTAs take one kv stage, two an SM, when even the largest split count gives
// two CTAs an SM. NOTE: with fewer (T = 1 or 8 at Hq 16), one stage at one CTA an SM or
// more splits to fill two were slower than the two-stage ring (H100: T 8, topk 2048:
// 16.8 against 14.6 us); with enough, one stage gained 10-35% (T 64 and 256).
bool single_stage_for(int head_tiles, int64_t num_tokens, int64_t num_heads, int64_t topk) {
  return head_tiles == 1 &&
         num_tokens * ((num_heads + 15) / 16) * max_splits_for(topk) >= 2 * int64_t(current_device_info().num_sms);
}

// fn(MlaCta<head_tiles, single_stage ? 1 : 2>{}): the one place a plan's numbers pick a
// CTA type (its shared memory, its CTAs an SM, its kernel).
template <class Fn>
decltype(auto) with_mla_cta(int head_tiles, bool single_stage, Fn&& fn) {
  switch (head_tiles) {
    case 1: return single_stage ? fn(MlaCta<1, 1>{}) : fn(MlaCta<1>{});
    case 2: return single_stage ? fn(MlaCta<2, 1>{}) : fn(MlaCta<2>{});
    default: return single_stage ? fn(MlaCta<4, 1>{}) : fn(MlaCta<4>{});
  }
}
int smem_bytes_for(int head_tiles, bool single_stage) {
  return with_mla_cta(head_tiles, single_stage, [](auto cta) { return decltype(cta)::kSmemBytes; });
}

// The kernel a call runs: one decision for the split heuristic and the launch.
struct MlaPlan {
  int head_tiles;     // 16-head mma tiles a CTA takes (4: 64 heads)
  bool sm90;          // the wgmma kernel (64-head groups, sm_90a build and device)
  bool single_stage;  // the one-stage mma.sync CTA
  int smem_bytes;     // of the kernel's CTA
  int ctas_per_sm;    // the CTAs an SM holds at once
};
MlaPlan plan_for(int64_t num_tokens, int64_t num_heads, int64_t topk) {
  const DeviceInfo& device = current_device_info();
  const int smem_limit = cta_smem_limit(device);
  MlaPlan plan;
  plan.head_tiles = head_tiles_for(num_tokens, num_heads, topk);
  plan.sm90 = plan.head_tiles * 16 == kMlaSm90Heads && sm90_kernels_available(device) &&
              sparse_mla_decode_sm90_smem_bytes() <= smem_limit;
  plan.single_stage = single_stage_for(plan.head_tiles, num_tokens, num_heads, topk);
  if (!plan.sm90) {
    // A part whose CTA cannot have the two-stage ring (A100: 163 KB) takes one stage, the
    // same head group; fewer heads only where even that does not fit.
    if (smem_bytes_for(plan.head_tiles, plan.single_stage) > smem_limit) plan.single_stage = true;
    while (plan.head_tiles > 1 && smem_bytes_for(plan.head_tiles, true) > smem_limit) plan.head_tiles /= 2;
    if (smem_bytes_for(plan.head_tiles, plan.single_stage) > smem_limit) {
      throw Error("moelora.sparse_mla_decode: the CUDA kernels need " +
                  std::to_string(smem_bytes_for(1, true)) + " bytes of shared memory a CTA; this device (" +
                  device.name + ") allows " + std::to_string(smem_limit));
    }
  }
  plan.smem_bytes = plan.sm90 ? sparse_mla_decode_sm90_smem_bytes() : smem_bytes_for(plan.head_tiles, plan.single_stage);
  // The kernel's CTAs an SM (its launch bounds), as the SM's shared memory allows.
  const auto ctas_per_sm_of = [](auto cta) { return decltype(cta)::kCtasPerSm; };
  const int kernel_ctas_per_sm = plan.sm90 ? 1 : with_mla_cta(plan.head_tiles, plan.single_stage, ctas_per_sm_of);
  plan.ctas_per_sm = std::clamp(sm_smem_limit(device) / (plan.smem_bytes + 1024), 1, kernel_ctas_per_sm);
  return plan;
}

template <class Cta>
void launch_splits(const SparseMlaDecodeParams& p, int num_head_groups, int blocks_per_split, cudaStream_t stream) {
  auto kernel = sparse_mla_decode_kernel<Cta::kHeadTiles, Cta::kStages>;
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cta::kSmemBytes));
  const int64_t num_ctas = p.num_tokens * num_head_groups * p.num_splits;
  launch_kernel(kernel, dim3(unsigned(num_ctas)), dim3(kThreads), Cta::kSmemBytes, stream, p, num_head_groups,
                blocks_per_split);
}

}  // namespace

int sparse_mla_decode_num_splits(int64_t num_tokens, int64_t num_heads, int64_t topk, int requested) {
  const int64_t max_splits = max_splits_for(topk);
  const MlaPlan plan = plan_for(std::max<int64_t>(num_tokens, 1), num_heads, topk);
  if (requested > 0) return int(resolved_splits(topk, std::min<int64_t>(requested, max_splits), plan.sm90));
  if (num_tokens <= 0) return 1;
  // Fill the device in whole waves: the smallest split count whose last wave keeps >= 80%
  // of the CTA slots busy, else the one that keeps the most busy.
  const int64_t slots = int64_t(current_device_info().num_sms) * plan.ctas_per_sm;
  const int64_t base = num_tokens * ((num_heads + 16 * plan.head_tiles - 1) / (16 * plan.head_tiles));
  int64_t splits = 1;
  double best = 0.0;
  for (int64_t s = 1; s <= max_splits; ++s) {
    const int64_t ctas = base * resolved_splits(topk, s, plan.sm90);
    const double busy = double(ctas) / double((ctas + slots - 1) / slots * slots);
    if (busy > best + 1e-9) {
      best = busy;
      splits = resolved_splits(topk, s, plan.sm90);
    }
    if (busy >= 0.8) break;
  }
  return int(splits);
}

int64_t sparse_mla_decode_workspace_bytes(int64_t num_tokens, int64_t num_heads, int num_splits) {
  if (num_splits <= 1) return 0;
  return mla_partial_out_bytes(num_tokens, num_heads, num_splits) +
         (int64_t(num_splits) * num_tokens * num_heads * 4 + 255) / 256 * 256;
}

void sparse_mla_decode(const SparseMlaDecodeParams& p, Stream stream) {
  if (p.num_tokens == 0) return;
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  const MlaPlan plan = plan_for(p.num_tokens, p.num_heads, p.topk);
  const int num_head_groups = int((p.num_heads + 16 * plan.head_tiles - 1) / (16 * plan.head_tiles));
  const int64_t units = split_units(p.topk, plan.sm90);
  const int blocks_per_split = int((units + p.num_splits - 1) / p.num_splits) * (plan.sm90 ? 2 : 1);
  if (p.num_tokens * num_head_groups * p.num_splits > INT32_MAX) {
    throw std::runtime_error("moelora.sparse_mla_decode: too many tokens for one grid");
  }
  if (plan.sm90) {
    sparse_mla_decode_sm90(p, num_head_groups, blocks_per_split, cuda_stream);
  } else {
    with_mla_cta(plan.head_tiles, plan.single_stage, [&](auto cta) {
      launch_splits<decltype(cta)>(p, num_head_groups, blocks_per_split, cuda_stream);
    });
  }
  if (p.num_splits > 1) launch_merge(p, cuda_stream);
}

}  // namespace moelora::cuda
