// strata-prof: measure the machine and the model, predict the step time of every placement,
// recommend the fastest that fits, and check the prediction by running the best few.
//
//   measure   pinned H2D / D2H, device and host memory passes, NVMe write and read through the
//             engine's own swap store, CPU and device AdamW, collectives (more than one rank),
//             and the model's per-unit forward / backward time and activation bytes from real
//             micro-batches of a 1- and a 2-layer copy of it (every layer of a model costs
//             the same; the embedding and the head are measured on their own).
//   predict   src/scheduler/perf_model.cpp replays the engine's step on those rates.
//   search    placements x live window x micro-batch x checkpointing, filtered by the memory
//             planner; the best few printed, the best written as a ds_config.json.
//   validate  (--validate K) the top K run through strata::train for a few steps; predicted vs
//             measured step time, and the Chrome trace of the best.
//   picture   an SVG with the best candidate's step per resource lane (predicted, and measured
//             when validated) and the bytes per tier of the top candidates.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <cstring>
#include <sstream>
#include <utility>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "strata/adamw.h"
#include "strata/comm.h"
#include "strata/device.h"
#include "strata/engine.h"
#include "strata/engine_config.h"
#include "strata/error.h"
#include "strata/json_config.h"
#include "strata/kernels.h"
#include "strata/log.h"
#include "strata/model.h"
#include "strata/nvme.h"
#include "strata/perf_model.h"
#include "strata/pinned_pool.h"
#include "strata/system_info.h"
#include "strata/trace.h"
#include "strata/trainer.h"
#include "tool_main.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string human(double b) { return log::human_bytes(b); }

struct Args {
  std::string model_dir, model_config, ds_config, aio_file;
  std::vector<std::string> data_files;
  std::string text_file;
  std::int64_t seq_len = 0, micro_batch = 0, grad_accum = 0;  // 0: --config's, else 1
  std::vector<std::int64_t> micro_batches;  // empty: B/2, B, 2B
  std::string dtype;  // "": --config's, else fp32
  std::string device = "auto";
  double device_mem_gb = 0, host_mem_gb = 0;
  double emu_h2d = 0, emu_d2h = 0, emu_gflops = 0;
  std::string nvme_path;
  bool no_nvme = false;
  int top = 5;
  int validate = 0;
  int validate_steps = 4;
  std::string out = "strata-prof.ds_config.json";
  std::string svg = "strata-prof.svg";
  std::string trace;  // with --validate: default strata-prof.trace.json
  bool overwrite = false;
  // Which of --out, --svg, --trace the user named: the default files (strata-prof.*) are the
  // tool's own and replaced without --overwrite, as a re-run in the same folder expects.
  bool out_named = false, svg_named = false, trace_named = false;
  bool json = false;
  // Set in main: the --config as the user wrote it (plus the flags), before this machine's
  // defaults; and whether the host budget came from the user.
  EngineConfig user_config;
  std::string user_text;  // the --config as written (written_json puts its own keys back)
  bool host_budget_given = false;
};

// ---- measuring the machine ----
template <class F>
double best_of(int reps, F f) {
  double best = 1e300;
  for (int i = 0; i < reps; ++i) best = std::min(best, f());
  return best;
}

