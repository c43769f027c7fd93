// Launchers for strata's element-wise and reduction kernels on CUDA (cuda_kernels.cu).
//
// Each launcher queues its kernel(s) on `stream` and returns cudaGetLastError() after the
// launch, so the caller (cuda_device.cpp) checks it with STRATA_CUDA_CHECK; this header and
// the .cu file stay free of strata's exception machinery. Arguments are already validated by
// the Device wrapper: pointers are device memory, counts > 0, dtypes fp32 / bf16 / fp16 (fp64
// is answered with cudaErrorInvalidValue). Element-wise kernels load their inputs as fp32,
// compute in fp32 and round the result to the destination dtype to nearest even, whatever
// the mix of dtypes, so results match the CPU kernels of src/cpu.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "strata/dtype.h"

namespace strata::gpu {

cudaError_t launch_fill(void* x, DType xt, std::size_t n, float value, cudaStream_t stream);
// y += alpha * x
cudaError_t launch_axpy(float alpha, const void* x, DType xt, void* y, DType yt, std::size_t n,
                        cudaStream_t stream);
// x *= alpha
cudaError_t launch_scale(float alpha, void* x, DType xt, std::size_t n, cudaStream_t stream);
// out = a + b
cudaError_t launch_add(const void* a, DType at, const void* b, DType bt, void* out, DType ot,
                       std::size_t n, cudaStream_t stream);
// dst = src converted; may run in place only when the dtypes are equal.
cudaError_t launch_cast(const void* src, DType st, void* dst, DType dt, std::size_t n,
                        cudaStream_t stream);

// At most this many blocks run pass 1 of sum_squares. Fixed, so the order of additions,
// and hence the result bits, depend on n only (not on the GPU model or its SM count).
inline constexpr unsigned kSumSquaresBlocks = 1024;
// Device scratch launch_sum_squares needs: one fp64 partial sum per pass-1 block.
inline constexpr std::size_t kSumSquaresScratchBytes = kSumSquaresBlocks * sizeof(double);
// out[0] (fp32) = sum(x^2), deterministic and without atomics: pass 1 has each block sum a
// grid-stride slice per thread and tree-reduce it into `scratch`; pass 2 tree-reduces those
// partials in one block in a fixed order. Accumulates in fp64 like the CPU reference
// (cpu::sum_squares), so both backends round the same exact-ish sum once to fp32; on sm_90
// fp64 adds cost nothing next to the memory traffic. `scratch` (kSumSquaresScratchBytes of
// device memory) belongs to the stream: no other stream may use it concurrently.
cudaError_t launch_sum_squares(const void* x, DType xt, std::size_t n, float* out, void* scratch,
                               cudaStream_t stream);

// Holds `stream` until *flag >= target: one thread polls `flag` (8-byte aligned, mapped
// pinned host memory that a host thread advances) with a system-scope acquire load, sleeping
// between polls. This is how a CudaStream waits for a host function run by its own worker
// thread instead of blocking CUDA's shared callback thread.
cudaError_t launch_wait_host_flag(unsigned long long* flag, unsigned long long target,
                                  cudaStream_t stream);

// Loads every kernel above into the current device's context now. With CUDA's lazy module
// loading, a first launch may wait for running kernels; a wait_host_flag kernel that waits
// for a host thread that is itself waiting for that launch would then deadlock.
cudaError_t preload_kernels();

}  // namespace strata::gpu
