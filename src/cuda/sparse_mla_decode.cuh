// What the two sparse_mla_decode kernels (mma.sync in sparse_mla_decode.cu, wgmma in
// sparse_mla_decode_sm90.cu) share: the shapes, the split bookkeeping and the workspace
// layout the merge kernel reads.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/params.h"

namespace moelora::cuda {

constexpr int kMlaHeadLanes = int(kMlaHeadDim);    // 576: 512 latent + 64 rope lanes
constexpr int kMlaValueLanes = int(kMlaValueDim);  // 512: V is the first 512 lanes of a kv row
constexpr int kMlaBlockKeys = 64;                  // gathered kv rows a pipeline stage holds
constexpr float kMlaLog2e = 1.4426950408889634f;
constexpr float kMlaLn2 = 0.6931471805599453f;

// The token's valid index count: topk_length clamped to [0, topk], else topk.
__device__ __forceinline__ int64_t mla_clamped_length(const detail::SparseMlaDecodeParams& p, int64_t token) {
  if (!p.topk_length) return p.topk;
  const int64_t length = p.topk_length[token * p.topk_length_stride];
  return length < 0 ? 0 : (length > p.topk ? p.topk : length);
}

// One work item: a token, a group of its heads and one split of its indices. Item order:
// the items of a token are adjacent (they gather the same rows: L2 hits), its splits in
// order, head groups fastest. The mma.sync kernel's CTA b takes item b; the wgmma
// kernel's persistent CTAs take items b, b + gridDim.x, ...
struct MlaCtaWork {
  int64_t token;
  int split;
  int head0;               // first head of the item's group
  int64_t begin, end;      // the split's index positions [begin, end), within topk_length
  int num_blocks;          // kMlaBlockKeys-row blocks in [begin, end)
};
// Reads topk_length: call after wait_for_previous_kernel().
// Items are < 2^31 (the launcher checks): 32-bit division, at the start of every CTA.
__device__ __forceinline__ MlaCtaWork mla_cta_work(const detail::SparseMlaDecodeParams& p, int num_head_groups,
                                                   int heads_per_group, int blocks_per_split, int item) {
  MlaCtaWork w;
  const int items_per_token = num_head_groups * p.num_splits;
  w.token = item / items_per_token;
  w.split = item % items_per_token / num_head_groups;
  w.head0 = item % num_head_groups * heads_per_group;
  w.begin = int64_t(w.split) * blocks_per_split * kMlaBlockKeys;
  const int64_t split_end = w.begin + int64_t(blocks_per_split) * kMlaBlockKeys;
  const int64_t length = mla_clamped_length(p, w.token);
  w.end = split_end < length ? split_end : length;
  w.num_blocks = w.end > w.begin ? int((w.end - w.begin + kMlaBlockKeys - 1) / kMlaBlockKeys) : 0;
  return w;
}

// P's bf16 pair (key, key + 1) of `row` into a [rows, 64 keys] bf16 tile of 128-byte rows
// whose 16-byte chunk c sits at (c ^ row % 8): the swizzle both kernels read P back with
// (ldmatrix rows, and the wgmma 128-byte swizzle), conflict-free.
__device__ __forceinline__ void mla_store_p_pair(uint32_t tile, int row, int key, uint32_t pair) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(tile + row * 128 + (((key >> 3) ^ (row & 7)) << 4) + (key & 7) * 2),
               "r"(pair));
}
static_assert(kMlaBlockKeys * 2 == 128, "a P row is one 128-byte swizzle row");

// The partial outputs of the splits: [num_splits, T, Hq, 512] bf16 (each normalised by
// its own sum, so a convex combination of V rows: bf16 like out, as FlashInfer's split-kv
// partial outputs; the merge sums them in fp32), then their log2-sum-exps [num_splits, T,
// Hq] fp32 at a 256-byte boundary. Every split writes both for every head, zeros and -inf
// when it saw no valid key: the merge reads them all. NOTE (H100): with fp32 parts their
// round trip was the larger part of a T = 1, Hq 128 call (8 MB at 32 splits).
__host__ __device__ inline int64_t mla_partial_out_bytes(int64_t num_tokens, int64_t num_heads, int num_splits) {
  return (int64_t(num_splits) * num_tokens * num_heads * kMlaValueLanes * 2 + 255) / 256 * 256;
}

