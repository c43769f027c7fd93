// The gradient reducer: grad_buffer / reduce_grad (bucketed reduce-scatter, then fp32
// accumulation on the gradient's tier: device, host, or NVMe keys read back and written
// behind). Part of the engine (engine_impl.h).
#include "scheduler/engine_impl.h"

namespace strata {

using detail::GradIo;
using detail::Unit;
using detail::wait_all;

void Engine::Impl::settle_grad_io(Unit& u) {
  std::exception_ptr err;
  for (const auto& io : std::exchange(u.g.io, {})) try {
      io->wait();
    } catch (...) {
      if (!err) err = std::current_exception();
    }
  if (err) std::rethrow_exception(err);
}

std::vector<IoHandle> Engine::Impl::read_grad(std::size_t ui, detail::Range r,
                                              const std::shared_ptr<PinnedBlock>& dst) {
  Unit& u = units[ui];
  std::vector<IoHandle> reads;
  if (u.g.fresh) {
    std::memset(dst->data(), 0, r.size * 4);
    return reads;
  }
  for (const detail::Range p : grad_pieces(r)) {
    reads.push_back(g_store->read(
        g_key(ui, p.first), static_cast<float*>(dst->data()) + (p.first - r.first), p.size * 4));
    reads.back().on_complete([dst](std::exception_ptr) {});
    st.nvme_read_bytes += p.size * 4;
  }
  return reads;
}

void Engine::Impl::reduce_to_nvme(std::size_t ui, detail::Range r, const TensorRef& part,
                                  bool first_bucket, Stream& cs) {
  Unit& u = units[ui];
  while (grad_out.size() >= detail::kGradBucketsInFlight) {
    const std::shared_ptr<GradIo> oldest = grad_out.front();
    grad_out.pop_front();
    std::optional<TraceScope> span;
    if (!oldest->queued.query())
      span.emplace("staging_wait", "engine");  // the host waits for staging
    oldest->wait();
  }
  if (first_bucket) settle_grad_io(u);  // the last gradient's writes of the keys read below
  const bool fresh = u.g.fresh;
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
        if (first_bucket) x.g.sumsq_run = cpu::SumSquares{};
        x.g.sumsq_run.add(v, r.size);
        x.g.sumsq = x.g.sumsq_run.result();
        if (tp_partial(ui)) {
          if (first_bucket) x.g.tp_sumsq_run = cpu::SumSquares{};
          for (const detail::Range c : tp_ranges[ui]) {
            const std::uint64_t a = std::max(c.first, r.first),
                                b = std::min(c.first + c.size, r.first + r.size);
            if (a < b) x.g.tp_sumsq_run.add(v + (a - r.first), b - a);
          }
          x.g.tp_sumsq = x.g.tp_sumsq_run.result();
        }
        for (const detail::Range p : grad_pieces(r)) {
          io->writes.push_back(
              g_store->write(g_key(ui, p.first), v + (p.first - r.first), p.size * 4));
          io->writes.back().on_complete([out](std::exception_ptr) {});
        }
      },
      "grad_to_nvme");
  io->queued = cs.record();
  u.g.io.push_back(io);
  grad_out.push_back(io);
  st.nvme_written_bytes += bytes;
}

TensorRef Engine::grad_buffer(int unit, Stream& compute, GradInit init) {
  Impl& s = *impl_;
  STRATA_REQUIRE(s.finalized, "Engine::grad_buffer before finalize()");
  STRATA_REQUIRE(!s.eval,
                 "Engine::grad_buffer while set_eval(true): a forward-only pass has no backward; "
                 "call set_eval(false) before training");
  Unit& u = s.unit_at(unit, "Engine::grad_buffer");
  STRATA_REQUIRE(!u.g.full, "Engine::grad_buffer('{}') twice without reduce_grad", u.name);
  // The unit gradients the plan counts: the host waits for the reduces (and the frees of their
  // gradients) beyond them. Running ahead of them, it would hold a gradient for every unit whose
  // backward it has queued.
  Impl::bound(s.reduces, detail::unit_grads_alive(s.cfg), "grad_wait", &s.st.grad_waits);
  u.g.full = s.alloc(u.padded * 4, &compute);
  // The padding is always zero: it is reduced, and its squares go into the gradient norm.
  const std::size_t from = init == GradInit::kOverwrite ? u.numel : 0;
  if (from < u.padded) compute.fill(Impl::view(u.g.full, DType::kF32, u.padded - from, from), 0.0f);
  return Impl::view(u.g.full, DType::kF32, u.numel);
}

