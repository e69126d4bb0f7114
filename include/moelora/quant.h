// moelora public API: quantized experts — the schemes, and the quantization op the 8-bit
// schemes are built from.
//
// W8A8 (issue 28): a quantized tensor is its 8-bit elements (DType::kFloat8E4M3 or
// DType::kInt8) and fp32 scales, one per block of elements: value = element * scale.
// Weight-only (issue 30, w4a16 / w8a16): the weights are unsigned 4- or 8-bit integers
// (DType::kUInt8 bytes) with a zero point and a scale in the layer dtype per group of K:
// value = (q - zero) * scale; activations stay bf16/fp16. The schemes below name vLLM's
// and SGLang's (DESIGN.md, "Quantized experts").
#pragma once

#include <cstdint>
#include <string>

#include "moelora/tensor.h"

namespace moelora {

// How one operand's scales cover it.
//   kTensor:  one scale per tensor (weights: per expert, scales [E]; activations: [1])
//   kChannel: one per row (weights: per output channel, [E, N]; activations: per token, [M])
//   kBlock:   one per block (weights: block_n x block_k, [E, ceil(N/block_n), ceil(K/block_k)];
//             activations: per token group of block_k, [M, K / block_k])
enum class ScaleGranularity : int8_t { kTensor, kChannel, kBlock };

enum class QuantMethod : int8_t {
  kNone,
  kFp8Block,
  kFp8Channel,
  kFp8Tensor,
  kInt8Channel,
  kInt8Block,
  kW4A16,  // weight-only, 4-bit (GPTQ / AWQ int4)
  kW8A16,  // weight-only, 8-bit (GPTQ int8)
};

// A quantization scheme of a layer's experts, as data: the element type of weights and
// activations, and how the scales of each cover them. make_quant_scheme() fills it for
// a named method; the API validates any struct it is given.
struct QuantScheme {
  QuantMethod method = QuantMethod::kNone;
  DType element = DType::kFloat8E4M3;  // weights and activations: kFloat8E4M3 or kInt8
  ScaleGranularity weight_scales = ScaleGranularity::kBlock;
  ScaleGranularity activation_scales = ScaleGranularity::kBlock;
  int64_t block_n = 128;  // kBlock weights: rows (output channels) per scale
  int64_t block_k = 128;  // kBlock: K per scale, for weights and activations alike
  // kTensor activations only: the scales are given (static, from the checkpoint's
  // input_scale) instead of computed from each chunk's values (dynamic).
  bool static_activation_scales = false;
  // Weight-only schemes (element kUInt8; weight_scales kBlock with block_n = 1 and
  // block_k = group_size, or kChannel): the bits of a weight (4: two a byte along K, the
  // even k in the low nibble; 8: one a byte), the K of a scale group (32, 64 or 128; 0:
  // one group per output channel), and whether zero points come with the scales (else
  // the symmetric 8 / 128).
  int weight_bits = 8;
  int64_t group_size = 0;
  bool zero_points = false;

  bool enabled() const { return method != QuantMethod::kNone; }
  bool weight_only() const { return method == QuantMethod::kW4A16 || method == QuantMethod::kW8A16; }
};

// fp8_block (DeepSeek-V3, Qwen3-FP8: 128x128 weight blocks, 1x128 activation groups),
// fp8_channel (per output channel / per token), fp8_tensor (per expert / per tensor,
// dynamic unless static_activation_scales), int8_channel, int8_block. block_k also sets
// the activation group; block_n, block_k: 16 to 1024, powers of two.
QuantScheme make_quant_scheme(QuantMethod method, int64_t block_n = 128, int64_t block_k = 128,
                              bool static_activation_scales = false);
// w4a16 / w8a16 (vLLM's use_int4_w4a16 / use_int8_w8a16 with block_shape [0, group_size]):
// group_size 32, 64 or 128, or 0 for one scale per output channel; zero_points: the
// layer takes zero points (GPTQ sym=False, AWQ zero_point=True).
QuantScheme make_weight_only_scheme(QuantMethod method, int64_t group_size = 128, bool zero_points = false);
// "fp8_block", "fp8_channel", "fp8_tensor", "int8_channel", "int8_block", "w4a16",
// "w8a16"; throws moelora::Error for any other name.
QuantMethod quant_method_from_name(const std::string& name);
const char* quant_method_name(QuantMethod method);

// The largest magnitude an element holds: 448 (fp8 e4m3) or 127 (int8); 0 for others.
inline float quant_max(DType element) {
  return element == DType::kFloat8E4M3 ? 448.0f : element == DType::kInt8 ? 127.0f : 0.0f;
}
// Dynamic scales are max(absmax, kQuantAbsmaxFloor) / quant_max: an all-zero block gets a
// tiny positive scale instead of a division by zero (vLLM's eps).
constexpr float kQuantAbsmaxFloor = 1e-10f;

// ---------------------------------------------------------------------------------
// quantize: input [B, R, C] (or [R, C], B = 1) -> out (same shape, 8-bit) and scales
// [B, ceil(R / block_rows), ceil(C / block_cols)] (or rank 2 without B), one fp32 scale
// per block of block_rows x block_cols elements (0: the whole dim). Any strides on the
// scales: transposed strides give vLLM's column-major scales. input: bf16/fp16/fp32 with
// unit stride on C; out: unit stride on C.
//   dynamic (static_scales = false): absmax = max(max |x| over the block, 1e-10),
//       scale = absmax / qmax, written to `scales`.
//   static (static_scales = true): `scales` is read (each > 0 and finite).
//   out = fp8: saturate(round_to_nearest_even(x / scale)) to +-448;
//         int8: clamp(round_half_even(x / scale), -128, 127).
// (x / scale is an IEEE division on both backends, so CPU and CUDA agree bit for bit;
// vLLM's per-token-group kernels divide too, its per-tensor ones multiply by 1 / scale.)
// The usual cases: per token group (1, g) — per_token_group_quant; per token (1, 0);
// per tensor (0, 0); weights per 128x128 block (128, 128) or per channel (1, 0).
// CUDA: one launch for row blocks (block_rows == 1), else three (absmax into the scales,
// elements, scales); no host synchronisation either way.
struct QuantizeArgs {
  TensorView input;
  TensorView out;
  TensorView scales;
  int64_t block_rows = 1;
  int64_t block_cols = 128;
  bool static_scales = false;
};
void quantize(const QuantizeArgs& args, Stream stream = nullptr);

}  // namespace moelora
