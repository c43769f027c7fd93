// The ZeRO-3 offload engine (include/strata/engine.h).
//
// Owns: this rank's shard of every unit's training state on its tier, the gathered full
// weights of units in use or prefetched, gradient scratch, staging memory, and the three
// streams it queues work on: `fetch` (NVMe wait -> H2D -> all-gather), `comm` (gradient
// reduce-scatter -> D2H -> accumulate) and `opt` (device-side optimizer work).
// Invariants:
//  - The compute stream waits only on the ready event of the unit it asked for.
//  - A gathered buffer is freed on the fetch stream after the compute stream's release
//    event; gradient scratch written on the compute stream is freed in the comm stream's
//    order, after its last use there (so compute never stalls for it, and the memory comes
//    back without the host having to poll for it).
//  - Gathered non-resident units never exceed stage3_max_live_parameters, except that the
//    unit needed now is always fetched; prefetch follows the order recorded in the first
//    step and re-records when the model's order changes.
//  - The optimizer math is the same code whatever the placement (Stream::adamw on the
//    emulated device and CpuAdamW are bit-identical), so offload does not change results.
#include "strata/engine.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "cpu/cpu_kernels.h"
#include "scheduler/layout.h"
#include "strata/adamw.h"
#include "strata/error.h"
#include "strata/log.h"
#include "strata/nvme.h"
#include "strata/pinned_pool.h"
#include "strata/trace.h"

namespace strata {
namespace {

constexpr int kStateVersion = 1;

// A file written with write(2) and fsync'd before close, for save_state.
class SyncedFile {
 public:
  explicit SyncedFile(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) STRATA_THROW(kIo, "checkpoint: cannot create {}: {}", path, std::strerror(errno));
  }
  ~SyncedFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  void write(const void* data, std::size_t bytes) {
    write_at(data, bytes, end_);
  }
  // At byte `offset` of the file (pwrite(2)); write() goes on after the furthest byte written.
  void write_at(const void* data, std::size_t bytes, std::uint64_t offset) {
    const char* p = static_cast<const char*>(data);
    while (bytes > 0) {
      const ssize_t n = ::pwrite(fd_, p, bytes, off_t(offset));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) STRATA_THROW(kIo, "checkpoint: writing {} failed: {}", path_, std::strerror(errno));
      p += n;
      bytes -= std::size_t(n);
      offset += std::uint64_t(n);
    }
    end_ = std::max(end_, offset);
  }
  void close() {
    if (::fsync(fd_) != 0) STRATA_THROW(kIo, "checkpoint: fsync {} failed: {}", path_, std::strerror(errno));
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) STRATA_THROW(kIo, "checkpoint: closing {} failed: {}", path_, std::strerror(errno));
  }

 private:
  std::string path_;
  int fd_ = -1;
  std::uint64_t end_ = 0;
};

std::string state_file(const std::string& dir, int rank, const char* ext) {
  return (std::filesystem::path(dir) / fmt::format("rank{}.{}", rank, ext)).string();
}


// Every handle settled, then the first error thrown.
void wait_all(const std::vector<IoHandle>& hs) {
  std::exception_ptr err;
  for (const IoHandle& h : hs) try {
      h.wait();
    } catch (...) {
      if (!err) err = std::current_exception();
    }
  if (err) std::rethrow_exception(err);
}

// One bucket of an NVMe-tier gradient on its way out (Engine::reduce_grad): the writes its
// host function on the comm stream issued, and that stream's event after it.
struct GradIo {
  Event queued;
  std::vector<IoHandle> writes;  // set by the host function (read once `queued` is reached)
  // Both done; the first write error is thrown (a failed host function's own error is the comm
  // stream's, thrown by its synchronize).
  void wait() const {
    queued.synchronize();
    wait_all(writes);
  }
};

struct Unit {
  std::string name;
  std::vector<std::size_t> offsets;
  std::size_t numel = 0, padded = 0, shard = 0;
  UnitSource source;  // the initial values, until finalize() has placed this rank's shard
  // Full weights live on the device for good: stage < 3, a unit under the persistence
  // threshold, or (one rank) a unit whose compute weights are on the device tier.
  bool resident = false;
  Tier w_tier = Tier::kDevice, g_tier = Tier::kDevice, o_tier = Tier::kDevice;
  Buffer w_dev;                         // compute-weight shard (non-resident, device tier)
  std::shared_ptr<PinnedBlock> w_host;  // ... host tier
  Buffer full;                          // gathered weights (padded), while gathered
  Event w_written;                      // the device optimizer's last write of w_host (wb stream)
  Event ready, released;
  bool gathered = false;
  int in_use = 0;
  Buffer g_dev;  // fp32 gradient accumulator (shard)
  std::shared_ptr<PinnedBlock> g_host;
  Buffer o_dev;  // master | m | v, fp32, 3 * shard
  std::shared_ptr<PinnedBlock> o_host;
  Buffer grad_full;  // fp32 gradient scratch between grad_buffer() and reduce_grad()
  // An NVMe-tier gradient (g_tier kNvme), kept as keys cut by detail::grad_pieces. `g_fresh`:
  // they hold nothing of this step yet — the next reduce_grad writes instead of adding, and
  // step() takes zeros (set when made, by every step() and by load_state). `g_sumsq`: the sum
  // of squares of what the last reduce_grad wrote (the norm's part), taken as it went out.
  // `g_io`: that reduce_grad's writes, done before anything reads the keys again.
  bool g_fresh = true;
  float g_sumsq = 0;
  cpu::SumSquares g_sumsq_run;  // (the comm stream's host functions only)
  std::vector<std::shared_ptr<GradIo>> g_io;
  // The early optimizer step (Impl::early_*): second copies of host-tier state and weights,
  // and which of the two NVMe keys holds the current optimizer state / compute weights.
  std::shared_ptr<PinnedBlock> o_alt, w_alt;
  int o_gen = 0, w_gen = 0;
  // This step's early work on the unit: queued when its last gradient of the step is
  // reduced, done on the early worker, then kept or dropped by step().
  enum class Early { kNone, kQueued, kDone, kVoid } early = Early::kNone;
  Event grads_done;              // the accumulation of that last gradient
  AdamWOptions early_opt;        // the options it ran with (lr, step, grad_scale)
  std::int64_t early_call = 0;   // the step() call it was queued for (Impl::step_calls)
  float early_sumsq = 0;         // its gradient's sum of squares (the norm's part) ...
  std::int64_t norm_call = -1;   // ... for the job of this step() call (early_mu; -1: none)
  // A host-tier gradient that arrives whole in one reduce_grad: its sum of squares taken on
  // the device from the shard it was copied from (Impl::norm_host[unit], valid once the copy's
  // grads_done / the comm stream is reached) for this step() call, so no CPU pass over it.
  std::int64_t dev_sumsq_call = -1;
  std::shared_ptr<PinnedBlock> early_w;  // new weights for a device target, until finished
  std::vector<IoHandle> early_io;  // its writes to the other NVMe keys (one a sub-group and kind)
  // step() kept the early work but did not wait for it: it is finished (state and weights
  // switched to the new copy) before anything uses the unit again (Impl::finish_early).
  bool finish_pending = false;
  bool gather_pending = false;  // resident, more than one rank: finished, not yet all-gathered
  bool kept_behind = false;     // kept by the last step() and not fetched since (see prefetch_ahead)
  std::size_t first_fetch = 0;  // position of the unit's first fetch in the last step
  std::int64_t first_fetch_step = -1;
};

}  // namespace

struct Engine::Impl {
  Device& dev;
  Communicator& comm;
  EngineConfig cfg;
  int rank, world;
  std::size_t c_size;
  std::uint64_t device_alloc_waits_at_start = 0;  // DeviceStats::num_alloc_waits when made
  bool finalized = false;
  MemoryPlan plan;
  // Declared before the units: destroyed after them (units hold their blocks and buffers).
  std::unique_ptr<PinnedPool> pool;
  std::unique_ptr<SwapStore> w_store, o_store_own, g_store_own;
  SwapStore* o_store = nullptr;
  SwapStore* g_store = nullptr;  // NVMe-tier gradients: the optimizer's or the weights' store, or its own
  std::unique_ptr<CpuAdamW> cpu_adam;
  // wb: new compute weights from the device optimizer back to host or NVMe tiers; apart from
  // `fetch` so they overlap the next forward's host-to-device reads (a link carries both
  // directions at once), each unit's fetch waiting for its own (Unit::w_written).
  std::unique_ptr<Stream> fetch_s, comm_s, opt_s, wb_s;
  std::vector<Unit> units;

  // prefetch trace
  std::vector<int> trace;
  bool recording = true;
  std::size_t pos = 0;
  // Engine::set_eval: forward-only passes follow the trace's forward part, [0, eval_end), at
  // their own position (SIZE_MAX: lost), and leave the trace and `pos` alone.
  bool eval = false;
  std::size_t eval_pos = SIZE_MAX, eval_end = 0;
  std::size_t cursor() const { return eval ? eval_pos : pos; }
  std::size_t trace_end() const { return eval ? eval_end : trace.size(); }
  bool order_known() const { return !recording && cursor() != SIZE_MAX; }
  std::uint64_t live = 0;  // padded elements of gathered non-resident units

  // Pinned staging in flight (the memory plan's "gradient D2H staging" and "parameter swap
  // buffers"): the host waits for the oldest before it takes one more.
  std::deque<Event> grad_staging, param_staging;
  static void bound(std::deque<Event>& q, std::size_t most) {
    while (q.size() >= std::max<std::size_t>(most, 1)) {
      if (!q.front().query()) {
        TraceScope span("staging_wait", "engine");  // the host waits for a staging buffer
        q.front().synchronize();
      }
      q.pop_front();
    }
  }

  // fp16 loss scaling (DeepSpeed's DynamicLossScaler, consecutive_hysteresis off)
  double scale = 1;
  int hysteresis_left = 0;
  std::int64_t scaler_iter = 0, last_overflow_iter = -1;
  std::int64_t steps_taken = 0;
  EngineStats st;

  // ---- the early optimizer step ----
  // When a unit's last gradient of the step has been accumulated on the host (the count of
  // reduce_grad calls per unit is recorded in the first step), a worker thread runs its
  // AdamW at once — while backward goes on for the units before it — with clip coefficient
  // 1 and the expected lr, reading the current state and writing a second copy (host tier:
  // o_alt / w_alt; NVMe tier: the other key). step() keeps that result only when the step
  // it would have run is the same: no clipping, finite gradients, the same lr; otherwise it
  // drops it and steps the unit from the untouched state. Either way the bits are those of
  // the serial step. (The clip coefficient needs the global norm, which exists only after
  // the last gradient: that is why this is a speculation and not a reordering.)
  // step() decides what to keep without waiting for the worker: kept work still queued is
  // reordered to the next forward's order and finished behind — each unit before its next
  // fetch (or anything else that reads it) — so the AdamW of the last units to get their
  // gradients overlaps the next step's forward instead of stalling the device.
  bool early = false;  // plan.early_optimizer_step
  std::vector<int> grads_recorded, grads_now;
  bool grads_recording = true, grads_changed = false;
  std::shared_ptr<PinnedBlock> norm_host;  // one float a unit: Unit::dev_sumsq_call
  float dev_sumsq(std::size_t ui) const { return static_cast<const float*>(norm_host->data())[ui]; }
  // After a step whose early work was all redone (it clipped, overflowed, or the lr was not
  // announced), the next `early_skip` steps do not speculate — 1, 2, 4, then 8 steps, back to
  // 0 once a result is kept — so a run that clips every step does not do its AdamW twice.
  int early_skip = 0, early_backoff = 0;
  float next_lr = NAN;  // set_next_lr(), else the last step's lr
  std::thread early_thread;
  std::mutex early_mu;
  std::condition_variable early_cv;
  std::deque<std::size_t> early_queue;
  std::vector<std::size_t> early_order;  // units queued this step, in order (main thread)
  std::size_t early_busy = 0;  // queued or running jobs
  std::size_t early_next = SIZE_MAX;  // the queued job whose state the worker read ahead
  bool early_stop = false;
  std::exception_ptr early_error;
  // NVMe state reads issued ahead by the worker, and its writes in flight (worker only).
  // (Keyed by unit and sub-group.)
  std::map<std::pair<std::size_t, std::size_t>, std::pair<std::shared_ptr<PinnedBlock>, IoHandle>> early_reads;
  std::deque<IoHandle> early_writes, early_w_writes;
  // Kept early work that step() left running (Unit::finish_pending), and the fetch count of
  // the step in progress (Unit::first_fetch: the order the worker finishes them in).
  std::vector<std::size_t> pending_finish;
  std::size_t fetch_seq = 0;
  // step() calls so far, counting skipped steps (main thread), and the last call that has
  // taken its gradient norm (early_mu): jobs queued before it that the worker starts later
  // skip their sum of squares, which nothing will read.
  std::int64_t step_calls = 0, norm_taken_call = -1;

  Impl(Device& d, Communicator& c, const EngineConfig& config)
      : dev(d), comm(c), cfg(config), rank(c.rank()), world(c.world_size()) {
    STRATA_REQUIRE(&c.device() == &d, "Engine: the communicator belongs to another device");
    STRATA_REQUIRE(cfg.stage >= 1 && cfg.stage <= 3, "zero_optimization.stage = {}: use 1, 2 or 3", cfg.stage);
    STRATA_REQUIRE(cfg.compute_dtype != DType::kF64, "Engine: fp64 compute is not supported");
    if (!isa_supported(cfg.optimizer_isa))
      STRATA_THROW(kUnsupported, "config key 'strata.optimizer_isa' = \"{}\": {}; use \"auto\"",
                   isa_name(cfg.optimizer_isa), isa_unavailable(cfg.optimizer_isa));
    c_size = dtype_size(cfg.compute_dtype);
    sg = std::size_t(detail::sub_group_elems(cfg));
    bucket_share = std::size_t(detail::bucket_share_elems(cfg, world));
    device_alloc_waits_at_start = dev.stats().num_alloc_waits;
    if (cfg.fp16.enabled) {
      scale = cfg.fp16.loss_scale > 0 ? cfg.fp16.loss_scale : std::ldexp(1.0, cfg.fp16.initial_scale_power);
      hysteresis_left = cfg.fp16.hysteresis;
    }
  }

