// Engine::Impl: the engine's state and its internal operations, shared by the files of
// src/scheduler that implement include/strata/engine.h (internal; nothing outside
// src/scheduler includes it). Which file holds what: docs/engine.md, "Source files".
#pragma once

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "cpu/cpu_kernels.h"
#include "scheduler/schedule.h"
#include "strata/adamw.h"
#include "strata/engine.h"
#include "strata/error.h"
#include "strata/log.h"
#include "strata/nvme.h"
#include "strata/pinned_pool.h"
#include "strata/trace.h"

namespace strata {
namespace detail {

// Every handle settled, then the first error thrown.
inline void wait_all(const std::vector<IoHandle>& hs) {
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

// One unit's training state, one sub-struct per piece: what the unit is and where its pieces
// live (set by add_unit and finalize), then its weights, fetch bookkeeping, gradient,
// optimizer state and early optimizer step.
struct Unit {
  std::string name;
  std::vector<std::size_t> offsets;
  std::size_t numel = 0, padded = 0, shard = 0;
  UnitSource source;  // the initial values, until finalize() has placed this rank's shard
  // Full weights live on the device for good: stage < 3, a unit under the persistence
  // threshold, or (one rank) a unit whose compute weights are on the device tier.
  bool resident = false;
  Tier w_tier = Tier::kDevice, g_tier = Tier::kDevice, o_tier = Tier::kDevice;

  // The compute weights (compute dtype).
  struct Weights {
    Buffer dev;                         // this rank's shard (non-resident, device tier)
    std::shared_ptr<PinnedBlock> host;  // ... host tier
    Buffer full;                        // gathered weights (padded), while gathered
    Event written;                      // the device optimizer's last write of `host` (wb stream)
  } w;

  // Gathering (param_coordinator.cpp): the full weights' events, users, and place in the order.
  struct Fetch {
    Event ready, released;
    bool gathered = false;
    int in_use = 0;
    std::size_t first = 0;         // position of the unit's first fetch in the last step
    std::int64_t first_step = -1;  // the step that position belongs to
  } fetch;

  // The gradient (fp32).
  struct Grads {
    Buffer dev;                         // accumulator (shard), device tier
    std::shared_ptr<PinnedBlock> host;  // ... host tier
    Buffer full;  // scratch between grad_buffer() and reduce_grad() (padded, every rank's)
    // An NVMe-tier gradient (g_tier kNvme), kept as keys cut by detail::grad_pieces. `fresh`:
    // they hold nothing of this step yet — the next reduce_grad writes instead of adding, and
    // step() takes zeros (set when made, by every step() and by load_state). `sumsq`: the sum
    // of squares of what the last reduce_grad wrote (the norm's part), taken as it went out.
    // `io`: that reduce_grad's writes, done before anything reads the keys again.
    bool fresh = true;
    float sumsq = 0;
    cpu::SumSquares sumsq_run;  // (the comm stream's host functions only)
    // The same over the tensor-parallel counted ranges only (Impl::tp_ranges), when partial.
    float tp_sumsq = 0;
    cpu::SumSquares tp_sumsq_run;
    std::vector<std::shared_ptr<GradIo>> io;
    // A host-tier gradient that arrives whole in one reduce_grad: its sum of squares taken on
    // the device from the shard it was copied from (Impl::norm_host[unit], valid once the copy's
    // early.grads_done / the comm stream is reached) for this step() call, so no CPU pass over it.
    std::int64_t dev_sumsq_call = -1;
  } g;

  // The optimizer state: master | m | v, fp32, 3 * shard on the device; off it, each array
  // detail::state_stride(shard) elements on the host, state_stride(sub-group) in each NVMe
  // record (layout.h).
  struct OptimizerState {
    Buffer dev;                         // device tier
    std::shared_ptr<PinnedBlock> host;  // host tier (NVMe: keys in the optimizer's store)
  } o;

  // The early optimizer step (early_step.cpp).
  enum class Early { kNone, kQueued, kDone, kVoid };
  struct EarlyStep {
    // Second copies of host-tier state and weights, and which of the two NVMe keys holds the
    // current optimizer state / compute weights.
    std::shared_ptr<PinnedBlock> o_alt, w_alt;
    int o_gen = 0, w_gen = 0;
    // This step's early work on the unit: queued when its last gradient of the step is
    // reduced, done on the early worker, then kept or dropped by step().
    Early state = Early::kNone;
    Event grads_done;                    // the accumulation of that last gradient
    AdamWOptions opt;                    // the options it ran with (lr, step, grad_scale)
    std::int64_t call = 0;               // the step() call it was queued for (Impl::step_calls)
    float sumsq = 0;                     // its gradient's sum of squares (the norm's part) ...
    std::int64_t norm_call = -1;         // ... for the job of this step() call (early_mu; -1: none)
    std::shared_ptr<PinnedBlock> new_w;  // new weights for a device target, until finished
    std::vector<IoHandle> io;  // its writes to the other NVMe keys (one a sub-group and kind)
    // step() kept the early work but did not wait for it: it is finished (state and weights
    // switched to the new copy) before anything uses the unit again (EarlyStepper::finish).
    bool finish_pending = false;
    bool gather_pending = false;  // resident, more than one rank: finished, not yet all-gathered
    bool kept_behind = false;  // kept by the last step() and not fetched since (see prefetch_ahead)
  } early;
};

// The early optimizer step (strata.overlap_optimizer; early_step.cpp). When a unit's last
// gradient of the step has been accumulated on the host (the count of reduce_grad calls per unit
// is recorded in the first step), a worker thread runs its AdamW at once — while backward goes on
// for the units before it — with clip coefficient 1 and the expected lr, reading the current
// state and writing a second copy (host tier: o_alt / w_alt; NVMe tier: the other key). step()
// keeps that result only when the step it would have run is the same: no clipping, finite
// gradients, the same lr; otherwise it drops it and steps the unit from the untouched state.
// Either way the bits are those of the serial step. (The clip coefficient needs the global norm,
// which exists only after the last gradient: that is why this is a speculation and not a
// reordering.) step() decides what to keep without waiting for the worker: kept work still
// queued is reordered to the next forward's order and finished behind — each unit before its
// next fetch (or anything else that reads it) — so the AdamW of the last units to get their
// gradients overlaps the next step's forward instead of stalling the device.
//
// The engine calls it at four points: note_grad (each reduce_grad), settle (step() decides what
// to keep), for_fetch (the one entry point of Engine::fetch) and finish / finish_all (anything
// else that reads a unit's state: save, load, gather).
class EarlyStepper {
 public:
  explicit EarlyStepper(Engine::Impl& engine) : s(engine) {}
  ~EarlyStepper() { stop(); }
  EarlyStepper(const EarlyStepper&) = delete;
  EarlyStepper& operator=(const EarlyStepper&) = delete;

  bool on = false;      // plan.early_optimizer_step
  float next_lr = NAN;  // set_next_lr(), else the last step's lr
  // Guards every Unit::early.state / norm_call, the worker's queue, and the two counts below
  // (the reducer and step()'s norm read them too).
  std::mutex mu;
  // step() calls so far, counting skipped steps (main thread), and the last call that has taken
  // its gradient norm (mu): jobs queued before it that the worker starts later skip their sum of
  // squares, which nothing will read.
  std::int64_t step_calls = 0, norm_taken_call = -1;

  bool eligible(const Unit& u) const { return on && early_step_takes(u.o_tier, u.g_tier); }
  void start();  // the worker thread, when on
  void stop();

  // Called for every reduce_grad, after its accumulation was queued on the comm stream.
  void note_grad(std::size_t ui, Stream& cs);
  // Which units keep their early result; the others are stepped by step().
  std::vector<bool> settle(float lr, bool overflow, bool clipped);
  // Everything a fetch of unit `ui` needs of the early step (Engine::fetch; collective).
  void for_fetch(std::size_t ui);
  // Switches unit `ui` to the result of its kept early work (step() decided to keep it):
  // the second copies become the current ones, and new weights for a device target go there
  // on the fetch stream. `block`: wait for the worker; otherwise return false if it has not
  // finished the unit yet. Local to this rank: a resident unit's all-gather, when there is
  // more than one rank, is left to gather_finished() (collective calls only).
  bool finish(std::size_t ui, bool block);
  void finish_all();  // collective
  // Switches the kept units the worker has finished, in the next forward's order: their new
  // weights go to the device on the fetch stream ahead of their fetch (a resident unit has no
  // prefetch to do it). It stops at the first unit still being stepped: one queued behind
  // units the forward needs later would wait for all their copies on the fetch stream (the
  // forward's first unit is the last to get its gradient, so it is often the one not done).
  // Local, never waits.
  void finish_done_ahead();
  // Marks every early result of the current step unusable (the state it read was replaced).
  void void_results();

 private:
  Engine::Impl& s;
  // After a step whose early work was all redone (it clipped, overflowed, or the lr was not
  // announced), the next `skip` steps do not speculate — 1, 2, 4, then 8 steps, back to 0 once
  // a result is kept — so a run that clips every step does not do its AdamW twice.
  int skip = 0, backoff = 0;
  std::thread worker;
  std::condition_variable cv;
  std::deque<std::size_t> queue;
  std::vector<std::size_t> order;         // units queued this step, in order (main thread)
  std::size_t busy = 0;                   // queued or running jobs
  std::size_t read_ahead_job = SIZE_MAX;  // the queued job whose state the worker read ahead
  bool stopping = false;
  std::exception_ptr worker_error;
  // NVMe state reads issued ahead by the worker, and its writes in flight (worker only).
  // (Keyed by unit and sub-group.)
  std::map<std::pair<std::size_t, std::size_t>, std::pair<std::shared_ptr<PinnedBlock>, IoHandle>>
      reads;
  std::deque<IoHandle> writes, w_writes;
  // Kept early work that step() left running (Unit::early.finish_pending), in the order they
  // are finished.
  std::vector<std::size_t> pending_finish;

  void wait_idle();
  Unit::Early state_of(std::size_t ui);
  // Waits until the worker is done with unit `ui`; its final state.
  Unit::Early wait(std::size_t ui);
  bool failed();
  // Drops the jobs the worker has not started (their results could not be kept).
  void cancel_queued();
  // The NVMe traffic of a unit's finished early job (kept or not).
  void count_io(const Unit& u);
  // The worker's error (an I/O fault, say), once every write it issued has settled. Kept: the
  // state it left is not usable, so every later call that needs it throws the same error.
  [[noreturn]] void rethrow_error();
  // A resident unit's new shard (finish) to every rank. Collective: every rank calls it for the
  // same units in the same order (Engine::fetch, step, save_state, load_state).
  void gather_finished(std::size_t ui);
  // The position in `queue` of the job the worker takes next (mu held, queue not empty):
  // detail::next_early_job, by each unit's first fetch in the step that queued it.
  std::size_t next_job() const;
  // From the last sub-group of the running job (worker thread): the state of the job the worker
  // would take now is read ahead when it is on NVMe, and that job is then taken next.
  void read_ahead_next();
  // Whether the job of unit `ui` still owes step() its part of the gradient norm (mu held).
  bool norm_owed(const Unit& u) const {
    return u.early.norm_call != u.early.call && u.early.call > norm_taken_call;
  }
  void loop();
  // The norm's part of every queued job whose gradient is complete, before the next AdamW:
  // a few tenths of a millisecond each against the AdamW's few milliseconds, and step() needs
  // all of them before it can decide anything, while the AdamW can finish behind it. So step()
  // finds them done instead of computing them on its own thread (worker thread, `lk` held).
  void norms(std::unique_lock<std::mutex>& lk);
  // Waits for the oldest of `q` until fewer than `most` are in flight (worker thread).
  static void bound_io(std::deque<IoHandle>& q, std::size_t most);
  void read_ahead(std::size_t ui, std::size_t g);
  // One unit's AdamW from its current state into the second copy, a sub-group at a time (worker
  // thread), and its part of the norm when owed (the device's when it took it). NVMe state is
  // read one sub-group ahead (the next job's first once this unit's last is stepping).
  void step_unit(std::size_t ui, bool need_norm, bool device_norm);
};

}  // namespace detail

struct Engine::Impl {
  using Unit = detail::Unit;
  using GradIo = detail::GradIo;
  Device& dev;
  Communicator& comm;
  EngineConfig cfg;
  int rank, world;
  // Engine::set_tensor_parallel: the TP group and, per unit, the counted ranges within this
  // rank's shard (shard-relative), or tp_all[unit]: the whole shard counts (TP rank 0).
  Communicator* tp = nullptr;
  std::vector<Engine::Ranges> tp_counted;  // as given, unit-relative (until finalize)
  std::vector<std::vector<detail::Range>> tp_ranges;
  std::vector<char> tp_all;
  bool tp_partial(std::size_t ui) const { return tp && !tp_all[ui]; }
  int tp_size() const { return tp ? tp->world_size() : 1; }
  // This rank in the whole job (TP innermost): names its swap folders and checkpoint files.
  int job_rank() const { return tp ? rank * tp->world_size() + tp->rank() : rank; }
  int job_world() const { return world * tp_size(); }
  // Engine::set_weight_decay_exempt: per unit, the ranges of this rank's shard (shard-relative,
  // sorted) that weight decay skips; as given (unit-relative) until finalize.
  std::vector<Engine::Ranges> wd_exempt_given;
  std::vector<std::vector<detail::Range>> wd_exempt;
  // `whole`, elements [first, first + numel) of unit ui's shard, cut where a range weight decay
  // skips begins or ends, each piece's AdamWShard::decay set: what one AdamW step takes for it
  // (`whole` alone when nothing of it is exempt or there is no weight decay).
  std::vector<AdamWShard> decay_pieces(std::size_t ui, std::size_t first,
                                       const AdamWShard& whole) const;
  // The sum of squares of `g` (this rank's shard of unit ui, host memory) over its counted ranges.
  float tp_host_sumsq(std::size_t ui, const float* g) const;
  std::size_t c_size;
  std::uint64_t device_alloc_waits_at_start = 0;  // DeviceStats::num_alloc_waits when made
  bool finalized = false;
  MemoryPlan plan;
  // Declared before the units: destroyed after them (units hold their blocks and buffers).
  std::unique_ptr<PinnedPool> pool;
  std::unique_ptr<SwapStore> w_store, o_store_own, g_store_own;
  SwapStore* o_store = nullptr;
  SwapStore* g_store =
      nullptr;  // NVMe-tier gradients: the optimizer's or the weights' store, or its own
  std::unique_ptr<CpuAdamW> cpu_adam;
  // wb: new compute weights from the device optimizer back to host or NVMe tiers; apart from
  // `fetch` so they overlap the next forward's host-to-device reads (a link carries both
  // directions at once), each unit's fetch waiting for its own (Unit::w.written).
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
  // The ends of the reduce_grad calls' work on the comm stream (each frees its unit gradient)
  // not yet waited for: grad_buffer waits for the oldest beyond detail::unit_grads_alive.
  std::deque<Event> reduces;
  // Waits (a `wait` span on the engine lane, counted in `waits` if given) for the oldest events
  // of `q` until fewer than `most` (at least 1) are left.
  static void bound(std::deque<Event>& q, std::size_t most, const char* wait = "staging_wait",
                    std::uint64_t* waits = nullptr);

