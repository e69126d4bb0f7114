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

// The partial outputs of the splits: [num_splits, T, Hq, 512] fp32, then their
// log2-sum-exps [num_splits, T, Hq] fp32 at a 256-byte boundary. Every split writes both
// for every head, zeros and -inf when it saw no valid key: the merge reads them all.
__host__ __device__ inline int64_t mla_partial_out_bytes(int64_t num_tokens, int64_t num_heads, int num_splits) {
  return (int64_t(num_splits) * num_tokens * num_heads * kMlaValueLanes * 4 + 255) / 256 * 256;
}

__device__ __forceinline__ float* mla_partial_lse(const detail::SparseMlaDecodeParams& p) {
  return reinterpret_cast<float*>(static_cast<uint8_t*>(p.workspace) +
                                  mla_partial_out_bytes(p.num_tokens, p.num_heads, p.num_splits));
}

// Scores of a warp in the mma accumulator layout to log2 units, invalid keys to -inf, and
// the max of each of the thread's two rows over its quad (the 4 lanes that hold a row).
// score[4j + 2h + e]: row h (lane / 4, + 8), key 8j + 2 (lane % 4) + e, whose flag the
// caller passes at valid[8j + e].
template <int kKeyTiles>
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
        s = ok ? s * scale_log2 : -INFINITY;
        row_max[h] = fmaxf(row_max[h], s);
      }
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 1));
    row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 2));
  }
}

// The end of one (token, head) row of a split: where its values go (bf16 out with one
// split, else the split's fp32 part) and the factor they take; writes the row's lse when
// asked (one split: out's natural-log lse, the sink only in the denominator; splits: the
// part's log2-sum-exp, -inf when it saw no valid key: the merge reads every part).
struct MlaRowEnd {
  float scale;
  void* row;
};
__device__ __forceinline__ MlaRowEnd mla_finish_row(const detail::SparseMlaDecodeParams& p, int64_t token, int split,
                                                    int head, float row_max, float sum, bool write_lse) {
  const float m = row_max == -INFINITY ? 0.0f : row_max;
  const float lse2 = sum > 0.0f ? m + log2f(sum) : -INFINITY;  // of the row's scaled logits
  MlaRowEnd end;
  if (p.num_splits == 1) {
    float denominator = sum;
    if (p.attn_sink) denominator += exp2f(p.attn_sink[head * p.attn_sink_stride] * kMlaLog2e - m);
    // no valid key: the accumulator is 0 and so is the output (also under a sink)
    end.scale = denominator > 0.0f ? 1.0f / denominator : 0.0f;
    end.row = static_cast<__nv_bfloat16*>(p.out) + token * p.out_stride_token + head * p.out_stride_head;
    if (write_lse && p.lse) p.lse[token * p.lse_stride_token + head * p.lse_stride_head] = lse2 * kMlaLn2;
  } else {
    end.scale = sum > 0.0f ? 1.0f / sum : 0.0f;
    const int64_t slot = (int64_t(split) * p.num_tokens + token) * p.num_heads + head;
    end.row = static_cast<float*>(p.workspace) + slot * kMlaValueLanes;
    if (write_lse) mla_partial_lse(p)[slot] = lse2;
  }
  return end;
}
// Value lanes col, col + 1 of a finished row.
__device__ __forceinline__ void mla_store_pair(const detail::SparseMlaDecodeParams& p, const MlaRowEnd& end, int col,
                                               float v0, float v1) {
  if (p.num_splits == 1) {
    *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(end.row) + col) =
        __floats2bfloat162_rn(v0 * end.scale, v1 * end.scale);
  } else {
    *reinterpret_cast<float2*>(static_cast<float*>(end.row) + col) = make_float2(v0 * end.scale, v1 * end.scale);
  }
}

// The wgmma kernel (sm_90a builds on compute capability 9.0): 64 heads a CTA, the same
// grid order (token, split, head group), workspace and merge as the mma.sync kernel.
void sparse_mla_decode_sm90(const detail::SparseMlaDecodeParams& p, int num_head_groups, int blocks_per_split,
                            cudaStream_t stream);
constexpr int kMlaSm90Heads = 64;

}  // namespace moelora::cuda
