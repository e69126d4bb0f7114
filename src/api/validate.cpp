#include "api/validate.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>

namespace moelora::detail {

void fail(const char* op, const std::string& message) {
  throw Error(std::string("moelora.") + op + ": " + message);
}

void require_cuda_backend(const char* op) {
#ifndef MOELORA_WITH_CUDA
  fail(op, "tensors are on a CUDA device but moelora was built without the CUDA backend");
#else
  (void)op;
#endif
}

ArgCheck::ArgCheck(const char* op, const char* name, const TensorView& t) : op_(op), name_(name), t_(t) {
  if (t.rank < 0 || t.rank > kMaxRank) {
    fail_expected("rank <= " + std::to_string(kMaxRank), "rank " + std::to_string(t.rank));
  }
  for (int d = 0; d < t.rank; ++d) {
    if (t.shape[d] < 0) fail_expected("non-negative sizes", "shape " + t.shape_string());
    if (t.strides[d] < 0) {
      fail_expected("non-negative strides", "stride " + std::to_string(t.strides[d]) + " on dim " +
                                                std::to_string(d));
    }
  }
  if (dtype_size(t.dtype) == 0) fail_expected("a known dtype", "dtype code " + std::to_string(int(t.dtype)));
  // Every size a check or a backend derives from the view (its element count, its
  // furthest byte) must fit in int64: a view that claims more is not memory anyone owns.
  int64_t elements = 1, last = 0, bytes = 0;
  bool fits = true;
  for (int d = 0; d < t.rank; ++d) {
    int64_t span = 0;
    fits = fits && !__builtin_mul_overflow(elements, t.shape[d], &elements);
    if (t.shape[d] > 0) {
      fits = fits && !__builtin_mul_overflow(t.shape[d] - 1, t.strides[d], &span) &&
             !__builtin_add_overflow(last, span, &last);
    }
  }
  fits = fits && last < INT64_MAX && !__builtin_mul_overflow(last + 1, int64_t(dtype_size(t.dtype)), &bytes);
  if (!fits) fail_expected("sizes and strides whose extent fits in 64-bit byte offsets", "shape " + t.shape_string());
  if (t.data == nullptr && t.numel() > 0) fail_expected("a data pointer", "null with shape " + t.shape_string());
  // Elements are read through typed pointers (DLPack allows any byte offset).
  const uintptr_t misaligned = reinterpret_cast<uintptr_t>(t.data) % dtype_size(t.dtype);
  if (misaligned != 0 && t.numel() > 0) {
    fail_expected("data aligned to its " + std::to_string(dtype_size(t.dtype)) + "-byte elements",
                  "an address offset by " + std::to_string(misaligned) + " bytes");
  }
}

void ArgCheck::fail_expected(const std::string& expected, const std::string& given) const {
  fail(op_, std::string("argument '") + name_ + "' expected " + expected + ", got " + given);
}

ArgCheck& ArgCheck::rank(int expected) {
  if (t_.rank != expected) {
    fail_expected("rank " + std::to_string(expected), "rank " + std::to_string(t_.rank) + " " + t_.shape_string());
  }
  return *this;
}

ArgCheck& ArgCheck::dtype(DType expected) {
  if (t_.dtype != expected) fail_expected(std::string("dtype ") + dtype_name(expected), dtype_name(t_.dtype));
  return *this;
}

ArgCheck& ArgCheck::dtype_in(std::initializer_list<DType> allowed) {
  if (std::find(allowed.begin(), allowed.end(), t_.dtype) != allowed.end()) return *this;
  std::string names;
  for (DType d : allowed) names += (names.empty() ? "" : "|") + std::string(dtype_name(d));
  fail_expected("dtype " + names, dtype_name(t_.dtype));
}

ArgCheck& ArgCheck::same_dtype(const TensorView& other, const char* other_name) {
  if (t_.dtype != other.dtype) {
    fail_expected(std::string("dtype ") + dtype_name(other.dtype) + " (that of '" + other_name + "')",
                  dtype_name(t_.dtype));
  }
  return *this;
}

ArgCheck& ArgCheck::dim(int d, int64_t expected, const char* what) {
  if (t_.shape[d] != expected) {
    fail_expected("size " + std::to_string(expected) + " on dim " + std::to_string(d) + " (" + what + ")",
                  "shape " + t_.shape_string());
  }
  return *this;
}

ArgCheck& ArgCheck::dim_at_least(int d, int64_t minimum, const char* what) {
  if (t_.shape[d] < minimum) {
    fail_expected("at least " + std::to_string(minimum) + " on dim " + std::to_string(d) + " (" + what + ")",
                  "shape " + t_.shape_string());
  }
  return *this;
}

ArgCheck& ArgCheck::unit_stride(int d) {
  // NOTE: an empty view's strides mean nothing (DLPack exporters report 0 for them).
  if (t_.numel() > 0 && t_.shape[d] > 1 && t_.strides[d] != 1) {
    fail_expected("stride 1 on dim " + std::to_string(d), "stride " + std::to_string(t_.strides[d]));
  }
  return *this;
}

ArgCheck& ArgCheck::contiguous() {
  if (t_.numel() > 0 && !t_.is_contiguous()) fail_expected("a contiguous tensor", "shape " + t_.shape_string() + " with other strides");
  return *this;
}

ArgCheck& ArgCheck::on(const Device& device, const char* other_name) {
  if (t_.device != device) {
    fail_expected("device " + device_name(device) + " (that of '" + other_name + "')", device_name(t_.device));
  }
  return *this;
}

ArgCheck& ArgCheck::no_overlap(const TensorView& other, const char* other_name) {
  if (views_overlap(t_, other)) fail_expected(std::string("memory disjoint from '") + other_name + "'", "an overlap");
  return *this;
}

ArgCheck& ArgCheck::rows_aligned(int64_t bytes) {
  if (t_.numel() == 0) return *this;
  const int64_t element = int64_t(dtype_size(t_.dtype));
  if (reinterpret_cast<uintptr_t>(t_.data) % uint64_t(bytes) != 0) {
    fail_expected("data " + std::to_string(bytes) + "-byte aligned", "an address offset by " +
                  std::to_string(reinterpret_cast<uintptr_t>(t_.data) % uint64_t(bytes)) + " bytes");
  }
  for (int d = 0; d + 1 < t_.rank; ++d) {
    if (t_.shape[d] > 1 && (t_.strides[d] * element) % bytes != 0) {
      fail_expected("strides of whole " + std::to_string(bytes) + "-byte units (multiples of " +
                        std::to_string(bytes / element) + " elements) on dim " + std::to_string(d),
                    "stride " + std::to_string(t_.strides[d]));
    }
  }
  return *this;
}

namespace {
struct ByteRange { uintptr_t first, last; };
ByteRange byte_range(const TensorView& t) {
  const uintptr_t base = reinterpret_cast<uintptr_t>(t.data);
  if (t.numel() == 0) return {base, base};
  int64_t last = 0;
  for (int d = 0; d < t.rank; ++d) last += (t.shape[d] - 1) * t.strides[d];
  return {base, base + uintptr_t((last + 1) * int64_t(dtype_size(t.dtype)))};
}
}  // namespace

bool views_overlap(const TensorView& a, const TensorView& b) {
  if (a.device != b.device) return false;
  const ByteRange ra = byte_range(a), rb = byte_range(b);
  if (ra.first == ra.last || rb.first == rb.last) return false;
  return ra.first < rb.last && rb.first < ra.last;
}

void NamedViews::add(const TensorView* t, const char* name) {
  if (size_ == kCapacity) throw std::logic_error("moelora: NamedViews holds at most 32 views");
  items_[size_++] = NamedView{t, name};
}

void check_disjoint_writes(const char* op, const NamedViews& writes, const NamedViews& reads) {
  // Optional tensors an op ignores (topk_weights without mul_routed_weight) reach here
  // unchecked: their rank and extent first (found by the fuzzer: a rank-5 view).
  for (const NamedViews* list : {&writes, &reads}) {
    for (const NamedView& v : *list) {
      if (v.first) ArgCheck(op, v.second, *v.first);
    }
  }
  for (const NamedView* w = writes.begin(); w != writes.end(); ++w) {
    if (!w->first) continue;
    auto check = [&](const NamedView& other) {
      if (other.first && views_overlap(*w->first, *other.first)) {
        fail(op, std::string("argument '") + w->second + "' expected memory disjoint from '" + other.second +
                     "', got an overlap");
      }
    };
    for (const NamedView* v = w + 1; v != writes.end(); ++v) check(*v);
    for (const NamedView& r : reads) check(r);
  }
}

bool same_view(const TensorView& a, const TensorView& b) {
  if (a.data != b.data || a.dtype != b.dtype || a.rank != b.rank || a.device != b.device) return false;
  for (int d = 0; d < a.rank; ++d) {
    if (a.shape[d] != b.shape[d] || (a.shape[d] > 1 && a.strides[d] != b.strides[d])) return false;
  }
  return true;
}

}  // namespace moelora::detail
