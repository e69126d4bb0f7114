// fused_experts' layer test problem, shared by test_fused_experts.cpp (the layer against
// its float64 reference over the cases) and test_fused_experts_checks.cpp (per-backend
// checks: workspace, bad arguments, repeated calls): one case's shapes and options, its
// routing, and every buffer of one call, filled, uploaded and poisoned, with the reference;
// and grouped_config, which the quantized and LoRA layer tests use too.
#pragma once

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "api/fused_experts_plan.h"
#include "common/params.h"
#include "test_util.h"

namespace moelora::test {

// Whether a fused_experts call took the grouped path: only it writes the alignment's
// per-slot entries, so with the workspace poisoned before the call their first word tells.
inline bool grouped_path_ran(const detail::WorkspaceLayout& layout, Buffer& workspace) {
  if (layout.grouped_rows == 0) return false;
  workspace.download();
  return !workspace.is_poison(layout.grouped_slot_entries / 4);
}

// A config that forces a chunk onto the grouped GEMMs (MoeKernelConfig::grouped_gemm) with
// these tiles for GEMM1 and GEMM2 (kAuto: the heuristic's). Static storage: the options keep
// a pointer to it.
inline const MoeKernelConfig* grouped_config(GroupedGemmTiles tiles1 = GroupedGemmTiles::kAuto,
                                             GroupedGemmTiles tiles2 = GroupedGemmTiles::kAuto) {
  constexpr int kKinds = 4;  // GroupedGemmTiles' values
  static const auto configs = [] {
    std::vector<MoeKernelConfig> all(kKinds * kKinds);
    for (int i = 0; i < kKinds * kKinds; ++i) {
      all[i] = {.grouped_gemm = true, .grouped_tiles1 = GroupedGemmTiles(i / kKinds),
                .grouped_tiles2 = GroupedGemmTiles(i % kKinds)};
    }
    return all;
  }();
  return &configs.at(int(tiles1) * kKinds + int(tiles2));
}

struct LayerCase {
  std::string name;
  Backend backend;
  DType dtype = DType::kBFloat16;
  int64_t M = 20, top_k = 2, H = 136, I = 40;
  int64_t num_global = 8;        // E_global: the range of topk_ids
  int64_t num_local = 8;         // E_local: experts in w13/w2
  bool expert_map = false;       // false: num_global == num_local, ids are local
  double local_share = 0.0;      // with expert_map: chance a pick favours a local expert (0: uniform)
  double dropped_share = 0.0;    // share of slots set to -1
  bool one_expert = false;       // every slot on one expert
  bool inplace = false;          // out is hidden_states
  bool padded = false;           // hidden_states, out, topk_ids, topk_weights with padded rows
  int64_t x_row_pad = 9;         // padded: hidden_states elements past each row (9: rows not 16-byte aligned)
  DType id_dtype = DType::kInt32;
  double weight_scale = 0.0;     // 0: 1/sqrt(K) per GEMM
  FusedExpertsOptions options{};
  // CUDA, when set: whether the small-batch kernels (true) or the aligned path (false)
  // take every chunk. The small-batch kernels never write the alignment part of the
  // workspace (its first bytes), so its poison shows which path ran.
  std::optional<bool> expect_small_batch;
  // CUDA on an sm_90 device, when set: whether the grouped GEMMs (MoeKernelConfig::
  // grouped_gemm) take every chunk; only that path writes the alignment's slot entries.
  std::optional<bool> expect_grouped;
};

inline void PrintTo(const LayerCase& c, std::ostream* os) { *os << c.name; }

// Routing for a layer case: distinct experts per token; with expert_map, picks favour the
// local experts by local_share; then a share of slots is dropped.
inline std::vector<int64_t> make_routing(const LayerCase& c, const std::vector<int64_t>& local_experts, std::mt19937& rng) {
  std::vector<int64_t> ids(static_cast<size_t>(c.M * c.top_k));
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  for (int64_t m = 0; m < c.M; ++m) {
    std::vector<int64_t> chosen;
    for (int64_t j = 0; j < c.top_k; ++j) {
      std::vector<int64_t> candidates;
      const bool favour_local = uniform(rng) < c.local_share;
      for (int64_t e : favour_local ? local_experts : std::vector<int64_t>{}) {
        if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) candidates.push_back(e);
      }
      if (candidates.empty()) {
        for (int64_t e = 0; e < c.num_global; ++e) {
          if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) candidates.push_back(e);
        }
      }
      std::uniform_int_distribution<size_t> pick(0, candidates.size() - 1);
      chosen.push_back(candidates[pick(rng)]);
      ids[size_t(m * c.top_k + j)] = chosen.back();
    }
  }
  std::bernoulli_distribution drop(c.dropped_share);
  for (auto& id : ids) {
    if (c.one_expert) id = local_experts.front();
    if (drop(rng)) id = -1;
  }
  return ids;
}

