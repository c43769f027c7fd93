// Tests of the pinned host pool: budget, exact accounting, usable and aligned memory,
// honest page kinds and lock state, registration ranges, threads, trim.
#include "strata/pinned_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "strata/device.h"
#include "strata/error.h"

namespace strata {
namespace {

constexpr std::size_t kMiB = std::size_t(1) << 20;

std::size_t round_up(std::size_t x, std::size_t a) { return (x + a - 1) / a * a; }

// A field (in bytes) of the /proc/self/smaps entry of the mapping containing `addr`.
std::size_t smaps_field(const void* addr, const std::string& field) {
  std::ifstream f("/proc/self/smaps");
  const auto a = reinterpret_cast<std::uintptr_t>(addr);
  std::string line;
  bool in = false;
  while (std::getline(f, line)) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2) {
      if (in) break;
      in = a >= lo && a < hi;
    } else if (in && line.rfind(field + ":", 0) == 0) {
      return std::stoull(line.substr(field.size() + 1)) * 1024;
    }
  }
  ADD_FAILURE() << "no smaps entry with " << field << " for " << addr;
  return 0;
}

std::size_t proc_value(const char* file, const std::string& key) {
  std::ifstream f(file);
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(key + ":", 0) == 0) return std::stoull(line.substr(key.size() + 1));
  return 0;
}

std::string thp_mode() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  std::getline(f, line);
  const auto o = line.find('['), c = line.find(']');
  return o == std::string::npos || c == std::string::npos ? "unavailable"
                                                          : line.substr(o + 1, c - o - 1);
}

PinnedPoolOptions opts(std::size_t budget) {
  PinnedPoolOptions o;
  o.budget_bytes = budget;
  return o;
}

template <class Fn>
Error expect_error(Fn fn, ErrorKind kind) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    return e;
  }
  ADD_FAILURE() << "no strata::Error thrown";
  return Error(ErrorKind::kInternal, "", "", __FILE__, __LINE__);
}

TEST(PinnedPool, InvalidOptionsAreRejectedNamingTheField) {
  auto reject = [](PinnedPoolOptions o, const char* field) {
    const Error e = expect_error([&] { PinnedPool p(o); }, ErrorKind::kInvalidArgument);
    EXPECT_NE(e.message().find(field), std::string::npos) << e.message();
  };
  reject(opts(0), "budget_bytes");
  reject(opts(std::size_t(1) << 20), "at least 2 MiB");  // below one commit step: it held nothing
  auto o = opts(64 * kMiB);
  o.alignment = 3000;
  reject(o, "alignment");
  o.alignment = 2048;
  reject(o, "alignment");
  o = opts(64 * kMiB);
  o.chunk_bytes = kMiB;
  reject(o, "chunk_bytes");
  o = opts(64 * kMiB);
  o.chunk_bytes = 2 * kMiB + 100;
  reject(o, "chunk_bytes");
  o = opts(64 * kMiB);
  o.alignment = 8 * kMiB;
  o.chunk_bytes = 4 * kMiB;
  reject(o, "alignment");
  o = opts(64 * kMiB);
  o.numa_node = -2;
  reject(o, "numa_node");
  o.numa_node = 4096;
  const Error e = expect_error([&] { PinnedPool p(o); }, ErrorKind::kInvalidArgument);
  EXPECT_NE(e.message().find("numa_node"), std::string::npos) << e.message();
  EXPECT_NE(e.message().find("one of: 0"), std::string::npos) << e.message();

  PinnedPool ok(opts(64 * kMiB));
  expect_error([&] { (void)ok.allocate(0); }, ErrorKind::kInvalidArgument);
}

