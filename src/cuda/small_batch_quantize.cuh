// The W8A8 small-batch kernels' own quantization of their inputs
// (SmallBatchMoeParams::fused_quantize_x / fused_quantize_act): each CTA quantizes every
// row its MMAs read (x's tokens in GEMM1, act's slots in GEMM2) into shared memory, by the
// rules of cuda/quantize.cuh, so the values and scales are the quantize op's bit for bit,
// instead of a quantize launch before each GEMM.
// NOTE: at decode the two launches cost more than their work (Qwen3-30B fp8_block M = 1:
// 4 us each in ncu of a 28.5 us layer, for 2K and 6K elements); every CTA repeating the
// work pays only for at most kSmallBatchFusedQuantizeElements elements, one 16-byte load
// a thread and round, every round's load in flight before the first use.
#pragma once

#include <type_traits>

#include "common/params.h"
#include "cuda/numeric.cuh"
#include "cuda/quantize.cuh"

namespace moelora::cuda::small_batch {

constexpr int kQuantizeChunk = 8;  // elements of one 16-byte load of the 16-bit input

// Bytes between the quantized rows in shared memory: a multiple of 128 plus 64, so the 8
// vectors of an MMA step (64 bytes each, lanes (g, q) at row g) fall on alternating halves
// of the banks: 4 wavefronts a step, not 8.
__host__ __device__ constexpr int64_t fused_quantize_row_stride(int64_t width) { return (width + 127) / 128 * 128 + 64; }

// The scales of `rows` rows of `width` columns under activation scales q: one per row and
// K block, one per row, or one.
__host__ __device__ inline int64_t fused_quantize_scale_count(int64_t rows, int64_t width,
                                                             const detail::GemmQuantParams& q) {
  switch (q.a_scales) {
    case ScaleGranularity::kBlock: return rows * ((width + q.block_k - 1) / q.block_k);
    case ScaleGranularity::kChannel: return rows;
    default: return 1;
  }
}

// Whether q's scale strides are those of the scales quantize_rows_into_shared writes for
// rows of `width` columns: [rows, ceil(width / block_k)] row-major, [rows, 1] or [1, 1].
inline bool fused_quantize_scale_strides(int64_t width, const detail::GemmQuantParams& q) {
  switch (q.a_scales) {
    case ScaleGranularity::kBlock: return q.a_scale_stride_row == (width + q.block_k - 1) / q.block_k && q.a_scale_stride_k == 1;
    case ScaleGranularity::kChannel: return q.a_scale_stride_row == 1;
    default: return true;
  }
}

// Shared memory for rows x width quantized: the rows, then their scales (fp32).
__host__ __device__ inline int64_t fused_quantize_bytes(int64_t rows, int64_t width, const detail::GemmQuantParams& q) {
  return rows * fused_quantize_row_stride(width) + 4 * fused_quantize_scale_count(rows, width, q);
}

// The most any launch asks for: kSmallBatchMaxSlots8Bit rows (padded by at most 191 bytes
// each) of kSmallBatchFusedQuantizeElements elements in all, a scale per 64 columns (the
// smallest K block the kernels take) and row.
constexpr int kFusedQuantizeMaxBytes = 48 * 1024;
static_assert(detail::kSmallBatchFusedQuantizeElements + kSmallBatchMaxSlots8Bit * 191 +
                      4 * (detail::kSmallBatchFusedQuantizeElements / 64 + kSmallBatchMaxSlots8Bit) <=
                  kFusedQuantizeMaxBytes,
              "the quantized rows fit the shared memory the launches allow");

// Rows [0, rows) of `in` (T, row stride in_stride elements, width % 8 == 0, 16-byte aligned
// rows) quantized into `shared` (fused_quantize_bytes of it: the rows, row stride
// fused_quantize_row_stride(width), then the scales) by q's activation scales; every thread
// of the CTA (kCtaThreads) calls it. Returns the scales in shared memory, laid out as q's
// strides say (fused_quantize_scale_strides: the API's layout too, which the launcher
// checks, so only the pointer changes). static_scale: q.a_scale holds the caller's one scale.
// Each scale's absmax gathers through shared-memory atomicMax on the bits of its chunks'
// maxima (non-negative floats order like their bits): blocks, rows and the tensor take one path.
template <class T, class E, int kCtaThreads>
__device__ __forceinline__ const float* quantize_rows_into_shared(const T* in, int64_t in_stride, int rows, int width,
                                                                 const detail::GemmQuantParams& q, bool static_scale,
                                                                 unsigned char* shared) {
  using Q = std::conditional_t<std::is_same_v<E, int8_t>, int8_t, uint8_t>;  // uint8_t: fp8 e4m3 bits
  constexpr int kRounds = int(detail::kSmallBatchFusedQuantizeElements) / kQuantizeChunk / kCtaThreads;
  static_assert(kRounds >= 1, "a chunk a thread at least");
  const int stride = int(fused_quantize_row_stride(width));
  const int chunks_per_row = width / kQuantizeChunk;
  const int chunks = rows * chunks_per_row;
  const bool block = q.a_scales == ScaleGranularity::kBlock;
  const int scale_cols = block ? (width + int(q.block_k) - 1) / int(q.block_k) : 1;
  const int num_scales = int(fused_quantize_scale_count(rows, width, q));
  float* scales = reinterpret_cast<float*>(shared + int64_t(rows) * stride);
  auto scale_index = [&](int row, int col) {
    switch (q.a_scales) {
      case ScaleGranularity::kBlock: return row * scale_cols + col / int(q.block_k);
      case ScaleGranularity::kChannel: return row;
      default: return 0;
    }
  };
  int* amax = reinterpret_cast<int*>(scales);
  for (int i = int(threadIdx.x); i < num_scales; i += kCtaThreads) amax[i] = 0;
  uint4 raw[kRounds];
#pragma unroll
  for (int u = 0; u < kRounds; ++u) {
    const int c = int(threadIdx.x) + u * kCtaThreads;
    const int row = c / chunks_per_row, col = (c - row * chunks_per_row) * kQuantizeChunk;
    raw[u] = c < chunks ? *reinterpret_cast<const uint4*>(in + int64_t(row) * in_stride + col) : make_uint4(0, 0, 0, 0);
  }
  __syncthreads();  // amax zeroed
  if (!static_scale) {
#pragma unroll
    for (int u = 0; u < kRounds; ++u) {
      const int c = int(threadIdx.x) + u * kCtaThreads;
      if (c >= chunks) break;
      const int row = c / chunks_per_row, col = (c - row * chunks_per_row) * kQuantizeChunk;
      const Vec16<T>& v = reinterpret_cast<const Vec16<T>&>(raw[u]);
      float m = 0.f;
#pragma unroll
      for (int i = 0; i < kQuantizeChunk; ++i) m = fmaxf(m, fabsf(to_float(v.v[i])));
      atomicMax(&amax[scale_index(row, col)], __float_as_int(m));
    }
    __syncthreads();
  }
  for (int i = int(threadIdx.x); i < num_scales; i += kCtaThreads) {
    scales[i] = static_scale ? *q.a_scale : scale_of(__int_as_float(amax[i]), kQmax<Q>);
  }
  __syncthreads();
#pragma unroll
  for (int u = 0; u < kRounds; ++u) {
    const int c = int(threadIdx.x) + u * kCtaThreads;
    if (c >= chunks) break;
    const int row = c / chunks_per_row, col = (c - row * chunks_per_row) * kQuantizeChunk;
    const Vec16<T>& v = reinterpret_cast<const Vec16<T>&>(raw[u]);
    const float scale = scales[scale_index(row, col)];
    Q out[kQuantizeChunk];
#pragma unroll
    for (int i = 0; i < kQuantizeChunk; ++i) out[i] = quantize_element<Q>(to_float(v.v[i]), scale);
    *reinterpret_cast<uint2*>(shared + int64_t(row) * stride + col) = *reinterpret_cast<const uint2*>(out);
  }
  __syncthreads();
  return scales;
}

}  // namespace moelora::cuda::small_batch
