// The step-time model and the placement search (include/strata/perf_model.h).
//
// The model is a replay, not a formula: every operation the engine issues for one step is
// issued here in the same host order, onto the same streams (FIFO each), using one resource
// (a lane that serves one operation at a time, in issue order) for bytes / bandwidth or a
// measured time. Waits are the engine's waits. The step's length, each lane's busy time and
// the schedule (for the timeline picture) fall out. When a step leaves work for the next one
// (kept early optimizer work finished behind), two steps are replayed and the second, a
// steady-state step, is the prediction. What it replays is the engine's schedule: fetches
// (param_coordinator.cpp), gradient reduction (grad_reduce.cpp), the optimizer pass
// (optimizer_step.cpp) and the early step (early_step.cpp); when the engine changes what it
// overlaps this must follow, and strata-prof --validate is how a mismatch shows.
#include "strata/perf_model.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <deque>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "cpu/cpu_info.h"
#include "scheduler/schedule.h"
#include "strata/dtype.h"
#include "strata/error.h"
#include "strata/model.h"

namespace strata {

const char* resource_name(Resource r) {
  switch (r) {
    case Resource::kCompute:
      return "compute";
    case Resource::kH2D:
      return "h2d";
    case Resource::kD2H:
      return "d2h";
    case Resource::kNvme:
      return "nvme";
    case Resource::kCpu:
      return "cpu";
    case Resource::kComm:
      return "comm";
    case Resource::kTp:
      return "tp";
    case Resource::kCount:
      break;
  }
  return "?";
}

namespace {

constexpr std::size_t kNone = std::numeric_limits<std::size_t>::max();
constexpr double kNever = std::numeric_limits<double>::infinity();

enum StreamId { kComputeS, kFetchS, kCommS, kOptS, kHostS, kEarlyS, kWbS, kNumStreams };
// As Interval::stream names them: the engine's stream names (engine.cpp), "host" and "early"
// for its host thread and early-optimizer worker, "" for none.
const char* stream_name(StreamId s) {
  constexpr const char* kNames[] = {"compute", "fetch", "comm",      "optimizer",
                                    "host",    "early", "writeback", ""};
  return kNames[s];
}

struct SimUnit {
  std::uint64_t numel = 0, padded = 0, shard = 0;
  bool resident = false;
  Tier w = Tier::kDevice, g = Tier::kDevice, o = Tier::kDevice;
  // state during the replay
  bool gathered = false;
  int in_use = 0;
  double ready = 0, released = 0;
  double w_written = 0;  // the device optimizer's write-back of its host-tier weights
};

// When the device's lanes run on the host's own cores (the CPU-emulated device): how many there
// are, and the cores an operation on each lane wants while it runs (below 1: the share of its
// time that is CPU work, the rest sleeps, as a throttled copy does). cores == 0: nothing shared.
struct CoreShare {
  double cores = 0;
  // How much longer a kernel takes while the drive is busy (MachineProfile::nvme_compute_slowdown).
  double drive_slowdown = 0;
  double lane_weight[int(Resource::kCount) + 1] =
      {};  // by lane; the last: no lane (device memory passes, frees)
};

// One operation's use of the cores, for the next replay's stretch.
struct CoreUse {
  double start = 0, end = 0, weight = 0;
  bool kernel = false;  // on the compute lane
  bool copy = false;    // on a copy lane: it keeps its rate, and takes its cores first
};
// What one replay leaves for the next one's stretch: every operation's use of the cores, by
// operation index, and the NVMe lane's busy spans.
struct CoreLoad {
  std::vector<CoreUse> uses;
  std::vector<std::pair<double, double>> drive;
};

// Operations on streams and lanes.
class Sim {
 public:
  double stream_free[kNumStreams] = {};
  double lane_free[int(Resource::kCount)] = {};
  double busy[int(Resource::kCount)] = {};
  std::vector<Interval> schedule;
  // Core sharing: `stretch` (from the previous replay, by operation index) lengthens each
  // operation's CPU part; every operation's use is recorded in `load`, and the NVMe lane's busy
  // spans.
  const CoreShare* share = nullptr;
  const std::vector<double>* stretch = nullptr;
  CoreLoad load;

  // An operation on stream `s` (or the host thread) using lane `r` (kCount: none), ready at
  // `ready`; returns its end. `weight`: cores it uses (< 0: the lane's).
  double op(StreamId s, Resource r, double ready, double dur, const std::string& what,
            double weight = -1, double bytes = 0) {
    const double end = lane(r, std::max(stream_free[s], ready), dur, what, weight, bytes, s);
    stream_free[s] = end;
    return end;
  }
  // Work that is not on a stream (NVMe requests): the lane only (kCount: no lane, no wait).
  double lane(Resource r, double ready, double dur, const std::string& what, double weight = -1,
              double bytes = 0, StreamId s = kNumStreams) {
    if (weight < 0) weight = share ? share->lane_weight[int(r)] : 0.0;
    // A copy keeps its measured rate beside the other work, and takes its core from the rest
    // (its use is noted with its weight): the OS runs a thread that wakes for a short job ahead
    // of the kernels' team that has long been running. The traced steps show it: every copy of
    // the offload regime's candidates at its measured rate, which the replay had stretched to
    // 1.14-2.15x that (Intel Xeon VM, 2 cores, 2026-12-04).
    const double own = std::max(dur, 0.0), shared = stretched(own, weight);
    dur = r == Resource::kH2D || r == Resource::kD2H ? own : shared;
    if (r == Resource::kCount) {
      note(ready, ready + dur, weight, false);
      return ready + dur;
    }
    const double start = std::max(lane_free[int(r)], ready);
    const double end = start + dur;
    lane_free[int(r)] = end;
    busy[int(r)] += end - start;
    if (r == Resource::kNvme && end > start && share && share->drive_slowdown > 0)
      load.drive.push_back({start, end});
    if (end > start)
      schedule.push_back({r, start, end, what, stream_name(s), std::uint64_t(bytes)});
    note(start, end, weight, r == Resource::kCompute, r == Resource::kH2D || r == Resource::kD2H);
    return end;
  }
  // The host thread's own CPU work (allocations it poisons) from host time `h`: returns the new h.
  double host(double h, double dur) {
    dur = stretched(std::max(dur, 0.0), 1.0);
    note(h, h + dur, 1.0, false);
    return h + dur;
  }
  // A stream waits for an event.
  void wait(StreamId s, double t) { stream_free[s] = std::max(stream_free[s], t); }

 private:
  // The CPU part of an operation (its weight, up to one core's worth of time) runs slower by
  // the stretch the previous replay found for it.
  double stretched(double dur, double weight) {
    const std::size_t i = next_++;
    if (!share || share->cores <= 0 || !stretch || i >= stretch->size()) return dur;
    return dur * (1.0 + std::min(1.0, weight) * ((*stretch)[i] - 1.0));
  }
  void note(double start, double end, double weight, bool kernel, bool copy = false) {
    if (share && share->cores > 0) load.uses.push_back({start, end, weight, kernel, copy});
  }
  std::size_t next_ = 0;
};

// Each operation's stretch when the operations of `load` share `cores` cores: the mean, over its
// time, of max(1, cores wanted / cores left to them); a kernel's also times 1 + `drive_slowdown`
// while the NVMe lane is busy (what the profile measured of kernels beside the drive). The copies
// keep their rate (Sim::lane) and so take their cores first: the rest share what they leave (a
// kernel keeping 1.6 cores busy beside a copy on 2 gets 1, not a fair 2 x 1.6 / 2.6), and at
// least half their fair share of all the cores when the copies want them all. In the offload
// regime's traced steps (AMD EPYC Zen 3 VM, AVX2, 2 cores, 2026-12-07) an 11 MB fill took 0.5 ms
// alone and 1.4-1.5 beside one copy, a matmul 0.55-0.64 alone and 1.3 beside one; shared fairly
// the replay had predicted that regime's steps 9.4% fast on average (three runs), and 2.8% so.
std::vector<double> core_stretch(const CoreLoad& load, double cores, double drive_slowdown) {
  struct Event {
    // time, change in cores wanted (by copies, by the rest), change in drive spans open
    double t, copies, wanted, drive;
    bool operator<(const Event& o) const { return t < o.t; }
  };
  std::vector<Event> ev;
  ev.reserve(2 * (load.uses.size() + load.drive.size()));
  for (const CoreUse& x : load.uses)
    if (x.end > x.start && x.weight > 0) {
      const double c = x.copy ? x.weight : 0, w = x.copy ? 0 : x.weight;
      ev.push_back({x.start, c, w, 0});
      ev.push_back({x.end, -c, -w, 0});
    }
  for (const auto& [a, b] : load.drive)
    if (b > a) {
      ev.push_back({a, 0, 0, 1});
      ev.push_back({b, 0, 0, -1});
    }
  std::sort(ev.begin(), ev.end());
  // Breakpoints and the integrals of the slowdown up to each: [0] any operation's, [1] a
  // kernel's.
  std::vector<double> t, integral[2];
  double copies = 0, wanted = 0, drive = 0, acc[2] = {0, 0};
  double last = ev.empty() ? 0 : ev.front().t;
  for (std::size_t k = 0; k < ev.size();) {
    const double avail =
        wanted > 0 ? std::max(cores - copies, 0.5 * cores * wanted / (copies + wanted)) : cores;
    const double now = ev[k].t, shared = std::max(1.0, wanted / avail);
    acc[0] += (now - last) * shared;
    acc[1] += (now - last) * shared * (drive > 0.5 ? 1.0 + drive_slowdown : 1.0);
    t.push_back(now);
    for (int j = 0; j < 2; ++j) integral[j].push_back(acc[j]);
    last = now;
    for (; k < ev.size() && ev[k].t == now; ++k) {
      copies += ev[k].copies;
      wanted += ev[k].wanted;
      drive += ev[k].drive;
    }
  }
  // The integral `f` up to x (x within the breakpoints' range).
  auto at = [&](const std::vector<double>& f, double x) {
    const std::size_t j = std::size_t(std::upper_bound(t.begin(), t.end(), x) - t.begin());
    if (j == 0) return 0.0;
    // the slowdown between t[j-1] and t[j]: recover from the integral's slope
    if (j >= t.size()) return f.back();
    const double slope = t[j] > t[j - 1] ? (f[j] - f[j - 1]) / (t[j] - t[j - 1]) : 1.0;
    return f[j - 1] + (x - t[j - 1]) * slope;
  };
  std::vector<double> out(load.uses.size(), 1.0);
  for (std::size_t i = 0; i < load.uses.size(); ++i) {
    const CoreUse& x = load.uses[i];
    const std::vector<double>& f = integral[x.kernel ? 1 : 0];
    if (x.end > x.start && x.weight > 0)
      out[i] = std::max(1.0, (at(f, x.end) - at(f, x.start)) / (x.end - x.start));
  }
  return out;
}

double secs(double bytes, double rate) { return bytes <= 0 ? 0.0 : bytes / rate; }

void need_rate(double rate, const char* what, const char* why) {
  STRATA_REQUIRE(rate > 0 && std::isfinite(rate),
                 "perf model: no {} rate was measured, and {} needs it", what, why);
}

}  // namespace

namespace {
std::vector<std::uint64_t> numels(const ModelProfile& mp) {
  std::vector<std::uint64_t> n;
  for (const UnitCost& x : mp.units) n.push_back(x.numel);
  return n;
}

// One replay of the step (see the file's head). `share`/`stretch`: core sharing (stretch by
// operation index, from the previous replay; empty: none); each operation's use of the
// cores goes to `load`.
class Replay {
 public:
  Replay(const MachineProfile& m_, const ModelProfile& mp_, const EngineConfig& c_,
         const CoreShare& share_, const std::vector<double>& stretch)
      : m(m_), mp(mp_), c(c_), share(share_) {
    STRATA_REQUIRE(!mp.units.empty(), "perf model: the model profile has no units");
    STRATA_REQUIRE(m.world_size >= 1, "perf model: world_size {} must be at least 1", m.world_size);
    STRATA_REQUIRE(c.gradient_accumulation_steps >= 1,
                   "perf model: gradient_accumulation_steps must be at least 1");
    need_rate(m.device_mem_bps, "device memory", "every step");
    need_rate(m.host_mem_bps, "host memory", "every step");
    // ---- units, tiers: as Engine::finalize places them (scheduler/layout.h) ----
    const std::vector<detail::UnitLayout> layout =
        detail::layout_units(c, numels(mp), m.world_size);
    for (std::size_t i = 0; i < N; ++i) {
      SimUnit& x = u[i];
      x.numel = layout[i].numel;
      x.padded = layout[i].padded;
      x.shard = layout[i].shard;
      x.resident = layout[i].resident;
      x.w = layout[i].w;
      x.g = layout[i].g;
      x.o = layout[i].o;
      if (!x.resident && x.w != Tier::kDevice)
        need_rate(m.h2d_bps, "host-to-device", "offloaded parameters");
      if (!x.resident && x.w == Tier::kNvme)
        need_rate(m.nvme_read_bps, "NVMe read", "parameters on NVMe");
      if (!x.resident && x.w == Tier::kNvme)
        need_rate(m.nvme_write_bps, "NVMe write", "parameters on NVMe");
      if (x.o == Tier::kNvme) need_rate(m.nvme_read_bps, "NVMe read", "optimizer state on NVMe");
      if (x.o == Tier::kNvme) need_rate(m.nvme_write_bps, "NVMe write", "optimizer state on NVMe");
      if (x.g == Tier::kNvme) need_rate(m.nvme_read_bps, "NVMe read", "gradients on NVMe");
      if (x.g == Tier::kNvme) need_rate(m.nvme_write_bps, "NVMe write", "gradients on NVMe");
      if (x.g == Tier::kNvme && x.o == Tier::kDevice)
        need_rate(m.h2d_bps, "host-to-device", "NVMe gradients");
      if (x.o != Tier::kDevice)
        need_rate(m.cpu_adamw_params_per_s, "CPU AdamW", "optimizer state off the device");
      if (x.o == Tier::kDevice)
        need_rate(m.device_adamw_params_per_s, "device AdamW", "optimizer state on the device");
      if (x.g != Tier::kDevice || x.o != Tier::kDevice || (!x.resident && x.w != Tier::kDevice))
        need_rate(m.d2h_bps, "device-to-host", "gradients or weights leaving the device");
      if (x.g == Tier::kHost && x.o == Tier::kDevice)
        need_rate(m.h2d_bps, "host-to-device", "host gradients");
    }
    if (W > 1) {
      need_rate(m.all_gather_bps, "all-gather", "more than one rank");
      need_rate(m.reduce_scatter_bps, "reduce-scatter", "more than one rank");
    }
    std::vector<Use> one;
    for (std::size_t i = 0; i < N; ++i) one.push_back({i, false});
    for (std::size_t i = head; i-- > 1;) one.push_back({i, true});
    for (std::int64_t a = 0; a < replayed; ++a)
      for (const Use& x : one)
        if (!u[x.unit].resident) trace.push_back(x.unit);
    sim.share = &share;
    sim.stretch = &stretch;
    mixed_request_s = mixed_request_at(m, optimizer_in_flight());
  }