TEST(PinnedPool, BudgetIsEnforcedAndTheErrorNamesTheNumbers) {
  auto o = opts(8 * kMiB);
  o.chunk_bytes = 4 * kMiB;
  PinnedPool pool(o);
  PinnedBlock a = pool.allocate(6 * kMiB);
  const Error e = expect_error([&] { (void)pool.allocate(3 * kMiB + 5); }, ErrorKind::kOutOfMemory);
  const std::string msg = e.message();
  EXPECT_NE(msg.find(std::to_string(3 * kMiB + 5)), std::string::npos) << msg;  // requested
  EXPECT_NE(msg.find(std::to_string(6 * kMiB)), std::string::npos) << msg;      // reserved
  EXPECT_NE(msg.find(std::to_string(8 * kMiB)), std::string::npos) << msg;      // budget
  EXPECT_NE(msg.find("raise the pinned budget or free blocks"), std::string::npos) << msg;
  EXPECT_LE(pool.stats().reserved_bytes, o.budget_bytes);

  // More than the whole budget is refused outright.
  expect_error([&] { (void)pool.allocate(8 * kMiB + 1); }, ErrorKind::kOutOfMemory);

  // Freed space is reused, and an empty chunk is released when that is what makes room.
  a.reset();
  PinnedBlock b = pool.allocate(2 * kMiB);
  PinnedBlock c = pool.allocate(2 * kMiB);
  EXPECT_LE(pool.stats().reserved_bytes, o.budget_bytes);
  b.reset();
  c.reset();
  PinnedBlock d = pool.allocate(8 * kMiB);
  EXPECT_EQ(pool.stats().reserved_bytes, 8 * kMiB);
}

TEST(PinnedPool, AccountingIsExactThroughRandomAllocsAndFrees) {
  for (std::size_t alignment : {std::size_t(4096), std::size_t(65536)}) {
    auto o = opts(256 * kMiB);
    o.chunk_bytes = 16 * kMiB;
    o.alignment = alignment;
    PinnedPool pool(o);
    std::mt19937_64 rng(42 + alignment);
    std::uniform_int_distribution<std::size_t> size_dist(1, 3 * kMiB);
    std::vector<PinnedBlock> live;
    std::size_t requested = 0, allocated = 0;
    for (int step = 0; step < 600; ++step) {
      if (live.empty() || (live.size() < 60 && rng() % 3 != 0)) {
        const std::size_t n = size_dist(rng) | 1;  // odd sizes
        live.push_back(pool.allocate(n));
        ASSERT_EQ(live.back().size(), n);
        ASSERT_EQ(reinterpret_cast<std::uintptr_t>(live.back().data()) % alignment, 0u);
        requested += n;
        allocated += round_up(n, alignment);
      } else {
        const std::size_t i = rng() % live.size();
        requested -= live[i].size();
        allocated -= round_up(live[i].size(), alignment);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
      }
      const PinnedPoolStats s = pool.stats();
      ASSERT_EQ(s.requested_bytes, requested);
      ASSERT_EQ(s.allocated_bytes, allocated);
      ASSERT_EQ(s.num_blocks, live.size());
      ASSERT_GE(s.reserved_bytes, s.allocated_bytes);
      ASSERT_LE(s.reserved_bytes, o.budget_bytes);
      ASSERT_LE(s.reserved_bytes, s.peak_reserved_bytes);
      ASSERT_EQ(s.reserved_bytes % (2 * kMiB), 0u);
    }
    live.clear();
    const PinnedPoolStats s = pool.stats();
    EXPECT_EQ(s.requested_bytes, 0u);
    EXPECT_EQ(s.allocated_bytes, 0u);
    EXPECT_EQ(s.num_blocks, 0u);
  }
}

// Many staging buffers of odd sizes, allocated as a batch: the memory held stays within 5%
// of what was asked for.
void check_batch_overhead(std::size_t min_bytes, std::size_t max_bytes, int count, double limit) {
  auto o = opts(std::size_t(4) << 30);
  PinnedPool pool(o);
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<std::size_t> size_dist(min_bytes, max_bytes);
  std::vector<PinnedBlock> blocks;
  for (int i = 0; i < count; ++i) blocks.push_back(pool.allocate(size_dist(rng) | 1));
  const PinnedPoolStats s = pool.stats();
  std::printf(
      "batch of %d buffers %zu..%zu MiB: requested %.1f MiB, reserved %.1f MiB in %zu chunks, "
      "overhead %.2f%%\n",
      count, min_bytes / kMiB, max_bytes / kMiB, double(s.requested_bytes) / kMiB,
      double(s.reserved_bytes) / kMiB, s.num_chunks, 100 * s.overhead());
  EXPECT_LE(s.overhead(), limit);
  EXPECT_GE(s.overhead(), 0.0);

  // A second wave after freeing every other buffer reuses the freed ranges.
  for (std::size_t i = 0; i < blocks.size(); i += 2) blocks[i].reset();
  for (std::size_t i = 0; i < blocks.size(); i += 2) blocks[i] = pool.allocate(size_dist(rng) | 1);
  const PinnedPoolStats s2 = pool.stats();
  std::printf("  after a second wave: requested %.1f MiB, reserved %.1f MiB, overhead %.2f%%\n",
              double(s2.requested_bytes) / kMiB, double(s2.reserved_bytes) / kMiB,
              100 * s2.overhead());
  EXPECT_LE(s2.reserved_bytes, s.reserved_bytes + s2.requested_bytes / 5);
}

