// Kernel config registry: table parsing, file lookup and checks. See kernel_config.h.
#include "api/kernel_config.h"

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <utility>

#include "api/validate.h"

namespace moelora::detail {
namespace {

// ---- a strict reader for the table format --------------------------------------
// The format is a fixed subset of JSON: objects, strings without escapes, integers.
//   {"<tokens>": {"block_size": 64, "gemm1": {"kernel": "sm90", "block_m": 64,
//                 "block_n": 256, "cluster_m": 2, "ordered": 0}, "gemm2": {...},
//                 "small_batch": 1, "sorted_input": 1}, ...}
// cluster_m may be left out (1), ordered too (1), small_batch and sorted_input too (0).
// Unknown keys are errors, so a typo cannot silently fall back to defaults.
class TableReader {
 public:
  TableReader(const std::string& text, const std::string& source) : s_(text), source_(source) {}

  KernelConfigTable table() {
    KernelConfigTable out;
    object([&](const std::string& key) {
      char* end = nullptr;
      const long long tokens = std::strtoll(key.c_str(), &end, 10);
      if (key.empty() || *end != '\0' || tokens < 1) error("a positive token count as key, got \"" + key + "\"");
      MoeKernelConfig config;
      object([&](const std::string& field) {
        if (field == "block_size") {
          config.block_size = integer();
        } else if (field == "gemm1") {
          config.gemm1 = tile();
        } else if (field == "gemm2") {
          config.gemm2 = tile();
        } else if (field == "small_batch") {
          config.small_batch = flag("small_batch");
        } else if (field == "sorted_input") {
          config.sorted_input = flag("sorted_input");
        } else {
          error("one of block_size, gemm1, gemm2, small_batch, sorted_input, got \"" + field + "\"");
        }
      });
      if (config.block_size == 0) error("a block_size for tokens " + key);
      check_kernel_config("kernel config table", (source_ + " [" + key + "]").c_str(), config);
      out[tokens] = config;
    });
    skip_space();
    if (pos_ != s_.size()) error("end of text after the table");
    return out;
  }

 private:
  // A 0/1 field.
  bool flag(const char* name) {
    const int64_t value = integer();
    if (value != 0 && value != 1) error(std::string(name) + " 0 or 1");
    return value == 1;
  }

  GemmTile tile() {
    GemmTile t;
    object([&](const std::string& field) {
      if (field == "kernel") {
        const std::string name = string();
        if (name == "sm80") t.kernel = GemmKernel::kSm80;
        else if (name == "sm90") t.kernel = GemmKernel::kSm90;
        else if (name == "auto") t.kernel = GemmKernel::kAuto;
        else error("kernel \"sm80\", \"sm90\" or \"auto\", got \"" + name + "\"");
      } else if (field == "block_m") {
        t.block_m = int32_t(integer());
      } else if (field == "block_n") {
        t.block_n = int32_t(integer());
      } else if (field == "cluster_m") {
        t.cluster_m = int32_t(integer());
      } else if (field == "ordered") {
        t.ordered = flag("ordered");
      } else {
        error("one of kernel, block_m, block_n, cluster_m, ordered, got \"" + field + "\"");
      }
    });
    return t;
  }

  template <class OnField>
  void object(OnField&& on_field) {
    expect('{');
    skip_space();
    if (peek() == '}') { ++pos_; return; }
    while (true) {
      const std::string key = string();
      expect(':');
      on_field(key);
      skip_space();
      if (peek() == ',') { ++pos_; continue; }
      expect('}');
      return;
    }
  }

  std::string string() {
    expect('"');
    const size_t begin = pos_;
    while (pos_ < s_.size() && s_[pos_] != '"') {
      if (s_[pos_] == '\\') error("a string without escapes");
      ++pos_;
    }
    if (pos_ >= s_.size()) error("a closing quote");
    return s_.substr(begin, pos_++ - begin);
  }

  int64_t integer() {
    skip_space();
    const size_t begin = pos_;
    if (peek() == '-') ++pos_;
    while (pos_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[pos_]))) ++pos_;
    if (pos_ == begin || (pos_ == begin + 1 && s_[begin] == '-')) error("an integer");
    return std::strtoll(s_.substr(begin, pos_ - begin).c_str(), nullptr, 10);
  }

  void expect(char c) {
    skip_space();
    if (peek() != c) error(std::string("'") + c + "'");
    ++pos_;
  }
  char peek() const { return pos_ < s_.size() ? s_[pos_] : '\0'; }
  void skip_space() {
    while (pos_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[pos_]))) ++pos_;
  }
  [[noreturn]] void error(const std::string& expected) const {
    throw Error("moelora kernel config " + source_ + ": expected " + expected + " at byte " + std::to_string(pos_));
  }

  const std::string& s_;
  const std::string& source_;
  size_t pos_ = 0;
};

const char* dtype_tag(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16: return "bf16";
    case DType::kFloat16: return "fp16";
    case DType::kFloat32: return "fp32";
    default: return "other";
  }
}

bool valid_tile_size(GemmKernel kernel, int32_t block_m, int32_t block_n) {
  switch (kernel) {
    case GemmKernel::kSm80: return (block_m == 16 || block_m == 32 || block_m == 64) && (block_n == 64 || block_n == 128);
    case GemmKernel::kSm90: return (block_m == 64 || block_m == 128) && (block_n == 128 || block_n == 256);
    default: return false;
  }
}

}  // namespace

