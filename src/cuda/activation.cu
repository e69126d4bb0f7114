// Gated activations on CUDA: [rows, 2I] -> [rows, I]. Memory-bound: one pass, 16-byte
// loads and stores when rows are aligned, fp32 math.
#include <algorithm>

#include <stdexcept>

#include "common/params.h"
#include "cuda/cuda_check.h"
#include "cuda/gated_activation.cuh"
#include "cuda/launch.cuh"
#include "cuda/numeric.cuh"

namespace moelora::cuda {
namespace {

using detail::ActivationKind;
using detail::ActivationParams;

// One thread produces kVec consecutive outputs of one row. Grid: (column groups, rows).
template <typename T, ActivationKind kKind, int kVec>
__global__ void activation_kernel(const ActivationParams p) {
  const int64_t row = blockIdx.y;
  const int64_t col = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kVec;
  wait_for_previous_kernel();
  if (col >= p.width) return;
  const T* in = static_cast<const T*>(p.input) + row * p.input_stride_row;
  T* out = static_cast<T*>(p.out) + row * p.out_stride_row;
  T gate[kVec], up[kVec], result[kVec];
  load_gate_up<T, kKind, kVec>(in, p.width, col, gate, up);
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    result[i] = from_float<T>(gated_activation<kKind>(to_float(gate[i]), to_float(up[i]), p.alpha, p.limit));
  }
  if constexpr (kVec > 1) {
    *reinterpret_cast<Vec16<T>*>(out + col) = *reinterpret_cast<const Vec16<T>*>(result);
  } else {
    out[col] = result[0];
  }
}

template <typename T, ActivationKind kKind>
void launch(const ActivationParams& p, cudaStream_t stream) {
  constexpr int kVec = Vec16<T>::kSize;
  // 16-byte access needs every row start aligned and whole groups per row.
  const bool vectorize = p.width % kVec == 0 && aligned16(p.input) && aligned16(p.out) &&
                         (p.input_stride_row * sizeof(T)) % 16 == 0 && (p.out_stride_row * sizeof(T)) % 16 == 0;
  constexpr int kThreads = 128;
  for (int64_t row0 = 0; row0 < p.num_rows; row0 += 65535) {
    ActivationParams chunk = p;
    chunk.num_rows = std::min<int64_t>(65535, p.num_rows - row0);
    chunk.input = static_cast<const T*>(p.input) + row0 * p.input_stride_row;
    chunk.out = static_cast<T*>(p.out) + row0 * p.out_stride_row;
    const int vec = vectorize ? kVec : 1;
    const dim3 grid(unsigned((p.width + int64_t(kThreads) * vec - 1) / (int64_t(kThreads) * vec)), unsigned(chunk.num_rows));
    launch_kernel(vectorize ? activation_kernel<T, kKind, kVec> : activation_kernel<T, kKind, 1>, grid, dim3(kThreads),
                  0, stream, chunk);
  }
}

}  // namespace

void activation(const ActivationParams& p, Stream stream) {
  if (p.num_rows == 0 || p.width == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.out_dtype != p.dtype) {
    throw std::logic_error("moelora.activation: the CUDA kernel writes its input's dtype");
  }
  dispatch_float(p.dtype, [&](auto t) {
    using T = decltype(t);
    switch (p.kind) {
      case ActivationKind::kSiluAndMul: launch<T, ActivationKind::kSiluAndMul>(p, s); break;
      case ActivationKind::kGeluAndMul: launch<T, ActivationKind::kGeluAndMul>(p, s); break;
      case ActivationKind::kSwigluOai: launch<T, ActivationKind::kSwigluOai>(p, s); break;
    }
  });
}

}  // namespace moelora::cuda
