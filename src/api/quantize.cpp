// The quantization API: the named schemes, their validation, and the quantize op's
// argument checks. See include/moelora/quant.h.
#include <algorithm>
#include <cmath>
#include <string>

#include "api/api_util.h"
#include "api/quant_check.h"
#include "api/validate.h"
#include "common/params.h"
#include "moelora/quant.h"

namespace moelora {

using detail::ArgCheck;
using detail::ceil_div;
using detail::fail;

namespace {

bool power_of_two_in(int64_t v, int64_t lo, int64_t hi) { return v >= lo && v <= hi && (v & (v - 1)) == 0; }

}  // namespace

QuantScheme make_quant_scheme(QuantMethod method, int64_t block_n, int64_t block_k, bool static_activation_scales) {
  QuantScheme s;
  s.method = method;
  s.block_n = block_n;
  s.block_k = block_k;
  switch (method) {
    case QuantMethod::kNone: return QuantScheme{};
    case QuantMethod::kFp8Block:
    case QuantMethod::kInt8Block:
      s.weight_scales = s.activation_scales = ScaleGranularity::kBlock;
      break;
    case QuantMethod::kFp8Channel:
    case QuantMethod::kInt8Channel:
      s.weight_scales = s.activation_scales = ScaleGranularity::kChannel;
      break;
    case QuantMethod::kFp8Tensor:
      s.weight_scales = s.activation_scales = ScaleGranularity::kTensor;
      s.static_activation_scales = static_activation_scales;
      break;
    case QuantMethod::kW4A16:
    case QuantMethod::kW8A16:
      throw Error(std::string("moelora.make_quant_scheme: ") + quant_method_name(method) +
                  " is weight-only: make it with make_weight_only_scheme(method, group_size, zero_points)");
  }
  s.element = method == QuantMethod::kInt8Block || method == QuantMethod::kInt8Channel ? DType::kInt8
                                                                                       : DType::kFloat8E4M3;
  detail::check_quant_scheme("make_quant_scheme", s);
  return s;
}

QuantScheme make_weight_only_scheme(QuantMethod method, int64_t group_size, bool zero_points) {
  if (method != QuantMethod::kW4A16 && method != QuantMethod::kW8A16) {
    throw Error(std::string("moelora.make_weight_only_scheme: expected w4a16 or w8a16, got ") +
                quant_method_name(method));
  }
  QuantScheme s;
  s.method = method;
  s.element = DType::kUInt8;
  s.weight_bits = method == QuantMethod::kW4A16 ? 4 : 8;
  s.group_size = group_size;
  s.zero_points = zero_points;
  s.weight_scales = group_size == 0 ? ScaleGranularity::kChannel : ScaleGranularity::kBlock;
  s.activation_scales = ScaleGranularity::kChannel;  // unused: activations stay 16-bit
  s.block_n = 1;
  s.block_k = group_size;
  detail::check_quant_scheme("make_weight_only_scheme", s);
  return s;
}

const char* quant_method_name(QuantMethod method) {
  switch (method) {
    case QuantMethod::kNone: return "none";
    case QuantMethod::kFp8Block: return "fp8_block";
    case QuantMethod::kFp8Channel: return "fp8_channel";
    case QuantMethod::kFp8Tensor: return "fp8_tensor";
    case QuantMethod::kInt8Channel: return "int8_channel";
    case QuantMethod::kInt8Block: return "int8_block";
    case QuantMethod::kW4A16: return "w4a16";
    case QuantMethod::kW8A16: return "w8a16";
  }
  return "unknown";
}

QuantMethod quant_method_from_name(const std::string& name) {
  for (QuantMethod m : {QuantMethod::kFp8Block, QuantMethod::kFp8Channel, QuantMethod::kFp8Tensor,
                        QuantMethod::kInt8Channel, QuantMethod::kInt8Block, QuantMethod::kW4A16,
                        QuantMethod::kW8A16}) {
    if (name == quant_method_name(m)) return m;
  }
  throw Error("moelora.quant_scheme: unknown scheme '" + name +
              "' (expected fp8_block, fp8_channel, fp8_tensor, int8_channel, int8_block, w4a16 or w8a16)");
}

namespace detail {

namespace {

// A weight-only scheme: unsigned bytes, 4 or 8 bits by the method, groups of 32, 64 or
// 128 along K (block_n 1, block_k the group) or per channel, no activation scales.
void check_weight_only_scheme(const char* op, const QuantScheme& s) {
  const std::string name = quant_method_name(s.method);
  const int bits = s.method == QuantMethod::kW4A16 ? 4 : 8;
  if (s.element != DType::kUInt8 || s.weight_bits != bits) {
    fail(op, "argument 'quant' expected uint8 elements of " + std::to_string(bits) + " bits for scheme " + name +
                 ", got " + dtype_name(s.element) + " of " + std::to_string(s.weight_bits) + " bits");
  }
  const bool channel = s.weight_scales == ScaleGranularity::kChannel && s.group_size == 0;
  const bool grouped = s.weight_scales == ScaleGranularity::kBlock &&
                       (s.group_size == 32 || s.group_size == 64 || s.group_size == 128) && s.block_n == 1 &&
                       s.block_k == s.group_size;
  if (!channel && !grouped) {
    fail(op, "argument 'quant' expected group_size 32, 64 or 128 (kBlock scales, block 1 x group_size) or 0 (kChannel) "
             "for scheme " + name + ", got group_size " + std::to_string(s.group_size));
  }
  if (s.static_activation_scales) {
    fail(op, "argument 'quant' expected no activation scales for weight-only scheme " + name +
                 " (static_activation_scales true)");
  }
}

}  // namespace

void check_quant_scheme(const char* op, const QuantScheme& s) {
  if (!s.enabled()) return;
  if (s.weight_only()) return check_weight_only_scheme(op, s);
  const std::string name = quant_method_name(s.method);
  if (s.element != DType::kFloat8E4M3 && s.element != DType::kInt8) {
    fail(op, "argument 'quant' expected element float8_e4m3fn or int8 for scheme " + name + ", got " +
                 dtype_name(s.element));
  }
  const bool block = s.weight_scales == ScaleGranularity::kBlock || s.activation_scales == ScaleGranularity::kBlock;
  if (block && !(power_of_two_in(s.block_n, 16, 1024) && power_of_two_in(s.block_k, 16, 1024))) {
    fail(op, "argument 'quant' expected block_n and block_k powers of two in [16, 1024], got " +
                 std::to_string(s.block_n) + " x " + std::to_string(s.block_k));
  }
  // Activation scales at least as fine as the K blocks of the weights: a block scale of w
  // meets per-token-group scales of a (vLLM's pairing); channel and tensor scales pair up.
  if ((s.weight_scales == ScaleGranularity::kBlock) != (s.activation_scales == ScaleGranularity::kBlock)) {
    fail(op, "argument 'quant' expected block weight scales with per-token-group activation scales (both kBlock), "
             "got scheme " + name + " mixing them");
  }
  if (s.static_activation_scales && s.activation_scales != ScaleGranularity::kTensor) {
    fail(op, "argument 'quant' expected static activation scales only with per-tensor activations, got scheme " + name);
  }
}

void check_scales_finite(const char* op, const char* name, const TensorView& scales) {
  if (scales.device.type != DeviceType::kCPU || scales.dtype != DType::kFloat32) return;
  int64_t index[kMaxRank] = {0, 0, 0, 0};
  const int64_t n = scales.numel();
  for (int64_t i = 0; i < n; ++i) {
    int64_t offset = 0;
    for (int d = 0; d < scales.rank; ++d) offset += index[d] * scales.strides[d];
    const float v = static_cast<const float*>(scales.data)[offset];
    if (!(std::isfinite(v) && v > 0.0f)) {
      fail(op, std::string("argument '") + name + "' expected finite scales > 0, got " + std::to_string(v) +
                   " at flat index " + std::to_string(i));
    }
    for (int d = scales.rank - 1; d >= 0; --d) {
      if (++index[d] < scales.shape[d]) break;
      index[d] = 0;
    }
  }
}

namespace {

// A weight scale tensor in the scheme's layout for w [E, N, K]; returns the params' view.
void check_weight_scales(const char* op, const char* name, const TensorView& scales, const QuantScheme& s, int64_t E,
                         int64_t N, int64_t K, const Device& device, GemmQuantParams* q) {
  ArgCheck c(op, name, scales);
  c.dtype(DType::kFloat32).on(device, "hidden_states");
  switch (s.weight_scales) {
    case ScaleGranularity::kBlock:
      c.rank(3).dim(0, E, "experts").dim(1, (N + s.block_n - 1) / s.block_n, "ceil(N / block_n) (N: the GEMM's weight rows)")
          .dim(2, (K + s.block_k - 1) / s.block_k, "ceil(K / block_k)");
      q->w_scale_stride_k = scales.strides[2];
      q->w_scale_stride_n = scales.strides[1];
      break;
    case ScaleGranularity::kChannel:
      c.rank(2).dim(0, E, "experts").dim(1, N, "N, one per output channel");
      q->w_scale_stride_n = scales.strides[1];
      break;
    case ScaleGranularity::kTensor:
      c.rank(1).dim(0, E, "experts, one per expert");
      break;
  }
  q->w_scale_stride_expert = scales.strides[0];
  q->w_scale = static_cast<const float*>(scales.data);
  check_scales_finite(op, name, scales);
}

}  // namespace

FusedExpertsQuantParams check_fused_experts_quant(const char* op, const FusedExpertsArgs& args, int64_t E, int64_t H,
                                                  int64_t I) {
  const FusedExpertsQuant& quant = *args.quant;
  const QuantScheme& s = quant.scheme;
  if (!s.enabled()) fail(op, "argument 'quant' expected a scheme (method other than none), got none");
  check_quant_scheme(op, s);
  if (s.weight_only()) return check_weight_only_experts(op, args, E, H, I);
  if (quant.w13_zero || quant.w2_zero) {
    fail(op, std::string("argument 'w13_zero' expected none: zero points belong to the weight-only schemes, got a "
                         "tensor with ") + quant_method_name(s.method));
  }
  const Device device = args.hidden_states.device;
  ArgCheck(op, "hidden_states", args.hidden_states).dtype_in({DType::kBFloat16, DType::kFloat16});
  FusedExpertsQuantParams p;
  for (GemmQuantParams* q : {&p.gemm1, &p.gemm2}) {
    q->enabled = true;
    q->element = s.element;
    q->a_scales = s.activation_scales;
    q->w_scales = s.weight_scales;
    q->block_n = s.block_n;
    q->block_k = s.block_k;
  }
  check_weight_scales(op, "w13_scale", quant.w13_scale, s, E, 2 * I, H, device, &p.gemm1);
  check_weight_scales(op, "w2_scale", quant.w2_scale, s, E, H, I, device, &p.gemm2);
  const std::pair<const TensorView*, const char*> static_scales[] = {{quant.a13_scale, "a13_scale"},
                                                                     {quant.a2_scale, "a2_scale"}};
  for (const auto& [scale, name] : static_scales) {
    if (!s.static_activation_scales) {
      if (scale) {
        fail(op, std::string("argument '") + name + "' expected none: scheme " + quant_method_name(s.method) +
                     " quantizes activations dynamically (static_activation_scales is false), got a tensor");
      }
      continue;
    }
    if (!scale) fail(op, std::string("argument '") + name + "' expected a [1] float32 static scale, got none");
    ArgCheck(op, name, *scale).rank(1).dtype(DType::kFloat32).dim(0, 1, "one scale").on(device, "hidden_states");
    check_scales_finite(op, name, *scale);
  }
  if (device.type == DeviceType::kCUDA) {
#ifdef MOELORA_WITH_CUDA
    if (!cuda::quant_element_supported(s.element)) {
      const CudaDeviceFacts facts = cuda::current_device_facts();
      fail(op, std::string("argument 'quant' expected a scheme this GPU runs: ") + quant_method_name(s.method) +
                   " needs " + (s.element == DType::kInt8 ? "int8 tensor cores (sm_80+)" : "fp8 tensor cores (sm_89+)") +
                   ", got " + facts.name + " (sm_" + std::to_string(facts.cc_major) + std::to_string(facts.cc_minor) +
                   ")");
    }
#endif
    if (s.weight_scales == ScaleGranularity::kBlock && s.block_k != 128) {
      fail(op, "argument 'quant' expected block_k 128 on CUDA (the W8A8 kernels' K tile is one scale block), got " +
                   std::to_string(s.block_k));
    }
    if (H % 16 != 0 || I % 16 != 0) {
      fail(op, "argument 'w13' expected a hidden size and an intermediate size that are multiples of 16 for quantized "
               "experts on CUDA (16-byte rows), got H = " + std::to_string(H) + ", I = " + std::to_string(I));
    }
  }
  return p;
}

QuantizeParams quantize_params(const QuantizeArgs& args) {
  const TensorView& x = args.input;
  const int r = x.rank;
  const int64_t R = x.shape[r - 2], C = x.shape[r - 1];
  return QuantizeParams{
      .input_dtype = x.dtype,
      .input = x.data,
      .input_stride_batch = r == 3 ? x.strides[0] : 0,
      .input_stride_row = x.strides[r - 2],
      .out_dtype = args.out.dtype,
      .out = args.out.data,
      .out_stride_batch = r == 3 ? args.out.strides[0] : 0,
      .out_stride_row = args.out.strides[r - 2],
      .scales = static_cast<float*>(args.scales.data),
      .scales_stride_batch = r == 3 ? args.scales.strides[0] : 0,
      .scales_stride_row = args.scales.strides[r - 2],
      .scales_stride_col = args.scales.strides[r - 1],
      .batch = r == 3 ? x.shape[0] : 1,
      .rows = R,
      .cols = C,
      .block_rows = args.block_rows == 0 ? std::max<int64_t>(R, 1) : args.block_rows,
      .block_cols = args.block_cols == 0 ? std::max<int64_t>(C, 1) : args.block_cols,
      .static_scales = args.static_scales,
  };
}

}  // namespace detail

void quantize(const QuantizeArgs& args, Stream stream) {
  const char* op = "quantize";
  const TensorView& x = args.input;
  ArgCheck(op, "input", x).dtype_in({DType::kFloat32, DType::kFloat16, DType::kBFloat16});
  if (x.rank != 2 && x.rank != 3) {
    fail(op, "argument 'input' expected rank 2 [rows, cols] or 3 [batch, rows, cols], got rank " +
                 std::to_string(x.rank) + " " + x.shape_string());
  }
  ArgCheck(op, "input", x).unit_stride(x.rank - 1);
  const Device device = x.device;
  const int r = x.rank;
  const int64_t B = r == 3 ? x.shape[0] : 1, R = x.shape[r - 2], C = x.shape[r - 1];
  ArgCheck out(op, "out", args.out);
  out.rank(r).dtype_in({DType::kFloat8E4M3, DType::kInt8}).on(device, "input").unit_stride(r - 1)
      .no_overlap(x, "input");
  for (int d = 0; d < r; ++d) out.dim(d, x.shape[d], "the shape of 'input'");
  if (args.block_rows < 0 || args.block_cols < 0) {
    fail(op, "argument 'block_rows'/'block_cols' expected >= 0 (0: the whole dim), got " +
                 std::to_string(args.block_rows) + " x " + std::to_string(args.block_cols));
  }
  const int64_t block_rows = args.block_rows == 0 ? std::max<int64_t>(R, 1) : args.block_rows;
  const int64_t block_cols = args.block_cols == 0 ? std::max<int64_t>(C, 1) : args.block_cols;
  ArgCheck scales(op, "scales", args.scales);
  scales.rank(r).dtype(DType::kFloat32).on(device, "input").no_overlap(x, "input").no_overlap(args.out, "out");
  if (r == 3) scales.dim(0, B, "batch, from 'input'");
  scales.dim(r - 2, ceil_div(R, block_rows), "ceil(rows / block_rows)")
      .dim(r - 1, ceil_div(C, block_cols), "ceil(cols / block_cols)");
  if (args.static_scales) detail::check_scales_finite(op, "scales", args.scales);
  if (device.type == DeviceType::kCUDA) detail::require_cuda_backend(op);
  if (x.numel() == 0) return;
  detail::run_quantize(detail::quantize_params(args), device, stream);
}

}  // namespace moelora