// Several ranks: every rank searches with the same figures, the slowest rank's (the lowest rate,
// the longest time, the smallest capacity: a data-parallel step waits for its slowest rank),
// so all of them rank the candidates alike and validate the same ones. One all-reduce (max)
// of the figures, rates and capacities negated.
void agree_across_ranks(Communicator& comm, MachineProfile& m, std::vector<ModelProfile>& models) {
  if (comm.world_size() <= 1) return;
  std::vector<double*> lowest = {&m.h2d_bps, &m.d2h_bps, &m.device_mem_bps, &m.free_bps, &m.host_mem_bps,
                                 &m.host_norm_bps, &m.nvme_read_bps, &m.nvme_write_bps, &m.nvme_mixed_bps,
                                 &m.nvme_fetch_read_bps, &m.cpu_adamw_params_per_s, &m.device_adamw_params_per_s,
                                 &m.all_gather_bps, &m.reduce_scatter_bps};
  std::vector<std::uint64_t*> lowest_bytes = {&m.device_capacity, &m.host_capacity, &m.nvme_free, &m.ram_capacity};
  std::vector<double*> highest = {&m.nvme_request_s};
  std::vector<std::uint64_t*> highest_bytes = {&m.ram_base_bytes};
  for (ModelProfile& mp : models) {
    for (UnitCost& u : mp.units) {
      highest.push_back(&u.forward_s);
      highest.push_back(&u.backward_s);
    }
    highest_bytes.push_back(&mp.activation_bytes);
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

// NVMe is measured under `nvme_dir`; the free space is that of every path the search may use
// (`all_nvme_paths`: a file system counted once).
// (`nvme_key`: what gave the path, named in its errors: "--nvme-path", or the --config's key)
MachineProfile measure_machine(Device& dev, Communicator& comm, const EngineConfig& base,
                               const std::string& nvme_dir, const std::vector<std::string>& all_nvme_paths,
                               const std::string& nvme_key, bool use_nvme, std::size_t unit_state_bytes,
                               std::size_t unit_weight_bytes) {
  const std::uint64_t rss_before = cpu::process_rss_bytes();
  MachineProfile m;
  m.world_size = comm.world_size();
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
  // The rates the host's cores set (copies, memory passes, AdamW): measured twice, a second
  // or so apart (the NVMe runs between), and the better of each kept: on a shared machine a
  // burst of someone else's work can slow one best-of-3 as a whole.
  auto measure_rates = [&](MachineProfile& m) {
    const double h2d = best_of(3, [&] {
      const auto t0 = Clock::now();
      s->copy(d.ref(), host_ref(host.data(), bytes));
      s->synchronize();
      return since(t0);
    });
    const double d2h = best_of(3, [&] {
      const auto t0 = Clock::now();
      s->copy(host_ref(host.data(), bytes), d.ref());
      s->synchronize();
      return since(t0);
    });
    m.h2d_bps = double(bytes) / h2d;
    m.d2h_bps = double(bytes) / d2h;
    const double fill = best_of(3, [&] {
      const auto t0 = Clock::now();
      s->fill(tensor(d, DType::kF32, bytes / 4), 0.0f);
      s->synchronize();
      return since(t0);
    });
    m.device_mem_bps = double(bytes) / fill;
    // What a free costs on its stream (the emulated device poisons freed memory).
    const double fr = best_of(3, [&] {
      Buffer t = dev.alloc(bytes, s.get());
      s->synchronize();
      const auto t0 = Clock::now();
      t.reset();
      s->synchronize();
      return since(t0);
    });
    m.free_bps = fr > 0 ? double(bytes) / fr : 0;
    std::vector<char> h1(bytes), h2(bytes, 2);
    const double cp = best_of(3, [&] {
      const auto t0 = Clock::now();
      std::memcpy(h1.data(), h2.data(), bytes);
      return since(t0);
    });
    m.host_mem_bps = 2.0 * double(bytes) / cp;
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

    // AdamW: 8M parameters, the compute dtype's copy-out, on the CPU and on the device.
    {
      const std::size_t n = std::size_t(8) << 20;
      const DType ct = base.compute_dtype;
      std::vector<float> p(n, 0.5f), g(n, 1e-3f), mm(n, 0.0f), v(n, 0.0f);
      std::vector<std::uint16_t> out16(n);
      // The path the engine will run (strata.optimizer_isa).
      STRATA_REQUIRE(isa_supported(base.optimizer_isa),
                     "config key 'strata.optimizer_isa' = \"{}\": {}; use \"auto\"",
                     isa_name(base.optimizer_isa), isa_unavailable(base.optimizer_isa));
      CpuAdamW adam({.isa = base.optimizer_isa});
      AdamWOptions o;
      AdamWShard sh{host_tensor(p.data(), DType::kF32, n), host_tensor(g.data(), DType::kF32, n),
                    host_tensor(mm.data(), DType::kF32, n), host_tensor(v.data(), DType::kF32, n), {}};
      if (ct != DType::kF32) sh.copy_out = host_tensor(out16.data(), ct, n);
      adam.step(o, sh);
      const double t = best_of(3, [&] {
        const auto t0 = Clock::now();
        adam.step(o, sh);
        return since(t0);
      });
      m.cpu_adamw_params_per_s = double(n) / t;
      Buffer dp = dev.alloc(n * 4), dg = dev.alloc(n * 4), dm = dev.alloc(n * 4), dv = dev.alloc(n * 4);
      Buffer dout = dev.alloc(n * 2);
      for (Buffer* b : {&dp, &dg, &dm, &dv}) s->fill(tensor(*b, DType::kF32, n), 0.01f);
      AdamWDesc desc;
      desc.options = o;
      desc.policy = NonFinitePolicy::kReportOnly;
      desc.shards.push_back({tensor(dp, DType::kF32, n), tensor(dg, DType::kF32, n), tensor(dm, DType::kF32, n),
                             tensor(dv, DType::kF32, n), ct != DType::kF32 ? tensor(dout, ct, n) : TensorRef{}});
      s->adamw(desc);
      s->synchronize();
      const double td = best_of(3, [&] {
        const auto t0 = Clock::now();
        s->adamw(desc);
        s->synchronize();
        return since(t0);
      });
      m.device_adamw_params_per_s = double(n) / td;
    }
  };
  measure_rates(m);

  // NVMe: the engine's swap store, as the engine drives it: extents of one unit's optimizer
  // state, two in flight (the optimizer reads one ahead; a fetch reads the next unit while
  // the current one is in use). A drive reaches its sequential rate only with many requests
  // in flight; the engine rarely has them, and the model must see the rate it gets.
  if (use_nvme) {
    SwapStoreOptions so;
    so.paths = {nvme_dir};
    so.rank = comm.rank();
    so.world_size = comm.world_size();
    so.aio = base.aio;
    so.config_key = nvme_key;
    SwapStore store(so);
    const std::size_t extent =
        SwapStore::padded_bytes(std::clamp<std::size_t>(unit_state_bytes, std::size_t(1) << 20, std::size_t(16) << 20));
    const std::size_t count = std::max<std::size_t>(8, (std::size_t(128) << 20) / extent), depth = 2;
    std::vector<PinnedBlock> bufs;
    for (std::size_t i = 0; i < 4; ++i) {
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
        hs.push_back(write ? store.write(fmt::format("x{}", i), b, extent) : store.read(fmt::format("x{}", i), b, extent));
      }
      for (auto& h : hs) h.wait();
      return since(t0);
    };
    run(true);  // allocate the extents on disk
    const double w = best_of(2, [&] { return run(true); });
    const double r = best_of(2, [&] { return run(false); });
    m.nvme_write_bps = double(extent * count) / w;
    m.nvme_read_bps = double(extent * count) / r;
    // Half the extents read while the other half are written, as the optimizer streams.
    const double mixed = best_of(2, [&] {
      const auto t0 = Clock::now();
      std::deque<IoHandle> hs;
      for (std::size_t i = 0; i < count; ++i) {
        if (hs.size() >= 2 * depth) {  // a read ahead and a write behind, each `depth` deep
          hs.front().wait();
          hs.pop_front();
        }
        void* b = bufs[i % bufs.size()].data();
        const std::string key = fmt::format("x{}", i);
        hs.push_back(i % 2 ? store.write(key, b, extent) : store.read(key, b, extent));
      }
      for (auto& h : hs) h.wait();
      return since(t0);
    });
    m.nvme_mixed_bps = double(extent * count) / mixed;
    // One read at a time, of a big extent and of a small one: the line through both is a read's
    // fixed time (the drive's latency, the engine's per-request work) plus its bytes. The
    // optimizer waits for each sub-group's read, issued one ahead, so with small sub-groups that
    // fixed time is what their step pays; a noisy pair that gives no such line leaves it 0.
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
    {
      const std::size_t small = 64 << 10, reads = 16;
      auto one_at_a_time = [&](std::size_t bytes) {
        const std::string prefix = written_keys("s", bytes, reads);
        return best_of(2, [&] {
                 const auto t0 = Clock::now();
                 for (std::size_t i = 0; i < reads; ++i)
                   store.read(fmt::format("{}{}", prefix, i % count), bufs[0].data(), bytes).wait();
                 return since(t0);
               }) /
               double(reads);
      };
      const double big = one_at_a_time(extent), little = one_at_a_time(small);
      m.nvme_request_s = 0;
      if (small < extent && little < big) m.nvme_request_s = std::max(0.0, little - double(small) * (big - little) / double(extent - small));
    }
    // A fetch reads one unit's weight shard and the fetch stream waits for it before its copy:
    // one read of that size at a time (the next is issued as the prefetch window moves).
    const std::size_t w_extent = SwapStore::padded_bytes(std::clamp<std::size_t>(unit_weight_bytes, 4096, extent));
    const std::size_t w_count = std::max<std::size_t>(8, (std::size_t(64) << 20) / w_extent);
    const std::string w_prefix = written_keys("w", w_extent, count);
    const double fetch = best_of(2, [&] {
      const auto t0 = Clock::now();
      for (std::size_t i = 0; i < w_count; ++i)
        store.read(fmt::format("{}{}", w_prefix, i % count), bufs[0].data(), w_extent).wait();
      return since(t0);
    });
    m.nvme_fetch_read_bps = double(w_extent * w_count) / fetch;
    // The engine's own rule: this rank's share of the drive's free space (its files counted free).
    m.nvme_free = SwapStore::free_bytes(all_nvme_paths, comm.rank(), nvme_key, ranks_on_this_node(comm),
                                        comm.world_size());
  }

  {
    MachineProfile again = m;
    measure_rates(again);
    for (double MachineProfile::*f : {&MachineProfile::h2d_bps, &MachineProfile::d2h_bps, &MachineProfile::device_mem_bps,
                                      &MachineProfile::free_bps, &MachineProfile::host_mem_bps,
                                      &MachineProfile::host_norm_bps, &MachineProfile::cpu_adamw_params_per_s,
                                      &MachineProfile::device_adamw_params_per_s})
      m.*f = std::max(m.*f, again.*f);
  }

  // Collectives over the full buffer.
  if (m.world_size > 1) {
    // A whole shard per rank whatever the world size (3 ranks do not divide 2^24 elements).
    const std::size_t shard = bytes / 4 / std::size_t(m.world_size), n = shard * std::size_t(m.world_size);
    Buffer full = dev.alloc(n * 4), part = dev.alloc(shard * 4);
    comm.all_gather(tensor(full, DType::kF32, shard, shard * std::size_t(comm.rank())), tensor(full, DType::kF32, n), *s);
    s->synchronize();
    const double ag = best_of(3, [&] {
      const auto t0 = Clock::now();
      comm.all_gather(tensor(full, DType::kF32, shard, shard * std::size_t(comm.rank())), tensor(full, DType::kF32, n),
                      *s);
      s->synchronize();
      return since(t0);
    });
    const double rs = best_of(3, [&] {
      const auto t0 = Clock::now();
      comm.reduce_scatter(tensor(full, DType::kF32, n), tensor(part, DType::kF32, shard), ReduceOp::kAvg, *s);
      s->synchronize();
      return since(t0);
    });
    m.all_gather_bps = double(bytes) / ag;
    m.reduce_scatter_bps = double(bytes) / rs;
  }
  m.device_capacity = dev.stats().capacity_bytes;
  m.host_capacity = base.host_budget_bytes;
  // Host RAM as strata-train will plan it (set_host_ram_inputs), its base the resident memory
  // before the measurements above took theirs.
  PlanInputs ram;
  set_host_ram_inputs(ram, dev, m.ranks_on_node);
  m.ram_base_bytes = std::min<std::uint64_t>(ram.ram_base_bytes, rss_before);
  m.ram_capacity = ram.ram_capacity == 0 ? 0 : ram.ram_capacity - ram.ram_base_bytes + m.ram_base_bytes;
  m.device_in_ram = ram.device_in_ram;
  return m;
}

// ---- measuring the model ----
// Wraps the resident weights and stamps the stream's clock each time the model takes a unit's
// weights (and unit 0's gradient, where the embedding's backward begins).
class StampingWeights final : public UnitProvider {
 public:
  StampingWeights(ResidentWeights& inner, Stream& s) : inner_(inner), s_(s) {}
  struct Stamp {
    bool grads;
    std::size_t unit;
    Clock::time_point t;
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
    s_.host_fn(
        [this, grads, unit] {
          std::lock_guard lock(mu_);
          stamps_.push_back({grads, unit, Clock::now()});
        },
        "prof_stamp");
  }
  ResidentWeights& inner_;
  Stream& s_;
  std::mutex mu_;
  std::vector<Stamp> stamps_;
};

struct LayerTiming {
  double embed_f = 0, embed_b = 0, layer_f = 0, layer_b = 0, head_f = 0;
  std::uint64_t activation_bytes = 0;
};

// Runs a copy of `base` with `layers` layers for a few micro-batches; per-unit times (median
// over the repetitions) and the device bytes beyond the weights at the peak.
LayerTiming time_layers(const ModelConfig& base, int layers, std::int64_t B, std::int64_t T, bool ckpt, bool ckpt_host,
                        DType dt,
                        const std::string& device, const HostDeviceOptions& hopt, const CudaDeviceOptions& copt) {
  ModelConfig cfg = base;
  cfg.num_layers = layers;
  auto dev = make_device(device, hopt, copt);
  auto s = dev->create_stream("compute");
  ModelOptions mo;
  mo.micro_batch = B;
  mo.seq_len = T;
  mo.compute = dt;
  mo.checkpoint = ckpt;
  mo.checkpoint_on_host = ckpt && ckpt_host;
  Model model(cfg, *dev, *s, mo);
  ResidentWeights rw(model, *s);
  rw.init_random(1);
  s->synchronize();
  StampingWeights sw(rw, *s);
  std::mt19937_64 rng(7);
  Batch b;
  for (std::int64_t i = 0; i < B * T; ++i) {
    b.tokens.push_back(std::int32_t(rng() % std::uint64_t(cfg.vocab_size)));
    b.targets.push_back(std::int32_t(rng() % std::uint64_t(cfg.vocab_size)));
  }
  const std::size_t base_bytes = dev->stats().bytes_in_use;
  std::vector<LayerTiming> reps;
  const int kReps = 7;  // the median of 7: short layers on a shared machine are noisy
  for (int r = 0; r <= kReps; ++r) {
    model.forward(b, sw);
    sw.mark_end();
    model.backward(sw);
    sw.mark_end();
    const auto st = sw.take();
    if (r == 0) continue;  // warm-up
    // forward: w0 w1 .. wL whead (w0 again when tied) end | backward: wL .. w1 g0 end
    const std::size_t L = std::size_t(layers), head = L + 1;
    std::map<std::size_t, Clock::time_point> fw, bw;
    Clock::time_point f_end{}, g0{}, b_end{};
    int phase = 0;
    for (const auto& x : st) {
      if (x.unit == SIZE_MAX) {
        (phase++ == 0 ? f_end : b_end) = x.t;
      } else if (!x.grads) {
        (phase == 0 ? fw : bw).emplace(x.unit, x.t);
      } else if (phase == 1 && x.unit == 0) {
        g0 = x.t;
      }
    }
    STRATA_CHECK(fw.size() == head + 1 && bw.size() == L && phase == 2, "strata-prof: unexpected unit order from the model");
    auto d = [](Clock::time_point a0, Clock::time_point b2) { return std::chrono::duration<double>(b2 - a0).count(); };
    LayerTiming t;
    t.embed_f = d(fw[0], fw[1]);
    double lf = 0, lb = 0;
    for (std::size_t l = 1; l <= L; ++l) lf += d(fw[l], fw[l + 1]);
    t.layer_f = lf / double(L);
    t.head_f = d(fw[head], f_end);
    for (std::size_t l = L; l >= 1; --l) lb += d(bw[l], l > 1 ? bw[l - 1] : g0);
    t.layer_b = lb / double(L);
    t.embed_b = d(g0, b_end);
    reps.push_back(t);
  }
  auto median = [&](double LayerTiming::*f) {
    std::vector<double> v;
    for (auto& r : reps) v.push_back(r.*f);
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  LayerTiming out;
  for (auto f : {&LayerTiming::embed_f, &LayerTiming::embed_b, &LayerTiming::layer_f, &LayerTiming::layer_b,
                 &LayerTiming::head_f})
    out.*f = median(f);
  const std::size_t peak = dev->stats().peak_bytes_in_use;
  out.activation_bytes = peak > base_bytes ? peak - base_bytes : 0;
  return out;
}

ModelProfile profile_model(const ModelConfig& mcfg, std::int64_t B, std::int64_t T, bool ckpt, bool ckpt_host, DType dt,
                           const std::string& device, const HostDeviceOptions& hopt, const CudaDeviceOptions& copt) {
  const LayerTiming one = time_layers(mcfg, 1, B, T, ckpt, ckpt_host, dt, device, hopt, copt);
  const LayerTiming two = time_layers(mcfg, 2, B, T, ckpt, ckpt_host, dt, device, hopt, copt);
  ModelProfile mp;
  mp.micro_batch = B;
  mp.seq_len = T;
  mp.checkpoint = ckpt;
  mp.checkpoint_on_host = ckpt && ckpt_host;
  const auto units = model_units(mcfg);
  const std::size_t head = units.size() - 1;
  for (std::size_t i = 0; i < units.size(); ++i) {
    UnitCost c;
    c.name = units[i].name;
    c.numel = units[i].numel;
    if (i == 0) {
      c.forward_s = two.embed_f;
      c.backward_s = two.embed_b;
    } else if (i == head) {
      c.forward_s = two.head_f;
    } else {
      c.forward_s = two.layer_f;
      c.backward_s = two.layer_b;
    }
    mp.units.push_back(c);
  }
  const double per_layer = double(two.activation_bytes) - double(one.activation_bytes);
  mp.activation_bytes =
      std::uint64_t(std::max(0.0, double(one.activation_bytes) + double(mcfg.num_layers - 1) * std::max(0.0, per_layer)));
  return mp;
}

// ---- the trace of a measured step, per resource lane ----
Resource lane_of(const TraceSpan& sp) {
  if (sp.name == "wait_event" || sp.name == "free" || sp.name == "prof_stamp") return Resource::kCount;
  if (sp.name == "copy_h2d") return Resource::kH2D;
  if (sp.name == "copy_d2h") return Resource::kD2H;
  if (sp.lane.starts_with("nvme")) return Resource::kNvme;
  if (sp.name == "cpu_adamw" || sp.name == "grad_accumulate") return Resource::kCpu;
  if (sp.lane == "compute" || (sp.lane == "optimizer" && sp.name == "adamw")) return Resource::kCompute;
  if (sp.name.starts_with("all_gather") || sp.name.starts_with("reduce_scatter") || sp.name.starts_with("all_reduce"))
    return Resource::kComm;
  return Resource::kCount;
}

std::vector<Interval> measured_schedule(const std::vector<TraceSpan>& spans) {
  std::vector<Interval> out;
  std::int64_t t0 = INT64_MAX;
  for (const auto& sp : spans) t0 = std::min(t0, sp.start_ns);
  for (const auto& sp : spans) {
    const Resource r = lane_of(sp);
    if (r == Resource::kCount || sp.end_ns <= sp.start_ns) continue;
    out.push_back({r, double(sp.start_ns - t0) / 1e9, double(sp.end_ns - t0) / 1e9, sp.name, sp.lane, sp.bytes});
  }
  return out;
}

// ---- the picture ----
std::string svg_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '<') o += "&lt;";
    else if (c == '>') o += "&gt;";
    else if (c == '&') o += "&amp;";
    else o += c;
  }
  return o;
}

