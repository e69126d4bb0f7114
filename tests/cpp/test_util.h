// Test plumbing shared by every test file: the backend parameter, a stream, and Buffer,
// the storage of one test tensor on the host and (for CUDA) on the device.
//
// The pattern of every test:
//   Buffer x(backend, dtype, M * H);               // storage
//   TensorView xv = x.view({M, H});                 // a view into the backend's copy
//   std::vector<double> xd = x.fill_normal(xv, rng);  // dtype-rounded values, for the reference
//   x.upload();
//   Buffer out(...); out.poison();                  // NaN everywhere, on both copies
//   moelora::op(..., stream.handle()); stream.sync(); out.download();
//   EXPECT_LE(ref::rel_error(out.read(ov), expected), ref::tolerance(dtype));
//   EXPECT_EQ(out.count_unwritten(ov), 0);          // every element written
//   EXPECT_EQ(out.count_written_outside(ov), 0);    // nothing else written
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cctype>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <ostream>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef MOELORA_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include "moelora/ops.h"
#include "reference.h"

namespace moelora::test {

// ---- backends ------------------------------------------------------------------------

enum class Backend { kCPU, kCUDA };

inline const char* backend_name(Backend backend) { return backend == Backend::kCPU ? "CPU" : "CUDA"; }

// gtest prints parameters with this (test names in ctest stay readable).
inline void PrintTo(Backend backend, std::ostream* os) { *os << backend_name(backend); }

inline Device device_of(Backend backend) {
  return backend == Backend::kCPU ? Device{DeviceType::kCPU, 0} : Device{DeviceType::kCUDA, 0};
}

// The device a tensor of the *other* backend lives on: for wrong-device tests.
inline Device other_device(Backend backend) {
  return backend == Backend::kCPU ? Device{DeviceType::kCUDA, 0} : Device{DeviceType::kCPU, 0};
}

inline bool backend_available(Backend backend) {
  if (backend == Backend::kCPU) return true;
#ifdef MOELORA_WITH_CUDA
  return moelora::cuda_available();
#else
  return false;
#endif
}

inline const std::vector<Backend>& all_backends() {
  static const std::vector<Backend> backends{Backend::kCPU, Backend::kCUDA};
  return backends;
}

// Use at the top of a test body (or SetUp): skips the CUDA variant where there is no
// CUDA backend or no device.
#define MOELORA_SKIP_UNLESS_AVAILABLE(backend)                                                         \
  do {                                                                                                  \
    if (!::moelora::test::backend_available(backend)) {                                                 \
      GTEST_SKIP() << ::moelora::test::backend_name(backend) << " backend not built or no device";     \
    }                                                                                                   \
  } while (0)

// A test name gtest accepts: every character but letters and digits becomes '_'.
inline std::string sanitized(std::string name) {
  for (char& ch : name) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return name;
}

// The CUDA cases of a parameterized suite's list that `keep` accepts: the list of a CUDA-only
// test instantiated as its own suite, so that its CPU instances do not show as skipped.
template <class Case, class Keep>
std::vector<Case> cuda_cases_where(const std::vector<Case>& cases, Keep keep) {
  std::vector<Case> kept;
  for (const Case& c : cases) {
    if (c.backend == Backend::kCUDA && keep(c)) kept.push_back(c);
  }
  return kept;
}

inline const char* dtype_short_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "fp32";
    case DType::kFloat16: return "fp16";
    case DType::kBFloat16: return "bf16";
    case DType::kInt32: return "i32";
    case DType::kInt64: return "i64";
    case DType::kFloat8E4M3: return "fp8";
    case DType::kInt8: return "i8";
    case DType::kUInt8: return "u8";
  }
  return "unknown";
}

// ---- CUDA helpers --------------------------------------------------------------------

