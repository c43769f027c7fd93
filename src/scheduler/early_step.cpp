// The early optimizer step: the worker that runs a unit's AdamW as soon as its last gradient
// of the step is accumulated, and the switch to its result (see engine_impl.h, "the early
// optimizer step"). Part of the engine.
#include "scheduler/engine_impl.h"

namespace strata {

using detail::EarlyStepper;
using detail::Unit;

void EarlyStepper::start() {
  if (on) worker = std::thread([this] { loop(); });
}

void EarlyStepper::stop() {
  if (!worker.joinable()) return;
  {
    std::lock_guard<std::mutex> lk(mu);
    stopping = true;
  }
  cv.notify_all();
  worker.join();
  // Reads issued ahead for jobs that will not run still target their blocks.
  for (auto& [ui, read] : std::exchange(reads, {})) read.second.wait_for(std::chrono::minutes(1));
}

void EarlyStepper::void_results() {
  wait_idle();
  std::lock_guard<std::mutex> lk(mu);
  for (auto& u : s.units) {
    if (u.early.state != Unit::Early::kNone) u.early.state = Unit::Early::kVoid;
    u.early.norm_call = -1;
  }
}

void EarlyStepper::wait_idle() {
  std::unique_lock<std::mutex> lk(mu);
  cv.wait(lk, [&] { return busy == 0; });
}

Unit::Early EarlyStepper::state_of(std::size_t ui) {
  std::lock_guard<std::mutex> lk(mu);
  return s.units[ui].early.state;
}

Unit::Early EarlyStepper::wait(std::size_t ui) {
  std::unique_lock<std::mutex> lk(mu);
  cv.wait(lk, [&] { return s.units[ui].early.state != Unit::Early::kQueued; });
  return s.units[ui].early.state;
}

bool EarlyStepper::failed() {
  std::lock_guard<std::mutex> lk(mu);
  return worker_error != nullptr;
}

void EarlyStepper::cancel_queued() {
  std::lock_guard<std::mutex> lk(mu);
  for (const std::size_t ui : queue) s.units[ui].early.state = Unit::Early::kVoid;
  busy -= queue.size();
  queue.clear();
  read_ahead_job = SIZE_MAX;
}

void EarlyStepper::count_io(const Unit& u) {
  if (u.o_tier == Tier::kNvme) {  // each sub-group's record, gaps included (layout.h)
    const std::uint64_t bytes =
        3 * u.shard * 4 + detail::state_gap_bytes(u.shard, s.sg, Tier::kNvme);
    s.st.nvme_read_bytes += bytes;
    s.st.nvme_written_bytes += bytes;
  }
  if (!u.resident && u.w_tier == Tier::kNvme) s.st.nvme_written_bytes += u.shard * s.c_size;
}

void EarlyStepper::rethrow_error() {
  wait_idle();
  for (auto& u : s.units)
    for (IoHandle& h : u.early.io)
      if (h.valid()) h.wait_for(std::chrono::minutes(1));
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lk(mu);
    error = worker_error;
  }
  STRATA_CHECK(error != nullptr, "rethrow_error without an error");
  std::rethrow_exception(error);
}

