// The fuzz harness's tensors (issue 33): views built from the fuzzer's bytes, each backed
// by a heap block of exactly the bytes it spans, so AddressSanitizer sees any access
// past a view; and the invariants every op call must keep:
//   - a call either throws moelora::Error or returns;
//   - a call that throws wrote nothing (every block as it was before the call);
//   - a call that returns wrote only its outputs (every input block as it was).
// Views are mostly the shapes an op expects, mutated now and then (a dtype, a rank, a
// dim, a stride, the data pointer, the device, an alias of another view), so that most
// calls reach the CPU backend and the rest probe the validation.
#pragma once

#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <new>
#include <random>
#include <vector>

#include "common/host_numeric.h"
#include "moelora/ops.h"

namespace moelora::fuzz {

// Views larger than this stay unbacked (null data): the fuzzer still reaches the size
// arithmetic of their checks, and the harness never claims memory it does not own.
constexpr size_t kMaxBlockBytes = size_t(1) << 20;

[[noreturn]] inline void violation(const char* what) {
  std::fprintf(stderr, "fuzz invariant violated: %s\n", what);
  std::abort();
}

// The values written into a block: float tensors from a seeded generator in [-2, 2]
// (kValues) or (0, 2] (kPositive: scales), with NaN, inf and huge values now and then;
// others as raw bytes.
enum class Fill { kValues, kPositive, kBytes };

class Arena {
 public:
  explicit Arena(FuzzedDataProvider& fdp) : fdp_(fdp), rng_(fdp.ConsumeIntegral<uint32_t>()) {
    specials_ = fdp_.ConsumeIntegralInRange<int>(0, 7) == 0;
    // A view's chance of a mutation, in 64ths: none, rare (most calls run the backend),
    // or often (the validation).
    mutation_rate_ = fdp_.PickValueInArray({0, 1, 4, 16});
  }

  FuzzedDataProvider& fdp() { return fdp_; }

  // Whether a choice this call makes goes outside the op's contract: never in a clean
  // call (mutation rate 0), rarely or often in the others.
  bool odd() {
    return mutation_rate_ > 0 && fdp_.remaining_bytes() > 0 && fdp_.ConsumeIntegralInRange<int>(0, 63) < 2 * mutation_rate_;
  }
  // One of `usual`, or of `unusual` (if any) when odd().
  template <class T>
  T pick(std::initializer_list<T> usual, std::initializer_list<T> unusual) {
    const std::initializer_list<T>& list = unusual.size() > 0 && odd() ? unusual : usual;
    return *(list.begin() + fdp_.ConsumeIntegralInRange<size_t>(0, list.size() - 1));
  }

  // A view of `dtype` and row-major `shape`, mutated at the call's rate.
  TensorView input(DType dtype, std::initializer_list<int64_t> shape, Fill fill = Fill::kValues) {
    return make(dtype, shape, fill, /*output=*/false);
  }
  // An output: its block is poisoned (never zeros) and may change.
  TensorView output(DType dtype, std::initializer_list<int64_t> shape) {
    return make(dtype, shape, Fill::kBytes, /*output=*/true);
  }
  // Integers (int32, int64 or uint8) in [lo, hi], the op's valid range, shape as
  // input(): ids, flags, zero points. When odd(), one past either end too. Drawn from
  // the call's seeded generator: one fuzzer value an element ran short inputs dry.
  TensorView ids(DType dtype, std::initializer_list<int64_t> shape, int64_t lo, int64_t hi) {
    TensorView t = make(dtype, shape, Fill::kBytes, /*output=*/false);
    if (odd()) --lo, ++hi;
    Block* b = block_of(t);
    const bool integers = t.dtype == DType::kInt32 || t.dtype == DType::kInt64 || t.dtype == DType::kUInt8;
    if (!b || !integers) return t;
    const size_t width = dtype_size(t.dtype);
    std::uniform_int_distribution<int64_t> value(lo, hi);
    for (size_t i = 0; i + width <= b->size; i += width) {
      const int64_t v = value(rng_);
      const int32_t v32 = int32_t(v);
      const uint8_t v8 = uint8_t(v);
      std::memcpy(b->bytes.get() + i, width == 8 ? static_cast<const void*>(&v)
                                      : width == 4 ? static_cast<const void*>(&v32) : &v8, width);
    }
    return t;
  }
  // A byte workspace of `bytes` (1-D uint8), 256-byte aligned unless mutated.
  TensorView workspace(int64_t bytes) { return make(DType::kUInt8, {bytes}, Fill::kBytes, /*output=*/true); }

  // The view's block (or the one it aliases) becomes an output: in-place ops write it.
  void mark_output(const TensorView& t) {
    if (Block* b = block_of(t)) b->output = true;
  }

