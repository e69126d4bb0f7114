// Argument validation for the C++ API. Every failure throws moelora::Error with
// "<op>: argument '<name>' expected <what>, got <given>".
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "moelora/tensor.h"

namespace moelora::detail {

[[noreturn]] void fail(const char* op, const std::string& message);

// Throws when tensors on a CUDA device reach a build without the CUDA backend.
void require_cuda_backend(const char* op);

// Fluent checks on one tensor argument. The constructor checks what holds for every
// tensor: rank within [0, kMaxRank], non-negative shape and strides, data present when
// the tensor has elements.
class ArgCheck {
 public:
  ArgCheck(const char* op, const char* name, const TensorView& t);

  ArgCheck& rank(int expected);
  ArgCheck& dtype(DType expected);
  ArgCheck& dtype_in(std::initializer_list<DType> allowed);
  ArgCheck& same_dtype(const TensorView& other, const char* other_name);
  // shape[dim] == expected; `what` names the dimension, e.g. "K (from 'a')".
  ArgCheck& dim(int d, int64_t expected, const char* what);
  ArgCheck& dim_at_least(int d, int64_t minimum, const char* what);
  ArgCheck& unit_stride(int d);
  ArgCheck& contiguous();
  ArgCheck& on(const Device& device, const char* other_name);
  ArgCheck& no_overlap(const TensorView& other, const char* other_name);
  // Every row (index of the last dim = 0) starts at a multiple of `bytes`: the data
  // pointer and every stride but the last's (what 16-byte vector loads need).
  ArgCheck& rows_aligned(int64_t bytes);

 private:
  [[noreturn]] void fail_expected(const std::string& expected, const std::string& given) const;
  const char* op_;
  const char* name_;
  const TensorView& t_;
};

// Byte range [first, last) a view touches; empty views touch nothing.
bool views_overlap(const TensorView& a, const TensorView& b);

// An op's tensor and its argument name; a null view is an absent optional argument.
using NamedView = std::pair<const TensorView*, const char*>;
// A short list of them, on the stack: the checks run on every call, which allocates
// nothing.
class NamedViews {
 public:
  static constexpr int kCapacity = 32;
  NamedViews(std::initializer_list<NamedView> views) {
    for (const NamedView& v : views) add(v.first, v.second);
  }
  void add(const TensorView* t, const char* name);
  const NamedView* begin() const { return items_; }
  const NamedView* end() const { return items_ + size_; }

 private:
  NamedView items_[kCapacity];
  int size_ = 0;
};
// Every tensor an op writes is disjoint from every tensor it reads and from the other
// written ones: a kernel would read what it has overwritten, or two outputs race.
// NOTE: found by the fuzzer (issue 33): fused_moe's out over expert_ids, and
// fused_experts' in-place out over expert_map, sent the CPU backend to a garbage expert.
void check_disjoint_writes(const char* op, const NamedViews& writes, const NamedViews& reads);
bool same_view(const TensorView& a, const TensorView& b);

}  // namespace moelora::detail
