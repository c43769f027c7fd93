// strata-prof's measuring: the machine (pinned H2D / D2H, device and host memory passes, NVMe
// write and read through the engine's own swap store, CPU and device AdamW, collectives) and the
// model (per-unit forward / backward time and activation bytes from real micro-batches of a 1-
// and a 2-layer copy of it), agreed across ranks.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <utility>

#include "prof.h"
#include "strata/adamw.h"
#include "strata/comm.h"
#include "strata/engine.h"
#include "strata/error.h"
#include "strata/kernels.h"
#include "strata/nvme.h"
#include "strata/pinned_pool.h"
#include "strata/system_info.h"

namespace strata::prof {
namespace {

// ---- measuring the machine ----
template <class F>
double best_of(int reps, F f) {
  double best = 1e300;
  for (int i = 0; i < reps; ++i) best = std::min(best, f());
  return best;
}

// The median of `reps` runs: for what the steps will meet rather than a bound. A virtualised
// drive's rate moves by tens of percent from one short window to the next; the fastest of a few
// windows is a rate the validated steps rarely see.
template <class F>
double median_of(int reps, F f) {
  std::vector<double> v;
  for (int i = 0; i < reps; ++i) v.push_back(f());
  return median(std::move(v));
}

// The line through the times of an operation at two sizes (`small` taking `t_small`, `big`
// taking `t_big`): its fixed time (at least 0) and the rate of its size. None where the pair
// gives no such line (a noisy pair: the small one no faster).
struct TimeLine {
  double fixed_s = 0, rate = 0;
};
std::optional<TimeLine> line_through(double small, double t_small, double big, double t_big) {
  if (!(small < big && t_small < t_big)) return std::nullopt;
  const double rate = (big - small) / (t_big - t_small);
  return TimeLine{std::max(0.0, t_small - small / rate), rate};
}

// Several ranks: every rank searches with the same figures, the slowest rank's (the lowest rate,
// the longest time, the smallest capacity: a data-parallel step waits for its slowest rank),
// so all of them rank the candidates alike and validate the same ones. One all-reduce (max)
// of the figures, rates and capacities negated.
void agree_across_ranks(Communicator& comm, MachineProfile& m, std::vector<ModelProfile>& models) {
  if (comm.world_size() <= 1) return;
  std::vector<double*> lowest = {&m.h2d_bps,
                                 &m.d2h_bps,
                                 &m.device_mem_bps,
                                 &m.free_bps,
                                 &m.host_mem_bps,
                                 &m.host_norm_bps,
                                 &m.nvme_read_bps,
                                 &m.nvme_write_bps,
                                 &m.nvme_mixed_bps,
                                 &m.nvme_fetch_read_bps,
                                 &m.cpu_adamw_params_per_s,
                                 &m.device_adamw_params_per_s,
                                 &m.all_gather_bps,
                                 &m.reduce_scatter_bps,
                                 &m.tp_all_reduce_bps};
  std::vector<std::uint64_t*> lowest_bytes = {&m.device_capacity, &m.host_capacity, &m.nvme_free,
                                              &m.ram_capacity};
  std::vector<double*> highest = {
      &m.nvme_request_s,       &m.nvme_mixed_request_s, &m.nvme_mixed_deep_request_s,
      &m.nvme_subgroup_s,      &m.nvme_fetch_request_s, &m.cpu_adamw_call_s,
      &m.nvme_compute_slowdown};
  std::vector<std::uint64_t*> highest_bytes = {&m.ram_base_bytes};
  for (ModelProfile& mp : models) {
    for (UnitCost& u : mp.units) {
      highest.push_back(&u.forward_s);
      highest.push_back(&u.backward_s);
      // (TP ranks' slices differ where the vocabulary does not divide: every rank plans the
      // largest, so all of them keep the same candidates)
      for (std::uint64_t* b : {&u.numel, &u.tp_forward_bytes, &u.tp_backward_bytes})
        highest_bytes.push_back(b);
    }
    highest_bytes.push_back(&mp.activation_bytes);
    highest.push_back(&mp.device_cores);
  }
  std::vector<double> v;
  for (double* x : lowest) v.push_back(-*x);
  for (std::uint64_t* x : lowest_bytes) v.push_back(-double(*x));
  for (double* x : highest) v.push_back(*x);
  for (std::uint64_t* x : highest_bytes) v.push_back(double(*x));
  max_across_ranks(comm, v);
  std::size_t i = 0;
  for (double* x : lowest) *x = -v[i++];
  for (std::uint64_t* x : lowest_bytes) *x = bytes_from_double(-v[i++]);
  for (double* x : highest) *x = v[i++];
  for (std::uint64_t* x : highest_bytes) *x = bytes_from_double(v[i++]);
}

}  // namespace

double host_copy_bps(char* dst, const char* src, std::size_t bytes) {
  const double t = best_of(3, [&] {
    const auto t0 = Clock::now();
    std::memcpy(dst, src, bytes);
    return since(t0);
  });
  return t > 0 ? 2.0 * double(bytes) / t : 0;
}

namespace {

// The copy and memory rates: pinned H2D and D2H, a device fill, a free on its stream, a host
// memcpy and the engine's gradient-norm pass, each best of 3 over `bytes`.
void measure_copy_rates(Device& dev, Stream& s, PinnedBlock& host, Buffer& d, std::size_t bytes,
                        MachineProfile& m) {
  const double h2d = best_of(3, [&] {
    const auto t0 = Clock::now();
    s.copy(d.ref(), host_ref(host.data(), bytes));
    s.synchronize();
    return since(t0);
  });
  const double d2h = best_of(3, [&] {
    const auto t0 = Clock::now();
    s.copy(host_ref(host.data(), bytes), d.ref());
    s.synchronize();
    return since(t0);
  });
  m.h2d_bps = double(bytes) / h2d;
  m.d2h_bps = double(bytes) / d2h;
  const double fill = best_of(3, [&] {
    const auto t0 = Clock::now();
    s.fill(tensor(d, DType::kF32, bytes / 4), 0.0f);
    s.synchronize();
    return since(t0);
  });
  m.device_mem_bps = double(bytes) / fill;
  // What a free costs on its stream (the emulated device poisons freed memory).
  const double fr = best_of(3, [&] {
    Buffer t = dev.alloc(bytes, &s);
    s.synchronize();
    const auto t0 = Clock::now();
    t.reset();
    s.synchronize();
    return since(t0);
  });
  m.free_bps = fr > 0 ? double(bytes) / fr : 0;
  std::vector<char> h1(bytes), h2(bytes, 2);
  m.host_mem_bps = host_copy_bps(h1.data(), h2.data(), bytes);
  // The engine's gradient-norm pass over host gradients.
  {
    volatile float sink = 0;
    const double t = best_of(3, [&] {
      const auto t0 = Clock::now();
      sink = cpu::sum_squares(DType::kF32, h1.data(), bytes / 4);
      return since(t0);
    });
    (void)sink;
    m.host_norm_bps = double(bytes) / t;
  }
}

// The host's cache written over, on the CPU-emulated device, before each timed repetition: in a
// step the weights a layer reads were last used a step (or a forward) ago, and since then the
// rest of the step (the other layers, the optimizer's state, the copies, the drive's transfers)
// has passed through the cache; a 2-layer copy run again and again finds them there (on an Intel
// Xeon VM with a 480 MiB L3 the demo model's layer timed 26% short forward and 9-16% backward, and
// the NVMe regime's traced compute lanes came out 6-58% longer than replayed). 1.5 times the
// last-level cache, at most 1 GiB. It runs on the stream that then computes, as a step's other
// work on that stream runs there: written over from the host thread, the stream's worker slept
// through it (70 ms and more) and its kernels' OpenMP team came back on one core for the
// micro-batch that followed (Intel Xeon VM, 2 cores, capped to AVX2, 2026-12-04: a wide layer at
// B = 4 timed 5.0 ms forward and 10.0 backward at 1.01 cores busy, against 3.5 and 6.7 at 1.58
// with the cache written over on the stream and 3.3 and 6.5 at 1.55 not written over; in the
// traced steps the layers ran at the latter speeds, and strata-prof predicted every offloaded
// placement 4-18% slow in two runs).
// (The host's own work, the CPU AdamW's, writes it over on the calling thread: here().)
class CacheEvictor {
 public:
  CacheEvictor() {
    const std::size_t llc = cpu::last_level_cache_bytes();
    buf_.resize(std::min(llc + llc / 2, std::size_t(1) << 30));
  }
  // For the device's kernels: on a GPU, which has no such cache to write over, nothing.
  explicit CacheEvictor(const Device& dev) {
    if (dev.kind() == DeviceKind::kCpu) *this = CacheEvictor();
  }
  // Writes the cache over on this thread: every line of the buffer read and written, so each
  // one is brought into the cache. Not memset: glibc's memset of this size is `rep stosb`, which
  // a CPU may carry out with stores that do not allocate lines (on the AMD EPYC Zen 5 VM, 32 MiB
  // L3, 2026-12-05, the demo's layer at B = 1 timed 8-10% shorter forward after a memset than
  // after this, in two sets of four runs each in turns: 0.50-0.51 against 0.55-0.57 ms and
  // 0.57-0.64 against 0.63-0.71).
  void here() {
    volatile unsigned char* b = buf_.data();
    for (std::size_t i = 0; i < buf_.size(); i += 64) b[i] = static_cast<unsigned char>(b[i] + 1);
  }
  // Writes the cache over on `s` and waits for it (nothing on a GPU).
  void operator()(Stream& s) {
    if (buf_.empty()) return;
    s.host_fn([this] { here(); }, "evict_cache");
    s.synchronize();
  }

