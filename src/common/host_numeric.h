// Host-side conversions between fp32 and the 16-bit and 8-bit formats, bit-exact with
// the CUDA intrinsics (__float2bfloat16_rn / __float2half_rn: round to nearest even;
// __nv_cvt_float_to_fp8 with __NV_SATFINITE for fp8 e4m3; __float2int_rn for int8).
// Used by the CPU backend, the tests and the benchmark; no CUDA header needed.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace moelora::host {

struct bf16 { uint16_t bits; };
struct fp16 { uint16_t bits; };

inline uint32_t float_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline float to_float(bf16 v) { return bits_float(uint32_t(v.bits) << 16); }

inline bf16 to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t((u >> 16) | 0x40)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return bf16{uint16_t(u >> 16)};
}

inline float to_float(fp16 v) {
  const uint32_t sign = uint32_t(v.bits & 0x8000u) << 16;
  uint32_t exp = (v.bits >> 10) & 0x1fu;
  uint32_t man = v.bits & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (man << 13));  // inf / NaN
  if (exp == 0) {
    if (man == 0) return bits_float(sign);
    // subnormal: normalise
    int e = -1;
    do { man <<= 1; ++e; } while ((man & 0x400u) == 0);
    man &= 0x3ffu;
    return bits_float(sign | uint32_t(127 - 15 - e) << 23 | (man << 13));
  }
  return bits_float(sign | (exp + 127 - 15) << 23 | (man << 13));
}

inline fp16 to_fp16(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return fp16{uint16_t(sign | 0x7e00u)};         // NaN
  if (abs >= 0x477ff000u) return fp16{uint16_t(sign | 0x7c00u)};        // rounds to inf
  if (abs < 0x38800000u) {                                               // subnormal or zero
    // value = abs_float; fp16 subnormal unit = 2^-24
    const float a = bits_float(abs);
    const float scaled = a * 16777216.0f;  // exact (power of two)
    // round half to even on an integer
    uint32_t q = uint32_t(scaled);
    const float rem = scaled - float(q);
    if (rem > 0.5f || (rem == 0.5f && (q & 1u))) ++q;
    return fp16{uint16_t(sign | q)};
  }
  uint32_t mant = abs & 0x7fffffu;
  uint32_t exp = (abs >> 23) - 127 + 15;
  uint32_t h = (exp << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // may carry into exponent: correct
  return fp16{uint16_t(sign | h)};
}

// fp8 e4m3 without infinities (float8_e4m3fn): 1 sign, 4 exponent (bias 7), 3 mantissa
// bits; 0x7f / 0xff are NaN, 448 the largest finite value, 2^-9 the smallest subnormal.
struct fp8e4m3 { uint8_t bits; };
constexpr float kFp8E4M3Max = 448.0f;
constexpr float kInt8Max = 127.0f;

inline float to_float(fp8e4m3 v) {
  const int exp = (v.bits >> 3) & 0xf, man = v.bits & 0x7;
  const float sign = (v.bits & 0x80) ? -1.0f : 1.0f;
  if (exp == 0xf && man == 0x7) return std::nanf("");
  if (exp == 0) return sign * std::ldexp(float(man), -9);
  return sign * std::ldexp(float(8 + man), exp - 10);
}

// The same through a table of all 256 codes (the CPU backend decodes fp8 weights with it:
// to_float's ldexp per element made the CPU fp8 layer ~5x slower than int8).
inline float to_float_table(fp8e4m3 v) {
  static const struct Table {
    float values[256];
    Table() {
      for (int code = 0; code < 256; ++code) values[code] = to_float(fp8e4m3{uint8_t(code)});
    }
  } table;
  return table.values[v.bits];
}

// Round to nearest even, saturating to +-448 (cvt.rn.satfinite.e4m3x2.f32); NaN -> 0x7f.
inline fp8e4m3 to_fp8e4m3(float f) {
  if (std::isnan(f)) return fp8e4m3{0x7f};
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  const float a = std::fabs(f);
  uint32_t code;
  if (a < 0.015625f) {
    // Subnormal range (below 2^-6): code = round(a * 2^9); 8 is the smallest normal's code.
    code = uint32_t(std::nearbyint(std::ldexp(a, 9)));
  } else {
    int ex = 0;
    std::frexp(a, &ex);  // a = f * 2^ex, f in [0.5, 1)
    const int e = ex - 1;                                      // a in [2^e, 2^(e+1))
    const uint32_t q = uint32_t(std::nearbyint(std::ldexp(a, 3 - e)));  // in [8, 16]: 16 carries
    code = e + 7 > 15 ? 0x7fu : uint32_t((e + 7) << 3) + (q - 8);
  }
  if (code > 0x7e) code = 0x7e;  // saturate (0x7f is NaN)
  return fp8e4m3{uint8_t(sign | code)};
}

// Round half to even, saturating to [-128, 127] (float_to_int8_rn of vLLM's kernels).
inline int8_t to_int8(float f) {
  if (std::isnan(f)) return 0;
  const float r = std::nearbyint(f);
  return int8_t(r > 127.0f ? 127.0f : r < -128.0f ? -128.0f : r);
}

}  // namespace moelora::host
