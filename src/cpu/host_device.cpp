// HostDevice: a GPU emulated on the CPU, honest enough to test a scheduler against.
//
// Owns: one capped arena (the emulated HBM), a set of streams, their events.
// Invariants:
//  - Memory comes from one mmap'd region of `capacity_bytes`; the allocator never hands
//    out more than the cap, and fresh and freed bytes are poisoned (0x7fc0, a NaN in
//    fp32/bf16/fp16) so a read of uninitialised or freed memory shows up as NaN.
//    Freed ranges stay mapped: a late access reads poison instead of crashing.
//  - Each stream is a worker thread draining an in-order queue; the caller never runs
//    queued work itself, so a missing wait is a real race here, as on a GPU. An optional
//    seeded random delay before each operation makes such races show.
//  - Events are (stream, sequence number) pairs; waiting on one blocks the waiting
//    stream's worker, never the host.
//  - A buffer allocated on a stream is released in that stream's order (cudaFreeAsync);
//    one allocated without a stream is released once the whole device is idle. Until the
//    stream reaches the free, the block may be handed at once to the next allocation of the
//    same size on the same stream, as a GPU caching allocator does: everything that stream
//    runs for the new owner comes after the free (which poisons it), and other streams
//    reach it only through that stream's events.
//  - Copies can be throttled to a set rate per direction: they then take at least
//    bytes / rate, as a PCIe link would, and copies in the same direction share that rate
//    (each reserves the link after those already on it, whatever stream it runs on); the two
//    directions run at once. Matmuls can likewise be throttled to a set
//    GFLOP/s, so which resource bounds a step (compute, link, NVMe, CPU optimizer) is a
//    choice of the test, not an accident of the host's cores. A throttled copy's bytes and a
//    throttled matmul's product land when their time ends.
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <utility>

#include "core/range_pool.h"
#include "cpu/cpu_kernels.h"
#include "cpu/model_kernels.h"
#include "strata/adamw.h"
#include "strata/device.h"
#include "strata/error.h"
#include "strata/log.h"
#include "strata/system_info.h"
#include "strata/trace.h"

namespace strata {
namespace {

constexpr std::size_t kAlign = 256;  // like cudaMalloc
// The slowest throttle the emulated device takes (GB/s, GFLOP/s): a megabyte or a megaflop a
// second.
constexpr double kMinThrottle = 1e-3;

// `amount` (bytes, flops) at `rate` (GB/s, GFLOP/s) in nanoseconds, saturated at a day: a
// conversion past int64 is undefined (it gave a time in the past, no throttle at all).
std::chrono::nanoseconds throttle_ns(double amount, double rate) {
  return std::chrono::nanoseconds(static_cast<std::int64_t>(std::min(amount / rate, 86400e9)));
}
constexpr std::size_t kLargeStep = std::size_t(64) << 10;

// Set on stream worker threads: they must never wait for streams (their own among them).
thread_local bool t_in_stream_worker = false;

std::string gib(std::size_t b) { return fmt::format("{:.2f} GiB", b / double(1ull << 30)); }

void poison(void* p, std::size_t bytes) {
  auto* h = static_cast<std::uint16_t*>(p);
  std::fill_n(h, bytes / 2, kPoison16);
  if (bytes % 2) static_cast<unsigned char*>(p)[bytes - 1] = 0x7f;
}

class HostDevice;

// The part of a stream that its events, its buffers' frees and waiting streams share.
struct StreamCore {
  struct Op {
    std::function<void()> fn;
    const char* kind;
    std::uint64_t bytes;
    std::uint64_t seq;
  };

  StreamCore(std::string n, std::uint32_t delay_us, std::uint64_t seed, int threads)
      : name(std::move(n)), max_delay_us(delay_us), compute_threads(threads), rng(seed) {
    worker = std::thread([this] { run(); });
  }

  // Queues `fn`; false when the stream is shutting down (its worker has stopped taking work).
  bool enqueue(std::function<void()> fn, const char* kind, std::uint64_t bytes = 0) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (stopping) return false;
      q.push_back(Op{std::move(fn), kind, bytes, ++submitted});
    }
    cv_work.notify_one();
    return true;
  }