 private:
  std::vector<unsigned char> buf_;
};

// AdamW: 8M parameters, the compute dtype's copy-out, on the CPU and on the device. The CPU's as
// the engine calls it: one call a sub-group, on state and gradients the cache does not hold (a
// step's optimizer state is far larger than any cache, and each sub-group is stepped once). One
// pass over the 8M in calls of a size, after the cache is written over; the line through two
// sizes is a call's fixed time (the threads' start and join) and its parameters' rate. Stepped
// in the cache, as a single 8M call best of 3, the Intel Xeon VM (480 MiB L3) ran 2.2-2.5 G
// params/s, while the validated steps' 90112-parameter sub-groups took twice what that says.
// Master, m and v lie as the engine holds them: one block, optimizer_state_stride apart.
void measure_adamw_rates(Device& dev, Stream& s, const EngineConfig& base, MachineProfile& m) {
  const std::size_t n = std::size_t(8) << 20, stride = optimizer_state_stride(n);
  const DType ct = base.compute_dtype;
  std::vector<float> state(3 * stride, 0.0f), g(n, 1e-3f);
  std::fill_n(state.begin(), n, 0.5f);
  float* const p = state.data();
  float* const mm = p + stride;
  float* const v = p + 2 * stride;
  std::vector<std::uint16_t> out16(n);
  // The path the engine will run (strata.optimizer_isa).
  STRATA_REQUIRE(isa_supported(base.optimizer_isa),
                 "config key 'strata.optimizer_isa' = \"{}\": {}; use \"auto\"",
                 isa_name(base.optimizer_isa), isa_unavailable(base.optimizer_isa));
  CpuAdamW adam({.isa = base.optimizer_isa});
  AdamWOptions o;
  AdamWShard sh{host_tensor(p, DType::kF32, n),
                host_tensor(g.data(), DType::kF32, n),
                host_tensor(mm, DType::kF32, n),
                host_tensor(v, DType::kF32, n),
                {}};
  if (ct != DType::kF32) sh.copy_out = host_tensor(out16.data(), ct, n);
  adam.step(o, sh);
  CacheEvictor evict;
  // The time of one call of `len` parameters, cold.
  auto per_call = [&](std::size_t len) {
    return median_of(3,
                     [&] {
                       evict.here();
                       const auto t0 = Clock::now();
                       for (std::size_t a = 0; a < n; a += len) {
                         const std::size_t k = std::min(len, n - a);
                         AdamWShard part{host_tensor(p + a, DType::kF32, k),
                                         host_tensor(g.data() + a, DType::kF32, k),
                                         host_tensor(mm + a, DType::kF32, k),
                                         host_tensor(v + a, DType::kF32, k),
                                         {}};
                         if (ct != DType::kF32)
                           part.copy_out = host_tensor(out16.data() + a, ct, k);
                         adam.step(o, part);
                       }
                       return since(t0);
                     }) /
           double((n + len - 1) / len);
  };
  const std::size_t small = std::size_t(16) << 10, big = std::size_t(1) << 20;
  const double t_small = per_call(small), t_big = per_call(big);
  m.cpu_adamw_params_per_s = double(big) / t_big;  // (no line: the big calls' rate alone)
  m.cpu_adamw_call_s = 0;
  if (const auto line = line_through(double(small), t_small, double(big), t_big)) {
    m.cpu_adamw_call_s = line->fixed_s;
    m.cpu_adamw_params_per_s = line->rate;
  }
  Buffer dp = dev.alloc(n * 4), dg = dev.alloc(n * 4), dm = dev.alloc(n * 4), dv = dev.alloc(n * 4);
  Buffer dout = dev.alloc(n * 2);
  for (Buffer* b : {&dp, &dg, &dm, &dv}) s.fill(tensor(*b, DType::kF32, n), 0.01f);
  AdamWDesc desc;
  desc.options = o;
  desc.policy = NonFinitePolicy::kReportOnly;
  desc.shards.push_back({tensor(dp, DType::kF32, n), tensor(dg, DType::kF32, n),
                         tensor(dm, DType::kF32, n), tensor(dv, DType::kF32, n),
                         ct != DType::kF32 ? tensor(dout, ct, n) : TensorRef{}});
  s.adamw(desc);
  s.synchronize();
  const double td = best_of(3, [&] {
    const auto t0 = Clock::now();
    s.adamw(desc);
    s.synchronize();
    return since(t0);
  });
  m.device_adamw_params_per_s = double(n) / td;
}

// The rates the host's cores set (copies, memory passes, AdamW): measured twice, a second
// or so apart (the NVMe runs between), and the better of each kept: on a shared machine a
// burst of someone else's work can slow one best-of-3 as a whole.
void measure_rates(Device& dev, Stream& s, PinnedBlock& host, Buffer& d, std::size_t bytes,
                   const EngineConfig& base, MachineProfile& m) {
  measure_copy_rates(dev, s, host, d, bytes, m);
  measure_adamw_rates(dev, s, base, m);
}

// The kernels' drive load (DriveLoad, below): 16 keys of 4 MiB in a store of its own under the
// same folder, made after measure_nvme's is gone.
constexpr std::size_t kDriveLoadExtent = std::size_t(4) << 20, kDriveLoadKeys = 16;
constexpr std::uint64_t kDriveLoadScratchBytes = kDriveLoadExtent * kDriveLoadKeys;

// The sizes measure_nvme's requests take, from the largest unit's optimizer state and weight
// shard (`unit_state_bytes`, `unit_weight_bytes`) and the aio block, and the scratch files they
// fill: each set of keys reserved once and kept to the end of the measurement.
struct NvmeSizes {
  std::size_t extent = 0, count = 0;  // the x keys: one unit's state, 128 MiB of them
  std::size_t mixed_small = std::size_t(256) << 10, mixed_small_n = 0;  // the m keys
  std::size_t read_small = std::size_t(64) << 10, reads = 16;           // the s keys
  std::size_t w_extent = 0;                                             // the w keys, count
  std::size_t piece = 0, pieces = 0, one_read = 0, split_units = 0;     // the p keys
  bool split_fetch() const { return pieces > one_read; }
  std::uint64_t scratch_bytes() const {
    const auto keys = [](std::size_t bytes, std::size_t n) {
      return std::uint64_t(SwapStore::padded_bytes(bytes)) * n;
    };
    std::uint64_t b = keys(extent, count);
    if (mixed_small < extent) b += keys(mixed_small, mixed_small_n);
    if (read_small != extent) b += keys(read_small, reads);
    if (w_extent != extent) b += keys(w_extent, count);
    if (split_fetch() && piece != extent) b += keys(piece, split_units * pieces);
    return b;
  }
};
NvmeSizes nvme_sizes(const EngineConfig& base, std::size_t unit_state_bytes,
                     std::size_t unit_weight_bytes) {
  NvmeSizes z;
  z.extent = SwapStore::padded_bytes(
      std::clamp<std::size_t>(unit_state_bytes, std::size_t(1) << 20, std::size_t(16) << 20));
  z.count = std::max<std::size_t>(8, (std::size_t(128) << 20) / z.extent);
  z.mixed_small_n = std::max<std::size_t>(z.count, 64);
  z.w_extent = SwapStore::padded_bytes(std::clamp<std::size_t>(unit_weight_bytes, 4096, z.extent));
  const std::size_t block = std::max<std::size_t>(base.aio.block_size, 4096);
  z.piece = std::min<std::size_t>(std::size_t(64) << 10, block);
  z.pieces = z.w_extent / z.piece;
  z.one_read = (z.w_extent + block - 1) / block;
  z.split_units = std::min<std::size_t>(z.count, 8);
  return z;
}

// The drive's scratch files (`bytes`, or the kernels' drive load's where that is more) must fit the
// free space under `dir` (this rank's share of it): said before any is written, with both ways out.
// The swap store alone refused only once a reserve failed, naming neither how much the measurement
// needs nor --no-nvme.
void require_nvme_scratch(Communicator& comm, const std::string& dir, const std::string& key,
                          std::uint64_t bytes) {
  const std::uint64_t need = std::max<std::uint64_t>(bytes, kDriveLoadScratchBytes);
  const std::uint64_t free =
      SwapStore::free_bytes({dir}, comm.rank(), key, ranks_on_this_node(comm), comm.world_size());
  STRATA_REQUIRE(need <= free,
                 "{} {}: strata-prof measures the drive with {} of scratch files there{} and {} "
                 "are free: free space there, give --nvme-path on a drive with more, or --no-nvme "
                 "to leave NVMe out of the search",
                 key, dir, human(double(need)),
                 ranks_on_this_node(comm) > 1 ? " (each rank of this node its own)" : "",
                 human(double(free)));
}

// The optimizer's traffic on `store`: request i reads (even i) or writes (odd i) `bytes` between
// bufs[i % bufs.size()] and key(i), `in_flight` at once (reads ahead, writes behind), for as long
// as more(i) says before each; done() after each one completes. Returns when all have.
template <class Key, class More, class Done>
void run_mix(SwapStore& store, const std::vector<PinnedBlock>& bufs, std::size_t bytes,
             std::size_t in_flight, Key key, More more, Done done) {
  std::deque<IoHandle> hs;
  auto complete_one = [&] {
    hs.front().wait();
    hs.pop_front();
    done();
  };
  for (std::size_t i = 0;; ++i) {
    if (hs.size() >= in_flight) complete_one();
    if (!more(i)) break;
    void* b = bufs[i % bufs.size()].data();
    const std::string k = key(i);
    hs.push_back(i % 2 ? store.write(k, b, bytes) : store.read(k, b, bytes));
  }
  while (!hs.empty()) complete_one();
}

// The mix's time over the `n` keys `prefix`0.. of `bytes` each, `in_flight` requests in flight
// (run_mix): the median of 3 passes.
double mixed_pass_s(SwapStore& store, const std::vector<PinnedBlock>& bufs,
                    const std::string& prefix, std::size_t bytes, std::size_t n,
                    std::size_t in_flight) {
  return median_of(3, [&] {
    const auto t0 = Clock::now();
    run_mix(
        store, bufs, bytes, in_flight,
        [&](std::size_t i) { return fmt::format("{}{}", prefix, i); },
        [&](std::size_t i) { return i < n; }, [] {});
    return since(t0);
  });
}

// NVMe: the engine's swap store, as the engine drives it: extents of one unit's optimizer
// state, two in flight (the optimizer reads one ahead; a fetch reads the next unit while
// the current one is in use). A drive reaches its sequential rate only with many requests
// in flight; the engine rarely has them, and the model must see the rate it gets.
void measure_nvme(Communicator& comm, PinnedPool& pool, const EngineConfig& base,
                  const std::string& nvme_dir, const std::vector<std::string>& all_nvme_paths,
                  const std::string& nvme_key, std::size_t unit_state_bytes,
                  std::size_t unit_weight_bytes, double sustain_s, MachineProfile& m,
                  DriveProbe& probe) {
  const NvmeSizes z = nvme_sizes(base, unit_state_bytes, unit_weight_bytes);
  require_nvme_scratch(comm, nvme_dir, nvme_key, z.scratch_bytes());
  SwapStoreOptions so;
  so.paths = {nvme_dir};
  so.rank = comm.rank();
  so.world_size = comm.world_size();
  so.aio = base.aio;
  so.config_key = nvme_key;
  SwapStore store(so);
  const std::size_t extent = z.extent, count = z.count, depth = 2;
  std::vector<PinnedBlock> bufs;
  // (one a request in flight at most: with aio.verify a buffer read into while it is written
  // would fail its checksum)
  for (int i = 0; i < MachineProfile::kMixedDeepInFlight; ++i) {
    bufs.push_back(pool.allocate(extent));
    std::memset(bufs.back().data(), int(i + 1), extent);
  }
  for (std::size_t i = 0; i < count; ++i) store.reserve(fmt::format("x{}", i), extent);
  auto run = [&](bool write) {
    const auto t0 = Clock::now();
    std::deque<IoHandle> hs;
    for (std::size_t i = 0; i < count; ++i) {
      if (hs.size() >= depth) {
        hs.front().wait();
        hs.pop_front();
      }
      void* b = bufs[i % bufs.size()].data();
      hs.push_back(write ? store.write(fmt::format("x{}", i), b, extent)
                         : store.read(fmt::format("x{}", i), b, extent));
    }
    for (auto& h : hs) h.wait();
    return since(t0);
  };
  run(true);  // allocate the extents on disk
  const double w = median_of(3, [&] { return run(true); });
  const double r = median_of(3, [&] { return run(false); });
  m.nvme_write_bps = double(extent * count) / w;
  m.nvme_read_bps = double(extent * count) / r;
  // (Reads of fewer bytes than an extent go to keys written at that size: with aio.verify a read
  // must take a whole write.)
  auto written_keys = [&](const char* prefix, std::size_t bytes, std::size_t n) {
    if (bytes == extent) return std::string("x");
    for (std::size_t i = 0; i < n; ++i) {
      const std::string key = fmt::format("{}{}", prefix, i);
      store.reserve(key, bytes);
      store.write(key, bufs[0].data(), bytes).wait();
    }
    return std::string(prefix);
  };
  // Half the requests read while the other half are written, as the optimizer streams (and the
  // gradients go out): the time a request of `bytes`, `n` of them.
  // (reads ahead and writes behind, half of `in_flight` each, over the keys `prefix` holds)
  auto mixed_at = [&](const std::string& prefix, std::size_t bytes, std::size_t n,
                      std::size_t in_flight) {
    return mixed_pass_s(store, bufs, prefix, bytes, n, in_flight) / double(n);
  };
  // At the extent and at 256 KiB (sub-groups, gradient buckets and split state make requests
  // that small): the line through both is a request's fixed part and its bytes' rate. A noisy pair
  // that gives no such line leaves the extent's rate alone. Then the line again with twice the
  // requests in flight, for its fixed part: the engine keeps 3-9 in flight (one read ahead, its
  // state and new weights written behind, offload_optimizer.buffer_count), and on the Zen 5 VM,
  // 2026-12-05, the part fell from 0.021-0.023 ms with 2 in flight to 0.006 with 4 and 0 with 8.
  {
    const std::size_t small = z.mixed_small;
    const std::size_t big_n = count, small_n = z.mixed_small_n;
    const std::string big_keys = written_keys("m", extent, big_n);
    const std::string small_keys = small < extent ? written_keys("m", small, small_n) : "";
    // The line's fixed part and rate at `in_flight` (none: the extent's rate, no fixed part).
    auto line_at = [&](std::size_t in_flight) {
      const double big = mixed_at(big_keys, extent, big_n, in_flight);
      if (in_flight == MachineProfile::kMixedInFlight)  // (the x keys: DriveProbe's pass)
        probe = DriveProbe{extent, big_n, double(extent) / big};
      TimeLine out{0, double(extent) / big};
      if (small < extent) {
        const double little = mixed_at(small_keys, small, small_n, in_flight);
        // (a positive fixed part: little x extent > small x big; else the extent's rate stands)
        const bool fixed_part = little * double(extent) > double(small) * big;
        const auto line = line_through(double(small), little, double(extent), big);
        if (line && fixed_part) out = *line;
      }
      return out;
    };
    const TimeLine line = line_at(MachineProfile::kMixedInFlight);
    m.nvme_mixed_request_s = line.fixed_s;
    m.nvme_mixed_bps = line.rate;
    m.nvme_mixed_deep_request_s = line_at(MachineProfile::kMixedDeepInFlight).fixed_s;
    // The optimizer's loop over NVMe state as the engine runs it: wait for sub-group g's read,
    // issue g+1's, write g behind (two writes in flight), at both sizes: the line's fixed part is
    // a sub-group's time beyond its bytes. On the Zen 5 VM, 2026-12-05, it was 0.049-0.055 ms a
    // sub-group with two or six writes in flight, where a read alone paid 0.052 and the mixed
    // traffic 0.014-0.022 a request more: the writes' part overlaps the read's wait.
    // One pass: the time a sub-group of `bytes`, `n` of them.
    auto loop_once = [&](const std::string& prefix, std::size_t bytes, std::size_t n) {
      const auto t0 = Clock::now();
      std::deque<IoHandle> writes;
      auto key = [&](std::size_t g) { return fmt::format("{}{}", prefix, g); };
      IoHandle next = store.read(key(0), bufs[0].data(), bytes);
      for (std::size_t g = 0; g < n; ++g) {
        next.wait();
        if (g + 1 < n) next = store.read(key(g + 1), bufs[(g + 1) % bufs.size()].data(), bytes);
        writes.push_back(store.write(key(g), bufs[g % bufs.size()].data(), bytes));
        while (writes.size() > 2) {
          writes.front().wait();
          writes.pop_front();
        }
      }
      for (auto& h : writes) h.wait();
      return since(t0) / double(n);
    };
    // The two sizes in turns, kLoopRounds passes of each, and the median of each size's: the
    // fixed part is the small sub-groups' time less their bytes', and a drive that stalls for a
    // few tens of ms takes a pass of each at most. Three passes of one size back to back (~20 ms
    // at 256 KiB) could all fall in one stall: on the Zen 5 VM, 2026-12-05, 49 runs gave
    // 0.001-0.063 ms and two 0.127 and 0.171, the latter predicting the nvme regime's
    // 260-sub-group candidate 35% slow; in turns, 23 runs gave 0.031-0.063.
    constexpr int kLoopRounds = 5;
    m.nvme_subgroup_s = -1;
    if (small < extent) {
      std::vector<double> small_t, big_t;
      for (int round = 0; round < kLoopRounds; ++round) {
        small_t.push_back(loop_once(small_keys, small, small_n));
        big_t.push_back(loop_once(big_keys, extent, big_n));
      }
      const auto sub = line_through(double(small), median(std::move(small_t)), double(extent),
                                    median(std::move(big_t)));
      if (sub) m.nvme_subgroup_s = sub->fixed_s;
    }
  }
  // The drive's sustained rate. A cloud or virtual drive often runs at a burst rate for some
  // seconds and then at a lower one (on an Intel Xeon VM's virtio disk fio's mix fell from 2.5
  // to 1.4 GB/s after 6 s), and a training step meets the sustained one. The mix at the extent
  // again for `sustain_s`, its rate over the second half; where that is below the burst's, every
  // NVMe rate below is scaled down by the same factor (the drive's cap is on its total).
  double sustained_factor = 1;
  if (sustain_s > 0) {
    const auto t0 = Clock::now();
    std::uint64_t late_bytes = 0;
    double late_start = -1;
    bool finished = false;
    run_mix(
        store, bufs, extent, MachineProfile::kMixedInFlight,
        [&](std::size_t i) { return fmt::format("x{}", i % count); },
        [&](std::size_t) { return !finished; },
        [&] {
          const double now = since(t0);
          // (counted from the first after half-time; that may come past the end, where the
          // drive stalled across half-time: the requests still in flight then count)
          if (late_start >= 0)
            late_bytes += extent;
          else if (now >= sustain_s / 2)
            late_start = now;
          if (now >= sustain_s) finished = true;
        });
    const double late_s = since(t0) - late_start;
    if (late_start >= 0 && late_s > 0 && late_bytes > 0) {
      m.nvme_sustained_bps = double(late_bytes) / late_s;
      m.nvme_mixed_burst_bps = m.nvme_mixed_bps;
      sustained_factor = std::min(1.0, m.nvme_sustained_bps / m.nvme_mixed_bps);
    }
  }
  // One read at a time, of a big extent and of a small one: the line through both is a read's
  // fixed time (the drive's latency, the engine's per-request work) plus its bytes. The
  // optimizer waits for each sub-group's read, issued one ahead, so with small sub-groups that
  // fixed time is what their step pays; a noisy pair that gives no such line leaves it 0.
  {
    const std::size_t small = z.read_small, reads = z.reads;
    auto one_at_a_time = [&](std::size_t bytes) {
      const std::string prefix = written_keys("s", bytes, reads);
      return median_of(3,
                       [&] {
                         const auto t0 = Clock::now();
                         for (std::size_t i = 0; i < reads; ++i)
                           store.read(fmt::format("{}{}", prefix, i % count), bufs[0].data(), bytes)
                               .wait();
                         return since(t0);
                       }) /
             double(reads);
    };
    const double big = one_at_a_time(extent), little = one_at_a_time(small);
    const auto line = line_through(double(small), little, double(extent), big);
    m.nvme_request_s = line ? line->fixed_s : 0;
  }
  // A fetch reads one unit's weight shard and the fetch stream waits for it before its copy:
  // one read of that size at a time (the next is issued as the prefetch window moves).
  const std::size_t w_extent = z.w_extent;
  const std::size_t w_count = std::max<std::size_t>(8, (std::size_t(64) << 20) / w_extent);
  const std::string w_prefix = written_keys("w", w_extent, count);
  const double fetch = median_of(3, [&] {
    const auto t0 = Clock::now();
    for (std::size_t i = 0; i < w_count; ++i)
      store.read(fmt::format("{}{}", w_prefix, i % count), bufs[0].data(), w_extent).wait();
    return since(t0);
  });
  m.nvme_fetch_read_bps = double(w_extent * w_count) / fetch;
  // The engine reads a unit's weights one request a sub-group, all issued at once: the same
  // bytes again as 64 KiB requests a unit (or aio.block_size ones, if smaller). Each request
  // beyond one read's costs the difference over their number; none measured (a noisy pair) is 0.
  {
    const std::size_t piece = z.piece, pieces = z.pieces, one_read = z.one_read;
    m.nvme_fetch_request_s = 0;
    if (z.split_fetch()) {
      const std::size_t units = z.split_units;
      const std::string p_prefix = written_keys("p", piece, units * pieces);
      std::vector<IoHandle> hs;
      const double split = median_of(3, [&] {
        const auto t0 = Clock::now();
        for (std::size_t i = 0; i < w_count; ++i) {
          hs.clear();
          for (std::size_t p = 0; p < pieces; ++p)
            hs.push_back(store.read(fmt::format("{}{}", p_prefix, (i % units) * pieces + p),
                                    static_cast<char*>(bufs[0].data()) + p * piece, piece));
          for (auto& h : hs) h.wait();
        }
        return since(t0);
      });
      // (the whole read's time for the same bytes: pieces x piece of w_extent's)
      const double whole = fetch * double(pieces * piece) / double(w_extent);
      m.nvme_fetch_request_s =
          std::max(0.0, (split - whole) / double(w_count) / double(pieces - one_read));
    }
  }
  for (double* r : {&m.nvme_read_bps, &m.nvme_write_bps, &m.nvme_mixed_bps, &m.nvme_fetch_read_bps})
    *r *= sustained_factor;
  // The engine's own rule: this rank's share of the drive's free space (its files counted free).
  m.nvme_free = SwapStore::free_bytes(all_nvme_paths, comm.rank(), nvme_key,
                                      ranks_on_this_node(comm), comm.world_size());
}

}  // namespace

double probe_drive(const std::string& folder, const AioConfig& aio, const DriveProbe& shape) {
  STRATA_REQUIRE(shape.extent > 0 && shape.count > 0,
                 "probe_drive: no probe shape (the profile probed no drive)");
  SwapStoreOptions so;
  so.paths = {folder};
  so.aio = aio;
  SwapStore store(so);
  // Page-locked buffers, as the profile's and the engine's are (on the AMD EPYC Zen 3 VM,
  // 2026-12-07, the same passes from plain aligned memory ran at 1.2-1.5 GB/s where these ran at
  // 2.2-2.4, as the profile's did), one a request in flight (with aio.verify a buffer read into
  // while it is written would fail its checksum).
  PinnedPoolOptions po;
  // (with a chunk to spare: a block lies within one, so a chunk's tail may go unused)
  po.budget_bytes = std::size_t(MachineProfile::kMixedInFlight) * shape.extent + po.chunk_bytes;
  PinnedPool pool(po);
  std::vector<PinnedBlock> bufs;
  for (int i = 0; i < MachineProfile::kMixedInFlight; ++i) {
    bufs.push_back(pool.allocate(shape.extent));
    std::memset(bufs.back().data(), i + 1, shape.extent);
  }
  // Every key written once first (a read takes a whole write; the files laid down), as the
  // profile's were before its passes.
  std::vector<IoHandle> writes;
  for (std::size_t i = 0; i < shape.count; ++i) {
    const std::string key = fmt::format("x{}", i);
    store.reserve(key, shape.extent);
    writes.push_back(store.write(key, bufs[i % bufs.size()].data(), shape.extent));
    if (writes.size() >= bufs.size()) {
      for (IoHandle& h : writes) h.wait();
      writes.clear();
    }
  }
  for (IoHandle& h : writes) h.wait();
  const double t =
      mixed_pass_s(store, bufs, "x", shape.extent, shape.count, MachineProfile::kMixedInFlight);
  return t > 0 ? double(shape.extent * shape.count) / t : 0;
}

namespace {

// Collectives over the full buffer (more than one rank).
void measure_collectives(Device& dev, Communicator& comm, Stream& s, std::size_t bytes,
                         MachineProfile& m) {
  // A whole shard per rank whatever the world size (3 ranks do not divide 2^24 elements).
  const std::size_t shard = bytes / 4 / std::size_t(m.world_size),
                    n = shard * std::size_t(m.world_size);
  Buffer full = dev.alloc(n * 4), part = dev.alloc(shard * 4);
  comm.all_gather(tensor(full, DType::kF32, shard, shard * std::size_t(comm.rank())),
                  tensor(full, DType::kF32, n), s);
  s.synchronize();
  const double ag = best_of(3, [&] {
    const auto t0 = Clock::now();
    comm.all_gather(tensor(full, DType::kF32, shard, shard * std::size_t(comm.rank())),
                    tensor(full, DType::kF32, n), s);
    s.synchronize();
    return since(t0);
  });
  const double rs = best_of(3, [&] {
    const auto t0 = Clock::now();
    comm.reduce_scatter(tensor(full, DType::kF32, n), tensor(part, DType::kF32, shard),
                        ReduceOp::kAvg, s);
    s.synchronize();
    return since(t0);
  });
  m.all_gather_bps = double(bytes) / ag;
  m.reduce_scatter_bps = double(bytes) / rs;
}

// Tensor parallelism: the all-reduce of one micro-batch's activations (`bytes`, the size the
// model's row-parallel layers sum) over the TP group, as bytes of the buffer per second (the
// median of 7 after a warm-up).
double measure_tp_all_reduce(Device& dev, Communicator& tp, std::size_t bytes) {
  auto s = dev.create_stream("compute");
  const std::size_t n = std::max<std::size_t>(1, bytes / 4);
  Buffer x = dev.alloc(n * 4);
  s->fill(tensor(x, DType::kF32), 1.0f);
  std::vector<double> t;
  for (int r = 0; r <= 7; ++r) {
    const auto t0 = Clock::now();
    tp.all_reduce(tensor(x, DType::kF32), ReduceOp::kSum, *s);
    s->synchronize();
    if (r > 0) t.push_back(since(t0));
  }
  std::sort(t.begin(), t.end());
  return double(n * 4) / t[t.size() / 2];
}

// NVMe is measured under `nvme_dir`; the free space is that of every path the search may use
// (`all_nvme_paths`: a file system counted once).
// (`nvme_key`: what gave the path, named in its errors: "--nvme-path", or the --config's key)
// `comm` is the job's (its ranks share the node's RAM and drives), `dp` the data-parallel group's
// (the ZeRO collectives': the job's under TP 1).
MachineProfile measure_machine(Device& dev, Communicator& comm, Communicator& dp,
                               const EngineConfig& base, const std::string& nvme_dir,
                               const std::vector<std::string>& all_nvme_paths,
                               const std::string& nvme_key, bool use_nvme,
                               std::size_t unit_state_bytes, std::size_t unit_weight_bytes,
                               double nvme_sustain_s, DriveProbe& probe) {
  const std::uint64_t rss_before = cpu::process_rss_bytes();
  MachineProfile m;
  m.world_size = dp.world_size();
  m.ranks_on_node = ranks_on_this_node(comm);
  auto s = dev.create_stream("prof");
  const std::size_t bytes = std::size_t(64) << 20;
  PinnedPoolOptions po;
  po.budget_bytes = std::size_t(512) << 20;
  po.device = &dev;
  PinnedPool pool(po);
  PinnedBlock host = pool.allocate(bytes);
  std::memset(host.data(), 1, bytes);
  Buffer d = dev.alloc(bytes);
  s->copy(d.ref(), host_ref(host.data(), bytes));  // warm
  s->synchronize();
  measure_rates(dev, *s, host, d, bytes, base, m);
  if (use_nvme)
    measure_nvme(comm, pool, base, nvme_dir, all_nvme_paths, nvme_key, unit_state_bytes,
                 unit_weight_bytes, nvme_sustain_s, m, probe);
  {
    MachineProfile again = m;
    measure_rates(dev, *s, host, d, bytes, base, again);
    for (double MachineProfile::*f :
         {&MachineProfile::h2d_bps, &MachineProfile::d2h_bps, &MachineProfile::device_mem_bps,
          &MachineProfile::free_bps, &MachineProfile::host_mem_bps, &MachineProfile::host_norm_bps,
          &MachineProfile::device_adamw_params_per_s})
      m.*f = std::max(m.*f, again.*f);
    // The CPU AdamW's line of the two runs whose 90112-parameter call (a sub-group size the
    // search tries) is the faster: its rate and fixed time belong together.
    auto call_s = [](const MachineProfile& x) {
      return x.cpu_adamw_call_s + 90112.0 / x.cpu_adamw_params_per_s;
    };
    if (call_s(again) < call_s(m)) {
      m.cpu_adamw_params_per_s = again.cpu_adamw_params_per_s;
      m.cpu_adamw_call_s = again.cpu_adamw_call_s;
    }
  }

  if (m.world_size > 1) measure_collectives(dev, dp, *s, bytes, m);
  m.device_capacity = dev.stats().capacity_bytes;
  m.host_capacity = base.host_budget_bytes;
  // Host RAM as strata-train will plan it (set_host_ram_inputs), its base the resident memory
  // before the measurements above took theirs.
  PlanInputs ram;
  set_host_ram_inputs(ram, dev, m.ranks_on_node);
  m.ram_base_bytes = std::min<std::uint64_t>(ram.ram_base_bytes, rss_before);
  m.ram_capacity =
      ram.ram_capacity == 0 ? 0 : ram.ram_capacity - ram.ram_base_bytes + m.ram_base_bytes;
  m.device_in_ram = ram.device_in_ram;
  return m;
}

// ---- measuring the model ----
// Wraps the resident weights and stamps the stream's clock each time the model takes a unit's
// weights (and unit 0's gradient, where the embedding's backward begins).
class StampingWeights final : public UnitProvider {
 public:
  // `model`'s TP collectives' bytes issued so far are read at each stamp (on the host, as the
  // model issues the unit's work), so each unit's share of them falls out as its time does.
  StampingWeights(ResidentWeights& inner, Stream& s, const Model& model)
      : inner_(inner), s_(s), model_(model) {}
  struct Stamp {
    bool grads;
    std::size_t unit;
    Clock::time_point t;
    std::uint64_t tp_bytes = 0;  // TP collectives' bytes issued before it
  };
  TensorRef acquire_weights(std::size_t unit) override {
    stamp(false, unit);
    return inner_.acquire_weights(unit);
  }
  void release_weights(std::size_t unit) override { inner_.release_weights(unit); }
  TensorRef acquire_grads(std::size_t unit) override {
    if (unit == 0) stamp(true, unit);
    return inner_.acquire_grads(unit);
  }
  void release_grads(std::size_t unit) override { inner_.release_grads(unit); }
  void mark_end() { stamp(true, SIZE_MAX); }
  std::vector<Stamp> take() {
    s_.synchronize();
    std::lock_guard lock(mu_);
    return std::exchange(stamps_, {});
  }

