// What the fused_experts tests on quantized experts share (test_quant.cpp: 8-bit W8A8,
// test_weight_only.cpp: w4a16 / w8a16): the case's layer dimensions, and the layer's
// inputs and outputs around the experts: hidden states, a random expert_map (a shuffled
// subset of the global experts is local), routing and router weights, LoRA stacks and
// adapter ids, out and workspace (poisoned); their FusedExpertsArgs for given weights and
// the float64 reference on given dequantized weights.
#pragma once

#include <algorithm>
#include <functional>
#include <numeric>
#include <optional>
#include <random>
#include <vector>

#include "lora_testing.h"
#include "test_util.h"

namespace moelora::test {

struct QuantLayerDims {
  Backend backend = Backend::kCPU;
  DType dtype = DType::kBFloat16;
  int64_t M = 20, top_k = 2, H = 256, I = 128;
  int64_t num_global = 8, num_local = 8;  // num_global > num_local: an expert_map with -1
  double dropped_share = 0.0;             // slots routed to -1
  int64_t lora_rank = 0;                  // > 0: kAdapters adapters of this rank
  double lora_share = 1.0;                // of the tokens with an adapter
  bool inplace = false;                   // out is hidden_states
  FusedExpertsOptions options{};
};

constexpr int64_t kQuantLayerAdapters = 4;

inline FusedExpertsShape quant_layer_shape(const QuantLayerDims& d, const QuantScheme& scheme) {
  FusedExpertsShape s{d.M, d.top_k, d.num_global, d.H, d.I, d.dtype, d.num_local};
  s.quant = scheme;
  if (d.lora_rank > 0) {
    s.max_loras = kQuantLayerAdapters;
    s.lora_rank = d.lora_rank;
  }
  return s;
}

struct QuantLayerIo {
  // routing(local experts, rng): topk_ids [M, top_k] (before dropped_share's -1s).
  using Routing = std::function<std::vector<int64_t>(const std::vector<int64_t>& local, std::mt19937& rng)>;

  QuantLayerIo(const QuantLayerDims& d, const FusedExpertsShape& shape, std::mt19937& rng, const Routing& routing)
      : d(d),
        x(d.backend, d.dtype, std::max<int64_t>(1, d.M * d.H)),
        topk_weights(d.backend, DType::kFloat32, std::max<int64_t>(1, d.M * d.top_k)),
        topk_ids(d.backend, DType::kInt32, std::max<int64_t>(1, d.M * d.top_k)),
        expert_map(d.backend, DType::kInt32, d.num_global),
        out(d.backend, d.dtype, std::max<int64_t>(1, d.M * (d.options.no_combine ? d.top_k : 1) * d.H)),
        lora_ids(d.backend, DType::kInt32, std::max<int64_t>(1, d.M)),
        workspace(d.backend, DType::kFloat32, (fused_experts_workspace_size(shape, d.options) + 3) / 4) {
    x_view = x.view({d.M, d.H});
    x_values = x.fill_normal(x_view, rng);
    x.upload();
    std::vector<int64_t> global(size_t(d.num_global));
    std::iota(global.begin(), global.end(), 0);
    std::shuffle(global.begin(), global.end(), rng);
    const std::vector<int64_t> local(global.begin(), global.begin() + d.num_local);
    map.assign(size_t(d.num_global), -1);
    for (int64_t i = 0; i < d.num_local; ++i) map[size_t(local[size_t(i)])] = int32_t(i);
    expert_map.write(expert_map.view({d.num_global}), std::vector<double>(map.begin(), map.end()));
    ids = routing(local, rng);
    std::bernoulli_distribution drop(d.dropped_share);
    for (auto& id : ids) id = drop(rng) ? -1 : id;
    weight_values = random_router_weights(d.M, d.top_k, rng);
    topk_weights.write(topk_weights.view({d.M, d.top_k}), weight_values);
    topk_ids.write(topk_ids.view({d.M, d.top_k}), std::vector<double>(ids.begin(), ids.end()));
    for (Buffer* b : {&topk_weights, &topk_ids, &expert_map}) b->upload();
    if (d.lora_rank > 0) {
      stack13.emplace(d.backend, d.dtype, 2, kQuantLayerAdapters, d.num_local, d.lora_rank, d.H, 2 * d.I,
                      d.options.activation == Activation::kSwigluOai, rng);
      stack2.emplace(d.backend, d.dtype, 1, kQuantLayerAdapters, d.num_local, d.lora_rank, d.I, d.H, false, rng);
      token_loras = random_token_loras(d.M, kQuantLayerAdapters, d.lora_share, rng);
      lora_ids.write(lora_ids.view({d.M}), std::vector<double>(token_loras.begin(), token_loras.end()));
      lora_ids.upload();
    }
    out.poison();
    workspace.poison();
  }

  // The call on weights w13 / w2 (views of the scheme's elements) and their quant.
  FusedExpertsArgs args(const TensorView& w13, const TensorView& w2, const FusedExpertsQuant* quant) {
    map_view = expert_map.view({d.num_global});
    FusedExpertsArgs a;
    a.hidden_states = x_view;
    a.w13 = w13;
    a.w2 = w2;
    a.topk_weights = topk_weights.view({d.M, d.top_k});
    a.topk_ids = topk_ids.view({d.M, d.top_k});
    a.out = d.inplace ? x_view : d.options.no_combine ? out.view({d.M, d.top_k, d.H}) : out.view({d.M, d.H});
    a.workspace = workspace.view({workspace.size()});
    a.expert_map = d.num_global > d.num_local ? &map_view : nullptr;
    a.quant = quant;
    if (d.lora_rank > 0) {
      lora.adapters = MoeLoraAdapters{lora_ids.view({d.M}), nullptr, nullptr};
      lora.w13 = stack13->weights;
      lora.w2 = stack2->weights;
      a.lora = &lora;
    }
    return a;
  }

  // The float64 layer on the dequantized weights (with the op's activation quantization
  // when rq is given).
  std::vector<double> reference(const std::vector<double>& w13, const std::vector<double>& w2,
                                const ref::RefQuant* rq = nullptr) const {
    ref::RefLora rl;
    if (d.lora_rank > 0) {
      rl.token_lora = token_loras;
      rl.scale.assign(kQuantLayerAdapters, 1.0);
      rl.w13 = stack13->ref;
      rl.w2 = stack2->ref;
    }
    return ref::reference_fused_experts(x_values, w13, w2, weight_values, ids, d.M, d.top_k, d.num_local, d.H, d.I,
                                        d.num_global > d.num_local ? map.data() : nullptr, d.options.activation,
                                        d.options.swiglu_alpha, d.options.swiglu_limit,
                                        d.options.apply_router_weight_on_input, d.options.no_combine,
                                        d.options.routed_scaling_factor, d.lora_rank > 0 ? &rl : nullptr, rq);
  }

  const QuantLayerDims& d;
  Buffer x, topk_weights, topk_ids, expert_map, out, lora_ids, workspace;
  std::optional<LoraStackData> stack13, stack2;
  std::vector<double> x_values, weight_values;
  std::vector<int64_t> ids, token_loras;
  std::vector<int32_t> map;
  TensorView x_view, map_view;
  FusedExpertsLora lora;
};

}  // namespace moelora::test
