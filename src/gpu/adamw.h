// Launchers of the fused multi-tensor AdamW on CUDA (adamw.cu), called by CudaStream::do_adamw.
//
// Like cuda_kernels.h: launchers never throw, they return cudaGetLastError() for the caller to
// check, and arguments are already validated by the Device wrapper (strata/device.h).
// The kernel performs the CPU AdamW's element step operation for operation (see
// src/cpu/adamw_kernels.h) with the same fp32 scalars, so the results match bit for bit.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "core/adamw_common.h"

namespace strata::gpu {

// One shard as the kernel sees it.
struct AdamWGpuShard {
  float* params;
  void* m;
  void* v;
  const float* params_src;  // the old params, m, v: params, m, v themselves for an in-place step
  const void* m_src;
  const void* v_src;
  const void* grads;
  void* copy_out;  // nullptr = no copy-out
  std::size_t n;
  DType grad_dtype, state_dtype, copy_dtype;
  float decay = 1.0f;  // 1 - lr * weight_decay, or 1 for a shard weight decay skips
};

// Shards per launch: their table travels in the kernel's parameter space.
inline constexpr int kAdamWShardsPerLaunch = 32;

// Adds the number of NaN/Inf among grads * grad_scale of every shard to *counter.
cudaError_t launch_adamw_count(const AdamWGpuShard* shards, int count, float grad_scale,
                               unsigned long long* counter, cudaStream_t stream);
// Updates every shard. With `skip_if_counted`, does nothing when *counter != 0 (the count
// launches ran before, on the same stream); else adds its own non-finite count to *counter.
cudaError_t launch_adamw_update(const AdamWGpuShard* shards, int count,
                                const detail::AdamWScalars& k, bool skip_if_counted,
                                unsigned long long* counter, cudaStream_t stream);
// Loads the kernels above now (see preload_kernels in cuda_kernels.h for why).
cudaError_t preload_adamw_kernels();
// out[0] = float(*counter).
cudaError_t launch_adamw_report(const unsigned long long* counter, float* out, cudaStream_t stream);

}  // namespace strata::gpu