 private:
  void stamp(bool grads, std::size_t unit) {
    const Model::TpTraffic tr = model_.tp_traffic();
    const std::uint64_t tp = tr.all_reduce_bytes + tr.all_gather_bytes + tr.reduce_scatter_bytes;
    s_.host_fn(
        [this, grads, unit, tp] {
          std::lock_guard lock(mu_);
          stamps_.push_back({grads, unit, Clock::now(), tp});
        },
        "prof_stamp");
  }
  ResidentWeights& inner_;
  Stream& s_;
  const Model& model_;
  std::mutex mu_;
  std::vector<Stamp> stamps_;
};

struct LayerTiming {
  double embed_f = 0, embed_b = 0, layer_f = 0, layer_b = 0, head_f = 0;
  // The cores the process kept busy through the forward and backward (its CPU time over their
  // wall time): on the CPU-emulated device, what its kernels take of the host's cores.
  double cores = 0;
  std::uint64_t activation_bytes = 0;
  // The TP collectives' bytes of each (tensor parallelism; 0 without).
  std::uint64_t embed_fb = 0, embed_bb = 0, layer_fb = 0, layer_bb = 0, head_fb = 0;
};

// One profile's settings: the micro-batch and the checkpointing.
struct ProfileKey {
  std::int64_t B = 1;
  bool ckpt = false, ckpt_host = false;
};
// Its checkpointing as the model's table and the JSON name it.
const char* checkpoint_name(const ProfileKey& k) {
  return !k.ckpt ? "off" : k.ckpt_host ? "host" : "on";
}

// The engine's mix of NVMe traffic (extents of 4 MiB, half read and half written, two of each in
// flight, as the optimizer reads ahead and writes behind) on a thread of its own, from
// construction until stop(): what the device's kernels meet while a step's NVMe lane is busy.
class DriveLoad {
 public:
  DriveLoad(Device& dev, Communicator& comm, const EngineConfig& base, const NvmeChoice& nvme)
      : pool_(pool_options(dev)) {
    SwapStoreOptions so;
    so.paths = {nvme.dir};
    so.rank = comm.rank();
    so.world_size = comm.world_size();
    so.aio = base.aio;
    so.config_key = nvme.key;
    store_.emplace(so);
    for (std::size_t i = 0; i < 4; ++i) {
      bufs_.push_back(pool_.allocate(kExtent));
      std::memset(bufs_.back().data(), int(i + 1), kExtent);
    }
    for (std::size_t i = 0; i < kKeys; ++i) {  // (a read must find its key written)
      store_->reserve(key(i), kExtent);
      store_->write(key(i), bufs_[0].data(), kExtent).wait();
    }
    thread_ = std::thread([this] {
      const auto t0 = Clock::now();
      try {
        run_mix(
            *store_, bufs_, kExtent, 4, [](std::size_t i) { return key(i % kKeys); },
            [this](std::size_t) { return !stop_.load(std::memory_order_relaxed); },
            [this] { requests_.fetch_add(1, std::memory_order_relaxed); });
      } catch (...) {
        error_ = std::current_exception();
      }
      seconds_ = since(t0);
    });
  }
  DriveLoad(const DriveLoad&) = delete;
  DriveLoad& operator=(const DriveLoad&) = delete;
  ~DriveLoad() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  // Ends the traffic; an I/O error it met is thrown here.
  void stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    if (error_) std::rethrow_exception(error_);
  }
  // The drive's rate while it ran (after stop()).
  double bytes_per_s() const {
    return seconds_ > 0 ? double(requests_.load()) * double(kExtent) / seconds_ : 0;
  }