#ifdef MOELORA_WITH_CUDA
inline void cuda_check(cudaError_t status, const char* what, const char* file, int line) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(what) + " failed at " + file + ":" + std::to_string(line) + ": " +
                             cudaGetErrorString(status));
  }
}
#define MOELORA_CUDA_CHECK(expr) ::moelora::test::cuda_check((expr), #expr, __FILE__, __LINE__)
#endif

// The stream an op runs on: a fresh CUDA stream for the CUDA backend, none on the CPU.
class TestStream {
 public:
  explicit TestStream(Backend backend) : backend_(backend) {
#ifdef MOELORA_WITH_CUDA
    if (backend_ == Backend::kCUDA) MOELORA_CUDA_CHECK(cudaStreamCreate(&stream_));
#endif
  }
  ~TestStream() {
#ifdef MOELORA_WITH_CUDA
    if (stream_) cudaStreamDestroy(stream_);
#endif
  }
  TestStream(const TestStream&) = delete;
  TestStream& operator=(const TestStream&) = delete;

  Stream handle() const {
#ifdef MOELORA_WITH_CUDA
    return static_cast<Stream>(stream_);
#else
    return nullptr;
#endif
  }

  // Waits for the stream and surfaces any CUDA error (a kernel fault shows up here).
  void sync() const {
#ifdef MOELORA_WITH_CUDA
    if (backend_ == Backend::kCUDA) {
      MOELORA_CUDA_CHECK(cudaStreamSynchronize(stream_));
      MOELORA_CUDA_CHECK(cudaGetLastError());
    }
#endif
  }

 private:
  Backend backend_;
#ifdef MOELORA_WITH_CUDA
  cudaStream_t stream_ = nullptr;
#endif
};

// A process-wide A/B knob (an op's kernel choice, e.g. cuda::set_lora_expand_groups_use) set
// for a test's scope; the value it had comes back when the scope ends, whatever the test set
// in between.
template <class Value>
class ScopedKnob {
 public:
  ScopedKnob(Value (*get)(), void (*set)(Value), Value value) : set_(set), before_(get()) { set(value); }
  ~ScopedKnob() { set_(before_); }
  ScopedKnob(const ScopedKnob&) = delete;
  ScopedKnob& operator=(const ScopedKnob&) = delete;

 private:
  void (*set_)(Value);
  Value before_;
};

// ---- Buffer --------------------------------------------------------------------------

// The storage of one test tensor: 256-byte aligned host bytes and, for the CUDA backend,
// a device allocation of the same size. Views point into the backend's copy (the host
// bytes on the CPU); tests fill and inspect the host copy and move it with
// upload()/download().
class Buffer {
 public:
  Buffer(Backend backend, DType dtype, int64_t num_elements)
      : backend_(backend), dtype_(dtype), size_(num_elements), bytes_(size_t(num_elements) * dtype_size(dtype)) {
    host_storage_.resize(bytes_ + 256);
    const uintptr_t raw = reinterpret_cast<uintptr_t>(host_storage_.data());
    host_ = host_storage_.data() + ((256 - raw % 256) % 256);
#ifdef MOELORA_WITH_CUDA
    if (backend_ == Backend::kCUDA && bytes_ > 0) {
      void* device = nullptr;
      MOELORA_CUDA_CHECK(cudaMalloc(&device, bytes_));
      device_.reset(device);
    }
#endif
  }

  Buffer(const Buffer&) = delete;  // host_ points into host_storage_: copies would alias
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&&) = default;  // the vector's heap block moves with it, so host_ stays valid
  Buffer& operator=(Buffer&&) = default;

  DType dtype() const { return dtype_; }
  int64_t size() const { return size_; }
  size_t bytes() const { return bytes_; }
  void* host() { return host_; }
  const void* host() const { return host_; }
  template <class T>
  T* host_as() { return reinterpret_cast<T*>(host_); }

  // Where views point: the host bytes on the CPU, the device copy on CUDA.
  void* data() {
#ifdef MOELORA_WITH_CUDA
    if (backend_ == Backend::kCUDA) return device_.get();
#endif
    return host_;
  }

  // A view of this storage, starting `offset` elements in; contiguous when strides are
  // not given.
  TensorView view(const std::vector<int64_t>& shape, std::vector<int64_t> strides = {}, int64_t offset = 0) {
    if (shape.size() > size_t(kMaxRank)) throw std::invalid_argument("Buffer::view: rank too high");
    if (strides.empty()) {
      strides.assign(shape.size(), 1);
      for (int d = int(shape.size()) - 2; d >= 0; --d) {
        strides[size_t(d)] = strides[size_t(d + 1)] * shape[size_t(d + 1)];
      }
    }
    TensorView t;
    t.data = static_cast<char*>(data()) + offset * int64_t(dtype_size(dtype_));
    t.dtype = dtype_;
    t.rank = int(shape.size());
    t.device = device_of(backend_);
    for (size_t d = 0; d < shape.size(); ++d) {
      t.shape[d] = shape[d];
      t.strides[d] = strides[d];
    }
    if (max_offset(t) >= size_) throw std::invalid_argument("Buffer::view: view runs past the storage");
    return t;
  }

  void upload() {
#ifdef MOELORA_WITH_CUDA
    if (backend_ == Backend::kCUDA && bytes_ > 0) {
      MOELORA_CUDA_CHECK(cudaMemcpy(device_.get(), host_, bytes_, cudaMemcpyHostToDevice));
    }
#endif
  }
  void download() {
#ifdef MOELORA_WITH_CUDA
    if (backend_ == Backend::kCUDA && bytes_ > 0) {
      MOELORA_CUDA_CHECK(cudaMemcpy(host_, device_.get(), bytes_, cudaMemcpyDeviceToHost));
    }
#endif
  }

  double get(int64_t index) const { return ref::read_element(dtype_, host_, index); }
  void set(int64_t index, double value) { ref::write_element(dtype_, host_, index, value); }

  // The storage offset (elements) of the view's first element.
  int64_t base_offset(const TensorView& t) const {
    return (static_cast<const char*>(t.data) - static_cast<const char*>(const_data())) / int64_t(dtype_size(dtype_));
  }

  // Storage offsets (elements) of the view's elements, in row-major logical order.
  std::vector<int64_t> offsets(const TensorView& t) const {
    const int64_t base = base_offset(t);
    std::vector<int64_t> result;
    result.reserve(size_t(std::max<int64_t>(t.numel(), 0)));
    int64_t shape[kMaxRank] = {1, 1, 1, 1}, strides[kMaxRank] = {0, 0, 0, 0};
    for (int d = 0; d < t.rank; ++d) {  // right-aligned into 4 dims
      shape[kMaxRank - t.rank + d] = t.shape[d];
      strides[kMaxRank - t.rank + d] = t.strides[d];
    }
    for (int64_t i0 = 0; i0 < shape[0]; ++i0)
      for (int64_t i1 = 0; i1 < shape[1]; ++i1)
        for (int64_t i2 = 0; i2 < shape[2]; ++i2)
          for (int64_t i3 = 0; i3 < shape[3]; ++i3)
            result.push_back(base + i0 * strides[0] + i1 * strides[1] + i2 * strides[2] + i3 * strides[3]);
    return result;
  }

  // The view's elements from the host copy, as doubles, row-major.
  std::vector<double> read(const TensorView& t) const {
    std::vector<double> values;
    for (int64_t offset : offsets(t)) values.push_back(get(offset));
    return values;
  }
  // Writes values (row-major over the view) into the host copy, rounded to the dtype.
  void write(const TensorView& t, const std::vector<double>& values) {
    const std::vector<int64_t> offs = offsets(t);
    if (offs.size() != values.size()) throw std::invalid_argument("Buffer::write: size mismatch");
    for (size_t i = 0; i < offs.size(); ++i) set(offs[i], values[i]);
  }

  // Fills the view with normal(0, scale) values in the host copy; returns them as the
  // dtype-rounded doubles the op will see.
  std::vector<double> fill_normal(const TensorView& t, std::mt19937& rng, double scale = 1.0) {
    const int64_t count = t.numel();
    const size_t element = dtype_size(dtype_);
    if (t.is_contiguous()) {  // NOTE: weights run to 10^8 elements: no staging copy
      void* first = static_cast<char*>(host_) + size_t(base_offset(t)) * element;
      ref::fill_normal(dtype_, first, count, rng, scale);
      return ref::to_double(dtype_, first, count);
    }
    std::vector<uint8_t> staging(size_t(count) * element);
    ref::fill_normal(dtype_, staging.data(), count, rng, scale);
    const std::vector<int64_t> offs = offsets(t);
    for (size_t i = 0; i < offs.size(); ++i) {
      std::memcpy(static_cast<char*>(host_) + size_t(offs[i]) * element, staging.data() + i * element, element);
    }
    return ref::to_double(dtype_, staging.data(), count);
  }

  // Poison: a NaN bit pattern for floats (0x7fc0 bf16, 0x7e00 fp16, 0x7fc00000 fp32, 0x7f
  // fp8 e4m3), the largest value for wide ints, -128 for int8 (symmetric quantization
  // writes [-127, 127]), 0xA5 for uint8 (packed weights are inputs only). Fills the whole storage, host and device.
  void poison() {
    for (int64_t i = 0; i < size_; ++i) set_poison(i);
    upload();
  }
  bool is_poison(int64_t index) const {
    switch (dtype_) {
      case DType::kFloat32: return reinterpret_cast<const uint32_t*>(host_)[index] == 0x7fc00000u;
      case DType::kFloat16: return reinterpret_cast<const uint16_t*>(host_)[index] == 0x7e00u;
      case DType::kBFloat16: return reinterpret_cast<const uint16_t*>(host_)[index] == 0x7fc0u;
      case DType::kInt32: return reinterpret_cast<const int32_t*>(host_)[index] == INT32_MAX;
      case DType::kInt64: return reinterpret_cast<const int64_t*>(host_)[index] == INT64_MAX;
      case DType::kFloat8E4M3: return reinterpret_cast<const uint8_t*>(host_)[index] == 0x7fu;
      case DType::kInt8: return reinterpret_cast<const int8_t*>(host_)[index] == INT8_MIN;
      case DType::kUInt8: return reinterpret_cast<const uint8_t*>(host_)[index] == 0xA5u;
    }
    return false;
  }
  // Elements of the view that still hold poison (0 = all written).
  int64_t count_unwritten(const TensorView& t) const {
    int64_t count = 0;
    for (int64_t offset : offsets(t)) count += is_poison(offset) ? 1 : 0;
    return count;
  }
  // Elements of the storage outside the view that lost their poison (0 = none written).
  int64_t count_written_outside(const TensorView& t) const {
    std::vector<bool> inside(static_cast<size_t>(size_), false);
    for (int64_t offset : offsets(t)) inside[size_t(offset)] = true;
    int64_t count = 0;
    for (int64_t i = 0; i < size_; ++i) count += (!inside[size_t(i)] && !is_poison(i)) ? 1 : 0;
    return count;
  }
  // Elements of the whole storage that lost their poison.
  int64_t count_written() const {
    int64_t count = 0;
    for (int64_t i = 0; i < size_; ++i) count += is_poison(i) ? 0 : 1;
    return count;
  }

 private:
  const void* const_data() const { return const_cast<Buffer*>(this)->data(); }
  static int64_t max_offset(const TensorView& t) {
    int64_t last = 0;
    for (int d = 0; d < t.rank; ++d) {
      if (t.shape[d] == 0) return -1;
      last += (t.shape[d] - 1) * t.strides[d];
    }
    return last;
  }
  void set_poison(int64_t index) {
    switch (dtype_) {
      case DType::kFloat32: reinterpret_cast<uint32_t*>(host_)[index] = 0x7fc00000u; return;
      case DType::kFloat16: reinterpret_cast<uint16_t*>(host_)[index] = 0x7e00u; return;
      case DType::kBFloat16: reinterpret_cast<uint16_t*>(host_)[index] = 0x7fc0u; return;
      case DType::kInt32: reinterpret_cast<int32_t*>(host_)[index] = INT32_MAX; return;
      case DType::kInt64: reinterpret_cast<int64_t*>(host_)[index] = INT64_MAX; return;
      case DType::kFloat8E4M3: reinterpret_cast<uint8_t*>(host_)[index] = 0x7fu; return;
      case DType::kInt8: reinterpret_cast<int8_t*>(host_)[index] = INT8_MIN; return;
      case DType::kUInt8: reinterpret_cast<uint8_t*>(host_)[index] = 0xA5u; return;
    }
  }

