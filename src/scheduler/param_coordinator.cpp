// The parameter coordinator: fetch / release of a unit's full weights (host or NVMe shard ->
// device -> all-gather on the fetch stream), prefetch along the order recorded in the first
// step, and the eval pass's use of that order. Part of the engine (engine_impl.h).
#include "scheduler/engine_impl.h"

namespace strata {

using detail::Unit;
using detail::wait_all;

void Engine::Impl::issue_fetch(int ui, bool prefetch) {
  Unit& u = units[std::size_t(ui)];
  if (u.fetch.gathered) return;
  TraceScope span(prefetch ? "prefetch" : "fetch", "engine", u.padded * c_size);
  u.w.full = alloc(u.padded * c_size, fetch_s.get());
  const TensorRef block = view(u.w.full, cfg.compute_dtype, u.shard, std::size_t(rank) * u.shard);
  switch (detail::fetch_path(u.w_tier)) {
    case detail::FetchPath::kDeviceCopy:
      fetch_s->copy(block.mem, u.w.dev.ref());
      break;
    case detail::FetchPath::kUpload:
      if (u.w.written.valid()) fetch_s->wait(u.w.written);
      fetch_s->copy(block.mem, host_ref(u.w.host->data(), u.shard * c_size));
      st.h2d_bytes += u.shard * c_size;
      break;
    case detail::FetchPath::kNvmeUpload: {
      bound(param_staging, detail::weight_reads_in_flight(cfg));
      auto staging = pinned(SwapStore::padded_bytes(u.shard * c_size));
      std::vector<IoHandle> reads;  // one a sub-group, into its place in the shard
      for (std::size_t g = 0; g < groups(u); ++g) {
        const detail::Range r = range(u, g);
        reads.push_back(w_swap().read(w_key(std::size_t(ui), g),
                                      static_cast<char*>(staging->data()) + r.first * c_size,
                                      r.size * c_size));
        reads.back().on_complete(
            [staging](std::exception_ptr) {});  // outlives it if a later read throws
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
  if (world > 1) comm.all_gather(block, view(u.w.full, cfg.compute_dtype, u.padded), *fetch_s);
  u.fetch.ready = fetch_s->record();
  u.fetch.gathered = true;
  live += u.padded;
  ++(prefetch ? st.prefetches : st.fetches);
}

void Engine::Impl::drop(Unit& u) {
  if (!u.fetch.gathered || u.resident) return;
  if (u.fetch.released.valid()) fetch_s->wait(u.fetch.released);
  u.w.full.reset();
  u.fetch.gathered = false;
  live -= u.padded;
}

std::size_t Engine::Impl::next_use(int ui, std::size_t from) const {
  for (std::size_t p = from; p < trace_end(); ++p)
    if (trace[p] == ui) return p;
  return SIZE_MAX;
}

void Engine::Impl::make_room(std::uint64_t need) {
  while (detail::over_live_budget(cfg, live, need)) {
    const std::size_t victim = detail::release_victim(
        units.size(),
        [&](std::size_t i) {
          const Unit& u = units[i];
          return u.fetch.gathered && !u.resident && u.fetch.in_use == 0;
        },
        [&](std::size_t i) { return order_known() ? next_use(int(i), cursor()) : SIZE_MAX; });
    if (victim == units.size()) return;
    drop(units[victim]);
  }
}

void Engine::Impl::prefetch_ahead() {
  if (!order_known()) return;
  std::uint64_t ahead = 0;
  // At the end of a forward-only pass, the next one (or the next training step) begins again
  // at the first unit.
  const std::size_t from = eval && eval_pos == eval_end ? 0 : cursor();
  for (std::size_t p = from; p < trace_end(); ++p) {
    Unit& u = units[std::size_t(trace[p])];
    if (u.resident || u.fetch.gathered) continue;
    if (!detail::prefetch_fits(cfg, ahead, live, u.padded)) break;
    // Kept early work not finished yet: its new weights are not there. With more than one
    // rank, whether the worker is done must not decide which all-gathers go first: there
    // prefetch stops at any unit the last step left to finish, done or not.
    if (world > 1 ? u.early.kept_behind : !early_step.finish(std::size_t(trace[p]), false)) break;
    issue_fetch(trace[p], true);
    ahead += u.padded;
  }
}

void Engine::Impl::note_eval_fetch(int ui) {
  if (eval_pos < eval_end && trace[eval_pos] == ui)
    ++eval_pos;
  else
    eval_pos = eval_end > 0 && trace[0] == ui ? 1 : SIZE_MAX;
}

void Engine::Impl::note_fetch(int ui) {
  if (recording) {
    trace.push_back(ui);
    return;
  }
  if (pos < trace.size() && trace[pos] == ui) {
    ++pos;
    return;
  }
  log::info("engine: unit order changed at position {} (expected {}, got {}); recording it again",
            pos, pos < trace.size() ? units[std::size_t(trace[pos])].name : std::string("the end"),
            units[std::size_t(ui)].name);
  ++st.trace_rebuilds;
  trace.assign(trace.begin(), trace.begin() + std::ptrdiff_t(std::min(pos, trace.size())));
  trace.push_back(ui);
  recording = true;
}

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
  STRATA_REQUIRE(unit >= 0 && std::size_t(unit) < s.units.size(), "Engine::fetch: no unit {}",
                 unit);
  Unit& u = s.units[std::size_t(unit)];
  if (!s.eval && u.fetch.first_step != s.steps_taken) {
    std::lock_guard<std::mutex> lk(s.early_step.mu);  // the worker's next_job reads it
    u.fetch.first_step = s.steps_taken;
    u.fetch.first = s.fetch_seq++;
  }
  s.early_step.for_fetch(std::size_t(unit));
  if (!u.resident) {
    if (s.eval)
      s.note_eval_fetch(unit);
    else
      s.note_fetch(unit);
    if (!u.fetch.gathered) {
      s.make_room(u.padded);
      s.issue_fetch(unit, false);
    }
    s.prefetch_ahead();
  }
  ++u.fetch.in_use;
  compute.wait(u.fetch.ready);
  return Impl::view(u.w.full, s.cfg.compute_dtype, u.numel);
}

void Engine::release(int unit, Stream& compute) {
  Impl& s = *impl_;
  Unit& u = s.unit_at(unit, "Engine::release");
  STRATA_REQUIRE(u.fetch.in_use > 0, "Engine::release('{}') without a matching fetch", u.name);
  --u.fetch.in_use;
  // A resident unit stays, but its weights are overwritten in place by step() (the optimizer's
  // copy-out, the early step's switch) and load_state: after this event.
  u.fetch.released = compute.record();
  if (u.resident || u.fetch.in_use > 0) return;
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

}  // namespace strata