 private:
  static constexpr std::size_t kExtent = kDriveLoadExtent, kKeys = kDriveLoadKeys;
  static PinnedPoolOptions pool_options(Device& dev) {
    PinnedPoolOptions po;
    po.budget_bytes = 4 * kExtent;
    po.device = &dev;
    return po;
  }
  static std::string key(std::size_t i) { return fmt::format("load{}", i); }
  PinnedPool pool_;
  std::vector<PinnedBlock> bufs_;
  std::optional<SwapStore> store_;
  std::atomic<bool> stop_{false};
  std::atomic<std::uint64_t> requests_{0};
  double seconds_ = 0;
  std::exception_ptr error_;
  std::thread thread_;
};

// The 2-layer copies' times are taken in kRounds rounds of kRepsPerRound repetitions each (see
// measure_the_model).
constexpr int kRounds = 3, kRepsPerRound = 3;

// Runs a copy of `base` with `layers` layers for `reps` micro-batches after a warm-up one, on
// `dev` (every copy on the same device: under tensor parallelism its communicators are made once);
// per-unit times of each, and the device bytes beyond the weights at the peak. Under tensor
// parallelism (`tp_group` set: every rank runs this in the same order) each TP rank runs its
// slices, the TP collectives in the times. With `evict`, the cache is written over before each
// timed one.
std::vector<LayerTiming> time_layers(Device& dev, Communicator* tp_group, const ModelConfig& base,
                                     int layers, const ProfileKey& k, std::int64_t T, DType dt,
                                     int reps, CacheEvictor* evict = nullptr) {
  const std::int64_t B = k.B;
  const bool ckpt = k.ckpt, ckpt_host = k.ckpt_host;
  ModelConfig cfg = base;
  cfg.num_layers = layers;
  // What the copies before left is freed (their frees ordered on their streams, gone now); the
  // peak counts from here, as on a device of its own.
  dev.synchronize();
  dev.reset_peak_stats();
  auto s = dev.create_stream("compute");
  ModelOptions mo;
  mo.tensor_parallel = tp_group;
  mo.micro_batch = B;
  mo.seq_len = T;
  mo.compute = dt;
  mo.checkpoint = ckpt;
  mo.checkpoint_on_host = ckpt && ckpt_host;
  Model model(cfg, dev, *s, mo);
  ResidentWeights rw(model, *s);
  rw.init_random(1);
  s->synchronize();
  StampingWeights sw(rw, *s, model);
  std::mt19937_64 rng(7);
  Batch b;
  for (std::int64_t i = 0; i < B * T; ++i) {
    b.tokens.push_back(std::int32_t(rng() % std::uint64_t(cfg.vocab_size)));
    b.targets.push_back(std::int32_t(rng() % std::uint64_t(cfg.vocab_size)));
  }
  // An error mid-step (a micro-batch the device cannot hold, which the caller goes on from)
  // unwinds with the device's work still queued: the stamps' host functions write into `sw` and
  // the copies read the batch, so that work ends before they go (it wrote into freed memory:
  // "malloc_consolidate(): unaligned fastbin chunk detected").
  struct DrainOnUnwind {
    Device& d;
    ~DrainOnUnwind() {
      if (std::uncaught_exceptions() == 0) return;
      try {
        d.synchronize();
      } catch (...) {  // the error already on its way is the one to report
      }
    }
  } drain{dev};
  const std::size_t base_bytes = dev.stats().bytes_in_use;
  std::vector<LayerTiming> out;
  for (int r = 0; r <= reps; ++r) {
    if (evict && r > 0) (*evict)(*s);  // on the stream that computes: see CacheEvictor
    const double cpu0 = cpu::process_cpu_seconds();
    const auto wall0 = Clock::now();
    model.forward(b, sw);
    sw.mark_end();
    model.backward(sw);
    sw.mark_end();
    const auto st = sw.take();
    const double wall = since(wall0), cpu_s = cpu::process_cpu_seconds() - cpu0;
    if (r == 0) continue;  // warm-up
    // forward: w0 w1 .. wL whead (w0 again when tied) end | backward: wL .. w1 g0 end
    const std::size_t L = std::size_t(layers), head = L + 1;
    using Stamp = StampingWeights::Stamp;
    std::map<std::size_t, Stamp> fw, bw;
    Stamp f_end{}, g0{}, b_end{};
    int phase = 0;
    for (const auto& x : st) {
      if (x.unit == SIZE_MAX) {
        (phase++ == 0 ? f_end : b_end) = x;
      } else if (!x.grads) {
        (phase == 0 ? fw : bw).emplace(x.unit, x);
      } else if (phase == 1 && x.unit == 0) {
        g0 = x;
      }
    }
    STRATA_CHECK(fw.size() == head + 1 && bw.size() == L && phase == 2,
                 "strata-prof: unexpected unit order from the model");
    auto d = [](const Stamp& a0, const Stamp& b2) {
      return std::chrono::duration<double>(b2.t - a0.t).count();
    };
    auto tb = [](const Stamp& a0, const Stamp& b2) { return b2.tp_bytes - a0.tp_bytes; };
    LayerTiming t;
    t.embed_f = d(fw[0], fw[1]);
    t.embed_fb = tb(fw[0], fw[1]);
    double lf = 0, lb = 0;
    std::uint64_t lfb = 0, lbb = 0;
    for (std::size_t l = 1; l <= L; ++l) {
      lf += d(fw[l], fw[l + 1]);
      lfb += tb(fw[l], fw[l + 1]);
    }
    t.layer_f = lf / double(L);
    t.layer_fb = lfb / L;
    t.head_f = d(fw[head], f_end);
    t.head_fb = tb(fw[head], f_end);
    for (std::size_t l = L; l >= 1; --l) {
      lb += d(bw[l], l > 1 ? bw[l - 1] : g0);
      lbb += tb(bw[l], l > 1 ? bw[l - 1] : g0);
    }
    t.layer_b = lb / double(L);
    t.layer_bb = lbb / L;
    t.embed_b = d(g0, b_end);
    t.embed_bb = tb(g0, b_end);
    if (dev.kind() == DeviceKind::kCpu && wall > 0) t.cores = cpu_s / wall;
    out.push_back(t);
  }
  const std::size_t peak = dev.stats().peak_bytes_in_use;
  for (LayerTiming& t : out) t.activation_bytes = peak > base_bytes ? peak - base_bytes : 0;
  return out;
}

// Each time (and the cores busy) the mean over the repetitions but the smallest and the largest
// (trimmed_mean; the TP bytes and the activations are the same in every one). Not the median: on
// the AMD EPYC Zen 5 VM (2 cores, 2026-12-04) a copy's first two repetitions ran the offload
// regime's B = 4 layer on one core (backward 5.4-5.6 ms) and the later ones on 1.5-1.7 (3.4-3.9),
// a step's kernels between the two; the median of nine fell on either side from run to run, one
// placement's profile 15-30% off in a run, and the offload regime missed its targets in two runs
// of six.
LayerTiming mean_timing(const std::vector<LayerTiming>& reps) {
  auto mean_of_field = [&](double LayerTiming::*f) {
    std::vector<double> v;
    for (auto& r : reps) v.push_back(r.*f);
    return trimmed_mean(std::move(v));
  };
  LayerTiming out = reps.front();
  for (auto f : {&LayerTiming::embed_f, &LayerTiming::embed_b, &LayerTiming::layer_f,
                 &LayerTiming::layer_b, &LayerTiming::head_f, &LayerTiming::cores})
    out.*f = mean_of_field(f);
  return out;
}

// A profile from the 1-layer copy's activations and the 2-layer copy's times (the units are this
// rank's slices under tensor parallelism).
ModelProfile profile_model(const ModelConfig& mcfg, const ProfileKey& k, std::int64_t T,
                           TensorParallel tpl, const LayerTiming& one, const LayerTiming& two) {
  const std::int64_t B = k.B;
  const bool ckpt = k.ckpt, ckpt_host = k.ckpt_host;
  ModelProfile mp;
  mp.micro_batch = B;
  mp.seq_len = T;
  mp.checkpoint = ckpt;
  mp.checkpoint_on_host = ckpt && ckpt_host;
  if (mp.checkpoint_on_host) mp.host_checkpoint_bytes = host_checkpoint_bytes(mcfg, B, T);
  const auto units = model_units(mcfg, tpl);
  const std::size_t head = units.size() - 1;
  for (std::size_t i = 0; i < units.size(); ++i) {
    UnitCost c;
    c.name = units[i].name;
    c.numel = units[i].numel;
    if (i == 0) {
      c.forward_s = two.embed_f;
      c.backward_s = two.embed_b;
      c.tp_forward_bytes = two.embed_fb;
      c.tp_backward_bytes = two.embed_bb;
    } else if (i == head) {
      c.forward_s = two.head_f;
      c.tp_forward_bytes = two.head_fb;
    } else {
      c.forward_s = two.layer_f;
      c.backward_s = two.layer_b;
      c.tp_forward_bytes = two.layer_fb;
      c.tp_backward_bytes = two.layer_bb;
    }
    mp.units.push_back(c);
  }
  mp.device_cores = two.cores;
  const double per_layer = double(two.activation_bytes) - double(one.activation_bytes);
  mp.activation_bytes = std::uint64_t(std::max(
      0.0, double(one.activation_bytes) + double(mcfg.num_layers - 1) * std::max(0.0, per_layer)));
  return mp;
}

void print_machine(const MachineProfile& m, const std::string& dev_name) {
  auto g = [](double bps) {
    return bps > 0 ? fmt::format("{:.2f} GB/s", bps / 1e9) : std::string("-");
  };
  const int ranks = m.world_size * m.tensor_parallel;
  std::printf("machine (%s, %d rank%s%s):\n", dev_name.c_str(), ranks, ranks == 1 ? "" : "s",
              m.tensor_parallel > 1 ? fmt::format(": tensor parallel {} x data parallel {}",
                                                  m.tensor_parallel, m.world_size)
                                          .c_str()
                                    : "");
  std::printf("  h2d %s  d2h %s  device memory %s  device free %s  host memory %s\n",
              g(m.h2d_bps).c_str(), g(m.d2h_bps).c_str(), g(m.device_mem_bps).c_str(),
              g(m.free_bps).c_str(), g(m.host_mem_bps).c_str());
  std::printf(
      "  nvme write %s  read %s  both at once %s + %.3f ms a request%s  a unit's weights at a "
      "time %s + %.3f ms a sub-group's request  a read's fixed time %.3f ms%s"
      "  (%s free)\n",
      g(m.nvme_write_bps).c_str(), g(m.nvme_read_bps).c_str(), g(m.nvme_mixed_bps).c_str(),
      m.nvme_mixed_request_s * 1e3,
      m.nvme_mixed_deep_request_s >= 0
          ? fmt::format(" ({:.3f} with {} in flight)", m.nvme_mixed_deep_request_s * 1e3,
                        MachineProfile::kMixedDeepInFlight)
                .c_str()
          : "",
      g(m.nvme_fetch_read_bps).c_str(), m.nvme_fetch_request_s * 1e3, m.nvme_request_s * 1e3,
      m.nvme_subgroup_s >= 0
          ? fmt::format("  the optimizer's loop + {:.3f} ms a sub-group", m.nvme_subgroup_s * 1e3)
                .c_str()
          : "",
      m.nvme_free ? human(double(m.nvme_free)).c_str() : "-");
  if (m.nvme_sustained_bps > 0)
    std::printf("  nvme sustained (both at once, the second half of the run) %s%s\n",
                g(m.nvme_sustained_bps).c_str(),
                m.nvme_sustained_bps < m.nvme_mixed_burst_bps
                    ? fmt::format(": below the short runs' {}, the rates above scaled to it",
                                  g(m.nvme_mixed_burst_bps))
                          .c_str()
                    : "");
  std::printf(
      "  AdamW cpu %.0f M params/s + %.3f ms a call (out of the cache)  device %.0f M params/s  "
      "gradient norm (host) %s\n",
      m.cpu_adamw_params_per_s / 1e6, m.cpu_adamw_call_s * 1e3, m.device_adamw_params_per_s / 1e6,
      g(m.host_norm_bps).c_str());
  if (m.world_size > 1)
    std::printf("  all-gather %s  reduce-scatter %s%s\n", g(m.all_gather_bps).c_str(),
                g(m.reduce_scatter_bps).c_str(),
                m.tensor_parallel > 1
                    ? fmt::format(" (over the {} data-parallel ranks)", m.world_size).c_str()
                    : "");
  if (m.tensor_parallel > 1)
    std::printf("  tensor parallel %d: all-reduce of a micro-batch's activations %s\n",
                m.tensor_parallel, g(m.tp_all_reduce_bps).c_str());
  std::printf("  capacity: device %s, host (pinned budget) %s\n",
              human(double(m.device_capacity)).c_str(), human(double(m.host_capacity)).c_str());
  if (m.device_shares_host_cores > 0)
    std::printf(
        "  (the emulated device computes on this process's %g core%s, with the host thread and the "
        "CPU\n"
        "   optimizer: the model shares them out among whatever runs at once)\n",
        m.device_shares_host_cores, m.device_shares_host_cores == 1 ? "" : "s");
}

// The machine, measured on the device the placements run on (the emulated one sized up to hold the
// measurements' buffers); `a.device` becomes what "auto" chose and `base` takes the device's
// defaults.
void measure_this_machine(Args& a, EngineConfig& base, const ModelConfig& mcfg,
                          const NvmeChoice& nvme, const DeviceOptions& dopt, int world_size,
                          Measurement& out) {
  const HostDeviceOptions& hopt = dopt.hopt;
  MachineProfile& machine = out.machine;
  std::string& dev_name = out.dev_name;
  auto dev = make_device(a.device, dopt.mhopt, dopt.copt);
  dev_name = dev->name();
  // The emulated device's throttles would be ignored on a GPU (with --device auto, say).
  STRATA_REQUIRE(
      dev->kind() == DeviceKind::kCpu || (a.emu_h2d <= 0 && a.emu_d2h <= 0 && a.emu_gflops <= 0),
      "--emu-h2d-gbps, --emu-d2h-gbps and --emu-compute-gflops throttle the CPU-emulated device, "
      "and "
      "this run measures {}: leave them out, or pass --device cpu",
      dev_name);
  auto comm = make_communicator(*dev);
  // Tensor parallelism: the ZeRO collectives run over the DP group (`world_size` ranks), each
  // rank's units are its TP slices.
  ProcessGroups groups = make_process_groups(*comm, a.tp.size);
  std::size_t largest = 0;
  for (const auto& u : model_units(mcfg, {groups.tp_size, groups.tp_rank}))
    largest = std::max<std::size_t>(largest, u.numel);
  const std::size_t shard = largest / std::size_t(std::max(1, world_size));
  std::vector<std::string> all_paths =
      nvme.paths.empty() ? std::vector<std::string>{nvme.dir} : nvme.paths;
  for (const std::string& p : nvme.param_paths)
    if (std::find(all_paths.begin(), all_paths.end(), p) == all_paths.end()) all_paths.push_back(p);
  machine = measure_machine(*dev, *comm, *groups.dp, base, nvme.dir, all_paths, nvme.key, nvme.use,
                            shard * 12, shard * dtype_size(base.compute_dtype), a.nvme_sustain_s,
                            out.drive);
  machine.tensor_parallel = groups.tp_size;
  if (groups.tp_size > 1) {  // the centre micro-batch's activations, as the model sums them (fp32)
    const std::int64_t B = a.micro_batches[a.micro_batches.size() / 2];
    machine.tp_all_reduce_bps =
        measure_tp_all_reduce(*dev, *groups.tp, std::size_t(B * a.seq_len * mcfg.hidden_size) * 4);
  }
  if (dev->kind() == DeviceKind::kCpu) {
    machine.device_capacity = hopt.capacity_bytes;
    // Named with the cap the placements are planned for (the measuring one is sized up).
    dev_name = fmt::format("cpu-emulated (cap {})", human(double(hopt.capacity_bytes)));
    a.device = "cpu";  // what "auto" chose; said once above
    // As the engine decides it there: the emulated device's kernels share the host's cores.
    base = Engine::with_device_defaults(base, *dev);
    // ... and the model shares them out (the cores this process may run on).
    machine.device_shares_host_cores = cpu::usable_cores();
    machine.device_kernel_threads = hopt.compute_threads;
  }
}

// The model's profiles: every micro-batch size with checkpointing off, on, and on with the
// checkpoints in host memory; with several ranks, every rank then takes the slowest rank's figures.
void measure_the_model(const Args& a, const EngineConfig& base, const ModelConfig& mcfg,
                       const NvmeChoice& nvme, const DeviceOptions& dopt, int world_size, bool talk,
                       Measurement& out) {
  SearchSpace& space = out.space;
  space.base = base;
  if (nvme.use) {
    space.nvme_paths = nvme.paths.empty() ? std::vector<std::string>{nvme.dir} : nvme.paths;
    space.param_nvme_paths = nvme.param_paths;
  }
  const DType dt = base.compute_dtype;
  std::vector<ProfileKey> keys;
  for (auto B : a.micro_batches)
    for (int ck = 0; ck < 3; ++ck)  // off, on, on with the checkpoints in host memory
      keys.push_back({B, ck > 0, ck == 2});
  // The 1-layer copies give the activations only (one micro-batch each). The 2-layer copies'
  // times are taken in rounds that go over every profile in turn, reduced over all of them
  // (mean_timing):
  // a shared host's speed moves over a second or so, and each profile timed in one stretch
  // could land in a fast or a slow one (a layer timed 20% fast, its profile's placements
  // ranked wrongly against the others').
  std::vector<LayerTiming> one(keys.size());
  std::vector<std::vector<LayerTiming>> two(keys.size());
  // A profile whose copy runs out of memory (the device's, or the host's) is not measured: its
  // candidates do not fit, and the search goes on with the others. Nor is one that holds more
  // than one that failed: a larger micro-batch, or checkpointing that keeps more on the device
  // (off, on, on with the checkpoints in host memory: `keeps`). Why each was not: `failed`.
  std::vector<std::string> failed(keys.size());
  std::vector<bool> ran_out(keys.size(), false);  // (not only held more than one that did)
  const auto keeps = [](const ProfileKey& k) { return !k.ckpt ? 2 : k.ckpt_host ? 0 : 1; };
  const auto measure_key = [&](std::size_t i, const auto& f) {
    for (std::size_t j = 0; j < keys.size() && failed[i].empty(); ++j)
      if (ran_out[j] && keys[i].B >= keys[j].B && keeps(keys[i]) >= keeps(keys[j]))
        failed[i] = fmt::format("holds more than B={} with checkpointing {}, which ran out",
                                keys[j].B, checkpoint_name(keys[j]));
    if (!failed[i].empty()) return;
    try {
      f();
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::kOutOfMemory) throw;
      failed[i] = "out of memory while measured: " + e.message();
      ran_out[i] = true;
    } catch (const std::bad_alloc&) {
      failed[i] = "out of host memory while measured (std::bad_alloc)";
      ran_out[i] = true;
    }
  };
  // (the 1-layer copies in the order of what they hold, least first, so that one that fails
  // spares the larger ones)
  std::vector<std::size_t> least_first(keys.size());
  for (std::size_t i = 0; i < keys.size(); ++i) least_first[i] = i;
  std::stable_sort(least_first.begin(), least_first.end(), [&](std::size_t x, std::size_t y) {
    return keys[x].B != keys[y].B ? keys[x].B < keys[y].B : keeps(keys[x]) < keeps(keys[y]);
  });
  {
    // One device for every copy (and under tensor parallelism one set of communicators: NCCL's
    // are slow to make), gone before the ranks agree below.
    auto mdev = make_device(a.device, dopt.mhopt, dopt.copt);
    std::unique_ptr<Communicator> world;
    ProcessGroups groups;
    if (a.tp.size > 1) {
      world = make_communicator(*mdev);
      groups = make_process_groups(*world, a.tp.size);
    }
    CacheEvictor evict(*mdev);
    for (const std::size_t i : least_first)
      measure_key(i, [&] {
        one[i] = time_layers(*mdev, groups.tp.get(), mcfg, 1, keys[i], a.seq_len, dt, 1).front();
      });
    for (int round = 0; round < kRounds; ++round)
      for (std::size_t i = 0; i < keys.size(); ++i)
        measure_key(i, [&] {
          for (const LayerTiming& t : time_layers(*mdev, groups.tp.get(), mcfg, 2, keys[i],
                                                  a.seq_len, dt, kRepsPerRound, &evict))
            two[i].push_back(t);
        });
    std::size_t first = 0;  // the first profile measured
    while (first < keys.size() && !failed[first].empty()) ++first;
    STRATA_REQUIRE(first < keys.size(),
                   "every micro-batch size searched ran out of memory while measured, with "
                   "checkpointing and without (--micro-batches {} at --seq-len {}; the smallest: "
                   "{}): give smaller --micro-batches or a shorter --seq-len",
                   fmt::join(a.micro_batches, " "), a.seq_len, failed[least_first.front()]);
    // The drive's traffic slows the emulated device's kernels where the guest's CPU time does not
    // show it (on a virtual machine its I/O is served on the same physical cores and memory): the
    // first profile with the engine's NVMe traffic running beside it and alone, in turns.
    if (nvme.use && mdev->kind() == DeviceKind::kCpu) {
      if (!world) world = make_communicator(*mdev);
      // The median of each side. These repetitions fall into the same one-core and two-core
      // groups as the layer profile's, but both sides have them in the same places. On the AMD
      // EPYC Zen 5 VM (2026-12-05, 8 runs) the slowdown's spread from run to run (standard
      // deviation) was 6.3 points with this, 6.8 with the trimmed mean, 6.5 with the median of
      // paired repetitions' ratios and 4.9 with 8 rounds instead of 3: the slowdown itself moves
      // (one run saw none, the others 5-18%).
      auto layer = [](const std::vector<LayerTiming>& v) {
        std::vector<double> x;
        for (const LayerTiming& t : v) x.push_back(t.layer_f + t.layer_b);
        return median(std::move(x));
      };
      const auto slowdown = [&](const std::vector<LayerTiming>& alone_v,
                                const std::vector<LayerTiming>& beside_v) {
        const double alone = layer(alone_v), with = layer(beside_v);
        return alone > 0 ? std::max(0.0, with / alone - 1) : 0.0;
      };
      std::vector<LayerTiming> alone_t, beside_t;  // every round's
      for (int round = 0; round < kRounds; ++round) {
        DriveLoad load(*mdev, *world, base, nvme);
        const std::vector<LayerTiming> beside = time_layers(
            *mdev, groups.tp.get(), mcfg, 2, keys[first], a.seq_len, dt, kRepsPerRound, &evict);
        load.stop();
        out.machine.nvme_load_bps = std::max(out.machine.nvme_load_bps, load.bytes_per_s());
        const std::vector<LayerTiming> alone = time_layers(
            *mdev, groups.tp.get(), mcfg, 2, keys[first], a.seq_len, dt, kRepsPerRound, &evict);
        out.nvme_slowdown_rounds.push_back(slowdown(alone, beside));
        beside_t.insert(beside_t.end(), beside.begin(), beside.end());
        alone_t.insert(alone_t.end(), alone.begin(), alone.end());
      }
      out.machine.nvme_compute_slowdown = slowdown(alone_t, beside_t);
    }
    // The timing the validation repeats beside its runs (ComputeProbe): where the kernels run on
    // the host's cores, and need no other rank.
    if (mdev->kind() == DeviceKind::kCpu && a.tp.size == 1) {
      const LayerTiming t = mean_timing(two[first]);
      out.compute = ComputeProbe{keys[first].B, keys[first].ckpt, keys[first].ckpt_host, dt,
                                 t.layer_f + t.layer_b};
    }
  }
  std::unique_ptr<Device> agree_dev;
  std::unique_ptr<Communicator> agree_comm;
  if (world_size * a.tp.size > 1) {
    agree_dev = make_device(a.device, dopt.hopt, dopt.copt);
    agree_comm = make_communicator(*agree_dev);
    // A profile another rank could not hold is left out on every rank: all search alike.
    std::vector<double> out_v(keys.size());
    for (std::size_t i = 0; i < keys.size(); ++i) out_v[i] = failed[i].empty() ? 0 : 1;
    max_across_ranks(*agree_comm, out_v);
    for (std::size_t i = 0; i < keys.size(); ++i)
      if (out_v[i] > 0 && failed[i].empty()) failed[i] = "did not fit on another rank";
    STRATA_REQUIRE(std::find(failed.begin(), failed.end(), std::string()) != failed.end(),
                   "every micro-batch size searched ran out of memory while measured on some "
                   "rank (--micro-batches {} at --seq-len {}): give smaller --micro-batches or a "
                   "shorter --seq-len",
                   fmt::join(a.micro_batches, " "), a.seq_len);
  }
  for (std::size_t i = 0; i < keys.size(); ++i) {
    if (!failed[i].empty()) {
      out.unmeasured.push_back({keys[i].B, checkpoint_name(keys[i]), failed[i]});
      continue;
    }
    space.models.push_back(
        profile_model(mcfg, keys[i], a.seq_len, a.tp, one[i], mean_timing(two[i])));
  }
  if (agree_comm) {
    agree_across_ranks(*agree_comm, out.machine, space.models);
    // The plan takes the config's budget over the machine's: the least any rank has, on every rank.
    space.base.host_budget_bytes = out.machine.host_capacity;
    if (talk)
      std::printf(
          "%d ranks: the search takes the slowest rank's figures (lowest rates, longest times)\n",
          world_size * a.tp.size);
  }
}

