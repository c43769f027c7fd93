// CpuAdamW: runtime ISA dispatch, the thread arena and its placement, and the step driver.
//
// Owns: the chosen kernels (from cpuid at run time, never from build flags), a oneTBB arena
// of `threads` workers and, when asked, an hwloc observer that binds each worker as it enters
// the arena (and gives the calling thread its own placement back when it leaves).
// Invariants:
//  - A step validates every shard and the hyper-parameters before touching memory.
//  - With NonFinitePolicy::kSkipStep a read-only pass counts non-finite gradients first and
//    nothing is written when it finds one.
//  - Work is cut into kTile-element tiles over all shards; a static partition gives each
//    worker one contiguous run of tiles (hardware prefetchers like long streams).
#include <hwloc.h>
#include <tbb/blocked_range.h>
#include <tbb/info.h>
#include <tbb/parallel_reduce.h>
#include <tbb/partitioner.h>
#include <tbb/task_arena.h>
#include <tbb/task_scheduler_observer.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "core/adamw_common.h"
#include "cpu/adamw_kernels.h"
#include "strata/error.h"
#include "strata/log.h"

namespace strata {
namespace {

constexpr std::size_t kTile = 16384;  // elements: ~0.5 MiB of state traffic, L2-sized
// Non-temporal copy-out stores only pay off when the step does not fit in the caches.
constexpr std::size_t kStreamCopyMinElems = std::size_t(1) << 19;

bool cpu_has(const char* feature) {
  __builtin_cpu_init();
  // __builtin_cpu_supports needs a literal; map the few names used here.
  const std::string f(feature);
  if (f == "avx512f") return __builtin_cpu_supports("avx512f");
  if (f == "avx512bw") return __builtin_cpu_supports("avx512bw");
  if (f == "avx512vl") return __builtin_cpu_supports("avx512vl");
  if (f == "avx512bf16") return __builtin_cpu_supports("avx512bf16");
  if (f == "avx2") return __builtin_cpu_supports("avx2");
  if (f == "fma") return __builtin_cpu_supports("fma");
  if (f == "f16c") return __builtin_cpu_supports("f16c");
  return false;
}

// Binds threads entering the arena to hwloc cpusets, slot by slot.
class Binder final : public tbb::task_scheduler_observer {
 public:
  Binder(tbb::task_arena& arena, hwloc_topology_t topo, std::vector<hwloc_bitmap_t> sets)
      : tbb::task_scheduler_observer(arena), topo_(topo), sets_(std::move(sets)) {
    observe(true);
  }
  ~Binder() override {
    observe(false);
    for (hwloc_bitmap_t s : sets_) hwloc_bitmap_free(s);
    hwloc_topology_destroy(topo_);
  }
  void on_scheduler_entry(bool is_worker) override {
    const int slot = tbb::this_task_arena::current_thread_index();
    if (slot < 0) return;
    if (!is_worker) {  // the caller's thread: remember its placement to give it back
      saved() = hwloc_bitmap_alloc();
      if (hwloc_get_cpubind(topo_, saved(), HWLOC_CPUBIND_THREAD) != 0) {
        hwloc_bitmap_free(saved());
        saved() = nullptr;
      }
    }
    if (hwloc_set_cpubind(topo_, sets_[std::size_t(slot) % sets_.size()], HWLOC_CPUBIND_THREAD) !=
        0)
      log::warn_once("adamw.bind",
                     "CpuAdamW: hwloc could not bind a worker thread; it runs unbound");
  }
  void on_scheduler_exit(bool is_worker) override {
    if (is_worker || saved() == nullptr) return;
    hwloc_set_cpubind(topo_, saved(), HWLOC_CPUBIND_THREAD);
    hwloc_bitmap_free(saved());
    saved() = nullptr;
  }

 private:
  static hwloc_bitmap_t& saved() {
    thread_local hwloc_bitmap_t s = nullptr;
    return s;
  }
  hwloc_topology_t topo_;
  std::vector<hwloc_bitmap_t> sets_;
};

}  // namespace

const char* isa_requirements(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return "avx512f, avx512bw and avx512vl";
    case Isa::kAvx2:
      return "avx2, fma and f16c";
    default:
      return "nothing";
  }
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAuto:
      return "auto";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kScalar:
      return "scalar";
  }
  return "?";
}

