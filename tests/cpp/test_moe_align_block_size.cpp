// moe_align_block_size: the full layout is checked against the contract in ops.h, not
// against another implementation's output.
#include <algorithm>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "test_util.h"

#ifdef MOELORA_WITH_CUDA
#include "common/params.h"
#endif

namespace moelora::test {
namespace {

using ::testing::HasSubstr;

int64_t round_up(int64_t x, int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }

// What the op wrote, copied back to the host.
struct AlignOutput {
  std::vector<int32_t> sorted_token_ids;  // [view size]
  std::vector<int32_t> expert_ids;        // [view size]
  int32_t num_tokens_post_padded;
};

// Checks `got` against the contract:
// - num_tokens_post_padded = Σ over non-empty groups of round_up(group size, block_size);
// - groups in ascending expert order, then the dropped group (ids -1); each holds exactly
//   its slots (ascending when `ordered`, as the CPU backend writes them; as a set
//   otherwise), then sentinels up to the block boundary;
// - each block's expert id is expert_map[e] (or e), -1 for the dropped group;
// - every entry past the groups is the sentinel, every block past them -1.
// `ids` [num_slots]: the expert of each slot, -1 for dropped.
::testing::AssertionResult alignment_is_valid(const std::vector<int64_t>& ids, int64_t num_experts,
                                              const std::vector<int32_t>* expert_map, int64_t block_size,
                                              const AlignOutput& got, bool ordered) {
  const int64_t num_slots = int64_t(ids.size());
  const int32_t sentinel = int32_t(num_slots);
  std::vector<std::vector<int32_t>> groups(size_t(num_experts + 1));  // the last one: dropped slots
  for (int64_t s = 0; s < num_slots; ++s) {
    const int64_t id = ids[size_t(s)];
    groups[size_t(id == -1 ? num_experts : id)].push_back(int32_t(s));
  }
  int64_t expected_used = 0;
  for (const auto& group : groups) expected_used += round_up(int64_t(group.size()), block_size);
  if (got.num_tokens_post_padded != expected_used) {
    return ::testing::AssertionFailure() << "num_tokens_post_padded is " << got.num_tokens_post_padded
                                         << ", expected " << expected_used;
  }
  if (int64_t(got.sorted_token_ids.size()) < expected_used ||
      int64_t(got.expert_ids.size()) < expected_used / block_size) {
    return ::testing::AssertionFailure() << "outputs smaller than the layout";
  }
  int64_t position = 0;
  for (int64_t g = 0; g <= num_experts; ++g) {
    const std::vector<int32_t>& expected_slots = groups[size_t(g)];
    if (expected_slots.empty()) continue;
    const int64_t count = int64_t(expected_slots.size());
    std::vector<int32_t> slots(got.sorted_token_ids.begin() + position,
                               got.sorted_token_ids.begin() + position + count);
    if (!ordered) std::sort(slots.begin(), slots.end());
    if (slots != expected_slots) {
      std::ostringstream s;
      s << "group " << (g == num_experts ? std::string("dropped") : "of expert " + std::to_string(g))
        << " at entry " << position << " holds other slots than the " << count << " routed there (first: "
        << slots.front() << " vs " << expected_slots.front() << ")";
      return ::testing::AssertionFailure() << s.str();
    }
    const int64_t end = position + round_up(count, block_size);
    for (int64_t i = position + count; i < end; ++i) {
      if (got.sorted_token_ids[size_t(i)] != sentinel) {
        return ::testing::AssertionFailure() << "padding entry " << i << " of group " << g << " is "
                                             << got.sorted_token_ids[size_t(i)] << ", expected sentinel " << sentinel;
      }
    }
    const int32_t expected_expert = g == num_experts ? -1 : expert_map ? (*expert_map)[size_t(g)] : int32_t(g);
    for (int64_t b = position / block_size; b < end / block_size; ++b) {
      if (got.expert_ids[size_t(b)] != expected_expert) {
        return ::testing::AssertionFailure() << "expert_ids[" << b << "] is " << got.expert_ids[size_t(b)]
                                             << ", expected " << expected_expert << " (group " << g << ")";
      }
    }
    position = end;
  }
  for (size_t i = size_t(position); i < got.sorted_token_ids.size(); ++i) {
    if (got.sorted_token_ids[i] != sentinel) {
      return ::testing::AssertionFailure() << "tail entry " << i << " is " << got.sorted_token_ids[i]
                                           << ", expected sentinel " << sentinel;
    }
  }
  for (size_t b = size_t(position / block_size); b < got.expert_ids.size(); ++b) {
    if (got.expert_ids[b] != -1) {
      return ::testing::AssertionFailure() << "tail expert_ids[" << b << "] is " << got.expert_ids[b]
                                           << ", expected -1";
    }
  }
  return ::testing::AssertionSuccess();
}

// The buffers of one call: topk_ids (optionally a strided view with garbage between the
// elements), expert_map, and outputs sized capacity + slack inside storage with a poisoned
// margin that must stay untouched.
struct AlignCall {
  static constexpr int64_t kSlack = 3;   // view entries past the capacity: the contract says sentinel/-1
  static constexpr int64_t kMargin = 5;  // storage past the view: must keep its poison