  std::uint64_t submitted_seq() {
    std::lock_guard<std::mutex> lock(mu);
    return submitted;
  }

  bool reached(std::uint64_t seq) {
    std::lock_guard<std::mutex> lock(mu);
    return completed >= seq;
  }

  void wait_for(std::uint64_t seq) {
    std::unique_lock<std::mutex> lock(mu);
    wait_locked(lock, seq);
  }

  // Waits for everything queued so far and returns (and clears) the first failure.
  std::exception_ptr drain() {
    std::unique_lock<std::mutex> lock(mu);
    wait_locked(lock, submitted);
    return std::exchange(error, nullptr);
  }
  // The first failure not yet reported, cleared (no wait).
  std::exception_ptr take_error() {
    std::lock_guard<std::mutex> lock(mu);
    return std::exchange(error, nullptr);
  }

  // Sleeps until op `seq` has completed. The worker wakes waiters only when it reaches the
  // earliest op one of them waits for (`wake_at`), not after every op: a host thread or
  // another stream waiting on a long queue would otherwise be woken, and take the lock, once
  // per op (measured: a forward of ~200 small ops ran 1.8x its kernels' time, the stream
  // idling between ops while the waiters it woke ran on the other core).
  void wait_locked(std::unique_lock<std::mutex>& lock, std::uint64_t seq) {
    while (completed < seq) {
      wake_at = std::min(wake_at, seq);
      cv_done.wait(lock);  // every waiter wakes at a notify and registers again if not done
    }
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stopping = true;
    }
    cv_work.notify_one();
    if (worker.joinable()) worker.join();
  }

  void run() {
    t_in_stream_worker = true;
    if (compute_threads > 0) omp_set_num_threads(compute_threads);  // this thread's teams
    Tracer& tracer = Tracer::global();
    for (;;) {
      Op op;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv_work.wait(lock, [&] { return stopping || !q.empty(); });
        if (q.empty()) return;  // stopping and drained
        op = std::move(q.front());
        q.pop_front();
      }
      if (max_delay_us > 0) {
        std::uniform_int_distribution<std::uint32_t> dist(0, max_delay_us);
        std::this_thread::sleep_for(std::chrono::microseconds(dist(rng)));
      }
      const std::int64_t t0 = tracer.enabled() ? tracer.now_ns() : 0;
      std::exception_ptr failure;
      try {
        // The callable (and what it captured) is destroyed here, before the op counts as done:
        // a buffer it held is freed before any wait for the op can return.
        std::function<void()> fn = std::move(op.fn);
        fn();
      } catch (...) {
        failure = std::current_exception();
      }
      if (t0) tracer.record(op.kind, name, t0, tracer.now_ns(), op.bytes);
      bool wake;
      {
        std::lock_guard<std::mutex> lock(mu);
        if (failure && !error) error = failure;
        completed = op.seq;
        wake = completed >= wake_at;
        if (wake) wake_at = UINT64_MAX;
      }
      if (wake) cv_done.notify_all();
    }
  }

  std::string name;
  std::uint32_t max_delay_us;
  int compute_threads;  // OpenMP threads of this worker's kernels; 0 = the default (every core)
  std::mt19937_64 rng;  // used by the worker only
  std::mutex mu;
  std::condition_variable cv_work, cv_done;
  std::deque<Op> q;
  std::uint64_t submitted = 0, completed = 0;
  std::uint64_t wake_at = UINT64_MAX;  // the earliest op a waiter waits for (see wait_locked)
  bool stopping = false;
  std::exception_ptr error;
  cpu::Matmul matmul;               // used by the worker only
  std::unique_ptr<CpuAdamW> adamw;  // made by the worker on first use
  std::thread worker;               // last: started after every other member exists
};

struct HostBlock {
  std::size_t offset = 0;
  std::size_t size = 0;  // rounded to kAlign
  std::weak_ptr<StreamCore> stream;
};