void write_svg(const std::string& path, const Candidate& best, const std::vector<Interval>* measured,
               double measured_step_s, const std::vector<Candidate>& top) {
  const char* colors[] = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948"};
  const int lanes = int(Resource::kCount);
  const double width = 1000, left = 90, lane_h = 22;
  std::string body;
  double y = 30;
  // One time scale for both timelines, so the predicted and the measured step compare by eye.
  const double span_s = std::max(best.prediction.step_s, measured ? measured_step_s : 0.0);
  auto timeline = [&](const std::vector<Interval>& sched, double step_s, const std::string& title) {
    body += fmt::format("<text x='10' y='{}' font-weight='bold'>{}</text>\n", y, svg_escape(title));
    y += 10;
    const double scale = (width - left - 20) / std::max(span_s, 1e-9);
    for (int r = 0; r < lanes; ++r) {
      const double ly = y + r * lane_h;
      body += fmt::format("<text x='10' y='{}'>{}</text>\n", ly + 15, resource_name(Resource(r)));
      body += fmt::format("<rect x='{}' y='{}' width='{}' height='{}' fill='#f4f4f4'/>\n", left, ly + 2,
                          width - left - 20, lane_h - 4);
    }
    for (const auto& iv : sched) {
      const double ly = y + int(iv.lane) * lane_h;
      const double x = left + iv.start_s * scale, w = std::max(0.5, (iv.end_s - iv.start_s) * scale);
      body += fmt::format("<rect x='{:.1f}' y='{}' width='{:.1f}' height='{}' fill='{}'><title>{} {:.2f}-{:.2f} ms</title></rect>\n",
                          x, ly + 2, w, lane_h - 4, colors[int(iv.lane)], svg_escape(iv.what), iv.start_s * 1e3,
                          iv.end_s * 1e3);
    }
    y += lanes * lane_h;
    body += fmt::format("<text x='{}' y='{}'>0</text><text x='{:.1f}' y='{}' text-anchor='end'>{:.1f} ms</text>\n", left,
                        y + 14, left + step_s * scale, y + 14, step_s * 1e3);
    y += 36;
  };
  timeline(best.prediction.schedule, best.prediction.step_s,
           fmt::format("predicted step: {} ({:.1f} ms)", best.label, best.prediction.step_s * 1e3));
  if (measured)
    timeline(*measured, measured_step_s, fmt::format("measured step (trace of the same configuration, {:.1f} ms)",
                                                     measured_step_s * 1e3));
  // bytes per tier of the top candidates
  body += fmt::format("<text x='10' y='{}' font-weight='bold'>bytes per tier (planner), top candidates</text>\n", y);
  y += 12;
  double maxb = 1;
  for (const auto& c : top) maxb = std::max({maxb, double(c.plan.device_bytes), double(c.plan.host_bytes), double(c.plan.nvme_bytes)});
  const char* tier_names[] = {"device", "host", "nvme"};
  for (std::size_t i = 0; i < top.size(); ++i) {
    const Candidate& c = top[i];
    const double vals[] = {double(c.plan.device_bytes), double(c.plan.host_bytes), double(c.plan.nvme_bytes)};
    body += fmt::format("<text x='10' y='{}'>#{} {}</text>\n", y + 12, i + 1, svg_escape(c.label));
    y += 16;
    for (int t = 0; t < 3; ++t) {
      const double w = vals[t] / maxb * (width - left - 160);
      body += fmt::format("<text x='20' y='{}'>{}</text><rect x='{}' y='{}' width='{:.1f}' height='12' fill='{}'/>"
                          "<text x='{:.1f}' y='{}'>{}</text>\n",
                          y + 11, tier_names[t], left, y + 1, w, colors[t], left + w + 6, y + 11, human(vals[t]));
      y += 15;
    }
    y += 6;
  }
  std::ofstream f(path, std::ios::trunc);
  f << fmt::format("<svg xmlns='http://www.w3.org/2000/svg' width='{}' height='{}' font-family='sans-serif' "
                   "font-size='12'>\n<rect width='100%' height='100%' fill='white'/>\n",
                   width, y + 10)
    << body << "</svg>\n";
  STRATA_REQUIRE(f.good(), "--svg {}: cannot be written", path);
}

// ---- validation ----
struct Measured {
  double step_s = 0;
  std::vector<double> steps;
};

// The demo's model config, written beside --out for the printed command: best.json ->
// best.model.json.
std::string demo_model_file(const std::string& out) { return fs::path(out).replace_extension(".model.json").string(); }