  AlignCall(Backend backend, const std::vector<int64_t>& ids, int64_t M, int64_t top_k, DType id_dtype,
            bool strided, int64_t block_size, int64_t num_experts, const std::vector<int32_t>* map)
      : capacity(moe_align_block_size_capacity(M * top_k, block_size, num_experts)),
        topk_ids(backend, id_dtype, std::max<int64_t>(1, (strided ? 4 : 1) * M * top_k)),
        expert_map(backend, DType::kInt32, map ? int64_t(map->size()) : 1),
        sorted_token_ids(backend, DType::kInt32, capacity.max_num_tokens_padded + kSlack + kMargin),
        expert_ids(backend, DType::kInt32, capacity.max_num_blocks + kSlack + kMargin),
        num_tokens_post_padded(backend, DType::kInt32, 1 + kMargin) {
    // strided: a view of every other row and every other column; the skipped elements
    // hold an id no expert has, so reading one is caught.
    for (int64_t i = 0; i < topk_ids.size(); ++i) topk_ids.set(i, 100000);
    ids_view = strided ? topk_ids.view({M, top_k}, {4 * top_k, 2}) : topk_ids.view({M, top_k});
    topk_ids.write(ids_view, std::vector<double>(ids.begin(), ids.end()));
    topk_ids.upload();
    if (map) {
      expert_map.write(expert_map.view({int64_t(map->size())}), std::vector<double>(map->begin(), map->end()));
      expert_map.upload();
      map_view = expert_map.view({int64_t(map->size())});
    }
    sorted_view = sorted_token_ids.view({capacity.max_num_tokens_padded + kSlack});
    expert_ids_view = expert_ids.view({capacity.max_num_blocks + kSlack});
    count_view = num_tokens_post_padded.view({1});
    poison();
  }

  void poison() {
    sorted_token_ids.poison();
    expert_ids.poison();
    num_tokens_post_padded.poison();
  }

  void run(int64_t block_size, int64_t num_experts, bool with_map, Stream stream) {
    moe_align_block_size(ids_view, block_size, num_experts, with_map ? &map_view : nullptr, sorted_view,
                         expert_ids_view, count_view, stream);
  }

  // Copies the storage back without reading through the views (a bad-argument case
  // may have re-pointed a view at memory that is not this buffer's).
  void download_storage() {
    sorted_token_ids.download();
    expert_ids.download();
    num_tokens_post_padded.download();
  }

  AlignOutput download() {
    download_storage();
    AlignOutput out;
    for (double v : sorted_token_ids.read(sorted_view)) out.sorted_token_ids.push_back(int32_t(v));
    for (double v : expert_ids.read(expert_ids_view)) out.expert_ids.push_back(int32_t(v));
    out.num_tokens_post_padded = int32_t(num_tokens_post_padded.get(0));
    return out;
  }

  void expect_margins_untouched() const {
    EXPECT_EQ(sorted_token_ids.count_written_outside(sorted_view), 0);
    EXPECT_EQ(expert_ids.count_written_outside(expert_ids_view), 0);
    EXPECT_EQ(num_tokens_post_padded.count_written_outside(count_view), 0);
  }

  void expect_nothing_written() const {
    EXPECT_EQ(sorted_token_ids.count_written(), 0);
    EXPECT_EQ(expert_ids.count_written(), 0);
    EXPECT_EQ(num_tokens_post_padded.count_written(), 0);
  }

