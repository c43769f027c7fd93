// Core: errors, dtype conversions, logging levels, the tracer, the allocators' placement rule, the
// tables signal handlers read.
#include <fcntl.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "core/interrupt_files.h"
#include "core/range_pool.h"
#include "core/signal_slots.h"
#include "core/utf8.h"
#include "strata/dtype.h"
#include "strata/error.h"
#include "strata/log.h"
#include "strata/trace.h"
#include "test_util.h"

namespace strata {
namespace {

TEST(Error, CarriesKindCallFileLineAndFix) {
  try {
    const int n = 0;
    STRATA_REQUIRE(n > 0, "n must be positive, got {}; pass --n 1 or more", n);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_EQ(e.call(), "n > 0");
    EXPECT_GT(e.line(), 0);
    const std::string what = e.what();
    EXPECT_NE(what.find("n must be positive, got 0"), std::string::npos) << what;
    EXPECT_NE(what.find("core_test.cpp:"), std::string::npos) << what;
    // What a tool prints: the message and the fix, no source location.
    EXPECT_EQ(e.user_message(), "invalid argument: n must be positive, got 0; pass --n 1 or more");
  }
  try {
    STRATA_CHECK(1 + 1 == 3, "arithmetic");
  } catch (const Error& e) {
    EXPECT_NE(e.user_message().find("core_test.cpp:"), std::string::npos)
        << "a bug report needs the place";
  }
}

TEST(Error, ErrnoTextIncluded) {
  try {
    STRATA_CHECK_ERRNO(::open("/nonexistent/strata", 0), "opening {}", "/nonexistent/strata");
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kIo);
    EXPECT_NE(e.detail().find("errno 2"), std::string::npos) << e.detail();
    EXPECT_NE(std::string(e.what()).find("No such file"), std::string::npos) << e.what();
  }
}

TEST(DType, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::kF32), 4u);
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(parse_dtype("bfloat16"), DType::kBF16);
  EXPECT_EQ(dtype_name(parse_dtype("fp16")), "fp16");
  try {
    parse_dtype("int7");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fp32, bf16, fp16"), std::string::npos);
  }
}

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  // 1 + 2^-8 is exactly half way between 1 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(f32_to_bf16(1.0f + 0.00390625f), 0x3f80);
  // 1 + 3*2^-8 is half way between 1+2^-7 (odd) and 1+2^-6: ties to even (up).
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * 0.00390625f), 0x3f82);
  EXPECT_EQ(f32_to_bf16(std::nextafter(1.0f + 0.00390625f, 2.0f)), 0x3f81);  // just above half: up
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::nanf("")))));
  EXPECT_EQ(f32_to_bf16(INFINITY), 0x7f80);
  EXPECT_EQ(f32_to_bf16(3.4e38f), 0x7f80);  // rounds up to Inf
}

TEST(DType, F16AllValuesRoundTrip) {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const float f = f16_to_f32(static_cast<std::uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(f)))) << h;
      continue;
    }
    EXPECT_EQ(f32_to_f16(f), h) << "half 0x" << std::hex << h;
  }
}

TEST(DType, F16RoundingMatchesDoubleReference) {
  // Midpoints between consecutive halves round to the even one; values beyond max -> Inf.
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65519.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);
  EXPECT_EQ(f32_to_f16(5.9604645e-08f), 0x0001);  // smallest subnormal
  EXPECT_EQ(f32_to_f16(2.9802322e-08f), 0x0000);  // half of it: ties to even (0)
  EXPECT_EQ(f32_to_f16(8.940697e-08f), 0x0002);   // 1.5 ulp: ties to even (2)
  EXPECT_EQ(f32_to_f16(-1.0f), 0xbc00);
  EXPECT_EQ(f32_to_f16(1.0f + 0.00048828125f), 0x3c00);      // tie -> even
  EXPECT_EQ(f32_to_f16(1.0f + 3 * 0.00048828125f), 0x3c02);  // tie -> even (up)
}

TEST(Log, HumanBytes) {
  EXPECT_EQ(log::human_bytes(512), "512 B");
  EXPECT_EQ(log::human_bytes(1536), "1.50 KiB");
  EXPECT_EQ(log::human_bytes(double(std::uint64_t(4) << 30)), "4.00 GiB");
  EXPECT_EQ(log::human_bytes(double(20 << 20), 1), "20.0 MiB");
  EXPECT_EQ(log::human_bytes(double(std::uint64_t(4) << 30), -2), "4 GiB");
  EXPECT_EQ(log::human_bytes(1.5 * (1 << 20), -2), "1.5 MiB");
  EXPECT_EQ(log::human_bytes(61.44 * (1 << 20), -2), "61.44 MiB");
}

