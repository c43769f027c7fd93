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
#include <algorithm>
#include <atomic>

#include "scheduler/engine_impl.h"

namespace strata {

using detail::Unit;

void Engine::Impl::bound(std::deque<Event>& q, std::size_t most, const char* wait,
                         std::uint64_t* waits) {
  while (q.size() >= std::max<std::size_t>(most, 1)) {
    if (!q.front().query()) {
      TraceScope span(wait, "engine");  // the host waits
      if (waits) ++*waits;
      q.front().synchronize();
    }
    q.pop_front();
  }
}

Engine::Impl::Impl(Device& d, Communicator& c, const EngineConfig& config)
    : dev(d), comm(c), cfg(config), rank(c.rank()), world(c.world_size()) {
  STRATA_REQUIRE(&c.device() == &d, "Engine: the communicator belongs to another device");
  STRATA_REQUIRE(cfg.stage >= 1 && cfg.stage <= 3, "zero_optimization.stage = {}: use 1, 2 or 3",
                 cfg.stage);
  STRATA_REQUIRE(cfg.compute_dtype != DType::kF64, "Engine: fp64 compute is not supported");
  if (!isa_supported(cfg.optimizer_isa))
    STRATA_THROW(kUnsupported, "config key 'strata.optimizer_isa' = \"{}\": {}; use \"auto\"",
                 isa_name(cfg.optimizer_isa), isa_unavailable(cfg.optimizer_isa));
  c_size = dtype_size(cfg.compute_dtype);
  sg = std::size_t(detail::sub_group_elems(cfg));
  bucket_share = std::size_t(detail::bucket_share_elems(cfg, world));
  device_alloc_waits_at_start = dev.stats().num_alloc_waits;
  if (cfg.fp16.enabled) {
    scale = cfg.fp16.loss_scale > 0 ? cfg.fp16.loss_scale
                                    : std::ldexp(1.0, cfg.fp16.initial_scale_power);
    hysteresis_left = cfg.fp16.hysteresis;
  }
}

Buffer Engine::Impl::alloc(std::size_t bytes, Stream* s) {
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

std::optional<TensorRef> Engine::Impl::w_target_dev(const Unit& u, std::size_t first,
                                                    std::size_t size) const {
  size = std::min(size, u.shard);
  if (u.resident)
    return view(u.w.full, cfg.compute_dtype, size, std::size_t(rank) * u.shard + first);
  if (u.w_tier == Tier::kDevice) return view(u.w.dev, cfg.compute_dtype, size, first);
  return std::nullopt;
}

Unit& Engine::Impl::unit_at(int unit, const char* call) {
  STRATA_REQUIRE(unit >= 0 && std::size_t(unit) < units.size(),
                 "{}: no unit {} (the model registered {})", call, unit, units.size());
  return units[std::size_t(unit)];
}

Engine::Engine(Device& device, Communicator& comm, const EngineConfig& config)
    : impl_(std::make_unique<Impl>(device, comm, config)) {}

Engine::~Engine() {
  if (!impl_) return;
  impl_->early_step.stop();
  try {
    impl_->dev.synchronize();
  } catch (const std::exception& e) {
    log::error("engine shutdown: {}", e.what());
  }
}

int Engine::add_unit(const UnitDef& def) {
  Impl& s = *impl_;
  STRATA_REQUIRE(!s.finalized, "Engine::add_unit('{}') after finalize(): register every unit first",
                 def.name);
  STRATA_REQUIRE(!def.params.empty(), "unit '{}' has no parameters", def.name);
  Unit u;
  u.name = def.name;
  for (const ParamDef& p : def.params) {
    STRATA_REQUIRE(p.numel > 0, "parameter '{}.{}' has 0 elements", def.name, p.name);
    STRATA_REQUIRE(
        (p.init != nullptr) != bool(def.source), "parameter '{}.{}': {}", def.name, p.name,
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

std::size_t Engine::unit_numel(int unit) const {
  return impl_->unit_at(unit, "Engine::unit_numel").numel;
}
std::size_t Engine::param_offset(int unit, int param) const {
  const Unit& u = impl_->unit_at(unit, "Engine::param_offset");
  STRATA_REQUIRE(param >= 0 && std::size_t(param) < u.offsets.size(),
                 "Engine::param_offset: unit '{}' has no parameter {} (it registered {})", u.name,
                 param, u.offsets.size());
  return u.offsets[std::size_t(param)];
}
const MemoryPlan& Engine::plan() const { return impl_->plan; }
const EngineConfig& Engine::config() const { return impl_->cfg; }
DType Engine::compute_dtype() const { return impl_->cfg.compute_dtype; }
Isa Engine::host_optimizer_isa() const {
  return impl_->cpu_adam ? impl_->cpu_adam->isa() : Isa::kAuto;
}
float Engine::loss_scale() const { return float(impl_->scale); }
std::size_t optimizer_state_stride(std::size_t n) { return detail::state_stride(n); }

EngineConfig Engine::with_device_defaults(EngineConfig config, const Device& device) {
  // The early optimizer step on the CPU-emulated device: its kernels run on the cores the
  // optimizer would use, so the overlap turns into contention (measured: slower steps).
  if (!config.overlap_optimizer.has_value() && device.kind() == DeviceKind::kCpu)
    config.overlap_optimizer = false;
  // The norm's sums on the device: free on a GPU, but the emulated device's kernels are host
  // threads, and its comm stream taking them delays the next gradient's copy (measured: the
  // engine benchmark's AdamW regime 1.18-1.23 -> 1.27-1.30).
  if (!config.device_grad_norm.has_value())
    config.device_grad_norm = device.kind() != DeviceKind::kCpu;
  return config;
}

// Tiers, in unit order, by each piece's byte position (scheduler/layout.h); which pieces
// have some unit on NVMe.
Engine::Impl::OnNvme Engine::Impl::assign_tiers() {
  std::vector<std::uint64_t> numel;
  for (const Unit& u : units) numel.push_back(u.numel);
  const std::vector<detail::UnitLayout> layout = detail::layout_units(cfg, numel, world);
  OnNvme nvme;
  for (std::size_t i = 0; i < units.size(); ++i) {
    Unit& u = units[i];
    u.resident = layout[i].resident;
    u.w_tier = layout[i].w;
    u.g_tier = layout[i].g;
    u.o_tier = layout[i].o;
    nvme.w = nvme.w || (!u.resident && u.w_tier == Tier::kNvme);
    nvme.o = nvme.o || u.o_tier == Tier::kNvme;
    nvme.g = nvme.g || u.g_tier == Tier::kNvme;
  }
  return nvme;
}

// The memory plan, before anything is allocated (with more than one rank, one plan for the
// job), or the error that says what does not fit.
void Engine::Impl::make_plan(const OnNvme& nvme) {
  const bool defaulted = !cfg.overlap_optimizer.has_value();
  cfg = Engine::with_device_defaults(cfg, dev);
  const int on_node = ranks_on_this_node(comm);
  if (cfg.host_budget_bytes == 0) cfg.host_budget_bytes = default_host_budget(on_node);
  if (defaulted && cfg.overlap_optimizer == false) {
    // Once a process: strata-prof --validate builds an engine a run, and the line fell between
    // the rows of its table.
    static std::atomic<bool> said{false};
    if (cfg.optimizer.device_fraction < 1 && cfg.grads.device_fraction < 1 && !said.exchange(true))
      log::info(
          "engine: the early optimizer step is off on the CPU-emulated device (its kernels use the "
          "cores "
          "the optimizer would); strata.overlap_optimizer true turns it on");
  }

  // The plan's inputs.
  PlanInputs in;
  for (auto& u : units) in.units.push_back({u.name, u.numel});
  in.world_size = world;
  in.device_capacity = dev.stats().capacity_bytes;
  in.host_capacity = cfg.host_budget_bytes;
  in.nvme_capacity =
      (nvme.w || nvme.o || nvme.g) ? nvme_capacity(cfg, rank, on_node, world) : UINT64_MAX;
  in.ranks_on_node = on_node;
  set_host_ram_inputs(in, dev, on_node);
  // The settings this host refuses (more optimizer threads than it runs), said on every rank
  // below when there are several: a rank that stopped alone left the others in a collective.
  std::string host_refused;
  try {
    Engine::check_host_settings(cfg);
  } catch (const Error& e) {
    if (world == 1) throw;
    host_refused = e.what();
  }
  if (world > 1) agree_on_plan_inputs(in, host_refused);
  plan = plan_memory(cfg, in);
  if (world > 1) agree_on_plan_outcome();
  if (!plan.fits) {
    // The problems first (the message's first lines name what to change), then the table
    // without them (its tail would say them again).
    std::string problems;
    for (auto& p : plan.problems) problems += "\n  " + p;
    MemoryPlan shown = plan;
    shown.problems.clear();
    STRATA_THROW(kOutOfMemory, "the training state does not fit:{}\n{}", problems, shown.table());
  }
  for (const std::string& n : plan.notes) log::info("engine: {}", n);
  early_step.on = plan.early_optimizer_step;
  grads_recorded.assign(units.size(), 0);
  grads_now.assign(units.size(), 0);
}

// One plan for the job: every rank plans with the least room any rank has (a rank that
// decided otherwise — the early step off, say — would issue other collectives), so all of
// them stop here together when it does not fit (the others would wait in their first
// collective). And every rank reads its free space before any writes its swap files
// below: this all-reduce is that barrier (a rank planning after a neighbour's files grew
// counted them against itself).
// The same all-reduce compares the settings that decide which collectives a rank issues,
// and in what order: ranks given different ones would hang or mix buffers in a collective
// (a double free, a truncated message) instead of saying why.
void Engine::Impl::agree_on_plan_inputs(PlanInputs& in, const std::string& host_refused) {
  double numel = 0, order = 0;  // (the units' sizes, and in which order)
  for (std::size_t i = 0; i < units.size(); ++i) {
    numel += double(units[i].numel);
    order += double(units[i].numel) * double(i + 1);
  }
  auto optional = [](const std::optional<bool>& b) { return b.has_value() ? double(*b) : -1.0; };
  const std::pair<const char*, double> same[] = {
      {"the number of units registered", double(units.size())},
      {"the parameters registered", numel},
      {"the units' sizes in their order (sum of size x position)", order},
      {"zero_optimization.stage", double(cfg.stage)},
      {"zero_optimization.reduce_bucket_size", double(cfg.reduce_bucket_size)},
      {"zero_optimization.stage3_prefetch_bucket_size", double(cfg.prefetch_bucket_size)},
      {"zero_optimization.stage3_max_live_parameters", double(cfg.max_live_parameters)},
      {"zero_optimization.stage3_max_reuse_distance", double(cfg.max_reuse_distance)},
      {"zero_optimization.stage3_param_persistence_threshold",
       double(cfg.param_persistence_threshold)},
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
      {"the optimizer state's placement (offload_optimizer: device fraction)",
       cfg.optimizer.device_fraction},
      {"the optimizer state's placement (offload_optimizer: host fraction)",
       cfg.optimizer.host_fraction},
      {"gradient_accumulation_steps", double(cfg.gradient_accumulation_steps)},
      {"gradient_clipping", cfg.gradient_clipping},
      {"the compute dtype (bf16 / fp16 / fp32)", double(int(cfg.compute_dtype))},
      {"strata.overlap_optimizer (-1: not given)", optional(cfg.overlap_optimizer)},
      {"strata.device_grad_norm (-1: not given)", optional(cfg.device_grad_norm)}};
  std::vector<double> v = {-double(in.device_capacity), -double(cfg.host_budget_bytes),
                           -double(in.nvme_capacity), host_refused.empty() ? 0.0 : 1.0};
  for (const auto& [key, x] : same) v.insert(v.end(), {x, -x});
  max_across_ranks(comm, v);
  if (!host_refused.empty()) STRATA_THROW(kInvalidArgument, "{}", host_refused);
  STRATA_REQUIRE(v[3] == 0,
                 "another rank's host refused its settings (its error says which and why)");
  for (std::size_t i = 0; i < std::size(same); ++i)
    STRATA_REQUIRE(
        v[4 + 2 * i] == -v[5 + 2 * i],
        "the ranks were given different engine settings: {} is {:g} on some and {:g} on others; "
        "give every rank the same config",
        same[i].first, -v[5 + 2 * i], v[4 + 2 * i]);
  in.device_capacity = bytes_from_double(-v[0]);
  cfg.host_budget_bytes = in.host_capacity = bytes_from_double(-v[1]);  // the pool's budget too
  in.nvme_capacity = bytes_from_double(-v[2]);
}

// One outcome for the job: every input above is the same on every rank but the NVMe paths
// (node-local), which can still decide whether it fits, and with it the early step.
void Engine::Impl::agree_on_plan_outcome() {
  double o[] = {plan.fits ? 0.0 : 1.0, plan.early_optimizer_step ? 1.0 : 0.0,
                plan.early_optimizer_step ? 0.0 : 1.0};
  max_across_ranks(comm, o);
  if (plan.fits && o[0] > 0)
    STRATA_THROW(
        kOutOfMemory,
        "the training state does not fit on another rank (its error says where and what to "
        "change)");
  STRATA_REQUIRE(
      o[0] > 0 || o[1] + o[2] < 2,
      "the ranks planned the early optimizer step differently (strata.overlap_optimizer left to "
      "the "
      "plan): set strata.overlap_optimizer, or give every rank the same config and NVMe paths");
}

// The streams, the pinned pool, the host optimizer and the swap stores the plan needs.
void Engine::Impl::open_streams_and_stores(const OnNvme& nvme) {
  fetch_s = dev.create_stream("fetch");
  comm_s = dev.create_stream("comm");
  opt_s = dev.create_stream("optimizer");
  wb_s = dev.create_stream("writeback");
  PinnedPoolOptions po;
  po.budget_bytes = cfg.host_budget_bytes;
  po.huge_pages = cfg.aio.use_hugepages;
  po.lock = cfg.pin_memory;
  po.device = &dev;
  // The plan's host lines as one registered piece: grown piece by piece, a GPU's pool left each
  // piece's unused tail behind (an H200: 130 MiB held against a plan of 116).
  po.initial_bytes = std::min<std::uint64_t>(plan.host_bytes, po.budget_bytes);
  pool = std::make_unique<PinnedPool>(po);
  if (std::any_of(units.begin(), units.end(),
                  [](const Unit& u) { return u.g_tier == Tier::kHost; }))
    norm_host = pinned(4 * units.size());
  CpuAdamWConfig ac;
  ac.policy = NonFinitePolicy::kReportOnly;
  ac.threads = cfg.optimizer_threads;
  ac.isa = cfg.optimizer_isa;
  cpu_adam = std::make_unique<CpuAdamW>(ac);

  auto store_options = [&](const std::vector<std::string>& paths, const char* key) {
    SwapStoreOptions so;
    so.paths = paths;
    // The job's rank (TP innermost, as make_process_groups): the DP groups' ranks share numbers.
    so.rank = job_rank();
    so.world_size = job_world();
    so.aio = cfg.aio;
    so.config_key = key;
    return so;
  };
  // One store where two pieces name the same directories (detail::same_dirs).
  using detail::same_dirs;
  if (nvme.w)
    w_store = std::make_unique<SwapStore>(
        store_options(cfg.param_nvme_paths, "zero_optimization.offload_param.nvme_path"));
  if (nvme.o) {
    if (w_store && same_dirs(cfg.optimizer_nvme_paths, cfg.param_nvme_paths)) {
      o_store = w_store.get();
    } else {
      o_store_own = std::make_unique<SwapStore>(
          store_options(cfg.optimizer_nvme_paths, "zero_optimization.offload_optimizer.nvme_path"));
      o_store = o_store_own.get();
    }
  }
  if (nvme.g) {  // beside the optimizer state (config: its nvme_path), else the weights
    if (o_store && same_dirs(cfg.grad_nvme_paths, cfg.optimizer_nvme_paths)) {
      g_store = o_store;
    } else if (w_store && same_dirs(cfg.grad_nvme_paths, cfg.param_nvme_paths)) {
      g_store = w_store.get();
    } else {
      g_store_own = std::make_unique<SwapStore>(
          store_options(cfg.grad_nvme_paths, detail::grad_nvme_path_key(cfg)));
      g_store = g_store_own.get();
    }
  }
}

// Initial state: this rank's shard of every unit, from its source a sub-group at a time (the
// padding beyond the unit's elements zero).
void Engine::Impl::place_initial_state() {
  Stream& up = *fetch_s;
  PutsInFlight pending(kPutsInFlight);
  const Placing placing(*this, pending);
  for (std::size_t ui = 0; ui < units.size(); ++ui) {
    Unit& u = units[ui];
    // compute weights as the optimizer's copy-out would produce them, and the optimizer state
    // (master | m | v, m and v zero), a sub-group at a time
    begin_put(ui, /*first=*/true);
    for (std::size_t g = 0; g < groups(u); ++g) {
      const detail::Range r = range(u, g);
      const std::size_t first = std::size_t(rank) * u.shard + r.first;
      const std::size_t given = first < u.numel ? std::min(r.size, u.numel - first) : 0;
      put_group(
          ui, g,
          [&](std::size_t k, float* dst) {
            std::fill(dst, dst + r.size, 0.0f);
            if (k == 0 && given > 0) u.source(first, given, dst);
          },
          &pending);
    }
    end_put(ui);
    if (early_step.eligible(u)) {  // the early step's second copies (the plan's lines)
      if (u.o_tier == Tier::kHost)
        u.early.o_alt = pinned(SwapStore::padded_bytes(detail::state_elems(u.shard) * 4));
      if (!u.resident && u.w_tier == Tier::kHost)
        u.early.w_alt = pinned(SwapStore::padded_bytes(u.shard * c_size));
      for (std::size_t g = 0; g < groups(u); ++g) {
        const std::size_t n = range(u, g).size;
        if (u.o_tier == Tier::kNvme)
          o_store->reserve(Impl::key('o', ui, 1, g), detail::state_elems(n) * 4);
        if (!u.resident && u.w_tier == Tier::kNvme)
          w_store->reserve(Impl::key('w', ui, 1, g), n * c_size);
      }
    }
    // gradient accumulator (NVMe: its keys' room taken now, so a full disk is said here)
    if (u.g_tier == Tier::kDevice) {
      u.g.dev = dev.alloc(u.shard * 4);
      up.fill(Impl::view(u.g.dev, DType::kF32, u.shard), 0.0f);
    } else if (u.g_tier == Tier::kHost) {
      u.g.host = pinned(u.shard * 4);
      std::memset(u.g.host->data(), 0, u.shard * 4);
    } else {
      for (const detail::Range p : grad_pieces({0, u.shard}))
        g_store->reserve(Impl::g_key(ui, p.first), p.size * 4);
    }
    up.synchronize();    // the staging above is released when this scope ends
    u.source = nullptr;  // what it holds (a copy of given values) goes now
  }
  pending.drain();
}

void Engine::set_tensor_parallel(Communicator& tp, std::vector<Ranges> counted) {
  Impl& s = *impl_;
  STRATA_REQUIRE(!s.finalized, "Engine::set_tensor_parallel after finalize()");
  STRATA_REQUIRE(counted.size() == s.units.size(),
                 "Engine::set_tensor_parallel: {} units' counted ranges for {} units",
                 counted.size(), s.units.size());
  STRATA_REQUIRE(
      &tp.device() == &s.dev,
      "Engine::set_tensor_parallel: the TP communicator is on device {}, the engine on {}",
      tp.device().name(), s.dev.name());
  for (std::size_t ui = 0; ui < counted.size(); ++ui)
    for (const auto& [first, count] : counted[ui])
      STRATA_REQUIRE(first + count <= s.units[ui].numel,
                     "Engine::set_tensor_parallel: range [{}, {}) beyond unit '{}' ({} elements)",
                     first, first + count, s.units[ui].name, s.units[ui].numel);
  s.tp = tp.world_size() > 1 ? &tp : nullptr;
  s.tp_counted = std::move(counted);
}

void Engine::set_weight_decay_exempt(std::vector<Ranges> exempt) {
  Impl& s = *impl_;
  STRATA_REQUIRE(!s.finalized, "Engine::set_weight_decay_exempt after finalize()");
  STRATA_REQUIRE(exempt.size() == s.units.size(),
                 "Engine::set_weight_decay_exempt: {} units' ranges for {} units", exempt.size(),
                 s.units.size());
  for (std::size_t ui = 0; ui < exempt.size(); ++ui)
    for (const auto& [first, count] : exempt[ui])
      STRATA_REQUIRE(first + count <= s.units[ui].numel,
                     "Engine::set_weight_decay_exempt: range [{}, {}) beyond unit '{}' ({} "
                     "elements)",
                     first, first + count, s.units[ui].name, s.units[ui].numel);
  s.wd_exempt_given = std::move(exempt);
}

void Engine::finalize() {
  Impl& s = *impl_;
  STRATA_REQUIRE(!s.finalized, "Engine::finalize() called twice");
  STRATA_REQUIRE(!s.units.empty(), "Engine::finalize(): no units registered");
  if (!s.wd_exempt_given.empty()) {  // the exempt ranges within this rank's shard, in order
    STRATA_REQUIRE(s.wd_exempt_given.size() == s.units.size(),
                   "Engine::finalize: weight decay's exempt ranges were given for {} units, and {} "
                   "are registered: call set_weight_decay_exempt after the last add_unit",
                   s.wd_exempt_given.size(), s.units.size());
    s.wd_exempt.assign(s.units.size(), {});
    for (std::size_t ui = 0; ui < s.units.size(); ++ui) {
      auto given = s.wd_exempt_given[ui];
      std::sort(given.begin(), given.end());
      const std::size_t lo = std::size_t(s.rank) * s.units[ui].shard, hi = lo + s.units[ui].shard;
      auto& out = s.wd_exempt[ui];
      for (const auto& [first, count] : given) {
        const std::size_t a = std::max(first, lo), b = std::min(first + count, hi);
        if (a >= b) continue;
        if (!out.empty() && out.back().first + out.back().size >= a - lo) {  // touching: merged
          out.back().size = std::max(out.back().first + out.back().size, b - lo) - out.back().first;
        } else {
          out.push_back({a - lo, b - a});
        }
      }
    }
    s.wd_exempt_given = {};
  }
  if (s.tp) {  // the counted ranges within this rank's shard
    s.tp_ranges.assign(s.units.size(), {});
    s.tp_all.assign(s.units.size(), 0);
    for (std::size_t ui = 0; ui < s.units.size(); ++ui) {
      const auto& c = s.tp_counted[ui];
      s.tp_all[ui] = c.size() == 1 && c[0].first == 0 && c[0].second >= s.units[ui].numel;
      const std::size_t lo = std::size_t(s.rank) * s.units[ui].shard, hi = lo + s.units[ui].shard;
      for (const auto& [first, count] : c) {
        const std::size_t a = std::max(first, lo), b = std::min(first + count, hi);
        if (a < b) s.tp_ranges[ui].push_back({a - lo, b - a});
      }
    }
    s.tp_counted = {};  // (the shard's ranges above are what the steps use)
  }
  const Impl::OnNvme nvme = s.assign_tiers();
  s.make_plan(nvme);
  s.open_streams_and_stores(nvme);
  s.place_initial_state();
  s.early_step.start();
  s.finalized = true;
}

void Engine::check_host_settings(const EngineConfig& config) {
  const std::string too_many =
      CpuAdamW::threads_problem(config.optimizer_threads);  // named as the key that asked
  STRATA_REQUIRE(too_many.empty(), "config key 'strata.optimizer_threads' = {}: {}",
                 config.optimizer_threads, too_many);
}

void Engine::set_next_lr(float lr) { impl_->early_step.next_lr = lr; }

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
