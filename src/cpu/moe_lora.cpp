// CPU moe_lora_delta: the LoRA delta of an expert GEMM, per slot (the reference backend).
// See LoraDeltaParams in src/common/params.h and fused_moe_lora in include/moelora/ops.h.
//
//   for every slot s with an adapter l (enabled, in range) and an expert e >= 0:
//     t_c = round_to_dtype(a[s / a_top_k] · lora_a[c][l, e]ᵀ)             [rank], c < S
//     out[s, col(c, j)] = (add_inputs ? out : 0) + scale[l] · t_c · lora_b[c][l, e, j]
//                          (× the routed weight of s)
//   every other slot: out row kept (add_inputs) or zeroed.
// The intermediate t is rounded to the dtype as the CUDA kernels store it, so both
// backends compute the same thing; it is also written to p.intermediate.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/params.h"
#include "cpu/convert.h"
#include "cpu/parallel.h"

namespace moelora::cpu {
namespace {

int32_t adapter_of_token(const detail::LoraAdapterParams& a, int64_t token) {
  const int32_t id = a.token_lora_ids[token * a.token_lora_ids_stride];
  if (id < 0 || id >= a.max_loras) return -1;
  if (a.adapter_enabled != nullptr && a.adapter_enabled[id] == 0) return -1;
  return id;
}

int64_t expert_of_slot(const detail::LoraDeltaParams& p, int64_t slot) {
  const int64_t token = slot / p.top_k, j = slot % p.top_k;
  const int64_t offset = token * p.topk_ids_stride_token + j * p.topk_ids_stride_k;
  const int64_t e = p.topk_ids_int64 ? static_cast<const int64_t*>(p.topk_ids)[offset]
                                     : int64_t(static_cast<const int32_t*>(p.topk_ids)[offset]);
  if (e < 0 || e >= p.num_global_experts) return -1;
  const int64_t local = p.expert_map ? p.expert_map[e] : e;
  return local < p.num_experts ? local : -1;
}

// Σ_k v[k] · row[k] over a stack row of n unit-stride elements (loaded into scratch).
float dot_with_row(DType dtype, const void* row, const float* v, int64_t n, float* scratch) {
  load_row(dtype, row, 1, n, scratch);
  float acc = 0.f;
  for (int64_t k = 0; k < n; ++k) acc += v[k] * scratch[k];
  return acc;
}

}  // namespace

void moe_lora_delta(const detail::LoraDeltaParams& p) {
  // (expert, adapter) of every slot; -1 where the slot gets no delta.
  std::vector<int64_t> slot_expert(p.num_slots, -1), slot_adapter(p.num_slots, -1);
  if (p.sorted_token_ids == nullptr) {
    for (int64_t s = 0; s < p.num_slots; ++s) {
      slot_expert[s] = expert_of_slot(p, s);
      slot_adapter[s] = adapter_of_token(p.adapters, s / p.top_k);
    }
  } else {
    const int64_t used = std::clamp<int64_t>(*p.num_tokens_post_padded, 0, p.max_num_tokens_padded);
    const int64_t blocks = std::min((used + p.block_size - 1) / p.block_size, p.max_num_blocks);
    for (int64_t b = 0; b < blocks; ++b) {
      for (int64_t i = b * p.block_size; i < std::min(used, (b + 1) * p.block_size); ++i) {
        const int64_t s = p.sorted_token_ids[i];
        if (s < 0 || s >= p.num_slots) continue;
        slot_expert[s] = p.expert_ids[b];
        slot_adapter[s] = p.block_lora_ids[b];
      }
    }
  }

  const int64_t N = p.N_slice * p.num_slices;
  const int64_t dsize = int64_t(dtype_size(p.dtype));
  parallel_for(0, p.num_slots, [&](int64_t s) {
    const int64_t e = slot_expert[s], l = slot_adapter[s];
    void* out_row = static_cast<char*>(p.out) + s * p.out_stride_row * dsize;
    std::vector<float> row(N);  // [N] the output row in fp32
    const bool active = e >= 0 && e < p.num_experts && l >= 0 && l < p.adapters.max_loras;
    if (p.add_inputs) {
      if (!active) return;
      load_row(p.dtype, out_row, p.out_stride_n, N, row.data());
    }
    if (!active) {
      store_row(p.dtype, row.data(), N, out_row, p.out_stride_n);  // zeros
      return;
    }
    const float scale = (p.adapters.adapter_scale ? p.adapters.adapter_scale[l] : 1.0f) *
                        (p.topk_weights ? p.topk_weights[(s / p.topk_weights_cols) * p.topk_weights_stride_row +
                                                         (s % p.topk_weights_cols) * p.topk_weights_stride_col]
                                        : 1.0f);
    std::vector<float> a_row(p.K), lora_row(std::max(p.K, p.rank)), t(p.rank);
    load_row(p.dtype, element_ptr(p.dtype, p.a, (s / p.a_top_k) * p.a_stride_row), 1, p.K, a_row.data());
    for (int c = 0; c < p.num_slices; ++c) {
      const detail::LoraSliceParams& sl = p.slices[c];
      for (int64_t i = 0; i < p.rank; ++i) {
        t[i] = dot_with_row(
            p.dtype, element_ptr(p.dtype, sl.lora_a, l * sl.a_stride_lora + e * sl.a_stride_expert + i * sl.a_stride_rank),
            a_row.data(), p.K, lora_row.data());
      }
      // Round the intermediate as the CUDA kernels store it.
      void* t_out = element_ptr(p.dtype, p.intermediate, (s * p.num_slices + c) * p.rank);
      store_row(p.dtype, t.data(), p.rank, t_out, 1);
      load_row(p.dtype, t_out, 1, p.rank, t.data());
      for (int64_t j = 0; j < p.N_slice; ++j) {
        const float acc = dot_with_row(
            p.dtype, element_ptr(p.dtype, sl.lora_b, l * sl.b_stride_lora + e * sl.b_stride_expert + j * sl.b_stride_n),
            t.data(), p.rank, lora_row.data());
        const int64_t col = p.interleaved_slices ? j * p.num_slices + c : c * p.N_slice + j;
        row[col] += scale * acc;
      }
    }
    store_row(p.dtype, row.data(), N, out_row, p.out_stride_n);
  });
}

}  // namespace moelora::cpu