TEST(Log, ParsesLevels) {
  EXPECT_EQ(log::parse_level("debug"), log::Level::kDebug);
  EXPECT_EQ(log::parse_level("off"), log::Level::kOff);
  EXPECT_THROW(log::parse_level("loud"), Error);
  const log::Level before = log::level();
  log::set_level(log::Level::kError);
  EXPECT_EQ(log::level(), log::Level::kError);
  log::set_level(before);
}

TEST(Tracer, DisabledRecordsNothing) {
  Tracer& t = Tracer::global();
  t.set_enabled(false);
  t.clear();
  t.record("x", "lane", 1, 2, 3);
  { TraceScope s("y", "lane"); }
  EXPECT_TRUE(t.spans().empty());
}

TEST(Tracer, RecordsFromManyThreadsAndWritesChromeJson) {
  Tracer& t = Tracer::global();
  t.clear();
  t.set_enabled(true);
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([i] {
      for (int j = 0; j < 100; ++j) {
        TraceScope s("op \"quoted\"", i % 2 ? "copy" : "compute", 4096);
      }
    });
  }
  for (auto& th : threads) th.join();
  t.set_enabled(false);
  const auto spans = t.spans();
  ASSERT_EQ(spans.size(), 400u);
  for (std::size_t i = 1; i < spans.size(); ++i)
    EXPECT_LE(spans[i - 1].start_ns, spans[i].start_ns);
  for (const auto& s : spans) {
    EXPECT_LE(s.start_ns, s.end_ns);
    EXPECT_EQ(s.bytes, 4096u);
  }

  const auto path = std::filesystem::temp_directory_path() / "strata_core_test_trace.json";
  t.write_chrome_trace(path.string());
  std::ifstream in(path);
  const nlohmann::json j = nlohmann::json::parse(in);
  int x = 0, meta = 0;
  std::set<std::string> lanes;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] == "X") {
      ++x;
      EXPECT_EQ(e["name"], "op \"quoted\"");
      EXPECT_EQ(e["args"]["bytes"], 4096);
    } else if (e["ph"] == "M") {
      ++meta;
      lanes.insert(e["args"]["name"].get<std::string>());
    }
  }
  EXPECT_EQ(x, 400);
  EXPECT_EQ(meta, 2);
  EXPECT_EQ(lanes, (std::set<std::string>{"compute", "copy"}));
  std::filesystem::remove(path);
  t.clear();
}

// Span and lane names are bytes from anywhere: invalid UTF-8 becomes U+FFFD so the trace stays
// JSON; valid multi-byte sequences pass through unchanged.
TEST(Tracer, InvalidUtf8InNamesStillWritesValidJson) {
  Tracer& t = Tracer::global();
  t.clear();
  t.set_enabled(true);
  const std::string valid = "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80";  // café € 😀
  const std::string invalid[] = {
      "a\xff"
      "b",
      "\xc3",
      "x\xe2\x82",
      "\xc0\xaf",
      "\xed\xa0\x80",
      "\xf4\x90\x80\x80",
      "\x80z"};
  t.record(valid, "lane \xfe", 1, 2, 0);
  for (const auto& n : invalid) t.record(n, "lane", 3, 4, 0);
  t.set_enabled(false);
  const auto path = std::filesystem::temp_directory_path() / "strata_core_test_trace_utf8.json";
  t.write_chrome_trace(path.string());
  std::ifstream in(path);
  nlohmann::json j;
  ASSERT_NO_THROW(j = nlohmann::json::parse(in)) << "the trace is not valid JSON";
  std::set<std::string> names, lanes;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] == "X")
      names.insert(e["name"].get<std::string>());
    else
      lanes.insert(e["args"]["name"].get<std::string>());
  }
  const std::string r = "\xef\xbf\xbd";  // U+FFFD
  EXPECT_EQ(names, (std::set<std::string>{valid, "a" + r + "b", r, "x" + r, r + r, r + r + r,
                                          r + r + r + r, r + "z"}));
  EXPECT_EQ(lanes, (std::set<std::string>{"lane " + r, "lane"}));
  std::filesystem::remove(path);
  t.clear();
}