  AlignCapacity capacity;
  Buffer topk_ids, expert_map, sorted_token_ids, expert_ids, num_tokens_post_padded;
  TensorView ids_view, map_view, sorted_view, expert_ids_view, count_view;
};

// ---- layouts -------------------------------------------------------------------------

enum class Routing {
  kRandom,         // top_k distinct experts per token, as a router picks them
  kDropped,        // random, with about a quarter of the slots -1
  kAllDropped,     // every slot -1
  kOneExpert,      // every slot on one expert
  kTwoExperts,     // only the first and last expert get slots; the rest are empty
  kWorstPadding,   // every expert exactly one slot, plus one dropped slot: most padding
};

struct AlignCase {
  std::string name;
  Backend backend;
  int64_t M, top_k, num_experts, block_size;
  Routing routing;
  DType id_dtype;
  bool strided;
  bool with_expert_map;  // half the experts mapped to -1, the rest to shuffled local ids
};

void PrintTo(const AlignCase& c, std::ostream* os) { *os << c.name; }

std::vector<int64_t> make_ids(const AlignCase& c, std::mt19937& rng) {
  const int64_t num_slots = c.M * c.top_k;
  std::vector<int64_t> ids;
  switch (c.routing) {
    case Routing::kRandom:
      return random_routing(c.M, c.top_k, c.num_experts, rng);
    case Routing::kDropped: {
      ids = random_routing(c.M, c.top_k, c.num_experts, rng);
      std::bernoulli_distribution drop(0.25);
      for (auto& id : ids) id = drop(rng) ? -1 : id;
      return ids;
    }
    case Routing::kAllDropped:
      return std::vector<int64_t>(size_t(num_slots), -1);
    case Routing::kOneExpert:
      return std::vector<int64_t>(size_t(num_slots), c.num_experts / 2);
    case Routing::kTwoExperts: {
      std::bernoulli_distribution first(0.5);
      for (int64_t s = 0; s < num_slots; ++s) ids.push_back(first(rng) ? 0 : c.num_experts - 1);
      return ids;
    }
    case Routing::kWorstPadding: {
      for (int64_t s = 0; s < num_slots; ++s) ids.push_back(s < c.num_experts ? s : -1);
      std::shuffle(ids.begin(), ids.end(), rng);
      return ids;
    }
  }
  return ids;
}

void expect_layout_matches_contract(const AlignCase& c) {
  std::mt19937 rng(std::hash<std::string>{}(c.name) ^ 0x5eed);
  const std::vector<int64_t> ids = make_ids(c, rng);
  std::vector<int32_t> map;
  if (c.with_expert_map) {
    // EP: every other expert lives on another rank (-1); the rest get shuffled local ids.
    std::vector<int32_t> local((size_t(c.num_experts) + 1) / 2);
    std::iota(local.begin(), local.end(), 0);
    std::shuffle(local.begin(), local.end(), rng);
    for (int64_t e = 0; e < c.num_experts; ++e) map.push_back(e % 2 == 0 ? local[size_t(e / 2)] : -1);
  }
  TestStream stream(c.backend);
  AlignCall call(c.backend, ids, c.M, c.top_k, c.id_dtype, c.strided, c.block_size, c.num_experts,
                 c.with_expert_map ? &map : nullptr);
  call.run(c.block_size, c.num_experts, c.with_expert_map, stream.handle());
  stream.sync();
  const AlignOutput got = call.download();
  EXPECT_TRUE(alignment_is_valid(ids, c.num_experts, c.with_expert_map ? &map : nullptr, c.block_size, got,
                                 /*ordered=*/c.backend == Backend::kCPU));
  call.expect_margins_untouched();
  // the capacity bounds the layout
  EXPECT_LE(got.num_tokens_post_padded, call.capacity.max_num_tokens_padded);
  EXPECT_LE(got.num_tokens_post_padded / c.block_size, call.capacity.max_num_blocks);
}

class AlignTest : public ::testing::TestWithParam<AlignCase> {};

TEST_P(AlignTest, LayoutMatchesContract) {
  MOELORA_SKIP_UNLESS_AVAILABLE(GetParam().backend);
  expect_layout_matches_contract(GetParam());
}

std::vector<AlignCase> align_cases() {
  std::vector<AlignCase> cases;
  auto add = [&](std::string name, int64_t M, int64_t top_k, int64_t E, int64_t bs, Routing routing, DType id_dtype,
                 bool strided, bool with_map) {
    for (Backend backend : all_backends()) {
      cases.push_back({std::string(backend_name(backend)) + "_" + name + "_bs" + std::to_string(bs), backend, M, top_k,
                       E, bs, routing, id_dtype, strided, with_map});
    }
  };
  const DType i32 = DType::kInt32, i64 = DType::kInt64;
  for (int64_t bs : {16, 32, 48, 64, 128, 256}) {
    add("qwen3_M64", 64, 8, 128, bs, Routing::kRandom, i32, false, false);
    add("deepseek_M37_strided_i64", 37, 8, 256, bs, Routing::kRandom, i64, true, false);
    add("mixtral_M256", 256, 2, 8, bs, Routing::kRandom, i32, false, false);
    add("dropped_M50", 50, 4, 16, bs, Routing::kDropped, i64, false, false);
    add("expert_map_M40", 40, 4, 64, bs, Routing::kDropped, i32, false, true);
    add("one_expert_M300_topk1", 300, 1, 64, bs, Routing::kOneExpert, i32, false, false);
    add("two_experts_M20", 20, 2, 64, bs, Routing::kTwoExperts, i64, true, false);
    add("worst_padding_E32", 33, 1, 32, bs, Routing::kWorstPadding, i32, false, false);
  }
  add("M0", 0, 8, 128, 64, Routing::kRandom, i32, false, false);
  add("M0_strided_i64", 0, 4, 16, 16, Routing::kRandom, i64, true, true);
  add("M1_topk1", 1, 1, 64, 16, Routing::kRandom, i32, false, false);
  add("M1_topk8", 1, 8, 128, 64, Routing::kRandom, i64, false, true);
  add("E1", 9, 1, 1, 16, Routing::kRandom, i32, false, false);
  add("all_dropped", 12, 4, 16, 32, Routing::kAllDropped, i32, false, false);
  add("qwen3_M4096", 4096, 8, 128, 64, Routing::kRandom, i32, false, false);
  // Past the 80K slots whose groups the CUDA kernel keeps in shared memory: the scatter re-reads ids.
  add("qwen3_M13000_strided_i64", 13000, 8, 128, 128, Routing::kDropped, i64, true, false);
  add("qwen3_M10240_contiguous", 10240, 8, 128, 128, Routing::kRandom, i32, false, false);
  add("deepseek_M1000_map", 1000, 8, 256, 128, Routing::kDropped, i64, false, true);
  add("gpt_oss_M256", 256, 4, 128, 16, Routing::kRandom, i32, true, false);
  // The CUDA kernel splits the slots over a cluster of up to 8 CTAs (2048 slots each):
  // two CTAs with uneven shares, every slot of 8 CTAs in one group, dropped slots and
  // an expert map across CTAs, and most groups padding.
  add("two_ctas_M257", 257, 8, 128, 32, Routing::kRandom, i32, false, false);
  add("one_expert_M5000_8ctas", 5000, 4, 64, 64, Routing::kOneExpert, i32, false, false);
  add("dropped_map_M3001_8ctas", 3001, 8, 256, 16, Routing::kDropped, i64, true, true);
  add("worst_padding_M3000", 3000, 1, 256, 256, Routing::kWorstPadding, i32, false, false);
  add("max_experts", 100, 8, kMaxNumExperts, 16, Routing::kRandom, i32, false, false);
  // The CUDA kernel's CTA sizes at one CTA: 512 threads for 1025-2048 groups (512 slots) and
  // for 1025-2048 slots (1600); 1024 past 2048 groups (max_experts above).
  add("E1500_M64", 64, 8, 1500, 16, Routing::kDropped, i32, false, true);
  add("one_cta_M200_topk8", 200, 8, 128, 16, Routing::kRandom, i64, true, false);
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Layouts, AlignTest, ::testing::ValuesIn(align_cases()),
                         [](const auto& info) { return info.param.name; });

#ifdef MOELORA_WITH_CUDA
// The CUDA cases of at most 2048 slots: where one CTA takes them the CUDA kernel runs 256 or
// 512 threads by the rule (align_threads); its 1024-thread CTA ($MOELORA_ALIGN_SMALL_CTA=0)
// must meet the contract there too.
class AlignFullCtaTest : public ::testing::TestWithParam<AlignCase> {};

TEST_P(AlignFullCtaTest, LayoutMatchesContract) {
  const AlignCase& c = GetParam();
  MOELORA_SKIP_UNLESS_AVAILABLE(c.backend);
  const ScopedKnob full_cta(cuda::align_small_cta_enabled, cuda::set_align_small_cta_enabled, false);
  expect_layout_matches_contract(c);
}

INSTANTIATE_TEST_SUITE_P(Layouts, AlignFullCtaTest,
                         ::testing::ValuesIn(cuda_cases_where(align_cases(),
                                                              [](const AlignCase& c) { return c.M * c.top_k <= 2048; })),
                         [](const auto& info) { return info.param.name; });
#endif

// ---- ids outside [0, num_experts) ----------------------------------------------------

class AlignBackendTest : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override { MOELORA_SKIP_UNLESS_AVAILABLE(GetParam()); }
  Backend backend() const { return GetParam(); }
};

// On the CPU an id outside [0, E) other than -1 is an error naming the argument, the value
// and its position, and nothing is written. The CUDA backend cannot read ids on the host:
// it treats them as dropped (-1).
TEST_P(AlignBackendTest, OutOfRangeIds) {
  const int64_t M = 6, top_k = 3, E = 16, block_size = 16;
  std::mt19937 rng(301);
  std::vector<int64_t> ids = random_routing(M, top_k, E, rng);
  ids[3 * top_k + 2] = 777;
  ids[4 * top_k + 0] = -2;
  ids[5 * top_k + 1] = E;
  TestStream stream(backend());
  for (DType id_dtype : {DType::kInt32, DType::kInt64}) {
    AlignCall call(backend(), ids, M, top_k, id_dtype, false, block_size, E, nullptr);
    if (backend() == Backend::kCPU) {
      const std::string message = error_message([&] { call.run(block_size, E, false, stream.handle()); });
      EXPECT_THAT(message, HasSubstr("'topk_ids'"));
      EXPECT_THAT(message, HasSubstr("777"));
      EXPECT_THAT(message, HasSubstr("[3, 2]"));
      EXPECT_THAT(message, HasSubstr("16)"));  // the end of the valid range
      call.download();
      call.expect_nothing_written();
    } else {
      call.run(block_size, E, false, stream.handle());
      stream.sync();
      std::vector<int64_t> as_dropped = ids;
      for (auto& id : as_dropped) id = (id >= 0 && id < E) ? id : -1;
      EXPECT_TRUE(alignment_is_valid(as_dropped, E, nullptr, block_size, call.download(), /*ordered=*/false));
    }
  }
}

TEST_P(AlignBackendTest, CapacityCoversTheDroppedGroup) {
  // Worst case: every one of E experts and the dropped group pads by block_size - 1.
  for (int64_t block_size : {16, 48, 256}) {
    const int64_t E = 8;
    const AlignCapacity capacity = moe_align_block_size_capacity(E + 1, block_size, E);
    EXPECT_GE(capacity.max_num_tokens_padded, (E + 1) * block_size);
    EXPECT_GE(capacity.max_num_blocks, E + 1);
  }
}

// The capacity queries check their numbers (found by the fuzzer, issue 33: a huge slot
// count overflowed the padded size, block size 0 divided by zero).
TEST(AlignCapacity, RejectsOutOfRangeArguments) {
  EXPECT_THAT(error_message([] { moe_align_block_size_capacity(-1, 64, 8); }), HasSubstr("'num_slots'"));
  EXPECT_THAT(error_message([] { moe_align_block_size_capacity(int64_t(1) << 62, 64, 8); }),
              HasSubstr("'num_slots'"));
  EXPECT_THAT(error_message([] { moe_align_block_size_capacity(16, 0, 8); }), HasSubstr("'block_size'"));
  EXPECT_THAT(error_message([] { moe_align_block_size_capacity(16, 64, 0); }), HasSubstr("'num_experts'"));
  EXPECT_THAT(error_message([] { moe_align_block_size_capacity(16, 64, kMaxNumExperts + 1); }),
              HasSubstr("'num_experts'"));
  EXPECT_THAT(error_message([] { moe_lora_align_block_size_capacity(16, 64, 8, 0); }), HasSubstr("'max_loras'"));
  EXPECT_THAT(error_message([] { moe_lora_align_block_size_capacity(16, 64, 8, kMaxLoraAdapters + 1); }),
              HasSubstr("'max_loras'"));
  EXPECT_THAT(error_message([] { moe_lora_align_block_size_capacity(16, 64, -3, 4); }), HasSubstr("'num_experts'"));
}

// ---- rejected arguments ---------------------------------------------------------------

// Each case breaks one argument of an otherwise valid call; the call must throw
// moelora::Error naming that argument and leave every output untouched.
TEST_P(AlignBackendTest, RejectsBadArguments) {
  const int64_t M = 5, top_k = 2, E = 8, block_size = 32;
  std::mt19937 rng(302);
  const std::vector<int64_t> ids = random_routing(M, top_k, E, rng);
  std::vector<int32_t> map(static_cast<size_t>(E));
  std::iota(map.begin(), map.end(), 0);
  TestStream stream(backend());
  float any_storage[4] = {0, 0, 0, 0};

  struct BadCase {
    std::string what;
    std::string argument;
    std::function<void(AlignCall&, int64_t& block_size, int64_t& num_experts, const TensorView*& expert_map)> breaks;
  };
  const std::vector<BadCase> bad_cases = {
      {"rank 1 topk_ids", "topk_ids", [](AlignCall& c, auto&, auto&, auto&) { c.ids_view.rank = 1; }},
      {"rank above kMaxRank", "topk_ids", [](AlignCall& c, auto&, auto&, auto&) { c.ids_view.rank = kMaxRank + 1; }},
      {"float topk_ids", "topk_ids", [](AlignCall& c, auto&, auto&, auto&) { c.ids_view.dtype = DType::kFloat32; }},
      {"null topk_ids", "topk_ids", [](AlignCall& c, auto&, auto&, auto&) { c.ids_view.data = nullptr; }},
      {"negative stride", "topk_ids",
       [](AlignCall& c, auto&, auto&, auto&) { c.ids_view.strides[0] = -c.ids_view.strides[0]; }},
      {"int64 sorted_token_ids", "sorted_token_ids",
       [](AlignCall& c, auto&, auto&, auto&) { c.sorted_view.dtype = DType::kInt64; }},
      {"short sorted_token_ids", "sorted_token_ids",
       [](AlignCall& c, auto&, auto&, auto&) { c.sorted_view.shape[0] = c.capacity.max_num_tokens_padded - 1; }},
      {"rank 2 sorted_token_ids", "sorted_token_ids",
       [](AlignCall& c, auto&, auto&, auto&) {
         c.sorted_view.rank = 2;
         c.sorted_view.shape[1] = 1;
         c.sorted_view.strides[1] = 1;
       }},
      {"short expert_ids", "expert_ids",
       [](AlignCall& c, auto&, auto&, auto&) { c.expert_ids_view.shape[0] = c.capacity.max_num_blocks - 1; }},
      {"two counts", "num_tokens_post_padded",
       [](AlignCall& c, auto&, auto&, auto&) { c.count_view.shape[0] = 2; }},
      // An output over the ids it reads (check_disjoint_writes, issue 33).
      {"count over topk_ids", "num_tokens_post_padded",
       [](AlignCall& c, auto&, auto&, auto&) { c.count_view.data = c.ids_view.data; }},
      {"count on another device", "num_tokens_post_padded",
       [&](AlignCall& c, auto&, auto&, auto&) {
         c.count_view.device = other_device(backend());
         c.count_view.data = any_storage;
       }},
      {"sorted ids on another device", "sorted_token_ids",
       [&](AlignCall& c, auto&, auto&, auto&) {
         c.sorted_view.device = other_device(backend());
         c.sorted_view.data = any_storage;
       }},
      {"block_size 15", "block_size", [](AlignCall&, int64_t& bs, auto&, auto&) { bs = 15; }},
      {"block_size 257", "block_size", [](AlignCall&, int64_t& bs, auto&, auto&) { bs = 257; }},
      {"num_experts 0", "num_experts", [](AlignCall&, auto&, int64_t& e, auto&) { e = 0; }},
      {"expert_map too short", "expert_map",
       [](AlignCall& c, auto&, auto&, const TensorView*& m) {
         c.map_view.shape[0] -= 1;
         m = &c.map_view;
       }},
      {"int64 expert_map", "expert_map",
       [](AlignCall& c, auto&, auto&, const TensorView*& m) {
         c.map_view.dtype = DType::kInt64;
         m = &c.map_view;
       }},
  };
  for (const BadCase& bad : bad_cases) {
    SCOPED_TRACE(bad.what);
    AlignCall call(backend(), ids, M, top_k, DType::kInt32, false, block_size, E, &map);
    int64_t bs = block_size, num_experts = E;
    const TensorView* expert_map = nullptr;
    bad.breaks(call, bs, num_experts, expert_map);
    const std::string message = error_message([&] {
      moe_align_block_size(call.ids_view, bs, num_experts, expert_map, call.sorted_view, call.expert_ids_view,
                           call.count_view, stream.handle());
    });
    EXPECT_THAT(message, HasSubstr(quoted(bad.argument)));
    stream.sync();
    call.download_storage();
    call.expect_nothing_written();
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, AlignBackendTest, ::testing::ValuesIn(all_backends()),
                         [](const auto& info) { return std::string(backend_name(info.param)); });

}  // namespace
}  // namespace moelora::test
