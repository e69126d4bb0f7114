// CPU sparse MLA decode: one pass per token over its valid indices, in fp32 from the
// bf16 inputs (two-pass softmax: logits, then their max, then the weighted sum), the
// output rounded once to bf16. See include/moelora/ops.h for the contract.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common/params.h"
#include "cpu/convert.h"
#include "cpu/parallel.h"

namespace moelora::cpu {

void sparse_mla_decode(const detail::SparseMlaDecodeParams& p) {
  constexpr int64_t D = kMlaHeadDim, DV = kMlaValueDim;
  const DType bf16 = DType::kBFloat16;
  parallel_for(0, p.num_tokens, [&](int64_t t) {
    // The token's valid rows, in index order (duplicates kept: each counts).
    const int64_t length = p.topk_length
                               ? std::clamp<int64_t>(p.topk_length[t * p.topk_length_stride], 0, p.topk)
                               : p.topk;
    std::vector<int64_t> rows;
    for (int64_t i = 0; i < length; ++i) {
      const int64_t row = p.indices[t * p.indices_stride_token + i];
      if (row >= 0 && row < p.num_kv_rows) rows.push_back(row);
    }
    const int64_t n = int64_t(rows.size());
    std::vector<float> kv(size_t(n * D));  // [n, D] the gathered rows
    for (int64_t j = 0; j < n; ++j) {
      load_row(bf16, element_ptr(bf16, p.kv, rows[size_t(j)] * p.kv_stride_row), 1, D, &kv[size_t(j * D)]);
    }
    std::vector<float> q(D), logits(static_cast<size_t>(n)), out(DV);
    for (int64_t h = 0; h < p.num_heads; ++h) {
      load_row(bf16, element_ptr(bf16, p.q, t * p.q_stride_token + h * p.q_stride_head), 1, D, q.data());
      float max_logit = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        float dot = 0.0f;
        for (int64_t d = 0; d < D; ++d) dot += q[size_t(d)] * kv[size_t(j * D + d)];
        logits[size_t(j)] = dot * p.softmax_scale;
        max_logit = std::max(max_logit, logits[size_t(j)]);
      }
      std::fill(out.begin(), out.end(), 0.0f);
      float sum = 0.0f;
      for (int64_t j = 0; j < n; ++j) {
        const float weight = std::exp(logits[size_t(j)] - max_logit);
        sum += weight;
        for (int64_t d = 0; d < DV; ++d) out[size_t(d)] += weight * kv[size_t(j * D + d)];
      }
      // The sink joins the denominator only; with no valid row the output stays zero.
      float denominator = sum;
      if (p.attn_sink && n > 0) denominator += std::exp(p.attn_sink[h * p.attn_sink_stride] - max_logit);
      const float inv = n > 0 ? 1.0f / denominator : 0.0f;
      for (float& v : out) v *= inv;
      store_row(bf16, out.data(), DV, element_ptr(bf16, p.out, t * p.out_stride_token + h * p.out_stride_head), 1);
      if (p.lse) {
        p.lse[t * p.lse_stride_token + h * p.lse_stride_head] =
            n > 0 ? max_logit + std::log(sum) : -std::numeric_limits<float>::infinity();
      }
    }
  });
}

}  // namespace moelora::cpu
