// _moelora: the thin Python binding of include/moelora/ops.h.
//
// Arrays cross as DLPack (nb::ndarray): `view()` turns any DLPack-capable array (numpy,
// torch, ...) into a moelora::TensorView, and every op takes TensorViews. The Python
// package (python/moelora/ops.py) allocates outputs and workspaces and keeps the
// arrays alive across the call; this module never allocates device memory, never
// synchronises and never links a framework.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "moelora/ops.h"
#include "moelora/tensor.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using moelora::DType;
using moelora::TensorView;

// DLPack device types (dlpack.h DLDeviceType) that can hold a moelora tensor.
constexpr int kDLCPU = 1;
constexpr int kDLCUDA = 2;
constexpr int kDLCUDAHost = 3;  // pinned host memory: addressed by the CPU backend
constexpr int kDLCUDAManaged = 13;

std::string dlpack_dtype_name(nb::dlpack::dtype dt) {
  const char* prefix = "unknown";
  switch (static_cast<nb::dlpack::dtype_code>(dt.code)) {
    case nb::dlpack::dtype_code::Int: prefix = "int"; break;
    case nb::dlpack::dtype_code::UInt: prefix = "uint"; break;
    case nb::dlpack::dtype_code::Float: prefix = "float"; break;
    case nb::dlpack::dtype_code::Bfloat: prefix = "bfloat"; break;
    case nb::dlpack::dtype_code::Complex: prefix = "complex"; break;
    case nb::dlpack::dtype_code::Bool: return "bool";
  }
  std::string name = prefix + std::to_string(dt.bits);
  if (dt.lanes != 1) name += "x" + std::to_string(dt.lanes);
  return name;
}

int dtype_bits(DType dtype) { return static_cast<int>(moelora::dtype_size(dtype)) * 8; }

DType parse_dtype(const std::string& name) {
  if (name == "float32") return DType::kFloat32;
  if (name == "float16") return DType::kFloat16;
  if (name == "bfloat16") return DType::kBFloat16;
  if (name == "int32") return DType::kInt32;
  if (name == "int64") return DType::kInt64;
  throw moelora::Error("moelora.view: dtype must be one of float32, float16, bfloat16, int32, "
                       "int64; got '" + name + "'");
}

std::optional<DType> dtype_from_dlpack(nb::dlpack::dtype dt) {
  if (dt.lanes != 1) return std::nullopt;
  switch (static_cast<nb::dlpack::dtype_code>(dt.code)) {
    case nb::dlpack::dtype_code::Float:
      if (dt.bits == 32) return DType::kFloat32;
      if (dt.bits == 16) return DType::kFloat16;
      break;
    case nb::dlpack::dtype_code::Bfloat:
      if (dt.bits == 16) return DType::kBFloat16;
      break;
    case nb::dlpack::dtype_code::Int:
      if (dt.bits == 32) return DType::kInt32;
      if (dt.bits == 64) return DType::kInt64;
      break;
    default:
      break;
  }
  return std::nullopt;
}

// nb::ro accepts read-only arrays too (numpy cannot export those through DLPack, so
// nanobind falls back to the buffer protocol); whether a view is written is the op's
// business, and the Python wrappers only pass arrays they may write as outputs.
using AnyArray = nb::ndarray<nb::ro>;