  // ---- memory ----
  Buffer alloc(std::size_t bytes, Stream* s) {
    try {
      return dev.alloc(bytes, s);
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::kOutOfMemory) throw;
    }
    // Frees queued on streams release memory only when the streams reach them: let them —
    // the engine's own streams first (units dropped on `fetch`, reduce-scatter outputs on
    // `comm`, optimizer scratch on `opt`), each a wait for that stream only; the whole device
    // (the compute stream's queue, which the host runs far ahead of) last.
    ++st.alloc_waits;
    for (Stream* own : {fetch_s.get(), comm_s.get(), opt_s.get(), wb_s.get()}) {
      if (own == nullptr) continue;
      own->synchronize();
      try {
        return dev.alloc(bytes, s);
      } catch (const Error& e) {
        if (e.kind() != ErrorKind::kOutOfMemory) throw;
      }
    }
    ++st.alloc_device_syncs;
    dev.synchronize();
    return dev.alloc(bytes, s);
  }

  std::shared_ptr<PinnedBlock> pinned(std::size_t bytes) {
    return std::make_shared<PinnedBlock>(pool->allocate(bytes));
  }

  static TensorRef view(const Buffer& b, DType t, std::size_t numel, std::size_t offset = 0) {
    return tensor(b, t, numel, offset);
  }

  SwapStore& w_swap() { return *w_store; }

  // ---- sub-groups (zero_optimization.sub_group_size; scheduler/layout.h) ----
  // The host optimizer steps a unit's shard one sub-group (range of `sg` elements, whole pages)
  // at a time, and NVMe-tier optimizer state and compute weights are stored one key per
  // sub-group: every pinned buffer between the optimizer and NVMe holds one sub-group.
  std::size_t sg = 0;
  std::size_t groups(const Unit& u) const { return std::size_t(detail::num_pieces(u.shard, sg)); }
  detail::Range range(const Unit& u, std::size_t g) const { return detail::piece(u.shard, sg, g); }
  // NVMe keys of sub-group g of the current (gen) or the other (1 - gen) copy.
  static std::string key(char kind, std::size_t u, int gen, std::size_t g) {
    return fmt::format("{}{}.{}{}", kind, u, g, gen ? "'" : "");
  }
  // Gradient buckets (zero_optimization.reduce_bucket_size): a unit's gradient is reduced
  // `bucket_share` elements of every rank's shard at a time.
  std::size_t bucket_share = 0;
  std::size_t buckets(const Unit& u) const { return std::size_t(detail::num_pieces(u.shard, bucket_share)); }
  // Whether the reduce-scatter itself goes bucket by bucket (every rank's share gathered side by
  // side first): only where that takes less device memory than one reduce-scatter of the unit
  // into a shard-sized output (scheduler/layout.h).
  bool bucketed_reduce(const Unit& u) const { return detail::bucketed_reduce(u.shard, bucket_share, world); }
  detail::Range bucket_range(const Unit& u, std::size_t b) const { return detail::piece(u.shard, bucket_share, b); }
  // An NVMe-tier gradient's keys: the pieces of a bucket or a sub-group (detail::grad_pieces),
  // each named by its first element.
  std::vector<detail::Range> grad_pieces(detail::Range r) const { return detail::grad_pieces(r, sg, bucket_share); }
  static std::string g_key(std::size_t u, std::size_t first) { return fmt::format("g{}@{}", u, first); }
  // Waits for unit u's gradient writes (before its keys are read, or the step reads them): all
  // of them, then the first error (once: they are not waited for again).
  void settle_grad_io(Unit& u) {
    std::exception_ptr err;
    for (const auto& io : std::exchange(u.g_io, {})) try {
        io->wait();
      } catch (...) {
        if (!err) err = std::current_exception();
      }
    if (err) std::rethrow_exception(err);
  }
  // Reads `r` of unit ui's NVMe-tier gradient (a sub-group, or a bucket to add to) into `dst`
  // (pinned, r.size floats); zeros when it has none this step. `dst` lives until they settle.
  std::vector<IoHandle> read_grad(std::size_t ui, detail::Range r, const std::shared_ptr<PinnedBlock>& dst) {
    Unit& u = units[ui];
    std::vector<IoHandle> reads;
    if (u.g_fresh) {
      std::memset(dst->data(), 0, r.size * 4);
      return reads;
    }
    for (const detail::Range p : grad_pieces(r)) {
      reads.push_back(g_store->read(g_key(ui, p.first), static_cast<float*>(dst->data()) + (p.first - r.first), p.size * 4));
      reads.back().on_complete([dst](std::exception_ptr) {});
      st.nvme_read_bytes += p.size * 4;
    }
    return reads;
  }
  // Bucket `r` of unit ui's reduced gradient (`part`, on the device, in the comm stream's order)
  // to its NVMe keys: copied to pinned staging, added to what the keys hold (read back, unless it
  // is the step's first gradient of the unit), its squares added to the unit's sum (restarted by
  // the first bucket), written behind. The host waits for the oldest bucket's writes before it
  // takes a third (the plan's "gradient NVMe staging").
  std::deque<std::shared_ptr<GradIo>> grad_out;
  void reduce_to_nvme(std::size_t ui, detail::Range r, const TensorRef& part, bool first_bucket, Stream& cs) {
    Unit& u = units[ui];
    while (grad_out.size() >= 2) {
      const std::shared_ptr<GradIo> oldest = grad_out.front();
      grad_out.pop_front();
      std::optional<TraceScope> span;
      if (!oldest->queued.query()) span.emplace("staging_wait", "engine");  // the host waits for staging
      oldest->wait();
    }
    if (first_bucket) settle_grad_io(u);  // the last gradient's writes of the keys read below
    const bool fresh = u.g_fresh;
    const std::size_t bytes = r.size * 4;
    auto in = pinned(bytes);
    std::shared_ptr<PinnedBlock> acc;  // what the keys hold, read back to add to
    std::vector<IoHandle> reads;
    if (!fresh) {
      acc = pinned(bytes);
      reads = read_grad(ui, r, acc);
    }
    cs.copy(host_ref(in->data(), bytes), part.mem);
    st.d2h_bytes += bytes;
    auto io = std::make_shared<GradIo>();
    cs.host_fn(
        [this, ui, r, in, acc, reads, io, first_bucket] {
          Unit& x = units[ui];
          std::shared_ptr<PinnedBlock> out = in;
          if (acc) {  // acc += g, as the host tier's accumulator
            wait_all(reads);
            float* a = static_cast<float*>(acc->data());
            const float* g = static_cast<const float*>(in->data());
            for (std::size_t i = 0; i < r.size; ++i) a[i] += g[i];
            out = acc;
          }
          const float* v = static_cast<const float*>(out->data());
          if (first_bucket) x.g_sumsq_run = cpu::SumSquares{};
          x.g_sumsq_run.add(v, r.size);
          x.g_sumsq = x.g_sumsq_run.result();
          for (const detail::Range p : grad_pieces(r)) {
            io->writes.push_back(g_store->write(g_key(ui, p.first), v + (p.first - r.first), p.size * 4));
            io->writes.back().on_complete([out](std::exception_ptr) {});
          }
        },
        "grad_to_nvme");
    io->queued = cs.record();
    u.g_io.push_back(io);
    grad_out.push_back(io);
    st.nvme_written_bytes += bytes;
  }
  std::string w_key(std::size_t u, std::size_t g) const { return key('w', u, units[u].w_gen, g); }
  std::string o_key(std::size_t u, std::size_t g) const { return key('o', u, units[u].o_gen, g); }

  // ---- placing a unit's shard (finalize, load_state) ----
  // begin_put, then put_group for every sub-group, then end_put. `first`: allocate the unit's
  // storage (finalize); otherwise overwrite what is there (load_state).
  void begin_put(std::size_t ui, bool first) {
    Unit& u = units[ui];
    if (first) {
      if (u.resident) u.full = dev.alloc(u.padded * c_size);
      else if (u.w_tier == Tier::kDevice) u.w_dev = dev.alloc(u.shard * c_size);
      else if (u.w_tier == Tier::kHost) u.w_host = pinned(SwapStore::padded_bytes(u.shard * c_size));
      if (u.o_tier == Tier::kDevice) u.o_dev = dev.alloc(3 * u.shard * 4);
      else if (u.o_tier == Tier::kHost) u.o_host = pinned(SwapStore::padded_bytes(3 * u.shard * 4));
    }
    if (u.resident && u.released.valid()) fetch_s->wait(u.released);  // the compute stream's last read
    if (!u.resident && u.w_tier == Tier::kHost && u.w_written.valid()) u.w_written.synchronize();  // a write-back
  }
  // Where the new compute weights of unit `u` go on the device — its gathered buffer (resident)
  // or its device-tier shard — or nullopt for a host or NVMe target, which the optimizer
  // writes in host memory. (`first`, `size`: the elements of the shard wanted; all by default)
  std::optional<TensorRef> w_target_dev(const Unit& u, std::size_t first = 0, std::size_t size = SIZE_MAX) const {
    size = std::min(size, u.shard);
    if (u.resident) return view(u.full, cfg.compute_dtype, size, std::size_t(rank) * u.shard + first);
    if (u.w_tier == Tier::kDevice) return view(u.w_dev, cfg.compute_dtype, size, first);
    return std::nullopt;
  }
  // Sub-group g of unit ui from its master, m and v values (g's size each; m and v null:
  // zeros) onto the unit's tiers: the optimizer state, and the compute weights derived from
  // the master exactly as the optimizer's copy-out produces them. Device-tier state is copied
  // from the caller's memory: the plan has no pinned staging for it.
  void put_group(std::size_t ui, std::size_t g, const float* master, const float* m, const float* v) {
    Unit& u = units[ui];
    const detail::Range r = range(u, g);
    const std::size_t a = r.first, n = r.size, w_bytes = n * c_size;
    const DType ct = cfg.compute_dtype;
    Stream& up = *fetch_s;
    const bool w_host = !u.resident && u.w_tier == Tier::kHost;
    std::shared_ptr<PinnedBlock> staging;
    if (!w_host) staging = pinned(SwapStore::padded_bytes(w_bytes));
    void* w = w_host ? static_cast<char*>(u.w_host->data()) + a * c_size : staging->data();
    cpu::cast(DType::kF32, master, ct, w, n);  // round to nearest even, as the copy-out
    if (const auto target = w_target_dev(u, a, n)) up.copy(target->mem, host_ref(w, w_bytes));
    else if (u.w_tier == Tier::kNvme) w_store->write(w_key(ui, g), w, w_bytes).wait();
    const float* parts[3] = {master, m, v};
    if (u.o_tier == Tier::kDevice) {
      for (std::size_t k = 0; k < 3; ++k) {
        const TensorRef dst = view(u.o_dev, DType::kF32, n, k * u.shard + a);
        if (parts[k]) up.copy(dst.mem, host_ref(parts[k], n * 4));
        else up.fill(dst, 0.0f);
      }
    } else {
      std::shared_ptr<PinnedBlock> block;  // NVMe: the sub-group's master | m | v
      if (u.o_tier == Tier::kNvme) block = pinned(SwapStore::padded_bytes(3 * n * 4));
      float* o = block ? static_cast<float*>(block->data()) : static_cast<float*>(u.o_host->data());
      for (std::size_t k = 0; k < 3; ++k) {
        float* dst = block ? o + k * n : o + k * u.shard + a;
        if (parts[k]) std::memcpy(dst, parts[k], n * 4);
        else std::memset(dst, 0, n * 4);
      }
      if (block) o_store->write(o_key(ui, g), block->data(), 3 * n * 4).wait();
    }
    up.synchronize();  // the staging is released when this scope ends
  }
  void end_put(std::size_t ui) {
    Unit& u = units[ui];
    if (!u.resident) return;
    const DType ct = cfg.compute_dtype;
    if (world > 1)
      comm.all_gather(view(u.full, ct, u.shard, std::size_t(rank) * u.shard), view(u.full, ct, u.padded), *fetch_s);
    u.gathered = true;
    u.ready = fetch_s->record();
  }

  // Unit `unit` of a public call, or a clear error naming the call (not std::out_of_range).
  Unit& unit_at(int unit, const char* call) {
    STRATA_REQUIRE(unit >= 0 && std::size_t(unit) < units.size(), "{}: no unit {} (the model registered {})", call,
                   unit, units.size());
    return units[std::size_t(unit)];
  }

  // Sub-group g of unit ui's master | m | v from its tier into `out` (3 * its size fp32 values).
  void get_group(std::size_t ui, std::size_t g, float* out) {
    Unit& u = units[ui];
    const detail::Range r = range(u, g);
    const std::size_t a = r.first, n = r.size;
    if (u.o_tier == Tier::kDevice) {
      for (std::size_t k = 0; k < 3; ++k) opt_s->copy(host_ref(out + k * n, n * 4), u.o_dev.ref((k * u.shard + a) * 4, n * 4));
      opt_s->synchronize();
    } else if (u.o_tier == Tier::kHost) {
      const float* o = static_cast<const float*>(u.o_host->data());
      for (std::size_t k = 0; k < 3; ++k) std::memcpy(out + k * n, o + k * u.shard + a, n * 4);
    } else {
      auto b = pinned(SwapStore::padded_bytes(3 * n * 4));
      o_store->read(o_key(ui, g), b->data(), 3 * n * 4).wait();
      std::memcpy(out, b->data(), 3 * n * 4);
    }
  }

  // ---- gathering ----
  void issue_fetch(int ui, bool prefetch) {
    Unit& u = units[std::size_t(ui)];
    if (u.gathered) return;
    TraceScope span(prefetch ? "prefetch" : "fetch", "engine", u.padded * c_size);
    u.full = alloc(u.padded * c_size, fetch_s.get());
    const TensorRef block = view(u.full, cfg.compute_dtype, u.shard, std::size_t(rank) * u.shard);
    switch (u.w_tier) {
      case Tier::kDevice: fetch_s->copy(block.mem, u.w_dev.ref()); break;
      case Tier::kHost:
        if (u.w_written.valid()) fetch_s->wait(u.w_written);
        fetch_s->copy(block.mem, host_ref(u.w_host->data(), u.shard * c_size));
        st.h2d_bytes += u.shard * c_size;
        break;
      case Tier::kNvme: {
        bound(param_staging, std::size_t(cfg.param_buffer_count));
        auto staging = pinned(SwapStore::padded_bytes(u.shard * c_size));
        std::vector<IoHandle> reads;  // one a sub-group, into its place in the shard
        for (std::size_t g = 0; g < groups(u); ++g) {
          const detail::Range r = range(u, g);
          reads.push_back(w_swap().read(w_key(std::size_t(ui), g), static_cast<char*>(staging->data()) + r.first * c_size,
                                        r.size * c_size));
          reads.back().on_complete([staging](std::exception_ptr) {});  // outlives it if a later read throws
        }
        // Every read settles before the staging can be freed; then the first error.
        fetch_s->host_fn([reads] { wait_all(reads); }, "nvme_wait");
        fetch_s->copy(block.mem, host_ref(staging->data(), u.shard * c_size));
        fetch_s->host_fn([staging] {}, "staging_free");
        param_staging.push_back(fetch_s->record());
        st.nvme_read_bytes += u.shard * c_size;
        st.h2d_bytes += u.shard * c_size;
        break;
      }
    }
    if (world > 1) comm.all_gather(block, view(u.full, cfg.compute_dtype, u.padded), *fetch_s);
    u.ready = fetch_s->record();
    u.gathered = true;
    live += u.padded;
    ++(prefetch ? st.prefetches : st.fetches);
  }

  void drop(Unit& u) {
    if (!u.gathered || u.resident) return;
    if (u.released.valid()) fetch_s->wait(u.released);
    u.full.reset();
    u.gathered = false;
    live -= u.padded;
  }

  // Next position after `from` where the trace uses `ui`, or SIZE_MAX.
  std::size_t next_use(int ui, std::size_t from) const {
    for (std::size_t p = from; p < trace_end(); ++p)
      if (trace[p] == ui) return p;
    return SIZE_MAX;
  }

  // Makes room for `need` more live elements by dropping released units whose next use is
  // furthest away.
  void make_room(std::uint64_t need) {
    while (live + need > cfg.max_live_parameters) {
      int victim = -1;
      std::size_t furthest = 0;
      for (std::size_t i = 0; i < units.size(); ++i) {
        const Unit& u = units[i];
        if (!u.gathered || u.resident || u.in_use > 0) continue;
        const std::size_t nu = order_known() ? next_use(int(i), cursor()) : SIZE_MAX;
        if (victim < 0 || nu > furthest) {
          victim = int(i);
          furthest = nu;
        }
      }
      if (victim < 0) return;
      drop(units[std::size_t(victim)]);
    }
  }

  void prefetch_ahead() {
    if (!order_known()) return;
    std::uint64_t ahead = 0;
    // At the end of a forward-only pass, the next one (or the next training step) begins again
    // at the first unit.
    const std::size_t from = eval && eval_pos == eval_end ? 0 : cursor();
    for (std::size_t p = from; p < trace_end(); ++p) {
      Unit& u = units[std::size_t(trace[p])];
      if (u.resident || u.gathered) continue;
      if (ahead + u.padded > std::max<std::uint64_t>(cfg.prefetch_bucket_size, 1)) break;
      if (live + u.padded > cfg.max_live_parameters) break;
      // Kept early work not finished yet: its new weights are not there. With more than one
      // rank, whether the worker is done must not decide which all-gathers go first: there
      // prefetch stops at any unit the last step left to finish, done or not.
      if (world > 1 ? u.kept_behind : !finish_early(std::size_t(trace[p]), false)) break;
      issue_fetch(trace[p], true);
      ahead += u.padded;
    }
  }

  // A fetch in a forward-only pass: on the trace's forward part if it follows it (a pass begins
  // at its first unit), else no prefetching until the next pass begins.
  void note_eval_fetch(int ui) {
    if (eval_pos < eval_end && trace[eval_pos] == ui) ++eval_pos;
    else eval_pos = eval_end > 0 && trace[0] == ui ? 1 : SIZE_MAX;
  }

  void note_fetch(int ui) {
    if (recording) {
      trace.push_back(ui);
      return;
    }
    if (pos < trace.size() && trace[pos] == ui) {
      ++pos;
      return;
    }
    log::info("engine: unit order changed at position {} (expected {}, got {}); recording it again", pos,
              pos < trace.size() ? units[std::size_t(trace[pos])].name : std::string("the end"),
              units[std::size_t(ui)].name);
    ++st.trace_rebuilds;
    trace.assign(trace.begin(), trace.begin() + std::ptrdiff_t(std::min(pos, trace.size())));
    trace.push_back(ui);
    recording = true;
  }

  // ---- the early optimizer step (see the fields above) ----
  bool early_eligible(const Unit& u) const { return early && detail::early_step_takes(u.o_tier, u.g_tier); }

  void stop_early_worker() {
    if (!early_thread.joinable()) return;
    {
      std::lock_guard<std::mutex> lk(early_mu);
      early_stop = true;
    }
    early_cv.notify_all();
    early_thread.join();
    // Reads issued ahead for jobs that will not run still target their blocks.
    for (auto& [ui, read] : std::exchange(early_reads, {})) read.second.wait_for(std::chrono::minutes(1));
  }

  // Marks every early result of the current step unusable (the state it read was replaced).
  void void_early() {
    wait_early_idle();
    std::lock_guard<std::mutex> lk(early_mu);
    for (auto& u : units) {
      if (u.early != Unit::Early::kNone) u.early = Unit::Early::kVoid;
      u.norm_call = -1;
    }
  }

  void wait_early_idle() {
    std::unique_lock<std::mutex> lk(early_mu);
    early_cv.wait(lk, [&] { return early_busy == 0; });
  }
  Unit::Early early_state(std::size_t ui) {
    std::lock_guard<std::mutex> lk(early_mu);
    return units[ui].early;
  }
  // Waits until the worker is done with unit `ui`; its final state.
  Unit::Early wait_early(std::size_t ui) {
    std::unique_lock<std::mutex> lk(early_mu);
    early_cv.wait(lk, [&] { return units[ui].early != Unit::Early::kQueued; });
    return units[ui].early;
  }
  bool early_failed() {
    std::lock_guard<std::mutex> lk(early_mu);
    return early_error != nullptr;
  }
  // Drops the jobs the worker has not started (their results could not be kept).
  void cancel_queued_early() {
    std::lock_guard<std::mutex> lk(early_mu);
    for (const std::size_t ui : early_queue) units[ui].early = Unit::Early::kVoid;
    early_busy -= early_queue.size();
    early_queue.clear();
    early_next = SIZE_MAX;
  }
  // The NVMe traffic of a unit's finished early job (kept or not).
  void count_early_io(const Unit& u) {
    if (u.o_tier == Tier::kNvme) {
      st.nvme_read_bytes += 3 * u.shard * 4;
      st.nvme_written_bytes += 3 * u.shard * 4;
    }
    if (!u.resident && u.w_tier == Tier::kNvme) st.nvme_written_bytes += u.shard * c_size;
  }
  // The worker's error (an I/O fault, say), once every write it issued has settled. Kept: the
  // state it left is not usable, so every later call that needs it throws the same error.
  [[noreturn]] void rethrow_early_error() {
    wait_early_idle();
    for (auto& u : units)
      for (IoHandle& h : u.early_io)
        if (h.valid()) h.wait_for(std::chrono::minutes(1));
    std::exception_ptr error;
    {
      std::lock_guard<std::mutex> lk(early_mu);
      error = early_error;
    }
    STRATA_CHECK(error != nullptr, "rethrow_early_error without an error");
    std::rethrow_exception(error);
  }
  // Switches unit `ui` to the result of its kept early work (step() decided to keep it):
  // the second copies become the current ones, and new weights for a device target go there
  // on the fetch stream. `block`: wait for the worker; otherwise return false if it has not
  // finished the unit yet. Local to this rank: a resident unit's all-gather, when there is
  // more than one rank, is left to gather_finished() (collective calls only).
  bool finish_early(std::size_t ui, bool block) {
    Unit& u = units[ui];
    if (!u.finish_pending) return true;
    Unit::Early state = early_state(ui);
    if (state == Unit::Early::kQueued) {
      if (!block) return false;
      TraceScope span("optimizer_wait", "engine");  // the host waits for the worker
      state = wait_early(ui);
    }
    if (state != Unit::Early::kDone || early_failed()) rethrow_early_error();
    for (IoHandle& h : u.early_io) h.wait();
    const std::size_t n = u.shard, w_bytes = n * c_size;
    count_early_io(u);
    if (u.o_tier == Tier::kHost) std::swap(u.o_host, u.o_alt);
    else u.o_gen = 1 - u.o_gen;
    if (!u.resident && u.w_tier == Tier::kHost) std::swap(u.w_host, u.w_alt);
    if (!u.resident && u.w_tier == Tier::kNvme) u.w_gen = 1 - u.w_gen;
    if (const auto target = w_target_dev(u)) {
      Stream& up = *fetch_s;
      up.copy(target->mem, host_ref(u.early_w->data(), w_bytes));
      up.host_fn([b = u.early_w] {}, "staging_free");
      st.h2d_bytes += w_bytes;
      if (u.resident && world > 1) u.gather_pending = true;
      else if (u.resident) u.ready = up.record();
    }
    {
      std::lock_guard<std::mutex> lk(early_mu);
      u.early = Unit::Early::kNone;
    }
    u.early_w.reset();
    u.early_io.clear();
    u.finish_pending = false;
    std::erase(pending_finish, ui);
    return true;
  }
  // A resident unit's new shard (finish_early) to every rank. Collective: every rank calls
  // it for the same units in the same order (Engine::fetch, step, save_state, load_state).
  void gather_finished(std::size_t ui) {
    Unit& u = units[ui];
    if (!u.gather_pending) return;
    const DType ct = cfg.compute_dtype;
    comm.all_gather(view(u.full, ct, u.shard, std::size_t(rank) * u.shard), view(u.full, ct, u.padded), *fetch_s);
    u.ready = fetch_s->record();
    u.gather_pending = false;
  }
  // Switches the kept units the worker has finished, in the next forward's order: their new
  // weights go to the device on the fetch stream ahead of their fetch (a resident unit has no
  // prefetch to do it). It stops at the first unit still being stepped: one queued behind
  // units the forward needs later would wait for all their copies on the fetch stream (the
  // forward's first unit is the last to get its gradient, so it is often the one not done).
  // Local, never waits.
  void finish_done_ahead() {
    for (const std::size_t ui : std::vector<std::size_t>(pending_finish))
      if (!finish_early(ui, false)) return;
  }
  void finish_all_early() {  // collective
    while (!pending_finish.empty()) finish_early(pending_finish.front(), true);
    for (std::size_t ui = 0; ui < units.size(); ++ui) {
      gather_finished(ui);
      units[ui].kept_behind = false;
    }
  }

  // Called for every reduce_grad, after its accumulation was queued on the comm stream.
  void note_grad(std::size_t ui, Stream& cs) {
    ++grads_now[ui];
    if (!early || grads_recording) return;
    Unit& u = units[ui];
    if (grads_now[ui] > grads_recorded[ui]) {
      // More gradients than the recorded step had: the early result (if any) used a partial
      // sum. Drop it; step() steps the unit serially and the counts are recorded again.
      grads_changed = true;
      if (early_state(ui) != Unit::Early::kNone) {
        wait_early(ui);
        std::lock_guard<std::mutex> lk(early_mu);
        u.early = Unit::Early::kVoid;
        u.norm_call = -1;  // (its norm's part too)
      }
      return;
    }
    if (grads_now[ui] < grads_recorded[ui] || !early_eligible(u) || early_skip > 0) return;
    u.grads_done = cs.record();
    u.early_opt = cfg.adamw;
    u.early_opt.lr = next_lr;
    u.early_opt.step = steps_taken + 1;
    u.early_call = step_calls;
    // Exactly the serial step's grad_scale with clip coefficient 1.
    u.early_opt.grad_scale = float(1.0 / (double(cfg.gradient_accumulation_steps) * scale));
    early_order.push_back(ui);
    {
      std::lock_guard<std::mutex> lk(early_mu);
      u.early = Unit::Early::kQueued;
      early_queue.push_back(ui);
      ++early_busy;
    }
    early_cv.notify_all();
  }

  // The position in early_queue of the job the worker takes next (early_mu held, queue not
  // empty): detail::next_early_job, by each unit's first fetch in the step that queued it.
  std::size_t next_early_job() const {
    return detail::next_early_job(
        early_queue.size(), [&](std::size_t i) { return early_queue[i] == early_next; },
        [&](std::size_t i) { return units[early_queue[i]].grads_done.query(); },
        [&](std::size_t i) { return units[early_queue[i]].first_fetch; });
  }
  // From the last sub-group of the running job (worker thread): the state of the job the worker
  // would take now is read ahead when it is on NVMe, and that job is then taken next.
  void read_ahead_next() {
    std::size_t next = SIZE_MAX;
    {
      std::lock_guard<std::mutex> lk(early_mu);
      if (early_queue.empty()) return;
      next = early_queue[next_early_job()];
      if (units[next].o_tier != Tier::kNvme) return;
      early_next = next;
    }
    early_read_ahead(next, 0);
  }

  // Whether the job of unit `ui` still owes step() its part of the gradient norm (early_mu held).
  bool norm_owed(const Unit& u) const { return u.norm_call != u.early_call && u.early_call > norm_taken_call; }

  void early_loop() {
    std::unique_lock<std::mutex> lk(early_mu);
    for (;;) {
      early_cv.wait(lk, [&] { return early_stop || !early_queue.empty(); });
      if (early_stop) return;
      early_norms(lk);
      if (early_queue.empty()) continue;  // (cancelled meanwhile)
      const auto it = early_queue.begin() + std::ptrdiff_t(next_early_job());
      const std::size_t ui = *it;
      early_queue.erase(it);
      early_next = SIZE_MAX;
      const bool need_norm = norm_owed(units[ui]);
      const std::int64_t call = units[ui].early_call;
      const bool device_norm = units[ui].dev_sumsq_call == call;
      lk.unlock();
      std::exception_ptr error;
      try {
        early_unit(ui, need_norm, device_norm);
      } catch (...) {
        error = std::current_exception();
      }
      lk.lock();
      units[ui].early = error ? Unit::Early::kVoid : Unit::Early::kDone;
      if (need_norm && !error) units[ui].norm_call = call;
      if (error && !early_error) early_error = error;
      --early_busy;
      early_cv.notify_all();
    }
  }

  // The norm's part of every queued job whose gradient is complete, before the next AdamW:
  // a few tenths of a millisecond each against the AdamW's few milliseconds, and step() needs
  // all of them before it can decide anything, while the AdamW can finish behind it. So step()
  // finds them done instead of computing them on its own thread (worker thread, `lk` held).
  void early_norms(std::unique_lock<std::mutex>& lk) {
    for (bool again = true; again && !early_stop;) {
      again = false;
      for (const std::size_t ui : early_queue) {
        Unit& u = units[ui];
        if (!norm_owed(u) || !u.grads_done.query()) continue;
        const std::int64_t call = u.early_call;
        float sq;
        if (u.dev_sumsq_call == call) {
          sq = dev_sumsq(ui);  // the device's, in host memory since grads_done
        } else {
          lk.unlock();
          TraceScope norm_span("sum_squares", "optimizer", u.shard * 4);
          sq = cpu::sum_squares(DType::kF32, u.g_host->data(), u.shard);
          lk.lock();
        }
        u.early_sumsq = sq;
        u.norm_call = call;
        again = true;  // the queue may have changed meanwhile: look again
        break;
      }
    }
  }

  // Waits for the oldest of `q` until fewer than `most` are in flight (worker thread).
  static void bound_io(std::deque<IoHandle>& q, std::size_t most) {
    while (q.size() >= std::max<std::size_t>(most, 1)) {
      IoHandle h = q.front();
      q.pop_front();
      h.wait();
    }
  }

  void early_read_ahead(std::size_t ui, std::size_t g) {
    Unit& u = units[ui];
    if (u.o_tier != Tier::kNvme || early_reads.count({ui, g})) return;
    const std::size_t n = range(u, g).size;
    auto b = pinned(SwapStore::padded_bytes(3 * n * 4));
    early_reads[{ui, g}] = {b, o_store->read(o_key(ui, g), b->data(), 3 * n * 4)};
  }

  // One unit's AdamW from its current state into the second copy, a sub-group at a time (worker
  // thread), and its part of the norm when owed (the device's when it took it). NVMe state is
  // read one sub-group ahead (the next job's first once this unit's last is stepping).
  void early_unit(std::size_t ui, bool need_norm, bool device_norm) {
    Unit& u = units[ui];
    const std::size_t n = u.shard;
    u.grads_done.synchronize();
    TraceScope span("early_optimizer_unit", "optimizer", n * 4 * 4);
    const auto* g = static_cast<const float*>(u.g_host->data());
    if (need_norm && device_norm) {
      u.early_sumsq = dev_sumsq(ui);
    } else if (need_norm) {
      TraceScope norm_span("sum_squares", "optimizer", n * 4);
      u.early_sumsq = cpu::sum_squares(DType::kF32, g, n);
    }
    const bool w_host = !u.resident && u.w_tier == Tier::kHost;
    const bool w_nvme = !u.resident && u.w_tier == Tier::kNvme;
    const bool copy_out = cfg.compute_dtype != DType::kF32;
    if (!w_host && !w_nvme) {  // new weights for the device, held until the unit switches to them
      TraceScope alloc_span("staging_alloc", "optimizer", n * c_size);
      u.early_w = pinned(SwapStore::padded_bytes(n * c_size));
    }
    const std::size_t G = groups(u);
    for (std::size_t gi = 0; gi < G; ++gi) {
      const detail::Range r = range(u, gi);
      const std::size_t a = r.first, len = r.size, w_bytes = len * c_size;
      AdamWShard sh;
      float* master = nullptr;
      std::shared_ptr<PinnedBlock> state;  // NVMe: read, stepped in place, written to the other key
      if (u.o_tier == Tier::kHost) {
        const float* src = static_cast<const float*>(u.o_host->data());
        float* dst = static_cast<float*>(u.o_alt->data());
        master = dst + a;
        sh = {host_tensor(dst + a, DType::kF32, len), host_tensor(g + a, DType::kF32, len),
              host_tensor(dst + n + a, DType::kF32, len), host_tensor(dst + 2 * n + a, DType::kF32, len), {}};
        sh.params_src = host_tensor(src + a, DType::kF32, len);
        sh.m_src = host_tensor(src + n + a, DType::kF32, len);
        sh.v_src = host_tensor(src + 2 * n + a, DType::kF32, len);
        if (gi + 1 == G) read_ahead_next();  // (an NVMe job after it)
      } else {
        early_read_ahead(ui, gi);
        if (gi + 1 < G) early_read_ahead(ui, gi + 1);
        else read_ahead_next();
        auto it = early_reads.find({ui, gi});
        state = it->second.first;
        const IoHandle h = it->second.second;
        early_reads.erase(it);
        h.wait();
        master = static_cast<float*>(state->data());
        sh = {host_tensor(master, DType::kF32, len), host_tensor(g + a, DType::kF32, len),
              host_tensor(master + len, DType::kF32, len), host_tensor(master + 2 * len, DType::kF32, len), {}};
      }
      std::shared_ptr<PinnedBlock> w_block;  // NVMe weights: the sub-group's, written behind
      if (w_nvme) {
        bound_io(early_w_writes, 2);  // the plan's "new compute-weight staging"
        TraceScope alloc_span("staging_alloc", "optimizer", w_bytes);
        w_block = pinned(SwapStore::padded_bytes(w_bytes));
      }
      void* w_dst = w_host ? static_cast<char*>(u.w_alt->data()) + a * c_size
                    : w_nvme ? w_block->data()
                             : static_cast<char*>(u.early_w->data()) + a * c_size;
      if (copy_out) sh.copy_out = host_tensor(w_dst, cfg.compute_dtype, len);
      {
        TraceScope adam_span("cpu_adamw", "optimizer", len * 4 * 4);
        cpu_adam->step(u.early_opt, sh, NonFinitePolicy::kReportOnly);
      }
      if (!copy_out) std::memcpy(w_dst, master, len * 4);
      if (state) {
        bound_io(early_writes, std::size_t(std::max(1, cfg.optimizer_buffer_count - 2)));
        IoHandle h = o_store->write(key('o', ui, 1 - u.o_gen, gi), state->data(), 3 * len * 4);
        h.on_complete([state](std::exception_ptr) {});
        early_writes.push_back(h);
        u.early_io.push_back(h);
      }
      if (w_nvme) {
        IoHandle h = w_store->write(key('w', ui, 1 - u.w_gen, gi), w_block->data(), w_bytes);
        h.on_complete([w_block](std::exception_ptr) {});
        early_w_writes.push_back(h);
        u.early_io.push_back(h);
      }
    }
  }
};