  // Before the op: every block's bytes.
  void snapshot() {
    for (auto& b : blocks_) b->before.assign(b->bytes.get(), b->bytes.get() + b->size);
  }
  // After the op: the invariants.
  void check(bool rejected) const {
    for (const auto& b : blocks_) {
      if ((rejected || !b->output) && std::memcmp(b->before.data(), b->bytes.get(), b->size) != 0) {
        violation(rejected ? "a rejected call wrote memory" : "a call wrote an input");
      }
    }
  }

 private:
  struct Block {
    // 256-byte aligned, as framework allocations are (the workspace needs it; the
    // misalign mutation moves views off it), and exactly `size` long.
    struct AlignedDelete {
      void operator()(uint8_t* p) const { ::operator delete[](p, std::align_val_t(256)); }
    };
    std::unique_ptr<uint8_t[], AlignedDelete> bytes;
    size_t size = 0;
    bool output = false;
    std::vector<uint8_t> before;
  };

  // NOTE: an exhausted provider returns the range's minimum: without the byte check the
  // mutation loop never ended on short inputs.
  // v * times + plus in two's complement (a mutated size may already be INT64_MAX).
  static int64_t wrap(int64_t v, int64_t times, int64_t plus) {
    return int64_t(uint64_t(v) * uint64_t(times) + uint64_t(plus));
  }

  bool mutate() {
    return mutation_rate_ > 0 && fdp_.remaining_bytes() > 0 && fdp_.ConsumeIntegralInRange<int>(0, 63) < mutation_rate_;
  }

  TensorView make(DType dtype, std::initializer_list<int64_t> shape, Fill fill, bool output) {
    TensorView t;
    t.dtype = dtype;
    t.rank = int(shape.size());
    int d = 0;
    for (int64_t s : shape) t.shape[d++] = s;
    int64_t stride = 1;
    for (d = t.rank - 1; d >= 0; --d) {
      t.strides[d] = stride;
      stride *= t.shape[d] > 0 ? t.shape[d] : 1;
    }
    int misalign = 0;
    bool null_data = false;
    for (int m = 0; m < 3 && mutate(); ++m) {
      switch (fdp_.ConsumeIntegralInRange<int>(0, 9)) {
        case 0: {  // another dtype, now and then one outside the enum
          const int v = fdp_.ConsumeIntegralInRange<int>(0, 9);
          t.dtype = static_cast<DType>(v <= int(DType::kUInt8) ? v : 100 + v);
          break;
        }
        case 1: t.rank = fdp_.ConsumeIntegralInRange<int>(-1, kMaxRank + 1); break;
        case 2: {  // one dim off: by one, to 0, or huge
          if (t.rank <= 0 || t.rank > kMaxRank) break;
          const int dim = fdp_.ConsumeIntegralInRange<int>(0, t.rank - 1);
          const int64_t choices[] = {wrap(t.shape[dim], 1, 1), wrap(t.shape[dim], 1, -1), 0, int64_t(1) << 31,
                                     int64_t(1) << 40, INT64_MAX, -1};
          t.shape[dim] = fdp_.PickValueInArray(choices);
          break;
        }
        case 3: {  // one stride: zero, negative, padded, huge
          if (t.rank <= 0 || t.rank > kMaxRank) break;
          const int dim = fdp_.ConsumeIntegralInRange<int>(0, t.rank - 1);
          const int64_t choices[] = {0, wrap(t.strides[dim], -1, 0), wrap(t.strides[dim], 1, 1),
                                     wrap(t.strides[dim], 2, 8), int64_t(1) << 40, INT64_MAX / 2, -1};
          t.strides[dim] = fdp_.PickValueInArray(choices);
          break;
        }
        case 4:  // transposed: the last two dims' strides swapped
          if (t.rank >= 2 && t.rank <= kMaxRank) {
            std::swap(t.strides[t.rank - 1], t.strides[t.rank - 2]);
          }
          break;
        case 5: null_data = true; break;
        case 6: misalign = fdp_.PickValueInArray({1, 2, 4, 8}); break;
        case 7: t.device = Device{DeviceType::kCUDA, fdp_.ConsumeIntegralInRange<int>(0, 1)}; break;
        case 8:  // an alias of an earlier view's block, where the new view fits in it
          alias_ = true;
          break;
        default: break;
      }
    }
    const bool aliased = alias_;
    alias_ = false;
    t = back(t, fill, output, misalign, null_data, aliased);
    if (std::getenv("MOELORA_FUZZ_TRACE")) trace(t, output);
    return t;
  }

