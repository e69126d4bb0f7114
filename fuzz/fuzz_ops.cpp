// libFuzzer target over every public op of moelora (issue 33): the fuzzer's bytes pick
// an op, its sizes, options, scheme and adapters, and the arena (fuzz_arena.h) builds
// its tensors, mutated now and then. Built with AddressSanitizer and UBSan over the
// library's CPU backend (tools/fuzz.sh); a crash, a sanitizer report, an exception that
// is not moelora::Error, or a write the op's contract forbids is a finding.
#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "fuzz_arena.h"
#include "moelora/ops.h"
#include "moelora/quant.h"

namespace moelora::fuzz {
namespace {

// Calls that ran and calls that were rejected, by op: MOELORA_FUZZ_STATS=1 prints them
// at exit (how deep a corpus reaches: a target whose calls are all rejected tests only
// the validation).
constexpr int kOps = 10;
const char* const kOpNames[kOps] = {"moe_align_block_size", "moe_lora_align_block_size", "fused_moe",
                                    "fused_moe_lora", "activations", "moe_sum_reduce", "quantize",
                                    "fused_experts", "sparse_mla_decode", "size queries"};
int64_t g_ran[kOps], g_rejected[kOps];
int g_op = 0;
// fused_experts calls that ran, by QuantMethod (kNone: bf16/fp16/fp32 experts) and LoRA.
int64_t g_layer_ran[8][2];
int g_layer_method = 0, g_layer_lora = 0;

void print_stats() {
  for (int op = 0; op < kOps; ++op) {
    std::fprintf(stderr, "%-26s ran %8lld  rejected %8lld\n", kOpNames[op], (long long)g_ran[op],
                 (long long)g_rejected[op]);
  }
  for (int m = 0; m < 8; ++m) {
    std::fprintf(stderr, "fused_experts %-12s ran %6lld, with LoRA %6lld\n", quant_method_name(QuantMethod(m)),
                 (long long)g_layer_ran[m][0], (long long)g_layer_ran[m][1]);
  }
}

// Runs one op call under the arena's invariants.
template <class Call>
void run(Arena& arena, Call call) {
  arena.snapshot();
  bool rejected = false;
  try {
    call();
  } catch (const Error& e) {
    rejected = true;
    if (std::getenv("MOELORA_FUZZ_ERRORS")) std::fprintf(stderr, "rejected: %s\n", e.what());
  }
  arena.check(rejected);
  ++(rejected ? g_rejected : g_ran)[g_op];
  if (!rejected && g_op == 7) ++g_layer_ran[g_layer_method & 7][g_layer_lora];
}

DType float_dtype(FuzzedDataProvider& f) {
  return f.PickValueInArray({DType::kBFloat16, DType::kFloat16, DType::kFloat32});
}
DType id_dtype(FuzzedDataProvider& f) { return f.ConsumeBool() ? DType::kInt32 : DType::kInt64; }

// A float argument: `usual`, or when odd() what a careless caller passes.
float some_float(Arena& a, float usual) { return a.pick({usual}, {NAN, INFINITY, -1.f, 0.f}); }

// The layer's sizes, small enough for the CPU backend to run thousands of calls a second.
struct Sizes {
  int64_t M, top_k, E, H, I;
};
Sizes layer_sizes(Arena& a) {
  auto& f = a.fdp();
  Sizes s;
  s.M = f.ConsumeIntegralInRange<int64_t>(0, 6);
  s.top_k = f.ConsumeIntegralInRange<int64_t>(1, 4);
  s.E = f.ConsumeIntegralInRange<int64_t>(1, 8);
  s.H = a.pick<int64_t>({32, 64, 96, 128}, {16, 1, 34});
  s.I = a.pick<int64_t>({32, 64}, {16, 1, 24});
  return s;
}

// ---- alignment ----------------------------------------------------------------------

void fuzz_moe_align_block_size(Arena& a) {
  auto& f = a.fdp();
  const int64_t M = f.ConsumeIntegralInRange<int64_t>(0, 8), top_k = f.ConsumeIntegralInRange<int64_t>(1, 4);
  const int64_t E = a.pick<int64_t>({1, 3, 8, 64}, {0, kMaxNumExperts + 1});
  const int64_t block = a.pick<int64_t>({16, 32, 64, 256, 24}, {0, 15, 512});
  const TensorView ids = a.ids(id_dtype(f), {M, top_k}, -1, E - 1);
  const bool with_map = f.ConsumeBool();
  const TensorView map = a.ids(DType::kInt32, {E}, -1, E - 1);
  AlignCapacity cap{16, 1};
  try {
    cap = moe_align_block_size_capacity(M * top_k, block, E);
  } catch (const Error&) {
  }
  const int64_t slack = a.pick<int64_t>({0, 1}, {-1});
  const TensorView sorted = a.output(DType::kInt32, {cap.max_num_tokens_padded + slack});
  const TensorView experts = a.output(DType::kInt32, {cap.max_num_blocks + slack});
  const TensorView count = a.output(DType::kInt32, {1});
  run(a, [&] { moe_align_block_size(ids, block, E, with_map ? &map : nullptr, sorted, experts, count); });
}

// The adapter state of M tokens over L slots (the views MoeLoraAdapters points to).
struct Adapters {
  TensorView ids, enabled, scale;
};
MoeLoraAdapters adapters_of(Arena& a, int64_t M, int64_t L, Adapters& storage) {
  auto& f = a.fdp();
  storage.ids = a.ids(DType::kInt32, {M}, -1, L - 1);
  storage.enabled = a.ids(DType::kInt32, {L}, 0, 1);
  storage.scale = a.input(DType::kFloat32, {L});
  MoeLoraAdapters v;
  v.token_lora_ids = storage.ids;
  if (f.ConsumeBool()) v.adapter_enabled = &storage.enabled;
  if (f.ConsumeBool()) v.adapter_scale = &storage.scale;
  return v;
}

void fuzz_moe_lora_align_block_size(Arena& a) {
  auto& f = a.fdp();
  const int64_t M = f.ConsumeIntegralInRange<int64_t>(0, 8), top_k = f.ConsumeIntegralInRange<int64_t>(1, 4);
  const int64_t E = a.pick<int64_t>({1, 3, 8}, {0});
  const int64_t L = a.pick<int64_t>({1, 2, 4, kMaxLoraAdapters}, {0, kMaxLoraAdapters + 1});
  const int64_t block = a.pick<int64_t>({16, 64, 24}, {0});
  const TensorView ids = a.ids(id_dtype(f), {M, top_k}, -1, E - 1);
  Adapters storage;
  const MoeLoraAdapters adapters = adapters_of(a, M, L, storage);
  AlignCapacity cap{16, 1};
  try {
    cap = moe_lora_align_block_size_capacity(M * top_k, block, E, L);
  } catch (const Error&) {
  }
  const int64_t slack = a.pick<int64_t>({0}, {-1});
  const TensorView sorted = a.output(DType::kInt32, {cap.max_num_tokens_padded + slack});
  const TensorView experts = a.output(DType::kInt32, {cap.max_num_blocks});
  const TensorView loras = a.output(DType::kInt32, {cap.max_num_blocks + slack});
  const TensorView count = a.output(DType::kInt32, {1});
  run(a, [&] {
    moe_lora_align_block_size(ids, adapters, L, block, E, nullptr, sorted, experts, loras, count);
  });
}

// ---- the grouped GEMM and its LoRA delta ---------------------------------------------

// An alignment for fused_moe: from moe_align_block_size on fuzzed ids (the usual case),
// or raw fuzzed arrays (the op must not trust them).
struct Alignment {
  TensorView sorted, experts, count;
};
Alignment alignment(Arena& a, const TensorView& topk_ids, int64_t slots, int64_t E, int64_t block) {
  auto& f = a.fdp();
  Alignment al;
  AlignCapacity cap{block, 1};
  try {
    cap = moe_align_block_size_capacity(slots, block, E);
  } catch (const Error&) {
  }
  if (!a.odd()) {
    // Inputs of the op under test: written here, before its snapshot.
    al.sorted = a.input(DType::kInt32, {cap.max_num_tokens_padded}, Fill::kBytes);
    al.experts = a.input(DType::kInt32, {cap.max_num_blocks}, Fill::kBytes);
    al.count = a.input(DType::kInt32, {1}, Fill::kBytes);
    try {
      moe_align_block_size(topk_ids, block, E, nullptr, al.sorted, al.experts, al.count);
    } catch (const Error&) {
    }
  } else {
    al.sorted = a.ids(DType::kInt32, {cap.max_num_tokens_padded}, -1, slots + 1);
    al.experts = a.ids(DType::kInt32, {cap.max_num_blocks}, -2, E);
    al.count = a.ids(DType::kInt32, {1}, -16, cap.max_num_tokens_padded + 16);
  }
  return al;
}

void fuzz_fused_moe(Arena& a) {
  auto& f = a.fdp();
  const Sizes s = layer_sizes(a);
  const DType dt = float_dtype(f);
  const int64_t slots = s.M * s.top_k, block = a.pick<int64_t>({16, 32, 64}, {24});
  const bool row_per_slot = f.ConsumeBool();
  const int64_t rows = row_per_slot ? slots : s.M;
  const TensorView topk_ids = a.ids(DType::kInt32, {s.M, s.top_k}, -1, s.E - 1);
  const Alignment al = alignment(a, topk_ids, slots, s.E, block);
  FusedMoeArgs args;
  args.a = a.input(dt, {rows, s.H});
  args.w = a.input(dt, {s.E, s.I, s.H});
  args.out = a.output(dt, {slots, s.I});
  args.sorted_token_ids = al.sorted;
  args.expert_ids = al.experts;
  args.num_tokens_post_padded = al.count;
  const TensorView weights = a.input(DType::kFloat32, {s.M, s.top_k});
  if (f.ConsumeBool()) args.topk_weights = &weights;
  args.mul_routed_weight = f.ConsumeBool();
  args.top_k = row_per_slot ? 1 : a.pick<int64_t>({s.top_k}, {0, s.top_k + 1});
  args.block_size = a.pick<int64_t>({block}, {16, 0});
  args.tile.kernel = a.pick({GemmKernel::kAuto}, {GemmKernel::kSm80, GemmKernel::kSm90, static_cast<GemmKernel>(3)});
  args.tile.block_m = a.pick({0}, {16, 64, 7});
  run(a, [&] { fused_moe(args); });
}

// One GEMM's adapter stacks: num_slices slices of N / num_slices rows over K.
MoeLoraWeights lora_weights(Arena& a, DType dt, int64_t L, int64_t E, int64_t r, int64_t N, int64_t K,
                            int num_slices, bool interleaved) {
  MoeLoraWeights w;
  w.num_slices = num_slices;
  w.interleaved_slices = interleaved;
  for (int c = 0; c < num_slices && c < 2; ++c) {
    w.lora_a[c] = a.input(dt, {L, E, r, K});
    w.lora_b[c] = a.input(dt, {L, E, N / num_slices, r});
  }
  return w;
}

void fuzz_fused_moe_lora(Arena& a) {
  auto& f = a.fdp();
  const Sizes s = layer_sizes(a);
  const DType dt = f.ConsumeBool() ? DType::kBFloat16 : float_dtype(f);
  const int64_t slots = s.M * s.top_k;
  const int64_t L = a.pick<int64_t>({1, 2, 3}, {0}), r = a.pick<int64_t>({1, 4, 8}, {0, kMaxLoraRank + 1});
  const int slices = a.pick({1, 2}, {3});
  const int64_t N = 2 * s.I;
  FusedMoeLoraArgs args;
  args.out = a.output(dt, {slots, N});
  args.a = a.input(dt, {f.ConsumeBool() ? slots : s.M, s.H});
  args.topk_ids = a.ids(id_dtype(f), {s.M, s.top_k}, -1, s.E - 1);
  Adapters storage;
  args.adapters = adapters_of(a, s.M, L, storage);
  args.weights = lora_weights(a, dt, L, s.E, r, N, s.H, slices, f.ConsumeBool());
  int64_t bytes = 256;
  try {
    bytes = fused_moe_lora_workspace_size(slots, slices, r, dt);
  } catch (const Error&) {
  }
  args.workspace = a.workspace(bytes - a.pick<int64_t>({0}, {1}));
  const TensorView weights = a.input(DType::kFloat32, {s.M, s.top_k});
  if (f.ConsumeBool()) args.topk_weights = &weights;
  args.mul_routed_weight = f.ConsumeBool();
  args.add_inputs = f.ConsumeBool();
  if (args.add_inputs) a.mark_output(args.out);
  TensorView sorted, experts, loras, count;
  if (f.ConsumeBool()) {  // the aligned form
    const int64_t block = a.pick<int64_t>({16, 64}, {24});
    AlignCapacity cap{block, 1};
    try {
      cap = moe_lora_align_block_size_capacity(slots, block, s.E, L);
    } catch (const Error&) {
    }
    sorted = a.input(DType::kInt32, {cap.max_num_tokens_padded}, Fill::kBytes);
    experts = a.input(DType::kInt32, {cap.max_num_blocks}, Fill::kBytes);
    loras = a.input(DType::kInt32, {cap.max_num_blocks}, Fill::kBytes);
    count = a.input(DType::kInt32, {1}, Fill::kBytes);
    try {
      moe_lora_align_block_size(args.topk_ids, args.adapters, L, block, s.E, nullptr, sorted, experts, loras, count);
    } catch (const Error&) {
    }
    args.sorted_token_ids = &sorted;
    args.expert_ids = &experts;
    args.block_lora_ids = &loras;
    args.num_tokens_post_padded = &count;
    args.block_size = a.pick<int64_t>({block}, {0});
  }
  run(a, [&] { fused_moe_lora(args); });
}

// ---- elementwise ops --------------------------------------------------------------

void fuzz_activation(Arena& a) {
  auto& f = a.fdp();
  const DType dt = float_dtype(f);
  const int64_t T = f.ConsumeIntegralInRange<int64_t>(0, 8), I = a.pick<int64_t>({1, 8, 64}, {3});
  const TensorView input = a.input(dt, {T, 2 * I});
  const TensorView out = a.output(dt, {T, I});
  const int which = f.ConsumeIntegralInRange<int>(0, 2);
  const float alpha = some_float(a, 1.702f), limit = some_float(a, 7.f);
  run(a, [&] {
    if (which == 0) silu_and_mul(input, out);
    if (which == 1) gelu_and_mul(input, out);
    if (which == 2) swiglu_oai_and_mul(input, out, alpha, limit);
  });
}

void fuzz_moe_sum_reduce(Arena& a) {
  auto& f = a.fdp();
  const DType dt = float_dtype(f);
  const int64_t M = f.ConsumeIntegralInRange<int64_t>(0, 8), top_k = f.ConsumeIntegralInRange<int64_t>(1, 8);
  const int64_t H = a.pick<int64_t>({1, 16, 64}, {33});
  const TensorView input = a.input(dt, {M, top_k, H});
  const TensorView out = a.output(dt, {M, H});
  const float factor = some_float(a, 2.5f);
  run(a, [&] { moe_sum_reduce(input, out, factor); });
}

// ---- quantization ------------------------------------------------------------------

// A scheme: a named method through its maker (the usual case), or a raw struct the API
// must validate.
QuantScheme scheme(Arena& a) {
  auto& f = a.fdp();
  const auto method = a.pick({QuantMethod::kFp8Block, QuantMethod::kFp8Channel, QuantMethod::kFp8Tensor,
                              QuantMethod::kInt8Channel, QuantMethod::kInt8Block, QuantMethod::kW4A16,
                              QuantMethod::kW8A16},
                             {QuantMethod::kNone, static_cast<QuantMethod>(8)});
  const bool weight_only = method == QuantMethod::kW4A16 || method == QuantMethod::kW8A16;
  try {
    if (!a.odd()) {
      return weight_only ? make_weight_only_scheme(method, a.pick({128, 64, 32, 0}, {16, 96}), f.ConsumeBool())
                         : make_quant_scheme(method, a.pick({128, 64, 16}, {0, 100}), a.pick({128, 64, 16}, {2048, 0}),
                                             f.ConsumeBool());
    }
  } catch (const Error&) {
  }
  QuantScheme s;
  s.method = method;
  s.element = static_cast<DType>(f.ConsumeIntegralInRange<int>(0, 9));
  s.weight_scales = static_cast<ScaleGranularity>(f.ConsumeIntegralInRange<int>(0, 3));
  s.activation_scales = static_cast<ScaleGranularity>(f.ConsumeIntegralInRange<int>(0, 3));
  s.block_n = f.PickValueInArray({128, 1, 0, -128, 3});
  s.block_k = f.PickValueInArray({128, 32, 0, 7});
  s.static_activation_scales = f.ConsumeBool();
  s.weight_bits = f.PickValueInArray({4, 8, 0, 16});
  s.group_size = f.PickValueInArray({128, 32, 0, -1, 48});
  s.zero_points = f.ConsumeBool();
  return s;
}

int64_t ceil_div(int64_t a, int64_t b) { return b > 0 ? (a + b - 1) / b : 1; }

void fuzz_quantize(Arena& a) {
  auto& f = a.fdp();
  const DType dt = float_dtype(f);
  const bool batched = f.ConsumeBool();
  const int64_t B = f.ConsumeIntegralInRange<int64_t>(1, 3), R = f.ConsumeIntegralInRange<int64_t>(0, 9);
  const int64_t C = f.PickValueInArray({1, 16, 128, 130});
  QuantizeArgs args;
  args.block_rows = a.pick<int64_t>({1, 0, 2, 128}, {-1});
  args.block_cols = a.pick<int64_t>({128, 0, 16, 1, 7}, {-1});
  args.static_scales = f.ConsumeBool();
  const DType element = a.pick({DType::kFloat8E4M3, DType::kInt8}, {DType::kUInt8});
  const int64_t sr = ceil_div(R, args.block_rows > 0 ? args.block_rows : R),
                sc = ceil_div(C, args.block_cols > 0 ? args.block_cols : C);
  if (batched) {
    args.input = a.input(dt, {B, R, C});
    args.out = a.output(element, {B, R, C});
    args.scales = args.static_scales ? a.input(DType::kFloat32, {B, sr, sc}, Fill::kPositive)
                                     : a.output(DType::kFloat32, {B, sr, sc});
  } else {
    args.input = a.input(dt, {R, C});
    args.out = a.output(element, {R, C});
    args.scales = args.static_scales ? a.input(DType::kFloat32, {sr, sc}, Fill::kPositive)
                                     : a.output(DType::kFloat32, {sr, sc});
  }
  run(a, [&] { quantize(args); });
}

// ---- the whole layer ----------------------------------------------------------------

// Scale and weight tensors of one GEMM (N rows over K) for a quantized scheme, in the
// layout include/moelora/ops.h (FusedExpertsQuant) gives.
struct QuantGemm {
  TensorView w, scale, zero;
};
QuantGemm quant_gemm(Arena& a, const QuantScheme& s, DType dt, int64_t E, int64_t N, int64_t K) {
  QuantGemm g;
  if (s.weight_only()) {
    const int64_t groups = s.group_size > 0 ? ceil_div(K, s.group_size) : 0;
    g.w = a.input(DType::kUInt8, {E, N, s.weight_bits == 4 ? (K + 1) / 2 : K}, Fill::kBytes);
    g.scale = groups > 0 ? a.input(dt, {E, N, groups}, Fill::kPositive) : a.input(dt, {E, N}, Fill::kPositive);
    // 4-bit zero points one a byte (below 16) or packed two a byte along N; 8-bit one a byte.
    const bool packed = s.weight_bits == 4 && a.fdp().ConsumeBool();
    const int64_t rows = packed ? N / 2 : N, top = s.weight_bits == 4 && !packed ? 15 : 255;
    g.zero = groups > 0 ? a.ids(DType::kUInt8, {E, rows, groups}, 0, top) : a.ids(DType::kUInt8, {E, rows}, 0, top);
    return g;
  }
  g.w = a.input(s.element, {E, N, K}, Fill::kBytes);
  switch (s.weight_scales) {
    case ScaleGranularity::kBlock:
      g.scale = a.input(DType::kFloat32, {E, ceil_div(N, s.block_n), ceil_div(K, s.block_k)}, Fill::kPositive);
      break;
    case ScaleGranularity::kChannel: g.scale = a.input(DType::kFloat32, {E, N}, Fill::kPositive); break;
    default: g.scale = a.input(DType::kFloat32, {E}, Fill::kPositive); break;
  }
  return g;
}

void fuzz_fused_experts(Arena& a) {
  auto& f = a.fdp();
  const Sizes s = layer_sizes(a);
  // Quantized experts keep bf16/fp16 activations (fp32 now and then: rejected).
  const bool quantized = f.ConsumeBool();
  const DType dt = quantized && f.ConsumeIntegralInRange<int>(0, 7) != 0 ? f.PickValueInArray({DType::kBFloat16, DType::kFloat16})
                                                                         : float_dtype(f);
  const int64_t E_global = s.E + a.pick<int64_t>({0, 2}, {});
  FusedExpertsOptions o;
  o.activation = a.pick({Activation::kSilu, Activation::kGelu, Activation::kSwigluOai}, {static_cast<Activation>(3)});
  o.swiglu_alpha = some_float(a, 1.702f);
  o.swiglu_limit = some_float(a, 7.f);
  o.apply_router_weight_on_input = f.ConsumeBool();
  o.no_combine = f.ConsumeBool();
  o.routed_scaling_factor = some_float(a, 1.f);
  o.chunk_size = a.pick<int64_t>({64 * 1024, 1, 3}, {0, -1});
  o.block_size = a.pick<int64_t>({0, 16, 64}, {24, -16});
  o.weight_only_path = a.pick({WeightOnlyPath::kAuto, WeightOnlyPath::kDecode, WeightOnlyPath::kAligned,
                               WeightOnlyPath::kDense},
                              {static_cast<WeightOnlyPath>(4)});
  MoeKernelConfig config;
  config.block_size = a.pick<int64_t>({16, 32, 0}, {17});
  config.small_batch = f.ConsumeBool();
  if (f.ConsumeIntegralInRange<int>(0, 7) == 0) o.config = &config;

  FusedExpertsShape shape{s.M, s.top_k, E_global, s.H, s.I, dt};
  shape.num_local_experts = s.E;
  FusedExpertsArgs args;
  args.hidden_states = a.input(dt, {s.M, s.H});
  args.topk_weights = a.input(DType::kFloat32, {s.M, s.top_k});
  args.topk_ids = a.ids(id_dtype(f), {s.M, s.top_k}, -1, E_global - 1);
  const TensorView expert_map = a.ids(DType::kInt32, {E_global}, -1, s.E - 1);
  if (E_global != s.E || f.ConsumeIntegralInRange<int>(0, 3) == 0) args.expert_map = &expert_map;

  FusedExpertsQuant quant;
  QuantGemm q13, q2;
  const TensorView a13 = a.input(DType::kFloat32, {1}, Fill::kPositive), a2 = a.input(DType::kFloat32, {1}, Fill::kPositive);
  if (quantized) {
    quant.scheme = scheme(a);
    shape.quant = quant.scheme;
    q13 = quant_gemm(a, quant.scheme, dt, s.E, 2 * s.I, s.H);
    q2 = quant_gemm(a, quant.scheme, dt, s.E, s.H, s.I);
    args.w13 = q13.w;
    args.w2 = q2.w;
    quant.w13_scale = q13.scale;
    quant.w2_scale = q2.scale;
    if (quant.scheme.zero_points || a.odd()) {
      quant.w13_zero = &q13.zero;
      quant.w2_zero = &q2.zero;
    }
    if (quant.scheme.static_activation_scales || a.odd()) {
      quant.a13_scale = &a13;
      quant.a2_scale = &a2;
    }
    args.quant = &quant;
  } else {
    args.w13 = a.input(dt, {s.E, 2 * s.I, s.H});
    args.w2 = a.input(dt, {s.E, s.H, s.I});
  }

  FusedExpertsLora lora;
  Adapters storage;
  if (f.ConsumeIntegralInRange<int>(0, 2) == 2) {  // (an exhausted input reads 0: no LoRA)
    const int64_t L = a.pick<int64_t>({1, 2, 3}, {}), r = a.pick<int64_t>({1, 2, 4}, {0});
    const int slices = a.pick({1, 2}, {});
    const bool interleaved = slices == 2 && (o.activation == Activation::kSwigluOai) != a.odd();
    lora.adapters = adapters_of(a, s.M, L, storage);
    lora.w13 = lora_weights(a, dt, L, s.E, r, 2 * s.I, s.H, slices, interleaved);
    lora.w2 = lora_weights(a, dt, L, s.E, r, s.H, s.I, 1, false);
    args.lora = &lora;
    shape.max_loras = L;
    shape.lora_rank = r;
  }

  if (f.ConsumeIntegralInRange<int>(0, 5) == 0 && !o.no_combine) {
    args.out = args.hidden_states;  // in place
    a.mark_output(args.out);
  } else {
    args.out = o.no_combine ? a.output(dt, {s.M, s.top_k, s.H}) : a.output(dt, {s.M, s.H});
  }
  int64_t bytes = 256;
  try {
    bytes = fused_experts_workspace_size(shape, o);
  } catch (const Error&) {
  }
  args.workspace = a.workspace(bytes - a.pick<int64_t>({0}, {1, 256}));
  g_layer_method = args.quant ? int(quant.scheme.method) : 0;
  g_layer_lora = args.lora != nullptr;
  run(a, [&] { fused_experts(args, o); });
}

// ---- sparse MLA decode ---------------------------------------------------------------

void fuzz_sparse_mla_decode(Arena& a) {
  auto& f = a.fdp();
  const int64_t T = f.ConsumeIntegralInRange<int64_t>(0, 2), Hq = a.pick<int64_t>({1, 2, 4}, {0, kMlaMaxHeads + 1});
  const int64_t S = f.ConsumeIntegralInRange<int64_t>(0, 40), topk = a.pick<int64_t>({1, 8, 17, 64}, {0});
  const DType dt = a.odd() ? float_dtype(f) : DType::kBFloat16;
  SparseMlaDecodeArgs args;
  args.q = a.input(dt, {T, Hq, kMlaHeadDim});
  args.kv = a.input(dt, {S, 1, kMlaHeadDim});
  // Any index: entries outside [0, S) are masked by contract.
  args.indices = a.ids(DType::kInt32, {T, 1, topk}, -2, S + 1);
  args.out = a.output(dt, {T, Hq, kMlaValueDim});
  args.softmax_scale = some_float(a, 0.04f);
  args.num_splits = a.pick<int>({0, 1, 2}, {-1, int(kMlaMaxSplits) + 1});
  int64_t bytes = 0;
  try {
    bytes = sparse_mla_decode_workspace_size(T, Hq, topk, Device{}, args.num_splits);
  } catch (const Error&) {
  }
  args.workspace = a.workspace(bytes);
  const TensorView lse = a.output(DType::kFloat32, {T, Hq});
  // Any length: the contract clamps them.
  const TensorView lengths = a.ids(DType::kInt32, {T}, -2, topk + 2);
  const TensorView sink = a.input(DType::kFloat32, {Hq});
  if (f.ConsumeBool()) args.lse = &lse;
  if (f.ConsumeBool()) args.topk_length = &lengths;
  if (f.ConsumeBool()) args.attn_sink = &sink;
  run(a, [&] { sparse_mla_decode(args); });
}

// ---- the size queries and scheme makers, with any arguments --------------------------

void fuzz_queries(Arena& a) {
  auto& f = a.fdp();
  auto any = [&] { return f.PickValueInArray({int64_t(0), int64_t(1), int64_t(16), int64_t(-1), int64_t(1) << 31,
                                              int64_t(1) << 62, INT64_MAX, int64_t(kMaxNumExperts + 1)}); };
  run(a, [&] { moe_align_block_size_capacity(any(), any(), any()); });
  run(a, [&] { moe_lora_align_block_size_capacity(any(), any(), any(), any()); });
  run(a, [&] { fused_moe_lora_workspace_size(any(), int(f.ConsumeIntegralInRange<int>(-1, 3)), any(), float_dtype(f)); });
  run(a, [&] { sparse_mla_decode_workspace_size(any(), any(), any(), Device{}, int(f.ConsumeIntegralInRange<int>(-1, 70))); });
  FusedExpertsShape shape{any(), any(), any(), any(), any(), float_dtype(f)};
  shape.num_local_experts = any();
  shape.max_loras = f.ConsumeBool() ? any() : 0;
  shape.lora_rank = any();
  if (f.ConsumeBool()) shape.quant = scheme(a);
  FusedExpertsOptions o;
  o.chunk_size = any();
  o.block_size = f.ConsumeBool() ? any() : 0;
  run(a, [&] { fused_experts_workspace_size(shape, o); });
  run(a, [&] { fused_experts_block_size(any(), any(), any(), o); });
  run(a, [&] { quant_method_from_name(f.ConsumeRandomLengthString(16)); });
}

}  // namespace
}  // namespace moelora::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moelora::fuzz;
  static const bool stats = [] {
    if (std::getenv("MOELORA_FUZZ_STATS")) std::atexit(print_stats);
    return true;
  }();
  (void)stats;
  FuzzedDataProvider fdp(data, size);
  const int op = g_op = fdp.ConsumeIntegralInRange<int>(0, kOps - 1);
  Arena arena(fdp);
  switch (op) {
    case 0: fuzz_moe_align_block_size(arena); break;
    case 1: fuzz_moe_lora_align_block_size(arena); break;
    case 2: fuzz_fused_moe(arena); break;
    case 3: fuzz_fused_moe_lora(arena); break;
    case 4: fuzz_activation(arena); break;
    case 5: fuzz_moe_sum_reduce(arena); break;
    case 6: fuzz_quantize(arena); break;
    case 7: fuzz_fused_experts(arena); break;
    case 8: fuzz_sparse_mla_decode(arena); break;
    default: fuzz_queries(arena); break;
  }
  return 0;
}