  // The prediction; each operation's use of the cores goes to `load`.
  Prediction run(CoreLoad& load) {
    Prediction pr;
    // Kept early work that a step leaves to finish behind (Engine::step) delays the next
    // step's forward: then two steps are replayed, and the second is the prediction.
    bool any_early = false;
    for (const SimUnit& x : u) any_early = any_early || eligible(x);
    const int passes = any_early ? 2 : 1;
    double pass_start = 0, busy_before[int(Resource::kCount)] = {};
    // The micro-batches left out of the replay (see kReplayAllUpTo) take the steady one's time:
    // its host time, or a lane's busy time where a lane falls behind the host; the operations
    // after it in the schedule move that much later.
    const double skipped = double(c.gradient_accumulation_steps - replayed);
    double steady_fwd = 0, steady_bwd = 0, steady_host = 0, steady_end = 0;
    double steady_busy[int(Resource::kCount)] = {};
    for (int pass = 0; pass < passes; ++pass) {
      if (pass + 1 == passes) {
        pass_start = h;
        std::copy(std::begin(sim.busy), std::end(sim.busy), std::begin(busy_before));
      }
      pos = 0;
      early_order.clear();
      double fwd_total = 0, bwd_total = 0;
      for (std::int64_t a = 0; a < replayed; ++a) {
        first_micro_batch = a == 0;
        last_micro_batch = a + 1 == replayed;
        const double h0 = h;
        double busy0[int(Resource::kCount)];
        std::copy(std::begin(sim.busy), std::end(sim.busy), std::begin(busy0));
        const double f = forward(), b = backward();
        fwd_total += f;
        bwd_total += b;
        if (a == kSteadyMicroBatch && skipped > 0) {
          steady_fwd = f;
          steady_bwd = b;
          steady_host = h - h0;
          steady_end = h;
          for (int r = 0; r < int(Resource::kCount); ++r) steady_busy[r] = sim.busy[r] - busy0[r];
        }
      }
      pr.forward_s = fwd_total;
      pr.backward_s = bwd_total;

      pr.optimizer_s = optimizer_step();
    }  // passes
    pr.step_s = h - pass_start;

    for (int r = 0; r < int(Resource::kCount); ++r) pr.busy_s[r] = sim.busy[r] - busy_before[r];
    double shift = 0;  // the skipped micro-batches' time
    if (skipped > 0) {
      double period = steady_host;
      for (double b : steady_busy) period = std::max(period, b);
      shift = skipped * period;
      pr.step_s += shift;
      const double host_share = steady_host > 0 ? period / steady_host : 1.0;
      pr.forward_s += skipped * steady_fwd * host_share;
      pr.backward_s += skipped * steady_bwd * host_share;
      for (int r = 0; r < int(Resource::kCount); ++r) pr.busy_s[r] += skipped * steady_busy[r];
    }
    pr.bottleneck = busiest(pr.busy_s);
    pr.tokens_per_s = pr.step_s > 0
                          ? mp.tokens_per_micro_batch() * double(c.gradient_accumulation_steps) *
                                double(W) / pr.step_s
                          : 0;
    // The last step's window: what ran in it (the step before's work finished behind, too).
    for (Interval iv : sim.schedule)
      if (iv.end_s > pass_start) {
        iv.start_s = std::max(iv.start_s, pass_start) - pass_start;
        iv.end_s -= pass_start;
        if (shift > 0 && iv.start_s >= steady_end - pass_start) {
          iv.start_s += shift;
          iv.end_s += shift;
        }
        pr.schedule.push_back(iv);
      }
    load = std::move(sim.load);
    return pr;
  }

 private:
  const MachineProfile& m;
  const ModelProfile& mp;
  const EngineConfig& c;
  const CoreShare& share;
  const std::size_t N = mp.units.size();
  // The micro-batches replayed: all of them up to kReplayAllUpTo; beyond, the first, two in the
  // middle and the last, the second of the middle ones (kSteadyMicroBatch) standing for those
  // left out (run() scales it). A replay of every one took time and memory in proportion to
  // gradient_accumulation_steps, for every candidate and every pass of the fixed point.
  static constexpr std::int64_t kReplayAllUpTo = 8, kSteadyMicroBatch = 2;
  const std::int64_t replayed = c.gradient_accumulation_steps <= kReplayAllUpTo
                                    ? c.gradient_accumulation_steps
                                    : kSteadyMicroBatch + 2;
  const std::uint64_t W = std::uint64_t(m.world_size);
  const double csz = double(dtype_size(c.compute_dtype));
  const bool copy_out = c.compute_dtype != DType::kF32;
  std::vector<SimUnit> u = std::vector<SimUnit>(N);
  // The host optimizer's sub-groups and the reducer's buckets, as the engine cuts a shard.
  const std::uint64_t sub_group = detail::sub_group_elems(c),
                      bucket_share = detail::bucket_share_elems(c, m.world_size);
  // The early optimizer step (strata.overlap_optimizer) of the units whose optimizer runs on
  // the host from host gradients. The search sets the flag from the plan; unset, the engine's
  // default (on) is assumed. Modelled as kept: no clipping, the lr announced.
  const bool early = c.overlap_optimizer.value_or(true);
  // ---- the fetch sequence of one step: the trace the engine records ----
  // Forward: embed, layers, head (the head also takes unit 0 with tied embeddings, which the
  // profile does not know; the units' costs already include it). Backward: layers in reverse;
  // the embedding's backward takes only its gradient.
  const std::size_t head = N - 1;
  struct Use {
    std::size_t unit;
    bool backward;
  };
  std::vector<std::size_t> trace;  // non-resident units, in fetch order, micro-batches replayed
  Sim sim;
  const double all_cores = share.cores;
  const double adamw_cores = c.optimizer_threads > 0
                                 ? std::min<double>(c.optimizer_threads, share.cores)
                                 : share.cores;
  double h = 0;  // the host thread
  // Pinned staging in flight, as the engine bounds it: the host waits for the oldest.
  std::deque<double> grad_staging, param_staging;
  // NVMe-tier gradients: the writes of the buckets in flight (two), and the last of all.
  std::deque<double> grad_nvme;
  double grad_writes = 0;
  // The ends of the reduces on the comm stream not yet waited for (Engine::Impl::reduces).
  std::deque<double> reduces;
  std::uint64_t live = 0;
  std::size_t pos = 0;  // position in `trace`
  const double fetch_read_bps = m.nvme_fetch_read_bps > 0 ? m.nvme_fetch_read_bps : m.nvme_read_bps;
  // EarlyStepper::finish: kept early work the last step did not wait for, before the
  // unit's first use (the host waits for the worker; new weights for the device go over the
  // link on the fetch stream, then a resident unit's all-gather).
  // pending[i]: kept, not finished; worker_done(i) replays the worker's queue up to unit i's
  // job and returns when it and its writes are done (defined with the worker, below).
  std::vector<bool> pending = std::vector<bool>(N, false),
                    kept_behind = std::vector<bool>(N, false);
  // NVMe rates when reads and writes share the drive (the optimizer's state traffic).
  const double opt_read_bps = m.nvme_mixed_bps > 0 ? m.nvme_mixed_bps : m.nvme_read_bps;
  const double opt_write_bps = m.nvme_mixed_bps > 0 ? m.nvme_mixed_bps : m.nvme_write_bps;
  const double norm_bps = m.host_norm_bps > 0 ? m.host_norm_bps : m.host_mem_bps;
  const std::size_t max_writes = detail::state_writes_in_flight(c);
  // The drive's per-request part beside the optimizer's traffic, at the depth it keeps in flight:
  // its read ahead, its state written behind and, with weights on NVMe, their new values written
  // behind (schedule.h; set once the units' tiers are known).
  double mixed_request_s = 0;
  double optimizer_in_flight() const {
    bool w_nvme = false;
    for (const SimUnit& x : u) w_nvme = w_nvme || x.w == Tier::kNvme;
    return double(1 + max_writes + (w_nvme ? detail::kWeightStagingInFlight : 0));
  }
  // EarlyStepper::step_unit on the early worker thread: a unit's job is queued when its last
  // gradient of the step has been accumulated (`avail`); the worker takes the jobs in the order
  // of EarlyStepper::next_job (pick_job below), reads the NVMe state of the job it will
  // take next when it starts the last sub-group of one, and writes the second copy behind.
  // (unit, gradient ready, its norm still wanted: false for jobs started after step() took it)
  struct Job {
    std::size_t unit;
    double avail;
    bool norm;
  };
  std::deque<Job> early_q;
  std::vector<std::size_t> early_order;
  std::vector<double> early_done = std::vector<double>(N, 0),
                      early_io_done = std::vector<double>(N, 0);
  std::vector<double> norm_done =
      std::vector<double>(N, kNever);  // when the worker had the unit's norm part
  std::size_t early_next = kNone;      // the job whose state was read ahead, taken next
  double early_prev_start = -1;        // the start of the previous job's last sub-group
  bool ahead_pending = false;          // ... at which the worker chose the job to read ahead
  std::deque<double> early_writes, early_w_writes;
  // The worker's queue, replayed lazily: a job is replayed when a later event shows the
  // worker must have started it, or when something waits for it; at step() the jobs not
  // started are reordered to the next forward's order, as the engine does.
  std::vector<bool> queued = std::vector<bool>(N, false);
  bool first_micro_batch = true, last_micro_batch = false;