TensorView make_view(const AnyArray& array, const std::optional<std::string>& dtype_override) {
  TensorView view;
  const nb::dlpack::dtype dt = array.dtype();
  if (dtype_override) {
    view.dtype = parse_dtype(*dtype_override);
    // The override reinterprets the elements' bits (numpy bf16 arrives as uint16), so
    // the element width must match.
    if (dt.lanes != 1 || dt.bits != dtype_bits(view.dtype)) {
      throw moelora::Error("moelora.view: dtype override '" + *dtype_override +
                           "' needs " + std::to_string(dtype_bits(view.dtype)) +
                           "-bit elements; the array holds " + dlpack_dtype_name(dt));
    }
  } else {
    const std::optional<DType> dtype = dtype_from_dlpack(dt);
    if (!dtype) {
      throw moelora::Error("moelora.view: unsupported dtype " + dlpack_dtype_name(dt) +
                           " (expected float32, float16, bfloat16, int32 or int64)");
    }
    view.dtype = *dtype;
  }

  const size_t rank = array.ndim();
  if (rank > static_cast<size_t>(moelora::kMaxRank)) {
    throw moelora::Error("moelora.view: rank " + std::to_string(rank) + " exceeds the maximum " +
                         std::to_string(moelora::kMaxRank));
  }
  view.rank = static_cast<int>(rank);
  for (size_t d = 0; d < rank; ++d) {
    view.shape[d] = static_cast<int64_t>(array.shape(d));
    view.strides[d] = array.stride(d);
  }
  view.data = const_cast<void*>(array.data());

  switch (array.device_type()) {
    case kDLCPU:
    case kDLCUDAHost:
      view.device = moelora::Device{moelora::DeviceType::kCPU, 0};
      break;
    case kDLCUDA:
    case kDLCUDAManaged:
      view.device = moelora::Device{moelora::DeviceType::kCUDA, array.device_id()};
      break;
    default:
      throw moelora::Error("moelora.view: unsupported DLPack device type " +
                           std::to_string(array.device_type()) + " (expected CPU or CUDA)");
  }
  return view;
}

moelora::Stream as_stream(uintptr_t stream) { return reinterpret_cast<moelora::Stream>(stream); }

const TensorView* optional_ptr(const std::optional<TensorView>& view) {
  return view ? &*view : nullptr;
}

moelora::FusedExpertsOptions make_options(moelora::Activation activation, float swiglu_alpha,
                                          float swiglu_limit, bool apply_router_weight_on_input,
                                          bool no_combine, float routed_scaling_factor,
                                          int64_t chunk_size, int64_t block_size) {
  moelora::FusedExpertsOptions options;
  options.activation = activation;
  options.swiglu_alpha = swiglu_alpha;
  options.swiglu_limit = swiglu_limit;
  options.apply_router_weight_on_input = apply_router_weight_on_input;
  options.no_combine = no_combine;
  options.routed_scaling_factor = routed_scaling_factor;
  options.chunk_size = chunk_size;
  options.block_size = block_size;
  return options;
}

nb::tuple tuple_of(const int64_t* values, int count) {
  nb::list items;
  for (int i = 0; i < count; ++i) items.append(values[i]);
  return nb::tuple(items);
}

}  // namespace

