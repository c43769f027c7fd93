// The umbrella: device selection at run time and what this build contains.
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "cpu/cpu_info.h"
#include "gpu/gpu_info.h"
#include "strata/build_info.h"
#include "strata/comm.h"
#include "strata/device.h"
#include "strata/error.h"
#include "strata/log.h"
#include "strata/system_info.h"

namespace strata {

void reexec_with_passive_openmp(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr || argv == nullptr || argv[0] == nullptr) return;
  if (::setenv("OMP_WAIT_POLICY", "PASSIVE", 1) != 0) return;
  ::execv("/proc/self/exe", argv);
  // Still here: no /proc, or exec refused. Run on with libgomp's policy as it loaded (the
  // variable stays set, so a child we start gets it).
  log::debug("OMP_WAIT_POLICY=PASSIVE not applied: re-executing {} failed: {}", argv[0],
             std::strerror(errno));
}

std::string strata_version() { return STRATA_VERSION_STRING; }

bool built_with_cuda() { return probe_cuda().compiled; }

std::vector<ComponentVersion> component_versions() {
  std::vector<ComponentVersion> out = gpu::component_versions();
  for (auto& c : cpu::component_versions()) out.push_back(std::move(c));
  out.push_back({"liburing", nvme::probe_io_uring().version});
  return out;
}

// One process per GPU: the launcher's local rank picks the GPU unless the caller chose.
static CudaDeviceOptions with_ordinal(CudaDeviceOptions o, int device_count) {
  if (o.ordinal < 0) o.ordinal = launch_gpu_ordinal(launch_info(), device_count);
  return o;
}

std::unique_ptr<Device> make_device(std::string_view which, const HostDeviceOptions& host,
                                    const CudaDeviceOptions& cuda) {
  if (which == "cpu") return make_host_device(host);
  if (which == "cuda") {
    const CudaProbe p = probe_cuda();
    if (p.device_count == 0)
      STRATA_THROW(kUnsupported, "--device cuda: no usable GPU ({}); use --device cpu or auto",
                   p.reason);
    return make_cuda_device(with_ordinal(cuda, p.device_count));
  }
  if (which == "auto") {
    const CudaProbe p = probe_cuda();
    if (p.device_count > 0) return make_cuda_device(with_ordinal(cuda, p.device_count));
    log::info("no usable GPU ({}); using the CPU-emulated device", p.reason);
    return make_host_device(host);
  }
  STRATA_THROW(kInvalidArgument, "unknown device '{}': use auto, cpu or cuda", which);
}

}  // namespace strata
