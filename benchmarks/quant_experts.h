// quant_bench's experts: one model's expert GEMMs in one quantized scheme on the run's
// device, with host copies for the float64 reference. 8-bit experts (W8A8: quantized from
// moelora_bench's bf16 weights by the op) and weight-only ones (w4a16 / w8a16: random packed
// codes). Included by benchmarks/quant_bench.cpp alone.
#pragma once

#include <cmath>
#include <memory>
#include <vector>

#include "layer_bench.h"
#include "moelora/ops.h"
#include "moelora/quant.h"

namespace moelora::bench {

using moelora::QuantMethod;
using moelora::QuantScheme;
using moelora::ScaleGranularity;

constexpr DType kQuantLayerDtype = DType::kBFloat16;  // the layer's activations and output

// ---- weight-only experts (w4a16 / w8a16, issue 30) -----------------------------------
// One expert GEMM's packed weights [E, N, K * bits / 8]: random codes (the timing does not
// depend on them), scales [E, N, K / G] (or [E, N]) in the layer dtype sized so the
// weights have moelora_bench's std (0.02), and zero points one a byte (--zero-points)
// around the middle of the range. Host copies for the reference.
struct WeightOnlyGemm {
  WeightOnlyGemm(bool cuda, const QuantScheme& s, int64_t E, int64_t N, int64_t K, uint64_t seed)
      : E(E), N(N), K(K), bits(s.weight_bits), group(s.group_size > 0 ? s.group_size : K), groups(K / group),
        packed_host(E * N * K * bits / 8), scale_host(E * N * groups), zero_host(s.zero_points ? E * N * groups : 0),
        packed(cuda, packed_host.size()), scales(cuda, scale_host.size() * 2), zeros(cuda, std::max<size_t>(1, zero_host.size())) {
    parallel_for(int64_t((packed_host.size() + 4095) / 4096), [&](int64_t block) {
      for (size_t i = size_t(block) * 4096; i < std::min(packed_host.size(), size_t(block + 1) * 4096); ++i) {
        packed_host[i] = uint8_t(splitmix64(seed ^ (i * 0x9E3779B97F4A7C15ull)));
      }
    });
    const int maxq = (1 << bits) - 1;
    // Uniform codes: std (maxq + 1) / sqrt(12) around the zero point.
    const double scale = 0.02 * std::sqrt(12.0) / (maxq + 1);
    for (size_t i = 0; i < scale_host.size(); ++i) {
      const double jitter = 0.75 + 0.5 * double(splitmix64(seed + 7 * i) % 1024) / 1024.0;
      scale_host[i] = moelora::host::to_bf16(float(scale * jitter)).bits;
    }
    for (size_t i = 0; i < zero_host.size(); ++i) zero_host[i] = uint8_t(maxq / 4 + splitmix64(seed + 13 * i) % (maxq / 2 + 1));
    const moelora::Device device = cuda ? moelora::Device{moelora::DeviceType::kCUDA, 0} : moelora::Device{};
    packed.upload(packed_host.data(), packed_host.size());
    scales.upload(scale_host.data(), scale_host.size() * 2);
    if (!zero_host.empty()) zeros.upload(zero_host.data(), zero_host.size());
    values_view = view(packed.ptr(), DType::kUInt8, {E, N, K * bits / 8}, device);
    scale_view = s.group_size > 0 ? view(scales.ptr(), kQuantLayerDtype, {E, N, groups}, device) : view(scales.ptr(), kQuantLayerDtype, {E, N}, device);
    zero_view = s.group_size > 0 ? view(zeros.ptr(), DType::kUInt8, {E, N, groups}, device)
                                 : view(zeros.ptr(), DType::kUInt8, {E, N}, device);
  }
  // Bytes of one expert: its packed weights, scales and zero points.
  double expert_bytes() const { return double(N) * K * bits / 8 + double(N) * groups * (2 + (zero_host.empty() ? 0 : 1)); }
  // Row n of expert e, dequantized: out[K].
  void row(int64_t e, int64_t n, double* out) const {
    const uint8_t* q = packed_host.data() + (e * N + n) * K * bits / 8;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t g = (e * N + n) * groups + k / group;
      const int code = bits == 4 ? (q[k / 2] >> (4 * (k % 2))) & 15 : q[k];
      const int zero = zero_host.empty() ? 1 << (bits - 1) : zero_host[g];
      out[k] = double(code - zero) * moelora::host::to_float(moelora::host::bf16{scale_host[g]});
    }
  }

  int64_t E, N, K;
  int bits;
  int64_t group, groups;
  std::vector<uint8_t> packed_host;
  std::vector<uint16_t> scale_host;
  std::vector<uint8_t> zero_host;
  Buffer packed, scales, zeros;
  TensorView values_view, scale_view, zero_view;
};

// ---- quantized experts ----------------------------------------------------------------
// The scale blocks of one expert GEMM's weights [E, N, K]: rows x cols elements per scale
// (quantize's block_rows / block_cols; 0: the whole dim), RB x CB scales per expert.
struct ScaleGrid {
  int64_t rows, cols, RB, CB;
  int64_t index(int64_t e, int64_t n, int64_t k) const {
    return (e * RB + (rows ? n / rows : 0)) * CB + (cols ? k / cols : 0);
  }
};

inline ScaleGrid scale_grid(const QuantScheme& s, int64_t N, int64_t K) {
  switch (s.weight_scales) {
    case ScaleGranularity::kBlock:
      return {s.block_n, s.block_k, (N + s.block_n - 1) / s.block_n, (K + s.block_k - 1) / s.block_k};
    case ScaleGranularity::kChannel: return {1, 0, N, 1};
    default: return {0, 0, 1, 1};
  }
}