  std::uint64_t groups(const SimUnit& x) { return detail::num_pieces(x.shard, sub_group); }
  // A sub-group's NVMe state record of `len` elements: master, m and v, each with its gap.
  static double state_bytes(double len) {
    return double(4 * detail::state_elems(std::uint64_t(len)));
  }
  double group_size(const SimUnit& x, std::uint64_t g) {
    return double(detail::piece(x.shard, sub_group, g).size);
  }
  // Engine::Impl::issue_fetch reads an NVMe shard one request a sub-group (each split at
  // aio.block_size), all at once: the requests beyond those of one read of the whole shard (what
  // nvme_fetch_read_bps was measured with) add their time each.
  double fetch_requests_s(const SimUnit& x) {
    if (m.nvme_fetch_request_s <= 0) return 0;
    const double block = double(std::max<std::size_t>(c.aio.block_size, 1));
    double n = 0;
    for (std::uint64_t g = 0; g < groups(x); ++g) n += std::ceil(group_size(x, g) * csz / block);
    const double one_read = std::ceil(double(x.shard) * csz / block);
    return std::max(0.0, n - one_read) * m.nvme_fetch_request_s;
  }
  std::uint64_t buckets(const SimUnit& x) { return detail::num_pieces(x.shard, bucket_share); }
  bool bucketed(const SimUnit& x) {
    return detail::bucketed_reduce(x.shard, bucket_share, m.world_size);
  }
  bool eligible(const SimUnit& x) { return early && detail::early_step_takes(x.o, x.g); }
  void bound(std::deque<double>& q, std::size_t most) {
    while (q.size() >= std::max<std::size_t>(most, 1)) {
      h = std::max(h, q.front());
      q.pop_front();
    }
  }
  std::size_t next_use(std::size_t unit, std::size_t from) {
    for (std::size_t p = from; p < trace.size(); ++p)
      if (trace[p] == unit) return p;
    return kNone;
  }
  const std::string& name(std::size_t i) { return mp.units[i].name; }
  // Engine::Impl::drop: the fetch stream waits for the unit's release before its memory goes.
  double free_s(double bytes) { return m.free_bps > 0 ? bytes / m.free_bps : 0.0; }
  void drop(std::size_t i) {
    if (!u[i].gathered || u[i].resident) return;
    sim.wait(kFetchS, u[i].released);
    sim.op(kFetchS, Resource::kCount, 0, free_s(double(u[i].padded) * csz), "");
    u[i].gathered = false;
    live -= u[i].padded;
  }
  void make_room(std::uint64_t need) {
    while (detail::over_live_budget(c, live, need)) {
      const std::size_t victim = detail::release_victim(
          N, [&](std::size_t i) { return u[i].gathered && !u[i].resident && u[i].in_use == 0; },
          [&](std::size_t i) { return next_use(i, pos); });
      if (victim == N) return;
      drop(victim);
    }
  }
  // Engine::Impl::issue_fetch at host time `h`.
  // A unit's all-gather of its compute weights across the ranks.
  double all_gather_s(const SimUnit& x) {
    return secs(double(x.padded) * csz * double(W - 1) / double(W), m.all_gather_bps);
  }
  void issue_fetch(std::size_t i) {
    SimUnit& x = u[i];
    if (x.gathered) return;
    const double bytes = double(x.shard) * csz;
    // The gathered buffer's allocation: on a device that poisons fresh memory (the emulated
    // one, free_bps > 0) the host thread writes it before it goes on.
    h = sim.host(h, free_s(double(x.padded) * csz));
    double ready = h;
    switch (detail::fetch_path(x.w)) {
      case detail::FetchPath::kDeviceCopy:
        ready = sim.op(kFetchS, Resource::kCount, h, secs(2 * bytes, m.device_mem_bps), "");
        break;
      case detail::FetchPath::kUpload:
        sim.wait(kFetchS, x.w_written);
        ready = copy(kFetchS, Resource::kH2D, h, bytes, m.h2d_bps, "h2d " + name(i));
        break;
      case detail::FetchPath::kNvmeUpload: {
        bound(param_staging, detail::weight_reads_in_flight(c));
        const double rd =
            nvme_request(h, bytes, fetch_read_bps, "read w " + name(i), fetch_requests_s(x));
        sim.wait(kFetchS, rd);
        ready = copy(kFetchS, Resource::kH2D, h, bytes, m.h2d_bps, "h2d " + name(i));
        param_staging.push_back(ready);
        break;
      }
    }
    if (W > 1)
      ready = sim.op(kFetchS, Resource::kComm, ready, all_gather_s(x), "all-gather " + name(i));
    x.ready = ready;
    x.gathered = true;
    live += x.padded;
  }
  void finish_early(std::size_t i) {
    if (!pending[i]) return;
    SimUnit& x = u[i];
    h = std::max(h, worker_done(i));
    pending[i] = false;
    if (!x.resident && x.w != Tier::kDevice) return;
    double t =
        copy(kFetchS, Resource::kH2D, h, double(x.shard) * csz, m.h2d_bps, "h2d w " + name(i));
    if (x.resident && W > 1)
      t = sim.op(kFetchS, Resource::kComm, t, all_gather_s(x), "all-gather " + name(i));
    if (x.resident) x.ready = t;
  }
  void prefetch_ahead() {
    std::uint64_t ahead = 0;
    for (std::size_t p = pos; p < trace.size(); ++p) {
      SimUnit& x = u[trace[p]];
      if (x.resident || x.gathered) continue;
      if (!detail::prefetch_fits(c, ahead, live, x.padded)) break;
      if (W > 1 ? kept_behind[trace[p]] : pending[trace[p]] && worker_done(trace[p]) > h) break;
      finish_early(trace[p]);
      issue_fetch(trace[p]);
      ahead += x.padded;
    }
  }
  // EarlyStepper::finish_done_ahead: the kept units the worker has finished by now, in the
  // forward's order (the units' own), up to the first it has not.
  void finish_done_ahead() {
    for (std::size_t j = 0; j < N; ++j) {
      if (!pending[j]) continue;
      if (worker_done(j) > h) return;
      finish_early(j);
    }
  }
  // Engine::fetch: returns the time the compute stream may use the unit.
  double fetch(std::size_t i) {
    SimUnit& x = u[i];
    finish_early(i);
    finish_done_ahead();
    kept_behind[i] = false;
    if (!x.resident) {
      ++pos;
      if (!x.gathered) {
        make_room(x.padded);
        issue_fetch(i);
      }
      prefetch_ahead();
    }
    ++x.in_use;
    return x.ready;  // (a resident unit: its last update's, see finish_early)
  }
  void release(std::size_t i, double event) {
    SimUnit& x = u[i];
    --x.in_use;
    if (x.resident) return;
    x.released = event;
    if (x.in_use > 0) return;
    const std::size_t nu = next_use(i, pos);
    if (nu != kNone) {
      std::uint64_t dist = 0;
      for (std::size_t p = pos; p < nu; ++p) dist += u[trace[p]].padded;
      if (dist <= c.max_reuse_distance) return;
    }
    drop(i);
  }
  // A transfer of `bytes` at `rate` on stream `s`, holding lane `r` (a copy: H2D or D2H).
  double copy(StreamId s, Resource r, double ready, double bytes, double rate,
              const std::string& what) {
    return sim.op(s, r, ready, secs(bytes, rate), what, -1, bytes);
  }
  // A CPU AdamW call of `len` parameters (one sub-group): its fixed time and its parameters.
  double cpu_adamw_secs(double len) const {
    return m.cpu_adamw_call_s + secs(len, m.cpu_adamw_params_per_s);
  }
  // An NVMe request of `bytes` at `rate` (plus `fixed_s`, a read waited for alone), on no stream.
  double nvme_request(double ready, double bytes, double rate, const std::string& what,
                      double fixed_s = 0) {
    return sim.lane(Resource::kNvme, ready, fixed_s + secs(bytes, rate), what, -1, bytes);
  }
  // A sub-group's read of optimizer state (or NVMe gradients) as the optimizer waits for it: its
  // fixed time (waited for one ahead; at least the mixed traffic's per-request part) and its
  // bytes, at the drive's mixed rate.
  double opt_read(double ready, double bytes, const std::string& what) {
    return nvme_request(ready, bytes, opt_read_bps, what,
                        std::max(m.nvme_request_s, mixed_request_s));
  }
  // A write of optimizer state, new weights or gradients beside that traffic: the mixed traffic's
  // per-request part and its bytes.
  double opt_write(double ready, double bytes, const std::string& what) {
    return nvme_request(ready, bytes, opt_write_bps, what, mixed_request_s);
  }
  // The optimizer's loop over a unit's NVMe state (MachineProfile::nvme_subgroup_s, where
  // measured): a sub-group's read of state pays the loop's time a sub-group beyond its bytes, and
  // the writes behind it (state, new weights) their bytes alone.
  double state_read(double ready, double bytes, const std::string& what) {
    if (m.nvme_subgroup_s < 0) return opt_read(ready, bytes, what);
    return nvme_request(ready, bytes, opt_read_bps, what, m.nvme_subgroup_s);
  }
  double state_write(const SimUnit& x, double ready, double bytes, const std::string& what) {
    if (m.nvme_subgroup_s < 0 || x.o != Tier::kNvme) return opt_write(ready, bytes, what);
    return nvme_request(ready, bytes, opt_write_bps, what);
  }
  // Whether the device sums the unit's part of the norm as its step's only gradient (one
  // micro-batch a step) is reduced (strata.device_grad_norm): no host pass over it.
  bool device_norm(const SimUnit& x) {
    return detail::device_norm_takes(c, x.g, true, c.gradient_accumulation_steps == 1, bucketed(x));
  }
  // The job the worker takes at time `t` (the forward takes the units in their own order).
  std::deque<Job>::iterator pick_job(double t) {
    return early_q.begin() +
           std::ptrdiff_t(detail::next_early_job(
               early_q.size(), [&](std::size_t k) { return early_q[k].unit == early_next; },
               [&](std::size_t k) { return early_q[k].avail <= t; },
               [&](std::size_t k) { return early_q[k].unit; }));
  }
  void early_job(std::size_t i, double avail, bool norm) {
    SimUnit& x = u[i];
    const double n = double(x.shard);
    double t = std::max(sim.stream_free[kEarlyS], avail);
    const bool read_ahead = i == early_next;
    early_next = kNone;
    double io = 0;
    const bool w_nvme = !x.resident && x.w == Tier::kNvme;
    if (norm)
      t = norm_done[i] =
          sim.op(kEarlyS, Resource::kCpu, t, secs(4 * n, norm_bps), "norm " + name(i), all_cores);
    // A sub-group at a time: NVMe state read one sub-group ahead (the first when the previous
    // job started its last, if this one was queued by then), written behind.
    double read = 0;
    if (x.o == Tier::kNvme) {
      const double issue = read_ahead ? early_prev_start : t;
      read = state_read(issue, state_bytes(group_size(x, 0)), "read state " + name(i));
    }
    const std::uint64_t G = groups(x);
    for (std::uint64_t g = 0; g < G; ++g) {
      const double len = group_size(x, g), w_bytes = len * csz;
      t = std::max(t, read);
      if (x.o == Tier::kNvme && g + 1 < G)
        read = state_read(t, state_bytes(group_size(x, g + 1)), "read state " + name(i));
      if (g + 1 ==
          G) {  // EarlyStepper::read_ahead_next, chosen in run_next (the queue is complete then)
        early_prev_start = t;
        ahead_pending = true;
      }
      if (w_nvme && early_w_writes.size() >= detail::kWeightStagingInFlight) {
        t = std::max(t, early_w_writes.front());
        early_w_writes.pop_front();
      }
      t = sim.op(kEarlyS, Resource::kCpu, t, cpu_adamw_secs(len), "adamw " + name(i), adamw_cores);
      if (!copy_out)
        t = sim.op(kEarlyS, Resource::kCpu, t, secs(8 * len, m.host_mem_bps), "copy w " + name(i));
      if (x.o == Tier::kNvme) {
        if (early_writes.size() >= max_writes) {
          t = std::max(t, early_writes.front());
          early_writes.pop_front();
        }
        early_writes.push_back(state_write(x, t, state_bytes(len), "write state " + name(i)));
        io = std::max(io, early_writes.back());
      }
      if (w_nvme) {
        early_w_writes.push_back(state_write(x, t, w_bytes, "write w " + name(i)));
        io = std::max(io, early_w_writes.back());
      }
    }
    sim.wait(kEarlyS, t);
    early_done[i] = t;
    early_io_done[i] = io;
  }
  void run_next() {
    // EarlyStepper::norms: first the norm's part of every queued job whose gradient
    // is there when the worker is free, then the next AdamW.
    for (bool again = true; again;) {
      again = false;
      for (Job& j : early_q) {
        const double free = sim.stream_free[kEarlyS];
        if (!j.norm || j.avail > free) continue;
        const double n = double(u[j.unit].shard);
        norm_done[j.unit] = sim.op(kEarlyS, Resource::kCpu, free, secs(4 * n, norm_bps),
                                   "norm " + name(j.unit), all_cores);
        sim.wait(kEarlyS, norm_done[j.unit]);
        j.norm = false;
        again = true;
      }
    }
    // The job the last one read ahead for, chosen at the start of its last sub-group: by now every
    // job queued by then is in early_q (it was replayed before the next job's arrival).
    if (std::exchange(ahead_pending, false) && !early_q.empty()) {
      const std::size_t next = pick_job(early_prev_start)->unit;
      if (u[next].o == Tier::kNvme) early_next = next;
    }
    const auto k = pick_job(sim.stream_free[kEarlyS]);
    const Job j = *k;
    const std::size_t i = j.unit;
    early_q.erase(k);
    queued[i] = false;
    early_job(i, j.avail, j.norm);
  }
  void run_started_before(double t) {
    while (!early_q.empty() && std::max(sim.stream_free[kEarlyS], early_q.front().avail) < t)
      run_next();
  }
  double worker_done(std::size_t i) {
    while (queued[i]) run_next();
    return std::max(early_done[i], early_io_done[i]);
  }
  void enqueue(std::size_t i, double avail) {
    run_started_before(avail);
    norm_done[i] = device_norm(u[i]) ? avail : kNever;
    early_q.push_back({i, avail, !device_norm(u[i])});
    queued[i] = true;
    early_order.push_back(i);
  }
  // Engine::grad_buffer + the model's backward + Engine::reduce_grad for unit i.
  void reduce(std::size_t i, double after_compute) {
    SimUnit& x = u[i];
    sim.wait(kCommS, after_compute);
    double t = after_compute, ready = after_compute;  // `ready`: the accumulation's end
    const std::uint64_t B = buckets(x);
    const bool by_bucket = bucketed(x);
    if (W > 1 && !by_bucket)  // one reduce-scatter into a shard-sized output
      t = sim.op(kCommS, Resource::kComm, t,
                 secs(double(x.shard) * 4 * double(W - 1), m.reduce_scatter_bps),
                 "reduce-scatter " + name(i));
    for (std::uint64_t b = 0; b < B; ++b) {  // Engine::reduce_grad's buckets, on the comm stream
      const double len = double(detail::piece(x.shard, bucket_share, b).size);
      if (by_bucket) {  // every rank's share gathered side by side, reduce-scattered
        t = sim.op(kCommS, Resource::kCount, t, secs(8.0 * len * double(W), m.device_mem_bps), "");
        t = sim.op(kCommS, Resource::kComm, t, secs(len * 4 * double(W - 1), m.reduce_scatter_bps),
                   "reduce-scatter " + name(i));
        sim.op(kCommS, Resource::kCount, t, free_s(4.0 * len),
               "");  // its output, freed on the comm stream
      }              // one rank: the gradient scratch is the shard, no copy
      switch (detail::grad_path(x.g, first_micro_batch)) {
        case detail::GradPath::kDeviceAdd:
          sim.op(kCommS, Resource::kCount, t, secs(12.0 * len, m.device_mem_bps), "");
          break;
        case detail::GradPath::kNvme: {  // Engine::Impl::reduce_to_nvme
          bound(grad_nvme, detail::kGradBucketsInFlight);
          // What the keys hold, read back by the host (not for the step's first gradient) while
          // the bucket comes over; added, its squares summed, written behind.
          const double rd = first_micro_batch ? h : opt_read(h, 4.0 * len, "read grad " + name(i));
          t = copy(kCommS, Resource::kD2H, std::max(t, h), 4.0 * len, m.d2h_bps,
                   "d2h grad " + name(i));
          t = std::max(t, rd);
          if (!first_micro_batch)
            t = sim.op(kCommS, Resource::kCpu, t, secs(12.0 * len, m.host_mem_bps),
                       "grad add " + name(i), all_cores);
          // cpu::SumSquares is serial: one core's share of the (all-core) rate.
          t = ready = sim.op(kCommS, Resource::kCpu, t, secs(4.0 * len, norm_bps / all_cores),
                             "norm " + name(i), 1);
          grad_nvme.push_back(opt_write(t, 4.0 * len, "write grad " + name(i)));
          grad_writes = std::max(grad_writes, grad_nvme.back());
          break;
        }
        case detail::GradPath::kStraightCopy:
          t = ready = copy(kCommS, Resource::kD2H, t, 4.0 * len, m.d2h_bps, "d2h grad " + name(i));
          break;
        case detail::GradPath::kStagedAdd:
          bound(grad_staging, detail::kGradBucketsInFlight);
          t = copy(kCommS, Resource::kD2H, t, 4.0 * len, m.d2h_bps, "d2h grad " + name(i));
          grad_staging.push_back(sim.op(kCommS, Resource::kCpu, t, secs(12.0 * len, m.host_mem_bps),
                                        "grad add " + name(i), all_cores));
          ready = grad_staging.back();
          break;
      }
    }
    if (W > 1)
      sim.op(kCommS, Resource::kCount, t, free_s(4.0 * double(x.padded)),
             "");  // the scratch, after its last use
    if (W > 1 && !by_bucket)
      sim.op(kCommS, Resource::kCount, t, free_s(4.0 * double(x.shard)), "");  // the output
    if (first_micro_batch && device_norm(x)) {  // its sum of squares, read back
      t = sim.op(kCommS, Resource::kCount, t, secs(4.0 * double(x.shard), m.device_mem_bps), "");
      copy(kCommS, Resource::kD2H, t, 4, m.d2h_bps, "d2h norm " + name(i));
    }
    if (x.g == Tier::kHost && last_micro_batch && eligible(x)) enqueue(i, ready);
    // One rank: the scratch is the shard, freed on the comm stream after its last use there.
    if (W == 1) sim.op(kCommS, Resource::kCount, 0, free_s(4.0 * double(x.padded)), "");
    reduces.push_back(sim.stream_free[kCommS]);  // the comm stream's event, after the free
  }
  // Engine::grad_buffer's allocation: the host first waits for the reduces beyond the unit
  // gradients the plan counts.
  void grad_buffer(std::size_t i) {
    bound(reduces, detail::unit_grads_alive(c));
    h = sim.host(h, free_s(4.0 * double(u[i].padded)));
  }
  // The unit's fp32 gradient scratch: zero-filled on the compute stream (and freed on the
  // comm stream, in `reduce`).
  double grad_fill(std::size_t i) { return secs(4.0 * double(u[i].padded), m.device_mem_bps); }