// A block freed on a stream that has not reached the free yet; `reused`: handed to a new
// block on the same stream, so the free poisons it but does not return it to the arena.
struct PendingFree {
  std::size_t offset = 0, size = 0;
  const StreamCore* stream = nullptr;
  bool reused = false;
};

class HostEvent final : public detail::EventImpl {
 public:
  explicit HostEvent(std::shared_ptr<StreamCore> c) : core(std::move(c)) {}
  bool query() override { return core->reached(seq); }
  void synchronize() override { core->wait_for(seq); }
  std::shared_ptr<StreamCore> core;
};

class HostDevice final : public Device {
 public:
  explicit HostDevice(const HostDeviceOptions& o)
      : opt_(o),
        arena_(std::min<std::size_t>(round_down(o.capacity_bytes) / 8, std::size_t(4) << 20)) {
    arena_.add_segment(round_down(o.capacity_bytes));
    STRATA_REQUIRE(o.capacity_bytes >= kAlign,
                   "HostDevice capacity_bytes must be at least {} bytes, got {}", kAlign,
                   o.capacity_bytes);
    // A throttle is 0 (off) or a rate a copy or a matmul ends at: 1e-300 made an infinite wait
    // that cast to a time in the past (no throttle at all), 1e-6 GFLOP/s a hang.
    const struct {
      const char *what, *unit;
      double v;
    } rates[] = {{"host-to-device copy rate (--emu-h2d-gbps)", "GB/s", o.h2d_gbps},
                 {"device-to-host copy rate (--emu-d2h-gbps)", "GB/s", o.d2h_gbps},
                 {"device-to-device copy rate", "GB/s", o.d2d_gbps},
                 {"matmul rate (--emu-compute-gflops)", "GFLOP/s", o.compute_gflops}};
    for (const auto& r : rates)
      STRATA_REQUIRE(r.v == 0 || (std::isfinite(r.v) && r.v >= kMinThrottle),
                     "the emulated device's {} is {} {}: give 0 (unthrottled) or at least {} {}",
                     r.what, r.v, r.unit, kMinThrottle, r.unit);
    STRATA_REQUIRE(o.compute_threads >= 0,
                   "HostDevice compute_threads must be >= 0 (0 = every core), got {}",
                   o.compute_threads);
    void* p = ::mmap(nullptr, o.capacity_bytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
      detail::throw_errno(
          __FILE__, __LINE__, "mmap", errno,
          fmt::format("cannot reserve {} for the emulated device{}", gib(o.capacity_bytes),
                      address_space_limit() != 0
                          ? address_space_note() +
                                ", or give the emulated device less memory (strata-train's and "
                                "strata-prof's --device-mem-gb)"
                          : std::string()));
    // Under an address-space limit, room beside the reservation for what the kernels map as they
    // run: oneDNN's code generation crashed (SIGSEGV) when it found none.
    if (const std::uint64_t limit = address_space_limit(); limit != 0) {
      const std::uint64_t used = address_space_used(), headroom = address_space_headroom();
      if (used + headroom > limit) {
        ::munmap(p, o.capacity_bytes);
        STRATA_THROW(
            kOutOfMemory,
            "the emulated device's {} leaves {} MiB of the process's address-space limit "
            "(`ulimit -v`, {} MiB), and its kernels and threads need about {} MiB beside it: "
            "raise "
            "the limit (`ulimit -v unlimited`), or give the emulated device less memory "
            "(strata-train's and strata-prof's --device-mem-gb)",
            gib(o.capacity_bytes), used < limit ? (limit - used) >> 20 : 0, limit >> 20,
            headroom >> 20);
      }
    }
    base_ = static_cast<char*>(p);
  }

  ~HostDevice() override {
    synchronize_quietly();
    for (Deferred& d : deferred_) delete d.block;
    ::munmap(base_, opt_.capacity_bytes);
  }

  DeviceKind kind() const override { return DeviceKind::kCpu; }
  std::string name() const override {
    return fmt::format("cpu-emulated (cap {})", log::human_bytes(double(opt_.capacity_bytes)));
  }

  std::unique_ptr<Stream> create_stream(std::string name) override;
  const model_ops::Backend* model_kernels() const override { return &cpu::host_model_ops(); }

  DeviceStats stats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    DeviceStats s = stats_;
    s.capacity_bytes = opt_.capacity_bytes;
    s.bytes_reserved = arena_.high_water();
    return s;
  }
  void reset_peak_stats() override {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.peak_bytes_in_use = stats_.bytes_in_use;
  }