// One expert GEMM's weights [E, N, K] on the run's device: 8-bit elements and fp32
// scales, quantized from bf16 by the op; host copies (download()) for the reference.
struct QuantGemm {
  QuantGemm(bool cuda, const QuantScheme& s, int64_t E, int64_t N, int64_t K, const void* bf16_weights)
      : E(E), N(N), K(K), element(s.element), grid(scale_grid(s, N, K)),
        values(cuda, E * N * K), scales(cuda, E * grid.RB * grid.CB * 4) {
    const moelora::Device device = cuda ? moelora::Device{moelora::DeviceType::kCUDA, 0} : moelora::Device{};
    moelora::quantize(moelora::QuantizeArgs{
        .input = view(const_cast<void*>(bf16_weights), kQuantLayerDtype, {E, N, K}, device),
        .out = view(values.ptr(), element, {E, N, K}, device),
        .scales = view(scales.ptr(), DType::kFloat32, {E, grid.RB, grid.CB}, device),
        .block_rows = grid.rows,
        .block_cols = grid.cols,
    });
    // fused_experts' scale shapes: [E, RB, CB] blocks, [E, N] channels, [E] tensors.
    scale_view = s.weight_scales == ScaleGranularity::kBlock ? view(scales.ptr(), DType::kFloat32, {E, grid.RB, grid.CB}, device)
                 : s.weight_scales == ScaleGranularity::kChannel ? view(scales.ptr(), DType::kFloat32, {E, N}, device)
                                                                 : view(scales.ptr(), DType::kFloat32, {E}, device);
  }
  void download() {
    host_values.resize(E * N * K);
    host_scales.resize(E * grid.RB * grid.CB);
    values.download(host_values.data(), host_values.size());
    scales.download(host_scales.data(), host_scales.size() * 4);
  }
  // Bytes of one expert: its elements and scales.
  double expert_bytes() const { return double(N) * K + 4.0 * grid.RB * grid.CB; }

  int64_t E, N, K;
  DType element;
  ScaleGrid grid;
  Buffer values, scales;
  TensorView scale_view;
  std::vector<uint8_t> host_values;
  std::vector<float> host_scales;
};

// One model's experts in one scheme, and the fused_experts argument naming them.
struct QuantExperts {
  QuantScheme scheme;
  std::unique_ptr<QuantGemm> w13, w2;
  std::unique_ptr<WeightOnlyGemm> wo13, wo2;  // weight-only schemes instead
  const void* w13_values() const { return wo13 ? wo13->packed.ptr() : w13->values.ptr(); }
  const void* w2_values() const { return wo2 ? wo2->packed.ptr() : w2->values.ptr(); }
  double expert_bytes() const {
    return wo13 ? wo13->expert_bytes() + wo2->expert_bytes() : w13->expert_bytes() + w2->expert_bytes();
  }
  std::unique_ptr<Buffer> static_scales;  // [2]: a13, a2 (static activation scales)
  double a13 = 0, a2 = 0;                 // their values (0: dynamic)
  TensorView a13_view, a2_view;
  moelora::FusedExpertsQuant args;
};

inline std::unique_ptr<QuantExperts> weight_only_experts(const Model& m, QuantMethod method, int64_t group,
                                                         bool zero_points, bool cuda) {
  auto q = std::make_unique<QuantExperts>();
  // gpt-oss's 2880 takes groups of 64 at most (vLLM halves the group until it divides).
  int64_t g = group;
  while (g > 32 && (m.H % g != 0 || m.I % g != 0)) g /= 2;
  q->scheme = moelora::make_weight_only_scheme(method, g, zero_points);
  q->wo13 = std::make_unique<WeightOnlyGemm>(cuda, q->scheme, m.E, 2 * m.I, m.H, 21);
  q->wo2 = std::make_unique<WeightOnlyGemm>(cuda, q->scheme, m.E, m.H, m.I, 22);
  q->args = moelora::FusedExpertsQuant{.scheme = q->scheme, .w13_scale = q->wo13->scale_view,
                                       .w2_scale = q->wo2->scale_view,
                                       .w13_zero = zero_points ? &q->wo13->zero_view : nullptr,
                                       .w2_zero = zero_points ? &q->wo2->zero_view : nullptr};
  return q;
}

inline std::unique_ptr<QuantExperts> quantize_experts(const Model& m, QuantMethod method, bool static_act, bool cuda,
                                                      const void* w13, const void* w2, const float calibrated[2]) {
  auto q = std::make_unique<QuantExperts>();
  q->scheme = moelora::make_quant_scheme(method, 128, 128, static_act && method == QuantMethod::kFp8Tensor);
  q->w13 = std::make_unique<QuantGemm>(cuda, q->scheme, m.E, 2 * m.I, m.H, w13);
  q->w2 = std::make_unique<QuantGemm>(cuda, q->scheme, m.E, m.H, m.I, w2);
  q->args = moelora::FusedExpertsQuant{.scheme = q->scheme, .w13_scale = q->w13->scale_view,
                                       .w2_scale = q->w2->scale_view};
  if (q->scheme.static_activation_scales) {
    const moelora::Device device = cuda ? moelora::Device{moelora::DeviceType::kCUDA, 0} : moelora::Device{};
    q->static_scales = std::make_unique<Buffer>(cuda, 8);
    q->static_scales->upload(calibrated, 8);
    q->a13 = calibrated[0];
    q->a2 = calibrated[1];
    q->a13_view = view(q->static_scales->ptr(), DType::kFloat32, {1}, device);
    q->a2_view = view(static_cast<float*>(q->static_scales->ptr()) + 1, DType::kFloat32, {1}, device);
    q->args.a13_scale = &q->a13_view;
    q->args.a2_scale = &q->a2_view;
  }
  return q;
}

}  // namespace moelora::bench
