// CPU moe_sum_reduce: input [num_tokens, top_k, hidden] -> out [num_tokens, hidden]
//   out[m, h] = scale * Σ_j input[m, j, h], fp32, j ascending (deterministic).
// See include/moelora/ops.h for the contract.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/params.h"
#include "cpu/convert.h"
#include "cpu/parallel.h"

namespace moelora::cpu {

void moe_sum_reduce(const detail::SumReduceParams& p) {
  const int64_t hidden = p.hidden;
  // NOTE: a thread is worth starting for ~64K elements of work.
  const int64_t tokens_per_thread = std::max<int64_t>(1, 65536 / std::max<int64_t>(hidden * p.top_k, 1));
  parallel_for(0, p.num_tokens, [&](int64_t token) {
    std::vector<float> sum(hidden, 0.0f);  // [hidden]
    std::vector<float> row(hidden);        // [hidden] input[token, j, :]
    for (int64_t j = 0; j < p.top_k; ++j) {
      const int64_t offset = token * p.input_stride_token + j * p.input_stride_k;
      load_row(p.dtype, element_ptr(p.dtype, p.input, offset), 1, hidden, row.data());
      for (int64_t h = 0; h < hidden; ++h) sum[h] += row[h];
    }
    for (int64_t h = 0; h < hidden; ++h) sum[h] *= p.scale;
    store_row(p.dtype, sum.data(), hidden, element_ptr(p.dtype, p.out, token * p.out_stride_token), 1);
  }, tokens_per_thread);
}

}  // namespace moelora::cpu
