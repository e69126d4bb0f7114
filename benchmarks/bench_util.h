// What the benchmarks share: normal random data at memory speed, CUDA error checks and
// device buffers, the median, the measured ceilings (HBM copy rate, bf16 matmul rate;
// fp8 and int8 GEMM rates for the quantized layer) and JSON numbers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common/host_numeric.h"
#include "moelora/ops.h"
#include "moelora/tensor.h"

#ifdef MOELORA_WITH_CUDA
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#endif

namespace moelora::bench {

using moelora::DType;

template <class F>
inline void parallel_for(int64_t count, F fn) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(std::thread::hardware_concurrency(), count));
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (int64_t i = t; i < count; i += threads) fn(i);
    });
  }
  for (auto& th : pool) th.join();
}

// ---- random data ------------------------------------------------------------------
// NOTE: hundreds of millions of normal draws per model; a table of 65536 normal
// quantiles indexed by a counter hash gives normal data at memory speed.
inline const std::vector<float>& normal_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (int i = 0; i < 65536; ++i) {
      const double p = (i + 0.5) / 65536.0;
      // Acklam-free: invert the CDF by bisection on erfc (once, 65536 entries).
      double lo = -6, hi = 6;
      for (int it = 0; it < 60; ++it) {
        const double mid = 0.5 * (lo + hi);
        (0.5 * std::erfc(-mid / std::sqrt(2.0)) < p ? lo : hi) = mid;
      }
      t[i] = float(0.5 * (lo + hi));
    }
    return t;
  }();
  return table;
}

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

inline void fill_normal(DType dtype, void* data, int64_t count, uint64_t seed, float scale) {
  const std::vector<float>& table = normal_table();
  constexpr int64_t kBlock = 1 << 20;
  parallel_for((count + kBlock - 1) / kBlock, [&](int64_t b) {
    const int64_t end = std::min(count, (b + 1) * kBlock);
    for (int64_t i = b * kBlock; i < end; ++i) {
      const float v = table[splitmix64(seed * 0x100000001b3ull + uint64_t(i)) & 0xffff] * scale;
      if (dtype == DType::kBFloat16) static_cast<uint16_t*>(data)[i] = moelora::host::to_bf16(v).bits;
      else static_cast<uint16_t*>(data)[i] = moelora::host::to_fp16(v).bits;
    }
  });
}

#ifdef MOELORA_WITH_CUDA
#define CHECK_CUDA(call)                                                                          \
  do {                                                                                            \
    const cudaError_t err_ = (call);                                                              \
    if (err_ != cudaSuccess) throw std::runtime_error(std::string(#call) + ": " + cudaGetErrorString(err_)); \
  } while (0)

struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t bytes) { CHECK_CUDA(cudaMalloc(&ptr, std::max<size_t>(bytes, 256))); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

// The milliseconds `body` (stream work) takes between two events on `stream`.
template <class F>
inline double event_ms(cudaStream_t stream, F&& body) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  CHECK_CUDA(cudaEventRecord(start, stream));
  body();
  CHECK_CUDA(cudaEventRecord(stop, stream));
  CHECK_CUDA(cudaEventSynchronize(stop));
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  return ms;
}
#endif

// Bytes on a bench's device: CUDA memory, or 256-byte aligned host memory for
// --device cpu (the alignment the ops' workspaces ask for).
class Buffer {
 public:
  Buffer(bool cuda, size_t bytes) : cuda_(cuda) {
    bytes = std::max<size_t>((bytes + 255) / 256 * 256, 256);
#ifdef MOELORA_WITH_CUDA
    if (cuda) {
      CHECK_CUDA(cudaMalloc(&ptr_, bytes));
      return;
    }
#endif
    if (cuda) throw std::runtime_error("a CUDA buffer in a build without CUDA");
    ptr_ = std::aligned_alloc(256, bytes);
    if (!ptr_) throw std::bad_alloc();
  }
  ~Buffer() {
#ifdef MOELORA_WITH_CUDA
    if (cuda_) {
      cudaFree(ptr_);
      return;
    }
#endif
    std::free(ptr_);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* ptr() const { return ptr_; }
  void upload(const void* host, size_t bytes) { copy(ptr_, host, bytes); }
  void download(void* host, size_t bytes) const { copy(host, ptr_, bytes); }
  // NOTE: on CUDA waits for the fill: cudaMemset runs on the legacy stream, which the
  // benches' non-blocking streams do not wait for.
  void fill(int byte, size_t bytes) {
#ifdef MOELORA_WITH_CUDA
    if (cuda_) {
      CHECK_CUDA(cudaMemset(ptr_, byte, bytes));
      CHECK_CUDA(cudaDeviceSynchronize());
      return;
    }
#endif
    std::memset(ptr_, byte, bytes);
  }

 private:
  void copy(void* dst, const void* src, size_t bytes) const {
#ifdef MOELORA_WITH_CUDA
    if (cuda_) {
      CHECK_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault));
      return;
    }
#endif
    std::memcpy(dst, src, bytes);
  }
  bool cuda_;
  void* ptr_ = nullptr;
};

