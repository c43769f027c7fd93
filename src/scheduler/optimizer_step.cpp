// The optimizer step (Engine::step): the global gradient norm, the fp16 loss scaler, what to
// keep of the early step, and AdamW over every unit not kept, where its state lives. Part of
// the engine (engine_impl.h).
#include "scheduler/engine_impl.h"

namespace strata {

using detail::Unit;
using detail::wait_all;

namespace {

// Elements [first, first + count) of `t` (unset: stays unset).
TensorRef elements(const TensorRef& t, std::size_t first, std::size_t count) {
  if (t.mem.ptr == nullptr) return t;
  const std::size_t es = dtype_size(t.dtype);
  TensorRef out = t;
  out.mem.ptr = static_cast<char*>(t.mem.ptr) + first * es;
  out.mem.bytes = count * es;
  out.numel = count;
  return out;
}

}  // namespace

std::vector<AdamWShard> Engine::Impl::decay_pieces(std::size_t ui, std::size_t first,
                                                   const AdamWShard& whole) const {
  const std::size_t n = whole.params.numel, end = first + n;
  std::vector<AdamWShard> out;
  auto add = [&](std::size_t a, std::size_t b, bool decay) {  // [a, b) of the unit's shard
    if (a >= b) return;
    const std::size_t at = a - first, len = b - a;
    AdamWShard p{elements(whole.params, at, len),
                 elements(whole.grads, at, len),
                 elements(whole.m, at, len),
                 elements(whole.v, at, len),
                 elements(whole.copy_out, at, len),
                 elements(whole.params_src, at, len),
                 elements(whole.m_src, at, len),
                 elements(whole.v_src, at, len),
                 decay};
    out.push_back(p);
  };
  if (wd_exempt.empty() || cfg.adamw.weight_decay == 0) return {whole};
  std::size_t at = first;
  for (const detail::Range r : wd_exempt[ui]) {
    const std::size_t a = std::max<std::size_t>(r.first, first),
                      b = std::min<std::size_t>(r.first + r.size, end);
    if (a >= b) continue;
    add(at, a, true);
    add(a, b, false);
    at = b;
  }
  if (out.empty()) return {whole};
  add(at, end, true);
  return out;
}

namespace {

// AdamW over every unit whose early result step() did not keep, where its optimizer state lives:
// the device's adamw kernel (device tier), or CpuAdamW a sub-group at a time (host and NVMe
// tiers). Sub-groups with state or gradients on NVMe are read one ahead while the one before
// computes; state and new weights are written behind.
class OptimizerPass {
 public:
  OptimizerPass(Engine::Impl& impl, const AdamWOptions& options, const std::vector<bool>& kept);
  void run();

 private:
  using Impl = Engine::Impl;
  struct GroupRead {
    std::shared_ptr<PinnedBlock> state, grad;  // master | m | v; the gradient
    IoHandle state_read;
    std::vector<IoHandle> grad_reads;
  };
  void device_unit(std::size_t ui, const std::optional<TensorRef>& target);
  void host_unit(std::size_t ui, const std::optional<TensorRef>& target);
  std::shared_ptr<PinnedBlock> stage_w(std::size_t bytes);
  void issue_read(std::size_t k);
  // Writes `bytes` from `block` to `store`; the block lives until the write completes.
  IoHandle write_behind(SwapStore& store, const std::string& key,
                        std::shared_ptr<PinnedBlock> block, std::size_t bytes);
  void write_state(const std::string& key, std::shared_ptr<PinnedBlock> block, std::size_t bytes);
  // New NVMe-tier weights of sub-group g of unit ui, from `block`, written behind.
  void write_w(std::size_t ui, std::size_t g, std::shared_ptr<PinnedBlock> block,
               std::size_t bytes);

