// fused_experts on weight-only experts (w4a16 / w8a16, issue 30): the checks of the
// packed weights, their scales and zero points (layouts: include/moelora/ops.h,
// FusedExpertsQuant), and the backend parameters they become.
#include <climits>
#include <cmath>
#include <string>

#include "api/api_util.h"
#include "api/quant_check.h"
#include "common/host_numeric.h"
#include "common/params.h"

namespace moelora::detail {

namespace {

// fn(e, n, g, element offset) for every element of a [E, N, groups] or [E, N] view.
template <class Fn>
void for_each_group(const TensorView& t, Fn fn) {
  const int64_t groups = t.rank == 3 ? t.shape[2] : 1, stride_g = t.rank == 3 ? t.strides[2] : 0;
  for (int64_t e = 0; e < t.shape[0]; ++e) {
    for (int64_t n = 0; n < t.shape[1]; ++n) {
      for (int64_t g = 0; g < groups; ++g) fn(e, n, g, e * t.strides[0] + n * t.strides[1] + g * stride_g);
    }
  }
}

std::string at(int64_t e, int64_t n, int64_t g) {
  return " at [" + std::to_string(e) + ", " + std::to_string(n) + ", " + std::to_string(g) + "]";
}

// On the CPU, where they are readable: every scale finite (16-bit; NaN or inf would
// poison every output of the group's rows).
void check_scales_finite_16bit(const char* op, const char* name, const TensorView& scales) {
  if (scales.device.type != DeviceType::kCPU) return;
  const auto* data = static_cast<const uint16_t*>(scales.data);
  for_each_group(scales, [&](int64_t e, int64_t n, int64_t g, int64_t offset) {
    const float v = scales.dtype == DType::kBFloat16 ? host::to_float(host::bf16{data[offset]})
                                                     : host::to_float(host::fp16{data[offset]});
    if (!std::isfinite(v)) {
      fail(op, std::string("argument '") + name + "' expected finite scales, got " + std::to_string(v) + at(e, n, g));
    }
  });
}

// On the CPU: every unpacked 4-bit zero point below 16 (a byte above means a packed
// tensor passed as unpacked: the wrong packing).
void check_zero_values(const char* op, const char* name, const TensorView& zero, int bits, bool packed) {
  if (zero.device.type != DeviceType::kCPU || bits != 4 || packed) return;
  const auto* data = static_cast<const uint8_t*>(zero.data);
  for_each_group(zero, [&](int64_t e, int64_t n, int64_t g, int64_t offset) {
    if (data[offset] > 15) {
      fail(op, std::string("argument '") + name + "' expected 4-bit zero points in [0, 15] (one a byte), got " +
                   std::to_string(data[offset]) + at(e, n, g) + ": packed zero points are [E, N / 2, K / group_size]");
    }
  });
}

// One GEMM's weights w [E, N, K * bits / 8] (checked by the caller), scales and zero
// points; `k_name` names K for the messages.
WeightOnlyParams weight_only_params(const char* op, const char* w_name, const TensorView& w, const char* scale_name,
                                    const TensorView& scale, const char* zero_name, const TensorView* zero,
                                    const QuantScheme& s, const TensorView& x, int64_t E, int64_t N, int64_t K,
                                    const char* k_name) {
  const Device device = x.device;
  const int bits = s.weight_bits;
  const int64_t G = s.group_size;
  if (bits == 4 && K % 2 != 0) {
    fail(op, std::string("argument '") + w_name + "' expected an even " + k_name +
                 " for 4-bit weights (two a byte along K), got " + std::to_string(K));
  }
  if (G > 0 && K % G != 0) {
    fail(op, std::string("argument 'quant' expected group_size ") + std::to_string(G) + " to divide " + k_name +
                 " (" + std::to_string(K) + ")");
  }
  const int64_t groups = G > 0 ? K / G : 1;
  ArgCheck sc(op, scale_name, scale);
  sc.same_dtype(x, "hidden_states").on(device, "hidden_states");
  if (G > 0) {
    sc.rank(3).dim(0, E, "experts").dim(1, N, "N (the GEMM's weight rows)").dim(2, groups, "K / group_size");
  } else {
    sc.rank(2).dim(0, E, "experts").dim(1, N, "N, one per output channel (group_size 0)");
  }
  check_scales_finite_16bit(op, scale_name, scale);
  // The CUDA kernels step through a row's groups with 32-bit offsets (weight_only_convert.cuh).
  auto check_group_stride = [&](const char* name, const TensorView& t) {
    if (device.type != DeviceType::kCUDA || G == 0) return;
    if (t.strides[2] < 0 || t.strides[2] > INT32_MAX / 2 / groups) {
      fail(op, std::string("argument '") + name + "' expected a stride along K / group_size in [0, " +
                   std::to_string(INT32_MAX / 2 / groups) + "] elements on CUDA, got " + std::to_string(t.strides[2]));
    }
  };
  check_group_stride(scale_name, scale);
  WeightOnlyParams p;
  p.enabled = true;
  p.bits = bits;
  p.group_size = G;
  p.w = static_cast<const uint8_t*>(w.data);
  p.w_stride_expert = w.strides[0];
  p.w_stride_n = w.strides[1];
  p.scale_dtype = scale.dtype;
  p.scale = scale.data;
  p.scale_stride_expert = scale.strides[0];
  p.scale_stride_n = scale.strides[1];
  p.scale_stride_k = G > 0 ? scale.strides[2] : 0;
  if (!s.zero_points) {
    if (zero) {
      fail(op, std::string("argument '") + zero_name +
                   "' expected none: the scheme has no zero points (zero_points false), got a tensor");
    }
    return p;
  }
  if (!zero) {
    fail(op, std::string("argument '") + zero_name + "' expected uint8 zero points (the scheme has zero_points), got none");
  }
  ArgCheck zc(op, zero_name, *zero);
  zc.dtype(DType::kUInt8).on(device, "hidden_states").rank(G > 0 ? 3 : 2).dim(0, E, "experts");
  if (G > 0) zc.dim(2, groups, "K / group_size");
  const int64_t rows = zero->shape[1];
  const bool packed = bits == 4 && N % 2 == 0 && rows == N / 2;
  if (!packed && rows != N) {
    const std::string packed_shape =
        bits == 4 && N % 2 == 0 ? " or " + std::to_string(N / 2) + " (4-bit, packed two a byte along N)" : "";
    fail(op, std::string("argument '") + zero_name + "' expected dim 1 " + std::to_string(N) +
                 " (one zero point a byte)" + packed_shape +
                 ", got shape " + zero->shape_string());
  }
  check_zero_values(op, zero_name, *zero, bits, packed);
  check_group_stride(zero_name, *zero);
  p.zero = static_cast<const uint8_t*>(zero->data);
  p.zero_packed = packed;
  p.zero_stride_expert = zero->strides[0];
  p.zero_stride_n = zero->strides[1];
  p.zero_stride_k = G > 0 ? zero->strides[2] : 0;
  return p;
}

}  // namespace

int64_t packed_weight_cols(const QuantScheme& scheme, int64_t K) {
  return scheme.weight_only() && scheme.weight_bits == 4 ? (K + 1) / 2 : K;
}

FusedExpertsQuantParams check_weight_only_experts(const char* op, const FusedExpertsArgs& args, int64_t E, int64_t H,
                                                  int64_t I) {
  const FusedExpertsQuant& quant = *args.quant;
  const QuantScheme& s = quant.scheme;
  const TensorView& x = args.hidden_states;
  ArgCheck(op, "hidden_states", x).dtype_in({DType::kBFloat16, DType::kFloat16});
  if (quant.a13_scale || quant.a2_scale) {
    fail(op, std::string("argument 'a13_scale' expected none: weight-only scheme ") + quant_method_name(s.method) +
                 " keeps the activations in " + dtype_name(x.dtype) + ", got a tensor");
  }
  FusedExpertsQuantParams p;
  p.w13 = weight_only_params(op, "w13", args.w13, "w13_scale", quant.w13_scale, "w13_zero", quant.w13_zero, s, x, E,
                             2 * I, H, "the hidden size");
  p.w2 = weight_only_params(op, "w2", args.w2, "w2_scale", quant.w2_scale, "w2_zero", quant.w2_zero, s, x, E, H, I,
                            "the intermediate size");
  if (x.device.type == DeviceType::kCUDA) {
    // The decode kernels load 16-byte chunks of the packed rows (32 or 16 values, each
    // chunk within one scale group) and take GEMM1's columns 8 at a time.
    constexpr int64_t need = 32;
    if (H % need != 0 || I % need != 0) {
      fail(op, "argument 'w13' expected a hidden size and an intermediate size that are multiples of " +
                   std::to_string(need) + " for " + quant_method_name(s.method) +
                   " experts on CUDA (16-byte chunks of the packed rows), got H = " + std::to_string(H) +
                   ", I = " + std::to_string(I));
    }
    ArgCheck(op, "w13", args.w13).rows_aligned(16);
    ArgCheck(op, "w2", args.w2).rows_aligned(16);
    // The decode and aligned kernels load x's rows in 16-byte chunks too (every CUDA path
    // but the dense copies): checked here, before any chunk has written `out`.
    ArgCheck(op, "hidden_states", x).rows_aligned(16);
  }
  return p;
}

}  // namespace moelora::detail
