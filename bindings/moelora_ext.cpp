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
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

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
  if (name == "float8_e4m3fn") return DType::kFloat8E4M3;
  if (name == "int8") return DType::kInt8;
  if (name == "uint8") return DType::kUInt8;
  throw moelora::Error("moelora.view: dtype must be one of float32, float16, bfloat16, int32, "
                       "int64, float8_e4m3fn, int8, uint8; got '" + name + "'");
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
      if (dt.bits == 8) return DType::kInt8;
      break;
    case nb::dlpack::dtype_code::UInt:
      if (dt.bits == 8) return DType::kUInt8;
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
                           " (expected float32, float16, bfloat16, int32, int64 or int8; fp8 as uint8 "
                           "with dtype 'float8_e4m3fn')");
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

// The adapter state of a LoRA op (token_lora_ids, and the optional per-slot tensors).
// The returned struct points into the optionals: keep them alive while it is used.
moelora::MoeLoraAdapters make_adapters(const TensorView& token_lora_ids,
                                       const std::optional<TensorView>& adapter_enabled,
                                       const std::optional<TensorView>& adapter_scale) {
  moelora::MoeLoraAdapters adapters;
  adapters.token_lora_ids = token_lora_ids;
  adapters.adapter_enabled = optional_ptr(adapter_enabled);
  adapters.adapter_scale = optional_ptr(adapter_scale);
  return adapters;
}

// One GEMM's adapter stacks from Python lists of 1 or 2 slices (prefix names the
// arguments in errors: "", "w13_").
moelora::MoeLoraWeights make_lora_weights(const char* op, const std::string& prefix,
                                          const std::vector<TensorView>& lora_a,
                                          const std::vector<TensorView>& lora_b, bool interleaved_slices) {
  if (lora_a.size() != 1 && lora_a.size() != 2) {
    throw moelora::Error(std::string("moelora.") + op + ": argument '" + prefix +
                         "lora_a' expected a list of 1 or 2 tensors (output slices), got " +
                         std::to_string(lora_a.size()));
  }
  if (lora_b.size() != lora_a.size()) {
    throw moelora::Error(std::string("moelora.") + op + ": argument '" + prefix + "lora_b' expected " +
                         std::to_string(lora_a.size()) + " tensors (one per slice of '" + prefix +
                         "lora_a'), got " + std::to_string(lora_b.size()));
  }
  moelora::MoeLoraWeights weights;
  weights.num_slices = static_cast<int>(lora_a.size());
  for (size_t c = 0; c < lora_a.size(); ++c) {
    weights.lora_a[c] = lora_a[c];
    weights.lora_b[c] = lora_b[c];
  }
  weights.interleaved_slices = interleaved_slices;
  return weights;
}