// A (split, token, head) row's index in both.
__device__ __forceinline__ int64_t mla_part_slot(const detail::SparseMlaDecodeParams& p, int64_t token, int split,
                                                 int head) {
  return (int64_t(split) * p.num_tokens + token) * p.num_heads + head;
}
__device__ __forceinline__ float* mla_partial_lse(const detail::SparseMlaDecodeParams& p) {
  return reinterpret_cast<float*>(static_cast<uint8_t*>(p.workspace) +
                                  mla_partial_out_bytes(p.num_tokens, p.num_heads, p.num_splits));
}

// Scores of a warp in the mma accumulator layout: invalid keys to -inf, and the max of each
// of the thread's two rows over its quad (the 4 lanes that hold a row) in log2 units.
// kScaleScores: the scores too go to log2 units (P = mla_exp2(score - max)); else they
// stay unscaled and P = mla_exp2(fmaf(score, scale_log2, -max)) folds the scale into the
// exponent's one FFMA (scale_log2 > 0, so the max commutes with it; the API checks).
// score[4j + 2h + e]: row h (lane / 4, + 8), key 8j + 2 (lane % 4) + e, whose flag the
// caller passes at valid[8j + e].
template <int kKeyTiles, bool kScaleScores>
__device__ __forceinline__ void mla_mask_and_row_max(float* score, const uint8_t* valid, float scale_log2,
                                                     float (&row_max)[2]) {
  row_max[0] = row_max[1] = -INFINITY;
#pragma unroll
  for (int j = 0; j < kKeyTiles; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const bool ok = valid[8 * j + e];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float& s = score[4 * j + 2 * h + e];
        s = ok ? (kScaleScores ? s * scale_log2 : s) : -INFINITY;
        row_max[h] = fmaxf(row_max[h], s);
      }
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 1));
    row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 2));
    if (!kScaleScores) row_max[h] *= scale_log2;
  }
}

// 2^x of a softmax weight: the SFU's approximation with denormals flushed to zero. exp2f
// wraps it in a three-instruction fix-up for x < -126 (FSETP and two predicated FMULs)
// that P never needs: such weights are zero in bf16 and in the fp32 sums. Every score
// goes through it once. 2^-inf = 0 (a masked key).
__device__ __forceinline__ float mla_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The log2-sum-exp of a row whose reference max is m (log2 units) and whose
// sum = Σ 2^(logit - m); -inf when it saw no valid key.
__device__ __forceinline__ float mla_row_lse2(float m, float sum) { return sum > 0.0f ? m + log2f(sum) : -INFINITY; }

// A finished row of out, from one pass or from the merge of the splits: its factor
// 1 / (sum + sink) (m: the row's reference max, 0 when it saw no valid key; lse2:
// mla_row_lse2), and out's natural-log lse when asked (the sink only in the denominator).
// No valid key: the values are 0 and so is the output, also under a sink.
__device__ __forceinline__ float mla_out_row_scale(const detail::SparseMlaDecodeParams& p, int64_t token, int head,
                                                   float m, float sum, float lse2, bool write_lse) {
  float denominator = sum;
  if (p.attn_sink) denominator += exp2f(p.attn_sink[head * p.attn_sink_stride] * kMlaLog2e - m);
  if (write_lse && p.lse) p.lse[token * p.lse_stride_token + head * p.lse_stride_head] = lse2 * kMlaLn2;
  return denominator > 0.0f ? 1.0f / denominator : 0.0f;
}

// The end of one (token, head) row of a split: the factor its values take (one split:
// mla_out_row_scale; splits: 1 / sum, the part is normalised), and with splits the part's
// log2-sum-exp when asked (-inf when it saw no valid key: the merge reads every part).
__device__ __forceinline__ float mla_finish_row(const detail::SparseMlaDecodeParams& p, int64_t token, int split,
                                                int head, float row_max, float sum, bool write_lse) {
  const float m = row_max == -INFINITY ? 0.0f : row_max;
  const float lse2 = mla_row_lse2(m, sum);
  if (p.num_splits == 1) return mla_out_row_scale(p, token, head, m, sum, lse2, write_lse);
  if (write_lse) mla_partial_lse(p)[mla_part_slot(p, token, split, head)] = lse2;
  return sum > 0.0f ? 1.0f / sum : 0.0f;
}

