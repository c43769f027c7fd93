// Facts about the machine strata runs on, as strata sees them: the CPU (model, ISA features,
// the code paths strata takes), host memory and NUMA, the GPUs and where the CUDA libraries
// were loaded from, and whether io_uring can be used. What strata-info prints and the
// benchmarks size themselves by.
//
// Every fact is read at run time (cpuid, hwloc, /proc and /sys, the loaded libraries), never
// guessed at build time. Nothing here throws except cpu_paths (on a bad STRATA_CPU_ISA): a fact
// that cannot be read is reported as absent ("unknown", 0, empty). Safe to call in every build:
// without CUDA compiled in, without the CUDA libraries or without a driver the GPU facts are
// empty. Library versions: strata/build_info.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace strata {

// The process's address-space limit (RLIMIT_AS, `ulimit -v`) in bytes, 0 when there is none.
std::uint64_t address_space_limit();
// What to add to the message of a reservation or a thread that failed: "" without such a limit,
// else the limit in MiB, that it counts address space reserved and not yet used (each thread's
// stack, the emulated device's whole capacity), and to raise it.
std::string address_space_note();
// The address space the process holds now (VmSize: /proc/self/statm's size) in bytes, 0 unknown.
std::uint64_t address_space_used();
// What an address-space limit must leave free beside the emulated device's reservation for
// the kernels and the threads still to start: 512 MiB (oneDNN's generated code: with about 200
// it crashed, SIGSEGV, on a 2-core host) and per hardware thread one thread stack (RLIMIT_STACK)
// and one glibc malloc arena (64 MiB of address space each).
std::uint64_t address_space_headroom();
// The least address space the tools that compute run in: below it oneDNN's code generation crashed
// (SIGSEGV in dnnl_primitive_create at 300 MiB) and the thread pools failed to start (500 MiB).
inline constexpr std::uint64_t kMinAddressSpace = std::uint64_t(1) << 30;

// This host's name (gethostname), "?" when it cannot be read: the name strata's files and folders
// give the host that wrote them (a swap folder's owner, a work folder, a half-written checkpoint).
std::string this_host();

}  // namespace strata

namespace strata::cpu {

std::string cpu_model();  // "AMD EPYC ..." from /proc/cpuinfo; "unknown"
std::vector<std::string>
cpu_isa_features();  // of avx2, f16c, fma, avx512f, avx512bw, avx512_bf16, amx_bf16 (cpuid)

// The code paths strata takes on this host, after STRATA_CPU_ISA (strata/adamw.h): the cap, the
// ISA of the CPU AdamW and of the model's row kernels, oneDNN's ISA, and each GEMM operand
// dtype's route through oneDNN. Throws on a bad STRATA_CPU_ISA (or STRATA_ADAMW_ISA /
// STRATA_MODEL_ISA), naming it.
struct CpuPaths {
  std::string cap;           // "auto" (no cap), "avx512", "avx2" or "scalar"
  std::string adamw, model;  // "avx512", "avx2", "scalar"
  std::string onednn;        // "avx2", "avx512_core_amx", ...
  struct Gemm {
    std::string dtype;  // "fp32", "bf16", "fp16"
    std::string route;  // "oneDNN native" or "widened to fp32"
    std::string impl;  // oneDNN's implementation of the GEMM that runs, e.g. "brg:avx512_core_bf16"
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
// The largest cache of the host (its last level, e.g. a socket's L3), in bytes (hwloc); 0 when
// unknown.
std::size_t last_level_cache_bytes();

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
// This process's resident memory now (/proc/self/statm).
std::size_t process_rss_bytes();

// The cores this process may run on (sched_getaffinity; hardware_concurrency where that fails):
// what taskset, a cgroup's cpuset or a batch scheduler left it, at least 1.
int usable_cores();
// This process's CPU time so far, every thread's, in seconds (CLOCK_PROCESS_CPUTIME_ID): over a
// stretch of wall time, the cores the process kept busy.
double process_cpu_seconds();

}  // namespace strata::cpu

namespace strata::gpu {

// One line per visible GPU: "cuda:0 NVIDIA H200, 139.8 GiB, sm_90, PCI 0000:19:00.0"; empty
// without a usable GPU (strata/device.h probe_cuda says why).
std::vector<std::string> device_descriptions();

// The CUDA libraries and the CUDA module in load order, with the file each was loaded from:
// {"libcudart.so.13", "/usr/local/cuda/lib64/libcudart.so.13"}. Loads them if not yet done;
// empty when they could not all be found (probe_cuda().reason says where it looked).
struct LoadedLibrary {
  std::string name;
  std::string path;
};
std::vector<LoadedLibrary> cuda_libraries();

}  // namespace strata::gpu

namespace strata::nvme {

// Whether io_uring can be used here (old kernels and seccomp profiles forbid it); without it
// the NVMe engine runs on a pread/pwrite thread pool.
struct UringProbe {
  bool available = false;
  std::string reason;   // why not, with the errno text
  std::string version;  // liburing version compiled against
};
// Creates and destroys a small ring once; cached after the first call.
UringProbe probe_io_uring();

}  // namespace strata::nvme