  // MOELORA_FUZZ_TRACE=1: each view as made, to read a finding's input.
  static void trace(const TensorView& t, bool output) {
    std::fprintf(stderr, "view %s dtype %d rank %d shape", output ? "out" : "in ", int(t.dtype), t.rank);
    for (int d = 0; d < t.rank && d < kMaxRank; ++d) std::fprintf(stderr, " %lld", (long long)t.shape[d]);
    std::fprintf(stderr, " strides");
    for (int d = 0; d < t.rank && d < kMaxRank; ++d) std::fprintf(stderr, " %lld", (long long)t.strides[d]);
    std::fprintf(stderr, " data %p device %d\n", t.data, int(t.device.type));
  }

  // Gives t memory: exactly the bytes it spans (negative strides: below data too).
  TensorView back(TensorView t, Fill fill, bool output, int misalign, bool null_data, bool aliased) {
    if (t.rank < 0 || t.rank > kMaxRank) {
      t.data = scratch_;  // the op must reject the rank before reading
      return t;
    }
    // The lowest and highest element offsets the view touches, if they fit.
    int64_t low = 0, high = 0;
    bool empty = false, fits = true;
    for (int d = 0; d < t.rank; ++d) {
      if (t.shape[d] <= 0) empty = true;
      int64_t span = 0;
      if (t.shape[d] > 0 && __builtin_mul_overflow(t.shape[d] - 1, t.strides[d], &span)) fits = false;
      if (span < 0 ? __builtin_add_overflow(low, span, &low) : __builtin_add_overflow(high, span, &high)) fits = false;
    }
    const size_t width = dtype_size(t.dtype) > 0 ? dtype_size(t.dtype) : 1;
    size_t bytes = 0;
    if (fits && !empty) {
      const uint64_t elements = uint64_t(high) - uint64_t(low) + 1;
      fits = elements <= kMaxBlockBytes / width;
      bytes = size_t(elements) * width + size_t(misalign);
    }
    if (null_data || (!fits && !empty)) {
      t.data = nullptr;
      return t;
    }
    if (empty) {  // a real pointer that nothing may read
      bytes = 16;
      low = 0;
    }
    if (aliased && !blocks_.empty()) {
      Block& host = *blocks_[fdp_.ConsumeIntegralInRange<size_t>(0, blocks_.size() - 1)];
      if (host.size >= bytes) {
        const size_t offset = fdp_.ConsumeIntegralInRange<size_t>(0, host.size - bytes);
        t.data = host.bytes.get() + offset + misalign - low * int64_t(width);
        host.output = host.output || output;
        return t;
      }
    }
    auto block = std::make_unique<Block>();
    block->size = bytes;
    block->output = output;
    block->bytes.reset(static_cast<uint8_t*>(::operator new[](bytes, std::align_val_t(256))));
    fill_block(*block, t.dtype, fill, output);
    t.data = block->bytes.get() + misalign - low * int64_t(width);
    blocks_.push_back(std::move(block));
    return t;
  }

  void fill_block(Block& b, DType dtype, Fill fill, bool output) {
    std::uniform_real_distribution<float> value(-2.f, 2.f);
    std::uniform_int_distribution<int> byte(0, 255);
    const size_t width = dtype_size(dtype);
    const bool floats = fill != Fill::kBytes && !output &&
                        (dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16);
    if (!floats) {
      for (size_t i = 0; i < b.size; ++i) b.bytes[i] = uint8_t(byte(rng_));
      return;
    }
    for (size_t i = 0; i + width <= b.size; i += width) {
      float v = value(rng_);
      if (fill == Fill::kPositive) v = std::fabs(v) + 0.01f;
      if (specials_ && byte(rng_) < 8) {
        const float specials[] = {NAN, INFINITY, -INFINITY, 1e30f, -1e30f, 0.f, 1e-30f};
        v = specials[byte(rng_) % 7];
      }
      if (dtype == DType::kFloat32) {
        std::memcpy(b.bytes.get() + i, &v, 4);
      } else {
        const uint16_t bits = dtype == DType::kBFloat16 ? host::to_bf16(v).bits : host::to_fp16(v).bits;
        std::memcpy(b.bytes.get() + i, &bits, 2);
      }
    }
  }

  Block* block_of(const TensorView& t) {
    const auto* p = static_cast<const uint8_t*>(t.data);
    for (auto& b : blocks_) {
      if (p >= b->bytes.get() && p < b->bytes.get() + b->size) return b.get();
    }
    return nullptr;
  }

  FuzzedDataProvider& fdp_;
  std::mt19937 rng_;
  bool specials_ = false;
  int mutation_rate_ = 0;  // in 64ths
  bool alias_ = false;
  std::vector<std::unique_ptr<Block>> blocks_;
  alignas(16) uint8_t scratch_[16] = {};
};

}  // namespace moelora::fuzz
