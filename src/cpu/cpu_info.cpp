// Host facts for strata-info and the memory planner. Everything here is read at run time
// from the loaded libraries, cpuid, hwloc and /proc or /sys, never from build-time guesses,
// and nothing here throws: a fact that cannot be read is reported as absent.
#include "cpu/cpu_info.h"

#include <hwloc.h>
#include <oneapi/dnnl/dnnl.h>
#include <oneapi/tbb/version.h>
#include <sched.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <fmt/format.h>

#include "cpu/gemm_path.h"
#include "cpu/model_simd.h"
#include "strata/adamw.h"

namespace strata::cpu {

std::vector<ComponentVersion> component_versions() {
  std::vector<ComponentVersion> out;
  const dnnl_version_t* d = dnnl_version();
  out.push_back({"onednn", fmt::format("{}.{}.{}", d->major, d->minor, d->patch)});
  out.push_back({"tbb", TBB_runtime_version()});
  // hwloc reports its API version at run time (2.9.x releases carry API 2.8.0), so say which
  // is which.
  const unsigned v = hwloc_get_api_version();
  out.push_back({"hwloc", fmt::format("{}.{}.{} API (headers {})", v >> 16, (v >> 8) & 0xff,
                                      v & 0xff, HWLOC_VERSION)});
  return out;
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    // x86 says "model name", arm64 kernels may say "Model" or nothing useful.
    if (line.rfind("model name", 0) == 0 || line.rfind("Model", 0) == 0) {
      const auto colon = line.find(':');
      if (colon == std::string::npos) continue;
      std::string v = line.substr(colon + 1);
      const auto b = v.find_first_not_of(" \t");
      return b == std::string::npos ? std::string("unknown") : v.substr(b);
    }
  }
  return "unknown";
}

std::vector<std::string> cpu_isa_features() {
  std::vector<std::string> out;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  // __builtin_cpu_supports also checks that the OS saves the AVX / AVX-512 state.
  const bool avx512f = __builtin_cpu_supports("avx512f");
  if (__builtin_cpu_supports("avx2")) out.push_back("avx2");
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29))) out.push_back("f16c");
  if (__builtin_cpu_supports("fma")) out.push_back("fma");
  if (avx512f) out.push_back("avx512f");
  if (__builtin_cpu_supports("avx512bw")) out.push_back("avx512bw");
  if (avx512f && __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5)))
    out.push_back("avx512_bf16");
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 22))) out.push_back("amx_bf16");
#endif
  return out;
}

CpuPaths cpu_paths() {
  CpuPaths p;
  p.cap = isa_name(cpu_isa_cap());
  p.adamw = isa_name(adamw_selected_isa());
  p.model = isa_name(simd::model_isa());
  for (const GemmPath& g : gemm_paths())
    p.gemms.push_back({std::string(dtype_name(g.dtype)), gemm_route_name(g.route), g.impl});
  p.onednn = onednn_isa();
  return p;
}

namespace {

std::size_t meminfo_value(const std::string& key, std::size_t unit_bytes) {
  const char* fake = std::getenv("STRATA_TEST_MEMINFO");
  std::ifstream f(fake && *fake ? fake : "/proc/meminfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(key + ":", 0) == 0)
      return std::strtoull(line.c_str() + key.size() + 1, nullptr, 10) * unit_bytes;
  }
  return 0;
}

}  // namespace

std::vector<NumaNode> numa_nodes() {
  std::vector<NumaNode> out;
  hwloc_topology_t topo = nullptr;
  if (hwloc_topology_init(&topo) == 0 && hwloc_topology_load(topo) == 0) {
    for (hwloc_obj_t n = hwloc_get_next_obj_by_type(topo, HWLOC_OBJ_NUMANODE, nullptr); n;
         n = hwloc_get_next_obj_by_type(topo, HWLOC_OBJ_NUMANODE, n)) {
      NumaNode node;
      node.os_index = static_cast<int>(n->os_index);
      node.memory_bytes = n->attr ? n->attr->numanode.local_memory : 0;
      node.cores = hwloc_get_nbobjs_inside_cpuset_by_type(topo, n->cpuset, HWLOC_OBJ_CORE);
      char* s = nullptr;
      if (n->cpuset && hwloc_bitmap_list_asprintf(&s, n->cpuset) >= 0 && s) {
        node.cpuset = s;
        std::free(s);
      }
      out.push_back(std::move(node));
    }
  }
  if (topo) hwloc_topology_destroy(topo);
  if (out.empty()) {
    NumaNode node;
    node.memory_bytes = meminfo_value("MemTotal", 1024);
    out.push_back(node);
  }
  return out;
}