void print_models(const SearchSpace& space, const std::vector<Unmeasured>& unmeasured) {
  // The cores column only where they were measured (the CPU-emulated device).
  const bool cores = !space.models.empty() && space.models.front().device_cores > 0;
  std::printf("model (per micro-batch, measured on 1- and 2-layer copies):\n");
  std::printf("  %-6s %-5s %10s %10s %10s %10s %12s%s\n", "B", "ckpt", "layer fwd", "layer bwd",
              "head", "embed", "activations", cores ? "  cores" : "");
  for (const auto& mp : space.models)
    std::printf("  %-6lld %-5s %8.2fms %8.2fms %8.2fms %8.2fms %12s%s\n", (long long)mp.micro_batch,
                !mp.checkpoint          ? "off"
                : mp.checkpoint_on_host ? "host"
                                        : "on",
                mp.units[1].forward_s * 1e3, mp.units[1].backward_s * 1e3,
                mp.units.back().forward_s * 1e3,
                (mp.units[0].forward_s + mp.units[0].backward_s) * 1e3,
                human(double(mp.activation_bytes)).c_str(),
                cores ? fmt::format("  {:5.2f}", mp.device_cores).c_str() : "");
  for (const Unmeasured& u : unmeasured)
    std::printf("  %-6lld %-5s does not fit, left out of the search: %s\n",
                (long long)u.micro_batch, u.checkpoint.c_str(), u.why.c_str());
}

}  // namespace