// All buffers of one fused_experts call, filled, uploaded and poisoned.
struct LayerProblem {
  LayerProblem(const LayerCase& c, std::mt19937& rng)
      : x_row_stride(c.padded ? c.H + c.x_row_pad : c.H),
        out_rows(c.options.no_combine ? c.M * c.top_k : c.M),
        out_row_stride(c.padded ? c.H + 3 : c.H),
        ids_row_stride(c.padded ? c.top_k + 2 : c.top_k),
        workspace_bytes(fused_experts_workspace_size({c.M, c.top_k, c.num_global, c.H, c.I, c.dtype, c.num_local},
                                                     c.options)),
        hidden(c.backend, c.dtype, std::max<int64_t>(1, c.M * x_row_stride)),
        w13(c.backend, c.dtype, c.num_local * 2 * c.I * c.H),
        w2(c.backend, c.dtype, c.num_local * c.H * c.I),
        topk_weights(c.backend, DType::kFloat32, std::max<int64_t>(1, c.M * ids_row_stride)),
        topk_ids(c.backend, c.id_dtype, std::max<int64_t>(1, c.M * ids_row_stride)),
        expert_map(c.backend, DType::kInt32, c.num_global),
        out(c.backend, c.dtype, std::max<int64_t>(1, out_rows * out_row_stride)),
        // 256 spare bytes, so a misaligned view of the full size still fits (bad-argument tests)
        workspace(c.backend, DType::kFloat32, (workspace_bytes + 256 + 3) / 4) {
    // which global experts are local: a random subset, mapped to 0..E_local-1
    std::vector<int64_t> global(static_cast<size_t>(c.num_global));
    std::iota(global.begin(), global.end(), 0);
    if (c.expert_map) std::shuffle(global.begin(), global.end(), rng);
    const std::vector<int64_t> local_experts(global.begin(), global.begin() + c.num_local);
    map.assign(size_t(c.num_global), -1);
    for (int64_t i = 0; i < c.num_local; ++i) map[size_t(local_experts[size_t(i)])] = int32_t(i);
    ids = make_routing(c, local_experts, rng);

    hidden.poison();  // the padding of hidden_states must keep it (matters when inplace)
    x_view = hidden.view({c.M, c.H}, {x_row_stride, 1});
    x_values = hidden.fill_normal(x_view, rng);
    hidden.upload();
    const double w13_scale = c.weight_scale > 0 ? c.weight_scale : 1.0 / std::sqrt(double(c.H));
    const double w2_scale = c.weight_scale > 0 ? c.weight_scale : 1.0 / std::sqrt(double(c.I));
    w13_values = w13.fill_normal(w13.view({c.num_local, 2 * c.I, c.H}), rng, w13_scale);
    w2_values = w2.fill_normal(w2.view({c.num_local, c.H, c.I}), rng, w2_scale);
    w13.upload();
    w2.upload();
    weights_view = topk_weights.view({c.M, c.top_k}, {ids_row_stride, 1});
    weight_values = random_router_weights(c.M, c.top_k, rng);
    topk_weights.write(weights_view, weight_values);
    topk_weights.upload();
    // padding of topk_ids holds an id no expert has: reading it is caught
    for (int64_t i = 0; i < topk_ids.size(); ++i) topk_ids.set(i, 100000);
    ids_view = topk_ids.view({c.M, c.top_k}, {ids_row_stride, 1});
    topk_ids.write(ids_view, std::vector<double>(ids.begin(), ids.end()));
    topk_ids.upload();
    expert_map.write(expert_map.view({c.num_global}), std::vector<double>(map.begin(), map.end()));
    expert_map.upload();
    map_view = expert_map.view({c.num_global});
    out.poison();
    workspace.poison();  // the op must not rely on a zeroed workspace

    args.hidden_states = x_view;
    args.w13 = w13.view({c.num_local, 2 * c.I, c.H});
    args.w2 = w2.view({c.num_local, c.H, c.I});
    args.topk_weights = weights_view;
    args.topk_ids = ids_view;
    if (c.inplace) {
      out_view = x_view;
    } else if (c.options.no_combine) {
      out_view = out.view({c.M, c.top_k, c.H}, {c.top_k * out_row_stride, out_row_stride, 1});
    } else {
      out_view = out.view({c.M, c.H}, {out_row_stride, 1});
    }
    args.out = out_view;
    args.workspace = workspace.view({(workspace_bytes + 3) / 4});
    args.expert_map = c.expert_map ? &map_view : nullptr;
  }

  std::vector<double> reference(const LayerCase& c) const {
    return ref::reference_fused_experts(x_values, w13_values, w2_values, weight_values, ids, c.M, c.top_k, c.num_local,
                                        c.H, c.I, c.expert_map ? map.data() : nullptr, c.options.activation,
                                        c.options.swiglu_alpha, c.options.swiglu_limit,
                                        c.options.apply_router_weight_on_input, c.options.no_combine,
                                        c.options.routed_scaling_factor);
  }

  Buffer& out_buffer(const LayerCase& c) { return c.inplace ? hidden : out; }

  int64_t x_row_stride, out_rows, out_row_stride, ids_row_stride, workspace_bytes;
  Buffer hidden, w13, w2, topk_weights, topk_ids, expert_map, out, workspace;
  std::vector<int64_t> ids;
  std::vector<int32_t> map;
  TensorView x_view, weights_view, ids_view, map_view, out_view;
  std::vector<double> x_values, w13_values, w2_values, weight_values;
  FusedExpertsArgs args;
};

}  // namespace moelora::test
