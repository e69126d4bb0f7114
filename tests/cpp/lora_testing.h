// LoRA test data shared by the LoRA and the quantized-layer tests: random adapter ids,
// their resolution against the enabled mask, and one GEMM's stacks on a backend with
// their double copy for the reference.
#pragma once

#include <cmath>
#include <random>
#include <vector>

#include "test_util.h"

namespace moelora::test {

// Adapter of each token: share of them get one (uniform over the slots), the rest -1.
inline std::vector<int64_t> random_token_loras(int64_t M, int64_t max_loras, double share, std::mt19937& rng) {
  std::vector<int64_t> ids(static_cast<size_t>(M), -1);
  std::bernoulli_distribution has(share);
  std::uniform_int_distribution<int64_t> pick(0, max_loras - 1);
  for (auto& id : ids) {
    if (has(rng)) id = pick(rng);
  }
  return ids;
}

// The adapter a token runs with: -1 when it has none or its slot is disabled.
inline std::vector<int64_t> resolve_loras(const std::vector<int64_t>& ids, const std::vector<int32_t>& enabled) {
  std::vector<int64_t> resolved(ids);
  for (auto& id : resolved) {
    if (id >= 0 && !enabled[size_t(id)]) id = -1;
  }
  return resolved;
}

// One GEMM's stacks on a backend plus their double copy.
struct LoraStackData {
  std::vector<Buffer> a, b;
  MoeLoraWeights weights;
  ref::RefLoraStack ref;

  LoraStackData(Backend backend, DType dtype, int num_slices, int64_t L, int64_t E, int64_t rank, int64_t K,
                int64_t N, bool interleaved, std::mt19937& rng, double b_scale = 0.5) {
    ref.num_slices = num_slices;
    ref.max_loras = L;
    ref.num_experts = E;
    ref.rank = rank;
    ref.K = K;
    ref.N = N;
    ref.interleaved = interleaved;
    weights.num_slices = num_slices;
    weights.interleaved_slices = interleaved;
    const int64_t n_slice = N / num_slices;
    for (int c = 0; c < num_slices; ++c) {
      a.emplace_back(backend, dtype, L * E * rank * K);
      b.emplace_back(backend, dtype, L * E * n_slice * rank);
      weights.lora_a[c] = a.back().view({L, E, rank, K});
      weights.lora_b[c] = b.back().view({L, E, n_slice, rank});
      // |delta| ~ b_scale of the base output's size: the LoRA path must be visible.
      ref.lora_a[c] = a.back().fill_normal(weights.lora_a[c], rng, 1.0 / std::sqrt(double(K)));
      ref.lora_b[c] = b.back().fill_normal(weights.lora_b[c], rng, b_scale / std::sqrt(double(rank)));
      a.back().upload();
      b.back().upload();
    }
  }
};

}  // namespace moelora::test
