// TensorView helpers and names used in error messages.
#include <string>

#include "moelora/ops.h"
#include "moelora/tensor.h"

namespace moelora {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kFloat8E4M3: return "float8_e4m3fn";
    case DType::kInt8: return "int8";
    case DType::kUInt8: return "uint8";
  }
  return "unknown";
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat8E4M3:
    case DType::kInt8: return 1;
    case DType::kUInt8: return 1;
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kFloat32:
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
  }
  return 0;
}

std::string device_name(const Device& device) {
  return device.type == DeviceType::kCPU ? std::string("cpu") : "cuda:" + std::to_string(device.index);
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < rank; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t expected = 1;
  for (int d = rank - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

// NOTE: no iostreams in the library: a Python extension that links libstdc++ pieces
// statically crashed inside std::ostringstream (seen with nanobind 3.1 on the H100 box).
std::string TensorView::shape_string() const {
  std::string s = "[";
  for (int d = 0; d < rank && d < kMaxRank; ++d) s += (d ? ", " : "") + std::to_string(shape[d]);
  return s + "]";
}

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                                  Device device) {
  if (shape.size() > size_t(kMaxRank)) {
    throw Error("TensorView::contiguous: rank " + std::to_string(shape.size()) +
                " is above the supported maximum " + std::to_string(kMaxRank));
  }
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.rank = int(shape.size());
  t.device = device;
  int d = 0;
  for (int64_t s : shape) t.shape[d++] = s;
  int64_t stride = 1;
  for (d = t.rank - 1; d >= 0; --d) {
    t.strides[d] = stride;
    stride *= t.shape[d];
  }
  return t;
}

const char* version() { return "0.1.0"; }

}  // namespace moelora
