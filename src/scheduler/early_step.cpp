// The early optimizer step: the worker that runs a unit's AdamW as soon as its last gradient
// of the step is accumulated, and the switch to its result (see engine_impl.h, "the early
// optimizer step"). Part of the engine.
#include "scheduler/engine_impl.h"

namespace strata {

using detail::Unit;

void Engine::Impl::stop_early_worker() {
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

void Engine::Impl::void_early() {
  wait_early_idle();
  std::lock_guard<std::mutex> lk(early_mu);
  for (auto& u : units) {
    if (u.early.state != Unit::Early::kNone) u.early.state = Unit::Early::kVoid;
    u.early.norm_call = -1;
  }
}

void Engine::Impl::wait_early_idle() {
  std::unique_lock<std::mutex> lk(early_mu);
  early_cv.wait(lk, [&] { return early_busy == 0; });
}

Unit::Early Engine::Impl::early_state(std::size_t ui) {
  std::lock_guard<std::mutex> lk(early_mu);
  return units[ui].early.state;
}

Unit::Early Engine::Impl::wait_early(std::size_t ui) {
  std::unique_lock<std::mutex> lk(early_mu);
  early_cv.wait(lk, [&] { return units[ui].early.state != Unit::Early::kQueued; });
  return units[ui].early.state;
}

bool Engine::Impl::early_failed() {
  std::lock_guard<std::mutex> lk(early_mu);
  return early_error != nullptr;
}

void Engine::Impl::cancel_queued_early() {
  std::lock_guard<std::mutex> lk(early_mu);
  for (const std::size_t ui : early_queue) units[ui].early.state = Unit::Early::kVoid;
  early_busy -= early_queue.size();
  early_queue.clear();
  early_next = SIZE_MAX;
}

void Engine::Impl::count_early_io(const Unit& u) {
  if (u.o_tier == Tier::kNvme) {
    st.nvme_read_bytes += 3 * u.shard * 4;
    st.nvme_written_bytes += 3 * u.shard * 4;
  }
  if (!u.resident && u.w_tier == Tier::kNvme) st.nvme_written_bytes += u.shard * c_size;
}

void Engine::Impl::rethrow_early_error() {
  wait_early_idle();
  for (auto& u : units)
    for (IoHandle& h : u.early.io)
      if (h.valid()) h.wait_for(std::chrono::minutes(1));
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lk(early_mu);
    error = early_error;
  }
  STRATA_CHECK(error != nullptr, "rethrow_early_error without an error");
  std::rethrow_exception(error);
}

bool Engine::Impl::finish_early(std::size_t ui, bool block) {
  Unit& u = units[ui];
  if (!u.early.finish_pending) return true;
  Unit::Early state = early_state(ui);
  if (state == Unit::Early::kQueued) {
    if (!block) return false;
    TraceScope span("optimizer_wait", "engine");  // the host waits for the worker
    state = wait_early(ui);
  }
  if (state != Unit::Early::kDone || early_failed()) rethrow_early_error();
  for (IoHandle& h : u.early.io) h.wait();
  const std::size_t n = u.shard, w_bytes = n * c_size;
  count_early_io(u);
  if (u.o_tier == Tier::kHost) std::swap(u.o.host, u.early.o_alt);
  else u.early.o_gen = 1 - u.early.o_gen;
  if (!u.resident && u.w_tier == Tier::kHost) std::swap(u.w.host, u.early.w_alt);
  if (!u.resident && u.w_tier == Tier::kNvme) u.early.w_gen = 1 - u.early.w_gen;
  if (const auto target = w_target_dev(u)) {
    Stream& up = *fetch_s;
    up.copy(target->mem, host_ref(u.early.new_w->data(), w_bytes));
    up.host_fn([b = u.early.new_w] {}, "staging_free");
    st.h2d_bytes += w_bytes;
    if (u.resident && world > 1) u.early.gather_pending = true;
    else if (u.resident) u.fetch.ready = up.record();
  }
  {
    std::lock_guard<std::mutex> lk(early_mu);
    u.early.state = Unit::Early::kNone;
  }
  u.early.new_w.reset();
  u.early.io.clear();
  u.early.finish_pending = false;
  std::erase(pending_finish, ui);
  return true;
}

void Engine::Impl::gather_finished(std::size_t ui) {
  Unit& u = units[ui];
  if (!u.early.gather_pending) return;
  const DType ct = cfg.compute_dtype;
  comm.all_gather(view(u.w.full, ct, u.shard, std::size_t(rank) * u.shard), view(u.w.full, ct, u.padded), *fetch_s);
  u.fetch.ready = fetch_s->record();
  u.early.gather_pending = false;
}

// The early step's one entry point for a fetch of unit `ui` (Engine::fetch): its kept early
// work finished (waiting for the worker if it is not done), the others the worker has done
// switched ahead, and a resident unit's new shard all-gathered (collective, as gather_finished).
void Engine::Impl::finish_early_for_fetch(std::size_t ui) {
  finish_early(ui, true);
  finish_done_ahead();
  gather_finished(ui);
  units[ui].early.kept_behind = false;
}

void Engine::Impl::finish_done_ahead() {
  for (const std::size_t ui : std::vector<std::size_t>(pending_finish))
    if (!finish_early(ui, false)) return;
}

void Engine::Impl::finish_all_early() {
  while (!pending_finish.empty()) finish_early(pending_finish.front(), true);
  for (std::size_t ui = 0; ui < units.size(); ++ui) {
    gather_finished(ui);
    units[ui].early.kept_behind = false;
  }
}

void Engine::Impl::note_grad(std::size_t ui, Stream& cs) {
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
      u.early.state = Unit::Early::kVoid;
      u.early.norm_call = -1;  // (its norm's part too)
    }
    return;
  }
  if (grads_now[ui] < grads_recorded[ui] || !early_eligible(u) || early_skip > 0) return;
  u.early.grads_done = cs.record();
  u.early.opt = cfg.adamw;
  u.early.opt.lr = next_lr;
  u.early.opt.step = steps_taken + 1;
  u.early.call = step_calls;
  // Exactly the serial step's grad_scale with clip coefficient 1.
  u.early.opt.grad_scale = float(1.0 / (double(cfg.gradient_accumulation_steps) * scale));
  early_order.push_back(ui);
  {
    std::lock_guard<std::mutex> lk(early_mu);
    u.early.state = Unit::Early::kQueued;
    early_queue.push_back(ui);
    ++early_busy;
  }
  early_cv.notify_all();
}