// ---- storing finished rows ------------------------------------------------------------
// Rows of out (one split) and of the parts (splits) are bf16 and go straight from the
// accumulator layout, where a row's values (col 8n + 2q, +1) sit in thread q of the row's
// quad; that would store half sectors, so mla_store_out_group first transposes the quad's
// values.
__device__ __forceinline__ __nv_bfloat16* mla_part_row(const detail::SparseMlaDecodeParams& p, int64_t token,
                                                       int split, int head) {
  return static_cast<__nv_bfloat16*>(p.workspace) + mla_part_slot(p, token, split, head) * kMlaValueLanes;
}
// True when every out row starts on 16 bytes (else they are 4-byte aligned, ArgCheck).
__device__ __forceinline__ bool mla_out_rows_16b(const detail::SparseMlaDecodeParams& p) {
  return ((reinterpret_cast<uintptr_t>(p.out) | uintptr_t(p.out_stride_token * 2) | uintptr_t(p.out_stride_head * 2)) %
          16) == 0;
}
// 32 value lanes [col0, col0 + 32) of one out row, from its quad: v[2j], v[2j + 1] are this
// thread's values (col0 + 8j + 2q, +1), already scaled. A 4x4 transpose across the quad
// (two shuffle rounds) gives thread q lanes [col0 + 8q, col0 + 8q + 8), one 16-byte store;
// a warp's store then covers 8 rows x 64 B of whole sectors. NOTE (H100): the 4-byte
// stores of the accumulator layout took the wgmma kernel's epilogue ~6 us a CTA
// (globaltimer), a sixth of a topk 512 CTA.
// Every lane of the warp calls it (shuffles); `store` masks rows past Hq.
__device__ __forceinline__ void mla_store_out_group(__nv_bfloat16* row, int col0, const float (&v)[8], bool wide,
                                                    bool store) {
  const int q = threadIdx.x % 4;
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(v[2 * j], v[2 * j + 1]);
    w[j] = *reinterpret_cast<const uint32_t*>(&pair);
  }
  if (!wide) {
    if (store) {
#pragma unroll
      for (int j = 0; j < 4; ++j) *reinterpret_cast<uint32_t*>(row + col0 + 8 * j + 2 * q) = w[j];
    }
    return;
  }
#pragma unroll
  for (int k = 1; k <= 2; k *= 2) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (j & k) continue;
      // pairs (j, j | k): the lower thread of the k-pair sends w[j | k], the upper w[j]
      const bool upper = q & k;
      const uint32_t received = __shfl_xor_sync(0xffffffffu, upper ? w[j] : w[j | k], k);
      if (upper) {
        w[j] = received;
      } else {
        w[j | k] = received;
      }
    }
  }
  if (store) *reinterpret_cast<uint4*>(row + col0 + 8 * q) = make_uint4(w[0], w[1], w[2], w[3]);
}

// One finished (token, head) row of a thread's accumulators: kTiles 8-lane tiles from
// value lane col0, this thread's pair of tile n being value(n, 0), value(n, 1) (lanes
// col0 + 8n + 2q, +1), times `scale`. To the split's part, or to out, through
// mla_store_out_group. Every lane of the warp calls it; `valid` masks rows past Hq.
template <int kTiles, class Value>
__device__ __forceinline__ void mla_store_row(const detail::SparseMlaDecodeParams& p, int64_t token, int split,
                                              int head, bool valid, float scale, int col0, Value value) {
  static_assert(kTiles % 4 == 0, "the stores take 4 tiles a quad transpose");
  const int row_head = valid ? head : 0;
  // part rows are 1 KB apart from a 256-byte boundary: always 16-byte stores
  const bool split_part = p.num_splits > 1;
  const bool wide = split_part || mla_out_rows_16b(p);
  __nv_bfloat16* out_row = split_part ? mla_part_row(p, token, split, row_head)
                                      : static_cast<__nv_bfloat16*>(p.out) + token * p.out_stride_token +
                                            int64_t(row_head) * p.out_stride_head;
#pragma unroll
  for (int m = 0; m < kTiles / 4; ++m) {
    float v[8];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      v[2 * j] = value(4 * m + j, 0) * scale;
      v[2 * j + 1] = value(4 * m + j, 1) * scale;
    }
    mla_store_out_group(out_row, col0 + 32 * m, v, wide, valid);
  }
}

// The wgmma kernel (sm_90a builds on compute capability 9.0): 64 heads a CTA, the same
// grid order (token, split, head group), workspace and merge as the mma.sync kernel.
void sparse_mla_decode_sm90(const detail::SparseMlaDecodeParams& p, int num_head_groups, int blocks_per_split,
                            cudaStream_t stream);
int sparse_mla_decode_sm90_smem_bytes();
constexpr int kMlaSm90Heads = 64;

}  // namespace moelora::cuda