// One step of a longer recording: the spans that overlap the window, cut to it (work begun
// before the step or still running after it shows for its part inside); the rest left out.
TEST(Tracer, WritesTheSpansOfAWindowCutToIt) {
  Tracer& t = Tracer::global();
  t.clear();
  t.set_enabled(true);
  t.record("before", "a", 100, 200);  // ends where the window starts: out
  t.record("across_start", "a", 150, 1300);
  t.record("inside", "b", 1100, 1200, 7);
  t.record("instant", "b", 1500, 1500);
  t.record("across_end", "a", 1900, 2600);
  t.record("after", "b", 2000, 2100);  // starts where the window ends: out
  t.record("around", "c", 500, 3000);
  t.set_enabled(false);
  const auto path = std::filesystem::temp_directory_path() / "strata_core_test_trace_window.json";
  t.write_chrome_trace(path.string(), 1000, 2000);
  std::ifstream in(path);
  const nlohmann::json j = nlohmann::json::parse(in);
  std::map<std::string, std::pair<double, double>> got;  // name: ts, dur (us)
  std::set<std::string> lanes;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] == "X")
      got[e["name"].get<std::string>()] = {e["ts"].get<double>(), e["dur"].get<double>()};
    else
      lanes.insert(e["args"]["name"].get<std::string>());
  }
  using P = std::pair<double, double>;
  EXPECT_EQ(got, (std::map<std::string, P>{{"across_start", P{1.0, 0.3}},
                                           {"inside", P{1.1, 0.1}},
                                           {"instant", P{1.5, 0.0}},
                                           {"across_end", P{1.9, 0.1}},
                                           {"around", P{1.0, 1.0}}}));
  EXPECT_EQ(lanes, (std::set<std::string>{"a", "b", "c"}));
  // The whole recording is still there, uncut.
  t.write_chrome_trace(path.string());
  std::ifstream all(path);
  const nlohmann::json whole = nlohmann::json::parse(all);
  int x = 0;
  for (const auto& e : whole["traceEvents"]) x += e["ph"] == "X";
  EXPECT_EQ(x, 7);
  std::filesystem::remove(path);
  t.clear();
}

TEST(Tracer, UnwritablePathIsAClearError) {
  try {
    Tracer::global().write_chrome_trace("/nonexistent-dir/trace.json");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kIo);
    EXPECT_NE(std::string(e.what()).find("/nonexistent-dir/trace.json"), std::string::npos);
  }
}

// The placement rule both devices' allocators use (core/range_pool.h).
TEST(RangePool, LargeBlocksGoBestFitAndSplit) {
  detail::RangePool pool(/*small_limit=*/1024);
  const std::size_t base = pool.add_segment(100000);
  const std::size_t a = pool.alloc(10000), b = pool.alloc(30000), c = pool.alloc(5000),
                    d = pool.alloc(20000);
  EXPECT_EQ(a, base);
  EXPECT_EQ(b, a + 10000);
  pool.free(a, 10000);  // a hole of 10000 at the bottom, 35000 at the top
  pool.free(c, 5000);   // and one of 5000 between b and d
  EXPECT_EQ(pool.free_ranges(), 3u);
  // The smallest range that fits, split: 4000 goes into the 5000 hole, not the bottom one.
  const std::size_t e = pool.alloc(4000);
  EXPECT_EQ(e, c);
  EXPECT_EQ(pool.largest_free(), 35000u);
  // The 1000 the split left is too small for 2000: the next smallest, the bottom hole, takes it.
  EXPECT_EQ(pool.alloc(2000), a);
  EXPECT_EQ(pool.free_bytes(), 100000u - 30000 - 20000 - 4000 - 2000);
  (void)d;
}

TEST(RangePool, FreedNeighboursCoalesceAndSmallBlocksComeFromTheTop) {
  detail::RangePool pool(/*small_limit=*/1000);
  const std::size_t base = pool.add_segment(10000);
  const std::size_t s1 = pool.alloc(100), s2 = pool.alloc(100);
  EXPECT_EQ(s1, base + 9900);  // small: carved from the top
  EXPECT_EQ(s2, base + 9800);
  const std::size_t l1 = pool.alloc(3000), l2 = pool.alloc(3000);
  EXPECT_EQ(l1, base);  // large: from the bottom
  EXPECT_EQ(l2, base + 3000);
  pool.free(l1, 3000);
  pool.free(l2, 3000);  // merges with l1's range and the free middle
  EXPECT_EQ(pool.free_ranges(), 1u);
  EXPECT_EQ(pool.largest_free(), 9800u);
  pool.free(s2, 100);
  pool.free(s1, 100);
  EXPECT_EQ(pool.free_ranges(), 1u);
  EXPECT_EQ(pool.largest_free(), 10000u);
  EXPECT_EQ(pool.free_bytes(), 10000u);
  EXPECT_EQ(pool.alloc(10000), base);  // whole again
}

