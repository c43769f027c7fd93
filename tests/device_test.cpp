// The differential device suite: the same checks on every Device backend, each kernel
// against a double-precision CPU reference on random (never zero) inputs at odd shapes.
// Built twice: device_test (the CPU-emulated device, plain and with random delays) and
// device_gpu_test (-DSTRATA_TEST_CUDA, label gpu: skipped where no GPU is usable).
#include "strata/device.h"

#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <future>
#include <limits>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include "cpu/cpu_kernels.h"
#include "cpu/gemm_path.h"
#include "strata/adamw.h"
#include "strata/error.h"
#include "strata/trace.h"

namespace strata {
namespace {

using namespace std::chrono_literals;

struct Backend {
  std::string name;
  bool cuda;
  std::function<std::unique_ptr<Device>(std::size_t cap)> make;
};

std::vector<Backend> backends() {
#ifdef STRATA_TEST_CUDA
  return {{"cuda", true, [](std::size_t cap) {
             CudaDeviceOptions o;
             o.capacity_bytes = cap;
             return make_cuda_device(o);
           }}};
#else
  return {{"cpu", false,
           [](std::size_t cap) {
             HostDeviceOptions o;
             o.capacity_bytes = cap;
             return make_host_device(o);
           }},
          {"cpu_random_delay", false, [](std::size_t cap) {
             HostDeviceOptions o;
             o.capacity_bytes = cap;
             o.random_delay_us = 300;
             o.seed = 42;
             return make_host_device(o);
           }}};
#endif
}

void PrintTo(const Backend& b, std::ostream* os) { *os << b.name; }

constexpr std::size_t kDefaultCap = std::size_t(256) << 20;

class DeviceTest : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    if (GetParam().cuda) {
      const CudaProbe p = probe_cuda();
      if (p.device_count == 0) GTEST_SKIP() << "no usable GPU: " << p.reason;
    }
    dev = GetParam().make(kDefaultCap);
    s = dev->create_stream("main");
  }
  void TearDown() override {
    if (s) s->synchronize();
  }

  std::vector<float> random_floats(std::size_t n, std::uint64_t seed, float lo = -2, float hi = 2) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> d(lo, hi);
    std::vector<float> v(n);
    for (auto& x : v) {
      do x = d(rng);
      while (std::fabs(x) < 1e-3f);  // never zero
    }
    return v;
  }

  // Host floats -> device tensor of `t` (rounded with strata's scalar conversions).
  Buffer upload(const std::vector<float>& v, DType t) {
    std::vector<std::uint8_t> bytes(v.size() * dtype_size(t));
    for (std::size_t i = 0; i < v.size(); ++i) store_host(t, bytes.data(), i, v[i]);
    Buffer b = dev->alloc(bytes.size(), s.get());
    s->copy(b.ref(), host_ref(bytes.data(), bytes.size()));
    s->synchronize();
    return b;
  }

  std::vector<double> download(const Buffer& b, DType t, std::size_t n) {
    std::vector<std::uint8_t> bytes(n * dtype_size(t));
    s->copy(host_ref(bytes.data(), bytes.size()), b.ref(0, bytes.size()));
    s->synchronize();
    std::vector<double> out(n);
    for (std::size_t i = 0; i < n; ++i) out[i] = load_host(t, bytes.data(), i);
    return out;
  }

  static void store_host(DType t, void* p, std::size_t i, float v) {
    switch (t) {
      case DType::kF32:
        static_cast<float*>(p)[i] = v;
        break;
      case DType::kBF16:
        static_cast<std::uint16_t*>(p)[i] = f32_to_bf16(v);
        break;
      case DType::kF16:
        static_cast<std::uint16_t*>(p)[i] = f32_to_f16(v);
        break;
      case DType::kF64:
        static_cast<double*>(p)[i] = v;
        break;
    }
  }
  static double load_host(DType t, const void* p, std::size_t i) {
    switch (t) {
      case DType::kF32:
        return static_cast<const float*>(p)[i];
      case DType::kBF16:
        return bf16_to_f32(static_cast<const std::uint16_t*>(p)[i]);
      case DType::kF16:
        return f16_to_f32(static_cast<const std::uint16_t*>(p)[i]);
      case DType::kF64:
        return static_cast<const double*>(p)[i];
    }
    return 0;
  }
  // Value as the device sees it after upload (rounded to t).
  static double as_stored(DType t, float v) {
    std::uint8_t tmp[8];
    store_host(t, tmp, 0, v);
    return load_host(t, tmp, 0);
  }
  // Relative step of t: results stored as t may differ by one rounding.
  static double eps(DType t) {
    switch (t) {
      case DType::kBF16:
        return 1.0 / 128;
      case DType::kF16:
        return 1.0 / 1024;
      default:
        return 1e-6;
    }
  }

  std::unique_ptr<Device> dev;
  std::unique_ptr<Stream> s;
};

// ---- memory ----

TEST_P(DeviceTest, AllocFreeAndStatsAreExact) {
  const DeviceStats before = dev->stats();
  {
    std::vector<Buffer> bufs;
    for (std::size_t sz : {1u, 255u, 257u, 4097u, 1000003u})
      bufs.push_back(dev->alloc(sz, s.get()));
    for (const auto& b : bufs) {
      EXPECT_NE(b.data(), nullptr);
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b.data()) % 256, 0u);
    }
    const DeviceStats mid = dev->stats();
    EXPECT_GE(mid.bytes_in_use - before.bytes_in_use, 1u + 255 + 257 + 4097 + 1000003);
    EXPECT_EQ(mid.num_allocs - before.num_allocs, 5u);
    EXPECT_GE(mid.peak_bytes_in_use, mid.bytes_in_use);
  }
  s->synchronize();  // frees are ordered on the stream
  const DeviceStats after = dev->stats();
  EXPECT_EQ(after.bytes_in_use, before.bytes_in_use);
  EXPECT_EQ(after.num_frees - before.num_frees, 5u);
}