Isa parse_isa(std::string_view name) {
  for (Isa i : {Isa::kAuto, Isa::kAvx512, Isa::kAvx2, Isa::kScalar})
    if (name == isa_name(i)) return i;
  STRATA_THROW(kInvalidArgument, "unknown AdamW ISA '{}': use one of auto, avx512, avx2, scalar",
               name);
}

namespace {

bool cpu_runs(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return cpu_has("avx512f") && cpu_has("avx512bw") && cpu_has("avx512vl");
    case Isa::kAvx2:
      return cpu_has("avx2") && cpu_has("fma") && cpu_has("f16c");
    default:
      return true;
  }
}

// Paths from the widest down; a cap allows itself and what follows it.
int width(Isa isa) { return isa == Isa::kAvx512 ? 2 : isa == Isa::kAvx2 ? 1 : 0; }

Isa read_cap() {
  const char* env = std::getenv("STRATA_CPU_ISA");
  if (env == nullptr || *env == '\0') return Isa::kAuto;
  for (Isa i : {Isa::kAuto, Isa::kAvx512, Isa::kAvx2, Isa::kScalar})
    if (std::string_view(env) == isa_name(i)) return i;
  STRATA_THROW(kInvalidArgument,
               "STRATA_CPU_ISA='{}' is not one of auto, avx512, avx2, scalar: unset it or pick one",
               env);
}

}  // namespace

Isa cpu_isa_cap() {
  static const Isa cap = read_cap();
  return cap;
}

bool isa_supported(Isa isa) {
  if (isa == Isa::kAuto || isa == Isa::kScalar) return true;
  const Isa cap = cpu_isa_cap();
  return cpu_runs(isa) && (cap == Isa::kAuto || width(isa) <= width(cap));
}

std::string isa_unavailable(Isa isa) {
  if (isa_supported(isa)) return {};
  if (!cpu_runs(isa)) return fmt::format("this CPU lacks {}", isa_requirements(isa));
  return fmt::format("STRATA_CPU_ISA={} caps strata's CPU paths below it", isa_name(cpu_isa_cap()));
}

bool adamw_native_bf16() { return isa_supported(Isa::kAvx512) && cpu_has("avx512bf16"); }

bool adamw_streams_copy_out(Isa isa, std::size_t elements) {
  return (isa == Isa::kAuto ? adamw_selected_isa() : isa) == Isa::kAvx512 &&
         elements >= kStreamCopyMinElems;
}

Isa isa_from_env(const char* var) {
  const char* env = std::getenv(var);
  if (env == nullptr || *env == '\0') return Isa::kAuto;
  Isa forced = Isa::kAuto;
  try {
    forced = parse_isa(env);
  } catch (
      const Error&) {  // it said "unknown AdamW ISA", of a variable the user may not know is set
    STRATA_THROW(kInvalidArgument,
                 "{}='{}' is not one of auto, avx512, avx2, scalar: unset it or "
                 "pick one",
                 var, env);
  }
  if (forced != Isa::kAuto && !isa_supported(forced))
    STRATA_THROW(kUnsupported, "{}={} but {}; unset it or pick a path it has", var, env,
                 isa_unavailable(forced));
  return forced;
}

Isa adamw_selected_isa() {
  if (const Isa forced = isa_from_env("STRATA_ADAMW_ISA"); forced != Isa::kAuto) return forced;
  if (isa_supported(Isa::kAvx512)) return Isa::kAvx512;
  if (isa_supported(Isa::kAvx2)) return Isa::kAvx2;
  return Isa::kScalar;
}

struct CpuAdamW::Impl {
  CpuAdamWConfig config;
  Isa isa = Isa::kScalar;
  cpu::adamw::Kernels kernels{};
  int threads = 1;
  std::unique_ptr<tbb::task_arena> arena;
  std::unique_ptr<Binder> binder;