TEST(RangePool, SegmentsNeverMergeAndWhollyFreeOnesAreTakenBack) {
  detail::RangePool pool(/*small_limit=*/1);
  const std::size_t a = pool.add_segment(4096), b = pool.add_segment(4096);
  EXPECT_GT(b, a + 4096);  // a gap: their memory is not contiguous
  EXPECT_EQ(pool.free_bytes(), 8192u);
  EXPECT_EQ(pool.largest_free(), 4096u);
  EXPECT_EQ(pool.alloc(8192), detail::RangePool::kNone);  // two free segments are not one range
  const std::size_t x = pool.alloc(4096);
  EXPECT_EQ(pool.segment_of(x + 100), (std::pair<std::size_t, std::size_t>{x, 4096}));
  const auto freed = pool.take_free_segments();  // only the other one is wholly free
  ASSERT_EQ(freed.size(), 1u);
  EXPECT_NE(freed[0].first, x);
  EXPECT_EQ(pool.segments(), 1u);
  EXPECT_EQ(pool.free_bytes(), 0u);
  pool.free(x, 4096);
  EXPECT_EQ(pool.take_free_segments().size(), 1u);
  EXPECT_EQ(pool.segments(), 0u);
  EXPECT_EQ(pool.alloc(1), detail::RangePool::kNone);
}

// The table a signal handler reads: each publish takes its own slot until none is left; a path too
// long for a slot is refused (a file to unlink) or cut (one only shown); a freed slot is taken
// again; find names a slot by its range's start.
TEST(SignalSlots, PublishesUntilFullAndRefusesOrCutsLongPaths) {
  auto slots = std::make_unique<core::SignalSlots<4, 8>>();
  std::vector<int> taken;
  std::vector<std::thread> threads;
  std::mutex mu;
  for (int i = 0; i < 4; ++i)
    threads.emplace_back([&, i] {
      const int slot =
          slots->publish("f" + std::to_string(i),
                         {std::uintptr_t(100 * (i + 1)), std::uintptr_t(100 * (i + 1) + 50)});
      std::lock_guard<std::mutex> lock(mu);
      taken.push_back(slot);
    });
  for (auto& t : threads) t.join();
  std::sort(taken.begin(), taken.end());
  EXPECT_EQ(taken, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(slots->publish("late"), -1);  // full
  std::set<std::string> seen;
  slots->for_each_published([&](const char* path, auto range) {
    seen.insert(path);
    EXPECT_EQ(range.end - range.begin, 50u);
    return true;
  });
  EXPECT_EQ(seen, (std::set<std::string>{"f0", "f1", "f2", "f3"}));
  const int at300 = slots->find(300);
  ASSERT_GE(at300, 0);
  EXPECT_EQ(slots->find(301), -1);
  slots->unpublish(at300);
  EXPECT_EQ(slots->find(300), -1);
  EXPECT_EQ(slots->publish("12345678"), -1);  // 8 bytes and its NUL do not fit
  const int cut = slots->publish("12345678", {}, /*cut_long=*/true);
  EXPECT_EQ(cut, at300);  // the freed slot
  int visited = 0;
  std::string cut_path;
  slots->for_each_published([&](const char* path, auto) {
    ++visited;
    if (std::strlen(path) == 7) cut_path = path;
    return false;  // stops at the first
  });
  EXPECT_EQ(visited, 1);
  slots->for_each_published([&](const char* path, auto) {
    if (std::string(path).size() == 7) cut_path = path;
    return true;
  });
  EXPECT_EQ(cut_path, "1234567");
  slots->unpublish(-1);  // nothing
  slots->unpublish(4);   // out of range: nothing
}

// A registered file goes when the process is interrupted (what the signal handler calls); a
// forgotten one stays.
TEST(InterruptFiles, RegisteredFilesAreRemovedAndForgottenOnesKept) {
  const testing::TempDir dir;
  const std::string kept = dir.path + "/kept.tmp", gone = dir.path + "/gone.tmp";
  std::ofstream(kept) << "k";
  std::ofstream(gone) << "g";
  const int k = core::remove_file_on_interrupt(kept), g = core::remove_file_on_interrupt(gone);
  ASSERT_GE(k, 0);
  ASSERT_GE(g, 0);
  EXPECT_NE(k, g);
  core::forget_interrupt_file(k);
  core::remove_interrupt_files();
  core::forget_interrupt_file(g);
  EXPECT_TRUE(std::filesystem::exists(kept));
  EXPECT_FALSE(std::filesystem::exists(gone));
  EXPECT_EQ(core::remove_file_on_interrupt(std::string(5000, 'x')), -1);  // too long to unlink
}

// A name cut to fit a file name's length ends on a character's edge.
TEST(Utf8, PrefixEndsOnACharactersEdge) {
  EXPECT_EQ(utf8::prefix("abcdef", 4), "abcd");
  EXPECT_EQ(utf8::prefix("abc", 64), "abc");
  EXPECT_EQ(utf8::prefix("ab\xc3\xa9z", 3), "ab");  // é is two bytes: not cut in half
  EXPECT_EQ(utf8::prefix("ab\xc3\xa9z", 4), "ab\xc3\xa9");
  EXPECT_EQ(utf8::prefix("a\xff"
                         "b",
                         2),
            "a\xff");  // an ill-formed byte counts as one
  EXPECT_EQ(utf8::prefix("", 4), "");
}

}  // namespace
}  // namespace strata
