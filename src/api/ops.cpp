// The C++ API: validate every argument, fill the backend's parameter struct, dispatch
// on the tensors' device. fused_experts is composed here from the backend ops, so both
// backends share one orchestration.
#include "moelora/ops.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "api/kernel_config.h"
#include "api/validate.h"
#include "common/params.h"

namespace moelora {

using detail::ArgCheck;
using detail::fail;
using detail::require_cuda_backend;

namespace {


ArgCheck& float_dtype(ArgCheck& c) {
  return c.dtype_in({DType::kFloat32, DType::kFloat16, DType::kBFloat16});
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool on_cuda(const TensorView& t) { return t.device.type == DeviceType::kCUDA; }

constexpr int64_t kMaxBlockSize = 256;

void check_block_size(const char* op, int64_t block_size, bool multiple_of_16) {
  if (block_size < 16 || block_size > 256 || (multiple_of_16 && block_size % 16 != 0)) {
    fail(op, std::string("argument 'block_size' expected ") +
                 (multiple_of_16 ? "a multiple of 16 in [16, 256]" : "a value in [16, 256]") + ", got " +
                 std::to_string(block_size));
  }
}

// On the CPU the ids are readable: reject out-of-range ones with a clear message.
// (The CUDA backend cannot read them without a host sync; see ops.h.)
void check_cpu_ids(const char* op, const char* name, const TensorView& ids, int64_t lo, int64_t hi) {
  if (on_cuda(ids) || ids.numel() == 0) return;
  for (int64_t i = 0; i < ids.shape[0]; ++i) {
    for (int64_t j = 0; j < (ids.rank > 1 ? ids.shape[1] : 1); ++j) {
      const int64_t offset = i * ids.strides[0] + (ids.rank > 1 ? j * ids.strides[1] : 0);
      const int64_t v = ids.dtype == DType::kInt64 ? static_cast<const int64_t*>(ids.data)[offset]
                                                   : static_cast<const int32_t*>(ids.data)[offset];
      if (v < lo || v >= hi) {
        fail(op, std::string("argument '") + name + "' expected values in [" + std::to_string(lo) + ", " +
                     std::to_string(hi) + "), got " + std::to_string(v) + " at [" + std::to_string(i) +
                     (ids.rank > 1 ? ", " + std::to_string(j) : std::string()) + "]");
      }
    }
  }
}

detail::AlignParams align_params(const TensorView& topk_ids, int64_t block_size, int64_t num_experts,
                                 const TensorView* expert_map, const TensorView& sorted_token_ids,
                                 const TensorView& expert_ids, const TensorView& num_tokens_post_padded) {
  return detail::AlignParams{
      .topk_ids = topk_ids.data,
      .topk_ids_int64 = topk_ids.dtype == DType::kInt64,
      .topk_ids_stride_token = topk_ids.strides[0],
      .topk_ids_stride_k = topk_ids.strides[1],
      .num_tokens = topk_ids.shape[0],
      .top_k = topk_ids.shape[1],
      .block_size = block_size,
      .num_experts = num_experts,
      .expert_map = expert_map ? static_cast<const int32_t*>(expert_map->data) : nullptr,
      .sorted_token_ids = static_cast<int32_t*>(sorted_token_ids.data),
      .max_num_tokens_padded = sorted_token_ids.shape[0],
      .expert_ids = static_cast<int32_t*>(expert_ids.data),
      .max_num_blocks = expert_ids.shape[0],
      .num_tokens_post_padded = static_cast<int32_t*>(num_tokens_post_padded.data),
  };
}

// Runs a backend entry point on the tensors' device. Without the CUDA backend a CUDA
// call never gets here: require_cuda_backend() rejected it during validation.
#ifdef MOELORA_WITH_CUDA
#define MOELORA_BACKEND_CALL(fn, params, device, stream) \
  ((device).type == DeviceType::kCPU ? cpu::fn(params) : cuda::fn(params, stream))
#else
#define MOELORA_BACKEND_CALL(fn, params, device, stream) ((void)(device), (void)(stream), cpu::fn(params))
#endif

void run_align(const detail::AlignParams& p, Device device, Stream stream) {
  MOELORA_BACKEND_CALL(moe_align_block_size, p, device, stream);
}
void run_gemm(const detail::GemmParams& p, Device device, Stream stream) {
  MOELORA_BACKEND_CALL(fused_moe, p, device, stream);
}
void run_activation(const detail::ActivationParams& p, Device device, Stream stream) {
  MOELORA_BACKEND_CALL(activation, p, device, stream);
}
void run_sum_reduce(const detail::SumReduceParams& p, Device device, Stream stream) {
  MOELORA_BACKEND_CALL(moe_sum_reduce, p, device, stream);
}
void run_lora_delta(const detail::LoraDeltaParams& p, Device device, Stream stream) {
  MOELORA_BACKEND_CALL(moe_lora_delta, p, device, stream);
}

// A 2-D view [rows, cols] of a tensor's storage.
TensorView view2d(void* data, DType dtype, int64_t rows, int64_t cols, int64_t stride_row, int64_t stride_col,
                  Device device) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.rank = 2;
  t.shape[0] = rows;
  t.shape[1] = cols;
  t.strides[0] = stride_row;
  t.strides[1] = stride_col;
  t.device = device;
  return t;
}

void* byte_offset(void* p, int64_t bytes) { return static_cast<char*>(p) + bytes; }

int64_t round_up(int64_t v, int64_t to) { return ceil_div(v, to) * to; }

}  // namespace

// ---------------------------------------------------------------------------------
AlignCapacity moe_align_block_size_capacity(int64_t num_slots, int64_t block_size, int64_t num_experts) {
  // Every non-empty group (of num_experts experts + the trailing dropped-slot group)
  // pads by at most block_size - 1 entries, and at most num_slots groups are non-empty.
  // NOTE: the min keeps decode grids small: at M = 1, top_k = 8 and 256 experts the
  // GEMM grids cover 9 blocks instead of 257.
  const int64_t max_padded = num_slots + std::min(num_experts + 1, num_slots) * (block_size - 1);
  return {max_padded, ceil_div(max_padded, block_size)};
}

namespace {

// The checks both alignment ops share; returns the backend's parameters. num_groups: the
// alignment groups (experts, or (expert, adapter) pairs) that size the outputs;
// block_lora_ids: the LoRA op's extra output, or null.
detail::AlignParams checked_align_params(const char* op, const char* capacity_fn, const TensorView& topk_ids,
                                         int64_t block_size, int64_t num_experts, int64_t num_groups,
                                         const TensorView* expert_map, const TensorView& sorted_token_ids,
                                         const TensorView& expert_ids, const TensorView* block_lora_ids,
                                         const TensorView& num_tokens_post_padded) {
  const Device device = topk_ids.device;
  const AlignCapacity cap = moe_align_block_size_capacity(topk_ids.numel(), block_size, num_groups);
  ArgCheck(op, "sorted_token_ids", sorted_token_ids)
      .rank(1).dtype(DType::kInt32).unit_stride(0).on(device, "topk_ids")
      .dim_at_least(0, cap.max_num_tokens_padded, (std::string(capacity_fn) + "().max_num_tokens_padded").c_str());
  ArgCheck(op, "expert_ids", expert_ids)
      .rank(1).dtype(DType::kInt32).unit_stride(0).on(device, "topk_ids")
      .dim_at_least(0, cap.max_num_blocks, (std::string(capacity_fn) + "().max_num_blocks").c_str())
      .no_overlap(sorted_token_ids, "sorted_token_ids");
  ArgCheck ntpp(op, "num_tokens_post_padded", num_tokens_post_padded);
  ntpp.rank(1).dtype(DType::kInt32).dim(0, 1, "a single count").on(device, "topk_ids")
      .no_overlap(sorted_token_ids, "sorted_token_ids").no_overlap(expert_ids, "expert_ids");
  if (block_lora_ids) {
    ArgCheck(op, "block_lora_ids", *block_lora_ids)
        .rank(1).dtype(DType::kInt32).unit_stride(0).on(device, "topk_ids")
        .dim(0, expert_ids.shape[0], "one adapter per block, as 'expert_ids'")
        .no_overlap(sorted_token_ids, "sorted_token_ids").no_overlap(expert_ids, "expert_ids");
    ntpp.no_overlap(*block_lora_ids, "block_lora_ids");
  }
  if (expert_map) {
    ArgCheck(op, "expert_map", *expert_map)
        .rank(1).dtype(DType::kInt32).unit_stride(0).dim(0, num_experts, "num_experts").on(device, "topk_ids");
  }
  if (int64_t(cap.max_num_tokens_padded) > INT32_MAX) {
    fail(op, "argument 'topk_ids' expected fewer slots (sorted ids are int32), got " + topk_ids.shape_string());
  }
  check_cpu_ids(op, "topk_ids", topk_ids, -1, num_experts);
  if (on_cuda(topk_ids)) require_cuda_backend(op);
  detail::AlignParams p = align_params(topk_ids, block_size, num_experts, expert_map, sorted_token_ids, expert_ids,
                                       num_tokens_post_padded);
  if (block_lora_ids) p.block_lora_ids = static_cast<int32_t*>(block_lora_ids->data);
  return p;
}

void check_align_args(const char* op, const TensorView& topk_ids, int64_t block_size, int64_t num_experts) {
  ArgCheck(op, "topk_ids", topk_ids).rank(2).dtype_in({DType::kInt32, DType::kInt64});
  check_block_size(op, block_size, /*multiple_of_16=*/false);
  if (num_experts < 1 || num_experts > kMaxNumExperts) {
    fail(op, "argument 'num_experts' expected a value in [1, " + std::to_string(kMaxNumExperts) + "], got " +
                 std::to_string(num_experts));
  }
}

}  // namespace

void moe_align_block_size(const TensorView& topk_ids, int64_t block_size, int64_t num_experts,
                          const TensorView* expert_map, const TensorView& sorted_token_ids,
                          const TensorView& expert_ids, const TensorView& num_tokens_post_padded,
                          Stream stream) {
  const char* op = "moe_align_block_size";
  check_align_args(op, topk_ids, block_size, num_experts);
  run_align(checked_align_params(op, "moe_align_block_size_capacity", topk_ids, block_size, num_experts, num_experts,
                                 expert_map, sorted_token_ids, expert_ids, nullptr, num_tokens_post_padded),
            topk_ids.device, stream);
}

// ---------------------------------------------------------------------------------
// LoRA: shared validation of the adapter state and the stacks.
namespace {

// Groups of the virtual alignment: (expert, adapter or none) pairs.
int64_t lora_groups(int64_t num_experts, int64_t max_loras) { return num_experts * (max_loras + 1); }

void check_max_loras(const char* op, int64_t max_loras) {
  if (max_loras < 1 || max_loras > kMaxLoraAdapters) {
    fail(op, "argument 'max_loras' expected a value in [1, " + std::to_string(kMaxLoraAdapters) + "], got " +
                 std::to_string(max_loras));
  }
}

// token_lora_ids [num_tokens] int32 (CPU: values in [-1, max_loras)), adapter_enabled and
// adapter_scale [max_loras].
detail::LoraAdapterParams lora_adapter_params(const char* op, const MoeLoraAdapters& a, int64_t num_tokens,
                                              int64_t max_loras, const Device& device, const char* device_of) {
  ArgCheck(op, "token_lora_ids", a.token_lora_ids).rank(1).dtype(DType::kInt32).on(device, device_of)
      .dim(0, num_tokens, "tokens");
  if (a.adapter_enabled) {
    ArgCheck(op, "adapter_enabled", *a.adapter_enabled).rank(1).dtype(DType::kInt32).unit_stride(0)
        .on(device, device_of).dim(0, max_loras, "adapter slots");
  }
  if (a.adapter_scale) {
    ArgCheck(op, "adapter_scale", *a.adapter_scale).rank(1).dtype(DType::kFloat32).unit_stride(0)
        .on(device, device_of).dim(0, max_loras, "adapter slots");
  }
  check_cpu_ids(op, "token_lora_ids", a.token_lora_ids, -1, max_loras);
  return detail::LoraAdapterParams{
      .token_lora_ids = static_cast<const int32_t*>(a.token_lora_ids.data),
      .token_lora_ids_stride = a.token_lora_ids.strides[0],
      .adapter_enabled = a.adapter_enabled ? static_cast<const int32_t*>(a.adapter_enabled->data) : nullptr,
      .adapter_scale = a.adapter_scale ? static_cast<const float*>(a.adapter_scale->data) : nullptr,
      .max_loras = max_loras,
  };
}

// A GEMM's stacks: every slice lora_a [L, E, r, K], lora_b [L, E, N / S, r], dtype of the
// GEMM, unit stride on the last dim. `name` prefixes the argument names ("w13_" ...).
struct LoraStack {
  int64_t max_loras, rank, N_slice;
  int num_slices;
  detail::LoraSliceParams slices[2];
};
LoraStack lora_stack(const char* op, const std::string& name, const MoeLoraWeights& w, int64_t num_experts,
                     int64_t K, int64_t N, DType dtype, const Device& device, const char* device_of) {
  if (w.num_slices != 1 && w.num_slices != 2) {
    fail(op, "argument '" + name + "num_slices' expected 1 or 2, got " + std::to_string(w.num_slices));
  }
  if (N % w.num_slices != 0) {
    fail(op, "argument '" + name + "num_slices' expected to divide the GEMM's " + std::to_string(N) +
                 " output columns, got " + std::to_string(w.num_slices));
  }
  LoraStack st{};
  st.num_slices = w.num_slices;
  st.N_slice = N / w.num_slices;
  for (int c = 0; c < w.num_slices; ++c) {
    const std::string a_name = name + "lora_a[" + std::to_string(c) + "]";
    const std::string b_name = name + "lora_b[" + std::to_string(c) + "]";
    const TensorView& la = w.lora_a[c];
    const TensorView& lb = w.lora_b[c];
    ArgCheck(op, a_name.c_str(), la).rank(4).dtype(dtype).on(device, device_of).unit_stride(3)
        .dim(1, num_experts, "experts").dim(3, K, "the GEMM's K");
    if (c == 0) {
      st.max_loras = la.shape[0];
      st.rank = la.shape[2];
      if (st.max_loras < 1 || st.max_loras > kMaxLoraAdapters) {
        fail(op, "argument '" + a_name + "' expected 1 to " + std::to_string(kMaxLoraAdapters) +
                     " adapter slots on dim 0, got shape " + la.shape_string());
      }
      if (st.rank < 1 || st.rank > kMaxLoraRank) {
        fail(op, "argument '" + a_name + "' expected a rank (dim 2) in [1, " + std::to_string(kMaxLoraRank) +
                     "], got shape " + la.shape_string());
      }
    }
    ArgCheck(op, a_name.c_str(), la).dim(0, st.max_loras, "adapter slots, from the first slice")
        .dim(2, st.rank, "rank, from the first slice");
    ArgCheck(op, b_name.c_str(), lb).rank(4).dtype(dtype).on(device, device_of).unit_stride(3)
        .dim(0, st.max_loras, "adapter slots, from lora_a").dim(1, num_experts, "experts")
        .dim(2, st.N_slice, "the slice's output columns").dim(3, st.rank, "rank, from lora_a");
    st.slices[c] = detail::LoraSliceParams{
        .lora_a = la.data, .a_stride_lora = la.strides[0], .a_stride_expert = la.strides[1],
        .a_stride_rank = la.strides[2],
        .lora_b = lb.data, .b_stride_lora = lb.strides[0], .b_stride_expert = lb.strides[1],
        .b_stride_n = lb.strides[2]};
  }
  return st;
}

// One GEMM's LoRA delta in the per-slot mode (topk_ids [M, top_k] gives each slot's
// expert); with_blocks() switches it to the blocks of a LoRA alignment.
struct LoraDelta {
  detail::LoraDeltaParams p{};
  LoraDelta(const LoraStack& st, bool interleaved, const TensorView& a, int64_t a_top_k, int64_t num_experts,
            const TensorView& out, bool add_inputs, const TensorView* topk_weights,
            const detail::LoraAdapterParams& adapters, const TensorView& topk_ids, const TensorView* expert_map,
            int64_t num_global_experts, void* intermediate) {
    p.dtype = a.dtype;
    p.a = a.data;
    p.a_stride_row = a.strides[0];
    p.a_top_k = a_top_k;
    p.K = a.shape[1];
    p.N_slice = st.N_slice;
    p.rank = st.rank;
    p.num_slices = st.num_slices;
    p.slices[0] = st.slices[0];
    p.slices[1] = st.slices[1];
    p.interleaved_slices = interleaved;
    p.num_experts = num_experts;
    p.out = out.data;
    p.out_stride_row = out.strides[0];
    p.out_stride_n = out.strides[1];
    p.add_inputs = add_inputs;
    if (topk_weights) {
      p.topk_weights = static_cast<const float*>(topk_weights->data);
      p.topk_weights_cols = topk_ids.shape[1];
      p.topk_weights_stride_row = topk_weights->strides[0];
      p.topk_weights_stride_col = topk_weights->strides[1];
    }
    p.adapters = adapters;
    p.top_k = topk_ids.shape[1];
    p.num_slots = topk_ids.shape[0] * topk_ids.shape[1];
    p.intermediate = intermediate;
    p.topk_ids = topk_ids.data;
    p.topk_ids_int64 = topk_ids.dtype == DType::kInt64;
    p.topk_ids_stride_token = topk_ids.strides[0];
    p.topk_ids_stride_k = topk_ids.strides[1];
    p.expert_map = expert_map ? static_cast<const int32_t*>(expert_map->data) : nullptr;
    p.num_global_experts = num_global_experts;
  }
  LoraDelta& with_blocks(const int32_t* sorted_token_ids, int64_t max_num_tokens_padded, const int32_t* expert_ids,
                         const int32_t* block_lora_ids, int64_t max_num_blocks, const int32_t* num_tokens_post_padded,
                         int64_t block_size) {
    p.sorted_token_ids = sorted_token_ids;
    p.max_num_tokens_padded = max_num_tokens_padded;
    p.expert_ids = expert_ids;
    p.block_lora_ids = block_lora_ids;
    p.max_num_blocks = max_num_blocks;
    p.num_tokens_post_padded = num_tokens_post_padded;
    p.block_size = block_size;
    return *this;
  }
};

}  // namespace

AlignCapacity moe_lora_align_block_size_capacity(int64_t num_slots, int64_t block_size, int64_t num_experts,
                                                 int64_t max_loras) {
  return moe_align_block_size_capacity(num_slots, block_size, lora_groups(num_experts, max_loras));
}

void moe_lora_align_block_size(const TensorView& topk_ids, const MoeLoraAdapters& adapters, int64_t max_loras,
                               int64_t block_size, int64_t num_experts, const TensorView* expert_map,
                               const TensorView& sorted_token_ids, const TensorView& expert_ids,
                               const TensorView& block_lora_ids, const TensorView& num_tokens_post_padded,
                               Stream stream) {
  const char* op = "moe_lora_align_block_size";
  check_align_args(op, topk_ids, block_size, num_experts);
  check_max_loras(op, max_loras);
  const detail::LoraAdapterParams lora =
      lora_adapter_params(op, adapters, topk_ids.shape[0], max_loras, topk_ids.device, "topk_ids");
  detail::AlignParams p = checked_align_params(op, "moe_lora_align_block_size_capacity", topk_ids, block_size,
                                               num_experts, lora_groups(num_experts, max_loras), expert_map,
                                               sorted_token_ids, expert_ids, &block_lora_ids, num_tokens_post_padded);
  p.max_loras = max_loras;
  p.token_lora_ids = lora.token_lora_ids;
  p.token_lora_ids_stride = lora.token_lora_ids_stride;
  p.adapter_enabled = lora.adapter_enabled;
  run_align(p, topk_ids.device, stream);
}

int64_t fused_moe_lora_workspace_size(int64_t num_slots, int num_slices, int64_t rank, DType dtype) {
  return round_up(std::max<int64_t>(num_slots * num_slices * rank * int64_t(dtype_size(dtype)), 1), 256);
}

void fused_moe_lora(const FusedMoeLoraArgs& args, Stream stream) {
  const char* op = "fused_moe_lora";
  const TensorView& a = args.a;
  float_dtype(ArgCheck(op, "a", a).rank(2).unit_stride(1));
  const Device device = a.device;
  ArgCheck(op, "topk_ids", args.topk_ids).rank(2).dtype_in({DType::kInt32, DType::kInt64}).on(device, "a");
  const int64_t M = args.topk_ids.shape[0], top_k = args.topk_ids.shape[1];
  const int64_t num_slots = M * top_k;
  if (top_k < 1) fail(op, "argument 'topk_ids' expected top_k >= 1, got shape " + args.topk_ids.shape_string());
  if (a.shape[0] != M && a.shape[0] != num_slots) {
    fail(op, "argument 'a' expected " + std::to_string(M) + " rows (one per token) or " + std::to_string(num_slots) +
                 " (one per slot), got shape " + a.shape_string());
  }
  ArgCheck(op, "out", args.out).rank(2).same_dtype(a, "a").on(device, "a").dim(0, num_slots, "slots = M * top_k")
      .no_overlap(a, "a");
  const int64_t K = a.shape[1], N = args.out.shape[1];
  const int64_t num_experts = args.weights.lora_a[0].rank == 4 ? args.weights.lora_a[0].shape[1] : 0;
  const LoraStack st = lora_stack(op, "", args.weights, num_experts, K, N, a.dtype, device, "a");
  const detail::LoraAdapterParams adapters = lora_adapter_params(op, args.adapters, M, st.max_loras, device, "a");
  check_cpu_ids(op, "topk_ids", args.topk_ids, -1, num_experts);
  const TensorView* topk_weights = nullptr;
  if (args.mul_routed_weight) {
    if (!args.topk_weights) fail(op, "argument 'topk_weights' expected a tensor when mul_routed_weight, got none");
    ArgCheck(op, "topk_weights", *args.topk_weights).rank(2).dtype(DType::kFloat32).on(device, "a")
        .dim(0, M, "tokens").dim(1, top_k, "top_k, from 'topk_ids'");
    topk_weights = args.topk_weights;
  }
  const bool blocks = args.sorted_token_ids != nullptr;
  if (blocks != (args.expert_ids != nullptr) || blocks != (args.block_lora_ids != nullptr) ||
      blocks != (args.num_tokens_post_padded != nullptr)) {
    fail(op, "argument 'sorted_token_ids' expected all four alignment tensors (sorted_token_ids, expert_ids, "
             "block_lora_ids, num_tokens_post_padded) or none, got some");
  }
  if (blocks) {
    check_block_size(op, args.block_size, /*multiple_of_16=*/false);
    ArgCheck(op, "sorted_token_ids", *args.sorted_token_ids).rank(1).dtype(DType::kInt32).unit_stride(0).on(device, "a");
    const int64_t blocks_needed = ceil_div(args.sorted_token_ids->shape[0], args.block_size);
    ArgCheck(op, "expert_ids", *args.expert_ids).rank(1).dtype(DType::kInt32).unit_stride(0).on(device, "a")
        .dim_at_least(0, blocks_needed, "one expert per block of 'sorted_token_ids'");
    ArgCheck(op, "block_lora_ids", *args.block_lora_ids).rank(1).dtype(DType::kInt32).unit_stride(0).on(device, "a")
        .dim_at_least(0, blocks_needed, "one adapter per block of 'sorted_token_ids'");
    ArgCheck(op, "num_tokens_post_padded", *args.num_tokens_post_padded)
        .rank(1).dtype(DType::kInt32).dim(0, 1, "a single count").on(device, "a");
    if (!on_cuda(a)) {
      // Readable on the CPU: an id outside its range would index past the stacks.
      const int64_t used = std::min<int64_t>(
          blocks_needed, ceil_div(*static_cast<const int32_t*>(args.num_tokens_post_padded->data), args.block_size));
      TensorView e = *args.expert_ids, l = *args.block_lora_ids;
      e.shape[0] = l.shape[0] = std::max<int64_t>(used, 0);
      check_cpu_ids(op, "expert_ids", e, -1, num_experts);
      check_cpu_ids(op, "block_lora_ids", l, -1, st.max_loras);
    }
  }
  const int64_t workspace_bytes = fused_moe_lora_workspace_size(num_slots, st.num_slices, st.rank, a.dtype);
  ArgCheck(op, "workspace", args.workspace).rank(1).on(device, "a").unit_stride(0);
  if (args.workspace.numel() * int64_t(dtype_size(args.workspace.dtype)) < workspace_bytes) {
    fail(op, "argument 'workspace' expected at least " + std::to_string(workspace_bytes) +
                 " bytes (fused_moe_lora_workspace_size), got " +
                 std::to_string(args.workspace.numel() * int64_t(dtype_size(args.workspace.dtype))));
  }
  if (reinterpret_cast<uintptr_t>(args.workspace.data) % 256 != 0) {
    fail(op, "argument 'workspace' expected a 256-byte aligned pointer, got an unaligned one");
  }
  for (const auto& [t, name] : {std::pair{&a, "a"}, std::pair{&args.out, "out"}}) {
    if (detail::views_overlap(args.workspace, *t)) {
      fail(op, std::string("argument 'workspace' expected memory disjoint from '") + name + "', got an overlap");
    }
  }
  if (on_cuda(a)) require_cuda_backend(op);
  if (num_slots == 0) return;
  LoraDelta delta(st, args.weights.interleaved_slices, a, a.shape[0] == num_slots ? 1 : top_k, num_experts, args.out,
                  args.add_inputs, topk_weights, adapters, args.topk_ids, nullptr, num_experts, args.workspace.data);
  if (blocks) {
    delta.with_blocks(static_cast<const int32_t*>(args.sorted_token_ids->data), args.sorted_token_ids->shape[0],
                      static_cast<const int32_t*>(args.expert_ids->data),
                      static_cast<const int32_t*>(args.block_lora_ids->data),
                      std::min(args.expert_ids->shape[0], args.block_lora_ids->shape[0]),
                      static_cast<const int32_t*>(args.num_tokens_post_padded->data), args.block_size);
  }
  run_lora_delta(delta.p, device, stream);
}

// ---------------------------------------------------------------------------------
namespace {

detail::GemmParams gemm_params(const TensorView& a, const TensorView& w, const TensorView& out,
                               const TensorView& sorted_token_ids, const TensorView& expert_ids,
                               const TensorView& num_tokens_post_padded, const TensorView* topk_weights,
                               int64_t top_k, int64_t block_size, GemmTile tile) {
  return detail::GemmParams{
      .dtype = a.dtype,
      .a = a.data,
      .a_stride_row = a.strides[0],
      .a_stride_k = a.strides[1],
      .w = w.data,
      .w_stride_expert = w.strides[0],
      .w_stride_n = w.strides[1],
      .w_stride_k = w.strides[2],
      .out = out.data,
      .out_stride_row = out.strides[0],
      .out_stride_n = out.strides[1],
      .topk_weights = topk_weights ? static_cast<const float*>(topk_weights->data) : nullptr,
      .topk_weights_cols = topk_weights ? topk_weights->shape[1] : 1,
      .topk_weights_stride_row = topk_weights ? topk_weights->strides[0] : 0,
      .topk_weights_stride_col = topk_weights ? topk_weights->strides[1] : 0,
      .sorted_token_ids = static_cast<const int32_t*>(sorted_token_ids.data),
      .sorted_token_ids_size = sorted_token_ids.shape[0],
      .expert_ids = static_cast<const int32_t*>(expert_ids.data),
      .num_tokens_post_padded = static_cast<const int32_t*>(num_tokens_post_padded.data),
      .max_num_blocks = std::min<int64_t>(expert_ids.shape[0], ceil_div(sorted_token_ids.shape[0], block_size)),
      .num_rows = a.shape[0],
      .num_slots = out.shape[0],
      .num_experts = w.shape[0],
      .N = w.shape[1],
      .K = w.shape[2],
      .top_k = top_k,
      .block_size = block_size,
      .tile = tile,
  };
}

}  // namespace

void fused_moe(const FusedMoeArgs& args, Stream stream) {
  const char* op = "fused_moe";
  const TensorView& a = args.a;
  float_dtype(ArgCheck(op, "a", a).rank(2));
  const Device device = a.device;
  ArgCheck(op, "w", args.w).rank(3).same_dtype(a, "a").on(device, "a").dim(2, a.shape[1], "K, from 'a'");
  if (args.top_k < 1) fail(op, "argument 'top_k' expected >= 1, got " + std::to_string(args.top_k));
  ArgCheck(op, "out", args.out)
      .rank(2).same_dtype(a, "a").on(device, "a")
      .dim(0, a.shape[0] * args.top_k, "num_slots = a rows * top_k")
      .dim(1, args.w.shape[1], "N, from 'w'")
      .no_overlap(a, "a").no_overlap(args.w, "w");
  check_block_size(op, args.block_size, /*multiple_of_16=*/true);
  detail::check_gemm_tile(op, "tile", args.tile, args.block_size);
  ArgCheck(op, "sorted_token_ids", args.sorted_token_ids).rank(1).dtype(DType::kInt32).unit_stride(0).on(device, "a");
  ArgCheck(op, "expert_ids", args.expert_ids).rank(1).dtype(DType::kInt32).unit_stride(0).on(device, "a")
      .dim_at_least(0, ceil_div(args.sorted_token_ids.shape[0], args.block_size),
                    "one expert per block of 'sorted_token_ids'");
  ArgCheck(op, "num_tokens_post_padded", args.num_tokens_post_padded)
      .rank(1).dtype(DType::kInt32).dim(0, 1, "a single count").on(device, "a");
  const TensorView* topk_weights = nullptr;
  if (args.mul_routed_weight) {
    if (!args.topk_weights) fail(op, "argument 'topk_weights' expected a tensor when mul_routed_weight, got none");
    ArgCheck(op, "topk_weights", *args.topk_weights).rank(2).dtype(DType::kFloat32).on(device, "a");
    if (args.topk_weights->numel() != args.out.shape[0]) {
      fail(op, "argument 'topk_weights' expected " + std::to_string(args.out.shape[0]) +
                   " elements (one per slot), got shape " + args.topk_weights->shape_string());
    }
    topk_weights = args.topk_weights;
  }
  if (on_cuda(a)) require_cuda_backend(op);
  if (!on_cuda(a)) {
    // On the CPU the block experts are readable: an id outside [-1, E) would index past w.
    const int64_t used_blocks =
        std::min<int64_t>(args.expert_ids.shape[0],
                          ceil_div(*static_cast<const int32_t*>(args.num_tokens_post_padded.data), args.block_size));
    TensorView used = args.expert_ids;
    used.shape[0] = std::max<int64_t>(used_blocks, 0);
    check_cpu_ids(op, "expert_ids", used, -1, args.w.shape[0]);
  }
  run_gemm(gemm_params(a, args.w, args.out, args.sorted_token_ids, args.expert_ids, args.num_tokens_post_padded,
                       topk_weights, args.top_k, args.block_size, args.tile),
           device, stream);
}

// ---------------------------------------------------------------------------------
namespace {

void run_activation_op(const char* op, detail::ActivationKind kind, const TensorView& input, const TensorView& out,
                       float alpha, float limit, Stream stream) {
  float_dtype(ArgCheck(op, "input", input).rank(2).unit_stride(1));
  if (input.shape[1] % 2 != 0) {
    fail(op, "argument 'input' expected an even last dim (gate and up halves), got shape " + input.shape_string());
  }
  ArgCheck(op, "out", out)
      .rank(2).same_dtype(input, "input").on(input.device, "input").unit_stride(1)
      .dim(0, input.shape[0], "rows of 'input'").dim(1, input.shape[1] / 2, "half the last dim of 'input'")
      .no_overlap(input, "input");
  if (on_cuda(input)) require_cuda_backend(op);
  const detail::ActivationParams p{
      .dtype = input.dtype,
      .kind = kind,
      .input = input.data,
      .input_stride_row = input.strides[0],
      .out = out.data,
      .out_stride_row = out.strides[0],
      .num_rows = input.shape[0],
      .width = out.shape[1],
      .alpha = alpha,
      .limit = limit,
  };
  run_activation(p, input.device, stream);
}

}  // namespace

void silu_and_mul(const TensorView& input, const TensorView& out, Stream stream) {
  run_activation_op("silu_and_mul", detail::ActivationKind::kSiluAndMul, input, out, 0.f, 0.f, stream);
}

void gelu_and_mul(const TensorView& input, const TensorView& out, Stream stream) {
  run_activation_op("gelu_and_mul", detail::ActivationKind::kGeluAndMul, input, out, 0.f, 0.f, stream);
}

void swiglu_oai_and_mul(const TensorView& input, const TensorView& out, float alpha, float limit, Stream stream) {
  if (!(limit > 0.f)) fail("swiglu_oai_and_mul", "argument 'limit' expected > 0, got " + std::to_string(limit));
  run_activation_op("swiglu_oai_and_mul", detail::ActivationKind::kSwigluOai, input, out, alpha, limit, stream);
}

// ---------------------------------------------------------------------------------
void moe_sum_reduce(const TensorView& input, const TensorView& out, float routed_scaling_factor, Stream stream) {
  const char* op = "moe_sum_reduce";
  float_dtype(ArgCheck(op, "input", input).rank(3).unit_stride(2));
  ArgCheck(op, "out", out)
      .rank(2).same_dtype(input, "input").on(input.device, "input").unit_stride(1)
      .dim(0, input.shape[0], "tokens of 'input'").dim(1, input.shape[2], "hidden size of 'input'")
      .no_overlap(input, "input");
  if (on_cuda(input)) require_cuda_backend(op);
  const detail::SumReduceParams p{
      .dtype = input.dtype,
      .input = input.data,
      .input_stride_token = input.strides[0],
      .input_stride_k = input.strides[1],
      .out = out.data,
      .out_stride_token = out.strides[0],
      .num_tokens = input.shape[0],
      .top_k = input.shape[1],
      .hidden = input.shape[2],
      .scale = routed_scaling_factor,
  };
  run_sum_reduce(p, input.device, stream);
}

// ---------------------------------------------------------------------------------
// fused_experts

int64_t fused_experts_block_size(int64_t num_tokens, int64_t top_k, int64_t num_experts,
                                 const FusedExpertsOptions& options) {
  if (options.block_size > 0) return options.block_size;
  // NOTE: monotone in num_tokens, so the first (largest) chunk's block size bounds the
  // workspace of every later chunk. Tiles of 16 rows waste least padding when each
  // expert sees few slots (decode); 64 once experts see dozens of slots.
  const int64_t slots_per_expert = ceil_div(std::max<int64_t>(num_tokens, 1) * top_k, std::max<int64_t>(num_experts, 1));
  if (slots_per_expert <= 16) return 16;
  if (slots_per_expert <= 48) return 32;
  return 64;
}

MoeKernelConfig fused_experts_config(const FusedExpertsShape& shape, int64_t num_local_experts, Device device,
                                     const FusedExpertsOptions& options) {
  const int64_t heuristic_block_size = fused_experts_block_size(shape.num_tokens, shape.top_k, shape.num_experts, options);
  if (options.config != nullptr) {
    MoeKernelConfig config = *options.config;
    if (options.block_size > 0 || config.block_size == 0) config.block_size = heuristic_block_size;
    return config;
  }
  MoeKernelConfig config;
  config.block_size = heuristic_block_size;
  if (options.block_size > 0 || device.type != DeviceType::kCUDA) return config;
#ifdef MOELORA_WITH_CUDA
  const detail::CudaDeviceFacts facts = cuda::current_device_facts();
  const std::string file_name = detail::kernel_config_file_name(num_local_experts, shape.intermediate_size, shape.dtype, facts.name);
  if (const detail::KernelConfigTable* table = detail::find_kernel_config_table(file_name)) {
    const MoeKernelConfig tuned = detail::nearest_kernel_config(*table, std::max<int64_t>(shape.num_tokens, 1));
    const bool runs_here = facts.sm90_kernels ||
                           (tuned.gemm1.kernel != GemmKernel::kSm90 && tuned.gemm2.kernel != GemmKernel::kSm90);
    if (runs_here) return tuned;
  }
  // No table: wgmma tiles of 128 rows once experts see enough slots to fill them; the
  // small-batch kernels while there are no more slots than experts. NOTE: that rule
  // matches every cell the H100 tuner measured (docs/PERF_NOTES.md, issue 3 step 5):
  // small-batch won up to 64 slots on the 64-256-expert models and up to 8 on Mixtral
  // (8 experts), and lost beyond.
  const int64_t slots = std::max<int64_t>(shape.num_tokens, 1) * shape.top_k;
  const int64_t slots_per_expert = ceil_div(slots, std::max<int64_t>(shape.num_experts, 1));
  if (facts.sm90_kernels && slots_per_expert >= 192) config.block_size = 128;
  config.small_batch = slots <= std::min(kSmallBatchMaxSlots, shape.num_experts);
#else
  (void)num_local_experts;
#endif
  return config;
}

std::string kernel_config_file_name(int64_t num_local_experts, int64_t intermediate_size, DType dtype) {
#ifdef MOELORA_WITH_CUDA
  if (cuda::device_available()) {
    return detail::kernel_config_file_name(num_local_experts, intermediate_size, dtype, cuda::current_device_facts().name);
  }
#endif
  (void)num_local_experts, (void)intermediate_size, (void)dtype;
  throw Error("moelora.kernel_config_file_name: tables are per CUDA device, and no CUDA device is available");
}

namespace {

// GEMM1's and GEMM2's ordered-tile counters (GemmParams::tile_counter).
constexpr int kNumTileCounters = 2;
// The segmented shrink's split-K scratch: up to 32 splits (the CUDA kernel's limit) of
// fp32 partial sums, at most 8 MB (a shrink over more padded entries splits less).
constexpr int64_t kLoraShrinkMaxSplits = 32;
constexpr int64_t kLoraShrinkPartialBytes = int64_t(8) << 20;

// Chunks of at least this many slots get room for the activation in sorted order
// (GemmParams::out_rows_sorted: padded entries, not slots); smaller ones keep it by slot.
constexpr int64_t kSortedActivationMinSlots = 512;

// Workspace layout, each piece 256-byte aligned. cache1 (GEMM1's [slots, 2I], only when
// the activation runs as its own kernel) is dead once the activation has read it, before
// GEMM2 writes cache3 ([slots, H]): the two share one region, and so does the sorted input.
struct WorkspaceLayout {
  int64_t sorted_token_ids, expert_ids, num_tokens_post_padded, tile_counters, cache1, cache2, cache3, sorted_input,
      block_lora_ids, entry_lora_ids, block_lora_masks, lora_intermediate, lora_shrink_partials, lora_shrink_counters,
      total;
  int64_t lora_shrink_partial_rows;  // rows of [*, 2 * rank] fp32 partial sums
  int64_t cache2_rows;  // slots, or the padded entries of the worst block size (sorted activation)
  int64_t sorted_input_rows;  // 0, or cache2_rows when a chunk's config may ask for the sorted input
  AlignCapacity capacity;
};

// Whether a chunk of this call may run with MoeKernelConfig::sorted_input: the caller's
// config, else the tuned table of the current CUDA device for the full and the last
// chunk. NOTE: the sorted input needs [padded entries, H] of workspace, up to
// (E + 1) x 255 rows more than the slots (~0.9 GB for DeepSeek-V3 at 8192 tokens), so
// only calls whose config may use it reserve it; a call whose table changed since the
// query runs without it.
bool may_sort_input(const FusedExpertsShape& s, const FusedExpertsOptions& o, int64_t chunk_tokens) {
  if (o.config != nullptr) return o.config->sorted_input;
#ifdef MOELORA_WITH_CUDA
  if (o.block_size > 0 || !cuda::device_available()) return false;
  const int64_t num_local_experts = s.num_local_experts > 0 ? s.num_local_experts : s.num_experts;
  const Device cuda_device{DeviceType::kCUDA, 0};  // the table follows the current device
  for (int64_t tokens : {chunk_tokens, s.num_tokens % chunk_tokens}) {
    FusedExpertsShape chunk = s;
    chunk.num_tokens = tokens;
    if (tokens > 0 && fused_experts_config(chunk, num_local_experts, cuda_device, o).sorted_input) return true;
  }
#else
  (void)s, (void)chunk_tokens;
#endif
  return false;
}

WorkspaceLayout workspace_layout(const FusedExpertsShape& s, const FusedExpertsOptions& o) {
  const int64_t chunk_tokens = std::min(s.num_tokens, std::max<int64_t>(o.chunk_size, 1));
  const int64_t slots = chunk_tokens * s.top_k;
  // NOTE: the block size of a chunk comes from the config registry at call time, and a
  // table may change between this query and the call ($MOELORA_CONFIG_DIR). Unless the
  // caller fixed it, size each alignment buffer for its worst block size: padded
  // entries peak at 256, block counts at 16. Both are small next to the GEMM caches.
  const int64_t fixed_block_size = o.block_size > 0                              ? o.block_size
                                   : o.config != nullptr && o.config->block_size > 0 ? o.config->block_size
                                                                                   : 0;
  const int64_t elem = int64_t(dtype_size(s.dtype));
  WorkspaceLayout l{};
  // With LoRA the alignment groups are virtual experts (expert, adapter or none).
  const int64_t groups = s.max_loras > 0 ? lora_groups(s.num_experts, s.max_loras) : s.num_experts;
  for (int64_t block_size = fixed_block_size > 0 ? fixed_block_size : 16;
       block_size <= (fixed_block_size > 0 ? fixed_block_size : kMaxBlockSize); block_size += 16) {
    const AlignCapacity c = moe_align_block_size_capacity(slots, block_size, groups);
    l.capacity.max_num_tokens_padded = std::max(l.capacity.max_num_tokens_padded, c.max_num_tokens_padded);
    l.capacity.max_num_blocks = std::max(l.capacity.max_num_blocks, c.max_num_blocks);
  }
  int64_t at = 0;
  auto take = [&at](int64_t bytes) { const int64_t here = at; at += round_up(std::max<int64_t>(bytes, 1), 256); return here; };
  l.sorted_token_ids = take(l.capacity.max_num_tokens_padded * 4);
  l.expert_ids = take(l.capacity.max_num_blocks * 4);
  l.num_tokens_post_padded = take(4);
  l.tile_counters = take(kNumTileCounters * 4);
  l.cache2_rows = slots >= kSortedActivationMinSlots ? std::max(slots, l.capacity.max_num_tokens_padded) : slots;
  // The sorted input ([padded entries, H], read by GEMM1 only) shares the region too: GEMM2
  // writes cache3 after GEMM1 has finished.
  l.sorted_input_rows =
      slots >= kSortedActivationMinSlots && chunk_tokens > 0 && may_sort_input(s, o, chunk_tokens) ? l.cache2_rows : 0;
  l.cache1 = l.cache3 = l.sorted_input =
      take(std::max(slots * std::max(2 * s.intermediate_size, s.hidden_size), l.sorted_input_rows * s.hidden_size) *
           elem);
  l.cache2 = take(l.cache2_rows * s.intermediate_size * elem);
  if (s.max_loras > 0) {
    l.block_lora_ids = take(l.capacity.max_num_blocks * 4);
    l.entry_lora_ids = take(l.capacity.max_num_tokens_padded * 4);  // the segmented alignment (fused path)
    l.block_lora_masks = take(l.capacity.max_num_blocks * 8);
    // Each GEMM's shrink output (w13: 2 slices at most): [slots, slices, rank], or by
    // entry for the fused expand ([padded entries, slices * rank]). GEMM2's shrink runs
    // after GEMM1 has read GEMM1's, so they share it.
    l.lora_intermediate = take(std::max(slots, l.capacity.max_num_tokens_padded) * 2 * s.lora_rank * elem);
    // The fused path's shrink splits K when few blocks hold the entries (small M): fp32
    // partial sums by split and entry, and arrival counters.
    l.lora_shrink_partial_rows = std::min(kLoraShrinkMaxSplits * l.capacity.max_num_tokens_padded,
                                          kLoraShrinkPartialBytes / (2 * s.lora_rank * 4));
    l.lora_shrink_partials = take(l.lora_shrink_partial_rows * 2 * s.lora_rank * 4);
    // One per 16 entries of the blocks: blocks end at most 255 entries past the padded ones.
    l.lora_shrink_counters = take((l.capacity.max_num_tokens_padded / 16 + 16) * 4);
  }
  l.total = at;
  return l;
}

#ifdef MOELORA_WITH_CUDA
// The small-batch kernels' parameters for one chunk: x_chunk, ids and weights are the
// chunk's rows; act is GEMM1's output in the workspace, out_chunk the chunk's first row.
detail::SmallBatchMoeParams small_batch_params(const FusedExpertsArgs& args, const FusedExpertsOptions& options,
                                               const TensorView& x_chunk, const TensorView& ids,
                                               const TensorView& weights, void* act, void* out_chunk,
                                               int64_t num_experts, detail::ActivationKind kind) {
  return detail::SmallBatchMoeParams{
      .dtype = x_chunk.dtype,
      .x = x_chunk.data,
      .x_stride_token = x_chunk.strides[0],
      .w13 = args.w13.data,
      .w13_stride_expert = args.w13.strides[0],
      .w13_stride_n = args.w13.strides[1],
      .w13_stride_k = args.w13.strides[2],
      .w2 = args.w2.data,
      .w2_stride_expert = args.w2.strides[0],
      .w2_stride_n = args.w2.strides[1],
      .w2_stride_k = args.w2.strides[2],
      .topk_ids = ids.data,
      .topk_ids_int64 = ids.dtype == DType::kInt64,
      .topk_ids_stride_token = ids.strides[0],
      .topk_ids_stride_k = ids.strides[1],
      .topk_weights = static_cast<const float*>(weights.data),
      .topk_weights_stride_token = weights.strides[0],
      .topk_weights_stride_k = weights.strides[1],
      .expert_map = args.expert_map ? static_cast<const int32_t*>(args.expert_map->data) : nullptr,
      .num_tokens = x_chunk.shape[0],
      .top_k = ids.shape[1],
      .num_experts = num_experts,
      .num_local_experts = args.w13.shape[0],
      .H = x_chunk.shape[1],
      .I = args.w2.shape[2],
      .act = act,
      .out = out_chunk,
      .out_stride_token = args.out.strides[0],
      .out_stride_k = options.no_combine ? args.out.strides[1] : 0,
      .no_combine = options.no_combine,
      .router_weight_on_input = options.apply_router_weight_on_input,
      .routed_scaling_factor = options.routed_scaling_factor,
      .activation = kind,
      .alpha = options.swiglu_alpha,
      .limit = options.swiglu_limit,
  };
}
#endif

}  // namespace

int64_t fused_experts_workspace_size(const FusedExpertsShape& shape, const FusedExpertsOptions& options) {
  return workspace_layout(shape, options).total;
}

void fused_experts(const FusedExpertsArgs& args, const FusedExpertsOptions& options, Stream stream) {
  const char* op = "fused_experts";
  const TensorView& x = args.hidden_states;
  float_dtype(ArgCheck(op, "hidden_states", x).rank(2).unit_stride(1));
  const Device device = x.device;
  const int64_t M = x.shape[0], H = x.shape[1];
  ArgCheck(op, "w13", args.w13).rank(3).same_dtype(x, "hidden_states").on(device, "hidden_states")
      .dim(2, H, "hidden size, from 'hidden_states'");
  if (args.w13.shape[1] % 2 != 0) {
    fail(op, "argument 'w13' expected an even dim 1 (2 * intermediate size), got shape " + args.w13.shape_string());
  }
  const int64_t E_local = args.w13.shape[0], I = args.w13.shape[1] / 2;
  if (E_local < 1 || E_local > kMaxNumExperts) {
    fail(op, "argument 'w13' expected 1 to " + std::to_string(kMaxNumExperts) + " experts on dim 0, got shape " +
                 args.w13.shape_string());
  }
  ArgCheck(op, "w2", args.w2).rank(3).same_dtype(x, "hidden_states").on(device, "hidden_states")
      .dim(0, E_local, "experts, from 'w13'").dim(1, H, "hidden size").dim(2, I, "intermediate size, from 'w13'");
  ArgCheck(op, "topk_ids", args.topk_ids).rank(2).dtype_in({DType::kInt32, DType::kInt64})
      .on(device, "hidden_states").dim(0, M, "tokens, from 'hidden_states'");
  const int64_t top_k = args.topk_ids.shape[1];
  if (top_k < 1) fail(op, "argument 'topk_ids' expected top_k >= 1, got shape " + args.topk_ids.shape_string());
  ArgCheck(op, "topk_weights", args.topk_weights).rank(2).dtype(DType::kFloat32).on(device, "hidden_states")
      .dim(0, M, "tokens").dim(1, top_k, "top_k, from 'topk_ids'");
  int64_t E_global = E_local;
  if (args.expert_map) {
    ArgCheck(op, "expert_map", *args.expert_map).rank(1).dtype(DType::kInt32).unit_stride(0)
        .on(device, "hidden_states");
    E_global = args.expert_map->shape[0];
    if (E_global < 1 || E_global > kMaxNumExperts) {
      fail(op, "argument 'expert_map' expected 1 to " + std::to_string(kMaxNumExperts) + " experts, got shape " +
                   args.expert_map->shape_string());
    }
    check_cpu_ids(op, "expert_map", *args.expert_map, -1, E_local);
  }
  check_cpu_ids(op, "topk_ids", args.topk_ids, -1, E_global);
  if (options.no_combine) {
    ArgCheck(op, "out", args.out).rank(3).same_dtype(x, "hidden_states").on(device, "hidden_states").unit_stride(2)
        .dim(0, M, "tokens").dim(1, top_k, "top_k (no_combine)").dim(2, H, "hidden size");
    if (M > 0 && top_k > 1 && args.out.strides[0] != top_k * args.out.strides[1]) {
      fail(op, "argument 'out' expected dims 0 and 1 to merge (stride0 == top_k * stride1) with no_combine, got strides [" +
                   std::to_string(args.out.strides[0]) + ", " + std::to_string(args.out.strides[1]) + ", 1]");
    }
  } else {
    ArgCheck(op, "out", args.out).rank(2).same_dtype(x, "hidden_states").on(device, "hidden_states").unit_stride(1)
        .dim(0, M, "tokens").dim(1, H, "hidden size");
  }
  const bool inplace = detail::same_view(args.out, x);
  if (!inplace) ArgCheck(op, "out", args.out).no_overlap(x, "hidden_states");
  for (const auto& [w, name] : {std::pair{&args.w13, "w13"}, std::pair{&args.w2, "w2"}}) {
    ArgCheck(op, "out", args.out).no_overlap(*w, name);
  }
  if (options.chunk_size < 1) fail(op, "argument 'chunk_size' expected >= 1, got " + std::to_string(options.chunk_size));
  if (options.block_size != 0) check_block_size(op, options.block_size, /*multiple_of_16=*/true);
  if (options.config != nullptr) {
    MoeKernelConfig resolved = *options.config;
    if (options.block_size > 0) resolved.block_size = options.block_size;
    if (resolved.block_size != 0) {
      detail::check_kernel_config(op, "config", resolved);
    } else if (resolved.gemm1.kernel != GemmKernel::kAuto || resolved.gemm2.kernel != GemmKernel::kAuto) {
      fail(op, "argument 'config' expected a block_size (or options.block_size) when it names GEMM tiles, got 0");
    }
  }
  if (options.activation == Activation::kSwigluOai && !(options.swiglu_limit > 0.f)) {
    fail(op, "argument 'swiglu_limit' expected > 0, got " + std::to_string(options.swiglu_limit));
  }
  // LoRA: the stacks of both GEMMs and the adapter state.
  LoraStack lora13{}, lora2{};
  detail::LoraAdapterParams lora_adapters{};
  if (args.lora) {
    lora13 = lora_stack(op, "w13_", args.lora->w13, E_local, H, 2 * I, x.dtype, device, "hidden_states");
    lora2 = lora_stack(op, "w2_", args.lora->w2, E_local, I, H, x.dtype, device, "hidden_states");
    if (lora2.num_slices != 1) {
      fail(op, "argument 'w2_num_slices' expected 1 (w2 has one output slice), got " + std::to_string(lora2.num_slices));
    }
    ArgCheck(op, "w2_lora_a[0]", args.lora->w2.lora_a[0]).dim(0, lora13.max_loras, "adapter slots, from w13_lora_a");
    // The slices of w13 follow its row order: interleaved exactly for gpt-oss's two.
    const bool interleaved13 = options.activation == Activation::kSwigluOai && lora13.num_slices == 2;
    if (args.lora->w13.interleaved_slices != interleaved13 || args.lora->w2.interleaved_slices) {
      fail(op, std::string("argument 'w13_interleaved_slices' expected ") + (interleaved13 ? "true" : "false") +
                   " (true only for swiglu_oai with two slices; w2's false), got " +
                   (args.lora->w13.interleaved_slices ? "true" : "false") + " / w2 " +
                   (args.lora->w2.interleaved_slices ? "true" : "false"));
    }
    lora_adapters = lora_adapter_params(op, args.lora->adapters, M, lora13.max_loras, device, "hidden_states");
  }

  FusedExpertsShape shape{M, top_k, E_global, H, I, x.dtype, E_local};
  if (args.lora) {
    shape.max_loras = lora13.max_loras;
    shape.lora_rank = std::max(lora13.rank, lora2.rank);
  }
  const WorkspaceLayout layout = workspace_layout(shape, options);
  ArgCheck(op, "workspace", args.workspace).rank(1).on(device, "hidden_states").unit_stride(0);
  const int64_t workspace_bytes = args.workspace.numel() * int64_t(dtype_size(args.workspace.dtype));
  if (workspace_bytes < layout.total) {
    fail(op, "argument 'workspace' expected at least " + std::to_string(layout.total) +
                 " bytes (fused_experts_workspace_size), got " + std::to_string(workspace_bytes));
  }
  if (reinterpret_cast<uintptr_t>(args.workspace.data) % 256 != 0) {
    fail(op, "argument 'workspace' expected a 256-byte aligned pointer, got an unaligned one");
  }
  for (const auto* t : {&x, &args.w13, &args.w2, &args.topk_ids, &args.topk_weights, &args.out}) {
    if (detail::views_overlap(args.workspace, *t)) fail(op, "argument 'workspace' expected memory disjoint from the other arguments, got an overlap");
  }
  if (args.lora) {
    if (detail::views_overlap(args.workspace, args.lora->adapters.token_lora_ids) ||
        detail::views_overlap(args.out, args.lora->adapters.token_lora_ids)) {
      fail(op, "argument 'token_lora_ids' expected memory disjoint from 'out' and 'workspace', got an overlap");
    }
  }
  if (on_cuda(x)) require_cuda_backend(op);
  if (M == 0) return;

  const DType dtype = x.dtype;
  const int64_t elem = int64_t(dtype_size(dtype));
  void* ws = args.workspace.data;
  const int64_t chunk = std::max<int64_t>(options.chunk_size, 1);
  auto i32 = [&](int64_t offset, int64_t n) {
    TensorView t = TensorView::contiguous(byte_offset(ws, offset), DType::kInt32, {n}, device);
    return t;
  };
  const TensorView sorted_ids = i32(layout.sorted_token_ids, layout.capacity.max_num_tokens_padded);
  const TensorView expert_ids = i32(layout.expert_ids, layout.capacity.max_num_blocks);
  const TensorView ntpp = i32(layout.num_tokens_post_padded, 1);
  int32_t* block_lora_ids = args.lora ? static_cast<int32_t*>(byte_offset(ws, layout.block_lora_ids)) : nullptr;
  int32_t* entry_lora_ids = args.lora ? static_cast<int32_t*>(byte_offset(ws, layout.entry_lora_ids)) : nullptr;
  uint64_t* block_lora_masks = args.lora ? static_cast<uint64_t*>(byte_offset(ws, layout.block_lora_masks)) : nullptr;
  int32_t* lora_shrink_counters =
      args.lora ? static_cast<int32_t*>(byte_offset(ws, layout.lora_shrink_counters)) : nullptr;
  int32_t* tile_counters =
      on_cuda(x) && options.ordered_tiles ? static_cast<int32_t*>(byte_offset(ws, layout.tile_counters)) : nullptr;

  for (int64_t begin = 0; begin < M; begin += chunk) {
    const int64_t tokens = std::min(chunk, M - begin);
    const int64_t slots = tokens * top_k;
    MoeKernelConfig config =
        fused_experts_config(FusedExpertsShape{tokens, top_k, E_global, H, I, x.dtype}, E_local, device, options);
    detail::check_kernel_config(op, "config", config);
    const int64_t block_size = config.block_size;
    const AlignCapacity cap = args.lora ? moe_lora_align_block_size_capacity(slots, block_size, E_global, lora13.max_loras)
                                        : moe_align_block_size_capacity(slots, block_size, E_global);
    if (cap.max_num_tokens_padded > layout.capacity.max_num_tokens_padded ||
        cap.max_num_blocks > layout.capacity.max_num_blocks) {
      // The layout bounds every block size; this guards the workspace against a new one.
      throw std::logic_error("moelora.fused_experts: block size " + std::to_string(block_size) +
                             " needs more alignment workspace than fused_experts_workspace_size reserved");
    }

    TensorView ids = args.topk_ids;
    ids.shape[0] = tokens;
    ids.data = byte_offset(ids.data, begin * ids.strides[0] * int64_t(dtype_size(ids.dtype)));
    TensorView weights = args.topk_weights;
    weights.shape[0] = tokens;
    weights.data = byte_offset(weights.data, begin * weights.strides[0] * 4);
    TensorView sorted_chunk = sorted_ids;
    sorted_chunk.shape[0] = cap.max_num_tokens_padded;
    TensorView expert_chunk = expert_ids;
    expert_chunk.shape[0] = cap.max_num_blocks;
    const TensorView x_chunk = view2d(byte_offset(x.data, begin * x.strides[0] * elem), dtype, tokens, H,
                                      x.strides[0], 1, device);
    // Both GEMMs on the tensor-core kernels (16-byte rows; e.g. I % 8 == 0) open two paths:
    // - with adapters, the fused LoRA: each GEMM takes its expand as extra K steps
    //   (GemmParams::lora_t) after a shrink kernel, on the segmented alignment, and the
    //   activation stays fused. Otherwise the aligned path runs on the virtual alignment,
    //   the activation as its own kernel and the delta kernels after each GEMM (the w13
    //   delta before the activation). The small-batch kernels take per-slot deltas.
    // - both on the sm90 kernel, the sorted activation: GEMM1 writes the activation in
    //   sorted order (row = entry), and GEMM2 loads each tile's rows as one TMA box instead
    //   of gathering them by slot. NOTE: gathered 16-byte cp.async rows cost ~35% of
    //   Mixtral's layer at M = 4096 (H100; docs/PERF_NOTES.md, issue 3 step 6).
    auto tensor_core_kernel = [](const GemmTile& t) {
      return t.kernel == GemmKernel::kSm80 || t.kernel == GemmKernel::kSm90;
    };
    const bool tensor_core_gemms = on_cuda(x) && options.fuse_activation && tensor_core_kernel(config.gemm1) &&
                                   tensor_core_kernel(config.gemm2);
    bool sm90_rows = false, fused_lora = false;
#ifdef MOELORA_WITH_CUDA
    if (tensor_core_gemms) {
      const TensorView by_slot = view2d(byte_offset(ws, layout.cache2), dtype, slots, I, I, 1, device);
      const detail::GemmParams gemm1_probe = gemm_params(x_chunk, args.w13, by_slot, sorted_chunk, expert_chunk, ntpp,
                                                         nullptr, top_k, block_size, config.gemm1);
      const detail::GemmParams gemm2_probe = gemm_params(by_slot, args.w2, by_slot, sorted_chunk, expert_chunk, ntpp,
                                                         nullptr, 1, block_size, config.gemm2);
      const bool loadable =
          cuda::fused_moe_tensor_core_loadable(gemm1_probe) && cuda::fused_moe_tensor_core_loadable(gemm2_probe);
      sm90_rows = loadable && config.gemm1.kernel == GemmKernel::kSm90 && config.gemm2.kernel == GemmKernel::kSm90;
      fused_lora = args.lora && loadable &&
                   cuda::fused_moe_lora_expand_supported(gemm1_probe, lora13.rank, lora13.num_slices, lora13.slices) &&
                   cuda::fused_moe_lora_expand_supported(gemm2_probe, lora2.rank, lora2.num_slices, lora2.slices);
    }
#endif
    if (args.lora && !fused_lora) config.sorted_input = false;  // the delta kernels read x by slot
    const bool sorted_activation =
        sm90_rows && (!args.lora || fused_lora) && cap.max_num_tokens_padded <= layout.cache2_rows;
    // GEMM1 reads x in sorted order too (a copy by moe_gather_sorted_rows): one TMA box
    // per tile instead of gathered rows. NOTE: a table choice: on H100 it cut Mixtral's
    // layer 24% at M = 4096 and made DeepSeek's (I = 256) 24% slower (PERF_NOTES step 7).
    const bool sorted_input =
        sorted_activation && config.sorted_input && cap.max_num_tokens_padded <= layout.sorted_input_rows;
    const TensorView cache2 = view2d(byte_offset(ws, layout.cache2), dtype,
                                     sorted_activation ? cap.max_num_tokens_padded : slots, I, I, 1, device);
    const detail::ActivationKind kind = options.activation == Activation::kSilu   ? detail::ActivationKind::kSiluAndMul
                                        : options.activation == Activation::kGelu ? detail::ActivationKind::kGeluAndMul
                                                                                  : detail::ActivationKind::kSwigluOai;
    void* out_chunk = byte_offset(args.out.data, begin * args.out.strides[0] * elem);
    detail::LoraAdapterParams chunk_adapters = lora_adapters;
    if (args.lora) chunk_adapters.token_lora_ids += begin * chunk_adapters.token_lora_ids_stride;
    // The LoRA delta of one GEMM of this chunk, added into its output rows (by slot)
    // before what follows reads them.
    auto add_lora_delta = [&](const LoraStack& st, bool interleaved, const TensorView& a, int64_t a_top_k,
                              const TensorView& gemm_out, bool weighted, bool aligned, bool add_inputs) {
      LoraDelta delta(st, interleaved, a, a_top_k, E_local, gemm_out, add_inputs, weighted ? &weights : nullptr,
                      chunk_adapters, ids, args.expert_map, E_global, byte_offset(ws, layout.lora_intermediate));
      // Slots from the chunk's virtual alignment, or one by one from topk_ids.
      if (aligned) {
        delta.with_blocks(static_cast<const int32_t*>(sorted_chunk.data), cap.max_num_tokens_padded,
                          static_cast<const int32_t*>(expert_chunk.data), block_lora_ids, cap.max_num_blocks,
                          static_cast<const int32_t*>(ntpp.data), block_size);
      }
      run_lora_delta(delta.p, device, stream);
    };
    // The fused path: GEMM g's shrink over the chunk's LoRA blocks into the intermediate by
    // entry (scaled), then g takes the expand in its K loop.
    auto with_fused_lora = [&](detail::GemmParams& g, const LoraStack& st, bool interleaved, const TensorView& a,
                               int64_t a_top_k, bool a_rows_by_entry) {
      void* lora_t = byte_offset(ws, layout.lora_intermediate);
      LoraDelta shrink(st, interleaved, a, a_top_k, E_local, a, false, nullptr, chunk_adapters, ids, args.expert_map,
                       E_global, lora_t);
      shrink.with_blocks(static_cast<const int32_t*>(sorted_chunk.data), cap.max_num_tokens_padded,
                         static_cast<const int32_t*>(expert_chunk.data), nullptr, cap.max_num_blocks,
                         static_cast<const int32_t*>(ntpp.data), block_size);
      shrink.p.entry_lora_ids = entry_lora_ids;
      shrink.p.block_lora_masks = block_lora_masks;
      shrink.p.shrink_partials = static_cast<float*>(byte_offset(ws, layout.lora_shrink_partials));
      shrink.p.shrink_partial_rows = layout.lora_shrink_partial_rows;
      shrink.p.segmented_entries = moe_align_block_size_capacity(slots, block_size, E_global).max_num_tokens_padded;
      shrink.p.shrink_counters = lora_shrink_counters;
      shrink.p.a_rows_by_entry = a_rows_by_entry;
#ifdef MOELORA_WITH_CUDA
      cuda::moe_lora_shrink(shrink.p, stream);
#endif
      g.lora_t = lora_t;
      g.block_lora_masks = block_lora_masks;
      g.entry_lora_ids = entry_lora_ids;
      g.lora_t_cols = st.num_slices * st.rank;
      g.lora_rank = st.rank;
      g.lora_slices = st.num_slices;
      g.lora[0] = st.slices[0];
      g.lora[1] = st.slices[1];
    };
#ifdef MOELORA_WITH_CUDA
    if (on_cuda(x) && config.small_batch) {
      const detail::SmallBatchMoeParams small =
          small_batch_params(args, options, x_chunk, ids, weights, cache2.data, out_chunk, E_global, kind);
      // A chunk the kernels do not take (see SmallBatchMoeParams) runs the aligned path.
      if (cuda::fused_experts_small_batch_supported(small)) {
        if (!args.lora) {
          cuda::fused_experts_small_batch(small, stream);
          continue;
        }
        // With adapters: each GEMM's delta per slot (no alignment) into the cache1/cache3
        // region, added by the kernels before the activation and the routed weight.
        // NOTE: GEMM2's delta overwrites GEMM1's after GEMM1 has read it (stream order).
        detail::SmallBatchMoeParams with_lora = small;
        const TensorView delta13 = view2d(byte_offset(ws, layout.cache1), dtype, slots, 2 * I, 2 * I, 1, device);
        const TensorView delta2 = view2d(byte_offset(ws, layout.cache3), dtype, slots, H, H, 1, device);
        const TensorView act = view2d(cache2.data, dtype, slots, I, I, 1, device);
        const bool interleaved = options.activation == Activation::kSwigluOai && lora13.num_slices == 2;
        add_lora_delta(lora13, interleaved, x_chunk, top_k, delta13, false, /*aligned=*/false, /*add_inputs=*/false);
        with_lora.gate_up_delta = delta13.data;
        cuda::fused_experts_small_batch(with_lora, stream, /*stages=*/1);
        add_lora_delta(lora2, false, act, 1, delta2, false, /*aligned=*/false, /*add_inputs=*/false);
        with_lora.down_delta = delta2.data;
        cuda::fused_experts_small_batch(with_lora, stream, /*stages=*/2);
        continue;
      }
    }
#endif
    detail::AlignParams align = align_params(ids, block_size, E_global, args.expert_map, sorted_chunk, expert_chunk, ntpp);
    align.tile_counters = tile_counters;
    align.num_tile_counters = tile_counters ? kNumTileCounters : 0;
    if (args.lora) {
      align.max_loras = lora13.max_loras;
      align.token_lora_ids = chunk_adapters.token_lora_ids;
      align.token_lora_ids_stride = chunk_adapters.token_lora_ids_stride;
      align.adapter_enabled = chunk_adapters.adapter_enabled;
      if (fused_lora) {
        // Segmented: the blocks of the plain expert alignment, each with its adapters'
        // runs, so the base GEMM tiles are those without adapters (no per-adapter padding).
        align.entry_lora_ids = entry_lora_ids;
        align.block_lora_masks = block_lora_masks;
        align.lora_shrink_counters = lora_shrink_counters;
      } else {
        align.block_lora_ids = block_lora_ids;
      }
    }
    run_align(align, device, stream);
    const TensorView* gemm1_weights = options.apply_router_weight_on_input ? &weights : nullptr;
    if (on_cuda(x) && options.fuse_activation && (!args.lora || fused_lora)) {
      // GEMM1 + activation: cache2[s] = act(x[s / top_k] · w13[e]ᵀ)   [slots, I]
      TensorView gemm1_input = x_chunk;
      if (sorted_input) {
        gemm1_input = view2d(byte_offset(ws, layout.sorted_input), dtype, cap.max_num_tokens_padded, H, H, 1, device);
#ifdef MOELORA_WITH_CUDA
        cuda::moe_gather_sorted_rows(
            detail::GatherRowsParams{.dtype = dtype, .input = x_chunk.data, .input_stride_row = x_chunk.strides[0],
                                     .out = gemm1_input.data, .out_stride_row = H,
                                     .sorted_token_ids = static_cast<const int32_t*>(sorted_chunk.data),
                                     .num_tokens_post_padded = static_cast<const int32_t*>(ntpp.data),
                                     .max_num_tokens_padded = cap.max_num_tokens_padded, .num_slots = slots,
                                     .top_k = top_k, .width = H},
            stream);
#endif
      }
      detail::GemmParams gemm1 = gemm_params(gemm1_input, args.w13, cache2, sorted_chunk, expert_chunk, ntpp,
                                             gemm1_weights, top_k, block_size, config.gemm1);
      gemm1.a_rows_sorted = sorted_input;
      gemm1.N = I;
      gemm1.num_slots = slots;  // the padding sentinel, whatever rows cache2 has
      gemm1.out_rows_sorted = sorted_activation;
      gemm1.gated = true;
      gemm1.activation = kind;
      gemm1.alpha = options.swiglu_alpha;
      gemm1.limit = options.swiglu_limit;
      gemm1.tile_counter = config.gemm1.ordered ? tile_counters : nullptr;
      if (fused_lora) {
        with_fused_lora(gemm1, lora13, options.activation == Activation::kSwigluOai && lora13.num_slices == 2, x_chunk,
                        top_k, false);
      }
      run_gemm(gemm1, device, stream);
    } else {
      // GEMM1: cache1[s] = x[s / top_k] · w13[e]ᵀ   [slots, 2I]; then cache2 = act(cache1)   [slots, I]
      const TensorView cache1 = view2d(byte_offset(ws, layout.cache1), dtype, slots, 2 * I, 2 * I, 1, device);
      detail::GemmParams gemm1 = gemm_params(x_chunk, args.w13, cache1, sorted_chunk, expert_chunk, ntpp, gemm1_weights,
                                             top_k, block_size, config.gemm1);
      gemm1.tile_counter = config.gemm1.ordered ? tile_counters : nullptr;
      run_gemm(gemm1, device, stream);
      if (args.lora) {
        // gpt-oss keeps gate and up interleaved in w13's rows: the slices follow.
        const bool interleaved = options.activation == Activation::kSwigluOai && lora13.num_slices == 2;
        add_lora_delta(lora13, interleaved, x_chunk, top_k, cache1, options.apply_router_weight_on_input,
                       /*aligned=*/true, /*add_inputs=*/true);
      }
      run_activation(detail::ActivationParams{.dtype = dtype, .kind = kind, .input = cache1.data,
                                              .input_stride_row = 2 * I, .out = cache2.data, .out_stride_row = I,
                                              .num_rows = slots, .width = I, .alpha = options.swiglu_alpha,
                                              .limit = options.swiglu_limit},
                     device, stream);
    }

    // GEMM2: one output row per slot, written straight into `out` when no reduction is needed.
    const TensorView* gemm2_weights = options.apply_router_weight_on_input ? nullptr : &weights;
    const bool direct = options.no_combine || (top_k == 1 && options.routed_scaling_factor == 1.0f);
    TensorView cache3;
    if (direct) {
      const int64_t row_stride = options.no_combine ? args.out.strides[1] : args.out.strides[0];
      cache3 = view2d(out_chunk, dtype, slots, H,
                      top_k == 1 ? args.out.strides[0] : row_stride, 1, device);
    } else {
      cache3 = view2d(byte_offset(ws, layout.cache3), dtype, slots, H, H, 1, device);
    }
    detail::GemmParams gemm2 =
        gemm_params(cache2, args.w2, cache3, sorted_chunk, expert_chunk, ntpp, gemm2_weights, 1, block_size, config.gemm2);
    gemm2.tile_counter = tile_counters && config.gemm2.ordered ? tile_counters + 1 : nullptr;
    gemm2.a_rows_sorted = sorted_activation;
    if (fused_lora) with_fused_lora(gemm2, lora2, false, cache2, 1, sorted_activation);
    run_gemm(gemm2, device, stream);
    if (args.lora && !fused_lora) {
      add_lora_delta(lora2, false, cache2, 1, cache3, !options.apply_router_weight_on_input, /*aligned=*/true,
                     /*add_inputs=*/true);
    }

    if (!direct) {
      run_sum_reduce(detail::SumReduceParams{.dtype = dtype, .input = cache3.data, .input_stride_token = top_k * H,
                                             .input_stride_k = H,
                                             .out = out_chunk,
                                             .out_stride_token = args.out.strides[0], .num_tokens = tokens,
                                             .top_k = top_k, .hidden = H, .scale = options.routed_scaling_factor},
                     device, stream);
    }
  }
}

bool cuda_available() {
#ifdef MOELORA_WITH_CUDA
  return cuda::device_available();
#else
  return false;
#endif
}

}  // namespace moelora
