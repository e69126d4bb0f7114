// moe_sum_reduce on CUDA: [tokens, top_k, H] -> [tokens, H], fp32 sum in slot order
// (deterministic), scaled; or, for fused_experts' grouped path, each slot's row found by
// entry and weighted. Memory-bound: 16-byte accesses when aligned.
#include <algorithm>

#include "common/params.h"
#include "cuda/cuda_check.h"
#include "cuda/launch.cuh"
#include "cuda/numeric.cuh"

namespace moelora::cuda {
namespace {

using detail::SumReduceParams;

// Grid: (column groups, tokens). One thread sums kVec consecutive columns over top_k.
template <typename T, int kVec>
__global__ void moe_sum_reduce_kernel(const SumReduceParams p) {
  const int64_t token = blockIdx.y;
  const int64_t col = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kVec;
  wait_for_previous_kernel();
  if (col >= p.hidden) return;
  const T* in = static_cast<const T*>(p.input) + token * p.input_stride_token + col;
  float acc[kVec] = {};
  for (int64_t j = 0; j < p.top_k; ++j) {
    // Rows by slot, or (the grouped path) by entry with the routed weight.
    const T* row = in + j * p.input_stride_k;
    float weight = 1.f;
    if (p.slot_entries) {
      const int32_t entry = p.slot_entries[token * p.top_k + j];
      if (entry < 0) continue;
      row = static_cast<const T*>(p.input) + entry * p.input_stride_k + col;
      weight = p.topk_weights[token * p.topk_weights_stride_token + j * p.topk_weights_stride_k];
    }
    T v[kVec];
    if constexpr (kVec > 1) {
      *reinterpret_cast<Vec16<T>*>(v) = *reinterpret_cast<const Vec16<T>*>(row);
    } else {
      v[0] = row[0];
    }
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[i] += weight * to_float(v[i]);
  }
  T result[kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) result[i] = from_float<T>(acc[i] * p.scale);
  T* out = static_cast<T*>(p.out) + token * p.out_stride_token + col;
  if constexpr (kVec > 1) {
    *reinterpret_cast<Vec16<T>*>(out) = *reinterpret_cast<const Vec16<T>*>(result);
  } else {
    out[0] = result[0];
  }
}

template <typename T>
void launch(const SumReduceParams& p, cudaStream_t stream) {
  constexpr int kVec = Vec16<T>::kSize;
  const bool vectorize = p.hidden % kVec == 0 && aligned16(p.input) && aligned16(p.out) &&
                         (p.input_stride_token * sizeof(T)) % 16 == 0 && (p.input_stride_k * sizeof(T)) % 16 == 0 &&
                         (p.out_stride_token * sizeof(T)) % 16 == 0;
  constexpr int kThreads = 128;
  for (int64_t token0 = 0; token0 < p.num_tokens; token0 += 65535) {
    SumReduceParams chunk = p;
    chunk.num_tokens = std::min<int64_t>(65535, p.num_tokens - token0);
    if (p.slot_entries) {
      chunk.slot_entries = p.slot_entries + token0 * p.top_k;
      chunk.topk_weights = p.topk_weights + token0 * p.topk_weights_stride_token;
    } else {
      chunk.input = static_cast<const T*>(p.input) + token0 * p.input_stride_token;
    }
    chunk.out = static_cast<T*>(p.out) + token0 * p.out_stride_token;
    const int vec = vectorize ? kVec : 1;
    const dim3 grid(unsigned((p.hidden + int64_t(kThreads) * vec - 1) / (int64_t(kThreads) * vec)), unsigned(chunk.num_tokens));
    launch_kernel(vectorize ? moe_sum_reduce_kernel<T, kVec> : moe_sum_reduce_kernel<T, 1>, grid, dim3(kThreads), 0,
                  stream, chunk);
  }
}

}  // namespace

void moe_sum_reduce(const SumReduceParams& p, Stream stream) {
  if (p.num_tokens == 0 || p.hidden == 0) return;
  dispatch_float(p.dtype, [&](auto t) { launch<decltype(t)>(p, static_cast<cudaStream_t>(stream)); });
}

}  // namespace moelora::cuda
