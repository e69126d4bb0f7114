// CPU quantize: one fp32 scale per block of block_rows x block_cols elements, then every
// element divided by its block's scale and rounded to the 8-bit type.
// See include/moelora/quant.h for the contract; the CUDA kernels compute the same values.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common/host_numeric.h"
#include "common/params.h"
#include "cpu/convert.h"
#include "cpu/parallel.h"

namespace moelora::cpu {

void quantize(const detail::QuantizeParams& p) {
  const float qmax = quant_max(p.out_dtype);
  const int64_t row_blocks = (p.rows + p.block_rows - 1) / p.block_rows;
  const int64_t col_blocks = (p.cols + p.block_cols - 1) / p.block_cols;
  // Items are (batch, block row): each owns its rows of out and its row of scales.
  parallel_for(0, p.batch * row_blocks, [&](int64_t item) {
    const int64_t b = item / row_blocks, rb = item % row_blocks;
    const int64_t row_begin = rb * p.block_rows, row_end = std::min(p.rows, row_begin + p.block_rows);
    const int64_t num_rows = row_end - row_begin;
    std::vector<float> block(size_t(num_rows * p.cols));  // [num_rows, cols] the block row in fp32
    for (int64_t r = 0; r < num_rows; ++r) {
      const int64_t offset = b * p.input_stride_batch + (row_begin + r) * p.input_stride_row;
      load_row(p.input_dtype, element_ptr(p.input_dtype, p.input, offset), 1, p.cols, &block[size_t(r * p.cols)]);
    }
    std::vector<float> quantized(size_t(p.cols));
    for (int64_t cb = 0; cb < col_blocks; ++cb) {
      const int64_t col_begin = cb * p.block_cols, col_end = std::min(p.cols, col_begin + p.block_cols);
      float* scale = p.scales + b * p.scales_stride_batch + rb * p.scales_stride_row + cb * p.scales_stride_col;
      if (!p.static_scales) {
        float absmax = 0.0f;
        for (int64_t r = 0; r < num_rows; ++r) {
          for (int64_t c = col_begin; c < col_end; ++c) absmax = std::max(absmax, std::fabs(block[size_t(r * p.cols + c)]));
        }
        *scale = std::max(absmax, kQuantAbsmaxFloor) / qmax;
      }
      const float s = *scale;
      for (int64_t r = 0; r < num_rows; ++r) {
        float* values = &block[size_t(r * p.cols)];
        for (int64_t c = col_begin; c < col_end; ++c) values[c] = std::clamp(values[c] / s, -qmax, qmax);
      }
    }
    for (int64_t r = 0; r < num_rows; ++r) {
      const int64_t offset = b * p.out_stride_batch + (row_begin + r) * p.out_stride_row;
      store_row(p.out_dtype, &block[size_t(r * p.cols)], p.cols, element_ptr(p.out_dtype, p.out, offset), 1);
    }
  });
}

}  // namespace moelora::cpu