  // fp16 loss scaling (DeepSpeed's DynamicLossScaler, consecutive_hysteresis off)
  double scale = 1;
  int hysteresis_left = 0;
  std::int64_t scaler_iter = 0, last_overflow_iter = -1;
  std::int64_t steps_taken = 0;
  EngineStats st;

  // Gradient counts per unit: this step's, and the recorded step's (the early optimizer step
  // queues a unit at its last one; more than recorded re-records).
  std::vector<int> grads_recorded, grads_now;
  bool grads_recording = true, grads_changed = false;
  std::shared_ptr<PinnedBlock> norm_host;  // one float a unit: Unit::g.dev_sumsq_call
  float dev_sumsq(std::size_t ui) const { return static_cast<const float*>(norm_host->data())[ui]; }
  std::size_t fetch_seq = 0;  // fetches in the step in progress (Unit::fetch.first)
  detail::EarlyStepper early_step{*this};

  Impl(Device& d, Communicator& c, const EngineConfig& config);

  // ---- memory ----
  Buffer alloc(std::size_t bytes, Stream* s);

  // A pinned block; while the state is placed (`placing`), after the writes in flight where the
  // budget has no room for it beside their blocks.
  std::shared_ptr<PinnedBlock> pinned(std::size_t bytes);

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
  std::size_t buckets(const Unit& u) const {
    return std::size_t(detail::num_pieces(u.shard, bucket_share));
  }
  // Whether the reduce-scatter itself goes bucket by bucket (every rank's share gathered side by
  // side first): only where that takes less device memory than one reduce-scatter of the unit
  // into a shard-sized output (scheduler/layout.h).
  bool bucketed_reduce(const Unit& u) const {
    return detail::bucketed_reduce(u.shard, bucket_share, world);
  }
  detail::Range bucket_range(const Unit& u, std::size_t b) const {
    return detail::piece(u.shard, bucket_share, b);
  }
  // An NVMe-tier gradient's keys: the pieces of a bucket or a sub-group (detail::grad_pieces),
  // each named by its first element.
  std::vector<detail::Range> grad_pieces(detail::Range r) const {
    return detail::grad_pieces(r, sg, bucket_share);
  }
  static std::string g_key(std::size_t u, std::size_t first) {
    return fmt::format("g{}@{}", u, first);
  }