Engine::Engine(Device& device, Communicator& comm, const EngineConfig& config)
    : impl_(std::make_unique<Impl>(device, comm, config)) {}

Engine::~Engine() {
  if (!impl_) return;
  impl_->stop_early_worker();
  try {
    impl_->dev.synchronize();
  } catch (const std::exception& e) {
    log::error("engine shutdown: {}", e.what());
  }
}

int Engine::add_unit(const UnitDef& def) {
  Impl& s = *impl_;
  STRATA_REQUIRE(!s.finalized, "Engine::add_unit('{}') after finalize(): register every unit first", def.name);
  STRATA_REQUIRE(!def.params.empty(), "unit '{}' has no parameters", def.name);
  Unit u;
  u.name = def.name;
  for (const ParamDef& p : def.params) {
    STRATA_REQUIRE(p.numel > 0, "parameter '{}.{}' has 0 elements", def.name, p.name);
    STRATA_REQUIRE((p.init != nullptr) != bool(def.source), "parameter '{}.{}': {}", def.name, p.name,
                   def.source ? "the unit has a source: give no initial values" : "no initial values");
    u.offsets.push_back(u.numel);
    u.numel += p.numel;
  }
  u.padded = detail::padded_numel(u.numel, s.world);
  u.shard = u.padded / std::size_t(s.world);
  if (def.source) {
    u.source = def.source;
  } else {  // the values given, copied: a source over them
    auto flat = std::make_shared<std::vector<float>>();
    flat->reserve(u.numel);
    for (const ParamDef& p : def.params) flat->insert(flat->end(), p.init, p.init + p.numel);
    u.source = [flat](std::size_t first, std::size_t count, float* out) {
      std::copy_n(flat->data() + first, count, out);
    };
  }
  s.units.push_back(std::move(u));
  return int(s.units.size() - 1);
}

std::size_t Engine::unit_numel(int unit) const { return impl_->units.at(std::size_t(unit)).numel; }
std::size_t Engine::param_offset(int unit, int param) const {
  return impl_->units.at(std::size_t(unit)).offsets.at(std::size_t(param));
}
const MemoryPlan& Engine::plan() const { return impl_->plan; }
const EngineConfig& Engine::config() const { return impl_->cfg; }
DType Engine::compute_dtype() const { return impl_->cfg.compute_dtype; }
Isa Engine::host_optimizer_isa() const { return impl_->cpu_adam ? impl_->cpu_adam->isa() : Isa::kAuto; }
float Engine::loss_scale() const { return float(impl_->scale); }

EngineConfig Engine::with_device_defaults(EngineConfig config, const Device& device) {
  // The early optimizer step on the CPU-emulated device: its kernels run on the cores the
  // optimizer would use, so the overlap turns into contention (measured: slower steps).
  if (!config.overlap_optimizer.has_value() && device.kind() == DeviceKind::kCpu) config.overlap_optimizer = false;
  // The norm's sums on the device: free on a GPU, but the emulated device's kernels are host
  // threads, and its comm stream taking them delays the next gradient's copy (measured: the
  // engine benchmark's AdamW regime 1.18-1.23 -> 1.27-1.30).
  if (!config.device_grad_norm.has_value()) config.device_grad_norm = device.kind() != DeviceKind::kCpu;
  return config;
}

void Engine::finalize() {
  Impl& s = *impl_;
  STRATA_REQUIRE(!s.finalized, "Engine::finalize() called twice");
  STRATA_REQUIRE(!s.units.empty(), "Engine::finalize(): no units registered");
  const EngineConfig& cfg = s.cfg;

  // Tiers, in unit order, by each piece's byte position (scheduler/layout.h).
  std::vector<std::uint64_t> numel;
  for (const Unit& u : s.units) numel.push_back(u.numel);
  const std::vector<detail::UnitLayout> layout = detail::layout_units(cfg, numel, s.world);
  bool w_nvme = false, o_nvme = false, g_nvme = false;
  for (std::size_t i = 0; i < s.units.size(); ++i) {
    Unit& u = s.units[i];
    u.resident = layout[i].resident;
    u.w_tier = layout[i].w;
    u.g_tier = layout[i].g;
    u.o_tier = layout[i].o;
    w_nvme = w_nvme || (!u.resident && u.w_tier == Tier::kNvme);
    o_nvme = o_nvme || u.o_tier == Tier::kNvme;
    g_nvme = g_nvme || u.g_tier == Tier::kNvme;
  }

  const bool defaulted = !s.cfg.overlap_optimizer.has_value();
  s.cfg = with_device_defaults(s.cfg, s.dev);
  const int on_node = ranks_on_this_node(s.comm);
  if (s.cfg.host_budget_bytes == 0) s.cfg.host_budget_bytes = default_host_budget(on_node);
  if (defaulted && s.cfg.overlap_optimizer == false) {
    if (cfg.optimizer.device_fraction < 1 && cfg.grads.device_fraction < 1)
      log::info("engine: the early optimizer step is off on the CPU-emulated device (its kernels use the cores "
                "the optimizer would); strata.overlap_optimizer true turns it on");
  }

  // The plan, before anything is allocated.
  PlanInputs in;
  for (auto& u : s.units) in.units.push_back({u.name, u.numel});
  in.world_size = s.world;
  in.device_capacity = s.dev.stats().capacity_bytes;
  in.host_capacity = cfg.host_budget_bytes;
  in.nvme_capacity = (w_nvme || o_nvme || g_nvme) ? nvme_capacity(cfg, s.rank, on_node, s.world) : UINT64_MAX;
  in.ranks_on_node = on_node;
  set_host_ram_inputs(in, s.dev, on_node);
  // The settings this host refuses (more optimizer threads than it runs), said on every rank
  // below when there are several: a rank that stopped alone left the others in a collective.
  std::string host_refused;
  try {
    check_host_settings(cfg);
  } catch (const Error& e) {
    if (s.world == 1) throw;
    host_refused = e.what();
  }
  if (s.world > 1) {
    // One plan for the job: every rank plans with the least room any rank has (a rank that
    // decided otherwise — the early step off, say — would issue other collectives), so all of
    // them stop here together when it does not fit (the others would wait in their first
    // collective). And every rank reads its free space before any writes its swap files
    // below: this all-reduce is that barrier (a rank planning after a neighbour's files grew
    // counted them against itself).
    // The same all-reduce compares the settings that decide which collectives a rank issues,
    // and in what order: ranks given different ones would hang or mix buffers in a collective
    // (a double free, a truncated message) instead of saying why.
    double numel = 0, order = 0;  // (the units' sizes, and in which order)
    for (std::size_t i = 0; i < s.units.size(); ++i) {
      numel += double(s.units[i].numel);
      order += double(s.units[i].numel) * double(i + 1);
    }
    auto optional = [](const std::optional<bool>& b) { return b.has_value() ? double(*b) : -1.0; };
    const std::pair<const char*, double> same[] = {
        {"the number of units registered", double(s.units.size())},
        {"the parameters registered", numel},
        {"the units' sizes in their order (sum of size x position)", order},
        {"zero_optimization.stage", double(cfg.stage)},
        {"zero_optimization.reduce_bucket_size", double(cfg.reduce_bucket_size)},
        {"zero_optimization.stage3_prefetch_bucket_size", double(cfg.prefetch_bucket_size)},
        {"zero_optimization.stage3_max_live_parameters", double(cfg.max_live_parameters)},
        {"zero_optimization.stage3_max_reuse_distance", double(cfg.max_reuse_distance)},
        {"zero_optimization.stage3_param_persistence_threshold", double(cfg.param_persistence_threshold)},
        {"zero_optimization.overlap_comm", double(cfg.overlap_comm)},
        {"zero_optimization.sub_group_size", double(cfg.sub_group_size)},
        {"zero_optimization.offload_optimizer.buffer_count", double(cfg.optimizer_buffer_count)},
        {"zero_optimization.offload_param.buffer_count", double(cfg.param_buffer_count)},
        {"aio.block_size", double(cfg.aio.block_size)},
        {"fp16.enabled", double(cfg.fp16.enabled)},
        {"fp16.loss_scale", cfg.fp16.loss_scale},
        {"fp16.initial_scale_power", double(cfg.fp16.initial_scale_power)},
        {"fp16.loss_scale_window", double(cfg.fp16.loss_scale_window)},
        {"fp16.hysteresis", double(cfg.fp16.hysteresis)},
        {"fp16.min_loss_scale", cfg.fp16.min_loss_scale},
        {"the weights' placement (offload_param: device fraction)", cfg.params.device_fraction},
        {"the weights' placement (offload_param: host fraction)", cfg.params.host_fraction},
        {"the gradients' placement (device fraction)", cfg.grads.device_fraction},
        {"the gradients' placement (host fraction)", cfg.grads.host_fraction},
        {"the optimizer state's placement (offload_optimizer: device fraction)", cfg.optimizer.device_fraction},
        {"the optimizer state's placement (offload_optimizer: host fraction)", cfg.optimizer.host_fraction},
        {"gradient_accumulation_steps", double(cfg.gradient_accumulation_steps)},
        {"gradient_clipping", cfg.gradient_clipping},
        {"the compute dtype (bf16 / fp16 / fp32)", double(int(cfg.compute_dtype))},
        {"strata.overlap_optimizer (-1: not given)", optional(cfg.overlap_optimizer)},
        {"strata.device_grad_norm (-1: not given)", optional(cfg.device_grad_norm)}};
    std::vector<double> v = {-double(in.device_capacity), -double(s.cfg.host_budget_bytes), -double(in.nvme_capacity),
                             host_refused.empty() ? 0.0 : 1.0};
    for (const auto& [key, x] : same) v.insert(v.end(), {x, -x});
    max_across_ranks(s.comm, v);
    if (!host_refused.empty()) STRATA_THROW(kInvalidArgument, "{}", host_refused);
    STRATA_REQUIRE(v[3] == 0, "another rank's host refused its settings (its error says which and why)");
    for (std::size_t i = 0; i < std::size(same); ++i)
      STRATA_REQUIRE(v[4 + 2 * i] == -v[5 + 2 * i],
                     "the ranks were given different engine settings: {} is {:g} on some and {:g} on others; "
                     "give every rank the same config",
                     same[i].first, -v[5 + 2 * i], v[4 + 2 * i]);
    in.device_capacity = bytes_from_double(-v[0]);
    s.cfg.host_budget_bytes = in.host_capacity = bytes_from_double(-v[1]);  // the pool's budget too
    in.nvme_capacity = bytes_from_double(-v[2]);
  }
  s.plan = plan_memory(cfg, in);
  if (s.world > 1) {
    // One outcome for the job: every input above is the same on every rank but the NVMe paths
    // (node-local), which can still decide whether it fits, and with it the early step.
    double o[] = {s.plan.fits ? 0.0 : 1.0, s.plan.early_optimizer_step ? 1.0 : 0.0,
                  s.plan.early_optimizer_step ? 0.0 : 1.0};
    max_across_ranks(s.comm, o);
    if (s.plan.fits && o[0] > 0)
      STRATA_THROW(kOutOfMemory, "the training state does not fit on another rank (its error says where and what to "
                   "change)");
    STRATA_REQUIRE(o[0] > 0 || o[1] + o[2] < 2,
                   "the ranks planned the early optimizer step differently (strata.overlap_optimizer left to the "
                   "plan): set strata.overlap_optimizer, or give every rank the same config and NVMe paths");
  }
  if (!s.plan.fits) {
    // The problems first (the message's first lines name what to change), then the table
    // without them (its tail would say them again).
    std::string problems;
    for (auto& p : s.plan.problems) problems += "\n  " + p;
    MemoryPlan shown = s.plan;
    shown.problems.clear();
    STRATA_THROW(kOutOfMemory, "the training state does not fit:{}\n{}", problems, shown.table());
  }
  for (const std::string& n : s.plan.notes) log::info("engine: {}", n);
  s.early = s.plan.early_optimizer_step;
  s.grads_recorded.assign(s.units.size(), 0);
  s.grads_now.assign(s.units.size(), 0);

  s.fetch_s = s.dev.create_stream("fetch");
  s.comm_s = s.dev.create_stream("comm");
  s.opt_s = s.dev.create_stream("optimizer");
  s.wb_s = s.dev.create_stream("writeback");
  PinnedPoolOptions po;
  po.budget_bytes = cfg.host_budget_bytes;
  po.huge_pages = cfg.aio.use_hugepages;
  po.lock = cfg.pin_memory;
  po.device = &s.dev;
  s.pool = std::make_unique<PinnedPool>(po);
  if (std::any_of(s.units.begin(), s.units.end(), [](const Unit& u) { return u.g_tier == Tier::kHost; }))
    s.norm_host = s.pinned(4 * s.units.size());
  CpuAdamWConfig ac;
  ac.policy = NonFinitePolicy::kReportOnly;
  ac.threads = cfg.optimizer_threads;
  ac.isa = cfg.optimizer_isa;
  s.cpu_adam = std::make_unique<CpuAdamW>(ac);

  auto store_options = [&](const std::vector<std::string>& paths, const char* key) {
    SwapStoreOptions so;
    so.paths = paths;
    so.rank = s.rank;
    so.world_size = s.world;
    so.aio = cfg.aio;
    so.config_key = key;
    return so;
  };
  // One store where two pieces name the same directories (detail::same_dirs).
  using detail::same_dirs;
  if (w_nvme) s.w_store = std::make_unique<SwapStore>(store_options(cfg.param_nvme_paths, "zero_optimization.offload_param.nvme_path"));
  if (o_nvme) {
    if (s.w_store && same_dirs(cfg.optimizer_nvme_paths, cfg.param_nvme_paths)) {
      s.o_store = s.w_store.get();
    } else {
      s.o_store_own = std::make_unique<SwapStore>(store_options(cfg.optimizer_nvme_paths, "zero_optimization.offload_optimizer.nvme_path"));
      s.o_store = s.o_store_own.get();
    }
  }
  if (g_nvme) {  // beside the optimizer state (config: its nvme_path), else the weights
    if (s.o_store && same_dirs(cfg.grad_nvme_paths, cfg.optimizer_nvme_paths)) {
      s.g_store = s.o_store;
    } else if (s.w_store && same_dirs(cfg.grad_nvme_paths, cfg.param_nvme_paths)) {
      s.g_store = s.w_store.get();
    } else {
      s.g_store_own = std::make_unique<SwapStore>(store_options(cfg.grad_nvme_paths, detail::grad_nvme_path_key(cfg)));
      s.g_store = s.g_store_own.get();
    }
  }

  // Initial state: this rank's shard of every unit, from its source a sub-group at a time (the
  // padding beyond the unit's elements zero).
  Stream& up = *s.fetch_s;
  std::vector<float> master;
  for (std::size_t ui = 0; ui < s.units.size(); ++ui) {
    Unit& u = s.units[ui];
    // compute weights as the optimizer's copy-out would produce them, and the optimizer state
    // (master | m | v, m and v zero), a sub-group at a time
    s.begin_put(ui, /*first=*/true);
    for (std::size_t g = 0; g < s.groups(u); ++g) {
      const detail::Range r = s.range(u, g);
      const std::size_t first = std::size_t(s.rank) * u.shard + r.first;
      const std::size_t given = first < u.numel ? std::min(r.size, u.numel - first) : 0;
      master.assign(r.size, 0.0f);
      if (given > 0) u.source(first, given, master.data());
      s.put_group(ui, g, master.data(), nullptr, nullptr);
      up.synchronize();  // put_group's copies read `master`
    }
    s.end_put(ui);
    if (s.early_eligible(u)) {  // the early step's second copies (the plan's lines)
      if (u.o_tier == Tier::kHost) u.o_alt = s.pinned(SwapStore::padded_bytes(3 * u.shard * 4));
      if (!u.resident && u.w_tier == Tier::kHost) u.w_alt = s.pinned(SwapStore::padded_bytes(u.shard * s.c_size));
      for (std::size_t g = 0; g < s.groups(u); ++g) {
        const std::size_t n = s.range(u, g).size;
        if (u.o_tier == Tier::kNvme) s.o_store->reserve(Impl::key('o', ui, 1, g), 3 * n * 4);
        if (!u.resident && u.w_tier == Tier::kNvme) s.w_store->reserve(Impl::key('w', ui, 1, g), n * s.c_size);
      }
    }
    // gradient accumulator (NVMe: its keys' room taken now, so a full disk is said here)
    if (u.g_tier == Tier::kDevice) {
      u.g_dev = s.dev.alloc(u.shard * 4);
      up.fill(Impl::view(u.g_dev, DType::kF32, u.shard), 0.0f);
    } else if (u.g_tier == Tier::kHost) {
      u.g_host = s.pinned(u.shard * 4);
      std::memset(u.g_host->data(), 0, u.shard * 4);
    } else {
      for (const detail::Range p : s.grad_pieces({0, u.shard})) s.g_store->reserve(Impl::g_key(ui, p.first), p.size * 4);
    }
    up.synchronize();  // the staging above is released when this scope ends
    u.source = nullptr;  // what it holds (a copy of given values) goes now
  }
  master.clear();
  master.shrink_to_fit();
  if (s.early) s.early_thread = std::thread([&s] { s.early_loop(); });
  s.finalized = true;
}

void Engine::check_host_settings(const EngineConfig& config) {
  const std::string too_many = CpuAdamW::threads_problem(config.optimizer_threads);  // named as the key that asked
  STRATA_REQUIRE(too_many.empty(), "config key 'strata.optimizer_threads' = {}: {}", config.optimizer_threads,
                 too_many);
}

void Engine::set_next_lr(float lr) { impl_->next_lr = lr; }

void Engine::set_eval(bool on) {
  Impl& s = *impl_;
  STRATA_REQUIRE(s.finalized, "Engine::set_eval before finalize()");
  if (on == s.eval) return;
  s.eval = on;
  if (!on) return;
  // The forward part of the recorded order: up to the first unit fetched a second time.
  s.eval_end = s.trace.size();
  std::vector<bool> seen(s.units.size(), false);
  for (std::size_t p = 0; p < s.trace.size(); ++p) {
    if (seen[std::size_t(s.trace[p])]) {
      s.eval_end = p;
      break;
    }
    seen[std::size_t(s.trace[p])] = true;
  }
  s.eval_pos = 0;
  s.prefetch_ahead();  // the first pass's first units
}

TensorRef Engine::fetch(int unit, Stream& compute) {
  Impl& s = *impl_;
  STRATA_REQUIRE(s.finalized, "Engine::fetch before finalize()");
  STRATA_REQUIRE(unit >= 0 && std::size_t(unit) < s.units.size(), "Engine::fetch: no unit {}", unit);
  Unit& u = s.units[std::size_t(unit)];
  if (!s.eval && u.first_fetch_step != s.steps_taken) {
    std::lock_guard<std::mutex> lk(s.early_mu);  // next_early_job reads it on the worker
    u.first_fetch_step = s.steps_taken;
    u.first_fetch = s.fetch_seq++;
  }
  s.finish_early(std::size_t(unit), true);
  s.finish_done_ahead();
  s.gather_finished(std::size_t(unit));
  u.kept_behind = false;
  if (!u.resident) {
    if (s.eval) s.note_eval_fetch(unit);
    else s.note_fetch(unit);
    if (!u.gathered) {
      s.make_room(u.padded);
      s.issue_fetch(unit, false);
    }
    s.prefetch_ahead();
  }
  ++u.in_use;
  compute.wait(u.ready);
  return Impl::view(u.full, s.cfg.compute_dtype, u.numel);
}

void Engine::release(int unit, Stream& compute) {
  Impl& s = *impl_;
  Unit& u = s.unit_at(unit, "Engine::release");
  STRATA_REQUIRE(u.in_use > 0, "Engine::release('{}') without a matching fetch", u.name);
  --u.in_use;
  // A resident unit stays, but its weights are overwritten in place by step() (the optimizer's
  // copy-out, the early step's switch) and load_state: after this event.
  u.released = compute.record();
  if (u.resident || u.in_use > 0) return;
  // Keep it gathered if the trace uses it again soon and the budget allows.
  if (s.order_known()) {
    const std::size_t nu = s.next_use(unit, s.cursor());
    if (nu != SIZE_MAX) {
      std::uint64_t dist = 0;
      for (std::size_t p = s.cursor(); p < nu; ++p) dist += s.units[std::size_t(s.trace[p])].padded;
      if (dist <= s.cfg.max_reuse_distance) return;
    }
  }
  s.drop(u);
}

TensorRef Engine::grad_buffer(int unit, Stream& compute, GradInit init) {
  Impl& s = *impl_;
  STRATA_REQUIRE(s.finalized, "Engine::grad_buffer before finalize()");
  STRATA_REQUIRE(!s.eval, "Engine::grad_buffer while set_eval(true): a forward-only pass has no backward; "
                 "call set_eval(false) before training");
  Unit& u = s.unit_at(unit, "Engine::grad_buffer");
  STRATA_REQUIRE(!u.grad_full, "Engine::grad_buffer('{}') twice without reduce_grad", u.name);
  u.grad_full = s.alloc(u.padded * 4, &compute);
  // The padding is always zero: it is reduced, and its squares go into the gradient norm.
  const std::size_t from = init == GradInit::kOverwrite ? u.numel : 0;
  if (from < u.padded) compute.fill(Impl::view(u.grad_full, DType::kF32, u.padded - from, from), 0.0f);
  return Impl::view(u.grad_full, DType::kF32, u.numel);
}

void Engine::reduce_grad(int unit, Stream& compute) {
  Impl& s = *impl_;
  STRATA_REQUIRE(s.finalized, "Engine::reduce_grad before finalize()");
  Unit& u = s.unit_at(unit, "Engine::reduce_grad");
  STRATA_REQUIRE(static_cast<bool>(u.grad_full), "Engine::reduce_grad('{}') without grad_buffer", u.name);
  s.finish_early(std::size_t(unit), true);  // its last early job reads the accumulator
  Stream& cs = *s.comm_s;
  cs.wait(compute.record());
  const std::size_t ui = std::size_t(unit), n = u.shard;
  const bool host_first = u.g_tier == Tier::kHost && s.grads_now[ui] == 0;
  // The step's only gradient of the unit (as recorded), arriving whole into a host
  // accumulator: its part of the norm from the same kernel on the device, beside the copy (a
  // GPU does it in microseconds; on the host it was a pass over the shard on the CPU the
  // optimizer needs). Bit for bit the host's: the same fp32 shard, the same kernel (step()
  // falls back to the host if more come) — so only where the whole reduced shard is on the
  // device at once (not when the reduce-scatter itself goes bucket by bucket).
  const std::size_t buckets = s.buckets(u);
  const bool bucketed = s.bucketed_reduce(u);
  const bool device_norm = host_first && s.cfg.device_grad_norm.value_or(true) && !s.grads_recording &&
                           s.grads_recorded[ui] == 1 && !bucketed;
  // The whole reduced shard, when it is on the device at once. One rank: the gradient is its
  // own shard (an average over one rank is the value itself), so no second buffer and no copy;
  // the scratch is freed after the accumulation below.
  Buffer full;
  if (s.world == 1) {
    full = std::move(u.grad_full);
  } else if (!bucketed) {
    full = s.alloc(n * 4, &cs);
    s.comm.reduce_scatter(Impl::view(u.grad_full, DType::kF32, u.padded), Impl::view(full, DType::kF32, n),
                          ReduceOp::kAvg, cs);
    ++s.st.reduce_scatters;
  }
  // In buckets of reduce_bucket_size (a bucket_share of every rank's shard): each (reduced on
  // the comm stream, when bucketed, and) added into this rank's accumulator, so the host
  // staging — and the reduce-scatter's buffers, when bucketed — hold one bucket's share.
  for (std::size_t b = 0; b < buckets; ++b) {
    const detail::Range r = s.bucket_range(u, b);
    const std::size_t a = r.first, len = r.size;
    Buffer out;
    TensorRef part;  // this rank's reduced elements [a, a + len) of the shard
    if (bucketed) {
      out = s.alloc(len * 4, &cs);
      part = Impl::view(out, DType::kF32, len);
      // Every rank's [a, a + len) of the unit side by side: the bucket's contiguous input.
      Buffer bucket = s.alloc(std::size_t(s.world) * len * 4, &cs);
      for (int q = 0; q < s.world; ++q)
        cs.copy(bucket.ref(std::size_t(q) * len * 4, len * 4), u.grad_full.ref((std::size_t(q) * n + a) * 4, len * 4));
      s.comm.reduce_scatter(Impl::view(bucket, DType::kF32, std::size_t(s.world) * len), part, ReduceOp::kAvg, cs);
      bucket.reset_on(cs);
      ++s.st.reduce_scatters;
    } else {
      part = Impl::view(full, DType::kF32, len, a);
    }
    if (u.g_tier == Tier::kDevice) {
      const TensorRef acc = Impl::view(u.g_dev, DType::kF32, len, a);
      cs.add(acc, part, acc);
    } else if (u.g_tier == Tier::kNvme) {
      s.reduce_to_nvme(ui, r, part, b == 0, cs);
    } else if (host_first) {
      // The step's first gradient of the unit goes straight into its accumulator: no staging
      // and no host pass (what it holds from the last step is overwritten, not added to; bitwise
      // the same as 0 + g for the optimizer, which never sees the sign of a zero gradient).
      cs.copy(host_ref(static_cast<float*>(u.g_host->data()) + a, len * 4), part.mem);
      s.st.d2h_bytes += len * 4;
    } else {
      Impl::bound(s.grad_staging, 2);
      auto staging = s.pinned(len * 4);
      cs.copy(host_ref(staging->data(), len * 4), part.mem);
      s.st.d2h_bytes += len * 4;
      float* acc = static_cast<float*>(u.g_host->data()) + a;
      cs.host_fn(
          [staging, acc, len] {
            const float* g = static_cast<const float*>(staging->data());
            for (std::size_t i = 0; i < len; ++i) acc[i] += g[i];
          },
          "grad_accumulate");
      s.grad_staging.push_back(cs.record());
    }
    if (device_norm && b + 1 == buckets) {
      Buffer sq = s.alloc(4, &cs);
      cs.sum_squares(Impl::view(full, DType::kF32, n), Impl::view(sq, DType::kF32, 1));
      cs.copy(host_ref(static_cast<float*>(s.norm_host->data()) + unit, 4), sq.ref());
      sq.reset_on(cs);
      std::lock_guard<std::mutex> lk(s.early_mu);
      u.dev_sumsq_call = s.step_calls;
    }
    if (out) out.reset_on(cs);  // its last use: the accumulation above
    ++s.st.grad_buckets;
  }
  if (s.world > 1) u.grad_full.reset_on(cs);  // its last use: the reduce-scatters
  if (full) full.reset_on(cs);                // its last use: the accumulation above
  u.g_fresh = false;
  s.note_grad(std::size_t(unit), cs);
}

