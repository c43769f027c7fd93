// Measuring strata's CUDA paths against the GPU's own bounds (strata-bench gpu): the fastest of
// cuBLASLt's algorithms for a GEMM, the GPU time of queued work, and the switch between the two
// variants of the model's CUDA kernels. A training program never needs this header.
//
// Each call goes to the CUDA backend, a module loaded at run time (strata/device.h probe_cuda):
// without it (no GPU, no CUDA libraries, a build without CUDA) each throws kUnsupported naming
// why. Safe to include in every build; it carries no CUDA types.
#pragma once

#include <cstddef>
#include <functional>

namespace strata {
class Stream;
struct MatmulDesc;
}  // namespace strata

namespace strata::gpu {

// The fastest of cuBLASLt's heuristic candidates for one GEMM (best_cublaslt_gemm).
struct GemmBest {
  double seconds = 0;  // per call
  int candidates = 0;  // candidates that ran and were timed
  int candidate = -1;  // the fastest one's rank in the heuristic's order (0 = its first choice)
  std::size_t workspace_bytes = 0;  // what the fastest one needs
};

// Times the GEMM `desc` describes (Stream::matmul's operands, layout and types; device buffers of
// `stream`'s device, a CUDA stream) with each of up to `max_candidates` cuBLASLt heuristic
// algorithms, `iters` calls each, on `stream`; blocks; returns the fastest: the bound that
// Stream::matmul (cuBLAS's default algorithm) is held to.
GemmBest best_cublaslt_gemm(Stream& stream, const MatmulDesc& desc, int max_candidates, int iters);

// Milliseconds of GPU time between CUDA events recorded on `stream` (a CUDA stream) before and
// after `queue` queues its work there; blocks until that work is done.
double time_queued_ms(Stream& stream, const std::function<void()>& queue);

// The model's CUDA kernels come in two variants behind the same ops: kSimple, the reference and
// the default, and kTiled (tensor-core attention, parallel column reductions), opt-in.
// STRATA_GPU_KERNELS=simple|tiled picks one for the process when the kernels are first used.
enum class KernelVariant { kSimple, kTiled };

// The variant the model's CUDA kernels run from now on, for every device of the process, and the
// current one. Safe to switch at any time; an op that runs several kernels reads it once.
void set_model_kernel_variant(KernelVariant variant);
KernelVariant model_kernel_variant();

}  // namespace strata::gpu