TEST(PinnedPool, OverheadOfABatchOfOddSizedBuffersIsAtMostFivePercent) {
  check_batch_overhead(1 * kMiB, 16 * kMiB, 64, 0.05);
  check_batch_overhead(1 * kMiB, 64 * kMiB, 32, 0.05);
}

TEST(PinnedPool, MemoryIsUsableAlignedAndBlocksDoNotOverlap) {
  for (std::size_t alignment : {std::size_t(4096), std::size_t(1) << 21}) {
    auto o = opts(128 * kMiB);
    o.alignment = alignment;
    o.chunk_bytes = 8 * kMiB;
    PinnedPool pool(o);
    std::mt19937_64 rng(3);
    std::vector<PinnedBlock> blocks;
    std::vector<std::uint64_t> seeds;
    for (std::size_t n : {std::size_t(1), std::size_t(4095), std::size_t(4097), 3 * kMiB + 17,
                          5 * kMiB, std::size_t(12345), 9 * kMiB + 1 /* larger than a chunk */}) {
      blocks.push_back(pool.allocate(n));
      ASSERT_EQ(reinterpret_cast<std::uintptr_t>(blocks.back().data()) % alignment, 0u);
      seeds.push_back(rng());
    }
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      std::mt19937_64 gen(seeds[i]);
      auto* p = static_cast<unsigned char*>(blocks[i].data());
      for (std::size_t j = 0; j < blocks[i].size(); ++j) p[j] = static_cast<unsigned char>(gen());
    }
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      std::mt19937_64 gen(seeds[i]);
      const auto* p = static_cast<const unsigned char*>(blocks[i].data());
      std::size_t bad = 0;
      for (std::size_t j = 0; j < blocks[i].size(); ++j)
        bad += p[j] != static_cast<unsigned char>(gen());
      EXPECT_EQ(bad, 0u) << "block " << i << " of " << blocks[i].size() << " bytes";
    }
  }
}

TEST(PinnedPool, HugePageRequestReportsWhatTheKernelGave) {
  PinnedPool pool(opts(64 * kMiB));
  PinnedBlock b = pool.allocate(8 * kMiB + 3);
  std::memset(b.data(), 0x5a, b.size());
  const std::size_t huge_free = proc_value("/proc/meminfo", "HugePages_Free");
  const std::size_t kernel_page = smaps_field(b.data(), "KernelPageSize");
  const std::size_t anon_huge = smaps_field(b.data(), "AnonHugePages");
  std::printf("huge-page request got %s (HugePages_Free %zu, THP %s, AnonHugePages %zu KiB)\n",
              page_kind_name(b.page_kind()), huge_free, thp_mode().c_str(), anon_huge / 1024);
  switch (b.page_kind()) {
    case PageKind::kHugeTlb:
      EXPECT_EQ(kernel_page, 2 * kMiB);
      break;
    case PageKind::kTransparentHuge:
      EXPECT_NE(thp_mode(), "never");
      EXPECT_GT(anon_huge, 0u);
      break;
    case PageKind::kNormal:
      EXPECT_EQ(anon_huge, 0u);
      EXPECT_EQ(kernel_page, 4096u);
      break;
  }
  // Without free hugetlbfs pages, MAP_HUGETLB cannot have succeeded.
  if (huge_free == 0) {
    EXPECT_NE(b.page_kind(), PageKind::kHugeTlb);
  }
  EXPECT_EQ(pool.stats().huge_chunks, b.page_kind() == PageKind::kNormal ? 0u : 1u);
}

