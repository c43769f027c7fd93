// The CUDA module's one exported symbol: the table the loader (cuda_loader.cpp) asks for after
// it has loaded the CUDA libraries. See cuda_module.h.
#include "gpu/cuda_module.h"

#include <tuple>

#include "comm/comm_internal.h"
#include "gpu/cuda_trace.h"

namespace strata::gpu {
namespace {

// Each launcher behind a wrapper that makes its launch a GPU-timed span of its stream's lane
// while the tracer is on (cuda_trace.h); the stream is every launcher's last argument.
#define STRATA_TRACED(fn)                                                 \
  static_cast<decltype(&model::fn)>([](auto... args) {                    \
    const GpuSpan span(#fn, std::get<sizeof...(args) - 1>(std::tie(args...))); \
    return model::fn(args...);                                            \
  })

const model::Kernels kModelKernels = {
    &model::error_text,
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
    &backend::best_cublaslt_gemm,
};

}  // namespace
}  // namespace strata::gpu

extern "C" const strata::gpu::CudaModule* strata_cuda_module() { return &strata::gpu::kModule; }
