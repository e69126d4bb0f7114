// Converting strided rows between the tensor dtypes and fp32 on the host.
//
// The CPU backend converts each row once into an fp32 scratch row and computes on
// that; the dtype switch sits outside the element loop so the loops stay tight.
#pragma once

#include <cstdint>

#include "common/host_numeric.h"
#include "moelora/tensor.h"

namespace moelora::cpu {

// dst[i] = float(src[i * stride]) for i < count. src holds `dtype` elements
// (bf16/fp16 as uint16_t bits; fp8 and int8 as their 8-bit values, unscaled).
inline void load_row(DType dtype, const void* src, int64_t stride, int64_t count, float* dst) {
  switch (dtype) {
    case DType::kFloat32: {
      const float* s = static_cast<const float*>(src);
      for (int64_t i = 0; i < count; ++i) dst[i] = s[i * stride];
      return;
    }
    case DType::kBFloat16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < count; ++i) dst[i] = host::to_float(host::bf16{s[i * stride]});
      return;
    }
    case DType::kFloat16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < count; ++i) dst[i] = host::to_float(host::fp16{s[i * stride]});
      return;
    }
    case DType::kFloat8E4M3: {
      const uint8_t* s = static_cast<const uint8_t*>(src);
      for (int64_t i = 0; i < count; ++i) dst[i] = host::to_float_table(host::fp8e4m3{s[i * stride]});
      return;
    }
    case DType::kInt8: {
      const int8_t* s = static_cast<const int8_t*>(src);
      for (int64_t i = 0; i < count; ++i) dst[i] = float(s[i * stride]);
      return;
    }
    default:
      throw Error("cpu backend: load_row called with a non-float dtype");
  }
}

// dst[i * stride] = round_to_dtype(src[i]) for i < count (round to nearest even; fp8
// saturates to +-448, int8 to [-128, 127]).
inline void store_row(DType dtype, const float* src, int64_t count, void* dst, int64_t stride) {
  switch (dtype) {
    case DType::kFloat32: {
      float* d = static_cast<float*>(dst);
      for (int64_t i = 0; i < count; ++i) d[i * stride] = src[i];
      return;
    }
    case DType::kBFloat16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < count; ++i) d[i * stride] = host::to_bf16(src[i]).bits;
      return;
    }
    case DType::kFloat16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < count; ++i) d[i * stride] = host::to_fp16(src[i]).bits;
      return;
    }
    case DType::kFloat8E4M3: {
      uint8_t* d = static_cast<uint8_t*>(dst);
      for (int64_t i = 0; i < count; ++i) d[i * stride] = host::to_fp8e4m3(src[i]).bits;
      return;
    }
    case DType::kInt8: {
      int8_t* d = static_cast<int8_t*>(dst);
      for (int64_t i = 0; i < count; ++i) d[i * stride] = host::to_int8(src[i]);
      return;
    }
    default:
      throw Error("cpu backend: store_row called with a non-float dtype");
  }
}

// The address of element `index` (in elements) of a buffer of `dtype`.
inline const void* element_ptr(DType dtype, const void* base, int64_t index) {
  return static_cast<const char*>(base) + index * int64_t(dtype_size(dtype));
}
inline void* element_ptr(DType dtype, void* base, int64_t index) {
  return static_cast<char*>(base) + index * int64_t(dtype_size(dtype));
}

}  // namespace moelora::cpu
