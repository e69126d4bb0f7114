// Helpers the op files of the C++ API share: argument checks, small arithmetic, views of
// raw storage, and the dispatch of a backend entry point on the tensors' device. The op
// files define the public ops in namespace moelora with `using namespace detail`.
#pragma once

#include <cstdint>

#include "api/validate.h"
#include "common/params.h"
#include "moelora/ops.h"

namespace moelora::detail {

constexpr int64_t kMaxBlockSize = 256;

inline ArgCheck& float_dtype(ArgCheck& c) {
  return c.dtype_in({DType::kFloat32, DType::kFloat16, DType::kBFloat16});
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The sizes the queries take (slots, tokens) stay below this: sorted ids and slot
// indices are int32 on every backend, and the byte counts derived from them fit in int64.
constexpr int64_t kMaxSlots = (int64_t(1) << 31) - 1;
// Hidden and intermediate sizes: far above any model's (32K), low enough that an
// expert's bytes (experts x 2I x H x 4) fit in int64.
constexpr int64_t kMaxLayerDim = int64_t(1) << 20;

// A raw number argument of a query or an op (not a tensor): value in [lo, hi].
void check_range(const char* op, const char* name, int64_t value, int64_t lo, int64_t hi);

inline int64_t round_up(int64_t v, int64_t to) { return ceil_div(v, to) * to; }

inline bool on_cuda(const TensorView& t) { return t.device.type == DeviceType::kCUDA; }

// A 2-D view [rows, cols] of a tensor's storage.
inline TensorView view2d(void* data, DType dtype, int64_t rows, int64_t cols, int64_t stride_row,
                         int64_t stride_col, Device device) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.rank = 2;
  t.shape[0] = rows;
  t.shape[1] = cols;
  t.strides[0] = stride_row;
  t.strides[1] = stride_col;
  t.device = device;
  return t;
}

inline void* byte_offset(void* p, int64_t bytes) { return static_cast<char*>(p) + bytes; }

void check_block_size(const char* op, int64_t block_size, bool multiple_of_16);

// On the CPU the ids are readable: reject out-of-range ones with a clear message.
// (The CUDA backend cannot read them without a host sync; see ops.h.)
void check_cpu_ids(const char* op, const char* name, const TensorView& ids, int64_t lo, int64_t hi);

// Runs a backend entry point on the tensors' device. Without the CUDA backend a CUDA
// call never gets here: require_cuda_backend() rejected it during validation.
#ifdef MOELORA_WITH_CUDA
#define MOELORA_BACKEND_CALL(fn, params, device, stream) \
  ((device).type == DeviceType::kCPU ? cpu::fn(params) : cuda::fn(params, stream))
#else
#define MOELORA_BACKEND_CALL(fn, params, device, stream) ((void)(device), (void)(stream), cpu::fn(params))
#endif

inline void run_align(const AlignParams& p, Device device, Stream stream) {
  MOELORA_BACKEND_CALL(moe_align_block_size, p, device, stream);
}
inline void run_gemm(const GemmParams& p, Device device, Stream stream) {
  MOELORA_BACKEND_CALL(fused_moe, p, device, stream);
}
inline void run_activation(const ActivationParams& p, Device device, Stream stream) {
  MOELORA_BACKEND_CALL(activation, p, device, stream);
}
inline void run_sum_reduce(const SumReduceParams& p, Device device, Stream stream) {
  MOELORA_BACKEND_CALL(moe_sum_reduce, p, device, stream);
}
inline void run_lora_delta(const LoraDeltaParams& p, Device device, Stream stream) {
  MOELORA_BACKEND_CALL(moe_lora_delta, p, device, stream);
}
inline void run_quantize(const QuantizeParams& p, Device device, Stream stream) {
  MOELORA_BACKEND_CALL(quantize, p, device, stream);
}

}  // namespace moelora::detail