  // Every stream drained, a failed one too (what a caller frees after catching must be idle);
  // the first failure is rethrown after, and the other streams keep theirs for their own
  // synchronize or the next device-wide one (as on a GPU; they were cleared unreported).
  void synchronize() override {
    // From a stream's own work it would wait for that work: a hang (CUDA forbids it too).
    STRATA_REQUIRE(!t_in_stream_worker,
                   "Device::synchronize inside a stream's host function: it would wait for "
                   "itself; wait outside, or record an event and make another stream wait on it");
    std::exception_ptr first;
    for (auto& core : live_streams()) {
      if (!first)
        first = core->drain();
      else
        core->wait_for(core->submitted_seq());
    }
    release_deferred();
    if (first) std::rethrow_exception(first);
  }

  const HostDeviceOptions& options() const { return opt_; }
  // Reserves the link in one direction (0: host to device, 1: device to host) for `bytes` at
  // `gbps`: returns when the copy may end, after every copy that reserved it before.
  std::chrono::steady_clock::time_point reserve_link(int dir, std::size_t bytes, double gbps) {
    std::lock_guard<std::mutex> lock(link_mu_);
    const auto start = std::max(std::chrono::steady_clock::now(), link_free_[dir]);
    link_free_[dir] = start + throttle_ns(double(bytes), gbps);
    return link_free_[dir];
  }
  void register_stream(const std::shared_ptr<StreamCore>& core) {
    std::lock_guard<std::mutex> lock(mu_);
    streams_.push_back(core);
  }

 protected:
  void* do_alloc(std::size_t bytes, Stream* stream, void** block) override;
  void do_free(void* block) noexcept override;
  void do_free_on(void* block, Stream& stream) noexcept override;

 private:
  static std::size_t round_up(std::size_t b) { return (b + kAlign - 1) / kAlign * kAlign; }
  static std::size_t round_down(std::size_t b) { return b / kAlign * kAlign; }

