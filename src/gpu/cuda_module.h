// The boundary between strata and its CUDA backend, which is a separate shared module
// (libstrata_cuda.so: CudaDevice, the CUDA kernels, cuBLAS, the NCCL communicator).
//
// Why a module: the CUDA runtime, cuBLAS and NCCL are not shipped with strata. They are found
// on the target machine at run time (cuda_loader.cpp: STRATA_CUDA_LIBS, the CUDA install, the
// nvidia-* Python wheels, the loader's default path), loaded by full path, and only then is
// the module dlopen'ed; its DT_NEEDED entries resolve to the libraries already loaded. So the
// tools start, and run on the CPU-emulated device, on machines without any of them.
//
// The module exports one C symbol, kCudaModuleEntry, returning a CudaModule table; every
// other symbol of the module is local (a version script), so nothing in it can interpose on
// strata's own libraries, which it links like any other strata code. The table carries C++
// types: host and module come from the same build, which the loader checks (abi and
// version) before using it. This header carries no CUDA types.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gpu/model_kernels.h"
#include "strata/build_info.h"
#include "strata/comm.h"
#include "strata/device.h"
#include "strata/gpu_bench.h"

namespace strata::gpu {

// Raise when CudaModule's layout or meaning changes (model::Kernels included).
inline constexpr int kCudaModuleAbi = 3;
inline constexpr const char* kCudaModuleEntry = "strata_cuda_module";

struct CudaModule {
  int abi;                     // kCudaModuleAbi of the module's build
  std::size_t table_bytes;     // sizeof(CudaModule) in the module's build
  const char* strata_version;  // the module's strata version
  CudaProbe (*probe)();        // the driver's answer, cached
  std::unique_ptr<Device> (*make_device)(const CudaDeviceOptions& options);
  std::vector<ComponentVersion> (*component_versions)();  // cuda, cuda driver, cublas, nccl
  std::vector<std::string> (*device_descriptions)();
  // nullptr when the module was built without NCCL.
  std::unique_ptr<Communicator> (*make_nccl_communicator)(Device& device, double timeout_s);
  const model::Kernels* model_kernels;
  // Times the GEMM `desc` describes (Stream::matmul's operands, layout and types; device
  // buffers of `stream`'s device) with each of up to `max_candidates` cuBLASLt heuristic
  // algorithms, `iters` calls each, on `stream`; blocks; returns the fastest. For
  // strata-bench gpu: our matmul against cuBLAS's best.
  GemmBest (*best_cublaslt_gemm)(Stream& stream, const MatmulDesc& desc, int max_candidates,
                                 int iters);
  // Milliseconds of GPU time between CUDA events recorded on `stream` before and after `queue`
  // queues its work there; blocks until that work is done. For strata-bench gpu's kernel timings.
  double (*time_queued_ms)(Stream& stream, const std::function<void()>& queue);
};

// The module's side (defined in libstrata_cuda.so only).
namespace backend {
CudaProbe probe();
std::unique_ptr<Device> make_device(const CudaDeviceOptions& options);
std::vector<ComponentVersion> component_versions();
std::vector<std::string> device_descriptions();
GemmBest best_cublaslt_gemm(Stream& stream, const MatmulDesc& desc, int max_candidates, int iters);
// After memory the device's allocator does not see was taken (the NCCL communicator's buffers):
// a CudaDevice whose cap is the default measures again, its cap lowered to the free memory now
// (plus what its allocator holds) less the headroom. A no-op for other devices and set caps.
void remeasure_default_capacity(Device& device);
}  // namespace backend

// The host's side (cuda_loader.cpp, in every build): the module's table, loaded on first use
// (thread-safe, once); nullptr when it cannot be loaded, and then cuda_unavailable_reason()
// says why, naming every place that was searched and what to do.
const CudaModule* cuda_module();
const std::string& cuda_unavailable_reason();
// best_cublaslt_gemm, time_queued_ms and the model kernels' variant (strata/gpu_bench.h) call
// the loaded module's table the same way, and throw kUnsupported (with the reason) without one.

}  // namespace strata::gpu

extern "C" {
// Exported by libstrata_cuda.so under the name kCudaModuleEntry.
const strata::gpu::CudaModule* strata_cuda_module();
}
