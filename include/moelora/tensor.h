// moelora public API: the tensor view every op takes, and the error every op throws.
//
// A TensorView does not own memory. The caller keeps the memory alive and on the
// right device for the duration of the call (and, for CUDA, until the stream has
// consumed it). Strides are in elements, not bytes, as in torch and DLPack.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>

namespace moelora {

enum class DType : int8_t {
  kFloat32,
  kFloat16,
  kBFloat16,
  kInt32,
  kInt64,
  // 8-bit quantized elements (issue 28): OCP fp8 e4m3 without infinities (torch's
  // float8_e4m3fn: max 448, one NaN pattern 0x7f/0xff) and two's-complement int8.
  kFloat8E4M3,
  kInt8,
  // Packed weight-only experts (issue 30): unsigned bytes, two 4-bit values or one 8-bit
  // value each (QuantScheme::weight_bits); also their zero points.
  kUInt8,
};

const char* dtype_name(DType dtype);
size_t dtype_size(DType dtype);

enum class DeviceType : int8_t { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;  // CUDA ordinal; 0 for the CPU
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
};

std::string device_name(const Device& device);

// Highest rank any op accepts; ops state their own rank in their contract.
constexpr int kMaxRank = 4;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int rank = 0;
  int64_t shape[kMaxRank] = {0, 0, 0, 0};
  int64_t strides[kMaxRank] = {0, 0, 0, 0};  // in elements
  Device device{};

  int64_t size(int dim) const { return shape[dim]; }
  int64_t stride(int dim) const { return strides[dim]; }
  int64_t numel() const;
  bool is_contiguous() const;
  std::string shape_string() const;  // "[8, 14336, 4096]"

  // A row-major contiguous view; throws moelora::Error when shape has more than kMaxRank dims.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               Device device = {});
};

// Every invalid argument raises this, with a message that names the op, the argument,
// what was expected and what was given.
class Error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A CUDA stream (cudaStream_t) as an opaque handle; nullptr is the legacy default
// stream. CPU ops ignore it and run synchronously.
using Stream = void*;

}  // namespace moelora
