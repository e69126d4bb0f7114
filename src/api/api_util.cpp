// The argument checks of api_util.h that the op files share.
#include "api/api_util.h"

#include <string>

namespace moelora::detail {

void check_block_size(const char* op, int64_t block_size, bool multiple_of_16) {
  if (block_size < 16 || block_size > 256 || (multiple_of_16 && block_size % 16 != 0)) {
    fail(op, std::string("argument 'block_size' expected ") +
                 (multiple_of_16 ? "a multiple of 16 in [16, 256]" : "a value in [16, 256]") + ", got " +
                 std::to_string(block_size));
  }
}

void check_range(const char* op, const char* name, int64_t value, int64_t lo, int64_t hi) {
  if (value < lo || value > hi) {
    fail(op, std::string("argument '") + name + "' expected a value in [" + std::to_string(lo) + ", " +
                 std::to_string(hi) + "], got " + std::to_string(value));
  }
}

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

}  // namespace moelora::detail