// The quantized experts of fused_experts: the scheme and all of its scales, or none.
// The returned struct points into the optionals: keep them alive while it is used.
std::optional<moelora::FusedExpertsQuant> make_quant(const std::optional<moelora::QuantScheme>& scheme,
                                                     const std::optional<TensorView>& w13_scale,
                                                     const std::optional<TensorView>& w2_scale,
                                                     const std::optional<TensorView>& a13_scale,
                                                     const std::optional<TensorView>& a2_scale,
                                                     const std::optional<TensorView>& w13_zero,
                                                     const std::optional<TensorView>& w2_zero) {
  if (!scheme || !scheme->enabled()) {
    if (w13_scale || w2_scale || a13_scale || a2_scale || w13_zero || w2_zero) {
      throw moelora::Error("moelora.fused_experts: argument 'quant' expected a scheme with w13_scale/w2_scale "
                           "(and a13_scale/a2_scale), got none");
    }
    return std::nullopt;
  }
  if (!w13_scale || !w2_scale) {
    throw moelora::Error(std::string("moelora.fused_experts: argument '") + (w13_scale ? "w2_scale" : "w13_scale") +
                         "' expected a tensor with quant, got none");
  }
  moelora::FusedExpertsQuant quant;
  quant.scheme = *scheme;
  quant.w13_scale = *w13_scale;
  quant.w2_scale = *w2_scale;
  quant.a13_scale = optional_ptr(a13_scale);
  quant.a2_scale = optional_ptr(a2_scale);
  quant.w13_zero = optional_ptr(w13_zero);
  quant.w2_zero = optional_ptr(w2_zero);
  return quant;
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

  nb::enum_<moelora::ScaleGranularity>(m, "ScaleGranularity")
      .value("tensor", moelora::ScaleGranularity::kTensor)
      .value("channel", moelora::ScaleGranularity::kChannel)
      .value("block", moelora::ScaleGranularity::kBlock);
  nb::class_<moelora::QuantScheme>(m, "QuantScheme",
                                   "A quantization scheme of the experts (include/moelora/quant.h); make one "
                                   "with quant_scheme(name).")
      .def_prop_ro("name", [](const moelora::QuantScheme& q) { return std::string(moelora::quant_method_name(q.method)); })
      .def_prop_ro("element", [](const moelora::QuantScheme& q) { return std::string(moelora::dtype_name(q.element)); })
      .def_ro("weight_scales", &moelora::QuantScheme::weight_scales)
      .def_ro("activation_scales", &moelora::QuantScheme::activation_scales)
      .def_ro("block_n", &moelora::QuantScheme::block_n)
      .def_ro("block_k", &moelora::QuantScheme::block_k)
      .def_ro("static_activation_scales", &moelora::QuantScheme::static_activation_scales)
      .def_ro("weight_bits", &moelora::QuantScheme::weight_bits)
      .def_ro("group_size", &moelora::QuantScheme::group_size)
      .def_ro("zero_points", &moelora::QuantScheme::zero_points)
      .def_prop_ro("weight_only", &moelora::QuantScheme::weight_only)
      .def("__repr__", [](const moelora::QuantScheme& q) {
        if (q.weight_only()) {
          return "QuantScheme(" + std::string(moelora::quant_method_name(q.method)) + ", group " +
                 std::to_string(q.group_size) + (q.zero_points ? ", zero points)" : ")");
        }
        return "QuantScheme(" + std::string(moelora::quant_method_name(q.method)) + ", block " +
               std::to_string(q.block_n) + "x" + std::to_string(q.block_k) +
               (q.static_activation_scales ? ", static activation scales)" : ")");
      });
  m.def(
      "quant_scheme",
      [](const std::string& name, int64_t block_n, int64_t block_k, bool static_activation_scales,
         int64_t group_size, bool zero_points) {
        const moelora::QuantMethod method = moelora::quant_method_from_name(name);
        if (method == moelora::QuantMethod::kW4A16 || method == moelora::QuantMethod::kW8A16) {
          return moelora::make_weight_only_scheme(method, group_size, zero_points);
        }
        return moelora::make_quant_scheme(method, block_n, block_k, static_activation_scales);
      },
      "name"_a, "block_n"_a = 128, "block_k"_a = 128, "static_activation_scales"_a = false, "group_size"_a = 128,
      "zero_points"_a = false,
      "The scheme 'fp8_block', 'fp8_channel', 'fp8_tensor', 'int8_channel' or 'int8_block' (block_n, block_k, "
      "static_activation_scales), or weight-only 'w4a16' / 'w8a16' (group_size 32/64/128 or 0 per channel, "
      "zero_points).");
  m.def(
      "quantize",
      [](const TensorView& input, const TensorView& out, const TensorView& scales, int64_t block_rows,
         int64_t block_cols, bool static_scales, uintptr_t stream) {
        moelora::QuantizeArgs args;
        args.input = input;
        args.out = out;
        args.scales = scales;
        args.block_rows = block_rows;
        args.block_cols = block_cols;
        args.static_scales = static_scales;
        nb::gil_scoped_release release;
        moelora::quantize(args, as_stream(stream));
      },
      "input"_a, "out"_a, "scales"_a, "block_rows"_a, "block_cols"_a, "static_scales"_a = false, "stream"_a = 0);

  m.def("view", &make_view, "array"_a, "dtype"_a = nb::none(),
        "View a DLPack-capable array (numpy, torch, ...) as a TensorView. `dtype` "
        "reinterprets the elements (e.g. 'bfloat16' for a numpy uint16 view of bf16 data).");

  m.attr("MAX_NUM_EXPERTS") = moelora::kMaxNumExperts;
  m.attr("MAX_LORA_RANK") = moelora::kMaxLoraRank;
  m.attr("MAX_LORA_ADAPTERS") = moelora::kMaxLoraAdapters;
  m.attr("ROUTING_BAD_EXPERT_ID") = moelora::kRoutingBadExpertId;
  m.attr("ROUTING_BAD_ADAPTER_ID") = moelora::kRoutingBadAdapterId;
  m.attr("ROUTING_BAD_EXPERT_MAP") = moelora::kRoutingBadExpertMap;

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
      "moe_lora_align_block_size_capacity",
      [](int64_t num_slots, int64_t block_size, int64_t num_experts, int64_t max_loras) {
        const moelora::AlignCapacity capacity =
            moelora::moe_lora_align_block_size_capacity(num_slots, block_size, num_experts, max_loras);
        return std::make_tuple(capacity.max_num_tokens_padded, capacity.max_num_blocks);
      },
      "num_slots"_a, "block_size"_a, "num_experts"_a, "max_loras"_a,
      "(max_num_tokens_padded, max_num_blocks): the sizes of moe_lora_align_block_size's outputs.");

  m.def(
      "moe_lora_align_block_size",
      [](const TensorView& topk_ids, const TensorView& token_lora_ids,
         const std::optional<TensorView>& adapter_enabled, int64_t max_loras, int64_t block_size,
         int64_t num_experts, const std::optional<TensorView>& expert_map, const TensorView& sorted_token_ids,
         const TensorView& expert_ids, const TensorView& block_lora_ids,
         const TensorView& num_tokens_post_padded, uintptr_t stream) {
        const std::optional<TensorView> no_scale;
        const moelora::MoeLoraAdapters adapters = make_adapters(token_lora_ids, adapter_enabled, no_scale);
        nb::gil_scoped_release release;
        moelora::moe_lora_align_block_size(topk_ids, adapters, max_loras, block_size, num_experts,
                                           optional_ptr(expert_map), sorted_token_ids, expert_ids,
                                           block_lora_ids, num_tokens_post_padded, as_stream(stream));
      },
      "topk_ids"_a, "token_lora_ids"_a, "adapter_enabled"_a.none(), "max_loras"_a, "block_size"_a,
      "num_experts"_a, "expert_map"_a.none(), "sorted_token_ids"_a, "expert_ids"_a, "block_lora_ids"_a,
      "num_tokens_post_padded"_a, "stream"_a = 0);

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

  m.def(
      "fused_moe_lora_workspace_size",
      [](int64_t num_slots, int num_slices, int64_t rank, const std::string& dtype) {
        return moelora::fused_moe_lora_workspace_size(num_slots, num_slices, rank, parse_dtype(dtype));
      },
      "num_slots"_a, "num_slices"_a, "rank"_a, "dtype"_a,
      "Bytes of workspace fused_moe_lora needs (the [slots, slices, rank] intermediate).");

  m.def(
      "fused_moe_lora",
      [](const TensorView& out, const TensorView& a, const TensorView& topk_ids, const TensorView& token_lora_ids,
         const std::vector<TensorView>& lora_a, const std::vector<TensorView>& lora_b,
         const TensorView& workspace, const std::optional<TensorView>& adapter_enabled,
         const std::optional<TensorView>& adapter_scale, const std::optional<TensorView>& topk_weights,
         bool mul_routed_weight, bool add_inputs, bool interleaved_slices,
         const std::optional<TensorView>& sorted_token_ids, const std::optional<TensorView>& expert_ids,
         const std::optional<TensorView>& block_lora_ids, const std::optional<TensorView>& num_tokens_post_padded,
         int64_t block_size, uintptr_t stream) {
        moelora::FusedMoeLoraArgs args;
        args.out = out;
        args.a = a;
        args.topk_ids = topk_ids;
        args.adapters = make_adapters(token_lora_ids, adapter_enabled, adapter_scale);
        args.weights = make_lora_weights("fused_moe_lora", "", lora_a, lora_b, interleaved_slices);
        args.workspace = workspace;
        args.topk_weights = optional_ptr(topk_weights);
        args.mul_routed_weight = mul_routed_weight;
        args.add_inputs = add_inputs;
        args.sorted_token_ids = optional_ptr(sorted_token_ids);
        args.expert_ids = optional_ptr(expert_ids);
        args.block_lora_ids = optional_ptr(block_lora_ids);
        args.num_tokens_post_padded = optional_ptr(num_tokens_post_padded);
        args.block_size = block_size;
        nb::gil_scoped_release release;
        moelora::fused_moe_lora(args, as_stream(stream));
      },
      "out"_a, "a"_a, "topk_ids"_a, "token_lora_ids"_a, "lora_a"_a, "lora_b"_a, "workspace"_a,
      "adapter_enabled"_a.none() = nb::none(), "adapter_scale"_a.none() = nb::none(),
      "topk_weights"_a.none() = nb::none(), "mul_routed_weight"_a = false, "add_inputs"_a = true,
      "interleaved_slices"_a = false, "sorted_token_ids"_a.none() = nb::none(),
      "expert_ids"_a.none() = nb::none(), "block_lora_ids"_a.none() = nb::none(),
      "num_tokens_post_padded"_a.none() = nb::none(), "block_size"_a = 0, "stream"_a = 0);

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

  m.attr("MLA_HEAD_DIM") = moelora::kMlaHeadDim;
  m.attr("MLA_VALUE_DIM") = moelora::kMlaValueDim;
  m.attr("MLA_MAX_HEADS") = moelora::kMlaMaxHeads;
  m.attr("MLA_MAX_SPLITS") = moelora::kMlaMaxSplits;
  m.def(
      "sparse_mla_decode_num_splits",
      [](int64_t num_tokens, int64_t num_heads, int64_t topk, const TensorView& like, int num_splits) {
        return moelora::sparse_mla_decode_num_splits(num_tokens, num_heads, topk, like.device, num_splits);
      },
      "num_tokens"_a, "num_heads"_a, "topk"_a, "like"_a, "num_splits"_a = 0,
      "The split count sparse_mla_decode runs with on like's device (1 on the CPU).");
  m.def(
      "sparse_mla_decode_workspace_size",
      [](int64_t num_tokens, int64_t num_heads, int64_t topk, const TensorView& like, int num_splits) {
        return moelora::sparse_mla_decode_workspace_size(num_tokens, num_heads, topk, like.device, num_splits);
      },
      "num_tokens"_a, "num_heads"_a, "topk"_a, "like"_a, "num_splits"_a = 0);
  m.def(
      "sparse_mla_decode",
      [](const TensorView& q, const TensorView& kv, const TensorView& indices, const TensorView& out,
         const TensorView& workspace, float softmax_scale, const std::optional<TensorView>& lse,
         const std::optional<TensorView>& topk_length, const std::optional<TensorView>& attn_sink, int num_splits,
         uintptr_t stream) {
        moelora::SparseMlaDecodeArgs args;
        args.q = q;
        args.kv = kv;
        args.indices = indices;
        args.out = out;
        args.workspace = workspace;
        args.softmax_scale = softmax_scale;
        args.lse = optional_ptr(lse);
        args.topk_length = optional_ptr(topk_length);
        args.attn_sink = optional_ptr(attn_sink);
        args.num_splits = num_splits;
        nb::gil_scoped_release release;
        moelora::sparse_mla_decode(args, as_stream(stream));
      },
      "q"_a, "kv"_a, "indices"_a, "out"_a, "workspace"_a, "softmax_scale"_a, "lse"_a = nb::none(),
      "topk_length"_a = nb::none(), "attn_sink"_a = nb::none(), "num_splits"_a = 0, "stream"_a = 0);

  m.def(
      "fused_experts_workspace_size",
      [](int64_t num_tokens, int64_t top_k, int64_t num_experts, int64_t hidden_size,
         int64_t intermediate_size, const std::string& dtype, moelora::Activation activation,
         float swiglu_alpha, float swiglu_limit, bool apply_router_weight_on_input,
         bool no_combine, float routed_scaling_factor, int64_t chunk_size, int64_t block_size,
         int64_t num_local_experts, int64_t max_loras, int64_t lora_rank,
         const std::optional<moelora::QuantScheme>& quant) {
        moelora::FusedExpertsShape shape{num_tokens,  top_k,
                                         num_experts, hidden_size,
                                         intermediate_size, parse_dtype(dtype), num_local_experts};
        shape.max_loras = max_loras;
        shape.lora_rank = lora_rank;
        if (quant) shape.quant = *quant;
        return moelora::fused_experts_workspace_size(
            shape, make_options(activation, swiglu_alpha, swiglu_limit,
                                apply_router_weight_on_input, no_combine, routed_scaling_factor,
                                chunk_size, block_size));
      },
      "num_tokens"_a, "top_k"_a, "num_experts"_a, "hidden_size"_a, "intermediate_size"_a,
      "dtype"_a, "activation"_a = moelora::Activation::kSilu, "swiglu_alpha"_a = 1.702f,
      "swiglu_limit"_a = 7.0f, "apply_router_weight_on_input"_a = false, "no_combine"_a = false,
      "routed_scaling_factor"_a = 1.0f, "chunk_size"_a = 64 * 1024, "block_size"_a = 0, "num_local_experts"_a = 0,
      "max_loras"_a = 0, "lora_rank"_a = 0, "quant"_a.none() = nb::none(),
      "Bytes of workspace fused_experts needs; num_experts is the global expert count. With "
      "adapters: max_loras (the slots L) and lora_rank (the largest rank of w13's and w2's stacks); "
      "with quantized experts, their QuantScheme.");

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
         int64_t chunk_size, int64_t block_size, const std::optional<TensorView>& token_lora_ids,
         const std::optional<std::vector<TensorView>>& w13_lora_a,
         const std::optional<std::vector<TensorView>>& w13_lora_b, const std::optional<TensorView>& w2_lora_a,
         const std::optional<TensorView>& w2_lora_b, const std::optional<TensorView>& adapter_enabled,
         const std::optional<TensorView>& adapter_scale, const std::optional<moelora::QuantScheme>& quant,
         const std::optional<TensorView>& w13_scale, const std::optional<TensorView>& w2_scale,
         const std::optional<TensorView>& a13_scale, const std::optional<TensorView>& a2_scale,
         const std::optional<TensorView>& w13_zero, const std::optional<TensorView>& w2_zero,
         const std::optional<TensorView>& routing_status, uintptr_t stream) {
        moelora::FusedExpertsArgs args;
        args.hidden_states = hidden_states;
        args.w13 = w13;
        args.w2 = w2;
        args.topk_weights = topk_weights;
        args.topk_ids = topk_ids;
        args.out = out;
        args.workspace = workspace;
        args.expert_map = optional_ptr(expert_map);
        args.routing_status = optional_ptr(routing_status);
        // LoRA: all of token_lora_ids and the four stacks, or none of them.
        const bool any_lora = token_lora_ids || w13_lora_a || w13_lora_b || w2_lora_a || w2_lora_b;
        moelora::FusedExpertsLora lora;
        if (any_lora) {
          const std::pair<bool, const char*> required[] = {
              {bool(token_lora_ids), "token_lora_ids"}, {bool(w13_lora_a), "w13_lora_a"},
              {bool(w13_lora_b), "w13_lora_b"},         {bool(w2_lora_a), "w2_lora_a"},
              {bool(w2_lora_b), "w2_lora_b"}};
          for (const auto& [given, name] : required) {
            if (!given) {
              throw moelora::Error(std::string("moelora.fused_experts: argument '") + name +
                                   "' expected a tensor with the other LoRA arguments (token_lora_ids, "
                                   "w13_lora_a, w13_lora_b, w2_lora_a, w2_lora_b), got none");
            }
          }
          lora.adapters = make_adapters(*token_lora_ids, adapter_enabled, adapter_scale);
          // gpt-oss keeps gate and up interleaved in w13's rows: two slices follow them.
          const bool interleaved = activation == moelora::Activation::kSwigluOai && w13_lora_a->size() == 2;
          lora.w13 = make_lora_weights("fused_experts", "w13_", *w13_lora_a, *w13_lora_b, interleaved);
          lora.w2 = make_lora_weights("fused_experts", "w2_", {*w2_lora_a}, {*w2_lora_b}, false);
          args.lora = &lora;
        } else if (adapter_enabled || adapter_scale) {
          throw moelora::Error(std::string("moelora.fused_experts: argument '") +
                               (adapter_enabled ? "adapter_enabled" : "adapter_scale") +
                               "' expected none without token_lora_ids and the LoRA stacks, got a tensor");
        }
        const std::optional<moelora::FusedExpertsQuant> quantized =
            make_quant(quant, w13_scale, w2_scale, a13_scale, a2_scale, w13_zero, w2_zero);
        if (quantized) args.quant = &*quantized;
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
      "token_lora_ids"_a.none() = nb::none(), "w13_lora_a"_a.none() = nb::none(),
      "w13_lora_b"_a.none() = nb::none(), "w2_lora_a"_a.none() = nb::none(), "w2_lora_b"_a.none() = nb::none(),
      "adapter_enabled"_a.none() = nb::none(), "adapter_scale"_a.none() = nb::none(),
      "quant"_a.none() = nb::none(), "w13_scale"_a.none() = nb::none(), "w2_scale"_a.none() = nb::none(),
      "a13_scale"_a.none() = nb::none(), "a2_scale"_a.none() = nb::none(), "w13_zero"_a.none() = nb::none(),
      "w2_zero"_a.none() = nb::none(), "routing_status"_a.none() = nb::none(), "stream"_a = 0);
}