  Impl& s;
  Stream& os;
  const AdamWOptions& opt;
  const std::vector<bool>& kept;
  const DType ct;
  const bool copy_out;
  // Sub-groups of the host optimizer with state or gradients on NVMe: the next one's stream in
  // while this one computes; state writes go out behind, at most optimizer_buffer_count in flight.
  std::vector<std::pair<std::size_t, std::size_t>> nvme_groups;  // (unit, sub-group)
  std::map<std::pair<std::size_t, std::size_t>, GroupRead> reads;
  std::deque<IoHandle> writes;  // optimizer state written behind
  // At most optimizer_buffer_count state buffers at once: one read ahead, one stepping, the
  // rest written behind (the memory plan's "optimizer swap buffers", a sub-group each).
  const std::size_t max_writes;
  // New compute weights staged in pinned memory on their way to the device or NVMe: at most
  // two sub-groups' at once (the plan's "new compute-weight staging"); each entry waits for one
  // to be free.
  std::deque<std::function<void()>> w_staging;
  std::size_t nvme_next = 0;
};

OptimizerPass::OptimizerPass(Engine::Impl& impl, const AdamWOptions& options,
                             const std::vector<bool>& kept_units)
    : s(impl),
      os(*impl.opt_s),
      opt(options),
      kept(kept_units),
      ct(impl.cfg.compute_dtype),
      copy_out(ct != DType::kF32),
      max_writes(detail::state_writes_in_flight(impl.cfg)) {
  for (std::size_t i = 0; i < s.units.size(); ++i) {
    const Unit& u = s.units[i];
    if (!kept[i] && detail::reads_ahead_from_nvme(u.o_tier, u.g_tier))
      for (std::size_t g = 0; g < s.groups(u); ++g) nvme_groups.push_back({i, g});
  }
}

std::shared_ptr<PinnedBlock> OptimizerPass::stage_w(std::size_t bytes) {
  while (w_staging.size() >= detail::kWeightStagingInFlight) {
    w_staging.front()();
    w_staging.pop_front();
  }
  return s.pinned(SwapStore::padded_bytes(bytes));
}

void OptimizerPass::issue_read(std::size_t k) {
  if (k >= nvme_groups.size()) return;
  const auto [ui, g] = nvme_groups[k];
  const detail::Range r = s.range(s.units[ui], g);
  GroupRead& rd = reads[nvme_groups[k]];
  if (s.units[ui].o_tier == Tier::kNvme) {
    const std::size_t bytes = detail::state_elems(r.size) * 4;  // master | m | v (layout.h)
    auto b = s.pinned(SwapStore::padded_bytes(bytes));
    rd.state_read = s.o_store->read(s.o_key(ui, g), b->data(), bytes);
    rd.state_read.on_complete(
        [b](std::exception_ptr) {});  // the block outlives the read, even if step() throws
    s.st.nvme_read_bytes += bytes;
    rd.state = b;
  }
  if (s.units[ui].g_tier == Tier::kNvme) {
    rd.grad = s.pinned(SwapStore::padded_bytes(r.size * 4));
    rd.grad_reads = s.read_grad(ui, r, rd.grad);
  }
}

IoHandle OptimizerPass::write_behind(SwapStore& store, const std::string& key,
                                     std::shared_ptr<PinnedBlock> block, std::size_t bytes) {
  IoHandle h = store.write(key, block->data(), bytes);
  h.on_complete([block](std::exception_ptr) {});
  s.st.nvme_written_bytes += bytes;
  return h;
}

void OptimizerPass::write_state(const std::string& key, std::shared_ptr<PinnedBlock> block,
                                std::size_t bytes) {
  writes.push_back(write_behind(*s.o_store, key, std::move(block), bytes));
  while (writes.size() > max_writes) {
    writes.front().wait();
    writes.pop_front();
  }
}

void OptimizerPass::write_w(std::size_t ui, std::size_t g, std::shared_ptr<PinnedBlock> block,
                            std::size_t bytes) {
  IoHandle h = write_behind(*s.w_store, s.w_key(ui, g), std::move(block), bytes);
  w_staging.push_back([h] { h.wait(); });
}

void OptimizerPass::run() {
  issue_read(nvme_next++);
  for (std::size_t ui = 0; ui < s.units.size(); ++ui) {
    Unit& u = s.units[ui];
    if (kept[ui]) continue;
    // The whole unit (state in, update, weights out); the update itself is the device's
    // adamw kernel or the cpu_adamw spans below, so a trace tells waiting from computing.
    TraceScope span("optimizer_unit", "optimizer", u.shard * 4 * 4);
    const auto target = s.w_target_dev(u);  // device-resident compute weights, if any
    if (u.o_tier == Tier::kDevice)
      device_unit(ui, target);
    else
      host_unit(ui, target);
  }
  for (auto& h : writes) h.wait();
  for (auto& w : w_staging) w();
}

// A unit with its optimizer state on the device: one adamw kernel on the optimizer stream, new
// weights straight to a device target, else back to their host or NVMe tier on the write-back
// stream.
void OptimizerPass::device_unit(std::size_t ui, const std::optional<TensorRef>& target) {
  Unit& u = s.units[ui];
  const std::size_t n = u.shard;
  const std::size_t w_bytes = n * s.c_size;
  Buffer g_tmp, scratch;
  TensorRef g;
  if (u.g_tier == Tier::kDevice) {
    g = Impl::view(u.g.dev, DType::kF32, n);
  } else if (u.g_tier == Tier::kHost) {
    g_tmp = s.alloc(n * 4, &os);
    os.copy(g_tmp.ref(), host_ref(u.g.host->data(), n * 4));
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
  AdamWShard sh{Impl::view(u.o.dev, DType::kF32, n, 0),
                g,
                Impl::view(u.o.dev, DType::kF32, n, n),
                Impl::view(u.o.dev, DType::kF32, n, 2 * n),
                {}};
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
  d.shards = s.decay_pieces(ui, 0, sh);
  os.adamw(d);
  if (target) {
    if (!copy_out) os.copy(target->mem, u.o.dev.ref(0, n * 4));
    return;
  }
  // The new weights go back over the link on the write-back stream, so the next unit's
  // update overlaps this unit's device -> host copy, and host-tier ones (not waited for
  // here) the next forward's reads: its fetch of the unit waits for w.written.
  const Buffer& new_w = copy_out ? scratch : u.o.dev;  // (fp32: the master itself)
  Stream& xs = *s.wb_s;
  xs.wait(os.record());
  if (detail::weights_out(u.resident, u.w_tier) == detail::WeightsOut::kHost) {
    xs.copy(host_ref(u.w.host->data(), w_bytes), new_w.ref(0, w_bytes));
    u.w.written = xs.record();
  } else {
    // NVMe: a sub-group at a time through staging, written by the host once copied.
    for (std::size_t gi = 0; gi < s.groups(u); ++gi) {
      const detail::Range r = s.range(u, gi);
      auto block = stage_w(r.size * s.c_size);
      xs.copy(host_ref(block->data(), r.size * s.c_size),
              new_w.ref(r.first * s.c_size, r.size * s.c_size));
      xs.synchronize();
      write_w(ui, gi, block, r.size * s.c_size);
    }
  }
  if (scratch) scratch.reset_on(xs);
  s.st.d2h_bytes += w_bytes;
}

void OptimizerPass::host_unit(std::size_t ui, const std::optional<TensorRef>& target) {
  Unit& u = s.units[ui];
  // The host optimizer, a sub-group at a time; master, m and v a stride apart (layout.h).
  const std::size_t host_stride = detail::state_stride(u.shard);
  for (std::size_t gi = 0; gi < s.groups(u); ++gi) {
    const detail::Range r = s.range(u, gi);
    const std::size_t a = r.first, len = r.size, len_w = len * s.c_size;
    float* master = nullptr;
    AdamWShard sh;
    GroupRead rd;  // what was read ahead from NVMe for this sub-group
    if (detail::reads_ahead_from_nvme(u.o_tier, u.g_tier)) {
      issue_read(nvme_next++);
      auto it = reads.find({ui, gi});
      rd = std::move(it->second);
      reads.erase(it);
    }
    std::shared_ptr<PinnedBlock> state_block;
    if (u.o_tier == Tier::kHost) {
      float* o = static_cast<float*>(u.o.host->data());
      master = o + a;
      sh.params = host_tensor(o + a, DType::kF32, len);
      sh.m = host_tensor(o + host_stride + a, DType::kF32, len);
      sh.v = host_tensor(o + 2 * host_stride + a, DType::kF32, len);
    } else {
      rd.state_read.wait();
      state_block = rd.state;
      master = static_cast<float*>(state_block->data());
      sh.params = host_tensor(master, DType::kF32, len);
      const std::size_t stride = detail::state_stride(len);
      sh.m = host_tensor(master + stride, DType::kF32, len);
      sh.v = host_tensor(master + 2 * stride, DType::kF32, len);
    }
    std::shared_ptr<PinnedBlock> g_stage;
    if (u.g_tier == Tier::kHost) {
      sh.grads = host_tensor(static_cast<const float*>(u.g.host->data()) + a, DType::kF32, len);
    } else if (u.g_tier == Tier::kNvme) {
      wait_all(rd.grad_reads);
      g_stage = rd.grad;
      sh.grads = host_tensor(g_stage->data(), DType::kF32, len);
    } else {
      g_stage = s.pinned(len * 4);
      os.copy(host_ref(g_stage->data(), len * 4), u.g.dev.ref(a * 4, len * 4));
      os.synchronize();
      s.st.d2h_bytes += len * 4;
      sh.grads = host_tensor(g_stage->data(), DType::kF32, len);
    }
    const detail::WeightsOut out = detail::weights_out(u.resident, u.w_tier);
    const bool to_host = out == detail::WeightsOut::kHost;  // written in place, no staging
    std::shared_ptr<PinnedBlock> w_block;
    if (!to_host) w_block = stage_w(len_w);
    void* w_dst = to_host ? static_cast<char*>(u.w.host->data()) + a * s.c_size : w_block->data();
    if (copy_out) sh.copy_out = host_tensor(w_dst, ct, len);
    {
      TraceScope adam_span("cpu_adamw", "optimizer", len * 4 * 4);
      s.cpu_adam->step(opt, s.decay_pieces(ui, a, sh), NonFinitePolicy::kReportOnly);
    }
    if (!copy_out) {
      TraceScope copy_span("cpu_copy_w", "optimizer", len * 4);
      std::memcpy(w_dst, master, len * 4);
    }
    if (target) {
      os.copy(s.w_target_dev(u, a, len)->mem, host_ref(w_dst, len_w));
      os.host_fn([w_block] {}, "staging_free");
      w_staging.push_back([e = os.record()] { e.synchronize(); });
      s.st.h2d_bytes += len_w;
    }
    if (state_block) write_state(s.o_key(ui, gi), state_block, detail::state_elems(len) * 4);
    if (out == detail::WeightsOut::kNvme) write_w(ui, gi, w_block, len_w);
  }
}

}  // namespace

// Everything queued for this step done: kept early work switched, gradients reduced and
// written, the compute stream's reads of resident weights done.
void Engine::Impl::begin_step() {
  early_step.finish_all();  // a unit the model did not fetch since the last step
  for (auto& u : units)
    STRATA_REQUIRE(u.fetch.in_use == 0 && !u.g.full,
                   "Engine::step: unit '{}' is still fetched or has an unreduced gradient", u.name);
  comm_s->synchronize();
  fetch_s->synchronize();
  for (auto& u : units) settle_grad_io(u);  // NVMe-tier gradients written
  grad_out.clear();
  Stream& os = *opt_s;
  // Resident units' weights are rewritten in place below and after (the optimizer stream's
  // copy-out, the fetch stream's switch to kept early results): only once the compute stream
  // has done what it queued before release(), which the last reduce_grad need not cover.
  for (const Unit& u : units) {
    if (!u.resident || !u.fetch.released.valid()) continue;
    os.wait(u.fetch.released);
    fetch_s->wait(u.fetch.released);
  }
  for (std::size_t ui = 0; ui < units.size(); ++ui)  // no gradient this step: still last step's
    if (units[ui].g_tier == Tier::kHost && grads_now[ui] == 0)
      std::memset(units[ui].g.host->data(), 0, units[ui].shard * 4);
}

// Global gradient norm (and fp16 overflow) from the accumulators: one all-reduce. Each
// unit's sum of squares is the fp32 result of the same kernel wherever its gradient lives
// (the device's sum_squares; on the host the CPU kernel the emulated device runs), summed
// in unit order: offloading gradients does not change the norm, hence the clipping. Under tensor
// parallelism a unit of which this rank counts only ranges (Impl::tp_ranges) adds the sum of
// squares of those ranges back to back, and the total is summed over the TP group as well.
double Engine::Impl::grad_sumsq() {
  Stream& os = *opt_s;
  double local = 0;
  {
    TraceScope span("grad_norm", "optimizer");
    std::vector<float> part(units.size(), 0.0f);
    Buffer sq = alloc(4 * units.size(), &os);
    bool any_device = false;
    for (std::size_t ui = 0; ui < units.size(); ++ui) {
      Unit& u = units[ui];
      if (u.g_tier == Tier::kDevice) {
        if (!tp_partial(ui))
          os.sum_squares(Impl::view(u.g.dev, DType::kF32, u.shard),
                         Impl::view(sq, DType::kF32, 1, ui));
        any_device = true;
      }
    }
    // Tensor parallelism, device-tier units whose shard counts only in part: the counted ranges
    // copied back to back into scratch, one sum_squares over them (the host tiers' bits).
    std::size_t tp_scratch = 0;
    for (std::size_t ui = 0; ui < units.size(); ++ui)
      if (tp_partial(ui) && units[ui].g_tier == Tier::kDevice) {
        std::size_t n = 0;
        for (const detail::Range c : tp_ranges[ui]) n += c.size;
        tp_scratch = std::max(tp_scratch, n);
      }
    Buffer tp_buf = tp_scratch > 0 ? alloc(4 * tp_scratch, &os) : Buffer{};
    for (std::size_t ui = 0; ui < units.size() && tp_scratch > 0; ++ui) {
      if (!tp_partial(ui) || units[ui].g_tier != Tier::kDevice) continue;
      std::size_t n = 0;
      for (const detail::Range c : tp_ranges[ui]) {
        os.copy(Impl::view(tp_buf, DType::kF32, c.size, n).mem,
                Impl::view(units[ui].g.dev, DType::kF32, c.size, c.first).mem);
        n += c.size;
      }
      if (n > 0)
        os.sum_squares(Impl::view(tp_buf, DType::kF32, n), Impl::view(sq, DType::kF32, 1, ui));
      else
        os.fill(Impl::view(sq, DType::kF32, 1, ui), 0.0f);
    }
    std::vector<float> dev_part(units.size(), 0.0f);
    if (any_device) os.copy(host_ref(dev_part.data(), 4 * dev_part.size()), sq.ref());

    for (std::size_t ui = 0; ui < units.size(); ++ui) {
      Unit& u = units[ui];
      // NVMe: taken as the last gradient went out (reduce_to_nvme), the host's kernel's bits.
      if (u.g_tier == Tier::kNvme)
        part[ui] = u.g.fresh ? 0.0f : tp_partial(ui) ? u.g.tp_sumsq : u.g.sumsq;
      if (u.g_tier != Tier::kHost) continue;
      if (tp_partial(ui)) {  // the counted ranges of the accumulator
        part[ui] = tp_host_sumsq(ui, static_cast<const float*>(u.g.host->data()));
        continue;
      }
      // The early worker computed it with the same kernel from the same final gradient.
      bool done;
      {
        std::lock_guard<std::mutex> lk(early_step.mu);
        done = u.early.norm_call == early_step.step_calls;
      }
      // Or the device took it from the step's only gradient (the comm stream is done).
      const bool device = grads_now[ui] == 1 && u.g.dev_sumsq_call == early_step.step_calls;
      if (done || device) {
        part[ui] = done ? u.early.sumsq : dev_sumsq(ui);
      } else {
        TraceScope norm_span("cpu_sum_squares", "optimizer", u.shard * 4);
        part[ui] = cpu::sum_squares(DType::kF32, u.g.host->data(), u.shard);
      }
    }
    os.synchronize();
    for (std::size_t ui = 0; ui < units.size(); ++ui)
      local += double(units[ui].g_tier == Tier::kDevice ? dev_part[ui] : part[ui]);
  }
  double total = local;
  if (world > 1) {
    Buffer b = alloc(8, &os);
    os.copy(b.ref(), host_ref(&local, 8));
    comm.all_reduce(TensorRef{b.ref(), DType::kF64, 1}, ReduceOp::kSum, os);
    os.copy(host_ref(&total, 8), b.ref());
    os.synchronize();
  }
  if (tp) {  // the other slices' parts: every element of the model once
    Buffer b = alloc(8, &os);
    os.copy(b.ref(), host_ref(&total, 8));
    tp->all_reduce(TensorRef{b.ref(), DType::kF64, 1}, ReduceOp::kSum, os);
    os.copy(host_ref(&total, 8), b.ref());
    os.synchronize();
  }
  {
    std::lock_guard<std::mutex> lk(early_step.mu);
    early_step.norm_taken_call = early_step.step_calls++;
  }
  return total;
}

float Engine::Impl::tp_host_sumsq(std::size_t ui, const float* g) const {
  cpu::SumSquares run;
  for (const detail::Range c : tp_ranges[ui]) run.add(g + c.first, c.size);
  return run.result();
}

// DeepSpeed's DynamicLossScaler::update_scale (fp16 with a dynamic scale; nothing otherwise),
// with its raise_error_at_min_scale: an overflow at the least scale that would lower it ends the
// run (every step after would be skipped too, and the run would go on without a word) — said by
// the caller, Engine::step, once the skipped step is wound up.
bool Engine::Impl::update_loss_scale(bool overflow) {
  if (!cfg.fp16.enabled) return true;
  if (cfg.fp16.loss_scale <= 0) {
    if (overflow) {
      const double was = scale;
      if (cfg.fp16.hysteresis == 1 || hysteresis_left == 1) {
        if (scale <= cfg.fp16.min_loss_scale) return false;
        scale = std::max(scale / 2, cfg.fp16.min_loss_scale);
      } else {
        --hysteresis_left;
      }
      log::info("fp16: the gradients overflowed at loss scale {:g}: the step is skipped{}", was,
                scale < was ? fmt::format(", the scale lowered to {:g}", scale) : std::string());
      last_overflow_iter = scaler_iter;
    } else if ((scaler_iter - last_overflow_iter) % cfg.fp16.loss_scale_window == 0) {
      hysteresis_left = cfg.fp16.hysteresis;
      scale *= 2;
    }
    ++scaler_iter;
  }
  return true;
}

// The gradient counts of this step become the record the next step's early work follows.
void Engine::Impl::record_grad_counts() {
  if (grads_recording || grads_changed || grads_now != grads_recorded) {
    if (!grads_recording)
      log::info("engine: the gradients per unit changed this step; recording them again");
    grads_recorded = grads_now;
    grads_recording = false;
    grads_changed = false;
  }
  std::fill(grads_now.begin(), grads_now.end(), 0);
}

// Host accumulators need no zeroing: the next step's first gradient overwrites them (and a
// unit without one is zeroed when that step begins).
void Engine::Impl::zero_grads() {
  Stream& os = *opt_s;
  for (auto& u : units) {
    if (u.g_tier == Tier::kDevice) os.fill(Impl::view(u.g.dev, DType::kF32, u.shard), 0.0f);
    if (u.g_tier == Tier::kNvme) u.g.fresh = true;
  }
  os.synchronize();
}

// The next forward starts the recorded order again, whether this step updates or is skipped.
void Engine::Impl::rewind_trace() {
  recording = false;
  pos = 0;
  fetch_seq = 0;
}

// After the update: resident units gathered again, stale gathered copies dropped, gradients
// zeroed, kept early work already done switched, and the trace rewound.
void Engine::Impl::end_step() {
  Stream& os = *opt_s;
  const DType ct = cfg.compute_dtype;
  os.synchronize();
  fetch_s->synchronize();

  // Resident units: gather the updated shards.
  for (auto& u : units) {
    if (!u.resident || world == 1 || u.early.finish_pending)
      continue;  // (EarlyStepper::finish gathers those)
    const TensorRef block = Impl::view(u.w.full, ct, u.shard, std::size_t(rank) * u.shard);
    comm.all_gather(block, Impl::view(u.w.full, ct, u.padded), os);
  }
  // Gathered non-resident units hold the old weights: drop them.
  for (auto& u : units) drop(u);
  zero_grads();
  for (auto& u : units)
    if (u.resident && !u.early.finish_pending) u.fetch.ready = os.record();
  os.synchronize();

  // Kept units the worker has already finished switch now (after the loops above, which
  // leave them alone): their new weights go to the device on the fetch stream while it steps
  // the rest. Local only: a resident unit's all-gather still waits for its fetch.
  early_step.finish_done_ahead();

  rewind_trace();
}

StepResult Engine::step(float lr) {
  Impl& s = *impl_;
  STRATA_REQUIRE(s.finalized, "Engine::step before finalize()");
  STRATA_REQUIRE(!s.eval,
                 "Engine::step while set_eval(true): call set_eval(false) after the evaluation");
  s.begin_step();
  const double total = s.grad_sumsq();
  const double den = double(s.cfg.gradient_accumulation_steps) * s.scale;
  StepResult r;
  r.loss_scale = s.scale;
  r.grad_norm = std::sqrt(total) / den;
  const bool overflow = !std::isfinite(r.grad_norm);

  const bool scale_left = s.update_loss_scale(overflow);

  const bool clipped = s.cfg.gradient_clipping > 0 && r.grad_norm > s.cfg.gradient_clipping;
  const std::vector<bool> kept = s.early_step.settle(lr, overflow, clipped);
  s.record_grad_counts();
  s.early_step.next_lr = lr;

  if (overflow) {
    if (!s.cfg.fp16.enabled)
      // (The engine's count of updates is not the caller's step: it stops at a skipped one.)
      log::warn("the gradient norm is not finite: this step is skipped ({} update{} taken so far)",
                s.steps_taken, s.steps_taken == 1 ? "" : "s");
    s.zero_grads();
    s.rewind_trace();
    STRATA_REQUIRE(scale_left,
                   "fp16: the gradients overflowed at the least loss scale (fp16.min_loss_scale "
                   "{:g}), after {} update{}: every step from here on would be skipped; train "
                   "in bf16 (\"bf16\": {{\"enabled\": true}}), lower the learning rate, or "
                   "set a smaller fp16.min_loss_scale",
                   s.cfg.fp16.min_loss_scale, s.steps_taken, s.steps_taken == 1 ? "" : "s");
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

  OptimizerPass pass(s, opt, kept);
  pass.run();
  s.end_step();
  r.step = ++s.steps_taken;
  return r;
}

}  // namespace strata