// A buffer freed on a stream is in use until the stream's work reaches the free (the GPU may
// still read it): the memory plan bounds that, on every backend alike.
TEST_P(DeviceTest, AFreeQueuedBehindWorkCountsUntilTheStreamReachesIt) {
  s->synchronize();
  const DeviceStats before = dev->stats();
  std::atomic<bool> go{false};
  {
    Buffer b = dev->alloc(1 << 20, s.get());
    s->host_fn(
        [&go] {
          while (!go.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        },
        "hold");
  }  // freed on s, behind the hold
  EXPECT_GE(dev->stats().bytes_in_use, before.bytes_in_use + (1u << 20))
      << "a free the stream has not reached no longer counts";
  go = true;
  s->synchronize();
  EXPECT_EQ(dev->stats().bytes_in_use, before.bytes_in_use);
}

// The peak restarts from what is in use: what came before no longer counts, what stays does.
TEST_P(DeviceTest, PeakRestartsFromTheBytesInUse) {
  Buffer keep = dev->alloc(1 << 20, s.get());
  { Buffer big = dev->alloc(8 << 20, s.get()); }
  s->synchronize();
  const DeviceStats before = dev->stats();
  EXPECT_GE(before.peak_bytes_in_use, before.bytes_in_use + (8u << 20));
  dev->reset_peak_stats();
  EXPECT_EQ(dev->stats().peak_bytes_in_use, before.bytes_in_use);
  {
    Buffer small = dev->alloc(2 << 20, s.get());
    EXPECT_EQ(dev->stats().peak_bytes_in_use, dev->stats().bytes_in_use);
  }
  s->synchronize();
  const DeviceStats after = dev->stats();
  EXPECT_GE(after.peak_bytes_in_use, before.bytes_in_use + (2u << 20));
  EXPECT_LT(after.peak_bytes_in_use, before.bytes_in_use + (8u << 20));
}

TEST_P(DeviceTest, OverBudgetNamesRequestedInUseAndCap) {
  auto small = GetParam().make(std::size_t(1) << 20);
  Buffer keep = small->alloc(576 * 1024);  // a multiple of 64 KiB: no allocator rounds it
  try {
    small->alloc(512 * 1024);
    FAIL() << "allocation beyond the cap succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kOutOfMemory);
    const std::string w = e.what();
    EXPECT_NE(w.find("524288"), std::string::npos) << w;   // requested
    EXPECT_NE(w.find("589824"), std::string::npos) << w;   // in use
    EXPECT_NE(w.find("1048576"), std::string::npos) << w;  // cap
  }
  EXPECT_EQ(small->stats().num_alloc_failures, 1u);
  EXPECT_LE(small->stats().peak_bytes_in_use, std::size_t(1) << 20);
}

TEST_P(DeviceTest, BadSizesAreClearErrors) {
  EXPECT_THROW(
      {
        try {
          dev->alloc(0);
        } catch (const Error& e) {
          EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
          EXPECT_NE(std::string(e.what()).find("0 bytes"), std::string::npos);
          throw;
        }
      },
      Error);
  // A negative size that reached a size_t is enormous: refused as over budget, no crash.
  const long negative = -5;
  EXPECT_THROW(dev->alloc(static_cast<std::size_t>(negative)), Error);
  Buffer b = dev->alloc(64, s.get());
  EXPECT_THROW(b.ref(32, 64), Error);
  EXPECT_THROW(tensor(b, DType::kF32, 17), Error);
  Buffer c = dev->alloc(64, s.get());
  MatmulDesc d;
  d.m = -1;
  d.n = 2;
  d.k = 2;
  d.a = tensor(b, DType::kF32, 4);
  d.b = tensor(b, DType::kF32, 4);
  d.c = tensor(c, DType::kF32, 4);
  EXPECT_THROW(s->matmul(d), Error);
}

TEST_P(DeviceTest, CopiesOfRandomDataAtOddSizesRoundTrip) {
  std::mt19937_64 rng(7);
  for (std::size_t n : {1u, 3u, 17u, 4093u, (1u << 20) + 13u}) {
    std::vector<std::uint8_t> src(n), dst(n, 0);
    for (auto& x : src) x = static_cast<std::uint8_t>(rng());
    Buffer a = dev->alloc(n + 5, s.get());
    Buffer b = dev->alloc(n + 11, s.get());
    s->copy(a.ref(5, n), host_ref(src.data(), n));   // H2D at an odd offset
    s->copy(b.ref(11, n), a.ref(5, n));              // D2D between odd offsets
    s->copy(host_ref(dst.data(), n), b.ref(11, n));  // D2H
    s->synchronize();
    EXPECT_EQ(std::memcmp(src.data(), dst.data(), n), 0) << "size " << n;
  }
}

TEST_P(DeviceTest, CopyBetweenMismatchedSizesIsRejected) {
  Buffer a = dev->alloc(100, s.get());
  std::vector<std::uint8_t> h(99);
  try {
    s->copy(host_ref(h.data(), h.size()), a.ref());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("mismatched sizes"), std::string::npos) << e.what();
  }
}

TEST_P(DeviceTest, KernelOnHostMemoryIsRejected) {
  std::vector<float> h(16, 1.0f);
  TensorRef t{host_ref(h.data(), h.size() * 4), DType::kF32, h.size()};
  try {
    s->fill(t, 2.0f);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not in this device's memory"), std::string::npos);
  }
  EXPECT_EQ(h[0], 1.0f);
}

// ---- asynchrony and ordering ----

TEST_P(DeviceTest, WorkIsAsynchronous) {
  std::promise<void> gate;
  auto opened = gate.get_future().share();
  s->host_fn([opened] { opened.wait(); });
  const Event e = s->record();
  EXPECT_FALSE(e.query()) << "the stream ran ahead of a blocked host function: not asynchronous";
  gate.set_value();
  e.synchronize();
  EXPECT_TRUE(e.query());
}

// Writes 3.0 on stream `a` once a gate opens, then reads on stream `b`, with or without
// waiting on an event. Without the wait the read is made to happen first (deterministic:
// the gate opens only after the consumer finished), which a correct device must expose.
std::vector<double> race(Device& dev, bool with_wait) {
  auto a = dev.create_stream("producer");
  auto b = dev.create_stream("consumer");
  const std::size_t n = 4097;
  Buffer buf = dev.alloc(n * 4, a.get());
  a->fill(tensor(buf, DType::kF32), 1.0f);
  a->synchronize();
  std::promise<void> gate;
  auto opened = gate.get_future().share();
  a->host_fn([opened] { opened.wait(); });
  a->fill(tensor(buf, DType::kF32), 3.0f);
  const Event done = a->record();
  if (with_wait) b->wait(done);
  std::vector<float> h(n, 0.0f);
  b->copy(host_ref(h.data(), n * 4), buf.ref());
  if (with_wait) {
    std::this_thread::sleep_for(5ms);  // give a broken device the chance to run ahead
    gate.set_value();
    b->synchronize();
  } else {
    b->synchronize();
    gate.set_value();
  }
  a->synchronize();
  return std::vector<double>(h.begin(), h.end());
}

TEST_P(DeviceTest, CrossStreamOrderingWithEvents) {
  const auto seen = race(*dev, true);
  for (double v : seen) ASSERT_EQ(v, 3.0);
}

TEST_P(DeviceTest, MissingWaitIsObservable) {
  // The negative control: without the event the consumer reads before the producer wrote.
  // If this ever passes with all 3.0, the device is not really asynchronous.
  const auto seen = race(*dev, false);
  std::size_t threes = 0;
  for (double v : seen) threes += v == 3.0;
  EXPECT_EQ(threes, 0u) << "the consumer saw the producer's write without waiting for it";
}

TEST_P(DeviceTest, WaitOnEventOfDestroyedStreamIsAnError) {
  Event e;
  {
    auto gone = dev->create_stream("short-lived");
    Buffer b = dev->alloc(64, gone.get());
    gone->fill(tensor(b, DType::kF32), 1.0f);
    e = gone->record();
  }
  EXPECT_TRUE(e.query());  // the stream drained when destroyed
  try {
    s->wait(e);
    FAIL();
  } catch (const Error& err) {
    EXPECT_EQ(err.kind(), ErrorKind::kInvalidArgument);
    const std::string w = err.what();
    EXPECT_NE(w.find("short-lived"), std::string::npos) << w;
    EXPECT_NE(w.find("destroyed"), std::string::npos) << w;
  }
  EXPECT_THROW(s->wait(Event{}), Error);
}

TEST_P(DeviceTest, FreeIsOrderedOnItsStream) {
  const std::size_t n = 1024;
  Buffer buf = dev->alloc(n * 4, s.get());
  s->fill(tensor(buf, DType::kF32), 5.0f);
  s->host_fn([] { std::this_thread::sleep_for(20ms); });
  std::vector<float> h(n, 0.0f);
  s->copy(host_ref(h.data(), n * 4), buf.ref());
  buf.reset();  // queued after the copy: the copy still sees the data
  s->synchronize();
  for (float v : h) ASSERT_EQ(v, 5.0f);
}

TEST_P(DeviceTest, FailureInQueuedWorkSurfacesAtSynchronize) {
  s->host_fn([] { throw std::runtime_error("boom in host_fn"); });
  try {
    s->synchronize();
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("boom"), std::string::npos);
  }
  s->synchronize();  // reported once
}

// Device::synchronize waits for every stream, a failed one's neighbours too, before it rethrows:
// a caller that catches and frees must not free what another stream still uses. (It returned
// at the first failed stream.)
TEST_P(DeviceTest, DeviceSynchronizeDrainsEveryStreamBeforeItRethrows) {
  auto other = dev->create_stream("other");
  std::atomic<bool> done{false};
  other->host_fn([&] {
    std::this_thread::sleep_for(300ms);
    done = true;
  });
  s->host_fn([] { throw std::runtime_error("boom in host_fn"); });
  EXPECT_THROW(dev->synchronize(), std::runtime_error);
  EXPECT_TRUE(done.load()) << "synchronize() returned while another stream still ran";
  dev->synchronize();  // reported once
}

// Every failed stream's failure is reported: the first at a device-wide synchronize, the next
// at the next one (they were cleared unreported, as they are not on a GPU).
TEST_P(DeviceTest, DeviceSynchronizeKeepsTheOtherStreamsFailuresForLater) {
  auto other = dev->create_stream("other");
  s->host_fn([] { throw std::runtime_error("boom on main"); });
  other->host_fn([] { throw std::runtime_error("boom on other"); });
  std::set<std::string> seen;
  for (int i = 0; i < 2; ++i) {
    try {
      dev->synchronize();
      ADD_FAILURE() << "synchronize " << i << " reported nothing";
    } catch (const std::runtime_error& e) {
      seen.insert(e.what());
    }
  }
  EXPECT_EQ(seen, (std::set<std::string>{"boom on main", "boom on other"}));
  dev->synchronize();  // each reported once
}

