// Facts about the CUDA side: versions, visible devices, and where the CUDA libraries were
// loaded from. Safe to call in every build (without CUDA compiled in, without the CUDA
// libraries, or without a driver, they say so).
#pragma once

#include <string>
#include <vector>

#include "strata/build_info.h"

namespace strata::gpu {

// cuda runtime, cuda driver, cublas, nccl; "not built" / "not found" / "no driver" where absent.
std::vector<ComponentVersion> component_versions();
// One line per visible GPU: "cuda:0 NVIDIA H200, 139.8 GiB, sm_90, PCI 0000:19:00.0".
std::vector<std::string> device_descriptions();

// The CUDA libraries and the CUDA module in load order, with the file each was loaded from:
// {"libcudart.so.13", "/usr/local/cuda/lib64/libcudart.so.13"}. Loads them if not yet done;
// empty when they could not all be found (probe_cuda().reason says where it looked).
struct LoadedLibrary {
  std::string name;
  std::string path;
};
std::vector<LoadedLibrary> cuda_libraries();

}  // namespace strata::gpu