  void bind(const CpuAdamWConfig& c) {
    hwloc_topology_t topo = nullptr;
    if (hwloc_topology_init(&topo) != 0 || hwloc_topology_load(topo) != 0) {
      if (topo) hwloc_topology_destroy(topo);
      log::warn_once("adamw.topology",
                     "CpuAdamW: hwloc cannot read the topology; threads run unbound");
      return;
    }
    hwloc_const_cpuset_t scope = hwloc_topology_get_topology_cpuset(topo);
    if (c.numa_node >= 0) {
      hwloc_obj_t node =
          hwloc_get_numanode_obj_by_os_index(topo, static_cast<unsigned>(c.numa_node));
      if (node == nullptr) hwloc_topology_destroy(topo);
      STRATA_REQUIRE(node != nullptr,
                     "CpuAdamW: NUMA node {} does not exist on this machine "
                     "(strata-info lists the nodes)",
                     c.numa_node);
      scope = node->cpuset;
    }
    std::vector<hwloc_bitmap_t> sets;
    if (c.binding == ThreadBinding::kNumaNode) {
      sets.push_back(hwloc_bitmap_dup(scope));
    } else {
      const int cores = hwloc_get_nbobjs_inside_cpuset_by_type(topo, scope, HWLOC_OBJ_CORE);
      for (int i = 0; i < cores; ++i) {
        hwloc_obj_t core =
            hwloc_get_obj_inside_cpuset_by_type(topo, scope, HWLOC_OBJ_CORE, unsigned(i));
        if (core != nullptr) sets.push_back(hwloc_bitmap_dup(core->cpuset));
      }
    }
    if (sets.empty()) {
      hwloc_topology_destroy(topo);
      log::warn_once("adamw.cores",
                     "CpuAdamW: hwloc found no cores to bind to; threads run unbound");
      return;
    }
    binder = std::make_unique<Binder>(*arena, topo, std::move(sets));
  }
};

CpuAdamW::CpuAdamW(const CpuAdamWConfig& c) : impl_(std::make_unique<Impl>()) {
  impl_->config = c;
  STRATA_REQUIRE(c.threads >= 0, "CpuAdamW threads must be >= 0 (0 = every core), got {}",
                 c.threads);
  STRATA_REQUIRE(c.binding != ThreadBinding::kNumaNode || c.numa_node >= 0,
                 "CpuAdamW binding to a NUMA node needs numa_node >= 0");
  Isa isa = c.isa;
  if (isa == Isa::kAuto) {
    isa = adamw_selected_isa();
  } else if (!isa_supported(isa)) {
    STRATA_THROW(kUnsupported, "CpuAdamW isa {}: {}; use Isa::kAuto", isa_name(isa),
                 isa_unavailable(isa));
  }
  impl_->isa = isa;
  switch (isa) {
    case Isa::kAvx512:
      impl_->kernels = cpu::adamw::avx512_kernels(adamw_native_bf16());
      break;
    case Isa::kAvx2:
      impl_->kernels = cpu::adamw::avx2_kernels();
      break;
    default:
      impl_->kernels = cpu::adamw::scalar_kernels();
      break;
  }
  // More threads than the process may run on would be reported here and not run (oneTBB keeps to
  // the cores and says so at exit).
  const std::string too_many = threads_problem(c.threads);
  STRATA_REQUIRE(too_many.empty(), "CpuAdamW threads = {}: {}", c.threads, too_many);
  impl_->threads = c.threads > 0 ? c.threads : tbb::info::default_concurrency();
  impl_->arena = std::make_unique<tbb::task_arena>(impl_->threads);
  impl_->arena->initialize();
  if (c.binding != ThreadBinding::kNone) impl_->bind(c);
}

CpuAdamW::~CpuAdamW() = default;

std::string CpuAdamW::threads_problem(int threads) {
  const int cores = tbb::info::default_concurrency();
  if (threads <= cores) return {};
  const bool launched =
      std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE") || std::getenv("PMIX_RANK");
  return fmt::format(
      "oneTBB runs at most {} thread{} in this process (its CPU affinity{}); use 0 (every core) or "
      "at "
      "most {}{}",
      cores, cores == 1 ? "" : "s", launched ? ", which the MPI launcher set" : " or CPU quota",
      cores,
      launched
          ? " (mpirun binds each rank to its share of the cores: --bind-to none, or fewer ranks "
            "per node, gives a rank more)"
          : "");
}

