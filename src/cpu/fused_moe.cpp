// CPU fused_moe: the grouped expert GEMM over the blocks of moe_align_block_size.
// See include/moelora/ops.h for the contract.
//
//   for block b < ceil(num_tokens_post_padded / block_size), e = expert_ids[b]:
//     for entry i of block b with slot s = sorted_token_ids[i] < num_slots:
//       out[s, n] = (e == -1) ? 0 : Σ_k a[s / top_k, k] · w[e, n, k]  (× topk_weights[s])
//
// W8A8 (GemmParams::quant): a and w are dequantized row by row (element × its scale)
// before the fp32 dot products; weight-only experts (GemmParams::weight_only): w's rows,
// (q - zero) × scale.
//
// Work items are (block, tile of N columns), so a few blocks with a wide N still keep
// every thread busy. Each item converts its a rows and each w row to fp32 once and
// reuses them across the whole tile.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/params.h"
#include "cpu/convert.h"
#include "cpu/parallel.h"

namespace moelora::cpu {
namespace {

// NOTE: 64 columns per item: the tile's a rows (<= block_size x K floats) are converted
// once per item, so the conversion is 1/64 of the multiply work.
constexpr int64_t kColumnsPerItem = 64;

// fp32 dot product. Sixteen independent partial sums: the compiler vectorises them
// (no reassociation needed) and the adds do not wait on one another.
float dot(const float* x, const float* y, int64_t count) {
  constexpr int kLanes = 16;
  float partial[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= count; k += kLanes) {
    for (int lane = 0; lane < kLanes; ++lane) partial[lane] += x[k + lane] * y[k + lane];
  }
  float sum = 0.0f;
  for (; k < count; ++k) sum += x[k] * y[k];
  for (int lane = 0; lane < kLanes; ++lane) sum += partial[lane];
  return sum;
}

// W8A8: row[k] *= the scale of element k of a's row `row` (weight = false) or of w's row
// `row` of `expert` (weight = true): dequantized values, so the dot below is the layer's.
void apply_scales(const detail::GemmQuantParams& q, bool weight, int64_t expert, int64_t row, int64_t K, float* values) {
  const ScaleGranularity g = weight ? q.w_scales : q.a_scales;
  const float* base = weight ? q.w_scale + expert * q.w_scale_stride_expert : q.a_scale;
  const int64_t stride_row = weight ? q.w_scale_stride_n : q.a_scale_stride_row;
  const int64_t stride_k = weight ? q.w_scale_stride_k : q.a_scale_stride_k;
  if (g == ScaleGranularity::kBlock) {
    const float* scales = base + (weight ? row / q.block_n : row) * stride_row;
    for (int64_t k0 = 0, kb = 0; k0 < K; k0 += q.block_k, ++kb) {
      const float scale = scales[kb * stride_k];
      for (int64_t k = k0; k < std::min(K, k0 + q.block_k); ++k) values[k] *= scale;
    }
    return;
  }
  const float scale = g == ScaleGranularity::kChannel ? base[row * stride_row] : base[0];
  for (int64_t k = 0; k < K; ++k) values[k] *= scale;
}

// Weight-only experts: dst[k] = (q - zero) * scale of w's row n of `expert` (exact in
// fp32: a scale of at most 11 significant bits times an integer of at most 9).
void load_weight_only_row(const detail::WeightOnlyParams& q, int64_t expert, int64_t n, int64_t K, float* dst) {
  const uint8_t* row = q.w + expert * q.w_stride_expert + n * q.w_stride_n;
  const int64_t group_size = q.group_size > 0 ? q.group_size : K;
  const uint16_t* scales = static_cast<const uint16_t*>(q.scale) + expert * q.scale_stride_expert + n * q.scale_stride_n;
  const uint8_t* zeros = q.zero ? q.zero + expert * q.zero_stride_expert + (q.zero_packed ? n / 2 : n) * q.zero_stride_n
                                : nullptr;
  for (int64_t k0 = 0, g = 0; k0 < K; k0 += group_size, ++g) {
    const uint16_t bits = scales[g * q.scale_stride_k];
    const float scale = q.scale_dtype == DType::kBFloat16 ? host::to_float(host::bf16{bits})
                                                          : host::to_float(host::fp16{bits});
    int zero = q.bits == 4 ? 8 : 128;
    if (zeros) {
      const int byte = zeros[g * q.zero_stride_k];
      zero = q.zero_packed ? (byte >> (4 * (n % 2))) & 15 : byte;
    }
    for (int64_t k = k0; k < std::min(K, k0 + group_size); ++k) {
      const int value = q.bits == 4 ? (row[k / 2] >> (4 * (k % 2))) & 15 : row[k];
      dst[k] = float(value - zero) * scale;
    }
  }
}

float routed_weight(const detail::GemmParams& p, int64_t slot) {
  return p.topk_weights[(slot / p.topk_weights_cols) * p.topk_weights_stride_row +
                        (slot % p.topk_weights_cols) * p.topk_weights_stride_col];
}

}  // namespace

void fused_moe(const detail::GemmParams& p) {
  // The API has checked every used expert id against [-1, num_experts).
  // NOTE: entries are read below min(num_used, sorted_token_ids_size): a count past the
  // buffer (a corrupt num_tokens_post_padded) must not read beyond it.
  const int64_t num_used = std::clamp<int64_t>(*p.num_tokens_post_padded, 0, p.sorted_token_ids_size);
  const int64_t num_blocks = std::min((num_used + p.block_size - 1) / p.block_size, p.max_num_blocks);

  const int64_t tiles_per_block = std::max<int64_t>(1, (p.N + kColumnsPerItem - 1) / kColumnsPerItem);
  const int64_t num_items = num_blocks * tiles_per_block;
  const int64_t dsize = int64_t(dtype_size(p.dtype));
  auto out_row = [&](int64_t slot) { return static_cast<char*>(p.out) + slot * p.out_stride_row * dsize; };

  parallel_for(0, num_items, [&](int64_t item) {
    const int64_t block = item / tiles_per_block;
    const int64_t n_begin = (item % tiles_per_block) * kColumnsPerItem;
    const int64_t n_end = std::min(p.N, n_begin + kColumnsPerItem);
    const int64_t width = n_end - n_begin;
    if (width <= 0) return;

    // The valid slots of this block; padding entries (the sentinel) are skipped.
    std::vector<int64_t> slots;
    slots.reserve(p.block_size);
    const int64_t entry_end = std::min(num_used, (block + 1) * p.block_size);
    for (int64_t i = block * p.block_size; i < entry_end; ++i) {
      const int64_t slot = p.sorted_token_ids[i];
      if (slot >= 0 && slot < p.num_slots) slots.push_back(slot);
    }
    if (slots.empty()) return;

    const int64_t expert = p.expert_ids[block];
    std::vector<float> out_tile(width);  // [width] one output row's tile
    if (expert == -1) {
      // A block whose expert is on another rank (or a dropped slot): zero rows.
      for (const int64_t slot : slots) {
        store_row(p.dtype, out_tile.data(), width, out_row(slot) + n_begin * p.out_stride_n * dsize, p.out_stride_n);
      }
      return;
    }

    const int64_t K = p.K;
    const DType operand = p.quant.enabled ? p.quant.element : p.dtype;  // of a and w
    std::vector<float> a_rows(slots.size() * K);  // [num_valid_slots, K]
    for (size_t r = 0; r < slots.size(); ++r) {
      const int64_t row = slots[r] / p.top_k;
      load_row(operand, element_ptr(operand, p.a, row * p.a_stride_row), p.a_stride_k, K, &a_rows[r * K]);
      if (p.quant.enabled) apply_scales(p.quant, false, 0, row, K, &a_rows[r * K]);
    }
    std::vector<float> w_tile(width * K);  // [width, K] w[expert, n_begin:n_end, :]
    for (int64_t n = 0; n < width; ++n) {
      const int64_t offset = expert * p.w_stride_expert + (n_begin + n) * p.w_stride_n;
      if (p.weight_only.enabled) {
        load_weight_only_row(p.weight_only, expert, n_begin + n, K, &w_tile[n * K]);
        continue;
      }
      load_row(operand, element_ptr(operand, p.w, offset), p.w_stride_k, K, &w_tile[n * K]);
      if (p.quant.enabled) apply_scales(p.quant, true, expert, n_begin + n, K, &w_tile[n * K]);
    }
    for (size_t r = 0; r < slots.size(); ++r) {
      const float scale = p.topk_weights ? routed_weight(p, slots[r]) : 1.0f;
      const float* a_row = &a_rows[r * K];
      for (int64_t n = 0; n < width; ++n) {
        const float acc = dot(a_row, &w_tile[n * K], K);
        out_tile[n] = p.topk_weights ? acc * scale : acc;
      }
      store_row(p.dtype, out_tile.data(), width, out_row(slots[r]) + n_begin * p.out_stride_n * dsize, p.out_stride_n);
    }
  });
}

}  // namespace moelora::cpu