KernelConfigTable parse_kernel_config_table(const std::string& json, const std::string& source) {
  return TableReader(json, source).table();
}

std::string kernel_config_file_name(int64_t num_experts, int64_t intermediate_size, DType dtype,
                                    const std::string& device_name) {
  std::string device = device_name;
  for (char& c : device) {
    if (c == ' ') c = '_';
  }
  return "E=" + std::to_string(num_experts) + ",N=" + std::to_string(intermediate_size) + ",device_name=" + device +
         ",dtype=" + dtype_tag(dtype) + ".json";
}

const KernelConfigTable* find_kernel_config_table(const std::string& file_name) {
  static std::mutex mutex;
  // std::map never moves its nodes: the returned pointers stay valid.
  static std::map<std::string, std::optional<KernelConfigTable>> cache;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = cache.find(file_name); it != cache.end()) return it->second ? &*it->second : nullptr;

  std::optional<KernelConfigTable> found;
  if (const char* dir = std::getenv("MOELORA_CONFIG_DIR"); dir != nullptr && *dir != '\0') {
    const std::string path = std::string(dir) + "/" + file_name;
    // NOTE: stdio, not iostreams: the core stays free of iostreams (see ops.cpp).
    if (std::FILE* file = std::fopen(path.c_str(), "rb")) {
      std::string text;
      char buffer[4096];
      for (size_t n; (n = std::fread(buffer, 1, sizeof(buffer), file)) > 0;) text.append(buffer, n);
      std::fclose(file);
      found = parse_kernel_config_table(text, path);
    }
  }
  for (int i = 0; !found && i < kNumShippedKernelConfigs; ++i) {
    if (file_name == kShippedKernelConfigs[i].file_name) {
      found = parse_kernel_config_table(kShippedKernelConfigs[i].json, std::string("configs/") + file_name);
    }
  }
  std::optional<KernelConfigTable>& cached = cache[file_name];
  cached = std::move(found);
  return cached ? &*cached : nullptr;
}

MoeKernelConfig nearest_kernel_config(const KernelConfigTable& table, int64_t num_tokens) {
  auto best = table.begin();
  for (auto it = table.begin(); it != table.end(); ++it) {
    if (std::llabs(it->first - num_tokens) < std::llabs(best->first - num_tokens)) best = it;
  }
  return best->second;
}

void check_gemm_tile(const char* op, const char* what, const GemmTile& tile, int64_t block_size) {
  if (tile.kernel == GemmKernel::kAuto) return;
  if (!valid_tile_size(tile.kernel, tile.block_m, tile.block_n)) {
    fail(op, std::string("argument '") + what + "' expected block_m x block_n in " +
                 (tile.kernel == GemmKernel::kSm80 ? "{16, 32, 64} x {64, 128} for sm80"
                                                   : "{64, 128} x {128, 256} for sm90") +
                 ", got " + std::to_string(tile.block_m) + " x " + std::to_string(tile.block_n));
  }
  const bool cluster_ok = tile.kernel == GemmKernel::kSm90 ? (tile.cluster_m == 1 || tile.cluster_m == 2) : tile.cluster_m == 1;
  if (!cluster_ok) {
    fail(op, std::string("argument '") + what + "' expected cluster_m " +
                 (tile.kernel == GemmKernel::kSm90 ? "1 or 2 for sm90" : "1 for sm80") + ", got " +
                 std::to_string(tile.cluster_m));
  }
  if (!tile.ordered && tile.kernel != GemmKernel::kSm90) {
    fail(op, std::string("argument '") + what + "' expected ordered only on sm90 tiles (the static schedule is " +
                 "an sm90 choice), got ordered = false on sm80");
  }
  if (block_size % tile.block_m != 0) {
    fail(op, std::string("argument '") + what + "' expected block_m dividing the block size " +
                 std::to_string(block_size) + ", got " + std::to_string(tile.block_m));
  }
}

void check_kernel_config(const char* op, const char* what, const MoeKernelConfig& config) {
  if (config.block_size < 16 || config.block_size > 256 || config.block_size % 16 != 0) {
    fail(op, std::string("argument '") + what + "' expected block_size a multiple of 16 in [16, 256], got " +
                 std::to_string(config.block_size));
  }
  check_gemm_tile(op, (std::string(what) + ".gemm1").c_str(), config.gemm1, config.block_size);
  check_gemm_tile(op, (std::string(what) + ".gemm2").c_str(), config.gemm2, config.block_size);
  if (config.sorted_input && (config.gemm1.kernel != GemmKernel::kSm90 || config.gemm2.kernel != GemmKernel::kSm90)) {
    fail(op, std::string("argument '") + what + "' expected sm90 tiles for both GEMMs with sorted_input (GEMM1 " +
                 "reads the sorted rows by TMA), got another kernel");
  }
  const GroupedGemmTiles grouped_tiles[2] = {config.grouped_tiles1, config.grouped_tiles2};
  for (int i = 0; i < 2; ++i) {
    const int value = int(grouped_tiles[i]);
    if (value < int(GroupedGemmTiles::kAuto) || value > int(GroupedGemmTiles::kCooperative128x256)) {
      fail(op, std::string("argument '") + what + ".grouped_tiles" + std::to_string(i + 1) +
                   "' expected kAuto, kCooperative128, kPingpong64 or kCooperative128x256, got " + std::to_string(value));
    }
  }
}

}  // namespace moelora::detail