Isa CpuAdamW::isa() const noexcept { return impl_->isa; }
int CpuAdamW::threads() const noexcept { return impl_->threads; }
const CpuAdamWConfig& CpuAdamW::config() const noexcept { return impl_->config; }

AdamWResult CpuAdamW::step(const AdamWOptions& options, std::span<const AdamWShard> shards) {
  return step(options, shards, impl_->config.policy);
}

AdamWResult CpuAdamW::step(const AdamWOptions& options, std::span<const AdamWShard> shards,
                           NonFinitePolicy policy) {
  const detail::AdamWScalars k = detail::adamw_scalars(options);
  std::size_t total = 0;
  for (std::size_t i = 0; i < shards.size(); ++i) {
    const std::string where = fmt::format("CpuAdamW::step shard {}", i);
    const AdamWShard& s = shards[i];
    detail::validate_adamw_shard(s, where);
    // Unset sources (null) are skipped; validation made sure the rest have memory.
    for (const TensorRef* t :
         {&s.params, &s.grads, &s.m, &s.v, &s.params_src, &s.m_src, &s.v_src}) {
      STRATA_REQUIRE(t->mem.ptr == nullptr || t->mem.space == MemSpace::kHost,
                     "{}: a tensor is in device memory; CpuAdamW works on host memory "
                     "(host_tensor(...)); run Stream::adamw for device buffers",
                     where);
    }
    total += s.params.numel;
  }

  struct Tile {
    std::uint32_t shard;
    std::size_t lo, hi;
  };
  std::vector<cpu::adamw::Arrays> arrays;
  std::vector<Tile> tiles;
  // A shard weight decay skips steps with decay 1: p * 1 is p, the weight_decay-0 step's bits.
  detail::AdamWScalars k_exempt = k;
  k_exempt.decay = 1.0f;
  arrays.reserve(shards.size());
  for (std::size_t i = 0; i < shards.size(); ++i) {
    const AdamWShard& s = shards[i];
    const bool copy = s.copy_out.numel > 0;
    arrays.push_back({static_cast<float*>(s.params.mem.ptr), s.m.mem.ptr, s.v.mem.ptr,
                      static_cast<const float*>(s.params_in().mem.ptr), s.m_in().mem.ptr,
                      s.v_in().mem.ptr, s.grads.mem.ptr, copy ? s.copy_out.mem.ptr : nullptr,
                      s.grads.dtype, s.m.dtype, s.copy_out.dtype,
                      adamw_streams_copy_out(impl_->isa, total)});
    for (std::size_t lo = 0; lo < s.params.numel; lo += kTile)
      tiles.push_back({static_cast<std::uint32_t>(i), lo, std::min(s.params.numel, lo + kTile)});
  }

  // Sums fn(tile) over all tiles, on the arena for more than one tile.
  auto reduce = [&](auto fn) -> std::size_t {
    if (tiles.size() <= 1 || impl_->threads == 1) {
      std::size_t sum = 0;
      for (const Tile& t : tiles) sum += fn(t);
      return sum;
    }
    return impl_->arena->execute([&] {
      return tbb::parallel_reduce(
          tbb::blocked_range<std::size_t>(0, tiles.size()), std::size_t(0),
          [&](const tbb::blocked_range<std::size_t>& r, std::size_t sum) {
            for (std::size_t i = r.begin(); i < r.end(); ++i) sum += fn(tiles[i]);
            return sum;
          },
          [](std::size_t a, std::size_t b) { return a + b; }, tbb::static_partitioner());
    });
  };

  AdamWResult result;
  const cpu::adamw::Kernels& kern = impl_->kernels;
  if (policy == NonFinitePolicy::kSkipStep) {
    result.non_finite = reduce([&](const Tile& t) {
      const auto& a = arrays[t.shard];
      return kern.count_non_finite(k.grad_scale, a.g, a.grad_dtype, t.lo, t.hi);
    });
    if (result.non_finite > 0) {
      result.skipped = true;
      return result;
    }
  }
  const std::size_t bad = reduce([&](const Tile& t) {
    return kern.update(shards[t.shard].decay ? k : k_exempt, arrays[t.shard], t.lo, t.hi);
  });
  if (policy == NonFinitePolicy::kReportOnly) result.non_finite = bad;
  return result;
}

}  // namespace strata
