// The CUDA entry points of a build without the CUDA backend (configured with
// -DSTRATA_CUDA=OFF, or AUTO where no nvcc was found). They answer what a GPU-less machine
// answers, with the reason, so callers need no #ifdefs: probe_cuda() reports zero devices,
// make_cuda_device() throws kUnsupported, and the reports say "not built".
#include "gpu/gpu_info.h"
#include "strata/device.h"
#include "strata/error.h"

namespace strata {
namespace {
constexpr const char* kNotBuilt = "built without CUDA (configure with -DSTRATA_CUDA=ON)";
}  // namespace

CudaProbe probe_cuda() {
  CudaProbe p;
  p.compiled = false;
  p.device_count = 0;
  p.reason = kNotBuilt;
  return p;
}

std::unique_ptr<Device> make_cuda_device(const CudaDeviceOptions&) {
  STRATA_THROW(kUnsupported, "{}", kNotBuilt);
}

namespace gpu {

// The same names as the CUDA build reports, so tools print a stable set of rows.
std::vector<ComponentVersion> component_versions() {
  return {{"cuda", "not built"}, {"cuda driver", "not built"}, {"cublas", "not built"},
          {"nccl", "not built"}};
}

std::vector<std::string> device_descriptions() { return {}; }

}  // namespace gpu
}  // namespace strata