  std::vector<std::shared_ptr<StreamCore>> live_streams() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::shared_ptr<StreamCore>> out;
    std::erase_if(streams_, [](const std::weak_ptr<StreamCore>& w) { return w.expired(); });
    for (auto& w : streams_)
      if (auto s = w.lock()) out.push_back(std::move(s));
    return out;
  }

  void synchronize_quietly() noexcept {
    for (auto& core : live_streams()) core->wait_for(core->submitted_seq());
    release_deferred();
  }

  // Blocks freed without a stream from inside a stream's work (a host_fn dropping the last
  // reference): that thread cannot wait for the device, its own op included. Each waits for
  // what every stream had queued at its free (its own op included), and returns at the first
  // device-wide wait (synchronize, a failed allocation's) that finds all of that done.
  struct Deferred {
    HostBlock* block;
    std::vector<std::pair<std::weak_ptr<StreamCore>, std::uint64_t>> after;
  };
  void defer(HostBlock* b) {
    Deferred d{b, {}};
    for (auto& core : live_streams()) d.after.emplace_back(core, core->submitted_seq());
    std::lock_guard<std::mutex> lock(mu_);
    deferred_.push_back(std::move(d));
  }
  void release_deferred() noexcept {
    std::vector<HostBlock*> ready;
    {
      std::lock_guard<std::mutex> lock(mu_);
      std::erase_if(deferred_, [&](const Deferred& d) {
        for (const auto& [w, seq] : d.after)
          if (auto core = w.lock(); core && !core->reached(seq)) return false;
        ready.push_back(d.block);
        return true;
      });
    }
    for (HostBlock* b : ready) release(b);
  }

  // A block no stream orders the free of, once the device is idle.
  void release(HostBlock* b) noexcept {
    if (opt_.poison) poison(base_ + b->offset, b->size);
    {
      std::lock_guard<std::mutex> lock(mu_);
      arena_.free(b->offset, b->size);
      stats_.bytes_in_use -= b->size;
      ++stats_.num_frees;
      delete b;
    }
    freed_cv_.notify_all();  // an allocation waiting on another thread may fit now
  }

  // A free queued on a stream, now reached: poisoned (for its next owner too, if reused)
  // and, unless reused, returned to the arena.
  void release_pending(PendingFree& pf) noexcept {
    if (opt_.poison) poison(base_ + pf.offset, pf.size);
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.num_frees;
      --pending_frees_;
      if (!pf.reused) {
        for (auto [lo, hi] = pending_.equal_range(pf.size); lo != hi; ++lo)
          if (lo->second.get() == &pf) {
            pending_.erase(lo);
            break;
          }
        arena_.free(pf.offset, pf.size);
        stats_.bytes_in_use -= pf.size;
      }
    }
    freed_cv_.notify_all();
  }

  HostDeviceOptions opt_;
  std::mutex link_mu_;
  std::chrono::steady_clock::time_point link_free_[2] = {};  // when each direction is free
  char* base_ = nullptr;
  mutable std::mutex mu_;
  // The emulated HBM: one segment, [0, cap). Small blocks (below cap/8, at most 4 MiB) from the
  // top: with cap/64 (at most 1 MiB) as the boundary, the demo (a ~17 MB working set) failed at an
  // 18 MiB cap with 7 MB free in pieces of at most 2.7 MB, none large enough for one layer.
  detail::RangePool arena_;
  DeviceStats stats_;
  // Frees queued on streams and not yet run; freed_cv_ is notified as each runs. The blocks
  // of those not yet reused, by size.
  std::size_t pending_frees_ = 0;
  std::condition_variable freed_cv_;
  std::multimap<std::size_t, std::shared_ptr<PendingFree>> pending_;
  std::vector<std::weak_ptr<StreamCore>> streams_;
  std::vector<Deferred> deferred_;  // see defer()
  friend class HostStream;
};

class HostStream final : public Stream {
 public:
  HostStream(HostDevice* dev, std::string name, std::shared_ptr<StreamCore> core)
      : Stream(dev, std::move(name)), dev_(dev), core_(std::move(core)) {}

  ~HostStream() override {
    core_->stop();  // drains the queue first
    mark_destroyed();
    warn_unreported(core_->take_error(), "failure");
  }

  const std::shared_ptr<StreamCore>& core() const { return core_; }

 protected:
  void do_copy(MemRef dst, MemRef src) override {
    double gbps = 0;
    int link = -1;  // the direction of the host<->device link it uses
    const char* kind = "copy_h2h";
    if (src.space == MemSpace::kHost && dst.space == MemSpace::kDevice) {
      gbps = dev_->options().h2d_gbps;
      link = 0;
      kind = "copy_h2d";
    } else if (src.space == MemSpace::kDevice && dst.space == MemSpace::kHost) {
      gbps = dev_->options().d2h_gbps;
      link = 1;
      kind = "copy_d2h";
    } else if (src.space == MemSpace::kDevice) {
      gbps = dev_->options().d2d_gbps;
      kind = "copy_d2d";
    }
    submit(
        [dst, src, gbps, link, dev = dev_] {
          if (gbps <= 0) {  // unthrottled: as fast as memmove goes
            std::memmove(dst.ptr, src.ptr, src.bytes);
            return;
          }
          // Throttled: the host<->device link is one per direction, taken in turn by every
          // stream's copies; a device-to-device copy has its own bandwidth. bytes / (GB/s) = ns.
          const auto end =
              link >= 0 ? dev->reserve_link(link, src.bytes, gbps)
                        : std::chrono::steady_clock::now() + throttle_ns(double(src.bytes), gbps);
          // The bytes land when the transfer ends, as a DMA's do: a reader on another stream
          // that misses its wait sees the old contents for the whole transfer, not only for the
          // memmove's first microseconds.
          std::this_thread::sleep_until(end);
          std::memmove(dst.ptr, src.ptr, src.bytes);
        },
        kind, src.bytes);
  }