NB_MODULE(_moelora, m) {
  m.doc() = "moelora: Mixture-of-Experts ops with vLLM/SGLang fused_moe semantics (C++ core)";

  // A subclass of ValueError, so callers can catch either.
  nb::exception<moelora::Error>(m, "Error", PyExc_ValueError);

  nb::enum_<moelora::Activation>(m, "Activation")
      .value("silu", moelora::Activation::kSilu)
      .value("gelu", moelora::Activation::kGelu)
      .value("swiglu_oai", moelora::Activation::kSwigluOai);

  nb::class_<TensorView>(m, "TensorView",
                         "A non-owning view of an array's memory; keep the array alive while "
                         "an op uses the view.")
      .def_prop_ro("data_ptr", [](const TensorView& v) { return reinterpret_cast<uintptr_t>(v.data); })
      .def_prop_ro("dtype", [](const TensorView& v) { return std::string(moelora::dtype_name(v.dtype)); })
      .def_prop_ro("shape", [](const TensorView& v) { return tuple_of(v.shape, v.rank); })
      .def_prop_ro("strides", [](const TensorView& v) { return tuple_of(v.strides, v.rank); },
                   "Strides in elements.")
      .def_prop_ro("device", [](const TensorView& v) { return moelora::device_name(v.device); })
      .def_prop_ro("rank", [](const TensorView& v) { return v.rank; })
      .def("numel", &TensorView::numel)
      .def("is_contiguous", &TensorView::is_contiguous)
      .def("__repr__", [](const TensorView& v) {
        return "TensorView(" + std::string(moelora::dtype_name(v.dtype)) + ", " + v.shape_string() +
               ", " + moelora::device_name(v.device) + ")";
      });

  m.def("view", &make_view, "array"_a, "dtype"_a = nb::none(),
        "View a DLPack-capable array (numpy, torch, ...) as a TensorView. `dtype` "
        "reinterprets the elements (e.g. 'bfloat16' for a numpy uint16 view of bf16 data).");

  m.def("version", []() { return std::string(moelora::version()); });
  m.def("cuda_available", &moelora::cuda_available,
        "True when built with the CUDA backend and a CUDA device is visible.");

  m.def(
      "moe_align_block_size_capacity",
      [](int64_t num_slots, int64_t block_size, int64_t num_experts) {
        const moelora::AlignCapacity capacity =
            moelora::moe_align_block_size_capacity(num_slots, block_size, num_experts);
        return std::make_tuple(capacity.max_num_tokens_padded, capacity.max_num_blocks);
      },
      "num_slots"_a, "block_size"_a, "num_experts"_a,
      "(max_num_tokens_padded, max_num_blocks): the sizes of moe_align_block_size's outputs.");

  m.def(
      "moe_align_block_size",
      [](const TensorView& topk_ids, int64_t block_size, int64_t num_experts,
         const std::optional<TensorView>& expert_map, const TensorView& sorted_token_ids,
         const TensorView& expert_ids, const TensorView& num_tokens_post_padded, uintptr_t stream) {
        nb::gil_scoped_release release;
        moelora::moe_align_block_size(topk_ids, block_size, num_experts, optional_ptr(expert_map),
                                      sorted_token_ids, expert_ids, num_tokens_post_padded,
                                      as_stream(stream));
      },
      "topk_ids"_a, "block_size"_a, "num_experts"_a, "expert_map"_a.none(), "sorted_token_ids"_a,
      "expert_ids"_a, "num_tokens_post_padded"_a, "stream"_a = 0);

  m.def(
      "fused_moe",
      [](const TensorView& a, const TensorView& w, const TensorView& out,
         const TensorView& sorted_token_ids, const TensorView& expert_ids,
         const TensorView& num_tokens_post_padded, const std::optional<TensorView>& topk_weights,
         bool mul_routed_weight, int64_t top_k, int64_t block_size, uintptr_t stream) {
        moelora::FusedMoeArgs args;
        args.a = a;
        args.w = w;
        args.out = out;
        args.sorted_token_ids = sorted_token_ids;
        args.expert_ids = expert_ids;
        args.num_tokens_post_padded = num_tokens_post_padded;
        args.topk_weights = optional_ptr(topk_weights);
        args.mul_routed_weight = mul_routed_weight;
        args.top_k = top_k;
        args.block_size = block_size;
        nb::gil_scoped_release release;
        moelora::fused_moe(args, as_stream(stream));
      },
      "a"_a, "w"_a, "out"_a, "sorted_token_ids"_a, "expert_ids"_a, "num_tokens_post_padded"_a,
      "topk_weights"_a.none() = nb::none(), "mul_routed_weight"_a = false, "top_k"_a = 1,
      "block_size"_a = 64, "stream"_a = 0);

  // The gated activations without parameters share one binding shape.
  using GatedActivation = void (*)(const TensorView&, const TensorView&, moelora::Stream);
  for (const auto& [name, fn] : {std::pair<const char*, GatedActivation>{"silu_and_mul", &moelora::silu_and_mul},
                                 std::pair<const char*, GatedActivation>{"gelu_and_mul", &moelora::gelu_and_mul}}) {
    m.def(
        name,
        [fn = fn](const TensorView& input, const TensorView& out, uintptr_t stream) {
          nb::gil_scoped_release release;
          fn(input, out, as_stream(stream));
        },
        "input"_a, "out"_a, "stream"_a = 0);
  }

  m.def(
      "swiglu_oai_and_mul",
      [](const TensorView& input, const TensorView& out, float alpha, float limit,
         uintptr_t stream) {
        nb::gil_scoped_release release;
        moelora::swiglu_oai_and_mul(input, out, alpha, limit, as_stream(stream));
      },
      "input"_a, "out"_a, "alpha"_a = 1.702f, "limit"_a = 7.0f, "stream"_a = 0);

  m.def(
      "moe_sum_reduce",
      [](const TensorView& input, const TensorView& out, float routed_scaling_factor,
         uintptr_t stream) {
        nb::gil_scoped_release release;
        moelora::moe_sum_reduce(input, out, routed_scaling_factor, as_stream(stream));
      },
      "input"_a, "out"_a, "routed_scaling_factor"_a = 1.0f, "stream"_a = 0);

  m.def(
      "fused_experts_workspace_size",
      [](int64_t num_tokens, int64_t top_k, int64_t num_experts, int64_t hidden_size,
         int64_t intermediate_size, const std::string& dtype, moelora::Activation activation,
         float swiglu_alpha, float swiglu_limit, bool apply_router_weight_on_input,
         bool no_combine, float routed_scaling_factor, int64_t chunk_size, int64_t block_size,
         int64_t num_local_experts) {
        const moelora::FusedExpertsShape shape{num_tokens,  top_k,
                                               num_experts, hidden_size,
                                               intermediate_size, parse_dtype(dtype), num_local_experts};
        return moelora::fused_experts_workspace_size(
            shape, make_options(activation, swiglu_alpha, swiglu_limit,
                                apply_router_weight_on_input, no_combine, routed_scaling_factor,
                                chunk_size, block_size));
      },
      "num_tokens"_a, "top_k"_a, "num_experts"_a, "hidden_size"_a, "intermediate_size"_a,
      "dtype"_a, "activation"_a = moelora::Activation::kSilu, "swiglu_alpha"_a = 1.702f,
      "swiglu_limit"_a = 7.0f, "apply_router_weight_on_input"_a = false, "no_combine"_a = false,
      "routed_scaling_factor"_a = 1.0f, "chunk_size"_a = 64 * 1024, "block_size"_a = 0, "num_local_experts"_a = 0,
      "Bytes of workspace fused_experts needs; num_experts is the global expert count.");

  m.def(
      "fused_experts_block_size",
      [](int64_t num_tokens, int64_t top_k, int64_t num_experts, int64_t chunk_size,
         int64_t block_size) {
        moelora::FusedExpertsOptions options;
        options.chunk_size = chunk_size;
        options.block_size = block_size;
        return moelora::fused_experts_block_size(num_tokens, top_k, num_experts, options);
      },
      "num_tokens"_a, "top_k"_a, "num_experts"_a, "chunk_size"_a = 64 * 1024, "block_size"_a = 0,
      "The block size fused_experts uses for a chunk of num_tokens tokens.");

  m.def(
      "fused_experts",
      [](const TensorView& hidden_states, const TensorView& w13, const TensorView& w2,
         const TensorView& topk_weights, const TensorView& topk_ids, const TensorView& out,
         const TensorView& workspace, const std::optional<TensorView>& expert_map,
         moelora::Activation activation, float swiglu_alpha, float swiglu_limit,
         bool apply_router_weight_on_input, bool no_combine, float routed_scaling_factor,
         int64_t chunk_size, int64_t block_size, uintptr_t stream) {
        moelora::FusedExpertsArgs args;
        args.hidden_states = hidden_states;
        args.w13 = w13;
        args.w2 = w2;
        args.topk_weights = topk_weights;
        args.topk_ids = topk_ids;
        args.out = out;
        args.workspace = workspace;
        args.expert_map = optional_ptr(expert_map);
        const moelora::FusedExpertsOptions options =
            make_options(activation, swiglu_alpha, swiglu_limit, apply_router_weight_on_input,
                         no_combine, routed_scaling_factor, chunk_size, block_size);
        nb::gil_scoped_release release;
        moelora::fused_experts(args, options, as_stream(stream));
      },
      "hidden_states"_a, "w13"_a, "w2"_a, "topk_weights"_a, "topk_ids"_a, "out"_a, "workspace"_a,
      "expert_map"_a.none() = nb::none(), "activation"_a = moelora::Activation::kSilu,
      "swiglu_alpha"_a = 1.702f, "swiglu_limit"_a = 7.0f,
      "apply_router_weight_on_input"_a = false, "no_combine"_a = false,
      "routed_scaling_factor"_a = 1.0f, "chunk_size"_a = 64 * 1024, "block_size"_a = 0,
      "stream"_a = 0);
}