bool EarlyStepper::finish(std::size_t ui, bool block) {
  Unit& u = s.units[ui];
  if (!u.early.finish_pending) return true;
  Unit::Early state = state_of(ui);
  if (state == Unit::Early::kQueued) {
    if (!block) return false;
    TraceScope span("optimizer_wait", "engine");  // the host waits for the worker
    state = wait(ui);
  }
  if (state != Unit::Early::kDone || failed()) rethrow_error();
  for (IoHandle& h : u.early.io) h.wait();
  const std::size_t n = u.shard, w_bytes = n * s.c_size;
  count_io(u);
  if (u.o_tier == Tier::kHost)
    std::swap(u.o.host, u.early.o_alt);
  else
    u.early.o_gen = 1 - u.early.o_gen;
  if (!u.resident && u.w_tier == Tier::kHost) std::swap(u.w.host, u.early.w_alt);
  if (!u.resident && u.w_tier == Tier::kNvme) u.early.w_gen = 1 - u.early.w_gen;
  if (const auto target = s.w_target_dev(u)) {
    Stream& up = *s.fetch_s;
    up.copy(target->mem, host_ref(u.early.new_w->data(), w_bytes));
    up.host_fn([b = u.early.new_w] {}, "staging_free");
    s.st.h2d_bytes += w_bytes;
    if (u.resident && s.world > 1)
      u.early.gather_pending = true;
    else if (u.resident)
      u.fetch.ready = up.record();
  }
  {
    std::lock_guard<std::mutex> lk(mu);
    u.early.state = Unit::Early::kNone;
  }
  u.early.new_w.reset();
  u.early.io.clear();
  u.early.finish_pending = false;
  std::erase(pending_finish, ui);
  return true;
}

void EarlyStepper::gather_finished(std::size_t ui) {
  Unit& u = s.units[ui];
  if (!u.early.gather_pending) return;
  const DType ct = s.cfg.compute_dtype;
  s.comm.all_gather(s.view(u.w.full, ct, u.shard, std::size_t(s.rank) * u.shard),
                    s.view(u.w.full, ct, u.padded), *s.fetch_s);
  u.fetch.ready = s.fetch_s->record();
  u.early.gather_pending = false;
}

// The early step's one entry point for a fetch of unit `ui` (Engine::fetch): its kept early
// work finished (waiting for the worker if it is not done), the others the worker has done
// switched ahead, and a resident unit's new shard all-gathered (collective, as gather_finished).
void EarlyStepper::for_fetch(std::size_t ui) {
  finish(ui, true);
  finish_done_ahead();
  gather_finished(ui);
  s.units[ui].early.kept_behind = false;
}

void EarlyStepper::finish_done_ahead() {
  for (const std::size_t ui : std::vector<std::size_t>(pending_finish))
    if (!finish(ui, false)) return;
}

void EarlyStepper::finish_all() {
  while (!pending_finish.empty()) finish(pending_finish.front(), true);
  for (std::size_t ui = 0; ui < s.units.size(); ++ui) {
    gather_finished(ui);
    s.units[ui].early.kept_behind = false;
  }
}

void EarlyStepper::note_grad(std::size_t ui, Stream& cs) {
  ++s.grads_now[ui];
  if (!on || s.grads_recording) return;
  Unit& u = s.units[ui];
  if (s.grads_now[ui] > s.grads_recorded[ui]) {
    // More gradients than the recorded step had: the early result (if any) used a partial
    // sum. Drop it; step() steps the unit serially and the counts are recorded again.
    s.grads_changed = true;
    if (state_of(ui) != Unit::Early::kNone) {
      wait(ui);
      std::lock_guard<std::mutex> lk(mu);
      u.early.state = Unit::Early::kVoid;
      u.early.norm_call = -1;  // (its norm's part too)
    }
    return;
  }
  if (s.grads_now[ui] < s.grads_recorded[ui] || !eligible(u) || skip > 0) return;
  u.early.grads_done = cs.record();
  u.early.opt = s.cfg.adamw;
  u.early.opt.lr = next_lr;
  u.early.opt.step = s.steps_taken + 1;
  u.early.call = step_calls;
  // Exactly the serial step's grad_scale with clip coefficient 1.
  u.early.opt.grad_scale = float(1.0 / (double(s.cfg.gradient_accumulation_steps) * s.scale));
  order.push_back(ui);
  {
    std::lock_guard<std::mutex> lk(mu);
    u.early.state = Unit::Early::kQueued;
    queue.push_back(ui);
    ++busy;
  }
  cv.notify_all();
}

