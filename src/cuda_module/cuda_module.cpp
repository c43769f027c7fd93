// The CUDA module's one exported symbol: the table the loader (cuda_loader.cpp) asks for after
// it has loaded the CUDA libraries. See cuda_module.h.
#include "gpu/cuda_module.h"

#include <cuda_runtime.h>

#include <tuple>

#include "comm/comm_internal.h"
#include "gpu/cuda_check.h"
#include "gpu/cuda_trace.h"
#include "strata/device.h"

namespace strata::gpu {
namespace {

// The launchers below take a raw stream of any rank's GPU: its device is made current first.
using detail::use_device_of;

// Each launcher behind a wrapper that sets its stream's device current and makes its launch a
// GPU-timed span of the stream's lane while the tracer is on (cuda_trace.h); the stream is
// every launcher's last argument.
#define STRATA_TRACED(fn)                                            \
  static_cast<decltype(&model::fn)>([](auto... args) {               \
    void* stream = std::get<sizeof...(args) - 1>(std::tie(args...)); \
    use_device_of(stream);                                           \
    const GpuSpan span(#fn, stream);                                 \
    return model::fn(args...);                                       \
  })

GemmBest best_gemm_on_its_device(Stream& stream, const MatmulDesc& desc, int max_candidates,
                                 int iters) {
  use_device_of(stream.native_handle());
  return backend::best_cublaslt_gemm(stream, desc, max_candidates, iters);
}

double time_queued_on_its_device_ms(Stream& stream, const std::function<void()>& queue) {
  use_device_of(stream.native_handle());
  const auto s = static_cast<cudaStream_t>(stream.native_handle());
  struct Events {
    cudaEvent_t e[2] = {nullptr, nullptr};
    ~Events() {
      for (cudaEvent_t x : e)
        if (x) (void)cudaEventDestroy(x);
    }
  } ev;
  STRATA_CUDA_CHECK(cudaEventCreate(&ev.e[0]));
  STRATA_CUDA_CHECK(cudaEventCreate(&ev.e[1]));
  STRATA_CUDA_CHECK(cudaEventRecord(ev.e[0], s));
  queue();
  STRATA_CUDA_CHECK(cudaEventRecord(ev.e[1], s));
  STRATA_CUDA_CHECK(cudaEventSynchronize(ev.e[1]));
  float ms = 0;
  STRATA_CUDA_CHECK(cudaEventElapsedTime(&ms, ev.e[0], ev.e[1]));
  return ms;
}

// The variant switch is plain module state, not a launch: no wrapper.
const model::Kernels kModelKernels = {
    &model::error_text,
    &model::set_kernel_variant,
    &model::kernel_variant,
    STRATA_TRACED(embedding_forward),
    STRATA_TRACED(embedding_backward),
    STRATA_TRACED(rmsnorm_forward),
    STRATA_TRACED(rmsnorm_backward),
    STRATA_TRACED(layernorm_forward),
    STRATA_TRACED(layernorm_backward),
    STRATA_TRACED(rope),
    STRATA_TRACED(attention_forward),
    STRATA_TRACED(attention_backward),
    STRATA_TRACED(swiglu_forward),
    STRATA_TRACED(swiglu_backward),
    STRATA_TRACED(gelu_forward),
    STRATA_TRACED(gelu_backward),
    STRATA_TRACED(bias_add),
    STRATA_TRACED(bias_backward),
    STRATA_TRACED(cross_entropy),
};
#undef STRATA_TRACED

const CudaModule kModule = {
    kCudaModuleAbi,
    sizeof(CudaModule),
    STRATA_VERSION_STRING,
    &backend::probe,
    &backend::make_device,
    &backend::component_versions,
    &backend::device_descriptions,
#if defined(STRATA_HAVE_NCCL)
    &comm::create_nccl_communicator,
#else
    nullptr,
#endif
    &kModelKernels,
    &best_gemm_on_its_device,
    &time_queued_on_its_device_ms,
};

}  // namespace
}  // namespace strata::gpu

extern "C" const strata::gpu::CudaModule* strata_cuda_module() { return &strata::gpu::kModule; }