  // ---- NVMe-tier gradients (grad_reduce.cpp) ----
  // Waits for unit u's gradient writes (before its keys are read, or the step reads them): all
  // of them, then the first error (once: they are not waited for again).
  void settle_grad_io(Unit& u);
  // Reads `r` of unit ui's NVMe-tier gradient (a sub-group, or a bucket to add to) into `dst`
  // (pinned, r.size floats); zeros when it has none this step. `dst` lives until they settle.
  std::vector<IoHandle> read_grad(std::size_t ui, detail::Range r,
                                  const std::shared_ptr<PinnedBlock>& dst);
  // Bucket `r` of unit ui's reduced gradient (`part`, on the device, in the comm stream's order)
  // to its NVMe keys: copied to pinned staging, added to what the keys hold (read back, unless it
  // is the step's first gradient of the unit), its squares added to the unit's sum (restarted by
  // the first bucket), written behind. The host waits for the oldest bucket's writes before it
  // takes a third (the plan's "gradient NVMe staging").
  std::deque<std::shared_ptr<GradIo>> grad_out;
  void reduce_to_nvme(std::size_t ui, detail::Range r, const TensorRef& part, bool first_bucket,
                      Stream& cs);
  std::string w_key(std::size_t u, std::size_t g) const {
    return key('w', u, units[u].early.w_gen, g);
  }
  std::string o_key(std::size_t u, std::size_t g) const {
    return key('o', u, units[u].early.o_gen, g);
  }