std::size_t EarlyStepper::next_job() const {
  return detail::next_early_job(
      queue.size(), [&](std::size_t i) { return queue[i] == read_ahead_job; },
      [&](std::size_t i) { return s.units[queue[i]].early.grads_done.query(); },
      [&](std::size_t i) { return s.units[queue[i]].fetch.first; });
}

void EarlyStepper::read_ahead_next() {
  std::size_t next = SIZE_MAX;
  {
    std::lock_guard<std::mutex> lk(mu);
    if (queue.empty()) return;
    next = queue[next_job()];
    if (s.units[next].o_tier != Tier::kNvme) return;
    read_ahead_job = next;
  }
  read_ahead(next, 0);
}

void EarlyStepper::loop() {
  std::unique_lock<std::mutex> lk(mu);
  for (;;) {
    cv.wait(lk, [&] { return stopping || !queue.empty(); });
    if (stopping) return;
    norms(lk);
    if (queue.empty()) continue;  // (cancelled meanwhile)
    const auto it = queue.begin() + std::ptrdiff_t(next_job());
    const std::size_t ui = *it;
    queue.erase(it);
    read_ahead_job = SIZE_MAX;
    const bool need_norm = norm_owed(s.units[ui]);
    const std::int64_t call = s.units[ui].early.call;
    const bool device_norm = s.units[ui].g.dev_sumsq_call == call;
    lk.unlock();
    std::exception_ptr error;
    try {
      step_unit(ui, need_norm, device_norm);
    } catch (...) {
      error = std::current_exception();
    }
    lk.lock();
    s.units[ui].early.state = error ? Unit::Early::kVoid : Unit::Early::kDone;
    if (need_norm && !error) s.units[ui].early.norm_call = call;
    if (error && !worker_error) worker_error = error;
    --busy;
    cv.notify_all();
  }
}

void EarlyStepper::norms(std::unique_lock<std::mutex>& lk) {
  for (bool again = true; again && !stopping;) {
    again = false;
    for (const std::size_t ui : queue) {
      Unit& u = s.units[ui];
      if (!norm_owed(u) || !u.early.grads_done.query()) continue;
      const std::int64_t call = u.early.call;
      float sq;
      if (u.g.dev_sumsq_call == call) {
        sq = s.dev_sumsq(ui);  // the device's, in host memory since grads_done
      } else {
        lk.unlock();
        TraceScope norm_span("cpu_sum_squares", "optimizer", u.shard * 4);
        sq = cpu::sum_squares(DType::kF32, u.g.host->data(), u.shard);
        lk.lock();
      }
      u.early.sumsq = sq;
      u.early.norm_call = call;
      again = true;  // the queue may have changed meanwhile: look again
      break;
    }
  }
}

void EarlyStepper::bound_io(std::deque<IoHandle>& q, std::size_t most) {
  while (q.size() >= std::max<std::size_t>(most, 1)) {
    IoHandle h = q.front();
    q.pop_front();
    h.wait();
  }
}

void EarlyStepper::read_ahead(std::size_t ui, std::size_t g) {
  Unit& u = s.units[ui];
  if (u.o_tier != Tier::kNvme || reads.count({ui, g})) return;
  const std::size_t n = s.range(u, g).size;
  const std::size_t bytes = detail::state_elems(n) * 4;  // master | m | v (layout.h)
  auto b = s.pinned(SwapStore::padded_bytes(bytes));
  reads[{ui, g}] = {b, s.o_store->read(s.o_key(ui, g), b->data(), bytes)};
}