  Event do_record() override {
    auto e = std::make_shared<HostEvent>(core_);
    e->device = dev_;
    e->stream = life();
    e->seq = core_->submitted_seq();
    return Event(std::move(e));
  }

  void do_wait(const Event& event) override {
    auto* he = dynamic_cast<HostEvent*>(event.impl().get());
    STRATA_CHECK(he != nullptr, "event of another backend passed to a HostDevice stream");
    if (he->core == core_) return;  // already in this stream's order
    submit([other = he->core, seq = he->seq] { other->wait_for(seq); }, "wait_event");
  }

  void do_synchronize() override {
    STRATA_REQUIRE(!t_in_stream_worker,
                   "Stream::synchronize of '{}' inside a stream's host function: a hang where "
                   "it is that stream's (CUDA forbids it on any); wait outside, or make a stream "
                   "wait on an event",
                   name());
    if (auto err = core_->drain()) std::rethrow_exception(err);
  }

  void do_host_fn(std::function<void()> fn, const char* trace_name,
                  std::uint64_t trace_bytes) override {
    submit(std::move(fn), trace_name, trace_bytes);
  }

  void do_fill(TensorRef x, float v) override {
    submit([x, v] { cpu::fill(x.dtype, x.mem.ptr, x.numel, v); }, "fill", x.mem.bytes);
  }
  void do_axpy(float a, TensorRef x, TensorRef y) override {
    submit([a, x, y] { cpu::axpy(a, x.dtype, x.mem.ptr, y.dtype, y.mem.ptr, x.numel); }, "axpy",
           x.mem.bytes + y.mem.bytes);
  }
  void do_scale(float a, TensorRef x) override {
    submit([a, x] { cpu::scale(a, x.dtype, x.mem.ptr, x.numel); }, "scale", x.mem.bytes);
  }
  void do_add(TensorRef a, TensorRef b, TensorRef out) override {
    submit(
        [a, b, out] {
          cpu::add(a.dtype, a.mem.ptr, b.dtype, b.mem.ptr, out.dtype, out.mem.ptr, a.numel);
        },
        "add", a.mem.bytes + b.mem.bytes + out.mem.bytes);
  }
  void do_cast(TensorRef s, TensorRef d) override {
    submit([s, d] { cpu::cast(s.dtype, s.mem.ptr, d.dtype, d.mem.ptr, s.numel); }, "cast",
           s.mem.bytes);
  }
  void do_sum_squares(TensorRef x, TensorRef out) override {
    submit(
        [x, out] {
          *static_cast<float*>(out.mem.ptr) = cpu::sum_squares(x.dtype, x.mem.ptr, x.numel);
        },
        "sum_squares", x.mem.bytes);
  }
  void do_matmul(const MatmulDesc& d) override {
    const double gflops = dev_->options().compute_gflops;
    submit(
        [d, gflops, core = core_.get()] {
          const auto t0 = std::chrono::steady_clock::now();
          if (gflops <= 0) {
            core->matmul.run(d);
            return;
          }
          // Throttled: at least flops / (GFLOP/s) nanoseconds (a lower bound, as for copies), and
          // the product lands when that time ends, as a kernel's: computed aside (from C when it
          // accumulates), so a reader on another stream missing its wait sees the old C throughout.
          const double flops = 2.0 * double(d.m) * double(d.n) * double(d.k);
          const std::size_t c_bytes =
              std::size_t(d.m) * std::size_t(d.n) * dtype_size(d.c.dtype);  // what it writes
          thread_local std::vector<float> aside;
          aside.resize((c_bytes + 3) / 4);
          if (d.beta != 0.0f) std::memcpy(aside.data(), d.c.mem.ptr, c_bytes);
          MatmulDesc t = d;
          t.c.mem.ptr = aside.data();
          core->matmul.run(t);
          std::this_thread::sleep_until(t0 + throttle_ns(flops, gflops));
          std::memcpy(d.c.mem.ptr, aside.data(), c_bytes);
        },
        "matmul", d.a.mem.bytes + d.b.mem.bytes + d.c.mem.bytes);
  }
  // Runs the CPU AdamW (every core, the best ISA) on the stream's worker: the emulated
  // device's memory is host memory, so the shards are passed on as host tensors.
  void do_adamw(const AdamWDesc& d) override {
    std::uint64_t bytes = 0;
    for (const AdamWShard& sh : d.shards)
      bytes += sh.params.mem.bytes + sh.grads.mem.bytes + sh.m.mem.bytes + sh.v.mem.bytes +
               sh.params_src.mem.bytes + sh.m_src.mem.bytes + sh.v_src.mem.bytes;
    submit(
        [d, core = core_.get()] {
          if (!core->adamw) core->adamw = std::make_unique<CpuAdamW>();
          std::vector<AdamWShard> host;
          host.reserve(d.shards.size());
          // Optional tensors that are not set stay empty.
          auto as_host = [](const TensorRef& t) {
            return t.mem.ptr != nullptr ? host_tensor(t.mem.ptr, t.dtype, t.numel) : TensorRef{};
          };
          for (const AdamWShard& sh : d.shards) {
            host.push_back({as_host(sh.params), as_host(sh.grads), as_host(sh.m), as_host(sh.v),
                            as_host(sh.copy_out), as_host(sh.params_src), as_host(sh.m_src),
                            as_host(sh.v_src), sh.decay});
          }
          const AdamWResult r = core->adamw->step(d.options, host, d.policy);
          if (d.non_finite.mem.ptr)
            *static_cast<float*>(d.non_finite.mem.ptr) = static_cast<float>(r.non_finite);
        },
        "adamw", bytes);
  }