  // A unit's forward or backward on the compute stream, `dur` long with the time of its
  // `tp_bytes` of tensor-parallel collectives in it: the rest computes, then the collectives
  // hold the stream on the "tp" lane (their time at the measured all-reduce rate, at most 90% of
  // `dur`: the measurement that gave `dur` ran them). Returns its end.
  double compute(double ready, double dur, std::uint64_t tp_bytes, const std::string& what) {
    const double tp = tp_bytes && m.tp_all_reduce_bps > 0
                          ? std::min(0.9 * dur, double(tp_bytes) / m.tp_all_reduce_bps)
                          : 0.0;
    const double end = sim.op(kComputeS, Resource::kCompute, ready, dur - tp, what);
    if (tp <= 0) return end;
    return sim.op(kComputeS, Resource::kTp, end, tp, "tp " + what, -1, double(tp_bytes));
  }

  // One micro-batch's forward: the host time it took.
  double forward() {
    const double f0 = h;
    for (std::size_t i = 0; i < N; ++i) {
      const double ready = fetch(i);
      double dur = mp.units[i].forward_s;
      if (i == head) {
        dur += grad_fill(i);
        grad_buffer(i);
      }
      const double end =
          compute(std::max(ready, h), dur, mp.units[i].tp_forward_bytes, "fwd " + name(i));
      if (i == head) reduce(i, end);
      release(i, end);
    }
    h = std::max(h, sim.stream_free[kComputeS]);  // the loss
    return h - f0;
  }