StepResult Engine::step(float lr) {
  Impl& s = *impl_;
  STRATA_REQUIRE(s.finalized, "Engine::step before finalize()");
  STRATA_REQUIRE(!s.eval, "Engine::step while set_eval(true): call set_eval(false) after the evaluation");
  s.finish_all_early();  // a unit the model did not fetch since the last step
  for (auto& u : s.units)
    STRATA_REQUIRE(u.in_use == 0 && !u.grad_full, "Engine::step: unit '{}' is still fetched or has an unreduced gradient",
                   u.name);
  s.comm_s->synchronize();
  s.fetch_s->synchronize();
  for (auto& u : s.units) s.settle_grad_io(u);  // NVMe-tier gradients written
  s.grad_out.clear();
  Stream& os = *s.opt_s;
  // Resident units' weights are rewritten in place below and after (the optimizer stream's
  // copy-out, the fetch stream's switch to kept early results): only once the compute stream
  // has done what it queued before release(), which the last reduce_grad need not cover.
  for (const Unit& u : s.units) {
    if (!u.resident || !u.released.valid()) continue;
    os.wait(u.released);
    s.fetch_s->wait(u.released);
  }
  for (std::size_t ui = 0; ui < s.units.size(); ++ui)  // no gradient this step: still last step's
    if (s.units[ui].g_tier == Tier::kHost && s.grads_now[ui] == 0)
      std::memset(s.units[ui].g_host->data(), 0, s.units[ui].shard * 4);

  // Global gradient norm (and fp16 overflow) from the accumulators: one all-reduce. Each
  // unit's sum of squares is the fp32 result of the same kernel wherever its gradient lives
  // (the device's sum_squares; on the host the CPU kernel the emulated device runs), summed
  // in unit order: offloading gradients does not change the norm, hence the clipping.
  double local = 0;
  {
    TraceScope span("grad_norm", "optimizer");
    std::vector<float> part(s.units.size(), 0.0f);
    Buffer sq = s.alloc(4 * s.units.size(), &os);
    bool any_device = false;
    for (std::size_t ui = 0; ui < s.units.size(); ++ui) {
      Unit& u = s.units[ui];
      if (u.g_tier == Tier::kDevice) {
        os.sum_squares(Impl::view(u.g_dev, DType::kF32, u.shard), Impl::view(sq, DType::kF32, 1, ui));
        any_device = true;
      }
    }
    std::vector<float> dev_part(s.units.size(), 0.0f);
    if (any_device) os.copy(host_ref(dev_part.data(), 4 * dev_part.size()), sq.ref());
    for (std::size_t ui = 0; ui < s.units.size(); ++ui) {
      Unit& u = s.units[ui];
      // NVMe: taken as the last gradient went out (reduce_to_nvme), the host's kernel's bits.
      if (u.g_tier == Tier::kNvme) part[ui] = u.g_fresh ? 0.0f : u.g_sumsq;
      if (u.g_tier != Tier::kHost) continue;
      // The early worker computed it with the same kernel from the same final gradient.
      bool done;
      {
        std::lock_guard<std::mutex> lk(s.early_mu);
        done = u.norm_call == s.step_calls;
      }
      // Or the device took it from the step's only gradient (the comm stream is done).
      const bool device = s.grads_now[ui] == 1 && u.dev_sumsq_call == s.step_calls;
      if (done || device) {
        part[ui] = done ? u.early_sumsq : s.dev_sumsq(ui);
      } else {
        TraceScope norm_span("sum_squares", "optimizer", u.shard * 4);
        part[ui] = cpu::sum_squares(DType::kF32, u.g_host->data(), u.shard);
      }
    }
    os.synchronize();
    for (std::size_t ui = 0; ui < s.units.size(); ++ui)
      local += double(s.units[ui].g_tier == Tier::kDevice ? dev_part[ui] : part[ui]);
  }
  double total = local;
  if (s.world > 1) {
    Buffer b = s.alloc(8, &os);
    os.copy(b.ref(), host_ref(&local, 8));
    s.comm.all_reduce(TensorRef{b.ref(), DType::kF64, 1}, ReduceOp::kSum, os);
    os.copy(host_ref(&total, 8), b.ref());
    os.synchronize();
  }
  {
    std::lock_guard<std::mutex> lk(s.early_mu);
    s.norm_taken_call = s.step_calls++;
  }
  const double den = double(s.cfg.gradient_accumulation_steps) * s.scale;
  StepResult r;
  r.loss_scale = s.scale;
  r.grad_norm = std::sqrt(total) / den;
  const bool overflow = !std::isfinite(r.grad_norm);

  if (s.cfg.fp16.enabled) {  // DeepSpeed's DynamicLossScaler::update_scale
    if (s.cfg.fp16.loss_scale <= 0) {
      if (overflow) {
        if (s.cfg.fp16.hysteresis == 1 || s.hysteresis_left == 1)
          s.scale = std::max(s.scale / 2, s.cfg.fp16.min_loss_scale);
        else
          --s.hysteresis_left;
        s.last_overflow_iter = s.scaler_iter;
      } else if ((s.scaler_iter - s.last_overflow_iter) % s.cfg.fp16.loss_scale_window == 0) {
        s.hysteresis_left = s.cfg.fp16.hysteresis;
        s.scale *= 2;
      }
      ++s.scaler_iter;
    }
  }
  const DType ct = s.cfg.compute_dtype;

  // The early step's results: kept when this step is the one they assumed (finite, no
  // clipping, the same lr and step) — without waiting for them: the worker finishes them
  // behind, in the next forward's order, and each unit switches to its new copy before it is
  // used again (finish_early). The decision depends on nothing timed, so every rank makes the
  // same one (a resident unit's all-gather moves with it). Otherwise dropped: the state they
  // read is untouched, and the serial loop below steps the unit.
  const bool clipped = s.cfg.gradient_clipping > 0 && r.grad_norm > s.cfg.gradient_clipping;
  if (overflow || clipped) s.cancel_queued_early();
  std::vector<bool> kept(s.units.size(), false);
  const std::vector<std::size_t> early_order = std::exchange(s.early_order, {});
  bool any_kept = false;
  for (const std::size_t ui : early_order) {
    Unit& u = s.units[ui];
    const bool keep = !overflow && !clipped && u.early_opt.lr == lr && u.early_opt.step == s.steps_taken + 1;
    const Unit::Early state = keep ? s.early_state(ui) : s.wait_early(ui);
    if (keep && state != Unit::Early::kVoid) {
      kept[ui] = true;
      u.finish_pending = true;
      s.pending_finish.push_back(ui);
      ++s.st.early_units_kept;
      if (state == Unit::Early::kQueued) ++s.st.early_units_finished_behind;
      any_kept = true;
      continue;
    }
    const bool failed = s.early_failed();
    if (!failed) {
      // Its writes (to the second NVMe keys) settle before anything else may write there: a
      // job voided after it ran (a unit that got more gradients than recorded) issued them
      // too, and the next step's early job writes the same keys.
      for (IoHandle& h : u.early_io) h.wait();
      if (state == Unit::Early::kDone) s.count_early_io(u);  // what it moved, for nothing
    }
    ++s.st.early_units_redone;
    if (!failed) u.early_io.clear();
    {
      std::lock_guard<std::mutex> lk(s.early_mu);
      u.early = Unit::Early::kNone;
    }
    u.early_w.reset();
  }
  if (s.early_failed()) s.rethrow_early_error();  // the run stops with the worker's error
  if (s.pending_finish.empty()) {
    s.wait_early_idle();
    // State read ahead for jobs that were cancelled: stale after this step.
    for (auto& [ui, read] : std::exchange(s.early_reads, {})) read.second.wait_for(std::chrono::minutes(1));
  } else {
    {
      // The next forward takes the units in the order this one did: the worker follows it.
      std::lock_guard<std::mutex> lk(s.early_mu);
      std::stable_sort(s.early_queue.begin(), s.early_queue.end(),
                       [&](std::size_t a, std::size_t b) { return s.units[a].first_fetch < s.units[b].first_fetch; });
    }
    for (const std::size_t ui : s.pending_finish) s.units[ui].kept_behind = true;
    // ... and switches them in that order (finish_done_ahead): the first the forward needs first.
    std::stable_sort(s.pending_finish.begin(), s.pending_finish.end(),
                     [&](std::size_t a, std::size_t b) { return s.units[a].first_fetch < s.units[b].first_fetch; });
  }
  if (!early_order.empty()) {
    s.early_backoff = any_kept ? 0 : std::min(8, std::max(1, 2 * s.early_backoff));
    s.early_skip = any_kept ? 0 : s.early_backoff;
  } else if (s.early_skip > 0) {
    --s.early_skip;
    ++s.st.early_steps_skipped;
  }
  // The gradient counts of this step become the record the next step's early work follows.
  if (s.grads_recording || s.grads_changed || s.grads_now != s.grads_recorded) {
    if (!s.grads_recording) log::info("engine: the gradients per unit changed this step; recording them again");
    s.grads_recorded = s.grads_now;
    s.grads_recording = false;
    s.grads_changed = false;
  }
  std::fill(s.grads_now.begin(), s.grads_now.end(), 0);
  s.next_lr = lr;

  // Host accumulators need no zeroing: the next step's first gradient overwrites them (and a
  // unit without one is zeroed when that step begins).
  auto zero_grads = [&] {
    for (auto& u : s.units) {
      if (u.g_tier == Tier::kDevice) os.fill(Impl::view(u.g_dev, DType::kF32, u.shard), 0.0f);
      if (u.g_tier == Tier::kNvme) u.g_fresh = true;
    }
    os.synchronize();
  };
  // The next forward starts the recorded order again, whether this step updates or is skipped.
  auto rewind_trace = [&] {
    s.recording = false;
    s.pos = 0;
    s.fetch_seq = 0;
  };
  if (overflow) {
    if (!s.cfg.fp16.enabled)
      log::warn("step {}: the gradient norm is not finite; the step is skipped", s.steps_taken + 1);
    zero_grads();
    rewind_trace();
    r.skipped = true;
    r.step = s.steps_taken;
    return r;
  }
  if (s.cfg.gradient_clipping > 0 && r.grad_norm > s.cfg.gradient_clipping)
    r.clip_coef = s.cfg.gradient_clipping / (r.grad_norm + 1e-6);

  AdamWOptions opt = s.cfg.adamw;
  opt.lr = lr;
  opt.step = s.steps_taken + 1;
  opt.grad_scale = float(r.clip_coef / den);
  const bool copy_out = ct != DType::kF32;

  // Sub-groups of the host optimizer with state or gradients on NVMe: the next one's stream in
  // while this one computes; state writes go out behind, at most optimizer_buffer_count in flight.
  std::vector<std::pair<std::size_t, std::size_t>> nvme_groups;  // (unit, sub-group)
  for (std::size_t i = 0; i < s.units.size(); ++i) {
    const Unit& u = s.units[i];
    if (!kept[i] && (u.o_tier == Tier::kNvme || (u.g_tier == Tier::kNvme && u.o_tier == Tier::kHost)))
      for (std::size_t g = 0; g < s.groups(u); ++g) nvme_groups.push_back({i, g});
  }
  struct GroupRead {
    std::shared_ptr<PinnedBlock> state, grad;  // master | m | v; the gradient
    IoHandle state_read;
    std::vector<IoHandle> grad_reads;
  };
  std::map<std::pair<std::size_t, std::size_t>, GroupRead> reads;
  std::deque<IoHandle> writes;  // optimizer state written behind
  // At most optimizer_buffer_count state buffers at once: one read ahead, one stepping, the
  // rest written behind (the memory plan's "optimizer swap buffers", a sub-group each).
  const std::size_t max_writes = std::size_t(std::max(1, s.cfg.optimizer_buffer_count - 2));
  // New compute weights staged in pinned memory on their way to the device or NVMe: at most
  // two sub-groups' at once (the plan's "new compute-weight staging"); each entry waits for one
  // to be free.
  std::deque<std::function<void()>> w_staging;
  auto stage_w = [&](std::size_t bytes) {
    while (w_staging.size() >= 2) {
      w_staging.front()();
      w_staging.pop_front();
    }
    return s.pinned(SwapStore::padded_bytes(bytes));
  };
  auto issue_read = [&](std::size_t k) {
    if (k >= nvme_groups.size()) return;
    const auto [ui, g] = nvme_groups[k];
    const detail::Range r = s.range(s.units[ui], g);
    GroupRead& rd = reads[nvme_groups[k]];
    if (s.units[ui].o_tier == Tier::kNvme) {
      const std::size_t bytes = 3 * r.size * 4;
      auto b = s.pinned(SwapStore::padded_bytes(bytes));
      rd.state_read = s.o_store->read(s.o_key(ui, g), b->data(), bytes);
      rd.state_read.on_complete([b](std::exception_ptr) {});  // the block outlives the read, even if step() throws
      s.st.nvme_read_bytes += bytes;
      rd.state = b;
    }
    if (s.units[ui].g_tier == Tier::kNvme) {
      rd.grad = s.pinned(SwapStore::padded_bytes(r.size * 4));
      rd.grad_reads = s.read_grad(ui, r, rd.grad);
    }
  };
  // Writes `bytes` from `block` to `store`; the block lives until the write completes.
  auto write_behind = [&](SwapStore& store, const std::string& key, std::shared_ptr<PinnedBlock> block,
                          std::size_t bytes) {
    IoHandle h = store.write(key, block->data(), bytes);
    h.on_complete([block](std::exception_ptr) {});
    s.st.nvme_written_bytes += bytes;
    return h;
  };
  auto write_state = [&](const std::string& key, std::shared_ptr<PinnedBlock> block, std::size_t bytes) {
    writes.push_back(write_behind(*s.o_store, key, std::move(block), bytes));
    while (writes.size() > max_writes) {
      writes.front().wait();
      writes.pop_front();
    }
  };
  // New NVMe-tier weights of sub-group g of unit ui, from `block`, written behind.
  auto write_w = [&](std::size_t ui, std::size_t g, std::shared_ptr<PinnedBlock> block, std::size_t bytes) {
    IoHandle h = write_behind(*s.w_store, s.w_key(ui, g), std::move(block), bytes);
    w_staging.push_back([h] { h.wait(); });
  };
  std::size_t nvme_next = 0;
  issue_read(nvme_next++);

  for (std::size_t ui = 0; ui < s.units.size(); ++ui) {
    Unit& u = s.units[ui];
    if (kept[ui]) continue;
    // The whole unit (state in, update, weights out); the update itself is the device's
    // adamw kernel or the cpu_adamw spans below, so a trace tells waiting from computing.
    TraceScope span("optimizer_unit", "optimizer", u.shard * 4 * 4);
    const std::size_t n = u.shard;
    const std::size_t w_bytes = n * s.c_size;
    const auto target = s.w_target_dev(u);  // device-resident compute weights, if any

    if (u.o_tier == Tier::kDevice) {
      Buffer g_tmp, scratch;
      TensorRef g;
      if (u.g_tier == Tier::kDevice) {
        g = Impl::view(u.g_dev, DType::kF32, n);
      } else if (u.g_tier == Tier::kHost) {
        g_tmp = s.alloc(n * 4, &os);
        os.copy(g_tmp.ref(), host_ref(u.g_host->data(), n * 4));
        g = Impl::view(g_tmp, DType::kF32, n);
      } else {  // NVMe: a sub-group at a time through pinned staging
        g_tmp = s.alloc(n * 4, &os);
        for (std::size_t gi = 0; gi < s.groups(u); ++gi) {
          const detail::Range r = s.range(u, gi);
          auto staging = s.pinned(SwapStore::padded_bytes(r.size * 4));
          wait_all(s.read_grad(ui, r, staging));
          os.copy(g_tmp.ref(r.first * 4, r.size * 4), host_ref(staging->data(), r.size * 4));
          os.synchronize();
          s.st.h2d_bytes += r.size * 4;
        }
        g = Impl::view(g_tmp, DType::kF32, n);
      }
      AdamWShard sh{Impl::view(u.o_dev, DType::kF32, n, 0), g, Impl::view(u.o_dev, DType::kF32, n, n),
                    Impl::view(u.o_dev, DType::kF32, n, 2 * n), {}};
      if (copy_out) {
        if (target) {
          sh.copy_out = *target;
        } else {
          // Allocated on the stream that writes it first (a block whose free is still queued
          // on another stream must not be handed to it), freed on the write-back stream after
          // the copy below has read it.
          scratch = s.alloc(w_bytes, &os);
          sh.copy_out = Impl::view(scratch, ct, n);
        }
      }
      AdamWDesc d;
      d.options = opt;
      d.policy = NonFinitePolicy::kReportOnly;
      d.shards.push_back(sh);
      os.adamw(d);
      if (target) {
        if (!copy_out) os.copy(target->mem, u.o_dev.ref(0, n * 4));
        continue;
      }
      // The new weights go back over the link on the write-back stream, so the next unit's
      // update overlaps this unit's device -> host copy, and host-tier ones (not waited for
      // here) the next forward's reads: its fetch of the unit waits for w_written.
      const Buffer& new_w = copy_out ? scratch : u.o_dev;  // (fp32: the master itself)
      Stream& xs = *s.wb_s;
      xs.wait(os.record());
      if (u.w_tier == Tier::kHost) {
        xs.copy(host_ref(u.w_host->data(), w_bytes), new_w.ref(0, w_bytes));
        u.w_written = xs.record();
      } else {
        // NVMe: a sub-group at a time through staging, written by the host once copied.
        for (std::size_t gi = 0; gi < s.groups(u); ++gi) {
          const detail::Range r = s.range(u, gi);
          auto block = stage_w(r.size * s.c_size);
          xs.copy(host_ref(block->data(), r.size * s.c_size), new_w.ref(r.first * s.c_size, r.size * s.c_size));
          xs.synchronize();
          write_w(ui, gi, block, r.size * s.c_size);
        }
      }
      if (scratch) scratch.reset_on(xs);
      s.st.d2h_bytes += w_bytes;
      continue;
    }
    // The host optimizer, a sub-group at a time.
    for (std::size_t gi = 0; gi < s.groups(u); ++gi) {
      const detail::Range r = s.range(u, gi);
      const std::size_t a = r.first, len = r.size, len_w = len * s.c_size;
      float* master = nullptr;
      AdamWShard sh;
      GroupRead rd;  // what was read ahead from NVMe for this sub-group
      if (u.o_tier == Tier::kNvme || u.g_tier == Tier::kNvme) {
        issue_read(nvme_next++);
        auto it = reads.find({ui, gi});
        rd = std::move(it->second);
        reads.erase(it);
      }
      std::shared_ptr<PinnedBlock> state_block;
      if (u.o_tier == Tier::kHost) {
        float* o = static_cast<float*>(u.o_host->data());
        master = o + a;
        sh.params = host_tensor(o + a, DType::kF32, len);
        sh.m = host_tensor(o + n + a, DType::kF32, len);
        sh.v = host_tensor(o + 2 * n + a, DType::kF32, len);
      } else {
        rd.state_read.wait();
        state_block = rd.state;
        master = static_cast<float*>(state_block->data());
        sh.params = host_tensor(master, DType::kF32, len);
        sh.m = host_tensor(master + len, DType::kF32, len);
        sh.v = host_tensor(master + 2 * len, DType::kF32, len);
      }
      std::shared_ptr<PinnedBlock> g_stage;
      if (u.g_tier == Tier::kHost) {
        sh.grads = host_tensor(static_cast<const float*>(u.g_host->data()) + a, DType::kF32, len);
      } else if (u.g_tier == Tier::kNvme) {
        wait_all(rd.grad_reads);
        g_stage = rd.grad;
        sh.grads = host_tensor(g_stage->data(), DType::kF32, len);
      } else {
        g_stage = s.pinned(len * 4);
        os.copy(host_ref(g_stage->data(), len * 4), u.g_dev.ref(a * 4, len * 4));
        os.synchronize();
        s.st.d2h_bytes += len * 4;
        sh.grads = host_tensor(g_stage->data(), DType::kF32, len);
      }
      const bool to_host = !target && u.w_tier == Tier::kHost;  // written in place, no staging
      std::shared_ptr<PinnedBlock> w_block;
      if (!to_host) w_block = stage_w(len_w);
      void* w_dst = to_host ? static_cast<char*>(u.w_host->data()) + a * s.c_size : w_block->data();
      if (copy_out) sh.copy_out = host_tensor(w_dst, ct, len);
      {
        TraceScope adam_span("cpu_adamw", "optimizer", len * 4 * 4);
        s.cpu_adam->step(opt, sh, NonFinitePolicy::kReportOnly);
      }
      if (!copy_out) std::memcpy(w_dst, master, len * 4);
      if (target) {
        os.copy(s.w_target_dev(u, a, len)->mem, host_ref(w_dst, len_w));
        os.host_fn([w_block] {}, "staging_free");
        w_staging.push_back([e = os.record()] { e.synchronize(); });
        s.st.h2d_bytes += len_w;
      }
      if (state_block) write_state(s.o_key(ui, gi), state_block, 3 * len * 4);
      if (!u.resident && u.w_tier == Tier::kNvme) write_w(ui, gi, w_block, len_w);
    }
  }
  for (auto& h : writes) h.wait();
  for (auto& w : w_staging) w();
  os.synchronize();
  s.fetch_s->synchronize();

  // Resident units: gather the updated shards.
  for (auto& u : s.units) {
    if (!u.resident || s.world == 1 || u.finish_pending) continue;  // (finish_early gathers those)
    const TensorRef block = Impl::view(u.full, ct, u.shard, std::size_t(s.rank) * u.shard);
    s.comm.all_gather(block, Impl::view(u.full, ct, u.padded), os);
  }
  // Gathered non-resident units hold the old weights: drop them.
  for (auto& u : s.units) s.drop(u);
  zero_grads();
  for (auto& u : s.units)
    if (u.resident && !u.finish_pending) u.ready = os.record();
  os.synchronize();

  // Kept units the worker has already finished switch now (after the loops above, which
  // leave them alone): their new weights go to the device on the fetch stream while it steps
  // the rest. Local only: a resident unit's all-gather still waits for its fetch.
  s.finish_done_ahead();

  rewind_trace();
  r.step = ++s.steps_taken;
  return r;
}

