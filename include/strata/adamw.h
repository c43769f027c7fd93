// CPU AdamW: the fused, SIMD, multi-threaded optimizer step over host-resident shards, and
// the scalars every AdamW backend (CPU and CUDA) shares so that they compute the same bits.
//
// One pass over each shard reads params (fp32 master), m, v and the gradient, writes
// params, m, v and (optionally) the bf16/fp16 compute copy. The instruction set is chosen at
// run time from cpuid (AVX-512, AVX2 + FMA + F16C, scalar), never from the build machine;
// every path performs the same IEEE fp32 operations in the same order, so all paths (and
// the CUDA kernel) produce identical bits. The exact order is in docs/adamw.md, "Semantics".
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "strata/device.h"

namespace strata {

enum class Isa { kAuto, kAvx512, kAvx2, kScalar };

const char* isa_name(Isa isa);
// "auto", "avx512", "avx2", "scalar"; throws naming the allowed values otherwise.
Isa parse_isa(std::string_view name);
// The path the environment variable `var` (STRATA_ADAMW_ISA, STRATA_MODEL_ISA) forces: kAuto when
// it is unset, empty or "auto"; throws naming the variable when its value is no path's name, or a
// path isa_supported() refuses here.
Isa isa_from_env(const char* var);
// The widest CPU path strata may take, from STRATA_CPU_ISA: kAuto (unset or "auto": no cap),
// kAvx512, kAvx2 or kScalar. Every CPU dispatcher keeps at or below it (AdamW, the model's row
// kernels, and oneDNN's GEMMs through oneDNN's own maximum ISA, see cpu/gemm_path.h), so a host
// with AVX-512 can prove the AVX2 and scalar paths. Read once per process; an unknown value
// throws naming the variable and its values.
Isa cpu_isa_cap();
// Whether strata may run `isa` here (kAuto and kScalar: always): the CPU has it (kAvx512 needs
// avx512f/bw/vl, kAvx2 needs avx2, fma and f16c) and STRATA_CPU_ISA does not cap it away.
bool isa_supported(Isa isa);
// The CPU features `isa` needs, in words ("nothing" for kAuto and kScalar).
const char* isa_requirements(Isa isa);
// Why isa_supported(isa) is false, in words ("this CPU lacks avx2, fma and f16c", or
// "STRATA_CPU_ISA=avx2 caps strata's CPU paths below it"); empty when it is supported.
std::string isa_unavailable(Isa isa);
// The path a CpuAdamW with Isa::kAuto takes: STRATA_ADAMW_ISA when set (an error if this CPU
// lacks it), else the best the CPU supports.
Isa adamw_selected_isa();
// Whether the AVX-512 path converts to bf16 with AVX512_BF16 (vcvtneps2bf16) on this CPU.
bool adamw_native_bf16();
// Whether a CpuAdamW step on `isa` (kAuto resolved as the step resolves it) over `elements`
// parameters in all writes its bf16 copy-out with non-temporal stores (and, stepping out of
// place, its p, m and v where they are aligned): the AVX-512 path only, and only from 2^19
// elements (below that the copy stays in the caches for whoever reads it next).
bool adamw_streams_copy_out(Isa isa, std::size_t elements);

struct AdamWResult {
  // Gradients (after grad_scale) that were NaN or Inf. With kSkipStep the pre-check's count;
  // with kReportOnly the update pass's count.
  std::size_t non_finite = 0;
  bool skipped = false;  // kSkipStep found some: nothing was written
  bool all_finite() const noexcept { return non_finite == 0; }
};

// How worker threads are placed (through hwloc).
enum class ThreadBinding {
  kNone,      // the OS places them
  kCores,     // worker i is bound to core i (of the NUMA node when numa_node >= 0)
  kNumaNode,  // every worker may run on any core of numa_node
};

struct CpuAdamWConfig {
  int threads = 0;  // oneTBB workers (the calling thread included); 0 = every core
  Isa isa = Isa::kAuto;
  NonFinitePolicy policy = NonFinitePolicy::kSkipStep;
  ThreadBinding binding = ThreadBinding::kNone;
  int numa_node = -1;  // for kCores / kNumaNode; -1 = the whole machine (kCores only)
};

// Runs AdamW steps over host memory. Construction resolves the ISA (throws kUnsupported if
// the forced one is missing) and makes the thread arena; step() may be called from any
// thread, but not concurrently on one object.
class CpuAdamW {
 public:
  explicit CpuAdamW(const CpuAdamWConfig& config = {});
  ~CpuAdamW();
  CpuAdamW(const CpuAdamW&) = delete;
  CpuAdamW& operator=(const CpuAdamW&) = delete;

  // One step over every shard (host tensors: host_tensor(...)); validates everything
  // (lengths, dtypes, null or misaligned pointers, hyper-parameters) before writing anything.
  AdamWResult step(const AdamWOptions& options, std::span<const AdamWShard> shards);
  AdamWResult step(const AdamWOptions& options, const AdamWShard& shard) {
    return step(options, std::span<const AdamWShard>(&shard, 1));
  }
  // The same with the non-finite policy of this call instead of config().policy.
  AdamWResult step(const AdamWOptions& options, std::span<const AdamWShard> shards,
                   NonFinitePolicy policy);
  AdamWResult step(const AdamWOptions& options, const AdamWShard& shard, NonFinitePolicy policy) {
    return step(options, std::span<const AdamWShard>(&shard, 1), policy);
  }

  Isa isa() const noexcept;
  int threads() const noexcept;
  const CpuAdamWConfig& config() const noexcept;

  // Why `threads` is more than oneTBB runs in this process ("oneTBB runs at most 2 threads in
  // this process (its CPU affinity ...); use 0 (every core) or at most 2"); empty when it is not.
  // The constructor refuses such a config with it; callers with a config key of their own name it.
  static std::string threads_problem(int threads);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata
