// Which way each matmul input dtype goes through oneDNN on this host, decided once per process.
//
// oneDNN has a bf16 (and fp16) matmul only on some CPUs: Debian's 2.6 has bf16 from AVX-512
// (emulated on avx512_core, native with AVX512_BF16 or AMX) and no fp16 below AVX512-FP16. Where
// it has none, the operands are widened to fp32 (exact) and run through oneDNN's fp32 GEMM. Both
// routes have one meaning: bf16 or fp16 operands, fp32 accumulation, one rounding of a bf16
// output. The choice comes from what oneDNN reports when asked for a small primitive of each
// dtype, once, before any other primitive: never from a failure in the middle of a step.
//
// It is also where STRATA_CPU_ISA reaches oneDNN: with the cap at avx2 (or scalar) and no
// ONEDNN_MAX_CPU_ISA of the user's, oneDNN's maximum ISA is set to AVX2 (SSE4.1), so a host with
// AVX-512 runs every GEMM as an AVX2-only host does.
#pragma once

#include <string>
#include <vector>

#include "strata/dtype.h"

namespace strata::cpu {

enum class GemmRoute { kNative, kWidened };

// "oneDNN native" or "widened to fp32".
const char* gemm_route_name(GemmRoute r);

// The route of matmuls whose operands are `in` (kF32: always native). The first call (from any
// function here) sets oneDNN's maximum ISA and runs the probes; it must come before any other
// oneDNN primitive is made, which is why cpu::Matmul and the attention's workspace call it first.
GemmRoute gemm_route(DType in);

struct GemmPath {
  DType dtype;       // the operands' dtype: fp32, bf16, fp16
  GemmRoute route;   // as gemm_route() now says
  std::string impl;  // oneDNN's implementation of the GEMM that runs ("brg:avx512_core_bf16")
};
// fp32, bf16 and fp16, for strata-info and the benchmarks.
std::vector<GemmPath> gemm_paths();

// The ISA oneDNN's kernels use here ("avx2", "avx512_core_amx"), after any cap.
std::string onednn_isa();

// For tests: runs `in`'s matmuls on `route` from now on. kNative where oneDNN has no such
// primitive here throws (kUnsupported); kF32 takes kNative only. Not thread-safe against
// running matmuls.
void set_gemm_route(DType in, GemmRoute route);
// Whether oneDNN has a native `in` matmul on this host (under the cap).
bool gemm_native_available(DType in);

}  // namespace strata::cpu