std::vector<float> Engine::master_shard(int unit) {
  Impl& s = *impl_;
  STRATA_REQUIRE(s.finalized, "Engine::master_shard before finalize()");
  Unit& u = s.unit_at(unit, "Engine::master_shard");
  s.finish_early(std::size_t(unit), true);
  std::vector<float> out(u.shard), buf;
  for (std::size_t g = 0; g < s.groups(u); ++g) {
    const detail::Range r = s.range(u, g);
    buf.resize(3 * r.size);
    s.get_group(std::size_t(unit), g, buf.data());
    std::copy_n(buf.begin(), r.size, out.begin() + std::ptrdiff_t(r.first));
  }
  return out;
}

std::vector<float> Engine::gather_master(int unit) {
  Impl& s = *impl_;
  Unit& u = s.unit_at(unit, "Engine::gather_master");
  std::vector<float> shard = master_shard(unit);
  std::vector<float> full(u.padded);
  if (s.world == 1) {
    full = shard;
  } else {
    Buffer b = s.alloc(u.padded * 4, s.opt_s.get());
    const TensorRef block = Impl::view(b, DType::kF32, u.shard, std::size_t(s.rank) * u.shard);
    s.opt_s->copy(block.mem, host_ref(shard.data(), u.shard * 4));
    s.comm.all_gather(block, Impl::view(b, DType::kF32, u.padded), *s.opt_s);
    s.opt_s->copy(host_ref(full.data(), u.padded * 4), b.ref());
    s.opt_s->synchronize();
  }
  full.resize(u.numel);
  return full;
}

std::vector<float> Engine::gather_master_to(int unit, int root) {
  Impl& s = *impl_;
  Unit& u = s.unit_at(unit, "Engine::gather_master_to");
  STRATA_REQUIRE(root >= 0 && root < s.world, "Engine::gather_master_to: root {} is not a rank of this {}-rank job",
                 root, s.world);
  if (s.world == 1) return gather_master(unit);
  std::vector<float> shard = master_shard(unit);
  const bool am_root = s.rank == root;
  Buffer b = s.alloc((am_root ? u.padded : u.shard) * 4, s.opt_s.get());
  const TensorRef block = Impl::view(b, DType::kF32, u.shard, am_root ? std::size_t(s.rank) * u.shard : 0);
  s.opt_s->copy(block.mem, host_ref(shard.data(), u.shard * 4));
  s.comm.gather(block, am_root ? Impl::view(b, DType::kF32, u.padded) : TensorRef{}, root, *s.opt_s);
  std::vector<float> full;
  if (am_root) {
    full.resize(u.padded);
    s.opt_s->copy(host_ref(full.data(), u.padded * 4), b.ref());
  }
  s.opt_s->synchronize();
  if (am_root) full.resize(u.numel);
  return full;
}

// ---- checkpoints ----
// dir/rank<R>.bin: for every unit in order, this rank's master | m | v shard (3 * shard fp32
// values, padding included), streamed one unit at a time from whichever tier holds it.
// dir/rank<R>.json: the layout (units, numel, shard, byte offsets), the rank and world size,
// and the scalar state (steps taken, fp16 loss-scaler fields).
void Engine::save_state(const std::string& dir) {
  Impl& s = *impl_;
  STRATA_REQUIRE(s.finalized, "Engine::save_state before finalize()");
  for (auto& u : s.units)
    STRATA_REQUIRE(u.in_use == 0 && !u.grad_full, "Engine::save_state: unit '{}' is still fetched or has an unreduced "
                   "gradient; save between steps", u.name);
  s.finish_all_early();
  s.comm_s->synchronize();
  s.fetch_s->synchronize();
  s.opt_s->synchronize();
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  STRATA_REQUIRE(!ec, "checkpoint: cannot create {}: {}", dir, ec.message());

  nlohmann::json j;
  j["format"] = "strata-engine-state";
  j["version"] = kStateVersion;
  j["rank"] = s.rank;
  j["world_size"] = s.world;
  j["steps_taken"] = s.steps_taken;
  j["loss_scale"] = s.scale;
  j["hysteresis_left"] = s.hysteresis_left;
  j["scaler_iter"] = s.scaler_iter;
  j["last_overflow_iter"] = s.last_overflow_iter;
  j["compute_dtype"] = std::string(dtype_name(s.cfg.compute_dtype));
  nlohmann::json units = nlohmann::json::array();
  SyncedFile bin(state_file(dir, s.rank, "bin"));
  std::vector<float> buf;
  std::uint64_t offset = 0;
  for (std::size_t ui = 0; ui < s.units.size(); ++ui) {
    const Unit& u = s.units[ui];
    // A sub-group at a time, each of its master, m and v to its place in the unit's record
    // (the file does not depend on sub_group_size).
    for (std::size_t g = 0; g < s.groups(u); ++g) {
      const detail::Range r = s.range(u, g);
      buf.resize(3 * r.size);
      s.get_group(ui, g, buf.data());
      for (std::size_t k = 0; k < 3; ++k)
        bin.write_at(buf.data() + k * r.size, r.size * 4, offset + (k * u.shard + r.first) * 4);
    }
    units.push_back({{"name", u.name}, {"numel", u.numel}, {"shard", u.shard}, {"offset", offset}});
    offset += 3 * u.shard * 4;
  }
  bin.close();
  j["units"] = std::move(units);
  j["bytes"] = offset;
  const std::string text = j.dump(1);
  SyncedFile meta(state_file(dir, s.rank, "json"));
  meta.write(text.data(), text.size());
  meta.close();
}

void Engine::load_state(const std::string& dir) {
  Impl& s = *impl_;
  STRATA_REQUIRE(s.finalized, "Engine::load_state before finalize(): build the engine as for training, then load");
  for (auto& u : s.units)
    STRATA_REQUIRE(u.in_use == 0 && !u.grad_full, "Engine::load_state: unit '{}' is still fetched", u.name);
  auto read_json = [&](int r) {
    const std::string path = state_file(dir, r, "json");
    std::ifstream f(path);
    if (!f) return nlohmann::json();
    std::stringstream ss;
    ss << f.rdbuf();
    try {
      return nlohmann::json::parse(ss.str());
    } catch (const std::exception& e) {
      STRATA_THROW(kInvalidArgument, "checkpoint {}: {} is not valid JSON: {}", dir, path, e.what());
    }
  };
  // Rank 0's file says how many ranks wrote the checkpoint, whatever this run's world size.
  const nlohmann::json j0 = read_json(0);
  STRATA_REQUIRE(!j0.is_null(), "checkpoint {}: no engine state (rank0.json is missing)", dir);
  const int ck_world = j0.value("world_size", -1);
  STRATA_REQUIRE(ck_world == s.world, "checkpoint {} has {} rank{}, this run has {}; resharding is not supported yet",
                 dir, ck_world, ck_world == 1 ? "" : "s", s.world);
  const nlohmann::json j = s.rank == 0 ? j0 : read_json(s.rank);
  STRATA_REQUIRE(!j.is_null(), "checkpoint {}: rank{}.json is missing", dir, s.rank);
  STRATA_REQUIRE(j.value("format", "") == "strata-engine-state" && j.value("version", 0) == kStateVersion,
                 "checkpoint {}: rank{}.json is not a strata engine state of version {}", dir, s.rank, kStateVersion);
  STRATA_REQUIRE(j.value("rank", -1) == s.rank, "checkpoint {}: rank{}.json was written by rank {}", dir, s.rank,
                 j.value("rank", -1));
  const nlohmann::json& units = j.at("units");
  STRATA_REQUIRE(units.size() == s.units.size(), "checkpoint {} has {} units, this model has {}: a different model",
                 dir, units.size(), s.units.size());
  for (std::size_t ui = 0; ui < s.units.size(); ++ui) {
    const Unit& u = s.units[ui];
    const nlohmann::json& cu = units[ui];
    const std::string name = cu.value("name", "");
    STRATA_REQUIRE(name == u.name, "checkpoint {}: unit {} is '{}', this model's is '{}': a different model", dir, ui,
                   name, u.name);
    const std::size_t numel = cu.value("numel", std::size_t(0)), shard = cu.value("shard", std::size_t(0));
    STRATA_REQUIRE(numel == u.numel, "checkpoint {}: unit '{}' has {} elements, this model's {}: a different model",
                   dir, u.name, numel, u.numel);
    STRATA_REQUIRE(shard == u.shard, "checkpoint {}: unit '{}' has a shard of {} elements, this run {}", dir, u.name,
                   shard, u.shard);
  }
  const std::string bin_path = state_file(dir, s.rank, "bin");
  std::ifstream bin(bin_path, std::ios::binary);
  STRATA_REQUIRE(bin.good(), "checkpoint {}: {} cannot be read: {}", dir, bin_path, std::strerror(errno));
  bin.seekg(0, std::ios::end);
  const std::uint64_t size = std::uint64_t(bin.tellg());
  STRATA_REQUIRE(size == j.value("bytes", std::uint64_t(0)), "checkpoint {}: {} has {} bytes, rank{}.json says {}",
                 dir, bin_path, size, s.rank, j.value("bytes", std::uint64_t(0)));
  bin.seekg(0);

  s.finish_all_early();
  s.comm_s->synchronize();
  s.fetch_s->synchronize();
  s.opt_s->synchronize();
  s.void_early();  // early optimizer work of a step in progress read the state replaced below
  for (auto& u : s.units) s.drop(u);  // gathered copies hold the old weights
  std::vector<float> buf;
  for (std::size_t ui = 0; ui < s.units.size(); ++ui) {
    Unit& u = s.units[ui];
    const std::uint64_t at = units[ui].value("offset", std::uint64_t(0));
    s.begin_put(ui, /*first=*/false);
    for (std::size_t g = 0; g < s.groups(u); ++g) {  // (pageable: put_group stages what needs it)
      const detail::Range r = s.range(u, g);
      buf.resize(3 * r.size);
      for (std::size_t k = 0; k < 3; ++k) {
        bin.seekg(std::streamoff(at + (k * u.shard + r.first) * 4));
        bin.read(reinterpret_cast<char*>(buf.data() + k * r.size), std::streamsize(r.size * 4));
      }
      STRATA_REQUIRE(bin.good(), "checkpoint {}: {} is truncated at unit '{}'", dir, bin_path, u.name);
      s.put_group(ui, g, buf.data(), buf.data() + r.size, buf.data() + 2 * r.size);
    }
    s.end_put(ui);
    if (u.g_tier == Tier::kDevice) {
      s.opt_s->fill(Impl::view(u.g_dev, DType::kF32, u.shard), 0.0f);
    } else if (u.g_tier == Tier::kHost) {
      std::memset(u.g_host->data(), 0, u.shard * 4);
    } else {
      try {
        s.settle_grad_io(u);  // (what they wrote is dropped: a write error does not matter now)
      } catch (const Error&) {
      }
      u.g_fresh = true;
    }
  }
  s.opt_s->synchronize();
  s.steps_taken = j.at("steps_taken").get<std::int64_t>();
  s.scale = j.at("loss_scale").get<double>();
  s.hysteresis_left = j.at("hysteresis_left").get<int>();
  s.scaler_iter = j.at("scaler_iter").get<std::int64_t>();
  s.last_overflow_iter = j.at("last_overflow_iter").get<std::int64_t>();
}

std::int64_t Engine::steps_taken() const { return impl_->steps_taken; }

EngineStats Engine::stats() const {
  const Impl& s = *impl_;
  EngineStats st = s.st;
  const DeviceStats ds = s.dev.stats();
  st.device_peak_bytes = ds.peak_bytes_in_use;
  st.device_alloc_waits = ds.num_alloc_waits - s.device_alloc_waits_at_start;
  st.device_capacity = ds.capacity_bytes;
  if (s.pool) {
    const PinnedPoolStats ps = s.pool->stats();
    st.host_pinned_peak_bytes = ps.peak_reserved_bytes;
    st.host_budget_bytes = ps.budget_bytes;
  }
  if (s.w_store) st.nvme_bytes += s.w_store->stats().file_bytes;
  if (s.o_store_own) st.nvme_bytes += s.o_store_own->stats().file_bytes;
  if (s.g_store_own) st.nvme_bytes += s.g_store_own->stats().file_bytes;
  return st;
}

}  // namespace strata