  // ... and its backward.
  double backward() {
    const double b0 = h;
    for (std::size_t i = head; i-- > 1;) {
      const double ready = fetch(i);
      grad_buffer(i);
      const double end = compute(std::max(ready, h), mp.units[i].backward_s + grad_fill(i),
                                 mp.units[i].tp_backward_bytes, "bwd " + name(i));
      reduce(i, end);
      release(i, end);
    }
    {
      grad_buffer(0);
      const double end = compute(h, mp.units[0].backward_s + grad_fill(0),
                                 mp.units[0].tp_backward_bytes, "bwd " + name(0));
      reduce(0, end);
    }
    h = std::max(h, sim.stream_free[kComputeS]);  // compute->synchronize()
    return h - b0;
  }

  // ---- step ----
  // Engine::step: the host time it took.
  double optimizer_step() {
    for (std::size_t i = 0; i < N; ++i) {  // the last step's, if not fetched since
      finish_early(i);
      kept_behind[i] = false;
    }
    const double s0 = h;
    h = std::max({h, sim.stream_free[kCommS], sim.stream_free[kFetchS],
                  grad_writes});  // (NVMe gradients written)
    const std::vector<bool> kept = grad_norm();
    update(kept);
    if (W > 1)
      for (std::size_t i = 0; i < N; ++i)
        if (u[i].resident && !pending[i])
          sim.op(kOptS, Resource::kComm, h, all_gather_s(u[i]), "all-gather " + name(i));
    // Device gradients zeroed (host accumulators are overwritten by the next step's first
    // gradient).
    for (std::size_t i = 0; i < N; ++i)
      if (u[i].g == Tier::kDevice)
        sim.op(kOptS, Resource::kCount, h, secs(4.0 * double(u[i].shard), m.device_mem_bps), "");
    h = std::max(h, sim.stream_free[kOptS]);
    // The gathered units hold the old weights: dropped (freed on the fetch stream) before the
    // next step's first fetch.
    for (std::size_t i = 0; i < N; ++i) drop(i);
    h = std::max(h, sim.stream_free[kFetchS]);
    // Kept units the worker has finished by now switch at once (new weights over the link).
    finish_done_ahead();
    return h - s0;
  }

  // The gradient norm: device shards on the optimizer stream, host shards on the host thread;
  // returns the units the early worker stepped (kept).
  std::vector<bool> grad_norm() {
    grad_nvme.clear();
    bool any_device_grad = false;
    for (std::size_t i = 0; i < N; ++i)
      if (u[i].g == Tier::kDevice) {
        sim.op(kOptS, Resource::kCount, h, secs(4.0 * double(u[i].shard), m.device_mem_bps), "");
        any_device_grad = true;
      }
    if (any_device_grad)  // each unit's sum of squares read back (Engine::Impl::grad_sumsq)
      copy(kOptS, Resource::kD2H, h, 4.0 * double(N), m.d2h_bps, "d2h norm");
    if (W > 1) {  // the rank's sum all-reduced through the device, in fp64
      copy(kOptS, Resource::kH2D, h, 8, m.h2d_bps, "h2d norm");
      sim.op(kOptS, Resource::kComm, h, secs(8, m.all_gather_bps), "all-reduce norm");
      copy(kOptS, Resource::kD2H, h, 8, m.d2h_bps, "d2h norm");
    }
    std::vector<bool> kept(N, false);
    for (std::size_t i : early_order) kept[i] = true;
    // The early worker computed the norm's part of the units it got to by now (it does those
    // before its next AdamW); the host thread takes the rest, beside the worker (not queued
    // behind its jobs on the CPU lane).
    const double norm_at = h;
    run_started_before(norm_at);
    const Resource norm_lane = early_order.empty() ? Resource::kCpu : Resource::kCount;
    for (std::size_t i = 0; i < N; ++i)
      if (u[i].g == Tier::kHost && !device_norm(u[i]) && !(kept[i] && norm_done[i] <= norm_at))
        h = sim.op(kHostS, norm_lane, h, secs(4.0 * double(u[i].shard), norm_bps),
                   "norm " + name(i), all_cores);
    h = std::max(h, sim.stream_free[kOptS]);
    // The early results: kept without waiting; each unit is finished before its next use
    // (finish_early), the jobs not started yet in the next forward's order (the units').
    for (std::size_t i : early_order) pending[i] = kept_behind[i] = true;
    std::stable_sort(early_q.begin(), early_q.end(),
                     [](const Job& x, const Job& y) { return x.unit < y.unit; });
    for (Job& j : early_q) j.norm = false;  // step() has the norm
    return kept;
  }

