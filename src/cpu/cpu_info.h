// Facts about the host: library versions, CPU features, NUMA layout, huge pages.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "strata/build_info.h"

namespace strata::cpu {

// oneDNN, oneTBB and hwloc versions as the loaded libraries report them.
std::vector<ComponentVersion> component_versions();

std::string cpu_model();                      // "AMD EPYC ..." from /proc/cpuinfo
std::vector<std::string> cpu_isa_features();  // of avx2, f16c, fma, avx512f, avx512bw, avx512_bf16, amx_bf16 (cpuid)

// The code paths strata takes on this host, after STRATA_CPU_ISA (strata/adamw.h): the cap, the
// ISA of the CPU AdamW and of the model's row kernels, oneDNN's ISA, and each GEMM operand
// dtype's route through oneDNN (cpu/gemm_path.h). Throws on a bad STRATA_CPU_ISA (or
// STRATA_ADAMW_ISA / STRATA_MODEL_ISA), naming it.
struct CpuPaths {
  std::string cap;            // "auto" (no cap), "avx512", "avx2" or "scalar"
  std::string adamw, model;   // "avx512", "avx2", "scalar"
  std::string onednn;         // "avx2", "avx512_core_amx", ...
  struct Gemm {
    std::string dtype;  // "fp32", "bf16", "fp16"
    std::string route;  // "oneDNN native" or "widened to fp32"
    std::string impl;   // oneDNN's implementation of the GEMM that runs, e.g. "brg:avx512_core_bf16"
  };
  std::vector<Gemm> gemms;
};
CpuPaths cpu_paths();

struct NumaNode {
  int os_index = 0;
  std::size_t memory_bytes = 0;
  int cores = 0;
  std::string cpuset;  // hwloc list syntax, e.g. "0-15"
};
std::vector<NumaNode> numa_nodes();  // at least one node (a machine without NUMA has node 0)

struct HugePageInfo {
  std::size_t hugetlb_page_bytes = 0;  // Hugepagesize
  std::size_t hugetlb_total = 0;       // HugePages_Total (pages)
  std::size_t hugetlb_free = 0;        // HugePages_Free (pages)
  std::string thp_mode;                // "always", "madvise", "never" or "unavailable"
};
HugePageInfo huge_page_info();

// MemAvailable from /proc/meminfo: what can be allocated without swapping (0 when unknown).
// STRATA_TEST_MEMINFO names a file read instead of /proc/meminfo (tests of the RAM plan).
std::size_t mem_available_bytes();
// What this process may still take of the host's RAM: MemAvailable, or less where the process's
// cgroup (v2) sets memory.max (its limit less memory.current). 0 when unknown. (With
// STRATA_TEST_MEMINFO set, MemAvailable of that file alone.)
std::size_t ram_available_bytes();
// This process's resident memory now (/proc/self/statm), and its peak so far (getrusage).
std::size_t process_rss_bytes();
std::size_t process_peak_rss_bytes();

// The cores this process may run on (sched_getaffinity; hardware_concurrency where that fails):
// what taskset, a cgroup's cpuset or a batch scheduler left it, at least 1.
int usable_cores();

}  // namespace strata::cpu