double probe_compute(const Args& a, const DeviceOptions& dopt, const ModelConfig& mcfg,
                     const ComputeProbe& shape) {
  STRATA_REQUIRE(shape.layer_s > 0, "probe_compute: no probe shape (the profile timed no layer)");
  auto dev = make_device(a.device, dopt.mhopt, dopt.copt);
  CacheEvictor evict(*dev);
  const ProfileKey k{shape.micro_batch, shape.checkpoint, shape.checkpoint_on_host};
  const LayerTiming t = mean_timing(
      time_layers(*dev, nullptr, mcfg, 2, k, a.seq_len, shape.dtype, kRepsPerRound, &evict));
  return t.layer_f + t.layer_b;
}

// ---- measure ----
Measurement measure(Args& a, EngineConfig& base, const ModelConfig& mcfg, const NvmeChoice& nvme,
                    const DeviceOptions& dopt, int world_size, bool talk,
                    Clock::time_point t_start) {
  Measurement out;
  measure_this_machine(a, base, mcfg, nvme, dopt, world_size, out);
  out.machine_s = since(t_start);
  if (talk) {
    std::printf(
        "strata-prof: %s, %zu layers, %.2fM parameters, seq %lld, %s\n", mcfg.model_type.c_str(),
        std::size_t(mcfg.num_layers),
        [&] {
          double n = 0;
          for (const auto& u : model_units(mcfg)) n += double(u.numel);
          return n / 1e6;
        }(),
        (long long)a.seq_len, a.dtype.c_str());
    print_machine(out.machine, out.dev_name);
    std::fflush(stdout);
  }
  measure_the_model(a, base, mcfg, nvme, dopt, world_size, talk, out);
  out.measured_s = since(t_start);
  if (talk) {
    print_models(out.space, out.unmeasured);
    if (out.machine.nvme_load_bps > 0) {
      std::string rounds;  // each round alone: how far one such measurement moves here
      for (double r : out.nvme_slowdown_rounds)
        rounds += fmt::format("{}{:.0f}%", rounds.empty() ? "" : ", ", r * 100);
      std::printf(
          "  with the drive busy beside them (the engine's mix of NVMe reads and writes, %.2f "
          "GB/s) "
          "a layer's forward and backward took %.0f%% longer (%s rounds alone: %s)\n",
          out.machine.nvme_load_bps / 1e9, out.machine.nvme_compute_slowdown * 100,
          world_size * a.tp.size > 1 ? "the slowest rank's figure; rank 0's" : "its",
          rounds.c_str());
    }
    std::printf("measured in %.1f s (machine %.1f s)\n\n", out.measured_s, out.machine_s);
    std::fflush(stdout);
  }
  return out;
}

}  // namespace strata::prof