void EarlyStepper::step_unit(std::size_t ui, bool need_norm, bool device_norm) {
  Unit& u = s.units[ui];
  const std::size_t n = u.shard;
  u.early.grads_done.synchronize();
  TraceScope span("early_optimizer_unit", "optimizer", n * 4 * 4);
  const auto* g = static_cast<const float*>(u.g.host->data());
  if (need_norm && device_norm) {
    u.early.sumsq = s.dev_sumsq(ui);
  } else if (need_norm) {
    TraceScope norm_span("cpu_sum_squares", "optimizer", n * 4);
    u.early.sumsq = cpu::sum_squares(DType::kF32, g, n);
  }
  const bool w_host = !u.resident && u.w_tier == Tier::kHost;
  const bool w_nvme = !u.resident && u.w_tier == Tier::kNvme;
  const bool copy_out = s.cfg.compute_dtype != DType::kF32;
  if (!w_host && !w_nvme) {  // new weights for the device, held until the unit switches to them
    TraceScope alloc_span("staging_alloc", "optimizer", n * s.c_size);
    u.early.new_w = s.pinned(SwapStore::padded_bytes(n * s.c_size));
  }
  const std::size_t G = s.groups(u);
  for (std::size_t gi = 0; gi < G; ++gi) {
    const detail::Range r = s.range(u, gi);
    const std::size_t a = r.first, len = r.size, w_bytes = len * s.c_size;
    AdamWShard sh;
    float* master = nullptr;
    std::shared_ptr<PinnedBlock> state;  // NVMe: read, stepped in place, written to the other s.key
    if (u.o_tier == Tier::kHost) {
      const float* src = static_cast<const float*>(u.o.host->data());
      float* dst = static_cast<float*>(u.early.o_alt->data());
      const std::size_t stride = detail::state_stride(n);
      master = dst + a;
      sh = {host_tensor(dst + a, DType::kF32, len),
            host_tensor(g + a, DType::kF32, len),
            host_tensor(dst + stride + a, DType::kF32, len),
            host_tensor(dst + 2 * stride + a, DType::kF32, len),
            {}};
      sh.params_src = host_tensor(src + a, DType::kF32, len);
      sh.m_src = host_tensor(src + stride + a, DType::kF32, len);
      sh.v_src = host_tensor(src + 2 * stride + a, DType::kF32, len);
      if (gi + 1 == G) read_ahead_next();  // (an NVMe job after it)
    } else {
      read_ahead(ui, gi);
      if (gi + 1 < G)
        read_ahead(ui, gi + 1);
      else
        read_ahead_next();
      auto it = reads.find({ui, gi});
      state = it->second.first;
      const IoHandle h = it->second.second;
      reads.erase(it);
      h.wait();
      master = static_cast<float*>(state->data());
      const std::size_t stride = detail::state_stride(len);
      sh = {host_tensor(master, DType::kF32, len),
            host_tensor(g + a, DType::kF32, len),
            host_tensor(master + stride, DType::kF32, len),
            host_tensor(master + 2 * stride, DType::kF32, len),
            {}};
    }
    std::shared_ptr<PinnedBlock> w_block;  // NVMe weights: the sub-group's, written behind
    if (w_nvme) {
      bound_io(w_writes,
               detail::kWeightStagingInFlight);  // the plan's "new compute-weight staging"
      TraceScope alloc_span("staging_alloc", "optimizer", w_bytes);
      w_block = s.pinned(SwapStore::padded_bytes(w_bytes));
    }
    void* w_dst = w_host   ? static_cast<char*>(u.early.w_alt->data()) + a * s.c_size
                  : w_nvme ? w_block->data()
                           : static_cast<char*>(u.early.new_w->data()) + a * s.c_size;
    if (copy_out) sh.copy_out = host_tensor(w_dst, s.cfg.compute_dtype, len);
    {
      TraceScope adam_span("cpu_adamw", "optimizer", len * 4 * 4);
      s.cpu_adam->step(u.early.opt, s.decay_pieces(ui, a, sh), NonFinitePolicy::kReportOnly);
    }
    if (!copy_out) {
      TraceScope copy_span("cpu_copy_w", "optimizer", len * 4);
      std::memcpy(w_dst, master, len * 4);
    }
    if (state) {
      bound_io(writes, detail::state_writes_in_flight(s.cfg));
      IoHandle h = s.o_store->write(s.key('o', ui, 1 - u.early.o_gen, gi), state->data(),
                                    detail::state_elems(len) * 4);
      h.on_complete([state](std::exception_ptr) {});
      writes.push_back(h);
      u.early.io.push_back(h);
    }
    if (w_nvme) {
      IoHandle h =
          s.w_store->write(s.key('w', ui, 1 - u.early.w_gen, gi), w_block->data(), w_bytes);
      h.on_complete([w_block](std::exception_ptr) {});
      w_writes.push_back(h);
      u.early.io.push_back(h);
    }
  }
}

