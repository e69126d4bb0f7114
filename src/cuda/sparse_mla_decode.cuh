// What the two sparse_mla_decode kernels (mma.sync in sparse_mla_decode.cu, wgmma in
// sparse_mla_decode_sm90.cu) share: the shapes, the split bookkeeping and the workspace
// layout the merge kernel reads.
#pragma once

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

// The wgmma kernel (sm_90a builds on compute capability 9.0): 64 heads a CTA, the same
// grid order (token, split, head group), workspace and merge as the mma.sync kernel.
void sparse_mla_decode_sm90(const detail::SparseMlaDecodeParams& p, int num_head_groups, int blocks_per_split,
                            cudaStream_t stream);
constexpr int kMlaSm90Heads = 64;

}  // namespace moelora::cuda