// Free bytes on the current CUDA device (infinite without CUDA).
inline double device_free_bytes() {
#ifdef MOELORA_WITH_CUDA
  size_t free_bytes = 0, total_bytes = 0;
  CHECK_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
  return double(free_bytes);
#else
  return INFINITY;
#endif
}

// Waits for all work on the current CUDA device (nothing without CUDA).
inline void device_synchronize() {
#ifdef MOELORA_WITH_CUDA
  CHECK_CUDA(cudaDeviceSynchronize());
#endif
}

// The rates floors divide by. Unmeasured: H100 nominal (copy, cuBLAS bf16) and, for the
// 8-bit GEMMs, twice the bf16 rate (the tensor cores' fp8/int8 rate is twice bf16's).
struct Ceilings {
  double copy_tbps = 3.0, bf16_tflops = 790;
  double fp8_tflops = 1580, int8_tops = 1580;
  bool measured = false;
};

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

#ifdef MOELORA_WITH_CUDA
// The median of `reps` timings of body on stream, after 3 untimed ones.
template <class F>
inline double median_ms(cudaStream_t stream, F&& body, int reps) {
  std::vector<double> t;
  for (int i = 0; i < reps + 3; ++i) {
    const double ms = event_ms(stream, body);
    if (i >= 3) t.push_back(ms);
  }
  return median(t);
}

