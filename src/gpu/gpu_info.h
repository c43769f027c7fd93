// Facts about the CUDA side: versions and visible devices. Safe to call in every build
// (without CUDA compiled in, or without a driver, they say so).
#pragma once

#include <string>
#include <vector>

#include "strata/build_info.h"

namespace strata::gpu {

// cuda runtime, cuda driver, cublas, nccl; "not built" / "no driver" where absent.
std::vector<ComponentVersion> component_versions();
// One line per visible GPU: "cuda:0 NVIDIA H200, 139.8 GiB, sm_90, PCI 0000:19:00.0".
std::vector<std::string> device_descriptions();

}  // namespace strata::gpu