TEST(PinnedPool, WithoutHugePagesTheKindIsNormal) {
  auto o = opts(64 * kMiB);
  o.huge_pages = false;
  PinnedPool pool(o);
  PinnedBlock b = pool.allocate(8 * kMiB);
  std::memset(b.data(), 1, b.size());
  EXPECT_EQ(b.page_kind(), PageKind::kNormal);
  EXPECT_EQ(smaps_field(b.data(), "AnonHugePages"), 0u);
  EXPECT_EQ(smaps_field(b.data(), "KernelPageSize"), 4096u);
  EXPECT_EQ(pool.stats().huge_chunks, 0u);
  // 4 KiB pages are faulted in through a pin (an io_uring buffer registration) that is dropped
  // at once: the pages are there, the process holds no pin.
  EXPECT_GE(smaps_field(b.data(), "Rss"), 8 * kMiB);
  std::ifstream status("/proc/self/status");
  std::size_t pinned_kb = SIZE_MAX;
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmPin:", 0) == 0) pinned_kb = std::stoul(line.substr(6));
  EXPECT_EQ(pinned_kb, 0u) << "a pin was left behind";
}

TEST(PinnedPool, LockStateIsReportedHonestly) {
  {
    auto o = opts(64 * kMiB);
    o.lock = false;
    PinnedPool pool(o);
    PinnedBlock b = pool.allocate(4 * kMiB);
    EXPECT_FALSE(b.pinned());
    EXPECT_EQ(pool.stats().locked_bytes, 0u);
    EXPECT_EQ(smaps_field(b.data(), "Locked"), 0u);
  }
  PinnedPool pool(opts(64 * kMiB));
  PinnedBlock b = pool.allocate(4 * kMiB + 1);
  const PinnedPoolStats s = pool.stats();
  if (b.pinned()) {
    EXPECT_EQ(s.locked_bytes, s.reserved_bytes);
    // smaps counts no "Locked" bytes for hugetlbfs pages (they are never swapped anyway): the
    // check applies to the other kinds (a machine with vm.nr_hugepages > 0 gives hugetlb ones).
    if (b.page_kind() != PageKind::kHugeTlb) {
      EXPECT_GE(smaps_field(b.data(), "Locked"), round_up(b.size(), 4096));
    }
  } else {
    EXPECT_EQ(s.locked_bytes, 0u);
    EXPECT_EQ(smaps_field(b.data(), "Locked"), 0u);
  }
}

TEST(PinnedPool, NumaBindingToAnExistingNodeWorks) {
  auto o = opts(32 * kMiB);
  o.numa_node = 0;
  PinnedPool pool(o);
  PinnedBlock b = pool.allocate(3 * kMiB);
  std::memset(b.data(), 7, b.size());
  EXPECT_EQ(static_cast<unsigned char*>(b.data())[b.size() - 1], 7);
}

// A device that registers every range it is given, to check what the pool registers.
class RecordingDevice final : public Device {
 public:
  DeviceKind kind() const override { return DeviceKind::kCuda; }
  std::string name() const override { return "recording"; }
  std::unique_ptr<Stream> create_stream(std::string) override { return nullptr; }
  DeviceStats stats() const override { return {}; }
  void reset_peak_stats() override {}
  void synchronize() override {}
  bool register_host(void* ptr, std::size_t bytes) override {
    std::lock_guard<std::mutex> lock(mu);
    const auto p = reinterpret_cast<std::uintptr_t>(ptr);
    EXPECT_EQ(p % 4096, 0u);
    EXPECT_EQ(bytes % 4096, 0u);
    for (const auto& [q, n] : ranges) {
      EXPECT_TRUE(p + bytes <= q || q + n <= p) << "overlapping registration";
    }
    ranges[p] = bytes;
    return true;
  }
  void unregister_host(void* ptr) override {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(ranges.erase(reinterpret_cast<std::uintptr_t>(ptr)), 1u) << "unregistering " << ptr;
  }
  // True when [p, p + n) lies inside one registered range.
  bool inside_one(const void* ptr, std::size_t n) {
    std::lock_guard<std::mutex> lock(mu);
    const auto p = reinterpret_cast<std::uintptr_t>(ptr);
    auto it = ranges.upper_bound(p);
    if (it == ranges.begin()) return false;
    --it;
    return p >= it->first && p + n <= it->first + it->second;
  }
  std::mutex mu;
  std::map<std::uintptr_t, std::size_t> ranges;

 protected:
  void* do_alloc(std::size_t, Stream*, void**) override { return nullptr; }
  void do_free(void*) noexcept override {}
};