// The early step's results: kept when this step is the one they assumed (finite, no
// clipping, the same lr and step) — without waiting for them: the worker finishes them
// behind, in the next forward's order, and each unit switches to its new copy before it is
// used again (finish). The decision depends on nothing timed, so every s.rank makes the
// same one (a resident unit's all-gather moves with it). Otherwise dropped: the state they
// read is untouched, and the serial loop of step() steps the unit. Returns which s.units were kept.
std::vector<bool> EarlyStepper::settle(float lr, bool overflow, bool clipped) {
  if (overflow || clipped) cancel_queued();
  std::vector<bool> kept(s.units.size(), false);
  const std::vector<std::size_t> queued = std::exchange(order, {});
  bool any_kept = false;
  for (const std::size_t ui : queued) {
    Unit& u = s.units[ui];
    const bool keep =
        !overflow && !clipped && u.early.opt.lr == lr && u.early.opt.step == s.steps_taken + 1;
    const Unit::Early state = keep ? state_of(ui) : wait(ui);
    if (keep && state != Unit::Early::kVoid) {
      kept[ui] = true;
      u.early.finish_pending = true;
      pending_finish.push_back(ui);
      ++s.st.early_units_kept;
      if (state == Unit::Early::kQueued) ++s.st.early_units_finished_behind;
      any_kept = true;
      continue;
    }
    const bool worker_failed = failed();
    if (!worker_failed) {
      // Its writes (to the second NVMe keys) settle before anything else may write there: a
      // job voided after it ran (a unit that got more gradients than recorded) issued them
      // too, and the next step's early job writes the same keys.
      for (IoHandle& h : u.early.io) h.wait();
      if (state == Unit::Early::kDone) count_io(u);  // what it moved, for nothing
    }
    ++s.st.early_units_redone;
    if (!worker_failed) u.early.io.clear();
    {
      std::lock_guard<std::mutex> lk(mu);
      u.early.state = Unit::Early::kNone;
    }
    u.early.new_w.reset();
  }
  if (failed()) rethrow_error();  // the run stops with the worker's error
  if (pending_finish.empty()) {
    wait_idle();
    // State read ahead for jobs that were cancelled: stale after this step.
    for (auto& [ui, read] : std::exchange(reads, {})) read.second.wait_for(std::chrono::minutes(1));
  } else {
    {
      // The next forward takes the s.units in the order this one did: the worker follows it.
      std::lock_guard<std::mutex> lk(mu);
      std::stable_sort(queue.begin(), queue.end(), [&](std::size_t a, std::size_t b) {
        return s.units[a].fetch.first < s.units[b].fetch.first;
      });
    }
    for (const std::size_t ui : pending_finish) s.units[ui].early.kept_behind = true;
    // ... and switches them in that order (finish_done_ahead): the first the forward needs first.
    std::stable_sort(pending_finish.begin(), pending_finish.end(),
                     [&](std::size_t a, std::size_t b) {
                       return s.units[a].fetch.first < s.units[b].fetch.first;
                     });
  }
  if (!queued.empty()) {
    backoff = any_kept ? 0 : std::min(8, std::max(1, 2 * backoff));
    skip = any_kept ? 0 : backoff;
  } else if (skip > 0) {
    --skip;
    ++s.st.early_steps_skipped;
  }
  return kept;
}

}  // namespace strata