// The TFLOP/s of one n^3 GEMM through cuBLASLt with ab_type operands: D = Aᵀ·B with A and
// B column-major n x n, the TN layout cuBLASLt takes for fp8 and int8 (IMMA) alike; C and D
// of d_type, `compute` accumulation, alpha/beta of scale_type. Data: normal(0, 1) draws
// (fp8) or normal(0, 32) (int8), rounded as the layer's quantize rounds.
inline double lt_gemm_tflops(cudaStream_t stream, cudaDataType_t ab_type, cudaDataType_t d_type,
                             cublasComputeType_t compute, cudaDataType_t scale_type) {
  const int n = 8192;
  const size_t elements = size_t(n) * n, workspace_bytes = size_t(64) << 20;
  std::vector<uint16_t> normal(elements);
  fill_normal(DType::kBFloat16, normal.data(), int64_t(elements), 9, ab_type == CUDA_R_8I ? 32.0f : 1.0f);
  std::vector<uint8_t> host(elements);
  parallel_for(int64_t(elements) / n, [&](int64_t row) {
    for (int64_t i = row * n; i < (row + 1) * n; ++i) {
      const float v = moelora::host::to_float(moelora::host::bf16{normal[i]});
      host[i] = ab_type == CUDA_R_8I ? uint8_t(moelora::host::to_int8(v)) : moelora::host::to_fp8e4m3(v).bits;
    }
  });
  DeviceBuffer a(elements), b(elements), d(elements * 4), workspace(workspace_bytes);
  CHECK_CUDA(cudaMemcpy(a.ptr, host.data(), elements, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(b.ptr, host.data(), elements, cudaMemcpyHostToDevice));
  auto check = [](cublasStatus_t status, const char* what) {
    if (status != CUBLAS_STATUS_SUCCESS) {
      throw std::runtime_error(std::string("cuBLASLt ") + what + " failed: " + cublasGetStatusString(status));
    }
  };
  cublasLtHandle_t lt;
  check(cublasLtCreate(&lt), "create");
  cublasLtMatmulDesc_t op;
  check(cublasLtMatmulDescCreate(&op, compute, scale_type), "matmul desc");
  const cublasOperation_t transpose = CUBLAS_OP_T, keep = CUBLAS_OP_N;
  check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof transpose), "TRANSA");
  check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &keep, sizeof keep), "TRANSB");
  cublasLtMatrixLayout_t a_layout, b_layout, d_layout;
  check(cublasLtMatrixLayoutCreate(&a_layout, ab_type, n, n, n), "A layout");
  check(cublasLtMatrixLayoutCreate(&b_layout, ab_type, n, n, n), "B layout");
  check(cublasLtMatrixLayoutCreate(&d_layout, d_type, n, n, n), "D layout");
  cublasLtMatmulPreference_t preference;
  check(cublasLtMatmulPreferenceCreate(&preference), "preference");
  check(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                                             sizeof workspace_bytes),
        "workspace preference");
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  check(cublasLtMatmulAlgoGetHeuristic(lt, op, a_layout, b_layout, d_layout, d_layout, preference, 1, &heuristic,
                                       &found),
        "heuristic");
  if (found == 0) throw std::runtime_error("cuBLASLt has no algorithm for the 8-bit ceiling GEMM");
  const float one_f = 1, zero_f = 0;
  const int32_t one_i = 1, zero_i = 0;
  const bool int_scale = scale_type == CUDA_R_32I;
  const double ms = median_ms(stream, [&] {
    check(cublasLtMatmul(lt, op, int_scale ? static_cast<const void*>(&one_i) : &one_f, a.ptr, a_layout, b.ptr,
                         b_layout, int_scale ? static_cast<const void*>(&zero_i) : &zero_f, d.ptr, d_layout, d.ptr,
                         d_layout, &heuristic.algo, workspace.ptr, workspace_bytes, stream),
          "matmul");
  }, 10);
  cublasLtMatmulPreferenceDestroy(preference);
  cublasLtMatrixLayoutDestroy(a_layout);
  cublasLtMatrixLayoutDestroy(b_layout);
  cublasLtMatrixLayoutDestroy(d_layout);
  cublasLtMatmulDescDestroy(op);
  cublasLtDestroy(lt);
  return 2.0 * n * n * double(n) / (ms * 1e-3) / 1e12;
}