  // ---- placing a unit's shard (engine_state.cpp; finalize, load_state) ----
  // begin_put, then put_group for every sub-group, then end_put. `first`: allocate the unit's
  // storage (finalize); otherwise overwrite what is there (load_state).
  void begin_put(std::size_t ui, bool first);
  // Where the new compute weights of unit `u` go on the device — its gathered buffer (resident)
  // or its device-tier shard — or nullopt for a host or NVMe target, which the optimizer
  // writes in host memory. (`first`, `size`: the elements of the shard wanted; all by default)
  std::optional<TensorRef> w_target_dev(const Unit& u, std::size_t first = 0,
                                        std::size_t size = SIZE_MAX) const;
  // Sub-group g of unit ui onto the unit's tiers: `fill(k, dst)` writes the g's-size values of
  // part k (0 master, 1 m, 2 v) into `dst`, which is where the part lives on the host (host-tier
  // state in place, an NVMe record's pinned block) or, for device-tier state, one part's scratch
  // copied up before the next part is filled (the plan has no pinned staging for it); the
  // compute weights are derived from the master exactly as the optimizer's copy-out produces
  // them. No copy of the three parts together is made.
  using FillPart = std::function<void(std::size_t k, float* dst)>;
  // The NVMe writes of put_group not yet waited for, with the pinned blocks they read: the next
  // sub-groups' values are made while earlier ones are written (placing a billion parameters on
  // NVMe, one after the other, took the sum of the two). At most `depth` sub-groups' writes are
  // in flight: their blocks are the plan's swap buffers' room, idle while the state is placed.
  // drain() waits for the rest and throws a write's failure; destroyed undrained (an error on
  // the way), it waits for them without throwing.
  static constexpr std::size_t kPutsInFlight = 2;
  class PutsInFlight;
  PutsInFlight* placing = nullptr;  // the writes in flight while the state is placed
  class PutsInFlight {
   public:
    explicit PutsInFlight(std::size_t depth) : depth_(depth) {}
    PutsInFlight(const PutsInFlight&) = delete;
    PutsInFlight& operator=(const PutsInFlight&) = delete;
    ~PutsInFlight();
    void add(std::vector<IoHandle> io, std::vector<std::shared_ptr<PinnedBlock>> keep);
    void drain();
    bool empty() const { return q_.empty(); }