#ifdef MOELORA_WITH_CUDA
  struct CudaFree {
    void operator()(void* p) const { cudaFree(p); }
  };
  std::unique_ptr<void, CudaFree> device_;
#endif
  Backend backend_;
  DType dtype_;
  int64_t size_;
  size_t bytes_;
  std::vector<uint8_t> host_storage_;
  void* host_ = nullptr;
};

// A buffer holding `values` (rounded to dtype) as a contiguous tensor, already uploaded.
inline Buffer buffer_with(Backend backend, DType dtype, const std::vector<double>& values) {
  Buffer buffer(backend, dtype, int64_t(values.size()));
  for (size_t i = 0; i < values.size(); ++i) buffer.set(int64_t(i), values[i]);
  buffer.upload();
  return buffer;
}

// ---- errors --------------------------------------------------------------------------

// Runs `call`, which must throw moelora::Error; returns its message ("" and a failure when
// it does not throw, or throws something else).
inline std::string error_message(const std::function<void()>& call) {
  try {
    call();
  } catch (const moelora::Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected moelora::Error, got another exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected moelora::Error, but the call returned";
  return "";
}

// The argument name as error messages quote it: 'w'.
inline std::string quoted(const std::string& name) { return "'" + name + "'"; }

// ---- routing -------------------------------------------------------------------------

// topk_ids [M, top_k] as a router makes them: top_k distinct experts per token, uniform
// over [0, num_experts) (top_k <= num_experts).
inline std::vector<int64_t> random_routing(int64_t M, int64_t top_k, int64_t num_experts, std::mt19937& rng) {
  std::vector<int64_t> ids(static_cast<size_t>(M * top_k));
  std::vector<int64_t> experts(static_cast<size_t>(num_experts));
  for (int64_t e = 0; e < num_experts; ++e) experts[size_t(e)] = e;
  for (int64_t m = 0; m < M; ++m) {
    // partial Fisher-Yates: the first top_k entries become a random distinct choice
    for (int64_t j = 0; j < top_k; ++j) {
      std::uniform_int_distribution<int64_t> pick(j, num_experts - 1);
      std::swap(experts[size_t(j)], experts[size_t(pick(rng))]);
      ids[size_t(m * top_k + j)] = experts[size_t(j)];
    }
  }
  return ids;
}

// Router weights [M, top_k]: positive, each row summing to 1 (softmax-like).
inline std::vector<double> random_router_weights(int64_t M, int64_t top_k, std::mt19937& rng) {
  std::uniform_real_distribution<double> uniform(0.1, 1.0);
  std::vector<double> weights(static_cast<size_t>(M * top_k));
  for (int64_t m = 0; m < M; ++m) {
    double sum = 0.0;
    for (int64_t j = 0; j < top_k; ++j) sum += weights[size_t(m * top_k + j)] = uniform(rng);
    for (int64_t j = 0; j < top_k; ++j) weights[size_t(m * top_k + j)] /= sum;
  }
  // as the op sees them (fp32)
  return ref::round_to(DType::kFloat32, weights);
}

}  // namespace moelora::test