  // The units the early worker did not step, unit by unit on the host thread.
  void update(const std::vector<bool>& kept) {
    // (unit, sub-group) of the host optimizer with state or gradient on NVMe, read one ahead
    std::vector<std::pair<std::size_t, std::uint64_t>> nvme_groups;
    for (std::size_t i = 0; i < N; ++i)
      if (!kept[i] && detail::reads_ahead_from_nvme(u[i].o, u[i].g))
        for (std::uint64_t g = 0; g < groups(u[i]); ++g) nvme_groups.push_back({i, g});
    std::vector<double> read_done(nvme_groups.size(), 0);
    std::size_t nvme_next = 0;
    auto issue_read = [&](std::size_t k) {
      if (k >= nvme_groups.size()) return;
      const auto [i, g] = nvme_groups[k];
      read_done[k] = h;
      if (u[i].o == Tier::kNvme)
        read_done[k] = state_read(h, state_bytes(group_size(u[i], g)), "read state " + name(i));
      if (u[i].g == Tier::kNvme)
        read_done[k] =
            std::max(read_done[k], opt_read(h, 4.0 * group_size(u[i], g), "read grad " + name(i)));
    };
    std::deque<double> writes, w_staging;
    double all_writes = h;
    auto write_behind = [&](const SimUnit& x, double bytes, double ready, const std::string& what) {
      const double end = state_write(x, ready, bytes, what);
      all_writes = std::max(all_writes, end);
      return end;
    };
    auto write_state = [&](const SimUnit& x, double bytes, double ready, const std::string& what) {
      writes.push_back(write_behind(x, bytes, ready, what));
      while (writes.size() > max_writes) {
        h = std::max(h, writes.front());
        writes.pop_front();
      }
    };
    // New compute weights staged in pinned memory: two at a time.
    auto stage_w = [&] {
      while (w_staging.size() >= detail::kWeightStagingInFlight) {
        h = std::max(h, w_staging.front());
        w_staging.pop_front();
      }
    };
    issue_read(nvme_next++);
    for (std::size_t i = 0; i < N; ++i) {
      SimUnit& x = u[i];
      if (kept[i]) continue;
      const double n = double(x.shard);
      const double w_bytes = n * csz;
      const detail::WeightsOut out = detail::weights_out(x.resident, x.w);
      const bool target_dev = out == detail::WeightsOut::kDevice;
      if (x.o == Tier::kDevice) {
        double t = h;
        if (x.g == Tier::kHost)
          t = copy(kOptS, Resource::kH2D, t, 4 * n, m.h2d_bps, "h2d grad " + name(i));
        if (x.g == Tier::kNvme) {  // a sub-group at a time, the host waiting for each
          for (std::uint64_t g = 0; g < groups(x); ++g) {
            const double len = group_size(x, g);
            t = opt_read(t, 4 * len, "read grad " + name(i));
            t = h = copy(kOptS, Resource::kH2D, t, 4 * len, m.h2d_bps, "h2d grad " + name(i));
          }
        }
        t = sim.op(kOptS, Resource::kCompute, t, secs(n, m.device_adamw_params_per_s),
                   "adamw " + name(i));
        if (!target_dev) {
          // On the write-back stream: the step does not wait for host-tier ones (the next
          // fetch of the unit does); NVMe-tier ones a sub-group at a time through staging,
          // written by the host from there.
          sim.wait(kWbS, t);
          if (out == detail::WeightsOut::kHost) {
            x.w_written = copy(kWbS, Resource::kD2H, t, w_bytes, m.d2h_bps, "d2h w " + name(i));
          } else {
            for (std::uint64_t g = 0; g < groups(x); ++g) {
              const double len_w = group_size(x, g) * csz;
              stage_w();
              h = std::max(h, copy(kWbS, Resource::kD2H, h, len_w, m.d2h_bps, "d2h w " + name(i)));
              w_staging.push_back(write_behind(x, len_w, h, "write w " + name(i)));
            }
          }
        } else if (!copy_out) {
          sim.op(kOptS, Resource::kCount, t, secs(2 * w_bytes, m.device_mem_bps), "");
        }
        continue;
      }
      // The host optimizer, a sub-group at a time.
      for (std::uint64_t g = 0; g < groups(x); ++g) {
        const double len = group_size(x, g), len_w = len * csz;
        if (detail::reads_ahead_from_nvme(x.o, x.g)) {
          const std::size_t k = nvme_next - 1;  // this sub-group's read, issued one ahead
          issue_read(nvme_next++);
          h = std::max(h, read_done[k]);
        }
        if (x.g == Tier::kDevice)
          h = copy(kOptS, Resource::kD2H, h, 4 * len, m.d2h_bps, "d2h grad " + name(i));
        if (out != detail::WeightsOut::kHost) stage_w();
        h = sim.op(kHostS, Resource::kCpu, h, cpu_adamw_secs(len), "adamw " + name(i), adamw_cores);
        if (!copy_out)
          h = sim.op(kHostS, Resource::kCpu, h, secs(8 * len, m.host_mem_bps), "copy w " + name(i));
        if (target_dev)
          w_staging.push_back(copy(kOptS, Resource::kH2D, h, len_w, m.h2d_bps, "h2d w " + name(i)));
        if (x.o == Tier::kNvme) write_state(x, state_bytes(len), h, "write state " + name(i));
        if (out == detail::WeightsOut::kNvme)
          w_staging.push_back(write_behind(x, len_w, h, "write w " + name(i)));
      }
    }
    h = std::max({h, all_writes, sim.stream_free[kOptS], sim.stream_free[kFetchS]});
  }
};

}  // namespace

double mixed_request_at(const MachineProfile& m, double in_flight) {
  if (m.nvme_mixed_deep_request_s < 0) return m.nvme_mixed_request_s;
  constexpr double lo = MachineProfile::kMixedInFlight, hi = MachineProfile::kMixedDeepInFlight;
  const double f = std::clamp((in_flight - lo) / (hi - lo), 0.0, 1.0);
  return m.nvme_mixed_request_s + f * (m.nvme_mixed_deep_request_s - m.nvme_mixed_request_s);
}

Prediction predict_step(const MachineProfile& m, const ModelProfile& mp, const EngineConfig& c) {
  CoreShare share;
  if (m.device_shares_host_cores > 0) {
    // The CPU-emulated device: its kernels, copies and memory passes are threads on the same
    // cores as the host thread and the CPU optimizer; NVMe requests and comm take none.
    share.cores = m.device_shares_host_cores;
    double kernel = m.device_kernel_threads > 0
                        ? std::min<double>(m.device_kernel_threads, share.cores)
                        : share.cores;
    // Small kernels keep fewer cores busy than they have threads (serial parts, a team
    // waiting for its slowest): what the profile measured them to use.
    if (mp.device_cores > 0) kernel = std::min(kernel, mp.device_cores);
    share.lane_weight[int(Resource::kCompute)] = kernel;
    // A throttled link sleeps most of each copy: the memcpy's share of its time.
    const double copy_bps = m.host_mem_bps / 2;
    share.lane_weight[int(Resource::kH2D)] =
        m.h2d_bps > 0 ? std::min(1.0, m.h2d_bps / copy_bps) : 1.0;
    share.lane_weight[int(Resource::kD2H)] =
        m.d2h_bps > 0 ? std::min(1.0, m.d2h_bps / copy_bps) : 1.0;
    share.lane_weight[int(Resource::kCpu)] = 1;
    share.lane_weight[int(Resource::kTp)] = 1;     // the collective thread's copies and sums
    share.lane_weight[int(Resource::kCount)] = 1;  // fills, adds, frees on the device's streams
    share.drive_slowdown = std::max(0.0, m.nvme_compute_slowdown);
  }
  std::vector<double> stretch;
  CoreLoad load;
  Prediction pr = Replay(m, mp, c, share, stretch).run(load);
  if (share.cores <= 0) return pr;
  // Fixed point: each replay stretches the operations by how crowded the cores were around
  // them in the last one (halfway, so that it settles rather than oscillates).
  for (int it = 0; it < 12; ++it) {
    const std::vector<double> want = core_stretch(load, share.cores, share.drive_slowdown);
    if (stretch.size() != want.size()) stretch.assign(want.size(), 1.0);
    for (std::size_t i = 0; i < want.size(); ++i) stretch[i] = 0.5 * (stretch[i] + want[i]);
    const double before = pr.step_s;
    pr = Replay(m, mp, c, share, stretch).run(load);
    if (std::abs(pr.step_s - before) <= 1e-3 * before) break;
  }
  return pr;
}

// ---- the search ----
namespace {

struct TierChoice {
  const char* label;
  Placement p;
};

}  // namespace

double measured_tokens_per_s(const Candidate& c, double measured_step_s) {
  return measured_step_s > 0 ? c.prediction.tokens_per_s * c.prediction.step_s / measured_step_s
                             : 0;
}

std::size_t fastest_validated(const std::vector<Candidate>& ranked,
                              const std::vector<double>& measured_step_s) {
  STRATA_REQUIRE(measured_step_s.size() <= ranked.size(),
                 "fastest_validated: {} measurements of {} candidates", measured_step_s.size(),
                 ranked.size());
  std::size_t best = measured_step_s.size();
  double best_tps = 0;
  for (std::size_t i = 0; i < measured_step_s.size(); ++i) {
    const double tps = measured_tokens_per_s(ranked[i], measured_step_s[i]);
    if (tps > best_tps) best_tps = tps, best = i;
  }
  return best;
}

namespace {
// Each value's rank (0-based): the values clearly below it, plus half of those it cannot be told
// apart from (within `tie_within` of it, relative to the smaller of the two), which is its mean
// rank over the orders those could come in. With 0, equal values: the textbook's mean rank of a
// tie. Pair by pair, not in groups: groups anchored at their smallest value put values 0.2% apart
// in different groups wherever an anchor fell between them, and ranked the same runs differently
// as tokens/s (ascending) and as step times (strata-prof's link regime on the AMD EPYC Zen 5 VM,
// 2026-12-05, at 0.6%: 0.66 against 1.00; 0.98 both ways pair by pair).
std::vector<double> ranks_of(const std::vector<double>& v, double tie_within) {
  std::vector<double> r(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    double below = 0, near = 0;
    for (std::size_t j = 0; j < v.size(); ++j) {
      if (j == i) continue;
      if (std::abs(v[j] - v[i]) <= tie_within * std::min(std::abs(v[i]), std::abs(v[j])))
        near += 1;
      else if (v[j] < v[i])
        below += 1;
    }
    r[i] = below + 0.5 * near;
  }
  return r;
}
}  // namespace

std::optional<double> spearman(const std::vector<double>& x, const std::vector<double>& y,
                               double tie_within) {
  STRATA_REQUIRE(x.size() == y.size(), "spearman: {} values against {}", x.size(), y.size());
  STRATA_REQUIRE(tie_within >= 0, "spearman: tie_within {} is negative", tie_within);
  if (x.size() < 3) return std::nullopt;
  const std::vector<double> rx = ranks_of(x, tie_within), ry = ranks_of(y, tie_within);
  const double n = double(x.size()), mean = (n - 1) / 2;
  double sxy = 0, sxx = 0, syy = 0;
  for (std::size_t i = 0; i < rx.size(); ++i) {
    sxy += (rx[i] - mean) * (ry[i] - mean);
    sxx += (rx[i] - mean) * (rx[i] - mean);
    syy += (ry[i] - mean) * (ry[i] - mean);
  }
  if (sxx == 0 || syy == 0) return std::nullopt;  // every value tied: no order to compare
  return sxy / std::sqrt(sxx * syy);
}

double step_spread(std::vector<double> steps_s) {
  if (steps_s.size() < 2) return 0;
  std::sort(steps_s.begin(), steps_s.end());
  const std::size_t n = steps_s.size();
  const double median = steps_s[n / 2];
  return median > 0 ? (steps_s[3 * n / 4] - steps_s[n / 4]) / median : 0;
}

double round_drift(const std::vector<double>& round_step_s) {
  if (round_step_s.size() < 2) return 0;
  const auto [lo, hi] = std::minmax_element(round_step_s.begin(), round_step_s.end());
  return *lo > 0 ? (*hi - *lo) / *lo : 0;
}

double trimmed_mean(std::vector<double> v) {
  if (v.empty()) return 0;
  std::size_t lo = 0, hi = v.size();
  if (v.size() >= 3) {
    std::sort(v.begin(), v.end());
    ++lo;
    --hi;
  }
  double sum = 0;
  for (std::size_t i = lo; i < hi; ++i) sum += v[i];
  return sum / double(hi - lo);
}

std::string placement_class(const Candidate& c) {
  const auto tiers = [](const Placement& p) {
    std::string s;
    const std::pair<double, Tier> parts[] = {{p.device_fraction, Tier::kDevice},
                                             {p.host_fraction, Tier::kHost},
                                             {p.nvme_fraction(), Tier::kNvme}};
    for (const auto& [fraction, tier] : parts) {
      if (fraction <= 1e-9) continue;
      if (!s.empty()) s += '+';
      s += tier_name(tier);
    }
    return s;
  };
  const EngineConfig& k = c.config;
  return fmt::format("params {}, optimizer {}, grads {}{}", tiers(k.params), tiers(k.optimizer),
                     tiers(k.grads), c.plan.early_optimizer_step ? ", early step" : "");
}

std::vector<ValidationPick> validation_picks(const std::vector<Candidate>& ranked, std::size_t top,
                                             std::size_t spread) {
  const std::size_t n = ranked.size();
  std::vector<ValidationPick> picks;
  std::vector<bool> chosen(n, false);
  std::set<std::string> classes;
  const auto pick = [&](std::size_t i, const char* reason) {
    chosen[i] = true;
    classes.insert(placement_class(ranked[i]));
    picks.push_back({i, reason});
  };
  for (std::size_t i = 0; i < std::min(top, n); ++i) pick(i, "top");
  // The low-ranked ones keep up to half of the spread; the classes may take the rest.
  const std::size_t low = std::min<std::size_t>(2, spread / 2);
  std::size_t extra = 0;
  for (std::size_t i = 0; i < n && extra < spread - low; ++i)
    if (!chosen[i] && !classes.contains(placement_class(ranked[i]))) {
      pick(i, "best of class");
      ++extra;
    }
  // The median first (the last-ranked may take many times the best's step): the middle rank, or
  // the next below it not yet chosen.
  std::size_t mid = n / 2;
  while (mid + 1 < n && chosen[mid]) ++mid;
  if (mid + 1 < n && extra < spread) {
    pick(mid, "low-ranked (median)");
    ++extra;
  }
  if (n > 0 && extra < spread && !chosen[n - 1]) pick(n - 1, "low-ranked (last)");
  std::sort(picks.begin(), picks.end(),
            [](const ValidationPick& a, const ValidationPick& b) { return a.index < b.index; });
  return picks;
}

std::vector<std::size_t> validation_order(std::size_t picks, int rounds) {
  std::vector<std::size_t> order;
  const std::size_t R = std::size_t(std::max(rounds, 0));
  for (std::size_t r = 0; r < R; ++r) {
    const std::size_t shift = picks > R ? r * picks / R : 0;
    for (std::size_t n = 0; n < picks; ++n) order.push_back((shift + n) % picks);
  }
  return order;
}

Resource busiest(const double (&busy_s)[int(Resource::kCount)]) {
  int best = 0;
  for (int r = 1; r < int(Resource::kCount); ++r)
    if (busy_s[r] > busy_s[best]) best = r;
  return Resource(best);
}

LaneBusy lane_busy(const std::vector<Interval>& schedule) {
  LaneBusy out;
  std::vector<std::pair<double, double>> spans[int(Resource::kCount)];
  for (const Interval& iv : schedule)
    if (iv.lane != Resource::kCount && iv.end_s > iv.start_s)
      spans[int(iv.lane)].emplace_back(iv.start_s, iv.end_s);
  bool any = false;
  for (int r = 0; r < int(Resource::kCount); ++r) {
    std::sort(spans[r].begin(), spans[r].end());
    double covered_to = -kNever;
    for (const auto& [start, end] : spans[r]) {  // the union: each instant counted once
      const double from = std::max(start, covered_to);
      if (end > from) out.busy_s[r] += end - from;
      covered_to = std::max(covered_to, end);
    }
    any = any || out.busy_s[r] > 0;
  }
  if (any) out.busiest = busiest(out.busy_s);
  return out;
}

namespace {

// What the planner is given for `mp` on `m`, the device's capacity cut to `headroom`.
PlanInputs plan_inputs(const MachineProfile& m, const ModelProfile& mp, double headroom) {
  PlanInputs in;
  for (const auto& x : mp.units) in.units.push_back({x.name, x.numel});
  in.world_size = m.world_size;
  in.device_capacity = std::uint64_t(double(m.device_capacity) * std::clamp(headroom, 0.0, 1.0));
  in.host_capacity = m.host_capacity;
  in.nvme_capacity = m.nvme_free;
  in.ranks_on_node = m.ranks_on_node;
  in.activation_bytes = mp.activation_bytes;
  in.ram_capacity = m.ram_capacity;
  in.ram_base_bytes = m.ram_base_bytes;
  in.device_in_ram = m.device_in_ram;
  return in;
}

// A candidate short of host memory with optimizer state on NVMe: its swap buffers and the new
// weights' staging hold one sub-group each, so smaller sub-groups may make it fit. Takes the
// largest that does (halving from the largest unit's shard, whole pages), if any: true then.
bool fit_smaller_sub_groups(Candidate& cand, const std::vector<std::uint64_t>& numel, int world,
                            const PlanInputs& in) {
  EngineConfig& c = cand.config;
  std::uint64_t largest_shard = 0;
  for (const detail::UnitLayout& u : detail::layout_units(c, numel, world))
    largest_shard = std::max(largest_shard, u.shard);
  EngineConfig smaller = c;
  smaller.sub_group_size_given = true;
  for (std::uint64_t sg = std::min(detail::sub_group_elems(c), largest_shard) / 2;
       sg >= detail::kShardAlign; sg /= 2) {
    smaller.sub_group_size = sg / detail::kShardAlign * detail::kShardAlign;
    MemoryPlan p = plan_memory(smaller, in);
    if (!p.fits) continue;
    c = smaller;
    cand.plan = std::move(p);
    cand.label += fmt::format(", sub-groups of {} elements", c.sub_group_size);
    return true;
  }
  return false;
}

// The bytes a plan lacks, summed over the tiers.
std::uint64_t bytes_missing(const MemoryPlan& p) {
  auto miss = [](std::uint64_t need, std::uint64_t cap) { return need > cap ? need - cap : 0; };
  return miss(p.device_bytes, p.device_capacity) + miss(p.host_bytes, p.host_capacity) +
         miss(p.nvme_bytes, p.nvme_capacity);
}

}  // namespace

SearchResult search_placements(const MachineProfile& m, const SearchSpace& space) {
  STRATA_REQUIRE(!space.models.empty(), "search_placements: no model profiles");
  const bool nvme = !space.nvme_paths.empty();
  std::vector<TierChoice> params = {{"device", {1, 0}}, {"host", {0, 1}}};
  std::vector<TierChoice> opt;
  if (space.allow_device_optimizer) opt.push_back({"device", {1, 0}});
  opt.push_back({"host", {0, 1}});
  if (space.allow_device_optimizer) opt.push_back({"device 50% + host 50%", {0.5, 0.5}});
  if (nvme) {
    params.push_back({"nvme", {0, 0}});
    params.push_back({"host 50% + nvme 50%", {0, 0.5}});
    opt.push_back({"nvme", {0, 0}});
    opt.push_back({"host 50% + nvme 50%", {0, 0.5}});
  }
  std::vector<TierChoice> grads = {{"device", {1, 0}}, {"host", {0, 1}}};
  if (nvme) grads.push_back({"nvme", {0, 0}});  // (beside NVMe optimizer state or weights)
  const std::vector<int> windows = {0, 2, 4};   // units live at once (0: the default, all)

  SearchResult out;
  bool have_smallest = false;
  std::uint64_t smallest_short = 0;
  for (const ModelProfile& mp : space.models) {
    // Windows in the engine's measure: padded units (a window of "2 units" of unpadded size held
    // one padded unit, and never prefetched).
    std::uint64_t max_unit = 0;
    std::vector<std::uint64_t> numel;
    for (const auto& x : mp.units) {
      max_unit = std::max<std::uint64_t>(max_unit, detail::padded_numel(x.numel, m.world_size));
      numel.push_back(x.numel);
    }
    // Candidates that lay the state out alike (every unit resident: no window and no weight
    // tier to choose) are one candidate.
    std::set<std::string> seen;
    const PlanInputs in = plan_inputs(m, mp, space.device_headroom);
    for (const auto& pc : params)
      for (const auto& oc : opt)
        for (const auto& gc : grads)
          for (int win : windows)
            for (int more_buffers = 0; more_buffers < 2; ++more_buffers) {
              if (win > 0 && int(mp.units.size()) <= win) continue;  // the same as "all"
              // One rank with every compute weight on the device: nothing is gathered
              // (Engine::finalize keeps such units resident), so no window either.
              if (win > 0 && m.world_size == 1 && pc.p.device_fraction >= 1) continue;
              const bool p_nvme = pc.p.nvme_fraction() > 1e-9, o_nvme = oc.p.nvme_fraction() > 1e-9;
              const bool g_nvme = gc.p.nvme_fraction() > 1e-9;
              if (g_nvme && !o_nvme && !p_nvme)
                continue;  // (no directory for them: the config's rule)
              // NVMe swap buffers (offload_param / offload_optimizer buffer_count): the config's,
              // or twice as many (more reads ahead and writes behind, more pinned memory).
              if (more_buffers && !p_nvme && !o_nvme) continue;
              Candidate cand;
              EngineConfig& c = cand.config;
              c = space.base;
              c.stage = 3;
              c.micro_batch_per_gpu = mp.micro_batch;
              c.train_batch_size = mp.micro_batch * c.gradient_accumulation_steps * m.world_size;
              c.params = pc.p;
              c.optimizer = oc.p;
              c.grads = gc.p;
              if (more_buffers) {  // (of what is on NVMe)
                if (p_nvme) c.param_buffer_count = 2 * space.base.param_buffer_count;
                if (o_nvme) c.optimizer_buffer_count = 2 * space.base.optimizer_buffer_count;
              }
              c.param_nvme_paths = !p_nvme                          ? std::vector<std::string>{}
                                   : space.param_nvme_paths.empty() ? space.nvme_paths
                                                                    : space.param_nvme_paths;
              c.optimizer_nvme_paths = o_nvme ? space.nvme_paths : std::vector<std::string>{};
              c.grad_nvme_paths = !g_nvme  ? std::vector<std::string>{}
                                  : o_nvme ? c.optimizer_nvme_paths
                                           : c.param_nvme_paths;
              const EngineConfig d = default_engine_config();
              if (win > 0) {
                c.max_live_parameters = max_unit * std::uint64_t(win);
                c.prefetch_bucket_size = max_unit * std::uint64_t(win - 1);
              } else {
                c.max_live_parameters = d.max_live_parameters;
                c.prefetch_bucket_size = d.prefetch_bucket_size;
              }
              c.max_reuse_distance = d.max_reuse_distance;
              {
                std::string sig;
                bool gathered = false, swapped = false;
                for (const detail::UnitLayout& u : detail::layout_units(c, numel, m.world_size)) {
                  gathered = gathered || !u.resident;
                  swapped = swapped || (!u.resident && u.w == Tier::kNvme) || u.o == Tier::kNvme ||
                            u.g == Tier::kNvme;
                  sig += fmt::format("{}{}{}{},", u.resident ? 'r' : 'g', u.resident ? 0 : int(u.w),
                                     int(u.g), int(u.o));
                }
                if (win > 0 && !gathered) continue;
                // Nothing of this layout on NVMe (every unit below the persistence threshold, say):
                // no swap buffers to double, and "params nvme" is "params device" by another name.
                if (more_buffers && !swapped) continue;
                if (!seen.insert(fmt::format("{}|{}|{}", sig, win, more_buffers)).second) continue;
              }
              cand.checkpoint = mp.checkpoint;
              cand.checkpoint_on_host = mp.checkpoint && mp.checkpoint_on_host;
              cand.micro_batch = mp.micro_batch;
              cand.label = fmt::format(
                  "params {}, optimizer {}, grads {}, {}, B={}{}{}", pc.label, oc.label, gc.label,
                  win > 0 ? fmt::format("{} units live", win) : std::string("all units live"),
                  mp.micro_batch,
                  !mp.checkpoint          ? ""
                  : mp.checkpoint_on_host ? ", checkpoints on host"
                                          : ", checkpointing",
                  more_buffers ? ", twice the swap buffers" : "");
              ++out.considered;
              c.model_host_ram_bytes = cand.checkpoint_on_host ? mp.host_checkpoint_bytes : 0;
              c.model_host_ram_what = "layer checkpoints (--checkpoint-on-host)";
              cand.plan = plan_memory(c, in);
              // Short of host memory with optimizer state on NVMe: smaller sub-groups may fit.
              if (!cand.plan.fits && o_nvme && cand.plan.host_bytes > cand.plan.host_capacity) {
                const bool shrunk = fit_smaller_sub_groups(cand, numel, m.world_size, in);
                // Twice the optimizer's swap buffers of half the sub-group are the same bytes as
                // the config's count of the whole one: not another candidate.
                if (more_buffers && shrunk && !p_nvme)
                  continue;  // (params on NVMe: their read-ahead doubles)
              }
              if (!cand.plan.fits) {
                // The least demanding candidate: the smallest sum of bytes missing.
                const std::uint64_t shortfall = bytes_missing(cand.plan);
                if (!have_smallest || shortfall < smallest_short) {
                  have_smallest = true;
                  smallest_short = shortfall;
                  out.smallest = cand.plan;
                  out.smallest_label = cand.label;
                  out.problems = cand.plan.problems;
                }
                continue;
              }
              // The engine decides the early optimizer step by the plan: say it in the config.
              cand.config.overlap_optimizer = cand.plan.early_optimizer_step;
              cand.prediction = predict_step(m, mp, cand.config);
              out.ranked.push_back(std::move(cand));
            }
  }
  std::stable_sort(out.ranked.begin(), out.ranked.end(),
                   [](const Candidate& a, const Candidate& b) {
                     if (a.prediction.tokens_per_s != b.prediction.tokens_per_s)
                       return a.prediction.tokens_per_s > b.prediction.tokens_per_s;
                     return a.plan.device_bytes < b.plan.device_bytes;
                   });
  recommend_less_drive_bound(out.ranked);
  if (!out.ranked.empty()) out.problems.clear();
  return out;
}

void recommend_less_drive_bound(std::vector<Candidate>& ranked) {
  const auto drive = [](const Candidate& c) { return c.prediction.busy_s[int(Resource::kNvme)]; };
  if (ranked.empty() || drive(ranked[0]) <= 0) return;  // the fastest leaves the drive alone
  const double fastest = ranked[0].prediction.tokens_per_s;
  // Markedly less: not a flip on a rounding.
  const double at_most = kRecommendDriveAtMost * drive(ranked[0]);
  for (std::size_t i = 1; i < ranked.size(); ++i) {
    if (ranked[i].prediction.tokens_per_s < (1 - kRecommendTieWithin) * fastest) return;
    if (drive(ranked[i]) <= at_most) {
      std::rotate(ranked.begin(), ranked.begin() + std::ptrdiff_t(i),
                  ranked.begin() + std::ptrdiff_t(i) + 1);
      return;
    }
  }
}

StepData step_data(double grad_accum, double micro_batch, double seq_len) {
  StepData d;
  d.held_bytes = grad_accum * (micro_batch * seq_len * 12 + double(sizeof(Batch)));
  d.available_bytes = double(cpu::ram_available_bytes());
  return d;
}

// ---- ds_config.json out ----
std::string engine_config_json(const EngineConfig& c) {
  using nlohmann::json;
  auto paths = [](const std::vector<std::string>& p) -> json {
    if (p.size() == 1) return p[0];
    return p;
  };
  auto is = [](const Placement& p, double dev, double host) {
    return std::abs(p.device_fraction - dev) < 1e-9 && std::abs(p.host_fraction - host) < 1e-9;
  };
  json j;
  j["train_micro_batch_size_per_gpu"] = c.micro_batch_per_gpu;
  j["gradient_accumulation_steps"] = c.gradient_accumulation_steps;
  if (c.gradient_clipping > 0) j["gradient_clipping"] = c.gradient_clipping;
  if (c.compute_dtype == DType::kBF16) j["bf16"] = {{"enabled", true}};
  if (c.fp16.enabled)
    j["fp16"] = {{"enabled", true},
                 {"loss_scale", c.fp16.loss_scale},
                 {"initial_scale_power", c.fp16.initial_scale_power},
                 {"loss_scale_window", c.fp16.loss_scale_window},
                 {"hysteresis", c.fp16.hysteresis},
                 {"min_loss_scale", c.fp16.min_loss_scale}};
  // A float as the decimal that reads back as it (0.9, not 0.8999999761581421).
  const auto dec = [](float f) {
    const std::string text = fmt::format("{}", f);  // shortest round trip, in the C locale
    double d = 0;
    std::from_chars(text.data(), text.data() + text.size(), d);
    return d;
  };
  j["optimizer"] = {{"type", c.optimizer_type},
                    {"params",
                     {{"lr", dec(c.adamw.lr)},
                      {"betas", {dec(c.adamw.beta1), dec(c.adamw.beta2)}},
                      {"eps", dec(c.adamw.eps)},
                      {"weight_decay", dec(c.adamw.weight_decay)},
                      {"bias_correction", c.adamw.bias_correction}}}};
  if (!c.scheduler.type.empty()) {
    const LrScheduleConfig& l = c.scheduler;
    json sp = {{"warmup_num_steps", l.warmup_num_steps}, {"warmup_type", l.warmup_type}};
    if (l.type == "WarmupCosineLR") {
      sp["warmup_min_ratio"] = l.warmup_min_ratio;
      sp["cos_min_ratio"] = l.cos_min_ratio;
    } else {
      sp["warmup_min_lr"] = l.warmup_min_lr;
      // < 0: the optimizer's lr, written as the "auto" it was read from (without the key the
      // schedule peaks at DeepSpeed's 0.001)
      if (l.warmup_max_lr >= 0)
        sp["warmup_max_lr"] = l.warmup_max_lr;
      else
        sp["warmup_max_lr"] = "auto";
    }
    if (l.type != "WarmupLR")
      sp["total_num_steps"] = l.total_num_steps > 0 ? json(l.total_num_steps) : json("auto");
    j["scheduler"] = {{"type", l.type}, {"params", sp}};
  }
  json z = {{"stage", c.stage},
            {"overlap_comm", c.overlap_comm},
            {"contiguous_gradients", c.contiguous_gradients},
            {"allgather_bucket_size", c.allgather_bucket_size},
            {"stage3_prefetch_bucket_size", c.prefetch_bucket_size},
            {"stage3_max_live_parameters", c.max_live_parameters},
            {"stage3_max_reuse_distance", c.max_reuse_distance},
            {"stage3_param_persistence_threshold", c.param_persistence_threshold}};
  // Only when true: false is the default, and a false one written out draws strata-train's
  // warning (strata gathers the model at --out either way) on every run of a file whose user
  // never wrote it. (strata-prof puts a false of the user's own --config back as written.)
  if (c.gather_16bit_weights_on_model_save) z["stage3_gather_16bit_weights_on_model_save"] = true;
  // Written when the --config gave them: DeepSpeed's defaults are below a large model's embedding
  // unit, and the plan notes a value below the largest unit as the user's.
  if (c.reduce_bucket_size_given) z["reduce_bucket_size"] = c.reduce_bucket_size;
  if (c.sub_group_size_given) z["sub_group_size"] = c.sub_group_size;
  json op = {{"buffer_count", c.param_buffer_count},
             {"buffer_size", c.param_buffer_size},
             {"pin_memory", c.pin_memory}};
  if (is(c.params, 1, 0)) {
    op["device"] = "none";
  } else if (std::abs(c.params.nvme_fraction()) < 1e-9) {
    op["device"] = "cpu";
    if (c.params.host_fraction < 1) op["ratio"] = c.params.host_fraction;
  } else {
    STRATA_REQUIRE(
        c.params.device_fraction < 1e-9,
        "engine_config_json: parameters split over device, host and NVMe cannot be written as a "
        "ds_config");
    op["device"] = "nvme";
    op["nvme_path"] = paths(c.param_nvme_paths);
    if (c.params.host_fraction > 0) op["host_fraction"] = c.params.host_fraction;
  }
  z["offload_param"] = op;
  json oo = {{"buffer_count", c.optimizer_buffer_count},
             {"pin_memory", c.pin_memory},
             {"pipeline_read", c.pipeline_read},
             {"pipeline_write", c.pipeline_write}};
  if (is(c.optimizer, 1, 0)) {
    oo["device"] = "none";
  } else if (std::abs(c.optimizer.nvme_fraction()) < 1e-9) {
    oo["device"] = "cpu";
    if (c.optimizer.host_fraction < 1) oo["ratio"] = c.optimizer.host_fraction;
  } else {
    STRATA_REQUIRE(c.optimizer.device_fraction < 1e-9,
                   "engine_config_json: optimizer state split over device, host and NVMe cannot be "
                   "written as a "
                   "ds_config");
    oo["device"] = "nvme";
    oo["nvme_path"] = paths(c.optimizer_nvme_paths);
    if (c.optimizer.host_fraction > 0) oo["host_fraction"] = c.optimizer.host_fraction;
  }
  z["offload_optimizer"] = oo;
  if (is(c.grads, 1, 0)) {
    z["offload_grads"] = "none";
  } else if (std::abs(c.grads.nvme_fraction()) < 1e-9) {
    z["offload_grads"] = "cpu";
    if (c.grads.host_fraction < 1) z["offload_grads_ratio"] = c.grads.host_fraction;
  } else {
    STRATA_REQUIRE(c.grads.device_fraction < 1e-9,
                   "engine_config_json: gradients split over device, host and NVMe cannot be "
                   "written as a ds_config");
    // parse_engine_config puts them under the optimizer's nvme_path, else the parameters'.
    const bool o_nvme = oo["device"] == "nvme", p_nvme = op["device"] == "nvme";
    STRATA_REQUIRE((o_nvme && c.grad_nvme_paths == c.optimizer_nvme_paths) ||
                       (!o_nvme && p_nvme && c.grad_nvme_paths == c.param_nvme_paths),
                   "engine_config_json: gradients on NVMe are written as a ds_config only under "
                   "the optimizer's "
                   "nvme_path (or, with the optimizer off NVMe, the parameters')");
    z["offload_grads"] = "nvme";
    if (c.grads.host_fraction > 0) z["offload_grads_host_fraction"] = c.grads.host_fraction;
  }
  j["zero_optimization"] = z;
  j["aio"] = {{"block_size", c.aio.block_size},
              {"queue_depth", c.aio.queue_depth},
              {"thread_count", c.aio.thread_count},
              {"single_submit", c.aio.single_submit},
              {"overlap_events", c.aio.overlap_events},
              {"use_hugepages", c.aio.use_hugepages},
              {"verify", c.aio.verify},
              {"engine", io_backend_name(c.aio.engine)},
              {"register_buffers", c.aio.register_buffers}};
  if (c.aio.direct != DirectIo::kAuto) j["aio"]["direct"] = c.aio.direct == DirectIo::kOn;
  if (c.host_budget_bytes > 0) j["strata"]["host_budget_bytes"] = c.host_budget_bytes;
  if (c.overlap_optimizer) j["strata"]["overlap_optimizer"] = *c.overlap_optimizer;
  if (c.optimizer_threads > 0) j["strata"]["optimizer_threads"] = c.optimizer_threads;
  if (c.optimizer_isa != Isa::kAuto) j["strata"]["optimizer_isa"] = isa_name(c.optimizer_isa);
  if (c.device_grad_norm) j["strata"]["device_grad_norm"] = *c.device_grad_norm;
  if (!c.decay_exempt_norms_and_biases)
    j["strata"]["weight_decay_exempt"] = weight_decay_exempt_name(false);
  return j.dump(2) + "\n";
}

}  // namespace strata