   private:
    struct Entry {
      std::vector<IoHandle> io;
      std::vector<std::shared_ptr<PinnedBlock>> keep;
    };
    void wait_front();
    std::size_t depth_;
    std::deque<Entry> q_;
  };
  // `placing` set for its life (pinned() drains `in_flight` where the budget is short).
  class Placing {
   public:
    Placing(Impl& s, PutsInFlight& in_flight);
    Placing(const Placing&) = delete;
    Placing& operator=(const Placing&) = delete;
    ~Placing();

   private:
    Impl& s_;
  };
  // (`pending`: its NVMe writes left in flight there, else waited for here)
  void put_group(std::size_t ui, std::size_t g, const FillPart& fill,
                 PutsInFlight* pending = nullptr);
  void end_put(std::size_t ui);

  // Unit `unit` of a public call, or a clear error naming the call (not std::out_of_range).
  Unit& unit_at(int unit, const char* call);

  // Sub-group g of unit ui's first `parts` parts (0 master, 1 m, 2 v) from its tier, each handed
  // to `use(k, values)` (g's size values, valid during the call): host-tier state where it lives,
  // an NVMe record through one pinned block, device-tier state one part at a time through
  // `scratch`. No copy of the three parts together is made.
  using UsePart = std::function<void(std::size_t k, const float* values)>;
  void read_group(std::size_t ui, std::size_t g, std::size_t parts, std::vector<float>& scratch,
                  const UsePart& use);