std::size_t Engine::Impl::next_early_job() const {
  return detail::next_early_job(
      early_queue.size(), [&](std::size_t i) { return early_queue[i] == early_next; },
      [&](std::size_t i) { return units[early_queue[i]].early.grads_done.query(); },
      [&](std::size_t i) { return units[early_queue[i]].fetch.first; });
}

void Engine::Impl::read_ahead_next() {
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

void Engine::Impl::early_loop() {
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
    const std::int64_t call = units[ui].early.call;
    const bool device_norm = units[ui].g.dev_sumsq_call == call;
    lk.unlock();
    std::exception_ptr error;
    try {
      early_unit(ui, need_norm, device_norm);
    } catch (...) {
      error = std::current_exception();
    }
    lk.lock();
    units[ui].early.state = error ? Unit::Early::kVoid : Unit::Early::kDone;
    if (need_norm && !error) units[ui].early.norm_call = call;
    if (error && !early_error) early_error = error;
    --early_busy;
    early_cv.notify_all();
  }
}

void Engine::Impl::early_norms(std::unique_lock<std::mutex>& lk) {
  for (bool again = true; again && !early_stop;) {
    again = false;
    for (const std::size_t ui : early_queue) {
      Unit& u = units[ui];
      if (!norm_owed(u) || !u.early.grads_done.query()) continue;
      const std::int64_t call = u.early.call;
      float sq;
      if (u.g.dev_sumsq_call == call) {
        sq = dev_sumsq(ui);  // the device's, in host memory since grads_done
      } else {
        lk.unlock();
        TraceScope norm_span("sum_squares", "optimizer", u.shard * 4);
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

void Engine::Impl::bound_io(std::deque<IoHandle>& q, std::size_t most) {
  while (q.size() >= std::max<std::size_t>(most, 1)) {
    IoHandle h = q.front();
    q.pop_front();
    h.wait();
  }
}

void Engine::Impl::early_read_ahead(std::size_t ui, std::size_t g) {
  Unit& u = units[ui];
  if (u.o_tier != Tier::kNvme || early_reads.count({ui, g})) return;
  const std::size_t n = range(u, g).size;
  auto b = pinned(SwapStore::padded_bytes(3 * n * 4));
  early_reads[{ui, g}] = {b, o_store->read(o_key(ui, g), b->data(), 3 * n * 4)};
}

void Engine::Impl::early_unit(std::size_t ui, bool need_norm, bool device_norm) {
  Unit& u = units[ui];
  const std::size_t n = u.shard;
  u.early.grads_done.synchronize();
  TraceScope span("early_optimizer_unit", "optimizer", n * 4 * 4);
  const auto* g = static_cast<const float*>(u.g.host->data());
  if (need_norm && device_norm) {
    u.early.sumsq = dev_sumsq(ui);
  } else if (need_norm) {
    TraceScope norm_span("sum_squares", "optimizer", n * 4);
    u.early.sumsq = cpu::sum_squares(DType::kF32, g, n);
  }
  const bool w_host = !u.resident && u.w_tier == Tier::kHost;
  const bool w_nvme = !u.resident && u.w_tier == Tier::kNvme;
  const bool copy_out = cfg.compute_dtype != DType::kF32;
  if (!w_host && !w_nvme) {  // new weights for the device, held until the unit switches to them
    TraceScope alloc_span("staging_alloc", "optimizer", n * c_size);
    u.early.new_w = pinned(SwapStore::padded_bytes(n * c_size));
  }
  const std::size_t G = groups(u);
  for (std::size_t gi = 0; gi < G; ++gi) {
    const detail::Range r = range(u, gi);
    const std::size_t a = r.first, len = r.size, w_bytes = len * c_size;
    AdamWShard sh;
    float* master = nullptr;
    std::shared_ptr<PinnedBlock> state;  // NVMe: read, stepped in place, written to the other key
    if (u.o_tier == Tier::kHost) {
      const float* src = static_cast<const float*>(u.o.host->data());
      float* dst = static_cast<float*>(u.early.o_alt->data());
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
    void* w_dst = w_host ? static_cast<char*>(u.early.w_alt->data()) + a * c_size
                  : w_nvme ? w_block->data()
                           : static_cast<char*>(u.early.new_w->data()) + a * c_size;
    if (copy_out) sh.copy_out = host_tensor(w_dst, cfg.compute_dtype, len);
    {
      TraceScope adam_span("cpu_adamw", "optimizer", len * 4 * 4);
      cpu_adam->step(u.early.opt, sh, NonFinitePolicy::kReportOnly);
    }
    if (!copy_out) std::memcpy(w_dst, master, len * 4);
    if (state) {
      bound_io(early_writes, std::size_t(std::max(1, cfg.optimizer_buffer_count - 2)));
      IoHandle h = o_store->write(key('o', ui, 1 - u.early.o_gen, gi), state->data(), 3 * len * 4);
      h.on_complete([state](std::exception_ptr) {});
      early_writes.push_back(h);
      u.early.io.push_back(h);
    }
    if (w_nvme) {
      IoHandle h = w_store->write(key('w', ui, 1 - u.early.w_gen, gi), w_block->data(), w_bytes);
      h.on_complete([w_block](std::exception_ptr) {});
      early_w_writes.push_back(h);
      u.early.io.push_back(h);
    }
  }
}


// The early step's results: kept when this step is the one they assumed (finite, no
// clipping, the same lr and step) — without waiting for them: the worker finishes them
// behind, in the next forward's order, and each unit switches to its new copy before it is
// used again (finish_early). The decision depends on nothing timed, so every rank makes the
// same one (a resident unit's all-gather moves with it). Otherwise dropped: the state they
// read is untouched, and the serial loop of step() steps the unit. Returns which units were kept.
std::vector<bool> Engine::Impl::settle_early_step(float lr, bool overflow, bool clipped) {
  if (overflow || clipped) cancel_queued_early();
  std::vector<bool> kept(units.size(), false);
  const std::vector<std::size_t> queued = std::exchange(early_order, {});
  bool any_kept = false;
  for (const std::size_t ui : queued) {
    Unit& u = units[ui];
    const bool keep = !overflow && !clipped && u.early.opt.lr == lr && u.early.opt.step == steps_taken + 1;
    const Unit::Early state = keep ? early_state(ui) : wait_early(ui);
    if (keep && state != Unit::Early::kVoid) {
      kept[ui] = true;
      u.early.finish_pending = true;
      pending_finish.push_back(ui);
      ++st.early_units_kept;
      if (state == Unit::Early::kQueued) ++st.early_units_finished_behind;
      any_kept = true;
      continue;
    }
    const bool failed = early_failed();
    if (!failed) {
      // Its writes (to the second NVMe keys) settle before anything else may write there: a
      // job voided after it ran (a unit that got more gradients than recorded) issued them
      // too, and the next step's early job writes the same keys.
      for (IoHandle& h : u.early.io) h.wait();
      if (state == Unit::Early::kDone) count_early_io(u);  // what it moved, for nothing
    }
    ++st.early_units_redone;
    if (!failed) u.early.io.clear();
    {
      std::lock_guard<std::mutex> lk(early_mu);
      u.early.state = Unit::Early::kNone;
    }
    u.early.new_w.reset();
  }
  if (early_failed()) rethrow_early_error();  // the run stops with the worker's error
  if (pending_finish.empty()) {
    wait_early_idle();
    // State read ahead for jobs that were cancelled: stale after this step.
    for (auto& [ui, read] : std::exchange(early_reads, {})) read.second.wait_for(std::chrono::minutes(1));
  } else {
    {
      // The next forward takes the units in the order this one did: the worker follows it.
      std::lock_guard<std::mutex> lk(early_mu);
      std::stable_sort(early_queue.begin(), early_queue.end(),
                       [&](std::size_t a, std::size_t b) { return units[a].fetch.first < units[b].fetch.first; });
    }
    for (const std::size_t ui : pending_finish) units[ui].early.kept_behind = true;
    // ... and switches them in that order (finish_done_ahead): the first the forward needs first.
    std::stable_sort(pending_finish.begin(), pending_finish.end(),
                     [&](std::size_t a, std::size_t b) { return units[a].fetch.first < units[b].fetch.first; });
  }
  if (!queued.empty()) {
    early_backoff = any_kept ? 0 : std::min(8, std::max(1, 2 * early_backoff));
    early_skip = any_kept ? 0 : early_backoff;
  } else if (early_skip > 0) {
    --early_skip;
    ++st.early_steps_skipped;
  }
  return kept;
}

}  // namespace strata