// Waiting for the device or a stream from inside a stream's host function is an error, not a
// hang (it waited for itself; CUDA forbids any CUDA call there).
TEST_P(DeviceTest, SynchronizeInsideAHostFunctionIsAnErrorNotAHang) {
  if (GetParam().cuda)
    GTEST_SKIP() << "on CUDA it deadlocks: the emulated device is where it is caught";
  auto other = dev->create_stream("other");
  s->host_fn([&] { s->synchronize(); });
  other->host_fn([&] { dev->synchronize(); });
  for (Stream* st : {s.get(), other.get()}) {
    try {
      st->synchronize();
      ADD_FAILURE() << st->name() << ": no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("inside a stream's host function"), std::string::npos)
          << e.what();
    }
  }
  // A buffer freed on another device's stream is refused, not freed through the wrong device.
  auto second = GetParam().make(kDefaultCap);
  auto foreign = second->create_stream("foreign");
  Buffer b = dev->alloc(4096, s.get());
  EXPECT_THROW(b.reset_on(*foreign), Error);
  b.reset_on(*s);
}

// A stream destroyed with a failure nobody asked about says so (it vanished without a word).
TEST_P(DeviceTest, AStreamDestroyedWithAnUnreportedFailureSaysSo) {
  auto doomed = dev->create_stream("doomed");
  doomed->host_fn([] { throw std::runtime_error("never asked about"); });
  ::testing::internal::CaptureStderr();
  doomed.reset();
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("stream 'doomed' destroyed with an unreported"), std::string::npos) << err;
  EXPECT_NE(err.find("never asked about"), std::string::npos) << err;
}

// A host function that drops the last reference to a buffer allocated without a stream: the
// free cannot wait for the device from there (it hung, waiting for its own op); the memory
// returns at the next device-wide wait.
TEST_P(DeviceTest, AStreamlessBufferFreedInAHostFnReturnsAtTheNextDeviceWait) {
  if (GetParam().cuda) GTEST_SKIP() << "CUDA forbids cudaFree inside a host function";
  auto buf = std::make_shared<Buffer>(dev->alloc(1 << 20));
  const std::uint64_t before = dev->stats().bytes_in_use;
  std::promise<void> gate;
  s->host_fn([f = gate.get_future().share()] { f.wait(); });
  s->host_fn([buf]() mutable { buf.reset(); });  // the last reference, once the gate opens
  buf.reset();
  gate.set_value();
  auto waited = std::async(std::launch::async, [&] { s->synchronize(); });
  ASSERT_EQ(waited.wait_for(20s), std::future_status::ready) << "the stream hung in the free";
  waited.get();
  EXPECT_EQ(dev->stats().bytes_in_use, before) << "returned before every stream was idle";
  dev->synchronize();
  EXPECT_EQ(dev->stats().bytes_in_use, before - (1u << 20));

  // Captured and never touched: the callable is destroyed (the buffer freed) before its op
  // counts as done, so the next device-wide wait returns it (it was left for a later one, and
  // a full device then refused an allocation the cap held).
  for (int i = 0; i < 200; ++i) {
    auto held = std::make_shared<Buffer>(dev->alloc(1 << 20));
    s->host_fn([held] {});
    held.reset();
    dev->synchronize();
    ASSERT_EQ(dev->stats().bytes_in_use, before - (1u << 20)) << "iteration " << i;
  }
}

#ifndef STRATA_TEST_CUDA
// Large blocks are rounded to 64 KiB, but not past the arena: with a cap that is no multiple
// of 64 KiB the whole cap was unallocatable on an empty device.
TEST(HostDevice, TheWholeCapIsAllocatableWhateverItsSize) {
  HostDeviceOptions o;
  o.capacity_bytes = 10'000'000;
  auto dev = make_host_device(o);
  { Buffer all = dev->alloc(10'000'000 / 256 * 256); }
  dev->synchronize();
  { Buffer most = dev->alloc(9'961'473); }  // rounds past the cap's last 64 KiB step
  dev->synchronize();
  try {
    Buffer too_much = dev->alloc(10'000'000);
    FAIL() << "more than the arena was granted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kOutOfMemory) << e.what();
  }
}
#endif

TEST_P(DeviceTest, FreedAndFreshMemoryIsPoisoned) {
  if (GetParam().cuda) GTEST_SKIP() << "poisoning is a property of the emulated device";
  Buffer fresh = dev->alloc(64, s.get());
  const auto v = download(fresh, DType::kF32, 16);
  for (double x : v) EXPECT_TRUE(std::isnan(x));
  s->fill(tensor(fresh, DType::kF32), 1.0f);
  s->synchronize();
  const auto* raw = static_cast<const std::uint16_t*>(fresh.data());
  EXPECT_EQ(raw[1], 0x3f80);
  fresh.reset();
  s->synchronize();
  for (int i = 0; i < 32; ++i) EXPECT_EQ(raw[i], kPoison16);  // still mapped, now poison
}

// A 64 MiB emulated device with these throttles (0: none).
std::unique_ptr<Device> throttled_device(double h2d_gbps, double d2h_gbps, double compute_gflops) {
  HostDeviceOptions o;
  o.capacity_bytes = 64 << 20;
  o.h2d_gbps = h2d_gbps;
  o.d2h_gbps = d2h_gbps;
  o.compute_gflops = compute_gflops;
  return make_host_device(o);
}