  // ---- gathering (param_coordinator.cpp) ----
  void issue_fetch(int ui, bool prefetch);

  void drop(Unit& u);

  // Next position after `from` where the trace uses `ui`, or SIZE_MAX.
  std::size_t next_use(int ui, std::size_t from) const;

  // Makes room for `need` more live elements by dropping released units whose next use is
  // furthest away.
  void make_room(std::uint64_t need);

  void prefetch_ahead();

  // A fetch in a forward-only pass: on the trace's forward part if it follows it (a pass begins
  // at its first unit), else no prefetching until the next pass begins.
  void note_eval_fetch(int ui);

  void note_fetch(int ui);

  // ---- finalize (engine.cpp; Engine::finalize runs them in this order) ----
  struct OnNvme {  // which pieces some unit keeps on NVMe
    bool w = false, o = false, g = false;
  };
  OnNvme assign_tiers();
  void make_plan(const OnNvme& nvme);
  // One plan for the job, from the least room any rank has, and every rank's settings the
  // same (more than one rank; collective).
  void agree_on_plan_inputs(PlanInputs& in, const std::string& host_refused);
  void agree_on_plan_outcome();
  void open_streams_and_stores(const OnNvme& nvme);
  void place_initial_state();

  // ---- the optimizer step (optimizer_step.cpp; Engine::step runs them in this order) ----
  void begin_step();
  // This rank's sum of squares of every gradient, summed over the ranks (the norm before
  // unscaling); the step's norm is then taken (norm_taken_call).
  double grad_sumsq();
  // Returns false for an overflow at the least scale that would lower it (the scale left as is):
  // the caller ends the run once the step is wound up.
  bool update_loss_scale(bool overflow);
  void record_grad_counts();
  void zero_grads();
  void rewind_trace();
  void end_step();
};

}  // namespace strata
