// moe_sum_reduce on CUDA: [tokens, top_k, H] -> [tokens, H], fp32 sum in slot order
// (deterministic), scaled; or, for fused_experts' grouped path, each slot's row found by
// entry and weighted. Memory-bound: 16-byte accesses when aligned.
#include <algorithm>

#include "common/params.h"
#include "cuda/cuda_check.h"
#include "cuda/device_info.h"
#include "cuda/launch.cuh"
#include "cuda/numeric.cuh"

namespace moelora::cuda {
namespace {

using detail::SumReduceParams;

// Slots a thread of the batched kernel takes at once: their entries (and weights) loaded
// together, then their rows together.
// NOTE: one slot at a time (the other kernel), a thread's row loads go one after another (the
// compiler issues each after the last one's sum: sm_90a SASS), top_k L2 round trips in series
// (and twice that by entry); at small M few warps hide them: one more sum launch cost 1.5-3.7 us
// of the layer at M = 16-64 (H200, 5e60aaa, docs/wip/issue31-exposed.sh). At large M other warps
// do: batched, Qwen3-30B M = 1024's sum stayed at 13.6 us and DeepSeek-V3's went 36.3 -> 39.8
// (126 registers a thread against 34; H200, forty-ninth session). Hence sum_batched.
constexpr int kSlotBatch = 8;
// The batched kernel where the grid holds at most this many CTAs an SM.
constexpr int64_t kBatchedMaxCtasPerSm = 4;

// Adds slot j0 + b's row (b < batch) of `token` into acc, kSlotBatch slots at a time.
template <typename T, int kVec>
__device__ __forceinline__ void add_slot_batch(const SumReduceParams& p, int64_t token, int64_t col, int64_t j0,
                                               int batch, float (&acc)[kVec]) {
  const T* rows[kSlotBatch];  // null: no row (past the batch, or a slot without an entry)
  float weights[kSlotBatch];
  if (p.slot_entries) {
    int32_t entries[kSlotBatch];
#pragma unroll
    for (int b = 0; b < kSlotBatch; ++b) {
      entries[b] = b < batch ? p.slot_entries[token * p.top_k + j0 + b] : -1;
      weights[b] = b < batch ? p.topk_weights[token * p.topk_weights_stride_token + (j0 + b) * p.topk_weights_stride_k]
                             : 0.f;
    }
#pragma unroll
    for (int b = 0; b < kSlotBatch; ++b) {
      rows[b] = entries[b] >= 0 ? static_cast<const T*>(p.input) + entries[b] * p.input_stride_k + col : nullptr;
    }
  } else {
    const T* in = static_cast<const T*>(p.input) + token * p.input_stride_token + col;
#pragma unroll
    for (int b = 0; b < kSlotBatch; ++b) {
      rows[b] = b < batch ? in + (j0 + b) * p.input_stride_k : nullptr;
      weights[b] = 1.f;
    }
  }
  T v[kSlotBatch][kVec];
#pragma unroll
  for (int b = 0; b < kSlotBatch; ++b) {
    if (rows[b] == nullptr) continue;
    if constexpr (kVec > 1) {
      *reinterpret_cast<Vec16<T>*>(v[b]) = *reinterpret_cast<const Vec16<T>*>(rows[b]);
    } else {
      v[b][0] = rows[b][0];
    }
  }
#pragma unroll
  for (int b = 0; b < kSlotBatch; ++b) {  // in slot order: the sum does not depend on the batching
    if (rows[b] == nullptr) continue;
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[i] += weights[b] * to_float(v[b][i]);
  }
}

// Grid: (column groups, tokens). One thread sums kVec consecutive columns over top_k, in slot
// order; kBatched: kSlotBatch slots' loads at a time (add_slot_batch).
template <typename T, int kVec, bool kBatched>
__global__ void moe_sum_reduce_kernel(const SumReduceParams p) {
  const int64_t token = blockIdx.y;
  const int64_t col = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kVec;
  wait_for_previous_kernel();
  if (col >= p.hidden) return;
  float acc[kVec] = {};
  if constexpr (kBatched) {
    for (int64_t j0 = 0; j0 < p.top_k; j0 += kSlotBatch) {
      add_slot_batch<T, kVec>(p, token, col, j0, int(std::min<int64_t>(p.top_k - j0, kSlotBatch)), acc);
    }
  } else {
    const T* in = static_cast<const T*>(p.input) + token * p.input_stride_token + col;
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

// Whether a grid of `ctas` CTAs takes the batched kernel (sum_batched_use()).
bool sum_batched(int64_t ctas) {
  switch (sum_batched_use()) {
    case SumBatchedUse::kNever: return false;
    case SumBatchedUse::kAlways: return true;
    default: return ctas <= kBatchedMaxCtasPerSm * current_device_info().num_sms;
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
    const bool batched = sum_batched(int64_t(grid.x) * grid.y);
    const auto kernel = vectorize ? (batched ? moe_sum_reduce_kernel<T, kVec, true> : moe_sum_reduce_kernel<T, kVec, false>)
                                  : (batched ? moe_sum_reduce_kernel<T, 1, true> : moe_sum_reduce_kernel<T, 1, false>);
    launch_kernel(kernel, grid, dim3(kThreads), 0, stream, chunk);
  }
}

}  // namespace

void moe_sum_reduce(const SumReduceParams& p, Stream stream) {
  if (p.num_tokens == 0 || p.hidden == 0) return;
  dispatch_float(p.dtype, [&](auto t) { launch<decltype(t)>(p, static_cast<cudaStream_t>(stream)); });
}

}  // namespace moelora::cuda