#ifndef STRATA_TEST_CUDA
// A throttle is 0 or a rate things end at: 1e-300 GB/s made an infinite wait that cast to a time
// in the past (no throttle at all), 1e-6 GFLOP/s a hang; each is refused naming the flag.
TEST(HostDevice, ThrottlesTooSlowToEndAreRefused) {
  const auto error_of = [](double h2d, double d2h, double gflops) {
    try {
      throttled_device(h2d, d2h, gflops);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  EXPECT_NE(error_of(1e-300, 0, 0)
                .find("the emulated device's host-to-device copy rate "
                      "(--emu-h2d-gbps) is 1e-300 GB/s: give 0 (unthrottled) or "
                      "at least 0.001 GB/s"),
            std::string::npos);
  EXPECT_NE(error_of(0, std::numeric_limits<double>::infinity(), 0).find("(--emu-d2h-gbps) is inf"),
            std::string::npos);
  EXPECT_NE(error_of(0, 0, 1e-6).find("matmul rate (--emu-compute-gflops) is 1e-06 GFLOP/s"),
            std::string::npos);
  EXPECT_EQ(error_of(0.001, 0, 0), "(accepted)");
}
#endif

TEST_P(DeviceTest, ThrottledCopiesTakeAtLeastBytesOverBandwidth) {
  if (GetParam().cuda) GTEST_SKIP() << "throttling is a property of the emulated device";
  auto slow = throttled_device(2.0, 1.0, 0);
  auto st = slow->create_stream("pcie");
  const std::size_t bytes = 8 << 20;
  std::vector<std::uint8_t> h(bytes, 1);
  Buffer b = slow->alloc(bytes, st.get());
  auto t0 = std::chrono::steady_clock::now();
  st->copy(b.ref(), host_ref(h.data(), bytes));
  st->synchronize();
  const double h2d_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  t0 = std::chrono::steady_clock::now();
  st->copy(host_ref(h.data(), bytes), b.ref());
  st->synchronize();
  const double d2h_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(h2d_s, bytes / 2.0e9);  // lower bounds only
  EXPECT_GE(d2h_s, bytes / 1.0e9);
}

// A throttled link is one link: copies in the same direction on different streams share its
// rate (lower bound: together they take at least their bytes over it).
TEST_P(DeviceTest, ThrottledCopiesOnTwoStreamsShareTheLink) {
  if (GetParam().cuda) GTEST_SKIP() << "throttling is a property of the emulated device";
  auto slow = throttled_device(2.0, 0, 0);
  auto a = slow->create_stream("a"), b = slow->create_stream("b");
  const std::size_t bytes = 8 << 20;
  std::vector<std::uint8_t> h(bytes, 1);
  Buffer ba = slow->alloc(bytes, a.get()), bb = slow->alloc(bytes, b.get());
  const auto t0 = std::chrono::steady_clock::now();
  a->copy(ba.ref(), host_ref(h.data(), bytes));
  b->copy(bb.ref(), host_ref(h.data(), bytes));
  a->synchronize();
  b->synchronize();
  const double both_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(both_s, 2 * bytes / 2.0e9);
}

TEST_P(DeviceTest, ThrottledMatmulsTakeAtLeastFlopsOverRate) {
  if (GetParam().cuda) GTEST_SKIP() << "throttling is a property of the emulated device";
  auto slow = throttled_device(0, 0, 0.5);
  auto st = slow->create_stream("compute");
  const std::int64_t m = 64, n = 96, k = 80;  // 2*m*n*k = 983040 flops: >= 1.97 ms at 0.5 GFLOP/s
  std::vector<float> ha(std::size_t(m * k), 0.25f), hb(std::size_t(k * n), 0.5f);
  Buffer a = slow->alloc(ha.size() * 4, st.get()), b = slow->alloc(hb.size() * 4, st.get());
  Buffer c = slow->alloc(std::size_t(m * n) * 4, st.get());
  st->copy(a.ref(), host_ref(ha.data(), ha.size() * 4));
  st->copy(b.ref(), host_ref(hb.data(), hb.size() * 4));
  st->synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  st->matmul({m, n, k, false, false, 1.0f, 0.0f, tensor(a, DType::kF32), tensor(b, DType::kF32),
              tensor(c, DType::kF32)});
  std::vector<float> hc(std::size_t(m * n));
  st->copy(host_ref(hc.data(), hc.size() * 4), c.ref());
  st->synchronize();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(s, 2.0 * m * n * k / 0.5e9);  // a lower bound only
  EXPECT_EQ(hc[0], 0.25f * 0.5f * float(k)) << "the throttle must not change the result";
}

// A throttled matmul's product lands when its time ends, as a kernel's: a reader on another
// stream that misses its wait sees the old C while it runs (it saw the product at once, the
// throttle's sleep coming after it), and an accumulating one (beta 1) still adds to the old C.
TEST_P(DeviceTest, AThrottledMatmulsProductLandsWhenItEnds) {
  if (GetParam().cuda) GTEST_SKIP() << "throttling is a property of the emulated device";
  auto slow = throttled_device(0, 0, 0.2);
  auto st = slow->create_stream("compute");
  const std::int64_t m = 128, n = 128, k = 256;  // 2*m*n*k = 8.4 MFLOP: >= 42 ms at 0.2 GFLOP/s
  std::vector<float> ha(std::size_t(m * k), 0.5f), hb(std::size_t(k * n), 0.25f),
      hc(std::size_t(m * n), 7.0f);
  Buffer a = slow->alloc(ha.size() * 4, st.get()), b = slow->alloc(hb.size() * 4, st.get());
  Buffer c = slow->alloc(hc.size() * 4, st.get());
  st->copy(a.ref(), host_ref(ha.data(), ha.size() * 4));
  st->copy(b.ref(), host_ref(hb.data(), hb.size() * 4));
  st->copy(c.ref(), host_ref(hc.data(), hc.size() * 4));
  st->synchronize();
  const Event done = [&] {
    st->matmul({m, n, k, false, false, 1.0f, 1.0f, tensor(a, DType::kF32), tensor(b, DType::kF32),
                tensor(c, DType::kF32)});
    return st->record();
  }();
  std::this_thread::sleep_for(15ms);
  const float* seen = static_cast<const float*>(c.ref().ptr);  // host memory on this device
  if (!done.query()) {
    std::size_t old = 0;
    for (std::size_t i = 0; i < hc.size(); ++i) old += seen[i] == 7.0f;
    if (!done.query()) {  // still in flight after the scan: nothing may have landed during it
      EXPECT_EQ(old, hc.size()) << "a product still in flight was visible";
    }
  }
  st->synchronize();
  EXPECT_EQ(seen[0], 7.0f + 0.5f * 0.25f * float(k));
  EXPECT_EQ(seen[hc.size() - 1], 7.0f + 0.5f * 0.25f * float(k));
}

TEST_P(DeviceTest, KernelsOnFewerThreadsGiveTheSameResult) {
  if (GetParam().cuda) GTEST_SKIP() << "compute_threads is a property of the emulated device";
  auto result = [](int threads) {
    HostDeviceOptions o;
    o.capacity_bytes = 64 << 20;
    o.compute_threads = threads;
    auto dev = make_host_device(o);
    auto st = dev->create_stream("compute");
    const std::int64_t m = 96, n = 128, k = 200;
    std::vector<float> ha(std::size_t(m * k)), hb(std::size_t(k * n));
    for (std::size_t i = 0; i < ha.size(); ++i) ha[i] = float(i % 13) * 0.125f - 0.5f;
    for (std::size_t i = 0; i < hb.size(); ++i) hb[i] = float(i % 7) * 0.25f - 0.75f;
    Buffer a = dev->alloc(ha.size() * 4, st.get()), b = dev->alloc(hb.size() * 4, st.get());
    Buffer c = dev->alloc(std::size_t(m * n) * 4, st.get());
    st->copy(a.ref(), host_ref(ha.data(), ha.size() * 4));
    st->copy(b.ref(), host_ref(hb.data(), hb.size() * 4));
    st->matmul({m, n, k, false, false, 1.0f, 0.0f, tensor(a, DType::kF32), tensor(b, DType::kF32),
                tensor(c, DType::kF32)});
    std::vector<float> hc(std::size_t(m * n));
    st->copy(host_ref(hc.data(), hc.size() * 4), c.ref());
    st->synchronize();
    return hc;
  };
  EXPECT_TRUE(result(1) == result(0));
  HostDeviceOptions bad;
  bad.compute_threads = -1;
  try {
    make_host_device(bad);
    FAIL() << "compute_threads -1 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("compute_threads"), std::string::npos) << e.what();
  }
}

TEST_P(DeviceTest, StreamOperationsAreTraced) {
  if (GetParam().cuda) GTEST_SKIP() << "the CUDA backend does not record spans yet";
  Tracer& t = Tracer::global();
  t.clear();
  t.set_enabled(true);
  const std::size_t n = 1 << 16;
  std::vector<std::uint8_t> h(n, 7);
  Buffer b = dev->alloc(n, s.get());
  s->copy(b.ref(), host_ref(h.data(), n));
  s->copy(host_ref(h.data(), n), b.ref());
  s->synchronize();
  t.set_enabled(false);
  int h2d = 0, d2h = 0;
  for (const auto& span : t.spans()) {
    if (span.lane != "main") continue;
    h2d += span.name == "copy_h2d" && span.bytes == n;
    d2h += span.name == "copy_d2h" && span.bytes == n;
  }
  EXPECT_EQ(h2d, 1);
  EXPECT_EQ(d2h, 1);
  t.clear();
}

// Both devices' allocators place blocks by one rule (core/range_pool.h): a freed range is split
// for a smaller request, with no wait and no failure, within the cap.
TEST_P(DeviceTest, AFreedRangeIsSplitForSmallerRequests) {
  const std::size_t cap = std::size_t(1) << 20, kib = 1024;
  auto small = GetParam().make(cap);
  Buffer a = small->alloc(384 * kib), b = small->alloc(384 * kib);
  a.reset();  // no stream: returned once the device is idle, to the pool
  Buffer c = small->alloc(256 * kib), d = small->alloc(64 * kib), e = small->alloc(64 * kib);
  const DeviceStats st = small->stats();
  EXPECT_EQ(st.num_alloc_failures, 0u);
  EXPECT_EQ(st.num_alloc_waits, 0u);
  EXPECT_EQ(st.bytes_in_use, (384 + 256 + 64 + 64) * kib);
  EXPECT_LE(st.bytes_reserved, cap);
  // What is left is less than a block of 384 KiB: that request fails, naming the cap.
  EXPECT_THROW(small->alloc(384 * kib), Error);
}

// A stream kept busy by a host function until release() (or 20 s): an allocator that waited for
// every stream would not return before then.
// (The state is shared with the host function: it outlives a test that ends early.)
struct HeldBusy {
  struct State {
    std::promise<void> go;
    std::shared_future<void> gone = go.get_future().share();
    std::atomic<bool> done{false};
  };
  std::shared_ptr<State> st = std::make_shared<State>();
  explicit HeldBusy(Stream& s) {
    s.host_fn([st = st] {
      st->gone.wait_for(20s);
      st->done = true;
    });
  }
  bool done() const { return st->done.load(); }
  void release() { st->go.set_value(); }
};

// Releases `gate` once `dev` has counted `waits` allocation waits (or after 20 s): a free queued
// behind the gate is then one an allocation truly waited for, however the threads were scheduled
// (a sleep in its place let the free run first when the test thread was descheduled).
std::jthread release_after_waits(const Device& dev, std::uint64_t waits, HeldBusy gate) {
  return std::jthread([&dev, waits, gate]() mutable {
    const auto until = std::chrono::steady_clock::now() + 20s;
    while (dev.stats().num_alloc_waits < waits && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(1ms);
    gate.release();
  });
}

TEST_P(DeviceTest, AllocationWaitsForQueuedFreesBeforeFailing) {
  auto small = GetParam().make(std::size_t(1) << 20);
  auto st = small->create_stream("busy");
  auto other = small->create_stream("other");
  std::vector<std::jthread> releasers;
  for (int i = 0; i < 4; ++i) {
    // Alternating streams: a block freed on one is not the other's to reuse at once.
    Stream* s = i % 2 ? other.get() : st.get();
    Buffer b = small->alloc(700 * 1024, s);
    HeldBusy gate(*s);
    s->fill(tensor(b, DType::kF32), float(i));
    // b's free is queued behind the gate, which opens once the next allocation waits: it must
    // wait for the free, not fail.
    if (i < 3)
      releasers.push_back(release_after_waits(*small, std::uint64_t(i) + 1, gate));
    else
      gate.release();
  }
  releasers.clear();  // joined
  small->synchronize();
  EXPECT_EQ(small->stats().num_alloc_failures, 0u);
  EXPECT_EQ(small->stats().num_alloc_waits, 3u);
  EXPECT_LE(small->stats().peak_bytes_in_use, std::size_t(1) << 20);
}

TEST_P(DeviceTest, AnAllocationWaitsForTheFreeItNeedsNotForTheWholeDevice) {
  auto small = GetParam().make(std::size_t(1) << 20);
  auto a = small->create_stream("a"), b = small->create_stream("b"),
       busy = small->create_stream("busy");
  HeldBusy held(*busy);
  std::jthread releaser;
  {
    Buffer x = small->alloc(700 * 1024, a.get());
    HeldBusy gate(*a);
    a->fill(tensor(x, DType::kF32), 1.0f);
    releaser = release_after_waits(*small, 1, gate);
  }                                              // freed on `a`, behind its gate
  Buffer y = small->alloc(700 * 1024, b.get());  // waits for that free only
  EXPECT_FALSE(held.done());
  EXPECT_EQ(small->stats().num_alloc_waits, 1u);
  held.release();
  y.reset();
  small->synchronize();
}

// A request that no queued free can make room for fails at once, as on a GPU: it waited for every
// stream to finish its work (here one held by a host function that waits on this thread: a hang
// for 20 s where the GPU says out of memory).
TEST_P(DeviceTest, AnAllocationNothingCanMakeRoomForFailsWithoutWaitingForBusyStreams) {
  if (GetParam().cuda) GTEST_SKIP() << "a property of the emulated device's allocator";
  auto small = GetParam().make(std::size_t(1) << 20);
  auto busy = small->create_stream("busy");
  HeldBusy hold(*busy);
  Buffer held = small->alloc(700 * 1024, busy.get());
  try {
    Buffer more = small->alloc(700 * 1024);
    ADD_FAILURE() << "two 700 KiB blocks in a 1 MiB cap";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kOutOfMemory) << e.what();
  }
  EXPECT_FALSE(hold.done()) << "the failed allocation waited for the busy stream";
  hold.release();
  held.reset();
  small->synchronize();
}

// A throttled copy's bytes land when it ends, as a DMA's: a reader on another stream that
// misses its wait sees the old (here poisoned) contents, not the data, while the copy runs.
TEST_P(DeviceTest, AThrottledCopysBytesLandWhenItEnds) {
  if (GetParam().cuda) GTEST_SKIP() << "throttling is a property of the emulated device";
  auto slow = throttled_device(0.01, 0.01, 0);  // 1 MiB: ~100 ms
  auto st = slow->create_stream("pcie");
  const std::size_t n = std::size_t(1) << 18;
  std::vector<float> h(n, 3.0f);
  Buffer b = slow->alloc(n * 4, st.get());
  st->synchronize();  // (its poison written)
  const Event done = [&] {
    st->copy(b.ref(), host_ref(h.data(), n * 4));
    return st->record();
  }();
  std::this_thread::sleep_for(20ms);
  const float* seen = static_cast<const float*>(b.ref().ptr);  // host memory on this device
  if (!done.query()) {
    std::size_t landed = 0;
    for (std::size_t i = 0; i < n; ++i) landed += seen[i] == 3.0f;
    if (!done.query()) {  // still in flight after the scan: nothing may have landed during it
      EXPECT_EQ(landed, 0u) << "bytes of a copy still in flight were visible";
    }
  }
  st->synchronize();
  EXPECT_EQ(seen[0], 3.0f);
  EXPECT_EQ(seen[n - 1], 3.0f);
}

TEST_P(DeviceTest, AFreedBlockIsReusedAtOnceOnItsStreamAndPoisonedFirst) {
  if (GetParam().cuda) GTEST_SKIP() << "poisoning is a property of the emulated device";
  auto small = GetParam().make(std::size_t(1) << 20);
  auto s = small->create_stream("s");
  std::promise<void> go;
  std::shared_future<void> gone = go.get_future().share();
  s->host_fn([gone] { gone.wait_for(20s); });  // nothing on `s` runs until the test says so
  void* first = nullptr;
  {
    Buffer x = small->alloc(700 * 1024, s.get());
    first = x.data();
    s->fill(tensor(x, DType::kF32), 1.0f);
  }  // its free is queued on `s`, behind the fill
  // Only one such block fits: the same stream gets it back at once (no wait), as a caching
  // allocator does; stream order makes the fill and the free's poisoning come first.
  Buffer y = small->alloc(700 * 1024, s.get());
  EXPECT_EQ(y.data(), first);
  EXPECT_EQ(small->stats().num_alloc_waits, 0u);
  EXPECT_EQ(small->stats().num_reused, 1u);
  std::vector<std::uint16_t> back(8, 0);
  s->copy(host_ref(back.data(), back.size() * 2), y.ref(0, back.size() * 2));
  go.set_value();
  s->synchronize();
  for (std::uint16_t v : back) EXPECT_EQ(v, kPoison16);  // fresh memory reads as poison, not 1.0
  y.reset();
  small->synchronize();
  EXPECT_EQ(small->stats().bytes_in_use, 0u);
}

TEST_P(DeviceTest, ResetOnFreesInTheOrderOfTheLastUser) {
  auto dev = GetParam().make(kDefaultCap);
  auto a = dev->create_stream("a"), b = dev->create_stream("b");
  Buffer x = dev->alloc(1 << 20, a.get());
  a->fill(tensor(x, DType::kF32), 2.0f);
  b->wait(a->record());
  std::vector<float> back(4, 0.0f);
  b->host_fn([] { std::this_thread::sleep_for(20ms); });
  b->copy(host_ref(back.data(), back.size() * 4), x.ref(0, back.size() * 4));
  x.reset_on(*b);  // `b` reads it last: freed in b's order, after the copy
  EXPECT_FALSE(static_cast<bool>(x));
  b->synchronize();
  for (float v : back) EXPECT_EQ(v, 2.0f);  // the copy read the data, not poison
  dev->synchronize();
  EXPECT_EQ(dev->stats().bytes_in_use, 0u);
}

// ---- kernels against a double-precision reference ----

const DType kTypes[] = {DType::kF32, DType::kBF16, DType::kF16};

TEST_P(DeviceTest, FillScaleAxpyAddAgainstReference) {
  for (std::size_t n : {1u, 15u, 16u, 17u, 100003u}) {
    for (DType t : kTypes) {
      SCOPED_TRACE(::testing::Message() << "n=" << n << " " << dtype_name(t));
      const auto x = random_floats(n, n * 3 + 1);
      const auto y = random_floats(n, n * 5 + 2);
      Buffer bx = upload(x, t), by = upload(y, t), bo = dev->alloc(n * dtype_size(t), s.get());

      s->fill(tensor(bo, t), 0.37f);
      auto got = download(bo, t, n);
      for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(got[i], as_stored(t, 0.37f));

      s->add(tensor(bx, t), tensor(by, t), tensor(bo, t));
      got = download(bo, t, n);
      for (std::size_t i = 0; i < n; ++i) {
        const double ref = as_stored(t, x[i]) + as_stored(t, y[i]);
        ASSERT_NEAR(got[i], ref, eps(t) * std::fabs(ref) + 1e-30) << i;
      }

      s->axpy(-1.5f, tensor(bx, t), tensor(by, t));
      got = download(by, t, n);
      for (std::size_t i = 0; i < n; ++i) {
        const double ref = as_stored(t, y[i]) - 1.5 * as_stored(t, x[i]);
        ASSERT_NEAR(got[i], ref,
                    eps(t) * (std::fabs(ref) + 1.5 * std::fabs(x[i]) + std::fabs(y[i])))
            << i;
      }

      s->scale(0.75f, tensor(bx, t));
      got = download(bx, t, n);
      for (std::size_t i = 0; i < n; ++i) {
        const double ref = 0.75 * as_stored(t, x[i]);
        ASSERT_NEAR(got[i], ref, eps(t) * std::fabs(ref)) << i;
      }
    }
  }
}

TEST_P(DeviceTest, MixedPrecisionAxpyAccumulatesInFp32) {
  const std::size_t n = 1031;
  const auto x = random_floats(n, 11), y = random_floats(n, 12);
  Buffer bx = upload(x, DType::kBF16), by = upload(y, DType::kF32);
  s->axpy(0.5f, tensor(bx, DType::kBF16), tensor(by, DType::kF32));
  const auto got = download(by, DType::kF32, n);
  for (std::size_t i = 0; i < n; ++i) {
    const double ref = y[i] + 0.5 * as_stored(DType::kBF16, x[i]);
    ASSERT_NEAR(got[i], ref, 1e-6 * (std::fabs(ref) + 1)) << i;
  }
}

TEST_P(DeviceTest, CastMatchesScalarRoundingBitForBit) {
  const std::size_t n = 4099;
  auto x = random_floats(n, 99, -70000, 70000);  // includes fp16 overflow to Inf
  x[0] = 1.0f + 0.00390625f;                     // bf16 tie
  x[1] = 6.0e-8f;                                // fp16 subnormal
  for (DType from : kTypes) {
    for (DType to : kTypes) {
      SCOPED_TRACE(::testing::Message() << dtype_name(from) << "->" << dtype_name(to));
      Buffer src = upload(x, from), dst = dev->alloc(n * dtype_size(to), s.get());
      s->cast(tensor(src, from), tensor(dst, to));
      const auto got = download(dst, to, n);
      for (std::size_t i = 0; i < n; ++i) {
        const double ref = as_stored(to, static_cast<float>(as_stored(from, x[i])));
        if (std::isinf(ref)) {
          ASSERT_TRUE(std::isinf(got[i]) && (got[i] > 0) == (ref > 0)) << i;
        } else {
          ASSERT_EQ(got[i], ref) << i << " x=" << x[i];
        }
      }
    }
  }
}

TEST_P(DeviceTest, SumOfSquaresAgainstReference) {
  for (std::size_t n : {1u, 17u, 65537u, 1000003u}) {
    for (DType t : kTypes) {
      SCOPED_TRACE(::testing::Message() << "n=" << n << " " << dtype_name(t));
      const auto x = random_floats(n, n + 5);
      Buffer bx = upload(x, t), out = dev->alloc(4, s.get());
      s->sum_squares(tensor(bx, t), tensor(out, DType::kF32));
      const double got = download(out, DType::kF32, 1)[0];
      double ref = 0;
      for (float v : x) ref += as_stored(t, v) * as_stored(t, v);
      EXPECT_NEAR(got, ref, 1e-5 * ref);
    }
  }
}

struct MatmulCase {
  std::int64_t m, n, k;
  bool ta, tb;
  float alpha, beta;
};

// The routes a CPU backend's matmul of `in` operands can take on this host (cpu/gemm_path.h):
// widened to fp32 (bf16, fp16), and oneDNN's own where it has one. CUDA: one, as it is.
std::vector<std::optional<cpu::GemmRoute>> gemm_routes(const Backend& b, DType in) {
  if (b.cuda || in == DType::kF32) return {std::nullopt};
  std::vector<std::optional<cpu::GemmRoute>> r{cpu::GemmRoute::kWidened};
  if (cpu::gemm_native_available(in)) r.push_back(cpu::GemmRoute::kNative);
  return r;
}

// Runs `in`'s CPU matmuls on `route` while it lives (none: as they are).
struct GemmRouteScope {
  GemmRouteScope(DType in, std::optional<cpu::GemmRoute> route) : in(in), was(cpu::gemm_route(in)) {
    if (route) cpu::set_gemm_route(in, *route);
  }
  ~GemmRouteScope() { cpu::set_gemm_route(in, was); }
  DType in;
  cpu::GemmRoute was;
};

// Every operand dtype on every route this host has: fp32, bf16 and fp16 operands, fp32 or bf16
// out, bf16 and fp16 both widened to fp32 and (where oneDNN has it) native.
TEST_P(DeviceTest, MatmulAgainstDoubleReference) {
  const MatmulCase cases[] = {
      {1, 1, 1, false, false, 1, 0},     {7, 13, 5, false, false, 1, 0},
      {33, 17, 65, true, false, 1, 0},   {64, 48, 80, false, true, 1, 0},
      {31, 29, 37, true, true, 0.5f, 0}, {19, 23, 129, false, false, 1.5f, 0.25f}};
  for (DType in : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (const auto route : gemm_routes(GetParam(), in)) {
      const GemmRouteScope scope(in, route);
      for (DType out : {DType::kF32, DType::kBF16}) {
        for (const auto& c : cases) {
          SCOPED_TRACE(::testing::Message()
                       << dtype_name(in) << "->" << dtype_name(out) << " m" << c.m << " n" << c.n
                       << " k" << c.k << " ta" << c.ta << " tb" << c.tb << " route "
                       << (route ? cpu::gemm_route_name(*route) : "as is"));
          const auto a = random_floats(c.m * c.k, c.m * 7 + c.k);
          const auto b = random_floats(c.k * c.n, c.n * 11 + c.k);
          const auto c0 = random_floats(c.m * c.n, c.m + c.n);
          Buffer ba = upload(a, in), bb = upload(b, in), bc = upload(c0, out);
          MatmulDesc d{c.m,
                       c.n,
                       c.k,
                       c.ta,
                       c.tb,
                       c.alpha,
                       c.beta,
                       tensor(ba, in),
                       tensor(bb, in),
                       tensor(bc, out)};
          s->matmul(d);
          const auto got = download(bc, out, c.m * c.n);
          for (std::int64_t i = 0; i < c.m; ++i) {
            for (std::int64_t j = 0; j < c.n; ++j) {
              double ref = 0, mag = 0;
              for (std::int64_t p = 0; p < c.k; ++p) {
                const double av = as_stored(in, a[c.ta ? p * c.m + i : i * c.k + p]);
                const double bv = as_stored(in, b[c.tb ? j * c.k + p : p * c.n + j]);
                ref += av * bv;
                mag += std::fabs(av * bv);
              }
              const double cv = as_stored(out, c0[i * c.n + j]);
              ref = c.alpha * ref + c.beta * cv;
              mag = std::fabs(c.alpha) * mag + std::fabs(c.beta * cv);
              const double tol =
                  1e-5 * mag + (out == DType::kBF16 ? std::fabs(ref) / 128 : 0) + 1e-6;
              ASSERT_NEAR(got[i * c.n + j], ref, tol) << "at " << i << "," << j;
            }
          }
        }
      }
    }
  }
}

// AdamW on the device against the CPU AdamW's scalar path on host copies of the same data:
// the element step is the same IEEE fp32 operations on every backend, so bit for bit.
// Several shards of mixed dtypes in one call (one launch per batch on CUDA), three steps,
// then the non-finite handling: kSkipStep writes nothing, kReportOnly updates and reports.
TEST_P(DeviceTest, AdamWMatchesCpuScalarPathBitForBit) {
  struct ShardSpec {
    std::size_t n;
    DType grad, state, copy;  // copy kF32 = none
  };
  const ShardSpec specs[] = {{1000003, DType::kF32, DType::kF32, DType::kBF16},
                             {17, DType::kBF16, DType::kBF16, DType::kF16},
                             {4099, DType::kF32, DType::kBF16, DType::kF32},
                             {1, DType::kBF16, DType::kF32, DType::kBF16}};
  struct HostShard {
    std::vector<std::uint8_t> p, g, m, v, c;
  };
  auto bytes_of = [this](const std::vector<float>& v, DType t) {
    std::vector<std::uint8_t> b(v.size() * dtype_size(t));
    for (std::size_t i = 0; i < v.size(); ++i) store_host(t, b.data(), i, v[i]);
    return b;
  };
  auto to_device = [this](const std::vector<std::uint8_t>& b) {
    Buffer buf = dev->alloc(b.size(), s.get());
    s->copy(buf.ref(), host_ref(b.data(), b.size()));
    return buf;
  };
  auto to_host = [this](const Buffer& buf, std::size_t bytes) {
    std::vector<std::uint8_t> b(bytes);
    s->copy(host_ref(b.data(), bytes), buf.ref(0, bytes));
    s->synchronize();
    return b;
  };
  std::vector<HostShard> host;
  std::vector<std::array<Buffer, 5>> bufs;
  AdamWDesc desc;
  std::vector<AdamWShard> host_shards;
  for (std::size_t k = 0; k < std::size(specs); ++k) {
    const ShardSpec& sp = specs[k];
    HostShard h;
    h.p = bytes_of(random_floats(sp.n, 100 + k), DType::kF32);
    h.g = bytes_of(random_floats(sp.n, 200 + k, -1, 1), sp.grad);
    h.m = bytes_of(random_floats(sp.n, 300 + k, -0.1f, 0.1f), sp.state);
    h.v = bytes_of(random_floats(sp.n, 400 + k, 1e-4f, 1e-2f), sp.state);
    if (sp.copy != DType::kF32) h.c.assign(sp.n * 2, 0);
    host.push_back(std::move(h));
  }
  for (std::size_t k = 0; k < std::size(specs); ++k) {
    const ShardSpec& sp = specs[k];
    HostShard& h = host[k];
    std::array<Buffer, 5> b{to_device(h.p), to_device(h.g), to_device(h.m), to_device(h.v),
                            h.c.empty() ? Buffer{} : to_device(h.c)};
    AdamWShard ds{tensor(b[0], DType::kF32, sp.n), tensor(b[1], sp.grad, sp.n),
                  tensor(b[2], sp.state, sp.n), tensor(b[3], sp.state, sp.n),
                  h.c.empty() ? TensorRef{} : tensor(b[4], sp.copy, sp.n)};
    // Shard 1 without weight decay (a norm weight's or a bias's, AdamWShard::decay).
    ds.decay = k != 1;
    desc.shards.push_back(ds);
    host_shards.push_back(
        {host_tensor(h.p.data(), DType::kF32, sp.n), host_tensor(h.g.data(), sp.grad, sp.n),
         host_tensor(h.m.data(), sp.state, sp.n), host_tensor(h.v.data(), sp.state, sp.n),
         h.c.empty() ? TensorRef{} : host_tensor(h.c.data(), sp.copy, sp.n)});
    host_shards.back().decay = ds.decay;
    bufs.push_back(std::move(b));
  }
  // The uploads read the host copies, which the reference step below rewrites: wait for them.
  s->synchronize();
  Buffer flag = dev->alloc(4, s.get());
  desc.non_finite = tensor(flag, DType::kF32, 1);
  desc.options.lr = 3e-3;
  desc.options.weight_decay = 0.05;
  desc.options.grad_scale = 0.5;
  CpuAdamW reference(CpuAdamWConfig{1, Isa::kScalar});
  // Bit for bit, except that a NaN matches a NaN: IEEE leaves the payload of an operation's NaN
  // to the hardware (x86 makes 0xffc00000, a GPU 0x7fffffff; an H200 differed so only there).
  auto same = [&](const Buffer& buf, const std::vector<std::uint8_t>& want, DType t) {
    const std::vector<std::uint8_t> got = to_host(buf, want.size());
    const std::size_t w = dtype_size(t), n = want.size() / w;
    std::size_t differ = 0, first = n;
    for (std::size_t i = 0; i < n; ++i) {
      if (std::memcmp(got.data() + i * w, want.data() + i * w, w) == 0) continue;
      if (std::isnan(load_host(t, got.data(), i)) && std::isnan(load_host(t, want.data(), i)))
        continue;
      if (differ++ == 0) first = i;
    }
    return differ == 0 ? ::testing::AssertionSuccess()
                       : ::testing::AssertionFailure()
                             << differ << " of " << n << " elements differ, the first at " << first;
  };
  auto expect_same = [&](const char* when) {
    for (std::size_t k = 0; k < std::size(specs); ++k) {
      const HostShard& h = host[k];
      const ShardSpec& sp = specs[k];
      SCOPED_TRACE(::testing::Message() << when << ", shard " << k << " n=" << sp.n);
      EXPECT_TRUE(same(bufs[k][0], h.p, DType::kF32)) << "params differ";
      EXPECT_TRUE(same(bufs[k][2], h.m, sp.state)) << "m differs";
      EXPECT_TRUE(same(bufs[k][3], h.v, sp.state)) << "v differs";
      if (!h.c.empty()) {
        EXPECT_TRUE(same(bufs[k][4], h.c, sp.copy)) << "copy_out differs";
      }
    }
  };
  for (int t = 1; t <= 3; ++t) {
    desc.options.step = t;
    s->adamw(desc);
    const AdamWResult r = reference.step(desc.options, host_shards);
    ASSERT_TRUE(r.all_finite());
    EXPECT_EQ(download(flag, DType::kF32, 1)[0], 0.0);
    expect_same("finite steps");
    if (HasFailure()) return;
  }
  // One NaN gradient in shard 1 (bf16) and an Inf in shard 0 (fp32).
  host[1].g[2 * 5] = 0xc0, host[1].g[2 * 5 + 1] = 0x7f;
  const float inf = INFINITY;
  std::memcpy(host[0].g.data() + 4 * 999999, &inf, 4);
  s->copy(bufs[1][1].ref(), host_ref(host[1].g.data(), host[1].g.size()));
  s->copy(bufs[0][1].ref(), host_ref(host[0].g.data(), host[0].g.size()));
  desc.options.step = 4;
  desc.policy = NonFinitePolicy::kSkipStep;
  s->adamw(desc);
  EXPECT_EQ(download(flag, DType::kF32, 1)[0], 2.0);
  expect_same("skipped step: nothing written");
  desc.policy = NonFinitePolicy::kReportOnly;
  s->adamw(desc);
  EXPECT_EQ(download(flag, DType::kF32, 1)[0], 2.0);
  const AdamWResult r = reference.step(desc.options, host_shards, NonFinitePolicy::kReportOnly);
  EXPECT_EQ(r.non_finite, 2u);
  expect_same("reported step");
  // Bad input is rejected before anything is queued.
  AdamWDesc bad = desc;
  bad.shards[0].grads.numel = 5;
  EXPECT_THROW(s->adamw(bad), Error);
  bad = desc;
  bad.shards[2].params = host_shards[2].params;
  EXPECT_THROW(s->adamw(bad), Error);
  bad = desc;
  bad.options.beta2 = 1.0;
  EXPECT_THROW(s->adamw(bad), Error);
}

// The out-of-place step (params_src, m_src, v_src): from one copy of the state into another,
// bit for bit the in-place step's result, the sources left byte for byte as they were.
TEST_P(DeviceTest, AdamWOutOfPlaceMatchesInPlaceAndKeepsSources) {
  const std::size_t n = 4099;
  auto bytes = [this](const Buffer& b, std::size_t size) {
    std::vector<std::uint8_t> out(size);
    s->copy(host_ref(out.data(), size), b.ref(0, size));
    s->synchronize();
    return out;
  };
  for (DType state : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(dtype_name(state));
    const std::size_t sb = n * dtype_size(state);
    const std::vector<float> p0 = random_floats(n, 1), m0 = random_floats(n, 2, -0.1f, 0.1f),
                             v0 = random_floats(n, 3, 1e-4f, 1e-2f);
    Buffer g = upload(random_floats(n, 4, -1, 1), DType::kBF16);
    Buffer in_p = upload(p0, DType::kF32), in_m = upload(m0, state), in_v = upload(v0, state);
    Buffer src_p = upload(p0, DType::kF32), src_m = upload(m0, state), src_v = upload(v0, state);
    const auto src_p0 = bytes(src_p, n * 4), src_m0 = bytes(src_m, sb), src_v0 = bytes(src_v, sb);
    Buffer dst_p = dev->alloc(n * 4, s.get()), dst_m = dev->alloc(sb, s.get()),
           dst_v = dev->alloc(sb, s.get());
    Buffer in_c = dev->alloc(n * 2, s.get()), dst_c = dev->alloc(n * 2, s.get());
    AdamWDesc d;
    d.options.lr = 3e-3;
    d.options.weight_decay = 0.05;
    d.options.step = 2;
    d.shards.push_back({tensor(in_p, DType::kF32, n), tensor(g, DType::kBF16, n),
                        tensor(in_m, state, n), tensor(in_v, state, n),
                        tensor(in_c, DType::kBF16, n)});
    s->adamw(d);
    d.shards[0] = {tensor(dst_p, DType::kF32, n),  tensor(g, DType::kBF16, n),
                   tensor(dst_m, state, n),        tensor(dst_v, state, n),
                   tensor(dst_c, DType::kBF16, n), tensor(src_p, DType::kF32, n),
                   tensor(src_m, state, n),        tensor(src_v, state, n)};
    s->adamw(d);
    EXPECT_TRUE(bytes(dst_p, n * 4) == bytes(in_p, n * 4)) << "params differ";
    EXPECT_TRUE(bytes(dst_m, sb) == bytes(in_m, sb)) << "m differs";
    EXPECT_TRUE(bytes(dst_v, sb) == bytes(in_v, sb)) << "v differs";
    EXPECT_TRUE(bytes(dst_c, n * 2) == bytes(in_c, n * 2)) << "copy_out differs";
    EXPECT_TRUE(bytes(src_p, n * 4) == src_p0) << "params_src was written";
    EXPECT_TRUE(bytes(src_m, sb) == src_m0) << "m_src was written";
    EXPECT_TRUE(bytes(src_v, sb) == src_v0) << "v_src was written";
    // Bad sources are rejected before anything is queued.
    AdamWDesc bad = d;
    bad.shards[0].v_src = {};
    EXPECT_THROW(s->adamw(bad), Error);
    bad = d;
    bad.shards[0].m_src = tensor(dst_v, state, n);
    EXPECT_THROW(s->adamw(bad), Error);
    bad = d;
    bad.shards[0].params_src = host_tensor(p0.data(), DType::kF32, n);
    EXPECT_THROW(s->adamw(bad), Error);
  }
}

#ifndef STRATA_TEST_CUDA
// A widened matmul (bf16 or fp16 operands on the fp32 GEMM), and a bf16 output of an fp32 one,
// run in blocks of C whose widened operands and fp32 accumulator fit the Matmul's scratch: a
// 4 KiB scratch cuts these products into many blocks, with every transpose and with beta, and each
// still sums over the whole of k once in fp32 (against the double reference, as above; and
// within one bf16 rounding of an unblocked Matmul's result).
TEST(CpuMatmul, WidenedInBlocksOfABoundedScratch) {
  const std::int64_t m = 37, n = 53, k = 29;
  constexpr std::size_t kStage = 4096;
  const cpu::MatmulBlocks blk = cpu::matmul_blocks(m, n, k, true, true, kStage);
  ASSERT_LT(blk.rows, m);
  ASSERT_LT(blk.cols, n);
  EXPECT_LE(std::size_t(blk.rows * k + k * blk.cols + blk.rows * blk.cols) * 4, kStage);
  EXPECT_EQ(cpu::matmul_blocks(m, n, k, true, true, cpu::Matmul::kStageBytes).rows,
            m);  // fits whole
  cpu::Matmul small(kStage), whole;
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> u(-2, 2);
  auto randv = [&](std::int64_t count) {
    std::vector<float> v(static_cast<std::size_t>(count));
    for (float& x : v) x = u(rng);
    return v;
  };
  auto stored = [](DType t, const std::vector<float>& v) {
    std::vector<std::uint8_t> b(v.size() * dtype_size(t));
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (t == DType::kF32)
        std::memcpy(b.data() + 4 * i, &v[i], 4);
      else {
        const std::uint16_t h = t == DType::kBF16 ? f32_to_bf16(v[i]) : f32_to_f16(v[i]);
        std::memcpy(b.data() + 2 * i, &h, 2);
      }
    }
    return b;
  };
  auto value = [](DType t, const std::vector<std::uint8_t>& b, std::size_t i) -> double {
    if (t == DType::kF32) {
      float f;
      std::memcpy(&f, b.data() + 4 * i, 4);
      return f;
    }
    std::uint16_t h;
    std::memcpy(&h, b.data() + 2 * i, 2);
    return t == DType::kBF16 ? bf16_to_f32(h) : f16_to_f32(h);
  };
  for (DType in : {DType::kBF16, DType::kF16, DType::kF32}) {
    const GemmRouteScope scope(
        in, in == DType::kF32 ? std::nullopt : std::optional(cpu::GemmRoute::kWidened));
    for (DType out : {DType::kF32, DType::kBF16}) {
      if (in == DType::kF32 && out == DType::kF32) continue;  // nothing staged: oneDNN straight
      for (int t = 0; t < 4; ++t) {
        const bool ta = t & 1, tb = t & 2;
        const float alpha = 0.75f, beta = 0.5f;
        SCOPED_TRACE(::testing::Message()
                     << dtype_name(in) << "->" << dtype_name(out) << " ta" << ta << " tb" << tb);
        const auto a = stored(in, randv(m * k)), b = stored(in, randv(k * n)),
                   c0 = stored(out, randv(m * n));
        auto c_small = c0, c_whole = c0;
        auto desc = [&](std::vector<std::uint8_t>& c) {
          return MatmulDesc{m,
                            n,
                            k,
                            ta,
                            tb,
                            alpha,
                            beta,
                            host_tensor(a.data(), in, std::size_t(m * k)),
                            host_tensor(b.data(), in, std::size_t(k * n)),
                            host_tensor(c.data(), out, std::size_t(m * n))};
        };
        small.run(desc(c_small));
        whole.run(desc(c_whole));
        for (std::int64_t i = 0; i < m; ++i) {
          for (std::int64_t j = 0; j < n; ++j) {
            double ref = 0, mag = 0;
            for (std::int64_t p = 0; p < k; ++p) {
              const double av = value(in, a, std::size_t(ta ? p * m + i : i * k + p));
              const double bv = value(in, b, std::size_t(tb ? j * k + p : p * n + j));
              ref += av * bv;
              mag += std::fabs(av * bv);
            }
            const double cv = value(out, c0, std::size_t(i * n + j));
            ref = alpha * ref + beta * cv;
            mag = alpha * mag + std::fabs(beta * cv);
            const double bf16_ulp = out == DType::kBF16 ? std::fabs(ref) / 128 : 0;
            const std::size_t at = std::size_t(i * n + j);
            ASSERT_NEAR(value(out, c_small, at), ref, 1e-5 * mag + bf16_ulp + 1e-6)
                << "at " << i << "," << j;
            ASSERT_NEAR(value(out, c_small, at), value(out, c_whole, at), 1e-5 * mag + bf16_ulp)
                << "at " << i << "," << j;
          }
        }
      }
    }
  }
}
#endif

INSTANTIATE_TEST_SUITE_P(Backends, DeviceTest, ::testing::ValuesIn(backends()),
                         [](const ::testing::TestParamInfo<Backend>& p) { return p.param.name; });

}  // namespace
}  // namespace strata