TEST(PinnedPool, DeviceRegistrationCoversEveryBlockWithOneRange) {
  RecordingDevice dev;
  {
    auto o = opts(512 * kMiB);
    o.device = &dev;
    o.chunk_bytes = 32 * kMiB;
    PinnedPool pool(o);
    std::mt19937_64 rng(11);
    std::uniform_int_distribution<std::size_t> size_dist(1, 5 * kMiB);
    std::vector<PinnedBlock> live;
    for (int step = 0; step < 300; ++step) {
      if (live.empty() || rng() % 3 != 0) {
        live.push_back(pool.allocate(size_dist(rng)));
        ASSERT_TRUE(live.back().pinned());
        ASSERT_TRUE(dev.inside_one(live.back().data(), live.back().size()))
            << "block of " << live.back().size() << " bytes spans two registrations";
      } else {
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(rng() % live.size()));
      }
    }
    const PinnedPoolStats s = pool.stats();
    EXPECT_EQ(s.locked_bytes, s.reserved_bytes);
    std::size_t registered = 0;
    for (const auto& [p, n] : dev.ranges) registered += n;
    EXPECT_EQ(registered, s.reserved_bytes);
    live.clear();
    EXPECT_EQ(pool.trim(), s.reserved_bytes);
    EXPECT_TRUE(dev.ranges.empty());
  }
  EXPECT_TRUE(dev.ranges.empty());
}

// initial_bytes: the bytes a caller knows it will hold, committed and registered as one piece
// at the first allocation, so blocks placed in it leave no registered tail behind; grown piece
// by piece, the same blocks hold more. More than the budget is refused by name.
TEST(PinnedPool, InitialBytesAreOneRegistrationThatHoldsWhatIsAskedFor) {
  std::mt19937_64 rng(5);
  std::uniform_int_distribution<std::size_t> size_dist(kMiB / 2, 6 * kMiB);
  std::vector<std::size_t> sizes;
  std::size_t aligned = 0;
  for (int i = 0; i < 24; ++i) {
    sizes.push_back(size_dist(rng) | 1);
    aligned += (sizes.back() + 4095) / 4096 * 4096;
  }
  const std::size_t whole = (aligned + 2 * kMiB - 1) / (2 * kMiB) * (2 * kMiB);
  std::size_t grown = 0;
  for (const bool initial : {true, false}) {
    RecordingDevice dev;
    auto o = opts(std::size_t(1) << 30);
    o.device = &dev;
    o.initial_bytes = initial ? aligned : 0;
    PinnedPool pool(o);
    std::vector<PinnedBlock> blocks;
    for (std::size_t n : sizes) {
      blocks.push_back(pool.allocate(n));
      ASSERT_TRUE(dev.inside_one(blocks.back().data(), n));
    }
    const PinnedPoolStats st = pool.stats();
    if (initial) {
      EXPECT_EQ(st.reserved_bytes, whole);
      EXPECT_EQ(dev.ranges.size(), 1u);
    } else {
      grown = st.reserved_bytes;
    }
  }
  EXPECT_GT(grown, whole) << "grown piece by piece, the registered tails left nothing unused";
  auto o = opts(16 * kMiB);
  o.initial_bytes = 17 * kMiB;
  try {
    PinnedPool pool(o);
    FAIL() << "initial_bytes past the budget accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("initial_bytes"), std::string::npos) << e.what();
  }
}

// Registered ranges cannot merge, so each growth step may leave a tail under 2 MiB unused
// until a smaller request takes it: a batch still stays within 10%.
TEST(PinnedPool, OverheadWithDeviceRegistration) {
  RecordingDevice dev;
  auto o = opts(std::size_t(2) << 30);
  o.device = &dev;
  PinnedPool pool(o);
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<std::size_t> size_dist(kMiB, 16 * kMiB);
  std::vector<PinnedBlock> blocks;
  for (int i = 0; i < 64; ++i) blocks.push_back(pool.allocate(size_dist(rng) | 1));
  const PinnedPoolStats s = pool.stats();
  std::printf(
      "registered batch of 64 buffers 1..16 MiB: requested %.1f MiB, reserved %.1f MiB in %zu "
      "registrations, overhead %.2f%%\n",
      double(s.requested_bytes) / kMiB, double(s.reserved_bytes) / kMiB, dev.ranges.size(),
      100 * s.overhead());
  EXPECT_LE(s.overhead(), 0.10);
  for (const auto& b : blocks) EXPECT_TRUE(dev.inside_one(b.data(), b.size()));
}