std::size_t last_level_cache_bytes() {
  std::size_t out = 0;
  hwloc_topology_t topo = nullptr;
  if (hwloc_topology_init(&topo) == 0 && hwloc_topology_load(topo) == 0) {
    for (hwloc_obj_type_t t : {HWLOC_OBJ_L1CACHE, HWLOC_OBJ_L2CACHE, HWLOC_OBJ_L3CACHE,
                               HWLOC_OBJ_L4CACHE, HWLOC_OBJ_L5CACHE})
      for (hwloc_obj_t c = hwloc_get_next_obj_by_type(topo, t, nullptr); c;
           c = hwloc_get_next_obj_by_type(topo, t, c))
        if (c->attr) out = std::max<std::size_t>(out, c->attr->cache.size);
  }
  if (topo) hwloc_topology_destroy(topo);
  return out;
}

std::size_t mem_available_bytes() { return meminfo_value("MemAvailable", 1024); }

std::size_t ram_available_bytes() {
  std::size_t avail = mem_available_bytes();
  if (const char* fake = std::getenv("STRATA_TEST_MEMINFO"); fake && *fake) return avail;
  // cgroup v2: this process's group, from /proc/self/cgroup ("0::/path").
  std::ifstream cg("/proc/self/cgroup");
  std::string line, path;
  while (std::getline(cg, line))
    if (line.rfind("0::", 0) == 0) path = line.substr(3);
  if (path.empty()) return avail;
  const std::string dir = "/sys/fs/cgroup" + (path == "/" ? std::string() : path);
  std::ifstream max_f(dir + "/memory.max"), cur_f(dir + "/memory.current");
  std::string max_s;
  std::size_t cur = 0;
  if (!(max_f >> max_s) || max_s == "max" || !(cur_f >> cur)) return avail;
  const std::size_t limit = std::strtoull(max_s.c_str(), nullptr, 10);
  const std::size_t left = limit > cur ? limit - cur : 0;
  return avail == 0 ? left : std::min(avail, left);
}

namespace {
// /proc/self/statm's first two fields, the process's size (all it has mapped, VmSize) and its
// resident part, in bytes; {0, 0} when unreadable.
struct Statm {
  std::uint64_t size = 0, resident = 0;
};
Statm read_statm() {
  std::ifstream f("/proc/self/statm");
  std::uint64_t size = 0, resident = 0;
  if (!(f >> size >> resident)) return {};
  const auto page = std::uint64_t(::sysconf(_SC_PAGESIZE));
  return {size * page, resident * page};
}
}  // namespace

std::size_t process_rss_bytes() { return std::size_t(read_statm().resident); }

std::size_t process_peak_rss_bytes() {
  rusage ru{};
  return ::getrusage(RUSAGE_SELF, &ru) == 0 ? std::size_t(ru.ru_maxrss) * 1024 : 0;
}

double process_cpu_seconds() {
  timespec ts{};
  if (::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts) != 0) return 0;
  return double(ts.tv_sec) + double(ts.tv_nsec) / 1e9;
}

int usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) != 0)
    return int(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, CPU_COUNT(&set));
}

HugePageInfo huge_page_info() {
  HugePageInfo h;
  h.hugetlb_page_bytes = meminfo_value("Hugepagesize", 1024);
  h.hugetlb_total = meminfo_value("HugePages_Total", 1);
  h.hugetlb_free = meminfo_value("HugePages_Free", 1);
  h.thp_mode = "unavailable";
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  if (std::getline(f, line)) {
    const auto open = line.find('['), close = line.find(']');
    if (open != std::string::npos && close != std::string::npos && close > open)
      h.thp_mode = line.substr(open + 1, close - open - 1);
  }
  return h;
}

}  // namespace strata::cpu

namespace strata {

std::uint64_t address_space_limit() {
  rlimit r{};
  if (::getrlimit(RLIMIT_AS, &r) != 0 || r.rlim_cur == RLIM_INFINITY) return 0;
  return std::uint64_t(r.rlim_cur);
}

std::uint64_t address_space_used() { return cpu::read_statm().size; }

std::uint64_t address_space_headroom() {
  rlimit st{};
  std::uint64_t stack = std::uint64_t(8) << 20;
  if (::getrlimit(RLIMIT_STACK, &st) == 0 && st.rlim_cur != RLIM_INFINITY)
    stack = std::uint64_t(st.rlim_cur);
  const std::uint64_t threads = std::max(1u, std::thread::hardware_concurrency());
  return (std::uint64_t(512) << 20) + threads * (stack + (std::uint64_t(64) << 20));
}

std::string address_space_note() {
  const std::uint64_t limit = address_space_limit();
  if (limit == 0) return {};
  return fmt::format(
      "; the process's address-space limit (`ulimit -v`) is {} MiB, and it counts address space "
      "reserved and not yet used (each thread's stack, the emulated device's whole capacity): "
      "raise it (`ulimit -v unlimited`)",
      limit >> 20);
}

}  // namespace strata