void Engine::reduce_grad(int unit, Stream& compute) {
  Impl& s = *impl_;
  STRATA_REQUIRE(s.finalized, "Engine::reduce_grad before finalize()");
  Unit& u = s.unit_at(unit, "Engine::reduce_grad");
  STRATA_REQUIRE(static_cast<bool>(u.g.full), "Engine::reduce_grad('{}') without grad_buffer",
                 u.name);
  s.early_step.finish(std::size_t(unit), true);  // its last early job reads the accumulator
  Stream& cs = *s.comm_s;
  cs.wait(compute.record());
  const std::size_t ui = std::size_t(unit), n = u.shard;
  const bool first = s.grads_now[ui] == 0;
  // The step's only gradient of the unit (as recorded), arriving whole into a host
  // accumulator: its part of the norm from the same kernel on the device, beside the copy (a
  // GPU does it in microseconds; on the host it was a pass over the shard on the CPU the
  // optimizer needs). Bit for bit the host's: the same fp32 shard, the same kernel (step()
  // falls back to the host if more come) — so only where the whole reduced shard is on the
  // device at once (not when the reduce-scatter itself goes bucket by bucket).
  const std::size_t buckets = s.buckets(u);
  const bool bucketed = s.bucketed_reduce(u);
  const bool device_norm = detail::device_norm_takes(
      s.cfg, u.g_tier, first, !s.grads_recording && s.grads_recorded[ui] == 1, bucketed);
  // The whole reduced shard, when it is on the device at once. One rank: the gradient is its
  // own shard (an average over one rank is the value itself), so no second buffer and no copy;
  // the scratch is freed after the accumulation below.
  Buffer full;
  if (s.world == 1) {
    full = std::move(u.g.full);
  } else if (!bucketed) {
    full = s.alloc(n * 4, &cs);
    s.comm.reduce_scatter(Impl::view(u.g.full, DType::kF32, u.padded),
                          Impl::view(full, DType::kF32, n), ReduceOp::kAvg, cs);
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
        cs.copy(bucket.ref(std::size_t(q) * len * 4, len * 4),
                u.g.full.ref((std::size_t(q) * n + a) * 4, len * 4));
      s.comm.reduce_scatter(Impl::view(bucket, DType::kF32, std::size_t(s.world) * len), part,
                            ReduceOp::kAvg, cs);
      bucket.reset_on(cs);
      ++s.st.reduce_scatters;
    } else {
      part = Impl::view(full, DType::kF32, len, a);
    }
    switch (detail::grad_path(u.g_tier, first)) {
      case detail::GradPath::kDeviceAdd: {
        const TensorRef acc = Impl::view(u.g.dev, DType::kF32, len, a);
        cs.add(acc, part, acc);
        break;
      }
      case detail::GradPath::kNvme:
        s.reduce_to_nvme(ui, r, part, b == 0, cs);
        break;
      case detail::GradPath::kStraightCopy:
        // The step's first gradient of the unit goes straight into its accumulator: no staging
        // and no host pass (what it holds from the last step is overwritten, not added to; bitwise
        // the same as 0 + g for the optimizer, which never sees the sign of a zero gradient).
        cs.copy(host_ref(static_cast<float*>(u.g.host->data()) + a, len * 4), part.mem);
        s.st.d2h_bytes += len * 4;
        break;
      case detail::GradPath::kStagedAdd: {
        Impl::bound(s.grad_staging, detail::kGradBucketsInFlight);
        auto staging = s.pinned(len * 4);
        cs.copy(host_ref(staging->data(), len * 4), part.mem);
        s.st.d2h_bytes += len * 4;
        float* acc = static_cast<float*>(u.g.host->data()) + a;
        cs.host_fn(
            [staging, acc, len] {
              const float* g = static_cast<const float*>(staging->data());
              for (std::size_t i = 0; i < len; ++i) acc[i] += g[i];
            },
            "grad_accumulate");
        s.grad_staging.push_back(cs.record());
        break;
      }
    }
    if (device_norm && b + 1 == buckets) {
      Buffer sq = s.alloc(4, &cs);
      cs.sum_squares(Impl::view(full, DType::kF32, n), Impl::view(sq, DType::kF32, 1));
      cs.copy(host_ref(static_cast<float*>(s.norm_host->data()) + unit, 4), sq.ref());
      sq.reset_on(cs);
      std::lock_guard<std::mutex> lk(s.early_step.mu);
      u.g.dev_sumsq_call = s.early_step.step_calls;
    }
    if (out) out.reset_on(cs);  // its last use: the accumulation above
    ++s.st.grad_buckets;
  }
  if (s.world > 1) u.g.full.reset_on(cs);  // its last use: the reduce-scatters
  if (full) full.reset_on(cs);             // its last use: the accumulation above
  u.g.fresh = false;
  s.early_step.note_grad(std::size_t(unit), cs);
  s.reduces.push_back(cs.record());
}

}  // namespace strata