 private:
  void submit(std::function<void()> fn, const char* kind, std::uint64_t bytes = 0) {
    const bool ok = core_->enqueue(std::move(fn), kind, bytes);
    STRATA_CHECK(ok, "stream '{}' is shutting down", name());
  }

  HostDevice* dev_;
  std::shared_ptr<StreamCore> core_;
};

std::unique_ptr<Stream> HostDevice::create_stream(std::string name) {
  std::uint64_t index;
  {
    std::lock_guard<std::mutex> lock(mu_);
    index = streams_.size() + stats_.num_allocs;  // varies the per-stream seed
  }
  auto core = std::make_shared<StreamCore>(
      name, opt_.random_delay_us, opt_.seed * 0x9e3779b97f4a7c15ull + index, opt_.compute_threads);
  register_stream(core);
  return std::make_unique<HostStream>(this, std::move(name), std::move(core));
}

void* HostDevice::do_alloc(std::size_t bytes, Stream* stream, void** block) {
  std::size_t size = round_up(bytes);
  // Large blocks in 64 KiB steps (a GPU caching allocator rounds its large blocks too): a
  // layer's gradient shard and its gathered weights, a few KiB apart, then fit each other's
  // holes instead of leaving a free range a few KiB too small.
  // (Not past the arena: the whole cap stays allocatable when it is not a multiple of 64 KiB.)
  if (size >= arena_.small_limit())
    size = std::max(size, std::min((size + kLargeStep - 1) / kLargeStep * kLargeStep,
                                   round_down(opt_.capacity_bytes)));
  std::size_t off = SIZE_MAX;
  std::unique_lock<std::mutex> lock(mu_);
  // A block of this size whose free is still queued on the same stream: the stream's order
  // protects it (see the file's head). Its bytes stay in use, now the new block's.
  if (stream) {
    const StreamCore* core = static_cast<HostStream*>(stream)->core().get();
    const auto [lo, hi] = pending_.equal_range(size);
    for (auto it = lo; it != hi; ++it) {
      if (it->second->stream != core) continue;
      it->second->reused = true;
      auto* b = new HostBlock{it->second->offset, size, static_cast<HostStream*>(stream)->core()};
      pending_.erase(it);
      ++stats_.num_allocs;
      ++stats_.num_reused;
      *block = b;
      return base_ + b->offset;
    }
  }
  const auto take = [&] {
    off = size >= bytes && size <= opt_.capacity_bytes - stats_.bytes_in_use ? arena_.alloc(size)
                                                                             : SIZE_MAX;
    return off != SIZE_MAX;
  };
  if (!take() && !t_in_stream_worker) {
    // Frees are stream-ordered: memory the caller already freed returns only when its
    // stream reaches the free. Like a GPU caching allocator on a failed allocation (which
    // waits for the cached blocks it releases, not for the device), wait until enough of the
    // queued frees have run; only when none is left, for every stream, once.
    ++stats_.num_alloc_waits;
    lock.unlock();
    TraceScope span("alloc_wait", "engine", size);  // the calling thread stalls: show it
    lock.lock();
    freed_cv_.wait(lock, [&] { return take() || pending_frees_ == 0; });
    // Blocks freed inside a stream's work return at a device-wide wait; with none of those, no
    // stream has memory to give back, and the request fails now, as on a GPU (it waited for
    // every stream, however long their work, or for a host function that was waiting on this
    // thread: a hang where the GPU says out of memory).
    if (off == SIZE_MAX && !deferred_.empty()) {
      lock.unlock();
      synchronize_quietly();
      lock.lock();
      take();
    }
  }
  if (off == SIZE_MAX) {
    ++stats_.num_alloc_failures;
    STRATA_THROW(kOutOfMemory,
                 "emulated device cannot allocate {} bytes{}: {} bytes in use of a {}-byte cap "
                 "(largest free range {} bytes); lower the request or raise the device memory cap",
                 bytes, size != bytes ? fmt::format(" ({} as allocated)", size) : std::string(),
                 stats_.bytes_in_use, opt_.capacity_bytes, arena_.largest_free());
  }
  stats_.bytes_in_use += size;
  stats_.peak_bytes_in_use = std::max(stats_.peak_bytes_in_use, stats_.bytes_in_use);
  ++stats_.num_allocs;
  lock.unlock();
  auto* b = new HostBlock{off, size, {}};
  if (stream) b->stream = static_cast<HostStream*>(stream)->core();
  if (opt_.poison) poison(base_ + off, size);
  *block = b;
  return base_ + off;
}