// with_8bit also measures fp8_tflops (e4m3 x e4m3, fp32 accumulation, bf16 out) and
// int8_tops (int8 x int8, int32 accumulation and out).
inline Ceilings measure_ceilings(bool with_8bit = false) {
  Ceilings c;
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  {  // device-to-device copy of 2 GiB, counting bytes read and written
    const size_t bytes = size_t(2) << 30;
    DeviceBuffer a(bytes), b(bytes);
    CHECK_CUDA(cudaMemsetAsync(a.ptr, 1, bytes, stream));
    const double ms = median_ms(stream, [&] { CHECK_CUDA(cudaMemcpyAsync(b.ptr, a.ptr, bytes, cudaMemcpyDeviceToDevice, stream)); }, 10);
    c.copy_tbps = 2.0 * bytes / (ms * 1e-3) / 1e12;
  }
  {  // 8192^3 bf16 matmul through cuBLAS, fp32 accumulation, random data
    const int n = 8192;
    std::vector<uint16_t> host(size_t(n) * n);
    DeviceBuffer a(host.size() * 2), b(host.size() * 2), d(host.size() * 2);
    fill_normal(DType::kBFloat16, host.data(), int64_t(host.size()), 7, 1.0f);
    CHECK_CUDA(cudaMemcpy(a.ptr, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(b.ptr, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
    cublasHandle_t handle;
    if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) throw std::runtime_error("cublasCreate failed");
    cublasSetStream(handle, stream);
    const float one = 1, zero = 0;
    const double ms = median_ms(stream, [&] {
      if (cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &one, a.ptr, CUDA_R_16BF, n, b.ptr, CUDA_R_16BF, n,
                       &zero, d.ptr, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
        throw std::runtime_error("cublasGemmEx failed");
      }
    }, 10);
    cublasDestroy(handle);
    c.bf16_tflops = 2.0 * n * n * double(n) / (ms * 1e-3) / 1e12;
  }
  if (with_8bit) {
    c.fp8_tflops = lt_gemm_tflops(stream, CUDA_R_8F_E4M3, CUDA_R_16BF, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    c.int8_tops = lt_gemm_tflops(stream, CUDA_R_8I, CUDA_R_32I, CUBLAS_COMPUTE_32I, CUDA_R_32I);
  }
  CHECK_CUDA(cudaStreamDestroy(stream));
  c.measured = true;
  return c;
}
#endif

// A JSON number with a decimal point (1.0, not 1).
inline std::string json_fraction(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  std::string out = buf;
  if (out.find_first_of(".en") == std::string::npos) out += ".0";
  return out;
}

// --device auto|cpu|cuda: whether to run on the CUDA backend; *error names what is wrong
// with the choice (empty when it is usable).
inline bool choose_cuda(const std::string& device, std::string* error) {
  error->clear();
  if (device == "cuda") {
    if (!moelora::cuda_available()) *error = "--device cuda but no CUDA device (or built without CUDA)";
    return true;
  }
  if (device == "auto") return moelora::cuda_available();
  if (device != "cpu") *error = "--device takes auto, cpu or cuda";
  return false;
}

inline moelora::TensorView view(void* data, DType dtype, std::initializer_list<int64_t> shape,
                                moelora::Device device) {
  return moelora::TensorView::contiguous(data, dtype, shape, device);
}

// printf into a std::string (one JSON row of a bench).
inline std::string format(const char* fmt, ...) {
  va_list args, copy;
  va_start(args, fmt);
  va_copy(copy, args);
  std::string out(size_t(std::max(0, std::vsnprintf(nullptr, 0, fmt, copy))), '\0');
  va_end(copy);
  std::vsnprintf(out.data(), out.size() + 1, fmt, args);
  va_end(args);
  return out;
}

// {"ceilings": {...}, "rows": [...]} at path, one row object a line. with_8bit adds the
// 8-bit GEMM rates (fp8_tflops, int8_tops) to the ceilings.
inline void write_bench_json(const std::string& path, const Ceilings& c, const std::vector<std::string>& rows,
                             bool with_8bit = false) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) throw std::runtime_error("cannot write " + path);
  const std::string rates_8bit =
      with_8bit ? format(", \"fp8_tflops\": %.2f, \"int8_tops\": %.2f", c.fp8_tflops, c.int8_tops) : "";
  std::fprintf(f, "{\"ceilings\": {\"copy_tbps\": %.4f, \"bf16_tflops\": %.2f%s, \"measured\": %s},\n \"rows\": [\n",
               c.copy_tbps, c.bf16_tflops, rates_8bit.c_str(), c.measured ? "true" : "false");
  for (size_t i = 0; i < rows.size(); ++i) std::fprintf(f, "  %s%s\n", rows[i].c_str(), i + 1 < rows.size() ? "," : "");
  std::fprintf(f, " ]}\n");
  std::fclose(f);
}

}  // namespace moelora::bench
