// CPU gated activations: input [num_rows, 2 * width] -> out [num_rows, width].
// See include/moelora/ops.h for the contract. Computed in fp32 from the dtype-rounded
// inputs, rounded once to the output dtype.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common/params.h"
#include "cpu/convert.h"
#include "cpu/parallel.h"

namespace moelora::cpu {
namespace {

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
float silu(float x) { return x * sigmoid(x); }
float gelu_erf(float x) { return 0.5f * x * (1.0f + std::erf(x * 0.70710678118654752f)); }

}  // namespace

void activation(const detail::ActivationParams& p) {
  const int64_t width = p.width;
  // NOTE: a thread is worth starting for ~64K elements of work.
  const int64_t rows_per_thread = std::max<int64_t>(1, 65536 / std::max<int64_t>(width, 1));
  parallel_for(0, p.num_rows, [&](int64_t row) {
    std::vector<float> input(2 * width);  // [2 * width] gate and up of this row
    std::vector<float> out(width);        // [width]
    load_row(p.dtype, element_ptr(p.dtype, p.input, row * p.input_stride_row), 1, 2 * width, input.data());
    switch (p.kind) {
      case detail::ActivationKind::kSiluAndMul:
        // gate = input[:width], up = input[width:]
        for (int64_t i = 0; i < width; ++i) out[i] = silu(input[i]) * input[width + i];
        break;
      case detail::ActivationKind::kGeluAndMul:
        for (int64_t i = 0; i < width; ++i) out[i] = gelu_erf(input[i]) * input[width + i];
        break;
      case detail::ActivationKind::kSwigluOai:
        // gpt-oss stores gate and up interleaved: gate = input[0::2], up = input[1::2].
        for (int64_t i = 0; i < width; ++i) {
          const float gate = std::min(input[2 * i], p.limit);
          const float up = std::clamp(input[2 * i + 1], -p.limit, p.limit);
          out[i] = (up + 1.0f) * gate * sigmoid(p.alpha * gate);
        }
        break;
    }
    store_row(p.out_dtype, out.data(), width, element_ptr(p.out_dtype, p.out, row * p.out_stride_row), 1);
  }, rows_per_thread);
}

}  // namespace moelora::cpu