TEST(PinnedPool, TwoThreadsAllocatingAndFreeing) {
  auto o = opts(256 * kMiB);
  o.chunk_bytes = 16 * kMiB;
  PinnedPool pool(o);
  auto worker = [&](std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::uniform_int_distribution<std::size_t> size_dist(1, 2 * kMiB);
    std::vector<std::pair<PinnedBlock, unsigned char>> live;
    for (int i = 0; i < 400; ++i) {
      if (live.size() < 8 && rng() % 2 == 0) {
        PinnedBlock b = pool.allocate(size_dist(rng));
        const auto tag = static_cast<unsigned char>(rng());
        std::memset(b.data(), tag, b.size());
        live.emplace_back(std::move(b), tag);
      } else if (!live.empty()) {
        auto& [b, tag] = live.back();
        const auto* p = static_cast<const unsigned char*>(b.data());
        EXPECT_EQ(p[0], tag);
        EXPECT_EQ(p[b.size() / 2], tag);
        EXPECT_EQ(p[b.size() - 1], tag);
        live.pop_back();
      }
    }
  };
  std::thread t1(worker, 1), t2(worker, 2);
  t1.join();
  t2.join();
  const PinnedPoolStats s = pool.stats();
  EXPECT_EQ(s.requested_bytes, 0u);
  EXPECT_EQ(s.allocated_bytes, 0u);
  EXPECT_EQ(s.num_blocks, 0u);
  EXPECT_LE(s.peak_reserved_bytes, o.budget_bytes);
}

TEST(PinnedPool, TrimReleasesEmptyChunksOnly) {
  auto o = opts(256 * kMiB);
  o.chunk_bytes = 8 * kMiB;
  PinnedPool pool(o);
  std::vector<PinnedBlock> blocks;
  for (int i = 0; i < 6; ++i) blocks.push_back(pool.allocate(5 * kMiB + 1));
  PinnedBlock keep = pool.allocate(kMiB);
  const PinnedPoolStats before = pool.stats();
  ASSERT_GE(before.num_chunks, 2u);
  blocks.clear();
  // Empty chunks are kept for reuse until trimmed.
  EXPECT_EQ(pool.stats().reserved_bytes, before.reserved_bytes);
  const std::size_t released = pool.trim();
  const PinnedPoolStats after = pool.stats();
  EXPECT_EQ(after.num_chunks, 1u);
  EXPECT_EQ(released, before.reserved_bytes - after.reserved_bytes);
  EXPECT_GT(released, 0u);
  EXPECT_EQ(after.requested_bytes, kMiB);
  keep.reset();
  EXPECT_EQ(pool.trim(), after.reserved_bytes);
  EXPECT_EQ(pool.stats().reserved_bytes, 0u);
  EXPECT_EQ(pool.stats().num_chunks, 0u);
  EXPECT_EQ(pool.stats().peak_reserved_bytes, before.reserved_bytes);
}

TEST(PinnedPool, BlocksMoveAndReset) {
  PinnedPool pool(opts(16 * kMiB));
  PinnedBlock a = pool.allocate(100);
  void* p = a.data();
  PinnedBlock b = std::move(a);
  EXPECT_FALSE(a);
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(b.data(), p);
  EXPECT_EQ(b.size(), 100u);
  EXPECT_EQ(pool.stats().num_blocks, 1u);
  b.reset();
  EXPECT_FALSE(b);
  EXPECT_EQ(pool.stats().num_blocks, 0u);
  b.reset();
  EXPECT_EQ(pool.stats().num_blocks, 0u);
}

TEST(PinnedPool, DestroyingThePoolBeforeItsBlocksLeaksInsteadOfCrashing) {
  PinnedBlock b;
  {
    PinnedPool pool(opts(16 * kMiB));
    b = pool.allocate(kMiB);
  }
  // The chunk was leaked, so the memory is still there to use and to give back.
  std::memset(b.data(), 3, b.size());
  EXPECT_EQ(static_cast<unsigned char*>(b.data())[kMiB - 1], 3);
  b.reset();
}

}  // namespace
}  // namespace strata