void HostDevice::do_free_on(void* block, Stream& stream) noexcept {
  static_cast<HostBlock*>(block)->stream = static_cast<HostStream&>(stream).core();
  do_free(block);
}

void HostDevice::do_free(void* block) noexcept {
  auto* b = static_cast<HostBlock*>(block);
  if (auto core = b->stream.lock()) {
    auto pf = std::make_shared<PendingFree>(PendingFree{b->offset, b->size, core.get(), false});
    bool queued = false;
    {
      // Queued and offered for reuse in one critical section (mu_, then the stream's lock): an
      // allocation on this stream that takes the block queues its work behind this free, never
      // ahead of it (the free's poison would land on the new owner's data).
      std::lock_guard<std::mutex> lock(mu_);
      queued = core->enqueue([this, pf] { release_pending(*pf); }, "free");
      if (queued) {
        ++pending_frees_;
        pending_.emplace(b->size, pf);
      }
    }
    if (queued) {
      delete b;
      return;
    }
    b->stream.reset();  // the stream is stopping: free it here, once the device is idle
  }
  if (t_in_stream_worker) {
    defer(b);
    return;
  }
  synchronize_quietly();
  release(b);
}

}  // namespace

std::unique_ptr<Device> make_host_device(const HostDeviceOptions& options) {
  return std::make_unique<HostDevice>(options);
}

}  // namespace strata
