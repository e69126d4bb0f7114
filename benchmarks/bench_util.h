// What the benchmarks share: normal random data at memory speed, CUDA error checks and
// device buffers, the median, the measured ceilings (HBM copy rate, bf16 matmul rate)
// and JSON numbers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common/host_numeric.h"
#include "moelora/ops.h"
#include "moelora/tensor.h"

#ifdef MOELORA_WITH_CUDA
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
#endif

struct Ceilings { double copy_tbps = 3.0, bf16_tflops = 790; bool measured = false; };

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

#ifdef MOELORA_WITH_CUDA
inline Ceilings measure_ceilings() {
  Ceilings c;
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  auto time_ms = [&](auto&& body, int reps) {
    std::vector<double> t;
    for (int i = 0; i < reps + 3; ++i) {
      CHECK_CUDA(cudaEventRecord(start, stream));
      body();
      CHECK_CUDA(cudaEventRecord(stop, stream));
      CHECK_CUDA(cudaEventSynchronize(stop));
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
      if (i >= 3) t.push_back(ms);
    }
    return median(t);
  };
  {  // device-to-device copy of 2 GiB, counting bytes read and written
    const size_t bytes = size_t(2) << 30;
    DeviceBuffer a(bytes), b(bytes);
    CHECK_CUDA(cudaMemsetAsync(a.ptr, 1, bytes, stream));
    const double ms = time_ms([&] { CHECK_CUDA(cudaMemcpyAsync(b.ptr, a.ptr, bytes, cudaMemcpyDeviceToDevice, stream)); }, 10);
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
    const double ms = time_ms([&] {
      if (cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &one, a.ptr, CUDA_R_16BF, n, b.ptr, CUDA_R_16BF, n,
                       &zero, d.ptr, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
        throw std::runtime_error("cublasGemmEx failed");
      }
    }, 10);
    cublasDestroy(handle);
    c.bf16_tflops = 2.0 * n * n * double(n) / (ms * 1e-3) / 1e12;
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
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

// {"ceilings": {...}, "rows": [...]} at path, one row object a line.
inline void write_bench_json(const std::string& path, const Ceilings& c, const std::vector<std::string>& rows) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) throw std::runtime_error("cannot write " + path);
  std::fprintf(f, "{\"ceilings\": {\"copy_tbps\": %.4f, \"bf16_tflops\": %.2f, \"measured\": %s},\n \"rows\": [\n",
               c.copy_tbps, c.bf16_tflops, c.measured ? "true" : "false");
  for (size_t i = 0; i < rows.size(); ++i) std::fprintf(f, "  %s%s\n", rows[i].c_str(), i + 1 < rows.size() ? "," : "");
  std::fprintf(f, " ]}\n");
  std::fclose(f);
}

}  // namespace moelora::bench