// The configuration written for a candidate: what the search decided, and otherwise the user's
// own keys — not this machine's defaults (the host budget of 80% of its RAM over its ranks, the
// emulated device's early-step and norm settings), which strata-train works out again where it
// runs (a config carried to a GPU or to more ranks must not take them along).
EngineConfig written_config(const EngineConfig& chosen, const EngineConfig& user, bool host_budget_given) {
  EngineConfig w = chosen;
  if (!host_budget_given) w.host_budget_bytes = 0;
  w.overlap_optimizer = user.overlap_optimizer;
  w.device_grad_norm = user.device_grad_norm;
  return w;
}

// The recommendation as written to --out: `chosen`'s settings, with the --config's own keys that
// strata's full config would lose put back as the user wrote them — Hugging Face's "auto"
// placeholders, keys strata does not use, defaults written out — wherever that leaves the
// configuration the same (each tried, parsed and compared): a key of the user's that only says
// what strata does anyway, and does not change what was decided.
std::string written_json(const EngineConfig& chosen, const std::string& user_text, int world) {
  const std::string plain = engine_config_json(chosen);
  if (user_text.empty()) return plain;
  // The trial parses warn of the user's unused keys and "auto"s: said once already, when read.
  const log::Quiet quiet(log::Level::kOff);
  auto meaning = [&](const config::Json& j) -> std::string {
    try {
      return engine_config_json(parse_engine_config(j.dump(), world));
    } catch (const Error&) {
      return {};
    }
  };
  config::Json out = config::Json::parse(plain);
  const config::Json user = config::parse(user_text, "--config");
  const std::string decided = meaning(out), users = meaning(user);
  if (decided.empty() || users.empty()) return plain;
  // The user's values, each a leaf where `out` has no object at that place.
  using Ptr = config::Json::json_pointer;
  std::vector<Ptr> leaves;
  const auto collect = [&](const auto& self, const config::Json& at, const Ptr& where) -> void {
    for (auto it = at.begin(); it != at.end(); ++it) {
      const Ptr p = where / it.key();
      if (it->is_object() && out.contains(p) && out[p].is_object()) self(self, *it, p);
      else leaves.push_back(p);
    }
  };
  if (user.is_object()) collect(collect, user, Ptr());
  for (const Ptr& p : leaves) {
    const config::Json& v = user[p];
    const bool missing = !out.contains(p), placeholder = v.is_string() && v == "auto" && !missing && out[p] != v;
    if (!missing && !placeholder) continue;
    try {
      config::Json without = user;  // inert in the user's own config: removing it changes nothing there
      without[p.parent_pointer()].erase(p.back());
      if (meaning(without) != users) continue;
      config::Json trial = out;  // ... and it changes nothing in the recommendation
      trial[p] = v;
      if (meaning(trial) == decided) out = std::move(trial);
    } catch (const nlohmann::json::exception&) {  // (a place `out` holds a value, not an object, above it)
    }
  }
  return out.dump(2) + "\n";
}

Measured run_candidate(const Args& a, const Candidate& c, const std::string& work, const std::string& data_file,
                       const std::string& trace_file, int index) {
  const std::string cfg_path = (fs::path(work) / fmt::format("candidate{}.json", index)).string();
  {
    // No schedule: a step's time does not depend on its lr, and a schedule the --config sizes for
    // the whole run ("auto" total steps, a long warmup) may not fit the few steps measured here.
    EngineConfig w = written_config(c.config, a.user_config, a.host_budget_given);
    w.scheduler = LrScheduleConfig{};
    std::ofstream f(cfg_path, std::ios::trunc);
    f << engine_config_json(w);
  }
  TrainOptions o;
  o.model_dir = a.model_dir;
  o.model_config = a.model_config;
  if (a.model_dir.empty() && a.model_config.empty()) {
    // The demo model, from its config: train() then needs no demo data.
    const std::string mc = (fs::path(work) / "model_config.json").string();
    std::ofstream f(mc, std::ios::trunc);
    f << model_config_json(demo_model_config());
    o.model_config = mc;
  }
  if (!a.data_files.empty()) o.data_files = a.data_files;
  else if (!a.text_file.empty()) o.text_file = a.text_file;
  else o.data_files = {data_file};
  if (a.data_files.empty() && a.text_file.empty()) o.data_format = "u32";
  o.ds_config = cfg_path;
  o.seq_len = a.seq_len;
  o.micro_batch = c.micro_batch;
  o.grad_accum = a.grad_accum;
  o.steps = a.validate_steps;
  o.dtype = a.dtype;
  o.device = a.device;
  o.device_mem_gb = a.device_mem_gb;
  o.emu_h2d_gbps = a.emu_h2d;
  o.emu_d2h_gbps = a.emu_d2h;
  o.emu_compute_gflops = a.emu_gflops;
  o.checkpoint_activations = c.checkpoint;
  o.checkpoint_on_host = c.checkpoint_on_host;
  o.trace_file = trace_file;
  o.trace_step = a.validate_steps;
  std::FILE* null = std::fopen("/dev/null", "w");
  o.console = null;
  TrainResult r;
  try {
    r = train(o);
  } catch (...) {
    std::fclose(null);
    throw;
  }
  std::fclose(null);
  Measured m;
  for (std::size_t i = 1; i < r.steps.size(); ++i) m.steps.push_back(r.steps[i].step_s);  // step 1 records the order
  std::vector<double> v = m.steps;
  std::sort(v.begin(), v.end());
  m.step_s = v.empty() ? 0 : v[v.size() / 2];
  return m;
}

void print_machine(const MachineProfile& m, const std::string& dev_name) {
  auto g = [](double bps) { return bps > 0 ? fmt::format("{:.2f} GB/s", bps / 1e9) : std::string("-"); };
  std::printf("machine (%s, %d rank%s):\n", dev_name.c_str(), m.world_size, m.world_size == 1 ? "" : "s");
  std::printf("  h2d %s  d2h %s  device memory %s  device free %s  host memory %s\n", g(m.h2d_bps).c_str(),
              g(m.d2h_bps).c_str(), g(m.device_mem_bps).c_str(), g(m.free_bps).c_str(), g(m.host_mem_bps).c_str());
  std::printf("  nvme write %s  read %s  both at once %s  a unit's weights at a time %s  a read's fixed time %.3f ms"
              "  (%s free)\n",
              g(m.nvme_write_bps).c_str(), g(m.nvme_read_bps).c_str(), g(m.nvme_mixed_bps).c_str(),
              g(m.nvme_fetch_read_bps).c_str(), m.nvme_request_s * 1e3,
              m.nvme_free ? human(double(m.nvme_free)).c_str() : "-");
  std::printf("  AdamW cpu %.0f M params/s  device %.0f M params/s  gradient norm (host) %s\n",
              m.cpu_adamw_params_per_s / 1e6, m.device_adamw_params_per_s / 1e6, g(m.host_norm_bps).c_str());
  if (m.world_size > 1)
    std::printf("  all-gather %s  reduce-scatter %s\n", g(m.all_gather_bps).c_str(), g(m.reduce_scatter_bps).c_str());
  std::printf("  capacity: device %s, host (pinned budget) %s\n", human(double(m.device_capacity)).c_str(),
              human(double(m.host_capacity)).c_str());
  if (m.device_shares_host_cores > 0)
    std::printf("  (the emulated device computes on this process's %g core%s, with the host thread and the CPU\n"
                "   optimizer: the model shares them out among whatever runs at once)\n",
                m.device_shares_host_cores, m.device_shares_host_cores == 1 ? "" : "s");
}

int run(Args a) {
  const auto t_start = Clock::now();
  const bool demo = a.model_dir.empty() && a.model_config.empty();
  STRATA_REQUIRE(a.model_dir.empty() || a.model_config.empty(), "give --model or --model-config, not both");
  ModelConfig mcfg = !a.model_dir.empty()      ? load_model_config(a.model_dir + "/config.json")
                     : !a.model_config.empty() ? load_model_config(a.model_config)
                                               : demo_model_config();
  if (a.seq_len <= 0)  // strata-train's default
    a.seq_len = demo ? 128 : mcfg.max_positions > 0 ? std::min<std::int64_t>(1024, mcfg.max_positions) : 1024;
  // As strata-train refuses it (the model itself said so only after the machine was measured).
  STRATA_REQUIRE(mcfg.arch != ModelArch::kGpt2 || a.seq_len <= mcfg.max_positions,
                 "--seq-len {} exceeds the model's {} positions", a.seq_len, mcfg.max_positions);
  if (!a.out.empty()) {  // nothing of the user's is replaced by what strata-prof writes
    std::error_code ec;
    const std::string mc = demo_model_file(a.out);
    if (demo && fs::exists(mc, ec)) {
      std::ifstream f(mc);
      std::stringstream have;
      have << f.rdbuf();
      STRATA_REQUIRE(have.str() == model_config_json(demo_model_config()),
                     "{} exists and is not the demo model's config, which strata-prof writes beside --out {}; move it, "
                     "or choose another --out", mc, a.out);
    }
  }
  STRATA_REQUIRE(a.micro_batch <= 0 || a.micro_batches.empty(),
                 "--micro-batch {} and --micro-batches: --micro-batches is the list searched (--micro-batch only sets "
                 "its default B/2, B, 2B); give one of them", a.micro_batch);
  STRATA_REQUIRE(a.data_files.empty() || a.text_file.empty(), "--data and --text: the validation runs read one of "
                 "them; give one");
  STRATA_REQUIRE(a.validate > 0 || ((!a.trace_named || a.trace.empty()) && a.data_files.empty() && a.text_file.empty()),
                 "--trace, --data and --text are for the validation runs: add --validate K (or leave them out)");
  for (const std::string& f : a.data_files)
    STRATA_REQUIRE(fs::is_regular_file(f), "--data {}: no such file", f);
  STRATA_REQUIRE(a.text_file.empty() || fs::is_regular_file(a.text_file), "--text {}: no such file", a.text_file);
  STRATA_REQUIRE(a.dtype.empty() || a.dtype == "fp32" || a.dtype == "bf16", "--dtype '{}': use fp32 or bf16", a.dtype);
  STRATA_REQUIRE(a.validate >= 0 && a.validate_steps >= 2, "--validate-steps must be at least 2 (the first step records "
                 "the unit order and is not timed)");
  for (auto b : a.micro_batches) STRATA_REQUIRE(b >= 1, "--micro-batches: {} is not a positive batch size", b);

  const LaunchInfo launch = init_launch();
  // Whether the --config gives a batch size (the micro-batch, or train_batch_size: the user's
  // global batch, as strata-train takes it), or leaves the defaults.
  bool config_micro = false, config_train = false;
  EngineConfig base = a.ds_config.empty() ? default_engine_config() : [&] {
    std::ifstream f(a.ds_config);
    STRATA_REQUIRE(f.good(), "--config {}: cannot be read", a.ds_config);
    std::stringstream ss;
    ss << f.rdbuf();
    // Parsed here too: a syntax error names the file, and the batch keys are read from it.
    const config::Json top = config::parse(ss.str(), fmt::format("--config {}", a.ds_config));
    EngineConfig c = parse_engine_config(ss.str(), launch.world_size);
    a.user_text = ss.str();
    config_train = top.is_object() && top.contains("train_batch_size");
    config_micro = config_train || (top.is_object() && top.contains("train_micro_batch_size_per_gpu"));
    return c;
  }();
  if (!a.aio_file.empty()) {
    std::ifstream f(a.aio_file);
    STRATA_REQUIRE(f.good(), "--aio {}: cannot be read (write one with strata-bench nvme --sweep --out FILE)", a.aio_file);
    std::stringstream ss;
    ss << f.rdbuf();
    // A file without one (a model's config.json by mistake) would leave every aio key at its
    // default, silently. (Not JSON at all: parse_aio_config says where.)
    STRATA_REQUIRE(has_aio_block(ss.str()),
                   "--aio {}: no \"aio\" block in it; give the file strata-bench nvme --sweep --out FILE writes "
                   "({{\"aio\": {{\"block_size\": ..., \"queue_depth\": ..., ...}}}})",
                   a.aio_file);
    base.aio = parse_aio_config(ss.str());
  }
  // --dtype and --grad-accum override the --config (as strata-train's flags do); left out, its
  // values stand, and the run line and the written config carry them.
  if (!a.dtype.empty()) {
    base.compute_dtype = a.dtype == "bf16" ? DType::kBF16 : DType::kF32;
    base.fp16.enabled = false;
  }
  STRATA_REQUIRE(base.compute_dtype == DType::kF32 || base.compute_dtype == DType::kBF16,
                 "--config {}: fp16.enabled: the model computes in fp32 or bf16 (fp16 is not supported yet); use "
                 "\"bf16\": {{\"enabled\": true}} or --dtype bf16", a.ds_config);
  a.dtype = base.compute_dtype == DType::kBF16 ? "bf16" : "fp32";
  const bool grad_accum_given = a.grad_accum > 0;
  if (grad_accum_given) base.gradient_accumulation_steps = a.grad_accum;
  a.grad_accum = base.gradient_accumulation_steps;
  // As strata-train takes --grad-accum beside a train_batch_size: the global batch stays and the
  // micro-batch follows (the --config's micro-batch was derived under its own accumulation).
  if (a.micro_batch <= 0 && a.micro_batches.empty() && config_train && grad_accum_given) {
    const std::int64_t per = a.grad_accum * launch.world_size;
    STRATA_REQUIRE(base.train_batch_size % per == 0,
                   "--grad-accum {} x {} rank(s) does not divide the train_batch_size {} of --config {}: give a "
                   "--grad-accum that divides it, or --micro-batch / --micro-batches",
                   a.grad_accum, launch.world_size, base.train_batch_size, a.ds_config);
    a.micro_batch = base.train_batch_size / per;
  }
  // The micro-batch the search centres on: --micro-batch, else the --config's (as --dtype and
  // --grad-accum default to it) when it gives one, else 4 for the demo and 1.
  if (a.micro_batch <= 0) a.micro_batch = config_micro ? base.micro_batch_per_gpu : demo ? 4 : 1;
  if (a.micro_batches.empty()) {
    if (a.micro_batch >= 2) a.micro_batches.push_back(a.micro_batch / 2);
    a.micro_batches.push_back(a.micro_batch);
    a.micro_batches.push_back(a.micro_batch * 2);
  }
  std::sort(a.micro_batches.begin(), a.micro_batches.end());  // the token file is sized by the last
  a.micro_batches.erase(std::unique(a.micro_batches.begin(), a.micro_batches.end()), a.micro_batches.end());
  const std::int64_t config_train_batch = config_train ? base.train_batch_size : 0;
  a.user_config = base;
  a.host_budget_given = a.host_mem_gb > 0 || base.host_budget_bytes > 0;
  STRATA_REQUIRE(a.host_mem_gb <= 0 || a.host_mem_gb * double(1ull << 30) >= double(2 << 20),
                 "--host-mem-gb {}: at least 0.002 (2 MiB): pinned memory is committed in 2 MiB steps", a.host_mem_gb);
  base.host_budget_bytes =
      a.host_mem_gb > 0 ? std::uint64_t(a.host_mem_gb * double(1ull << 30))
                        : (base.host_budget_bytes ? base.host_budget_bytes : default_host_budget(launch.local_size));
  if (a.ds_config.empty() && a.model_dir.empty()) base.adamw.weight_decay = 0;

  HostDeviceOptions hopt;
  CudaDeviceOptions copt;
  if (a.device_mem_gb > 0) {
    hopt.capacity_bytes = std::size_t(a.device_mem_gb * double(1ull << 30));
    copt.capacity_bytes = hopt.capacity_bytes;
  }
  hopt.h2d_gbps = a.emu_h2d;
  hopt.d2h_gbps = a.emu_d2h;
  hopt.compute_gflops = a.emu_gflops;

  std::string nvme_dir, nvme_key = "--nvme-path";  // (the key: what gave it, for its errors)
  std::vector<std::string> nvme_paths;        // the search's: the --config's lists, else nvme_dir
  std::vector<std::string> param_nvme_paths;  // the --config's offload_param list, when it has its own
  const bool use_nvme = !a.no_nvme;
  STRATA_REQUIRE(!a.no_nvme || a.nvme_path.empty(), "--no-nvme and --nvme-path {}: --no-nvme leaves NVMe out (nothing "
                 "is measured or placed there); give one of them", a.nvme_path);
  if (use_nvme) {
    std::error_code ec;
    // Left out: the --config's nvme_path (the drive the user means), else a scratch folder.
    const std::vector<std::string>& cfg_paths =
        !base.optimizer_nvme_paths.empty() ? base.optimizer_nvme_paths : base.param_nvme_paths;
    if (a.nvme_path.empty() && !cfg_paths.empty()) {
      for (const auto* list : {&base.param_nvme_paths, &base.optimizer_nvme_paths})
        for (const std::string& p : *list)
          STRATA_REQUIRE(fs::is_directory(p, ec), "--config {}: nvme_path {}: no such directory; create it on the "
                         "drive to profile, or give --nvme-path DIR", a.ds_config, p);
      nvme_dir = cfg_paths.front();  // measured there
      nvme_key = !base.optimizer_nvme_paths.empty() ? "zero_optimization.offload_optimizer.nvme_path"
                                                    : "zero_optimization.offload_param.nvme_path";
      nvme_paths = cfg_paths;
      if (!base.param_nvme_paths.empty()) param_nvme_paths = base.param_nvme_paths;
    } else if (a.nvme_path.empty()) {
      nvme_dir = default_scratch_dir("prof-nvme");
      fs::create_directories(nvme_dir, ec);
      STRATA_REQUIRE(fs::is_directory(nvme_dir), "cannot create the default NVMe folder {} ({}): give --nvme-path DIR",
                     nvme_dir, ec.message());
    } else {  // the drive to measure: a typo must not measure another one
      nvme_dir = a.nvme_path;
      STRATA_REQUIRE(fs::is_directory(nvme_dir, ec), "--nvme-path {}: {}", nvme_dir,
                     fs::exists(nvme_dir, ec) ? "a file, not a folder: give a folder on the drive to profile"
                                              : "no such directory; create it on the drive to profile, or leave the "
                                                "flag out (a scratch folder, or --no-nvme)");
    }
  }
  const int rank = launch.rank;
  const bool talk = rank == 0;
  // What rank 0 writes at the end, checked now: a folder that is not there, or a file of the
  // user's in the way, must not cost the measuring and the search first (and --svg must not
  // fail after --out was written).
  if (a.validate > 0 && a.trace.empty() && !a.trace_named) a.trace = "strata-prof.trace.json";  // --trace "": none
  {
    // What strata-prof writes must not name one file twice (the later replaced the earlier: the
    // recommendation by the picture or the trace), nor a file it reads (the model's config is
    // read again by the validation runs and named in the run line). Links resolved.
    using Named = std::vector<std::pair<std::string, std::string>>;
    Named outs = {{"--out", a.out}, {"--svg", a.svg}};
    if (a.validate > 0) outs.push_back({"--trace", a.trace});
    if (demo && !a.out.empty()) outs.push_back({"the demo model file written beside --out", demo_model_file(a.out)});
    Named ins;  // inputs may share a file with each other (--config and --aio, say), not with an output
    if (!a.ds_config.empty()) ins.push_back({"--config", a.ds_config});
    if (!a.model_config.empty()) ins.push_back({"--model-config", a.model_config});
    if (!a.model_dir.empty()) ins.push_back({"--model folder's config.json", a.model_dir + "/config.json"});
    if (!a.aio_file.empty()) ins.push_back({"--aio", a.aio_file});
    for (const std::string& f : a.data_files) ins.push_back({"--data", f});
    if (!a.text_file.empty()) ins.push_back({"--text", a.text_file});
    auto key = [](const std::string& p) {
      std::error_code ec;
      const fs::path k = fs::weakly_canonical(fs::absolute(p), ec);
      return ec ? fs::absolute(p).lexically_normal() : k;
    };
    auto same = [&](const std::string& x, const std::string& y) {
      std::error_code ec;  // (equivalent: hard links too)
      return !x.empty() && !y.empty() && (key(x) == key(y) || (fs::equivalent(x, y, ec) && !ec));
    };
    for (std::size_t i = 0; i < outs.size(); ++i) {
      for (std::size_t k = i + 1; k < outs.size(); ++k)
        STRATA_REQUIRE(!same(outs[i].second, outs[k].second), "{} and {} both name {}: give each its own file",
                       outs[i].first, outs[k].first, outs[i].second);
      for (const auto& [flag, path] : ins)
        STRATA_REQUIRE(!same(outs[i].second, path),
                       "{} {} is the {} file: strata-prof would replace it; write it elsewhere", outs[i].first,
                       outs[i].second, flag);
    }
  }
  if (talk) {
    tools::require_output_file("--out", a.out, a.overwrite || !a.out_named);
    tools::require_output_file("--svg", a.svg, a.overwrite || !a.svg_named);
    if (a.validate > 0) tools::require_output_file("--trace", a.trace, a.overwrite || !a.trace_named);
  }

  // ---- measure ----
  // The device the measurements run on must hold their buffers and a 2-layer copy of the
  // model: the emulated one is sized for it (its throttles stay), a GPU is what it is.
  HostDeviceOptions mhopt = hopt;
  mhopt.capacity_bytes = std::max<std::size_t>(hopt.capacity_bytes, std::size_t(8) << 30);
  MachineProfile machine;
  std::string dev_name;
  {
    auto dev = make_device(a.device, mhopt, copt);
    dev_name = dev->name();
    // The emulated device's throttles would be ignored on a GPU (with --device auto, say).
    STRATA_REQUIRE(dev->kind() == DeviceKind::kCpu || (a.emu_h2d <= 0 && a.emu_d2h <= 0 && a.emu_gflops <= 0),
                   "--emu-h2d-gbps, --emu-d2h-gbps and --emu-compute-gflops throttle the CPU-emulated device, and "
                   "this run measures {}: leave them out, or pass --device cpu", dev_name);
    auto comm = make_communicator(*dev);
    std::size_t largest = 0;
    for (const auto& u : model_units(mcfg)) largest = std::max<std::size_t>(largest, u.numel);
    const std::size_t shard = largest / std::size_t(std::max(1, launch.world_size));
    std::vector<std::string> all_paths = nvme_paths.empty() ? std::vector<std::string>{nvme_dir} : nvme_paths;
    for (const std::string& p : param_nvme_paths)
      if (std::find(all_paths.begin(), all_paths.end(), p) == all_paths.end()) all_paths.push_back(p);
    machine = measure_machine(*dev, *comm, base, nvme_dir, all_paths, nvme_key, use_nvme, shard * 12,
                              shard * dtype_size(base.compute_dtype));
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
  const auto t_machine = since(t_start);
  if (talk) {
    std::printf("strata-prof: %s, %zu layers, %.2fM parameters, seq %lld, %s\n", mcfg.model_type.c_str(),
                std::size_t(mcfg.num_layers), [&] {
                  double n = 0;
                  for (const auto& u : model_units(mcfg)) n += double(u.numel);
                  return n / 1e6;
                }(), (long long)a.seq_len, a.dtype.c_str());
    print_machine(machine, dev_name);
    std::fflush(stdout);
  }
  SearchSpace space;
  space.base = base;
  if (use_nvme) {
    space.nvme_paths = nvme_paths.empty() ? std::vector<std::string>{nvme_dir} : nvme_paths;
    space.param_nvme_paths = param_nvme_paths;
  }
  const DType dt = base.compute_dtype;
  for (auto B : a.micro_batches)
    for (int ck = 0; ck < 3; ++ck)  // off, on, on with the checkpoints in host memory
      space.models.push_back(profile_model(mcfg, B, a.seq_len, ck > 0, ck == 2, dt, a.device, mhopt, copt));
  if (launch.world_size > 1) {
    auto dev = make_device(a.device, hopt, copt);
    auto comm = make_communicator(*dev);
    agree_across_ranks(*comm, machine, space.models);
    // The plan takes the config's budget over the machine's: the least any rank has, on every rank.
    space.base.host_budget_bytes = machine.host_capacity;
    if (talk)
      std::printf("%d ranks: the search takes the slowest rank's figures (lowest rates, longest times)\n",
                  launch.world_size);
  }
  const auto t_measured = since(t_start);
  if (talk) {
    std::printf("model (per micro-batch, measured on 1- and 2-layer copies):\n");
    std::printf("  %-6s %-5s %10s %10s %10s %10s %12s\n", "B", "ckpt", "layer fwd", "layer bwd", "head", "embed",
                "activations");
    for (const auto& mp : space.models)
      std::printf("  %-6lld %-5s %8.2fms %8.2fms %8.2fms %8.2fms %12s\n", (long long)mp.micro_batch,
                  !mp.checkpoint ? "off" : mp.checkpoint_on_host ? "host" : "on", mp.units[1].forward_s * 1e3, mp.units[1].backward_s * 1e3,
                  mp.units.back().forward_s * 1e3, (mp.units[0].forward_s + mp.units[0].backward_s) * 1e3,
                  human(double(mp.activation_bytes)).c_str());
    std::printf("measured in %.1f s (machine %.1f s)\n\n", t_measured, t_machine);
    std::fflush(stdout);
  }

  // ---- search ----
  const SearchResult sr = search_placements(machine, space);
  nlohmann::json j;
  j["command"] = "prof";
  j["machine"] = {{"device", dev_name},
                  {"world_size", machine.world_size},
                  {"nvme_path", use_nvme ? nlohmann::json(nvme_dir) : nlohmann::json(nullptr)},
                  {"h2d_gbps", machine.h2d_bps / 1e9},
                  {"d2h_gbps", machine.d2h_bps / 1e9},
                  {"device_mem_gbps", machine.device_mem_bps / 1e9},
                  {"device_free_gbps", machine.free_bps / 1e9},
                  {"host_mem_gbps", machine.host_mem_bps / 1e9},
                  {"host_norm_gbps", machine.host_norm_bps / 1e9},
                  {"nvme_read_gbps", machine.nvme_read_bps / 1e9},
                  {"nvme_write_gbps", machine.nvme_write_bps / 1e9},
                  {"nvme_mixed_gbps", machine.nvme_mixed_bps / 1e9},
                  {"nvme_request_ms", machine.nvme_request_s * 1e3},
                  {"nvme_fetch_read_gbps", machine.nvme_fetch_read_bps / 1e9},
                  {"device_shares_host_cores", machine.device_shares_host_cores},
                  {"cpu_adamw_mparams_per_s", machine.cpu_adamw_params_per_s / 1e6},
                  {"device_adamw_mparams_per_s", machine.device_adamw_params_per_s / 1e6},
                  {"all_gather_gbps", machine.all_gather_bps / 1e9},
                  {"reduce_scatter_gbps", machine.reduce_scatter_bps / 1e9},
                  {"device_capacity_bytes", machine.device_capacity},
                  {"host_capacity_bytes", machine.host_capacity},
                  {"nvme_free_bytes", machine.nvme_free}};
  j["model"] = {{"type", mcfg.model_type},
                {"layers", mcfg.num_layers},
                {"params", [&] {
                   std::uint64_t n = 0;
                   for (const auto& u : model_units(mcfg)) n += u.numel;
                   return n;
                 }()},
                {"seq_len", a.seq_len},
                {"dtype", a.dtype},
                {"gradient_accumulation_steps", a.grad_accum}};
  {
    nlohmann::json rows = nlohmann::json::array();
    for (const auto& mp : space.models)
      rows.push_back({{"micro_batch", mp.micro_batch},
                      {"checkpoint", !mp.checkpoint ? "off" : mp.checkpoint_on_host ? "host" : "on"},
                      {"layer_forward_s", mp.units[1].forward_s},
                      {"layer_backward_s", mp.units[1].backward_s},
                      {"head_forward_s", mp.units.back().forward_s},
                      {"embed_s", mp.units[0].forward_s + mp.units[0].backward_s},
                      {"activation_bytes", mp.activation_bytes}});
    j["model"]["measured"] = std::move(rows);
  }
  j["machine_seconds"] = t_machine;
  j["measure_seconds"] = t_measured;
  j["candidates_considered"] = sr.considered;
  j["candidates_feasible"] = sr.ranked.size();
  if (sr.ranked.empty()) {
    if (talk) {
      std::printf("no placement fits: %zu candidates considered. The one closest to fitting (the fewest bytes "
                  "missing over all tiers), %s:\n%s", sr.considered, sr.smallest_label.c_str(),
                  sr.smallest.table().c_str());
      // The table's device capacity is the headroom's share, not the device's: say so.
      std::printf("(a plan may fill %.0f%% of the device's memory, %s of %s: the rest is the allocator's)\n",
                  100 * space.device_headroom, log::human_bytes(double(sr.smallest.device_capacity)).c_str(),
                  log::human_bytes(double(machine.device_capacity)).c_str());
      // (A GPU's own memory is its limit: a larger cap than it has plans for memory not there.)
      std::string ways = dev_name.starts_with("cpu") || a.device_mem_gb > 0 ? "a larger --device-mem-gb or --host-mem-gb"
                                                                           : "a larger --host-mem-gb";
      if (a.micro_batches.front() > 1) ways += fmt::format(", --micro-batches below {}", a.micro_batches.front());
      ways += use_nvme ? ", or --nvme-path on a drive with more free space" : ", or NVMe (leave out --no-nvme)";
      std::printf("strata-prof's own ways out: %s\n", ways.c_str());
      std::error_code ec;
      for (const std::string* f : {&a.out, &a.svg, &a.trace})
        if (!f->empty() && fs::exists(*f, ec)) std::printf("(%s is not this run's: nothing was written)\n", f->c_str());
      if (!use_nvme) std::printf("(NVMe placements were not considered: --no-nvme)\n");
      if (a.json) {
        j["fits"] = false;
        j["candidates"] = nlohmann::json::array();
        if (a.validate > 0) {
          j["validated"] = 0;
          j["validation_failures"] = 0;
          for (const char* k2 : {"worst_prediction_error", "recommended_vs_best_measured", "trace_file"}) j[k2] = nullptr;
        }
        j["problems"] = sr.problems;
        j["closest"] = {{"label", sr.smallest_label},
                        {"device_bytes", sr.smallest.device_bytes},
                        {"device_capacity_bytes", sr.smallest.device_capacity},
                        {"host_bytes", sr.smallest.host_bytes},
                        {"host_capacity_bytes", sr.smallest.host_capacity},
                        {"nvme_bytes", sr.smallest.nvme_bytes},
                        {"nvme_capacity_bytes", sr.smallest.nvme_capacity}};
        j["best_config_file"] = nullptr;
        j["total_seconds"] = since(t_start);
        std::printf("%s\n", j.dump().c_str());
      }
    }
    return 2;
  }
  const std::size_t shown = std::min<std::size_t>(std::size_t(std::max(1, a.top)), sr.ranked.size());
  if (talk) {
    std::printf("%zu placements considered, %zu fit; the best %zu (predicted):\n", sr.considered, sr.ranked.size(), shown);
    std::printf("  %-3s %10s %10s %-9s %10s %10s %10s  %s\n", "#", "step ms", "tokens/s", "bound by", "device", "host",
                "nvme", "configuration");
    for (std::size_t i = 0; i < shown; ++i) {
      const Candidate& c = sr.ranked[i];
      std::printf("  %-3zu %10.1f %10.0f %-9s %10s %10s %10s  %s\n", i + 1, c.prediction.step_s * 1e3,
                  c.prediction.tokens_per_s, resource_name(c.prediction.bottleneck),
                  human(double(c.plan.device_bytes)).c_str(), human(double(c.plan.host_bytes)).c_str(),
                  human(double(c.plan.nvme_bytes)).c_str(), c.label.c_str());
    }
    std::fflush(stdout);
  }
  const Candidate& best = sr.ranked[0];
  int exit_code = 0;
  if (talk && !a.out.empty()) {
    std::ofstream f(a.out, std::ios::trunc);
    f << written_json(written_config(best.config, a.user_config, a.host_budget_given), a.user_text,
                      std::max(1, machine.world_size));
    STRATA_REQUIRE(f.good(), "--out {}: cannot be written", a.out);
    std::string model_flag = !a.model_dir.empty()      ? " --model " + a.model_dir
                             : !a.model_config.empty() ? " --model-config " + a.model_config
                                                       : "";
    if (model_flag.empty()) {
      // The demo model as profiled: strata-train without a model runs the demo under its own
      // 20 MiB cap, not the device this plan was made for.
      const std::string mc = demo_model_file(a.out);
      std::ofstream(mc, std::ios::trunc) << model_config_json(demo_model_config());
      model_flag = " --model-config " + mc;
    }
    // The device it was measured on, as strata-train takes it (the emulated one with its cap and throttles).
    std::string device_flags;
    if (dev_name.starts_with("cpu")) {
      device_flags = " --device cpu";
      if (a.device_mem_gb > 0) device_flags += fmt::format(" --device-mem-gb {:g}", a.device_mem_gb);
      if (a.emu_h2d > 0) device_flags += fmt::format(" --emu-h2d-gbps {:g}", a.emu_h2d);
      if (a.emu_d2h > 0) device_flags += fmt::format(" --emu-d2h-gbps {:g}", a.emu_d2h);
      if (a.emu_gflops > 0) device_flags += fmt::format(" --emu-compute-gflops {:g}", a.emu_gflops);
    } else if (a.device_mem_gb > 0) {  // a GPU planned under a cap: the run keeps to it too
      device_flags = fmt::format(" --device-mem-gb {:g}", a.device_mem_gb);
    }
    // strata-train beside this binary (a build tree's tools/, a package's bin/), else by name.
    std::error_code ec;
    const fs::path train = fs::read_symlink("/proc/self/exe", ec).parent_path() / "strata-train";
    const std::int64_t global = best.config.micro_batch_per_gpu * best.config.gradient_accumulation_steps *
                                machine.world_size;
    if (config_train_batch > 0 && global != config_train_batch) {
      const std::int64_t per_b = best.config.gradient_accumulation_steps * machine.world_size;
      const std::string keep =
          config_train_batch % per_b == 0
              ? fmt::format("pass --micro-batches {} to keep it", config_train_batch / per_b)
              : fmt::format("no micro-batch keeps it with {} x {} rank(s): choose a --grad-accum that divides it",
                            best.config.gradient_accumulation_steps, machine.world_size);
      std::printf("\nnote: B=%lld x gradient_accumulation_steps %lld x %d rank(s) = %lld sequences a step, not the "
                  "train_batch_size %lld of --config %s (%s)\n",
                  (long long)best.config.micro_batch_per_gpu, (long long)best.config.gradient_accumulation_steps,
                  machine.world_size, (long long)global, (long long)config_train_batch, a.ds_config.c_str(),
                  keep.c_str());
    }
    std::printf("\nbest configuration written to %s; run it with:\n  %s%s --config %s --seq-len %lld%s%s\n",
                a.out.c_str(), !ec && fs::exists(train) ? train.c_str() : "strata-train", model_flag.c_str(),
                a.out.c_str(), (long long)a.seq_len,
                best.checkpoint_on_host ? " --checkpoint-on-host" : best.checkpoint ? " --checkpoint-activations" : "",
                device_flags.c_str());
  }
  nlohmann::json cands = nlohmann::json::array();
  // The printed ones, and every validated one (--top 1 --validate 3): each with its figures.
  const std::size_t in_json = std::min(sr.ranked.size(), std::max(shown, std::size_t(std::max(0, a.validate))));
  for (std::size_t i = 0; i < in_json; ++i) {
    const Candidate& c = sr.ranked[i];
    nlohmann::json busy;
    for (int r = 0; r < int(Resource::kCount); ++r) busy[resource_name(Resource(r))] = c.prediction.busy_s[r];
    cands.push_back({{"rank", i + 1},
                     {"label", c.label},
                     {"micro_batch", c.micro_batch},
                     {"checkpoint", !c.checkpoint ? "off" : c.checkpoint_on_host ? "host" : "on"},
                     {"predicted_step_s", c.prediction.step_s},
                     {"predicted_tokens_per_s", c.prediction.tokens_per_s},
                     {"predicted_forward_s", c.prediction.forward_s},
                     {"predicted_backward_s", c.prediction.backward_s},
                     {"predicted_optimizer_s", c.prediction.optimizer_s},
                     {"bottleneck", resource_name(c.prediction.bottleneck)},
                     {"busy_s", busy},
                     {"device_bytes", c.plan.device_bytes},
                     {"host_bytes", c.plan.host_bytes},
                     {"nvme_bytes", c.plan.nvme_bytes}});
  }

  // ---- validate ----
  std::vector<Interval> measured_sched;
  double measured_best_step = 0;
  bool have_trace = false;
  if (a.validate > 0) {
    const std::size_t k = std::min<std::size_t>(std::size_t(a.validate), sr.ranked.size());
    const std::string work = (fs::path(nvme_dir.empty() ? fs::temp_directory_path().string() : nvme_dir) /
                              fmt::format("prof-work-{}", ::getpid()))
                                 .string();
    fs::create_directories(work);
    std::string data_file;
    if (a.data_files.empty() && a.text_file.empty()) {
      // Random tokens: the step's time does not depend on what they are.
      data_file = (fs::path(work) / "tokens.u32").string();
      std::vector<std::uint32_t> tok(std::size_t(a.seq_len + 1) * std::size_t(a.micro_batches.back()) *
                                     std::size_t(a.grad_accum * launch.world_size * (a.validate_steps + 2)));
      std::mt19937_64 rng(3);
      for (auto& t : tok) t = std::uint32_t(rng() % std::uint64_t(mcfg.vocab_size));
      std::ofstream f(data_file, std::ios::binary | std::ios::trunc);  // every rank its own (its work folder)
      f.write(reinterpret_cast<const char*>(tok.data()), std::streamsize(tok.size() * 4));
    }
    if (talk) std::printf("\nvalidating the best %zu (%d steps each, the first not timed):\n", k, a.validate_steps);
    if (talk)
      std::printf("  %-3s %12s %12s %8s %10s  %s\n", "#", "predicted ms", "measured ms", "error", "tokens/s",
                  "configuration");
    const std::string& trace = a.trace;
    bool trace_written = false;  // only by the recommended configuration's run, when it ran
    {
      // An older file of that name is not this run's trace (checked replaceable up front).
      std::error_code ec;
      if (talk && !trace.empty()) fs::remove(trace, ec);
    }
    // The candidates may differ in micro-batch size: which is fastest is a matter of tokens a
    // second (what the search ranks by), not of step time (fastest_validated).
    double worst = 0;
    int failed = 0;
    std::vector<double> measured(k), measured_tps(k, 0.0);
    for (std::size_t i = 0; i < k; ++i) {
      const Candidate& c = sr.ranked[i];
      Tracer::global().clear();
      Measured mres;
      try {
        mres = run_candidate(a, c, work, data_file, i == 0 ? trace : std::string(), int(i));
      } catch (const Error& e) {
        // A configuration the planner passed and the run refused is a finding, not the end.
        ++failed;
        if (talk) std::printf("  %-3zu %12.1f %12s %8s %10s  %s\n      FAILED: %s\n", i + 1,
                              c.prediction.step_s * 1e3, "-", "-", "-", c.label.c_str(), e.user_message().c_str());
        cands[i]["validation_error"] = e.user_message();
        for (const char* k2 : {"measured_step_s", "measured_tokens_per_s", "measured_steps_s", "prediction_error"})
          cands[i][k2] = nullptr;
        measured[i] = 0;
        continue;
      }
      if (i == 0) {
        trace_written = fs::exists(trace);
        measured_sched = measured_schedule(Tracer::global().spans());
        have_trace = !measured_sched.empty();
        measured_best_step = mres.steps.empty() ? 0 : mres.steps.back();
        Tracer::global().clear();
      }
      measured[i] = mres.step_s;
      measured_tps[i] = measured_tokens_per_s(c, mres.step_s);
      const double err = (c.prediction.step_s - mres.step_s) / mres.step_s;
      worst = std::max(worst, std::abs(err));
      if (talk) {
        std::printf("  %-3zu %12.1f %12.1f %+7.1f%% %10.0f  %s\n", i + 1, c.prediction.step_s * 1e3,
                    mres.step_s * 1e3, err * 100, measured_tps[i], c.label.c_str());
        std::fflush(stdout);
      }
      cands[i]["measured_step_s"] = mres.step_s;
      cands[i]["measured_tokens_per_s"] = measured_tps[i];
      cands[i]["measured_steps_s"] = mres.steps;
      cands[i]["prediction_error"] = err;
    }
    std::error_code ec;
    fs::remove_all(work, ec);
    // How much slower the recommended configuration trains than the fastest validated (>= 1).
    const std::size_t best_measured_i = fastest_validated(sr.ranked, measured);
    const double rec_vs_best =
        measured_tps[0] > 0 && best_measured_i < k ? measured_tps[best_measured_i] / measured_tps[0] : 0;
    if (failed > 0) {
      exit_code = 3;
      if (talk) std::printf("%d of %zu validation runs FAILED (see above)\n", failed, k);
    }
    const int validated_ok = int(k) - failed;
    if (talk) {
      if (measured[0] <= 0 && validated_ok > 0)
        std::printf("worst prediction error %.1f%% (target 15%%) over the %d that ran; the recommended configuration's "
                    "run FAILED\n", worst * 100, validated_ok);
      if (measured[0] > 0) {
        std::printf("worst prediction error %.1f%% (target 15%%); the recommended configuration measured %.1f ms "
                    "(%.0f tokens/s), %s\n",
                    worst * 100, measured[0] * 1e3, measured_tps[0],
                    best_measured_i == 0
                        ? "the fastest of those validated"
                        : fmt::format("{:.1f}% slower than #{} in tokens/s (target 5%)", (rec_vs_best - 1) * 100,
                                      best_measured_i + 1)
                              .c_str());
      }
      if (trace_written)
        std::printf("Chrome trace of the recommended configuration's step %d: %s\n", a.validate_steps, trace.c_str());
    }
    j["validated"] = k;
    j["validation_failures"] = failed;
    j["worst_prediction_error"] = validated_ok > 0 ? nlohmann::json(worst) : nlohmann::json(nullptr);
    j["recommended_vs_best_measured"] = measured[0] > 0 ? nlohmann::json(rec_vs_best) : nlohmann::json(nullptr);
    j["trace_file"] = trace_written ? nlohmann::json(trace) : nlohmann::json(nullptr);
  }
  if (talk && !a.svg.empty()) {
    write_svg(a.svg, best, have_trace ? &measured_sched : nullptr, measured_best_step,
              std::vector<Candidate>(sr.ranked.begin(), sr.ranked.begin() + std::ptrdiff_t(shown)));
    std::printf("picture: %s\n", a.svg.c_str());
  }
  j["fits"] = true;
  j["candidates"] = cands;
  j["best_config_file"] = a.out.empty() ? nlohmann::json(nullptr) : nlohmann::json(a.out);
  j["total_seconds"] = since(t_start);
  if (talk && a.json) std::printf("%s\n", j.dump().c_str());
  return exit_code;
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  strata::reexec_with_passive_openmp(argv);  // before libgomp's first team: see device.h
  strata::remove_swap_files_on_interrupt();   // its validation runs' swap files too
  strata::tools::g_ranks_start_mpi = true;    // every rank starts MPI: one failing early ends the job
  strata::Args a;
  CLI::App app{"strata-prof: measure this machine and the model, predict the step time of every placement of\n"
               "weights, gradients and optimizer state over device, host and NVMe, recommend the fastest\n"
               "that fits (written as a ds_config.json), and --validate the prediction by running the best."};
  app.add_option("--model", a.model_dir, "Hugging Face model folder (config.json); default: the demo model");
  app.add_option("--model-config", a.model_config, "config.json of the model");
  app.add_option("--config", a.ds_config, "ds_config.json whose other settings (precision, clipping, aio) are kept");
  app.add_option("--aio", a.aio_file, "an aio block from strata-bench nvme --sweep --out FILE");
  app.add_option("--data", a.data_files, "token file(s) for --validate (default: random tokens)");
  app.add_option("--text", a.text_file, "a text file for --validate (byte-level models)");
  app.add_option("--seq-len", a.seq_len,
                 "tokens per sequence (default 128 demo, else 1024 or the model's max_position_embeddings when smaller)")->check(strata::tools::kPositive);
  app.add_option("--micro-batch", a.micro_batch, "sequences per micro-batch (default 4 demo, else 1)")
      ->check(strata::tools::kPositive);
  app.add_option("--micro-batches", a.micro_batches, "micro-batch sizes to search (default B/2, B, 2B)");
  app.add_option("--grad-accum", a.grad_accum, "micro-batches per step (default: --config's, else 1)")
      ->check(strata::tools::kPositive);
  app.add_option("--dtype", a.dtype, "compute dtype (default: --config's, else fp32)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--device", a.device, "device")->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--device-mem-gb", a.device_mem_gb, "device memory to plan for, GiB (the emulated device's cap)")
      ->check(strata::tools::kPositive);
  app.add_option("--host-mem-gb", a.host_mem_gb, "pinned host memory to plan for, GiB (default 80% of RAM)")
      ->check(strata::tools::kPositive);
  app.add_option("--emu-h2d-gbps", a.emu_h2d, "emulated device: host-to-device GB/s")->check(strata::tools::kNonNegative);
  app.add_option("--emu-d2h-gbps", a.emu_d2h, "emulated device: device-to-host GB/s")->check(strata::tools::kNonNegative);
  app.add_option("--emu-compute-gflops", a.emu_gflops, "emulated device: matmul GFLOP/s")->check(strata::tools::kNonNegative);
  app.add_option("--nvme-path", a.nvme_path,
                 "folder on the NVMe drive (default <build>/prof-nvme, or ~/.cache/strata/prof-nvme installed)");
  app.add_flag("--no-nvme", a.no_nvme, "do not consider NVMe placements");
  app.add_option("--top", a.top, "candidates to print (default 5)")->check(CLI::Range(1, 100));
  app.add_option("--validate", a.validate, "run the best K for a few steps and compare (default 0)")
      ->check(CLI::Range(0, 20));
  app.add_option("--validate-steps", a.validate_steps, "steps per validation run (default 4)")->check(CLI::Range(2, 100));
  app.add_option("--out", a.out, "write the best configuration here (default strata-prof.ds_config.json)");
  app.add_option("--svg", a.svg, "the picture (default strata-prof.svg; empty: none)");
  app.add_option("--trace", a.trace,
                 "Chrome trace of the recommended configuration (with --validate; default strata-prof.trace.json; \"\": none)");
  app.add_flag("--overwrite", a.overwrite, "replace existing --out, --svg and --trace files you named");
  app.add_flag("--json", a.json, "print, last, one JSON object of the figures");
  return strata::tools::run_tool("strata-prof", app, argc, argv, [&] {
    a.out_named = app.count("--out") > 0;
    a.svg_named = app.count("--svg") > 0;
    a.trace_named = app.count("--trace") > 0;
    return strata::run(a);
  });
}
